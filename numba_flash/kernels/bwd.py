"""Attention backward on CUDA cores: FlashAttention Algorithm 4 and FlashAttention-2 Algorithm 2.

Both papers' backward passes walk the K/V tiles in the outer loop and the Q tiles in the inner
one, recomputing P from the forward's statistics instead of storing it; they differ in where the
work goes and how dQ is summed:

- ``"fa1"`` (FlashAttention, Algorithm 4): one block per (batch, KV head) walks every K/V tile
  (line 5) and, inside, every Q tile (line 8); D_i = rowsum(dO_i * O_i) is computed in the inner
  loop (line 19) and dQ_i is read, updated and written back in global memory at every step
  (line 21): no race, the block is alone on its head.
- ``"fa2"`` (FlashAttention-2, Algorithm 2): D is computed once by a first kernel (line 4,
  :func:`rowdot_kernel`); one block per (K/V tile, batch, KV head) -- the K/V tiles are spread
  over the GPU -- and dQ_i is accumulated with float32 atomics (line 15). ``deterministic``: the
  K/V-tile kernel skips dQ, and :func:`bwd_dq_kernel` computes it Q tile by Q tile (outer loop
  over Q, inner over K/V: the forward's order) with no atomics, so results are bitwise
  reproducible.

GQA: the block of a KV head walks the query heads that share it, so dK_j and dV_j sum over them
in shared memory. Rows that see no key (lse = -inf) have P = 0: zero gradients, never NaN.

This is the first, plain version: every thread computes whole dot products over the head dim
from shared tiles (no register micro-tiles, no tensor cores). All arithmetic is float32.
"""

from __future__ import annotations

import functools
import math

from numba_flash._cuda import cuda, float32

from numba_flash.kernels.jit import NEG_INF, SMEM_ALIGN, device_jit, kernel_jit
from numba_flash.kernels.row_state import last_visible_key

BWD_THREADS = 128


@functools.lru_cache(maxsize=None)
def bwd_ops(head_dim: int, block_m: int, block_n: int, threads: int = BWD_THREADS):
    """Device functions of one (head_dim, block_m, block_n) specialisation."""
    from types import ModuleType

    D, BM, BN, NT = head_dim, block_m, block_n, threads

    @device_jit
    def load_rows(x, b, h, row0, n_rows, n_valid, dst):
        """Rows ``row0 ..`` of ``x[b, h]`` -> ``dst`` (n_rows x D, float32); rows past n_valid are 0."""
        for e in range(cuda.threadIdx.x, n_rows * D, NT):
            r = e // D
            d = e - r * D
            row = row0 + r
            dst[e] = float32(x[b, h, row, d]) if row < n_valid else float32(0.0)

    @device_jit
    def load_row_stats(lse, dvec, b, h, row0, n_q, lse_s, dvec_s, read_dvec):
        """L_i (and D_i when ``read_dvec``) of the Q tile (rows past Nq: L = -inf, so they
        contribute nothing)."""
        for r in range(cuda.threadIdx.x, BM, NT):
            row = row0 + r
            lse_s[r] = lse[b, h, row] if row < n_q else float32(NEG_INF)
            if read_dvec:
                dvec_s[r] = dvec[b, h, row] if row < n_q else float32(0.0)

    @device_jit
    def rowdot_tile(do_s, o_s, dvec_s):
        """D_i = rowsum(dO_i * O_i) of the tile's rows (FA-1 line 19)."""
        for r in range(cuda.threadIdx.x, BM, NT):
            acc = float32(0.0)
            for d in range(D):
                acc += do_s[r * D + d] * o_s[r * D + d]
            dvec_s[r] = acc

    @device_jit
    def probs_and_dscores(q_s, k_s, v_s, do_s, lse_s, dvec_s, p_s, ds_s, row0, col0, n_q, n_k, causal, scale):
        """P_ij = exp(scale Q_i K_j^T - L_i) (0 where masked or the row sees nothing) and
        dS_ij = P_ij * (dO_i V_j^T - D_i), both BM x BN in shared memory."""
        for e in range(cuda.threadIdx.x, BM * BN, NT):
            r = e // BN
            c = e - r * BN
            key = col0 + c
            lse_r = lse_s[r]
            p = float32(0.0)
            ds = float32(0.0)
            if lse_r != NEG_INF and key < n_k and key <= last_visible_key(row0 + r, n_q, n_k, causal):
                s = float32(0.0)
                dp = float32(0.0)
                for d in range(D):
                    s += q_s[r * D + d] * k_s[c * D + d]
                    dp += do_s[r * D + d] * v_s[c * D + d]
                p = math.exp(s * scale - lse_r)  # FA-2 line 11 (FA-1 line 13: diag(l)^-1 exp(S - m))
                ds = p * (dp - dvec_s[r])  # FA-2 lines 13-14 (FA-1 lines 17, 20)
            p_s[e] = p
            ds_s[e] = ds

    @device_jit
    def accumulate_dkdv(p_s, ds_s, q_s, do_s, dk_s, dv_s, scale):
        """dV_j += P^T dO_i; dK_j += scale dS^T Q_i (FA-2 lines 12, 16; FA-1 lines 16, 22)."""
        for e in range(cuda.threadIdx.x, BN * D, NT):
            c = e // D
            d = e - c * D
            dv = float32(0.0)
            dk = float32(0.0)
            for r in range(BM):
                dv += p_s[r * BN + c] * do_s[r * D + d]
                dk += ds_s[r * BN + c] * q_s[r * D + d]
            dv_s[e] += dv
            dk_s[e] += dk * scale

    @device_jit
    def dq_step(ds_s, k_s, r, d, scale):
        """scale (dS_ij K_j)[r, d]: this K/V tile's share of dQ_i (FA-2 line 15, FA-1 line 21)."""
        acc = float32(0.0)
        for c in range(BN):
            acc += ds_s[r * BN + c] * k_s[c * D + d]
        return acc * scale

    ops = ModuleType(f"numba_flash.kernels.bwd_ops_d{D}_m{BM}_n{BN}")
    for name, func in dict(load_rows=load_rows, load_row_stats=load_row_stats, rowdot_tile=rowdot_tile,
                           probs_and_dscores=probs_and_dscores, accumulate_dkdv=accumulate_dkdv,
                           dq_step=dq_step).items():
        setattr(ops, name, func)
    return ops


