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

A plugin runs on a thread of its own (`run_plugin`), never on an asyncio
event loop: a caller on a worker thread waits for the run it needs (at most
the plugin's ``timeout``), while a call made on an event loop's thread
starts the run and goes on with the keys already known. Async code that
needs a key only a plugin can give asks from a worker thread
(``asyncio.to_thread``). The plugin gets no stdin, a minimal environment
(`PLUGIN_ENV` and the variables its ``env`` names), ``/`` as its directory
and a session of its own; its stdout and stderr are bounded while they are
read, and when it ends, overruns or times out, its process group is killed.

The keyring document (YAML or JSON; unknown keys are refused)::

    domains:
      team-a:                  # a domain (encryption.domains names groups of namespaces)
        - id: team-a-2026-12   # newest first: new checkpoints use this one
          key: <base64 of 32 random bytes>
        - id: team-a-2026-06   # older: still opens what it sealed
          key: ...
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import IO, Any, Final

import msgspec

from node_agent import errors
from node_agent.config.schema import Encryption, KeySource
from node_agent.names import KEY_ID_RE
from node_agent.store.sealing import KEY_BYTES, SealKey

log = logging.getLogger(__name__)

SECRET_ITEM: Final = "keyring.yaml"
MAX_KEYRING_BYTES: Final = 1 << 20
MAX_KEYS: Final = 4096
_STAT_EVERY: Final = 1.0
_MISS_RETRY: Final = 10.0
# A KMS plugin's environment: this, plus the variables its `env` names (docs/security.md).
PLUGIN_ENV: Final[Mapping[str, str]] = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
MAX_PLUGIN_STDOUT: Final = MAX_KEYRING_BYTES
MAX_PLUGIN_STDERR: Final = 64 << 10


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


def plugin_environment(names: Sequence[str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """A plugin's environment: `PLUGIN_ENV`, and the variables ``names`` lists that the agent has."""
    environ = os.environ if environ is None else environ
    return {**PLUGIN_ENV, **{n: environ[n] for n in names if n in environ}}


def run_plugin(source: KeySource) -> bytes:
    """Run a KMS plugin (blocking: call it from a thread of its own) and return its stdout.

    Unavailable, saying why, when it cannot start, overruns a bound, outlives
    its ``timeout`` or exits other than 0. Its whole process group is killed
    when it is done with, so a timeout takes its children too.
    """
    try:
        proc = subprocess.Popen(  # noqa: S603 - the operator's own plugin, from the config
            list(source.exec), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=plugin_environment(source.env), cwd="/", start_new_session=True, close_fds=True,
        )
    except OSError as exc:
        raise errors.Unavailable(f"cannot run: {exc.strerror}") from None
    assert proc.stdout is not None and proc.stderr is not None
    try:
        out, err, why = _collect(proc, proc.stdout, proc.stderr, source.timeout)
    except OSError as exc:
        out, err, why = b"", b"", f"cannot read its output: {exc.strerror}"
    finally:
        # The leader is not reaped yet, so its group id cannot have been reused.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.stdout.close()
        proc.stderr.close()
        proc.wait()
    if why:
        raise errors.Unavailable(why)
    if proc.returncode != 0:
        said = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
        raise errors.Unavailable(f"exited with {proc.returncode}: {said[0][:300]}")
    return out


def _collect(
    proc: subprocess.Popen[bytes], stdout: IO[bytes], stderr: IO[bytes], timeout: float
) -> tuple[bytes, bytes, str]:
    """Read both pipes to their end and wait for the plugin to exit, within the bounds; why not, if not."""
    bounds = {stdout.fileno(): ("stdout", MAX_PLUGIN_STDOUT), stderr.fileno(): ("stderr", MAX_PLUGIN_STDERR)}
    got = {fd: bytearray() for fd in bounds}
    deadline = time.monotonic() + timeout
    exited = os.pidfd_open(proc.pid)  # readable once the plugin exited (not reaped)
    try:
        with selectors.DefaultSelector() as sel:
            for fd in (*bounds, exited):
                sel.register(fd, selectors.EVENT_READ)
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    return b"", b"", f"did not answer within {timeout:g}s"
                for key, _ in sel.select(left):
                    fd = key.fd
                    if fd == exited:
                        sel.unregister(fd)
                        continue
                    data = os.read(fd, 1 << 16)
                    if not data:
                        sel.unregister(fd)
                        continue
                    got[fd] += data
                    name, bound = bounds[fd]
                    if len(got[fd]) > bound:
                        return b"", b"", f"printed more than {bound} bytes on {name}; stopped"
    finally:
        os.close(exited)
    return bytes(got[stdout.fileno()]), bytes(got[stderr.fileno()]), ""


def _on_event_loop() -> bool:
    """Whether this thread runs an asyncio event loop (which must never wait on a plugin)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


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
        self.running: Future[None] | None = None  # a plugin's run in flight

    @property
    def path(self) -> str:
        c = self.config
        return c.file if c.file else os.path.join(c.secret, SECRET_ITEM)

    def name(self) -> str:
        return f"{self.config.kind} {self.config.where}"

    def plugin_due(self, *, interval: float, missing: bool, reading: bool) -> bool:
        """Whether a plugin's run is due now; if so, it counts as run from now. ``reading``: only on a miss."""
        now = self.clock()
        due = (now - self._ran >= interval and not reading) or (missing and now - self._ran >= _MISS_RETRY)
        if due:
            self._ran = now
        return due

    def refresh(self) -> bool:
        """Re-read a file or Secret if it changed (checked at most once a second); whether the keys changed."""
        now = self.clock()
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
        """Re-read the sources that are due (see the module's rule).

        A plugin that is due runs on a thread of its own. The caller waits
        for it, and for a run already in flight (unless it only reads a blob
        and misses no key), except on an event loop's thread, which never
        waits: there the run goes on in the background.
        """
        runs: list[Future[None]] = []
        with self._lock:
            changed = False
            for source in self._sources:
                if not source.config.exec:
                    changed |= source.refresh()
                    continue
                if source.running is not None:
                    if missing or not reading:
                        runs.append(source.running)
                elif source.plugin_due(interval=self.settings.refresh_interval, missing=missing, reading=reading):
                    runs.append(self._start(source))
            if changed or (missing and not self._by_id):
                self._index()
        if runs and not _on_event_loop():
            for run in runs:
                run.result()

    def _index(self) -> None:
        """Every source's keys by id, the earliest source winning (under the lock)."""
        by_id: dict[str, SealKey] = {}
        for source in self._sources:
            for keys in source.domains.values():
                for key in keys:
                    first = by_id.setdefault(key.key_id, key)
                    if first.secret != key.secret:
                        log.warning("key id %s: %s has other bytes than an earlier source; the earlier wins",
                                    key.key_id, source.name())
        self._by_id = by_id

    def _start(self, source: _Source) -> Future[None]:
        """Run `source`'s plugin on a thread of its own (under the lock); done when its keys are taken."""
        run: Future[None] = Future()
        source.running = run

        def work() -> None:
            try:
                try:
                    out: bytes | errors.AgentError = run_plugin(source.config)
                except errors.AgentError as exc:
                    out = exc

                def read() -> bytes:
                    if isinstance(out, errors.AgentError):
                        raise out
                    return out

                with self._lock:
                    if source._take(read):
                        self._index()
            finally:
                with self._lock:
                    source.running = None
                run.set_result(None)

        threading.Thread(target=work, name=f"key plugin {source.config.exec[0]}", daemon=True).start()
        return run

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
                why = source.problem or ("its first run has not ended" if source.running else "not read yet")
                raise errors.FailedPrecondition(
                    f"encryption key source {source.name()} has not given any keys ({why}); "
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
