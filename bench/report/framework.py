"""bench/framework.py's figures: the torch server's first answers (page cache warm and emptied), restored memory's
transfer rate against its bound, the targets, and the tables for the terminal and docs/benchmarks.md.
"""

from __future__ import annotations

import datetime
import json
import textwrap
from pathlib import Path
from typing import Any

from bench.report import fmt, stats
from bench.report.results import BENCH_DIR

FRAMEWORK_JSON = BENCH_DIR / "framework.json"
SCHEMA = 1
# The torch server's first answer / its cold start (the same page cache), and the transfer rate / its bound.
LIMITS = {"torch_default": 0.25, "torch_full": 0.4, "rate": 0.6}
CACHES = ("warm", "emptied")
PATHS = ("cold", "default", "full")
WORKLOADS = (("torch", "torch server"), ("numpy", "numpy model server"), ("memhog", "memhog"))
Table = tuple[str, list[str], list[list[str]]]


def _med(samples: list[dict[str, Any]], *keys: str) -> float | None:
    vals = []
    for s in samples:
        x: Any = s
        for k in keys:
            x = x.get(k) if isinstance(x, dict) else None
        if isinstance(x, (int, float)):
            vals.append(float(x))
    return stats.median(vals)


def _transfer(w: dict[str, Any], default: str, full: str) -> dict[str, Any]:
    """Median seconds and rates (MB/s of process memory) of the default restore until all in, of --full until
    running, and of the bound, with each run's ratio of rates."""
    ss = w.get("samples") or []
    mem = float(w.get("memory_bytes") or 0)
    out: dict[str, Any] = {"memory_bytes": mem, "runs": len(ss), "default_s": _med(ss, default, "all_in_s"),
                           "full_s": _med(ss, full, "running_s"), "bound_s": _med(ss, "bound", "s")}
    for k in ("default", "full", "bound"):
        out[f"{k}_mbps"] = stats.div(mem / 1e6, out[f"{k}_s"]) if mem else None
    for k, key in (("default", default), ("full", full), ("bound", "bound")):
        out[f"{k}_cpu_busy"] = _med(ss, key, "cpu_busy")
    for k, key, field in (("default", default, "all_in_s"), ("full", full, "running_s")):
        # The run's own rate over the run's own bound, then the median of those.
        out[f"{k}_over_bound"] = stats.median([b["bound"]["s"] / b[key][field] for b in ss
                                              if b.get(key, {}).get(field) and b.get("bound", {}).get("s")])
    return out


def summary(results: dict[str, Any]) -> dict[str, Any]:
    t = results.get("torch") or {}
    ss = t.get("samples") or []
    torch: dict[str, Any] = {"runs": len(ss), "memory_bytes": t.get("memory_bytes"), "rss_kib": t.get("rss_kib")}
    for c in CACHES:
        for p in PATHS:
            torch[f"{p}_{c}_answer_s"] = _med(ss, f"{p}_{c}", "answer_s")
            torch[f"{p}_{c}_running_s"] = _med(ss, f"{p}_{c}", "running_s")
        torch[f"default_{c}_all_in_s"] = _med(ss, f"default_{c}", "all_in_s")
        for step in ("import_s", "load_s", "trace_s", "warmup_s", "ready_s"):
            torch[f"cold_{c}_{step}"] = _med(ss, f"cold_{c}", step)
        for p in ("default", "full"):
            torch[f"{p}_{c}_cpu_busy"] = _med(ss, f"{p}_{c}", "cpu_busy")
            torch[f"{p}_{c}_over_cold"] = stats.median([s[f"{p}_{c}"]["answer_s"] / s[f"cold_{c}"]["answer_s"]
                                                       for s in ss])
    rates = {"torch": _transfer(t, "default_warm", "full_warm")}
    for kind in ("numpy", "memhog"):
        w = results.get(kind) or {}
        rates[kind] = {**_transfer(w, "default", "full"), "mib": w.get("mib")}
    return {"torch": torch, "transfer": rates}


