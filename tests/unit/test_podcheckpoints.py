"""The PodCheckpoint controller against the fake API server (tests/kube_fake.py), with a stand-in for the node.

Several agents (one controller each, as on several nodes) share one API
server: only the agent of the source pod's node takes a PodCheckpoint; it
pushes when asked; deleting the object removes the checkpoint; a refusal or
a missing pod fails the object with the reason; a time to live expires it;
a node that is gone lets any agent release the object; a watch cut mid-way
or answered 410 Gone loses nothing; and an agent restarted between its
checkpoint and its status finishes the object without checkpointing again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from node_agent import errors
from node_agent.kubeapi import KubeClient, from_kubeconfig
from node_agent.podcheckpoints.controller import PodCheckpoints
from node_agent.podcheckpoints.model import FINALIZER, PodCheckpoint
from node_agent.store.records import CheckpointRecord
from tests.kube_fake import FakeKube

NS = "team"


@dataclass
class FakeNode:
    """The node's side: checkpoints kept in a list, as the store would keep them, each naming who asked."""

    name: str
    records: list[CheckpointRecord] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)  # the pods checkpointed, in order
    pushes: list[tuple[str, str]] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    refuse: errors.AgentError | None = None
    gate: asyncio.Event | None = None  # when set, a checkpoint waits for it

    async def checkpoint(self, pc: PodCheckpoint) -> CheckpointRecord:
        if self.refuse is not None:
            raise self.refuse
        if self.gate is not None:
            await self.gate.wait()
        self.checkpoints.append(pc.pod)
        record = make_record(len(self.records) + 1, pc.uid)
        self.records.append(record)
        return record

    async def push(self, record: CheckpointRecord, reference: str) -> str:
        self.pushes.append((record.id, reference))
        return reference.rsplit(":", 1)[0] + "@sha256:" + "d" * 64

    def made_for(self, uid: str) -> list[CheckpointRecord]:
        return [r for r in self.records if r.metadata["requested_by"]["uid"] == uid]

    def remove(self, record: CheckpointRecord) -> None:
        self.removed.append(record.id)
        self.records.remove(record)


def make_record(n: int, uid: str) -> CheckpointRecord:
    return CheckpointRecord(id="sha256:" + f"{n:x}" * 64, created="2026-12-06T00:00:00Z", metadata={
        "frozen_ms": 41.6, "requested_by": {"kind": "PodCheckpoint", "uid": uid}}, files=(), size=100,
        stored_size=12345, manifest_path="")


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Cluster:
    api: FakeKube
    tmp: Path
    clock: Clock
    agents: dict[str, tuple[PodCheckpoints, FakeNode, asyncio.Task[None]]] = field(default_factory=dict)

    def client(self) -> KubeClient:
        return KubeClient(from_kubeconfig(str(self.api.kubeconfig(self.tmp / "kubeconfig"))))

    async def start(self, node: str, fake: FakeNode | None = None, **kw: Any) -> FakeNode:
        fake = fake or FakeNode(node)
        ctl = PodCheckpoints(self.client(), node, fake, wall=self.clock, **kw)
        task = asyncio.create_task(ctl.run())
        self.agents[node] = (ctl, fake, task)
        await asyncio.wait_for(ctl.synced.wait(), 10)
        return fake

    async def stop(self, node: str) -> None:
        ctl, _, task = self.agents.pop(node)
        await ctl.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def pod(self, name: str, node: str) -> dict[str, Any]:
        return self.api.put("pods", {"apiVersion": "v1", "kind": "Pod",
                                     "metadata": {"name": name, "namespace": NS}, "spec": {"nodeName": node}})

    def ask(self, name: str, pod: str, **spec: Any) -> dict[str, Any]:
        return self.api.put("podcheckpoints", {
            "apiVersion": "node-agent.io/v1alpha1", "kind": "PodCheckpoint",
            "metadata": {"name": name, "namespace": NS}, "spec": {"source": {"podName": pod}, **spec}})

    def obj(self, name: str) -> dict[str, Any] | None:
        return self.api.get("podcheckpoints", NS, name)

    async def until(self, what: str, check: Callable[[], Any], timeout: float = 10.0) -> Any:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            got = check()
            if got:
                return got
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"{what}: not within {timeout:g}s; objects: {self.api.state.objects}")
            await asyncio.sleep(0.02)

    async def phase(self, name: str, phase: str) -> dict[str, Any]:
        return await self.until(f"{name} {phase}", lambda: (o := self.obj(name)) and (o.get("status") or {}).get(
            "phase") == phase and o)


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    with FakeKube() as api:
        c = Cluster(api, tmp_path, Clock())
        try:
            yield c
        finally:
            for node in list(c.agents):
                await c.stop(node)
    assert api.state.problems == [], "every object and write the agents sent must pass the CRD's schema"


