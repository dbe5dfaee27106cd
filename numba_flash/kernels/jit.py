"""Compile options and constants shared by every kernel, for both worlds.

One kernel source runs on the GPU and in Numba's CUDA simulator. The simulator rejects
some ``cuda.jit`` options (``lineinfo``, ``max_registers``, ``launch_bounds``), so every
option that only the GPU understands is added here and nowhere else.
"""

from __future__ import annotations

import math

from numba_flash._cuda import cuda

from numba_flash._world import simulated

LOG2E = 1.4426950408889634  # 1 / ln(2): exp(x) = exp2(x * LOG2E); scores are kept in log2 units
LN2 = 0.6931471805599453  # ln(2): converts a log2-unit logsumexp back to natural log
NEG_INF = -math.inf  # the documented mask value (never a finite sentinel such as -1e4)


# Byte alignment of the kernels' shared tiles: 16 lets a 128-bit load read four floats
# (``ld.shared.v4``); the simulator rejects the argument, so there it is None.
SMEM_ALIGN = None if simulated() else 16


def kernel_jit(**gpu_only):
    """``cuda.jit`` for a kernel; ``gpu_only`` options are dropped in the simulator."""
    options = {} if simulated() else dict(gpu_only)
    return cuda.jit(**options)


def device_jit(func):
    """``cuda.jit(device=True)``, inlined at the NVVM level (``alwaysinline``) so that the
    caller's local arrays (the S and O micro-tiles, the copy registers) can stay in registers."""
    if simulated():
        return cuda.jit(device=True)(func)
    return cuda.jit(device=True, forceinline=True)(func)
