"""Container checkpoint archives: export, import, and every hostile archive refused."""

from __future__ import annotations

import gzip
import io
import json
import os
import stat
import struct
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zstandard
from google.protobuf.internal.encoder import _VarintBytes

from criu_bridge import criuimg as img
from criu_bridge import taskimages
from node_agent import errors, interop
from node_agent.podformat import METADATA_KIND
from node_agent.interop import imagefacts
from node_agent.interop.common import ImportLimits, dns_label
from node_agent.store import CheckpointRecord, Store
from tests.unit.criu_images import image, v

MiB = 1 << 20


# -- building blocks -------------------------------------------------------------------


def _field(number: int, value: int | bytes) -> bytes:
    """One protobuf field, encoded by protobuf's own varint encoder."""
    if isinstance(value, int):
        return _VarintBytes(number << 3) + _VarintBytes(value)
    return _VarintBytes((number << 3) | 2) + _VarintBytes(len(value)) + value


def _reg(name: bytes, mode: int, fid: int) -> bytes:
    fown = _field(1, 0) + _field(2, 0) + _field(3, 0) + _field(4, 0) + _field(5, 0)
    body = _field(1, fid) + _field(2, 0) + _field(3, 0) + _field(5, fown) + _field(6, name) + _field(7, 20) + _field(10, mode)
    return _field(1, 1) + _field(2, fid) + _field(3, body)


def files_img(entries: list[bytes]) -> bytes:
    out = struct.pack("<II", img.IMG_COMMON_MAGIC, img.FILES_MAGIC)
    for e in entries:
        out += struct.pack("<I", len(e)) + e
    return out


def small_tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in files.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def pod_config(ns: str = "team", name: str = "web") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": ns, "uid": "1f7c", "attempt": 0},
        "hostname": name,
        "log_directory": f"/var/log/pods/{ns}_{name}_1f7c",
        "linux": {"cgroup_parent": "/kubepods", "security_context": {"namespace_options": {"pid": 1}}},
    }


def container_files(name: str) -> dict[str, bytes]:
    cfg = {
        "id": "c0ffee" + name, "name": name, "rootfsImage": "localhost/busybox:1", "rootfsImageRef": "sha256:aa",
        "rootfsImageName": "localhost/busybox:1", "runtime": "runc",
        "config": {"metadata": {"name": name}, "image": {"image": "localhost/busybox:1"}, "command": ["sh"],
                   "log_path": f"{name}/0.log"},
        "log_path": f"/var/log/pods/team_web_1f7c/{name}/0.log",
    }
    return {
        f"containers/{name}/checkpoint/inventory.img": os.urandom(86),
        # One task, PID 7, its own process group and session.
        f"containers/{name}/checkpoint/pstree.img": image(taskimages.PSTREE_MAGIC, v(1, 7) + v(3, 7) + v(4, 7)),
        f"containers/{name}/checkpoint/pages-1.img": os.urandom(3 * MiB + 123),
        f"containers/{name}/checkpoint/files.img": files_img([_reg(b"/", 0o40555, 1)]),
        f"containers/{name}/checkpoint/stats-dump": os.urandom(48),
        f"containers/{name}/checkpoint/empty.img": b"",
        f"containers/{name}/config.dump": json.dumps(cfg).encode(),
        f"containers/{name}/spec.dump": json.dumps({"ociVersion": "1.0.2", "process": {"args": ["sh"]}}).encode(),
        f"containers/{name}/rootfs-diff.tar": small_tar({"data/count.log": b"1\n2\n3\n"}),
        f"containers/{name}/deleted.files": b'["etc/motd"]',
        f"containers/{name}/opaque.dirs": b'["var/cache"]',
        f"containers/{name}/dump.log": b"(00.000) dump log\n",
    }


def make_checkpoint(store: Store, names: tuple[str, ...] = ("app",), pod: dict[str, Any] | None = None,
                    extra: dict[str, bytes] | None = None) -> tuple[CheckpointRecord, dict[str, bytes]]:
    files: dict[str, bytes] = {
        "pod/config.json": json.dumps({"config": pod or pod_config(), "runtime_handler": ""}).encode(),
        "pod/cpuinfo/cpuinfo.img": os.urandom(110),
        "pod/devshm.tar": small_tar({"app.count": b"7\n"}),
        "pod/devshm.deleted": b"[]",
    }
    for n in names:
        files.update(container_files(n))
    files.update(extra or {})
    meta = {
        "kind": METADATA_KIND, "version": 1, "created": "2026-07-02T10:00:00.000000Z", "node": "n1",
        "pod": {"id": "ab" * 32, "name": "web", "namespace": "team", "uid": "1f7c", "runtime_handler": ""},
        "containers": [{"name": n, "id": "c0ffee" + n, "image": "localhost/busybox:1", "image_ref": "sha256:aa",
                        "dump_ms": 1.5} for n in names],
        "frozen_ms": 12.5, "options": {"tcp-established": "true"}, "criu_version": "4.2.1",
    }
    with store.writer() as w:
        for n in names:
            w.add_dir(f"containers/{n}/checkpoint", mode=0o700)
        for path, data in sorted(files.items()):
            w.add_bytes(path, data, mode=0o644 if path.endswith(".img") else 0o600)
        rec = w.commit(meta)
    return rec, files


