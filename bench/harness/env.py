"""The environment of a benchmark: its test bed and agent (its own or attached), CRI and CLI calls, pods.

`Env` brings the bed up (or attaches to a running one), starts the agent,
creates and removes pods and checkpoints, and removes everything it and
the scenarios registered with it created, also on errors. The timed
operations on top of it are bench/harness/ops.py's.
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
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, TypeVar

from bench.harness import crilog
from bench.harness.base import FAST_TICK_MS, MARKER, MODEL_MIB_ENV, NS_SRC, BenchError, log, wait_until
from criu_bridge import freezer
from node_agent import errors as agent_errors
from node_agent.config.loading import load as load_settings
from node_agent.cri import CriClient
from testbed.bed import NODE_AGENT, Bed, bring_up, container_config, pod_config, testbed

T = TypeVar("T")


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


class Env:
    """A test bed with its agent, and what a run created on it (removed by `cleanup`)."""

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
        # What scenarios made beyond pods and checkpoints: their own removal (returning errors to
        # report), run before the work dir goes, and the work dir's scratch directories.
        self.cleanups: list[Callable[[], list[str]]] = []
        self.scratch: list[str] = ["bare"]

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
            self.bed = bring_up(self.args.bed, self.work, containerd=self.args.containerd,
                                images=getattr(self.args, "images", None))
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
        self.bed = bring_up(self.args.bed, self.work, containerd=self.args.containerd,
                            images=getattr(self.args, "images", None))
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
        for undo in self.cleanups:
            errors += undo()  # e.g. the native comparison's registry image, its hosts.toml, the registry
        if self.work_claimed:
            for name in self.scratch:
                shutil.rmtree(self.work / name, ignore_errors=True)
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

    def _thaw(self, c: Ctr) -> None:
        """A failed or killed dump may leave the container frozen."""
        try:
            fz = freezer.freezer_of(c.pid)
            if freezer.state(fz) != "THAWED":
                freezer.thaw(fz)
        except Exception as exc:  # noqa: BLE001 - best effort
            log(f"cannot check the freezer of {c.name}: {exc}")

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
            try:
                cids = [c.id for c in await cri.list_containers(pod_id)]
                await cri.stop_pod(pod_id)
                await cri.remove_pod(pod_id)
            except agent_errors.NotFound:
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
