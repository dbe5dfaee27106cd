"""FlashAttention-3 on the H200 (issue 23): correctness, then time against its peers, one run.

1. Correctness of ``attention(..., algorithm="fa3")`` on awkward shapes (tails of every tile,
   GQA/MQA, causal with Nq != Nk, windows, head dims that are not 64/128/256): the output against
   float64 (FlashAttention's rule: at most twice a plain 16-bit implementation's error, plus a
   small floor), the logsumexp, and bitwise determinism (two calls). A watchdog reports a hung
   kernel (an mbarrier phase that never completes) after ``--watchdog`` seconds and exits 3.
2. Timing (CUDA events around each of ``--repeats`` calls queued back to back, the median,
   compilation excluded) of fa3, our fa2, and PyTorch SDPA's flash (FlashAttention-2) and cuDNN
   backends on the same tensors; TFLOP/s with 4 B H Nq Nk D (halved when causal).
3. ``--mods``: correctness of the score modifications and packed batches on fa3 (softcap, ALiBi,
   a document ``mask_mod`` walking its block mask, a ``score_mod`` bias table, ``attention_varlen``)
   on small awkward shapes, against float64 (``numba_flash.reference``): the error at most twice
   fa2's on the same call (our tensor-core forward, itself checked by FlashAttention's rule), plus
   a floor; with ``--no-bench``, what compute-sanitizer runs on these kernels.
4. ``--fp8``: the same correctness cases on float8_e4m3fn inputs with (B, Hkv) descales (against
   float64 beside a plain fp8 implementation), and fa3 timed on e4m3 copies of the float16 inputs
   (its ratio to fa3 on float16 in the same run: FA-3 section 3.3).
5. ``--pair A,B``: two ``--tiles`` configurations timed in alternating rounds (A then B, B then A, ...), the
   median of the rounds' B / A ratios with their range (``mod_cost.paired_cost``): a tile or knob
   decided on one process's sequential timings can be the order effect (performance log 28).

    python scripts/fa3_bench.py --json docs/data/fa3_h200_<date>.json
    python scripts/fa3_bench.py --quick            # correctness and one shape
    python scripts/fa3_bench.py --fp8 --dtypes float16 --no-variants   # fp8 beside float16
    python scripts/fa3_bench.py --pair 192x128x2-pingpong,192x128x2 --dtypes float16 --shapes "4,16,4096,64"
    compute-sanitizer --tool racecheck python scripts/fa3_bench.py --mods --no-check --no-bench

Needs a Hopper GPU and torch.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from mask_gallery import median_ms, standard_slopes  # noqa: E402 (queued timing; ALiBi's slopes)
from mod_cost import paired_cost, parse_shapes  # noqa: E402 (alternating rounds; B,H,N,D;...)

CASES = [  # (B, H, Hkv, Nq, Nk, D, causal, window)
    (1, 1, 1, 128, 128, 64, False, (-1, -1)),
    (2, 4, 4, 300, 300, 128, False, (-1, -1)),
    (2, 4, 2, 300, 517, 128, True, (-1, -1)),
    (1, 8, 1, 1000, 333, 64, True, (-1, -1)),
    (1, 4, 4, 129, 4097, 96, False, (-1, -1)),
    (3, 2, 1, 1, 700, 40, False, (-1, -1)),
    (1, 2, 2, 513, 1030, 256, True, (-1, -1)),
    (1, 2, 2, 777, 777, 128, False, (100, 20)),
    (1, 3, 3, 64, 64, 8, True, (-1, -1)),
    (2, 2, 2, 2048, 2048, 200, False, (-1, -1)),
]

VARIANTS = {  # fa3 with a factor of FA-3's design removed (numba_flash.fa3.forward's knobs)
    "fa3 no overlap": dict(overlap=False),
    "fa3 no pingpong": dict(pingpong=False),
    "fa3 neither": dict(overlap=False, pingpong=False),
    "fa3 no setmaxnreg": dict(reallocate=False),
}

SHAPES = [  # (B, H, N, D) of the timing
    (4, 16, 4096, 64), (4, 16, 4096, 128), (1, 16, 16384, 64), (1, 16, 16384, 128), (4, 16, 4096, 256),
]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10, help="queued calls timed per entry (median)")
    ap.add_argument("--json", help="write every row to this file")
    ap.add_argument("--quick", action="store_true", help="the correctness cases and one timed shape")
    ap.add_argument("--host", action="store_true", help="the host's time per call instead: small calls (B1 H8 "
                    "N256 D128) back to back, the wall clock per call, for fa3, fa2 (planned) "
                    "and flash SDPA, and fa3's profile (what the next call's Python spends its time on)")
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness cases")
    ap.add_argument("--watchdog", type=float, default=120.0, help="seconds before a kernel is called hung")
    ap.add_argument("--shapes", default="", help="timed shapes B,H,N,D separated by ';' (default: the issue's five)")
    ap.add_argument("--cases", type=int, default=len(CASES), help="run only the first N correctness cases (sanitizers)")
    ap.add_argument("--no-bench", action="store_true", help="correctness only")
    ap.add_argument("--no-variants", action="store_true", help="time fa3 without its ablation's variants")
    ap.add_argument("--mods", action="store_true", help="check softcap, ALiBi, mask_mod, score_mod and packed batches "
                    "on fa3 (small shapes; against float64, at most twice fa2's error)")
    ap.add_argument("--fp8", action="store_true", help="also time fa3 on float8_e4m3fn copies of the float16 inputs "
                    "(V^T made in the call, timed with it) and check fp8 against float64 beside a plain fp8 attention")
    ap.add_argument("--tiles", default="", help="extra fa3 configurations to time, comma-separated: bm x bn x stages, "
                    "optionally with knobs after a '-' (e.g. 128x176x2, 128x128x2-nopingpong, 192x128x2-pingpong, "
                    "128x128x2-nopingpong-nooverlap-noreallocate; -fp8: on the float8 inputs of --fp8; -poly2: "
                    "2/8 of the exponentials on the FMA units; -rescale8: O rescaled only when a row's max moves by more than 8 "
                    "(log2 units; -rescale0: every tile); -softcap50: with softcap=50; -alibi: with ALiBi's slopes; -notmastore: O stored by every "
                    "thread, not by TMA; -pingpong: consumer warpgroups taking turns where the default takes none)")
    ap.add_argument("--pair", default="", help="two --tiles configurations A,B timed in alternating rounds instead of "
                    "the bench: the median B / A ratio of --rounds rounds and its range, per shape")
    ap.add_argument("--rounds", type=int, default=7, help="--pair's alternating rounds")
    args = ap.parse_args(argv)
    if args.pair and len([t for t in args.pair.split(",") if t]) != 2:
        ap.error(f"--pair takes two configurations A,B; got {args.pair!r}")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    try:  # (None: the default shapes)
        args.shape_list = parse_shapes(args.shapes) if args.shapes.strip(" ;") else None
    except ValueError as e:
        ap.error(f"--shapes: {e}")
    return args


def tile_spec(text: str):
    """``"192x128x2-nopingpong"`` -> (label, (192, 128, 2), {"pingpong": False})."""
    tiles, *off = text.split("-")
    knobs = {}
    for name in off:
        if name == "fp8":  # on the float8 copies of the inputs
            knobs["fp8"] = True
            continue
        if name.startswith("poly") and name[4:].isdigit():  # eighths of the exponentials on the FMA units
            knobs["poly_exp2"] = int(name[4:])
            continue
        if name.startswith("rescale") and name[7:].replace(".", "", 1).isdigit():  # FA-4's conditional rescaling
            knobs["rescale_threshold"] = float(name[7:])
            continue
        if name.startswith("softcap") and name[7:].replace(".", "", 1).isdigit():  # with a soft cap
            knobs["softcap"] = float(name[7:])
            continue
        if name == "alibi":  # with ALiBi's standard slopes (made for the shape's heads)
            knobs["alibi"] = True
            continue
        if name == "pingpong":  # consumer warpgroups taking turns where the default takes none (fa3.takes_turns)
            knobs["pingpong"] = True
            continue
        if name == "notmastore":  # O stored by every thread, not through shared memory and TMA
            knobs["tma_store"] = False
            continue
        if not name.startswith("no") or name[2:] not in ("overlap", "pingpong", "reallocate"):
            raise SystemExit(f"--tiles: unknown knob {name!r} in {text!r} (nooverlap, nopingpong, pingpong, "
                             "noreallocate, notmastore, polyN, rescaleT, softcapC, alibi, fp8)")
        knobs[name[2:]] = False
    dims = tiles.split("x")
    if len(dims) != 3 or not all(d.isdigit() and int(d) > 0 for d in dims):
        raise SystemExit(f"--tiles: a configuration is block_m x block_n x stages (e.g. 128x128x2); got {text!r}")
    return text, tuple(int(x) for x in dims), knobs


def wait(torch, what: str, seconds: float) -> None:
    """Synchronise, or report a hang (an mbarrier phase that never completed) and exit 3."""
    ev = torch.cuda.Event()
    ev.record()
    start = time.time()
    while not ev.query():
        if time.time() - start > seconds:
            print(f"HANG {what}: still running after {seconds:.0f} s", flush=True)
            sys.stdout.flush()
            import os

            os._exit(3)
        time.sleep(0.001)


def plain(q, k, v, causal, window, torch):
    """A plain 16-bit attention (S and P in the inputs' dtype): the error the 2x rule scales."""
    return reference(q, k, v, causal, window, torch, dtype=q.dtype)


def reference(q, k, v, causal, window, torch, dtype=None):
    dtype = dtype or torch.float64
    group = q.shape[1] // k.shape[1]
    q, k, v = q.to(dtype), k.repeat_interleave(group, 1).to(dtype), v.repeat_interleave(group, 1).to(dtype)
    nq, nk = q.shape[2], k.shape[2]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    i = torch.arange(nq, device=q.device)[:, None] + (nk - nq)
    j = torch.arange(nk, device=q.device)[None]
    visible = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if right >= 0:
        visible &= j <= i + right
    if left >= 0:
        visible &= j >= i - left
    s = s.masked_fill(~visible, -math.inf)
    m = s.amax(-1, keepdim=True).nan_to_num(neginf=0.0)
    p = (s - m).exp()
    lsum = p.sum(-1, keepdim=True)
    o = (p.to(dtype) @ v) / lsum.clamp_min(1e-300).to(dtype)
    lse = (m + lsum.log()).squeeze(-1)
    return o.masked_fill(lsum == 0, 0), lse


def check(torch, numba_flash, dtype, watchdog, cases=CASES) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for B, H, Hkv, Nq, Nk, D, causal, window in cases:
        q = torch.randn(B, H, Nq, D, device="cuda", dtype=dtype, generator=gen)
        k = torch.randn(B, Hkv, Nk, D, device="cuda", dtype=dtype, generator=gen)
        v = torch.randn(B, Hkv, Nk, D, device="cuda", dtype=dtype, generator=gen)
        out = torch.full_like(q, float("nan"))
        lse_out = torch.full((B, H, Nq), float("nan"), device="cuda")
        label = f"{dtype} B{B} H{H}/{Hkv} {Nq}x{Nk} D{D} causal={causal} window={window}"
        try:
            o, lse = numba_flash.api.forward(q, k, v, causal=causal, window_size=window, algorithm="fa3", out=out,
                                         lse_out=lse_out)
            wait(torch, label, watchdog)
            o2, _ = numba_flash.api.forward(q, k, v, causal=causal, window_size=window, algorithm="fa3")
            wait(torch, label, watchdog)
        except Exception as e:  # noqa: BLE001
            rows.append(dict(case=label, status=f"error: {type(e).__name__}: {e}"))
            print(f"FAIL {label}: {type(e).__name__}: {e}", flush=True)
            continue
        ref_o, ref_lse = reference(q, k, v, causal, window, torch)
        base_o, _ = plain(q, k, v, causal, window, torch)
        err = float((o.double() - ref_o).abs().max())
        base = float((base_o.double() - ref_o).abs().max())
        finite = torch.isfinite(ref_lse)
        lse_err = float((lse.double() - ref_lse)[finite].abs().max()) if finite.any() else 0.0
        inf_ok = bool(torch.equal(torch.isinf(lse), torch.isinf(ref_lse)))
        same = bool(torch.equal(o, o2))
        ok = err <= 2 * base + 1e-5 and lse_err < 1e-3 and inf_ok and same and not torch.isnan(o).any()
        rows.append(dict(case=label, status="ok" if ok else "FAIL", err=err, plain_err=base, lse_err=lse_err,
                         deterministic=same))
        print(f"{'PASS' if ok else 'FAIL'} {label}: err {err:.2e} (plain {base:.2e}) lse {lse_err:.1e} "
              f"-inf rows {'match' if inf_ok else 'DIFFER'} deterministic={same}", flush=True)
    return rows


def same_document(b, h, q_idx, kv_idx, doc):
    return doc[q_idx + 217] == doc[kv_idx]  # (queries: the last 300 of 517 positions)


def relative_bias(score, b, h, q_idx, kv_idx, table):
    return score + table[h, q_idx - kv_idx + 517]


def mod_cases(torch, dtype, gen):
    """(label, q, k, v, keyword arguments) of ``--mods``: B2 H4/2 300x517 D128 (tails, GQA, Nq != Nk)
    with each modification, and a packed batch."""
    B, H, Hkv, Nq, Nk, D = 2, 4, 2, 300, 517, 128
    q = torch.randn(B, H, Nq, D, device="cuda", dtype=dtype, generator=gen)
    k, v = (torch.randn(B, Hkv, Nk, D, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    doc = torch.sort(torch.randint(0, 4, (Nk,), device="cuda", generator=gen)).values.to(torch.int32)
    table = 0.5 * torch.randn(H, Nq + Nk + 1, device="cuda", generator=gen)
    slopes = torch.rand(B, H, device="cuda", generator=gen) * 0.1
    return [
        ("softcap 3, causal", (3 * q, k, v), dict(softcap=3.0, causal=True)),
        ("ALiBi (B, H), window (200, -1)", (q, k, v), dict(alibi_slopes=slopes, window_size=(200, -1))),
        ("ALiBi, causal", (q, k, v), dict(alibi_slopes=slopes, causal=True)),
        ("documents by mask_mod (block-sparse)", (q, k, v), dict(mask_mod=same_document, mod_args=(doc,))),
        ("score_mod bias table, causal", (q, k, v), dict(score_mod=relative_bias, mod_args=(table,), causal=True)),
    ]


def check_mods(torch, numba_flash, dtype, watchdog) -> list[dict]:
    """``--mods``: fa3 with each score modification, and on a packed batch, against float64."""
    import numpy as np

    from numba_flash import reference as oracle

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    host = (lambda x: x.float().cpu().numpy().astype(np.float64))

    def judged(label, o, fa2_o, ref_o):
        err = float(np.abs(host(o) - ref_o).max())
        base = float(np.abs(host(fa2_o) - ref_o).max())
        ok = err <= 2 * base + 1e-4 and not torch.isnan(o).any()
        rows.append(dict(case=f"{dtype} {label}", status="ok" if ok else "FAIL", err=err, fa2_err=base))
        print(f"{'PASS' if ok else 'FAIL'} {dtype} {label}: err {err:.2e} (fa2 {base:.2e})", flush=True)

    for label, (q, k, v), kw in mod_cases(torch, dtype, gen):
        o = numba_flash.attention(q, k, v, algorithm="fa3", **kw)
        wait(torch, label, watchdog)
        fa2_o = numba_flash.attention(q, k, v, algorithm="fa2", **kw)
        ref_kw = {n: (tuple(a.cpu().numpy() for a in x) if n == "mod_args" else
                      x.cpu().numpy() if hasattr(x, "cpu") else x) for n, x in kw.items()}
        ref_o, _ = oracle.attention(*(host(x) for x in (q, k, v)), **ref_kw)
        judged(label, o, fa2_o, ref_o)
    lens = [100, 0, 1, 300, 129]  # a packed batch: an empty sequence, a one-row one, tails
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q, k, v = (torch.randn(int(cu[-1]), 4, 128, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    kw = dict(causal=True, softcap=5.0)
    o = numba_flash.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), algorithm="fa3", **kw)
    wait(torch, "varlen", watchdog)
    fa2_o = numba_flash.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), algorithm="fa2", **kw)
    ref_o, _ = oracle.attention_varlen(*(host(x) for x in (q, k, v)), cu, cu, max(lens), max(lens), **kw)
    judged("attention_varlen, causal, softcap 5", o, fa2_o, ref_o)
    return rows


def plain_fp8(q, k, v, causal, window, torch):
    """A plain fp8 attention on dequantized float64 ``q``, ``k``, ``v``: float32 S and softmax, the
    normalised P rounded to e4m3, float32 O, bfloat16 out (tests/helpers.py's plain_fp8_attention)."""
    p = torch.softmax(_scores(q.float(), k.float(), causal, window, torch), -1).nan_to_num(0.0)
    g = q.shape[1] // k.shape[1]
    return (p.to(torch.float8_e4m3fn).float() @ v.float().repeat_interleave(g, 1)).to(torch.bfloat16)


def _scores(q, k, causal, window, torch):
    group = q.shape[1] // k.shape[1]
    s = (q @ k.repeat_interleave(group, 1).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    nq, nk = s.shape[-2:]
    i = torch.arange(nq, device=q.device)[:, None] + (nk - nq)
    j = torch.arange(nk, device=q.device)[None]
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    visible = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
    if right >= 0:
        visible &= j <= i + right
    if left >= 0:
        visible &= j >= i - left
    return s.masked_fill(~visible, -math.inf)


def check_fp8(torch, numba_flash, watchdog, cases=CASES) -> list[dict]:
    """fa3 on e4m3 inputs with (B, Hkv) descales: the error against float64 (dequantized inputs)
    at most twice a plain fp8 implementation's, lse within 1e-3 of the largest score (Hopper's e4m3
    products keep ~14 bits of their sums), bfloat16 out, bitwise deterministic."""
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for B, H, Hkv, Nq, Nk, D, causal, window in cases:
        q8, k8, v8 = ((2 * torch.randn(B, h, n, D, device="cuda", generator=gen)).to(torch.float8_e4m3fn)
                      for h, n in ((H, Nq), (Hkv, Nk), (Hkv, Nk)))
        scales = [0.3 + 1.5 * torch.rand(B, Hkv, device="cuda", generator=gen) for _ in range(3)]
        real = [x.double() * sc.double().repeat_interleave(x.shape[1] // Hkv, 1)[:, :, None, None]
                for x, sc in zip((q8, k8, v8), scales)]
        label = f"float8_e4m3fn B{B} H{H}/{Hkv} {Nq}x{Nk} D{D} causal={causal} window={window}"
        try:
            kw = dict(causal=causal, window_size=window, algorithm="fa3", q_descale=scales[0], k_descale=scales[1],
                      v_descale=scales[2])
            o, lse = numba_flash.api.forward(q8, k8, v8, **kw)
            wait(torch, label, watchdog)
            o2, _ = numba_flash.api.forward(q8, k8, v8, **kw)
            wait(torch, label, watchdog)
        except Exception as e:  # noqa: BLE001
            rows.append(dict(case=label, status=f"error: {type(e).__name__}: {e}"))
            print(f"FAIL {label}: {type(e).__name__}: {e}", flush=True)
            continue
        ref_o, ref_lse = reference(*real, causal, window, torch)
        err = float((o.double() - ref_o).abs().max())
        base = float((plain_fp8(*real, causal, window, torch).double() - ref_o).abs().max())
        s = _scores(real[0], real[1], causal, window, torch)
        top = float(s[torch.isfinite(s)].abs().max()) if torch.isfinite(s).any() else 1.0
        finite = torch.isfinite(ref_lse)
        lse_err = float((lse.double() - ref_lse)[finite].abs().max()) if finite.any() else 0.0
        same = bool(torch.equal(o, o2))
        ok = (err <= 2 * base + 1e-5 and lse_err < 1e-3 * max(1.0, top) and same and o.dtype == torch.bfloat16
              and bool(torch.equal(torch.isinf(lse), torch.isinf(ref_lse))) and not torch.isnan(o).any())
        rows.append(dict(case=label, status="ok" if ok else "FAIL", err=err, plain_err=base, lse_err=lse_err,
                         deterministic=same))
        print(f"{'PASS' if ok else 'FAIL'} {label}: err {err:.2e} (plain fp8 {base:.2e}) lse {lse_err:.1e} "
              f"(largest score {top:.0f}) deterministic={same}", flush=True)
    return rows


def variants_at(numba_flash, head_dim: int) -> dict:
    """:data:`VARIANTS` for the default tiles at ``head_dim``: where they take no turns (192 rows,
    ``fa3.takes_turns``), the ping-pong entries add the turns instead of removing them."""
    from numba_flash.tile_table import fa3_tiles

    if numba_flash.fa3.takes_turns(fa3_tiles(numba_flash.fa3.kernel_head_dim(head_dim))[0]):
        return VARIANTS
    return {"fa3 with pingpong": dict(pingpong=True), "fa3 no overlap": dict(overlap=False),
            "fa3 no overlap, with pingpong": dict(overlap=False, pingpong=True),
            "fa3 no setmaxnreg": dict(reallocate=False)}


def tile_call(torch, numba_flash, spec, inputs, fp8_inputs, causal):
    """The call of one ``tile_spec`` on ``inputs`` (``fp8_inputs`` with ``-fp8``; ``None`` where
    those are ``None``): ``numba_flash.fa3.forward`` with the tiles and knobs."""
    _, (bm, bn, st), knobs = spec
    knobs = dict(knobs)
    if knobs.pop("fp8", False):
        inputs = fp8_inputs
    if inputs[0] is None:
        return None
    if knobs.pop("alibi", False):  # ALiBi (Press et al.): slopes 2^(-8 h / H), h = 1..H
        knobs["alibi_slopes"] = standard_slopes(int(inputs[0].shape[1]), torch)
    return lambda: numba_flash.fa3.forward(*inputs, causal=causal, block_m=bm, block_n=bn, stages=st, **knobs)


def pair(torch, numba_flash, dtype, shapes, repeats, specs, rounds) -> list[dict]:
    """``--pair``: configurations A and B (``tile_spec``s) timed in alternating rounds on the same
    inputs; B / A as the median of the rounds' ratios, with their range."""
    (label_a, _, knobs_a), (label_b, _, knobs_b) = specs
    rows = []
    for B, H, N, D in shapes:
        for causal in (False, True):
            q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype) for _ in range(3))
            fp8 = knobs_a.get("fp8") or knobs_b.get("fp8")
            q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v)) if fp8 else (None,) * 3
            a, b = (tile_call(torch, numba_flash, spec, (q, k, v), (q8, k8, v8), causal) for spec in specs)
            for fn in (a, b):  # compiled and warm before the rounds
                fn()
            cost = paired_cost(lambda: median_ms(a, torch, repeats), lambda: median_ms(b, torch, repeats), rounds)
            rows.append(dict(dtype=str(dtype), B=B, H=H, N=N, D=D, causal=causal, a=label_a, b=label_b,
                             a_ms=cost["plain_ms"], b_ms=cost["mod_ms"], ratio=cost["ratio"], ratio_min=cost["ratio_min"],
                             ratio_max=cost["ratio_max"], rounds=rounds))
            print(f"{dtype} B{B} H{H} N{N} D{D} causal={causal}: {label_b} / {label_a} = {cost['ratio']:.3f} (rounds "
                  f"{cost['ratio_min']:.3f}-{cost['ratio_max']:.3f}; {cost['mod_ms']:.3f} / {cost['plain_ms']:.3f} ms)",
                  flush=True)
    return rows


