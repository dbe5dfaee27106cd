"""The backward on CUDA cores: the engines of ``kernels.backward``'s two loop nests
(:func:`ffma_bwd_engine`, :func:`ffma_dq_engine`), their shared-memory layouts, and the named
points the host launches (:func:`bwd_kernel`, :func:`bwd_dq_kernel`, :func:`rowdot_kernel`).

The loop nests, the two loop orders and how each sums dQ are ``kernels.backward``'s (its module
doc); FA-2's D_i comes from :func:`rowdot_kernel` (line 4). What this module decides is where each
product of a step lives on CUDA cores.

The tile steps are the forward's (``tile_ops``, layout ``tiles.TileLayout`` of a square
``block x block`` tile): every product is a register micro-tile, each thread owning 4 rows x
``block / 8`` columns of a score-shaped tile and 4 rows x ``D / 8`` columns of a D-wide one, so
one 128-bit shared load feeds 8-32 FMAs:

==================  =========================  ============================================
product             tile_ops primitive         rows of a thread's micro-tile
==================  =========================  ============================================
S^T = K_j Q_i^T     ``score_tile(k_s, q_s)``   keys (the K/V kernels); queries (dQ kernel:
dP^T = V_j dO_i^T   ``score_tile(v_s, do_s)``  S = Q_i K_j^T, dP = dO_i V_j^T)
dV_j += P^T dO_i    ``ab_tile(pt_s, do_s)``    keys: dV_j in registers for the whole Q walk
dK_j += dS^T Q_i    ``ab_tile(ds_s, q_s)``     keys: dK_j in registers for the whole Q walk
dQ_i += dS K_j      ``atb_tile(ds_s, k_s)``    queries, then atomics (FA-2) or a read-modify-
                                               write (FA-1); the dQ kernel: ``ab_tile(ds_s,
                                               k_s)``, dQ_i in registers for the whole K/V walk
==================  =========================  ============================================

The K/V kernels compute the scores transposed (keys as the micro-tile rows), so that P^T and
dS^T leave the registers in the row-major form that dV_j += P^T dO_i and dK_j += dS^T Q_i read
with 128-bit loads (the forward's P~ V product), and dK_j, dV_j stay in the registers of the
threads that own those key rows across the whole inner loop over Q tiles (and over the query
heads of a KV head: GQA sums there). dQ_i = dS K_j reads dS^T down its columns: a thread owns
four neighbouring query rows, so one 128-bit load gives its four entries of a key's column.

Q_i is loaded scaled by ``scale * log2(e)`` as the forward does, so S is in log2 units, P =
exp2(S - L_i log2(e)) is one ``exp2``, and dK_j = scale dS^T Q_i = ln(2) dS^T (Q_i scale
log2(e)) is scaled once, when it is written. Rows that see no key (lse = -inf) get L = +inf:
P = 0, zero gradients, never NaN; keys hidden by the causal mask or past Nk get P = dS = 0
(block-uniform: only tiles on the diagonal or at the tail test).

Shared memory (float32, dynamic: above 48 KiB the launcher opts in): Q_i, dO_i, K_j, V_j with
rows padded to ``D_pad + 4`` (and O_i for FA-1), P^T and dS^T (``block x (block + 8)``), L_i
and D_i. ``tile_table.backward_block`` picks the tile.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from numba_flash._cuda import cuda, float32

from numba_flash.kernels.jit import LN2, LOG2E, NEG_INF, device_jit, kernel_factory, kernel_jit, shared_tile
from numba_flash.kernels import mask, score_mods
from numba_flash.kernels.tile_ops import at, tile_ops
from numba_flash.kernels.tiles import VEC, tile_layout
from numba_flash.kernels.mask import window_of

POS_INF = math.inf  # L_i of a row that sees no key: P = exp2(S - inf) = 0
ROWDOT_THREADS = 128

KERNELS = ("fa1", "fa2", "dq")  # the K/V kernels of each loop order, and the deterministic dQ kernel


@dataclass(frozen=True)
class BwdLayout:
    """Where each tile lives in the dynamic shared memory of one backward kernel (float32
    offsets, multiples of 4: every tile starts 16-byte aligned)."""

    kernel: str  # one of KERNELS
    head_dim: int
    block: int

    @property
    def tiles(self):
        """The forward's thread layout of a block x block tile (``tiles.TileLayout``)."""
        return tile_layout(self.head_dim, self.block, self.block)

    @property
    def threads(self) -> int:
        return self.tiles.threads

    @property
    def row_tile(self) -> int:  # floats of one block x D tile (row stride D_pad + 4)
        return self.block * self.tiles.q_stride

    @property
    def prob_tile(self) -> int:  # floats of one block x block tile (row stride block + 8)
        return self.block * self.tiles.p_stride

    @property
    def n_row_tiles(self) -> int:  # Q_i, dO_i, K_j, V_j (and O_i for FA-1)
        return 5 if self.kernel == "fa1" else 4

    @property
    def n_prob_tiles(self) -> int:  # P^T and dS^T (the dQ kernel: dS only)
        return 1 if self.kernel == "dq" else 2

    def offset(self, name: str) -> int:
        order = ["q", "do", "k", "v"] + (["o"] if self.kernel == "fa1" else [])
        if name in order:
            return order.index(name) * self.row_tile
        base = self.n_row_tiles * self.row_tile
        probs = ["ds"] if self.kernel == "dq" else ["p", "ds"]
        if name in probs:
            return base + probs.index(name) * self.prob_tile
        base += self.n_prob_tiles * self.prob_tile
        return base + {"lse": 0, "dvec": self.block}[name]

    @property
    def floats(self) -> int:
        return self.n_row_tiles * self.row_tile + self.n_prob_tiles * self.prob_tile + 2 * self.block

    @property
    def smem_bytes(self) -> int:
        return 4 * self.floats


