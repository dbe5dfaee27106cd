"""Time FA-1/FA-2 over (block_m, block_n) candidates on the GPU at hand.

    python scripts/tile_sweep.py [--algorithm fa2] [--head-dim 64] [--dtype float32] [--causal]

Prints one line per candidate (median ms, TFLOP/s, registers, occupancy), best last.
"""

from __future__ import annotations

import argparse

import numba_flash  # noqa: F401  (chooses the world before numba.cuda is imported)
from numba_flash.api import forward, kernel_for
from numba_flash.kernels.tiles import STATIC_SMEM_LIMIT, smem_bytes
from numba_flash.profiling.resources import compiled_resources
from numba_flash.profiling.timing import attention_flops, median_ms, tflops


def main():
    import cupy as cp

    ap = argparse.ArgumentParser()
    ap.add_argument("--algorithm", default="fa2")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--block-m", type=int, nargs="*", default=[32, 64, 128, 256])
    ap.add_argument("--block-n", type=int, nargs="*", default=[8, 16, 32, 64])
    a = ap.parse_args()
    rs = cp.random.default_rng(0)
    shape = (a.batch, a.heads, a.seq, a.head_dim)
    q, k, v = (rs.standard_normal(shape, dtype=cp.float32).astype(a.dtype) for _ in range(3))
    flops = attention_flops(a.batch, a.heads, a.seq, a.seq, a.head_dim, a.causal)
    results = []
    for bm in a.block_m:
        for bn in a.block_n:
            if smem_bytes(a.head_dim, bm, bn) > STATIC_SMEM_LIMIT:
                continue
            kw = dict(causal=a.causal, algorithm=a.algorithm, block_m=bm, block_n=bn)
            ms = median_ms(lambda: forward(q, k, v, **kw), repeats=10)
            res = compiled_resources(kernel_for(a.algorithm, a.head_dim, bm, bn, a.causal, a.dtype), bm)
            results.append((tflops(flops, ms), bm, bn, ms, res))
            print(f"{a.algorithm} D{a.head_dim} {a.dtype} causal={a.causal} bm={bm:4d} bn={bn:3d} "
                  f"{ms:8.3f} ms {tflops(flops, ms):6.2f} TFLOP/s regs={res.regs} local={res.local_bytes} "
                  f"blocks/SM={res.blocks_per_sm} occ={res.occupancy:.0%}", flush=True)
    best = max(results)
    print(f"best: bm={best[1]} bn={best[2]} {best[0]:.2f} TFLOP/s")


if __name__ == "__main__":
    main()
