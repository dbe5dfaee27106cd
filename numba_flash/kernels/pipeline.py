"""Copy policies of the forward: how K_j, V_j (and Q_i) reach shared memory, and the barriers.

The loop nests of ``kernels.forward`` say *when* a tile must be in shared memory; a pipeline says
how it gets there and what is in flight meanwhile. One policy per way of copying:

- :func:`synchronous`: loads through registers, a barrier on each side (the CUDA-core engine's
  ``tile_ops`` copies: they scale Q_i as they go and pad K's rows for its micro-tiles);
- :func:`cp_async`: ``cp.async`` copies that overlap the products (the mma engine's). With one
  stage K_j and V_j alternate: V_j is in flight during S = Q_i K_j^T and K_{j+1} during
  O~ += P~ V_j (FlashAttention-2's schedule); tf32x3's pre-split operands add a split pass per
  tile (``tc_ops.split_k_tile`` / ``split_v_tile``). With ``stages = S > 1``, a ring: K/V tiles
  j+1 .. j+S-1 in flight while tile j is used, one barrier per tile (decode's knob).

Every policy is a module of device functions with the same signatures:

Q-outer walk (FA-2 lines 4-11), tile ``step`` of ``n_steps`` at key ``col0``, the walk's next
tile at key ``col_next`` (``col0 + block_n`` in a walk over consecutive tiles; a block-sparse
walk's next listed tile: a ring, ``stages > 1``, walks consecutive tiles only):
  ``load_q(q, b, h, row0, n_q, q_scale, q_s, lead)`` (line 4), then, the walk's range known,
  ``start(k, v, b, hk, n_k, col_first, n_steps, smem, k_s, v_s)`` (the first K/V copies),
  ``before_scores(k, v, b, hk, col0, col_next, step, n_steps, n_k, smem, k_s, v_s, k_split, kv_reg)``,
  ``before_pv(k, v, b, hk, col0, col_next, step, n_steps, n_k, smem, k_s, v_s, v_split)``, ``finish()``;
  ``k_operand(smem, k_s, k_split, step)`` and ``v_operand(smem, v_s, v_split, step)``: the
  shared-memory tiles the products read at ``step``; a ring, or key warps (``SLICED``: each
  warp's part of a tile), instead give their offsets in the dynamic buffer, ``k_offset(step)``
  and ``v_offset(step)``, ``OPERAND_ELEMS`` long (numba's device functions return only arrays
  they were given, not new views).
K/V-outer walk (FA-1 lines 5-8):
  ``kv_tile(k, v, b, hk, col0, n_k, smem, k_s, v_s, k_split, v_split, kv_reg)``,
  ``q_tile(q, b, h, row0, n_q, q_scale, q_s, lead)``, ``finish()``.
``SYNCHRONOUS``: no copy outlives its hook (a loop nest may then skip tiles freely).
``Q_BEFORE_RANGE``: Q_i is loaded before the walk's range is worked out (synchronous copies, as
measured), else just before ``start`` (its copies join the first K/V tile's commit group).
"""

from __future__ import annotations

import functools
from types import ModuleType

from numba_flash._cuda import cuda
from numba_flash.kernels import mma
from numba_flash.kernels.jit import device_jit


def _policy(name: str, **functions) -> ModuleType:
    module = ModuleType(f"numba_flash.kernels.pipeline_{name}")
    for attr, value in functions.items():
        setattr(module, attr, value)
    return module


@device_jit
def _nothing():
    pass


@device_jit
def _zero_offset(step):
    return 0


