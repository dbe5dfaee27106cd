"""No module of the package (or script) uses another module's private names: every name one
module takes from another is public in its owner (issue 22). Private modules of the package
(``numba_flash._cuda``, ``numba_flash._world``) are the package's own plumbing and may be
imported; their public names are what they offer."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(path: pathlib.Path) -> list[str]:
    """``from numba_flash.x import _name`` and ``module._name`` (``module`` an imported
    numba_flash module) in the file at ``path``, as ``"file:line: what"``."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    modules = {}  # local name -> numba_flash module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([source] if source else []))
            if not source.startswith("numba_flash"):
                continue
            for alias in node.names:
                if _private(alias.name) and source != me:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {source} import {alias.name}")
                modules[alias.asname or alias.name] = f"{source}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("numba_flash"):
                    local = alias.asname or alias.name.split(".")[0]
                    modules[local] = alias.name if alias.asname else local
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root, chain = node.value, []
            while isinstance(root, ast.Attribute):
                chain.append(root.attr)
                root = root.value
            if isinstance(root, ast.Name) and root.id in modules:
                owner = ".".join([modules[root.id], *reversed(chain)])
                if owner != me:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {owner}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    files = sorted((ROOT / "numba_flash").rglob("*.py")) + sorted((ROOT / "scripts").rglob("*.py"))
    assert files
    found = [use for path in files for use in private_uses(path)]
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_the_check_finds_both_forms(tmp_path, monkeypatch):
    """The scan above sees the two forms it forbids, and allows a module its own names."""
    pkg = tmp_path / "numba_flash"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "from numba_flash.b import _hidden, shown\n"
        "from numba_flash import b\n"
        "from . import c\n"
        "import numba_flash.d\n"
        "x = b._secret + c._other + numba_flash.d._deep + shown\n"
        "from numba_flash.a import _mine\n"
    )
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    found = private_uses(pkg / "a.py")
    assert sorted(use.split(": ", 1)[1] for use in found) == [
        "from numba_flash.b import _hidden", "numba_flash.b._secret", "numba_flash.c._other",
        "numba_flash.d._deep",
    ]
