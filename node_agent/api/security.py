"""Who gets in: mutual TLS with reloaded certificates, the authorization policy, the local socket's peer check.

- `CertificateFiles` feeds gRPC's dynamic server credentials: on every new
  connection it checks the certificate, key and client CA files and hands
  over a new configuration when their contents changed.
- `AuthorizedServicer` wraps the agent's servicer on the TLS listener: the
  client's identity (certificate subject or SANs) must be allowed the method
  and the namespace of the pod or checkpoint it names (`node_agent.authz`).
- `LocalSocketGate` owns the local Unix socket. gRPC does not tell a servicer
  who is on the other end of a Unix socket, so the gate accepts connections
  itself, reads the peer's SO_PEERCRED (and SO_PEERGROUPS), and relays the
  bytes of admitted peers to the server's private socket in a root-only
  directory; other peers are relayed to a server that refuses every call with
  PERMISSION_DENIED.
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
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Mapping

import grpc

from node_agent import authz, errors
from node_agent._proto.nodeagent.v1 import nodeagent_pb2 as pb
from node_agent._proto.nodeagent.v1 import nodeagent_pb2_grpc as pb_grpc
from node_agent.api.agent import AgentServicer, abort_with
from node_agent.checkpointing import resolve_pod

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


# ---- identities and policy ---------------------------------------------------------


def _values(ctx: Mapping[str, Any], key: str) -> list[str]:
    return [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in ctx.get(key) or []]


def peer_identity(context: grpc.aio.ServicerContext) -> authz.Identity | None:
    """The client's certificate identity, or None when the call did not come over TLS."""
    ctx = context.auth_context() or {}
    if _values(ctx, "transport_security_type") != ["ssl"]:
        return None
    cn = _values(ctx, "x509_common_name")
    subject = _values(ctx, "x509_subject")
    return authz.Identity(
        common_name=cn[0] if cn else "",
        subject=subject[0] if subject else "",
        sans=tuple(_values(ctx, "x509_subject_alternative_name")),
    )


def _namespace_of(rec: Any) -> str:
    pod = rec.metadata.get("pod") if isinstance(rec.metadata, Mapping) else None
    ns = pod.get("namespace") if isinstance(pod, Mapping) else None
    return ns if isinstance(ns, str) else ""


