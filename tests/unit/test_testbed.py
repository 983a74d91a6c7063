"""The test bed's provisioning, its pure parts: configs, apt sources, image archives, the model's weights.

No root, no network, no containerd: what scripts/testbed renders and builds,
checked as data.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import os
import struct
import subprocess
import tarfile
import tomllib
from pathlib import Path
from typing import Any

import pytest

from node_agent import containerd
from testbed import cli, config, debian, images, layout, oci, weights
from testbed import host
from testbed.host import arg_value, program_name, under

REPO = Path(__file__).resolve().parents[2]
PLATFORM = {"architecture": "arm", "os": "linux", "variant": "v7"}


def _dig(doc: dict[str, Any], name: str) -> Any:
    """The table of `doc` at TOML table name `name` (as node_agent.containerd writes them: a."b.c".d)."""
    node: Any = tomllib.loads(f"[{name}]\nmarker = 1\n")
    while "marker" not in node:
        (key, node), = node.items()
        doc = doc[key]
    return doc


# --------------------------------------------------------------------------
# containerd's config


@pytest.mark.parametrize("version,expected", [
    ("1.6.20~ds1", 2), ("1.7.24", 2), ("v2.0.0", 3), ("2.1.9+unknown", 3), ("garbage", 2),
])
def test_config_version_follows_the_containerd_major(version: str, expected: int) -> None:
    assert config.config_version_for(version) == expected
    text = config.containerd_config(layout.BedLayout("t"), version)
    assert tomllib.loads(text)["version"] == expected


def test_version_2_config_puts_everything_in_the_one_cri_plugin() -> None:
    bed = layout.BedLayout("alpha")
    doc = tomllib.loads(config.containerd_config(bed, "1.7.24"))
    assert containerd.version_of(doc) == 2
    assert (doc["root"], doc["state"]) == (bed.root, bed.ctr_state)
    assert doc["grpc"]["address"] == bed.socket and doc["ttrpc"]["address"] == bed.ttrpc_socket
    assert "io.containerd.nri.v1.nri" in doc["disabled_plugins"]
    cri = doc["plugins"][containerd.CRI]
    assert cri["sandbox_image"] == layout.IMAGES["pause"]
    assert cri["cni"] == {"bin_dir": layout.CNI_BIN_DIR, "conf_dir": bed.cni_conf_dir, "max_conf_num": 1}
    assert cri["cdi_spec_dirs"] == [bed.cdi_dir] and cri["registry"]["config_path"] == bed.hosts_dir
    assert _dig(doc, containerd.containerd_table(2))["default_runtime_name"] == "runc"
    runc = containerd.runtimes(doc, 2)["runc"]
    assert runc == _dig(doc, containerd.table(2, "runc"))
    assert runc["runtime_type"] == "io.containerd.runc.v2" and "sandboxer" not in runc
    assert runc["options"] == {"Root": bed.runc_base, "SystemdCgroup": False}
    assert containerd.runtimes(doc, 3) == {}


def test_version_3_config_splits_the_cri_plugin_and_names_the_runc() -> None:
    bed = layout.BedLayout("beta")
    doc = tomllib.loads(config.containerd_config(bed, "2.1.4", "/opt/c2/bin/runc"))
    assert containerd.version_of(doc) == 3
    plugins = doc["plugins"]
    assert plugins[containerd.CRI] == {"disable_tcp_service": True, "stream_server_address": "127.0.0.1",
                                       "stream_server_port": "0"}
    assert plugins[containerd.CRI_IMAGES]["pinned_images"]["sandbox"] == layout.IMAGES["pause"]
    assert plugins[containerd.CRI_RUNTIME]["cni"]["bin_dirs"] == [layout.CNI_BIN_DIR]
    nri = plugins["io.containerd.nri.v1.nri"]
    assert (nri["disable"], nri["socket_path"], nri["plugin_path"]) == (False, bed.nri_socket, bed.nri_plugin_dir)
    runc = containerd.runtimes(doc, 3)["runc"]
    assert runc["sandboxer"] == containerd.SANDBOXER
    assert runc["options"] == {"BinaryName": "/opt/c2/bin/runc", "Root": bed.runc_base, "SystemdCgroup": False}
    assert containerd.runtimes(doc, 2) == {}
    # Before 2.1, bin_dirs is unknown.
    older = tomllib.loads(config.containerd_config(bed, "2.0.5"))
    assert older["plugins"][containerd.CRI_RUNTIME]["cni"]["bin_dir"] == layout.CNI_BIN_DIR


@pytest.mark.parametrize("version,containerd_version", [(2, "1.7.24"), (3, "2.1.4")])
def test_the_restore_handler_tables_join_the_config_of_their_version(version: int, containerd_version: str) -> None:
    bed = layout.BedLayout("gamma")
    snippet = containerd.handler_tables(version, "node-agent-restore", binary="/usr/bin/wrap", root="/run/r",
                                        systemd_cgroup=False)
    text = config.containerd_config(bed, containerd_version) + snippet
    doc = tomllib.loads(text)
    handler = containerd.runtimes(doc, version)["node-agent-restore"]
    assert handler["options"]["BinaryName"] == "/usr/bin/wrap"
    assert config.handler_names(text, "snippet", version) == ["runc", "node-agent-restore"]
    assert list(containerd.all_runtimes(doc)) == ["runc", "node-agent-restore"]


def test_a_handler_in_the_other_versions_layout_is_refused() -> None:
    bed = layout.BedLayout("delta")
    snippet = containerd.handler_tables(2, "old", binary="/b", root="/r", systemd_cgroup=False)
    text = config.containerd_config(bed, "2.1.4") + snippet
    with pytest.raises(host.TestbedError) as err:
        config.handler_names(text, "FILE", 3)
    assert str(err.value) == (
        'FILE: handler(s) old are under plugins."io.containerd.grpc.v1.cri", which this bed\'s version-3 config '
        'ignores; put them under plugins."io.containerd.cri.v1.runtime".containerd.runtimes.NAME '
        '(with sandboxer = "podsandbox")')
    assert config.handler_names(text, "FILE") == ["old", "runc"]
    with pytest.raises(host.TestbedError, match="not valid TOML"):
        config.handler_names("[[", "FILE", 2)


def test_cni_config_is_the_beds_bridge_and_subnet() -> None:
    bed = layout.BedLayout("eps")
    conf = json.loads(config.cni_config(bed, 7))
    assert conf["name"] == "node-agent-testbed-eps" and conf["cniVersion"] == "1.0.0"
    plugin, = conf["plugins"]
    assert (plugin["type"], plugin["bridge"], plugin["isGateway"], plugin["ipMasq"]) == ("bridge", "natb7", True, False)
    assert plugin["ipam"]["dataDir"] == bed.ipam_dir
    assert plugin["ipam"]["ranges"] == [[{"subnet": "10.231.7.0/24", "gateway": "10.231.7.1"}]]


# --------------------------------------------------------------------------
# A bed's layout


def test_bed_names_are_checked_and_paths_follow_them() -> None:
    bed = layout.BedLayout("n-1")
    assert bed.base == "/var/lib/node-agent-testbed/n-1" and bed.state == "/run/node-agent-testbed/n-1"
    assert bed.runc_root == "/run/node-agent-testbed/n-1/runc/k8s.io"
    assert bed.cgroup_parent == "/node-agent-testbed/n-1"
    for bad in ("", "-a", "A", "a_b", "a" * 41):
        with pytest.raises(host.TestbedError, match="invalid bed name"):
            layout.BedLayout(bad)


def test_a_bed_takes_a_free_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layout, "BASE_ROOT", str(tmp_path))
    for name, index in (("a", "1\n"), ("b", "3\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "index").write_text(index)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "testbed.json").write_text(json.dumps({"index": 2}))
    (tmp_path / "Not_A_Bed").mkdir()
    bed = layout.BedLayout("new")
    assert layout.claimed_indexes("new") == {1: "a", 3: "b", 2: "c"}
    assert layout.choose_index(bed, None, None) == 4
    assert layout.choose_index(bed, None, 7) == 7
    assert layout.choose_index(bed, None, 3) == 4
    assert layout.choose_index(layout.BedLayout("b"), None, 3) == 3
    with pytest.raises(host.TestbedError, match="index 3 is used by bed b"):
        layout.choose_index(bed, 3, None)
    with pytest.raises(host.TestbedError, match=r"--index must be in 1\.\.200"):
        layout.choose_index(bed, 201, None)


def test_the_lock_excludes_and_can_be_removed(tmp_path: Path) -> None:
    path = str(tmp_path / "locks" / "x.lock")
    with layout.Lock(path) as lock:
        assert os.path.exists(path)
        lock.unlink()
    assert not os.path.exists(path)


def test_image_kinds_always_include_pause_and_the_torch_image_only_when_named() -> None:
    assert cli.image_kinds(None) == ["busybox", "pause", "memhog", "debian"]
    assert cli.image_kinds("debian, busybox") == ["busybox", "pause", "debian"]
    assert cli.image_kinds("torch") == ["pause", "torch"]
    with pytest.raises(host.TestbedError, match="unknown image nope"):
        cli.image_kinds("nope")


def test_the_workload_sources_are_found() -> None:
    assert Path(layout.IMAGE_SOURCES) == REPO / "scripts" / "testbed_images"
    for name in [*debian.DEBIAN_PROGRAMS, *debian.DEBIAN_FILES, *debian.TORCH_PROGRAMS, "pause.c", "memhog.c"]:
        assert (Path(layout.IMAGE_SOURCES) / name).is_file(), name


def test_command_lines_are_read_as_containerd_writes_them() -> None:
    argv = ["/lib64/ld-linux-x86-64.so.2", "--library-path", "/x", "/opt/bin/containerd-shim-runc-v2", "-id", "a"]
    assert program_name(argv) == "containerd-shim-runc-v2"
    assert program_name(["/usr/bin/containerd", "--config", "c"]) == "containerd"
    assert arg_value(["containerd", "--config=/a"], "--config", "-c") == "/a"
    assert arg_value(["containerd", "-c", "/b"], "--config", "-c") == "/b"
    assert under("/run/x/y", "/run/x") and under("/run/x", "/run/x") and not under("/run/xy", "/run/x")


def test_the_mount_table_is_read_with_each_mounts_type() -> None:
    points = dict(host.mountpoints())
    assert "/" in points and points["/proc"] == "proc"
    assert all(point.startswith("/") and fstype for point, fstype in points.items())


# --------------------------------------------------------------------------
# apt sources


DEB822 = """\
# The main archive.
Types: deb deb-src
URIs: http://deb.example.org/debian/
Suites: trixie trixie-updates
Components: main
Signed-By: -----BEGIN PGP PUBLIC KEY BLOCK-----
 .
 abc
 -----END PGP PUBLIC KEY BLOCK-----

