"""Hostile input, fuzzed: no input may raise anything but the agent's own errors, or grow memory past a bound.

Hypothesis generates the inputs: documents (configs, manifests, indexes, saved pod and container configs,
option maps), byte strings and mutated real encodings (tar archives, CRIU images, /proc/locks), CRI
requests to the agent's CRI endpoint, and answers of a registry on loopback. Each target's budget is a
bounded number of examples, so that the suite stays within a few minutes.
"""

from __future__ import annotations

import asyncio
import io
import json
import struct
import tarfile
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from criu_bridge import criuimg as img
from criu_bridge import locks
from criu_bridge.errors import BridgeError
from criu_bridge.wrapper import Call
from node_agent import errors, hostaccess
from node_agent.config.loading import from_mapping
from node_agent.interop import imagefacts
from node_agent.lazy import pagemap
from node_agent.store import documents as store_manifest

# Parsers get many examples; whole pipelines (an import, a pull, a CRI call) fewer.
FAST = settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=200, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
MEMORY_BOUND = 64 << 20

# ---- inputs -------------------------------------------------------------------------------

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=40))
json_docs = st.recursive(scalars, lambda children: st.one_of(
    st.lists(children, max_size=6), st.dictionaries(st.text(max_size=20), children, max_size=6)), max_leaves=40)
keys = st.sampled_from(["metadata", "linux", "security_context", "namespace_options", "mounts", "devices",
                        "CDI_devices", "annotations", "capabilities", "add_capabilities", "privileged",
                        "host_path", "container_path", "propagation", "port_mappings", "host_port", "uid",
                        "network", "pid", "ipc", "name", "image", "config"])
config_like = st.recursive(scalars, lambda children: st.one_of(
    st.lists(children, max_size=5), st.dictionaries(st.one_of(keys, st.text(max_size=8)), children, max_size=6)),
    max_leaves=50)


def only_agent_errors(fn: Callable[[], Any], *extra: type[BaseException]) -> None:
    """Run `fn`: it may succeed or raise one of the agent's error classes (or `extra`), nothing else."""
    try:
        fn()
    except (errors.AgentError, *extra):
        pass


def bounded_memory(fn: Callable[[], Any]) -> None:
    tracemalloc.start()
    try:
        fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MEMORY_BOUND, f"peak {peak >> 20} MiB"


def mutations(seed: bytes) -> st.SearchStrategy[bytes]:
    """`seed` with bytes flipped, cut short, or grown: mostly valid framing, broken content."""
    def mutate(data: bytes, flips: list[tuple[int, int]], cut: int, tail: bytes) -> bytes:
        buf = bytearray(data)
        for pos, value in flips:
            if buf:
                buf[pos % len(buf)] = value
        return bytes(buf[: max(0, len(buf) - cut)]) + tail
    return st.builds(mutate, st.just(seed), st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)),
                                                     max_size=8),
                     st.integers(0, 64), st.binary(max_size=64))


# ---- the config loader ----------------------------------------------------------------------


@FAST
@given(json_docs)
def test_config_documents(doc: Any) -> None:
    only_agent_errors(lambda: from_mapping(doc))


@FAST
@given(st.dictionaries(st.sampled_from(["timeouts", "retention", "devices", "authorization", "store", "socket",
                                         "lazy-restore", "pre-dump", "health-listen", "kubelet-root",
                                         "min-free-bytes", "log-level"]), json_docs, max_size=4))
def test_config_documents_with_known_keys(doc: dict[str, Any]) -> None:
    only_agent_errors(lambda: from_mapping(doc))


