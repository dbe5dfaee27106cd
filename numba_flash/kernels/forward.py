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

FA-1 and FA-2 are two named points (:data:`FA1`, :data:`FA2`): ``fa1.fa1_kernel``,
``fa2.fa2_kernel`` (CUDA cores) and ``tc_fa1.tc_fa1_kernel``, ``tc_fa2.tc_fa2_kernel`` (tensor
cores) are this skeleton at those points. Each loop nest is written once, against an engine
(``engines``: the tile steps S, masking, row max, P~ = exp2(S - m), P~ V on FFMA micro-tiles or
``mma.sync``) and a pipeline (``pipeline``: how K_j, V_j, Q_i are copied and the barriers), so
every variant runs on both engines. On tensor cores split_k's groups are key warps (``mma_engine``
with ``key_warps = SPLIT_K_GROUPS``: each warp of a group holds 16 query rows and multiplies its
group's keys of every K/V tile); their states are merged by the same ``merge_groups`` as on CUDA
cores, through shared memory.

Arguments (every variant): ``q (B,H,Nq,D)``, ``k, v (B,Hkv,Nk,D)``; ``o`` out (q's dtype;
``(S*B,H,Nq,D)`` for split partials); ``lse`` out ``(S*B,H,Nq) float32``; ``o_hbm (B,H,Nq,D)
float32``, ``l_hbm, m_hbm (B,H,Nq) float32``: the state in global memory of ``kv_outer``
(any float32 arrays of rank 4, 3, 3 for ``q_outer``, which never reads them); ``q_scale =
scale * log2(e)`` (float32); ``kv_order``: int32 permutation of the K/V tiles (read when
``permuted``); ``seqlens``: int32 ``(B,)`` valid keys per batch (read when ``ragged``);
``n_splits``, ``rows_per_query`` (int32; ``block_info``, ``mask``; q_outer only, 1 and 1
otherwise); ``softcap_log2``: the soft cap in log2 units (float32; read when ``softcap``);
``alibi``: ``(B, H) float32`` ALiBi slopes times log2(e), H the query heads (read when ``alibi``;
any 2-D float32 array otherwise).
``kv_outer`` with ``cast_out``: O is kept in ``o_hbm`` (float32) and cast into ``o`` at the
end; without, ``o_hbm`` is the output and ``o`` is not read.
"""

from __future__ import annotations

from dataclasses import dataclass

from numba_flash._cuda import cuda, float32, int32

from numba_flash.kernels import mask, mma, paged, score_mods, softmax
from numba_flash.kernels.mask import window_of
from numba_flash.kernels.block_info import (batch_and_head, list_row, listed_partial, listed_range, listed_tile,
                                            sequence_span, split_of_block, split_tiles, tile_of_block, valid_keys)
from numba_flash.kernels.engines import CudaCores, TensorCores, ffma_engine, key_warp_merge, mma_engine
from numba_flash.kernels.jit import NEG_INF, SMEM_ALIGN, device_jit, kernel_factory, kernel_jit, shared_tile
from numba_flash.kernels.pipeline import cp_async, synchronous
from numba_flash.kernels.row_reduce import scratch_floats
from numba_flash.kernels.tiles import ROWS_PER_THREAD, uses_dynamic_smem

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


def tensor_core_min_block_n(variant) -> int:
    """The fewest keys per K/V tile the tensor-core engine runs ``variant`` with: 16 (one
    m16n8k16 step), times the groups for split_k (each group's warps take ``block_n /
    SPLIT_K_GROUPS`` keys)."""
    return 16 * (SPLIT_K_GROUPS if variant is not None and variant.warp_partition == "split_k" else 1)


def check_tensor_core_variant(variant, block_n: int) -> None:
    """``ValueError`` for a variant the tensor-core engine cannot run with ``block_n`` keys per
    tile (:func:`tensor_core_min_block_n`)."""
    if variant is not None and variant.warp_partition == "split_k" and block_n < tensor_core_min_block_n(variant):
        raise ValueError(f"split_k on tensor cores gives each of its {SPLIT_K_GROUPS} warp groups block_n / "
                         f"{SPLIT_K_GROUPS} keys, at least 16: block_n={block_n} is too small (32 or more)")


def tc_split_k_merge_floats(loop_order: str, layout) -> tuple[int, int]:
    """split_k on tensor cores: where the groups' states go for the merge, as (first float32 of
    the dynamic shared memory, floats). Q-outer merges once, after the walk: over the tiles.
    K/V-outer merges at every step while K_j, V_j are still in use: after the tiles."""
    groups, warps = SPLIT_K_GROUPS, layout.block_m // 16
    state = 2 * (2 + layout.padded_dim // 4)  # a thread's m, l and O~ of its two rows (engines.mma_engine)
    floats = (groups - 1) * 32 * warps * state
    base = 0 if loop_order == "q_outer" else -(-layout.smem_bytes // 16) * 4
    return base, floats


def tc_split_k_smem_bytes(loop_order: str, layout) -> int:
    """Dynamic shared memory of a split_k kernel on tensor cores: its tiles, and the merge's states."""
    base, floats = tc_split_k_merge_floats(loop_order, layout)
    return max(layout.smem_bytes, 4 * (base + floats))


