"""Encryption keys: which key domain a namespace is in, and the domains' keys from their sources.

Rule: keys come only from the configured sources (docs/security.md), in
their order of precedence: for each domain, the first source that has it
supplies the key new checkpoints use (its first key: the newest); a key id
is looked up in every source, the first that has it winning. A keyring file
or mounted Secret is re-read when it changes (checked at most once a
second), a KMS plugin at start, before a checkpoint is sealed once
``refresh-interval`` has passed since its last run (never in the middle of
reading blobs), and when a key id is asked for that no source has (at most
once per ``_MISS_RETRY`` seconds). A source
that stops reading keeps its last good keys and says why in the log; one
that has never read refuses to let a checkpoint of any domain go out in the
clear. Key bytes are never logged or shown.

The keyring document (YAML or JSON; unknown keys are refused)::

    domains:
      team-a:                  # a domain (encryption.domains names groups of namespaces)
        - id: team-a-2026-12   # newest first: new checkpoints use this one
          key: <base64 of 32 random bytes>
        - id: team-a-2026-06   # older: still opens what it sealed
          key: ...
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any, Final

import msgspec

from node_agent import errors
from node_agent.config import Encryption, KeySource
from node_agent.store.sealing import KEY_BYTES, KEY_ID_RE, SealKey

log = logging.getLogger(__name__)

SECRET_ITEM: Final = "keyring.yaml"
MAX_KEYRING_BYTES: Final = 1 << 20
MAX_KEYS: Final = 4096
_STAT_EVERY: Final = 1.0
_MISS_RETRY: Final = 10.0


def parse_keyring(data: bytes, where: str) -> dict[str, tuple[SealKey, ...]]:
    """A keyring document's domains and their keys (newest first); InvalidArgument naming ``where`` otherwise."""
    if len(data) > MAX_KEYRING_BYTES:
        raise errors.InvalidArgument(f"keyring {where}: over {MAX_KEYRING_BYTES} bytes")
    try:
        doc: Any = msgspec.yaml.decode(data) if data.strip() else {}
    except msgspec.DecodeError as exc:
        raise errors.InvalidArgument(f"keyring {where} is not valid YAML or JSON: {exc}") from None
    if not isinstance(doc, dict) or set(doc) - {"domains"}:
        raise errors.InvalidArgument(f"keyring {where}: want a mapping with the one key 'domains'")
    domains = doc.get("domains") or {}
    if not isinstance(domains, dict):
        raise errors.InvalidArgument(f"keyring {where}: domains must be a mapping of domain names to key lists")
    out: dict[str, tuple[SealKey, ...]] = {}
    seen: set[str] = set()
    for name, items in domains.items():
        if not isinstance(name, str) or not KEY_ID_RE.fullmatch(name):
            raise errors.InvalidArgument(f"keyring {where}: {name!r} is not a domain name")
        if not isinstance(items, list) or not items:
            raise errors.InvalidArgument(f"keyring {where}: domain {name!r} needs a non-empty list of keys")
        keys = []
        for i, item in enumerate(items):
            at = f"keyring {where}: domains.{name}[{i}]"
            if not isinstance(item, dict) or set(item) != {"id", "key"}:
                raise errors.InvalidArgument(f"{at}: want exactly the keys id and key")
            kid, text = item["id"], item["key"]
            if not isinstance(kid, str) or not KEY_ID_RE.fullmatch(kid):
                raise errors.InvalidArgument(f"{at}: id {kid!r}: want 1-64 of [A-Za-z0-9._-], starting alphanumeric")
            if kid in seen:
                raise errors.InvalidArgument(f"{at}: key id {kid} is given twice (ids are unique across domains)")
            seen.add(kid)
            try:
                secret = base64.b64decode(text, validate=True) if isinstance(text, str) else b""
            except (binascii.Error, ValueError):
                secret = b""
            if len(secret) != KEY_BYTES:
                raise errors.InvalidArgument(f"{at}: key {kid} is not the base64 of {KEY_BYTES} bytes")
            keys.append(SealKey(kid, secret, name))
        out[name] = tuple(keys)
    if len(seen) > MAX_KEYS:
        raise errors.InvalidArgument(f"keyring {where}: {len(seen)} keys, at most {MAX_KEYS}")
    return out


