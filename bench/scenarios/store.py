"""Store dedup: the bytes a repeated checkpoint of an unchanged workload adds to the store, the previous one
still stored (results: "repeat"). The agent's peak RSS is the checkpoint scenario's, around its largest size.
"""

from __future__ import annotations

import json
from typing import Any

from bench.harness.base import log
from bench.harness.measure import store_usage
from bench.harness.ops import Bench


def run(bench: Bench) -> None:
    repeat(bench, bench.args.repeat_mib)


def repeat(bench: Bench, mib: int) -> None:
    runs = bench.args.runs
    log(f"{mib} MiB, unchanged: a first checkpoint, then {runs} repeats")
    pod = bench.new_pod("steady", mib, ["hog"], flip=False)
    ids: list[str] = []
    samples: list[dict[str, Any]] = []
    try:
        for i in range(runs + 1):
            before = store_usage(bench.store)
            cp, wall, _, _ = bench.cli("checkpoint", pod.id, "-o", "json")
            info = json.loads(cp.stdout)
            bench.checkpoints.append(info["id"])
            ids.append(info["id"])
            added = store_usage(bench.store) - before
            samples.append({"run": i, "added_bytes": added, "size": int(info.get("size", 0)),
                            "stored_size": int(info.get("stored_size", 0)), "wall_s": round(wall, 4),
                            "frozen_reported_ms": float(info.get("frozen_ms", 0.0))})
            if len(ids) > 2:
                bench.remove_checkpoint(ids[-3])
            bench.settle()
            log(f"  checkpoint {i}: +{added / 1048576:.1f} MiB in the store")
    finally:
        for ckpt in ids:
            if ckpt in bench.checkpoints:
                bench.remove_checkpoint(ckpt)
        bench.remove_pod(pod.id)
    bench.results["repeat"] = {"mib": mib, "first": samples[0], "samples": samples[1:]}
