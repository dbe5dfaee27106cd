"""The float64 oracle: attention with the whole score matrix S materialised.

:func:`attention` is the forward pass, :func:`attention_backward` its exact gradients
(the backward kernels' oracle), both with every mask and score modification of API.md
section 2c (window, softcap, ALiBi, ``mask_mod``, ``score_mod``). :func:`attention_varlen`, its
backward and :func:`decode` (API.md 2d-2e: packed variable-length batches, contiguous or paged KV
caches with appended keys) run them one sequence at a time. Written without
:mod:`numba_flash.online` on purpose (a plain softmax over the masked rows of S, not a running
one), so that it can check the online algebra as well as the kernels. Slow and memory-hungry
(``O(B H Nq Nk)``): it is for tests and small problems.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from numba_flash.checks import integer_array, paged_cache, sequence_bounds, softcap_value, whole_number
from numba_flash.masking import MaskSpec, evaluate_mask_mod, window_spec

__all__ = ["attention", "attention_backward", "attention_varlen", "attention_backward_varlen", "decode"]


def to_numpy(x, name: str) -> np.ndarray:
    """Any array-like as a float64 NumPy array, copying GPU arrays to the host.

    Duck-typed so that neither CuPy nor PyTorch has to be installed: an object with
    ``__cuda_array_interface__`` is fetched with ``get()`` (CuPy) or ``copy_to_host()``
    (Numba device arrays); a PyTorch tensor (``detach``/``cpu``/``double``/``numpy``
    methods) with ``detach().cpu()``, in float64 so that bfloat16 converts too. NumPy arrays of
    ml_dtypes' types (bfloat16, as ``numba_flash.attention`` takes them) are real numbers too.
    """
    arr = np.asarray(_on_host(x, double=True))
    if arr.dtype.kind not in "biuf" and arr.dtype.type.__module__ != "ml_dtypes":
        raise TypeError(f"{name} must hold real numbers, got dtype {arr.dtype}")
    return arr.astype(np.float64, copy=False)


def _on_host(x, double: bool = False):
    """``x`` fetched to the host when it is a GPU array or a PyTorch tensor (in float64 when
    ``double``), else ``x`` itself."""
    # A torch tensor first: a CUDA tensor also has __cuda_array_interface__ (one that
    # requires grad raises on it), but neither get() nor copy_to_host().
    if all(callable(getattr(x, attr, None)) for attr in ("detach", "cpu", "numpy", "double")):
        x = x.detach().cpu()
        return (x.double() if double else x).numpy()
    if hasattr(x, "__cuda_array_interface__"):
        fetch = getattr(x, "get", None) or getattr(x, "copy_to_host", None)
        if callable(fetch):
            return fetch()
    return x


def _check_shapes(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    """ValueError naming the argument unless q (B,H,Nq,D), k (B,Hkv,Nk,D), v (B,Hkv,Nk,Dv),
    H % Hkv == 0, D >= 1 and Dv >= 1."""
    for name, arr, layout in (
        ("q", q, "(batch, heads, seq_q, head_dim)"),
        ("k", k, "(batch, kv_heads, seq_k, head_dim)"),
        ("v", v, "(batch, kv_heads, seq_k, v_head_dim)"),
    ):
        if arr.ndim != 4:
            raise ValueError(f"{name} must be 4-D with shape {layout}, got shape {arr.shape}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k must have q's batch size {q.shape[0]}, got shape {k.shape}")
    if v.shape[:3:2] != k.shape[:3:2]:
        raise ValueError(
            f"v must have the shape of k {k.shape} but for its head_dim (batch and seq_k equal), got {v.shape}"
        )
    _check_heads(q.shape[1::2], k.shape[1::2], v.shape[1::2], ("q", "k", "v"))


def attention(
    q,
    k,
    v,
    causal: bool = False,
    scale: float | None = None,
    *,
    window_size=(-1, -1),
    softcap: float = 0.0,
    alibi_slopes=None,
    mask_mod=None,
    score_mod=None,
    mod_args=(),
):
    """Exact softmax attention in float64, returning ``(o, lse)``.

    Parameters
    ----------
    q : array_like, shape (B, H, Nq, D)
    k : array_like, shape (B, Hkv, Nk, D), with ``H % Hkv == 0``
    v : array_like, shape (B, Hkv, Nk, Dv)
        Query head ``h`` reads kv head ``h // (H // Hkv)`` (grouped-query attention). Any head
        dims ``D, Dv >= 1`` (API.md 2e; ``Dv`` may differ from ``D``).
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

    The masks and score modifications of API.md section 2c, keyword-only:

    window_size : (int, int)
        ``(left, right)``: query ``i`` sees key ``j`` iff
        ``i + (Nk - Nq) - left <= j <= i + (Nk - Nq) + right`` (bottom-right aligned; ``-1``
        unbounded on that side; ``causal=True`` is ``right = 0``, and with a window the two
        intersect: :class:`numba_flash.masking.MaskSpec`).
    softcap : float
        ``> 0``: each scaled score ``s`` becomes ``softcap * tanh(s / softcap)``; 0: off.
    alibi_slopes : array_like, shape (H,) or (B, H), optional
        The score of query ``i``, key ``j`` gains ``-slope * |i + (Nk - Nq) - j|`` (the slope
        of its batch and query head). Float32 in the kernels; any real dtype here.
    mask_mod : callable, optional
        ``mask_mod(b, h, q_idx, kv_idx, *mod_args) -> bool``, True: visible (FlexAttention's
        signature; ``h`` is the query head).
    score_mod : callable, optional
        ``score_mod(score, b, h, q_idx, kv_idx, *mod_args) -> float``; ``score`` is the scaled
        score after softcap and ALiBi.
    mod_args : tuple of arrays
        Passed as trailing arguments to both mods, read-only (NumPy views that refuse writes;
        GPU arrays and tensors are copied to the host first).

    Each score is, in this order: ``scale q.k``, softcap, + ALiBi bias, ``score_mod``, then
    the masks (causal, window, ``mask_mod``): a key is seen when every mask given says so.

    The mods are plain Python functions (a numba device function is called through its
    ``py_func``). Each is first called once with broadcast int64 NumPy index arrays (``b``
    of shape (B, 1, 1, 1), ``h`` (1, H, 1, 1), ``q_idx`` (1, 1, Nq, 1), ``kv_idx``
    (1, 1, 1, Nk); ``score`` (B, H, Nq, Nk) float64): a mod written with ``+``, ``<``, ``&``,
    ``np.where`` or indexing into ``mod_args`` works on arrays and costs one call. If that
    call raises (``if``/``and``/``max``/``math.*`` on an array), or its result is not of a
    shape that broadcasts to (B, H, Nq, Nk) (a bool or number for ``mask_mod``, a number for
    ``score_mod``), the mod is called elementwise with Python ``int`` indices and a Python
    ``float`` score, one call per (b, h, q_idx, kv_idx) (``score_mod``: per visible one).

    Returns
    -------
    o : ndarray float64, shape (B, H, Nq, Dv)
        ``softmax(scores, masked) @ v``; 0 for a row that sees no key (also Nk = 0).
    lse : ndarray float64, shape (B, H, Nq)
        Natural-log logsumexp of each row's seen (modified) scores; ``-inf`` when none.

    A score of ``-inf`` masks its key (it contributes nothing, even a NaN value); NaN
    in ``q``/``k`` makes the rows whose scores it reaches NaN, NaN in ``v[.., j, d]`` makes
    ``o[.., i, d]`` NaN for the rows ``i`` that see key ``j``. No RuntimeWarning is emitted.
    """
    q = to_numpy(q, "q")
    k = to_numpy(k, "k")
    v = to_numpy(v, "v")
    _check_shapes(q, k, v)
    mods = _modifications(
        q.shape, causal, window_size, softcap, alibi_slopes, mask_mod, score_mod, mod_args
    )
    batch, heads, n_q, head_dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)

    # Grouped layout: query head h = g * group + r reads kv head g (= h // group);
    # k and v broadcast over the group axis r instead of being repeated.
    q5 = q.reshape(batch, kv_heads, group, n_q, head_dim)
    k5 = k[:, :, None]
    v5 = v[:, :, None]

    with np.errstate(invalid="ignore", over="ignore"):
        s, _ = _scores(q5, k5, scale, mods, gradient=False)  # (B, Hkv, group, Nq, Nk)
        o, lse = _masked_softmax_times_v(s, v5)
    return o.reshape(batch, heads, n_q, v.shape[3]), lse.reshape(batch, heads, n_q)


def attention_backward(
    do,
    q,
    k,
    v,
    causal: bool = False,
    scale: float | None = None,
    *,
    window_size=(-1, -1),
    softcap: float = 0.0,
    alibi_slopes=None,
    mask_mod=None,
    score_mod=None,
    mod_args=(),
    score_mod_grad=None,
):
    """Exact gradients of :func:`attention`'s ``o`` in float64, returning ``(dq, dk, dv)``.

    ``dq, dk, dv`` are the gradients of ``sum(do * o)`` with respect to ``q, k, v``, where
    ``o = attention(q, k, v, causal, scale, ...)[0]``; the arguments are as there, and ``do``
    (the incoming gradient of ``o``) has ``o``'s shape (B, H, Nq, Dv) and is converted the
    same way. With X = scale Q K^T, S = f(X) the modified scores (masked entries -inf) and
    P = softmax(S) row by row::

        dV  = P^T dO
        dP  = dO V^T
        D_i = rowsum(P_i * dP_i)       (= rowsum(dO_i * O_i), FlashAttention-2's D)
        dS  = P * (dP - D)
        dX  = dS * f'(X)
        dQ  = scale dX K
        dK  = scale dX^T Q

    ``f'`` is the chain of the modifications: softcap's ``1 - tanh(x / softcap)^2``, ALiBi's 1
    (a constant bias), and ``score_mod_grad`` at ``score_mod``'s input; masks contribute
    nothing (their entries have ``P = 0`` and get ``dX = 0`` exactly).

    score_mod_grad : callable, optional
        ``score_mod_grad(score, b, h, q_idx, kv_idx, *mod_args) -> float``, d score_mod /
        d score, called as ``score_mod`` is (vectorised first, else elementwise). Required
        with ``score_mod`` (``ValueError`` naming it otherwise); only with it.

    Grouped-query attention: ``dk`` and ``dv`` of kv head ``g`` sum the contributions of
    its query heads ``g * group .. (g + 1) * group - 1``. A row that sees no key (causal
    with Nq > Nk, a window or mask that hides every key, or Nk = 0) has ``dq = 0`` and adds
    exactly nothing to ``dk``/``dv`` (no NaN, whatever its ``do``); masked keys get exactly
    zero weight.

    Returns
    -------
    dq : ndarray float64, shape (B, H, Nq, D)
    dk : ndarray float64, shape (B, Hkv, Nk, D)
    dv : ndarray float64, shape (B, Hkv, Nk, Dv)
    """
    do = to_numpy(do, "do")
    q = to_numpy(q, "q")
    k = to_numpy(k, "k")
    v = to_numpy(v, "v")
    _check_shapes(q, k, v)
    if do.shape != q.shape[:3] + v.shape[3:]:
        raise ValueError(
            f"do must have the shape of q {q.shape} with v's head_dim (o's shape "
            f"{q.shape[:3] + v.shape[3:]}), got {do.shape}"
        )
    mods = _modifications(
        q.shape, causal, window_size, softcap, alibi_slopes, mask_mod, score_mod, mod_args
    )
    if score_mod is not None and score_mod_grad is None:
        raise ValueError(
            "score_mod_grad is required with score_mod: the backward needs d score_mod / d score, "
            "a function with score_mod's signature"
        )
    if score_mod_grad is not None:
        if score_mod is None:
            raise ValueError("score_mod_grad was given without score_mod")
        mods = replace(mods, score_mod_grad=_callable(score_mod_grad, "score_mod_grad"))
    batch, heads, n_q, head_dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)

    # The forward's grouped layout: (B, Hkv, group, N, D), k and v broadcast over group.
    q5 = q.reshape(batch, kv_heads, group, n_q, head_dim)
    do5 = do.reshape(batch, kv_heads, group, n_q, v.shape[3])
    k5 = k[:, :, None]
    v5 = v[:, :, None]

    with np.errstate(invalid="ignore", over="ignore"):
        s, chain = _scores(q5, k5, scale, mods, gradient=True)  # (B, Hkv, group, Nq, Nk)
        p, unmasked = _masked_softmax(s)
        dv = (p.swapaxes(-1, -2) @ do5).sum(axis=2)  # dV = P^T dO, summed over the group
        dp = do5 @ v5.swapaxes(-1, -2)  # dP = dO V^T
        # dS = P * (dP - D); masked entries exactly 0 even where dP is not finite
        d_row = np.where(unmasked, p * dp, 0.0).sum(axis=-1, keepdims=True)
        ds = np.where(unmasked, p * (dp - d_row), 0.0)
        if chain is not None:  # dX = dS * f'(X), masked entries still exactly 0
            ds = np.where(unmasked, ds * chain, 0.0)
        dq = scale * (ds @ k5)  # dQ = scale dX K
        dk = scale * (ds.swapaxes(-1, -2) @ q5).sum(axis=2)  # dK = scale dX^T Q, over the group
    return dq.reshape(batch, heads, n_q, head_dim), dk, dv


# --------------------------------------------------------------------------- variable lengths


def attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    causal: bool = False,
    scale: float | None = None,
    window_size=(-1, -1),
    softcap: float = 0.0,
    alibi_slopes=None,
):
    """Attention over a packed batch of sequences of their own lengths (API.md 2d), ``(o, lse)``.

    FlashAttention's ``flash_attn_varlen_func`` semantics: the sequences of a batch of ``B`` are
    stored one after the other, sequence ``b`` being rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``
    of ``q`` and ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of ``k`` and ``v``; it attends only to
    its own keys, exactly as :func:`attention` on that sequence alone (one call per sequence,
    no padding), so ``causal``, ``window_size`` and ALiBi are aligned bottom-right per
    sequence (``offset = Nk_b - Nq_b``).

    Parameters
    ----------
    q : array_like, shape (total_q, H, D)
    k : array_like, shape (total_k, Hkv, D), with ``H % Hkv == 0``
    v : array_like, shape (total_k, Hkv, Dv)
    cu_seqlens_q, cu_seqlens_k : integer array_like, shape (B + 1,)
        Prefix sums of the lengths (int32 in the kernels; any integer dtype here): start at 0,
        never decrease, end at ``total_q`` / ``total_k``. Lengths 0 and 1 are allowed (a
        sequence with no keys gives ``o = 0``, ``lse = -inf``; one with no queries, nothing).
    max_seqlen_q, max_seqlen_k : int
        At least the longest length (the kernels size their grid by them); larger is allowed.
    causal, scale, window_size, softcap :
        As in :func:`attention`, per sequence.
    alibi_slopes : array_like, shape (H,) or (B, H), optional
        Row ``b`` for sequence ``b``.

    Returns
    -------
    o : ndarray float64, shape (total_q, H, Dv)
    lse : ndarray float64, shape (H, total_q)
        FlashAttention's varlen layout (heads first).
    """
    q, k, v = _packed(q, k, v)
    _modifications((0, q.shape[1]), causal, window_size, softcap, None, None, None, ())  # checks them
    spans = _sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, len(q), len(k))
    slopes = _sequence_slopes(alibi_slopes, len(spans), q.shape[1])
    o = np.zeros(q.shape[:2] + v.shape[2:])
    lse = np.full(q.shape[1::-1], -np.inf)
    for b, (rows, keys) in enumerate(spans):
        o_b, lse_b = attention(
            _unpacked(q[rows]), _unpacked(k[keys]), _unpacked(v[keys]), causal, scale,
            window_size=window_size, softcap=softcap, alibi_slopes=slopes[b],
        )
        o[rows] = _packed_rows(o_b)
        lse[:, rows] = lse_b[0]
    return o, lse


def attention_backward_varlen(
    do,
    q,
    k,
    v,
    o,
    lse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    causal: bool = False,
    scale: float | None = None,
    window_size=(-1, -1),
    softcap: float = 0.0,
    alibi_slopes=None,
):
    """Exact gradients of :func:`attention_varlen`'s ``o`` in float64, ``(dq, dk, dv)``.

    :func:`attention_backward` on each sequence alone, packed as the inputs are: ``dq`` has
    ``q``'s shape (total_q, H, D), ``dk`` ``k``'s (total_k, Hkv, D), ``dv`` ``v``'s
    (total_k, Hkv, Dv). ``do`` is the incoming gradient of ``o``, shape (total_q, H, Dv).
    ``o`` (total_q, H, Dv) and ``lse`` (H, total_q), what :func:`attention_varlen` returned
    (the kernels' inputs), are checked for shape only: the oracle recomputes the softmax from
    ``q``, ``k``, ``v``. The other arguments are :func:`attention_varlen`'s.
    """
    q, k, v = _packed(q, k, v)
    do = to_numpy(do, "do")
    o_shape = q.shape[:2] + v.shape[2:]
    for name, arr, shape in (("do", do, o_shape), ("o", to_numpy(o, "o"), o_shape),
                             ("lse", to_numpy(lse, "lse"), q.shape[1::-1])):
        if arr.shape != shape:
            raise ValueError(f"{name} must have shape {shape} (total_q, H, Dv / H, total_q), got {arr.shape}")
    _modifications((0, q.shape[1]), causal, window_size, softcap, None, None, None, ())  # checks them
    spans = _sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, len(q), len(k))
    slopes = _sequence_slopes(alibi_slopes, len(spans), q.shape[1])
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for b, (rows, keys) in enumerate(spans):
        dq_b, dk_b, dv_b = attention_backward(
            _unpacked(do[rows]), _unpacked(q[rows]), _unpacked(k[keys]), _unpacked(v[keys]), causal, scale,
            window_size=window_size, softcap=softcap, alibi_slopes=slopes[b],
        )
        dq[rows], dk[keys], dv[keys] = _packed_rows(dq_b), _packed_rows(dk_b), _packed_rows(dv_b)
    return dq, dk, dv


def _packed(q, k, v):
    """q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv) as float64, checked as
    :func:`attention` checks its inputs (ValueError naming the argument)."""
    q, k, v = to_numpy(q, "q"), to_numpy(k, "k"), to_numpy(v, "v")
    for name, arr, layout in (
        ("q", q, "(total_q, heads, head_dim)"),
        ("k", k, "(total_k, kv_heads, head_dim)"),
        ("v", v, "(total_k, kv_heads, v_head_dim)"),
    ):
        if arr.ndim != 3:
            raise ValueError(f"{name} must be 3-D with shape {layout} (packed sequences), got shape {arr.shape}")
    _check_heads(q.shape[1:], k.shape[1:], v.shape[1:], ("q", "k", "v"))
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"v must have k's total_k = {k.shape[0]} rows, got shape {v.shape}")
    return q, k, v


def _check_heads(q_heads, k_heads, v_heads, names) -> None:
    """ValueError naming the argument unless the (heads, head_dim) pairs are q (H, D),
    k (Hkv, D), v (Hkv, Dv) with H % Hkv == 0, D >= 1, Dv >= 1."""
    q, k, v = names
    (heads, head_dim), (kv_heads, k_dim), (v_heads, v_dim) = q_heads, k_heads, v_heads
    if head_dim < 1 or v_dim < 1:
        raise ValueError(f"{q if head_dim < 1 else v} must have head_dim >= 1")
    if k_dim != head_dim:
        raise ValueError(f"{k} must have {q}'s head_dim {head_dim}, got {k_dim}")
    if v_heads != kv_heads:
        raise ValueError(f"{v} must have {k}'s {kv_heads} kv heads, got {v_heads}")
    if kv_heads < 1 or heads % kv_heads != 0:
        raise ValueError(f"{k} has {kv_heads} kv heads; {q}'s {heads} heads must be a positive multiple of it")


def _unpacked(x: np.ndarray) -> np.ndarray:
    """Rows (N, heads, dim) of one sequence as :func:`attention`'s (1, heads, N, dim) view."""
    return x.transpose(1, 0, 2)[None]


def _packed_rows(x: np.ndarray) -> np.ndarray:
    """The inverse of :func:`_unpacked`: (1, heads, N, dim) as rows (N, heads, dim)."""
    return x[0].transpose(1, 0, 2)


def _sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q: int, total_k: int):
    """``[(rows, keys)]``: sequence ``b``'s slices of the packed queries and keys, the prefix
    sums and maxima checked (``checks.sequence_bounds``: TypeError / ValueError naming the argument)."""
    cu_q, cu_k = sequence_bounds(_on_host(cu_seqlens_q), _on_host(cu_seqlens_k), max_seqlen_q, max_seqlen_k,
                                 total_q, total_k)
    return [(slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])) for b in range(len(cu_q) - 1)]


