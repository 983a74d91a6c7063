"""A synchronous client of the local API socket, for the CLI."""

from __future__ import annotations

import os
from typing import Any, Iterator

import grpc

from node_agent._proto.nodeagent.v1 import nodeagent_pb2 as pb
from node_agent._proto.nodeagent.v1 import nodeagent_pb2_grpc as pb_grpc
from node_agent.config import Settings

ENV_SOCKET = "NODE_AGENT_SOCKET"


class CliError(Exception):
    """One line for stderr and an exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def socket_path(flag: str | None) -> str:
    return flag or os.environ.get(ENV_SOCKET) or Settings().socket


class Client:
    def __init__(self, socket: str) -> None:
        self.socket = socket
        self.channel = grpc.insecure_channel("unix://" + socket)
        self.stub = pb_grpc.NodeAgentStub(self.channel)  # type: ignore[no-untyped-call]

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.channel.close()

    def translate(self, exc: grpc.RpcError) -> CliError:
        code = exc.code() if hasattr(exc, "code") else None
        details = exc.details() if hasattr(exc, "details") else str(exc)
        if code == grpc.StatusCode.UNAVAILABLE and not os.path.exists(self.socket):
            return CliError(f"the node-agent daemon is not running (no socket at {self.socket})", 3)
        name = code.name if code else "UNKNOWN"
        return CliError(f"{name}: {details}", 1)

    def stream(self, method: str, request: Any, timeout: float | None) -> Iterator[Any]:
        try:
            yield from getattr(self.stub, method)(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise self.translate(exc) from None

    def call(self, method: str, request: Any, timeout: float | None = 60.0) -> Any:
        try:
            return getattr(self.stub, method)(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise self.translate(exc) from None


__all__ = ["Client", "CliError", "socket_path", "pb"]
