"""Shared test helpers: random inputs, poisoned outputs, error measures and bounds, plain
float16, example counts that follow the Hypothesis profile."""

from __future__ import annotations

import math

import numpy as np

CI_EXAMPLES = 40  # max_examples of the "ci" profile (conftest.py): the scale of examples()
FLOAT32_UNIT_ROUNDOFF = 2.0**-24  # u: a float32 operation's relative rounding error is <= u


def examples(n: int) -> int:
    """``max_examples`` for a property test that is worth ``n`` examples in CI.

    An explicit ``@settings(max_examples=n)`` would override the profile; this scales ``n`` by
    the loaded profile's count over the "ci" profile's: ``n`` under "ci", 25 n under
    "thorough" (1000 / 40), never fewer than ``n``. Evaluated when the test module is
    imported, after conftest.py has loaded the profile.
    """
    from hypothesis import settings

    return max(n, round(n * settings.default.max_examples / CI_EXAMPLES))


def to_numpy(x) -> np.ndarray:
    if hasattr(x, "get"):
        return x.get()
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def random_qkv(rng, batch, heads, kv_heads, n_q, n_k, head_dim, dtype, xp=np, scale=1.0):
    """Fresh standard-normal q, k, v (never zeros), as ``xp`` arrays of ``dtype``."""
    shapes = ((batch, heads, n_q, head_dim), (batch, kv_heads, n_k, head_dim), (batch, kv_heads, n_k, head_dim))
    return tuple(xp.asarray((scale * rng.standard_normal(s)).astype(dtype)) for s in shapes)


def poisoned(xp, shape, dtype):
    """An output buffer full of NaN: any element a kernel forgets to write stays NaN."""
    out = xp.empty(shape, dtype=dtype)
    out[...] = np.nan
    return out


BACKWARD_DTYPES = {"float16": np.float16, "float32": np.float32}  # and "bfloat16" (ml_dtypes), below


def backward_problem(rng, B, H, Hkv, Nq, Nk, D, dtype, causal, scale=1.0):
    """A backward test's inputs: ``do, q, k, v`` of NumPy ``dtype`` (random normal, q times
    ``scale``) and the CUDA-core forward's ``o, lse``."""
    import ml_dtypes

    import numba_flash

    npdt = {**BACKWARD_DTYPES, "bfloat16": ml_dtypes.bfloat16}[dtype]
    q = (scale * rng.standard_normal((B, H, Nq, D))).astype(npdt)
    k = rng.standard_normal((B, Hkv, Nk, D)).astype(npdt)
    v = rng.standard_normal((B, Hkv, Nk, D)).astype(npdt)
    o, lse = numba_flash.attention(q, k, v, causal=causal, return_lse=True, precision="ieee")
    do = rng.standard_normal(o.shape).astype(npdt)
    return do, q, k, v, o, lse


def max_rel(got, ref) -> float:
    """Largest absolute error relative to the largest reference magnitude (gradients' rule)."""
    got = np.asarray(got).astype(np.float64)
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))


GRADIENT_FLOOR = 0.1  # share of a call's largest reference gradient that floors each gradient's scale


def gradient_error(got, ref, refs) -> float:
    """Largest absolute error of one gradient relative to its largest reference magnitude, or to
    ``GRADIENT_FLOOR`` times the largest among all of the call's reference gradients (``refs``:
    dq, dk, dv) when its own is smaller. A gradient that is exactly 0 in float64 (dq when every
    row sees at most one key: the softmax of one score is constant) comes back from the kernels
    as rounding noise (dP - D of two dot products summed in different orders), which no bound
    relative to 0 can hold; against the call's gradient scale that noise is ~1e-7."""
    got = np.asarray(got).astype(np.float64)
    scale = max(np.abs(ref).max(), GRADIENT_FLOOR * max(np.abs(r).max() for r in refs), 1e-30)
    return float(np.abs(got - ref).max() / scale)


def rel_err(got, ref) -> float:
    got = to_numpy(got).astype(np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(got - ref) / denom) if denom > 0 else float(np.linalg.norm(got))


