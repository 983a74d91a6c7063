"""The cross-node table's columns: each path of one weights size, timed to the model server's first correct answer.

Every column starts when its first request leaves the bench for a connection already open (the agent's local
socket, as the CLI sends its calls, or its CRI socket, as the kubelet's), and ends at the first 200 of
`GET /predict` to the new pod's IP, checked as bench/scenarios/firstanswer.py checks a replica (the source's
own start time, pid, weights digest and answer for the same x, its request count going on); a cold start
must have the same weights. After the answer, untimed, a lazy restore's pages are waited for until all are
in, the pods are removed and each target's store is emptied, so no path finds what another brought. The
machine's CPU is logged from /proc/stat all along (`CpuLog`), and each column keeps the busy share of all
cores over its own interval.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import http.client
import json
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode, urlsplit

import grpc

from bench.harness.base import BenchError
from bench.harness.ops import Bench
from bench.scenarios.crossnode_nodes import CKPT_REPO, NS_POD, Cluster, Model, quiet_count
from bench.scenarios.firstanswer import MODEL_CMD, X, AnswerError, FirstAnswer, first_answer
from node_agent import errors as agent_errors
from node_agent.api.pod_restores import RESTORE_FROM
from node_agent.cli.client import CliError, Client, pb
from node_agent.cri import CriClient
from node_agent.store.direct import NewFile
from node_agent.store.files import fsync_dir
from testbed.bed import container_config, pod_config
from testbed.bed import run as cri_run
from testbed.kubelet import Kubelet
from testbed.registry import Registry

PLAIN = pb.RegistryCredentials(plain_http=True)  # the origin and its caches speak plain HTTP on loopback


NO_CPU: dict[str, float | None] = {"cpu_busy": None, "cpu_iowait": None, "registry_cpu": None}


class CpuLog:
    """The machine's CPU time from /proc/stat, every core busy and in all, and the CPU seconds of the processes
    `watch` counts (the registries), sampled in a thread every 50 ms, so that the busy share of any interval of
    the run, and the watched processes' share, can be read afterwards."""

    def __init__(self, interval: float = 0.05, watch: Callable[[], float] | None = None) -> None:
        self.interval = interval
        self.watch = watch
        self.times: list[float] = []
        self.ticks: list[tuple[int, int, int]] = []  # (busy, all, iowait) in clock ticks, summed over the cores
        self.watched: list[float] = []  # the watched processes' CPU seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-log", daemon=True)

    def start(self) -> None:
        self._sample()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _sample(self) -> None:
        try:
            with open("/proc/stat", encoding="ascii") as fh:
                fields = [int(x) for x in fh.readline().split()[1:9]]
            watched = self.watch() if self.watch is not None else 0.0
        except (OSError, ValueError, AssertionError):  # a registry stopping meanwhile: the next sample
            return
        # user nice system idle iowait irq softirq steal: idle and iowait are not busy
        self.ticks.append((sum(fields) - fields[3] - fields[4], sum(fields), fields[4]))
        self.watched.append(watched)
        self.times.append(time.monotonic())

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _around(self, start: float, end: float) -> tuple[int, int] | None:
        """The samples at or before `start` and at or after `end` (waited for), if the clock moved between."""
        deadline = time.monotonic() + 1.0
        while (not self.times or self.times[-1] < end) and time.monotonic() < deadline:
            time.sleep(self.interval)
        i = bisect.bisect_right(self.times, start) - 1
        j = bisect.bisect_left(self.times, end)
        if i < 0 or j >= len(self.times) or self.ticks[j][1] <= self.ticks[i][1]:
            return None
        return i, j

    def span(self, start: float, end: float) -> dict[str, float | None]:
        """Over `start` to `end`: the busy share of all cores (`cpu_busy`), their share idle while waiting for
        I/O (`cpu_iowait`), and the share of all cores the watched processes took (`registry_cpu`: of the busy
        share, what the registries serving the path used)."""
        around = self._around(start, end)
        if around is None:
            return dict(NO_CPU)
        i, j = around
        every = (self.ticks[j][1] - self.ticks[i][1]) / os.sysconf("SC_CLK_TCK")  # seconds of all cores
        ticks = self.ticks[j][1] - self.ticks[i][1]
        return {"cpu_busy": round((self.ticks[j][0] - self.ticks[i][0]) / ticks, 3),
                "cpu_iowait": round((self.ticks[j][2] - self.ticks[i][2]) / ticks, 3),
                "registry_cpu": round((self.watched[j] - self.watched[i]) / every, 3) if self.watch else None}


