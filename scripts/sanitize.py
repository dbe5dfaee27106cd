"""Run every kernel under compute-sanitizer (memcheck, racecheck) on small awkward shapes.

    python scripts/sanitize.py                        # memcheck and racecheck, CUDA-core kernels
    python scripts/sanitize.py --tool memcheck --precision ieee f16 tf32 tf32x3
    python scripts/sanitize.py --list                 # the cases, without running anything
    python scripts/sanitize.py --split-kv --precision ieee f16   # split-KV, combine, decode (ragged, paged)
    python scripts/sanitize.py --backward             # attention_backward: FA-1, FA-2, FA-2 deterministic (CUDA and tensor cores)
    python scripts/sanitize.py --masks                # sliding windows and softcap: forward, split-KV, decode, backward

The script re-invokes itself as a child process under ``compute-sanitizer --tool TOOL``; the
child runs each case (``CASES``: a list of (name, callable)) on the GPU and synchronises after
it. The parent parses the sanitizer's report and exits non-zero on any kernel error: an
"Invalid ..." (or misaligned, out-of-range, uninitialised, barrier) access, a racecheck hazard,
a kernel fault surfacing as a sticky CUDA error, an error count the report does not explain,
a case that fails, or a child that does not finish. Host API errors (e.g. a driver entry
point looked up and refused) are listed but do not fail the run.

Cases: FA-1 and FA-2, causal and not, float16 and float32, Nq and Nk of 1, 17 and 33 (not
multiples of any tile), head dims 8, 40, 64, 100 and 128, GQA (4 query heads on 2 K/V heads),
batch 2, default tiles (``--tiles all`` adds layouts of one-row tiles, blocks smaller than a
warp and wide K/V tiles). ``--precision`` picks the regimes: ``ieee`` (CUDA cores, the
default), and the tensor-core ones (``f16``: float16 on ``mma.sync``; ``tf32``, ``tf32x3``:
float32); a new regime or kernel is one more entry in ``REGIMES`` or in :func:`build_cases`.

Needs a GPU, CuPy and compute-sanitizer (``--compute-sanitizer`` or PATH); ``--help`` and
``--list`` need none of them. Run it on the GPU whenever a kernel changes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import time
import zlib

# regime name -> (dtypes, the `precision` argument of attention)
REGIMES = {
    "ieee": (("float32", "float16"), "ieee"),
    "f16": (("float16",), None),
    "tf32": (("float32",), "tf32"),
    "tf32x3": (("float32",), "tf32x3"),
}
ALGORITHMS = ("fa1", "fa2")
HEAD_DIMS = (8, 40, 64, 100, 128)
LENGTHS = ((1, 33), (33, 1), (17, 33), (33, 17), (17, 17))  # (Nq, Nk)
BATCH, HEADS, KV_HEADS = 2, 4, 2
EXTRA_TILES = ((1, 1), (2, 4), (8, 2), (16, 16), (32, 64), (128, 8))  # --tiles all (CUDA cores)

CHILD_DONE = "SANITIZE-CHILD-DONE"
PROGRESS = "SANITIZE-PROGRESS"
CASE_FAILED = "SANITIZE-CASE-FAILED"


# ------------------------------------------------------------------------------------------
# The cases
# ------------------------------------------------------------------------------------------


def build_cases(precisions=("ieee",), tiles="default", xp=None, split_kv=False, variants=False, backward=False,
                masks=False, head_dims=None):
    """[(name, callable)] for every kernel configuration and shape; ``xp``: the array module
    the callables use (CuPy on a GPU; NumPy runs them in the simulator, for tests).
    ``split_kv``: only the split-KV cases (FA-2 with ``num_splits=3``, its combine, and
    ``decode`` on ragged caches), D 40 and 128. ``masks``: :func:`_mask_cases`. ``head_dims``:
    instead of each mode's own head dims (the forward's ``HEAD_DIMS``, 40 and 128 for the
    backward and split-KV; issue 25's wide ones: ``--head-dims 200 256``)."""
    if masks:
        return _mask_cases(xp)
    if split_kv:
        return _split_kv_cases(precisions, xp, head_dims or (40, 128))
    if variants:
        return _variant_cases(xp)
    if backward:
        return _backward_cases(xp, head_dims or (40, 128))
    from numba_flash.kernels.tiles import tiles_fit

    cases = []
    for precision in precisions:
        dtypes, precision_arg = REGIMES[precision]
        tile_choices = [(None, None)]
        if tiles == "all" and precision == "ieee":
            tile_choices += list(EXTRA_TILES)
        for algorithm in ALGORITHMS:
            for dtype in dtypes:
                for causal in (False, True):
                    for head_dim in head_dims or HEAD_DIMS:
                        for block_m, block_n in tile_choices:
                            if block_m is not None and not tiles_fit(head_dim, block_m, block_n):
                                continue
                            for n_q, n_k in LENGTHS:
                                tile = "" if block_m is None else f"-{block_m}x{block_n}"
                                name = (f"{precision}-{algorithm}-{dtype}-{'causal' if causal else 'full'}-D{head_dim}"
                                        f"-Nq{n_q}-Nk{n_k}-B{BATCH}H{HEADS}/{KV_HEADS}{tile}")
                                spec = dict(algorithm=algorithm, dtype=dtype, causal=causal, head_dim=head_dim,
                                            n_q=n_q, n_k=n_k, block_m=block_m, block_n=block_n,
                                            precision=precision_arg)
                                cases.append((name, _case(spec, xp)))
    return cases


