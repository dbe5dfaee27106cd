"""FlashAttention-1 forward (Dao et al. 2022, "FlashAttention", Algorithm 1), in numba.cuda.

Loop order: one thread block per (batch, head) -- the paper parallelises over batch and
heads only. The outer loop walks the K/V tiles (line 5) and loads each once into
shared memory (line 6); the inner loop walks every Q tile (line 7), and each inner step
reads Q_i, O_i, l_i, m_i from global memory (line 8), merges the tile's contribution
into them, and writes O_i (normalised, line 12) and l_i, m_i (line 13) back. So O, l, m
make one round trip through HBM per K/V tile: the traffic that FA-2 removes.

The tile work (loads, scores, exp, P~V) is the same register micro-tiled code as FA-2's
(``tile_ops``). A thread always owns the same rows and output columns of every Q tile, so
the O round trip of an element is read and written by one thread. l_i and m_i are written
by the first thread of each row after a barrier that follows every thread's read of them.
"""

from __future__ import annotations

import functools

from numba_flash._cuda import cuda, float32, int32

from numba_flash.kernels.jit import NEG_INF, SMEM_ALIGN, kernel_jit
from numba_flash.kernels.row_reduce import scratch_floats
from numba_flash.kernels.tile_ops import tile_ops
from numba_flash.kernels.tiles import VEC, register_cap


def casts_output(dtype: str) -> bool:
    """True when O lives in a float32 scratch in HBM and a final pass casts it to the
    output dtype (FA-1 keeps O, l, m in float32, line 2); float32 outputs are O itself."""
    return dtype != "float32"


