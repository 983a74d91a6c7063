"""Test doubles for the device tests: a synthetic sysfs tree, an API server, a pynvml module.

The API server listens on 127.0.0.1 only and checks every DeviceTaintRule
request against the Kubernetes 1.37 schema (kubernetes-validate). The pynvml
stand-in has the real module's function names, exception class and constants.
"""

from __future__ import annotations

import json
import os
import queue
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kubernetes_validate
import pynvml

from tests.kube_fake import ApiHandler

K8S_VERSION = "1.37.0"

# ---- sysfs ---------------------------------------------------------------------------


class SysfsTree:
    """A sysfs-shaped tree: devices under their host bridge, bus/pci/devices links, class links."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "bus" / "pci" / "devices").mkdir(parents=True)
        (root / "class" / "hwmon").mkdir(parents=True)
        (root / "class" / "net").mkdir(parents=True)
        self.paths: dict[str, Path] = {}

    def _link(self, link: Path, target: Path) -> None:
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(target, link.parent))

    def add(self, bdf: str, *, parent: str = "", host_bridge: str = "", vendor: str = "0x10de",
            device: str = "0x2335", cls: str = "0x030200", driver: str = "", numa: int = -1,
            link: tuple[str, str, int, int] | None = None, aer: bool = False) -> Path:
        if parent:
            base = self.paths[parent]
        else:
            base = self.root / "devices" / (host_bridge or "pci" + bdf[:7])
        path = base / bdf
        path.mkdir(parents=True)
        self.paths[bdf] = path
        for name, value in (("vendor", vendor), ("device", device), ("class", cls), ("numa_node", str(numa))):
            (path / name).write_text(value + "\n")
        if driver:
            drv = self.root / "bus" / "pci" / "drivers" / driver
            drv.mkdir(parents=True, exist_ok=True)
            self._link(path / "driver", drv)
        if link:
            self.set_link(bdf, *link)
        if aer:
            self.set_aer(bdf)
        self._link(self.root / "bus" / "pci" / "devices" / bdf, path)
        return path

    def set_link(self, bdf: str, speed: str, max_speed: str, width: int, max_width: int) -> None:
        p = self.paths[bdf]
        (p / "current_link_speed").write_text(speed + "\n")
        (p / "max_link_speed").write_text(max_speed + "\n")
        (p / "current_link_width").write_text(f"{width}\n")
        (p / "max_link_width").write_text(f"{max_width}\n")

    def set_aer(self, bdf: str, fatal: int = 0, nonfatal: int = 0, correctable: int = 0) -> None:
        p = self.paths[bdf]
        (p / "aer_dev_fatal").write_text(
            f"Undefined 0\nDLP 0\nSDES 0\nTLP 0\nFCP 0\nCmpltTO 0\nCmpltAbrt 0\nUnxCmplt 0\nRxOF 0\nMalfTLP {fatal}\n"
            f"ECRC 0\nUnsupReq 0\nACSViol 0\nTOTAL_ERR_FATAL {fatal}\n")
        (p / "aer_dev_nonfatal").write_text(f"Undefined 0\nDLP 0\nCmpltTO {nonfatal}\nTOTAL_ERR_NONFATAL {nonfatal}\n")
        (p / "aer_dev_correctable").write_text(f"RxErr {correctable}\nBadTLP 0\nTOTAL_ERR_COR {correctable}\n")

    def add_hwmon(self, bdf: str, index: int, chip: str, celsius: float, *, max_c: float = 0, crit_c: float = 0,
                  label: str = "") -> None:
        hw = self.paths[bdf] / "hwmon" / f"hwmon{index}"
        hw.mkdir(parents=True)
        (hw / "name").write_text(chip + "\n")
        if label:
            (hw / "temp1_label").write_text(label + "\n")
        if max_c:
            (hw / "temp1_max").write_text(f"{int(max_c * 1000)}\n")
        if crit_c:
            (hw / "temp1_crit").write_text(f"{int(crit_c * 1000)}\n")
        self._link(self.root / "class" / "hwmon" / f"hwmon{index}", hw)
        self.set_temp(bdf, index, celsius)

    def set_temp(self, bdf: str, index: int, celsius: float) -> None:
        (self.paths[bdf] / "hwmon" / f"hwmon{index}" / "temp1_input").write_text(f"{int(celsius * 1000)}\n")

    def add_net(self, bdf: str, name: str) -> None:
        net = self.paths[bdf] / "net" / name
        net.mkdir(parents=True)
        self._link(net / "device", self.paths[bdf])
        self._link(self.root / "class" / "net" / name, net)

    def add_numa(self, node: int, cpulist: str, distances: list[int]) -> None:
        d = self.root / "devices" / "system" / "node" / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist + "\n")
        (d / "distance").write_text(" ".join(map(str, distances)) + "\n")


# ---- the API server --------------------------------------------------------------------

API = "/apis/resource.k8s.io/v1"


def resource_slice(name: str, node: str, driver: str, pool: str, devices: list[tuple[str, dict[str, Any]]],
                   generation: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name},
        "spec": {
            "driver": driver, "nodeName": node,
            "pool": {"name": pool, "generation": generation, "resourceSliceCount": 1},
            "devices": [{"name": dev, "attributes": attrs} for dev, attrs in devices],
        },
    }


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    body: Any
    auth: str


@dataclass
class ApiState:
    node: str
    token: str = "test-token"
    slices: list[dict[str, Any]] = field(default_factory=list)
    rules: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    version: int = 100
    client_certs: list[str] = field(default_factory=list)
    fail_slices: bool = False  # answer ResourceSlice lists with 503
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def writes(self) -> list[Request]:
        return [r for r in self.requests if r.method in ("POST", "PUT", "DELETE", "PATCH")]


def _validate(obj: Any, what: str) -> str:
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"{what}: {type(exc).__name__}: {getattr(exc, 'message', exc)}"
    return ""


class _Handler(ApiHandler):
    state: ApiState

    def _handle(self) -> None:
        st = self.state
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        req = Request(self.command, url.path, query, body, self.headers.get("Authorization", ""))
        with st.lock:
            st.requests.append(req)
            peer = self.connection.getpeercert() if hasattr(self.connection, "getpeercert") else None
            if peer:
                st.client_certs.append(dict(x[0] for x in peer["subject"])["commonName"])
            elif req.auth != f"Bearer {st.token}":
                return self._status(401, "Unauthorized", "bad token")
            if url.path == f"{API}/resourceslices" and self.command == "GET":
                if st.fail_slices:
                    return self._status(503, "ServiceUnavailable", "etcd is having a bad day")
                if query.get("fieldSelector") != [f"spec.nodeName={st.node}"]:
                    st.problems.append(f"ResourceSlices listed with {query.get('fieldSelector')}")
                return self._send(200, {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSliceList",
                                        "metadata": {"resourceVersion": str(st.version)}, "items": st.slices})
            if url.path == f"{API}/devicetaintrules":
                if self.command == "GET":
                    sel = dict(kv.split("=", 1) for kv in (query.get("labelSelector") or [""])[0].split(",") if kv)
                    items = [r for r in st.rules.values()
                             if all(r["metadata"].get("labels", {}).get(k) == v for k, v in sel.items())]
                    if not sel:
                        st.problems.append("DeviceTaintRules listed without a label selector")
                    return self._send(200, {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRuleList",
                                            "metadata": {"resourceVersion": str(st.version)}, "items": items})
                if self.command == "POST":
                    problem = _validate(body, "POST DeviceTaintRule")
                    if problem:
                        st.problems.append(problem)
                        return self._status(422, "Invalid", problem)
                    if body.get("metadata", {}).get("resourceVersion"):
                        st.problems.append("POST with a resourceVersion")
                    name = body["metadata"]["name"]
                    if name in st.rules:
                        return self._status(409, "AlreadyExists", f"{name} exists")
                    return self._send(201, self._store(body))
            prefix = f"{API}/devicetaintrules/"
            if url.path.startswith(prefix):
                name = urllib.parse.unquote(url.path[len(prefix):])
                if name not in st.rules:
                    return self._status(404, "NotFound", f"{name} not found")
                if self.command == "DELETE":
                    del st.rules[name]
                    return self._send(200, {"apiVersion": "v1", "kind": "Status", "status": "Success"})
                if self.command == "PUT":
                    problem = _validate(body, "PUT DeviceTaintRule")
                    if not problem and body["metadata"]["name"] != name:
                        problem = "PUT: the body's name differs from the path's"
                    rv = body.get("metadata", {}).get("resourceVersion")
                    if not problem and rv and rv != st.rules[name]["metadata"]["resourceVersion"]:
                        return self._status(409, "Conflict", "stale resourceVersion")
                    if problem:
                        st.problems.append(problem)
                        return self._status(422, "Invalid", problem)
                    return self._send(200, self._store(body))
                if self.command == "GET":
                    return self._send(200, st.rules[name])
            st.problems.append(f"unexpected {self.command} {self.path}")
            return self._status(404, "NotFound", "no such path")

    def _store(self, body: dict[str, Any]) -> dict[str, Any]:
        st = self.state
        st.version += 1
        obj = json.loads(json.dumps(body))
        meta = obj["metadata"]
        old = st.rules.get(meta["name"])
        meta["resourceVersion"] = str(st.version)
        meta["uid"] = old["metadata"]["uid"] if old else f"uid-{st.version}"
        meta["generation"] = (old["metadata"]["generation"] + 1) if old else 1
        obj["spec"]["taint"].setdefault("timeAdded", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        problem = _validate(obj, "stored DeviceTaintRule")
        if problem:
            st.problems.append(problem)
        st.rules[meta["name"]] = obj
        return obj

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _handle


class FakeApiServer:
    """An API server on 127.0.0.1 for ResourceSlices and DeviceTaintRules."""

    def __init__(self, node: str, tls: tuple[str, str, str] | None = None) -> None:
        """`tls`: the server's certificate and key, and the CA client certificates must chain to."""
        self.state = ApiState(node=node)
        handler = type("Handler", (_Handler,), {"state": self.state})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.tls = tls is not None
        if tls is not None:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=tls[2])
            ctx.load_cert_chain(tls[0], tls[1])
            ctx.verify_mode = ssl.CERT_OPTIONAL
            self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="fake-apiserver", daemon=True)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.httpd.server_address[1]}"

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "c", "cluster": {"server": self.url}}],
            "users": [{"name": "u", "user": {"token": self.state.token}}],
            "contexts": [{"name": "test", "context": {"cluster": "c", "user": "u"}}],
        }))
        return path

    def __enter__(self) -> FakeApiServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