def stored_files(store: Store, rec: CheckpointRecord) -> dict[str, bytes]:
    out = {}
    for f in rec.files:
        if f.type == "file":
            with store.open(rec.id, f.path) as fh:
                out[f.path] = fh.read(fh.size) if f.size else b""
    return out


def fake_cpuinfo(images_dir: str) -> None:
    Path(images_dir, "cpuinfo.img").write_bytes(b"cpuinfo of this node")


class Tar:
    """Hand-made archives: tarfile for most members, raw headers where tarfile won't go."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.tf = tarfile.open(fileobj=self.buf, mode="w", format=tarfile.PAX_FORMAT,
                               encoding="utf-8", errors="surrogateescape")

    def file(self, name: str, data: bytes = b"x", **attrs: Any) -> Tar:
        ti = tarfile.TarInfo(name)
        ti.size = len(data)
        for k, v in attrs.items():
            setattr(ti, k, v)
        self.tf.addfile(ti, io.BytesIO(data))
        return self

    def special(self, name: str, kind: bytes, linkname: str = "", **attrs: Any) -> Tar:
        ti = tarfile.TarInfo(name)
        ti.type = kind
        ti.linkname = linkname
        for k, v in attrs.items():
            setattr(ti, k, v)
        self.tf.addfile(ti)
        return self

    def dir(self, name: str) -> Tar:
        return self.special(name, tarfile.DIRTYPE)

    def bytes(self) -> bytes:
        self.tf.close()
        return self.buf.getvalue()


def podman_spec(**changes: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "ociVersion": "1.0.2-dev",
        "process": {"user": {"uid": 0, "gid": 0}, "args": ["sh", "-c", "while :; do sleep 1; done"],
                    "env": ["PATH=/usr/bin:/bin", "HOSTNAME=c1a9b8a65911", "EMPTY="], "cwd": "/"},
        "root": {"path": "/var/lib/containers/storage/overlay/x/merged"},
        "hostname": "c1a9b8a65911",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/etc/hosts", "type": "bind", "source": "/run/containers/x/userdata/hosts",
             "options": ["bind", "rprivate"]},
            {"destination": "/dev/shm", "type": "bind", "source": "/var/lib/containers/x/userdata/shm",
             "options": ["bind", "rprivate"]},
            {"destination": "/run/.containerenv", "type": "bind", "source": "/run/containers/x/userdata/.containerenv",
             "options": ["bind", "rprivate"]},
            {"destination": "/etc/hostname", "type": "bind", "source": "/run/containers/x/userdata/hostname",
             "options": ["bind", "rprivate"]},
        ],
        "annotations": {"io.container.manager": "libpod"},
        "linux": {"namespaces": [{"type": "pid"}, {"type": "network"}, {"type": "ipc"}, {"type": "uts"},
                                 {"type": "mount"}]},
    }
    spec.update(changes)
    return spec


def podman_archive(spec: dict[str, Any] | None = None, config: dict[str, Any] | None = None,
                   extra: Callable[[Tar], None] | None = None) -> bytes:
    cfg = config if config is not None else {
        "id": "c1a9b8a65911c4c129fe020f86e651e5d17154da068816e17440d7bd1ae77c3d", "name": "My_App",
        "rootfsImageID": "88c3abd7", "rootfsImageName": "localhost/node-agent-test/busybox:1",
        "createdTime": "2026-11-30T01:50:42.039576299Z", "spec": {"big": "ignored"},
    }
    t = Tar()
    t.dir("artifacts/")
    t.file("devshm-checkpoint.tar", small_tar({"x.count": b"1"}))
    t.file("config.dump", json.dumps(cfg).encode())
    t.file("spec.dump", json.dumps(spec or podman_spec()).encode())
    t.file("network.status", b"null")
    t.file("stats-dump", b"@Y\x10stats")
    t.file("ctr.log", b"2026-11-30T01:50:42Z stdout F tick 1\n")
    t.dir("checkpoint/")
    t.file("checkpoint/inventory.img", b"inventory")
    t.file("checkpoint/files.img", files_img([_reg(b"/bin/busybox", 0o100755, 1), _reg(b"/", 0o40555, 2)]))
    t.file("checkpoint/pages-1.img", os.urandom(70000))
    t.file("rootfs-diff.tar", small_tar({"data/c.log": b"1\n2\n"}))
    if extra:
        extra(t)
    return t.bytes()


# -- fixtures ---------------------------------------------------------------------------


class Env:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.store = Store(root / "store")
        self.sentinel = root / "sentinel"
        self.sentinel.mkdir()
        (self.sentinel / "keep").write_text("untouched")
        self.cwd = root / "cwd"
        self.cwd.mkdir()
        (root / "archives").mkdir()

    def write(self, data: bytes, name: str = "in.tar") -> str:
        path = self.root / "archives" / name
        path.write_bytes(data)
        return str(path)

    def outside(self) -> set[str]:
        """Every path under the test root outside the store and the archives."""
        found = set()
        for dirpath, dirnames, filenames in os.walk(self.root):
            rel = os.path.relpath(dirpath, self.root)
            if rel.split(os.sep)[0] in ("store", "archives"):
                continue
            for n in dirnames + filenames:
                found.add(os.path.normpath(os.path.join(rel, n)))
        return found

    def import_(self, data: bytes, **kw: Any) -> CheckpointRecord:
        kw.setdefault("cpuinfo_dump", fake_cpuinfo)
        return interop.import_archive(self.store, self.write(data), **kw)

    def assert_clean(self, before: set[str]) -> None:
        assert self.outside() == before, "something was written outside the store"
        assert (self.sentinel / "keep").read_text() == "untouched"
        assert sorted(os.listdir(self.sentinel)) == ["keep"]
        assert os.listdir(self.cwd) == []
        work = self.root / "store" / "work"
        assert not work.exists() or os.listdir(work) == [], "staging left behind"
        interop_dir = self.root / "store" / "interop"
        assert not interop_dir.exists() or os.listdir(interop_dir) == [], "interop files left behind"
        assert self.store.list() == []


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    e = Env(tmp_path)
    monkeypatch.chdir(e.cwd)
    yield e


# -- export and round trip --------------------------------------------------------------


@pytest.mark.parametrize("suffix,magic", [(".tar", b""), (".tar.gz", b"\x1f\x8b"), (".tar.zst", b"\x28\xb5\x2f\xfd")])
def test_export_then_import_gives_back_every_file_byte_for_byte(env: Env, suffix: str, magic: bytes) -> None:
    rec, files = make_checkpoint(env.store, ("app", "side"))
    out = env.root / "archives" / f"app{suffix}"
    report = interop.export_container(env.store, rec.id, "app", str(out))
    assert report.path == str(out) and report.size == out.stat().st_size > 0
    assert report.container == "app" and report.checkpoint_id == rec.id
    assert out.read_bytes().startswith(magic)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert [p.name for p in out.parent.iterdir()] == [out.name], "temporary file left behind"

    back = interop.import_archive(env.store, str(out))
    assert back.id != rec.id
    got = stored_files(env.store, back)
    want = {p: d for p, d in files.items() if not p.startswith("containers/side/")}
    assert got == want
    assert {f.path: f.mode for f in back.files if f.type == "file"} == {
        f.path: f.mode for f in rec.files if f.type == "file" and not f.path.startswith("containers/side/")
    }
    meta = back.metadata
    assert meta["kind"] == METADATA_KIND
    assert meta["pod"]["namespace"] == "team" and meta["pod"]["name"] == "web"
    assert [c["name"] for c in meta["containers"]] == ["app"]
    assert meta["options"] == {"tcp-established": "true"} and meta["frozen_ms"] == 12.5
    assert meta["imported"]["format"] == "node-agent" and meta["imported"]["checkpoint"] == rec.id


def test_archive_layout_is_what_other_tools_read(env: Env) -> None:
    rec, files = make_checkpoint(env.store)
    out = env.root / "a.tar"
    interop.export_container(env.store, rec.id, "app", str(out))
    with tarfile.open(out) as tf:
        names = tf.getnames()
        assert tf.extractfile("stats-dump").read() == files["containers/app/checkpoint/stats-dump"]  # type: ignore[union-attr]
        assert tf.extractfile("checkpoint/pages-1.img").read() == files["containers/app/checkpoint/pages-1.img"]  # type: ignore[union-attr]
        manifest = json.load(tf.extractfile("node-agent/manifest.json"))  # type: ignore[arg-type]
        members = tf.getmembers()
    for name in ("checkpoint", "checkpoint/inventory.img", "config.dump", "spec.dump", "rootfs-diff.tar",
                 "deleted.files", "opaque.dirs", "dump.log", "stats-dump", "devshm-checkpoint.tar",
                 "node-agent/manifest.json", "node-agent/pod/config.json", "node-agent/pod/cpuinfo/cpuinfo.img"):
        assert name in names, name
    assert "checkpoint/stats-dump" not in names
    assert names.index("checkpoint") < names.index("checkpoint/inventory.img")
    assert all(m.uid == 0 and m.gid == 0 and (m.isfile() or m.isdir()) for m in members)
    assert manifest["kind"] == "node-agent.container-export" and manifest["container"] == "app"
    assert manifest["metadata"]["containers"][0]["name"] == "app"


def test_export_refuses_unknown_container_and_existing_file(env: Env) -> None:
    rec, _ = make_checkpoint(env.store)
    out = env.root / "a.tar"
    with pytest.raises(errors.NotFound, match="no container 'nope'"):
        interop.export_container(env.store, rec.id, "nope", str(out))
    out.write_bytes(b"mine")
    with pytest.raises(errors.AlreadyExists):
        interop.export_container(env.store, rec.id, "app", str(out))
    assert out.read_bytes() == b"mine"
    interop.export_container(env.store, rec.id, "app", str(out), overwrite=True)
    assert out.read_bytes() != b"mine"
    assert sorted(p.name for p in env.root.iterdir() if p.name.startswith(".")) == []


def test_export_streams_large_files(env: Env) -> None:
    big = os.urandom(9 * MiB + 7)
    rec, _ = make_checkpoint(env.store, extra={"containers/app/checkpoint/pages-2.img": big})
    out = env.root / "a.tar.zst"
    interop.export_container(env.store, rec.id, "app", str(out))
    back = interop.import_archive(env.store, str(out))
    with env.store.open(back.id, "containers/app/checkpoint/pages-2.img") as fh:
        assert fh.read(fh.size) == big


def test_hardlink_to_an_earlier_file_becomes_a_copy(env: Env) -> None:
    rec, files = make_checkpoint(env.store)
    out = env.root / "a.tar"
    interop.export_container(env.store, rec.id, "app", str(out))
    t = Tar()
    with tarfile.open(out) as tf:
        for m in tf.getmembers():
            if m.isfile():
                t.file(m.name, tf.extractfile(m).read(), mode=m.mode)  # type: ignore[union-attr]
    t.special("checkpoint/pages-9.img", tarfile.LNKTYPE, "checkpoint/pages-1.img")
    back = env.import_(t.bytes())
    got = stored_files(env.store, back)
    assert got["containers/app/checkpoint/pages-9.img"] == files["containers/app/checkpoint/pages-1.img"]


def test_own_archive_with_host_mounts_needs_permission(env: Env) -> None:
    cfgs = container_files("app")
    cfg = json.loads(cfgs["containers/app/config.dump"])
    cfg["config"]["mounts"] = [{"container_path": "/host", "host_path": "/"}]
    rec, _ = make_checkpoint(env.store, extra={"containers/app/config.dump": json.dumps(cfg).encode()})
    out = env.root / "a.tar"
    interop.export_container(env.store, rec.id, "app", str(out))
    env.store.remove(rec.id)
    before = env.outside()
    with pytest.raises(errors.FailedPrecondition, match="reaches into the host.*mounts host path / at /host"):
        interop.import_archive(env.store, str(out))
    env.assert_clean(before)
    assert interop.import_archive(env.store, str(out), allow_host_access=True).metadata["pod"]["name"] == "web"


def test_own_archive_with_host_ports_needs_permission(env: Env) -> None:
    pod = pod_config()
    pod["port_mappings"] = [{"container_port": 80, "host_port": 22}]
    rec, _ = make_checkpoint(env.store, pod=pod)
    out = env.root / "a.tar"
    interop.export_container(env.store, rec.id, "app", str(out))
    env.store.remove(rec.id)
    before = env.outside()
    with pytest.raises(errors.FailedPrecondition, match="the pod maps host port 22"):
        interop.import_archive(env.store, str(out))
    env.assert_clean(before)


def test_import_overrides_namespace_and_name_and_checks_the_log_root(env: Env) -> None:
    rec, _ = make_checkpoint(env.store)
    out = env.root / "a.tar"
    interop.export_container(env.store, rec.id, "app", str(out))
    back = interop.import_archive(env.store, str(out), namespace="other", name="moved")
    assert back.metadata["pod"]["namespace"] == "other" and back.metadata["pod"]["name"] == "moved"
    with pytest.raises(errors.FailedPrecondition, match="log_directory"):
        interop.import_archive(env.store, str(out), log_root="/srv/logs")
    assert interop.import_archive(env.store, str(out), log_root="/var/log/pods").id
    with pytest.raises(errors.InvalidArgument):
        interop.import_archive(env.store, str(out), namespace="Not_A_Name")


# -- foreign (Podman) archives -----------------------------------------------------------------


def test_podman_archive_becomes_a_pod_checkpoint(env: Env) -> None:
    rec = env.import_(podman_archive(), cgroup_parent="/kubepods/besteffort", log_root="/var/log/pods")
    files = stored_files(env.store, rec)
    assert set(files) == {
        "containers/my-app/checkpoint/inventory.img", "containers/my-app/checkpoint/files.img",
        "containers/my-app/checkpoint/pages-1.img", "containers/my-app/checkpoint/stats-dump",
        "containers/my-app/config.dump", "containers/my-app/spec.dump", "containers/my-app/rootfs-diff.tar",
        "pod/config.json", "pod/devshm.tar", "pod/cpuinfo/cpuinfo.img",
    }
    assert files["pod/cpuinfo/cpuinfo.img"] == b"cpuinfo of this node"
    assert files["containers/my-app/checkpoint/stats-dump"] == b"@Y\x10stats"
    meta = rec.metadata
    assert meta["kind"] == METADATA_KIND
    assert meta["pod"]["namespace"] == "default" and meta["pod"]["name"] == "my-app"
    assert meta["containers"][0]["image"] == "localhost/node-agent-test/busybox:1"
    assert meta["imported"]["format"] == "podman" and meta["imported"]["container_name"] == "My_App"

    pod = json.loads(files["pod/config.json"])["config"]
    assert pod["metadata"]["namespace"] == "default" and pod["metadata"]["name"] == "my-app"
    assert pod["log_directory"] == f"/var/log/pods/default_my-app_{pod['metadata']['uid']}"
    assert pod["linux"]["cgroup_parent"] == "/kubepods/besteffort"
    assert pod["linux"]["security_context"]["namespace_options"] == {"network": 0, "pid": 1, "ipc": 0}
    dump = json.loads(files["containers/my-app/config.dump"])
    cfg = dump["config"]
    assert dump["rootfsImageName"] == "localhost/node-agent-test/busybox:1"
    assert cfg["metadata"]["name"] == "my-app" and cfg["image"]["image"] == "localhost/node-agent-test/busybox:1"
    assert cfg["command"] == ["sh", "-c", "while :; do sleep 1; done"] and cfg["working_dir"] == "/"
    assert {"key": "EMPTY", "value": ""} in cfg["envs"] and {"key": "PATH", "value": "/usr/bin:/bin"} in cfg["envs"]
    assert cfg["linux"]["security_context"]["namespace_options"]["pid"] == 1
    assert cfg["log_path"] == "my-app/0.log"
    [mount] = cfg["mounts"]
    assert mount["container_path"] == "/run/.containerenv"
    host = Path(mount["host_path"])
    assert host.is_relative_to(env.root / "store" / "interop") and host.read_bytes() == b""
    assert meta["imported"]["files"] == str(host.parent)
    # The root directory's mode is no longer compared at restore; the rest of files.img is intact.
    img = files["containers/my-app/checkpoint/files.img"]
    assert img.count(_field(10, 0o40555)) == 0 and img.count(_field(10, 0o100755)) == 1


def test_podman_archive_options_and_overrides(env: Env) -> None:
    spec = podman_spec(annotations={"io.container.manager": "libpod"}, hostname="Weird_Host")
    rec = env.import_(podman_archive(spec), namespace="imports", name="counter", container_name="ctr",
                      image="localhost/other:2", options={"tcp-established": "true"})
    meta = rec.metadata
    assert (meta["pod"]["namespace"], meta["pod"]["name"]) == ("imports", "counter")
    assert meta["containers"][0]["name"] == "ctr" and meta["containers"][0]["image"] == "localhost/other:2"
    assert meta["options"] == {"tcp-established": "true"}
    pod = json.loads(stored_files(env.store, rec)["pod/config.json"])["config"]
    assert pod["hostname"] == "weird-host"
    with pytest.raises(errors.InvalidArgument, match="unknown checkpoint option"):
        env.import_(podman_archive(), options={"bogus": "true"})


def test_cri_annotations_name_the_pod(env: Env) -> None:
    spec = podman_spec(annotations={"io.kubernetes.cri.sandbox-namespace": "prod",
                                    "io.kubernetes.cri.sandbox-name": "api-7d9",
                                    "io.kubernetes.cri.container-name": "server"})
    rec = env.import_(podman_archive(spec))
    assert rec.metadata["imported"]["format"] == "containerd"
    assert (rec.metadata["pod"]["namespace"], rec.metadata["pod"]["name"]) == ("prod", "api-7d9")
    assert rec.metadata["containers"][0]["name"] == "server"


def test_foreign_bind_mounts_need_a_host_path(env: Env) -> None:
    spec = podman_spec()
    spec["mounts"].append({"destination": "/data", "type": "bind", "source": "/srv/data", "options": ["rbind"]})
    before = env.outside()
    with pytest.raises(errors.FailedPrecondition, match="/data"):
        env.import_(podman_archive(spec))
    env.assert_clean(before)
    rec = env.import_(podman_archive(spec), volumes={"/data": "/srv/elsewhere"})
    cfg = json.loads(stored_files(env.store, rec)["containers/my-app/config.dump"])["config"]
    assert {"container_path": "/data", "host_path": "/srv/elsewhere", "readonly": False} in cfg["mounts"]


@pytest.mark.parametrize("spec,match", [
    (podman_spec(linux={"namespaces": [{"type": "pid"}, {"type": "user"}, {"type": "mount"}]}), "user namespace"),
    (podman_spec(linux={"namespaces": [{"type": "pid", "path": "/proc/1/ns/pid"}, {"type": "mount"}]}),
     "PID namespace"),
    (podman_spec(process={"terminal": True, "args": ["sh"]}), "terminal"),
    (podman_spec(linux={"namespaces": [{"type": "mount"}], "devices": [{"path": "/dev/sda"}]}), "device"),
])
def test_foreign_containers_that_cannot_be_restored_through_cri(env: Env, spec: dict[str, Any], match: str) -> None:
    before = env.outside()
    with pytest.raises(errors.FailedPrecondition, match=match):
        env.import_(podman_archive(spec))
    env.assert_clean(before)


def test_foreign_host_namespaces_are_marked_node(env: Env) -> None:
    spec = podman_spec(linux={"namespaces": [{"type": "pid"}, {"type": "mount"}, {"type": "uts"}]})
    rec = env.import_(podman_archive(spec))
    pod = json.loads(stored_files(env.store, rec)["pod/config.json"])["config"]
    # The restore refuses NODE namespaces unless allowed.
    assert pod["linux"]["security_context"]["namespace_options"] == {"network": 2, "pid": 1, "ipc": 2}


def test_dns_label() -> None:
    assert dns_label("My_App", "x") == "my-app"
    assert dns_label("--__--", "x") == "x"
    assert dns_label("a" * 100, "x") == "a" * 63
    assert dns_label("ünïcode", "x") == "n-code"


# -- hostile archives ----------------------------------------------------------------------


def _with(*members: Callable[[Tar], Any]) -> bytes:
    def extra(t: Tar) -> None:
        for m in members:
            m(t)
    return podman_archive(extra=extra)


HOSTILE: dict[str, tuple[Callable[[str], bytes], type[errors.AgentError], str]] = {
    "dotdot": (lambda s: _with(lambda t: t.file("../escape", b"evil")), errors.InvalidArgument, r"'\.\.'"),
    "dotdot-inside": (lambda s: _with(lambda t: t.file("checkpoint/../../escape", b"evil")),
                      errors.InvalidArgument, r"'\.\.'"),
    "absolute": (lambda s: _with(lambda t: t.file("/tmp/escape", b"evil")), errors.InvalidArgument, "absolute"),
    "symlink-out": (lambda s: _with(lambda t: t.special("evil", tarfile.SYMTYPE, "../../../../etc")),
                    errors.InvalidArgument, "symlink"),
    "write-through-symlink": (
        lambda s: Tar().special("checkpoint", tarfile.SYMTYPE, s).file("checkpoint/pages-1.img", b"evil")
        .file("config.dump", b"{}").file("spec.dump", b"{}").bytes(),
        errors.InvalidArgument, "symlink"),
    "hardlink-out": (lambda s: _with(lambda t: t.special("checkpoint/x.img", tarfile.LNKTYPE, "/etc/passwd")),
                     errors.InvalidArgument, "absolute"),
    "hardlink-dotdot": (lambda s: _with(lambda t: t.special("checkpoint/x.img", tarfile.LNKTYPE, "../../x")),
                        errors.InvalidArgument, r"'\.\.'"),
    "hardlink-to-missing": (lambda s: _with(lambda t: t.special("checkpoint/x.img", tarfile.LNKTYPE, "later.img")),
                            errors.InvalidArgument, "hardlink"),
    "char-device": (lambda s: _with(lambda t: t.special("checkpoint/null", tarfile.CHRTYPE, devmajor=1, devminor=3)),
                    errors.InvalidArgument, "character device"),
    "block-device": (lambda s: _with(lambda t: t.special("checkpoint/sda", tarfile.BLKTYPE, devmajor=8)),
                     errors.InvalidArgument, "block device"),
    "fifo": (lambda s: _with(lambda t: t.special("checkpoint/fifo", tarfile.FIFOTYPE)), errors.InvalidArgument, "fifo"),
    "duplicate": (lambda s: _with(lambda t: t.file("config.dump", b"{}")), errors.InvalidArgument, "twice"),
    "duplicate-dot-slash": (lambda s: _with(lambda t: t.file("./spec.dump", b"{}")), errors.InvalidArgument, "twice"),
    "file-as-dir": (lambda s: _with(lambda t: t.file("config.dump/x", b"{}")), errors.InvalidArgument, "not a directory"),
    "dir-then-file": (lambda s: _with(lambda t: t.file("checkpoint", b"x")), errors.InvalidArgument, "twice|lie inside"),
    "pax-path-escape": (lambda s: _with(lambda t: t.file("harmless", b"evil", pax_headers={"path": "../../pax-escape"})),
                        errors.InvalidArgument, r"'\.\.'"),
    "gnu-longname-escape": (lambda s: _gnu_longname("../" * 40 + "escape"), errors.InvalidArgument, r"'\.\.'"),
    "non-utf8-name": (lambda s: _with(lambda t: t.file("checkpoint/\udcff\udcfe.img", b"x")),
                      errors.InvalidArgument, "not UTF-8"),
    "nul-in-pax-name": (lambda s: _with(lambda t: t.file("x", b"x", pax_headers={"path": "check\0point"})),
                        errors.InvalidArgument, "NUL"),
    "non-utf8-json": (lambda s: _json_member("config.dump", b'{"name": "My\xff\xfeApp"}'),
                      errors.InvalidArgument, "config.dump is not UTF-8"),
    "non-utf8-spec": (lambda s: _json_member("spec.dump", b'{"process": "\xc0\xaf"}'),
                      errors.InvalidArgument, "spec.dump is not UTF-8"),
    "garbage-json": (lambda s: _json_member("config.dump", b"\x00\x01garbage{"), errors.InvalidArgument, "not valid JSON"),
    "json-bomb-depth": (lambda s: _json_member("spec.dump", b"[" * 200_000 + b"]" * 200_000),
                        errors.InvalidArgument, "nested too deeply"),
    "json-duplicate-keys": (lambda s: _json_member("config.dump", b'{"name": "a", "name": "b"}'),
                            errors.InvalidArgument, "duplicate key"),
    "json-nan": (lambda s: _json_member("config.dump", b'{"name": NaN}'), errors.InvalidArgument, "not JSON|not valid"),
    "json-huge-int": (lambda s: _json_member("config.dump", b'{"n": ' + b"9" * 100_000 + b"}"),
                      errors.InvalidArgument, "not valid JSON"),
    "not-a-tar": (lambda s: os.urandom(4096), errors.InvalidArgument, "checksum|not a tar"),
    "truncated": (lambda s: podman_archive()[:3000], errors.InvalidArgument, "truncated"),
    "corrupt-gzip": (lambda s: b"\x1f\x8b\x08\x00" + os.urandom(600), errors.InvalidArgument, "gzip"),
    "corrupt-zstd": (lambda s: b"\x28\xb5\x2f\xfd" + os.urandom(600), errors.InvalidArgument, "zstd"),
    "xz": (lambda s: b"\xfd7zXZ\x00" + os.urandom(100), errors.InvalidArgument, "xz"),
    "nested-rootfs-diff-escape": (
        lambda s: _json_member("rootfs-diff.tar", Tar().file("../../etc/cron.d/evil", b"* * * * * root sh").bytes()),
        errors.InvalidArgument, r"rootfs-diff.tar member .*'\.\.'"),
    "nested-rootfs-diff-device": (
        lambda s: _json_member("rootfs-diff.tar", Tar().special("dev/sda", tarfile.BLKTYPE, devmajor=8).bytes()),
        errors.InvalidArgument, "block device"),
    "no-images": (lambda s: Tar().file("config.dump", b"{}").file("spec.dump", b"{}").bytes(),
                  errors.InvalidArgument, "CRIU images"),
    "files-img-garbage": (lambda s: _json_member("checkpoint/files.img", b"\x19\x43\x56\x54\x18\x31\x30\x56" + b"\xff" * 40),
                          errors.InvalidArgument, "files.img"),
}


def _gnu_longname(name: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        ti = tarfile.TarInfo(name)
        ti.size = 1
        tf.addfile(ti, io.BytesIO(b"x"))
    return buf.getvalue()


def _json_member(name: str, data: bytes) -> bytes:
    """A Podman archive with one member's content replaced."""
    original = tarfile.open(fileobj=io.BytesIO(podman_archive()))
    t = Tar()
    for m in original.getmembers():
        if m.name == name:
            t.file(name, data)
        elif m.isdir():
            t.dir(m.name)
        else:
            t.file(m.name, original.extractfile(m).read())  # type: ignore[union-attr]
    original.close()
    return t.bytes()


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_archive_is_refused_and_nothing_escapes(env: Env, case: str) -> None:
    make, error, match = HOSTILE[case]
    data = make(str(env.sentinel))
    before = env.outside()
    with pytest.raises(error, match=match):
        env.import_(data)
    env.assert_clean(before)
    assert not (env.root / "escape").exists() and not (env.root.parent / "escape").exists()


