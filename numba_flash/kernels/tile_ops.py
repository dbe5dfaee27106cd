"""Device functions shared by the FA-1 and FA-2 kernels: one tile's worth of work.

Both papers' inner step is the same computation on a (Q row block, K/V tile) pair; only
the loop nest around it and where (m, l, O) live differ. So the step is written once
here and the two kernels (``fa1.py``, ``fa2.py``) call it:

- :func:`load_q_row`      Q_i (one row per thread) into registers, pre-scaled
- :func:`load_kv_tile`    K_j, V_j into shared memory, zero beyond the last key
- :func:`score_tile`      S = Q_i K_j^T for the thread's row, masked keys -> -inf, rowmax
- :func:`exp_rowsum_pv`   P~ = exp(S - m), rowsum(P~), O += P~ V_j
- :func:`nan_max`         max that propagates NaN (a NaN score must reach the output)

Thread mapping: a block of ``block_m`` threads; thread ``t`` owns query row ``t`` of the
Q tile (its q row and its O accumulator are per-thread register arrays). All threads
cooperate to load a K/V tile of ``block_n`` rows into shared memory and then each reads
every row of it (a broadcast: no bank conflicts). The row's scores for the tile go to a
shared column ``S[:, t]`` (consecutive threads, consecutive banks).

Scores are kept in log2 units: the caller folds ``scale * log2(e)`` into q, so
``exp(s - m)`` becomes one ``exp2`` (FlashAttention-2, section 3.1).

Every function is specialised by closure on (head_dim, block_m, block_n), so loop trip
counts are compile-time constants and the register arrays are indexed by constants
after unrolling (otherwise they would be demoted to local memory).
"""

from __future__ import annotations

import functools
import math
from types import ModuleType

from numba_flash._cuda import cuda, float32

from numba_flash.kernels.jit import LN2, NEG_INF, device_jit


@functools.lru_cache(maxsize=None)
def tile_ops(head_dim: int, block_m: int, block_n: int) -> ModuleType:
    """Device functions for one (head_dim, block_m, block_n) specialisation (memoised)."""
    D, BM, BN = head_dim, block_m, block_n
    D4 = D - D % 4  # the part of the head dim that splits into groups of four

    @device_jit
    def nan_max(a, b):
        """max(a, b), but NaN if either is NaN (plain max would silently drop it)."""
        if a > b or a != a:
            return a
        return b

    @device_jit
    def load_q_row(q, b, h, row, n_q, q_scale, q_reg):
        """Q_i -> registers: this thread's query row times ``scale * log2(e)`` (0 past Nq)."""
        if row < n_q:
            for d in range(D):
                q_reg[d] = float32(q[b, h, row, d]) * q_scale
        else:
            for d in range(D):
                q_reg[d] = float32(0.0)

    @device_jit
    def load_kv_tile(k, v, b, hk, col0, n_k, k_tile, v_tile):
        """K_j, V_j -> shared memory, all threads cooperating; rows past Nk are zero.

        Consecutive threads read consecutive d, so a row of a contiguous head is one
        coalesced read. Rows past Nk are never used (their scores are masked and P~V stops
        at the last visible key); zeroing them keeps stale values out of shared memory.
        """
        tid = cuda.threadIdx.x
        for idx in range(tid, BN * D, BM):
            c = idx // D
            d = idx - c * D
            col = col0 + c
            if col < n_k:
                k_tile[c, d] = float32(k[b, hk, col, d])
                v_tile[c, d] = float32(v[b, hk, col, d])
            else:
                k_tile[c, d] = float32(0.0)
                v_tile[c, d] = float32(0.0)

    @device_jit
    def score_tile(q_reg, k_tile, s_tile, col0, last_key, first_row_last_key):
        """S_ij = Q_i K_j^T for this thread's row into ``s_tile[:, tid]``; returns rowmax.

        Keys after ``last_key`` (past Nk, or hidden by the causal mask) score -inf.
        ``first_row_last_key``, the ``last_key`` of the tile's first row (the smallest
        in the block), decides block-uniformly whether any row needs the mask at all.
        """
        tid = cuda.threadIdx.x
        row_max = float32(NEG_INF)
        for c in range(BN):
            # Four independent partial sums: a single running sum would be one chain of
            # D dependent FMAs (4 cycles each); four chains keep the FMA pipe busy.
            s0 = float32(0.0)
            s1 = float32(0.0)
            s2 = float32(0.0)
            s3 = float32(0.0)
            for d in range(0, D4, 4):
                s0 += q_reg[d] * k_tile[c, d]
                s1 += q_reg[d + 1] * k_tile[c, d + 1]
                s2 += q_reg[d + 2] * k_tile[c, d + 2]
                s3 += q_reg[d + 3] * k_tile[c, d + 3]
            for d in range(D4, D):
                s0 += q_reg[d] * k_tile[c, d]
            s = (s0 + s1) + (s2 + s3)
            s_tile[c, tid] = s
            row_max = nan_max(row_max, s)
        if col0 + BN - 1 > first_row_last_key:  # block-uniform
            # Only diagonal (causal) and tail tiles get here: mask outside the hot loop,
            # so that the unmasked tiles pay nothing for it (one inner loop, two stages).
            for c in range(max(last_key - col0 + 1, 0), BN):
                s_tile[c, tid] = float32(NEG_INF)
            row_max = float32(NEG_INF)
            for c in range(BN):
                row_max = nan_max(row_max, s_tile[c, tid])
        return row_max

    @device_jit
    def exp_rowsum_pv(s_tile, v_tile, m_ref, acc, n_cols):
        """P~ = exp(S - m_ref) for this thread's row; ``acc += P~ V_j``; returns rowsum(P~).

        Only the first ``n_cols`` keys of the tile -- those this row may see -- take part:
        a key hidden by the causal mask contributes nothing, not even ``0 * NaN``.
        ``m_ref`` must not be -inf (the caller skips rows that have seen no key).
        """
        tid = cuda.threadIdx.x
        row_sum = float32(0.0)
        for c in range(n_cols):
            p = math.exp2(s_tile[c, tid] - m_ref)
            row_sum += p
            for d in range(D):
                acc[d] += p * v_tile[c, d]
        return row_sum

    @device_jit
    def visible_cols(col0, last_key):
        """How many keys of the tile starting at ``col0`` a row with ``last_key`` sees."""
        return max(0, min(BN, last_key - col0 + 1))

    @device_jit
    def rescale(acc, alpha):
        """acc *= alpha (diag(e^{m_old - m_new}) O in both papers)."""
        for d in range(D):
            acc[d] *= alpha

    @device_jit
    def zero(acc):
        for d in range(D):
            acc[d] = float32(0.0)

    @device_jit
    def last_visible_key(row, n_q, n_k, causal):
        """Index of the last key query ``row`` may see (bottom-right causal alignment).

        Query i sees key j iff j <= i + (Nk - Nq); without the mask, every key < Nk.
        """
        if causal:
            return min(n_k - 1, row + n_k - n_q)
        return n_k - 1

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

    # A module object, so that kernels can call ``ops.load_q_row(...)``: numba resolves
    # attributes of a module at compile time (it cannot do that for other objects).
    ops = ModuleType(f"numba_flash.kernels.tile_ops_d{D}_m{BM}_n{BN}")
    for func in (
        nan_max, load_q_row, load_kv_tile, score_tile, exp_rowsum_pv, visible_cols, rescale,
        zero, last_visible_key, exp2_diff, log_sum_exp, reciprocal_or_zero,
    ):
        setattr(ops, func.py_func.__name__ if hasattr(func, "py_func") else func.__name__, func)
    return ops
