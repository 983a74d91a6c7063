"""The namespace policy on a real node: in a refused namespace nothing is frozen and nothing is made.

One agent config (`namespaces: {e2e-pol-deny: {checkpoint: false, restore: false}}`), one small pod
in that namespace and one in another: a checkpoint of the refused pod, a restore into the refused
namespace through the local socket, and a restore there through a Pod annotation on the CRI
endpoint are each PERMISSION_DENIED, and containerd, the store and the agent's working places show
nothing new.
"""

from __future__ import annotations

import os
import secrets
import uuid

import grpc
import pytest

from node_agent._proto.k8s.cri.runtime.v1 import api_pb2 as cri
from node_agent._proto.k8s.cri.runtime.v1 import api_pb2_grpc as cri_grpc
from node_agent.store import Store
from testbed.bed import (Bed, container_config, container_detail, criu_processes, freezer_state, make_pod, pods_in,
                           reconfigured, remove_pod, ticks, wait_for)

DENY = "e2e-pol-deny"
ALLOW = "e2e-pol-src"
RESTORE_FROM = "checkpoint.node-agent.io/restore-from"
TICKER = "i=0; while :; do i=$((i+1)); echo tick $i; sleep 0.1; done"


def _leftovers(bed: Bed) -> dict[str, list[str]]:
    """What the agent's journal, scratch space, restore plans and pending Pod restores hold now."""
    out = {}
    for sub in ("journal", "work", "plans", "cri-restores"):
        d = os.path.join(bed.store, sub)
        out[sub] = sorted(os.listdir(d)) if os.path.isdir(d) else []
    return out


def test_a_refused_namespace_gets_nothing_frozen_or_made(agent: Bed) -> None:
    busybox = agent.info["images"]["busybox"]
    with reconfigured(agent, f"namespaces:\n  {DENY}:\n    checkpoint: false\n    restore: false\n"):
        denied = make_pod(agent, DENY, [container_config("app", busybox, ["sh", "-c", TICKER])])
        source = make_pod(agent, ALLOW, [container_config("app", busybox, ["sh", "-c", TICKER])])
        ckpt = ""
        try:
            d = container_detail(agent, denied.containers["app"])
            wait_for(lambda: len(ticks(d.log_path)) >= 3, what="the pod ticks")
            before, left = {r.id for r in Store(agent.store).list()}, _leftovers(agent)
            log_start = os.path.getsize(agent.agent_log)  # the log goes on from earlier tests

            cp = agent.cli("checkpoint", f"{DENY}/{denied.name}", check=False)
            assert cp.returncode != 0 and "PERMISSION_DENIED" in cp.stderr, cp.stderr
            assert f'namespaces["{DENY}"].checkpoint is false' in cp.stderr, cp.stderr
            assert f"checkpoint of pod {DENY}/{denied.name}" in cp.stderr, cp.stderr
            assert freezer_state(d.pid) == "THAWED" and not criu_processes()
            with open(agent.agent_log, "rb") as fh:
                fh.seek(log_start)
                assert b"frozen for" not in fh.read()
            n = len(ticks(d.log_path))
            wait_for(lambda: len(ticks(d.log_path)) > n, what="the refused pod keeps ticking")
            assert {r.id for r in Store(agent.store).list()} == before and _leftovers(agent) == left

            ckpt = agent.cli("checkpoint", f"{ALLOW}/{source.name}").stdout.strip().splitlines()[-1]
            left = _leftovers(agent)
            there = {p.id for p in pods_in(agent, DENY)}
            cp = agent.cli("restore", ckpt, "--namespace", DENY, "--start", check=False)
            assert cp.returncode != 0 and "PERMISSION_DENIED" in cp.stderr, cp.stderr
            assert f'namespaces["{DENY}"].restore is false' in cp.stderr, cp.stderr
            assert {p.id for p in pods_in(agent, DENY)} == there and _leftovers(agent) == left

            # Restore through a Pod, as the kubelet asks for one: no sandbox either.
            name = f"p-{secrets.token_hex(3)}"
            request = cri.RunPodSandboxRequest(config=cri.PodSandboxConfig(
                metadata=cri.PodSandboxMetadata(name=name, namespace=DENY, uid=str(uuid.uuid4())),
                annotations={RESTORE_FROM: ckpt}))
            with grpc.insecure_channel(agent.cri_endpoint) as ch:
                with pytest.raises(grpc.RpcError) as info:
                    cri_grpc.RuntimeServiceStub(ch).RunPodSandbox(request, timeout=120)  # type: ignore[no-untyped-call]
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value
            assert info.value.details() == (f"restore of pod {DENY}/{name} from {ckpt}: restore as pod {DENY}/{name}: "
                                            f'refused by this node\'s policy: namespaces["{DENY}"].restore is false')
            assert {p.id for p in pods_in(agent, DENY)} == there and _leftovers(agent) == left
        finally:
            remove_pod(agent, denied.id)
            remove_pod(agent, source.id)
            if ckpt:
                agent.cli("checkpoints", "rm", ckpt, check=False)
