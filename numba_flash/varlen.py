"""``numba_flash.attention_varlen``: a packed batch of sequences of their own lengths (API.md 2d).

FlashAttention's ``flash_attn_varlen_func``: sequence ``b`` is rows ``cu_seqlens_q[b] ..
cu_seqlens_q[b + 1]`` of ``q (total_q, H, D)`` and ``cu_seqlens_k[b] .. cu_seqlens_k[b + 1]`` of
``k``, ``v (total_k, Hkv, D)``. No padding is computed, and the common case copies nothing: the
kernels read the packed arrays through ``(1, H, total, D)`` views (heads before rows, strided;
the regimes' usual copies aside: bfloat16 widened on CUDA cores, a head dim the tensor cores
pad), and the grid is
laid over (sequence, head, Q tile of the longest sequence) -- ``LaunchConfig.varlen``. Each block
cuts its sequence's rows out of every array (``kernels.block_info.sequence_span``) and runs the
one-sequence walk on them, so the masks' bottom-right alignment, the K/V walk's bounds and the
tail tiles follow from that sequence's lengths; a block whose Q tile lies past its sequence's
end returns at once. One kernel serves both loop orders and regimes (the skeleton's ``varlen``
switch); ``num_splits`` is 1.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field, replace

import numpy as np

from numba_flash import api, value_dim
from numba_flash.alibi import check_slopes
from numba_flash.arrays import ArrayContext, as_cupy_view, dtype_name, host_values, kind_of
from numba_flash.checks import sequence_bounds
from numba_flash.problem import describe

__all__ = ["PackedBatch", "attention_backward_varlen", "attention_varlen", "packed_batch"]


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, scale=None,
                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, algorithm="fa2", return_lse=False,
                     precision=None, batch=None):
    """Attention of each sequence of a packed batch to its own keys (API.md 2d).

    ``q``: ``(total_q, H, D)``; ``k``, ``v``: ``(total_k, Hkv, D)``, ``H % Hkv == 0``; CuPy,
    torch or NumPy arrays of one library and dtype (float16, bfloat16, float32).
    ``cu_seqlens_q``, ``cu_seqlens_k``: integer ``(B + 1,)`` prefix sums (start at 0, never
    decrease, end at ``total_q`` / ``total_k``; read on the host to be checked: device arrays
    cost a synchronising copy per call, so a loop passes NumPy or lists); ``max_seqlen_q``, ``max_seqlen_k``: at
    least the longest lengths. ``causal``, ``window_size``, ``softcap``, ``scale``: as
    :func:`numba_flash.attention`, aligned bottom-right per sequence; ``alibi_slopes``: float32
    ``(H,)`` or ``(B, H)`` (row ``b``: sequence ``b``). ``algorithm``: ``"fa1"`` or ``"fa2"``;
    ``precision``: as :func:`numba_flash.attention`. Returns ``o (total_q, H, D)`` in q's dtype,
    or ``(o, lse)`` with ``return_lse=True``, ``lse`` float32 ``(H, total_q)`` (natural log;
    a sequence with no keys: ``o = 0``, ``lse = -inf``). ``batch``: these prefix sums as a
    :class:`PackedBatch` already made (:func:`packed_batch`; then they are not read again).
    """
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool; got {type(return_lse).__name__}")
    dims = value_dim.value_dims(q, v)  # a v head dim of its own: the call at the wider (numba_flash.value_dim)
    if dims is not None:
        q, k, v, scale = value_dim.widen(q, k, v, scale, dims)
        o, lse = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                  scale=scale, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                  algorithm=algorithm, return_lse=True, precision=precision, batch=batch)
        o = value_dim.narrow(o, dims[1])
        return (o, lse) if return_lse else o
    (q, k, v), kind = _packed_inputs(("q", q), ("k", k), ("v", v))
    views = [_heads_first(x, kind) for x in (q, k, v)]  # (the checks of describe name q, k, v)
    if algorithm == "fa3":  # FlashAttention-3's kernel, a tensor map per sequence (numba_flash.fa3)
        return _fa3_varlen(q, k, v, views, kind, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                           window_size, softcap, alibi_slopes, return_lse, precision, batch)
    problem = describe(*views, causal=causal, scale=scale, algorithm=algorithm, precision=precision,
                       window_size=window_size, softcap=softcap)
    total_q, H, D = (int(n) for n in q.shape)
    ctx = ArrayContext(kind, q)
    if batch is None:
        batch = packed_batch(ctx, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q, int(k.shape[0]))
    batch.check(ctx, total_q, int(k.shape[0]))
    if alibi_slopes is not None:  # (H,) or a row per sequence
        problem = replace(problem, alibi_slopes=batch.slopes(alibi_slopes, problem), alibi=True)
    call = replace(api.configure(problem), num_splits=1, varlen=(batch.sequences, batch.max_seqlen_q))
    with ctx.on_device():
        o = ctx.empty((total_q, H, D), problem.dtype)
        lse = ctx.empty((H, total_q), "float32")
        if total_q:
            if batch.max_seqlen_k:
                # (a GPU writes o through its strided view; NumPy results go through a device
                # copy, which must be one contiguous buffer: heads first, then transposed)
                o_kernel = ctx.empty((1, H, total_q, D), problem.dtype) if kind == "numpy" else _heads_first(o, kind)
                api.run(ctx, call, *views, o_kernel, lse[None], seqlens=batch.bounds)
                if kind == "numpy":
                    o[...] = o_kernel[0].transpose(1, 0, 2)
            else:  # no sequence has keys: o = 0, lse = -inf (as for a fully masked row)
                o[...] = 0
                lse[...] = -np.inf
    return (o, lse) if return_lse else o


def _fa3_varlen(q, k, v, views, kind, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                window_size, softcap, alibi_slopes, return_lse, precision, batch):
    """:func:`attention_varlen` with ``algorithm="fa3"``: the same checks and results, the kernel
    ``fa3``'s (writing o and lse through their heads-first views)."""
    from numba_flash import fa3

    total_q, H, D = (int(n) for n in q.shape)
    ctx = ArrayContext(kind, q)
    if batch is None:
        batch = packed_batch(ctx, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q, int(k.shape[0]))
    batch.check(ctx, total_q, int(k.shape[0]))
    with ctx.on_device():
        o = ctx.empty((total_q, H, D), dtype_name(q, kind))
        lse = ctx.empty((H, total_q), "float32")
    fa3.forward(*views, causal=causal, scale=scale, window_size=window_size, softcap=softcap,
                alibi_slopes=alibi_slopes, precision=precision, out=_heads_first(o, kind), lse_out=lse[None],
                packed=batch)
    return (o, lse) if return_lse else o


