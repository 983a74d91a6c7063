"""A checkpoint grants nothing: forged CRIU images and saved configs are refused before runc restores.

Each case starts from a genuine checkpoint of a running container, exports it, changes one thing (a
field of a CRIU image, or the saved container config) and imports it again, so every digest is
right and the import is clean: what refuses it is the restore wrapper's check of the images against
the new container's config.json (`criu_bridge.privileges`), by name, before runc runs. Nothing is left
behind: no sandbox, no plan, no CRIU. The unchanged export restores, as a control.
"""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path
from typing import Any, Callable

import pytest

from criu_bridge import criuimg
from testbed.bed import (
    Bed, container_config, container_detail, criu_processes, make_pod, pods_in, remove_pod, ticks, wait_for,
)
from tests.unit.criu_images import mount

COUNTER = "i=0; while :; do i=$((i+1)); echo tick $i; sleep 0.2; done"
SECCOMP_FIELD, THREAD_CORE = 11, 5
AUTO_FS = 16


def _source(agent: Bed) -> tuple[Any, str]:
    """A pod with a container under the runtime's default seccomp profile, and one with CAP_SYS_ADMIN."""
    busybox = agent.info["images"]["busybox"]
    plain = container_config("plain", busybox, ["sh", "-c", COUNTER])
    plain["linux"] = {"security_context": {"seccomp": {"profile_type": 0}}}  # RuntimeDefault
    admin = container_config("admin", busybox, ["sh", "-c", COUNTER])
    admin["linux"] = {"security_context": {"capabilities": {"add_capabilities": ["SYS_ADMIN"]}}}
    pod = make_pod(agent, "e2e-forge", [plain, admin])
    for name in ("plain", "admin"):
        d = container_detail(agent, pod.containers[name])
        wait_for(lambda d=d: len(ticks(d.log_path)) >= 3, what=f"{name} ticks")
    ckpt = agent.cli("checkpoint", pod.id).stdout.strip().splitlines()[-1]
    return pod, ckpt


def _exported(agent: Bed, ckpt: str, container: str, into: Path, *args: str) -> Path:
    archive = into.with_suffix(".tar")
    agent.cli("export", ckpt, "--container", container, "--file", str(archive), *args)
    into.mkdir()
    with tarfile.open(archive) as tf:
        tf.extractall(into)  # the agent's own export, just made
    archive.unlink()
    return into


def _imported(agent: Bed, tree: Path, namespace: str) -> str:
    archive = tree.with_suffix(".forged.tar")
    with tarfile.open(archive, "w") as tf:
        for name in sorted(os.listdir(tree)):
            tf.add(tree / name, arcname=name)
    out = json.loads(agent.cli("import", str(archive), "--namespace", namespace, "-o", "json").stdout)
    return str(out["id"])


def _edit_config(tree: Path, change: Callable[[dict[str, Any]], None]) -> None:
    path = tree / "config.dump"
    doc = json.loads(path.read_text())
    change(doc["config"])
    path.write_text(json.dumps(doc))


def _rebuilt(buf: bytes, start: int, end: int, number: int, change: Callable[[bytes], bytes]) -> bytes:
    """The message buf[start:end] with its field `number` (a message) replaced by change(payload)."""
    out = b""
    for n, w, a, b, raw in criuimg.fields(buf, start, end):
        if n == number and w == criuimg.LENGTH:
            payload = change(buf[a:b])
            out += criuimg.encode_varint(n << 3 | criuimg.LENGTH) + criuimg.encode_varint(len(payload)) + payload
        else:
            out += buf[raw:b]
    return out


def _without_seccomp(tree: Path) -> int:
    """Every thread's seccomp mode set to disabled, in each core image; returns how many were filtered."""
    changed = 0
    for core in sorted((tree / "checkpoint").glob("core-*.img")):
        data = core.read_bytes()
        (start, end), = list(criuimg.entries(data, core.name))[:1]

        def thread(payload: bytes) -> bytes:
            nonlocal changed
            kept = b""
            for n, w, _a, b, raw in criuimg.fields(payload, 0, len(payload)):
                if n == SECCOMP_FIELD and w == criuimg.VARINT:
                    changed += 1
                    continue
                kept += payload[raw:b]
            return kept + criuimg.encode_varint(SECCOMP_FIELD << 3) + criuimg.encode_varint(0)

        entry = _rebuilt(data, start, end, THREAD_CORE, thread)
        core.write_bytes(data[:8] + criuimg.entry_bytes(entry) + data[end:])
    return changed


