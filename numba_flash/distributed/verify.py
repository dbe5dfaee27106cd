"""Is a gathered ring result right? Its error against float64 on a subset of rows, judged as the tests judge.

The oracle is plain attention in float64, computed one (batch, head) at a time for the rows
checked only, so that it fits at any length: the scores of ``r`` rows against ``N`` keys take
``8 r N`` bytes (512 rows of a 262 144-token sequence: 1 GB). Rows are spread over the whole
sequence (:func:`check_rows`), so every rank's shard and both chunks of a zigzag shard are
checked; a row's causal mask is its global one (key ``j`` visible to query ``i`` iff ``j <= i``).

The rules (``tests/gpu/test_gpu.py``, after FlashAttention's ``tests/test_flash_attn.py``):

- float32: relative (Frobenius) error against float64 below :data:`FLOAT32_REL_TOL`;
- float16: largest absolute error against float64 at most twice that of a plain float16
  implementation on the same rows (``tests/helpers.py``'s ``plain_fp16_attention``: products
  accumulated in float32 and rounded to float16, softmax in float16);
- logsumexp: within ``LSE_TOL * (1 + |lse|)`` of float64's.

Arrays: NumPy (the tests of this module), CuPy, or torch CUDA tensors (viewed as CuPy arrays through
DLPack, no copy; bfloat16 has no CuPy dtype and is refused). ``q`` is ``(B, H, N, D)``, ``k`` and
``v`` ``(B, Hkv, N, D)``, outputs ``(B, H, N, D)``, logsumexps ``(B, H, N)``.
"""

from __future__ import annotations

import math

from numba_flash.masking import CAUSAL

FLOAT32_REL_TOL = 1e-5
LSE_TOL = 1e-4
SMALL_HEAD_COUNT = 16  # up to this many (batch, head) pairs, check them all; else the four corners


def check_rows(seq: int, count: int) -> list[int]:
    """``count`` query rows spread evenly over ``0 .. seq - 1``, first and last included (every
    row when ``count >= seq``)."""
    if count >= seq:
        return list(range(seq))
    if count < 2:
        return [seq - 1]
    return sorted({round(i * (seq - 1) / (count - 1)) for i in range(count)})


def check_heads(batch: int, heads: int) -> list[tuple[int, int]]:
    """The (batch, head) pairs checked: all of them when few, else the four corners (the first and
    last head meet the first and last K/V head under GQA)."""
    if batch * heads <= SMALL_HEAD_COUNT:
        return [(b, h) for b in range(batch) for h in range(heads)]
    return sorted({(0, 0), (0, heads - 1), (batch - 1, 0), (batch - 1, heads - 1)})


def scope_label(seq: int, rows: list[int], pairs: list[tuple[int, int]], batch: int, heads: int) -> str:
    """Words for the part checked, e.g. ``512 of 262144 rows (evenly spaced), 4 of 64 (batch, head) pairs``."""
    row_part = "every row" if len(rows) == seq else f"{len(rows)} of {seq} rows (evenly spaced)"
    head_part = "every head" if len(pairs) == batch * heads else f"{len(pairs)} of {batch * heads} (batch, head) pairs"
    return f"{row_part}, {head_part}"


def errors_against_float64(outputs: dict, q, k, v, causal: bool, rows: list[int], pairs, scale=None) -> dict:
    """For each named output ``(o, lse)`` (``lse`` may be ``None``) in ``outputs``, its error against
    float64 on ``rows`` of the ``pairs``: ``{name: {"max_abs", "rel", "lse_max_abs", "lse_ok"}}``,
    plus ``"plain"``: ``{"max_abs"}`` of a plain float16 implementation (float16 inputs; ``None``
    for float32)."""
    xp = _array_module(q)
    q, k, v = (_as_array(x) for x in (q, k, v))
    outputs = {name: (_as_array(o), None if lse is None else _as_array(lse)) for name, (o, lse) in outputs.items()}
    with _on_device(q):
        return _errors(xp, outputs, q, k, v, causal, rows, pairs, scale)


