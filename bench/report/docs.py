"""docs/benchmarks.md: the prose is written in the file itself; writing the docs replaces only its generated blocks.

A generated block is what lies between a line `<!-- generated: NAME -->` and a line
`<!-- end: NAME -->`: the tables and every measured figure. `render` fills each block of the
file's text from the results files (bench/results.json, bench/encryption.json,
bench/image_check.json, bench/crossnode.json) and leaves everything else as it is. Rule: no
sentence here quotes a figure; prose that depends on the figures lives in docs/benchmarks.md,
next to its block.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from bench.report import crossnode as crossnode_results
from bench.report import framework as framework_results
from bench.report import fmt, tables
from bench.report.encryption import encryption_block
from bench.report.image_check import image_check_block
from bench.report.results import series, series_order
from bench.report.targets import NATIVE_LIMITS


DOCS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
BLOCK = re.compile(r"^<!-- generated: ([a-z0-9-]+) -->\n(.*?)^<!-- end: \1 -->\n", re.M | re.S)
START = re.compile(r"^<!-- generated: ([a-z0-9-]+) -->$", re.M)


class DocsError(Exception):
    """The text's generated blocks are not the ones the results render."""


def block_names(text: str) -> list[str]:
    """The generated blocks of a text, in order (every start marker, closed or not)."""
    return START.findall(text)


def splice(text: str, blocks: dict[str, str]) -> str:
    """`text` with each generated block's content replaced by `blocks[NAME]`: a blank line, the content, a
    blank line, or nothing at all for an empty one."""
    names = block_names(text)
    closed = [m.group(1) for m in BLOCK.finditer(text)]
    if names != closed:
        raise DocsError(f"generated blocks not closed by their end line: {sorted(set(names) - set(closed))}")
    if sorted(names) != sorted(blocks):
        raise DocsError(f"the text has the generated blocks {names}, the results render {sorted(blocks)}")

    def fill(m: re.Match[str]) -> str:
        body = blocks[m.group(1)].strip("\n")
        inner = f"\n{body}\n\n" if body else ""
        return f"<!-- generated: {m.group(1)} -->\n{inner}<!-- end: {m.group(1)} -->\n"

    return BLOCK.sub(fill, text)


def _cell(t: dict[str, Any] | None) -> str:
    if t is None:
        return "-"
    return f"{fmt.ratio(t)}: {fmt.verdict(t)}"


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
        ["load average (1, 5, 15 min)", fmt.loadavg(doc["samples"].get("loadavg"), m.get("cores"))],
        ["elapsed", "-" if doc["samples"].get("elapsed_s") is None else f"{doc['samples']['elapsed_s'] / 60:.1f} min"],
    ]


def results_blocks(merged: dict[str, Any]) -> dict[str, str]:
    """The blocks of bench/run.py's results: "latest" (the targets of every containerd version, a column
    each, newest first) and "versions" (each version's machine and tables)."""
    docs = [merged["runs"][k] for k in series_order(merged)]
    parts: list[str] = []
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
        rows.append([first[k]["title"], fmt.limit(first[k]), *cells])
    parts.append("### Targets\n\n")
    parts.append(fmt.md_table(["target", "limit", *[f"containerd {d['machine']['containerd']}" for d in docs]], rows))
    versions: list[str] = []
    for d in docs:
        versions.append(f"\n## containerd {d['machine']['containerd']} ({d['date'][:10]})\n\n")
        versions.append(fmt.md_table(["machine", ""], _machine_rows(d)))
        for title, header, trows in tables.tables(d):
            versions.append(f"\n### {title}\n\n")
            versions.append(fmt.md_table(header, trows))
        if d["summary"].get("native_skipped"):
            versions.append(f"\nAgainst containerd's own checkpoint and restore: not measured "
                            f"({d['summary']['native_skipped']}).\n")
        if d["summary"].get("answer_skipped"):
            versions.append(f"\nTime to first answer: not measured ({d['summary']['answer_skipped']}).\n")
    return {"latest": "".join(parts), "versions": "".join(versions)}


def render(text: str, merged: dict[str, Any], encryption: dict[str, Any] | None = None,
           image_check: dict[str, Any] | None = None, crossnode: dict[str, Any] | None = None,
           framework: dict[str, Any] | None = None) -> str:
    """`text` (docs/benchmarks.md as it is) with every generated block filled from a results file (every
    containerd version it holds) and from bench/encryption.py's, bench/image_check.py's,
    bench/crossnode.py's and bench/framework.py's results."""
    blocks = results_blocks(merged)
    blocks["encryption"] = encryption_block(encryption)
    blocks["image-check"] = image_check_block(image_check)
    blocks["crossnode"] = crossnode_results.crossnode_block(crossnode)
    blocks["framework"] = framework_results.framework_block(framework)
    return splice(text, blocks)


def write(merged: dict[str, Any], encryption: dict[str, Any] | None = None,
          image_check: dict[str, Any] | None = None, path: Path = DOCS,
          crossnode: dict[str, Any] | None = None, framework: dict[str, Any] | None = None) -> None:
    """Fills the generated blocks of `path` in place; the cross-node and framework blocks from `crossnode` and
    `framework`, by default from bench/crossnode.json and bench/framework.json as they are."""
    if crossnode is None:
        crossnode = crossnode_results.load()
    if framework is None:
        framework = framework_results.load()
    path.write_text(render(path.read_text(encoding="utf-8"), merged, encryption, image_check, crossnode, framework),
                    encoding="utf-8")
