"""Measured DRAM traffic and achieved occupancy (Nsight Compute) against the model.

    python scripts/ncu_traffic.py --out ncu-out            # on a GPU machine with ncu

Runs itself under ``ncu --clock-control none`` as the target (``--target``), where it
launches FA-1, FA-2 and the CuPy matmul-softmax-matmul baseline once per configuration,
each run framed by a tiny marker kernel so that the kernels of one run can be grouped.
Then it sums ``dram__bytes_read.sum + dram__bytes_write.sum`` per run, averages
``sm__warps_active.avg.pct_of_peak_sustained_active`` (achieved occupancy) over the
run's kernels weighted by duration, and sets them beside ``traffic.dram_bytes`` and
``traffic.traffic_bytes``. Writes ``ncu.csv``, ``ncu.md`` and two plots (bytes against
N; bytes against block_n), and prints the Markdown table.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys

from numba_flash import needs
from numba_flash.research.profiling.ncu import group_runs, parse_ncu_csv, run_ncu

BATCH, HEADS, HEAD_DIM = 4, 16, 64


SWEEP_BLOCK_M = 32  # block_m of the block_n sweep: 32 x 8 ... 32 x 32 all fit at D = 64


def plan(seqs, block_ns, standard_max_seq=4096):
    """Runs: every algorithm over N at the default tiles, then FA-1/FA-2 over block_n at
    N=4096 with block_m = SWEEP_BLOCK_M."""
    from numba_flash.tile_table import forward_tiles

    bm, bn_default = forward_tiles("fa2", HEAD_DIM, "float32", False)
    runs = []
    for n in seqs:
        for alg in ("fa1", "fa2", "standard"):
            if alg == "standard" and n > standard_max_seq:
                continue
            runs.append(dict(algorithm=alg, seq=n, block_m=bm, block_n=bn_default, sweep="seq"))
    for bn in block_ns:
        for alg in ("fa1", "fa2"):
            runs.append(dict(algorithm=alg, seq=4096, block_m=SWEEP_BLOCK_M, block_n=bn, sweep="block_n"))
    return runs


def run_target(runs):
    """Inside ncu: one marker, one run, per configuration (no warm-up: compiling is not a
    kernel launch, so the run's kernels are exactly the ones between markers)."""
    import numpy as np

    import numba_flash  # noqa: F401
    from numba_flash.api import forward
    from numba_flash.baselines import cupy_attention

    import cupy as cp

    from numba_flash.research.profiling.ncu import marker

    ncu_run_marker = marker()
    rng = np.random.default_rng(0)
    for r in runs:
        shape = (BATCH, HEADS, r["seq"], HEAD_DIM)
        q, k, v = (cp.asarray(rng.standard_normal(shape, dtype=np.float32)) for _ in range(3))
        cp.cuda.Device().synchronize()
        ncu_run_marker()
        if r["algorithm"] == "standard":
            cupy_attention(q, k, v)
        else:
            forward(q, k, v, algorithm=r["algorithm"], block_m=r["block_m"], block_n=r["block_n"])
        cp.cuda.Device().synchronize()
    ncu_run_marker()
    cp.cuda.Device().synchronize()


def add_model(results, l2_bytes):
    from numba_flash.research.profiling.traffic import dram_bytes, traffic_bytes

    for r in results:
        args = (r["algorithm"], BATCH, HEADS, HEADS, r["seq"], r["seq"], HEAD_DIM, r["block_m"], r["block_n"])
        r["model_dram_bytes"] = dram_bytes(*args, l2_bytes=l2_bytes)
        r["model_global_bytes"] = traffic_bytes(*args)
        r["model_over_measured"] = r["model_dram_bytes"] / r["dram_bytes"] if r["dram_bytes"] else float("nan")
    return results


def markdown(results) -> str:
    lines = [
        "| sweep | algorithm | N | block_n | kernels | time (ms) | DRAM measured (MB) | DRAM model (MB) | model / measured | global-request model (MB) | achieved occupancy |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['sweep']} | {r['algorithm']} | {r['seq']} | {r['block_n']} | {r['kernels']} | {r['time_ms']:.2f} | "
            f"{r['dram_bytes'] / 1e6:.1f} | {r['model_dram_bytes'] / 1e6:.1f} | {r['model_over_measured']:.2f} | "
            f"{r['model_global_bytes'] / 1e6:.1f} | {r['achieved_occupancy']:.1%} |"
        )
    return "\n".join(lines)


def plot(results, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for sweep, xkey, xlabel in (("seq", "seq", "sequence length N"), ("block_n", "block_n", "block_n (K/V tile rows)")):
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for alg, color in (("fa1", "C0"), ("fa2", "C1"), ("standard", "C2")):
            pts = sorted((r for r in results if r["sweep"] == sweep and r["algorithm"] == alg), key=lambda r: r[xkey])
            if not pts:
                continue
            x = [r[xkey] for r in pts]
            ax.plot(x, [r["dram_bytes"] / 1e9 for r in pts], "o-", color=color, label=f"{alg} measured (ncu)")
            ax.plot(x, [r["model_dram_bytes"] / 1e9 for r in pts], "x--", color=color, label=f"{alg} DRAM model")
            ax.plot(x, [r["model_global_bytes"] / 1e9 for r in pts], ":", color=color, alpha=0.6, label=f"{alg} global-request model")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("bytes moved (GB)")
        ax.set_title(f"DRAM traffic, B{BATCH} H{HEADS} D{HEAD_DIM} fp32, model vs ncu")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a sweep with no rows has nothing to label
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, f"ncu_traffic_vs_{sweep}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--block-n", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--out", default="ncu-out")
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.target:
        with open(a.plan) as f:
            run_target(json.load(f))
        return 0
    needs.exit_unless("ncu_traffic.py", needs.gpu(), needs.module("cupy"), needs.module("matplotlib"),
                      needs.tool(a.ncu, "Nsight Compute's command line, from the CUDA toolkit; or give its path to --ncu"))
    runs = plan(a.seq, a.block_n)
    os.makedirs(a.out, exist_ok=True)
    plan_path = os.path.join(a.out, "plan.json")
    with open(plan_path, "w") as f:
        json.dump(runs, f)
    raw = os.path.join(a.out, "ncu_raw.csv")
    target = [sys.executable, os.path.abspath(__file__), "--target", "--plan", plan_path]
    print(f"profiling {len(runs)} runs under {a.ncu} ...", file=sys.stderr, flush=True)
    results = group_runs(run_ncu(a.ncu, raw, target), runs)
    import cupy

    l2 = cupy.cuda.runtime.getDeviceProperties(0)["l2CacheSize"]
    add_model(results, l2)
    with open(os.path.join(a.out, "ncu.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(results[0]))
        w.writeheader()
        w.writerows(results)
    table = markdown(results)
    with open(os.path.join(a.out, "ncu.md"), "w") as f:
        f.write(f"L2 = {l2 / 2**20:.0f} MiB\n\n{table}\n")
    for p in plot(results, a.out):
        print(f"wrote {p}", file=sys.stderr)
    print(f"L2 = {l2 / 2**20:.0f} MiB")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
