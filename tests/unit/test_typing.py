"""mypy --strict over the package, the benchmarks and the test bed (generated stubs excluded; pyproject.toml lists them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_mypy_strict() -> None:
    cp = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert cp.returncode == 0, cp.stdout + cp.stderr
