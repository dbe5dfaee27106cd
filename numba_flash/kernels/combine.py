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

Launch (``combine_kernel``): ``grid = (B * H * Nq,)`` rows, ``block = (threads,)`` over the head
dim. Arguments: ``o_parts (S*B, H, Nq, D) float32``, ``lse_parts (S*B, H, Nq) float32`` (split s
of batch b at ``s * B + b``), ``o (B, H, Nq, D)`` out (float32 or float16 values, or uint16 bit
patterns of the 16-bit ``bits`` kind), ``lse (B, H, Nq) float32`` out.
"""

from __future__ import annotations

import functools
import math

from numba_flash._cuda import cuda, float32

from numba_flash.kernels import mma
from numba_flash.kernels.jit import NEG_INF, device_jit, kernel_jit

COMBINE_THREADS = 128


@device_jit
def combined_lse(lse_parts, n_splits, batch, b, h, i):
    """``m + log sum_s exp(lse_s - m)`` of row (b, h, i) over its ``n_splits`` partials
    (-inf when every partial is empty; NaN when one is NaN)."""
    m = float32(NEG_INF)
    for s in range(n_splits):
        x = lse_parts[s * batch + b, h, i]
        if x > m or x != x:  # a NaN max stays NaN
            m = x
    if m == NEG_INF:
        return m
    total = float32(0.0)
    for s in range(n_splits):
        total += math.exp(lse_parts[s * batch + b, h, i] - m)
    return m + math.log(total)


@device_jit
def split_weight(lse_s, lse):
    """exp(lse_s - lse): the share of a partial in the merged row (0 for an empty partial)."""
    if lse_s == NEG_INF:
        return float32(0.0)
    return math.exp(lse_s - lse)


@functools.lru_cache(maxsize=None)
def combine_kernel(bits: str | None = None, threads: int = COMBINE_THREADS):
    """The combine kernel; ``bits``: ``None`` (``o`` holds values) or ``"f16"`` / ``"bf16"``
    (``o`` holds the 16-bit patterns of that kind, as the tensor-core path passes it)."""
    BITS = None if bits is None else mma.BITS_16[bits]
    NT = threads

    @kernel_jit(fastmath={"contract", "afn", "arcp"})
    def combine(o_parts, lse_parts, o, lse):
        batch, n_heads, n_q, dim = o.shape[0], o.shape[1], o.shape[2], o.shape[3]
        n_splits = lse_parts.shape[0] // batch
        row = cuda.blockIdx.x
        i = row % n_q
        bh = row // n_q
        h = bh % n_heads
        b = bh // n_heads
        total = combined_lse(lse_parts, n_splits, batch, b, h, i)
        for d in range(cuda.threadIdx.x, dim, NT):
            acc = float32(0.0)
            if total != NEG_INF:
                for s in range(n_splits):
                    w = split_weight(lse_parts[s * batch + b, h, i], total)
                    if w != 0:  # an empty partial's O is 0 anyway; skip its read
                        acc += w * o_parts[s * batch + b, h, i, d]
            if BITS is None:
                o[b, h, i, d] = acc
            else:
                o[b, h, i, d] = BITS(acc)
        if cuda.threadIdx.x == 0:
            lse[b, h, i] = total

    return combine
