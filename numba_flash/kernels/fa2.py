"""FlashAttention-2 forward (Dao 2023, "FlashAttention-2", Algorithm 1), in numba.cuda.

Loop order: the grid runs over (Q tiles x batch x heads) -- sequence parallelism, one
block per Q tile -- and each block walks the K/V tiles (the inner loop of the paper,
line 6). The block keeps its Q tile in shared memory and the unnormalised accumulators
O~, l, m in registers for the whole walk, rescales once at the end (line 12), and writes
O and the logsumexp L only (lines 14-15). With ``causal=True`` the K/V tiles that are
masked for every row of the Q tile are skipped (section 3.1.1).

Each thread holds a register micro-tile of O~ (its rows x its slice of the head dim) and
its share of l (the row sum is linear, so the threads of a row keep partial sums and add
them once at the end); m is combined across the row's threads every tile (``row_max``).
The per-tile work (load, scores, exp, P~V) is shared with FA-1 in ``tile_ops``.
"""

from __future__ import annotations

import functools

from numba_flash._cuda import cuda, float32, int32

from numba_flash.kernels.jit import NEG_INF, SMEM_ALIGN, kernel_jit
from numba_flash.kernels.kv_split import split_of_block, split_tiles, valid_keys
from numba_flash.kernels.row_reduce import scratch_floats
from numba_flash.kernels.tile_ops import tile_ops
from numba_flash.kernels.tiles import VEC, register_cap


