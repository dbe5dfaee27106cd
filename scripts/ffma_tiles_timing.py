"""Time the CUDA-core float32 FA-2 forward (exact FFMA) at tile / micro-tile candidates against
PyTorch's memory-efficient SDPA, causal, B=1 H=8 D=64 (the long-context prefill).

    python scripts/ffma_tiles_timing.py                      # N = 16384 and 131072, every candidate
    python scripts/ffma_tiles_timing.py --seq 16384 --candidates 64x32 128x32 128x64 128x32:r8:cap168

A candidate is ``BMxBN[:r8][:capN]``: ``numba_flash.attention(q, k, v, causal=True, block_m=BM,
block_n=BN)`` with ``NUMBA_FLASH_FFMA_ROWS_PER_THREAD=8`` for ``:r8`` and
``NUMBA_FLASH_FFMA_MAXREG=N`` for ``:capN`` (the offline table: docs/performance-log.md,
"Tiles above 48 KiB and 8 rows per thread"). Those knobs are read when a configuration's spec
and kernel are first made (memoised), so every candidate runs in a child process of its own
(``--child``), with its own inputs (same seed) and check: the last 128 query rows of (batch 0,
head 0) against float64 NumPy, max |o - ref| / max |ref|. Timing: ``profiling.timing.median_ms``
(CUDA events; warm-up calls, which also compile, not timed). TFLOP/s = 2 B H N^2 D (causal: half
of 4 B H N^2 D).

Written offline on branch ffma-tiles; run on the H200 on 2026-11-30 (docs/performance-log.md,
"Tiles above 48 KiB and 8 rows per thread": 128x64 at 8 rows, 8.67 ms against 9.95 for 64x32).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

B, H, D = 1, 8, 64
CANDIDATES = ["64x32", "128x32", "128x64", "256x32", "64x64", "128x32:r8", "128x32:r8:cap168", "128x64:r8",
              "256x64:r8"]
CHECK_ROWS = 128
T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def parse_candidate(text):
    """``BMxBN[:r8][:capN]`` -> (block_m, block_n, environment)."""
    tiles, *opts = text.split(":")
    bm, bn = (int(x) for x in tiles.split("x"))
    env = {}
    for opt in opts:
        if opt.startswith("r"):
            env["NUMBA_FLASH_FFMA_ROWS_PER_THREAD"] = opt[1:]
        elif opt.startswith("cap"):
            env["NUMBA_FLASH_FFMA_MAXREG"] = opt[3:]
        else:
            raise ValueError(f"unknown option {opt!r} in {text!r} (r8, capN)")
    return bm, bn, env


def inputs(n, seed=0):
    import cupy as cp

    rng = cp.random.default_rng(seed)
    return tuple(rng.standard_normal((B, H, n, D), dtype=cp.float32) for _ in range(3))


def last_rows_error(o, q, k, v):
    """max |o - ref| / max |ref| over the last CHECK_ROWS query rows of (batch 0, head 0), causal
    (Nq = Nk: row i sees keys 0..i), reference in float64 NumPy."""
    import numpy as np

    n = q.shape[2]
    rows = np.arange(n - CHECK_ROWS, n)
    qh = q[0, 0, n - CHECK_ROWS:].get().astype(np.float64)
    kh, vh = (x[0, 0].get().astype(np.float64) for x in (k, v))
    s = qh @ kh.T / np.sqrt(D)
    s[np.arange(n)[None, :] > rows[:, None]] = -np.inf
    s -= s.max(axis=1, keepdims=True)
    p = np.exp(s)
    ref = (p / p.sum(axis=1, keepdims=True)) @ vh
    got = o[0, 0, n - CHECK_ROWS:].get().astype(np.float64)
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def median_ms(fn, repeats):
    from numba_flash.research.profiling.timing import median_ms as shared

    return shared(fn, warmup=2, repeats=repeats)


def child(n, candidate, repeats):
    """One candidate under this process's environment: a ``CHILD {json}`` line."""
    import numba_flash
    from numba_flash.specs import kernel_spec

    bm, bn, _ = parse_candidate(candidate)
    q, k, v = inputs(n)
    spec = kernel_spec("fa2", D, "float32", bm, bn, True)

    def run():
        return numba_flash.attention(q, k, v, causal=True, block_m=bm, block_n=bn)

    err = last_rows_error(run(), q, k, v)
    ms = median_ms(run, repeats)
    print("CHILD " + json.dumps(dict(ms=ms, err=err, rows=spec.rows_per_thread, cap=spec.register_cap,
                                     threads=spec.threads, dynamic_smem=spec.dynamic_smem)), flush=True)


def in_child(n, candidate, repeats):
    _, _, env = parse_candidate(candidate)
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", str(n), candidate, str(repeats)],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=900)
    lines = [x for x in done.stdout.splitlines() if x.startswith("CHILD ")]
    if done.returncode or not lines:
        raise RuntimeError(f"child failed ({done.returncode}): {(done.stderr or done.stdout)[-800:]}")
    return json.loads(lines[-1][6:])


def torch_ms(n, repeats):
    """PyTorch SDPA, memory-efficient backend, on the same inputs (DLPack views)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.from_dlpack(x) for x in inputs(n))
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        return median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), repeats)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[16384, 131072])
    ap.add_argument("--candidates", nargs="+", default=CANDIDATES)
    ap.add_argument("--repeats", type=int, default=0, help="timed runs (0: 10 below N = 65536, else 5)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        n, candidate, repeats = args.child
        return child(int(n), candidate, int(repeats))
    for c in args.candidates:
        parse_candidate(c)  # refuse a typo before any GPU time is spent
    print("| N | candidate | rows | cap | threads | dynamic smem | ms | TFLOP/s | vs torch mem-efficient | rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in args.seq:
        repeats = args.repeats or (10 if n < 65536 else 5)
        flops = 2.0 * B * H * n * n * D
        peer = None
        if not args.no_torch:
            try:
                peer = torch_ms(n, repeats)
                log(f"N={n} torch mem-efficient {peer:.3f} ms ({flops / peer / 1e9:.1f} TFLOP/s)")
                print(f"| {n} | torch SDPA mem-efficient | | | | | {peer:.3f} | {flops / peer / 1e9:.1f} | 1.00 | |")
            except Exception as e:  # noqa: BLE001 (recorded, the sweep goes on)
                log(f"N={n} torch failed: {e}")
        for c in args.candidates:
            try:
                r = in_child(n, c, repeats)
            except Exception as e:  # noqa: BLE001
                log(f"N={n} {c}: {e}")
                print(f"| {n} | {c} | | | | | failed | | | |")
                continue
            ratio = f"{peer / r['ms']:.3f}" if peer else ""
            log(f"N={n} {c}: {r['ms']:.3f} ms, err {r['err']:.2e}")
            print(f"| {n} | {c} | {r['rows']} | {r['cap']} | {r['threads']} | {r['dynamic_smem']} | {r['ms']:.3f} | "
                  f"{flops / r['ms'] / 1e9:.1f} | {ratio} | {r['err']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
