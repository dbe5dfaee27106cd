"""What a new process pays for its first call, with and without the compilation cache.

    python scripts/first_call.py                      # every case, a fresh temporary cache
    python scripts/first_call.py --cases fwd_f16_causal --json

For each case, two fresh Python processes run the same call on the same seeded inputs, each
timing its first call end to end (host clock, synchronised; the imports are timed apart):

1. ``cold``: an empty cache folder (``NUMBA_FLASH_CACHE_DIR``): numba compiles every kernel
   of the call and ``numba_flash.compile_cache`` stores it;
2. ``cached``: the same folder: the kernels are loaded from it, nothing is compiled.

Each process also reports how many kernels it compiled (``CUDADispatcher.compile`` calls)
and loaded from the cache (``launch.load_cubin`` calls), and a checksum of its outputs: the
two processes must agree bit for bit. The table's last column is cold / cached.

Needs a CUDA GPU and CuPy; without them it says so in one line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CASES = {  # name: (what the child runs, its description)
    "fwd_f16_causal": "attention, float16 D64 causal, B1 H2 N256",
    "fwd_f32": "attention, float32 D64, B1 H2 N256",
    "bwd_f16_causal": "attention + attention_backward, float16 D64 causal, B1 H2 N256",
    "decode_f16": "decode, float16 D128, B2 H8 Hkv2, 1000 cached keys",
}


def child(case: str) -> dict:
    """One process's first call of ``case`` (run with ``--child``)."""
    t0 = time.perf_counter()
    import cupy as cp
    import numpy as np
    from numba.cuda.dispatcher import CUDADispatcher

    import numba_flash
    from numba_flash import launch

    counts = {"compiled": 0, "loaded": 0}
    compile_, load = CUDADispatcher.compile, launch.load_cubin

    def counting_compile(self, sig):
        counts["compiled"] += 1
        return compile_(self, sig)

    def counting_load(*args):
        counts["loaded"] += 1
        return load(*args)

    CUDADispatcher.compile = counting_compile
    launch.load_cubin = counting_load
    rng = np.random.default_rng(0)

    def randn(*shape, dtype="float16"):
        return cp.asarray(rng.standard_normal(shape).astype(dtype))

    cp.cuda.Device().synchronize()
    imported = time.perf_counter() - t0
    t1 = time.perf_counter()
    if case == "decode_f16":
        q, k, v = randn(2, 8, 1, 128), randn(2, 2, 1000, 128), randn(2, 2, 1000, 128)
        outs = [numba_flash.decode(q, k, v)]
    else:
        dtype = "float32" if case == "fwd_f32" else "float16"
        q, k, v = (randn(1, 2, 256, 64, dtype=dtype) for _ in range(3))
        causal = case.endswith("causal")
        o, lse = numba_flash.attention(q, k, v, causal=causal, return_lse=True)
        outs = [o, lse]
        if case.startswith("bwd"):
            do = randn(*o.shape, dtype=dtype)
            outs += list(numba_flash.attention_backward(do, q, k, v, o, lse, causal=causal))
    cp.cuda.Device().synchronize()
    first = time.perf_counter() - t1
    checksum = [float(cp.asnumpy(x).astype(np.float64).sum()) for x in outs]
    return {"case": case, "import_s": imported, "first_call_s": first, **counts, "checksum": checksum}


def run_child(case: str, cache: str) -> dict:
    env = dict(os.environ, NUMBA_FLASH_CACHE_DIR=cache, PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, __file__, "--child", case], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{case}: the child process failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    ap.add_argument("--cache-dir", help="the cache folder of both processes (default: a fresh temporary one)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--child", choices=list(CASES), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child)))
        return 0
    from numba_flash import needs

    needs.exit_unless("first_call.py", needs.gpu(), needs.module("cupy"))
    rows = []
    with tempfile.TemporaryDirectory(prefix="numba-flash-cache-") as fresh:
        for case in args.cases:
            cache = os.path.join(args.cache_dir or fresh, case)
            for stage in ("cold", "cached"):
                print(f"first_call.py: {case} ({CASES[case]}), {stage} process...", file=sys.stderr, flush=True)
                rows.append(dict(run_child(case, cache), stage=stage))
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'case':<16} {'stage':<7} {'import s':>8} {'first call s':>12} {'compiled':>8} {'loaded':>6}")
        for r in rows:
            print(f"{r['case']:<16} {r['stage']:<7} {r['import_s']:8.2f} {r['first_call_s']:12.3f} {r['compiled']:8d} {r['loaded']:6d}")
        for cold, cached in zip(rows[::2], rows[1::2]):
            print(f"{cold['case']}: cold / cached first call {cold['first_call_s'] / cached['first_call_s']:.1f}x")
    bad = [c["case"] for c, w in zip(rows[::2], rows[1::2]) if c["checksum"] != w["checksum"] or w["compiled"]]
    if bad:
        print(f"first_call.py: cached processes that compiled or disagreed: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
