"""Split-KV on the host: how many splits, and the launch of the combine (API.md section 2b).

``attention(..., num_splits=S)`` and ``decode`` run the FA-2 kernel ``S`` times over, each split
on a contiguous range of the K/V tiles (``kernels.kv_split``), into float32 partials that
``kernels.combine`` merges. ``num_splits=None`` asks :func:`num_splits_heuristic`: split only
when the unsplit grid leaves the GPU idle (few query tiles: decoding, short prompts with long
caches), and then into as many splits as fill whole waves of blocks -- FlashAttention's
``num_splits_heuristic`` (``csrc/flash_attn/flash_api.cpp``), restated:

- ``blocks`` unsplit blocks already make 80% of a wave of ``slots`` (SMs x resident blocks
  per SM): one split (the extra memory traffic would buy nothing);
- else, for each ``s`` up to ``min(MAX_SPLITS, slots, kv_tiles)``, the wave efficiency
  ``w / ceil(w)`` with ``w = blocks * s / slots``; the smallest ``s`` within 85% of the best
  efficiency wins (fewer splits: less partial traffic, longer ranges per block). Values of
  ``s`` that give the same tiles per split as ``s - 1`` are skipped (they only add empty
  splits).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from numba_flash._world import simulated

MAX_SPLITS = 128
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
def num_splits_heuristic(blocks: int, slots: int, kv_tiles: int, max_splits: int = MAX_SPLITS) -> int:
    """Splits for a grid of ``blocks`` unsplit blocks on ``slots`` resident blocks, ``kv_tiles``
    K/V tiles per row walk (see the module doc)."""
    if blocks >= 0.8 * slots or kv_tiles <= 1:
        return 1
    limit = max(1, min(max_splits, slots, kv_tiles))

    def tiles_per_split(s):
        return -(-kv_tiles // s)

    efficiency = {}
    for s in range(1, limit + 1):
        if s > 1 and tiles_per_split(s) == tiles_per_split(s - 1):
            continue
        waves = blocks * s / slots
        efficiency[s] = waves / math.ceil(waves)
    best = max(efficiency.values())
    return min(s for s, e in efficiency.items() if e >= 0.85 * best)


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
    slots = multiprocessors(device_id) * resident_blocks(spec.threads, spec.smem_bytes)
    return num_splits_heuristic(blocks, slots, -(-n_k // spec.block_n))


def combine(ctx, o_parts, lse_parts, o, lse, bits=None) -> None:
    """Merge the partials (``(S*B, H, Nq, >= D)`` and ``(S*B, H, Nq)`` float32, arrays of the
    call's kind or CuPy) into ``o (B, H, Nq, D)`` and ``lse``: ``kernels.combine`` on the
    caller's stream. ``bits``: ``"bf16"`` when ``o`` is a uint16 view of bfloat16 patterns."""
    from numba_flash.kernels.combine import COMBINE_THREADS, combine_kernel
    from numba_flash.launch import device_array, launch, numba_launch

    B, H, Nq, D = (int(n) for n in o.shape)
    kernel = combine_kernel(bits)
    grid, threads = (B * H * Nq,), COMBINE_THREADS
    arrays = [o_parts, lse_parts, o, lse]
    if ctx.direct_launch:
        args = [device_array(x, _kind_of_device_array(x)) for x in arrays]
        launch(kernel, grid, (threads,), ctx.stream_ptr(), args, device_id=ctx.device_id)
        return
    if ctx.on_host and not simulated():
        from numba_flash._cuda import cuda

        stream = ctx.stream()
        dev = [cuda.to_device(np.ascontiguousarray(x), stream=stream) for x in arrays[:2]]
        out = [cuda.device_array(x.shape, x.dtype, stream=stream) for x in arrays[2:]]
        numba_launch(kernel, grid, threads, stream, [*dev, *out])
        for host, d in zip(arrays[2:], out):
            d.copy_to_host(host, stream=stream)
        if stream is not None:
            stream.synchronize()
        return
    numba_launch(kernel, grid, threads, ctx.stream(), [ctx.to_kernel(x) if not ctx.on_host else x for x in arrays])


def _kind_of_device_array(x) -> str:
    from numba_flash.arrays import kind_of

    return kind_of(x)
