"""Push and pull against a real registry (docker-registry 2.8 on 127.0.0.1).

Interruptions are real: a progress callback that raises part-way through a
blob, or a child process killed with SIGKILL while it is blocked in the
middle of a transfer. Hostile or redirecting servers, which the real
registry never is, are small HTTP servers on loopback.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from node_agent.config.schema import RegistrySettings
from node_agent.errors import (
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from node_agent.oci import OCI_MANIFEST_MEDIA_TYPE
from node_agent.registry import Credentials, Progress, pull, push
from node_agent.store import Store

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # tests/unit is not a package: make the repository's tests/ importable
    sys.path.insert(0, str(REPO))

from testbed.httpanswers import FakeServer, answer  # noqa: E402
from testbed.registry import Registry  # noqa: E402

MiB = 1 << 20
PLAIN = Credentials(plain_http=True)
ONE_LANE = RegistrySettings(connections=1)  # blob after blob: a transfer cut at a byte count stops at a known blob


class Stop(Exception):
    """Raised by a progress callback to interrupt a transfer."""


# -- helpers -------------------------------------------------------------------------------


def _make_checkpoint(store: Store) -> tuple[str, dict[str, bytes]]:
    files = {
        "containers/app/checkpoint/pages-1.img": os.urandom(12 * MiB),
        "containers/app/checkpoint/core.img": os.urandom(3000),
        "containers/app/config.dump": b'{"id": "abc"}',
        "spec.dump": b"{}",
    }
    with store.writer() as w:
        for path, data in files.items():
            w.add_bytes(path, data)
        w.add_dir("containers/app/empty")
        record = w.commit({"kind": "test"}, annotations={"io.node-agent.test": "registry"})
    return record.id, files


@pytest.fixture
def source(tmp_path: Path) -> tuple[Store, str, dict[str, bytes]]:
    store = Store(tmp_path / "source-store", chunk_size=4 * MiB)  # big chunks: a transfer can stop inside one
    cid, files = _make_checkpoint(store)
    return store, cid, files


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    with Registry(tmp_path / "registry") as r:
        yield r


def _blobs(store: Store, cid: str) -> list[tuple[str, int]]:
    out: dict[str, int] = {}
    for d in store.descriptors(cid):
        out.setdefault(d.digest, d.size)
    return list(out.items())


def _assert_same(src: Store, dst: Store, cid: str, files: dict[str, bytes] | None = None, tmp: Path | None = None) -> None:
    assert dst.get(cid).id == cid
    assert dst.manifest_bytes(cid) == src.manifest_bytes(cid)
    assert _blobs(dst, cid) == _blobs(src, cid)
    assert dst.verify(cid) == []
    if files is not None and tmp is not None:
        dest = tmp / "materialized"
        dest.mkdir()
        dst.materialize(cid, dest)
        for path, data in files.items():
            assert (dest / path).read_bytes() == data


def _interrupt_point(blobs: list[tuple[str, int]]) -> tuple[int, int]:
    """(blobs wholly before the largest layer, a byte count 1 MiB into that layer)."""
    index = max(range(1, len(blobs)), key=lambda i: blobs[i][1])
    assert blobs[index][1] > 2 * MiB, blobs
    before = sum(size for _, size in blobs[:index])
    return index, before + 1


def _stopper(threshold: int) -> Callable[[Progress], None]:
    def progress(p: Progress) -> None:
        if p.phase == "blobs" and p.bytes_done >= threshold:
            raise Stop
    return progress


def _manifest_status(registry: Registry, target: str, user: str = "") -> int:
    status, _ = registry.request("GET", f"/v2/ckpt/web/manifests/{target}", user=user, headers={"Accept": OCI_MANIFEST_MEDIA_TYPE})
    return status


# -- push and pull ---------------------------------------------------------------------------


def test_push_then_pull_into_an_empty_store(tmp_path: Path, registry: Registry, source: tuple[Store, str, dict[str, bytes]]) -> None:
    src, cid, files = source
    blobs = _blobs(src, cid)
    total = sum(size for _, size in blobs)
    events: list[Progress] = []
    report = push(src, cid, registry.ref("ckpt/web:v1"), PLAIN, progress=events.append)
    assert report.digest == cid
    assert report.ref == f"{registry.host}/ckpt/web:v1@{cid}"
    assert (report.blobs_uploaded, report.blobs_skipped, report.bytes_uploaded) == (len(blobs), 0, total)
    assert events[-1] == Progress("done", len(blobs), len(blobs), total, total, 0)
    assert [e.bytes_done for e in events] == sorted(e.bytes_done for e in events)
    assert {e.phase for e in events} == {"blobs", "manifest", "done"}

    status, body = registry.request("GET", "/v2/ckpt/web/manifests/v1", headers={"Accept": OCI_MANIFEST_MEDIA_TYPE})
    assert (status, body) == (200, src.manifest_bytes(cid))
    assert registry.blob_data(cid).read_bytes() == src.manifest_bytes(cid)

    dst = Store(tmp_path / "dest-store")
    events = []
    got = pull(dst, registry.ref("ckpt/web:v1"), PLAIN, progress=events.append)
    assert (got.checkpoint_id, got.blobs_downloaded, got.blobs_skipped, got.bytes_downloaded) == (cid, len(blobs), 0, total)
    assert events[-1] == Progress("done", len(blobs), len(blobs), total, total, 0)
    assert [e.phase for e in events][:2] == ["manifest", "blobs"]
    _assert_same(src, dst, cid, files, tmp_path)

    again = pull(dst, registry.ref(f"ckpt/web@{cid}"), PLAIN)
    assert (again.checkpoint_id, again.blobs_downloaded, again.blobs_skipped, again.bytes_downloaded) == (cid, 0, len(blobs), 0)


def test_pushing_again_uploads_nothing(registry: Registry, source: tuple[Store, str, dict[str, bytes]]) -> None:
    src, cid, _ = source
    n = len(_blobs(src, cid))
    push(src, cid, registry.ref("ckpt/web:v1"), PLAIN)
    for ref in ("ckpt/web:v1", "ckpt/web:v2", f"ckpt/web@{cid}", f"ckpt/web:v3@{cid}"):
        events: list[Progress] = []
        report = push(src, cid, registry.ref(ref), PLAIN, progress=events.append)
        assert (report.blobs_uploaded, report.blobs_skipped, report.bytes_uploaded) == (0, n, 0)
        assert events[-1].skipped == n
    for tag in ("v2", "v3", cid):
        assert _manifest_status(registry, tag) == 200


def test_push_checks_the_reference(registry: Registry, source: tuple[Store, str, dict[str, bytes]]) -> None:
    src, cid, _ = source
    with pytest.raises(InvalidArgument, match="names digest"):
        push(src, cid, registry.ref("ckpt/web@sha256:" + "0" * 64), PLAIN)
    with pytest.raises(InvalidArgument):
        push(src, cid, "ckpt/web:v1", PLAIN)
    with pytest.raises(NotFound):
        push(src, "sha256:" + "0" * 64, registry.ref("ckpt/web:v1"), PLAIN)
    with pytest.raises(InvalidArgument, match="neither a tag nor a digest"):
        pull(src, registry.ref("ckpt/web"), PLAIN)


def test_interrupted_push_resumes(tmp_path: Path, registry: Registry, source: tuple[Store, str, dict[str, bytes]]) -> None:
    src, cid, _ = source
    blobs = _blobs(src, cid)
    total = sum(size for _, size in blobs)
    done_before, threshold = _interrupt_point(blobs)
    with pytest.raises(Stop):
        push(src, cid, registry.ref("ckpt/web:v1"), PLAIN, progress=_stopper(threshold), settings=ONE_LANE)
    assert _manifest_status(registry, "v1") == 404  # nothing published half-way

    report = push(src, cid, registry.ref("ckpt/web:v1"), PLAIN)
    assert report.blobs_skipped == done_before
    assert report.blobs_uploaded == len(blobs) - done_before
    assert report.bytes_uploaded == total - sum(size for _, size in blobs[:done_before])
    dst = Store(tmp_path / "dest-store")
    assert pull(dst, registry.ref("ckpt/web:v1"), PLAIN).bytes_downloaded == total
    _assert_same(src, dst, cid)


def test_callback_errors_pass_through_unchanged(registry: Registry, source: tuple[Store, str, dict[str, bytes]]) -> None:
    """An OSError from the progress callback is not taken for a network failure (nor retried)."""
    src, cid, _ = source

    class Refused(ConnectionResetError):
        pass

    def progress(p: Progress) -> None:
        if p.phase == "blobs" and p.bytes_done > 0:
            raise Refused

    with pytest.raises(Refused):
        push(src, cid, registry.ref("ckpt/web:v1"), PLAIN, progress=progress)


def test_interrupted_pull_resumes(tmp_path: Path, registry: Registry, source: tuple[Store, str, dict[str, bytes]]) -> None:
    src, cid, files = source
    blobs = _blobs(src, cid)
    total = sum(size for _, size in blobs)
    push(src, cid, registry.ref("ckpt/web:v1"), PLAIN)
    done_before, threshold = _interrupt_point(blobs)
    dst = Store(tmp_path / "dest-store")
    with pytest.raises(Stop):
        pull(dst, registry.ref("ckpt/web:v1"), PLAIN, progress=_stopper(threshold), settings=ONE_LANE)
    assert dst.list() == []
    with pytest.raises(NotFound):
        dst.get(cid)

    report = pull(dst, registry.ref("ckpt/web:v1"), PLAIN)
    assert report.blobs_skipped == done_before
    assert report.bytes_downloaded == total - sum(size for _, size in blobs[:done_before])
    _assert_same(src, dst, cid, files, tmp_path)


_CHILD = r"""
import sys
import time
from node_agent.config.schema import RegistrySettings
from node_agent.registry import Credentials, pull, push
from node_agent.store import Store

