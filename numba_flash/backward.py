"""``numba_flash.attention_backward``: gradients of attention (API.md section 5).

The kernels are ``kernels.bwd`` (FlashAttention Algorithm 4 and FlashAttention-2 Algorithm 2 on
CUDA cores, register micro-tiles on the forward's ``tile_ops``, square tiles in dynamic shared
memory). This wrapper validates, launches them in their order (FA-2: D = rowsum(dO * O)
first, then dK/dV with dQ by atomics, or dQ by its own kernel when ``deterministic``) and
answers in the inputs' kind and dtypes. float16 is read as it is; bfloat16 is widened to
float32 for the kernels and the gradients narrowed back.
"""

from __future__ import annotations

import numpy as np

from numba_flash._world import simulated
from numba_flash.arrays import ArrayContext, as_cupy_view

ALGORITHMS = ("fa1", "fa2")


def backward_tiles(head_dim: int) -> tuple[int, int, int]:
    """(block_m, block_n, threads) of the backward kernels: square tiles by
    ``kernels.bwd.backward_block``'s rule (D <= 64: 64 x 64, 128 threads; D <= 128: 32 x 32,
    64 threads; the simulator: 8 x 8, 16 threads)."""
    from numba_flash.kernels.bwd import backward_block, bwd_layout

    block = backward_block(head_dim)
    return block, block, bwd_layout("fa2", head_dim, block).threads


def attention_backward(do, q, k, v, o, lse, *, causal=False, scale=None, algorithm="fa2", deterministic=False):
    """Gradients ``(dq, dk, dv)`` of ``o = attention(q, k, v)`` for the upstream gradient ``do``.

    ``o`` and ``lse`` are what ``attention(q, k, v, causal=causal, scale=scale,
    return_lse=True)`` returned. Shapes and dtypes: ``do`` and ``o`` like ``q``; ``lse``
    float32 ``(B, H, Nq)``; the gradients have the shapes and dtypes of ``q``, ``k``, ``v``.
    GQA: dk and dv of a KV head sum over its query heads. Rows that see no key give zero
    gradients. ``algorithm``: ``"fa2"`` (FlashAttention-2 Algorithm 2; dQ summed by float32
    atomics, whose order varies from run to run, unless ``deterministic=True``) or ``"fa1"``
    (FlashAttention Algorithm 4; deterministic by construction).
    """
    from numba_flash import api

    do, q, k, v, o, lse = (as_cupy_view(x) for x in (do, q, k, v, o, lse))
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {list(ALGORITHMS)}; got {algorithm!r}")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be a bool; got {type(deterministic).__name__}")
    call = api._validate(q, k, v, causal, scale, "fa2", None, None, "ieee")
    kind = call["kind"]
    B, H, Nq, D = call["q_shape"]
    Hkv, Nk = int(k.shape[1]), call["n_k"]
    api.check_like(do, "do", (B, H, Nq, D), call["dtype"], kind)
    api.check_like(o, "o", (B, H, Nq, D), call["dtype"], kind)
    api.check_like(lse, "lse", (B, H, Nq), "float32", kind)
    ctx = ArrayContext(kind, q)
    with ctx.on_device():
        dq, dk, dv = (ctx.empty(tuple(x.shape), call["dtype"]) for x in (q, k, v))
        if B * H * Nq == 0 or Nk == 0:
            for g in (dq, dk, dv):
                g[...] = 0
            return dq, dk, dv
        _run(ctx, call, algorithm, bool(deterministic), (do, q, k, v, o, lse), (dq, dk, dv), Hkv)
    return dq, dk, dv


def _run(ctx, call, algorithm, deterministic, inputs, grads, Hkv) -> None:
    from numba_flash.kernels.bwd import ROWDOT_THREADS, bwd_dq_kernel, bwd_kernel, bwd_layout, rowdot_kernel
    from numba_flash.launch import numba_launch

    B, H, Nq, D = call["q_shape"]
    Nk = call["n_k"]
    block, _, _ = backward_tiles(D)
    scale = np.float32(call["scale"])
    wide = call["dtype"] == "bfloat16"  # the kernels read float16 or float32
    do, q, k, v, o, lse = (_widen(x, ctx.kind) if wide and i != 5 else x for i, x in enumerate(inputs))
    dq, dk, dv = grads
    dk_k, dv_k = (ctx.empty(tuple(g.shape), "float32") if wide else g for g in (dk, dv))
    dq_acc = ctx.empty((B, H, Nq, D), "float32")
    dq_acc[...] = 0
    dvec = ctx.empty((B, H, Nq), "float32")
    stream = ctx.stream()
    dev = _DeviceArgs(ctx)
    if algorithm == "fa2":  # FA-2 line 4: D = rowsum(dO * O), once
        numba_launch(rowdot_kernel(D), (-(-(B * H * Nq) // ROWDOT_THREADS),), ROWDOT_THREADS, stream,
                     dev(("in", do), ("in", o), ("out", dvec)))
        grid = (-(-Nk // block) * B * Hkv,)
    else:
        grid = (B * Hkv,)
    layout = bwd_layout(algorithm, D, block)
    kernel = bwd_kernel(algorithm, D, block, call["causal"], not deterministic or algorithm == "fa1")
    numba_launch(kernel, grid, layout.threads, stream,
                 dev(("in", q), ("in", k), ("in", v), ("in", o), ("in", do), ("in", lse), ("in", dvec),
                     ("out", dq_acc), ("out", dk_k), ("out", dv_k), scale), shared_mem_bytes=layout.smem_bytes)
    if deterministic and algorithm == "fa2":
        dq_layout = bwd_layout("dq", D, block)
        numba_launch(bwd_dq_kernel(D, block, call["causal"]), (-(-Nq // block) * B * H,), dq_layout.threads, stream,
                     dev(("in", q), ("in", k), ("in", v), ("in", do), ("in", lse), ("in", dvec), ("out", dq_acc), scale),
                     shared_mem_bytes=dq_layout.smem_bytes)
    dev.copy_back()
    dq[...] = _narrow(dq_acc, dq, ctx.kind) if call["dtype"] != "float32" else dq_acc
    if wide:
        dk[...] = _narrow(dk_k, dk, ctx.kind)
        dv[...] = _narrow(dv_k, dv, ctx.kind)


class _DeviceArgs:
    """Kernel arguments of one call: NumPy inputs copied to the GPU once (read-only ones
    as copies in the simulator, which writes arguments back), outputs copied back at the end."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.on_device = {}  # id(host array) -> (host array, device array, written)

    def __call__(self, *args):
        out = []
        for a in args:
            if not isinstance(a, tuple):
                out.append(a)
                continue
            role, x = a
            hit = self.on_device.get(id(x))
            if hit is None:
                hit = self.on_device[id(x)] = [x, self._to_kernel(x, role), role == "out"]
            hit[2] = hit[2] or role == "out"
            out.append(hit[1])
        return out

    def _to_kernel(self, x, role):
        ctx = self.ctx
        if ctx.kind != "numpy":
            return ctx.to_kernel(x)
        if simulated():
            return x if role == "out" else np.array(x)
        from numba_flash._cuda import cuda

        return cuda.to_device(np.ascontiguousarray(x))

    def copy_back(self):
        if self.ctx.kind != "numpy" or simulated():
            return
        for host, device, written in self.on_device.values():
            if written:
                device.copy_to_host(host)


def _widen(x, kind):
    return x.float() if kind == "torch" else x.astype(np.float32)


def _narrow(x32, like, kind):
    return x32.to(like.dtype) if kind == "torch" else x32.astype(like.dtype)

