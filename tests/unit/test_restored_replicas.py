"""What a user sees of a restore that failed: ContainerStatus, the refused re-create, `node-agent restores`.

The kubelet's calls reach the agent's real CRI endpoint over a real socket,
in front of a fake containerd that answers as containerd does (its
ContainerStatus carries a field this agent's CRI subset does not know); the
agent's API is served by the real servicer on its real listeners (the node
of test_policy_paths). The agent's records of restored containers are
written as the restorer writes them.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, AsyncIterator

import grpc
import pytest

from node_agent._proto.k8s.cri.runtime.v1 import api_pb2 as cri
from node_agent._proto.nodeagent.v1 import nodeagent_pb2 as pb
from node_agent._proto.nodeagent.v1 import nodeagent_pb2_grpc as pb_grpc
from node_agent.api.cri_endpoint import RESTORE_FAILED
from node_agent.replicas import Replica, cri_log_line, tell
from test_policy_paths import DNS, WEB, Node, Pki, _status

RT = "/runtime.v1.RuntimeService/"
UNKNOWN = b"\x98\x06\x01"  # field 99 = 1: a field this agent's CRI subset does not know
NODE_AGENT = str(Path(sys.executable).parent / "node-agent")
CKPT = "sha256:" + "c1" * 32


def _status_bytes(cid: str) -> bytes:
    """containerd's answer to ContainerStatus of ``cid``: an exited container, and a field the agent does not know."""
    status = cri.ContainerStatus(id=cid, metadata=cri.ContainerMetadata(name="app", attempt=0),
                                 state=cri.CONTAINER_EXITED, exit_code=137, reason="Error",
                                 log_path="/var/log/pods/ns_web_u/app/0.log")
    return bytes(cri.ContainerStatusResponse(status=status).SerializeToString()) + UNKNOWN


class Containerd(grpc.GenericRpcHandler):  # type: ignore[misc]
    """The containerd behind the endpoint: records each call; StartContainer of ``failing`` fails as runc would."""

    def __init__(self) -> None:
        self.methods: list[str] = []
        self.failing: set[str] = set()

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        name = str(details.method).rsplit("/", 1)[-1]

        async def answer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            self.methods.append(name)
            if name == "ContainerStatus":
                return _status_bytes(cri.ContainerStatusRequest.FromString(request).container_id)
            if name == "CreateContainer":
                return bytes(cri.CreateContainerResponse(container_id="fe" * 32).SerializeToString())
            if name == "StartContainer" and cri.StartContainerRequest.FromString(request).container_id in self.failing:
                await context.abort(grpc.StatusCode.UNKNOWN, "failed to create containerd task: OCI runtime create "
                                                             "failed: exit status 1")
            return b""

        return grpc.unary_unary_rpc_method_handler(answer)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path / "ca")


async def _node(tmp_path: Path, pki: Pki, **config: Any) -> Node:
    node = Node(tmp_path, pki, **config)
    node.containerd = Containerd()  # type: ignore[assignment]
    return await node.__aenter__()


@pytest.fixture
async def node(tmp_path: Path, pki: Pki) -> AsyncIterator[Node]:
    n = await _node(tmp_path, pki)
    try:
        yield n
    finally:
        await n.__aexit__(None, None, None)


def _replica(node: Node, name: str, cid: str, *, sandbox: str = WEB.id, pod: str = "prod/web", lazy: bool = False,
             log: bool = True) -> Replica:
    logs = node.root / "logs" / pod.replace("/", "_")
    (logs / name).mkdir(parents=True, exist_ok=True)
    rep = Replica(cid, sandbox, pod, name, CKPT, lazy, str(logs / name / "0.log") if log else "", str(logs),
                  "2026-12-02T00:00:00Z")
    node.restorer.replicas.record(rep)
    return rep


async def _raw(node: Node, method: str, request: Any) -> tuple[grpc.StatusCode, str, bytes]:
    async with node.kubelet() as ch:
        call = ch.unary_unary(RT + method, request_serializer=None, response_deserializer=None)
        try:
            return grpc.StatusCode.OK, "", bytes(await call(request.SerializeToString(), timeout=30))
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or "", b""


def _create(sandbox: str, name: str) -> Any:
    return cri.CreateContainerRequest(pod_sandbox_id=sandbox, config=cri.ContainerConfig(
        metadata=cri.ContainerMetadata(name=name, attempt=1)))


