"""PyTorch entry points: ``numba_flash.torch.attention`` (autograd) and ``numba_flash.torch.decode``.

Each is a registered PyTorch custom operator (``torch.library.custom_op``) with a fake (meta)
implementation, so ``torch.compile`` sees one opaque node per call and never traces into the
launch path (default mode and ``fullgraph=True``; ``torch._dynamo.explain`` reports no graph
break), and ``attention``'s gradient is registered with the operator
(``register_autograd``)::

    import numba_flash.torch

    o = numba_flash.torch.attention(q, k, v, causal=True)  # q.requires_grad_() etc.
    o.sum().backward()                                    # fills q.grad, k.grad, v.grad

The operators, in the ``numba_flash`` namespace (``torch.ops.numba_flash.*``):

==========================  ===============================================================
``attention_forward``       ``(q, k, v, causal, scale, algorithm, window_size, softcap, alibi_slopes)
                            -> (o, lse)``
``attention_backward``      ``(do, q, k, v, o, lse, causal, scale, algorithm, window_size, softcap,
                            alibi_slopes) -> (dq, dk, dv)``
``decode``                  ``(q, k_cache, v_cache, cache_seqlens, causal, scale, num_splits, window_size,
                            softcap, alibi_slopes) -> (o, lse)``
==========================  ===============================================================

They launch on PyTorch's current stream, so they can be captured in CUDA graphs (what may not
change between replays: ``docs/api.md``). PyTorch stays an optional extra: ``import numba_flash``
never imports it; importing this module does (without torch: ``ImportError`` naming the extra
that installs it) and registers the operators then, outside any ``torch.compile`` trace (a
registration while tracing a first call would break the graph there). Double backward
(gradients of gradients) is not supported.
"""

from __future__ import annotations

from numba_flash import value_dim
from numba_flash.checks import softcap_value
from numba_flash.needs import require_module

torch = require_module("torch", "numba_flash.torch")  # the real PyTorch (absolute import), or the install hint

__all__ = ["attention", "attention_varlen", "decode"]


def _check_tensors(**arrays) -> None:
    for name, x in arrays.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"{name} must be a torch tensor, got {type(x).__module__}.{type(x).__name__}; "
                "for other arrays use numba_flash.attention, numba_flash.attention_backward and numba_flash.decode"
            )


def _window(causal, window_size) -> list:
    """``window_size`` checked as ``numba_flash.attention`` checks it, as the operators take it."""
    from numba_flash.masking import window_spec

    window_spec(bool(causal), window_size)
    return [int(window_size[0]), int(window_size[1])]


def attention(q, k, v, causal=False, scale=None, algorithm="fa2", window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
              mask_mod=None, score_mod=None, mod_args=(), score_mod_grad=None, block_mask=None):
    """Differentiable attention over torch CUDA tensors, returning ``o``.

    Shapes, dtypes, the causal mask and ``window_size`` (bottom-right aligned), ``softcap``,
    ``alibi_slopes`` (a float32 tensor on q's device; no gradient), ``scale``
    (default ``1 / sqrt(D)``) and ``algorithm`` (``"fa1"`` or ``"fa2"``) are those of
    :func:`numba_flash.attention`:
    q (B, H, Nq, D), k and v (B, Hkv, Nk, D) with ``H % Hkv == 0``; ``o`` has q's shape and
    dtype. The forward saves q, k, v, o and the logsumexp; the backward runs
    :func:`numba_flash.attention_backward` with the same ``algorithm`` and gives gradients
    of the inputs' dtypes (those of a GQA kv head summed over its query heads; rows that see
    no key give zero gradients).

    ``mask_mod``, ``score_mod``, ``mod_args`` (tensors on q's device, no gradient) and
    ``block_mask``: FlexAttention's hooks as :func:`numba_flash.attention` takes them (API.md 2c);
    the backward needs ``score_mod_grad`` (d score_mod / d score, same signature) with a
    ``score_mod``. A call with them runs as a ``torch.autograd.Function``, not as the custom
    operators (an operator's schema takes no Python function): ``torch.compile`` breaks its graph
    there.
    """
    _check_tensors(q=q, k=k, v=v, **({} if alibi_slopes is None else {"alibi_slopes": alibi_slopes}))
    dims = value_dim.value_dims(q, v)  # a v head dim of its own: padded and cut by torch's ops (value_dim)
    if dims is not None:
        q, k, v, scale = value_dim.widen(q, k, v, scale, dims)
        o = attention(q, k, v, causal, scale, algorithm, window_size, softcap, alibi_slopes, mask_mod, score_mod,
                      mod_args, score_mod_grad, block_mask)
        return value_dim.narrow(o, dims[1])
    if mask_mod is not None or score_mod is not None or block_mask is not None or len(tuple(mod_args)):
        _check_tensors(**{f"mod_args[{i}]": a for i, a in enumerate(mod_args)})
        options = dict(causal=bool(causal), scale=None if scale is None else float(scale), algorithm=str(algorithm),
                       window_size=tuple(_window(causal, window_size)), softcap=softcap_value(softcap))
        mods = dict(mask_mod=mask_mod, score_mod=score_mod, score_mod_grad=score_mod_grad, block_mask=block_mask)
        o, _ = _ModdedAttention.apply(q, k, v, alibi_slopes, options, mods, *mod_args)
        return o
    o, _ = _OPS.attention_forward(q, k, v, bool(causal), None if scale is None else float(scale), str(algorithm),
                                  _window(causal, window_size), softcap_value(softcap), alibi_slopes)
    return o


