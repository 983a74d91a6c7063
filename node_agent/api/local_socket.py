"""The local API socket: peers relayed by their credentials, since gRPC does not say who is on a Unix socket.

`LocalSocketGate` accepts the connections itself, reads the peer's
credentials (`unix_sockets.peer_credentials`) and relays the bytes of root
to the root server's private socket, those of the socket group's members to
the group's, both in a root-only directory; other peers are relayed to a
server that refuses every call with PERMISSION_DENIED. What each kind of
caller may then call is the method table's to say (`node_agent.authz`),
enforced by `node_agent.api.gate` on every server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any

import grpc

from node_agent.api.unix_sockets import PeerCredentials, claim_socket, peer_credentials

log = logging.getLogger(__name__)

# A refused local-socket caller is logged at most this often (seconds), per uid.
REFUSAL_LOG_INTERVAL = 60.0


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