@functools.lru_cache(maxsize=None)
def synchronous(engine) -> ModuleType:
    """The CUDA-core engine's copies: everyone done with the previous tiles, copy, everyone's copy
    visible (each split_k group copies its own keys of the tile)."""
    ops = engine.ops

    @device_jit
    def load_q(q, b, h, row0, n_q, q_scale, q_s, lead):
        if lead:  # (split_k: the groups share Q_i; one loads it)
            engine.load_q(q, b, h, row0, n_q, q_scale, q_s)  # FA-2 line 4

    @device_jit
    def start(k, v, b, hk, n_k, col_first, n_steps, smem, k_s, v_s):
        pass

    @device_jit
    def before_scores(k, v, b, hk, col0, col_next, step, n_steps, n_k, smem, k_s, v_s, k_split, kv_reg):
        cuda.syncthreads()  # everyone is done with the previous K_j, V_j and P~
        ops.load_kv_tile(k, v, b, hk, col0 + engine.first_key(), n_k, k_s, v_s, kv_reg)  # FA-2 line 7
        cuda.syncthreads()  # Q_i, K_j, V_j are in shared memory before anyone reads them

    @device_jit
    def before_pv(k, v, b, hk, col0, col_next, step, n_steps, n_k, smem, k_s, v_s, v_split):
        cuda.syncthreads()  # P~ of every row is in shared memory

    @device_jit
    def k_operand(smem, k_s, k_split, step):
        return k_s

    @device_jit
    def v_operand(smem, v_s, v_split, step):
        return v_s

    @device_jit
    def kv_tile(k, v, b, hk, col0, n_k, smem, k_s, v_s, k_split, v_split, kv_reg):
        cuda.syncthreads()  # everyone is done with the previous K_j, V_j
        ops.load_kv_tile(k, v, b, hk, col0 + engine.first_key(), n_k, k_s, v_s, kv_reg)  # FA-1 line 6

    @device_jit
    def q_tile(q, b, h, row0, n_q, q_scale, q_s, lead):
        cuda.syncthreads()  # the previous Q_i and P~ are no longer read
        if lead:
            engine.load_q(q, b, h, row0, n_q, q_scale, q_s)  # FA-1 line 8: load Q_i

    return _policy("synchronous", SYNCHRONOUS=True, Q_BEFORE_RANGE=True, SLICED=False, OPERAND_ELEMS=1,
                   k_offset=_zero_offset, v_offset=_zero_offset, load_q=load_q, start=start, before_scores=before_scores, before_pv=before_pv,
                   k_operand=k_operand, v_operand=v_operand, kv_tile=kv_tile, q_tile=q_tile, finish=_nothing)


