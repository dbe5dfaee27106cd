"""Device functions shared by the FA-1 and FA-2 kernels: one tile's worth of work.

Both papers' inner step is the same computation on a (Q tile, K/V tile) pair; only the loop
nest around it and where (m, l, O) live differ. So the step is written once here, for the
register micro-tile layout of ``tiles.TileLayout``, and both kernels call it:

- :func:`load_q_tile`   Q_i (pre-scaled) into shared memory
- :func:`load_kv_tile`  K_j, V_j into shared memory (through registers)
- :func:`score_tile`    S = Q_i K_j^T, each thread a rows_per_thread x cols_per_thread block
- :func:`mask_scores`   keys past Nk or hidden by the mask -> -inf
- :func:`row_max`       rowmax(S) over the whole row (local max, then across the row's threads)
- :func:`exp_scores`    P~ = exp(S - m) into shared memory, and the thread's part of rowsum(P~)
- :func:`pv_tile`       O~ += P~ V_j, each thread a rows_per_thread x (4 * dim_groups) block

The backward kernels (``kernels.bwd``) run on the same layout and the same primitives: its S and
dP are :func:`score_tile` products, dV += P^T dO and dK += dS^T Q are :func:`ab_tile` (the
P~V product with a padded B operand), dQ += dS K is :func:`atb_tile` (A read transposed); its
tiles are copied by :func:`load_rows`.

Scores are kept in log2 units: q is multiplied by ``scale * log2(e)`` as it is loaded, so
``exp(s - m)`` is one ``exp2`` (FlashAttention-2, section 3.1).

Why micro-tiles: in S = Q K^T a thread that owns 4 rows x 4 keys does 64 FMAs per 4-wide
step of the head dim for two 128-bit loads per row/key (8 loads), against 4 FMAs per load
when a thread owns one row. Every loop below has a compile-time trip count, so it unrolls
and the local arrays (``s``, ``acc``, fragments) are indexed by constants: registers.
"""

from __future__ import annotations

import functools
import math
from types import ModuleType

from numba_flash._cuda import cuda, float32, int32, uint64

from numba_flash.kernels.jit import NEG_INF, device_jit, shared_tile
from numba_flash.kernels.row_reduce import add, row_allreduce
from numba_flash.kernels import mask, paged, score_mods
from numba_flash.kernels.softmax import exp2_diff, finite_or_zero, log_sum_exp, nan_max, reciprocal_or_zero
from numba_flash.kernels.tiles import ROWS_PER_THREAD, VEC, tile_layout


@device_jit
def at(i):
    """``i`` as an unsigned shared-memory index. numba wraps negative signed indices
    (``i + size`` when ``i < 0``); that select hides from the compiler that ``x[i]`` and
    ``x[i + 1]`` are neighbours, and so keeps it from fusing four loads into one 128-bit
    load. Unsigned indices skip the wraparound."""
    return uint64(i)


