"""The per-row pieces of the online softmax that every kernel shares, in log2 units.

A query row's state is (m, l, O~): the running max of its scores (log2 units: q is scaled by
``scale * log2(e)``), the running sum of exp2(s - m), and the unnormalised output
(``numba_flash.online`` states the same algebra in NumPy, natural-log units). These device
functions handle the edge cases of that state once, for the CUDA-core (``tile_ops``) and the
tensor-core (``tc_ops``) steps alike: a row that has seen no key (m = -inf, l = 0) gives O = 0
and lse = -inf, never NaN; and the causal mask is bottom-right aligned (also for rows packed several per query position).
"""

from __future__ import annotations

import math

from numba_flash._cuda import float32

from numba_flash.kernels.jit import LN2, NEG_INF, device_jit


@device_jit
def last_visible_key(row, n_q, n_k, causal):
    """Index of the last key query ``row`` may see (bottom-right causal alignment).

    Query i sees key j iff j <= i + (Nk - Nq); without the mask, every key < Nk.
    """
    if causal:
        return min(n_k - 1, row + n_k - n_q)
    return n_k - 1


@device_jit
def packed_last_visible_key(row, rows_per_query, n_rows, n_k, causal):
    """``last_visible_key`` of kernel row ``row`` when each query position owns
    ``rows_per_query`` consecutive rows (decoding packs the query heads of one KV head that
    way: row = position * group + head); ``n_rows`` rows in all. 1: one row per query."""
    return last_visible_key(row // rows_per_query, n_rows // rows_per_query, n_k, causal)


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
