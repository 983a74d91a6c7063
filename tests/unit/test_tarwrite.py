"""Tests for criu_bridge.tarwrite: what the one tar writer puts in ustar fields and PAX records."""

from __future__ import annotations

import io
import tarfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from criu_bridge import tarstream
from criu_bridge.tarstream import BLOCK, DIR, FIFO, FILE, HARDLINK, SYMLINK, MemberReader, StreamSource, TarStream
from criu_bridge.tarwrite import END, TarWriter, member_header, split_ustar_name

NS = 1_000_000_000


def pax_records(headers: bytes) -> dict[bytes, bytes]:
    """The PAX records in front of one member's ustar header, {} if there is none."""
    if headers[156:157] != b"x":
        return {}
    size = tarstream.number(headers[124:136], "size")
    return dict(tarstream.parse_pax(headers[BLOCK : BLOCK + size]))


def ustar_block(headers: bytes) -> bytes:
    return headers[-BLOCK:]


def read_back(data: bytes) -> list[tarstream.Header]:
    reader = TarStream(StreamSource(io.BytesIO(data)), devices=True)
    out = []
    while (h := reader.next()) is not None:
        out.append(h)
    return out


def test_the_writer_output_reads_back_with_tarfile_and_the_member_reader() -> None:
    buf = io.BytesIO()
    tw = TarWriter(buf, mtime_ns=1_700_000_000 * NS, uname=b"root", gname=b"root")
    tw.member(b"d", DIR, 0o755)
    long_name = "d/" + "x" * 150 + "/ünï.img"
    tw.add_bytes(long_name.encode(), 0o640, b"content")
    tw.add_bytes(b"d/empty", 0o600, b"")
    tw.close()
    assert (tw.members, tw.content_bytes) == (3, 7)
    with tarfile.open(fileobj=io.BytesIO(buf.getvalue())) as tf:
        assert tf.getnames() == ["d", long_name, "d/empty"]
        m = tf.getmember(long_name)
        assert m.mode == 0o640 and m.mtime == 1_700_000_000 and m.uname == "root"
        assert tf.extractfile(m).read() == b"content"  # type: ignore[union-attr]
    reader = MemberReader(io.BytesIO(buf.getvalue()), max_member_bytes=100)
    kinds = []
    while (member := reader.next()) is not None:
        kinds.append((member.name.decode(), member.kind, member.size, member.mtime))
    assert kinds == [("d/", DIR, 0, 1_700_000_000), (long_name, FILE, 7, 1_700_000_000),
                     ("d/empty", FILE, 0, 1_700_000_000)]


def test_a_name_that_fits_ustar_needs_no_pax_header() -> None:
    name = b"a" * 120 + b"/" + b"b" * 90
    assert split_ustar_name(name) == (b"a" * 120, b"b" * 90)
    headers = member_header(name, FILE, 0o644)
    assert len(headers) == BLOCK and headers[:90] == b"b" * 90 and headers[345:465] == b"a" * 120
    assert read_back(headers + END)[0].name == name
    assert split_ustar_name(b"x" * 101) is None  # no slash to split at
    assert split_ustar_name(b"a" * 156 + b"/b") is None  # the prefix would be too long


@pytest.mark.parametrize("name,short", [
    (b"x" * 200, b"x" * 100),
    ("dïr/fïle".encode(), b"././@LongName"),
])
def test_a_name_that_does_not_fit_goes_in_a_pax_path(name: bytes, short: bytes) -> None:
    headers = member_header(name, FILE, 0o644)
    assert pax_records(headers) == {b"path": name}
    assert ustar_block(headers)[:100].rstrip(b"\0") == short
    assert read_back(headers + END)[0].name == name


def test_names_and_links_that_are_not_utf8_say_so() -> None:
    headers = member_header(b"bad\xff", SYMLINK, 0o777, linkname=b"t\xfe")
    records = pax_records(headers)
    assert list(records) == [b"hdrcharset", b"path", b"linkpath"] and records[b"hdrcharset"] == b"BINARY"
    h = read_back(headers + END)[0]
    assert (h.name, h.linkname, h.kind) == (b"bad\xff", b"t\xfe", SYMLINK)
    long_link = member_header(b"l", SYMLINK, 0o777, linkname=b"t" * 150)
    assert pax_records(long_link) == {b"linkpath": b"t" * 150}
    assert ustar_block(long_link)[157:257] == b"t" * 100


