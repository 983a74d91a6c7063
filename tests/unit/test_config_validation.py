"""The config validation pass: every kind of refusal, its exact key path, and wording from the agent's own table."""

from __future__ import annotations

import re
import string
from pathlib import Path
from typing import Any

import msgspec
import pytest

from node_agent.config import validation
from node_agent.config.loading import from_mapping, load, parse_registry
from node_agent.config.messages import Problem, Takes, refusal, shown, taken
from node_agent.config.schema import Document, KeySource, NamespaceRule, RegistrySettings, Settings
from node_agent.errors import InvalidArgument

# (document, the exact message): one or more for every kind of problem a document can have.
REFUSALS: list[tuple[Any, str, Problem | None]] = [
    ({"bogus": 1}, "unknown config key 'bogus' (known: " + ", ".join(sorted(f.encode_name for f in msgspec.structs.fields(Document))) + ")", Problem.UNKNOWN_KEY),
    ({"devices": {"nope": 1}}, "unknown config key 'devices.nope' (known: api-timeout, check-link-speed, clear-seconds, "
     "enabled, escalate-after, kubeconfig, max-effect, node-name, poll-interval, raise-polls, resync-interval, taints, "
     "temperature-margin, temperature-max, write-burst, write-rate, xid-ignore)", Problem.UNKNOWN_KEY),
    ({"encryption": {"key-sources": [{"file": "/k"}, {"file": "/k", "bogus": 1}]}},
     "unknown config key 'encryption.key-sources[1].bogus' (known: env, exec, file, secret, timeout)", Problem.UNKNOWN_KEY),
    ({"namespaces": {"ns": {"bogus": True}}},
     "unknown config key \"namespaces['ns'].bogus\" (known: checkpoint, restore)", Problem.UNKNOWN_KEY),
    ({"authorization": [{"identities": ["a"], "methods": ["*"], "namespaces": ["*"], "x": 1}]},
     "unknown config key 'authorization[0].x' (known: identities, methods, namespaces)", None),
    ({1: 2}, "config: every key must be a string", Problem.TOP_KEY_NOT_STRING),
    ({"devices": {1: 2}}, "config key 'devices': every key must be a string", Problem.KEY_NOT_STRING),
    ({"encryption": {"key-sources": [{None: 1}]}}, "config key 'encryption.key-sources[0]': every key must be a string",
     Problem.KEY_NOT_STRING),
    ({"namespaces": {"ns": {1: True}}}, "config key \"namespaces['ns']\": every key must be a string", Problem.KEY_NOT_STRING),
    ({"encryption": {"domains": {"": ["a"]}}}, "config key 'encryption.domains': every key must be a non-empty string, got ''",
     Problem.NAME_NOT_STRING),
    ({"restore": {"pod-sources": {3: ["a"]}}}, "config key 'restore.pod-sources': every key must be a non-empty string, got 3",
     Problem.NAME_NOT_STRING),
    (["a"], "config file: the top level must be a mapping, got ['a']", Problem.TOP_WRONG_VALUE),
    ({"timeouts": 5}, "config key 'timeouts': must be a mapping, got 5", Problem.WRONG_VALUE),
    ({"timeouts": {"cleanup": 0}}, "config key 'timeouts.cleanup': must be a positive, finite number, got 0", Problem.WRONG_VALUE),
    ({"timeouts": {"cleanup": True}}, "config key 'timeouts.cleanup': must be a positive, finite number, got True",
     Problem.WRONG_VALUE),
    ({"devices": {"clear-seconds": float("inf")}},
     "config key 'devices.clear-seconds': must be a non-negative, finite number, got inf", Problem.WRONG_VALUE),
    ({"devices": {"temperature-max": 2**1100}},
     "config key 'devices.temperature-max': must be a positive, finite number, got " + shown(2**1100), Problem.WRONG_VALUE),
    ({"devices": {"raise-polls": 0}}, "config key 'devices.raise-polls': must be an integer of at least 1, got 0",
     Problem.WRONG_VALUE),
    ({"retention": {"gc-interval": 1.5}}, "config key 'retention.gc-interval': must be a non-negative integer, got 1.5",
     Problem.WRONG_VALUE),
    ({"devices": {"xid-ignore": [13, "x"]}}, "config key 'devices.xid-ignore[1]': must be an integer, got 'x'",
     Problem.WRONG_VALUE),
    ({"devices": {"xid-ignore": 13}}, "config key 'devices.xid-ignore': must be a list, got 13", Problem.WRONG_VALUE),
    ({"devices": {"taints": "yes"}}, "config key 'devices.taints': must be true or false, got 'yes'", Problem.WRONG_VALUE),
    ({"namespaces": {"*": {"restore": 1}}},
     "config key \"namespaces['*'].restore\": must be true, false or null, got 1", Problem.WRONG_VALUE),
    ({"store": 5}, "config key 'store': must be a string, got 5", Problem.WRONG_VALUE),
    ({"devices": {"max-effect": "Evict"}},
     "config key 'devices.max-effect': must be one of None, NoSchedule, NoExecute, got 'Evict'", Problem.WRONG_VALUE),
    ({"metrics-listen": [9100]}, "config key 'metrics-listen': must be HOST:PORT or a port, got [9100]", Problem.WRONG_VALUE),
    ({"registry": {"token-realms": "auth.example"}},
     "config key 'registry.token-realms': must be a list of hosts, got 'auth.example'", Problem.WRONG_VALUE),
    ({"encryption": {"domains": {"d": "ns"}}}, "config key \"encryption.domains['d']\": must be a list, got 'ns'",
     Problem.WRONG_VALUE),
    ({"restore": {"trusted-keys": {"ns": ["/k", 7]}}},
     "config key \"restore.trusted-keys['ns'][1]\": must be a string, got 7", Problem.WRONG_VALUE),
    ({"namespaces": {"ns": "yes"}}, "config key \"namespaces['ns']\": must be a mapping, got 'yes'", Problem.WRONG_VALUE),
    ({"encryption": {"key-sources": [5]}}, "config key 'encryption.key-sources[0]': must be a mapping, got 5",
     Problem.WRONG_VALUE),
    ({"store": "rel"}, "store must be an absolute path, got 'rel'", Problem.NOT_ABSOLUTE),
    ({"signing": {"key-file": "k.pem"}}, "signing.key-file must be an absolute path, got 'k.pem'", Problem.NOT_ABSOLUTE),
    ({"encryption": {"key-sources": [{"secret": "s"}]}},
     "encryption.key-sources[0].secret must be an absolute path, got 's'", Problem.NOT_ABSOLUTE),
    ({"cri-endpoint": "nowhere"}, "cri-endpoint must be a unix:// URL or HOST:PORT, got 'nowhere'", Problem.NOT_CRI_ENDPOINT),
    ({"cri-listen": "unix://x"}, "cri-listen must be a unix:///path URL, got 'unix://x'", Problem.NOT_CRI_LISTEN),
    ({"runtime-handler": "a b"}, "runtime-handler 'a b' is not a valid handler name", Problem.NOT_HANDLER_NAME),
    ({"health-listen": 70000}, "health-listen must be HOST:PORT, got '70000'", Problem.NOT_HOST_PORT),
    ({"registry": {"token-realms": ["a/b"]}}, "registry.token-realms: expected a host or host:port, got 'a/b'",
     Problem.NOT_REALM),
    ({"listen": "0.0.0.0:9443", "tls-cert": "/c"}, "listen 0.0.0.0:9443 needs tls-key, tls-client-ca (mutual TLS only)",
     Problem.LISTEN_WITHOUT_TLS),
    ({"encryption": {"key-sources": [{}]}}, "encryption.key-sources[0] needs exactly one of file, secret, exec (got none)",
     Problem.KEY_SOURCE_COUNT),
    ({"encryption": {"key-sources": [{"exec": ["kms"]}]}}, "encryption.key-sources[0].exec: the command must be an absolute path",
     Problem.KEY_SOURCE_COMMAND),
    ({"encryption": {"key-sources": [{"file": "/k", "env": ["A"]}]}},
     "encryption.key-sources[0].env: only a plugin (exec) has an environment", Problem.KEY_SOURCE_ENV),
    ({"encryption": {"key-sources": [{"exec": ["/kms"], "env": ["1A"]}]}},
     "encryption.key-sources[0].env: '1A' is not an environment variable name", Problem.ENV_NAME),
    ({"encryption": {"domains": {"a b": ["x"]}}},
     "encryption.domains: 'a b' is not a domain name ([A-Za-z0-9._-], at most 64)", Problem.DOMAIN_NAME),
    ({"encryption": {"domains": {"a": ["x"], "b": ["x"]}}}, "encryption.domains: namespace 'x' is in both 'a' and 'b'",
     Problem.DOMAIN_OVERLAP),
    ({"restore": {"trusted-keys": {"ns": ["k.pem"]}}},
     "restore.trusted-keys['ns']: 'k.pem' is neither an absolute path nor ed25519:<base64>", Problem.TRUSTED_KEY),
]


