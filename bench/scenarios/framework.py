"""A framework's model server: its time to first answer, and how fast restored memory moves against its bound.

One test bed with the torch image (scripts/testbed up --images pause,memhog,debian,torch), the Debian image's
numpy model server at --mib MiB of weights, and memhog.

  * first answer (the torch server, tests' and docs/testbed.md's `torchserver`: torch imported, 512 MiB of
    weights loaded from the image into 128 layers, traced, warmed up): the source pod is checkpointed once;
    then, interleaved in every run, a cold start (a new pod from the image), the agent's default restore
    and `--full`, each first with the page cache emptied (every file of the bed's containerd root and of
    the store dropped after a sync) and then warm (the store read just before; the image's files as the
    emptied paths left them). Timed
    as firstanswer.py times them: from the first request (RunPodSandbox, or the agent's Restore over an
    open connection; the CLI's start-up not included) to the first correct `GET /predict`. Every answer is
    checked: a replica is the checkpointed process by its own account and answers as it did.
  * transfer rate, for the torch server, the numpy server and memhog (--mib MiB): the bytes of process
    memory in the checkpoint (its pages files) over the time from the restore call until every page is in
    (the default restore: until the page source says so; `--full`: until the call returns, since then the
    memory is in), warm page cache. Against a bound measured in the same run: one pass over the same
    chunks (unencrypted, from the page cache) by two threads, each chunk read, checked against its sha256,
    decoded and copied into an anonymous mapping at its place, as a page source would at best.

bench/framework.py is its command line, bench/report/framework.py its figures, targets and tables.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from bench.harness.base import NOT_STORE, BenchError, log
from bench.harness.main import docs_with, run_facts, standalone
from bench.harness.measure import evict, proc_status, warm
from bench.harness.ops import Bench
from bench.report import framework as report
from bench.scenarios.crossnode_paths import CpuLog, Marked
from bench.scenarios.firstanswer import MODEL, PORT, Server, model_image
from node_agent.store import Store
from node_agent.store.documents import FileEntry

DEFAULT_BED = "na-framework"
IMAGES = "pause,memhog,debian,torch"
TORCH = Server(
    "torch", ["/usr/local/bin/torchserver", "--weights", "/opt/torchmodel/weights.npy", "--port", str(PORT)],
    None,
    re.compile(r"imported in (?P<import_s>[0-9.]+)s, .*loaded in (?P<load_s>[0-9.]+)s, trace "
               r"(?P<trace_s>[0-9.]+)s, warm-up (?P<warmup_s>[0-9.]+)s, .*serving on :\d+ (?P<ready_s>[0-9.]+)s "
               r"after start"))


class FrameworkError(BenchError):
    """A failure of the framework runs, reported as one line."""


PAGES_RE = re.compile(r"^pages-\d+\.img$")
CACHES = ("emptied", "warm")  # in this order in every round: see Framework._cache
PATHS = ("cold", "default", "full")


def pages_entries(store: Store, ckpt: str) -> list[FileEntry]:
    """The checkpoint's process memory: its pages files (each CRIU image dir's pages-N.img)."""
    return [e for e in store.get(ckpt).files if PAGES_RE.match(os.path.basename(e.path))]


def transfer_bound(store_root: str, ckpt: str, threads: int = 2) -> dict[str, Any]:
    """One pass over the checkpoint's memory chunks by `threads` threads, from the page cache: each chunk read,
    verified, decoded and copied to its place in an anonymous mapping of the memory's size."""
    store = Store(store_root)
    entries = pages_entries(store, ckpt)
    total = sum(e.size for e in entries)
    jobs: list[tuple[int, Any]] = []
    base = 0
    for e in entries:
        jobs += [(base + c.offset, c) for c in e.chunks]
        base += e.size
    warm(store_root, NOT_STORE)
    area = mmap.mmap(-1, max(total, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    anchor = ctypes.c_char.from_buffer(area)
    try:
        addr = ctypes.addressof(anchor)

        def lane(mine: list[tuple[int, Any]]) -> int:
            n = 0
            for off, chunk in mine:
                data = store.chunks.read_chunk(chunk)
                ctypes.memmove(addr + off, data, len(data))
                n += len(data)
            return n

        t = time.monotonic()
        with ThreadPoolExecutor(threads) as pool:
            moved = sum(pool.map(lane, [jobs[i::threads] for i in range(threads)]))
        end = time.monotonic()
        seconds = end - t
    finally:
        del anchor
        area.close()
    if moved != total:
        raise FrameworkError(f"the bound moved {moved} bytes of {total}")
    return {"bytes": total, "chunks": len(jobs), "s": round(seconds, 4), "threads": threads, "span": (t, end)}


class Framework:
    def __init__(self, bench: Bench, cpu: CpuLog) -> None:
        self.bench = bench
        self.timeout = bench.op_timeout
        self.cpu = cpu

    def _restore(self, fa: Marked, ckpt: str, path: str, ref: dict[str, Any] | None, tag: str,
                 **kw: Any) -> dict[str, Any]:
        """fa.agent's restore, with the machine's CPU busy share from the call until every page is in."""
        x = fa.agent(ckpt, path, ref, tag, self.timeout, **kw)
        took = x.get("all_in_s") or x.get("answer_s") or x["running_s"]
        x["cpu_busy"] = self.cpu.span(fa.opened, fa.opened + took)["cpu_busy"]
        return x

    def _cache(self, state: str) -> None:
        """The page cache as `state` says. Emptied: every file of the bed's containerd root (image content and
        snapshots) and of the store dropped. Warm: the store read; the image's files are in the cache from
        the paths just before (the emptied ones of the same round read what they use), as on a node that
        ran the image a moment ago. Reading the whole containerd root instead would fill memory with other
        images and make the next allocation reclaim it."""
        if state == "warm":
            warm(self.bench.store, NOT_STORE)
        else:
            evict([os.path.join(self.bench.b.info["base"], "root"), self.bench.store])

    def _checkpoint(self, pod_id: str) -> tuple[str, int]:
        cp, _, _, _ = self.bench.cli("checkpoint", pod_id, "-o", "json", "--timeout", str(self.timeout - 10))
        ckpt = str(json.loads(cp.stdout)["id"])
        self.bench.checkpoints.append(ckpt)
        memory = sum(e.size for e in pages_entries(Store(self.bench.store), ckpt))
        return ckpt, memory

    def _rounds(self, ckpt: str, one_round: Callable[[str], dict[str, Any]], prefix: str, runs: int, warmup: int,
                line: Callable[[dict[str, Any]], str], out: dict[str, Any]) -> dict[str, Any]:
        """`warmup` untimed rounds, then `runs` rounds of `one_round` (each ending with the bound), into `out`;
        a line each (`line`); the checkpoint removed at the end."""
        try:
            def with_bound(label: str) -> dict[str, Any]:
                r = one_round(label)
                r["bound"] = transfer_bound(self.bench.store, ckpt)
                r["bound"]["cpu_busy"] = self.cpu.span(*r["bound"].pop("span"))["cpu_busy"]
                return r

            out["warmup"] = [with_bound(f"{prefix}w{i + 1}") for i in range(warmup)]
            out["samples"] = []
            for i in range(runs):
                r = with_bound(f"{prefix}{i + 1}")
                out["samples"].append({"run": i + 1, **r})
                log(f"  run {i + 1}/{runs}: {line(r)} | bound {r['bound']['s']:.2f}s")
        finally:
            self.bench.remove_checkpoint(ckpt)
        return out

    def torch(self, runs: int, warmup: int) -> dict[str, Any]:
        """The torch server's first-answer rounds, and its transfer rate."""
        fa = Marked(self.bench, TORCH)
        image = self.bench.b.info["images"]["torch"]
        pod_id, _, ref, cid = fa.source(image, self.timeout)
        pid = self.bench.cri(lambda cri: cri.container_status(cid)).pid
        out: dict[str, Any] = {"source": ref, "rss_kib": proc_status(pid, "VmRSS")}
        ckpt, out["memory_bytes"] = self._checkpoint(pod_id)
        self.bench.remove_pod(pod_id)

        def one_round(label: str) -> dict[str, Any]:
            r: dict[str, Any] = {}
            for cache in CACHES:
                for path in PATHS:
                    self._cache(cache)
                    tag = f"{label}{cache[0]}{path[0]}"
                    if path == "cold":
                        x = fa.cold(image, ref, tag, self.timeout)
                    else:
                        x = self._restore(fa, ckpt, path, ref, tag, warm_store=False)
                    x.pop("body", None)
                    r[f"{path}_{cache}"] = x
                    self.bench.settle()
            return r

        def line(r: dict[str, Any]) -> str:
            return "torch server, first answer: " + " | ".join(
                f"{c}: cold {r[f'cold_{c}']['answer_s']:.2f}s, default {r[f'default_{c}']['answer_s']:.2f}s "
                f"(all in {r[f'default_{c}'].get('all_in_s', 0):.2f}s), full {r[f'full_{c}']['answer_s']:.2f}s"
                for c in CACHES)

        return self._rounds(ckpt, one_round, "t", runs, warmup, line, out)

    def transfer(self, kind: str, runs: int, warmup: int, mib: int) -> dict[str, Any]:
        """The numpy model server (`kind` "numpy") or memhog ("memhog") of `mib` MiB: default and full restores,
        warm, against the bound."""
        if kind == "numpy":
            fa = Marked(self.bench, MODEL)
            image = model_image(self.bench.b.info)
            if image is None:
                raise FrameworkError("the bed has no model server image")
            pod_id, _, ref, _ = fa.source(image, self.timeout)
            ref_: dict[str, Any] | None = ref
        else:
            fa = Marked(self.bench)
            pod_id = self.bench.new_pod("hog", mib, ["hog"]).id
            ref_ = None
        out: dict[str, Any] = {"kind": kind, "mib": mib}
        ckpt, out["memory_bytes"] = self._checkpoint(pod_id)
        self.bench.remove_pod(pod_id)

        def one_round(label: str) -> dict[str, Any]:
            r: dict[str, Any] = {}
            for path in ("default", "full"):
                x = self._restore(fa, ckpt, path, ref_, f"{label}{path[0]}", keep=ref_ is None)
                if ref_ is None:  # memhog answers nothing: its ticks going on say it runs
                    try:
                        self.bench.check_running(x["container_id"])
                    finally:
                        self.bench.remove_pod(_pod_of(self.bench, x["container_id"]))
                x.pop("body", None)
                r[path] = x
                self.bench.settle()
            return r

        def line(r: dict[str, Any]) -> str:
            return (f"{kind} {mib} MiB: default all in {r['default'].get('all_in_s', 0):.2f}s, "
                    f"full running {r['full']['running_s']:.2f}s")

        return self._rounds(ckpt, one_round, kind[0], runs, warmup, line, out)


def _pod_of(bench: Bench, cid: str) -> str:
    return str(bench.cri(lambda cri: cri.container_status(cid)).container.pod_id)


def measure(bench: Bench) -> dict[str, Any]:
    """The torch server's rounds, then the numpy server's and memhog's transfer (the bed set up)."""
    args = bench.args
    bench.op_timeout = min(600.0, 120.0 + args.mib * 0.4)
    out: dict[str, Any] = {"runs": args.runs, "mib": args.mib}
    log(f"torch server: {args.runs} interleaved runs of cold / default / full, page cache warm and emptied")
    cpu = CpuLog()
    cpu.start()
    try:
        out["torch"] = Framework(bench, cpu).torch(args.runs, args.warmup)
        for kind in ("numpy", "memhog"):
            log(f"{kind}, {args.mib} MiB: {args.runs} runs of default and full restores against the bound")
            out[kind] = Framework(bench, cpu).transfer(kind, args.runs, args.warmup, args.mib)
    finally:
        cpu.stop()
    return out


def main(args: argparse.Namespace) -> int:
    """bench/framework.py once its arguments are parsed."""
    bench = Bench(args)
    return standalone(args, bench, lambda: run_facts(lambda: measure(bench)), report.build, report.text,
                      lambda out: docs_with(framework=report.load(out)))