def decode(q, k_cache, v_cache, *, cache_seqlens=None, causal=False, scale=None, num_splits=None, return_lse=False,
           window_size=(-1, -1), softcap=0.0, alibi_slopes=None, block_table=None):
    """:func:`numba_flash.decode` on torch CUDA tensors as a custom operator (no gradient):
    ``o``, or ``(o, lse)`` with ``return_lse``. ``cache_seqlens``: ``None``, an int32 tensor
    ``(B,)`` on q's device, or a list of ints (made such a tensor). ``block_table``: a paged
    cache's table (API.md 2e), an int32 tensor ``(B, max_blocks)`` or a list (checked on the
    host at every call: a synchronising read). Appended keys (``k_new``) are
    :func:`numba_flash.decode`'s only (an operator that writes its inputs would say so in its schema)."""
    _check_tensors(q=q, k_cache=k_cache, v_cache=v_cache, **({} if alibi_slopes is None else {"alibi_slopes": alibi_slopes}))
    if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.as_tensor(cache_seqlens, dtype=torch.int32, device=q.device)
    if block_table is not None and not isinstance(block_table, torch.Tensor):
        block_table = torch.as_tensor(block_table, dtype=torch.int32, device=q.device)
    o, lse = _OPS.decode(q, k_cache, v_cache, cache_seqlens, bool(causal), None if scale is None else float(scale),
                         None if num_splits is None else int(num_splits), _window(causal, window_size),
                         softcap_value(softcap), alibi_slopes, block_table)
    return (o, lse) if return_lse else o


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, scale=None,
                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, algorithm="fa2", deterministic=False):
    """Differentiable :func:`numba_flash.attention_varlen` over torch CUDA tensors (API.md 2d),
    returning ``o`` ``(total_q, H, D)``: FlashAttention's ``flash_attn_varlen_func``. The prefix
    sums (int32 tensors, NumPy arrays or lists) are read on the host once, in the forward (a
    device tensor costs a synchronising copy: pass host ones in a loop); the backward runs
    :func:`numba_flash.attention_backward_varlen` on the same packed batch (``deterministic``:
    FA-2's dQ without atomics). A ``torch.autograd.Function``, not a custom operator (the lengths
    shape the launch): ``torch.compile`` breaks its graph there."""
    _check_tensors(q=q, k=k, v=v, **({} if alibi_slopes is None else {"alibi_slopes": alibi_slopes}))
    dims = value_dim.value_dims(q, v)  # a v head dim of its own: padded and cut by torch's ops (value_dim)
    if dims is not None:
        q, k, v, scale = value_dim.widen(q, k, v, scale, dims)
    options = dict(causal=bool(causal), scale=None if scale is None else float(scale), algorithm=str(algorithm),
                   window_size=tuple(_window(causal, window_size)), softcap=softcap_value(softcap))
    lengths = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    o, _ = _VarlenAttention.apply(q, k, v, alibi_slopes, options, lengths, bool(deterministic))
    return o if dims is None else value_dim.narrow(o, dims[1])


class _VarlenAttention(torch.autograd.Function):
    """:func:`attention_varlen`: ``numba_flash.varlen``'s forward and backward on one packed batch."""

    @staticmethod
    def forward(ctx, q, k, v, alibi_slopes, options, lengths, deterministic):
        from numba_flash.arrays import ArrayContext
        from numba_flash.varlen import attention_varlen as run
        from numba_flash.varlen import packed_batch

        q, k, v = q.detach(), k.detach(), v.detach()
        batch = packed_batch(ArrayContext("torch", q), *lengths, int(q.shape[0]), int(k.shape[0]))
        o, lse = run(q, k, v, *lengths, alibi_slopes=alibi_slopes, return_lse=True, batch=batch, **options)
        ctx.save_for_backward(q, k, v, o, lse, alibi_slopes)
        ctx.options, ctx.lengths, ctx.batch, ctx.deterministic = options, lengths, batch, deterministic
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        from numba_flash.varlen import attention_backward_varlen

        q, k, v, o, lse, alibi_slopes = ctx.saved_tensors
        dq, dk, dv = attention_backward_varlen(do.contiguous(), q, k, v, o, lse, *ctx.lengths, alibi_slopes=alibi_slopes,
                                               deterministic=ctx.deterministic, batch=ctx.batch, **ctx.options)
        return dq, dk, dv, None, None, None, None  # (no gradient for the slopes, as FlashAttention)


