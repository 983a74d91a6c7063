"""Restore through a Pod, lazily: RunPodSandbox reads no more than the saved configs, and the memory streams.

A memhog pod (memory filled from a seed, answering with its checksum) is checkpointed on one node and
pushed to a real registry on loopback; another node restores it through the Pod path, with the kubelet's
calls in the kubelet's order. The registry's own log counts the bytes it served for the checkpoint:

- lazily (the node's default) without fetching ahead (`registry.prefetch: false`): when RunPodSandbox
  returns, the node has fetched less than a twentieth of the checkpoint (its manifest, config and saved
  configs), and holds no plan and no plaintext; the container, once started, is the same process with the
  same memory (its checksum), its memory streams in from the registry, and the checkpoint ends up whole in
  the node's store (its origin settled, every blob verified);
- lazily, fetching ahead (the default), on a store without the checkpoint's memory: while the kubelet is
  held where it pulls the image, every blob comes into the store before CreateContainer; the replica is
  the same process with the same memory, and the origin served each missing blob once;
- with `lazy-restore: never`: RunPodSandbox fetches as little, and CreateContainer reads everything, so the
  checkpoint is whole in the store before StartContainer, the plan holds all the memory, and the same
  process comes back.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from node_agent.api.pod_restores import RESTORE_FROM, STATE_DIR
from node_agent.oci import digest_hex
from testbed.bed import Bed, answers, ask, container_config, make_pod, pod_config, pod_detail, reconfigured
from testbed.bed import remove_pod, wait_for
from testbed.kubelet import Kubelet, StartedPod
from testbed.layout import BedLayout, write_hosts_toml
from testbed.registry import Registry
from tests.e2e.test_fanout import push_memhog

NS, DST = "e2e-plz", "e2e-plz-dst"
MEMHOG = ["/usr/local/bin/memhog", "--mib", "64", "--seed", "23", "--port", "8080", "--interval-ms", "100",
          "--flip", "0"]


@pytest.fixture(scope="module")
def origin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with Registry(tmp_path_factory.mktemp("plz-origin")) as reg:
        yield reg


def _plaintext_free(bed: Bed, sandbox: str) -> list[str]:
    """What the Pod's restore state holds besides its state file (nothing: no staging between calls)."""
    state = Path(bed.store) / STATE_DIR / sandbox
    return sorted(p.name for p in state.iterdir() if p.name != "state.json")


