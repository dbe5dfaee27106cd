"""The float64 oracle: attention with the whole score matrix S materialised.

:func:`attention` is the forward pass, :func:`attention_backward` its exact gradients
(the backward kernels' oracle). Written without :mod:`numba_flash.online` on purpose (a
plain softmax over the masked rows of S, not a running one), so that it can check the
online algebra as well as the kernels. Slow and memory-hungry (``O(B H Nq Nk)``): it is
for tests and small problems.
"""

from __future__ import annotations

import math

import numpy as np

from numba_flash.masking import mask_spec

__all__ = ["attention", "attention_backward"]


def to_numpy(x, name: str) -> np.ndarray:
    """Any array-like as a float64 NumPy array, copying GPU arrays to the host.

    Duck-typed so that neither CuPy nor PyTorch has to be installed: an object with
    ``__cuda_array_interface__`` is fetched with ``get()`` (CuPy) or ``copy_to_host()``
    (Numba device arrays); a PyTorch tensor (``detach``/``cpu``/``double``/``numpy``
    methods) with ``detach().cpu()``, in float64 so that bfloat16 converts too. NumPy arrays of
    ml_dtypes' types (bfloat16, as ``numba_flash.attention`` takes them) are real numbers too.
    """
    # A torch tensor first: a CUDA tensor also has __cuda_array_interface__ (one that
    # requires grad raises on it), but neither get() nor copy_to_host().
    if all(callable(getattr(x, attr, None)) for attr in ("detach", "cpu", "numpy", "double")):
        x = x.detach().cpu().double().numpy()
    elif hasattr(x, "__cuda_array_interface__"):
        fetch = getattr(x, "get", None) or getattr(x, "copy_to_host", None)
        if callable(fetch):
            x = fetch()
    arr = np.asarray(x)
    if arr.dtype.kind not in "biuf" and arr.dtype.type.__module__ != "ml_dtypes":
        raise TypeError(f"{name} must hold real numbers, got dtype {arr.dtype}")
    return arr.astype(np.float64, copy=False)


def _check_shapes(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    """ValueError naming the argument unless q (B,H,Nq,D), k = v (B,Hkv,Nk,D), H % Hkv == 0."""
    for name, arr, layout in (
        ("q", q, "(batch, heads, seq_q, head_dim)"),
        ("k", k, "(batch, kv_heads, seq_k, head_dim)"),
        ("v", v, "(batch, kv_heads, seq_k, head_dim)"),
    ):
        if arr.ndim != 4:
            raise ValueError(f"{name} must be 4-D with shape {layout}, got shape {arr.shape}")
    batch, heads, _, head_dim = q.shape
    if k.shape[0] != batch:
        raise ValueError(f"k must have q's batch size {batch}, got shape {k.shape}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k must have q's head_dim {head_dim}, got shape {k.shape}")
    if head_dim < 1:
        raise ValueError(f"q must have head_dim >= 1, got shape {q.shape}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {k.shape}, got {v.shape}")
    kv_heads = k.shape[1]
    if kv_heads < 1 or heads % kv_heads != 0:
        raise ValueError(
            f"k has {kv_heads} kv heads; q's {heads} heads must be a positive multiple of it"
        )


def attention(q, k, v, causal: bool = False, scale: float | None = None):
    """Exact softmax attention in float64, returning ``(o, lse)``.

    Parameters
    ----------
    q : array_like, shape (B, H, Nq, D)
    k, v : array_like, shape (B, Hkv, Nk, D), with ``H % Hkv == 0``
        Query head ``h`` reads kv head ``h // (H // Hkv)`` (grouped-query attention).
        Anything ``np.asarray`` converts works, as do CuPy arrays and PyTorch tensors
        (copied to the host). Inputs are never modified.
    causal : bool
        Bottom-right aligned mask (FlashAttention >= 2.1): query ``i`` sees key ``j``
        iff ``j <= i + (Nk - Nq)``. For Nq = 2, Nk = 4 (``x`` = seen)::

            x x x .
            x x x x

        and for Nq = 4, Nk = 2 the first two rows see nothing::

            . .
            . .
            x .
            x x
    scale : float, optional
        Multiplies ``q @ k^T``; defaults to ``1 / sqrt(D)``.

    Returns
    -------
    o : ndarray float64, shape (B, H, Nq, D)
        ``softmax(scale q k^T, masked) @ v``; 0 for a row that sees no key (also Nk = 0).
    lse : ndarray float64, shape (B, H, Nq)
        Natural-log logsumexp of each row's seen scaled scores; ``-inf`` when none.

    A score of ``-inf`` masks its key (it contributes nothing, even a NaN value); NaN
    in ``q``/``k`` makes the rows whose scores it reaches NaN, NaN in ``v[.., j, d]`` makes
    ``o[.., i, d]`` NaN for the rows ``i`` that see key ``j``. No RuntimeWarning is emitted.
    """
    q = to_numpy(q, "q")
    k = to_numpy(k, "k")
    v = to_numpy(v, "v")
    _check_shapes(q, k, v)
    batch, heads, n_q, head_dim = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)

    # Grouped layout: query head h = g * group + r reads kv head g (= h // group);
    # k and v broadcast over the group axis r instead of being repeated.
    q5 = q.reshape(batch, kv_heads, group, n_q, head_dim)
    k5 = k[:, :, None]
    v5 = v[:, :, None]

    with np.errstate(invalid="ignore", over="ignore"):
        s = (q5 @ k5.swapaxes(-1, -2)) * scale  # (B, Hkv, group, Nq, Nk), materialised
        mask = mask_spec(causal)
        if not mask.is_full:
            s = np.where(mask.matrix(n_q, n_k), s, -np.inf)
        o, lse = _masked_softmax_times_v(s, v5)
    return o.reshape(batch, heads, n_q, head_dim), lse.reshape(batch, heads, n_q)