@SLOW
@given(st.text(max_size=400))
def test_config_files(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    from node_agent.config.loading import load

    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(text)
    only_agent_errors(lambda: load(str(path)))


# ---- store and registry documents -----------------------------------------------------------


def _real_documents(tmp: Path) -> tuple[bytes, bytes, bytes]:
    from node_agent.store import Store

    store = Store(tmp / "store")
    with store.writer() as w:
        w.add_bytes("pod/config.json", b'{"config": {}}')
        w.add_bytes("containers/c/pages-1.img", bytes(range(256)) * 64)
        rec = w.commit({"pod": {"namespace": "ns", "name": "p"}})
    man = store.manifest_bytes(rec.id)
    desc = store_manifest.decode_manifest(man).config
    cfg = store.blobs.read(desc.digest, desc.size)
    return man, cfg, (tmp / "store" / "index.json").read_bytes()


@pytest.fixture(scope="module")
def documents(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, bytes, bytes]:
    return _real_documents(tmp_path_factory.mktemp("docs"))


@FAST
@given(st.data())
def test_store_manifest_config_and_index(documents: tuple[bytes, bytes, bytes], data: st.DataObject) -> None:
    man, cfg, index = documents
    for seed, decode in ((man, store_manifest.decode_manifest), (cfg, store_manifest.decode_config),
                         (index, store_manifest.decode_index)):
        raw = data.draw(st.one_of(mutations(seed), st.binary(max_size=200),
                                  json_docs.map(lambda d: json.dumps(d).encode())))
        only_agent_errors(lambda: decode(raw))


@FAST
@given(st.data())
def test_registry_manifests(documents: tuple[bytes, bytes, bytes], data: st.DataObject) -> None:
    from node_agent.registry.pulling import parse_manifest

    man, _, _ = documents
    raw = data.draw(st.one_of(mutations(man), json_docs.map(lambda d: json.dumps(d).encode())))
    only_agent_errors(lambda: parse_manifest(raw))


# ---- a checkpoint's saved configs and options ----------------------------------------------


@FAST
@given(config_like, st.lists(st.tuples(st.text(max_size=10), config_like), max_size=3))
def test_host_access_findings_never_raise(pod: Any, containers: list[tuple[str, Any]]) -> None:
    pod = pod if isinstance(pod, dict) else {}
    found = hostaccess.findings(pod, [(n, c if isinstance(c, dict) else {}) for n, c in containers],
                                kubelet_root="/var/lib/kubelet", agent_files="/var/lib/node-agent/interop")
    assert all(isinstance(f, str) for f in found)


@FAST
@given(config_like, st.sampled_from(["pod", "container"]))
def test_saved_configs_against_the_cri_schema(doc: Any, kind: str) -> None:
    from node_agent.cri.client import normalized

    only_agent_errors(lambda: normalized(doc if isinstance(doc, dict) else {"x": doc}, kind))


@FAST
@given(st.dictionaries(st.text(max_size=20), st.text(max_size=10), max_size=5))
def test_option_maps(options: dict[str, str]) -> None:
    from node_agent.podformat import parse_all_options, parse_options
    from node_agent.admission import parse_restore_options

    for parse in (parse_all_options, parse_options, parse_restore_options):
        only_agent_errors(lambda: parse(options))


# ---- CRIU images, /proc/locks, runc's command line ------------------------------------------


def _img(magic: int, entries: list[bytes]) -> bytes:
    return struct.pack("<II", img.IMG_COMMON_MAGIC, magic) + b"".join(struct.pack("<I", len(e)) + e
                                                                         for e in entries)


@FAST
@given(st.data())
def test_criu_images(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    d = tmp_path_factory.mktemp("img")
    lock = bytes.fromhex("08021001180120052800 3000".replace(" ", ""))
    seeds = {"filelocks.img": _img(img.FILE_LOCKS_MAGIC, [lock]),
             "ids-1.img": _img(img.IDS_MAGIC, [bytes.fromhex("0801100b18012001")]),
             "fdinfo-11.img": _img(img.FDINFO_MAGIC, [bytes.fromhex("082810001801 2005".replace(" ", ""))]),
             "files.img": _img(img.FILES_MAGIC, [b"\x08\x01\x10\x28\x1a\x08\x08\x28\x32\x04/a/b"])}
    for name, seed in seeds.items():
        (d / name).write_bytes(data.draw(st.one_of(mutations(seed), st.binary(max_size=100))))
    only_agent_errors(lambda: imagefacts.file_locks(str(d)))
    files = data.draw(mutations(seeds["files.img"]))
    only_agent_errors(lambda: imagefacts.relax_root_dir_mode(files))


@FAST
@given(st.binary(max_size=300), st.integers(0, 2**31))
def test_pagemaps(raw: bytes, task: int) -> None:
    only_agent_errors(lambda: pagemap.parse(raw, task), pagemap.PagemapError)


@FAST
@given(st.text(max_size=300))
def test_proc_locks_and_lock_plans(text: str) -> None:
    assert all(h.kind in locks.KINDS for h in locks.held_locks(text))
    try:
        entries = locks.check_entries(json.loads(text))
    except ValueError:
        return
    locks.conflicts(entries, proc_locks="/nonexistent")


@FAST
@given(st.lists(st.text(max_size=30), max_size=12))
def test_runc_command_lines(argv: list[str]) -> None:
    call = Call(argv)
    assert isinstance(call.container_id, str) and isinstance(call.command, str)


# ---- archives ------------------------------------------------------------------------------


def _tar(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, payload in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(payload)
            tf.addfile(ti, io.BytesIO(payload))
    return buf.getvalue()


ARCHIVE_SEED = _tar([("config.dump", b'{"id": "x"}'), ("spec.dump", b"{}"), ("checkpoint/inventory.img", b"\0" * 16),
                     ("rootfs-diff.tar", _tar([("etc/x", b"y")]))])


@pytest.fixture(scope="module")
def import_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from node_agent.store import Store

    yield Store(tmp_path_factory.mktemp("imports") / "store")


@SLOW
@given(st.data())
def test_archive_imports(import_store: Any, tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    from node_agent import interop

    member_names = st.sampled_from(["config.dump", "spec.dump", "checkpoint/inventory.img", "rootfs-diff.tar",
                                    "node-agent/manifest.json", "../x", "/etc/passwd", "a/../../b", "deleted.files",
                                    "checkpoint/files.img", "stats-dump", "x" * 300])
    raw = data.draw(st.one_of(
        mutations(ARCHIVE_SEED),
        st.lists(st.tuples(member_names, st.binary(max_size=64)), max_size=6).map(_tar),
        st.binary(max_size=600),
    ))
    path = tmp_path_factory.mktemp("arc") / "a.tar"
    path.write_bytes(raw)

    def run() -> None:
        only_agent_errors(lambda: interop.import_archive(import_store, str(path), cpuinfo_dump=lambda d: None,
                                                         work_dir=str(path.parent / "work")), BridgeError)

    bounded_memory(run)
    work = path.parent / "work"
    assert not work.exists() or not any(work.iterdir()), "an import left staging behind"


# ---- the CRI endpoint's request validation --------------------------------------------------


class _Refusing:
    """Stands in for the checkpointer's and restorer's work: validation must stop before it."""

    def __init__(self, settings: Any) -> None:
        from node_agent.replicas import Replicas

        self.settings = settings
        self.cri = self
        self.replicas = Replicas(settings.replicas_dir)  # the restorer's records of restored containers

    async def list_pods(self) -> list[Any]:
        return []

    async def list_containers(self, *_: Any) -> list[Any]:
        return []

    async def checkpoint(self, *_: Any, **__: Any) -> Any:
        raise errors.Internal("validation let the request through to a checkpoint")

    async def restore(self, *_: Any, **__: Any) -> Any:
        raise errors.Internal("validation let the request through to a restore")


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import grpc

    from node_agent.api.cri_endpoint import CriEndpoint
    from node_agent.config.schema import Settings
    from node_agent.store import Store

    root = tmp_path_factory.mktemp("cri")
    s = Settings(store=str(root / "store"))
    fake = _Refusing(s)

    async def make() -> Any:
        return CriEndpoint(fake, fake, Store(s.store), grpc.aio.insecure_channel("unix:///nonexistent"))  # type: ignore[arg-type]

    return asyncio.run(make()), root


@SLOW
@given(st.dictionaries(st.text(max_size=12), st.text(max_size=6), max_size=3),
       st.one_of(st.text(max_size=30), st.sampled_from(["/", "/tmp", "/etc/passwd", "relative", ""])),
       st.lists(st.text(max_size=20), max_size=3), st.text(max_size=10))
def test_cri_checkpoint_and_restore_pod_requests(endpoint: Any, options: dict[str, str], path: str,
                                                 ids: list[str], handler: str) -> None:
    from node_agent._proto.k8s.cri.runtime.v1 import api_pb2 as cri

    ep, _ = endpoint

    async def go() -> None:
        for coro in (
            lambda: ep._checkpoint_pod(cri.CheckpointPodRequest(pod_sandbox_id=handler, output_path=path,
                                                                container_ids=ids, options=options), 5.0),
            lambda: ep._restore_pod(cri.RestorePodRequest(checkpoint_path=path, runtime_handler=handler,
                                                          options=options), 5.0),
        ):
            try:
                await coro()
            except errors.Internal as exc:
                assert "validation let the request through" not in str(exc)
            except errors.AgentError:
                pass

    asyncio.run(go())


# ---- the registry client's response handling ------------------------------------------------


@pytest.fixture(scope="module")
def hostile_registry() -> Iterator[tuple[Any, list[Any]]]:
    """A loopback server whose every answer is the next one the test queued (else a 404)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from testbed.httpanswers import FakeServer

    queue: list[Any] = []

    def serve(handler: Any) -> None:
        status, headers, body = queue.pop(0) if queue else (404, {}, b"")
        handler.send_response_only(status)
        for name, value in headers.items():
            handler.send_header(name, value)
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(body)
        handler.close_connection = True

    with FakeServer(serve) as server:
        yield server, queue


header_values = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=60)
answers = st.tuples(
    st.sampled_from([200, 201, 202, 204, 301, 302, 307, 400, 401, 403, 404, 416, 429, 500, 503]),
    st.dictionaries(st.sampled_from(["Content-Type", "Content-Length", "Docker-Content-Digest", "Location",
                                     "WWW-Authenticate", "Range", "Content-Range", "Transfer-Encoding"]),
                    st.one_of(header_values, st.sampled_from([
                        "application/vnd.oci.image.manifest.v1+json", "0", "99999999999999999999", "-1",
                        "sha256:" + "0" * 64, "chunked", 'Bearer realm="http://127.0.0.2:1/t",service="x"',
                        'Basic realm="x"', "http://127.0.0.1:1/elsewhere", "file:///etc/passwd"])),
                    max_size=4),
    st.one_of(json_docs.map(lambda d: json.dumps(d).encode()), st.binary(max_size=300)),
)


@SLOW
@given(st.lists(answers, min_size=1, max_size=4))
def test_registry_answers(hostile_registry: tuple[Any, list[Any]], tmp_path_factory: pytest.TempPathFactory,
                          queued: list[Any]) -> None:
    import time

    from node_agent.config.schema import RegistrySettings
    from node_agent.registry import Credentials, pull
    from node_agent.store import Store

    server, queue = hostile_registry
    queue[:] = list(queued)
    store = Store(tmp_path_factory.mktemp("pull") / "store")
    fast = RegistrySettings(request_timeout=2.0, io_timeout=2.0)
    t0 = time.monotonic()
    only_agent_errors(lambda: pull(store, f"{server.netloc}/fuzz/repo:1", Credentials("u", "p", plain_http=True),
                                   settings=fast))
    assert time.monotonic() - t0 < 30
    assert not any((Path(store.root) / "ingest").iterdir()), "a failed pull left staging behind"
