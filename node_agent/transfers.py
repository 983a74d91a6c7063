"""Checkpoints in and out of the node: push, pull, export and import, as a service of the API.

Rule: plain dataclasses in, typed results out; nothing here knows the API's
messages. Push and pull block on the registry, so they run in a worker
thread whose progress is relayed to the event loop; once the caller is gone
the transfer stops at its next step (`errors.Cancelled`). An archive that is
streamed rather than named by a path lives in a private directory of the
agent's scratch space (`work_dir`) for as long as the call lasts, and one
that a caller streams in is kept only while `min-free-bytes` stay free.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import BinaryIO, Final, TypeVar

from node_agent import errors, interop, registry
from node_agent.config.schema import Settings
from node_agent.lazy.remote import memory_chunks
from node_agent.progress import Progress
from node_agent.registry.fetching import RemoteBlobs
from node_agent.store import CheckpointRecord, Store
from node_agent.store.sealing import SealKey

T = TypeVar("T")

ARCHIVE_CHUNK: Final = 1 << 20  # bytes per piece of a streamed archive
FREE_CHECK_BYTES: Final = 64 << 20  # a streamed archive checks the free space at least this often
ARCHIVE_NAME: Final = "archive"  # the archive's file in its scratch directory
PROGRESS_EVERY: Final = 0.1
"""Seconds between two progress events of a push or pull within one phase: a transfer reports every piece
it moves (a thousand per GiB), and each event wakes the event loop and goes out to the caller, work
taken from the transfer itself; a new phase and the last report of the transfer always go out."""
_clock = time.monotonic


@dataclass(frozen=True)
class PushRequest:
    checkpoint_id: str
    reference: str
    credentials: registry.Credentials


@dataclass(frozen=True)
class PullRequest:
    reference: str
    credentials: registry.Credentials
    lazy: bool = False  # leave the chunks only memory images use in the registry


@dataclass(frozen=True)
class TransferResult:
    """A finished push or pull: the checkpoint (its manifest's digest), the reference, what moved and what was there."""

    checkpoint_id: str
    reference: str
    blobs_transferred: int
    blobs_skipped: int
    bytes_transferred: int


@dataclass(frozen=True)
class ExportRequest:
    checkpoint_id: str
    container: str
    output_path: str = ""  # absolute; empty when the archive is streamed
    compression: str = ""  # "none", "gzip", "zstd"; empty: by the file's name, or none when streamed
    plaintext: bool = False


@dataclass(frozen=True)
class ExportResult:
    output_path: str
    size: int  # bytes of the archive as written


@dataclass(frozen=True)
class ImportRequest:
    input_path: str = ""  # absolute; empty when the archive is streamed
    namespace: str = ""  # empty: the archive's own
    name: str = ""


class ArchiveSink:
    """An archive a caller streams in, written into a scratch directory while `min_free` bytes stay free there."""

    def __init__(self, directory: str, min_free: int) -> None:
        self.directory = directory
        self.path = os.path.join(directory, ARCHIVE_NAME)
        self.min_free = min_free
        self.written = 0
        self._fh: BinaryIO = open(self.path, "wb")

    async def write(self, data: bytes) -> None:
        """Append `data`; RESOURCE_EXHAUSTED when the stream would leave too little free."""
        self.written += len(data)
        if self.written % FREE_CHECK_BYTES < len(data):
            await asyncio.to_thread(keep_free, self.directory, self.min_free, self.written)
        await asyncio.to_thread(self._fh.write, data)

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> ArchiveSink:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class Transfers:
    """Push, pull, export and import for one store, under the agent's settings.

    ``seal_for(namespace)`` is the key an imported checkpoint is sealed under;
    ``remote`` (the store's fetcher of lazily pulled chunks) keeps the
    password of a lazy pull for the chunks it fetches later.
    """

    def __init__(
        self, settings: Settings, store: Store, *, seal_for: Callable[[str], SealKey | None],
        remote: RemoteBlobs | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.seal_for = seal_for
        self.remote = remote

    # ---- registries ----------------------------------------------------------------

    async def push(self, request: PushRequest, progress: Callable[[Progress], None]) -> TransferResult:
        """Push a checkpoint to a registry, reporting progress on the event loop."""
        store, settings = self.store, self.settings

        def work(relay: registry.ProgressCallback) -> TransferResult:
            rec = store.get(request.checkpoint_id)
            report = registry.push(store, rec.id, request.reference, request.credentials, progress=relay,
                                   settings=settings.registry)
            return TransferResult(
                checkpoint_id=report.digest, reference=request.reference, blobs_transferred=report.blobs_uploaded,
                blobs_skipped=report.blobs_skipped, bytes_transferred=report.bytes_uploaded,
            )

        return await _in_thread(work, request.reference, progress)

    async def pull(self, request: PullRequest, progress: Callable[[Progress], None]) -> TransferResult:
        """Pull a checkpoint from a registry into the store (lazily: memory chunks stay there), reporting progress."""
        store, settings, remote = self.store, self.settings, self.remote
        creds = request.credentials
        defer: Callable[[str, int], set[str]] | None = (
            functools.partial(memory_chunks, store) if request.lazy else None
        )

        def work(relay: registry.ProgressCallback) -> TransferResult:
            if defer is not None and remote is not None and creds.password:
                # The password stays in memory, for the chunks fetched later.
                remote.remember_password(request.reference, creds.password)
            report = registry.pull(store, request.reference, creds, progress=relay, defer=defer,
                                   settings=settings.registry, min_free_bytes=settings.min_free_bytes)
            return TransferResult(
                checkpoint_id=report.checkpoint_id, reference=request.reference,
                blobs_transferred=report.blobs_downloaded, blobs_skipped=report.blobs_skipped,
                bytes_transferred=report.bytes_downloaded,
            )

        return await _in_thread(work, request.reference, progress)

    # ---- archives ----------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def scratch(self, kind: str) -> AsyncIterator[str]:
        """A private directory of the agent's scratch space for one call, removed when it ends."""
        path = await asyncio.to_thread(scratch_dir, self.settings.work_dir, kind)
        try:
            yield path
        finally:
            await asyncio.shield(asyncio.to_thread(shutil.rmtree, path, True))

    def export_file(self, request: ExportRequest) -> ExportResult:
        """Write one container of a checkpoint as an archive at the caller's absolute path (blocking)."""
        if not os.path.isabs(request.output_path):
            raise errors.InvalidArgument("the output path must be absolute")
        rec = self.store.get(request.checkpoint_id)
        report = interop.export_container(self.store, rec.id, request.container, request.output_path,
                                          compression=request.compression or None, plaintext=request.plaintext)
        return ExportResult(output_path=request.output_path, size=report.size)

    def export_archive(self, request: ExportRequest, scratch: str) -> str:
        """Write one container of a checkpoint as an archive in `scratch` (see `scratch`); its path (blocking)."""
        path = os.path.join(scratch, ARCHIVE_NAME)
        rec = self.store.get(request.checkpoint_id)
        interop.export_container(self.store, rec.id, request.container, path,
                                 compression=request.compression or "none", plaintext=request.plaintext)
        return path

    def archive_sink(self, scratch: str) -> ArchiveSink:
        """Where an archive a caller streams is kept, in `scratch` (see `scratch`), within the free space."""
        return ArchiveSink(scratch, self.settings.min_free_bytes)

    def import_file(self, request: ImportRequest) -> CheckpointRecord:
        """Import the archive at the caller's absolute path as a pod checkpoint (blocking)."""
        if not os.path.isabs(request.input_path):
            raise errors.InvalidArgument("the input path must be absolute")
        return self.import_archive(request.input_path, request)

    def import_archive(self, path: str, request: ImportRequest) -> CheckpointRecord:
        """Import the archive at `path` (a caller's, or a streamed one in scratch space) as a pod checkpoint (blocking)."""
        s = self.settings
        return interop.import_archive(
            self.store, path, namespace=request.namespace or None, name=request.name or None,
            log_root=s.pod_log_root, cgroup_parent=s.cgroup_parent or None, runtime_handler=s.runtime_handler,
            kubelet_root=s.kubelet_root, criu=s.criu, work_dir=s.work_dir, seal_for=self.seal_for,
            limits=interop.ImportLimits(min_free_bytes=s.min_free_bytes),
        )


async def read_archive(path: str) -> AsyncIterator[bytes]:
    """The archive at `path`, in pieces of `ARCHIVE_CHUNK` bytes."""
    with open(path, "rb") as fh:
        while True:
            data = await asyncio.to_thread(fh.read, ARCHIVE_CHUNK)
            if not data:
                break
            yield data


async def _in_thread(
    work: Callable[[registry.ProgressCallback], T], ref: str, progress: Callable[[Progress], None]
) -> T:
    """Run a blocking push or pull in a worker thread, relaying its progress to the event loop."""
    loop = asyncio.get_running_loop()
    ended = threading.Event()
    sent_phase, sent_at = "", 0.0  # of the last event sent (a transfer's reports come one at a time)

    def relay(p: registry.Progress) -> None:
        nonlocal sent_phase, sent_at
        if ended.is_set():  # the call is over: the transfer stops at its next step
            raise errors.Cancelled(f"the transfer of {ref} was cancelled")
        now = _clock()
        if p.phase == sent_phase and now - sent_at < PROGRESS_EVERY:
            return
        sent_phase, sent_at = p.phase, now
        loop.call_soon_threadsafe(progress, Progress(
            p.phase, 0, 0, p.bytes_done, p.bytes_total,
            f"{p.blobs_done}/{p.blobs_total} blobs, {p.skipped} already there",
        ))

    try:
        return await asyncio.to_thread(work, relay)
    finally:
        ended.set()


def scratch_dir(work_dir: str, kind: str) -> str:
    """A private directory of the agent's scratch space (the caller names no path)."""
    os.makedirs(work_dir, mode=0o700, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"{kind}-", dir=work_dir)


def keep_free(directory: str, min_free: int, written: int) -> None:
    """RESOURCE_EXHAUSTED when what a caller streams would leave less than `min_free` bytes free."""
    st = os.statvfs(directory)
    if st.f_bavail * st.f_frsize < min_free:
        raise errors.ResourceExhausted(
            f"the streamed archive ({written >> 20} MiB so far) would leave less than min-free-bytes "
            f"({min_free >> 20} MiB) free under {directory}"
        )
