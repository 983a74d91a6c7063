"""The device monitor: poll, judge, match, taint, publish snapshots.

Every `poll-interval` one round runs: the sysfs inventory and the NVML scan
(in threads, with a deadline), the health model, the ResourceSlice index
(relisted every `resync-interval`), the desired DeviceTaintRules and, when
the agent has cluster credentials, the writes. Each round ends in a complete
`Snapshot`; `watch()` hands every new one to API streams. A failing round
is logged and the next one tries again; the monitor itself never stops the
daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable

from node_agent import errors
from node_agent.cancelling import cancel_and_wait
from node_agent.config.schema import Settings
from node_agent.devices import dra, sysfs
from node_agent.devices.health import HealthModel
from node_agent.kubeapi import KubeClient, from_kubeconfig, in_cluster
from node_agent.devices.nvml import Nvml
from node_agent.devices.ratelimit import TokenBucket
from node_agent.devices.taints import EFFECTS, TaintWriter, desired_rules
from node_agent.devices.types import STATES, DeviceReport, GpuScan, PciDevice, Snapshot

log = logging.getLogger(__name__)

SCAN_TIMEOUT = 30.0
# NVML calls can hang on a failing GPU: after this the GPUs are unmonitored,
# and no second scan starts while the first is still stuck.
NVML_TIMEOUT = 15.0


def node_name(configured: str) -> str:
    return (configured or os.environ.get("NODE_NAME") or socket.gethostname()).lower()


def kube_client(s: Settings) -> tuple[KubeClient | None, str]:
    """The API-server client from the config's kubeconfig or in-cluster credentials, or why there is none."""
    d = s.devices
    if not d.taints:
        return None, "off: taints are turned off in the config"
    creds = from_kubeconfig(d.kubeconfig) if d.kubeconfig else in_cluster()
    if creds is None:
        return None, "off: no cluster credentials (no kubeconfig in the config, not in a pod)"
    return KubeClient(creds, timeout=d.api_timeout), "on"


