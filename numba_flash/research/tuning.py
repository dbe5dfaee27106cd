"""Autotuning of (block_m, block_n) on the user's GPU (``numba-flash autotune``).

Times every runnable candidate for each (algorithm, head_dim, dtype, causal) class on a
representative problem, through the public API, and stores the fastest in the tile cache
(``numba_flash.tile_cache``: ``$XDG_CACHE_HOME/numba_flash/tiles.json``, keyed by the GPU's
name). ``attention`` reads that cache when the caller leaves ``block_m`` / ``block_n`` as
``None``. This module sits above ``api`` (it calls it); the cache lookup sits below.
"""

from __future__ import annotations

from numba_flash.arch import STATIC_SMEM_LIMIT
from numba_flash.kernels.tiles import smem_bytes
from numba_flash.tile_cache import save

CANDIDATES_M = (32, 64, 128, 256)
CANDIDATES_N = (8, 16, 32, 64)


def candidates(head_dim: int):
    return [(m, n) for m in CANDIDATES_M for n in CANDIDATES_N if smem_bytes(head_dim, m, n) <= STATIC_SMEM_LIMIT]


def autotune(algorithm, head_dim, dtype, causal, *, batch=4, heads=16, seq=4096, repeats=10, progress=print):
    """Time every candidate on the GPU, cache the fastest; returns (best tiles, rows)."""
    import cupy as cp

    from numba_flash.api import forward
    from numba_flash.research.profiling.timing import attention_flops, median_ms, tflops

    shape = (batch, heads, seq, head_dim)
    rs = cp.random.default_rng(0)
    q, k, v = (rs.standard_normal(shape, dtype=cp.float32).astype(dtype) for _ in range(3))
    flops = attention_flops(batch, heads, seq, seq, head_dim, causal)
    rows = []
    for bm, bn in candidates(head_dim):
        # The cache serves the CUDA-core kernels (precision="ieee"); tensor-core tiles are fixed.
        kw = dict(causal=causal, algorithm=algorithm, block_m=bm, block_n=bn, precision="ieee")
        ms = median_ms(lambda: forward(q, k, v, **kw), repeats=repeats)
        rows.append(dict(block_m=bm, block_n=bn, ms=ms, tflops=tflops(flops, ms)))
        progress(f"{algorithm} D={head_dim} {dtype} causal={causal} {bm:>3} x {bn:<3} {ms:8.3f} ms {rows[-1]['tflops']:6.2f} TFLOP/s")
    best = max(rows, key=lambda r: r["tflops"])
    tiles = (best["block_m"], best["block_n"])
    path = save(algorithm, head_dim, dtype, causal, tiles, best["tflops"], device_id=q.device.id)
    progress(f"best {best['block_m']} x {best['block_n']}: {best['tflops']:.2f} TFLOP/s -> {path}")
    return (best["block_m"], best["block_n"]), rows
