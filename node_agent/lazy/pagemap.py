"""CRIU's memory images: which pages of which task live where in a pages file.

A task's ``pagemap-<id>.img`` is a CRIU protobuf image: two magic words,
then length-prefixed messages. The first message (PagemapHead) names the
pages file (``pages-<pages_id>.img``); every later one (PagemapEntry) covers
``nr_pages`` pages from ``vaddr`` with flags: PE_PARENT (the pages are in a
parent image), PE_LAZY (they may be restored on demand) and PE_PRESENT
(their bytes are in this pages file, in entry order).

Images come out of checkpoints, and checkpoints are hostile input: sizes
and counts are bounded, and the entries must be sorted and disjoint.
"""

from __future__ import annotations

import bisect
import os
import re
from dataclasses import dataclass
from typing import Final

from criu_bridge import criuimg
from criu_bridge.errors import InvalidInput

PAGE_SIZE: Final = 4096
PE_PARENT: Final = 1 << 0
PE_LAZY: Final = 1 << 1
PE_PRESENT: Final = 1 << 2

MAX_PAGEMAP_BYTES: Final = 64 << 20
MAX_ENTRY_BYTES: Final = 256
TASK_PAGEMAP: Final = re.compile(r"^pagemap-([0-9]{1,10})\.img$")


class PagemapError(ValueError):
    """A pagemap image that is malformed or out of bounds."""


@dataclass(frozen=True)
class Extent:
    """``nr_pages`` pages from ``vaddr``, stored at ``offset`` of the pages file (when present)."""

    vaddr: int
    nr_pages: int
    flags: int
    offset: int  # -1 when the pages are not in this pages file

    @property
    def end(self) -> int:
        return self.vaddr + self.nr_pages * PAGE_SIZE

    @property
    def lazy(self) -> bool:
        return bool(self.flags & PE_LAZY) and bool(self.flags & PE_PRESENT)


@dataclass(frozen=True)
class Pagemap:
    """One task's memory layout: its pages file and its extents, sorted by address."""

    task_id: int
    pages_id: int
    extents: tuple[Extent, ...]

    @property
    def pages_file(self) -> str:
        return f"pages-{self.pages_id}.img"

    @property
    def pages_size(self) -> int:
        """Bytes of the pages file the extents account for."""
        return sum(e.nr_pages * PAGE_SIZE for e in self.extents if e.offset >= 0)

    @property
    def lazy_pages(self) -> int:
        return sum(e.nr_pages for e in self.extents if e.lazy)

    def find(self, vaddr: int) -> Extent | None:
        """The present extent holding ``vaddr``, or None."""
        i = bisect.bisect_right(self._starts, vaddr) - 1
        if i < 0:
            return None
        ext = self.extents[i]
        return ext if ext.offset >= 0 and ext.vaddr <= vaddr < ext.end else None

    def in_file(self, lo: int, hi: int) -> list[Extent]:
        """The lazy extents whose bytes lie in [lo, hi) of the pages file, in file order."""
        offsets, lazy = self._by_offset
        i = max(0, bisect.bisect_right(offsets, lo) - 1)
        out: list[Extent] = []
        while i < len(lazy) and lazy[i].offset < hi:
            e = lazy[i]
            if e.offset + e.nr_pages * PAGE_SIZE > lo:
                out.append(e)
            i += 1
        return out

    @property
    def _by_offset(self) -> tuple[list[int], list[Extent]]:
        cached = self.__dict__.get("_by_offset_cache")
        if cached is None:
            lazy = sorted((e for e in self.extents if e.lazy), key=lambda e: e.offset)
            cached = ([e.offset for e in lazy], lazy)
            object.__setattr__(self, "_by_offset_cache", cached)
        return cached

    @property
    def _starts(self) -> list[int]:
        starts = self.__dict__.get("_starts_cache")
        if starts is None:
            starts = [e.vaddr for e in self.extents]
            object.__setattr__(self, "_starts_cache", starts)
        return starts


def _fields(data: bytes, start: int, end: int, what: str) -> dict[int, int]:
    """The varint fields of a message; any other wire type is refused."""
    out: dict[int, int] = {}
    for number, wire, value, _end, _raw in criuimg.fields(data, start, end, what):
        if wire != criuimg.VARINT:
            raise PagemapError(f"unexpected wire type {wire} in a pagemap message")
        out[number] = value
    return out