def attention_backward(do, q, k, v, causal: bool = False, scale: float | None = None):
    """Exact gradients of :func:`attention`'s ``o`` in float64, returning ``(dq, dk, dv)``.

    ``dq, dk, dv`` are the gradients of ``sum(do * o)`` with respect to ``q, k, v``, where
    ``o = attention(q, k, v, causal, scale)[0]``; the arguments are as there, and ``do``
    (the incoming gradient of ``o``) has ``q``'s shape (B, H, Nq, D) and is converted the
    same way. With S = scale Q K^T (masked entries -inf) and P = softmax(S) row by row::

        dV  = P^T dO
        dP  = dO V^T
        D_i = rowsum(P_i * dP_i)       (= rowsum(dO_i * O_i), FlashAttention-2's D)
        dS  = P * (dP - D)
        dQ  = scale dS K
        dK  = scale dS^T Q

    Grouped-query attention: ``dk`` and ``dv`` of kv head ``g`` sum the contributions of
    its query heads ``g * group .. (g + 1) * group - 1``. A row that sees no key (causal
    with Nq > Nk, or Nk = 0) has ``dq = 0`` and adds exactly nothing to ``dk``/``dv``
    (no NaN, whatever its ``do``); masked keys get exactly zero weight.

    Returns
    -------
    dq : ndarray float64, shape (B, H, Nq, D)
    dk, dv : ndarray float64, shape (B, Hkv, Nk, D)
    """
    do = to_numpy(do, "do")
    q = to_numpy(q, "q")
    k = to_numpy(k, "k")
    v = to_numpy(v, "v")
    _check_shapes(q, k, v)
    if do.shape != q.shape:
        raise ValueError(f"do must have the shape of q {q.shape}, got {do.shape}")
    batch, heads, n_q, head_dim = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)

    # The forward's grouped layout: (B, Hkv, group, N, D), k and v broadcast over group.
    q5 = q.reshape(batch, kv_heads, group, n_q, head_dim)
    do5 = do.reshape(batch, kv_heads, group, n_q, head_dim)
    k5 = k[:, :, None]
    v5 = v[:, :, None]

    with np.errstate(invalid="ignore", over="ignore"):
        s = (q5 @ k5.swapaxes(-1, -2)) * scale  # (B, Hkv, group, Nq, Nk)
        mask = mask_spec(causal)
        if not mask.is_full:
            s = np.where(mask.matrix(n_q, n_k), s, -np.inf)
        p, unmasked = _masked_softmax(s)
        dv = (p.swapaxes(-1, -2) @ do5).sum(axis=2)  # dV = P^T dO, summed over the group
        dp = do5 @ v5.swapaxes(-1, -2)  # dP = dO V^T
        # dS = P * (dP - D); masked entries exactly 0 even where dP is not finite
        d_row = np.where(unmasked, p * dp, 0.0).sum(axis=-1, keepdims=True)
        ds = np.where(unmasked, p * (dp - d_row), 0.0)
        dq = scale * (ds @ k5)  # dQ = scale dS K
        dk = scale * (ds.swapaxes(-1, -2) @ q5).sum(axis=2)  # dK = scale dS^T Q, over the group
    return dq.reshape(batch, heads, n_q, head_dim), dk, dv