def _errors(xp, outputs, q, k, v, causal, rows, pairs, scale) -> dict:
    B, H, N, D = (int(n) for n in q.shape)
    group = H // int(k.shape[1])
    scale = 1 / math.sqrt(D) if scale is None else scale
    index = xp.asarray(rows)
    visible = CAUSAL.visible(index[:, None], xp.arange(N)[None, :], N, N) if causal else None  # the global mask
    sums = {name: dict(diff2=0.0, ref2=0.0, max_abs=0.0, lse_max_abs=0.0, lse_ok=True) for name in outputs}
    plain_max = 0.0
    half = q.dtype == xp.float16
    for b, h in pairs:
        q_rows, k_h, v_h = q[b, h][index], k[b, h // group], v[b, h // group]
        ref_o, ref_lse = _attention_rows(xp, *(x.astype(xp.float64) for x in (q_rows, k_h, v_h)), scale, visible)
        for name, (o, lse) in outputs.items():
            s = sums[name]
            diff = o[b, h][index].astype(xp.float64) - ref_o
            s["diff2"] += float((diff * diff).sum())
            s["ref2"] += float((ref_o * ref_o).sum())
            s["max_abs"] = max(s["max_abs"], float(abs(diff).max()))
            if lse is not None:
                lse_err = abs(lse[b, h][index].astype(xp.float64) - ref_lse)
                s["lse_max_abs"] = max(s["lse_max_abs"], float(lse_err.max()))
                s["lse_ok"] = s["lse_ok"] and bool((lse_err <= LSE_TOL * (1 + abs(ref_lse))).all())
        if half:
            plain = plain_rows(xp, q_rows, k_h, v_h, scale, visible)
            plain_max = max(plain_max, float(abs(plain.astype(xp.float64) - ref_o).max()))
    result = {name: dict(max_abs=s["max_abs"], rel=math.sqrt(s["diff2"] / max(s["ref2"], 1e-300)),
                         lse_max_abs=s["lse_max_abs"] if outputs[name][1] is not None else None,
                         lse_ok=s["lse_ok"]) for name, s in sums.items()}
    result["plain"] = dict(max_abs=plain_max) if half else None
    return result


def passes(errors: dict, name: str, dtype: str) -> tuple[bool, str]:
    """Whether ``errors[name]`` (:func:`errors_against_float64`) meets the dtype's rule, and the
    rule with its figures in words."""
    e = errors[name]
    if dtype == "float32":
        ok = e["rel"] < FLOAT32_REL_TOL
        rule = f"relative error {e['rel']:.2e} {'<' if ok else '>='} {FLOAT32_REL_TOL:g}"
    else:
        plain = errors["plain"]["max_abs"]
        ok = e["max_abs"] <= 2 * plain
        rule = f"max |o - float64| {e['max_abs']:.3e} {'<=' if ok else '>'} 2 x plain {dtype}'s {plain:.3e}"
    if e["lse_max_abs"] is not None:
        ok = ok and e["lse_ok"]
        rule += f"; lse within {LSE_TOL:g} (1 + |lse|) of float64: {'yes' if e['lse_ok'] else 'no'} (max {e['lse_max_abs']:.1e})"
    return bool(ok), rule


def relative_error(a, b) -> float:
    """``||a - b|| / ||b||`` (Frobenius) of two ``(B, H, N, D)`` arrays, in float64, one (batch, head)
    at a time (no float64 copy of a whole large output)."""
    xp = _array_module(a)
    a, b = _as_array(a), _as_array(b)
    diff2 = ref2 = 0.0
    with _on_device(a):
        for x, y in zip(a.reshape((-1,) + tuple(a.shape[2:])), b.reshape((-1,) + tuple(b.shape[2:]))):
            x, y = x.astype(xp.float64), y.astype(xp.float64)
            diff2 += float(((x - y) ** 2).sum())
            ref2 += float((y * y).sum())
    return math.sqrt(diff2 / max(ref2, 1e-300))


def plain_rows(xp, q, k, v, scale, visible):
    """Rows ``q`` (``(r, D)``) of a plain float16 attention against ``k``, ``v`` (``(N, D)``):
    ``tests/helpers.py``'s ``plain_fp16_attention`` for these rows (``visible``: ``(r, N)``
    booleans, or ``None``)."""
    f16, f32 = xp.float16, xp.float32
    s = ((q.astype(f32) @ k.astype(f32).T) * scale).astype(f16)
    if visible is not None:
        s = xp.where(visible, s, xp.asarray(-xp.inf, dtype=f16))
    m = s.max(axis=-1, keepdims=True)
    m = xp.where(xp.isfinite(m), m, xp.asarray(0, dtype=f16))
    p = xp.exp(s - m).astype(f16)
    l = p.astype(f32).sum(axis=-1, keepdims=True)
    p = (p / xp.where(l > 0, l, 1).astype(f16)).astype(f16)
    return (p.astype(f32) @ v.astype(f32)).astype(f16)


def _attention_rows(xp, q, k, v, scale, visible):
    """``(o, lse)`` of rows ``q`` (``(r, D)``) against ``k``, ``v`` (``(N, D)``), float64; every row
    sees at least one key."""
    s = (q @ k.T) * scale
    if visible is not None:
        s = xp.where(visible, s, -xp.inf)
    m = s.max(axis=-1, keepdims=True)
    lse = m + xp.log(xp.exp(s - m).sum(axis=-1, keepdims=True))
    return xp.exp(s - lse) @ v, lse[:, 0]


def _library(x) -> str:
    return type(x).__module__.split(".")[0]


def _array_module(x):
    if _library(x) == "numpy":
        import numpy

        return numpy
    import cupy

    return cupy


def _on_device(x):
    """A context in which a CuPy array's GPU is CuPy's current device (nothing for NumPy)."""
    if _library(x) == "numpy":
        import contextlib

        return contextlib.nullcontext()
    import cupy

    return cupy.cuda.Device(x.device.id)


def _as_array(x):
    """``x`` as a NumPy or CuPy array (a torch CUDA tensor through DLPack, no copy)."""
    if _library(x) != "torch":
        return x
    if str(x.dtype) == "torch.bfloat16":
        raise ValueError("the float64 check reads arrays as CuPy arrays, which have no bfloat16; "
                         "check float16 or float32 runs")
    import cupy

    return cupy.from_dlpack(x.detach())
