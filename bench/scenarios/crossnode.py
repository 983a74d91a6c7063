"""The cross-node table: a model server's replica on another node, from the request to its first correct answer.

Four test beds are four nodes, each with its own containerd, CNI bridge, store and agent
(bench/scenarios/crossnode_nodes.py): A runs the model server (the Debian test image's modelserver, N MiB
of weights, `scripts/testbed up --model-mib N`) and checkpoints it; B, C and D are the targets. A real
registry on loopback is the origin: the model image and the checkpoint are pushed there, and a
pull-through cache of it (docker-registry in proxy mode) is every target's mirror in its hosts.toml. Before
the runs of a size each target pulls the model image through CRI PullImage (timed, reported apart), so
every path below finds it on the node. Then, interleaved in every run (bench/scenarios/crossnode_paths.py):

  1. cold: a new pod on B running the server from that image (RunPodSandbox, CreateContainer, StartContainer
     with the node's default runtime, then the server's own start-up);
  2. same node: the agent's Restore with start and default options (lazy where CRIU and the kernel allow
     it) on A, from A's own store;
  3. CLI path: on B, `pull --lazy` of the origin's reference, then the default restore with start, each
     call as the CLI sends it to the agent's local socket; the pull and the restore are also reported
     apart, with their sum;
  4. Pod path: on B, a Pod annotated `checkpoint.node-agent.io/restore-from: <the origin's reference>`,
     started with testbed.kubelet.Kubelet's calls (RunPodSandbox, then ImageStatus, CreateContainer,
     StartContainer: the image is there, so no PullImage) through the agent's CRI endpoint;
     RunPodSandbox's own duration is a column of its own;
  5. fan-out: with an empty cache, the Pod path on C, then on B and D at once (all kept running until the
     end): the time until both answered, and the blob bytes the origin served (from its own log) for C and
     for B and D together, each against the checkpoint's stored bytes;
  6. throughput: a full `pull` on B straight from the origin and a `push` from A into a new repository
     of the origin, each against the registry's own bound: every blob of the checkpoint's manifest read by
     GET over as many connections as the agent's `registry.connections` and discarded.

Columns 3 and 4 run after the fan-out, through the cache it filled. Every column is timed from its first
request over a connection already open (the CLI's own start-up is not included) to the first 200 of
`GET /predict` to the new pod's IP, and every answer is checked as firstanswer.py checks a replica (the
source's start time, pid, weights digest and answer for the same x, its request count going on); a wrong
answer fails the run, except in the fan-out, where it is recorded and judged as a target. A lazy restore's
pages are then waited for, untimed; each target's store is emptied after each path. The busy share of
all cores (/proc/stat) is kept over each column's interval. bench/crossnode.py is its command line,
bench/report/crossnode.py its figures, targets and tables.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from bench.harness.base import log
from bench.harness.main import docs_with, run_facts, standalone
from bench.report import crossnode as report
from bench.scenarios.crossnode_nodes import Cluster
from bench.scenarios.crossnode_paths import Columns, CpuLog

DEFAULT_BED = "na-xnode"  # the beds are na-xnode-a, -b, -c and -d


def one_size(cluster: Cluster, cpu: CpuLog, mib: int, runs: int) -> dict[str, Any]:
    """Every column of one weights size, interleaved, `runs` times."""
    model = cluster.prepare(mib)
    cols = Columns(cluster, model, cpu, cluster.op_timeout)
    order: tuple[tuple[str, Callable[[str], dict[str, Any]]], ...] = (
        ("cold", cols.cold), ("same_node", cols.same_node), ("fan_out", cols.fan_out), ("cli", cols.cli),
        ("pod", cols.pod), ("throughput", cols.throughput))
    samples = []
    try:
        cluster.settle()
        for i in range(runs):
            row: dict[str, Any] = {"run": i + 1}
            for key, column in order:
                row[key] = column(f"{mib}m{i + 1}")
                cluster.settle()
            samples.append(row)
            f, t = row["fan_out"], row["throughput"]
            log(f"  {mib} MiB, run {i + 1}/{runs}, first answer: cold {row['cold']['answer_s']:.2f}s | same node "
                f"{row['same_node']['answer_s']:.2f}s | CLI {row['cli']['answer_s']:.2f}s (pull "
                f"{row['cli']['pull_s']:.2f}s) | Pod {row['pod']['answer_s']:.2f}s (RunPodSandbox "
                f"{row['pod']['sandbox_s']:.2f}s) | fan-out C {f['first']['answer_s']:.2f}s, B+D "
                + ("-" if f["two_answer_s"] is None else f"{f['two_answer_s']:.2f}s")
                + f" | GET {t['get']['s']:.2f}s, pull {t['pull']['s']:.2f}s, push {t['push']['s']:.2f}s")
    finally:
        cluster.drop(model)
    return {**model.record, "samples": samples}


def measure(cluster: Cluster) -> dict[str, Any]:
    """Every size in turn on the cluster (set up): the raw samples."""
    args = cluster.args
    timeout = min(600.0, 120.0 + max(args.sizes) * 0.4)
    for node in (cluster, *cluster.targets.values()):
        node.op_timeout = timeout
    out: dict[str, Any] = {"sizes": {}, "runs": args.runs, "connections": cluster.connections,
                           "nodes": {"a": cluster.b.name, **{n: x.b.name for n, x in cluster.targets.items()}}}
    cpu = CpuLog(watch=cluster.registry_cpu)
    cpu.start()
    try:
        for mib in args.sizes:
            out["sizes"][str(mib)] = one_size(cluster, cpu, mib, args.runs)
    finally:
        cpu.stop()
    return out


def main(args: argparse.Namespace) -> int:
    """bench/crossnode.py once its arguments are parsed."""
    cluster = Cluster(args)
    return standalone(args, cluster, lambda: run_facts(lambda: measure(cluster)), report.build, report.text,
                      lambda out: docs_with(crossnode=report.load(out)))