op, root, ref, threshold, cid = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
linked = sys.argv[6:]  # blobs a pull has brought by then: its link threads link them meanwhile

def progress(p):
    if p.phase == "blobs" and p.bytes_done >= threshold:
        blobs, deadline = Store(root).blobs, time.monotonic() + 60
        while any(blobs.size_of(d) is None for d in linked) and time.monotonic() < deadline:
            time.sleep(0.01)
        print("stopped", p.blobs_done, p.bytes_done, flush=True)
        sys.stdin.read()  # hold the transfer open here until killed

store = Store(root)
one_lane = RegistrySettings(connections=1)  # blob after blob, so that the cut falls where the test says
if op == "push":
    push(store, cid, ref, Credentials(plain_http=True), progress=progress, settings=one_lane)
else:
    pull(store, ref, Credentials(plain_http=True), progress=progress, settings=one_lane)
print("finished", flush=True)
"""


def _kill_mid_transfer(op: str, root: Path, ref: str, threshold: int, cid: str = "",
                       linked: Iterable[str] = ()) -> tuple[int, int]:
    """Run a push or pull in a child, SIGKILL it while a blob is in flight (once the blobs ``linked`` are in its
    store); return (blobs_done, bytes_done)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, op, str(root), ref, str(threshold), cid, *linked],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    guard = threading.Timer(120, proc.kill)
    guard.start()
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("stopped"), (line, proc.stderr.read() if proc.stderr else "")
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        guard.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    _, blobs_done, bytes_done = line.split()
    return int(blobs_done), int(bytes_done)


