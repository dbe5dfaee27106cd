"""The FA-2 -> FA-3 ablation (``numba-flash ablate --fa3``): FlashAttention-3's design, one factor at a time.

FA-3's own ablation (Shah et al. 2024, Table 2: H100, D = 128, 16-bit, non-causal) removes its two
pipelining schemes from the full kernel: 661 TFLOP/s with both, 582 without the GEMM-softmax
pipelining (the intra-warpgroup overlap), 570 without warp specialization's ping-pong. Here every
point is the same ``kernels.fa3`` kernel with compile-time switches, beside FA-2 (``mma.sync`` and
``cp.async``, no warp specialization) on the same inputs:

========================================  ===============================================================
point                                     what differs
========================================  ===============================================================
fa2                                       Ampere's synchronous ``mma.sync``, ``cp.async`` loads, every warp both loads and computes
fa3, neither pipelining                   TMA producer warpgroup, ``wgmma`` consumers, setmaxnreg; products and softmax in turn
fa3, ping-pong only                       consumer warpgroups take turns issuing products (section 3.1)
fa3, overlap only                         S_j's softmax under P_{j-1} V_{j-1} inside a warpgroup (section 3.2)
fa3                                       both (the default at D = 128; 192-row tiles take no turns by default)
fa3 without setmaxnreg                    both, every warpgroup at the launch's 168 registers
fa3 storing O from every thread           both, O stored as pairs by each thread, not through shared memory and TMA
fa3 rescaling O at every tile             both, without FlashAttention-4's conditional rescaling (threshold 0)
========================================  ===============================================================

The last two are this kernel's additions beyond FA-3's own table (results 16g and 16f measured
them with ``scripts/fa3_bench.py``'s ``-notmastore`` and ``-rescale0``). Each row's ratio is to its
base: the row before it up to the full kernel ("overlap only" against "neither pipelining": each
adds one scheme to it), then the full kernel (each later row removes one factor from it).

Each row: time (CUDA events, calls queued back to back, median), TFLOP/s, the error against
float64 on a sample of heads, and the ratio to its base (above). Every point runs unsplit
(``num_splits=1``), so the TMA-store row differs from the full kernel wherever the output allows it.
In the simulator: the error
only (small problem).
"""

from __future__ import annotations

POINTS = [  # (name, fa3.forward's knobs; None: FA-2)
    ("fa2 (mma.sync, cp.async)", None),
    ("fa3, neither pipelining", dict(overlap=False, pingpong=False)),
    ("fa3, ping-pong only", dict(overlap=False, pingpong=True)),
    ("fa3, overlap only", dict(overlap=True, pingpong=False)),
    # the full kernel names its turns: the default at D = 128 (two consumer warpgroups), where
    # FA-3's Table 2 was measured; 192-row tiles take none by default (fa3.takes_turns)
    ("fa3 (ping-pong and overlap)", dict(pingpong=True)),
    ("fa3 without setmaxnreg", dict(pingpong=True, reallocate=False)),
    ("fa3 storing O from every thread", dict(pingpong=True, tma_store=False)),
    ("fa3 rescaling O at every tile", dict(pingpong=True, rescale_threshold=0.0)),
]

FULL = "fa3 (ping-pong and overlap)"  # the full kernel (the default at D = 128): each later row removes one factor
BASES = {"fa3, overlap only": "fa3, neither pipelining"}  # a base other than the row before (up to FULL)

PAPER_H100 = {  # FA-3 Table 2 (H100 SXM5, D = 128, non-causal, 16-bit): TFLOP/s
    "fa3 (ping-pong and overlap)": 661,
    "fa3, ping-pong only": 582,  # "no GEMM-softmax pipelining"
    "fa3, overlap only": 570,  # "no warp specialization" (its ping-pong)
}


