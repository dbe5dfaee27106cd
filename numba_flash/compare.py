"""FA-1 against FA-2 on the same inputs: the main job of ``numba-flash compare``.

For each algorithm: error against the float64 reference, time and TFLOP/s (GPU only:
CUDA events, warm-up excluded, median), registers, shared memory, theoretical
occupancy (GPU only), and the modelled global-memory traffic. On a GPU the CuPy
matmul-softmax-matmul baseline (and PyTorch SDPA when installed) are timed in the same
run so that every figure has a peer beside it.
"""

from __future__ import annotations

import numpy as np

from numba_flash._world import simulated
from numba_flash.specs import kernel_spec
from numba_flash.tensor_cores import regime
from numba_flash.profiling.timing import attention_flops, median_ms, tflops
from numba_flash.profiling.traffic import traffic_bytes

ALGORITHMS = ("fa1", "fa2")


# Problems `compare` runs when the user names none: the research shape on a GPU, and a
# small one the simulator finishes in seconds.
GPU_DEFAULT = dict(batch=4, heads=16, seq=4096, head_dim=64)
SIM_DEFAULT = dict(batch=1, heads=2, seq=48, head_dim=16, block_m=16, block_n=16)


def _problem(args) -> dict:
    defaults = SIM_DEFAULT if simulated() else GPU_DEFAULT
    p = {}
    for key in ("batch", "heads", "seq", "head_dim", "block_m", "block_n"):
        given = getattr(args, key, None)
        p[key] = given if given is not None else defaults.get(key)
    p["kv_heads"] = p["heads"] if args.kv_heads is None else args.kv_heads
    p["seq_k"] = p["seq"] if args.seq_k is None else args.seq_k
    p["causal"] = bool(args.causal)
    p["dtype"] = args.dtype
    precision = getattr(args, "precision", "default")
    p["precision"] = None if precision in (None, "default") else precision
    return p


def setup(args, say, algorithms=ALGORITHMS):
    """The problem of ``args`` (shapes, dtype, precision): inputs, the float64 reference, FLOPs
    (a dict read by :func:`measure`), and notes for the table."""
    from numba_flash import reference
    from numba_flash.simulator import format_seconds

    p = _problem(args)
    B, H, Hkv, Nq, Nk, D = p["batch"], p["heads"], p["kv_heads"], p["seq"], p["seq_k"], p["head_dim"]
    rng = np.random.default_rng(args.seed)
    mode = regime(p["precision"], p["dtype"])  # ValueError for a combination that does not exist
    host = [
        rng.standard_normal(shape).astype(np.float32).astype(_numpy_dtype(p["dtype"]))
        for shape in ((B, H, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D))
    ]
    sim = simulated()
    notes = []
    if sim:
        notes.append(
            "No GPU: ran in Numba's CUDA simulator on a small problem (no timings or "
            "occupancy; errors and modelled traffic are real)."
        )
        q, k, v = host
        ref_o, _ = reference.attention(*(x.astype(np.float64) for x in host), causal=p["causal"])
    elif p["dtype"] == "bfloat16":  # CuPy has no bfloat16: torch tensors
        import cupy
        import torch

        from numba_flash.baselines import cupy_attention

        q, k, v = (torch.as_tensor(x.astype(np.float32), device="cuda").to(torch.bfloat16) for x in host)
        ref_o = torch.as_tensor(cupy_attention(*(cupy.asarray(x.astype(np.float64)) for x in host), causal=p["causal"]), device="cuda")
    else:
        import cupy

        from numba_flash.baselines import cupy_attention

        q, k, v = (cupy.asarray(x) for x in host)
        ref_o = cupy_attention(*(x.astype(cupy.float64) for x in (q, k, v)), causal=p["causal"])
    problem = dict(p=p, mode=mode, q=q, k=k, v=v, ref_o=ref_o, sim=sim,
                   flops=attention_flops(B, H, Nq, Nk, D, p["causal"]))
    if sim:
        shape = f"B{B} H{H}/{Hkv} Nq{Nq} Nk{Nk} D{D} {p['dtype']}{' causal' if p['causal'] else ''}"
        estimate = _simulated_seconds(q, k, v, p, algorithms)
        say(f"no GPU: running {shape} in Numba's CUDA simulator, about {format_seconds(estimate)} for "
            f"{len(algorithms)} kernels" + ("; smaller --seq/--head-dim/--batch/--heads run faster" if estimate >= 60 else ""))
    return problem, notes


