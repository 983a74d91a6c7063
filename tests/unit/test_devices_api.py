"""ListDevices and WatchDevices with a real gRPC client, the `devices` CLI through it, config and metrics."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, AsyncIterator

import grpc
import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from devices_fakes import FakeApiServer, SysfsTree, resource_slice
from node_agent._proto.nodeagent.v1 import nodeagent_pb2 as pb
from node_agent._proto.nodeagent.v1 import nodeagent_pb2_grpc as pb_grpc
from node_agent.api.agent import AgentServicer
from node_agent.cli.main import main as cli
from node_agent.config.loading import from_mapping
from node_agent.config.schema import Devices, Settings
from node_agent.kubeapi import KubeClient, from_kubeconfig
from node_agent.devices.monitor import DeviceMonitor
from node_agent.devices.nvml import Nvml
from node_agent.errors import InvalidArgument
from node_agent.metrics import Metrics

NODE = "worker-1"
GPU = "0000:41:00.0"


def no_nvml() -> Nvml:
    def missing() -> Any:
        raise ImportError("pynvml")

    return Nvml(loader=missing)


class Daemon:
    """The servicer on a real unix socket with a device monitor over a synthetic tree."""

    def __init__(self, root: Path, api: FakeApiServer | None) -> None:
        self.tree = SysfsTree(root / "sys")
        self.tree.add("0000:40:01.0", host_bridge="pci0000:40", vendor="0x1022", device="0x1483", cls="0x060400",
                      driver="pcieport", numa=1)
        self.tree.add(GPU, parent="0000:40:01.0", vendor="0x1002", device="0x74a1", cls="0x038000", driver="amdgpu",
                      numa=1)
        self.tree.add_hwmon(GPU, 0, "amdgpu", 40, crit_c=95, label="edge")
        self.tree.add_numa(0, "0-7", [10, 20])
        self.tree.add_numa(1, "8-15", [20, 10])
        self.socket = str(root / "agent.sock")
        self.settings = Settings(sysfs_root=str(root / "sys"), socket=self.socket,
                                 devices=Devices(node_name=NODE, raise_polls=1, clear_seconds=0.0))
        kube = KubeClient(from_kubeconfig(str(api.kubeconfig(root / "kc")))) if api else None
        self.monitor = DeviceMonitor(self.settings, kube=kube, nvml=no_nvml())

    async def __aenter__(self) -> "Daemon":
        checkpointer = SimpleNamespace(settings=self.settings)
        self.servicer = AgentServicer(checkpointer, None, None, lambda dry_run=False: None,  # type: ignore[arg-type]
                                      transfers=None, rekeyer=None, devices=self.monitor)  # type: ignore[arg-type]
        self.server = grpc.aio.server()
        pb_grpc.add_NodeAgentServicer_to_server(self.servicer, self.server)  # type: ignore[no-untyped-call]
        self.server.add_insecure_port("unix://" + self.socket)
        await self.server.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.server.stop(grace=1)
        await self.monitor.stop()


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[Daemon]:
    with FakeApiServer(NODE) as api:
        api.state.slices = [resource_slice("s", NODE, "gpu.amd.com", NODE,
                                           [("gpu-0", {"resource.kubernetes.io/pciBusID": {"string": GPU}})])]
        async with Daemon(tmp_path, api) as d:
            yield d
        assert api.state.problems == []


async def test_watch_streams_complete_snapshots_to_a_real_client(daemon: Daemon) -> None:
    await daemon.monitor.poll()
    async with grpc.aio.insecure_channel("unix://" + daemon.socket) as ch:
        stub = pb_grpc.NodeAgentStub(ch)  # type: ignore[no-untyped-call]
        listed = await stub.ListDevices(pb.ListDevicesRequest(), timeout=10)
        assert listed.node == NODE and listed.generation == 1 and listed.dra_status == "on"
        call = stub.WatchDevices(pb.WatchDevicesRequest(), timeout=30)
        first = await asyncio.wait_for(call.read(), 10)
        assert first == listed
        gpu = next(d for d in first.devices if d.bdf == GPU)
        assert gpu.health.state == "healthy" and gpu.attributes["resource.kubernetes.io/numaNode"].int_value == 1
        assert gpu.attributes["resource.kubernetes.io/pcieRoot"].string_value == "pci0000:40"
        assert [r.device for r in gpu.dra] == ["gpu-0"]
        assert [(n.id, n.cpulist, list(n.distances)) for n in first.numa_nodes] == [(0, "0-7", [10, 20]), (1, "8-15", [20, 10])]
        # The GPU overheats: the next snapshot is complete and carries the rule.
        daemon.tree.set_temp(GPU, 0, 99)
        await daemon.monitor.poll()
        second = await asyncio.wait_for(call.read(), 10)
        assert second.generation == 2 and len(second.devices) == len(first.devices)
        gpu = next(d for d in second.devices if d.bdf == GPU)
        assert gpu.health.state == "unhealthy" and [r.reason for r in gpu.health.reasons] == ["temperature"]
        assert [(r.reason, r.effect, r.target.device) for r in second.taint_rules] == [("temperature", "None", "gpu-0")]
        # The client goes away: the server's stream ends with it.
        call.cancel()
    await asyncio.sleep(0.1)


async def test_the_devices_cli_through_the_daemon(daemon: Daemon, capsys: pytest.CaptureFixture[str]) -> None:
    daemon.tree.set_temp(GPU, 0, 99)
    await daemon.monitor.poll()

    async def run(*argv: str) -> str:
        capsys.readouterr()
        assert await asyncio.to_thread(cli, [*argv, "--socket", daemon.socket]) == 0
        return capsys.readouterr().out

    doc = json.loads(await run("devices", "ls", "-o", "json"))
    gpu = next(d for d in doc["devices"] if d["bdf"] == GPU)
    assert {k: gpu[k] for k in ("bdf", "vendor", "device", "class", "driver")} == {
        "bdf": GPU, "vendor": "0x1002", "device": "0x74a1", "class": "0x038000", "driver": "amdgpu"}
    assert gpu["attributes"] == {
        "resource.kubernetes.io/numaNode": {"int": 1},
        "resource.kubernetes.io/pciBusID": {"string": GPU},
        "resource.kubernetes.io/pcieRoot": {"string": "pci0000:40"},
    }
    assert gpu["health"]["state"] == "unhealthy" and gpu["health"]["reasons"][0]["reason"] == "temperature"
    assert gpu["dra"] == {"published": True, "devices": [{"driver": "gpu.amd.com", "pool": NODE, "device": "gpu-0"}]}
    port = next(d for d in doc["devices"] if d["bdf"] == "0000:40:01.0")
    assert port["dra"]["published"] is False and port["health"] == {"state": "healthy", "reasons": []}
    assert yaml.safe_load(await run("devices", "ls", "-o", "yaml")) == doc
    table = await run("devices", "ls")
    assert table.splitlines()[0].split() == ["BDF", "ID", "CLASS", "DRIVER", "NUMA", "ROOT", "HEALTH", "REASONS", "DRA"]
    assert any(GPU in line and "unhealthy" in line and "gpu.amd.com/worker-1/gpu-0" in line for line in table.splitlines())
    assert any("0000:40:01.0" in line and "unpublished" in line for line in table.splitlines())
    # `devices taints` prints what kubectl apply takes, and what the 1.37 schema accepts.
    docs = list(yaml.safe_load_all(await run("devices", "taints", "-o", "yaml")))
    assert len(docs) == 1 and docs[0]["kind"] == "DeviceTaintRule"
    for d in docs:
        kubernetes_validate.validate(d, "1.37.0", strict=True)
    assert docs[0]["spec"]["taint"] == {"key": "health.node-agent.io/temperature", "value": "unhealthy", "effect": "None"}
    listed = json.loads(await run("devices", "taints", "-o", "json"))
    assert listed["kind"] == "List" and listed["items"] == docs


async def test_list_devices_says_when_monitoring_is_off(tmp_path: Path) -> None:
    d = Daemon(tmp_path, None)
    d.monitor = None  # type: ignore[assignment]
    checkpointer = SimpleNamespace(settings=d.settings)
    servicer = AgentServicer(checkpointer, None, None, lambda dry_run=False: None,  # type: ignore[arg-type]
                             transfers=None, rekeyer=None)  # type: ignore[arg-type]
    server = grpc.aio.server()
    pb_grpc.add_NodeAgentServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    server.add_insecure_port("unix://" + d.socket)
    await server.start()
    try:
        async with grpc.aio.insecure_channel("unix://" + d.socket) as ch:
            stub = pb_grpc.NodeAgentStub(ch)  # type: ignore[no-untyped-call]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ListDevices(pb.ListDevicesRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.WatchDevices(pb.WatchDevicesRequest(), timeout=10):
                    pass
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        await server.stop(grace=1)


async def test_the_monitor_loop_starts_and_stops_and_feeds_metrics(tmp_path: Path) -> None:
    d = Daemon(tmp_path, None)
    d.monitor = DeviceMonitor(
        Settings(sysfs_root=d.settings.sysfs_root, devices=Devices(node_name=NODE, poll_interval=0.05)), nvml=no_nvml())
    metrics = Metrics()
    metrics.device_health = d.monitor.counts
    d.monitor.start()
    try:
        seen = []
        async with asyncio.timeout(10):
            async for snap in d.monitor.watch():
                seen.append(snap.generation)
                if len(seen) == 1:
                    # Unchanged rounds publish nothing; a change does.
                    d.tree.set_temp(GPU, 0, 41)
                else:
                    break
        assert seen == [1, 2]
    finally:
        await d.monitor.stop()
    assert d.monitor._task is None
    by_health = devices_by_health(await asyncio.to_thread(metrics.render))
    assert (by_health["healthy"], by_health["unmonitored"]) == (2, 0)


def devices_by_health(text: str) -> dict[str, float]:
    """`node_agent_devices` of an exposition, parsed by prometheus_client's parser: health -> count."""
    return {s.labels["health"]: s.value for f in text_string_to_metric_families(text) if f.name == "node_agent_devices"
            for s in f.samples}


