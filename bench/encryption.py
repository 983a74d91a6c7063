#!/usr/bin/env python3
"""The cost of encryption at rest: the same checkpoints and restores with and without it, on one agent.

    .venv/bin/python bench/encryption.py [--runs 3] [--out bench/encryption.json] [--write-docs] [--keep]
                                         [--bed na-bench-enc] [--workdir DIR] [--mib 1024] [--repeat-mib 256]
                                         [--answer-mib 256] [--warmup 1] [--settle 1] [--quiet-wait 60]
                                         [--containerd PATH] [--note TEXT] [--docs-only]

As root. It brings up one test bed (scripts/testbed, --bed, default
na-bench-enc) and one agent whose config has an `encryption` section: a
keyring file with one key for the domain `benchteam`, which holds the
namespaces `bench` and `bench-r`. Pods in `bench` are therefore checkpointed
encrypted (AES-256-GCM, chunks and config blob) and restored into
`bench-r`; the same pods in `plain` (restored into `plain-r`) are in no
domain with a key and stay in the clear. The two variants differ only by
namespace: same agent, same store, same settings, same workload. In every
run the clear variant goes first, then the encrypted one (for the 1 GiB pod:
the clear checkpoint, its restore and its removal, then the same encrypted,
so no checkpoint directly follows another one), after untimed warm-up
rounds (--warmup), each round started once the machine is nearly
idle (waiting at most --quiet-wait seconds); every figure is the median
over --runs:

  * a memhog pod of --mib MiB (default 1024): the agent's checkpoint until it
    returns (durable), its frozen window from the ticker's CRI log (and the
    agent's frozen_ms), then the full `restore --start` of that checkpoint
    until running (bench/run.py's agent_checkpoint and agent_restore); each
    checkpoint is removed before the next one, so every one stores the
    whole workload;
  * the store bytes a repeated checkpoint of an unchanged memhog of
    --repeat-mib MiB (default 256) adds, the previous one still stored
    (bench/run.py's repeat measurement);
  * the first answer of a restored numpy model server with --answer-mib MiB
    of weights (default 256): the agent's Restore with start and no lazy
    option, until its first answer (bench/firstanswer.py's "default" column),
    each replica checked to be the checkpointed process.

Every checkpoint is checked from outside: `checkpoints inspect` must show the
key id for the encrypted variant and none for the clear one, and every blob
the checkpoint added to the store must start with the sealed-blob header
(`NAS2`) for the encrypted variant, but for its manifest (a JSON document,
never sealed); the clear variant adds no sealed blob. It prints the medians
and the ratios (encrypted / clear, limit 1.15x; repeated-checkpoint growth,
limit 5%), writes every raw sample to --out and, with --write-docs, regenerates
docs/benchmarks.md (bench/report.py adds an "Encryption" section from
--out). Everything it creates (pods, checkpoints, the bed unless --keep, its
work dir) is removed at the end, also on errors and on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import hashlib
import json
import os
import secrets
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import firstanswer, report  # noqa: E402
from bench.run import NOT_STORE, Bench, BenchError, SrcPod, log, write_docs  # noqa: E402
from testbed.bed import CONTAINERD2  # noqa: E402

DEFAULT_BED = "na-bench-enc"
DOMAIN = "benchteam"
KEY_ID = "bench-1"
VARIANTS = ("clear", "encrypted")
# Source and restore namespaces of each variant: only the encrypted ones are in the key domain.
NAMESPACES = {"clear": ("plain", "plain-r"), "encrypted": ("bench", "bench-r")}
SEALED_MAGIC = b"NAS2"  # node_agent.store.sealing.MAGIC: the first bytes of every blob sealed now
MAX_DOCUMENT_BYTES = 4 << 20
QUIET_CORES = 0.3  # busy cores (of two) below which the machine counts as quiet before a round


def _clock_ticks() -> int:
    try:
        return int(os.sysconf("SC_CLK_TCK"))
    except (ValueError, OSError):
        return 100


CLK_TCK = _clock_ticks()


def proc_times(pid: int) -> dict[str, float] | None:
    """A process's (all its threads') user and system CPU seconds and minor page faults, from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return {"user_s": int(fields[11]) / CLK_TCK, "sys_s": int(fields[12]) / CLK_TCK, "minflt": float(fields[7])}
    except (OSError, ValueError, IndexError):
        return None


