"""Test-bed helpers: a private containerd "node", the agent, and pods on it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator, TypeVar

import msgspec

from node_agent.cri import CriClient
from testbed.layout import BedLayout

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
NODE_AGENT = str(VENV_BIN / "node-agent")
T = TypeVar("T")


def run(coro_fn: Callable[[CriClient], Awaitable[T]], endpoint: str) -> T:
    async def go() -> T:
        cri = CriClient(endpoint, timeout=60)
        try:
            return await coro_fn(cri)
        finally:
            await cri.close()

    return asyncio.run(go())


@dataclass
class Bed:
    name: str
    info: dict[str, Any]
    store: str
    socket: str
    config: str
    handler: str = "criu"
    agent: subprocess.Popen[bytes] | None = None
    agent_log: str = ""
    cri_socket: str = ""  # the agent's CRI endpoint

    @property
    def cri_endpoint(self) -> str:
        return "unix://" + self.cri_socket

    @property
    def endpoint(self) -> str:
        return "unix://" + str(self.info["containerd_socket"])

    @property
    def runc_root(self) -> str:
        return str(self.info["runc_root"])

    def cri(self, fn: Callable[[CriClient], Awaitable[T]]) -> T:
        return run(fn, self.endpoint)

    def cli(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, NODE_AGENT_SOCKET=self.socket)
        cp = subprocess.run([NODE_AGENT, *args], capture_output=True, text=True, timeout=timeout, env=env)
        if check and cp.returncode != 0:
            raise AssertionError(f"node-agent {' '.join(args)} exited {cp.returncode}:\n{cp.stderr}\n{cp.stdout}")
        return cp

    # ---- the agent ---------------------------------------------------------

    def start_agent(self) -> None:
        assert self.agent is None or self.agent.poll() is not None
        for path in (self.socket, self.cri_socket):
            if path and os.path.exists(path):
                os.unlink(path)
        logf = open(self.agent_log, "ab")
        self.agent = subprocess.Popen(
            [NODE_AGENT, "serve", "--config", self.config], stdout=logf, stderr=logf, start_new_session=True
        )
        logf.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.agent.poll() is not None:
                raise AssertionError(f"node-agent serve exited {self.agent.returncode}:\n{self.tail_log()}")
            if self._socket_answers(self.socket) and (not self.cri_socket or self._socket_answers(self.cri_socket)):
                return
            time.sleep(0.05)
        raise AssertionError(f"node-agent serve did not come up:\n{self.tail_log()}")

    def _socket_answers(self, path: str) -> bool:
        if not os.path.exists(path):
            return False
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(path)
            return True
        except OSError:
            return False
        finally:
            s.close()

    def kill_agent(self) -> None:
        if self.agent and self.agent.poll() is None:
            self.agent.send_signal(signal.SIGKILL)
            self.agent.wait()

    def stop_agent(self) -> None:
        if self.agent and self.agent.poll() is None:
            self.agent.send_signal(signal.SIGTERM)
            try:
                self.agent.wait(60)
            except subprocess.TimeoutExpired:
                self.agent.kill()
                self.agent.wait()

    def tail_log(self, n: int = 60) -> str:
        try:
            with open(self.agent_log, encoding="utf-8", errors="replace") as fh:
                return "".join(fh.readlines()[-n:])
        except OSError:
            return ""


def merged_yaml(base: str, extra: str) -> str:
    """``base`` with ``extra``'s keys added, sections (mappings) merged key by key; ``extra`` wins a clash."""

    def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        out = dict(a)
        for key, value in b.items():
            old = out.get(key)
            out[key] = merge(old, value) if isinstance(old, dict) and isinstance(value, dict) else value
        return out

    doc = merge(msgspec.yaml.decode(base.encode()) or {}, msgspec.yaml.decode(extra.encode()) or {})
    return msgspec.yaml.encode(doc).decode()


