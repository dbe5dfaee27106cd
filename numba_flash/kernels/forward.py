"""The forward pass on CUDA cores as one kernel skeleton with compiled-in switches (issue 10).

FlashAttention (Dao et al. 2022, Algorithm 1) and FlashAttention-2 (Dao 2023, Algorithm 1)
compute the same function; the second paper changes several things at once. Each change is a
switch of this skeleton (:class:`Variant`), so that any one can be measured alone:

- ``loop_order``: ``"kv_outer"`` (FA-1: K/V tiles outside, Q tiles inside, the state O, l, m of
  every row round-tripping through global memory at every step) or ``"q_outer"`` (FA-2: Q tiles
  outside, K/V inside, the state on chip for the whole walk);
- ``grid``: ``"heads"`` (one block per (batch, head), as FA-1 launches) or ``"heads_x_qtiles"``
  (one block per Q tile of every (batch, head): FA-2's sequence parallelism; with
  ``kv_outer`` each block owns one Q tile and still walks every K/V tile around it);
- ``rescale``: ``"every_step"`` (O normalised by its running l at every step, FA-1 line 12) or
  ``"deferred"`` (O~ kept unnormalised and divided once at the end, FA-2 line 12);
- ``o_load`` (``kv_outer`` only): where the previous O_i, l_i, m_i are read: ``"at_update"``
  (after P~_ij V_j is computed, just before they are needed) or ``"with_q"`` (with Q_i, as
  FA-1 line 8 lists them: the loads are in flight during S = Q K^T, at the cost of registers);
- ``warp_partition``: ``"split_q"`` (each warp owns query rows of the tile and sees all of
  K_j, V_j: FA-2 section 3.3) or ``"split_k"`` (the warps form ``SPLIT_K_GROUPS`` groups, each
  with all rows of Q_i and its own part of every K/V tile; each group keeps its own (m, l, O)
  and the groups' states are merged through shared memory with the merge of
  ``numba_flash.online`` -- at the end of the walk for q_outer, at every step for kv_outer,
  whose state goes to global memory after each step: the communication FA-2 removes).

FA-1 and FA-2 are two named points (:data:`FA1`, :data:`FA2`): ``fa1.fa1_kernel`` and
``fa2.fa2_kernel`` are this skeleton at those points. The tile steps (loads, S, masking, row
max, P~ = exp2(S - m), P~ V) are ``tile_ops``'s, shared by every variant.

Arguments (every variant): ``q (B,H,Nq,D)``, ``k, v (B,Hkv,Nk,D)``; ``o`` out (q's dtype;
``(S*B,H,Nq,D)`` for split partials); ``lse`` out ``(S*B,H,Nq) float32``; ``o_hbm (B,H,Nq,D)
float32``, ``l_hbm, m_hbm (B,H,Nq) float32``: the state in global memory of ``kv_outer``
(any float32 arrays of rank 4, 3, 3 for ``q_outer``, which never reads them); ``q_scale =
scale * log2(e)`` (float32); ``kv_order``: int32 permutation of the K/V tiles (read when
``permuted``); ``seqlens``: int32 ``(B,)`` valid keys per batch (read when ``ragged``);
``n_splits``, ``rows_per_query`` (int32; ``block_info``, ``mask``; q_outer only, 1 and 1
otherwise). ``kv_outer`` with ``cast_out``: O is kept in ``o_hbm`` (float32) and cast into
``o`` at the end; without, ``o_hbm`` is the output and ``o`` is not read.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from numba_flash._cuda import cuda, float32, int32

from numba_flash.kernels import mask, softmax
from numba_flash.kernels.jit import NEG_INF, SMEM_ALIGN, device_jit, kernel_jit, shared_tile
from numba_flash.kernels.block_info import batch_and_head, split_of_block, split_tiles, tile_of_block, valid_keys
from numba_flash.kernels.row_reduce import scratch_floats
from numba_flash.kernels.tile_ops import tile_ops
from numba_flash.kernels.tiles import ROWS_PER_THREAD, VEC, register_cap, uses_dynamic_smem

LOOP_ORDERS = ("kv_outer", "q_outer")
GRIDS = ("heads", "heads_x_qtiles")
RESCALES = ("every_step", "deferred")
WARP_PARTITIONS = ("split_q", "split_k")
SPLIT_K_GROUPS = 2  # split_k: the warps of a block form this many groups, each on 1/groups of every K/V tile
O_LOADS = ("at_update", "with_q")


@dataclass(frozen=True)
class Variant:
    """One point of the FA-1 -> FA-2 ablation space (see the module doc)."""

    loop_order: str
    grid: str
    rescale: str
    warp_partition: str = "split_q"
    o_load: str = "at_update"

    def __post_init__(self):
        for name, allowed in (("loop_order", LOOP_ORDERS), ("grid", GRIDS), ("rescale", RESCALES),
                              ("warp_partition", WARP_PARTITIONS), ("o_load", O_LOADS)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}; got {value!r}")
        if self.loop_order == "q_outer" and self.o_load != "at_update":
            raise ValueError("o_load is a switch of the kv_outer loop order (q_outer keeps O on chip)")

    @property
    def name(self) -> str:
        named = {FA1: "fa1", FA2: "fa2"}
        if self in named:
            return named[self]
        return "-".join((self.loop_order, self.grid, self.rescale, self.warp_partition, self.o_load))


FA1 = Variant("kv_outer", "heads", "every_step", "split_q", "at_update")
FA2 = Variant("q_outer", "heads_x_qtiles", "deferred", "split_q", "at_update")


@functools.lru_cache(maxsize=None)
def forward_kernel(variant: Variant, head_dim: int, block_m: int, block_n: int, causal: bool,
                   permuted: bool = False, ragged: bool = False, cast_out: bool = False,
                   rows_per_thread: int = ROWS_PER_THREAD, maxreg: int | None = None):
    """The forward kernel at ``variant`` for one specialisation (memoised).

    Launch: ``grid = (n_blocks,)`` with ``n_blocks = B * H`` (``grid="heads"``) or
    ``ceil(Nq / block_m) * B * H`` (``"heads_x_qtiles"``), times ``n_splits`` for ``q_outer``;
    ``block = (variant_threads(...),)``; dynamic shared memory ``variant_dynamic_smem_bytes(...)``
    (0 unless the tiles need more than 48 KiB: then one dynamic buffer holds Q_i | K_j | V_j | P~).
    ``rows_per_thread``: the micro-tile height (``tile_table.forward_rows_per_thread``; split_q only).
    ``maxreg``: ``tiles.register_cap``'s override (``NUMBA_FLASH_FFMA_MAXREG``, read by the host).
    Arguments: the module doc.
    """
    D, BM, BN = head_dim, block_m, block_n
    CAUSAL, PERMUTED, RAGGED, CAST_OUT = bool(causal), bool(permuted), bool(ragged), bool(cast_out)
    KV_OUTER = variant.loop_order == "kv_outer"
    PER_TILE = variant.grid == "heads_x_qtiles"
    EVERY_STEP = variant.rescale == "every_step"
    O_WITH_Q = variant.o_load == "with_q"
    SPLIT_K = variant.warp_partition == "split_k"
    KG = SPLIT_K_GROUPS if SPLIT_K else 1  # groups of warps splitting each K/V tile
    BNG = BN // KG  # keys of a K/V tile per group
    if SPLIT_K and rows_per_thread != ROWS_PER_THREAD:
        raise ValueError("split_k runs the 4-row micro-tile only")
    ops = tile_ops(D, BM, BNG, KG, rows_per_thread)  # the tile steps every variant shares (one group's layout)
    L = ops.layout
    NT = L.threads  # threads of one group
    TM, TN, DG = L.rows_per_thread, L.cols_per_thread, L.dim_groups
    Q_FLOATS, K_FLOATS, V_FLOATS, P_FLOATS = L.q_floats, L.k_floats, L.v_floats, L.p_floats
    SCRATCH = scratch_floats(TM, NT * KG)
    ACC_COLS = VEC * DG  # output columns per thread
    KV_LOADS = L.kv_loads
    O_REGS = TM if O_WITH_Q else 1  # rows of the O_i read early (o_load="with_q")
    STATE = TM * (2 + ACC_COLS)  # one thread's (m, l, O) of its rows, for the merge of split_k
    MERGE_FLOATS = (KG - 1) * NT * STATE  # groups 1.. write their states, group 0 merges them
    K_ALL, V_ALL, P_ALL = KG * K_FLOATS, KG * V_FLOATS, KG * P_FLOATS  # shared sizes: compile-time constants
    # split_k: Q_i and the groups' P~ in one buffer, which the merge reuses once they are read
    # (within the 48 KiB of static shared memory: D=64 64x32 46.6 KB, D=128 32x16 37.6 KB)
    QP_FLOATS = max(Q_FLOATS + P_ALL, MERGE_FLOATS)
    # split_q above 48 KiB: the tiles are views of one dynamic buffer, Q_i | K_j | V_j | P~
    # (jit.shared_tile: a constant offset from the base, so the 128-bit loads stay LDS.128)
    DYNAMIC = not SPLIT_K and uses_dynamic_smem(D, BM, BN)
    q_tile = shared_tile(0, Q_FLOATS)
    k_tile = shared_tile(Q_FLOATS, K_FLOATS)
    v_tile = shared_tile(Q_FLOATS + K_FLOATS, V_FLOATS)
    p_tile = shared_tile(Q_FLOATS + K_FLOATS + V_FLOATS, P_FLOATS)

    update_rows = softmax.row_update(TM, ops.rescale_row, not EVERY_STEP)

    @device_jit
    def group_of_thread():
        """The split_k group of this thread (0 for split_q)."""
        if SPLIT_K:
            return cuda.threadIdx.x // NT
        return 0

    @device_jit
    def merge_groups(m, l_sum, acc, merge_s):
        """split_k: the (m, l, O~) of every group's thread in this thread's position merged into
        group 0's (``online.merge`` in log2 units: m = max, each side rescaled by exp2(m_g - m),
        then added; an empty side, m = -inf, weighs 0). Groups 1.. write their states into
        ``merge_s`` (which aliases Q_i and P~: hence the first barrier); after the second, group 0
        reads them. All threads must call."""
        grp = group_of_thread()
        cuda.syncthreads()  # everyone is done with Q_i and P~
        if grp > 0:
            base = ((grp - 1) * NT + cuda.threadIdx.x % NT) * STATE
            for i in range(TM):
                merge_s[base + i] = m[i]
                merge_s[base + TM + i] = l_sum[i]
                for c in range(ACC_COLS):
                    merge_s[base + 2 * TM + i * ACC_COLS + c] = acc[i, c]
        cuda.syncthreads()  # every group's state is in shared memory
        if grp == 0:
            for g in range(1, KG):
                other = ((g - 1) * NT + cuda.threadIdx.x % NT) * STATE
                for i in range(TM):
                    m_g = merge_s[other + i]
                    m_new = ops.nan_max(m[i], m_g)
                    a_own, a_g = softmax.merge_weights(m[i], m_g, ops.finite_or_zero(m_new))
                    l_sum[i] = a_own * l_sum[i] + a_g * merge_s[other + TM + i]
                    for c in range(ACC_COLS):
                        acc[i, c] = a_own * acc[i, c] + a_g * merge_s[other + 2 * TM + i * ACC_COLS + c]
                    m[i] = m_new

    @device_jit
    def walk_q_tile(i_tile, q, k, v, o, lse, q_scale, kv_order, rows_per_query, n_splits, split, b, h, hk, ob, n_q, n_k,
                    n_kv_tiles, q_s, k_s, v_s, p_s, scratch, s, acc, tile_max, m_ref, row_sums, m, l_run, last_keys, kv_reg,
                    grp, key0, merge_s):
        """FA-2 lines 4-15 for Q tile ``i_tile``: its whole K/V walk with O~, l, m on chip.
        split_k: this thread's group ``grp`` walks keys ``key0 ..`` of every K/V tile (``k_s``,
        ``v_s``, ``p_s``: its part), and the groups' states are merged at the end."""
        row0 = i_tile * BM
        # Line 4: load Q_i into shared memory (scaled into log2 units).
        if not SPLIT_K or grp == 0:  # (split_k: the groups share Q_i; one loads it)
            ops.load_q_tile(q, b, h, row0, n_q, q_scale, q_s)
        # Line 5: O~ = 0, l = 0, m = -inf, on chip.
        ops.zero(acc)
        for i in range(TM):
            m[i] = float32(NEG_INF)
            l_run[i] = float32(0.0)
        ops.row_last_keys(row0, n_q, n_k, CAUSAL, last_keys, rows_per_query)
        # The last key any row of this Q tile sees: tiles after it are fully masked.
        tile_last_key = ops.packed_last_visible_key(min(row0 + BM, n_q) - 1, rows_per_query, n_q, n_k, CAUSAL)
        first_row_last_key = ops.packed_last_visible_key(row0, rows_per_query, n_q, n_k, CAUSAL)

        # The K/V tiles to walk: in order, up to the last one any row of this Q tile sees
        # (causal: the rest are masked for every row, section 3.1.1); or all, permuted;
        # of them, this split's range.
        n_visible = n_kv_tiles if PERMUTED else mask.kv_tiles_seen(tile_last_key, n_kv_tiles, BN)
        first, end = split_tiles(n_visible, n_splits, split)
        for jj in range(first, end):  # Line 6: for 1 <= j <= Tc
            j = kv_order[jj] if PERMUTED else jj
            col0 = j * BN
            if col0 > tile_last_key:
                continue  # permuted order, causal: every score of this tile is masked
            cuda.syncthreads()  # everyone is done with the previous K_j, V_j and P~
            colg = col0 + key0  # this group's keys of the tile (split_q: all of them)
            ops.load_kv_tile(k, v, b, hk, colg, n_k, k_s, v_s, kv_reg)  # Line 7
            cuda.syncthreads()  # Q_i, K_j, V_j are in shared memory before anyone reads them
            ops.score_tile(q_s, k_s, s)  # Line 8: S_i^(j) = Q_i K_j^T
            masked = ops.tile_needs_mask(colg, first_row_last_key)
            if masked:
                ops.mask_scores(s, colg, last_keys)
            # Line 9: m^(j) = max(m^(j-1), rowmax(S_i^(j))).
            ops.row_max(s, tile_max, scratch)
            # Lines 9-10: m, l and O~ rescaled where the max moved (every_step: O is kept
            # normalised, which does not depend on m)
            update_rows(m, l_run, acc, tile_max, m_ref)
            # Line 9: P~ = exp(S - m^(j)), l^(j) += rowsum(P~) (this thread's keys).
            ops.exp_scores(s, m_ref, p_s, row_sums)
            if EVERY_STEP:
                # FA-1's line 12 on chip: O_i <- diag(l_new)^-1 (diag(l) O_i + P~ V_j) at every
                # step. l must then be the whole row's sum now (FA-2 keeps per-thread parts
                # and adds them once, at the end).
                ops.allreduce_sum(row_sums, scratch)
                for i in range(TM):
                    ops.rescale_row(acc, i, l_run[i])  # diag(l) O_i
                cuda.syncthreads()  # P~ of every row is in shared memory
                ops.pv_tile(p_s, v_s, acc, colg, last_keys, masked)  # + P~ V_j
                for i in range(TM):
                    l_new = l_run[i] + row_sums[i]
                    ops.rescale_row(acc, i, ops.reciprocal_or_zero(l_new))  # diag(l_new)^-1
                    l_run[i] = l_new
            else:
                for i in range(TM):
                    l_run[i] += row_sums[i]
                cuda.syncthreads()  # P~ of every row is in shared memory
                ops.pv_tile(p_s, v_s, acc, colg, last_keys, masked)  # Line 10: O~ += P~ V_j

        if not EVERY_STEP:
            ops.allreduce_sum(l_run, scratch)  # l of each row: the sum of its threads' parts
        if SPLIT_K:  # the groups' states (over their keys) merged into group 0's
            if EVERY_STEP:
                for i in range(TM):
                    ops.rescale_row(acc, i, l_run[i])  # back to O~ = diag(l) O for the merge
            merge_groups(m, l_run, acc, merge_s)
        for i in range(TM):
            row = row0 + ops.thread_row(i)
            if row < n_q and grp == 0:
                # Line 12: O_i = diag(l)^-1 O~ (every_step: O_i is normalised already)
                inv_l = float32(1.0) if EVERY_STEP and not SPLIT_K else ops.reciprocal_or_zero(l_run[i])
                for g in range(DG):
                    for u in range(VEC):
                        d = ops.out_col(g, u)
                        if d < D:
                            o[ob, h, row, d] = acc[i, VEC * g + u] * inv_l  # Line 14: write O_i
                if ops.thread_col() == 0:  # Lines 13, 15: L_i = m + log(l)
                    lse[ob, h, row] = ops.log_sum_exp(m[i], l_run[i])

    @kernel_jit(fastmath={"contract", "afn", "arcp"}, max_registers=register_cap(D, rows_per_thread, maxreg))
    def forward(q, k, v, o, lse, o_hbm, l_hbm, m_hbm, q_scale, kv_order, seqlens, n_splits, rows_per_query):
        n_batch = q.shape[0]
        n_heads = q.shape[1]
        n_q = q.shape[2]
        group = n_heads // k.shape[1]  # query heads per kv head (GQA / MQA)
        n_q_tiles = (n_q + BM - 1) // BM  # Tr

        # The grid: (batch, head) and, per tile, the Q tile; q_outer also the split of its K/V walk.
        split = 0
        block = cuda.blockIdx.x
        if not KV_OUTER:
            split, block = split_of_block(cuda.blockIdx.x, (n_q_tiles if PER_TILE else 1) * n_batch * n_heads)
        # (q_outer, causal: the longest walks, the last Q tiles, first)
        i_first, i_end, bh = tile_of_block(block, n_q_tiles, PER_TILE, CAUSAL and not KV_OUTER)
        b, h = batch_and_head(bh, n_heads)
        hk = h // group
        ob = split * n_batch + b  # where a split's partial result goes
        n_k = valid_keys(seqlens, b, k.shape[2], RAGGED)
        n_kv_tiles = (n_k + BN - 1) // BN  # Tc
        first_of_row = ops.thread_col() == 0
        grp = group_of_thread()  # split_k: this thread's group (its part of every K/V tile)
        lead = grp == 0  # split_k: the group that holds the merged state (split_q: everyone)

        if SPLIT_K:  # each group its own part of K_j, V_j and its P~; the merge reuses Q_i and P~
            qp = cuda.shared.array(QP_FLOATS, float32, SMEM_ALIGN)
            k_all = cuda.shared.array(K_ALL, float32, SMEM_ALIGN)
            v_all = cuda.shared.array(V_ALL, float32, SMEM_ALIGN)
            q_s = qp[:Q_FLOATS]
            k_s = k_all[grp * K_FLOATS : (grp + 1) * K_FLOATS]
            v_s = v_all[grp * V_FLOATS : (grp + 1) * V_FLOATS]
            p_s = qp[Q_FLOATS + grp * P_FLOATS : Q_FLOATS + (grp + 1) * P_FLOATS]
            merge_s = qp
        elif DYNAMIC:
            smem = cuda.shared.array(0, float32, SMEM_ALIGN)  # dynamic: Q_i | K_j | V_j | P~
            q_s = q_tile(smem)
            k_s = k_tile(smem)
            v_s = v_tile(smem)
            p_s = p_tile(smem)
            merge_s = q_s  # (not used)
        else:
            q_s = cuda.shared.array(Q_FLOATS, float32, SMEM_ALIGN)
            k_s = cuda.shared.array(K_FLOATS, float32, SMEM_ALIGN)
            v_s = cuda.shared.array(V_FLOATS, float32, SMEM_ALIGN)
            p_s = cuda.shared.array(P_FLOATS, float32, SMEM_ALIGN)
            merge_s = q_s  # (not used)
        key0 = grp * BNG  # this group's first key of a K/V tile
        scratch = cuda.shared.array(SCRATCH, float32)  # row reductions in the simulator only
        s = cuda.local.array((TM, TN), float32)
        acc = cuda.local.array((TM, ACC_COLS), float32)
        tile_max = cuda.local.array(TM, float32)
        m_ref = cuda.local.array(TM, float32)
        row_sums = cuda.local.array(TM, float32)
        m = cuda.local.array(TM, float32)
        l_run = cuda.local.array(TM, float32)
        last_keys = cuda.local.array(TM, int32)
        kv_reg = cuda.local.array(KV_LOADS, float32)  # this thread's share of K_j or V_j in flight
        o_old = cuda.local.array((O_REGS, ACC_COLS), float32)  # O_i read with Q_i (o_load="with_q")

        if KV_OUTER:
            # ---------------------------------------------------------------- FA-1's loop nest
            # Line 2: O = 0, l = 0, m = -inf in HBM (each thread, the elements it will own).
            for i_tile in range(i_first, i_end):
                for i in range(TM):
                    row = i_tile * BM + ops.thread_row(i)
                    if row < n_q and lead:
                        for g in range(DG):
                            for u in range(VEC):
                                d = ops.out_col(g, u)
                                if d < D:
                                    o_hbm[b, h, row, d] = float32(0.0)
                        if first_of_row:
                            l_hbm[b, h, row] = float32(0.0)
                            m_hbm[b, h, row] = float32(NEG_INF)

            # One Q tile per block (heads_x_qtiles): the K/V tiles it sees, as FA-2 walks them
            # (causal: those past its last visible key are masked for every row of it).
            own_last_key = ops.last_visible_key(min(i_first * BM + BM, n_q) - 1, n_q, n_k, CAUSAL)
            n_kv_walk = n_kv_tiles
            if PER_TILE and not PERMUTED:
                n_kv_walk = mask.kv_tiles_seen(own_last_key, n_kv_tiles, BN)
            for jj in range(n_kv_walk):  # Line 5: for 1 <= j <= Tc
                j = kv_order[jj] if PERMUTED else jj
                col0 = j * BN
                if PER_TILE and col0 > own_last_key:
                    continue  # permuted order, causal: the block's one Q tile sees nothing of K_j
                cuda.syncthreads()  # everyone is done with the previous K_j, V_j
                colg = col0 + key0  # this group's keys of the tile (split_q: all of them)
                ops.load_kv_tile(k, v, b, hk, colg, n_k, k_s, v_s, kv_reg)  # Line 6

                for i_tile in range(i_first, i_end):  # Line 7: for 1 <= i <= Tr
                    row0 = i_tile * BM
                    # causal: skip Q tiles for which every key of K_j is masked (block-uniform)
                    if col0 > ops.last_visible_key(min(row0 + BM, n_q) - 1, n_q, n_k, CAUSAL):
                        continue
                    cuda.syncthreads()  # the previous Q_i and P~ are no longer read
                    if lead:  # (split_k: the groups share Q_i; one loads it)
                        ops.load_q_tile(q, b, h, row0, n_q, q_scale, q_s)  # Line 8: load Q_i
                    if O_WITH_Q:  # Line 8 as written: O_i, l_i, m_i with Q_i
                        for i in range(TM):
                            row = row0 + ops.thread_row(i)
                            if row < n_q and lead:
                                l_run[i] = l_hbm[b, h, row]
                                m[i] = m_hbm[b, h, row]
                                for g in range(DG):
                                    for u in range(VEC):
                                        d = ops.out_col(g, u)
                                        if d < D:
                                            o_old[i, VEC * g + u] = o_hbm[b, h, row, d]
                    cuda.syncthreads()  # Q_i (and K_j, V_j) in shared memory
                    ops.score_tile(q_s, k_s, s)  # Line 9: S_ij = Q_i K_j^T
                    ops.row_last_keys(row0, n_q, n_k, CAUSAL, last_keys, 1)
                    first_row_last_key = ops.last_visible_key(row0, n_q, n_k, CAUSAL)
                    masked = ops.tile_needs_mask(colg, first_row_last_key)
                    if masked:
                        ops.mask_scores(s, colg, last_keys)
                    # Line 10: m~_ij = rowmax(S_ij), P~_ij = exp(S_ij - m~_ij), l~_ij = rowsum(P~_ij).
                    ops.row_max(s, tile_max, scratch)
                    for i in range(TM):
                        m_ref[i] = ops.finite_or_zero(tile_max[i])
                    ops.exp_scores(s, m_ref, p_s, row_sums)
                    ops.allreduce_sum(row_sums, scratch)
                    if not O_WITH_Q:
                        # Line 8's l_i, m_i, read here (before the barrier: the row's first
                        # thread overwrites them after it).
                        for i in range(TM):
                            row = row0 + ops.thread_row(i)
                            if row < n_q and lead:
                                l_run[i] = l_hbm[b, h, row]
                                m[i] = m_hbm[b, h, row]
                    cuda.syncthreads()  # P~_ij of every row is in shared memory
                    ops.zero(acc)
                    ops.pv_tile(p_s, v_s, acc, colg, last_keys, masked)  # acc = P~_ij V_j
                    if SPLIT_K:  # the groups' (m~, l~, P~V) over their keys, merged: the whole tile's
                        merge_groups(tile_max, row_sums, acc, merge_s)
                    for i in range(TM):
                        row = row0 + ops.thread_row(i)
                        if row < n_q and lead and tile_max[i] != NEG_INF:  # else the tile adds nothing
                            # Line 11: m_new = max(m_i, m~_ij); l_new = e^{m_i-m_new} l_i + e^{m~_ij-m_new} l~_ij.
                            m_new = ops.nan_max(m[i], tile_max[i])
                            alpha_old, alpha_tile = softmax.merge_weights(m[i], tile_max[i], m_new)
                            l_new = alpha_old * l_run[i] + alpha_tile * row_sums[i]
                            if EVERY_STEP:
                                # Line 12: O_i <- diag(l_new)^-1 (diag(l_i) e^{m_i-m_new} O_i + e^{m~_ij-m_new} P~_ij V_j).
                                inv_l = ops.reciprocal_or_zero(l_new)
                                w_old = l_run[i] * alpha_old * inv_l
                                w_tile = alpha_tile * inv_l
                            else:  # deferred: O~_i <- e^{m_i-m_new} O~_i + e^{m~_ij-m_new} P~_ij V_j
                                w_old = alpha_old
                                w_tile = alpha_tile
                            for g in range(DG):
                                for u in range(VEC):
                                    d = ops.out_col(g, u)
                                    if d < D:
                                        o_prev = o_old[i, VEC * g + u] if O_WITH_Q else o_hbm[b, h, row, d]
                                        o_hbm[b, h, row, d] = w_old * o_prev + w_tile * acc[i, VEC * g + u]
                            if first_of_row:  # Line 13: l_i <- l_new, m_i <- m_new to HBM.
                                l_hbm[b, h, row] = l_new
                                m_hbm[b, h, row] = m_new

            # every_step: each value read below was written by the reading thread itself;
            # deferred: every thread of a row reads l_i, which the row's first thread wrote.
            cuda.syncthreads()
            # Line 16: return O (normalised now if the rescale was deferred; cast to q's dtype
            # when O was kept in float32) and L = m + log l.
            for i_tile in range(i_first, i_end):
                for i in range(TM):
                    row = i_tile * BM + ops.thread_row(i)
                    if row < n_q and lead:
                        if EVERY_STEP:
                            if CAST_OUT:
                                for g in range(DG):
                                    for u in range(VEC):
                                        d = ops.out_col(g, u)
                                        if d < D:
                                            o[b, h, row, d] = o_hbm[b, h, row, d]
                        else:  # deferred: O_i = diag(l_i)^-1 O~_i, once
                            inv_l = ops.reciprocal_or_zero(l_hbm[b, h, row])
                            for g in range(DG):
                                for u in range(VEC):
                                    d = ops.out_col(g, u)
                                    if d < D:
                                        if CAST_OUT:
                                            o[b, h, row, d] = o_hbm[b, h, row, d] * inv_l
                                        else:
                                            o_hbm[b, h, row, d] = o_hbm[b, h, row, d] * inv_l
                        if first_of_row:
                            lse[b, h, row] = ops.log_sum_exp(m_hbm[b, h, row], l_hbm[b, h, row])
        else:
            # ---------------------------------------------------------------- FA-2's loop nest
            # Line 3: for 1 <= i <= Tr -- the grid (one Q tile per block), or this block's loop.
            if PER_TILE:
                walk_q_tile(i_first, q, k, v, o, lse, q_scale, kv_order, rows_per_query, n_splits, split, b, h, hk, ob, n_q,
                            n_k, n_kv_tiles, q_s, k_s, v_s, p_s, scratch, s, acc, tile_max, m_ref, row_sums, m, l_run,
                            last_keys, kv_reg, grp, key0, merge_s)
            else:
                for i_tile in range(n_q_tiles):
                    cuda.syncthreads()  # the previous Q tile's last P~ and V_j are no longer read
                    walk_q_tile(i_tile, q, k, v, o, lse, q_scale, kv_order, rows_per_query, n_splits, split, b, h, hk, ob,
                                n_q, n_k, n_kv_tiles, q_s, k_s, v_s, p_s, scratch, s, acc, tile_max, m_ref, row_sums, m,
                                l_run, last_keys, kv_reg, grp, key0, merge_s)

    return forward