@functools.lru_cache(maxsize=None)
def bwd_kernel(order: str, head_dim: int, block_m: int, block_n: int, causal: bool, compute_dq: bool = True,
               threads: int = BWD_THREADS):
    """The dK/dV (and dQ) kernel of one loop order (memoised).

    Launch: ``"fa1"``: ``grid = (B * Hkv,)``; ``"fa2"``: ``grid = (ceil(Nk / block_n) * B * Hkv,)``;
    ``block = (threads,)``. Arguments: ``q, do, o (B,H,Nq,D)``, ``k, v (B,Hkv,Nk,D)``,
    ``lse (B,H,Nq) float32``, ``dvec (B,H,Nq) float32`` (D_i; read by ``"fa2"`` only, FA-1
    computes it: any float32 array of that shape will do), ``dq (B,H,Nq,D) float32``, zeroed before the launch and accumulated into
    (atomically for ``"fa2"``; untouched when not ``compute_dq``), ``dk, dv (B,Hkv,Nk,D)`` out,
    ``scale`` (float32).
    """
    if order not in ("fa1", "fa2"):
        raise ValueError(f"order must be 'fa1' or 'fa2'; got {order!r}")
    D, BM, BN, NT = head_dim, block_m, block_n, threads
    FA1, CAUSAL, DQ = order == "fa1", bool(causal), bool(compute_dq)
    ops = bwd_ops(D, BM, BN, NT)
    Q_FLOATS, KV_FLOATS, P_FLOATS = BM * D, BN * D, BM * BN  # shared array sizes: compile-time constants

    @kernel_jit(fastmath={"contract", "arcp"})
    def attention_bwd(q, k, v, o, do, lse, dvec, dq, dk, dv, scale):
        n_batch, n_heads, n_q = q.shape[0], q.shape[1], q.shape[2]
        n_kv_heads, n_k = k.shape[1], k.shape[2]
        group = n_heads // n_kv_heads
        n_kv_tiles = (n_k + BN - 1) // BN
        n_q_tiles = (n_q + BM - 1) // BM
        if FA1:  # one block per (batch, KV head): it walks every K/V tile (line 5)
            bh = cuda.blockIdx.x
            j_first, j_end = 0, n_kv_tiles
        else:  # one block per (K/V tile, batch, KV head): line 5's loop is the grid
            j_first = cuda.blockIdx.x % n_kv_tiles
            j_end = j_first + 1
            bh = cuda.blockIdx.x // n_kv_tiles
        b = bh // n_kv_heads
        hk = bh - b * n_kv_heads

        q_s = cuda.shared.array(Q_FLOATS, float32, SMEM_ALIGN)
        do_s = cuda.shared.array(Q_FLOATS, float32, SMEM_ALIGN)
        o_s = cuda.shared.array(Q_FLOATS, float32, SMEM_ALIGN)
        k_s = cuda.shared.array(KV_FLOATS, float32, SMEM_ALIGN)
        v_s = cuda.shared.array(KV_FLOATS, float32, SMEM_ALIGN)
        dk_s = cuda.shared.array(KV_FLOATS, float32, SMEM_ALIGN)
        dv_s = cuda.shared.array(KV_FLOATS, float32, SMEM_ALIGN)
        p_s = cuda.shared.array(P_FLOATS, float32, SMEM_ALIGN)
        ds_s = cuda.shared.array(P_FLOATS, float32, SMEM_ALIGN)
        lse_s = cuda.shared.array(BM, float32)
        dvec_s = cuda.shared.array(BM, float32)

        for j in range(j_first, j_end):  # line 5: for 1 <= j <= Tc
            col0 = j * BN
            cuda.syncthreads()  # the previous tile's dK_j, dV_j are written out
            ops.load_rows(k, b, hk, col0, BN, n_k, k_s)  # line 6: K_j, V_j
            ops.load_rows(v, b, hk, col0, BN, n_k, v_s)
            for e in range(cuda.threadIdx.x, BN * D, NT):  # line 7: dK_j = 0, dV_j = 0 on chip
                dk_s[e] = float32(0.0)
                dv_s[e] = float32(0.0)
            for g in range(group):  # the query heads of this KV head (GQA): dK_j, dV_j sum over them
                h = hk * group + g
                for i in range(n_q_tiles):  # line 8: for 1 <= i <= Tr
                    row0 = i * BM
                    # Causal: a Q tile whose last row sees no key of this tile contributes nothing.
                    if col0 > last_visible_key(min(row0 + BM, n_q) - 1, n_q, n_k, CAUSAL):
                        continue
                    cuda.syncthreads()  # everyone is done with the previous Q_i, dO_i, P, dS
                    ops.load_rows(q, b, h, row0, BM, n_q, q_s)  # line 9: Q_i, dO_i, L_i, D_i
                    ops.load_rows(do, b, h, row0, BM, n_q, do_s)
                    ops.load_row_stats(lse, dvec, b, h, row0, n_q, lse_s, dvec_s, not FA1)
                    if FA1:
                        ops.load_rows(o, b, h, row0, BM, n_q, o_s)
                        cuda.syncthreads()
                        ops.rowdot_tile(do_s, o_s, dvec_s)  # FA-1 line 19: D_i
                    cuda.syncthreads()
                    ops.probs_and_dscores(q_s, k_s, v_s, do_s, lse_s, dvec_s, p_s, ds_s, row0, col0, n_q, n_k,
                                          CAUSAL, scale)
                    cuda.syncthreads()  # P_ij, dS_ij are in shared memory
                    ops.accumulate_dkdv(p_s, ds_s, q_s, do_s, dk_s, dv_s, scale)
                    if DQ:
                        for e in range(cuda.threadIdx.x, BM * D, NT):
                            r = e // D
                            d = e - r * D
                            row = row0 + r
                            if row < n_q:
                                x = ops.dq_step(ds_s, k_s, r, d, scale)
                                if FA1:  # line 21: dQ_i read, updated, written back (this block only)
                                    dq[b, h, row, d] += x
                                else:  # FA-2 line 15: other K/V tiles' blocks add to dQ_i too
                                    cuda.atomic.add(dq, (b, h, row, d), x)
            cuda.syncthreads()  # every step's dK_j, dV_j share is in
            for e in range(cuda.threadIdx.x, BN * D, NT):  # line 24 (FA-2 line 18): write dK_j, dV_j
                c = e // D
                d = e - c * D
                if col0 + c < n_k:
                    dk[b, hk, col0 + c, d] = dk_s[e]
                    dv[b, hk, col0 + c, d] = dv_s[e]

    return attention_bwd