class AuthorizedServicer(pb_grpc.NodeAgentServicer):
    """The agent's API under the authorization policy (the mutual-TLS listener)."""

    def __init__(self, inner: AgentServicer, policy: authz.Policy) -> None:
        self.inner = inner
        self.policy = policy

    async def _caller(self, context: grpc.aio.ServicerContext, method: str) -> authz.Identity:
        who = peer_identity(context)
        if who is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "this listener needs a client certificate")
            raise AssertionError("unreachable")
        if not self.policy.may_call(who, method):
            log.warning("refused %s to %s", method, who, extra={"phase": "authorize"})
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{who} may not call {method}")
        return who

    async def _check(self, context: grpc.aio.ServicerContext, who: authz.Identity, method: str, namespace: str) -> None:
        if self.policy.allows(who, method, namespace):
            return
        where = "every namespace" if namespace == authz.ANY else f"namespace {namespace!r}"
        log.warning("refused %s to %s in %s", method, who, where, extra={"phase": "authorize"})
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{who} may not call {method} for {where}")

    def _scope(self, who: authz.Identity, method: str) -> Any:
        """The namespaces `who` may call `method` for, as a predicate (None: every one)."""
        allowed = self.policy.namespaces(who, method)
        if authz.ANY in allowed:
            return None
        return lambda namespace: namespace in allowed

    async def _checkpoint(self, context: grpc.aio.ServicerContext, who: authz.Identity, method: str, ref: str) -> Any:
        """The checkpoint `ref` names among those of the namespaces `who` may call `method` for.

        Resolved within the caller's scope: a checkpoint of another namespace
        is not found, exactly as one that does not exist (no existence oracle).
        """
        scope = self._scope(who, method)
        within = None if scope is None else (lambda rec: scope(_namespace_of(rec)))
        try:
            return await asyncio.to_thread(lambda: self.inner.store.get(ref, within=within))
        except Exception as exc:  # noqa: BLE001 - mapped right here
            await abort_with(context, exc)
            raise

    async def Checkpoint(self, request: pb.CheckpointRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.CheckpointEvent]:
        who = await self._caller(context, "Checkpoint")
        ref = request.pod.strip()
        if "/" in ref:
            # namespace/name: the namespace is the caller's to name, checked before anything is looked up.
            await self._check(context, who, "Checkpoint", ref.partition("/")[0])
        try:
            pod = await resolve_pod(self.inner.checkpointer.cri, request.pod, self._scope(who, "Checkpoint"))
        except Exception as exc:  # noqa: BLE001 - mapped right here
            await abort_with(context, exc)
            raise
        await self._check(context, who, "Checkpoint", pod.namespace)
        pinned = pb.CheckpointRequest()
        pinned.CopyFrom(request)
        pinned.pod = pod.id
        async for ev in self.inner.Checkpoint(pinned, context):
            yield ev

    async def Restore(self, request: pb.RestoreRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.RestoreEvent]:
        who = await self._caller(context, "Restore")
        if request.namespace:
            await self._check(context, who, "Restore", request.namespace)
        rec = await self._checkpoint(context, who, "Restore", request.checkpoint_id)
        pinned = pb.RestoreRequest()
        pinned.CopyFrom(request)
        pinned.checkpoint_id = rec.id
        async for ev in self.inner.Restore(pinned, context):
            yield ev

    async def ListDevices(self, request: pb.ListDevicesRequest, context: grpc.aio.ServicerContext) -> pb.DeviceSnapshot:
        # Devices are the node's, not a namespace's: the rule must cover every namespace.
        who = await self._caller(context, "ListDevices")
        await self._check(context, who, "ListDevices", authz.ANY)
        return await self.inner.ListDevices(request, context)

    async def WatchDevices(self, request: pb.WatchDevicesRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DeviceSnapshot]:
        who = await self._caller(context, "WatchDevices")
        await self._check(context, who, "WatchDevices", authz.ANY)
        async for snap in self.inner.WatchDevices(request, context):
            yield snap

    async def ListCheckpoints(self, request: pb.ListCheckpointsRequest, context: grpc.aio.ServicerContext) -> pb.ListCheckpointsResponse:
        who = await self._caller(context, "ListCheckpoints")
        if request.pod_namespace:
            await self._check(context, who, "ListCheckpoints", request.pod_namespace)
        allowed = self.policy.namespaces(who, "ListCheckpoints")
        resp = await self.inner.ListCheckpoints(request, context)
        if authz.ANY in allowed:
            return resp
        return pb.ListCheckpointsResponse(checkpoints=[c for c in resp.checkpoints if c.pod_namespace in allowed])

    async def InspectCheckpoint(self, request: pb.InspectCheckpointRequest, context: grpc.aio.ServicerContext) -> pb.CheckpointInfo:
        who = await self._caller(context, "InspectCheckpoint")
        rec = await self._checkpoint(context, who, "InspectCheckpoint", request.checkpoint_id)
        return await self.inner.InspectCheckpoint(pb.InspectCheckpointRequest(checkpoint_id=rec.id), context)

    async def RemoveCheckpoint(self, request: pb.RemoveCheckpointRequest, context: grpc.aio.ServicerContext) -> pb.RemoveCheckpointResponse:
        who = await self._caller(context, "RemoveCheckpoint")
        rec = await self._checkpoint(context, who, "RemoveCheckpoint", request.checkpoint_id)
        return await self.inner.RemoveCheckpoint(pb.RemoveCheckpointRequest(checkpoint_id=rec.id), context)

    async def VerifyCheckpoint(self, request: pb.VerifyCheckpointRequest, context: grpc.aio.ServicerContext) -> pb.VerifyCheckpointResponse:
        who = await self._caller(context, "VerifyCheckpoint")
        rec = await self._checkpoint(context, who, "VerifyCheckpoint", request.checkpoint_id)
        return await self.inner.VerifyCheckpoint(pb.VerifyCheckpointRequest(checkpoint_id=rec.id), context)

    async def GarbageCollect(self, request: pb.GarbageCollectRequest, context: grpc.aio.ServicerContext) -> pb.GarbageCollectResponse:
        who = await self._caller(context, "GarbageCollect")
        await self._check(context, who, "GarbageCollect", authz.ANY)
        return await self.inner.GarbageCollect(request, context)

    async def Push(self, request: pb.PushRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TransferEvent]:
        who = await self._caller(context, "Push")
        rec = await self._checkpoint(context, who, "Push", request.checkpoint_id)
        pinned = pb.PushRequest()
        pinned.CopyFrom(request)
        pinned.checkpoint_id = rec.id
        async for ev in self.inner.Push(pinned, context):
            yield ev

    async def Pull(self, request: pb.PullRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TransferEvent]:
        who = await self._caller(context, "Pull")
        # What a pull brings in is known only once it is here.
        await self._check(context, who, "Pull", authz.ANY)
        async for ev in self.inner.Pull(request, context):
            yield ev

    async def Export(self, request: pb.ExportRequest, context: grpc.aio.ServicerContext) -> pb.ExportResponse:
        who = await self._caller(context, "Export")
        rec = await self._checkpoint(context, who, "Export", request.checkpoint_id)
        pinned = pb.ExportRequest()
        pinned.CopyFrom(request)
        pinned.checkpoint_id = rec.id
        return await self.inner.Export(pinned, context)

    async def Import(self, request: pb.ImportRequest, context: grpc.aio.ServicerContext) -> pb.CheckpointInfo:
        who = await self._caller(context, "Import")
        # Without a target namespace the archive's own decides.
        await self._check(context, who, "Import", request.namespace or authz.ANY)
        return await self.inner.Import(request, context)

    async def ExportArchive(self, request: pb.ExportRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ArchiveChunk]:
        who = await self._caller(context, "Export")
        rec = await self._checkpoint(context, who, "Export", request.checkpoint_id)
        pinned = pb.ExportRequest()
        pinned.CopyFrom(request)
        pinned.checkpoint_id = rec.id
        async for chunk in self.inner.ExportArchive(pinned, context):
            yield chunk

    async def ImportArchive(self, request_iterator: AsyncIterator[pb.ImportChunk], context: grpc.aio.ServicerContext) -> pb.CheckpointInfo:
        who = await self._caller(context, "Import")
        first = await anext(aiter(request_iterator), None)
        namespace = first.header.namespace if first is not None and first.WhichOneof("part") == "header" else ""
        await self._check(context, who, "Import", namespace or authz.ANY)
        return await self.inner.ImportArchive(_chain(first, request_iterator), context)


