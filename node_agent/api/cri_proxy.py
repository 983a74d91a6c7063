"""A byte-level gRPC proxy to the node's CRI runtime.

Every method the CRI endpoint does not implement itself is forwarded to the
upstream runtime (containerd) unchanged: request and response messages stay
raw bytes and are never decoded, so methods this agent has never heard of
(a newer kubelet's) pass through as well. Metadata, deadlines, cancellation,
status codes, details and trailing metadata travel both ways.

Whether a method streams is decided by its name: the CRI's only streaming
method is the server-streaming `GetContainerEvents`; everything else is
unary.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Sequence

import grpc

log = logging.getLogger(__name__)

# Server-streaming methods of the CRI (by method name, any service version).
SERVER_STREAMING = frozenset({"GetContainerEvents"})
# CRI services this endpoint answers for; other services are UNIMPLEMENTED.
CRI_SERVICE_PREFIXES = ("/runtime.v1.", "/runtime.v1alpha2.")

# Headers gRPC itself owns; forwarding them would confuse the other side.
_RESERVED = frozenset({
    "content-type", "te", "user-agent", "grpc-timeout", "grpc-encoding", "grpc-accept-encoding",
    "grpc-status", "grpc-message", "grpc-internal-encoding-request", "host", "authority",
})

Metadata = Sequence[tuple[str, Any]]
LocalHandler = Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]


def forwardable(md: Optional[Metadata]) -> tuple[tuple[str, Any], ...]:
    """Metadata minus pseudo-headers and the headers gRPC sets itself."""
    if not md:
        return ()
    return tuple((k, v) for k, v in md if not k.startswith(":") and k.lower() not in _RESERVED)


def method_name(full: str) -> str:
    """`/runtime.v1.RuntimeService/ListPodSandbox` -> `ListPodSandbox`."""
    return full.rsplit("/", 1)[-1]


def is_server_streaming(full: str) -> bool:
    return method_name(full) in SERVER_STREAMING


def _timeout(context: grpc.aio.ServicerContext) -> float | None:
    left = context.time_remaining()
    return None if left is None else max(float(left), 0.0)


class CriProxy(grpc.GenericRpcHandler):  # type: ignore[misc]
    """A generic handler: local implementations first, then the upstream runtime.

    `local` maps full method names (`/runtime.v1.RuntimeService/CheckpointPod`)
    to handlers taking and returning serialized messages.
    """

    def __init__(self, channel: grpc.aio.Channel, local: dict[str, LocalHandler] | None = None) -> None:
        self.channel = channel
        self.local = dict(local or {})

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = str(handler_call_details.method)
        if not method.startswith(CRI_SERVICE_PREFIXES):
            return None
        if method in self.local:
            return grpc.unary_unary_rpc_method_handler(self.local[method])
        if is_server_streaming(method):
            return grpc.unary_stream_rpc_method_handler(self.stream_forwarder(method))
        return grpc.unary_unary_rpc_method_handler(self.unary_forwarder(method))

    def unary_forwarder(
        self, method: str, before_error: Callable[[bytes, grpc.aio.AioRpcError], Awaitable[None]] | None = None,
    ) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]:
        """A forwarder of `method`; `before_error(request, error)` runs before an upstream error is relayed."""
        upstream = self.channel.unary_unary(method, request_serializer=None, response_deserializer=None)

        async def forward(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            call = upstream(
                request, timeout=_timeout(context), metadata=forwardable(context.invocation_metadata())
            )
            try:
                initial = await call.initial_metadata()
                if forwardable(initial):
                    await context.send_initial_metadata(forwardable(initial))
                response: bytes = await call
            except grpc.aio.AioRpcError as exc:
                if before_error is not None:
                    await before_error(request, exc)
                await _relay_error(context, exc)
                raise  # not reached: abort raises
            finally:
                if not call.done():
                    call.cancel()
            trailing = forwardable(await call.trailing_metadata())
            if trailing:
                context.set_trailing_metadata(trailing)
            return response

        return forward

    def stream_forwarder(self, method: str) -> Callable[[bytes, grpc.aio.ServicerContext], AsyncIterator[bytes]]:
        upstream = self.channel.unary_stream(method, request_serializer=None, response_deserializer=None)

        async def forward(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            call = upstream(
                request, timeout=_timeout(context), metadata=forwardable(context.invocation_metadata())
            )
            try:
                initial = await call.initial_metadata()
                if forwardable(initial):
                    await context.send_initial_metadata(forwardable(initial))
                async for message in call:
                    yield message
            except grpc.aio.AioRpcError as exc:
                await _relay_error(context, exc)
            finally:
                # The client went away (or the stream ended): end the upstream call too.
                if not call.done():
                    call.cancel()
            trailing = forwardable(await call.trailing_metadata())
            if trailing:
                context.set_trailing_metadata(trailing)

        return forward


async def _relay_error(context: grpc.aio.ServicerContext, exc: grpc.aio.AioRpcError) -> None:
    code = exc.code()
    if code == grpc.StatusCode.CANCELLED and context.cancelled():
        # Our own client cancelled; there is no one left to tell.
        return
    await context.abort(code, exc.details() or "", forwardable(exc.trailing_metadata()))
