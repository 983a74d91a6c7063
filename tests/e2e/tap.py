"""A recording relay between the agent and a bed's containerd.

containerd 1.7 hands each container event to only one of the
`GetContainerEvents` streams open at the time, so a second stream opened
directly against containerd cannot see what the agent's stream sees. The
relay, put in as the agent's `cri-endpoint`, forwards every CRI call to
containerd untouched and keeps each event message exactly as containerd sent
it, one list per `GetContainerEvents` call.
"""

from __future__ import annotations

import threading
from concurrent import futures
from typing import Any, Callable, Iterator

import grpc

EVENTS = "/runtime.v1.RuntimeService/GetContainerEvents"


class EventTap(grpc.GenericRpcHandler):  # type: ignore[misc]
    def __init__(self, listen: str, upstream: str) -> None:
        """`listen`, `upstream`: unix socket paths."""
        self.listen = listen
        self.channel = grpc.insecure_channel("unix://" + upstream)
        self.lock = threading.Lock()
        self.streams: list[list[bytes]] = []  # what containerd streamed, per call
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
        self.server.add_generic_rpc_handlers((self,))
        self.server.add_insecure_port("unix://" + listen)

    def __enter__(self) -> "EventTap":
        self.server.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.stop(grace=None)
        self.channel.close()

    @property
    def endpoint(self) -> str:
        return "unix://" + self.listen

    def stream_count(self) -> int:
        with self.lock:
            return len(self.streams)

    def stream(self, i: int) -> list[bytes]:
        with self.lock:
            return list(self.streams[i])

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = str(details.method)
        if method == EVENTS:
            return grpc.unary_stream_rpc_method_handler(self._events)
        return grpc.unary_unary_rpc_method_handler(self._unary(method))

    def _unary(self, method: str) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        call = self.channel.unary_unary(method, request_serializer=None, response_deserializer=None)

        def forward(request: bytes, context: grpc.ServicerContext) -> bytes:
            try:
                out: bytes = call(request, timeout=context.time_remaining())
                return out
            except grpc.RpcError as exc:
                context.abort(exc.code(), exc.details() or "")
                raise  # not reached

        return forward

    def _events(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        call = self.channel.unary_stream(EVENTS, request_serializer=None, response_deserializer=None)(
            request, timeout=context.time_remaining())
        context.add_callback(call.cancel)
        with self.lock:
            seen: list[bytes] = []
            self.streams.append(seen)
        try:
            for message in call:
                with self.lock:
                    seen.append(message)
                yield message
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                context.abort(exc.code(), exc.details() or "")