@pytest.mark.parametrize("doc, message, problem", REFUSALS, ids=[m[:60] for _, m, _ in REFUSALS])
def test_each_refusal_names_the_exact_key(doc: Any, message: str, problem: Problem | None) -> None:
    with pytest.raises(InvalidArgument) as e:
        from_mapping(doc)
    assert str(e.value) == message
    if problem is not None:
        assert _template(problem).fullmatch(message), (problem, message)


def test_every_kind_of_document_problem_is_covered() -> None:
    loading = {Problem.UNREADABLE_FILE, Problem.NOT_YAML, Problem.UNKNOWN_SETTINGS}
    assert {p for _, _, p in REFUSALS if p is not None} == set(Problem) - loading


def _template(problem: Problem) -> re.Pattern[str]:
    """The message table's wording for `problem`, its fields as wildcards."""
    parts = string.Formatter().parse(problem.value)
    return re.compile("".join(re.escape(text) + (".*" if name is not None else "") for text, name, _, _ in parts), re.S)


def _sections() -> list[tuple[str, Any, list[str]]]:
    """Every mapping of the schema: where it is in a document, a document holding it, its keys."""
    out: list[tuple[str, Any, list[str]]] = [("", {}, sorted(f.encode_name for f in msgspec.structs.fields(Document)))]
    for f in msgspec.structs.fields(Document):
        kind = f.type
        if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
            out.append((f.encode_name, {}, sorted(g.encode_name for g in msgspec.structs.fields(kind))))
    out.append(("encryption.key-sources[0]", {"file": "/k"}, sorted(g.encode_name for g in msgspec.structs.fields(KeySource))))
    out.append(("namespaces['ns']", {}, sorted(g.encode_name for g in msgspec.structs.fields(NamespaceRule))))
    return out


