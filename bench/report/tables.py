"""The tables of one run of bench/run.py: printed as text at the end of a run, and in docs/benchmarks.md.
"""

from __future__ import annotations

from typing import Any

from bench.report import fmt


def tables(doc: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    s = doc["summary"]
    runs = doc["config"]["runs"]
    out: list[tuple[str, list[str], list[list[str]]]] = []
    out.append((
        "Targets",
        ["target", "measured (median)", "ratio", "limit", "result"],
        [[t["title"], t["measured"], fmt.ratio(t), fmt.limit(t), fmt.verdict(t)] for t in doc["targets"]],
    ))
    rows = []
    for mib in sorted(s["single"], key=int):
        x = s["single"][mib]
        rows.append([
            f"{mib} MiB", fmt.s(x["agent_wall_s"]), fmt.ms(x["agent_frozen_reported_ms"]), fmt.ms(x["agent_frozen_outside_ms"]),
            fmt.s(x["bare_wall_s"]), fmt.ms(x["bare_frozen_ms"]), fmt.s(x["tar_zstd_wall_s"]), fmt.ms(x["tar_zstd_frozen_ms"]),
            fmt.mib(x["first_added_bytes"]), fmt.mib(x["ticking_repeat_added_bytes"]),
        ])
    out.append((
        f"Checkpoint, one container (medians of {runs})",
        ["workload", "agent", "agent: frozen (reported)", "agent: frozen (log)", "runc", "runc: frozen",
         "runc+tar|zstd", "runc+tar|zstd: frozen", "store: first", "store: next (ticking)"],
        rows,
    ))
    if "pair" in s:
        p = s["pair"]
        per = ", ".join(f"{n}: {fmt.s(v['wall_s'])} / {fmt.ms(v['frozen_ms'])}" for n, v in p["bare"].items())
        out.append((
            f"Checkpoint, two containers of {p['mib']} MiB (medians of {p['runs']})",
            ["agent", "agent: frozen (reported)", "agent: frozen (log)", "runc, sum", "runc: frozen, sum",
             "runc per container (time / frozen)"],
            [[fmt.s(p["agent_wall_s"]), fmt.ms(p["agent_frozen_reported_ms"]), fmt.ms(p["agent_frozen_outside_ms"]),
              fmt.s(p["bare_sum_wall_s"]), fmt.ms(p["bare_sum_frozen_ms"]), per]],
        ))
    rows = []
    for mib in sorted(s["restore"], key=int):
        x = s["restore"][mib]
        rows.append([
            f"{mib} MiB", fmt.s(x["agent_wall_s"]), fmt.ms(x["agent_start_ms"]), fmt.ms(x.get("agent_criu_restore_ms")),
            fmt.s(x["bare_wall_s"]), fmt.ms(x["bare_start_ms"]), fmt.ms(x.get("bare_criu_restore_ms")),
            fmt.s(x["bare_sandbox_s"]), fmt.s(x["bare_create_s"]),
            fmt.s(x.get("lazy_wall_s")), fmt.ms(x.get("lazy_start_ms")), fmt.s(x.get("lazy_all_in_s")),
            f"{fmt.ms(x.get('lazy_tick_gap_median_ms'))} / {fmt.ms(x.get('lazy_tick_gap_max_ms'))}",
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
            [[str(r["count"]), fmt.ms(r["start_ms_median"]), fmt.ms(r["start_ms_max"]), fmt.s(r["wall_s_max"])]],
        ))
    rows = []
    if "repeat" in s:
        r = s["repeat"]
        rows.append([f"repeated checkpoint, unchanged {r['mib']} MiB", f"first {fmt.mib(r['first_added_bytes'])}, "
                     f"then {fmt.mib(r['added_bytes'])} each (median of {r['runs']})"])
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
                f"{mib} MiB", fmt.s(x["agent_wall_s"]), fmt.ms(x["agent_frozen_outside_ms"]), fmt.s(x.get("agent_after_thaw_s")),
                fmt.mib(x["agent_store_added_bytes"]), fmt.s(x["native_wall_s"]), fmt.s(x["native_call_s"]),
                fmt.ms(x["native_frozen_ms"]), fmt.mib(x["native_archive_bytes"]),
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
                f"{mib} MiB", fmt.s(x["lazy_wall_s"]), fmt.ms(x["lazy_start_ms"]), fmt.s(x["lazy_first_tick_s"]),
                fmt.s(x["lazy_all_in_s"]), fmt.s(x["native_restore_wall_s"]), fmt.s(x["native_restore_sandbox_s"]),
                fmt.s(x["native_restore_create_s"]), fmt.s(x["native_restore_start_call_s"]),
                fmt.s(x["native_restore_first_tick_s"]),
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
            f"{mib} MiB", str(x["runs"]), fmt.s(x["cold_answer_s"]), fmt.s(x.get("cold_ready_s")),
            fmt.s(x["local_running_s"]), fmt.s(x["local_answer_s"]),
            fmt.s(x["default_running_s"]), fmt.s(x["default_answer_s"]) + lazy, fmt.s(x.get("default_all_in_s")),
            fmt.s(x["full_running_s"]), fmt.s(x["full_answer_s"]), fmt.ms(x.get("cli_startup_ms")),
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
            rows.append([f"{mib} MiB", str(r["count"]), fmt.s(r["answer_s_first"]), fmt.s(r["answer_s_median"]),
                         fmt.s(r["answer_s_max"]), "-" if r.get("slowest_over_first") is None
                         else f"{r['slowest_over_first']:.2f}x", fmt.s(r["running_s_median"]), fmt.s(r["running_s_max"])])
    if rows:
        out.append((
            "Model server replicas of one checkpoint, default restore, one after another, all kept running",
            ["weights", "replicas", "first answer: the first", "first answer: median", "first answer: slowest",
             "slowest / first", "running: median", "running: slowest"],
            rows,
        ))
    return out


def text_tables(doc: dict[str, Any]) -> str:
    parts = []
    for title, header, rows in tables(doc):
        parts.append(f"\n{title}\n{fmt.text_table(header, rows)}")
    m = doc["machine"]
    parts.append(f"\n{doc['date']}  {m['cores']} cores, kernel {m['kernel']}, containerd {m['containerd']}, "
                 f"runc {m['runc']}, CRIU {m['criu']}\n")
    return "".join(parts)