def attention_backward_varlen(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                              causal=False, scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              algorithm="fa2", deterministic=False, precision=None, batch=None):
    """Gradients ``(dq, dk, dv)`` of :func:`attention_varlen`'s ``o`` for the upstream gradient
    ``do`` (API.md 2d): ``o`` and ``lse`` ``(H, total_q)`` are what it returned for the same
    arguments; ``do`` and ``o`` like ``q``; the gradients have the packed shapes and dtypes of
    ``q``, ``k``, ``v`` (GQA: a KV head's sum over its query heads; rows that see no key: zero).
    ``algorithm``, ``deterministic``, ``precision``: as :func:`numba_flash.attention_backward`.
    The kernels are the backward's, cut per sequence as the forward's (``kernels.backward``'s
    ``varlen`` switch). ``batch``: the forward's :class:`PackedBatch` (the prefix sums then are
    not read again: no host copy)."""
    from numba_flash.backward import gradients

    dims = value_dim.value_dims(q, v)  # a v head dim of its own (numba_flash.value_dim)
    if dims is not None:
        do, o = value_dim.widen_outputs(do, o, dims)
        q, k, v, scale = value_dim.widen(q, k, v, scale, dims)
        grads = attention_backward_varlen(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          causal=causal, scale=scale, window_size=window_size, softcap=softcap,
                                          alibi_slopes=alibi_slopes, algorithm=algorithm, deterministic=deterministic,
                                          precision=precision, batch=batch)
        return value_dim.narrow_grads(grads, dims)

    (q, k, v, do, o), kind = _packed_inputs(("q", q), ("k", k), ("v", v), ("do", do), ("o", o))
    lse = as_cupy_view(lse, "lse")
    if kind_of(lse, "lse") != kind:
        raise TypeError(f"lse must be an array of q's library ({kind})")
    total_q, H = (int(n) for n in q.shape[:2])
    for name, x in (("do", do), ("o", o)):  # (the packed layout's shapes; dtypes: the backward's checks)
        if tuple(x.shape) != tuple(q.shape):
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}; got {tuple(x.shape)}")
    if tuple(lse.shape) != (H, total_q):
        raise ValueError(f"lse must have shape (H, total_q) = {(H, total_q)}, as attention_varlen returns it; "
                         f"got {tuple(lse.shape)}")
    ctx = ArrayContext(kind, q)
    if batch is None:
        batch = packed_batch(ctx, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q, int(k.shape[0]))
    batch.check(ctx, total_q, int(k.shape[0]))
    views = [_heads_first(x, kind) for x in (do, q, k, v, o)]
    grads = gradients(*views, lse[None], causal=causal, scale=scale, algorithm=algorithm, deterministic=deterministic,
                      precision=precision, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                      packed=batch)
    return tuple(_rows_first(g, kind) for g in grads)


