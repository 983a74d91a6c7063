"""How a chunk's bytes are stored: zstd level 1, or as they are.

Rule: encoding is deterministic (the same content always gives the same
stored bytes, hence the same blob digest): one-shot zstd frames with fixed
parameters, the content size in the header, no checksum, no dictionary and
no worker threads inside zstd. A chunk that does not shrink by at least an
eighth is stored as it is ("identity"). Decoding treats the stored bytes
as hostile: the frame must declare exactly the expected size, hold nothing
after its end, and inflate to exactly that size. Compressors are per
thread (zstd contexts are not thread-safe); zstd and hashlib release the
GIL on large buffers, so callers spread chunks over threads. This module
does no I/O.
"""

from __future__ import annotations

import threading
from typing import Final

import zstandard

from node_agent.store.documents import IDENTITY, ZSTD

ZSTD_LEVEL: Final = 1

_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    cctx: zstandard.ZstdCompressor | None = getattr(_local, "cctx", None)
    if cctx is None:
        cctx = zstandard.ZstdCompressor(
            level=ZSTD_LEVEL, write_checksum=False, write_content_size=True, write_dict_id=False, threads=0
        )
        _local.cctx = cctx
    return cctx


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx: zstandard.ZstdDecompressor | None = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = zstandard.ZstdDecompressor()
        _local.dctx = dctx
    return dctx


# A chunk is kept compressed only when that saves at least an eighth of it
# (KEEP_RATIO). Memory that shrinks by less, such as float weights (a few
# percent, all of it from entropy-coding their exponent bytes), is the
# kind zstd decodes slowest, at about 1.2 GB/s per core against sha256's
# 1.8: every restore and every node that pulls it would spend more CPU
# decoding than the store and the link save.
KEEP_RATIO: Final = 7 / 8

# Probing small windows first spares compressing whole chunks that won't
# shrink enough (most process memory of a model server is such data). The
# windows are spread over the whole chunk, one per PROBE_STRIDE (at least
# three: start, middle, end), so a compressible stretch inside a large
# chunk (zero pages beside weights) is found. The probe depends only on
# the chunk's content, so encoding stays deterministic.
PROBE: Final = 4096
PROBE_MIN_SIZE: Final = 64 << 10
PROBE_RATIO: Final = 0.9  # a 4 KiB window shrinks a little less than its whole chunk
PROBE_STRIDE: Final = 256 << 10


def probe_offsets(n: int) -> list[int]:
    """Where the probes of a chunk of ``n`` bytes (at least PROBE_MIN_SIZE) start."""
    count = max(3, n // PROBE_STRIDE + 1)
    last = n - PROBE
    return sorted({i * last // (count - 1) for i in range(count)})


def _looks_incompressible(data: bytes | bytearray | memoryview) -> bool:
    n = len(data)
    if n < PROBE_MIN_SIZE:
        return False
    view = memoryview(data)
    cctx = _compressor()
    for start in probe_offsets(n):
        if len(cctx.compress(view[start : start + PROBE])) < PROBE * PROBE_RATIO:
            return False
    return True


def encode(data: bytes | bytearray | memoryview) -> tuple[bytes | bytearray | memoryview, str]:
    """The stored form of a chunk and its encoding name; identity returns ``data`` itself, the same object."""
    if _looks_incompressible(data):
        return data, IDENTITY
    packed = _compressor().compress(data)
    if len(packed) <= len(data) * KEEP_RATIO:
        return packed, ZSTD
    return data, IDENTITY


class DecodeError(ValueError):
    """Stored bytes that do not decode to the declared content."""


def decode(stored: bytes, encoding: str, size: int) -> bytes:
    """The content of a chunk from its stored bytes; DecodeError when they don't fit ``size``."""
    if encoding == IDENTITY:
        if len(stored) != size:
            raise DecodeError(f"identity chunk of {len(stored)} bytes, expected {size}")
        return stored
    if encoding != ZSTD:
        raise DecodeError(f"unsupported encoding {encoding!r}")
    try:
        declared = zstandard.frame_content_size(stored)
    except zstandard.ZstdError as exc:
        raise DecodeError(f"not a zstd frame: {exc}") from None
    if declared != size:
        shown = "no size" if declared < 0 else f"{declared} bytes"
        raise DecodeError(f"zstd frame declares {shown}, expected {size}")
    try:
        data = _decompressor().decompress(stored, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise DecodeError(f"zstd frame does not decompress: {exc}") from None
    if len(data) != size:
        raise DecodeError(f"zstd frame inflates to {len(data)} bytes, expected {size}")
    return data
