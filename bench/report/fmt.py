"""How figures and targets are written: seconds, milliseconds, MiB, a target's ratio, limit and verdict,
and tables as text and as Markdown.
"""

from __future__ import annotations

import math
from typing import Any, Callable


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f} ms"


def s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 1048576:.1f} MiB"


def pct(x: float | None) -> str:
    """A share (0..1) as a percentage."""
    return "-" if x is None else f"{x * 100:.0f}%"


def mbps(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f} MB/s"


def times(x: float | None) -> str:
    """A ratio, as "0.006x"."""
    return "-" if x is None else f"{x:.3f}x"


def target(key: str, title: str, measured: str, ratio: float | None, limit: float, strict: bool = False,
            unit: str = "x") -> dict[str, Any]:
    ok: bool | None = None
    margin: float | None = None
    if ratio is not None and math.isfinite(ratio):
        ok = ratio < limit if strict else ratio <= limit
        margin = round((ratio / limit - 1) * 100, 1)
    return {"key": key, "title": title, "measured": measured, "ratio": ratio, "limit": limit,
            "op": "<" if strict else "<=", "unit": unit, "pass": ok, "margin_pct": margin}


def verdict(t: dict[str, Any]) -> str:
    if t["pass"] is None:
        return "n/a"
    m = t["margin_pct"]
    if t["pass"]:
        return f"PASS ({-m:.0f}% under the limit)" if m < 0 else "PASS (at the limit)"
    return f"MISS (by {m:.0f}%)" if m > 0 else "MISS (at the limit)"


def ratio(t: dict[str, Any]) -> str:
    r = t["ratio"]
    if r is None:
        return "-"
    if t["unit"] == "fraction":
        return f"{r * 100:.2f}%"
    if t["unit"].startswith("of "):
        return f"{r:.2f} x {t['unit'][3:]}"
    return f"{r:.2f}x"


def limit(t: dict[str, Any]) -> str:
    if t["unit"] == "fraction":
        return f"{t['op']} {t['limit'] * 100:.0f}%"
    if t["unit"].startswith("of "):
        return f"{t['op']} {t['unit'][3:]}"
    return f"{t['op']} {t['limit']:.2f}x"


def text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [len(h) for h in header]
    for r in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, r)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n"


def md_table(header: list[str], rows: list[list[str]]) -> str:
    esc: Callable[[str], str] = lambda c: c.replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(esc(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def loadavg(la: dict[str, Any] | None, cores: int | None) -> str:
    if not la:
        return "-"
    three: Callable[[list[float]], str] = lambda xs: " ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    full = f" ({cores} cores: {cores}.0 is a busy machine)" if cores else ""
    if not la.get("end"):
        return f"{three(la['start'])} at the start{full}"
    return f"{three(la['start'])} at the start, {three(la['end'])} at the end{full}"
