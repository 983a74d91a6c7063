"""containerd 2.1's own checkpoint archives (CRI CheckpointContainer), imported and restored on the test bed.

The archives are made by the bed's containerd itself, through its CRI
RuntimeService, from running containers: a Python process on the Debian
image in its own PID namespace (the kubelet's default) and in the pod's
shared one, and a container that joined another container's PID namespace,
which the import refuses.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import grpc
import pytest

from node_agent._proto.k8s.cri.runtime.v1 import api_pb2 as cri
from node_agent._proto.k8s.cri.runtime.v1 import api_pb2_grpc as cri_grpc
from node_agent.cri.client import grpc_target
from node_agent.store import Store
from testbed.bed import Bed, container_config, container_detail, make_pod, pod_detail, remove_pod, ticks, wait_for

# CRI NamespaceMode.
POD, CONTAINER, TARGET = 0, 1, 3

# The workload: it changes its writable layer (a file deleted from the image, a directory
# emptied and made again, a file it appends to through a descriptor held open), then prints
# its counter with its PID and the start time the kernel gave it, both read once at start.
# A restored process goes on with the same values; a restarted one would begin at tick 1
# with a new start time.
WORKLOAD = """\
import os, shutil, time
START = open('/proc/self/stat').read().rsplit(')', 1)[1].split()[19]
PID = os.getpid()
os.remove('/etc/motd')
shutil.rmtree('/etc/apt')
os.makedirs('/etc/apt')
with open('/etc/apt/only.conf', 'w') as fh:
    fh.write('made by the workload\\n')
os.makedirs('/var/lib/app', exist_ok=True)
log = open('/var/lib/app/count.log', 'a')
i = 0
while True:
    i += 1
    print(f'tick {i} pid {PID} start {START}', flush=True)
    log.write(f'{i}\\n')
    log.flush()
    time.sleep(0.2)
"""


def checkpoint_container(bed: Bed, container_id: str, location: Path) -> None:
    """containerd's own CRI CheckpointContainer: it writes its archive to `location`."""

    async def go() -> None:
        async with grpc.aio.insecure_channel(grpc_target(bed.endpoint)) as ch:
            stub = cri_grpc.RuntimeServiceStub(ch)  # type: ignore[no-untyped-call]
            await stub.CheckpointContainer(
                cri.CheckpointContainerRequest(container_id=container_id, location=str(location), timeout=60),
                timeout=120,
            )

    asyncio.run(go())


def namespaced(name: str, image: str, command: list[str], pid: int, target: str = "") -> dict[str, Any]:
    cfg = container_config(name, image, command)
    options: dict[str, Any] = {"network": POD, "pid": pid, "ipc": POD}
    if target:
        options["target_id"] = target
    cfg["linux"] = {"security_context": {"namespace_options": options}}
    return cfg


def archive_members(path: Path) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(path, mode="r:") as tf:
        return {m.name.rstrip("/"): m for m in tf}