def _sequence_slopes(alibi_slopes, batch: int, heads: int) -> list:
    """Each sequence's ALiBi slopes (H,), or None each: ``alibi_slopes`` (H,) or (B, H)."""
    if alibi_slopes is None:
        return [None] * batch
    slopes = _modifications((batch, heads), False, (-1, -1), 0.0, alibi_slopes, None, None, ()).slopes
    return [slopes[b if len(slopes) > 1 else 0] for b in range(batch)]


def _integers(x, name: str) -> np.ndarray:
    """An integer array-like as an int64 NumPy array (TypeError naming ``name`` otherwise)."""
    return integer_array(_on_host(x), name)


# --------------------------------------------------------------------------- KV caches


def decode(
    q,
    k_cache,
    v_cache,
    *,
    cache_seqlens=None,
    block_table=None,
    k_new=None,
    v_new=None,
    causal: bool = False,
    scale: float | None = None,
    window_size=(-1, -1),
    softcap: float = 0.0,
    alibi_slopes=None,
    mask_mod=None,
    score_mod=None,
    mod_args=(),
):
    """Attention of a few queries per sequence to a KV cache (API.md 2b, 2e), ``(o, lse)``.

    ``numba_flash.decode``'s semantics, sequence by sequence through :func:`attention`:
    sequence ``b``'s keys are its first ``cache_seqlens[b]`` cached keys, then ``k_new[b]``
    (``v`` likewise); ``causal=True`` aligns its ``Nq`` queries to the end of them (query ``i``
    sees key ``j`` iff ``j <= cache_seqlens[b] + Nnew - Nq + i``).

    Parameters
    ----------
    q : array_like, shape (B, H, Nq, D)
    k_cache, v_cache : array_like
        Contiguous (``block_table=None``): ``(B, Hkv, Nmax, D)`` and ``(B, Hkv, Nmax, Dv)``.
        Paged: ``(num_blocks, page_size, Hkv, D)`` and ``(num_blocks, page_size, Hkv, Dv)``
        (FlashAttention's layout; the kernels take ``page_size`` a multiple of 16, the oracle
        any ``page_size >= 1``). ``H % Hkv == 0``.
    cache_seqlens : integer array_like, shape (B,), optional
        Valid cached keys per sequence; default: the whole cache (``Nmax``, or
        ``max_blocks * page_size`` when paged). As ``numba_flash.decode`` does, values are
        clamped to ``[0, Nmax]`` for a contiguous cache (negative ones to 0 when paged); keys at
        or past it are never read.
    block_table : integer array_like, shape (B, max_blocks), optional
        Sequence ``b``'s key ``j`` lives in page ``block_table[b, j // page_size]``, row
        ``j % page_size``. Only the entries of pages a sequence uses are read (the rest may hold
        anything, e.g. -1).
    k_new, v_new : array_like, shape (B, Hkv, Nnew, D) and (B, Hkv, Nnew, Dv), optional
        Keys and values appended at positions ``cache_seqlens[b] .. cache_seqlens[b] + Nnew - 1``
        before attending. The kernel writes them into the cache in place (the caller then
        advances ``cache_seqlens``); this oracle computes on a copy and modifies none of its
        inputs.
    causal, scale, window_size, softcap, alibi_slopes, mask_mod, score_mod, mod_args :
        As in :func:`attention` (``scale`` defaults to ``1 / sqrt(D)``; the window and ALiBi's
        distances bottom-right aligned to each sequence's keys, as ``causal``; a mod's ``b`` is
        the sequence, ``q_idx`` the query's index, ``kv_idx`` the key's position in the sequence).

    ``ValueError`` naming the argument for: a block index outside ``[0, num_blocks)`` among the
    pages a sequence uses; ``cache_seqlens[b] + Nnew`` past the cache (``Nmax``, or the table's
    ``max_blocks * page_size``; with ``k_new`` and no ``cache_seqlens`` the cache is full); and,
    when paged with ``k_new``, an appended key written to a page row that another key (of this
    or another sequence) also uses, where the in-place write would change what is read.

    Returns
    -------
    o : ndarray float64, shape (B, H, Nq, Dv)
    lse : ndarray float64, shape (B, H, Nq)
    """
    q = to_numpy(q, "q")
    k_cache, v_cache = to_numpy(k_cache, "k_cache"), to_numpy(v_cache, "v_cache")
    for name, arr in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if arr.ndim != 4:
            raise ValueError(f"{name} must be 4-D, got shape {arr.shape}")
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(
            f"v_cache must have the shape of k_cache {k_cache.shape} but for its head_dim, got {v_cache.shape}"
        )
    batch = q.shape[0]
    if block_table is None:
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache must have q's batch size {batch} (B, Hkv, Nmax, D), got shape {k_cache.shape}")
        kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
        table, page_size = None, None
    else:
        table = _integers(block_table, "block_table")
        if table.ndim != 2 or table.shape[0] != batch:
            raise ValueError(f"block_table must have shape (B, max_blocks) with B = {batch}, got {table.shape}")
        page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
        if page_size < 1:
            raise ValueError(f"k_cache must have page_size >= 1 (num_blocks, page_size, Hkv, D), got {k_cache.shape}")
        capacity = table.shape[1] * page_size

    _check_heads(q.shape[1::2], (kv_heads, k_cache.shape[3]), (kv_heads, v_cache.shape[3]),
                 ("q", "k_cache", "v_cache"))

    n_new = 0
    if (k_new is None) != (v_new is None):
        raise ValueError(f"{'v_new' if v_new is None else 'k_new'} is missing: k_new and v_new go together")
    if k_new is not None:
        k_new, v_new = to_numpy(k_new, "k_new"), to_numpy(v_new, "v_new")
        for name, arr, like in (("k_new", k_new, k_cache), ("v_new", v_new, v_cache)):
            if arr.ndim != 4 or arr.shape[:2] != (batch, kv_heads) or arr.shape[3] != like.shape[3]:
                raise ValueError(
                    f"{name} must have shape (B, Hkv, Nnew, {like.shape[3]}) with B = {batch}, Hkv = {kv_heads}, "
                    f"got {arr.shape}"
                )
        if k_new.shape[2] != v_new.shape[2]:
            raise ValueError(f"v_new must have k_new's Nnew = {k_new.shape[2]}, got shape {v_new.shape}")
        n_new = k_new.shape[2]

    if cache_seqlens is None:
        lengths = np.full(batch, capacity, dtype=np.int64)
    else:
        lengths = _integers(cache_seqlens, "cache_seqlens")
        if lengths.shape != (batch,):
            raise ValueError(f"cache_seqlens must have shape ({batch},), got {lengths.shape}")
        lengths = np.clip(lengths, 0, capacity if table is None else None)
    if table is not None:
        total = paged_cache(table, lengths, n_new, page_size, k_cache.shape[0], cache_seqlens is not None)
    else:
        total = lengths + n_new
        over = np.flatnonzero(total > capacity)
        if over.size:
            b = int(over[0])
            hint = " (cache_seqlens=None: the cache is full)" if cache_seqlens is None else ""
            raise ValueError(f"cache_seqlens[{b}] + Nnew = {lengths[b]} + {n_new} is past k_cache's Nmax = {capacity}{hint}")

    slopes = _sequence_slopes(alibi_slopes, batch, q.shape[1])
    o = np.zeros(q.shape[:3] + v_cache.shape[3:])
    lse = np.full(q.shape[:3], -np.inf)
    for b in range(batch):
        keys, values = (_cached(cache, b, int(lengths[b]), table, page_size) for cache in (k_cache, v_cache))
        if n_new:
            keys = np.concatenate([keys, k_new[b]], axis=1)
            values = np.concatenate([values, v_new[b]], axis=1)
        mods = {}
        if mask_mod is not None:  # (this call's batch is one sequence: its index is b)
            mods["mask_mod"] = lambda _, h, i, j, *args, b=b: mask_mod(b, h, i, j, *args)
        if score_mod is not None:
            mods["score_mod"] = lambda s, _, h, i, j, *args, b=b: score_mod(s, b, h, i, j, *args)
        o[b], lse[b] = (x[0] for x in attention(q[b : b + 1], keys[None], values[None], causal, scale,
                                                window_size=window_size, softcap=softcap,
                                                alibi_slopes=slopes[b], mod_args=tuple(mod_args), **mods))
    return o, lse


