"""Medians, targets, the text tables and docs/benchmarks.md from raw samples.

One run of bench/run.py measures one containerd. The results file
(bench/results.json) keeps the latest run of each containerd version
(`{"schema": 2, "latest": "2.1", "runs": {"2.1": RUN, "1.6": RUN}}`, a RUN
being what `build` returns), and docs/benchmarks.md shows all of them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import textwrap
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
from pathlib import Path
from typing import Any, Callable

SCHEMA = 2
RSS_LIMIT_MIB = 200
# Against containerd's own CRI checkpoint and restore (bench/native.py), at the native target size.
NATIVE_LIMITS = {"native_durable": 0.5, "native_frozen": 0.15, "native_restore": 0.5}
# Time to first answer of the model server (bench/firstanswer.py): the sizes its targets are judged at
# (or the smallest and, from 1024 MiB, the largest measured) and their limits.
ANSWER_SMALL_MIB, ANSWER_LARGE_MIB = 256, 2048
ANSWER_LIMITS = {"answer_first_s": 0.75, "answer_running": 1.25, "answer_cold": 0.3, "answer_replicas": 1.5,
                 "answer_large_local": 1.0, "answer_large_cold": 0.3}
ANSWER_PATHS = ("cold", "local", "default", "full")


def _median(xs: list[Any]) -> float | None:
    vals = [float(x) for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool)]
    return float(statistics.median(vals)) if vals else None


def _cmd_first_line(argv: list[str]) -> str:
    try:
        cp = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return "not found"
    if cp.returncode != 0:
        return "unknown"
    text = (cp.stdout or cp.stderr).strip()
    return text.splitlines()[0] if text else "unknown"


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def _fstype(path: str) -> str:
    """The filesystem type of the mount ``path`` lies on."""
    from node_agent.cli.checks import mount_of, mounts

    found = mount_of(path, mounts())
    return found.fstype if found is not None else "unknown"


def machine_info(repo: Path) -> dict[str, Any]:
    cpuinfo = _read("/proc/cpuinfo")
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    mem = re.search(r"^MemTotal:\s*(\d+)", _read("/proc/meminfo"), re.M)
    osrel = re.search(r'^PRETTY_NAME="?([^"\n]+)', _read("/etc/os-release"), re.M)
    criu_line = _cmd_first_line(["criu", "--version"])
    ctrd = _cmd_first_line(["containerd", "--version"]).split(" ")
    zstd = _cmd_first_line(["zstd", "--version"])
    commit = _cmd_first_line(["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"])
    try:
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=20).stdout.strip() != ""
    except (OSError, subprocess.SubprocessError):
        dirty = False
    return {
        "cores": os.cpu_count(),
        "cpu": model.group(1).strip() if model else platform.machine(),
        "memory_gib": round(int(mem.group(1)) / 1048576, 1) if mem else None,
        "kernel": platform.release(),
        "os": (osrel.group(1) if osrel else "unknown") + (f" ({_read('/etc/debian_version').strip()})"
                                                          if os.path.exists("/etc/debian_version") else ""),
        "cgroup": "v2" if os.path.exists("/sys/fs/cgroup/cgroup.controllers") else "v1",
        "containerd": (ctrd[2] if len(ctrd) > 2 else "unknown"),
        "runc": _cmd_first_line(["runc", "--version"]).removeprefix("runc version "),
        "criu": criu_line.removeprefix("Version: "),
        "criu_path": shutil.which("criu") or "",
        "run_fs": _fstype("/run"),
        "zstd": (re.findall(r"v\d+\.\d+\.\d+", zstd) or [zstd])[0],
        "python": platform.python_version(),
        "node_agent_commit": commit + (" with local changes" if dirty and commit != "unknown" else ""),
    }


def bed_info(info: dict[str, Any]) -> dict[str, Any]:
    """The test bed's containerd and runc, which `machine_info` cannot know (a bed may run a
    containerd other than the one on PATH)."""
    return {
        "containerd": str(info.get("containerd_version") or "unknown"),
        "containerd_binary": str(info.get("containerd_binary") or ""),
        "runc": str(info.get("runc_version") or "unknown"),
        "runc_binary": str(info.get("runc_binary") or ""),
    }


def series(version: str) -> str:
    """`2.1.9+unknown` -> `2.1`: the containerd version a results file keeps one run of."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return f"{m.group(1)}.{m.group(2)}" if m else version or "unknown"


def _series_key(s: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in s.split("."))
    except ValueError:
        return (0,)


