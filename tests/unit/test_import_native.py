"""containerd 2.x's own checkpoint archives (CRI CheckpointContainer) on import, hostile variants included.

The archives here have the layout containerd 2.1 writes (a plain tar, sorted
by name: `checkpoint/`, config.dump, container.log, dump.log, rootfs-diff.tar
as a gzip OCI layer with whiteout files, spec.dump, stats-dump, status,
status.dump); tests/e2e/test_native_import.py imports real ones.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import stat
import tarfile
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from criu_bridge.rootfs.apply import apply_diff
from node_agent import errors
from node_agent.interop.archive import Pass
from node_agent.interop.common import ImportLimits
from tests.unit.test_interop import Env, Tar, _json_member, _reg, files_img, stored_files

MiB = 1 << 20
SANDBOX = "24d6dbd0369acb94317073db67dbba8262466475034d2e3144465d4f1aaee1b7"
CID = "faa5f37523fb61696d18688171584e032ae613324319216c76f0cbf5a688b4a1"
IMAGE = "localhost/node-agent-test/debian:1"


def namespaces(pid_path: str | None = None, sandbox_pid: int = 23691) -> list[dict[str, str]]:
    pid: dict[str, str] = {"type": "pid"}
    if pid_path is not None:
        pid["path"] = pid_path
    return [pid, {"type": "ipc", "path": f"/proc/{sandbox_pid}/ns/ipc"},
            {"type": "uts", "path": f"/proc/{sandbox_pid}/ns/uts"}, {"type": "mount"},
            {"type": "network", "path": f"/proc/{sandbox_pid}/ns/net"}]


def spec(ns: list[dict[str, str]] | None = None) -> dict[str, Any]:
    sandbox_dir = f"/var/lib/containerd/io.containerd.grpc.v1.cri/sandboxes/{SANDBOX}"
    return {
        "ociVersion": "1.2.1",
        "process": {"user": {"uid": 0, "gid": 0}, "args": ["python3", "-c", "pass"],
                    "env": ["PATH=/usr/local/bin:/usr/bin:/bin"], "cwd": "/"},
        "root": {"path": "rootfs"},
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup"},
            *({"destination": d, "type": "bind", "source": f"{sandbox_dir}/{d.rsplit('/', 1)[-1]}",
               "options": ["rbind", "rprivate", "rw"]} for d in ("/etc/hostname", "/etc/hosts", "/etc/resolv.conf")),
            {"destination": "/dev/shm", "type": "bind", "source": f"/run/containerd/sandboxes/{SANDBOX}/shm",
             "options": ["rbind", "rprivate", "rw"]},
        ],
        "annotations": {
            "io.kubernetes.cri.container-name": "app", "io.kubernetes.cri.container-type": "container",
            "io.kubernetes.cri.image-name": IMAGE, "io.kubernetes.cri.sandbox-id": SANDBOX,
            "io.kubernetes.cri.sandbox-name": "web-0", "io.kubernetes.cri.sandbox-namespace": "shop",
            "io.kubernetes.cri.sandbox-uid": "5182a3cb-7281-4a45-8465-b72c57ea76dc",
        },
        "linux": {"namespaces": ns if ns is not None else namespaces()},
    }


def config_dump(**changes: Any) -> dict[str, Any]:
    cfg = {"id": CID, "name": "app_web-0_shop_5182a3cb-7281-4a45-8465-b72c57ea76dc_0", "rootfsImage": IMAGE,
           "rootfsImageRef": "sha256:584f45c2", "rootfsImageName": IMAGE, "runtime": "io.containerd.runc.v2",
           "createdTime": "2026-12-01T12:33:17.782148652Z", "checkpointedTime": "2026-12-01T12:33:20.322581639Z",
           "restoredTime": "0001-01-01T00:00:00Z", "restored": False}
    cfg.update(changes)
    return cfg


def status_dump(**changes: Any) -> dict[str, Any]:
    status = {"id": CID, "metadata": {"name": "app"}, "state": 1, "created_at": 1796128397782763795,
              "started_at": 1796128397822309654, "image": {"image": IMAGE}, "image_ref": "sha256:584f45c2",
              "labels": {"io.kubernetes.pod.name": "web-0"},
              "annotations": {"cdi.k8s.io/evil": "vendor.com/gpu=all"},
              "log_path": "/var/log/pods/shop_web-0_5182/app/0.log", "resources": {"linux": {}}}
    status.update(changes)
    return status


def layer(build: Callable[[Tar], Any] | None = None, *, compress: bool = True) -> bytes:
    """A writable layer as containerd's differ writes it: an OCI layer, gzip by default."""
    t = Tar()
    if build is None:
        t.dir("etc/")
        t.file("etc/.wh.motd", b"")
        t.dir("etc/apt/")
        t.file("etc/apt/.wh..wh..opq", b"")
        t.file("etc/apt/only.conf", b"new\n", mode=0o640, uid=7, gid=8, mtime=1796128397)
        t.dir("var/lib/app/")
        t.file("var/lib/app/count.log", b"1\n2\n3\n", pax_headers={"SCHILY.xattr.user.origin": "app",
                                                                  "mtime": "1796128397.5"})
        t.special("var/lib/app/current", tarfile.SYMTYPE, "count.log")
        t.special("var/lib/app/again.log", tarfile.LNKTYPE, "var/lib/app/count.log")
        t.special("var/lib/app/pipe", tarfile.FIFOTYPE)
        t.file("var/lib/app/" + "long-" * 30 + "name", b"long\n")
    else:
        build(t)
    data = t.bytes()
    return gzip.compress(data) if compress else data