def ablate_fa3(args, progress=None):
    """Measure every point of :data:`POINTS` on ``args``' problem; returns ``(rows, notes)``."""
    from numba_flash import fa3
    from numba_flash._world import simulated
    from numba_flash.api import forward
    from numba_flash.research.profiling.timing import attention_flops, median_ms, tflops

    say = progress or (lambda line: None)
    sim = simulated()
    dtype = args.dtype if args.dtype in ("float16", "bfloat16") else "float16"
    B = args.batch or (1 if sim else 4)
    H = args.heads or (1 if sim else 16)
    N = args.seq or (64 if sim else 4096)
    Nk = args.seq_k or N
    D = args.head_dim or (64 if sim else 128)
    Hkv = args.kv_heads or H
    q, k, v = _inputs(B, H, Hkv, N, Nk, D, dtype, args.seed, sim)
    ref = _reference(q, k, v, args.causal)
    flops = attention_flops(B, H, N, Nk, D, args.causal)
    rows, notes = [], []
    if sim:  # two consumer warpgroups: ping-pong has someone to hand over to
        tiles = dict(block_m=128, block_n=32)
    else:
        tiles = {key: value for key, value in (("block_m", args.block_m), ("block_n", args.block_n)) if value is not None}
    for n, (name, knobs) in enumerate(POINTS, 1):
        say(f"[{n}/{len(POINTS)}] {name} ...")
        if knobs is None:
            call = lambda: forward(q, k, v, causal=args.causal)  # noqa: E731
        else:
            call = lambda knobs=knobs: fa3.forward(q, k, v, causal=args.causal, num_splits=1, **tiles, **knobs)  # noqa: E731
        o, _ = call()
        err = _error(o, ref)
        ms = None if sim else median_ms(call, repeats=args.repeats)
        row = dict(point=name, dtype=dtype, batch=B, heads=H, seq=N, seq_k=Nk, head_dim=D, causal=bool(args.causal),
                   rel_err=err, ms=ms, tflops=None if ms is None else tflops(flops, ms),
                   paper_h100_tflops=PAPER_H100.get(name) if D == 128 and not args.causal else None)
        rows.append(row)
    base_ratios(rows)
    if sim:
        notes.append("No GPU: the points ran in Numba's CUDA simulator on a small problem (errors only).")
    notes.append(f"{B}x{H}x{N}x{D} {dtype}{' causal' if args.causal else ''}; FLOPs 4 B H Nq Nk D"
                 + (" / 2" if args.causal else ""))
    return rows, notes


def base_ratios(rows) -> None:
    """Set each timed row's ``vs_base``, its base's time over its own: the base is the row before it
    up to the full kernel (:data:`FULL`: the path adds one factor a row), then the full kernel (each
    later row removes one factor from it)."""
    at_full = next(i for i, row in enumerate(rows) if row["point"] == FULL)
    for i, row in enumerate(rows[1:], 1):
        named = BASES.get(row["point"])
        base = rows[at_full] if i > at_full else next((r for r in rows if r["point"] == named), rows[i - 1])
        if base["ms"] and row["ms"]:
            row["vs_base"] = base["ms"] / row["ms"]


def _inputs(B, H, Hkv, N, Nk, D, dtype, seed, sim):
    import numpy as np

    rng = np.random.default_rng(seed)
    shapes = ((B, H, N, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D))
    if sim:
        import ml_dtypes

        npt = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
        return tuple(rng.standard_normal(s).astype(npt) for s in shapes)
    import cupy

    if dtype == "bfloat16":
        import torch

        return tuple(torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in shapes)
    return tuple(cupy.asarray(rng.standard_normal(s).astype(np.float16)) for s in shapes)


def _host(x):
    import numpy as np

    if hasattr(x, "detach"):
        return x.detach().float().cpu().numpy()
    if hasattr(x, "get"):
        return x.get()
    return np.asarray(x)


def _reference(q, k, v, causal):
    """float64 attention of the first batch entry and head (a sample: the whole would be large)."""
    from numba_flash import reference

    sample = [_host(x)[:1, :1].astype("float64") for x in (q, k, v)]
    return reference.attention(*sample, causal=causal)[0]


def _error(o, ref) -> float:
    import numpy as np

    got = _host(o)[:1, :1].astype(np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def format_fa3_ablation(rows, notes) -> str:
    """The rows as a markdown table (with FA-3's H100 figures where the problem is theirs), notes below."""
    lines = ["| point | ms | TFLOP/s | vs its base | FA-3 paper, H100 | rel. error |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        ms = "" if row["ms"] is None else f"{row['ms']:.3f}"
        tf = "" if row["tflops"] is None else f"{row['tflops']:.0f}"
        vs = f"{row['vs_base']:.2f}x" if row.get("vs_base") else ""
        paper = "" if row["paper_h100_tflops"] is None else str(row["paper_h100_tflops"])
        lines.append(f"| {row['point']} | {ms} | {tf} | {vs} | {paper} | {row['rel_err']:.1e} |")
    lines.append(f"\n'vs its base': the base's time / this row's; the base is the row before, up to {FULL!r} "
                 f"({', '.join(f'{k!r}: {v!r}' for k, v in BASES.items())}), then {FULL!r}.")
    return "\n".join(lines + [""] + notes)
