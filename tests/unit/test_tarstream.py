"""Tests for criu_bridge.tarstream: the strict tar header parser on its own."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path
from typing import Any

import pytest

from criu_bridge import tarstream
from criu_bridge.errors import InvalidInput, LimitExceeded
from criu_bridge.tarstream import (
    BLOCK,
    FileSource,
    Header,
    StreamSource,
    TarStream,
    number,
    parse_pax,
    pax_int,
    pax_mtime_ns,
)
from criu_bridge.tarwrite import pax_record

# ---------------------------------------------------------------------------
# helpers


def header(
    name: bytes = b"f",
    *,
    typeflag: bytes = b"0",
    size: int | bytes = 0,
    mode: bytes = b"0000644\0",
    uid: bytes = b"0001750\0",
    gid: bytes = b"0000012\0",
    mtime: bytes = b"14524321400\0",
    linkname: bytes = b"",
    prefix: bytes = b"",
    magic: bytes = b"ustar\x0000",
    checksum: str = "unsigned",
) -> bytes:
    """One raw header block; `checksum` is "unsigned", "signed" or "bad"."""
    h = bytearray(BLOCK)
    h[0 : len(name)] = name
    h[100:108] = mode
    h[108:116] = uid
    h[116:124] = gid
    h[124:136] = size if isinstance(size, bytes) else b"%011o\0" % size
    h[136:148] = mtime
    h[148:156] = b"        "
    h[156:157] = typeflag
    h[157 : 157 + len(linkname)] = linkname
    h[257:265] = magic
    h[345 : 345 + len(prefix)] = prefix
    unsigned = sum(h)
    signed = unsigned - 256 * sum(1 for b in h if b >= 128)
    value = {"unsigned": unsigned, "signed": signed, "bad": unsigned + 1}[checksum]
    h[148:156] = b"%06o\0 " % value
    return bytes(h)


def padded(data: bytes) -> bytes:
    return data + bytes(-len(data) % BLOCK)


def member(name: bytes, data: bytes = b"", **kw: Any) -> bytes:
    return header(name, size=len(data), **kw) + padded(data)


def pax(records: dict[bytes, bytes] | bytes, typeflag: bytes = b"x") -> bytes:
    body = records if isinstance(records, bytes) else b"".join(pax_record(k, v) for k, v in records.items())
    return header(b"././@PaxHeader", typeflag=typeflag, size=len(body)) + padded(body)


END = bytes(2 * BLOCK)


def stream(data: bytes, **kw: Any) -> TarStream:
    return TarStream(StreamSource(io.BytesIO(data)), **kw)


def headers(data: bytes, **kw: Any) -> list[Header]:
    reader = stream(data, **kw)
    out = []
    while (h := reader.next()) is not None:
        out.append(h)
    return out


def with_tarfile(fmt: int, *members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for info, data in members:
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def info(
    name: str, kind: bytes = tarfile.REGTYPE, data: bytes | None = None, **kw: Any
) -> tuple[tarfile.TarInfo, bytes | None]:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.size = len(data) if data is not None else 0
    for key, value in kw.items():
        setattr(ti, key, value)
    return ti, data


class Trickle:
    """A stream that hands out at most `step` bytes per read, like a pipe or a decompressor."""

    def __init__(self, data: bytes, step: int) -> None:
        self.buf = io.BytesIO(data)
        self.step = step

    def read(self, n: int = -1, /) -> bytes:
        return self.buf.read(min(n, self.step) if n >= 0 else self.step)


# ---------------------------------------------------------------------------
# numbers and checksums


def test_octal_and_base256_numbers() -> None:
    assert number(b"0000644\0", "mode") == 0o644
    assert number(b"  644 \0", "mode") == 0o644
    assert number(b"\0\0\0\0", "mode") == 0
    assert number(b"", "mode") == 0
    assert number(b"\x80" + (10 * 2**30).to_bytes(11, "big"), "size") == 10 * 2**30
    assert number(b"\x81" + bytes(11), "size") == 1 << 88
    with pytest.raises(InvalidInput, match="negative size"):
        number(b"\xff" * 12, "size")
    with pytest.raises(InvalidInput, match="mode field is not octal"):
        number(b"0000648\0", "mode")
    with pytest.raises(InvalidInput, match="not octal"):
        number(b"12 34\0", "uid")


def test_unsigned_and_signed_checksums_are_accepted() -> None:
    high = "é".encode()  # bytes >= 128 make the signed and unsigned sums differ
    for checksum in ("unsigned", "signed"):
        (h,) = headers(member(b"caf" + high, b"data", checksum=checksum) + END)
        assert h.name == b"caf" + high and h.size == 4
    assert tarstream.checksum_ok(header(b"caf" + high, checksum="signed"))
    assert not tarstream.checksum_ok(header(b"caf" + high, checksum="bad"))


def test_bad_checksum_is_refused() -> None:
    with pytest.raises(InvalidInput, match="checksum"):
        headers(member(b"f", checksum="bad") + END)
    with pytest.raises(InvalidInput, match="checksum"):
        headers(os.urandom(BLOCK) + END)


def test_base256_size_in_a_header() -> None:
    data = b"x" * 700
    raw = header(b"big", size=b"\x80" + len(data).to_bytes(11, "big")) + padded(data) + END
    (h,) = headers(raw)
    assert h.size == 700


# ---------------------------------------------------------------------------
# PAX records


def test_pax_records_parse_in_order() -> None:
    data = pax_record(b"path", b"a b=c") + pax_record(b"mtime", b"1.5") + pax_record(b"comment", b"")
    assert parse_pax(data) == [(b"path", b"a b=c"), (b"mtime", b"1.5"), (b"comment", b"")]
    assert parse_pax(b"") == []
    # The length counts itself, across a change in its number of digits.
    for n in range(1, 120):
        rec = pax_record(b"k", b"v" * n)
        assert int(rec.split(b" ", 1)[0]) == len(rec)
        assert parse_pax(rec) == [(b"k", b"v" * n)]


@pytest.mark.parametrize("data,match", [
    (b"12path=abcde\n", r"no length"),
    (b"x1 path=a\n", r"length"),
    (b" path=abc\n", r"length"),
    (b"30 path=a\n", r"malformed PAX record$"),
    (b"9 path=ab\n", r"malformed PAX record$"),
    (b"3 a\n", r"malformed PAX record$"),
    (b"10 path=ab!", r"malformed PAX record$"),
    (b"9 pathab\n", r"no key"),
    (b"6 =ab\n", r"no key"),
    (b"8 path=\n\0\0", r"no length"),
])
def test_malformed_pax_records_are_refused(data: bytes, match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        parse_pax(data)


def test_pax_options() -> None:
    rec = pax_record(b"path", b"p")
    # A NUL where a record would start ends the list only when asked.
    assert parse_pax(rec + bytes(10), nul_ends=True) == [(b"path", b"p")]
    with pytest.raises(InvalidInput):
        parse_pax(rec + bytes(10))
    # Keys that are not UTF-8.
    odd = pax_record(b"\xff\xfe", b"v")
    assert parse_pax(odd) == [(b"\xff\xfe", b"v")]
    with pytest.raises(InvalidInput, match="not UTF-8"):
        parse_pax(odd, text_keys=True)
    # Leading zeros in the length: the number of digits is bounded.
    assert parse_pax(b"0" * 18 + b"28 path=p\n") == [(b"path", b"p")]
    long_len = b"0" * 21 + b"31 path=p\n"
    assert parse_pax(long_len, length_digits=23) == [(b"path", b"p")]
    with pytest.raises(InvalidInput, match="no length"):
        parse_pax(long_len)


def test_pax_numbers() -> None:
    assert pax_int(b"42", "size", 100) == 42
    assert pax_int(b"100", "size", 100) == 100
    with pytest.raises(InvalidInput, match="out of range"):
        pax_int(b"101", "size", 100)
    for bad in (b"-1", b"1.5", b"", b"0x10", b"9" * 21):
        with pytest.raises(InvalidInput, match="not a non-negative integer"):
            pax_int(bad, "size", 1 << 62)
    assert pax_mtime_ns(b"1700000000") == 1_700_000_000 * 10**9
    assert pax_mtime_ns(b"1.5") == 1_500_000_000
    assert pax_mtime_ns(b"1.1234567891") == 1_123_456_789
    assert pax_mtime_ns(b"-2.5") == -2_500_000_000
    assert pax_mtime_ns(b"7.") == 7 * 10**9
    for bad in (b"", b"abc", b".5", b"1.x", b"1e3", b"123456789012"):
        with pytest.raises(InvalidInput):
            pax_mtime_ns(bad)
    with pytest.raises(InvalidInput, match="out of range"):
        pax_mtime_ns(b"8589934592")


def test_pax_header_sets_and_removes_fields() -> None:
    raw = (
        pax({b"path": b"long/" + b"n" * 200, b"linkpath": b"target", b"size": b"3",
             b"SCHILY.xattr.user.k": b"v1", b"SCHILY.xattr.security.capability": b"\x01\x00"})
        + member(b"short", b"abc")
        + pax({b"path": b"first"})
        + pax({b"path": b""})  # an empty record removes the earlier one
        + member(b"second")
        + END
    )
    first, second = headers(raw)
    assert first.name == b"long/" + b"n" * 200 and first.linkname == b"target" and first.size == 3
    assert first.xattrs == [(b"user.k", b"v1"), (b"security.capability", b"\x01\x00")]
    assert b"SCHILY.xattr.user.k" not in first.pax
    assert second.name == b"second" and second.xattrs == []


def test_pax_size_overrides_the_header_and_is_bounded() -> None:
    data = b"y" * 10
    raw = pax({b"size": b"10"}) + header(b"f", size=0) + padded(data) + END
    (h,) = headers(raw)
    assert h.size == 10
    huge = pax({b"size": b"%d" % (1 << 62)}) + header(b"f") + END
    assert stream(huge, max_pax_size=1 << 62).next() is not None
    with pytest.raises(InvalidInput, match="PAX size .* out of range"):
        stream(huge, max_pax_size=(1 << 62) - 1).next()
    with pytest.raises(InvalidInput, match="not a non-negative integer"):
        headers(pax({b"size": b"-1"}) + header(b"f") + END)


def test_malformed_pax_header_in_an_archive() -> None:
    with pytest.raises(InvalidInput, match="malformed PAX record"):
        headers(pax(b"99 path=x\n") + member(b"f") + END)


# ---------------------------------------------------------------------------
# names


def test_ustar_prefix_and_gnu_long_names() -> None:
    (h,) = headers(member(b"name", prefix=b"some/prefix") + END)
    assert h.name == b"some/prefix/name"
    # The prefix field means nothing without the ustar magic.
    (h,) = headers(member(b"name", prefix=b"ignored", magic=b"ustar  \0") + END)
    assert h.name == b"name"
    long_name = "d/" + "n" * 300
    long_link = "t/" + "l" * 200
    raw = with_tarfile(tarfile.GNU_FORMAT, info(long_name, data=b"12"), info("h", tarfile.LNKTYPE, linkname=long_link))
    a, b = headers(raw)
    assert (a.name, a.kind, a.size) == (long_name.encode(), tarstream.FILE, 2)
    assert (b.name, b.kind, b.linkname) == (b"h", tarstream.HARDLINK, long_link.encode())


def test_tarfile_pax_archive_reads_back() -> None:
    raw = with_tarfile(
        tarfile.PAX_FORMAT,
        info("dir", tarfile.DIRTYPE, mode=0o1755, uid=3_000_000, gid=7),
        info("dir/ünï", data=b"content", mode=0o4750, mtime=1_700_000_000.25),
        info("dir/link", tarfile.SYMTYPE, linkname="ünï"),
        info("dir/pipe", tarfile.FIFOTYPE),
    )
    d, f, link, fifo = headers(raw)
    assert (d.name, d.kind, d.mode(), d.owner()) == (b"dir/", tarstream.DIR, 0o1755, (3_000_000, 7))
    assert (f.kind, f.size, f.mode()) == (tarstream.FILE, 7, 0o4750)
    assert f.mtime_ns() == 1_700_000_000_250_000_000
    assert (link.kind, link.linkname) == (tarstream.SYMLINK, "ünï".encode())
    assert fifo.kind == tarstream.FIFO


def test_trailing_slash() -> None:
    # Old tars mark directories by a trailing slash on a regular-file typeflag.
    (h,) = headers(member(b"old/", typeflag=b"\0") + END)
    assert h.kind == tarstream.DIR
    (h,) = headers(member(b"new/", typeflag=b"5") + END)
    assert h.kind == tarstream.DIR
    with pytest.raises(InvalidInput, match="trailing slash"):
        headers(member(b"file/", typeflag=b"0") + END)
    (h,) = headers(member(b"file/", typeflag=b"0") + END, slash_dirs_only=False)
    assert h.kind == tarstream.FILE


# ---------------------------------------------------------------------------
# member kinds


@pytest.mark.parametrize("typeflag,kind", [(b"3", tarstream.CHARDEV), (b"4", tarstream.BLOCKDEV)])
def test_device_members(typeflag: bytes, kind: str) -> None:
    raw = member(b"dev/x", typeflag=typeflag) + END
    with pytest.raises(InvalidInput, match=f"'dev/x': {kind} members are not allowed"):
        headers(raw)
    (h,) = headers(raw, devices=True)
    assert h.kind == kind


@pytest.mark.parametrize("typeflag,match", [
    (b"S", "GNU sparse file"),
    (b"V", "GNU volume header"),
    (b"M", "GNU multi-volume"),
    (b"D", "GNU dump directory"),
    (b"N", "GNU old long name"),
    (b"Z", "unknown member type"),
])
def test_unsupported_and_unknown_types(typeflag: bytes, match: str) -> None:
    with pytest.raises(InvalidInput, match=f"tar member 'm': {match}"):
        headers(member(b"m", typeflag=typeflag) + END, devices=True)


def test_sparse_pax_members_are_refused() -> None:
    with pytest.raises(InvalidInput, match="sparse"):
        headers(pax({b"GNU.sparse.map": b"0,1"}) + member(b"f", b"x") + END)
    with pytest.raises(InvalidInput, match="sparse"):
        headers(pax({b"GNU.sparse.major": b"1", b"GNU.sparse.minor": b"0"}) + member(b"f", b"x") + END)


@pytest.mark.parametrize("typeflag", [b"1", b"2", b"3", b"5", b"6"])
def test_members_without_data_must_say_so(typeflag: bytes) -> None:
    raw = header(b"m", typeflag=typeflag, size=5) + padded(b"hello") + END
    with pytest.raises(InvalidInput, match="tar member 'm': a .* member with 5 bytes of data"):
        headers(raw, devices=True)


def test_contiguous_file_is_a_file() -> None:
    (h,) = headers(member(b"c", b"abc", typeflag=b"7") + END)
    assert h.kind == tarstream.FILE and h.size == 3


# ---------------------------------------------------------------------------
# metadata fields


def test_metadata_is_read_on_demand() -> None:
    (h,) = headers(member(b"f", mode=b"0107755\0", uid=b"0001750\0", gid=b"0000012\0") + END)
    assert h.mode() == 0o7755
    assert h.owner() == (1000, 10)
    assert h.mtime_ns() == 0o14524321400 * 10**9
    # A bad field is only refused when it is read.
    (h,) = headers(member(b"f", mode=b"zzz\0\0\0\0\0") + END)
    with pytest.raises(InvalidInput, match="mode field is not octal"):
        h.mode()


def test_owner_and_mtime_ranges() -> None:
    (h,) = headers(pax({b"uid": b"4294967294", b"gid": b"5"}) + member(b"f") + END)
    assert h.owner() == (2**32 - 2, 5)
    (h,) = headers(pax({b"uid": b"4294967295"}) + member(b"f") + END)
    with pytest.raises(InvalidInput, match="out of range"):
        h.owner()
    (h,) = headers(member(b"f", gid=b"\x80" + (2**32 - 1).to_bytes(7, "big")) + END)
    with pytest.raises(InvalidInput, match="tar member 'f': uid/gid out of range"):
        h.owner()
    (h,) = headers(member(b"f", mtime=b"\x80" + (1 << 33).to_bytes(11, "big")) + END)
    with pytest.raises(InvalidInput, match="tar member 'f': mtime out of range"):
        h.mtime_ns()
    (h,) = headers(pax({b"mtime": b"-1.5"}) + member(b"f") + END)
    assert h.mtime_ns() == -1_500_000_000


# ---------------------------------------------------------------------------
# limits


def test_extended_header_size_limit() -> None:
    ok = pax({b"comment": b"x" * (tarstream.MAX_META_BYTES - 20)})
    assert headers(ok + member(b"f") + END)[0].name == b"f"
    too_big = header(b"././@LongLink", typeflag=b"L", size=tarstream.MAX_META_BYTES + 1)
    with pytest.raises(LimitExceeded, match="extended header of 1048577 bytes"):
        headers(too_big + bytes(tarstream.MAX_META_BYTES + 512))


def test_extended_header_count_limit() -> None:
    eight = pax({b"comment": b"c"}) * tarstream.MAX_META_HEADERS
    assert headers(eight + member(b"f") + END)[0].name == b"f"
    with pytest.raises(InvalidInput, match="too many extended headers"):
        headers(eight + pax({b"comment": b"c"}) + member(b"f") + END)


def test_global_header_limit_counts_the_whole_archive() -> None:
    one = pax(b"", typeflag=b"g") + member(b"f")
    assert len(headers(one * tarstream.MAX_GLOBAL_HEADERS + END)) == tarstream.MAX_GLOBAL_HEADERS
    with pytest.raises(InvalidInput, match="too many global PAX headers"):
        headers(one * (tarstream.MAX_GLOBAL_HEADERS + 1) + END)


# ---------------------------------------------------------------------------
# the end of the archive, truncation and content


def test_one_zero_block_ends_the_archive() -> None:
    reader = stream(member(b"f", b"abc") + bytes(BLOCK) + b"garbage after the end")
    assert reader.next() is not None
    assert reader.next() is None
    assert reader.next() is None


def test_end_without_zero_blocks() -> None:
    raw = member(b"f", b"abc")
    with pytest.raises(InvalidInput, match="truncated"):
        headers(raw)
    assert [h.name for h in headers(raw, eof_ends_archive=True)] == [b"f"]
    assert headers(b"", eof_ends_archive=True) == []


@pytest.mark.parametrize("cut", [1, 100, 511, 512 + 1, 512 + 2999, 512 + 3000, 512 + 3071])
def test_truncation_is_refused_in_every_mode(cut: int) -> None:
    raw = (member(b"f", b"x" * 3000) + member(b"g") + END)[:cut]
    for eof_ends in (False, True):
        with pytest.raises(InvalidInput, match="truncated"):
            headers(raw, eof_ends_archive=eof_ends)


def test_truncated_extended_header() -> None:
    raw = pax({b"path": b"p" * 600})[:700]
    with pytest.raises(InvalidInput, match="truncated"):
        headers(raw, eof_ends_archive=True)


def test_content_is_read_in_pieces_and_skipped_when_unread() -> None:
    raw = member(b"a", b"0123456789") + member(b"b", b"B" * 1000) + member(b"c", b"c") + END
    source = StreamSource(Trickle(raw, 7))
    reader = TarStream(source)
    a = reader.next()
    assert a is not None and a.name == b"a"
    assert reader.read(4) == b"0123"
    assert reader.read(100) == b"456789"
    assert reader.read(100) == b""
    b = reader.next()  # left unread
    assert b is not None and b.name == b"b"
    c = reader.next()
    assert c is not None and reader.read(5) == b"c"
    assert reader.next() is None
    assert source.consumed == 8 * BLOCK  # up to the first zero block


def test_file_source_reads_by_offset(tmp_path: Path) -> None:
    raw = member(b"a", b"hello") + member(b"b", b"x" * 600) + END
    path = tmp_path / "t.tar"
    path.write_bytes(raw + b"beyond the size given")
    fd = os.open(path, os.O_RDONLY)
    try:
        source = FileSource(fd, len(raw))
        reader = TarStream(source)
        a = reader.next()
        assert a is not None and source.pos == BLOCK
        assert os.pread(fd, a.size, source.pos) == b"hello"
        b = reader.next()
        assert b is not None and b.size == 600 and source.pos == 3 * BLOCK
        assert reader.next() is None
        # Reads never go past the size given, even where the file goes on.
        assert FileSource(fd, 100).read_upto(BLOCK) == raw[:100]
        for size in (3 * BLOCK, 3 * BLOCK + 10):  # both members, then no or a partial end block
            cut = TarStream(FileSource(fd, size))
            assert cut.next() is not None and cut.next() is not None
            with pytest.raises(InvalidInput, match="truncated"):
                cut.next()
    finally:
        os.close(fd)


@pytest.mark.parametrize("cut", [BLOCK + 1, BLOCK + 2999, BLOCK + 3000, 7 * BLOCK + 100])
def test_file_source_skip_past_the_end_is_truncation_even_where_the_end_may_end_the_archive(
    tmp_path: Path, cut: int
) -> None:
    # A member cut short and left unread (skipped, not read) must not pass for the end of the archive.
    raw = (member(b"f", b"x" * 3000) + member(b"g", b"y" * 100) + END)[:cut]
    path = tmp_path / "t.tar"
    path.write_bytes(raw)
    fd = os.open(path, os.O_RDONLY)
    try:
        for eof_ends in (False, True):
            reader = TarStream(FileSource(fd, len(raw)), eof_ends_archive=eof_ends)
            with pytest.raises(InvalidInput, match="truncated"):
                while reader.next() is not None:
                    pass
        source = FileSource(fd, 10)
        source.skip(10)
        with pytest.raises(InvalidInput, match="truncated"):
            source.skip(1)
        assert source.pos == 10
    finally:
        os.close(fd)


def test_stream_source_skip_notices_the_end() -> None:
    source = StreamSource(io.BytesIO(b"x" * 10))
    source.skip(4)
    assert source.consumed == 4
    with pytest.raises(InvalidInput, match="truncated"):
        source.skip(7)


def test_pax_record_round_trip_through_tarfile() -> None:
    body = pax_record(b"path", "ü/".encode() * 70 + b"f") + pax_record(b"mtime", b"5")
    raw = header(b"././@PaxHeader", typeflag=b"x", size=len(body)) + padded(body) + member(b"short", b"z") + END
    with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
        (m,) = tf.getmembers()
        assert m.name == "ü/" * 70 + "f" and m.mtime == 5
