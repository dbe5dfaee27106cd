"""FlashAttention-2 forward (Dao 2023, "FlashAttention-2", Algorithm 1), in numba.cuda.

Loop order: the grid runs over (Q tiles x batch x heads) -- sequence parallelism, one
block per Q tile -- and each block walks the K/V tiles (the inner loop of the paper,
line 6). The block keeps its Q tile and the unnormalised accumulators O~, l, m on
chip for the whole walk, rescales once at the end (line 12), and writes O and the
logsumexp L only (lines 14-15). With ``causal=True`` the K/V tiles that are masked
for every row of the Q tile are skipped (section 3.1.1).

The per-tile work (load, scores, exp, P~V) is shared with FA-1 in ``tile_ops``.
"""

from __future__ import annotations

import functools

from numba_flash._cuda import cuda, float32

from numba_flash.kernels.jit import NEG_INF, kernel_jit
from numba_flash.kernels.tile_ops import tile_ops
from numba_flash.kernels.tiles import register_cap


@functools.lru_cache(maxsize=None)
def fa2_kernel(head_dim: int, block_m: int, block_n: int, causal: bool, permuted: bool = False):
    """The FA-2 kernel specialised for (head_dim, block_m, block_n, causal, permuted) (memoised).

    Launch: ``grid = (ceil(Nq / block_m) * B * H,)``, ``block = (block_m,)``.
    Arguments: ``q (B,H,Nq,D)``, ``k, v (B,Hkv,Nk,D)``, ``o (B,H,Nq,D)`` out,
    ``lse (B,H,Nq) float32`` out, ``q_scale = scale * log2(e)`` as float32, and
    ``kv_order``: an int32 permutation of the K/V tiles, read only when ``permuted``
    (the research knob; otherwise tiles go in order and any int32 array will do).
    """
    D, BM, BN = head_dim, block_m, block_n
    CAUSAL = bool(causal)
    PERMUTED = bool(permuted)
    ops = tile_ops(D, BM, BN)  # the tile steps both kernels share

    @kernel_jit(fastmath={"contract", "afn", "arcp"}, max_registers=register_cap(D))
    def fa2_forward(q, k, v, o, lse, q_scale, kv_order):
        n_heads = q.shape[1]
        n_q = q.shape[2]
        n_k = k.shape[2]
        group = n_heads // k.shape[1]  # query heads per kv head (GQA / MQA)
        n_q_tiles = (n_q + BM - 1) // BM
        n_kv_tiles = (n_k + BN - 1) // BN  # Tc (line 1)

        # Line 3: for 1 <= i <= Tr -- the outer loop is the grid: this block is Q tile i
        # of one (batch, head).
        i = cuda.blockIdx.x % n_q_tiles
        bh = cuda.blockIdx.x // n_q_tiles
        b = bh // n_heads
        h = bh - b * n_heads
        hk = h // group
        tid = cuda.threadIdx.x
        row = i * BM + tid

        k_tile = cuda.shared.array((BN, D), float32)
        v_tile = cuda.shared.array((BN, D), float32)
        s_tile = cuda.shared.array((BN, BM), float32)
        q_reg = cuda.local.array(D, float32)
        acc = cuda.local.array(D, float32)

        # Line 4: load Q_i (this thread's row, in registers).
        ops.load_q_row(q, b, h, row, n_q, q_scale, q_reg)
        # Line 5: O~ = 0, l = 0, m = -inf, on chip.
        ops.zero(acc)
        l_sum = float32(0.0)
        m = float32(NEG_INF)
        last_key = ops.last_visible_key(row, n_q, n_k, CAUSAL)
        # The last key any row of this Q tile sees: tiles after it are fully masked.
        tile_last_key = ops.last_visible_key(min(i * BM + BM, n_q) - 1, n_q, n_k, CAUSAL)
        first_row_last_key = ops.last_visible_key(i * BM, n_q, n_k, CAUSAL)

        for jj in range(n_kv_tiles):  # Line 6: for 1 <= j <= Tc
            j = kv_order[jj] if PERMUTED else jj
            col0 = j * BN
            if col0 > tile_last_key:
                continue  # causal: every score of this tile is masked (block-uniform)
            cuda.syncthreads()  # everyone is done reading the previous K_j, V_j
            ops.load_kv_tile(k, v, b, hk, col0, n_k, k_tile, v_tile)  # Line 7
            cuda.syncthreads()  # the whole tile is in shared memory before anyone reads it
            # Line 8: S_i^(j) = Q_i K_j^T.
            tile_max = ops.score_tile(q_reg, k_tile, s_tile, col0, last_key, first_row_last_key)
            # Line 9: m^(j) = max(m^(j-1), rowmax(S)).
            m_new = ops.nan_max(m, tile_max)
            if m_new != NEG_INF:  # else the row has seen only masked keys: nothing to add
                alpha = ops.exp2_diff(m, m_new)  # e^{m^(j-1) - m^(j)}
                if m_new != m:  # alpha == 1 when the max did not move: nothing to rescale
                    ops.rescale(acc, alpha)  # Line 10, first term: diag(alpha) O~^(j-1)
                # Lines 9-10: P~ = exp(S - m^(j)); l = alpha l + rowsum(P~); O~ += P~ V_j.
                n_cols = ops.visible_cols(col0, last_key)
                l_sum = alpha * l_sum + ops.exp_rowsum_pv(s_tile, v_tile, m_new, acc, n_cols)
                m = m_new

        if row < n_q:
            inv_l = ops.reciprocal_or_zero(l_sum)  # Line 12: O_i = diag(l)^-1 O~
            for d in range(D):
                o[b, h, row, d] = acc[d] * inv_l  # Line 14: write O_i
            lse[b, h, row] = ops.log_sum_exp(m, l_sum)  # Lines 13, 15: L_i = m + log(l)

    return fa2_forward
