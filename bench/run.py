#!/usr/bin/env python3
"""node-agent against bare runc and CRIU, on a private containerd node.

    .venv/bin/python bench/run.py [--sizes 64,256,1024] [--runs 5] [--pair 512]
                                  [--repeat-mib 256] [--warmup 1] [--out bench/results.json]
                                  [--write-docs] [--note TEXT] [--quick] [--keep]
                                  [--bed NAME] [--attach AGENT_CONFIG] [--containerd PATH]
                                  [--native-sizes 256,1024] [--no-native] [--docs-only]
                                  [--answer-sizes 256,2048] [--answer-runs N] [--answer-large-runs N]
                                  [--answer-replicas N] [--no-answer] [--answer-only]

As root. It brings up a test bed (scripts/testbed, name from --bed or
NODE_AGENT_BENCH_BED, default na-bench) on the containerd binary --containerd
(default: 2.1 from /opt/node-agent/containerd-2; /usr/bin/containerd is the
system's) with the agent's restore handler, starts the agent, and on pods of
memhog (a process holding N MiB of live memory and printing `tick N` every
5 ms) measures, in interleaved runs after an untimed warm-up round:

  * checkpoints: the agent's CLI, bare `runc checkpoint --leave-running`, and
    `runc checkpoint` followed by `tar | zstd -1 -T0` into a fsynced file,
    with each one's frozen window taken from the ticker's CRI log;
  * a pod of two containers: the agent's pod-wide cut against the two bare
    dumps one after the other;
  * restores: the agent's `restore --start` against the same restore plan
    (the checkpoint's images already unpacked in a local directory) handed to
    the same runtime handler through plain CRI calls;
  * the store bytes a repeated checkpoint of an unchanged workload adds, and
    the agent's peak RSS during the largest checkpoint;
  * on containerd 2.x, against containerd's own CRI path (bench/native.py):
    CheckpointContainer into an archive, and the restore of that archive
    through CreateContainer in a fresh sandbox, on fresh random memory;
  * time to first answer (bench/firstanswer.py): a numpy model server from
    the bed's Debian image (weights of --answer-sizes MiB, one bed image per
    size) restored with the agent's default and with --full, against the
    same plan from local disk and a cold start, each until its first answer
    over HTTP, timed from the moment the request reaches the agent (or
    RunPodSandbox), the CLI's start-up excluded and measured on its own; at
    the smallest size also N replicas one after another, all kept running.

It prints the tables, writes every raw sample as JSON (--out, which keeps the
latest run of every other containerd version too) and, with --write-docs,
rewrites docs/benchmarks.md with all of them. Everything it creates (pods,
checkpoints, archives, the loopback registry and its image, temporary
directories, the test bed unless --keep) is removed, also on errors and on
SIGINT/SIGTERM. docs/benchmarks.md says how each number is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, TypeVar

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import crilog, firstanswer, native, report  # noqa: E402
from node_agent.config import load as load_settings  # noqa: E402
from node_agent.cri import CriClient  # noqa: E402
from testbed.bed import CONTAINERD2, NODE_AGENT, Bed, bring_up, container_config, pod_config, testbed  # noqa: E402

T = TypeVar("T")
FAST_TICK_MS = 5
NS_SRC, NS_RESTORE, NS_STAGE = "bench", "bench-r", "bench-stage"
MARKER = ".node-agent-bench"
MODEL_MIB_ENV = "NODE_AGENT_MODEL_MIB"  # scripts/testbed up --model-mib


def log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


class BenchError(Exception):
    """A failure reported as one line."""


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


# Under the agent's store directory but not the checkpoint store itself:
# scratch, restore plans, logs, the journal, the runtime wrapper, writers in flight.
NOT_STORE = {"work", "plans", "logs", "journal", "bin", "ingest"}


def store_usage(store: str) -> int:
    """Bytes of every file of the checkpoint store (blobs, manifests, indexes)."""
    total = 0
    for dirpath, dirs, files in os.walk(store):
        if dirpath == store:
            dirs[:] = [d for d in dirs if d not in NOT_STORE]
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except FileNotFoundError:
                pass
    return total


def proc_status(pid: int, key: str) -> int | None:
    """A `kB` field of /proc/<pid>/status, in KiB."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def criu_log_ms(path: str) -> float | None:
    """The last relative time stamp, `(SS.ssssss)`, in a CRIU log: its run time."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 65536))
            lines = fh.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("(") and ")" in line:
            try:
                return round(float(line[1:line.index(")")]) * 1000, 1)
            except ValueError:
                continue
    return None


def warm(root: str, skip: frozenset[str] | set[str] = frozenset()) -> int:
    """Reads every file under `root` (but not under its top-level `skip`
    dirs), so an operation that follows finds its data in the page cache."""
    buf = bytearray(8 << 20)
    total = 0
    for dirpath, dirs, files in os.walk(root):
        if dirpath == root:
            dirs[:] = [d for d in dirs if d not in skip]
        for f in files:
            try:
                with open(os.path.join(dirpath, f), "rb", buffering=0) as fh:
                    while n := fh.readinto(buf):
                        total += n
            except OSError:
                pass
    return total


def copy_tree(src: Path, dst: Path) -> None:
    """A private copy of a plan directory, as the agent makes one per restore.

    Untimed. It must be a copy, not hard links: the restore runs CRIU with
    --auto-dedup, which punches each restored page out of the image files.
    """
    shutil.copytree(src, dst, symlinks=True)


def wait_until(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


@dataclass
class Ctr:
    name: str
    id: str
    pid: int
    log: crilog.TickLog
    config: dict[str, Any]


@dataclass
class SrcPod:
    id: str
    namespace: str
    name: str
    mib: int
    config: dict[str, Any]
    containers: list[Ctr] = field(default_factory=list)


def memhog(name: str, image: str, mib: int, flip: bool, seed: int | None = None) -> dict[str, Any]:
    """memhog ticking every 5 ms; with `flip` False its memory stays the same. `seed`
    starts its pseudo-random fill (memhog's default, 1, when None)."""
    return container_config(name, image, [
        "/usr/local/bin/memhog", "--mib", str(mib), "--interval-ms", str(FAST_TICK_MS), "--flip", "1" if flip else "0",
        *(["--seed", str(seed)] if seed is not None else []),
    ])


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.workdir or f"/var/lib/node-agent-bench/{args.bed}")
        self.own_bed = not args.attach
        self.bed: Bed | None = None
        self.pods: dict[str, str] = {}  # live sandboxes we created: id -> namespace/name
        self.sources: dict[str, list[Ctr]] = {}  # source pod id -> its containers (thawed before removal)
        self.checkpoints: list[str] = []  # checkpoints we created and have not removed
        self.results: dict[str, Any] = {}
        self.runc = "runc"
        self.plans_dir = ""
        self.store = ""
        self.handler = "criu"
        self.op_timeout = 600.0
        self.agent_pid_hint: int | None = args.agent_pid
        self.ctrd_log: crilog.ContainerdLog | None = None
        self.work_claimed = False
        self.bed_started = False
        self.native: native.Native | None = None

    # ---- plumbing ----------------------------------------------------------

    @property
    def b(self) -> Bed:
        assert self.bed is not None
        return self.bed

    def cri(self, fn: Callable[[CriClient], Awaitable[T]], timeout: float = 60) -> T:
        async def go() -> T:
            cri = CriClient(self.b.endpoint, timeout=timeout)
            try:
                return await fn(cri)
            finally:
                await cri.close()

        return asyncio.run(go())

    def cli(self, *args: str, timeout: float | None = None) -> tuple[subprocess.CompletedProcess[str], float, float, float]:
        """Runs node-agent; returns (result, wall seconds, start and end epoch)."""
        env = dict(os.environ, NODE_AGENT_SOCKET=self.b.socket)
        t0 = time.time()
        m0 = time.monotonic()
        try:
            cp = subprocess.run([NODE_AGENT, *args], capture_output=True, text=True, env=env,
                                timeout=timeout or self.op_timeout)
        except subprocess.TimeoutExpired as exc:
            raise BenchError(f"node-agent {' '.join(args)} timed out after {exc.timeout:g}s") from exc
        wall = time.monotonic() - m0
        t1 = time.time()
        if cp.returncode != 0:
            raise BenchError(f"node-agent {' '.join(args)} exited {cp.returncode}: {cp.stderr.strip()[-2000:]}")
        return cp, wall, t0, t1

    def settle(self) -> None:
        """Between operations: write back what the last one left, then pause."""
        os.sync()
        time.sleep(self.args.settle)

    def agent_pid(self) -> int:
        if self.own_bed:
            assert self.b.agent is not None
            return self.b.agent.pid
        if self.agent_pid_hint:
            return self.agent_pid_hint
        want = os.path.realpath(self.b.config)
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    argv = [a.decode(errors="replace") for a in fh.read().split(b"\0")[:-1]]
            except OSError:
                continue
            if "serve" in argv and "--config" in argv:
                i = argv.index("--config")
                if i + 1 < len(argv) and os.path.realpath(argv[i + 1]) == want:
                    self.agent_pid_hint = int(entry)
                    return int(entry)
        raise BenchError(f"no running `node-agent serve --config {self.b.config}` found (pass --agent-pid)")

    # ---- set-up and tear-down ----------------------------------------------

    def _claim_workdir(self) -> None:
        """Creates the work dir, or takes over one a previous run left (marked)."""
        marker = self.work / MARKER
        if self.work.exists() and any(self.work.iterdir()):
            if not marker.exists():
                raise BenchError(f"{self.work} is not empty and not a benchmark work dir; pass another --workdir")
            shutil.rmtree(self.work)
        self.work.mkdir(parents=True, exist_ok=True, mode=0o700)
        marker.write_text("node-agent benchmark work dir; removed at the end of the run\n")
        self.work_claimed = True

    def setup(self) -> None:
        self._claim_workdir()
        if self.own_bed:
            log(f"test bed {self.args.bed} (scripts/testbed up), work dir {self.work}")
            self.bed_started = True
            if self.args.answer_sizes:
                self._model_env(self.args.answer_sizes[0])
            self.bed = bring_up(self.args.bed, self.work, containerd=self.args.containerd)
            self._quiet_agent()
            self.bed.start_agent()
        else:
            settings = load_settings(self.args.attach)
            prefix = "unix://"
            sock = settings.cri_endpoint.removeprefix(prefix)
            info = json.loads(testbed("env", self.args.bed))
            if os.path.realpath(info["containerd_socket"]) != os.path.realpath(sock):
                raise BenchError(f"{self.args.attach} talks to {settings.cri_endpoint}, not to test bed {self.args.bed}")
            self.bed = Bed(name=self.args.bed, info=info, store=settings.store, socket=settings.socket,
                           config=self.args.attach, handler=settings.runtime_handler)
        settings = load_settings(self.b.config)
        self.store = settings.store
        self.plans_dir = settings.plans_dir
        self.runc = settings.runc
        self.handler = settings.runtime_handler
        self.ctrd_log = crilog.ContainerdLog(self.b.info["containerd_log"])
        (self.work / "bare").mkdir(exist_ok=True)

    def _model_env(self, mib: int) -> None:
        """The weights of the Debian image's model server the next `scripts/testbed up` builds."""
        os.environ[MODEL_MIB_ENV] = str(mib)

    def _quiet_agent(self) -> None:
        """The same agent as a node runs, without debug logging."""
        cfg = Path(self.b.config)
        cfg.write_text(cfg.read_text().replace("log-level: debug", "log-level: info"))

    def model_bed(self, mib: int) -> None:
        """Brings the own bed up again with a model image of `mib` MiB of weights, unless it has one.
        Nothing of the runs before is left on it by then (pods and checkpoints are removed as they go)."""
        if not self.own_bed or self.b.info.get("model_mib") == mib:
            return
        log(f"test bed {self.args.bed} again, with {mib} MiB of model weights in its image")
        self.b.stop_agent()
        self._model_env(mib)
        self.bed = bring_up(self.args.bed, self.work, containerd=self.args.containerd)
        self._quiet_agent()
        self.bed.start_agent()
        self.ctrd_log = crilog.ContainerdLog(self.b.info["containerd_log"])

    def cleanup(self) -> None:
        errors: list[str] = []
        for ctrs in self.sources.values():
            for c in ctrs:  # a dump cut short may leave a container frozen
                self._thaw(c)
        for pod_id in list(self.pods):
            try:
                self.remove_pod(pod_id)
            except Exception as exc:  # noqa: BLE001 - keep cleaning
                errors.append(f"pod {self.pods.get(pod_id, pod_id)}: {exc}")
        for ckpt in list(self.checkpoints):
            try:
                self.remove_checkpoint(ckpt)
            except Exception as exc:  # noqa: BLE001
                errors.append(f"checkpoint {ckpt[:19]}: {exc}")
        if self.native is not None:
            errors += self.native.cleanup()  # the registry's image, its hosts.toml, the registry
        if self.work_claimed:
            shutil.rmtree(self.work / "bare", ignore_errors=True)
            shutil.rmtree(self.work / "restore-src", ignore_errors=True)
            shutil.rmtree(self.work / "answer-src", ignore_errors=True)
        if self.own_bed and self.bed is not None:
            self.bed.stop_agent()
        if self.own_bed and self.bed_started and not self.args.keep:
            try:
                testbed("down", self.args.bed)
            except Exception as exc:  # noqa: BLE001
                errors.append(f"scripts/testbed down {self.args.bed}: {exc}")
        if self.work_claimed and (not self.args.keep or not self.own_bed):
            shutil.rmtree(self.work, ignore_errors=True)
            if not self.args.workdir:
                with contextlib.suppress(OSError):
                    self.work.parent.rmdir()  # the default parent, when empty
        elif self.bed is not None and self.args.keep:
            log(f"kept: test bed {self.args.bed} (scripts/testbed down {self.args.bed}), store {self.store}")
        for e in errors:
            log(f"cleanup: {e}")

    # ---- pods ---------------------------------------------------------------

    def new_pod(self, kind: str, mib: int, names: list[str], flip: bool = True, image: str | None = None,
                seed: int | None = None, namespace: str = NS_SRC) -> SrcPod:
        name = f"{kind}-{mib}-{secrets.token_hex(3)}"
        pcfg = pod_config(self.b, namespace, name)
        cfgs = [memhog(n, image or self.b.info["images"]["memhog"], mib, flip, seed) for n in names]
        for n in names:
            os.makedirs(os.path.join(pcfg["log_directory"], n), exist_ok=True)

        async def go(cri: CriClient) -> SrcPod:
            pod_id = await cri.run_pod(pcfg, "")
            self.pods[pod_id] = f"{namespace}/{name}"
            pod = SrcPod(pod_id, namespace, name, mib, pcfg)
            self.sources[pod_id] = pod.containers
            for n, c in zip(names, cfgs):
                cid = await cri.create_container(pod_id, c, pcfg)
                await cri.start_container(cid)
                d = await cri.container_status(cid)
                pod.containers.append(Ctr(n, cid, d.pid, crilog.TickLog(d.log_path), c))
            return pod

        pod = self.cri(go)
        for c in pod.containers:
            # memhog fills its memory before its first tick.
            wait_until(functools.partial(lambda t: t.poll() >= 40, c.log), 60 + mib / 8, f"{name}/{c.name} to tick")
        return pod

    def remove_pod(self, pod_id: str) -> None:
        """Removes a sandbox, and any restore plan left for its containers (a
        container that never started leaves its plan behind)."""
        async def go(cri: CriClient) -> list[str]:
            from node_agent import errors

            try:
                cids = [c.id for c in await cri.list_containers(pod_id)]
                await cri.stop_pod(pod_id)
                await cri.remove_pod(pod_id)
            except errors.NotFound:
                return []
            return cids

        for cid in self.cri(go, timeout=90):
            plan = os.path.join(self.plans_dir, cid)
            if self.plans_dir and os.path.isdir(plan):
                shutil.rmtree(plan, ignore_errors=True)
        self.pods.pop(pod_id, None)
        self.sources.pop(pod_id, None)

    def remove_checkpoint(self, ckpt: str) -> None:
        self.cli("checkpoints", "rm", ckpt, timeout=120)
        if ckpt in self.checkpoints:
            self.checkpoints.remove(ckpt)

    def check_running(self, cid: str, tick_log: str | None = None, since: float | None = None) -> float | None:
        """A restored container runs and its ticker goes on (not timed). With `since`
        (epoch seconds): the stamp of its first tick after that, from its CRI log
        (which may begin with the ticks of the process it was checkpointed from)."""
        d = self.cri(lambda cri: cri.container_status(cid))
        if d.container.state != "CONTAINER_RUNNING":
            raise BenchError(f"restored container {cid[:13]} is {d.container.state}")
        path = tick_log or d.log_path
        if since is None:
            t = crilog.TickLog(path)
            wait_until(lambda: t.poll() >= 3, 30, f"the restored container {cid[:13]} to tick")
            return None
        after: list[float] = []

        def ticked() -> bool:
            after[:] = [ts for ts in crilog.tick_stamps(path) if ts > since]
            return len(after) >= 3

        wait_until(ticked, 30, f"the restored container {cid[:13]} to tick", interval=0.02)
        return after[0]

    # ---- operations ---------------------------------------------------------

    def agent_checkpoint(self, pod: SrcPod) -> dict[str, Any]:
        before = store_usage(self.store)
        for c in pod.containers:
            c.log.mark()
        cp, wall, t0, t1 = self.cli("checkpoint", pod.id, "-o", "json", "--timeout", str(self.op_timeout - 10))
        info = json.loads(cp.stdout)
        self.checkpoints.append(info["id"])
        gaps = {c.name: c.log.gap_since_mark(t1) for c in pod.containers}
        added = store_usage(self.store) - before
        return {
            "id": info["id"],
            "wall_s": round(wall, 4),
            "frozen_reported_ms": float(info.get("frozen_ms", 0.0)),
            "frozen_outside_ms": max(g.gap_ms for g in gaps.values()),
            "gap_ms": {n: g.gap_ms for n, g in gaps.items()},
            "dump_ms": {c["name"]: float(c.get("dump_ms", 0.0)) for c in info.get("containers", [])},
            "size": int(info.get("size", 0)),
            "stored_size": int(info.get("stored_size", 0)),
            "store_added_bytes": added,
            "start": t0,
            "end": t1,
        }

    def _runc_dump(self, c: Ctr, image_dir: str, work_dir: str) -> None:
        os.makedirs(image_dir)
        os.makedirs(work_dir)
        argv = [self.runc, "--root", self.b.runc_root, "checkpoint", "--leave-running",
                "--image-path", image_dir, "--work-path", work_dir, c.id]
        try:
            cp = subprocess.run(argv, capture_output=True, text=True, timeout=self.op_timeout)
        except subprocess.TimeoutExpired as exc:
            self._thaw(c)
            raise BenchError(f"runc checkpoint of {c.name} timed out after {exc.timeout:g}s") from exc
        if cp.returncode != 0:
            self._thaw(c)
            tail = ""
            try:
                with open(os.path.join(work_dir, "dump.log"), encoding="utf-8", errors="replace") as fh:
                    tail = " | ".join(line.strip() for line in fh.readlines()[-5:])
            except OSError:
                pass
            raise BenchError(f"runc checkpoint of {c.name} exited {cp.returncode}: {cp.stderr.strip()[-500:]} {tail}")

    def _thaw(self, c: Ctr) -> None:
        """A failed or killed dump may leave the container frozen."""
        from criu_bridge import freezer

        try:
            fz = freezer.freezer_of(c.pid)
            if freezer.state(fz) != "THAWED":
                freezer.thaw(fz)
        except Exception as exc:  # noqa: BLE001 - best effort
            log(f"cannot check the freezer of {c.name}: {exc}")

    def bare_checkpoint(self, c: Ctr) -> dict[str, Any]:
        op = self.work / "bare" / secrets.token_hex(4)
        c.log.mark()
        t0 = time.time()
        m0 = time.monotonic()
        try:
            self._runc_dump(c, str(op / "images"), str(op / "work"))
            wall = time.monotonic() - m0
            t1 = time.time()
            size = sum(f.stat().st_size for f in (op / "images").iterdir())
        finally:
            shutil.rmtree(op, ignore_errors=True)
        gap = c.log.gap_since_mark(t1)
        return {"wall_s": round(wall, 4), "frozen_outside_ms": gap.gap_ms, "image_bytes": size,
                "start": t0, "end": t1}

    def bare_tar_zstd(self, c: Ctr) -> dict[str, Any]:
        op = self.work / "bare" / secrets.token_hex(4)
        out = str(op) + ".tar.zst"
        c.log.mark()
        t0 = time.time()
        m0 = time.monotonic()
        try:
            self._runc_dump(c, str(op / "images"), str(op / "work"))
            dumped = time.monotonic() - m0
            tar = subprocess.Popen(["tar", "-C", str(op / "images"), "-cf", "-", "."], stdout=subprocess.PIPE)
            zstd = subprocess.Popen(["zstd", "-1", "-T0", "-q", "-o", out], stdin=tar.stdout)
            assert tar.stdout is not None
            tar.stdout.close()
            try:
                zrc = zstd.wait(timeout=self.op_timeout)
                trc = tar.wait(timeout=self.op_timeout)
            except subprocess.TimeoutExpired as exc:
                tar.kill()
                zstd.kill()
                tar.wait()
                zstd.wait()
                raise BenchError(f"tar | zstd of {c.name} timed out") from exc
            if trc != 0 or zrc != 0:
                raise BenchError(f"tar | zstd of {c.name} failed (tar {trc}, zstd {zrc})")
            native.fsync_path(out)
            native.fsync_path(os.path.dirname(out))
            wall = time.monotonic() - m0
            t1 = time.time()
            size = os.path.getsize(out)
        finally:
            shutil.rmtree(op, ignore_errors=True)
            if os.path.exists(out):
                os.unlink(out)
        gap = c.log.gap_since_mark(t1)
        return {"wall_s": round(wall, 4), "dump_s": round(dumped, 4), "frozen_outside_ms": gap.gap_ms,
                "file_bytes": size, "start": t0, "end": t1}

    def agent_restore(self, ckpt: str, label: str, lazy: bool = False, keep: bool = False,
                      namespace: str = NS_RESTORE) -> dict[str, Any]:
        """`node-agent restore --start`, full or lazy. Lazily, also the time until
        every page is in and the ticker's stalls until then (each tick flips a
        word on a random page: a page not yet in costs the tick a fault served
        from the store)."""
        name = f"r-{label}-{secrets.token_hex(3)}"
        warm(self.store, NOT_STORE)
        cp, wall, t0, t1 = self.cli("restore", ckpt, "--namespace", namespace, "--name", name, "--start",
                                    "--lazy" if lazy else "--full", "-o", "json", "--timeout", str(self.op_timeout - 10))
        res = json.loads(cp.stdout)
        pod_id = res["pod_sandbox_id"]
        self.pods[pod_id] = f"{namespace}/{name}"
        out: dict[str, Any] = {}
        try:
            cids = [c["container_id"] for c in res.get("containers", [])]
            if lazy:
                out.update(self.lazy_completion(cids, t0))
            assert self.ctrd_log is not None
            starts = [self.ctrd_log.start_ms(cid) for cid in cids]
            ticked = [self.check_running(cid, since=t0) for cid in cids]
            criu = [criu_log_ms(os.path.join(self.plans_dir, cid, "work", "restore.log")) for cid in cids]
        finally:
            if not keep:
                self.remove_pod(pod_id)
        first_tick = max((t for t in ticked if t is not None), default=None)
        out.update({"wall_s": round(wall, 4), "start_ms": sum(s for s in starts if s is not None) if all(
            s is not None for s in starts) else None, "criu_restore_ms": criu, "start": t0, "end": t1,
            "first_tick_s": round(first_tick - t0, 4) if first_tick is not None else None})
        return out

    def lazy_completion(self, cids: list[str], t0: float) -> dict[str, Any]:
        """Seconds from the restore call until every page is in; tick stalls in between."""
        done = [os.path.join(self.plans_dir, cid, "lazy.done") for cid in cids]
        failed = [os.path.join(self.plans_dir, cid, "lazy.failed") for cid in cids]
        deadline = time.monotonic() + self.op_timeout
        while not all(os.path.exists(d) for d in done):
            bad = [f for f in failed if os.path.exists(f)]
            if bad:
                raise BenchError(f"lazy restore failed: {Path(bad[0]).read_text()[:500]}")
            if time.monotonic() > deadline:
                raise BenchError("lazy restore: the pages did not all come in")
            time.sleep(0.005)
        all_in = time.time() - t0
        gaps: list[float] = []
        for cid in cids:
            d = self.cri(lambda cri: cri.container_status(cid))
            stamps = crilog.tick_stamps(d.log_path)
            window = [t for t in stamps if t0 <= t <= t0 + all_in]
            gaps += [b - a for a, b in zip(window, window[1:])]
        gaps.sort()
        return {"all_in_s": round(all_in, 4),
                "tick_gap_max_ms": round(gaps[-1] * 1000, 1) if gaps else None,
                "tick_gap_median_ms": round(gaps[len(gaps) // 2] * 1000, 1) if gaps else None}

    def stage_plan(self, ckpt: str, dest: Path, devshm_dest: Path | None = None) -> None:
        """The restore plan the agent writes for this checkpoint's (only)
        container, copied to `dest`: a restore without --start, then the plan.
        With `devshm_dest`, also what the restore put into the new sandbox's
        /dev/shm (the pod's own tmpfs, which is not part of the plan)."""
        name = f"stage-{secrets.token_hex(3)}"
        cp, _, _, _ = self.cli("restore", ckpt, "--namespace", NS_STAGE, "--name", name, "--full", "-o", "json")
        res = json.loads(cp.stdout)
        pod_id = res["pod_sandbox_id"]
        self.pods[pod_id] = f"{NS_STAGE}/{name}"
        try:
            cids = [c["container_id"] for c in res.get("containers", [])]
            if len(cids) != 1:
                raise BenchError(f"expected one container in {ckpt[:19]}, got {len(cids)}")
            src = os.path.join(self.plans_dir, cids[0])
            shutil.copytree(src, dest, symlinks=True,
                            ignore=shutil.ignore_patterns("work", "restored", "failed", "*.tmp"))
            if devshm_dest is not None:
                from node_agent import devshm

                shm = devshm.shm_source(self.cri(lambda cri: cri.pod_status(pod_id)).spec)
                if not shm or not os.path.isdir(shm):
                    raise BenchError(f"cannot find the /dev/shm of the staged sandbox {pod_id[:13]}")
                shutil.copytree(shm, devshm_dest, symlinks=True)
        finally:
            self.remove_pod(pod_id)

    def stage_bare_plan(self, src_plan: Path, ccfg: dict[str, Any], label: str) -> tuple[str, dict[str, Any], Path]:
        """A new pod's name and config in NS_RESTORE, and a copy of `src_plan` made for it (untimed)."""
        name = f"b-{label}-{secrets.token_hex(3)}"
        pcfg = pod_config(self.b, NS_RESTORE, name)
        os.makedirs(os.path.join(pcfg["log_directory"], ccfg["metadata"]["name"]), exist_ok=True)
        stage = self.work / "bare" / f"plan-{secrets.token_hex(4)}"
        copy_tree(src_plan, stage)
        plan_file = stage / "plan.json"
        if plan_file.exists():
            plan = json.loads(plan_file.read_text())
            if isinstance(plan, dict):
                plan["pod"] = f"{NS_RESTORE}/{name}"
                plan_file.write_text(json.dumps(plan))
        return name, pcfg, stage

    def bare_restore(self, src_plan: Path, ccfg: dict[str, Any], label: str) -> dict[str, Any]:
        """The same plan, already unpacked on local disk, through the same
        runtime handler by plain CRI calls: RunPodSandbox, CreateContainer,
        the plan moved into place, StartContainer."""
        name, pcfg, stage = self.stage_bare_plan(src_plan, ccfg, label)
        same_fs = os.stat(stage).st_dev == os.stat(self.plans_dir).st_dev
        warm(str(src_plan))
        times: dict[str, float] = {}

        async def go(cri: CriClient) -> tuple[str, str]:
            await cri.version()  # the connection is up before the clock starts
            t0 = time.time()
            m0 = time.monotonic()
            pod_id = await cri.run_pod(pcfg, self.handler)
            self.pods[pod_id] = f"{NS_RESTORE}/{name}"
            m1 = time.monotonic()
            cid = await cri.create_container(pod_id, ccfg, pcfg)
            m2 = time.monotonic()
            shutil.move(str(stage), os.path.join(self.plans_dir, cid))
            m3 = time.monotonic()
            await cri.start_container(cid, timeout=self.op_timeout)
            m4 = time.monotonic()
            times.update(wall_s=m4 - m0, sandbox_s=m1 - m0, create_s=m2 - m1, plan_s=m3 - m2,
                         start_call_s=m4 - m3, start=t0, end=time.time())
            return pod_id, cid

        try:
            pod_id, cid = self.cri(go, timeout=self.op_timeout)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        try:
            assert self.ctrd_log is not None
            start_ms = self.ctrd_log.start_ms(cid)
            self.check_running(cid)
            criu = criu_log_ms(os.path.join(self.plans_dir, cid, "work", "restore.log"))
        finally:
            self.remove_pod(pod_id)
        out: dict[str, Any] = {k: round(v, 4) if k.endswith("_s") else v for k, v in times.items()}
        out.update(start_ms=start_ms, criu_restore_ms=[criu], plan_renamed=same_fs)
        return out

    # ---- workloads ----------------------------------------------------------

    def single(self, mib: int, measure_rss: bool) -> None:
        runs = self.args.runs
        log(f"{mib} MiB, one container: {runs} interleaved runs")
        pod = self.new_pod("hog", mib, ["hog"])
        c = pod.containers[0]
        samples: list[dict[str, Any]] = []
        rss: dict[str, Any] | None = None
        first = ""
        prev = ""
        try:
            warmups: list[dict[str, Any]] = []
            for _ in range(self.args.warmup):
                a = self.agent_checkpoint(pod)
                self.remove_checkpoint(a["id"])
                self.settle()
                warmups.append({"agent": a, "bare": self.bare_checkpoint(c)})
                self.settle()
                warmups[-1]["bare_tar_zstd"] = self.bare_tar_zstd(c)
                self.settle()
            if warmups:
                self.results["warmup"][f"single/{mib}"] = warmups
            if measure_rss:
                rss = self.rss_before()
            for i in range(runs):
                a = self.agent_checkpoint(pod)
                if measure_rss and i == 0:
                    assert rss is not None
                    rss.update(self.rss_after(mib, a))
                if not first:
                    first = a["id"]
                elif prev and prev != first:
                    self.remove_checkpoint(prev)
                prev = a["id"]
                self.settle()
                b = self.bare_checkpoint(c)
                self.settle()
                z = self.bare_tar_zstd(c)
                self.settle()
                samples.append({"run": i + 1, "agent": a, "bare": b, "bare_tar_zstd": z})
                log(f"  {mib} MiB run {i + 1}/{runs}: agent {a['wall_s']:.2f}s frozen "
                    f"{a['frozen_reported_ms']:.0f}/{a['frozen_outside_ms']:.0f} ms | runc {b['wall_s']:.2f}s "
                    f"frozen {b['frozen_outside_ms']:.0f} ms | runc+tar|zstd {z['wall_s']:.2f}s "
                    f"frozen {z['frozen_outside_ms']:.0f} ms | store +{a['store_added_bytes'] >> 20} MiB")
            self.results["single"][str(mib)] = samples
            if rss is not None:
                self.results["rss"] = rss
            if prev and prev != first:
                self.remove_checkpoint(prev)
            self.restores(mib, first, c.config)
        finally:
            if first in self.checkpoints:
                self.remove_checkpoint(first)
            self.remove_pod(pod.id)

    def restores(self, mib: int, ckpt: str, ccfg: dict[str, Any]) -> None:
        runs = self.args.runs
        src = self.work / "restore-src" / str(mib)
        shutil.rmtree(src, ignore_errors=True)
        src.parent.mkdir(exist_ok=True)
        self.stage_plan(ckpt, src)
        samples: list[dict[str, Any]] = []
        try:
            self.settle()
            warmups: list[dict[str, Any]] = []
            for i in range(self.args.warmup):
                a = self.agent_restore(ckpt, f"{mib}-w{i + 1}")
                self.settle()
                b = self.bare_restore(src, ccfg, f"{mib}-w{i + 1}")
                self.settle()
                warmups.append({"agent": a, "bare": b, "lazy": self.agent_restore(ckpt, f"{mib}-lw{i + 1}", lazy=True)})
                self.settle()
            if warmups:
                self.results["warmup"][f"restore/{mib}"] = warmups
            for i in range(runs):
                a = self.agent_restore(ckpt, f"{mib}-{i + 1}")
                self.settle()
                b = self.bare_restore(src, ccfg, f"{mib}-{i + 1}")
                self.settle()
                z = self.agent_restore(ckpt, f"{mib}-l{i + 1}", lazy=True)
                self.settle()
                samples.append({"run": i + 1, "agent": a, "bare": b, "lazy": z})
                log(f"  {mib} MiB restore {i + 1}/{runs}: agent {a['wall_s']:.2f}s (start {a['start_ms']} ms, "
                    f"CRIU {a['criu_restore_ms']} ms) | bare {b['wall_s']:.2f}s (start {b['start_ms']} ms, "
                    f"CRIU {b['criu_restore_ms']} ms) | lazy {z['wall_s']:.2f}s (start {z['start_ms']} ms, "
                    f"all in {z['all_in_s']:.2f}s, tick stall max {z['tick_gap_max_ms']} ms)")
        finally:
            shutil.rmtree(src, ignore_errors=True)
        self.results["restore"][str(mib)] = samples
        if mib == max(self.args.sizes):
            self.replicas(mib, ckpt)

    def replicas(self, mib: int, ckpt: str) -> None:
        """Replicas stamped out lazily from one checkpoint, one after another, all left running."""
        n = self.args.replicas
        log(f"{mib} MiB: {n} lazy replicas from one checkpoint")
        samples: list[dict[str, Any]] = []
        kept: list[str] = []
        try:
            for i in range(n):
                before = set(self.pods)
                r = self.agent_restore(ckpt, f"{mib}-x{i + 1}", lazy=True, keep=True)
                kept += [p for p in self.pods if p not in before]
                samples.append({"replica": i + 1, **r})
                log(f"  replica {i + 1}/{n}: {r['wall_s']:.2f}s, StartContainer {r['start_ms']} ms, "
                    f"all in {r['all_in_s']:.2f}s")
        finally:
            for pod_id in kept:
                self.remove_pod(pod_id)
        self.results["replicas"] = {"mib": mib, "samples": samples}

    def pair(self, mib: int) -> None:
        runs = self.args.runs
        log(f"{mib} MiB x 2 containers: {runs} interleaved runs")
        pod = self.new_pod("pair", mib, ["a", "b"])
        samples: list[dict[str, Any]] = []
        try:
            for i in range(-self.args.warmup, runs):
                a = self.agent_checkpoint(pod)
                self.remove_checkpoint(a["id"])
                self.settle()
                bare = {}
                for c in pod.containers:
                    bare[c.name] = self.bare_checkpoint(c)
                    self.settle()
                sample: dict[str, Any] = {
                    "run": i + 1, "agent": a,
                    "bare": {
                        "containers": bare,
                        "sum_wall_s": round(sum(x["wall_s"] for x in bare.values()), 4),
                        "sum_frozen_ms": round(sum(x["frozen_outside_ms"] for x in bare.values()), 2),
                    },
                }
                if i < 0:
                    self.results["warmup"].setdefault("pair", []).append(sample)
                    continue
                samples.append(sample)
                log(f"  pair run {i + 1}/{runs}: agent {a['wall_s']:.2f}s pod-wide frozen "
                    f"{a['frozen_reported_ms']:.0f}/{a['frozen_outside_ms']:.0f} ms | bare sum "
                    f"{sample['bare']['sum_wall_s']:.2f}s frozen {sample['bare']['sum_frozen_ms']:.0f} ms")
        finally:
            self.remove_pod(pod.id)
        self.results["pair"] = {"mib": mib, "samples": samples}

    def repeat(self, mib: int) -> None:
        runs = self.args.runs
        log(f"{mib} MiB, unchanged: a first checkpoint, then {runs} repeats")
        pod = self.new_pod("steady", mib, ["hog"], flip=False)
        ids: list[str] = []
        samples: list[dict[str, Any]] = []
        try:
            for i in range(runs + 1):
                before = store_usage(self.store)
                cp, wall, _, _ = self.cli("checkpoint", pod.id, "-o", "json")
                info = json.loads(cp.stdout)
                self.checkpoints.append(info["id"])
                ids.append(info["id"])
                added = store_usage(self.store) - before
                samples.append({"run": i, "added_bytes": added, "size": int(info.get("size", 0)),
                                "stored_size": int(info.get("stored_size", 0)), "wall_s": round(wall, 4),
                                "frozen_reported_ms": float(info.get("frozen_ms", 0.0))})
                if len(ids) > 2:
                    self.remove_checkpoint(ids[-3])
                self.settle()
                log(f"  checkpoint {i}: +{added / 1048576:.1f} MiB in the store")
        finally:
            for ckpt in ids:
                if ckpt in self.checkpoints:
                    self.remove_checkpoint(ckpt)
            self.remove_pod(pod.id)
        self.results["repeat"] = {"mib": mib, "first": samples[0], "samples": samples[1:]}

    def rss_before(self) -> dict[str, Any]:
        if self.own_bed:
            log("  restarting the agent, so its high-water mark is this checkpoint's")
            self.b.stop_agent()
            self.b.agent = None
            self.b.start_agent()
        pid = self.agent_pid()
        return {"pid": pid, "restarted": self.own_bed, "vm_rss_before_kib": proc_status(pid, "VmRSS"),
                "vm_hwm_before_kib": proc_status(pid, "VmHWM")}

    def rss_after(self, mib: int, a: dict[str, Any]) -> dict[str, Any]:
        pid = self.agent_pid()
        hwm = proc_status(pid, "VmHWM")
        if hwm is None:
            raise BenchError(f"cannot read VmHWM of the agent (pid {pid})")
        return {"mib": mib, "vm_hwm_kib": hwm, "checkpoint": a["id"]}

    # ---- the whole run --------------------------------------------------------

    def run(self) -> dict[str, Any]:
        sizes = self.args.sizes
        self.results = {"single": {}, "restore": {}, "warmup": {}}
        self.op_timeout = min(600.0, 120.0 + max(sizes + self.args.native_sizes + [self.args.pair * 2]) * 0.4)
        started = time.time()
        # Other work on the machine shows here first: the load averages at the start and the end.
        self.results["loadavg"] = {"start": [round(x, 2) for x in os.getloadavg()]}
        if not self.args.answer_only:
            for mib in sizes:
                self.single(mib, measure_rss=(mib == max(sizes)))
            self.pair(self.args.pair)
            self.repeat(self.args.repeat_mib)
            why_not = native.unsupported(self.b.info) if not self.args.no_native else "--no-native"
            if why_not:
                log(f"against containerd's own checkpoint and restore: skipped ({why_not})")
                self.results["native"] = {"skipped": why_not}
            else:
                self.native = native.Native(self, NS_RESTORE)
                self.results["native"] = self.native.run(self.args.native_sizes)
        if self.args.answer_sizes:
            self.op_timeout = max(self.op_timeout, min(600.0, 120.0 + max(self.args.answer_sizes) * 0.4))
            self.results["answer"] = firstanswer.FirstAnswer(self).run(self.args.answer_sizes)
            skipped = self.results["answer"].get("skipped")
            if skipped:
                log(f"time to first answer: skipped ({skipped})")
        else:
            self.results["answer"] = {"skipped": "--no-answer"}
        self.results["loadavg"]["end"] = [round(x, 2) for x in os.getloadavg()]
        self.results["elapsed_s"] = round(time.time() - started, 1)
        return self.results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench/run.py", description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--sizes", default="64,256,1024", help="MiB held by the one-container pods (default 64,256,1024)")
    ap.add_argument("--runs", type=int, default=5, help="interleaved runs per workload (default 5)")
    ap.add_argument("--pair", type=int, default=512, help="MiB per container of the two-container pod (default 512)")
    ap.add_argument("--repeat-mib", type=int, default=256, help="MiB of the unchanged workload checkpointed repeatedly")
    ap.add_argument("--out", default=str(REPO / "bench" / "results.json"), help="JSON with every raw sample")
    ap.add_argument("--write-docs", action="store_true", help="rewrite docs/benchmarks.md with these results")
    ap.add_argument("--note", default="", help="a line for docs/benchmarks.md about the conditions of this run")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 16 MiB, one run of each, short pauses")
    ap.add_argument("--keep", action="store_true", help="leave the test bed (and the store) in place")
    ap.add_argument("--bed", default=os.environ.get("NODE_AGENT_BENCH_BED", "na-bench"),
                    help="test bed name (default $NODE_AGENT_BENCH_BED or na-bench)")
    ap.add_argument("--workdir", help="agent config, store and scratch (default /var/lib/node-agent-bench/BED)")
    ap.add_argument("--attach", metavar="AGENT_CONFIG",
                    help="use the running test bed --bed and the agent already serving with this config "
                         "(neither is restarted or removed; peak RSS is then since that agent's start)")
    ap.add_argument("--agent-pid", type=int, help="with --attach: the agent's pid (default: found by its config)")
    ap.add_argument("--replicas", type=int, default=None,
                    help="lazy replicas stamped out from the largest size's checkpoint (default 10; --quick 2)")
    ap.add_argument("--settle", type=float, default=None, help="seconds of quiet between operations (default 1)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed rounds of every operation on each workload before the runs (default 1)")
    ap.add_argument("--containerd", default=CONTAINERD2,
                    help=f"the containerd binary of the test bed (default {CONTAINERD2}; the system's: "
                         "/usr/bin/containerd); with --attach, the bed's own")
    ap.add_argument("--native-sizes", default="256,1024",
                    help="MiB of fresh random memory for the comparison with containerd's own CRI checkpoint "
                         "and restore (containerd 2.x; default 256,1024; --quick 16)")
    ap.add_argument("--no-native", action="store_true", help="skip the comparison with containerd's own path")
    ap.add_argument("--answer-sizes", default="256,2048",
                    help="MiB of model weights for the time-to-first-answer table, one bed image each (default "
                         "256,2048; --quick 64; with --attach only the bed's own weights are measured)")
    ap.add_argument("--answer-runs", type=int, default=None,
                    help="interleaved first-answer runs below 1024 MiB of weights (default --runs)")
    ap.add_argument("--answer-large-runs", type=int, default=1,
                    help="interleaved first-answer runs at 1024 MiB of weights and more (default 1)")
    ap.add_argument("--answer-replicas", type=int, default=None,
                    help="replicas of the smallest model checkpoint restored one after another, all kept "
                         "running (default 10; --quick 2)")
    ap.add_argument("--no-answer", action="store_true", help="skip the time-to-first-answer table")
    ap.add_argument("--answer-only", action="store_true", help="measure only the time-to-first-answer table")
    ap.add_argument("--docs-only", action="store_true",
                    help="measure nothing: rewrite docs/benchmarks.md from the runs in --out")
    args = ap.parse_args(argv)
    try:
        args.sizes = sorted({int(s) for s in str(args.sizes).split(",") if s.strip()})
        args.native_sizes = sorted({int(s) for s in str(args.native_sizes).split(",") if s.strip()})
        args.answer_sizes = sorted({int(s) for s in str(args.answer_sizes).split(",") if s.strip()})
    except ValueError:
        ap.error("--sizes, --native-sizes, --answer-sizes: comma-separated MiB, e.g. 64,256,1024")
    if args.quick:
        explicit = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:])}
        if "--sizes" not in explicit:
            args.sizes = [16]
        if "--native-sizes" not in explicit:
            args.native_sizes = [16]
        if "--runs" not in explicit:
            args.runs = 1
        if "--pair" not in explicit:
            args.pair = 16
        if "--repeat-mib" not in explicit:
            args.repeat_mib = 16
        if "--answer-sizes" not in explicit:
            args.answer_sizes = [64]
    if args.settle is None:
        args.settle = 0.1 if args.quick else 1.0
    if args.replicas is None:
        args.replicas = 2 if args.quick else 10
    if args.answer_replicas is None:
        args.answer_replicas = 2 if args.quick else 10
    if args.answer_runs is None:
        args.answer_runs = args.runs
    if args.no_answer:
        if args.answer_only:
            ap.error("--no-answer and --answer-only exclude each other")
        args.answer_sizes = []
    if args.answer_sizes and (min(args.answer_sizes) < 1 or args.answer_runs < 1 or args.answer_large_runs < 1
                              or args.answer_replicas < 0):
        ap.error("--answer-sizes, --answer-runs, --answer-large-runs must be positive, --answer-replicas not negative")
    if args.warmup is None:
        args.warmup = 0 if args.quick else 1
    if args.warmup < 0:
        ap.error("--warmup must not be negative")
    if not args.sizes or min(args.sizes) < 1 or args.runs < 1 or args.pair < 1 or args.repeat_mib < 1:
        ap.error("sizes, runs, pair and repeat-mib must be positive")
    if not args.no_native and (not args.native_sizes or min(args.native_sizes) < 1):
        ap.error("--native-sizes must be positive")
    if not args.attach and args.containerd and not os.access(args.containerd, os.X_OK):
        ap.error(f"--containerd {args.containerd}: not an executable (scripts/install-host installs 1.7 and 2.1)")
    return args


