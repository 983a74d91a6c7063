"""Checkpoint and restore of one-container memhog pods, against bare runc and CRIU, at each --sizes.

Per size, interleaved runs after untimed warm-up rounds: the agent's
checkpoint, bare `runc checkpoint --leave-running`, and `runc checkpoint`
followed by `tar | zstd` into a fsynced file (the agent's peak RSS around the
largest size's first one); then restores of the first checkpoint: the
agent's full and lazy `restore --start`, and the same plan from local disk
through plain CRI calls; at the largest size, lazy replicas of it, one after
another, all kept running. Results: "single", "restore", "rss", "replicas".
"""

from __future__ import annotations

import shutil
from typing import Any

from bench.harness.base import log
from bench.harness.ops import Bench

SCRATCH = "restore-src"  # under the work dir: the staged plan of each size


def run(bench: Bench) -> None:
    if SCRATCH not in bench.scratch:
        bench.scratch.append(SCRATCH)
    sizes = bench.args.sizes
    for mib in sizes:
        single(bench, mib, measure_rss=(mib == max(sizes)))


def single(bench: Bench, mib: int, measure_rss: bool) -> None:
    runs = bench.args.runs
    log(f"{mib} MiB, one container: {runs} interleaved runs")
    pod = bench.new_pod("hog", mib, ["hog"])
    c = pod.containers[0]
    samples: list[dict[str, Any]] = []
    rss: dict[str, Any] | None = None
    first = ""
    prev = ""
    try:
        warmups: list[dict[str, Any]] = []
        for _ in range(bench.args.warmup):
            a = bench.agent_checkpoint(pod)
            bench.remove_checkpoint(a["id"])
            bench.settle()
            warmups.append({"agent": a, "bare": bench.bare_checkpoint(c)})
            bench.settle()
            warmups[-1]["bare_tar_zstd"] = bench.bare_tar_zstd(c)
            bench.settle()
        if warmups:
            bench.results["warmup"][f"single/{mib}"] = warmups
        if measure_rss:
            rss = bench.rss_before()
        for i in range(runs):
            a = bench.agent_checkpoint(pod)
            if measure_rss and i == 0:
                assert rss is not None
                rss.update(bench.rss_after(mib, a))
            if not first:
                first = a["id"]
            elif prev and prev != first:
                bench.remove_checkpoint(prev)
            prev = a["id"]
            bench.settle()
            b = bench.bare_checkpoint(c)
            bench.settle()
            z = bench.bare_tar_zstd(c)
            bench.settle()
            samples.append({"run": i + 1, "agent": a, "bare": b, "bare_tar_zstd": z})
            log(f"  {mib} MiB run {i + 1}/{runs}: agent {a['wall_s']:.2f}s frozen "
                f"{a['frozen_reported_ms']:.0f}/{a['frozen_outside_ms']:.0f} ms | runc {b['wall_s']:.2f}s "
                f"frozen {b['frozen_outside_ms']:.0f} ms | runc+tar|zstd {z['wall_s']:.2f}s "
                f"frozen {z['frozen_outside_ms']:.0f} ms | store +{a['store_added_bytes'] >> 20} MiB")
        bench.results["single"][str(mib)] = samples
        if rss is not None:
            bench.results["rss"] = rss
        if prev and prev != first:
            bench.remove_checkpoint(prev)
        restores(bench, mib, first, c.config)
    finally:
        if first in bench.checkpoints:
            bench.remove_checkpoint(first)
        bench.remove_pod(pod.id)


def restores(bench: Bench, mib: int, ckpt: str, ccfg: dict[str, Any]) -> None:
    runs = bench.args.runs
    src = bench.work / SCRATCH / str(mib)
    shutil.rmtree(src, ignore_errors=True)
    src.parent.mkdir(exist_ok=True)
    bench.stage_plan(ckpt, src)
    samples: list[dict[str, Any]] = []
    try:
        bench.settle()
        warmups: list[dict[str, Any]] = []
        for i in range(bench.args.warmup):
            a = bench.agent_restore(ckpt, f"{mib}-w{i + 1}")
            bench.settle()
            b = bench.bare_restore(src, ccfg, f"{mib}-w{i + 1}")
            bench.settle()
            warmups.append({"agent": a, "bare": b, "lazy": bench.agent_restore(ckpt, f"{mib}-lw{i + 1}", lazy=True)})
            bench.settle()
        if warmups:
            bench.results["warmup"][f"restore/{mib}"] = warmups
        for i in range(runs):
            a = bench.agent_restore(ckpt, f"{mib}-{i + 1}")
            bench.settle()
            b = bench.bare_restore(src, ccfg, f"{mib}-{i + 1}")
            bench.settle()
            z = bench.agent_restore(ckpt, f"{mib}-l{i + 1}", lazy=True)
            bench.settle()
            samples.append({"run": i + 1, "agent": a, "bare": b, "lazy": z})
            log(f"  {mib} MiB restore {i + 1}/{runs}: agent {a['wall_s']:.2f}s (start {a['start_ms']} ms, "
                f"CRIU {a['criu_restore_ms']} ms) | bare {b['wall_s']:.2f}s (start {b['start_ms']} ms, "
                f"CRIU {b['criu_restore_ms']} ms) | lazy {z['wall_s']:.2f}s (start {z['start_ms']} ms, "
                f"all in {z['all_in_s']:.2f}s, tick stall max {z['tick_gap_max_ms']} ms)")
    finally:
        shutil.rmtree(src, ignore_errors=True)
    bench.results["restore"][str(mib)] = samples
    if mib == max(bench.args.sizes):
        replicas(bench, mib, ckpt)


def replicas(bench: Bench, mib: int, ckpt: str) -> None:
    """Replicas stamped out lazily from one checkpoint, one after another, all left running."""
    n = bench.args.replicas
    log(f"{mib} MiB: {n} lazy replicas from one checkpoint")
    samples: list[dict[str, Any]] = []
    kept: list[str] = []
    try:
        for i in range(n):
            before = set(bench.pods)
            r = bench.agent_restore(ckpt, f"{mib}-x{i + 1}", lazy=True, keep=True)
            kept += [p for p in bench.pods if p not in before]
            samples.append({"replica": i + 1, **r})
            log(f"  replica {i + 1}/{n}: {r['wall_s']:.2f}s, StartContainer {r['start_ms']} ms, "
                f"all in {r['all_in_s']:.2f}s")
    finally:
        for pod_id in kept:
            bench.remove_pod(pod_id)
    bench.results["replicas"] = {"mib": mib, "samples": samples}
