"""The restore handler as containerd reports it, and the check after StartContainer (node_agent.runtime_handler)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from criu_bridge import wrapper
from node_agent import errors, runtime_handler
from node_agent.config.schema import Settings
from node_agent.cri.types import Container, ContainerDetail


def _status(binary: str, annotations: list[str] | None) -> dict[str, str]:
    """containerd 1.6's verbose Status info, as the test bed's containerd answers it."""
    runtime = {"runtimeType": "io.containerd.runc.v2", "runtimePath": "", "PodAnnotations": None,
               "ContainerAnnotations": annotations, "runtimeRoot": "",
               "options": {"BinaryName": binary, "Root": "/run/x/runc", "SystemdCgroup": False}}
    cfg = {"containerd": {"snapshotter": "overlayfs", "defaultRuntimeName": "runc",
                          "runtimes": {"criu": runtime, "runc": {"options": {"Root": "/run/x/runc"}}}},
           "cni": {}, "sandboxImage": "pause"}
    return {"config": json.dumps(cfg), "golang": '"go1.19"'}


class FakeCri:
    def __init__(self, info: dict[str, str], pid: int = 0) -> None:
        self.info = info
        self.pid = pid
        self.stopped: list[str] = []

    async def status_info(self) -> dict[str, str]:
        return self.info

    async def container_status(self, cid: str) -> ContainerDetail:
        c = Container(cid, "pod", "app", 0, "CONTAINER_RUNNING", "img", "ref", 0)
        return ContainerDetail(c, {}, {}, self.pid, "/log")

    async def stop_container(self, cid: str, *, timeout: int = 0) -> None:
        self.stopped.append(cid)


@pytest.fixture
def node(tmp_path: Path) -> tuple[Settings, str]:
    s = Settings(store=str(tmp_path / "store"), runc_root="/run/x/runc/k8s.io")
    launcher = tmp_path / "store" / "bin" / "node-agent-runc"
    wrapper.install(str(launcher), python=sys.executable, runc="/usr/bin/runc", plans_dir=s.plans_dir)
    return s, str(launcher)


def test_a_handler_serving_this_agent_passes(node: tuple[Settings, str]) -> None:
    s, launcher = node
    view = runtime_handler.view_from_status(_status(launcher, [wrapper.PLAN_ANNOTATION]), "criu")
    assert view.binary == launcher and view.serves == s.plans_dir and view.problems(s) == []
    assert asyncio.run(runtime_handler.require(FakeCri(_status(launcher, ["node-agent.io/*"])), s, "criu", "x")).found


def test_a_handler_serving_another_store_is_refused_with_everything_needed_to_fix_it(
        node: tuple[Settings, str], tmp_path: Path) -> None:
    s, _ = node
    other = tmp_path / "other" / "bin" / "node-agent-runc"
    wrapper.install(str(other), python=sys.executable, runc="/usr/bin/runc", plans_dir=str(tmp_path / "other/plans"))
    s = msgspec.structs.replace(s, config_file="/etc/node-agent/config.yaml")
    with pytest.raises(errors.FailedPrecondition) as e:
        asyncio.run(runtime_handler.require(FakeCri(_status(str(other), [wrapper.PLAN_ANNOTATION])), s, "criu",
                                    "restore as pod staging/copy"))
    msg = str(e.value)
    for needle in ("restore as pod staging/copy", "'criu'", str(other), str(tmp_path / "other/plans"), s.plans_dir,
                   "node-agent containerd-config --config /etc/node-agent/config.yaml", "restart containerd"):
        assert needle in msg, (needle, msg)


@pytest.mark.parametrize("binary, annotations, needle", [
    ("", [wrapper.PLAN_ANNOTATION], "sets no options.BinaryName"),
    ("/usr/bin/runc", [wrapper.PLAN_ANNOTATION], "not a node-agent launcher"),
    (None, None, "does not pass the annotation"),
    (None, ["io.kubernetes.*"], "does not pass the annotation"),
])
def test_each_handler_problem_is_named(node: tuple[Settings, str], binary: str | None,
                                       annotations: list[str] | None, needle: str) -> None:
    s, launcher = node
    problems = runtime_handler.view_from_status(_status(launcher if binary is None else binary, annotations), "criu").problems(s)
    assert len(problems) == 1 and needle in problems[0], problems
    missing = runtime_handler.view_from_status(_status(launcher, []), "kata")
    assert missing.problems(s) == ["containerd has no runtime handler 'kata'"]


def test_annotation_patterns_match_as_containerd_does() -> None:
    assert runtime_handler.annotation_matches("node-agent.io/*", wrapper.PLAN_ANNOTATION)
    assert runtime_handler.annotation_matches(wrapper.PLAN_ANNOTATION, wrapper.PLAN_ANNOTATION)
    assert not runtime_handler.annotation_matches("*", wrapper.PLAN_ANNOTATION)  # `*` stops at `/`
    assert not runtime_handler.annotation_matches("node-agent.io", wrapper.PLAN_ANNOTATION)


def test_a_status_without_a_config_cannot_be_checked() -> None:
    with pytest.raises(errors.FailedPrecondition):
        runtime_handler.view_from_status({}, "criu")


CID = "d" * 64


def _plan(s: Settings, record: dict[str, Any] | None) -> str:
    d = Path(s.plans_dir) / CID
    d.mkdir(parents=True)
    (d / "plan.json").write_text(json.dumps({"nonce": "n1", "pod": "ns/p", "container": "app"}))
    if record is not None:
        (d / "restored").write_text(json.dumps(record))
    return str(d)


def test_a_container_restored_from_its_plan_passes(node: tuple[Settings, str]) -> None:
    s, launcher = node
    plan = _plan(s, {"container_id": CID, "checkpoint": "sha256:1", "nonce": "n1", "pid": 321})
    cri = FakeCri(_status(launcher, [wrapper.PLAN_ANNOTATION]), pid=321)
    asyncio.run(runtime_handler.verify_restored(cri, s, CID, plan, "n1", where="w", handler="criu"))
    assert cri.stopped == [] and runtime_handler.plan_nonce(plan) == "n1"


def test_a_container_started_without_its_plan_is_stopped_and_fails_precondition(
        node: tuple[Settings, str], tmp_path: Path) -> None:
    s, _ = node
    plan = _plan(s, None)
    cri = FakeCri(_status(str(tmp_path / "nowhere"), [wrapper.PLAN_ANNOTATION]), pid=99)
    with pytest.raises(errors.FailedPrecondition) as e:
        asyncio.run(runtime_handler.verify_restored(cri, s, CID, plan, "n1", where="restore of pod ns/p, container app",
                                            handler="criu"))
    assert cri.stopped == [CID]
    msg = str(e.value)
    assert "container app" in msg and "phase verify-start" in msg and "from the beginning" in msg
    assert "not a node-agent launcher" in msg and "stopped" in msg


@pytest.mark.parametrize("record, pid, needle", [
    ({"container_id": CID, "nonce": "n1", "pid": 321}, 400, "not the one CRIU restored (PID 321)"),
    ({"container_id": "e" * 64, "nonce": "n1", "pid": 321}, 321, "another container or plan"),
    ({"container_id": CID, "nonce": "other", "pid": 321}, 321, "another container or plan"),
])
def test_a_restore_record_that_does_not_match_stops_the_container(
        node: tuple[Settings, str], record: dict[str, Any], pid: int, needle: str) -> None:
    s, launcher = node
    plan = _plan(s, record)
    cri = FakeCri(_status(launcher, [wrapper.PLAN_ANNOTATION]), pid=pid)
    with pytest.raises(errors.Internal) as e:
        asyncio.run(runtime_handler.verify_restored(cri, s, CID, plan, "n1", where="w", handler="criu"))
    assert needle in str(e.value) and cri.stopped == [CID]


def test_the_wrappers_account_is_a_precondition_only_before_runc_ran(tmp_path: Path) -> None:
    """Refused before runc ran: that is the reason. CRIU's failure, and a filled restore its pre-resume gate
    stopped (the page source had failed, or was gone), are INTERNAL: the agent asks the page source first."""
    where = "restore of pod ns/p, container app"
    for text, code in ((f"{where}, phase privileges: the images grant CAP_SYS_ADMIN", errors.FailedPrecondition),
                       (f"{where}, phase restore: Error (criu/cr-restore.c:1): x", errors.Internal),
                       (f"{where}, phase lazy-pages: the page source cannot be reached (Connection refused); it "
                        f"failed or is gone; {wrapper.GATE_KILLED} (full CRIU log: /p/work/restore.log)",
                        errors.Internal)):
        (tmp_path / wrapper.FAILED).write_text(text)
        got = runtime_handler.refusal(str(tmp_path))
        assert type(got) is code and str(got) == text
    (tmp_path / wrapper.FAILED).unlink()
    assert runtime_handler.refusal(str(tmp_path)) is None
