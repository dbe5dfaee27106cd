"""Shared test helpers: random inputs, poisoned outputs, error measures, plain float16."""

from __future__ import annotations

import numpy as np


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


def rel_err(got, ref) -> float:
    got = to_numpy(got).astype(np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(got - ref) / denom) if denom > 0 else float(np.linalg.norm(got))


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
    if causal:
        i, j = np.arange(Nq)[:, None], np.arange(Nk)[None, :]
        s = np.where(j <= i + (Nk - Nq), s, np.asarray(-np.inf, dtype))
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, np.asarray(0, dtype))
    p = np.exp(s - m).astype(dtype)
    l = p.astype(np.float32).sum(axis=-1, keepdims=True)
    p = (p / np.where(l > 0, l, 1).astype(dtype)).astype(dtype)
    return np.einsum("bhij,bhjd->bhid", p.astype(np.float32), v.astype(np.float32)).astype(dtype)
