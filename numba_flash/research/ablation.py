"""``numba-flash ablate``: every point of the FA-1 -> FA-2 space on the same inputs (issue 10).

The variants are ``kernels.forward.Variant`` (loop order, grid, rescale, warp partition, O load
placement); each is measured by ``harness.measure`` -- the harness ``compare`` uses -- and the
rows gain the variant's switches, its grid size and its barriers per K/V tile. The *path* walks
from FA-1 to FA-2 one factor at a time (warp partition, grid, rescale, loop order); its waterfall
(``--plot``) shows each step's share of the FA-2 / FA-1 speed-up on a GPU, or of the modelled
traffic saving in the simulator (no timings there).
"""

from __future__ import annotations

import itertools
import math

from numba_flash.kernels.forward import (FA1, FA2, GRIDS, LOOP_ORDERS, O_LOADS, RESCALES, WARP_PARTITIONS, Variant,
                                         tensor_core_min_block_n)
from numba_flash.problem import TENSOR_CORE_KIND
from numba_flash.research.report import markdown_table, shape_label

SWITCHES = ("loop_order", "grid", "rescale", "warp_partition", "o_load")

# FA-1 -> FA-2, one factor at a time: the order in which FlashAttention-2 section 3 argues them,
# from FA-1 as that paper describes its warps (split-K, section 3.3; this project's FA-1 kernel
# splits Q rows, as its register tiles do: the second point).
PATH = (
    Variant("kv_outer", "heads", "every_step", "split_k"),  # FA-1 with split-K warps
    FA1,  # + split-Q warps (section 3.3)
    Variant("kv_outer", "heads_x_qtiles", "every_step"),  # + sequence parallelism (section 3.2)
    Variant("kv_outer", "heads_x_qtiles", "deferred"),  # + fewer non-matmul FLOPs (section 3.1)
    FA2,  # + Q outer: O, l, m on chip (Algorithm 1)
)


def all_variants() -> list[Variant]:
    """Every point built: 2 loop orders x 2 grids x 2 rescales x 2 warp partitions, and the O
    load placement of kv_outer (24)."""
    return [Variant(loop, grid, rescale, warps, o_load)
            for loop, grid, rescale, warps, o_load in itertools.product(LOOP_ORDERS, GRIDS, RESCALES, WARP_PARTITIONS, O_LOADS)
            if loop == "kv_outer" or o_load == "at_update"]


def parse_variant(text: str) -> Variant:
    """``fa1``, ``fa2``, or the dash-joined switches of :attr:`Variant.name`
    (``kv_outer-heads_x_qtiles-deferred-split_q-at_update``; trailing switches may be left out)."""
    if text in ("fa1", "fa2"):
        return FA1 if text == "fa1" else FA2
    parts = text.split("-")
    if not 3 <= len(parts) <= 5:
        raise ValueError(f"a variant is fa1, fa2 or loop_order-grid-rescale[-warp_partition[-o_load]]; got {text!r}")
    return Variant(*parts)


