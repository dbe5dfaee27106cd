"""FA-1 against FA-2 on the same inputs: the main job of ``numba-flash compare``.

For each algorithm, a row of ``harness.measure``: error against the float64 reference, time and
TFLOP/s (GPU only: CUDA events, warm-up excluded, median), registers, shared memory, theoretical
occupancy (GPU only), and the modelled global-memory traffic. On a GPU the CuPy
matmul-softmax-matmul baseline (and PyTorch SDPA when installed) are timed in the same
run so that every figure has a peer beside it.
"""

from __future__ import annotations

from numba_flash._world import simulated
from numba_flash.research.harness import (
    ALGORITHMS, REF_BUDGET_BYTES, describe, make_problem, measure, measure_or_fail, peer_names, time_ratio,
)
from numba_flash.research.report import SHAPE, display_name, markdown_table, shape_label

# Problems `compare` runs when the user names none: the research shape on a GPU, and a
# small one the simulator finishes in seconds.
GPU_DEFAULT = dict(batch=4, heads=16, seq=4096, head_dim=64)
SIM_DEFAULT = dict(batch=1, heads=2, seq=48, head_dim=16, block_m=16, block_n=16)
REFUSE_SECONDS = 600.0  # a simulated run expected to take longer is refused unless asked for (--force)


class SimulatorTooSlow(Exception):
    """A simulated run expected to take longer than :data:`REFUSE_SECONDS`, not asked for with ``--force``."""


def problem_of(args) -> dict:
    """The problem of ``args`` (``harness.describe``): the flags given, the world's defaults for the rest."""
    defaults = SIM_DEFAULT if simulated() else GPU_DEFAULT
    given = {key: getattr(args, key, None) for key in ("batch", "heads", "seq", "head_dim", "block_m", "block_n")}
    precision = getattr(args, "precision", "default")
    p = describe(
        **{key: defaults.get(key) if value is None else value for key, value in given.items()},
        dtype=args.dtype, causal=args.causal, kv_heads=args.kv_heads, seq_k=args.seq_k,
        precision=None if precision in (None, "default") else precision,
    )
    cuda_cores = p["precision"] == "ieee" or (p["precision"] is None and p["dtype"] == "float32")
    if cuda_cores and p["block_m"] is None and p["block_n"] is None:  # FA-1 and FA-2 at the same tiles
        from numba_flash.tile_table import comparison_tiles

        p["block_m"], p["block_n"] = comparison_tiles(p["head_dim"])
    return p


def setup(args, say, algorithms=ALGORITHMS, backward=False):
    """The problem of ``args`` built (``harness.make_problem``), and notes for the table. In the
    simulator, first ``say`` how long ``algorithms`` (and with ``backward`` their backward passes)
    will take, or raise :class:`SimulatorTooSlow` when that is more than :data:`REFUSE_SECONDS`
    and ``args.force`` is not set; ``ValueError`` for a problem the kernels refuse."""
    from numba_flash.simulator import format_seconds

    p = problem_of(args)
    if simulated():  # from the shapes alone, before any input is made
        shape = shape_label(p) + f" {p['dtype']}{' causal' if p['causal'] else ''}"
        estimate = simulated_seconds(p, algorithms, backward)
        if estimate > REFUSE_SECONDS and not getattr(args, "force", False):
            raise SimulatorTooSlow(
                f"no GPU: {shape} would take about {format_seconds(estimate)} in Numba's CUDA simulator (more than "
                f"{REFUSE_SECONDS / 60:.0f} minutes); pass --force to run it anyway, or smaller --seq/--head-dim/--batch/--heads"
            )
        say(f"no GPU: running {shape} in Numba's CUDA simulator, about {format_seconds(estimate)} for "
            f"{len(algorithms)} kernels{' and their backward passes' if backward else ''}"
            + ("; smaller --seq/--head-dim/--batch/--heads run faster" if estimate >= 60 else ""))
    problem = make_problem(p, args.seed)
    notes = []
    if problem["rel_err_scope"] != "all":
        notes.append(f"Errors checked on {problem['rel_err_scope']} only: the float64 scores of every head "
                     f"would take more than {REF_BUDGET_BYTES / 1e9:.0f} GB.")
    if problem["sim"]:
        notes.append(
            "No GPU: ran in Numba's CUDA simulator on a small problem (no timings or "
            "occupancy; errors and modelled traffic are real)."
        )
    return problem, notes


def compare(args, progress=None):
    """Run both algorithms on one problem; return (rows, notes) for :func:`format_table`.

    ``progress``: called with a line per stage (the CLI prints them to stderr as they come)."""
    import time

    say = progress or (lambda line: None)
    backward = bool(getattr(args, "backward", False))
    algorithms = tuple(getattr(args, "algorithms", None) or ALGORITHMS)
    if backward and "fa3" in algorithms:
        raise ValueError("fa3 has no backward yet: compare --backward takes --algorithms fa1 fa2")
    problem, notes = setup(args, say, algorithms=algorithms, backward=backward)
    rows = []
    for n, alg in enumerate(algorithms, 1):
        name = display_name(alg)
        started = time.perf_counter()
        say(f"[{n}/{len(algorithms)}] {name}: {'simulating' if problem['sim'] else 'compiling, checking against float64, timing'} ...")
        row = measure(problem, alg, args.repeats, backward=backward)
        rows.append(row)
        say(f"[{n}/{len(algorithms)}] {name}: done in {time.perf_counter() - started:.1f} s, relative error {row['rel_err']:.1e}")
    if not problem["sim"]:
        say("timing the peers (CuPy matmul-softmax-matmul, PyTorch SDPA backends) ...")
        for name in peer_names(problem["p"]["dtype"]):
            notes.append(peer_note(measure_or_fail(problem, name, args.repeats, backward=backward)))
        by_alg = dict(zip(algorithms, rows))
        for slow, fast in (("fa1", "fa2"), ("fa2", "fa3")):
            if slow in by_alg and fast in by_alg:
                notes.append(f"{display_name(fast)} / {display_name(slow)} speed: {time_ratio(by_alg[slow], by_alg[fast]):.2f}x")
        if backward and "fa1" in by_alg and "fa2" in by_alg:
            notes.append(f"FA-2 / FA-1 backward speed: {by_alg['fa1']['bwd_ms'] / by_alg['fa2']['bwd_ms']:.2f}x")
    return rows, notes


