"""The sysfs inventory: this machine's real /sys, synthetic trees, and hostile content."""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from devices_fakes import SysfsTree
from node_agent.devices import dra, sysfs
from node_agent.devices.types import ATTR_NUMA_NODE, ATTR_PCI_BUS_ID, ATTR_PCIE_ROOT


def test_this_machine_lists_its_virtio_devices_and_publishes_no_unknown_numa_node() -> None:
    inv = sysfs.scan("/sys")
    virtio = [d for d in inv.devices if d.vendor == "0x1af4"]
    assert virtio, [d.bdf for d in inv.devices]
    assert all(d.driver == "virtio-pci" for d in virtio)
    for d in inv.devices:
        with open(f"/sys/bus/pci/devices/{d.bdf}/numa_node") as fh:
            raw = int(fh.read())
        assert d.numa_node == raw
        attrs = dra.attributes(d)
        assert attrs[ATTR_PCI_BUS_ID] == d.bdf
        assert attrs[ATTR_PCIE_ROOT] == os.path.realpath(f"/sys/bus/pci/devices/{d.bdf}").split("/")[3]
        if raw == -1:
            assert ATTR_NUMA_NODE not in attrs
    assert all(d.numa_node == -1 for d in virtio)
    assert all(ATTR_NUMA_NODE not in dra.attributes(d) for d in virtio)
    # The virtio network device carries the machine's interface.
    assert any(d.pci_class == "0x020000" and d.interfaces for d in virtio)
    assert inv.numa_nodes and inv.numa_nodes[0].id == 0 and inv.numa_nodes[0].cpulist


def test_a_gpu_on_numa_node_1_behind_a_root_port_gets_all_three_standard_attributes(tmp_path: Path) -> None:
    tree = SysfsTree(tmp_path)
    tree.add("0000:40:01.0", host_bridge="pci0000:40", vendor="0x1022", device="0x1483", cls="0x060400",
             driver="pcieport", numa=1, link=("32.0 GT/s PCIe", "32.0 GT/s PCIe", 16, 16))
    tree.add("0000:41:00.0", parent="0000:40:01.0", vendor="0x10de", device="0x2335", cls="0x030200",
             driver="nvidia", numa=1, link=("32.0 GT/s PCIe", "32.0 GT/s PCIe", 16, 16), aer=True)
    tree.add_hwmon("0000:41:00.0", 3, "gpu", 41.5, crit_c=95)
    tree.add_numa(0, "0-63", [10, 32])
    tree.add_numa(1, "64-127", [32, 10])
    inv = sysfs.scan(str(tmp_path))
    gpu = next(d for d in inv.devices if d.bdf == "0000:41:00.0")
    assert (gpu.vendor, gpu.device, gpu.pci_class, gpu.driver) == ("0x10de", "0x2335", "0x030200", "nvidia")
    assert gpu.is_nvidia_gpu and gpu.numa_node == 1 and gpu.pcie_root == "pci0000:40"
    assert gpu.link.current_speed == gpu.link.max_speed == 32.0 and gpu.link.max_width == 16
    assert gpu.aer == {"aer_dev_fatal": 0, "aer_dev_nonfatal": 0, "aer_dev_correctable": 0}
    assert [(t.sensor, t.celsius, t.crit_celsius) for t in gpu.temperatures] == [("gpu/temp1", 41.5, 95.0)]
    assert dra.attributes(gpu) == {
        ATTR_PCI_BUS_ID: "0000:41:00.0", ATTR_PCIE_ROOT: "pci0000:40", ATTR_NUMA_NODE: 1,
    }
    assert [(n.id, n.cpulist, n.distances) for n in inv.numa_nodes] == [(0, "0-63", (10, 32)), (1, "64-127", (32, 10))]