@contextlib.contextmanager
def reconfigured(bed: Bed, extra: str, *, trust: str = "") -> Iterator[Bed]:
    """The bed's agent restarted with `extra` (YAML keys the config does not have yet) appended to its
    config; afterwards restarted with the config as it was.

    `trust`: a CA bundle the node trusts meanwhile, as a node whose trust store holds it (OpenSSL's
    SSL_CERT_FILE, read by the agent's default TLS context).
    """
    config = Path(bed.config)
    original = config.read_text()
    before = os.environ.get("SSL_CERT_FILE")
    bed.stop_agent()
    config.write_text(merged_yaml(original, extra))
    try:
        if trust:
            os.environ["SSL_CERT_FILE"] = trust
        bed.start_agent()
        yield bed
    finally:
        bed.stop_agent()
        config.write_text(original)
        if trust:
            if before is None:
                os.environ.pop("SSL_CERT_FILE", None)
            else:
                os.environ["SSL_CERT_FILE"] = before
        bed.start_agent()


def testbed(*args: str, timeout: float = 600) -> str:
    cp = subprocess.run(
        [str(REPO / "scripts" / "testbed"), *args], capture_output=True, text=True, timeout=timeout
    )
    if cp.returncode != 0:
        raise AssertionError(f"scripts/testbed {' '.join(args)} failed ({cp.returncode}):\n{cp.stderr}\n{cp.stdout}")
    return cp.stdout


def containerd_config_version(binary: str) -> int:
    """The config version the containerd `binary` reads (3 for 2.x, 2 for 1.x)."""
    from node_agent.containerd import version_for_binary

    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60, check=True).stdout.split()
    return version_for_binary(out[2] if len(out) > 2 else "")


CONTAINERD2 = os.environ.get("NODE_AGENT_E2E_CONTAINERD2", "/opt/node-agent/containerd-2/bin/containerd")
CONTAINERD17 = os.environ.get("NODE_AGENT_E2E_CONTAINERD17", "/opt/node-agent/containerd-1.7/bin/containerd")


def bring_up(name: str, workdir: Path, containerd: str | None = CONTAINERD2, handler_store: str | None = None,
             images: str | None = None, runc: str | None = None, with_handler: bool = True) -> Bed:
    """A test bed named `name` with the agent's restore handler, and the agent's config.
    `containerd`: the containerd binary the bed runs (default: 2.x from its private prefix; None: the
    system's). `runc`: the runc both containerd and the agent run (default: the one beside a 2.x
    containerd, else the system's). `handler_store`: write the handler for this store instead of the
    agent's (the easy mistake: `containerd-config` run without the agent's settings).
    `images`: the images to import (`scripts/testbed up --images`; default all). `with_handler=False`:
    containerd starts without the restore handler, as on a node before node-agent is installed."""
    assert containerd is None or os.access(containerd, os.X_OK), f"{containerd} missing: run scripts/install-host"
    version = containerd_config_version(containerd or "containerd")
    if runc is None and version == 3:
        runc = os.path.join(os.path.dirname(containerd or ""), "runc")
    store = str(workdir / "store")
    sock = str(workdir / "agent.sock")
    cri_sock = str(workdir / "cri.sock")
    runc_root = f"/run/node-agent-testbed/{name}/runc/k8s.io"
    config = workdir / "agent.yaml"
    endpoint = f"unix:///run/node-agent-testbed/{name}/containerd.sock"
    config.write_text(
        "\n".join([
            f"cri-endpoint: {endpoint}", f"socket: {sock}", f"store: {store}", f"runc-root: {runc_root}",
            "runtime-handler: criu", "log-level: debug", f"cri-listen: unix://{cri_sock}",
            *([f"runc: {runc}"] if runc else []),
            # The registry hosts the bed's containerd reads; logins only where a test writes them.
            "registry:", f"  config-path: {BedLayout(name).hosts_dir}", f"  credentials-file: {workdir / 'config.json'}",
        ]) + "\n"
    )
    extra: list[str] = []
    if with_handler:
        snippet = workdir / "handler.toml"
        extra_args = ["--store", handler_store] if handler_store else []
        extra_args += ["--config-version", str(version)]
        cp = subprocess.run([NODE_AGENT, "containerd-config", "--config", str(config), *extra_args],
                            capture_output=True, text=True)
        if cp.returncode != 0:
            raise AssertionError(f"containerd-config failed: {cp.stderr}")
        snippet.write_text(cp.stdout)
        extra += ["--handler-snippet", str(snippet)]
    extra += ["--containerd", containerd] if containerd else []
    extra += ["--images", images] if images else []
    extra += ["--runc", runc] if runc else []
    info = json.loads(testbed("up", name, *extra))
    assert info["runc_root"] == runc_root, info
    with config.open("a") as fh:
        fh.write(f"pod-log-root: {info['pod_log_root']}\ncgroup-parent: {info['cgroup_parent']}\n"
                 f"kubelet-root: {info['kubelet_root']}\n")
    return Bed(name=name, info=info, store=store, socket=sock, config=str(config), agent_log=str(workdir / "agent.log"),
               cri_socket=cri_sock)


