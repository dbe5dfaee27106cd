"""Peers measured beside the kernels in the same process.

- :func:`cupy_attention`: plain matmul -> softmax -> matmul on CuPy arrays, S and P
  materialised in float32 (the "standard attention" of the FlashAttention paper).
- :func:`torch_sdpa_backends`: PyTorch's ``scaled_dot_product_attention`` per backend
  that accepts the dtype, when torch is installed (recorded as missing otherwise).
"""

from __future__ import annotations

import math

from numba_flash.masking import mask_spec


def cupy_attention(q, k, v, causal=False, scale=None):
    """Materialised attention on CuPy arrays, output in q's dtype.

    S and P are float32 (float64 for float64 inputs: the on-device reference).
    """
    import cupy as cp

    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    group = H // k.shape[1]
    if group > 1:
        k = cp.repeat(k, group, axis=1)
        v = cp.repeat(v, group, axis=1)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    acc = cp.float64 if q.dtype == cp.float64 else cp.float32
    s = cp.matmul(q.astype(acc), k.astype(acc).swapaxes(-1, -2))
    s *= scale
    if causal:
        s = cp.where(mask_spec(causal).matrix(Nq, Nk, xp=cp), s, -cp.inf)
    m = s.max(axis=-1, keepdims=True)
    m = cp.where(cp.isfinite(m), m, 0)
    p = cp.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    o = cp.matmul(p, v.astype(acc)) / cp.where(l > 0, l, 1)
    return o.astype(q.dtype)


def torch_sdpa_backends(dtype: str) -> dict:
    """``{name: fn(q, k, v, causal) -> o}`` for each SDPA backend usable with ``dtype``.

    Takes CuPy arrays (shared through DLPack, no copy) or torch tensors. Empty when torch is
    missing.
    """
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    names = {"math": SDPBackend.MATH, "mem_efficient": SDPBackend.EFFICIENT_ATTENTION}
    if dtype in ("float16", "bfloat16"):
        names.update(flash=SDPBackend.FLASH_ATTENTION, cudnn=SDPBackend.CUDNN_ATTENTION)
    backends = {}
    for name, backend in names.items():

        def run(q, k, v, causal, _backend=backend):
            tq, tk, tv = (x if isinstance(x, torch.Tensor) else torch.from_dlpack(x) for x in (q, k, v))
            enable_gqa = tq.shape[1] != tk.shape[1]
            with sdpa_kernel(_backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    tq, tk, tv, is_causal=causal, enable_gqa=enable_gqa
                )

        backends[f"torch-{name}"] = run
    return backends
