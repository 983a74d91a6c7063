"""Fan-out through a distribution engine the cluster already runs: a pull-through cache as every node's mirror.

The origin is a real registry on loopback; the cache is Debian's docker-registry in proxy mode
(``proxy: remoteurl:``) in front of it, named as the mirror in each node's hosts.toml. A model-like
workload (memhog: memory filled from a seed, answering with its checksum) is checkpointed on one node
and pushed to the origin. A first node restores it through the Pod path, with the kubelet's calls; then
two more nodes at once. Every replica answers with the checksum the original had, on its own node, and
after the first node the origin serves less than a tenth of the checkpoint's bytes more (counted at the
origin, from its own log).
"""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from node_agent.api.pod_restores import RESTORE_FROM
from testbed.bed import Bed, answers, ask, container_config, make_pod, pod_config, pod_detail, reconfigured
from testbed.bed import remove_pod, wait_for
from testbed.kubelet import Kubelet, StartedPod
from testbed.layout import BedLayout, write_hosts_toml
from testbed.registry import Registry

MEMHOG = ["/usr/local/bin/memhog", "--mib", "48", "--seed", "11", "--port", "8080", "--interval-ms", "100",
          "--flip", "0"]


@pytest.fixture(scope="module")
def origin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with Registry(tmp_path_factory.mktemp("fan-origin")) as reg:
        yield reg


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory, origin: Registry) -> Iterator[Registry]:
    with Registry(tmp_path_factory.mktemp("fan-cache"), proxy=f"http://{origin.host}") as reg:
        yield reg


def _mirror(bed: Bed, origin: Registry, cache: Registry) -> Path:
    """The node's hosts.toml for the origin: the cache first, for pulls, then the origin itself."""
    return write_hosts_toml(BedLayout(bed.name).hosts_dir, origin.host,
                            f'server = "http://{origin.host}"\n\n'
                            f'[host."http://{cache.host}"]\n  capabilities = ["pull", "resolve"]\n')


@dataclass(frozen=True)
class Pushed:
    """A memhog pod's checkpoint pushed to an origin: its id, reference, the checksum memhog answered before,
    and its blobs at the origin (digests, their stored bytes)."""

    ckpt: str
    ref: str
    checksum: str
    digests: set[str]
    stored: int


def push_memhog(agent: Bed, pod_id: str, origin: Registry, repository: str) -> Pushed:
    """Once memhog in `pod_id` answers: its checksum, then its checkpoint pushed to `origin` under a new tag."""
    ip = pod_detail(agent, pod_id).ip
    wait_for(lambda: answers(ip), what="memhog to answer")
    checksum = ask(ip).split("sum=")[1]
    ckpt = agent.cli("checkpoint", pod_id).stdout.strip().splitlines()[-1]
    tag = secrets.token_hex(3)
    ref = origin.ref(f"{repository}:{tag}")
    agent.cli("push", ckpt, ref, "--plain-http")
    sizes = origin.manifest_blobs(repository, tag)
    return Pushed(ckpt, ref, checksum, set(sizes), sum(sizes.values()))


def _replica(bed: Bed, namespace: str, ref: str, image: str) -> StartedPod:
    pcfg = pod_config(bed, namespace, f"p-{secrets.token_hex(3)}")
    pcfg["annotations"] = {RESTORE_FROM: ref}
    return asyncio.run(Kubelet(bed.cri_endpoint).start_pod(pcfg, [container_config("mem", image, MEMHOG)]))


def test_replicas_fan_out_through_a_pull_through_cache(
    agent: Bed, node2: Bed, node3: Bed, bed17: tuple[Bed, Any], origin: Registry, cache: Registry
) -> None:
    targets = [node2, node3, bed17[0]]
    src = make_pod(agent, "e2e-fan", [container_config("mem", agent.info["images"]["memhog"], MEMHOG)])
    hosts = [_mirror(b, origin, cache) for b in targets]
    started: list[tuple[Bed, str]] = []
    ckpt = ""
    try:
        pushed = push_memhog(agent, src.id, origin, "ckpts/fan")
        ckpt, ref, checksum, digests, stored = pushed.ckpt, pushed.ref, pushed.checksum, pushed.digests, pushed.stored
        before = origin.blob_bytes_served(digests)

        rules = (f"restore:\n  pod-registries: [{origin.host}/ckpts]\n"
                 "  pod-sources:\n    e2e-fan-replica: [e2e-fan]\n")

        def replica(bed: Bed, out: list[StartedPod]) -> None:
            out.append(_replica(bed, "e2e-fan-replica", ref, bed.info["images"]["memhog"]))

        def answered(bed: Bed, pod: StartedPod) -> None:
            assert pod.error is None, (bed.name, pod.error)
            started.append((bed, pod.sandbox_id))
            new_ip = pod_detail(bed, pod.sandbox_id).ip
            wait_for(lambda: answers(new_ip), what=f"the replica on {bed.name} to answer")
            assert ask(new_ip).split("sum=")[1] == checksum, bed.name

        with reconfigured(node2, rules), reconfigured(node3, rules), reconfigured(bed17[0], rules):
            first: list[StartedPod] = []
            replica(node2, first)
            answered(node2, first[0])
            after_first = origin.blob_bytes_served(digests) - before
            # On a miss distribution's proxy streams a blob to the client and fetches it again for itself.
            assert 0 < after_first <= 2.5 * stored, (after_first, stored)

            outs: dict[str, list[StartedPod]] = {b.name: [] for b in targets[1:]}
            threads = [threading.Thread(target=replica, args=(b, outs[b.name])) for b in targets[1:]]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for b in targets[1:]:
                assert outs[b.name], f"no replica on {b.name}"
                answered(b, outs[b.name][0])
            more = origin.blob_bytes_served(digests) - before - after_first
            assert more < 0.1 * stored, (more, stored)
    finally:
        for b, pod_id in started:
            remove_pod(b, pod_id)
        for path in hosts:
            path.unlink(missing_ok=True)
        for b in targets:
            if ckpt:
                b.cli("checkpoints", "rm", ckpt, check=False)
        remove_pod(agent, src.id)