def mask_of(causal):
    """A test's mask argument as a ``masking.MaskSpec``: the public ``causal`` flag (a bool), a
    window ``(left, right)``, or a ``MaskSpec``."""
    from numba_flash.masking import MaskSpec, mask_spec

    if isinstance(causal, MaskSpec):
        return causal
    if isinstance(causal, tuple):
        return MaskSpec(*causal)
    return mask_spec(bool(causal))


def visible_matrix(causal, n_q, n_k):
    """The (n_q, n_k) visibility of :func:`mask_of`'s mask; ``None`` for no mask."""
    spec = mask_of(causal)
    return None if spec.is_full else spec.matrix(n_q, n_k)


def score_rounding_bound(q, k, scale=None, causal=False):
    """Per query row, how far float32 rounding alone can move the scores (natural-log units).

    The kernels compute ``s_ij = sum_d (q_id * scale * log2 e) k_jd`` in float32 and then
    ``exp2(s_ij - m_i)``. Each of the ``D`` products and ``D - 1`` additions, the scaling of
    q and the subtraction of the row max rounds once (relative error <= u = 2^-24), so
    ``|s^_ij - s_ij| <= (D + 4) u scale sum_d |q_id| |k_jd|`` (Higham's dot-product bound,
    one u for the scaling, two for the log2 conversion and the max subtraction). Returns
    ``delta_i``, that bound's maximum over the keys row ``i`` sees: shape (B, H, Nq).
    It grows with the score magnitude: at scores ~1e4 it is ~1e-2, far above any constant
    tolerance fit for unit-sized scores.
    """
    q, k = (to_numpy(x).astype(np.float64) for x in (q, k))
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    k = np.repeat(k, H // k.shape[1], axis=1)
    scale = 1 / np.sqrt(D) if scale is None else scale
    mag = abs(scale) * np.einsum("bhid,bhjd->bhij", np.abs(q), np.abs(k))
    seen = visible_matrix(causal, Nq, Nk)
    if seen is not None:
        mag = np.where(seen, mag, 0.0)
    return (D + 4) * FLOAT32_UNIT_ROUNDOFF * mag.max(axis=-1, initial=0.0)


def output_rounding_bound(q, k, v, ref_o, scale=None, causal=False):
    """Per output element, the error that score rounding alone can cause in ``o``.

    With every score of row i off by at most ``delta_i`` (:func:`score_rounding_bound`), each
    softmax weight and the logsumexp move by a factor within ``exp(+-delta_i)``, so each
    normalised weight by a factor within ``exp(+-2 delta_i)``; since the weights sum to 1 in
    both, ``|o^_id - o_id| = |sum_j (w^_j - w_j)(v_jd - o_id)|
    <= (exp(2 delta_i) - 1) max_j |v_jd - o_id|`` over the keys the row sees.
    """
    q, k, v = (to_numpy(x).astype(np.float64) for x in (q, k, v))
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    v = np.repeat(v, H // v.shape[1], axis=1)
    delta = score_rounding_bound(q, k, scale, causal)
    spread = np.abs(v[:, :, None, :, :] - np.asarray(ref_o, np.float64)[:, :, :, None, :])  # (B,H,Nq,Nk,D)
    seen = visible_matrix(causal, Nq, Nk)
    if seen is not None:
        spread = np.where(seen[None, None, :, :, None], spread, 0.0)
    return np.expm1(2 * delta)[..., None] * spread.max(axis=3, initial=0.0)


def assert_equal_up_to_rounding(got, want, ref_o, allowed, rel):
    """``got`` and ``want`` (two float32 results) differ by at most ``allowed`` elementwise (the
    score-rounding bound, which grows with |score|) plus ``rel`` times ``|ref_o|``, norm-wise."""
    got, want = (to_numpy(x).astype(np.float64) for x in (got, want))
    excess = np.maximum(np.abs(got - want) - allowed, 0.0)
    ref_norm = float(np.linalg.norm(ref_o))
    assert float(np.linalg.norm(excess)) <= rel * ref_norm, (rel_err(got, want), float(np.asarray(allowed).max(initial=0)))


def lse_matches(lse, ref_lse, atol=1e-4, rtol=1e-5) -> bool:
    """Finite entries close, -inf exactly where the reference is -inf, no NaN."""
    lse = to_numpy(lse).astype(np.float64)
    return bool(np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))) and np.allclose(
        np.where(np.isneginf(lse), 0, lse), np.where(np.isneginf(ref_lse), 0, ref_lse), atol=atol, rtol=rtol
    )


