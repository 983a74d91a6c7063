"""Start-up recovery and undo until done (`recovery`, `undoing`, `Restorer`'s undo).

The CRI under the agent is a fake that keeps the pods and containers it was
asked to make, and can be "down" (every call UNAVAILABLE) for a number of
calls, as containerd is while it restarts. Other agents and helpers are real
processes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

import pytest

from criu_bridge import wrapper
from criu_bridge.watchdog import holders, proc_starttime
from node_agent import errors
from node_agent.config.loading import from_mapping
from node_agent.config.schema import Settings
from node_agent.cri.client import RuntimeUnavailable
from node_agent.cri.types import Container, ContainerDetail, Pod, PodDetail
from node_agent.journal import Entry, Journal
from node_agent.metrics import Metrics
from node_agent.recovery import _settle_helpers, recover
from node_agent.restoring import RestoreRequest, Restorer
from node_agent.store import Store
from node_agent.undoing import RESTORE_OP, Undoer, sandbox_record
from test_runtime_handler import _status
from test_interop import make_checkpoint

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


class Containerd:
    """The CRI client under the agent, over a pretend containerd that keeps what it made.

    `down` calls from now on answer UNAVAILABLE (containerd restarting);
    each such call records whether the journal still held `watch`.
    `lose_run_answer`: RunPodSandbox makes the sandbox, then the answer is
    lost (UNAVAILABLE). `die_at_start`: StartContainer fails UNAVAILABLE
    and containerd stays down for that many more calls.
    """

    def __init__(self, shm: Path) -> None:
        self.shm = shm
        self.pods: dict[str, Pod] = {}
        self.containers: dict[str, Container] = {}
        self.down = 0
        self.lose_run_answer = False
        self.die_at_start = 0
        self.calls: list[str] = []
        self.refused: list[str] = []
        self.journal: Journal | None = None
        self.watch: Entry | None = None
        self.held_while_down: list[bool] = []

    def _answer(self, name: str) -> None:
        self.calls.append(name)
        if self.down:
            self.down -= 1
            self.refused.append(name)
            if self.journal is not None and self.watch is not None:
                self.held_while_down.append(self.journal.holds(self.watch))
            raise RuntimeUnavailable(f"{name}: connection error: dial unix /run/containerd/containerd.sock: "
                                     "connect: connection refused")

    async def status_info(self) -> dict[str, str]:
        self._answer("Status")
        return dict(self.info)

    async def image_present(self, image: str) -> bool:
        self._answer("ImageStatus")
        return True

    async def list_pods(self) -> list[Pod]:
        self._answer("ListPodSandbox")
        return list(self.pods.values())

    async def run_pod(self, config: Mapping[str, Any], runtime_handler: str) -> str:
        self._answer("RunPodSandbox")
        meta = config["metadata"]
        pod_id = f"{len(self.calls):02d}" * 32
        self.pods[pod_id] = Pod(pod_id, meta["name"], meta["namespace"], meta.get("uid", ""), 0, "SANDBOX_READY", 0,
                                runtime_handler, annotations=dict(config.get("annotations") or {}))
        if self.lose_run_answer:
            raise RuntimeUnavailable("RunPodSandbox: error reading from server: EOF")
        return pod_id

    async def pod_status(self, pod_id: str) -> PodDetail:
        self._answer("PodSandboxStatus")
        spec = {"mounts": [{"destination": "/dev/shm", "type": "bind", "source": str(self.shm)}]}
        return PodDetail(self.pods[pod_id], {}, spec, 1)

    async def create_container(self, pod_id: str, config: Mapping[str, Any], pod_config: Mapping[str, Any]) -> str:
        self._answer("CreateContainer")
        cid = f"c{len(self.containers)}".ljust(64, "0")
        self.containers[cid] = Container(cid, pod_id, config["metadata"]["name"], 0, "CONTAINER_CREATED", "", "", 0)
        return cid

    async def start_container(self, container_id: str, *, timeout: float | None = None) -> None:
        self._answer("StartContainer")
        if self.die_at_start:
            self.down = self.die_at_start
            raise RuntimeUnavailable("StartContainer: error reading from server: EOF")

    async def container_status(self, container_id: str) -> ContainerDetail:
        self._answer("ContainerStatus")
        if container_id not in self.containers:
            raise errors.NotFound(f"ContainerStatus {container_id[:13]}: not found")
        return ContainerDetail(self.containers[container_id], {}, {}, 0, "")

    async def list_containers(self, pod_id: str | None = None) -> list[Container]:
        self._answer("ListContainers")
        return [c for c in self.containers.values() if pod_id in (None, c.pod_id)]

    async def stop_pod(self, pod_id: str) -> None:
        self._answer("StopPodSandbox")
        if pod_id not in self.pods:
            raise errors.NotFound(f"StopPodSandbox {pod_id[:13]}: not found")

    async def remove_pod(self, pod_id: str) -> None:
        self._answer("RemovePodSandbox")
        if self.pods.pop(pod_id, None) is None:
            raise errors.NotFound(f"RemovePodSandbox {pod_id[:13]}: not found")
        # Its containers go with it.
        for cid in [c.id for c in self.containers.values() if c.pod_id == pod_id]:
            del self.containers[cid]


class FakeCriu:
    async def cpuinfo_check(self, images: str) -> None:
        return None


class WatchedJournal(Journal):
    """A journal that says when an entry goes."""

    def __init__(self, directory: str) -> None:
        super().__init__(directory)
        self.removed = asyncio.Event()

    def remove(self, entry: Entry) -> None:
        super().remove(entry)
        self.removed.set()


@pytest.fixture
def node(tmp_path: Path) -> tuple[Settings, Store, Containerd]:
    s = from_mapping({"store": str(tmp_path / "store"), "lazy-restore": "never", "min-free-bytes": 0,
                      "timeouts": {"cleanup": 5}})
    wrapper.install(s.wrapper_path, python=sys.executable, runc="/usr/bin/runc", plans_dir=s.plans_dir)
    store = Store(s.store)
    (tmp_path / "shm").mkdir()
    cri = Containerd(tmp_path / "shm")
    cri.info = _status(s.wrapper_path, [wrapper.PLAN_ANNOTATION])  # type: ignore[attr-defined]
    return s, store, cri


def _restorer(s: Settings, store: Store, cri: Containerd, journal: Journal) -> Restorer:
    undoer = Undoer(s, cri, journal, first=0.001, most=0.004)  # type: ignore[arg-type]
    return Restorer(s, cri, store, journal, FakeCriu(), Metrics(), undoer=undoer)  # type: ignore[arg-type]


# ---- undo until done ---------------------------------------------------------------------------------


async def test_containerd_dying_at_start_leaves_nothing_once_it_answers_again(
        node: tuple[Settings, Store, Containerd], caplog: pytest.LogCaptureFixture) -> None:
    s, store, cri = node
    rec, _ = make_checkpoint(store, names=("app", "side"))
    journal = WatchedJournal(s.journal_dir)
    restorer = _restorer(s, store, cri, journal)
    cri.die_at_start = 7  # down for the undo at once and for some retries
    caplog.set_level(logging.INFO, logger="node_agent.undoing")
    with pytest.raises(errors.Unavailable) as e:
        await restorer.restore(RestoreRequest(rec.id, namespace="team", name="copy", start=True))
    [entry] = journal.pending()
    assert str(e.value) == (
        f"restore as pod team/copy, phase start app: the container runtime at {s.cri_endpoint} did not answer "
        "(StartContainer: error reading from server: EOF); removing what it created is pending: the agent retries "
        f"until the runtime answers (journal entry {entry.op_id})")
    # The entry stays, marked: its sandbox (with both containers) is still there; the plans went at once.
    assert entry.data["undo"] is True and len(cri.pods) == 1 and len(cri.containers) == 2
    assert os.listdir(s.plans_dir) == []
    assert f"undo of restore {entry.op_id} (pod team/copy) pending (attempt 1): " in caplog.text

    cri.journal, cri.watch = journal, entry
    journal.removed.clear()
    retrier = asyncio.create_task(restorer.undoer.run(), name="undo-retry")
    try:
        await asyncio.wait_for(journal.removed.wait(), 30)
    finally:
        retrier.cancel()
        await asyncio.gather(retrier, return_exceptions=True)
    assert cri.down == 0 and cri.held_while_down and all(cri.held_while_down)
    assert cri.pods == {} and cri.containers == {} and journal.pending() == []
    assert os.listdir(s.plans_dir) == [] and os.listdir(s.work_dir) == []
    assert f"undo of restore {entry.op_id} (pod team/copy) done: its sandboxes and plans are removed" in caplog.text


class Refusing(Containerd):
    """StartContainer as it ends when the restore wrapper fails: its `failed` mark in the plan, an error."""

    def __init__(self, shm: Path, plans: str, mark: str) -> None:
        super().__init__(shm)
        self.plans = plans
        self.mark = mark

    async def start_container(self, container_id: str, *, timeout: float | None = None) -> None:
        self._answer("StartContainer")
        Path(self.plans, container_id, wrapper.FAILED).write_text(self.mark)
        raise errors.Internal("StartContainer: OCI runtime create failed: exit status 1")


REFUSED = "restore of pod team/copy, container app, phase privileges: refusing to restore it"
CRIU_CUT = "restore of pod team/copy, container app, phase restore: Running post-restore scripts; RPC"
LOST = "restore of pod team/copy, container app, phase lazy-pages: [Errno 2] No such file or directory"
BAD_CHUNK = ("restore of pod team/copy, container app, phase lazy-pages: blob sha256:ab: digest mismatch "
             "(content hashes to sha256:cd)")


@pytest.mark.parametrize("mark, source, raised, reason", [
    (REFUSED, LOST, errors.FailedPrecondition, "phase privileges"),  # the page source only lost its restore
    (CRIU_CUT, BAD_CHUNK, errors.DataLoss, "digest mismatch"),  # CRIU was cut off: the source says why
    (CRIU_CUT, "", errors.Internal, "phase restore"),  # nothing from the source: CRIU's own account
])
async def test_a_failed_lazy_start_names_the_decisive_reason(
        node: tuple[Settings, Store, Containerd], monkeypatch: pytest.MonkeyPatch,
        mark: str, source: str, raised: type[errors.AgentError], reason: str) -> None:
    s, store, _ = node
    cri = Refusing(Path(s.store), s.plans_dir, mark)
    cri.info = _status(s.wrapper_path, [wrapper.PLAN_ANNOTATION])  # type: ignore[attr-defined]
    rec, _ = make_checkpoint(store)
    restorer = _restorer(s, store, cri, Journal(s.journal_dir))

    async def lazily(*_: Any) -> bool:
        return True

    async def started(*_: Any, **__: Any) -> None:
        return None

    async def told(*_: Any, **__: Any) -> errors.AgentError | None:  # as LazyRestores.failure answers
        if not source:
            return None
        return errors.DataLoss(source) if "digest mismatch" in source else errors.Unavailable(source)

    monkeypatch.setattr(restorer.lazy, "wanted", lazily)
    monkeypatch.setattr(restorer.lazy, "start", started)
    monkeypatch.setattr(restorer.lazy, "failure", told)
    with pytest.raises(raised, match=reason):
        await restorer.restore(RestoreRequest(rec.id, namespace="team", name="copy", start=True))
    assert cri.pods == {} and cri.containers == {}


async def test_a_sandbox_whose_answer_was_lost_is_found_and_removed(node: tuple[Settings, Store, Containerd]) -> None:
    s, store, cri = node
    rec, _ = make_checkpoint(store)
    journal = Journal(s.journal_dir)
    restorer = _restorer(s, store, cri, journal)
    cri.lose_run_answer = True
    # Another pod of the same name, made by something else, is no restore's to remove.
    cri.pods["ff" * 32] = Pod("ff" * 32, "copy", "team", "u-other", 0, "SANDBOX_NOTREADY", 0)
    with pytest.raises(errors.Unavailable) as e:
        await restorer.restore(RestoreRequest(rec.id, namespace="team", name="copy"))
    assert str(e.value) == (
        f"restore as pod team/copy, phase sandbox: the container runtime at {s.cri_endpoint} did not answer "
        "(RunPodSandbox: error reading from server: EOF); everything it created was removed")
    assert list(cri.pods) == ["ff" * 32] and journal.pending() == []
    assert cri.calls[-3:] == ["ListPodSandbox", "StopPodSandbox", "RemovePodSandbox"]


async def test_the_sandbox_is_findable_before_run_pod_sandbox_is_called(tmp_path: Path) -> None:
    s = from_mapping({"store": str(tmp_path / "store")})
    cri = Containerd(tmp_path)
    journal = Journal(s.journal_dir)
    config = {"metadata": {"name": "copy", "namespace": "team", "uid": "u1"}, "annotations": {RESTORE_OP: "op-1"}}
    entry = Entry("restore", op_id="op-1", data={"pod": "team/copy", "sandboxes": [], "plans": [],
                                                 "sandbox": sandbox_record(config, "op-1")})
    journal.write(entry)
    pod_id = await cri.run_pod(config, "criu")  # the agent died before it could record the ID
    assert await Undoer(s, cri, journal).undo(Journal(s.journal_dir).pending()[0])  # type: ignore[arg-type]
    assert pod_id not in cri.pods and journal.pending() == []


async def test_not_found_is_done_and_unavailable_keeps_the_entry(tmp_path: Path) -> None:
    s = from_mapping({"store": str(tmp_path / "store")})
    cri = Containerd(tmp_path)
    journal = Journal(s.journal_dir)
    plan = Path(s.plans_dir, "c" * 64)
    plan.mkdir(parents=True)
    entry = Entry("restore", data={"pod": "team/gone", "sandboxes": ["ab" * 32], "plans": [str(plan)]})
    journal.write(entry)
    undoer = Undoer(s, cri, journal)  # type: ignore[arg-type]
    cri.down = 1
    assert not await undoer.undo(entry)
    assert journal.holds(entry) and list(undoer.pending()) == [entry.op_id] and not plan.exists()
    assert await undoer.undo(entry)  # the runtime answers: it knows no such sandbox
    assert cri.refused == ["StopPodSandbox"] and cri.calls[-2:] == ["StopPodSandbox", "RemovePodSandbox"]
    assert journal.pending() == [] and list(undoer.pending()) == []


async def test_a_checkpoint_entry_stays_until_its_pod_is_thawed_and_its_scratch_space_gone(tmp_path: Path) -> None:
    """A thaw that fails (here the cgroup's control file cannot be written) keeps the checkpoint's entry."""
    s = from_mapping({"store": str(tmp_path / "store")})
    journal = Journal(s.journal_dir)
    cgroup = tmp_path / "freezer" / "pod"
    (cgroup / "freezer.state").mkdir(parents=True)  # a thaw cannot write it
    work = Path(s.work_dir, "op")
    (work / "images").mkdir(parents=True)
    entry = Entry("checkpoint", data={"pod": "team/web", "freezers": [f"v1:{cgroup}"], "work": str(work)})
    journal.write(entry)
    undoer = Undoer(s, Containerd(tmp_path), journal)  # type: ignore[arg-type]
    assert not await undoer.undo(entry)
    assert journal.holds(entry) and list(undoer.pending()) == [entry.op_id] and not work.exists()
    assert undoer.owns(journal.pending()[0])  # the retrier takes it over
    (cgroup / "freezer.state").rmdir()
    (cgroup / "freezer.state").write_text("FROZEN\n")
    assert await undoer.undo(entry)
    assert (cgroup / "freezer.state").read_text() == "THAWED" and journal.pending() == []


async def test_the_retrier_never_undoes_an_operation_in_flight(tmp_path: Path) -> None:
    s = from_mapping({"store": str(tmp_path / "store")})
    cri = Containerd(tmp_path)
    journal = WatchedJournal(s.journal_dir)
    cri.pods["aa" * 32] = Pod("aa" * 32, "live", "team", "u1", 0, "SANDBOX_READY", 0)
    cri.pods["bb" * 32] = Pod("bb" * 32, "failed", "team", "u2", 0, "SANDBOX_READY", 0)
    in_flight = Entry("restore", data={"pod": "team/live", "sandboxes": ["aa" * 32], "plans": []})
    failed = Entry("restore", data={"pod": "team/failed", "sandboxes": ["bb" * 32], "plans": [], "undo": True})
    journal.write(in_flight)
    journal.write(failed)
    retrier = asyncio.create_task(Undoer(s, cri, journal).run(), name="undo-retry")  # type: ignore[arg-type]
    try:
        await asyncio.wait_for(journal.removed.wait(), 30)  # one pass went over both entries
    finally:
        retrier.cancel()
        await asyncio.gather(retrier, return_exceptions=True)
    assert list(cri.pods) == ["aa" * 32] and [e.op_id for e in journal.pending()] == [in_flight.op_id]


# ---- recovery: live writers, helpers --------------------------------------------------------------------

WRITE_ENTRY = ("import sys\nfrom node_agent.journal import Entry, Journal\n"
               "e = Entry('restore', data={'pod': 'team/live', 'sandboxes': ['" + "aa" * 32 + "'], 'plans': []})\n"
               "Journal(sys.argv[1]).write(e)\nprint(e.op_id, flush=True)\nsys.stdin.read()\n")


@contextmanager
def process(argv: list[str], ready: bytes | None = None, **kw: Any) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=ENV, **kw)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        if ready is not None:
            assert proc.stdout.readline().startswith(ready)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        proc.stdin.close()
        proc.stdout.close()


async def test_recovery_leaves_a_live_writers_entry_alone_and_undoes_a_dead_ones(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    s = from_mapping({"store": str(tmp_path / "store")})
    cri = Containerd(tmp_path)
    cri.pods["aa" * 32] = Pod("aa" * 32, "live", "team", "u1", 0, "SANDBOX_READY", 0)
    os.makedirs(Path(s.work_dir, "restore-x"))
    journal = Journal(s.journal_dir)
    with process([sys.executable, "-c", WRITE_ENTRY, s.journal_dir], cwd=str(REPO)) as writer:
        assert writer.stdout is not None
        op_id = writer.stdout.readline().decode().strip()
        [entry] = journal.pending()
        assert (entry.op_id, entry.pid, entry.start) == (op_id, writer.pid, proc_starttime(writer.pid))
        caplog.set_level(logging.WARNING, logger="node_agent.recovery")
        assert await recover(s, journal, cri) == 0  # type: ignore[arg-type]
        assert [e.op_id for e in journal.pending()] == [op_id] and "aa" * 32 in cri.pods
        assert os.listdir(s.work_dir) == ["restore-x"]  # its scratch space too
        assert (f"leaving journal entry {op_id} (restore of pod team/live) alone: its writer, pid {writer.pid}, "
                "still runs") in caplog.text
    # The writer is gone: its entry is undone.
    assert await recover(s, journal, cri) == 1  # type: ignore[arg-type]
    assert journal.pending() == [] and cri.pods == {} and os.listdir(s.work_dir) == []


def test_a_process_holding_the_scratch_directory_is_not_a_helper_unless_it_is_runc_or_criu(tmp_path: Path) -> None:
    work = tmp_path / "work" / "op"
    work.mkdir(parents=True)
    runc = tmp_path / "bin" / "runc"
    runc.parent.mkdir()
    shutil.copy(sys.executable, runc)  # an executable named runc (holds the directory as its cwd)
    code = "import sys; print('in', flush=True); sys.stdin.read()"
    with process([sys.executable, "-c", code], b"in", cwd=str(work)) as python, \
            process([str(runc), "-c", code], b"in", cwd=str(work)) as helper:
        found = holders(str(work))
        assert helper.pid in found and python.pid not in found
        _settle_helpers([], [], str(work), grace=0.05)
        assert helper.wait(10) == -9
        assert python.poll() is None  # a python process in the directory: never killed


def test_a_recorded_helper_is_killed_and_a_node_agent_process_never_is(tmp_path: Path) -> None:
    agent = tmp_path / "node-agent"
    agent.write_text("import sys\nprint('in', flush=True)\nsys.stdin.read()\n")
    code = "import sys; print('in', flush=True); sys.stdin.read()"
    with process([sys.executable, "-c", code], b"in") as recorded, \
            process([sys.executable, str(agent)], b"in") as node_agent:
        helpers = [{"pid": p.pid, "start": proc_starttime(p.pid)} for p in (recorded, node_agent)]
        helpers.append({"pid": os.getpid(), "start": proc_starttime(os.getpid())})  # this very process
        _settle_helpers(helpers, [], "", grace=0.05)
        assert recorded.wait(10) == -9
        assert node_agent.poll() is None
