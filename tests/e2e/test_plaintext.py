"""Plaintext lives only as long as docs/security.md says, on every path a restore can take.

The agent seals a namespace's checkpoints; a Python server holds a secret that exists only in its
memory. Restore plans hold that memory in the clear while they are needed. After each path the
secret is searched for in the whole store (blobs, plans, Pod restores' state, scratch), and found
nowhere:
- restored and started (lazily, the default): the plan's data goes when the pages are in;
- restored in full, never started, and its pod removed through containerd itself (not through the
  agent): its plan holds none of the memory (the page source writes what CRIU places itself when the
  container starts, and brings the rest in), and the periodic sweep removes the plan;
- a restore that fails at start (a forged checkpoint, refused by the image check): nothing stays;
- restore through a Pod whose container the kubelet does not create yet: nothing is kept in the
  clear between the kubelet's calls; its CreateContainer then reads the checkpoint and restores the
  same process, and RemovePodSandbox takes plan and state along.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from node_agent.api.pod_restores import RESTORE_FROM
from testbed.bed import Bed, make_pod, pod_detail, pods_in, reconfigured, remove_pod, wait_for
from tests.e2e.test_cri_endpoint import pod_via_agent, via_agent
from tests.e2e.test_encryption import SECRET, SERVER, _ask, _grep, _ring
from tests.e2e.test_forged_images import _edit_config, _exported, _imported
from tests.e2e.test_native_import import CONTAINER, namespaced

NS, DST = "e2e-pt", "e2e-pt-dst"


def _found(bed: Bed, under: str = "") -> list[str]:
    return _grep(Path(bed.store) / under if under else Path(bed.store), SECRET.encode())


def _restore(bed: Bed, ckpt: str, *args: str) -> dict[str, Any]:
    return dict(json.loads(bed.cli("restore", ckpt, "--namespace", DST, "-o", "json", *args).stdout))


@pytest.mark.also17
def test_plaintext_is_gone_after_every_path(agent: Bed, tmp_path: Path) -> None:
    ring = tmp_path / "keyring.json"
    _ring(ring, [("secteam-1", 1)])
    sealed = (f"encryption:\n  key-sources:\n    - file: {ring}\n  domains:\n    secteam: [{NS}, {DST}]\n"
              "retention:\n  plan-sweep-interval: 1\n")
    image = agent.info["images"]["debian"]
    app = namespaced("app", image, ["python3", "-c", SERVER], CONTAINER)
    with reconfigured(agent, sealed):
        src = make_pod(agent, NS, [app])
        made: list[str] = []
        pod = None
        try:
            before = wait_for(lambda: _ask(pod_detail(agent, src.id).ip), timeout=60, what="the server to answer")
            ckpt = agent.cli("checkpoint", src.id).stdout.split()[-1]
            assert _found(agent) == [], "a sealed checkpoint left plaintext in the store"

            # Restored and started, lazily: the plan's pages go once they are in.
            res = _restore(agent, ckpt, "--start")
            made.append(res["pod_sandbox_id"])
            got = wait_for(lambda: _ask(pod_detail(agent, res["pod_sandbox_id"]).ip), timeout=60, what="restored")
            assert (got["started"], got["memory"]) == (before["started"], before["memory"])
            wait_for(lambda: _found(agent) == [], timeout=60, what="the plan's plaintext to go")
            remove_pod(agent, res["pod_sandbox_id"])

            # Restored in full, never started: the memory waits sealed in the store (at the start the page
            # source writes what CRIU places itself, then brings the rest in before the processes run), so
            # the plan holds none of it. Its pod removed through containerd itself: the sweep removes the plan.
            res = _restore(agent, ckpt, "--full")
            made.append(res["pod_sandbox_id"])
            plan = Path(agent.store) / "plans" / res["containers"][0]["container_id"]
            assert (plan / "plan.json").is_file() and _found(agent, "plans") == []
            assert not list((plan / "images").glob("pages-*.img")), "the plan holds memory before its start"
            remove_pod(agent, res["pod_sandbox_id"])
            wait_for(lambda: not plan.exists(), timeout=30, what="the sweep to remove the plan")
            assert _found(agent) == []

            # A restore that fails at start: the images are refused, nothing of it stays.
            tree = _exported(agent, ckpt, "app", tmp_path / "forged", "--plaintext")
            _edit_config(tree, lambda c: c["linux"]["security_context"].update(run_as_user={"value": 1000}))
            forged = _imported(agent, tree, DST)
            cp = agent.cli("restore", forged, "--namespace", DST, "--start", "--full", check=False)
            assert cp.returncode != 0 and "phase privileges" in cp.stderr, cp.stderr
            assert pods_in(agent, DST) == [] and _found(agent) == []
            agent.cli("checkpoints", "rm", forged)

            # Restore through a Pod whose container is not created yet: no plaintext between the kubelet's calls.
            pod = pod_via_agent(agent, NS, [], annotations={RESTORE_FROM: ckpt})
            state = Path(agent.store) / "cri-restores" / pod.id
            assert (state / "state.json").exists() and _found(agent) == []
            # The kubelet creates the container: read and verified now, the same process.
            os.makedirs(os.path.join(pod.log_dir, "app"), exist_ok=True)

            async def create(client: Any) -> str:
                config = (await client.pod_status(pod.id)).config
                cid: str = await client.create_container(pod.id, app, dict(config))
                assert not list((Path(agent.store) / "plans" / cid / "images").glob("pages-*.img"))
                await client.start_container(cid)
                return cid

            cid = via_agent(agent, create)
            got = wait_for(lambda: _ask(pod_detail(agent, pod.id).ip), timeout=60, what="the Pod's restored server")
            assert (got["started"], got["memory"]) == (before["started"], before["memory"])
            assert (Path(agent.store) / "plans" / cid).is_dir()

            async def remove(client: Any) -> None:
                await client.stop_pod(pod.id)
                await client.remove_pod(pod.id)

            via_agent(agent, remove)  # the kubelet removes the Pod through the endpoint
            assert not (Path(agent.store) / "plans" / cid).exists() and not state.exists()
            wait_for(lambda: _found(agent) == [], timeout=60, what="no plaintext left")
            agent.cli("checkpoints", "rm", ckpt)
        finally:
            for pod_id in made:
                remove_pod(agent, pod_id)
            remove_pod(agent, src.id)
            if pod is not None:
                remove_pod(agent, pod.id)