def test_the_pod_path_fetches_only_the_saved_configs_before_the_sandbox_and_streams_the_rest(
    agent: Bed, node2: Bed, origin: Registry
) -> None:
    src = make_pod(agent, NS, [container_config("mem", agent.info["images"]["memhog"], MEMHOG)])
    hosts = write_hosts_toml(BedLayout(node2.name).hosts_dir, origin.host, f'server = "http://{origin.host}"\n')
    made: list[str] = []
    ckpt = ""
    try:
        pushed = push_memhog(agent, src.id, origin, "ckpts/plz")
        ckpt, ref, checksum, digests, stored = pushed.ckpt, pushed.ref, pushed.checksum, pushed.digests, pushed.stored
        origins = Path(node2.store) / "origins" / (digest_hex(ckpt) + ".json")
        rules = f"restore:\n  pod-registries: [{origin.host}/ckpts]\n  pod-sources:\n    {DST}: [{NS}]\n"

        def replica(seen: dict[str, Any], pulling: Callable[[], None] = lambda: None) -> StartedPod:
            before = origin.blob_bytes_served(digests)

            def sandboxed(sandbox: str) -> None:
                seen["at_sandbox"] = origin.blob_bytes_served(digests) - before
                seen["state"] = json.loads((Path(node2.store) / STATE_DIR / sandbox / "state.json").read_text())
                seen["extra"] = _plaintext_free(node2, sandbox)
                seen["plans"] = sorted(p.name for p in (Path(node2.store) / "plans").iterdir())
                seen["origin_recorded"] = origins.exists()
                pulling()  # where the kubelet pulls the image: on a fresh node, seconds

            pcfg = pod_config(node2, DST, f"p-{secrets.token_hex(3)}")
            pcfg["annotations"] = {RESTORE_FROM: ref}
            image = node2.info["images"]["memhog"]
            pod = asyncio.run(Kubelet(node2.cri_endpoint).start_pod(
                pcfg, [container_config("mem", image, MEMHOG)], sandboxed=sandboxed))
            made.append(pod.sandbox_id)
            assert pod.error is None, pod.error
            seen["after_create"] = origins.exists()
            new_ip = pod_detail(node2, pod.sandbox_id).ip
            wait_for(lambda: answers(new_ip), what="the replica to answer")
            assert ask(new_ip).split("sum=")[1] == checksum, "not the checkpointed memory"
            return pod

        # Lazily, the node's default, without fetching ahead: what RunPodSandbox itself takes.
        with reconfigured(node2, rules + "registry:\n  prefetch: false\n"):
            seen: dict[str, Any] = {}
            pod = replica(seen)
            assert seen["at_sandbox"] < 0.05 * stored, (seen["at_sandbox"], stored)
            assert seen["state"]["lazy"] is True and seen["extra"] == [] and seen["plans"] == [], seen
            assert seen["origin_recorded"], "the memory was not left in the registry"
            (rep,) = [r for r in json.loads(node2.cli("restores", "-o", "json").stdout)
                      if r["container_id"] == pod.containers["mem"]]
            assert rep["lazy"] is True, rep
            # The memory streams in from the registry; then the checkpoint is whole in the store.
            wait_for(lambda: not origins.exists(), timeout=120, what="every blob to be in the node's store")
            node2.cli("checkpoints", "verify", ckpt)
            assert origin.blob_bytes_served(digests) >= 0.9 * stored

        remove_pod(node2, made.pop())
        node2.cli("checkpoints", "rm", ckpt)
        node2.cli("gc")  # its blobs go too: the next restore starts from a store without them

        # Lazily, fetching ahead (the default): while the kubelet pulls the image, the rest comes in.
        blob = Path(node2.store) / "blobs" / "sha256"
        with reconfigured(node2, rules):
            before = origin.blob_bytes_served(digests)
            seen = {}
            # Blobs other checkpoints on the node share (a chunk of zeros, say) stay; the memory is gone.
            absent = {d: n for d, n in origin.manifest_blobs("ckpts/plz", ref.rsplit(":", 1)[1]).items()
                      if not (blob / digest_hex(d)).exists()}
            assert sum(absent.values()) > stored // 2, (sum(absent.values()), stored)

            def whole() -> bool:
                return all((blob / digest_hex(d)).exists() for d in digests)

            pod = replica(seen, lambda: wait_for(whole, timeout=120, what="every blob before CreateContainer"))
            assert seen["state"]["lazy"] is True and seen["origin_recorded"], seen
            wait_for(lambda: not origins.exists(), timeout=120, what="the origin to be settled")
            node2.cli("checkpoints", "verify", ckpt)
            # Each blob crossed the network once: nothing fetched ahead was fetched again by a reader.
            assert origin.blob_bytes_served(digests) - before == sum(absent.values())

        remove_pod(node2, made.pop())
        node2.cli("checkpoints", "rm", ckpt)

        # In full: RunPodSandbox fetches as little; CreateContainer reads the rest before StartContainer.
        with reconfigured(node2, rules + "lazy-restore: never\n"):
            seen = {}
            pod = replica(seen)
            assert seen["at_sandbox"] < 0.05 * stored, (seen["at_sandbox"], stored)
            assert seen["state"]["lazy"] is False and seen["extra"] == [] and seen["plans"] == [], seen
            assert seen["origin_recorded"] and not seen["after_create"], "CreateContainer left blobs behind"
            (rep,) = [r for r in json.loads(node2.cli("restores", "-o", "json").stdout)
                      if r["container_id"] == pod.containers["mem"]]
            assert rep["lazy"] is False, rep
    finally:
        for pod_id in made:
            remove_pod(node2, pod_id)
        hosts.unlink(missing_ok=True)
        if ckpt:
            node2.cli("checkpoints", "rm", ckpt, check=False)
        remove_pod(agent, src.id)
