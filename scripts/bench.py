"""Benchmark sweep: FA-1 and FA-2 against CuPy and PyTorch SDPA, on the GPU at hand.

Reproduces the H200 results table:

    python scripts/bench.py --seq 1024 2048 4096 8192 --head-dim 64 128 --dtype float32 float16 --causal both --long-context --out bench-out

For every configuration (seq, head_dim, causal, dtype), in one process, by the harness of
``numba-flash compare`` and ``ablate`` (``numba_flash.research.harness``; one ``measure`` a row):

1. fresh standard-normal inputs q, k, v of shape (B, H, N, D) (seeded NumPy, copied to the
   GPU as CuPy arrays);
2. FA-1 and FA-2 are checked against the float64 on-device reference
   (``cupy_attention`` of the upcast inputs): relative error ||o - o_ref|| / ||o_ref||,
   on every head when the float64 score matrix (B*H*N*N*8 bytes) fits
   ``harness.REF_BUDGET_BYTES`` (16 GB), else on batch 0, head 0 (its last query rows at
   very long N);
3. every implementation is timed by ``median_ms`` (CUDA events; the warm-up calls,
   which also compile, are not timed) and rated in TFLOP/s (``attention_flops``:
   4*B*H*N*N*D, halved for causal), with speed-ups against the CuPy baseline and
   against torch SDPA's memory-efficient backend measured on the same inputs. The FA
   kernels run with their default tiles (autotuned ones when cached) and regime: CUDA
   cores for float32, tensor cores for float16.

A peer that fails on a shape (out of memory, unsupported backend, ...) is recorded as
failed with the reason; FA-1 above ``--skip-fa1-above`` is recorded as skipped. Nothing
is silently dropped and no failure stops the sweep.

Outputs in ``--out`` (rewritten after every configuration, so a killed run keeps what
it measured): ``bench.csv`` (one row per configuration and implementation),
``bench.md`` (one table per (dtype, head_dim, causal)), and
``tflops_<dtype>_d<D>_<causal|noncausal>.png`` (TFLOP/s against N). The Markdown is
also printed to stdout at the end; progress goes to stderr, one line per measurement.

``--long-context`` adds FA-2 at B=1 H=8 N=131072 D=64 float32 and reports the device
memory it takes beyond its inputs and output o (CuPy's memory pool, read before and
after one call): the logsumexp, B*H*N*4 bytes, O(N) -- where S would be O(N^2).

``--backward`` also times the backward pass of every sweep row (the harness's ``backward``):
FA-1 and FA-2 run ``attention_backward`` (its default regime: tensor cores for float16,
tf32x3 for float32) of their own o and lse for a seeded upstream gradient, their gradients
checked against float64 (``grad_rel_err``: the largest of dq, dk, dv); each PyTorch SDPA
backend is timed through ``torch.autograd.grad`` (the CuPy baseline has no backward).
TFLOP/s at 2.5x the forward's FLOPs, as the FlashAttention papers count the backward.
bench.md gains a backward table per group.

``--launch-overhead`` adds the cost of a call from Python on a tiny problem (B=1 H=1 N=128 D=64
float32, compilation excluded): ``--launch-calls`` back-to-back calls timed by the host clock
with one synchronisation at the end (what a Python loop sees: a call's host work hides behind
the previous call's kernel), and single calls each followed by a synchronisation (median: the
latency, host work included), for FA-2, FA-1 and a CuPy elementwise op on the same stream (the
floor of a launch). Its rows carry ``ms`` (per call in the loop) and ``sync_ms``.

Needs a CUDA GPU and CuPy (torch optional); ``--dry-run`` lists the plan anywhere.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import itertools
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numba_flash  # (chooses GPU or simulator before numba.cuda is imported)
from numba_flash import needs
from numba_flash._world import simulated
from numba_flash.research import harness
from numba_flash.research.cli import positive_int
from numba_flash.research.profiling.timing import attention_flops
from numba_flash.research.report import display_name, markdown_table

IMPL_CHOICES = ("fa1", "fa2", "cupy", "torch")
SDPA_MEM_EFFICIENT = "torch-mem_efficient"  # the name torch_sdpa_backends gives it
TOLERANCE = {"float32": 1e-4, "float16": 1e-2}  # rel_err above this: status "inaccurate"
LONG_WARMUP = 1  # the long-context row takes seconds a call
LONG_CONTEXT = dict(seq=131072, head_dim=64, causal=False, dtype="float32", batch=1, heads=8)
LAUNCH = dict(seq=128, head_dim=64, causal=False, dtype="float32", batch=1, heads=1)  # --launch-overhead
LAUNCH_FLOOR = "cupy-elementwise"  # q * 2: one kernel launch from Python, the floor of a call
LAUNCH_WARMUP, LAUNCH_SINGLE = 20, 200  # untimed calls; synchronised calls timed one by one

# bench.csv columns: the result table first, then the details behind it.
CSV_FIELDS = [
    "seq", "head_dim", "causal", "dtype", "batch", "heads", "impl",
    "ms", "tflops", "rel_err", "vs_cupy", "vs_sdpa_mem_efficient", "status",
    "bwd_ms", "bwd_tflops", "grad_rel_err",
    "sync_ms", "rel_err_scope", "grad_rel_err_scope", "tiles", "regs", "occupancy", "extra_mem_bytes", "suite",
]  # fmt: skip


# ----------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Config:
    """One problem: every implementation runs on the same inputs of this shape."""

    seq: int
    head_dim: int
    causal: bool
    dtype: str
    batch: int
    heads: int
    suite: str = "sweep"  # "sweep", "long-context" or "launch-overhead"

    @property
    def group(self) -> tuple[str, int, bool]:
        """The Markdown table and plot this configuration belongs to."""
        return self.dtype, self.head_dim, self.causal

    @property
    def flops(self) -> float:
        return attention_flops(self.batch, self.heads, self.seq, self.seq, self.head_dim, self.causal)

    def problem(self) -> dict:
        """The harness's problem (``harness.describe``): default tiles and regime."""
        return harness.describe(self.batch, self.heads, self.seq, self.head_dim, self.dtype, self.causal)

    def label(self) -> str:
        mask = "causal" if self.causal else "noncausal"
        return f"{self.dtype} D{self.head_dim} {mask} B{self.batch} H{self.heads} N{self.seq}"


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="bench.py", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seq", type=positive_int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    ap.add_argument("--head-dim", type=positive_int, nargs="+", default=[64, 128])
    ap.add_argument("--causal", choices=["both", "on", "off"], default="both")
    ap.add_argument("--dtype", choices=["float32", "float16"], nargs="+", default=["float32", "float16"])
    ap.add_argument("--batch", type=positive_int, default=4)
    ap.add_argument("--heads", type=positive_int, default=16)
    ap.add_argument(
        "--tokens", type=positive_int, help="keep B*N constant: batch = tokens // seq (overrides --batch)"
    )
    ap.add_argument(
        "--impl", choices=IMPL_CHOICES, nargs="+", default=list(IMPL_CHOICES),
        help="torch: every SDPA backend torch offers for the dtype",
    )  # fmt: skip
    ap.add_argument("--repeats", type=positive_int, default=20, help="timed runs (median reported)")
    ap.add_argument("--long-repeats", type=positive_int, default=5, help="timed runs of the --long-context row")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-out", help="directory for bench.csv, bench.md and the plots")
    ap.add_argument(
        "--skip-fa1-above", type=positive_int, default=8192, help="record FA-1 as skipped for N above this"
    )
    ap.add_argument("--long-context", action="store_true", help="add FA-2 at B=1 H=8 N=131072 D=64 float32")
    ap.add_argument("--launch-overhead", action="store_true",
                    help="add the per-call cost from Python at B=1 H=1 N=128 D=64 float32 (see above)")
    ap.add_argument("--launch-calls", type=positive_int, default=2000,
                    help="back-to-back calls timed by --launch-overhead")
    ap.add_argument("--backward", action="store_true",
                    help="also time each sweep row's backward pass and check FA's gradients (see above)")
    ap.add_argument("--dry-run", action="store_true", help="print the planned configurations and exit")
    args = ap.parse_args(argv)
    if args.tokens is not None and args.tokens < max(args.seq):
        ap.error(f"--tokens ({args.tokens}) must be at least the largest --seq ({max(args.seq)})")
    args.impl = list(dict.fromkeys(args.impl))  # drop repeats, keep the order
    return args


