"""Statistics over raw samples: medians per workload and per column, the summary every table and target reads.
"""

from __future__ import annotations

import statistics
from typing import Any


ANSWER_PATHS = ("cold", "local", "default", "full")


def median(xs: list[Any]) -> float | None:
    vals = [float(x) for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool)]
    return float(statistics.median(vals)) if vals else None


def div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def total(xs: Any) -> float | None:
    """The sum of a per-container list, None if any is missing."""
    if not isinstance(xs, list) or not xs or any(not isinstance(x, (int, float)) for x in xs):
        return None
    return float(sum(xs))


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"single": {}, "restore": {}}
    for mib, samples in results.get("single", {}).items():
        later = [s["agent"]["store_added_bytes"] for s in samples[1:]]
        out["single"][mib] = {
            "runs": len(samples),
            "size_bytes": median([s["agent"]["size"] for s in samples]),
            "agent_wall_s": median([s["agent"]["wall_s"] for s in samples]),
            "agent_frozen_reported_ms": median([s["agent"]["frozen_reported_ms"] for s in samples]),
            "agent_frozen_outside_ms": median([s["agent"]["frozen_outside_ms"] for s in samples]),
            "bare_wall_s": median([s["bare"]["wall_s"] for s in samples]),
            "bare_frozen_ms": median([s["bare"]["frozen_outside_ms"] for s in samples]),
            "tar_zstd_wall_s": median([s["bare_tar_zstd"]["wall_s"] for s in samples]),
            "tar_zstd_dump_s": median([s["bare_tar_zstd"]["dump_s"] for s in samples]),
            "tar_zstd_frozen_ms": median([s["bare_tar_zstd"]["frozen_outside_ms"] for s in samples]),
            "first_added_bytes": samples[0]["agent"]["store_added_bytes"] if samples else None,
            "ticking_repeat_added_bytes": median(later),
        }
    for mib, samples in results.get("restore", {}).items():
        out["restore"][mib] = {
            "runs": len(samples),
            "agent_wall_s": median([s["agent"]["wall_s"] for s in samples]),
            "agent_start_ms": median([s["agent"]["start_ms"] for s in samples]),
            "bare_wall_s": median([s["bare"]["wall_s"] for s in samples]),
            "bare_start_ms": median([s["bare"]["start_ms"] for s in samples]),
            "agent_criu_restore_ms": median([total(s["agent"].get("criu_restore_ms")) for s in samples]),
            "bare_criu_restore_ms": median([total(s["bare"].get("criu_restore_ms")) for s in samples]),
            "bare_sandbox_s": median([s["bare"]["sandbox_s"] for s in samples]),
            "bare_create_s": median([s["bare"]["create_s"] for s in samples]),
            "lazy_wall_s": median([s["lazy"]["wall_s"] for s in samples if "lazy" in s]),
            "lazy_start_ms": median([s["lazy"]["start_ms"] for s in samples if "lazy" in s]),
            "lazy_all_in_s": median([s["lazy"]["all_in_s"] for s in samples if "lazy" in s]),
            "lazy_tick_gap_max_ms": median([s["lazy"]["tick_gap_max_ms"] for s in samples if "lazy" in s]),
            "lazy_tick_gap_median_ms": median([s["lazy"]["tick_gap_median_ms"] for s in samples if "lazy" in s]),
        }
    reps = results.get("replicas")
    if reps and reps.get("samples"):
        starts = [x["start_ms"] for x in reps["samples"] if x.get("start_ms") is not None]
        out["replicas"] = {
            "mib": reps["mib"], "count": len(reps["samples"]),
            "start_ms_max": max(starts) if starts else None, "start_ms_median": median(starts),
            "wall_s_max": max(x["wall_s"] for x in reps["samples"]),
        }
    pair = results.get("pair")
    if pair:
        ss = pair["samples"]
        names = sorted(ss[0]["bare"]["containers"]) if ss else []
        out["pair"] = {
            "mib": pair["mib"],
            "runs": len(ss),
            "agent_wall_s": median([s["agent"]["wall_s"] for s in ss]),
            "agent_frozen_reported_ms": median([s["agent"]["frozen_reported_ms"] for s in ss]),
            "agent_frozen_outside_ms": median([s["agent"]["frozen_outside_ms"] for s in ss]),
            "bare_sum_wall_s": median([s["bare"]["sum_wall_s"] for s in ss]),
            "bare_sum_frozen_ms": median([s["bare"]["sum_frozen_ms"] for s in ss]),
            "bare": {
                n: {
                    "wall_s": median([s["bare"]["containers"][n]["wall_s"] for s in ss]),
                    "frozen_ms": median([s["bare"]["containers"][n]["frozen_outside_ms"] for s in ss]),
                }
                for n in names
            },
        }
    rep = results.get("repeat")
    if rep:
        added = median([s["added_bytes"] for s in rep["samples"]])
        size = median([s["size"] for s in rep["samples"]])
        out["repeat"] = {
            "mib": rep["mib"],
            "runs": len(rep["samples"]),
            "size_bytes": size,
            "first_added_bytes": rep["first"]["added_bytes"],
            "added_bytes": added,
            "added_fraction": (added / size) if added is not None and size else None,
        }
    rss = results.get("rss")
    if rss:
        out["rss"] = {
            "mib": rss["mib"],
            "peak_mib": round(rss["vm_hwm_kib"] / 1024, 1),
            "restarted": rss["restarted"],
        }
    nat = results.get("native")
    if nat and nat.get("skipped"):
        out["native_skipped"] = nat["skipped"]
    elif nat:
        out["native"] = _native_summary(nat)
    ans = results.get("answer")
    if ans and ans.get("skipped"):
        out["answer_skipped"] = ans["skipped"]
    elif ans:
        out["answer"] = _answer_summary(ans)
    return out