@pytest.mark.parametrize("limits,match", [
    (ImportLimits(max_member_bytes=60000), "more than the limit"),
    (ImportLimits(max_members=5), "more than 5 members"),
    (ImportLimits(max_total_bytes=50000), "more than 50000 bytes"),
    (ImportLimits(max_json_bytes=100), "more than the limit of 100"),
    (ImportLimits(max_path_bytes=10), "longer than 10 bytes"),
])
def test_limits(env: Env, limits: ImportLimits, match: str) -> None:
    before = env.outside()
    with pytest.raises(errors.ResourceExhausted, match=match):
        env.import_(podman_archive(), limits=limits)
    env.assert_clean(before)


def test_compressed_bomb_is_bounded_by_the_total(env: Env) -> None:
    # 64 MiB of zeros in one member compresses to almost nothing.
    t = Tar()
    ti = tarfile.TarInfo("checkpoint/pages-1.img")
    ti.size = 64 * MiB
    t.tf.addfile(ti, io.BytesIO(bytes(64 * MiB)))
    data = zstandard.ZstdCompressor(level=3).compress(t.bytes())
    assert len(data) < 64 * 1024
    before = env.outside()
    with pytest.raises(errors.ResourceExhausted):
        env.import_(data, limits=ImportLimits(max_total_bytes=16 * MiB))
    env.assert_clean(before)


