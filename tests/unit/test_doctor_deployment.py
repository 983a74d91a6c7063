"""`doctor --deployment`: each check's verdict and its one-line fix, on files laid out here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from criu_bridge.mountinfo import Mount
from node_agent.cli import doctor
from node_agent.cli.checks import Check, criu_cache_check, mount_of, mounts
from node_agent.cli.containerd_config import snippet
from node_agent.config.schema import Settings

NODE_AGENT = str(Path(sys.executable).parent / "node-agent")
RUNC = "/usr/sbin/runc" if os.path.exists("/usr/sbin/runc") else "/usr/bin/runc"


def _by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def test_a_problem_is_one_line_with_its_fix() -> None:
    c = Check("x", "FAIL", "it is broken", "mend it")
    assert c.line() == "FAIL x: it is broken; fix: mend it"
    assert Check("x", "OK", "fine", "unused").line() == "OK   x: fine"


def test_mount_table_and_longest_prefix(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 0:21 / / rw - overlay overlay rw\n"
        "23 22 0:22 / /run/containerd rw,relatime shared:5 - tmpfs tmpfs rw\n"
        "24 22 0:23 / /var/lib/node\\040agent rw - ext4 /dev/vda1 rw\n"
        "25 22 0:24 / /dev rw - devtmpfs udev rw\n"
    )
    table = mounts(str(info))
    assert [m.point for m in table] == ["/", "/run/containerd", "/var/lib/node agent", "/dev"]
    m = mount_of("/run/containerd/containerd.sock", table)
    assert m is not None and m.point == "/run/containerd"
    m = mount_of("/run/containerdX", table)
    assert m is not None and m.point == "/"
    m = mount_of("/var/lib/node agent/bin", table)
    assert m is not None and m.fstype == "ext4"


def test_criu_cache_needs_run_on_a_tmpfs(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text("22 1 0:21 / / rw - ext4 /dev/vda rw\n")
    check = criu_cache_check(mounts(str(info)))
    assert check.verdict == "WARN" and "/run is ext4" in check.detail and "criu.kdat" in check.detail
    info.write_text("22 1 0:21 / / rw - ext4 /dev/vda rw\n23 22 0:22 / /run rw - tmpfs tmpfs rw\n")
    assert criu_cache_check(mounts(str(info))).verdict == "OK"
    # This machine's answer matches its own mount table.
    here = mount_of("/run", mounts())
    assert criu_cache_check(mounts()).verdict == ("OK" if here and here.fstype == "tmpfs" else "WARN")


def _pci(sysfs: Path, bdf: str, vendor: str, klass: str) -> None:
    d = sysfs / "bus/pci/devices" / bdf
    d.mkdir(parents=True)
    (d / "vendor").write_text(vendor + "\n")
    (d / "class").write_text(klass + "\n")


def test_nvml_is_required_only_where_nvidia_gpus_are(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    _pci(sysfs, "0000:00:02.0", "0x8086", "0x030000")  # an Intel GPU
    _pci(sysfs, "0000:3b:00.1", "0x10de", "0x040300")  # an NVIDIA audio function
    c = doctor._nvml_check(str(sysfs), init=lambda: "libnvidia-ml.so.1 does not load")
    assert c.verdict == "OK" and "no NVIDIA GPU" in c.detail
    _pci(sysfs, "0000:3b:00.0", "0x10de", "0x030200")  # a 3D controller
    assert doctor.nvidia_gpus(str(sysfs)) == ["0000:3b:00.0"]
    c = doctor._nvml_check(str(sysfs), init=lambda: "libnvidia-ml.so.1 does not load")
    assert c.verdict == "FAIL" and "0000:3b:00.0" in c.detail and "driver" in c.fix
    assert doctor._nvml_check(str(sysfs), init=lambda: None).verdict == "OK"


def test_credentials_missing_is_a_warning(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    c = doctor._credentials_check()
    assert c.verdict == "WARN" and "device taints" in c.detail and c.fix
    (tmp_path / "kubeconfig").write_text("apiVersion: v1\nkind: Config\n")
    monkeypatch.setenv("KUBECONFIG", f"{tmp_path / 'none'}:{tmp_path / 'kubeconfig'}")
    c = doctor._credentials_check()
    assert c.verdict == "OK" and "kubeconfig" in c.detail
    assert doctor._credentials_check(str(tmp_path / "kubeconfig")).verdict == "OK"
    c = doctor._credentials_check(str(tmp_path / "gone"))
    assert c.verdict == "WARN" and "devices.kubeconfig" in c.detail and c.fix
    assert doctor._credentials_check(needed=False).verdict == "OK"


def _host(tmp_path: Path, s: Settings, config: str | None) -> Path:
    root = tmp_path / "host"
    cfg = root / "etc/containerd/config.toml"
    cfg.parent.mkdir(parents=True)
    if config is not None:
        cfg.write_text(config)
    return root


def test_handler_missing_from_containerds_config(tmp_path: Path) -> None:
    s = Settings()
    root = _host(tmp_path, s, "version = 2\n")
    (c,) = doctor._handler_checks(s, "/etc/containerd/config.toml", str(root))
    assert c.verdict == "FAIL" and "'criu' is not in" in c.detail and "install-handler" in c.fix
    (c,) = doctor._handler_checks(s, "/etc/containerd/none.toml", str(root))
    assert c.verdict == "FAIL" and "no containerd config" in c.detail


def test_handler_present_with_wrapper_runnable_on_the_host(tmp_path: Path) -> None:
    from node_agent.cli import install_systemd as inst

    s = Settings(runc=RUNC)
    root = _host(tmp_path, s, "version = 2\n")
    inst.install_handler(str(root), s, criu_bundle="none")
    checks = _by_name(doctor._handler_checks(s, "/etc/containerd/config.toml", str(root)))
    assert checks["handler"].verdict == "OK"
    # The wrapper's interpreter is this venv's Python, which lies outside the stand-in root.
    assert checks["wrapper"].verdict == "FAIL" and "which the host lacks" in checks["wrapper"].detail
    assert "--runtime-bundle" in checks["wrapper"].fix
    checks = _by_name(doctor._handler_checks(s, str(root / "etc/containerd/config.toml"), "/"))
    assert checks["wrapper"].verdict == "FAIL" and "missing" in checks["wrapper"].detail  # /var/lib/node-agent/bin


def test_handler_root_must_match_runc_root(tmp_path: Path) -> None:
    s = Settings(runc=RUNC, store=str(tmp_path / "store"))
    text = "version = 2\n" + snippet(Settings(store=str(tmp_path / "store"), runc_root="/run/other/runc/k8s.io"), 2)
    cfg = tmp_path / "config.toml"
    cfg.write_text(text)
    from node_agent.daemon import install_wrapper, prepare_dirs

    prepare_dirs(s)
    install_wrapper(s)
    checks = _by_name(doctor._handler_checks(s, str(cfg), "/"))
    assert checks["handler"].verdict == "FAIL" and "/run/other/runc" in checks["handler"].detail
    assert checks["wrapper"].verdict == "OK", checks["wrapper"]


def test_privilege_checks_here() -> None:
    names = _by_name(doctor._privilege_checks())
    assert names["capabilities"].verdict == ("OK" if os.geteuid() == 0 else "FAIL")
    assert names["seccomp"].verdict in ("OK", "FAIL")


def test_lazy_restore_line_names_the_fallback() -> None:
    c = doctor._lazy_check(Settings())
    assert (c.verdict, c.detail.split(" (")[0]) in {("OK", "available"), ("WARN", "unavailable")}
    if c.verdict == "WARN":
        assert "falls back to full restore" in c.detail
    c = doctor._lazy_check(Settings(criu="/nonexistent/criu"))
    assert c.verdict == "WARN" and c.detail.startswith("unavailable (falls back to full restore)")


def test_criu_feature_report_is_folded_into_the_one_lazy_verdict(tmp_path: Path) -> None:
    """A report of no lazy pages makes the verdict no, even where `criu check` passes."""
    criu = tmp_path / "criu"
    criu.write_text("#!/bin/sh\nexit 0\n")
    criu.chmod(0o755)
    s = Settings(criu=str(criu))
    assert doctor._lazy_check(s, {"lazy_pages": True}).verdict == "OK"
    assert doctor._lazy_check(s).verdict == "OK"
    c = doctor._lazy_check(s, {"lazy_pages": False})
    assert c.verdict == "WARN" and "feature report" in c.detail and c.fix.startswith("a kernel with userfaultfd")


def test_doctor_deployment_command_fails_on_a_bare_machine(tmp_path: Path) -> None:
    """No containerd, no handler: exit 1, and every FAIL carries a fix."""
    cp = subprocess.run([NODE_AGENT, "doctor", "--deployment", "--store", str(tmp_path / "s"), "--cri-endpoint",
                         f"unix://{tmp_path}/none.sock", "--containerd-config", str(tmp_path / "none.toml")],
                        capture_output=True, text=True, timeout=180)
    assert cp.returncode == 1, cp.stdout + cp.stderr
    lines = cp.stdout.splitlines()
    fails = [line for line in lines if line.startswith("FAIL")]
    assert any(line.startswith("FAIL cri:") for line in fails)
    assert any(line.startswith("FAIL handler:") for line in fails)
    for line in fails:
        assert "; fix: " in line or line.startswith("FAIL cri:"), line
    lazy = [line for line in lines if "lazy" in line.split(":")[0]]  # one verdict, CRIU's report folded in
    assert len(lazy) == 1 and lazy[0].startswith(("OK   lazy restore:", "WARN lazy restore:")), cp.stdout
    assert any(line.startswith(("OK   api credentials:", "WARN api credentials:")) for line in lines)
    assert any(line.startswith(("OK   nvml gpus:", "FAIL nvml gpus:")) for line in lines)


def test_in_a_container_the_store_must_come_from_the_host(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    s = Settings(store=str(store), cri_endpoint=f"unix://{tmp_path}/none.sock")
    image_only = [Mount("/", "overlay", "overlay"), Mount("/sys/fs/cgroup", "cgroup2", "cgroup2"),
                  Mount("/dev", "tmpfs", "tmpfs")]
    checks = _by_name(doctor._mount_checks(s, image_only, contained=True))
    assert checks["mount store"].verdict == "FAIL" and "container's own filesystem" in checks["mount store"].detail
    assert checks["mount store"].fix == f"mount the host's {store} at {store} (hostPath) in the agent's container"
    assert checks["mount cri socket"].verdict == "FAIL"
    assert checks["mount /dev"].verdict == "WARN"
    assert checks["mount /sys"].verdict == "OK"
    mounted = image_only + [Mount(str(store), "ext4", "/dev/vda1"), Mount("/dev", "devtmpfs", "udev")]
    checks = _by_name(doctor._mount_checks(s, mounted, contained=True))
    assert checks["mount store"].verdict == "OK" and checks["mount /dev"].verdict == "OK"
    # On the host itself, the same store is simply there.
    assert _by_name(doctor._mount_checks(s, image_only, contained=False))["mount store"].verdict == "OK"


def test_a_version_3_handler_is_read_and_its_sandboxer_checked(tmp_path: Path) -> None:
    from node_agent.cli import install_systemd as inst

    s = Settings(runc=RUNC)
    root = _host(tmp_path, s, "version = 3\n")
    inst.install_handler(str(root), s, criu_bundle="none")
    cfg = root / "etc/containerd/config.toml"
    checks = _by_name(doctor._handler_checks(s, "/etc/containerd/config.toml", str(root)))
    assert checks["handler"].verdict == "OK" and "handler sandboxer" not in checks
    cfg.write_text(cfg.read_text().replace('sandboxer = "podsandbox"', 'sandboxer = "shim"'))
    checks = _by_name(doctor._handler_checks(s, "/etc/containerd/config.toml", str(root)))
    assert checks["handler sandboxer"].verdict == "FAIL" and "'shim'" in checks["handler sandboxer"].detail


def test_version_2_tables_in_a_version_3_file_are_named_as_ignored(tmp_path: Path) -> None:
    s = Settings(runc=RUNC)
    root = _host(tmp_path, s, "version = 3\n\n" + snippet(s, 2))
    c = _by_name(doctor._handler_checks(s, "/etc/containerd/config.toml", str(root)))["handler"]
    assert c.verdict == "FAIL" and "written for version 2" in c.detail and "--containerd-config" in c.fix
