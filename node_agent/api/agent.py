"""The `nodeagent.v1.NodeAgent` servicer."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import tempfile
import threading
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Coroutine, TypeVar

import grpc

from node_agent import errors, signing
from node_agent._proto.nodeagent.v1 import nodeagent_pb2 as pb
from node_agent._proto.nodeagent.v1 import nodeagent_pb2_grpc as pb_grpc
from node_agent.api import convert
from node_agent.checkpointing import Checkpointer, CheckpointRequest
from node_agent.progress import Progress
from node_agent.restoring import Restorer, RestoreRequest
from node_agent.store import Store

if TYPE_CHECKING:
    from node_agent.devices.monitor import DeviceMonitor

log = logging.getLogger(__name__)
T = TypeVar("T")

_STATUS = {name: getattr(grpc.StatusCode, name) for name in errors.BY_CODE}


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """The one place agent errors become gRPC statuses."""
    if isinstance(exc, errors.AgentError):
        await context.abort(_STATUS.get(exc.code, grpc.StatusCode.UNKNOWN), str(exc))
    log.exception("internal error", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {exc!r}")


def operation_timeout(context: grpc.aio.ServicerContext) -> float | None:
    """The operation's own deadline: a little before the caller's.

    The operation then gives up first, and its cleanup begins (a frozen pod
    is thawed at once) before the caller sees DEADLINE_EXCEEDED on its side.
    """
    left = context.time_remaining()
    if left is None:
        return None
    # A quarter of the call's time, at least 50 ms and at most a second, is
    # left for the cleanup to start (a thaw can take tens of milliseconds).
    return float(max(left - min(max(left * 0.25, 0.05), 1.0), 0.0))


_timeout = operation_timeout


class AgentServicer(pb_grpc.NodeAgentServicer):
    def __init__(
        self, checkpointer: Checkpointer, restorer: Restorer, store: Store, gc: Callable[..., Any],
        devices: DeviceMonitor | None = None,
    ) -> None:
        self.settings = checkpointer.settings
        self.checkpointer = checkpointer
        self.restorer = restorer
        self.store = store
        self.gc = gc
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
        new, signed = await self._unary(context, lambda: self.checkpointer.rekey(rec))
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
        self, context: grpc.aio.ServicerContext, fn: Callable[[Callable[[Any], None]], Any], ref: str
    ) -> AsyncIterator[pb.TransferEvent]:
        """Run a blocking push/pull in a thread, streaming its progress."""
        loop = asyncio.get_running_loop()

        async def run(progress: Callable[[Progress], None]) -> Any:
            ended = threading.Event()

            def relay(p: Any) -> None:
                if ended.is_set():  # the call is over: the transfer stops at its next step
                    raise errors.Cancelled(f"the transfer of {ref} was cancelled")
                loop.call_soon_threadsafe(progress, Progress(
                    p.phase, 0, 0, p.bytes_done, p.bytes_total,
                    f"{p.blobs_done}/{p.blobs_total} blobs, {p.skipped} already there",
                ))
            try:
                return await asyncio.to_thread(fn, relay)
            finally:
                ended.set()

        async for ev in self._stream(
            context, run,
            lambda p: pb.TransferEvent(progress=p),
            lambda r: pb.TransferEvent(result=pb.TransferResult(
                checkpoint_id=getattr(r, "digest", "") or getattr(r, "checkpoint_id", ""), reference=ref,
                blobs_transferred=getattr(r, "blobs_uploaded", getattr(r, "blobs_downloaded", 0)),
                blobs_skipped=r.blobs_skipped,
                bytes_transferred=getattr(r, "bytes_uploaded", getattr(r, "bytes_downloaded", 0)),
            )),
        ):
            yield ev

    async def Push(self, request: pb.PushRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TransferEvent]:
        from node_agent import registry

        creds = _creds(request.credentials)
        store = self.store

        def fn(progress: Callable[[Any], None]) -> Any:
            rec = store.get(request.checkpoint_id)
            return registry.push(store, rec.id, request.reference, creds, progress=progress,
                                 settings=self.settings.registry)

        async for ev in self._transfer(context, fn, request.reference):
            yield ev

    async def Pull(self, request: pb.PullRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TransferEvent]:
        from node_agent import registry

        creds = _creds(request.credentials)
        store = self.store
        defer: Callable[[str, int], set[str]] | None = None
        if request.lazy:
            from node_agent.lazy.remote import memory_chunks

            defer = functools.partial(memory_chunks, store)

        from node_agent.registry.fetching import RemoteBlobs, repository_key

        def fn(progress: Callable[[Any], None]) -> Any:
            if defer is not None and isinstance(store.origins.fetcher, RemoteBlobs) and creds.password:
                # The password stays in memory, for the chunks fetched later.
                store.origins.fetcher.passwords[repository_key(request.reference)] = creds.password
            return registry.pull(store, request.reference, creds, progress=progress, defer=defer,
                                 settings=self.settings.registry, min_free_bytes=self.settings.min_free_bytes)

        async for ev in self._transfer(context, fn, request.reference):
            yield ev

    async def Export(self, request: pb.ExportRequest, context: grpc.aio.ServicerContext) -> pb.ExportResponse:
        from node_agent import interop

        if not os.path.isabs(request.output_path):
            await abort_with(context, errors.InvalidArgument("the output path must be absolute"))
        store = self.store

        def fn() -> Any:
            rec = store.get(request.checkpoint_id)
            return interop.export_container(store, rec.id, request.container, request.output_path,
                                            compression=request.compression or None, plaintext=request.plaintext)

        report = await self._unary(context, fn)
        return pb.ExportResponse(output_path=request.output_path, size=int(getattr(report, "size", 0)))

    async def ExportArchive(self, request: pb.ExportRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ArchiveChunk]:
        """The archive, written into the agent's own scratch space, then streamed and removed."""
        from node_agent import interop

        if request.output_path:
            await abort_with(context, errors.InvalidArgument("ExportArchive streams the archive: give no output path"))
        store, s = self.store, self.settings
        scratch = await asyncio.to_thread(_scratch, s.work_dir, "export")
        try:
            path = os.path.join(scratch, "archive")

            def fn() -> Any:
                rec = store.get(request.checkpoint_id)
                return interop.export_container(store, rec.id, request.container, path,
                                                compression=request.compression or "none",
                                                plaintext=request.plaintext)

            await self._unary(context, fn)
            with open(path, "rb") as fh:
                while True:
                    data = await asyncio.to_thread(fh.read, ARCHIVE_CHUNK)
                    if not data:
                        break
                    yield pb.ArchiveChunk(data=data)
        finally:
            await asyncio.shield(asyncio.to_thread(shutil.rmtree, scratch, True))

    async def ImportArchive(self, request_iterator: AsyncIterator[pb.ImportChunk], context: grpc.aio.ServicerContext) -> pb.CheckpointInfo:
        """An archive streamed by the caller: kept in the agent's scratch space, within the free space, then imported."""
        s = self.settings
        header: pb.ImportRequest | None = None
        scratch = await asyncio.to_thread(_scratch, s.work_dir, "import")
        try:
            path = os.path.join(scratch, "archive")
            with open(path, "wb") as fh:
                written = 0
                async for chunk in request_iterator:
                    if header is None:
                        if chunk.WhichOneof("part") != "header" or chunk.header.input_path:
                            await abort_with(context, errors.InvalidArgument(
                                "ImportArchive: the first message is the header, without an input path"))
                        header = chunk.header
                        continue
                    if chunk.WhichOneof("part") != "data":
                        await abort_with(context, errors.InvalidArgument("ImportArchive: one header, then data"))
                    written += len(chunk.data)
                    if written % (64 << 20) < len(chunk.data):
                        await asyncio.to_thread(_keep_free, scratch, s.min_free_bytes, written)
                    await asyncio.to_thread(fh.write, chunk.data)
            if header is None:
                await abort_with(context, errors.InvalidArgument("ImportArchive: no header came"))
                raise AssertionError("unreachable")
            return await self._import(context, path, header)
        except OSError as exc:
            await abort_with(context, errors.ResourceExhausted(f"cannot keep the streamed archive: {exc.strerror}"))
            raise
        except errors.AgentError as exc:
            await abort_with(context, exc)
            raise
        finally:
            await asyncio.shield(asyncio.to_thread(shutil.rmtree, scratch, True))

    async def Import(self, request: pb.ImportRequest, context: grpc.aio.ServicerContext) -> pb.CheckpointInfo:
        if not os.path.isabs(request.input_path):
            await abort_with(context, errors.InvalidArgument("the input path must be absolute"))
        return await self._import(context, request.input_path, request)

    async def _import(self, context: grpc.aio.ServicerContext, path: str, request: pb.ImportRequest) -> pb.CheckpointInfo:
        from node_agent import interop

        store = self.store
        s = self.settings
        rec = await self._unary(context, lambda: interop.import_archive(
            store, path, namespace=request.namespace or None, name=request.name or None,
            log_root=s.pod_log_root, cgroup_parent=s.cgroup_parent or None, runtime_handler=s.runtime_handler,
            kubelet_root=s.kubelet_root, criu=s.criu, work_dir=s.work_dir, seal_for=self.checkpointer.seal_key,
            limits=interop.ImportLimits(min_free_bytes=s.min_free_bytes),
        ))
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


ARCHIVE_CHUNK = 1 << 20  # bytes per streamed archive message


def _scratch(work_dir: str, kind: str) -> str:
    """A private directory of the agent's scratch space (the caller names no path)."""
    os.makedirs(work_dir, mode=0o700, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"{kind}-", dir=work_dir)


def _keep_free(directory: str, min_free: int, written: int) -> None:
    """RESOURCE_EXHAUSTED when what a caller streams would leave less than `min_free` bytes free."""
    st = os.statvfs(directory)
    if st.f_bavail * st.f_frsize < min_free:
        raise errors.ResourceExhausted(
            f"the streamed archive ({written >> 20} MiB so far) would leave less than min-free-bytes "
            f"({min_free >> 20} MiB) free under {directory}"
        )


def _creds(c: pb.RegistryCredentials) -> Any:
    from node_agent.registry import Credentials

    return Credentials(
        username=c.username, password=c.password, ca_file=c.ca_file, ca_pem=c.ca_pem,
        plain_http=c.plain_http, insecure_skip_verify=c.insecure_skip_verify,
    )
