"""`devices ls` and `devices taints`: the daemon's device snapshot, for people and programs."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from node_agent.cli import output
from node_agent.cli.client import Client, pb
from node_agent.devices import taints
from node_agent.devices.types import DraDevice, TaintRule


def attribute_dict(a: Any) -> dict[str, Any]:
    """A DRA attribute as a ResourceSlice writes it: {"int": 1}, {"string": "..."}, ..."""
    which = a.WhichOneof("value")
    names = {"int_value": "int", "bool_value": "bool", "string_value": "string", "version_value": "version"}
    return {names[which]: getattr(a, which)} if which else {}


def device_dict(d: Any, dra_on: bool) -> dict[str, Any]:
    return {
        "bdf": d.bdf,
        "vendor": d.vendor,
        "device": d.device,
        "class": d.pci_class,
        "driver": d.driver,
        "name": d.name,
        "uuid": d.uuid,
        "attributes": {k: attribute_dict(v) for k, v in sorted(d.attributes.items())},
        "health": {
            "state": d.health.state,
            "reasons": [{"reason": r.reason, "severity": r.severity, "message": r.message, "since": r.since}
                        for r in d.health.reasons],
            **({"unmonitored": d.health.unmonitored} if d.health.unmonitored else {}),
        },
        "numa_node": d.numa_node,
        "pcie_root": d.pcie_root,
        "link": {"speed": d.link_speed, "max_speed": d.link_max_speed, "width": d.link_width,
                 "max_width": d.link_max_width},
        "aer": {k: int(v) for k, v in sorted(d.aer.items())},
        "temperatures": [{"sensor": t.sensor, "celsius": t.celsius, "max_celsius": t.max_celsius,
                          "crit_celsius": t.crit_celsius} for t in d.temperatures],
        "interfaces": list(d.interfaces),
        # Where a DRA driver publishes the device; unpublished devices get no rule.
        "dra": {
            "published": bool(d.dra) if dra_on else None,
            "devices": [{"driver": r.driver, "pool": r.pool, "device": r.device} for r in d.dra],
        },
    }


def snapshot_dict(s: Any) -> dict[str, Any]:
    dra_on = s.dra_status == "on"
    return {
        "node": s.node,
        "taken_at": s.taken_at,
        "dra_status": s.dra_status,
        "devices": [device_dict(d, dra_on) for d in s.devices],
        "numa_nodes": [{"id": n.id, "cpulist": n.cpulist, "distances": list(n.distances)} for n in s.numa_nodes],
    }


def rule_manifests(s: Any) -> list[dict[str, Any]]:
    out = []
    for r in s.taint_rules:
        rule = TaintRule(
            name=r.name, node=r.node, bdf=r.bdf, reason=r.reason,
            target=DraDevice(driver=r.target.driver, pool=r.target.pool, device=r.target.device),
            key=r.key, value=r.value, effect=r.effect, message=r.message,
        )
        out.append(taints.manifest(rule))
    return out


def _snapshot(args: argparse.Namespace) -> Any:
    with Client.of(args) as c:
        return c.call("ListDevices", pb.ListDevicesRequest(), timeout=30.0)


def _dra_column(d: Any, dra_on: bool) -> str:
    if not dra_on:
        return "-"
    if not d.dra:
        return "unpublished"
    return ",".join(f"{r.driver}/{r.pool}/{r.device}" for r in d.dra)


def cmd_ls(args: argparse.Namespace) -> int:
    snap = _snapshot(args)
    if args.output in output.DATA:
        output.emit(snapshot_dict(snap), args.output)
        return 0
    dra_on = snap.dra_status == "on"
    rows = []
    for d in snap.devices:
        reasons = ",".join(r.reason for r in d.health.reasons) or ("-" if not d.health.unmonitored else "nvml")
        rows.append([
            d.bdf, f"{d.vendor}:{d.device}", d.pci_class, d.driver or "-",
            str(d.numa_node) if d.numa_node >= 0 else "-", d.pcie_root or "-",
            d.health.state, reasons, _dra_column(d, dra_on),
        ])
    output.table(rows, ["BDF", "ID", "CLASS", "DRIVER", "NUMA", "ROOT", "HEALTH", "REASONS", "DRA"])
    if sys.stderr.isatty():
        sys.stderr.write(f"node {snap.node}: DeviceTaintRules {snap.dra_status}\n")
    return 0


def cmd_taints(args: argparse.Namespace) -> int:
    snap = _snapshot(args)
    docs = rule_manifests(snap)
    if args.output == "json":
        output.emit({"apiVersion": "v1", "kind": "List", "items": docs}, "json")
        return 0
    import yaml

    sys.stdout.write("---\n".join(yaml.safe_dump(d, sort_keys=False) for d in docs))
    if not docs:
        sys.stderr.write(f"no DeviceTaintRules for node {snap.node} (DRA: {snap.dra_status})\n")
    return 0


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("devices", help="the node's devices, their health and DRA device taints (through the daemon)")
    dsub = p.add_subparsers(dest="devices_command", required=True)
    ls = dsub.add_parser("ls", parents=[common], help="list PCI devices with health, NUMA and DRA attributes")
    output.add_flag(ls, "table")
    ls.set_defaults(func=cmd_ls)
    t = dsub.add_parser("taints", parents=[common], help="print the DeviceTaintRules the agent applies (kubectl-apply ready)")
    output.add_flag(t, None, default="yaml")
    t.set_defaults(func=cmd_taints)
