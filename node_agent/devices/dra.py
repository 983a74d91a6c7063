"""From a device to DRA: attributes to publish, and where drivers publish it.

`attributes()` gives a device's standard DRA attributes (numaNode only when
known). `SliceIndex` reads the node's ResourceSlices (plain JSON from the API
server, untrusted) and finds the driver, pool and device name under which a
device is published: by its `resource.kubernetes.io/pciBusID` attribute, or
by a `uuid` attribute (NVIDIA's driver). Only the newest generation of each
pool counts. Pure; no I/O.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from node_agent.devices.types import (
    ATTR_NUMA_NODE,
    ATTR_NVIDIA_UUID,
    ATTR_PCI_BUS_ID,
    ATTR_PCIE_ROOT,
    AttrValue,
    DraDevice,
    PciDevice,
    Version,
)

MAX_STRING = 64


def attributes(pci: PciDevice, uuid: str = "", numa_override: int = -1) -> dict[str, AttrValue | Version]:
    """The qualified DRA attributes of a device; numaNode only when it is known (not -1)."""
    out: dict[str, AttrValue | Version] = {ATTR_PCI_BUS_ID: pci.bdf}
    if pci.pcie_root:
        out[ATTR_PCIE_ROOT] = pci.pcie_root
    numa = pci.numa_node if pci.numa_node >= 0 else numa_override
    if numa >= 0:
        out[ATTR_NUMA_NODE] = numa
    if uuid:
        out[ATTR_NVIDIA_UUID] = uuid[:MAX_STRING]
    return out


def _str(v: Any) -> str:
    return v if isinstance(v, str) else ""


def _attr_string(attrs: Mapping[str, Any], wanted: Iterable[str]) -> list[str]:
    """String values of the attributes whose name (qualified or not) is one of `wanted`."""
    out = []
    for name, value in attrs.items():
        if not isinstance(name, str) or not isinstance(value, Mapping):
            continue
        short = name.rsplit("/", 1)[-1]
        if name in wanted or short in wanted:
            s = _str(value.get("string"))
            if s:
                out.append(s)
    return out


class SliceIndex:
    """The node's published devices, by PCI bus ID and by UUID."""

    def __init__(self, slices: Iterable[Any] = ()) -> None:
        newest: dict[tuple[str, str], int] = {}
        usable: list[tuple[str, str, int, Mapping[str, Any]]] = []
        for item in slices:
            spec = item.get("spec") if isinstance(item, Mapping) else None
            if not isinstance(spec, Mapping):
                continue
            driver = _str(spec.get("driver"))
            raw_pool = spec.get("pool")
            pool: Mapping[str, Any] = raw_pool if isinstance(raw_pool, Mapping) else {}
            pool_name = _str(pool.get("name"))
            gen = pool.get("generation")
            gen = gen if isinstance(gen, int) and not isinstance(gen, bool) else 0
            if not driver or not pool_name:
                continue
            key = (driver, pool_name)
            newest[key] = max(newest.get(key, gen), gen)
            usable.append((driver, pool_name, gen, spec))
        self.by_bus_id: dict[str, list[DraDevice]] = {}
        self.by_uuid: dict[str, list[DraDevice]] = {}
        for driver, pool_name, gen, spec in usable:
            if gen != newest[(driver, pool_name)]:
                continue
            devices = spec.get("devices")
            for dev in devices if isinstance(devices, list) else []:
                if not isinstance(dev, Mapping) or not _str(dev.get("name")):
                    continue
                attrs = dev.get("attributes")
                attrs = attrs if isinstance(attrs, Mapping) else {}
                target = DraDevice(driver=driver, pool=pool_name, device=_str(dev.get("name")))
                for bus_id in _attr_string(attrs, (ATTR_PCI_BUS_ID,)):
                    self.by_bus_id.setdefault(bus_id.lower(), []).append(target)
                for uuid in _attr_string(attrs, ("uuid",)):
                    self.by_uuid.setdefault(uuid, []).append(target)

    def match(self, bdf: str, uuid: str = "") -> tuple[DraDevice, ...]:
        """Every (driver, pool, device) that publishes this PCI function, without repeats."""
        found = list(self.by_bus_id.get(bdf.lower(), ()))
        if uuid:
            found += self.by_uuid.get(uuid, ())
        return tuple(dict.fromkeys(found))
