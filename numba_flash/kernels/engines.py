"""The compute engines of the forward: one set of signatures over CUDA cores and tensor cores.

The forward's two loop nests (``kernels.forward``: FA-1's K/V-outer, FA-2's Q-outer) are written
once, against the functions below; an engine supplies them for its register layout:

- :func:`ffma_engine`: register micro-tiles on CUDA cores (``tile_ops``): Q_i scaled into log2
  units as it is loaded, P~ through shared memory, FFMA products;
- :func:`mma_engine`: ``mma.sync`` tiles (``tc_ops``): Q_i's fragments in registers, S scaled
  after the product, P~ kept in registers and converted for P~ V.

The engine interface (every function device code; arguments an engine does not need are ignored):

``load_q(q, b, h, row0, n_q, q_scale, q_s)``
    Q_i into shared memory (FFMA: synchronous and scaled; mma: ``cp.async``, the pipeline commits).
``q_frags(q_s, qf, qf_small)``
    Q_i's operand fragments into registers once its copy landed (FFMA: nothing).
``score_tile(qf, qf_small, q_s, k_s, s, scratch)``
    S = Q_i K_j^T (FA-1 line 9, FA-2 line 8).
``scale_mask(s, q_scale, col0, first_keys, last_keys, masked, window, capped, cap, biased, slopes, diags)``
    S in log2 units, soft-capped when ``capped`` (``score_mods``; ``cap`` in log2 units), the
    ALiBi bias added when ``biased`` (``score_mods.tile_alibi``; each row's slope and diagonal
    key from ``row_alibi``), and the keys a row does not see -> -inf (``mask.tile_masker``; each
    row's visible keys ``[first_keys, last_keys]`` from ``row_key_bounds``, ``window`` the kernel's).
``mask_tile(s, col0, first_keys, last_keys, window)``, ``score_key(i, j)``, ``score_row(i, j)``
    the mask alone (what ``scale_mask`` does when ``masked``), and the layout of S: entry ``(i, j)``
    holds key ``col0 + score_key(i, j)`` of row ``score_row(i, j)`` (a user's mods go between the
    two: ``score_mods.tile_user_mods``).
``row_max(s, out, scratch)``, ``exp_scores(s, m_ref, p_s, row_sums)``
    rowmax(S); P~ = exp2(S - m) and this thread's part of rowsum(P~).
``pv_tile(s, p_s, v_s, acc, col0, first_keys, last_keys, masked, window, scratch)``
    O~ += P~ V_j (FFMA: in masked tiles a key a row does not see is skipped, so a NaN in its V
    row cannot reach the row; mma: its P~ is 0).
``rescale_row(acc, i, alpha)``, ``zero(acc)``, ``allreduce_sum(x, scratch)``
    the row algebra on the accumulators (``softmax.row_update`` takes ``rescale_row``).
``thread_row(i)``, ``first_of_row()``, ``out_col(c)``, ``acc_row(i, c)``, ``acc_col(i, c)``
    where this thread's i-th row and c-th output column are: head-dim index ``out_col(c)``, held
    in ``acc[acc_row(i, c), acc_col(i, c)]`` (all constants once the loops unroll).
``store_out(o, b, h, row, d, x)``
    one element of the output in its dtype (mma: 16-bit outputs as bit patterns).
``group()``, ``first_key()``
    which group of warps whose states the nest merges this thread is in (split_k's groups: warp
    groups on CUDA cores, key warps on tensor cores; 0 otherwise), and the first key of each K/V
    tile it multiplies (split_k's groups and decode's key warps; 0 otherwise).

Constants: ``rows_per_thread``, ``out_cols``, the shapes of the register arrays (``s_shape``,
``acc_shape``, ``qf_shape``, ``qf_small_shape``, ``kv_reg``), and ``layout`` (the engine's own).
The copies of K_j and V_j belong to the pipeline (``kernels.pipeline``), which pairs with the
engine that can feed it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

from numba_flash._cuda import cuda
from numba_flash.kernels.jit import device_jit
from numba_flash.kernels.score_mods import tile_soft_capper
from numba_flash.kernels.tc_ops import ROWS_PER_THREAD as MMA_ROWS_PER_THREAD
from numba_flash.kernels.tc_ops import tc_ops
from numba_flash.kernels.tile_ops import tile_ops
from numba_flash.kernels.tiles import ROWS_PER_THREAD, VEC

SHARED = ("load_q", "q_frags", "score_tile", "scale_mask", "row_max", "exp_scores", "pv_tile", "rescale_row", "zero",
          "allreduce_sum", "thread_row", "first_of_row", "out_col", "acc_row", "acc_col", "store_out",
          "row_key_bounds", "row_alibi", "tile_needs_mask", "mask_tile", "score_key", "score_row",
          "nan_max", "finite_or_zero", "reciprocal_or_zero", "log_sum_exp",
          "exp2_diff", "group", "first_key")


def _engine(name: str, ops, functions: dict, **constants) -> ModuleType:
    """A module (numba resolves a module's attributes at compile time) with the interface's
    functions: ``functions`` first, the rest taken from ``ops`` under the same name."""
    engine = ModuleType(name)
    for attr in SHARED:
        setattr(engine, attr, functions[attr] if attr in functions else getattr(ops, attr))
    for attr, value in constants.items():
        setattr(engine, attr, value)
    engine.ops = ops
    return engine


@functools.lru_cache(maxsize=None)
def ffma_engine(head_dim: int, block_m: int, block_n: int, groups: int = 1,
                rows_per_thread: int = ROWS_PER_THREAD, page_size: int = 0) -> ModuleType:
    """CUDA cores: ``tile_ops``'s micro-tiles (``groups``: split_k's groups of warps, each with the
    layout of ``block_n`` keys; ``page_size``: K/V from a paged cache, ``kernels.paged``)."""
    ops = tile_ops(head_dim, block_m, block_n, groups, rows_per_thread, page_size)
    L = ops.layout
    TM = L.rows_per_thread
    cap_tile = tile_soft_capper(TM, L.cols_per_thread)  # (float32 accuracy: the exact tanh)

    @device_jit
    def q_frags(q_s, qf, qf_small):
        pass  # the micro-tiles read Q_i from shared memory at every product

    @device_jit
    def score_tile(qf, qf_small, q_s, k_s, s, scratch):
        ops.score_tile(q_s, k_s, s)

    @device_jit
    def scale_mask(s, q_scale, col0, first_keys, last_keys, masked, window, capped, cap, biased, slopes, diags):
        if capped:  # (scaled already: Q_i was loaded in log2 units)
            cap_tile(s, cap)
        if biased:
            ops.add_alibi(s, col0, slopes, diags)
        if masked:
            ops.mask_scores(s, col0, first_keys, last_keys, window)

    @device_jit
    def pv_tile(s, p_s, v_s, acc, col0, first_keys, last_keys, masked, window, scratch):
        ops.pv_tile(p_s, v_s, acc, col0, first_keys, last_keys, masked, window)

    @device_jit
    def first_of_row():
        return ops.thread_col() == 0

    @device_jit
    def out_col(c):
        return ops.out_col(c // VEC, c % VEC)

    @device_jit
    def acc_row(i, c):
        return i

    @device_jit
    def acc_col(i, c):
        return c

    @device_jit
    def store_out(o, b, h, row, d, x):
        o[b, h, row, d] = x

    NT, GROUPS = L.threads, int(groups)

    @device_jit
    def group():
        """This thread's group of warps (split_k; 0 for one group)."""
        if GROUPS > 1:
            return cuda.threadIdx.x // NT
        return 0

    @device_jit
    def first_key():
        """The first key of every K/V tile this thread's group multiplies."""
        return group() * block_n

    return _engine(ops.__name__.replace("tile_ops", "ffma_engine"), ops, dict(
        load_q=ops.load_q_tile, q_frags=q_frags, score_tile=score_tile, scale_mask=scale_mask, pv_tile=pv_tile,
        first_of_row=first_of_row, out_col=out_col, acc_row=acc_row, acc_col=acc_col, store_out=store_out,
        group=group, first_key=first_key),
        layout=L, rows_per_thread=TM, out_cols=VEC * L.dim_groups, s_shape=(TM, L.cols_per_thread),
        acc_shape=(TM, VEC * L.dim_groups), qf_shape=(1, 1), qf_small_shape=(1, 1), kv_reg=L.kv_loads,
        key_warps=1)