def test_the_devices_config_section() -> None:
    s = from_mapping({"sysfs-root": "/host/sys", "devices": {
        "poll-interval": 5, "raise-polls": 4, "clear-seconds": 0, "xid-ignore": [13, 31], "max-effect": "NoSchedule",
        "kubeconfig": "/etc/node-agent/kubeconfig", "check-link-speed": True, "write-rate": 0.5, "write-burst": 5,
    }})
    d = s.devices
    assert s.sysfs_root == "/host/sys"
    assert (d.poll_interval, d.raise_polls, d.clear_seconds, d.xid_ignore, d.max_effect) == (5.0, 4, 0.0, (13, 31), "NoSchedule")
    assert d.check_link_speed and d.kubeconfig == "/etc/node-agent/kubeconfig" and (d.write_rate, d.write_burst) == (0.5, 5)
    assert Devices().xid_ignore == (13, 31, 43, 45, 68, 109) and Devices().max_effect == "None"
    for bad, msg in (
        ({"devices": {"nope": 1}}, "unknown config key 'devices.nope'"),
        ({"devices": {"max-effect": "PreferNoSchedule"}}, "max-effect"),
        ({"devices": {"raise-polls": 0}}, "raise-polls"),
        ({"devices": {"xid-ignore": "13"}}, "xid-ignore"),
        ({"devices": {"taints": "yes"}}, "true or false"),
        ({"devices": []}, "mapping"),
        ({"sysfs-root": "relative/sys"}, "absolute"),
    ):
        with pytest.raises(InvalidArgument, match=msg):
            from_mapping(bad)