async def test_container_status_says_why_a_restore_failed_and_is_untouched_otherwise(node: Node) -> None:
    bad, good = _replica(node, "app", "a1" * 32), _replica(node, "side", "a2" * 32)
    reason = "checkpoint sha256:x: blob sha256:y: digest mismatch (after 3 pages)"
    assert node.restorer.replicas.mark_failed(bad, reason)
    for cid in ("b0" * 32, good.container_id):  # not restored, and restored without a failure: byte for byte
        code, _, raw = await _raw(node, "ContainerStatus", cri.ContainerStatusRequest(container_id=cid))
        assert code == grpc.StatusCode.OK and raw == _status_bytes(cid)
    code, _, raw = await _raw(node, "ContainerStatus", cri.ContainerStatusRequest(container_id=bad.container_id))
    assert code == grpc.StatusCode.OK and UNKNOWN in raw
    status = cri.ContainerStatusResponse.FromString(raw).status
    assert (status.reason, status.message) == (RESTORE_FAILED, f"restore of pod prod/web, container app failed: "
                                                               f"{reason}; the container was stopped")
    expected = cri.ContainerStatusResponse.FromString(_status_bytes(bad.container_id)).status
    expected.reason, expected.message = status.reason, status.message
    assert status == expected  # nothing else changed
    assert node.containerd.methods == ["ContainerStatus"] * 3


async def test_a_container_whose_restore_failed_is_not_created_again(node: Node) -> None:
    rep = _replica(node, "app", "a1" * 32)
    assert node.restorer.replicas.mark_failed(rep, "the page source exited mid-transfer (killed by signal 9)")
    code, details, _ = await _raw(node, "CreateContainer", _create(WEB.id, "app"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert details == ("restore of pod prod/web, container app failed: the page source exited mid-transfer (killed by "
                       "signal 9); the container was stopped; it is not created again from its image in a pod restored "
                       f"from checkpoint {CKPT} (restore.after-failed-restore: refuse): delete the pod and restore it "
                       "again")
    assert "CreateContainer" not in node.containerd.methods
    # Another name in that pod, and that name in another pod, are created as asked.
    for sandbox, name in ((WEB.id, "sidecar"), (DNS.id, "app")):
        code, details, raw = await _raw(node, "CreateContainer", _create(sandbox, name))
        assert code == grpc.StatusCode.OK, details
    code, details, _ = await _raw(node, "StartContainer", cri.StartContainerRequest(container_id=rep.container_id))
    assert (code, details) == (grpc.StatusCode.FAILED_PRECONDITION, "restore of pod prod/web, container app failed: "
                               "the page source exited mid-transfer (killed by signal 9); the container was stopped")
    assert node.containerd.methods == ["CreateContainer", "CreateContainer"]


async def test_an_operator_may_let_it_start_fresh(tmp_path: Path, pki: Pki) -> None:
    node = await _node(tmp_path, pki, restore={"after-failed-restore": "start-fresh"})
    try:
        rep = _replica(node, "app", "a1" * 32)
        node.restorer.replicas.mark_failed(rep, "gone")
        code, details, raw = await _raw(node, "CreateContainer", _create(WEB.id, "app"))
        assert code == grpc.StatusCode.OK, details
        assert cri.CreateContainerResponse.FromString(raw).container_id == "fe" * 32
    finally:
        await node.__aexit__(None, None, None)


async def test_a_restore_that_fails_at_start_fails_its_pod(node: Node) -> None:
    """The kubelet starts a restored container and the runtime's restore fails: the pod's others stop too."""
    first, second = _replica(node, "app", "a1" * 32), _replica(node, "side", "a2" * 32)
    plan = Path(node.settings.plans_dir) / second.container_id
    plan.mkdir(parents=True)
    (plan / "plan.json").write_text(json.dumps({"pod": "prod/web", "container": "side", "nonce": "n0"}))
    criu = "Error (criu/cr-restore.c:1480): cannot restore task 7 (full CRIU log: /x/restore.log)"
    (plan / "failed").write_text(f"restore of pod prod/web, container side, phase restore: {criu}")
    node.containerd.failing.add(second.container_id)
    code, details, _ = await _raw(node, "StartContainer", cri.StartContainerRequest(container_id=second.container_id))
    assert (code, details) == (grpc.StatusCode.UNKNOWN, "failed to create containerd task: OCI runtime create failed: "
                                                        "exit status 1")  # the runtime's answer, as it was
    replicas = node.restorer.replicas
    assert replicas.failure(second) == f"phase restore: {criu}"
    assert replicas.failure(first) == f"the restore of container side of the same pod failed (phase restore: {criu})"
    for name, cid in (("side", second.container_id), ("app", first.container_id)):
        code, details, _ = await _raw(node, "CreateContainer", _create(WEB.id, name))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith(
            f"restore of pod prod/web, container {name} failed: "), details
        code, _, raw = await _raw(node, "ContainerStatus", cri.ContainerStatusRequest(container_id=cid))
        assert cri.ContainerStatusResponse.FromString(raw).status.reason == RESTORE_FAILED
    line = (node.root / "logs" / "prod_web" / "side" / "0.log").read_text()
    assert re.fullmatch(r"\S+ stderr F node-agent: restore of pod prod/web, container side failed: phase restore: "
                        + re.escape(criu) + r"; the container was stopped\n", line), line


def test_the_cri_log_line_is_containerds_format(tmp_path: Path) -> None:
    assert cri_log_line("a\nb  c", 1764633600_123456789) == b"2025-12-02T00:00:00.123456789Z stderr F a b c\n"
    assert cri_log_line("x", 1764633600_120000000) == b"2025-12-02T00:00:00.12Z stderr F x\n"
    assert cri_log_line("x", 1764633600_000000000) == b"2025-12-02T00:00:00Z stderr F x\n"
    logs = tmp_path / "pods"
    (logs / "app").mkdir(parents=True)
    (logs / "app" / "0.log").write_bytes(b"2025-12-02T00:00:00Z stdout F hello\n")
    rep = Replica("a1", "s1", "ns/web", "app", CKPT, True, str(logs / "app" / "0.log"), str(logs))
    assert tell(rep, "node-agent: gone")
    lines = (logs / "app" / "0.log").read_text().splitlines()
    assert lines[0] == "2025-12-02T00:00:00Z stdout F hello"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,9})?Z stderr F node-agent: gone", lines[1]), lines
    # Only inside the pod's log directory, and never through a link.
    outside = tmp_path / "etc-cron"
    outside.mkdir()
    for path in (str(outside / "x"), str(logs / "app" / ".." / ".." / "etc-cron" / "x")):
        assert not tell(Replica("a1", "s1", "ns/web", "app", CKPT, True, path, str(logs)), "no")
    os.symlink(outside / "y", logs / "app" / "1.log")
    assert not tell(Replica("a1", "s1", "ns/web", "app", CKPT, True, str(logs / "app" / "1.log"), str(logs)), "no")
    assert list(outside.iterdir()) == []


