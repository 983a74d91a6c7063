"""A shared PID namespace's next PID, moved past every PID a pod's restore takes back (criu_bridge.pidns).

The namespaces here are real: `unshare` makes one whose only process sleeps, and what the next process
born in it gets is read by starting one there (`nsenter`), as a restored container's fork would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from criu_bridge import pidns, taskimages, wrapper
from node_agent import errors, podformat
from node_agent.store import Store
from tests.unit.criu_images import Checkpoint, spec

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a PID namespace of its own, setns)")


def test_the_highest_pid_counts_tasks_threads_groups_and_sessions(tmp_path: Path) -> None:
    ck = Checkpoint(tmp_path)
    ck.write()
    assert taskimages.highest_pid((tmp_path / "pstree.img").read_bytes()) == 23
    ck.tasks = [(7, [7, 31]), (23, [23])]  # a thread of 7's above every task
    ck.write()
    assert taskimages.highest_pid((tmp_path / "pstree.img").read_bytes()) == 31


def test_a_spec_joins_a_pid_namespace_only_by_its_path() -> None:
    assert pidns.joined(spec()) is None  # its own
    assert pidns.joined({"linux": {"namespaces": [{"type": "network"}]}}) is None  # the host's
    assert pidns.joined(spec(linux__namespaces=[{"type": "pid", "path": "/proc/42/ns/pid"}])) == "/proc/42/ns/pid"
    assert pidns.joined({"linux": {"namespaces": "pid"}}) is None


@pytest.fixture
def namespace() -> Iterator[int]:
    """A new PID namespace whose one process sleeps; yields that process's PID on this host."""
    holder = subprocess.Popen(["unshare", "--pid", "--fork", "sleep", "600"])
    try:
        def inner() -> int | None:
            try:
                with open(f"/proc/{holder.pid}/task/{holder.pid}/children", encoding="ascii") as fh:
                    kids = fh.read().split()
            except FileNotFoundError:
                return None
            return int(kids[0]) if kids else None

        deadline = time.monotonic() + 30
        while (pid := inner()) is None:
            assert holder.poll() is None and time.monotonic() < deadline, "unshare did not start its child"
            time.sleep(0.01)
        yield pid
    finally:
        holder.kill()
        holder.wait()