def barriers_per_kv_tile(variant: Variant, n_q: int, n_k: int, block_m: int, block_n: int, causal: bool,
                         tensor_cores: bool = False) -> float:
    """Block-wide barriers per K/V tile a block visits, averaged over the blocks (the kernels'
    ``cuda.syncthreads``, as ``kernels.forward`` and ``kernels.pipeline`` place them): q_outer 3
    per K/V tile on CUDA cores (the synchronous copies: 2 around K_j, V_j's load, 1 after P~),
    4 on tensor cores (the ``cp.async`` schedule: 2 around S, 2 around P~V); its split_k merge,
    2 per Q tile at the end of the walk, is not counted. kv_outer: 1 per K/V tile, and per Q
    tile it updates with it 3 (before Q_i's load, after it, after P~), 5 with split_k (the
    groups' states merged through shared memory at every step: 2 more)."""
    if variant.loop_order == "q_outer":
        return 4.0 if tensor_cores else 3.0
    from numba_flash.research.profiling.traffic import visible_tiles

    per_pair = 5 if variant.warp_partition == "split_k" else 3
    tiles = visible_tiles(n_q, n_k, block_m, block_n, causal)
    n_kv = -(-n_k // block_n)
    pairs = sum(n_tiles for _, n_tiles, _ in tiles)  # visited (Q tile, K/V tile) pairs of one head
    if variant.grid == "heads":
        return 1 + per_pair * pairs / n_kv
    return 1 + per_pair * pairs / (n_kv * len(tiles))  # each block: every K/V tile, its one Q tile


def ablate(args, progress=None):
    """Measure ``args.variants`` (default: all) on one problem; returns ``(rows, notes)``."""
    import time

    from numba_flash.research.compare import problem_of, setup
    from numba_flash.research.harness import measure

    say = progress or (lambda line: None)
    variants = [parse_variant(v) for v in args.variants] if args.variants else all_variants()
    for needed in PATH:  # the path's points are always measured
        if needed not in variants:
            variants.append(needed)
    p = problem_of(args)
    # The engine: CUDA cores for float32 (and --precision ieee), tensor cores for the 16-bit
    # dtypes (or --precision tf32 / tf32x3): the same loop nests (kernels.forward) on either.
    regime = p["precision"] or TENSOR_CORE_KIND.get(p["dtype"], "ieee")
    args.precision = "ieee" if regime == "ieee" else p["precision"]  # (None: the 16-bit dtype's kind)
    if args.block_m is None or args.block_n is None:  # one tile choice for every variant (tile_table)
        from numba_flash.api import choose_tiles
        from numba_flash.tile_table import comparison_tiles, forward_tc_tiles

        if regime == "ieee":
            bm, bn = comparison_tiles(p["head_dim"])
        else:
            from numba_flash.kernels.tc_ops import kernel_head_dim

            bm, bn = forward_tc_tiles(regime, kernel_head_dim(regime, p["head_dim"]))
            bn = max([bn] + [tensor_core_min_block_n(v) for v in variants])  # (split_k: 16 keys a group)
        args.block_m, args.block_n = choose_tiles(regime, "fa1", p["head_dim"], p["dtype"], p["causal"],
                                                  bm if args.block_m is None else args.block_m,
                                                  bn if args.block_n is None else args.block_n)
    problem, notes = setup(args, say, algorithms=tuple("fa1" if v.loop_order == "kv_outer" else "fa2" for v in variants))
    rows = []
    for n, variant in enumerate(variants, 1):
        started = time.perf_counter()
        algorithm = "fa1" if variant.loop_order == "kv_outer" else "fa2"
        say(f"[{n}/{len(variants)}] {variant.name} ...")
        row = measure(problem, algorithm, args.repeats, variant=variant)
        row = {
            **{key: getattr(variant, key) for key in SWITCHES},
            "variant": variant.name,
            **row,  # its blocks, threads and shared memory: the variant's launch specification
            "barriers_per_kv_tile": barriers_per_kv_tile(variant, p["seq"], p["seq_k"], row["block_m"], row["block_n"],
                                                         p["causal"], regime != "ieee"),
        }
        rows.append(row)
        say(f"[{n}/{len(variants)}] {variant.name}: done in {time.perf_counter() - started:.1f} s, relative error {row['rel_err']:.1e}")
    notes.extend(path_notes(rows))
    return rows, notes


def path_steps(rows) -> list[tuple[str, dict, dict]]:
    """The PATH's steps as ``(factor, before, after)`` rows (from its first point measured: on
    tensor cores FA-1 with split-Q warps)."""
    by_name = {row["variant"]: row for row in rows}
    path = [v for v in PATH if v.name in by_name]
    steps = []
    for before, after in zip(path, path[1:]):
        factor = next(key for key in SWITCHES if getattr(before, key) != getattr(after, key))
        steps.append((f"{factor}: {getattr(before, factor)} -> {getattr(after, factor)}", by_name[before.name], by_name[after.name]))
    return steps


def path_notes(rows) -> list[str]:
    """One line per step of the path: its speed-up (GPU) and traffic change, and its share."""
    steps = path_steps(rows)
    timed = all(r["ms"] is not None for _, r0, r1 in steps for r in (r0, r1))
    key = "ms" if timed else "modelled_bytes"
    total = math.log(steps[0][1][key] / steps[-1][2][key]) if steps[0][1][key] and steps[-1][2][key] else 0.0
    notes = [f"FA-1 -> FA-2 one factor at a time ({'median time' if timed else 'modelled traffic: no timings here'}):"]
    for factor, r0, r1 in steps:
        gain = r0[key] / r1[key] if r1[key] else float("inf")
        share = math.log(gain) / total if total else float("nan")
        notes.append(f"  {factor}: {gain:.2f}x ({share:.0%} of the whole)")
    return notes


def plot_waterfall(rows, path: str) -> str:
    """The path as a waterfall (PNG at ``path``): each factor's log-share of the FA-2 / FA-1 gain."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = path_steps(rows)
    timed = all(r["ms"] is not None for _, r0, r1 in steps for r in (r0, r1))
    key = "ms" if timed else "modelled_bytes"
    gains = [math.log2(r0[key] / r1[key]) for _, r0, r1 in steps]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    bottom = 0.0
    for i, ((factor, _, _), g) in enumerate(zip(steps, gains)):
        ax.bar(i, g, bottom=bottom, color="tab:green" if g >= 0 else "tab:red")  # from the running total
        ax.text(i, max(bottom, bottom + g) + 0.03, f"{2 ** g:.2f}x", ha="center", va="bottom", fontsize=8)
        bottom += g
    ax.bar(len(steps), bottom, color="tab:blue")
    ax.text(len(steps), max(bottom, 0) + 0.03, f"{2 ** bottom:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_xticks(range(len(steps) + 1), [f.replace(": ", "\n").replace(" -> ", "\n-> ") for f, _, _ in steps]
                  + ["FA-2 /\nFA-1 with\nsplit-K warps" if steps[0][1]["warp_partition"] == "split_k" else "FA-2 /\nFA-1"],
                  fontsize=7)
    ax.set_ylabel("log2 gain (" + ("time" if timed else "modelled traffic") + ")")
    r = rows[0]
    engine = r.get("regime") or "CUDA cores"
    ax.set_title(f"FA-1 -> FA-2, one factor at a time: {shape_label(r)} {r['dtype']}{' causal' if r['causal'] else ''},\n"
                 f"{engine}", fontsize=9)  # (two lines: the tensor-core engine's name is long)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def format_ablation(rows, notes) -> str:
    """One line per variant (its switches, error, time, traffic, grid, barriers, resources), then the notes."""
    def cell(value, fmt):
        return "n/a" if value is None else fmt.format(value)

    header = ["loop order", "grid", "rescale", "warps", "O load", "rel err", "ms", "TFLOP/s", "model MB", "DRAM MB (ncu)",
              "blocks", "barriers / KV tile", "regs", "occupancy", "achieved (ncu)", "smem ld+st M inst (ncu)",
              "barrier stall (ncu)"]
    body = []
    for r in rows:
        dram = r.get("dram_bytes")
        body.append([
            r["loop_order"], r["grid"], r["rescale"], r["warp_partition"], r["o_load"] if r["loop_order"] == "kv_outer" else "-",
            f"{r['rel_err']:.1e}", cell(r["ms"], "{:.3f}"), cell(r["tflops"], "{:.2f}"),
            f"{r['modelled_bytes'] / 1e6:.3f}", cell(None if dram is None else dram / 1e6, "{:.1f}"), str(r["blocks"]),
            f"{r['barriers_per_kv_tile']:.1f}", cell(r["regs"], "{}"), cell(r["occupancy"], "{:.0%}"),
            cell(r.get("achieved_occupancy"), "{:.0%}"),
            cell(None if r.get("shared_ld") is None else (r["shared_ld"] + r["shared_st"]) / 1e6, "{:.1f}"),
            cell(r.get("barrier_stall"), "{:.0%}"),
        ])
    return "\n".join(markdown_table(header, body) + [""] + notes)


def _ncu_problem_args(args) -> dict:
    """The problem flags of ``args``, to rebuild the same inputs in the profiled process."""
    keys = ("batch", "heads", "kv_heads", "seq", "seq_k", "head_dim", "causal", "dtype", "block_m", "block_n", "seed")
    return {key: getattr(args, key) for key in keys}


def ncu_target(plan_path: str) -> None:
    """Inside ncu: the problem of the plan, then each variant once between marker kernels."""
    import argparse
    import json

    from numba_flash.api import forward
    from numba_flash.research.compare import setup
    from numba_flash.research.profiling.ncu import marker

    with open(plan_path) as f:
        plan = json.load(f)
    args = argparse.Namespace(**plan["args"], precision="ieee", repeats=1)
    problem, _ = setup(args, lambda line: None)
    p, q, k, v = problem["p"], problem["q"], problem["k"], problem["v"]
    mark = marker()
    sync = _synchronize(q)
    for name in plan["variants"]:
        variant = parse_variant(name)
        algorithm = "fa1" if variant.loop_order == "kv_outer" else "fa2"
        sync()
        mark()
        forward(q, k, v, causal=p["causal"], algorithm=algorithm, block_m=p["block_m"], block_n=p["block_n"],
                precision="ieee", variant=variant, num_splits=1)
        sync()
    mark()
    sync()


def _synchronize(x):
    import numpy as np

    if isinstance(x, np.ndarray):  # the simulator: every launch has finished when it returns
        return lambda: None
    if type(x).__module__.startswith("torch"):
        import torch

        return torch.cuda.synchronize
    import cupy

    return cupy.cuda.Device().synchronize


def add_ncu(rows, args, ncu: str, workdir: str) -> None:
    """Measured DRAM bytes and achieved occupancy of every row's variant (Nsight Compute), run
    in a child process under ``ncu``: ``dram_bytes``, ``achieved_occupancy`` added to the rows,
    and ``shared_ld``, ``shared_st``, ``barrier_stall`` (``ncu.WARP_METRICS``) where this ncu
    knows those metrics (else the run is repeated without them, said on stderr)."""
    import json
    import os
    import sys

    import subprocess

    from numba_flash.research.profiling.ncu import METRICS, WARP_METRICS, group_runs, run_ncu

    os.makedirs(workdir, exist_ok=True)
    plan_path = os.path.join(workdir, "ablate_ncu_plan.json")
    with open(plan_path, "w") as f:
        json.dump(dict(args=_ncu_problem_args(args), variants=[r["variant"] for r in rows]), f)
    target = [sys.executable, "-c", f"from numba_flash.research.ablation import ncu_target; ncu_target({plan_path!r})"]
    log_file = os.path.join(workdir, "ablate_ncu.csv")
    try:
        kernels = run_ncu(ncu, log_file, target, metrics=(*METRICS, *WARP_METRICS))
    except subprocess.CalledProcessError:
        print("numba-flash ablate: ncu refused the shared-memory and barrier metrics; profiling again without them",
              file=sys.stderr, flush=True)
        kernels = run_ncu(ncu, log_file, target)
    for row, m in zip(rows, group_runs(kernels, rows)):
        for key in ("dram_bytes", "achieved_occupancy", "shared_ld", "shared_st", "barrier_stall"):
            if key in m:
                row[key] = m[key]
