"""Between the device monitor's snapshots and the `nodeagent.v1` device messages."""

from __future__ import annotations

from node_agent._proto.nodeagent.v1 import nodeagent_pb2 as pb
from node_agent.devices.types import AttrValue, DeviceReport, DraDevice, Snapshot, TaintRule, Version


def attribute(value: AttrValue | Version) -> pb.DeviceAttribute:
    if isinstance(value, Version):
        return pb.DeviceAttribute(version_value=value.value)
    if isinstance(value, bool):
        return pb.DeviceAttribute(bool_value=value)
    if isinstance(value, int):
        return pb.DeviceAttribute(int_value=value)
    return pb.DeviceAttribute(string_value=value)


def _ref(d: DraDevice) -> pb.DraDeviceRef:
    return pb.DraDeviceRef(driver=d.driver, pool=d.pool, device=d.device)


def device(rep: DeviceReport) -> pb.Device:
    p = rep.pci
    return pb.Device(
        bdf=p.bdf, vendor=p.vendor, device=p.device, pci_class=p.pci_class, driver=p.driver,
        attributes={k: attribute(v) for k, v in rep.attributes.items()},
        health=pb.DeviceHealth(
            state=rep.health.state, unmonitored=rep.health.unmonitored,
            reasons=[pb.DeviceHealthReason(reason=r.reason, severity=r.severity, message=r.message, since=r.since)
                     for r in rep.health.reasons],
        ),
        dra=[_ref(d) for d in rep.dra],
        numa_node=p.numa_node, pcie_root=p.pcie_root,
        link_speed=p.link.current_speed, link_max_speed=p.link.max_speed,
        link_width=p.link.current_width, link_max_width=p.link.max_width,
        aer={k: max(v, 0) for k, v in p.aer.items()},
        temperatures=[pb.DeviceTemperature(sensor=t.sensor, celsius=t.celsius, max_celsius=t.max_celsius,
                                           crit_celsius=t.crit_celsius) for t in p.temperatures],
        interfaces=list(p.interfaces), uuid=rep.uuid, name=rep.name,
    )


def rule(r: TaintRule) -> pb.DeviceTaintRuleInfo:
    return pb.DeviceTaintRuleInfo(name=r.name, node=r.node, bdf=r.bdf, reason=r.reason, target=_ref(r.target),
                                  key=r.key, value=r.value, effect=r.effect, message=r.message)


def snapshot(s: Snapshot) -> pb.DeviceSnapshot:
    return pb.DeviceSnapshot(
        node=s.node, taken_at=s.taken_at, generation=s.generation,
        devices=[device(d) for d in s.devices],
        numa_nodes=[pb.NumaNodeInfo(id=n.id, cpulist=n.cpulist, distances=list(n.distances)) for n in s.numa_nodes],
        taint_rules=[rule(r) for r in s.rules],
        dra_status=s.dra_status,
    )
