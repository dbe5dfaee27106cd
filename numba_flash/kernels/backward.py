"""The backward pass as one kernel skeleton over the two engines (issue 22).

FlashAttention's Algorithm 4 and FlashAttention-2's Algorithm 2 walk the K/V tiles in the outer
loop and the Q tiles in the inner one, recomputing P from the forward's logsumexp; this module
writes that loop nest once (:func:`kv_kernel`), against a *backward engine*:

- ``bwd.ffma_bwd_engine``: register micro-tiles on CUDA cores (float32 tiles, Q_i loaded
  in log2 units, P^T and dS^T through shared memory, synchronous copies);
- ``tc_bwd.mma_bwd_engine``: ``mma.sync`` on tensor cores (16-bit or tf32x3 tiles, P^T and
  dS^T in registers, Q_i, dO_i (O_i) double-buffered by ``cp.async``: the next step's copies
  in flight during this one's products).

The nest has the two loop orders: ``"fa1"`` (one block per (batch, KV head) walks every K/V
tile; D_i = rowsum(dO_i O_i) inside the step, Alg. 4 line 19; dQ_i read, updated and written
back, line 21) and ``"fa2"`` (one block per (K/V tile, batch, KV head); D from the first kernel,
FA-2 line 4; dQ_i by atomics, line 15; ``compute_dq=False``: none, for the deterministic dQ
kernel). The walk over Q tiles and the query heads of a KV head (GQA: dK_j, dV_j sum over them)
is one flat loop of steps, so a pipeline does not drain between heads.

The backward engine interface (device functions; arguments an engine does not need are ignored):

``load_kv(k, v, b, hk, col0, n_k, k_s, v_s)``
    K_j, V_j into shared memory (line 6; the mma engine's copies are asynchronous).
``step_inputs(q, do, o, lse, dvec, b, h, row0, n_q, q_scale, q_s, do_s, o_s, stats)``
    synchronous engines: Q_i, dO_i (FA-1: O_i), L_i (FA-2: D_i) of this step (line 9).
``load_step(q, do, o, b, h, row0, n_q, q_s, do_s, o_s)``, ``read_stats(lse, dvec, b, h, row0, n_q,
nxt)``, ``write_stats(stats, base, nxt)``, ``commit()``, ``wait_all()``
    prefetching engines: a step's tiles issued asynchronously, its L and D through registers.
``kv_frags(k_s, v_s, kf, vf)``
    K_j, V_j's operand fragments into registers once they landed (or nothing).
``rowdot(do_s, o_s, stats, base)``
    FA-1 line 19: D_i = rowsum(dO_i * O_i) into ``stats``.
``scores_t(af, a_s, b_s, out, scratch)``
    S^T = K_j Q_i^T, dP^T = V_j dO_i^T (keys are the rows of a thread's accumulators).
``probs_t(s, dp, stats, base, q_scale, masked, first_q, last_q, window, capped, cap, biased, slope, diags, row0,
pt_s, ds_s, user)``
    P^T = exp2(S^T - L), dS^T = P^T (dP^T - D), hidden entries 0 (in place, or into shared
    memory when ``P_IN_SMEM``); ``capped``: S^T soft-capped first, dS^T times the cap's slope;
    ``biased``: ALiBi's bias (``slope``, ``diags``: each key row's diagonal query); ``user``: with
    the engine's ``user_mods``, ``(b, h, col0, Nq, Nk, mod_args)`` (a user's score_mod, its slope
    in dS, and mask_mod), else ``()``.
``dv_update(s, pt_s, do_s, acc, scratch)``, ``dk_update(dp, ds_s, q_s, acc, scratch)``
    dV_j += P^T dO_i, dK_j += dS^T Q_i.
``dq_update(dp, ds_s, k_s, dq, b, h, row0, n_q, scale, dq_acc, scratch)``
    dQ_i += scale dS K_j (atomics for FA-2, read-modify-write for FA-1).
``key_bounds(col0, n_q, n_k, window, first_q, last_q)``, ``zero(acc)``, ``write_grad(x, b, h, col0, n_k,
acc, factor)``, ``dk_factor(scale)``
    the queries that see each of this thread's keys; the accumulators; the output.

Constants: ``order``, ``block_m``, ``block_n``, ``layout``, ``ELEM`` (the shared element type), ``PREFETCH``, ``PAIRED`` (tf32x3: the
double buffers selected on the offset, ``jit.shared_tile_pair``), ``P_IN_SMEM``, ``STATS_STATIC``
(floats of a static L/D array; 0: ``stats_tile`` of the dynamic buffer), the register arrays'
shapes (``s_shape``, ``acc_shape``, ``dq_shape``, ``af_shape``, ``nxt_shape``, ``first_q_rows``),
``scratch_floats``, and the tile views ``k_tile``, ``v_tile``, ``q_tiles``, ``do_tiles``,
``o_tiles`` (each a pair: the two buffers, one view twice when not prefetching), ``p_tile``,
``ds_tile``, ``stats_tile``; with ``PAIRED``, ``q_pair``, ``do_pair``, ``o_pair``
(``jit.shared_tile_pair``: a buffer's view selected on its offset).
"""