def dq_parts(layout: BwdLayout) -> int:
    """Parts of the head dim in which the K/V kernels sum a step's dQ_i share in registers: two
    when a thread's dK_j, dV_j already take 128 registers (D > 64), so that the third
    accumulator fits without spilling; else one."""
    return 2 if layout.tiles.dim_groups >= 4 else 1


def bwd_layout(kernel: str, head_dim: int, block: int) -> BwdLayout:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {list(KERNELS)}; got {kernel!r}")
    return BwdLayout(kernel, int(head_dim), int(block))


@functools.lru_cache(maxsize=None)
def bwd_ops(head_dim: int, block: int, user_mods=None):
    """Device functions of one (head_dim, block) specialisation: the steps the K/V kernels of
    both loop orders and the dQ kernel share (``user_mods``: a ``score_mods.UserMods`` compiled
    into P and dS)."""
    from types import ModuleType

    D, B = head_dim, block
    ops = tile_ops(D, B, B)
    L = ops.layout
    TM, TX, TN, DG, NT = L.rows_per_thread, L.threads_per_row, L.cols_per_thread, L.dim_groups, L.threads
    QS, PS = L.q_stride, L.p_stride

    @device_jit
    def load_row_stats(lse, dvec, b, h, row0, n_q, stats, read_dvec):
        """L_i in log2 units (+inf for rows that see no key and rows past Nq, so that their P is
        0) into ``stats[:B]`` and, when ``read_dvec``, D_i (0 past Nq) into ``stats[B:]``."""
        for r in range(cuda.threadIdx.x, B, NT):
            row = row0 + r
            l2 = float32(POS_INF)
            dd = float32(0.0)
            if row < n_q:
                x = lse[b, h, row]
                if x != NEG_INF:
                    l2 = x * float32(LOG2E)
                if read_dvec:
                    dd = dvec[b, h, row]
            stats[r] = l2
            if read_dvec:
                stats[B + r] = dd

    @device_jit
    def rowdot_tile(do_s, o_s, stats, base):
        """D_i = rowsum(dO_i * O_i) of the tile's rows from shared memory into ``stats[base + B:]``
        (FA-1 line 19; the padded columns and the rows past Nq are 0)."""
        for r in range(cuda.threadIdx.x, B, NT):
            acc = float32(0.0)
            for d in range(D):
                acc += do_s[at(r * QS + d)] * o_s[at(r * QS + d)]
            stats[base + B + r] = acc


    def make_probs(key_rows, write_p):
        """P = exp2(S - L) and dS = P * (dP - D) of this thread's micro-tile, into shared memory
        (``p_s``, ``ds_s``: the layout's P~ form, row stride PS); L and D from ``stats[base:]``
        and ``stats[base + B:]``. ``key_rows``: the micro-tile is
        transposed (rows keys, columns queries: L and D per column, and ``[lo[i], hi[i]]`` are
        the queries that see key row i); else rows are queries (``[lo[i], hi[i]]``: the keys
        query row i sees; ``lo`` is read only with the ``window``'s left edge). ``masked``
        (block-uniform): test every entry against them,
        ``col0``: the absolute index of column 0; ``user`` (with user mods): ``(b, h, row0, Nq, Nk,
        mod_args)``, ``row0`` the absolute index of row 0. A hidden entry gets P = dS = 0 (not 0 times
        a dP that a NaN in a hidden V row could make NaN)."""

        N_STATS = TN if key_rows else TM  # L and D of each column (key rows) or row (query rows)
        # (float32 accuracy: the exact tanh)
        p_and_ds = score_mods.backward_probs(False, user_mods, key_rows)

        @device_jit
        def probs(s, dp, stats, base, masked, lo, hi, window, capped, cap, biased, slope, diags, col0, p_s, ds_s, user):
            tx = ops.thread_col()
            l2 = cuda.local.array(N_STATS, float32)
            dd = cuda.local.array(N_STATS, float32)
            if key_rows:  # per column (query), read once
                for j in range(TN):
                    l2[j] = stats[base + tx + TX * j]
                    dd[j] = stats[base + B + tx + TX * j]
            else:
                for i in range(TM):
                    l2[i] = stats[base + ops.thread_row(i)]
                    dd[i] = stats[base + B + ops.thread_row(i)]
            for i in range(TM):
                r = ops.thread_row(i)
                for j in range(TN):
                    c = tx + TX * j
                    stat = j if key_rows else i
                    # FA-2 Alg. 2 lines 11, 14 (Alg. 4 lines 13, 20), with the forward's modifications
                    p, ds = p_and_ds(s[i, j], l2[stat], dp[i, j], dd[stat], capped, cap, biased, slope, diags[i], r,
                                     col0 + c, user)
                    if masked:
                        if key_rows:
                            hidden = mask.query_hidden(col0 + c, lo[i], hi[i], window)
                        else:
                            hidden = mask.key_hidden(col0 + c, lo[i], hi[i], window)
                        if hidden:
                            p = float32(0.0)
                            ds = float32(0.0)
                    if write_p:
                        p_s[at(r * PS + c)] = p
                    ds_s[at(r * PS + c)] = ds

        return probs

    probs_key_rows = make_probs(True, True)
    dscores_query_rows = make_probs(False, False)

    @device_jit
    def key_bounds(col0, n_q, n_k, window, first_q, last_q):
        """The queries ``[first_q[i], last_q[i]]`` that see each of this thread's key rows
        (``kernels.mask``; keys past Nk: none; ``last_q``: with a left edge only)."""
        for i in range(TM):
            key = col0 + ops.thread_row(i)
            first_q[i] = mask.first_visible_query(key, n_q, n_k, window)
            if window[0] >= 0:
                last_q[i] = mask.last_visible_query(key, n_q, n_k, window)

    @device_jit
    def key_diagonals(col0, n_q, n_k, diags):
        """ALiBi: the query on each of this thread's key rows' diagonal (``key - (Nk - Nq)``;
        ``score_mods.alibi_bias`` measures a query's distance from it)."""
        for i in range(TM):
            diags[i] = col0 + ops.thread_row(i) - (n_k - n_q)

    @device_jit
    def write_rows(x, b, h, row0, n_valid, acc, factor):
        """This thread's rows (``thread_row``) and columns (``out_col``) of ``acc`` times
        ``factor`` -> ``x[b, h]`` (rows below ``n_valid``, d < D)."""
        for i in range(TM):
            row = row0 + ops.thread_row(i)
            if row < n_valid:
                for g in range(DG):
                    for u in range(VEC):
                        d = ops.out_col(g, u)
                        if d < D:
                            x[b, h, row, d] = acc[i, VEC * g + u] * factor

    ns = ModuleType(f"numba_flash.kernels.bwd_ops_d{D}_b{B}")
    for name, func in dict(load_row_stats=load_row_stats, rowdot_tile=rowdot_tile, probs_key_rows=probs_key_rows,
                           dscores_query_rows=dscores_query_rows, key_bounds=key_bounds,
                           key_diagonals=key_diagonals,
                           write_rows=write_rows).items():
        setattr(ns, name, func)
    ns.tile = ops
    return ns


