"""Time to first answer: a model server's replica, from the restore request to its first answer.

The workload is the Debian test image's model server
(scripts/testbed_images/modelserver.py): a threaded HTTP server holding
N MiB of seeded random float32 weights (the image's /opt/model/weights.npy,
`scripts/testbed up --model-mib N`), every answer a pass over all of them,
and a 16 MiB cache file held open in the pod's /dev/shm. Each size is one
source pod, checkpointed once by the agent; then, interleaved in every run:

  * cold: a new pod running the server from its image (RunPodSandbox,
    CreateContainer, StartContainer with the node's default runtime; the
    server then loads its weights and runs its warm-up pass);
  * local plan: the restore plan the agent writes for that checkpoint,
    copied once to a local directory, handed to the agent's runtime handler
    by plain CRI calls (RunPodSandbox, the pod's /dev/shm copied in,
    CreateContainer, the plan renamed into place, StartContainer): `runc
    restore` from local disk, with no store read and no verification;
  * default: the agent's Restore with start and no lazy option, what
    `node-agent restore ID --start` asks for (lazy where CRIU and the kernel
    allow it);
  * full: the same with lazy=false (`--full`).

Every column is timed from one point: the moment the request leaves the
bench process for its first hop, with every connection (the CRI socket, the
agent's local socket) already open: the agent's Restore call goes over its
local socket as the CLI sends it (node_agent.cli.client), so the CLI's own
start-up is not included; it is measured separately and reported beside the
table. "Running" is until the call (StartContainer for the CRI paths)
returns; "first answer" until the first `GET /predict` to the new pod's IP
(PodSandboxStatus, asked once the call has returned, by every path alike)
returns 200. Every answer is checked: a restored replica must be the
checkpointed process by its own account (same `started`, pid, weights
digest, request count going on) and give the source's answer for the same x.

At the smallest size, N replicas (default 10) are then restored one after
another with the agent's default and all kept running until the last one
has answered.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from bench.harness.base import NOT_STORE, NS_RESTORE, NS_SRC, BenchError, log, wait_until
from bench.harness.measure import warm
from bench.harness.ops import Bench
from bench.report.stats import median
from node_agent import devshm
from node_agent.cli.client import Client, pb
from node_agent.cri import CriClient
from node_agent.lazy.source import DONE_FILE, FAILED_FILE
from testbed.bed import NODE_AGENT, container_config, pod_config

PORT = 8080
SHM_MIB = 16
WEIGHTS = "/opt/model/weights.npy"
MODEL_CMD = ["/usr/local/bin/modelserver", "--weights", WEIGHTS, "--port", str(PORT), "--shm-mib", str(SHM_MIB)]
X = 7.0  # the x of every first request
NS_COLD = "bench"
# The image kinds of scripts/testbed that carry the model server, in order of preference.
IMAGE_KINDS = ("model", "debian")
READY_RE = re.compile(r"weights loaded in (?P<load_s>[0-9.]+)s.*warm-up (?P<warmup_s>[0-9.]+)s.*"
                      r"serving on :\d+ (?P<ready_s>[0-9.]+)s after start")
CLI_SAMPLES = 5
SCRATCH = "answer-src"  # under the work dir: the staged plan and /dev/shm of the checkpoint


class AnswerError(BenchError):
    """A failure of the first-answer runs, reported as one line."""


@dataclass(frozen=True)
class Server:
    """A model server of the test bed's images: its container's name and command, the key of its answer that
    names its weights' digest (None for a server that takes none: its answer, which reads every weight, is
    compared), and its start-up line (named groups: seconds of each step)."""

    container: str
    command: list[str]
    digest_key: str | None
    ready_re: re.Pattern[str]


MODEL = Server("model", MODEL_CMD, "weights_sha256", READY_RE)


def model_image(info: dict[str, Any]) -> str | None:
    images = info.get("images") or {}
    for kind in IMAGE_KINDS:
        if images.get(kind):
            return str(images[kind])
    return None


def ask(ip: str, x: float, timeout: float) -> dict[str, Any]:
    """One GET /predict?x=X; raises OSError while nothing answers."""
    conn = http.client.HTTPConnection(ip, PORT, timeout=timeout)
    try:
        conn.request("GET", f"/predict?x={x!r}", headers={"Connection": "close"})
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise AnswerError(f"GET /predict on {ip}: HTTP {resp.status}: {body[:200]!r}")
        return dict(json.loads(body))
    finally:
        conn.close()


def first_answer(ip: str, x: float, timeout: float) -> tuple[float, dict[str, Any], int]:
    """Asks until the server answers: (monotonic time of the answer, the answer, attempts)."""
    deadline = time.monotonic() + timeout
    attempts = 0
    last = ""
    while True:
        attempts += 1
        try:
            body = ask(ip, x, max(1.0, deadline - time.monotonic()))
            return time.monotonic(), body, attempts
        except (OSError, http.client.HTTPException, ValueError) as exc:  # not listening yet, reset, half an answer
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() > deadline:
            raise AnswerError(f"no answer from {ip}:{PORT} within {timeout:g}s ({attempts} attempts; {last})")
        time.sleep(0.005)


class FirstAnswer:
    """The first-answer runs on the harness's bed, one size (one bed image) after another."""

    def __init__(self, bench: Bench, server: Server = MODEL) -> None:
        self.bench = bench
        self.server = server

    @property
    def b(self) -> Any:
        return self.bench.b

    # ---- one connection each, opened before the clock starts ------------------

    def _agent(self) -> Client:
        c = Client(self.b.socket)
        grpc.channel_ready_future(c.channel).result(timeout=30)
        return c

    def _ready_line(self, log_path: str) -> dict[str, float]:
        """The server's own account of its start-up, from its first stdout line in the CRI log."""
        try:
            with open(log_path, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    m = self.server.ready_re.search(line)
                    if m:
                        return {k: float(v) for k, v in m.groupdict().items()}
        except OSError:
            pass
        return {}

    def check(self, what: str, body: dict[str, Any], ref: dict[str, Any], restored: bool) -> None:
        """A restored replica is the checkpointed process, answering as it did; a cold start has its weights."""
        bad = []
        key = self.server.digest_key
        if key is not None and body.get(key) != ref[key]:
            bad.append(f"{key} {body.get(key)!r} != {ref[key]!r}")
        if restored:
            for key in ("started", "pid", "answer"):
                if body.get(key) != ref[key]:
                    bad.append(f"{key} {body.get(key)!r} != {ref[key]!r}")
            if body.get("requests") != ref["requests"] + 1:
                bad.append(f"requests {body.get('requests')!r}, expected {ref['requests'] + 1}")
        elif body.get("started") == ref["started"]:
            bad.append("a cold start reports the source's start time")
        if bad:
            raise AnswerError(f"{what}: wrong answer: {'; '.join(bad)}")

    # ---- the four paths ---------------------------------------------------------

    def cold(self, image: str, ref: dict[str, Any], label: str, timeout: float) -> dict[str, Any]:
        name = f"cold-{label}-{secrets.token_hex(3)}"
        pcfg = pod_config(self.b, NS_COLD, name)
        ccfg = container_config(self.server.container, image, self.server.command)
        os.makedirs(os.path.join(pcfg["log_directory"], self.server.container), exist_ok=True)
        out: dict[str, Any] = {}

        async def go(cri: CriClient) -> str:
            await cri.version()
            t0 = time.time()
            m0 = time.monotonic()
            pod_id = await cri.run_pod(pcfg, "")
            self.bench.pods[pod_id] = f"{NS_COLD}/{name}"
            m1 = time.monotonic()
            cid = await cri.create_container(pod_id, ccfg, pcfg)
            await cri.start_container(cid, timeout=timeout)
            m2 = time.monotonic()
            ip = (await cri.pod_status(pod_id)).ip
            m3, body, attempts = first_answer(ip, X, timeout)
            out.update(running_s=round(m2 - m0, 4), answer_s=round(m3 - m0, 4), sandbox_s=round(m1 - m0, 4),
                       attempts=attempts, body=body, container_id=cid, process_started_s=round(body["started"] - t0, 4))
            return pod_id

        pod_id = self.bench.cri(go, timeout=timeout)
        try:
            self.check(f"cold start {name}", out["body"], ref, restored=False)
            d = self.bench.cri(lambda cri: cri.container_status(out["container_id"]))
            out.update(self._ready_line(d.log_path))
            out["same_answer"] = out["body"].get("answer") == ref["answer"]
        finally:
            self.bench.remove_pod(pod_id)
        return out

    def local(self, src_plan: Path, src_shm: Path, ccfg: dict[str, Any], ref: dict[str, Any], label: str,
              timeout: float) -> dict[str, Any]:
        name, pcfg, stage = self.bench.stage_bare_plan(src_plan, ccfg, label)
        warm(str(src_plan))
        warm(str(src_shm))
        out: dict[str, Any] = {}

        async def go(cri: CriClient) -> str:
            await cri.version()
            m0 = time.monotonic()
            pod_id = await cri.run_pod(pcfg, self.bench.handler)
            self.bench.pods[pod_id] = f"{NS_RESTORE}/{name}"
            m1 = time.monotonic()
            target = devshm.shm_source((await cri.pod_status(pod_id)).spec)
            if not target or not os.path.isdir(target):
                raise AnswerError(f"local plan {name}: cannot find the new sandbox's /dev/shm")
            shutil.copytree(src_shm, target, symlinks=True, dirs_exist_ok=True)
            m2 = time.monotonic()
            cid = await cri.create_container(pod_id, ccfg, pcfg)
            shutil.move(str(stage), os.path.join(self.bench.plans_dir, cid))
            m3 = time.monotonic()
            await cri.start_container(cid, timeout=timeout)
            m4 = time.monotonic()
            ip = (await cri.pod_status(pod_id)).ip
            m5, body, attempts = first_answer(ip, X, timeout)
            out.update(running_s=round(m4 - m0, 4), answer_s=round(m5 - m0, 4), sandbox_s=round(m1 - m0, 4),
                       devshm_s=round(m2 - m1, 4), create_s=round(m3 - m2, 4), start_call_s=round(m4 - m3, 4),
                       attempts=attempts, body=body, container_id=cid)
            return pod_id

        try:
            pod_id = self.bench.cri(go, timeout=timeout)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        try:
            self.check(f"local plan {name}", out["body"], ref, restored=True)
        finally:
            self.bench.remove_pod(pod_id)
        return out

    def agent(self, ckpt: str, mode: str, ref: dict[str, Any] | None, label: str, timeout: float,
              keep: bool = False, wait_all_in: bool = True, namespace: str | None = None,
              warm_store: bool = True) -> dict[str, Any]:
        """The agent's Restore with start: `mode` "default" (no lazy option) or "full" (lazy=false),
        into `namespace` (default NS_RESTORE), the store read into the page cache first unless not
        `warm_store`. Without `ref` (a workload that serves nothing), no answer is asked for."""
        ns = namespace or NS_RESTORE
        name = f"r-{label}-{secrets.token_hex(3)}"
        if warm_store:
            warm(self.bench.store, NOT_STORE)
        options = {} if mode == "default" else {"lazy": "false"}
        req = pb.RestoreRequest(checkpoint_id=ckpt, namespace=ns, name=name, start=True, options=options)
        out: dict[str, Any] = {"mode": mode}

        async def go(cri: CriClient) -> str:
            await cri.version()
            with self._agent() as agent:
                agent.call("InspectCheckpoint", pb.InspectCheckpointRequest(checkpoint_id=ckpt))
                m0 = time.monotonic()
                result = None
                for ev in agent.stream("Restore", req, timeout=timeout):
                    if ev.HasField("result"):
                        result = ev.result
                m1 = time.monotonic()
            if result is None:
                raise AnswerError(f"restore {name}: the agent ended the call without a result")
            pod_id = str(result.pod_sandbox_id)
            self.bench.pods[pod_id] = f"{ns}/{name}"
            out.update(running_s=round(m1 - m0, 4), m0=m0,
                       container_id=result.containers[0].container_id if result.containers else "")
            if ref is not None:
                ip = (await cri.pod_status(pod_id)).ip
                m2, body, attempts = first_answer(ip, X, timeout)
                out.update(answer_s=round(m2 - m0, 4), attempts=attempts, body=body)
            return pod_id

        pod_id = self.bench.cri(go, timeout=timeout)
        try:
            if ref is not None:
                self.check(f"restore {name} ({mode})", out["body"], ref, restored=True)
            plan = os.path.join(self.bench.plans_dir, out["container_id"])
            try:
                with open(os.path.join(plan, "plan.json"), encoding="utf-8") as fh:
                    out["lazy"] = json.load(fh).get("lazy") is True
            except (OSError, ValueError):
                out["lazy"] = None
            if out["lazy"] and wait_all_in:
                # Untimed for the answer: the background transfer ends before the next operation starts.
                def arrived() -> bool:
                    if os.path.exists(os.path.join(plan, DONE_FILE)):
                        return True
                    if os.path.exists(os.path.join(plan, FAILED_FILE)):
                        raise AnswerError(f"restore {name}: lazy restore failed: "
                                          f"{Path(plan, FAILED_FILE).read_text()[:300]}")
                    return False

                wait_until(arrived, timeout, f"every page of {name}", interval=0.005,
                           failure=f"restore {name}: the pages did not all come in")
                out["all_in_s"] = round(time.monotonic() - out["m0"], 4)
        finally:
            if not keep:
                self.bench.remove_pod(pod_id)
        out.pop("m0", None)
        return out

    # ---- set-up -----------------------------------------------------------------

    def source(self, image: str, timeout: float,
               namespace: str | None = None) -> tuple[str, dict[str, Any], dict[str, Any], str]:
        """The source pod, answering: (pod id, container config, its answer for X, container id), in
        `namespace` (default NS_SRC)."""
        ns = namespace or NS_SRC
        name = f"model-{secrets.token_hex(3)}"
        pcfg = pod_config(self.b, ns, name)
        ccfg = container_config(self.server.container, image, self.server.command)
        os.makedirs(os.path.join(pcfg["log_directory"], self.server.container), exist_ok=True)

        async def go(cri: CriClient) -> tuple[str, str, str]:
            pod_id = await cri.run_pod(pcfg, "")
            self.bench.pods[pod_id] = f"{ns}/{name}"
            cid = await cri.create_container(pod_id, ccfg, pcfg)
            await cri.start_container(cid)
            return pod_id, cid, (await cri.pod_status(pod_id)).ip

        pod_id, cid, ip = self.bench.cri(go)
        _, ref, _ = first_answer(ip, X, timeout)
        for x in (1.0, 2.0):  # a few more requests, so the count the replicas go on from is not 1
            ask(ip, x, timeout)
        ref = ask(ip, X, timeout)
        time.sleep(0.5)  # the server's side of the last connection closed: CRIU dumps listening sockets only
        return pod_id, ccfg, ref, cid

    def cli_startup(self, ckpt: str) -> dict[str, Any]:
        """The CLI's own cost before a request reaches the agent: `node-agent checkpoints inspect ID` as a
        process, less the same call over an open connection."""
        env = dict(os.environ, NODE_AGENT_SOCKET=self.b.socket)
        walls, calls = [], []
        with self._agent() as agent:
            for _ in range(CLI_SAMPLES):
                m0 = time.monotonic()
                cp = subprocess.run([NODE_AGENT, "checkpoints", "inspect", ckpt, "-o", "json"], capture_output=True,
                                    text=True, env=env, timeout=120)
                walls.append(time.monotonic() - m0)
                if cp.returncode != 0:
                    raise AnswerError(f"node-agent checkpoints inspect exited {cp.returncode}: {cp.stderr.strip()}")
                m0 = time.monotonic()
                agent.call("InspectCheckpoint", pb.InspectCheckpointRequest(checkpoint_id=ckpt))
                calls.append(time.monotonic() - m0)
        cli, call = median(walls), median(calls)
        return {"cli_wall_s": [round(x, 4) for x in walls], "call_s": [round(x, 4) for x in calls],
                "startup_ms": round((cli - call) * 1000, 1) if cli is not None and call is not None else None}

    # ---- one size ---------------------------------------------------------------

    def size(self, image: str, runs: int, replicas: int) -> dict[str, Any]:
        args = self.bench.args
        timeout = self.bench.op_timeout
        pod_id, ccfg, ref, _ = self.source(image, timeout)
        mib = int(ref["weights_bytes"]) >> 20
        log(f"model server, {mib} MiB of weights: {runs} interleaved runs of cold / local plan / default / full"
            + (f", then {replicas} replicas" if replicas else ""))
        ckpt = ""
        src_plan = self.bench.work / SCRATCH / "plan"
        src_shm = self.bench.work / SCRATCH / "devshm"
        shutil.rmtree(src_plan.parent, ignore_errors=True)
        src_plan.parent.mkdir(parents=True)
        out: dict[str, Any] = {"mib": mib, "weights_bytes": ref["weights_bytes"], "source": ref}
        kept: list[str] = []
        try:
            cp, _, _, _ = self.bench.cli("checkpoint", pod_id, "-o", "json", "--timeout", str(timeout - 10))
            ckpt = json.loads(cp.stdout)["id"]
            self.bench.checkpoints.append(ckpt)
            self.bench.remove_pod(pod_id)  # the replicas answer for it from here on
            pod_id = ""
            self.bench.stage_plan(ckpt, src_plan, devshm_dest=src_shm)
            out["cli"] = self.cli_startup(ckpt)
            self.bench.settle()

            def one_round(label: str) -> dict[str, Any]:
                r: dict[str, Any] = {}
                r["cold"] = self.cold(image, ref, label, timeout)
                self.bench.settle()
                r["local"] = self.local(src_plan, src_shm, ccfg, ref, label, timeout)
                self.bench.settle()
                r["default"] = self.agent(ckpt, "default", ref, label + "d", timeout)
                self.bench.settle()
                r["full"] = self.agent(ckpt, "full", ref, label + "f", timeout)
                self.bench.settle()
                for v in r.values():
                    v.pop("body", None)
                return r

            out["warmup"] = [one_round(f"{mib}-aw{i + 1}") for i in range(args.warmup)]
            samples = []
            for i in range(runs):
                r = one_round(f"{mib}-a{i + 1}")
                samples.append({"run": i + 1, **r})
                log(f"  {mib} MiB first answer {i + 1}/{runs}: cold {r['cold']['answer_s']:.2f}s | local plan "
                    f"{r['local']['running_s']:.2f}/{r['local']['answer_s']:.2f}s | default "
                    f"{r['default']['running_s']:.2f}/{r['default']['answer_s']:.2f}s"
                    + (f" (all in {r['default']['all_in_s']:.2f}s)" if "all_in_s" in r["default"] else "")
                    + f" | full {r['full']['running_s']:.2f}/{r['full']['answer_s']:.2f}s (running/answer)")
            out["samples"] = samples
            reps = []
            for i in range(replicas):
                before = set(self.bench.pods)
                x = self.agent(ckpt, "default", ref, f"{mib}-ax{i + 1}", timeout, keep=True, wait_all_in=False)
                kept += [p for p in self.bench.pods if p not in before]
                x.pop("body", None)
                reps.append({"replica": i + 1, **x})
                log(f"  replica {i + 1}/{replicas}: running {x['running_s']:.2f}s, first answer {x['answer_s']:.2f}s")
            if replicas:
                out["replicas"] = reps
        finally:
            for p in kept:
                self.bench.remove_pod(p)
            if pod_id:
                self.bench.remove_pod(pod_id)
            if ckpt in self.bench.checkpoints:
                self.bench.remove_checkpoint(ckpt)
            shutil.rmtree(src_plan.parent, ignore_errors=True)
        return out

    def run(self, sizes: list[int]) -> dict[str, Any]:
        args = self.bench.args
        image = model_image(self.b.info)
        if image is None:
            return {"skipped": f"the test bed has no model server image (images: {', '.join(self.b.info.get('images', {}))})"}
        res: dict[str, Any] = {"image": image, "x": X, "shm_mib": SHM_MIB, "sizes": {}}
        todo = list(sizes)
        if not self.bench.own_bed:
            todo = todo[:1]  # an attached bed has the weights it was built with
        for i, mib in enumerate(todo):
            if self.bench.own_bed:
                self.bench.model_bed(mib)
                image = model_image(self.b.info) or image
            runs = args.answer_runs if mib < 1024 else args.answer_large_runs
            n = args.answer_replicas if i == 0 else 0
            one = self.size(image, runs, n)
            res["sizes"][str(one["mib"])] = one
        return res


def run(bench: Bench) -> None:
    """The time-to-first-answer table at each --answer-sizes (results: "answer"), unless --no-answer."""
    args = bench.args
    if not args.answer_sizes:
        bench.results["answer"] = {"skipped": "--no-answer"}
        return
    if SCRATCH not in bench.scratch:
        bench.scratch.append(SCRATCH)
    bench.op_timeout = max(bench.op_timeout, min(600.0, 120.0 + max(args.answer_sizes) * 0.4))
    bench.results["answer"] = FirstAnswer(bench).run(args.answer_sizes)
    skipped = bench.results["answer"].get("skipped")
    if skipped:
        log(f"time to first answer: skipped ({skipped})")
