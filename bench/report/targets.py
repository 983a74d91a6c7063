"""The targets: each a ratio of two medians against a limit, judged at the target sizes; and the record
of one run (`build`) that bench/results.json keeps per containerd version.
"""

from __future__ import annotations

import argparse
import datetime
from typing import Any, Callable

from bench.report import fmt, stats
from bench.report.results import SCHEMA


RSS_LIMIT_MIB = 200


# Against containerd's own CRI checkpoint and restore (bench/scenarios/native.py), at the native target size.
NATIVE_LIMITS = {"native_durable": 0.5, "native_frozen": 0.15, "native_restore": 0.5}


# Time to first answer of the model server (bench/scenarios/firstanswer.py): the sizes its targets are judged at
# (or the smallest and, from 1024 MiB, the largest measured) and their limits.
ANSWER_SMALL_MIB, ANSWER_LARGE_MIB = 256, 2048


ANSWER_LIMITS = {"answer_first_s": 0.75, "answer_running": 1.25, "answer_cold": 0.3, "answer_replicas": 1.5,
                 "answer_large_local": 1.0, "answer_large_cold": 0.3}



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
        t.append(fmt.target(
            "answer_first", f"model server {small} MiB: first answer, default restore",
            fmt.s(a.get("default_answer_s")), stats.div(a.get("default_answer_s"), lim), 1.0, unit=f"of {lim:g} s"))
        t.append(fmt.target(
            "answer_running", f"model server {small} MiB: first answer / the same restore's time until running, "
                              "default restore",
            f"{fmt.s(a.get('default_answer_s'))} vs {fmt.s(a.get('default_running_s'))} (median of each run's ratio)",
            a.get("default_answer_over_running"), ANSWER_LIMITS["answer_running"]))
        t.append(fmt.target(
            "answer_cold", f"model server {small} MiB: first answer, default restore / cold start",
            f"{fmt.s(a.get('default_answer_s'))} vs {fmt.s(a.get('cold_answer_s'))}",
            stats.div(a.get("default_answer_s"), a.get("cold_answer_s")), ANSWER_LIMITS["answer_cold"]))
        r = a.get("replicas")
        if r:
            t.append(fmt.target(
                "answer_replicas", f"model server {small} MiB: {r['count']} replicas one after another, slowest "
                                   "first answer / the first's",
                f"{fmt.s(r['answer_s_max'])} vs {fmt.s(r['answer_s_first'])}", r.get("slowest_over_first"),
                ANSWER_LIMITS["answer_replicas"]))
    if large is not None:
        a = summary["answer"][large]
        t.append(fmt.target(
            "answer_large_local", f"model server {large} MiB: first answer, default restore / local plan's",
            f"{fmt.s(a.get('default_answer_s'))} vs {fmt.s(a.get('local_answer_s'))}",
            stats.div(a.get("default_answer_s"), a.get("local_answer_s")), ANSWER_LIMITS["answer_large_local"]))
        t.append(fmt.target(
            "answer_large_cold", f"model server {large} MiB: first answer, default restore / cold start",
            f"{fmt.s(a.get('default_answer_s'))} vs {fmt.s(a.get('cold_answer_s'))}",
            stats.div(a.get("default_answer_s"), a.get("cold_answer_s")), ANSWER_LIMITS["answer_large_cold"]))
    return t