def measure(problem, algorithm, repeats, variant=None) -> dict:
    """One row: ``algorithm``'s kernel (or the ablation ``variant``'s, CUDA cores) on the problem:
    error against float64, modelled traffic, shared memory and threads; on a GPU also the
    median time, TFLOP/s and the compiled kernel's registers and occupancy."""
    import warnings

    from numba_flash.api import choose_tiles, forward
    from numba_flash.simulator import SimulatorSlowWarning

    p, mode, q, k, v, ref_o = (problem[key] for key in ("p", "mode", "q", "k", "v", "ref_o"))
    B, H, Hkv, Nq, Nk, D = p["batch"], p["heads"], p["kv_heads"], p["seq"], p["seq_k"], p["head_dim"]
    bm, bn = choose_tiles(mode, algorithm, D, p["dtype"], p["causal"], p["block_m"], p["block_n"])  # as attention does
    spec = kernel_spec(algorithm, D, p["dtype"], bm, bn, p["causal"], mode, variant=variant)

    def run():
        return forward(q, k, v, causal=p["causal"], algorithm=algorithm, block_m=bm, block_n=bn,
                       precision=p["precision"], variant=variant, num_splits=1 if variant is not None else None)

    with warnings.catch_warnings():  # the estimate was said by setup
        warnings.simplefilter("ignore", SimulatorSlowWarning)
        o, _ = run()
    sim = problem["sim"]
    diff = o.double() - ref_o if p["dtype"] == "bfloat16" and not sim else o.astype(np.float64) - ref_o
    row = dict(
        algorithm=algorithm,
        regime="CUDA cores (FFMA)" if mode == "ieee" else f"tensor cores ({_MMA_NAME[mode]})",
        shape=f"B{B} H{H}/{Hkv} Nq{Nq} Nk{Nk} D{D}",
        dtype=p["dtype"],
        causal=p["causal"],
        block_m=bm,
        block_n=bn,
        max_abs_err=float(abs(diff).max()),
        rel_err=float(_norm(diff) / _norm(ref_o)),
        modelled_bytes=traffic_bytes(algorithm, B, H, Hkv, Nq, Nk, D, bm, bn, p["dtype"], p["causal"],
                                     tensor_cores=mode != "ieee", variant=variant),
        smem_bytes=spec.smem_bytes,  # the driver's figure replaces it on a GPU
        threads=spec.threads,
        blocks=spec.grid(B, H, Nq)[0],
        ms=None,
        tflops=None,
    )
    if not sim:
        from numba_flash.profiling.resources import compiled_resources

        ms = median_ms(run, repeats=repeats)
        row.update(ms=ms, tflops=tflops(problem["flops"], ms))
        res = compiled_resources(spec.kernel, spec.threads, spec.dynamic_smem)
        row.update(res.as_dict())
    return row


def compare(args, progress=None):
    """Run both algorithms on one problem; return (rows, notes) for :func:`format_table`.

    ``progress``: called with a line per stage (the CLI prints them to stderr as they come)."""
    import time

    say = progress or (lambda line: None)
    problem, notes = setup(args, say)
    rows = []
    for n, alg in enumerate(ALGORITHMS, 1):
        name = alg.upper().replace("FA", "FA-")
        started = time.perf_counter()
        say(f"[{n}/{len(ALGORITHMS)}] {name}: {'simulating' if problem['sim'] else 'compiling, checking against float64, timing'} ...")
        row = measure(problem, alg, args.repeats)
        for key in ("ms", "tflops"):  # compare's table shows timings only where there are some
            if row[key] is None:
                del row[key]
        rows.append(row)
        say(f"[{n}/{len(ALGORITHMS)}] {name}: done in {time.perf_counter() - started:.1f} s, relative error {row['rel_err']:.1e}")
    if not problem["sim"]:
        say("timing the peers (CuPy matmul-softmax-matmul, PyTorch SDPA backends) ...")
        q, k, v, p = problem["q"], problem["k"], problem["v"], problem["p"]
        notes.extend(_peers(q, k, v, p, problem["flops"], args.repeats))
        fa1, fa2 = rows
        notes.append(f"FA-2 / FA-1 speed: {fa1['ms'] / fa2['ms']:.2f}x")
    return rows, notes


