"""The Vagrantfile: Ruby accepts it, `vagrant validate` (with vagrant-libvirt) passes with and
without GPU passthrough, and every variable it reads is documented."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VAGRANTFILE = REPO / "Vagrantfile"


def _validate(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    # A copy, so that vagrant's .vagrant/ state lands in tmp_path, not in the tree.
    work = tmp_path / "v"
    work.mkdir(exist_ok=True)
    shutil.copy(VAGRANTFILE, work / "Vagrantfile")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("NODE_AGENT_")}
    return subprocess.run(["vagrant", "validate"], cwd=work, capture_output=True, text=True, timeout=300,
                          env={**clean, "VAGRANT_CHECKPOINT_DISABLE": "1", "VAGRANT_DEFAULT_PROVIDER": "libvirt", **env})


def test_ruby_accepts_the_vagrantfile() -> None:
    cp = subprocess.run(["ruby", "-c", str(VAGRANTFILE)], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0 and "Syntax OK" in cp.stdout, cp.stderr


def test_vagrant_libvirt_is_installed() -> None:
    cp = subprocess.run(["vagrant", "plugin", "list"], capture_output=True, text=True, timeout=120,
                        env={**os.environ, "VAGRANT_CHECKPOINT_DISABLE": "1"})
    assert cp.returncode == 0 and "vagrant-libvirt" in cp.stdout, cp.stdout + cp.stderr


def test_vagrant_validate_passes(tmp_path: Path) -> None:
    cp = _validate(tmp_path)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "validated successfully" in cp.stdout


def test_vagrant_validate_with_gpu_passthrough(tmp_path: Path) -> None:
    cp = _validate(tmp_path, NODE_AGENT_GPU_NODE1="0000:3b:00.0,0000:3b:00.1", NODE_AGENT_GPU_NODE2="86:00.0",
                   NODE_AGENT_VM_NVIDIA_DRIVER="1", NODE_AGENT_VM_CPUS="8", NODE_AGENT_VM_MEMORY="16384")
    assert cp.returncode == 0, cp.stdout + cp.stderr


def test_a_bad_pci_address_names_the_variable(tmp_path: Path) -> None:
    cp = _validate(tmp_path, NODE_AGENT_GPU_NODE2="3b:00")
    assert cp.returncode != 0
    assert "NODE_AGENT_GPU_NODE2" in cp.stderr and '"3b:00"' in cp.stderr


def test_every_variable_is_documented() -> None:
    used = set(re.findall(r"NODE_AGENT_[A-Z0-9_]+", VAGRANTFILE.read_text()))
    used |= set(re.findall(r"NODE_AGENT_[A-Z0-9_]+", (REPO / "scripts" / "cross-node-scenario").read_text()))
    used.discard("NODE_AGENT_GPU_NODE")  # the prefix the Vagrantfile completes with 1 and 2
    used |= {"NODE_AGENT_GPU_NODE1", "NODE_AGENT_GPU_NODE2"}
    doc = (REPO / "docs" / "install.md").read_text()
    missing = sorted(v for v in used if f"`{v}`" not in doc)
    assert not missing, missing
    assert "vagrant up" in doc


def test_scenario_scripts_parse() -> None:
    cp = subprocess.run(["bash", "-n", str(REPO / "scripts" / "cross-node-scenario")], capture_output=True, text=True)
    assert cp.returncode == 0, cp.stderr
    source = (REPO / "scripts" / "vagrant-node").read_text()
    compile(source, "vagrant-node", "exec")
    assert os.access(REPO / "scripts" / "vagrant-node", os.X_OK)
    assert os.access(REPO / "scripts" / "cross-node-scenario", os.X_OK)