def native_archive(*, spec_doc: dict[str, Any] | None = None, cfg: dict[str, Any] | None = None,
                   status: dict[str, Any] | bytes | None = None, diff: bytes | None = None,
                   replace: dict[str, Callable[[Tar], Any]] | None = None,
                   extra: Callable[[Tar], Any] | None = None) -> bytes:
    """An archive in containerd 2.1's layout and member order; `replace` builds a member instead."""
    replace = replace or {}
    status_bytes = status if isinstance(status, bytes) else json.dumps(status or status_dump()).encode()
    members: list[tuple[str, Callable[[Tar], Any]]] = [
        ("checkpoint/", lambda t: t.dir("checkpoint/")),
        ("checkpoint/descriptors.json", lambda t: t.file("checkpoint/descriptors.json", b'["/dev/null"]')),
        ("checkpoint/files.img", lambda t: t.file(
            "checkpoint/files.img", files_img([_reg(b"/usr/bin/python3.11", 0o100755, 1), _reg(b"/", 0o40755, 2)]))),
        ("checkpoint/inventory.img", lambda t: t.file("checkpoint/inventory.img", b"inventory")),
        ("checkpoint/pages-1.img", lambda t: t.file("checkpoint/pages-1.img", os.urandom(70000))),
        ("config.dump", lambda t: t.file("config.dump", json.dumps(cfg or config_dump()).encode(), mode=0o600)),
        ("container.log", lambda t: t.file("container.log", b"2026-12-01T12:33:17Z stdout F tick 1\n", mode=0o600)),
        ("dump.log", lambda t: t.file("dump.log", b"(00.000000) CRIU run id\n", mode=0o600)),
        ("rootfs-diff.tar", lambda t: t.file("rootfs-diff.tar", diff if diff is not None else layer())),
        ("spec.dump", lambda t: t.file("spec.dump", json.dumps(spec_doc or spec()).encode())),
        ("stats-dump", lambda t: t.file("stats-dump", b"@Y\x10stats")),
        ("status", lambda t: t.file("status", b'{"Version":"v1","Pid":23738}', mode=0o600)),
        ("status.dump", lambda t: t.file("status.dump", status_bytes, mode=0o600)),
    ]
    t = Tar()
    for name, make in members:
        (replace.get(name) or make)(t)
    if extra:
        extra(t)
    return t.bytes()


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    e = Env(tmp_path)
    monkeypatch.chdir(e.cwd)
    yield e


def stored_diff(files: dict[str, bytes]) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(files["containers/app/rootfs-diff.tar"]), mode="r:") as tf:
        return {m.name.rstrip("/"): m for m in tf}


# -- what an import makes of them ------------------------------------------------------------


