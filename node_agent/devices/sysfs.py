"""The PCI inventory from sysfs: identity, NUMA, PCIe root, link, AER, hwmon, topology.

`scan(root)` reads a sysfs tree (`/sys`, or a copy under another root) and
returns an `Inventory`. sysfs is untrusted input here: every read is bounded,
a missing or malformed file leaves its field at the "unknown" value, and
links that leave the tree are not followed for anything but a name.
Blocking; the monitor calls it in a thread.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Iterator

from node_agent.devices.types import Inventory, Link, NumaNode, PciDevice, Temperature

log = logging.getLogger(__name__)

MAX_READ = 4096  # sysfs attributes are one page at most
MAX_DEVICES = 4096
MAX_SENSORS = 64
AER_FILES = ("aer_dev_fatal", "aer_dev_nonfatal", "aer_dev_correctable")

BDF_RE = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
ROOT_RE = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")
_HEX_RE = re.compile(r"^0x[0-9a-f]{1,8}$")
_SPEED_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)\s*GT/s")


def read_text(path: str, limit: int = MAX_READ) -> str | None:
    """The first `limit` bytes of a file as stripped text; None if it cannot be read."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(limit)
    except OSError:
        return None
    return data.decode("utf-8", "replace").strip()


def read_int(path: str) -> int | None:
    text = read_text(path, 64)
    if text is None:
        return None
    try:
        return int(text, 0) if text.startswith("0x") else int(text)
    except ValueError:
        return None


def _hex_id(path: str) -> str:
    text = (read_text(path, 64) or "").lower()
    return text if _HEX_RE.match(text) else ""


def parse_speed(text: str | None) -> float:
    """GT/s from `16.0 GT/s PCIe`; 0.0 when unknown."""
    m = _SPEED_RE.match(text or "")
    return float(m.group(1)) if m else 0.0


def parse_aer(text: str | None) -> int | None:
    """The total of an `aer_dev_*` file ("NAME COUNT" lines, TOTAL_ERR_* last)."""
    if text is None:
        return None
    total, summed = None, 0
    for line in text.splitlines()[:128]:
        parts = line.split()
        if len(parts) != 2 or not (parts[1].isascii() and parts[1].isdigit()):
            continue
        if parts[0].startswith("TOTAL_ERR"):
            total = int(parts[1])
        else:
            summed += int(parts[1])
    return total if total is not None else summed


def pcie_root(real: str, devices_dir: str) -> str:
    """The host bridge (`pci0000:40`) a device's sysfs path hangs below, "" if none."""
    rel = os.path.relpath(real, devices_dir)
    if rel.startswith(".."):
        return ""
    first = rel.split(os.sep, 1)[0]
    return first if ROOT_RE.match(first) else ""


def _link(path: str) -> Link:
    def width(name: str) -> int:
        v = read_int(os.path.join(path, name))
        return v if v is not None and 0 < v <= 32 else 0

    return Link(
        current_speed=parse_speed(read_text(os.path.join(path, "current_link_speed"), 64)),
        max_speed=parse_speed(read_text(os.path.join(path, "max_link_speed"), 64)),
        current_width=width("current_link_width"),
        max_width=width("max_link_width"),
    )


def _driver(path: str) -> str:
    try:
        return os.path.basename(os.readlink(os.path.join(path, "driver")))[:64]
    except OSError:
        return ""


def _milli(path: str) -> float:
    v = read_int(path)
    return v / 1000.0 if v is not None else 0.0


def _class_members(root: str, cls: str, bdfs: set[str], limit: int) -> Iterator[tuple[str, str, str]]:
    """(name, path, owner BDF) of the first ``limit`` members of ``/sys/class/<cls>`` below a known PCI function."""
    base = os.path.join(root, "class", cls)
    try:
        names = sorted(os.listdir(base))[:limit]
    except OSError:
        return
    for name in names:
        path = os.path.join(base, name)
        owner = _owner(path, bdfs)
        if owner is not None:
            yield name, path, owner