class Marked(FirstAnswer):
    """firstanswer's paths, noting when the agent's connection is open (`opened`): the start of its Restore,
    but for one InspectCheckpoint, so that the CPU log is read over the same interval."""

    opened = 0.0

    def _agent(self) -> Client:
        client = super()._agent()
        self.opened = time.monotonic()
        return client


def transfer(node: Bench, method: str, request: Any, timeout: float) -> tuple[Any, float, float]:
    """One Push or Pull to the node's agent over its local socket, as the CLI sends it, the connection open
    first: (its result, when it started, its seconds)."""
    with Client(node.b.socket) as agent:
        grpc.channel_ready_future(agent.channel).result(timeout=30)
        m0 = time.monotonic()
        result = None
        try:
            for event in agent.stream(method, request, timeout=timeout):
                if event.HasField("result"):
                    result = event.result
        except CliError as exc:
            raise BenchError(f"{method} on {node.b.name}: {exc}") from exc
        took = time.monotonic() - m0
    if result is None:
        raise BenchError(f"{method} on {node.b.name}: the agent ended the call without a result")
    return result, m0, took


def _lanes(registry: Registry, blobs: list[tuple[str, int]], connections: int, timeout: float, what: str,
           one: Callable[[http.client.HTTPConnection, str, int], int]) -> dict[str, Any]:
    """`one(connection, digest, size)` for every blob, over `connections` kept-alive HTTP connections to
    `registry` at once (a thread each taking the next blob, largest first); it returns the bytes it moved."""
    todo = sorted(blobs, key=lambda b: b[1])
    lock = threading.Lock()
    failures: list[str] = []
    moved = [0]

    def lane() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", registry.port, timeout=timeout, blocksize=1 << 20)
        try:
            while not failures:
                with lock:
                    if not todo:
                        return
                    digest, size = todo.pop()
                got = one(conn, digest, size)
                with lock:
                    moved[0] += got
        except (OSError, http.client.HTTPException, BenchError) as exc:
            failures.append(f"{what} on {registry.host}: {exc}")
        finally:
            conn.close()

    lanes = [threading.Thread(target=lane, name=f"bound-{i}") for i in range(max(1, min(connections, len(blobs))))]
    m0 = time.monotonic()
    for t in lanes:
        t.start()
    for t in lanes:
        t.join()
    took = time.monotonic() - m0
    if failures:
        raise BenchError(failures[0])
    return {"s": round(took, 4), "bytes": moved[0], "connections": len(lanes), "blobs": len(blobs), "m0": m0}


