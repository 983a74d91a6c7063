"""CRIU's pagemap and mm images written by hand, and the process a lazy restore leaves, for the fault handler.

The fault handler's unit tests and bench/lazy_throughput.py set up a process
the way CRIU's restore leaves one (UFFD_PROCESS, run as a script: it maps
memory, registers it with a userfaultfd and hands that over) and describe
its memory with these two images.
"""

from __future__ import annotations

import struct
from pathlib import Path

from criu_bridge.criuimg import encode_varint as _varint
from node_agent.lazy import pagemap

PAGE = pagemap.PAGE_SIZE
LAZY = pagemap.PE_LAZY | pagemap.PE_PRESENT
UFFD_PROCESS = Path(__file__).resolve().parents[1] / "tests" / "unit" / "uffd_process.py"
MAGICS = b"\x19\x43\x56\x54\x25\x40\x08\x56"


def _fields(fields: dict[int, int]) -> bytes:
    return b"".join(_varint(k << 3) + _varint(v) for k, v in fields.items())


def _entry(body: bytes) -> bytes:
    return struct.pack("<I", len(body)) + body


def pagemap_image(extents: list[tuple[int, int, int]]) -> bytes:
    return MAGICS + _entry(_fields({1: 1})) + b"".join(_entry(_fields({1: v, 2: 0, 4: f, 5: n})) for v, n, f in extents)


def mm_image(vmas: list[tuple[int, int]]) -> bytes:
    body = _fields({1: 0, 2: 0})
    for lo, hi in vmas:
        vma = _fields({1: lo, 2: hi, 3: 0, 4: 0, 5: 3, 6: 0x22, 7: 0})
        body += _varint(14 << 3 | 2) + _varint(len(vma)) + vma
    return MAGICS + _entry(body)
