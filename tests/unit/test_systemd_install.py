"""The systemd unit, `install-systemd --root DIR` and `install-handler`."""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from node_agent.cli import install_systemd as inst
from node_agent.errors import FailedPrecondition

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd" / "node-agent.service"
NODE_AGENT = str(Path(sys.executable).parent / "node-agent")
CRIU_BUNDLE = "/opt/node-agent/criu"
RUNC = "/usr/sbin/runc" if os.path.exists("/usr/sbin/runc") else "/usr/bin/runc"


def _verify(path: Path) -> None:
    cp = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=120, cwd=path.parent)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    # verify only warns about some mistakes; none may mention our unit.
    assert path.name not in cp.stderr, cp.stderr


def _unit(text: str) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str  # type: ignore[assignment,method-assign]
    cp.read_string(text)
    return cp


def test_shipped_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    unit = tmp_path / "node-agent.service"
    unit.write_text(inst.render_unit(UNIT.read_text(), NODE_AGENT, "/etc/node-agent/config.yaml"))
    _verify(unit)


def test_unit_declares_what_the_daemon_relies_on() -> None:
    u = _unit(UNIT.read_text())
    svc, unit = u["Service"], u["Unit"]
    assert svc["Type"] == "notify" and svc["NotifyAccess"] == "main"
    assert svc["Restart"] == "on-failure"
    assert svc["StateDirectory"] == "node-agent" and svc["StateDirectoryMode"] == "0700"
    assert svc["RuntimeDirectory"] == "node-agent"
    # The freeze watchdog and CRIU must outlive a dying agent.
    assert svc["KillMode"] == "process"
    assert "kubelet.service" in unit["Before"].split()
    assert "containerd.service" in unit["After"].split()
    assert svc["Environment"].startswith("PATH=/usr/local/sbin:")
    # No option that gives the agent a mount namespace of its own, or caps it:
    # CRIU, the freezer and the shm capture need the host's view with full privileges.
    # Nor a seccomp filter, which runc and CRIU would inherit (doctor --deployment FAILs on one).
    for opt in ("ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices", "ProtectKernelTunables",
                "ProtectControlGroups", "ProtectHostname", "ProtectClock", "PrivateUsers", "CapabilityBoundingSet",
                "NoNewPrivileges", "SystemCallFilter", "RestrictRealtime", "RestrictSUIDSGID", "LockPersonality",
                "MemoryDenyWriteExecute", "RestrictNamespaces", "RestrictAddressFamilies", "DynamicUser"):
        assert opt not in svc, opt
    assert svc["UMask"] == "0077" and svc["KeyringMode"] == "private" and svc["ManagedOOMPreference"] == "omit"