# ---- node-agent restores ---------------------------------------------------------------------


def _states(node: Node) -> dict[str, Replica]:
    """Replicas in every state the listing knows, as the restorer and the wrapper leave them."""
    plans = Path(node.settings.plans_dir)
    reps = {
        "created": _replica(node, "created", "d1" * 32),
        "running": _replica(node, "running", "d2" * 32),
        "paging": _replica(node, "paging", "d3" * 32, lazy=True),
        "done": _replica(node, "done", "d4" * 32, lazy=True),
        "exited": _replica(node, "exited", "d5" * 32),
        "failed": _replica(node, "failed", "d6" * 32, lazy=True),
        "gone": _replica(node, "gone", "d7" * 32),
        "dns": _replica(node, "dns", "d8" * 32, sandbox=DNS.id, pod="kube-system/dns"),
        "pruned": _replica(node, "pruned", "d9" * 32, sandbox="ee" * 32),
    }
    for name in ("created", "running", "paging", "done", "exited", "dns"):
        (plans / reps[name].container_id).mkdir(parents=True)
        (plans / reps[name].container_id / "plan.json").write_text("{}")
    for name in ("running", "paging", "done", "exited", "dns"):
        (plans / reps[name].container_id / "restored").write_text("{}")
    (plans / reps["done"].container_id / "lazy.done").write_text(json.dumps({"pages": 10, "total": 12}))
    node.restorer.replicas.mark_failed(reps["failed"], "blob sha256:0f: digest mismatch")
    live = {r.container_id: "CONTAINER_RUNNING" for r in reps.values()}
    live[reps["exited"].container_id] = "CONTAINER_EXITED"
    del live[reps["gone"].container_id], live[reps["failed"].container_id]

    async def list_containers(pod_id: str | None = None) -> list[Any]:
        return [SimpleNamespace(id=cid, state=state) for cid, state in live.items()]

    node.cri.list_containers = list_containers  # type: ignore[attr-defined]
    return reps