def test_native_archive_becomes_a_pod_checkpoint(env: Env) -> None:
    rec = env.import_(native_archive())
    meta = rec.metadata
    assert meta["pod"]["namespace"] == "shop" and meta["pod"]["name"] == "web-0"
    assert meta["containers"] == [{"name": "app", "id": CID, "image": IMAGE, "image_ref": "sha256:584f45c2",
                                   "dump_ms": 0.0}]
    assert meta["imported"]["format"] == "containerd" and meta["imported"]["container_id"] == CID
    files = stored_files(env.store, rec)
    assert sorted(files) == [
        "containers/app/checkpoint/descriptors.json", "containers/app/checkpoint/files.img",
        "containers/app/checkpoint/inventory.img", "containers/app/checkpoint/pages-1.img",
        "containers/app/checkpoint/stats-dump",
        "containers/app/config.dump", "containers/app/deleted.files", "containers/app/dump.log",
        "containers/app/opaque.dirs", "containers/app/rootfs-diff.tar", "containers/app/spec.dump",
        "pod/config.json", "pod/cpuinfo/cpuinfo.img",
    ]  # no container.log, status or status.dump
    pod = json.loads(files["pod/config.json"])["config"]
    assert pod["linux"]["security_context"]["namespace_options"] == {"network": 0, "pid": 1, "ipc": 0}
    cfg = json.loads(files["containers/app/config.dump"])["config"]
    assert cfg["linux"]["security_context"]["namespace_options"] == {"network": 0, "pid": 1, "ipc": 0}
    assert cfg["mounts"] == [] and cfg["command"] == ["python3", "-c", "pass"]
    # Nothing of status.dump's labels or annotations reaches the new container.
    assert "cdi" not in json.dumps(cfg) and "cdi" not in json.dumps(pod)

    # The whiteouts became the lists; the rest a plain tar with every attribute kept.
    assert json.loads(files["containers/app/deleted.files"]) == ["etc/motd"]
    assert json.loads(files["containers/app/opaque.dirs"]) == ["etc/apt"]
    diff = stored_diff(files)
    long_name = "var/lib/app/" + "long-" * 30 + "name"
    assert sorted(diff) == sorted(["etc", "etc/apt", "etc/apt/only.conf", "var/lib/app", "var/lib/app/count.log",
                                   "var/lib/app/current", "var/lib/app/again.log", "var/lib/app/pipe", long_name])
    conf = diff["etc/apt/only.conf"]
    assert (conf.mode, conf.uid, conf.gid, conf.mtime) == (0o640, 7, 8, 1796128397)
    count = diff["var/lib/app/count.log"]
    assert count.pax_headers.get("SCHILY.xattr.user.origin") == "app" and count.mtime == 1796128397.5
    assert diff["var/lib/app/current"].issym() and diff["var/lib/app/current"].linkname == "count.log"
    assert diff["var/lib/app/again.log"].islnk() and diff["var/lib/app/again.log"].linkname == "var/lib/app/count.log"
    assert diff["var/lib/app/pipe"].isfifo() and diff[long_name].size == 5


def test_the_converted_layer_applies_as_the_restore_applies_it(env: Env, tmp_path: Path) -> None:
    files = stored_files(env.store, env.import_(native_archive()))
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc" / "apt" / "sources.list.d").mkdir(parents=True)
    (rootfs / "etc" / "motd").write_text("welcome\n")
    (rootfs / "etc" / "apt" / "sources.list").write_text("deb x\n")
    (rootfs / "etc" / "passwd").write_text("root:x:0:0::/:/bin/sh\n")
    plan = tmp_path / "plan"
    plan.mkdir()
    for name in ("rootfs-diff.tar", "deleted.files", "opaque.dirs"):
        (plan / name).write_bytes(files[f"containers/app/{name}"])
    apply_diff(str(rootfs), str(plan / "rootfs-diff.tar"), str(plan / "deleted.files"))
    assert not (rootfs / "etc" / "motd").exists()
    assert os.listdir(rootfs / "etc" / "apt") == ["only.conf"]
    assert (rootfs / "etc" / "passwd").read_text().startswith("root")
    app = rootfs / "var" / "lib" / "app"
    assert (app / "count.log").read_bytes() == b"1\n2\n3\n"
    assert os.readlink(app / "current") == "count.log"
    assert os.stat(app / "again.log").st_ino == os.stat(app / "count.log").st_ino
    assert stat.S_ISFIFO(os.lstat(app / "pipe").st_mode)
    assert os.getxattr(app / "count.log", "user.origin") == b"app"


def test_a_layer_with_only_an_opaque_directory_still_gets_its_deleted_files(env: Env) -> None:
    diff = layer(lambda t: (t.dir("etc/apt/"), t.file("etc/apt/.wh..wh..opq", b"")))
    files = stored_files(env.store, env.import_(native_archive(diff=diff)))
    # The restore reads opaque.dirs beside deleted.files only.
    assert json.loads(files["containers/app/deleted.files"]) == []
    assert json.loads(files["containers/app/opaque.dirs"]) == ["etc/apt"]