def stat_line(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status", encoding="utf-8") as fh:
        return dict(line.split(":\t", 1) for line in fh.read().splitlines() if ":\t" in line)


def ns_pid(pid: int) -> int:
    """A host process's PID in its own (innermost) PID namespace."""
    return int(stat_line(pid)["NSpid"].split()[-1])


def in_pid_namespace(pid: int) -> dict[int, str]:
    """Every process in `pid`'s PID namespace: its PID there -> its command line."""
    ino = os.stat(f"/proc/{pid}/ns/pid").st_ino
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{entry}/ns/pid").st_ino != ino:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                found[ns_pid(int(entry))] = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, KeyError):
            continue
    return found


def lines(path: str) -> list[list[str]]:
    """The `tick N pid P start S` lines of a CRI log, split."""
    out = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            words = line.split()
            if "tick" in words:
                out.append(words[words.index("tick"):])
    return out


@pytest.mark.usefixtures("allow_foreign")  # containerd's archive: restored only with restore.allow-foreign
@pytest.mark.parametrize("pid_mode", [CONTAINER, POD], ids=["own-pid-namespace", "pod-pid-namespace"])
def test_native_archive_restores_the_same_python_process(agent: Bed, tmp_path: Path, pid_mode: int) -> None:
    debian = agent.info["images"]["debian"]
    src = make_pod(agent, "e2e-native-src", [namespaced("app", debian, ["python3", "-c", WORKLOAD], pid_mode)])
    new_pod = ""
    ckpt = ""
    try:
        src_cid = src.containers["app"]
        src_detail = container_detail(agent, src_cid)
        wait_for(lambda: len(ticks(src_detail.log_path)) >= 5, what="source ticks")
        archive = tmp_path / "app.tar"
        checkpoint_container(agent, src_cid, archive)
        at_checkpoint = max(ticks(src_detail.log_path))
        src_words = lines(src_detail.log_path)[0]
        src_pid_in_ns = ns_pid(src_detail.pid)
        assert src_words[3] == str(src_pid_in_ns)
        if pid_mode == CONTAINER:
            assert src_pid_in_ns == 1
        else:  # the pod's namespace: the pause process is PID 1, the container's are not
            assert src_pid_in_ns != 1
            assert in_pid_namespace(src_detail.pid)[1] == "/pause"

        # What containerd wrote: its own layout, the writable layer as a gzip OCI layer.
        members = archive_members(archive)
        assert {"checkpoint/inventory.img", "config.dump", "spec.dump", "status.dump", "rootfs-diff.tar",
                "stats-dump", "dump.log", "container.log"} <= set(members), sorted(members)
        with tarfile.open(archive, mode="r:") as tf:
            layer = tf.extractfile("rootfs-diff.tar").read()  # type: ignore[union-attr]
            status = json.loads(tf.extractfile("status.dump").read())  # type: ignore[union-attr]
        assert layer[:2] == b"\x1f\x8b" and status["metadata"]["name"] == "app"
        with tarfile.open(fileobj=io.BytesIO(layer), mode="r:gz") as tf:
            whiteouts = {m.name for m in tf if os.path.basename(m.name).startswith(".wh.")}
        # containerd's differ whites out each entry of the emptied directory.
        assert {"etc/.wh.motd", "etc/apt/.wh.sources.list"} <= whiteouts, whiteouts

        imported = json.loads(agent.cli("import", str(archive), "--namespace", "e2e-native-dst", "-o", "json").stdout)
        ckpt = imported["id"]
        assert imported["pod_namespace"] == "e2e-native-dst"
        assert [(c["name"], c["image"], c["id"]) for c in imported["containers"]] == [("app", debian, src_cid)]

        # Stored as the restore applies a diff: a plain tar, the whiteouts as lists; the source's
        # log and containerd's own records are not kept.
        store = Store(agent.store)
        rec = store.get(ckpt)
        assert rec.metadata["imported"]["format"] == "containerd"
        stored = {f.path for f in rec.files if f.type == "file"}
        assert not any(os.path.basename(p) in ("container.log", "status", "status.dump") for p in stored), stored
        assert "containers/app/checkpoint/stats-dump" in stored and "containers/app/dump.log" in stored

        def read(path: str) -> bytes:
            with store.open(ckpt, path) as fh:
                return bytes(fh.read(fh.size))

        with tarfile.open(fileobj=io.BytesIO(read("containers/app/rootfs-diff.tar")), mode="r:") as tf:
            names = {m.name.rstrip("/") for m in tf}
        assert "var/lib/app/count.log" in names and "etc/apt/only.conf" in names
        assert not any(".wh." in n for n in names), names
        assert {"etc/motd", "etc/apt/sources.list"} <= set(json.loads(read("containers/app/deleted.files")))
        pod_cfg = json.loads(read("pod/config.json"))["config"]
        assert pod_cfg["linux"]["security_context"]["namespace_options"]["pid"] == pid_mode

        res = json.loads(agent.cli("restore", ckpt, "--namespace", "e2e-native-dst", "--start", "-o", "json").stdout)
        new_pod = res["pod_sandbox_id"]
        [(name, cid)] = [(c["name"], c["container_id"]) for c in res["containers"]]
        assert name == "app"
        d = container_detail(agent, cid)
        assert d.container.state == "CONTAINER_RUNNING"
        wait_for(lambda: len(lines(d.log_path)) >= 3, what="restored ticks")
        restored = lines(d.log_path)
        counter = [int(w[1]) for w in restored]
        # The same process: the counter goes on from the dumped point, and the PID and the start
        # time it read when it started are the source's.
        assert 5 < counter[0] <= at_checkpoint + 1, f"restored counter starts at {counter[0]}"
        assert counter == list(range(counter[0], counter[0] + len(counter)))
        assert {(w[3], w[5]) for w in restored} == {(src_words[3], src_words[5])}
        assert ns_pid(d.pid) == src_pid_in_ns
        if pid_mode == POD:
            # In the new pod's namespace, beside its pause process.
            assert in_pid_namespace(d.pid)[1] == "/pause"
            new_pause = pod_detail(agent, new_pod).pid
            assert os.stat(f"/proc/{d.pid}/ns/pid").st_ino == os.stat(f"/proc/{new_pause}/ns/pid").st_ino
        # Its writable layer is the dumped one: the deletion, the opaque directory, the file it
        # appends to through the descriptor it kept.
        root = f"/proc/{d.pid}/root"
        assert not os.path.lexists(f"{root}/etc/motd")
        assert os.listdir(f"{root}/etc/apt") == ["only.conf"]
        held = [os.readlink(f"/proc/{d.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{d.pid}/fd")]
        assert "/var/lib/app/count.log" in held, held
        wait_for(lambda: len(ticks(f"{root}/var/lib/app/count.log")) > counter[0], what="count.log goes on")
        counts = ticks(f"{root}/var/lib/app/count.log")
        assert counts == list(range(1, len(counts) + 1))
        with open(f"/proc/{d.pid}/cgroup", encoding="utf-8") as fh:
            cgroups = fh.read()
        assert cid in cgroups and src_cid not in cgroups
        # containerd left the source running.
        n = max(ticks(src_detail.log_path))
        wait_for(lambda: max(ticks(src_detail.log_path)) > n, what="the source keeps ticking")
        agent.cli("checkpoints", "rm", ckpt)
        ckpt = ""
    finally:
        if new_pod:
            remove_pod(agent, new_pod)
        remove_pod(agent, src.id)
        if ckpt:
            agent.cli("checkpoints", "rm", ckpt, check=False)


def test_native_archive_of_a_container_in_another_containers_pid_namespace_is_refused(
        agent: Bed, tmp_path: Path) -> None:
    busybox = agent.info["images"]["busybox"]
    src = make_pod(agent, "e2e-native-target", [
        namespaced("main", busybox, ["sh", "-c", "while :; do sleep 0.2; done"], CONTAINER),
    ])
    try:
        # CRI TARGET: the container joins the PID namespace of "main", not the pod's.
        pcfg = pod_detail(agent, src.id).config
        cfg = namespaced("peek", busybox, ["sh", "-c", "while :; do sleep 0.2; done"], TARGET,
                         target=src.containers["main"])
        os.makedirs(os.path.join(src.log_dir, "peek"), exist_ok=True)

        async def add(cri_client: Any) -> str:
            cid: str = await cri_client.create_container(src.id, cfg, pcfg)
            await cri_client.start_container(cid)
            return cid

        peek = agent.cri(add)
        spec_ns = {ns["type"]: ns.get("path", "") for ns in container_detail(agent, peek).spec["linux"]["namespaces"]}
        main_pid = container_detail(agent, src.containers["main"]).pid
        assert spec_ns["pid"] == f"/proc/{main_pid}/ns/pid", spec_ns
        archive = tmp_path / "peek.tar"
        checkpoint_container(agent, peek, archive)
        assert "checkpoint/inventory.img" in archive_members(archive)
        before = {r.id for r in Store(agent.store).list()}
        cp = agent.cli("import", str(archive), "--namespace", "e2e-native-dst", check=False)
        assert cp.returncode != 0 and "FAILED_PRECONDITION" in cp.stderr, cp.stdout + cp.stderr
        assert "another container's PID namespace" in cp.stderr, cp.stderr
        assert "its own PID namespace or shares its pod's" in cp.stderr, cp.stderr
        assert {r.id for r in Store(agent.store).list()} == before
        work = os.path.join(agent.store, "work")
        assert not any(n.startswith("import-") for n in os.listdir(work)) if os.path.isdir(work) else True
    finally:
        remove_pod(agent, src.id)
