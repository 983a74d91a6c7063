"""The cross-node benchmark's cluster: four test beds with their agents, an origin registry and pull-through caches.

Node A is the harness's own bed and agent (`Cluster` is its Bench): the model server runs there and is
checkpointed. The target nodes B, C and D are beds of their own, a Bench each (their own containerd, CNI
bridge and subnet, store and agent), whose agents may restore a Pod of NS_POD from the origin's checkpoint
repository (`restore: pod-registries`, `pod-sources`), as an operator allows it. The origin is a real
registry on loopback (testbed/registry.py); a pull-through cache of it (docker-registry in proxy mode) is
named as the origin's mirror in each target's hosts.toml (the directory both its containerd and its agent
read), and replaced by an empty one whenever a measurement needs a cold cache.

Per weights size (`prepare`): A's bed is brought up with that size's model image; the image is tagged with
the origin's name and pushed there; each target removes the image the bed imported and pulls the origin's
through CRI PullImage (timed, reported apart: no column includes it); the model server starts on A, answers,
is checkpointed by the agent and removed, and the checkpoint is pushed to the origin. Everything is removed
with the beds at the end, registries included, also on errors.
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness.base import NS_SRC, BenchError, log, wait_until
from bench.harness.machine import inode_reuse_window
from bench.harness.ops import Bench
from bench.scenarios.firstanswer import FirstAnswer, model_image
from node_agent.config.loading import load as load_settings
from node_agent.cri import CriClient
from testbed.bed import merged_yaml
from testbed.host import TestbedError
from testbed.layout import BedLayout, write_hosts_toml
from testbed.registry import Registry

TARGETS = ("b", "c", "d")
NS_POD = "bench-pod"  # the Pod path's replicas; their checkpoint comes from NS_SRC
CKPT_REPO = "ckpts/model"
IMAGE_REPO = "models/debian"
REGISTRIES = "registries"  # under A's work dir


def node_args(args: argparse.Namespace, node: str) -> argparse.Namespace:
    """The harness's arguments for one node: its bed `<--bed>-<node>` and its own work dir."""
    one = argparse.Namespace(**vars(args))
    one.bed = f"{args.bed}-{node}"
    one.workdir = str(Path(args.workdir) / node) if args.workdir else None
    return one


def quiet_count(registry: Registry, digests: set[str], timeout: float = 120.0) -> int:
    """The blob bytes `registry` has served of `digests`, once the count has not moved for 1.5 s (a cache that
    missed fetches each blob a second time for itself, and its log counts a response when it ends)."""
    last = registry.blob_bytes_served(digests)
    still = time.monotonic()
    deadline = still + timeout
    while time.monotonic() - still < 1.5 and time.monotonic() < deadline:
        time.sleep(0.25)
        now = registry.blob_bytes_served(digests)
        if now != last:
            last, still = now, time.monotonic()
    return last


@dataclass
class Model:
    """One weights size on the cluster: the image in the origin, the checkpoint there, the source's answer."""

    mib: int
    image_ref: str  # the model image by the origin's name: A ran the source from it, the targets pulled it
    ckpt: str  # the checkpoint's ID on A
    ckpt_ref: str  # and where the origin holds it
    ref: dict[str, Any]  # the source's own answer for firstanswer.X, which every replica must give
    blobs: list[tuple[str, int]]  # the checkpoint's blobs in the origin: (digest, size)
    record: dict[str, Any] = field(default_factory=dict)  # what the results keep of the set-up

    @property
    def digests(self) -> set[str]:
        return {d for d, _ in self.blobs}

    @property
    def stored(self) -> int:
        """The checkpoint's stored bytes: every blob of its manifest."""
        return sum(s for _, s in self.blobs)


