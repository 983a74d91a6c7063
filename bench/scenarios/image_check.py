"""The image check's cost: restores until running with it and without it, interleaved on one agent.

Two checkpoints (a memhog, and a busybox shell with many sleeping children:
the check's worst case per byte) restored with `restore --start --full`, once
with the agent's restore wrapper and once with a wrapper whose check passes
everything, in alternating order; and the check alone on each checkpoint's
plan. bench/image_check.py is its command line.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness.base import BenchError, log
from bench.harness.env import SrcPod
from bench.harness.machine import REPO, machine_info, tree_digest
from bench.harness.main import docs_only, guarded, not_root, write_json, write_docs
from bench.harness.ops import Bench
from bench.report import results as results_files
from bench.report.image_check import CHECK_ALONE_RUNS, VARIANTS, summary
from criu_bridge import privileges, taskimages
from node_agent.cri import CriClient
from testbed.bed import container_config

DEFAULT_BED = "na-bench-img"
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
    """Two checkpoints restored with the check on and off in turn; the check alone on each one's plan."""

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
        for _ in range(CHECK_ALONE_RUNS):
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


def main(args: argparse.Namespace) -> int:
    """bench/image_check.py once its arguments are parsed."""
    out = Path(args.out)
    if args.docs_only:
        return docs_only()
    refused = not_root()
    if refused is not None:
        return refused
    machine = machine_info(REPO)
    bench = ImageCheck(args)

    def before() -> None:
        machine["node_agent_tree"] = tree_digest(REPO)

    rc, results = guarded(bench.bench, machine, bench.run, before=before)
    if rc != 0:
        return rc
    doc = {"machine": machine, "results": results, "summary": summary(results),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    write_json(out, doc, atomic=False)
    sys.stdout.write(json.dumps(doc["summary"], indent=1) + "\n")
    log(f"raw samples: {out}")
    if args.write_docs:
        merged = results_files.load(results_files.RESULTS_JSON)
        if merged is not None:
            write_docs(merged)
    return 0
