"""The agent API's listeners: the local socket, mutual TLS, plaintext health, metrics.

`Listeners.root_server` makes the main server (the one the local socket
relays root to) and `bind` prepares it before it starts; `start` opens every
listener the settings name; `stop` shuts them down in stages: no new
connections, then calls in flight get `grace` seconds, then what is left is
cancelled. Every server of the API has a `MethodGate` for the kind of caller
it serves: root, the socket group, mutual TLS.
"""

from __future__ import annotations

import asyncio
import logging
import os

import grpc

from node_agent import authz, errors
from node_agent._proto.nodeagent.v1 import nodeagent_pb2_grpc as pb_grpc
from node_agent.api.agent import AgentServicer
from node_agent.api.gate import Caller, MethodGate
from node_agent.api.grpc_health import add_operability, serve_health, set_not_serving
from node_agent.api.local_socket import LocalSocketGate
from node_agent.api.tls_files import CertificateFiles, tls_port
from node_agent.api.unix_sockets import claim_socket, group_id, private_dir
from node_agent.config.schema import Settings
from node_agent.config.validation import host_port
from node_agent.metrics import Metrics, serve_metrics

log = logging.getLogger(__name__)

SERVER_OPTIONS = [("grpc.max_receive_message_length", 16 << 20)]


def api_server(servicer: AgentServicer, gate: MethodGate) -> grpc.aio.Server:
    """A server of the agent's API whose every call passes `gate`."""
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=(gate,))
    pb_grpc.add_NodeAgentServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    return server


class Listeners:
    def __init__(self, settings: Settings, servicer: AgentServicer, metrics: Metrics) -> None:
        self.settings = settings
        self.servicer = servicer
        self.metrics = metrics
        self.directory = private_dir(settings.store)
        self.backend = os.path.join(self.directory, "api.sock")
        gid = group_id(settings.socket_group)
        # Members of the socket group reach a server of their own, whose gate refuses
        # them the forms that name paths on the node.
        self.group_backend = os.path.join(self.directory, "group.sock") if gid is not None else ""
        self.group: grpc.aio.Server | None = None
        self.gate = LocalSocketGate(settings.socket, self.backend, self.directory, gid, self.group_backend)
        self.tls: grpc.aio.Server | None = None
        self.tls_port = 0
        self.health: grpc.aio.Server | None = None
        self.metrics_server: asyncio.Server | None = None
        self._health_servicers: list[object] = []
        self._server: grpc.aio.Server | None = None
        # Bad certificate files fail here, before anything listens.
        self.files = CertificateFiles(settings.tls_cert, settings.tls_key, settings.tls_client_ca) if settings.listen else None

    def root_server(self) -> grpc.aio.Server:
        """The main server: the API as root may call it (what the local socket relays root to)."""
        return api_server(self.servicer, MethodGate(Caller.ROOT))

    async def bind(self, server: grpc.aio.Server) -> None:
        """Give the main server health, reflection and its private socket (before it starts)."""
        self._server = server
        self._health_servicers.append(await add_operability(server))
        claim_socket(self.backend, "the API's backend socket")
        server.add_insecure_port("unix://" + self.backend)

    async def start(self) -> None:
        """Open every listener; if one cannot be opened, close what was (the bound server too) and raise."""
        try:
            await self._start()
        except BaseException:
            if self._server is not None:
                await asyncio.shield(self.stop(self._server, grace=0))
            raise

    async def _start(self) -> None:
        s = self.settings
        if self.group_backend:
            self.group = api_server(self.servicer, MethodGate(Caller.GROUP))
            self._health_servicers.append(await add_operability(self.group))
            claim_socket(self.group_backend, "the socket group's backend socket")
            self.group.add_insecure_port("unix://" + self.group_backend)
            await self.group.start()
        await self.gate.start()
        log.info("serving on unix://%s", s.socket)
        if self.files is not None:
            self.tls = api_server(self.servicer, MethodGate(
                Caller.TLS, policy=authz.Policy(s.authorization), store=self.servicer.store,
                pods=self.servicer.checkpointer.cri))
            self._health_servicers.append(await add_operability(self.tls))
            self.tls_port = tls_port(self.tls, s.listen, self.files)
            await self.tls.start()
            log.info("serving on %s with mutual TLS (%d authorization rules)", s.listen, len(s.authorization))
        if s.health_listen:
            host, port = host_port(s.health_listen, default_host="127.0.0.1", what="health-listen")
            try:
                self.health, servicer = await serve_health(host, port)
            except (OSError, RuntimeError) as exc:
                raise errors.FailedPrecondition(f"cannot listen on {s.health_listen} for health: {exc}") from exc
            self._health_servicers.append(servicer)
        if s.metrics_listen:
            host, port = host_port(s.metrics_listen, default_host="127.0.0.1", what="metrics-listen")
            try:
                self.metrics_server = await serve_metrics(self.metrics, host, port)
            except OSError as exc:
                raise errors.FailedPrecondition(f"cannot listen on {s.metrics_listen} for metrics: {exc.strerror}") from exc

    async def stop(self, server: grpc.aio.Server, grace: float) -> None:
        """Stop `server` and every listener; calls in flight get `grace` seconds."""
        for servicer in self._health_servicers:
            await set_not_serving(servicer)
        self.gate.stop_accepting()
        if self.metrics_server is not None:
            self.metrics_server.close()
        stops = [server.stop(grace)]
        if self.tls is not None:
            stops.append(self.tls.stop(grace))
        if self.group is not None:
            stops.append(self.group.stop(grace))
        await asyncio.gather(*stops)
        await self.gate.close()
        if self.health is not None:
            await self.health.stop(None)