@dataclass(frozen=True)
class PackedBatch:
    """A checked packed batch, as the kernels take it: ``bounds``, int32 ``(2, B + 1)`` (the
    queries' and the keys' prefix sums) in the inputs' library and device; the sequence count;
    the longest query and key lengths (what the grids are laid over)."""

    bounds: object
    sequences: int
    max_seqlen_q: int
    max_seqlen_k: int
    total_q: int  # (what the prefix sums end at: checked against each call's arrays)
    total_k: int
    device_id: object = None
    host_bounds: object = field(default=None, compare=False, repr=False)  # the same, NumPy int32 (fa3's maps)

    def check(self, ctx: ArrayContext, total_q: int, total_k: int) -> None:
        """``ValueError`` unless this batch was made for packed rows of these totals on the inputs'
        device (a batch of other rows would walk past the arrays)."""
        if (self.total_q, self.total_k) != (total_q, total_k):
            raise ValueError(f"batch was made for total_q = {self.total_q}, total_k = {self.total_k}; the arrays have "
                             f"{total_q} and {total_k}")
        if ctx.kind != "numpy" and self.device_id != ctx.device_id:
            raise ValueError(f"batch's bounds are on device {self.device_id}; the arrays on {ctx.device_id}")

    def slopes(self, alibi_slopes, problem):
        """ALiBi's slopes ``(H,)`` or ``(B, H)`` checked against the sequences, as ``(B, H)``
        (the kernels cut out their sequence's row)."""
        alibi_slopes = as_cupy_view(alibi_slopes, "alibi_slopes")
        check_slopes(alibi_slopes, problem.kind, self.sequences, problem.heads, problem.device_id)
        return _rows_per_sequence(alibi_slopes, self.sequences, problem.kind)


def packed_batch(ctx: ArrayContext, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q: int,
                 total_k: int) -> PackedBatch:
    """The prefix sums read on the host and checked (``checks.sequence_bounds``), as a
    :class:`PackedBatch` on the inputs' device."""
    cu_q, cu_k = sequence_bounds(host_values(cu_seqlens_q, "cu_seqlens_q"), host_values(cu_seqlens_k, "cu_seqlens_k"),
                                 max_seqlen_q, max_seqlen_k, total_q, total_k)
    longest_q = max((b - a for a, b in zip(cu_q, cu_q[1:])), default=0)
    longest_k = max((b - a for a, b in zip(cu_k, cu_k[1:])), default=0)
    with ctx.on_device():
        bounds = _device_bounds(np.array([cu_q, cu_k], dtype=np.int32), ctx.kind, ctx)
    return PackedBatch(bounds, len(cu_q) - 1, longest_q, longest_k, total_q, total_k,
                       None if ctx.kind == "numpy" else ctx.device_id, np.array([cu_q, cu_k], dtype=np.int32))


