"""Real servers from Debian's packages, checkpointed while they serve and restored into another namespace.

All four run from the bed's Debian image (scripts/testbed; docs/testbed.md), each pod with its own command:
redis-server with 100k keys, the numpy model server (`modelserver`, 64 MiB of seeded weights by default), a
multi-process Python server (`mpserver`: a multiprocessing pool, POSIX shared memory, sqlite in WAL mode) and
nginx (`user root;`). Each test keeps a client requesting over TCP from before the checkpoint until after it,
restores the checkpoint into another namespace and checks, by the server's own account, that the restored
one is the same process (its recorded start, its PIDs inside the container's PID namespace; never /proc
start times, which are the restore's), that it has the same data, that it answers at its new pod IP, and
that the source answers too.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from testbed.bed import Bed, PodHandle, container_detail, make_pod, pod_detail, remove_pod, wait_for
from tests.e2e.test_native_import import CONTAINER, in_pid_namespace, namespaced

PORT = 8080


def _pod(bed: Bed, namespace: str, command: list[str]) -> PodHandle:
    """A pod of one container, `app`, in a PID namespace of its own (Kubernetes' default)."""
    return make_pod(bed, namespace, [namespaced("app", bed.info["images"]["debian"], command, CONTAINER)])


def _get(ip: str, path: str, port: int = PORT, timeout: float = 10) -> bytes:
    """One HTTP GET on a connection of its own; the body of a 200."""
    conn = http.client.HTTPConnection(ip, port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"Connection": "close"})
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise OSError(f"GET {path}: {resp.status} {body[:200]!r}")
        return body
    finally:
        conn.close()


def _get_json(ip: str, path: str, port: int = PORT, timeout: float = 10) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(_get(ip, path, port, timeout))
    return doc


def _answering(fn: Callable[[], Any]) -> Callable[[], Any]:
    def probe() -> Any:
        try:
            return fn()
        except (OSError, ValueError, http.client.HTTPException):
            return None

    return probe


class Load:
    """A client thread that keeps requesting (`request()`, one connection each) until stopped."""

    def __init__(self, request: Callable[[], Any]) -> None:
        self.request = request
        self.ok: list[float] = []  # monotonic times of the answers
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.request()
                self.ok.append(time.monotonic())
            except Exception as exc:  # noqa: BLE001 - counted; a frozen server times out
                self.errors.append(f"{type(exc).__name__}: {exc}")
                self._stop.wait(0.05)
            self._stop.wait(0.01)

    @contextmanager
    def running(self) -> Iterator[Load]:
        self._thread.start()
        try:
            wait_for(lambda: len(self.ok) >= 5, timeout=30, what="the client's first answers")
            yield self
            n = len(self.ok)
            wait_for(lambda: len(self.ok) >= n + 5, timeout=60, what="the client's answers after the checkpoint")
        finally:
            self._stop.set()
            self._thread.join(30)


def _checkpoint_while_serving(agent: Bed, pod: PodHandle, request: Callable[[], Any]) -> str:
    """Checkpoint `pod` while a client keeps requesting; the checkpoint's ID."""
    load = Load(request)
    with load.running():
        t0 = time.monotonic()
        ckpt = agent.cli("checkpoint", pod.id).stdout.strip().splitlines()[-1]
        t1 = time.monotonic()
    assert any(t < t0 for t in load.ok) and any(t > t1 for t in load.ok), "the client was not answered around it"
    return ckpt


def _restore(agent: Bed, ckpt: str, namespace: str) -> tuple[str, str, str]:
    """Restore into `namespace` and start; (pod ID, container ID, pod IP)."""
    out = agent.cli("restore", ckpt, "--namespace", namespace, "--start").stdout.split()
    pod_id, cid = out[0], out[2]
    assert container_detail(agent, cid).container.state == "CONTAINER_RUNNING"
    return pod_id, cid, pod_detail(agent, pod_id).ip


def _processes(agent: Bed, cid: str) -> dict[int, str]:
    """The container's processes: PID inside its PID namespace -> command line."""
    return in_pid_namespace(container_detail(agent, cid).pid)


def _same_processes(agent: Bed, cid: str, procs: dict[int, str]) -> None:
    """The restored container has the same processes, by PID inside its PID namespace and command line.
    A lazily restored process's command line (in its own memory) reads empty until that page is in."""
    assert set(_processes(agent, cid)) == set(procs), (_processes(agent, cid), procs)
    wait_for(lambda: _processes(agent, cid) == procs, timeout=60, what=f"the restored processes to be {procs}")