def plain_fp16_attention(q, k, v, causal=False, scale=None, dtype=np.float16):
    """Attention as a plain float16 implementation does it (the FlashAttention baseline);
    ``dtype=ml_dtypes.bfloat16`` gives the plain bfloat16 one.

    Matmuls accumulate in float32 and round to float16 (as cuBLAS does); S, P, the
    softmax and O are float16 values. Its error against float64 sets the bar: a kernel
    passes when its own error is at most twice this one's.
    """
    q, k, v = (to_numpy(x).astype(dtype) for x in (q, k, v))
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    g = H // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    scale = 1 / np.sqrt(D) if scale is None else scale
    s = (np.einsum("bhid,bhjd->bhij", q.astype(np.float32), k.astype(np.float32)) * scale).astype(dtype)
    seen = visible_matrix(causal, Nq, Nk)
    if seen is not None:
        s = np.where(seen, s, np.asarray(-np.inf, dtype))
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, np.asarray(0, dtype))
    p = np.exp(s - m).astype(dtype)
    l = p.astype(np.float32).sum(axis=-1, keepdims=True)
    p = (p / np.where(l > 0, l, 1).astype(dtype)).astype(dtype)
    return np.einsum("bhij,bhjd->bhid", p.astype(np.float32), v.astype(np.float32)).astype(dtype)


def plain_fp8_attention(q, k, v, causal=False, scale=None):
    """Attention as a plain float8 (e4m3) implementation does it, on the dequantized inputs ``q``,
    ``k``, ``v`` (float64 values of e4m3 numbers times their descales): S from exact products
    accumulated in float32 (an fp8 GEMM's float32 output), the softmax in float32, the normalised
    P rounded to e4m3 (the operand of the second fp8 GEMM), O accumulated in float32 and rounded to
    bfloat16 (fa3's fp8 output). The bar of the fp8 tests: at most twice this one's error."""
    import ml_dtypes

    from numba_flash.kernels import e4m3

    q, k, v = (to_numpy(x).astype(np.float32) for x in (q, k, v))
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    g = H // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    scale = 1 / np.sqrt(D) if scale is None else scale
    s = np.einsum("bhid,bhjd->bhij", q, k) * np.float32(scale)
    seen = visible_matrix(causal, Nq, Nk)
    if seen is not None:
        s = np.where(seen, s, np.float32(-np.inf))
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0))
    l = p.sum(axis=-1, keepdims=True)
    p = e4m3.values_of(e4m3.bits_of(p / np.where(l > 0, l, 1))).astype(np.float32)
    return np.einsum("bhij,bhjd->bhid", p, v).astype(ml_dtypes.bfloat16)


def run_poisoned(xp, q, k, v, **kw):
    """``forward`` into NaN-poisoned buffers; the CUDA-core kernels unless ``precision`` is given
    (their tiles go down to one row; the tensor-core kernels have tests of their own)."""
    from numba_flash.api import forward

    kw.setdefault("precision", "ieee")
    B, H, Nq, D = q.shape
    o = poisoned(xp, (B, H, Nq, D), q.dtype)
    lse = poisoned(xp, (B, H, Nq), np.float32)
    return forward(q, k, v, out=o, lse_out=lse, **kw)