# ---- pynvml ----------------------------------------------------------------------------


@dataclass
class FakeGpu:
    bus_id: str  # NVML form: 00000000:41:00.0
    uuid: str
    name: str = "NVIDIA H200"
    numa: int = 1
    temperature: int = 40
    slowdown: int = 87
    ecc_volatile: int = 0
    pages_pending: int = pynvml.NVML_FEATURE_DISABLED
    remapped: tuple[int, int, int, int] = (0, 0, 0, 0)
    recovery_action: int = pynvml.NVML_GPU_RECOVERY_ACTION_NONE
    lost: bool = False  # every query fails with GPU_IS_LOST


class FakePynvml:
    """pynvml's interface over a list of FakeGpu; checks the arguments it is called with."""

    NVMLError = pynvml.NVMLError

    def __init__(self, gpus: list[FakeGpu], *, init_error: int | None = None) -> None:
        for name in dir(pynvml):
            if name.startswith(("NVML_", "nvmlEventType")):
                setattr(self, name, getattr(pynvml, name))
        self.gpus = gpus
        self.init_error = init_error
        self.initialized = False
        self.events: queue.Queue[tuple[int, int]] = queue.Queue()
        self.registered: set[int] = set()
        self.event_sets = 0
        self.calls: list[str] = []

    def _check(self) -> None:
        if not self.initialized:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)

    def _gpu(self, handle: Any) -> FakeGpu:
        self._check()
        gpu = self.gpus[handle.index]
        if gpu.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpu

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self._check()
        self.initialized = False

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._check()
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return SimpleNamespace(index=index)

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        self._check()
        gpu = self.gpus[handle.index]  # PCI info answers even for a lost GPU
        return SimpleNamespace(busId=gpu.bus_id.encode(), busIdLegacy=gpu.bus_id.encode())

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self._gpu(handle).uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self._gpu(handle).name

    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int:
        return self._gpu(handle).numa

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._gpu(handle).temperature

    def nvmlDeviceGetTemperatureThreshold(self, handle: Any, threshold: int) -> int:
        assert threshold == pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
        return self._gpu(handle).slowdown

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter_type: int) -> int:
        assert error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED and counter_type == pynvml.NVML_VOLATILE_ECC
        return self._gpu(handle).ecc_volatile

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Any) -> int:
        return self._gpu(handle).pages_pending

    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]:
        return self._gpu(handle).remapped

    def nvmlDeviceGetFieldValues(self, handle: Any, field_ids: list[Any]) -> list[Any]:
        gpu = self._gpu(handle)
        assert field_ids == [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION]
        return [SimpleNamespace(fieldId=field_ids[0], scopeId=0, nvmlReturn=pynvml.NVML_SUCCESS,
                                valueType=pynvml.NVML_VALUE_TYPE_UNSIGNED_INT,
                                value=SimpleNamespace(uiVal=gpu.recovery_action))]

    def nvmlEventSetCreate(self) -> Any:
        self._check()
        self.event_sets += 1
        return SimpleNamespace(id=self.event_sets)

    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: Any) -> None:
        self._check()
        assert event_types & pynvml.nvmlEventTypeXidCriticalError
        self.registered.add(handle.index)

    def nvmlEventSetWait_v2(self, event_set: Any, timeout_ms: int) -> Any:
        self._check()
        try:
            index, xid = self.events.get(timeout=timeout_ms / 1000.0)
        except queue.Empty:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT) from None
        return SimpleNamespace(device=SimpleNamespace(index=index), eventType=pynvml.nvmlEventTypeXidCriticalError,
                               eventData=xid, gpuInstanceId=0, computeInstanceId=0)

    def nvmlEventSetFree(self, event_set: Any) -> None:
        pass

    def xid(self, index: int, xid: int) -> None:
        """The driver reports an Xid on GPU `index`."""
        self.events.put((index, xid))
