"""The merge of partial softmax states on the GPU: split-KV's second kernel.

The partials of a split launch (``kv_split``) are finalised states over disjoint key ranges:
(O_s, lse_s). As a state of the online softmax (``numba_flash.online``) a finalised partial is
(m = lse_s, l = 1, acc = O_s), and merging them all and finalising once gives::

    lse = m + log sum_s exp(lse_s - m)          m = max_s lse_s
    O   = sum_s exp(lse_s - lse) O_s

which is ``online.merge`` folded over the splits, then ``online.finalize`` (the NumPy twin,
``online.combine``, states it so; the merge is associative and commutative, so any number of
splits in any order gives the same result up to rounding). A split that saw no key (lse = -inf)
weighs exp(-inf) = 0; if every split is empty the row gives O = 0, lse = -inf, as an unsplit row
that sees no key. NaN propagates (a NaN lse makes m NaN).

Launch (``combine_kernel``): ``grid = (B * H * Nq,)`` rows, ``block = (COMBINE_THREADS,)``.
Arguments: ``o_parts (S*B, H, Nq, D) float32``, ``lse_parts (S*B, H, Nq) float32`` (split s
of batch b at ``s * B + b``, ``S <= MAX_PARTIALS``), ``o (B, H, Nq, D)`` out (float32 or float16
values, or uint16 bit patterns of the 16-bit ``bits`` kind), ``lse (B, H, Nq) float32`` out.

The block reads every lse_s once (one load per thread) into shared memory, where each thread
finds the merged lse and the block turns them into the weights exp(lse_s - lse); then
``COMBINE_GROUPS`` groups of ``COMBINE_COLS`` threads each sum a share of the splits for the
same head-dim columns, and add their sums through shared memory. So a row waits on about
``2 + S / (4 COMBINE_GROUPS)`` loads in a row (ptxas keeps ~4 of a loop's loads in flight), where the
first version, one thread per column walking all S partials and reading every lse three
times, waited on ~3 S / 4 (47 at S = 63; SASS: loops unrolled by 4; an estimate of ~10 us of
L2 latency at decode's 63 splits, against ~185 us for the whole 131072-key call).
"""

from __future__ import annotations

import functools
import math

from numba_flash._cuda import cuda, float32

from numba_flash._world import simulated
from numba_flash.kernels import mma
from numba_flash.kernels.jit import NEG_INF, device_jit, kernel_jit

MAX_PARTIALS = 128  # partials a row may have: their weights sit in shared memory
COMBINE_COLS = 32 if simulated() else 128  # threads over the head dim (the simulator: fewer threads)
COMBINE_GROUPS = 2 if simulated() else 4  # thread groups over the splits
COMBINE_THREADS = COMBINE_COLS * COMBINE_GROUPS


@device_jit
def combined_lse(lse_values, n_splits):
    """``m + log sum_s exp(lse_s - m)`` of one row's ``n_splits`` partials ``lse_values[s]``
    (-inf when every partial is empty; NaN when one is NaN)."""
    m = float32(NEG_INF)
    for s in range(n_splits):
        x = lse_values[s]
        if x > m or x != x:  # a NaN max stays NaN
            m = x
    if m == NEG_INF:
        return m
    total = float32(0.0)
    for s in range(n_splits):
        total += math.exp(lse_values[s] - m)
    return m + math.log(total)


@device_jit
def split_weight(lse_s, lse):
    """exp(lse_s - lse): the share of a partial in the merged row (0 for an empty partial)."""
    if lse_s == NEG_INF:
        return float32(0.0)
    return math.exp(lse_s - lse)


@functools.lru_cache(maxsize=None)
def combine_kernel(bits: str | None = None, cols: int = COMBINE_COLS, groups: int = COMBINE_GROUPS):
    """The combine kernel, launched with ``cols * groups`` threads; ``bits``: ``None`` (``o``
    holds values) or ``"f16"`` / ``"bf16"`` (``o`` holds the 16-bit patterns of that kind, as
    the tensor-core path passes it)."""
    BITS = None if bits is None else mma.BITS_16[bits]
    NC, NG = cols, groups
    NT = NC * NG

    @kernel_jit(fastmath={"contract", "afn", "arcp"})
    def combine(o_parts, lse_parts, o, lse):
        batch, n_heads, n_q, dim = o.shape[0], o.shape[1], o.shape[2], o.shape[3]
        n_splits = lse_parts.shape[0] // batch
        row = cuda.blockIdx.x
        i = row % n_q
        bh = row // n_q
        h = bh % n_heads
        b = bh // n_heads
        tid = cuda.threadIdx.x
        weights = cuda.shared.array(MAX_PARTIALS, float32)  # the partials' lse, then their weights
        sums = cuda.shared.array((NG, NC), float32)  # each group's sums of one chunk of columns
        for s in range(tid, n_splits, NT):
            weights[s] = lse_parts[s * batch + b, h, i]
        cuda.syncthreads()
        total = combined_lse(weights, n_splits)  # every thread (shared reads: broadcasts)
        cuda.syncthreads()  # every lse has been read before it becomes a weight
        for s in range(tid, n_splits, NT):
            weights[s] = split_weight(weights[s], total)
        cuda.syncthreads()
        g = tid // NC
        c = tid - g * NC
        for d0 in range(0, dim, NC):
            d = d0 + c
            acc = float32(0.0)
            if total != NEG_INF and d < dim:
                # Unconditional loads, so ptxas can keep several in flight (a load under
                # ``if w != 0`` waited for the one before it: ~0.25 us per split on the H200,
                # 9.7 us at 32 splits). Every split writes its partial, an empty one O = 0 and
                # weight 0, so the product is the one the skip gave.
                for s in range(g, n_splits, NG):
                    acc += weights[s] * o_parts[s * batch + b, h, i, d]
            sums[g, c] = acc
            cuda.syncthreads()
            if g == 0 and d < dim:
                for gg in range(1, NG):
                    acc += sums[gg, c]
                if BITS is None:
                    o[b, h, i, d] = acc
                else:
                    o[b, h, i, d] = BITS(acc)
            cuda.syncthreads()  # the sums have been read before the next chunk's
        if tid == 0:
            lse[b, h, i] = total

    return combine
