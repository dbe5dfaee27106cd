"""Combine a per-row statistic across the threads that share a query row.

Each query row is split over ``threads_per_row`` consecutive lanes of one warp (see
``tiles.TileLayout``); the row max (line 9 of FlashAttention-2 Alg. 1) and the final row sum
need all of them. On the GPU that is a butterfly of warp shuffles, log2(threads_per_row)
steps with no shared memory and no barrier. Numba's simulator has no shuffles, so there the
same reduction goes through a shared scratch array between two barriers. This module is the
one place the two worlds differ in kernel code.

``vals`` is a thread's local array of ``rows_per_thread`` values; on return every thread of a
row holds the combined value in it. All threads of the block must call (no divergence).
"""

from __future__ import annotations

import functools

from numba_flash._cuda import cuda

from numba_flash._world import simulated
from numba_flash.kernels.jit import device_jit


def scratch_floats(rows_per_thread: int, threads: int) -> int:
    """float32 elements of shared scratch the reduction needs (1 on the GPU: unused)."""
    return rows_per_thread * threads if simulated() else 1


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
        tid = cuda.threadIdx.x
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
