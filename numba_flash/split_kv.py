"""Split-KV on the host: how many splits, and the launch of the combine (API.md section 2b).

``attention(..., num_splits=S)`` and ``decode`` run the FA-2 kernel ``S`` times over, each split
on a contiguous range of the K/V tiles (``kernels.block_info``), into float32 partials that
``kernels.combine`` merges. ``num_splits=None`` asks :func:`num_splits_heuristic`. The idea is FlashAttention's
(``num_splits_heuristic`` in ``csrc/flash_attn/flash_api.cpp``: split only when the grid leaves
the GPU idle, into a count that fills whole waves); the rules are ours, fitted to what a split
launch measured on the H200 (``docs/results.md``, section 8):

- ``blocks`` unsplit blocks already fill 75% of the GPU's resident blocks (``slots`` = SMs x
  blocks per SM, counting at most ``MAX_SLOTS_PER_SM`` = 2 per SM, as ``flash_api.cpp`` passes
  ``multiProcessorCount * 2``; measured on the H200, 2026-11-30: decoding B1 Hkv8 131072 keys
  with 32 splits (1.94 one-warp blocks per SM) 0.1475 ms against 63 (3.8 per SM, 75% of the 5
  that fit) 0.1548, and 1.036 ms against 1.056 at 1M keys: more concurrent K/V streams per SM
  only lengthen the combine): one split (the partials' traffic and the combine's launch would buy nothing);
- fewer than ``2 * MIN_TILES_PER_SPLIT`` K/V tiles: one split (a split must walk at least
  ``MIN_TILES_PER_SPLIT`` tiles to pay for its partial);
- else the fewest splits that fill 75% of the slots (``s0``), or a few more: the first ``s`` in
  ``[s0, 2 s0]`` whose blocks spread evenly over the SMs (``w / ceil(w) >= 0.95`` with
  ``w = blocks * s / SMs``; the blocks of a memory-bound kernel share their SM's bandwidth, so an
  SM with one block more than the others finishes last), else the most even of them; at most
  ``MAX_SPLITS`` and ``kv_tiles / MIN_TILES_PER_SPLIT``.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from numba_flash._world import simulated
from numba_flash.kernels.combine import MAX_PARTIALS, combine_launch
from numba_flash.launch import device_array, launch, numba_launch

MAX_SPLITS = MAX_PARTIALS  # the combine kernel: up to 4 lse per lane of a warp, 16 warps per row
MIN_TILES_PER_SPLIT = 4  # shorter walks do not pay for the partials and the second launch
FILL = 0.75  # share of the GPU's resident blocks a grid must fill to run unsplit
MAX_SLOTS_PER_SM = 2  # resident blocks per SM the heuristic counts (FlashAttention's 2 x SMs)
SM_SHARED_BYTES = 228 * 1024  # shared memory per SM on H100 / H200 (the blocks' share)


def check_num_splits(num_splits, algorithm: str):
    """``num_splits`` as given (``None`` or an int >= 1); ``ValueError`` / ``TypeError`` otherwise."""
    if num_splits is None:
        return None
    if isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, (int, np.integer)):
        raise TypeError(f"num_splits must be a positive int or None; got {type(num_splits).__name__}")
    if not 1 <= int(num_splits) <= MAX_SPLITS:
        raise ValueError(f"num_splits must be from 1 to {MAX_SPLITS}; got {int(num_splits)}")
    if algorithm == "fa1" and int(num_splits) > 1:
        raise ValueError("num_splits > 1 splits the K/V walk of FA-2; algorithm='fa1' takes num_splits=None or 1")
    return int(num_splits)


@functools.lru_cache(maxsize=4096)
def num_splits_heuristic(blocks: int, sms: int, resident: int, kv_tiles: int, max_splits: int = MAX_SPLITS) -> int:
    """Splits for a grid of ``blocks`` unsplit blocks on ``sms`` SMs holding ``resident`` blocks
    each, ``kv_tiles`` K/V tiles per row walk (the rules: the module doc)."""
    slots = sms * min(resident, MAX_SLOTS_PER_SM)
    if blocks >= FILL * slots or kv_tiles < 2 * MIN_TILES_PER_SPLIT:
        return 1
    limit = max(1, min(max_splits, kv_tiles // MIN_TILES_PER_SPLIT))
    first = min(limit, math.ceil(FILL * slots / blocks))

    def balance(s):
        waves = blocks * s / sms
        return waves / math.ceil(waves)

    candidates = range(first, min(limit, 2 * first) + 1)
    even = [s for s in candidates if balance(s) >= 0.95]
    return even[0] if even else max(candidates, key=balance)


@functools.lru_cache(maxsize=None)
def multiprocessors(device_id) -> int:
    """SMs of a GPU (``None``: numba's current one); 1 in the simulator (nothing to fill)."""
    if simulated():
        return 1
    from numba_flash._cuda import cuda

    dev = cuda.get_current_device() if device_id is None else cuda.list_devices()[device_id]
    return int(dev.MULTIPROCESSOR_COUNT)


def resident_blocks(threads: int, smem_bytes: int) -> int:
    """Blocks of a kernel one SM holds, estimated from its shared memory and threads (the
    heuristic's wave size; registers are not known before the kernel is compiled)."""
    return max(1, min(SM_SHARED_BYTES // (smem_bytes + 1024), 1024 // threads, 32))


def choose_num_splits(num_splits, spec, batch: int, heads: int, n_q: int, n_k: int, device_id) -> int:
    """The caller's ``num_splits``, or the heuristic's for this launch specification."""
    if num_splits is not None:
        return num_splits
    if spec.algorithm != "fa2":
        return 1
    blocks = spec.grid(batch, heads, n_q)[0]
    return num_splits_heuristic(blocks, multiprocessors(device_id), resident_blocks(spec.threads, spec.smem_bytes),
                                -(-n_k // spec.block_n))


def combine(ctx, o_parts, lse_parts, o, lse, bits=None) -> None:
    """Merge the partials (``(S*B, H, Nq, >= D)`` and ``(S*B, H, Nq)`` float32, arrays of the
    call's kind) into ``o (B, H, Nq, D)`` and ``lse``: ``kernels.combine`` on the caller's
    stream. ``bits``: ``"bf16"`` when ``o`` is bfloat16 (written as its bit patterns)."""
    kernel, grid, block = combine_launch(int(lse_parts.shape[0]) // int(o.shape[0]), o.shape, bits)
    if ctx.direct_launch:
        args = combine_arguments(*(device_array(x, ctx.kind) for x in (o_parts, lse_parts, o, lse)), bits)
        launch(kernel, grid, block, ctx.stream_ptr(), args, device_id=ctx.device_id)
        return
    if bits:
        o = o.view(np.uint16)  # NumPy (ml_dtypes.bfloat16)
    arrays = [o_parts, lse_parts, o, lse]
    if ctx.on_host and not simulated():
        from numba_flash._cuda import cuda

        stream = ctx.stream()
        dev = [cuda.to_device(np.ascontiguousarray(x), stream=stream) for x in arrays[:2]]
        out = [cuda.device_array(x.shape, x.dtype, stream=stream) for x in arrays[2:]]
        numba_launch(kernel, grid, block, stream, [*dev, *out])
        for host, d in zip(arrays[2:], out):
            d.copy_to_host(host, stream=stream)
        if stream is not None:
            stream.synchronize()
        return
    numba_launch(kernel, grid, block, ctx.stream(), [ctx.to_kernel(x) if not ctx.on_host else x for x in arrays])


def plan_combine(builder, o_parts, lse_parts, o, lse, bits=None) -> None:
    """:func:`combine` added to a plan (``plans.PlanBuilder``), for arrays described with
    open pointers (``launch.DeviceArray``)."""
    kernel, grid, block = combine_launch(int(lse_parts.shape[0]) // int(o.shape[0]), o.shape, bits)
    builder.add_launch(kernel, grid, block, combine_arguments(o_parts, lse_parts, o, lse, bits))


def combine_arguments(o_parts, lse_parts, o, lse, bits=None) -> list:
    """The combine kernel's arguments (``launch.DeviceArray``): a bfloat16 ``o`` as uint16."""
    return [o_parts, lse_parts, o._replace(dtype="uint16") if bits else o, lse]
