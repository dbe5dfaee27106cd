"""Offline SASS statistics of the backward kernels (no GPU): registers, spills, shared memory,
blocks per SM, and the instruction mix of the inner loop over Q tiles (one step). CUDA cores
(``kernels.bwd``) by default; ``--tensor-cores`` the float16 kernels of ``kernels.tc_bwd``
(per warp and step: HMMA, LDSM, local memory inside the step loop, barriers, reductions).

Run with numba's CUDA target (``NUMBA_ENABLE_CUDASIM=0``, set here before numba loads) and the
ptxas of the ``occupancy`` extra; needs ``cuobjdump`` (nvidia-cuda-cuobjdump wheel) on PATH or
in ``CUOBJDUMP`` (as ``scripts/tc_sass_stats.py``).

    python scripts/bwd_sass_stats.py --head-dim 64 128 [--causal] [--loops]
    python scripts/bwd_sass_stats.py --tensor-cores --head-dim 64 128 [--tiles 64x128 64x64] [--causal]

Counts are static (each instruction once). ptxas keeps the reduction loop of each micro-tile
product rolled (one step of the head dim for S^T and dP^T, four keys for dV and dK, one key for
dQ), so the step's dynamic count is the step body plus each product loop's body times its trip
count: ``--loops`` prints every loop of the step with its per-iteration mix, and the script
weights each product loop by the trip count its FFMA count implies (the product's FMAs per
thread, ``block^2 x D_pad / threads``, over the loop's FFMA per iteration; a loop around the
products, such as the two halves of dQ at D > 64, by what is left), then checks the weighted
FFMA against the products a step must make. The step body's branches (masked or not, full or
tail copies) are counted once each, so its figure is an upper bound for one step.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tc_sass_stats import compile_sass_of, loops, parse  # noqa: E402

KEYS = ("FFMA", "LDS.128", "LDS.32", "STS", "LDG", "BAR", "MUFU", "RED", "LDL", "STL", "IMAD", "total")


def mix(instrs, weights=None) -> collections.Counter:
    c = collections.Counter()
    for n, (addr, op, _) in enumerate(instrs):
        w = 1 if weights is None else weights[addr]
        fam = op.split(".")[0]
        c[fam] += w
        if fam in ("RED", "REDG", "ATOM", "ATOMG"):
            c["RED"] += w if fam != "RED" else 0
        if fam == "LDS":
            c["LDS.128" if ".128" in op else "LDS.64" if ".64" in op else "LDS.32"] += w
        c["total"] += w
    return c


def kernels(head_dim, causal):
    """(name, dispatcher, signature, layout, FFMA per thread and step) of each backward kernel."""
    from numba import types

    from numba_flash.kernels.bwd import bwd_dq_kernel, bwd_kernel, bwd_layout, dq_parts
    from numba_flash.tile_table import backward_block

    f4, f3, f = types.Array(types.float32, 4, "C"), types.Array(types.float32, 3, "C"), types.float32
    block = backward_block(head_dim)
    kv_sig = (f4,) * 5 + (f3, f3, f4, f4, f4, f)
    out = []
    for name, k, sig, kind, products in (
        ("fa2 (dK, dV, atomic dQ)", bwd_kernel("fa2", head_dim, block, causal, True), kv_sig, "fa2", 5),
        ("fa2 deterministic (dK, dV)", bwd_kernel("fa2", head_dim, block, causal, False), kv_sig, "fa2", 4),
        ("fa1 (Alg. 4)", bwd_kernel("fa1", head_dim, block, causal, True), kv_sig, "fa1", 5),
        ("fa2 deterministic dQ", bwd_dq_kernel(head_dim, block, causal), (f4,) * 4 + (f3, f3, f4, f), "dq", 3),
    ):
        lay = bwd_layout(kind, head_dim, block)
        per_product = block * block * lay.tiles.padded_dim // lay.threads
        parts = dq_parts(lay) if kind != "dq" else 1
        out.append((name, k, sig, lay, products * per_product, per_product, parts))
    return out


def step_weights(instrs, hot, per_product, head_dim, parts):
    """Trip-count weight of every instruction of the step (see the module doc): a loop of
    128-bit loads and FFMAs is a product's reduction loop, ``per_product / FFMA`` trips; a loop
    of FFMAs on scalar loads is FA-1's D_i = rowsum(dO * O), ``D / FFMA`` trips; a loop around
    product loops is dQ's parts of the head dim (``parts`` trips, its products' trips divided
    by as many); any other loop (copies, row statistics) at most once per step."""
    inner = sorted((r for r in loops(instrs) if hot[0] <= r[0] and r[1] <= hot[1] and r != hot),
                   key=lambda r: r[1] - r[0])
    trip = {}
    for lo, hi in inner:  # innermost first
        nested = [r for r in trip if lo <= r[0] and r[1] <= hi]
        own = [x for x in instrs if lo <= x[0] <= hi and not any(r[0] <= x[0] <= r[1] for r in nested)]
        ffma = sum(1 for x in own if x[1].startswith("FFMA"))
        vector = any(x[1].startswith("LDS.128") for x in own)
        product_inside = any(trip[r] > 1 and any(r[0] <= x[0] <= r[1] and x[1].startswith("LDS.128") for x in instrs)
                             for r in nested)
        if product_inside:
            trip[(lo, hi)] = parts
            for r in nested:
                trip[r] = max(1, trip[r] // parts)
        elif ffma and vector:
            trip[(lo, hi)] = max(1, per_product // ffma)
        elif ffma:
            trip[(lo, hi)] = max(1, head_dim // ffma)
        else:
            trip[(lo, hi)] = 1
    weights = {}
    for addr, _, _ in instrs:
        w = 1
        for r, t in trip.items():
            if r[0] <= addr <= r[1]:
                w *= t
        weights[addr] = w
    return weights, trip


def stats(head_dim, causal, show_loops=False):
    from numba_flash.arch import ARCH
    from numba_flash.research.profiling.occupancy import occupancy_from_resources

    rows = []
    for name, k, sig, lay, expected_ffma, per_product, parts in kernels(head_dim, causal):
        _, sass, res = compile_sass_of(k.py_func, sig, k.targetoptions.get("fastmath"))
        instrs = parse(sass)
        ranges = [r for r in loops(instrs) if any(r[0] <= a <= r[1] and o.startswith("FFMA") for a, o, _ in instrs)]
        hot = max(ranges, key=lambda r: r[1] - r[0])
        # the step: the innermost loop that still holds every product (the Q walk, not the GQA loop)
        for r in sorted(ranges, key=lambda r: r[1] - r[0]):
            body = [x for x in instrs if r[0] <= x[0] <= r[1]]
            if sum(1 for x in body if x[1].startswith("BAR")) >= 2:
                hot = r
                break
        body = [x for x in instrs if hot[0] <= x[0] <= hot[1]]
        weights, trip = step_weights(instrs, hot, per_product, head_dim, parts)
        dyn = mix(body, weights)
        blocks, limiter = occupancy_from_resources(res["regs"], lay.smem_bytes, lay.threads, ARCH[(9, 0)])
        row = dict(kernel=name, D=head_dim, tile=f"{lay.block}x{lay.block}", threads=lay.threads, smem=lay.smem_bytes,
                   regs=res["regs"], spills=f"{res['spill_stores']}/{res['spill_loads']}", blocks=blocks,
                   warps=blocks * lay.threads // 32, limiter=limiter, **{k: dyn[k] for k in KEYS})
        row["FFMA/instr"] = round(dyn["FFMA"] / dyn["total"], 2)
        row["FFMA/LDS"] = round(dyn["FFMA"] / max(1, dyn["LDS"]), 1)
        # the products' FFMA, and a few percent more: FA-1's D_i = rowsum(dO * O) and the FFMA of
        # its dQ read-modify-write (dq += x * scale)
        row["check"] = "ok" if expected_ffma <= dyn["FFMA"] <= 1.03 * expected_ffma else f"FFMA != {expected_ffma}"
        rows.append(row)
        if show_loops:
            for r, t in sorted(trip.items()):
                c = mix([x for x in instrs if r[0] <= x[0] <= r[1]])
                print(f"#   {name} D={head_dim}: loop {r[0]:#x}-{r[1]:#x} x{t}: " +
                      ", ".join(f"{k} {c[k]}" for k in KEYS if c[k]), file=sys.stderr)
    return rows


TC_KEYS = ("HMMA", "LDSM", "LDS", "STS", "LDGSTS", "RED", "MUFU", "BAR", "LDL", "STL", "total")


def tc_kernels(head_dim, tiles, causal, kind="f16"):
    """(name, dispatcher, signature, layout, HMMA per warp and step) of each tensor-core backward
    kernel (float16; bfloat16 differs in the conversions only; ``kind="tf32x3"``: the float32
    kernels, m16n8k8 with three products per TF32 step)."""
    from numba import types

    from numba_flash.kernels import tc_bwd

    u4, f4, f3 = types.Array(types.uint16, 4, "C"), types.Array(types.float32, 4, "C"), types.Array(types.float32, 3, "C")
    x4 = u4 if kind in tc_bwd.HALF_KINDS else f4
    kv_sig = (x4,) * 5 + (f3, f3, f4, x4, x4, types.float32)
    ks, mult = (16, 1) if kind in tc_bwd.HALF_KINDS else (8, 3)  # k of one product, products per k-step
    bm, bn = tiles
    dm, dn = tc_bwd.dq_kernel_tiles(bm, bn, kind)
    out = []
    for name, order, dq in (("fa2 (dK, dV, atomic dQ)", "fa2", True), ("fa2 deterministic (dK, dV)", "fa2", False),
                            ("fa1 (Alg. 4)", "fa1", True)):
        lay = tc_bwd.tc_bwd_layout(order, kind, head_dim, bm, bn)
        kt, qg = lay.padded_dim // ks, bm // 16
        products = 2 * (bm // 8) * kt + 2 * (bm // ks) * (lay.padded_dim // 8)  # S^T, dP^T, dV, dK
        if dq:
            groups, split = max(1, qg // lay.warps), max(1, lay.warps // qg)
            products += groups * -(-(lay.padded_dim // 16) // split) * (bn // ks) * 2
        out.append((name, tc_bwd.tc_bwd_kernel(order, kind, head_dim, bm, bn, causal, dq), kv_sig, lay, mult * products))
    lay = tc_bwd.tc_bwd_layout("dq", kind, head_dim, dm, dn)
    products = 2 * (dn // 8) * (lay.padded_dim // ks) + (dn // ks) * (lay.padded_dim // 8)
    out.append(("fa2 deterministic dQ", tc_bwd.tc_bwd_dq_kernel(kind, head_dim, dm, dn, causal),
                (x4,) * 4 + (f3, f3, f4, types.float32), lay, mult * products))
    return out


def tc_stats(head_dim, tiles, causal, kind="f16", dump=None):
    """Rows of the tensor-core kernels: the step loop is the smallest loop holding every HMMA of
    the kernel; loops inside it that hold HMMA (ptxas keeps dQ's loop over 16-column chunks
    rolled) are weighted by the trip count that makes the step's HMMA equal the products a warp
    must make (checked: an integer)."""
    from numba_flash.arch import ARCH
    from numba_flash.research.profiling.occupancy import occupancy_from_resources

    rows = []
    for name, k, sig, lay, expected in tc_kernels(head_dim, tiles, causal, kind):
        _, sass, res = compile_sass_of(k.py_func, sig, k.targetoptions.get("fastmath"))
        if dump:  # the SASS text, for diffs between versions
            tag = f"{kind}_d{head_dim}_{lay.block_m}x{lay.block_n}_{name.split(' (')[0].replace(' ', '_')}"
            with open(os.path.join(dump, tag + ".sass"), "w") as f:
                f.write(sass)
        instrs = parse(sass)
        hmma = [a for a, o, _ in instrs if o.startswith("HMMA")]
        step = min((r for r in loops(instrs) if r[0] <= min(hmma) and max(hmma) <= r[1]), key=lambda r: r[1] - r[0])
        inner = [r for r in loops(instrs) if step[0] <= r[0] and r[1] <= step[1] and r != step
                 and any(r[0] <= a <= r[1] for a in hmma)]
        inner = [r for r in inner if not any(o != r and o[0] <= r[0] and r[1] <= o[1] for o in inner)]  # outermost
        body = [x for x in instrs if step[0] <= x[0] <= step[1]]
        in_inner = sum(1 for a in hmma if any(r[0] <= a <= r[1] for r in inner))
        trip, check = 1, "ok"
        if inner:
            t = (expected - (len(hmma) - in_inner)) / in_inner
            trip, check = (int(t), "ok") if t == int(t) and t >= 1 else (1, f"HMMA: trip {t:.2f}")
        elif len(hmma) != expected:
            check = f"HMMA {len(hmma)} != {expected}"
        weights = {a: (trip if any(r[0] <= a <= r[1] for r in inner) else 1) for a, _, _ in body}
        c = collections.Counter()
        for a, op, _ in body:
            fam = op.split(".")[0]
            fam = "RED" if fam in ("RED", "REDG") else fam
            c[fam] += weights[a]
            c["total"] += weights[a]
        blocks, limiter = occupancy_from_resources(res["regs"], lay.smem_bytes + 4 * lay.stat_floats, lay.threads,
                                                   ARCH[(9, 0)])
        rows.append(dict(kernel=name, D=head_dim, tile=f"{lay.block_m}x{lay.block_n}", threads=lay.threads,
                         smem=lay.smem_bytes, regs=res["regs"], spills=f"{res['spill_stores']}/{res['spill_loads']}",
                         blocks=blocks, warps=blocks * lay.warps, limiter=limiter,
                         **{f"{k}/step": c[k] for k in TC_KEYS}, check=check))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head-dim", nargs="+", type=int, default=[64, 128])
    p.add_argument("--causal", action="store_true")
    p.add_argument("--loops", action="store_true", help="print each loop of the step (stderr)")
    p.add_argument("--tensor-cores", action="store_true", help="the tensor-core kernels (kernels.tc_bwd, float16)")
    p.add_argument("--tiles", nargs="+", default=None, help="tensor-core tiles 'MxN' (block_m queries x block_n keys)")
    p.add_argument("--kind", default="f16", choices=["f16", "bf16", "tf32x3"], help="tensor-core kind (--tensor-cores)")
    p.add_argument("--dump-sass", default=None, help="folder to write each tensor-core kernel's SASS into")
    a = p.parse_args(argv)
    import numba_flash

    print(f"# numba_flash from {os.path.dirname(numba_flash.__file__)}; per thread and step (one Q tile x one K/V "
          "tile), branches of the step body counted once each", file=sys.stderr)
    header = None
    if a.tensor_cores:
        from numba_flash.tile_table import backward_tc_tiles as default_tc_bwd_tiles

        rows = (row for d in a.head_dim
                for t in ([tuple(int(x) for x in t.lower().split("x")) for t in a.tiles] if a.tiles
                          else [default_tc_bwd_tiles(d, a.kind)])
                for row in tc_stats(d, t, a.causal, a.kind, a.dump_sass))
    else:
        rows = (row for d in a.head_dim for row in stats(d, a.causal, a.loops))
    for row in rows:
        if header is None:
            header = list(row)
            print("| " + " | ".join(header) + " |")
            print("|" + "---|" * len(header))
        print("| " + " | ".join(str(row[k]) for k in header) + " |", flush=True)


if __name__ == "__main__":
    main()
