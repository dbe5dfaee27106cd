"""Offline SASS statistics of the CUDA-core forward (``kernels.forward``, exact FFMA) for tile
and micro-tile candidates (no GPU): registers, spills, shared memory (static + dynamic), blocks
and warps per SM, and the instruction mix of one K/V tile of the FA-2 walk.

Run with numba's CUDA target (``NUMBA_ENABLE_CUDASIM=0``, set here before numba loads), the
ptxas of the ``occupancy`` extra and ``cuobjdump`` (as ``scripts/tc_sass_stats.py``):

    python scripts/ffma_sass_stats.py --head-dim 64 --tiles 64x32 128x32 64x64 --rows 4 8 [--causal]

How the K/V tile is read from the SASS: the K/V loop is the largest backward-branch range that
holds a barrier; the loops nested in it are the micro-tile products that ptxas kept rolled:
those before the first ``MUFU.EX2`` (P~ = exp2(S - m)) are S = Q K^T (FA-2 Algorithm 1 line 8),
those after it P~ V (line 10: two of them, the masked and the unmasked walk, told apart by
their ``ISETP``). Each loop's trip count is the product's FFMA per thread (``TM x TN x D_pad``
for S, ``TM x block_n x 4 DG`` for P~V) over its FFMA per iteration. ``tile`` is one unmasked
K/V tile: the body outside the nested loops (both branches of the masking counted: an upper
bound) plus S's and the unmasked P~V's loops times their trips; ``ffma%`` of it is a lower
bound of the FFMA share a tile issues. ``lds/ffma``: shared loads per FFMA in the products.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tc_sass_stats import compile_sass_of, loops, parse  # noqa: E402


def family(op: str) -> str:
    return op.split(".")[0]


def counts(instrs) -> collections.Counter:
    c = collections.Counter(family(o) for _, o, _ in instrs)
    c["total"] = len(instrs)
    return c


def kv_tile(instrs, ffma_s: int, ffma_pv: int) -> dict:
    """The K/V loop's mix (module doc); ``ffma_s``, ``ffma_pv``: FFMA per thread of each product."""
    ranges = [r for r in loops(instrs) if any(r[0] <= a <= r[1] and o.startswith("BAR") for a, o, _ in instrs)]
    if not ranges:
        return {}
    lo, hi = max(ranges, key=lambda r: r[1] - r[0])
    body = [x for x in instrs if lo <= x[0] <= hi]
    inner = [r for r in loops(instrs) if lo <= r[0] and r[1] <= hi and (r[0], r[1]) != (lo, hi)]
    inner = [r for r in inner if not any(o[0] <= r[0] and r[1] <= o[1] and o != r for o in inner)]  # outermost
    exp_at = min((a for a, o, _ in body if o.startswith("MUFU.EX2")), default=hi)
    loop_mix = {r: counts([x for x in body if r[0] <= x[0] <= r[1]]) for r in inner}
    s_loops = [r for r in inner if r[1] < exp_at and loop_mix[r]["FFMA"]]
    pv_loops = [r for r in inner if r[0] > exp_at and loop_mix[r]["FFMA"]]
    outside = counts([x for x in body if not any(r[0] <= x[0] <= r[1] for r in inner)])
    out = dict(body=len(body), outside=outside["total"], outside_ffma=outside["FFMA"], inner=len(inner))

    def product(name, rs, ffma_total):
        if not rs:  # fully unrolled: its FFMA are in the body
            out[f"{name}_iter"] = None
            return collections.Counter()
        m = sum((loop_mix[r] for r in rs), collections.Counter())
        trip = ffma_total / m["FFMA"]
        out[f"{name}_iter"] = f"{m['total']}i/{m['FFMA']}F/{m['LDS']}L x{trip:g}"
        out[f"{name}_ffma%"] = round(100 * m["FFMA"] / m["total"], 1)
        out[f"{name}_lds/ffma"] = round(m["LDS"] / m["FFMA"], 3)
        return collections.Counter({k: v * trip for k, v in m.items()})

    s = product("S", s_loops, ffma_s)
    # P~V: the unmasked walk is the loop with fewer ISETP (the masked one tests each key)
    pv_unmasked = sorted(pv_loops, key=lambda r: loop_mix[r]["ISETP"])[:1]
    pv = product("PV", pv_unmasked, ffma_pv)
    if len(pv_loops) > 1:
        masked = sorted(pv_loops, key=lambda r: loop_mix[r]["ISETP"])[-1]
        m = loop_mix[masked]
        out["PVmasked_ffma%"] = round(100 * m["FFMA"] / m["total"], 1)
    tile_total = outside["total"] + s["total"] + pv["total"]
    tile_ffma = outside["FFMA"] + s["FFMA"] + pv["FFMA"]
    out["tile"] = round(tile_total)
    out["tile_ffma"] = round(tile_ffma)
    out["tile_ffma%"] = round(100 * tile_ffma / tile_total, 1)
    return out


