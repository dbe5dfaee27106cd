"""``numba_flash.attention_backward``: gradients of attention (API.md section 5).

Two regimes, chosen by dtype as the forward's ``precision=None`` does (API.md section 2a):

- float16 and bfloat16: tensor cores (``kernels.tc_bwd``: ``mma.sync`` m16n8k16 with float32
  accumulation; FlashAttention-2 Algorithm 2 and FlashAttention Algorithm 4 loop nests, dQ by
  float32 atomics, or by its own kernel when ``deterministic``). Inputs reach the kernels as
  uint16 bit patterns, padded to 16-byte rows when they are not; dK and dV are written in the
  inputs' dtype by the kernel, dQ summed in float32 and narrowed at the end.
- float32: tensor cores in split precision (:data:`TF32X3_BACKWARD`, on: ``kernels.tc_bwd``
  with kind ``"tf32x3"``: each float32 operand split into TF32 big + small, three m16n8k8
  products, error close to float32's, as the forward's ``precision="tf32x3"`` and PyTorch's
  memory-efficient backward); with the switch off, CUDA cores (``kernels.bwd``: register
  micro-tiles on the forward's ``tile_ops``, square tiles in dynamic shared memory), exact FFMA.

The public signature has no ``precision`` (API.md section 5). The CUDA-core kernels stay
reachable for any dtype through :func:`gradients` with ``precision="ieee"`` (the research
baseline, as the forward's ``precision="ieee"``: float16 read as it is, bfloat16 widened to
float32 and narrowed back).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from numba_flash import tile_table, value_dim
from numba_flash._world import simulated
from numba_flash.alibi import slopes_argument
from numba_flash.arrays import ArrayContext, as_cupy_view
from numba_flash.block_sparse import lists_at
from numba_flash.kernels.jit import LOG2E
from numba_flash.problem import ALGORITHMS, TENSOR_CORE_KIND
from numba_flash.user_mods import compiling, user_mods_of

# Does attention_backward run float32 on tensor cores (tf32x3) instead of CUDA cores? On since
# the H200 check (docs/performance-log.md, "Backward in tf32x3"): FA-2 B4 H16 N4096 D64 18.4 ms
# (1.06x PyTorch memory-efficient, which splits its float32 products the same way) against
# 24.9 ms on CUDA cores; errors against float64 within the CUDA-core bound. The CUDA-core kernels
# stay reachable through gradients(..., precision="ieee").
TF32X3_BACKWARD = True


def backward_regime(precision, dtype: str) -> str:
    """``"ieee"`` (CUDA cores) or the tensor-core kind (``"f16"``, ``"bf16"``, ``"tf32x3"``) of a
    backward call: ``precision=None`` picks tensor cores for 16-bit inputs, and for float32 CUDA
    cores, or tf32x3 when :data:`TF32X3_BACKWARD` is set; ``"ieee"`` CUDA cores for any dtype;
    ``"tf32x3"`` split-precision tensor cores (float32 inputs only). (Plain TF32 has no backward
    kernels: its error is far from float32's.)"""
    if precision is None:
        if dtype == "float32" and TF32X3_BACKWARD:
            return "tf32x3"
        return TENSOR_CORE_KIND.get(dtype, "ieee")
    if isinstance(precision, str) and precision == "ieee":
        return "ieee"
    if isinstance(precision, str) and precision == "tf32x3":
        if dtype != "float32":
            raise ValueError(f"precision='tf32x3' needs float32 inputs; got {dtype}")
        return "tf32x3"
    raise ValueError(f"the backward's precision must be None, 'ieee' or 'tf32x3'; got {precision!r}")


def attention_backward(do, q, k, v, o, lse, *, causal=False, scale=None, algorithm="fa2", deterministic=False,
                       window_size=(-1, -1), softcap=0.0, alibi_slopes=None, mask_mod=None, score_mod=None, mod_args=(),
                       score_mod_grad=None):
    """Gradients ``(dq, dk, dv)`` of ``o = attention(q, k, v)`` for the upstream gradient ``do``.

    ``o`` and ``lse`` are what ``attention(q, k, v, causal=causal, scale=scale,
    window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, return_lse=True)`` returned
    (ALiBi's slopes get no gradient: FlashAttention's contract). ``mask_mod``, ``score_mod`` and
    ``mod_args`` as the forward took them; with ``score_mod``, ``score_mod_grad(score, b, h, q_idx,
    kv_idx, *mod_args)`` -> d score_mod / d score (``ValueError`` without it); ``mod_args`` get no
    gradient. Shapes and dtypes: ``do`` and ``o`` like ``q``; ``lse``
    float32 ``(B, H, Nq)``; the gradients have the shapes and dtypes of ``q``, ``k``, ``v``.
    GQA: dk and dv of a KV head sum over its query heads. Rows that see no key give zero
    gradients. ``algorithm``: ``"fa2"`` (FlashAttention-2 Algorithm 2; dQ summed by float32
    atomics, whose order varies from run to run, unless ``deterministic=True``) or ``"fa1"``
    (FlashAttention Algorithm 4; deterministic by construction). float16 and bfloat16 run on
    tensor cores, float32 on CUDA cores (:func:`gradients` chooses otherwise).
    """
    dims = value_dim.value_dims(q, v)  # a v head dim of its own (numba_flash.value_dim)
    if dims is not None:
        do, o = value_dim.widen_outputs(do, o, dims)
        q, k, v, scale = value_dim.widen(q, k, v, scale, dims)
    grads = gradients(do, q, k, v, o, lse, causal=causal, scale=scale, algorithm=algorithm, deterministic=deterministic,
                      window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, mask_mod=mask_mod,
                      score_mod=score_mod, mod_args=mod_args, score_mod_grad=score_mod_grad)
    return grads if dims is None else value_dim.narrow_grads(grads, dims)


def gradients(do, q, k, v, o, lse, *, causal=False, scale=None, algorithm="fa2", deterministic=False, precision=None,
              tiles=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, mask_mod=None, score_mod=None,
              mod_args=(), score_mod_grad=None, packed=None):
    """:func:`attention_backward` with the regime chosen by ``precision`` (:func:`backward_regime`):
    ``None`` (the public default: tensor cores for float16 and bfloat16, tf32x3 for float32), ``"ieee"`` (CUDA
    cores for any dtype: the research baseline, and the kernels the tests compare against) or
    ``"tf32x3"`` (float32 on split-precision tensor cores; the default for float32).
    ``tiles``: ``(block_m, block_n)`` of the tensor-core kernels (queries per Q tile, keys per
    K/V tile; default ``tile_table.backward_tc_tiles``), for sweeps. ``packed``: a packed batch
    (``numba_flash.varlen.PackedBatch``; the arrays are its ``(1, heads, total, ...)`` views, and
    ``alibi_slopes`` ``(H,)`` or one row per sequence)."""
    from numba_flash import api
    from numba_flash.problem import describe

    do, q, k, v, o, lse = (as_cupy_view(x, name) for name, x in zip(("do", "q", "k", "v", "o", "lse"), (do, q, k, v, o, lse)))
    if alibi_slopes is not None:
        alibi_slopes = as_cupy_view(alibi_slopes, "alibi_slopes")
    if isinstance(mod_args, (tuple, list)):
        mod_args = tuple(as_cupy_view(a, f"mod_args[{i}]") for i, a in enumerate(mod_args))
    if score_mod is not None and score_mod_grad is None:
        raise ValueError("score_mod_grad is required with score_mod: the backward needs d score_mod / d score, a "
                         "function with score_mod's signature")
    if score_mod_grad is not None and (score_mod is None or not callable(score_mod_grad)):
        raise ValueError("score_mod_grad goes with score_mod, and must be a function")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {list(ALGORITHMS)}; got {algorithm!r}")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be a bool; got {type(deterministic).__name__}")
    # attention's checks (the forward's regime is not this one: backward_regime below decides)
    problem = describe(q, k, v, causal=causal, scale=scale, algorithm="fa2", precision="ieee", window_size=window_size,
                       softcap=softcap, alibi_slopes=None if packed is not None else alibi_slopes, mask_mod=mask_mod,
                       score_mod=score_mod, mod_args=mod_args)
    if packed is not None and alibi_slopes is not None:  # (a row per sequence, checked against the sequences)
        problem = replace(problem, alibi_slopes=packed.slopes(alibi_slopes, problem), alibi=True)
    kind = problem.kind
    # (compiled into the kernels; with a mask_mod, the walks visit its block mask's tiles: block_sparse)
    user = user_mods_of(mask_mod, score_mod, problem.mod_args, score_mod_grad, block_sparse=True)
    B, H, Nq, D = problem.q_shape
    Hkv, Nk = int(k.shape[1]), problem.n_k
    api.check_like(do, "do", (B, H, Nq, D), problem.dtype, kind)
    api.check_like(o, "o", (B, H, Nq, D), problem.dtype, kind)
    api.check_like(lse, "lse", (B, H, Nq), "float32", kind)
    ctx = ArrayContext(kind, q)
    with ctx.on_device():
        dq, dk, dv = (ctx.empty(tuple(x.shape), problem.dtype) for x in (q, k, v))
        if B * H * Nq == 0 or Nk == 0:
            for g in (dq, dk, dv):
                g[...] = 0
            return dq, dk, dv
        regime = backward_regime(precision, problem.dtype)
        if simulated():  # (before minutes of simulated kernels: say so, as attention does)
            from numba_flash.simulator import warn_if_slow

            warn_if_slow(f"backward (B={B} H={H} Nq={Nq} Nk={Nk} D={D})", simulated_seconds(problem, regime, tiles))
        if regime == "ieee":
            with compiling(user):
                _run(ctx, problem, algorithm, bool(deterministic), (do, q, k, v, o, lse), (dq, dk, dv), Hkv, user, packed)
        else:
            with compiling(user):
                _run_tc(ctx, problem, regime, algorithm, bool(deterministic), (do, q, k, v, o, lse), (dq, dk, dv), Hkv,
                        tiles, user, packed)
    return dq, dk, dv