MASKS = (((5, 3), False, 0.0, False), ((4, -1), True, 0.0, False), ((-1, 6), False, 0.9, False),
         ((7, 0), False, 2.0, False), ((-1, -1), True, 0.0, True), ((6, 2), False, 1.5, True))  # window, causal, cap, ALiBi


def _mask_cases(xp):
    """Sliding windows (narrower than a tile, one-sided, with causal), softcap and ALiBi through every
    kernel path: the forward in both loop orders on CUDA cores (float32), tensor cores (float16)
    and tf32x3, FA-2 split in 3, ragged decode, and the backward (FA-1, FA-2, FA-2 deterministic;
    float32 and float16 on tensor cores), D 40, on the awkward lengths."""
    cases = []
    for window, causal, cap, alibi in MASKS:
        tag = (f"w{window[0]}_{window[1]}{'-causal' if causal else ''}{f'-cap{cap}' if cap else ''}"
               f"{'-alibi' if alibi else ''}")
        extra = dict(causal=causal, window_size=window, softcap=cap, alibi=alibi, head_dim=40)
        for n_q, n_k in ((17, 33), (33, 17), (1, 33)):
            for algorithm in ALGORITHMS:
                for dtype, precision in (("float32", "ieee"), ("float16", None), ("float32", "tf32x3")):
                    name = f"mask-{tag}-{algorithm}-{dtype}-{precision or 'tc'}-Nq{n_q}-Nk{n_k}"
                    spec = dict(algorithm=algorithm, dtype=dtype, n_q=n_q, n_k=n_k, block_m=None, block_n=None,
                                precision=precision, **extra)
                    cases.append((name, _case(spec, xp)))
            for dtype, precision in (("float32", "ieee"), ("float16", None)):
                spec = dict(algorithm="fa2", dtype=dtype, n_q=n_q, n_k=n_k, block_m=None, block_n=None,
                            precision=precision, num_splits=3, **extra)
                cases.append((f"mask-{tag}-fa2-split3-{dtype}-Nq{n_q}-Nk{n_k}", _case(spec, xp)))
            for algorithm, deterministic in (("fa1", False), ("fa2", False), ("fa2", True)):
                for dtype in ("float32", "float16"):
                    spec = dict(algorithm=algorithm, deterministic=deterministic, dtype=dtype, n_q=n_q, n_k=n_k,
                                precision=None, **extra)
                    label = algorithm + ("-deterministic" if deterministic else "")
                    cases.append((f"mask-{tag}-backward-{label}-{dtype}-Nq{n_q}-Nk{n_k}", _backward_case(spec, xp)))
        for dtype in ("float32", "float16"):
            spec = dict(dtype=dtype, n_q=3, window_size=window, causal=causal, softcap=cap, alibi=alibi, head_dim=40)
            cases.append((f"mask-{tag}-decode-{dtype}-Nq3-ragged", _decode_case(spec, xp)))
    # A user's mask_mod reading document ids by q_idx and kv_idx (mod_args): no read past them
    extra = dict(causal=False, user=True, head_dim=40, n_q=17, n_k=33)
    for dtype, precision in (("float32", "ieee"), ("float16", None)):
        for algorithm in ALGORITHMS:
            spec = dict(algorithm=algorithm, dtype=dtype, block_m=None, block_n=None, precision=precision, **extra)
            cases.append((f"mask-user-{algorithm}-{dtype}-{precision or 'tc'}-Nq17-Nk33", _case(spec, xp)))
        for algorithm, deterministic in (("fa1", False), ("fa2", True)):
            spec = dict(algorithm=algorithm, deterministic=deterministic, dtype=dtype, precision=None, **extra)
            label = algorithm + ("-deterministic" if deterministic else "")
            cases.append((f"mask-user-backward-{label}-{dtype}-Nq17-Nk33", _backward_case(spec, xp)))
    return cases


