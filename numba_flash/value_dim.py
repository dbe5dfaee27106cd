"""A ``v`` with a head dim of its own (API.md 2e): ``Dv`` from 1 to 256, ``o`` with ``Dv`` columns
(DeepSeek's 192/128, for instance).

The kernels take one head dim for Q, K and V. A call whose ``v`` is narrower or wider than ``q``
and ``k`` runs them at ``W = max(D, Dv)``: the narrower operands zero-padded to ``W`` columns,
which changes nothing (a zero column adds nothing to a score ``q . k``, and a zero column of V
gives a zero column of O), the scale taken from ``D`` (``1/sqrt(D)``, not ``1/sqrt(W)``), and
the output cut back to ``Dv`` columns. The backward pads ``do`` and ``o`` as ``v`` and cuts
``dq``, ``dk`` to ``D`` and ``dv`` to ``Dv``; the softmax statistics (``lse``) do not depend on
it. The cost is the padded copies and products over ``W`` columns (192/128: P V over 192 columns
instead of 128, about 1.25x the forward's work). Kernels with two head dims are the way past it.

This module is the only place that knows: :func:`widen` before a call, :func:`narrow` after it,
for the public functions of ``api``, ``backward``, ``varlen`` and ``numba_flash.torch`` (torch
tensors are padded and cut by torch's differentiable ops, so autograd cuts the gradients).
``decode`` refuses it (its caches are appended to in place; padding them would copy the whole
cache at every step). NumPy and CuPy padding is ``arrays.zero_padded``, the tensor-core inputs'.
"""

from __future__ import annotations

import math

from numba_flash.arrays import ArrayContext, as_cupy_view, kind_of, zero_padded
from numba_flash.tile_table import MAX_HEAD_DIM


def value_dims(q, v) -> tuple[int, int] | None:
    """``(D, Dv)`` when ``v``'s last axis differs from ``q``'s, else ``None`` (also for inputs
    that are not arrays: the call's own checks name those)."""
    try:
        d, dv = int(q.shape[-1]), int(v.shape[-1])
    except (AttributeError, IndexError, TypeError):
        return None
    if d == dv:
        return None
    if not 1 <= d <= MAX_HEAD_DIM:  # (problem.describe's check, before any padding could hide it)
        raise ValueError(f"head_dim (last axis of q) must be from 1 to {MAX_HEAD_DIM}; got {d}")
    if not 1 <= dv <= MAX_HEAD_DIM:
        raise ValueError(f"v's head_dim (its last axis) must be from 1 to {MAX_HEAD_DIM}; got {dv}")
    return d, dv


def pad(x, width: int, name: str = "x"):
    """``x`` with its last axis zero-padded to ``width`` columns, a new array of ``x``'s library
    and device; ``x`` itself when it has them already."""
    x = as_cupy_view(x, name)
    cols = int(x.shape[-1])
    if cols == width:
        return x
    kind = kind_of(x, name)
    if kind == "torch":  # differentiable: autograd cuts the gradient back (numba_flash.torch)
        import torch

        return torch.nn.functional.pad(x, (0, width - cols))
    with ArrayContext(kind, x).on_device():  # (CuPy: on x's GPU, not the current one)
        return zero_padded(x, width)


def narrow(x, width: int):
    """The first ``width`` columns of ``x``'s last axis, contiguous (a copy)."""
    if int(x.shape[-1]) == width:
        return x
    part = x[..., :width]
    if hasattr(part, "contiguous"):  # torch (differentiable)
        return part.contiguous()
    kind = kind_of(part, "x")
    with ArrayContext(kind, part).on_device():  # (CuPy: on x's GPU)
        return part.copy()


def widen(q, k, v, scale, dims):
    """``(q, k, v, scale)`` of a call at ``W = max(D, Dv)`` columns (``dims`` = ``(D, Dv)``);
    ``scale`` defaults to ``1/sqrt(D)``."""
    d, dv = dims
    check_columns(k, "k", d, "q's head_dim")
    if tuple(k.shape[:-1]) != tuple(v.shape[:-1]):  # (before padding: the message shows the caller's shapes)
        raise ValueError(f"k and v must have the same shape but for the last axis; got k {tuple(k.shape)} and "
                         f"v {tuple(v.shape)}")
    width = max(d, dv)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    return pad(q, width, "q"), pad(k, width, "k"), pad(v, width, "v"), scale


def check_columns(x, name: str, cols: int, what: str) -> None:
    """``ValueError`` unless ``x``'s last axis has ``cols`` entries (``what`` names them)."""
    got = int(x.shape[-1])
    if got != cols:
        raise ValueError(f"{name} must have {what} {cols} (its last axis); got {got}")


def widen_outputs(do, o, dims):
    """The backward's ``do`` and ``o`` (``Dv`` columns, checked) padded to ``max(D, Dv)``."""
    d, dv = dims
    for x, name in ((do, "do"), (o, "o")):
        check_columns(x, name, dv, "v's head_dim")
    if tuple(do.shape) != tuple(o.shape):
        raise ValueError(f"do and o must have the same shape; got do {tuple(do.shape)} and o {tuple(o.shape)}")
    width = max(d, dv)
    return pad(do, width, "do"), pad(o, width, "o")


def narrow_grads(grads, dims):
    """``(dq, dk, dv)`` of a widened call cut back to ``D``, ``D``, ``Dv`` columns."""
    d, dv = dims
    dq, dk, dvv = grads
    return narrow(dq, d), narrow(dk, d), narrow(dvv, dv)
