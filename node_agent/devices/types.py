"""The plain frozen dataclasses that every devices module passes around.

No I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

# Qualified DRA attribute names (KEP-4381 standard attributes, KEP-6072).
ATTR_PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
ATTR_PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
ATTR_NUMA_NODE = "resource.kubernetes.io/numaNode"
ATTR_NVIDIA_UUID = "gpu.nvidia.com/uuid"

HEALTHY = "healthy"
DEGRADED = "degraded"
UNHEALTHY = "unhealthy"
UNMONITORED = "unmonitored"
STATES = (HEALTHY, DEGRADED, UNHEALTHY, UNMONITORED)

# A DRA attribute value: int, bool or str ("version" values are tagged).
AttrValue = int | bool | str


@dataclass(frozen=True)
class Version:
    """A semantic-version attribute value (`version` in a ResourceSlice)."""

    value: str


@dataclass(frozen=True)
class Link:
    """PCIe link state; speeds in GT/s (0 = unknown), widths in lanes (0 = unknown)."""

    current_speed: float = 0.0
    max_speed: float = 0.0
    current_width: int = 0
    max_width: int = 0


@dataclass(frozen=True)
class Temperature:
    """One temperature sensor in degrees Celsius; thresholds 0 when the sensor has none."""

    sensor: str
    celsius: float
    max_celsius: float = 0.0
    crit_celsius: float = 0.0


@dataclass(frozen=True)
class PciDevice:
    """One PCI function as sysfs shows it."""

    bdf: str  # 0000:41:00.0, lower case
    vendor: str  # 0x10de
    device: str  # 0x2335
    pci_class: str  # 0x030200
    driver: str = ""
    numa_node: int = -1  # -1: unknown (not published)
    pcie_root: str = ""  # pci0000:40
    link: Link = field(default_factory=Link)
    # TOTAL_ERR_FATAL / _NONFATAL / _COR counters, keyed by the sysfs file name.
    aer: Mapping[str, int] = field(default_factory=dict)
    temperatures: tuple[Temperature, ...] = ()
    interfaces: tuple[str, ...] = ()  # network interface names

    @property
    def is_nvidia_gpu(self) -> bool:
        return self.vendor == "0x10de" and self.pci_class.startswith("0x03")


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpulist: str
    distances: tuple[int, ...] = ()


@dataclass(frozen=True)
class Inventory:
    devices: tuple[PciDevice, ...] = ()
    numa_nodes: tuple[NumaNode, ...] = ()


@dataclass(frozen=True)
class GpuReading:
    """What NVML says about one GPU in one poll; `error` set means unmonitored."""

    bdf: str
    uuid: str = ""
    name: str = ""
    numa_node: int = -1
    temperature: float | None = None
    slowdown_celsius: float | None = None
    ecc_uncorrected_volatile: int | None = None
    retired_pages_pending: bool | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    recovery_action: int | None = None  # NVML_GPU_RECOVERY_ACTION_*
    xids: tuple[int, ...] = ()  # critical Xids seen since the last poll
    error: str = ""


@dataclass(frozen=True)
class GpuScan:
    """One NVML poll: readings per GPU, or why NVML could not be used at all."""

    readings: tuple[GpuReading, ...] = ()
    error: str = ""  # set when NVML is missing or failed to initialise


@dataclass(frozen=True)
class Signal:
    """A condition observed in one poll (before hysteresis).

    `event` conditions (a rising error counter, an Xid) count at once; level
    conditions (a temperature, a narrow link) count after N consecutive polls.
    """

    reason: str
    severity: str  # DEGRADED or UNHEALTHY
    message: str
    event: bool = False


@dataclass(frozen=True)
class Reason:
    """A condition that counts (after hysteresis)."""

    reason: str
    severity: str
    message: str
    since: float  # unix seconds


@dataclass(frozen=True)
class Health:
    state: str = HEALTHY
    reasons: tuple[Reason, ...] = ()
    unmonitored: str = ""  # why this device cannot be watched, when it cannot


@dataclass(frozen=True)
class DraDevice:
    """Where a DRA driver publishes this device."""

    driver: str
    pool: str
    device: str


@dataclass(frozen=True)
class TaintRule:
    """One DeviceTaintRule the agent wants: one device, one reason, one taint."""

    name: str
    node: str
    bdf: str
    reason: str
    target: DraDevice
    key: str
    value: str
    effect: str  # None | NoSchedule | NoExecute
    message: str = ""


@dataclass(frozen=True)
class DeviceReport:
    """Everything said about one device in a snapshot."""

    pci: PciDevice
    attributes: Mapping[str, AttrValue | Version]
    health: Health
    dra: tuple[DraDevice, ...] = ()
    uuid: str = ""
    name: str = ""


@dataclass(frozen=True)
class Snapshot:
    """A complete view of the node's devices at one poll."""

    node: str = ""
    taken_at: float = 0.0
    generation: int = 0
    devices: tuple[DeviceReport, ...] = ()
    numa_nodes: tuple[NumaNode, ...] = ()
    rules: tuple[TaintRule, ...] = ()
    # "on" (rules written), "off: <why>" or "error: <what>".
    dra_status: str = ""
