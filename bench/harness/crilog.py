"""Timestamps from CRI log files and containerd's log, read incrementally.

A CRI log line is `<RFC3339Nano time> <stream> <P|F> <text>`; containerd
stamps it when it reads the line from the container's pipe. A ticker that
prints `tick N` every few milliseconds therefore leaves a gap in those
stamps exactly as long as it could not run: the largest gap within an
operation's time span is the frozen window seen from outside.
"""

from __future__ import annotations

import calendar
import os
import re
import time
from dataclasses import dataclass

from bench.harness.base import BenchError, wait_until

_SECONDS_CACHE: dict[str, int] = {}


def parse_ts(text: str) -> float:
    """Seconds since the epoch from an RFC 3339 time with up to nanoseconds."""
    if text.endswith(("Z", "z")):
        body, offset = text[:-1], 0
    elif len(text) > 6 and text[-6] in "+-" and text[-3] == ":":
        body = text[:-6]
        offset = int(text[-5:-3]) * 3600 + int(text[-2:]) * 60
        if text[-6] == "-":
            offset = -offset
    else:
        raise ValueError(f"no time zone in {text!r}")
    whole, _, frac = body.partition(".")
    secs = _SECONDS_CACHE.get(whole)
    if secs is None:
        secs = calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S"))
        if len(_SECONDS_CACHE) > 100_000:
            _SECONDS_CACHE.clear()
        _SECONDS_CACHE[whole] = secs
    if frac and not frac.isdigit():
        raise ValueError(f"bad fraction in {text!r}")
    return secs + (int(frac) / 10 ** len(frac) if frac else 0.0) - offset


def tick_time(line: str) -> float | None:
    """The stamp of a CRI log line that carries `tick N` on stdout, else None."""
    parts = line.split(" ", 3)
    if len(parts) < 4 or parts[1] != "stdout" or not parts[3].startswith("tick "):
        return None
    try:
        return parse_ts(parts[0])
    except ValueError:
        return None


def tick_stamps(path: str) -> list[float]:
    """Every tick stamp in a CRI log file, in order."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return [t for t in (tick_time(line) for line in fh) if t is not None]
    except OSError:
        return []


def largest_gap(stamps: list[float]) -> float:
    """The largest difference between consecutive stamps (0 for fewer than two)."""
    return max((b - a for a, b in zip(stamps, stamps[1:])), default=0.0)


class _Tail:
    """Complete lines appended to a file since the last read."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0
        self._partial = b""

    def lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self._partial + data
        cut = data.rfind(b"\n") + 1
        self._partial = data[cut:]
        return data[:cut].decode("utf-8", "replace").splitlines()


@dataclass
class Gap:
    """The largest tick gap around an operation, in milliseconds."""

    gap_ms: float
    ticks: int  # tick lines that fell inside the span


class TickLog:
    """The tick stamps of one container's CRI log file."""

    def __init__(self, path: str) -> None:
        self._tail = _Tail(path)
        self.path = path
        self.count = 0
        self.last: float | None = None
        self._since: list[float] = []
        self._before: float | None = None

    def _read(self) -> None:
        for line in self._tail.lines():
            ts = tick_time(line)
            if ts is not None:
                self.count += 1
                self.last = ts
                self._since.append(ts)

    def poll(self) -> int:
        """Reads what is new; returns the number of ticks seen so far."""
        self._read()
        return self.count

    def mark(self) -> None:
        """Start of an operation: what was logged so far lies before it."""
        self._read()
        self._before = self.last
        self._since = []

    def gap_since_mark(self, t_end: float, *, timeout: float = 15.0) -> Gap:
        """The largest gap from the last tick before `mark()` through the first
        tick after `t_end` (seconds since the epoch). Waits, up to `timeout`,
        for that first tick after `t_end`."""
        def ticked() -> bool:
            self._read()
            return any(ts > t_end for ts in self._since)

        wait_until(ticked, timeout, f"a tick in {self.path} after the operation", interval=0.01,
                   failure=f"no tick in {self.path} within {timeout:g}s after the operation", error=TimeoutError)
        stamps = [] if self._before is None else [self._before]
        inside = 0
        for ts in self._since:
            stamps.append(ts)
            if ts > t_end:
                break
            inside += 1
        if len(stamps) < 2:
            raise ValueError(f"too few ticks in {self.path} to measure a gap")
        return Gap(round(largest_gap(stamps) * 1000, 2), inside)


_TIME_RE = re.compile(r'time="([^"]+)"')


class ContainerdLog:
    """When containerd logged StartContainer's start and success for a container."""

    def __init__(self, path: str) -> None:
        self._tail = _Tail(path)
        try:
            self._tail.offset = os.path.getsize(path)
        except OSError:
            pass
        self._starts: dict[str, float] = {}
        self._ends: dict[str, float] = {}

    def _read(self) -> None:
        for line in self._tail.lines():
            if "StartContainer for" not in line:
                continue
            m = _TIME_RE.search(line)
            cid = re.search(r'StartContainer for \\?"([0-9a-f]{64})\\?"', line)
            if not m or not cid:
                continue
            try:
                ts = parse_ts(m.group(1))
            except ValueError:
                continue
            if "returns successfully" in line:
                self._ends[cid.group(1)] = ts
            else:
                self._starts[cid.group(1)] = ts

    def start_ms(self, container_id: str, *, timeout: float = 10.0) -> float | None:
        """StartContainer's duration as containerd logged it; None if it did not."""
        def logged() -> bool:
            self._read()
            return container_id in self._starts and container_id in self._ends

        try:
            wait_until(logged, timeout, f"StartContainer of {container_id[:13]} in containerd's log")
        except BenchError:
            return None
        return round((self._ends[container_id] - self._starts[container_id]) * 1000, 1)
