"""Content-defined chunking of byte streams that arrive in segments.

Rule: the cut points of a file depend only on its content, never on how it
was read. FastCDC decides each cut from at most ``max_size`` bytes after the
chunk's start, so a cut is final once that many bytes are in hand; the bytes
after the last final cut of a segment are carried into the next one. Cutting
a file in segments of any size gives the same chunks as cutting it whole.
This module does no I/O.
"""

from __future__ import annotations

from typing import Final

from pyfastcdc.cy import FastCDC

from node_agent.errors import InvalidArgument

MIN_AVERAGE: Final = 256
MAX_AVERAGE: Final = 4 << 20


class Chunker:
    """FastCDC with ``min = average / 4`` and ``max = average * 4``.

    The expected chunk size is about ``average + min`` (FastCDC skips the
    first ``min`` bytes of a chunk before it looks for a cut).
    """

    def __init__(self, average: int) -> None:
        if isinstance(average, bool) or not isinstance(average, int) or not MIN_AVERAGE <= average <= MAX_AVERAGE:
            raise InvalidArgument(f"chunk size {average!r} is not in [{MIN_AVERAGE}, {MAX_AVERAGE}]")
        self.average = average
        self.min_size = average // 4
        self.max_size = average * 4
        self._cdc = FastCDC(average, min_size=self.min_size, max_size=self.max_size)

    def cut(self, buf: memoryview, *, final: bool) -> tuple[list[tuple[int, int]], int]:
        """Cut ``buf``; return ``([(start, length), ...], consumed)``.

        Without ``final`` (more data follows), cutting stops before the first
        chunk whose decision could depend on bytes beyond ``buf``; the caller
        carries ``buf[consumed:]`` into the next call. With ``final`` every
        byte is consumed.
        """
        cuts: list[tuple[int, int]] = []
        end = len(buf)
        consumed = 0
        for piece in self._cdc.cut_buf(buf):
            start = piece.offset
            if not final and end - start < self.max_size:
                break
            cuts.append((start, piece.length))
            consumed = start + piece.length
        return cuts, consumed