@kernel_factory
def forward_kernel(variant: Variant, tiles, window, permuted: bool = False, ragged: bool = False,
                   cast_out: bool = False, f32_out: bool = False, max_registers: int | None = None,
                   softcap: bool = False, alibi: bool = False, user_mods=None, varlen: bool = False,
                   page_size: int = 0):
    """The forward kernel at ``variant`` on the engine of ``tiles`` (memoised).

    ``window``: the mask's ``(left, right)`` of ``kernels.mask`` (a compile-time constant; a bool:
    the public ``causal``); ``softcap``: the scores are soft-capped (``score_mods``; the cap is
    the argument ``softcap_log2``, read only then); ``alibi``: the scores gain ALiBi's bias
    (``score_mods``; the slopes are the argument ``alibi``, read only then); ``user_mods``: a
    ``score_mods.UserMods`` (a user's ``mask_mod`` and ``score_mod``, compiled in), and then the
    kernel takes one more argument, the tuple of their ``mod_args`` arrays. ``varlen``: the
    sequences of a packed batch (``numba_flash.varlen``): ``seqlens`` is then int32 ``(2, B + 1)``,
    ``cu_seqlens_q`` and ``cu_seqlens_k``, and every array a ``(1, H, total, ...)`` view of the
    packed rows; each block cuts its sequence's rows out of them (``block_info.sequence_span``).
    ``page_size``: ``k`` and ``v`` are a paged cache, each the pair ``(pages, block_table)`` of
    ``kernels.paged`` (``decode(..., block_table=)``; the copies look the pages up); 0: arrays.
    ``tiles``: ``engines.CudaCores`` (FFMA micro-tiles, synchronous copies) or
    ``engines.TensorCores`` (``mma.sync``, ``cp.async`` copies: ``pipeline.cp_async``).
    ``cast_out`` (kv_outer): O lives in ``o_hbm`` (float32) and is cast into ``o`` at the end
    (always so on tensor cores); ``f32_out`` (tensor cores, q_outer): ``o`` is float32 (split
    partials), written as it is. ``max_registers``: the register cap the host chose
    (``tiles.register_cap``, ``tc_ops.tc_register_cap``).

    Launch: ``grid = (n_blocks,)`` with ``n_blocks = B * H`` (``grid="heads"``) or
    ``ceil(Nq / block_m) * B * H`` (``"heads_x_qtiles"``), times ``n_splits`` for ``q_outer``;
    ``block = (threads,)``, dynamic shared memory: ``specs.kernel_spec``'s (CUDA cores:
    ``variant_threads``, ``variant_dynamic_smem_bytes``; tensor cores: ``tc_layout(...)``'s, with
    split_k's key warps and ``tc_split_k_smem_bytes``). Arguments: the module doc.
    """
    D, BM, BN = tiles.head_dim, tiles.block_m, tiles.block_n
    WINDOW = window_of(window)
    PERMUTED, RAGGED, F32_OUT, SOFTCAP, ALIBI = bool(permuted), bool(ragged), bool(f32_out), bool(softcap), bool(alibi)
    VARLEN = bool(varlen)  # a packed batch: the grid is (sequence, head, Q tile); seqlens holds cu_seqlens
    KV = paged.kv_source(page_size)  # k, v: arrays, or a paged cache's (pages, block_table)
    PAGED = KV.PAGED  # (a closure constant: the branches below are pruned, a contiguous kernel's code unchanged)
    if VARLEN and KV.PAGED:
        raise ValueError("a packed batch (varlen) reads contiguous K/V, not a paged cache")
    if VARLEN and (RAGGED or PERMUTED or user_mods is not None or f32_out):
        raise ValueError("a packed batch (varlen) runs unsplit, in order, without cache lengths or a user's mods")
    if VARLEN and variant.loop_order == "q_outer" and variant.grid != "heads_x_qtiles":
        raise ValueError("a packed batch (varlen) runs FA-2's order on its per-Q-tile grid")  # (the heads grid's
        # loop counts the packed rows' tiles)
    HAS_USER = user_mods is not None  # a user's mask_mod / score_mod (score_mods.UserMods)
    # a block mask's tile lists (block_info): the walks visit the listed tiles only, and mask_mod
    # runs on the partial ones
    SPARSE = HAS_USER and user_mods.block_sparse
    if SPARSE and PERMUTED:
        raise ValueError("a block-sparse walk visits its listed tiles in order (no kv_tile_order)")
    KV_OUTER = variant.loop_order == "kv_outer"
    PER_TILE = variant.grid == "heads_x_qtiles"
    EVERY_STEP = variant.rescale == "every_step"
    O_WITH_Q = variant.o_load == "with_q"
    SPLIT_K = variant.warp_partition == "split_k"
    TENSOR_CORES = isinstance(tiles, TensorCores)
    if TENSOR_CORES:
        KW, STAGES = int(tiles.key_warps), int(tiles.kv_stages)
        check_tensor_core_variant(variant, BN)
        if PERMUTED:
            raise ValueError("the tensor-core engine walks the K/V tiles in order (its copies run ahead of the walk)")
        if KW < 1 or BN % KW or BN // KW < 16:
            raise ValueError(f"key_warps must divide block_n into parts of >= 16 keys; got {KW} for {BN}")
        if SPARSE and (STAGES > 1 or KW > 1):
            raise ValueError("a block-sparse walk copies one K/V tile ahead (kv_stages = key_warps = 1)")
        if KW > 1 and (STAGES < 2 or BM != 16):
            raise ValueError(f"key_warps={KW} needs a ring (kv_stages > 1) and block_m = 16")
        if (KV_OUTER or variant != FA2) and (STAGES > 1 or KW > 1):
            raise ValueError("a ring of K/V tiles and key warps are FA-2's (kv_stages = key_warps = 1 elsewhere)")
        presplit = tiles.presplit
        KEY_WARP_MERGE = KW > 1  # decode's key warps merge themselves (engines.key_warp_merge)
        KG = 1
        if SPLIT_K:  # the groups are key warps; no pre-split operands (each group reads its own keys)
            KW = KG = SPLIT_K_GROUPS
            presplit = ""
        E = mma_engine(tiles.kind, D, BM, BN, tiles.row_walk, presplit, KW, SPLIT_K, KV.PAGE_SIZE)
        pipe = cp_async(E, BN, STAGES)
        L = E.copies.layout
        NT = L.threads // KG  # threads of one group
        CAST_OUT = True  # O, l, m of kv_outer in float32 HBM; o in the input type
        merge_key_warps = key_warp_merge(E, BN, STAGES, F32_OUT) if KEY_WARP_MERGE else None
        MERGE_BASE, _ = tc_split_k_merge_floats(variant.loop_order, L)
        Q_ELEMS, KV_ELEMS = L.q_elems, L.kv_elems
        SPLIT_BASE = Q_ELEMS + 2 * KV_ELEMS
        K_SPLIT, V_SPLIT = L.k_split_elems, L.v_split_elems
        SMEM_TYPE = mma.uint16 if L.elem_bytes == 2 else float32
        MMA_SCRATCH = mma.scratch_floats(L.threads)
        DYNAMIC = True
    else:
        KEY_WARP_MERGE = False
        CAST_OUT = bool(cast_out)
        KG = SPLIT_K_GROUPS if SPLIT_K else 1  # groups of warps splitting each K/V tile
        BNG = BN // KG  # keys of a K/V tile per group
        if SPLIT_K and tiles.rows_per_thread != ROWS_PER_THREAD:
            raise ValueError("split_k runs the 4-row micro-tile only")
        E = ffma_engine(D, BM, BNG, KG, tiles.rows_per_thread, KV.PAGE_SIZE)  # one group's layout
        pipe = synchronous(E)
        L = E.layout
        NT = L.threads  # threads of one group
        Q_FLOATS, K_FLOATS, V_FLOATS, P_FLOATS = L.q_floats, L.k_floats, L.v_floats, L.p_floats
        K_ALL, V_ALL, P_ALL = KG * K_FLOATS, KG * V_FLOATS, KG * P_FLOATS  # shared sizes: compile-time constants
        # split_q above 48 KiB: the tiles are views of one dynamic buffer, Q_i | K_j | V_j | P~
        # (jit.shared_tile: a constant offset from the base, so the 128-bit loads stay LDS.128)
        DYNAMIC = not SPLIT_K and uses_dynamic_smem(D, BM, BN)
        q_tile = shared_tile(0, Q_FLOATS)
        k_tile = shared_tile(Q_FLOATS, K_FLOATS)
        v_tile = shared_tile(Q_FLOATS + K_FLOATS, V_FLOATS)
        p_tile = shared_tile(Q_FLOATS + K_FLOATS + V_FLOATS, P_FLOATS)
    # FA-1 block-sparse: a block of one Q tile walks its list; a block of every Q tile, each K/V tile's
    SPARSE_OWN, SPARSE_EACH = SPARSE and PER_TILE, SPARSE and not PER_TILE
    SKIPS_TILES = pipe.SYNCHRONOUS  # a walk may skip tiles only where no copy runs ahead of it
    # a ring (or tensor-core split_k): the products read this stage's tiles, this group's keys of them
    SLICED, OPERAND_ELEMS = pipe.SLICED, pipe.OPERAND_ELEMS
    TM, OUT = E.rows_per_thread, E.out_cols
    S_SHAPE, ACC_SHAPE, QF_SHAPE, QF_SMALL_SHAPE, KV_LOADS = E.s_shape, E.acc_shape, E.qf_shape, E.qf_small_shape, E.kv_reg
    SCRATCH = scratch_floats(TM, NT * KG)
    O_REGS = TM if O_WITH_Q else 1  # rows of the O_i read early (o_load="with_q")
    STATE = TM * (2 + OUT)  # one thread's (m, l, O) of its rows, for the merge of split_k
    MERGE_FLOATS = (KG - 1) * NT * STATE  # groups 1.. write their states, group 0 merges them
    if TENSOR_CORES and SPLIT_K and MERGE_FLOATS != tc_split_k_merge_floats(variant.loop_order, L)[1]:
        raise AssertionError("tc_split_k_merge_floats disagrees with the engine's state")  # (the host sizes the launch)
    if not TENSOR_CORES:
        # split_k: Q_i and the groups' P~ in one buffer, which the merge reuses once they are read
        # (within the 48 KiB of static shared memory: D=64 64x32 46.6 KB, D=128 32x16 37.6 KB)
        QP_FLOATS = max(Q_FLOATS + P_ALL, MERGE_FLOATS)
    cap = {"max_registers": max_registers} if max_registers else {}

    update_rows = softmax.row_update(TM, E.rescale_row, not EVERY_STEP)
    row_queries = score_mods.query_rows(TM, E.thread_row) if HAS_USER else None
    user_tile = score_mods.tile_user_mods(S_SHAPE[0], S_SHAPE[1], E.score_key, E.score_row, user_mods) if HAS_USER else None

    @device_jit
    def scores_modded(s, q_scale, colg, first_keys, last_keys, masked, cap, slopes, diags, n_k, b, positions, heads,
                      mod_args, partial):
        """S in log2 units with every modification (API.md 2c's order): the scale, softcap and ALiBi
        (the engine's), a user's score_mod and mask_mod (``partial``: a tile mask_mod may hide
        entries of; a block mask's full tile skips it), then the built-in mask."""
        if HAS_USER:
            E.scale_mask(s, q_scale, colg, first_keys, last_keys, False, WINDOW, SOFTCAP, cap, ALIBI, slopes, diags)
            user_tile(s, colg, n_k, b, positions, heads, mod_args, partial)
            if masked:
                E.mask_tile(s, colg, first_keys, last_keys, WINDOW)
        else:
            E.scale_mask(s, q_scale, colg, first_keys, last_keys, masked, WINDOW, SOFTCAP, cap, ALIBI, slopes, diags)

    @device_jit
    def merge_groups(m, l_sum, acc, merge_s):
        """split_k: the (m, l, O~) of every group's thread in this thread's position merged into
        group 0's (``online.merge`` in log2 units: m = max, each side rescaled by exp2(m_g - m),
        then added; an empty side, m = -inf, weighs 0). Groups 1.. write their states into
        ``merge_s`` (which aliases Q_i and P~ -- on tensor cores every tile for q_outer; for
        kv_outer it lies after K_j, V_j, still in use -- hence the first barrier); after the
        second, group 0 reads them. All threads must call."""
        grp = E.group()
        cuda.syncthreads()  # everyone is done with Q_i and P~
        if grp > 0:
            base = ((grp - 1) * NT + cuda.threadIdx.x % NT) * STATE
            for i in range(TM):
                merge_s[base + i] = m[i]
                merge_s[base + TM + i] = l_sum[i]
                for c in range(OUT):
                    merge_s[base + 2 * TM + i * OUT + c] = acc[E.acc_row(i, c), E.acc_col(i, c)]
        cuda.syncthreads()  # every group's state is in shared memory
        if grp == 0:
            for g in range(1, KG):
                other = ((g - 1) * NT + cuda.threadIdx.x % NT) * STATE
                for i in range(TM):
                    m_g = merge_s[other + i]
                    m_new = E.nan_max(m[i], m_g)
                    a_own, a_g = softmax.merge_weights(m[i], m_g, E.finite_or_zero(m_new))
                    l_sum[i] = a_own * l_sum[i] + a_g * merge_s[other + TM + i]
                    for c in range(OUT):
                        acc[E.acc_row(i, c), E.acc_col(i, c)] = (a_own * acc[E.acc_row(i, c), E.acc_col(i, c)]
                                                                 + a_g * merge_s[other + 2 * TM + i * OUT + c])
                    m[i] = m_new

    @device_jit
    def store(o, b, h, row, d, x):
        """One element of O in o's type (f32_out: a split's float32 partial, as it is)."""
        if F32_OUT:
            o[b, h, row, d] = x
        else:
            E.store_out(o, b, h, row, d, x)

    @device_jit
    def walk_q_tile(i_tile, q, k, v, o, lse, q_scale, kv_order, rows_per_query, n_splits, split, b, h, hk, ob, n_q, n_k,
                    n_kv_tiles, smem, q_s, k_s, v_s, p_s, k_split, v_split, rscratch, mscratch, qf, qf_small, s, acc,
                    tile_max, m_ref, row_sums, m, l_run, first_keys, last_keys, kv_reg, merge_s, cap, slopes, diags,
                    alibi, positions, heads, mod_args, walk_counts, walk_lists):
        """FA-2 lines 4-15 for Q tile ``i_tile``: its whole K/V walk with O~, l, m on chip.
        split_k: this thread's group walks its keys of every K/V tile (``k_s``, ``v_s``, ``p_s``:
        its part), and the groups' states are merged at the end. Block-sparse: the K/V tiles
        listed for this Q tile (``walk_counts``, ``walk_lists``: block_info) among those."""
        row0 = i_tile * BM
        lead = E.group() == 0  # split_k: the group that holds the merged state (else everyone)
        key0 = E.first_key()  # this thread's first key of every K/V tile (split_k, key warps)
        if pipe.Q_BEFORE_RANGE:  # Line 4: load Q_i into shared memory (synchronous copies: first)
            pipe.load_q(q, b, h, row0, n_q, q_scale, q_s, lead)
        E.row_key_bounds(row0, n_q, n_k, WINDOW, first_keys, last_keys, rows_per_query)
        if ALIBI:  # each row's slope and diagonal key (score_mods)
            E.row_alibi(alibi, b, h, row0, n_q, n_k, rows_per_query, slopes, diags)
        if HAS_USER:  # each row's query position and head, for a user's mods
            row_queries(h, row0, n_q, rows_per_query, positions, heads)
        # The keys any row of this Q tile sees: [its first row's first, its last row's last];
        # tiles outside are masked for every row.
        row_last = min(row0 + BM, n_q) - 1
        tile_first_key = mask.packed_first_visible_key(row0, rows_per_query, n_q, n_k, WINDOW)
        tile_last_key = mask.packed_last_visible_key(row_last, rows_per_query, n_q, n_k, WINDOW)
        first_row_last_key = mask.packed_last_visible_key(row0, rows_per_query, n_q, n_k, WINDOW)
        last_row_first_key = mask.packed_first_visible_key(row_last, rows_per_query, n_q, n_k, WINDOW)
        # The K/V tiles to walk: in order, those any row of this Q tile sees (causal, a window:
        # the rest are masked for every row, section 3.1.1); or all, permuted; of them, this
        # split's range.
        tile0, n_visible = 0, n_kv_tiles
        if not PERMUTED:
            tile0, n_visible = mask.kv_tile_range(tile_first_key, tile_last_key, n_kv_tiles, BN, WINDOW)
        if SPARSE:  # [first, end) index the block mask's list: its tiles in the range above
            n_listed, listed = list_row(walk_counts, walk_lists, b, h, i_tile)
            lo, hi = 0, n_listed
            if WINDOW[0] >= 0 or WINDOW[1] >= 0:  # (a built-in mask: its range of the list, by bisection)
                lo, hi = listed_range(listed, n_listed, tile0, n_visible)
            first, end = split_tiles(hi - lo, n_splits, split)
            first += lo
            end += lo
            next_entry = listed[first] if first < end else 0  # (each step reads the entry after its own)
            col_first = listed_tile(next_entry) * BN
        else:
            listed = kv_order  # (not read)
            next_entry = 0
            first, end = split_tiles(n_visible, n_splits, split)
            first += tile0
            end += tile0
            col_first = (kv_order[first] if PERMUTED and first < end else first) * BN
        if not pipe.Q_BEFORE_RANGE:  # Line 4: Q_i, issued with the first K/V copies (one commit group)
            pipe.load_q(q, b, h, row0, n_q, q_scale, q_s, lead)
        # The pipeline's first K/V copies.
        pipe.start(k, v, b, hk, n_k, col_first, end - first, smem, k_s, v_s)
        # Line 5: O~ = 0, l = 0, m = -inf, on chip.
        E.zero(acc)
        for i in range(TM):
            m[i] = float32(NEG_INF)
            l_run[i] = float32(0.0)

        for jj in range(first, end):  # Line 6: for 1 <= j <= Tc
            partial = True  # (mask_mod applies: no block mask says the tile is full)
            if SPARSE:  # this tile's entry, read by the step before; the next one's, for the copies ahead
                entry = next_entry
                col0 = listed_tile(entry) * BN
                partial = listed_partial(entry)
                next_entry = listed[jj + 1] if jj + 1 < end else entry
                col_next = listed_tile(next_entry) * BN
            else:
                j = kv_order[jj] if PERMUTED else jj
                col0 = j * BN
                col_next = col0 + BN
            if SKIPS_TILES:
                if mask.tile_hidden(col0, BN, tile_first_key, tile_last_key, WINDOW):
                    continue  # permuted order, a mask: every score of this tile is masked
            step = jj - first
            colg = col0 + key0  # this thread's keys of the tile
            pipe.before_scores(k, v, b, hk, col0, col_next, step, end - first, n_k, smem, k_s, v_s, k_split, kv_reg)  # Line 7
            if jj == first:
                E.q_frags(q_s, qf, qf_small)
            if SLICED:  # this stage's K_j (this warp's keys of it)
                k_op = smem[pipe.k_offset(step) : pipe.k_offset(step) + OPERAND_ELEMS]
            else:
                k_op = pipe.k_operand(smem, k_s, k_split, step)
            E.score_tile(qf, qf_small, q_s, k_op, s, mscratch)  # Line 8: S_i^(j) = Q_i K_j^T
            masked = E.tile_needs_mask(colg, first_row_last_key, last_row_first_key, WINDOW)
            scores_modded(s, q_scale, colg, first_keys, last_keys, masked, cap, slopes, diags, n_k, b, positions, heads,
                          mod_args, partial)
            # Line 9: m^(j) = max(m^(j-1), rowmax(S_i^(j))).
            E.row_max(s, tile_max, rscratch)
            # Lines 9-10: m, l and O~ rescaled where the max moved (every_step: O is kept
            # normalised, which does not depend on m)
            update_rows(m, l_run, acc, tile_max, m_ref)
            # Line 9: P~ = exp(S - m^(j)), l^(j) += rowsum(P~) (this thread's keys).
            E.exp_scores(s, m_ref, p_s, row_sums)
            if EVERY_STEP:
                # FA-1's line 12 on chip: O_i <- diag(l_new)^-1 (diag(l) O_i + P~ V_j) at every
                # step. l must then be the whole row's sum now (FA-2 keeps per-thread parts
                # and adds them once, at the end).
                E.allreduce_sum(row_sums, rscratch)
                for i in range(TM):
                    E.rescale_row(acc, i, l_run[i])  # diag(l) O_i
                pipe.before_pv(k, v, b, hk, col0, col_next, step, end - first, n_k, smem, k_s, v_s, v_split)
                if SLICED:
                    v_op = smem[pipe.v_offset(step) : pipe.v_offset(step) + OPERAND_ELEMS]
                else:
                    v_op = pipe.v_operand(smem, v_s, v_split, step)
                E.pv_tile(s, p_s, v_op, acc, colg, first_keys, last_keys, masked, WINDOW, mscratch)  # + P~ V_j
                for i in range(TM):
                    l_new = l_run[i] + row_sums[i]
                    E.rescale_row(acc, i, E.reciprocal_or_zero(l_new))  # diag(l_new)^-1
                    l_run[i] = l_new
            else:
                for i in range(TM):
                    l_run[i] += row_sums[i]
                pipe.before_pv(k, v, b, hk, col0, col_next, step, end - first, n_k, smem, k_s, v_s, v_split)
                if SLICED:
                    v_op = smem[pipe.v_offset(step) : pipe.v_offset(step) + OPERAND_ELEMS]
                else:
                    v_op = pipe.v_operand(smem, v_s, v_split, step)
                E.pv_tile(s, p_s, v_op, acc, colg, first_keys, last_keys, masked, WINDOW, mscratch)  # Line 10: O~ += P~ V_j
        pipe.finish()  # no copy outlives the walk

        if not EVERY_STEP:
            E.allreduce_sum(l_run, rscratch)  # l of each row: the sum of its threads' parts
        if SPLIT_K:  # the groups' states (over their keys) merged into group 0's
            if EVERY_STEP:
                for i in range(TM):
                    E.rescale_row(acc, i, l_run[i])  # back to O~ = diag(l) O for the merge
            merge_groups(m, l_run, acc, merge_s)
        if KEY_WARP_MERGE:  # the key warps' states merged, and Lines 12-15
            merge_key_warps(o, lse, ob, h, row0, n_q, m, l_run, acc)
            return
        for i in range(TM):
            row = row0 + E.thread_row(i)
            if row < n_q and lead:
                # Line 12: O_i = diag(l)^-1 O~ (every_step: O_i is normalised already)
                inv_l = float32(1.0) if EVERY_STEP and not SPLIT_K else E.reciprocal_or_zero(l_run[i])
                for c in range(OUT):
                    d = E.out_col(c)
                    if d < D:
                        store(o, ob, h, row, d, acc[E.acc_row(i, c), E.acc_col(i, c)] * inv_l)  # Line 14: write O_i
                if E.first_of_row():  # Lines 13, 15: L_i = m + log(l)
                    lse[ob, h, row] = E.log_sum_exp(m[i], l_run[i])

    @device_jit
    def walk_kv_tiles(i_first, i_end, q, k, v, o, lse, o_hbm, l_hbm, m_hbm, q_scale, kv_order, b, h, hk, n_q, n_k,
                      n_kv_tiles, smem, q_s, k_s, v_s, p_s, k_split, v_split, rscratch, mscratch, qf, qf_small, s, acc,
                      tile_max, m_ref, row_sums, m, l_run, first_keys, last_keys, kv_reg, o_old, merge_s, cap, slopes,
                      diags, alibi, positions, heads, mod_args, walk_counts, walk_lists):
        """FA-1 lines 2-16 for Q tiles ``i_first ..`` of one (batch, head): the K/V tiles outside,
        the state O, l, m of every row in global memory between steps. Block-sparse: a block of
        one Q tile walks the K/V tiles listed for it; a block of every Q tile walks, for each K/V
        tile, the Q tiles listed for it (``walk_counts``, ``walk_lists``: block_info)."""
        lead = E.group() == 0  # split_k: the group that holds the merged state (else everyone)
        first_of_row = E.first_of_row()
        key0 = E.first_key()
        # Line 2: O = 0, l = 0, m = -inf in HBM (each thread, the elements it will own).
        for i_tile in range(i_first, i_end):
            for i in range(TM):
                row = i_tile * BM + E.thread_row(i)
                if row < n_q and lead:
                    for c in range(OUT):
                        d = E.out_col(c)
                        if d < D:
                            o_hbm[b, h, row, d] = float32(0.0)
                    if first_of_row:
                        l_hbm[b, h, row] = float32(0.0)
                        m_hbm[b, h, row] = float32(NEG_INF)

        # One Q tile per block (heads_x_qtiles): the K/V tiles it sees, as FA-2 walks them
        # (causal, a window: the others are masked for every row of it).
        own_first_key = mask.first_visible_key(i_first * BM, n_q, n_k, WINDOW)
        own_last_key = mask.last_visible_key(min(i_first * BM + BM, n_q) - 1, n_q, n_k, WINDOW)
        tile0, n_kv_walk = 0, n_kv_tiles
        if PER_TILE and not PERMUTED:
            tile0, n_kv_walk = mask.kv_tile_range(own_first_key, own_last_key, n_kv_tiles, BN, WINDOW)
        own_listed = kv_order  # (block-sparse, one Q tile: its listed K/V tiles in the range above)
        if SPARSE_OWN:
            n_own, own_listed = list_row(walk_counts, walk_lists, b, h, i_first)
            tile0, end = listed_range(own_listed, n_own, tile0, n_kv_walk)
            n_kv_walk = end - tile0
        for jj in range(tile0, tile0 + n_kv_walk):  # Line 5: for 1 <= j <= Tc
            own_partial = True  # (mask_mod applies: no block mask says the pair is full)
            if SPARSE_OWN:
                j = listed_tile(own_listed[jj])
                own_partial = listed_partial(own_listed[jj])
            else:
                j = kv_order[jj] if PERMUTED else jj
            col0 = j * BN
            if PER_TILE and mask.tile_hidden(col0, BN, own_first_key, own_last_key, WINDOW):
                continue  # permuted order, a mask: the block's one Q tile sees nothing of K_j
            # The Q tiles to visit: i_first .., or (block-sparse, every Q tile) those listed for K_j
            ii_first, ii_end = i_first, i_end
            q_listed = kv_order
            if SPARSE_EACH:
                n_q_listed, q_listed = list_row(walk_counts, walk_lists, b, h, j)
                if n_q_listed == 0:
                    continue  # K_j is hidden from every row: not even loaded
                ii_first, ii_end = 0, n_q_listed
            colg = col0 + key0  # this thread's keys of the tile
            pipe.kv_tile(k, v, b, hk, col0, n_k, smem, k_s, v_s, k_split, v_split, kv_reg)  # Line 6

            for ii in range(ii_first, ii_end):  # Line 7: for 1 <= i <= Tr
                i_tile = ii
                partial = own_partial
                if SPARSE_EACH:
                    i_tile = listed_tile(q_listed[ii])
                    partial = listed_partial(q_listed[ii])
                row0 = i_tile * BM
                # causal, a window: skip Q tiles for which every key of K_j is masked (block-uniform)
                row_last = min(row0 + BM, n_q) - 1
                if mask.tile_hidden(col0, BN, mask.first_visible_key(row0, n_q, n_k, WINDOW),
                                    mask.last_visible_key(row_last, n_q, n_k, WINDOW), WINDOW):
                    continue
                pipe.q_tile(q, b, h, row0, n_q, q_scale, q_s, lead)  # Line 8: load Q_i
                if O_WITH_Q:  # Line 8 as written: O_i, l_i, m_i with Q_i
                    for i in range(TM):
                        row = row0 + E.thread_row(i)
                        if row < n_q and lead:
                            l_run[i] = l_hbm[b, h, row]
                            m[i] = m_hbm[b, h, row]
                            for c in range(OUT):
                                d = E.out_col(c)
                                if d < D:
                                    o_old[i, c] = o_hbm[b, h, row, d]
                cuda.syncthreads()  # Q_i (and K_j, V_j) in shared memory
                E.q_frags(q_s, qf, qf_small)
                if SLICED:  # this group's keys of K_j
                    k_op = smem[pipe.k_offset(0) : pipe.k_offset(0) + OPERAND_ELEMS]
                else:
                    k_op = pipe.k_operand(smem, k_s, k_split, 0)
                E.score_tile(qf, qf_small, q_s, k_op, s, mscratch)  # Line 9: S_ij = Q_i K_j^T
                E.row_key_bounds(row0, n_q, n_k, WINDOW, first_keys, last_keys, 1)
                if ALIBI:
                    E.row_alibi(alibi, b, h, row0, n_q, n_k, 1, slopes, diags)
                if HAS_USER:
                    row_queries(h, row0, n_q, 1, positions, heads)
                first_row_last_key = mask.last_visible_key(row0, n_q, n_k, WINDOW)
                last_row_first_key = mask.first_visible_key(row_last, n_q, n_k, WINDOW)
                masked = E.tile_needs_mask(colg, first_row_last_key, last_row_first_key, WINDOW)
                scores_modded(s, q_scale, colg, first_keys, last_keys, masked, cap, slopes, diags, n_k, b, positions, heads,
                              mod_args, partial)
                # Line 10: m~_ij = rowmax(S_ij), P~_ij = exp(S_ij - m~_ij), l~_ij = rowsum(P~_ij).
                E.row_max(s, tile_max, rscratch)
                for i in range(TM):
                    m_ref[i] = E.finite_or_zero(tile_max[i])
                E.exp_scores(s, m_ref, p_s, row_sums)
                E.allreduce_sum(row_sums, rscratch)
                if not O_WITH_Q:
                    # Line 8's l_i, m_i, read here (before the barrier: the row's first
                    # thread overwrites them after it).
                    for i in range(TM):
                        row = row0 + E.thread_row(i)
                        if row < n_q and lead:
                            l_run[i] = l_hbm[b, h, row]
                            m[i] = m_hbm[b, h, row]
                cuda.syncthreads()  # P~_ij of every row is in shared memory; every thread read l_i, m_i
                E.zero(acc)
                if SLICED:
                    v_op = smem[pipe.v_offset(0) : pipe.v_offset(0) + OPERAND_ELEMS]
                else:
                    v_op = pipe.v_operand(smem, v_s, v_split, 0)
                E.pv_tile(s, p_s, v_op, acc, colg, first_keys, last_keys, masked, WINDOW, mscratch)  # acc = P~_ij V_j
                if SPLIT_K:  # the groups' (m~, l~, P~V) over their keys, merged: the whole tile's
                    merge_groups(tile_max, row_sums, acc, merge_s)
                for i in range(TM):
                    row = row0 + E.thread_row(i)
                    if row < n_q and lead and tile_max[i] != NEG_INF:  # else the tile adds nothing
                        # Line 11: m_new = max(m_i, m~_ij); l_new = e^{m_i-m_new} l_i + e^{m~_ij-m_new} l~_ij.
                        m_new = E.nan_max(m[i], tile_max[i])
                        alpha_old, alpha_tile = softmax.merge_weights(m[i], tile_max[i], m_new)
                        l_new = alpha_old * l_run[i] + alpha_tile * row_sums[i]
                        if EVERY_STEP:
                            # Line 12: O_i <- diag(l_new)^-1 (diag(l_i) e^{m_i-m_new} O_i + e^{m~_ij-m_new} P~_ij V_j).
                            inv_l = E.reciprocal_or_zero(l_new)
                            w_old = l_run[i] * alpha_old * inv_l
                            w_tile = alpha_tile * inv_l
                        else:  # deferred: O~_i <- e^{m_i-m_new} O~_i + e^{m~_ij-m_new} P~_ij V_j
                            w_old = alpha_old
                            w_tile = alpha_tile
                        for c in range(OUT):
                            d = E.out_col(c)
                            if d < D:
                                o_prev = o_old[i, c] if O_WITH_Q else o_hbm[b, h, row, d]
                                o_hbm[b, h, row, d] = w_old * o_prev + w_tile * acc[E.acc_row(i, c), E.acc_col(i, c)]
                        if first_of_row:  # Line 13: l_i <- l_new, m_i <- m_new to HBM.
                            l_hbm[b, h, row] = l_new
                            m_hbm[b, h, row] = m_new
        pipe.finish()  # no copy outlives the block

        if not EVERY_STEP:
            # deferred: every thread of a row reads l_i, which the row's first thread wrote
            # (every_step: each value read below was written by the reading thread itself)
            cuda.syncthreads()
        # Line 16: return O (normalised now if the rescale was deferred; cast to o's type
        # when O was kept in float32) and L = m + log l.
        for i_tile in range(i_first, i_end):
            for i in range(TM):
                row = i_tile * BM + E.thread_row(i)
                if row < n_q and lead:
                    if EVERY_STEP:
                        if CAST_OUT:
                            for c in range(OUT):
                                d = E.out_col(c)
                                if d < D:
                                    store(o, b, h, row, d, o_hbm[b, h, row, d])
                    else:  # deferred: O_i = diag(l_i)^-1 O~_i, once
                        inv_l = E.reciprocal_or_zero(l_hbm[b, h, row])
                        for c in range(OUT):
                            d = E.out_col(c)
                            if d < D:
                                if CAST_OUT:
                                    store(o, b, h, row, d, o_hbm[b, h, row, d] * inv_l)
                                else:
                                    o_hbm[b, h, row, d] = o_hbm[b, h, row, d] * inv_l
                    if first_of_row:
                        lse[b, h, row] = E.log_sum_exp(m_hbm[b, h, row], l_hbm[b, h, row])

    @device_jit
    def forward_body(q, k, v, o, lse, o_hbm, l_hbm, m_hbm, q_scale, kv_order, seqlens, n_splits, rows_per_query,
                     softcap_log2, alibi, mod_args, walk_counts, walk_lists):
        """The kernel (one body for the signatures below: with user mods, their arrays' tuple; with
        a block mask, its tile lists too)."""
        n_batch = q.shape[0]
        n_heads = q.shape[1]
        n_q = q.shape[2]
        if PAGED:  # query heads per kv head (GQA / MQA)
            group = n_heads // KV.heads(k)
        else:
            group = n_heads // k.shape[1]
        n_q_tiles = (n_q + BM - 1) // BM  # Tr
        if VARLEN:  # the sequences of the packed batch; the grid's Q tiles: the longest sequence's
            n_batch = seqlens.shape[1] - 1
            if PER_TILE:
                n_q_tiles = cuda.gridDim.x // (n_batch * n_heads)

        # The grid (block_info): (batch, head) and, per tile, the Q tile; q_outer also the split
        # of its K/V walk.
        split = 0
        block = cuda.blockIdx.x
        if not KV_OUTER:
            split, block = split_of_block(cuda.blockIdx.x, (n_q_tiles if PER_TILE else 1) * n_batch * n_heads)
        # (q_outer, a right edge (causal) or a block mask (a causal mask_mod's, say): the longest
        # walks, the last Q tiles, first)
        i_first, i_end, bh = tile_of_block(block, n_q_tiles, PER_TILE, (WINDOW[1] >= 0 or SPARSE) and not KV_OUTER)
        b, h = batch_and_head(bh, n_heads)
        hk = h // group
        if VARLEN:  # sequence b's rows of every array (block_info.sequence_span): batch 0 of views
            q0, q1, k0, k1 = sequence_span(seqlens, b)
            q, o, lse, k, v = q[:, :, q0:q1], o[:, :, q0:q1], lse[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1]
            o_hbm, l_hbm, m_hbm = o_hbm[:, :, q0:q1], l_hbm[:, :, q0:q1], m_hbm[:, :, q0:q1]  # (FA-1's, as the queries)
            n_q = q1 - q0
            if ALIBI:
                alibi = alibi[b : b + 1]
            b = 0
            seq_tiles = (n_q + BM - 1) // BM
            if PER_TILE and i_first >= seq_tiles:  # a Q tile past this sequence's end: no work
                return
            i_end = min(i_end, seq_tiles)
        ob = split * n_batch + b  # where a split's partial result goes
        if VARLEN:  # (seqlens holds the prefix sums: not a key count per batch)
            n_k = k.shape[2]
        else:
            n_k = valid_keys(seqlens, b, KV.capacity(k) if PAGED else k.shape[2], RAGGED)
        n_kv_tiles = (n_k + BN - 1) // BN  # Tc

        # Shared memory: the engine's tiles (the mma engine: one dynamic buffer, Q_i | K/V stages |
        # pre-split K_j, V_j; the CUDA-core engine: static tiles, one dynamic buffer above 48 KiB,
        # or split_k's groups' parts).
        if TENSOR_CORES:
            smem = cuda.shared.array(0, SMEM_TYPE, SMEM_ALIGN)  # (16-byte aligned for cp.async, ldmatrix)
            q_s = smem[:Q_ELEMS]
            k_s = smem[Q_ELEMS : Q_ELEMS + KV_ELEMS]
            v_s = smem[Q_ELEMS + KV_ELEMS : Q_ELEMS + 2 * KV_ELEMS]
            k_split = smem[SPLIT_BASE : SPLIT_BASE + K_SPLIT]  # K_j's, V_j's split fragments (if pre-split;
            v_split = smem[SPLIT_BASE + K_SPLIT : SPLIT_BASE + K_SPLIT + V_SPLIT]  # k_s, v_s stage the copies)
            p_s = q_s  # (P~ stays in registers)
            merge_s = q_s  # (not used)
            if SPLIT_K:  # the groups' states, float32, over the tiles (q_outer) or after them (kv_outer)
                merge_all = cuda.shared.array(0, float32, SMEM_ALIGN)
                merge_s = merge_all[MERGE_BASE:]
            mscratch = cuda.shared.array(MMA_SCRATCH, float32)  # simulated mma only
        else:
            grp = E.group()
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
                dyn = cuda.shared.array(0, float32, SMEM_ALIGN)  # dynamic: Q_i | K_j | V_j | P~
                q_s = q_tile(dyn)
                k_s = k_tile(dyn)
                v_s = v_tile(dyn)
                p_s = p_tile(dyn)
                merge_s = q_s  # (not used)
            else:
                q_s = cuda.shared.array(Q_FLOATS, float32, SMEM_ALIGN)
                k_s = cuda.shared.array(K_FLOATS, float32, SMEM_ALIGN)
                v_s = cuda.shared.array(V_FLOATS, float32, SMEM_ALIGN)
                p_s = cuda.shared.array(P_FLOATS, float32, SMEM_ALIGN)
                merge_s = q_s  # (not used)
            smem = q_s  # (not used: the synchronous pipeline names its tiles)
            k_split = k_s
            v_split = v_s
        rscratch = cuda.shared.array(SCRATCH, float32)  # row reductions in the simulator only
        if not TENSOR_CORES:
            mscratch = rscratch  # (no simulated mma)
        qf = cuda.local.array(QF_SHAPE, mma.uint32)  # Q_i's fragments (mma engine)
        qf_small = cuda.local.array(QF_SMALL_SHAPE, mma.uint32)
        s = cuda.local.array(S_SHAPE, float32)
        acc = cuda.local.array(ACC_SHAPE, float32)
        tile_max = cuda.local.array(TM, float32)
        m_ref = cuda.local.array(TM, float32)
        row_sums = cuda.local.array(TM, float32)
        m = cuda.local.array(TM, float32)
        l_run = cuda.local.array(TM, float32)
        first_keys = cuda.local.array(TM, int32)  # each row's visible keys [first, last] (first: a left edge only)
        last_keys = cuda.local.array(TM, int32)
        slopes = cuda.local.array(TM, float32)  # ALiBi: each row's slope and diagonal key (score_mods)
        diags = cuda.local.array(TM, int32)
        positions = cuda.local.array(TM, int32)  # a user's mods: each row's query position and head
        heads = cuda.local.array(TM, int32)
        kv_reg = cuda.local.array(KV_LOADS, float32)  # this thread's share of K_j or V_j in flight (CUDA cores)

        if KV_OUTER:  # ------------------------------------------------------------ FA-1's loop nest
            o_old = cuda.local.array((O_REGS, OUT), float32)  # O_i read with Q_i (o_load="with_q")
            walk_kv_tiles(i_first, i_end, q, k, v, o, lse, o_hbm, l_hbm, m_hbm, q_scale, kv_order, b, h, hk, n_q, n_k,
                          n_kv_tiles, smem, q_s, k_s, v_s, p_s, k_split, v_split, rscratch, mscratch, qf, qf_small, s,
                          acc, tile_max, m_ref, row_sums, m, l_run, first_keys, last_keys, kv_reg, o_old, merge_s, softcap_log2,
                          slopes, diags, alibi, positions, heads, mod_args, walk_counts, walk_lists)
        else:  # -------------------------------------------------------------------- FA-2's loop nest
            # Line 3: for 1 <= i <= Tr -- the grid (one Q tile per block), or this block's loop.
            if PER_TILE:
                walk_q_tile(i_first, q, k, v, o, lse, q_scale, kv_order, rows_per_query, n_splits, split, b, h, hk, ob,
                            n_q, n_k, n_kv_tiles, smem, q_s, k_s, v_s, p_s, k_split, v_split, rscratch, mscratch, qf,
                            qf_small, s, acc, tile_max, m_ref, row_sums, m, l_run, first_keys, last_keys, kv_reg, merge_s, softcap_log2,
                            slopes, diags, alibi, positions, heads, mod_args, walk_counts, walk_lists)
            else:
                for i_tile in range(n_q_tiles):
                    cuda.syncthreads()  # the previous Q tile's last P~ and V_j are no longer read
                    walk_q_tile(i_tile, q, k, v, o, lse, q_scale, kv_order, rows_per_query, n_splits, split, b, h, hk,
                                ob, n_q, n_k, n_kv_tiles, smem, q_s, k_s, v_s, p_s, k_split, v_split, rscratch, mscratch,
                                qf, qf_small, s, acc, tile_max, m_ref, row_sums, m, l_run, first_keys, last_keys, kv_reg, merge_s, softcap_log2,
                            slopes, diags, alibi, positions, heads, mod_args, walk_counts, walk_lists)

    if not HAS_USER:
        @kernel_jit(fastmath={"contract", "afn", "arcp"}, **cap)
        def forward(q, k, v, o, lse, o_hbm, l_hbm, m_hbm, q_scale, kv_order, seqlens, n_splits, rows_per_query,
                    softcap_log2, alibi):
            forward_body(q, k, v, o, lse, o_hbm, l_hbm, m_hbm, q_scale, kv_order, seqlens, n_splits, rows_per_query,
                         softcap_log2, alibi, (), (), ())
    elif not SPARSE:
        @kernel_jit(fastmath={"contract", "afn", "arcp"}, **cap)
        def forward(q, k, v, o, lse, o_hbm, l_hbm, m_hbm, q_scale, kv_order, seqlens, n_splits, rows_per_query,
                    softcap_log2, alibi, mod_args):
            forward_body(q, k, v, o, lse, o_hbm, l_hbm, m_hbm, q_scale, kv_order, seqlens, n_splits, rows_per_query,
                         softcap_log2, alibi, mod_args, (), ())
    else:  # a block mask's lists (int32 (B or 1, H or 1, tiles) counts and (.., tiles, tiles) entries) after mod_args
        @kernel_jit(fastmath={"contract", "afn", "arcp"}, **cap)
        def forward(q, k, v, o, lse, o_hbm, l_hbm, m_hbm, q_scale, kv_order, seqlens, n_splits, rows_per_query,
                    softcap_log2, alibi, mod_args, walk_counts, walk_lists):
            forward_body(q, k, v, o, lse, o_hbm, l_hbm, m_hbm, q_scale, kv_order, seqlens, n_splits, rows_per_query,
                         softcap_log2, alibi, mod_args, walk_counts, walk_lists)

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
