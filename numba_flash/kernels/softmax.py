"""The online softmax on the device: the (m, l, O~) algebra of every kernel, in log2 units.

A query row's state is (m, l, O~): the running max of its scores (log2 units: q is scaled by
``scale * log2(e)``), the running sum of exp2(s - m), and the unnormalised output
(``numba_flash.online`` states the same algebra in NumPy, natural-log units, and its tests are
the executable statement of what these functions must do). Stated once here, for the CUDA-core
(``tile_ops``) and tensor-core (``tc_ops``) engines alike:

- the edge cases: a row that has seen no key (m = -inf, l = 0) gives O = 0 and lse = -inf,
  never NaN (:func:`finite_or_zero`, :func:`exp2_diff`, :func:`reciprocal_or_zero`,
  :func:`log_sum_exp`); a NaN score propagates (:func:`nan_max`);
- the update of a row's state by a new tile's row max (FA-2 Algorithm 1 lines 9-10):
  :func:`row_update`;
- when the reference max moves (always when it grows, or, FlashAttention-4's conditional
  rescaling, only past a threshold): :func:`max_moves` (the Hopper engine, ``kernels.fa3``);
- the merge of two states (``online.merge``; associative and commutative, the empty state its
  identity): :func:`merge_weights`, used by the split-K warp groups, the key warps of decode,
  and FA-1's per-tile update (Algorithm 1 line 11).
"""

from __future__ import annotations

import functools
import math

from numba_flash._cuda import float32

from numba_flash.kernels.jit import LN2, NEG_INF, device_jit


@device_jit
def nan_max(a, b):
    """max(a, b), but NaN if either is NaN (plain max would silently drop it)."""
    if a > b or a != a:
        return a
    return b


@device_jit
def finite_or_zero(m):
    """The max to subtract: ``m``, or 0 for a row that has seen only masked keys (then
    every score is -inf and exp2(-inf - 0) = 0, where exp2(-inf - -inf) would be NaN)."""
    if m == NEG_INF:
        return float32(0.0)
    return m


@device_jit
def exp2_diff(a, b):
    """exp2(a - b) with exp2(-inf - anything) = 0 (a row that had seen no key)."""
    if a == NEG_INF:
        return float32(0.0)
    return math.exp2(a - b)


@device_jit
def log_sum_exp(m, l_sum):
    """The natural-log logsumexp of the scaled scores from log2-unit (m, l)."""
    if l_sum == 0:
        return float32(NEG_INF)
    return (m + math.log2(l_sum)) * float32(LN2)


@device_jit
def reciprocal_or_zero(l_sum):
    """1 / l, or 0 for a row that saw no key (so O = 0 there, never NaN)."""
    if l_sum == 0:
        return float32(0.0)
    return float32(1.0) / l_sum


@device_jit
def max_moves(m_old, m_new, threshold):
    """Whether a row's reference max moves to ``m_new`` (= ``nan_max(m_old, tile max)``): past
    ``m_old + threshold`` (log2 units), or to NaN (a NaN score still poisons its row). With
    ``threshold`` 0 it moves whenever it grows (FA-2 Algorithm 1 line 9 as written); above 0,
    FlashAttention-4's conditional rescaling: (m, l, O~) stays consistent for a reference max up to
    ``threshold`` below the scores' (P~ <= 2^threshold), so most tiles leave l and O~ unscaled."""
    return m_new > m_old + threshold or m_new != m_new


@device_jit
def merge_weights(m_a, m_b, m_ref):
    """The weights of two states' (l, O~) in their merge, ``online.merge`` in log2 units:
    ``exp2(m_a - m_ref)`` and ``exp2(m_b - m_ref)`` for the merged max's reference ``m_ref``
    (``finite_or_zero(nan_max(m_a, m_b))``, or the max itself where it is known finite); an
    empty side (m = -inf) weighs 0, so the empty state is the identity."""
    return exp2_diff(m_a, m_ref), exp2_diff(m_b, m_ref)


@functools.lru_cache(maxsize=None)
def row_update(rows: int, rescale_row, rescale_acc: bool = True):
    """FA-2 Algorithm 1 lines 9-10 for a thread's ``rows`` rows, given the tile's row maxima:
    ``m_new = max(m, rowmax(S))``; where the max moved, ``l`` and (``rescale_acc``) the
    engine's accumulator rows are rescaled by ``exp2(m_old - m_new)`` (``rescale_row(acc, i,
    alpha)``, the engine's layout); ``m_ref[i]`` is the max to subtract from the scores
    (``finite_or_zero``). With ``rescale_acc=False`` O is kept normalised by the caller (FA-1's
    every-step rescale, which does not depend on m).

    ``update(m, l_run, acc, tile_max, m_ref)``."""

    @device_jit
    def update(m, l_run, acc, tile_max, m_ref):
        for i in range(rows):
            m_new = nan_max(m[i], tile_max[i])
            m_ref[i] = finite_or_zero(m_new)
            if m_new != m[i]:  # alpha == 1 when the max did not move: nothing to rescale
                alpha = exp2_diff(m[i], m_ref[i])  # e^{m^(j-1) - m^(j)}
                l_run[i] *= alpha  # Line 9: l^(j) = e^{m^(j-1) - m^(j)} l^(j-1) + ...
                if rescale_acc:
                    rescale_row(acc, i, alpha)  # Line 10: diag(e^{m^(j-1) - m^(j)}) O~^(j-1)
            m[i] = m_new

    return update
