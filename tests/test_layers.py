"""The package's modules form layers: no import circle, and each imports on its own.

The graph is built from the package's own ``import numba_flash...`` / ``from numba_flash...
import ...`` statements, function-level (lazy) imports included: a lazy import that closes a
circle still ties the two modules together (``api`` -> ``research.tuning`` -> ``api`` was one).
"""

from __future__ import annotations

import ast
import graphlib
import pathlib
import subprocess
import sys

import pytest

import numba_flash

PACKAGE = pathlib.Path(numba_flash.__file__).parent


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def import_graph(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in its source).

    ``from numba_flash.x import y`` points at ``numba_flash.x.y`` when that is a module, else
    at ``numba_flash.x``. A submodule's implicit import of its parent package is not an edge
    (Python finishes the parent's ``__init__`` first; only what it imports explicitly counts).
    """
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.split(".")[0] == "numba_flash")
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against this module's package
                    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = package[: len(package) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                if module.split(".")[0] != "numba_flash":
                    continue
                for alias in node.names:
                    sub = f"{module}.{alias.name}"
                    deps.add(sub if sub in mods else module)
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def test_the_graph_sees_every_kind_of_import():
    """Guard for the parser itself: top-level, function-level and ``from package import
    module`` imports are all edges (so a lazy import closing a circle would be seen)."""
    graph = import_graph(modules())
    assert "numba_flash.kernels.tiles" in graph["numba_flash.api"]  # top-level from-import
    assert "numba_flash.api" in graph["numba_flash.research.tuning"]  # function-level import
    assert "numba_flash.online" in graph["numba_flash"]  # from numba_flash import online


def test_no_import_circle():
    graph = import_graph(modules())
    try:
        order = list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        pytest.fail(f"import circle: {' -> '.join(exc.args[1])}")
    # Layers: the tile cache below the API, autotuning above it.
    tuning = order.index("numba_flash.research.tuning")
    assert order.index("numba_flash.tile_cache") < order.index("numba_flash.api") < tuning


# Modules that import an optional extra when they are imported: import name of what they need.
NEEDS_EXTRA = {"numba_flash.torch": "torch"}


def test_every_module_imports_in_a_fresh_interpreter():
    """Each module imports (in order of the package listing, one interpreter, no GPU needed);
    a module of :data:`NEEDS_EXTRA` only where its extra is installed."""
    from numba_flash import needs

    names = [m for m in modules() if not m.endswith("__main__")
             and (m not in NEEDS_EXTRA or needs.module(NEEDS_EXTRA[m]) is None)]
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    done = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True,
                          cwd=PACKAGE.parent, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
