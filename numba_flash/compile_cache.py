"""The persistent compilation cache: compiled kernels kept on disk across processes.

numba compiles a kernel the first time a process launches it (typing, lowering, NVVM, ptxas:
1-9 s per configuration on the H200 machine) and keeps it only in memory. This module keeps
the linked cubin of every kernel that ``numba_flash.launch`` compiles, so that a new process's
first call of a configuration compiled before loads it instead (``API.md`` section 7).

Where: ``$NUMBA_FLASH_CACHE_DIR``, else ``$XDG_CACHE_HOME/numba_flash``, else
``~/.cache/numba_flash`` (:func:`cache_root`); the kernels under ``kernels/`` there, one file
per compiled kernel (:func:`entry_path`).

Keyed by (:func:`entry_key`):

- the kernel: its factory's qualified name and arguments (``kernels.jit.kernel_factory``
  gives every memoised kernel this identity), and the argument types it was compiled for;
- the sources: a digest of every ``.py`` file of the installed package (:func:`source_digest`),
  so that a reinstall of the same sources keeps the cache and any edit invalidates it;
- the GPU's compute capability, the toolchain (Python, numba, numba-cuda, llvmlite, NVVM, the
  CUDA driver) and the environment that steers compilation (``NUMBA_*`` and ``NUMBA_FLASH_*``
  variables, the experiment switches among them).

An entry is one file: a JSON header (what it is, for ``numba-flash cache info``) and the cubin.
It is written to a temporary file in the same folder and renamed into place (``os.replace`` is
atomic), so concurrent processes never read half an entry: two that compile the same kernel at
once both write it, and either file is whole. A file that does not parse is ignored and
rewritten. Kernels without an identity (made outside a ``kernel_factory``) and kernels that
need numba's module setup are compiled as before and not stored. The simulator compiles
nothing and uses no cache.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import platform
import struct
import tempfile
import time

FORMAT = 1  # bumped when an entry's layout changes (older entries are then never read)
CACHE_DIR_VAR = "NUMBA_FLASH_CACHE_DIR"
_MAGIC = b"NFKC"  # an entry: magic, u32 header length, JSON header, cubin
_SUFFIX = ".nfk"


def cache_root() -> pathlib.Path:
    """The folder of numba_flash's caches (compiled kernels, autotuned tiles)."""
    explicit = os.environ.get(CACHE_DIR_VAR)
    if explicit:
        return pathlib.Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "numba_flash"


def kernels_dir() -> pathlib.Path:
    return cache_root() / "kernels"


@functools.lru_cache(maxsize=4)
def source_digest(package: pathlib.Path | None = None) -> str:
    """sha256 of the package's Python sources (relative path and bytes of every ``.py`` file;
    ``package``: the folder of an installed copy, default this one), computed once per process."""
    package = pathlib.Path(__file__).resolve().parent if package is None else pathlib.Path(package)
    h = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        h.update(path.relative_to(package).as_posix().encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


@functools.lru_cache(maxsize=1)
def toolchain() -> dict:
    """What compiles and loads a kernel: Python, numba, numba-cuda, llvmlite, NVVM and the CUDA
    driver's versions (asked once per process)."""
    found = {"python": platform.python_version(), "numba": _version("numba"),
             "numba-cuda": _version("numba-cuda"), "llvmlite": _version("llvmlite")}
    try:
        from numba.cuda.cudadrv import nvvm
        from numba.cuda.cudadrv.driver import driver

        found["nvvm"] = ".".join(map(str, nvvm.NVVM().get_version()))
        found["driver"] = ".".join(map(str, driver.get_version()))
    except Exception as exc:  # (no toolkit: nothing compiles either; the key says why)
        found["nvvm"] = f"unavailable: {type(exc).__name__}"
    return found


def compile_environment() -> dict:
    """The environment variables that steer what numba (``NUMBA_*``) and numba_flash's
    experiment switches (``NUMBA_FLASH_*``) compile; the cache folder's own variable excluded."""
    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith("NUMBA_") and k != CACHE_DIR_VAR}