def _simulated_seconds(q, k, v, p, algorithms=ALGORITHMS) -> float:
    """The simulator's cost model for these kernels on this problem (``api.simulated_seconds``)."""
    from numba_flash.api import _validate, simulated_seconds

    total = 0.0
    for alg in algorithms:
        call = _validate(q, k, v, p["causal"], None, alg, p["block_m"], p["block_n"], p["precision"])
        total += simulated_seconds(call)
    return total


_MMA_NAME = {"f16": "mma.sync f16", "bf16": "mma.sync bf16", "tf32": "mma.sync tf32", "tf32x3": "mma.sync 3xTF32"}


def _numpy_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def _norm(x) -> float:
    """Frobenius norm of a NumPy, CuPy or torch array, in float64."""
    if hasattr(x, "double"):  # torch
        return float(x.double().norm())
    xp = np if isinstance(x, np.ndarray) else __import__("cupy")
    return float(xp.linalg.norm(x.astype(np.float64).ravel()))


def _peers(q, k, v, p, flops, repeats) -> list[str]:
    """Time the CuPy baseline and torch SDPA backends on the same inputs."""
    from numba_flash.baselines import cupy_attention, torch_sdpa_backends

    peers = {} if p["dtype"] == "bfloat16" else {"cupy matmul-softmax-matmul": lambda: cupy_attention(q, k, v, causal=p["causal"])}
    for name, fn in torch_sdpa_backends(p["dtype"]).items():
        peers[name] = lambda fn=fn: fn(q, k, v, p["causal"])
    lines = []
    for name, fn in peers.items():
        try:
            ms = median_ms(fn, repeats=repeats)
        except Exception as exc:  # a backend may refuse a shape or dtype
            lines.append(f"peer {name}: not run ({type(exc).__name__}: {str(exc)[:80]})")
            continue
        lines.append(f"peer {name}: {ms:.3f} ms, {tflops(flops, ms):.1f} TFLOP/s")
    return lines


_FORMATS = [
    ("regime", "regime", "{}"),
    ("shape", "shape", "{}"),
    ("dtype", "dtype", "{}"),
    ("causal", "causal", "{}"),
    ("block_m x block_n", None, None),
    ("max |o - ref|", "max_abs_err", "{:.2e}"),
    ("relative error", "rel_err", "{:.2e}"),
    ("time (ms, median)", "ms", "{:.3f}"),
    ("TFLOP/s", "tflops", "{:.2f}"),
    ("registers / thread", "regs", "{}"),
    ("shared memory / block (B)", "smem_bytes", "{}"),
    ("local (spill) bytes / thread", "local_bytes", "{}"),
    ("resident blocks / SM", "blocks_per_sm", "{}"),
    ("theoretical occupancy", "occupancy", "{:.1%}"),
    ("modelled global traffic (MB)", "modelled_bytes", None),
]


def format_table(rows, notes) -> str:
    """One table, FA-1 and FA-2 side by side, then the notes (peers, ratio, world)."""
    header = ["", *(r["algorithm"].upper().replace("FA", "FA-") for r in rows)]
    lines = [header]
    for label, key, fmt in _FORMATS:
        if key is None and label.startswith("block"):
            cells = [f"{r['block_m']} x {r['block_n']}" for r in rows]
        elif key == "modelled_bytes":
            cells = [f"{r[key] / 1e6:.3f}" for r in rows]
        elif any(key in r for r in rows):
            cells = [fmt.format(r[key]) if key in r else "n/a" for r in rows]
        else:
            cells = ["n/a (simulator)" for _ in rows] if key in ("ms", "tflops", "regs", "occupancy") else None
            if cells is None:
                continue
        lines.append([label, *cells])
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    out = []
    for n, line in enumerate(lines):
        out.append("| " + " | ".join(str(c).ljust(w) for c, w in zip(line, widths)) + " |")
        if n == 0:
            out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out + [""] + notes)
