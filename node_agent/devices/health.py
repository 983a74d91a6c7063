"""The health model: readings -> signals -> conditions with hysteresis -> a state.

`signals()` says which conditions one poll shows for one device. A
`Tracker` per device debounces them: a level condition counts only after
`raise-polls` consecutive polls, an event at once; a condition that counts
is over only after `clear-seconds` without it. `HealthModel` keeps the
trackers and the previous readings (error counters count when they rise).
Every transition is logged with its reason. Pure apart from logging; the
clock is passed in.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from node_agent.config.schema import Devices
from node_agent.devices.types import (
    DEGRADED,
    HEALTHY,
    UNHEALTHY,
    UNMONITORED,
    GpuReading,
    GpuScan,
    Health,
    PciDevice,
    Reason,
    Signal,
)

log = logging.getLogger(__name__)

RECOVERY_ACTIONS = {
    1: "GPU reset",
    2: "node reboot",
    3: "drain peer-to-peer traffic",
    4: "drain and reset",
    5: "recover the IMEX domain",
    6: "bus reset",
    7: "system reboot",
}
_RANK = {HEALTHY: 0, UNMONITORED: 1, DEGRADED: 2, UNHEALTHY: 3}


def _fmt(v: float) -> str:
    return f"{v:g}"


def pci_signals(pci: PciDevice, prev: PciDevice | None, policy: Devices) -> list[Signal]:
    """What sysfs shows: a narrow or slow link, rising AER counters, hot sensors."""
    out: list[Signal] = []
    link = pci.link
    if link.current_width and link.max_width and link.current_width < link.max_width:
        out.append(Signal("link-width", DEGRADED, f"PCIe link x{link.current_width} of x{link.max_width}"))
    if policy.check_link_speed and link.current_speed and link.max_speed and link.current_speed < link.max_speed:
        out.append(Signal("link-speed", DEGRADED,
                          f"PCIe link {_fmt(link.current_speed)} GT/s of {_fmt(link.max_speed)} GT/s"))
    if prev is not None:
        for name, reason in (("aer_dev_fatal", "aer-fatal"), ("aer_dev_nonfatal", "aer-nonfatal")):
            now, before = pci.aer.get(name), prev.aer.get(name)
            if now is not None and before is not None and now > before:
                out.append(Signal(reason, DEGRADED, f"{name} rose from {before} to {now}", event=True))
    hot = []
    for t in pci.temperatures:
        limit = t.max_celsius or t.crit_celsius or policy.temperature_max
        if t.celsius >= limit - policy.temperature_margin:
            hot.append(f"{t.sensor} {_fmt(t.celsius)}C >= {_fmt(limit)}C")
    if hot:
        out.append(Signal("temperature", UNHEALTHY, "; ".join(hot)))
    return out


def gpu_signals(gpu: GpuReading, policy: Devices) -> list[Signal]:
    """What NVML shows about one GPU."""
    out: list[Signal] = []
    if gpu.temperature is not None:
        limit = gpu.slowdown_celsius or policy.temperature_max
        what = "slowdown" if gpu.slowdown_celsius else "temperature-max"
        if gpu.temperature >= limit - policy.temperature_margin:
            out.append(Signal("temperature", UNHEALTHY, f"GPU {_fmt(gpu.temperature)}C >= {what} {_fmt(limit)}C"))
    if gpu.ecc_uncorrected_volatile:
        out.append(Signal("ecc-uncorrected", UNHEALTHY,
                          f"{gpu.ecc_uncorrected_volatile} uncorrected ECC error(s) since the driver loaded"))
    if gpu.retired_pages_pending:
        out.append(Signal("retired-pages-pending", DEGRADED, "retired pages wait for a GPU reset"))
    if gpu.remap_failure:
        out.append(Signal("row-remap-failure", UNHEALTHY, "a memory row could not be remapped"))
    elif gpu.remap_pending:
        out.append(Signal("row-remap-pending", DEGRADED, "remapped rows wait for a GPU reset"))
    if gpu.recovery_action:
        what = RECOVERY_ACTIONS.get(gpu.recovery_action, f"action {gpu.recovery_action}")
        out.append(Signal("recovery-action", UNHEALTHY, f"NVML asks for recovery: {what}"))
    critical = [x for x in gpu.xids if x not in policy.xid_ignore]
    if critical:
        out.append(Signal("xid", UNHEALTHY, "Xid " + ", ".join(str(x) for x in sorted(set(critical))), event=True))
    return out


@dataclass
class _Track:
    severity: str
    message: str
    streak: int = 0
    active: bool = False
    since: float = 0.0
    last_held: float = 0.0


@dataclass
class Tracker:
    """The conditions of one device, debounced."""

    bdf: str
    policy: Devices
    tracks: dict[str, _Track] = field(default_factory=dict)

    def update(self, now: float, wall: float, held: list[Signal]) -> None:
        """One poll at monotonic `now` (`wall`: unix seconds, for `since`)."""
        seen = set()
        for sig in held:
            if sig.reason in seen:
                continue
            seen.add(sig.reason)
            t = self.tracks.get(sig.reason)
            if t is None:
                t = self.tracks[sig.reason] = _Track(sig.severity, sig.message)
            t.streak += 1
            t.last_held = now
            t.message, t.severity = sig.message, sig.severity
            if not t.active and (sig.event or t.streak >= self.policy.raise_polls):
                t.active, t.since = True, wall
                log.warning("device %s %s: %s (%s)", self.bdf, t.severity, sig.reason, sig.message,
                            extra={"phase": "devices", "device": self.bdf, "reason": sig.reason})
        for reason in list(self.tracks):
            if reason in seen:
                continue
            t = self.tracks[reason]
            t.streak = 0
            if not t.active:
                del self.tracks[reason]
            elif now - t.last_held >= self.policy.clear_seconds:
                del self.tracks[reason]
                log.warning("device %s recovered from %s (clear for %gs; was: %s)", self.bdf, reason,
                            now - t.last_held, t.message,
                            extra={"phase": "devices", "device": self.bdf, "reason": reason})

    def reasons(self) -> tuple[Reason, ...]:
        return tuple(
            Reason(reason=r, severity=t.severity, message=t.message, since=t.since)
            for r, t in sorted(self.tracks.items()) if t.active
        )


def state_of(reasons: tuple[Reason, ...], unmonitored: str) -> str:
    state = UNMONITORED if unmonitored else HEALTHY
    for r in reasons:
        if _RANK[r.severity] > _RANK[state]:
            state = r.severity
    return state


class HealthModel:
    """Trackers and previous readings for every device seen."""

    def __init__(self, policy: Devices) -> None:
        self.policy = policy
        self._trackers: dict[str, Tracker] = {}
        self._prev: dict[str, PciDevice] = {}
        self._unmonitored: dict[str, str] = {}

    def observe(self, now: float, wall: float, devices: tuple[PciDevice, ...], gpus: GpuScan) -> dict[str, Health]:
        """One poll of every device; the health of each, by BDF."""
        by_bdf = {g.bdf: g for g in gpus.readings}
        out: dict[str, Health] = {}
        for pci in devices:
            held = pci_signals(pci, self._prev.get(pci.bdf), self.policy)
            unmonitored = ""
            gpu = by_bdf.get(pci.bdf)
            if gpu is not None and not gpu.error:
                held += [s for s in gpu_signals(gpu, self.policy) if s.reason not in {h.reason for h in held}]
            elif gpu is not None:
                unmonitored = f"NVML: {gpu.error}"
            elif pci.is_nvidia_gpu:
                unmonitored = f"NVML: {gpus.error or 'the GPU is not among the devices NVML lists'}"
            self._note_unmonitored(pci.bdf, unmonitored)
            tracker = self._trackers.get(pci.bdf)
            if tracker is None:
                tracker = self._trackers[pci.bdf] = Tracker(pci.bdf, self.policy)
            tracker.update(now, wall, held)
            reasons = tracker.reasons()
            out[pci.bdf] = Health(state=state_of(reasons, unmonitored), reasons=reasons, unmonitored=unmonitored)
            self._prev[pci.bdf] = pci
        for gone in set(self._trackers) - set(out):
            log.warning("device %s is gone", gone, extra={"phase": "devices", "device": gone})
            del self._trackers[gone]
            self._prev.pop(gone, None)
            self._unmonitored.pop(gone, None)
        return out

    def _note_unmonitored(self, bdf: str, why: str) -> None:
        before = self._unmonitored.get(bdf, "")
        if why and why != before:
            log.warning("device %s is unmonitored: %s", bdf, why, extra={"phase": "devices", "device": bdf})
        elif before and not why:
            log.info("device %s is monitored again", bdf, extra={"phase": "devices", "device": bdf})
        if why:
            self._unmonitored[bdf] = why
        else:
            self._unmonitored.pop(bdf, None)
