"""FlashAttention-2 forward (Dao 2023, Algorithm 1) on tensor cores, in numba.cuda.

The loop nest of ``fa2`` (grid over Q tiles x batch x heads; each block walks the K/V tiles with
O~, l, m on chip and rescales once at the end), with the tile steps of ``tc_ops``: products on
``mma.sync``, Q_i's fragments in registers for the whole walk, P~ kept in registers and
converted to the input type for P~V. Copies are ``cp.async``, and overlap the products: V_j is
in flight while S = Q_i K_j^T is computed, K_{j+1} while O~ += P~ V_j is. Or, compiled with
``kv_stages = S > 1`` (decode's knob, ``tile_table.DECODE_KV_STAGES``), K/V tiles j+1 .. j+S-1
are in flight in a ring of S shared tiles while tile j is used: more bytes in flight per block
for the one-warp decode tiles, one barrier per tile.

Launch: ``grid = (ceil(Nq / block_m) * B * H,)``, ``block = (layout.threads,)``, dynamic shared
memory ``layout.smem_bytes``. Arguments: ``q (B,H,Nq,D)``, ``k, v (B,Hkv,Nk,D)`` (16-bit bit
patterns as uint16 for f16/bf16, float32 for TF32; D a multiple of 8 resp. 4, rows 16-byte
aligned), ``o (S*B,H,Nq,D)`` of the same element type (float32 when compiled ``f32_out``, as
split partials are), ``lse (S*B,H,Nq) float32``, ``q_scale = scale * log2(e)`` (float32),
``seqlens`` (int32 ``(B,)``, read only when ``ragged``), ``n_splits`` and ``rows_per_query``
(int32; the split launch of ``block_info``, and the query rows packed per position of
``mask.packed_last_visible_key``: 1 and 1 for a plain call, grid times ``n_splits``).
"""

from __future__ import annotations

import functools

from numba_flash._cuda import cuda, float32, int32
from numba_flash.kernels import mask, mma, softmax
from numba_flash.kernels.jit import NEG_INF, SMEM_ALIGN, device_jit, kernel_jit
from numba_flash.kernels.block_info import batch_and_head, split_of_block, split_tiles, tile_of_block, valid_keys
from numba_flash.kernels.row_reduce import scratch_floats as reduce_scratch_floats
from numba_flash.kernels.tc_ops import ROWS_PER_THREAD, tc_layout, tc_ops