def test_push_killed_mid_blob_resumes(tmp_path: Path, registry: Registry, source: tuple[Store, str, dict[str, bytes]]) -> None:
    src, cid, _ = source
    blobs = _blobs(src, cid)
    done_before, threshold = _interrupt_point(blobs)
    root = tmp_path / "source-store"
    blobs_done, bytes_done = _kill_mid_transfer("push", root, registry.ref("ckpt/web:v1"), threshold, cid)
    assert blobs_done == done_before and bytes_done > sum(size for _, size in blobs[:done_before])
    assert _manifest_status(registry, "v1") == 404

    report = push(src, cid, registry.ref("ckpt/web:v1"), PLAIN)
    assert report.blobs_skipped == done_before
    assert report.bytes_uploaded == sum(size for _, size in blobs[done_before:])
    dst = Store(tmp_path / "dest-store")
    pull(dst, registry.ref("ckpt/web:v1"), PLAIN)
    _assert_same(src, dst, cid)


def test_pull_killed_mid_blob_resumes(tmp_path: Path, registry: Registry, source: tuple[Store, str, dict[str, bytes]]) -> None:
    src, cid, files = source
    blobs = _blobs(src, cid)
    push(src, cid, registry.ref("ckpt/web:v1"), PLAIN)
    done_before, threshold = _interrupt_point(blobs)
    root = tmp_path / "dest-store"
    Store(root)
    blobs_done, _ = _kill_mid_transfer("pull", root, registry.ref("ckpt/web:v1"), threshold,
                                       linked=[d for d, _ in blobs[:done_before]])
    assert blobs_done == done_before

    dst = Store(root)
    assert dst.list() == []
    report = pull(dst, registry.ref("ckpt/web:v1"), PLAIN)
    assert report.blobs_skipped == done_before
    assert report.bytes_downloaded == sum(size for _, size in blobs[done_before:])
    dst.recover()  # the dead child's ingest goes; the pulled checkpoint stays whole
    _assert_same(src, dst, cid, files, tmp_path)


