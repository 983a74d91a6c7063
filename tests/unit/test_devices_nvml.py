"""The NVML path against a stand-in with pynvml's interface: readings, Xid events, unmonitored GPUs."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pynvml
import pytest

from conftest import Clock
from devices_fakes import FakeApiServer, FakeGpu, FakePynvml, SysfsTree, resource_slice
from node_agent.config.schema import Devices, Settings
from node_agent.kubeapi import KubeClient, from_kubeconfig
from node_agent.devices.monitor import DeviceMonitor
from node_agent.devices.nvml import Nvml, normalize_bus_id
from node_agent.devices.types import ATTR_NUMA_NODE, ATTR_NVIDIA_UUID, ATTR_PCI_BUS_ID, ATTR_PCIE_ROOT

NODE = "dgx-3"
GPU0, GPU1 = "0000:41:00.0", "0000:c1:00.0"
UUID0, UUID1 = "GPU-5d3a7c1e-0b1f-4b4e-9f7e-1a2b3c4d5e6f", "GPU-0f9e8d7c-6b5a-4321-8765-abcdefabcdef"


def gpu_tree(root: Path) -> None:
    tree = SysfsTree(root)
    tree.add("0000:40:01.0", host_bridge="pci0000:40", cls="0x060400", vendor="0x1022", driver="pcieport")
    # sysfs does not know the NUMA node here (-1); NVML does.
    tree.add(GPU0, parent="0000:40:01.0", driver="nvidia", numa=-1)
    tree.add("0000:c0:01.0", host_bridge="pci0000:c0", cls="0x060400", vendor="0x1022", driver="pcieport")
    tree.add(GPU1, parent="0000:c0:01.0", driver="nvidia", numa=1)


def fake(*gpus: FakeGpu, **kw: Any) -> FakePynvml:
    return FakePynvml(list(gpus), **kw)


def two_gpus() -> FakePynvml:
    return fake(FakeGpu("00000000:41:00.0", UUID0, numa=0), FakeGpu("00000000:C1:00.0", UUID1, numa=1))


def make_monitor(tmp_path: Path, nv: Any, clock: Clock, api: FakeApiServer | None = None, **policy: Any) -> DeviceMonitor:
    gpu_tree(tmp_path / "sys")
    s = Settings(sysfs_root=str(tmp_path / "sys"), devices=Devices(**({"node_name": NODE, "raise_polls": 2} | policy)))
    kube = KubeClient(from_kubeconfig(str(api.kubeconfig(tmp_path / "kc")))) if api else None
    loader = nv if callable(nv) and not isinstance(nv, FakePynvml) else (lambda: nv)
    return DeviceMonitor(s, kube=kube, nvml=Nvml(loader=loader, clock=clock), clock=clock, wall=clock.wall)


def by_bdf(snap: Any) -> dict[str, Any]:
    return {d.pci.bdf: d for d in snap.devices}


def test_bus_ids_are_normalised_to_the_sysfs_form() -> None:
    assert normalize_bus_id(b"00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_bus_id("0001:C1:00.1") == "0001:c1:00.1"
    assert normalize_bus_id(b"\xff garbage") == "" and normalize_bus_id("0000:3b:00") == ""


async def test_readings_attributes_and_a_uuid_match(tmp_path: Path) -> None:
    clock = Clock()
    with FakeApiServer(NODE) as api:
        # NVIDIA's driver publishes `uuid` (and here no pciBusID) for each GPU.
        api.state.slices = [resource_slice("nv", NODE, "gpu.nvidia.com", NODE, [
            ("gpu-0", {"uuid": {"string": UUID0}, "productName": {"string": "NVIDIA H200"}}),
            ("gpu-1", {"uuid": {"string": UUID1}}),
        ])]
        nv = two_gpus()
        m = make_monitor(tmp_path, nv, clock, api)
        try:
            snap = await m.poll()
        finally:
            await m.stop()
        assert api.state.problems == []
    devs = by_bdf(snap)
    g0 = devs[GPU0]
    assert g0.uuid == UUID0 and g0.name == "NVIDIA H200" and g0.health.state == "healthy"
    assert g0.attributes == {ATTR_PCI_BUS_ID: GPU0, ATTR_PCIE_ROOT: "pci0000:40", ATTR_NUMA_NODE: 0,
                             ATTR_NVIDIA_UUID: UUID0}
    assert [(d.driver, d.pool, d.device) for d in g0.dra] == [("gpu.nvidia.com", NODE, "gpu-0")]
    assert [d.device for d in devs[GPU1].dra] == ["gpu-1"] and devs[GPU1].attributes[ATTR_NUMA_NODE] == 1
    assert nv.registered == {0, 1} and not nv.initialized  # stop() shut NVML down


async def test_health_signals_from_nvml(tmp_path: Path) -> None:
    clock = Clock()
    nv = two_gpus()
    m = make_monitor(tmp_path, nv, clock)
    try:
        nv.gpus[0].temperature, nv.gpus[0].ecc_volatile = 88, 2
        nv.gpus[1].remapped = (0, 3, 1, 1)
        nv.gpus[1].recovery_action = pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET
        nv.gpus[1].pages_pending = pynvml.NVML_FEATURE_ENABLED
        await m.poll()
        clock.t += 10
        devs = by_bdf(await m.poll())
    finally:
        await m.stop()
    h0, h1 = devs[GPU0].health, devs[GPU1].health
    assert h0.state == "unhealthy"
    assert {r.reason: r.message for r in h0.reasons} == {
        "temperature": "GPU 88C >= slowdown 87C",
        "ecc-uncorrected": "2 uncorrected ECC error(s) since the driver loaded",
    }
    assert {r.reason: r.severity for r in h1.reasons} == {
        "row-remap-failure": "unhealthy", "recovery-action": "unhealthy", "retired-pages-pending": "degraded",
    }
    assert "GPU reset" in next(r.message for r in h1.reasons if r.reason == "recovery-action")


async def wait_for(pred: Any, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.02)


async def test_critical_xids_count_at_once_and_ignored_ones_never(tmp_path: Path) -> None:
    clock = Clock()
    nv = two_gpus()
    m = make_monitor(tmp_path, nv, clock, raise_polls=5, clear_seconds=20.0)
    try:
        await m.poll()
        assert m.nvml._thread is not None and m.nvml._thread.is_alive()
        nv.xid(1, 13)  # an application error: on the ignore list
        nv.xid(1, 43)
        await wait_for(lambda: nv.events.empty())
        await asyncio.sleep(0.1)
        clock.t += 10
        assert by_bdf(await m.poll())[GPU1].health.state == "healthy"
        nv.xid(1, 79)  # fallen off the bus
        await wait_for(lambda: nv.events.empty())
        await asyncio.sleep(0.1)
        clock.t += 10
        h = by_bdf(await m.poll())[GPU1].health
        assert h.state == "unhealthy" and [(r.reason, r.message) for r in h.reasons] == [("xid", "Xid 79")]
        assert by_bdf(m.snapshot())[GPU0].health.state == "healthy"
        # No new Xid for clear-seconds: recovered.
        clock.t += 10
        assert by_bdf(await m.poll())[GPU1].health.state == "unhealthy"
        clock.t += 15
        assert by_bdf(await m.poll())[GPU1].health.state == "healthy"
    finally:
        await m.stop()
    assert m.nvml._thread is None


@pytest.mark.parametrize("case", ["module-missing", "library-missing", "gpu-lost"])
async def test_gpus_nvml_cannot_watch_are_unmonitored_never_healthy(tmp_path: Path, case: str) -> None:
    clock = Clock()
    if case == "module-missing":
        def nv() -> Any:
            raise ImportError("No module named 'pynvml'")
        want = "nvidia-ml-py is not installed"
    elif case == "library-missing":
        nv = fake(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)  # type: ignore[assignment]
        want = "NVML Shared Library Not Found"
    else:
        nv = two_gpus()  # type: ignore[assignment]
        nv.gpus[1].lost = True  # type: ignore[attr-defined]
        want = "GPU is lost"
    m = make_monitor(tmp_path, nv, clock)
    try:
        devs = by_bdf(await m.poll())
    finally:
        await m.stop()
    lost = devs[GPU1].health
    assert lost.state == "unmonitored" and want in lost.unmonitored
    if case == "gpu-lost":
        assert devs[GPU0].health.state == "healthy"
    else:
        assert devs[GPU0].health.state == "unmonitored"
    # The root ports are not GPUs: plain healthy.
    assert devs["0000:40:01.0"].health.state == "healthy"
    assert m.counts()["unmonitored"] == (1 if case == "gpu-lost" else 2)


def test_nvml_init_is_retried_but_not_on_every_scan() -> None:
    t = [0.0]
    calls = []

    def loader() -> Any:
        calls.append(t[0])
        raise ImportError("pynvml")

    n = Nvml(loader=loader, clock=lambda: t[0])
    assert n.scan().error and n.scan().error
    t[0] += 61
    n.scan()
    assert calls == [0.0, 61.0]


def test_the_real_pynvml_without_a_driver_reports_why() -> None:
    n = Nvml()  # the real nvidia-ml-py module
    scan = n.scan()
    if not scan.error:  # a machine with a GPU and its driver
        assert scan.readings and all(r.bdf for r in scan.readings)
        n.close()
        return
    assert scan.error.startswith("nvmlInit failed: ") and scan.readings == ()


def test_check_nvml_says_clearly_when_there_is_no_gpu() -> None:
    import subprocess

    script = Path(__file__).resolve().parents[2] / "scripts" / "check-nvml"
    cp = subprocess.run([str(script), "--xid-seconds", "0"], capture_output=True, text=True, timeout=60)
    if cp.returncode == 0:  # a machine with a GPU: the inventory is printed
        assert "GPU(s) through NVML" in cp.stderr and cp.stdout.strip()
        return
    assert cp.returncode == 2, cp.stderr
    assert cp.stderr.startswith("check-nvml: NVML is not usable here: nvmlInit failed")


async def test_a_hung_nvml_makes_gpus_unmonitored_and_is_not_called_again_meanwhile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from node_agent.devices import monitor as monitor_module

    monkeypatch.setattr(monitor_module, "NVML_TIMEOUT", 0.2)
    clock = Clock()
    nv = two_gpus()
    release = threading.Event()
    reads = []
    real = nv.nvmlDeviceGetTemperature

    def hanging(handle: Any, sensor: int) -> int:
        reads.append(handle.index)
        release.wait(10)
        return real(handle, sensor)

    m = make_monitor(tmp_path, nv, clock)
    try:
        await m.poll()
        nv.nvmlDeviceGetTemperature = hanging  # type: ignore[method-assign]
        for _ in range(3):
            clock.t += 10
            devs = by_bdf(await m.poll())
            assert devs[GPU0].health.state == "unmonitored" and "NVML has not answered" in devs[GPU0].health.unmonitored
        assert reads == [0]  # one stuck scan, not three
        release.set()
        await wait_for(lambda: m._nvml_scan is not None and m._nvml_scan.done())
        nv.nvmlDeviceGetTemperature = real  # type: ignore[method-assign]
        clock.t += 10
        assert by_bdf(await m.poll())[GPU0].health.state == "healthy"
    finally:
        release.set()
        await m.stop()


async def test_a_broken_binding_leaves_the_gpu_unmonitored_and_the_poll_alive(tmp_path: Path) -> None:
    clock = Clock()
    nv = two_gpus()

    def broken(handle: Any) -> str:
        raise RuntimeError("ctypes says no")

    nv.nvmlDeviceGetUUID = broken  # type: ignore[method-assign]
    m = make_monitor(tmp_path, nv, clock)
    try:
        devs = by_bdf(await m.poll())
    finally:
        await m.stop()
    assert {devs[b].health.state for b in (GPU0, GPU1)} == {"unmonitored"}
    assert "ctypes says no" in devs[GPU0].health.unmonitored


async def test_stopping_the_monitor_while_nvml_hangs_returns_at_once(tmp_path: Path) -> None:
    import threading

    clock = Clock()
    nv = two_gpus()
    release = threading.Event()
    entered = threading.Event()

    def hanging() -> int:
        entered.set()
        release.wait(10)
        return 2

    nv.nvmlDeviceGetCount = hanging  # type: ignore[method-assign]
    m = make_monitor(tmp_path, lambda: nv, clock)
    m.start()
    try:
        await asyncio.to_thread(entered.wait, 5)
        started = time.monotonic()
        await asyncio.wait_for(m.stop(), 5)
        assert time.monotonic() - started < 2.0
        assert m._task is None
    finally:
        release.set()


def test_a_gpu_without_a_slowdown_threshold_is_held_to_temperature_max() -> None:
    from node_agent.devices.health import gpu_signals
    from node_agent.devices.types import GpuReading

    policy = Devices(temperature_max=80.0, temperature_margin=2.0)
    assert gpu_signals(GpuReading(bdf=GPU0, temperature=77.0), policy) == []
    [sig] = gpu_signals(GpuReading(bdf=GPU0, temperature=78.0), policy)
    assert sig.reason == "temperature" and sig.message == "GPU 78C >= temperature-max 80C"
    [sig] = gpu_signals(GpuReading(bdf=GPU0, temperature=85.0, slowdown_celsius=87.0), policy)
    assert sig.message == "GPU 85C >= slowdown 87C"
