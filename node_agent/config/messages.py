"""How a refused config value is worded: one table, keyed by the agent's own kinds of problem.

`node_agent.config.validation` finds what is wrong with a document (the kind
of problem, the key, what the key takes, the value) and `refusal` words it;
no message here depends on how a third party words its errors. What a key
takes is a `Takes`, worded by `taken`. No I/O.
"""

from __future__ import annotations

import enum
from typing import Any

from node_agent.errors import InvalidArgument


class Takes(enum.Enum):
    """What a key takes, in words; `{least}` and `{choices}` are filled in by `taken`."""

    POSITIVE_NUMBER = "a positive, finite number"
    NON_NEGATIVE_NUMBER = "a non-negative, finite number"
    NUMBER = "a finite number"
    INTEGER = "an integer"
    NON_NEGATIVE_INTEGER = "a non-negative integer"
    INTEGER_AT_LEAST = "an integer of at least {least}"
    BOOLEAN = "true or false"
    BOOLEAN_OR_NULL = "true, false or null"
    STRING = "a string"
    LIST = "a list"
    MAPPING = "a mapping"
    ONE_OF = "one of {choices}"
    ADDRESS = "HOST:PORT or a port"
    HOSTS = "a list of hosts"


class Problem(enum.Enum):
    """The kinds of refusal, each with its wording; the fields are `refusal`'s keyword arguments."""

    # The document's shape: keys and the values they take.
    UNKNOWN_KEY = "unknown config key {key!r} (known: {known})"
    KEY_NOT_STRING = "config key {key!r}: every key must be a string"
    TOP_KEY_NOT_STRING = "config: every key must be a string"
    NAME_NOT_STRING = "config key {key!r}: every key must be a non-empty string, got {got}"
    WRONG_VALUE = "config key {key!r}: must be {takes}, got {got}"
    TOP_WRONG_VALUE = "config file: the top level must be {takes}, got {got}"
    # Values checked against each other and the node.
    NOT_ABSOLUTE = "{key} must be an absolute path, got {value!r}"
    NOT_CRI_ENDPOINT = "cri-endpoint must be a unix:// URL or HOST:PORT, got {value!r}"
    NOT_CRI_LISTEN = "cri-listen must be a unix:///path URL, got {value!r}"
    NOT_HANDLER_NAME = "runtime-handler {value!r} is not a valid handler name"
    NOT_HOST_PORT = "{key} must be HOST:PORT, got {value!r}"
    NOT_REALM = "{key}: expected a host or host:port, got {value!r}"
    LISTEN_WITHOUT_TLS = "listen {value} needs {missing} (mutual TLS only)"
    # Encryption, signing and restore rules.
    KEY_SOURCE_COUNT = "{key} needs exactly one of file, secret, exec (got {given})"
    KEY_SOURCE_COMMAND = "{key}.exec: the command must be an absolute path"
    KEY_SOURCE_ENV = "{key}.env: only a plugin (exec) has an environment"
    ENV_NAME = "{key}.env: {value!r} is not an environment variable name"
    DOMAIN_NAME = "encryption.domains: {value!r} is not a domain name ([A-Za-z0-9._-], at most 64)"
    DOMAIN_OVERLAP = "encryption.domains: namespace {value!r} is in both {first!r} and {second!r}"
    TRUSTED_KEY = "restore.trusted-keys[{namespace!r}]: {value!r} is neither an absolute path nor ed25519:<base64>"
    # Loading: the file and the flags.
    UNREADABLE_FILE = "cannot read config file {path}: {reason}"
    NOT_YAML = "config file {path} is not valid YAML: {reason}"
    UNKNOWN_SETTINGS = "unknown settings: {names}"


def taken(takes: Takes, *, least: int = 0, choices: tuple[str, ...] = ()) -> str:
    """What a key takes, in words."""
    return takes.value.format(least=least, choices=", ".join(choices))


def refusal(problem: Problem, **fields: Any) -> InvalidArgument:
    """The error for `problem`, its wording filled in with `fields`."""
    return InvalidArgument(problem.value.format(**fields))


def shown(value: Any) -> str:
    """A refused value as messages show it: its repr, cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