def same_document(b, h, q_idx, kv_idx, q_doc, kv_doc):
    """The user mask cases' mask_mod: a query sees its own document's keys."""
    return q_doc[q_idx] == kv_doc[kv_idx]


def _mods(spec, arrays=None) -> dict:
    """A case's mask and score modifications, as attention and the reference take them (ALiBi's
    slopes, one per query head, of library ``arrays``: NumPy by default)."""
    import numpy as np

    mods = dict(causal=spec["causal"], window_size=spec.get("window_size", (-1, -1)), softcap=spec.get("softcap", 0.0))
    if spec.get("alibi"):
        mods["alibi_slopes"] = (arrays or np).asarray(np.linspace(0.1, 0.8, HEADS, dtype=np.float32))
    if spec.get("user"):  # documents of 5 keys; the queries are the last n_q positions
        kv_doc = (np.arange(spec["n_k"]) // 5).astype(np.int32)
        mods["mask_mod"] = same_document
        mods["mod_args"] = tuple((arrays or np).asarray(x) for x in (kv_doc[spec["n_k"] - spec["n_q"]:].copy(), kv_doc))
    return mods


def _variant_cases(xp):
    """Every point of the ablation space (kernels.forward), float32 and float16 on CUDA cores and
    float16 on tensor cores (the "-tc" cases: the mma engine, split_k as key warps), causal or
    not, on two awkward shapes, D 40."""
    from numba_flash.research.ablation import all_variants

    cases = []
    for variant in all_variants():
        for dtype, precision, label in (("float32", "ieee", "float32"), ("float16", "ieee", "float16"),
                                        ("float16", None, "float16-tc")):
            for causal in (False, True):
                for n_q, n_k in ((17, 33), (33, 17)):
                    name = f"variant-{variant.name}-{label}-{'causal' if causal else 'full'}-D40-Nq{n_q}-Nk{n_k}"
                    spec = dict(algorithm="fa2", dtype=dtype, causal=causal, head_dim=40, n_q=n_q, n_k=n_k,
                                block_m=None, block_n=None, precision=precision, num_splits=1, variant=variant)
                    cases.append((name, _case(spec, xp)))
    return cases


def _backward_cases(xp, head_dims):
    """``attention_backward``: FA-1 (Algorithm 4), FA-2 with atomics and FA-2 deterministic
    (Algorithm 2); float32 (CUDA cores), float16 on tensor cores (``kernels.tc_bwd``, the default
    for 16-bit inputs) and on CUDA cores (``gradients(precision="ieee")``: the "-ieee" cases);
    causal or not, D 40 and 128, on the awkward lengths, GQA."""
    cases = []
    for algorithm, deterministic in (("fa1", False), ("fa2", False), ("fa2", True)):
        label = algorithm + ("-deterministic" if deterministic else "")
        for dtype, precision in (("float32", None), ("float16", None), ("float16", "ieee")):
            regime = "-ieee" if precision else ""
            for causal in (False, True):
                for head_dim in head_dims:
                    for n_q, n_k in LENGTHS:
                        name = (f"backward-{label}-{dtype}{regime}-{'causal' if causal else 'full'}-D{head_dim}"
                                f"-Nq{n_q}-Nk{n_k}-B{BATCH}H{HEADS}/{KV_HEADS}")
                        spec = dict(algorithm=algorithm, deterministic=deterministic, dtype=dtype, causal=causal,
                                    head_dim=head_dim, n_q=n_q, n_k=n_k, precision=precision)
                        cases.append((name, _backward_case(spec, xp)))
    return cases


def _backward_case(spec, xp):
    def run():
        import numpy as np

        from numba_flash import reference
        from numba_flash.api import forward
        from numba_flash import backward

        arrays = xp or __import__("cupy")
        rng = np.random.default_rng(zlib.crc32(repr(sorted((k, str(v)) for k, v in spec.items())).encode()))
        shapes = ((BATCH, HEADS, spec["n_q"], spec["head_dim"]), (BATCH, KV_HEADS, spec["n_k"], spec["head_dim"]))
        host = [rng.standard_normal(s).astype(spec["dtype"]) for s in (shapes[0], shapes[1], shapes[1], shapes[0])]
        q, k, v, do = (arrays.asarray(x) for x in host)
        o, lse = forward(q, k, v, precision="ieee", **_mods(spec, arrays))
        kw = dict(algorithm=spec["algorithm"], deterministic=spec["deterministic"], **_mods(spec, arrays))
        if spec["precision"] is None:  # the public function (tests patch it)
            grads = backward.attention_backward(do, q, k, v, o, lse, **kw)
        else:
            grads = backward.gradients(do, q, k, v, o, lse, precision=spec["precision"], **kw)
        if arrays is not np:
            arrays.cuda.Device().synchronize()
        refs = reference.attention_backward(*(x.astype(np.float64) for x in (host[3], *host[:3])), **_mods(spec))
        for name, got, ref in zip(("dq", "dk", "dv"), grads, refs):
            got = (got.get() if hasattr(got, "get") else np.asarray(got)).astype(np.float64)
            if np.isnan(got).any():
                raise AssertionError(f"NaN in {name}")
            err = float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1.0))
            if err > 0.05:  # garbage, not rounding (float16 included)
                raise AssertionError(f"{name}: max |error| / max(|ref|, 1) = {err:.3g}")

    return run


