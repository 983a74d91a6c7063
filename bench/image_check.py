#!/usr/bin/env python3
"""The cost of the image check: restores until running, with and without it, interleaved on one agent.

    .venv/bin/python bench/image_check.py [--runs 5] [--out bench/image_check.json] [--write-docs] [--keep]
                                          [--bed na-bench-img] [--attach AGENT_CONFIG] [--workdir DIR]
                                          [--mib 256] [--tasks 64]
                                          [--warmup 1] [--settle 1] [--containerd PATH] [--docs-only]

As root. It brings up one test bed and one agent (bench/run.py's Bench), and
checkpoints two pods: a memhog of --mib MiB (one task, the usual workload)
and a busybox shell with --tasks sleeping children (many tasks, so many core
and ids images: the check's worst case per byte). Then, in every run, each
checkpoint is restored twice with `restore --start --full` until its
container runs (the agent's call, then its ticker going on), once with the
restore wrapper as the agent installed it (the check on) and once with the
same wrapper whose check passes everything (the check off, a launcher this
benchmark writes in place of the agent's for that one restore: the product
has no switch to turn the check off). The order of the two alternates from
run to run. It also times the check alone (reading the images and holding
them to the config) on the plan each checkpoint gives. It prints the medians
and the ratio (on / off), writes the raw samples to --out and, with
--write-docs, regenerates docs/benchmarks.md. Everything it makes is removed
at the end, also on errors and signals.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import report  # noqa: E402
from bench.encryption import tree_digest  # noqa: E402
from bench.run import Bench, BenchError, SrcPod, log, write_docs  # noqa: E402
from criu_bridge import privileges, taskimages  # noqa: E402
from node_agent.cri import CriClient  # noqa: E402
from testbed.bed import CONTAINERD2, container_config  # noqa: E402

DEFAULT_BED = "na-bench-img"
VARIANTS = ("on", "off")
# The launcher the agent writes, with its restore step wrapped so that the check finds nothing: the
# same modules load at the same moments as with the check on (only in a restore), then the check's
# work is skipped. Only ever installed for one restore.
OFF_LINES = (
    "import criu_bridge.wrapper as _w\n"
    "_restore = _w.restore\n"
    "def _unchecked(*args):\n"
    "    import criu_bridge.privileges as _p\n"
    "    _p.findings = lambda *a, **k: []\n"
    "    return _restore(*args)\n"
    "_w.restore = _unchecked\n"
)


class ImageCheck:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.bench = Bench(args)
        self.results: dict[str, Any] = {}
        self.launcher = ""
        self.original = ""

    def _install(self, variant: str) -> None:
        """The wrapper for the next restore: the agent's own (on), or the same with the check off."""
        text = self.original if variant == "on" else self.original.replace(
            "from criu_bridge.wrapper import main", OFF_LINES + "from criu_bridge.wrapper import main", 1)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.launcher))
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(tmp, 0o755)
        os.replace(tmp, self.launcher)

    def _tasks_pod(self) -> SrcPod:
        n = self.args.tasks
        shell = container_config("many", self.bench.b.info["images"]["busybox"], [
            "sh", "-c", f"for i in $(seq {n}); do sleep 1000000 & done; i=0; "
                        "while :; do i=$((i+1)); echo tick $i; sleep 0.05; done"])
        pod = self.bench.new_pod("tasks", 0, [], flip=False)
        pcfg = pod.config

        async def add(cri: Any) -> str:
            os.makedirs(os.path.join(pcfg["log_directory"], "many"), exist_ok=True)
            cid: str = await cri.create_container(pod.id, shell, pcfg)
            await cri.start_container(cid)
            return cid

        self.bench.cri(add)
        return pod

    def _check_alone(self, ckpt: str, label: str, spec: dict[str, Any]) -> dict[str, Any]:
        """The check by itself on the checkpoint's plan: read the images, hold them to the source's config."""
        dest = self.bench.work / f"plan-{label}"
        self.bench.stage_plan(ckpt, dest)
        images = next(dest.rglob("pstree.img")).parent
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            found = privileges.findings(taskimages.read(str(images)), spec, exists=lambda _p: True)
            times.append(time.perf_counter() - t0)
        tasks = len(taskimages.read(str(images)).tasks)
        return {"median_ms": round(statistics.median(times) * 1000, 3), "tasks": tasks, "findings": found}

    def run(self) -> dict[str, Any]:
        b = self.bench
        self.launcher = os.path.join(b.store, "bin", "node-agent-runc")
        self.original = Path(self.launcher).read_text()
        if "from criu_bridge.wrapper import main" not in self.original:
            raise BenchError(f"{self.launcher} is not the agent's restore wrapper")
        pods = {"memhog": b.new_pod("hog", self.args.mib, ["hog"], flip=True), "tasks": self._tasks_pod()}
        ckpts: dict[str, str] = {}
        specs: dict[str, dict[str, Any]] = {}
        try:
            for kind, pod in pods.items():
                cp, _, _, _ = b.cli("checkpoint", pod.id, "-o", "json")
                ckpts[kind] = json.loads(cp.stdout)["id"]
                b.checkpoints.append(ckpts[kind])
                (cid,) = [c.id for c in b.cri(functools.partial(CriClient.list_containers, pod_id=pod.id))]
                specs[kind] = dict(b.cri(functools.partial(CriClient.container_status, container_id=cid)).spec)
            for kind, pod in pods.items():
                b.remove_pod(pod.id)
            self.results["check_alone"] = {k: self._check_alone(c, k, specs[k]) for k, c in ckpts.items()}
            samples: list[dict[str, Any]] = []
            for i in range(-self.args.warmup, self.args.runs):
                order = VARIANTS if i % 2 == 0 else VARIANTS[::-1]
                row: dict[str, Any] = {"run": i + 1}
                for kind, ckpt in ckpts.items():
                    row[kind] = {}
                    for v in order:
                        self._install(v)
                        try:
                            row[kind][v] = b.agent_restore(ckpt, f"{kind[:3]}{v}{i + 1}")
                        finally:
                            self._install("on")
                        b.settle()
                if i >= 0:
                    samples.append(row)
                    log(f"  run {i + 1}/{self.args.runs}: " + " | ".join(
                        f"{k}: on {row[k]['on']['wall_s']:.3f}s, off {row[k]['off']['wall_s']:.3f}s" for k in ckpts))
            self.results["samples"] = samples
        finally:
            self._install("on")
            for ckpt in ckpts.values():
                if ckpt in b.checkpoints:
                    b.remove_checkpoint(ckpt)
        self.results.update(mib=self.args.mib, tasks=self.args.tasks, runs=self.args.runs, warmup=self.args.warmup)
        return self.results


