"""Who gets in: mutual TLS with reloaded certificates, the local socket's peer check.

- `CertificateFiles` feeds gRPC's dynamic server credentials: on every new
  connection it checks the certificate, key and client CA files and hands
  over a new configuration when their contents changed.
- `LocalSocketGate` owns the local Unix socket. gRPC does not tell a servicer
  who is on the other end of a Unix socket, so the gate accepts connections
  itself, reads the peer's SO_PEERCRED (and SO_PEERGROUPS), and relays the
  bytes of root to the root server's private socket, those of the socket
  group's members to the group's, both in a root-only directory; other peers
  are relayed to a server that refuses every call with PERMISSION_DENIED.
- `claim_socket` makes way for every Unix socket the agent listens on: a
  socket file another process still serves is never taken over (the start
  is refused), a stale one is replaced.

What each kind of caller may then call is the method table's to say
(`node_agent.authz`), enforced by `node_agent.api.gate` on every server.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import hashlib
import logging
import os
import socket
import ssl
import stat
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import grpc

from node_agent import errors

log = logging.getLogger(__name__)

# A refused local-socket caller is logged at most this often (seconds), per uid.
REFUSAL_LOG_INTERVAL = 60.0

# ---- certificates ----------------------------------------------------------------


class CertificateFiles:
    """The server's certificate chain, key and client CA, re-read when the files change.

    A change is noticed on the next new connection; a half-written pair (a
    key that does not match the certificate) is ignored until it is whole.
    """

    def __init__(self, cert: str, key: str, client_ca: str) -> None:
        self.paths = (cert, key, client_ca)
        self._stamp: tuple[tuple[int, int, int], ...] | None = None
        self._bad: tuple[tuple[int, int, int], ...] | None = None
        self._digest = ""
        self._error = ""
        self._lock = threading.Lock()
        try:
            first = self._read()
        except OSError as exc:
            raise errors.InvalidArgument(f"cannot read {exc.filename}: {exc.strerror}") from exc
        if first is None:
            raise errors.InvalidArgument(
                f"tls-cert {cert}, tls-key {key}, tls-client-ca {client_ca}: not a matching PEM certificate "
                f"and key and a PEM CA bundle ({self._error})"
            )
        self._initial = first

    def _stat(self) -> tuple[tuple[int, int, int], ...]:
        out = []
        for p in self.paths:
            st = os.stat(p)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(out)

    def _contents(self) -> tuple[bytes, bytes, bytes]:
        out = []
        for p in self.paths:
            with open(p, "rb") as fh:
                out.append(fh.read())
        return out[0], out[1], out[2]

    def _read(self) -> grpc.ServerCertificateConfiguration | None:
        stamp = self._stat()
        cert, key, ca = self._contents()
        # The key must match the certificate, and the files must not have
        # changed while they were checked.
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(self.paths[0], self.paths[1])
            ctx.load_verify_locations(cafile=self.paths[2])
        except (ssl.SSLError, OSError, ValueError) as exc:
            self._error = str(exc)
            if self._stamp is not None and stamp != self._bad:
                log.warning("TLS files not usable (yet), keeping the last good ones: %s", exc,
                            extra={"phase": "tls-reload"})
            self._bad = stamp
            return None
        if self._contents() != (cert, key, ca):
            return None
        self._stamp = stamp
        self._digest = hashlib.sha256(b"\0".join((cert, key, ca))).hexdigest()
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's fetcher: a new configuration when the files changed, else None (never raises)."""
        try:
            stamp = self._stat()
            if stamp in (self._stamp, self._bad):
                return None
            with self._lock:
                before = self._digest
                config = self._read()
            if config is None or self._digest == before:
                return None
            log.info("reloaded the TLS certificate, key and client CA", extra={"phase": "tls-reload"})
            return config
        except Exception as exc:  # noqa: BLE001 - runs on a gRPC thread; the old files stay in use
            log.warning("cannot reload TLS files: %s", exc, extra={"phase": "tls-reload"})
            return None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(self._initial, self.fetch, require_client_authentication=True)


def tls_port(server: grpc.aio.Server, listen: str, files: CertificateFiles) -> int:
    """Bind `listen` (HOST:PORT) on `server` with mutual TLS; returns the port."""
    from node_agent.config import host_port

    host, port = host_port(listen)
    bound = server.add_secure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}", files.credentials())
    if not bound:
        raise errors.FailedPrecondition(f"cannot listen on {listen}")
    return int(bound)


# ---- the local socket ----------------------------------------------------------------

SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_MAX_GROUPS = 1024