async def test_list_restores_says_how_each_replica_is_doing(node: Node) -> None:
    reps = _states(node)
    async with node.local() as ch:
        stub = pb_grpc.NodeAgentStub(ch)  # type: ignore[no-untyped-call]
        answer = await stub.ListRestores(pb.ListRestoresRequest(), timeout=30)
        only = await stub.ListRestores(pb.ListRestoresRequest(pod_namespace="kube-system"), timeout=30)
    got = {r.container: r for r in answer.restores}
    assert {n: (r.state, r.container_state) for n, r in got.items()} == {
        "created": ("created", "running"), "running": ("running", "running"), "paging": ("paging-in", "running"),
        "done": ("done", "running"), "exited": ("exited", "exited"), "failed": ("failed", "removed"),
        "dns": ("running", "running")}
    assert got["failed"].reason == "blob sha256:0f: digest mismatch" and got["failed"].lazy
    assert (got["done"].pages_in, got["done"].pages_total) == (10, 12)
    r = got["running"]
    assert (r.pod_namespace, r.pod_name, r.pod_sandbox_id, r.container_id, r.checkpoint_id, r.restored) == (
        "prod", "web", WEB.id, reps["running"].container_id, CKPT, "2026-12-02T00:00:00Z")
    assert [r.container for r in only.restores] == ["dns"]
    # The records of a sandbox that is gone went with it.
    assert node.restorer.replicas.sandboxes() == sorted([WEB.id, DNS.id])


async def test_list_restores_over_tls_keeps_to_the_callers_namespaces(tmp_path: Path, pki: Pki) -> None:
    rules = [{"identities": ["CN=watcher"], "methods": ["ListRestores"], "namespaces": ["prod"]}]
    node = await _node(tmp_path, pki, authorization=rules)
    try:
        _states(node)
        async with node.tls(pki, pki.client("watcher", "watcher")) as ch:
            stub = pb_grpc.NodeAgentStub(ch)  # type: ignore[no-untyped-call]
            answer = await stub.ListRestores(pb.ListRestoresRequest(), timeout=30)
            assert {r.pod_namespace for r in answer.restores} == {"prod"} and len(answer.restores) == 6
            code, details = await _status(stub.ListRestores(pb.ListRestoresRequest(pod_namespace="kube-system"),
                                                            timeout=30))
            assert (code, details) == (grpc.StatusCode.PERMISSION_DENIED,
                                       "CN=watcher may not call ListRestores for namespace 'kube-system'")
            code, details = await _status(stub.ListCheckpoints(pb.ListCheckpointsRequest(), timeout=30))
            assert (code, details) == (grpc.StatusCode.PERMISSION_DENIED, "CN=watcher may not call ListCheckpoints")
    finally:
        await node.__aexit__(None, None, None)


async def test_the_restores_command(node: Node) -> None:
    _states(node)

    def run(*args: str) -> str:
        cp = subprocess.run([NODE_AGENT, "restores", "--socket", node.settings.socket, *args], capture_output=True,
                            text=True, timeout=120)
        assert cp.returncode == 0, cp.stderr
        return cp.stdout

    items = json.loads(await asyncio.to_thread(run, "-o", "json"))
    done = next(i for i in items if i["container"] == "done")
    assert done == {
        "pod_namespace": "prod", "pod_name": "web", "pod_sandbox_id": WEB.id, "container": "done",
        "container_id": "d4" * 32, "checkpoint_id": CKPT, "lazy": True, "state": "done", "reason": "",
        "pages_in": 10, "pages_total": 12, "restored": "2026-12-02T00:00:00Z", "container_state": "running"}
    table = (await asyncio.to_thread(run, "--namespace", "prod")).splitlines()
    assert table[0].split() == ["POD", "CONTAINER", "CONTAINER", "ID", "CHECKPOINT", "RESTORE", "PAGES", "STATE"]
    rows = {line.split()[1]: line for line in table[1:]}
    assert sorted(rows) == ["created", "done", "exited", "failed", "paging", "running"]
    assert rows["done"].split()[4:7] == ["lazy", "10/12", "done"]
    assert rows["failed"].rstrip().endswith("failed: blob sha256:0f: digest mismatch")
    assert rows["running"].split()[4:] == ["full", "-", "running"]
