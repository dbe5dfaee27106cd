"""FlashAttention's own test grids, run against numba_flash: one GPU call re-checks them.

    python scripts/flash_attn_grid.py --dry-run            # the cases and counts, no GPU
    python scripts/flash_attn_grid.py --json grid.json     # every part on the GPU (torch tensors)
    python scripts/flash_attn_grid.py --part forward --algorithms fa2 --max-cases 50
    python scripts/flash_attn_grid.py --simulate --max-cases 2   # tiny shapes in the simulator

The grids are the parametrisations in Dao-AILab/flash-attention ``tests/test_flash_attn.py``
(commit ``FA_COMMIT``), written out as data below:

- ``forward``: ``test_flash_attn_output``'s output check (``OUTPUT_GRID``; batch 4, 6 heads,
  K/V heads 6 / 1 / 2 for mha / mqa / gqa);
- ``backward``: the same test's dq, dk, dv check, on the same grid;
- ``varlen``: ``test_flash_attn_varlen_output`` (``VARLEN_GRID``; batch 4, 6 heads (4 with
  softcap), K/V heads 6 / 1 / 2; each sequence's lengths drawn in ``[max(1, N - 20), N]`` as
  FlashAttention's ``generate_random_padding_mask``), run by ``attention_varlen`` and
  ``attention_backward_varlen`` on the packed rows: o (2x) and dq, dk, dv (3x) in one case;
- ``kvcache``: ``test_flash_attn_kvcache`` (``KVCACHE_GRID``; batch 2, 6 heads, K/V heads
  6 / 1 / 3, ``cache_seqlens`` drawn in ``[1, seqlen_k]`` as there, causal aligned to each length),
  run by ``numba_flash.decode`` (FlashAttention's ``num_splits=0``, its heuristic, is our ``None``).

What numba_flash's contract does not cover yet is dropped, each value with its reason
(``EXCLUDED``), after FlashAttention's own skips (``FA_SKIPS``); axes that change nothing once
those are gone (``COLLAPSED``) are run once. ``--dry-run`` prints every count. Inputs are made in
FlashAttention's layout ``(B, N, H, D)`` and passed as transposed views; ``kvpacked`` packs the
same K and V values into one ``(B, N, 2, Hkv, D)`` buffer, so one input set serves both layouts.
numba_flash's own axis: ``--algorithms`` (forward: FA-2 and FA-1, and FA-3 on Hopper with
``--algorithms fa3``, its 16-bit cases; backward: FA-2 with FA's
``deterministic`` flag, and FA-1, deterministic by construction).

The rule is FlashAttention's: the largest error of our result against a float64 reference is at
most ``MULT`` times that of a plain implementation in the input dtype (o: 2x; dq, dk, dv: 3x as
``test_flash_attn_output`` asserts them; kvcache: 3x + 1e-5). Reference and plain are the same
materialised computation (:func:`materialised`, FA's ``attention_ref`` with ``upcast`` on or off):
in float64, or with S, P, O (dP, dS and the gradients) rounded to the input dtype and products
accumulated in float32, as ``tests/helpers.py``'s ``plain_fp16_attention``. ``varlen``'s gradients
also get FlashAttention-3's varlen floor (:func:`gradient_atols`), for rows whose float64 gradient
is exactly 0. float32 inputs
(``--dtypes float32``, not in FA's grids) are held to the GPU tests' tolerances (``FLOAT32_TOL``:
relative norm of o, largest gradient error over the largest reference gradient).

On a GPU (needs CuPy and torch, for bfloat16) ``--jobs`` processes share the GPU, each taking all
cases of one (part, dtype, head dim, causal), so that each kernel configuration compiles in one
process; each reports every case as it finishes. Progress goes to stderr, one line a case, a
summary to stdout; exit status 1 when a case fails. A run stopped by SIGTERM (``timeout``) still
prints the summary of the cases it reached and writes them to ``--json`` (``"finished": false``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import signal
import sys
import time
import zlib
from dataclasses import dataclass, field

FA_REPO, FA_FILE = "Dao-AILab/flash-attention", "tests/test_flash_attn.py"
FA_COMMIT = "0251105a2fb19d2957484b7f023cd8c115286ced"

# ------------------------------------------------------------------------------ the grids
OUTPUT_GRID = dict(  # test_flash_attn_output's @pytest.mark.parametrize, in the file's order
    kvpacked=[True, False], dtype=["float16", "bfloat16"], mha_type=["mha", "mqa", "gqa"],
    deterministic=[False, True], alibi=[False, True], local=[False, True], causal=[False, True],
    d=[32, 40, 59, 64, 96, 111, 128, 160, 192, 224, 256],
    seqlens=[(113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256), (1024, 1024),
             (1023, 1024), (1024, 1023), (2048, 2048)],
    dropout_p=[0.0, 0.17], softcap=[0.0, 50.0])
KVCACHE_GRID = dict(  # test_flash_attn_kvcache's
    dtype=["float16"], num_splits=[1, 0], mha_type=["mha", "mqa", "gqa"], new_kv=[False, True],
    alibi=[False, True], local=[False, True], causal=[False, True], seqlen_new_eq_seqlen_q=[True, False],
    rotary_interleaved=[False, True], rotary_fraction=[0.0, 0.5, 1.0],
    paged_kv_block_size=[None, 256, 16, 64],  # FA's [None, 256], and issue 25's page sizes 16 and 64
    has_leftpad=[False, True], has_batch_idx=[False], d=[32, 59, 64, 80, 128, 256],
    seqlens=[(1, 128), (1, 339), (3, 1024), (64, 800), (64, 256), (3, 799), (64, 2048), (16, 20000),
             (1, 128 * 1024), (16, 128 * 1024), (128, 128)])
VARLEN_GRID = dict(OUTPUT_GRID, d=[32, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256],  # test_flash_attn_varlen_output's
                   seqlens=[(1, 147)] + OUTPUT_GRID["seqlens"])
MODS = ("local", "softcap", "alibi")  # the grids' axes of issue 24's score and mask modifications
GRIDS = {"forward": OUTPUT_GRID, "backward": OUTPUT_GRID, "varlen": VARLEN_GRID, "kvcache": KVCACHE_GRID}
FA_SKIPS = {  # the pytest.skip()s at the top of each test (the <= 16 GiB GPU one aside)
    "forward": lambda p: p["softcap"] > 0 and p["dropout_p"] > 0,
    "backward": lambda p: p["softcap"] > 0 and p["dropout_p"] > 0,
    "varlen": lambda p: p["softcap"] > 0 and p["dropout_p"] > 0,
    "kvcache": lambda p: (p["seqlens"][0] > p["seqlens"][1] and p["new_kv"]) or (not p["new_kv"] and p["rotary_fraction"] > 0)
    or (p["has_batch_idx"] and p["paged_kv_block_size"] is not None) or (p["has_leftpad"] and p["paged_kv_block_size"] is not None),
}
_OUTPUT_EXCLUDED = [  # (axis, values, why); a case counts under the first that drops it (head dims: all, since issue 25)
    ("dropout_p", (0.17,), "dropout (not in numba_flash)")]
EXCLUDED = {"forward": _OUTPUT_EXCLUDED, "backward": _OUTPUT_EXCLUDED, "varlen": _OUTPUT_EXCLUDED, "kvcache": [
    ("has_leftpad", (True,), "cache_leftpad (not in numba_flash)"),
    ("rotary_fraction", (0.5, 1.0), "rotary embedding (not in numba_flash)")]}
COLLAPSED = {  # axis -> (why it changes nothing in what is left, when: None or a test of the case): run at its first value
    "forward": {"deterministic": ("the flag is the backward's (numba_flash's forward is deterministic)", None)},
    "backward": {},
    "varlen": {},
    "kvcache": {"seqlen_new_eq_seqlen_q": ("no effect without new_kv", lambda p: not p["new_kv"]),
                "rotary_interleaved": ("no effect without rotary", None)}}
SHAPES = {"forward": (4, 6, {"mha": 6, "mqa": 1, "gqa": 2}), "kvcache": (2, 6, {"mha": 6, "mqa": 1, "gqa": 3})}
SHAPES["backward"] = SHAPES["varlen"] = SHAPES["forward"]  # (varlen with softcap: 4 heads, dims())
SIM_SHAPES = {"forward": (1, 4, {"mha": 4, "mqa": 1, "gqa": 2}), "kvcache": (2, 4, {"mha": 4, "mqa": 1, "gqa": 2})}
SIM_SHAPES["backward"] = SIM_SHAPES["forward"]
SIM_SHAPES["varlen"] = (2, 4, {"mha": 4, "mqa": 1, "gqa": 2})
SIM_CASES, SIM_STRIDE, SIM_MAX_LEN = 6, 2039, 24  # --simulate: cases i * SIM_STRIDE (mod the part's count), i = 1..6 (varied)

# ------------------------------------------------------------------------------ the rule
MULT = {"forward": 2.0, "backward": 3.0, "kvcache": 3.0}  # FA: out <= 2x; dq, dk, dv <= 3x; kvcache 3x
ATOL = {"forward": 0.0, "backward": 0.0, "varlen": 0.0, "kvcache": 1e-5}  # kvcache: "+ 1e-5" in FA's assert
FLOAT32_TOL = {"forward": 1e-5, "backward": 1e-4, "kvcache": 1e-5}  # tests/gpu: test_gpu.py, test_gpu_backward.py


def multiplier(part: str, tensor: str) -> float:
    """FA's factor over a plain implementation's error: o 2x, gradients 3x (varlen: both in one case)."""
    return MULT["forward" if tensor == "o" else "backward"] if part == "varlen" else MULT[part]


def float32_tolerance(part: str, tensor: str) -> float:
    return FLOAT32_TOL["forward" if tensor == "o" else "backward"] if part == "varlen" else FLOAT32_TOL[part]
# Estimates for the plan (not measured): per call, per reference FLOP, per kernel configuration.
SECONDS_PER_CALL, REF_FLOPS_PER_S, COMPILE_S = 0.02, 2e12, 7.0  # README: a configuration compiles in 1-9 s
SIM_SECONDS_PER_CALL = 1.0  # the simulator, at SIM_SHAPES


@dataclass(frozen=True)
class Case:
    part: str
    params: tuple  # ((axis, value), ...) of FlashAttention's grid
    variant: str  # forward: fa2 | fa1; backward: fa2 | fa2-det | fa1; kvcache: splits=1 | splits=auto
    p: dict = field(default=None, compare=False, hash=False)

    @property
    def name(self) -> str:
        p = self.p
        extra = ("kvpacked" if p["kvpacked"] else "kv") if "kvpacked" in p else ""
        mods = (("local " if p.get("local") else "") + (f"softcap={p['softcap']:g} " if p.get("softcap") else "")
                + ("alibi " if p.get("alibi") else ""))
        if self.part == "kvcache":
            extra = (("new " + ("new=q " if p["seqlen_new_eq_seqlen_q"] else "")) if p["new_kv"] else "") + (
                f"paged={p['paged_kv_block_size']}" if p["paged_kv_block_size"] else "")
        return (f"{self.part} {p['dtype']} {p['mha_type']} {'causal' if p['causal'] else 'full'} {mods}d={p['d']} "
                f"{p['seqlens'][0]}x{p['seqlens'][1]} {extra} {self.variant}").replace("  ", " ")

    @property
    def inputs(self) -> tuple:  # what the inputs (and so the references) depend on
        return (self.part,) + tuple(self.p.get(a) for a in ("dtype", "mha_type", "causal", "d", "seqlens", "local", "softcap",
                                                            "alibi", "new_kv", "seqlen_new_eq_seqlen_q"))


def grid(part: str, dtypes=None, algorithms=("fa2", "fa1")):
    """(cases, counts): the cases run (FA's kept cases times our variants) and how FA's grid was cut."""
    axes = dict(GRIDS[part], **({"dtype": list(dtypes)} if dtypes else {}))
    dup = "same case as another (" + "; ".join(f"{a}: {r}" for a, (r, _) in COLLAPSED[part].items()) + ")"
    counts = dict.fromkeys(["total", "skipped by FlashAttention"] + [f"{a}={x}: {r}" for a, vals, r in EXCLUDED[part]
                                                                    for x in vals if x in axes[a]], 0)
    counts[dup], kept = 0, {}
    for values in itertools.product(*axes.values()):
        p = dict(zip(axes, values))
        counts["total"] += 1
        if FA_SKIPS[part](p):
            counts["skipped by FlashAttention"] += 1
            continue
        why = next((f"{a}={p[a]}: {r}" for a, vals, r in EXCLUDED[part] if p[a] in vals), None)
        if why is None:
            for a, (_, when) in COLLAPSED[part].items():
                if when is None or when(p):
                    p[a] = axes[a][0]
            why = dup if tuple(p.items()) in kept else None
        if why is None:
            kept[tuple(p.items())] = p
        else:
            counts[why] += 1
    if not COLLAPSED[part]:
        del counts[dup]
    counts["FlashAttention cases kept"] = len(kept)
    cases = [Case(part, key, v, p) for key, p in kept.items() for v in variants(part, p, algorithms)]
    counts["runs (with our variants)"] = len(cases)
    return cases, counts


def variants(part, p, algorithms):
    if part == "kvcache":
        return ["splits=1" if p["num_splits"] == 1 else "splits=auto"]
    if part == "forward":  # fa3 (issue 23): the 16-bit cases (softcap and ALiBi included since results 16c)
        return [a for a in algorithms if a != "fa3" or p["dtype"] != "float32"]
    return (["fa2-det" if p["deterministic"] else "fa2"] if "fa2" in algorithms else []) + \
        (["fa1"] if "fa1" in algorithms and not p["deterministic"] else [])


def dims(case: Case, simulate: bool):
    """(batch, heads, kv_heads, Nq, Nk, D): FA's shapes, or scaled down for the simulator."""
    batch, heads, kv = (SIM_SHAPES if simulate else SHAPES)[case.part]
    if case.part == "varlen" and case.p["softcap"] and not simulate:  # FA: "softcap reference impl takes more memory"
        heads, kv = 4, dict(kv, mha=4)
    (nq, nk), d = case.p["seqlens"], case.p["d"]
    if simulate:
        nq, nk, d = min(math.ceil(nq / 64), SIM_MAX_LEN), min(math.ceil(nk / 64), SIM_MAX_LEN), math.ceil(d / 4)
    return batch, heads, kv[case.p["mha_type"]], nq, nk, d


def reference_seconds(c: Case, simulate=False) -> float:
    """The float64 reference and the plain implementation of ``c``'s input set (an estimate)."""
    b, h, _, nq, nk, d = dims(c, simulate)
    return 2 * (3.5 if c.part in ("backward", "varlen") else 1) * 4 * b * h * nq * nk * d / REF_FLOPS_PER_S


def estimate(cases, simulate=False, jobs=1):
    """(seconds, kernel configurations): calls, references and cold compiles, spread over ``jobs``."""
    configs = {(c.part, c.variant, c.p["dtype"], c.p["d"], c.p["causal"]) for c in cases}
    configs |= {("forward", "fa2", c.p["dtype"], c.p["d"], c.p["causal"]) for c in cases if c.part == "backward"}
    configs |= {("varlen-forward", c.variant[:3], c.p["dtype"], c.p["d"], c.p["causal"]) for c in cases if c.part == "varlen"}
    sets = {c.inputs: reference_seconds(c, simulate) for c in cases}
    per_call, compile_s = (SIM_SECONDS_PER_CALL, 0.0) if simulate else (SECONDS_PER_CALL, COMPILE_S)
    return (len(cases) * per_call + sum(sets.values()) + len(configs) * compile_s) / jobs, len(configs)


# ------------------------------------------------------------------------------ arrays
class Arrays:
    """The few array operations the references need, on torch (a GPU) or NumPy (the simulator)."""

    def __init__(self, simulate: bool):
        import numpy as np

        self.np, self.sim = np, simulate
        if simulate:
            self.xp, self.dt = np, {n: np.dtype(n) for n in ("float16", "float32", "float64", "int32")}
            try:
                import ml_dtypes

                self.dt["bfloat16"] = ml_dtypes.bfloat16
            except ImportError:
                pass
        else:
            import torch

            self.xp, self.dt = torch, {n: getattr(torch, n) for n in ("float16", "bfloat16", "float32", "float64", "int32")}

    def cast(self, x, dt):
        return x.astype(self.dt[dt]) if self.sim else x.to(self.dt[dt])

    def randn(self, shape, dt, seed):
        if self.sim:
            return self.np.random.default_rng(seed).standard_normal(shape, dtype=self.np.float32).astype(self.dt[dt])
        gen = self.xp.Generator(device="cuda").manual_seed(seed)
        return self.xp.randn(shape, generator=gen, device="cuda").to(self.dt[dt])

    def asarray(self, a):  # a NumPy array onto the device
        return a if self.sim else self.xp.as_tensor(a, device="cuda")

    def bhnd(self, x):  # FlashAttention's (B, N, H, D) -> numba_flash's (B, H, N, D), a view
        return x.transpose(0, 2, 1, 3) if self.sim else x.permute(0, 2, 1, 3)

    def stack(self, xs, axis):
        return self.xp.stack(xs, axis)

    def rowmax(self, x):
        return x.max(axis=-1, keepdims=True) if self.sim else x.amax(dim=-1, keepdim=True)

    def rowsum(self, x):
        return x.sum(axis=-1, keepdims=True) if self.sim else x.sum(dim=-1, keepdim=True)

    def repeat(self, x, g):  # K/V heads -> query heads
        return self.np.repeat(x, g, axis=1) if self.sim else x.repeat_interleave(g, dim=1)

    def fold(self, x, g):  # query heads -> their K/V head (the sum GQA's gradients take)
        b, h, n, d = x.shape
        return x.reshape(b, h // g, g, n, d).sum(2)

    def maxabs(self, a, ref):
        return float(abs(self.cast(a, "float64") - ref).max())

    def rel(self, a, ref, norm):  # float32's measures: relative 2-norm (o) or max over max (gradients)
        diff = self.cast(a, "float64") - ref
        if norm:
            return float((diff * diff).sum()) ** 0.5 / max(float((ref * ref).sum()) ** 0.5, 1e-300)
        return float(abs(diff).max()) / max(float(abs(ref).max()), 1e-300)


def visible_varlen(A: Arrays, nq, nk, causal, lengths_q, lengths_k, window=(-1, -1)):
    """(B, 1, Nq, Nk) bool for padded sequences: query i < lengths_q[b] sees key j < lengths_k[b]
    under the mask, bottom-right aligned to each sequence's lengths (FA's varlen semantics)."""
    from numba_flash.masking import window_spec

    np = A.np
    lq, lk = (np.asarray(x).reshape(-1, 1, 1, 1) for x in (lengths_q, lengths_k))
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    return A.asarray((i < lq) & (j < lk) & window_spec(causal, window).visible(i + (nq - lq), j + (nq - lk), nq, nq))


def pack_rows(A: Arrays, x, lengths):
    """(B, N, H, D) padded -> (total, H, D): each sequence's first lengths[b] rows, one after the other."""
    parts = [x[b, : int(n)] for b, n in enumerate(lengths)]
    return A.np.concatenate(parts) if A.sim else A.xp.cat(parts)


def unpack_rows(A: Arrays, x, lengths, n):
    """The inverse of :func:`pack_rows`, zeros in the padding: (B, n, H, D)."""
    out = A.np.zeros((len(lengths), n) + tuple(x.shape[1:]), x.dtype) if A.sim else \
        A.xp.zeros((len(lengths), n) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    at = 0
    for b, m in enumerate(lengths):
        out[b, : int(m)] = x[at : at + int(m)]
        at += int(m)
    return out


def visible_keys(A: Arrays, batch, nq, nk, causal, lengths=None, window=(-1, -1)):
    """(B, 1, Nq, Nk) bool: key j valid (j < cache_seqlens[b]) and seen by query i under the mask of
    ``causal`` and ``window`` (``masking.window_spec``; bottom-right aligned to each length)."""
    from numba_flash.masking import window_spec

    np = A.np
    n = np.full((batch, 1, 1, 1), nk) if lengths is None else np.asarray(lengths).reshape(batch, 1, 1, 1)
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    return A.asarray((j < n) & window_spec(causal, window).visible(i, j + (nq - n), nq, nq))


def fa_window(p, nk, seed):
    """FlashAttention's window for a ``local`` case: ``torch.randint(0, seqlen_k, (2,))`` (drawn
    here from the case's seed); ``(-1, -1)`` otherwise."""
    if not p.get("local"):
        return (-1, -1)
    import numpy as np

    return tuple(int(x) for x in np.random.default_rng(seed + 7).integers(0, nk, 2))


def alibi_bias(A: Arrays, slopes, nq, nk, lengths=None, lengths_q=None):
    """FlashAttention's ``attn_bias_from_alibi`` without causal's shortcut (which differs by a
    constant per row): ``-slope |i + n - m - j|``, ``n`` each sequence's key count, ``m`` its query
    count (``Nq`` unless ``lengths_q``), (B, H, Nq, Nk) float64 on the arrays' device."""
    np = A.np
    n = np.full((len(slopes), 1, 1, 1), nk) if lengths is None else np.asarray(lengths).reshape(-1, 1, 1, 1)
    m = nq if lengths_q is None else np.asarray(lengths_q).reshape(-1, 1, 1, 1)
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    return A.asarray(-np.asarray(slopes, np.float64)[:, :, None, None] * np.abs(i + n - m - j))


def materialised(A: Arrays, q, k, v, visible, dt, do=None, softcap=0.0, bias=None):
    """o (and with ``do`` also dq, dk, dv) with S and P materialised: every matrix rounded to ``dt``, products
    accumulated in float32 -- or all in float64 when ``dt`` is float64 (the reference). Inputs (B, H, N, D).
    ``softcap``: S -> softcap tanh(S / softcap) (rounded as FA's ``attention_ref`` does), and dS through
    its slope; ``bias`` (ALiBi's, :func:`alibi_bias`): added to S after the cap, as FA's reference does."""
    acc = "float64" if dt == "float64" else "float32"

    def r(x):  # round to dt, carry on in acc
        return x if dt == acc else A.cast(A.cast(x, dt), acc)

    g, scale = q.shape[1] // k.shape[1], 1 / math.sqrt(q.shape[-1])
    q, k, v = A.cast(q, acc), A.cast(A.repeat(k, g), acc), A.cast(A.repeat(v, g), acc)
    s = r((q @ k.swapaxes(-1, -2)) * scale)
    if softcap:
        t = r(A.xp.tanh(r(s / softcap)))
        s = r(t * softcap)
    if bias is not None:
        s = r(s + A.cast(bias, acc))
    s = A.xp.where(visible, s, -math.inf)
    m = A.rowmax(s)
    p = r(A.xp.exp(s - A.xp.where(A.xp.isfinite(m), m, 0.0)))
    l = A.rowsum(p)
    p = r(p / r(A.xp.where(l > 0, l, 1.0)))  # rows that see no key: p = 0, o = 0
    o = r(p @ v)
    if do is None:
        return {"o": o}
    do = A.cast(do, acc)
    dv = r(A.fold(r(p.swapaxes(-1, -2) @ do), g))
    dp = r(do @ v.swapaxes(-1, -2))
    ds = r(p * (dp - A.rowsum(dp * p)))  # softmax's backward
    if softcap:
        ds = r(ds * (1 - t * t))  # the cap's
    ds = r(ds * scale)  # and the scale's
    return {"o": o, "dq": r(ds @ k), "dk": r(A.fold(r(ds.swapaxes(-1, -2) @ q), g)), "dv": dv}


def judge(part, dtype, errors, plains, atols=None):
    """(allowed, ratio, passed): FA's rule per tensor (err <= MULT x plain + ATOL (+ ``atols[n]``);
    float32: a tolerance); ratio = the largest err / allowed (> 1 fails; NaN fails)."""
    atols = atols or {}
    allowed = {n: float32_tolerance(part, n) if dtype == "float32"
               else multiplier(part, n) * plains[n] + ATOL[part] + atols.get(n, 0.0) for n in errors}
    passed = all(errors[n] <= allowed[n] for n in errors)
    ratios = [errors[n] / allowed[n] if allowed[n] > 0 else (0.0 if errors[n] == 0 else math.inf) for n in errors]
    return allowed, (math.inf if any(map(math.isnan, ratios)) else max(ratios)), passed


# ------------------------------------------------------------------------------ running
def run_cases(cases, simulate, report=None):
    """Rows for ``cases`` (one (part, dtype, d, causal) chunk, or any list), input set by input set."""
    import numba_flash

    A, rows = Arrays(simulate), []
    for key in dict.fromkeys(c.inputs for c in cases):
        group = [c for c in cases if c.inputs == key]
        c0, t0 = group[0], time.perf_counter()
        batch, heads, kvh, nq, nk, d = dims(c0, simulate)
        part, dt, causal, seed = c0.part, c0.p["dtype"], c0.p["causal"], zlib.crc32(repr(key).encode())
        q = A.randn((batch, nq, heads, d), dt, seed)
        cap = c0.p.get("softcap") or 0.0
        if cap:  # FA's test: "Ensure the values of qk are at least within softcap range"
            q = A.cast(A.cast(q, "float32") * cap, dt)
        window = fa_window(c0.p, nk, seed)
        mods = {"window_size": window, "softcap": cap}
        slopes = None
        if c0.p.get("alibi"):  # FA's test: torch.rand(batch, nheads) * 0.3
            slopes = (A.np.random.default_rng(seed + 5).random((batch, heads)) * 0.3).astype(A.np.float32)
            mods["alibi_slopes"] = A.asarray(slopes)
        k, v = A.randn((batch, nk, kvh, d), dt, seed + 1), A.randn((batch, nk, kvh, d), dt, seed + 2)
        kv = A.stack([k, v], 2)  # kvpacked: the same values in one (B, N, 2, Hkv, D) buffer
        layouts = {False: (A.bhnd(k), A.bhnd(v)), True: (A.bhnd(kv[:, :, 0]), A.bhnd(kv[:, :, 1]))}
        lens = lens_q = None
        n_new = 0
        if part == "kvcache":  # FA's test: seqlen_new = seqlen_q or randint(1, seqlen_q + 1); the cache's
            draw = A.np.random.default_rng(seed)  # lengths leave room for the new keys (0 allowed with them)
            if c0.p["new_kv"]:
                n_new = nq if c0.p["seqlen_new_eq_seqlen_q"] else int(draw.integers(1, nq + 1))
            cached = draw.integers(0 if n_new else 1, nk - n_new + 1, batch).astype(A.np.int32)
            lens = cached + n_new  # the keys attended: the cached ones, then the new ones
        if part == "varlen":  # FA's generate_random_padding_mask(mode="random"): [max(1, N - 20), N]
            draw = A.np.random.default_rng(seed + 9)
            lens_q, lens = (draw.integers(max(1, n - 20), n + 1, batch) for n in (nq, nk))
            visible = visible_varlen(A, nq, nk, causal, lens_q, lens, window)
        else:
            visible = visible_keys(A, batch, nq, nk, causal, lens, window)
        bias = None if slopes is None else alibi_bias(A, slopes, nq, nk, lens, lens_q)
        do = A.randn((batch, nq, heads, d), dt, seed + 3) if part in ("backward", "varlen") else None
        args = (A.bhnd(q), *layouts[False], visible)
        ref = materialised(A, *args, "float64", None if do is None else A.bhnd(do), cap, bias)
        plain = None if dt == "float32" else materialised(A, *args, dt, None if do is None else A.bhnd(do), cap, bias)
        shared = (time.perf_counter() - t0) / len(group)
        fwd = {}
        for c in group:
            t1, row = time.perf_counter(), case_row(c)
            try:
                kk, vv = layouts[c.p.get("kvpacked", False)]
                if part == "forward":
                    got = {"o": numba_flash.attention(A.bhnd(q), kk, vv, causal=causal, algorithm=c.variant, **mods)}
                elif part == "varlen":
                    got = run_varlen(A, c, q, kk, vv, do, lens_q, lens, causal, mods)
                elif part == "kvcache":
                    caches = kv_cache(A, kk, vv, cached, n_new, c.p["paged_kv_block_size"], seed)
                    got = {"o": numba_flash.decode(A.bhnd(q), cache_seqlens=A.asarray(cached), causal=causal,
                                                   num_splits=1 if c.variant == "splits=1" else None, **caches, **mods)}
                else:
                    layout = c.p["kvpacked"]
                    if layout not in fwd:
                        fwd[layout] = numba_flash.attention(A.bhnd(q), kk, vv, causal=causal, return_lse=True, **mods)
                    grads = numba_flash.attention_backward(A.bhnd(do), A.bhnd(q), kk, vv, *fwd[layout], causal=causal,
                                                           algorithm=c.variant[:3], deterministic=c.variant == "fa2-det",
                                                           **mods)
                    got = dict(zip(("dq", "dk", "dv"), grads))
                if dt == "float32":
                    errors = {n: A.rel(x, ref[n], norm=part != "backward") for n, x in got.items()}
                    plains = {n: None for n in got}
                else:
                    errors = {n: A.maxabs(x, ref[n]) for n, x in got.items()}
                    plains = {n: A.maxabs(plain[n], ref[n]) for n in got}
                atols = gradient_atols(A, ref, dt) if part == "varlen" and dt != "float32" else None
                allowed, ratio, passed = judge(part, dt, errors, plains, atols)
                row.update(errors=errors, plain=plains, allowed=allowed, ratio=ratio, passed=passed, error=None)
            except Exception as exc:  # a case that raises fails; the others still run
                row.update(errors=None, plain=None, allowed=None, ratio=math.inf, passed=False,
                           error=f"{type(exc).__name__}: {exc}"[:300])
            row["seconds"] = time.perf_counter() - t1 + shared
            rows.append(row)
            if report:
                report(row)
    return rows


def kv_cache(A: Arrays, k, v, cached, n_new: int, page_size, seed: int) -> dict:
    """``decode``'s cache arguments holding the keys ``k``, ``v`` (B, Hkv, N, D) as FA's kvcache
    test builds them: sequence ``b``'s first ``cached[b]`` keys in the cache and, with ``n_new``,
    its next ``n_new`` keys as ``k_new`` / ``v_new`` (their rows in the cache NaN until the call
    writes them); with ``page_size``, the cache in pages of a random order through a block table
    (FA: ``torch.randperm(num_blocks)``), every spare page and row NaN."""
    np = A.np
    batch, kvh, nk, d = (int(x) for x in k.shape)
    out = {}
    if n_new:
        take = [slice(int(n), int(n) + n_new) for n in cached]
        out["k_new"], out["v_new"] = (A.stack([x[b, :, t] for b, t in enumerate(take)], 0) for x in (k, v))
        k, v = (x.copy() if A.sim else x.clone() for x in (k, v))
        for b, t in enumerate(take):
            k[b, :, t] = math.nan
            v[b, :, t] = math.nan
    if not page_size:
        out["k_cache"], out["v_cache"] = k, v
        return out
    per_seq = -(-nk // page_size)
    num_blocks = batch * per_seq + 3
    order = np.random.default_rng(seed + 11).permutation(num_blocks)[: batch * per_seq]
    table = order.reshape(batch, per_seq).astype(np.int32)
    for name, x in (("k_cache", k), ("v_cache", v)):
        pad = per_seq * page_size - nk
        rows = x.swapaxes(1, 2) if A.sim else x.transpose(1, 2)  # (B, N, Hkv, D)
        if A.sim:
            pages = np.full((num_blocks, page_size, kvh, d), np.nan, x.dtype)
            rows = np.concatenate([rows, np.full((batch, pad, kvh, d), np.nan, x.dtype)], 1) if pad else rows
        else:
            pages = A.xp.full((num_blocks, page_size, kvh, d), math.nan, dtype=x.dtype, device=x.device)
            rows = A.xp.cat([rows, A.xp.full((batch, pad, kvh, d), math.nan, dtype=x.dtype, device=x.device)], 1) \
                if pad else rows
        pages[A.asarray(order.astype(np.int64))] = rows.reshape(batch * per_seq, page_size, kvh, d)
        out[name] = pages
    out["block_table"] = A.asarray(table)
    return out


def gradient_atols(A: Arrays, ref: dict, dt: str) -> dict:
    """FlashAttention-3's varlen test's floor on each gradient's error, ``2 |(ref + 0.3 - 0.3) -
    ref|`` in the input dtype: a gradient that is 0 in float64 (a row that sees one key: its
    softmax is constant) comes back as rounding noise (dP - D summed in other orders), which no
    multiple of the plain implementation's exact 0 can hold."""
    out = {}
    for n in ("dq", "dk", "dv"):
        x = A.cast(ref[n], dt)  # (each step rounded to dt, as torch does half + 0.3 - 0.3)
        up = A.cast(A.cast(x, "float32") + 0.3, dt)
        back = A.cast(A.cast(up, "float32") - 0.3, dt)
        out[n] = 2 * A.maxabs(back, A.cast(x, "float64"))
    return out


def run_varlen(A: Arrays, c: Case, q, k, v, do, lens_q, lens_k, causal, mods) -> dict:
    """``attention_varlen`` and ``attention_backward_varlen`` on the packed rows of padded (B, N, H, D)
    inputs (``k``, ``v`` as numba_flash's (B, H, N, D) views), the results padded back to numba_flash's
    layout: o, dq, dk, dv (zeros in the padding, as the reference has there)."""
    import numba_flash

    np = A.np
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    packed = [pack_rows(A, x, n) for x, n in ((q, lens_q), (A.bhnd(k), lens_k), (A.bhnd(v), lens_k), (do, lens_q))]
    args = (cu_q, cu_k, int(max(lens_q)), int(max(lens_k)))
    o, lse = numba_flash.attention_varlen(*packed[:3], *args, causal=causal, algorithm=c.variant[:3], return_lse=True,
                                          **mods)
    grads = numba_flash.attention_backward_varlen(packed[3], *packed[:3], o, lse, *args, causal=causal,
                                                  algorithm=c.variant[:3], deterministic=c.variant == "fa2-det", **mods)
    nq, nk = q.shape[1], k.shape[2]
    return {name: A.bhnd(unpack_rows(A, x, n, m)) for name, x, n, m in
            zip(("o", "dq", "dk", "dv"), (o, *grads), (lens_q, lens_q, lens_k, lens_k), (nq, nq, nk, nk))}


def chunks(cases):
    """Cases grouped by (part, dtype, d, causal): the kernels one process compiles."""
    by = {}
    for c in cases:
        by.setdefault((c.part, c.p["dtype"], c.p["d"], c.p["causal"]), []).append(c)
    return sorted(by.values(), key=lambda cs: -estimate(cs)[0])  # longest first


def case_row(c: Case) -> dict:
    return {"part": c.part, "case": c.name, "variant": c.variant,
            **{a: list(x) if isinstance(x, tuple) else x for a, x in c.p.items()}}


def run_all(cases, simulate, jobs, out=sys.stderr, rows=None):
    """Every case's row (appended to ``rows`` as it arrives: a caller interrupted keeps them)."""
    weight = {c.name: SECONDS_PER_CALL + reference_seconds(c, simulate) for c in cases}  # relative cost
    rows = [] if rows is None else rows
    total, state, start = sum(weight.values()), {"done": 0.0, "n": 0}, time.perf_counter()

    def report(row):
        state["done"] += weight[row["case"]]
        state["n"] += 1
        elapsed = time.perf_counter() - start
        left = elapsed * (total - state["done"]) / max(state["done"], 1e-9)
        how = row["error"] or " ".join(f"{n} {e:.2e}/{row['allowed'][n]:.2e}" for n, e in row["errors"].items())
        print(f"[{state['n']}/{len(cases)}] {row['case']}: {'ok' if row['passed'] else 'FAIL'} {how} "
              f"({row['seconds']:.2f} s; ~{left:.0f} s left)", file=out, flush=True)
        rows.append(row)

    if jobs <= 1:
        run_cases(cases, simulate, report)
        return rows
    import concurrent.futures as cf
    import multiprocessing
    import queue as queues

    # Each worker takes whole chunks (a kernel configuration compiles in one process) but reports
    # every case as it finishes, through a queue: progress from the first case, and a run cut
    # short keeps every row it reached (main writes them).
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, cf.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        done_rows = manager.Queue()
        futures = {pool.submit(_run_chunk, cs, simulate, done_rows): cs for cs in chunks(cases)}
        reported = set()
        pending = set(futures)
        while pending or not done_rows.empty():
            try:
                row = done_rows.get(timeout=0.5)
            except queues.Empty:
                row = None
            if row is not None:
                reported.add(row["case"])
                report(row)
            for fut in [f for f in pending if f.done()]:
                pending.discard(fut)
                if fut.exception() is not None:  # a worker that died: its unreported cases fail
                    exc = fut.exception()
                    for c in futures[fut]:
                        if c.name not in reported:
                            reported.add(c.name)
                            report(dict(case_row(c), errors=None, plain=None, allowed=None, ratio=math.inf, passed=False,
                                        error=f"worker: {type(exc).__name__}: {exc}"[:300], seconds=0.0))
    return rows


def _run_chunk(cases, simulate, done_rows) -> None:
    """A worker's chunk, each row put on ``done_rows`` as soon as it is known."""
    run_cases(cases, simulate, done_rows.put)


def summary(rows) -> str:
    """A Markdown table per (part, variant, dtype), the failures, and a count."""
    lines = ["| part | variant | dtype | cases | failed | worst err/allowed | worst err/plain | seconds |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key in dict.fromkeys((r["part"], r["variant"], r["dtype"]) for r in rows):
        rs = [r for r in rows if (r["part"], r["variant"], r["dtype"]) == key]
        vs = [e / r["plain"][n] for r in rs if r["errors"] for n, e in r["errors"].items() if r["plain"][n]]
        lines.append("| " + " | ".join(map(str, key)) + f" | {len(rs)} | {sum(not r['passed'] for r in rs)} | "
                     f"{max(r['ratio'] for r in rs):.3g} | {f'{max(vs):.3g}' if vs else '-'} | {sum(r['seconds'] for r in rs):.1f} |")
    failed = [r for r in rows if not r["passed"]]
    lines += [f"FAILED {r['case']}: {r['error'] or r['errors']}" for r in failed[:30]]
    return "\n".join(lines + [f"{len(rows) - len(failed)} of {len(rows)} cases passed" + (f", {len(failed)} FAILED" if failed else "")])


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}")
    return int(text)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", nargs="+", choices=list(GRIDS), default=list(GRIDS), help="which grids (default: all)")
    ap.add_argument("--dtypes", nargs="+", choices=["float16", "bfloat16", "float32"],
                    help="replace the grids' dtype axis (FA's: float16 bfloat16; kvcache float16)")
    ap.add_argument("--algorithms", nargs="+", choices=["fa2", "fa1", "fa3"], default=["fa2", "fa1"],
                    help="numba_flash's loop orders for forward and backward (default: fa2 fa1; fa3, the Hopper "
                         "kernel, runs the forward's 16-bit cases)")
    ap.add_argument("--max-cases", type=positive, metavar="N", help="run the first N cases of each part")
    ap.add_argument("--mods-only", nargs="*", choices=list(MODS), metavar="MOD",
                    help="only the cases with a sliding window (local), softcap or ALiBi (what issue 24 added); "
                         "naming some of local, softcap, alibi: only the cases with one of those")
    ap.add_argument("--head-dims", nargs="+", type=positive, metavar="D",
                    help="only the cases of these head dims (e.g. 160 192 224 256: those above 128, issue 25)")
    ap.add_argument("--every", type=positive, metavar="K", default=1,
                    help="run every K-th case of each part (after --mods-only; a sample spread over the grid)")
    ap.add_argument("--dry-run", action="store_true", help="print the cases and counts; run nothing")
    ap.add_argument("--simulate", action="store_true",
                    help=f"{SIM_CASES} cases per part, scaled down (lengths / 64 up to {SIM_MAX_LEN}, head dim / 4), in Numba's simulator")
    ap.add_argument("--jobs", type=positive, help="processes sharing the GPU (default: min(8, CPUs); 1 with --simulate)")
    ap.add_argument("--json", metavar="FILE", help="write one row per case (parameters, errors, ratio, pass, seconds)")
    return ap.parse_args(argv)


def plan(args):
    cases, counts = [], {}
    for part in args.part:
        cs, counts[part] = grid(part, args.dtypes, args.algorithms)
        if args.mods_only is not None:
            cs = [c for c in cs if any(c.p.get(m) for m in (args.mods_only or MODS))]
        if args.head_dims:
            cs = [c for c in cs if c.p["d"] in args.head_dims]
        cs = cs[:: args.every]
        if args.simulate:
            cs = list(dict.fromkeys(cs[i * SIM_STRIDE % len(cs)] for i in range(1, SIM_CASES + 1)))
        cases += cs[: args.max_cases]
    return cases, counts


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from numba_flash import needs

    if args.simulate and "numba.cuda" not in sys.modules:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"  # decided before numba.cuda is first imported
    if not (args.dry_run or args.simulate):
        needs.exit_unless("flash_attn_grid.py", needs.gpu(), needs.module("cupy"), needs.module("torch"),
                          instead="--dry-run lists the cases, --simulate runs a few scaled down in the simulator")
    cases, counts = plan(args)
    jobs = 1 if args.simulate else args.jobs or min(8, os.cpu_count() or 1)
    if args.dry_run:
        print(f"FlashAttention's grids ({FA_REPO} {FA_FILE} at {FA_COMMIT[:12]}), as numba_flash runs them:")
        for part, cnt in counts.items():
            print(f"{part}:\n" + "\n".join(f"  {n:7d}  {what}" for what, n in cnt.items()))
        print("\n".join(c.name for c in cases))
        seconds, configs = estimate(cases, args.simulate, jobs)
        print(f"{len(cases)} cases to run; ~{configs} kernel configurations; estimate ~{seconds / 60:.1f} min with {jobs} "
              f"job(s), cold compile cache ({'simulator' if args.simulate else 'GPU'}; from shapes, not measured)")
        return 0
    if args.simulate and any(c.p["dtype"] == "bfloat16" for c in cases):
        needs.exit_unless("flash_attn_grid.py --simulate", needs.module("ml_dtypes"))
    start = time.perf_counter()
    rows, finished = [], False
    previous = signal.signal(signal.SIGTERM, _terminated)  # (timeout's signal: write what was reached, then exit)
    try:
        rows = run_all(cases, args.simulate, jobs, rows=rows)
        finished = True
    finally:
        signal.signal(signal.SIGTERM, previous)
        print(summary(rows) + ("" if finished else f"\nINTERRUPTED after {len(rows)} of {len(cases)} cases"))
        print(f"wall {time.perf_counter() - start:.1f} s, {jobs} job(s)", file=sys.stderr)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"source": f"{FA_REPO} {FA_FILE} @ {FA_COMMIT}", "simulated": args.simulate, "counts": counts,
                           "finished": finished, "rows": rows}, f, indent=1, default=str)
    return 0 if all(r["passed"] for r in rows) else 1


def _terminated(signum, frame):
    raise SystemExit(f"flash_attn_grid.py: terminated (signal {signum})")


if __name__ == "__main__":
    sys.exit(main())
