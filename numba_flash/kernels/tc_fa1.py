"""FlashAttention-1 forward (Dao et al. 2022, Algorithm 1) on tensor cores, in numba.cuda.

The loop nest of ``fa1`` (one block per (batch, head); outer loop over K/V tiles, inner over Q
tiles; O, l, m round-trip through global memory, O normalised at every step), with the tile
steps of ``tc_ops``, the same ones ``tc_fa2`` calls. O, l and m live in float32 in HBM (line 2);
a thread always owns the same rows and columns of every Q tile (the mma accumulator layout), so
each O element's round trip is read and written by one thread; l_i and m_i are written by the
row's lane t = 0 after a barrier that follows every lane's read of them.

Launch: ``grid = (B * H,)``, ``block = (layout.threads,)``, dynamic shared memory
``layout.smem_bytes``. Arguments: ``q``, ``k``, ``v`` as for ``tc_fa2``; ``o_hbm (B,H,Nq,D)
float32``, ``l_hbm, m_hbm (B,H,Nq) float32`` (the paper's O, l, m; initialised here);
``o (B,H,Nq,D)`` in the input element type, written from ``o_hbm`` at the end;
``lse (B,H,Nq) float32``; ``q_scale = scale * log2(e)``.
"""

from __future__ import annotations

import functools

from numba_flash._cuda import cuda, float32, int32
from numba_flash.kernels import mma, softmax
from numba_flash.kernels.block_info import batch_and_head
from numba_flash.kernels.jit import NEG_INF, SMEM_ALIGN, kernel_jit
from numba_flash.kernels.row_reduce import scratch_floats as reduce_scratch_floats
from numba_flash.kernels.tc_ops import ROWS_PER_THREAD, tc_ops


