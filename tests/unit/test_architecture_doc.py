"""docs/architecture.md's tree names every module, script and benchmark there is, and nothing that is not.

The tree is the fenced block at the top: two spaces of indent per level,
a name ending in "/" opens a folder, a description starts past column 26
(lines indented further are continuations). Checked: every Python module
of node_agent/ and criu_bridge/ (generated code and `__init__.py` aside),
every module of bench/ and testbed/, every file in scripts/.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DESCRIPTION_COLUMN = 27


def _named() -> set[str]:
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = text.split("```\n", 2)[1]
    named: set[str] = set()
    folders: list[str] = []
    for line in block.splitlines():
        m = re.match(r"^( *)(\S+)", line)
        if not m or len(m.group(1)) >= DESCRIPTION_COLUMN - 1:
            continue  # a description's continuation
        folders = folders[: len(m.group(1)) // 2]
        name = m.group(2)
        if name.endswith("/"):
            folders.append(name)
        named.add("".join(folders) if name.endswith("/") else "".join(folders) + name)
    return named


def _present() -> set[str]:
    found = set()
    for top in ("node_agent", "criu_bridge", "bench", "testbed"):
        for path in (REPO / top).rglob("*.py"):
            rel = path.relative_to(REPO)
            if path.name != "__init__.py" and "_proto" not in rel.parts and "__pycache__" not in rel.parts:
                found.add(rel.as_posix())
    for path in (REPO / "scripts").iterdir():
        if path.name != "__pycache__":
            found.add(f"scripts/{path.name}/" if path.is_dir() else f"scripts/{path.name}")
    return found


def test_every_module_is_in_the_architecture_and_every_name_there_exists() -> None:
    named, present = _named(), _present()
    covered = {n for n in named if n.startswith(("node_agent/", "criu_bridge/", "bench/", "testbed/", "scripts/"))}
    assert sorted(present - covered) == [], "not in docs/architecture.md"
    missing = [n for n in covered if not (REPO / n).exists()]
    assert missing == [], "named in docs/architecture.md but absent"