async def _chain(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    if first is not None:
        yield first
    async for item in rest:
        yield item


class GroupServicer:
    """The agent's API for members of the local socket's group: everything but naming paths on the node.

    The daemon runs as root; a path a caller names would be opened with
    root's permissions (an export into a root-only directory, an import of a
    root-only file). Group members stream archives instead (ExportArchive,
    ImportArchive, which the CLI uses) and hand a registry's CA as its
    contents, and checkpoint and restore as root does.
    """

    def __init__(self, inner: AgentServicer) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def Export(self, request: pb.ExportRequest, context: grpc.aio.ServicerContext) -> pb.ExportResponse:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, _PATHS_ROOT_ONLY.format(what=f"write {request.output_path}"))
        raise AssertionError("unreachable")

    async def Import(self, request: pb.ImportRequest, context: grpc.aio.ServicerContext) -> pb.CheckpointInfo:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, _PATHS_ROOT_ONLY.format(what=f"read {request.input_path}"))
        raise AssertionError("unreachable")

    async def Push(self, request: pb.PushRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TransferEvent]:
        await _no_ca_path(request.credentials, context)
        async for ev in self.inner.Push(request, context):
            yield ev

    async def Pull(self, request: pb.PullRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TransferEvent]:
        await _no_ca_path(request.credentials, context)
        async for ev in self.inner.Pull(request, context):
            yield ev


_PATHS_ROOT_ONLY = ("a member of the socket group may not have the agent {what} (it would do so as root); "
                    "`node-agent export` and `node-agent import` stream the archive through the socket instead")


async def _no_ca_path(creds: pb.RegistryCredentials, context: grpc.aio.ServicerContext) -> None:
    if creds.ca_file:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, (
            f"a member of the socket group may not have the agent read {creds.ca_file} (it would do so as root); "
            "the CLI sends the CA file's contents instead"))


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
    """The local API socket: root is relayed to `backend`, members of `gid` to `group_backend` (the API
    without path forms, `GroupServicer`); others are refused."""

    def __init__(self, path: str, backend: str, directory: str, gid: int | None, group_backend: str = "") -> None:
        self.path = path
        self.backend = backend
        self.group_backend = group_backend or backend
        self.refuse_path = os.path.join(directory, "refuse.sock")
        self.gid = gid
        self._server: asyncio.Server | None = None
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
        if os.path.exists(self.refuse_path):
            os.unlink(self.refuse_path)
        self._refuser.add_insecure_port("unix://" + self.refuse_path)
        await self._refuser.start()
        os.makedirs(os.path.dirname(self.path), mode=0o755, exist_ok=True)
        if os.path.exists(self.path):
            os.unlink(self.path)
        self._server = await asyncio.start_unix_server(self._accept, path=self.path)
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
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    async def close(self) -> None:
        self.stop_accepting()
        for task in list(self._relays):
            task.cancel()
        await asyncio.gather(*self._relays, return_exceptions=True)
        if self._refuser is not None:
            await self._refuser.stop(None)
