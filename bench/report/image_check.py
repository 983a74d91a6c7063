"""The image check (bench/image_check.py's results): medians with it and without it, and the "image-check"
block of docs/benchmarks.md.
"""

from __future__ import annotations

import json
import statistics
import textwrap
from pathlib import Path
from typing import Any

from bench.report import fmt
from bench.report.results import IMAGE_CHECK_JSON


VARIANTS = ("on", "off")
CHECK_ALONE_RUNS = 20  # bench/scenarios/image_check.py times the check alone this many times


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """Medians per checkpoint kind: the restore call and the first tick with the check and without it, the
    check alone."""
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


def load(path: Path | None = None) -> dict[str, Any] | None:
    """bench/image_check.py's results file, or None where there is none."""
    try:
        data = json.loads((path or IMAGE_CHECK_JSON).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "summary" in data and "results" in data else None


def image_check_block(doc: dict[str, Any] | None) -> str:
    """The "image-check" block of docs/benchmarks.md: the run, the table, the check's time against the spread of
    on / off between runs."""
    if doc is None:
        return f"Not measured: {IMAGE_CHECK_JSON.name} holds no results of bench/image_check.py.\n"
    s, m, r = doc["summary"], doc["machine"], doc["results"]
    rows = []
    for kind, what in (("memhog", f"memhog, {r['mib']} MiB, 1 task"),
                       ("tasks", f"busybox shell, {s['tasks']['check_tasks']} tasks")):
        x = s[kind]
        rows.append([what, fmt.s(x["on_s"]), fmt.s(x["off_s"]), f"{x['ratio']:.3f}x" if x["ratio"] else "-",
                     fmt.s(x["first_tick_on_s"]), fmt.s(x["first_tick_off_s"]), f"{x['check_ms']:.1f} ms"])
    run = (f"Measured {doc['date'][:10]}: {r['runs']} runs after {r.get('warmup', 1)} untimed, alternating which "
           f"goes first; the check alone: median of {CHECK_ALONE_RUNS}. containerd {m.get('containerd', '?')}, "
           f"runc {m.get('runc', '?')}.")
    return (textwrap.fill(run, width=104, break_on_hyphens=False) + "\n\n"
            + fmt.md_table(["checkpoint", "restore call, on", "off", "on / off", "first tick after the call, on",
                            "off", "the check alone"], rows)
            + _reading(doc))


def _reading(doc: dict[str, Any]) -> str:
    """What the figures say: the check's own time against the spread of on / off between runs."""
    s, samples = doc["summary"], doc["results"]["samples"]
    out = []
    for kind, what in (("memhog", "one task"), ("tasks", f"{s['tasks']['check_tasks']} tasks")):
        per_run = [x[kind]["on"]["wall_s"] / x[kind]["off"]["wall_s"] for x in samples if x[kind]["off"]["wall_s"]]
        out.append(f"with {what}, the check alone takes {s[kind]['check_ms']:.1f} ms, "
                   f"{s[kind]['check_ms'] / 10 / max(s[kind]['on_s'], 1e-9):.2f}% of the restore call, while "
                   f"on / off varies from {min(per_run):.2f}x to {max(per_run):.2f}x between runs")
    return "\n" + textwrap.fill("Reading: " + "; ".join(out) + ".", width=104, break_on_hyphens=False) + "\n"