def write_docs(merged: dict[str, Any]) -> None:
    path = REPO / "docs" / "benchmarks.md"
    path.write_text(report.markdown(merged, report.load_encryption(), report.load_image_check()))
    log(f"wrote {path} (containerd {', '.join(report.series_order(merged))})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.docs_only:
        loaded = report.load(Path(args.out))
        if loaded is None:
            print(f"bench: {args.out} holds no results", file=sys.stderr)
            return 1
        write_docs(loaded)
        return 0
    if os.geteuid() != 0:
        print("bench: needs root (it runs a private containerd)", file=sys.stderr)
        return 2

    def stop(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    machine = report.machine_info(REPO)
    bench = Bench(args)
    rc = 0
    results: dict[str, Any] = {}
    try:
        bench.setup()
        machine.update(report.bed_info(bench.b.info))
        log(f"containerd {machine['containerd']} ({machine['containerd_binary']}), runc {machine['runc']}")
        results = bench.run()
    except KeyboardInterrupt:
        log("interrupted; cleaning up")
        rc = 130
    except (BenchError, native.NativeError, firstanswer.AnswerError, TimeoutError) as exc:
        log(f"error: {exc}")
        rc = 1
    except Exception:  # noqa: BLE001 - reported, then cleaned up
        log("error:\n" + traceback.format_exc().rstrip())
        rc = 1
    finally:
        # Cleanup is bounded; a second signal must not cut it short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        bench.cleanup()
    if rc != 0:
        return rc
    doc = report.build(args, machine, results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # The file keeps the latest run of every containerd version; this run replaces its own.
    merged = report.merge(report.load(out), doc)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, out)
    sys.stdout.write(report.text_tables(doc))
    others = [k for k in merged["runs"] if k != merged["latest"]]
    log(f"raw samples: {out}" + (f" (also kept there: containerd {', '.join(others)})" if others else ""))
    if args.write_docs:
        write_docs(merged)
    return 0


if __name__ == "__main__":
    sys.exit(main())