# -- auth and TLS ----------------------------------------------------------------------------


def test_basic_auth(tmp_path: Path, source: tuple[Store, str, dict[str, bytes]]) -> None:
    src, cid, _ = source
    with Registry(tmp_path / "registry", users={"alice": "pw-of-alice"}) as registry:
        good = Credentials("alice", "pw-of-alice", plain_http=True)
        push(src, cid, registry.ref("ckpt/web:v1"), good)
        dst = Store(tmp_path / "dest-store")
        assert pull(dst, registry.ref("ckpt/web:v1"), good).checkpoint_id == cid
        _assert_same(src, dst, cid)

        bad = Credentials("alice", "not-the-password", plain_http=True)
        for call in (lambda: push(src, cid, registry.ref("ckpt/web:v2"), bad), lambda: pull(dst, registry.ref("ckpt/web:v1"), bad)):
            with pytest.raises(Unauthenticated) as info:
                call()
            text = str(info.value)
            assert registry.host in text and "ckpt/web" in text and "alice" in text
            assert "not-the-password" not in text
        with pytest.raises(Unauthenticated, match="requires a username"):
            pull(Store(tmp_path / "other"), registry.ref("ckpt/web:v1"), PLAIN)


def test_token_auth(tmp_path: Path, source: tuple[Store, str, dict[str, bytes]]) -> None:
    src, cid, _ = source
    users = {"alice": "pw-a", "reader": "pw-r"}
    grants = {"alice": {"pull", "push"}, "reader": {"pull"}}
    with Registry(tmp_path / "registry", users=users, token=True, grants=grants) as registry:
        tokens = registry.token_server
        assert tokens is not None
        alice = Credentials("alice", "pw-a", plain_http=True)
        push(src, cid, registry.ref("ckpt/web:v1"), alice)
        assert len(tokens.issued) == 1  # one token, cached for the whole push and shared by its lanes
        # The push's own scope covers the challenge's (pull): one scope asked for.
        assert tokens.issued[0] == ("alice", ["repository:ckpt/web:pull,push"])

        reader = Credentials("reader", "pw-r", plain_http=True)
        dst = Store(tmp_path / "dest-store")
        assert pull(dst, registry.ref("ckpt/web:v1"), reader).checkpoint_id == cid
        assert len(tokens.issued) == 2
        _assert_same(src, dst, cid)

        with pytest.raises(PermissionDenied) as denied:
            push(src, cid, registry.ref("ckpt/web:v2"), reader)
        assert "reader" in str(denied.value) and "ckpt/web" in str(denied.value) and registry.host in str(denied.value)

        with pytest.raises(Unauthenticated, match="rejected the password"):
            pull(dst, registry.ref("ckpt/web:v1"), Credentials("alice", "wrong", plain_http=True))
        with pytest.raises(Unauthenticated, match="requires a username"):
            pull(dst, registry.ref("ckpt/web:v1"), PLAIN)

        # A token just issued and still refused is final.
        tokens.poison = 1
        with pytest.raises(Unauthenticated, match="rejected the token"):
            pull(dst, registry.ref("ckpt/web:v1"), reader)