def _placed(where: str, section: dict[str, Any]) -> dict[str, Any]:
    if where == "":
        return section
    if where == "encryption.key-sources[0]":
        return {"encryption": {"key-sources": [section]}}
    if where == "namespaces['ns']":
        return {"namespaces": {"ns": section}}
    return {where: section}


@pytest.mark.parametrize("where, base, known", _sections(), ids=[w or "top" for w, _, _ in _sections()])
def test_unknown_keys_are_refused_at_every_level(where: str, base: dict[str, Any], known: list[str]) -> None:
    key = f"{where}.surplus" if where else "surplus"
    with pytest.raises(InvalidArgument) as e:
        from_mapping(_placed(where, {**base, "surplus": 1}))
    assert str(e.value) == f"unknown config key {key!r} (known: {', '.join(known)})"
    # The first bad key of a mapping is the one reported, in the document's order.
    with pytest.raises(InvalidArgument, match="surplus"):
        from_mapping(_placed(where, {**base, "surplus": 1, "another": 2}))


def test_the_registry_section_alone_names_its_keys_under_registry() -> None:
    assert parse_registry({"min-rate": 10}) == RegistrySettings(min_rate=10.0)
    with pytest.raises(InvalidArgument, match=r"^config key 'registry\.io-timeout': must be a positive, finite number, got -1$"):
        parse_registry({"io-timeout": -1})
    with pytest.raises(InvalidArgument, match=r"^unknown config key 'registry\.bogus'"):
        parse_registry({"bogus": 1})
    with pytest.raises(InvalidArgument, match=r"^config key 'registry': must be a mapping, got 5$"):
        parse_registry(5)


def test_what_passes_is_converted_as_the_schema_says() -> None:
    s = from_mapping({"timeouts": {"cleanup": 5}, "health-listen": 9100, "devices": {"xid-ignore": [1, 2]},
                      "registry": {"token-realms": ["Auth.Example", "auth.example:443"]},
                      "encryption": {"domains": {"d": ["a", "b"]}}, "namespaces": {"ns": {"restore": False}}})
    assert s.timeouts.cleanup == 5.0 and isinstance(s.timeouts.cleanup, float)
    assert s.health_listen == "9100" and s.devices.xid_ignore == (1, 2)
    assert s.registry.token_realms == ("auth.example:443",)
    assert dict(s.encryption.domains) == {"d": ("a", "b")}
    assert s.namespaces["ns"] == NamespaceRule(restore=False)
    # What the pass built reads back to the same settings.
    assert parse_registry(s.registry.as_mapping()) == s.registry


def test_no_message_comes_from_msgspec(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The pass never asks msgspec to check a value: with msgspec's conversion gone, every refusal reads the same."""
    def gone(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("msgspec.convert called")

    monkeypatch.setattr(msgspec, "convert", gone)
    for doc, message, _ in REFUSALS:
        with pytest.raises(InvalidArgument) as e:
            from_mapping(doc)
        assert str(e.value) == message
    cfg = tmp_path / "c.yaml"
    cfg.write_text("devices:\n  raise-polls: 0\n")
    with pytest.raises(InvalidArgument, match=r"^config key 'devices\.raise-polls': must be an integer of at least 1, got 0$"):
        load(str(cfg))
    assert load(None, {"log_level": "debug"}).log_level == "debug"


def test_messages_are_the_tables() -> None:
    assert taken(Takes.INTEGER_AT_LEAST, least=3) == "an integer of at least 3"
    assert taken(Takes.ONE_OF, choices=("a", "b")) == "one of a, b"
    assert str(refusal(Problem.WRONG_VALUE, key="k", takes="a string", got="5")) == "config key 'k': must be a string, got 5"
    assert shown("x" * 100) == repr("x" * 100)[:77] + "..."
    # Every wording the pass produces is a row of the table: none is formatted anywhere else.
    source = Path(validation.__file__).read_text()
    assert "InvalidArgument(" not in source and 'f"config key' not in source


def test_flags_are_checked_by_the_same_pass() -> None:
    with pytest.raises(InvalidArgument, match=r"^config key 'metrics-listen': must be HOST:PORT or a port, got True$"):
        load(None, {"metrics_listen": True})
    with pytest.raises(InvalidArgument, match="^unknown settings: nope, other$"):
        load(None, {"nope": 1, "other": 2})
    assert load(None, {"store": "/srv", "socket": None}) == Settings(store="/srv")