@pytest.fixture
def cleanup(agent: Bed) -> Iterator[list[str]]:
    """Pod IDs and checkpoint IDs (sha256:...) to remove after the test."""
    things: list[str] = []
    yield things
    for thing in reversed(things):
        if thing.startswith("sha256:"):
            agent.cli("checkpoints", "rm", thing, check=False)
        else:
            remove_pod(agent, thing)


# ---- redis ---------------------------------------------------------------------------------------------------

REDIS_PORT = 6379
REDIS_KEYS = 100_000


class Resp:
    """A minimal RESP2 client: commands out, replies in (pipelined when sent together)."""

    def __init__(self, ip: str, port: int = REDIS_PORT, timeout: float = 10) -> None:
        self.sock = socket.create_connection((ip, port), timeout=timeout)
        self.file = self.sock.makefile("rb")

    def close(self) -> None:
        self.file.close()
        self.sock.close()

    def __enter__(self) -> Resp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def encode(*args: str | bytes) -> bytes:
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            b = a.encode() if isinstance(a, str) else a
            out.append(b"$%d\r\n%s\r\n" % (len(b), b))
        return b"".join(out)

    def reply(self) -> Any:
        line = self.file.readline()
        if not line.endswith(b"\r\n"):
            raise OSError(f"redis closed the connection ({line!r})")
        kind, rest = line[:1], line[1:-2]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise OSError(f"redis: {rest.decode()}")
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self.file.read(n + 2)
            return data[:-2]
        if kind == b"*":
            return [self.reply() for _ in range(int(rest))]
        raise OSError(f"redis: unexpected reply {line!r}")

    def pipeline(self, commands: list[tuple[str | bytes, ...]]) -> list[Any]:
        self.sock.sendall(b"".join(self.encode(*c) for c in commands))
        return [self.reply() for _ in commands]

    def call(self, *args: str | bytes) -> Any:
        return self.pipeline([args])[0]


def _redis_value(i: int) -> bytes:
    return b"value-%d-%s" % (i, hashlib.sha256(b"%d" % i).hexdigest()[:16].encode())


def _redis_ping(ip: str) -> bool:
    with Resp(ip, timeout=5) as r:
        return bool(r.call("PING") == "PONG")


def _redis_info(ip: str) -> dict[str, str]:
    with Resp(ip) as r:
        text = r.call("INFO", "server").decode()
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line and not line.startswith("#"))


