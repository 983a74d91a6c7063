"""The `nodeagent.v1.NodeAgent` servicer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator, Callable, Coroutine, TypeVar

import grpc

from node_agent import errors
from node_agent._proto.nodeagent.v1 import nodeagent_pb2 as pb
from node_agent._proto.nodeagent.v1 import nodeagent_pb2_grpc as pb_grpc
from node_agent.api import convert
from node_agent.checkpointing import Checkpointer, CheckpointRequest, Progress
from node_agent.restoring import Restorer, RestoreRequest
from node_agent.store import Store

log = logging.getLogger(__name__)
T = TypeVar("T")

_STATUS = {name: getattr(grpc.StatusCode, name) for name in errors.BY_CODE}


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """The one place agent errors become gRPC statuses."""
    if isinstance(exc, errors.AgentError):
        await context.abort(_STATUS.get(exc.code, grpc.StatusCode.UNKNOWN), str(exc))
    log.exception("internal error", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {exc!r}")


def _timeout(context: grpc.aio.ServicerContext) -> float | None:
    left = context.time_remaining()
    return None if left is None else max(left, 0.0)


class AgentServicer(pb_grpc.NodeAgentServicer):
    def __init__(self, checkpointer: Checkpointer, restorer: Restorer, store: Store) -> None:
        self.checkpointer = checkpointer
        self.restorer = restorer
        self.store = store

    async def _stream(
        self,
        context: grpc.aio.ServicerContext,
        run: Callable[[Callable[[Progress], None]], Coroutine[Any, Any, T]],
        wrap_progress: Callable[[pb.Progress], Any],
        wrap_result: Callable[[T], Any],
    ) -> AsyncIterator[Any]:
        queue: asyncio.Queue[Progress] = asyncio.Queue()
        task: asyncio.Task[T] = asyncio.create_task(run(queue.put_nowait), name="api-operation")
        try:
            while True:
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield wrap_progress(convert.progress(getter.result()))
                    continue
                getter.cancel()
                while not queue.empty():
                    yield wrap_progress(convert.progress(queue.get_nowait()))
                break
            try:
                result = task.result()
            except BaseException as exc:  # noqa: BLE001 - mapped right here
                await abort_with(context, exc)
                return
            yield wrap_result(result)
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def Checkpoint(self, request: pb.CheckpointRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.CheckpointEvent]:
        req = CheckpointRequest(pod=request.pod, containers=tuple(request.containers), options=dict(request.options))
        timeout = _timeout(context)

        async def run(progress: Callable[[Progress], None]) -> Any:
            return await self.checkpointer.checkpoint(req, timeout=timeout, progress=progress)

        async for ev in self._stream(
            context, run,
            lambda p: pb.CheckpointEvent(progress=p),
            lambda rec: pb.CheckpointEvent(result=convert.checkpoint_info(rec)),
        ):
            yield ev

    async def Restore(self, request: pb.RestoreRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.RestoreEvent]:
        req = RestoreRequest(
            checkpoint_id=request.checkpoint_id, namespace=request.namespace, name=request.name,
            start=request.start, options=dict(request.options), runtime_handler=request.runtime_handler,
        )
        timeout = _timeout(context)

        async def run(progress: Callable[[Progress], None]) -> Any:
            return await self.restorer.restore(req, timeout=timeout, progress=progress)

        async for ev in self._stream(
            context, run,
            lambda p: pb.RestoreEvent(progress=p),
            lambda r: pb.RestoreEvent(result=convert.restore_result(r)),
        ):
            yield ev

    async def _unary(self, context: grpc.aio.ServicerContext, fn: Callable[[], T]) -> T:
        try:
            return await asyncio.to_thread(fn)
        except Exception as exc:  # noqa: BLE001 - mapped right here
            await abort_with(context, exc)
            raise

    async def ListCheckpoints(self, request: pb.ListCheckpointsRequest, context: grpc.aio.ServicerContext) -> pb.ListCheckpointsResponse:
        records = await self._unary(context, self.store.list)
        infos = [convert.checkpoint_info(r) for r in records]
        infos = [
            i for i in infos
            if (not request.pod_namespace or i.pod_namespace == request.pod_namespace)
            and (not request.pod_name or i.pod_name == request.pod_name)
        ]
        return pb.ListCheckpointsResponse(checkpoints=infos)

    async def InspectCheckpoint(self, request: pb.InspectCheckpointRequest, context: grpc.aio.ServicerContext) -> pb.CheckpointInfo:
        rec = await self._unary(context, lambda: self.store.get(request.checkpoint_id))
        return convert.checkpoint_info(rec)

    async def RemoveCheckpoint(self, request: pb.RemoveCheckpointRequest, context: grpc.aio.ServicerContext) -> pb.RemoveCheckpointResponse:
        rec = await self._unary(context, lambda: self.store.get(request.checkpoint_id))
        await self._unary(context, lambda: self.store.remove(rec.id))
        return pb.RemoveCheckpointResponse(checkpoint_id=rec.id)
