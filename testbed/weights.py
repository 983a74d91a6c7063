"""The model server's weights in the Debian image: a seeded float32 matrix in .npy format.

Deterministic (a SHAKE-256 counter stream), every value finite, no two
pages alike; written as a layer of its own without holding it in memory.

Rule: standard library only (see testbed/host.py).
"""

from __future__ import annotations

import hashlib
import os
import tarfile
from collections.abc import Iterable

from testbed.host import TestbedError

# The model server's weights: a float32 matrix of MODEL_COLS columns and MiB * 256 rows
# in .npy format, seeded (SHAKE-256 counter stream), every value finite and no two pages alike.
MODEL_PATH = "opt/model/weights.npy"
MODEL_SEED = b"node-agent-testbed-model-1"
MODEL_COLS = 1024
MODEL_MIB_DEFAULT = 64
MODEL_MIB_MAX = 65536
MODEL_MIB_ENV = "NODE_AGENT_MODEL_MIB"


def seeded_stream(seed: bytes, size: int, chunk: int = 1 << 20) -> Iterable[bytes]:
    """`size` deterministic pseudo-random bytes: SHAKE-256 of `seed` and a little-endian
    64-bit block counter, `chunk` bytes per block."""
    block = 0
    while size > 0:
        n = min(chunk, size)
        yield hashlib.shake_256(seed + block.to_bytes(8, "little")).digest(n)
        size -= n
        block += 1


# Each float32's top byte (sign and the exponent's high 7 bits) is mapped so that
# the exponent lies in 0x70..0x7f: values in +-[2**-15, 2), never NaN, infinite or
# subnormal, with 28 random bits of 32 left.
_FLOAT_TOP = bytes((x & 0x80) | (0x38 + (x & 0x07)) for x in range(256))


def npy_header(shape: tuple[int, ...], descr: str = "<f4") -> bytes:
    """A .npy format 1.0 header, padded (as numpy pads it) so the data starts 64-aligned."""
    text = "{'descr': '%s', 'fortran_order': False, 'shape': (%s), }" % (
        descr, "".join(f"{d}, " for d in shape).rstrip(" ") if len(shape) == 1 else ", ".join(map(str, shape)))
    total = 10 + len(text) + 1
    text += " " * (-total % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text.encode("latin-1")


def model_weights(mib: int, seed: bytes = MODEL_SEED) -> tuple[int, Iterable[bytes]]:
    """The weights file: (its size, its bytes in chunks)."""
    rows = mib * (1 << 20) // (4 * MODEL_COLS)
    header = npy_header((rows, MODEL_COLS))

    def chunks() -> Iterable[bytes]:
        yield header
        for raw in seeded_stream(seed, rows * MODEL_COLS * 4):
            buf = bytearray(raw)
            buf[3::4] = buf[3::4].translate(_FLOAT_TOP)
            yield bytes(buf)

    return len(header) + rows * MODEL_COLS * 4, chunks()


def model_mib(value: int | None) -> int:
    """The weights' size: `--model-mib`, else $NODE_AGENT_MODEL_MIB, else the default."""
    if value is None:
        env = os.environ.get(MODEL_MIB_ENV, "").strip()
        if env:
            try:
                value = int(env)
            except ValueError as exc:
                raise TestbedError(f"{MODEL_MIB_ENV}={env!r} is not a whole number of MiB") from exc
        else:
            value = MODEL_MIB_DEFAULT
    if not 1 <= value <= MODEL_MIB_MAX:
        raise TestbedError(f"the model's size must be 1..{MODEL_MIB_MAX} MiB, not {value}")
    return value


class _ChunkReader:
    """A file-like reader over an iterable of byte chunks (for tarfile.addfile)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self.it = iter(chunks)
        self.buf = b""

    def read(self, n: int = -1) -> bytes:
        while n < 0 or len(self.buf) < n:
            try:
                self.buf += next(self.it)
            except StopIteration:
                break
        if n < 0:
            out, self.buf = self.buf, b""
        else:
            out, self.buf = self.buf[:n], self.buf[n:]
        return out


def weights_layer(mib: int, out: str, path: str = MODEL_PATH, seed: bytes = MODEL_SEED) -> None:
    """Writes the layer that holds a model's weights (uncompressed tar) to `out`: the file
    at `path` (under opt/), seeded by `seed`."""
    size, chunks = model_weights(mib, seed)
    with open(out, "wb") as f, tarfile.open(fileobj=f, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for d in ("opt", os.path.dirname(path)):
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
            tar.addfile(info)
        info = tarfile.TarInfo(path)
        info.size, info.mode, info.mtime = size, 0o644, 0
        tar.addfile(info, _ChunkReader(chunks))