class _Source:
    """One configured source and the keys it last read."""

    def __init__(self, config: KeySource, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self.domains: dict[str, tuple[SealKey, ...]] = {}
        self.loaded = False
        self.problem = ""
        self._stamp: tuple[int, int, int, int] | None = None
        self._checked = -1e18
        self._ran = -1e18

    @property
    def path(self) -> str:
        c = self.config
        return c.file if c.file else os.path.join(c.secret, SECRET_ITEM)

    def name(self) -> str:
        return f"{self.config.kind} {self.config.where}"

    def refresh(self, *, interval: float, missing: bool = False, reading: bool = False) -> bool:
        """Re-read if due; whether the keys changed. ``reading``: for a blob being read, a plugin runs only on a miss."""
        now = self.clock()
        if self.config.exec:
            due = (now - self._ran >= interval and not reading) or (missing and now - self._ran >= _MISS_RETRY)
            if not due:
                return False
            self._ran = now
            return self._take(self._run)
        if now - self._checked < _STAT_EVERY:
            return False
        self._checked = now
        try:
            st = os.stat(self.path)  # follows the Secret's ..data link: a swap is a new inode
            stamp = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError as exc:
            return self._failed(f"cannot read {self.path}: {exc.strerror}")
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        return self._take(self._read)

    def _read(self) -> bytes:
        with open(self.path, "rb") as fh:
            return fh.read(MAX_KEYRING_BYTES + 1)

    def _run(self) -> bytes:
        try:
            done = subprocess.run(  # noqa: S603 - the operator's own plugin, from the config
                list(self.config.exec), stdin=subprocess.DEVNULL, capture_output=True,
                timeout=self.config.timeout, check=False,
            )
        except subprocess.TimeoutExpired:
            raise errors.Unavailable(f"did not answer within {self.config.timeout:g}s") from None
        except OSError as exc:
            raise errors.Unavailable(f"cannot run: {exc.strerror}") from None
        if done.returncode != 0:
            said = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
            raise errors.Unavailable(f"exited with {done.returncode}: {said[0][:300]}")
        return done.stdout

    def _take(self, read: Callable[[], bytes]) -> bool:
        try:
            domains = parse_keyring(read(), self.name())
        except (OSError, errors.AgentError) as exc:
            return self._failed(str(exc) if isinstance(exc, errors.AgentError) else f"{self.path}: {exc}")
        changed = domains != self.domains or not self.loaded
        self.domains, self.loaded, self.problem = domains, True, ""
        if changed:
            log.info("encryption keys from %s: %s", self.name(),
                     ", ".join(f"{d} ({len(k)} keys, newest {k[0].key_id})" for d, k in sorted(domains.items())) or "none")
        return changed

    def _failed(self, why: str) -> bool:
        if why != self.problem:
            kept = "keeping the keys it gave before" if self.loaded else "it has given no keys yet"
            log.error("encryption key source %s: %s (%s)", self.name(), why, kept)
        self.problem = why
        return False


class Keys:
    """The node's key domains and their keys (a ``sealing.Keyring`` for the store)."""

    def __init__(self, settings: Encryption, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._sources = [_Source(c, clock) for c in settings.key_sources]
        self._lock = threading.Lock()
        self._by_id: dict[str, SealKey] = {}
        self.refresh()

    @property
    def configured(self) -> bool:
        """Whether any key source is configured."""
        return bool(self._sources)

    def domain_of(self, namespace: str) -> str:
        """The key domain of a namespace: its group's name, "*"'s group, or its own name."""
        fallback = ""
        for name, members in self.settings.domains.items():
            if namespace in members:
                return name
            if "*" in members:
                fallback = name
        return fallback or namespace

    def refresh(self, *, missing: bool = False, reading: bool = False) -> None:
        """Re-read the sources that are due (see the module's rule)."""
        with self._lock:
            changed = False
            for source in self._sources:
                changed |= source.refresh(interval=self.settings.refresh_interval, missing=missing, reading=reading)
            if changed or (missing and not self._by_id):
                by_id: dict[str, SealKey] = {}
                for source in self._sources:
                    for keys in source.domains.values():
                        for key in keys:
                            first = by_id.setdefault(key.key_id, key)
                            if first.secret != key.secret:
                                log.warning("key id %s: %s has other bytes than an earlier source; the earlier wins",
                                            key.key_id, source.name())
                self._by_id = by_id

    def key(self, key_id: str) -> SealKey | None:
        """The key with this id from any source, or None.

        Called for every sealed blob read: files are checked (at most once a
        second), a plugin is asked only when no source has the id.
        """
        self.refresh(reading=True)
        found = self._by_id.get(key_id)
        if found is None and self._sources:
            self.refresh(missing=True)
            found = self._by_id.get(key_id)
        return found

    def seal_key(self, namespace: str) -> SealKey | None:
        """The key new checkpoints of ``namespace`` are sealed under; None: its domain has none (they stay clear).

        FailedPrecondition when a source has never read: a checkpoint must
        not go out in the clear because its key source is broken.
        """
        if not self._sources:
            return None
        self.refresh()
        domain = self.domain_of(namespace)
        for source in self._sources:
            if not source.loaded:
                raise errors.FailedPrecondition(
                    f"encryption key source {source.name()} has not given any keys ({source.problem}); "
                    f"refusing to write a checkpoint of namespace {namespace} (key domain {domain}) unencrypted"
                )
            keys = source.domains.get(domain)
            if keys:
                return keys[0]
        return None

    def describe(self) -> list[str]:
        """The sources, their state and their domains' key ids (never key bytes), for people."""
        self.refresh()
        lines = []
        for i, source in enumerate(self._sources):
            state = "ok" if source.loaded and not source.problem else source.problem or "not read"
            doms = ", ".join(f"{d}: {', '.join(k.key_id for k in keys)}" for d, keys in sorted(source.domains.items()))
            lines.append(f"{i + 1}. {source.name()} [{state}] {doms or '(no domains)'}")
        return lines
