"""How a response's bytes are received: a large read in one receive, within the connection's pace.

A body read into a large buffer is gathered by the kernel (one receive that
returns once the buffer is full), not a receive and a wake-up per arrival;
the status line and headers, read a buffer's worth at a time, take what has
come. A peer that stops part-way still ends each receive within the
io-timeout, with what came or, if nothing did, a timeout.
"""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
import threading
import time
from collections.abc import Iterator

import pytest

from node_agent.registry.connection import WHOLE_ABOVE, Pace, _SocketReader

BIG = 256 << 10


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _reader(sock: socket.socket, io_timeout: float) -> _SocketReader:
    return _SocketReader(sock, Pace(io_timeout), sock.makefile("rb"))


def _queued(sock: socket.socket) -> int:
    """Bytes waiting in ``sock``'s receive queue."""
    return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0])


def test_a_large_read_returns_once_every_byte_came_though_they_came_apart(
        pair: tuple[socket.socket, socket.socket]) -> None:
    ours, peer = pair
    half = BIG // 2

    def send() -> None:
        peer.sendall(b"a" * half)
        while _queued(ours):  # the reader has taken the first half, and is waiting in its receive
            threading.Event().wait(0.001)
        peer.sendall(b"b" * (BIG - half))

    sender = threading.Thread(target=send)
    sender.start()
    buf = bytearray(BIG)
    got = _reader(ours, 30.0).readinto(buf)
    sender.join()
    assert got == BIG  # a receive per arrival would have returned the first half alone
    assert buf == b"a" * half + b"b" * (BIG - half)


def test_a_buffers_worth_takes_what_has_come(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, peer = pair
    peer.sendall(b"HTTP/1.1 200 OK\r\n\r\n")
    start = time.monotonic()
    buf = bytearray(WHOLE_ABOVE)
    assert _reader(ours, 30.0).readinto(buf) == 19
    assert time.monotonic() - start < 10  # not the io-timeout's 30 s


def test_a_peer_that_stops_part_way_ends_the_receive_within_the_io_timeout(
        pair: tuple[socket.socket, socket.socket]) -> None:
    ours, peer = pair
    peer.sendall(b"x" * 1000)
    reader = _reader(ours, 0.3)
    buf = bytearray(BIG)
    assert reader.readinto(buf) == 1000  # what came, once the io-timeout passed
    with pytest.raises(TimeoutError):
        reader.readinto(buf)  # nothing more: a timeout, as any receive's


def test_the_peer_closing_ends_a_large_read_with_what_came(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, peer = pair
    peer.sendall(b"y" * 5000)
    peer.shutdown(socket.SHUT_WR)
    reader = _reader(ours, 30.0)
    buf = bytearray(BIG)
    assert reader.readinto(buf) == 5000
    assert reader.readinto(buf) == 0
