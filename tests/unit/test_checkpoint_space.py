"""A checkpoint on a full store: refused before the freeze, or RESOURCE_EXHAUSTED with CRIU's reason.

The real checkpointer, store, journal and thaw watchdog, on a real small
filesystem (a tmpfs this test mounts, which needs root, as the watchdog's
tests do). The pod is a fake cgroup tree (v2 files: `cgroup.freeze`,
`cgroup.events`, `memory.current`) that the freezer and the watchdog write
to; CRI and CRIU's RPC are fakes, and runc is a script that dumps, fills
the disk or fails as a test says. It runs only once the agent has journaled
it as a helper (a file, not a sleep, orders the two).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import wait_for
from criu_bridge import freezer, mountinfo
from criu_bridge import watchdog as wd
from criu_bridge.errors import RuntimeFailure
from criu_bridge.freezer import Freezer
from node_agent import diskspace, errors
from node_agent.checkpointing import Checkpointer, CheckpointRequest
from node_agent.config.loading import from_mapping
from node_agent.config.schema import Settings
from node_agent.cri.types import Container, ContainerDetail, Pod, PodDetail
from node_agent.journal import Journal
from node_agent.metrics import Metrics
from node_agent.store import Store

MiB = 1 << 20
POD = Pod("ab" * 32, "web", "ns", "uid-1", 0, "SANDBOX_READY", 0)
APP = Container("cd" * 32, POD.id, "app", 0, "CONTAINER_RUNNING", "img", "img@sha256:" + "0" * 64, 0)
CRIU_LINE = "Unable to write pages-1.img: No space left on device"

FAKE_RUNC = r'''
import json, os, re, sys, time
mode = json.load(open(MODE))
args = sys.argv[1:]
if "--help" in args:
    print("--tcp-established --file-locks --ext-unix-sk --shell-job --leave-running")
    sys.exit(0)
images, work = args[args.index("--image-path") + 1], args[args.index("--work-path") + 1]


def recorded():
    """Has the agent journaled this process as its helper?"""
    mine = re.compile(r'"pid": %d\b' % os.getpid())
    for name in os.listdir(mode["journal"]):
        try:
            with open(os.path.join(mode["journal"], name)) as fh:
                if name.endswith(".json") and mine.search(fh.read()):
                    return True
        except FileNotFoundError:
            pass
    return False


deadline = time.monotonic() + 60
while not recorded():
    if time.monotonic() > deadline:
        sys.exit("the agent never journaled this helper")
    time.sleep(0.01)


def fill():
    """Write into the images until the filesystem is full."""
    fd = os.open(os.path.join(images, "pages-1.img"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    for size in (1 << 20, 4096):
        try:
            while True:
                os.write(fd, os.urandom(size))
        except OSError:
            pass
    os.close(fd)


if mode["run"] == "ok":
    with open(os.path.join(images, "pages-1.img"), "wb") as fh:
        fh.write(os.urandom(mode["pages"]))
    with open(os.path.join(images, "core-1.img"), "wb") as fh:
        fh.write(b"core")
    with open(os.path.join(work, "dump.log"), "w") as fh:
        fh.write("(00.000100) Dumping finished successfully\n")
    sys.exit(0)
if mode["run"] == "enospc":  # CRIU says why in its log, then the disk is full
    with open(os.path.join(work, "dump.log"), "w") as fh:
        fh.write("(00.000100) Dumping task 1\n"
                 "(00.000200) Error (criu/image.c:123): " + CRIU_LINE + "\n"
                 "(00.000300) Error (criu/cr-dump.c:2100): Dumping FAILED.\n")
fill()  # "silent": the disk filled before CRIU could log anything
print("criu failed: type NOTIFY errno 0")
print("log file: " + os.path.join(work, "dump.log"))
sys.exit(1)
'''


class FakeCri:
    async def list_pods(self) -> list[Pod]:
        return [POD]

    async def list_containers(self, pod_id: str) -> list[Container]:
        return [APP]

    async def container_status(self, container_id: str) -> ContainerDetail:
        return ContainerDetail(APP, {"metadata": {"name": "app"}}, {"mounts": []}, os.getpid(), "/var/log/app.log")

    async def pod_status(self, pod_id: str) -> PodDetail:
        return PodDetail(POD, {"metadata": {"name": "web", "namespace": "ns"}}, {}, 1)


class FakeCriu:
    class Version:
        text = "4.1"

    async def cpuinfo_dump(self, images_dir: str, *, work_dir: str | None = None) -> None:
        Path(images_dir, "cpuinfo.img").write_bytes(b"cpuinfo")

    async def version(self) -> FakeCriu.Version:
        return self.Version()


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A fresh 8 MiB tmpfs."""
    assert os.geteuid() == 0, "needs root to mount a tmpfs"
    mnt = tmp_path / "fs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