def _cached(cache: np.ndarray, b: int, length: int, table, page_size) -> np.ndarray:
    """Sequence ``b``'s first ``length`` cached rows as (Hkv, length, dim), gathered (a copy)
    from its pages when ``table`` is given."""
    if table is None:
        return cache[b, :, :length]
    pages = table[b, : -(-length // page_size)]
    return cache[pages].reshape(-1, *cache.shape[2:])[:length].transpose(1, 0, 2)


# --------------------------------------------------------------------------- masks and mods


@dataclass(frozen=True)
class _Modifications:
    """Section 2c's arguments, checked: the window (with causal) as a MaskSpec, the rest as the
    oracle uses them (slopes float64 (B or 1, H), mods unwrapped, mod_args read-only NumPy)."""

    window: MaskSpec
    softcap: float
    slopes: np.ndarray | None
    mask_mod: object
    score_mod: object
    mod_args: tuple
    score_mod_grad: object = None


def _modifications(q_shape, causal, window_size, softcap, alibi_slopes, mask_mod, score_mod, mod_args):
    """Check section 2c's arguments (ValueError / TypeError naming the argument)."""
    batch, heads = q_shape[:2]
    window = window_spec(causal, window_size)

    softcap = softcap_value(softcap)

    slopes = None
    if alibi_slopes is not None:
        slopes = to_numpy(alibi_slopes, "alibi_slopes")
        if slopes.shape not in ((heads,), (batch, heads)):
            raise ValueError(
                f"alibi_slopes must have shape (H,) = ({heads},) or (B, H) = ({batch}, {heads}), "
                f"got {slopes.shape}"
            )
        slopes = slopes.reshape(-1, heads)

    if not isinstance(mod_args, tuple):
        raise TypeError(f"mod_args must be a tuple of arrays, got {type(mod_args).__name__}")
    mod_args = tuple(_read_only(arg, f"mod_args[{i}]") for i, arg in enumerate(mod_args))
    return _Modifications(
        window=window,
        softcap=softcap,
        slopes=slopes,
        mask_mod=None if mask_mod is None else _callable(mask_mod, "mask_mod"),
        score_mod=None if score_mod is None else _callable(score_mod, "score_mod"),
        mod_args=mod_args,
    )


def _callable(fn, name: str):
    """``fn`` as a Python callable: a numba device function (on a GPU not callable from the
    host) by its ``py_func``; TypeError naming ``name`` for anything not callable."""
    if not callable(fn):
        raise TypeError(f"{name} must be a callable, got {type(fn).__name__}")
    py_func = getattr(fn, "py_func", None)
    return py_func if callable(py_func) else fn


def _read_only(x, name: str) -> np.ndarray:
    """An array of ``mod_args`` as a read-only NumPy view, its dtype kept (GPU arrays and
    tensors copied to the host as :func:`to_numpy` does, without the float64 conversion)."""
    x = _on_host(x)
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be an array (mod_args is a tuple of arrays), got {type(x).__name__}")
    view = x.view()
    view.flags.writeable = False
    return view


def _scores(q5, k5, scale, mods: _Modifications, gradient: bool):
    """``(S, f'(X))`` in the grouped layout (B, Hkv, group, Nq, Nk): the scores after scale,
    softcap, ALiBi and ``score_mod``, with the masked entries ``-inf``; and, when ``gradient``,
    ``dS/dX`` of the unmasked entries (X = scale Q K^T), None when it is 1 everywhere."""
    batch, kv_heads, group, n_q, _ = q5.shape
    heads, n_k = kv_heads * group, k5.shape[-2]
    shape = (batch, heads, n_q, n_k)  # h = g * group + r: a reshape of the grouped layout
    x = ((q5 @ k5.swapaxes(-1, -2)) * scale).reshape(shape)
    chain = None
    if mods.softcap > 0.0:  # s -> c tanh(s / c); d/ds = 1 - tanh(s / c)^2
        t = np.tanh(x / mods.softcap)
        s = mods.softcap * t
        if gradient:
            chain = 1.0 - t * t
    else:
        s = x
    grid = _index_grid(batch, heads, n_q, n_k)
    if mods.slopes is not None:  # - slope |i + (Nk - Nq) - j|: a constant, d/ds = 1
        _, _, q_idx, kv_idx = grid
        slope = mods.slopes[:, :, None, None]  # (B or 1, H, 1, 1)
        s = s - slope * np.abs(q_idx + (n_k - n_q) - kv_idx)

    visible = np.broadcast_to(mods.window.matrix(n_q, n_k), shape)
    if mods.mask_mod is not None:
        visible = visible & evaluate_mask_mod(mods.mask_mod, grid, mods.mod_args, shape)
    if mods.score_mod is not None:
        score = s.view()
        score.flags.writeable = False  # a mod that writes into it runs elementwise instead
        s = _evaluate(mods.score_mod, "score_mod", grid, score, mods.mod_args, shape, visible)
        if gradient:
            grad = _evaluate(mods.score_mod_grad, "score_mod_grad", grid, score, mods.mod_args, shape, visible)
            chain = grad if chain is None else chain * grad
    s = np.where(visible, s, -np.inf)
    five = (batch, kv_heads, group, n_q, n_k)
    return s.reshape(five), None if chain is None else np.broadcast_to(chain, shape).reshape(five)


def _index_grid(batch, heads, n_q, n_k):
    """Read-only int64 ``(b, h, q_idx, kv_idx)`` shaped to broadcast to (B, H, Nq, Nk)."""
    grid = (
        np.arange(batch).reshape(batch, 1, 1, 1),
        np.arange(heads).reshape(1, heads, 1, 1),
        np.arange(n_q).reshape(1, 1, n_q, 1),
        np.arange(n_k).reshape(1, 1, 1, n_k),
    )
    for a in grid:
        a.flags.writeable = False
    return grid


def _evaluate(mod, name, grid, score, mod_args, shape, visible):
    """A score mod (or its gradient) over the whole (B, H, Nq, Nk) grid: one call on broadcast
    arrays when the mod is vectorisable, else one call per visible element (the others are
    masked anyway and left 0). (``masking.evaluate_mask_mod`` is the mask mods'.)"""
    with np.errstate(all="ignore"):
        try:
            out = np.asarray(mod(score, *grid, *mod_args))
            if out.dtype.kind in "iuf":
                return np.broadcast_to(out, shape).astype(np.float64)
        except Exception:  # noqa: BLE001 -- not vectorisable: the elementwise loop below
            pass
        out = np.zeros(shape, dtype=np.float64)
        b, h, q_idx, kv_idx = np.nonzero(visible)
        for e in zip(b.tolist(), h.tolist(), q_idx.tolist(), kv_idx.tolist()):
            result = mod(float(score[e]), *e, *mod_args)
            try:
                out[e] = float(result)
            except (TypeError, ValueError):
                raise TypeError(f"{name} must return a real number, got {type(result).__name__} at "
                                f"(b, h, q_idx, kv_idx) = {e}") from None
    return out


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
