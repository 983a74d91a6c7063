"""Encryption at rest: the same checkpoints and restores with it and without it, on one agent.

One agent whose config has an `encryption` section: a keyring file with one
key for the domain `benchteam`, which holds the namespaces `bench` and
`bench-r`. The two variants differ only by namespace. Three measurements:
a big memhog's checkpoint and full restore, the store growth of a repeated
checkpoint of an unchanged memhog, and a model server's first answer after
the default restore; every checkpoint checked from outside (its key id, and
the sealed-blob header of every blob it added). bench/encryption.py is its
command line; docs/benchmarks.md says how each figure is measured.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness.base import BenchError, log
from bench.harness.env import SrcPod
from bench.harness.machine import REPO, machine_info, tree_digest
from bench.harness.main import guarded, not_root, write_docs, write_json
from bench.harness.measure import agent_usage, delta, machine_cpu_seconds, proc_times, store_blobs
from bench.harness.ops import Bench
from bench.report import encryption as report
from bench.report import results
from bench.report.results import ENCRYPTION_JSON
from bench.scenarios import firstanswer

DEFAULT_BED = "na-bench-enc"
DOMAIN = "benchteam"
KEY_ID = "bench-1"
VARIANTS = ("clear", "encrypted")
# Source and restore namespaces of each variant: only the encrypted ones are in the key domain.
NAMESPACES = {"clear": ("plain", "plain-r"), "encrypted": ("bench", "bench-r")}
SEALED_MAGIC = b"NAS2"  # node_agent.store.sealing.MAGIC: the first bytes of every blob sealed now
MAX_DOCUMENT_BYTES = 4 << 20
QUIET_CORES = 0.3  # busy cores (of two) below which the machine counts as quiet before a round


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
    """The harness's Bench on an agent with an encryption section; the variants differ only by namespace."""

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
    """The three measurements, clear and encrypted interleaved, with the outside checks of every checkpoint."""

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
        a["machine_cpu_s"] = delta(m0, m1)
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


def docs(out: Path) -> int:
    """docs/benchmarks.md from the results files (its encryption block from bench/encryption.json)."""
    merged = results.load(results.RESULTS_JSON)
    if merged is None:
        log("bench/results.json holds no results of bench/run.py: docs/benchmarks.md not written")
        return 1
    if out.resolve() != ENCRYPTION_JSON.resolve():
        log(f"note: docs/benchmarks.md's Encryption section is rendered from {ENCRYPTION_JSON}, not {out}")
    write_docs(merged)
    return 0


def main(args: argparse.Namespace) -> int:
    """bench/encryption.py once its arguments are parsed."""
    out = Path(args.out)
    if args.docs_only:
        return docs(out)
    refused = not_root()
    if refused is not None:
        return refused
    machine = machine_info(REPO)
    enc = Encryption(args)

    def before() -> None:
        machine["node_agent_tree"] = tree_digest(REPO)

    def announce() -> None:
        log(f"containerd {machine['containerd']}, runc {machine['runc']}; encrypted: namespaces "
            f"{', '.join(NAMESPACES['encrypted'])} (key domain {DOMAIN}, key {KEY_ID}); clear: "
            f"{', '.join(NAMESPACES['clear'])}")

    rc, samples = guarded(enc.bench, machine, enc.run, before=before, announce=announce, agent_log_on_error=True)
    if rc != 0:
        return rc
    doc = report.build(args, machine, samples)
    write_json(out, doc)
    sys.stdout.write(report.text(doc))
    log(f"raw samples: {out}")
    if args.write_docs:
        return docs(out)
    return 0
