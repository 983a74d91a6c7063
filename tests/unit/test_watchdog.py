"""The freezer and the thaw watchdog, on a real cgroup of this machine."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from conftest import wait_for
from criu_bridge import freezer
from criu_bridge import watchdog as wd
from criu_bridge.freezer import Freezer, parse_proc_cgroup


def test_parse_proc_cgroup() -> None:
    text = "12:freezer:/k8s.io/abc\n11:cpu,cpuacct:/k8s.io/abc\n0::/system.slice/x\n"
    assert parse_proc_cgroup(text) == ("/k8s.io/abc", "/system.slice/x")
    assert parse_proc_cgroup("0::/a\n") == (None, "/a")


@pytest.fixture
def victim() -> Iterator[tuple[subprocess.Popen[bytes], Freezer]]:
    """A process alone in a fresh freezer cgroup."""
    assert os.geteuid() == 0, "needs root to make a cgroup"
    name = "node-agent-test-" + secrets.token_hex(4)
    if os.path.isdir("/sys/fs/cgroup/freezer"):
        path, version = f"/sys/fs/cgroup/freezer/{name}", 1
    else:
        path, version = f"/sys/fs/cgroup/{name}", 2
    os.mkdir(path)
    proc = subprocess.Popen(["sleep", "300"])
    Path(path, "cgroup.procs").write_text(str(proc.pid))
    fz = freezer.freezer_of(proc.pid)
    assert fz == Freezer(path, version)
    try:
        yield proc, fz
    finally:
        freezer.thaw(fz)
        proc.kill()
        proc.wait()
        # The kernel moves a reaped process out of its cgroup a moment later.
        wait_for(lambda: not Path(path, "cgroup.procs").read_text().strip(), what="the cgroup emptied")
        os.rmdir(path)


def test_freeze_and_thaw(victim: tuple[subprocess.Popen[bytes], Freezer]) -> None:
    _, fz = victim
    freezer.freeze(fz)
    assert freezer.state(fz) == "FROZEN"
    freezer.thaw(fz)
    assert freezer.state(fz) == "THAWED"


def test_watchdog_thaws_when_the_agent_goes_away(victim: tuple[subprocess.Popen[bytes], Freezer], tmp_path: Path) -> None:
    _, fz = victim
    armed = wd.arm([fz], max_freeze=60, log_path=str(tmp_path / "wd.log"))
    freezer.freeze(fz)
    armed.release()  # what the kernel does when the agent dies: EOF
    wait_for(lambda: freezer.state(fz) == "THAWED", timeout=2, what="thawed when the agent went away")
    assert armed.wait(10) == 0
    assert "thawing" in (tmp_path / "wd.log").read_text()


def test_watchdog_thaws_after_the_freeze_limit(victim: tuple[subprocess.Popen[bytes], Freezer], tmp_path: Path) -> None:
    _, fz = victim
    armed = wd.arm([fz], max_freeze=0.3, log_path=str(tmp_path / "wd.log"))
    freezer.freeze(fz)
    wait_for(lambda: freezer.state(fz) == "THAWED", what="thawed at the freeze limit")
    assert "the freeze limit passed" in (tmp_path / "wd.log").read_text()
    armed.release()
    assert armed.wait(10) == 0


def test_watchdog_stands_down(victim: tuple[subprocess.Popen[bytes], Freezer], tmp_path: Path) -> None:
    _, fz = victim
    armed = wd.arm([fz], max_freeze=60, log_path=str(tmp_path / "wd.log"))
    freezer.freeze(fz)
    armed.stand_down()
    assert armed.wait(10) == 0
    assert freezer.state(fz) == "FROZEN"  # the agent said it handles the thaw


def test_watchdog_outlives_a_refreezing_helper(victim: tuple[subprocess.Popen[bytes], Freezer], tmp_path: Path) -> None:
    """A helper that re-freezes on exit (as CRIU does) is waited out, then thawed again."""
    _, fz = victim
    armed = wd.arm([fz], max_freeze=60, log_path=str(tmp_path / "wd.log"))
    freezer.freeze(fz)
    # The helper re-freezes the cgroup when told to, then ends.
    helper = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.readline(); open(sys.argv[1],'w').write(sys.argv[2])",
         fz.control, "FROZEN" if fz.version == 1 else "1"],
        stdin=subprocess.PIPE,
    )
    armed.follow(helper.pid)
    armed.release()
    wait_for(lambda: freezer.state(fz) == "THAWED", what="thawed when the agent went away")
    assert armed.proc.poll() is None, "the watchdog left while a helper it follows still runs"
    helper.communicate(b"go\n", timeout=10)
    wait_for(lambda: freezer.state(fz) == "THAWED", what="thawed again after the helper re-froze")
    assert armed.wait(10) == 0
    assert "all thawed" in (tmp_path / "wd.log").read_text()


def test_helper_process_tracking() -> None:
    p = subprocess.Popen(["sh", "-c", "sleep 5 & wait"])
    try:
        start = wd.proc_starttime(p.pid)
        assert start is not None and wd.alive(p.pid, start)
        tracked = {p.pid: start}

        def child_found() -> bool:
            wd.descendants(tracked)
            return len(tracked) == 2

        wait_for(child_found, timeout=5, what="the shell's child tracked")
    finally:
        p.kill()
        p.wait()
    assert not wd.alive(p.pid, start)