def _packed_inputs(*named):
    """``(arrays, kind)``: the packed inputs ``(name, array)`` (q, k, v first) as CuPy views where
    they are CAI or DLPack objects, checked in the packed layout's words: one library, 3-D, k and
    v of one shape, heads that divide, one head dim, the rest like q."""
    arrays = [as_cupy_view(x, name) for name, x in named]
    kinds = [kind_of(x, name) for (name, _), x in zip(named, arrays)]
    if len(set(kinds)) != 1:
        raise TypeError(f"{', '.join(n for n, _ in named)} must be arrays of one library; got {', '.join(kinds)}")
    for (name, _), x in zip(named, arrays):
        if len(x.shape) != 3:
            raise ValueError(f"{name} must be 3-D (total, heads, head_dim), packed; got shape {tuple(x.shape)}")
    q, k, v = arrays[:3]
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape (total_k, kv_heads, head_dim); got k {tuple(k.shape)} "
                         f"and v {tuple(v.shape)}")
    if int(k.shape[1]) == 0 or int(q.shape[1]) % int(k.shape[1]):
        raise ValueError(f"q's heads ({int(q.shape[1])}) must be a positive multiple of k's and v's heads "
                         f"({int(k.shape[1])})")
    if int(k.shape[2]) != int(q.shape[2]):
        raise ValueError(f"k and v must have q's head_dim {int(q.shape[2])}; got {int(k.shape[2])}")
    return arrays, kinds[0]


def _heads_first(x, kind: str):
    """``(total, heads, dim)`` as the kernels' ``(1, heads, total, dim)``: a strided view."""
    if kind == "torch":
        return x.permute(1, 0, 2).unsqueeze(0)
    return x.transpose(1, 0, 2)[None]


def _rows_first(x, kind: str):
    """A ``(1, heads, total, dim)`` result as a C-contiguous packed ``(total, heads, dim)`` array."""
    if kind == "torch":
        return x[0].permute(1, 0, 2).contiguous()
    xp = np if kind == "numpy" else __import__("cupy")
    return xp.ascontiguousarray(x[0].transpose(1, 0, 2))


def _rows_per_sequence(slopes, n_seq: int, kind: str):
    """ALiBi slopes ``(H,)`` or ``(B, H)`` as ``(B, H)`` (the kernel cuts out its sequence's row)."""
    if len(slopes.shape) == 2:
        return slopes
    if kind == "torch":
        return slopes[None].expand(n_seq, -1)
    xp = np if kind == "numpy" else __import__("cupy")
    return xp.broadcast_to(slopes[None], (n_seq, slopes.shape[0]))


_BOUNDS: collections.OrderedDict = collections.OrderedDict()  # the kernels' bounds on the device, by contents
_BOUNDS_KEPT = 64  # (a training loop's batches repeat few shapes; the least recently used goes first)
_BOUNDS_LOCK = threading.Lock()


def _device_bounds(host: np.ndarray, kind: str, ctx: ArrayContext):
    """The int32 bounds ``host`` in the inputs' library and device, made once per contents and
    kept (least recently used first out; the contents are the key, so a kept array never stands
    for other lengths). torch copies from pinned memory without waiting on the stream. Not for
    CUDA-graph capture: a first use copies from the host."""
    if kind == "numpy":
        return host
    key = (kind, ctx.device_id, host.shape, host.tobytes())
    with _BOUNDS_LOCK:
        bounds = _BOUNDS.get(key)
        if bounds is not None:
            _BOUNDS.move_to_end(key)
            return bounds
    if kind == "torch":
        import torch

        bounds = torch.from_numpy(host).pin_memory().to(ctx.template.device, non_blocking=True)
    else:
        import cupy

        bounds = cupy.asarray(host)
    with _BOUNDS_LOCK:
        _BOUNDS[key] = bounds
        while len(_BOUNDS) > _BOUNDS_KEPT:
            _BOUNDS.popitem(last=False)
    return bounds