def bench(torch, numba_flash, dtype, shapes, repeats, extra_tiles, variants=True, fp8=False) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for B, H, N, D in shapes:
        for causal in (False, True):
            q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype) for _ in range(3))
            flops = 4 * B * H * N * N * D / (2 if causal else 1)
            entries = {"fa3": lambda: numba_flash.attention(q, k, v, causal=causal, algorithm="fa3"),
                       "fa2": lambda: numba_flash.attention(q, k, v, causal=causal)}
            q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v)) if fp8 else (None,) * 3
            if fp8 and dtype == torch.float16:  # FA-3 section 3.3: the e4m3 products
                entries["fa3 fp8"] = lambda: numba_flash.attention(q8, k8, v8, causal=causal, algorithm="fa3")
            for spec in extra_tiles:
                call = tile_call(torch, numba_flash, spec, (q, k, v), (q8, k8, v8), causal)
                if call is not None:
                    entries[f"fa3 {spec[0]}"] = call
            if variants and D <= 128:  # the v2 -> v3 factors, one removed at a time
                for name, knobs in variants_at(numba_flash, D).items():
                    entries[name] = lambda knobs=knobs: numba_flash.fa3.forward(q, k, v, causal=causal, **knobs)
            for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                def sdpa(backend=backend):
                    with sdpa_kernel(backend):
                        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
                entries[name] = sdpa
            times, gaps, expected = {}, {}, None
            for name, fn in [("flash", entries.pop("flash"))] + list(entries.items()):  # flash first: the yardstick
                try:
                    got = fn()
                    got = (got[0] if isinstance(got, tuple) else got).float()
                    expected = got if expected is None else expected
                    gaps[name] = float((got - expected).abs().max())  # a fast wrong kernel shows here
                    times[name] = median_ms(fn, torch, repeats)
                except Exception as e:  # noqa: BLE001
                    print(f"  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            line = f"{dtype} B{B} H{H} N{N} D{D} causal={causal}:"
            for name, ms in times.items():
                tf = flops / ms / 1e9
                ratio = times["flash"] / ms if "flash" in times else float("nan")
                rows.append(dict(dtype=str(dtype), B=B, H=H, N=N, D=D, causal=causal, impl=name, ms=ms, tflops=tf,
                                 vs_flash=ratio, vs_cudnn=times.get("cudnn", float("nan")) / ms,
                                 max_diff_vs_flash=gaps[name], vs_fa3=times.get("fa3", float("nan")) / ms))
                versus = f", {times['fa3'] / ms:.2f}x fa3" if name == "fa3 fp8" and "fa3" in times else ""
                line += f"  {name} {ms:.3f} ms {tf:.0f} TF ({ratio:.2f}x flash{versus}, |diff| {gaps[name]:.0e})"
            print(line, flush=True)
    return rows


def host_times(torch, numba_flash, dtype, calls: int = 2000) -> list[dict]:
    """Small calls whose GPU work is a few microseconds, queued back to back: the wall clock per
    call is the host's (checks, allocation, tensor maps, launch) where it exceeds the GPU's; fp8's
    call, and fa3's with its four tensor maps made anew each time (new pointers' cost)."""
    import cProfile
    import io
    import pstats

    B, H, N, D = 1, 8, 256, 128
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", generator=gen).to(dtype) for _ in range(3))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    def new_maps():  # the host's cost of four tensor maps never seen (fa3._kept_entry): encoded and copied
        numba_flash.fa3.forget_tensor_maps()
        return numba_flash.attention(q, k, v, algorithm="fa3")

    entries = {"fa3": lambda: numba_flash.attention(q, k, v, algorithm="fa3"),
               "fa2": lambda: numba_flash.attention(q, k, v), "flash": flash}
    if hasattr(torch, "float8_e4m3fn"):  # fp8: the V^T pass and the kernel, planned
        q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
        entries["fa3 fp8"] = lambda: numba_flash.attention(q8, k8, v8, algorithm="fa3")
    entries["fa3, its maps forgotten before each call"] = new_maps
    rows = []
    for name, call in entries.items():
        for _ in range(50):
            call()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) / calls * 1e6
        rows.append(dict(kind="host", impl=name, B=B, H=H, N=N, D=D, dtype=str(dtype), wall_us_per_call=wall_us))
        print(f"host {name}: {wall_us:.1f} us a call, {calls} calls back to back", flush=True)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(300):
        entries["fa3"]()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(20)
    print(text.getvalue(), flush=True)
    return rows


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from numba_flash import needs

    needs.exit_unless("fa3_bench.py", needs.gpu(), needs.module("torch"))
    import torch

    import numba_flash
    import numba_flash.api  # noqa: F401
    import numba_flash.fa3  # noqa: F401

    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                command="python scripts/fa3_bench.py " + " ".join(sys.argv[1:] if argv is None else argv))
    print(meta, flush=True)
    rows, failed = [], 0

    def write_json():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(meta=meta, rows=rows), f, indent=1)

    shapes = args.shape_list or (SHAPES[1:2] if args.quick else SHAPES)
    if args.host:
        rows = host_times(torch, numba_flash, getattr(torch, args.dtypes.split(",")[0]))
        write_json()
        return 0
    if args.pair:
        specs = [tile_spec(t) for t in args.pair.split(",") if t]
        for name in args.dtypes.split(","):
            rows += pair(torch, numba_flash, getattr(torch, name), shapes, args.repeats, specs, args.rounds)
        write_json()
        return 0
    extra = [tile_spec(t) for t in args.tiles.split(",") if t]
    if any(knobs.get("fp8") for _, _, knobs in extra) and not args.fp8:
        raise SystemExit("--tiles: an -fp8 entry needs --fp8 (the float8 inputs)")
    if args.fp8 and not args.no_check:
        checked = check_fp8(torch, numba_flash, args.watchdog, CASES[: args.cases])
        failed += sum(r["status"] != "ok" for r in checked)
        rows += checked
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        if args.mods:
            checked = check_mods(torch, numba_flash, dtype, args.watchdog)
            failed += sum(r["status"] != "ok" for r in checked)
            rows += checked
        if not args.no_check:
            checked = check(torch, numba_flash, dtype, args.watchdog, CASES[: args.cases])
            failed += sum(r["status"] != "ok" for r in checked)
            rows += checked
        if not args.no_bench:
            rows += bench(torch, numba_flash, dtype, shapes, args.repeats, extra, not args.no_variants, args.fp8)
    write_json()
    print(f"{failed} correctness failures", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