@functools.lru_cache(maxsize=None)
def tc_fa2_kernel(kind: str, head_dim: int, block_m: int, block_n: int, causal: bool, ragged: bool = False,
                  f32_out: bool = False, max_registers=None, row_walk=None, kv_stages: int = 1, presplit=None,
                  key_warps: int = 1):
    """The tensor-core FA-2 kernel for one specialisation (memoised); ``max_registers``: the
    register cap (``tc_ops.tc_register_cap``, through the spec); ``row_walk``: the K/V copies'
    loop (``tc_ops.row_walk_default`` when ``None``); ``kv_stages``: 1 (K_j and V_j in flight
    in turn) or a ring of that many K/V tiles (launch with ``tc_layout(..., kv_stages)``'s
    shared memory). Both are decode's knobs (scripts/decode_sweep.py tries them). ``presplit``:
    ``tc_ops.tc_layout``'s (tf32x3 at D > 64: operands split into TF32 parts once, in shared
    memory; only with ``kv_stages = 1``). ``key_warps`` (with a ring, 16-row Q tiles): the
    block's warps all hold the Q tile's 16 rows and split every K/V tile's keys between them,
    ``block_n / key_warps`` each, each warp with its own (m, l, O~); the states are merged at the
    end of the walk (``merge_key_warps``). Decode's knob: one 16-row tile is all of a KV head's
    packed queries, and one warp alone cannot keep up with the copies (docs/performance-log.md 9j)."""
    CAUSAL, RAGGED, F32_OUT = bool(causal), bool(ragged), bool(f32_out)
    KW = int(key_warps)
    if KW < 1 or block_n % KW or block_n // KW < 16:
        raise ValueError(f"key_warps must divide block_n into parts of >= 16 keys; got {key_warps} for {block_n}")
    if KW > 1 and (kv_stages < 2 or block_m != 16):
        raise ValueError(f"key_warps={key_warps} needs a ring (kv_stages > 1) and block_m = 16")
    BNW = block_n // KW  # keys of each tile one warp multiplies
    ops = tc_ops(kind, head_dim, block_m, BNW, row_walk, presplit, key_warps=KW)  # a warp's products and rows
    copies = ops if KW == 1 else tc_ops(kind, head_dim, block_m, block_n, row_walk, presplit, key_warps=KW)
    L = copies.layout
    BM, BN, D = block_m, block_n, head_dim
    TM, NS, DT = ROWS_PER_THREAD, ops.layout.score_tiles, L.out_tiles
    QF_ROWS, QF_SMALL = ops.q_frag_rows, ops.q_small_rows  # Q_i fragments kept in registers
    Q_ELEMS, KV_ELEMS = L.q_elems, L.kv_elems
    STRIDE = L.stride
    WARP_KV_ELEMS = ops.layout.kv_elems  # one warp's rows of a K or V tile (all of it with one warp per row)
    STAGES = int(kv_stages)
    if STAGES < 1:
        raise ValueError(f"kv_stages must be >= 1; got {kv_stages}")
    wait_ring = mma.cp_async_wait_group(max(STAGES - 2, 0))  # tile j's group: STAGES - 2 committed after it
    # tf32x3, D > 64 (tc_ops.presplit_operands): K_j and/or V_j split once per tile, for every warp
    SPLIT_K, SPLIT_V, K_SPLIT, V_SPLIT = ops.presplit_k, ops.presplit_v, L.k_split_elems, L.v_split_elems
    if STAGES > 1 and (SPLIT_K or SPLIT_V or L.presplit):
        raise ValueError("a ring of K/V tiles (kv_stages > 1) takes no pre-split operands")
    SPLIT_BASE = Q_ELEMS + 2 * KV_ELEMS
    SMEM_TYPE = mma.uint16 if L.elem_bytes == 2 else float32
    MMA_SCRATCH = mma.scratch_floats(L.threads)
    ROW_SCRATCH = reduce_scratch_floats(TM, L.threads)

    cap = {"max_registers": max_registers} if max_registers else {}

    update_rows = softmax.row_update(TM, ops.rescale_row)

    @device_jit
    def online_softmax(s, q_scale, col0, last_keys, first_row_last_key, m, l_part, acc, tile_max, m_ref, row_sums,
                       rscratch):
        """Lines 9-10 but P~V: S in log2 units and masked; m^(j) = max(m^(j-1), rowmax(S));
        O~ and l rescaled where the max moved; P~ = exp(S - m^(j)) in place; l += rowsum(P~)."""
        masked = ops.tile_needs_mask(col0, first_row_last_key)
        ops.scale_mask(s, q_scale, col0, last_keys, masked)
        ops.row_max(s, tile_max, rscratch)
        update_rows(m, l_part, acc, tile_max, m_ref)
        ops.exp_scores(s, m_ref, row_sums)
        for i in range(TM):
            l_part[i] += row_sums[i]

    @device_jit
    def load_kv_stage(k, v, b, hk, tile, n_k, smem, stage):
        """K and V of K/V tile ``tile`` into ring stage ``stage`` (asynchronous)."""
        base = Q_ELEMS + 2 * KV_ELEMS * stage
        copies.load_kv_tile(k, b, hk, tile * BN, n_k, smem[base : base + KV_ELEMS])
        copies.load_kv_tile(v, b, hk, tile * BN, n_k, smem[base + KV_ELEMS : base + 2 * KV_ELEMS])

    # The key warps' merge (KW > 1): m and l of every (warp, row), then each warp's O~ rows
    # (padded by 4 floats: fewer bank conflicts), in the dynamic shared memory the ring is done with.
    DP = L.padded_dim
    ACC_PITCH = DP + 4
    ACC_BASE = 2 * KW * BM
    THREADS = L.threads
    MERGE_PASSES = -(-BM * DP // THREADS)
    RING_BYTES = tc_layout(kind, head_dim, block_m, block_n, STAGES, key_warps=KW).smem_bytes if KW > 1 else 0
    if (ACC_BASE + KW * BM * ACC_PITCH) * 4 > RING_BYTES > 0:
        raise ValueError(f"the merge of {KW} key warps needs more shared memory than the ring's {RING_BYTES} bytes")

    @device_jit
    def merge_key_warps(o, lse, ob, h, row0, n_q, m, l_part, acc):
        """The key warps' states of each row merged as ``online.merge`` merges two states (in
        log2 units: m = max_w m_w, l = sum_w 2^(m_w - m) l_w, O~ = sum_w 2^(m_w - m) O~_w; the
        merge is associative and commutative, so the warps' key sets, disjoint and together the
        block's range, give the state of the whole range), then Lines 12-15: O_i = diag(l)^-1 O~
        and L_i written. A warp that saw no key (m_w = -inf) weighs 0. All threads must call."""
        fs = cuda.shared.array(0, float32, SMEM_ALIGN)  # aliases the tiles' dynamic shared memory
        cuda.syncthreads()  # every warp is done with the ring
        w = ops.key_warp()
        if ops.lane_t() == 0:
            for i in range(TM):
                r = ops.thread_row(i)
                fs[w * BM + r] = m[i]
                fs[(KW + w) * BM + r] = l_part[i]
        for dt in range(DT):
            for e in range(4):
                fs[ACC_BASE + (w * BM + ops.thread_row(e >> 1)) * ACC_PITCH + ops.col_of(dt, e)] = acc[dt, e]
        cuda.syncthreads()
        for n in range(MERGE_PASSES):  # thread tid: elements tid, tid + threads, .. of the 16 x DP tile
            c = cuda.threadIdx.x + THREADS * n
            r = c // DP
            d = c - r * DP
            row = row0 + r
            if r < BM and row < n_q and d < D:
                m_all = float32(NEG_INF)
                for w2 in range(KW):
                    m_all = ops.nan_max(m_all, fs[w2 * BM + r])
                m_sub = ops.finite_or_zero(m_all)
                l_all = float32(0.0)
                x = float32(0.0)
                for w2 in range(KW):
                    alpha = ops.exp2_diff(fs[w2 * BM + r], m_sub)
                    l_all += alpha * fs[(KW + w2) * BM + r]
                    x += alpha * fs[ACC_BASE + (w2 * BM + r) * ACC_PITCH + d]
                x *= ops.reciprocal_or_zero(l_all)  # Line 12
                if F32_OUT:  # a split's partial O_s, merged later in float32
                    o[ob, h, row, d] = x
                else:
                    ops.store_out(o, ob, h, row, d, x)  # Line 14
                if d == 0:  # Lines 13, 15
                    lse[ob, h, row] = ops.log_sum_exp(m_all, l_all)

    @kernel_jit(fastmath={"contract", "afn", "arcp"}, **cap)
    def tc_fa2_forward(q, k, v, o, lse, q_scale, seqlens, n_splits, rows_per_query):
        n_batch = q.shape[0]
        n_heads = q.shape[1]
        n_q = q.shape[2]
        group = n_heads // k.shape[1]  # query heads per kv head (GQA / MQA)
        n_q_tiles = (n_q + BM - 1) // BM

        # Line 3: for 1 <= i <= Tr -- the grid: this block is Q tile i of one (batch, head),
        # and one split of its K/V tiles (``block_info``).
        split, block = split_of_block(cuda.blockIdx.x, n_q_tiles * n_batch * n_heads)
        i_tile, _, bh = tile_of_block(block, n_q_tiles, True, CAUSAL)  # causal: the longest walks first
        b, h = batch_and_head(bh, n_heads)
        hk = h // group
        ob = split * n_batch + b  # where this split's partial result goes
        row0 = i_tile * BM
        n_k = valid_keys(seqlens, b, k.shape[2], RAGGED)
        n_kv_tiles = (n_k + BN - 1) // BN  # Tc (line 1)

        smem = cuda.shared.array(0, SMEM_TYPE, SMEM_ALIGN)  # dynamic: Q_i | K_j | V_j (16-byte aligned for cp.async, ldmatrix)
        q_s = smem[:Q_ELEMS]
        k_s = smem[Q_ELEMS : Q_ELEMS + KV_ELEMS]
        v_s = smem[Q_ELEMS + KV_ELEMS : Q_ELEMS + 2 * KV_ELEMS]
        k_split = smem[SPLIT_BASE : SPLIT_BASE + K_SPLIT]  # K_j's, V_j's split fragments (if pre-split;
        v_split = smem[SPLIT_BASE + K_SPLIT : SPLIT_BASE + K_SPLIT + V_SPLIT]  # k_s, v_s stage the copies)
        scratch = cuda.shared.array(MMA_SCRATCH, float32)  # simulated mma only
        rscratch = cuda.shared.array(ROW_SCRATCH, float32)  # simulated row reductions only

        qf = cuda.local.array((QF_ROWS, 4), mma.uint32)
        qf_small = cuda.local.array((QF_SMALL, 4), mma.uint32)
        s = cuda.local.array((NS, 4), float32)
        acc = cuda.local.array((DT, 4), float32)
        m = cuda.local.array(TM, float32)
        l_part = cuda.local.array(TM, float32)
        tile_max = cuda.local.array(TM, float32)
        m_ref = cuda.local.array(TM, float32)
        row_sums = cuda.local.array(TM, float32)
        last_keys = cuda.local.array(TM, int32)

        ops.row_last_keys(row0, n_q, n_k, CAUSAL, last_keys, rows_per_query)
        tile_last_key = ops.packed_last_visible_key(min(row0 + BM, n_q) - 1, rows_per_query, n_q, n_k, CAUSAL)
        first_row_last_key = ops.packed_last_visible_key(row0, rows_per_query, n_q, n_k, CAUSAL)
        # Causal: K/V tiles past the last key any row of this Q tile sees are skipped (3.1.1);
        # of the others, this split walks its range.
        n_visible = mask.kv_tiles_seen(tile_last_key, n_kv_tiles, BN)
        first, end = split_tiles(n_visible, n_splits, split)

        if STAGES == 1:
            # Line 4: load Q_i (and K_first) into shared memory.
            ops.load_q_tile(q, b, h, row0, n_q, q_s)
            if end > first:
                ops.load_kv_tile(k, b, hk, first * BN, n_k, k_s)
            ops.commit()
            if SPLIT_V:  # V_first as a second group: that walk issues each V_{j+1} after V_j's split
                if end > first:
                    ops.load_kv_tile(v, b, hk, first * BN, n_k, v_s)
                ops.commit()
        else:  # Q_i and the first STAGES - 1 tiles, a commit group each (Q_i's with the first)
            copies.load_q_tile(q, b, h, row0, n_q, q_s)
            for t in range(STAGES - 1):
                if first + t < end:
                    load_kv_stage(k, v, b, hk, first + t, n_k, smem, t)
                ops.commit()
        # Line 5: O~ = 0, l = 0, m = -inf, on chip.
        ops.zero(acc)
        for i in range(TM):
            m[i] = float32(NEG_INF)
            l_part[i] = float32(0.0)

        if STAGES == 1:
            for j in range(first, end):  # Line 6: for 1 <= j <= Tc
                col0 = j * BN
                if SPLIT_V:  # four barriers per tile too; V_j was issued after V_{j-1}'s split
                    ops.wait_one()  # this thread's copies of Q_i and K_j have landed (V_j may not)
                    cuda.syncthreads()  # ... and everyone's; everyone is done with tile j-1
                    if SPLIT_K:
                        ops.split_k_tile(k_s, k_split)
                        cuda.syncthreads()  # K_j's fragments are visible; k_s is free
                        if j + 1 < end:
                            ops.load_kv_tile(k, b, hk, col0 + BN, n_k, k_s)  # K_{j+1}, in flight a whole step
                            ops.commit()
                else:
                    cuda.syncthreads()  # everyone is done reading V_{j-1}
                    ops.load_kv_tile(v, b, hk, col0, n_k, v_s)  # Line 7 (V_j, in flight during S)
                    ops.commit()
                    ops.wait_one()  # this thread's copies of Q_i and K_j have landed
                    cuda.syncthreads()  # ... and everyone's
                if j == first:
                    ops.load_q_frags(q_s, qf, qf_small)
                ops.score_tile(qf, qf_small, q_s, k_split if SPLIT_K else k_s, s, scratch)  # Line 8: S = Q_i K_j^T
                online_softmax(s, q_scale, col0, last_keys, first_row_last_key, m, l_part, acc, tile_max, m_ref,
                               row_sums, rscratch)  # Lines 9-10
                if SPLIT_V:
                    if not SPLIT_K:
                        cuda.syncthreads()  # everyone is done reading K_j
                        if j + 1 < end:
                            ops.load_kv_tile(k, b, hk, col0 + BN, n_k, k_s)  # K_{j+1}
                            ops.commit()
                    if j + 1 < end:
                        ops.wait_one()  # V_j has landed (K_{j+1} may not)
                    else:
                        ops.wait_all()
                    cuda.syncthreads()  # V_j is visible to everyone
                    ops.split_v_tile(v_s, v_split)
                    cuda.syncthreads()  # V_j's fragments are visible; v_s is free
                    if j + 1 < end:
                        ops.load_kv_tile(v, b, hk, col0 + BN, n_k, v_s)  # V_{j+1}, in flight during P~V and S
                        ops.commit()
                else:
                    cuda.syncthreads()  # everyone is done reading K_j
                    if j + 1 < end:
                        ops.load_kv_tile(k, b, hk, col0 + BN, n_k, k_s)  # K_{j+1}, in flight during P~V
                        ops.commit()
                        ops.wait_one()  # V_j has landed
                    else:
                        ops.wait_all()
                    cuda.syncthreads()  # V_j is visible to everyone
                ops.pv_tile(s, v_split if SPLIT_V else v_s, acc, scratch)  # Line 10: O~ += P~ V_j
        else:
            key0 = ops.key_warp() * BNW if KW > 1 else 0  # this warp's first key of every tile
            for j in range(first, end):  # Line 6, over a ring of STAGES tiles
                stage = (j - first) % STAGES
                wait_ring()  # this thread's copies of tile j (and Q_i) have landed
                cuda.syncthreads()  # ... and everyone's; and everyone is done with tile j - 1
                if j + STAGES - 1 < end:  # Line 7, STAGES - 1 tiles ahead, into tile j - 1's stage
                    load_kv_stage(k, v, b, hk, j + STAGES - 1, n_k, smem, (stage + STAGES - 1) % STAGES)
                ops.commit()  # a group per tile, empty past the end: the wait above counts groups
                base = Q_ELEMS + 2 * KV_ELEMS * stage + key0 * STRIDE
                if j == first:
                    ops.load_q_frags(q_s, qf, qf_small)
                ops.score_tile(qf, qf_small, q_s, smem[base : base + WARP_KV_ELEMS], s, scratch)  # Line 8
                online_softmax(s, q_scale, j * BN + key0, last_keys, first_row_last_key, m, l_part, acc, tile_max,
                               m_ref, row_sums, rscratch)  # Lines 9-10
                ops.pv_tile(s, smem[base + KV_ELEMS : base + KV_ELEMS + WARP_KV_ELEMS], acc, scratch)  # Line 10
        ops.wait_all()  # no copy outlives the block (an empty range: Q_i's)

        ops.allreduce_sum(l_part, rscratch)  # l of each row: the sum of its four lanes' parts
        if KW > 1:
            merge_key_warps(o, lse, ob, h, row0, n_q, m, l_part, acc)
            return
        for i in range(TM):
            row = row0 + ops.thread_row(i)
            if row < n_q:
                inv_l = ops.reciprocal_or_zero(l_part[i])  # Line 12: O_i = diag(l)^-1 O~
                for dt in range(DT):
                    for e in range(2):
                        d = ops.col_of(dt, e)
                        if d < D:
                            x = acc[dt, 2 * i + e] * inv_l
                            if F32_OUT:  # a split's partial O_s, merged later in float32
                                o[ob, h, row, d] = x
                            else:
                                ops.store_out(o, ob, h, row, d, x)  # Line 14: write O_i
                if ops.lane_t() == 0:  # Lines 13, 15: L_i = m + log(l)
                    lse[ob, h, row] = ops.log_sum_exp(m[i], l_part[i])

    return tc_fa2_forward
