"""NVIDIA GPUs through NVML (the `pynvml` module of nvidia-ml-py), when present.

`Nvml.scan()` reads every GPU's identity and health counters; a thread
blocks in `nvmlEventSetWait_v2` for Xid events and queues them per GPU until
the next scan. When the module or the library is missing, or NVML fails, the
scan says why (`GpuScan.error`, `GpuReading.error`) and the GPUs are then
reported unmonitored, never healthy. The module is passed in (or imported on
first use), so a fake with pynvml's interface can stand in for it. Blocking;
the monitor calls `scan` in a thread.
"""

from __future__ import annotations

import importlib
import logging
import re
import threading
import time
from typing import Any, Callable

from node_agent.devices.types import GpuReading, GpuScan

log = logging.getLogger(__name__)

INIT_RETRY_SECONDS = 60.0
WAIT_MS = 500
MAX_PENDING_XIDS = 64
_BUS_ID_RE = re.compile(r"^([0-9a-fA-F]{1,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


def normalize_bus_id(raw: Any) -> str:
    """NVML's `00000000:3B:00.0` as sysfs writes it (`0000:3b:00.0`); "" if malformed."""
    text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else str(raw)
    m = _BUS_ID_RE.match(text.strip())
    if not m:
        return ""
    return f"{int(m.group(1), 16):04x}:{m.group(2).lower()}:{m.group(3).lower()}.{m.group(4)}"


def _text(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def import_pynvml() -> Any:
    return importlib.import_module("pynvml")


class Nvml:
    """One NVML session: initialised on first scan, retried while it fails."""

    def __init__(self, loader: Callable[[], Any] = import_pynvml, clock: Callable[[], float] = time.monotonic) -> None:
        self._loader = loader
        self._clock = clock
        self.nv: Any = None
        self.error = ""
        self._tried = -INIT_RETRY_SECONDS * 2
        self._lock = threading.Lock()
        self._xids: dict[str, list[int]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- session ---------------------------------------------------------

    def _ensure(self) -> bool:
        if self.nv is not None:
            return True
        now = self._clock()
        if now - self._tried < INIT_RETRY_SECONDS:
            return False
        self._tried = now
        try:
            nv = self._loader()
        except ImportError:
            self.error = "nvidia-ml-py is not installed (install node-agent[nvidia])"
            return False
        except Exception as exc:  # noqa: BLE001 - a broken module leaves the GPUs unmonitored
            self.error = f"cannot load nvidia-ml-py: {exc!r}"
            return False
        try:
            nv.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - NVMLError, or a broken library: unmonitored either way
            self.error = f"nvmlInit failed: {exc}"
            return False
        self.nv, self.error = nv, ""
        self._start_events()
        return True

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=WAIT_MS / 1000.0 * 4)
            self._thread = None
        if self.nv is not None:
            try:
                self.nv.nvmlShutdown()
            except self.nv.NVMLError as exc:
                log.debug("nvmlShutdown: %s", exc)
            self.nv = None

    # ---- Xid events ------------------------------------------------------

    def _start_events(self) -> None:
        nv = self.nv
        try:
            event_set = nv.nvmlEventSetCreate()
        except (nv.NVMLError, AttributeError) as exc:
            log.warning("no Xid events from NVML: %s", exc, extra={"phase": "devices"})
            return
        registered = 0
        for index in range(nv.nvmlDeviceGetCount()):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(index)
                nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, event_set)
                registered += 1
            except nv.NVMLError as exc:
                log.warning("GPU %d: no Xid events: %s", index, exc, extra={"phase": "devices"})
        if not registered:
            nv.nvmlEventSetFree(event_set)
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._wait_events, args=(event_set,), name="nvml-xid-events", daemon=True)
        self._thread.start()

    def _wait_events(self, event_set: Any) -> None:
        nv = self.nv
        timeout_code = getattr(nv, "NVML_ERROR_TIMEOUT", 10)
        try:
            while not self._stop.is_set():
                try:
                    data = nv.nvmlEventSetWait_v2(event_set, WAIT_MS)
                except Exception as exc:  # noqa: BLE001 - the thread must outlive a bad wait
                    if isinstance(exc, nv.NVMLError) and getattr(exc, "value", None) == timeout_code:
                        continue
                    log.warning("waiting for Xid events failed: %s", exc, extra={"phase": "devices"})
                    self._stop.wait(1.0)
                    continue
                if not int(data.eventType) & nv.nvmlEventTypeXidCriticalError:
                    continue
                try:
                    bdf = normalize_bus_id(nv.nvmlDeviceGetPciInfo(data.device).busId)
                except nv.NVMLError:
                    bdf = ""
                xid = int(data.eventData)
                log.warning("GPU %s: Xid %d", bdf or "?", xid, extra={"phase": "devices", "device": bdf})
                with self._lock:
                    pending = self._xids.setdefault(bdf, [])
                    if len(pending) < MAX_PENDING_XIDS:
                        pending.append(xid)
        finally:
            try:
                nv.nvmlEventSetFree(event_set)
            except nv.NVMLError:
                pass

    def _take_xids(self, bdf: str) -> tuple[int, ...]:
        with self._lock:
            return tuple(self._xids.pop(bdf, ()))

    # ---- readings --------------------------------------------------------

    def scan(self) -> GpuScan:
        """Every GPU's reading, or why there are none. Never raises: failures are what it reports."""
        if not self._ensure():
            return GpuScan(error=self.error)
        nv = self.nv
        try:
            count = nv.nvmlDeviceGetCount()
        except Exception as exc:  # noqa: BLE001 - reported as unmonitored GPUs
            return GpuScan(error=f"nvmlDeviceGetCount failed: {exc}")
        readings = []
        for index in range(min(int(count), 64)):
            readings.append(self._read(index))
        return GpuScan(readings=tuple(readings))

    def _optional(self, fn: str, *args: Any) -> Any:
        """A query that not every GPU supports: None where it is not supported."""
        nv = self.nv
        call = getattr(nv, fn, None)
        if call is None:
            return None
        try:
            return call(*args)
        except nv.NVMLError as exc:
            if getattr(exc, "value", None) in (getattr(nv, "NVML_ERROR_NOT_SUPPORTED", 3),):
                return None
            raise

    def _read(self, index: int) -> GpuReading:
        nv = self.nv
        bdf = ""
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            bdf = normalize_bus_id(nv.nvmlDeviceGetPciInfo(handle).busId)
            uuid = _text(nv.nvmlDeviceGetUUID(handle))
            name = _text(self._optional("nvmlDeviceGetName", handle) or "")
            numa = self._optional("nvmlDeviceGetNumaNodeId", handle)
            temp = nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU)
            slowdown = self._optional("nvmlDeviceGetTemperatureThreshold", handle, nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
            ecc = self._optional("nvmlDeviceGetTotalEccErrors", handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                 nv.NVML_VOLATILE_ECC)
            pending = self._optional("nvmlDeviceGetRetiredPagesPendingStatus", handle)
            rows = self._optional("nvmlDeviceGetRemappedRows", handle)
            action = self._recovery_action(handle)
        except Exception as exc:  # noqa: BLE001 - NVMLError or worse: this GPU is unmonitored
            return GpuReading(bdf=bdf or f"nvml-index-{index}", error=str(exc) or repr(exc),
                              xids=self._take_xids(bdf) if bdf else ())
        return GpuReading(
            bdf=bdf,
            uuid=uuid,
            name=name[:64],
            numa_node=int(numa) if isinstance(numa, int) and 0 <= numa < 1024 else -1,
            temperature=float(temp),
            slowdown_celsius=float(slowdown) if slowdown else None,
            ecc_uncorrected_volatile=int(ecc) if ecc is not None else None,
            retired_pages_pending=None if pending is None else pending == getattr(nv, "NVML_FEATURE_ENABLED", 1),
            remap_pending=None if rows is None else bool(rows[2]),
            remap_failure=None if rows is None else bool(rows[3]),
            recovery_action=action,
            xids=self._take_xids(bdf),
        )

    def _recovery_action(self, handle: Any) -> int | None:
        nv = self.nv
        field_id = getattr(nv, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if field_id is None:
            return None
        values = self._optional("nvmlDeviceGetFieldValues", handle, [field_id])
        if not values:
            return None
        v = values[0]
        if int(v.nvmlReturn) != getattr(nv, "NVML_SUCCESS", 0):
            return None
        return int(v.value.uiVal)
