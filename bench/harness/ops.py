"""Single timed operations on the environment: checkpoints and restores by the agent, and their baselines.

The agent's checkpoint and restore through its CLI; bare `runc checkpoint`
and `runc checkpoint` followed by `tar | zstd` into a fsynced file; the
agent's restore plan staged on local disk and restored through plain CRI
calls; the agent's peak RSS around a checkpoint. Each returns one raw sample.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.harness import crilog
from bench.harness.base import NOT_STORE, NS_RESTORE, NS_STAGE, BenchError, log, wait_until
from bench.harness.env import Ctr, Env, SrcPod
from bench.harness.measure import copy_tree, criu_log_ms, fsync_path, proc_status, store_usage, warm
from node_agent import devshm
from node_agent.cri import CriClient
from testbed.bed import pod_config


class Bench(Env):
    """The environment with the operations every scenario times."""

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
            fsync_path(out)
            fsync_path(os.path.dirname(out))
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

        def arrived() -> bool:
            if all(os.path.exists(d) for d in done):
                return True
            bad = [f for f in failed if os.path.exists(f)]
            if bad:
                raise BenchError(f"lazy restore failed: {Path(bad[0]).read_text()[:500]}")
            return False

        wait_until(arrived, self.op_timeout, "every page of the lazy restore", interval=0.005,
                   failure="lazy restore: the pages did not all come in")
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
        container, copied to `dest` with all its memory: a restore without
        --start, then the plan (`whole_memory`).
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
            self.whole_memory(ckpt, dest)
            if devshm_dest is not None:
                shm = devshm.shm_source(self.cri(lambda cri: cri.pod_status(pod_id)).spec)
                if not shm or not os.path.isdir(shm):
                    raise BenchError(f"cannot find the /dev/shm of the staged sandbox {pod_id[:13]}")
                shutil.copytree(shm, devshm_dest, symlinks=True)
        finally:
            self.remove_pod(pod_id)

    def whole_memory(self, ckpt: str, plan: Path) -> None:
        """The agent's plan leaves the memory its page source brings (lazily, or before the processes resume
        under --full) in the store, its pages files sparse: the baseline's copy gets every page, read from
        the store (untimed), and is restored as CRIU restores a plan that lies whole on local disk."""
        doc = json.loads((plan / "plan.json").read_text())
        if not doc.get("lazy"):
            return
        from node_agent import podformat
        from node_agent.store import Store

        store = Store(self.store)
        where = podformat.container_dir(str(doc["container"]))
        whole = self.work / f"whole-{secrets.token_hex(4)}"
        whole.mkdir(parents=True)
        try:
            store.materialize(store.get(ckpt), whole, prefix=where)
            for f in sorted((whole / where / podformat.IMAGES_DIR).glob("pages-*.img")):
                shutil.copyfile(f, plan / "images" / f.name)
        finally:
            shutil.rmtree(whole, ignore_errors=True)
        (plan / "plan.json").write_text(json.dumps({**doc, "lazy": False, "filled": False}))

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