def variant_threads(variant: Variant, head_dim: int, block_m: int, block_n: int,
                    rows_per_thread: int = ROWS_PER_THREAD) -> int:
    """Threads per block of ``variant``'s kernel: the tile layout's, times the groups of split_k
    (each group has the layout of block_m x block_n / groups)."""
    from numba_flash.kernels.tiles import threads_per_block

    if variant.warp_partition == "split_k":
        return SPLIT_K_GROUPS * threads_per_block(head_dim, block_m, block_n // SPLIT_K_GROUPS)
    return threads_per_block(head_dim, block_m, block_n, rows_per_thread)


def variant_dynamic_smem_bytes(variant: Variant, head_dim: int, block_m: int, block_n: int) -> int:
    """Dynamic shared memory a launch of ``variant``'s kernel passes: its tiles when they need
    more than the 48 KiB of static shared memory (split_q), else 0."""
    if variant.warp_partition == "split_q" and uses_dynamic_smem(head_dim, block_m, block_n):
        return variant_smem_bytes(variant, head_dim, block_m, block_n)
    return 0


def variant_smem_bytes(variant: Variant, head_dim: int, block_m: int, block_n: int) -> int:
    """Shared memory of ``variant``'s kernel, static or dynamic (float32 tiles; split_k: each group's K/V and
    P~ parts, Q_i and the P~ parts in one buffer that the merge reuses)."""
    from numba_flash.kernels.tiles import VEC, smem_bytes, tile_layout

    if variant.warp_partition != "split_k":
        return smem_bytes(head_dim, block_m, block_n)
    groups = SPLIT_K_GROUPS
    layout = tile_layout(head_dim, block_m, block_n // groups)
    state = layout.rows_per_thread * (2 + VEC * layout.dim_groups)
    qp = max(layout.q_floats + groups * layout.p_floats, (groups - 1) * layout.threads * state)
    return 4 * (qp + groups * (layout.k_floats + layout.v_floats))
