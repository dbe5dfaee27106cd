"""The autotuned-tile cache: where it lives, how it is keyed, lookup and save.

``numba-flash autotune`` (``numba_flash.research.tuning``, which times candidates through the API)
stores the fastest (block_m, block_n) per (GPU, algorithm, head_dim, dtype, causal) in
``$XDG_CACHE_HOME/numba_flash/tiles.json`` (``~/.cache/...`` by default); ``attention``
reads it here when the caller leaves ``block_m`` / ``block_n`` as ``None``, and falls
back to ``tile_table.forward_tiles`` without an entry.

Layering: this module sits below ``api`` (it imports only ``kernels.tiles``, ``compile_cache`` (the
cache folder, atomic writes) and, lazily,
numba.cuda for a device's name); ``tuning`` sits above ``api``. So the API never imports
the autotuner, and there is no import circle.

A GPU's name is asked of the driver once per device id (:func:`gpu_name`), never per call:
``api`` passes the device id that the caller's arrays carry (CuPy ``x.device.id``, torch
``x.device.index``).
"""

from __future__ import annotations

import functools
import json
import pathlib

from numba_flash.compile_cache import cache_root, write_atomically
from numba_flash.kernels.tiles import check_tiles

# Bumped when the kernels' tile layout changes: a choice timed on other kernels is stale
# (2: register micro-tiles, 2026-11-29; entries of layout 1 are ignored).
LAYOUT_VERSION = 2


def cache_path() -> pathlib.Path:
    return cache_root() / "tiles.json"


@functools.lru_cache(maxsize=1)
def load() -> dict:
    """The cache's entries (read once; :func:`save` re-reads); ``{}`` when absent or corrupt."""
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def key(gpu: str, algorithm: str, head_dim: int, dtype: str, causal: bool) -> str:
    return f"v{LAYOUT_VERSION}|{gpu}|{algorithm}|d{head_dim}|{dtype}|{'causal' if causal else 'full'}"


def current_device_id() -> int:
    """numba's current device (a driver call: for callers without arrays that carry one)."""
    from numba_flash._cuda import cuda

    return cuda.get_current_device().id


@functools.lru_cache(maxsize=None)
def gpu_name(device_id: int) -> str:
    """The name of GPU ``device_id``, asked of the driver once per device."""
    from numba_flash._cuda import cuda

    name = cuda.gpus[device_id].name
    return name.decode() if isinstance(name, bytes) else str(name)


def tuned_tiles(algorithm: str, head_dim: int, dtype: str, causal: bool, device_id: int | None = None):
    """The cached (block_m, block_n) for this GPU and problem class, or ``None``.

    ``device_id``: the GPU the arrays live on (``None``: numba's current device)."""
    entries = load()
    if not entries:
        return None  # nothing tuned: no need to know the GPU's name
    device_id = current_device_id() if device_id is None else device_id
    entry = entries.get(key(gpu_name(device_id), algorithm, head_dim, dtype, causal))
    if not isinstance(entry, dict) or "tiles" not in entry:
        return None
    try:
        tiles = tuple(int(t) for t in entry["tiles"])
        check_tiles(head_dim, *tiles)
    except (ValueError, TypeError):
        return None  # a hand-edited or foreign entry the kernels cannot run: use the defaults
    return tiles


def save(algorithm, head_dim, dtype, causal, tiles, tflops, device_id: int | None = None) -> pathlib.Path:
    """Store ``tiles`` for this GPU and problem class (atomically: a reader never sees half a file)."""
    path = cache_path()
    device_id = current_device_id() if device_id is None else device_id
    data = dict(load())
    data[key(gpu_name(device_id), algorithm, head_dim, dtype, causal)] = {"tiles": list(tiles), "tflops": round(tflops, 2)}
    write_atomically(path, json.dumps(data, indent=1, sort_keys=True).encode())
    load.cache_clear()
    return path