def _answer_summary(ans: dict[str, Any]) -> dict[str, Any]:
    """Medians per weights size of the time to first answer (bench/scenarios/firstanswer.py)."""
    out: dict[str, Any] = {}
    for mib, one in ans.get("sizes", {}).items():
        ss = one.get("samples", [])

        def col(path: str, key: str) -> float | None:
            return median([s[path].get(key) for s in ss if path in s])

        def per_run(path: str) -> float | None:
            return median([s[path]["answer_s"] / s[path]["running_s"] for s in ss
                            if path in s and s[path].get("running_s")])

        row: dict[str, Any] = {"runs": len(ss), "weights_bytes": one.get("weights_bytes"),
                               "cli_startup_ms": (one.get("cli") or {}).get("startup_ms")}
        for path in ANSWER_PATHS:
            row[f"{path}_running_s"] = col(path, "running_s")
            row[f"{path}_answer_s"] = col(path, "answer_s")
        for path in ("default", "full"):
            row[f"{path}_all_in_s"] = col(path, "all_in_s")
            row[f"{path}_answer_over_running"] = per_run(path)
        lazy = [s["default"].get("lazy") for s in ss if "default" in s]
        row["default_lazy"] = all(lazy) if lazy and None not in lazy else None
        for key in ("ready_s", "load_s", "warmup_s", "sandbox_s"):
            row[f"cold_{key}"] = col("cold", key)
        for key in ("sandbox_s", "devshm_s", "create_s", "start_call_s"):
            row[f"local_{key}"] = col("local", key)
        reps = one.get("replicas") or []
        if reps:
            answers = [r["answer_s"] for r in reps]
            row["replicas"] = {
                "count": len(reps), "answer_s_first": answers[0], "answer_s_median": median(answers),
                "answer_s_max": max(answers), "running_s_max": max(r["running_s"] for r in reps),
                "running_s_median": median([r["running_s"] for r in reps]),
                "slowest_over_first": div(max(answers), answers[0]),
            }
        out[mib] = row
    return out


def _native_summary(native: dict[str, Any]) -> dict[str, Any]:
    """Medians per size of the comparison with containerd's own path (bench/scenarios/native.py)."""
    out: dict[str, Any] = {}
    for mib, ss in native.get("sizes", {}).items():
        def col(op: str, key: str) -> float | None:
            return median([s[op].get(key) for s in ss if op in s])

        out[mib] = {
            "runs": len(ss),
            "agent_wall_s": col("agent", "wall_s"),
            "agent_frozen_outside_ms": col("agent", "frozen_outside_ms"),
            "agent_frozen_reported_ms": col("agent", "frozen_reported_ms"),
            "agent_after_thaw_s": median([s["agent"]["wall_s"] - s["agent"]["frozen_reported_ms"] / 1000
                                           for s in ss if "agent" in s]),
            "agent_store_added_bytes": col("agent", "store_added_bytes"),
            "agent_size_bytes": col("agent", "size"),
            "native_wall_s": col("native", "wall_s"),
            "native_call_s": col("native", "call_s"),
            "native_fsync_s": col("native", "fsync_s"),
            "native_frozen_ms": col("native", "frozen_outside_ms"),
            "native_archive_bytes": col("native", "archive_bytes"),
            "lazy_wall_s": col("lazy", "wall_s"),
            "lazy_start_ms": col("lazy", "start_ms"),
            "lazy_first_tick_s": col("lazy", "first_tick_s"),
            "lazy_all_in_s": col("lazy", "all_in_s"),
            "native_restore_wall_s": col("native_restore", "wall_s"),
            "native_restore_sandbox_s": col("native_restore", "sandbox_s"),
            "native_restore_create_s": col("native_restore", "create_s"),
            "native_restore_start_call_s": col("native_restore", "start_call_s"),
            "native_restore_start_ms": col("native_restore", "start_ms"),
            "native_restore_first_tick_s": col("native_restore", "first_tick_s"),
        }
    return out