def simulated_seconds(problem, regime: str | None = None, tiles=None) -> float:
    """About how long the simulator takes for the backward of a checked problem
    (``simulator.estimate_backward_seconds``), at the regime (default: the public one for its
    dtype) and the tiles the call picks."""
    from numba_flash.kernels.tc_ops import kernel_head_dim
    from numba_flash.simulator import estimate_backward_seconds

    regime = backward_regime(None, problem.dtype) if regime is None else regime
    if regime == "ieee":
        dim = problem.head_dim
        block_m = block_n = tile_table.backward_block(dim)
    else:
        dim = kernel_head_dim(regime, problem.head_dim)
        block_m, block_n = tile_table.backward_tc_tiles(dim, regime) if tiles is None else tiles
    return estimate_backward_seconds(regime, problem.batch, problem.heads, problem.n_q, problem.n_k, dim,
                                     block_m, block_n, problem.causal)


def _bounds(dev, packed) -> list:
    """The kernels' last argument for a packed batch: its prefix sums ``(2, B + 1)`` int32, as
    ``dev`` passes an input (``[]`` for a rectangle)."""
    return [] if packed is None else [dev(("in", packed.bounds))[0]]


def _mod_args(dev, problem, user, ctx=None, tiles=None, over="kv") -> list:
    """The kernels' last arguments with a user's mods: their arrays' tuple, as ``dev`` passes an
    input (``[]`` without mods), and with a mask_mod a block-sparse walk's two lists at the
    kernel's ``tiles`` for the walk ``over`` (``block_sparse.lists_at``)."""
    if user is None:
        return []
    lists = lists_at(ctx, problem, tiles, over) if user.block_sparse else []
    return [tuple(dev(("in", a))[0] for a in problem.mod_args), *lists]