def test_a_layer_without_whiteouts_writes_no_lists_and_an_uncompressed_one_is_read_too(env: Env) -> None:
    plain = layer(lambda t: t.file("data/x", b"x"), compress=False)
    for diff in (plain, gzip.compress(plain)):
        files = stored_files(env.store, env.import_(native_archive(diff=diff)))
        assert "containers/app/deleted.files" not in files and "containers/app/opaque.dirs" not in files
        assert sorted(stored_diff(files)) == ["data/x"]


def test_the_archives_own_deleted_files_join_the_layers_whiteouts(env: Env) -> None:
    archive = native_archive(extra=lambda t: t.file("deleted.files", b'["usr/share/doc", "etc/motd"]'))
    files = stored_files(env.store, env.import_(archive))
    assert json.loads(files["containers/app/deleted.files"]) == ["usr/share/doc", "etc/motd"]


def test_an_empty_layer_stays_empty(env: Env) -> None:
    files = stored_files(env.store, env.import_(native_archive(diff=b"")))
    assert files["containers/app/rootfs-diff.tar"] == b""


def test_the_container_name_comes_from_status_dump_when_the_spec_names_none(env: Env) -> None:
    doc = spec()
    del doc["annotations"]["io.kubernetes.cri.container-name"]
    rec = env.import_(native_archive(spec_doc=doc, status=status_dump(metadata={"name": "Worker_1"})))
    assert rec.metadata["containers"][0]["name"] == "worker-1"


def test_pod_shared_pid_namespace_is_restored_into_the_new_pods(env: Env) -> None:
    rec = env.import_(native_archive(spec_doc=spec(namespaces("/proc/23691/ns/pid"))))
    files = stored_files(env.store, rec)
    pod = json.loads(files["pod/config.json"])["config"]
    cfg = json.loads(files["containers/app/config.dump"])["config"]
    assert pod["linux"]["security_context"]["namespace_options"]["pid"] == 0  # POD
    assert cfg["linux"]["security_context"]["namespace_options"]["pid"] == 0


@pytest.mark.parametrize("ns", [
    namespaces("/proc/4242/ns/pid"),  # CRI TARGET: another container's namespace
    namespaces("/proc/23691/ns/ipc"),  # not a PID namespace
    namespaces("/proc/23691/ns/pid/../../1/ns/pid"),
    namespaces("/run/netns/other"),
    [{"type": "pid", "path": "/proc/23691/ns/pid"}, {"type": "mount"}],  # nothing says it is the sandbox's
])
def test_another_containers_pid_namespace_is_refused(env: Env, ns: list[dict[str, str]]) -> None:
    before = env.outside()
    with pytest.raises(errors.FailedPrecondition, match="another container's PID namespace.*its own PID namespace"):
        env.import_(native_archive(spec_doc=spec(ns)))
    env.assert_clean(before)


# -- hostile native archives ----------------------------------------------------------------


def _deep_status() -> bytes:
    return b'{"id": "' + CID.encode() + b'", "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


