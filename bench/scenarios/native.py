"""node-agent against containerd's own CRI checkpoint and restore (containerd 2.1 and later).

containerd's path, as a kubelet or an operator reaches it through the CRI:

  * checkpoint: RuntimeService `CheckpointContainer(container_id, location,
    timeout)`. containerd pauses the container, has runc and CRIU dump it
    (leaving it running), copies the images and the writable layer's diff into
    its content store, resumes the container, and then writes the archive
    (`checkpoint/`, `rootfs-diff.tar`, `config.dump`, `spec.dump`,
    `status.dump`, `container.log`, ...) to `location`;
  * restore (2.1): `CreateContainer` in a fresh sandbox with the archive's
    path as `config.image.image`, then `StartContainer`, which runs
    `runc restore` from the unpacked archive.

The archive names its base image by `config.dump`'s `rootfsImageRef`, the
container's CRI `image_ref`; containerd pulls it by that NAME@DIGEST when it is
not local, so the workload runs from an image a registry served: the bed's
memhog image is pushed to a loopback registry (testbed/registry.py) and
pulled back through CRI `PullImage`. The node-agent columns use the same pods.

Every run is a new pod whose memory is filled from a fresh random seed, so no
chunk of it is in the agent's store beforehand: content-addressed dedup does
not help the agent here. Within a run the agent and containerd take turns
(which one goes first alternates between runs), checkpoint and then restore.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, TypeVar

import grpc

from bench.harness.base import NS_RESTORE, BenchError, log
from bench.harness.env import Ctr
from bench.harness.measure import fsync_path, read_through, tree_bytes
from bench.harness.ops import Bench
from node_agent._proto.k8s.cri.runtime.v1 import api_pb2 as cri
from node_agent._proto.k8s.cri.runtime.v1 import api_pb2_grpc as cri_grpc
from node_agent.cri import CriClient
from node_agent.cri.client import grpc_target
from testbed.bed import pod_config
from testbed.layout import write_hosts_toml
from testbed.registry import Registry

T = TypeVar("T")
REPO_NAME = "node-agent-bench/memhog"
CONTENT_DIR = ("root", "io.containerd.content.v1.content")


class NativeError(BenchError):
    """A failure of the native path or of its set-up, reported as one line."""


def unsupported(info: dict[str, Any]) -> str:
    """Why the bed's containerd has no CRI checkpoint and restore to compare with ("" if it has)."""
    version = str(info.get("containerd_version", ""))
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return f"containerd version {version!r} not understood"
    if (major, minor) < (2, 1):
        return f"containerd {version} has no CRI restore (CheckpointContainer came in 2.0, restore through " \
               "CreateContainer in 2.1)"
    if not info.get("registry_hosts_dir"):
        return "the test bed has no registry config_path (registry_hosts_dir)"
    return ""


