"""The agent's listeners on a real node: mutual TLS and its policy, certificate reload, the local socket's
peer check, health, reflection and metrics after a real checkpoint."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from node_agent._proto.nodeagent.v1 import nodeagent_pb2 as pb
from node_agent._proto.nodeagent.v1 import nodeagent_pb2_grpc as pb_grpc
from tests.monitoring_kit import dashboard_queries, rule_groups, series_names
from tests.socket_probe import probe
from testbed.bed import NODE_AGENT, SHELL_COUNTER, Bed, container_config, make_pod, remove_pod
from tests.pki import Leaf, Pki

GROUP = 4343


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Listening:
    bed: Bed
    pki: Pki
    server: Leaf
    port: int
    health_port: int
    metrics_port: int
    socket: str

    def channel(self, client: Leaf | None, ca: Pki | None = None) -> grpc.Channel:
        key, cert = client.pem() if client else (None, None)
        creds = grpc.ssl_channel_credentials((ca or self.pki).ca_pem(), key, cert)
        return grpc.secure_channel(f"localhost:{self.port}", creds)

    def cli(self, client: Leaf, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [NODE_AGENT, *args, "--server", f"localhost:{self.port}", "--cert", client.cert, "--key", client.key,
             "--ca", self.pki.ca],
            capture_output=True, text=True, timeout=120,
        )

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            return str(r.read().decode())


@pytest.fixture(scope="module")
def listening(bed: Bed) -> Iterator[Listening]:
    """The bed's agent restarted with every listener on, its socket in a directory others may enter."""
    open_dir = Path(tempfile.mkdtemp(prefix="na-listen-"))
    os.chmod(open_dir, 0o755)
    pki = Pki(open_dir / "pki")
    server = pki.server()
    ports = free_port(), free_port(), free_port()
    config = yaml.safe_load(Path(bed.config).read_text())
    config.update({
        "socket": str(open_dir / "agent.sock"), "socket-group": str(GROUP),
        "listen": f"127.0.0.1:{ports[0]}", "tls-cert": server.cert, "tls-key": server.key, "tls-client-ca": pki.ca,
        "health-listen": str(ports[1]), "metrics-listen": f"127.0.0.1:{ports[2]}",
        "authorization": [
            {"identities": ["spiffe://cluster/ns/ops/sa/checkpointer"],
             "methods": ["Checkpoint", "ListCheckpoints", "InspectCheckpoint"], "namespaces": ["tls-ok"]},
        ],
    })
    path = open_dir / "agent.yaml"
    path.write_text(yaml.safe_dump(config))
    saved = bed.config, bed.socket
    bed.stop_agent()
    bed.config, bed.socket = str(path), str(open_dir / "agent.sock")
    try:
        bed.start_agent()
        yield Listening(bed, pki, server, *ports, bed.socket)
    finally:
        bed.stop_agent()
        bed.config, bed.socket = saved
        bed.start_agent()
        shutil.rmtree(open_dir, ignore_errors=True)


def health(channel: grpc.Channel, service: str = "") -> int:
    with channel:
        return int(health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10).status)


def shell_pod(bed: Bed, namespace: str) -> Any:
    cmd = ["sh", "-c", SHELL_COUNTER.format(name="shell")]
    return make_pod(bed, namespace, [container_config("shell", bed.info["images"]["busybox"], cmd)])


def test_tls_refuses_strangers_and_enforces_the_policy(listening: Listening, tmp_path: Path) -> None:
    with pytest.raises(grpc.RpcError) as err:
        health(listening.channel(None))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    rogue = Pki(tmp_path / "rogue", name="rogue CA")
    with pytest.raises(grpc.RpcError) as err:
        health(listening.channel(rogue.client("r", "x", "URI:spiffe://cluster/ns/ops/sa/checkpointer")))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]

    ctl = listening.pki.client("ctl", "controller", "URI:spiffe://cluster/ns/ops/sa/checkpointer")
    other = shell_pod(listening.bed, "tls-other")
    try:
        # The pod's namespace comes from the node's CRI, not from the caller; a pod of a namespace the
        # caller may not act in is not found, exactly as one that does not exist.
        missing = "f" * 64 if other.id != "f" * 64 else "e" * 64
        answers = []
        with listening.channel(ctl) as ch:
            stub = pb_grpc.NodeAgentStub(ch)  # type: ignore[no-untyped-call]
            for ref in (other.id, missing):
                with pytest.raises(grpc.RpcError) as err:
                    list(stub.Checkpoint(pb.CheckpointRequest(pod=ref), timeout=60))
                answers.append((err.value.code(), err.value.details().replace(ref, "<id>")))  # type: ignore[attr-defined]
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Checkpoint(pb.CheckpointRequest(pod=f"tls-other/{other.name}"), timeout=60))
        assert answers[0] == answers[1] and answers[0][0] == grpc.StatusCode.NOT_FOUND, answers
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
        assert err.value.details() == (  # type: ignore[attr-defined]
            "spiffe://cluster/ns/ops/sa/checkpointer may not call Checkpoint for namespace 'tls-other'"
        )
        cp = listening.cli(ctl, "checkpoints", "rm", "sha256:" + "0" * 64)
        assert cp.returncode == 1 and "PERMISSION_DENIED" in cp.stderr and "may not call RemoveCheckpoint" in cp.stderr
        # Nothing of the other pod was written: it is still running, never paused.
        listed = listening.cli(ctl, "checkpoints", "ls", "-o", "json")
        assert listed.returncode == 0, listed.stderr
        assert all(c["pod_namespace"] == "tls-ok" for c in json.loads(listed.stdout or "[]"))
    finally:
        remove_pod(listening.bed, other.id)


