"""Encryption at rest (bench/encryption.py's results): medians per variant, the targets, the tables, and
the "encryption" block of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import Any, Callable

from bench.report import fmt, stats
from bench.report.results import ENCRYPTION_JSON


SCHEMA = 1


LIMIT = 1.15  # encrypted / clear, for every time


REPEAT_LIMIT = 0.05  # store growth of a repeated checkpoint, encrypted



def load(path: Path | None = None) -> dict[str, Any] | None:
    """bench/encryption.py's results file, or None where there is none."""
    try:
        data = json.loads((path or ENCRYPTION_JSON).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("samples"), dict) or "machine" not in data:
        return None
    # Medians and targets from the raw samples, as this version of the report computes them.
    data["summary"] = summary(data["samples"])
    data["targets"] = targets(data["summary"])
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
        out[v] = stats.median(vals)
    return out


def _field(key: str) -> Callable[[dict[str, Any]], Any]:
    return lambda x: x[key]


def summary(results: dict[str, Any]) -> dict[str, Any]:
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
    s["restore"]["criu_restore_ms"] = _variants(rs, lambda x: stats.total(x.get("criu_restore_ms")))
    s["answer"] = {k: _variants(ansr, _field(k)) for k in ("running_s", "answer_s", "all_in_s")}
    s["answer"]["lazy"] = {v: sorted({str(r[v].get("lazy")) for r in ansr if v in r}) for v in ("clear", "encrypted")}
    added = _variants(reps, lambda x: x["added_bytes"])
    size = _variants(reps, lambda x: x["size"])
    s["repeat"] = {"added_bytes": added, "size": size,
                   "fraction": {v: stats.div(added[v], size[v]) for v in ("clear", "encrypted")},
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


def targets(s: dict[str, Any]) -> list[dict[str, Any]]:
    t: list[dict[str, Any]] = []
    mib, lim = s.get("mib"), LIMIT
    e, c = _pair(s["checkpoint"]["wall_s"])
    t.append(fmt.target("enc_durable", f"encryption: {mib} MiB checkpoint until durable, encrypted / clear",
                     f"{fmt.s(e)} vs {fmt.s(c)}", stats.div(e, c), lim))
    e, c = _pair(s["checkpoint"]["frozen_outside_ms"])
    er, cr = _pair(s["checkpoint"]["frozen_reported_ms"])
    t.append(fmt.target("enc_frozen", "encryption: frozen window of that checkpoint, encrypted / clear",
                     f"{fmt.ms(e)} (agent says {fmt.ms(er)}) vs {fmt.ms(c)} (agent says {fmt.ms(cr)})", stats.div(e, c), lim))
    e, c = _pair(s["restore"]["wall_s"])
    t.append(fmt.target("enc_restore", "encryption: restore --start (full) of that checkpoint until running, "
                                    "encrypted / clear", f"{fmt.s(e)} vs {fmt.s(c)}", stats.div(e, c), lim))
    e, c = _pair(s["answer"]["answer_s"])
    t.append(fmt.target("enc_answer", f"encryption: model server {s.get('answer_mib')} MiB, first answer of a restored "
                                   "replica (default restore), encrypted / clear", f"{fmt.s(e)} vs {fmt.s(c)}", stats.div(e, c), lim))
    rep = s["repeat"]
    frac, cfrac = rep["fraction"]["encrypted"], rep["fraction"]["clear"]
    t.append(fmt.target(
        "enc_repeat", f"encryption: store growth, repeated checkpoint of unchanged {s.get('repeat_mib')} MiB, encrypted",
        f"{fmt.mib(rep['added_bytes']['encrypted'])} of {fmt.mib(rep['size']['encrypted'])}"
        + (f" ({frac * 100:.2f}%)" if frac is not None else "")
        + (f"; clear {fmt.mib(rep['added_bytes']['clear'])} ({cfrac * 100:.2f}%)" if cfrac is not None else ""),
        frac, REPEAT_LIMIT, unit="fraction"))
    return t


def build(args: argparse.Namespace, machine: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    summary = summary(results)
    return {
        "schema": SCHEMA,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine,
        "config": {"runs": args.runs, "warmup": args.warmup, "mib": args.mib, "repeat_mib": args.repeat_mib,
                   "answer_mib": args.answer_mib, "settle_s": args.settle, "bed": args.bed, "note": args.note,
                   "limit": LIMIT, "repeat_limit": REPEAT_LIMIT,
                   "quiet_wait_s": getattr(args, "quiet_wait", None)},
        "samples": results,
        "summary": summary,
        "targets": targets(summary),
    }


def _enc_row(what: str, d: dict[str, float | None], show: Callable[[float | None], str]) -> list[str]:
    e, c = _pair(d)
    r = stats.div(e, c)
    return [what, show(c), show(e), "-" if r is None else f"{r:.2f}x"]


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
        _enc_row("  added to the store", ck["store_added_bytes"], fmt.mib),
        _enc_row("frozen window (log)", ck["frozen_outside_ms"], fmt.ms),
        _enc_row("frozen window (agent)", ck["frozen_reported_ms"], fmt.ms),
        _enc_row(f"{s['mib']} MiB restore --start (full) until running", rs["wall_s"], sec),
        _enc_row("  before StartContainer", rs["before_start_s"], sec),
        _enc_row("  StartContainer", rs["start_ms"], fmt.ms),
        _enc_row("  CRIU restore", rs["criu_restore_ms"], fmt.ms),
        _enc_row("  agent CPU during the call", rs["agent_cpu_s"], sec),
        _enc_row("    of it user", rs["agent_user_s"], sec),
        _enc_row("    of it system", rs["agent_sys_s"], sec),
        _enc_row("  agent's minor page faults", rs["agent_minflt"], _count),
        _enc_row(f"model server {s['answer_mib']} MiB, default restore: running", an["running_s"], sec),
        _enc_row("  first answer", an["answer_s"], sec),
        _enc_row("  all pages in", an["all_in_s"], sec),
        ["  restore kind", lazy["clear"], lazy["encrypted"], ""],
        _enc_row(f"repeated checkpoint of unchanged {s['repeat_mib']} MiB: added", s["repeat"]["added_bytes"], fmt.mib),
        _enc_row("  of its size", s["repeat"]["fraction"], pct),
    ]
    targets = [[t["title"], t["measured"], fmt.ratio(t), fmt.limit(t), fmt.verdict(t)] for t in doc["targets"]]
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


def text(doc: dict[str, Any]) -> str:
    parts = []
    for title, header, rows in _encryption_tables(doc):
        parts.append(f"\n{title}\n{fmt.text_table(header, rows)}")
    parts.append("\n" + _encryption_checked(doc["summary"]) + "\n")
    m = doc["machine"]
    parts.append(f"\n{doc['date']}  {m['cores']} cores, kernel {m['kernel']}, containerd {m['containerd']}, "
                 f"runc {m['runc']}, CRIU {m['criu']}\n")
    return "".join(parts)


def _quiet(rows: list[dict[str, Any]] | None, limit: float | None) -> str:
    if not rows:
        return "-"
    waited = sum(float(r.get("waited_s") or 0) for r in rows)
    busy = [r["busy_cores"] for r in rows if r.get("busy_cores") is not None]
    late = sum(1 for r in rows if limit is not None and float(r.get("waited_s") or 0) >= limit)
    return (f"{len(rows)} rounds; waited {waited:.0f} s in all for other work to stop"
            + (f"; busy cores at the start: median {stats.median(busy):.2f}, most {max(busy):.2f}" if busy else "")
            + (f"; {late} started busy after {limit:.0f} s" if late else ""))


def encryption_block(doc: dict[str, Any] | None) -> str:
    """The "encryption" block of docs/benchmarks.md: the run's machine, targets, medians and outside checks."""
    if doc is None:
        return f"Not measured: {ENCRYPTION_JSON.name} holds no results of bench/encryption.py.\n"
    m, c = doc["machine"], doc["config"]
    parts = []
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
        ["load average (1, 5, 15 min)", fmt.loadavg(la, m.get("cores"))],
        ["quiet before each round", _quiet(doc["samples"].get("quiet"), c.get("quiet_wait_s"))],
        ["elapsed", "-" if elapsed is None else f"{elapsed / 60:.1f} min"],
    ]
    parts.append(fmt.md_table(["machine", ""], machine))
    for title, header, rows in _encryption_tables(doc):
        parts.append(f"\n### {title.removeprefix('Encryption: ').capitalize()}\n\n")
        parts.append(fmt.md_table(header, rows))
    parts.append("\n" + _encryption_checked(doc["summary"]) + "\n")
    return "".join(parts)
