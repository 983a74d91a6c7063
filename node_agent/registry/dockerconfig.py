"""The node's registry logins, from a docker ``config.json`` read the way the kubelet reads its own.

The kubelet takes node-wide pull credentials from ``/var/lib/kubelet/config.json``:
``{"auths": {"host[:port][/path]": {"auth": base64("user:password")}}}``, or an
entry's ``username`` and ``password`` instead (an entry carrying both forms must
have them agree). An image is matched against the keys as the kubelet's
credential keyring does it (pkg/credentialprovider: ``BasicDockerKeyring``,
``URLsMatch``):

* a key loses a leading ``https://`` or ``http://``, and its path a leading
  ``/v1/`` or ``/v2/``: ``https://index.docker.io/v1/`` is ``index.docker.io``;
* the port must be the image's exactly (no port matches only no port); the host
  must have as many dot-separated parts as the image's, each matched as a glob
  (``*.example.com`` matches ``a.example.com``, not ``a.b.example.com``); the
  key's path must be a prefix of the image's path, as strings;
* of the keys that match, the first in reverse lexical order wins, so the more
  specific one (``quay.io/team`` before ``quay.io``, ``a.example.com`` before
  ``*.example.com``);
* the image is first normalised as the kubelet does: tag and digest are dropped,
  a name without a registry is on ``docker.io`` (``busybox`` is
  ``docker.io/library/busybox``) and ``index.docker.io`` is ``docker.io``; a
  ``docker.io`` image that no key matches takes the ``index.docker.io`` login.

Host names and globs compare with case, as in the kubelet. Two departures, both
refusals: the kubelet also gives the ``index.docker.io`` login to a registry
named without a dot (``localhost/app``), which sends a Docker Hub password to
another host, so here only ``docker.io`` images get it; and a key the kubelet
would parse loosely (a user, query, fragment or percent-escape in it, an empty
port, an IPv6 host without a port, which never matches there) is skipped.

Rule: only ``auths`` is read. ``credsStore`` and ``credHelpers`` are not
supported and no helper is ever run: each is named in one warning. The file is
hostile input: one over ``MAX_CONFIG_BYTES``, not JSON or not of the expected
shape gives no logins; an entry that cannot be used (wrong types, bad base64, an
``auth`` without ``:``, CR, LF or NUL in the login, ``:`` in the username,
forms that disagree, a key that names no registry) is skipped with a warning
naming its key, and the other entries are kept. A missing file means no logins;
an unreadable one, a warning and none. The file is read again only when its
(mtime, size, inode) changes. Passwords never reach a log record, a ``repr`` or
an error message.
"""

from __future__ import annotations

import base64
import binascii
import errno
import ipaddress
import json
import logging
import os
import re
import stat
import threading
from dataclasses import dataclass, field

from node_agent.errors import InvalidArgument
from node_agent.registry.auth import Credentials
from node_agent.registry.reference import MAX_REFERENCE_LENGTH, is_port, is_printable
from node_agent.store.files import read_upto

log = logging.getLogger(__name__)

MAX_CONFIG_BYTES = 1 << 20
"""Largest config file read; a larger one gives no logins."""

DEFAULT_REGISTRY = "docker.io"
"""Where an image named without a registry lives."""

LEGACY_DEFAULT_REGISTRY = "index.docker.io"
"""Docker Hub's older name: an image's registry becomes ``docker.io``; this key's login is Docker Hub's."""

UNSUPPORTED_KEYS = ("credsStore", "credHelpers")
"""Top-level keys that name credential helpers, which are never run."""

# Not a reference's host grammar (reference.py), on purpose: a key's host may be a glob (``*``, ``[a-z]``),
# and a bracketed IPv6 host is taken as the kubelet takes it, a zone allowed.
_HOST_CHARS = re.compile(r"[A-Za-z0-9\-_.*\[\]]+", re.ASCII)
_BRACKETED = re.compile(r"\[([^\]]*)\](?::([0-9]*))?", re.ASCII)
_REPOSITORY = re.compile(r"[a-z0-9._\-]+(?:/[a-z0-9._\-]+)*", re.ASCII)
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}", re.ASCII)


@dataclass(frozen=True)
class Login:
    """A username and password for one registry. ``repr`` hides the password."""

    username: str
    password: str = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.username, str) or not isinstance(self.password, str):
            raise InvalidArgument("a registry login is a username and a password, both strings")
        if not self.username:
            raise InvalidArgument("a registry login needs a username")
        Credentials(self.username, self.password).check()  # no ':' in the username, no CR, LF or NUL