def test_cached_token_refused_is_fetched_again(tmp_path: Path, source: tuple[Store, str, dict[str, bytes]]) -> None:
    """Mid-push, the registry restarts trusting a new signing key: the cached token is refused, a new one works.

    The restart also closes the kept-alive connection, so the next request goes out on a new one.
    """
    src, cid, _ = source
    blobs = _blobs(src, cid)
    with Registry(tmp_path / "registry", users={"alice": "pw-a"}, token=True) as registry:
        tokens = registry.token_server
        assert tokens is not None
        rotated: list[int] = []

        def progress(p: Progress) -> None:
            if p.phase == "blobs" and p.blobs_done == 1 and not rotated:
                rotated.append(p.bytes_done)
                registry.rotate_token_key()

        alice = Credentials("alice", "pw-a", plain_http=True)
        # One lane: the restart falls between two requests (with several lanes, those in flight fail with it).
        report = push(src, cid, registry.ref("ckpt/web:v1"), alice, progress=progress, settings=ONE_LANE)
        assert rotated and report.blobs_uploaded == len(blobs)
        assert len(tokens.issued) == 2
        dst = Store(tmp_path / "dest-store")
        pull(dst, registry.ref("ckpt/web:v1"), alice)
        _assert_same(src, dst, cid)


def test_tls_with_a_custom_ca(tmp_path: Path, source: tuple[Store, str, dict[str, bytes]]) -> None:
    src, cid, _ = source
    with Registry(tmp_path / "registry", tls=True) as registry:
        with_ca = Credentials(ca_file=registry.ca_file)
        push(src, cid, registry.ref("ckpt/web:v1"), with_ca)
        dst = Store(tmp_path / "dest-store")
        assert pull(dst, registry.ref("ckpt/web:v1"), with_ca).checkpoint_id == cid
        _assert_same(src, dst, cid)

        with pytest.raises(FailedPrecondition, match="not trusted") as info:
            pull(Store(tmp_path / "other"), registry.ref("ckpt/web:v1"), Credentials())
        assert registry.host in str(info.value)
        with pytest.raises(FailedPrecondition, match="speaks HTTPS"):
            pull(Store(tmp_path / "other"), registry.ref("ckpt/web:v1"), PLAIN)
        with pytest.raises(InvalidArgument, match="CA file"):
            pull(Store(tmp_path / "other"), registry.ref("ckpt/web:v1"), Credentials(ca_file=str(tmp_path / "missing.pem")))
        skip = pull(Store(tmp_path / "other"), registry.ref("ckpt/web:v1"), Credentials(insecure_skip_verify=True))
        assert skip.checkpoint_id == cid
        # The bundle's contents instead of a path (what the CLI sends, for callers that may not name paths).
        pem = Path(registry.ca_file).read_text()
        assert pull(Store(tmp_path / "by-pem"), registry.ref("ckpt/web:v1"), Credentials(ca_pem=pem)).checkpoint_id == cid
        with pytest.raises(InvalidArgument, match="not a usable PEM bundle"):
            pull(Store(tmp_path / "other2"), registry.ref("ckpt/web:v1"), Credentials(ca_pem="not a certificate"))


def test_tls_with_token_auth(tmp_path: Path, source: tuple[Store, str, dict[str, bytes]]) -> None:
    src, cid, _ = source
    with Registry(tmp_path / "registry", users={"alice": "pw-a"}, token=True, tls=True) as registry:
        creds = Credentials("alice", "pw-a", ca_file=registry.ca_file)
        push(src, cid, registry.ref("ckpt/web:v1"), creds)
        dst = Store(tmp_path / "dest-store")
        assert pull(dst, registry.ref("ckpt/web:v1"), creds).checkpoint_id == cid


def test_plain_registry_spoken_to_over_https(registry: Registry, tmp_path: Path) -> None:
    with pytest.raises(Unavailable, match="plain HTTP"):
        pull(Store(tmp_path / "dest-store"), registry.ref("ckpt/web:v1"), Credentials())


# -- refusals --------------------------------------------------------------------------------


