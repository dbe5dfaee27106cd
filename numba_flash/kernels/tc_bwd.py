"""Attention backward on tensor cores (16-bit inputs, float32 accumulation): FlashAttention-2
Algorithm 2 and FlashAttention's Algorithm 4, on the forward's primitives (``mma``, ``tc_ops``).
Also float32 inputs in split precision (kind ``"tf32x3"``, see the end of this docstring).

The loop nests are ``kernels.backward``'s, shared with the CUDA-core engine (``kernels.bwd``): K/V
tiles outside, Q tiles inside, P recomputed from the forward's logsumexp; this module is their
tensor-core engines (:func:`mma_bwd_engine`, :func:`mma_dq_engine`) and named points
(:func:`tc_bwd_kernel`, :func:`tc_bwd_dq_kernel`). What changes is where each product lives.

**Orientation.** A block of the K/V kernels has ``block_n / 16`` warps; warp ``w`` owns keys
``16 w .. 16 w + 15`` of K_j (lane ``(g, t)``: keys ``g`` and ``g + 8``) and computes the
*transposed* scores of its keys against all ``block_m`` queries of Q_i:

==================  ===========================================================================
S^T = K_j Q_i^T     A = the warp's K_j rows (``ldmatrix``; kept in registers for the whole walk
                    when D <= 64), B = Q_i rows (``ldmatrix`` of the row-major tile: the
                    forward's S = Q K^T with the roles swapped)
dP^T = V_j dO_i^T   the same with V_j and dO_i
P^T, dS^T           elementwise in the accumulators: P^T = exp2(S^T scale log2 e - L),
                    dS^T = P^T (dP^T - D), L and D per *column* (query), from shared memory
dV_j += P^T dO_i    P^T never leaves the registers: the accumulator layout of two adjacent
                    8-query tiles is the A-fragment layout of one 16-query step (the forward's
                    P~ V, ``tc_ops.pv_tile``), dO_i's B fragments by ``ldmatrix.trans``
dK_j += dS^T Q_i    the same with dS^T and Q_i; dK_j, dV_j stay in registers (float32 C
                    fragments) across the whole walk over Q tiles and query heads (GQA)
dQ_i += dS K_j      the sum over keys spans the warps, so dS^T goes to shared memory (16-bit,
                    packed pairs), and after a barrier warp ``w`` takes queries ``16 w ..``:
                    A = dS by ``ldmatrix.trans`` of dS^T (``mma.ldsm_x4_a_trans``), B = K_j by
                    ``ldmatrix.trans``; the float32 result goes to dQ by
                    ``red.global.add.v2.f32`` (FA-2) or a read-modify-write (FA-1)
==================  ===========================================================================

This is FlashAttention-2's choice (dV, dK from P^T, dS^T in registers; dQ through shared memory
and atomics). In dQ the warps take whole 16-query groups, or, when there are fewer groups than
warps (``block_m < block_n``), split a group's 16-column chunks of D.

**Head dims above 128** (issue 25). One warp's dK_j, dV_j would be 256 float32 registers at D =
256, so each 16 keys get two warps (``TcBwdLayout.col_split``), each keeping and writing half of
dK_j's and dV_j's columns (``tc_ops``' ``col_split``: ``pv_tile`` from the warp's ``out_col0``).
In 16-bit with Q tiles of 32 queries or more (``TcBwdLayout.shared_scores``) the two warps also
split S^T and dP^T by queries and store P^T and dS^T to shared memory, and dV_j, dK_j read their
A operand there by ``ldmatrix`` (``pv_shared``): FlashAttention-2's own exchange, every product
made once. Otherwise (tf32x3, 16-query tiles) both warps compute all of S^T and dP^T and the
first stores dS^T.

**Kernels.** The loop orders and how each sums dQ are ``kernels.backward``'s; here FA-2's dQ
atomics are ``red.global.add.v2.f32`` pairs (sm_90), FA-1's D_i is computed from O_i in shared
memory inside the step, and the deterministic dQ engine (:func:`mma_dq_engine`) works in the
forward's orientation (S = Q_i K_j^T, dP = dO_i V_j^T, dQ_i += dS K_j with dS in registers).

**Pipeline.** Q_i, dO_i (FA-1: O_i) are double-buffered: the copies of the next step (``cp.async``)
are issued at the top of a step and land during its products; L and D of the next step are
read into registers there and stored at the end. The walk over Q tiles and query heads is one
flat loop of steps, so the pipeline does not drain between heads. Two barriers per step:
the top one (this step's tiles visible, everyone done with the other buffers and dS^T), and the
one between storing dS^T and reading it (FA-1 one more, for D_i).

**Masks.** Rows past Nq and rows that see no key (lse = -inf) get L = +inf (P = 0) and D = 0;
Q, dO, K, V rows past the end are zero-filled by the copies. Keys hidden by the causal mask
(bottom-right) or past Nk get P = dS = 0, tested only in tiles that need it (block-uniform).
S is not pre-scaled (Q stays 16-bit): P = exp2(S scale log2 e - L log2 e), and dK = scale
dS^T Q, dQ = scale dS K are scaled when written.

**tf32x3** (float32 inputs; measured on the H200, docs/performance-log.md "Backward in tf32x3"):
the same kernels on float32 tiles (16 bytes of row padding). S^T, dP^T are the forward's tf32x3
``score_tile`` and dV_j, dK_j updates its ``pv_tile`` (m16n8k8: every operand split into TF32
big + small, products big*big + small*big + big*small; P^T and dS^T the A operand from the
accumulators with each 8-query step's columns permuted, t <-> 2t, t + 4 <-> 2t + 1; each step's
product summed from zero and added in float32); dS^T goes to shared memory as float32 and dQ's
A operand is read from it as scalars (``dq_tile_tf32x3``). No ``ldmatrix`` A fragments kept in
registers (two per element would crowd out dK_j, dV_j). Tiles: ``tile_table.backward_tc_tiles``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from numba_flash._cuda import cuda, float32
from numba_flash.arch import SMEM_OPTIN_LIMIT
from numba_flash.kernels import mma
from numba_flash.kernels.jit import LOG2E, NEG_INF, device_jit, shared_tile, shared_tile_pair
from numba_flash.kernels import mask, score_mods
from numba_flash.kernels.tc_ops import tc_ops
from numba_flash.kernels.mask import window_of

KINDS = ("f16", "bf16", "tf32x3")  # 16-bit inputs, or float32 with split-precision TF32 products
HALF_KINDS = ("f16", "bf16")
KERNELS = ("fa2", "fa1", "dq")  # the K/V kernels of each loop order, and the deterministic dQ kernel
BLOCK_CHOICES = (16, 32, 64, 128)
POS_INF = math.inf  # L of a row that sees no key (or past Nq): P = exp2(S - inf) = 0
A_IN_REGS_MAX_DIM = 64  # padded head dims up to which a warp keeps its own rows' fragments in registers
# Above this padded head dim the K/V kernels split dK_j, dV_j's columns between two warps per 16
# keys (``TcBwdLayout.col_split``): one warp's dK_j, dV_j at D = 256 are 256 float32 registers
# (offline, ptxas sm_90: 944-2248 bytes of spill at every tile without the split).
COL_SPLIT_ABOVE_DIM = 128
MAX_THREADS = 256  # a block's threads at up to 255 registers each within an SM's 64K


@dataclass(frozen=True)
class TcBwdLayout:
    """Sizes of one tensor-core backward kernel; shared memory is one dynamic ``uint16`` buffer
    carved into tiles (offsets multiples of 8 elements: 16-byte aligned for ``cp.async`` and
    ``ldmatrix``), rows padded by 16 bytes so that the eight rows of an ``ldmatrix`` fall in
    distinct banks; L and D (float32) are a static array beside it."""

    kernel: str  # one of KERNELS
    kind: str  # "f16", "bf16" (16-bit tiles) or "tf32x3" (float32 tiles)
    head_dim: int  # the kernel head dim (a multiple of 8: ``tc_ops.kernel_head_dim``)
    block_m: int  # queries of a Q tile
    block_n: int  # keys of a K/V tile

    @property
    def col_split(self) -> int:
        """Warps per 16 keys in the K/V kernels: 1, or 2 above ``COL_SPLIT_ABOVE_DIM``, where
        the two warps of each 16 keys both compute its S^T, dP^T, P^T and dS^T (the MMAs of two
        of the five products twice) and each keeps and writes half of dK_j's and dV_j's columns
        (``tc_ops``' ``col_split``), FlashAttention-2's D = 256 answer too (its sm80 backward
        splits dK, dV over 2 x 4 warps)."""
        return 2 if self.kernel != "dq" and self.padded_dim > COL_SPLIT_ABOVE_DIM else 1

    @property
    def shared_scores(self) -> bool:
        """In a 16-bit column split with Q tiles of 32 queries or more, the two warps of each 16
        keys split S^T and dP^T by queries instead of both computing all of them, and exchange
        P^T and dS^T through shared memory (FlashAttention-2's way: its P and dS go through
        shared memory): each warp then makes the five products once (at D = 256, 64 x 64: 320
        MMAs a warp and step instead of 448), for one more tile of shared memory (P^T)."""
        return self.col_split > 1 and self.kind in HALF_KINDS and self.block_m >= 32

    @property
    def warps(self) -> int:  # 16 rows a warp: keys (K/V kernels, col_split warps each) or queries (dQ kernel)
        return self.block_m // 16 if self.kernel == "dq" else self.block_n // 16 * self.col_split

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def elem_bytes(self) -> int:  # 2 (16-bit kinds) or 4 (tf32x3: float32 tiles)
        return 2 if self.kind in HALF_KINDS else 4

    @property
    def padded_dim(self) -> int:  # the k-step of the products along D is 16
        return -(-self.head_dim // 16) * 16

    @property
    def stride(self) -> int:  # elements of a shared row of Q, dO, O, K, V (16 bytes of padding)
        return self.padded_dim + 16 // self.elem_bytes

    @property
    def ds_stride(self) -> int:
        """Elements of a shared row of dS^T (keys x queries), 16 bytes of padding: tf32x3's
        scalar loads of dS (rows 2t, 2t + 1 of the permuted keys, column g) then fall in
        distinct banks (stride = 4 mod 32 words)."""
        return self.block_m + 16 // self.elem_bytes

    @property
    def a_in_regs(self) -> bool:
        """Does a warp keep the A fragments of its own rows in registers for the whole walk?
        The dQ kernel (Q_i, dO_i) up to D = 64 (16 + 16 registers); above, and in the K/V
        kernels (K_j, V_j) always, they are read by ``ldmatrix`` at every product (one per
        16-wide step of D, against ``block_m / 16`` for the B operand): the registers go to
        dK_j, dV_j (ptxas for sm_90, offline: with K_j, V_j in registers the D = 64 FA-2
        kernel spilled at 255 registers; without, 235 and none)."""
        return self.kernel == "dq" and self.padded_dim <= A_IN_REGS_MAX_DIM and self.kind in HALF_KINDS

    def tiles(self) -> list[tuple[str, int]]:
        """(name, elements) of the shared tiles in order."""
        q_rows, kv_rows = self.block_m * self.stride, self.block_n * self.stride
        if self.kernel == "dq":  # K_j double-buffered: read first (S) and last (dQ)
            return [("q", q_rows), ("do", q_rows), ("k0", kv_rows), ("k1", kv_rows), ("v", kv_rows)]
        out = [("k", kv_rows), ("v", kv_rows), ("q0", q_rows), ("q1", q_rows), ("do0", q_rows), ("do1", q_rows)]
        if self.kernel == "fa1":
            out += [("o0", q_rows), ("o1", q_rows)]
        if self.shared_scores:
            out += [("pt", self.block_n * self.ds_stride)]
        return out + [("ds", self.block_n * self.ds_stride)]

    def offset(self, name: str) -> int:
        at = 0
        for n, size in self.tiles():
            if n == name:
                return at
            at += size
        raise KeyError(name)

    def elems(self, name: str) -> int:
        return dict(self.tiles())[name]

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of one block (16-bit or float32 elements)."""
        return self.elem_bytes * sum(size for _, size in self.tiles())

    @property
    def stat_floats(self) -> int:
        """Static float32 shared memory: L and D of two steps (the K/V kernels); the dQ kernel
        keeps its rows' L and D in registers."""
        return 1 if self.kernel == "dq" else 4 * self.block_m


def tc_bwd_layout(kernel: str, kind: str, head_dim: int, block_m: int, block_n: int) -> TcBwdLayout:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {list(KERNELS)}; got {kernel!r}")
    if kind not in KINDS:
        raise ValueError(f"the tensor-core backward's kind must be one of {list(KINDS)}; got {kind!r}")
    return TcBwdLayout(kernel, kind, int(head_dim), int(block_m), int(block_n))


def dq_kernel_tiles(block_m: int, block_n: int, kind: str = "f16", head_dim: int = 0) -> tuple[int, int]:
    """(block_m, block_n) of the deterministic dQ kernel for the K/V kernels' tiles: the same Q
    tile, K/V tiles of at most 64 keys (its S and dP hold ``block_n / 2`` floats per thread
    each; at 128 keys and D = 64 it spilled 100 bytes, offline). tf32x3: 32 keys, and 64
    queries for the default 16-query tiles (one warp a block otherwise), at most 64 (ptxas for
    sm_90, 64 x 32: 172 / 255 registers at D = 64 / 128, no spills, no local memory; with 64
    keys its dQ accumulator went to local memory at D = 128); above D = 128 (``head_dim``, the
    kernel's), 32 x 32: 64 x 32's float32 tiles need 233 KiB at D = 256)."""
    if kind not in HALF_KINDS:
        if head_dim > COL_SPLIT_ABOVE_DIM:
            return 32, 32
        return (64 if block_m <= 16 else min(block_m, 64)), 32
    return block_m, min(block_n, 64)


def check_tc_bwd_tiles(kind: str, head_dim: int, block_m: int, block_n: int, kernels=KERNELS) -> None:
    """``ValueError`` naming the argument when the backward ``kernels`` cannot run these tiles."""
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if isinstance(value, bool) or value not in BLOCK_CHOICES:
            raise ValueError(f"{name}={value!r}: the tensor-core backward needs one of {list(BLOCK_CHOICES)}")
    for kernel in kernels:
        tiles = dq_kernel_tiles(block_m, block_n, kind, head_dim) if kernel == "dq" else (block_m, block_n)
        layout = tc_bwd_layout(kernel, kind, head_dim, *tiles)
        threads = layout.threads
        if threads > MAX_THREADS:  # (no register cap: ~230-255 registers a thread)
            raise ValueError(f"block_m={block_m}, block_n={block_n} at head_dim={head_dim}: the {kernel} kernel needs "
                             f"{threads} threads, more than the {MAX_THREADS} whose registers fit an SM (above D = "
                             f"{COL_SPLIT_ABOVE_DIM} each 16 keys take two warps: block_n at most 64)")
        need = layout.smem_bytes
        if need > SMEM_OPTIN_LIMIT:
            raise ValueError(f"block_m={block_m}, block_n={block_n} at head_dim={head_dim}: the {kernel} kernel needs "
                             f"{need} bytes of shared memory, more than the {SMEM_OPTIN_LIMIT} a block can have")


# ------------------------------------------------------------------------------------------
# Device functions shared by the kernels
# ------------------------------------------------------------------------------------------


def _tile_ops(kind: str, head_dim: int, block_m: int, block_n: int, col_split: int = 1):
    """``tc_ops`` of one specialisation; tf32x3 without the forward's pre-split operands (the
    backward's tiles hold plain float32 rows: ``pv_tile`` and ``score_tile`` split as they read).
    ``col_split``: ``TcBwdLayout.col_split``."""
    if kind in HALF_KINDS:
        return tc_ops(kind, head_dim, block_m, block_n, col_split=col_split)
    return tc_ops(kind, head_dim, block_m, block_n, presplit="", col_split=col_split)


@device_jit
def _identity(x):
    return x


def _value(kind: str):
    """Element of an input tile -> float32: the 16-bit conversions, or float32 as it is."""
    return mma.VALUE_16[kind] if kind in HALF_KINDS else _identity


def _bits(kind: str):
    """float32 -> an output element: 16-bit patterns, or float32 as it is."""
    return mma.BITS_16[kind] if kind in HALF_KINDS else _identity


def vector_reductions(compute_capability) -> bool:
    """Can a GPU of this compute capability run ``red.global.add.v2.f32``? (sm_90 and later;
    ``None``: the simulator, whose reduction is two atomics anyway.)"""
    return compute_capability is None or tuple(compute_capability) >= (9, 0)


@functools.lru_cache(maxsize=None)
def _products(kind: str, head_dim: int, warp_rows_tile: int, n_cols: int, a_in_regs: bool, col_split: int = 1,
              split_b: bool = False):
    """``(load_frags, ab_t)`` for a block whose warps own 16 rows each of an A tile:

    - ``load_frags(a_s, af)``: the A fragments of this warp's rows, one per 16-wide step of D
      (``af`` is ``(D_pad / 16, 4)`` when ``a_in_regs``, else unused);
    - ``ab_t(af, a_s, b_s, acc, scratch)``: ``acc = A_w B^T`` over the first ``n_cols`` rows of
      the B tile (``n_cols / 8`` accumulator tiles): the forward's S = Q_i K_j^T, with A from
      registers or, when not ``a_in_regs``, by one ``ldmatrix`` per 16-wide step of D.
    ``warp_rows_tile``: rows of the A tile (only for the tile ops' layout); ``col_split``: warps
    per 16 rows (``TcBwdLayout.col_split``): they compute the same product, or with ``split_b``
    (``TcBwdLayout.shared_scores``; 16-bit) each its part of the B rows (``n_cols / col_split``).

    tf32x3 (float32 tiles): ``ab_t`` is the forward's ``score_tile`` (m16n8k8, each operand
    split into TF32 big and small as it is read, three products, the small terms summed apart
    and added at the end); ``load_frags`` does nothing (``af`` unused: two fragments per
    element would crowd out dK_j, dV_j)."""
    if kind not in HALF_KINDS:
        return _products_tf32x3(kind, head_dim, warp_rows_tile, n_cols, col_split)
    ops = tc_ops(kind, head_dim, warp_rows_tile, n_cols, col_split=col_split)
    L = ops.layout
    S, KT, NC = L.stride, L.padded_dim // 16, n_cols // 8 // (col_split if split_b else 1)
    SPLIT_B = bool(split_b)
    MMA = mma.MMA_16[kind]
    A_REGS = bool(a_in_regs)

    @device_jit
    def load_frags(a_s, af):
        if A_REGS:
            r0 = ops.warp_row0()
            for kt in range(KT):
                a = mma.ldsm_x4(a_s, r0, 16 * kt, S)
                for e in range(4):
                    af[kt, e] = a[e]

    @device_jit
    def ab_t(af, a_s, b_s, acc, scratch):
        for nt in range(NC):
            for e in range(4):
                acc[nt, e] = float32(0.0)
        r0 = ops.warp_row0()
        b0 = ops.key_warp() * (8 * NC) if SPLIT_B else 0  # this warp's part of the B rows
        for kt in range(KT):
            if A_REGS:
                a0, a1, a2, a3 = af[kt, 0], af[kt, 1], af[kt, 2], af[kt, 3]
            else:
                a0, a1, a2, a3 = mma.ldsm_x4(a_s, r0, 16 * kt, S)
            for nt2 in range(NC // 2):  # 16 B rows: two 8-column tiles per ldmatrix.x4
                bb = mma.ldsm_x4(b_s, b0 + 16 * nt2, 16 * kt, S)
                MMA(acc, 2 * nt2, a0, a1, a2, a3, bb[0], bb[2], scratch)
                MMA(acc, 2 * nt2 + 1, a0, a1, a2, a3, bb[1], bb[3], scratch)

    return load_frags, ab_t


@functools.lru_cache(maxsize=None)
def _products_tf32x3(kind: str, head_dim: int, warp_rows_tile: int, n_cols: int, col_split: int = 1):
    ops = _tile_ops(kind, head_dim, warp_rows_tile, n_cols, col_split)

    @device_jit
    def load_frags(a_s, af):
        pass

    @device_jit
    def ab_t(af, a_s, b_s, acc, scratch):
        af_big = cuda.local.array((1, 4), mma.uint32)
        af_small = cuda.local.array((1, 4), mma.uint32)
        ops.score_tile(af_big, af_small, a_s, b_s, acc, scratch)

    return load_frags, ab_t


@functools.lru_cache(maxsize=None)
def _row_loader(head_dim: int, rows: int, threads: int, elem_bytes: int = 2):
    """``load(x, b, h, first, n_valid, x_s)``: rows ``first ..`` of ``x[b, h]`` (16-bit, D =
    ``head_dim`` a multiple of 8; ``elem_bytes=4``: float32, D a multiple of 4) -> ``x_s`` (``rows`` x D_pad, row stride D_pad + 8) by 16-byte
    ``cp.async`` copies, consecutive threads on consecutive chunks of a row; rows at or past
    ``n_valid`` and columns past D zero-filled. ``tc_ops``' loader, with the chunk's row and
    column by shift and mask when a row has a power-of-two number of chunks (D = 64: 8,
    D = 128: 16): the loop-invariant index arithmetic of the copies is then cheap enough for
    ptxas to recompute instead of keeping (or spilling) it across the step. The caller commits."""
    D, NT = head_dim, threads
    DP = -(-D // 16) * 16
    CH = 16 // elem_bytes  # elements of one 16-byte copy
    CSHIFT = CH.bit_length() - 1
    S, CPR = DP + CH, DP // CH
    COPY = mma.cp_async16 if elem_bytes == 2 else mma.cp_async16_f32
    COPIES = -(-rows * CPR // NT)
    EXACT = rows * CPR % NT == 0
    POW2 = CPR & (CPR - 1) == 0
    SHIFT = CPR.bit_length() - 1
    FULL = DP == D  # no padded columns to zero-fill

    @device_jit
    def load(x, b, h, first, n_valid, x_s):
        tid = cuda.threadIdx.x
        last = n_valid - 1
        for n in range(COPIES):
            c = tid + NT * n
            if EXACT or c < rows * CPR:
                if POW2:
                    r = c >> SHIFT
                    d = (c & (CPR - 1)) << CSHIFT
                else:
                    r = c // CPR
                    d = (c - r * CPR) * CH
                row = first + r
                if FULL:
                    COPY(x_s, r * S + d, x, b, h, min(row, last), d, row < n_valid)
                else:  # an invalid copy reads nothing, but its source address must be in bounds
                    COPY(x_s, r * S + d, x, b, h, min(row, last), min(d, D - CH), row < n_valid and d < D)

    return load


@functools.lru_cache(maxsize=None)
def mma_bwd_engine(order: str, kind: str, head_dim: int, block_m: int, block_n: int, vector_red: bool = True,
                   user_mods=None):
    """The tensor-core backward engine (``kernels.backward``'s interface) of the K/V kernel of
    ``order``: warps of 16 keys computing the transposed scores (module doc), Q_i, dO_i (O_i)
    double-buffered by ``cp.async``, L and D of two steps in a static float32 array, P^T and dS^T
    in registers, dQ through dS^T in shared memory. ``vector_red``: FA-2's dQ atomics as
    ``red.global.add.v2.f32`` (sm_90 and later; else two float32 atomics: :func:`vector_reductions`)."""

    if order not in ("fa1", "fa2"):
        raise ValueError(f"order must be 'fa1' or 'fa2'; got {order!r}")
    lay = tc_bwd_layout(order, kind, head_dim, block_m, block_n)
    FA1, VECTOR_RED = order == "fa1", bool(vector_red)
    # a score's P and dS with the forward's modifications (16-bit: tanh.approx; a user's mods)
    p_and_ds = score_mods.backward_probs(kind in HALF_KINDS, user_mods, True)
    D, BM, BN = head_dim, block_m, block_n
    # The forward's tile ops with the roles swapped: their "Q tile" rows are keys (one warp per
    # 16: warp_row0, thread_row), their "K/V tile" rows queries, so pv_tile(P^T, dO_i) is
    # dV_j += P^T dO_i. (The copies are this module's _row_loader.)
    CS = lay.col_split  # warps per 16 keys, each on DP / CS columns of dK_j, dV_j
    COLS = CS > 1
    SHARED_P = lay.shared_scores  # ... and each on BM / CS queries of S^T, dP^T, with P^T, dS^T in shared memory
    ops = _tile_ops(kind, D, BN, BM, CS)
    SIXTEEN = kind in HALF_KINDS
    ELEM = mma.uint16 if SIXTEEN else float32
    S, DSS, DP = lay.stride, lay.ds_stride, lay.padded_dim
    NQ, DT, KT = BM // 8, DP // 8, DP // 16
    NQW = NQ // CS if SHARED_P else NQ  # 8-query tiles of this warp's S^T, dP^T
    DTO = ops.out_tiles  # 8-wide column tiles of this warp's dK_j, dV_j (DT, or its part in a column split)
    KN, QG, WARPS, NT = BN // 16, BM // 16, lay.warps, lay.threads
    SR = -(-BM // NT)  # rows of L, D each thread reads for the next step
    A_REGS = lay.a_in_regs
    AF_ROWS = KT if A_REGS else 1
    load_frags, scores_t = _products(kind, D, BN, BM, A_REGS, CS, SHARED_P)
    if SIXTEEN:
        MMA, PACK = mma.MMA_16[kind], mma.PACK_16[kind]
    BITS, VALUE = _bits(kind), _value(kind)
    STATS = lay.stat_floats
    MMA_SCRATCH = mma.scratch_floats(NT)
    load_kv_rows, load_q_rows = _row_loader(D, BN, NT, lay.elem_bytes), _row_loader(D, BM, NT, lay.elem_bytes)
    GROUPS_PER_WARP = max(1, QG // WARPS)  # dQ: 16-query groups per warp
    SPLIT = max(1, WARPS // QG)  # dQ: warps sharing a group (they split its 16-column chunks of D)
    CHUNKS_PER_WARP = -(-(DT // 2) // SPLIT)

    @device_jit
    def key_bounds(col0, n_q, n_k, window, first_q, last_q):
        """The queries ``[first_q[i], last_q[i]]`` that see each of this lane's keys (rows g,
        g + 8 of its warp; ``kernels.mask``; past Nk: none; ``last_q``: with a left edge only)."""
        for i in range(2):
            key = col0 + ops.thread_row(i)
            first_q[i] = mask.first_visible_query(key, n_q, n_k, window)
            if window[0] >= 0:
                last_q[i] = mask.last_visible_query(key, n_q, n_k, window)

    @device_jit
    def key_diagonals(col0, n_q, n_k, diags):
        """ALiBi: the query on the diagonal of each of this lane's keys (``key - (Nk - Nq)``)."""
        for i in range(2):
            diags[i] = col0 + ops.thread_row(i) - (n_k - n_q)

    @device_jit
    def read_stats(lse, dvec, b, h, row0, n_q, nxt):
        """L (log2 units; +inf past Nq and for rows that see no key) and D of the rows this
        thread stores, into registers (``nxt``), for the next step."""
        for u in range(SR):
            r = cuda.threadIdx.x + NT * u
            row = row0 + r
            l2 = float32(POS_INF)
            dd = float32(0.0)
            if r < BM and row < n_q:
                x = lse[b, h, row]
                if x != NEG_INF:
                    l2 = x * float32(LOG2E)
                if not FA1:
                    dd = dvec[b, h, row]
            nxt[u, 0] = l2
            nxt[u, 1] = dd

    @device_jit
    def write_stats(stats, base, nxt):
        for u in range(SR):
            r = cuda.threadIdx.x + NT * u
            if r < BM:
                stats[base + r] = nxt[u, 0]
                if not FA1:
                    stats[base + BM + r] = nxt[u, 1]

    @device_jit
    def rowdot(do_s, o_s, stats, base):
        """Alg. 4 line 19: D_i = rowsum(dO_i * O_i) from shared memory (padded columns and
        rows past Nq are zero), float32."""
        for r in range(cuda.threadIdx.x, BM, NT):
            acc = float32(0.0)
            for d in range(DP):
                acc += VALUE(do_s[r * S + d]) * VALUE(o_s[r * S + d])
            stats[base + BM + r] = acc

    @device_jit
    def load_step(q, do, o, b, h, row0, n_q, q_s, do_s, o_s):
        """Q_i, dO_i (FA-1: O_i) of one step -> shared memory, asynchronously (the caller commits)."""
        load_q_rows(q, b, h, row0, n_q, q_s)
        load_q_rows(do, b, h, row0, n_q, do_s)
        if FA1:
            load_q_rows(o, b, h, row0, n_q, o_s)

    @device_jit
    def probs_t(s, dp, stats, base, q_scale, masked, first_q, last_q, window, capped, cap, biased, slope, diags, row0,
                pt_s, ds_s, user):
        """In place: S^T -> P^T = exp2(S^T scale log2 e - L) (FA-2 line 11, Alg. 4 line 13),
        dP^T -> dS^T = P^T (dP^T - D) (FA-2 line 14, Alg. 4 line 20); L and D of each column
        (query) from shared memory; hidden entries P = dS = 0."""
        t = ops.lane_t()
        q0 = ops.key_warp() * (8 * NQW) if SHARED_P else 0  # this warp's first query (column)
        for nt in range(NQW):
            for e in range(4):
                c = q0 + 8 * nt + 2 * t + (e & 1)  # the query (column) of this accumulator
                # (diags: the query on each key row's diagonal; user: (b, h, col0, Nq, Nk, args))
                p, ds = p_and_ds(s[nt, e] * q_scale, stats[base + c], dp[nt, e], stats[base + BM + c], capped, cap, biased,
                                 slope, diags[e >> 1], ops.thread_row(e >> 1), row0 + c, user)
                if masked and mask.query_hidden(row0 + c, first_q[e >> 1], last_q[e >> 1], window):
                    p = float32(0.0)
                    ds = float32(0.0)
                s[nt, e] = p
                dp[nt, e] = ds
        if SHARED_P:  # P^T, dS^T to shared memory (the caller's barrier makes them visible)
            store_t(s, pt_s, q0)
            store_t(dp, ds_s, q0)

    @device_jit
    def dq_write(dq_h, acc, qg, dt2, row0, n_q, scale):
        """dQ_i rows 16 qg .. of this warp's 16-column chunk ``dt2`` += scale acc (FA-1: read,
        add, write back; FA-2: atomics)."""
        g, t = (cuda.threadIdx.x & 31) >> 2, cuda.threadIdx.x & 3
        for n in range(2):
            d = 16 * dt2 + 8 * n + 2 * t  # even; D % 4 == 0, so d + 1 < D when d < D
            if d < D:
                for i in range(2):
                    row = row0 + 16 * qg + g + 8 * i
                    if row < n_q:
                        x0 = acc[n, 2 * i] * scale
                        x1 = acc[n, 2 * i + 1] * scale
                        if FA1:
                            dq_h[row, d] += x0
                            dq_h[row, d + 1] += x1
                        elif VECTOR_RED:
                            mma.red_add_f32x2(dq_h, row, d, x0, x1)
                        else:
                            cuda.atomic.add(dq_h, (row, d), x0)
                            cuda.atomic.add(dq_h, (row, d + 1), x1)

    @device_jit
    def store_ds_t_f32(ds, ds_s):
        """tf32x3: dS^T (this warp's 16 keys x block_m queries) -> shared memory as float32 (in a
        column split by the first of its keys' warps)."""
        if COLS and ops.key_warp() != 0:
            return
        r = ops.thread_row(0)
        t2 = 2 * ops.lane_t()
        for nt in range(NQ):
            i0 = r * DSS + 8 * nt + t2
            ds_s[i0] = ds[nt, 0]
            ds_s[i0 + 1] = ds[nt, 1]
            ds_s[i0 + 8 * DSS] = ds[nt, 2]
            ds_s[i0 + 8 * DSS + 1] = ds[nt, 3]

    @device_jit
    def dq_tile_tf32x3(ds_s, k_s, dq, b, h, row0, n_q, scale, scratch):
        """tf32x3 ``dq_tile``: the same work split (16-query groups x 16-column chunks of D),
        m16n8k8 products over 8 keys at a time with the keys of each step permuted as in
        ``tc_ops.pv_tile`` (A column t <-> key 2t, t + 4 <-> key 2t + 1): A = dS, read as
        scalars from dS^T (rows 2t, 2t + 1, columns g, g + 8: conflict-free with the ds_stride
        padding), B = K_j (rows 2t, 2t + 1, column g), every operand split into TF32 big and
        small, three products. The chunk's dS K_j is summed from zero over this tile's keys and
        added to dQ in float32 (the forward's per-tile accumulation, version 8c)."""
        lane = cuda.threadIdx.x & 31
        g, t = lane >> 2, lane & 3
        w = cuda.threadIdx.x >> 5
        dq_h = dq[b, h]
        acc = cuda.local.array((2, 4), float32)
        for m in range(GROUPS_PER_WARP):
            qg = w % QG + WARPS * m
            part = w // QG
            for u in range(CHUNKS_PER_WARP):
                dt2 = min(part + SPLIT * u, DT // 2 - 1)
                for n in range(2):
                    for e in range(4):
                        acc[n, e] = float32(0.0)
                kk = 0
                while kk < BN // 8:  # not range(): fully unrolled, ptxas hoisted the loads of every step and spilled
                    ia = (8 * kk + 2 * t) * DSS + 16 * qg + g
                    ab0, as0 = mma.split_tf32(ds_s[ia])  # (query g, key 2t)
                    ab1, as1 = mma.split_tf32(ds_s[ia + 8])  # (g + 8, 2t)
                    ab2, as2 = mma.split_tf32(ds_s[ia + DSS])  # (g, 2t + 1)
                    ab3, as3 = mma.split_tf32(ds_s[ia + DSS + 8])  # (g + 8, 2t + 1)
                    for n in range(2):
                        ib = (8 * kk + 2 * t) * S + 16 * dt2 + 8 * n + g
                        bb0, bs0 = mma.split_tf32(k_s[ib])
                        bb1, bs1 = mma.split_tf32(k_s[ib + S])
                        mma.mma_tf32(acc, n, ab0, ab1, ab2, ab3, bb0, bb1, scratch)
                        mma.mma_tf32(acc, n, as0, as1, as2, as3, bb0, bb1, scratch)
                        mma.mma_tf32(acc, n, ab0, ab1, ab2, ab3, bs0, bs1, scratch)
                    kk += 1
                if part + SPLIT * u < DT // 2:
                    dq_write(dq_h, acc, qg, dt2, row0, n_q, scale)

    @device_jit
    def store_t(x, x_s, q0):
        """This warp's ``NQW`` 8-query tiles of P^T or dS^T (its 16 keys x queries ``q0 ..``)
        -> shared memory as 16-bit pairs (keys x queries, row stride ``ds_stride``)."""
        r = ops.thread_row(0)
        t2 = q0 + 2 * ops.lane_t()
        for nt in range(NQW):
            mma.st_shared_u32(x_s, r * DSS + 8 * nt + t2, PACK(x[nt, 0], x[nt, 1]))
            mma.st_shared_u32(x_s, (r + 8) * DSS + 8 * nt + t2, PACK(x[nt, 2], x[nt, 3]))

    @device_jit
    def store_ds_t(ds, ds_s):
        """dS^T (this warp's 16 keys x block_m queries) -> shared memory as 16-bit pairs (in a
        column split by the first of its keys' warps: the other holds the same values)."""
        if COLS and ops.key_warp() != 0:
            return
        store_t(ds, ds_s, 0)

    @device_jit
    def pv_shared(a_s, x_s, acc, scratch):
        """``tc_ops.pv_tile`` with the A operand (P^T or dS^T: this warp's 16 keys x block_m
        queries) read from shared memory by ``ldmatrix``, for the shared-scores split: dV_j +=
        P^T dO_i, dK_j += dS^T Q_i on this warp's part of the columns (``tc_ops``' ``pv_step``)."""
        r0 = ops.warp_row0()
        c0 = ops.out_col0()
        for kk in range(NQ // 2):  # 16 queries per product
            a0, a1, a2, a3 = mma.ldsm_x4(a_s, r0, 16 * kk, DSS)
            ops.pv_step(a0, a1, a2, a3, x_s, kk, c0, acc, scratch)

    @device_jit
    def dq_tile(ds_s, k_s, dq, b, h, row0, n_q, scale, scratch):
        """dQ_i += scale dS K_j (FA-2 line 15 by atomics; Alg. 4 line 21 read and written back),
        16 columns of D at a time (8 accumulators): A = dS from dS^T by ldmatrix.trans, B = K_j
        by ldmatrix.trans. The work: 16-query groups x 16-column chunks of D; with at least as
        many groups as warps, warp w takes groups w, w + warps, .. whole; with fewer, the warps
        of a group split its chunks (a chunk past D, when they do not divide evenly, is
        computed on a clamped chunk and not written: every warp makes the same products)."""
        lane = cuda.threadIdx.x & 31
        g, t = lane >> 2, lane & 3
        w = cuda.threadIdx.x >> 5
        dq_h = dq[b, h]  # (Nq, D): two indices per element instead of four
        acc = cuda.local.array((2, 4), float32)
        for m in range(GROUPS_PER_WARP):
            qg = w % QG + WARPS * m
            part = w // QG  # 0 unless the warps of a group split its chunks
            for u in range(CHUNKS_PER_WARP):
                dt2 = min(part + SPLIT * u, DT // 2 - 1)
                for n in range(2):
                    for e in range(4):
                        acc[n, e] = float32(0.0)
                for kk in range(KN):
                    # dS's fragments again for every chunk: kept across D they made the kernels spill
                    a = mma.ldsm_x4_a_trans(ds_s, 16 * kk, 16 * qg, DSS)
                    kb = mma.ldsm_x4_trans(k_s, 16 * kk, 16 * dt2, S)
                    MMA(acc, 0, a[0], a[1], a[2], a[3], kb[0], kb[1], scratch)
                    MMA(acc, 1, a[0], a[1], a[2], a[3], kb[2], kb[3], scratch)
                if part + SPLIT * u < DT // 2:
                    for n in range(2):
                        d = 16 * dt2 + 8 * n + 2 * t  # even; D % 8 == 0, so d + 1 < D when d < D
                        if d < D:
                            for i in range(2):
                                row = row0 + 16 * qg + g + 8 * i
                                if row < n_q:
                                    x0 = acc[n, 2 * i] * scale
                                    x1 = acc[n, 2 * i + 1] * scale
                                    if FA1:  # Alg. 4 line 21: this block is alone on its head
                                        dq_h[row, d] += x0
                                        dq_h[row, d + 1] += x1
                                    elif VECTOR_RED:  # FA-2 line 15: other K/V tiles' blocks add to dQ_i too
                                        mma.red_add_f32x2(dq_h, row, d, x0, x1)
                                    else:
                                        cuda.atomic.add(dq_h, (row, d), x0)
                                        cuda.atomic.add(dq_h, (row, d + 1), x1)

    @device_jit
    def write_grad(x, b, h, col0, n_k, acc, factor):
        """This lane's rows (keys g, g + 8 of its warp) of dK_j or dV_j, times ``factor``, as
        16-bit values into ``x[b, h]`` (keys below Nk, the first ``x.shape[3]`` columns; in a
        column split, this warp's part of them)."""
        n_out = x.shape[3]
        t2 = 2 * ops.lane_t() + ops.out_col0()
        for i in range(2):
            row = col0 + ops.thread_row(i)
            if row < n_k:
                for dt in range(DTO):
                    for e in range(2):
                        d = 8 * dt + t2 + e
                        if d < n_out:
                            x[b, h, row, d] = BITS(acc[dt, 2 * i + e] * factor)

    STORE_DS_T, DQ_TILE = (store_ds_t, dq_tile) if SIXTEEN else (store_ds_t_f32, dq_tile_tf32x3)
    # tf32x3: this step's Q_i, dO_i (O_i) views selected on the offset (``shared_tile_pair``), so
    # that pv_tile's scalar reads of them stay LDS (a select of two views made them generic LD)
    Q_PAIR, DO_PAIR = (shared_tile_pair(lay.offset(a), lay.offset(b), lay.elems(a)) for a, b in (("q0", "q1"), ("do0", "do1")))
    O_PAIR = shared_tile_pair(lay.offset("o0"), lay.offset("o1"), lay.elems("o0")) if FA1 else Q_PAIR

    @device_jit
    def load_kv(k, v, b, hk, col0, n_k, k_s, v_s):
        load_kv_rows(k, b, hk, col0, n_k, k_s)
        load_kv_rows(v, b, hk, col0, n_k, v_s)

    @device_jit
    def step_inputs(q, do, o, lse, dvec, b, h, row0, n_q, q_scale, q_s, do_s, o_s, stats):
        pass  # (prefetching: load_step, read_stats, write_stats)

    @device_jit
    def kv_frags(k_s, v_s, kf, vf):
        load_frags(k_s, kf)
        load_frags(v_s, vf)

    @device_jit
    def dv_update(s, pt_s, do_s, acc, scratch):
        if SHARED_P:
            pv_shared(pt_s, do_s, acc, scratch)
        else:
            ops.pv_tile(s, do_s, acc, scratch)  # P^T never leaves the registers

    @device_jit
    def dk_update(dp, ds_s, q_s, acc, scratch):
        if SHARED_P:
            pv_shared(ds_s, q_s, acc, scratch)
        else:
            ops.pv_tile(dp, q_s, acc, scratch)

    @device_jit
    def dq_update(dp, ds_s, k_s, dq, b, h, row0, n_q, scale, dq_acc, scratch):
        if not SHARED_P:  # (shared scores: dS^T is in shared memory, visible since the barrier after probs_t)
            STORE_DS_T(dp, ds_s)
            cuda.syncthreads()  # dS^T of every warp is in shared memory
        DQ_TILE(ds_s, k_s, dq, b, h, row0, n_q, scale, scratch)

    @device_jit
    def dk_factor(scale):
        return scale  # dK_j = scale dS^T Q_i (Q_i unscaled)

    engine = score_mods.user_engine(f"numba_flash.kernels.mma_bwd_engine_{order}_{kind}_d{D}_m{BM}_n{BN}_red{int(VECTOR_RED)}", user_mods)
    for name, func in dict(load_kv=load_kv, step_inputs=step_inputs, load_step=load_step, read_stats=read_stats,
                           write_stats=write_stats, commit=ops.commit, wait_all=ops.wait_all, kv_frags=kv_frags,
                           rowdot=rowdot, scores_t=scores_t, probs_t=probs_t, dv_update=dv_update, dk_update=dk_update,
                           dq_update=dq_update, key_bounds=key_bounds, key_diagonals=key_diagonals, zero=ops.zero, write_grad=write_grad,
                           dk_factor=dk_factor).items():
        setattr(engine, name, func)
    engine.order, engine.block_m, engine.block_n, engine.layout, engine.ELEM = order, BM, BN, lay, ELEM
    engine.PREFETCH, engine.PAIRED, engine.P_IN_SMEM, engine.STATS_STATIC = True, not SIXTEEN, SHARED_P, STATS
    engine.s_shape, engine.acc_shape, engine.dq_shape = (NQW, 4), (DTO, 4), (1, 1)
    engine.af_shape, engine.nxt_shape, engine.first_q_rows, engine.scratch_floats = (AF_ROWS, 4), (SR, 2), 2, MMA_SCRATCH
    tile = {n: shared_tile(lay.offset(n), lay.elems(n)) for n, _ in lay.tiles()}
    engine.k_tile, engine.v_tile = tile["k"], tile["v"]
    engine.q_tiles, engine.do_tiles = (tile["q0"], tile["q1"]), (tile["do0"], tile["do1"])
    engine.o_tiles = (tile["o0"], tile["o1"]) if FA1 else engine.q_tiles
    engine.p_tile = tile["pt"] if SHARED_P else tile["ds"]  # (P^T stays in registers but with shared scores)
    engine.ds_tile = tile["ds"]
    engine.stats_tile = tile["ds"]  # (L, D: the static array)
    engine.q_pair, engine.do_pair = Q_PAIR, DO_PAIR
    engine.o_pair = O_PAIR
    return engine


def tc_bwd_kernel(order: str, kind: str, head_dim: int, block_m: int, block_n: int, window,
                  compute_dq: bool = True, vector_red: bool = True, softcap: bool = False, alibi: bool = False,
                  user_mods=None, varlen: bool = False):
    """The dK/dV (and dQ) kernel of one loop order on tensor cores: ``kernels.backward.kv_kernel``
    on :func:`mma_bwd_engine` (memoised there).

    Launch: ``"fa2"``: ``grid = (ceil(Nk / block_n) * B * Hkv,)``; ``"fa1"``: ``grid = (B * Hkv,)``;
    ``block = (layout.threads,)``, dynamic shared memory ``layout.smem_bytes`` (``layout =
    tc_bwd_layout(order, kind, head_dim, block_m, block_n)``). Arguments: ``q, o, do (B,H,Nq,D)``
    and ``k, v (B,Hkv,Nk,D)`` as uint16 bit patterns (D = ``head_dim``, rows 16-byte aligned),
    ``lse (B,H,Nq) float32``, ``dvec (B,H,Nq) float32`` (D_i; read by ``"fa2"``; FA-1 computes
    it from O_i), ``dq (B,H,Nq,D) float32`` zeroed and accumulated into (untouched when not
    ``compute_dq``), ``dk, dv (B,Hkv,Nk,D')`` uint16 bit patterns out (``D' <= D`` columns
    written), ``scale`` (float32), ``softcap_log2`` (float32; read with ``softcap``). ``vector_red``: FA-2's
    dQ atomics as ``red.global.add.v2.f32``
    (sm_90 and later; else two float32 atomics: :func:`vector_reductions`). ``varlen``: a packed
    batch (``kernels.backward.kv_kernel``).
    """
    from numba_flash.kernels.backward import kv_kernel

    engine = mma_bwd_engine(order, kind, int(head_dim), int(block_m), int(block_n), bool(vector_red), user_mods)
    return kv_kernel(engine, window_of(window), bool(compute_dq), bool(softcap), bool(alibi), bool(varlen))


@functools.lru_cache(maxsize=None)
def mma_dq_engine(kind: str, head_dim: int, block_m: int, block_n: int, user_mods=None):
    """The tensor-core engine of the deterministic dQ kernel (``kernels.backward.dq_kernel``'s
    interface): warps of 16 query rows (the forward's orientation); S = Q_i K_j^T, dP = dO_i V_j^T
    with A = Q_i, dO_i fragments (in registers when D <= 64); P and dS in registers with L and D
    of the lane's two rows; dQ_i += dS K_j with dS the A operand straight from the accumulators
    (the forward's P~ V), float32 in registers for the whole walk. K_j is double-buffered (read by
    the first product and the last): K_{j+1} is in flight during step j, V_{j+1} from the end of
    its products."""

    p_and_ds = score_mods.backward_probs(kind in HALF_KINDS, user_mods, False)  # 16-bit: tanh.approx

    lay = tc_bwd_layout("dq", kind, head_dim, block_m, block_n)
    D, BM, BN = head_dim, block_m, block_n
    ops = _tile_ops(kind, D, BM, BN)
    ELEM = mma.uint16 if kind in HALF_KINDS else float32
    NS, DT, KT = BN // 8, lay.padded_dim // 8, lay.padded_dim // 16
    A_REGS = lay.a_in_regs
    AF_ROWS = KT if A_REGS else 1
    load_frags, scores = _products(kind, D, BM, BN, A_REGS)

    @device_jit
    def row_stats(lse, dvec, b, h, row0, n_q, l2, dd):
        for i in range(2):  # L, D of this lane's rows g, g + 8 (L = +inf: P = 0)
            row = row0 + ops.thread_row(i)
            l2[i] = float32(POS_INF)
            dd[i] = float32(0.0)
            if row < n_q:
                x = lse[b, h, row]
                if x != NEG_INF:
                    l2[i] = x * float32(LOG2E)
                dd[i] = dvec[b, h, row]

    @device_jit
    def start(q, do, k, v, lse, dvec, b, h, hk, row0, n_q, n_k, q_scale, col_first, n_walk, q_s, do_s, k_s, v_s, stats,
              l2, dd):
        ops.load_q_tile(q, b, h, row0, n_q, q_s)
        ops.load_q_tile(do, b, h, row0, n_q, do_s)
        if n_walk > 0:  # the walk's first K_j, V_j
            ops.load_kv_tile(k, b, hk, col_first, n_k, k_s)
            ops.load_kv_tile(v, b, hk, col_first, n_k, v_s)
        ops.commit()

    @device_jit
    def before_scores(k, v, b, hk, col0, col_next, j, n_walk, n_k, k0_s, k1_s, v_s, q_s, do_s, qf, dof):
        ops.wait_all()  # K_j, V_j (and Q_i, dO_i) have landed
        cuda.syncthreads()  # ... for everyone; everyone is done with K_{j-1}
        if j == 0:
            load_frags(q_s, qf)
            load_frags(do_s, dof)
        if j + 1 < n_walk:  # K_{j+1} into the other buffer, in flight during this step
            if (j & 1) == 0:
                ops.load_kv_tile(k, b, hk, col_next, n_k, k1_s)
            else:
                ops.load_kv_tile(k, b, hk, col_next, n_k, k0_s)
            ops.commit()

    @device_jit
    def after_scores(v, b, hk, col0, col_next, j, n_walk, n_k, v_s):
        cuda.syncthreads()  # everyone is done reading V_j
        if j + 1 < n_walk:
            ops.load_kv_tile(v, b, hk, col_next, n_k, v_s)  # V_{j+1}, in flight during dS and dQ
            ops.commit()

    @device_jit
    def dscores(s, dp, stats, l2, dd, q_scale, masked, first_keys, last_keys, window, capped, cap, biased, slope, diags,
                col0, ds_s, user):
        for nt in range(NS):  # P = exp2(S scale log2 e - L), dS = P (dP - D), in place
            for e in range(4):
                # (diags: each query row's diagonal key; user: (b, h, row0, Nq, Nk, args))
                _, ds = p_and_ds(s[nt, e] * q_scale, l2[e >> 1], dp[nt, e], dd[e >> 1], capped, cap, biased, slope,
                                 diags[e >> 1], ops.thread_row(e >> 1), col0 + ops.col_of(nt, e), user)
                if masked and mask.key_hidden(col0 + ops.col_of(nt, e), first_keys[e >> 1], last_keys[e >> 1], window):
                    ds = float32(0.0)
                dp[nt, e] = ds

    @device_jit
    def dq_step(dp, ds_s, k_s, acc, scratch):
        ops.pv_tile(dp, k_s, acc, scratch)

    @device_jit
    def write_dq(dq, b, h, row0, n_q, acc, scale):
        t2 = 2 * ops.lane_t()
        for i in range(2):
            row = row0 + ops.thread_row(i)
            if row < n_q:
                for dt in range(DT):
                    for e in range(2):
                        d = 8 * dt + t2 + e
                        if d < D:
                            dq[b, h, row, d] = acc[dt, 2 * i + e] * scale

    engine = score_mods.user_engine(f"numba_flash.kernels.mma_dq_engine_{kind}_d{D}_m{BM}_n{BN}", user_mods)
    for name, func in dict(row_stats=row_stats, start=start, before_scores=before_scores, scores=scores,
                           after_scores=after_scores, dscores=dscores, dq_step=dq_step, write_dq=write_dq,
                           row_key_bounds=ops.row_key_bounds, row_alibi=ops.row_alibi, zero=ops.zero,
                           wait_all=ops.wait_all).items():
        setattr(engine, name, func)
    engine.block_m, engine.block_n, engine.layout, engine.ELEM = BM, BN, lay, ELEM
    engine.DOUBLE_K, engine.DS_IN_SMEM = True, False
    engine.s_shape, engine.acc_shape, engine.af_shape = (NS, 4), (DT, 4), (AF_ROWS, 4)
    engine.stat_rows, engine.scratch_floats = 2, mma.scratch_floats(lay.threads)
    tile = {n: shared_tile(lay.offset(n), lay.elems(n)) for n, _ in lay.tiles()}
    engine.q_tile, engine.do_tile, engine.k_tiles, engine.v_tile = tile["q"], tile["do"], (tile["k0"], tile["k1"]), tile["v"]
    engine.ds_tile = engine.stats_tile = tile["q"]  # (dS, L and D stay in registers)
    return engine


def tc_bwd_dq_kernel(kind: str, head_dim: int, block_m: int, block_n: int, window, softcap: bool = False,
                     alibi: bool = False, user_mods=None, varlen: bool = False):
    """dQ without atomics on tensor cores (``deterministic=True``): ``kernels.backward.dq_kernel``
    on :func:`mma_dq_engine` (memoised there).

    Launch: ``grid = (ceil(Nq / block_m) * B * H,)``, ``block = (layout.threads,)``, dynamic
    shared memory ``layout.smem_bytes``. Arguments: ``q, do (B,H,Nq,D)``, ``k, v (B,Hkv,Nk,D)``
    uint16 bit patterns, ``lse, dvec (B,H,Nq) float32``, ``dq (B,H,Nq,D) float32`` out,
    ``scale`` (float32), ``softcap_log2`` (float32; read with ``softcap``), ``alibi`` ((B, H) float32
    slopes times log2(e); read with ``alibi``); ``varlen``: a packed batch (``kernels.backward.dq_kernel``).
    """
    from numba_flash.kernels.backward import dq_kernel

    return dq_kernel(mma_dq_engine(kind, int(head_dim), int(block_m), int(block_n), user_mods), window_of(window),
                     bool(softcap), bool(alibi), bool(varlen))