def _glob(pattern: str) -> re.Pattern[str] | None:
    """One host part as Go's ``filepath.Match`` reads it (``*`` and ``[a-z]`` classes); None if malformed."""
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        ch = pattern[i]
        i += 1
        if ch == "*":
            out.append("[^/]*")
        elif ch != "[":
            out.append(re.escape(ch))
        else:
            ranges: list[tuple[str, str]] = []
            while not (i < n and pattern[i] == "]" and ranges):
                if i >= n or pattern[i] in "-]":
                    return None
                lo = hi = pattern[i]
                i += 1
                if i < n and pattern[i] == "-":
                    if i + 1 >= n or pattern[i + 1] in "-]":
                        return None
                    hi, i = pattern[i + 1], i + 2
                ranges.append((lo, hi))
            i += 1
            # A range whose ends are reversed matches nothing, as in Go.
            alternatives = [f"[{re.escape(lo)}-{re.escape(hi)}]" for lo, hi in ranges if lo <= hi]
            out.append("(?:" + "|".join(alternatives) + ")" if alternatives else "(?!)")
    return re.compile("".join(out), re.ASCII)


@dataclass(frozen=True)
class _Key:
    """One ``auths`` key, normalised: ``text`` is the kubelet's index string, ``host[:port][/path]``."""

    text: str
    parts: tuple[re.Pattern[str], ...]
    port: str
    path: str

    def matches(self, parts: tuple[str, ...], port: str, path: str) -> bool:
        """The kubelet's ``URLsMatch``: same port, as many host parts, path prefix, each part a glob."""
        if port != self.port or len(parts) != len(self.parts) or not path.startswith(self.path):
            return False
        return all(glob.fullmatch(part) is not None for glob, part in zip(self.parts, parts))


def _show_key(key: str) -> str:
    """A key, printable and short, with anything that might be a secret (user, query) cut out."""
    text = key.split("?", 1)[0].split("#", 1)[0]
    if len(text) < len(key):
        text += "?..."
    scheme, sep, rest = text.rpartition("://")
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = "...@" + authority.rpartition("@")[2]
    shown = repr(scheme + sep + authority + slash + path)
    return shown if len(shown) <= 100 else shown[:97] + "..."


def _parse_key(raw: str) -> _Key | str:
    """The normalised key, or why the key names no registry."""
    if not raw:
        return "the key is empty"
    if len(raw) > MAX_REFERENCE_LENGTH or not is_printable(raw):
        return "the key has spaces, control or non-ASCII characters, or is too long"
    text = raw
    for scheme in ("https://", "http://"):
        if text.startswith(scheme):
            text = text[len(scheme) :]
            break
    for mark, what in (
        ("://", "a scheme other than https or http"),
        ("@", "a user"),
        ("?", "a query"),
        ("#", "a fragment"),
        ("%", "a percent-escape"),
        ("\\", "a backslash"),
    ):
        if mark in text:
            return f"the key has {what}"
    authority, slash, path = text.partition("/")
    path = slash + path
    if path.startswith(("/v1/", "/v2/")):
        path = path[3:]
    if path == "/":
        path = ""
    if authority.startswith("["):
        m = _BRACKETED.fullmatch(authority)
        if m is None:
            return "the key's IPv6 host is malformed"
        host, port = m.group(1), m.group(2)
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return "the key's bracketed host is not an IPv6 address"
        if port is None:
            return "the key's IPv6 host has no port (the kubelet never matches one without)"
    else:
        host, colon, port = authority.partition(":")
        if _HOST_CHARS.fullmatch(host) is None:
            return "the key's host has a character other than letters, digits, '-', '_', '.', '*', '[' and ']'"
        if "" in host.split("."):
            return "the key's host has an empty part"
        if not colon:
            port = None
    if port is not None and not is_port(port):
        return "the key's port is not a number from 1 to 65535"
    labels = host.split(".")
    globs = [_glob(label) for label in labels]
    if any(glob is None for glob in globs):
        return "the key's host has a malformed glob"
    return _Key(authority + path, tuple(g for g in globs if g is not None), port or "", path)