@functools.lru_cache(maxsize=None)
def cp_async(engine, block_n: int, stages: int = 1) -> ModuleType:
    """The mma engine's asynchronous copies (module doc): K_j and V_j in turn, or a ring of ``stages``."""
    ops, copies = engine.ops, engine.copies
    L = copies.layout
    BN, STAGES = block_n, int(stages)
    if STAGES < 1:
        raise ValueError(f"kv_stages must be >= 1; got {stages}")
    Q_ELEMS, KV_ELEMS, STRIDE = L.q_elems, L.kv_elems, L.stride
    WARP_KV_ELEMS = ops.layout.kv_elems  # one warp's keys of a K or V tile (all of it with one warp per row)
    SPLIT_K, SPLIT_V = ops.presplit_k, ops.presplit_v  # tf32x3 (tc_ops.presplit_operands)
    if STAGES > 1 and (SPLIT_K or SPLIT_V or L.presplit):
        raise ValueError("a ring of K/V tiles (kv_stages > 1) takes no pre-split operands")
    KEY_WARPS = L.key_warps  # > 1: each warp multiplies its part of every tile (the nest slices it)
    if KEY_WARPS > 1 and (SPLIT_K or SPLIT_V or L.presplit):
        raise ValueError("key warps take no pre-split operands")
    commit, wait_one, wait_all = mma.cp_async_commit, mma.cp_async_wait_one, mma.cp_async_wait_all
    wait_ring = mma.cp_async_wait_group(max(STAGES - 2, 0))  # tile j's group: STAGES - 2 committed after it

    @device_jit
    def load_kv_stage(k, v, b, hk, col0, n_k, smem, stage):
        """K and V of the K/V tile at key ``col0`` into ring stage ``stage`` (asynchronous)."""
        base = Q_ELEMS + 2 * KV_ELEMS * stage
        copies.load_kv_tile(k, b, hk, col0, n_k, smem[base : base + KV_ELEMS])
        copies.load_kv_tile(v, b, hk, col0, n_k, smem[base + KV_ELEMS : base + 2 * KV_ELEMS])

    if STAGES == 1:

        @device_jit
        def start(k, v, b, hk, n_k, col_first, n_steps, smem, k_s, v_s):
            # (after load_q: Q_i and K_first are one commit group)
            if n_steps > 0:
                copies.load_kv_tile(k, b, hk, col_first, n_k, k_s)
            commit()
            if SPLIT_V:  # V_first as a second group: that walk issues each V_{j+1} after V_j's split
                if n_steps > 0:
                    copies.load_kv_tile(v, b, hk, col_first, n_k, v_s)
                commit()

        @device_jit
        def before_scores(k, v, b, hk, col0, col_next, step, n_steps, n_k, smem, k_s, v_s, k_split, kv_reg):
            if SPLIT_V:  # four barriers per tile too; V_j was issued after V_{j-1}'s split
                wait_one()  # this thread's copies of Q_i and K_j have landed (V_j may not)
                cuda.syncthreads()  # ... and everyone's; everyone is done with tile j-1
                if SPLIT_K:
                    ops.split_k_tile(k_s, k_split)
                    cuda.syncthreads()  # K_j's fragments are visible; k_s is free
                    if step + 1 < n_steps:
                        copies.load_kv_tile(k, b, hk, col_next, n_k, k_s)  # K_{j+1}, in flight a whole step
                        commit()
            else:
                cuda.syncthreads()  # everyone is done reading V_{j-1}
                copies.load_kv_tile(v, b, hk, col0, n_k, v_s)  # FA-2 line 7 (V_j, in flight during S)
                commit()
                wait_one()  # this thread's copies of Q_i and K_j have landed
                cuda.syncthreads()  # ... and everyone's

        @device_jit
        def before_pv(k, v, b, hk, col0, col_next, step, n_steps, n_k, smem, k_s, v_s, v_split):
            if SPLIT_V:
                if not SPLIT_K:
                    cuda.syncthreads()  # everyone is done reading K_j
                    if step + 1 < n_steps:
                        copies.load_kv_tile(k, b, hk, col_next, n_k, k_s)  # K_{j+1}
                        commit()
                if step + 1 < n_steps:
                    wait_one()  # V_j has landed (K_{j+1} may not)
                else:
                    wait_all()
                cuda.syncthreads()  # V_j is visible to everyone
                ops.split_v_tile(v_s, v_split)
                cuda.syncthreads()  # V_j's fragments are visible; v_s is free
                if step + 1 < n_steps:
                    copies.load_kv_tile(v, b, hk, col_next, n_k, v_s)  # V_{j+1}, in flight during P~V and S
                    commit()
            else:
                cuda.syncthreads()  # everyone is done reading K_j
                if step + 1 < n_steps:
                    copies.load_kv_tile(k, b, hk, col_next, n_k, k_s)  # K_{j+1}, in flight during P~V
                    commit()
                    wait_one()  # V_j has landed
                else:
                    wait_all()
                cuda.syncthreads()  # V_j is visible to everyone

        @device_jit
        def k_operand(smem, k_s, k_split, step):
            if SPLIT_K:
                return k_split
            return k_s

        @device_jit
        def v_operand(smem, v_s, v_split, step):
            if SPLIT_V:
                return v_split
            return v_s

    else:

        @device_jit
        def start(k, v, b, hk, n_k, col_first, n_steps, smem, k_s, v_s):
            # the first STAGES - 1 tiles, a commit group each (Q_i's with the first)
            for t in range(STAGES - 1):
                if t < n_steps:
                    load_kv_stage(k, v, b, hk, col_first + t * BN, n_k, smem, t)
                commit()

        @device_jit
        def before_scores(k, v, b, hk, col0, col_next, step, n_steps, n_k, smem, k_s, v_s, k_split, kv_reg):
            wait_ring()  # this thread's copies of tile j (and Q_i) have landed
            cuda.syncthreads()  # ... and everyone's; and everyone is done with tile j - 1
            if step + STAGES - 1 < n_steps:  # FA-2 line 7, STAGES - 1 tiles ahead, into tile j - 1's stage
                load_kv_stage(k, v, b, hk, col0 + (STAGES - 1) * BN, n_k, smem, (step + STAGES - 1) % STAGES)
            commit()  # a group per tile, empty past the end: the wait above counts groups

        @device_jit
        def before_pv(k, v, b, hk, col0, col_next, step, n_steps, n_k, smem, k_s, v_s, v_split):
            pass  # V_j landed with K_j

        @device_jit
        def k_offset(step):
            """Where in the dynamic buffer this warp's keys of K_j are at ``step`` (its stage)."""
            return Q_ELEMS + 2 * KV_ELEMS * (step % STAGES) + engine.first_key() * STRIDE

        @device_jit
        def v_offset(step):
            return Q_ELEMS + 2 * KV_ELEMS * (step % STAGES) + KV_ELEMS + engine.first_key() * STRIDE

        k_operand = v_operand = None  # (a device function returns only an array it was given: the nest slices)

    @device_jit
    def kv_tile(k, v, b, hk, col0, n_k, smem, k_s, v_s, k_split, v_split, kv_reg):
        wait_all()  # (a no-op: every copy was waited for in the Q loop)
        cuda.syncthreads()  # everyone is done with K_{j-1}, V_{j-1}
        copies.load_kv_tile(k, b, hk, col0, n_k, k_s)  # FA-1 line 6: load K_j, V_j
        copies.load_kv_tile(v, b, hk, col0, n_k, v_s)
        commit()
        if SPLIT_V:  # once per K/V tile for all Q tiles (the Q loop's barriers publish it)
            wait_all()
            cuda.syncthreads()  # K_j, V_j landed
            if SPLIT_K:
                ops.split_k_tile(k_s, k_split)
            ops.split_v_tile(v_s, v_split)

    @device_jit
    def q_tile(q, b, h, row0, n_q, q_scale, q_s, lead):
        cuda.syncthreads()  # everyone has Q_{i-1}'s fragments in registers
        engine.load_q(q, b, h, row0, n_q, q_scale, q_s)  # FA-1 line 8: load Q_i
        commit()
        wait_all()

    @device_jit
    def load_q(q, b, h, row0, n_q, q_scale, q_s, lead):
        engine.load_q(q, b, h, row0, n_q, q_scale, q_s)  # FA-2 line 4 (committed with the first K/V copies)

    if STAGES == 1 and KEY_WARPS > 1:  # this warp's keys of the one K_j, V_j

        @device_jit
        def k_offset(step):
            return Q_ELEMS + engine.first_key() * STRIDE

        @device_jit
        def v_offset(step):
            return Q_ELEMS + KV_ELEMS + engine.first_key() * STRIDE

    elif STAGES == 1:
        k_offset = v_offset = _zero_offset
    return _policy(f"cp_async_s{STAGES}_w{KEY_WARPS}", SYNCHRONOUS=False, Q_BEFORE_RANGE=False,
                   SLICED=STAGES > 1 or KEY_WARPS > 1,
                   OPERAND_ELEMS=WARP_KV_ELEMS, k_offset=k_offset, v_offset=v_offset, STAGES=STAGES, load_q=load_q, start=start, before_scores=before_scores,
                   before_pv=before_pv, k_operand=k_operand, v_operand=v_operand, kv_tile=kv_tile, q_tile=q_tile,
                   finish=wait_all)