def verify_cost(size: int) -> float:
    """The CPU seconds this machine takes to compute the sha256 of `size` bytes (in 16 MiB pieces, from memory):
    what checking every blob of a pull costs at the least, whoever checks it."""
    piece = bytes(range(256)) * (1 << 16)
    hasher = hashlib.sha256()
    started = time.thread_time()
    for _ in range(size // len(piece)):
        hasher.update(piece)
    hasher.update(piece[:size % len(piece)])
    return round(time.thread_time() - started, 4)


def store_cost(blobs: list[tuple[str, int]], scratch: str) -> float:
    """The CPU seconds this machine takes to write `blobs` (digest, size) as a store keeps them, in the new
    directory `scratch` on a node's store's filesystem: a new file each, written past the page cache
    (store/direct.py), fsynced and renamed into place, the directory fsynced: what keeping every blob of a
    pull costs at the least, whoever keeps it. The caller removes `scratch`, as the node's store is emptied
    (deleted files make the next files made near them dearer: `machine.inode_reuse_window`)."""
    os.mkdir(scratch, 0o700)
    data = memoryview(bytes(max((size for _, size in blobs), default=0)))  # what the bytes are costs nothing
    started = time.thread_time()
    for digest, size in blobs:
        _keep(scratch, digest, data[:size])
    fsync_dir(scratch)
    return round(time.thread_time() - started, 4)


def _keep(scratch: str, digest: str, data: memoryview) -> None:
    """One blob written as a store keeps it: a new file, past the page cache, fsynced, renamed into place."""
    name = digest.split(":", 1)[1]
    temp = os.path.join(scratch, f"blob-{name}")
    out = NewFile(temp)
    try:
        out.write(data)
        out.finish()
        os.fsync(out.fd)
    finally:
        out.close()
    os.rename(temp, os.path.join(scratch, name))


def get_bound(registry: Registry, repository: str, blobs: list[tuple[str, int]], connections: int,
              timeout: float) -> dict[str, Any]:
    """Every blob of the checkpoint read from `registry` by GET and discarded: what the registry and loopback
    give, the bound of a transfer of the same blobs on as many connections."""
    mine = threading.local()  # a buffer per lane

    def one(conn: http.client.HTTPConnection, digest: str, size: int) -> int:
        buf = getattr(mine, "buf", None)
        if buf is None:
            buf = mine.buf = bytearray(1 << 20)
        conn.request("GET", f"/v2/{repository}/blobs/{digest}")
        resp = conn.getresponse()
        got = 0
        while n := resp.readinto(buf):
            got += n
        if resp.status != 200 or got != size:
            raise BenchError(f"GET blob {digest}: HTTP {resp.status}, {got} of {size} bytes")
        return got

    return _lanes(registry, blobs, connections, timeout, "GET the checkpoint's blobs", one)


def pull_bound(registry: Registry, repository: str, blobs: list[tuple[str, int]], connections: int, scratch: str,
               timeout: float) -> dict[str, Any]:
    """Every blob of the checkpoint read from `registry` by GET, as a pull must at the least and nothing more:
    its sha256 computed as the bytes arrive and checked, then written as a store keeps it, in the new
    directory `scratch` on a node's store's filesystem (a new file, past the page cache, fsynced and renamed;
    the directory fsynced at the end): the bound of a full pull of the same blobs on as many connections,
    by a bare client. The caller removes `scratch` (see `store_cost`)."""
    os.mkdir(scratch, 0o700)
    mine = threading.local()  # a buffer per lane

    def one(conn: http.client.HTTPConnection, digest: str, size: int) -> int:
        buf = getattr(mine, "buf", None)
        if buf is None or len(buf) < size:
            buf = mine.buf = memoryview(bytearray(max(size, 1 << 20)))
        conn.request("GET", f"/v2/{repository}/blobs/{digest}")
        resp = conn.getresponse()
        hasher = hashlib.sha256()
        got = 0
        while got < size and (n := resp.readinto(buf[got:size])):
            hasher.update(buf[got:got + n])
            got += n
        if resp.read(1) or resp.status != 200 or got != size or "sha256:" + hasher.hexdigest() != digest:
            raise BenchError(f"GET blob {digest}: HTTP {resp.status}, {got} of {size} bytes, or not its digest")
        _keep(scratch, digest, buf[:size])
        return got

    done = _lanes(registry, blobs, connections, timeout, "GET, check and keep the checkpoint's blobs", one)
    fsync_dir(scratch)
    done["s"] = round(time.monotonic() - done["m0"], 4)
    return done


def put_bound(registry: Registry, repository: str, blobs: list[tuple[str, int]], blob_dir: str, connections: int,
              timeout: float) -> dict[str, Any]:
    """Every blob of the checkpoint uploaded to a new `repository` of `registry`, each in one upload (POST,
    then one PUT of its bytes, read from the file `blob_dir/<hex>`, with its digest): what the registry's own
    ingest (it hashes and stores every byte) gives a push of the same blobs on as many connections."""
    def one(conn: http.client.HTTPConnection, digest: str, size: int) -> int:
        conn.request("POST", f"/v2/{repository}/blobs/uploads/")
        resp = conn.getresponse()
        resp.read()
        location = resp.getheader("Location") or ""
        if resp.status != 202 or not location:
            raise BenchError(f"POST an upload of blob {digest}: HTTP {resp.status}")
        parts = urlsplit(location)
        target = f"{parts.path}?{parts.query + '&' if parts.query else ''}{urlencode({'digest': digest})}"
        with open(os.path.join(blob_dir, digest.split(":", 1)[1]), "rb") as fh:
            conn.request("PUT", target, body=fh, headers={"Content-Length": str(size),
                                                           "Content-Type": "application/octet-stream"})
            resp = conn.getresponse()
            resp.read()
        if resp.status != 201:
            raise BenchError(f"PUT blob {digest}: HTTP {resp.status}")
        return size

    return _lanes(registry, blobs, connections, timeout, "upload the checkpoint's blobs", one)


def remove_restored(node: Bench, pod_id: str) -> None:
    """A Pod-path replica removed as the kubelet removes it, through the agent's CRI endpoint (its restore
    state goes with it); then by the harness, which also takes what is left."""
    async def go(cri: CriClient) -> None:
        with contextlib.suppress(agent_errors.NotFound):
            await cri.stop_pod(pod_id)
            await cri.remove_pod(pod_id)

    cri_run(go, node.b.cri_endpoint)
    node.remove_pod(pod_id)


def plan_lazy(node: Bench, container_id: str) -> bool | None:
    """Whether the restore plan of a container says lazy (None: no readable plan)."""
    try:
        with open(os.path.join(node.plans_dir, container_id, "plan.json"), encoding="utf-8") as fh:
            return json.load(fh).get("lazy") is True
    except (OSError, ValueError, AttributeError):
        return None


class Columns:
    """The columns of one weights size on the cluster, each a method giving one run's sample."""

    def __init__(self, cluster: Cluster, model: Model, cpu: CpuLog, timeout: float) -> None:
        self.cluster = cluster
        self.model = model
        self.cpu = cpu
        self.timeout = timeout

    def _cpu(self, start: float, seconds: float | None) -> dict[str, float | None]:
        """The machine's CPU over `seconds` from `start`: busy, and the registries' share (`CpuLog.span`)."""
        return dict(NO_CPU) if seconds is None else self.cpu.span(start, start + seconds)

    # ---- 1, 2: cold start on B, the default restore on A --------------------------

    def cold(self, label: str) -> dict[str, Any]:
        """A new pod on B running the server from the image B pulled (firstanswer's cold start)."""
        m = time.monotonic()
        out = FirstAnswer(self.cluster.targets["b"]).cold(self.model.image_ref, self.model.ref, f"b{label}",
                                                          self.timeout)
        out.pop("body", None)
        out.update(self._cpu(m, out["answer_s"]))
        return out

    def same_node(self, label: str) -> dict[str, Any]:
        """The agent's Restore with start and default options on A, from A's own store."""
        path = Marked(self.cluster)
        out = path.agent(self.model.ckpt, "default", self.model.ref, f"a{label}", self.timeout)
        out.pop("body", None)
        out.update(self._cpu(path.opened, out["answer_s"]))
        return out

    # ---- 3: the CLI path on B ------------------------------------------------------

    def cli(self, label: str) -> dict[str, Any]:
        """`pull --lazy` of the origin's reference, then the default restore with start, on B."""
        node = self.cluster.targets["b"]
        self.cluster.fresh(node)
        request = pb.PullRequest(reference=self.model.ckpt_ref, credentials=PLAIN, lazy=True)
        result, m0, pull_s = transfer(node, "Pull", request, self.timeout)
        if result.checkpoint_id != self.model.ckpt:
            raise BenchError(f"pull of {self.model.ckpt_ref} on B gave {result.checkpoint_id}")
        node.checkpoints.append(self.model.ckpt)
        path = Marked(node)
        restore = path.agent(self.model.ckpt, "default", self.model.ref, f"c{label}", self.timeout)
        self.cluster.forget(node)
        return {"pull_s": round(pull_s, 4), "pull_bytes": int(result.bytes_transferred),
                "restore_s": restore["running_s"], "running_s": round(pull_s + restore["running_s"], 4),
                "restore_answer_s": restore["answer_s"], "answer_s": round(pull_s + restore["answer_s"], 4),
                "lazy": restore.get("lazy"), "restore_all_in_s": restore.get("all_in_s"),
                **self.cpu.span(m0, path.opened + restore["answer_s"])}

    # ---- 4, 5: the Pod path, on B alone and fanned out ----------------------------------

    def _pod_start(self, name: str, label: str, made: list[dict[str, Any]]) -> dict[str, Any]:
        """A Pod annotated restore-from the origin's reference, started on node `name` with the kubelet's calls
        through its agent's CRI endpoint, until its first answer (not checked yet); its sample is added to
        `made` at once, so that its pod is removed whatever happens."""
        node = self.cluster.targets[name]
        pcfg = pod_config(node.b, NS_POD, f"pod-{name}{label}-{secrets.token_hex(3)}")
        pcfg["annotations"] = {RESTORE_FROM: self.model.ckpt_ref}
        ccfg = container_config("model", self.model.image_ref, MODEL_CMD)
        os.makedirs(os.path.join(pcfg["log_directory"], "model"), exist_ok=True)
        out: dict[str, Any] = {"node": name}
        made.append(out)

        async def go() -> str:
            client = CriClient(node.b.cri_endpoint, timeout=self.timeout)
            try:
                await client.version()
                kubelet = Kubelet(node.b.cri_endpoint, timeout=self.timeout)
                out.update(t0=time.time(), m0=time.monotonic())
                try:
                    started = await kubelet.start_pod(pcfg, [ccfg], client=client)
                except agent_errors.AgentError as exc:
                    raise BenchError(f"Pod path on {name.upper()}: RunPodSandbox: {exc}") from exc
                out.update(running_s=round(time.monotonic() - out["m0"], 4), sandbox_s=round(started.seconds[0], 4),
                           sandbox_id=started.sandbox_id, calls=started.calls,
                           call_s=[round(x, 4) for x in started.seconds])
                node.pods[started.sandbox_id] = f"{NS_POD}/{pcfg['metadata']['name']}"
                if started.error is not None:
                    raise BenchError(f"Pod path on {name.upper()}: {started.calls[-1]}: {started.error}")
                if started.pulled:
                    raise BenchError(f"Pod path on {name.upper()}: the kubelet had to pull {started.pulled}")
                out["container_id"] = started.containers["model"]
                return (await client.pod_status(started.sandbox_id)).ip
            finally:
                await client.close()

        ip = asyncio.run(go())
        m1, body, attempts = first_answer(ip, X, self.timeout)
        out.update(answer_s=round(m1 - out["m0"], 4), m_answer=m1, body=body, attempts=attempts)
        return out

    def _pod_finish(self, out: dict[str, Any]) -> str:
        """The replica's answer checked ("" or what was wrong), and, untimed, its pages all in."""
        node = self.cluster.targets[out["node"]]
        wrong = ""
        try:
            FirstAnswer(node).check(f"Pod path on {out['node'].upper()}", out.pop("body"), self.model.ref,
                                    restored=True)
        except AnswerError as exc:
            wrong = str(exc)
        out["lazy"] = plan_lazy(node, out["container_id"])
        if out["lazy"]:
            out["all_in_s"] = node.lazy_completion([out["container_id"]], out["t0"])["all_in_s"]
        return wrong

    def _pod_remove(self, outs: list[dict[str, Any]]) -> None:
        for out in outs:
            if out.get("sandbox_id"):
                remove_restored(self.cluster.targets[out["node"]], out["sandbox_id"])
        for name in dict.fromkeys(out["node"] for out in outs):
            self.cluster.forget(self.cluster.targets[name])

    def _sample(self, out: dict[str, Any]) -> dict[str, Any]:
        """A Pod-path sample as the results keep it: the CPU over its interval, no clock readings."""
        m0, m1 = out.pop("m0", None), out.pop("m_answer", None)
        out.pop("t0", None)
        out.update(self._cpu(m0, None if m0 is None or m1 is None else m1 - m0))
        # From the end of the kubelet's calls to the first answer: the memory streaming in, mostly.
        calls = out.get("running_s")
        out["after_calls"] = dict(NO_CPU) if m0 is None or m1 is None or calls is None else self._cpu(
            m0 + calls, m1 - m0 - calls)
        return out

    def pod(self, label: str) -> dict[str, Any]:
        """The Pod path on B, the model image already there."""
        made: list[dict[str, Any]] = []
        self.cluster.fresh(self.cluster.targets["b"])
        try:
            out = self._pod_start("b", label, made)
            wrong = self._pod_finish(out)
            if wrong:
                raise AnswerError(wrong)
        finally:
            self._pod_remove(made)
        return self._sample(out)

    def fan_out(self, label: str) -> dict[str, Any]:
        """Through an empty pull-through cache: the Pod path on C, then on B and D at once, all kept running
        until the end; the origin's blob bytes counted before, after C, and after B and D."""
        origin, digests = self.cluster.reg, self.model.digests
        self.cluster.fresh_cache()
        self.cluster.fresh(self.cluster.targets["c"])
        before = quiet_count(origin, digests)
        made: list[dict[str, Any]] = []
        wrong: list[str] = []
        two: dict[str, dict[str, Any]] = {}
        try:
            first = self._pod_start("c", label, made)
            wrong += [w for w in [self._pod_finish(first)] if w]
            after_first = quiet_count(origin, digests)
            self.cluster.fresh(self.cluster.targets["b"], self.cluster.targets["d"])
            gate = threading.Barrier(2)

            def one(name: str) -> None:
                gate.wait()
                try:
                    two[name] = self._pod_start(name, label, made)
                except BenchError as exc:  # recorded: the others' figures still count
                    wrong.append(str(exc))

            threads = [threading.Thread(target=one, args=(name,), name=f"pod-{name}") for name in ("b", "d")]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            start = min((x["m0"] for x in two.values()), default=None)
            end = max((x["m_answer"] for x in two.values()), default=None)
            wrong += [w for w in (self._pod_finish(x) for x in two.values()) if w]
            after_two = quiet_count(origin, digests)
        finally:
            self._pod_remove(made)
        span = (start, end) if start is not None and end is not None else None
        return {"first": self._sample(first), "first_origin_bytes": after_first - before,
                "two": {n: self._sample(x) for n, x in two.items()},
                "two_answer_s": round(span[1] - span[0], 4) if span and len(two) == 2 else None,
                **{f"two_{k}": v for k, v in (self.cpu.span(*span) if span else self._cpu(0, None)).items()},
                "two_origin_bytes": after_two - after_first, "stored_bytes": self.model.stored,
                "replicas": 3, "answered": 1 + len(two), "wrong": wrong}

    # ---- 6: full pull and push against the registry's own bound -------------------------

    def throughput(self, label: str) -> dict[str, Any]:
        """The GET bound from the origin and from the cache the CLI and Pod paths read through (filled by the
        fan-out), a full pull on B straight from the origin, a push from A into a new repository of the origin
        (every blob uploaded again). What writing the blobs costs at the least is measured on B's filesystem
        first, where the pull writes them."""
        node, origin = self.cluster.targets["b"], self.cluster.reg
        self.cluster.fresh(node)
        scratch = os.path.join(os.path.dirname(node.b.store), f".store-cost-{label}")
        kept = os.path.join(os.path.dirname(node.b.store), f".pull-bound-{label}")
        try:  # the scratch blobs are deleted as B's store is emptied, or on any failure before
            store = {"cpu_s": store_cost(self.model.blobs, scratch)}
            get = get_bound(origin, CKPT_REPO, self.model.blobs, self.cluster.connections, self.timeout)
            get.update(self._cpu(get.pop("m0"), get["s"]))
            self.cluster.settle()
            bare = pull_bound(origin, CKPT_REPO, self.model.blobs, self.cluster.connections, kept, self.timeout)
            bare.update(self._cpu(bare.pop("m0"), bare["s"]))
            self.cluster.settle()
            assert self.cluster.cache is not None, "the fan-out made the cache"
            cache_get = get_bound(self.cluster.cache, CKPT_REPO, self.model.blobs, self.cluster.connections,
                                  self.timeout)
            cache_get.update(self._cpu(cache_get.pop("m0"), cache_get["s"]))
            self.cluster.settle()
            self.cluster.point(node, None)
            try:
                result, m0, took = transfer(node, "Pull", pb.PullRequest(reference=self.model.ckpt_ref,
                                                                         credentials=PLAIN), self.timeout)
            finally:
                self.cluster.point(node, self.cluster.cache)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            shutil.rmtree(kept, ignore_errors=True)
        if result.checkpoint_id != self.model.ckpt:
            raise BenchError(f"pull of {self.model.ckpt_ref} on B gave {result.checkpoint_id}")
        pull = {"s": round(took, 4), "bytes": int(result.bytes_transferred), "blobs": int(result.blobs_transferred),
                **self._cpu(m0, took)}
        self.cluster.forget(node)
        self.cluster.settle()
        target = origin.ref(f"ckpts/push-{label}-{secrets.token_hex(3)}:t")
        result, m0, took = transfer(self.cluster, "Push", pb.PushRequest(
            checkpoint_id=self.model.ckpt, reference=target, credentials=PLAIN), self.timeout)
        push = {"s": round(took, 4), "bytes": int(result.bytes_transferred), "blobs": int(result.blobs_transferred),
                "skipped": int(result.blobs_skipped), **self._cpu(m0, took)}
        self.cluster.settle()
        put = put_bound(origin, f"ckpts/put-{label}-{secrets.token_hex(3)}", self.model.blobs,
                        os.path.join(self.cluster.b.store, "blobs", "sha256"), self.cluster.connections, self.timeout)
        put.update(self._cpu(put.pop("m0"), put["s"]))
        return {"get": get, "cache_get": cache_get, "pull_bound": bare, "pull": pull, "push": push, "put": put,
                "sha256": {"cpu_s": verify_cost(self.model.stored)},
                "store": store}
