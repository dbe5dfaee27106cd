"""Time FA-2 tf32x3 / tf32 (numba_flash) against PyTorch's memory-efficient SDPA on one GPU.

    python scripts/tf32_timing.py
    python scripts/tf32_timing.py --no-sweep   # skip the tile / register-cap sweep

B=4 H=16 N=4096, D=64 and D=128, float32 CuPy inputs (torch reads the same memory through
DLPack). Each configuration: warm-up, then the median of >= 10 CUDA-event timings.
TFLOP/s = 4 B H N^2 D / time (non-causal; causal counts the same FLOPs, as the repo's
other tables do, so its figure is "effective"). The ratio is numba_flash / torch SDPA
(efficient backend) on the same inputs and causality. Relative error: max |o - ref| / max |ref|
on the first (batch, head), ref in float64 (NumPy).

The optional sweep re-runs tf32x3 with other tiles (block_m/block_n) and with the register cap
of the tensor-core kernels switched off/on (NUMBA_FLASH_TC_MAXREG, read when a kernel spec is
made, and kernel specs are memoised: run each cap in its own process). Budget: about 2-3 minutes
on an H100/H200.
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
    from numba_flash.profiling.timing import median_ms as shared_median_ms

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    args = ap.parse_args()

    import cupy as cp
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import numba_flash

    log(f"numba_flash from {os.path.dirname(numba_flash.__file__)}; torch {torch.__version__}; "
        f"GPU {torch.cuda.get_device_name()}; NUMBA_FLASH_TC_MAXREG={os.environ.get('NUMBA_FLASH_TC_MAXREG')}")
    from numba_flash.kernels.tc_ops import default_tc_tiles, tc_register_cap

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
            rows.append(("torch-efficient", D, causal, "-", None, t_ref, tf_ref, 1.0, e_t))
            for precision in ("tf32x3", "tf32"):
                tiles = default_tc_tiles(precision, D)
                cap = tc_register_cap(precision, D, *tiles)

                def run(precision=precision):
                    return numba_flash.attention(q, k, v, precision=precision, causal=causal)

                run()  # compile outside the timing
                t = median_ms(run)
                e = rel_err(run(), ref)
                tf = flops / t / 1e9
                log(f"D={D} causal={causal} {precision} {tiles[0]}x{tiles[1]} cap={cap}: {t:.3f} ms {tf:.1f} TFLOP/s "
                    f"= {tf / tf_ref:.2f}x SDPA, rel err {e:.2e}")
                rows.append((precision, D, causal, f"{tiles[0]}x{tiles[1]}", cap, t, tf, tf / tf_ref, e))
            if args.no_sweep or causal:
                continue
            # tf32x3 sweep (non-causal): other tiles, and the default tiles with the register cap
            # flipped (none <-> 128); each is one more compile (~10-20 s)
            default = default_tc_tiles("tf32x3", D)
            flip = "0" if tc_register_cap("tf32x3", D, *default) else "128"
            for (bm, bn), env in [(default, flip), ((64, 32), None), ((128, 64), None), ((64, 64), None)]:
                if env is None:
                    os.environ.pop("NUMBA_FLASH_TC_MAXREG", None)
                else:
                    os.environ["NUMBA_FLASH_TC_MAXREG"] = env
                cap = tc_register_cap("tf32x3", D, bm, bn)
                label = f"tf32x3 {bm}x{bn} cap={cap}"
                try:
                    def run(bm=bm, bn=bn):
                        return numba_flash.attention(q, k, v, precision="tf32x3", block_m=bm, block_n=bn)

                    run()
                    t = median_ms(run)
                    e = rel_err(run(), ref)
                except Exception as exc:  # e.g. tiles the kernel refuses
                    log(f"D={D} {label}: skipped ({type(exc).__name__}: {exc})")
                    continue
                finally:
                    os.environ.pop("NUMBA_FLASH_TC_MAXREG", None)
                tf = flops / t / 1e9
                log(f"D={D} {label}: {t:.3f} ms {tf:.1f} TFLOP/s = {tf / tf_ref:.2f}x SDPA, rel err {e:.2e}")
                rows.append(("sweep tf32x3", D, False, f"{bm}x{bn}", cap, t, tf, tf / tf_ref, e))
        del q, k, v, tq, tk, tv
        cp.get_default_memory_pool().free_all_blocks()

    print("\n| kernel | D | causal | tiles | reg cap | ms | TFLOP/s | x SDPA-efficient | rel err (b0,h0) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, D, causal, tiles, cap, t, tf, ratio, e in rows:
        print(f"| {name} | {D} | {causal} | {tiles} | {cap} | {t:.3f} | {tf:.1f} | {ratio:.2f} | {e:.2e} |")
    log("done")


if __name__ == "__main__":
    sys.exit(main())