def test_nested_rootfs_diff_is_kept_as_an_archive(env: Env) -> None:
    nested = Tar().file("etc/passwd", b"root::0:0::/:/bin/sh\n").file("data/x", b"x").bytes()
    rec = env.import_(_json_member("rootfs-diff.tar", nested))
    assert stored_files(env.store, rec)["containers/my-app/rootfs-diff.tar"] == nested
    assert not (env.root / "store" / "etc").exists() and not (env.cwd / "etc").exists()


def test_gzip_and_zstd_podman_archives_import(env: Env) -> None:
    raw = podman_archive()
    a = env.import_(gzip.compress(raw))
    b = env.import_(zstandard.ZstdCompressor().compress(raw))
    assert stored_files(env.store, a)["containers/my-app/rootfs-diff.tar"] == \
        stored_files(env.store, b)["containers/my-app/rootfs-diff.tar"]


def test_missing_archive_and_special_files(env: Env) -> None:
    with pytest.raises(errors.NotFound):
        interop.import_archive(env.store, str(env.root / "nope.tar"))
    with pytest.raises(errors.InvalidArgument, match="not a regular file"):
        interop.import_archive(env.store, str(env.root))


# -- pieces -------------------------------------------------------------------------------


def test_relax_root_dir_mode_touches_only_the_root_entry() -> None:
    busybox = _reg(b"/bin/busybox", 0o100755, 1)
    other_dir = _reg(b"/data", 0o40755, 3)
    pipe = _field(1, 2) + _field(2, 9) + _field(4, _field(1, 9))
    img = files_img([busybox, _reg(b"/", 0o40555, 2), pipe, other_dir])
    out, changed = imagefacts.relax_root_dir_mode(img)
    assert changed == 1
    assert out.count(_field(10, 0o40555)) == 0
    assert busybox in out and pipe in out and other_dir in out
    assert imagefacts.relax_root_dir_mode(out) == (out, 0)
    with pytest.raises(errors.InvalidArgument, match="magic"):
        imagefacts.relax_root_dir_mode(b"\0" * 16)
    with pytest.raises(errors.InvalidArgument, match="truncated"):
        imagefacts.relax_root_dir_mode(img[:-3])


