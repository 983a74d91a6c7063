"""Which pages of a restored process still wait for their bytes, where they are now and where they were.

A lazily restored process's memory that has not come in yet is a set of
disjoint page ranges (spans). Each span knows its address in the process
now and the address it had in the checkpoint (its image address, by which
its bytes are found in the pages file). The two part when the process moves
memory with ``mremap``; image addresses never change. The fault handler
keeps one set of waiting spans per process and one per copy in flight, and
updates all of them as the process's map changes (REMAP, REMOVE, UNMAP).

Not thread-safe: the handler holds its lock around every call.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

PAGE_SIZE = 4096


@dataclass
class Span:
    start: int  # address in the process now
    end: int
    img: int  # address of ``start`` in the checkpoint

    @property
    def size(self) -> int:
        return self.end - self.start

    def image(self, addr: int) -> int:
        """The image address of ``addr`` (inside this span)."""
        return self.img + (addr - self.start)


class Spans:
    """Disjoint spans sorted by their address now."""

    def __init__(self, spans: Iterable[Span] = ()) -> None:
        self._spans: list[Span] = []
        self._keys: list[int] = []  # the spans' starts, kept beside them for bisect
        self._moved = False  # some span is no longer at its image address
        for s in sorted(spans, key=lambda s: s.start):
            if s.end > s.start:
                self._add(Span(s.start, s.end, s.img))

    def __bool__(self) -> bool:
        return bool(self._spans)

    def __iter__(self) -> Iterator[Span]:
        return iter(list(self._spans))

    def __len__(self) -> int:
        return len(self._spans)

    @property
    def bytes(self) -> int:
        return sum(s.size for s in self._spans)

    def copy(self) -> Spans:
        return Spans(self._spans)

    def first(self) -> Span | None:
        return self._spans[0] if self._spans else None

    def find(self, addr: int) -> Span | None:
        """The span holding ``addr``, or None."""
        i = bisect.bisect_right(self._keys, addr) - 1
        if i >= 0 and self._spans[i].start <= addr < self._spans[i].end:
            return self._spans[i]
        return None

    def at_or_after(self, addr: int) -> Span | None:
        """The first span that ends after ``addr``; the first of all when none does."""
        i = bisect.bisect_right(self._keys, addr) - 1
        if i >= 0 and self._spans[i].end > addr:
            return self._spans[i]
        i += 1
        if i < len(self._spans):
            return self._spans[i]
        return self.first()

    def take(self, start: int, end: int) -> list[Span]:
        """Remove the parts of the spans inside [start, end) and return them."""
        out: list[Span] = []
        if end <= start:
            return out
        i = max(0, bisect.bisect_right(self._keys, start) - 1)
        while i < len(self._spans):
            s = self._spans[i]
            if s.start >= end:
                break
            if s.end <= start:
                i += 1
                continue
            lo, hi = max(s.start, start), min(s.end, end)
            out.append(Span(lo, hi, s.image(lo)))
            rest = []
            if s.start < lo:
                rest.append(Span(s.start, lo, s.img))
            if hi < s.end:
                rest.append(Span(hi, s.end, s.image(hi)))
            self._spans[i:i + 1] = rest
            self._keys[i:i + 1] = [r.start for r in rest]
            i += len(rest)
        return out

    def drop_image(self, img_start: int, img_end: int) -> None:
        """Remove the parts whose image addresses lie in [img_start, img_end) (bytes that came in)."""
        self.take_image(img_start, img_end)

    def take_image(self, img_start: int, img_end: int) -> list[Span]:
        """Remove the parts whose image addresses lie in [img_start, img_end) and return them."""
        if not self._moved:  # every span where it was in the checkpoint: image addresses are addresses
            return self.take(img_start, img_end)
        out: list[Span] = []
        for s in [s for s in self._spans if s.img < img_end and s.img + s.size > img_start]:
            lo = max(img_start, s.img) - s.img + s.start
            hi = min(img_end, s.img + s.size) - s.img + s.start
            out += self.take(lo, hi)
        return out

    def add(self, span: Span) -> None:
        """Add ``span``; whatever it overlaps is replaced."""
        if span.end > span.start:
            self.take(span.start, span.end)
            self._add(Span(span.start, span.end, span.img))

    def remap(self, frm: int, to: int, length: int) -> None:
        """The process moved [frm, frm + length) to ``to``; what was at the destination is gone."""
        moved = self.take(frm, frm + length)
        self.take(to, to + length)
        for s in moved:
            self.add(Span(s.start + to - frm, s.end + to - frm, s.img))

    def _add(self, span: Span) -> None:
        self._moved = self._moved or span.start != span.img
        i = bisect.bisect_left(self._keys, span.start)
        self._spans.insert(i, span)
        self._keys.insert(i, span.start)
