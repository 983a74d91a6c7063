"""`grpc.health.v1` and server reflection, on every listener; the plaintext health listener."""

from __future__ import annotations

import logging
from typing import Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from node_agent._proto.nodeagent.v1 import nodeagent_pb2 as pb

log = logging.getLogger(__name__)

AGENT_SERVICE = pb.DESCRIPTOR.services_by_name["NodeAgent"].full_name
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


async def add_operability(server: grpc.aio.Server, services: Iterable[str] = (AGENT_SERVICE,)) -> health.aio.HealthServicer:
    """Add the health service (SERVING for "" and each of `services`) and reflection to `server`."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = tuple(services)
    for name in ("", *names):
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection((*names, HEALTH_SERVICE, reflection.SERVICE_NAME), server)
    return servicer


async def set_not_serving(servicer: health.aio.HealthServicer) -> None:
    """Tell health watchers the agent is going away (at shutdown)."""
    await servicer.enter_graceful_shutdown()


async def serve_health(host: str, port: int) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """A plaintext server with only health and reflection, for probes without a client certificate."""
    server = grpc.aio.server()
    servicer = await add_operability(server, ())
    bound = server.add_insecure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    if not bound:
        raise OSError(f"cannot listen on {host}:{port} for health")
    await server.start()
    log.info("health on %s:%d (plaintext)", host, bound)
    return server, servicer