HOSTILE: dict[str, tuple[Callable[[], bytes], type[errors.AgentError], str]] = {
    # status.dump
    "status-not-json": (lambda: native_archive(status=b"\x00garbage{"), errors.InvalidArgument, "status.dump"),
    "status-not-object": (lambda: native_archive(status=b"[1, 2]"), errors.InvalidArgument, "not a JSON object"),
    "status-duplicate-keys": (lambda: native_archive(status=b'{"id": "a", "id": "b"}'),
                              errors.InvalidArgument, "duplicate key"),
    "status-too-deep": (lambda: native_archive(status=_deep_status()), errors.InvalidArgument, "nested too deeply"),
    "status-other-container": (lambda: native_archive(status=status_dump(id="0" * 64)),
                               errors.InvalidArgument, "describes container"),
    "status-bad-name": (lambda: native_archive(status=status_dump(metadata={"name": "a\nb"})),
                        errors.InvalidArgument, "control characters"),
    "status-as-directory": (lambda: native_archive(replace={"status.dump": lambda t: t.dir("status.dump/")}),
                            errors.InvalidArgument, "status.dump is not a file"),
    "status-symlink": (lambda: native_archive(
        replace={"status.dump": lambda t: t.special("status.dump", tarfile.SYMTYPE, "/etc/shadow")}),
        errors.InvalidArgument, "symlink"),
    "status-hardlink-out": (lambda: native_archive(
        replace={"status.dump": lambda t: t.special("status.dump", tarfile.LNKTYPE, "../../etc/shadow")}),
        errors.InvalidArgument, r"'\.\.'"),
    "container-log-symlink": (lambda: native_archive(
        replace={"container.log": lambda t: t.special("container.log", tarfile.SYMTYPE, "/var/log/syslog")}),
        errors.InvalidArgument, "symlink"),
    "status-device": (lambda: native_archive(
        replace={"status": lambda t: t.special("status", tarfile.CHRTYPE, devmajor=1, devminor=3)}),
        errors.InvalidArgument, "character device"),
    # the layer
    "layer-dotdot": (lambda: native_archive(diff=layer(lambda t: t.file("../../etc/cron.d/evil", b"* * * * *"))),
                     errors.InvalidArgument, r"rootfs-diff.tar member .*'\.\.'"),
    "layer-absolute": (lambda: native_archive(diff=layer(lambda t: t.file("/etc/cron.d/evil", b"x"))),
                       errors.InvalidArgument, "absolute"),
    "layer-pax-escape": (lambda: native_archive(diff=layer(
        lambda t: t.file("harmless", b"x", pax_headers={"path": "../escape"}))), errors.InvalidArgument, r"'\.\.'"),
    "layer-whiteout-dotdot": (lambda: native_archive(diff=layer(lambda t: t.file("etc/.wh...", b""))),
                              errors.InvalidArgument, "names no file"),
    "layer-whiteout-dot": (lambda: native_archive(diff=layer(lambda t: t.file("etc/.wh..", b""))),
                           errors.InvalidArgument, "names no file"),
    "layer-whiteout-empty": (lambda: native_archive(diff=layer(lambda t: t.file(".wh.", b""))),
                             errors.InvalidArgument, "names no file"),
    "layer-symlink-nul": (lambda: native_archive(diff=layer(
        lambda t: t.special("a", tarfile.SYMTYPE, "x", pax_headers={"linkpath": "/etc\0/shadow"}))),
        errors.InvalidArgument, "bad target"),
    "opaque-dirs-not-a-list": (lambda: native_archive(extra=lambda t: t.file("opaque.dirs", b'{"etc": 1}')),
                               errors.InvalidArgument, "opaque.dirs is not a JSON list"),
    "layer-opaque-root": (lambda: native_archive(diff=layer(lambda t: t.file(".wh..wh..opq", b""))),
                          errors.InvalidArgument, "rootfs itself opaque"),
    "layer-under-whiteout": (lambda: native_archive(diff=layer(lambda t: t.file("etc/.wh.x/y", b""))),
                             errors.InvalidArgument, "under a whiteout"),
    "layer-whiteout-dir": (lambda: native_archive(diff=layer(lambda t: t.dir("etc/.wh.x/"))),
                           errors.InvalidArgument, "whiteout that is not a regular file"),
    "layer-whiteout-symlink": (lambda: native_archive(diff=layer(
        lambda t: t.special("etc/.wh.x", tarfile.SYMTYPE, "/etc/shadow"))), errors.InvalidArgument, "whiteout"),
    "layer-device": (lambda: native_archive(diff=layer(
        lambda t: t.special("dev/sda", tarfile.BLKTYPE, devmajor=8))), errors.InvalidArgument, "block device"),
    "layer-hardlink-out": (lambda: native_archive(diff=layer(
        lambda t: t.special("etc/passwd", tarfile.LNKTYPE, "../../etc/shadow"))), errors.InvalidArgument, r"'\.\.'"),
    "layer-hardlink-missing": (lambda: native_archive(diff=layer(
        lambda t: t.special("a", tarfile.LNKTYPE, "later"))), errors.InvalidArgument, "hardlink"),
    "layer-hardlink-to-whiteout": (lambda: native_archive(diff=layer(
        lambda t: (t.file(".wh.gone", b""), t.special("a", tarfile.LNKTYPE, ".wh.gone")))),
        errors.InvalidArgument, "hardlink"),
    "layer-duplicate": (lambda: native_archive(diff=layer(lambda t: (t.file("a", b"1"), t.file("./a", b"2")))),
                        errors.InvalidArgument, "twice"),
    "layer-non-utf8": (lambda: native_archive(diff=layer(lambda t: t.file("etc/\udcff", b"x"))),
                       errors.InvalidArgument, "not UTF-8"),
    "layer-corrupt-gzip": (lambda: native_archive(diff=b"\x1f\x8b\x08\x00" + os.urandom(600)),
                           errors.InvalidArgument, "rootfs-diff.tar gzip"),
    "layer-truncated": (lambda: native_archive(diff=gzip.compress(layer(compress=False)[:1500])),
                        errors.InvalidArgument, "truncated"),
    "layer-not-a-tar": (lambda: native_archive(diff=gzip.compress(os.urandom(4096))),
                        errors.InvalidArgument, "checksum"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_native_archive_is_refused_and_nothing_escapes(env: Env, case: str) -> None:
    make, error, match = HOSTILE[case]
    data = make()
    before = env.outside()
    with pytest.raises(error, match=match):
        env.import_(data)
    env.assert_clean(before)
    assert not (env.root / "escape").exists() and not (env.root.parent / "escape").exists()


def test_oversized_status_dump_is_refused_at_its_header(env: Env) -> None:
    big = json.dumps(status_dump(labels={f"k{i}": "v" * 100 for i in range(100)})).encode()
    assert len(big) > 8192
    before = env.outside()
    with pytest.raises(errors.ResourceExhausted, match=r"status.dump: \d+ bytes is more than the limit of 8192"):
        env.import_(native_archive(status=big), limits=ImportLimits(max_json_bytes=8192))
    env.assert_clean(before)


def test_what_is_not_kept_is_not_staged_but_still_counts(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """container.log and status are skipped unread; status.dump is staged to be read; all count against the total."""
    huge_log = os.urandom(3 * MiB)
    archive = native_archive(replace={"container.log": lambda t: t.file("container.log", huge_log)})
    before = env.outside()
    with pytest.raises(errors.ResourceExhausted, match="max_total_bytes"):
        env.import_(archive, limits=ImportLimits(max_total_bytes=2 * MiB))
    env.assert_clean(before)

    staged: list[str] = []
    real_stage = Pass._stage

    def stage(self: Pass, reader: Any, shown: str, size: int) -> str:
        staged.append(shown)
        return real_stage(self, reader, shown, size)

    monkeypatch.setattr(Pass, "_stage", stage)
    files = stored_files(env.store, env.import_(archive))
    assert "'status.dump'" in staged and "'config.dump'" in staged
    assert "'container.log'" not in staged and "'status'" not in staged
    assert not any(huge_log[:64] in data for data in files.values())


def test_a_layer_bomb_is_bounded(env: Env) -> None:
    """A gzip layer of a few KiB that inflates to 64 MiB stops at the bound on one file."""
    t = Tar()
    ti = tarfile.TarInfo("bomb")
    ti.size = 64 * MiB
    t.tf.addfile(ti, io.BytesIO(bytes(64 * MiB)))
    diff = gzip.compress(t.bytes(), compresslevel=9)
    assert len(diff) < 256 * 1024
    before = env.outside()
    with pytest.raises(errors.ResourceExhausted, match="rootfs-diff.tar"):
        env.import_(native_archive(diff=diff), limits=ImportLimits(max_member_bytes=16 * MiB))
    env.assert_clean(before)
    with pytest.raises(errors.ResourceExhausted, match="max_total_bytes"):
        env.import_(native_archive(diff=diff), limits=ImportLimits(max_total_bytes=16 * MiB))
    env.assert_clean(before)
    # Files each within the bound on one file, together past it: the plain tar is one file.
    t = Tar()
    for i in range(5):
        ti = tarfile.TarInfo(f"part-{i}")
        ti.size = 4 * MiB
        t.tf.addfile(ti, io.BytesIO(bytes(4 * MiB)))
    with pytest.raises(errors.ResourceExhausted, match="uncompressed layer is larger than 16777216"):
        env.import_(native_archive(diff=gzip.compress(t.bytes())), limits=ImportLimits(max_member_bytes=16 * MiB))
    env.assert_clean(before)


def test_too_many_layer_members_are_refused(env: Env) -> None:
    diff = layer(lambda t: [t.file(f"f{i}", b"") for i in range(50)])
    before = env.outside()
    with pytest.raises(errors.ResourceExhausted, match="rootfs-diff.tar has more than 40 members"):
        env.import_(native_archive(diff=diff), limits=ImportLimits(max_members=40))
    env.assert_clean(before)


def test_whiteouts_are_only_read_in_containerd_archives(env: Env) -> None:
    """A Podman or CRI-O rootfs-diff.tar is a plain tar of changed files: a `.wh.` name there is just a name."""
    nested = Tar().file("etc/.wh.motd", b"").bytes()
    rec = env.import_(_json_member("rootfs-diff.tar", nested))
    assert stored_files(env.store, rec)["containers/my-app/rootfs-diff.tar"] == nested