def summary(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("memhog", "tasks"):
        med = {v: statistics.median(s[kind][v]["wall_s"] for s in results["samples"]) for v in VARIANTS}
        tick = {v: statistics.median(s[kind][v]["first_tick_s"] for s in results["samples"]
                                     if s[kind][v].get("first_tick_s") is not None) for v in VARIANTS}
        out[kind] = {"on_s": round(med["on"], 4), "off_s": round(med["off"], 4),
                     "ratio": round(med["on"] / med["off"], 3) if med["off"] else None,
                     "first_tick_on_s": round(tick["on"], 4), "first_tick_off_s": round(tick["off"], 4),
                     "check_ms": results["check_alone"][kind]["median_ms"],
                     "check_tasks": results["check_alone"][kind]["tasks"]}
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench/image_check.py", description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=5, help="interleaved runs (default 5)")
    ap.add_argument("--out", default=str(report.IMAGE_CHECK_JSON), help="JSON with every raw sample")
    ap.add_argument("--write-docs", action="store_true", help="regenerate docs/benchmarks.md")
    ap.add_argument("--docs-only", action="store_true", help="measure nothing: regenerate docs/benchmarks.md")
    ap.add_argument("--keep", action="store_true", help="leave the test bed (and the store) in place")
    ap.add_argument("--bed", default=DEFAULT_BED, help=f"test bed name (default {DEFAULT_BED})")
    ap.add_argument("--attach", metavar="AGENT_CONFIG",
                    help="measure the agent already running with this config on the running bed --bed (no bed "
                         "of its own; the end-to-end suite's smoke run)")
    ap.add_argument("--agent-pid", type=int, help="with --attach: the agent's pid (default: found by its config)")
    ap.add_argument("--workdir", help="agent config, store and scratch (default /var/lib/node-agent-bench/BED)")
    ap.add_argument("--containerd", default=CONTAINERD2, help=f"the test bed's containerd binary (default {CONTAINERD2})")
    ap.add_argument("--mib", type=int, default=256, help="MiB of the memhog pod (default 256)")
    ap.add_argument("--tasks", type=int, default=64, help="sleeping children of the many-task pod (default 64)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds before the runs (default 1)")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds of quiet between operations (default 1)")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.warmup < 0 or args.mib < 1 or args.tasks < 1:
        ap.error("--runs, --mib and --tasks must be positive, --warmup not negative")
    args.answer_sizes = []
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.docs_only:
        merged = report.load(REPO / "bench" / "results.json")
        if merged is None:
            log("bench/results.json holds no results of bench/run.py: docs/benchmarks.md not written")
            return 1
        write_docs(merged)
        return 0
    if os.geteuid() != 0:
        print("bench: needs root (it runs a private containerd)", file=sys.stderr)
        return 2

    def stop(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    machine = report.machine_info(REPO)
    bench = ImageCheck(args)
    rc = 0
    results: dict[str, Any] = {}
    try:
        machine["node_agent_tree"] = tree_digest(REPO)
        bench.bench.setup()
        machine.update(report.bed_info(bench.bench.b.info))
        results = bench.run()
    except KeyboardInterrupt:
        log("interrupted; cleaning up")
        rc = 130
    except (BenchError, TimeoutError) as exc:
        log(f"error: {exc}")
        rc = 1
    except Exception:  # noqa: BLE001 - reported, then cleaned up
        log("error:\n" + traceback.format_exc().rstrip())
        rc = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        bench.bench.cleanup()
    if rc != 0:
        return rc
    doc = {"machine": machine, "results": results, "summary": summary(results),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    sys.stdout.write(json.dumps(doc["summary"], indent=1) + "\n")
    log(f"raw samples: {out}")
    if args.write_docs:
        merged = report.load(REPO / "bench" / "results.json")
        if merged is not None:
            write_docs(merged)
    return 0


if __name__ == "__main__":
    sys.exit(main())