@functools.lru_cache(maxsize=None)
def mma_engine(kind: str, head_dim: int, block_m: int, block_n: int, row_walk=None, presplit=None,
               key_warps: int = 1, nest_merges: bool = False, page_size: int = 0) -> ModuleType:
    """Tensor cores: ``tc_ops``'s ``mma.sync`` tiles of ``kind``. ``key_warps`` > 1: the block's
    warps split each K/V tile's keys (``block_n / key_warps`` each); the products then run on one
    warp's part (``ops``) and the copies on the whole tile (``copies``, also the engine's ``load_q``).
    ``nest_merges``: the key warps are the loop nest's groups (split_k), whose states the nest
    merges (``group()`` is the key warp); else they merge themselves (:func:`key_warp_merge`,
    decode's ring), and ``group()`` is 0. ``page_size``: the copies read K/V from a paged cache
    (``kernels.paged``)."""
    KW = int(key_warps)
    ops = tc_ops(kind, head_dim, block_m, block_n // KW, row_walk, presplit, key_warps=KW, page_size=page_size)
    copies = ops if KW == 1 else tc_ops(kind, head_dim, block_m, block_n, row_walk, presplit, key_warps=KW,
                                        page_size=page_size)
    L = ops.layout
    TM = MMA_ROWS_PER_THREAD

    @device_jit
    def load_q(q, b, h, row0, n_q, q_scale, q_s):
        copies.load_q_tile(q, b, h, row0, n_q, q_s)  # (scaled after the product, by scale_mask)

    @device_jit
    def exp_scores(s, m_ref, p_s, row_sums):
        ops.exp_scores(s, m_ref, row_sums)  # P~ in place, in registers

    @device_jit
    def pv_tile(s, p_s, v_s, acc, col0, first_keys, last_keys, masked, window, scratch):
        ops.pv_tile(s, v_s, acc, scratch)  # (a hidden key's P~ is exp2(-inf) = 0 exactly)

    @device_jit
    def first_of_row():
        return ops.lane_t() == 0

    @device_jit
    def out_col(c):
        return ops.col_of(c >> 1, c & 1)

    @device_jit
    def acc_row(i, c):
        return c >> 1

    @device_jit
    def acc_col(i, c):
        return 2 * i + (c & 1)

    BNW = block_n // KW

    NEST_MERGES = bool(nest_merges)

    @device_jit
    def group():
        if NEST_MERGES:  # split_k: this thread's group is its key warp
            return ops.key_warp()
        return 0  # (decode's key warps merge their states themselves: ``key_warp_merge``)

    @device_jit
    def first_key():
        """The first key of every K/V tile this thread's warp multiplies."""
        if KW > 1:
            return ops.key_warp() * BNW
        return 0

    engine = _engine(f"numba_flash.kernels.mma_engine_{kind}_d{head_dim}_m{block_m}_n{block_n}_w{KW}"
                     + ("_groups" if NEST_MERGES else ""), ops, dict(
        load_q=load_q, q_frags=ops.load_q_frags, exp_scores=exp_scores, pv_tile=pv_tile, first_of_row=first_of_row,
        out_col=out_col, acc_row=acc_row, acc_col=acc_col, group=group, first_key=first_key),
        layout=L, rows_per_thread=TM, out_cols=2 * L.out_tiles, s_shape=(L.score_tiles, 4),
        acc_shape=(L.out_tiles, 4), qf_shape=(ops.q_frag_rows, 4), qf_small_shape=(ops.q_small_rows, 4), kv_reg=1,
        key_warps=KW)
    engine.copies = copies
    return engine


@functools.lru_cache(maxsize=None)
def key_warp_merge(engine, block_n: int, kv_stages: int, f32_out: bool):
    """The mma engine's key warps (``key_warps`` > 1) merged at the end of an FA-2 walk, and the
    output written: ``merge(o, lse, ob, h, row0, n_q, m, l_part, acc)``. Each warp's states
    of its rows as ``online.merge`` merges two states (in log2 units: m = max_w m_w,
    l = sum_w 2^(m_w - m) l_w, O~ = sum_w 2^(m_w - m) O~_w; the merge is associative and
    commutative, so the warps' key sets, disjoint and together the block's range, give the state
    of the whole range), then FA-2 lines 12-15: O_i = diag(l)^-1 O~ and L_i written. A warp that
    saw no key (m_w = -inf) weighs 0. m and l of every (warp, row), then each warp's O~ rows
    (padded by 4 floats: fewer bank conflicts), go through the dynamic shared memory the ring is
    done with. All threads must call."""
    from numba_flash._cuda import float32
    from numba_flash.kernels.jit import NEG_INF, SMEM_ALIGN
    from numba_flash.kernels.tc_ops import tc_layout

    ops, L = engine.ops, engine.copies.layout
    KW, TM, DT, BM, D = engine.key_warps, engine.rows_per_thread, L.out_tiles, L.block_m, L.head_dim
    F32_OUT = bool(f32_out)
    DP = L.padded_dim
    ACC_PITCH = DP + 4
    ACC_BASE = 2 * KW * BM
    THREADS = L.threads
    MERGE_PASSES = -(-BM * DP // THREADS)
    ring_bytes = tc_layout(L.kind, D, BM, block_n, kv_stages, key_warps=KW).smem_bytes
    if (ACC_BASE + KW * BM * ACC_PITCH) * 4 > ring_bytes:
        raise ValueError(f"the merge of {KW} key warps needs more shared memory than the ring's {ring_bytes} bytes")

    @device_jit
    def merge(o, lse, ob, h, row0, n_q, m, l_part, acc):
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

    return merge


@dataclass(frozen=True)
class CudaCores:
    """The CUDA-core engine's compile key: tiles and the micro-tile height (``tile_table``)."""

    head_dim: int
    block_m: int
    block_n: int
    rows_per_thread: int = ROWS_PER_THREAD


@dataclass(frozen=True)
class TensorCores:
    """The mma engine's compile key: precision kind, tiles, and the copies' knobs (``row_walk``:
    ``tc_ops``'s; ``presplit``: tf32x3's pre-split operands, ``tc_ops.tc_layout``'s;
    ``kv_stages``: the ring of ``pipeline.cp_async``; ``key_warps``: warps splitting each tile's keys)."""

    kind: str
    head_dim: int
    block_m: int
    block_n: int
    row_walk: object = None
    presplit: object = None
    kv_stages: int = 1
    key_warps: int = 1