@functools.lru_cache(maxsize=None)
def tc_fa1_kernel(kind: str, head_dim: int, block_m: int, block_n: int, causal: bool, max_registers=None,
                  presplit=None):
    """The tensor-core FA-1 kernel for one specialisation (memoised);
    ``max_registers``: the register cap (``tc_ops.tc_register_cap``, through the spec);
    ``presplit``: ``tc_ops.tc_layout``'s."""
    CAUSAL = bool(causal)
    ops = tc_ops(kind, head_dim, block_m, block_n, presplit=presplit)
    L = ops.layout
    BM, BN, D = block_m, block_n, head_dim
    TM, NS, DT = ROWS_PER_THREAD, L.score_tiles, L.out_tiles
    QF_ROWS, QF_SMALL = ops.q_frag_rows, ops.q_small_rows  # Q_i fragments kept in registers
    Q_ELEMS, KV_ELEMS = L.q_elems, L.kv_elems
    # tf32x3, D > 64 (tc_ops.presplit_operands): K_j and/or V_j split once per K/V tile
    SPLIT_K, SPLIT_V, K_SPLIT, V_SPLIT = ops.presplit_k, ops.presplit_v, L.k_split_elems, L.v_split_elems
    SPLIT_BASE = Q_ELEMS + 2 * KV_ELEMS
    SMEM_TYPE = mma.uint16 if L.elem_bytes == 2 else float32
    MMA_SCRATCH = mma.scratch_floats(L.threads)
    ROW_SCRATCH = reduce_scratch_floats(TM, L.threads)

    cap = {"max_registers": max_registers} if max_registers else {}

    @kernel_jit(fastmath={"contract", "afn", "arcp"}, **cap)
    def tc_fa1_forward(q, k, v, o_hbm, l_hbm, m_hbm, o, lse, q_scale):
        n_heads = q.shape[1]
        n_q = q.shape[2]
        n_k = k.shape[2]
        group = n_heads // k.shape[1]  # query heads per kv head (GQA / MQA)
        n_q_tiles = (n_q + BM - 1) // BM  # Tr (line 3)
        n_kv_tiles = (n_k + BN - 1) // BN  # Tc (line 3)
        b, h = batch_and_head(cuda.blockIdx.x, n_heads)  # one block per (batch, head)
        hk = h // group
        first_of_row = ops.lane_t() == 0

        smem = cuda.shared.array(0, SMEM_TYPE, SMEM_ALIGN)  # dynamic: Q_i | K_j | V_j (16-byte aligned for cp.async, ldmatrix)
        q_s = smem[:Q_ELEMS]
        k_s = smem[Q_ELEMS : Q_ELEMS + KV_ELEMS]
        v_s = smem[Q_ELEMS + KV_ELEMS : Q_ELEMS + 2 * KV_ELEMS]
        k_split = smem[SPLIT_BASE : SPLIT_BASE + K_SPLIT]  # K_j's, V_j's split fragments (if pre-split)
        v_split = smem[SPLIT_BASE + K_SPLIT : SPLIT_BASE + K_SPLIT + V_SPLIT]
        scratch = cuda.shared.array(MMA_SCRATCH, float32)  # simulated mma only
        rscratch = cuda.shared.array(ROW_SCRATCH, float32)  # simulated row reductions only

        qf = cuda.local.array((QF_ROWS, 4), mma.uint32)
        qf_small = cuda.local.array((QF_SMALL, 4), mma.uint32)
        s = cuda.local.array((NS, 4), float32)
        acc = cuda.local.array((DT, 4), float32)
        tile_max = cuda.local.array(TM, float32)
        m_ref = cuda.local.array(TM, float32)
        l_tile = cuda.local.array(TM, float32)
        l_old = cuda.local.array(TM, float32)
        m_old = cuda.local.array(TM, float32)
        last_keys = cuda.local.array(TM, int32)

        # Line 2: O = 0, l = 0, m = -inf in HBM (each thread, the elements it will own).
        for i_tile in range(n_q_tiles):
            for i in range(TM):
                row = i_tile * BM + ops.thread_row(i)
                if row < n_q:
                    for dt in range(DT):
                        for e in range(2):
                            d = ops.col_of(dt, e)
                            if d < D:
                                o_hbm[b, h, row, d] = float32(0.0)
                    if first_of_row:
                        l_hbm[b, h, row] = float32(0.0)
                        m_hbm[b, h, row] = float32(NEG_INF)

        for j in range(n_kv_tiles):  # Line 5: for 1 <= j <= Tc
            col0 = j * BN
            ops.wait_all()  # (a no-op: every copy was waited for in the Q loop)
            cuda.syncthreads()  # everyone is done with K_{j-1}, V_{j-1}
            ops.load_kv_tile(k, b, hk, col0, n_k, k_s)  # Line 6: load K_j, V_j
            ops.load_kv_tile(v, b, hk, col0, n_k, v_s)
            ops.commit()
            if SPLIT_V:  # once per K/V tile for all Q tiles (the Q loop's barriers publish it)
                ops.wait_all()
                cuda.syncthreads()  # K_j, V_j landed
                if SPLIT_K:
                    ops.split_k_tile(k_s, k_split)
                ops.split_v_tile(v_s, v_split)
            for i_tile in range(n_q_tiles):  # Line 7: for 1 <= i <= Tr
                row0 = i_tile * BM
                # causal: skip Q tiles for which every key of K_j is masked (block-uniform)
                if col0 > ops.last_visible_key(min(row0 + BM, n_q) - 1, n_q, n_k, CAUSAL):
                    continue
                cuda.syncthreads()  # everyone has Q_{i-1}'s fragments in registers
                ops.load_q_tile(q, b, h, row0, n_q, q_s)  # Line 8: load Q_i
                ops.commit()
                ops.wait_all()
                cuda.syncthreads()  # Q_i (and K_j, V_j) in shared memory
                ops.load_q_frags(q_s, qf, qf_small)
                ops.score_tile(qf, qf_small, q_s, k_split if SPLIT_K else k_s, s, scratch)  # Line 9: S_ij = Q_i K_j^T
                ops.row_last_keys(row0, n_q, n_k, CAUSAL, last_keys, 1)
                first_row_last_key = ops.last_visible_key(row0, n_q, n_k, CAUSAL)
                masked = ops.tile_needs_mask(col0, first_row_last_key)
                ops.scale_mask(s, q_scale, col0, last_keys, masked)
                # Line 10: m~_ij = rowmax(S_ij), P~_ij = exp(S_ij - m~_ij), l~_ij = rowsum(P~_ij).
                ops.row_max(s, tile_max, rscratch)
                for i in range(TM):
                    m_ref[i] = ops.finite_or_zero(tile_max[i])
                ops.exp_scores(s, m_ref, l_tile)
                ops.allreduce_sum(l_tile, rscratch)
                # Line 8: load l_i, m_i from HBM (before the barrier: lane t = 0 overwrites them after it).
                for i in range(TM):
                    row = row0 + ops.thread_row(i)
                    if row < n_q:
                        l_old[i] = l_hbm[b, h, row]
                        m_old[i] = m_hbm[b, h, row]
                cuda.syncthreads()  # every lane has read l_i, m_i
                ops.zero(acc)
                ops.pv_tile(s, v_split if SPLIT_V else v_s, acc, scratch)  # acc = P~_ij V_j
                for i in range(TM):
                    row = row0 + ops.thread_row(i)
                    if row < n_q and tile_max[i] != NEG_INF:  # else the tile adds nothing
                        # Line 11: m_new = max(m_i, m~_ij); l_new = e^{m_i-m_new} l_i + e^{m~_ij-m_new} l~_ij.
                        m_new = ops.nan_max(m_old[i], tile_max[i])
                        alpha_old, alpha_tile = softmax.merge_weights(m_old[i], tile_max[i], m_new)
                        l_new = alpha_old * l_old[i] + alpha_tile * l_tile[i]
                        # Line 12: O_i <- diag(l_new)^-1 (diag(l_i) e^{m_i-m_new} O_i + e^{m~_ij-m_new} P~_ij V_j).
                        inv_l = ops.reciprocal_or_zero(l_new)
                        w_old = l_old[i] * alpha_old * inv_l
                        w_tile = alpha_tile * inv_l
                        for dt in range(DT):
                            for e in range(2):
                                d = ops.col_of(dt, e)
                                if d < D:
                                    o_hbm[b, h, row, d] = w_old * o_hbm[b, h, row, d] + w_tile * acc[dt, 2 * i + e]
                        if first_of_row:  # Line 13: l_i <- l_new, m_i <- m_new to HBM.
                            l_hbm[b, h, row] = l_new
                            m_hbm[b, h, row] = m_new
        ops.wait_all()  # no copy outlives the block

        # Line 16: return O in the input type, and L = m + log l (each thread its own elements).
        for i_tile in range(n_q_tiles):
            for i in range(TM):
                row = i_tile * BM + ops.thread_row(i)
                if row < n_q:
                    for dt in range(DT):
                        for e in range(2):
                            d = ops.col_of(dt, e)
                            if d < D:
                                ops.store_out(o, b, h, row, d, o_hbm[b, h, row, d])
                    if first_of_row:
                        lse[b, h, row] = ops.log_sum_exp(m_hbm[b, h, row], l_hbm[b, h, row])

    return tc_fa1_forward