@functools.lru_cache(maxsize=None)
def fa1_kernel(
    head_dim: int, block_m: int, block_n: int, causal: bool, permuted: bool = False, cast_out: bool = False
):
    """The FA-1 kernel for (head_dim, block_m, block_n, causal, permuted, cast_out) (memoised).

    Launch: ``grid = (B * H,)``, ``block = (tile_layout(...).threads,)``.
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
    L = ops.layout
    TM, TN, DG = L.rows_per_thread, L.cols_per_thread, L.dim_groups
    Q_FLOATS, K_FLOATS, V_FLOATS, P_FLOATS = L.q_floats, L.k_floats, L.v_floats, L.p_floats
    SCRATCH = scratch_floats(TM, L.threads)
    KV_LOADS = L.kv_loads
    ACC_COLS = VEC * DG  # output columns per thread

    @kernel_jit(fastmath={"contract", "afn", "arcp"}, max_registers=register_cap(D))
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
        first_of_row = ops.thread_col() == 0

        q_s = cuda.shared.array(Q_FLOATS, float32, SMEM_ALIGN)
        k_s = cuda.shared.array(K_FLOATS, float32, SMEM_ALIGN)
        v_s = cuda.shared.array(V_FLOATS, float32, SMEM_ALIGN)
        p_s = cuda.shared.array(P_FLOATS, float32, SMEM_ALIGN)
        scratch = cuda.shared.array(SCRATCH, float32)  # row reductions in the simulator only
        s = cuda.local.array((TM, TN), float32)
        acc = cuda.local.array((TM, ACC_COLS), float32)
        tile_max = cuda.local.array(TM, float32)
        m_ref = cuda.local.array(TM, float32)
        l_tile = cuda.local.array(TM, float32)
        l_old = cuda.local.array(TM, float32)
        m_old = cuda.local.array(TM, float32)
        last_keys = cuda.local.array(TM, int32)
        kv_reg = cuda.local.array(KV_LOADS, float32)  # this thread's share of K_j or V_j in flight

        # Line 2: O = 0, l = 0, m = -inf in HBM (each thread, the elements it will own).
        for i_tile in range(n_q_tiles):
            for i in range(TM):
                row = i_tile * BM + ops.thread_row(i)
                if row < n_q:
                    for g in range(DG):
                        for u in range(VEC):
                            d = ops.out_col(g, u)
                            if d < D:
                                o_hbm[b, h, row, d] = float32(0.0)
                    if first_of_row:
                        l_hbm[b, h, row] = float32(0.0)
                        m_hbm[b, h, row] = float32(NEG_INF)

        for jj in range(n_kv_tiles):  # Line 5: for 1 <= j <= Tc
            j = kv_order[jj] if PERMUTED else jj
            col0 = j * BN
            cuda.syncthreads()  # everyone is done with the previous K_j, V_j
            ops.load_kv_tile(k, v, b, hk, col0, n_k, k_s, v_s, kv_reg)  # Line 6

            for i_tile in range(n_q_tiles):  # Line 7: for 1 <= i <= Tr
                row0 = i_tile * BM
                # causal: skip Q tiles for which every key of K_j is masked (block-uniform)
                if col0 > ops.last_visible_key(min(row0 + BM, n_q) - 1, n_q, n_k, CAUSAL):
                    continue
                cuda.syncthreads()  # the previous Q_i and P~ are no longer read
                ops.load_q_tile(q, b, h, row0, n_q, q_scale, q_s)  # Line 8: load Q_i
                cuda.syncthreads()  # Q_i (and K_j, V_j) in shared memory
                ops.score_tile(q_s, k_s, s)  # Line 9: S_ij = Q_i K_j^T
                ops.row_last_keys(row0, n_q, n_k, CAUSAL, last_keys, 1)
                first_row_last_key = ops.last_visible_key(row0, n_q, n_k, CAUSAL)
                masked = ops.tile_needs_mask(col0, first_row_last_key)
                if masked:
                    ops.mask_scores(s, col0, last_keys)
                # Line 10: m~_ij = rowmax(S_ij), P~_ij = exp(S_ij - m~_ij), l~_ij = rowsum(P~_ij).
                ops.row_max(s, tile_max, scratch)
                for i in range(TM):
                    m_ref[i] = ops.finite_or_zero(tile_max[i])
                ops.exp_scores(s, m_ref, p_s, l_tile)
                ops.allreduce_sum(l_tile, scratch)
                # Line 8: load l_i, m_i from HBM (before the barrier: the row's first thread
                # overwrites them after it).
                for i in range(TM):
                    row = row0 + ops.thread_row(i)
                    if row < n_q:
                        l_old[i] = l_hbm[b, h, row]
                        m_old[i] = m_hbm[b, h, row]
                cuda.syncthreads()  # P~_ij of every row is in shared memory
                ops.zero(acc)
                ops.pv_tile(p_s, v_s, acc, col0, last_keys, masked)  # acc = P~_ij V_j
                for i in range(TM):
                    row = row0 + ops.thread_row(i)
                    if row < n_q and tile_max[i] != NEG_INF:  # else the tile adds nothing
                        # Line 11: m_new = max(m_i, m~_ij); l_new = e^{m_i-m_new} l_i + e^{m~_ij-m_new} l~_ij.
                        m_new = ops.nan_max(m_old[i], tile_max[i])
                        alpha_old = ops.exp2_diff(m_old[i], m_new)
                        alpha_tile = ops.exp2_diff(tile_max[i], m_new)
                        l_new = alpha_old * l_old[i] + alpha_tile * l_tile[i]
                        # Line 12: O_i <- diag(l_new)^-1 (diag(l_i) e^{m_i-m_new} O_i + e^{m~_ij-m_new} P~_ij V_j).
                        inv_l = ops.reciprocal_or_zero(l_new)
                        w_old = l_old[i] * alpha_old * inv_l
                        w_tile = alpha_tile * inv_l
                        for g in range(DG):
                            for u in range(VEC):
                                d = ops.out_col(g, u)
                                if d < D:
                                    o_hbm[b, h, row, d] = w_old * o_hbm[b, h, row, d] + w_tile * acc[i, VEC * g + u]
                        if first_of_row:  # Line 13: l_i <- l_new, m_i <- m_new to HBM.
                            l_hbm[b, h, row] = l_new
                            m_hbm[b, h, row] = m_new

        # Not needed for correctness (every value read below was written by the reading
        # thread itself); kept, as in the kernel validated on the GPU.
        cuda.syncthreads()
        # Line 16: return O (cast to q's dtype when O was kept in float32) and L = m + log l.
        for i_tile in range(n_q_tiles):
            for i in range(TM):
                row = i_tile * BM + ops.thread_row(i)
                if row < n_q:
                    if CAST_OUT:
                        for g in range(DG):
                            for u in range(VEC):
                                d = ops.out_col(g, u)
                                if d < D:
                                    o[b, h, row, d] = o_hbm[b, h, row, d]
                    if first_of_row:
                        lse[b, h, row] = ops.log_sum_exp(m_hbm[b, h, row], l_hbm[b, h, row])

    return fa1_forward
