"""The cross-node table (bench/crossnode.py's results): medians per size and column, the targets, the tables as
text, and the "crossnode" block of docs/benchmarks.md.

The results file keeps the raw samples (`results`); `load` computes the medians and judges the targets again
from them, as this version of the report does.
"""

from __future__ import annotations

import datetime
import json
import textwrap
from pathlib import Path
from typing import Any

from bench.report import fmt, stats
from bench.report.results import BENCH_DIR


CROSSNODE_JSON = BENCH_DIR / "crossnode.json"
SCHEMA = 1


# The targets are judged at these weights sizes (MiB), else at the largest and the smallest measured.
SMALL_MIB, LARGE_MIB = 256, 1024


LIMITS = {"pod_same": 1.5, "cli_same": 1.5, "sandbox_s": 1.0, "pod_cold": 1.0, "pull_get": 1.3, "push_get": 1.3,
          "fan_origin": 0.1}


PATHS = ("cold", "same_node", "cli", "pod")
TRANSFERS = ("get", "cache_get", "pull_bound", "pull", "push", "put")
Table = tuple[str, list[str], list[list[str]]]


def _at(sample: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(sample, dict):
            return None
        sample = sample.get(key)
    return sample


def _med(samples: list[dict[str, Any]], *keys: str) -> float | None:
    return stats.median([_at(s, *keys) for s in samples])


def _share(samples: list[dict[str, Any]], stored: float, *keys: str) -> float | None:
    """The median over the runs of a byte count as a share of the checkpoint's stored bytes."""
    return stats.median([stats.div(_at(s, *keys), stored) for s in samples])


def _rate(samples: list[dict[str, Any]], op: str) -> float | None:
    """The median MB/s of a transfer of the throughput column."""
    return stats.median([stats.div(_at(s, "throughput", op, "bytes"), _at(s, "throughput", op, "s")) for s in samples])


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """Medians per weights size (MiB, as keys) of bench/crossnode.py's raw samples."""
    out: dict[str, Any] = {}
    for mib, one in (results.get("sizes") or {}).items():
        ss = one.get("samples") or []
        stored = float(one["checkpoint"]["stored_bytes"])
        row: dict[str, Any] = {"runs": len(ss), "stored_bytes": stored, "weights_bytes": one.get("weights_bytes"),
                               "image_pull_s": stats.median(list((one.get("image_pull_s") or {}).values()))}
        for path in PATHS:
            for key in ("running_s", "answer_s", "cpu_busy", "cpu_iowait", "registry_cpu"):
                row[f"{path}_{key}"] = _med(ss, path, key)
        for key in ("cpu_busy", "cpu_iowait", "registry_cpu"):
            row[f"pod_after_{key}"] = _med(ss, "pod", "after_calls", key)
        row.update(cli_pull_s=_med(ss, "cli", "pull_s"), cli_restore_s=_med(ss, "cli", "restore_s"),
                   pod_sandbox_s=_med(ss, "pod", "sandbox_s"))
        lazy = [_at(s, "same_node", "lazy") for s in ss]
        row["same_node_lazy"] = all(lazy) if lazy and None not in lazy else None
        row.update(fan_first_answer_s=_med(ss, "fan_out", "first", "answer_s"),
                   fan_first_origin=_share(ss, stored, "fan_out", "first_origin_bytes"),
                   fan_two_answer_s=_med(ss, "fan_out", "two_answer_s"),
                   fan_two_origin=_share(ss, stored, "fan_out", "two_origin_bytes"),
                   fan_two_cpu_busy=_med(ss, "fan_out", "two_cpu_busy"),
                   fan_two_registry_cpu=_med(ss, "fan_out", "two_registry_cpu"),
                   fan_two_cpu_iowait=_med(ss, "fan_out", "two_cpu_iowait"),
                   fan_replicas=sum(int(_at(s, "fan_out", "replicas") or 0) for s in ss),
                   fan_wrong=sum(len(_at(s, "fan_out", "wrong") or []) for s in ss))
        for op in TRANSFERS:
            rate = _rate(ss, op)
            row.update({f"{op}_s": _med(ss, "throughput", op, "s"), f"{op}_mbps": None if rate is None else rate / 1e6,
                        f"{op}_cpu_busy": _med(ss, "throughput", op, "cpu_busy"),
                        f"{op}_registry_cpu": _med(ss, "throughput", op, "registry_cpu"),
                        f"{op}_cpu_iowait": _med(ss, "throughput", op, "cpu_iowait")})
        row["connections"] = _med(ss, "throughput", "get", "connections")
        row["sha256_cpu_s"] = _med(ss, "throughput", "sha256", "cpu_s")
        row["store_cpu_s"] = _med(ss, "throughput", "store", "cpu_s")
        out[mib] = row
    return out


def judged_sizes(summary_: dict[str, Any]) -> tuple[str | None, str | None]:
    """The sizes (as keys) the targets are judged at: the small one (256 MiB, else the smallest) and the large
    one (1024 MiB, else the largest); one size measured is both."""
    sizes = sorted(summary_, key=int)
    if not sizes:
        return None, None
    small = str(SMALL_MIB) if str(SMALL_MIB) in sizes else sizes[0]
    large = str(LARGE_MIB) if str(LARGE_MIB) in sizes else sizes[-1]
    return small, large


def _busy(row: dict[str, Any], key: str, seconds: str = "answer_s") -> str:
    """A column's time with the machine's busy share over it, and the registries' part of that where measured:
    what bounds a path that misses on a loaded machine."""
    registries, iowait = row.get(f"{key}_registry_cpu"), row.get(f"{key}_cpu_iowait")
    of_it = "" if registries is None else f", the registries {fmt.pct(registries)}"
    waiting = "" if not iowait else f"; waiting for I/O {fmt.pct(iowait)}"
    return f"{fmt.s(row[f'{key}_{seconds}'])} (CPU busy {fmt.pct(row[f'{key}_cpu_busy'])}{of_it}{waiting})"


def _after_calls(row: dict[str, Any]) -> str:
    """The Pod path's CPU after the kubelet's calls returned, while the memory streamed in, where measured."""
    if row.get("pod_after_cpu_busy") is None:
        return ""
    iowait = row.get("pod_after_cpu_iowait")
    return (f", after the kubelet's calls CPU busy {fmt.pct(row['pod_after_cpu_busy'])}, the registries "
            f"{fmt.pct(row.get('pod_after_registry_cpu'))}" + ("" if iowait is None else f"; I/O {fmt.pct(iowait)}"))


def _cpu_seconds(row: dict[str, Any], share: str, seconds: str, cores: int) -> float | None:
    """CPU seconds from a column's share of all cores (`share`: its busy share, or the registries') times its
    time."""
    of_all, took = row.get(share), row.get(seconds)
    return None if of_all is None or took is None else of_all * cores * took


def floors(row: dict[str, Any], cores: int) -> dict[str, tuple[float, str]]:
    """The least time each cross-node measurement of one size could take on this machine's cores, from the same
    run's own figures, with how it is made up: (seconds, how).

    * restore on another node: it does what the same node's restore does (CRIU, the process, the agent's
      reading and checking of every page) and the registry must serve it the checkpoint besides. So it takes
      at least the CPU seconds of the same-node restore (its busy share times its time) plus those the
      registries spent serving the checkpoint to a bare reader (the GET bound, the cheapest read there is,
      from the cache the CLI and Pod paths read through where it was measured, else from the origin), over
      the cores; and no less than the same-node restore itself.
    * full pull: at least everything the machine did for the GET bound (the registry, a reader, whatever else
      ran) plus computing the sha256 of every byte and, where measured, writing every blob as the store keeps
      it (a new file each, written past the page cache, fsynced and renamed; both measured in the run), over
      the cores; and, where measured, no less than a bare client took to do exactly that on as many
      connections (the pull bound: every blob read by GET, hashed as it arrives, written as the store keeps
      it): that many cores did not do it faster.
    * push: at least the registry's own upload of the same blobs from a bare client (the PUT bound).
    """
    out: dict[str, tuple[float, str]] = {}
    same = _cpu_seconds(row, "same_node_cpu_busy", "same_node_answer_s", cores)
    via = "cache_get" if row.get("cache_get_s") is not None else "get"
    serve = _cpu_seconds(row, f"{via}_registry_cpu", f"{via}_s", cores)
    if same is not None and serve is not None:
        least = max(row["same_node_answer_s"], (same + serve) / cores)
        bound = "the cache's GET bound" if via == "cache_get" else "the GET bound"
        out["restore"] = (least, f"(the same-node restore's {same:.1f} CPU s + the registries' {serve:.1f} CPU s "
                                 f"serving the checkpoint to {bound}) / {cores} cores = {(same + serve) / cores:.2f} s, "
                                 f"and not under the same-node restore's {fmt.s(row['same_node_answer_s'])}")
    get_all, sha = _cpu_seconds(row, "get_cpu_busy", "get_s", cores), row.get("sha256_cpu_s")
    if get_all is not None and sha is not None:
        keep = row.get("store_cpu_s")
        kept = "" if keep is None else f" + {keep:.2f} CPU s writing its blobs as the store keeps them"
        least = (get_all + sha + (keep or 0.0)) / cores
        how = (f"(the machine's {get_all:.1f} CPU s over the GET bound + {sha:.2f} CPU s of sha256 over the "
               f"checkpoint{kept}) / {cores} cores = {least:.2f} s")
        bare = row.get("pull_bound_s")
        if bare is not None:
            how += (f"; a bare client doing only that (the pull bound: GET, sha256, each blob written as the store "
                    f"keeps it) took {bare:.2f} s, CPU busy {fmt.pct(row.get('pull_bound_cpu_busy'))}")
            least = max(least, bare)
        out["pull"] = (least, how)
    if row.get("put_s") is not None:
        out["push"] = (row["put_s"], "the registry's own upload of the same blobs (PUT bound)")
    return out


def _floored(t: dict[str, Any], floor: tuple[float, str] | None, denominator: float | None) -> dict[str, Any]:
    """A ratio target with the least its ratio could be on this machine beside it: a miss whose floor is over
    the limit is bounded by the machine, not by the path."""
    ratio = None if floor is None else stats.div(floor[0], denominator)
    t["floor"] = ratio
    t["floor_how"] = None if floor is None else floor[1]
    t["bounded"] = bool(t["pass"] is False and ratio is not None and ratio > t["limit"])
    return t


def _check(key: str, title: str, measured: str, wrong: int) -> dict[str, Any]:
    """A target that is a fact, not a ratio: it holds when nothing went wrong."""
    return {"key": key, "title": title, "measured": measured, "ratio": float(wrong), "limit": 0.0, "op": "",
            "unit": "check", "pass": wrong == 0, "margin_pct": None}


def targets(summary_: dict[str, Any], cores: int) -> list[dict[str, Any]]:
    """The targets, each with its measured medians (and the machine's CPU, the registry's own bound) beside it,
    and the least each ratio could be on this machine's `cores` (`floors`)."""
    small, large = judged_sizes(summary_)
    t: list[dict[str, Any]] = []
    if large is None or small is None:
        return t
    a = summary_[large]
    fa, fb = floors(a, cores), floors(summary_[small], cores)
    same = _busy(a, "same_node")
    t.append(_floored(fmt.target(
        "xn_pod_same", f"{large} MiB: Pod path on another node, first answer / same-node default restore's",
        f"{_busy(a, 'pod')}{_after_calls(a)} vs {same}",
        stats.div(a["pod_answer_s"], a["same_node_answer_s"]), LIMITS["pod_same"]), fa.get("restore"),
        a["same_node_answer_s"]))
    t.append(_floored(fmt.target(
        "xn_cli_same", f"{large} MiB: CLI path on another node (pull --lazy, restore), first answer / same-node "
                       "default restore's",
        f"{_busy(a, 'cli')}, of it the pull {fmt.s(a['cli_pull_s'])}, vs {same}",
        stats.div(a["cli_answer_s"], a["same_node_answer_s"]), LIMITS["cli_same"]), fa.get("restore"),
        a["same_node_answer_s"]))
    t.append(fmt.target(
        "xn_sandbox", f"{large} MiB: Pod path, RunPodSandbox", fmt.s(a["pod_sandbox_s"]),
        stats.div(a["pod_sandbox_s"], LIMITS["sandbox_s"]), 1.0, unit=f"of {LIMITS['sandbox_s']:g} s"))
    b = summary_[small]
    t.append(_floored(fmt.target(
        "xn_pod_cold", f"{small} MiB: Pod path on another node, first answer / a cold start on that node",
        f"{_busy(b, 'pod')}{_after_calls(b)} vs {_busy(b, 'cold')}",
        stats.div(b["pod_answer_s"], b["cold_answer_s"]), LIMITS["pod_cold"]), fb.get("restore"), b["cold_answer_s"]))
    bound = (f"the registry's GET bound {_busy(a, 'get', 's')}: {fmt.mbps(a['get_mbps'])} on "
             f"{a['connections'] or 0:.0f} connections")
    # A push's registry hashes and stores every byte it is sent: its own upload of the same blobs (PUT bound)
    # is what bounds a push on a machine whose cores the registry shares.
    ingest = (f"; the registry's own upload of the same blobs (PUT bound) {_busy(a, 'put', 's')}: "
              f"{fmt.mbps(a['put_mbps'])}" if a.get("put_s") is not None else "")
    for op, what, more in (("pull", "full pull", ""), ("push", "push", ingest)):
        t.append(_floored(fmt.target(
            f"xn_{op}", f"{large} MiB: {what} / the registry's GET bound",
            f"{_busy(a, op, 's')}, {fmt.mbps(a[f'{op}_mbps'])}, vs {bound}{more}",
            stats.div(a[f"{op}_s"], a["get_s"]), LIMITS[f"{op}_get"]), fa.get(op), a["get_s"]))
    t.append(fmt.target(
        "xn_fan_origin", f"{large} MiB: fan-out through a pull-through cache, origin bytes for the next two nodes "
                         "at once / the checkpoint's",
        f"{fmt.times(a['fan_two_origin'])} of {fmt.mib(a['stored_bytes'])} (the first node: {fmt.times(a['fan_first_origin'])})",
        a["fan_two_origin"], LIMITS["fan_origin"], strict=True))
    replicas = sum(r["fan_replicas"] for r in summary_.values())
    wrong = sum(r["fan_wrong"] for r in summary_.values())
    t.append(_check("xn_fan_answers", "fan-out: every replica answers correctly",
                    f"{replicas - wrong} of {replicas} replicas, every size and run", wrong))
    return t


def build(machine: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    """The results file of one run: the machine, the raw samples, their medians and the targets."""
    s = summary(results)
    return {"schema": SCHEMA, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": machine, "results": results, "summary": s, "targets": targets(s, _cores(machine))}


def _cores(machine: dict[str, Any]) -> int:
    cores = machine.get("cores")
    return cores if isinstance(cores, int) and cores > 0 else 1


def load(path: Path | None = None) -> dict[str, Any] | None:
    """bench/crossnode.py's results file (or `path`), its medians and targets computed again; None where there
    is none."""
    try:
        data = json.loads((path or CROSSNODE_JSON).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("results"), dict) or "machine" not in data:
        return None
    data["summary"] = summary(data["results"])
    data["targets"] = targets(data["summary"], _cores(data["machine"]))
    return data


# ---- tables ------------------------------------------------------------------------------


def _target_row(t: dict[str, Any]) -> list[str]:
    if t["unit"] == "check":
        return [t["title"], t["measured"], "all" if t["pass"] else f"{t['ratio']:.0f} wrong", "all",
                "PASS" if t["pass"] else "MISS"]
    bounded = f"; bounded by this machine: its floor is {t['floor']:.2f}x" if t.get("bounded") else ""
    return [t["title"], t["measured"], fmt.ratio(t), fmt.limit(t), fmt.verdict(t) + bounded]


def _floor_row(t: dict[str, Any]) -> list[str]:
    floor = t["floor"]
    reach = "-" if floor is None else ("no: the floor is over the limit" if floor > t["limit"] else
                                       "yes: what is over the floor is the path's")
    return [t["title"], t["floor_how"] or "-", "-" if floor is None else f"{floor:.2f}x", fmt.limit(t),
            fmt.ratio(t), reach]


def _origin(share: float | None, stored: float) -> str:
    return "-" if share is None else f"{fmt.times(share)} ({fmt.mib(share * stored)})"


def _cpu_cell(row: dict[str, Any], key: str) -> str:
    iowait = row.get(f"{key}_cpu_iowait")
    return fmt.pct(row.get(f"{key}_cpu_busy")) + ("" if iowait is None else f" (I/O {fmt.pct(iowait)})")


def _rated(seconds: float | None, mbps: float | None) -> str:
    return "-" if seconds is None else f"{fmt.s(seconds)}, {fmt.mbps(mbps)}"


def tables(doc: dict[str, Any]) -> list[Table]:
    """(title, header, rows) of every table: the targets, the first answers, their parts, the registry, the CPU."""
    s = doc["summary"]
    rows = [(f"{m} MiB", s[m]) for m in sorted(s, key=int)]
    cores = doc["machine"].get("cores") or "?"
    lazy = {True: " (lazy)", False: " (full)", None: ""}
    return [
        ("Targets", ["target", "measured (median)", "ratio", "limit", "result"],
         [_target_row(t) for t in doc["targets"]]),
        (f"The floor: the least each ratio could be on this machine's {cores} cores, from the same run's figures",
         ["target", "made up of", "floor", "limit", "measured", "can the limit be met here"],
         [_floor_row(t) for t in doc["targets"] if "floor" in t]),
        ("First answer of the model server, from the request reaching the node (medians)",
         ["weights", "runs", "cold start on B", "same node A, default restore", "CLI path on B", "Pod path on B",
          "fan-out: C, cache empty", "fan-out: B and D at once"],
         [[w, str(r["runs"]), fmt.s(r["cold_answer_s"]), fmt.s(r["same_node_answer_s"]) + lazy[r["same_node_lazy"]],
           fmt.s(r["cli_answer_s"]), fmt.s(r["pod_answer_s"]), fmt.s(r["fan_first_answer_s"]),
           fmt.s(r["fan_two_answer_s"])] for w, r in rows]),
        ("The parts (medians; the image pull came before the runs and is in no column)",
         ["weights", "CLI: pull --lazy", "CLI: restore --start", "CLI: pull + restore", "Pod: RunPodSandbox",
          "Pod: the kubelet's calls", "same node: running", "cold: running", "image pull, per node"],
         [[w, fmt.s(r["cli_pull_s"]), fmt.s(r["cli_restore_s"]), fmt.s(r["cli_running_s"]), fmt.s(r["pod_sandbox_s"]),
           fmt.s(r["pod_running_s"]), fmt.s(r["same_node_running_s"]), fmt.s(r["cold_running_s"]),
           fmt.s(r["image_pull_s"])] for w, r in rows]),
        ("The registry (medians; bytes the origin served / the checkpoint's stored bytes)",
         ["weights", "checkpoint stored", "origin: first node", "origin: next two at once", "GET bound",
          "GET bound, the cache", "pull bound", "full pull", "push", "PUT bound"],
         [[w, fmt.mib(r["stored_bytes"]), _origin(r["fan_first_origin"], r["stored_bytes"]),
           _origin(r["fan_two_origin"], r["stored_bytes"]),
           _rated(r["get_s"], r["get_mbps"]) + f" ({r['connections'] or 0:.0f} connections)",
           _rated(r.get("cache_get_s"), r.get("cache_get_mbps")), _rated(r.get("pull_bound_s"), r.get("pull_bound_mbps")),
           _rated(r["pull_s"], r["pull_mbps"]), _rated(r["push_s"], r["push_mbps"]),
           _rated(r["put_s"], r["put_mbps"])] for w, r in rows]),
        (f"CPU busy over each interval, and idle waiting for I/O where measured (medians, share of all {cores} "
         "cores, /proc/stat)",
         ["weights", "cold", "same node", "CLI path", "Pod path", "fan-out: B and D", "GET bound",
          "GET bound, the cache", "pull bound", "pull", "push", "PUT bound"],
         [[w, *(_cpu_cell(r, p) for p in PATHS), _cpu_cell(r, "fan_two"), *(_cpu_cell(r, op) for op in TRANSFERS)]
          for w, r in rows]),
        (f"Of it, the registries' CPU (the origin and the cache; medians, share of all {cores} cores, /proc/PID/stat)",
         ["weights", "cold", "same node", "CLI path", "Pod path", "fan-out: B and D", "GET bound",
          "GET bound, the cache", "pull bound", "pull", "push", "PUT bound"],
         [[w, *(fmt.pct(r.get(f"{p}_registry_cpu")) for p in PATHS), fmt.pct(r.get("fan_two_registry_cpu")),
           *(fmt.pct(r.get(f"{op}_registry_cpu")) for op in TRANSFERS)] for w, r in rows]),
    ]


def _run_line(doc: dict[str, Any]) -> str:
    m, r = doc["machine"], doc["results"]
    runs = r.get("runs") or max((x["runs"] for x in doc["summary"].values()), default=0)
    elapsed = "-" if r.get("elapsed_s") is None else f"{r['elapsed_s'] / 60:.1f} min"
    line = (f"Measured {doc['date'][:10]}: {runs} interleaved run{'' if runs == 1 else 's'} per size, medians; weights "
            f"{', '.join(sorted(doc['summary'], key=int))} MiB; four test beds on one machine ({m.get('cores', '?')} "
            f"cores, {m.get('memory_gib', '?')} GiB); containerd {m.get('containerd', '?')}, runc "
            f"{m.get('runc', '?')}, CRIU {m.get('criu', '?')}; registry.connections {r.get('connections', '?')}; "
            f"node-agent {m.get('node_agent_commit', '?')}; load average "
            f"{fmt.loadavg(r.get('loadavg'), m.get('cores'))}; {elapsed}.")
    given_back = r.get("memory_given_back_gib")
    if given_back is not None:
        line += (f" The host took back {given_back} GiB of freed memory while it ran (free page reporting; each"
                 " page costs a fault in the host when next used).")
    if runs < 3:
        line = f"Fewer than 3 runs: not a measurement to rely on. {line}"
    return textwrap.fill(line, width=104, break_on_hyphens=False) + "\n"


def text(doc: dict[str, Any]) -> str:
    """The tables as text, for the terminal."""
    return "\n" + _run_line(doc) + "".join(f"\n{title}\n\n" + fmt.text_table(header, rows)
                                          for title, header, rows in tables(doc))


def crossnode_block(doc: dict[str, Any] | None) -> str:
    """The "crossnode" block of docs/benchmarks.md: the run, the targets and the tables."""
    if doc is None:
        return f"Not measured: {CROSSNODE_JSON.name} holds no results of bench/crossnode.py.\n"
    return _run_line(doc) + "".join(f"\n### {title}\n\n" + fmt.md_table(header, rows)
                                    for title, header, rows in tables(doc))