class Node:
    """A checkpointer of one pod (one container, a fake v2 cgroup), with its store on ``fs``."""

    def __init__(self, tmp: Path, fs: Path, monkeypatch: pytest.MonkeyPatch, *, memory: int, min_free: int,
                 run: str = "ok", pages: int = 0) -> None:
        self.cgroup = tmp / "cgroup" / "pod" / "app"
        self.cgroup.mkdir(parents=True)
        for name, text in {"cgroup.freeze": "0\n", "cgroup.events": "populated 1\nfrozen 1\n",
                           "cgroup.procs": "", "memory.current": f"{memory}\n"}.items():
            (self.cgroup / name).write_text(text)
        upper = tmp / "upper"
        upper.mkdir()
        (upper / "written-by-app").write_text("hello")
        self.freezes: list[str] = []
        fz = Freezer(str(self.cgroup), 2)
        real_freeze = freezer.freeze

        def freeze(f: Freezer, *, timeout: float = 10.0) -> None:
            self.freezes.append(f.path)
            real_freeze(f, timeout=timeout)

        monkeypatch.setattr(freezer, "freezer_of", lambda pid, **kw: fz)
        monkeypatch.setattr(freezer, "freeze", freeze)
        monkeypatch.setattr(mountinfo, "upperdir_of", lambda pid: str(upper))
        self.settings: Settings = from_mapping({
            "store": str(fs / "store"), "pre-dump": "never", "runc": str(tmp / "runc"),
            "min-free-bytes": min_free, "timeouts": {"cleanup": 10},
        })
        mode = tmp / "runc-mode.json"
        mode.write_text(json.dumps({"run": run, "pages": pages, "journal": self.settings.journal_dir}))
        runc = tmp / "runc"
        runc.write_text(f"#!{sys.executable}\nMODE = {str(mode)!r}\nCRIU_LINE = {CRIU_LINE!r}\n{FAKE_RUNC}")
        runc.chmod(0o755)
        self.store = Store(self.settings.store)
        self.journal = Journal(self.settings.journal_dir)
        self.checkpointer = Checkpointer(self.settings, FakeCri(), self.store, self.journal,  # type: ignore[arg-type]
                                         FakeCriu(), Metrics())  # type: ignore[arg-type]

    async def checkpoint(self) -> Any:
        return await self.checkpointer.checkpoint(CheckpointRequest(pod="ns/web"))

    def assert_left_nothing(self) -> None:
        """Thawed; nothing published, journaled, staged or left in the store's ingest area."""
        assert (self.cgroup / "cgroup.freeze").read_text().strip() == "0"
        assert self.store.list() == []
        assert os.listdir(self.settings.journal_dir) == []
        assert not os.path.isdir(self.settings.work_dir) or os.listdir(self.settings.work_dir) == []
        assert os.listdir(self.store.ingest_dir) == []
        assert os.listdir(self.store.blobs.dir) == []