def served_fingerprint(listening: Listening, client: Leaf) -> str:
    ctx = ssl.create_default_context(cafile=listening.pki.ca)
    ctx.load_cert_chain(client.cert, client.key)
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", listening.port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
            der = tls.getpeercert(binary_form=True)
    assert der
    return hashlib.sha256(der).hexdigest()


def test_a_renewed_certificate_is_served_without_a_restart(listening: Listening) -> None:
    client = listening.pki.client("renew", "renew")
    pid = listening.bed.agent.pid if listening.bed.agent else 0
    before = served_fingerprint(listening, client)
    renewed = listening.pki.server("renewed")
    for src, dst in ((renewed.key, listening.server.key), (renewed.cert, listening.server.cert)):
        shutil.copyfile(src, dst + ".new")
        os.replace(dst + ".new", dst)
    after = served_fingerprint(listening, client)
    assert after != before
    assert after == hashlib.sha256(ssl.PEM_cert_to_DER_cert(Path(renewed.cert).read_text())).hexdigest()
    assert listening.bed.agent is not None and listening.bed.agent.pid == pid and listening.bed.agent.poll() is None


def test_the_local_socket_refuses_a_peer_outside_the_group(listening: Listening) -> None:
    sock = listening.socket
    nobody = ("--reuid=nobody", "--regid=nogroup", "--clear-groups")
    assert probe(sock, "--reuid=0") == "OK"
    assert probe(sock, "--reuid=nobody", "--regid=nogroup", f"--groups={GROUP}") == "OK"
    assert probe(sock, *nobody).startswith("UNAVAILABLE")  # the file mode (0660 root:GROUP)
    os.chmod(sock, 0o666)
    try:
        refused = probe(sock, *nobody)  # the peer check, where the mode would let it in
    finally:
        os.chmod(sock, 0o660)
    assert refused.startswith("PERMISSION_DENIED") and f"admits only root and group {GROUP}" in refused
    cp = subprocess.run(["setpriv", *nobody, NODE_AGENT, "checkpoints", "ls", "--socket", sock],
                        capture_output=True, text=True, timeout=60, cwd="/")
    assert cp.returncode != 0


def test_health_reflection_and_metrics_after_a_checkpoint(listening: Listening) -> None:
    ctl = listening.pki.client("ctl2", "controller", "URI:spiffe://cluster/ns/ops/sa/checkpointer")
    serving = health_pb2.HealthCheckResponse.SERVING
    assert health(listening.channel(ctl)) == serving
    assert health(listening.channel(ctl), "nodeagent.v1.NodeAgent") == serving
    assert health(grpc.insecure_channel(f"127.0.0.1:{listening.health_port}")) == serving
    assert health(grpc.insecure_channel("unix://" + listening.socket), "nodeagent.v1.NodeAgent") == serving
    for ch in (listening.channel(ctl), grpc.insecure_channel("unix://" + listening.socket)):
        with ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                timeout=10)
            names = {s.name for r in replies for s in r.list_services_response.service}
        assert {"nodeagent.v1.NodeAgent", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names

    def count(text: str, name: str, **labels: str) -> float:
        found = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == name and s.labels == labels]
        assert found, f"no {name}{labels} in\n{text}"
        return float(found[0])

    before = listening.metrics()
    pod = shell_pod(listening.bed, "tls-ok")
    try:
        cp = listening.cli(ctl, "checkpoint", "tls-ok/" + pod.name, "-o", "json")
        assert cp.returncode == 0, cp.stderr
        info = json.loads(cp.stdout)
        assert info["pod_namespace"] == "tls-ok"
        after = listening.metrics()
    finally:
        remove_pod(listening.bed, pod.id)
    for name in ("node_agent_checkpoint_duration_seconds_count", "node_agent_checkpoint_frozen_seconds_count"):
        assert count(after, name) == count(before, name) + 1
    assert count(after, "node_agent_checkpoint_duration_seconds_sum") > count(before, "node_agent_checkpoint_duration_seconds_sum")
    frozen = count(after, "node_agent_checkpoint_frozen_seconds_sum") - count(before, "node_agent_checkpoint_frozen_seconds_sum")
    assert frozen == pytest.approx(info["frozen_ms"] / 1000, abs=0.002)
    assert count(after, "node_agent_checkpoint_bytes_written_total") + count(
        after, "node_agent_checkpoint_bytes_deduplicated_total") > 0
    assert count(after, "node_agent_store_size_bytes") >= 0  # measured at most every 10 s
    # Devices by health state: this machine's real PCI devices are counted.
    for state in ("healthy", "degraded", "unhealthy", "unmonitored"):
        assert count(after, "node_agent_devices", health=state).is_integer(), state