def _decode_auth(text: str) -> tuple[str, str] | str:
    """``auth``'s username and password, or why it cannot be read (padded or unpadded base64, as Go takes it)."""
    if _BASE64.fullmatch(text) is None or len(text) % 4 == 1 or (text.endswith("=") and len(text) % 4):
        return '"auth" is not base64'
    try:
        decoded = base64.b64decode(text + "=" * (-len(text) % 4), validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return '"auth" is not base64 of UTF-8 text'
    username, colon, password = decoded.partition(":")
    if not colon:
        return '"auth" has no \':\' between username and password'
    return username, password


def _parse_entry(entry: object) -> Login | str:
    """The login of one ``auths`` entry, or why it cannot be used."""
    if not isinstance(entry, dict):
        return "the entry is not a JSON object"
    given: dict[str, str] = {}
    for name in ("auth", "username", "password", "email"):
        value = entry.get(name)
        if value is not None and not isinstance(value, str):
            return f'"{name}" is not a string'
        if value:  # the kubelet reads an empty string as absent
            given[name] = value
    if "auth" in given:
        decoded = _decode_auth(given["auth"])
        if isinstance(decoded, str):
            return decoded
        for name, value in zip(("username", "password"), decoded):
            if name in given and given[name] != value:
                return f'"{name}" and "auth" disagree'
        username, password = decoded
    else:
        username, password = given.get("username", ""), given.get("password", "")
    try:
        return Login(username, password)
    except InvalidArgument as exc:
        return str(exc)


def _split_image(image: str) -> tuple[str, tuple[str, ...], str, str]:
    """``image`` normalised as the kubelet normalises it: (registry, host parts, port, path)."""
    if not isinstance(image, str):
        raise InvalidArgument(f"an image is a string, not {type(image).__name__}")
    if not image or len(image) > MAX_REFERENCE_LENGTH or not is_printable(image):
        raise InvalidArgument("an image must be 1 to 1024 printable ASCII characters")
    shown = repr(image) if len(image) <= 80 else repr(image[:77] + "...")
    name = image.partition("@")[0]
    colon = name.rfind(":")
    if colon > name.rfind("/"):
        name = name[:colon]
    first, slash, rest = name.partition("/")
    if not slash or (not any(ch in first for ch in ".:") and first != "localhost" and first == first.lower()):
        registry, repository = DEFAULT_REGISTRY, name
    else:
        registry, repository = first, rest
    if registry == LEGACY_DEFAULT_REGISTRY:
        registry = DEFAULT_REGISTRY
    if registry == DEFAULT_REGISTRY and "/" not in repository:
        repository = "library/" + repository
    if _REPOSITORY.fullmatch(repository) is None:
        raise InvalidArgument(f"image {shown}: the repository must be lowercase names separated by '/'")
    m = _BRACKETED.fullmatch(registry)
    if m is not None:
        host, port = m.group(1), m.group(2)
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise InvalidArgument(f"image {shown}: the bracketed registry host is not an IPv6 address") from None
        if port is None:
            host = registry  # as Go's SplitHostPort leaves a bracketed host without a port
    else:
        host, sep, port = registry.partition(":")
        if _HOST_CHARS.fullmatch(host) is None or any(ch in host for ch in "*[]") or "" in host.split("."):
            raise InvalidArgument(f"image {shown}: bad registry host")
        port = port if sep else None
    if port is not None and not is_port(port):
        raise InvalidArgument(f"image {shown}: the registry port is not a number from 1 to 65535")
    return registry, tuple(host.split(".")), port or "", "/" + repository


_Signature = tuple[int, int, int]


class NodeCredentials:
    """The logins of one config.json file, re-read when the file changes (mtime, size, inode).

    Thread-safe: lookups share one lock, and the file is read under it.
    """

    def __init__(self, path: str) -> None:
        if not isinstance(path, str) or not path or "\0" in path:
            raise InvalidArgument("the registry config path must be a non-empty string without NUL")
        self._path = path
        self._lock = threading.Lock()
        self._signature: _Signature | None = None
        self._keys: tuple[_Key, ...] = ()
        self._logins: dict[str, Login] = {}
        self._problem: tuple[str, int] | None = None
        self._named: set[str] = set()

    def __repr__(self) -> str:
        return f"NodeCredentials({self._path!r})"

    @property
    def path(self) -> str:
        return self._path

    def lookup(self, image: str) -> Login | None:
        """The login for ``image`` (``host[:port]/repository``, a tag or digest allowed), or None.

        Raises InvalidArgument if ``image`` is not an image name.
        """
        registry, parts, port, path = _split_image(image)
        with self._lock:
            self._refresh()
            for key in self._keys:
                if key.matches(parts, port, path):
                    return self._logins[key.text]
            if registry == DEFAULT_REGISTRY:
                return self._logins.get(LEGACY_DEFAULT_REGISTRY)
        return None

    # -- reading the file (all under the lock) ----------------------------------------------

    def _install(self, signature: _Signature | None, keys: dict[str, _Key], logins: dict[str, Login]) -> None:
        self._signature = signature
        self._keys = tuple(sorted(keys.values(), key=lambda k: k.text, reverse=True))
        self._logins = logins
        self._problem = None

    def _fail(self, problem: tuple[str, int], text: str) -> None:
        """No logins, the file tried again on the next lookup; the same problem is told only once."""
        told = self._problem
        self._install(None, {}, {})
        if problem != told:
            log.warning("registry logins: %s %s; no logins are used", self._path, text)
        self._problem = problem

    def _warn(self, text: str) -> None:
        log.warning("registry logins: %s %s", self._path, text)

    def _os_error(self, step: str, exc: OSError) -> None:
        """``step`` (``stat``, ``open`` or ``read``) failed: no logins, and a warning told once.

        A file missing when it is looked up or opened is no problem: no logins, and no warning.
        """
        if step != "read" and isinstance(exc, (FileNotFoundError, NotADirectoryError)):
            self._install(None, {}, {})
        else:
            what = "cannot be examined" if step == "stat" else "cannot be read"
            self._fail((step, exc.errno or 0), f"{what} ({_errno_name(exc)})")

    def _refresh(self) -> None:
        try:
            st = os.stat(self._path)
        except OSError as exc:
            self._os_error("stat", exc)
            return
        if (st.st_mtime_ns, st.st_size, st.st_ino) != self._signature:
            self._read()

    def _read(self) -> None:
        try:
            fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
        except OSError as exc:
            self._os_error("open", exc)
            return
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                self._fail(("kind", stat.S_IFMT(st.st_mode)), "is not a regular file")
                return
            data = b"" if st.st_size > MAX_CONFIG_BYTES else read_upto(fd, MAX_CONFIG_BYTES + 1)
        except OSError as exc:
            self._os_error("read", exc)
            return
        finally:
            os.close(fd)
        signature = (st.st_mtime_ns, st.st_size, st.st_ino)
        if st.st_size > MAX_CONFIG_BYTES or len(data) > MAX_CONFIG_BYTES:
            self._warn(f"is larger than {MAX_CONFIG_BYTES} bytes; no logins are used")
            self._install(signature, {}, {})
            return
        self._install(signature, *self._parse(data))

    def _parse(self, data: bytes) -> tuple[dict[str, _Key], dict[str, Login]]:
        keys: dict[str, _Key] = {}
        logins: dict[str, Login] = {}
        try:
            doc = json.loads(data.decode("utf-8"))
        except UnicodeDecodeError:
            self._warn("is not UTF-8 text; no logins are used")
            return keys, logins
        except json.JSONDecodeError as exc:
            self._warn(f"is not JSON (line {exc.lineno}, column {exc.colno}); no logins are used")
            return keys, logins
        except (ValueError, RecursionError):
            self._warn("is not JSON that can be read; no logins are used")
            return keys, logins
        if not isinstance(doc, dict):
            self._warn("is not a JSON object; no logins are used")
            return keys, logins
        for name in UNSUPPORTED_KEYS:
            if name in doc and name not in self._named:
                self._named.add(name)
                self._warn(f'has "{name}": credential helpers are not supported and never run; only "auths" is read')
        auths = doc.get("auths")
        if auths is None:
            return keys, logins
        if not isinstance(auths, dict):
            self._warn('has an "auths" that is not a JSON object; no logins are used')
            return keys, logins
        for raw, entry in auths.items():
            key = _parse_key(raw)
            if isinstance(key, str):
                self._warn(f"entry {_show_key(raw)} skipped: {key}")
                continue
            login = _parse_entry(entry)
            if isinstance(login, str):
                self._warn(f"entry {_show_key(raw)} skipped: {login}")
            elif key.text in logins:
                self._warn(f"entry {_show_key(raw)} skipped: it names the registry of an earlier entry, {key.text!r}")
            else:
                keys[key.text], logins[key.text] = key, login
        return keys, logins


def _errno_name(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno, type(exc).__name__) if exc.errno else type(exc).__name__
