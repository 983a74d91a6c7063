"""The restore wrapper's import path is standard library only.

containerd runs the wrapper (`criu_bridge.wrapper`) from a runtime bundle
that holds criu_bridge and the standard library, nothing else. So every
module it imports, at the top or inside a function, and every module those
import, must come from the standard library or criu_bridge. The check runs
in a fresh interpreter whose import system refuses everything else,
protobuf and grpc included, although the virtual environment has them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CHECK = r'''
import ast
import importlib
import importlib.machinery
import importlib.util
import json
import sys

sys.path.insert(0, sys.argv[1])
assert "google" not in sys.modules and "grpc" not in sys.modules, sorted(sys.modules)
# protobuf is reachable from here, so the blocker below is what keeps it out.
assert importlib.machinery.PathFinder.find_spec("google") is not None


class StandardLibraryOnly:
    """A meta path finder that refuses every top-level name but the standard library's and criu_bridge."""

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in sys.stdlib_module_names or top == "criu_bridge":
            return None
        raise ImportError(f"{name} is not in the standard library")


sys.meta_path.insert(0, StandardLibraryOnly())
for name in ("google.protobuf", "grpc", "node_agent", "zstandard"):
    try:
        importlib.import_module(name)
    except ImportError:
        pass
    else:
        raise AssertionError(f"{name} was not blocked")


def runtime_imports(tree):
    """Every import statement of a module, at the top or in a function, but those under TYPE_CHECKING."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imported_modules(module):
    with open(module.__file__, encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    for node in runtime_imports(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
            continue
        base = importlib.util.resolve_name("." * node.level + (node.module or ""), module.__package__)
        yield base
        for alias in node.names:
            candidate = f"{base}.{alias.name}"
            try:
                if importlib.util.find_spec(candidate) is not None:
                    yield candidate  # a submodule: `from criu_bridge import locks`
            except ModuleNotFoundError:
                pass


todo, seen, stdlib = ["criu_bridge.wrapper"], set(), set()
while todo:
    name = todo.pop()
    if name in seen:
        continue
    seen.add(name)
    module = importlib.import_module(name)
    for child in imported_modules(module):
        if child.partition(".")[0] == "criu_bridge":
            todo.append(child)
        else:
            importlib.import_module(child)
            stdlib.add(child)
print(json.dumps({"criu_bridge": sorted(seen), "stdlib": sorted(stdlib), "loaded": sorted(sys.modules)}))
'''


def test_the_wrapper_and_everything_it_imports_need_only_the_standard_library() -> None:
    proc = subprocess.run([sys.executable, "-I", "-c", _CHECK, str(ROOT)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert {"criu_bridge.wrapper", "criu_bridge.locks", "criu_bridge.logs", "criu_bridge.errors",
            "criu_bridge.rootfs.apply", "criu_bridge.rootfs.tree", "criu_bridge.rootfs.common",
            "criu_bridge.tarstream"} <= set(found["criu_bridge"])
    assert {"json", "subprocess"} <= set(found["stdlib"])
    assert "criu_bridge.rpc" not in found["loaded"]
    assert not any(name.partition(".")[0] in ("google", "grpc", "node_agent") for name in found["loaded"])
