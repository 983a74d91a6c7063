"""Staging for a paged restore (lazy, or full through the page source): no memory in the plan before the start.

A full restore materializes every file of a checkpoint's containers. A
paged one reads each task's pagemap (`pagemap`) first, and the pages files
stay out of the plan (`read_memory`): the pages CRIU places itself (each
thread's stack page at the dump, file-backed, locked and special mappings)
are read, verified, into the agent's memory instead, while containerd makes
the sandbox, and the page source serves the rest once the processes exist.
When the container starts, its wrapper asks, before CRIU runs, and the
agent writes each pages file *sparse* (`Memory.write`): at its full size,
with only those pages in it. A container created and not started yet thus
has none of its memory in its plan, in the clear or otherwise: it waits in
the agent's memory and in the store, sealed where the checkpoint is.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field

from node_agent import podformat
from node_agent.lazy import pagemap
from node_agent.store import CheckpointRecord, Store
from node_agent.store.documents import Chunk, FileEntry
from node_agent.store.reading import FileReader

# What is read of a pages file at once.
STEP = 8 << 20
# How much of the memory CRIU places itself one restore holds read ahead in the agent's memory (never on
# disk) until its containers start; the rest is read from the store when the wrapper asks.
HELD_BYTES = 64 << 20


@dataclass
class PagesFile:
    """One task's pages file: where it is in the checkpoint, its pagemap, and the runs read ahead."""

    path: str  # in the checkpoint
    pm: pagemap.Pagemap
    size: int
    mode: int
    held: dict[int, bytes] = field(default_factory=dict)  # by offset: runs CRIU places itself, read ahead


@dataclass
class Memory:
    """The memory of one container of a paged restore: its pages files, written only when it starts."""

    store: Store
    record: CheckpointRecord
    files: list[PagesFile] = field(default_factory=list)

    @property
    def held(self) -> int:
        return sum(len(b) for f in self.files for b in f.held.values())

    def write(self, images: str) -> int:
        """Write each pages file into ``images`` (none may be there yet), with only the pages CRIU places
        itself; what is not held is read from the store now. Lets go of what it held; the bytes written."""
        written = 0
        for f in self.files:
            written += _write_sparse(os.path.join(images, f.pm.pages_file), f, self.store, self.record)
            f.held.clear()
        return written


def read_memory(store: Store, record: CheckpointRecord, containers: Collection[str] | None = None,
                budget: int = HELD_BYTES) -> dict[str, Memory]:
    """Every task's pages file of ``containers`` (all when None), by container, with the runs CRIU places
    itself read ahead and verified, ``budget`` bytes in all at most."""
    out: dict[str, Memory] = {}
    left = budget
    for container, pm, entry in pagemaps(store, record, containers):
        pages = PagesFile(entry.path, pm, entry.size, entry.mode)
        with store.open(record, entry.path) as reader:
            for offset, length in placed(pm):
                if length > left:
                    break
                pages.held[offset] = _read(reader, entry.path, offset, length)
                left -= length
        out.setdefault(container, Memory(store, record)).files.append(pages)
    return out


def pagemaps(store: Store, record: CheckpointRecord,
             containers: Collection[str] | None = None) -> Iterator[tuple[str, pagemap.Pagemap, FileEntry]]:
    """Each task's pagemap of ``containers`` (all when None), read from ``store`` and checked against its
    pages file: (the container, the pagemap, the pages file's entry in the checkpoint)."""
    for f in record.files:
        m = podformat.PAGEMAP_PATH.match(f.path)
        if not m or f.is_dir or (containers is not None and m.group(1) not in containers):
            continue
        if f.size > pagemap.MAX_PAGEMAP_BYTES:
            raise pagemap.PagemapError(f"{f.path} is larger than {pagemap.MAX_PAGEMAP_BYTES} bytes")
        with store.open(record, f.path) as fh:
            pm = pagemap.parse(fh.pread(0, f.size), int(m.group(2)))
        path = podformat.image_path(m.group(1), pm.pages_file)
        entry = record.entry(path)
        if entry.size != pm.pages_size:
            raise pagemap.PagemapError(f"{path} holds {entry.size} bytes, its pagemap accounts for {pm.pages_size}")
        yield m.group(1), pm, entry


def placed_chunks(store: Store, record: CheckpointRecord) -> Iterator[Chunk]:
    """The chunks of the pages files that hold what CRIU places itself (`placed`), which CreateContainer
    reads (`read_memory`): each pages file's in its order, a chunk once per file."""
    for _container, pm, entry in pagemaps(store, record):
        starts = [c.offset for c in entry.chunks]
        seen: set[int] = set()
        for offset, length in placed(pm):
            i = max(0, bisect.bisect_right(starts, offset) - 1)
            while i < len(entry.chunks) and entry.chunks[i].offset < offset + length:
                if i not in seen:
                    seen.add(i)
                    yield entry.chunks[i]
                i += 1


def placed(pm: pagemap.Pagemap) -> list[tuple[int, int]]:
    """The runs of ``pm``'s pages file that CRIU places itself (not lazily): (offset, bytes) each."""
    return [(e.offset, e.nr_pages * pagemap.PAGE_SIZE) for e in pm.extents if e.offset >= 0 and not e.lazy]


def _read(reader: FileReader, path: str, offset: int, length: int) -> bytes:
    data = reader.pread(offset, length)
    if len(data) != length:
        raise pagemap.PagemapError(f"{path}: {len(data)} bytes at offset {offset}, not {length}")
    return data


def _write_sparse(dest: str, f: PagesFile, store: Store, record: CheckpointRecord) -> int:
    """Create ``dest`` (it must not exist) at its full size with only the runs CRIU places itself."""
    parent, fname = os.path.split(dest)
    dir_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd = os.open(fname, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    written = 0
    try:
        os.ftruncate(fd, f.size)
        missing = [(o, n) for o, n in placed(f.pm) if o not in f.held]
        for offset, data in f.held.items():
            written += _pwrite_all(fd, data, offset)
        if missing:
            with store.open(record, f.path) as reader:
                for offset, length in missing:
                    for at in range(offset, offset + length, STEP):
                        step = min(STEP, offset + length - at)
                        written += _pwrite_all(fd, _read(reader, f.path, at, step), at)
        os.fchmod(fd, f.mode & 0o777)
    finally:
        os.close(fd)
    return written


def _pwrite_all(fd: int, data: bytes, offset: int) -> int:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
    return len(data)
