"""Staging for a lazy restore: the memory that can come on demand stays in the store.

A full restore materializes every file of a checkpoint's containers. A lazy
one reads each task's pagemap (`pagemap`) first: the pages files that hold
lazy memory (anonymous private pages) are written *sparse*, at their full
size with only the pages that cannot come lazily written in; the page
source serves the rest once the container runs. The restorer materializes
everything else as for a full restore, leaving out the files named here.
"""

from __future__ import annotations

import os
from collections.abc import Collection

from node_agent import errors, podformat
from node_agent.lazy import pagemap
from node_agent.store import CheckpointRecord, Store


def lazy_pages_files(store: Store, record: CheckpointRecord,
                     containers: Collection[str] | None = None) -> dict[str, pagemap.Pagemap]:
    """The pages files that hold memory a lazy restore may leave in the store, with their pagemaps.

    Only those of ``containers`` when given.
    """
    out: dict[str, pagemap.Pagemap] = {}
    for f in record.files:
        m = podformat.PAGEMAP_PATH.match(f.path)
        if not m or f.is_dir or (containers is not None and m.group(1) not in containers):
            continue
        if f.size > pagemap.MAX_PAGEMAP_BYTES:
            raise pagemap.PagemapError(f"{f.path} is larger than {pagemap.MAX_PAGEMAP_BYTES} bytes")
        with store.open(record, f.path) as fh:
            pm = pagemap.parse(fh.pread(0, f.size), int(m.group(2)))
        if pm.lazy_pages:
            out[podformat.image_path(m.group(1), pm.pages_file)] = pm
    return out


def write_sparse_pages(store: Store, record: CheckpointRecord, staging: str, path: str, pm: pagemap.Pagemap) -> None:
    """Create ``staging/path`` at its full size with only the pages that cannot come lazily written in."""
    entry = record.entry(path)
    if entry.size != pm.pages_size:
        raise pagemap.PagemapError(f"{path} holds {entry.size} bytes, its pagemap accounts for {pm.pages_size}")
    parent, _, fname = path.rpartition("/")
    dir_fd = os.open(os.path.join(staging, parent), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd = os.open(fname, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    try:
        os.ftruncate(fd, entry.size)
        with store.open(record, path) as reader:
            for ext in pm.extents:
                if ext.offset < 0 or ext.lazy:
                    continue
                pos, end = ext.offset, ext.offset + ext.nr_pages * pagemap.PAGE_SIZE
                while pos < end:
                    data = reader.pread(pos, min(end - pos, 8 << 20))
                    if not data:
                        raise errors.DataLoss(f"checkpoint {record.id}: {path} ends before offset {pos}")
                    os.pwrite(fd, data, pos)
                    pos += len(data)
        os.fchmod(fd, entry.mode & 0o777)
    finally:
        os.close(fd)