class Cluster(Bench):
    """Node A (this Bench), the targets B, C, D (a Bench each), the origin registry and the current cache."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(node_args(args, "a"))
        self.targets = {name: Bench(node_args(args, name)) for name in TARGETS}
        self.origin: Registry | None = None
        self.cache: Registry | None = None
        self.caches = 0
        self.retired_cpu = 0.0  # the CPU seconds of the caches stopped
        self.pulled: dict[str, str] = {}  # target -> the model image it pulled last
        self.connections = 8
        self.emptied: dict[str, float] = {}  # bed -> when its store's blobs were last deleted (monotonic)

    @property
    def reg(self) -> Registry:
        assert self.origin is not None
        return self.origin

    def registry_cpu(self) -> float:
        """The CPU seconds the registries (the origin and every cache) have used so far: it only grows."""
        cache = self.cache
        return (self.origin.cpu_seconds() if self.origin is not None else 0.0) + self.retired_cpu + (
            cache.cpu_seconds() if cache is not None else 0.0)

    # ---- set-up and tear-down ----------------------------------------------------

    def setup(self) -> None:
        super().setup()
        self.cleanups.append(self._take_down)
        self.connections = load_settings(self.b.config).registry.connections
        self.origin = Registry(self.work / REGISTRIES / "origin")
        self.origin.start()
        for name, node in self.targets.items():
            log(f"node {name.upper()}: its own test bed and agent")
            node.setup()
            self._pod_rules(node)

    def _pod_rules(self, node: Bench) -> None:
        """The target's agent restarted with the node's rules for Pods: restore-from may name the origin's
        checkpoints, and NS_POD may restore checkpoints of NS_SRC."""
        rules = (f"restore:\n  pod-registries: [{self.reg.host}/ckpts]\n"
                 f"  pod-sources:\n    {NS_POD}: [{NS_SRC}]\n")
        config = Path(node.b.config)
        node.b.stop_agent()
        config.write_text(merged_yaml(config.read_text(), rules))
        node.b.start_agent()

    def _take_down(self) -> list[str]:
        """The targets (their pods, checkpoints, agents and beds), then the registries."""
        errors: list[str] = []
        for node in self.targets.values():
            node.cleanup()  # logs its own errors
        for registry in (self.cache, self.origin):
            if registry is not None:
                try:
                    registry.stop()
                except Exception as exc:  # noqa: BLE001 - keep cleaning
                    errors.append(f"registry {registry.host}: {exc}")
        return errors

    # ---- registries --------------------------------------------------------------

    def point(self, node: Bench, mirror: Registry | None) -> None:
        """The node's hosts.toml for the origin: `mirror` first (pull and resolve), as an operator names a
        pull-through cache, then the origin; or the origin alone. Its agent reads it at every transfer."""
        text = f'server = "http://{self.reg.host}"\n'
        if mirror is not None:
            text += f'\n[host."http://{mirror.host}"]\n  capabilities = ["pull", "resolve"]\n'
        write_hosts_toml(node.b.info["registry_hosts_dir"], self.reg.host, text)

    def fresh_cache(self) -> Registry:
        """A new, empty pull-through cache of the origin (the one before stopped and removed), the mirror of
        every target from now on."""
        if self.cache is not None:
            cache, self.cache = self.cache, None  # no longer read by registry_cpu
            self.retired_cpu += cache.cpu_seconds()
            cache.stop()
            shutil.rmtree(cache.workdir, ignore_errors=True)
        self.caches += 1
        cache = Registry(self.work / REGISTRIES / f"cache-{self.caches}", proxy=f"http://{self.reg.host}")
        cache.start()
        self.cache = cache
        for node in self.targets.values():
            self.point(node, cache)
        return cache

    # ---- the targets' stores -----------------------------------------------------

    def forget(self, node: Bench) -> None:
        """The node's store emptied (`checkpoints rm` of each, then `gc`), so that its next path brings every
        byte again."""
        cp, _, _, _ = node.cli("checkpoints", "ls", "-o", "json")
        for item in json.loads(cp.stdout):
            node.remove_checkpoint(str(item["id"]))
        node.cli("gc", "-o", "json")
        self.emptied[node.b.name] = time.monotonic()

    def fresh(self, *nodes: Bench) -> None:
        """Wait until the nodes' stores make new files as a fresh node's does: after `forget`, for as long as
        the stores' filesystem makes a new file pay for each file deleted moments before
        (`machine.inode_reuse_window`; 0 on most filesystems)."""
        due = max((self.emptied.get(node.b.name, 0.0) + inode_reuse_window(node.b.store) for node in nodes),
                  default=0.0)
        wait = due - time.monotonic()
        if wait > 0:
            log(f"  {wait:.0f} s for the files deleted on {', '.join(node.b.name for node in nodes)} to age "
                "(ext4 without a journal)")
            time.sleep(wait)

    # ---- one weights size --------------------------------------------------------

    def _ctr(self, node: Bench, *args: str, check: bool = True) -> None:
        layout = BedLayout(node.b.name)
        layout.load_tools()
        try:
            layout.ctr(*args, timeout=self.op_timeout, check=check)
        except TestbedError as exc:
            raise BenchError(f"node {node.b.name}: {exc}") from exc

    def _drop_image(self, node: Bench, image: str) -> None:
        """The image removed from the node under every name the CRI keeps for it (its name, its ID, its repo
        digests), its content and snapshots collected: a pull after this fetches every layer."""
        found, digests = node.cri(lambda cri: cri.image_ids(image))
        if not found:
            return
        self._ctr(node, "images", "rm", "--sync", image, found, *digests, check=False)
        try:  # the CRI's image store follows containerd's events
            wait_until(lambda: not node.cri(lambda cri: cri.image_present(found)), 15, f"{image} to go")
        except BenchError:
            log(f"node {node.b.name}: image {image} ({found}) is still there after its removal; its pull may "
                "find its layers")

    def _pull_image(self, name: str, node: Bench, image_ref: str) -> float:
        """The model image on the target from the origin, through CRI PullImage as the kubelet pulls it, after
        the image the bed imported (the same, under its local name) or an earlier size's is removed: its
        seconds."""
        for old in (node.b.info["images"].get("debian"), self.pulled.pop(name, None)):
            if old:
                self._drop_image(node, old)

        async def go(cri: CriClient) -> float:
            await cri.version()
            m0 = time.monotonic()
            await cri.pull_image(image_ref, timeout=self.op_timeout)
            return time.monotonic() - m0

        took = node.cri(go, timeout=self.op_timeout)
        self.pulled[name] = image_ref
        return round(took, 4)

    def prepare(self, mib: int) -> Model:
        """A's bed with `mib` MiB of weights, the image in the origin and on every target, the source
        checkpointed and its checkpoint in the origin."""
        self.model_bed(mib)
        local = model_image(self.b.info)
        if local is None:
            raise BenchError(f"test bed {self.b.name} has no model server image")
        tag = f"{mib}m-{secrets.token_hex(3)}"
        image_ref = self.reg.ref(f"{IMAGE_REPO}:{tag}")
        self._ctr(self, "images", "tag", local, image_ref)
        self._ctr(self, "images", "push", "--plain-http", image_ref, image_ref)
        pulls = {}
        for name, node in self.targets.items():
            self.point(node, None)
            pulls[name] = self._pull_image(name, node, image_ref)
        log(f"{mib} MiB of weights: the model image pulled from the origin by "
            + ", ".join(f"{n.upper()} in {s:.2f}s" for n, s in pulls.items()) + " (in no column)")
        pod_id, _, ref, _ = FirstAnswer(self).source(image_ref, self.op_timeout)
        cp, _, _, _ = self.cli("checkpoint", pod_id, "-o", "json", "--timeout", str(self.op_timeout - 10))
        info = json.loads(cp.stdout)
        ckpt = str(info["id"])
        self.checkpoints.append(ckpt)
        self.remove_pod(pod_id)  # the replicas answer for it from here on
        ckpt_ref = self.reg.ref(f"{CKPT_REPO}:{tag}")
        self.cli("push", ckpt, ckpt_ref, "--plain-http")
        blobs = list(self.reg.manifest_blobs(CKPT_REPO, tag).items())
        model = Model(mib, image_ref, ckpt, ckpt_ref, ref, blobs)
        model.record = {
            "mib": mib, "weights_bytes": ref["weights_bytes"], "image_ref": image_ref, "image_pull_s": pulls,
            "checkpoint": {"id": ckpt, "reference": ckpt_ref, "size": int(info.get("size", 0)),
                           "stored_bytes": model.stored, "blobs": len(blobs)},
        }
        return model

    def drop(self, model: Model) -> None:
        """A's checkpoint of this size removed (the origin's copy goes with the origin)."""
        if model.ckpt in self.checkpoints:
            self.remove_checkpoint(model.ckpt)
