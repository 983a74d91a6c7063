"""Container checkpoint archives on the real test bed: ours through export/import, and Podman's.

Podman runs with its own storage root, run root, network config dir and
cgroup parent (under the bed's), so the host's Podman state is never
touched, and everything it made is removed afterwards.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import zstandard

from node_agent import interop
from node_agent.store import Store
from testbed.bed import (
    SHELL_COUNTER, Bed, container_config, container_detail, make_pod, remove_pod, ticks, wait_for,
)

IMAGE_CACHE = "/var/cache/node-agent-testbed/images"
BLOB_CACHE_DIRS = ("/var/lib/containers", "/var/lib/containers/cache")
COUNTER = "i=0; mkdir -p /data; exec 3>>/data/c.log; while :; do i=$((i+1)); echo tick $i; echo $i >&3; sleep 0.2; done"


def test_agent_checkpoint_exported_imported_and_restored(agent: Bed, tmp_path: Path) -> None:
    imgs = agent.info["images"]
    src = make_pod(agent, "e2e-ix-src", [
        container_config("shell", imgs["busybox"], ["sh", "-c", SHELL_COUNTER.format(name="shell")]),
        container_config("idle", imgs["busybox"], ["sh", "-c", "while :; do sleep 1; done"]),
    ])
    new_pod = ""
    try:
        log = os.path.join(src.log_dir, "shell", "0.log")
        wait_for(lambda: len(ticks(log)) >= 5, what="source ticks")
        ckpt = agent.cli("checkpoint", src.id).stdout.strip().splitlines()[-1]
        at_checkpoint = max(ticks(log))

        archive = tmp_path / "shell.tar.zst"
        agent.cli("export", ckpt, "--container", "shell", "--file", str(archive))
        assert archive.read_bytes()[:4] == b"\x28\xb5\x2f\xfd"
        imported = json.loads(agent.cli("import", str(archive), "--namespace", "e2e-ix-dst", "-o", "json").stdout)
        new_id = imported["id"]
        assert new_id != ckpt
        assert imported["pod_namespace"] == "e2e-ix-dst"
        assert [c["name"] for c in imported["containers"]] == ["shell"]

        # The imported checkpoint holds the same bytes as the original, for that container.
        store = Store(agent.store)
        old, new = store.get(ckpt), store.get(new_id)
        wanted = {f.path: f for f in old.files if f.type == "file" and not f.path.startswith("containers/idle/")}
        got = {f.path: f for f in new.files if f.type == "file"}
        assert sorted(got) == sorted(wanted)
        for path in wanted:
            with store.open(ckpt, path) as a, store.open(new_id, path) as b:
                assert a.read(a.size) == b.read(b.size), path

        res = json.loads(agent.cli("restore", new_id, "--start", "-o", "json").stdout)
        new_pod = res["pod_sandbox_id"]
        assert res["namespace"] == "e2e-ix-dst"
        [(name, cid)] = [(c["name"], c["container_id"]) for c in res["containers"]]
        assert name == "shell"
        d = container_detail(agent, cid)
        assert d.container.state == "CONTAINER_RUNNING"
        wait_for(lambda: len(ticks(d.log_path)) >= 3, what="restored ticks")
        first = ticks(d.log_path)[0]
        assert 5 <= first <= at_checkpoint + 1, f"restored counter starts at {first}"
        counts = ticks(f"/proc/{d.pid}/root/data/count.log")
        assert counts[0] == 1 and counts == list(range(1, len(counts) + 1))
        agent.cli("checkpoints", "rm", new_id)
        agent.cli("checkpoints", "rm", ckpt)
    finally:
        if new_pod:
            remove_pod(agent, new_pod)
        remove_pod(agent, src.id)


@dataclass
class Podman:
    base: Path
    runroot: Path  # Podman wants it under 50 characters
    cgroup_parent: str

    def argv(self, *args: str) -> list[str]:
        return [
            "podman", "--root", str(self.base / "root"), "--runroot", str(self.runroot),
            "--storage-driver", "overlay", "--cgroup-manager", "cgroupfs", "--events-backend", "file",
            "--runtime", "runc", "--network-config-dir", str(self.base / "cni"), "--tmpdir", str(self.base / "tmp"),
            *args,
        ]

    def __call__(self, *args: str, timeout: float = 60) -> str:
        cp = subprocess.run(self.argv(*args), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if cp.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)} exited {cp.returncode}:\n{cp.stderr}\n{cp.stdout}")
        return cp.stdout


@pytest.fixture
def podman(agent: Bed) -> Iterator[Podman]:
    assert shutil.which("podman"), "podman is not installed (scripts/setup installs it)"
    base = Path(f"/var/lib/node-agent-testbed/{agent.name}/podman")
    shutil.rmtree(base, ignore_errors=True)
    for d in ("root", "cni", "tmp"):
        (base / d).mkdir(parents=True, exist_ok=True)
    runroot = Path(tempfile.mkdtemp(prefix="na-podman-", dir="/run"))
    # `podman load` records blob digests in /var/lib/containers/cache whatever --root says; if that
    # did not exist before, it goes again afterwards.
    created = [d for d in BLOB_CACHE_DIRS if not os.path.lexists(d)]
    p = Podman(base, runroot, agent.info["cgroup_parent"] + "/podman")
    try:
        yield p
    finally:
        subprocess.run(p.argv("rm", "--all", "--force", "--time", "0"), capture_output=True, timeout=60)
        subprocess.run(p.argv("rmi", "--all", "--force"), capture_output=True, timeout=60)
        # conmon runs `podman container cleanup` when a container exits: let those finish first.
        _wait_gone(_processes_mentioning(str(runroot)), 15)
        with open("/proc/self/mountinfo", encoding="utf-8") as fh:
            left = [line.split()[4] for line in fh if line.split()[4].startswith((str(base), str(runroot)))]
        for point in sorted(left, key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True, timeout=30)
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(runroot, ignore_errors=True)
        if created:
            shutil.rmtree(created[0], ignore_errors=True)


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    if text.encode() in fh.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def _wait_gone(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
        time.sleep(0.1)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _busybox_tarball() -> str:
    found = sorted(glob.glob(os.path.join(IMAGE_CACHE, "busybox-*.tar")), key=os.path.getmtime)
    assert found, f"no busybox image tarball under {IMAGE_CACHE} (the test bed builds it)"
    return found[-1]


@pytest.mark.usefixtures("allow_foreign")  # a Podman archive: restored only with restore.allow-foreign
def test_podman_checkpoint_restored_as_a_pod(agent: Bed, podman: Podman, tmp_path: Path) -> None:
    image = agent.info["images"]["busybox"]
    loaded = podman("load", "-i", _busybox_tarball())
    assert image in loaded, loaded
    cid = podman(
        "run", "-d", "--name", "Counter_1", "--network", "none", "--cgroup-parent", podman.cgroup_parent,
        "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024", image, "sh", "-c", COUNTER,
    ).strip()
    assert re.fullmatch(r"[0-9a-f]{64}", cid), cid

    def podman_ticks() -> list[int]:
        return ticks_of(podman("logs", cid))

    wait_for(lambda: len(podman_ticks()) >= 5, what="podman container ticks", interval=0.2)
    archive = tmp_path / "podman.tar"
    podman("container", "checkpoint", "--leave-running", "--export", str(archive), cid)
    at_checkpoint = max(podman_ticks())
    names = _archive_names(archive)
    assert {"config.dump", "spec.dump", "checkpoint/inventory.img", "stats-dump"} <= names, names

    store = Store(agent.store)
    t0 = time.monotonic()
    rec = interop.import_archive(
        store, str(archive), namespace="e2e-podman",
        cgroup_parent=agent.info["cgroup_parent"], log_root=agent.info["pod_log_root"],
    )
    assert time.monotonic() - t0 < 10
    meta = rec.metadata
    assert meta["imported"]["format"] == "podman" and meta["imported"]["container_id"] == cid
    assert meta["pod"]["name"] == "counter-1" and meta["containers"][0]["name"] == "counter-1"
    assert meta["containers"][0]["image"] == image

    new_pod = ""
    try:
        res = json.loads(agent.cli("restore", rec.id, "--start", "-o", "json").stdout)
        new_pod = res["pod_sandbox_id"]
        [(name, new_cid)] = [(c["name"], c["container_id"]) for c in res["containers"]]
        assert name == "counter-1" and res["namespace"] == "e2e-podman"
        d = container_detail(agent, new_cid)
        assert d.container.state == "CONTAINER_RUNNING"
        wait_for(lambda: len(ticks(d.log_path)) >= 3, what="restored ticks")
        restored = ticks(d.log_path)
        assert 5 <= restored[0] <= at_checkpoint + 1, f"restored counter starts at {restored[0]}"
        assert restored == list(range(restored[0], restored[0] + len(restored)))
        # The file it holds open in its writable layer goes on from the dumped history. With
        # --leave-running Podman captures the writable layer after the dump, while the container
        # runs again, so lines written in between are there and the restored process repeats them.
        assert os.readlink(f"/proc/{d.pid}/fd/3") == "/data/c.log"
        counts = ticks(f"/proc/{d.pid}/root/data/c.log")
        assert counts[0] == 1 and counts == sorted(counts)
        assert sorted(set(counts)) == list(range(1, counts[-1] + 1))
        assert len(counts) - len(set(counts)) <= 5
        # It runs under the new container's cgroups, not Podman's.
        with open(f"/proc/{d.pid}/cgroup", encoding="utf-8") as fh:
            cgroups = fh.read()
        assert new_cid in cgroups and cid not in cgroups
        # Podman's own container goes on too.
        n = max(podman_ticks())
        wait_for(lambda: max(podman_ticks()) > n, what="podman container keeps ticking", interval=0.2)
        agent.cli("checkpoints", "rm", rec.id)
    finally:
        if new_pod:
            remove_pod(agent, new_pod)
        files = meta["imported"].get("files")
        if files:
            shutil.rmtree(files, ignore_errors=True)


def _archive_names(path: Path) -> set[str]:
    """Member names of a plain or zstd tar (Podman compresses with zstd by default)."""
    with open(path, "rb") as raw:
        if raw.read(4) == b"\x28\xb5\x2f\xfd":
            raw.seek(0)
            with zstandard.ZstdDecompressor().stream_reader(raw) as z, tarfile.open(fileobj=z, mode="r|") as tf:
                return {m.name for m in tf}
        raw.seek(0)
        with tarfile.open(fileobj=raw, mode="r|") as tf:
            return {m.name for m in tf}


def ticks_of(text: str) -> list[int]:
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "tick" and parts[1].isdigit():
            out.append(int(parts[1]))
    return out
