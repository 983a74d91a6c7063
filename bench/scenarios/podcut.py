"""The pod-wide cut: a pod of two memhog containers checkpointed by the agent at once, against the two bare
`runc checkpoint` dumps one after the other (results: "pair").
"""

from __future__ import annotations

from typing import Any

from bench.harness.base import log
from bench.harness.ops import Bench


def run(bench: Bench) -> None:
    pair(bench, bench.args.pair)


def pair(bench: Bench, mib: int) -> None:
    runs = bench.args.runs
    log(f"{mib} MiB x 2 containers: {runs} interleaved runs")
    pod = bench.new_pod("pair", mib, ["a", "b"])
    samples: list[dict[str, Any]] = []
    try:
        for i in range(-bench.args.warmup, runs):
            a = bench.agent_checkpoint(pod)
            bench.remove_checkpoint(a["id"])
            bench.settle()
            bare = {}
            for c in pod.containers:
                bare[c.name] = bench.bare_checkpoint(c)
                bench.settle()
            sample: dict[str, Any] = {
                "run": i + 1, "agent": a,
                "bare": {
                    "containers": bare,
                    "sum_wall_s": round(sum(x["wall_s"] for x in bare.values()), 4),
                    "sum_frozen_ms": round(sum(x["frozen_outside_ms"] for x in bare.values()), 2),
                },
            }
            if i < 0:
                bench.results["warmup"].setdefault("pair", []).append(sample)
                continue
            samples.append(sample)
            log(f"  pair run {i + 1}/{runs}: agent {a['wall_s']:.2f}s pod-wide frozen "
                f"{a['frozen_reported_ms']:.0f}/{a['frozen_outside_ms']:.0f} ms | bare sum "
                f"{sample['bare']['sum_wall_s']:.2f}s frozen {sample['bare']['sum_frozen_ms']:.0f} ms")
    finally:
        bench.remove_pod(pod.id)
    bench.results["pair"] = {"mib": mib, "samples": samples}