@functools.lru_cache(maxsize=None)
def tile_ops(head_dim: int, block_m: int, block_n: int, groups: int = 1,
             rows_per_thread: int = ROWS_PER_THREAD, page_size: int = 0) -> ModuleType:
    """Device functions for one (head_dim, block_m, block_n) specialisation (memoised).

    ``groups``: the block holds that many copies of the layout, one after the other (thread
    ``t`` is thread ``t % threads`` of group ``t // threads``): the warps of a split-K block
    (``kernels.forward``), each group on its own part of the K/V tile. 1: the whole block.
    ``rows_per_thread``: the micro-tile height (``tile_table.forward_rows_per_thread``).
    ``page_size``: :func:`load_kv_tile` reads a paged cache (``kernels.paged``); 0: contiguous."""
    L = tile_layout(head_dim, block_m, block_n, rows_per_thread)
    D, BM, BN = head_dim, block_m, block_n
    TM, TX, TN = L.rows_per_thread, L.threads_per_row, L.cols_per_thread
    NT, DP, DG, CK = L.threads, L.padded_dim, L.dim_groups, L.key_chunk
    QS, KS, PS = L.q_stride, L.k_stride, L.p_stride  # padded row strides in shared memory
    TY = BM // TM  # thread rows
    GROUPS = int(groups)

    @device_jit
    def tid():
        """This thread's index in its group's layout."""
        if GROUPS == 1:
            return cuda.threadIdx.x
        return cuda.threadIdx.x % NT

    @device_jit
    def thread_row(i):
        """Tile row of this thread's i-th query row: ``ty + (block_m / TM) * i``. The rows of
        one warp's threads are neighbours, so with the padded strides their 128-bit loads of
        Q_i and P~ fall in different banks."""
        return tid() // TX + TY * i

    @device_jit
    def thread_col():
        """This thread's position among the threads of its rows (tx)."""
        return tid() % TX

    # Copies from global to shared memory (tiles.TileLayout.copy_*): CT threads span the
    # padded head dim, so a thread keeps one d (or D_PASSES of them) and steps over rows.
    CT = L.copy_threads  # threads across d
    RP = L.copy_rows_per_pass  # rows per pass of the whole block
    D_PASSES = L.copy_d_passes

    KV = paged.kv_source(page_size)
    PAGED_KV = KV.PAGED  # (a closure constant: numba prunes the branch it decides; a module attribute it does not)

    def make_row_copy(tile_rows, stride, scaled, source=paged.CONTIGUOUS):
        """fetch/store device functions for a ``tile_rows`` x D tile with row ``stride``; a paged
        ``source`` (``kernels.paged``): fetch reads ``(pages, block_table, b, h)``, not a view."""
        PAGED = source.PAGED
        EXACT = tile_rows % RP == 0  # every pass is a full one: no row test needed
        LOADS = L.copy_loads(tile_rows)

        def make_fetch(checked):
            @device_jit
            def fetch_rows(x2, first, n_valid, scale, reg):
                t = tid()
                c_base = t // CT
                d_base = t - c_base * CT
                for n in range(LOADS):
                    c = c_base + RP * (n // D_PASSES)
                    d = d_base + CT * (n % D_PASSES)
                    reg[n] = float32(0.0)
                    if (EXACT or c < tile_rows) and (not checked or first + c < n_valid) and (D == DP or d < D):
                        if PAGED:  # x2: (pages, block_table, b, h); key first + c of sequence b
                            page, row = source.locate((x2[0], x2[1]), x2[2], first + c)
                            x = float32(x2[0][page, x2[3], row, d])
                        else:
                            x = float32(x2[at(first + c), at(d)])
                        reg[n] = x * scale if scaled else x

            return fetch_rows

        fetch_full = make_fetch(False)
        fetch_tail = make_fetch(True)

        @device_jit
        def fetch(x2, first, n_valid, scale, reg):
            """Rows ``first ..`` of the (N, D) view ``x2`` -> this thread's ``reg`` share, times
            ``scale`` when ``scaled``; rows at or past ``n_valid`` and d >= D are 0 (past Nk or
            Nq, a stale value or NaN must not enter the products). All loads are issued before
            any is used (constant trip count: the loop unrolls), and consecutive threads read
            consecutive d (coalesced). A tile that lies wholly before ``n_valid`` (all but the
            last; block-uniform) loads without a row test, so its addresses are a stride apart
            and the compiler computes them by adding, not by multiplying per element."""
            if first + tile_rows <= n_valid:
                fetch_full(x2, first, n_valid, scale, reg)
            else:
                fetch_tail(x2, first, n_valid, scale, reg)

        @device_jit
        def store(reg, x_s):
            t = tid()
            c_base = t // CT
            d_base = t - c_base * CT
            for n in range(LOADS):
                c = c_base + RP * (n // D_PASSES)
                d = d_base + CT * (n % D_PASSES)
                if EXACT or c < tile_rows:
                    x_s[at(c * stride + d)] = reg[n]

        return fetch, store, LOADS

    fetch_q, store_q, Q_LOADS = make_row_copy(BM, QS, True)
    fetch_k, store_k, KV_LOADS = make_row_copy(BN, KS, False, KV)
    fetch_v, store_v, _ = make_row_copy(BN, DP, False, KV)

    @device_jit
    def load_q_tile(q, b, h, row0, n_q, q_scale, q_s):
        """Q_i -> shared memory, times ``scale * log2(e)``; rows past Nq and d >= D are 0."""
        q_reg = cuda.local.array(Q_LOADS, float32)
        fetch_q(q[b, h], row0, n_q, q_scale, q_reg)
        store_q(q_reg, q_s)

    @device_jit
    def load_kv_tile(k, v, b, hk, col0, n_k, k_s, v_s, kv_reg):
        """K_j, V_j -> shared memory (K rows padded to ``k_stride``), one after the other
        through the same registers (a tile's share of both at once would cost more registers
        than the overlap is worth)."""
        one = float32(1.0)
        if PAGED_KV:  # (pages, block_table) each: sequence b's rows through its table
            fetch_k((k[0], k[1], b, hk), col0, n_k, one, kv_reg)
            store_k(kv_reg, k_s)
            fetch_v((v[0], v[1], b, hk), col0, n_k, one, kv_reg)
        else:
            fetch_k(k[b, hk], col0, n_k, one, kv_reg)
            store_k(kv_reg, k_s)
            fetch_v(v[b, hk], col0, n_k, one, kv_reg)
        store_v(kv_reg, v_s)

    # S = Q K^T streams one operand per 4-wide step of the head dim and holds the other's
    # fragments: the rows of Q (TM x 4 registers) for the 4-row micro-tiles (as measured), the
    # keys of K (TN x 4) for the 8-row ones, whose rows would take 32 registers.
    HOLD_KEYS = TM > ROWS_PER_THREAD and TN < TM

    @device_jit
    def score_tile_rows_held(q_s, k_s, s):
        tx = thread_col()
        qf = cuda.local.array((TM, VEC), float32)
        kf = cuda.local.array(VEC, float32)
        for i in range(TM):
            for j in range(TN):
                s[i, j] = float32(0.0)
        for d0 in range(0, DP, VEC):
            for i in range(TM):  # one 128-bit load per row (broadcast across the row's threads)
                for e in range(VEC):
                    qf[i, e] = q_s[at(thread_row(i) * QS + d0 + e)]
            for j in range(TN):
                base = (tx + TX * j) * KS + d0  # consecutive tx: consecutive K rows
                for e in range(VEC):
                    kf[e] = k_s[at(base + e)]
                for i in range(TM):
                    for e in range(VEC):
                        s[i, j] += qf[i, e] * kf[e]

    @device_jit
    def score_tile_keys_held(q_s, k_s, s):
        tx = thread_col()
        qf = cuda.local.array(VEC, float32)
        kf = cuda.local.array((TN, VEC), float32)
        for i in range(TM):
            for j in range(TN):
                s[i, j] = float32(0.0)
        for d0 in range(0, DP, VEC):
            for j in range(TN):  # consecutive tx: consecutive K rows
                for e in range(VEC):
                    kf[j, e] = k_s[at((tx + TX * j) * KS + d0 + e)]
            for i in range(TM):  # one 128-bit load per row (broadcast across the row's threads)
                for e in range(VEC):
                    qf[e] = q_s[at(thread_row(i) * QS + d0 + e)]
                for j in range(TN):
                    for e in range(VEC):
                        s[i, j] += qf[e] * kf[j, e]

    @device_jit
    def score_tile(q_s, k_s, s):
        """S_ij = Q_i K_j^T for this thread's rows and keys into ``s`` (TM x TN)."""
        if HOLD_KEYS:
            score_tile_keys_held(q_s, k_s, s)
        else:
            score_tile_rows_held(q_s, k_s, s)

    row_key_bounds = mask.row_bounds(TM, thread_row)

    @device_jit
    def tile_needs_mask(col0, first_row_last_key, last_row_first_key, window):
        return mask.tile_needs_mask(col0, BN, first_row_last_key, last_row_first_key, window)

    @device_jit
    def key_of(i, j):
        """The key of entry (i, j) of this thread's S micro-tile, from the tile's first."""
        return thread_col() + TX * j

    @device_jit
    def row_of(i, j):
        return i

    mask_scores = mask.tile_masker(TM, TN, key_of, row_of)  # keys outside each row's visible ones -> -inf
    add_alibi = score_mods.tile_alibi(TM, TN, key_of, row_of)
    row_alibi = score_mods.alibi_rows(TM, thread_row)

    allreduce_max = row_allreduce(nan_max, TM, TX, NT * GROUPS)  # a row's threads: one group's, one warp's
    allreduce_sum = row_allreduce(add, TM, TX, NT * GROUPS)

    @device_jit
    def row_max(s, out, scratch):
        """out[i] = rowmax(S) of row i over the whole tile (all threads must call)."""
        for i in range(TM):
            x = float32(NEG_INF)
            for j in range(TN):
                x = nan_max(x, s[i, j])
            out[i] = x
        allreduce_max(out, scratch)

    @device_jit
    def exp_scores(s, m_ref, p_s, row_sums):
        """P~ = exp2(S - m_ref) into ``p_s`` (block_m x block_n); this thread's part of rowsum(P~)."""
        tx = thread_col()
        for i in range(TM):
            total = float32(0.0)
            for j in range(TN):
                p = math.exp2(s[i, j] - m_ref[i])
                total += p
                p_s[at(thread_row(i) * PS + tx + TX * j)] = p
            row_sums[i] = total

    def make_pv_tile(guarded, v_stride=DP):
        """acc += P~ V for this thread's rows: P~ (block_m x block_n, row stride PS), V
        (block_n x D, row stride ``v_stride``: DP for the forward's V_j, QS for a padded tile)."""

        @device_jit
        def pv(p_s, v_s, acc, col0, first_keys, last_keys, window):
            tx = thread_col()
            pf = cuda.local.array((TM, CK), float32)
            vf = cuda.local.array(VEC, float32)
            for c0 in range(0, BN, CK):
                for i in range(TM):  # P~ rows: one 128-bit load each (broadcast)
                    for e in range(CK):
                        pf[i, e] = p_s[at(thread_row(i) * PS + c0 + e)]
                for e in range(CK):
                    for g in range(DG):
                        base = (c0 + e) * v_stride + VEC * tx + VEC * TX * g
                        for u in range(VEC):
                            vf[u] = v_s[at(base + u)]
                        for i in range(TM):
                            # A key row i does not see (past Nk: the tile's zero fill, or outside
                            # its window) contributes nothing, not even 0 * NaN.
                            if not guarded or not mask.key_hidden(col0 + c0 + e, first_keys[i], last_keys[i], window):
                                for u in range(VEC):
                                    acc[i, VEC * g + u] += pf[i, e] * vf[u]

        return pv

    pv_all_keys = make_pv_tile(False)
    pv_visible_keys = make_pv_tile(True)

    @device_jit
    def pv_tile(p_s, v_s, acc, col0, first_keys, last_keys, masked, window):
        """O~ += P~ V_j for this thread's rows and output columns (acc: TM x 4*DG).

        ``masked`` (block-uniform, from :func:`tile_needs_mask`): skip, row by row, the keys
        it does not see (``[first_keys[i], last_keys[i]]``, ``mask.key_hidden``); unmasked tiles run
        the loop without that test.
        """
        if masked:
            pv_visible_keys(p_s, v_s, acc, col0, first_keys, last_keys, window)
        else:
            pv_all_keys(p_s, v_s, acc, col0, first_keys, last_keys, window)

    pv_padded = make_pv_tile(False, QS)

    @device_jit
    def ab_tile(a_s, b_s, acc):
        """acc += A B for this thread's rows (``thread_row``) and output columns (``out_col``):
        A is block_m x block_n in ``a_s`` (row stride PS, as :func:`exp_scores` writes P~), B is
        block_n x D in ``b_s`` (row stride QS, as :func:`load_rows` writes). The P~V product of
        the forward with a padded B; no key is skipped (the caller zeroes A where masked)."""
        no_keys = cuda.local.array(TM, int32)  # (read only by the masked P~V)
        pv_padded(a_s, b_s, acc, 0, no_keys, no_keys, mask.NO_MASK)

    @device_jit
    def block_row(i):
        """Tile row of this thread's i-th row in :func:`atb_tile`: ``TM * ty + i`` (a thread's
        rows are neighbours, so one 128-bit load reads its four entries of a column of A)."""
        return (tid() // TX) * TM + i

    def make_atb_tile(parts):
        GP = max(1, DG // parts)  # groups of four output columns per part

        @device_jit
        def atb(at_s, b_s, acc, part):
            tx = thread_col()
            ty = tid() // TX
            af = cuda.local.array(TM, float32)
            bf = cuda.local.array(VEC, float32)
            for c in range(BN):
                for i in range(TM):
                    af[i] = at_s[at(c * PS + TM * ty + i)]
                for g in range(GP):
                    base = c * QS + VEC * tx + VEC * TX * (GP * part + g)
                    for u in range(VEC):
                        bf[u] = b_s[at(base + u)]
                    for i in range(TM):
                        for u in range(VEC):
                            acc[i, VEC * g + u] += af[i] * bf[u]

        return atb

    atb_whole = make_atb_tile(1)
    atb_half = make_atb_tile(2)

    @device_jit
    def atb_tile(at_s, b_s, acc):
        """acc += A B for this thread's rows (``block_row``) and output columns (``out_col``),
        A given transposed: ``at_s`` holds A^T (block_n x block_m, row stride PS; block_n ==
        block_m), B is block_n x D in ``b_s`` (row stride QS). Per key: one 128-bit load of A^T
        (the thread's TM rows), DG of B, TM x 4 DG FMAs -- the load-to-FMA ratio of P~V. All
        lanes of a warp read one row of A^T and of B: broadcasts, no bank conflicts."""
        atb_whole(at_s, b_s, acc, 0)

    @device_jit
    def atb_half_tile(at_s, b_s, acc, half):
        """:func:`atb_tile` for half of this thread's output columns, groups ``half * DG / 2 ..``
        (``acc``: TM x 2 DG; column ``VEC * g + u`` of it is ``out_col(half * DG / 2 + g, u)``):
        half the accumulator registers, for callers that hold other accumulators meanwhile."""
        atb_half(at_s, b_s, acc, half)

    # load_rows: a block_m x D tile through at most ROWS_IN_FLIGHT registers per thread, in
    # ROW_PARTS passes of block_m / ROW_PARTS rows (the backward loads Q_i, dO_i while a thread's
    # dK_j, dV_j take 64-128 registers: at D = 128 a whole 32-row tile would take 64 more)
    ROWS_IN_FLIGHT = 32
    ROW_PARTS = 2 if Q_LOADS > ROWS_IN_FLIGHT and BM % 2 == 0 and BM // 2 >= RP else 1  # (2 suffice to D = 128)
    PART_ROWS = BM // ROW_PARTS
    fetch_part, store_part, PART_LOADS = make_row_copy(PART_ROWS, QS, True)
    part_view = shared_tile(PART_ROWS * QS, PART_ROWS * QS)  # the second part's rows of the tile

    @device_jit
    def load_rows(x, b, h, row0, n_valid, scale, x_s):
        """Rows ``row0 ..`` (block_m of them) of ``x[b, h]`` -> ``x_s`` (row stride QS), times
        ``scale``; rows at or past ``n_valid`` and d >= D are 0. The copy of :func:`load_q_tile`
        (the backward's Q_i, dO_i, O_i, and K_j, V_j when block_n == block_m), in one or two
        passes so that at most 32 values per thread are in flight."""
        reg = cuda.local.array(PART_LOADS, float32)
        fetch_part(x[b, h], row0, n_valid, scale, reg)
        store_part(reg, x_s)
        if ROW_PARTS == 2:
            fetch_part(x[b, h], row0 + PART_ROWS, n_valid, scale, reg)
            store_part(reg, part_view(x_s))

    @device_jit
    def rescale_row(acc, i, alpha):
        """Row i of acc *= alpha (diag(e^{m_old - m_new}) O in both papers)."""
        for u in range(VEC * DG):
            acc[i, u] *= alpha

    @device_jit
    def zero(acc):
        for i in range(TM):
            for u in range(VEC * DG):
                acc[i, u] = float32(0.0)

    @device_jit
    def out_col(g, u):
        """Head-dim index of this thread's output column ``VEC * g + u``."""
        return VEC * thread_col() + VEC * TX * g + u

    # A module object, so that kernels can call ``ops.score_tile(...)``: numba resolves
    # attributes of a module at compile time (it cannot do that for other objects).
    ops = ModuleType(f"numba_flash.kernels.tile_ops_d{D}_m{BM}_n{BN}" + (f"_g{GROUPS}" if GROUPS > 1 else "")
                     + (f"_r{rows_per_thread}" if rows_per_thread != ROWS_PER_THREAD else "")
                     + (f"_p{KV.PAGE_SIZE}" if KV.PAGED else ""))
    ops.layout = L
    for name, func in dict(
        nan_max=nan_max, thread_row=thread_row, thread_col=thread_col, load_q_tile=load_q_tile,
        load_kv_tile=load_kv_tile, score_tile=score_tile, last_visible_key=mask.last_visible_key, packed_last_visible_key=mask.packed_last_visible_key,
        row_key_bounds=row_key_bounds, row_alibi=row_alibi, tile_needs_mask=tile_needs_mask, mask_scores=mask_scores,
        add_alibi=add_alibi, mask_tile=mask_scores, score_key=key_of, score_row=row_of,
        row_max=row_max, allreduce_sum=allreduce_sum, finite_or_zero=finite_or_zero,
        exp_scores=exp_scores, pv_tile=pv_tile, rescale_row=rescale_row, zero=zero,
        out_col=out_col, exp2_diff=exp2_diff, log_sum_exp=log_sum_exp,
        reciprocal_or_zero=reciprocal_or_zero, ab_tile=ab_tile, atb_tile=atb_tile, atb_half_tile=atb_half_tile,
        block_row=block_row,
        load_rows=load_rows,
    ).items():
        setattr(ops, name, func)
    return ops
