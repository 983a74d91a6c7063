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


# Every hand-written package of the repository: the agent, the restore bridge, the benchmarks,
# the test bed, and the tests' own packages.
PACKAGES = ("node_agent", "criu_bridge", "bench", "testbed", "tests")
# Where the 600-line rule holds (tests are exempt, as is generated code).
SIZED = ("node_agent", "criu_bridge", "bench", "testbed")
MAX_LINES = 600


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in edges.get(node, ()):
                    found.append(sorted(component))
    return found


def _cycle_path(edges: dict[str, set[str]], members: list[str]) -> str:
    """One concrete loop through a component, for the failure message: a -> b -> ... -> a."""
    inside = set(members)
    start = members[0]
    path = [start]
    seen = {start}
    node = start
    while True:
        nxt = sorted(edges[node] & inside)
        step = start if start in nxt and len(path) > 1 else next((n for n in nxt if n not in seen), start)
        path.append(step)
        if step == start or step in seen:
            return " -> ".join(path)
        seen.add(step)
        node = step


def test_cycle_finder_finds_loops_and_only_loops() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert sorted(_cycles(edges)) == [["a", "b", "c"], ["e"]]
    assert _cycle_path(edges, ["a", "b", "c"]) == "a -> b -> c -> a"


def test_no_import_cycle_anywhere_in_the_repository() -> None:
    import grimp

    graph = grimp.build_graph(
        *PACKAGES, include_external_packages=False, exclude_type_checking_imports=False, cache_dir=None,
    )
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    # Every package really was read (a misspelt or missing one would make the check vacuous).
    assert {m.split(".")[0] for m in edges} == set(PACKAGES)
    loops = [_cycle_path(edges, c) for c in _cycles(edges)]
    assert loops == [], "import cycles (function-local and TYPE_CHECKING imports count):\n" + "\n".join(loops)


def test_no_hand_written_module_is_over_600_lines() -> None:
    long = {}
    for pkg in SIZED:
        for path in (REPO / pkg).rglob("*.py"):
            if "_proto" in path.parts:
                continue
            n = len(path.read_text(encoding="utf-8").splitlines())
            if n > MAX_LINES:
                long[str(path.relative_to(REPO))] = n
    assert not long, long
