"""The one gate every call of the agent's API passes, on every listener: the method table applied per caller.

`MethodGate` is a gRPC server interceptor; each listener's server has one,
for the kind of caller it serves (`Caller`). It looks the method up in
`authz.METHODS` and, before the agent's servicer sees the request:

- `ROOT` (root on the local socket): lets every method through as asked;
- `GROUP` (a member of the socket group): refuses a call that sets a field
  naming a path on the node (the method's `paths`), with PERMISSION_DENIED;
- `TLS` (a client over mutual TLS): the client certificate's identity must
  be granted the method by the authorization policy, in the namespace the
  method's `Scope` finds. Pods and checkpoints are resolved among those of
  the caller's namespaces, so another namespace's is NOT_FOUND exactly as one
  that does not exist, and the call is pinned to what was resolved; a
  listing keeps only the caller's namespaces.

Calls of other services (health, reflection) pass untouched. A method of
`nodeagent.v1.NodeAgent` that the table lacks is refused on every listener.
For a client-streaming method, the first message is the one checked.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

import grpc

from node_agent import authz
from node_agent.api.status import abort_with
from node_agent.cri import CriClient
from node_agent.cri.pods import resolve_pod
from node_agent.podformat import namespace_of
from node_agent.store import Store

log = logging.getLogger(__name__)

SERVICE = "nodeagent.v1.NodeAgent"
_PREFIX = f"/{SERVICE}/"


class Caller(enum.Enum):
    """Who a listener serves."""

    ROOT = "root"
    GROUP = "the socket group"
    TLS = "mutual TLS"


# The answer of a method, as the caller may see it (LISTING keeps only the caller's namespaces).
Keep = Callable[[Any], Any]


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


def field_value(message: Any, field: str) -> str:
    """A (dotted) string field of a request; "" when there is no message or the field is unset."""
    value = message
    for part in field.split("."):
        if value is None:
            return ""
        value = getattr(value, part)
    return value if isinstance(value, str) else ""


def _pinned(message: Any, field: str, value: str) -> Any:
    """A copy of `message` with the (dotted) `field` set to `value`."""
    copy = type(message)()
    copy.CopyFrom(message)
    *parents, last = field.split(".")
    target = copy
    for part in parents:
        target = getattr(target, part)
    setattr(target, last, value)
    return copy


class MethodGate(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """`authz.METHODS` enforced for one kind of caller (see the module's rule)."""

    def __init__(self, caller: Caller, *, policy: authz.Policy | None = None, store: Store | None = None,
                 pods: CriClient | None = None) -> None:
        if caller is Caller.TLS and (policy is None or store is None):
            raise ValueError("the TLS gate needs the policy and the store")
        self.caller = caller
        self.policy = policy or authz.Policy()
        self.store = store
        self.pods = pods

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        name = str(details.method)
        if handler is None or not name.startswith(_PREFIX):
            return handler
        method = authz.METHODS.get(name[len(_PREFIX):])
        return _wrap(handler, functools.partial(self._enter, method, name), functools.partial(self._admit, method))

    async def _enter(
        self, method: authz.Method | None, name: str, context: grpc.aio.ServicerContext
    ) -> authz.Identity | None:
        """What is checked before the request is read: the method is in the table; a TLS client's identity."""
        if method is None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{name} is not in the agent's method table")
            raise AssertionError("unreachable")
        return await self._caller(method, context) if self.caller is Caller.TLS else None

    async def _admit(
        self, method: authz.Method | None, request: Any, context: grpc.aio.ServicerContext, who: authz.Identity | None
    ) -> tuple[Any, Keep | None]:
        """The request as the servicer gets it (pinned), and what the caller may see of the answer."""
        assert method is not None  # `_enter` refused the call otherwise
        if self.caller is Caller.GROUP:
            await self._no_node_paths(method, request, context)
        if self.caller is Caller.TLS:
            assert who is not None
            return await self._authorize(method, who, request, context)
        return request, None

    # ---- the socket group ----

    async def _no_node_paths(self, method: authz.Method, request: Any, context: grpc.aio.ServicerContext) -> None:
        for path in method.paths:
            value = field_value(request, path.field)
            if value:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, (
                    f"a member of the socket group may not have the agent {path.access} {value} "
                    f"(it would do so as root); {path.instead}"))

    # ---- mutual TLS ----

    async def _caller(self, method: authz.Method, context: grpc.aio.ServicerContext) -> authz.Identity:
        who = peer_identity(context)
        if who is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "this listener needs a client certificate")
            raise AssertionError("unreachable")
        if not self.policy.may_call(who, method.name):
            log.warning("refused %s to %s", method.name, who, extra={"phase": "authorize"})
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{who} may not call {method.name}")
        return who

    async def _check(self, context: grpc.aio.ServicerContext, who: authz.Identity, method: str, namespace: str) -> None:
        if self.policy.allows(who, method, namespace):
            return
        where = "every namespace" if namespace == authz.ANY else f"namespace {namespace!r}"
        log.warning("refused %s to %s in %s", method, who, where, extra={"phase": "authorize"})
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{who} may not call {method} for {where}")

    def _scope(self, who: authz.Identity, method: str) -> Callable[[str], bool] | None:
        """The namespaces `who` may call `method` for, as a predicate (None: every one)."""
        allowed = self.policy.namespaces(who, method)
        if authz.ANY in allowed:
            return None
        return lambda namespace: namespace in allowed

    async def _authorize(
        self, method: authz.Method, who: authz.Identity, request: Any, context: grpc.aio.ServicerContext
    ) -> tuple[Any, Keep | None]:
        name, scope = method.name, method.scope
        target = field_value(request, method.target) if method.target else ""
        if scope is authz.Scope.TARGET:
            # Without a target namespace the request's contents decide: the caller needs every one.
            await self._check(context, who, name, target or authz.ANY)
        elif target:
            await self._check(context, who, name, target)
        if scope in (authz.Scope.NODE, authz.Scope.AFTERWARDS):
            await self._check(context, who, name, authz.ANY)
        if scope is authz.Scope.POD:
            return await self._pod(method, who, request, context), None
        if scope is authz.Scope.CHECKPOINT:
            return await self._checkpoint(method, who, request, context), None
        if scope is authz.Scope.LISTING:
            return request, self._listing(who, method)
        return request, None

    async def _pod(
        self, method: authz.Method, who: authz.Identity, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        ref = field_value(request, method.ref)
        if "/" in ref.strip():
            # namespace/name: the namespace is the caller's to name, checked before anything is looked up.
            await self._check(context, who, method.name, ref.strip().partition("/")[0])
        try:
            pod = await resolve_pod(self.pods, ref, self._scope(who, method.name))  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - mapped right here
            await abort_with(context, exc)
            raise
        await self._check(context, who, method.name, pod.namespace)
        return _pinned(request, method.ref, pod.id)

    async def _checkpoint(
        self, method: authz.Method, who: authz.Identity, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        """The request pinned to the checkpoint it names among those of the namespaces `who` may call it for.

        A checkpoint of another namespace is not found, exactly as one that
        does not exist (no existence oracle).
        """
        scope = self._scope(who, method.name)
        within = None if scope is None else (lambda rec: scope(namespace_of(rec)))
        ref = field_value(request, method.ref)
        store = self.store
        assert store is not None
        try:
            rec = await asyncio.to_thread(lambda: store.get(ref, within=within))
        except Exception as exc:  # noqa: BLE001 - mapped right here
            await abort_with(context, exc)
            raise
        return _pinned(request, method.ref, rec.id)

    def _listing(self, who: authz.Identity, method: authz.Method) -> Keep | None:
        """The answer's items (`method.listing`) reduced to the namespaces `who` may list (None: all of them)."""
        allowed = self.policy.namespaces(who, method.name)
        if authz.ANY in allowed:
            return None
        items, namespace = method.listing

        def keep(answer: Any) -> Any:
            out = type(answer)()
            out.CopyFrom(answer)
            del getattr(out, items)[:]
            getattr(out, items).extend(c for c in getattr(answer, items) if getattr(c, namespace) in allowed)
            return out

        return keep


Enter = Callable[[grpc.aio.ServicerContext], Awaitable[Any]]
Admit = Callable[[Any, grpc.aio.ServicerContext, Any], Awaitable[tuple[Any, Keep | None]]]


def _wrap(handler: Any, enter: Enter, admit: Admit) -> Any:
    """`handler` with `enter`, then `admit` on its request (a client stream's first message), before the servicer."""
    options = {"request_deserializer": handler.request_deserializer,
               "response_serializer": handler.response_serializer}

    async def first(request: Any, context: grpc.aio.ServicerContext) -> tuple[Any, Keep | None]:
        return await admit(request, context, await enter(context))

    async def first_of(
        requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> tuple[AsyncIterator[Any], Keep | None]:
        who = await enter(context)  # before the caller's stream is read
        head = await anext(aiter(requests), None)
        checked, keep = await admit(head, context, who)
        return _chain(checked, requests), keep

    if not handler.request_streaming and not handler.response_streaming:
        unary_unary_inner = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            request, keep = await first(request, context)
            answer = await unary_unary_inner(request, context)
            return answer if keep is None else keep(answer)

        return grpc.unary_unary_rpc_method_handler(unary_unary, **options)
    if not handler.request_streaming:
        unary_stream_inner = handler.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            request, keep = await first(request, context)
            async for item in unary_stream_inner(request, context):
                yield item if keep is None else keep(item)

        return grpc.unary_stream_rpc_method_handler(unary_stream, **options)
    if not handler.response_streaming:
        stream_unary_inner = handler.stream_unary

        async def stream_unary(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            chained, keep = await first_of(requests, context)
            answer = await stream_unary_inner(chained, context)
            return answer if keep is None else keep(answer)

        return grpc.stream_unary_rpc_method_handler(stream_unary, **options)
    stream_stream_inner = handler.stream_stream

    async def stream_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        chained, keep = await first_of(requests, context)
        async for item in stream_stream_inner(chained, context):
            yield item if keep is None else keep(item)

    return grpc.stream_stream_rpc_method_handler(stream_stream, **options)


async def _chain(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    if first is not None:
        yield first
    async for item in rest:
        yield item