def test_tampered_manifest_is_refused(tmp_path: Path, registry: Registry, source: tuple[Store, str, dict[str, bytes]]) -> None:
    src, cid, _ = source
    push(src, cid, registry.ref("ckpt/web:v1"), PLAIN)
    path = registry.blob_data(cid)
    data = path.read_bytes()
    assert b'"registry"' in data
    path.write_bytes(data.replace(b'"registry"', b'"regisTry"'))
    dst = Store(tmp_path / "dest-store")
    for ref in ("ckpt/web:v1", f"ckpt/web@{cid}"):
        with pytest.raises(DataLoss, match="refused"):
            pull(dst, registry.ref(ref), PLAIN)
    assert dst.list() == []


def test_unknown_digest_and_tag(tmp_path: Path, registry: Registry, source: tuple[Store, str, dict[str, bytes]]) -> None:
    src, cid, _ = source
    push(src, cid, registry.ref("ckpt/web:v1"), PLAIN)
    dst = Store(tmp_path / "dest-store")
    fake = "sha256:" + hashlib.sha256(b"another manifest").hexdigest()
    for ref in (f"ckpt/web@{fake}", "ckpt/web:v2", "ckpt/other:v1"):
        with pytest.raises(NotFound, match="no manifest"):
            pull(dst, registry.ref(ref), PLAIN)
    assert dst.list() == []


def test_blob_missing_from_the_registry(tmp_path: Path, registry: Registry, source: tuple[Store, str, dict[str, bytes]]) -> None:
    src, cid, _ = source
    push(src, cid, registry.ref("ckpt/web:v1"), PLAIN)
    blobs = _blobs(src, cid)
    gone = blobs[-1][0]
    status, _ = registry.request("DELETE", f"/v2/ckpt/web/blobs/{gone}")
    assert status == 202
    dst = Store(tmp_path / "dest-store")
    with pytest.raises(NotFound, match=gone):
        pull(dst, registry.ref("ckpt/web:v1"), PLAIN)
    assert dst.list() == []
    with pytest.raises(NotFound):
        dst.get(cid)


def test_not_a_checkpoint(tmp_path: Path, registry: Registry, source: tuple[Store, str, dict[str, bytes]]) -> None:
    src, cid, _ = source
    push(src, cid, registry.ref("ckpt/web:v1"), PLAIN)
    doc = json.loads(src.manifest_bytes(cid))
    doc["artifactType"] = "application/vnd.example.other"
    status, body = registry.request(
        "PUT", "/v2/ckpt/web/manifests/other", headers={"Content-Type": OCI_MANIFEST_MEDIA_TYPE}, body=json.dumps(doc).encode()
    )
    assert status == 201, body
    dst = Store(tmp_path / "dest-store")
    with pytest.raises(InvalidArgument, match="not a node-agent checkpoint"):
        pull(dst, registry.ref("ckpt/web:other"), PLAIN)
    assert dst.list() == []


def test_unreachable_and_silent_registries(tmp_path: Path) -> None:
    dst = Store(tmp_path / "dest-store")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(Unavailable, match="refused the connection"):
        pull(dst, f"127.0.0.1:{port}/ckpt/web:v1", PLAIN)
    with socket.socket() as silent:  # accepts connections (backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        with pytest.raises(DeadlineExceeded, match="did not answer within 0.3s"):
            pull(dst, f"127.0.0.1:{port}/ckpt/web:v1", PLAIN, timeout=0.3)


# -- servers the real registry never is ---------------------------------------------------