def _masked_softmax(s: np.ndarray):
    """``(softmax(s), s != -inf)`` over the last axis, ``-inf`` = masked.

    Masked entries of P are exactly 0; a row whose scores are all ``-inf`` (or empty) is all
    zeros (never ``0 / 0``).
    """
    m = np.max(s, axis=-1, initial=-np.inf, keepdims=True)
    unmasked = s != -np.inf
    shifted = np.full(s.shape, -np.inf)
    np.subtract(s, m, out=shifted, where=unmasked)
    p = np.exp(shifted)
    l = p.sum(axis=-1, keepdims=True)  # noqa: E741
    np.divide(p, l, out=p, where=m != -np.inf)  # empty rows: p is already all 0
    return p, unmasked


def _masked_softmax_times_v(s: np.ndarray, v: np.ndarray):
    """``(softmax(s) @ v, logsumexp(s))`` over the last axis of ``s``, ``-inf`` = masked.

    Rows whose scores are all ``-inf`` (or empty) give ``o = 0``, ``lse = -inf``; the
    ``-inf - -inf`` and ``0 / 0`` such rows would produce are never evaluated.
    """
    m = np.max(s, axis=-1, initial=-np.inf, keepdims=True)  # np.max keeps NaN
    unmasked = s != -np.inf
    shifted = np.full(s.shape, -np.inf)
    np.subtract(s, m, out=shifted, where=unmasked)
    p = np.exp(shifted)  # masked entries: exactly 0
    l = p.sum(axis=-1, keepdims=True)  # noqa: E741
    num = _sum_over_seen_keys(p, unmasked, v)

    empty = m == -np.inf  # NaN rows are not empty: they stay NaN
    o = np.zeros(num.shape)
    np.divide(num, l, out=o, where=~empty)
    lse = np.full(m.shape, -np.inf)
    np.add(m, np.log(l, out=np.zeros(l.shape), where=~empty), out=lse, where=~empty)
    return o, lse[..., 0]


def _sum_over_seen_keys(p: np.ndarray, unmasked: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``sum_j p_ij v_j`` over the unmasked keys ``j`` of each row ``i``.

    ``p @ v`` is exact when ``v`` is finite (a masked key adds ``0 * v_j = 0``); a NaN or
    infinite value would turn that 0 into NaN, so then the masked keys are dropped
    explicitly, one query row at a time to keep the memory at ``O(Nk D)`` per row.
    """
    if np.isfinite(v).all():
        return p @ v
    num = np.empty(np.broadcast_shapes(p.shape[:-1], v.shape[:-2] + (1,)) + v.shape[-1:])
    for i in range(p.shape[-2]):
        terms = p[..., i, :, None] * v  # (..., Nk, D)
        num[..., i, :] = np.where(unmasked[..., i, :, None], terms, 0.0).sum(axis=-2)
    return num
