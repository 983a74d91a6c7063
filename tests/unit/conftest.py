"""What several unit test files share: fixtures by name, helpers by `from conftest import ...`.

Fixtures here are never autouse: a file that wants one names it, for a whole
file with `pytestmark = pytest.mark.usefixtures("no_leaked_threads")`.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import pytest
from hypothesis import settings

# Property tests draw the same examples on every machine and every run (derandomize: seeded from the
# test's name), with no wall-clock deadline and no example database carried between runs: a fresh
# machine's result is never left to chance or to the speed of the machine.
settings.register_profile("node-agent", derandomize=True, deadline=None, database=None, print_blob=True)
settings.load_profile("node-agent")


@pytest.fixture
def no_leaked_threads() -> Iterator[None]:
    """Fails the test when a thread it started is still running at its end."""
    before = set(threading.enumerate())
    yield
    leaked = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert leaked == []


@pytest.fixture
def servers() -> Iterator[list[Any]]:
    """Fake servers a test starts: each is closed (`close()`) when the test ends."""
    started: list[Any] = []
    yield started
    for server in started:
        server.close()


def wait_for(pred: Callable[[], Any], timeout: float = 10.0, what: str = "the condition") -> Any:
    """Poll `pred` until it is true and return its value; fail after `timeout` seconds.

    The way to wait for something to happen. That something did *not* happen
    is shown by a state that excludes it (a process still running, an event
    not set), never by a sleep.
    """
    deadline = time.monotonic() + timeout
    while not (value := pred()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        time.sleep(0.01)
    return value


class Clock:
    """A monotonic clock that moves only when the test moves `t`; `wall()` is the matching epoch time."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def wall(self) -> float:
        return 1_800_000_000.0 + self.t


@contextmanager
def tls_connection(port: int, cafile: str, cert: str | None = None, key: str | None = None) -> Iterator[ssl.SSLSocket]:
    """A TLS connection to 127.0.0.1:`port` as a gRPC (h2) client of `localhost` that trusts `cafile`.

    With `cert` and `key` it presents that client certificate. A refused
    handshake raises here (ssl.SSLError or ConnectionError), or at the first
    read where TLS 1.3 reports the server's alert late.
    """
    ctx = ssl.create_default_context(cafile=cafile)
    if cert:
        ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
            yield tls
