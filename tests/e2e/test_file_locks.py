"""File locks by default, on a real workload: python3 and sqlite3 from Debian's packages.

`lockserver` (scripts/testbed_images/lockserver.py, in the bed's Debian image) keeps one sqlite connection
open in WAL mode with its database in the writable layer (POSIX locks and a shared mapping of the -shm
file), and a child process that holds an flock on a lock file.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import pytest

from testbed.bed import (
    Bed, PodHandle, ask, container_config, container_detail, make_pod, pod_detail, pods_in, remove_pod, ticks,
    volume_dir, wait_for,
)
from tests.e2e.test_verified_restores import our_helpers as lazy_helpers


def _lockserver(bed: Bed, namespace: str, *, lock: str = "/var/lib/app/app.lock", uid: str | None = None,
                mounts: list[dict[str, Any]] | None = None) -> PodHandle:
    return make_pod(bed, namespace, [container_config("app", bed.info["images"]["debian"], [
        "/usr/local/bin/lockserver", "--rows", "5000", "--lock", lock, "--port", "8080",
    ], mounts=mounts)], uid=uid)


def _state(ip: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(ask(ip, timeout=20))
    return doc


def _answering(ip: str) -> dict[str, Any] | None:
    try:
        return _state(ip)
    except (OSError, ValueError):
        return None


def test_sqlite_in_wal_mode_and_an_flock_checkpoint_by_default_and_restore_as_the_same_processes(agent: Bed) -> None:
    src = _lockserver(agent, "e2e-locks")
    new_pod = ""
    try:
        ip = pod_detail(agent, src.id).ip
        before = wait_for(lambda: _answering(ip), timeout=60, what="lockserver to answer")
        assert before["journal_mode"] == "wal" and before["rows"] == 5000 and before["lock_held"] is True
        ckpt = agent.cli("checkpoint", src.id).stdout.strip().splitlines()[-1]
        info = json.loads(agent.cli("checkpoints", "inspect", ckpt, "-o", "json").stdout)
        assert info["options"].get("file-locks") == "true", info["options"]

        out = agent.cli("restore", ckpt, "--namespace", "e2e-locks-dst", "--start").stdout.split()
        new_pod, cid = out[0], out[2]
        assert container_detail(agent, cid).container.state == "CONTAINER_RUNNING"
        after = wait_for(lambda: _answering(pod_detail(agent, new_pod).ip), timeout=60, what="the restored server")
        # The same processes by their own account, with the same data read through the connection they kept.
        for key in ("pid", "started", "starttime_ticks", "lock_pid", "rows", "checksum", "journal_mode"):
            assert after[key] == before[key], (key, before, after)
        assert after["lock_held"] is True
        assert after["ticks"] > before["ticks"]
        log = container_detail(agent, cid).log_path
        first = wait_for(lambda: ticks(log), what="restored ticks")[0]
        assert first > 1, f"the counter restarted: first tick {first}"
        # The source goes on too.
        assert _state(ip)["lock_held"] is True
        agent.cli("checkpoints", "rm", ckpt)
    finally:
        if new_pod:
            remove_pod(agent, new_pod)
        remove_pod(agent, src.id)


def test_file_locks_false_gives_criu_refusal(agent: Bed) -> None:
    src = _lockserver(agent, "e2e-locks2")
    try:
        ip = pod_detail(agent, src.id).ip
        wait_for(lambda: _answering(ip), timeout=60, what="lockserver to answer")
        cp = agent.cli("checkpoint", src.id, "--option", "file-locks=false", check=False)
        assert cp.returncode != 0 and "FAILED_PRECONDITION" in cp.stderr, cp.stderr
        assert "file locks" in cp.stderr.lower() and "--option file-locks=true" in cp.stderr, cp.stderr
        assert _state(ip)["lock_held"] is True  # the pod runs on, thawed
    finally:
        remove_pod(agent, src.id)


def test_a_lock_held_by_the_live_source_on_a_shared_volume_fails_the_restore_by_name(agent: Bed) -> None:
    uid = str(uuid.uuid4())
    vol = volume_dir(agent, uid, "shared")
    src = _lockserver(agent, "e2e-locks3", lock="/shared/app.lock", uid=uid,
                      mounts=[{"container_path": "/shared", "host_path": vol}])
    try:
        ip = pod_detail(agent, src.id).ip
        wait_for(lambda: _answering(ip), timeout=60, what="lockserver to answer")
        ckpt = agent.cli("checkpoint", src.id).stdout.strip().splitlines()[-1]
        for start in ([], ["--start"]):
            cp = agent.cli("restore", ckpt, "--namespace", "e2e-locks3-dst", *start, check=False, timeout=120)
            assert cp.returncode != 0 and "FAILED_PRECONDITION" in cp.stderr, cp.stderr
            assert "phase file-locks" in cp.stderr and "/shared/app.lock" in cp.stderr, cp.stderr
            assert os.path.join(vol, "app.lock") in cp.stderr and "container app" in cp.stderr, cp.stderr
            assert pods_in(agent, "e2e-locks3-dst") == [], "a failed restore left a sandbox"
            assert not os.listdir(os.path.join(agent.store, "plans"))
            assert not lazy_helpers(agent)
        assert _state(ip)["lock_held"] is True
        # Once the source has let go of its lock, the same checkpoint restores, holding it again.
        remove_pod(agent, src.id)
        out = agent.cli("restore", ckpt, "--namespace", "e2e-locks3-dst", "--start").stdout.split()
        try:
            after = wait_for(lambda: _answering(pod_detail(agent, out[0]).ip), timeout=60, what="the restored server")
            assert after["lock_held"] is True
        finally:
            remove_pod(agent, out[0])
        agent.cli("checkpoints", "rm", ckpt)
    finally:
        remove_pod(agent, src.id)


@pytest.fixture(autouse=True)
def _debian_image(agent: Bed) -> None:
    assert "debian" in agent.info["images"], "the test bed builds a Debian image (scripts/testbed)"
