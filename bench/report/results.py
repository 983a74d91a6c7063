"""The results files: bench/results.json (bench/run.py: the latest run of each containerd version), and
where bench/encryption.py and bench/image_check.py keep theirs.

bench/results.json is `{"schema": 2, "latest": "2.1", "runs": {"2.1": RUN, "1.6": RUN}}`, a RUN being
what bench.report.targets.build returns.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any


BENCH_DIR = Path(__file__).resolve().parents[1]
RESULTS_JSON = BENCH_DIR / "results.json"
ENCRYPTION_JSON = BENCH_DIR / "encryption.json"
IMAGE_CHECK_JSON = BENCH_DIR / "image_check.json"
SCHEMA = 2


def series(version: str) -> str:
    """`2.1.9+unknown` -> `2.1`: the containerd version a results file keeps one run of."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return f"{m.group(1)}.{m.group(2)}" if m else version or "unknown"


def _series_key(s: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in s.split("."))
    except ValueError:
        return (0,)


def load(path: Path) -> dict[str, Any] | None:
    """A results file, in the current layout (one written by schema 1 held a single run)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    if isinstance(data.get("runs"), dict):
        return data
    if "machine" in data and "summary" in data:
        key = series(str(data["machine"].get("containerd", "")))
        return {"schema": SCHEMA, "latest": key, "runs": {key: data}}
    return None


def merge(old: dict[str, Any] | None, doc: dict[str, Any]) -> dict[str, Any]:
    """`old` with this run in place of the earlier one of its containerd version."""
    key = series(doc["machine"]["containerd"])
    runs = dict(old["runs"]) if old else {}
    runs[key] = doc
    return {"schema": SCHEMA, "latest": key, "runs": runs}


def series_order(merged: dict[str, Any]) -> list[str]:
    """The containerd versions of a results file, newest first."""
    return sorted(merged["runs"], key=_series_key, reverse=True)