def _split_kv_cases(precisions, xp, head_dims):
    cases = []
    for precision in precisions:
        dtypes, precision_arg = REGIMES[precision]
        for dtype in dtypes:
            for causal in (False, True):
                for head_dim in head_dims:
                    for n_q, n_k in LENGTHS:
                        name = (f"{precision}-fa2-split3-{dtype}-{'causal' if causal else 'full'}-D{head_dim}"
                                f"-Nq{n_q}-Nk{n_k}-B{BATCH}H{HEADS}/{KV_HEADS}")
                        spec = dict(algorithm="fa2", dtype=dtype, causal=causal, head_dim=head_dim, n_q=n_q, n_k=n_k,
                                    block_m=None, block_n=None, precision=precision_arg, num_splits=3)
                        cases.append((name, _case(spec, xp)))
                    if precision_arg in (None, "ieee") and (precision == "ieee") == (dtype == "float32"):
                        for n_q in (1, 3):  # decode runs float32 on CUDA cores, 16-bit on tensor cores
                            name = f"decode-{dtype}-{'causal' if causal else 'full'}-D{head_dim}-Nq{n_q}-ragged"
                            cases.append((name, _decode_case(dict(dtype=dtype, causal=causal, head_dim=head_dim, n_q=n_q), xp)))
                        for page in (16, 48):  # paged (API.md 2e): a 16-key page tiles a K/V tile, 48 does not
                            name = f"decode-{dtype}-{'causal' if causal else 'full'}-D{head_dim}-paged{page}-append2"
                            cases.append((name, _paged_decode_case(dict(dtype=dtype, causal=causal, head_dim=head_dim,
                                                                        page_size=page), xp)))
    return cases


