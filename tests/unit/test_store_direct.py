"""store/direct.py: new blob files written past the page cache, byte for byte, on any filesystem."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import io
import mmap
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from node_agent.store.direct import BLOCK, BUFFER, O_DIRECT, NewFile


def _pattern(size: int, seed: int) -> bytes:
    """``size`` bytes that differ between seeds (and almost everywhere along the file)."""
    return random.Random(seed).randbytes(size)


def _write(path: Path, data: bytes, piece: int, how: str = "write") -> NewFile:
    """``data`` into a new file at ``path``, ``piece`` bytes at a time: given (``write``) or read into the
    file's buffer from a stream (``receive``, which must hand every byte to its ``seen`` on the way)."""
    out = NewFile(str(path))
    try:
        if how == "write":
            for at in range(0, len(data), piece):
                out.write(data[at : at + piece])
        else:
            stream, seen = io.BytesIO(data), bytearray()
            while out.receive(stream.readinto, piece, seen.extend):
                pass
            assert seen == data
        out.finish()
    finally:
        out.close()
    return out


def _resident_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache (mincore over a shared mapping of it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vec = ctypes.create_string_buffer(pages)
            assert libc.mincore(address, size, vec) == 0, os.strerror(ctypes.get_errno())
            return sum(byte & 1 for byte in vec.raw)
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)


@pytest.mark.parametrize("size", [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, BUFFER - 1, BUFFER, BUFFER + 1, 3 * BUFFER + 12345])
@pytest.mark.parametrize("piece", [1000, BLOCK, 65536 + 7, 4 * BUFFER])
@pytest.mark.parametrize("how", ["write", "receive"])
def test_a_new_file_holds_exactly_the_bytes_written_whatever_their_length_and_pieces(
        tmp_path: Path, size: int, piece: int, how: str) -> None:
    data = _pattern(size, seed=size ^ piece)
    _write(tmp_path / "blob", data, piece, how)
    assert (tmp_path / "blob").read_bytes() == data
    assert (tmp_path / "blob").stat().st_mode & 0o777 == 0o600


def test_buffers_used_again_carry_nothing_from_the_file_before(tmp_path: Path) -> None:
    """The buffers are kept between files: a short file after a long one holds only its own bytes."""
    _write(tmp_path / "long", _pattern(BUFFER - 5, seed=1), BUFFER)
    short = _pattern(10, seed=2)
    _write(tmp_path / "short", short, 10)
    assert (tmp_path / "short").read_bytes() == short
    with open(tmp_path / "short", "rb") as fh:
        fh.seek(10)
        assert fh.read() == b""


@pytest.fixture
def disk_dir() -> Iterator[Path]:
    """A directory on a disk filesystem, as a store's is (/tmp may be tmpfs, which is all page cache)."""
    path = Path(tempfile.mkdtemp(prefix="na-direct-", dir="/var/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_a_file_written_direct_leaves_the_page_cache_alone(disk_dir: Path) -> None:
    data = _pattern(2 * BUFFER + 100, seed=3)
    out = _write(disk_dir / "blob", data, 65536)
    assert out.direct
    # Only the last block may be in the page cache (the truncation to the file's length reads it in).
    assert _resident_pages(disk_dir / "blob") <= 1
    assert (disk_dir / "blob").read_bytes() == data


def test_a_filesystem_that_refuses_direct_writes_gets_the_same_bytes_through_the_page_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Some filesystems open a file with O_DIRECT and then refuse its writes (EINVAL, as the kernel answers
    a write it cannot align); the file is then written through the page cache, from where it stood."""
    real = os.pwrite
    refused: list[int] = []

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT and offset >= BUFFER:
            refused.append(offset)
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    data = _pattern(3 * BUFFER + 77, seed=4)
    out = _write(tmp_path / "blob", data, 100_000)
    assert (tmp_path / "blob").read_bytes() == data
    if O_DIRECT and refused:
        assert refused == [BUFFER] and not out.direct


@pytest.mark.parametrize("how", ["write", "receive"])
def test_a_filesystem_that_cannot_open_direct_gets_an_ordinary_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    real = os.open

    def refusing(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(path, flags, mode)

    monkeypatch.setattr(os, "open", refusing)
    data = _pattern(BUFFER + 3, seed=5)
    out = _write(tmp_path / "blob", data, 4096, how)
    assert not out.direct
    assert (tmp_path / "blob").read_bytes() == data


def test_a_new_file_never_replaces_one_that_is_there(tmp_path: Path) -> None:
    (tmp_path / "blob").write_bytes(b"old")
    with pytest.raises(FileExistsError):
        NewFile(str(tmp_path / "blob"))
    assert (tmp_path / "blob").read_bytes() == b"old"