# ---- pods --------------------------------------------------------------------

SHELL_COUNTER = (
    "i=0; exec 3>>/data/count.log; exec 4>>/dev/shm/{name}.count; "
    "while :; do i=$((i+1)); echo tick $i; echo $i >&3; echo $i >&4; sleep 0.2; done"
)


@dataclass
class PodHandle:
    bed: Bed
    id: str
    namespace: str
    name: str
    uid: str
    log_dir: str
    containers: dict[str, str] = field(default_factory=dict)  # name -> id


def volume_dir(bed: Bed, uid: str, name: str) -> str:
    """A pod's own volume (an emptyDir where a kubelet keeps it), created; mount it by this host path."""
    path = os.path.join(bed.info["kubelet_root"], "pods", uid, "volumes", "kubernetes.io~empty-dir", name)
    os.makedirs(path, exist_ok=True)
    return path


# The namespaces the kubelet gives a Pod's sandbox and each of its containers (kuberuntime's namespacesForPod):
# the pod's network and IPC, and a PID namespace of each container's own (POD for every one of them where the
# Pod sets shareProcessNamespace: `shared_pids`).
KUBELET_NAMESPACES: dict[str, int] = {"network": 0, "pid": 1, "ipc": 0}


def shared_pids(pod: dict[str, Any], containers: list[dict[str, Any]]) -> None:
    """A Pod with shareProcessNamespace: its sandbox and containers in one PID namespace, as the kubelet asks."""
    for cfg in (pod, *containers):
        cfg["linux"]["security_context"]["namespace_options"]["pid"] = 0


def pod_config(bed: Bed, namespace: str, name: str, uid: str | None = None) -> dict[str, Any]:
    uid = uid or str(uuid.uuid4())
    log_dir = os.path.join(bed.info["pod_log_root"], f"{namespace}_{name}_{uid}")
    os.makedirs(log_dir, exist_ok=True)
    return {
        "metadata": {"name": name, "namespace": namespace, "uid": uid, "attempt": 0},
        "hostname": name,
        "log_directory": log_dir,
        "labels": {"app": "e2e"},
        "linux": {
            "cgroup_parent": bed.info["cgroup_parent"],
            "security_context": {"namespace_options": dict(KUBELET_NAMESPACES)},
        },
    }


def container_config(name: str, image: str, command: list[str], *, devices: list[dict[str, str]] | None = None,
                     mounts: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "metadata": {"name": name, "attempt": 0},
        "image": {"image": image},
        "command": command,
        "log_path": f"{name}/0.log",
        "linux": {"security_context": {"namespace_options": dict(KUBELET_NAMESPACES)}},
    }
    if devices:
        cfg["devices"] = devices
    if mounts:
        cfg["mounts"] = mounts
    return cfg


def make_pod(bed: Bed, namespace: str, containers: list[dict[str, Any]], name: str | None = None,
             handler: str = "", uid: str | None = None) -> PodHandle:
    name = name or f"p-{secrets.token_hex(3)}"
    pcfg = pod_config(bed, namespace, name, uid)
    for c in containers:
        os.makedirs(os.path.join(pcfg["log_directory"], c["metadata"]["name"]), exist_ok=True)

    async def go(cri: CriClient) -> PodHandle:
        pod_id = await cri.run_pod(pcfg, handler)
        h = PodHandle(bed, pod_id, namespace, name, pcfg["metadata"]["uid"], pcfg["log_directory"])
        for c in containers:
            cid = await cri.create_container(pod_id, c, pcfg)
            await cri.start_container(cid)
            h.containers[c["metadata"]["name"]] = cid
        return h

    return bed.cri(go)


def counter_containers(bed: Bed, *, mib: int = 16, flip: bool = True, seed: int = 1) -> list[dict[str, Any]]:
    """A counting shell, then a memhog server: the two containers of `counter_pod`."""
    imgs = bed.info["images"]
    return [
        container_config("shell", imgs["busybox"], ["sh", "-c", SHELL_COUNTER.format(name="shell")]),
        container_config("server", imgs["memhog"], [
            "/usr/local/bin/memhog", "--mib", str(mib), "--port", "8080", "--file", "/data/memhog.log",
            "--shm", "/dev/shm/server.count", "--interval-ms", "100", "--flip", "1" if flip else "0",
            "--seed", str(seed),
        ]),
    ]