class Prometheus:
    """Debian's prometheus on loopback, scraping the agent as deploy/monitoring/'s PodMonitor has it (job
    "node-agent", the node's name), every second, with the kit's alert rules loaded."""

    def __init__(self, root: Path, metrics_port: int, node: str) -> None:
        self.port = free_port()
        (root / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups()}))
        (root / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(root / "rules.yaml")],
            "scrape_configs": [{"job_name": "node-agent", "static_configs": [
                {"targets": [f"127.0.0.1:{metrics_port}"], "labels": {"node": node}}]}],
        }))
        self.log = open(root / "prometheus.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=root)

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as r:
            doc = json.loads(r.read())
        assert doc["status"] == "success", doc
        return doc["data"]

    def values(self, query: str) -> dict[str, float]:
        """The query's result now: each series (its labels, as text) and its value."""
        return {json.dumps(r["metric"], sort_keys=True): float(r["value"][1])
                for r in self.api("query", query=query)["result"]}

    def until(self, what: str, check: Any, timeout: float = 60.0) -> Any:
        """Ask `check()` again (every 0.2 s) until it returns something true; that, or fail naming `what`."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "prometheus ended: " + self.tail()
            try:
                last = check()
            except (OSError, ValueError) as exc:  # not listening yet
                last = exc
            else:
                if last:
                    return last
            time.sleep(0.2)
        raise AssertionError(f"{what}: not within {timeout:g}s (last: {last!r}); prometheus: {self.tail()}")

    def tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def test_prometheus_scrapes_the_agent_and_real_operations_move_the_kits_series_and_alerts(
        listening: Listening, tmp_path: Path) -> None:
    node = "bed-node"
    prom = Prometheus(tmp_path, listening.metrics_port, node)
    try:
        prom.until("the agent scraped", lambda: prom.values('up{job="node-agent"}') == {
            json.dumps({"__name__": "up", "instance": f"127.0.0.1:{listening.metrics_port}", "job": "node-agent",
                        "node": node}, sort_keys=True): 1.0})

        def total(name: str) -> float:
            found = prom.values(f'sum({name}{{job="node-agent", node="{node}"}})')
            return next(iter(found.values())) if found else -1.0

        before = {n: prom.until(n, lambda n=n: total(n) + 1) - 1 for n in (
            "node_agent_checkpoints_total", "node_agent_checkpoint_frozen_seconds_count")}
        ctl = listening.pki.client("ctl3", "controller", "URI:spiffe://cluster/ns/ops/sa/checkpointer")
        pod = shell_pod(listening.bed, "tls-ok")
        try:
            cp = listening.cli(ctl, "checkpoint", "tls-ok/" + pod.name, "-o", "json")
            assert cp.returncode == 0, cp.stderr
        finally:
            remove_pod(listening.bed, pod.id)
        for name, was in before.items():
            prom.until(f"{name} to count the checkpoint", lambda name=name, was=was: total(name) == was + 1)
        # A restore of a checkpoint that is not there: a real failure, which the kit's alert reports.
        cp = subprocess.run([NODE_AGENT, "restore", "sha256:" + "0" * 64, "--socket", listening.socket],
                            capture_output=True, text=True, timeout=120)
        assert cp.returncode != 0 and "NOT_FOUND" in cp.stderr, cp.stderr

        def firing() -> list[dict[str, str]]:
            return [a["labels"] for a in prom.api("alerts")["alerts"]
                    if a["labels"]["alertname"] == "NodeAgentRestoresFailing" and a["state"] == "firing"]

        assert prom.until("NodeAgentRestoresFailing to fire", firing) == [
            {"alertname": "NodeAgentRestoresFailing", "node": node, "operation": "restore", "reason": "NOT_FOUND",
             "severity": "warning"}]
        down = [a for a in prom.api("alerts")["alerts"] if a["labels"]["alertname"] in ("NodeAgentDown",
                                                                                        "NodeAgentMissing")]
        assert down == []
        # Every series the dashboard reads is there, and every one of its queries runs.
        for query in dashboard_queries():
            prom.api("query", query=query.replace("[2m]", "[10s]"))
            for name in series_names(query):
                assert prom.values(f'count({name}{{job="node-agent", node="{node}"}})'), (name, query)
    finally:
        prom.stop()
    assert prom.proc.returncode is not None