class Native:
    """The comparison with containerd's own path on one test bed; `cleanup` removes what it made."""

    def __init__(self, bench: Bench, restore_namespace: str = NS_RESTORE) -> None:
        self.bench = bench
        self.ns = restore_namespace
        self.dir = bench.work / "native"
        self.registry: Registry | None = None
        self.hosts_dir: Path | None = None
        self.refs: list[str] = []  # names this added to the bed's image store
        self.archives: set[str] = set()

    # ---- plumbing ----------------------------------------------------------

    @property
    def info(self) -> dict[str, Any]:
        return self.bench.b.info

    def _grpc(self, fn: Callable[[Any, Any], Awaitable[T]]) -> T:
        """`fn(runtime_stub, image_stub)` on a channel of its own to the bed's containerd."""
        async def go() -> T:
            ch = grpc.aio.insecure_channel(grpc_target(self.bench.b.endpoint),
                                           options=[("grpc.max_receive_message_length", 64 << 20)])
            try:
                return await fn(cri_grpc.RuntimeServiceStub(ch), cri_grpc.ImageServiceStub(ch))  # type: ignore[no-untyped-call]
            except grpc.aio.AioRpcError as exc:
                raise NativeError(f"CRI: {exc.code().name}: {exc.details()}") from exc
            finally:
                await ch.close()

        return asyncio.run(go())

    def _ctr(self, *args: str, what: str) -> str:
        argv = [self.info["ctr_binary"], "--address", self.info["containerd_socket"], "--namespace", "k8s.io", *args]
        try:
            cp = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired as exc:
            raise NativeError(f"{what}: ctr timed out") from exc
        if cp.returncode != 0:
            raise NativeError(f"{what}: ctr exited {cp.returncode}: {cp.stderr.strip()[-500:]}")
        return cp.stdout

    def _content_bytes(self) -> int:
        return tree_bytes(os.path.join(self.info["base"], *CONTENT_DIR))

    # ---- the image, from a registry ------------------------------------------

    def image(self) -> str:
        """The bed's memhog image pushed to a loopback registry and pulled back through CRI:
        its NAME:TAG, whose containers' image_ref is NAME@DIGEST."""
        self.dir.mkdir(exist_ok=True)
        self.registry = Registry(self.dir / "registry")
        self.registry.start()
        host = self.registry.host
        ref = self.registry.ref(f"{REPO_NAME}:{secrets.token_hex(4)}")
        self._ctr("images", "push", "--plain-http", ref, self.info["images"]["memhog"], what=f"push to {host}")
        self.hosts_dir = write_hosts_toml(self.info["registry_hosts_dir"], host, (
            f'server = "http://{host}"\n\n[host."http://{host}"]\n  capabilities = ["pull", "resolve"]\n')).parent
        self.refs.append(ref)

        async def pull(_rt: Any, img: Any) -> list[str]:
            await img.PullImage(cri.PullImageRequest(image=cri.ImageSpec(image=ref)), timeout=300)
            st = await img.ImageStatus(cri.ImageStatusRequest(image=cri.ImageSpec(image=ref)), timeout=60)
            return list(st.image.repo_digests)

        digests = [d for d in self._grpc(pull) if d.startswith(f"{host}/")]
        if not digests:
            raise NativeError(f"CRI PullImage of {ref} gave no repo digest")
        self.refs += digests
        log(f"  workload image {ref} from a loopback registry ({digests[0].split('@')[1][:19]})")
        return ref

    # ---- containerd's checkpoint and restore ----------------------------------

    def checkpoint(self, c: Ctr) -> dict[str, Any]:
        """CheckpointContainer into a new archive, then fsync of the archive and its directory."""
        path = str(self.dir / f"{secrets.token_hex(6)}.tar")
        self.archives.add(path)
        op_timeout = self.bench.op_timeout
        content_before = self._content_bytes()
        times: dict[str, float] = {}

        async def go(rt: Any, _img: Any) -> None:
            await rt.Version(cri.VersionRequest(version="v1"), timeout=30)  # the connection is up first
            c.log.mark()
            t0 = time.time()
            m0 = time.monotonic()
            await rt.CheckpointContainer(cri.CheckpointContainerRequest(
                container_id=c.id, location=path, timeout=int(op_timeout)), timeout=op_timeout)
            m1 = time.monotonic()
            fsync_path(path)
            fsync_path(os.path.dirname(path))
            m2 = time.monotonic()
            times.update(start=t0, end=time.time(), call_s=m1 - m0, fsync_s=m2 - m1, wall_s=m2 - m0)

        self._grpc(go)
        gap = c.log.gap_since_mark(times["end"])
        size = os.path.getsize(path)
        # containerd drops the checkpoint's copy in its content store afterwards; its garbage
        # collector removes the blobs a little later. Not timed: wait for that, so the next
        # operation does not run beside it.
        m0 = time.monotonic()
        left = self._content_bytes() - content_before
        while left > (16 << 20) and time.monotonic() - m0 < 60:
            time.sleep(0.1)
            left = self._content_bytes() - content_before
        out: dict[str, Any] = {k: round(v, 4) for k, v in times.items() if k.endswith("_s")}
        out.update(path=path, frozen_outside_ms=gap.gap_ms, archive_bytes=size, start=times["start"],
                   end=times["end"], content_gc_wait_s=round(time.monotonic() - m0, 2),
                   content_left_bytes=max(0, left))
        return out

    def restore(self, archive: str, ccfg: dict[str, Any], label: str) -> dict[str, Any]:
        """The archive restored by containerd: RunPodSandbox, CreateContainer with the archive
        as its image, StartContainer; then (not timed) the first tick of the restored process."""
        b = self.bench
        name = f"n-{label}-{secrets.token_hex(3)}"
        pcfg = pod_config(b.b, self.ns, name)
        cname = ccfg["metadata"]["name"]
        os.makedirs(os.path.join(pcfg["log_directory"], cname), exist_ok=True)
        cfg = copy.deepcopy(ccfg)
        cfg["image"] = {"image": archive}
        read_through(archive)
        times: dict[str, float] = {}

        async def go(cri_: CriClient) -> tuple[str, str]:
            await cri_.version()
            t0 = time.time()
            m0 = time.monotonic()
            pod_id = await cri_.run_pod(pcfg, "")  # the bed's default runtime: runc, no node-agent handler
            b.pods[pod_id] = f"{self.ns}/{name}"
            m1 = time.monotonic()
            cid = await cri_.create_container(pod_id, cfg, pcfg)
            m2 = time.monotonic()
            await cri_.start_container(cid, timeout=b.op_timeout)
            m3 = time.monotonic()
            times.update(start=t0, end=time.time(), sandbox_s=m1 - m0, create_s=m2 - m1, start_call_s=m3 - m2,
                         wall_s=m3 - m0)
            return pod_id, cid

        pod_id, cid = b.cri(go, timeout=b.op_timeout)
        try:
            assert b.ctrd_log is not None
            start_ms = b.ctrd_log.start_ms(cid)
            # The restored container's CRI log begins with the source's ticks (containerd copies
            # them from the archive): the first tick after the call is the restored process's.
            first = b.check_running(cid, since=times["start"])
        finally:
            b.remove_pod(pod_id)
        out: dict[str, Any] = {k: round(v, 4) for k, v in times.items() if k.endswith("_s")}
        out.update(start_ms=start_ms, start=times["start"], end=times["end"],
                   first_tick_s=round(first - times["start"], 4) if first is not None else None)
        return out

    def _drop_archive(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self.archives.discard(path)

    # ---- the runs ---------------------------------------------------------------

    def run(self, sizes: list[int]) -> dict[str, Any]:
        image = self.image()
        out: dict[str, Any] = {"image": image, "repo_digest": self.refs[1] if len(self.refs) > 1 else None,
                               "sizes": {}, "warmup": {}}
        for mib in sizes:
            samples, warmups = self.size(mib, image)
            out["sizes"][str(mib)] = samples
            if warmups:
                out["warmup"][str(mib)] = warmups
        return out

    def size(self, mib: int, image: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        b = self.bench
        runs, warmup = b.args.runs, b.args.warmup
        log(f"{mib} MiB of fresh random memory, against containerd's own CheckpointContainer and restore: "
            f"{runs} interleaved runs, a new pod each")
        samples: list[dict[str, Any]] = []
        warmups: list[dict[str, Any]] = []
        for i in range(-warmup, runs):
            seed = secrets.randbits(63) | 1
            pod = b.new_pod("fresh", mib, ["hog"], image=image, seed=seed)
            c = pod.containers[0]
            ckpt = ""
            archive = ""
            agent_first = i % 2 == 0
            label = f"{mib}-{'w' if i < 0 else ''}{abs(i) if i < 0 else i + 1}"
            try:
                ref = b.cri(lambda cri_: cri_.container_status(c.id)).container.image_ref
                if "@sha256:" not in ref:
                    raise NativeError(f"the workload's image_ref is {ref!r}, not NAME@DIGEST: containerd "
                                      "could not find the checkpoint's base image")
                done: dict[str, dict[str, Any]] = {}
                for who in (("agent", "native") if agent_first else ("native", "agent")):
                    if who == "agent":
                        done["agent"] = b.agent_checkpoint(pod)
                        ckpt = done["agent"]["id"]
                    else:
                        done["native"] = self.checkpoint(c)
                        archive = done["native"]["path"]
                    b.settle()
                for who in (("agent", "native") if agent_first else ("native", "agent")):
                    if who == "agent":
                        done["lazy"] = b.agent_restore(ckpt, f"f{label}", lazy=True)
                    else:
                        done["native_restore"] = self.restore(archive, c.config, label)
                    b.settle()
            finally:
                if ckpt and ckpt in b.checkpoints:
                    b.remove_checkpoint(ckpt)
                if archive:
                    self._drop_archive(archive)
                b.remove_pod(pod.id)
            sample = {"run": i + 1, "seed": seed, "image_ref": ref, "first": "agent" if agent_first else "native",
                      **done}
            if i < 0:
                warmups.append(sample)
                continue
            samples.append(sample)
            a, n, z, r = done["agent"], done["native"], done["lazy"], done["native_restore"]
            log(f"  {mib} MiB fresh run {i + 1}/{runs} ({sample['first']} first): agent {a['wall_s']:.2f}s frozen "
                f"{a['frozen_outside_ms']:.0f} ms, +{a['store_added_bytes'] >> 20} MiB stored | containerd "
                f"{n['wall_s']:.2f}s frozen {n['frozen_outside_ms']:.0f} ms | lazy restore {z['wall_s']:.2f}s "
                f"(ticks after {z['first_tick_s']}s) | containerd restore {r['wall_s']:.2f}s (create "
                f"{r['create_s']:.2f}s, start {r['start_call_s']:.2f}s, ticks after {r['first_tick_s']}s)")
            b.settle()
        return samples, warmups

    # ---- tear-down ------------------------------------------------------------

    def cleanup(self) -> list[str]:
        """Removes the archives, the image names it added, the registry's hosts.toml and the
        registry. Pods are the bench's (removed before this)."""
        errors: list[str] = []
        for path in list(self.archives):
            self._drop_archive(path)
        if self.refs:
            try:
                self._ctr("images", "rm", *self.refs, what="image removal")
            except Exception as exc:  # noqa: BLE001 - keep cleaning
                errors.append(f"images {', '.join(self.refs)}: {exc}")
            self.refs = []
        if self.hosts_dir is not None:
            shutil.rmtree(self.hosts_dir, ignore_errors=True)
            self.hosts_dir = None
        if self.registry is not None:
            try:
                self.registry.stop()
            except Exception as exc:  # noqa: BLE001
                errors.append(f"registry: {exc}")
            self.registry = None
        shutil.rmtree(self.dir, ignore_errors=True)
        return errors


def run(bench: Bench) -> None:
    """The comparison at each --native-sizes, unless the bed's containerd has none or --no-native; what it made
    is removed with the rest of the run."""
    args = bench.args
    why_not = unsupported(bench.b.info) if not args.no_native else "--no-native"
    if why_not:
        log(f"against containerd's own checkpoint and restore: skipped ({why_not})")
        bench.results["native"] = {"skipped": why_not}
        return
    native = Native(bench, NS_RESTORE)
    bench.cleanups.append(native.cleanup)  # the registry's image, its hosts.toml, the registry
    bench.results["native"] = native.run(args.native_sizes)
