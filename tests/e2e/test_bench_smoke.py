"""bench/run.py --quick on the end-to-end bed: every metric comes out, nothing is left behind.

On containerd 2.x that includes the comparison with containerd's own CRI
checkpoint and restore (bench/scenarios/native.py), at 16 MiB with one run.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.harness import crilog
from bench.report import docs, image_check, results
from bench.scenarios import native
from testbed.bed import REPO, Bed, pods_in

TARGETS = {"frozen_one", "frozen_pair", "durable", "restore", "repeat_store", "rss",
           "restore_lazy", "lazy_start", "lazy_whole", "lazy_all_in", "lazy_replicas"}
SUMMARY = {
    ("single", "16"): [
        "agent_wall_s", "agent_frozen_reported_ms", "agent_frozen_outside_ms", "bare_wall_s", "bare_frozen_ms",
        "tar_zstd_wall_s", "tar_zstd_dump_s", "tar_zstd_frozen_ms", "first_added_bytes", "size_bytes",
    ],
    ("restore", "16"): ["agent_wall_s", "agent_start_ms", "bare_wall_s", "bare_start_ms", "bare_sandbox_s", "bare_create_s",
                        "lazy_wall_s", "lazy_start_ms", "lazy_all_in_s"],
    ("replicas",): ["start_ms_max", "start_ms_median", "wall_s_max"],
    ("pair",): ["agent_wall_s", "agent_frozen_reported_ms", "agent_frozen_outside_ms", "bare_sum_wall_s", "bare_sum_frozen_ms"],
    ("repeat",): ["size_bytes", "first_added_bytes", "added_bytes", "added_fraction"],
    ("rss",): ["peak_mib"],
}
NATIVE_TARGETS = {"native_durable", "native_frozen", "native_restore"}
ANSWER_TARGETS = {"answer_first", "answer_running", "answer_cold", "answer_replicas"}
ANSWER_SUMMARY = ["cold_answer_s", "local_running_s", "local_answer_s", "default_running_s", "default_answer_s",
                  "full_running_s", "full_answer_s", "default_answer_over_running", "cli_startup_ms"]
NATIVE_SUMMARY = [
    "agent_wall_s", "agent_frozen_outside_ms", "agent_store_added_bytes", "native_wall_s", "native_call_s",
    "native_frozen_ms", "native_archive_bytes", "lazy_wall_s", "lazy_first_tick_s", "native_restore_wall_s",
    "native_restore_create_s", "native_restore_start_call_s", "native_restore_first_tick_s",
]


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def test_the_frozen_window_is_the_largest_gap_between_tick_stamps(tmp_path: Path) -> None:
    log = tmp_path / "0.log"
    lines = [
        "2026-01-01T00:00:00.000000000Z stdout F tick 1",
        "2026-01-01T00:00:00.005000000Z stdout F tick 2",
        "2026-01-01T00:00:00.010Z stderr F tick 99",
        "2026-01-01T01:00:00.250000000+01:00 stdout F tick 3",
        "2026-01-01T00:00:00.255Z stdout F tick 4",
    ]
    log.write_text("\n".join(lines[:2]) + "\n")
    t = crilog.TickLog(str(log))
    t.mark()
    log.write_text("\n".join(lines) + "\n")
    gap = t.gap_since_mark(crilog.parse_ts("2026-01-01T00:00:00.100Z"), timeout=1)
    assert gap.gap_ms == 245.0 and gap.ticks == 0
    assert crilog.parse_ts("2026-01-01T00:00:01.5Z") - crilog.parse_ts("2026-01-01T00:00:00Z") == 1.5


def test_quick_benchmark_reports_every_metric_and_cleans_up(agent: Bed, tmp_path: Path) -> None:
    assert agent.agent is not None
    plans = Path(agent.store) / "plans"
    plans_before = set(os.listdir(plans)) if plans.is_dir() else set()
    out = tmp_path / "results.json"
    cp = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), "--quick", "--bed", agent.name, "--attach", agent.config,
         "--agent-pid", str(agent.agent.pid), "--workdir", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, timeout=420,
    )
    assert cp.returncode == 0, f"{cp.stderr[-4000:]}\n{cp.stdout[-2000:]}"
    merged = json.loads(out.read_text())
    assert merged["schema"] == results.SCHEMA and set(merged["runs"]) == {merged["latest"]}
    doc = merged["runs"][merged["latest"]]
    assert doc["config"]["quick"] and doc["config"]["attached"]
    for key in ("cores", "kernel", "containerd", "runc", "criu"):
        assert doc["machine"][key], key
    # The bed's containerd and runc, not the ones on PATH.
    assert doc["machine"]["containerd"] == agent.info["containerd_version"]
    assert doc["machine"]["runc"] == agent.info["runc_version"]
    with_native = not native.unsupported(agent.info)

    targets = {t["key"]: t for t in doc["targets"]}
    assert set(targets) == TARGETS | ANSWER_TARGETS | (NATIVE_TARGETS if with_native else set())
    for t in targets.values():
        assert _number(t["ratio"]) and t["ratio"] > 0, t
        assert isinstance(t["pass"], bool), t
        assert t["key"] in ("repeat_store",) or t["ratio"] < 100, t
    for path, keys in SUMMARY.items():
        node: Any = doc["summary"]
        for p in path:
            node = node[p]
        for k in keys:
            assert _number(node[k]), (path, k, node.get(k))

    # Raw samples: one interleaved run of each operation, each with its window.
    run = doc["samples"]["single"]["16"][0]
    for op in ("agent", "bare", "bare_tar_zstd"):
        assert run[op]["wall_s"] > 0 and run[op]["frozen_outside_ms"] > 0, (op, run[op])
        assert run[op]["start"] < run[op]["end"]
    assert run["agent"]["frozen_reported_ms"] > 0
    pair = doc["samples"]["pair"]["samples"][0]
    assert set(pair["agent"]["gap_ms"]) == {"a", "b"} and set(pair["bare"]["containers"]) == {"a", "b"}
    assert doc["samples"]["restore"]["16"][0]["bare"]["plan_renamed"] in (True, False)

    for title in ("Targets", "Checkpoint, one container", "Restore until running", "Store and memory"):
        assert title in cp.stdout, cp.stdout
    assert "PASS" in cp.stdout or "MISS" in cp.stdout

    # The model server's first answer: cold start, local plan, the default restore and --full, each
    # timed from when the request reached the agent (or RunPodSandbox), every answer checked.
    answer = doc["summary"]["answer"][str(agent.info["model_mib"])]
    for k in ANSWER_SUMMARY:
        assert _number(answer[k]) and answer[k] > 0, k
    for path in ("local", "default", "full"):
        assert answer[f"{path}_answer_s"] >= answer[f"{path}_running_s"], path
    assert _number(answer["replicas"]["slowest_over_first"])
    assert "Time to first answer" in cp.stdout

    images: list[str] = []
    if with_native:
        # containerd's own path: checkpoint into an archive, restore from it, on fresh memory
        # the agent's store had never seen, from an image a registry served.
        for k in NATIVE_SUMMARY:
            assert _number(doc["summary"]["native"]["16"][k]), k
        nat = doc["samples"]["native"]
        s = nat["sizes"]["16"][0]
        assert "@sha256:" in s["image_ref"] and s["image_ref"].startswith(nat["image"].split("/")[0] + "/")
        assert s["agent"]["store_added_bytes"] >= 15 << 20, s["agent"]  # nothing of it was stored before
        assert s["native"]["archive_bytes"] >= 16 << 20 and s["native"]["frozen_outside_ms"] > 0
        assert s["native"]["call_s"] <= s["native"]["wall_s"]
        for op in ("lazy", "native_restore"):
            assert 0 < s[op]["wall_s"] and 0 < s[op]["first_tick_s"] < 60, (op, s[op])
        assert "Against containerd's CheckpointContainer" in cp.stdout
        images = [nat["image"], nat["repo_digest"]]
        host = nat["image"].split("/")[0]
        assert not os.path.exists(os.path.join(agent.info["registry_hosts_dir"], host))
    else:
        assert doc["summary"]["native_skipped"]

    # docs/benchmarks.md's blocks from the results file: one column per containerd version in the targets table.
    md = docs.render(docs.DOCS.read_text(), merged)
    assert f"| containerd {doc['machine']['containerd']} |" in md and "## How each number is measured" in md

    # Nothing is left: pods, checkpoints, the work dir; the agent still serves.
    for ns in ("bench", "bench-r", "bench-stage"):
        assert pods_in(agent, ns) == [], ns
    listed = json.loads(agent.cli("checkpoints", "ls", "-o", "json").stdout)
    assert [c["id"] for c in listed if c["pod_namespace"] == "bench"] == []
    assert not (tmp_path / "work").exists()
    assert (set(os.listdir(plans)) if plans.is_dir() else set()) <= plans_before
    assert agent.agent.poll() is None
    if images:
        ctr = [agent.info["ctr_binary"], "--address", agent.info["containerd_socket"], "-n", "k8s.io"]
        listed_images = subprocess.run([*ctr, "images", "ls", "-q"], capture_output=True, text=True, check=True).stdout
        assert not set(images) & set(listed_images.split()), listed_images


def test_the_image_check_benchmark_runs_both_variants_and_leaves_the_wrapper_as_it_was(agent: Bed,
                                                                                      tmp_path: Path) -> None:
    assert agent.agent is not None
    launcher = Path(agent.store) / "bin" / "node-agent-runc"
    before = launcher.read_text()
    out = tmp_path / "image_check.json"
    cp = subprocess.run(
        [sys.executable, str(REPO / "bench" / "image_check.py"), "--bed", agent.name, "--attach", agent.config,
         "--agent-pid", str(agent.agent.pid), "--workdir", str(tmp_path / "work"), "--out", str(out),
         "--runs", "1", "--warmup", "0", "--mib", "16", "--tasks", "4", "--settle", "0"],
        capture_output=True, text=True, timeout=420,
    )
    assert cp.returncode == 0, f"{cp.stderr[-4000:]}\n{cp.stdout[-2000:]}"
    doc = json.loads(out.read_text())
    for kind in ("memhog", "tasks"):
        s = doc["summary"][kind]
        for k in ("on_s", "off_s", "ratio", "check_ms"):
            assert _number(s[k]) and s[k] > 0, (kind, k, s)
        assert doc["results"]["check_alone"][kind]["findings"] == [], "a genuine checkpoint held to its own config"
    # The shell and its 4 sleeps, and the ticker's own sleep when the freeze caught one running.
    assert doc["summary"]["tasks"]["check_tasks"] in (5, 6), doc["summary"]["tasks"]
    block = image_check.image_check_block(doc)
    assert "the check alone" in block and block.startswith("Measured ")
    assert launcher.read_text() == before
    assert pods_in(agent, "bench") == [] and pods_in(agent, "bench-r") == []
    assert not (tmp_path / "work").exists()
    assert agent.agent.poll() is None