def _busy(seconds: float | None, busy: float | None, sep: str = " (", end: str = ")") -> str:
    return fmt.s(seconds) + ("" if busy is None else f"{sep}CPU busy {fmt.pct(busy)}{end}")


def _floored(t: dict[str, Any], seconds: float | None, busy: float | None, denominator: float | None,
             what: str) -> dict[str, Any]:
    """A ratio target with its floor on this machine: the same work with every core busy all along (its time
    times the busy share of all cores over it). A miss whose floor is over the limit is bounded by the
    machine's CPU, not by idle time the path leaves."""
    floor = None if seconds is None or busy is None else stats.div(seconds * busy, denominator)
    t["floor"] = floor
    t["floor_how"] = None if floor is None else f"{what}: {fmt.s(seconds)} x {fmt.pct(busy)} busy"
    t["bounded"] = bool(t["pass"] is False and floor is not None and floor > t["limit"])
    return t


def targets(s: dict[str, Any]) -> list[dict[str, Any]]:
    t = s["torch"]
    out = []
    for c in CACHES:
        out.append(_floored(fmt.target(
            f"fw_torch_default_{c}", f"torch server, page cache {c}: first answer, default restore / cold start",
            f"{_busy(t[f'default_{c}_answer_s'], t.get(f'default_{c}_cpu_busy'))} vs {fmt.s(t[f'cold_{c}_answer_s'])}",
            t[f"default_{c}_over_cold"], LIMITS["torch_default"]),
            t[f"default_{c}_answer_s"], t.get(f"default_{c}_cpu_busy"), t[f"cold_{c}_answer_s"], "default restore"))
    out.append(fmt.target(
        "fw_torch_full", "torch server, page cache warm: first answer, --full / cold start",
        f"{fmt.s(t['full_warm_answer_s'])} vs {fmt.s(t['cold_warm_answer_s'])}",
        t["full_warm_over_cold"], LIMITS["torch_full"]))
    limit = 1 / LIMITS["rate"]
    for kind, name in WORKLOADS:
        r = s["transfer"][kind]
        size = fmt.mib(r["memory_bytes"])
        for mode, what in (("default", "default restore until every page is in"), ("full", "--full until running")):
            inv = r[f"{mode}_over_bound"]
            out.append(_floored(fmt.target(
                f"fw_rate_{kind}_{mode}", f"{name}, {size} of memory: transfer rate, {what} / the bound "
                                          f"(>= {LIMITS['rate']:g}x: time <= {limit:.2f}x the bound's)",
                f"{fmt.mbps(r[f'{mode}_mbps'])} ({_busy(r[f'{mode}_s'], r.get(f'{mode}_cpu_busy'), ', ', '')}) vs "
                f"{fmt.mbps(r['bound_mbps'])} ({_busy(r['bound_s'], r.get('bound_cpu_busy'), ', ', '')})",
                None if not inv else 1 / inv, limit),
                r[f"{mode}_s"], r.get(f"{mode}_cpu_busy"), r["bound_s"], mode))
    return out


def _verdict(t: dict[str, Any]) -> str:
    bounded = (f"; bounded by this machine's CPU: its floor is {t['floor']:.2f}x ({t['floor_how']})"
               if t.get("bounded") else "")
    return fmt.verdict(t) + bounded