def check_against_reference(q, k, v, o, lse, causal, scale=None, oracle=None):
    """``o`` and ``lse`` against the float64 reference (or another float64 ``oracle``'s pair);
    ``causal``: the mask, as :func:`mask_of` takes it."""
    from numba_flash import reference

    if oracle is None:
        ref_o, ref_lse = reference.attention(to_numpy(q), to_numpy(k), to_numpy(v), scale=scale,
                                             window_size=mask_of(causal).window)
    else:
        ref_o, ref_lse = oracle
    o_np = to_numpy(o)
    assert not np.isnan(o_np).any(), "an output element was not written (or is NaN)"
    if q.dtype == np.float16:
        base = np.abs(plain_fp16_attention(q, k, v, causal, scale).astype(np.float64) - ref_o).max()
        err = np.abs(o_np.astype(np.float64) - ref_o).max()
        assert err <= 2 * base + 1e-6, f"float16 error {err:.3g} > 2 x plain float16 error {base:.3g}"
    else:
        # float32: rounding the scores alone moves o by up to output_rounding_bound, which grows
        # with the score magnitude (a constant fit for unit scores fails at scores ~1e4); what
        # the kernel gets wrong beyond that must stay within 2e-6 of the reference, norm-wise.
        allowed = output_rounding_bound(q, k, v, ref_o, scale, causal)
        excess = np.maximum(np.abs(o_np.astype(np.float64) - ref_o) - allowed, 0.0)
        ref_norm, excess_norm = float(np.linalg.norm(ref_o)), float(np.linalg.norm(excess))
        assert excess_norm <= 2e-6 * ref_norm, (rel_err(o_np, ref_o), excess_norm, float(allowed.max()))
    delta = score_rounding_bound(q, k, scale, causal)  # lse = m + log l moves by at most delta
    assert lse_matches(lse, ref_lse, atol=1e-4 + delta), (to_numpy(lse), ref_lse)


def ptxas_available() -> bool:
    """Whether kernels compile offline here (the ``occupancy`` extra: ptxas and libNVVM)."""
    try:
        from numba_flash.research.profiling.occupancy import find_ptxas

        find_ptxas()
        import nvidia.cu13  # noqa: F401  (libNVVM of numba-cuda[cu13])
    except Exception:
        return False
    return True


FD_STEP = 1e-5  # central differences: truncation ~ STEP^2, cancellation ~ 1e-16 |f| / STEP


def central_differences(f, *arrays, step: float = FD_STEP) -> tuple:
    """The gradient of the scalar ``f(*arrays)`` with respect to each array, by central
    differences one element at a time (float64 arrays; the callers' oracles are exact)."""
    grads = []
    for which in range(len(arrays)):
        args = [np.array(a, dtype=np.float64) for a in arrays]
        x = args[which]
        grad = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            saved = x[idx]
            x[idx] = saved + step
            up = f(*args)
            x[idx] = saved - step
            down = f(*args)
            x[idx] = saved
            grad[idx] = (up - down) / (2 * step)
        grads.append(grad)
    return tuple(grads)


SCRIPTS = __import__("pathlib").Path(__file__).resolve().parents[1] / "scripts"


def load_script(filename: str, module_name: str | None = None):
    """``scripts/<filename>`` imported as a module, registered in ``sys.modules`` (dataclasses
    look their module up while the file runs)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(module_name or f"{filename[:-3]}_script", SCRIPTS / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def script_module(filename: str, module_name: str | None = None):
    """:func:`load_script` for a module-scoped fixture: yields the module, then unregisters it."""
    import sys

    module = load_script(filename, module_name)
    yield module
    sys.modules.pop(module.__name__, None)


def torch_scores(q, k, causal, window_size=(-1, -1)):
    """Scaled scores of torch tensors in their dtype, K's heads repeated for GQA, keys hidden by
    the bottom-right causal mask and the window (FlashAttention's ``window_size``) at -inf: the
    GPU tests' reference attention starts here."""
    import torch

    g = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(g, dim=1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    left, right = window_size
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if left >= 0 or right >= 0:
        Nq, Nk = q.shape[2], k.shape[2]
        i = torch.arange(Nq, device=q.device)[:, None] + (Nk - Nq)
        j = torch.arange(Nk, device=q.device)[None, :]
        hidden = torch.zeros(Nq, Nk, dtype=torch.bool, device=q.device)
        if right >= 0:
            hidden |= j > i + right
        if left >= 0:
            hidden |= j < i - left
        s = s.masked_fill(hidden, -math.inf)
    return s


def torch_attention(q, k, v, causal, window_size=(-1, -1)):
    """softmax(scores) V of torch tensors in their dtype (rows that see no key: 0), autograd-ready."""
    import torch

    g = q.shape[1] // k.shape[1]
    scores = torch_scores(q, k, causal, window_size)
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v.repeat_interleave(g, dim=1)