def test_install_systemd_lays_out_the_tree(tmp_path: Path) -> None:
    root = tmp_path / "root"
    cp = subprocess.run([NODE_AGENT, "install-systemd", "--root", str(root), "--config-version", "2", "--runc", RUNC, "--criu-bundle", CRIU_BUNDLE],
                        capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, cp.stderr
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if not str(p.relative_to(root)).startswith("opt/node-agent/criu/"))
    assert files == [
        "etc", "etc/containerd", "etc/containerd/config.toml", "etc/node-agent", "etc/node-agent/config.yaml",
        "etc/systemd", "etc/systemd/system", "etc/systemd/system/node-agent.service",
        "opt", "opt/node-agent", "opt/node-agent/criu",
        "usr", "usr/local", "usr/local/sbin", "usr/local/sbin/criu",
        "var", "var/lib", "var/lib/node-agent", "var/lib/node-agent/bin", "var/lib/node-agent/bin/node-agent-runc",
        "var/lib/node-agent/journal", "var/lib/node-agent/logs", "var/lib/node-agent/plans", "var/lib/node-agent/work",
    ]
    assert "restart containerd" in cp.stdout
    assert (root / "var/lib/node-agent").stat().st_mode & 0o777 == 0o700

    unit = root / "etc/systemd/system/node-agent.service"
    assert f"ExecStart={NODE_AGENT} serve --config /etc/node-agent/config.yaml\n" in unit.read_text()
    _verify(unit)

    # The handler's tables name the wrapper by its host path; the wrapper runs runc.
    doc = tomllib.loads((root / "etc/containerd/config.toml").read_text())
    assert doc["version"] == 2
    criu = doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["criu"]
    assert criu["options"]["BinaryName"] == "/var/lib/node-agent/bin/node-agent-runc"
    wrapper = root / "var/lib/node-agent/bin/node-agent-runc"
    text = wrapper.read_text()
    assert text.startswith(f"#!{Path(sys.executable).parent}/python") and repr(RUNC) in text and "'/var/lib/node-agent/plans'" in text
    out = subprocess.run([str(wrapper), "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "runc version" in out.stdout

    # CRIU >= 4.2 from the bundle, through its own loader.
    launcher = root / "usr/local/sbin/criu"
    assert "/opt/node-agent/criu/usr/sbin/criu" in launcher.read_text()
    assert (root / "opt/node-agent/criu/usr/sbin/criu").is_file()

    # The config is the real loader's.
    from node_agent.config.loading import load

    s = load(str(root / "etc/node-agent/config.yaml"))
    assert s.store == "/var/lib/node-agent" and s.health_listen

    # The unit's config, once there, is what a later run installs from.
    cfg = root / "etc/node-agent/config.yaml"
    cfg.write_text(cfg.read_text().replace("runtime-handler: criu", "runtime-handler: restore"))
    again = subprocess.run([NODE_AGENT, "install-systemd", "--root", str(root), "--runc", RUNC], capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    runtimes = tomllib.loads((root / "etc/containerd/config.toml").read_text())["plugins"]["io.containerd.grpc.v1.cri"]
    assert set(runtimes["containerd"]["runtimes"]) == {"restore"}
    cfg.write_text(cfg.read_text().replace("runtime-handler: restore", "runtime-handler: criu"))
    subprocess.run([NODE_AGENT, "install-systemd", "--root", str(root), "--runc", RUNC], check=True, capture_output=True,
                   timeout=120)

    # A second run changes nothing.
    again = subprocess.run([NODE_AGENT, "install-systemd", "--root", str(root), "--runc", RUNC], capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "installed" not in again.stdout and "restart containerd" not in again.stdout


DEBIAN_CONFIG = """\
version = 2

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
      SystemdCgroup = true
"""


def _install_over(tmp_path: Path, config_text: str) -> tuple[Path, Path]:
    """install-handler into a root whose containerd config is `config_text`: (root, config path)."""
    from node_agent.config.schema import Settings

    root = tmp_path / "r"
    cfg = root / "etc/containerd/config.toml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text(config_text)
    inst.install_handler(str(root), Settings(runc=RUNC), criu_bundle="none")
    return root, cfg


def test_handler_block_is_appended_once_and_follows_the_cgroup_driver(tmp_path: Path) -> None:
    from node_agent.config.schema import Settings

    root, cfg = _install_over(tmp_path, DEBIAN_CONFIG)
    first = cfg.read_text()
    assert first.startswith(DEBIAN_CONFIG) and first.count(inst.BEGIN) == 1
    runtimes = tomllib.loads(first)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    assert runtimes["criu"]["options"]["SystemdCgroup"] is True
    # Another handler name replaces the block rather than adding a second one.
    inst.install_handler(str(root), Settings(runc=RUNC, runtime_handler="restore"), criu_bundle="none")
    second = cfg.read_text()
    assert second.count(inst.BEGIN) == 1
    runtimes = tomllib.loads(second)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    assert set(runtimes) == {"runc", "restore"}


def test_handler_refuses_configs_it_cannot_merge(tmp_path: Path) -> None:
    with pytest.raises(FailedPrecondition, match="version = 1"):
        inst.merge_containerd_config('[plugins.cri]\nx = 1\n', "", 2)
    clash = DEBIAN_CONFIG + '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.criu]\n  runtime_type = "x"\n'
    from node_agent.cli.containerd_config import snippet
    from node_agent.config.schema import Settings

    with pytest.raises(FailedPrecondition, match="already defines"):
        inst.merge_containerd_config(clash, snippet(Settings(), 2), 2)
    with pytest.raises(FailedPrecondition, match="version = 2, the handler's tables are for version 3"):
        inst.merge_containerd_config(DEBIAN_CONFIG, snippet(Settings(), 3), 3)


def test_install_handler_with_a_runtime_bundle(tmp_path: Path) -> None:
    """The DaemonSet's init container: the wrapper runs on the bundle's Python, copied to the host."""
    bundle = tmp_path / "bundle"
    (bundle / "bin").mkdir(parents=True)
    (bundle / "bin/python3").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    (bundle / "bin/python3").chmod(0o755)
    root = tmp_path / "host"
    cp = subprocess.run([NODE_AGENT, "install-handler", "--root", str(root), "--config-version", "2", "--runc", RUNC,
                         "--runtime-bundle", str(bundle),
                         "--criu-bundle", CRIU_BUNDLE, "--store", "/var/lib/na"], capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, cp.stderr
    assert (root / "opt/node-agent/runtime/bin/python3").is_file()
    wrapper = (root / "var/lib/na/bin/node-agent-runc").read_text()
    assert wrapper.startswith("#!/opt/node-agent/runtime/bin/python3 -IS\n")
    assert not (root / "etc/systemd").exists()
    assert (root / "usr/local/sbin/criu").is_file()


def test_runtime_bundle_and_wrapper_python_must_agree(tmp_path: Path) -> None:
    from node_agent.config.schema import Settings
    from node_agent.errors import InvalidArgument

    bundle = tmp_path / "bundle"
    (bundle / "bin").mkdir(parents=True)
    (bundle / "bin/python3").write_text("#!/bin/sh\n")
    (bundle / "bin/python3").chmod(0o755)
    with pytest.raises(InvalidArgument, match="wrapper-python"):
        inst.install_handler(str(tmp_path / "r"), Settings(runc=RUNC, wrapper_python="/usr/bin/python3"),
                             runtime_bundle=str(bundle), criu_bundle="none", config_version=2)
    # Without a bundle, wrapper-python names the host's interpreter.
    inst.install_handler(str(tmp_path / "r"), Settings(runc=RUNC, wrapper_python="/usr/bin/python3"), criu_bundle="none",
                         config_version=2)
    assert (tmp_path / "r/var/lib/node-agent/bin/node-agent-runc").read_text().startswith("#!/usr/bin/python3 -IS\n")


CONTAINERD2_CONFIG = """\
version = 3

[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
    SystemdCgroup = true
"""


def test_install_handler_edits_a_version_3_config(tmp_path: Path) -> None:
    from node_agent.config.schema import Settings

    root, cfg = _install_over(tmp_path, CONTAINERD2_CONFIG)
    doc = tomllib.loads(cfg.read_text())
    assert doc["version"] == 3
    runtimes = doc["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]
    assert runtimes["criu"]["sandboxer"] == "podsandbox"
    assert runtimes["criu"]["options"]["SystemdCgroup"] is True  # follows the node's runc handler
    assert "io.containerd.grpc.v1.cri" not in doc["plugins"]  # no version-2 tables, which 2.x would ignore
    # A config that does not exist yet is written for the version asked for.
    fresh = tmp_path / "fresh"
    inst.install_handler(str(fresh), Settings(runc=RUNC), criu_bundle="none", config_version=3)
    assert tomllib.loads((fresh / "etc/containerd/config.toml").read_text())["version"] == 3
    with pytest.raises(FailedPrecondition, match="version = 3, not 2"):
        inst.install_handler(str(root), Settings(runc=RUNC), criu_bundle="none", config_version=2)


def test_containerd_config_reads_the_files_version_and_never_guesses(tmp_path: Path) -> None:
    v3 = tmp_path / "v3.toml"
    v3.write_text(CONTAINERD2_CONFIG)
    base = [NODE_AGENT, "containerd-config", "--no-install", "--store", str(tmp_path / "s")]
    cp = subprocess.run([*base, "--containerd-config", str(v3)], capture_output=True, text=True)
    assert cp.returncode == 0, cp.stderr
    runtime = tomllib.loads(cp.stdout)["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["criu"]
    assert runtime["sandboxer"] == "podsandbox" and runtime["options"]["SystemdCgroup"] is True
    for bad, needle in (("", "version = 1"), ("version = 7\n", "version = 7"), ("[x\n", "not valid TOML")):
        path = tmp_path / "bad.toml"
        path.write_text(bad)
        cp = subprocess.run([*base, "--containerd-config", str(path)], capture_output=True, text=True)
        assert cp.returncode != 0 and needle in cp.stderr, cp.stderr
    cp = subprocess.run([*base, "--containerd-config", str(tmp_path / "missing.toml")], capture_output=True, text=True)
    assert cp.returncode != 0 and "--config-version" in cp.stderr, cp.stderr