def test_stats_dump_in_both_places_keeps_the_images_copy(env: Env) -> None:
    rec = env.import_(_with(lambda t: t.file("checkpoint/stats-dump", b"inside")))
    assert stored_files(env.store, rec)["containers/my-app/checkpoint/stats-dump"] == b"inside"


def test_hardlink_into_the_kept_tree_from_a_dropped_member_is_refused(env: Env) -> None:
    before = env.outside()
    with pytest.raises(errors.InvalidArgument, match="not kept"):
        env.import_(_with(lambda t: t.special("checkpoint/log.img", tarfile.LNKTYPE, "ctr.log")))
    env.assert_clean(before)


@pytest.mark.parametrize("change,match", [
    ({"linux": {"cgroup_parent": "/kubepods/../../system.slice"}}, "cgroup_parent"),
    ({"log_directory": "/var/log/pods/../../../etc/x"}, "log_directory"),
    ({"log_directory": "relative/dir"}, "log_directory"),
])
def test_own_archive_pod_paths_are_checked(env: Env, change: dict[str, Any], match: str) -> None:
    pod = pod_config()
    pod.update(change)
    rec, _ = make_checkpoint(env.store, pod=pod)
    out = env.root / "a.tar"
    interop.export_container(env.store, rec.id, "app", str(out))
    env.store.remove(rec.id)
    before = env.outside()
    with pytest.raises(errors.InvalidArgument, match=match):
        interop.import_archive(env.store, str(out))
    env.assert_clean(before)
