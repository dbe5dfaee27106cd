"""Per-call cost of `numba_flash.attention` from Python on a tiny problem (compile excluded).

    python scripts/launch_overhead.py [--seq 128 --head-dim 64 --calls 2000]

Times back-to-back calls with a host clock and one synchronisation at the end (the
throughput a Python loop sees), and single calls each followed by a synchronisation, and
compares with a bare CuPy elementwise op on the same stream as the floor of a launch.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba_flash


def main():
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + " Needs a GPU and CuPy.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--seq", type=int, default=128, help="query and key length")
    ap.add_argument("--head-dim", type=int, default=64, help="head dimension")
    ap.add_argument("--calls", type=int, default=2000, help="back-to-back calls timed in the loop")
    ap.add_argument("--profile", action="store_true", help="also print where an FA-2 call spends its time (cProfile)")
    a = ap.parse_args()
    import cupy as cp  # after parsing: --help works without CuPy or a GPU
    q, k, v = (cp.random.standard_normal((1, 1, a.seq, a.head_dim), dtype=cp.float32) for _ in range(3))
    rows = []
    for name, fn in (
        ("fa2", lambda: numba_flash.attention(q, k, v)),
        ("fa1", lambda: numba_flash.attention(q, k, v, algorithm="fa1")),
        ("cupy q * 2 (launch floor)", lambda: q * 2),
    ):
        for _ in range(20):
            fn()  # compile and warm up
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(a.calls):
            fn()
        cp.cuda.Device().synchronize()
        loop_us = (time.perf_counter() - t0) / a.calls * 1e6
        single = []
        for _ in range(200):
            t0 = time.perf_counter()
            fn()
            cp.cuda.Device().synchronize()
            single.append((time.perf_counter() - t0) * 1e6)
        rows.append((name, loop_us, statistics.median(single)))
    print(f"B=1 H=1 N={a.seq} D={a.head_dim} float32, {a.calls} calls")
    print("| call | us per call in a loop | us per synchronised call (median) |\n|---|---|---|")
    for name, loop_us, single_us in rows:
        print(f"| {name} | {loop_us:.1f} | {single_us:.1f} |")
    if a.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(500):
            numba_flash.attention(q, k, v)
        prof.disable()
        cp.cuda.Device().synchronize()
        print("\ncProfile of 500 FA-2 calls (cumulative time, top 25):")
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
        print("\nthe same, by own time (top 20):")
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