def _next_pid(pid: int) -> int:
    """The PID the namespace of `pid` gives the next process born in it (one is born to say so)."""
    out = subprocess.run(["nsenter", "--target", str(pid), "--pid", "--", "sh", "-c", "echo $$"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout)


@needs_root
def test_advance_moves_the_next_pid_past_the_floor_and_never_back(namespace: int) -> None:
    path = f"/proc/{namespace}/ns/pid"
    assert _next_pid(namespace) < 100  # a new namespace counts from 1
    pidns.advance(path, 5000)
    assert _next_pid(namespace) == 5001
    pidns.advance(path, 300)  # lower: left where it is (its helper, born there, took 5002 itself)
    assert _next_pid(namespace) == 5003


def test_advance_says_why_it_cannot(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        pidns.advance(str(tmp_path / "no-such-namespace"), 10)


# ---- the restore wrapper: the namespace moved before runc restore runs -------------------------

CID = "c" * 64


@pytest.fixture
def env(tmp_path: Path) -> dict[str, Path]:
    record = tmp_path / "runc-args"
    fake = tmp_path / "fake-runc"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {record}\nexit 0\n')
    fake.chmod(0o755)
    plans = tmp_path / "plans"
    bundle = tmp_path / "bundle"
    (bundle / "rootfs").mkdir(parents=True)
    launcher = tmp_path / "node-agent-runc"
    wrapper.install(str(launcher), python=sys.executable, runc=str(fake), plans_dir=str(plans))
    return {"record": record, "plans": plans, "bundle": bundle, "launcher": launcher}


def _restore(env: dict[str, Path], namespaces: list[dict[str, str]], pid_floor: object) -> subprocess.CompletedProcess[str]:
    (env["bundle"] / "config.json").write_text(json.dumps({**spec(linux__namespaces=namespaces),
                                                           "root": {"path": "rootfs"}}))
    d = env["plans"] / CID
    Checkpoint(d / "images").write()
    (d / "plan.json").write_text(json.dumps({"version": 1, "pod": "ns/p", "container": "app", "options": [],
                                             "pid_floor": pid_floor}))
    log = env["bundle"] / "log.json"
    return subprocess.run([str(env["launcher"]), "--log", str(log), "--log-format", "json", "create",
                           "--bundle", str(env["bundle"]), CID], capture_output=True, text=True,
                          cwd=str(env["bundle"]))


@needs_root
def test_a_restore_into_a_joined_pid_namespace_moves_it_past_the_pods_pids_first(
        env: dict[str, Path], namespace: int) -> None:
    joined = [{"type": "pid", "path": f"/proc/{namespace}/ns/pid"}, {"type": "mount"}]
    r = _restore(env, joined, 7000)
    assert r.returncode == 0, r.stderr
    assert "restore" in env["record"].read_text().split()
    assert _next_pid(namespace) == 7001


@needs_root
def test_a_restore_with_a_pid_namespace_of_its_own_leaves_others_alone(env: dict[str, Path], namespace: int) -> None:
    before = _next_pid(namespace)
    r = _restore(env, [{"type": "pid"}, {"type": "mount"}], 7000)
    assert r.returncode == 0, r.stderr
    assert _next_pid(namespace) == before + 1


@needs_root
@pytest.mark.parametrize("floor", [0, None, True, "7000"])
def test_a_plan_without_a_floor_moves_nothing(env: dict[str, Path], namespace: int, floor: object) -> None:
    before = _next_pid(namespace)
    r = _restore(env, [{"type": "pid", "path": f"/proc/{namespace}/ns/pid"}], floor)
    assert r.returncode == 0, r.stderr
    assert _next_pid(namespace) == before + 1


def test_a_namespace_that_cannot_be_entered_fails_the_restore_before_runc_runs(env: dict[str, Path]) -> None:
    r = _restore(env, [{"type": "pid", "path": "/proc/999999999/ns/pid"}], 7000)
    assert r.returncode != 0
    assert not env["record"].exists()
    logged = (env["bundle"] / "log.json").read_text()
    assert "restore of pod ns/p, container app, phase pid-namespace: /proc/999999999/ns/pid" in logged, logged


# ---- the agent's side: the floor read from every container of the checkpoint -----------------

def test_the_floor_is_the_highest_pid_of_every_container(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "store"))
    src = tmp_path / "src"
    for cname, tasks in (("shell", [(6, [6]), (40, [40])]), ("server", [(13, [13, 14])])):
        ck = Checkpoint(src / podformat.container_path(cname, podformat.IMAGES_DIR))
        ck.tasks = tasks
        ck.write()
    with store.writer() as w:
        w.add_tree("", str(src))
        record = w.commit({"kind": "test"})
    saved = podformat.SavedPod("ns", "p", {}, (("shell", {}, {}), ("server", {}, {})), ())
    assert podformat.highest_pid(store, record, saved) == 40
    bad = podformat.SavedPod("ns", "p", {}, (("shell", {}, {}), ("sidecar", {}, {})), ())
    with pytest.raises(errors.DataLoss, match="container sidecar has no"):
        podformat.highest_pid(store, record, bad)


@pytest.mark.parametrize("pid, shared", [(None, True), (0, True), (1, False), (2, False), (3, True)])
def test_the_floor_is_wanted_only_where_a_container_joins_a_shared_pid_namespace(pid: int | None,
                                                                                   shared: bool) -> None:
    # As the CRI's configs travel (JSON, integer enums; a mode left out is POD, as the runtime takes it).
    opts = {} if pid is None else {"pid": pid}
    config = {"linux": {"security_context": {"namespace_options": opts}}}
    assert podformat.shares_pids(config) is shared
    assert podformat.shares_pids({}) is True  # no options at all: the pod's namespace
    named = {0: "POD", 1: "CONTAINER", 2: "NODE", 3: "TARGET"}
    if pid is not None:
        config["linux"]["security_context"]["namespace_options"]["pid"] = named[pid]  # type: ignore[index]
        assert podformat.shares_pids(config) is shared