def test_missing_and_malformed_files_leave_fields_unknown(tmp_path: Path) -> None:
    tree = SysfsTree(tmp_path)
    p = tree.add("0000:05:00.0", vendor="0x8086", device="0x1593", cls="0x020000", numa=3)
    (p / "numa_node").write_text("banana\n")
    (p / "vendor").write_text("x" * 100_000)
    (p / "current_link_width").write_text("999\n")
    (p / "max_link_speed").write_text("Unknown\n")
    (p / "aer_dev_fatal").write_text("garbage\nTOTAL_ERR_FATAL notanumber\n\x00\xff\n")
    (p / "class").unlink()
    d = sysfs.read_device(str(tmp_path), "0000:05:00.0")
    assert d.numa_node == -1 and d.vendor == "" and d.pci_class == "" and d.driver == ""
    assert d.link.current_width == 0 and d.link.max_speed == 0.0
    assert d.aer == {"aer_dev_fatal": 0}
    assert ATTR_NUMA_NODE not in dra.attributes(d)
    # A tree without PCI devices, or no tree at all, is empty rather than an error.
    assert sysfs.scan(str(tmp_path / "nothing")).devices == ()


def test_a_bus_link_leaving_the_tree_gives_no_pcie_root(tmp_path: Path) -> None:
    tree = SysfsTree(tmp_path / "sys")
    outside = tmp_path / "elsewhere" / "pci0000:00" / "0000:00:09.0"
    outside.mkdir(parents=True)
    (outside / "vendor").write_text("0x1af4\n")
    (tmp_path / "sys" / "bus" / "pci" / "devices" / "0000:00:09.0").symlink_to(outside)
    del tree
    d = sysfs.read_device(str(tmp_path / "sys"), "0000:00:09.0")
    assert d.vendor == "0x1af4" and d.pcie_root == ""


@given(st.text(max_size=400))
def test_aer_and_speed_parsers_never_raise(text: str) -> None:
    v = sysfs.parse_aer(text)
    assert v is None or v >= 0
    assert sysfs.parse_speed(text) >= 0.0


def test_aer_parser_prefers_the_total_line() -> None:
    assert sysfs.parse_aer("RxErr 3\nBadTLP 2\nTOTAL_ERR_COR 7\n") == 7
    assert sysfs.parse_aer("RxErr 3\nBadTLP 2\n") == 5
    assert sysfs.parse_aer(None) is None


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=30,
)


@given(st.lists(_json, max_size=4), st.text(max_size=20))
def test_resource_slices_from_the_api_server_never_break_matching(items: list[object], bdf: str) -> None:
    index = dra.SliceIndex(items)
    assert isinstance(index.match(bdf, bdf), tuple)


def test_slice_matching_by_bus_id_and_uuid_newest_generation_only() -> None:
    def sl(driver: str, gen: int, devices: list[tuple[str, dict[str, object]]]) -> dict[str, object]:
        return {"spec": {"driver": driver, "nodeName": "n", "pool": {"name": "n", "generation": gen},
                         "devices": [{"name": n, "attributes": a} for n, a in devices]}}

    index = dra.SliceIndex([
        sl("gpu.nvidia.com", 2, [("gpu-0", {"uuid": {"string": "GPU-1"}, ATTR_PCI_BUS_ID: {"string": "0000:3B:00.0"}})]),
        sl("gpu.nvidia.com", 1, [("old", {"uuid": {"string": "GPU-1"}})]),
        sl("other.example.com", 1, [("x", {"other.example.com/uuid": {"string": "GPU-1"}, "pciBusID": {"string": "0000:3b:00.0"}})]),
    ])
    assert [(d.driver, d.device) for d in index.match("0000:3b:00.0", "GPU-1")] == [
        ("gpu.nvidia.com", "gpu-0"), ("other.example.com", "x")]
    # An unqualified pciBusID is a driver's own attribute, not the standard one.
    assert [d.device for d in index.match("0000:3b:00.0")] == ["gpu-0"]
    assert index.match("0000:00:01.0") == ()
