"""Score modifications on the device: what a scaled score goes through before the mask.

API.md section 2c's order on each score: scale, softcap, (ALiBi, ``score_mod``), then the masks.
The kernels keep scores in log2 units (``scale * log2(e)``, so that exp is one exp2), and so do
these functions: a natural-log cap ``c`` is ``c * log2(e)`` here (the host passes it so,
``softcap_log2``), and ``c tanh(s / c)`` is the same function in either unit.

- :func:`soft_cap`: the forward's ``s -> c tanh(s / c)`` (Gemma 2's logit soft-capping);
- :func:`soft_cap_with_slope`: the same and its derivative ``1 - tanh(s / c)^2``, by which the
  backward multiplies dS (the gradient reaches the score before the cap through it);
- :func:`tile_soft_capper`: the forward's routine over an engine's register tile.

Each is compiled in only where the kernel's ``softcap`` flag (a compile-time constant) is set:
a kernel without it has not one instruction more.
"""

from __future__ import annotations

import functools
import math

from numba_flash._cuda import float32

from numba_flash.kernels.jit import device_jit


@device_jit
def soft_cap(x, cap):
    """``cap * tanh(x / cap)`` (``cap > 0``; a NaN stays NaN, +-inf goes to +-cap)."""
    return cap * math.tanh(x / cap)


@device_jit
def soft_cap_with_slope(x, cap):
    """(``soft_cap(x, cap)``, its derivative ``1 - tanh(x / cap)^2``)."""
    t = math.tanh(x / cap)
    return cap * t, float32(1.0) - t * t


@functools.lru_cache(maxsize=None)
def tile_soft_capper(n_i: int, n_j: int):
    """``cap_tile(s, cap)``: :func:`soft_cap` on each entry of an ``n_i x n_j`` register tile."""

    @device_jit
    def cap_tile(s, cap):
        for i in range(n_i):
            for j in range(n_j):
                s[i, j] = soft_cap(s[i, j], cap)

    return cap_tile
