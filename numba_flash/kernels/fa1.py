"""FlashAttention-1 forward (Dao et al. 2022, "FlashAttention", Algorithm 1), in numba.cuda.

Loop order: one thread block per (batch, head) -- the paper parallelises over batch and
heads only. The outer loop walks the K/V tiles (line 5) and loads each once into
shared memory (line 6); the inner loop walks every Q tile (line 7), and each inner step
reads Q_i, O_i, l_i, m_i from global memory (line 8), merges the tile's contribution
into them, and writes O_i (normalised, line 12) and l_i, m_i (line 13) back. So O, l, m
make one round trip through HBM per K/V tile: the traffic that FA-2 removes.

Thread ``t`` of the block always owns row ``t`` of every Q tile, so the O/l/m round trip
of a row is read and written by one thread: no barrier is needed around it.

The per-tile work (load, scores, exp, P~V) is shared with FA-2 in ``tile_ops``.
"""

from __future__ import annotations

import functools

from numba_flash._cuda import cuda, float32

from numba_flash.kernels.jit import NEG_INF, kernel_jit
from numba_flash.kernels.tile_ops import tile_ops


def casts_output(dtype: str) -> bool:
    """True when O lives in a float32 scratch in HBM and a final pass casts it to the
    output dtype (FA-1 keeps O, l, m in float32, line 2); float32 outputs are O itself."""
    return dtype != "float32"


@functools.lru_cache(maxsize=None)
def fa1_kernel(
    head_dim: int, block_m: int, block_n: int, causal: bool, permuted: bool = False, cast_out: bool = False
):
    """The FA-1 kernel for (head_dim, block_m, block_n, causal, permuted, cast_out) (memoised).

    Launch: ``grid = (B * H,)``, ``block = (block_m,)``.
    Arguments: ``q (B,H,Nq,D)``, ``k, v (B,Hkv,Nk,D)``; ``o_hbm (B,H,Nq,D) float32``,
    ``l_hbm, m_hbm (B,H,Nq) float32``: the paper's O, l, m in global memory (initialised
    here, line 2); ``o``: the output in q's dtype, written from ``o_hbm`` at the end
    when ``cast_out`` (otherwise ``o_hbm`` is the float32 output and ``o`` is unused);
    ``lse (B,H,Nq) float32`` out; ``q_scale = scale*log2(e)``; ``kv_order``: an int32
    permutation of the K/V tiles, read only when ``permuted``.
    """
    D, BM, BN = head_dim, block_m, block_n
    CAUSAL = bool(causal)
    PERMUTED = bool(permuted)
    CAST_OUT = bool(cast_out)
    ops = tile_ops(D, BM, BN)  # the tile steps both kernels share

    @kernel_jit(fastmath={"contract", "afn", "arcp"})
    def fa1_forward(q, k, v, o_hbm, l_hbm, m_hbm, o, lse, q_scale, kv_order):
        n_heads = q.shape[1]
        n_q = q.shape[2]
        n_k = k.shape[2]
        group = n_heads // k.shape[1]  # query heads per kv head (GQA / MQA)
        n_q_tiles = (n_q + BM - 1) // BM  # Tr (line 3)
        n_kv_tiles = (n_k + BN - 1) // BN  # Tc (line 3)

        bh = cuda.blockIdx.x
        b = bh // n_heads
        h = bh - b * n_heads
        hk = h // group
        tid = cuda.threadIdx.x

        k_tile = cuda.shared.array((BN, D), float32)
        v_tile = cuda.shared.array((BN, D), float32)
        s_tile = cuda.shared.array((BN, BM), float32)
        q_reg = cuda.local.array(D, float32)
        acc = cuda.local.array(D, float32)

        # Line 2: O = 0, l = 0, m = -inf in HBM (each thread, the rows it will own).
        for i in range(n_q_tiles):
            row = i * BM + tid
            if row < n_q:
                for d in range(D):
                    o_hbm[b, h, row, d] = float32(0.0)
                l_hbm[b, h, row] = float32(0.0)
                m_hbm[b, h, row] = float32(NEG_INF)

        for jj in range(n_kv_tiles):  # Line 5: for 1 <= j <= Tc
            j = kv_order[jj] if PERMUTED else jj
            col0 = j * BN
            cuda.syncthreads()  # everyone is done reading the previous K_j, V_j
            ops.load_kv_tile(k, v, b, hk, col0, n_k, k_tile, v_tile)  # Line 6
            cuda.syncthreads()  # the whole tile is in shared memory before anyone reads it

            for i in range(n_q_tiles):  # Line 7: for 1 <= i <= Tr
                # causal: skip Q tiles for which every key of K_j is masked (block-uniform)
                if col0 > ops.last_visible_key(min(i * BM + BM, n_q) - 1, n_q, n_k, CAUSAL):
                    continue
                row = i * BM + tid
                ops.load_q_row(q, b, h, row, n_q, q_scale, q_reg)  # Line 8: load Q_i
                # Line 9: S_ij = Q_i K_j^T; line 10: m~_ij = rowmax(S_ij).
                last_key = ops.last_visible_key(row, n_q, n_k, CAUSAL)
                first_row_last_key = ops.last_visible_key(i * BM, n_q, n_k, CAUSAL)
                tile_max = ops.score_tile(q_reg, k_tile, s_tile, col0, last_key, first_row_last_key)
                if row < n_q and tile_max != NEG_INF:
                    # Line 10: P~_ij = exp(S_ij - m~_ij), l~_ij = rowsum(P~_ij); acc = P~_ij V_j.
                    ops.zero(acc)
                    l_tile = ops.exp_rowsum_pv(s_tile, v_tile, tile_max, acc, ops.visible_cols(col0, last_key))
                    # Line 8: load O_i, l_i, m_i from HBM.
                    l_old = l_hbm[b, h, row]
                    m_old = m_hbm[b, h, row]
                    # Line 11: m_new = max(m_i, m~_ij); l_new = e^{m_i-m_new} l_i + e^{m~_ij-m_new} l~_ij.
                    m_new = ops.nan_max(m_old, tile_max)
                    alpha_old = ops.exp2_diff(m_old, m_new)
                    alpha_tile = ops.exp2_diff(tile_max, m_new)
                    l_new = alpha_old * l_old + alpha_tile * l_tile
                    # Line 12: O_i <- diag(l_new)^-1 (diag(l_i) e^{m_i-m_new} O_i + e^{m~_ij-m_new} P~_ij V_j).
                    inv_l = ops.reciprocal_or_zero(l_new)
                    w_old = l_old * alpha_old * inv_l
                    w_tile = alpha_tile * inv_l
                    for d in range(D):
                        o_hbm[b, h, row, d] = w_old * o_hbm[b, h, row, d] + w_tile * acc[d]
                    # Line 13: l_i <- l_new, m_i <- m_new to HBM.
                    l_hbm[b, h, row] = l_new
                    m_hbm[b, h, row] = m_new

        # Line 16: return O (cast to q's dtype when O was kept in float32) and L = m + log l.
        for i in range(n_q_tiles):
            row = i * BM + tid
            if row < n_q:
                if CAST_OUT:
                    for d in range(D):
                        o[b, h, row, d] = o_hbm[b, h, row, d]
                lse[b, h, row] = ops.log_sum_exp(m_hbm[b, h, row], l_hbm[b, h, row])

    return fa1_forward