async def test_only_the_agent_of_the_pods_node_takes_it_and_pushes_it(cluster: Cluster) -> None:
    a, b = await cluster.start("node-a"), await cluster.start("node-b")
    cluster.pod("web", "node-b")
    cluster.ask("warm", "web", push={"reference": "registry.example:5000/team/web:warm"})
    done = await cluster.phase("warm", "Succeeded")
    assert a.checkpoints == [] and b.checkpoints == [f"{NS}/web"]
    status = done["status"]
    assert status["node"] == "node-b" and status["checkpointID"] == b.records[0].id
    assert status["pushedReference"] == "registry.example:5000/team/web@sha256:" + "d" * 64
    assert (status["storedBytes"], status["frozenMilliseconds"]) == (12345, 41)
    assert status["conditions"][0]["type"] == "Ready" and status["conditions"][0]["status"] == "True"
    assert b.pushes == [(b.records[0].id, "registry.example:5000/team/web:warm")]
    assert done["metadata"]["finalizers"] == [FINALIZER]
    # The record names the object it was taken for.
    assert b.records[0].metadata["requested_by"]["uid"] == done["metadata"]["uid"]


async def test_deleting_the_object_removes_its_checkpoint_then_the_object(cluster: Cluster) -> None:
    b = await cluster.start("node-b")
    await cluster.start("node-a")
    cluster.pod("web", "node-b")
    cluster.ask("warm", "web")
    done = await cluster.phase("warm", "Succeeded")
    cluster.api.delete("podcheckpoints", NS, "warm")
    await cluster.until("the object gone", lambda: cluster.obj("warm") is None)
    assert b.removed == [done["status"]["checkpointID"]] and b.records == []


async def test_a_refusal_and_a_missing_pod_fail_the_object_with_the_reason(cluster: Cluster) -> None:
    b = FakeNode("node-b", refuse=errors.PermissionDenied("checkpoint of pod team/web: namespace team may not be "
                                                          "checkpointed on this node (namespaces: team)"))
    await cluster.start("node-b", b)
    cluster.pod("web", "node-b")
    cluster.ask("refused", "web")
    failed = await cluster.phase("refused", "Failed")
    assert failed["status"]["message"].startswith("checkpoint of pod team/web: namespace team may not")
    assert failed["status"]["conditions"][0]["reason"] == "Failed"
    cluster.ask("nothing", "ghost")
    failed = await cluster.phase("nothing", "Failed")
    assert failed["status"]["message"] == "pod team/ghost does not exist"
    assert "node" not in failed["status"]


async def test_a_pod_of_another_uid_is_not_checkpointed(cluster: Cluster) -> None:
    b = await cluster.start("node-b")
    cluster.pod("web", "node-b")
    cluster.ask("old", "web", source={"podName": "web", "podUID": "00000000-0000-0000-0000-000000000001"})
    failed = await cluster.phase("old", "Failed")
    assert "is now another pod" in failed["status"]["message"] and b.checkpoints == []


async def test_the_time_to_live_deletes_the_object_and_its_checkpoint(cluster: Cluster) -> None:
    b = await cluster.start("node-b")
    cluster.pod("web", "node-b")
    cluster.ask("brief", "web", ttlSecondsAfterFinished=0)
    await cluster.until("expired and gone", lambda: cluster.obj("brief") is None)
    assert b.records == [] and len(b.removed) == 1


async def test_a_watch_cut_or_gone_loses_no_object(cluster: Cluster) -> None:
    b = await cluster.start("node-b", resync=3600.0)
    cluster.pod("web", "node-b")
    cluster.api.break_watches()
    cluster.ask("one", "web")
    await cluster.phase("one", "Succeeded")
    cluster.api.compact()
    cluster.api.break_watches()  # the next watch asks for a version the server no longer has: 410, a new list
    cluster.ask("two", "web")
    await cluster.phase("two", "Succeeded")
    assert b.checkpoints == [f"{NS}/web"] * 2
    watches = [c for c in cluster.api.state.calls if c.query.get("watch")]
    lists = [c for c in cluster.api.state.calls if c.method == "GET" and c.path.endswith("/podcheckpoints")
             and not c.query.get("watch")]
    assert len(watches) >= 3 and len(lists) >= 2


async def test_an_agent_restarted_after_its_checkpoint_finishes_without_checkpointing_again(cluster: Cluster) -> None:
    gate = asyncio.Event()
    b = FakeNode("node-b", gate=gate)
    await cluster.start("node-b", b)
    cluster.pod("web", "node-b")
    cluster.ask("warm", "web")
    claimed = await cluster.phase("warm", "Checkpointing")
    assert claimed["status"]["node"] == "node-b"
    await cluster.stop("node-b")  # stopped while the checkpoint is under way: it did not finish
    assert b.records == []
    # The checkpoint did finish before the stop, as far as the store is concerned (published, status not written).
    b.records.append(make_record(1, claimed["metadata"]["uid"]))
    b.gate = None
    await cluster.start("node-b", b)
    done = await cluster.phase("warm", "Succeeded")
    assert done["status"]["checkpointID"] == b.records[0].id and b.checkpoints == []


