"""The README's install on a live node: `install-handler` edits that containerd's own config (version 3
on containerd 2.x, version 2 on 1.7), containerd restarts on it, and a pod that ran before the install
checkpoints and restores through the handler it installed."""

from __future__ import annotations

import json
import os
import subprocess
import tomllib
from pathlib import Path

import pytest

from node_agent import containerd
from testbed.bed import (
    CONTAINERD2, CONTAINERD17, NODE_AGENT, Bed, bring_up, container_detail, counter_pod, remove_pod, ticks,
    wait_for,
)
from testbed.bed import testbed as scripts_testbed
from tests.e2e.conftest import BED_NAME


def _doctor_line(bed: Bed, check: str) -> str:
    cp = bed.cli("doctor", "--config", bed.config, check=False)
    [line] = [ln for ln in cp.stdout.splitlines() if ln.split(None, 1)[1:] and ln.split(None, 1)[1].startswith(check)]
    return line


@pytest.mark.parametrize("binary", [CONTAINERD2, CONTAINERD17], ids=["containerd-2.1", "containerd-1.7"])
def test_install_handler_then_restart_containerd_then_round_trip(binary: str, tmp_path: Path) -> None:
    assert os.access(binary, os.X_OK), f"{binary} missing: run scripts/install-host"
    name = BED_NAME + "-inst"
    bed = bring_up(name, tmp_path, containerd=binary, images="busybox,memhog", with_handler=False)
    version = bed.info["config_version"]
    assert version == (3 if bed.info["containerd_version"].startswith("2.") else 2), bed.info
    node_config = Path(bed.info["containerd_config"])
    before = node_config.read_text()
    src = None
    new_pod = ""
    try:
        assert "criu" not in bed.info["handlers"]
        # A pod runs before node-agent is installed (under runc, the only handler).
        src = counter_pod(bed, "e2e-inst-src", flip=False)
        shell_log = os.path.join(src.log_dir, "shell", "0.log")
        wait_for(lambda: len(ticks(shell_log)) >= 3, what="source ticks")

        # The install, as the README's DaemonSet init container and install-systemd run it.
        cmd = [NODE_AGENT, "install-handler", "--config", bed.config, "--containerd-config", str(node_config),
               "--criu-bundle", "none"]
        cp = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert cp.returncode == 0, cp.stderr
        assert f"installed {node_config}" in cp.stdout and "restart containerd" in cp.stdout, cp.stdout
        text = node_config.read_text()
        assert text.startswith(before.rstrip("\n")), "the node's own settings are kept as they were"
        doc = tomllib.loads(text)
        assert containerd.version_of(doc) == version
        handler = containerd.runtimes(doc, version)["criu"]
        assert handler["options"]["BinaryName"] == os.path.join(bed.store, "bin", "node-agent-runc")
        if version == 3:
            assert handler["sandboxer"] == "podsandbox"
        # Nothing in the other version's layout, which this containerd would ignore.
        assert not containerd.runtimes(doc, 5 - version)
        again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert again.returncode == 0 and f"unchanged {node_config}" in again.stdout, again.stdout + again.stderr

        # Until containerd restarts, the agent sees that the handler is not loaded and says what to do.
        bed.start_agent()
        line = _doctor_line(bed, "restore handler")
        assert line.startswith("FAIL") and "containerd has no runtime handler 'criu'" in line, line
        assert "restart containerd" in line, line
        bed.stop_agent()

        old_pid = bed.info["containerd_pid"]
        bed.info = json.loads(scripts_testbed("restart", name))
        assert bed.info["containerd_pid"] != old_pid and "criu" in bed.info["handlers"]
        # The pod kept running across the restart.
        seen = max(ticks(shell_log))
        wait_for(lambda: max(ticks(shell_log)) > seen + 2, what="ticks after the restart")

        bed.start_agent()
        line = _doctor_line(bed, "restore handler")
        assert line.startswith("OK"), line
        ckpt = bed.cli("checkpoint", src.id).stdout.strip().splitlines()[-1]
        at_checkpoint = max(ticks(shell_log))
        out = bed.cli("restore", ckpt, "--namespace", "e2e-inst-dst", "--start").stdout.split()
        new_pod = out[0]
        ids = dict(zip(out[1::2], out[2::2]))
        d = container_detail(bed, ids["shell"])
        assert d.container.state == "CONTAINER_RUNNING"
        first = wait_for(lambda: ticks(d.log_path), what="restored ticks")[0]
        assert 3 < first <= at_checkpoint + 1, f"the counter restarted or jumped: first tick {first}, {at_checkpoint}"
        bed.cli("checkpoints", "rm", ckpt)
    finally:
        if new_pod:
            remove_pod(bed, new_pod)
        if src is not None:
            remove_pod(bed, src.id)
        bed.stop_agent()
        if os.environ.get("NODE_AGENT_E2E_KEEP") != "1":
            scripts_testbed("down", name)
