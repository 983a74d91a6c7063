"""The `nodeagent.v1.NodeAgent` servicer: messages in, the agent's services called, messages out.

Rule: the handlers only adapt; the work is the services' (checkpointing,
restoring, `transfers`, the store). `abort_with` is the one place agent
errors become gRPC statuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Coroutine, TypeVar

import grpc

from node_agent import errors, signing, transfers
from node_agent._proto.nodeagent.v1 import nodeagent_pb2 as pb
from node_agent._proto.nodeagent.v1 import nodeagent_pb2_grpc as pb_grpc
from node_agent.api import convert
from node_agent.api.status import abort_with, operation_timeout
from node_agent.admission import parse_checkpoint_options, parse_restore_options
from node_agent.checkpointing import Checkpointer, CheckpointRequest
from node_agent.progress import Progress
from node_agent.rekeying import Rekeyer
from node_agent.restoring import Restorer, RestoreRequest
from node_agent.store import Store
from node_agent.transfers import Transfers

if TYPE_CHECKING:
    from node_agent.devices.monitor import DeviceMonitor

log = logging.getLogger(__name__)
T = TypeVar("T")



class AgentServicer(pb_grpc.NodeAgentServicer):
    def __init__(
        self, checkpointer: Checkpointer, restorer: Restorer, store: Store, gc: Callable[..., Any],
        transfers: Transfers, rekeyer: Rekeyer, devices: DeviceMonitor | None = None,
    ) -> None:
        self.checkpointer = checkpointer
        self.restorer = restorer
        self.rekeyer = rekeyer
        self.store = store
        self.gc = gc
        self.transfers = transfers
        self.devices = devices

    async def _stream(
        self,
        context: grpc.aio.ServicerContext,
        run: Callable[[Callable[[Progress], None]], Coroutine[Any, Any, T]],
        wrap_progress: Callable[[pb.Progress], Any],
        wrap_result: Callable[[T], Any],
    ) -> AsyncIterator[Any]:
        if context.cancelled():
            # The caller went away before this handler ran (a deadline already
            # spent in transit): start nothing, above all freeze nothing.
            log.info("a call was cancelled by its caller before it started; nothing was done")
            return
        queue: asyncio.Queue[Progress] = asyncio.Queue()
        task: asyncio.Task[T] = asyncio.create_task(run(queue.put_nowait), name="api-operation")

        def ended(_: object) -> None:
            if context.cancelled() and not task.done():
                task.cancel()  # the caller is gone: thaw and remove, as for any cancellation

        context.add_done_callback(ended)
        getter: asyncio.Future[Progress] | None = None
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
            if getter is not None:
                getter.cancel()  # a call cancelled while waiting leaves no reader of its queue behind
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def Checkpoint(self, request: pb.CheckpointRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.CheckpointEvent]:
        timeout = operation_timeout(context)

        async def run(progress: Callable[[Progress], None]) -> Any:
            # Parsed here, once: a bad option is this call's answer.
            req = CheckpointRequest(pod=request.pod, containers=tuple(request.containers),
                                    options=parse_checkpoint_options(dict(request.options)))
            return await self.checkpointer.checkpoint(req, timeout=timeout, progress=progress)

        async for ev in self._stream(
            context, run,
            lambda p: pb.CheckpointEvent(progress=p),
            lambda rec: pb.CheckpointEvent(result=convert.checkpoint_info(rec)),
        ):
            yield ev

    async def Restore(self, request: pb.RestoreRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.RestoreEvent]:
        timeout = operation_timeout(context)

        async def run(progress: Callable[[Progress], None]) -> Any:
            # Parsed here, once: a bad option is this call's answer.
            req = RestoreRequest(
                checkpoint_id=request.checkpoint_id, namespace=request.namespace, name=request.name,
                start=request.start, options=parse_restore_options(dict(request.options)),
                runtime_handler=request.runtime_handler,
            )
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
        info = convert.checkpoint_info(rec)
        info.signers.extend(await self._unary(context, lambda: signing.signers(self.store, rec.id)))
        return info

    async def RemoveCheckpoint(self, request: pb.RemoveCheckpointRequest, context: grpc.aio.ServicerContext) -> pb.RemoveCheckpointResponse:
        rec = await self._unary(context, lambda: self.store.get(request.checkpoint_id))
        await self._unary(context, lambda: self.store.remove(rec.id))
        return pb.RemoveCheckpointResponse(checkpoint_id=rec.id)

    async def VerifyCheckpoint(self, request: pb.VerifyCheckpointRequest, context: grpc.aio.ServicerContext) -> pb.VerifyCheckpointResponse:
        rec = await self._unary(context, lambda: self.store.get(request.checkpoint_id))
        bad = await self._unary(context, lambda: self.store.verify(rec.id))
        blobs = {c.digest for f in rec.files for c in f.chunks}
        return pb.VerifyCheckpointResponse(
            checkpoint_id=rec.id, ok=not bad, blobs_checked=len(blobs),
            bad_blobs=[pb.BadBlob(digest=b.digest, reason=b.reason, paths=list(b.paths)) for b in bad],
        )

    async def RekeyCheckpoint(self, request: pb.RekeyCheckpointRequest, context: grpc.aio.ServicerContext) -> pb.RekeyCheckpointResponse:
        rec = await self._unary(context, lambda: self.store.get(request.checkpoint_id))
        new, signed = await self._unary(context, lambda: self.rekeyer.rekey(rec))
        if request.replace and new.id != rec.id:
            await self._unary(context, lambda: self.store.remove(rec.id))
        return pb.RekeyCheckpointResponse(checkpoint_id=new.id, key_id=new.key_id, previous_id=rec.id,
                                          previous_key_id=rec.key_id, replaced=request.replace and new.id != rec.id,
                                          signed_by=signed.signer, unsigned_reason=signed.unsigned)

    async def GarbageCollect(self, request: pb.GarbageCollectRequest, context: grpc.aio.ServicerContext) -> pb.GarbageCollectResponse:
        report = await self._unary(context, lambda: self.gc(dry_run=request.dry_run))
        return pb.GarbageCollectResponse(
            removed_checkpoints=list(report.removed_checkpoints), removed_blobs=len(report.removed_blobs),
            bytes_freed=report.bytes_freed, kept=report.kept, dry_run=report.dry_run,
        )

    async def ListRestores(self, request: pb.ListRestoresRequest, context: grpc.aio.ServicerContext) -> pb.ListRestoresResponse:
        """The restored replicas and how each is doing; records of sandboxes that are gone are dropped first."""
        replicas = self.restorer.replicas
        recorded = replicas.sandboxes()  # listed before the sandboxes: one recorded meanwhile is never dropped
        cri = self.restorer.cri
        try:
            alive: set[str] | None = {p.id for p in await cri.list_pods()}
            runtime: dict[str, str] | None = {c.id: c.state for c in await cri.list_containers()}
        except errors.AgentError as exc:
            log.warning("cannot ask the runtime about restored containers: %s", exc)
            alive = runtime = None
        if alive is not None:
            await self._unary(context, lambda: replicas.prune([s for s in recorded if s not in alive]))
        states = await self._unary(context, lambda: self.restorer.lazy.report(runtime))
        return pb.ListRestoresResponse(restores=[
            convert.restored_replica(s) for s in states
            if not request.pod_namespace or s.replica.namespace == request.pod_namespace])

    async def _transfer(
        self, context: grpc.aio.ServicerContext,
        run: Callable[[Callable[[Progress], None]], Coroutine[Any, Any, transfers.TransferResult]],
    ) -> AsyncIterator[pb.TransferEvent]:
        """Stream a push or pull: its progress, then its result."""
        async for ev in self._stream(
            context, run,
            lambda p: pb.TransferEvent(progress=p),
            lambda r: pb.TransferEvent(result=convert.transfer_result(r)),
        ):
            yield ev

    async def Push(self, request: pb.PushRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TransferEvent]:
        req = transfers.PushRequest(checkpoint_id=request.checkpoint_id, reference=request.reference,
                                    credentials=convert.registry_credentials(request.credentials))
        async for ev in self._transfer(context, lambda progress: self.transfers.push(req, progress)):
            yield ev

    async def Pull(self, request: pb.PullRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TransferEvent]:
        req = transfers.PullRequest(reference=request.reference, lazy=request.lazy,
                                    credentials=convert.registry_credentials(request.credentials))
        async for ev in self._transfer(context, lambda progress: self.transfers.pull(req, progress)):
            yield ev

    async def Export(self, request: pb.ExportRequest, context: grpc.aio.ServicerContext) -> pb.ExportResponse:
        req = convert.export_request(request)
        result = await self._unary(context, lambda: self.transfers.export_file(req))
        return pb.ExportResponse(output_path=result.output_path, size=result.size)

    async def ExportArchive(self, request: pb.ExportRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ArchiveChunk]:
        """The archive, written into the agent's own scratch space, then streamed and removed."""
        if request.output_path:
            await abort_with(context, errors.InvalidArgument("ExportArchive streams the archive: give no output path"))
        req = convert.export_request(request)
        async with self.transfers.scratch("export") as scratch:
            path = await self._unary(context, lambda: self.transfers.export_archive(req, scratch))
            async for data in transfers.read_archive(path):
                yield pb.ArchiveChunk(data=data)

    async def ImportArchive(self, request_iterator: AsyncIterator[pb.ImportChunk], context: grpc.aio.ServicerContext) -> pb.CheckpointInfo:
        """An archive streamed by the caller: kept in the agent's scratch space, within the free space, then imported."""
        header: pb.ImportRequest | None = None
        async with self.transfers.scratch("import") as scratch:
            try:
                with self.transfers.archive_sink(scratch) as sink:
                    async for chunk in request_iterator:
                        if header is None:
                            if chunk.WhichOneof("part") != "header" or chunk.header.input_path:
                                await abort_with(context, errors.InvalidArgument(
                                    "ImportArchive: the first message is the header, without an input path"))
                            header = chunk.header
                            continue
                        if chunk.WhichOneof("part") != "data":
                            await abort_with(context, errors.InvalidArgument("ImportArchive: one header, then data"))
                        await sink.write(chunk.data)
                if header is None:
                    await abort_with(context, errors.InvalidArgument("ImportArchive: no header came"))
                    raise AssertionError("unreachable")
                req = convert.import_request(header)
                rec = await self._unary(context, lambda: self.transfers.import_archive(sink.path, req))
                return convert.checkpoint_info(rec)
            except OSError as exc:
                await abort_with(context, errors.ResourceExhausted(f"cannot keep the streamed archive: {exc.strerror}"))
                raise
            except errors.AgentError as exc:
                await abort_with(context, exc)
                raise

    async def Import(self, request: pb.ImportRequest, context: grpc.aio.ServicerContext) -> pb.CheckpointInfo:
        req = convert.import_request(request)
        rec = await self._unary(context, lambda: self.transfers.import_file(req))
        return convert.checkpoint_info(rec)

    async def _device_monitor(self, context: grpc.aio.ServicerContext) -> DeviceMonitor:
        if self.devices is None:
            await abort_with(context, errors.FailedPrecondition("device monitoring is off (devices.enabled: false)"))
            raise AssertionError("unreachable")
        return self.devices

    async def ListDevices(self, request: pb.ListDevicesRequest, context: grpc.aio.ServicerContext) -> pb.DeviceSnapshot:
        from node_agent.api import devices as convert_devices

        monitor = await self._device_monitor(context)
        return convert_devices.snapshot(monitor.snapshot())

    async def WatchDevices(self, request: pb.WatchDevicesRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DeviceSnapshot]:
        from node_agent.api import devices as convert_devices

        monitor = await self._device_monitor(context)
        async for snap in monitor.watch():
            yield convert_devices.snapshot(snap)

