"""Health with hysteresis, DRA matching and DeviceTaintRules against an API server on 127.0.0.1.

The server checks every DeviceTaintRule request (method, path, body) against
the Kubernetes 1.37 schema; the client is the production client.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from conftest import Clock
from devices_fakes import FakeApiServer, SysfsTree, resource_slice
from node_agent.config.schema import Devices, Settings
from node_agent.kubeapi import KubeClient, from_kubeconfig
from node_agent.devices.monitor import DeviceMonitor
from node_agent.devices.nvml import Nvml
from node_agent.devices.ratelimit import TokenBucket
from node_agent.devices.taints import manifest
from node_agent.devices.types import ATTR_PCI_BUS_ID

NODE = "gpu-node-7"
GPU = "0000:41:00.0"
NIC = "0000:81:00.0"


def no_nvml() -> Nvml:
    def missing() -> Any:
        raise ImportError("pynvml")

    return Nvml(loader=missing)


def node_tree(root: Path) -> SysfsTree:
    tree = SysfsTree(root)
    tree.add("0000:40:01.0", host_bridge="pci0000:40", vendor="0x1022", device="0x1483", cls="0x060400",
             driver="pcieport", numa=1)
    # An AMD GPU (hwmon with a critical temperature), published by its DRA driver.
    tree.add(GPU, parent="0000:40:01.0", vendor="0x1002", device="0x74a1", cls="0x038000", driver="amdgpu", numa=1,
             link=("32.0 GT/s PCIe", "32.0 GT/s PCIe", 16, 16), aer=True)
    tree.add_hwmon(GPU, 0, "amdgpu", 45, crit_c=95, label="edge")
    # A NIC that no DRA driver publishes.
    tree.add("0000:80:01.0", host_bridge="pci0000:80", vendor="0x1022", device="0x1483", cls="0x060400",
             driver="pcieport", numa=0)
    tree.add(NIC, parent="0000:80:01.0", vendor="0x15b3", device="0x1021", cls="0x020000", driver="mlx5_core",
             numa=0, link=("32.0 GT/s PCIe", "32.0 GT/s PCIe", 16, 16), aer=True)
    tree.add_net(NIC, "ens1f0np0")
    tree.add_numa(0, "0-31", [10, 21])
    tree.add_numa(1, "32-63", [21, 10])
    return tree


@pytest.fixture
def api() -> Any:
    with FakeApiServer(NODE) as server:
        server.state.slices = [
            resource_slice("gpu-slice", NODE, "gpu.amd.com", NODE,
                           [("gpu-0", {ATTR_PCI_BUS_ID: {"string": GPU}, "productName": {"string": "MI300X"}})]),
            # An older generation of the same pool must be ignored.
            resource_slice("gpu-slice-old", NODE, "gpu.amd.com", NODE,
                           [("stale-gpu", {ATTR_PCI_BUS_ID: {"string": GPU}})], generation=0),
        ]
        for s in server.state.slices:
            kubernetes_validate.validate(s, "1.37.0", strict=True)
        yield server
        assert server.state.problems == []


_made: list[DeviceMonitor] = []


@pytest.fixture(autouse=True)
async def _stop_monitors() -> Any:
    yield
    while _made:
        await _made.pop().stop()


def monitor(tmp_path: Path, api: FakeApiServer, clock: Clock, **policy: Any) -> DeviceMonitor:
    d = Devices(**({"node_name": NODE, "raise_polls": 3, "clear_seconds": 30.0} | policy))
    s = Settings(sysfs_root=str(tmp_path / "sys"), devices=d)
    kube = KubeClient(from_kubeconfig(str(api.kubeconfig(tmp_path / "kubeconfig"))), timeout=5.0)
    m = DeviceMonitor(s, kube=kube, nvml=no_nvml(), clock=clock, wall=clock.wall)
    _made.append(m)
    return m


async def poll(m: DeviceMonitor, clock: Clock, seconds: float = 10.0) -> Any:
    clock.t += seconds
    return await m.poll()


def health(snap: Any, bdf: str) -> Any:
    return next(d for d in snap.devices if d.pci.bdf == bdf).health


async def test_hot_for_n_polls_makes_a_rule_a_spike_does_not_and_recovery_deletes_it(
        tmp_path: Path, api: FakeApiServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    tree = node_tree(tmp_path / "sys")
    clock = Clock()
    m = monitor(tmp_path, api, clock)
    snap = await poll(m, clock)
    assert health(snap, GPU).state == "healthy" and snap.dra_status == "on"
    # The older generation of the pool (stale-gpu) does not count.
    assert [t.device for d in snap.devices if d.pci.bdf == GPU for t in d.dra] == ["gpu-0"]

    # A single spike: no rule, no write.
    tree.set_temp(GPU, 0, 97)
    assert health(await poll(m, clock), GPU).state == "healthy"
    tree.set_temp(GPU, 0, 50)
    assert health(await poll(m, clock), GPU).state == "healthy"
    assert api.state.writes == [] and api.state.rules == {}

    # Hot for raise-polls (3) polls: one rule, effect None.
    tree.set_temp(GPU, 0, 96)
    await poll(m, clock)
    await poll(m, clock)
    assert api.state.rules == {}
    snap = await poll(m, clock)
    h = health(snap, GPU)
    assert h.state == "unhealthy" and [r.reason for r in h.reasons] == ["temperature"]
    assert "amdgpu/edge 96C >= 95C" in h.reasons[0].message
    [rule] = api.state.rules.values()
    assert rule["metadata"]["name"] == f"{NODE}.0000-41-00-0.temperature"
    assert rule["spec"] == {
        "deviceSelector": {"driver": "gpu.amd.com", "pool": NODE, "device": "gpu-0"},
        "taint": {"key": "health.node-agent.io/temperature", "value": "unhealthy", "effect": "None",
                  "timeAdded": rule["spec"]["taint"]["timeAdded"]},
    }
    assert [(w.method, w.path) for w in api.state.writes] == [("POST", "/apis/resource.k8s.io/v1/devicetaintrules")]
    # What `devices taints` prints is what was sent.
    assert [manifest(r) for r in snap.rules] == [api.state.requests[-1].body]
    # Staying hot writes nothing more (effect None: escalation is off by default).
    for _ in range(40):
        await poll(m, clock)
    assert len(api.state.writes) == 1

    # Cool again: the rule stays until the condition has been clear for clear-seconds (30).
    tree.set_temp(GPU, 0, 60)
    await poll(m, clock)
    await poll(m, clock)
    assert len(api.state.rules) == 1 and health(m.snapshot(), GPU).state == "unhealthy"
    snap = await poll(m, clock, 15.0)
    assert health(snap, GPU).state == "healthy" and snap.rules == ()
    assert api.state.rules == {}
    assert api.state.writes[-1].method == "DELETE"
    assert api.state.writes[-1].path == f"/apis/resource.k8s.io/v1/devicetaintrules/{NODE}.0000-41-00-0.temperature"
    text = caplog.text
    assert f"device {GPU} unhealthy: temperature" in text and f"device {GPU} recovered from temperature" in text


async def test_a_narrow_link_with_rising_aer_fatal_is_degraded_with_both_reasons_and_unpublished(
        tmp_path: Path, api: FakeApiServer) -> None:
    tree = node_tree(tmp_path / "sys")
    clock = Clock()
    m = monitor(tmp_path, api, clock)
    await poll(m, clock)
    tree.set_link(NIC, "32.0 GT/s PCIe", "32.0 GT/s PCIe", 8, 16)
    tree.set_aer(NIC, fatal=1)
    snap = await poll(m, clock)
    # The AER rise is an event (counts at once); the narrow link is a level (needs 3 polls).
    assert [r.reason for r in health(snap, NIC).reasons] == ["aer-fatal"]
    tree.set_aer(NIC, fatal=2)
    await poll(m, clock)
    tree.set_aer(NIC, fatal=3)
    snap = await poll(m, clock)
    h = health(snap, NIC)
    assert h.state == "degraded"
    assert {r.reason: r.message for r in h.reasons} == {
        "aer-fatal": "aer_dev_fatal rose from 2 to 3",
        "link-width": "PCIe link x8 of x16",
    }
    nic = next(d for d in snap.devices if d.pci.bdf == NIC)
    assert nic.dra == () and nic.pci.interfaces == ("ens1f0np0",)
    assert snap.rules == () and api.state.writes == []


async def test_escalation_happens_only_as_far_as_the_config_allows(tmp_path: Path, api: FakeApiServer) -> None:
    tree = node_tree(tmp_path / "sys")
    clock = Clock()
    m = monitor(tmp_path, api, clock, max_effect="NoSchedule", escalate_after=60.0)
    assert m.tainted() == {"None": 0, "NoSchedule": 0, "NoExecute": 0}
    tree.set_temp(GPU, 0, 99)
    for _ in range(3):
        await poll(m, clock)
    [rule] = api.state.rules.values()
    assert rule["spec"]["taint"]["effect"] == "None"
    assert m.tainted() == {"None": 1, "NoSchedule": 0, "NoExecute": 0}  # the metric the alert reads
    for _ in range(6):
        await poll(m, clock)
    [rule] = api.state.rules.values()
    assert rule["spec"]["taint"]["effect"] == "NoSchedule"
    assert m.tainted() == {"None": 0, "NoSchedule": 1, "NoExecute": 0}
    put = [w for w in api.state.writes if w.method == "PUT"]
    assert len(put) == 1 and put[0].body["metadata"]["resourceVersion"]
    for _ in range(30):
        await poll(m, clock)
    assert [r["spec"]["taint"]["effect"] for r in api.state.rules.values()] == ["NoSchedule"]
    assert len(api.state.writes) == 2


async def test_a_flapping_device_stays_within_the_write_rate(tmp_path: Path, api: FakeApiServer) -> None:
    tree = node_tree(tmp_path / "sys")
    clock = Clock()
    # No debounce at all, so every poll flips the rule: only the bucket holds the writes back.
    m = monitor(tmp_path, api, clock, write_rate=0.1, write_burst=3, raise_polls=1, clear_seconds=0.0)
    start = clock.t
    for i in range(120):
        tree.set_temp(GPU, 0, 99 if i % 2 == 0 else 40)
        await poll(m, clock, 1.0)
    elapsed = clock.t - start
    writes = len(api.state.writes)
    assert 3 <= writes <= 3 + 0.1 * elapsed, writes
    assert {w.method for w in api.state.writes} == {"POST", "DELETE"}
    assert m.writer is not None and m.writer.deferred <= 1


def test_the_token_bucket() -> None:
    t = [0.0]
    b = TokenBucket(rate=0.5, burst=2, clock=lambda: t[0])
    assert b.try_take() and b.try_take() and not b.try_take()
    t[0] += 1.0
    assert not b.try_take()
    t[0] += 1.0
    assert b.try_take() and not b.try_take()
    t[0] += 100.0
    assert b.tokens == 2.0


async def test_stale_rules_of_this_node_are_deleted_and_other_nodes_rules_kept(tmp_path: Path, api: FakeApiServer) -> None:
    node_tree(tmp_path / "sys")
    clock = Clock()
    from node_agent.devices.types import DraDevice, TaintRule

    def stale(node: str) -> dict[str, Any]:
        r = TaintRule(name=f"{node}.0000-99-00-0.xid", node=node, bdf="0000:99:00.0", reason="xid",
                      target=DraDevice("gpu.amd.com", node, "gpu-9"), key="health.node-agent.io/xid",
                      value="unhealthy", effect="None")
        obj = manifest(r)
        obj["metadata"]["resourceVersion"] = "1"
        return obj

    api.state.rules = {o["metadata"]["name"]: o for o in (stale(NODE), stale("other-node"))}
    m = monitor(tmp_path, api, clock, resync_interval=1.0)
    # While the slices cannot be listed, nothing is known to be unpublished: no writes at all.
    api.state.fail_slices = True
    snap = await poll(m, clock)
    assert snap.dra_status.startswith("error: listing ResourceSlices") and "503" in snap.dra_status
    assert api.state.writes == [] and len(api.state.rules) == 2
    api.state.fail_slices = False
    snap = await poll(m, clock)
    assert snap.dra_status == "on"
    assert list(api.state.rules) == ["other-node.0000-99-00-0.xid"]
    lists = [r for r in api.state.requests if r.method == "GET" and r.path.endswith("/devicetaintrules")]
    assert lists[0].query["labelSelector"] == [f"app.kubernetes.io/managed-by=node-agent,node-agent.io/node={NODE}"]


async def test_rejected_credentials_are_reported_and_devices_still_are(tmp_path: Path, api: FakeApiServer) -> None:
    tree = node_tree(tmp_path / "sys")
    clock = Clock()
    m = monitor(tmp_path, api, clock)
    api.state.token = "rotated"
    tree.set_temp(GPU, 0, 99)
    for _ in range(3):
        snap = await poll(m, clock)
    assert snap.dra_status.startswith("error: listing ResourceSlices") and "401" in snap.dra_status
    assert health(snap, GPU).state == "unhealthy"
    api.state.token = "test-token"
    snap = await poll(m, clock)
    assert snap.dra_status == "on" and len(api.state.rules) == 1


async def test_without_credentials_health_is_reported_and_nothing_is_written(tmp_path: Path) -> None:
    tree = node_tree(tmp_path / "sys")
    clock = Clock()
    s = Settings(sysfs_root=str(tmp_path / "sys"), devices=Devices(node_name=NODE, raise_polls=1))
    m = DeviceMonitor(s, kube=None, kube_status="off: no cluster credentials", nvml=no_nvml(), clock=clock,
                      wall=clock.wall)
    _made.append(m)
    tree.set_temp(GPU, 0, 99)
    snap = await poll(m, clock)
    assert health(snap, GPU).state == "unhealthy" and snap.rules == ()
    assert snap.dra_status == "off: no cluster credentials"
    assert m.counts() == {"healthy": 3, "degraded": 0, "unhealthy": 1, "unmonitored": 0}


def test_rule_names_effects_and_manifests() -> None:
    from node_agent.devices.taints import desired_rules, effect_for, rule_name
    from node_agent.devices.types import DeviceReport, DraDevice, Health, PciDevice, Reason

    a, b = DraDevice("gpu.nvidia.com", NODE, "gpu-0"), DraDevice("other.example.com", "p", "d")
    hot = Reason("temperature", "unhealthy", "hot", since=1000.0)
    slow = Reason("link-width", "degraded", "x8 of x16", since=1000.0)
    rep = DeviceReport(pci=PciDevice(GPU, "0x10de", "0x2335", "0x030200"), attributes={},
                       health=Health("unhealthy", (hot, slow)), dra=(a, b))
    policy = Devices(max_effect="NoExecute", escalate_after=100.0)
    rules = desired_rules(NODE, [rep], 1250.0, policy)
    assert len(rules) == 4 and len({r.name for r in rules}) == 4
    assert {(r.reason, r.effect) for r in rules} == {("temperature", "NoExecute"), ("link-width", "None")}
    for r in rules:
        kubernetes_validate.validate(manifest(r), "1.37.0", strict=True)
    assert effect_for(hot, 1099.0, policy) == "None" and effect_for(hot, 1100.0, policy) == "NoSchedule"
    assert effect_for(hot, 10_000.0, Devices(max_effect="NoSchedule", escalate_after=100.0)) == "NoSchedule"
    assert effect_for(hot, 10_000.0, Devices()) == "None"
    long_node = "n" * 250
    name = rule_name(long_node, GPU, "temperature", a, False)
    assert name.startswith("node-agent-") and len(name) <= 63
    assert name == rule_name(long_node, GPU, "temperature", a, False)


async def test_stop_ends_the_monitor_even_when_a_poll_swallows_the_cancellation(tmp_path: Path) -> None:
    """Python 3.11's wait_for could eat a cancellation that met a finishing call; stop must not hang on it."""
    import asyncio

    node_tree(tmp_path / "sys")
    s = Settings(sysfs_root=str(tmp_path / "sys"), devices=Devices(node_name=NODE, poll_interval=30.0))
    m = DeviceMonitor(s, kube=None, kube_status="off", nvml=no_nvml())
    polls = 0
    entered = asyncio.Event()

    async def stubborn_poll() -> None:
        nonlocal polls
        polls += 1
        entered.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            if polls > 1:
                raise
            # the first one is swallowed, as the buggy wait_for did

    m.poll = stubborn_poll  # type: ignore[method-assign,assignment]
    m.start()
    await entered.wait()
    async with asyncio.timeout(10):
        await m.stop()
    assert polls == 1