@functools.lru_cache(maxsize=None)
def bwd_dq_kernel(head_dim: int, block_m: int, block_n: int, causal: bool, threads: int = BWD_THREADS):
    """dQ without atomics (``deterministic=True``): one block per (Q tile, batch, head) walks the
    K/V tiles it sees, recomputing P and dS, and sums dQ_i = scale sum_j dS_ij K_j on chip.

    Launch: ``grid = (ceil(Nq / block_m) * B * H,)``, ``block = (threads,)``. Arguments: ``q, do
    (B,H,Nq,D)``, ``k, v (B,Hkv,Nk,D)``, ``lse, dvec (B,H,Nq) float32``, ``dq (B,H,Nq,D)`` out
    (any float dtype), ``scale`` (float32).
    """
    D, BM, BN, NT = head_dim, block_m, block_n, threads
    CAUSAL = bool(causal)
    ops = bwd_ops(D, BM, BN, NT)
    Q_FLOATS, KV_FLOATS, P_FLOATS = BM * D, BN * D, BM * BN  # shared array sizes: compile-time constants

    @kernel_jit(fastmath={"contract", "arcp"})
    def attention_bwd_dq(q, k, v, do, lse, dvec, dq, scale):
        n_heads, n_q = q.shape[1], q.shape[2]
        n_k = k.shape[2]
        group = n_heads // k.shape[1]
        n_q_tiles = (n_q + BM - 1) // BM
        i_tile = cuda.blockIdx.x % n_q_tiles
        bh = cuda.blockIdx.x // n_q_tiles
        b = bh // n_heads
        h = bh - b * n_heads
        hk = h // group
        row0 = i_tile * BM

        q_s = cuda.shared.array(Q_FLOATS, float32, SMEM_ALIGN)
        do_s = cuda.shared.array(Q_FLOATS, float32, SMEM_ALIGN)
        dq_s = cuda.shared.array(Q_FLOATS, float32, SMEM_ALIGN)
        k_s = cuda.shared.array(KV_FLOATS, float32, SMEM_ALIGN)
        v_s = cuda.shared.array(KV_FLOATS, float32, SMEM_ALIGN)
        p_s = cuda.shared.array(P_FLOATS, float32, SMEM_ALIGN)
        ds_s = cuda.shared.array(P_FLOATS, float32, SMEM_ALIGN)
        lse_s = cuda.shared.array(BM, float32)
        dvec_s = cuda.shared.array(BM, float32)

        ops.load_rows(q, b, h, row0, BM, n_q, q_s)
        ops.load_rows(do, b, h, row0, BM, n_q, do_s)
        ops.load_row_stats(lse, dvec, b, h, row0, n_q, lse_s, dvec_s, True)
        for e in range(cuda.threadIdx.x, BM * D, NT):
            dq_s[e] = float32(0.0)
        last_key = last_visible_key(min(row0 + BM, n_q) - 1, n_q, n_k, CAUSAL)
        n_walk = min((n_k + BN - 1) // BN, last_key // BN + 1) if last_key >= 0 else 0
        for j in range(n_walk):
            col0 = j * BN
            cuda.syncthreads()  # everyone is done with the previous K_j, V_j, dS
            ops.load_rows(k, b, hk, col0, BN, n_k, k_s)
            ops.load_rows(v, b, hk, col0, BN, n_k, v_s)
            cuda.syncthreads()
            ops.probs_and_dscores(q_s, k_s, v_s, do_s, lse_s, dvec_s, p_s, ds_s, row0, col0, n_q, n_k, CAUSAL, scale)
            cuda.syncthreads()
            for e in range(cuda.threadIdx.x, BM * D, NT):  # each element owned by one thread: no race
                dq_s[e] += ops.dq_step(ds_s, k_s, e // D, e - (e // D) * D, scale)
        cuda.syncthreads()
        for e in range(cuda.threadIdx.x, BM * D, NT):
            r = e // D
            if row0 + r < n_q:
                dq[b, h, row0 + r, e - r * D] = dq_s[e]

    return attention_bwd_dq


@functools.lru_cache(maxsize=None)
def rowdot_kernel(head_dim: int, threads: int = BWD_THREADS):
    """FA-2 line 4: ``dvec[b, h, i] = sum_d do[b, h, i, d] * o[b, h, i, d]`` (float32).
    Launch: ``grid = (ceil(B * H * Nq / threads),)``, ``block = (threads,)``; one row a thread."""
    D = head_dim

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
            for d in range(D):
                acc += float32(do[b, h, i, d]) * float32(o[b, h, i, d])
            dvec[b, h, i] = acc

    return rowdot