def _hwmon(root: str, bdfs: set[str]) -> dict[str, list[Temperature]]:
    """Temperatures by the BDF of the PCI device each hwmon sits below."""
    out: dict[str, list[Temperature]] = {}
    for name, path, owner in _class_members(root, "hwmon", bdfs, MAX_SENSORS):
        chip = read_text(os.path.join(path, "name"), 64) or name
        try:
            inputs = sorted(f for f in os.listdir(path) if re.fullmatch(r"temp[0-9]{1,2}_input", f))
        except OSError:
            continue
        for inp in inputs[:MAX_SENSORS]:
            stem = inp[: -len("_input")]
            value = read_int(os.path.join(path, inp))
            if value is None:
                continue
            label = read_text(os.path.join(path, stem + "_label"), 64) or stem
            out.setdefault(owner, []).append(Temperature(
                sensor=f"{chip}/{label}"[:64],
                celsius=value / 1000.0,
                max_celsius=_milli(os.path.join(path, stem + "_max")),
                crit_celsius=_milli(os.path.join(path, stem + "_crit")),
            ))
    return out


def _owner(path: str, bdfs: set[str]) -> str | None:
    """The BDF of the nearest known PCI function above a class device (hwmon, net)."""
    return next((p for p in reversed(os.path.realpath(path).split(os.sep)) if p in bdfs), None)


def _interfaces(root: str, bdfs: set[str]) -> dict[str, list[str]]:
    """Network interface names by the BDF of the PCI function (or virtio device's function) below them."""
    out: dict[str, list[str]] = {}
    for name, _, owner in _class_members(root, "net", bdfs, MAX_DEVICES):
        out.setdefault(owner, []).append(name)
    return out


def numa_topology(root: str) -> tuple[NumaNode, ...]:
    base = os.path.join(root, "devices", "system", "node")
    try:
        names = os.listdir(base)
    except OSError:
        return ()
    nodes = []
    for name in names:
        m = re.fullmatch(r"node([0-9]{1,4})", name)
        if not m:
            continue
        cpulist = read_text(os.path.join(base, name, "cpulist"), 1024) or ""
        if not re.fullmatch(r"[0-9,\-]*", cpulist):
            cpulist = ""
        dist = []
        for part in (read_text(os.path.join(base, name, "distance"), 1024) or "").split()[:1024]:
            if part.isascii() and part.isdigit():
                dist.append(int(part))
        nodes.append(NumaNode(id=int(m.group(1)), cpulist=cpulist, distances=tuple(dist)))
    return tuple(sorted(nodes, key=lambda n: n.id))


def read_device(root: str, bdf: str) -> PciDevice:
    """One PCI function below `<root>/bus/pci/devices/<bdf>`."""
    path = os.path.join(root, "bus", "pci", "devices", bdf)
    devices_dir = os.path.realpath(os.path.join(root, "devices"))
    numa = read_int(os.path.join(path, "numa_node"))
    aer: dict[str, int] = {}
    for name in AER_FILES:
        count = parse_aer(read_text(os.path.join(path, name), MAX_READ))
        if count is not None:
            aer[name] = count
    return PciDevice(
        bdf=bdf,
        vendor=_hex_id(os.path.join(path, "vendor")),
        device=_hex_id(os.path.join(path, "device")),
        pci_class=_hex_id(os.path.join(path, "class")),
        driver=_driver(path),
        numa_node=numa if numa is not None and 0 <= numa < 1024 else -1,
        pcie_root=pcie_root(os.path.realpath(path), devices_dir),
        link=_link(path),
        aer=aer,
    )


def scan(root: str = "/sys") -> Inventory:
    """Every PCI function under `root`, with temperatures, interfaces and NUMA topology."""
    base = os.path.join(root, "bus", "pci", "devices")
    try:
        names = sorted(n for n in os.listdir(base) if BDF_RE.match(n))[:MAX_DEVICES]
    except OSError as exc:
        log.debug("no PCI devices under %s: %s", base, exc.strerror)
        names = []
    devices = [read_device(root, bdf) for bdf in names]
    temps = _hwmon(root, set(names))
    nets = _interfaces(root, set(names))
    devices = [
        dataclasses.replace(d, temperatures=tuple(temps.get(d.bdf, ())), interfaces=tuple(nets.get(d.bdf, ())))
        for d in devices
    ]
    return Inventory(devices=tuple(devices), numa_nodes=numa_topology(root))