@device_jit
def _nothing():
    pass  # (synchronous copies: nothing to commit or wait for)


@functools.lru_cache(maxsize=None)
def ffma_bwd_engine(order: str, head_dim: int, block: int, user_mods=None):
    """The CUDA-core backward engine (``kernels.backward``'s interface) of the K/V kernel of
    ``order``: square ``block x block`` micro-tiled steps, float32 tiles in the dynamic shared
    memory of :func:`bwd_layout` (Q_i | dO_i | K_j | V_j | (O_i) | P^T | dS^T | L_i | D_i),
    synchronous copies, Q_i scaled into log2 units as it is loaded. ``user_mods``: a user's mods
    compiled into P and dS (``score_mods.UserMods``)."""

    D, B = head_dim, block
    FA1 = order == "fa1"
    bops = bwd_ops(D, B, user_mods)
    ops = bops.tile
    lay = bwd_layout(order, D, B)
    TM, TN, ACC = lay.tiles.rows_per_thread, lay.tiles.cols_per_thread, VEC * lay.tiles.dim_groups
    ROWS, PROBS = lay.row_tile, lay.prob_tile
    DQ_PARTS = dq_parts(lay)
    DQ_COLS = ACC // DQ_PARTS
    one = float32(1.0)

    @device_jit
    def load_kv(k, v, b, hk, col0, n_k, k_s, v_s):
        ops.load_rows(k, b, hk, col0, n_k, one, k_s)
        ops.load_rows(v, b, hk, col0, n_k, one, v_s)

    @device_jit
    def step_inputs(q, do, o, lse, dvec, b, h, row0, n_q, q_scale, q_s, do_s, o_s, stats):
        ops.load_rows(q, b, h, row0, n_q, q_scale, q_s)  # Q_i times scale log2(e): S in log2 units
        ops.load_rows(do, b, h, row0, n_q, one, do_s)
        bops.load_row_stats(lse, dvec, b, h, row0, n_q, stats, not FA1)
        if FA1:
            ops.load_rows(o, b, h, row0, n_q, one, o_s)

    @device_jit
    def no_load_step(q, do, o, b, h, row0, n_q, q_s, do_s, o_s):
        pass  # (synchronous: step_inputs)

    @device_jit
    def no_read_stats(lse, dvec, b, h, row0, n_q, nxt):
        pass

    @device_jit
    def no_write_stats(stats, base, nxt):
        pass

    @device_jit
    def no_frags(k_s, v_s, kf, vf):
        pass

    @device_jit
    def scores_t(af, a_s, b_s, out, scratch):
        ops.score_tile(a_s, b_s, out)

    @device_jit
    def probs_t(s, dp, stats, base, q_scale, masked, first_q, last_q, window, capped, cap, biased, slope, diags, row0,
                pt_s, ds_s, user):
        bops.probs_key_rows(s, dp, stats, base, masked, first_q, last_q, window, capped, cap, biased, slope, diags, row0,
                            pt_s, ds_s, user)

    @device_jit
    def dv_update(s, pt_s, do_s, acc, scratch):
        ops.ab_tile(pt_s, do_s, acc)

    @device_jit
    def dk_update(dp, ds_s, q_s, acc, scratch):
        ops.ab_tile(ds_s, q_s, acc)  # (scale: at the end)

    @device_jit
    def dq_update(dp, ds_s, k_s, dq, b, h, row0, n_q, scale, dq_acc, scratch):
        for part in range(DQ_PARTS):  # (D > 64: half the head dim at a time, for registers)
            for i in range(TM):
                for c in range(DQ_COLS):
                    dq_acc[i, c] = float32(0.0)
            if DQ_PARTS == 1:
                ops.atb_tile(ds_s, k_s, dq_acc)  # dS_ij K_j
            else:
                ops.atb_half_tile(ds_s, k_s, dq_acc, part)
            for i in range(TM):
                row = row0 + ops.block_row(i)
                if row < n_q:
                    for g in range(DQ_COLS // VEC):
                        for u in range(VEC):
                            d = ops.out_col(part * (DQ_COLS // VEC) + g, u)
                            if d < D:
                                x = dq_acc[i, VEC * g + u] * scale
                                if FA1:  # Alg. 4 line 21: dQ_i += dS_ij K_j, read and written back (this block only)
                                    dq[b, h, row, d] += x
                                else:  # FA-2 line 15: other K/V tiles' blocks add to dQ_i too
                                    cuda.atomic.add(dq, (b, h, row, d), x)

    @device_jit
    def dk_factor(scale):
        return float32(LN2)  # dK_j = scale dS^T Q_i = ln 2 dS^T (Q_i scale log2 e)

    row = shared_tile
    q_tile = row(lay.offset("q"), ROWS)
    do_tile = row(lay.offset("do"), ROWS)
    o_tile = row(lay.offset("o") if FA1 else 0, ROWS)
    engine = score_mods.user_engine(f"numba_flash.kernels.ffma_bwd_engine_{order}_d{D}_b{B}", user_mods)
    for name, func in dict(load_kv=load_kv, step_inputs=step_inputs, load_step=no_load_step, read_stats=no_read_stats,
                           write_stats=no_write_stats, commit=_nothing, wait_all=_nothing, kv_frags=no_frags,
                           rowdot=bops.rowdot_tile, scores_t=scores_t, probs_t=probs_t, dv_update=dv_update,
                           dk_update=dk_update, dq_update=dq_update, key_bounds=bops.key_bounds, key_diagonals=bops.key_diagonals, zero=ops.zero,
                           write_grad=bops.write_rows, dk_factor=dk_factor).items():
        setattr(engine, name, func)
    engine.order, engine.block_m, engine.block_n, engine.layout, engine.ELEM = order, B, B, lay, float32
    engine.PREFETCH, engine.PAIRED, engine.P_IN_SMEM, engine.STATS_STATIC = False, False, True, 0
    engine.s_shape, engine.acc_shape, engine.dq_shape = (TM, TN), (TM, ACC), (TM, DQ_COLS)
    engine.af_shape, engine.nxt_shape, engine.first_q_rows, engine.scratch_floats = (1, 1), (1, 1), TM, 1
    engine.k_tile, engine.v_tile = row(lay.offset("k"), ROWS), row(lay.offset("v"), ROWS)
    engine.q_tiles, engine.do_tiles, engine.o_tiles = (q_tile, q_tile), (do_tile, do_tile), (o_tile, o_tile)
    engine.q_pair = engine.do_pair = engine.o_pair = None
    engine.p_tile, engine.ds_tile = row(lay.offset("p"), PROBS), row(lay.offset("ds"), PROBS)
    engine.stats_tile = row(lay.offset("lse"), 2 * B)
    return engine


def bwd_kernel(order: str, head_dim: int, block: int, window, compute_dq: bool = True, softcap: bool = False,
               alibi: bool = False, user_mods=None, varlen: bool = False):
    """The CUDA-core dK/dV (and dQ) kernel of one loop order: ``kernels.backward.kv_kernel`` on
    :func:`ffma_bwd_engine` (memoised there).

    Launch: ``"fa1"``: ``grid = (B * Hkv,)``; ``"fa2"``: ``grid = (ceil(Nk / block) * B * Hkv,)``;
    ``block = (bwd_layout(order, head_dim, block).threads,)``, dynamic shared memory
    ``bwd_layout(order, head_dim, block).smem_bytes``. Arguments: ``q, do, o (B,H,Nq,D)``,
    ``k, v (B,Hkv,Nk,D)``, ``lse (B,H,Nq) float32``, ``dvec (B,H,Nq) float32`` (D_i; read by
    ``"fa2"`` only, FA-1 computes it: any float32 array of that shape will do), ``dq (B,H,Nq,D)
    float32``, zeroed before the launch and accumulated into (atomically for ``"fa2"``;
    untouched when not ``compute_dq``), ``dk, dv (B,Hkv,Nk,D)`` out, ``scale`` (float32),
    ``softcap_log2`` (float32; read with ``softcap``), ``alibi`` ((B, H) float32 slopes times
    log2(e); read with ``alibi``); ``varlen``: a packed batch (``kernels.backward.kv_kernel``).
    """
    from numba_flash.kernels.backward import kv_kernel

    return kv_kernel(ffma_bwd_engine(order, int(head_dim), int(block), user_mods), window_of(window), bool(compute_dq),
                     bool(softcap), bool(alibi), bool(varlen))


@functools.lru_cache(maxsize=None)
def ffma_dq_engine(head_dim: int, block: int, user_mods=None):
    """The CUDA-core engine of the deterministic dQ kernel (``kernels.backward.dq_kernel``'s
    interface): S = Q_i K_j^T with queries as the micro-tile rows (the forward's orientation),
    dS through shared memory, synchronous copies; dynamic shared memory Q_i | dO_i | K_j | V_j |
    dS | L_i | D_i (:func:`bwd_layout` ``"dq"``); ``user_mods`` as :func:`ffma_bwd_engine`'s."""

    D, B = head_dim, block
    bops = bwd_ops(D, B, user_mods)
    ops = bops.tile
    lay = bwd_layout("dq", D, B)
    TM, TN, ACC = lay.tiles.rows_per_thread, lay.tiles.cols_per_thread, VEC * lay.tiles.dim_groups
    ROWS, PROBS = lay.row_tile, lay.prob_tile
    one = float32(1.0)

    @device_jit
    def start(q, do, k, v, lse, dvec, b, h, hk, row0, n_q, n_k, q_scale, col_first, n_walk, q_s, do_s, k_s, v_s, stats,
              l2, dd):
        ops.load_rows(q, b, h, row0, n_q, q_scale, q_s)  # Q_i in log2 units
        ops.load_rows(do, b, h, row0, n_q, one, do_s)
        bops.load_row_stats(lse, dvec, b, h, row0, n_q, stats, True)

    @device_jit
    def before_scores(k, v, b, hk, col0, col_next, j, n_walk, n_k, k0_s, k1_s, v_s, q_s, do_s, qf, dof):
        cuda.syncthreads()  # everyone is done with the previous K_j, V_j, dS
        ops.load_rows(k, b, hk, col0, n_k, one, k0_s)
        ops.load_rows(v, b, hk, col0, n_k, one, v_s)
        cuda.syncthreads()  # (and Q_i, dO_i, L_i, D_i before the first step)

    @device_jit
    def scores(af, a_s, b_s, out, scratch):
        ops.score_tile(a_s, b_s, out)

    @device_jit
    def after_scores(v, b, hk, col0, col_next, j, n_walk, n_k, v_s):
        pass

    @device_jit
    def dscores(s, dp, stats, l2, dd, q_scale, masked, first_keys, last_keys, window, capped, cap, biased, slope, diags,
                col0, ds_s, user):
        bops.dscores_query_rows(s, dp, stats, 0, masked, first_keys, last_keys, window, capped, cap, biased, slope, diags,
                                col0, ds_s, ds_s, user)

    @device_jit
    def dq_step(dp, ds_s, k_s, acc, scratch):
        ops.ab_tile(ds_s, k_s, acc)

    @device_jit
    def write_dq(dq, b, h, row0, n_q, acc, scale):
        bops.write_rows(dq, b, h, row0, n_q, acc, scale)

    @device_jit
    def no_row_stats(lse, dvec, b, h, row0, n_q, l2, dd):
        pass  # (L_i, D_i go to shared memory with Q_i: start)

    engine = score_mods.user_engine(f"numba_flash.kernels.ffma_dq_engine_d{D}_b{B}", user_mods)
    for name, func in dict(row_stats=no_row_stats, start=start, before_scores=before_scores, scores=scores, after_scores=after_scores,
                           dscores=dscores, dq_step=dq_step, write_dq=write_dq, row_key_bounds=ops.row_key_bounds,
                           row_alibi=ops.row_alibi,
                           zero=ops.zero, wait_all=_nothing).items():
        setattr(engine, name, func)
    engine.block_m, engine.block_n, engine.layout, engine.ELEM = B, B, lay, float32
    engine.DOUBLE_K, engine.DS_IN_SMEM = False, True
    engine.s_shape, engine.acc_shape, engine.af_shape, engine.stat_rows, engine.scratch_floats = (TM, TN), (TM, ACC), (1, 1), TM, 1
    k_tile = shared_tile(lay.offset("k"), ROWS)
    engine.q_tile, engine.do_tile = shared_tile(lay.offset("q"), ROWS), shared_tile(lay.offset("do"), ROWS)
    engine.k_tiles, engine.v_tile = (k_tile, k_tile), shared_tile(lay.offset("v"), ROWS)
    engine.ds_tile, engine.stats_tile = shared_tile(lay.offset("ds"), PROBS), shared_tile(lay.offset("lse"), 2 * B)
    return engine


def bwd_dq_kernel(head_dim: int, block: int, window, softcap: bool = False, alibi: bool = False, user_mods=None,
                  varlen: bool = False):
    """dQ without atomics (``deterministic=True``) on CUDA cores: ``kernels.backward.dq_kernel``
    on :func:`ffma_dq_engine` (memoised there).

    Launch: ``grid = (ceil(Nq / block) * B * H,)``, ``block = (bwd_layout("dq", ...).threads,)``,
    dynamic shared memory ``bwd_layout("dq", head_dim, block).smem_bytes``. Arguments: ``q, do
    (B,H,Nq,D)``, ``k, v (B,Hkv,Nk,D)``, ``lse, dvec (B,H,Nq) float32``, ``dq (B,H,Nq,D)`` out
    (any float dtype), ``scale`` (float32), ``softcap_log2`` (float32; read with ``softcap``),
    ``alibi`` (read with ``alibi``); ``varlen``: a packed batch (``kernels.backward.dq_kernel``).
    """
    from numba_flash.kernels.backward import dq_kernel

    return dq_kernel(ffma_dq_engine(int(head_dim), int(block), user_mods), window_of(window), bool(softcap), bool(alibi),
                     bool(varlen))


@kernel_factory
def rowdot_kernel(head_dim: int | None, threads: int = ROWDOT_THREADS, bits: str | None = None):
    """FA-2 line 4: ``dvec[b, h, i] = sum_d do[b, h, i, d] * o[b, h, i, d]`` (float32), for both
    regimes. ``head_dim``: the columns summed (a compile-time count; ``None``: ``do.shape[3]``,
    the tensor-core path's unpadded arrays); ``bits``: ``None`` (``do``, ``o`` hold values) or
    ``"f16"`` / ``"bf16"`` (they hold that kind's 16-bit patterns, as ``kernels.tc_bwd`` reads
    them). Launch: ``grid = (ceil(B * H * Nq / threads),)``, ``block = (threads,)``; one row a
    thread; any strides."""
    D = head_dim
    if bits is None:

        @device_jit
        def value(x):
            return float32(x)

    else:
        from numba_flash.kernels import mma

        value = mma.VALUE_16[bits]
    if D is None:

        @device_jit
        def columns(x):
            return x.shape[3]

    else:

        @device_jit
        def columns(x):
            return D

    @kernel_jit(fastmath={"contract", "arcp"})
    def rowdot(do, o, dvec):
        n_heads, n_q = do.shape[1], do.shape[2]
        row = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if row < do.shape[0] * n_heads * n_q:
            i = row % n_q
            bh = row // n_q
            h = bh % n_heads
            b = bh // n_heads
            acc = float32(0.0)
            for d in range(columns(do)):
                acc += value(do[b, h, i, d]) * value(o[b, h, i, d])
            dvec[b, h, i] = acc

    return rowdot
