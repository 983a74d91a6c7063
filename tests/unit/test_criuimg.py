"""Tests for criu_bridge.criuimg: CRIU image framing, protobuf fields and varints, checked against protobuf."""

from __future__ import annotations

import struct

import pytest
from google.protobuf.internal.decoder import _DecodeVarint
from google.protobuf.internal.encoder import _VarintBytes
from hypothesis import given
from hypothesis import strategies as st

from criu_bridge import criuimg
from criu_bridge.errors import InvalidInput, LimitExceeded

EDGES = [0, 1, 127, 128, 300, 2**14 - 1, 2**14, 2**31 - 1, 2**32, 2**35, 2**63 - 1, 2**63, 2**64 - 1]


@pytest.mark.parametrize("value", EDGES)
def test_varints_are_encoded_and_read_as_protobuf_does(value: int) -> None:
    encoded = _VarintBytes(value)
    assert criuimg.encode_varint(value) == encoded
    assert criuimg.read_varint(encoded, 0, len(encoded)) == _DecodeVarint(encoded, 0)


@given(st.integers(0, 2**64 - 1), st.binary(max_size=4))
def test_any_varint_reads_as_protobuf_reads_it(value: int, before: bytes) -> None:
    buf = before + _VarintBytes(value) + b"\x01"
    assert criuimg.encode_varint(value) == _VarintBytes(value)
    assert criuimg.read_varint(buf, len(before), len(buf)) == _DecodeVarint(buf, len(before))


@pytest.mark.parametrize("buf", [b"", b"\x80", b"\xff" * 3, b"\x80" * 10 + b"\x01"])
def test_truncated_and_overlong_varints_are_refused(buf: bytes) -> None:
    with pytest.raises(InvalidInput, match="^CRIU image: malformed varint$"):
        criuimg.read_varint(buf, 0, len(buf))
    with pytest.raises(InvalidInput, match="^pagemap of task 1: malformed varint$"):
        criuimg.read_varint(buf, 0, len(buf), "pagemap of task 1")


def test_a_varint_may_not_run_past_its_message() -> None:
    buf = _VarintBytes(300)
    with pytest.raises(InvalidInput, match="malformed varint"):
        criuimg.read_varint(buf, 0, 1)


def test_fields_of_every_wire_type() -> None:
    msg = (_VarintBytes(1 << 3) + _VarintBytes(2**40)
           + _VarintBytes(2 << 3 | 1) + struct.pack("<q", -2)
           + _VarintBytes(3 << 3 | 2) + _VarintBytes(3) + b"abc"
           + _VarintBytes(4 << 3 | 5) + struct.pack("<f", 1.5)
           + _VarintBytes(1 << 3) + _VarintBytes(7))
    got = list(criuimg.fields(msg, 0, len(msg)))
    assert [(n, w) for n, w, _a, _b, _r in got] == [(1, 0), (2, 1), (3, 2), (4, 5), (1, 0)]
    assert got[0][2] == 2**40 and msg[got[2][2] : got[2][3]] == b"abc"
    assert struct.unpack("<q", msg[got[1][2] : got[1][3]]) == (-2,)
    assert b"".join(msg[r:b] for _n, _w, _a, b, r in got) == msg
    assert criuimg.varints(msg, 0, len(msg)) == {1: 7}  # the last of a number wins


@pytest.mark.parametrize("msg,match", [
    (_VarintBytes(0 << 3) + b"\x01", "^CRIU image: field number 0$"),
    (_VarintBytes(1 << 3 | 3), "^CRIU image: unsupported wire type 3$"),
    (_VarintBytes(1 << 3 | 7) + b"\x00", "^CRIU image: unsupported wire type 7$"),
    (_VarintBytes(1 << 3 | 1) + b"\x00" * 7, "^CRIU image: truncated field$"),
    (_VarintBytes(1 << 3 | 5) + b"\x00" * 3, "^CRIU image: truncated field$"),
    (_VarintBytes(1 << 3 | 2) + _VarintBytes(5) + b"abcd", "^CRIU image: truncated field$"),
    (_VarintBytes(1 << 3) + b"\x80", "^CRIU image: malformed varint$"),
])
def test_malformed_fields_are_refused(msg: bytes, match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        list(criuimg.fields(msg, 0, len(msg)))


def _image(magic: int, *payloads: bytes) -> bytes:
    return struct.pack("<II", criuimg.IMG_COMMON_MAGIC, magic) + b"".join(map(criuimg.entry_bytes, payloads))


def test_entries_of_an_image() -> None:
    data = _image(criuimg.FILES_MAGIC, b"ab", b"", b"cde")
    spans = list(criuimg.entries(data, "files.img", magic=criuimg.FILES_MAGIC))
    assert [data[a:b] for a, b in spans] == [b"ab", b"", b"cde"]
    assert list(criuimg.entries(b"\0" * 8, "x")) == []  # magics unchecked unless asked for


@pytest.mark.parametrize("data,match", [
    (b"\0" * 7, "^files.img is truncated$"),
    (_image(criuimg.IDS_MAGIC), "^files.img does not start with CRIU's magic for it$"),
    (_image(criuimg.FILES_MAGIC) + b"\x01\x00", "^files.img: truncated entry length$"),
    (_image(criuimg.FILES_MAGIC) + struct.pack("<I", 5) + b"abcd", "^files.img: truncated entry$"),
])
def test_malformed_images_are_refused(data: bytes, match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        list(criuimg.entries(data, "files.img", magic=criuimg.FILES_MAGIC))


def test_an_entry_over_its_bound_is_a_limit() -> None:
    data = _image(0, b"x" * 300)
    with pytest.raises(LimitExceeded, match="^pagemap of task 3: entry of 300 bytes at 8 is out of bounds$"):
        list(criuimg.entries(data, "pagemap of task 3", max_entry=256))
