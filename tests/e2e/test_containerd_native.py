"""node-agent's exports read and restored by others: checkpointctl, and containerd 2.1's own restore.

checkpointctl (an outside reader of container checkpoint archives) must read
every export node-agent writes, in every compression it writes. containerd
2.1 restores a container from a checkpoint archive itself, when CRI
CreateContainer names the archive as the container's image: it pulls the
base image by the NAME@DIGEST the archive records, so the workload runs from
an image pulled out of a registry on loopback, and the restore goes into a
new sandbox under the plain `runc` handler, with no node-agent in the path.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import io
import json
import os
import secrets
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
import zstandard

from node_agent._proto.k8s.cri.runtime.v1 import api_pb2 as cri_pb
from node_agent._proto.k8s.cri.runtime.v1 import api_pb2_grpc as cri_grpc
from node_agent.cri import CriClient
from node_agent.interop.exporting import COMPRESSIONS
from testbed.bed import Bed, container_config, container_detail, make_pod, pod_config, remove_pod, ticks, wait_for
from testbed.layout import write_hosts_toml
from testbed.registry import Registry

CHECKPOINTCTL = os.environ.get("NODE_AGENT_E2E_CHECKPOINTCTL", "/opt/node-agent/containerd-2/bin/checkpointctl")
SUFFIX = {"none": ".tar", "gzip": ".tar.gz", "zstd": ".tar.zst"}
MAGIC = {"gzip": b"\x1f\x8b", "zstd": b"\x28\xb5\x2f\xfd"}

# A counter that records, once at its start, its PID in its PID namespace and its start time
# (field 22 of /proc/self/stat, in clock ticks), and repeats both on every tick: a restored
# process goes on with the values it had, a process started afresh would print new ones and
# count from 1 again. It also appends each tick to a file it holds open in its writable layer.
COUNTER = (
    "p=$$; st=$(cut -d' ' -f22 /proc/$$/stat); i=0; mkdir -p /data; exec 3>>/data/count.log; "
    "while :; do i=$((i+1)); echo tick $i pid $p start $st; echo $i >&3; sleep 0.2; done"
)

# dump_stats_entry of CRIU's stats.proto: the fields checkpointctl shows.
STATS_FIELDS = {1: "freezing_time", 2: "frozen_time", 3: "memdump_time", 4: "memwrite_time",
                5: "pages_scanned", 7: "pages_written"}


def checkpointctl(*args: str) -> str:
    cp = subprocess.run([CHECKPOINTCTL, *args], capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, f"checkpointctl {' '.join(args)} exited {cp.returncode}:\n{cp.stderr}\n{cp.stdout}"
    assert "error" not in cp.stderr.lower(), cp.stderr
    return cp.stdout


def archive_members(path: Path) -> dict[str, bytes]:
    """Name -> content of the regular files of a plain, gzip or zstd tar."""
    raw = path.read_bytes()
    if raw.startswith(MAGIC["gzip"]):
        raw = gzip.decompress(raw)
    elif raw.startswith(MAGIC["zstd"]):
        raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw)).read()
    out: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tf:
        for m in tf:
            if m.isfile():
                fh = tf.extractfile(m)
                assert fh is not None
                out[m.name] = fh.read()
    return out


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, pos


def dump_stats(stats_dump: bytes) -> dict[str, int]:
    """The dump statistics in a CRIU `stats-dump` image (two magic words, one length-prefixed stats_entry)."""
    size = int.from_bytes(stats_dump[8:12], "little")
    entry = stats_dump[12 : 12 + size]
    key, pos = _varint(entry, 0)
    assert key == (1 << 3) | 2, "stats_entry has no dump statistics"
    length, pos = _varint(entry, pos)
    dump, pos, out = entry[pos : pos + length], 0, {}
    while pos < len(dump):
        key, pos = _varint(dump, pos)
        assert key & 7 == 0, "dump_stats_entry holds only varints"
        value, pos = _varint(dump, pos)
        if key >> 3 in STATS_FIELDS:
            out[STATS_FIELDS[key >> 3]] = value
    return out


def log_lines(path: str) -> list[tuple[int, str, str]]:
    """(tick, pid, start) of each `tick N pid P start S` line of a CRI log."""
    out = []
    with contextlib.suppress(OSError), open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            parts = line.split()
            if "tick" in parts:
                i = parts.index("tick")
                rest = parts[i : i + 6]
                if len(rest) == 6 and rest[1].isdigit() and rest[2] == "pid" and rest[4] == "start":
                    out.append((int(rest[1]), rest[3], rest[5]))
    return out


def ns_pid(host_pid: int) -> int:
    """A process's PID in its innermost PID namespace (the last NSpid value)."""
    with open(f"/proc/{host_pid}/status", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    raise AssertionError(f"/proc/{host_pid}/status has no NSpid")


def test_checkpointctl_reads_every_export(agent: Bed, tmp_path: Path) -> None:
    image = agent.info["images"]["busybox"]
    src = make_pod(agent, "e2e-cctl", [container_config("counter", image, ["sh", "-c", COUNTER])])
    ckpt = ""
    try:
        cid = src.containers["counter"]
        log = os.path.join(src.log_dir, "counter", "0.log")
        wait_for(lambda: len(ticks(log)) >= 5, what="source ticks")
        pid_in_ns = ns_pid(container_detail(agent, cid).pid)
        ckpt = agent.cli("checkpoint", src.id).stdout.strip().splitlines()[-1]
        assert set(COMPRESSIONS) == set(SUFFIX)
        archives = []
        for compression in COMPRESSIONS:
            archive = tmp_path / f"counter{SUFFIX[compression]}"
            archives.append(str(archive))
            agent.cli("export", ckpt, "--container", "counter", "--file", str(archive))
            assert archive.read_bytes().startswith(MAGIC.get(compression, b"")), compression
            members = archive_members(archive)
            config = json.loads(members["config.dump"])
            stats = dump_stats(members["stats-dump"])
            assert stats["pages_written"] > 0 and stats["frozen_time"] > 0, stats
            created, checkpointed = config["createdTime"][:19] + "Z", config["checkpointedTime"][:19] + "Z"
            what = f"{compression}: "

            shown = checkpointctl("show", str(archive))
            [row] = [line for line in shown.splitlines() if cid[:12] in line]
            assert row.split()[:6] == ["counter", image, cid[:12], "runc", created, "containerd"], what + shown

            tree = checkpointctl("inspect", "--all", str(archive))
            for line in ("counter", f"Image: {image}", f"ID: {cid}", "Runtime: runc", f"Created: {created}",
                         f"Checkpointed: {checkpointed}", "Engine: containerd", f"Pod name: {src.name}",
                         "Kubernetes namespace: e2e-cctl", f"io.kubernetes.cri.sandbox-id: {src.id}",
                         "CRIU dump statistics", f"Pages written: {stats['pages_written']}",
                         f"Pages scanned: {stats['pages_scanned']}", f"[{pid_in_ns}]", "[REG 3]  /data/count.log",
                         "Destination: /etc/hostname", "Destination: /dev/shm"):
                assert line in tree, what + f"{line!r} not in:\n{tree}"

            [doc] = json.loads(checkpointctl("inspect", "--all", "--format", "json", str(archive)))
            assert (doc["container_name"], doc["image"], doc["id"]) == ("counter", image, cid), what + str(doc)
            assert (doc["engine"], doc["runtime"]) == ("containerd", "runc"), what + str(doc)
            assert (doc["created"], doc["checkpointed"]) == (created, checkpointed), what + str(doc)
            # Every figure checkpointctl shows is the one in the archive's stats-dump, and the sizes
            # are those of the archive's members.
            assert doc["statistics"] == stats, what + str(doc["statistics"])
            sizes = doc["checkpoint_size"]
            assert sizes["root_fs_diff_size"] == len(members["rootfs-diff.tar"]), what + str(sizes)
            assert sizes["total_size"] == sum(len(v) for k, v in members.items() if k.startswith("checkpoint/")), what
            assert sizes["memory_pages_size"] == sum(
                len(v) for k, v in members.items() if k.startswith("checkpoint/pages-")
            ), what + str(sizes)
            # The process tree: the shell, numbered as in its container's PID namespace, and the
            # file it holds open in its writable layer.
            root = doc["process_tree"]
            assert root["pid"] == pid_in_ns and root["command"] == "sh", what + str(root)
            assert all(child["command"] in ("sleep", "cut", "sh") for child in root.get("children", [])), root
            # checkpointctl 1.3.0 reads command lines from the memory images with a page count that
            # CRIU 4.2 no longer writes (docs/interop.md): where it reads one, it must be this one.
            assert not root["cmdline"].strip() or root["cmdline"].split()[:2] == ["sh", "-c"], what + str(root)
            [fds] = [f for f in doc["file_descriptors"] if f["pid"] == pid_in_ns]
            assert {"type": "REG", "fd": "REG 3", "path": "/data/count.log"} in fds["open_files"], what + str(fds)
            assert {m["destination"] for m in doc["mounts"]} >= {"/proc", "/etc/hosts", "/dev/shm"}, what

            # The process tree alone (pstree.img and each task's core image).
            ps = checkpointctl("inspect", "--ps-tree", str(archive))
            assert f"[{pid_in_ns}]  sh" in ps, what + ps

        # All three at once: one row each.
        shown = checkpointctl("show", *archives)
        assert len([line for line in shown.splitlines() if cid[:12] in line and "containerd" in line]) == 3, shown
        agent.cli("checkpoints", "rm", ckpt)
        ckpt = ""
    finally:
        remove_pod(agent, src.id)
        if ckpt:
            agent.cli("checkpoints", "rm", ckpt, check=False)


# ---- containerd's own restore ------------------------------------------------------------------


def ctr(agent: Bed, *args: str) -> str:
    cp = subprocess.run(
        [agent.info["ctr_binary"], "-a", agent.info["containerd_socket"], "-n", "k8s.io", *args],
        capture_output=True, text=True, timeout=120,
    )
    assert cp.returncode == 0, f"ctr {' '.join(args)} exited {cp.returncode}:\n{cp.stderr}\n{cp.stdout}"
    return cp.stdout


@pytest.fixture
def loopback_image(agent: Bed, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """The bed's busybox image in a registry on loopback, pulled from there through CRI PullImage.

    Yields (the image's name there, the reference CRI reports for it: NAME@DIGEST). The
    registry's hosts.toml (plain HTTP) lies in the bed's registry config dir while the test
    runs; the registry, hosts.toml and the image names made here are removed afterwards.
    """
    registry = Registry(tmp_path / "registry")
    registry.start()
    hosts = Path(agent.info["registry_hosts_dir"]) / registry.host
    names: list[str] = []
    try:
        name = registry.ref("node-agent-test/busybox:1")
        ctr(agent, "images", "push", "--plain-http", name, agent.info["images"]["busybox"])
        write_hosts_toml(agent.info["registry_hosts_dir"], registry.host,
                         f'server = "http://{registry.host}"\n\n'
                         f'[host."http://{registry.host}"]\n  capabilities = ["pull", "resolve"]\n')
        names.append(name)

        async def pull() -> str:
            async with grpc.aio.insecure_channel("unix:" + agent.info["containerd_socket"]) as channel:
                images = cri_grpc.ImageServiceStub(channel)  # type: ignore[no-untyped-call]
                spec = cri_pb.ImageSpec(image=name)
                await images.PullImage(cri_pb.PullImageRequest(image=spec), timeout=120)
                status = await images.ImageStatus(cri_pb.ImageStatusRequest(image=spec), timeout=60)
            [digested] = [r for r in status.image.repo_digests if r.startswith(registry.host + "/")]
            return str(digested)

        digested = asyncio.run(pull())
        names.append(digested)
        yield name, digested
    finally:
        for ref in names:
            # Only these names: the image's content is the bed's busybox, which stays.
            subprocess.run([agent.info["ctr_binary"], "-a", agent.info["containerd_socket"], "-n", "k8s.io",
                            "images", "rm", ref], capture_output=True, timeout=60)
        shutil.rmtree(hosts, ignore_errors=True)
        registry.stop()


def _sandbox(agent: Bed, namespace: str) -> tuple[str, dict[str, Any]]:
    pcfg = pod_config(agent, namespace, f"p-{secrets.token_hex(3)}")

    async def go(cri: CriClient) -> str:
        return await cri.run_pod(pcfg, "runc")

    return agent.cri(go), pcfg


def test_containerd_restores_an_export_through_create_container(
    agent: Bed, loopback_image: tuple[str, str], tmp_path: Path,
) -> None:
    name, digested = loopback_image
    src = make_pod(agent, "e2e-native-src", [container_config("counter", name, ["sh", "-c", COUNTER])])
    pods = [src.id]
    ckpt = ""
    try:
        cid = src.containers["counter"]
        log = os.path.join(src.log_dir, "counter", "0.log")
        before = container_detail(agent, cid)
        assert before.container.image_ref == digested, before.container
        wait_for(lambda: len(log_lines(log)) >= 5, what="source ticks")
        [(pid, start)] = {(p, s) for _, p, s in log_lines(log)}
        assert int(pid) == ns_pid(before.pid)

        ckpt = agent.cli("checkpoint", src.id).stdout.strip().splitlines()[-1]
        at_checkpoint = max(ticks(log))
        plain, zst = tmp_path / "counter.tar", tmp_path / "counter.tar.zst"
        agent.cli("export", ckpt, "--container", "counter", "--file", str(plain))
        agent.cli("export", ckpt, "--container", "counter", "--file", str(zst))
        config = json.loads(archive_members(plain)["config.dump"])
        assert config["rootfsImageRef"] == digested and config["rootfsImageName"] == name, config
        # The source goes: what runs afterwards can only be the restored process.
        remove_pod(agent, src.id)
        pods.remove(src.id)

        new_pod, pcfg = _sandbox(agent, "e2e-native-dst")
        pods.append(new_pod)
        os.makedirs(os.path.join(pcfg["log_directory"], "counter"), exist_ok=True)

        def create(archive: Path) -> Any:
            # As the kubelet sends it: the archive's path as the image, as the user wrote it.
            cfg = {"metadata": {"name": "counter", "attempt": 0},
                   "image": {"image": str(archive), "user_specified_image": str(archive)},
                   "log_path": "counter/0.log", "linux": {}}

            async def go(cri: CriClient) -> Any:
                try:
                    return await cri.create_container(new_pod, cfg, pcfg)
                except Exception as exc:  # noqa: BLE001 - the refusal is what the caller looks at
                    return exc

            return agent.cri(go)

        # containerd reads the archive as a plain tar: a compressed export is refused, and
        # leaves no container behind.
        refused = create(zst)
        assert isinstance(refused, Exception) and "unpacking of checkpoint archive" in str(refused), refused
        assert not agent.cri(lambda cri: cri.list_containers(new_pod))

        new_cid = create(plain)
        assert isinstance(new_cid, str), new_cid
        created = container_detail(agent, new_cid)
        assert created.container.state == "CONTAINER_CREATED"
        # containerd's restore made it: it marks the container so, with the dump time it read
        # from config.dump, and kept the name and labels status.dump gave.
        annotations = created.container.annotations
        assert annotations.get("restored") == "true", annotations
        assert annotations.get("checkpointImage") == str(plain), annotations
        assert datetime.fromisoformat(annotations["checkpointedAt"]) == datetime.fromisoformat(
            config["checkpointedTime"]), annotations
        assert created.container.name == "counter" and created.container.labels == before.container.labels
        agent.cri(lambda cri: cri.start_container(new_cid))

        d = container_detail(agent, new_cid)
        assert d.container.state == "CONTAINER_RUNNING", d.container
        assert d.container.image == name and d.container.image_ref == digested, d.container
        new_log = d.log_path
        wait_for(lambda: len(log_lines(new_log)) >= 5, what="restored ticks")
        restored = log_lines(new_log)
        # The same process: it goes on counting from where it was dumped, with the PID and the
        # start time it recorded when it first started, and has that PID in its new namespace.
        assert 5 <= restored[0][0] <= at_checkpoint + 1, f"restored counter starts at {restored[0][0]}"
        assert [t for t, _, _ in restored] == list(range(restored[0][0], restored[0][0] + len(restored)))
        assert {(p, s) for _, p, s in restored} == {(pid, start)}, restored[:3]
        assert ns_pid(d.pid) == int(pid)
        # The file it holds open in its writable layer came back (containerd applied rootfs-diff.tar)
        # and goes on from the dumped count.
        assert os.readlink(f"/proc/{d.pid}/fd/3") == "/data/count.log"
        counts = ticks(f"/proc/{d.pid}/root/data/count.log")
        assert counts == list(range(1, len(counts) + 1)) and counts[-1] >= restored[-1][0] - 1, counts[-5:]
        # It runs in the new container's cgroup, under the new sandbox.
        with open(f"/proc/{d.pid}/cgroup", encoding="utf-8") as fh:
            cgroups = fh.read()
        assert new_cid in cgroups and cid not in cgroups, cgroups
        agent.cli("checkpoints", "rm", ckpt)
        ckpt = ""
    finally:
        for pod in pods:
            remove_pod(agent, pod)
        if ckpt:
            agent.cli("checkpoints", "rm", ckpt, check=False)