def load(path: Path) -> dict[str, Any] | None:
    """A results file, in the current layout (one written by schema 1 held a single run)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    if isinstance(data.get("runs"), dict):
        return data
    if "machine" in data and "summary" in data:
        key = series(str(data["machine"].get("containerd", "")))
        return {"schema": SCHEMA, "latest": key, "runs": {key: data}}
    return None


def merge(old: dict[str, Any] | None, doc: dict[str, Any]) -> dict[str, Any]:
    """`old` with this run in place of the earlier one of its containerd version."""
    key = series(doc["machine"]["containerd"])
    runs = dict(old["runs"]) if old else {}
    runs[key] = doc
    return {"schema": SCHEMA, "latest": key, "runs": runs}


def series_order(merged: dict[str, Any]) -> list[str]:
    """The containerd versions of a results file, newest first."""
    return sorted(merged["runs"], key=_series_key, reverse=True)


# ---- summary ------------------------------------------------------------------


def _total(xs: Any) -> float | None:
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
            "size_bytes": _median([s["agent"]["size"] for s in samples]),
            "agent_wall_s": _median([s["agent"]["wall_s"] for s in samples]),
            "agent_frozen_reported_ms": _median([s["agent"]["frozen_reported_ms"] for s in samples]),
            "agent_frozen_outside_ms": _median([s["agent"]["frozen_outside_ms"] for s in samples]),
            "bare_wall_s": _median([s["bare"]["wall_s"] for s in samples]),
            "bare_frozen_ms": _median([s["bare"]["frozen_outside_ms"] for s in samples]),
            "tar_zstd_wall_s": _median([s["bare_tar_zstd"]["wall_s"] for s in samples]),
            "tar_zstd_dump_s": _median([s["bare_tar_zstd"]["dump_s"] for s in samples]),
            "tar_zstd_frozen_ms": _median([s["bare_tar_zstd"]["frozen_outside_ms"] for s in samples]),
            "first_added_bytes": samples[0]["agent"]["store_added_bytes"] if samples else None,
            "ticking_repeat_added_bytes": _median(later),
        }
    for mib, samples in results.get("restore", {}).items():
        out["restore"][mib] = {
            "runs": len(samples),
            "agent_wall_s": _median([s["agent"]["wall_s"] for s in samples]),
            "agent_start_ms": _median([s["agent"]["start_ms"] for s in samples]),
            "bare_wall_s": _median([s["bare"]["wall_s"] for s in samples]),
            "bare_start_ms": _median([s["bare"]["start_ms"] for s in samples]),
            "agent_criu_restore_ms": _median([_total(s["agent"].get("criu_restore_ms")) for s in samples]),
            "bare_criu_restore_ms": _median([_total(s["bare"].get("criu_restore_ms")) for s in samples]),
            "bare_sandbox_s": _median([s["bare"]["sandbox_s"] for s in samples]),
            "bare_create_s": _median([s["bare"]["create_s"] for s in samples]),
            "lazy_wall_s": _median([s["lazy"]["wall_s"] for s in samples if "lazy" in s]),
            "lazy_start_ms": _median([s["lazy"]["start_ms"] for s in samples if "lazy" in s]),
            "lazy_all_in_s": _median([s["lazy"]["all_in_s"] for s in samples if "lazy" in s]),
            "lazy_tick_gap_max_ms": _median([s["lazy"]["tick_gap_max_ms"] for s in samples if "lazy" in s]),
            "lazy_tick_gap_median_ms": _median([s["lazy"]["tick_gap_median_ms"] for s in samples if "lazy" in s]),
        }
    reps = results.get("replicas")
    if reps and reps.get("samples"):
        starts = [x["start_ms"] for x in reps["samples"] if x.get("start_ms") is not None]
        out["replicas"] = {
            "mib": reps["mib"], "count": len(reps["samples"]),
            "start_ms_max": max(starts) if starts else None, "start_ms_median": _median(starts),
            "wall_s_max": max(x["wall_s"] for x in reps["samples"]),
        }
    pair = results.get("pair")
    if pair:
        ss = pair["samples"]
        names = sorted(ss[0]["bare"]["containers"]) if ss else []
        out["pair"] = {
            "mib": pair["mib"],
            "runs": len(ss),
            "agent_wall_s": _median([s["agent"]["wall_s"] for s in ss]),
            "agent_frozen_reported_ms": _median([s["agent"]["frozen_reported_ms"] for s in ss]),
            "agent_frozen_outside_ms": _median([s["agent"]["frozen_outside_ms"] for s in ss]),
            "bare_sum_wall_s": _median([s["bare"]["sum_wall_s"] for s in ss]),
            "bare_sum_frozen_ms": _median([s["bare"]["sum_frozen_ms"] for s in ss]),
            "bare": {
                n: {
                    "wall_s": _median([s["bare"]["containers"][n]["wall_s"] for s in ss]),
                    "frozen_ms": _median([s["bare"]["containers"][n]["frozen_outside_ms"] for s in ss]),
                }
                for n in names
            },
        }
    rep = results.get("repeat")
    if rep:
        added = _median([s["added_bytes"] for s in rep["samples"]])
        size = _median([s["size"] for s in rep["samples"]])
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
    """Medians per weights size of the time to first answer (bench/firstanswer.py)."""
    out: dict[str, Any] = {}
    for mib, one in ans.get("sizes", {}).items():
        ss = one.get("samples", [])

        def col(path: str, key: str) -> float | None:
            return _median([s[path].get(key) for s in ss if path in s])

        def per_run(path: str) -> float | None:
            return _median([s[path]["answer_s"] / s[path]["running_s"] for s in ss
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
                "count": len(reps), "answer_s_first": answers[0], "answer_s_median": _median(answers),
                "answer_s_max": max(answers), "running_s_max": max(r["running_s"] for r in reps),
                "running_s_median": _median([r["running_s"] for r in reps]),
                "slowest_over_first": _div(max(answers), answers[0]),
            }
        out[mib] = row
    return out


def answer_sizes(summary: dict[str, Any]) -> tuple[str | None, str | None]:
    """The weights sizes (MiB, as keys) the first-answer targets are judged at: the small one
    (256 MiB, else the smallest) and the large one (2048 MiB, else the largest from 1024 MiB on)."""
    sizes = sorted(summary.get("answer") or {}, key=int)
    if not sizes:
        return None, None
    small = str(ANSWER_SMALL_MIB) if str(ANSWER_SMALL_MIB) in sizes else sizes[0]
    large = str(ANSWER_LARGE_MIB) if str(ANSWER_LARGE_MIB) in sizes else sizes[-1]
    if large == small or int(large) < 1024:
        large = None
    return small, large


def answer_targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    small, large = answer_sizes(summary)
    t: list[dict[str, Any]] = []
    if small is not None:
        a = summary["answer"][small]
        lim = ANSWER_LIMITS["answer_first_s"]
        t.append(_target(
            "answer_first", f"model server {small} MiB: first answer, default restore",
            _s(a.get("default_answer_s")), _div(a.get("default_answer_s"), lim), 1.0, unit=f"of {lim:g} s"))
        t.append(_target(
            "answer_running", f"model server {small} MiB: first answer / the same restore's time until running, "
                              "default restore",
            f"{_s(a.get('default_answer_s'))} vs {_s(a.get('default_running_s'))} (median of each run's ratio)",
            a.get("default_answer_over_running"), ANSWER_LIMITS["answer_running"]))
        t.append(_target(
            "answer_cold", f"model server {small} MiB: first answer, default restore / cold start",
            f"{_s(a.get('default_answer_s'))} vs {_s(a.get('cold_answer_s'))}",
            _div(a.get("default_answer_s"), a.get("cold_answer_s")), ANSWER_LIMITS["answer_cold"]))
        r = a.get("replicas")
        if r:
            t.append(_target(
                "answer_replicas", f"model server {small} MiB: {r['count']} replicas one after another, slowest "
                                   "first answer / the first's",
                f"{_s(r['answer_s_max'])} vs {_s(r['answer_s_first'])}", r.get("slowest_over_first"),
                ANSWER_LIMITS["answer_replicas"]))
    if large is not None:
        a = summary["answer"][large]
        t.append(_target(
            "answer_large_local", f"model server {large} MiB: first answer, default restore / local plan's",
            f"{_s(a.get('default_answer_s'))} vs {_s(a.get('local_answer_s'))}",
            _div(a.get("default_answer_s"), a.get("local_answer_s")), ANSWER_LIMITS["answer_large_local"]))
        t.append(_target(
            "answer_large_cold", f"model server {large} MiB: first answer, default restore / cold start",
            f"{_s(a.get('default_answer_s'))} vs {_s(a.get('cold_answer_s'))}",
            _div(a.get("default_answer_s"), a.get("cold_answer_s")), ANSWER_LIMITS["answer_large_cold"]))
    return t


def _native_summary(native: dict[str, Any]) -> dict[str, Any]:
    """Medians per size of the comparison with containerd's own path (bench/native.py)."""
    out: dict[str, Any] = {}
    for mib, ss in native.get("sizes", {}).items():
        def col(op: str, key: str) -> float | None:
            return _median([s[op].get(key) for s in ss if op in s])

        out[mib] = {
            "runs": len(ss),
            "agent_wall_s": col("agent", "wall_s"),
            "agent_frozen_outside_ms": col("agent", "frozen_outside_ms"),
            "agent_frozen_reported_ms": col("agent", "frozen_reported_ms"),
            "agent_after_thaw_s": _median([s["agent"]["wall_s"] - s["agent"]["frozen_reported_ms"] / 1000
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


def _target(key: str, title: str, measured: str, ratio: float | None, limit: float, strict: bool = False,
            unit: str = "x") -> dict[str, Any]:
    ok: bool | None = None
    margin: float | None = None
    if ratio is not None and math.isfinite(ratio):
        ok = ratio < limit if strict else ratio <= limit
        margin = round((ratio / limit - 1) * 100, 1)
    return {"key": key, "title": title, "measured": measured, "ratio": ratio, "limit": limit,
            "op": "<" if strict else "<=", "unit": unit, "pass": ok, "margin_pct": margin}


def _div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f} ms"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 1048576:.1f} MiB"


def targets(summary: dict[str, Any], target_mib: int, native_mib: int | None = None) -> list[dict[str, Any]]:
    t: list[dict[str, Any]] = []
    one = summary["single"].get(str(target_mib), {})
    res = summary["restore"].get(str(target_mib), {})
    r = _div(one.get("agent_frozen_outside_ms"), one.get("bare_frozen_ms"))
    t.append(_target(
        "frozen_one", f"frozen window, 1 x {target_mib} MiB / bare runc checkpoint",
        f"{_ms(one.get('agent_frozen_outside_ms'))} (agent says {_ms(one.get('agent_frozen_reported_ms'))}) "
        f"vs {_ms(one.get('bare_frozen_ms'))}", r, 1.1))
    pair = summary.get("pair", {})
    r = _div(pair.get("agent_frozen_outside_ms"), pair.get("bare_sum_frozen_ms"))
    t.append(_target(
        "frozen_pair", f"pod-wide frozen window, 2 x {pair.get('mib', '?')} MiB / sum of 2 bare dumps",
        f"{_ms(pair.get('agent_frozen_outside_ms'))} (agent says {_ms(pair.get('agent_frozen_reported_ms'))}) "
        f"vs {_ms(pair.get('bare_sum_frozen_ms'))}", r, 0.75))
    r = _div(one.get("agent_wall_s"), one.get("tar_zstd_wall_s"))
    t.append(_target(
        "durable", f"until durable, {target_mib} MiB / runc checkpoint + tar|zstd + fsync",
        f"{_s(one.get('agent_wall_s'))} vs {_s(one.get('tar_zstd_wall_s'))}", r, 1.0, strict=True))
    r = _div(res.get("agent_wall_s"), res.get("bare_wall_s"))
    t.append(_target(
        "restore", f"restore until running, {target_mib} MiB / same plan from local disk",
        f"{_s(res.get('agent_wall_s'))} vs {_s(res.get('bare_wall_s'))}", r, 1.3))
    r = _div(res.get("lazy_wall_s"), res.get("bare_wall_s"))
    t.append(_target(
        "restore_lazy", f"restore until running, lazy (the default), {target_mib} MiB / same plan from local disk",
        f"{_s(res.get('lazy_wall_s'))} vs {_s(res.get('bare_wall_s'))}", r, 1.3))
    start = res.get("lazy_start_ms")
    t.append(_target(
        "lazy_start", f"lazy: StartContainer until running, {target_mib} MiB",
        _ms(start), _div(start, 300.0), 1.0, unit="of 0.3 s"))
    t.append(_target(
        "lazy_whole", f"lazy: whole restore --lazy --start, sandbox included, {target_mib} MiB",
        _s(res.get("lazy_wall_s")), _div(res.get("lazy_wall_s"), 0.7), 1.0, unit="of 0.7 s"))
    sizes = sorted(summary["restore"], key=int)
    if len(sizes) > 1:
        lo, hi = summary["restore"][sizes[0]], summary["restore"][sizes[-1]]
        t.append(_target(
            "lazy_flat", f"lazy: time to running, {sizes[-1]} MiB / {sizes[0]} MiB",
            f"{_s(hi.get('lazy_wall_s'))} vs {_s(lo.get('lazy_wall_s'))}",
            _div(hi.get("lazy_wall_s"), lo.get("lazy_wall_s")), 1.2))
    t.append(_target(
        "lazy_all_in", f"lazy: every page in, {target_mib} MiB / full restore until running",
        f"{_s(res.get('lazy_all_in_s'))} vs {_s(res.get('agent_wall_s'))}",
        _div(res.get("lazy_all_in_s"), res.get("agent_wall_s")), 1.0))
    reps = summary.get("replicas", {})
    t.append(_target(
        "lazy_replicas", f"lazy: {reps.get('count', '?')} replicas of {reps.get('mib', '?')} MiB one after another, "
                         "slowest StartContainer",
        _ms(reps.get("start_ms_max")), _div(reps.get("start_ms_max"), 300.0), 1.0, unit="of 0.3 s"))
    rep = summary.get("repeat", {})
    frac = rep.get("added_fraction")
    t.append(_target(
        "repeat_store", f"store growth, repeated checkpoint of unchanged {rep.get('mib', '?')} MiB",
        f"{_mib(rep.get('added_bytes'))} of {_mib(rep.get('size_bytes'))}"
        + (f" ({frac * 100:.2f}%)" if frac is not None else ""), frac, 0.05, unit="fraction"))
    rss = summary.get("rss", {})
    peak = rss.get("peak_mib")
    t.append(_target(
        "rss", f"agent peak RSS, {rss.get('mib', '?')} MiB checkpoint"
               + ("" if rss.get("restarted", True) else " (since agent start)"),
        "-" if peak is None else f"{peak:.0f} MiB", _div(peak, RSS_LIMIT_MIB), 1.0, unit="of 200 MiB"))
    nat = summary.get("native", {}).get(str(native_mib), {}) if native_mib is not None else {}
    if nat:
        # What the same run measured for bare runc at that size, against containerd's figure: the
        # ratio a path that only dumps (frozen) or dumps and compresses (durable) would reach.
        same = summary["single"].get(str(native_mib), {})

        def floor(what: str, x: float | None, fmt: Callable[[float | None], str], of: float | None) -> str:
            r = _div(x, of)
            return "" if r is None else f" ({what} alone: {fmt(x)}, {r:.2f}x)"

        t.append(_target(
            "native_durable", f"vs containerd: until durable, {native_mib} MiB fresh / CheckpointContainer + fsync",
            f"{_s(nat.get('agent_wall_s'))} vs {_s(nat.get('native_wall_s'))}"
            + floor("runc + tar|zstd + fsync", same.get("tar_zstd_wall_s"), _s, nat.get("native_wall_s")),
            _div(nat.get("agent_wall_s"), nat.get("native_wall_s")), NATIVE_LIMITS["native_durable"]))
        t.append(_target(
            "native_frozen", f"vs containerd: frozen window, {native_mib} MiB fresh / CheckpointContainer's",
            f"{_ms(nat.get('agent_frozen_outside_ms'))} vs {_ms(nat.get('native_frozen_ms'))}"
            + floor("bare runc's dump", same.get("bare_frozen_ms"), _ms, nat.get("native_frozen_ms")),
            _div(nat.get("agent_frozen_outside_ms"), nat.get("native_frozen_ms")), NATIVE_LIMITS["native_frozen"]))
        t.append(_target(
            "native_restore", f"vs containerd: lazy restore until running, {native_mib} MiB fresh / containerd's "
                              "restore from the archive",
            f"{_s(nat.get('lazy_wall_s'))} vs {_s(nat.get('native_restore_wall_s'))}",
            _div(nat.get("lazy_wall_s"), nat.get("native_restore_wall_s")), NATIVE_LIMITS["native_restore"]))
    return t


def build(args: argparse.Namespace, machine: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    sizes = list(args.sizes)
    target_mib = 1024 if 1024 in sizes else max(sizes)
    nsizes = list(getattr(args, "native_sizes", None) or [])
    native_mib = (1024 if 1024 in nsizes else max(nsizes)) if nsizes else None
    summary = summarize(results)
    answer_only = bool(getattr(args, "answer_only", False))
    ts = [] if answer_only else targets(summary, target_mib, native_mib)
    ts += answer_targets(summary)
    return {
        "schema": SCHEMA,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine,
        "config": {
            "sizes_mib": sizes, "runs": args.runs, "pair_mib": args.pair, "repeat_mib": args.repeat_mib,
            "quick": bool(args.quick), "settle_s": args.settle, "bed": args.bed, "attached": bool(args.attach),
            "target_mib": target_mib, "tick_ms": 5, "note": args.note, "warmup": args.warmup,
            "native_sizes_mib": nsizes if "native" in summary else [], "native_target_mib": native_mib,
            "answer_sizes_mib": sorted((int(k) for k in summary.get("answer") or {})),
            "answer_runs": getattr(args, "answer_runs", None), "answer_large_runs": getattr(args, "answer_large_runs", None),
            "answer_replicas": getattr(args, "answer_replicas", None), "answer_only": answer_only,
        },
        "samples": results,
        "summary": summary,
        "targets": ts,
    }


# ---- rendering ------------------------------------------------------------------


def verdict(t: dict[str, Any]) -> str:
    if t["pass"] is None:
        return "n/a"
    m = t["margin_pct"]
    if t["pass"]:
        return f"PASS ({-m:.0f}% under the limit)" if m < 0 else "PASS (at the limit)"
    return f"MISS (by {m:.0f}%)" if m > 0 else "MISS (at the limit)"


def _ratio(t: dict[str, Any]) -> str:
    r = t["ratio"]
    if r is None:
        return "-"
    if t["unit"] == "fraction":
        return f"{r * 100:.2f}%"
    if t["unit"] == "of 200 MiB":
        return f"{r:.2f} x 200 MiB"
    if t["unit"].startswith("of "):
        return f"{r:.2f} x {t['unit'][3:]}"
    return f"{r:.2f}x"


def _limit(t: dict[str, Any]) -> str:
    if t["unit"] == "fraction":
        return f"{t['op']} {t['limit'] * 100:.0f}%"
    if t["unit"] == "of 200 MiB":
        return f"{t['op']} 200 MiB"
    if t["unit"].startswith("of "):
        return f"{t['op']} {t['unit'][3:]}"
    return f"{t['op']} {t['limit']:.2f}x"


def _tables(doc: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    s = doc["summary"]
    runs = doc["config"]["runs"]
    out: list[tuple[str, list[str], list[list[str]]]] = []
    out.append((
        "Targets",
        ["target", "measured (median)", "ratio", "limit", "result"],
        [[t["title"], t["measured"], _ratio(t), _limit(t), verdict(t)] for t in doc["targets"]],
    ))
    rows = []
    for mib in sorted(s["single"], key=int):
        x = s["single"][mib]
        rows.append([
            f"{mib} MiB", _s(x["agent_wall_s"]), _ms(x["agent_frozen_reported_ms"]), _ms(x["agent_frozen_outside_ms"]),
            _s(x["bare_wall_s"]), _ms(x["bare_frozen_ms"]), _s(x["tar_zstd_wall_s"]), _ms(x["tar_zstd_frozen_ms"]),
            _mib(x["first_added_bytes"]), _mib(x["ticking_repeat_added_bytes"]),
        ])
    out.append((
        f"Checkpoint, one container (medians of {runs})",
        ["workload", "agent", "agent: frozen (reported)", "agent: frozen (log)", "runc", "runc: frozen",
         "runc+tar|zstd", "runc+tar|zstd: frozen", "store: first", "store: next (ticking)"],
        rows,
    ))
    if "pair" in s:
        p = s["pair"]
        per = ", ".join(f"{n}: {_s(v['wall_s'])} / {_ms(v['frozen_ms'])}" for n, v in p["bare"].items())
        out.append((
            f"Checkpoint, two containers of {p['mib']} MiB (medians of {p['runs']})",
            ["agent", "agent: frozen (reported)", "agent: frozen (log)", "runc, sum", "runc: frozen, sum",
             "runc per container (time / frozen)"],
            [[_s(p["agent_wall_s"]), _ms(p["agent_frozen_reported_ms"]), _ms(p["agent_frozen_outside_ms"]),
              _s(p["bare_sum_wall_s"]), _ms(p["bare_sum_frozen_ms"]), per]],
        ))
    rows = []
    for mib in sorted(s["restore"], key=int):
        x = s["restore"][mib]
        rows.append([
            f"{mib} MiB", _s(x["agent_wall_s"]), _ms(x["agent_start_ms"]), _ms(x.get("agent_criu_restore_ms")),
            _s(x["bare_wall_s"]), _ms(x["bare_start_ms"]), _ms(x.get("bare_criu_restore_ms")),
            _s(x["bare_sandbox_s"]), _s(x["bare_create_s"]),
            _s(x.get("lazy_wall_s")), _ms(x.get("lazy_start_ms")), _s(x.get("lazy_all_in_s")),
            f"{_ms(x.get('lazy_tick_gap_median_ms'))} / {_ms(x.get('lazy_tick_gap_max_ms'))}",
        ])
    out.append((
        f"Restore until running (medians of {runs})",
        ["workload", "agent (full)", "agent: StartContainer", "agent: CRIU", "local plan", "local: StartContainer",
         "local: CRIU", "local: sandbox", "local: create", "lazy", "lazy: StartContainer", "lazy: all pages in",
         "lazy: tick gap median / max"],
        rows,
    ))
    if "replicas" in s:
        r = s["replicas"]
        out.append((
            f"Lazy replicas of one {r['mib']} MiB checkpoint, one after another, all kept running",
            ["replicas", "StartContainer, median", "StartContainer, slowest", "slowest restore call"],
            [[str(r["count"]), _ms(r["start_ms_median"]), _ms(r["start_ms_max"]), _s(r["wall_s_max"])]],
        ))
    rows = []
    if "repeat" in s:
        r = s["repeat"]
        rows.append([f"repeated checkpoint, unchanged {r['mib']} MiB", f"first {_mib(r['first_added_bytes'])}, "
                     f"then {_mib(r['added_bytes'])} each (median of {r['runs']})"])
    if "rss" in s:
        r = s["rss"]
        rows.append([f"agent peak RSS, {r['mib']} MiB checkpoint",
                     f"{r['peak_mib']:.0f} MiB" + ("" if r["restarted"] else " (since the agent's start)")])
    out.append(("Store and memory", ["what", "value"], rows))
    nat = s.get("native") or {}
    if nat:
        n_runs = max(x["runs"] for x in nat.values())
        rows = []
        for mib in sorted(nat, key=int):
            x = nat[mib]
            rows.append([
                f"{mib} MiB", _s(x["agent_wall_s"]), _ms(x["agent_frozen_outside_ms"]), _s(x.get("agent_after_thaw_s")),
                _mib(x["agent_store_added_bytes"]), _s(x["native_wall_s"]), _s(x["native_call_s"]),
                _ms(x["native_frozen_ms"]), _mib(x["native_archive_bytes"]),
            ])
        out.append((
            f"Against containerd's CheckpointContainer, fresh random memory each run (medians of {n_runs})",
            ["workload", "agent (durable)", "agent: frozen (log)", "agent: outside the freeze",
             "agent: added to the store", "containerd: call + fsync (durable)", "containerd: call",
             "containerd: frozen (log)", "containerd: archive"],
            rows,
        ))
        rows = []
        for mib in sorted(nat, key=int):
            x = nat[mib]
            rows.append([
                f"{mib} MiB", _s(x["lazy_wall_s"]), _ms(x["lazy_start_ms"]), _s(x["lazy_first_tick_s"]),
                _s(x["lazy_all_in_s"]), _s(x["native_restore_wall_s"]), _s(x["native_restore_sandbox_s"]),
                _s(x["native_restore_create_s"]), _s(x["native_restore_start_call_s"]),
                _s(x["native_restore_first_tick_s"]),
            ])
        out.append((
            f"Restore of those checkpoints: the agent's lazy restore against containerd's (medians of {n_runs})",
            ["workload", "agent lazy: running", "agent lazy: StartContainer", "agent lazy: first tick",
             "agent lazy: all pages in", "containerd: running", "containerd: sandbox",
             "containerd: CreateContainer", "containerd: StartContainer", "containerd: first tick"],
            rows,
        ))
    out += _answer_tables(s)
    # A run of the first-answer table alone (--answer-only) measured none of the others.
    if doc["config"].get("answer_only"):
        out = [t for t in out if t[2]]
    return out


def _answer_tables(s: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    ans = s.get("answer") or {}
    if not ans:
        return []
    out: list[tuple[str, list[str], list[list[str]]]] = []
    rows = []
    for mib in sorted(ans, key=int):
        x = ans[mib]
        lazy = {True: " (lazy)", False: " (full)"}.get(x.get("default_lazy"), "")
        rows.append([
            f"{mib} MiB", str(x["runs"]), _s(x["cold_answer_s"]), _s(x.get("cold_ready_s")),
            _s(x["local_running_s"]), _s(x["local_answer_s"]),
            _s(x["default_running_s"]), _s(x["default_answer_s"]) + lazy, _s(x.get("default_all_in_s")),
            _s(x["full_running_s"]), _s(x["full_answer_s"]), _ms(x.get("cli_startup_ms")),
        ])
    out.append((
        "Time to first answer, model server: from the restore request reaching the agent (cold and local plan: "
        "from RunPodSandbox), CLI start-up not included (medians)",
        ["weights", "runs", "cold: first answer", "cold: server's own start-up", "local plan: running",
         "local plan: first answer", "default: running", "default: first answer", "default: all pages in",
         "full: running", "full: first answer", "CLI start-up (not included)"],
        rows,
    ))
    rows = []
    for mib in sorted(ans, key=int):
        r = ans[mib].get("replicas")
        if r:
            rows.append([f"{mib} MiB", str(r["count"]), _s(r["answer_s_first"]), _s(r["answer_s_median"]),
                         _s(r["answer_s_max"]), "-" if r.get("slowest_over_first") is None
                         else f"{r['slowest_over_first']:.2f}x", _s(r["running_s_median"]), _s(r["running_s_max"])])
    if rows:
        out.append((
            "Model server replicas of one checkpoint, default restore, one after another, all kept running",
            ["weights", "replicas", "first answer: the first", "first answer: median", "first answer: slowest",
             "slowest / first", "running: median", "running: slowest"],
            rows,
        ))
    return out


def _text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [len(h) for h in header]
    for r in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, r)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n"


def text_tables(doc: dict[str, Any]) -> str:
    parts = []
    for title, header, rows in _tables(doc):
        parts.append(f"\n{title}\n{_text_table(header, rows)}")
    m = doc["machine"]
    parts.append(f"\n{doc['date']}  {m['cores']} cores, kernel {m['kernel']}, containerd {m['containerd']}, "
                 f"runc {m['runc']}, CRIU {m['criu']}\n")
    return "".join(parts)


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    esc: Callable[[str], str] = lambda c: c.replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(esc(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


METHOD = """\
## How each number is measured

Every workload is a pod on a private containerd node (`scripts/testbed`) with
the agent's restore handler, running `memhog`
(`scripts/testbed_images/memhog.c`): it holds N MiB of pseudo-random memory,
flips one word per tick, and prints `tick N` to stdout every 5 ms.
containerd stamps every line it reads from the container's pipe (RFC 3339,
nanoseconds) in the CRI log file. On one workload the runs are interleaved
(agent, bare runc, runc + tar | zstd, agent, ...), with `sync` and a short
pause between operations, after one untimed round of the same operations
(`--warmup`: the first dump of a fresh process, and the first use of a
GiB of fresh memory, is slower whoever does it); every number is the median
of the timed runs. The raw samples, warm-up rounds included, are in the JSON.

- **Frozen window (log).** The largest gap between consecutive tick stamps in
  the container's CRI log, from the last tick before the operation started to
  the first tick after it ended. For the pod of two containers it is the
  largest gap in either container's log during the agent's one checkpoint
  (both are frozen together); the bare figure is the sum of the two
  containers' gaps, each during its own `runc checkpoint`. A gap includes up to
  one tick interval (5 ms) on both sides of the comparison.
- **Frozen window (agent).** `frozen_ms` from `node-agent checkpoint -o json`:
  from the freeze of the first container to the thaw of the last.
- **Checkpoint (agent).** Wall time of `node-agent checkpoint POD -o json`, the
  CLI process included. It returns after the checkpoint's manifest is
  published, so this is also the time until the checkpoint is durable in the
  store.
- **runc.** Wall time of `runc --root <runc root> checkpoint --leave-running
  --image-path D --work-path W <container>` into a local directory on the same
  file system as the store (not fsynced), one container at a time.
- **runc + tar | zstd.** The same dump, then `tar -C D -cf - . | zstd -1 -T0 -o F`,
  then fsync of F and of its directory: the time until the compressed file is
  durable.
- **Store: first / next (ticking).** Bytes added to the checkpoint store (every
  file under the store directory except `work/`, `plans/`, `logs/`, `journal/`,
  `bin/` and `ingest/`: blobs and manifests) by the first timed agent
  checkpoint of a workload, and (median) by each later one while the previous
  one is still stored. The ticking workload changes one word every 5 ms,
  spread over its whole memory.
- **Repeated checkpoint, unchanged.** The same, on a separate pod whose
  memhog ticks every 5 ms but flips no word (`--flip 0`), so its memory stays
  the same apart from its counter and stack: a first checkpoint, then repeats,
  each measured with the previous one stored. The limit is 5% of the
  checkpoint's size.
- **Restore (agent).** Wall time of `node-agent restore ID --namespace bench-r
  --start -o json`: verification of every blob, the sandbox, `/dev/shm`, the
  container, the restore plan read from the store, and StartContainer, which
  runs `runc restore` through the handler's wrapper. StartContainer alone is
  taken from containerd's log ("StartContainer for" to "returns
  successfully").
- **CRIU.** The run time CRIU logged for the restore (the last time stamp
  of its `restore.log`): the part of StartContainer that restores memory and
  processes.
- **Restore (local plan), the baseline.** The restore plan the agent writes
  for the same checkpoint (CRIU images, writable-layer diff, `plan.json`) is
  copied once to a local directory beforehand. For each run a fresh private
  copy of it is made (untimed), then, timed, through plain CRI calls from
  the benchmark process: RunPodSandbox with the same runtime handler,
  CreateContainer with the same container config, a rename of the plan into
  `<store>/plans/<container id>/`, and StartContainer. That is `runc restore`
  from a local directory as containerd runs it, with no store read, no
  verification and no CLI process. Each restored pod is checked to run and
  tick, then removed, before the next run.
- **Restore (lazy).** The same call with `--lazy` (the agent's default where
  CRIU and the kernel support it): the container starts before its memory is
  read; a page source serves the pages from the store, on demand and then in
  the background. "All pages in" runs from the restore call until the agent
  records that the last page arrived. Each tick of the restored memhog flips
  a word on a random page, so a page not yet in costs that tick a fault
  served from the store: the tick gaps (median / largest, expected 5 ms)
  between the restore call and "all pages in" are the first-touch latency
  the workload sees.
- **Lazy replicas.** After the runs of the largest workload, that checkpoint
  restored lazily N times in a row (default 10), each replica left running
  until the last one is up.
- **Page cache.** Before each restore, untimed, the data it starts from is
  read once (the checkpoint store for the agent, the local plan for the
  baseline), so both start with it in memory: the comparison is of the work
  each path does, not of the disk. Both restores run CRIU with
  `--auto-dedup`, which punches each restored page out of the private image
  copy, so a freshly written copy no longer slows CRIU's memory restore (it
  used to, two- to threefold, on a virtual machine: the copy's page cache
  left CRIU only cold memory).
- **Agent peak RSS.** The agent is restarted before the first timed checkpoint
  of the largest one-container workload; `VmHWM` of its process
  (`/proc/<pid>/status`) right after that checkpoint. runc and CRIU run in
  their own processes and are not counted. (With `--attach`, the agent is not
  restarted and the figure is its high-water mark since it started.)

### Against containerd's own checkpoint and restore (containerd 2.1)

containerd 2.x checkpoints a container through the CRI's
`CheckpointContainer(container_id, location, timeout)` and, from 2.1 on,
restores such an archive through `CreateContainer` in a fresh sandbox with
the archive's path as `config.image.image` (`bench/native.py`).

- **The image.** The archive names its base image by `config.dump`'s
  `rootfsImageRef`, the container's CRI `image_ref`, and containerd pulls it by
  that NAME@DIGEST when it is not local. So these pods run from an image a
  registry served: the bench starts a loopback registry
  (`testbed/registry.py`, plain HTTP), pushes the bed's memhog image to it
  with the bed's `ctr images push --plain-http`, writes
  `<registry_hosts_dir>/127.0.0.1:PORT/hosts.toml` (the CRI plugin's
  `config_path`; `server = "http://127.0.0.1:PORT"`, capabilities pull and
  resolve), pulls it through CRI `PullImage` and runs the pods from that
  NAME:TAG, so their `image_ref` is NAME@DIGEST. The agent's columns use the
  same pods. Image names, `hosts.toml` and the registry are removed at the end.
- **Fresh memory.** Every run is a new pod whose memhog fills its memory
  from a new random 63-bit `--seed`, so none of it is in the agent's store
  beforehand (the agent's "added to the store" column shows each checkpoint
  stored in full): content-addressed dedup does not help the agent here. The
  agent's checkpoint of each run is removed before the next one.
- **Order.** In each run the agent and containerd take turns on the same
  pod: both checkpoints, then both restores, the agent first in odd runs and
  containerd first in even ones, with `sync` and a pause between operations,
  after one untimed run (`--warmup`).
- **Checkpoint (containerd).** Wall time of the `CheckpointContainer` call
  (a CRI connection already open) into a new file on the store's file
  system, then fsync of that file and of its directory: the time until the
  archive is durable ("call" is the call alone). containerd pauses the
  container, has runc and CRIU dump it into a temporary directory (leaving it
  running), copies the images and the writable layer's diff into its content
  store, resumes the container, then unpacks that copy again and writes the
  archive. Its frozen window is taken from the ticker's CRI log, as for every
  other column. Once the call returns, containerd's garbage collector
  removes the copy in its content store; the bench waits for that, untimed,
  before the next operation.
- **Checkpoint (agent).** As above: `node-agent checkpoint POD -o json`,
  durable when it returns. "Outside the freeze" is its wall time less the
  frozen window it reports: the CLI, the selection and the ingest into the
  store.
- **Restore (containerd).** The archive is read once (page cache, untimed),
  then, timed, through plain CRI calls: RunPodSandbox with the bed's default
  runtime (`runc`; no node-agent handler), CreateContainer with the source's
  container config whose image is the archive's path (containerd unpacks the
  archive's metadata, then the whole archive into the container's directory),
  and StartContainer (`runc restore` from there): "running" is until
  StartContainer returns.
- **Restore (agent).** `node-agent restore ID --lazy --start`, the agent's
  default, as above.
- **First tick.** For both restores, from the start of the restore to the
  first tick the restored process wrote (its stamp in the new container's
  CRI log; containerd's restore copies the source's log into it first, so only
  ticks stamped after the restore started count).

### Time to first answer (the model server)

`bench/firstanswer.py`. The workload is the Debian test image's model server
(`scripts/testbed_images/modelserver.py`, run as `modelserver --weights
/opt/model/weights.npy --port 8080 --shm-mib 16`): a threaded Python HTTP
server that reads N MiB of seeded random float32 weights (a file in the image,
`scripts/testbed up --model-mib N`; one bed image per size, the bed brought up
again between sizes) fully into memory, runs one warm-up pass over them,
fills a 16 MiB cache file in the pod's `/dev/shm` and holds it open, and then
answers `GET /predict?x=N` with a pass over every weight. For each size one
source pod is started, asked a few times, checkpointed by the agent and
removed; then the four paths below take turns in every run (after
`--warmup` untimed rounds), with `sync` and a pause between operations.

- **One starting point.** Every column is timed in the benchmark process
  from the moment it sends the first request of its path, with every
  connection it uses already open: the agent's `Restore` over the agent's
  local socket, as `node-agent restore` sends it (`node_agent.cli.client`),
  so the request reaches the agent at once; for the CRI paths,
  `RunPodSandbox`. The CLI's own start-up (Python, its imports, the
  connection) is therefore not in any column. It is measured on its own as
  the wall time of `node-agent checkpoints inspect ID` as a process less the
  same call over an open connection (median of 5), and shown beside the
  table ("CLI start-up"): add it to a column for what a user at a shell
  sees.
- **First answer.** Once the path's call has returned, the new pod's IP is
  taken from `PodSandboxStatus` (every path asks the same way), then
  `GET /predict?x=7` is sent to port 8080 every 5 ms until one returns
  200; the time of that answer is "first answer". Every answer is checked: a
  restored replica must report the source's own start time (`started`),
  pid, weights digest and request count going on, and give the source's
  answer for the same x; a cold start must have the same weights digest.
- **Running.** Until the path's call returns: the agent's `Restore` with
  start (StartContainer included), or the CRI `StartContainer` call.
  "first answer / running" is the median of each run's own ratio.
- **Cold.** A new pod running the server from the image, with the node's
  default runtime: `RunPodSandbox`, `CreateContainer`, `StartContainer`,
  then the server's own start-up (reading the weights, the warm-up pass,
  the cache file; its ready line on stdout gives that part alone: "server's
  own start-up") and the first answer.
- **Local plan.** As in the restore table: the restore plan the agent writes
  for the same checkpoint, copied once to a local directory with what the
  restore put into the new sandbox's `/dev/shm`; for each run a private copy
  is made (untimed), then, timed: `RunPodSandbox` with the agent's runtime
  handler, the `/dev/shm` files copied into the new sandbox's tmpfs,
  `CreateContainer`, the plan renamed into place, `StartContainer` (`runc
  restore` from local disk, no store read, no verification).
- **Default and full.** The agent's `Restore` with start and no lazy option
  (what `node-agent restore ID --start` sends: lazy where CRIU and the
  kernel allow it; the table marks what the plans said), and with
  `lazy=false` (`--full`). After a lazy restore's first answer the bench
  waits, untimed for the answer, until the agent records that every page is
  in ("all pages in", from the same starting point), so no transfer is
  still running when the next operation starts.
- **Page cache.** Before each restore the data it starts from is read once
  (the store for the agent, the local plan for the baseline); the cold
  start reads the image's weights file, in the page cache after the first
  round.
- **Replicas.** At the smallest size, after the runs: N restores with the
  agent's default, one after another, each started when the one before has
  answered, all kept running (their transfers going on) until the last has
  answered. The target compares the slowest first answer with the first
  replica's.
"""

READING = """\
## Reading the results

- **Restores are lazy by default**, and the lazy restore is the one that
  meets the restore target: the container runs after the sandbox, the
  non-memory images and CRIU's process restore, whatever the memory size.
- **A full restore (`--full`) stays above 1.3x the local plan**, and cannot
  get under it on this machine: before `runc restore` may start, every page
  must be read from the store, verified against its digest and written into
  the restore's private image copy (about 1.4 s for 1 GiB on two cores,
  where CRIU's own memory restore takes about 0.75 s), while the baseline
  starts from an image directory that is already on local disk and checked
  by nobody. Only not reading the memory before the start removes that work,
  which is what the lazy restore does; its pages are still verified, chunk
  by chunk, as they are served.
- **CRIU's kernel probes.** CRIU keeps what it learns about the kernel in
  `/run/criu.kdat`, but only where `/run` is a tmpfs (as systemd mounts it).
  On this VM it is not, so every CRIU run, every dump and every restore,
  probes the kernel again, running `iptables` and `ip6tables` several times
  (`node-agent doctor` warns about it). It costs every StartContainer here
  some 30 to 80 ms that a standard node does not pay; bare runc pays it too.
  In one run with the cache copied in from a tmpfs, ten lazy replicas of
  1 GiB took 191 to 260 ms each to start (median 229 ms), against 230 to
  335 ms without it on the same day. That edge, not the agent, is where the
  ten-replica target sits on this machine.
- **Frozen window, one container.** For one pod-wide cut the agent freezes
  every container first and then starts `runc checkpoint`, so the start-up
  of runc and CRIU falls inside its window, while bare `runc checkpoint`
  lets CRIU freeze the container once it has started. On this VM that
  start-up includes CRIU's kernel probes (above, some 80 to 100 ms), so
  the two windows come out close and their ratio moves around 1.0x with the
  machine's noise. With two containers the agent's parallel capture wins
  clearly.
- **Every page in, against a full restore.** The page source's fault
  handler copies the memory in 1 MiB windows straight from the verified,
  decoded chunks into the processes (`UFFDIO_COPY`), and starts as soon as
  the restore hands it the userfaultfds; a full restore first writes every
  page into the restore plan and CRIU then reads it back. What bounds the
  handler is reading and verifying the chunks and the kernel's copy, on
  the node's cores beside everything else: `bench/lazy_throughput.py`
  measures each stage alone (on this VM, 256 MiB: read and verify some
  2.9 GB/s with two threads, the copy some 5 GB/s, the whole handler
  1.7 GB/s streaming into an idle process and 1.2 GB/s while the process
  reads all of its memory). The full restore it is compared with varies
  most of all between runs on this VM (1.6 to 2.9 s for 1 GiB), and the
  ratio with it.
- **Lazy replicas** are restored while the earlier ones still stream their
  memory in. The page sources doing that run at nice 10, and so
  do their sessions' autogroups (a task's nice alone weighs nothing against
  other sessions), so the next restore's StartContainer is not starved; the
  transfers then take longer ("all pages in"), and a replica's first
  touches of missing pages may wait longer under that load (the tick gaps).
- **containerd 1.6 and 2.1.** The same agent, CRIU and kernel; the 2.1 bed
  runs runc 1.3 where the 1.6 bed runs Debian's runc 1.1, and the two runs
  were on different days. Three targets fall on different sides of their
  limits in the two columns (the one-container frozen window, "until
  durable" and "every page in"); each sits near its limit, and each ratio
  moves across it between two runs on the same version (see the items
  above). Missed on both: the full restore (above) and the slowest of ten
  lazy replicas, where CRIU's kernel probes set the edge. "Until durable"
  against runc + tar | zstd follows its baseline more than the agent: a dump
  and a compressed copy of 1 GiB with fsync took 1.6 to 4.1 s between runs
  on this VM (writing through the page cache costs most of it, and other
  work on the disk shows there first), the agent 1.6 to 2.8 s.
- **Against containerd's own checkpoint: the frozen window.** containerd
  keeps the container paused from before CRIU's dump until the images and the
  writable layer's diff are copied into its content store (about 2.2 s for
  1 GiB here); only the archive is written after the thaw. The agent's window
  is CRIU's dump alone, the dump bare `runc checkpoint` does, and comes out at
  or under bare runc's window (the one-container target). Bare runc's window
  is itself about a quarter of containerd's at 1 GiB (the target's "alone"
  figure), so no path that dumps the whole memory while the container is
  frozen gets to 0.15x on this machine: what bounds it is the dump of 1 GiB
  into the page cache, about 0.5 s. An iterative pre-dump would move it (the freeze then
  copies only the pages written since), and the agent does one where the
  kernel tracks dirty memory (`pre-dump: auto`); this VM's kernel has no
  soft-dirty tracking (`criu check --feature mem_dirty_track` reports it
  off, and `node-agent doctor` warns), so every checkpoint here is a full
  dump.
- **Against containerd's own checkpoint: until durable.** Both write all the
  memory more than once. The agent writes 1 GiB twice (CRIU's images into its
  scratch directory while the pod is frozen, then the chunks into the store,
  hashed, compression tried, fsynced); containerd four times (CRIU's images
  into a temporary directory, a tar of them into its content store, that
  copy unpacked again, and the archive). Writing through the page cache is
  the dominant cost on this VM (a copy of 1 GiB with fsync takes about 3 s,
  most of it system time), so the ratio sits near the write count, 2 of 4:
  0.43x to 0.50x per run at 1 GiB, the median on the limit. At 256 MiB the
  agent's fixed costs (the CLI process and the pod's selection, some 0.3 s)
  weigh more and it comes to about 0.7x. A clear margin needs one write less
  on the agent's side, CRIU's images streamed into the store instead of
  through a scratch directory; the `runc + tar | zstd` figure of the same run
  (a dump and one compressed copy) shows how far a path that writes twice
  gets against containerd.
- **Time to first answer (the model server).** Every request walks every
  weight, so whichever way a replica comes back, its first answer waits
  for all of its memory. The default, lazy restore is running before any
  other path, and its fault handler then brings the rest as fast as the
  chunks can be read, verified and copied (above, "every page in"): at
  256 MiB the first answer comes some 0.25 s after the call returns, at
  about the time a full restore is only running. That transfer is what
  bounds two of the targets on this machine: the first answer within 1.25x
  of running would need the remaining 256 MiB in some 0.1 s, over 2.5 GB/s
  verified on two cores shared with the restored server and the end of the
  restore; at 2 GiB the local plan, whose pages CRIU reads from a local
  file without verifying them, gets them in faster than the store's
  verified chunks come (2 GiB at the handler's 1.2 GB/s is 1.7 s before
  the answer's own pass). The bound of 0.3x the cold start cannot be met
  on this VM by any restore of 256 MiB: the cold start from RunPodSandbox
  here is under 1 s (the weights file is in the page cache, the server's
  own start-up some 0.4 s), and 0.3x of it is below even the local plan's
  time until running.
- **Against containerd's own restore.** containerd unpacks the whole archive
  in CreateContainer and CRIU then restores every page before StartContainer
  returns (1.1 to 3.4 s for 1 GiB between runs here, with the page cache of
  the fresh unpack), while the agent's lazy restore starts the process before
  its memory is read: its first tick comes some 0.45 s after the call,
  containerd's some 2 s. Its pages are all in about as late as containerd's
  process starts.
"""


def _cell(t: dict[str, Any] | None) -> str:
    if t is None:
        return "-"
    return f"{_ratio(t)}: {verdict(t)}"


def _machine_rows(doc: dict[str, Any]) -> list[list[str]]:
    m = doc["machine"]
    c = doc["config"]
    runs = (f"{c['runs']} interleaved per workload after {c.get('warmup', 0)} untimed; sizes "
            f"{', '.join(str(x) for x in c['sizes_mib'])} MiB; pair {c['pair_mib']} MiB x 2; repeat {c['repeat_mib']} MiB")
    if c.get("native_sizes_mib"):
        runs += f"; against containerd's own path {', '.join(str(x) for x in c['native_sizes_mib'])} MiB"
    if c.get("answer_sizes_mib"):
        answer = (f"first answer {', '.join(str(x) for x in c['answer_sizes_mib'])} MiB of weights "
                  f"({c.get('answer_runs')} runs below 1024 MiB, {c.get('answer_large_runs')} from 1024 MiB on, "
                  f"{c.get('answer_replicas')} replicas)")
        runs = f"{answer}, the others not measured (--answer-only)" if c.get("answer_only") else f"{runs}; {answer}"
    return [
        ["date", doc["date"]],
        ["CPU", f"{m['cores']} cores, {m['cpu']}"],
        ["memory", f"{m['memory_gib']} GiB"],
        ["OS, kernel", f"{m['os']}, Linux {m['kernel']}, cgroup {m['cgroup']}"],
        ["containerd, runc, CRIU", f"{m['containerd']}, {m['runc']}, {m['criu']}"],
        ["containerd binary", f"`{m['containerd_binary']}`" if m.get("containerd_binary") else "the one on PATH"],
        ["/run", f"{m.get('run_fs', 'unknown')}"
                 + ("" if m.get("run_fs") in ("tmpfs", None) else
                    " (not a tmpfs: CRIU keeps no kernel-feature cache, see below)")],
        ["zstd, Python", f"{m['zstd']}; Python {m['python']}"],
        ["node-agent", m["node_agent_commit"]],
        ["runs", runs],
        ["load average (1, 5, 15 min)", _loadavg(doc["samples"].get("loadavg"), m.get("cores"))],
        ["elapsed", "-" if doc["samples"].get("elapsed_s") is None else f"{doc['samples']['elapsed_s'] / 60:.1f} min"],
    ]


def _loadavg(la: dict[str, Any] | None, cores: int | None) -> str:
    if not la:
        return "-"
    fmt: Callable[[list[float]], str] = lambda xs: " ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    full = f" ({cores} cores: {cores}.0 is a busy machine)" if cores else ""
    if not la.get("end"):
        return f"{fmt(la['start'])} at the start{full}"
    return f"{fmt(la['start'])} at the start, {fmt(la['end'])} at the end{full}"


def markdown(merged: dict[str, Any], encryption: dict[str, Any] | None = None,
             image_check: dict[str, Any] | None = None) -> str:
    """docs/benchmarks.md from a results file: every containerd version it holds, newest first; with
    `encryption` (bench/encryption.py's results) and `image_check` (bench/image_check.py's), their
    sections after them."""
    order = series_order(merged)
    docs = [merged["runs"][k] for k in order]
    parts = [
        "# Benchmarks\n\n",
        "Checkpoint and restore with node-agent against bare runc and CRIU on the same\n"
        "node and the same workloads, and, on containerd 2.1, against containerd's own\n"
        "CRI checkpoint and restore. Produced by `bench/run.py --write-docs`; run it\n"
        "again rather than editing this file.\n\n",
        "    .venv/bin/python bench/run.py [--containerd PATH] [--sizes 64,256,1024] [--runs 5] \\\n"
        "        [--pair 512] [--repeat-mib 256] [--native-sizes 256,1024] [--no-native] [--warmup 1] \\\n"
        "        [--answer-sizes 256,2048] [--answer-runs N] [--answer-large-runs 1] [--answer-replicas 10] \\\n"
        "        [--no-answer] [--out bench/results.json] [--write-docs] [--note TEXT] [--quick] [--keep]\n\n",
        "As root, on a machine prepared with `scripts/setup`. It brings up its own test\n"
        "bed (`--bed`, or `NODE_AGENT_BENCH_BED`, default `na-bench`) on the containerd\n"
        "binary `--containerd` (default 2.1, `/opt/node-agent/containerd-2/bin/containerd`;\n"
        "`/usr/bin/containerd` is the system's 1.6), prints the tables below, writes\n"
        "every raw sample to `--out`, and removes everything it created. One run\n"
        "measures one containerd; `--out` keeps the latest run of every containerd\n"
        "version, and `--write-docs` writes all of them here. `--quick` is a smoke run\n"
        "(16 MiB, a model server of 64 MiB, one run each). Targets are judged at 1 GiB\n"
        "(or the largest `--sizes`, `--native-sizes`) unless stated; the model server's\n"
        "at 256 MiB and 2 GiB of weights (or the smallest and largest `--answer-sizes`).\n\n",
        "## Latest results\n\n",
    ]
    for d in docs:
        c = d["config"]
        label = f"containerd {d['machine']['containerd']} ({d['date'][:10]})"
        if c.get("quick") or c["runs"] < 5:
            parts.append(f"**{label}: {'a quick smoke run' if c.get('quick') else 'fewer than 5 runs'}, "
                         "not a measurement to rely on.**\n\n")
        if c.get("note"):
            parts.append(f"{label}: {c['note']}\n\n")
    # One row per target, a column per containerd version.
    keys: list[str] = []
    first: dict[str, dict[str, Any]] = {}
    for d in docs:
        for t in d["targets"]:
            if t["key"] not in first:
                keys.append(t["key"])
                first[t["key"]] = t
    by = [{t["key"]: t for t in d["targets"]} for d in docs]
    rows = []
    for k in keys:
        cells = []
        for d, ts in zip(docs, by):
            if k in ts:
                cells.append(_cell(ts[k]))
            elif k in NATIVE_LIMITS and d["summary"].get("native_skipped"):
                cells.append(f"n/a (containerd {series(d['machine']['containerd'])})")
            else:
                cells.append("-")
        rows.append([first[k]["title"], _limit(first[k]), *cells])
    parts.append("### Targets\n\n")
    parts.append(_md_table(["target", "limit", *[f"containerd {d['machine']['containerd']}" for d in docs]], rows))
    parts.append("\nThe measured values behind each ratio are in the section of each containerd version.\n")
    for d in docs:
        parts.append(f"\n## containerd {d['machine']['containerd']} ({d['date'][:10]})\n\n")
        parts.append(_md_table(["machine", ""], _machine_rows(d)))
        for title, header, trows in _tables(d):
            parts.append(f"\n### {title}\n\n")
            parts.append(_md_table(header, trows))
        if d["summary"].get("native_skipped"):
            parts.append(f"\nAgainst containerd's own checkpoint and restore: not measured "
                         f"({d['summary']['native_skipped']}).\n")
        if d["summary"].get("answer_skipped"):
            parts.append(f"\nTime to first answer: not measured ({d['summary']['answer_skipped']}).\n")
    if encryption is not None:
        parts.append(encryption_markdown(encryption))
    if image_check is not None:
        parts.append(image_check_markdown(image_check))
    parts.append("\n" + READING)
    parts.append("\n" + METHOD)
    return "".join(parts)


# ---- the image check (bench/image_check.py) --------------------------------------------

IMAGE_CHECK_JSON = Path(__file__).resolve().parent / "image_check.json"


def load_image_check(path: Path | None = None) -> dict[str, Any] | None:
    """bench/image_check.py's results file, or None where there is none."""
    try:
        data = json.loads((path or IMAGE_CHECK_JSON).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "summary" in data and "results" in data else None


def image_check_markdown(doc: dict[str, Any]) -> str:
    """The section of docs/benchmarks.md on what the image check costs a restore."""
    s, m, r = doc["summary"], doc["machine"], doc["results"]
    rows = []
    for kind, what in (("memhog", f"memhog, {r['mib']} MiB, 1 task"),
                       ("tasks", f"busybox shell, {s['tasks']['check_tasks']} tasks")):
        x = s[kind]
        rows.append([what, _s(x["on_s"]), _s(x["off_s"]), f"{x['ratio']:.3f}x" if x["ratio"] else "-",
                     _s(x["first_tick_on_s"]), _s(x["first_tick_off_s"]), f"{x['check_ms']:.1f} ms"])
    return (
        f"\n## The image check: restore until running, with and without it ({doc['date'][:10]})\n\n"
        "Every restore holds the checkpoint's CRIU images to the new container's config before `runc restore`\n"
        "(docs/security.md, \"What the CRIU images may not grant\"). `bench/image_check.py --write-docs` measures\n"
        "what that costs: the same checkpoint restored with `restore --start --full` until the container runs,\n"
        "with the agent's restore wrapper (on) and with the same wrapper whose check passes everything (off),\n"
        f"alternating which goes first, {r['runs']} runs after {r.get('warmup', 1)} untimed; medians. The last\n"
        "column is the check alone on that checkpoint's plan (reading the images, holding them to the config),\n"
        f"median of 20. containerd {m.get('containerd', '?')}, runc {m.get('runc', '?')}.\n\n"
        + _md_table(["checkpoint", "restore call, on", "off", "on / off", "first tick after the call, on", "off",
                     "the check alone"], rows)
        + _image_check_reading(doc)
    )


def _image_check_reading(doc: dict[str, Any]) -> str:
    """What the figures say: the check's own time against the spread of on / off between runs."""
    s, samples = doc["summary"], doc["results"]["samples"]
    out = []
    for kind, what in (("memhog", "one task"), ("tasks", f"{s['tasks']['check_tasks']} tasks")):
        per_run = [x[kind]["on"]["wall_s"] / x[kind]["off"]["wall_s"] for x in samples if x[kind]["off"]["wall_s"]]
        out.append(f"with {what}, the check alone takes {s[kind]['check_ms']:.1f} ms, "
                   f"{s[kind]['check_ms'] / 10 / max(s[kind]['on_s'], 1e-9):.2f}% of the restore call, while "
                   f"on / off varies from {min(per_run):.2f}x to {max(per_run):.2f}x between runs")
    text = ("Reading: " + "; ".join(out) + ". The check's cost is below what an A/B of whole restores can "
            "resolve on this machine; its time alone is the figure to go by, and it grows with the number of "
            "tasks and threads (one core image each), not with memory.")
    return "\n" + textwrap.fill(text, width=104, break_on_hyphens=False) + "\n"


# ---- encryption at rest (bench/encryption.py) ------------------------------------------

ENCRYPTION_JSON = Path(__file__).resolve().parent / "encryption.json"
ENCRYPTION_SCHEMA = 1
ENCRYPTION_LIMIT = 1.15  # encrypted / clear, for every time
ENCRYPTION_REPEAT_LIMIT = 0.05  # store growth of a repeated checkpoint, encrypted


def load_encryption(path: Path | None = None) -> dict[str, Any] | None:
    """bench/encryption.py's results file, or None where there is none."""
    try:
        data = json.loads((path or ENCRYPTION_JSON).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("samples"), dict) or "machine" not in data:
        return None
    # Medians and targets from the raw samples, as this version of the report computes them.
    data["summary"] = encryption_summary(data["samples"])
    data["targets"] = encryption_targets(data["summary"])
    return data


def _variants(rows: list[dict[str, Any]], fn: Callable[[dict[str, Any]], Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for v in ("clear", "encrypted"):
        vals = []
        for r in rows:
            if v in r:
                try:
                    vals.append(fn(r[v]))
                except (KeyError, TypeError):
                    pass
        out[v] = _median(vals)
    return out


def _field(key: str) -> Callable[[dict[str, Any]], Any]:
    return lambda x: x[key]


def encryption_summary(results: dict[str, Any]) -> dict[str, Any]:
    """Medians per variant of bench/encryption.py's raw samples."""
    ck, rs = results.get("checkpoint") or [], results.get("restore") or []
    ans = results.get("answer") or {}
    ansr = ans.get("samples") or []
    rep = results.get("repeat") or {}
    reps = rep.get("samples") or []
    s: dict[str, Any] = {"mib": results.get("mib"), "runs": len(ck), "answer_mib": ans.get("mib"),
                         "repeat_mib": rep.get("mib")}
    s["checkpoint"] = {k: _variants(ck, _field(k)) for k in (
        "wall_s", "frozen_outside_ms", "frozen_reported_ms", "log_thaw_s", "log_ingest_s", "agent_cpu_s",
        "agent_user_s", "agent_sys_s", "agent_minflt", "machine_cpu_s", "store_added_bytes", "size", "stored_size")}
    s["restore"] = {k: _variants(rs, _field(k)) for k in (
        "wall_s", "start_ms", "before_start_s", "agent_cpu_s", "agent_user_s", "agent_sys_s", "agent_minflt")}
    s["restore"]["criu_restore_ms"] = _variants(rs, lambda x: _total(x.get("criu_restore_ms")))
    s["answer"] = {k: _variants(ansr, _field(k)) for k in ("running_s", "answer_s", "all_in_s")}
    s["answer"]["lazy"] = {v: sorted({str(r[v].get("lazy")) for r in ansr if v in r}) for v in ("clear", "encrypted")}
    added = _variants(reps, lambda x: x["added_bytes"])
    size = _variants(reps, lambda x: x["size"])
    s["repeat"] = {"added_bytes": added, "size": size,
                   "fraction": {v: _div(added[v], size[v]) for v in ("clear", "encrypted")},
                   "first_added_bytes": {v: (rep.get("first") or {}).get(v, {}).get("added_bytes")
                                         for v in ("clear", "encrypted")}}
    checks = (results.get("checks") or {}).get("checkpoints") or []
    s["checks"] = {
        "checkpoints": len(checks),
        "encrypted": sum(1 for c in checks if c["variant"] == "encrypted"),
        "encrypted_ok": sum(1 for c in checks if c["variant"] == "encrypted" and c["key_id"] and not c["clear_blobs"]),
        "clear_ok": sum(1 for c in checks if c["variant"] == "clear" and not c["key_id"] and not c["sealed_blobs"]),
        "sealed_blobs": sum(c["sealed_blobs"] for c in checks if c["variant"] == "encrypted"),
        "key_ids": sorted({c["key_id"] for c in checks if c["key_id"]}),
    }
    return s


def _pair(d: dict[str, float | None]) -> tuple[float | None, float | None]:
    return d.get("encrypted"), d.get("clear")


def encryption_targets(s: dict[str, Any]) -> list[dict[str, Any]]:
    t: list[dict[str, Any]] = []
    mib, lim = s.get("mib"), ENCRYPTION_LIMIT
    e, c = _pair(s["checkpoint"]["wall_s"])
    t.append(_target("enc_durable", f"encryption: {mib} MiB checkpoint until durable, encrypted / clear",
                     f"{_s(e)} vs {_s(c)}", _div(e, c), lim))
    e, c = _pair(s["checkpoint"]["frozen_outside_ms"])
    er, cr = _pair(s["checkpoint"]["frozen_reported_ms"])
    t.append(_target("enc_frozen", "encryption: frozen window of that checkpoint, encrypted / clear",
                     f"{_ms(e)} (agent says {_ms(er)}) vs {_ms(c)} (agent says {_ms(cr)})", _div(e, c), lim))
    e, c = _pair(s["restore"]["wall_s"])
    t.append(_target("enc_restore", "encryption: restore --start (full) of that checkpoint until running, "
                                    "encrypted / clear", f"{_s(e)} vs {_s(c)}", _div(e, c), lim))
    e, c = _pair(s["answer"]["answer_s"])
    t.append(_target("enc_answer", f"encryption: model server {s.get('answer_mib')} MiB, first answer of a restored "
                                   "replica (default restore), encrypted / clear", f"{_s(e)} vs {_s(c)}", _div(e, c), lim))
    rep = s["repeat"]
    frac, cfrac = rep["fraction"]["encrypted"], rep["fraction"]["clear"]
    t.append(_target(
        "enc_repeat", f"encryption: store growth, repeated checkpoint of unchanged {s.get('repeat_mib')} MiB, encrypted",
        f"{_mib(rep['added_bytes']['encrypted'])} of {_mib(rep['size']['encrypted'])}"
        + (f" ({frac * 100:.2f}%)" if frac is not None else "")
        + (f"; clear {_mib(rep['added_bytes']['clear'])} ({cfrac * 100:.2f}%)" if cfrac is not None else ""),
        frac, ENCRYPTION_REPEAT_LIMIT, unit="fraction"))
    return t


def encryption_build(args: argparse.Namespace, machine: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    summary = encryption_summary(results)
    return {
        "schema": ENCRYPTION_SCHEMA,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine,
        "config": {"runs": args.runs, "warmup": args.warmup, "mib": args.mib, "repeat_mib": args.repeat_mib,
                   "answer_mib": args.answer_mib, "settle_s": args.settle, "bed": args.bed, "note": args.note,
                   "limit": ENCRYPTION_LIMIT, "repeat_limit": ENCRYPTION_REPEAT_LIMIT,
                   "quiet_wait_s": getattr(args, "quiet_wait", None)},
        "samples": results,
        "summary": summary,
        "targets": encryption_targets(summary),
    }


def _enc_row(what: str, d: dict[str, float | None], fmt: Callable[[float | None], str]) -> list[str]:
    e, c = _pair(d)
    r = _div(e, c)
    return [what, fmt(c), fmt(e), "-" if r is None else f"{r:.2f}x"]


def _count(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _encryption_tables(doc: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    s = doc["summary"]
    runs = doc["config"]["runs"]
    sec: Callable[[float | None], str] = lambda x: "-" if x is None else f"{x:.2f} s"  # noqa: E731
    ck, rs, an = s["checkpoint"], s["restore"], s["answer"]
    pct: Callable[[float | None], str] = lambda x: "-" if x is None else f"{x * 100:.2f}%"  # noqa: E731
    lazy = {v: ", ".join("lazy" if x == "True" else "full" if x == "False" else "?" for x in an["lazy"][v]) or "-"
            for v in ("clear", "encrypted")}
    rows = [
        _enc_row(f"{s['mib']} MiB checkpoint until durable", ck["wall_s"], sec),
        _enc_row("  call until thaw (agent log)", ck["log_thaw_s"], sec),
        _enc_row("  thaw until published: ingest (agent log)", ck["log_ingest_s"], sec),
        _enc_row("  agent CPU during the call", ck["agent_cpu_s"], sec),
        _enc_row("    of it user", ck["agent_user_s"], sec),
        _enc_row("    of it system", ck["agent_sys_s"], sec),
        _enc_row("  agent's minor page faults", ck["agent_minflt"], _count),
        _enc_row("  CPU of the whole machine during the call", ck["machine_cpu_s"], sec),
        _enc_row("  added to the store", ck["store_added_bytes"], _mib),
        _enc_row("frozen window (log)", ck["frozen_outside_ms"], _ms),
        _enc_row("frozen window (agent)", ck["frozen_reported_ms"], _ms),
        _enc_row(f"{s['mib']} MiB restore --start (full) until running", rs["wall_s"], sec),
        _enc_row("  before StartContainer", rs["before_start_s"], sec),
        _enc_row("  StartContainer", rs["start_ms"], _ms),
        _enc_row("  CRIU restore", rs["criu_restore_ms"], _ms),
        _enc_row("  agent CPU during the call", rs["agent_cpu_s"], sec),
        _enc_row("    of it user", rs["agent_user_s"], sec),
        _enc_row("    of it system", rs["agent_sys_s"], sec),
        _enc_row("  agent's minor page faults", rs["agent_minflt"], _count),
        _enc_row(f"model server {s['answer_mib']} MiB, default restore: running", an["running_s"], sec),
        _enc_row("  first answer", an["answer_s"], sec),
        _enc_row("  all pages in", an["all_in_s"], sec),
        ["  restore kind", lazy["clear"], lazy["encrypted"], ""],
        _enc_row(f"repeated checkpoint of unchanged {s['repeat_mib']} MiB: added", s["repeat"]["added_bytes"], _mib),
        _enc_row("  of its size", s["repeat"]["fraction"], pct),
    ]
    targets = [[t["title"], t["measured"], _ratio(t), _limit(t), verdict(t)] for t in doc["targets"]]
    return [
        ("Encryption: targets", ["target", "measured (median)", "ratio", "limit", "result"], targets),
        (f"Encryption: medians of {runs} interleaved runs", ["measurement", "clear", "encrypted", "encrypted / clear"],
         rows),
    ]


def _encryption_checked(s: dict[str, Any]) -> str:
    c = s["checks"]
    clear = c["checkpoints"] - c["encrypted"]
    return (f"Checked from outside: {c['encrypted_ok']} of {c['encrypted']} encrypted checkpoints showed key "
            f"{', '.join(c['key_ids']) or '-'} and added only sealed blobs ({c['sealed_blobs']} in all) "
            "besides their manifests; "
            f"{c['clear_ok']} of {clear} clear ones showed no key and added no sealed blob.")


def encryption_text(doc: dict[str, Any]) -> str:
    parts = []
    for title, header, rows in _encryption_tables(doc):
        parts.append(f"\n{title}\n{_text_table(header, rows)}")
    parts.append("\n" + _encryption_checked(doc["summary"]) + "\n")
    m = doc["machine"]
    parts.append(f"\n{doc['date']}  {m['cores']} cores, kernel {m['kernel']}, containerd {m['containerd']}, "
                 f"runc {m['runc']}, CRIU {m['criu']}\n")
    return "".join(parts)


ENCRYPTION_METHOD = """\
### How the encryption figures are measured

`bench/encryption.py` (`.venv/bin/python bench/encryption.py [--runs 3]
[--write-docs]`). One test bed, one agent, one store. The agent's config has
an `encryption` section: a keyring file (`key-sources: [{file: ...}]`) with
one key, `bench-1` (32 random bytes made for the run), for the domain
`benchteam`, which holds the namespaces `bench` and `bench-r`. The encrypted
variant's pods run in `bench` and are restored into `bench-r`; the clear
variant's run in `plain` and are restored into `plain-r`, namespaces in no
domain with a key, so their checkpoints are written as without the section.
Nothing else differs: the same agent process and settings, the same store,
image and workload. After one untimed round (`--warmup`), the runs
interleave the two variants; every figure is the median of the runs, every
ratio encrypted / clear of those medians. On the 1 GiB pod each variant's
checkpoint is followed by its own restore and removal before the other's
checkpoint, which variant goes first alternates from run to run, and each
checkpoint and each restore starts after `sync` and on a quiet machine: a checkpoint that
follows another one's gigabyte of writes pays for their writeback (here
the second of two 1 GiB checkpoints in a row took about 1 s longer, all of
it system time in the agent, whichever variant went second), so without
this the comparison measured the order rather than encryption. The runs
still spread widely on this VM (the per-run samples are in
`bench/encryption.json`). Other work on the machine shows in every figure
on two cores: before each round the bench waits (at most `--quiet-wait`,
60 s) until under 0.3 cores are busy, and the machine table says how long
it waited. What encryption costs by itself is one more sha256 pass over
every chunk's plaintext (the seal binds that digest; the clear path hashes
only the stored bytes; a chunk that zstd shrinks also has its smaller
encoding hashed, since its key derives from the bytes it seals), about
0.5 s of CPU per GiB here, and AES-256-GCM, under 0.1 s per GiB
(`bench/seal_cost.py` times each step).

- **Checked from outside.** After every checkpoint, `node-agent checkpoints
  inspect ID -o json` must show the key id for the encrypted variant and
  none for the clear one, and every blob the checkpoint added to the store
  must begin with the sealed-blob header (`NAS2`) for the encrypted
  variant, but for its manifest (a JSON document of digests of sealed
  blobs, never sealed itself); the clear variant must add no sealed blob. Each restored
  model server must answer as the checkpointed process (its start time, pid,
  weights digest and answer, its request count going on).
- **Until durable.** Wall time of `node-agent checkpoint POD -o json`, the CLI
  included, on a memhog pod of 1 GiB that ticks every 5 ms: it returns once
  the store's commit is durable. Each checkpoint is removed (after its
  restore) before the other variant's checkpoint, so every checkpoint
  stores the whole workload ("added to the store"). The agent's own log
  (`log-format: json`, millisecond stamps) splits it at its `frozen for`
  line: before it the CLI, the pre-dump, the
  freeze and the dump; after it, until the `published` line, the ingest
  into the store, where the chunks are hashed and, encrypted, sealed.
  "Agent CPU" is the agent process's user and system time over the call,
  and its minor page faults (`/proc/PID/stat`, every thread; CRIU and runc
  run in processes of their own), "CPU of
  the whole machine" every core's busy time over it (`/proc/stat`), of two
  cores.
- **Frozen window.** The largest gap between the ticker's stamps in its CRI
  log across the checkpoint ("log"), and the checkpoint's `frozen_ms`
  ("agent"), as in the checkpoint table above.
- **Restore until running.** Wall time of `node-agent restore ID --namespace
  NS --start --full -o json` of that run's checkpoint, the store read once
  beforehand (page cache). "Before StartContainer" is that time less
  StartContainer as containerd's log shows it: the checks, the sandbox and
  the restore plan, read (and, encrypted, opened) from the store.
- **First answer.** `bench/firstanswer.py`'s "default" path: a model server
  with 256 MiB of weights is checkpointed once per variant; each run restores
  it with the agent's `Restore` (start, no lazy option: what `node-agent
  restore ID --start` sends) over an open connection and times it until the
  first `GET /predict` answers. "All pages in" is when the agent records
  that a lazy restore's last page arrived (waited for, untimed, before the
  next operation).
- **Repeated checkpoint.** Per variant a memhog of 256 MiB that flips no
  word (`--flip 0`): a first checkpoint, then one more per run, each while
  the one before is still stored; the bytes each adds to the store (every
  file under it except scratch, plans, logs and the journal) as a share of
  the checkpoint's size. Chunks sealed under one domain key dedup among
  themselves (the same plaintext seals to the same bytes), never with clear
  ones.
"""


def _quiet(rows: list[dict[str, Any]] | None, limit: float | None) -> str:
    if not rows:
        return "-"
    waited = sum(float(r.get("waited_s") or 0) for r in rows)
    busy = [r["busy_cores"] for r in rows if r.get("busy_cores") is not None]
    late = sum(1 for r in rows if limit is not None and float(r.get("waited_s") or 0) >= limit)
    return (f"{len(rows)} rounds; waited {waited:.0f} s in all for other work to stop"
            + (f"; busy cores at the start: median {_median(busy):.2f}, most {max(busy):.2f}" if busy else "")
            + (f"; {late} started busy after {limit:.0f} s" if late else ""))


def encryption_markdown(doc: dict[str, Any]) -> str:
    """The "Encryption" section of docs/benchmarks.md."""
    m, c = doc["machine"], doc["config"]
    parts = [f"\n## Encryption at rest ({doc['date'][:10]})\n\n",
             "The cost of encrypting checkpoints (AES-256-GCM, chunks and config blob): the same runs on one "
             "agent, with the pods' namespace in a key domain and outside it. Produced by "
             "`bench/encryption.py --write-docs`.\n\n"]
    if c["runs"] < 3:
        parts.append(f"**Fewer than 3 runs ({c['runs']}): not a measurement to rely on.**\n\n")
    if c.get("note"):
        parts.append(f"{c['note']}\n\n")
    la = doc["samples"].get("loadavg")
    elapsed = doc["samples"].get("elapsed_s")
    machine = [
        ["date", doc["date"]],
        ["CPU, memory", f"{m['cores']} cores, {m['cpu']}; {m['memory_gib']} GiB"],
        ["OS, kernel", f"{m['os']}, Linux {m['kernel']}, cgroup {m['cgroup']}"],
        ["containerd, runc, CRIU", f"{m['containerd']}, {m['runc']}, {m['criu']}"],
        ["node-agent", m["node_agent_commit"] + (f" (its Python files: {m['node_agent_tree']})"
                                                 if m.get("node_agent_tree") else "")],
        ["runs", f"{c['runs']} interleaved (clear, encrypted) after {c['warmup']} untimed; memhog {c['mib']} MiB; "
                 f"repeat {c['repeat_mib']} MiB; model server {c['answer_mib']} MiB of weights"],
        ["load average (1, 5, 15 min)", _loadavg(la, m.get("cores"))],
        ["quiet before each round", _quiet(doc["samples"].get("quiet"), c.get("quiet_wait_s"))],
        ["elapsed", "-" if elapsed is None else f"{elapsed / 60:.1f} min"],
    ]
    parts.append(_md_table(["machine", ""], machine))
    for title, header, rows in _encryption_tables(doc):
        parts.append(f"\n### {title.removeprefix('Encryption: ').capitalize()}\n\n")
        parts.append(_md_table(header, rows))
    parts.append("\n" + _encryption_checked(doc["summary"]) + "\n")
    parts.append("\n" + ENCRYPTION_METHOD)
    return "".join(parts)