def entry_key(identity: str, signature: str, compute_capability) -> tuple[str, dict]:
    """(sha256 hex, the header that was hashed) of one compiled kernel."""
    header = {
        "format": FORMAT,
        "kernel": identity,
        "signature": signature,
        "cc": list(compute_capability),
        "sources": source_digest(),
        "toolchain": toolchain(),
        "environment": compile_environment(),
    }
    text = json.dumps(header, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest(), header


def entry_path(key: str) -> pathlib.Path:
    return kernels_dir() / key[:2] / f"{key}{_SUFFIX}"


def read_entry(path: pathlib.Path) -> tuple[dict, bytes] | None:
    """(header, cubin) of the entry at ``path``; ``None`` when absent, unreadable or not whole."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < 8 or data[:4] != _MAGIC:
        return None
    (n,) = struct.unpack("<I", data[4:8])
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError:
        return None
    cubin = data[8 + n :]
    if not isinstance(header, dict) or len(cubin) != header.get("cubin_bytes", -1):
        return None
    return header, cubin


def write_atomically(path: pathlib.Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the whole new one: a
    temporary file in the same folder (``.tmp-*``), renamed into place. ``OSError`` when the
    folder cannot be written (no temporary file is left behind)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_entry(path: pathlib.Path, header: dict, cubin: bytes) -> bool:
    """Store ``cubin`` with ``header`` at ``path`` atomically (:func:`write_atomically`). False
    when the folder cannot be written (the cache is then only skipped: compiling never fails
    for it)."""
    header = dict(header, cubin_bytes=len(cubin), created=time.time())
    blob = json.dumps(header, sort_keys=True).encode()
    try:
        write_atomically(path, _MAGIC + struct.pack("<I", len(blob)) + blob + cubin)
    except OSError:
        return False
    return True


def lookup(identity: str, signature: str, compute_capability) -> tuple[str, bytes] | None:
    """(entry name, cubin) of a kernel compiled before under the same key, or ``None``."""
    key, header = entry_key(identity, signature, compute_capability)
    found = read_entry(entry_path(key))
    if found is None:
        return None
    stored, cubin = found
    if any(stored.get(k) != v for k, v in header.items()) or not stored.get("entry_name"):
        return None  # (a hash collision or a foreign file: never load what was not asked for)
    return stored["entry_name"], cubin


def store(identity: str, signature: str, compute_capability, entry_name: str, cubin: bytes) -> bool:
    key, header = entry_key(identity, signature, compute_capability)
    return write_entry(entry_path(key), dict(header, entry_name=entry_name), cubin)


# ---------------------------------------------------------------------------------------------
# ``numba-flash cache info|clear``


def entries() -> list[pathlib.Path]:
    root = kernels_dir()
    return sorted(root.glob(f"*/*{_SUFFIX}")) if root.is_dir() else []


def info() -> dict:
    """What the cache holds: its folder, entries, bytes, and how many were compiled from this
    install's sources against stale ones (other sources, or files that do not parse); an entry
    of these sources compiled by another toolchain or for another GPU counts as usable here."""
    usable = stale = size = 0
    here = {"sources": source_digest(), "format": FORMAT}
    for path in entries():
        size += path.stat().st_size
        found = read_entry(path)
        if found is not None and all(found[0].get(k) == v for k, v in here.items()):
            usable += 1
        else:
            stale += 1
    return {"folder": str(kernels_dir()), "entries": usable + stale, "usable": usable, "stale": stale,
            "bytes": size, "sources": here["sources"][:12]}


def clear(stale_only: bool = False) -> tuple[int, int]:
    """Delete the cache's entries (``stale_only``: those this install cannot use); returns
    (files removed, bytes freed). Temporary files of interrupted writes go too."""
    removed = freed = 0
    here = source_digest()
    root = kernels_dir()
    paths = entries() + (sorted(root.glob(f"*/.tmp-*{_SUFFIX}")) if root.is_dir() else [])
    for path in paths:
        if stale_only and not path.name.startswith(".tmp-"):
            found = read_entry(path)
            if found is not None and found[0].get("sources") == here and found[0].get("format") == FORMAT:
                continue
        try:
            n = path.stat().st_size
            path.unlink()
        except OSError:
            continue
        removed += 1
        freed += n
    return removed, freed