@dataclass(frozen=True)
class PeerCredentials:
    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...]


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """The kernel's record of who connected: SO_PEERCRED, plus supplementary groups."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    groups: tuple[int, ...] = ()
    try:
        data = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * _MAX_GROUPS)
        groups = struct.unpack(f"{len(data) // 4}I", data[: len(data) // 4 * 4])
    except OSError:
        groups = _proc_groups(pid)
    return PeerCredentials(pid, uid, gid, tuple(groups))


def _proc_groups(pid: int) -> tuple[int, ...]:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Groups:"):
                    return tuple(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return ()


def group_id(group: str) -> int | None:
    """The gid of `group` (a name or a number); None when empty."""
    if not group:
        return None
    if group.isascii() and group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError as exc:
        raise errors.InvalidArgument(f"socket-group {group!r}: no such group") from exc


def private_dir(store: str) -> str:
    """A root-only directory for the server's own sockets (short enough for a socket path)."""
    path = os.path.join(store, "run")
    if len(path) > 80:
        return tempfile.mkdtemp(prefix="node-agent-")
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def check_socket_free(path: str, what: str) -> bool:
    """Is there a socket file at `path` that no process serves (stale)? FAILED_PRECONDITION when one serves it.

    False when nothing is there. A connection that is accepted (or waits in
    a full backlog) means a live server: refused, naming its PID where the
    kernel tells it. Only a refused connection (nobody listens) makes a
    socket stale. Anything else at `path` that is not a socket counts as
    stale too (it was always replaced).
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(st.st_mode):
        return True
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return True
        except BlockingIOError:
            pid = 0
        except OSError as exc:
            raise errors.FailedPrecondition(
                f"{what} {path}: cannot tell whether another process serves it ({exc.strerror}); not replacing it"
            ) from exc
        else:
            pid = peer_credentials(probe).pid
    by = f" (pid {pid})" if pid > 0 else ""
    raise errors.FailedPrecondition(
        f"{what} {path} is served by another process{by}; refusing to take it over (is another node-agent running?)"
    )


def claim_socket(path: str, what: str) -> None:
    """Make way for a new listening socket at `path`: a stale one is removed, a served one refuses the start.

    Every listener of the agent binds through this (the local socket, the
    store's private backend sockets, `cri-listen`), right before it binds.
    """
    if check_socket_free(path, what):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class _Refuse(grpc.GenericRpcHandler):  # type: ignore[misc]
    def __init__(self, message: str) -> None:
        self.message = message

    def service(self, handler_call_details: Any) -> Any:
        message = self.message

        async def refuse(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)
            return b""

        return grpc.unary_unary_rpc_method_handler(refuse)


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(1 << 16):
            dst.write(data)
            await dst.drain()
    except ConnectionError:
        pass
    finally:
        dst.close()


class LocalSocketGate:
    """The local API socket: root is relayed to `backend`, members of `gid` to `group_backend` (the server
    whose gate applies the socket group's column of the method table); others are refused."""

    def __init__(self, path: str, backend: str, directory: str, gid: int | None, group_backend: str = "") -> None:
        self.path = path
        self.backend = backend
        self.group_backend = group_backend or backend
        self.refuse_path = os.path.join(directory, "refuse.sock")
        self.gid = gid
        self._server: asyncio.Server | None = None
        self._bound: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket file this gate made
        self._refuser: grpc.aio.Server | None = None
        self._refusals: dict[int, tuple[float, int]] = {}  # uid -> (last logged, refused since)
        self._relays: set[asyncio.Task[Any]] = set()

    def _log_refusal(self, peer: PeerCredentials) -> None:
        """A WARNING per uid at most every `REFUSAL_LOG_INTERVAL` seconds, saying how many went unlogged."""
        now = time.monotonic()
        last, quiet = self._refusals.get(peer.uid, (-REFUSAL_LOG_INTERVAL, 0))
        if now - last < REFUSAL_LOG_INTERVAL:
            self._refusals[peer.uid] = (last, quiet + 1)
            return
        if len(self._refusals) >= 4096:
            self._refusals.clear()
        self._refusals[peer.uid] = (now, 0)
        more = f" ({quiet} more refused in the last {REFUSAL_LOG_INTERVAL:g}s)" if quiet else ""
        log.warning("refused the local socket to uid %d (pid %d)%s", peer.uid, peer.pid, more,
                    extra={"phase": "authorize"})

    def admits(self, peer: PeerCredentials) -> bool:
        if peer.uid == 0:
            return True
        return self.gid is not None and (peer.gid == self.gid or self.gid in peer.groups)

    async def start(self) -> None:
        who = "root" if self.gid is None else f"root and group {self.gid}"
        self._refuser = grpc.aio.server()
        self._refuser.add_generic_rpc_handlers((_Refuse(f"the local socket {self.path} admits only {who}"),))
        claim_socket(self.refuse_path, "the refusal socket")
        self._refuser.add_insecure_port("unix://" + self.refuse_path)
        await self._refuser.start()
        os.makedirs(os.path.dirname(self.path), mode=0o755, exist_ok=True)
        claim_socket(self.path, "local socket")
        self._server = await asyncio.start_unix_server(self._accept, path=self.path)
        st = os.stat(self.path)
        self._bound = (st.st_dev, st.st_ino)
        os.chown(self.path, 0, -1 if self.gid is None else self.gid)
        os.chmod(self.path, 0o660)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._relays.add(task)
        try:
            peer = peer_credentials(writer.get_extra_info("socket"))
            target = self.backend if peer.uid == 0 else self.group_backend
            if not self.admits(peer):
                self._log_refusal(peer)
                target = self.refuse_path
            try:
                async with asyncio.timeout(10):
                    up_reader, up_writer = await asyncio.open_unix_connection(target)
            except (OSError, TimeoutError) as exc:
                log.warning("cannot reach %s: %s", target, exc)
                return
            async with asyncio.TaskGroup() as tg:
                tg.create_task(_pipe(reader, up_writer), name="local-socket-up")
                tg.create_task(_pipe(up_reader, writer), name="local-socket-down")
        finally:
            writer.close()
            self._relays.discard(task)

    def stop_accepting(self) -> None:
        """Refuse new connections; those already relayed go on."""
        if self._server is not None:
            self._server.close()
        # Only the socket file this gate made: never one another process bound at the path.
        with contextlib.suppress(OSError):
            st = os.lstat(self.path)
            if self._bound == (st.st_dev, st.st_ino):
                os.unlink(self.path)

    async def close(self) -> None:
        self.stop_accepting()
        for task in list(self._relays):
            task.cancel()
        await asyncio.gather(*self._relays, return_exceptions=True)
        if self._refuser is not None:
            await self._refuser.stop(None)
