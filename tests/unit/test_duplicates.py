"""No new near-copies of code across the package, the benchmarks and the test bed.

pylint's duplicate-code check (configured in pyproject.toml: six or more similar lines, imports,
docstrings, comments and signatures aside) runs over every hand-written package. Each pair of
modules it still reports is listed in ALLOWED with the reason the copy stays; a pair that is not
listed fails, and so does a listed pair that is no longer reported (the list only shrinks).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHECKED = ("node_agent", "criu_bridge", "bench", "testbed")

# (module, module), in sorted order -> why the near-copy stays.
ALLOWED: dict[tuple[str, str], str] = {}


def reported() -> set[tuple[str, str]]:
    cp = subprocess.run(
        [sys.executable, "-m", "pylint", "--output-format=json", "--score=n", *CHECKED],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    # pylint's exit status is a bit mask of the message kinds it emitted; 32 is a usage error.
    assert cp.returncode & 32 == 0 and cp.stdout.strip().startswith("["), cp.stdout[-3000:] + cp.stderr[-3000:]
    pairs = set()
    for message in json.loads(cp.stdout):
        assert message["symbol"] == "duplicate-code", message
        modules = re.findall(r"^==([\w.]+):\[", message["message"], re.M)
        assert len(modules) >= 2, message["message"]
        for i, a in enumerate(modules):
            for b in modules[i + 1:]:
                if a != b:
                    pairs.add((min(a, b), max(a, b)))
    return pairs


def test_no_near_copy_beyond_the_listed_ones() -> None:
    found = reported()
    new = sorted(found - ALLOWED.keys())
    gone = sorted(ALLOWED.keys() - found)
    assert new == [], "near-copies (run `.venv/bin/python -m pylint " + " ".join(CHECKED) + "` for the lines)"
    assert gone == [], "listed in ALLOWED but no longer reported: remove them from the list"