class _ModdedAttention(torch.autograd.Function):
    """:func:`attention` with a user's mods: the forward and backward of ``numba_flash`` called
    directly (the mods are Python functions, which no operator schema takes)."""

    @staticmethod
    def forward(ctx, q, k, v, alibi_slopes, options, mods, *mod_args):
        from numba_flash.api import forward

        o, lse = forward(q.detach(), k.detach(), v.detach(), alibi_slopes=alibi_slopes, mask_mod=mods["mask_mod"],
                         score_mod=mods["score_mod"], mod_args=mod_args, block_mask=mods["block_mask"], **options)
        ctx.save_for_backward(q, k, v, o, lse, alibi_slopes, *mod_args)
        ctx.options, ctx.mods = options, mods
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        from numba_flash.backward import attention_backward as gradients

        q, k, v, o, lse, alibi_slopes, *mod_args = ctx.saved_tensors
        dq, dk, dv = gradients(do.contiguous(), q, k, v, o, lse, alibi_slopes=alibi_slopes,
                               mask_mod=ctx.mods["mask_mod"], score_mod=ctx.mods["score_mod"], mod_args=tuple(mod_args),
                               score_mod_grad=ctx.mods["score_mod_grad"], **ctx.options)
        return (dq, dk, dv, None, None, None) + (None,) * len(mod_args)  # (no gradient for slopes, mods, arrays)


def _register():
    """Register the operators (once, at import) and return ``torch.ops.numba_flash``."""
    from torch.library import custom_op

    @custom_op("numba_flash::attention_forward", mutates_args=(),
               schema="(Tensor q, Tensor k, Tensor v, bool causal, float? scale, str algorithm, int[] window_size, "
                      "float softcap, Tensor? alibi_slopes) -> (Tensor, Tensor)")
    def attention_forward(q, k, v, causal, scale, algorithm, window_size, softcap, alibi_slopes):
        from numba_flash.api import forward

        return forward(q, k, v, causal=causal, scale=scale, algorithm=algorithm, window_size=tuple(window_size),
                       softcap=softcap, alibi_slopes=alibi_slopes)

    @attention_forward.register_fake
    def _(q, k, v, causal, scale, algorithm, window_size, softcap, alibi_slopes):
        return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)

    @custom_op("numba_flash::attention_backward", mutates_args=(),
               schema="(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, bool causal, float? scale, "
                      "str algorithm, int[] window_size, float softcap, Tensor? alibi_slopes) -> (Tensor, Tensor, Tensor)")
    def attention_backward(do, q, k, v, o, lse, causal, scale, algorithm, window_size, softcap, alibi_slopes):
        from numba_flash.backward import attention_backward as gradients

        return gradients(do.contiguous(), q, k, v, o, lse, causal=causal, scale=scale, algorithm=algorithm,
                         window_size=tuple(window_size), softcap=softcap, alibi_slopes=alibi_slopes)

    @attention_backward.register_fake
    def _(do, q, k, v, o, lse, causal, scale, algorithm, window_size, softcap, alibi_slopes):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # (contiguous, as the kernels write them)

    def setup_context(ctx, inputs, output):
        q, k, v, causal, scale, algorithm, window_size, softcap, alibi_slopes = inputs
        o, lse = output
        ctx.save_for_backward(q, k, v, o, lse, alibi_slopes)
        ctx.causal, ctx.scale, ctx.algorithm, ctx.window_size, ctx.softcap = causal, scale, algorithm, window_size, softcap
        ctx.mark_non_differentiable(lse)

    def backward(ctx, do, _dlse):
        q, k, v, o, lse, alibi_slopes = ctx.saved_tensors
        dq, dk, dv = torch.ops.numba_flash.attention_backward(do, q, k, v, o, lse, ctx.causal, ctx.scale, ctx.algorithm,
                                                              ctx.window_size, ctx.softcap, alibi_slopes)
        return dq, dk, dv, None, None, None, None, None, None  # (no gradient for the slopes, as FlashAttention)

    attention_forward.register_autograd(backward, setup_context=setup_context)

    @custom_op("numba_flash::decode", mutates_args=(),
               schema="(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? cache_seqlens, bool causal, float? scale, "
                      "int? num_splits, int[] window_size, float softcap, Tensor? alibi_slopes, Tensor? block_table) "
                      "-> (Tensor, Tensor)")
    def decode_op(q, k_cache, v_cache, cache_seqlens, causal, scale, num_splits, window_size, softcap, alibi_slopes,
                  block_table):
        from numba_flash.decoding import decode as run

        return run(q, k_cache, v_cache, cache_seqlens=cache_seqlens, causal=causal, scale=scale, num_splits=num_splits,
                   return_lse=True, window_size=tuple(window_size), softcap=softcap, alibi_slopes=alibi_slopes,
                   block_table=block_table)

    @decode_op.register_fake
    def _(q, k_cache, v_cache, cache_seqlens, causal, scale, num_splits, window_size, softcap, alibi_slopes,
          block_table):
        return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)

    return torch.ops.numba_flash


_OPS = _register()  # torch.ops.numba_flash, registered at import (outside any torch.compile trace)
