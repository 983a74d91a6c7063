"""The container image: built here, and `doctor --deployment` inside it passes
against a test bed's containerd, mounted as the DaemonSet mounts a node.

The bed is this file's own (`na-ship`), so it runs beside the other tests' beds.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from testbed import bed as beds
from testbed.bed import REPO, Bed, bring_up

BED = os.environ.get("NODE_AGENT_SHIP_BED", "na-ship")
IMAGE = "localhost/node-agent:e2e"
RUNC = "/usr/sbin/runc" if os.path.exists("/usr/sbin/runc") else "/usr/bin/runc"
# Without CAP_SYS_RESOURCE on this machine, podman cannot raise these limits.
LIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]


@pytest.fixture(scope="module")
def image() -> str:
    assert os.geteuid() == 0, "building the image needs root"
    cp = subprocess.run(["bash", str(REPO / "scripts" / "build-image"), "--tag", IMAGE], capture_output=True, text=True,
                        timeout=1800, cwd=REPO)
    assert cp.returncode == 0, cp.stderr[-4000:]
    assert cp.stdout.strip().splitlines()[-1] == IMAGE
    return IMAGE


@pytest.fixture(scope="module")
def ship_bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    b = bring_up(BED, tmp_path_factory.mktemp("ship"))
    try:
        yield b
    finally:
        if os.environ.get("NODE_AGENT_E2E_KEEP") != "1":
            beds.testbed("down", BED)


def _run(image: str, *args: str, mounts: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    vols = [a for m in mounts for a in ("-v", m)]
    return subprocess.run(["podman", "run", "--rm", "--privileged", "--network=none", *LIMITS, *vols, image, *args],
                          capture_output=True, text=True, timeout=timeout)


def test_image_has_criu_runc_and_the_agent(image: str) -> None:
    cp = subprocess.run(["podman", "run", "--rm", "--network=none", *LIMITS, "--entrypoint", "sh", image, "-c",
                         "criu --version && runc --version && node-agent --help >/dev/null && "
                         "/opt/node-agent/runtime/bin/python3 -I -c 'import criu_bridge.wrapper'"],
                        capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, cp.stderr
    version = next(line for line in cp.stdout.splitlines() if line.startswith("Version:"))
    major, minor = (int(x) for x in version.split()[1].split(".")[:2])
    assert (major, minor) >= (4, 2), version
    assert "runc version" in cp.stdout


def test_doctor_deployment_in_the_image_reports_no_fail(image: str, ship_bed: Bed) -> None:
    state = f"/run/node-agent-testbed/{BED}"
    workdir = os.path.dirname(ship_bed.config)  # the agent's config and store
    cp = subprocess.run(
        ["podman", "run", "--rm", "--privileged", "--pid=host", "--network=none", *LIMITS,
         # As in the DaemonSet: the host's / read-only at /host, and each path the agent uses at its own place.
         "-v", "/:/host:ro,rslave", "-v", f"{state}:{state}:rslave", "-v", f"{workdir}:{workdir}",
         "-v", "/sys:/sys:rslave", "-v", "/dev:/dev",
         image, "doctor", "--deployment", "--config", ship_bed.config, "--host-root", "/host",
         "--containerd-config", ship_bed.info["containerd_config"]],
        capture_output=True, text=True, timeout=300)
    lines = cp.stdout.splitlines()
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert lines and not [line for line in lines if line.startswith("FAIL")], cp.stdout
    for name in ("environment", "cri", "criu", "mount cri socket", "mount store", "host pids", "capabilities",
                 "handler", "wrapper", "handler loaded"):
        assert any(line.startswith(f"OK   {name}:") for line in lines), (name, cp.stdout)
    assert "OK   environment: a container" in lines
    assert any(line.startswith(("OK   lazy restore: available", "WARN lazy restore: unavailable (falls back to full restore)"))
               for line in lines), cp.stdout


def test_doctor_deployment_names_each_missing_piece(image: str, ship_bed: Bed, tmp_path: Path) -> None:
    """Nothing mounted, no host PIDs: each problem is one FAIL line with its fix."""
    cp = _run(image, "doctor", "--deployment", "--cri-endpoint", f"unix://{ship_bed.info['containerd_socket']}",
              "--containerd-config", "/etc/none.toml", mounts=[])
    assert cp.returncode == 1, cp.stdout + cp.stderr
    fails = {line.split(":")[0].split(None, 1)[1]: line for line in cp.stdout.splitlines() if line.startswith("FAIL")}
    assert {"cri", "mount cri socket", "mount store", "host pids", "handler"} <= set(fails), cp.stdout
    for name in ("mount cri socket", "mount store", "host pids", "handler"):
        assert "; fix: " in fails[name], fails[name]


def test_init_container_install_gives_the_host_a_runnable_wrapper(image: str, tmp_path: Path) -> None:
    """What the DaemonSet's init container does, onto a stand-in host root; the
    wrapper's Python then runs on this host, outside the image."""
    host = tmp_path / "host"
    (host / "etc/containerd").mkdir(parents=True)
    (host / "etc/containerd/config.toml").write_text("version = 2\n")
    cp = _run(image, "install-handler", "--root", "/host", "--runc", RUNC, "--runtime-bundle", "/opt/node-agent/runtime",
              "--criu-bundle", "/opt/node-agent/criu", mounts=[f"{host}:/host"])
    assert cp.returncode == 0, cp.stdout + cp.stderr
    wrapper = host / "var/lib/node-agent/bin/node-agent-runc"
    assert wrapper.read_text().startswith("#!/opt/node-agent/runtime/bin/python3 -IS\n")
    python = host / "opt/node-agent/runtime/bin/python3"
    out = subprocess.run([str(python), "-I", str(wrapper), "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "runc version" in out.stdout, out.stderr
    criu = subprocess.run(["sh", "-c", f"sed 's#/opt/node-agent#{host}/opt/node-agent#g' {host}/usr/local/sbin/criu | sh -s -- --version"],
                          capture_output=True, text=True, timeout=60)
    assert criu.returncode == 0 and "Version: 4." in criu.stdout, criu.stderr
    assert "restart containerd" in cp.stdout


def test_a_pod_restores_through_the_image_host_runtime(image: str, ship_bed: Bed, tmp_path: Path) -> None:
    """The DaemonSet's restore path on the host: the wrapper runs on the image's
    relocatable Python (here copied out of the image), not on the agent's."""
    from testbed.bed import NODE_AGENT, container_detail, counter_pod, remove_pod, ticks, wait_for

    out = tmp_path / "out"
    out.mkdir()
    cp = subprocess.run(["podman", "run", "--rm", "--network=none", *LIMITS, "-v", f"{out}:/out", "--entrypoint", "cp",
                         image, "-a", "/opt/node-agent/runtime", "/out/"], capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, cp.stderr
    python = out / "runtime" / "bin" / "python3"
    config = Path(ship_bed.config)
    config.write_text(config.read_text() + f"wrapper-python: {python}\n")
    cp = subprocess.run([NODE_AGENT, "containerd-config", "--config", str(config)], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stderr
    wrapper = Path(ship_bed.store) / "bin" / "node-agent-runc"
    assert wrapper.read_text().startswith(f"#!{python} -IS\n")
    ship_bed.start_agent()
    try:
        src = counter_pod(ship_bed, "e2e-ship", mib=8)
        try:
            server = container_detail(ship_bed, src.containers["server"])
            wait_for(lambda: len(ticks(server.log_path)) >= 5, what="ticks")
            ckpt = ship_bed.cli("checkpoint", src.id).stdout.strip().splitlines()[-1]
            res = ship_bed.cli("restore", ckpt, "--namespace", "e2e-ship-restored", "--start").stdout.split()
            new_pod, names = res[0], dict(zip(res[1::2], res[2::2]))
            try:
                restored = container_detail(ship_bed, names["server"])
                assert restored.container.state == "CONTAINER_RUNNING"
                wait_for(lambda: len(ticks(restored.log_path)) >= 3, what="restored ticks")
                assert ticks(restored.log_path)[0] > 5  # it went on, it did not start over
                # The wrapper was not rewritten by the agent.
                assert wrapper.read_text().startswith(f"#!{python} -IS\n")
            finally:
                remove_pod(ship_bed, new_pod)
        finally:
            remove_pod(ship_bed, src.id)
    finally:
        ship_bed.stop_agent()