def test_a_pod_whose_memory_does_not_fit_is_refused_before_the_freeze(
        tmp_path: Path, small_fs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    node = Node(tmp_path, small_fs, monkeypatch, memory=64 * MiB, min_free=MiB)
    free = node.store.free_bytes()
    assert 7 * MiB < free <= 8 * MiB
    with pytest.raises(errors.ResourceExhausted) as info:
        asyncio.run(node.checkpoint())
    assert str(info.value) == (
        f"checkpoint of pod ns/web: not enough free space in store {node.store.root}: "
        f"{free} bytes ({free / MiB:.1f} MiB) free, {65 * MiB} bytes (65.0 MiB) needed: the {64 * MiB} bytes "
        f"(64.0 MiB) of memory its containers' cgroups use, plus min-free-bytes ({MiB} bytes (1.0 MiB)); "
        "the pod was not paused and nothing was written"
    )
    assert node.freezes == []  # never frozen
    assert not (small_fs / "store" / "logs").exists()  # no watchdog was armed
    node.assert_left_nothing()
    assert node.store.free_bytes() == free


def test_room_is_asked_of_the_memory_of_every_container_plus_min_free_bytes(tmp_path: Path) -> None:
    v2 = tmp_path / "v2" / "pod"
    for name, used in (("a", 3 * MiB), ("b", 5 * MiB)):
        (v2 / name).mkdir(parents=True)
        (v2 / name / "memory.current").write_text(f"{used}\n")
    # cgroup v1: the memory hierarchy holds the container at the freezer's path.
    root = tmp_path / "v1"
    (root / "freezer" / "kubepods" / "c").mkdir(parents=True)
    (root / "memory" / "kubepods" / "c").mkdir(parents=True)
    (root / "memory" / "kubepods" / "c" / "memory.usage_in_bytes").write_text("7340032\n")
    v1 = Freezer(str(root / "freezer" / "kubepods" / "c"), 1)
    assert freezer.memory_usage(v1, cgroup_root=str(root)) == 7 * MiB
    assert freezer.memory_usage(Freezer(str(tmp_path / "gone"), 2)) is None
    fzs = [Freezer(str(v2 / "a"), 2), Freezer(str(v2 / "b"), 2), Freezer(str(tmp_path / "gone"), 2)]
    assert diskspace.pod_memory(fzs) == 8 * MiB

    class Space:
        def __init__(self, root: str, free: int) -> None:
            self.root, self.free = root, free

        def free_bytes(self) -> int:
            return self.free

    ok = Space(str(tmp_path), 9 * MiB)
    room = diskspace.require("ns/web", fzs, [ok, ok], MiB)
    assert (room.memory, room.needed, len(room.stores)) == (8 * MiB, 9 * MiB, 1)
    with pytest.raises(errors.ResourceExhausted, match=f"not enough free space in store {tmp_path}: "):
        diskspace.require("ns/web", fzs, [Space(str(tmp_path), 9 * MiB - 1)], MiB)


def test_a_full_disk_during_the_ingest_is_resource_exhausted(
        tmp_path: Path, small_fs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The cgroups say 1 MiB, but CRIU writes 5 MiB: the dump fits, the ingest (another 5 MiB) does not.
    node = Node(tmp_path, small_fs, monkeypatch, memory=MiB, min_free=0, run="ok", pages=5 * MiB)
    with pytest.raises(errors.ResourceExhausted) as info:
        asyncio.run(node.checkpoint())
    text = str(info.value)
    assert text.startswith(f"checkpoint of pod ns/web: store {node.store.root} ran out of space during ingest ("), text
    assert f"{MiB} bytes (1.0 MiB) needed: the {MiB} bytes (1.0 MiB) of memory its containers' cgroups use" in text
    assert "No space left on device" in text and "storing " in text, text
    assert text.endswith("; the pod runs on and nothing was kept"), text
    assert node.freezes == [str(node.cgroup)]
    node.assert_left_nothing()


def test_a_full_disk_during_the_dump_keeps_criu_s_reason_when_its_log_cannot_be_copied(
        tmp_path: Path, small_fs: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    node = Node(tmp_path, small_fs, monkeypatch, memory=MiB, min_free=0, run="enospc")
    with caplog.at_level(logging.WARNING, logger="node_agent.checkpointing"):
        with pytest.raises(errors.ResourceExhausted) as info:
            asyncio.run(node.checkpoint())
    text = str(info.value)
    assert text.startswith(f"checkpoint of pod ns/web: store {node.store.root} ran out of space during dump ("), text
    assert f"): container app, phase dump: {CRIU_LINE}; the pod runs on and nothing was kept" in text, text
    assert "full CRIU log" not in text  # the copy under logs/ failed: said in the agent's log, not instead of this
    copies = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cannot keep CRIU's log")]
    assert len(copies) == 1 and "No space left on device" in copies[0], copies
    node.assert_left_nothing()


def test_a_dump_failed_on_a_full_disk_without_a_word_from_criu_is_still_said_as_such(
        tmp_path: Path, small_fs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    node = Node(tmp_path, small_fs, monkeypatch, memory=MiB, min_free=MiB, run="silent")
    with pytest.raises(errors.ResourceExhausted) as info:
        asyncio.run(node.checkpoint())
    text = str(info.value)
    assert "ran out of space during dump (0 bytes (0.0 MiB) free now; " in text, text
    assert "container app, phase dump: criu failed: type NOTIFY errno 0" in text, text
    node.assert_left_nothing()


def test_only_a_full_disk_is_taken_for_one() -> None:
    room = diskspace.Room((), MiB, MiB)
    assert diskspace.disk_full(OSError(errno.ENOSPC, "No space left on device"))
    wrapped = errors.FailedPrecondition("container app, phase dump: x")
    wrapped.__cause__ = RuntimeFailure("dump", decisive=["x"])
    assert not diskspace.disk_full(wrapped)
    assert diskspace.disk_full(wrapped, low=True)  # a failed dump while the disk is below min-free-bytes
    assert not diskspace.disk_full(errors.ResourceExhausted("opening x: Too many open files"), low=True)
    assert diskspace.exhausted(asyncio.CancelledError(), "ns/web", "dump", room) is None


def test_the_watchdog_thaws_even_when_its_log_cannot_be_written(tmp_path: Path) -> None:
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "cgroup.freeze").write_text("0\n")
    (cgroup / "cgroup.events").write_text("populated 1\nfrozen 1\n")
    fz = Freezer(str(cgroup), 2)
    armed = wd.arm([fz], max_freeze=60, log_path="/dev/full")  # every write to its log fails with ENOSPC
    freezer.freeze(fz)
    armed.release()  # the agent went away
    wait_for(lambda: freezer.state(fz) == "THAWED", what="thawed although its log is full")
    assert armed.wait(10) == 0