def peer_note(row) -> str:
    """A peer's row as a line under the table: its time and TFLOP/s, or why it has none."""
    if row["ms"] is None:
        return f"peer {row['impl']}: {row['status']}"
    note = f"peer {row['impl']}: {row['ms']:.3f} ms, {row['tflops']:.1f} TFLOP/s"
    if row["bwd_ms"] is not None:
        note += f"; backward {row['bwd_ms']:.3f} ms, {row['bwd_tflops']:.1f} TFLOP/s"
    return note


def simulated_seconds(p: dict, algorithms=ALGORITHMS, backward: bool = False) -> float:
    """About how long the simulator takes for ``algorithms`` on problem ``p`` (``harness.describe``),
    from its shapes alone: each forward (``api.simulated_seconds``) and, with ``backward``, the
    ``attention_backward`` call that follows it (:func:`backward_seconds`). ``ValueError`` for a
    problem the kernels refuse."""
    import numpy as np

    from numba_flash.api import configure
    from numba_flash.api import simulated_seconds as forward_seconds
    from numba_flash.problem import describe as describe_problem
    from numba_flash.research.harness import numpy_dtype

    zero = np.zeros((), numpy_dtype(p["dtype"]))  # broadcast views: shapes and dtype, no memory
    q = np.broadcast_to(zero, (p["batch"], p["heads"], p["seq"], p["head_dim"]))
    kv = np.broadcast_to(zero, (p["batch"], p["kv_heads"], p["seq_k"], p["head_dim"]))
    total = 0.0
    for alg in algorithms:
        if alg == "fa3":  # (its loop order is FA-2's; its simulated cost is of the same order)
            alg = "fa2"
        problem = describe_problem(q, kv, kv, causal=p["causal"], algorithm=alg, precision=p["precision"])
        total += forward_seconds(configure(problem, p["block_m"], p["block_n"]))
        if backward:
            total += backward_seconds(problem)
    return total


def backward_seconds(problem) -> float:
    """About how long the simulator takes for ``attention_backward`` of a checked problem, at the
    regime and tiles that call picks (``backward.simulated_seconds``)."""
    from numba_flash.backward import simulated_seconds

    return simulated_seconds(problem)


# The table's lines: a label and its cells, templates over a row (and its traffic in MB). A line
# whose keys no row has is left out, or said n/a where only a GPU measures them.
_LINES = [
    ("regime", "{regime}"),
    ("shape", SHAPE),
    ("dtype", "{dtype}"),
    ("causal", "{causal}"),
    ("block_m x block_n", "{block_m} x {block_n}"),
    ("max \\|o - ref\\|", "{max_abs_err:.2e}"),
    ("relative error", "{rel_err:.2e}"),
    ("time (ms, median)", "{ms:.3f}"),
    ("TFLOP/s", "{tflops:.2f}"),
    ("registers / thread", "{regs}"),
    ("shared memory / block (B)", "{smem_bytes}"),
    ("local (spill) bytes / thread", "{local_bytes}"),
    ("resident blocks / SM", "{blocks_per_sm}"),
    ("theoretical occupancy", "{occupancy:.1%}"),
    ("modelled global traffic (MB)", "{modelled_mb:.3f}"),
    ("backward: gradients' relative error", "{grad_rel_err:.2e}"),
    ("backward: gradients checked on", "{grad_rel_err_scope}"),
    ("backward: time (ms, median)", "{bwd_ms:.3f}"),
    ("backward: TFLOP/s (2.5x forward FLOPs)", "{bwd_tflops:.2f}"),
]
_GPU_ONLY = {"ms", "tflops", "regs", "occupancy", "bwd_ms", "bwd_tflops"}


def format_table(rows, notes) -> str:
    """One table, FA-1 and FA-2 side by side, then the notes (peers, ratio, world)."""
    import string

    values = [dict(r, modelled_mb=r["modelled_bytes"] / 1e6) for r in rows]
    body = []
    backward = any(r.get("grad_rel_err_scope") is not None for r in rows)  # compare --backward
    for label, template in _LINES:
        if label.startswith("backward") and not backward:
            continue
        keys = [field for _, field, _, _ in string.Formatter().parse(template) if field]
        cells = [template.format(**v) if all(v[key] is not None for key in keys) else "n/a" for v in values]
        if cells == ["n/a"] * len(rows):
            if not set(keys) <= _GPU_ONLY:
                continue
            cells = ["n/a (simulator)"] * len(rows)
        body.append([label, *cells])
    table = markdown_table(["", *(display_name(r["impl"]) for r in rows)], body)
    return "\n".join(table + [""] + notes)