def stats(head_dim, block_m, block_n, rows_per_thread, causal, dump=None, max_registers=None) -> dict:
    from numba_flash.kernels.tiles import VEC, tile_layout
    from numba_flash.arch import ARCH
    from numba_flash.research.profiling.occupancy import occupancy_from_resources
    from numba_flash.specs import kernel_spec

    spec = kernel_spec("fa2", head_dim, "float32", block_m, block_n, causal, rows_per_thread=rows_per_thread)
    kernel = spec.kernel
    cap = max_registers or spec.register_cap  # (--maxreg: ptxas's cap instead of the kernel's)
    ptx, sass, res = compile_sass_of(kernel.py_func, spec.signature(), kernel.targetoptions.get("fastmath"), cap)
    if dump:
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, f"fa2_d{head_dim}_{block_m}x{block_n}_r{rows_per_thread}_cap{cap}.sass"), "w") as f:
            f.write(sass)
    L = tile_layout(head_dim, block_m, block_n, rows_per_thread)
    TM, TN, DP, ACC = L.rows_per_thread, L.cols_per_thread, L.padded_dim, VEC * L.dim_groups
    smem = spec.static_smem + spec.dynamic_smem
    blocks, limiter = occupancy_from_resources(res["regs"], smem, spec.threads, ARCH[(9, 0)])
    row = dict(tiles=f"{block_m}x{block_n}", rows=TM, micro=f"S {TM}x{TN} O {TM}x{ACC}", threads=spec.threads,
               cap=cap, regs=res["regs"], spill=res["spill_stores"] + res["spill_loads"],
               smem=smem, dynamic=spec.dynamic_smem, blocks=blocks, warps=blocks * spec.threads // 32, limiter=limiter)
    row.update(kv_tile(parse(sass), TM * TN * DP, TM * block_n * ACC))
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--tiles", nargs="+", default=["64x32", "32x32", "128x32", "64x64", "128x64", "128x16"])
    ap.add_argument("--rows", nargs="+", type=int, default=[4])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dump", help="write each kernel's SASS into this directory")
    ap.add_argument("--maxreg", type=int, nargs="+", default=[0],
                    help="ptxas register caps to try (0: the kernel's own, tiles.register_cap)")
    args = ap.parse_args(argv)
    from numba_flash.kernels.tiles import check_tiles

    for r in args.rows:
        for t in args.tiles:
            bm, bn = (int(x) for x in t.split("x"))
            try:
                check_tiles(args.head_dim, bm, bn, r)
            except ValueError as e:
                print(dict(tiles=t, rows=r, refused=str(e)), flush=True)
                continue
            for cap in args.maxreg:
                print(stats(args.head_dim, bm, bn, r, args.causal, args.dump, cap or None), flush=True)


if __name__ == "__main__":
    main()