def parse(data: bytes, task_id: int) -> Pagemap:
    """Parse the bytes of ``pagemap-<task_id>.img``; the image framing is `criu_bridge.criuimg`'s."""
    if len(data) > MAX_PAGEMAP_BYTES:
        raise PagemapError(f"pagemap of task {task_id} is larger than {MAX_PAGEMAP_BYTES} bytes")
    try:
        return _parse(data, task_id)
    except InvalidInput as exc:
        raise PagemapError(str(exc)) from None


def _parse(data: bytes, task_id: int) -> Pagemap:
    what = f"pagemap of task {task_id}"
    head: dict[int, int] | None = None
    extents: list[Extent] = []
    offset = 0
    last_end = 0
    # The magics are not checked: the image's name says what it is.
    for start, end in criuimg.entries(data, what, max_entry=MAX_ENTRY_BYTES):
        fields = _fields(data, start, end, what)
        if head is None:
            head = fields
            continue
        vaddr = fields.get(1, -1)
        # CRIU 4 writes the page count as field 5 (uint64); older images use field 2.
        nr_pages = fields.get(5, fields.get(2, 0))
        flags = fields.get(4, PE_PRESENT)
        if vaddr < 0 or vaddr % PAGE_SIZE or nr_pages <= 0 or nr_pages > (1 << 36) or vaddr < last_end:
            raise PagemapError(
                f"pagemap of task {task_id}: bad extent (vaddr {vaddr:#x}, {nr_pages} pages) after {last_end:#x}"
            )
        present = bool(flags & PE_PRESENT)
        extents.append(Extent(vaddr, nr_pages, flags, offset if present else -1))
        if present:
            offset += nr_pages * PAGE_SIZE
        last_end = vaddr + nr_pages * PAGE_SIZE
    if head is None or 1 not in head:
        raise PagemapError(f"pagemap of task {task_id} has no head")
    return Pagemap(task_id, head[1], tuple(extents))


def _read_image(images: str, name: str) -> bytes:
    fd = os.open(os.path.join(images, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size > MAX_PAGEMAP_BYTES:
            raise PagemapError(f"{name} is larger than {MAX_PAGEMAP_BYTES} bytes")
        with os.fdopen(fd, "rb") as fh:
            fd = -1
            return fh.read(MAX_PAGEMAP_BYTES + 1)
    finally:
        if fd >= 0:
            os.close(fd)


def load_dir(images: str) -> dict[int, Pagemap]:
    """Every task pagemap in an images directory, by task id."""
    out: dict[int, Pagemap] = {}
    for name in sorted(os.listdir(images)):
        m = TASK_PAGEMAP.match(name)
        if m:
            task = int(m.group(1))
            out[task] = parse(_read_image(images, name), task)
    return out


def parse_vmas(data: bytes, task_id: int) -> tuple[tuple[int, int], ...]:
    """The (start, end) of every mapping in the bytes of ``mm-<task_id>.img``, sorted and disjoint.

    MmEntry field 14 holds the VmaEntry messages, whose fields 1 and 2 are
    the start and end addresses.
    """
    what = f"memory map of task {task_id}"
    out: list[tuple[int, int]] = []
    try:
        for start, end in criuimg.entries(data, what):
            for number, wire, a, b, _raw in criuimg.fields(data, start, end, what):
                if number != 14 or wire != criuimg.LENGTH:
                    continue
                vma = criuimg.varints(data, a, b, what)
                lo, hi = vma.get(1, -1), vma.get(2, -1)
                if lo < 0 or hi <= lo or lo % PAGE_SIZE or hi % PAGE_SIZE or (out and lo < out[-1][1]):
                    raise PagemapError(f"{what}: bad mapping {lo:#x}-{hi:#x}")
                out.append((lo, hi))
            break  # one MmEntry per image
    except InvalidInput as exc:
        raise PagemapError(str(exc)) from None
    return tuple(out)


def load_vmas(images: str, task_id: int) -> tuple[tuple[int, int], ...]:
    """The mappings of task ``task_id`` (its ``mm-<id>.img``)."""
    return parse_vmas(_read_image(images, f"mm-{task_id}.img"), task_id)


def lazy_ranges(pm: Pagemap, vmas: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    """The lazy extents of ``pm`` cut at mapping edges: one page fill never crosses two mappings."""
    out: list[tuple[int, int]] = []
    starts = [v[0] for v in vmas]
    for ext in pm.extents:
        if not ext.lazy:
            continue
        i = max(0, bisect.bisect_right(starts, ext.vaddr) - 1)
        while i < len(vmas) and vmas[i][0] < ext.end:
            lo, hi = max(ext.vaddr, vmas[i][0]), min(ext.end, vmas[i][1])
            if lo < hi:
                out.append((lo, hi))
            i += 1
    return out
