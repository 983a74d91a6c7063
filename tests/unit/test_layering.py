"""The import contracts in .importlinter hold: no cycles and the stated layering.

import-linter builds the graph with grimp, which counts function-local imports
and those under TYPE_CHECKING as well as module-level ones, so an import moved
into a function to dodge a cycle still counts as one.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _lint() -> tuple[int, str]:
    # In a process of its own: import-linter sets up logging and would disable the loggers
    # other tests capture.
    cp = subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
         "sys.exit(lint_imports(config_filename='.importlinter', no_cache=True, no_logo=True))"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={"PATH": "/usr/bin:/bin", "COLUMNS": "200", "PYTHONDONTWRITEBYTECODE": "1"},
    )
    return cp.returncode, cp.stdout + cp.stderr


def test_import_contracts_are_kept() -> None:
    rc, out = _lint()
    assert rc == 0, out[-6000:]
    # Every contract ran and was kept (one that failed to load would not be counted).
    contracts = (REPO / ".importlinter").read_text().count("[importlinter:contract:")
    assert contracts >= 7
    assert f"Contracts: {contracts} kept, 0 broken." in " ".join(out.split()), out[-3000:]


def test_no_hand_written_module_is_over_600_lines() -> None:
    long = {}
    for pkg in ("node_agent", "criu_bridge"):
        for path in (REPO / pkg).rglob("*.py"):
            if "_proto" in path.parts:
                continue
            n = len(path.read_text(encoding="utf-8").splitlines())
            if n > 600:
                long[str(path.relative_to(REPO))] = n
    assert not long, long