class DeviceMonitor:
    def __init__(
        self,
        settings: Settings,
        *,
        kube: KubeClient | None = None,
        kube_status: str = "off: no cluster credentials",
        nvml: Nvml | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.policy = settings.devices
        self.node = node_name(self.policy.node_name)
        self.kube = kube
        self.kube_status = kube_status if kube is None else "on"
        self.nvml = nvml if nvml is not None else Nvml()
        self.clock = clock
        self.wall = wall
        self.model = HealthModel(self.policy)
        self.index = dra.SliceIndex()
        self.bucket = TokenBucket(self.policy.write_rate, self.policy.write_burst, clock)
        self.writer = TaintWriter(kube, self.node, self.bucket, self.policy.api_timeout) if kube else None
        self._listed_at: float | None = None
        self._dra_error = ""
        self._snapshot = Snapshot(node=self.node, dra_status=self.kube_status)
        self._new = asyncio.Event()
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # Its own threads, so a hung sysfs or NVML read cannot starve the daemon's default executor.
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="devices")
        self._nvml_scan: asyncio.Future[GpuScan] | None = None
        self._nvml_since = 0.0
        self._slices_ok = False  # the last ResourceSlice listing succeeded
        self._announced = False

    # ---- one round ---------------------------------------------------------

    async def _slices(self) -> None:
        if self.kube is None:
            return
        now = self.clock()
        if self._listed_at is not None and now - self._listed_at < self.policy.resync_interval and not self._dra_error:
            return
        relist = self._listed_at is not None
        self._listed_at = now
        try:
            async with asyncio.timeout(self.policy.api_timeout + 1.0):
                items = await asyncio.to_thread(self.kube.list_resource_slices, self.node)
            self.index = dra.SliceIndex(items)
            if self.writer is not None and relist:
                self.writer.actual = None  # relist our rules with the slices
            self._dra_error = ""
            self._slices_ok = True
        except (errors.AgentError, TimeoutError) as exc:
            self._slices_ok = False
            self._dra_error = f"error: listing ResourceSlices: {exc or 'timed out'}"
            log.warning("%s", self._dra_error, extra={"phase": "devices"})

    async def _gpus(self) -> GpuScan:
        loop = asyncio.get_running_loop()
        if self._nvml_scan is None or self._nvml_scan.done():
            self._nvml_scan = loop.run_in_executor(self._executor, self.nvml.scan)
            self._nvml_since = self.clock()
        try:
            async with asyncio.timeout(NVML_TIMEOUT):
                return await asyncio.shield(self._nvml_scan)
        except TimeoutError:
            waited = self.clock() - self._nvml_since
            return GpuScan(error=f"NVML has not answered for {waited:.0f}s")
        except Exception as exc:  # noqa: BLE001 - whatever it was, the GPUs are unmonitored
            return GpuScan(error=f"NVML scan failed: {exc!r}")

    async def poll(self) -> Snapshot:
        """One round; returns (and publishes) its snapshot."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(SCAN_TIMEOUT):
            inv = await loop.run_in_executor(self._executor, sysfs.scan, self.settings.sysfs_root)
        gpus = await self._gpus()
        now, wall = self.clock(), self.wall()
        devices = list(inv.devices)
        known = {d.bdf for d in devices}
        for reading in gpus.readings:
            if reading.bdf not in known:  # NVML sees a GPU that this sysfs tree does not
                devices.append(PciDevice(bdf=reading.bdf, vendor="0x10de", device="", pci_class=""))
        health = self.model.observe(now, wall, tuple(devices), gpus)
        await self._slices()
        by_bdf = {g.bdf: g for g in gpus.readings}
        reports = []
        for pci in devices:
            g = by_bdf.get(pci.bdf)
            uuid = g.uuid if g is not None else ""
            reports.append(DeviceReport(
                pci=pci,
                attributes=dra.attributes(pci, uuid, g.numa_node if g is not None else -1),
                health=health[pci.bdf],
                dra=self.index.match(pci.bdf, uuid),
                uuid=uuid,
                name=g.name if g is not None else "",
            ))
        rules = desired_rules(self.node, reports, wall, self.policy)
        status = self.kube_status
        if not self._announced:
            self._announced = True
            gpus_seen = sum(1 for d in devices if d.is_nvidia_gpu)
            log.info("%d PCI device(s) under %s, %d NVIDIA GPU(s)%s", len(devices), self.settings.sysfs_root,
                     gpus_seen, f" (NVML: {gpus.error})" if gpus.error and gpus_seen else "",
                     extra={"phase": "devices"})
        # Without a good listing of the slices, an empty index would read as
        # "nothing is published" and delete every rule: write nothing then.
        if self.writer is not None and self._slices_ok:
            try:
                await self.writer.sync(rules)
            except (errors.AgentError, TimeoutError) as exc:
                self.writer.actual = None
                self._dra_error = self._dra_error or f"error: DeviceTaintRules: {exc or 'timed out'}"
                log.warning("%s", self._dra_error, extra={"phase": "devices"})
        if self._dra_error:
            status = self._dra_error
        snap = Snapshot(node=self.node, taken_at=wall, devices=tuple(reports), numa_nodes=inv.numa_nodes,
                        rules=rules, dra_status=status)
        self._publish(snap)
        return self._snapshot

    def _publish(self, snap: Snapshot) -> None:
        old = self._snapshot
        if old.generation and dataclasses.replace(old, taken_at=0.0, generation=0) == dataclasses.replace(
            snap, taken_at=0.0, generation=0
        ):
            return
        self._snapshot = dataclasses.replace(snap, generation=old.generation + 1)
        event, self._new = self._new, asyncio.Event()
        event.set()

    # ---- what the API reads -------------------------------------------------

    def snapshot(self) -> Snapshot:
        return self._snapshot

    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in STATES}
        for rep in self._snapshot.devices:
            out[rep.health.state] = out.get(rep.health.state, 0) + 1
        return out

    def tainted(self) -> dict[str, int]:
        """Devices the agent taints, each counted once, under the strongest effect of its taints."""
        strongest: dict[str, int] = {}
        for rule in self._snapshot.rules:
            rank = EFFECTS.index(rule.effect) if rule.effect in EFFECTS else 0
            strongest[rule.bdf] = max(rank, strongest.get(rule.bdf, 0))
        out = {e: 0 for e in EFFECTS}
        for rank in strongest.values():
            out[EFFECTS[rank]] += 1
        return out

    async def watch(self) -> AsyncIterator[Snapshot]:
        """The current snapshot (once there is one), then every new one."""
        seen = 0
        while True:
            event = self._new
            snap = self._snapshot
            if snap.generation > seen:
                seen = snap.generation
                yield snap
                continue
            await event.wait()

    # ---- the loop -----------------------------------------------------------

    async def run(self) -> None:
        # Ends on cancellation, or at the next turn once `stop` says so (a
        # cancellation that a library call swallowed must not keep it going).
        while not self._stopping.is_set():
            try:
                await self.poll()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - logged; the next round tries again
                log.exception("device poll failed", extra={"phase": "devices"})
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.policy.poll_interval):
                    await self._stopping.wait()

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="device-monitor")

    async def stop(self) -> None:
        self._stopping.set()
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        if self._nvml_scan is None or self._nvml_scan.done():
            await asyncio.to_thread(self.nvml.close)
        self._executor.shutdown(wait=False, cancel_futures=True)
