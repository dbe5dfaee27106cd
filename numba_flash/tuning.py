"""Autotuning of (block_m, block_n) on the user's GPU, cached in the user's cache directory.

``numba-flash autotune`` times every runnable candidate for each (algorithm, head_dim,
dtype, causal) class on a representative problem and stores the fastest in
``$XDG_CACHE_HOME/numba_flash/tiles.json`` (``~/.cache/...`` by default), keyed by the
GPU's name. ``attention`` then uses the cached choice when the caller leaves
``block_m`` / ``block_n`` as ``None``; without an entry it falls back to the built-in
defaults of ``kernels.tiles.default_tiles``.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import tempfile

from numba_flash.kernels.tiles import STATIC_SMEM_LIMIT, check_tiles, smem_bytes

CANDIDATES_M = (32, 64, 128, 256)
CANDIDATES_N = (8, 16, 32, 64)


def cache_path() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "numba_flash" / "tiles.json"


@functools.lru_cache(maxsize=1)
def _load() -> dict:
    try:
        return json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}


# Bumped when the kernels' tile layout changes: a choice timed on other kernels is stale
# (2: register micro-tiles, 2026-11-29; entries of layout 1 are ignored).
LAYOUT_VERSION = 2


def _key(gpu: str, algorithm: str, head_dim: int, dtype: str, causal: bool) -> str:
    return f"v{LAYOUT_VERSION}|{gpu}|{algorithm}|d{head_dim}|{dtype}|{'causal' if causal else 'full'}"


@functools.lru_cache(maxsize=None)
def _gpu_name() -> str:
    from numba_flash._cuda import cuda

    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


def tuned_tiles(algorithm: str, head_dim: int, dtype: str, causal: bool):
    """The cached (block_m, block_n) for this GPU and problem class, or ``None``."""
    entry = _load().get(_key(_gpu_name(), algorithm, head_dim, dtype, causal))
    if not entry:
        return None
    tiles = tuple(entry["tiles"])
    try:
        check_tiles(head_dim, *tiles)
    except (ValueError, TypeError):
        return None  # a hand-edited or foreign entry the kernels cannot run: use the defaults
    return tiles


def save(algorithm, head_dim, dtype, causal, tiles, tflops) -> pathlib.Path:
    path = cache_path()
    data = dict(_load())
    data[_key(_gpu_name(), algorithm, head_dim, dtype, causal)] = {"tiles": list(tiles), "tflops": round(tflops, 2)}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)  # atomic: a reader never sees half a file
    _load.cache_clear()
    return path


def candidates(head_dim: int):
    return [(m, n) for m in CANDIDATES_M for n in CANDIDATES_N if smem_bytes(head_dim, m, n) <= STATIC_SMEM_LIMIT]


def autotune(algorithm, head_dim, dtype, causal, *, batch=4, heads=16, seq=4096, repeats=10, progress=print):
    """Time every candidate on the GPU, cache the fastest; returns (best tiles, rows)."""
    import cupy as cp

    from numba_flash.api import forward
    from numba_flash.profiling.timing import attention_flops, median_ms, tflops

    shape = (batch, heads, seq, head_dim)
    rs = cp.random.default_rng(0)
    q, k, v = (rs.standard_normal(shape, dtype=cp.float32).astype(dtype) for _ in range(3))
    flops = attention_flops(batch, heads, seq, seq, head_dim, causal)
    rows = []
    for bm, bn in candidates(head_dim):
        kw = dict(causal=causal, algorithm=algorithm, block_m=bm, block_n=bn)
        ms = median_ms(lambda: forward(q, k, v, **kw), repeats=repeats)
        rows.append(dict(block_m=bm, block_n=bn, ms=ms, tflops=tflops(flops, ms)))
        progress(f"{algorithm} D={head_dim} {dtype} causal={causal} {bm:>3} x {bn:<3} {ms:8.3f} ms {rows[-1]['tflops']:6.2f} TFLOP/s")
    best = max(rows, key=lambda r: r["tflops"])
    path = save(algorithm, head_dim, dtype, causal, (best["block_m"], best["block_n"]), best["tflops"])
    progress(f"best {best['block_m']} x {best['block_n']}: {best['tflops']:.2f} TFLOP/s -> {path}")
    return (best["block_m"], best["block_n"]), rows
