"""Is a change slower? This tree against a base tree, same GPU, same inputs, interleaved processes.

    git worktree add /tmp/base aa02300                      # (or any copy of a base revision)
    python scripts/regression_timing.py --base /tmp/base [--rounds 2] [--json out.json]

Each round runs one child process per tree (``PYTHONPATH`` set to that tree) that times every
case of :data:`CASES` with CUDA events (median of ``--repeats`` queued calls after warm-up,
the tree's own ``median_ms``, ``research.profiling.timing``'s; compilation is excluded); the trees
alternate within a round so that a drift of the machine hits both. One line per case: each tree's
best median over the rounds and the ratio (this tree's time / base's: above 1.02 fails the refactor's "nothing slower" rule).
The cases are the benchmarks' headline configurations: forward at B4 H16 N4096 (both loop orders,
float16, bfloat16, float32 on CUDA cores and tf32x3, D 64 and 128, causal and not), the backward
at the same shape (FA-2 with atomics and deterministic, D 64 and 128, causal; FA-1 at D 64), and decode (B1 H32 Hkv8 1M keys; B64 x 4096 keys). Needs a GPU, CuPy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

B, H, N = 4, 16, 4096
CASES = (
    [("fwd", alg, dt, None, d, c) for alg in ("fa2",) for dt in ("float16", "bfloat16") for d in (64, 128)
     for c in (False, True)]
    + [("fwd", "fa2", "float32", p, d, c) for p in (None, "tf32x3") for d in (64, 128) for c in (False, True)]
    + [("fwd", "fa1", dt, p, 64, c) for dt, p in (("float16", None), ("float32", None)) for c in (False, True)]
    + [("bwd", "fa2", dt, None, d, True) for dt in ("float16", "float32") for d in (64, 128)]
    + [("bwd", "fa2det", dt, None, d, True) for dt in ("float16", "float32") for d in (64, 128)]
    + [("bwd", "fa1", dt, None, 64, False) for dt in ("float16", "float32")]
    + [("dec", "fa2", "float16", None, 128, n) for n in ("1M", "64x4096")]
)


def child(cases, repeats) -> None:
    """Time ``cases`` in this process (the tree on ``sys.path`` first); one JSON line each."""
    import cupy as cp

    import numba_flash

    try:
        from numba_flash.research.profiling.timing import median_ms
    except ImportError:  # a base tree from before the research tools moved (issue 22)
        from numba_flash.profiling.timing import median_ms

    def rand(shape, dtype):
        x = cp.random.standard_normal(shape, dtype=cp.float32)
        if dtype == "bfloat16":
            import torch

            return torch.as_tensor(x, device="cuda").to(torch.bfloat16)
        return x.astype(dtype)

    for kind, alg, dtype, precision, d, extra in cases:
        cp.random.seed(0)
        try:
            if kind == "dec":
                batch, keys = (1, 1 << 20) if extra == "1M" else (64, 4096)
                q = rand((batch, 32, 1, d), dtype)
                k, v = rand((batch, 8, keys, d), dtype), rand((batch, 8, keys, d), dtype)
                fn = lambda: numba_flash.decode(q, k, v)  # noqa: E731
            else:
                q, k, v = (rand((B, H, N, d), dtype) for _ in range(3))
                opts = dict(causal=extra, algorithm="fa2" if kind == "bwd" else alg)
                if precision:
                    opts["precision"] = precision
                if kind == "fwd":
                    fn = lambda: numba_flash.attention(q, k, v, **opts)  # noqa: E731
                else:
                    o, lse = numba_flash.attention(q, k, v, return_lse=True, **opts)
                    do = rand(o.shape, dtype)
                    how = dict(algorithm="fa1" if alg == "fa1" else "fa2", deterministic=alg == "fa2det")
                    fn = lambda: numba_flash.attention_backward(do, q, k, v, o, lse, causal=extra, **how)  # noqa: E731
            fn()
            cp.cuda.Device().synchronize()
            ms = median_ms(fn, warmup=3, repeats=repeats)
            row = dict(case=[kind, alg, dtype, precision, d, extra], ms=ms)
        except Exception as e:  # noqa: BLE001 -- a case that fails is reported, the rest still run
            row = dict(case=[kind, alg, dtype, precision, d, extra], error=f"{type(e).__name__}: {e}"[:200])
        print(json.dumps(row), flush=True)


def run_tree(root, repeats, match):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--repeats", str(repeats)] + (["--match", match] if match else [])
    out = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True)
    if out.returncode:
        sys.stderr.write(out.stderr[-3000:])
    rows = {}
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            rows[json.dumps(r["case"])] = r
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="the base tree (a checkout of the revision to compare against)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--match", help="only cases whose description contains this")
    ap.add_argument("--json", help="write every round's rows here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cases = [c for c in CASES if not args.match or args.match in " ".join(map(str, c))]
    if args.child:
        child(cases, args.repeats)
        return 0
    if not args.base:
        ap.error("--base is required")
    from numba_flash import needs

    needs.exit_unless("regression_timing.py", needs.gpu(), needs.module("cupy"))
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"this": here, "base": os.path.abspath(args.base)}
    rounds = []
    for r in range(args.rounds):
        order = ("base", "this") if r % 2 == 0 else ("this", "base")
        for name in order:
            print(f"round {r + 1}/{args.rounds}: {name} ({len(cases)} cases)", file=sys.stderr, flush=True)
            rounds.append((name, run_tree(trees[name], args.repeats, args.match)))
    worst, missing = 0.0, 0
    print(f"{'case':48s} {'base ms':>9s} {'this ms':>9s} {'this/base':>9s}")
    for c in cases:
        key = json.dumps(list(c))
        best = {}
        for name, rows in rounds:
            ms = rows.get(key, {}).get("ms")
            if ms is not None:
                best[name] = min(best.get(name, ms), ms)
        if len(best) == 2:
            ratio = best["this"] / best["base"]
            worst = max(worst, ratio)
            print(f"{' '.join(map(str, c)):48s} {best['base']:9.4f} {best['this']:9.4f} {ratio:9.3f}")
        else:
            missing += 1
            errs = [rows.get(key, {}).get("error") for _, rows in rounds]
            print(f"{' '.join(map(str, c)):48s} missing: {[e for e in errs if e][:1]}")
    print(f"worst ratio {worst:.3f} ({'within' if worst <= 1.02 else 'OUTSIDE'} 2%)"
          + (f"; {missing} of {len(cases)} cases not timed in both trees" if missing else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(tree=n, rows=list(r.values())) for n, r in rounds], f, indent=1)
    return 0 if worst <= 1.02 and not missing and cases else 1


if __name__ == "__main__":
    sys.exit(main())