def sweep_configs(args: argparse.Namespace) -> list[Config]:
    """The sweep, dtype outermost (so each kernel's newest compiled overload is the one in use)."""
    causals = {"both": (False, True), "on": (True,), "off": (False,)}[args.causal]
    return [
        Config(n, d, causal, dtype, args.tokens // n if args.tokens else args.batch, args.heads)
        for dtype in args.dtype
        for d in args.head_dim
        for causal in causals
        for n in args.seq
    ]


def impl_entries(cfg: Config, impls: list[str], skip_fa1_above: int, sdpa_names: list[str]):
    """``[(impl, status)]`` for one configuration: status ``None`` runs it, else it is the row's status."""
    entries = []
    for impl in impls:
        if impl == "torch":
            if sdpa_names:
                entries.extend((name, None) for name in sdpa_names)
            else:
                entries.append(("torch", "missing: torch with CUDA not available (no SDPA backend to run)"))
        elif impl == "fa1" and cfg.seq > skip_fa1_above:
            entries.append((impl, f"skipped: N={cfg.seq} > --skip-fa1-above {skip_fa1_above}"))
        else:
            entries.append((impl, None))
    return entries


def build_plan(args: argparse.Namespace, sdpa_names: dict[str, list[str]]):
    """``[(Config, [(impl, status)])]``: everything the run will measure or record as not run.

    ``sdpa_names``: dtype -> the torch SDPA backends available for it.
    """
    plan = [
        (cfg, impl_entries(cfg, args.impl, args.skip_fa1_above, sdpa_names.get(cfg.dtype, [])))
        for cfg in sweep_configs(args)
    ]
    if args.long_context:
        plan.append((Config(**LONG_CONTEXT, suite="long-context"), [("fa2", None)]))
    if args.launch_overhead:
        plan.append((Config(**LAUNCH, suite="launch-overhead"), [("fa2", None), ("fa1", None), (LAUNCH_FLOOR, None)]))
    return plan


def format_plan(plan) -> str:
    lines = []
    for i, (cfg, entries) in enumerate(plan, 1):
        impls = ", ".join(impl if status is None else f"{impl} [{status}]" for impl, status in entries)
        suite = "" if cfg.suite == "sweep" else f" ({cfg.suite})"
        lines.append(f"{i:3d}. {cfg.label()}{suite}: {impls}")
    n_runs = sum(status is None for _, entries in plan for _, status in entries)
    n_rows = sum(len(entries) for _, entries in plan)
    lines.append(f"{len(plan)} configurations, {n_rows} rows, {n_runs} measurements")
    return "\n".join(lines)


def sdpa_backend_names(args: argparse.Namespace) -> dict[str, list[str]]:
    """dtype -> torch SDPA backend names, asked of torch only when ``--impl`` includes it."""
    if "torch" not in args.impl:
        return {}
    from numba_flash.baselines import torch_sdpa_backends

    return {dtype: list(torch_sdpa_backends(dtype)) for dtype in args.dtype}


# ------------------------------------------------------------------ rows and ratios


def new_row(cfg: Config, impl: str, status: str | None) -> dict:
    """A result row (the harness's, ``harness.new_row``) of this configuration's suite."""
    return {**harness.new_row(cfg.problem(), impl, status), "suite": cfg.suite}


def add_ratios(rows: list[dict]) -> None:
    """Fill ``vs_cupy`` and ``vs_sdpa_mem_efficient`` for the rows of one configuration.

    A ratio is the implementation's speed-up over the peer: peer ms / own ms (> 1: faster).
    """
    by_impl = {r["impl"]: r for r in rows}
    for column, peer in (("vs_cupy", "cupy"), ("vs_sdpa_mem_efficient", SDPA_MEM_EFFICIENT)):
        for r in rows:
            r[column] = harness.time_ratio(by_impl.get(peer), r)


def accuracy_status(rel_err: float | None, dtype: str) -> str:
    if rel_err is None or rel_err <= TOLERANCE[dtype]:
        return "ok"
    return f"inaccurate: rel_err {rel_err:.1e} > {TOLERANCE[dtype]:.0e}"  # NaN lands here too


# ---------------------------------------------------------------- GPU measurements


def measure_row(cfg: Config, problem: dict, impl: str, repeats: int, backward: bool = False) -> dict:
    """One implementation's row (``harness.measure_or_fail``: never raises, a failure is the status);
    an FA row of the long-context suite also records the device memory one call takes; with
    ``backward``, the row also holds the backward pass."""
    row = new_row(cfg, impl, None)
    options = dict(backward=True) if backward else {}
    row.update(harness.measure_or_fail(
        problem, impl, repeats, warmup=harness.WARMUP if cfg.suite == "sweep" else LONG_WARMUP,
        device_memory=cfg.suite == "long-context", **options,
    ))  # fmt: skip
    if row["status"] == "ok":
        row["status"] = accuracy_status(row["rel_err"], cfg.dtype)
    return row


def measure_config(cfg: Config, entries, seed: int, repeats: int, report, backward: bool = False) -> list[dict]:
    """All rows of one configuration, on one set of inputs; ``report(row, seconds)`` after each;
    ``backward``: the backward pass too."""
    try:
        problem = harness.make_problem(cfg.problem(), seed)
    except Exception as exc:  # out of memory for the inputs
        problem = None
        entries = [(impl, status or harness.failure(exc)) for impl, status in entries]
    rows = []
    for impl, status in entries:
        start = time.perf_counter()
        row = measure_row(cfg, problem, impl, repeats, backward) if status is None else new_row(cfg, impl, status)
        report(row, time.perf_counter() - start)
        rows.append(row)
    add_ratios(rows)
    del problem
    harness.release_memory()
    return rows


def per_call_us(fn, calls: int, synchronize, single: int = LAUNCH_SINGLE) -> tuple[float, float]:
    """(us per call over ``calls`` back-to-back calls and one synchronisation, median us of
    ``single`` calls each followed by a synchronisation), after ``LAUNCH_WARMUP`` untimed calls."""
    for _ in range(LAUNCH_WARMUP):
        fn()  # compiles, warms the plan cache
    synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize()
    loop_us = (time.perf_counter() - start) / calls * 1e6
    times = []
    for _ in range(single):
        start = time.perf_counter()
        fn()
        synchronize()
        times.append((time.perf_counter() - start) * 1e6)
    return loop_us, statistics.median(times)


def measure_launch(cfg: Config, entries, seed: int, calls: int, report) -> list[dict]:
    """The rows of ``--launch-overhead``: each implementation's per-call cost (:func:`per_call_us`)
    on one set of inputs; a failure stays in its row."""
    import cupy

    problem = harness.make_problem(cfg.problem(), seed)
    q, k, v = problem["q"], problem["k"], problem["v"]
    rows = []
    for impl, status in entries:
        start = time.perf_counter()
        row = new_row(cfg, impl, status or "ok")
        if status is None:
            if impl == LAUNCH_FLOOR:
                def fn():
                    return q * 2
            else:
                def fn(impl=impl):
                    return numba_flash.attention(q, k, v, causal=cfg.causal, algorithm=impl)
            try:
                loop_us, sync_us = per_call_us(fn, calls, cupy.cuda.Device().synchronize)
                row.update(ms=loop_us / 1e3, sync_ms=sync_us / 1e3)
            except Exception as exc:  # recorded, the run goes on
                row["status"] = harness.failure(exc)
        report(row, time.perf_counter() - start)
        rows.append(row)
    del problem
    harness.release_memory()
    return rows


def progress_line(index: int, total: int, row: dict, seconds: float, elapsed: float) -> str:
    cfg = f"{row['dtype']} D{row['head_dim']} {'causal' if row['causal'] else 'noncausal'} "
    cfg += f"B{row['batch']} H{row['heads']} N{row['seq']}"
    if row.get("sync_ms") is not None:
        what = f"{row['ms'] * 1e3:.1f} us per call in a loop, {row['sync_ms'] * 1e3:.1f} us synchronised"
    elif row["ms"] is not None:
        what = f"{row['ms']:.3f} ms {row['tflops']:.2f} TFLOP/s"
        if row["rel_err"] is not None:
            what += f" rel_err {row['rel_err']:.1e}"
        if row.get("bwd_ms") is not None:
            what += f", backward {row['bwd_ms']:.3f} ms {row['bwd_tflops']:.2f} TFLOP/s"
        if row.get("grad_rel_err") is not None:
            what += f" grad_rel_err {row['grad_rel_err']:.1e}"
        if row["status"] != "ok":
            what += f" [{row['status']}]"
    else:
        what = row["status"]
    width = len(str(total))
    return f"[{index:>{width}}/{total}] {cfg} {row['impl']}: {what} ({seconds:.1f} s; {elapsed:.0f} s elapsed)"


def run_plan(plan, args: argparse.Namespace, meta: dict, out_dir: Path) -> list[dict]:
    """Measure everything in ``plan``; rewrite bench.csv and bench.md after each configuration."""
    total = sum(len(entries) for _, entries in plan)
    index = itertools.count(1)
    start = time.perf_counter()

    def report(row, seconds):
        line = progress_line(next(index), total, row, seconds, time.perf_counter() - start)
        print(line, file=sys.stderr, flush=True)

    rows: list[dict] = []
    for cfg, entries in plan:
        repeats = args.repeats if cfg.suite == "sweep" else args.long_repeats
        if cfg.suite == "launch-overhead":
            rows.extend(measure_launch(cfg, entries, args.seed, args.launch_calls, report))
        else:
            backward = args.backward and cfg.suite == "sweep"
            rows.extend(measure_config(cfg, entries, args.seed, repeats, report, backward))
        write_csv(rows, out_dir / "bench.csv")
        (out_dir / "bench.md").write_text(markdown_report(rows, meta))
    return rows


def environment(argv: list[str], args: argparse.Namespace) -> dict:
    """The header of bench.md: command, date, GPU, versions, method."""
    from numba_flash.research.profiling.run_info import gpu_name, versions

    return {
        "command": "`" + shlex.join(["python", os.path.relpath(__file__), *argv]) + "`",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "GPU": gpu_name(),
        "versions": versions(),
        "timing": (
            f"median of {args.repeats} runs ({args.long_repeats} for the long-context row) by CUDA events, "
            f"after untimed warm-up runs (compilation never timed); "
            f"TFLOP/s with FLOPs = 4*B*H*N*N*D, halved for causal"
            + ("; the backward's FLOPs are 2.5x the forward's" if args.backward else "")
        ),
        "rel err": (
            "||o - o_ref|| / ||o_ref|| against float64 CuPy attention of the same inputs "
            f"(all heads while the float64 scores fit {harness.REF_BUDGET_BYTES / 1e9:.0f} GB, else as marked)"
        ),
    }


# ----------------------------------------------------------------------- outputs


def write_csv(rows: list[dict], path: Path) -> None:
    """bench.csv: ``CSV_FIELDS`` of every row, the tiles as ``block_mxblock_n``."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({**r, "tiles": tiles(r)} for r in rows)


def tiles(row: dict) -> str | None:
    return None if row["block_m"] is None else f"{row['block_m']}x{row['block_n']}"


def grouped(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Sweep rows by (dtype, head_dim, causal), in order of first appearance."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["suite"] == "sweep":
            groups.setdefault((r["dtype"], r["head_dim"], r["causal"]), []).append(r)
    return groups


def group_title(dtype: str, head_dim: int, causal: bool) -> str:
    return f"{dtype}, D={head_dim}, {'causal' if causal else 'non-causal'}"


def speedup(by_impl: dict, slower: str, faster: str = "fa2") -> str:
    """``slower`` ms / ``faster`` ms as "1.23x", or "—" when either was not measured."""
    ratio = harness.time_ratio(by_impl.get(slower), by_impl.get(faster))
    return "—" if ratio is None else f"{ratio:.2f}x"


def tflops_cell(row: dict | None) -> str:
    if row is None:
        return "—"
    if row["ms"] is None:
        return row["status"].split(":")[0]  # failed / skipped / missing
    return f"{row['tflops']:.2f}" + (" (!)" if row["status"] != "ok" else "")


def rel_err_cell(row: dict | None, mark_scope: bool = True) -> str:
    """The relative error; with ``mark_scope``, a † when it was checked on part of the output."""
    if row is None or row["rel_err"] is None:
        return "—"
    partial = mark_scope and row["rel_err_scope"] != "all"
    return f"{row['rel_err']:.1e}" + ("†" if partial else "")


def group_section(key: tuple, rows: list[dict]) -> list[str]:
    """One table: a row per N, TFLOP/s per implementation, FA-2 speed-ups, FA errors."""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fa = [i for i in harness.ALGORITHMS if i in impls]
    header = ["N", "B", *impls, "FA-2/FA-1", "FA-2/SDPA-mem-efficient", *(f"rel err {i}" for i in fa)]
    body = []
    for seq in dict.fromkeys(r["seq"] for r in rows):
        by_impl = {r["impl"]: r for r in rows if r["seq"] == seq}
        batch = next(iter(by_impl.values()))["batch"]
        body.append(
            [str(seq), str(batch), *(tflops_cell(by_impl.get(i)) for i in impls),
             speedup(by_impl, "fa1"), speedup(by_impl, SDPA_MEM_EFFICIENT),
             *(rel_err_cell(by_impl.get(i)) for i in fa)]
        )  # fmt: skip
    heads = sorted({r["heads"] for r in rows})
    ran = {i: sorted({tiles(r) for r in rows if r["impl"] == i} - {None}) for i in fa}  # the tiles of every run
    tile_names = ", ".join(f"{display_name(i)} {' / '.join(ran[i])}" for i in fa if ran[i])
    lines = [f"### {group_title(*key)}", ""]
    lines.append(
        f"H={', '.join(map(str, heads))}. TFLOP/s per implementation; FA-2/X = time of X / time of FA-2 "
        f"(> 1: FA-2 faster)." + (f" Tiles (block_m x block_n): {tile_names}." if tile_names else "")
    )
    lines += [""] + markdown_table(header, body)
    notes = [f"- N={r['seq']} {r['impl']}: {r['status']}" for r in rows if r["status"] != "ok"]
    scopes = sorted({r["rel_err_scope"] for r in rows if r["rel_err_scope"] not in (None, "all")})
    notes += [f"- † rel err checked on {s} only" for s in scopes]
    lines += ([""] + notes if notes else []) + [""]
    if any(r.get("bwd_ms") is not None or r.get("grad_rel_err") is not None for r in rows):
        lines += backward_section(key, rows)
    return lines


def backward_section(key: tuple, rows: list[dict]) -> list[str]:
    """The group's backward table (``--backward``): a row per N, backward TFLOP/s per
    implementation that has one, FA-2's backward speed-ups, FA's gradient errors."""
    impls = list(dict.fromkeys(r["impl"] for r in rows if r["impl"] != "cupy"))  # CuPy: no backward
    fa = [i for i in harness.ALGORITHMS if i in impls]
    header = ["N", "B", *impls, "FA-2/FA-1", "FA-2/SDPA-mem-efficient", *(f"grad rel err {i}" for i in fa)]

    def tflops(row):
        if row is None:
            return "—"
        if row.get("bwd_ms") is None:
            return row["status"].split(":")[0] if row["status"] != "ok" else "—"
        return f"{row['bwd_tflops']:.2f}"

    def ratio(by_impl, slower):
        own, peer = by_impl.get("fa2"), by_impl.get(slower)
        if own is None or peer is None or own.get("bwd_ms") is None or peer.get("bwd_ms") is None:
            return "—"
        return f"{peer['bwd_ms'] / own['bwd_ms']:.2f}x"

    def grad_err(row):
        if row is None or row.get("grad_rel_err") is None:
            return "—"
        return f"{row['grad_rel_err']:.1e}" + ("†" if row.get("grad_rel_err_scope") not in (None, "all") else "")

    body = []
    for seq in dict.fromkeys(r["seq"] for r in rows):
        by_impl = {r["impl"]: r for r in rows if r["seq"] == seq}
        batch = next(iter(by_impl.values()))["batch"]
        body.append([str(seq), str(batch), *(tflops(by_impl.get(i)) for i in impls), ratio(by_impl, "fa1"),
                     ratio(by_impl, SDPA_MEM_EFFICIENT), *(grad_err(by_impl.get(i)) for i in fa)])
    intro = ("Backward TFLOP/s (2.5x the forward's FLOPs): FA's attention_backward of its own o and lse, "
             "PyTorch SDPA's autograd; FA-2/X = backward time of X / that of FA-2. Gradients' error: the "
             "largest relative error of dq, dk, dv against float64.")
    scopes = sorted({r["grad_rel_err_scope"] for r in rows if r.get("grad_rel_err_scope") not in (None, "all")})
    notes = [f"- grad rel err {s}" if s.startswith("not checked") else f"- † grad rel err checked on {s} only"
             for s in scopes]
    return [f"### {group_title(*key)}: backward", "", intro, ""] + markdown_table(header, body) + notes + [""]


def long_context_section(rows: list[dict]) -> list[str]:
    header = ["impl", "B", "H", "N", "D", "dtype", "causal", "ms", "TFLOP/s", "rel err", "checked on",
              "extra device memory", "logsumexp (B*H*N*4)", "S in float32 (B*H*N*N*4)"]  # fmt: skip
    body = []
    for r in rows:
        lse_bytes = r["batch"] * r["heads"] * r["seq"] * 4
        s_bytes = lse_bytes * r["seq"]
        timed = r["ms"] is not None
        body.append(
            [r["impl"], str(r["batch"]), str(r["heads"]), str(r["seq"]), str(r["head_dim"]), r["dtype"],
             str(r["causal"]), f"{r['ms']:.1f}" if timed else r["status"],
             f"{r['tflops']:.2f}" if timed else "—", rel_err_cell(r, mark_scope=False), r["rel_err_scope"] or "—",
             human_bytes(r["extra_mem_bytes"]), human_bytes(lse_bytes), human_bytes(s_bytes)]
        )  # fmt: skip
    intro = (
        "Device memory beyond the inputs and the output o, from CuPy's pool around one call: "
        "FA-2 keeps only the logsumexp, O(N), where materialised attention needs S, O(N^2)."
    )
    notes = [f"- {r['impl']}: {r['status']}" for r in rows if r["status"] != "ok"]
    return ["### Long context (FA-2)", "", intro, ""] + markdown_table(header, body) + notes + [""]


def launch_section(rows: list[dict]) -> list[str]:
    header = ["call", "us per call in a loop", "us per synchronised call (median)"]
    body = [[r["impl"], *((f"{r['ms'] * 1e3:.1f}", f"{r['sync_ms'] * 1e3:.1f}") if r.get("sync_ms") is not None
                          else (r["status"], "—"))] for r in rows]
    r = rows[0]
    intro = (f"B={r['batch']} H={r['heads']} N={r['seq']} D={r['head_dim']} {r['dtype']}: a call's cost from "
             f"Python (host clock, compilation excluded); {LAUNCH_FLOOR} is q * 2 on the same stream, one launch.")
    return ["### Launch overhead", "", intro, ""] + markdown_table(header, body) + [""]


def human_bytes(n: int | None) -> str:
    if n is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def markdown_report(rows: list[dict], meta: dict) -> str:
    """bench.md: the header (command, date, GPU, versions, method), then one table per group."""
    lines = ["## numba_flash benchmark", ""] + [f"- {key}: {value}" for key, value in meta.items()] + [""]
    for key, group_rows in grouped(rows).items():
        lines += group_section(key, group_rows)
    long_rows = [r for r in rows if r["suite"] == "long-context"]
    if long_rows:
        lines += long_context_section(long_rows)
    launch_rows = [r for r in rows if r["suite"] == "launch-overhead"]
    if launch_rows:
        lines += launch_section(launch_rows)
    return "\n".join(lines)


def plot_group(key: tuple, rows: list[dict], path: Path, gpu: str) -> bool:
    """TFLOP/s against N (log2 axis), one line per implementation; False when nothing was timed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullLocator

    series = {}
    for r in rows:
        if r["tflops"] is not None:
            series.setdefault(r["impl"], []).append((r["seq"], r["tflops"]))
    if not series:
        return False
    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)  # the Agg backend, without touching pyplot's global state
    ax = fig.subplots()
    for impl, points in series.items():
        ns, values = zip(*sorted(points))
        ax.plot(ns, values, marker="o", label=impl)
    seqs = sorted({r["seq"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(seqs, [str(n) for n in seqs])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("TFLOP/s")
    batches = sorted({r["batch"] for r in rows})
    shape = f"B={batches[0]}" if len(batches) == 1 else f"B*N={rows[0]['batch'] * rows[0]['seq']}"
    ax.set_title(f"{group_title(*key)}, {shape}, H={rows[0]['heads']} -- {gpu}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def plot_name(key: tuple) -> str:
    dtype, head_dim, causal = key
    return f"tflops_{dtype}_d{head_dim}_{'causal' if causal else 'noncausal'}.png"


def write_plots(rows: list[dict], out_dir: Path, gpu: str) -> list[Path]:
    written = []
    for key, group_rows in grouped(rows).items():
        path = out_dir / plot_name(key)
        if plot_group(key, group_rows, path, gpu):
            written.append(path)
    return written


# -------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.dry_run:
        print(format_plan(build_plan(args, sdpa_backend_names(args))))
        if simulated():
            print("(no GPU here: the plan is all --dry-run does; the run itself needs a CUDA GPU)")
        return 0
    needs.exit_unless("bench.py", needs.gpu(), needs.module("cupy"), instead="--dry-run prints the planned configurations")
    plan = build_plan(args, sdpa_backend_names(args))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = environment(argv, args)
    print(f"{len(plan)} configurations on {meta['GPU']}; writing to {out_dir}/", file=sys.stderr, flush=True)
    rows = run_plan(plan, args, meta, out_dir)
    try:
        plots = write_plots(rows, out_dir, meta["GPU"])
        print(f"plots: {', '.join(p.name for p in plots) or 'none'}", file=sys.stderr, flush=True)
    except ImportError:
        print("matplotlib is not installed: no plots (pip install 'numba-flash[plot]')", file=sys.stderr)
    print(markdown_report(rows, meta), flush=True)
    if rows and not any(r["status"] == "ok" for r in rows):
        print(f"bench.py: none of the {len(rows)} rows was measured (see their status)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