@pytest.mark.also17  # runc 1.1 there: both TCP options reach CRIU through its configuration file alone
def test_redis_with_100k_keys_restores_as_the_same_server_with_every_key(agent: Bed, cleanup: list[str]) -> None:
    src = _pod(agent, "e2e-redis", ["redis-server", "--port", str(REDIS_PORT), "--save", "", "--appendonly", "no",
                                    "--protected-mode", "no"])
    cleanup.append(src.id)
    ip = pod_detail(agent, src.id).ip
    wait_for(_answering(lambda: _redis_ping(ip)), timeout=60, what="redis to answer")
    with Resp(ip) as r:
        batch = 1000
        replies = r.pipeline([("MSET", *[x for i in range(start, start + batch) for x in (f"key:{i}", _redis_value(i))])
                              for start in range(0, REDIS_KEYS, batch)])
        assert replies == ["OK"] * (REDIS_KEYS // batch)
        assert r.call("DBSIZE") == REDIS_KEYS
    before = _redis_info(ip)
    assert before["process_id"] == "1", before  # PID 1 of the container's PID namespace
    procs = _processes(agent, src.containers["app"])

    def request() -> None:
        i = random.randrange(REDIS_KEYS)
        with Resp(ip, timeout=5) as r:
            if r.call("GET", f"key:{i}") != _redis_value(i):
                raise AssertionError(f"key:{i} has another value")

    # A client that keeps its connection open across the checkpoint, as a connection pool does. The source
    # keeps it; the restored server gets it closed (CRIU's --tcp-close, recorded with the checkpoint).
    with Resp(ip) as pooled:
        assert pooled.call("CLIENT", "SETNAME", "pooled") == "OK"
        ckpt = _checkpoint_while_serving(agent, src, request)
        cleanup.append(ckpt)
        assert pooled.call("GET", "key:7") == _redis_value(7)
    info = json.loads(agent.cli("checkpoints", "inspect", ckpt, "-o", "json").stdout)
    assert info["options"] == {"file-locks": "true", "tcp-close": "true"}, info["options"]
    new_pod, cid, new_ip = _restore(agent, ckpt, "e2e-redis-dst")
    cleanup.append(new_pod)
    assert new_ip != ip
    after = wait_for(_answering(lambda: _redis_info(new_ip)), timeout=60, what="the restored redis to answer")
    # The same server by its own account: its run_id (random at start), its pid, its uptime going on.
    for key in ("run_id", "process_id", "redis_version", "tcp_port"):
        assert after[key] == before[key], (key, before[key], after[key])
    assert int(after["uptime_in_seconds"]) >= int(before["uptime_in_seconds"]), (before, after)
    _same_processes(agent, cid, procs)
    # Every key, and sampled values.
    sample = random.Random(15).sample(range(REDIS_KEYS), 500)
    with Resp(new_ip) as r:
        assert r.call("DBSIZE") == REDIS_KEYS
        assert r.pipeline([("GET", f"key:{i}") for i in sample]) == [_redis_value(i) for i in sample]
        assert r.call("SET", "written-after-restore", "yes") == "OK"
        # The pooled client's connection came back closed, and redis let go of it.
        wait_for(lambda: b"name=pooled" not in r.call("CLIENT", "LIST"), timeout=30, what="redis to drop it")
    # The source goes on, with its own data.
    with Resp(ip) as r:
        assert r.call("DBSIZE") == REDIS_KEYS and r.call("GET", "written-after-restore") is None
    assert _redis_info(ip)["run_id"] == before["run_id"]


# ---- the model server -----------------------------------------------------------------------------------------


def _predict(ip: str, x: float) -> dict[str, Any]:
    return _get_json(ip, f"/predict?x={x}", timeout=30)


def test_the_numpy_model_server_restores_with_the_same_weights_and_answers(agent: Bed, cleanup: list[str]) -> None:
    src = _pod(agent, "e2e-model", ["/usr/local/bin/modelserver", "--weights", "/opt/model/weights.npy",
                                    "--port", str(PORT), "--shm-mib", "16"])
    cleanup.append(src.id)
    ip = pod_detail(agent, src.id).ip
    wait_for(_answering(lambda: _get(ip, "/healthz") == b"ok"), timeout=120, what="the model server to answer")
    xs = (1.0, 2.5, 7.0)
    before = {x: _predict(ip, x) for x in xs}
    ref = before[xs[0]]
    assert ref["pid"] == 1 and ref["weights_bytes"] == (agent.info["model_mib"] << 20), ref
    with open(f"/proc/{container_detail(agent, src.containers['app']).pid}/root/opt/model/weights.npy", "rb") as fh:
        fh.seek(128)  # the .npy header: the weights' bytes follow
        assert hashlib.sha256(fh.read()).hexdigest() == ref["weights_sha256"]
    cache = _get_json(ip, "/cache")
    procs = _processes(agent, src.containers["app"])

    ckpt = _checkpoint_while_serving(agent, src, lambda: _predict(ip, random.choice(xs)))
    cleanup.append(ckpt)
    new_pod, cid, new_ip = _restore(agent, ckpt, "e2e-model-dst")
    cleanup.append(new_pod)
    first = wait_for(_answering(lambda: _predict(new_ip, xs[0])), timeout=60, what="the restored model server")
    assert (first["started"], first["pid"], first["weights_sha256"]) == (ref["started"], ref["pid"],
                                                                          ref["weights_sha256"]), (ref, first)
    assert first["requests"] > ref["requests"]
    for x in xs:
        assert _predict(new_ip, x)["answer"] == before[x]["answer"], x
    assert _get_json(new_ip, "/cache") == cache  # the file it holds open in the pod's /dev/shm
    _same_processes(agent, cid, procs)
    # The source goes on.
    assert _predict(ip, xs[1])["answer"] == before[xs[1]]["answer"]


# ---- the multi-process server ---------------------------------------------------------------------------------


def test_a_multiprocess_server_with_shared_memory_and_sqlite_restores_whole(agent: Bed, cleanup: list[str]) -> None:
    src = _pod(agent, "e2e-mp", ["/usr/local/bin/mpserver", "--port", str(PORT), "--workers", "3", "--shm-mib", "32"])
    cleanup.append(src.id)
    ip = pod_detail(agent, src.id).ip
    wait_for(_answering(lambda: _get(ip, "/healthz") == b"ok"), timeout=60, what="mpserver to answer")
    for n in range(20):
        _get_json(ip, f"/work?n={n}")
    before = _get_json(ip, "/state")
    assert before["pid"] == 1 and len(before["workers"]) == 3 and before["rows"] == 20, before
    assert before["journal_mode"] == "wal" and before["shm_bytes"] == 32 << 20
    probe = _get_json(ip, "/work?n=5")  # a task's reading of the shared memory, to be read again after
    procs = _processes(agent, src.containers["app"])
    assert set(before["workers"]) <= set(procs), (before, procs)
    counter = iter(range(1000, 10**9))

    ckpt = _checkpoint_while_serving(agent, src, lambda: _get_json(ip, f"/work?n={next(counter)}"))
    cleanup.append(ckpt)
    source = _get_json(ip, "/state")
    new_pod, cid, new_ip = _restore(agent, ckpt, "e2e-mp-dst")
    cleanup.append(new_pod)
    after = wait_for(_answering(lambda: _get_json(new_ip, "/state")), timeout=60, what="the restored mpserver")
    for key in ("started", "pid", "workers", "shm_name", "shm_bytes", "shm_sha256", "journal_mode"):
        assert after[key] == before[key], (key, before[key], after[key])
    _same_processes(agent, cid, procs)
    # The rows written before the checkpoint, then those written while it ran: what the source had committed
    # by the cut, row for row (its rows since are its own).
    assert before["rows"] + 1 <= after["rows"] <= source["rows"], (before, after, source)
    upto = after["rows"]
    assert _get_json(ip, f"/state?upto={upto}")["rows_sha256"] == after["rows_sha256"]
    # Every worker still works: the same reading of the shared memory, a new row in the restored database.
    base = _get_json(new_ip, "/state")["rows"]
    seen = set()
    for _ in range(30):
        got = _get_json(new_ip, "/work?n=5")
        assert got["digest"] == probe["digest"] and got["id"] > upto
        seen.add(got["worker"])
    assert seen <= set(before["workers"]), seen
    assert _get_json(new_ip, "/state")["rows"] == base + 30
    # The source goes on with its own rows.
    assert _get_json(ip, "/state")["rows"] == source["rows"]
    assert _get_json(ip, "/work?n=5")["digest"] == probe["digest"]


# ---- nginx ----------------------------------------------------------------------------------------------------


def _nginx_status(ip: str) -> dict[str, int]:
    """stub_status: active connections, and the accepts/handled/requests counters (in nginx's shared memory)."""
    lines = _get(ip, "/nginx_status").decode().splitlines()
    accepts, handled, requests = (int(v) for v in lines[2].split())
    return {"active": int(lines[0].split(":")[1]), "accepts": accepts, "handled": handled, "requests": requests}


def test_nginx_with_root_workers_restores_master_and_workers(agent: Bed, cleanup: list[str]) -> None:
    src = _pod(agent, "e2e-nginx", ["nginx", "-g", "daemon off;"])
    cleanup.append(src.id)
    ip = pod_detail(agent, src.id).ip
    wait_for(_answering(lambda: _get(ip, "/index.html")), timeout=60, what="nginx to answer")
    host_pid = container_detail(agent, src.containers["app"]).pid
    blob = hashlib.sha256(Path(f"/proc/{host_pid}/root/srv/www/blob.bin").read_bytes()).hexdigest()
    master = int(Path(f"/proc/{host_pid}/root/run/nginx.pid").read_text())
    procs = _processes(agent, src.containers["app"])
    workers = {pid for pid, cmd in procs.items() if cmd.startswith("nginx: worker process")}
    assert master == 1 and procs[1].startswith("nginx: master process"), procs
    assert len(workers) == 2, procs
    assert hashlib.sha256(_get(ip, "/blob.bin")).hexdigest() == blob
    status = _nginx_status(ip)
    answered: set[int] = set()

    def request() -> None:
        answered.add(int(_get(ip, "/worker")))
        if hashlib.sha256(_get(ip, "/blob.bin")).hexdigest() != blob:
            raise AssertionError("another blob")

    ckpt = _checkpoint_while_serving(agent, src, request)
    cleanup.append(ckpt)
    assert answered <= workers, (answered, workers)
    new_pod, cid, new_ip = _restore(agent, ckpt, "e2e-nginx-dst")
    cleanup.append(new_pod)
    wait_for(_answering(lambda: _get(new_ip, "/index.html")), timeout=60, what="the restored nginx")
    # The same master and workers: the pid file, the processes and their titles, the counters in shared memory.
    _same_processes(agent, cid, procs)
    new_host_pid = container_detail(agent, cid).pid
    assert int(Path(f"/proc/{new_host_pid}/root/run/nginx.pid").read_text()) == master
    after = _nginx_status(new_ip)
    assert after["accepts"] > status["accepts"] and after["requests"] > status["requests"], (status, after)
    assert {int(_get(new_ip, "/worker")) for _ in range(20)} <= workers
    assert hashlib.sha256(_get(new_ip, "/blob.bin")).hexdigest() == blob
    # The source goes on.
    assert hashlib.sha256(_get(ip, "/blob.bin")).hexdigest() == blob
    assert _nginx_status(ip)["accepts"] > status["accepts"]


@pytest.fixture(autouse=True)
def _debian_image(agent: Bed) -> None:
    assert "debian" in agent.info["images"], "the test bed builds a Debian image (scripts/testbed)"