def _paged_decode_case(spec, xp):
    """``decode`` on a paged cache: pages in a random order, spare rows NaN, lengths 0, 1, 17,
    63, 64 and 100 with 2 keys appended, GQA 8/2, 2 queries, 3 splits; against the float64 oracle
    on the same pages (before the append writes them)."""
    def run():
        import numpy as np

        import numba_flash
        from numba_flash import reference

        arrays = xp or __import__("cupy")
        rng = np.random.default_rng(zlib.crc32(repr(sorted((k, str(v)) for k, v in spec.items())).encode()))
        P, D, dtype = spec["page_size"], spec["head_dim"], spec["dtype"]
        lens = np.array([0, 1, 17, 63, 64, 100], np.int32)
        B, max_blocks = len(lens), -(-102 // P)
        table = np.full((B, max_blocks), -1, np.int32)
        order = rng.permutation(B * max_blocks + 2)
        for b, n in enumerate(lens + 2):
            for j in range(-(-int(n) // P)):
                table[b, j] = order[b * max_blocks + j]
        pages = [np.full((B * max_blocks + 2, P, 2, D), np.nan, dtype) for _ in range(2)]
        for x, b, j in ((x, b, j) for x in pages for b in range(B) for j in range(max_blocks) if table[b, j] >= 0):
            x[table[b, j]] = rng.standard_normal((P, 2, D)).astype(dtype)
        q = rng.standard_normal((B, 8, 2, D)).astype(dtype)
        new = [rng.standard_normal((B, 2, 2, D)).astype(dtype) for _ in range(2)]
        want, _ = reference.decode(q, *pages, cache_seqlens=lens, block_table=table, k_new=new[0], v_new=new[1],
                                   causal=spec["causal"])
        o = numba_flash.decode(*(arrays.asarray(x) for x in (q, *pages)), cache_seqlens=arrays.asarray(lens),
                               block_table=arrays.asarray(table), k_new=arrays.asarray(new[0]),
                               v_new=arrays.asarray(new[1]), causal=spec["causal"], num_splits=3)
        if arrays is not np:
            arrays.cuda.Device().synchronize()
        got = (o.get() if hasattr(o, "get") else np.asarray(o)).astype(np.float64)
        err = float(np.abs(got - want).max())
        if not err <= 0.05:
            raise AssertionError(f"max |o - ref| = {err:.3g}")

    return run


def _decode_case(spec, xp):
    def run():
        import numpy as np

        import numba_flash
        from numba_flash import reference

        arrays = xp or __import__("cupy")
        rng = np.random.default_rng(zlib.crc32(repr(sorted((k, str(v)) for k, v in spec.items())).encode()))
        n_max, lens, D = 70, np.array([70, 23], np.int32), spec["head_dim"]
        host = [rng.standard_normal((BATCH, HEADS, spec["n_q"], D)).astype(spec["dtype"])]
        host += [rng.standard_normal((BATCH, KV_HEADS, n_max, D)).astype(spec["dtype"]) for _ in range(2)]
        for x in host[1:]:
            x[1, :, 23:] = np.nan  # past the valid length: never read
        q, k, v = (arrays.asarray(x) for x in host)
        o = numba_flash.decode(q, k, v, cache_seqlens=arrays.asarray(lens), num_splits=3, **_mods(spec, arrays))
        if arrays is not np:
            arrays.cuda.Device().synchronize()
        got = o.get() if hasattr(o, "get") else np.asarray(o)
        for b, n in enumerate(lens):
            ref, _ = reference.attention(*(x[b : b + 1, :, :n].astype(np.float64) if i else x[b : b + 1].astype(np.float64)
                                           for i, x in enumerate(host)), **_mods(spec))
            err = float(np.abs(got[b : b + 1].astype(np.float64) - ref).max())
            if not err <= 0.05:
                raise AssertionError(f"batch {b}: max |o - ref| = {err:.3g}")

    return run


def _case(spec, xp):
    def run():
        import numpy as np

        from numba_flash import reference
        from numba_flash.api import forward

        arrays = xp or __import__("cupy")
        rng = np.random.default_rng(zlib.crc32(repr(sorted((k, str(v)) for k, v in spec.items())).encode()))
        shapes = ((BATCH, HEADS, spec["n_q"], spec["head_dim"]), (BATCH, KV_HEADS, spec["n_k"], spec["head_dim"]))
        host = [rng.standard_normal(s).astype(spec["dtype"]) for s in (shapes[0], shapes[1], shapes[1])]
        q, k, v = (arrays.asarray(x) for x in host)
        out = arrays.full(q.shape, np.nan, dtype=spec["dtype"])
        lse = arrays.full(q.shape[:3], np.nan, dtype=np.float32)
        forward(q, k, v, algorithm=spec["algorithm"], block_m=spec["block_m"],
                block_n=spec["block_n"], precision=spec["precision"], out=out, lse_out=lse,
                num_splits=spec.get("num_splits"), variant=spec.get("variant"), **_mods(spec, arrays))
        if arrays is not np:
            arrays.cuda.Device().synchronize()
        got = out.get() if hasattr(out, "get") else np.asarray(out)
        ref, _ = reference.attention(*(x.astype(np.float64) for x in host), **_mods(spec))
        if np.isnan(got).any():
            raise AssertionError("unwritten (NaN) output elements")
        err = float(np.abs(got.astype(np.float64) - ref).max())
        if err > 0.05:  # garbage, not rounding (float16 and TF32 included)
            raise AssertionError(f"max |o - ref| = {err:.3g}")

    return run


def run_child(names, precisions, tiles, split_kv=False, variants=False, backward=False, masks=False,
              head_dims=None) -> int:
    """Run the cases (all, or those named) in this process; report each failure on stdout."""
    failures = 0
    selected = set(names or ())
    started = time.perf_counter()
    cases = [(n, c) for n, c in build_cases(precisions, tiles, split_kv=split_kv, variants=variants, backward=backward,
                                            masks=masks, head_dims=head_dims)
             if not selected or n in selected]
    for i, (name, case) in enumerate(cases, 1):
        if i == 1 or i % 20 == 0 or i == len(cases):
            print(f"{PROGRESS} case {i}/{len(cases)} ({time.perf_counter() - started:.0f} s): {name}", flush=True)
        try:
            case()
        except Exception as exc:  # noqa: BLE001 -- reported, and the parent fails the run
            failures += 1
            print(f"{CASE_FAILED} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    print(f"{CHILD_DONE} {len(cases)} cases, {failures} failed, {time.perf_counter() - started:.0f} s", flush=True)
    return 1 if failures else 0


# ------------------------------------------------------------------------------------------
# compute-sanitizer's report
# ------------------------------------------------------------------------------------------

_PREFIX = r"^=+\s*"
# Accesses and faults inside a kernel (memcheck, synccheck, initcheck).
_KERNEL_ERROR = re.compile(
    _PREFIX + r"(Invalid (__global__|__shared__|__local__|global|shared|local|generic)|Invalid .*(read|write|access)"
    r"|Misaligned|Out-of-range|Uninitialized|Barrier error|Illegal|Warp .*(error|illegal)|Hardware exception"
    r"|Malformed|Stack overflow|Race reported|Error: Race)",
    re.I,
)
# CUDA errors that only a faulting kernel causes (they then surface on a later API call).
_KERNEL_FAULT = re.compile(
    _PREFIX + r"Program hit (CUDA_ERROR_(ILLEGAL_ADDRESS|LAUNCH_FAILED|MISALIGNED_ADDRESS|ILLEGAL_INSTRUCTION"
    r"|HARDWARE_STACK_ERROR|INVALID_PC|INVALID_ADDRESS_SPACE|ASSERT|LAUNCH_TIMEOUT)"
    r"|cudaError(IllegalAddress|LaunchFailure|MisalignedAddress|IllegalInstruction|Assert))"
)
_HOST_ERROR = re.compile(_PREFIX + r"Program hit (CUDA_ERROR_\w+|cudaError\w+).*on CUDA API call to (\w+)")
_ERROR_SUMMARY = re.compile(_PREFIX + r"ERROR SUMMARY:\s*(\d+) error")
_RACE_SUMMARY = re.compile(_PREFIX + r"RACECHECK SUMMARY:\s*(\d+) hazard")


@dataclasses.dataclass
class Report:
    tool: str
    kernel_errors: list
    host_errors: list
    hazards: int
    error_summary: int | None
    case_failures: list
    child_done: bool

    @property
    def unexplained(self) -> int:
        """Errors the summary counts that no kernel or host line accounts for."""
        if self.error_summary is None:
            return 0
        return max(0, self.error_summary - len(self.kernel_errors) - len(self.host_errors))

    @property
    def ok(self) -> bool:
        return (not self.kernel_errors and self.hazards == 0 and self.unexplained == 0
                and not self.case_failures and self.child_done)

    def lines(self) -> list[str]:
        out = [f"{self.tool}: {'clean' if self.ok else 'KERNEL ERRORS'}"
               f" (kernel errors {len(self.kernel_errors)}, hazards {self.hazards}, host API errors "
               f"{len(self.host_errors)}, error summary {self.error_summary}, unexplained {self.unexplained}, "
               f"failed cases {len(self.case_failures)}, child finished {self.child_done})"]
        out += [f"  kernel: {e}" for e in self.kernel_errors[:20]]
        out += [f"  case: {e}" for e in self.case_failures[:20]]
        calls = sorted({m.group(1) for e in self.host_errors if (m := re.search(r"on CUDA API call to (\w+)", e))})
        if self.host_errors:
            out.append(f"  host API errors (not failing the run) on: {', '.join(calls) or '?'}")
        return out


def parse_report(text: str, tool: str) -> Report:
    """Classify compute-sanitizer's output (and the child's own lines) for one tool."""
    kernel, host, case_failures = [], [], []
    hazards, summary, done = 0, None, False
    for raw in text.splitlines():
        line = raw.rstrip()
        if line.startswith(CASE_FAILED):
            case_failures.append(line[len(CASE_FAILED):].strip())
        elif line.startswith(CHILD_DONE):
            done = True
        elif m := _RACE_SUMMARY.match(line):
            hazards += int(m.group(1))
        elif m := _ERROR_SUMMARY.match(line):
            summary = int(m.group(1))
        elif _KERNEL_FAULT.match(line) or _KERNEL_ERROR.match(line):
            kernel.append(line.lstrip("= "))
        elif _HOST_ERROR.match(line):
            host.append(line.lstrip("= "))
    return Report(tool, kernel, host, hazards, summary, case_failures, done)


# ------------------------------------------------------------------------------------------
# The parent
# ------------------------------------------------------------------------------------------


def find_sanitizer(given: str | None) -> str | None:
    for candidate in (given, shutil.which("compute-sanitizer"), "/usr/local/cuda/bin/compute-sanitizer"):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def run_tool(sanitizer, tool, args) -> Report:
    cmd = [sanitizer, "--tool", tool, "--print-limit", "200"]
    if tool == "racecheck":
        cmd += ["--racecheck-report", "all"]
    cmd += [sys.executable, os.path.abspath(__file__), "--child", "--precision", *args.precision, "--tiles", args.tiles]
    if args.split_kv:
        cmd.append("--split-kv")
    if args.variants:
        cmd.append("--variants")
    if args.backward:
        cmd.append("--backward")
    if args.masks:
        cmd.append("--masks")
    if args.head_dims:
        cmd += ["--head-dims", *map(str, args.head_dims)]
    for name in args.case or ():
        cmd += ["--case", name]
    print(f"$ {' '.join(cmd)}", flush=True)
    lines = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as child:
        for line in child.stdout:
            lines.append(line)
            if line.startswith((PROGRESS, CASE_FAILED, CHILD_DONE)):
                print(f"  [{tool}] {line.rstrip()}", file=sys.stderr, flush=True)
    text = "".join(lines)
    if args.log:
        os.makedirs(args.log, exist_ok=True)
        with open(os.path.join(args.log, f"{tool}.log"), "w") as f:
            f.write(text)
    return parse_report(text, tool)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="sanitize.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--tool", nargs="+", default=["memcheck", "racecheck"],
                    choices=["memcheck", "racecheck", "synccheck", "initcheck"], help="compute-sanitizer tools to run")
    ap.add_argument("--precision", nargs="+", default=["ieee"], choices=sorted(REGIMES),
                    help="regimes: ieee = CUDA-core kernels; f16, tf32, tf32x3 = tensor-core kernels")
    ap.add_argument("--tiles", choices=["default", "all"], default="default",
                    help="default tiles only, or also the extra CUDA-core layouts")
    ap.add_argument("--split-kv", action="store_true",
                    help="the split-KV cases instead (FA-2 with num_splits=3 and the combine; decode on ragged caches)")
    ap.add_argument("--variants", action="store_true",
                    help="the ablation variants instead (kernels.forward: every loop order, grid, rescale, warp partition, O load)")
    ap.add_argument("--backward", action="store_true",
                    help="the backward cases instead (attention_backward: FA-1, FA-2 with atomics, FA-2 deterministic)")
    ap.add_argument("--masks", action="store_true",
                    help="the mask cases instead (sliding windows and softcap: forward, split-KV, decode, backward)")
    ap.add_argument("--head-dims", nargs="+", type=int, metavar="D",
                    help="these head dims instead of each mode's own (e.g. 200 256: issue 25's wide ones)")
    ap.add_argument("--case", action="append", metavar="NAME", help="run only this case (repeatable; see --list)")
    ap.add_argument("--list", action="store_true", help="print the case names and exit (no GPU needed)")
    ap.add_argument("--compute-sanitizer", metavar="PATH", help="the compute-sanitizer binary (default: PATH, then /usr/local/cuda/bin)")
    ap.add_argument("--log", metavar="DIR", help="also write each tool's full report to DIR/TOOL.log")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        for name, _ in build_cases(args.precision, args.tiles, xp=False, split_kv=args.split_kv, variants=args.variants,
                                   backward=args.backward, masks=args.masks, head_dims=args.head_dims):
            print(name)
        return 0
    if args.child:
        return run_child(args.case, args.precision, args.tiles, args.split_kv, args.variants, args.backward, args.masks,
                         args.head_dims)
    from numba_flash import needs

    sanitizer = find_sanitizer(args.compute_sanitizer)
    needs.exit_unless(
        "sanitize.py", needs.gpu(), needs.module("cupy"),
        None if sanitizer else ("compute-sanitizer (not found: pass --compute-sanitizer PATH; it comes with the CUDA "
                                "toolkit, e.g. /usr/local/cuda/bin/compute-sanitizer)"),
        instead="--list prints the cases",
    )
    reports = [run_tool(sanitizer, tool, args) for tool in args.tool]
    for report in reports:
        print("\n".join(report.lines()))
    ok = all(r.ok for r in reports)
    print("sanitize.py: " + ("no kernel errors" if ok else "KERNEL ERRORS FOUND"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