def agent_usage(a: dict[str, float] | None, b: dict[str, float] | None) -> dict[str, Any]:
    """What the agent spent between two `proc_times`: CPU seconds (all, user, system) and minor faults."""
    if a is None or b is None:
        return {"agent_cpu_s": None, "agent_user_s": None, "agent_sys_s": None, "agent_minflt": None}
    user, sys_ = b["user_s"] - a["user_s"], b["sys_s"] - a["sys_s"]
    return {"agent_cpu_s": round(user + sys_, 3), "agent_user_s": round(user, 3), "agent_sys_s": round(sys_, 3),
            "agent_minflt": int(b["minflt"] - a["minflt"])}


def tree_digest(root: Path) -> str:
    """A digest of every Python file of the product (node_agent/, criu_bridge/) as the agent loaded it:
    the working tree changes under a long benchmark, and the commit alone does not say which code ran."""
    h = hashlib.sha256()
    for pkg in ("node_agent", "criu_bridge"):
        for path in sorted((root / pkg).rglob("*.py")):
            try:
                data = path.read_bytes()
            except OSError:
                continue
            h.update(str(path.relative_to(root)).encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()[:12]


def machine_cpu_seconds() -> float | None:
    """CPU time spent on the whole machine (all cores, not idle or waiting), in seconds, from /proc/stat."""
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal ...
    return (sum(fields[:3]) + sum(fields[5:8])) / CLK_TCK


def _delta(a: float | None, b: float | None) -> float | None:
    return round(b - a, 3) if a is not None and b is not None else None


def store_blobs(store: str) -> set[str]:
    """Paths of every file of the checkpoint store (not its scratch, plans, logs, ...)."""
    out: set[str] = set()
    for dirpath, dirs, files in os.walk(store):
        if dirpath == store:
            dirs[:] = [d for d in dirs if d not in NOT_STORE]
        out.update(os.path.join(dirpath, f) for f in files)
    return out


def _is_document(path: str, head: bytes) -> bool:
    """A store document (a checkpoint's OCI manifest): JSON with a mediaType, never sealed."""
    if not head.startswith(b"{"):
        return False
    try:
        with open(path, "rb") as fh:
            doc = json.loads(fh.read(MAX_DOCUMENT_BYTES + 1))
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and isinstance(doc.get("mediaType"), str)


def sealed_census(store: str, paths: set[str]) -> dict[str, int]:
    """The blobs among `paths` (files of the store's blobs/ directory): how many begin with the sealed-blob
    header, how many are store documents (manifests: JSON, not sealed), how many are neither, and their
    bytes."""
    blobs = os.path.join(store, "blobs") + os.sep
    out = {"sealed_blobs": 0, "sealed_bytes": 0, "documents": 0, "clear_blobs": 0, "clear_bytes": 0}
    for p in paths:
        if not p.startswith(blobs):
            continue
        try:
            n = os.path.getsize(p)
            with open(p, "rb") as fh:
                head = fh.read(len(SEALED_MAGIC))
        except OSError:
            continue
        if head == SEALED_MAGIC:
            out["sealed_blobs"] += 1
            out["sealed_bytes"] += n
        elif _is_document(p, head):
            out["documents"] += 1
        else:
            out["clear_blobs"] += 1
            out["clear_bytes"] += n
    return out


class AgentLog:
    """The agent's JSON log lines (log-format: json), read incrementally."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.pos = 0

    def since_mark(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.pos)
                data = fh.read()
        except OSError:
            return out
        end = data.rfind(b"\n") + 1
        self.pos += end
        for line in data[:end].splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict) and isinstance(doc.get("time"), str):
                try:
                    doc["t"] = datetime.datetime.strptime(doc["time"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(
                        tzinfo=datetime.timezone.utc).timestamp()
                except ValueError:
                    continue
                out.append(doc)
        return out

    def mark(self) -> None:
        self.since_mark()


class EncryptionBench(Bench):
    """bench/run.py's Bench on an agent with an encryption section; the variants differ only by namespace."""

    def _quiet_agent(self) -> None:
        super()._quiet_agent()
        ring = self.work / "keyring.json"
        doc = {"domains": {DOMAIN: [{"id": KEY_ID, "key": base64.b64encode(secrets.token_bytes(32)).decode()}]}}
        fd = os.open(ring, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(doc, fh)
        members = ", ".join(NAMESPACES["encrypted"])
        cfg = Path(self.b.config)
        cfg.write_text(cfg.read_text() + "log-format: json\n"
                       f"encryption:\n  key-sources:\n    - file: {ring}\n  domains:\n    {DOMAIN}: [{members}]\n")


class Encryption:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.bench = EncryptionBench(args)
        self.results: dict[str, Any] = {}
        self.alog: AgentLog | None = None
        self.checks: dict[str, Any] = {"checkpoints": []}

    @property
    def b(self) -> Any:
        return self.bench.b

    # ---- outside checks ---------------------------------------------------------

    def verify(self, variant: str, ckpt: str, added: set[str], what: str) -> dict[str, Any]:
        """The checkpoint is sealed under the key (encrypted) or not at all (clear), by inspect and on disk."""
        cp, _, _, _ = self.bench.cli("checkpoints", "inspect", ckpt, "-o", "json", timeout=120)
        info = json.loads(cp.stdout)
        key_id = str(info.get("key_id") or "")
        census = sealed_census(self.bench.store, added)
        want = KEY_ID if variant == "encrypted" else ""
        if key_id != want:
            raise BenchError(f"{what}: checkpoint {ckpt[:19]} has key_id {key_id!r}, want {want!r}")
        if variant == "encrypted" and census["clear_blobs"]:
            raise BenchError(f"{what}: encrypted checkpoint {ckpt[:19]} added {census['clear_blobs']} blobs "
                             f"({census['clear_bytes']} bytes) that are neither sealed nor a manifest, and "
                             f"{census['sealed_blobs']} sealed ones")
        if variant == "clear" and census["sealed_blobs"]:
            raise BenchError(f"{what}: clear checkpoint {ckpt[:19]} added {census['sealed_blobs']} sealed blobs")
        row = {"what": what, "variant": variant, "id": ckpt, "key_id": key_id, "locked": bool(info.get("locked")),
               **census}
        self.checks["checkpoints"].append(row)
        return row

    def quiet(self, what: str) -> None:
        """Before a round: wait (at most --quiet-wait seconds) until the machine is nearly idle, since
        other work on two cores shows in every figure; what was waited and seen is recorded."""
        deadline = time.monotonic() + self.args.quiet_wait
        t0 = time.monotonic()
        busy: float | None = None
        while True:
            a = machine_cpu_seconds()
            time.sleep(0.5)
            b = machine_cpu_seconds()
            busy = None if a is None or b is None else (b - a) / 0.5
            if busy is None or busy <= QUIET_CORES or time.monotonic() > deadline:
                break
            time.sleep(2)
        waited = round(time.monotonic() - t0, 1)
        self.results.setdefault("quiet", []).append({"before": what, "waited_s": waited,
                                                     "busy_cores": None if busy is None else round(busy, 2)})
        if waited > 5:
            log(f"  waited {waited:.0f}s for a quiet machine before {what} (busy {busy:.2f} cores)"
                if busy is not None else f"  waited {waited:.0f}s before {what}")

    # ---- one checkpoint / restore, with the agent's CPU and log around it ---------

    def checkpoint(self, variant: str, pod: SrcPod, what: str) -> dict[str, Any]:
        pid = self.bench.agent_pid()
        before = store_blobs(self.bench.store)
        assert self.alog is not None
        self.alog.mark()
        c0, m0 = proc_times(pid), machine_cpu_seconds()
        a = self.bench.agent_checkpoint(pod)
        c1, m1 = proc_times(pid), machine_cpu_seconds()
        lines = self.alog.since_mark()
        a.update(agent_usage(c0, c1))
        a["machine_cpu_s"] = _delta(m0, m1)
        a.update(self._checkpoint_phases(lines, a))
        a["check"] = self.verify(variant, a["id"], store_blobs(self.bench.store) - before, what)
        if variant == "encrypted" and not a["check"]["sealed_blobs"]:
            raise BenchError(f"{what}: encrypted checkpoint {a['id'][:19]} added no sealed blobs")
        return a

    @staticmethod
    def _checkpoint_phases(lines: list[dict[str, Any]], a: dict[str, Any]) -> dict[str, Any]:
        """From the agent's log: the call until the thaw (pre-dump, freeze and dump), and from the thaw until
        the checkpoint is published (the ingest into the store), in seconds."""
        thaw = next((x["t"] for x in lines if x.get("phase") == "thaw"), None)
        pub = next((x["t"] for x in lines if x.get("phase") == "publish" and x.get("checkpoint") == a["id"]), None)
        out: dict[str, Any] = {"log_thaw_s": None, "log_ingest_s": None}
        if thaw is not None:
            out["log_thaw_s"] = round(thaw - a["start"], 3)
            if pub is not None:
                out["log_ingest_s"] = round(pub - thaw, 3)
        return out

    def restore(self, variant: str, ckpt: str, label: str) -> dict[str, Any]:
        pid = self.bench.agent_pid()
        c0 = proc_times(pid)
        r = self.bench.agent_restore(ckpt, label, namespace=NAMESPACES[variant][1])
        r.update(agent_usage(c0, proc_times(pid)))
        # The part before StartContainer: verification, the sandbox, the plan read from the store.
        r["before_start_s"] = round(r["wall_s"] - r["start_ms"] / 1000, 4) if r.get("start_ms") is not None else None
        return r

    # ---- the three workloads -------------------------------------------------------

    def big(self) -> None:
        mib, runs = self.args.mib, self.args.runs
        log(f"{mib} MiB memhog, clear and encrypted: {self.args.warmup} untimed + {runs} interleaved runs "
            "of checkpoint (durable, frozen window) and full restore --start")
        pods = {v: self.bench.new_pod(f"enc-{v[:5]}", mib, ["hog"], namespace=NAMESPACES[v][0]) for v in VARIANTS}
        ckpts: list[dict[str, Any]] = []
        rests: list[dict[str, Any]] = []
        warm_c: list[dict[str, Any]] = []
        warm_r: list[dict[str, Any]] = []
        try:
            for i in range(-self.args.warmup, runs):
                label = f"w{-i}" if i < 0 else str(i + 1)
                self.quiet(f"{mib} MiB run {label}")
                c: dict[str, Any] = {}
                r: dict[str, Any] = {}
                # Each variant's checkpoint, its restore and its removal, then the other's: every checkpoint
                # follows the same steps (the other variant's restore and removal), never a checkpoint. On the
                # 2-core VM this was built on, the second of two 1 GiB checkpoints in a row took about 1 s
                # longer, all of it system time in the agent with the same syscalls and bytes, whichever
                # variant went second (encrypted first 2.16-2.28 s, clear second 2.76-2.93 s; clear first
                # 1.87-1.92 s, encrypted second 2.70-2.85 s): back to back, the order hid encryption's cost.
                # Which goes first alternates, and each checkpoint starts with the page cache written back
                # (sync, then a quiet machine): a checkpoint that follows another one's gigabyte of writes
                # pays for their writeback.
                for v in (VARIANTS if i % 2 == 0 else tuple(reversed(VARIANTS))):
                    os.sync()
                    self.quiet(f"{mib} MiB run {label}, {v}")
                    c[v] = self.checkpoint(v, pods[v], f"{mib} MiB run {label}")
                    self.bench.settle()
                    os.sync()
                    self.quiet(f"{mib} MiB restore {label}, {v}")
                    r[v] = self.restore(v, c[v]["id"], f"{v[:1]}{label}")
                    self.bench.settle()
                    self.bench.remove_checkpoint(c[v]["id"])
                    self.bench.settle()
                if i < 0:
                    warm_c.append({"run": label, **c})
                    warm_r.append({"run": label, **r})
                    continue
                ckpts.append({"run": i + 1, **c})
                rests.append({"run": i + 1, **r})
                log(f"  run {i + 1}/{runs}: " + " | ".join(
                    f"{v}: checkpoint {c[v]['wall_s']:.2f}s (ingest {c[v]['log_ingest_s']}s, agent CPU "
                    f"{c[v]['agent_cpu_s']}s) frozen {c[v]['frozen_reported_ms']:.0f}/{c[v]['frozen_outside_ms']:.0f} ms, "
                    f"restore {r[v]['wall_s']:.2f}s (StartContainer {r[v]['start_ms']} ms)" for v in VARIANTS))
        finally:
            for pod in pods.values():
                self.bench.remove_pod(pod.id)
        self.results.update(mib=mib, checkpoint=ckpts, restore=rests)
        self.results["warmup"].update(checkpoint=warm_c, restore=warm_r)

    def repeat(self) -> None:
        mib, runs = self.args.repeat_mib, self.args.runs
        log(f"{mib} MiB memhog, unchanged, clear and encrypted: a first checkpoint each, then {runs} interleaved repeats")
        pods = {v: self.bench.new_pod(f"steady-{v[:5]}", mib, ["hog"], flip=False, namespace=NAMESPACES[v][0])
                for v in VARIANTS}
        ids: dict[str, list[str]] = {v: [] for v in VARIANTS}
        first: dict[str, Any] = {}
        samples: list[dict[str, Any]] = []
        try:
            for i in range(runs + 1):
                self.quiet(f"repeat {i}")
                row: dict[str, Any] = {}
                for v in VARIANTS:
                    before = store_blobs(self.bench.store)
                    before_bytes = sum(os.path.getsize(p) for p in before if os.path.exists(p))
                    cp, wall, _, _ = self.bench.cli("checkpoint", pods[v].id, "-o", "json")
                    info = json.loads(cp.stdout)
                    self.bench.checkpoints.append(info["id"])
                    ids[v].append(info["id"])
                    after = store_blobs(self.bench.store)
                    added = sum(os.path.getsize(p) for p in after if os.path.exists(p)) - before_bytes
                    row[v] = {"id": info["id"], "added_bytes": added, "size": int(info.get("size", 0)),
                              "stored_size": int(info.get("stored_size", 0)), "wall_s": round(wall, 4),
                              "frozen_reported_ms": float(info.get("frozen_ms", 0.0)),
                              "check": self.verify(v, info["id"], after - before, f"repeat {i}")}
                    if len(ids[v]) > 2:  # the previous one stays stored, the one before goes
                        self.bench.remove_checkpoint(ids[v][-3])
                    self.bench.settle()
                if i == 0:
                    first = row
                else:
                    samples.append({"run": i, **row})
                log(f"  checkpoint {i}: " + " | ".join(f"{v} +{row[v]['added_bytes'] / 1048576:.1f} MiB" for v in VARIANTS))
        finally:
            for v in VARIANTS:
                for ckpt in ids[v]:
                    if ckpt in self.bench.checkpoints:
                        self.bench.remove_checkpoint(ckpt)
            for pod in pods.values():
                self.bench.remove_pod(pod.id)
        self.results["repeat"] = {"mib": mib, "first": first, "samples": samples}

    def answer(self) -> None:
        runs = self.args.runs
        fa = firstanswer.FirstAnswer(self.bench)
        image = firstanswer.model_image(self.b.info)
        if image is None:
            raise BenchError(f"the test bed has no model server image (images: {', '.join(self.b.info.get('images', {}))})")
        timeout = self.bench.op_timeout
        ckpts: dict[str, str] = {}
        refs: dict[str, dict[str, Any]] = {}
        out: dict[str, Any] = {"image": image, "x": firstanswer.X}
        try:
            for v in VARIANTS:
                pod_id, _, ref, _ = fa.source(image, timeout, namespace=NAMESPACES[v][0])
                before = store_blobs(self.bench.store)
                try:
                    cp, _, _, _ = self.bench.cli("checkpoint", pod_id, "-o", "json", "--timeout", str(timeout - 10))
                    ckpts[v] = json.loads(cp.stdout)["id"]
                    self.bench.checkpoints.append(ckpts[v])
                finally:
                    self.bench.remove_pod(pod_id)  # the replicas answer for it from here on
                self.verify(v, ckpts[v], store_blobs(self.bench.store) - before, "model server")
                refs[v] = ref
                self.bench.settle()
            mib = int(refs["clear"]["weights_bytes"]) >> 20
            out.update(mib=mib, weights_bytes=refs["clear"]["weights_bytes"], source=refs, checkpoints=ckpts)
            log(f"model server, {mib} MiB of weights, clear and encrypted: {self.args.warmup} untimed + {runs} "
                "interleaved runs of the default restore until the first answer")
            samples: list[dict[str, Any]] = []
            warmups: list[dict[str, Any]] = []
            for i in range(-self.args.warmup, runs):
                label = f"w{-i}" if i < 0 else str(i + 1)
                self.quiet(f"first answer run {label}")
                row: dict[str, Any] = {}
                for v in VARIANTS:
                    x = fa.agent(ckpts[v], "default", refs[v], f"a{v[:1]}{label}", timeout, namespace=NAMESPACES[v][1])
                    x.pop("body", None)
                    row[v] = x
                    self.bench.settle()
                if i < 0:
                    warmups.append({"run": label, **row})
                    continue
                samples.append({"run": i + 1, **row})
                log(f"  first answer {i + 1}/{runs}: " + " | ".join(
                    f"{v}: running {row[v]['running_s']:.2f}s, answer {row[v]['answer_s']:.2f}s"
                    + (" (lazy" + (f", all in {row[v]['all_in_s']:.2f}s)" if "all_in_s" in row[v] else ")")
                       if row[v].get("lazy") else " (full)") for v in VARIANTS))
            out["samples"] = samples
            self.results["warmup"]["answer"] = warmups
        finally:
            for ckpt in ckpts.values():
                if ckpt in self.bench.checkpoints:
                    self.bench.remove_checkpoint(ckpt)
        self.results["answer"] = out

    def run(self) -> dict[str, Any]:
        self.results = {"warmup": {}, "namespaces": NAMESPACES, "key_id": KEY_ID, "domain": DOMAIN}
        self.bench.op_timeout = min(600.0, 120.0 + max(self.args.mib, self.args.answer_mib) * 0.4)
        self.alog = AgentLog(self.b.agent_log)
        started = time.time()
        self.results["loadavg"] = {"start": [round(x, 2) for x in os.getloadavg()]}
        self.big()
        self.repeat()
        self.answer()
        self.results["checks"] = self.checks
        self.results["loadavg"]["end"] = [round(x, 2) for x in os.getloadavg()]
        self.results["elapsed_s"] = round(time.time() - started, 1)
        return self.results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench/encryption.py", description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=3, help="interleaved runs of each measurement (default 3)")
    ap.add_argument("--out", default=str(report.ENCRYPTION_JSON), help="JSON with every raw sample")
    ap.add_argument("--write-docs", action="store_true",
                    help="regenerate docs/benchmarks.md (its Encryption section from --out, the rest from "
                         "bench/results.json)")
    ap.add_argument("--docs-only", action="store_true", help="measure nothing: regenerate docs/benchmarks.md")
    ap.add_argument("--keep", action="store_true", help="leave the test bed (and the store) in place")
    ap.add_argument("--bed", default=DEFAULT_BED, help=f"test bed name (default {DEFAULT_BED})")
    ap.add_argument("--workdir", help="agent config, keyring, store and scratch (default /var/lib/node-agent-bench/BED)")
    ap.add_argument("--containerd", default=CONTAINERD2, help=f"the test bed's containerd binary (default {CONTAINERD2})")
    ap.add_argument("--mib", type=int, default=1024, help="MiB of the memhog pod checkpointed and restored (default 1024)")
    ap.add_argument("--repeat-mib", type=int, default=256,
                    help="MiB of the unchanged memhog checkpointed repeatedly (default 256)")
    ap.add_argument("--answer-mib", type=int, default=256,
                    help="MiB of the model server's weights (the bed's image; default 256)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds before the runs (default 1)")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds of quiet between operations (default 1)")
    ap.add_argument("--quiet-wait", type=float, default=60.0,
                    help="before each round, wait at most this many seconds for a nearly idle machine (default 60; "
                         "0: do not wait)")
    ap.add_argument("--note", default="", help="a line for docs/benchmarks.md about the conditions of this run")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.warmup < 0 or min(args.mib, args.repeat_mib, args.answer_mib) < 1:
        ap.error("--runs and the sizes must be positive, --warmup not negative")
    if not args.docs_only and not os.access(args.containerd, os.X_OK):
        ap.error(f"--containerd {args.containerd}: not an executable (scripts/install-host installs it)")
    # What bench/run.py's Bench reads: its own bed, the model image's size, no attached agent.
    args.attach = None
    args.agent_pid = None
    args.answer_sizes = [args.answer_mib]
    return args


def docs(out: Path) -> int:
    merged = report.load(REPO / "bench" / "results.json")
    if merged is None:
        log("bench/results.json holds no results of bench/run.py: docs/benchmarks.md not written")
        return 1
    if out.resolve() != report.ENCRYPTION_JSON.resolve():
        log(f"note: docs/benchmarks.md's Encryption section is rendered from {report.ENCRYPTION_JSON}, not {out}")
    write_docs(merged)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.docs_only:
        return docs(out)
    if os.geteuid() != 0:
        print("bench: needs root (it runs a private containerd)", file=sys.stderr)
        return 2

    def stop(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    machine = report.machine_info(REPO)
    enc = Encryption(args)
    rc = 0
    results: dict[str, Any] = {}
    try:
        machine["node_agent_tree"] = tree_digest(REPO)
        enc.bench.setup()
        machine.update(report.bed_info(enc.b.info))
        log(f"containerd {machine['containerd']}, runc {machine['runc']}; encrypted: namespaces "
            f"{', '.join(NAMESPACES['encrypted'])} (key domain {DOMAIN}, key {KEY_ID}); clear: "
            f"{', '.join(NAMESPACES['clear'])}")
        results = enc.run()
    except KeyboardInterrupt:
        log("interrupted; cleaning up")
        rc = 130
    except (BenchError, firstanswer.AnswerError, TimeoutError) as exc:
        log(f"error: {exc}")
        rc = 1
    except Exception:  # noqa: BLE001 - reported, then cleaned up
        log("error:\n" + traceback.format_exc().rstrip())
        rc = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if rc == 1 and enc.bench.bed is not None:
            tail = enc.bench.b.tail_log(15)
            if tail:
                log("the agent's last log lines:\n" + tail.rstrip())
        enc.bench.cleanup()
    if rc != 0:
        return rc
    doc = report.encryption_build(args, machine, results)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, out)
    sys.stdout.write(report.encryption_text(doc))
    log(f"raw samples: {out}")
    if args.write_docs:
        return docs(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
