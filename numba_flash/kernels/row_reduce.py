"""Combine a per-row statistic across the threads that share a query row.

Each query row is split over ``threads_per_row`` consecutive lanes of one warp (see
``tiles.TileLayout``); the row max (line 9 of FlashAttention-2 Alg. 1) and the final row sum
need all of them. On the GPU that is a butterfly of warp shuffles, log2(threads_per_row)
steps with no shared memory and no barrier. Numba's simulator has no shuffles, so there the
same reduction goes through a shared scratch array between two barriers (and so does
:func:`lane_broadcast`, a warp shuffle from one lane to all). This module is the
one place the two worlds differ in kernel code.

``vals`` is a thread's local array of ``rows_per_thread`` values; on return every thread of a
row holds the combined value in it. All threads of the block must call (no divergence).
"""

from __future__ import annotations

import functools

from numba_flash._cuda import cuda

from numba_flash._world import simulated
from numba_flash.kernels.jit import device_jit


@device_jit
def add(a, b):
    """The row sum's combine (``row_allreduce(add, ...)``)."""
    return a + b


def scratch_floats(rows_per_thread: int, threads: int) -> int:
    """float32 elements of shared scratch the reduction needs (1 on the GPU: unused)."""
    return rows_per_thread * threads if simulated() else 1


@device_jit
def linear_thread():
    """The thread's index in its block (x fastest), for blocks of one to three dimensions: a
    warp is 32 consecutive of them."""
    return cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z)


@functools.lru_cache(maxsize=None)
def row_allreduce(combine, rows_per_thread: int, threads_per_row: int, threads: int):
    """A device function ``(vals, scratch) -> None`` reducing ``vals`` in place with ``combine``."""
    TM, TX, NT = rows_per_thread, threads_per_row, threads
    STEPS = TX.bit_length() - 1  # TX is a power of two
    # Lanes that take part: the whole warp, or all of a block smaller than one.
    MASK = 0xFFFFFFFF if NT >= 32 else (1 << NT) - 1

    if not simulated():

        @device_jit
        def allreduce(vals, scratch):
            for i in range(TM):
                x = vals[i]
                for s in range(STEPS):
                    x = combine(x, cuda.shfl_xor_sync(MASK, x, 1 << s))
                vals[i] = x

        return allreduce

    @device_jit
    def allreduce_shared(vals, scratch):
        tid = linear_thread()
        first = tid - tid % TX  # the row's first thread
        cuda.syncthreads()  # the previous reduction has been read by everyone
        for i in range(TM):
            scratch[i * NT + tid] = vals[i]
        cuda.syncthreads()
        for i in range(TM):
            x = scratch[i * NT + first]
            for t in range(1, TX):
                x = combine(x, scratch[i * NT + first + t])
            vals[i] = x

    return allreduce_shared


@functools.lru_cache(maxsize=None)
def lane_broadcast(threads: int):
    """A device function ``(x, lane, scratch) -> x`` of lane ``lane`` of the caller's warp,
    for every lane of it: one ``shfl.sync`` on the GPU; in the simulator a shared scratch of
    ``threads`` floats (the block's threads at most) between two barriers, so there every
    thread of the block must call it."""
    if not simulated():

        @device_jit
        def broadcast(x, lane, scratch):
            return cuda.shfl_sync(0xFFFFFFFF, x, lane)

        return broadcast

    @device_jit
    def broadcast_shared(x, lane, scratch):
        tid = linear_thread()
        cuda.syncthreads()  # the previous broadcast has been read by everyone
        scratch[tid] = x
        cuda.syncthreads()
        return scratch[tid - tid % 32 + lane]

    return broadcast_shared


if simulated():

    @device_jit
    def issue_fence():
        """Nothing: the simulator runs a thread's statements in order."""

else:

    @device_jit
    def issue_fence():
        """``__syncwarp()`` as a scheduling fence: ptxas keeps the memory accesses on their side
        of it, so the loads before it are issued before any instruction after it (seen in the
        combine kernel's SASS, ptxas 13.5 sm_90, where it is a NOP). Every lane must call it."""
        cuda.syncwarp()