def counter_pod(bed: Bed, namespace: str, *, mib: int = 16, name: str | None = None, flip: bool = True,
                seed: int = 1) -> PodHandle:
    return make_pod(bed, namespace, counter_containers(bed, mib=mib, flip=flip, seed=seed), name=name)


def remove_pod(bed: Bed, pod_id: str) -> None:
    async def go(cri: CriClient) -> None:
        try:
            await cri.stop_pod(pod_id)
            await cri.remove_pod(pod_id)
        except Exception:  # noqa: BLE001 - best-effort teardown
            pass

    bed.cri(go)


def pods_in(bed: Bed, namespace: str) -> list[Any]:
    return bed.cri(lambda cri: _list(cri, namespace))


async def _list(cri: CriClient, namespace: str) -> list[Any]:
    return [p for p in await cri.list_pods() if p.namespace == namespace]


def container_detail(bed: Bed, cid: str) -> Any:
    return bed.cri(lambda cri: cri.container_status(cid))


def pod_detail(bed: Bed, pod_id: str) -> Any:
    return bed.cri(lambda cri: cri.pod_status(pod_id))


def ticks(path: str) -> list[int]:
    """The `tick N` values in a CRI log file (or a plain counter file)."""
    out = []
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                parts = line.split()
                if "tick" in parts:
                    i = parts.index("tick")
                    if i + 1 < len(parts) and parts[i + 1].isdigit():
                        out.append(int(parts[i + 1]))
                elif len(parts) == 1 and parts[0].isdigit():
                    out.append(int(parts[0]))
    except OSError:
        pass
    return out


def wait_for(pred: Callable[[], Any], timeout: float = 30, what: str = "condition", interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def freezer_state(pid: int) -> str:
    from criu_bridge import freezer

    return freezer.state(freezer.freezer_of(pid))


def criu_processes() -> list[Any]:
    """Every CRIU process on the node (psutil.Process): while none runs, nothing re-freezes a thawed pod."""
    import psutil

    out = []
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = p.info.get("cmdline") or []
        if p.info.get("name") == "criu" or (cmd and os.path.basename(cmd[0]) == "criu") or any(
            c.endswith("/usr/sbin/criu") for c in cmd[:5]
        ):
            out.append(p)
    return out


def answers(ip: str, port: int = 8080) -> bool:
    """Whether memhog at ``ip`` answers (for wait_for)."""
    try:
        return ask(ip, port, timeout=2).startswith("counter=")
    except OSError:
        return False


def ask(ip: str, port: int = 8080, timeout: float = 10) -> str:
    with socket.create_connection((ip, port), timeout=timeout) as s:
        s.settimeout(timeout)
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    return data.decode().strip()


def lazy_helpers(under: str) -> list[str]:
    """"PID ARGS" of each page source (or lazy-pages daemon) whose arguments name a path containing `under`
    (a store's plans directory, or `/plans/<container id>/`)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                args = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if ("lazy-pages" in args or "node_agent.lazy.source" in args) and under in args:
            found.append(f"{pid} {args}")
    return found


def start_refusal(bed: Bed, cid: str) -> str:
    """Call StartContainer on containerd directly; the error it gave ("" if it started)."""

    async def start(cri: CriClient) -> str:
        try:
            await cri.start_container(cid)
        except Exception as exc:  # noqa: BLE001 - the refusal is what the caller looks at
            return str(exc)
        return ""

    return bed.cri(start)


def volume_holder_pod(bed: Bed, namespace: str) -> tuple[PodHandle, str]:
    """A pod whose shell holds a file open on its own volume, and that volume's host path."""
    uid = str(uuid.uuid4())
    vol = volume_dir(bed, uid, "vol")
    pod = make_pod(bed, namespace, [
        container_config("holder", bed.info["images"]["busybox"], [
            "sh", "-c", "exec 5>>/vol/held.txt; i=0; while :; do i=$((i+1)); echo tick $i; echo $i >&5; sleep 0.2; done",
        ], mounts=[{"container_path": "/vol", "host_path": vol}]),
    ], uid=uid)
    return pod, vol