def test_the_daemon_serves_devices_from_another_sysfs_root_and_writes_rules(tmp_path: Path) -> None:
    """`serve --sysfs-root` with a `devices:` config: the CLI, the metrics and the API server see it."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    node_agent = str(Path(sys.executable).parent / "node-agent")
    with FakeApiServer(NODE) as api:
        api.state.slices = [resource_slice("s", NODE, "gpu.amd.com", NODE,
                                           [("gpu-0", {"resource.kubernetes.io/pciBusID": {"string": GPU}})])]
        d = Daemon(tmp_path, None)
        d.tree.set_temp(GPU, 0, 99)
        config = tmp_path / "config.yaml"
        config.write_text(yaml.safe_dump({"devices": {
            "node-name": NODE, "poll-interval": 0.2, "raise-polls": 2, "kubeconfig": str(api.kubeconfig(tmp_path / "kc")),
        }}))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            metrics_port = s.getsockname()[1]
        sock = str(tmp_path / "agent.sock")
        cmd = [node_agent, "serve", "--config", str(config), "--socket", sock, "--store", str(tmp_path / "store"),
               "--cri-endpoint", f"unix://{tmp_path}/no-containerd.sock", "--sysfs-root", str(tmp_path / "sys"),
               "--metrics-listen", str(metrics_port)]
        with open(tmp_path / "agent.log", "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
        env = dict(os.environ, NODE_AGENT_SOCKET=sock)
        try:
            deadline = time.monotonic() + 60
            while not api.state.rules:
                assert time.monotonic() < deadline, (tmp_path / "agent.log").read_text()
                assert proc.poll() is None, (tmp_path / "agent.log").read_text()
                time.sleep(0.1)
            cp = subprocess.run([node_agent, "devices", "ls", "-o", "json"], capture_output=True, text=True, env=env,
                                timeout=60)
            assert cp.returncode == 0, cp.stderr
            doc = json.loads(cp.stdout)
            assert doc["node"] == NODE and doc["dra_status"] == "on"
            assert {d["bdf"]: d["health"]["state"] for d in doc["devices"]} == {"0000:40:01.0": "healthy", GPU: "unhealthy"}
            [rule] = api.state.rules.values()
            assert rule["spec"]["deviceSelector"] == {"driver": "gpu.amd.com", "pool": NODE, "device": "gpu-0"}
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as resp:
                text = resp.read().decode()
            by_health = devices_by_health(text)
            assert (by_health["unhealthy"], by_health["healthy"]) == (1, 1)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0, (tmp_path / "agent.log").read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert api.state.problems == []
    assert "device monitor for node worker-1" in (tmp_path / "agent.log").read_text()
