"""``numba_flash.attention``: validate, convert, launch FA-1 or FA-2, answer in kind.

The wrapper only normalises inputs; the algorithms live in ``numba_flash.kernels``.
Every check runs before any launch, and inputs are never written. On a GPU, what a call
works out from its signature (checks, tiles, kernel, grid, splits, packed parameters) is kept
as a plan (``numba_flash.plans``) and reused by later calls of that signature, which only run
the checks that depend on pointers, allocate and launch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from numba_flash import fa3, fp8, plans, switches, tile_cache, value_dim
from numba_flash.alibi import kernel_slopes
from numba_flash._cuda import cuda
from numba_flash._world import simulated
from numba_flash.arrays import (ArrayContext, array_signature, as_cupy_view, check_like, check_no_overlap, dtype_name,
                                each)
from numba_flash.kernels import KERNEL_FACTORIES
from numba_flash.kernels.fa1 import casts_output
from numba_flash.kernels.jit import LOG2E
from numba_flash.kernels.mask import window_of
from numba_flash.arch import STATIC_SMEM_LIMIT
from numba_flash.kernels.tiles import check_tiles, threads_per_block, tile_layout
from numba_flash.launch import device_array
from numba_flash.launch import launch as direct_launch
from numba_flash.launch import numba_launch
from numba_flash.launch_config import LaunchConfig
from numba_flash.problem import Problem, describe
from numba_flash.block_sparse import kernel_lists
from numba_flash.user_mods import compiling, none_given
from numba_flash.simulator import quiet_kernels
from numba_flash.specs import kernel_spec
from numba_flash.split_kv import check_num_splits, choose_num_splits, combine, plan_combine
from numba_flash.tensor_cores import launch_tc, plan_in_place, tc_tiles
from numba_flash.tile_cache import tuned_tiles
from numba_flash.tile_table import MAX_HEAD_DIM, forward_rows_per_thread, forward_tiles


def attention(
    q,
    k,
    v,
    *,
    causal=False,
    scale=None,
    algorithm="fa2",
    block_m=None,
    block_n=None,
    return_lse=False,
    precision=None,
    num_splits=None,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    mask_mod=None,
    score_mod=None,
    mod_args=(),
    block_mask=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    """Scaled dot-product attention, forward pass, by FlashAttention-1, -2 or -3.

    Shapes (like ``torch.nn.functional.scaled_dot_product_attention``)::

        q: (B, H,   Nq, D)        o:   (B, H, Nq, Dv), q's dtype
        k: (B, Hkv, Nk, D)        lse: (B, H, Nq), float32, natural log
        v: (B, Hkv, Nk, Dv)

    ``H % Hkv == 0``: query head ``h`` reads kv head ``h // (H // Hkv)`` (GQA, MQA).
    Any strides. ``D`` and ``Dv`` from 1 to 256 (``Dv != D``: ``numba_flash.value_dim``, the
    kernels at the wider, the narrower zero-padded); float16, bfloat16 or float32 in, float32 accumulation.

    ``o[b, h, i] = sum_j softmax_j(scale * q_i . k_j) v_j`` over visible keys ``j``;
    ``lse[b, h, i] = log sum_j exp(scale * q_i . k_j)``; ``scale`` defaults to 1/sqrt(D).

    ``causal=True``: query ``i`` sees key ``j`` iff ``j <= i + (Nk - Nq)``
    (bottom-right aligned, as FlashAttention >= 2.1). For Nq = 2, Nk = 5::

        1 1 1 1 0
        1 1 1 1 1

    and for Nq = 5, Nk = 2 (rows 0-2 see nothing: o = 0, lse = -inf)::

        0 0
        0 0
        0 0
        1 0
        1 1

    ``window_size=(left, right)`` (FlashAttention's sliding window, API.md section 2c): query
    ``i`` sees key ``j`` iff ``i + (Nk - Nq) - left <= j <= i + (Nk - Nq) + right``; ``-1``
    leaves that side unbounded; with ``causal=True`` the intersection (``right`` at most 0).
    FA-2 never loads the K/V tiles outside every row's window of a Q tile. ``softcap > 0``: each
    scaled score ``s`` becomes ``softcap * tanh(s / softcap)`` before the mask (Gemma 2's logit
    soft-capping); 0: off. ``alibi_slopes``: float32 ``(H,)`` or ``(B, H)``, an array of the
    inputs' library on their device (ALiBi, Press et al. 2022): query ``i``'s score of key ``j``
    gains ``-slope * |i + (Nk - Nq) - j|`` after the soft cap, before the masks. Calls with
    slopes are not planned (each is checked in full). ``mask_mod(b, h, q_idx, kv_idx, *mod_args)
    -> bool`` (True: visible) and ``score_mod(score, b, h, q_idx, kv_idx, *mod_args) -> float``
    (``score`` the scaled score in natural-log units, after softcap and ALiBi): FlexAttention's
    hooks, plain Python functions or numba device functions, compiled into the kernels (one
    compilation per function object; never stored in the compilation cache); ``mod_args``: up to
    four arrays of the inputs' library, read-only. The order on a score: scale, softcap, ALiBi,
    ``score_mod``, then the masks (``causal``, ``window_size``, ``mask_mod``). Only real (query,
    key) pairs reach the functions. With a ``mask_mod`` the kernels walk its block mask: a tile
    it hides entirely is neither loaded nor computed, and one it shows entirely skips it
    (``numba_flash.block_sparse``). ``block_mask``: that mask precomputed
    (``numba_flash.block_mask(mask_mod, B, H, Nq, Nk, ...)``, made from the same ``mask_mod``);
    without one it is derived on the device once per function, shape and ``mod_args`` contents.

    ``algorithm``: ``"fa2"`` (default; FlashAttention-2 Algorithm 1) or ``"fa1"``
    (FlashAttention Algorithm 1). Both compute the same function. ``"fa3"`` (FlashAttention-3 on
    Hopper, ``numba_flash.fa3``): float16 and bfloat16, and float8_e4m3fn inputs (torch; NumPy
    through ``ml_dtypes`` in the simulator) with
    ``q_descale`` / ``k_descale`` / ``v_descale`` (float32 numbers or ``(B, Hkv)`` arrays: the real
    inputs are ``q * q_descale``, ...), which return bfloat16 (``numba_flash.fp8``).
    ``block_m`` / ``block_n``: Q-tile and K/V-tile rows (``None``: tuned default);
    unsupported values raise ``ValueError`` listing the supported ones.

    ``precision``: where the matrix products run. ``None``: float16 and bfloat16 on tensor
    cores (``mma.sync``, float32 accumulation), float32 on CUDA cores (exact FFMA);
    ``"ieee"``: CUDA cores for any dtype (the research baseline); ``"tf32"`` / ``"tf32x3"``:
    float32 inputs on tensor cores, plain TF32 (about 1e-3 relative error) or split
    precision (three TF32 products per product, error close to float32's).

    ``num_splits`` (FA-2): cut the keys into that many contiguous ranges, run them as
    separate blocks into partial (o, lse) and merge those (split-KV; ``numba_flash.split_kv``).
    ``None``: split only when the grid would leave the GPU idle; 1: never. Any value gives the
    unsplit result within float32 rounding. ``"fa1"`` takes ``None`` or 1.

    Array kinds: NumPy (simulator without a GPU, copied with one), CuPy (in place, on
    the current stream), PyTorch CUDA tensors, ``__cuda_array_interface__`` or DLPack
    objects. The result is of the caller's kind. Deterministic: the same inputs give
    bitwise-identical outputs.

    Returns ``o``, or ``(o, lse)`` with ``return_lse=True``.
    """
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool; got {type(return_lse).__name__}")
    dims = value_dim.value_dims(q, v)  # a v head dim of its own: run at the wider one (numba_flash.value_dim)
    if dims is not None and algorithm == "fa3" and fp8.is_fp8(v):
        raise ValueError(f"float8 inputs take v with q's head dim; got {dims[0]} and {dims[1]}")
    if dims is not None:
        q, k, v, scale = value_dim.widen(q, k, v, scale, dims)
    o, lse = forward(
        q, k, v, causal=causal, scale=scale, algorithm=algorithm, block_m=block_m, block_n=block_n,
        precision=precision, num_splits=num_splits, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, mask_mod=mask_mod, score_mod=score_mod, mod_args=mod_args, block_mask=block_mask,
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
    )
    if dims is not None:
        o = value_dim.narrow(o, dims[1])
    return (o, lse) if return_lse else o


def forward(
    q,
    k,
    v,
    *,
    causal=False,
    scale=None,
    algorithm="fa2",
    block_m=None,
    block_n=None,
    kv_tile_order=None,
    out=None,
    lse_out=None,
    precision=None,
    num_splits=None,
    variant=None,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    mask_mod=None,
    score_mod=None,
    mod_args=(),
    block_mask=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    """:func:`attention` with the research knobs; always returns ``(o, lse)``.

    ``variant``: a point of the FA-1 -> FA-2 ablation space (``kernels.forward.Variant``, or a
    dict of its fields: loop_order, grid, rescale, warp_partition, o_load); it overrides
    ``algorithm`` (``FA1`` and ``FA2`` are its named points). It runs on the engine the call's
    regime picks (the same loop nests, ``kernels.forward``); split_k on tensor cores needs
    ``block_n >= 32`` (two groups of key warps, 16 keys each at least; without tiles it gets them).

    ``kv_tile_order``: a permutation of ``range(ceil(Nk / block_n))``; the kernel walks
    the K/V tiles in that order (both algorithms) -- the seed's chunk-order invariance,
    on the real kernels. ``out`` / ``lse_out``: preallocated results of the caller's
    kind (tests poison them to prove every element is written).
    """
    if isinstance(algorithm, str) and algorithm == fa3.ALGORITHM:  # Hopper's own engine and loop (numba_flash.fa3)
        return fa3.forward(q, k, v, causal=causal, scale=scale, block_m=block_m, block_n=block_n, precision=precision,
                           num_splits=num_splits, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                           mask_mod=mask_mod, score_mod=score_mod, mod_args=mod_args, block_mask=block_mask, out=out,
                           lse_out=lse_out, variant=variant, kv_tile_order=kv_tile_order, q_descale=q_descale,
                           k_descale=k_descale, v_descale=v_descale)
    if not (q_descale is None and k_descale is None and v_descale is None):
        raise ValueError("q_descale, k_descale and v_descale are for algorithm='fa3' with float8_e4m3fn inputs; "
                         f"got algorithm={algorithm!r}")
    key = None
    if (kv_tile_order is None and variant is None and alibi_slopes is None and block_mask is None
            and none_given(mask_mod, score_mod, mod_args)):
        key = _forward_key(q, k, v, out, lse_out, causal, scale, algorithm, block_m, block_n, precision, num_splits,
                           window_size, softcap)
    plan = _FORWARD_PLANS.get(key)
    if plan is None:  # a signature not seen before (or not plannable): every check
        # CAI / DLPack objects: CuPy views (the caller's buffers, no copy)
        q, k, v = (as_cupy_view(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
        out, lse_out = (None if x is None else as_cupy_view(x, name) for x, name in ((out, "out"), (lse_out, "lse_out")))
        if alibi_slopes is not None:
            alibi_slopes = as_cupy_view(alibi_slopes, "alibi_slopes")
        if isinstance(mod_args, (tuple, list)):
            mod_args = tuple(as_cupy_view(a, f"mod_args[{i}]") for i, a in enumerate(mod_args))
        ctx, call = _checked_call(q, k, v, out, lse_out, causal, scale, algorithm, block_m, block_n, precision,
                                  num_splits, variant, window_size, softcap, alibi_slopes, mask_mod, score_mod,
                                  mod_args, block_mask, block_sparse=kv_tile_order is None)
        if key is not None:
            tuned = call.regime == "ieee" and (block_m is None or block_n is None)  # tiles from the autotune cache
            tile_entries = tile_cache.load() if tuned else None
            plan = _plan_forward(ctx, call, q, k, v, out, lse_out, tile_entries)
        if plan is None:
            return _forward_unplanned(ctx, call, q, k, v, out, lse_out, kv_tile_order)
        _FORWARD_PLANS.put(key, plan)
    if out is not None or lse_out is not None:
        check_no_overlap(plan.call.kind, q, k, v, out, lse_out)
    with plan.on_device():
        o, lse = plan.allocate(out, lse_out)
        if not plan.launch((q, k, v, o, lse)):  # inputs cp.async cannot read in place: copies
            run(ArrayContext(plan.call.kind, q), plan.call, q, k, v, o, lse)
    return o, lse


_FORWARD_PLANS = plans.PlanCache()  # forward's plans by signature (_forward_key)


def _forward_key(q, k, v, out, lse_out, causal, scale, algorithm, block_m, block_n, precision, num_splits, window_size,
                 softcap):
    """The signature of a forward call (``numba_flash.plans``): everything its checks and its
    launches depend on but pointers; ``None`` when it has none (NumPy, CAI or DLPack objects)."""
    try:
        arrays = tuple(array_signature(x) for x in (q, k, v, out, lse_out) if x is not None)
    except (AttributeError, RuntimeError):  # not an array of a known library: the checks say so
        return None
    if None in arrays:
        return None
    window = plans.pair_key(window_size)
    if window is None:  # not a pair: the checks say so
        return None
    return (arrays, out is None, lse_out is None, plans.value_key(causal), plans.value_key(scale),
            plans.value_key(algorithm), plans.value_key(block_m), plans.value_key(block_n),
            plans.value_key(precision), plans.value_key(num_splits), window, plans.value_key(softcap))


def _checked_call(q, k, v, out, lse_out, causal, scale, algorithm, block_m, block_n, precision, num_splits, variant,
                  window_size=(-1, -1), softcap=0.0, alibi_slopes=None, mask_mod=None, score_mod=None, mod_args=(),
                  block_mask=None, block_sparse=False):
    """Every check of a forward call that does not depend on pointers or ``kv_tile_order``:
    its array context and launch configuration (:func:`problem.describe`, :func:`configure`)."""
    variant = _check_variant(variant, precision)
    if variant is not None:  # the loop order decides which kernel family's defaults apply
        algorithm = "fa1" if variant.loop_order == "kv_outer" else "fa2"
    checked = describe(q, k, v, causal=causal, scale=scale, algorithm=algorithm, precision=precision,
                       window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, mask_mod=mask_mod,
                       score_mod=score_mod, mod_args=mod_args, block_mask=block_mask, block_sparse=block_sparse)
    split_k = variant is not None and variant.warp_partition == "split_k"
    if split_k and checked.regime == "ieee" and block_m is None and block_n is None:
        from numba_flash.tile_table import comparison_tiles  # (the ablation's tiles: FA-2's own default
        # at D <= 64, 128 x 64, gives split_k's static tiles 107 KiB)
        block_m, block_n = comparison_tiles(checked.q_shape[3])
    call = configure(checked, block_m, block_n)  # (the tiles' checks before num_splits', as always)
    if split_k and checked.regime != "ieee" and block_n is None:
        from numba_flash.kernels.forward import tensor_core_min_block_n

        fewest = tensor_core_min_block_n(variant)  # (the simulator's 16-key tiles are too few)
        if call.block_n < fewest:
            call = configure(checked, call.block_m, fewest)
    call = replace(call, num_splits=check_num_splits(num_splits, algorithm))
    if call.regime != "ieee":
        from numba_flash.kernels.forward import check_tensor_core_variant

        check_tensor_core_variant(variant, call.block_n)
    elif variant is not None and variant.warp_partition == "split_k":
        from numba_flash.kernels.forward import SPLIT_K_GROUPS

        half = call.block_n // SPLIT_K_GROUPS
        if call.block_n % SPLIT_K_GROUPS or half < 1:
            raise ValueError(f"split_k gives each of its {SPLIT_K_GROUPS} warp groups block_n / {SPLIT_K_GROUPS} keys: "
                             f"block_n={call.block_n} does not divide")
        check_tiles(call.q_shape[3], call.block_m, half, maxreg=switches.ffma_maxreg())
        from numba_flash.kernels.forward import variant_smem_bytes

        need = variant_smem_bytes(variant, call.q_shape[3], call.block_m, call.block_n)
        if need > STATIC_SMEM_LIMIT:  # (split_k declares its tiles statically)
            raise ValueError(f"split_k with block_m={call.block_m}, block_n={call.block_n} needs {need} bytes of "
                             f"shared memory, more than the {STATIC_SMEM_LIMIT} its static tiles can have")
    call = replace(call, variant=variant if variant not in _NAMED_POINTS else None)  # named points: their kernels
    B, H, Nq, D = call.q_shape
    _check_out(out, "out", (B, H, Nq, D), call.dtype, call.kind)
    _check_out(lse_out, "lse_out", (B, H, Nq), "float32", call.kind)
    return ArrayContext(call.kind, q), call


def _plan_forward(ctx: ArrayContext, call: LaunchConfig, q, k, v, out, lse_out, tile_entries):
    """The plan of a checked forward call (``numba_flash.plans``): its arrays q, k, v, o, lse in
    that order; ``None`` when the unplanned path runs it (NumPy, the simulator, an empty
    problem, or what :func:`plan_run` leaves to it)."""
    B, H, Nq, D = call.q_shape
    if not ctx.direct_launch or B * H * Nq == 0 or call.n_k == 0:
        return None
    builder = plans.PlanBuilder(ctx, call, 5)
    inputs = [builder.caller_array(i, x) for i, x in enumerate((q, k, v))]
    o = builder.caller_array(3, out) if out is not None else builder.result_array(3, (B, H, Nq, D), call.dtype)
    lse = builder.caller_array(4, lse_out) if lse_out is not None else builder.result_array(4, (B, H, Nq), "float32")
    if not plan_run(builder, call, *inputs, o, lse):
        return None
    return builder.plan((((B, H, Nq, D), call.dtype), ((B, H, Nq), "float32")), tile_entries)


def _forward_unplanned(ctx: ArrayContext, call: LaunchConfig, q, k, v, out, lse_out, kv_tile_order):
    """A checked forward call without a plan: the per-call checks, then :func:`run`."""
    B, H, Nq, D = call.q_shape
    Nk = call.n_k
    check_no_overlap(call.kind, q, k, v, out, lse_out)
    with ctx.on_device():  # arrays on another GPU than the current one: results and launch there
        o = out if out is not None else ctx.empty((B, H, Nq, D), call.dtype)
        lse = lse_out if lse_out is not None else ctx.empty((B, H, Nq), "float32")
        if kv_tile_order is not None and call.regime != "ieee":
            raise ValueError("kv_tile_order is a knob of the CUDA-core kernels: pass precision='ieee' with it")
        order = _check_order(kv_tile_order, Nk, call.block_n)
        if B * H * Nq == 0:
            return o, lse
        if Nk == 0:  # nothing to attend to: o = 0, lse = -inf, as for a fully masked row
            o[...] = 0
            lse[...] = -math.inf
            return o, lse
        if simulated():
            _warn_if_slow(call)
        run(ctx, call, q, k, v, o, lse, order)
        return o, lse


def run(ctx: ArrayContext, call: LaunchConfig, q, k, v, o, lse, order=None, seqlens=None, rows_per_query=1) -> None:
    """Launch a validated call into ``o`` and ``lse``: the regime's kernel, split (partials, then
    the combine) when ``call.num_splits`` or its heuristic says so. ``seqlens``: valid keys
    per batch (``decode``); ``rows_per_query``: query rows packed per position (``decode``)."""
    B, H, Nq, D = call.q_shape
    spec = kernel_spec(call.algorithm, D, call.dtype, call.block_m, call.block_n, call.window, call.regime,
                       ragged=seqlens is not None, kv_stages=call.kv_stages,
                       key_warps=call.key_warps, softcap=call.softcap > 0, alibi=call.alibi,
                       user_mods=call.user_mods, varlen=call.varlen is not None, page_size=call.page_size)
    splits = choose_num_splits(call.num_splits, spec, B, H, Nq, call.n_k, ctx.device_id)
    walk = dict(seqlens=seqlens, n_splits=splits, rows_per_query=rows_per_query)
    if splits == 1:
        _run_kernel(ctx, call, q, k, v, o, lse, order, walk)
        return
    # Split-KV: float32 partials (kernels.block_info), merged by kernels.combine.
    o_parts = ctx.empty((splits * B, H, Nq, spec.head_dim), "float32")
    lse_parts = ctx.empty((splits * B, H, Nq), "float32")
    _run_kernel(ctx, call, q, k, v, o_parts, lse_parts, order, walk)
    bf16 = call.dtype == "bfloat16"
    target = ctx.empty((B, H, Nq, D), "float32") if bf16 and (call.regime == "ieee" or ctx.on_host) else o
    with quiet_kernels():
        if bf16 and target is o:  # the tensor-core path's bfloat16: written as bit patterns
            combine(ctx, o_parts, lse_parts, o, lse, bits="bf16")
        else:
            combine(ctx, o_parts, lse_parts, target, lse)
    if target is not o:
        o[...] = _narrow(target, o, ctx.kind)


def plan_run(builder: plans.PlanBuilder, call: LaunchConfig, q, k, v, o, lse, seqlens=None, rows_per_query=1) -> bool:
    """:func:`run`'s launches on a GPU, added to a plan: the same kernel specification, split
    count, partials and combine, for the call's arrays described with open pointers
    (``launch.DeviceArray``: ``PlanBuilder.caller_array`` / ``result_array``). ``False`` when
    the call needs what a plan does not do: bfloat16 on CUDA cores (widened copies), tensor-core
    inputs whose head dim or row strides need padded copies (``tensor_cores.kernel_inputs``)."""
    B, H, Nq, D = call.q_shape
    if call.alibi or call.user_mods is not None or call.regime == "ieee" and call.dtype == "bfloat16":
        # (ALiBi, a user's mods: per-call arrays)
        return False
    spec = kernel_spec(call.algorithm, D, call.dtype, call.block_m, call.block_n, call.window, call.regime,
                       ragged=seqlens is not None, kv_stages=call.kv_stages,
                       key_warps=call.key_warps, softcap=call.softcap > 0, alibi=call.alibi,
                       user_mods=call.user_mods, varlen=call.varlen is not None, page_size=call.page_size)
    splits = choose_num_splits(call.num_splits, spec, B, H, Nq, call.n_k, builder.ctx.device_id)
    kernel_o, kernel_lse = o, lse
    if splits > 1:  # float32 partials (kernels.block_info), merged by kernels.combine
        kernel_o = builder.scratch_array((splits * B, H, Nq, spec.head_dim), "float32")
        kernel_lse = builder.scratch_array((splits * B, H, Nq), "float32")
    if call.regime != "ieee":
        if not plan_in_place(builder, call, q, k, v, kernel_o, kernel_lse, seqlens, splits, rows_per_query):
            return False
    else:
        _plan_cuda_cores(builder, call, q, k, v, kernel_o, kernel_lse, seqlens, splits, rows_per_query)
    if splits > 1:  # the tensor-core path's bfloat16 is written as bit patterns
        plan_combine(builder, kernel_o, kernel_lse, o, lse, bits="bf16" if call.dtype == "bfloat16" else None)
    return True


def _run_kernel(ctx: ArrayContext, call: LaunchConfig, q, k, v, o, lse, order, walk) -> None:
    """One launch of the call's kernel into ``o`` and ``lse`` (final, or float32 partials)."""
    if call.regime != "ieee":
        with quiet_kernels():
            launch_tc(ctx, call, q, k, v, o, lse, **walk)
    elif call.dtype == "bfloat16":  # CUDA cores read float16 or float32: widen, then narrow
        B, H, Nq, D = call.q_shape
        wide = [_widen(x, ctx.kind) for x in (q, k, v)]
        narrow = dtype_name(o, ctx.kind) == "bfloat16"
        o32 = ctx.empty((B, H, Nq, D), "float32") if narrow else o
        with quiet_kernels():
            _launch(ctx, call.with_dtype("float32"), *wide, o32, lse, order, **walk)
        if narrow:
            o[...] = _narrow(o32, o, ctx.kind)
    else:
        with quiet_kernels():
            _launch(ctx, call, q, k, v, o, lse, order, **walk)


def _narrow(x32, like, kind):
    """``x32`` (float32) in ``like``'s dtype, of the call's library."""
    return x32.to(like.dtype) if kind == "torch" else x32.astype(like.dtype)


def simulated_seconds(call: LaunchConfig) -> float:
    """About how long the simulator takes for a validated call (``simulator.estimate_seconds``)."""
    from numba_flash.simulator import estimate_seconds

    B, H, Nq, D = call.q_shape
    bm, bn = call.block_m, call.block_n
    spec = kernel_spec(call.algorithm, D, call.dtype, bm, bn, call.window, call.regime, softcap=call.softcap > 0, alibi=call.alibi,
                       user_mods=call.user_mods)
    padded = tile_layout(D, bm, bn).padded_dim if call.regime == "ieee" else spec.head_dim
    return estimate_seconds(call.algorithm, B, H, Nq, call.n_k, D, bm, bn, call.causal,
                            spec.threads, padded, call.regime != "ieee")


def _warn_if_slow(call: LaunchConfig) -> None:
    """Say so before a simulated call that will take minutes (no GPU here)."""
    from numba_flash.simulator import warn_if_slow

    B, H, Nq, D = call.q_shape
    warn_if_slow(f"{call.algorithm.upper().replace('FA', 'FA-')} call (B={B} H={H} Nq={Nq} Nk={call.n_k} D={D})",
                 simulated_seconds(call))


def _widen(x, kind):
    """A float32 copy of a bfloat16 array of the caller's library."""
    return x.float() if kind == "torch" else x.astype(np.float32)


def configure(problem: Problem, block_m=None, block_n=None, **launch) -> LaunchConfig:
    """The launch configuration of a checked problem: the caller's tiles, checked
    (``ValueError`` naming the argument), or the regime's defaults (:func:`choose_tiles`);
    ``launch``: :class:`LaunchConfig`'s other fields."""
    block_m, block_n = choose_tiles(problem.regime, problem.algorithm, problem.head_dim, problem.dtype,
                                    problem.causal, block_m, block_n, problem.device_id)
    return LaunchConfig(problem, block_m, block_n, **launch)


def _check_variant(variant, precision):
    """``variant`` as a :class:`~numba_flash.kernels.forward.Variant` (or ``None``)."""
    if variant is None:
        return None
    from numba_flash.kernels.forward import Variant

    if isinstance(variant, dict):
        variant = Variant(**variant)
    if not isinstance(variant, Variant):
        raise TypeError(f"variant must be a kernels.forward.Variant or a dict of its fields; got {type(variant).__name__}")
    return variant


def _named_points():
    from numba_flash.kernels.forward import FA1, FA2

    return (FA1, FA2)


class _NamedPoints:
    """``x in _NAMED_POINTS``: is ``x`` FA-1's or FA-2's variant (imported on first use)."""

    def __contains__(self, x):
        return x is not None and x in _named_points()


_NAMED_POINTS = _NamedPoints()


def choose_tiles(mode, algorithm, head_dim, dtype, causal, block_m=None, block_n=None, device_id=None):
    """(block_m, block_n) of a call: the caller's, checked (``ValueError`` naming the argument),
    or the defaults of the regime (``mode``: ``"ieee"`` or a tensor-core kind); the CUDA-core
    defaults come from this GPU's autotune cache when it has them."""
    if mode != "ieee":
        return tc_tiles(mode, head_dim, block_m, block_n)
    bm_default, bn_default = default_tiles_for(algorithm, head_dim, dtype, causal, device_id)
    block_m = bm_default if block_m is None else block_m
    block_n = bn_default if block_n is None else block_n
    check_tiles(head_dim, block_m, block_n, forward_rows_per_thread(head_dim, block_m, block_n), switches.ffma_maxreg())
    return int(block_m), int(block_n)


def _check_out(buf, name, shape, dtype, kind) -> None:
    """A caller's result buffer must match: same library, shape, dtype, C-contiguous."""
    if buf is None:
        return
    check_like(buf, name, shape, dtype, kind)
    if kind == "numpy" and not buf.dtype.isnative:
        raise ValueError(f"{name} must be in the machine's byte order; got {buf.dtype.str}")
    contiguous = buf.is_contiguous() if kind == "torch" else buf.flags.c_contiguous
    if not contiguous or (kind == "numpy" and not buf.flags.writeable):
        raise ValueError(f"{name} must be C-contiguous and writeable")


def default_tiles_for(algorithm, head_dim, dtype, causal, device_id=None):
    """The autotuned tiles cached for this GPU (``numba-flash autotune``), else the defaults.

    ``device_id``: the GPU the arrays live on (``None``: numba's current device)."""
    if not simulated():  # the simulator has nothing to tune
        tuned = tuned_tiles(algorithm, head_dim, dtype, causal, device_id)
        if tuned is not None:
            return tuned
    return forward_tiles(algorithm, head_dim, dtype, causal)


def _check_order(kv_tile_order, n_k: int, block_n: int):
    if kv_tile_order is None:
        return None
    n_tiles = -(-n_k // block_n)
    order = np.asarray(kv_tile_order)
    if order.shape != (n_tiles,) or sorted(order.tolist()) != list(range(n_tiles)):
        raise ValueError(
            f"kv_tile_order must be a permutation of range({n_tiles}) "
            f"(ceil(Nk={n_k} / block_n={block_n})); got {order.tolist()}"
        )
    return order.astype(np.int32)


def kernel_for(algorithm, head_dim, block_m, block_n, window, dtype, permuted=False, ragged=False):
    """The compiled-kernel dispatcher ``attention`` launches for this configuration."""
    if algorithm == "fa2":
        return KERNEL_FACTORIES["fa2"](head_dim, block_m, block_n, window_of(window), bool(permuted), bool(ragged))
    return KERNEL_FACTORIES["fa1"](
        head_dim, block_m, block_n, window_of(window), bool(permuted), casts_output(dtype)
    )


def _launch(ctx: ArrayContext, call: LaunchConfig, q, k, v, o, lse, order, seqlens=None, n_splits=1, rows_per_query=1) -> None:
    """One launch of a CUDA-core kernel (a named point or ``call.variant``) into ``o`` and
    ``lse``; ``order``: the K/V tile order (NumPy int32) or ``None``."""
    permuted = order is not None
    if permuted and not simulated():
        order = cuda.to_device(order, stream=ctx.stream())  # ordered before the launch
    spec = _cuda_core_spec(call, permuted=permuted, ragged=seqlens is not None)
    grid, threads = spec.grid(*call.grid_dims, n_splits), spec.threads
    args = _cuda_core_arguments(spec, call, q, k, v, o, lse, order if permuted else None, seqlens,
                                lambda shape, dtype: ctx.empty(shape, dtype),
                                lambda shape, dtype: _placeholder(shape, dtype, ctx.device_id),
                                n_splits, rows_per_query)
    user = call.user_mods is not None  # a user's mods: one more argument, a tuple (numba's own launch)
    if ctx.direct_launch and not user:  # CuPy / torch on a GPU, unplanned: skip numba's per-call dispatch
        args = [each(lambda x, a=a: device_array(x, "numba" if a.role == "own" else ctx.kind), a.array)
                if isinstance(a, _KernelArray) else a for a in args]
        direct_launch(spec.kernel, grid, (threads,), ctx.stream_ptr(), args, shared_mem_bytes=spec.dynamic_smem,
                      device_id=ctx.device_id)
        return

    convert = {"in": ctx.to_kernel, "out": ctx.out_to_kernel, "own": lambda x: x}
    kernel_args = [each(convert[a.role], a.array) if isinstance(a, _KernelArray) else a for a in args]
    if user:
        kernel_args.append(tuple(ctx.to_kernel(a) for a in call.problem.mod_args))
        if call.user_mods.block_sparse:  # the tile lists the walk visits (numba_flash.block_sparse)
            kernel_args += kernel_lists(ctx, call)
    # (tiles above 48 KiB: dynamic shared memory, the kernel opted in above 48 KiB)
    with compiling(call.user_mods):
        numba_launch(spec.kernel, grid, threads, ctx.stream(), kernel_args, shared_mem_bytes=spec.dynamic_smem)
    if ctx.on_host and not simulated():  # NumPy in, GPU run: copy the results back
        for a, arg in zip(args, kernel_args):
            if isinstance(a, _KernelArray) and a.role == "out" and (a.array is o or a.array is lse):
                arg.copy_to_host(a.array)


def _plan_cuda_cores(builder: plans.PlanBuilder, call: LaunchConfig, q, k, v, o, lse, seqlens, n_splits,
                     rows_per_query) -> None:
    """:func:`_launch` added to a plan (named points, no ``kv_tile_order``): FA-1's O, l, m are
    scratch arrays of the plan, placeholders its constants."""
    spec = _cuda_core_spec(call, permuted=False, ragged=seqlens is not None)
    device_id = builder.ctx.device_id
    args = _cuda_core_arguments(spec, call, q, k, v, o, lse, None, seqlens, builder.scratch_array,
                                lambda shape, dtype: builder.constant(_placeholder(shape, dtype, device_id), "numba"),
                                n_splits, rows_per_query)
    args = [a.array if isinstance(a, _KernelArray) else a for a in args]
    builder.add_launch(spec.kernel, spec.grid(*call.q_shape[:3], n_splits), (spec.threads,), args, spec.dynamic_smem)


def _cuda_core_spec(call: LaunchConfig, permuted: bool, ragged: bool):
    """The launch specification of a call's CUDA-core kernel (named point or variant)."""
    D = call.q_shape[3]
    return kernel_spec(call.algorithm, D, call.dtype, call.block_m, call.block_n, call.window, "ieee",
                       ragged=ragged, permuted=permuted, variant=call.variant, softcap=call.softcap > 0, alibi=call.alibi,
                       user_mods=call.user_mods, varlen=call.varlen is not None, page_size=call.page_size)


class _KernelArray(NamedTuple):
    """An array argument of a CUDA-core kernel: ``role`` ``"in"`` (read), ``"out"`` (written;
    both of the caller's kind, or a plan's descriptions) or ``"own"`` (already numba's: the
    K/V tile order on the device, placeholders). ``array``: an array, or a tuple of them (a
    paged cache's ``(pages, block_table)``, ``kernels.paged``)."""

    role: str
    array: object


def _cuda_core_arguments(spec, call: LaunchConfig, q, k, v, o, lse, order, seqlens, new_array, placeholder, n_splits,
                         rows_per_query) -> list:
    """A CUDA-core kernel's arguments in the skeleton's order (``kernels.forward``): q, k, v, o,
    lse, o_hbm, l_hbm, m_hbm, q_scale, kv_order, seqlens, n_splits, rows_per_query, softcap_log2, alibi.

    Arrays as :class:`_KernelArray`: the caller's, ``new_array(shape, dtype)``'s (FA-1's O, l, m
    in global memory), ``order`` (on the device) or ``placeholder(shape, dtype)``'s (an argument
    the kernel's specialisation never reads); scalars as NumPy float32 / int32."""
    B, H, Nq, D = call.q_shape
    unused4 = _KernelArray("own", placeholder((1, 1, 1, 1), "float32"))
    unused3 = _KernelArray("own", placeholder((1, 1, 1), "float32"))
    if not spec.kv_outer:
        state = [unused4, unused3, unused3]  # O, l, m stay on chip
        results = [_KernelArray("out", o), _KernelArray("out", lse)]
    else:
        cast_out = casts_output(call.dtype)
        # FA-1's O, l, m in global memory; O is the float32 output itself unless it is cast.
        o_hbm = _KernelArray("out", new_array((B, H, Nq, D), "float32") if cast_out else o)
        state = [o_hbm, _KernelArray("out", new_array((B, H, Nq), "float32")),
                 _KernelArray("out", new_array((B, H, Nq), "float32"))]
        # Not casting, the kernel never reads `o`; a placeholder avoids passing o twice.
        results = [_KernelArray("out", o) if cast_out else unused4, _KernelArray("out", lse)]
    kv_order = _KernelArray("own", placeholder(1, "int32") if order is None else order)  # unpermuted: not read
    lengths = _KernelArray("in", seqlens) if seqlens is not None else _KernelArray("own", placeholder(1, "int32"))
    q_scale = np.float32(call.scale * LOG2E)
    if call.alibi:  # (B, H) slopes in log2 units (numba_flash.alibi)
        slopes = _KernelArray("in", kernel_slopes(call.problem.alibi_slopes, B, call.kind))
    else:
        slopes = _KernelArray("own", placeholder((1, 1), "float32"))
    return [_KernelArray("in", q), _KernelArray("in", k), _KernelArray("in", v), *results, *state, q_scale, kv_order,
            lengths, np.int32(n_splits), np.int32(rows_per_query),  # split-KV (kernels.block_info)
            np.float32(call.softcap_log2), slopes]


@functools.lru_cache(maxsize=None)
def _placeholder(shape, dtype, device_id=None):
    """A tiny array for a kernel argument that its specialisation never reads (one per device;
    ``None``: numba's current device, for NumPy inputs)."""
    placeholder = np.zeros(shape, dtype=dtype)
    if simulated():
        return placeholder
    if device_id is None:
        return cuda.to_device(placeholder)
    with cuda.gpus[device_id]:
        return cuda.to_device(placeholder)