def _grid_dims(problem, packed) -> tuple:
    """(batch, Nq, Nk) the grids are laid over: the problem's, or a packed batch's (sequences,
    longest queries, longest keys)."""
    if packed is None:
        return problem.batch, problem.n_q, problem.n_k
    return packed.sequences, packed.max_seqlen_q, packed.max_seqlen_k


def _run(ctx, problem, algorithm, deterministic, inputs, grads, Hkv, user=None, packed=None) -> None:
    from numba_flash.kernels.bwd import ROWDOT_THREADS, bwd_dq_kernel, bwd_kernel, bwd_layout, rowdot_kernel
    from numba_flash.launch import numba_launch

    B, H, Nq, D = problem.q_shape
    Bg, Nqg, Nkg = _grid_dims(problem, packed)  # (the grids')
    block = tile_table.backward_block(D)  # square tiles (the simulator: 8 x 8)
    scale = np.float32(problem.scale)
    cap = np.float32(problem.softcap * LOG2E)  # the kernels' unit
    capped = problem.softcap > 0
    wide = problem.dtype == "bfloat16"  # the kernels read float16 or float32
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
        grid = (-(-Nkg // block) * Bg * Hkv,)
    else:
        grid = (Bg * Hkv,)
    layout = bwd_layout(algorithm, D, block)
    slopes = slopes_argument(problem, ctx.kind)
    varlen = packed is not None
    kernel = bwd_kernel(algorithm, D, block, problem.window, not deterministic or algorithm == "fa1", capped,
                        problem.alibi, user, varlen)
    mods = _mod_args(dev, problem, user, ctx, (block, block), "kv") + _bounds(dev, packed)
    numba_launch(kernel, grid, layout.threads, stream,
                 dev(("in", q), ("in", k), ("in", v), ("in", o), ("in", do), ("in", lse), ("in", dvec),
                     ("out", dq_acc), ("out", dk_k), ("out", dv_k), scale, cap, ("in", slopes)) + mods,
                 shared_mem_bytes=layout.smem_bytes)
    if deterministic and algorithm == "fa2":
        dq_layout = bwd_layout("dq", D, block)
        mods = _mod_args(dev, problem, user, ctx, (block, block), "q") + _bounds(dev, packed)
        numba_launch(bwd_dq_kernel(D, block, problem.window, capped, problem.alibi, user, varlen), (-(-Nqg // block) * Bg * H,),
                     dq_layout.threads, stream,
                     dev(("in", q), ("in", k), ("in", v), ("in", do), ("in", lse), ("in", dvec), ("out", dq_acc), scale, cap,
                         ("in", slopes)) + mods, shared_mem_bytes=dq_layout.smem_bytes)
    dev.copy_back()
    dq[...] = _narrow(dq_acc, dq, ctx.kind) if problem.dtype != "float32" else dq_acc
    if wide:
        dk[...] = _narrow(dk_k, dk, ctx.kind)
        dv[...] = _narrow(dv_k, dv, ctx.kind)


def _run_tc(ctx, problem, kind, algorithm, deterministic, inputs, grads, Hkv, tiles=None, user=None, packed=None) -> None:
    """The tensor-core kernels (``kernels.tc_bwd``) on 16-bit inputs (or float32, kind
    ``"tf32x3"``): FA-2 D = rowsum(dO * O) first, then dK/dV with dQ by atomics (or dQ by its own
    kernel when ``deterministic``), or FA-1 in one kernel; dK, dV written by the kernel in the
    inputs' dtype, dQ summed in float32."""
    import contextlib

    from numba_flash.kernels.bwd import ROWDOT_THREADS, rowdot_kernel
    from numba_flash.kernels.tc_bwd import (
        check_tc_bwd_tiles, dq_kernel_tiles, tc_bwd_dq_kernel, tc_bwd_kernel, tc_bwd_layout,
        vector_reductions,
    )
    from numba_flash.kernels.tc_ops import kernel_head_dim
    from numba_flash.launch import numba_launch
    from numba_flash.tensor_cores import bits_view, cupy_stream, kernel_arrays

    B, H, Nq, D = problem.q_shape
    Bg, Nqg, Nkg = _grid_dims(problem, packed)  # (the grids')
    varlen = packed is not None
    dim = kernel_head_dim(kind, D)
    block_m, block_n = tile_table.backward_tc_tiles(dim, kind, algorithm) if tiles is None else tiles
    check_tc_bwd_tiles(kind, dim, block_m, block_n, [algorithm] + (["dq"] if deterministic and algorithm == "fa2" else []))
    do, q, k, v, o, lse = inputs
    dq, dk, dv = grads
    dq_acc = ctx.empty((B, H, Nq, dim), "float32")  # the kernel's head dim: dQ's atomics add column pairs
    dq_acc[...] = 0
    dvec = ctx.empty((B, H, Nq), "float32")
    scale = np.float32(problem.scale)
    cap = np.float32(problem.softcap * LOG2E)  # the kernels' unit
    capped = problem.softcap > 0
    # torch: the CuPy views and padded copies on torch's stream
    on_stream = cupy_stream(ctx.stream_ptr()) if ctx.kind == "torch" else contextlib.nullcontext()
    with on_stream:
        kq, kk, kv, kdo, ko = kernel_arrays(kind, ctx.kind, q, k, v, do, o)
        sixteen = kind != "tf32x3"
        dk_b, dv_b = (bits_view(g, ctx.kind, sixteen) for g in (dk, dv))  # written by the kernel, D columns
        dq_b, lse_b, dvec_b = (bits_view(x, ctx.kind, False) for x in (dq_acc, lse, dvec))
        dev = _DeviceArgs(ctx if ctx.kind == "numpy" else ArrayContext("cupy", kq))
        stream = ctx.stream()
        if algorithm == "fa2":  # FA-2 line 4: D = rowsum(dO * O), once
            numba_launch(rowdot_kernel(None, bits=kind if sixteen else None), (-(-(B * H * Nq) // ROWDOT_THREADS),), ROWDOT_THREADS, stream,
                         dev(("in", kdo), ("in", ko), ("out", dvec_b)))
            grid = (-(-Nkg // block_n) * Bg * Hkv,)
        else:
            grid = (Bg * Hkv,)
        layout = tc_bwd_layout(algorithm, kind, dim, block_m, block_n)
        cc = None if simulated() else cuda_device_capability()
        slopes = slopes_argument(problem, "numpy" if ctx.kind == "numpy" else "cupy")
        kernel = tc_bwd_kernel(algorithm, kind, dim, block_m, block_n, problem.window, not deterministic or algorithm == "fa1",
                               vector_reductions(cc), capped, problem.alibi, user, varlen)
        mods = _mod_args(dev, problem, user, ctx, (block_m, block_n), "kv") + _bounds(dev, packed)
        numba_launch(kernel, grid, layout.threads, stream,
                     dev(("in", kq), ("in", kk), ("in", kv), ("in", ko), ("in", kdo), ("in", lse_b), ("in", dvec_b),
                         ("out", dq_b), ("out", dk_b), ("out", dv_b), scale, cap, ("in", slopes)) + mods,
                     shared_mem_bytes=layout.smem_bytes)
        if deterministic and algorithm == "fa2":
            dq_m, dq_n = dq_kernel_tiles(block_m, block_n, kind, dim)
            dq_layout = tc_bwd_layout("dq", kind, dim, dq_m, dq_n)
            mods = _mod_args(dev, problem, user, ctx, (dq_m, dq_n), "q") + _bounds(dev, packed)
            numba_launch(tc_bwd_dq_kernel(kind, dim, dq_m, dq_n, problem.window, capped, problem.alibi, user, varlen),
                         (-(-Nqg // dq_m) * Bg * H,), dq_layout.threads, stream,
                         dev(("in", kq), ("in", kk), ("in", kv), ("in", kdo), ("in", lse_b), ("in", dvec_b), ("out", dq_b),
                             scale, cap, ("in", slopes)) + mods, shared_mem_bytes=dq_layout.smem_bytes)
        dev.copy_back()
    dq[...] = _narrow(dq_acc[..., :D], dq, ctx.kind)


def cuda_device_capability():
    """numba's current device's compute capability (the kernels are compiled for it)."""
    from numba_flash._cuda import cuda

    return cuda.get_current_device().compute_capability


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
        if simulated():  # (inputs as C-ordered copies: the simulator refuses strided arguments)
            return x if role == "out" else np.array(x, order="C")
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

