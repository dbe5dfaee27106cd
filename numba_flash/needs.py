"""What an optional part of numba_flash needs, said in one line before it does any work.

The library needs numba-cuda and NumPy. Everything else is optional: packages that the extras
of setup.cfg install (:data:`EXTRAS`), tools of the CUDA toolkit (``ncu``, ``compute-sanitizer``,
``cuobjdump``), and a GPU. A command or script names what it needs; each of :func:`module`,
:func:`tool` and :func:`gpu` answers ``None`` when it is here, else a phrase saying what is
missing and how to get it. :func:`unmet` makes the one line of those phrases
(``"regimes.py needs a CUDA GPU (...) and cupy (pip install 'numba-flash[cuda13]', or [cuda12])"``),
:func:`exit_unless` prints it and exits with status 2, and :func:`require_module` imports a
module or raises ``ImportError`` with that line.
"""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import sys

# Import name -> the extra of setup.cfg that installs it (tests/host/test_needs.py checks them there).
EXTRAS = {
    "cupy": "cuda13",  # (or cuda12)
    "torch": "torch",
    "matplotlib": "plot",
    "ml_dtypes": "bfloat16",
}
EXIT_STATUS = 2  # what a command or script returns when something it needs is missing


def install_hint(name: str) -> str:
    """The pip command that installs the import ``name`` (a key of :data:`EXTRAS`)."""
    hint = f"pip install 'numba-flash[{EXTRAS[name]}]'"
    return hint + ", or [cuda12]" if name == "cupy" else hint


def module(name: str) -> str | None:
    """``None`` when ``name`` can be imported here, else ``"name (pip install ...)"``."""
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module set to None
        found = False
    return None if found else f"{name} ({install_hint(name)})"


def tool(name: str, how: str) -> str | None:
    """``None`` when the executable ``name`` (a command on PATH or a path) is here, else
    ``"name (how)"``, ``how`` saying where it comes from."""
    return None if shutil.which(name) else f"{name} ({how})"


def gpu() -> str | None:
    """``None`` when the kernels run on a CUDA GPU here, else a phrase saying they would not."""
    from numba_flash._world import choose_world, simulated

    choose_world()
    return "a CUDA GPU (Numba runs in its CUDA simulator here)" if simulated() else None


def unmet(what: str, *needs: str | None) -> str | None:
    """One line: ``what`` needs the phrases of ``needs`` that are not ``None``; ``None`` when
    every need is met."""
    missing = [need for need in needs if need]
    if not missing:
        return None
    listed = missing[0] if len(missing) == 1 else ", ".join(missing[:-1]) + " and " + missing[-1]
    return f"{what} needs {listed}"


def exit_unless(what: str, *needs: str | None, instead: str | None = None) -> None:
    """Return when every need is met; else print :func:`unmet`'s line on stderr (and after a
    semicolon ``instead``: what can be done here) and exit with :data:`EXIT_STATUS`."""
    line = unmet(what, *needs)
    if line is not None:
        print(line if instead is None else f"{line}; {instead}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_STATUS)


def require_module(name: str, what: str):
    """The module ``name``, imported; ``ImportError`` naming it and its install hint when it is
    not installed (an installed module that fails to import raises its own error)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        raise ImportError(unmet(what, module(name)) or f"{what} needs {name}", name=name) from None