async def test_an_agent_restarted_during_its_checkpoint_fails_the_object_and_never_takes_it_twice(
        cluster: Cluster) -> None:
    b = FakeNode("node-b", gate=asyncio.Event())
    await cluster.start("node-b", b)
    cluster.pod("web", "node-b")
    cluster.ask("warm", "web")
    await cluster.phase("warm", "Checkpointing")
    await cluster.stop("node-b")
    b.gate = None
    await cluster.start("node-b", b)
    failed = await cluster.phase("warm", "Failed")
    assert "stopped while it checkpointed pod team/web" in failed["status"]["message"]
    assert b.checkpoints == []


async def test_when_the_holding_node_is_gone_any_agent_lets_the_deleted_object_go(cluster: Cluster) -> None:
    b = await cluster.start("node-b")
    cluster.api.put("nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-b"}})
    cluster.pod("web", "node-b")
    cluster.ask("warm", "web")
    await cluster.phase("warm", "Succeeded")
    await cluster.stop("node-b")  # the node and its agent go away for good
    cluster.api.delete("nodes", "", "node-b")
    a = await cluster.start("node-a", node_gone_grace=30.0)
    cluster.api.delete("podcheckpoints", NS, "warm")
    await cluster.until("node-a to find node-b gone", lambda: any(
        c.path == "/api/v1/nodes/node-b" and c.status == 404 for c in cluster.api.state.calls))
    held = cluster.obj("warm")
    assert held is not None and held["metadata"]["finalizers"] == [FINALIZER]  # within the grace period
    cluster.clock.now += 31
    ctl = cluster.agents["node-a"][0]
    await ctl._relist_now()  # noqa: SLF001 - the next list, as the resync or the grace's timer would make it
    await cluster.until("the object gone", lambda: cluster.obj("warm") is None)
    assert a.removed == [] and b.records  # node-b's store is not node-a's to touch


@pytest.mark.parametrize(("change", "says"), [
    (lambda o: o["spec"].update(grant={"hostPID": True}), "spec.grant is not a field this agent knows"),
    (lambda o: o["spec"]["source"].update(podName="../etc"), "spec.source.podName is not a valid value"),
    (lambda o: o["spec"].update(containers=["a"] * 65), "spec.containers is not a list of at most 64 names"),
    (lambda o: o["spec"].update(push={"reference": "r", "password": "x"}), "spec.push must hold reference only"),
    (lambda o: o["spec"].update(ttlSecondsAfterFinished=-1), "spec.ttlSecondsAfterFinished is not a non-negative"),
    (lambda o: o.update(status={"phase": "Done"}), "status.phase 'Done' is not one of"),
    (lambda o: o.update(status={"phase": "Succeeded", "secret": "x"}), "status holds fields this agent does not"),
    (lambda o: o["metadata"].update(finalizers="x"), "metadata.finalizers is not a list of strings"),
])
def test_an_object_is_read_as_hostile(change: Callable[[dict[str, Any]], Any], says: str) -> None:
    from node_agent.podcheckpoints.model import parse

    obj: dict[str, Any] = {"metadata": {"name": "a", "namespace": NS, "uid": "u1", "resourceVersion": "7"},
                           "spec": {"source": {"podName": "web"}}}
    assert parse(obj).pod == f"{NS}/web"
    change(obj)
    with pytest.raises(errors.InvalidArgument, match=says.replace("(", r"\(").replace(".", r"\.")):
        parse(obj)


async def test_an_object_the_agent_cannot_read_fails_once_and_is_never_acted_on(cluster: Cluster) -> None:
    b = await cluster.start("node-b")
    cluster.pod("web", "node-b")
    # The CRD allows any option key length; this agent does not: the object is refused, not half-read.
    cluster.ask("odd", "web", options={"x" * 64: "1"})
    failed = await cluster.phase("odd", "Failed")
    assert "spec.options key is not a valid value" in failed["status"]["message"]
    assert b.checkpoints == [] and "finalizers" not in failed["metadata"]


@pytest.mark.parametrize("denied", ["update podcheckpoints", "update podcheckpoints/status"])
async def test_an_agent_rbac_does_not_let_claim_the_object_takes_no_checkpoint(cluster: Cluster, denied: str) -> None:
    """Without the claim (the finalizer, then the status), nothing is checkpointed: an agent whose
    ServiceAccount lacks either write leaves the pod alone, and does so again at each list."""
    cluster.api.state.forbidden.add(denied)
    b = await cluster.start("node-b", resync=0.5)
    cluster.pod("web", "node-b")
    cluster.ask("warm", "web")
    await cluster.until("two tries refused", lambda: sum(
        1 for c in cluster.api.state.calls if c.status == 403 and c.method == "PUT") >= 2)
    assert b.checkpoints == []
    assert (cluster.obj("warm") or {}).get("status") is None
