"""The runc that checkpoints need not be the runc that restores. As a DaemonSet, the agent checkpoints
with its image's runc (Debian's, 1.1) while the host's restore handler restores with the host's
(containerd 2.x: runc 1.3, which also created the container)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from testbed.bed import bring_up, container_detail, counter_pod, remove_pod, ticks, wait_for
from testbed.bed import testbed as scripts_testbed
from tests.e2e.conftest import BED_NAME

IMAGE_RUNC = "/usr/sbin/runc"  # what deploy/image installs: Debian's runc


def _version(runc: str) -> str:
    out = subprocess.run([runc, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    return out.split()[2]


def test_checkpoint_with_the_images_runc_restore_with_the_hosts(tmp_path: Path) -> None:
    name = BED_NAME + "-runc"
    bed = bring_up(name, tmp_path, images="busybox,memhog")
    src = None
    new_pod = ""
    try:
        host_runc = bed.info["runc_binary"]
        assert _version(host_runc).startswith("1.3") and _version(IMAGE_RUNC).startswith("1.1"), \
            (_version(host_runc), _version(IMAGE_RUNC))
        # The handler's wrapper runs the host's runc, as install-handler writes it; the agent then
        # checkpoints with the other runc and leaves the wrapper alone (wrapper-python is set).
        bed.start_agent()
        bed.stop_agent()
        wrapper = Path(bed.store, "bin", "node-agent-runc").read_text()
        assert repr(host_runc) in wrapper, wrapper
        config = Path(bed.config)
        config.write_text(re.sub(r"^runc: .*$", f"runc: {IMAGE_RUNC}", config.read_text(), flags=re.M)
                          + f"wrapper-python: {sys.executable}\n")
        bed.start_agent()
        assert Path(bed.store, "bin", "node-agent-runc").read_text() == wrapper

        src = counter_pod(bed, "e2e-runc-src", flip=False)
        shell_log = os.path.join(src.log_dir, "shell", "0.log")
        wait_for(lambda: len(ticks(shell_log)) >= 3, what="source ticks")
        ckpt = bed.cli("checkpoint", src.id).stdout.strip().splitlines()[-1]
        at_checkpoint = max(ticks(shell_log))
        out = bed.cli("restore", ckpt, "--namespace", "e2e-runc-dst", "--start").stdout.split()
        new_pod = out[0]
        ids = dict(zip(out[1::2], out[2::2]))
        for cname in ("shell", "server"):
            assert container_detail(bed, ids[cname]).container.state == "CONTAINER_RUNNING", cname
        d = container_detail(bed, ids["shell"])
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