def test_redirected_blobs_get_no_credentials(tmp_path: Path, source: tuple[Store, str, dict[str, bytes]], servers: list[FakeServer]) -> None:
    src, cid, files = source
    manifest = src.manifest_bytes(cid)

    def cdn(handler: BaseHTTPRequestHandler) -> None:
        digest = handler.path.split("?")[0].rsplit("/", 1)[-1]
        with src.open_blob(digest) as f:
            answer(handler, 200, f.read(), {"Content-Type": "application/octet-stream"})

    servers.append(FakeServer(cdn))
    cdn_port = servers[0].port

    def front(handler: BaseHTTPRequestHandler) -> None:
        if handler.headers.get("Authorization") != Credentials("alice", "pw").basic_header():
            answer(handler, 401, b"{}", {"WWW-Authenticate": 'Basic realm="front"'})
        elif handler.path == "/v2/ckpt/web/manifests/v1":
            answer(handler, 200, manifest, {"Content-Type": OCI_MANIFEST_MEDIA_TYPE, "Docker-Content-Digest": cid})
        elif "/blobs/" in handler.path:
            digest = handler.path.rsplit("/", 1)[-1]
            answer(handler, 307, b"", {"Location": f"http://127.0.0.1:{cdn_port}/cdn/{digest}?signature=abc"})
        else:
            answer(handler, 404)

    servers.append(FakeServer(front))
    dst = Store(tmp_path / "dest-store")
    report = pull(dst, f"127.0.0.1:{servers[1].port}/ckpt/web:v1", Credentials("alice", "pw", plain_http=True))
    assert report.checkpoint_id == cid
    _assert_same(src, dst, cid, files, tmp_path)
    assert servers[0].seen
    assert all("authorization" not in (name.lower() for name in headers) for _, _, headers in servers[0].seen)
    assert all(target.endswith("?signature=abc") for _, target, _ in servers[0].seen)


def test_hostile_answers(tmp_path: Path, source: tuple[Store, str, dict[str, bytes]], servers: list[FakeServer]) -> None:
    src, cid, _ = source
    manifest = src.manifest_bytes(cid)
    order = _blobs(src, cid)
    blobs = dict(order)
    victim = max(blobs, key=lambda d: blobs[d])
    state = {"mode": ""}

    def hostile(handler: BaseHTTPRequestHandler) -> None:
        path = handler.path
        if path == "/v2/ckpt/web/manifests/huge":
            answer(handler, 200, b"", {"Content-Type": OCI_MANIFEST_MEDIA_TYPE, "Content-Length": str(17 * MiB)})
        elif path == "/v2/ckpt/web/manifests/endless":
            handler.send_response(200)
            handler.send_header("Content-Type", OCI_MANIFEST_MEDIA_TYPE)
            handler.send_header("Transfer-Encoding", "chunked")
            handler.end_headers()
            piece = b" " * MiB
            for _ in range(20):
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        elif path.startswith("/v2/ckpt/web/manifests/"):
            answer(handler, 200, manifest, {"Content-Type": OCI_MANIFEST_MEDIA_TYPE})
        elif path.startswith("/v2/ckpt/web/blobs/"):
            digest = path.rsplit("/", 1)[-1]
            with src.open_blob(digest) as f:
                data = f.read()
            if digest == victim:
                mode = state["mode"]
                if mode == "longer":
                    data += b"extra"
                elif mode == "shorter":
                    answer(handler, 200, data[: len(data) // 2], {"Content-Length": str(len(data))})
                    handler.close_connection = True
                    return
                elif mode == "corrupt":
                    data = bytes([data[0] ^ 1]) + data[1:]
                elif mode == "chunked-longer":  # no length said: the extra bytes show only after the last
                    handler.send_response(200)
                    handler.send_header("Transfer-Encoding", "chunked")
                    handler.end_headers()
                    data += b"extra"
                    handler.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
                    return
            answer(handler, 200, data)
        else:
            answer(handler, 404)

    servers.append(FakeServer(hostile))
    host = f"127.0.0.1:{servers[0].port}"
    dst = Store(tmp_path / "dest-store")
    with pytest.raises(ResourceExhausted):
        pull(dst, f"{host}/ckpt/web:huge", PLAIN)
    with pytest.raises(ResourceExhausted):
        pull(dst, f"{host}/ckpt/web:endless", PLAIN)
    for mode, error in (("longer", DataLoss), ("shorter", Unavailable), ("corrupt", DataLoss),
                        ("chunked-longer", DataLoss)):
        state["mode"] = mode
        with pytest.raises(error):
            pull(dst, f"{host}/ckpt/web:v1", PLAIN, settings=ONE_LANE)
        assert dst.list() == []
    state["mode"] = ""
    report = pull(dst, f"{host}/ckpt/web:v1", PLAIN)
    # Blobs before the victim were kept from the failed attempts.
    assert report.blobs_downloaded == len(order) - [d for d, _ in order].index(victim)
    _assert_same(src, dst, cid)