def _with_block_device_mount(tree: Path) -> None:
    """The node's block device mounted at /host, appended to the container's mount namespace image."""
    (path,) = (tree / "checkpoint").glob("mountpoints-*.img")
    data = path.read_bytes()
    ids = []
    for start, end in criuimg.entries(data, path.name):
        msg = criuimg.Message(data, start, end, path.name)
        ids.append(msg.uint32(2) or 0)
        if msg.text(7) == "/":
            root = msg.uint32(2) or 0
    path.write_bytes(data + criuimg.entry_bytes(
        mount(max(ids) + 1, root, AUTO_FS, "/host", source="/dev/vda", fsname="ext4", root_dev=0xFD00)))


def _refused(agent: Bed, ckpt: str, namespace: str, *needles: str) -> str:
    plans = set(os.listdir(os.path.join(agent.store, "plans")))
    cp = agent.cli("restore", ckpt, "--namespace", namespace, "--start", check=False)
    assert cp.returncode != 0, cp.stdout
    assert "FAILED_PRECONDITION" in cp.stderr and "phase privileges" in cp.stderr, cp.stderr
    for needle in needles:
        assert needle in cp.stderr, (needle, cp.stderr)
    # Nothing was made that stays: no sandbox, no plan, no CRIU.
    assert pods_in(agent, namespace) == []
    assert set(os.listdir(os.path.join(agent.store, "plans"))) <= plans
    assert not criu_processes()
    return cp.stderr


@pytest.mark.also17
def test_forged_images_and_configs_are_refused_by_name(agent: Bed, tmp_path: Path) -> None:
    pod, ckpt = _source(agent)
    made: list[str] = []
    try:
        # Control: the genuine export, imported again, restores (no host access asked, none needed).
        genuine = _imported(agent, _exported(agent, ckpt, "plain", tmp_path / "genuine"), "e2e-forge-ok")
        made.append(genuine)
        res = json.loads(agent.cli("restore", genuine, "--namespace", "e2e-forge-ok", "--start", "-o", "json").stdout)
        d = container_detail(agent, res["containers"][0]["container_id"])
        assert d.container.state == "CONTAINER_RUNNING"
        with open(f"/proc/{d.pid}/status") as fh:
            assert "Seccomp:\t2\n" in fh.read()
        remove_pod(agent, res["pod_sandbox_id"])

        # CAP_SYS_ADMIN in the images, dropped from the saved config: no host access to refuse any more.
        tree = _exported(agent, ckpt, "admin", tmp_path / "admin")
        _edit_config(tree, lambda c: c["linux"]["security_context"].pop("capabilities"))
        made.append(forged := _imported(agent, tree, "e2e-forge-cap"))
        _refused(agent, forged, "e2e-forge-cap", "capabilities CAP_SYS_ADMIN in its permitted, effective and "
                 "bounding sets are outside the container's bounding set")

        # A root checkpoint restored under a config that runs it as user 1000.
        tree = _exported(agent, ckpt, "plain", tmp_path / "uid")
        _edit_config(tree, lambda c: c["linux"]["security_context"].update(run_as_user={"value": 1000}))
        made.append(forged := _imported(agent, tree, "e2e-forge-uid"))
        _refused(agent, forged, "e2e-forge-uid", "uid 0/0/0/0 (real/effective/saved/fs) is not the container's "
                 "user 1000")

        # The seccomp filter dropped from the images; the config still has the runtime's profile.
        tree = _exported(agent, ckpt, "plain", tmp_path / "seccomp")
        assert _without_seccomp(tree) >= 1
        made.append(forged := _imported(agent, tree, "e2e-forge-seccomp"))
        _refused(agent, forged, "e2e-forge-seccomp", "seccomp is disabled, and the container's config has a "
                 "seccomp profile")

        # A mount added to the images: the node's disk at /host.
        tree = _exported(agent, ckpt, "plain", tmp_path / "mount")
        _with_block_device_mount(tree)
        made.append(forged := _imported(agent, tree, "e2e-forge-mount"))
        _refused(agent, forged, "e2e-forge-mount", "at /host: a filesystem by name 'ext4' from /dev/vda, which the "
                 "container's config does not mount there")
    finally:
        remove_pod(agent, pod.id)
        for cid in [ckpt, *made]:
            agent.cli("checkpoints", "rm", cid, check=False)
