"""``numba-flash warmup``: compile the common configurations ahead of time, into the persistent
compilation cache (``numba_flash.compile_cache``), so that a training or serving process finds
them there at its first call.

A configuration is a public call on small inputs: each kernel a call of that configuration
launches (whatever the sequence lengths: the tiles depend on the dtype, head dim, mask and
regime, not on N) is compiled once and stored; a later process loads it in ~0.15 s instead of
compiling it in 1-6 s. The cases, per dtype x head dim x mask (:func:`plan`):

- ``attention`` of each algorithm, unsplit and with ``num_splits=2`` (FA-2's float32 partials
  and the combine kernel: the split-KV path long key ranges take);
- with ``--backward``: ``attention_backward`` (FA-2 with atomics and deterministic; FA-1 when
  asked for), which also compiles D_i's row-dot kernel;
- with ``--decode``: ``decode`` of one new query per sequence against a ragged cache, unsplit
  and split (float16, bfloat16 only: the serving dtypes).

Needs a CUDA GPU and CuPy (bfloat16: PyTorch); in the simulator nothing is compiled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

SMALL = dict(batch=1, heads=2, seq=192)  # a few tiles in each direction


@dataclass(frozen=True)
class Case:
    """One warm-up call: what it runs and on which configuration."""

    call: str  # "attention", "attention_backward" or "decode"
    dtype: str
    head_dim: int
    causal: bool
    algorithm: str = "fa2"
    num_splits: int | None = 1
    deterministic: bool = False

    @property
    def label(self) -> str:
        what = [self.call, self.dtype, f"D{self.head_dim}", "causal" if self.causal else "full", self.algorithm]
        if self.call != "attention_backward" and self.num_splits != 1:
            what.append(f"splits={self.num_splits or 'auto'}")
        if self.deterministic:
            what.append("deterministic")
        return " ".join(what)


def plan(dtypes=("float16", "bfloat16", "float32"), head_dims=(64, 128), causal=(False, True),
         algorithms=("fa2",), backward=False, decode=False) -> list[Case]:
    """The warm-up cases of these configurations, in the order they run."""
    cases = []
    for dtype in dtypes:
        for d in head_dims:
            for c in causal:
                for algorithm in algorithms:
                    cases.append(Case("attention", dtype, d, c, algorithm))
                    if algorithm == "fa2":
                        cases.append(Case("attention", dtype, d, c, algorithm, num_splits=2))
                    if backward:
                        cases.append(Case("attention_backward", dtype, d, c, algorithm))
                        if algorithm == "fa2":
                            cases.append(Case("attention_backward", dtype, d, c, algorithm, deterministic=True))
                if decode and dtype != "float32":
                    cases.append(Case("decode", dtype, d, c, num_splits=1))
                    cases.append(Case("decode", dtype, d, c, num_splits=None))
    return cases


def needs_for(cases) -> list:
    """What running ``cases`` needs here (``numba_flash.needs`` phrases; ``None`` when met)."""
    from numba_flash import needs

    return [needs.gpu(), needs.module("cupy"),
            needs.module("torch") if any(c.dtype == "bfloat16" for c in cases) else None]


def _inputs(case: Case, rng):
    """Random q, k, v of ``case`` on the GPU (bfloat16 as torch tensors: CuPy has none)."""
    import cupy as cp

    b, h, n, d = SMALL["batch"], SMALL["heads"], SMALL["seq"], case.head_dim
    if case.call == "decode":
        b, n_q = 4, 1
        shapes = ((b, h, n_q, d), (b, 1, n, d), (b, 1, n, d))
    else:
        shapes = ((b, h, n, d), (b, h, n, d), (b, h, n, d))
    arrays = [cp.asarray(rng.standard_normal(s), dtype=cp.float32) for s in shapes]
    if case.dtype == "bfloat16":
        import torch

        return [torch.as_tensor(x, device="cuda").to(torch.bfloat16) for x in arrays]
    return [x.astype(case.dtype) for x in arrays]


def run_case(case: Case, rng) -> None:
    """One warm-up call (synchronised: its kernels compiled, stored and run)."""
    import cupy as cp

    import numba_flash

    q, k, v = _inputs(case, rng)
    if case.call == "decode":
        lengths = cp.asarray([SMALL["seq"], SMALL["seq"] // 3, 1, 0], dtype=cp.int32)
        if case.dtype == "bfloat16":
            import torch

            lengths = torch.as_tensor(lengths, device="cuda")
        numba_flash.decode(q, k, v, cache_seqlens=lengths, causal=case.causal, num_splits=case.num_splits)
    else:
        splits = {"num_splits": case.num_splits} if case.algorithm == "fa2" else {}  # (FA-1 does not split)
        o, lse = numba_flash.attention(q, k, v, causal=case.causal, algorithm=case.algorithm, return_lse=True, **splits)
        if case.call == "attention_backward":
            numba_flash.attention_backward(o, q, k, v, o, lse, causal=case.causal, algorithm=case.algorithm,
                                           deterministic=case.deterministic)
    cp.cuda.Device().synchronize()
    if case.dtype == "bfloat16":
        import torch

        torch.cuda.synchronize()


def warmup(cases, progress=None) -> list[dict]:
    """Run ``cases``; one row each: the case, seconds, compiled kernels new in the cache, and
    ``error`` (a case that fails is reported and the rest still run)."""
    import numpy as np

    from numba_flash import compile_cache

    say = progress or (lambda line: None)
    rng = np.random.default_rng(0)
    rows = []
    for n, case in enumerate(cases, 1):
        before = len(compile_cache.entries())
        started = time.perf_counter()
        row = dict(case=case.label)
        try:
            run_case(case, rng)
        except Exception as exc:  # noqa: BLE001 -- reported in its row, the rest still run
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        row["seconds"] = round(time.perf_counter() - started, 3)
        row["new_kernels"] = len(compile_cache.entries()) - before
        rows.append(row)
        outcome = row.get("error") or f"{row['new_kernels']} kernels stored"
        say(f"[{n}/{len(cases)}] {case.label}: {row['seconds']:.1f} s, {outcome}")
    return rows