Types: deb
URIs: http://disabled.example.org/debian
Suites: trixie
Enabled: no

Types: deb
URIs: http://security.example.org/debian-security
Suites: trixie-security
"""

ONE_LINE = """\
# deb http://commented.example.org/debian trixie main
deb-src http://src.example.org/debian trixie main
deb [arch=amd64 signed-by=/usr/share/keyrings/k.gpg] http://one.example.org/debian/ bookworm main contrib  # why
"""


def test_deb822_stanzas_keep_fields_and_multi_line_values() -> None:
    entries = debian._deb822_entries(DEB822)
    assert [e["uris"] for e in entries] == ["http://deb.example.org/debian/", "http://disabled.example.org/debian",
                                            "http://security.example.org/debian-security"]
    assert entries[0]["suites"] == "trixie trixie-updates" and entries[0]["types"] == "deb deb-src"
    assert entries[0]["signed-by"].splitlines()[-1] == "-----END PGP PUBLIC KEY BLOCK-----"
    assert entries[1]["enabled"] == "no"


def test_one_line_entries_skip_comments_and_options() -> None:
    assert debian._one_line_entries(ONE_LINE) == [
        {"types": "deb-src", "uris": "http://src.example.org/debian", "suites": "trixie", "components": "main"},
        {"types": "deb", "uris": "http://one.example.org/debian/", "suites": "bookworm", "components": "main contrib"},
    ]


def test_the_mirror_is_the_first_enabled_deb_source_of_the_suite(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    listfile, sources = tmp_path / "sources.list", tmp_path / "sources.list.d"
    sources.mkdir()
    listfile.write_text(ONE_LINE)
    (sources / "a.sources").write_text(DEB822.replace("deb.example.org", "first.example.org")
                                       .replace("Types: deb deb-src", "Types: deb-src"))
    (sources / "b.sources").write_text(DEB822)
    (sources / "c.disabled").write_text("deb http://ignored.example.org/debian trixie main\n")
    monkeypatch.setattr(debian, "APT_SOURCES_LIST", str(listfile))
    monkeypatch.setattr(debian, "APT_SOURCES_DIR", str(sources))
    monkeypatch.delenv(debian.DEBIAN_MIRROR_ENV, raising=False)
    assert debian.debian_mirror("trixie") == "http://deb.example.org/debian"
    assert debian.debian_mirror("trixie-updates") == "http://deb.example.org/debian"
    assert debian.debian_mirror("bookworm") == "http://one.example.org/debian"
    with pytest.raises(host.TestbedError, match="no 'deb' source for suite sid"):
        debian.debian_mirror("sid")
    monkeypatch.setenv(debian.DEBIAN_MIRROR_ENV, " http://override.example.org/d/ ")
    assert debian.debian_mirror("sid") == "http://override.example.org/d"


def test_the_host_suite_comes_from_os_release(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release = tmp_path / "os-release"
    release.write_text('NAME="Debian GNU/Linux"\nVERSION_CODENAME="trixie"\n')
    monkeypatch.setattr(debian, "OS_RELEASE", str(release))
    assert debian.host_suite() == "trixie"
    release.write_text("NAME=x\n")
    with pytest.raises(host.TestbedError, match="no VERSION_CODENAME"):
        debian.host_suite()


# --------------------------------------------------------------------------
# Image archives


def _members(archive: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        return {m.name: m for m in tar.getmembers()}


def _read(archive: bytes, name: str) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        f = tar.extractfile(name)
        assert f is not None
        return f.read()


def _check_layout(archive: bytes, name: str, layer_type: str, diff_ids: list[str], cmd: list[str]) -> None:
    members = _members(archive)
    assert json.loads(_read(archive, "oci-layout")) == {"imageLayoutVersion": "1.0.0"}
    for member in members.values():
        assert (member.uid, member.gid, member.mtime) == (0, 0, 0)
        assert member.mode == (0o644 if member.isfile() else 0o755)

    def blob(desc: dict[str, Any]) -> bytes:
        data = _read(archive, "blobs/sha256/" + desc["digest"].removeprefix("sha256:"))
        assert desc["digest"] == "sha256:" + hashlib.sha256(data).hexdigest() and desc["size"] == len(data)
        return data

    index = json.loads(_read(archive, "index.json"))
    assert index["schemaVersion"] == 2 and index["mediaType"] == "application/vnd.oci.image.index.v1+json"
    desc, = index["manifests"]
    assert desc["mediaType"] == "application/vnd.oci.image.manifest.v1+json" and desc["platform"] == PLATFORM
    assert desc["annotations"] == {"io.containerd.image.name": name,
                                   "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1]}
    manifest = json.loads(blob(desc))
    assert manifest["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    assert manifest["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json"
    image_config = json.loads(blob(manifest["config"]))
    assert (image_config["architecture"], image_config["os"], image_config["variant"]) == ("arm", "linux", "v7")
    assert image_config["config"]["Cmd"] == cmd and image_config["rootfs"]["diff_ids"] == diff_ids
    assert len(image_config["history"]) == len(diff_ids)
    assert [layer["mediaType"] for layer in manifest["layers"]] == [layer_type] * len(diff_ids)
    blobs = {"blobs/sha256/" + d["digest"].removeprefix("sha256:")
             for d in [desc, manifest["config"], *manifest["layers"]]}
    for layer in manifest["layers"]:
        blob(layer)
    assert {n for n, m in members.items() if m.isfile()} == {"oci-layout", "index.json"} | blobs


def test_an_archive_of_gzip_layers_is_a_consistent_image_layout() -> None:
    layers = [images.binary_layer({"pause": b"\x7fELF"}), images.binary_layer({"usr/local/bin/x": b"x"})]
    archive = oci.oci_archive("localhost/t/img:1", layers, ["/pause"], PLATFORM)
    diff_ids = ["sha256:" + hashlib.sha256(layer).hexdigest() for layer in layers]
    _check_layout(archive, "localhost/t/img:1", "application/vnd.oci.image.layer.v1.tar+gzip", diff_ids, ["/pause"])
    assert archive == oci.oci_archive("localhost/t/img:1", layers, ["/pause"], PLATFORM), "deterministic"


def test_an_archive_streamed_from_files_has_uncompressed_layers(tmp_path: Path) -> None:
    paths = []
    for i, data in enumerate((debian.debian_program_layer({"usr/local/bin/p": b"#!/bin/sh\n"}, {"etc/f": b"f"}),
                              images.binary_layer({"bin/y": b"y"}))):
        path = tmp_path / f"layer{i}.tar"
        path.write_bytes(data)
        paths.append(str(path))
    out = tmp_path / "image.tar"
    oci.oci_archive_file("localhost/t/deb:1", paths, ["/usr/local/bin/p"], PLATFORM, str(out))
    diff_ids = ["sha256:" + hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths]
    _check_layout(out.read_bytes(), "localhost/t/deb:1", "application/vnd.oci.image.layer.v1.tar", diff_ids,
                  ["/usr/local/bin/p"])
    assert not [n for n in os.listdir(tmp_path) if ".tmp." in n]


def test_layers_are_root_owned_and_dated_zero() -> None:
    layer = oci.Layer()
    layer.file("a/b/c", b"data", 0o600)
    layer.symlink("bin/sh", "/bin/busybox")
    layer.dir("tmp", 0o1777)
    with tarfile.open(fileobj=io.BytesIO(layer.finish())) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert list(members) == ["a", "a/b", "a/b/c", "bin", "bin/sh", "tmp"]
    assert all((m.uid, m.gid, m.uname, m.mtime) == (0, 0, "root", 0) for m in members.values())
    assert members["a/b/c"].mode == 0o600 and members["tmp"].mode == 0o1777
    assert members["bin/sh"].linkname == "/bin/busybox"


def test_only_an_elf_without_interpreter_is_static(tmp_path: Path) -> None:
    script = tmp_path / "s"
    script.write_bytes(b"#!/bin/sh\n")
    assert not oci.elf_is_static(str(script))
    # A minimal 64-bit little-endian ELF header with one PT_LOAD, then with a PT_INTERP.
    head = bytearray(64)
    head[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", head, 32, 64)
    struct.pack_into("<HH", head, 54, 56, 1)
    phdr = bytearray(56)
    struct.pack_into("<I", phdr, 0, 1)
    static = tmp_path / "static"
    static.write_bytes(bytes(head) + bytes(phdr))
    assert oci.elf_is_static(str(static))
    struct.pack_into("<I", phdr, 0, 3)
    dynamic = tmp_path / "dynamic"
    dynamic.write_bytes(bytes(head) + bytes(phdr))
    assert not oci.elf_is_static(str(dynamic))


def test_cached_tarballs_are_grouped_by_what_they_are_a_version_of() -> None:
    assert images._cache_family("busybox-0123abcd.tar") == "busybox"
    assert images._cache_family("debian-64m-0123abcd.tar") == "debian-64m"
    assert images._cache_family("debootstrap-trixie-amd64-0123.tar") == "debootstrap"
    assert images._cache_family("torchroot-bookworm-amd64-0123.tar") == "torchroot"
    assert images._cache_family("torch-0123abcd.tar") == "torch"


# --------------------------------------------------------------------------
# The model's weights


def test_the_npy_header_is_numpys_format_1_0() -> None:
    header = weights.npy_header((512, 1024))
    assert header[:8] == b"\x93NUMPY\x01\x00" and len(header) % 64 == 0
    (length,) = struct.unpack("<H", header[8:10])
    assert length == len(header) - 10 and header.endswith(b"\n")
    assert ast.literal_eval(header[10:].decode("latin-1").strip()) == {
        "descr": "<f4", "fortran_order": False, "shape": (512, 1024)}
    assert ast.literal_eval(weights.npy_header((5,))[10:].decode().strip())["shape"] == (5,)


def test_the_weights_are_deterministic_and_finite() -> None:
    size, chunks = weights.model_weights(1)
    data = b"".join(chunks)
    header = weights.npy_header((256, weights.MODEL_COLS))
    assert size == len(data) == len(header) + (1 << 20) and data.startswith(header)
    assert data == b"".join(weights.model_weights(1)[1])
    values = struct.unpack(f"<{(1 << 20) // 4}f", data[len(header):])
    assert all(2.0 ** -15 <= abs(v) < 2.0 for v in values)
    pages = {data[i:i + 4096] for i in range(len(header), len(data), 4096)}
    assert len(pages) == 256


def test_the_weights_layer_holds_the_weights_file(tmp_path: Path) -> None:
    out = tmp_path / "weights.tar"
    weights.weights_layer(1, str(out))
    with tarfile.open(out) as tar:
        assert tar.getnames() == ["opt", "opt/model", weights.MODEL_PATH]
        f = tar.extractfile(weights.MODEL_PATH)
        assert f is not None
        assert f.read() == b"".join(weights.model_weights(1)[1])


def test_the_torch_weights_are_their_own_and_whole_layers() -> None:
    assert debian.TORCH_MIB % 4 == 0  # 1024 rows of 1024 float32 per layer
    torch_data = b"".join(weights.model_weights(1, debian.TORCH_SEED)[1])
    assert torch_data != b"".join(weights.model_weights(1)[1])
    assert debian.TORCH_WEIGHTS.startswith("opt/") and debian.TORCH_WEIGHTS != weights.MODEL_PATH


def test_the_model_size_comes_from_the_flag_the_environment_or_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(weights.MODEL_MIB_ENV, raising=False)
    assert weights.model_mib(None) == weights.MODEL_MIB_DEFAULT
    assert weights.model_mib(3) == 3
    monkeypatch.setenv(weights.MODEL_MIB_ENV, "12")
    assert weights.model_mib(None) == 12
    monkeypatch.setenv(weights.MODEL_MIB_ENV, "x")
    with pytest.raises(host.TestbedError, match="not a whole number"):
        weights.model_mib(None)
    with pytest.raises(host.TestbedError, match="must be 1..65536 MiB, not 0"):
        weights.model_mib(0)


# --------------------------------------------------------------------------
# The command line


def test_the_script_runs_the_command_line_from_any_directory(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "COLUMNS": "100"}
    cp = subprocess.run([str(REPO / "scripts" / "testbed"), "--help"], cwd=tmp_path, capture_output=True, text=True,
                        timeout=60, env=env)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.startswith("usage: testbed [-h] [-v] {up,restart,down,env} ...")
    cp = subprocess.run([str(REPO / "scripts" / "testbed"), "env"], cwd=tmp_path, capture_output=True, text=True,
                        timeout=60, env=env)
    assert cp.returncode == 2 and "the following arguments are required: name" in cp.stderr