from __future__ import annotations

from numba_flash._cuda import cuda, float32, int32

from numba_flash.kernels import mask, mma
from numba_flash.kernels.mask import window_of
from numba_flash.kernels.block_info import (batch_and_head, list_row, listed_partial, listed_range, listed_tile,
                                            sequence_span, tile_of_block)
from numba_flash.kernels.jit import LOG2E, SMEM_ALIGN, device_jit, kernel_factory, kernel_jit

ORDERS = ("fa1", "fa2")


@kernel_factory
def kv_kernel(engine, window, compute_dq: bool = True, softcap: bool = False, alibi: bool = False,
              varlen: bool = False):
    """The dK/dV (and dQ) kernel on ``engine``, of the loop order it was made for (memoised; the
    engine module's name says all it was made of, and is the kernel's identity in the
    compilation cache): ``bwd.ffma_bwd_engine(order, ...)`` or ``tc_bwd.mma_bwd_engine(order, ...)``.
    ``window``: the mask's ``(left, right)`` of ``kernels.mask`` (a bool: the public ``causal``);
    ``softcap``: the forward soft-capped the scores (``kernels.score_mods``): P is recomputed from
    the capped scores and dS carries the cap's slope; the cap is the argument ``softcap_log2``.
    ``alibi``: the forward added ALiBi's bias (``kernels.score_mods``): P is recomputed with it
    (a constant of the score, it adds nothing to dS); the slopes are the last argument.

    Launch: ``"fa1"``: ``grid = (B * Hkv,)``; ``"fa2"``: ``grid = (ceil(Nk / block_n) * B * Hkv,)``;
    ``block = (layout.threads,)``, dynamic shared memory ``layout.smem_bytes`` (the engine's
    layout: ``bwd.bwd_layout``, ``tc_bwd.tc_bwd_layout``). Arguments: ``q, o, do (B,H,Nq,D)``,
    ``k, v (B,Hkv,Nk,D)`` (the engine's element type), ``lse (B,H,Nq) float32``, ``dvec (B,H,Nq)
    float32`` (D_i; read by ``"fa2"``, FA-1 computes it), ``dq (B,H,Nq,D) float32`` zeroed and
    accumulated into (untouched when not ``compute_dq``), ``dk, dv (B,Hkv,Nk,D')`` out, ``scale``
    (float32), ``softcap_log2`` (float32, the cap in log2 units; read when ``softcap``), ``alibi``
    (``(B, H) float32``: ALiBi's slopes times log2(e), H the query heads; read when ``alibi``).
    ``varlen``: a packed batch (``numba_flash.varlen``): the arrays are ``(1, heads, total, ...)``
    views of packed rows and one more argument, ``cu_seqlens`` int32 ``(2, B + 1)``, follows;
    "fa2"'s grid counts the longest sequence's K/V tiles, and each block cuts its sequence out
    (``block_info.sequence_span``).
    """
    E = engine
    if E.order not in ORDERS:
        raise ValueError(f"the engine's order must be 'fa1' or 'fa2'; got {E.order!r}")
    FA1, WINDOW, DQ, SOFTCAP, ALIBI = E.order == "fa1", window_of(window), bool(compute_dq), bool(softcap), bool(alibi)
    BM, BN = E.block_m, E.block_n
    PREFETCH, PAIRED, P_IN_SMEM, STATS_STATIC = E.PREFETCH, E.PAIRED, E.P_IN_SMEM, E.STATS_STATIC
    ELEM = E.ELEM
    S_SHAPE, ACC_SHAPE, DQ_SHAPE, AF_SHAPE, NXT_SHAPE = E.s_shape, E.acc_shape, E.dq_shape, E.af_shape, E.nxt_shape
    FIRST_Q, SCRATCH = E.first_q_rows, E.scratch_floats
    K_TILE, V_TILE, P_TILE, DS_TILE, STATS_TILE = E.k_tile, E.v_tile, E.p_tile, E.ds_tile, E.stats_tile
    (Q0_TILE, Q1_TILE), (DO0_TILE, DO1_TILE), (O0_TILE, O1_TILE) = E.q_tiles, E.do_tiles, E.o_tiles
    Q_PAIR, DO_PAIR, O_PAIR = E.q_pair, E.do_pair, E.o_pair

    HAS_USER = getattr(E, "user_mods", None) is not None  # a user's mods (the engine's; their arrays: mod_args)
    SPARSE = HAS_USER and E.user_mods.block_sparse  # the Q tiles a block mask lists for each K/V tile and head
    VARLEN = bool(varlen)  # a packed batch: the grid is (sequence, KV head, K/V tile); cu_seqlens last
    if VARLEN and HAS_USER:
        raise ValueError("a packed batch (varlen) takes no user's mods")

    @device_jit
    def first_listed(walk_counts, walk_lists, b, h, h_end, j, i_first, i_end):
        """Block-sparse: ``(h, index, end)`` of the first query head from ``h`` (below ``h_end``)
        whose list for K/V tile ``j`` has Q tiles in ``[i_first, i_end)``: its first index and
        end in the list; ``(h_end, 0, 0)`` if none."""
        while h < h_end:
            n_listed, listed = list_row(walk_counts, walk_lists, b, h, j)
            lo, hi = listed_range(listed, n_listed, i_first, i_end - i_first)
            if lo < hi:
                return h, lo, hi
            h += 1
        return h_end, 0, 0

    @device_jit
    def bwd_body(q, k, v, o, do, lse, dvec, dq, dk, dv, scale, softcap_log2, alibi, mod_args, walk_counts, walk_lists,
                 cu_seqlens):
        n_heads, n_q = q.shape[1], q.shape[2]
        n_kv_heads, n_k = k.shape[1], k.shape[2]
        group = n_heads // n_kv_heads
        n_kv_tiles = (n_k + BN - 1) // BN
        n_q_tiles = (n_q + BM - 1) // BM
        if VARLEN and not FA1:  # the grid's K/V tiles: the longest sequence's
            n_kv_tiles = cuda.gridDim.x // ((cu_seqlens.shape[1] - 1) * n_kv_heads)
        # FA-1: one block per (batch, KV head), walking every K/V tile (line 5); FA-2: one per
        # (K/V tile, batch, KV head), line 5's loop is the grid
        j_first, j_end, bh = tile_of_block(cuda.blockIdx.x, n_kv_tiles, not FA1, False)
        b, hk = batch_and_head(bh, n_kv_heads)
        if VARLEN:  # sequence b's rows of every array (block_info.sequence_span): batch 0 of views
            q0, q1, k0, k1 = sequence_span(cu_seqlens, b)
            q, o, do, lse, dvec, dq = q[:, :, q0:q1], o[:, :, q0:q1], do[:, :, q0:q1], lse[:, :, q0:q1], \
                dvec[:, :, q0:q1], dq[:, :, q0:q1]
            k, v, dk, dv = k[:, :, k0:k1], v[:, :, k0:k1], dk[:, :, k0:k1], dv[:, :, k0:k1]
            if ALIBI:
                alibi = alibi[b : b + 1]
            b = 0
            n_q, n_k = q.shape[2], k.shape[2]
            n_kv_tiles = (n_k + BN - 1) // BN
            n_q_tiles = (n_q + BM - 1) // BM
            if j_first >= n_kv_tiles:  # a K/V tile past this sequence's end (FA-2): no work
                return
            j_end = min(j_end, n_kv_tiles)
        q_scale = scale * float32(LOG2E)

        smem = cuda.shared.array(0, ELEM, SMEM_ALIGN)  # the engine's tiles: K_j, V_j, Q_i, dO_i (O_i), P^T, dS^T
        k_s, v_s = K_TILE(smem), V_TILE(smem)
        q0_s, q1_s, do0_s, do1_s = Q0_TILE(smem), Q1_TILE(smem), DO0_TILE(smem), DO1_TILE(smem)
        o0_s, o1_s = O0_TILE(smem), O1_TILE(smem)  # (FA-1 only; FA-2: aliases of Q_i, never touched)
        pt_s, ds_s = P_TILE(smem), DS_TILE(smem)
        if STATS_STATIC > 0:  # L_i, D_i of each buffer (block_m each)
            stats = cuda.shared.array(STATS_STATIC, float32)
        else:
            stats = STATS_TILE(smem)
        scratch = cuda.shared.array(SCRATCH, float32)  # simulated mma only

        kf = cuda.local.array(AF_SHAPE, mma.uint32)  # K_j's, V_j's A fragments (mma engine)
        vf = cuda.local.array(AF_SHAPE, mma.uint32)
        s = cuda.local.array(S_SHAPE, float32)  # S^T, then P^T
        dp = cuda.local.array(S_SHAPE, float32)  # dP^T, then dS^T
        dk_acc = cuda.local.array(ACC_SHAPE, float32)
        dv_acc = cuda.local.array(ACC_SHAPE, float32)
        dq_acc = cuda.local.array(DQ_SHAPE, float32)
        first_q = cuda.local.array(FIRST_Q, int32)  # the queries [first, last] that see each key row
        last_q = cuda.local.array(FIRST_Q, int32)  # (a left edge only)
        diags = cuda.local.array(FIRST_Q, int32)  # ALiBi: the query on each key row's diagonal
        nxt = cuda.local.array(NXT_SHAPE, float32)  # the next step's L, D (prefetching engines)

        for j in range(j_first, j_end):  # line 5: for 1 <= j <= Tc
            col0 = j * BN
            # Causal, a window: Q tiles before the one holding the first query that sees key col0,
            # and (a left edge) after the one holding the last query that sees the tile's last
            # key, see none of this tile's keys (kernels.mask).
            i_first = mask.first_q_tile(col0, n_q, n_k, BM, WINDOW)
            i_end = mask.q_tiles_end(min(col0 + BN, n_k) - 1, n_q, n_k, BM, n_q_tiles, WINDOW)
            n_steps = group * max(0, i_end - i_first)  # (query head, Q tile) steps
            h = hk * group  # this step's query head and Q tile (counters: no division in the loop)
            i = i_first
            partial = True  # (mask_mod applies: no block mask says the pair is full)
            at, end = 0, 0  # block-sparse: this step's index in its head's list, and the list's end
            if SPARSE:  # the (query head, listed Q tile) steps, head by head (block_info)
                n_steps = 0
                for g in range(group):
                    n_listed, listed = list_row(walk_counts, walk_lists, b, hk * group + g, j)
                    lo, hi = listed_range(listed, n_listed, i_first, i_end - i_first)
                    n_steps += hi - lo
                h, at, end = first_listed(walk_counts, walk_lists, b, h, hk * group + group, j, i_first, i_end)
                if n_steps > 0:
                    n_listed, listed = list_row(walk_counts, walk_lists, b, h, j)
                    i = listed_tile(listed[at])
                    partial = listed_partial(listed[at])
            cuda.syncthreads()  # everyone is done with the previous K_j, V_j (buffers, L, D)
            E.load_kv(k, v, b, hk, col0, n_k, k_s, v_s)  # line 6: K_j, V_j to shared memory
            if PREFETCH:  # the first step's Q_i, dO_i (O_i), L_i, D_i, in flight with K_j, V_j
                if n_steps > 0:
                    E.load_step(q, do, o, b, h, i * BM, n_q, q0_s, do0_s, o0_s)
                    E.read_stats(lse, dvec, b, h, i * BM, n_q, nxt)
                    E.write_stats(stats, 0, nxt)
                E.commit()
            E.zero(dk_acc)  # line 7: dK_j = 0, dV_j = 0 on chip (registers)
            E.zero(dv_acc)
            E.key_bounds(col0, n_q, n_k, WINDOW, first_q, last_q)
            if ALIBI:
                E.key_diagonals(col0, n_q, n_k, diags)
            for st in range(n_steps):  # line 8: for 1 <= i <= Tr (and the query heads of this KV head)
                buf = st & 1 if PREFETCH else 0
                row0 = i * BM
                if PAIRED:
                    q_s, do_s, o_s = Q_PAIR(smem, buf), DO_PAIR(smem, buf), O_PAIR(smem, buf)
                else:
                    q_s = q0_s if buf == 0 else q1_s
                    do_s = do0_s if buf == 0 else do1_s
                    o_s = o0_s if buf == 0 else o1_s
                base = buf * 2 * BM
                i_next = i + 1  # the next step: the next Q tile, or the first of the next query head
                h_next = h
                at_next, end_next, partial_next = at, end, partial
                if SPARSE:  # the next listed Q tile of this head, or the first of the next head with one
                    at_next = at + 1
                    if at_next == end:
                        h_next, at_next, end_next = first_listed(walk_counts, walk_lists, b, h + 1, hk * group + group,
                                                                 j, i_first, i_end)
                    if st + 1 < n_steps:
                        n_listed, listed = list_row(walk_counts, walk_lists, b, h_next, j)
                        i_next = listed_tile(listed[at_next])
                        partial_next = listed_partial(listed[at_next])
                elif i_next == i_end:
                    i_next = i_first
                    h_next = h + 1
                if PREFETCH:
                    E.wait_all()  # this thread's copies of Q_i, dO_i (and K_j, V_j) have landed
                    cuda.syncthreads()  # ... and everyone's, with L_i, D_i; everyone is done with the other buffers
                    if st == 0:
                        E.kv_frags(k_s, v_s, kf, vf)
                    if st + 1 < n_steps:  # the next step's tiles into the other buffers, in flight during this step
                        E.load_step(q, do, o, b, h_next, i_next * BM, n_q, q1_s if buf == 0 else q0_s,
                                    do1_s if buf == 0 else do0_s, o1_s if buf == 0 else o0_s)
                        E.commit()
                        E.read_stats(lse, dvec, b, h_next, i_next * BM, n_q, nxt)
                else:
                    cuda.syncthreads()  # everyone is done with the previous Q_i, dO_i, P^T, dS^T
                    # Line 9: Q_i, dO_i, L_i (FA-2: D_i; Alg. 4: O_i)
                    E.step_inputs(q, do, o, lse, dvec, b, h, row0, n_q, q_scale, q_s, do_s, o_s, stats)
                    cuda.syncthreads()  # Q_i, dO_i, L_i (D_i) are in shared memory
                if FA1:
                    E.rowdot(do_s, o_s, stats, base)  # Alg. 4 line 19: D_i = rowsum(dO_i * O_i)
                    cuda.syncthreads()  # D_i is in shared memory
                E.scores_t(kf, k_s, q_s, s, scratch)  # FA-2 line 10 (Alg. 4 before line 13): S_ij^T = K_j Q_i^T
                E.scores_t(vf, v_s, do_s, dp, scratch)  # FA-2 line 13 (Alg. 4 line 17): dP_ij^T = V_j dO_i^T
                masked = mask.tile_needs_mask(col0, BN, mask.last_visible_key(row0, n_q, n_k, WINDOW),
                                               mask.first_visible_key(min(row0 + BM, n_q) - 1, n_q, n_k, WINDOW), WINDOW)
                # FA-2 lines 11, 14 (Alg. 4 lines 13, 20): P^T = exp(S^T - L_i), dS^T = P^T * (dP^T - D_i)
                slope = alibi[b, h] if ALIBI else float32(0.0)  # this step's query head's
                if SPARSE:  # (the rows: keys from col0; the pair's kind)
                    user = (b, h, col0, n_q, n_k, mod_args, partial)
                elif HAS_USER:
                    user = (b, h, col0, n_q, n_k, mod_args)
                else:
                    user = ()
                E.probs_t(s, dp, stats, base, q_scale, masked, first_q, last_q, WINDOW, SOFTCAP, softcap_log2, ALIBI, slope,
                          diags, row0, pt_s, ds_s, user)
                if P_IN_SMEM:
                    cuda.syncthreads()  # P^T, dS^T of every entry are in shared memory
                E.dv_update(s, pt_s, do_s, dv_acc, scratch)  # FA-2 line 12 (Alg. 4 line 16): dV_j += P_ij^T dO_i
                E.dk_update(dp, ds_s, q_s, dk_acc, scratch)  # FA-2 line 16 (Alg. 4 line 22): dK_j += dS_ij^T Q_i
                if DQ:  # FA-2 line 15 (atomics), Alg. 4 line 21 (read and written back): dQ_i += dS_ij K_j
                    E.dq_update(dp, ds_s, k_s, dq, b, h, row0, n_q, scale, dq_acc, scratch)
                if PREFETCH and st + 1 < n_steps:
                    E.write_stats(stats, 2 * BM - base, nxt)  # the other buffer: read after the next top barrier
                h = h_next
                i = i_next
                at, end, partial = at_next, end_next, partial_next
            E.wait_all()  # no copy outlives the block (a tile with no step: K_j, V_j's)
            # Line 24 (FA-2 line 18): write dK_j (= scale dS^T Q), dV_j
            E.write_grad(dk, b, hk, col0, n_k, dk_acc, E.dk_factor(scale))
            E.write_grad(dv, b, hk, col0, n_k, dv_acc, float32(1.0))

    if VARLEN:  # the prefix sums after the slopes
        @kernel_jit(fastmath={"contract", "afn", "arcp"})
        def attention_bwd(q, k, v, o, do, lse, dvec, dq, dk, dv, scale, softcap_log2, alibi, cu_seqlens):
            bwd_body(q, k, v, o, do, lse, dvec, dq, dk, dv, scale, softcap_log2, alibi, (), (), (), cu_seqlens)
    elif not HAS_USER:
        @kernel_jit(fastmath={"contract", "afn", "arcp"})
        def attention_bwd(q, k, v, o, do, lse, dvec, dq, dk, dv, scale, softcap_log2, alibi):
            bwd_body(q, k, v, o, do, lse, dvec, dq, dk, dv, scale, softcap_log2, alibi, (), (), (), ())
    elif not SPARSE:
        @kernel_jit(fastmath={"contract", "afn", "arcp"})
        def attention_bwd(q, k, v, o, do, lse, dvec, dq, dk, dv, scale, softcap_log2, alibi, mod_args):
            bwd_body(q, k, v, o, do, lse, dvec, dq, dk, dv, scale, softcap_log2, alibi, mod_args, (), (), ())
    else:  # a block mask's lists (block_info; for each K/V tile and query head, its Q tiles) after mod_args
        @kernel_jit(fastmath={"contract", "afn", "arcp"})
        def attention_bwd(q, k, v, o, do, lse, dvec, dq, dk, dv, scale, softcap_log2, alibi, mod_args, walk_counts,
                          walk_lists):
            bwd_body(q, k, v, o, do, lse, dvec, dq, dk, dv, scale, softcap_log2, alibi, mod_args, walk_counts, walk_lists,
                     ())

    return attention_bwd