def targets(summary: dict[str, Any], target_mib: int, native_mib: int | None = None) -> list[dict[str, Any]]:
    t: list[dict[str, Any]] = []
    one = summary["single"].get(str(target_mib), {})
    res = summary["restore"].get(str(target_mib), {})
    r = stats.div(one.get("agent_frozen_outside_ms"), one.get("bare_frozen_ms"))
    t.append(fmt.target(
        "frozen_one", f"frozen window, 1 x {target_mib} MiB / bare runc checkpoint",
        f"{fmt.ms(one.get('agent_frozen_outside_ms'))} (agent says {fmt.ms(one.get('agent_frozen_reported_ms'))}) "
        f"vs {fmt.ms(one.get('bare_frozen_ms'))}", r, 1.1))
    pair = summary.get("pair", {})
    r = stats.div(pair.get("agent_frozen_outside_ms"), pair.get("bare_sum_frozen_ms"))
    t.append(fmt.target(
        "frozen_pair", f"pod-wide frozen window, 2 x {pair.get('mib', '?')} MiB / sum of 2 bare dumps",
        f"{fmt.ms(pair.get('agent_frozen_outside_ms'))} (agent says {fmt.ms(pair.get('agent_frozen_reported_ms'))}) "
        f"vs {fmt.ms(pair.get('bare_sum_frozen_ms'))}", r, 0.75))
    r = stats.div(one.get("agent_wall_s"), one.get("tar_zstd_wall_s"))
    t.append(fmt.target(
        "durable", f"until durable, {target_mib} MiB / runc checkpoint + tar|zstd + fsync",
        f"{fmt.s(one.get('agent_wall_s'))} vs {fmt.s(one.get('tar_zstd_wall_s'))}", r, 1.0, strict=True))
    r = stats.div(res.get("agent_wall_s"), res.get("bare_wall_s"))
    t.append(fmt.target(
        "restore", f"restore until running, {target_mib} MiB / same plan from local disk",
        f"{fmt.s(res.get('agent_wall_s'))} vs {fmt.s(res.get('bare_wall_s'))}", r, 1.3))
    r = stats.div(res.get("lazy_wall_s"), res.get("bare_wall_s"))
    t.append(fmt.target(
        "restore_lazy", f"restore until running, lazy (the default), {target_mib} MiB / same plan from local disk",
        f"{fmt.s(res.get('lazy_wall_s'))} vs {fmt.s(res.get('bare_wall_s'))}", r, 1.3))
    start = res.get("lazy_start_ms")
    t.append(fmt.target(
        "lazy_start", f"lazy: StartContainer until running, {target_mib} MiB",
        fmt.ms(start), stats.div(start, 300.0), 1.0, unit="of 0.3 s"))
    t.append(fmt.target(
        "lazy_whole", f"lazy: whole restore --lazy --start, sandbox included, {target_mib} MiB",
        fmt.s(res.get("lazy_wall_s")), stats.div(res.get("lazy_wall_s"), 0.7), 1.0, unit="of 0.7 s"))
    sizes = sorted(summary["restore"], key=int)
    if len(sizes) > 1:
        lo, hi = summary["restore"][sizes[0]], summary["restore"][sizes[-1]]
        t.append(fmt.target(
            "lazy_flat", f"lazy: time to running, {sizes[-1]} MiB / {sizes[0]} MiB",
            f"{fmt.s(hi.get('lazy_wall_s'))} vs {fmt.s(lo.get('lazy_wall_s'))}",
            stats.div(hi.get("lazy_wall_s"), lo.get("lazy_wall_s")), 1.2))
    t.append(fmt.target(
        "lazy_all_in", f"lazy: every page in, {target_mib} MiB / full restore until running",
        f"{fmt.s(res.get('lazy_all_in_s'))} vs {fmt.s(res.get('agent_wall_s'))}",
        stats.div(res.get("lazy_all_in_s"), res.get("agent_wall_s")), 1.0))
    reps = summary.get("replicas", {})
    t.append(fmt.target(
        "lazy_replicas", f"lazy: {reps.get('count', '?')} replicas of {reps.get('mib', '?')} MiB one after another, "
                         "slowest StartContainer",
        fmt.ms(reps.get("start_ms_max")), stats.div(reps.get("start_ms_max"), 300.0), 1.0, unit="of 0.3 s"))
    rep = summary.get("repeat", {})
    frac = rep.get("added_fraction")
    t.append(fmt.target(
        "repeat_store", f"store growth, repeated checkpoint of unchanged {rep.get('mib', '?')} MiB",
        f"{fmt.mib(rep.get('added_bytes'))} of {fmt.mib(rep.get('size_bytes'))}"
        + (f" ({frac * 100:.2f}%)" if frac is not None else ""), frac, 0.05, unit="fraction"))
    rss = summary.get("rss", {})
    peak = rss.get("peak_mib")
    t.append(fmt.target(
        "rss", f"agent peak RSS, {rss.get('mib', '?')} MiB checkpoint"
               + ("" if rss.get("restarted", True) else " (since agent start)"),
        "-" if peak is None else f"{peak:.0f} MiB", stats.div(peak, RSS_LIMIT_MIB), 1.0, unit="of 200 MiB"))
    nat = summary.get("native", {}).get(str(native_mib), {}) if native_mib is not None else {}
    if nat:
        # What the same run measured for bare runc at that size, against containerd's figure: the
        # ratio a path that only dumps (frozen) or dumps and compresses (durable) would reach.
        same = summary["single"].get(str(native_mib), {})

        def floor(what: str, x: float | None, fmt: Callable[[float | None], str], of: float | None) -> str:
            r = stats.div(x, of)
            return "" if r is None else f" ({what} alone: {fmt(x)}, {r:.2f}x)"

        t.append(fmt.target(
            "native_durable", f"vs containerd: until durable, {native_mib} MiB fresh / CheckpointContainer + fsync",
            f"{fmt.s(nat.get('agent_wall_s'))} vs {fmt.s(nat.get('native_wall_s'))}"
            + floor("runc + tar|zstd + fsync", same.get("tar_zstd_wall_s"), fmt.s, nat.get("native_wall_s")),
            stats.div(nat.get("agent_wall_s"), nat.get("native_wall_s")), NATIVE_LIMITS["native_durable"]))
        t.append(fmt.target(
            "native_frozen", f"vs containerd: frozen window, {native_mib} MiB fresh / CheckpointContainer's",
            f"{fmt.ms(nat.get('agent_frozen_outside_ms'))} vs {fmt.ms(nat.get('native_frozen_ms'))}"
            + floor("bare runc's dump", same.get("bare_frozen_ms"), fmt.ms, nat.get("native_frozen_ms")),
            stats.div(nat.get("agent_frozen_outside_ms"), nat.get("native_frozen_ms")), NATIVE_LIMITS["native_frozen"]))
        t.append(fmt.target(
            "native_restore", f"vs containerd: lazy restore until running, {native_mib} MiB fresh / containerd's "
                              "restore from the archive",
            f"{fmt.s(nat.get('lazy_wall_s'))} vs {fmt.s(nat.get('native_restore_wall_s'))}",
            stats.div(nat.get("lazy_wall_s"), nat.get("native_restore_wall_s")), NATIVE_LIMITS["native_restore"]))
    return t


def build(args: argparse.Namespace, machine: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    sizes = list(args.sizes)
    target_mib = 1024 if 1024 in sizes else max(sizes)
    nsizes = list(getattr(args, "native_sizes", None) or [])
    native_mib = (1024 if 1024 in nsizes else max(nsizes)) if nsizes else None
    summary = stats.summarize(results)
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

