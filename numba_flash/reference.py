"""The float64 oracle: attention with the whole score matrix S materialised.

:func:`attention` is the forward pass, :func:`attention_backward` its exact gradients
(the backward kernels' oracle), both with every mask and score modification of API.md
section 2c (window, softcap, ALiBi, ``mask_mod``, ``score_mod``). Written without
:mod:`numba_flash.online` on purpose (a plain softmax over the masked rows of S, not a running
one), so that it can check the online algebra as well as the kernels. Slow and memory-hungry
(``O(B H Nq Nk)``): it is for tests and small problems.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

import numpy as np

from numba_flash.masking import MaskSpec, mask_spec

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
    o : ndarray float64, shape (B, H, Nq, D)
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
    return o.reshape(batch, heads, n_q, head_dim), lse.reshape(batch, heads, n_q)


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
    (the incoming gradient of ``o``) has ``q``'s shape (B, H, Nq, D) and is converted the
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
    dk, dv : ndarray float64, shape (B, Hkv, Nk, D)
    """
    do = to_numpy(do, "do")
    q = to_numpy(q, "q")
    k = to_numpy(k, "k")
    v = to_numpy(v, "v")
    _check_shapes(q, k, v)
    if do.shape != q.shape:
        raise ValueError(f"do must have the shape of q {q.shape}, got {do.shape}")
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
    do5 = do.reshape(batch, kv_heads, group, n_q, head_dim)
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
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__") or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right) of ints, got {window_size!r}")
    try:
        window = mask_spec(causal, tuple(window_size))
    except (TypeError, ValueError) as err:
        raise type(err)(f"window_size={tuple(window_size)!r}: {err}") from None

    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number, got {type(softcap).__name__}")
    softcap = float(softcap)
    if not (math.isfinite(softcap) and softcap >= 0.0):
        raise ValueError(f"softcap must be a finite number >= 0 (0: off), got {softcap}")

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
    if all(callable(getattr(x, attr, None)) for attr in ("detach", "cpu", "numpy")):
        x = x.detach().cpu().numpy()
    elif hasattr(x, "__cuda_array_interface__"):
        fetch = getattr(x, "get", None) or getattr(x, "copy_to_host", None)
        if callable(fetch):
            x = fetch()
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
        visible = visible & _evaluate(mods.mask_mod, "mask_mod", grid, None, mods.mod_args, shape, visible)
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
    """A mod over the whole (B, H, Nq, Nk) grid: one call on broadcast arrays when the mod is
    vectorisable, else one call per element (for a score mod, per visible element; the others
    are masked anyway and left 0). ``score`` None: a mask mod (bool result)."""
    is_mask = score is None
    head = () if is_mask else (score,)
    kinds = "biu" if is_mask else "iuf"  # bool/int for a mask, int/float for a score
    with np.errstate(all="ignore"):
        try:
            out = np.asarray(mod(*head, *grid, *mod_args))
            if out.dtype.kind in kinds:
                out = np.broadcast_to(out, shape)
                return out.astype(bool) if is_mask else out.astype(np.float64)
        except Exception:  # noqa: BLE001 -- not vectorisable: the elementwise loop below
            pass
        out = np.zeros(shape, dtype=bool if is_mask else np.float64)
        b, h, q_idx, kv_idx = np.nonzero(np.ones(shape, dtype=bool) if is_mask else visible)
        for e in zip(b.tolist(), h.tolist(), q_idx.tolist(), kv_idx.tolist()):
            result = mod(*e, *mod_args) if is_mask else mod(float(score[e]), *e, *mod_args)
            try:
                out[e] = bool(result) if is_mask else float(result)
            except (TypeError, ValueError):
                want = "a bool" if is_mask else "a real number"
                got = type(result).__name__
                raise TypeError(f"{name} must return {want}, got {got} at (b, h, q_idx, kv_idx) = {e}") from None
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
