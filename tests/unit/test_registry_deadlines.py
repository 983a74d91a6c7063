"""Deadlines of registry requests and the minimum rate of blobs, against loopback servers that take their time.

Each server here sends (or reads) a byte per second, or a blob below the
minimum rate; the transfer must end in DEADLINE_EXCEEDED when its bound
says so, and not before, with nothing staged left in the store and one
warning in the log. A transfer runs in a thread that the test waits for
only a little longer than the bound: without the deadlines it would run on
for minutes, and the test fails instead of hanging.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from node_agent.config.schema import RegistrySettings
from node_agent.errors import DeadlineExceeded
from node_agent.oci import OCI_MANIFEST_MEDIA_TYPE
from node_agent.registry import Credentials, pull, push
from node_agent.store import Store, kept

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # tests/unit is not a package: make the repository's tests/ importable
    sys.path.insert(0, str(REPO))

from testbed.httpanswers import FakeServer, answer, head_bytes, trickle  # noqa: E402

PLAIN = Credentials(plain_http=True)
BOUND = 2.0
FAST_BLOBS = RegistrySettings(request_timeout=BOUND, min_rate=float(1 << 20))  # a blob of < 2 MiB gets 2 s


@pytest.fixture
def source(tmp_path: Path) -> tuple[Store, str]:
    store = Store(tmp_path / "source-store")
    with store.writer() as w:
        w.add_bytes("containers/app/checkpoint/pages-1.img", os.urandom(200_000))
        w.add_bytes("containers/app/checkpoint/core.img", os.urandom(3000))
        w.add_bytes("spec.dump", b"{}")
        record = w.commit({"kind": "test"})
    return store, record.id


def _blobs(store: Store, cid: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in store.descriptors(cid):
        out.setdefault(d.digest, d.size)
    return out


def _blob(store: Store, digest: str) -> bytes:
    with store.open_blob(digest) as f:
        return f.read()


def _run(fn: Callable[[], Any], limit: float, servers: list[FakeServer]) -> tuple[BaseException | None, float]:
    """Run ``fn`` in a thread; (what it raised, seconds it took). Fails when it is still running after ``limit``."""
    out: dict[str, Any] = {}

    def target() -> None:
        start = time.monotonic()
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["exc"] = exc
        out["elapsed"] = time.monotonic() - start

    thread = threading.Thread(target=target, name="test-transfer", daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        for server in servers:
            server.close()  # the servers stop trickling, so that the transfer ends too
        thread.join(30)
        pytest.fail(f"the transfer was still running after {limit:g}s: no deadline stopped it")
    return out.get("exc"), out["elapsed"]


def _nothing_staged(store: Store) -> None:
    assert store.list() == []
    # Only what the pull brought stays, under a lease kept for a resume (registry.partial-pull-ttl).
    assert all(kept.until(os.path.join(store.ingest_dir, d)) > 0 for d in os.listdir(store.ingest_dir))
    assert os.listdir(store.origins.dir) == []


def _one_warning(caplog: pytest.LogCaptureFixture, op: str, ref: str, what: str) -> str:
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("node_agent.registry")]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{op} of {ref} timed out (DEADLINE_EXCEEDED): ") and what in lines[0], lines[0]
    return lines[0]


def _registry(
    src: Store, cid: str, slow: str, stopping: threading.Event, cdn: FakeServer | None = None
) -> Callable[[BaseHTTPRequestHandler], None]:
    """A registry serving checkpoint ``cid`` whose ``slow`` part comes at a byte per second, until ``stopping``."""
    manifest = src.manifest_bytes(cid)
    blobs = _blobs(src, cid)
    victim = max(blobs, key=lambda d: blobs[d])

    def serve(handler: BaseHTTPRequestHandler) -> None:
        path = handler.path.split("?")[0]
        if slow == "token" and path.startswith("/v2/") and handler.headers.get("Authorization") is None:
            realm = f"http://{handler.headers['Host']}/token"
            answer(handler, 401, b"{}", {"WWW-Authenticate": f'Bearer realm="{realm}",service="fake"'})
        elif path == "/token":
            body = b'{"token": "abc", "expires_in": 300}'
            handler.wfile.write(head_bytes(200, {"Content-Type": "application/json", "Content-Length": str(len(body))}))
            trickle(handler, body, stopping, rate=1)
        elif path == "/v2/ckpt/web/manifests/v1":
            headers = {"Content-Type": OCI_MANIFEST_MEDIA_TYPE, "Content-Length": str(len(manifest)), "Docker-Content-Digest": cid}
            if slow == "status line":
                trickle(handler, head_bytes(200, headers), stopping, rate=1)
            elif slow == "manifest":
                handler.wfile.write(head_bytes(200, headers))
                trickle(handler, manifest, stopping, rate=1)
            else:
                answer(handler, 200, manifest, headers)
        elif path.startswith("/v2/ckpt/web/blobs/"):
            digest = path.rsplit("/", 1)[-1]
            data = _blob(src, digest)
            if digest == victim and slow == "blob":
                handler.wfile.write(head_bytes(200, {"Content-Length": str(len(data))}))
                trickle(handler, data, stopping, rate=1)
            elif digest == victim and slow == "redirected blob":
                assert cdn is not None
                answer(handler, 307, b"", {"Location": f"http://{cdn.netloc}/cdn/{digest}?sig=1"})
            else:
                answer(handler, 200, data)
        else:
            answer(handler, 404)

    return serve


@pytest.mark.parametrize("slow", ["manifest", "blob", "status line", "token", "redirected blob"])
def test_one_byte_per_second_ends_in_deadline_exceeded(
    tmp_path: Path, source: tuple[Store, str], servers: list[FakeServer], caplog: pytest.LogCaptureFixture, slow: str
) -> None:
    src, cid = source
    blobs = _blobs(src, cid)
    victim = max(blobs, key=lambda d: blobs[d])
    cdn = None
    if slow == "redirected blob":

        def slow_cdn(handler: BaseHTTPRequestHandler) -> None:
            data = _blob(src, victim)
            handler.wfile.write(head_bytes(200, {"Content-Length": str(len(data))}))
            trickle(handler, data, cdn_server.stopping, rate=1)

        cdn_server = cdn = FakeServer(slow_cdn)
        servers.append(cdn)
    stopping = threading.Event()
    registry = FakeServer(_registry(src, cid, slow, stopping, cdn), stopping=stopping)
    servers.append(registry)
    ref = f"{registry.netloc}/ckpt/web:v1"
    dst = Store(tmp_path / "dest-store")

    exc, elapsed = _run(lambda: pull(dst, ref, PLAIN, settings=FAST_BLOBS), BOUND + 4, servers)

    assert isinstance(exc, DeadlineExceeded), exc
    assert exc.code == "DEADLINE_EXCEEDED"
    assert BOUND - 0.05 <= elapsed < BOUND + 1.0, elapsed
    text = str(exc)
    assert f"registry {registry.netloc}, repository ckpt/web" in text
    assert f"not finished within {BOUND:g}s" in text
    what = {
        "manifest": "fetching manifest v1", "status line": "fetching manifest v1", "blob": f"downloading blob {victim}",
        "token": "getting a token from", "redirected blob": f"downloading blob {victim}",
    }[slow]
    assert what in text
    if slow in ("blob", "redirected blob"):
        assert f"the longer of registry.request-timeout, 2s, and {blobs[victim]} bytes at registry.min-rate" in text
        assert not dst.has_blob(victim)
    else:
        assert "(registry.request-timeout)" in text
    _nothing_staged(dst)
    _one_warning(caplog, "pull", ref, what)


def test_a_blob_gets_its_size_over_the_minimum_rate(tmp_path: Path, source: tuple[Store, str], servers: list[FakeServer]) -> None:
    """Bound: max(request-timeout, N / min-rate). Slower than min-rate fails there; faster succeeds past request-timeout."""
    src, cid = source
    manifest = src.manifest_bytes(cid)
    blobs = _blobs(src, cid)
    victim = max(blobs, key=lambda d: blobs[d])
    size = blobs[victim]
    settings = RegistrySettings(request_timeout=1.0, min_rate=size / 3)  # the victim gets 3 s
    state = {"rate": size / 6.0}  # would take 6 s

    def serve(handler: BaseHTTPRequestHandler) -> None:
        path = handler.path
        if path == "/v2/ckpt/web/manifests/v1":
            answer(handler, 200, manifest, {"Content-Type": OCI_MANIFEST_MEDIA_TYPE})
        elif path.startswith("/v2/ckpt/web/blobs/"):
            digest = path.rsplit("/", 1)[-1]
            data = _blob(src, digest)
            if digest != victim:
                answer(handler, 200, data)
                return
            handler.wfile.write(head_bytes(200, {"Content-Length": str(len(data))}))
            piece = max(1, int(state["rate"] / 20))
            trickle(handler, data, registry.stopping, rate=state["rate"], piece=piece)
        else:
            answer(handler, 404)

    registry = FakeServer(serve)
    servers.append(registry)
    ref = f"{registry.netloc}/ckpt/web:v1"
    dst = Store(tmp_path / "dest-store")

    exc, elapsed = _run(lambda: pull(dst, ref, PLAIN, settings=settings), 3 + 4, servers)
    assert isinstance(exc, DeadlineExceeded), exc
    assert 3 - 0.05 <= elapsed < 3 + 1.0, elapsed
    assert "not finished within 3s" in str(exc)
    _nothing_staged(dst)

    state["rate"] = size / 2.0  # 2 s: over request-timeout, within the blob's bound
    exc, elapsed = _run(lambda: pull(dst, ref, PLAIN, settings=settings), 3 + 4, servers)
    assert exc is None, exc
    assert elapsed > 1.5
    assert [r.id for r in dst.list()] == [cid]
    assert dst.verify(cid) == []


def test_push_to_a_registry_that_reads_a_byte_per_second(
    tmp_path: Path, servers: list[FakeServer], caplog: pytest.LogCaptureFixture
) -> None:
    """Sends are bounded too: MiBs of blob into a peer that takes a byte a second."""
    src = Store(tmp_path / "source-store", chunk_size=4 << 20)
    with src.writer() as w:
        w.add_bytes("containers/app/checkpoint/pages-1.img", os.urandom(16 << 20))
        cid = w.commit({"kind": "test"}).id
    blobs = _blobs(src, cid)
    victim = max(blobs, key=lambda d: blobs[d])
    received = {"bytes": 0}

    def serve(handler: BaseHTTPRequestHandler) -> None:
        path = handler.path.split("?")[0]
        if handler.command == "HEAD":
            answer(handler, 200 if not path.endswith(victim) else 404)
        elif handler.command == "POST":
            answer(handler, 202, b"", {"Location": "/v2/ckpt/web/blobs/uploads/1"})
        elif handler.command == "PUT" and "/blobs/uploads/" in path:
            while not registry.stopping.is_set() and handler.rfile.read(1):
                received["bytes"] += 1
                registry.stopping.wait(1)
            handler.close_connection = True
        else:
            answer(handler, 404)

    registry = FakeServer(serve, rcvbuf=4096)
    servers.append(registry)
    ref = f"{registry.netloc}/ckpt/web:v1"
    settings = RegistrySettings(request_timeout=BOUND, min_rate=float(64 << 20))

    exc, elapsed = _run(lambda: push(src, cid, ref, PLAIN, settings=settings), BOUND + 4, servers)

    assert isinstance(exc, DeadlineExceeded), exc
    assert BOUND - 0.05 <= elapsed < BOUND + 1.0, elapsed
    assert f"uploading blob {victim}: not finished within 2s" in str(exc)
    assert received["bytes"] < 10
    assert not any(method == "PUT" and "/manifests/" in target for method, target, _ in registry.seen)
    _one_warning(caplog, "push", ref, f"uploading blob {victim}")


def test_a_silent_registry_meets_the_request_deadline_before_the_socket_timeout(tmp_path: Path) -> None:
    with socket.socket() as silent:  # accepts connections (backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded, match=r"fetching manifest v1: not finished within 0.5s \(registry.request-timeout\)"):
            pull(Store(tmp_path / "dest-store"), f"127.0.0.1:{port}/ckpt/web:v1", PLAIN,
                 settings=RegistrySettings(request_timeout=0.5, io_timeout=30.0))
        assert time.monotonic() - start < 1.5


def test_the_lazy_fetcher_keeps_the_same_deadlines(
    tmp_path: Path, source: tuple[Store, str], servers: list[FakeServer], caplog: pytest.LogCaptureFixture
) -> None:
    """A chunk a lazy pull left in the registry, fetched on demand (`RemoteBlobs`), from a registry at a byte per second."""
    from node_agent.registry.fetching import RemoteBlobs

    src, cid = source
    blobs = _blobs(src, cid)
    victim = max(blobs, key=lambda d: blobs[d])
    stopping = threading.Event()
    registry = FakeServer(_registry(src, cid, "blob", stopping), stopping=stopping)
    servers.append(registry)
    dst = Store(tmp_path / "dest-store")
    fetcher = RemoteBlobs(dst, settings=FAST_BLOBS)
    origin = {"reference": f"{registry.netloc}/ckpt/web@{cid}", "plain_http": True}

    class Chunk:
        digest = victim
        stored_size = blobs[victim]

    try:
        exc, elapsed = _run(lambda: fetcher(origin, Chunk()), BOUND + 4, servers)
    finally:
        fetcher.close()
    assert isinstance(exc, DeadlineExceeded), exc
    assert BOUND - 0.05 <= elapsed < BOUND + 1.0, elapsed
    assert f"downloading blob {victim}: not finished within 2s" in str(exc)
    assert not dst.has_blob(victim)
    assert os.listdir(dst.ingest_dir) == []
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert line.startswith(f"fetch of blob {victim} of {origin['reference']} timed out (DEADLINE_EXCEEDED): ")