@kernel_factory
def dq_kernel(engine, window, softcap: bool = False, alibi: bool = False, varlen: bool = False):
    """dQ without atomics (``deterministic=True``) on ``engine`` (``bwd.ffma_dq_engine``,
    ``tc_bwd.mma_dq_engine``; memoised): one
    block per (Q tile, batch, head) walks the K/V tiles it sees -- the forward's loop order, Q
    outside, K/V inside -- recomputing S = Q_i K_j^T, dP = dO_i V_j^T, P and dS with queries as
    the rows (FA-2 Alg. 2 lines 10-14), and sums dQ_i = scale sum_j dS_ij K_j on chip (line 15)
    for the whole walk; no other block writes dQ_i, so the result is bitwise reproducible.

    The dQ engine interface (device functions, as :func:`kv_kernel`'s):

    ``row_stats(lse, dvec, b, h, row0, n_q, l2, dd)``
        L and D of this thread's rows into registers (engines that keep them there).
    ``start(q, do, k, v, lse, dvec, b, h, hk, row0, n_q, n_k, q_scale, col_first, n_walk, q_s, do_s,
    k_s, v_s, stats, l2, dd)``
        Q_i, dO_i (an engine with L_i, D_i in shared memory: them too), and a prefetching
        engine's first K_j, V_j.
    ``before_scores(k, v, b, hk, col0, col_next, j, n_walk, n_k, k0_s, k1_s, v_s, q_s, do_s, qf, dof)``
        K_j, V_j in shared memory and visible (a prefetching engine: K_{j+1} issued); ``j`` counts
        the walk's steps from 0, ``col0`` is the tile's first key.
    ``scores(af, a_s, b_s, out, scratch)``: S = Q_i K_j^T, dP = dO_i V_j^T.
    ``after_scores(v, b, hk, col0, col_next, j, n_walk, n_k, v_s)``: a prefetching engine issues V_{j+1}
        (``col_next``: the walk's next tile's first key, ``col0 + block_n`` but in a block-sparse walk).
    ``dscores(s, dp, stats, l2, dd, q_scale, masked, first_keys, last_keys, window, capped, cap, biased, slope, diags,
    col0, ds_s)``: dS = P (dP - D) (times the soft cap's slope when ``capped``; P with ALiBi's bias
    when ``biased``: ``slope`` the head's, ``diags`` each row's diagonal key from ``row_alibi``).
    ``dq_step(dp, ds_s, k_s, acc, scratch)``: dQ_i += dS K_j.
    ``write_dq(dq, b, h, row0, n_q, acc, scale)``, ``row_key_bounds``, ``zero``, ``wait_all``.

    Constants: ``block_m``, ``block_n``, ``layout``, ``ELEM``, ``DOUBLE_K`` (K_j double-buffered: read by the first product
    and the last), ``DS_IN_SMEM``, shapes ``s_shape``, ``acc_shape``,
    ``af_shape``, ``stat_rows``, ``scratch_floats``, views ``q_tile``, ``do_tile``, ``k_tiles``
    (two), ``v_tile``, ``ds_tile``, ``stats_tile``.

    Launch: ``grid = (ceil(Nq / block_m) * B * H,)``, ``block = (layout.threads,)``, dynamic
    shared memory ``layout.smem_bytes``. Arguments: ``q, do (B,H,Nq,D)``, ``k, v (B,Hkv,Nk,D)``,
    ``lse, dvec (B,H,Nq) float32``, ``dq (B,H,Nq,D)`` out, ``scale`` (float32), ``softcap_log2``
    (float32; read when ``softcap``, as in :func:`kv_kernel`), ``alibi`` (read when ``alibi``, as there).
    """
    E = engine
    WINDOW, SOFTCAP, ALIBI = window_of(window), bool(softcap), bool(alibi)
    BM, BN = E.block_m, E.block_n
    ELEM, DOUBLE_K, DS_IN_SMEM = E.ELEM, E.DOUBLE_K, E.DS_IN_SMEM
    S_SHAPE, ACC_SHAPE, AF_SHAPE, STAT_ROWS, SCRATCH = E.s_shape, E.acc_shape, E.af_shape, E.stat_rows, E.scratch_floats
    Q_TILE, DO_TILE, V_TILE, DS_TILE, STATS_TILE = E.q_tile, E.do_tile, E.v_tile, E.ds_tile, E.stats_tile
    K0_TILE, K1_TILE = E.k_tiles

    HAS_USER = getattr(E, "user_mods", None) is not None
    SPARSE = HAS_USER and E.user_mods.block_sparse  # the K/V tiles a block mask lists for each Q tile
    VARLEN = bool(varlen)  # a packed batch (kv_kernel's): the grid's Q tiles are the longest sequence's
    if VARLEN and HAS_USER:
        raise ValueError("a packed batch (varlen) takes no user's mods")

    @device_jit
    def dq_body(q, k, v, do, lse, dvec, dq, scale, softcap_log2, alibi, mod_args, walk_counts, walk_lists, cu_seqlens):
        n_heads, n_q = q.shape[1], q.shape[2]
        n_k = k.shape[2]
        group = n_heads // k.shape[1]
        n_q_tiles = (n_q + BM - 1) // BM
        n_kv_tiles = (n_k + BN - 1) // BN
        if VARLEN:
            n_q_tiles = cuda.gridDim.x // ((cu_seqlens.shape[1] - 1) * n_heads)
        i_tile, _, bh = tile_of_block(cuda.blockIdx.x, n_q_tiles, True, WINDOW[1] >= 0)  # causal: the longest walks first
        b, h = batch_and_head(bh, n_heads)
        hk = h // group
        if VARLEN:  # sequence b's rows of every array (block_info.sequence_span): batch 0 of views
            q0, q1, k0, k1 = sequence_span(cu_seqlens, b)
            q, do, lse, dvec, dq = q[:, :, q0:q1], do[:, :, q0:q1], lse[:, :, q0:q1], dvec[:, :, q0:q1], dq[:, :, q0:q1]
            k, v = k[:, :, k0:k1], v[:, :, k0:k1]
            if ALIBI:
                alibi = alibi[b : b + 1]
            b = 0
            n_q, n_k = q.shape[2], k.shape[2]
            n_kv_tiles = (n_k + BN - 1) // BN
            if i_tile * BM >= n_q:  # a Q tile past this sequence's end: no work
                return
        row0 = i_tile * BM
        q_scale = scale * float32(LOG2E)

        smem = cuda.shared.array(0, ELEM, SMEM_ALIGN)  # the engine's tiles: Q_i, dO_i, K_j (x2), V_j, (dS, L_i, D_i)
        q_s, do_s, v_s, ds_s, stats = Q_TILE(smem), DO_TILE(smem), V_TILE(smem), DS_TILE(smem), STATS_TILE(smem)
        k0_s, k1_s = K0_TILE(smem), K1_TILE(smem)
        scratch = cuda.shared.array(SCRATCH, float32)  # simulated mma only

        qf = cuda.local.array(AF_SHAPE, mma.uint32)  # Q_i's, dO_i's A fragments (mma engine, D <= 64)
        dof = cuda.local.array(AF_SHAPE, mma.uint32)
        s = cuda.local.array(S_SHAPE, float32)  # S, then P
        dp = cuda.local.array(S_SHAPE, float32)  # dP, then dS
        acc = cuda.local.array(ACC_SHAPE, float32)  # dQ_i
        l2 = cuda.local.array(STAT_ROWS, float32)  # L, D of this thread's rows (engines that keep them in registers)
        dd = cuda.local.array(STAT_ROWS, float32)
        first_keys = cuda.local.array(STAT_ROWS, int32)  # each row's visible keys [first, last] (first: a left edge only)
        last_keys = cuda.local.array(STAT_ROWS, int32)
        slopes = cuda.local.array(STAT_ROWS, float32)  # ALiBi: each row's slope (the head's) and diagonal key
        diags = cuda.local.array(STAT_ROWS, int32)

        E.row_stats(lse, dvec, b, h, row0, n_q, l2, dd)  # (engines that keep L_i, D_i in registers)
        E.row_key_bounds(row0, n_q, n_k, WINDOW, first_keys, last_keys, 1)
        if ALIBI:
            E.row_alibi(alibi, b, h, row0, n_q, n_k, 1, slopes, diags)
        row_last = min(row0 + BM, n_q) - 1
        first_row_last_key = mask.last_visible_key(row0, n_q, n_k, WINDOW)
        last_row_first_key = mask.first_visible_key(row_last, n_q, n_k, WINDOW)
        # the K/V tiles this Q tile sees: n_walk of them from j_first
        j_first, n_walk = mask.kv_tile_range(mask.first_visible_key(row0, n_q, n_k, WINDOW),
                                              mask.last_visible_key(row_last, n_q, n_k, WINDOW), n_kv_tiles, BN, WINDOW)
        listed = walk_lists  # (block-sparse: this Q tile's list, from index lo)
        lo = 0
        if SPARSE:  # of those, the listed ones (block_info)
            n_listed, listed = list_row(walk_counts, walk_lists, b, h, i_tile)
            lo, hi = listed_range(listed, n_listed, j_first, n_walk)
            n_walk = hi - lo
            j_first = listed_tile(listed[lo]) if n_walk > 0 else 0
        # Q_i (the CUDA-core engine: in log2 units), dO_i, L_i, D_i
        E.start(q, do, k, v, lse, dvec, b, h, hk, row0, n_q, n_k, q_scale, j_first * BN, n_walk, q_s, do_s, k0_s, v_s,
                stats, l2, dd)
        E.zero(acc)
        partial = True  # (mask_mod applies: no block mask says the tile is full)
        for j in range(n_walk):  # FA-2 Alg. 2 line 6 in the forward's order: the K/V tiles this Q tile sees
            if SPARSE:
                col0 = listed_tile(listed[lo + j]) * BN
                partial = listed_partial(listed[lo + j])
                col_next = listed_tile(listed[lo + j + 1]) * BN if j + 1 < n_walk else col0
            else:
                col0 = (j_first + j) * BN
                col_next = col0 + BN
            if DOUBLE_K:
                k_s = k0_s if (j & 1) == 0 else k1_s
            else:
                k_s = k0_s
            E.before_scores(k, v, b, hk, col0, col_next, j, n_walk, n_k, k0_s, k1_s, v_s, q_s, do_s, qf, dof)  # line 7
            E.scores(qf, q_s, k_s, s, scratch)  # line 10: S_ij = Q_i K_j^T
            E.scores(dof, do_s, v_s, dp, scratch)  # line 13: dP_ij = dO_i V_j^T
            E.after_scores(v, b, hk, col0, col_next, j, n_walk, n_k, v_s)
            masked = mask.tile_needs_mask(col0, BN, first_row_last_key, last_row_first_key, WINDOW)
            if SPARSE:
                user = (b, h, row0, n_q, n_k, mod_args, partial)
            elif HAS_USER:
                user = (b, h, row0, n_q, n_k, mod_args)
            else:
                user = ()
            E.dscores(s, dp, stats, l2, dd, q_scale, masked, first_keys, last_keys, WINDOW, SOFTCAP, softcap_log2, ALIBI,
                      slopes[0], diags, col0, ds_s, user)  # lines 11, 14: P, dS = P (dP - D)
            if DS_IN_SMEM:
                cuda.syncthreads()  # dS_ij is in shared memory
            E.dq_step(dp, ds_s, k_s, acc, scratch)  # line 15: dQ_i += dS_ij K_j (scale at the end), on chip
        E.wait_all()  # no copy outlives the block
        E.write_dq(dq, b, h, row0, n_q, acc, scale)

    if VARLEN:  # the prefix sums after the slopes
        @kernel_jit(fastmath={"contract", "afn", "arcp"})
        def attention_bwd_dq(q, k, v, do, lse, dvec, dq, scale, softcap_log2, alibi, cu_seqlens):
            dq_body(q, k, v, do, lse, dvec, dq, scale, softcap_log2, alibi, (), (), (), cu_seqlens)
    elif not HAS_USER:
        @kernel_jit(fastmath={"contract", "afn", "arcp"})
        def attention_bwd_dq(q, k, v, do, lse, dvec, dq, scale, softcap_log2, alibi):
            dq_body(q, k, v, do, lse, dvec, dq, scale, softcap_log2, alibi, (), (), (), ())
    elif not SPARSE:
        @kernel_jit(fastmath={"contract", "afn", "arcp"})
        def attention_bwd_dq(q, k, v, do, lse, dvec, dq, scale, softcap_log2, alibi, mod_args):
            dq_body(q, k, v, do, lse, dvec, dq, scale, softcap_log2, alibi, mod_args, (), (), ())
    else:  # a block mask's lists (block_info) after mod_args
        @kernel_jit(fastmath={"contract", "afn", "arcp"})
        def attention_bwd_dq(q, k, v, do, lse, dvec, dq, scale, softcap_log2, alibi, mod_args, walk_counts, walk_lists):
            dq_body(q, k, v, do, lse, dvec, dq, scale, softcap_log2, alibi, mod_args, walk_counts, walk_lists, ())

    return attention_bwd_dq
