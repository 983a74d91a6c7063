"""A synchronous client of the daemon, for the CLI: the local socket, or the mutual-TLS listener."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterator

import grpc

from node_agent._proto.nodeagent.v1 import nodeagent_pb2 as pb
from node_agent._proto.nodeagent.v1 import nodeagent_pb2_grpc as pb_grpc
from node_agent.config.schema import Settings

ENV_SOCKET = "NODE_AGENT_SOCKET"


class CliError(Exception):
    """One line for stderr and an exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def socket_path(flag: str | None) -> str:
    """The daemon's socket: the flag, else $NODE_AGENT_SOCKET, else the default; relative to the current directory."""
    return os.path.abspath(flag or os.environ.get(ENV_SOCKET) or Settings().socket)


@dataclass(frozen=True)
class Remote:
    """The daemon's mutual-TLS listener and this client's certificate."""

    server: str
    cert: str
    key: str
    ca: str

    def channel(self) -> grpc.Channel:
        files = []
        for flag, path in (("--ca", self.ca), ("--key", self.key), ("--cert", self.cert)):
            try:
                with open(path, "rb") as fh:
                    files.append(fh.read())
            except OSError as exc:
                raise CliError(f"{flag} {path}: {exc.strerror}", 2) from None
        creds = grpc.ssl_channel_credentials(root_certificates=files[0], private_key=files[1], certificate_chain=files[2])
        return grpc.secure_channel(self.server, creds)


def remote_of(server: str | None, cert: str | None, key: str | None, ca: str | None) -> Remote | None:
    """The mutual-TLS listener a command goes to instead of the local socket (None: the socket)."""
    if not server:
        if cert or key or ca:
            raise CliError("--cert, --key and --ca go with --server HOST:PORT", 2)
        return None
    if not (cert and key and ca):
        raise CliError("--server needs --cert, --key and --ca (the listener takes mutual TLS only)", 2)
    return Remote(server, cert, key, ca)


class Client:
    def __init__(self, socket: str, remote: Remote | None = None) -> None:
        self.socket = socket
        self.remote = remote
        self.channel = self.remote.channel() if self.remote else grpc.insecure_channel("unix://" + socket)
        self.stub = pb_grpc.NodeAgentStub(self.channel)  # type: ignore[no-untyped-call]

    @classmethod
    def of(cls, args: Any) -> "Client":
        """The client a command's flags ask for: --server/--cert/--key/--ca, else --socket."""
        remote = remote_of(getattr(args, "server", None), getattr(args, "cert", None), getattr(args, "key", None),
                           getattr(args, "ca", None))
        return cls(socket_path(getattr(args, "socket", None)), remote)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.channel.close()

    def translate(self, exc: grpc.RpcError) -> CliError:
        code = exc.code() if hasattr(exc, "code") else None
        details = exc.details() if hasattr(exc, "details") else str(exc)
        if code == grpc.StatusCode.UNAVAILABLE and self.remote is not None:
            return CliError(f"cannot reach node-agent at {self.remote.server}: {details}", 3)
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


__all__ = ["Client", "CliError", "Remote", "remote_of", "socket_path", "pb"]