def build(machine: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    s = summary(results)
    return {"schema": SCHEMA, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": machine, "results": results, "summary": s, "targets": targets(s)}


def load(path: Path | None = None) -> dict[str, Any] | None:
    """bench/framework.py's results file (or `path`), its medians and targets computed again; None if none."""
    try:
        data = json.loads((path or FRAMEWORK_JSON).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("results"), dict) or "machine" not in data:
        return None
    data["summary"] = summary(data["results"])
    data["targets"] = targets(data["summary"])
    return data


def tables(doc: dict[str, Any]) -> list[Table]:
    t = doc["summary"]["torch"]
    tr = doc["summary"]["transfer"]
    answers = [[c, *(fmt.s(t[f"{p}_{c}_answer_s"]) for p in PATHS), fmt.s(t[f"default_{c}_all_in_s"]),
                fmt.s(t[f"default_{c}_running_s"]), fmt.s(t[f"full_{c}_running_s"]), fmt.s(t[f"cold_{c}_import_s"]),
                fmt.s(t[f"cold_{c}_load_s"]), fmt.s(t[f"cold_{c}_trace_s"]), fmt.s(t[f"cold_{c}_warmup_s"])]
               for c in CACHES]
    rates = [[name, fmt.mib(tr[k]["memory_bytes"]), f"{fmt.mbps(tr[k]['default_mbps'])} ({fmt.s(tr[k]['default_s'])})",
              f"{fmt.mbps(tr[k]['full_mbps'])} ({fmt.s(tr[k]['full_s'])})",
              f"{fmt.mbps(tr[k]['bound_mbps'])} ({fmt.s(tr[k]['bound_s'])})",
              fmt.times(tr[k]["default_over_bound"]), fmt.times(tr[k]["full_over_bound"])] for k, name in WORKLOADS]
    return [
        ("Targets", ["target", "measured (median)", "ratio", "limit", "result"],
         [[x["title"], x["measured"], fmt.ratio(x), fmt.limit(x), _verdict(x)] for x in doc["targets"]]),
        ("Torch server: first answer, from the request reaching the node (medians)",
         ["page cache", "cold start", "default restore", "--full", "default: every page in", "default: running",
          "--full: running", "cold: import torch", "cold: load weights", "cold: trace", "cold: warm-up"],
         answers),
        ("Restored memory per second, from the restore call until every page is in (medians; page cache warm)",
         ["workload", "memory", "default restore", "--full", "bound: 2 threads read, verify, decode, copy",
          "default / bound", "--full / bound"], rates),
    ]


def _run_line(doc: dict[str, Any]) -> str:
    m, r = doc["machine"], doc["results"]
    t = doc["summary"]["torch"]
    rss = t.get("rss_kib")
    elapsed = "-" if r.get("elapsed_s") is None else f"{r['elapsed_s'] / 60:.1f} min"
    line = (f"Measured {doc['date'][:10]}: {r.get('runs', '?')} interleaved runs, medians; one test bed ("
            f"{m.get('cores', '?')} cores, {m.get('memory_gib', '?')} GiB); containerd {m.get('containerd', '?')}, "
            f"runc {m.get('runc', '?')}, CRIU {m.get('criu', '?')}; the torch server's resident memory "
            f"{'-' if rss is None else f'{rss / 1024:.0f} MiB'}, numpy server and memhog {r.get('mib', '?')} MiB; "
            f"node-agent {m.get('node_agent_commit', '?')}; load average {fmt.loadavg(r.get('loadavg'), m.get('cores'))}"
            f"; {elapsed}.")
    given_back = r.get("memory_given_back_gib")
    if given_back is not None:
        line += f" The host took back {given_back} GiB of freed memory while it ran (free page reporting)."
    if (r.get("runs") or 0) < 3:
        line = f"Fewer than 3 runs: not a measurement to rely on. {line}"
    return textwrap.fill(line, width=104, break_on_hyphens=False) + "\n"


def text(doc: dict[str, Any]) -> str:
    return "\n" + _run_line(doc) + "".join(f"\n{title}\n\n" + fmt.text_table(header, rows)
                                          for title, header, rows in tables(doc))


def framework_block(doc: dict[str, Any] | None) -> str:
    """The "framework" block of docs/benchmarks.md."""
    if doc is None:
        return f"Not measured: {FRAMEWORK_JSON.name} holds no results of bench/framework.py.\n"
    return _run_line(doc) + "".join(f"\n### {title}\n\n" + fmt.md_table(header, rows)
                                    for title, header, rows in tables(doc))
