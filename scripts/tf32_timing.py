"""Time FA-2 tf32x3 / tf32 (numba_flash) against PyTorch's memory-efficient SDPA on one GPU.

    python scripts/tf32_timing.py
    python scripts/tf32_timing.py --no-sweep   # skip the tile / register-cap sweep

B=4 H=16 N=4096, D=64 and D=128, float32 CuPy inputs (torch reads the same memory through
DLPack). Each configuration: warm-up, then the median of >= 10 CUDA-event timings.
TFLOP/s = 4 B H N^2 D / time (non-causal; causal counts the same FLOPs, as the repo's
other tables do, so its figure is "effective"). The ratio is numba_flash / torch SDPA
(efficient backend) on the same inputs and causality. Relative error: max |o - ref| / max |ref|
on the first (batch, head), ref in float64 (NumPy).

The optional sweep re-runs tf32x3 (non-causal) with other tiles (block_m/block_n), with the
register cap of the tensor-core kernels switched off/on (NUMBA_FLASH_TC_MAXREG), and at D > 64
with each choice of operands split once in shared memory (NUMBA_FLASH_TF32X3_PRESPLIT, see
``tc_ops.presplit_operands``; "none" is the kernel of version 8d). Those knobs are read when a
configuration's spec and layout are first made (memoised), so an entry that sets one runs in a
child process (``--child``: same shapes, its own inputs, its own reference). Budget: about 5
minutes on an H100/H200 for ``--head-dims 64 128``; ``--modes`` narrows the pre-split sweep.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

B, H, N = 4, 16, 4096
REPS, WARMUP = 10, 3
T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def median_ms(fn, reps=REPS, warmup=WARMUP):
    from numba_flash.research.profiling.timing import median_ms as shared_median_ms

    return shared_median_ms(fn, warmup=warmup, repeats=reps)


def reference_head(q, k, v, causal):
    """float64 attention of (batch 0, head 0), NumPy."""
    import numpy as np

    qh, kh, vh = (x[0, 0].get().astype(np.float64) for x in (q, k, v))
    s = qh @ kh.T / np.sqrt(qh.shape[-1])
    if causal:
        n = s.shape[0]
        s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
    s -= s.max(axis=1, keepdims=True)
    p = np.exp(s)
    return (p / p.sum(axis=1, keepdims=True)) @ vh


def rel_err(o, ref):
    import numpy as np

    got = o[0, 0].get().astype(np.float64)
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def child(D, bm, bn):
    """One tf32x3 timing (non-causal) under this process's environment, as a JSON line."""
    import json

    import cupy as cp

    import numba_flash
    from numba_flash import switches
    from numba_flash.kernels.tc_ops import PRESPLIT_DEFAULT, kernel_head_dim, tc_layout, tc_register_cap

    rng = cp.random.default_rng(D)
    q, k, v = (rng.standard_normal((B, H, N, D), dtype=cp.float32) for _ in range(3))
    ref = reference_head(q, k, v, False)

    def run():
        return numba_flash.attention(q, k, v, precision="tf32x3", block_m=bm, block_n=bn)

    run()
    t = median_ms(run)
    e = rel_err(run(), ref)
    d = kernel_head_dim("tf32x3", D)
    mode = switches.tf32x3_presplit()
    mode = PRESPLIT_DEFAULT if mode is None else mode
    print("CHILD " + json.dumps(dict(ms=t, err=e, cap=tc_register_cap("tf32x3", d, bm, bn, switches.tc_maxreg()),
                                     presplit=tc_layout("tf32x3", d, bm, bn, presplit_mode=mode).presplit or "none")),
          flush=True)