def test_numbers_beyond_the_ustar_fields_go_in_pax_records() -> None:
    headers = member_header(b"f", FILE, 0o104755, size=8**11, mtime_ns=-5 * NS, uid=8**7, gid=7)
    assert pax_records(headers) == {b"uid": b"%d" % 8**7, b"size": b"%d" % 8**11, b"mtime": b"-5"}
    block = ustar_block(headers)
    assert tarstream.number(block[108:116], "uid") == 0 and tarstream.number(block[116:124], "gid") == 7
    assert tarstream.number(block[124:136], "size") == 0 and tarstream.number(block[136:148], "mtime") == 0
    assert tarstream.number(block[100:108], "mode") == 0o4755  # file type bits dropped, setuid kept


def test_a_fraction_of_a_second_is_kept_in_pax() -> None:
    headers = member_header(b"f", FILE, 0o644, mtime_ns=1_796_128_397_500_000_000)
    assert pax_records(headers) == {b"mtime": b"1796128397.500000000"}
    h = read_back(headers + END)[0]
    assert h.mtime_ns() == 1_796_128_397_500_000_000 and h.field(136, 148, "mtime") == 1_796_128_397


def test_xattrs_directories_and_every_kind() -> None:
    data = b"".join([
        member_header(b"dir", DIR, 0o1755, xattrs=[(b"user.a", b"1"), (b"security.capability", b"\x01\x02")]),
        member_header(b"dir/f", FILE, 0o600, size=3) + b"abc" + bytes(BLOCK - 3),
        member_header(b"dir/h", HARDLINK, 0o600, linkname=b"dir/f"),
        member_header(b"dir/p", FIFO, 0o600),
        member_header(b"dir/c", tarstream.CHARDEV, 0o600),
        END,
    ])
    got = read_back(data)
    assert [(h.name, h.kind) for h in got] == [
        (b"dir/", DIR), (b"dir/f", FILE), (b"dir/h", HARDLINK), (b"dir/p", FIFO), (b"dir/c", tarstream.CHARDEV)]
    assert got[0].xattrs == [(b"user.a", b"1"), (b"security.capability", b"\x01\x02")]
    assert got[0].mode() == 0o1755 and got[2].linkname == b"dir/f"


def test_a_source_that_ends_early_is_eof() -> None:
    tw = TarWriter(io.BytesIO())
    with pytest.raises(EOFError, match="^ünï: the source ended 2 bytes early$"):
        tw.add_file("ünï".encode(), 0o644, 5, io.BytesIO(b"abc"))


class _NonBlocking:
    def write(self, data: memoryview, /) -> int | None:
        return None


def test_a_non_blocking_stream_is_refused() -> None:
    with pytest.raises(OSError, match="non-blocking"):
        TarWriter(_NonBlocking()).close()


_names = st.lists(st.binary(min_size=1, max_size=40).filter(lambda b: b"\0" not in b and b"/" not in b),
                  min_size=1, max_size=8).map(lambda parts: b"/".join(parts))


@settings(max_examples=150, deadline=None)
@given(name=_names, mode=st.integers(0, 0o7777), uid=st.integers(0, 2**32 - 2), gid=st.integers(0, 2**32 - 2),
       mtime_ns=st.integers(0, 2**33 * NS - 1), size=st.integers(0, 3), link=_names)
def test_whatever_is_written_reads_back(name: bytes, mode: int, uid: int, gid: int, mtime_ns: int, size: int,
                                        link: bytes) -> None:
    data = (member_header(name, FILE, mode, size=size, mtime_ns=mtime_ns, uid=uid, gid=gid)
            + b"z" * size + bytes(-size % BLOCK)
            + member_header(name + b"-l", SYMLINK, mode, linkname=link) + END)
    f, ln = read_back(data)
    assert (f.name, f.kind, f.size, f.mode(), f.owner(), f.mtime_ns()) == (name, FILE, size, mode, (uid, gid), mtime_ns)
    assert (ln.name, ln.linkname) == (name + b"-l", link)
    if name.isascii() and link.isascii():
        with tarfile.open(fileobj=io.BytesIO(data)) as tf:
            members = tf.getmembers()
        assert [m.name.encode() for m in members] == [name, name + b"-l"]
        assert (members[0].uid, members[0].gid, members[0].mode) == (uid, gid, mode)
        assert members[1].linkname.encode() == link