@functools.lru_cache(maxsize=None)
def fa2_kernel(head_dim: int, block_m: int, block_n: int, causal: bool, permuted: bool = False, ragged: bool = False):
    """The FA-2 kernel specialised for (head_dim, block_m, block_n, causal, permuted, ragged) (memoised).

    Launch: ``grid = (ceil(Nq / block_m) * B * H * n_splits,)``, ``block = (tile_layout(...).threads,)``.
    Arguments: ``q (B,H,Nq,D)``, ``k, v (B,Hkv,Nk,D)``, ``o (S*B,H,Nq,D)`` out,
    ``lse (S*B,H,Nq) float32`` out (``S = n_splits``; ``kv_split``), ``q_scale = scale * log2(e)``
    as float32, ``kv_order``: an int32 permutation of the K/V tiles, read only when ``permuted``
    (the research knob; otherwise tiles go in order and any int32 array will do),
    ``seqlens``: int32 ``(B,)`` valid keys per batch, read only when ``ragged``, ``n_splits``
    (int32, 1: unsplit) and ``rows_per_query`` (int32: consecutive rows of one query position,
    1 unless the query heads of a KV head are packed as rows; ``row_state``).
    """
    D, BM, BN = head_dim, block_m, block_n
    CAUSAL = bool(causal)
    PERMUTED = bool(permuted)
    RAGGED = bool(ragged)
    ops = tile_ops(D, BM, BN)  # the tile steps both kernels share
    L = ops.layout
    TM, TN, DG = L.rows_per_thread, L.cols_per_thread, L.dim_groups
    Q_FLOATS, K_FLOATS, V_FLOATS, P_FLOATS = L.q_floats, L.k_floats, L.v_floats, L.p_floats
    SCRATCH = scratch_floats(TM, L.threads)
    ACC_COLS = VEC * DG  # output columns per thread
    KV_LOADS = L.kv_loads

    @kernel_jit(fastmath={"contract", "afn", "arcp"}, max_registers=register_cap(D))
    def fa2_forward(q, k, v, o, lse, q_scale, kv_order, seqlens, n_splits, rows_per_query):
        n_batch = q.shape[0]
        n_heads = q.shape[1]
        n_q = q.shape[2]
        group = n_heads // k.shape[1]  # query heads per kv head (GQA / MQA)
        n_q_tiles = (n_q + BM - 1) // BM

        # Line 3: for 1 <= i <= Tr -- the outer loop is the grid: this block is Q tile i
        # of one (batch, head), and one split of its K/V tiles (``kv_split``).
        split, block = split_of_block(cuda.blockIdx.x, n_q_tiles * n_batch * n_heads)
        i_tile = block % n_q_tiles
        if CAUSAL:  # the longest walks (last Q tiles) first: fewer idle SMs at the grid's tail
            i_tile = n_q_tiles - 1 - i_tile
        bh = block // n_q_tiles
        b = bh // n_heads
        h = bh - b * n_heads
        hk = h // group
        ob = split * n_batch + b  # where this split's partial result goes
        row0 = i_tile * BM
        n_k = valid_keys(seqlens, b, k.shape[2], RAGGED)
        n_kv_tiles = (n_k + BN - 1) // BN  # Tc (line 1)

        q_s = cuda.shared.array(Q_FLOATS, float32, SMEM_ALIGN)
        k_s = cuda.shared.array(K_FLOATS, float32, SMEM_ALIGN)
        v_s = cuda.shared.array(V_FLOATS, float32, SMEM_ALIGN)
        p_s = cuda.shared.array(P_FLOATS, float32, SMEM_ALIGN)
        scratch = cuda.shared.array(SCRATCH, float32)  # row reductions in the simulator only
        s = cuda.local.array((TM, TN), float32)
        acc = cuda.local.array((TM, ACC_COLS), float32)
        m = cuda.local.array(TM, float32)
        l_part = cuda.local.array(TM, float32)
        tile_max = cuda.local.array(TM, float32)
        m_ref = cuda.local.array(TM, float32)
        row_sums = cuda.local.array(TM, float32)
        last_keys = cuda.local.array(TM, int32)
        kv_reg = cuda.local.array(KV_LOADS, float32)  # this thread's share of K_j or V_j in flight

        # Line 4: load Q_i into shared memory (scaled into log2 units).
        ops.load_q_tile(q, b, h, row0, n_q, q_scale, q_s)
        # Line 5: O~ = 0, l = 0, m = -inf, on chip.
        ops.zero(acc)
        for i in range(TM):
            m[i] = float32(NEG_INF)
            l_part[i] = float32(0.0)
        ops.row_last_keys(row0, n_q, n_k, CAUSAL, last_keys, rows_per_query)
        # The last key any row of this Q tile sees: tiles after it are fully masked.
        tile_last_key = ops.packed_last_visible_key(min(row0 + BM, n_q) - 1, rows_per_query, n_q, n_k, CAUSAL)
        first_row_last_key = ops.packed_last_visible_key(row0, rows_per_query, n_q, n_k, CAUSAL)

        # The K/V tiles to walk: in order, up to the last one any row of this Q tile sees
        # (causal: the rest are masked for every row, section 3.1.1); or all, permuted;
        # of them, this split's range.
        n_visible = n_kv_tiles if PERMUTED else max(0, min(n_kv_tiles, tile_last_key // BN + 1))
        first, end = split_tiles(n_visible, n_splits, split)
        for jj in range(first, end):  # Line 6: for 1 <= j <= Tc
            j = kv_order[jj] if PERMUTED else jj
            col0 = j * BN
            if col0 > tile_last_key:
                continue  # permuted order, causal: every score of this tile is masked
            cuda.syncthreads()  # everyone is done with the previous K_j, V_j and P~
            ops.load_kv_tile(k, v, b, hk, col0, n_k, k_s, v_s, kv_reg)  # Line 7
            cuda.syncthreads()  # Q_i, K_j, V_j are in shared memory before anyone reads them
            ops.score_tile(q_s, k_s, s)  # Line 8: S_i^(j) = Q_i K_j^T
            masked = ops.tile_needs_mask(col0, first_row_last_key)
            if masked:
                ops.mask_scores(s, col0, last_keys)
            # Line 9: m^(j) = max(m^(j-1), rowmax(S_i^(j))).
            ops.row_max(s, tile_max, scratch)
            for i in range(TM):
                m_new = ops.nan_max(m[i], tile_max[i])
                m_ref[i] = ops.finite_or_zero(m_new)
                if m_new != m[i]:  # alpha == 1 when the max did not move: nothing to rescale
                    alpha = ops.exp2_diff(m[i], m_ref[i])  # e^{m^(j-1) - m^(j)}
                    l_part[i] *= alpha  # Line 9: l^(j) = e^{m^(j-1) - m^(j)} l^(j-1) + ...
                    ops.rescale_row(acc, i, alpha)  # Line 10: diag(e^{m^(j-1) - m^(j)}) O~^(j-1)
                m[i] = m_new
            # Line 9: P~ = exp(S - m^(j)), l^(j) += rowsum(P~) (this thread's keys).
            ops.exp_scores(s, m_ref, p_s, row_sums)
            for i in range(TM):
                l_part[i] += row_sums[i]
            cuda.syncthreads()  # P~ of every row is in shared memory
            ops.pv_tile(p_s, v_s, acc, col0, last_keys, masked)  # Line 10: O~ += P~ V_j

        ops.allreduce_sum(l_part, scratch)  # l of each row: the sum of its threads' parts
        for i in range(TM):
            row = row0 + ops.thread_row(i)
            if row < n_q:
                inv_l = ops.reciprocal_or_zero(l_part[i])  # Line 12: O_i = diag(l)^-1 O~
                for g in range(DG):
                    for u in range(VEC):
                        d = ops.out_col(g, u)
                        if d < D:
                            o[ob, h, row, d] = acc[i, VEC * g + u] * inv_l  # Line 14: write O_i
                if ops.thread_col() == 0:  # Lines 13, 15: L_i = m + log(l)
                    lse[ob, h, row] = ops.log_sum_exp(m[i], l_part[i])

    return fa2_forward
