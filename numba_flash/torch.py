"""PyTorch autograd for numba_flash: ``numba_flash.torch.attention``.

``attention(q, k, v)`` is :func:`numba_flash.attention` on torch CUDA tensors with a
backward pass (:func:`numba_flash.attention_backward`), as a ``torch.autograd.Function``::

    import numba_flash.torch

    o = numba_flash.torch.attention(q, k, v, causal=True)  # q.requires_grad_() etc.
    o.sum().backward()                                    # fills q.grad, k.grad, v.grad

PyTorch stays an optional extra: ``import numba_flash`` never imports it; importing this
module does, and without torch raises ``ImportError`` naming the extra that installs it.
Double backward (gradients of gradients) is not supported.
"""

from __future__ import annotations

from numba_flash.needs import require_module

require_module("torch", "numba_flash.torch")  # the real PyTorch (absolute import), or the install hint

__all__ = ["attention"]

_FUNCTION = None  # the torch.autograd.Function subclass, built on first use


def attention(q, k, v, causal=False, scale=None, algorithm="fa2"):
    """Differentiable attention over torch CUDA tensors, returning ``o``.

    Shapes, dtypes, the causal mask (bottom-right aligned), ``scale`` (default ``1 / sqrt(D)``)
    and ``algorithm`` (``"fa1"`` or ``"fa2"``) are those of :func:`numba_flash.attention`:
    q (B, H, Nq, D), k and v (B, Hkv, Nk, D) with ``H % Hkv == 0``; ``o`` has q's shape and
    dtype. The forward saves q, k, v, o and the logsumexp; the backward runs
    :func:`numba_flash.attention_backward` with the same ``algorithm`` and gives gradients
    of the inputs' dtypes (those of a GQA kv head summed over its query heads; rows that see
    no key give zero gradients).
    """
    import torch  # absolute import: the real PyTorch, not this module (numba_flash.torch)

    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"{name} must be a torch tensor, got {type(x).__module__}.{type(x).__name__}; "
                "for other arrays use numba_flash.attention and numba_flash.attention_backward"
            )
    return _autograd_function().apply(q, k, v, causal, scale, algorithm)


def _autograd_function():
    """The ``torch.autograd.Function`` subclass (defined here so that torch loads lazily)."""
    global _FUNCTION
    if _FUNCTION is not None:
        return _FUNCTION
    # Absolute import (Python 3 has no implicit relative imports): this is the real PyTorch,
    # even though this module's own name is numba_flash.torch.
    import torch

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal, scale, algorithm):
            from numba_flash.api import forward

            o, lse = forward(
                q.detach(), k.detach(), v.detach(), causal=causal, scale=scale, algorithm=algorithm
            )
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.causal, ctx.scale, ctx.algorithm = causal, scale, algorithm
            return o

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, do):
            from numba_flash.backward import attention_backward

            q, k, v, o, lse = ctx.saved_tensors
            dq, dk, dv = attention_backward(
                do.contiguous(), q, k, v, o, lse,
                causal=ctx.causal, scale=ctx.scale, algorithm=ctx.algorithm,
            )
            return dq, dk, dv, None, None, None

    _FUNCTION = Attention
    return _FUNCTION