def in_child(D, bm, bn, env):
    """``child`` in a fresh process with ``env`` added: (ms, rel err, cap, presplit)."""
    import json
    import subprocess

    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", str(D), str(bm), str(bn)],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    lines = [x for x in done.stdout.splitlines() if x.startswith("CHILD ")]
    if done.returncode or not lines:
        raise RuntimeError(f"child failed ({done.returncode}): {(done.stderr or done.stdout)[-500:]}")
    r = json.loads(lines[-1][6:])
    return r["ms"], r["err"], r["cap"], r["presplit"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--modes", nargs="*", default=["none", "q", "v", "kv", "qkv"],
                    help="pre-split operands swept at D > 64 besides the default (tc_ops.PRESPLIT_MODES; none: 8d)")
    ap.add_argument("--child", nargs=3, type=int, metavar=("D", "BM", "BN"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(*args.child)

    import cupy as cp
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import numba_flash

    log(f"numba_flash from {os.path.dirname(numba_flash.__file__)}; torch {torch.__version__}; "
        f"GPU {torch.cuda.get_device_name()}; NUMBA_FLASH_TC_MAXREG={os.environ.get('NUMBA_FLASH_TC_MAXREG')}")
    from numba_flash import switches
    from numba_flash.kernels.tc_ops import PRESPLIT_DEFAULT, kernel_head_dim, tc_layout
    from numba_flash.kernels.tc_ops import tc_register_cap as _tc_register_cap
    from numba_flash.tile_table import forward_tc_tiles as default_tc_tiles

    def tc_register_cap(precision, D, bm, bn):  # this process's cap (NUMBA_FLASH_TC_MAXREG)
        return _tc_register_cap(precision, D, bm, bn, switches.tc_maxreg())

    def presplit_of(precision, D, bm, bn):
        mode = switches.tf32x3_presplit()
        mode = PRESPLIT_DEFAULT if mode is None else mode
        return tc_layout(precision, kernel_head_dim(precision, D), bm, bn, presplit_mode=mode).presplit or "none"

    rows = []
    rng = cp.random.default_rng(0)
    for D in args.head_dims:
        q, k, v = (rng.standard_normal((B, H, N, D), dtype=cp.float32) for _ in range(3))
        tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
        flops = 4 * B * H * N * N * D
        for causal in (False, True):
            ref = reference_head(q, k, v, causal)

            def sdpa():
                with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

            t_ref = median_ms(sdpa)
            o_t = sdpa()
            torch.cuda.synchronize()
            e_t = rel_err(cp.from_dlpack(o_t), ref)
            tf_ref = flops / t_ref / 1e9
            log(f"D={D} causal={causal} torch SDPA efficient: {t_ref:.3f} ms {tf_ref:.1f} TFLOP/s rel err {e_t:.2e}")
            rows.append(("torch-efficient", D, causal, "-", None, "-", t_ref, tf_ref, 1.0, e_t))
            for precision in ("tf32x3", "tf32"):
                tiles = default_tc_tiles(precision, D)
                cap = tc_register_cap(precision, D, *tiles)

                def run(precision=precision):
                    return numba_flash.attention(q, k, v, precision=precision, causal=causal)

                run()  # compile outside the timing
                t = median_ms(run)
                e = rel_err(run(), ref)
                tf = flops / t / 1e9
                split = presplit_of(precision, D, *tiles)
                log(f"D={D} causal={causal} {precision} {tiles[0]}x{tiles[1]} cap={cap} presplit={split}: {t:.3f} ms "
                    f"{tf:.1f} TFLOP/s = {tf / tf_ref:.2f}x SDPA, rel err {e:.2e}")
                rows.append((precision, D, causal, f"{tiles[0]}x{tiles[1]}", cap, split, t, tf, tf / tf_ref, e))
            if args.no_sweep or causal:
                continue
            # tf32x3 sweep (non-causal): other tiles in this process; in a child process (the knobs
            # are memoised), the default tiles with the register cap flipped (none <-> 128) and,
            # at D > 64, with the other pre-split choices, and 128x16 without pre-split at 128
            # registers (two blocks per SM: 127 registers, no spills offline). Each entry is one
            # more compile (~10-20 s; a child also imports and makes its inputs).
            default = default_tc_tiles("tf32x3", D)
            flip = "0" if tc_register_cap("tf32x3", D, *default) else "128"
            entries = [(default, {"NUMBA_FLASH_TC_MAXREG": flip})]
            if D > 64:
                entries += [(default, {"NUMBA_FLASH_TF32X3_PRESPLIT": m}) for m in args.modes if m != PRESPLIT_DEFAULT]
                entries += [((128, 16), None), ((128, 16), {"NUMBA_FLASH_TF32X3_PRESPLIT": "none",
                                                            "NUMBA_FLASH_TC_MAXREG": "128"})]
            entries += [((64, 32), None), ((128, 64), None), ((64, 64), None)]
            for (bm, bn), env in entries:
                label = f"tf32x3 {bm}x{bn} " + " ".join(f"{name.split('_')[-1]}={val}" for name, val in (env or {}).items())
                try:
                    if env:
                        t, e, cap, split = in_child(D, bm, bn, env)
                    else:
                        def run(bm=bm, bn=bn):
                            return numba_flash.attention(q, k, v, precision="tf32x3", block_m=bm, block_n=bn)

                        run()
                        t = median_ms(run)
                        e = rel_err(run(), ref)
                        cap, split = tc_register_cap("tf32x3", D, bm, bn), presplit_of("tf32x3", D, bm, bn)
                except Exception as exc:  # e.g. tiles the kernel refuses
                    log(f"D={D} {label}: skipped ({type(exc).__name__}: {exc})")
                    continue
                tf = flops / t / 1e9
                log(f"D={D} {label} (cap={cap} presplit={split}): {t:.3f} ms {tf:.1f} TFLOP/s = {tf / tf_ref:.2f}x SDPA, "
                    f"rel err {e:.2e}")
                rows.append(("sweep tf32x3", D, False, f"{bm}x{bn}", cap, split, t, tf, tf / tf_ref, e))
        del q, k, v, tq, tk, tv
        cp.get_default_memory_pool().free_all_blocks()

    print("\n| kernel | D | causal | tiles | reg cap | presplit | ms | TFLOP/s | x SDPA-efficient | rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, D, causal, tiles, cap, split, t, tf, ratio, e in rows:
        print(f"| {name} | {D} | {causal} | {tiles} | {cap} | {split} | {t:.3f} | {tf:.1f} | {ratio:.3f} | {e:.2e} |")
    log("done")


if __name__ == "__main__":
    sys.exit(main())
