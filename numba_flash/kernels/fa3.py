"""FlashAttention-3's forward (Shah et al. 2024, Algorithms 1 and 2) on Hopper: the third loop design.

FA-2's loop order (outer Q, inner K/V, accumulators on chip) with Hopper's machinery, one thread
block per Q tile of ``block_m = 64 x consumers`` rows and ``128 x (consumers + 1)`` threads:

- **Warp specialization** (FA-3 section 3.1, Algorithm 1): warpgroup 0 is the *producer*: it lowers
  its registers (``setmaxnreg.dec``, line 3) and one thread issues TMA copies -- Q_i once (line 4),
  then K_j and V_j into a ring of ``stages`` shared-memory slots (line 7), each waiting until the
  consumers have released the slot (line 6: the ``empty`` mbarrier) and counted in bytes on the
  slot's ``full`` mbarriers (one for K, one for V, so S = QK^T starts before V lands). Warpgroups
  1.. are *consumers* (line 10: ``setmaxnreg.inc``), 64 rows of the Q tile each.
- **The consumer's step** (Algorithm 1, lines 13-20): wait for K_j (line 13), S = Q_i K_j^T with
  ``wgmma`` from shared memory (SS, line 14), the online softmax in registers on the wgmma
  accumulator layout (m, l, rescale of O: lines 15-17; ``kernels.softmax``), P converted to
  16-bit A fragments *in registers*, wait for V_j, O += P V_j with ``wgmma`` reading A from
  registers (RS, line 18), release the slot (line 19). At the end O / l and the logsumexp (lines
  21-23).
- **Intra-warpgroup overlap** (``overlap=True``: section 3.2, Algorithm 2): the product of the next
  tile's S is issued, then the current P V, and the softmax of the next S runs while P V is in
  flight (its exponentials under the tensor cores' work); O is rescaled after P V completes.
- What the tiles see: ``kernels.mask`` (causal, windows, the tails: the K/V tiles walked, the
  tiles that need the element-wise mask, each row's first and last visible key), exactly as FA-2;
  the score modifications (softcap, ALiBi, a user's ``mask_mod`` / ``score_mod``) are
  ``kernels.score_mods``' routines on this kernel's register layout, and a ``mask_mod``'s block
  mask is walked as FA-2 walks it (``kernels.block_info``'s lists: the producer loads the listed
  K/V tiles only). TMA zero-fills rows past Nq and Nk and columns past D (so any head dim up to
  the kernel's runs); a packed batch (``varlen``) has a tensor map per sequence, so the zeros
  start at each sequence's end.

One source for the GPU and the simulator: every Hopper instruction is a ``kernels.hopper``
primitive with a Python twin.
"""

from __future__ import annotations

import math

from numba_flash._cuda import cuda, float32  # first: chooses the world before numba.cuda loads

from numba import int32, uint8, uint32  # noqa: E402

from numba_flash._world import simulated
from numba_flash.kernels import hopper, score_mods
from numba_flash.kernels.poly_exp2 import exp2_poly
from numba_flash.kernels.block_info import (list_row, listed_partial, listed_range, listed_tile, sequence_span,
                                           split_tiles)
from numba_flash.kernels.jit import LN2, NEG_INF, device_jit, kernel_factory, kernel_jit
from numba_flash.kernels.mask import first_visible_key, kv_tile_range, last_visible_key, tile_masker, tile_needs_mask
from numba_flash.kernels.row_reduce import add
from numba_flash.kernels.softmax import exp2_diff, finite_or_zero, max_moves, nan_max, reciprocal_or_zero

WARPGROUP = 128


class Fa3Layout:
    """Where things live in the block's shared memory (byte offsets from the 1024-aligned base):
    the Q tile (``head_dim / 64`` boxes of ``block_m`` rows x 128 bytes), ``stages`` slots of K and
    V (boxes of ``block_n`` rows; e4m3: V^T, boxes of ``D`` rows of :func:`value_row_bytes` keys),
    then the mbarriers (8 bytes each): Q's, and per slot K's and V's full (the producer's TMA bytes
    landed) and K's and V's empty (every consumer thread is done with them)."""

    def __init__(self, head_dim: int, block_m: int, block_n: int, stages: int, elem_bytes: int = 2):
        self.head_dim, self.block_m, self.block_n, self.stages = head_dim, block_m, block_n, stages
        self.boxes = head_dim * elem_bytes // hopper.BOX_BYTES
        self.q_bytes = block_m * head_dim * elem_bytes
        self.kv_bytes = block_n * head_dim * elem_bytes  # fp8: V's slot holds V^T (D rows of block_n keys)
        self.q_at = 0
        self.k_at = self.q_bytes  # slot s: k_at + 2 s kv_bytes; V right after K
        self.bars_at = self.q_bytes + 2 * stages * self.kv_bytes
        self.sink_at = self.bars_at + 8 * (1 + 4 * stages)  # a word per thread: the ordered wait's store
        self.tile_bytes = self.sink_at + 4 * 128 * (block_m // 64 + 1)

    @property
    def smem_bytes(self) -> int:
        return hopper.smem_bytes(self.tile_bytes)


def value_row_bytes(block_n: int) -> int:
    """fp8: the bytes (keys) of a row of V^T's TMA boxes and ``wgmma`` operand for ``block_n``-key
    tiles: the widest swizzle (128, 64 or 32 bytes) whose rows tile ``block_n`` (FA-3's 128 x 224 tile
    at D = 128 takes 32-byte rows, as CUTLASS's operand selector picks for it)."""
    return next(row for row in (128, 64, 32) if block_n % row == 0)


def check_fa3_tiles(head_dim: int, block_m: int, block_n: int, stages: int, kind: str = "f16") -> None:
    """ValueError unless the kernel can be built for these tiles (``kind``: "f16", "bf16", "e4m3")."""
    if head_dim not in (64, 128, 256):
        raise ValueError(f"fa3 kernels are built for head dims 64, 128, 256; got {head_dim}")
    if kind == "e4m3" and (head_dim == 64 or block_n % 32):
        raise ValueError(f"fa3 in float8: head dims 128 or 256 (128-byte rows) and block_n a multiple of 32 "
                         f"(the e4m3 product's K, whole swizzled rows of V^T); got D={head_dim}, block_n={block_n}")
    if block_m % 64 or not 64 <= block_m <= 192:
        raise ValueError(f"fa3: block_m must be 64, 128 or 192 (64 rows per consumer warpgroup); got {block_m}")
    if block_n % 16 or not 16 <= block_n <= 256:
        raise ValueError(f"fa3: block_n must be a multiple of 16 from 16 to 256; got {block_n}")
    if block_m == 192 and (block_n > 192 or head_dim > 128):
        # 512 threads: ptxas fits each wgmma in the launch's 128 registers a thread (not setmaxnreg's
        # 160), with S (block_n / 2) and O (D / 2) accumulators live: 192 x 208 at D 64, 192 x 224 at
        # D 128 and any 192-row tile at D 256 stop it ("Insufficient registers"; offline, ptxas 13.5)
        raise ValueError(f"fa3: 192-row tiles (three consumer warpgroups, 128 registers a thread at launch) "
                         f"take block_n <= 192 and head dims <= 128; got block_n={block_n} at D={head_dim}")
    if stages < 1:
        raise ValueError(f"fa3: stages must be at least 1; got {stages}")
    layout = Fa3Layout(head_dim, block_m, block_n, stages, hopper.element_bytes(kind))
    from numba_flash.arch import SMEM_OPTIN_LIMIT as MAX_DYNAMIC_SMEM

    if layout.smem_bytes > MAX_DYNAMIC_SMEM:
        raise ValueError(f"fa3: {block_m}x{block_n} tiles at D={head_dim} with {stages} stages need "
                         f"{layout.smem_bytes} bytes of shared memory (at most {MAX_DYNAMIC_SMEM})")


@kernel_factory
def fa3_kernel(head_dim: int, block_m: int, block_n: int, stages: int, window, kind: str, overlap: bool = True,
               pingpong: bool = True, registers=(24, 240), softcap: bool = False, alibi: bool = False,
               user_mods=None, varlen: bool = False, poly_exp2: int = 0, split: bool = False,
               rescale_threshold: float = 0.0, tma_store: bool = False):
    """The FA-3 forward kernel for one configuration (all compile-time):
    ``kernel(q, k, v, o, lse, tmap_q, tmap_k, tmap_v, tmap_o, scale_log2, n_q, n_k, group, q_descale, k_descale,
    v_descale, softcap_log2, alibi, seqlens[, mod_args[, walk_counts, walk_lists]])``.

    q (B, H, Nq, Dq), k and v (B, Hkv, Nk, Dq), Dq <= D: 16-bit bit patterns (``kind`` "f16" or
    "bf16"), read only through TMA (the tensor maps; the simulator reads the arrays: columns past Dq
    read as zeros); o (B, H, Nq, D / 2) uint32, pairs of 16-bit values (``tma_store``: below); lse (B, H, Nq) float32; ``scale_log2`` = scale * log2(e) (> 0); ``group`` = H / Hkv.
    Grid (Q tiles, H, B), the Q tiles longest-first under a right bound (causal).

    ``kind`` "e4m3" (FA-3 section 3.3, fp8): q and k e4m3 bytes; ``v`` is V^T, (B, Hkv, Dq, Nk'),
    its keys permuted within each 32 (``numba_flash.fp8.value_order``) so that P's accumulator
    registers are the A operand of the e4m3 ``wgmma`` as they stand (8-bit operands are K-major
    only); ``q_descale``, ``k_descale``, ``v_descale``: (B, Hkv) float32 descaling factors (FA-3's;
    unread for 16-bit kinds); P~ is exp2(x - m + 8), in [0, 256] (FA-3's
    offset: e4m3's range), the 2^8 cancelling in O / l and taken out of the logsumexp; o bfloat16 pairs.

    The ablation's factors (``numba-flash ablate --fa3``): ``overlap`` (section 3.2: S_j's softmax
    under P_{j-1} V_{j-1}), ``pingpong`` (section 3.1: the consumer warpgroups take turns issuing
    their products, so one's softmax runs under the other's GEMMs; needs two or more),
    ``registers`` (setmaxnreg's (producer, consumer) registers; ``None``: no reallocation).
    ``poly_exp2`` (0-8): that many eighths of P~'s exponentials computed by a cubic on the FMA
    units (``kernels.poly_exp2``, FlashAttention-4's emulation) instead of the MUFU. Measured on
    the H200 it is slower at every share (performance log 22): the MUFU is not this kernel's bound.

    Score modifications (API.md 2c; ``kernels.score_mods``, as the other engines take them):
    ``softcap`` (the cap in log2 units is the argument ``softcap_log2``), ``alibi`` (the argument
    ``alibi``: (B, H) slopes in log2 units), ``user_mods`` (a ``score_mods.UserMods``: a user's
    ``mask_mod`` / ``score_mod``, their arrays the tuple ``mod_args``; block-sparse, the walk visits
    the tiles of a block mask's lists ``walk_counts`` / ``walk_lists`` (``kernels.block_info``),
    the producer and the consumers reading the same entries, and ``mask_mod`` runs on the partial
    ones only). With softcap, ALiBi or a ``score_mod`` the tile is scaled first, then modified,
    then masked; without (a ``mask_mod`` alone only hides entries), the scale stays folded into the
    row max and the exponentials' FFMA (not one instruction more).

    ``rescale_threshold`` (log2 units, 0 to 8; FlashAttention-4's conditional rescaling): a row's
    running max m moves only when a tile's row max exceeds it by more than this, so most tiles
    subtract a max up to that stale and leave O and l unscaled (the 64 multiplications of O between
    P V's completion and the next product's issue skipped by every thread whose rows did not
    move). P~ <= 2^threshold then (16-bit: in range; e4m3: FA-3's offset of 8 shrinks to 8 -
    threshold); O / l and the logsumexp are unchanged, the (m, l, O~) state being consistent for
    any reference max. 0: the papers' every-tile rescale.

    ``tma_store`` (16-bit, unsplit; FA-3's epilogue): each consumer warpgroup writes its 64 rows of O
    into its rows of the Q tile's boxes in shared memory (Q is read by then), swizzled as TMA reads
    them, and one of its threads stores them with TMA through ``tmap_o`` (boxes of 64 rows; rows
    past Nq and columns past the caller's head dim are not written, so ``o`` is the caller's
    (B, H, Nq, Dq) 16-bit array itself, read by the simulator's twin only). Without it ``tmap_o``
    is not read and every thread stores its pairs of O.

    ``split`` (split-KV, API.md 2b: ``num_splits``): the grid's z is ``S * B`` (split ``s`` of batch ``b``
    at ``s * B + b``); a Q tile's walk (its visible K/V tiles, or its block-mask list) is cut into
    ``S`` contiguous ranges (``kernels.block_info.split_tiles``), and each block writes its range's
    *partial* result, O normalised over its keys as float32 into ``o (S*B, H, Nq, D)`` and its
    logsumexp into ``lse (S*B, H, Nq)`` (an empty range: O = 0, lse = -inf), which
    ``kernels.combine`` merges.

    ``varlen`` (API.md 2d, a packed batch): q, k, v, o and lse are ``(1, heads, total, ...)`` views,
    ``seqlens`` the int32 ``(2, B + 1)`` prefix sums (``kernels.block_info.sequence_span``), the grid
    (Q tiles of the longest sequence, H, B), and the tensor maps ``(B, 16)``: sequence ``b``'s own
    map describes its rows only, so TMA reads zeros past its end, never the next sequence's keys
    and values (no value of another sequence, NaN or not, reaches its P V). Without ``varlen``
    ``seqlens`` is not read."""
    check_fa3_tiles(head_dim, block_m, block_n, stages, kind)
    if not 0.0 <= rescale_threshold <= 8.0:
        raise ValueError(f"fa3: rescale_threshold is in log2 units, 0 to 8; got {rescale_threshold}")
    TAU = float(rescale_threshold)
    if not 0 <= poly_exp2 <= 8:
        raise ValueError(f"fa3: poly_exp2 counts eighths of the exponentials, 0 to 8; got {poly_exp2}")
    POLY = int(poly_exp2)
    FP8 = kind == "e4m3"
    ELEM = hopper.element_bytes(kind)
    L = Fa3Layout(head_dim, block_m, block_n, stages, ELEM)
    CONSUMERS = block_m // 64
    BOXES, D = L.boxes, head_dim
    BOX_ELEMS = hopper.BOX_BYTES // ELEM  # columns of a 128-byte box
    Q_BOX, KV_BOX = block_m * 128, block_n * 128  # bytes of one box
    VT_ROW = value_row_bytes(block_n) if FP8 else hopper.BOX_BYTES  # fp8: keys in a row of V^T's boxes
    VT_MODE = hopper.SWIZZLE_MODES[VT_ROW]
    VT_BOX = head_dim * VT_ROW  # fp8: bytes of one of V^T's boxes (D rows of VT_ROW keys)
    V_BOX, V_BOXES = (VT_BOX, block_n // VT_ROW) if FP8 else (KV_BOX, BOXES)  # V's slot, as TMA fills it
    SWIZZLE_128B = hopper.SWIZZLE_MODES[hopper.BOX_BYTES]
    S_STEPS = D * ELEM // hopper.K_BYTES  # wgmma products along D
    PV_STEPS = block_n * ELEM // hopper.K_BYTES  # and along the keys
    S_N, O_N, P_WORDS = block_n // 2, head_dim // 2, block_n * ELEM // 8
    # FA-3's fp8 softmax: P~ = exp2(x - m + 8), in e4m3's range [0, 448]; with a stale max (TAU) 8 - TAU
    P_OFFSET = 8.0 - TAU if FP8 else 0.0
    S_SHAPE = (block_n // 8, 4)
    BARS, Q_BYTES, KV_BYTES, KV_AT, SINK = L.bars_at, L.q_bytes, L.kv_bytes, L.k_at, L.sink_at
    RELEASES = WARPGROUP * CONSUMERS  # a slot's K or V is free when every consumer thread says so
    SOFTCAP, ALIBI, USER, VARLEN = bool(softcap), bool(alibi), user_mods is not None, bool(varlen)
    SPLIT = bool(split)
    TMA_STORE = bool(tma_store)
    if TMA_STORE and (FP8 or SPLIT):
        raise ValueError("fa3: tma_store writes 16-bit O over the Q tile (not fp8's bfloat16 O, not split partials)")
    if SPLIT and VARLEN:
        raise ValueError("fa3: a packed batch (varlen) runs unsplit")
    SPARSE = USER and user_mods.block_sparse
    MODDED = SOFTCAP or ALIBI or USER
    SCORE_MOD = USER and user_mods.score_mod is not None
    # ALiBi without a cap or score_mod: the bias divided by the scale is added to the unscaled tile,
    # the scale stays folded into the exponentials. On a thread's tile whose keys lie on one side of
    # its rows' diagonals (every causal tile) the bias less a row constant, one FFMA a score (the row
    # constant, its "shift", joins the row max and the exponentials' bias); across a diagonal the
    # whole bias (one FADD and one FFMA a score)
    ALIBI_FOLDED = ALIBI and not SOFTCAP and not SCORE_MOD
    # the tile is scaled before the max where a mod acts on scaled scores (a mask_mod alone only
    # hides entries: the scale stays folded into the exponentials, as without mods)
    PRESCALED = SOFTCAP or (ALIBI and not ALIBI_FOLDED) or SCORE_MOD
    # the cap alone (FA-3's way): the tile holds tanh(S scale / cap), and the softmax multiplies by
    # the cap where it multiplied by the scale (one FMUL and one tanh more per score)
    CAP_FOLDED = SOFTCAP and not ALIBI and not SCORE_MOD
    # a right bound (or a block mask: a causal one, say): later Q tiles walk more K/V tiles; start them first
    REVERSED = window[1] >= 0 or SPARSE
    REALLOCATE = registers is not None
    PRODUCER_REGS, CONSUMER_REGS = registers if REALLOCATE else (0, 0)
    PINGPONG = pingpong and CONSUMERS > 1
    TURN = 2 * WARPGROUP  # a turn's barrier: the waiting warpgroup's sync and the previous one's arrive
    WINDOW = window
    qk = hopper.wgmma_ss(block_n, kind, 0)
    pv = hopper.wgmma_rs(head_dim, kind, 0 if FP8 else 1)  # fp8: V^T, K-major; 16-bit: V, N-major
    load_q = hopper.tma_box_loader(block_m, ELEM)
    load_kv = hopper.tma_box_loader(block_n, ELEM)
    load_v = hopper.tma_box_loader(head_dim, ELEM, VT_ROW) if FP8 else load_kv
    pack = hopper.pack_pair("bf16" if FP8 else kind)  # O's pairs: fp8 writes bfloat16
    store_o = hopper.tma_box_storer(64, ELEM)  # a consumer warpgroup's 64 rows of one box of O
    STORE_BAR = 1 + CONSUMERS  # named barriers STORE_BAR + c: warpgroup c's O is in shared memory (1..: turns)
    quad_max = hopper.quad_reduce(hopper.max_nan)
    quad_sum = hopper.quad_reduce(add)
    fence_s = hopper.register_fence(S_N)
    fence_o = hopper.register_fence(O_N)
    fence_p = hopper.register_fence(P_WORDS)
    fence_l = hopper.register_fence(2)
    SMEM_ALIGN = None if simulated() else hopper.TILE_ALIGN

    @device_jit
    def q_full(base):
        return base + BARS

    @device_jit
    def k_full(base, s):
        return base + BARS + 8 + 8 * s

    @device_jit
    def v_full(base, s):
        return base + BARS + 8 + 8 * stages + 8 * s

    @device_jit
    def k_empty(base, s):
        return base + BARS + 8 + 16 * stages + 8 * s

    @device_jit
    def v_empty(base, s):
        return base + BARS + 8 + 24 * stages + 8 * s

    @device_jit
    def k_slot(base, s):
        return base + KV_AT + 2 * KV_BYTES * s

    @device_jit
    def take_turn(smem, c):
        """Ping-pong: wait until the previous consumer warpgroup has issued its products."""
        if PINGPONG:
            hopper.named_barrier_sync(smem, 1 + c, TURN)

    @device_jit
    def pass_turn(smem, c, last):
        """Ping-pong: let the next consumer warpgroup issue (the last warpgroup's last turn is not
        passed: its first was given at the start, so every barrier completes as often as it is waited on)."""
        if PINGPONG:
            if not (last and c == CONSUMERS - 1):
                hopper.named_barrier_arrive(smem, 1 + (c + 1) % CONSUMERS, TURN)

    @device_jit
    def s_product(smem, base, s_acc, q_at, s):
        """S = Q_i K_j^T (Algorithm 1 line 14): D / 16 SS products from the slot's K (e4m3: D / 32)."""
        desc_q = hopper.descriptor(q_at, 16, hopper.SBO_128B, SWIZZLE_128B)
        desc_k = hopper.descriptor(k_slot(base, s), 16, hopper.SBO_128B, SWIZZLE_128B)
        for ks in range(S_STEPS):  # (each step's descriptors: the first's, moved by a constant)
            box, kk = ks // 4, ks % 4
            qk(smem, s_acc, hopper.descriptor_at(desc_q, box * Q_BOX + kk * 32),
               hopper.descriptor_at(desc_k, box * KV_BOX + kk * 32), ks)

    @device_jit
    def pv_product(smem, base, o_acc, p, s):
        """O += P V_j (line 18): block_n / 16 RS products, P from registers, V N-major (fp8:
        block_n / 32 products, V^T K-major, 32 keys a 32-byte step along its boxes' rows)."""
        desc_v = v_descriptor(k_slot(base, s) + KV_BYTES)
        for kk in range(PV_STEPS):
            pv(smem, o_acc, p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3],
               hopper.descriptor_at(desc_v, v_step(kk)), 1)

    @device_jit
    def v_descriptor(v_at):
        """The B operand of the first P V product: 16 rows of V (N-major: 64-column boxes ``KV_BOX``
        apart), or e4m3's 32 keys of V^T (K-major: rows of ``VT_ROW`` keys, 8-row groups 8 rows apart)."""
        if FP8:
            return hopper.descriptor(v_at, 16, 8 * VT_ROW, VT_MODE)
        return hopper.descriptor(v_at, KV_BOX, hopper.SBO_128B, SWIZZLE_128B)

    @device_jit
    def v_step(kk):
        """Bytes from the first P V product's B operand to the ``kk``-th's: 16 rows of V, or e4m3's 32
        keys of V^T (a 32-byte step along a box's rows, then the next box)."""
        if FP8:
            return (kk * 32 // VT_ROW) * VT_BOX + (kk * 32) % VT_ROW
        return kk * 16 * 128

    def issued_step(full, empty, product, fence):
        """``step(smem, base, acc, operand, it, c, last)``: one product of the ``it``-th K/V tile,
        issued on its own and waited for, between the slot's ``full`` and ``empty`` mbarriers: S =
        Q K^T (Algorithm 1 lines 13-14, Algorithm 2's first step) or O += P V (line 18, Algorithm 2's
        last step) and the slot's release (line 19)."""

        @device_jit
        def step(smem, base, acc, operand, it, c, last):
            s = it % stages
            hopper.mbarrier_wait(smem, full(base, s), (it // stages) & 1)
            take_turn(smem, c)
            fence(acc)
            hopper.wgmma_fence()
            product(smem, base, acc, operand, s)
            hopper.wgmma_commit()
            pass_turn(smem, c, last)
            hopper.wgmma_wait(0)
            fence(acc)
            hopper.mbarrier_arrive(smem, empty(base, s))

        return step

    s_step = issued_step(k_full, k_empty, s_product, fence_s)
    pv_step = issued_step(v_full, v_empty, pv_product, fence_o)

    def key_offset(j, e):
        """Entry (j, e) of a thread's S tile holds key 8 j + 2 t + (e & 1) past the tile's start
        (``col0 + 2 t`` is passed as the tile's first key), of row ``e >> 1`` (row, row + 8)."""
        return 8 * j + (e & 1)

    key_of = device_jit(key_offset)

    @device_jit
    def row_of(j, e):
        return e >> 1

    mask_scores = tile_masker(block_n // 8, 4, key_of, row_of)  # kernels.mask's one masking routine

    @device_jit
    def row_maxima(smem, s_acc, tile_max, scale_log2, shifts):
        """rowmax(S) of the thread's two rows, over its quad, in log2 units (scale > 0); with ALiBi
        folded, of S plus each row's shift (``folded_alibi``)."""
        for r in range(2):
            x = float32(NEG_INF)
            for j in range(block_n // 8):
                x = hopper.max_nan(x, hopper.max_nan(s_acc[j, 2 * r], s_acc[j, 2 * r + 1]))
            if ALIBI_FOLDED:
                x += shifts[r]
            tile_max[r] = quad_max(smem, x) * scale_log2

    @device_jit
    def update_max(m, m_ref, alpha, tile_max):
        """Lines 15-16's running max: m_new, the max to subtract, and exp2(m_old - m_new), where
        ``kernels.softmax.max_moves`` says the max moves (``TAU``: ``rescale_threshold``); else
        it stays, alpha = 1. ``m_ref`` holds the last max taken (starts at 0: ``finite_or_zero(-inf)``)."""
        for r in range(2):
            m_new = nan_max(m[r], tile_max[r])
            alpha[r] = float32(1.0)
            if max_moves(m[r], m_new, float32(TAU)):
                ref = finite_or_zero(m_new)
                alpha[r] = exp2_diff(m[r], ref)
                m_ref[r] = ref
                m[r] = m_new

    @device_jit
    def exponentials(s_acc, m_ref, l_run, alpha, scale_log2, shifts):
        """P~ = exp2(S scale_log2 - m) in place (line 16); l = alpha l + this thread's rowsum(P~)
        (line 17; the quad's partial sums are added once, at the end). ``POLY`` eighths of the
        column groups take the cubic (``poly_exp2``), the rest ``ex2.approx``. With ALiBi folded the
        row's shift joins the bias: exp2((S + shift) scale_log2 - m)."""
        for r in range(2):
            part = float32(0.0)
            bias = m_ref[r] - float32(P_OFFSET)
            if ALIBI_FOLDED:
                bias -= shifts[r] * scale_log2
            for j in range(block_n // 8):
                for e in range(2):
                    x = s_acc[j, 2 * r + e] * scale_log2 - bias
                    if (j * POLY) % 8 < POLY:  # POLY eighths of the columns, spread: the FMA units' share
                        x = exp2_poly(x)
                    else:
                        x = math.exp2(x)
                    s_acc[j, 2 * r + e] = x
                    part += x
            l_run[r] = l_run[r] * alpha[r] + part

    @device_jit
    def rescale_o(o_acc, alpha):
        """diag(alpha) O (line 17); with ``TAU`` > 0 only where a row's max moved (FA-4's
        conditional rescaling: mostly nothing)."""
        if TAU == 0.0 or alpha[0] != float32(1.0) or alpha[1] != float32(1.0):
            for j in range(D // 8):
                for e in range(4):
                    o_acc[4 * j + e] *= alpha[e >> 1]

    @device_jit
    def to_fragments(s_acc, p):
        """P~ as the A fragments of the P V product. 16-bit: key columns 16kk..16kk+15 of the
        accumulator are exactly m16n8k16's A layout (the FA-2 trick, FA-3 section 3.1). e4m3: a
        register holds keys 4t..4t+3 of a 32-key step in m16n8k32's layout, where the accumulator
        gives the thread keys 2t, 2t+1, 8+2t, 9+2t; they are packed as they stand, and V^T's keys
        were put in that order on the host (FA-3 section 3.3's layout mismatch, solved without shuffles)."""
        if FP8:
            for kk in range(block_n // 32):
                j = 4 * kk
                p[4 * kk] = hopper.pack_e4m3(s_acc[j, 0], s_acc[j, 1], s_acc[j + 1, 0], s_acc[j + 1, 1])
                p[4 * kk + 1] = hopper.pack_e4m3(s_acc[j, 2], s_acc[j, 3], s_acc[j + 1, 2], s_acc[j + 1, 3])
                p[4 * kk + 2] = hopper.pack_e4m3(s_acc[j + 2, 0], s_acc[j + 2, 1], s_acc[j + 3, 0], s_acc[j + 3, 1])
                p[4 * kk + 3] = hopper.pack_e4m3(s_acc[j + 2, 2], s_acc[j + 2, 3], s_acc[j + 3, 2], s_acc[j + 3, 3])
        else:
            for j in range(block_n // 8):
                p[2 * j] = pack(s_acc[j, 0], s_acc[j, 1])
                p[2 * j + 1] = pack(s_acc[j, 2], s_acc[j, 3])

    @device_jit
    def thread_row(i):
        """A consumer thread's rows: ``row`` and ``row + 8`` (the accumulator layout)."""
        return 8 * i

    cap_scores = score_mods.tile_soft_capper(block_n // 8, 4, True)  # tanh.approx, as the 16-bit engines
    tanh = score_mods.fast_tanh
    alibi_scores = score_mods.tile_alibi(block_n // 8, 4, key_of, row_of)
    alibi_one_side = score_mods.tile_alibi_one_side(block_n // 8, 4, key_of)
    LAST_KEY = key_offset(block_n // 8 - 1, 1)  # a thread's last key of a tile, past its first

    @device_jit
    def folded_alibi(s_acc, keys0, slopes, diags, shifts):
        """ALiBi over the scale on the unscaled tile (``ALIBI_FOLDED``; ``keys0``: the thread's
        first key). Where the thread's keys lie left of both its rows' diagonals, or right of both,
        the bias less each row's shift (``score_mods.tile_alibi_one_side``; a right edge at the
        diagonal puts every visible key left: the keys right of it are masked after); across a
        diagonal the whole bias, shift 0."""
        left = WINDOW[1] == 0 or keys0 + LAST_KEY <= diags[0]
        if left or keys0 >= diags[1]:
            slope = slopes[0] if left else -slopes[0]  # (both rows': one head)
            alibi_one_side(s_acc, slope)
            for r in range(2):
                shifts[r] = slope * float32(keys0 - diags[r])
        else:
            alibi_scores(s_acc, keys0, slopes, diags)
            for r in range(2):
                shifts[r] = float32(0.0)

    scale_alibi_scores = score_mods.tile_alibi_scaled(block_n // 8, 4, key_of, row_of)
    row_alibi = score_mods.alibi_rows(2, thread_row)
    row_queries = score_mods.query_rows(2, thread_row) if USER else None
    user_scores = score_mods.tile_user_mods(block_n // 8, 4, key_of, row_of, user_mods) if USER else None

    @device_jit
    def modify_scores(s_acc, keys0, scale_log2, cap, slopes, diags, shifts, n_k, b, positions, heads, mod_args,
                      partial):
        """S in log2 units with API.md 2c's modifications, in its order: the scale, the soft cap,
        ALiBi's bias (alone: divided by the scale and added to the unscaled tile, ``ALIBI_FOLDED``;
        with a ``score_mod`` under a right edge at the diagonal: fused with the scale, linear there),
        a user's ``score_mod`` and ``mask_mod`` (``partial``: the tile's entries may be hidden; a
        ``mask_mod`` alone sees the scores unscaled, which it does not read)."""
        if CAP_FOLDED:  # tanh(S scale / cap); the cap multiplies it in the softmax
            k = scale_log2 / cap
            for j in range(block_n // 8):
                for e in range(4):
                    s_acc[j, e] = tanh(s_acc[j, e] * k)
        elif ALIBI_FOLDED:  # (slopes / scale: the softmax scales the biased tile)
            folded_alibi(s_acc, keys0, slopes, diags, shifts)
        elif ALIBI and not SOFTCAP and WINDOW[1] == 0:
            scale_alibi_scores(s_acc, scale_log2, keys0, slopes, diags)
        elif PRESCALED:
            for j in range(block_n // 8):
                for e in range(4):
                    s_acc[j, e] *= scale_log2
            if SOFTCAP:
                cap_scores(s_acc, cap)
            if ALIBI:
                alibi_scores(s_acc, keys0, slopes, diags)
        if USER:
            user_scores(s_acc, keys0, n_k, b, positions, heads, mod_args, partial)

    @device_jit
    def softmax_step(smem, s_acc, col0, needs_mask, t, first_keys, last_keys, m, m_ref, alpha, tile_max, l_run,
                     scale_log2, mods):
        """Lines 15-17 on a tile's S: the mods (``mods``: ``(cap, slopes, diags, shifts, n_k, b,
        positions, heads, mod_args, partial)``, read when the kernel has any), mask, row max, the
        running max, P~ and l."""
        scale = scale_log2
        if MODDED:
            modify_scores(s_acc, col0 + 2 * t, scale_log2, *mods)
        if CAP_FOLDED:
            scale = mods[0]  # (the cap in log2 units)
        elif PRESCALED:
            scale = float32(1.0)
        if needs_mask:
            mask_scores(s_acc, col0 + 2 * t, first_keys, last_keys, WINDOW)
        row_maxima(smem, s_acc, tile_max, scale, mods[3])
        update_max(m, m_ref, alpha, tile_max)
        exponentials(s_acc, m_ref, l_run, alpha, scale, mods[3])

    @device_jit
    def walked_tile(listed, first, it):
        """The K/V tile of the walk's step ``it``: ``first + it``, or block-sparse, the tile of the
        list's entry ``first + it``."""
        if SPARSE:
            return listed_tile(listed[first + it])
        return first + it

    @device_jit
    def walked_partial(listed, first, it):
        """Whether a user's ``mask_mod`` applies to step ``it``'s tile: always, but on a block
        mask's full tiles."""
        if SPARSE:
            return listed_partial(listed[first + it])
        return True

    FASTMATH = {"contract", "afn", "arcp"}

    @device_jit(fastmath=FASTMATH)  # (the kernel's flags: math.log2 of the lse is MUFU.LG2)
    def body(q, k, v, o, lse, tmap_q, tmap_k, tmap_v, tmap_o, scale_log2, n_q, n_k, group, q_descale, k_descale,
             v_descale, softcap_log2, alibi, seqlens, mod_args, walk_counts, walk_lists):
        """The kernel (one body for the signatures below: with user mods, their arrays' tuple; with
        a block mask, its tile lists too)."""
        smem = cuda.shared.array(0, dtype=uint8, alignment=SMEM_ALIGN)
        base = hopper.tile_base(smem)
        tid = cuda.threadIdx.x
        wg = tid // WARPGROUP
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        split, n_splits = 0, 1
        if SPLIT:  # block z: split s of batch b at s * B + b, where the partials go too
            n_batch = q.shape[0]
            split, b = b // n_batch, b % n_batch
            n_splits = cuda.gridDim.z // n_batch
        tile = cuda.blockIdx.x
        if REVERSED:
            tile = cuda.gridDim.x - 1 - tile
        m0 = tile * block_m
        if VARLEN:  # sequence b: its rows of every array and its own tensor maps; then batch 0 of them
            q0, q1, k0, k1 = sequence_span(seqlens, b)
            n_q = q1 - q0
            n_k = k1 - k0
            if m0 >= n_q:  # a Q tile past this sequence's end: no work (the whole block returns)
                return
            q, k, v, o, lse = q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], o[:, :, q0:q1], lse[:, :, q0:q1]
            map_q, map_k, map_v, map_o = tmap_q[b], tmap_k[b], tmap_v[b], tmap_o[b]
            if ALIBI:
                alibi = alibi[b : b + 1]
            b = 0
        else:
            map_q, map_k, map_v, map_o = tmap_q, tmap_k, tmap_v, tmap_o
        b_out = b + split * q.shape[0]  # (unsplit: b)
        hk = h // group
        if FP8:  # S = (q_descale q)(k_descale k)^T: the descales join the scale
            scale_log2 = scale_log2 * q_descale[b, hk] * k_descale[b, hk]
        # The K/V tiles this Q tile walks (FA-2 section 3.1.1: those some row sees)
        last_row = min(m0 + block_m, n_q) - 1
        first_key = first_visible_key(m0, n_q, n_k, WINDOW)
        last_key = last_visible_key(last_row, n_q, n_k, WINDOW)
        n_tiles = (n_k + block_n - 1) // block_n
        first, count = kv_tile_range(first_key, last_key, n_tiles, block_n, WINDOW)
        if SPARSE:  # [first, first + count) index the block mask's list: its tiles in the range above
            n_listed, listed = list_row(walk_counts, walk_lists, b, h, tile)
            lo, hi = 0, n_listed
            if WINDOW[0] >= 0 or WINDOW[1] >= 0:  # (a built-in mask: its range of the list, by bisection)
                lo, hi = listed_range(listed, n_listed, first, count)
            first, count = lo, hi - lo
        else:
            listed = walk_lists  # (not read)
        if SPLIT:  # this split's share of the walk
            lo, hi = split_tiles(count, n_splits, split)
            first, count = first + lo, hi - lo
        if tid == 0:
            hopper.mbarrier_init(smem, q_full(base), 1)
            for s in range(stages):
                hopper.mbarrier_init(smem, k_full(base, s), 1)
                hopper.mbarrier_init(smem, v_full(base, s), 1)
                hopper.mbarrier_init(smem, k_empty(base, s), RELEASES)
                hopper.mbarrier_init(smem, v_empty(base, s), RELEASES)
            hopper.fence_barrier_init()
        cuda.syncthreads()
        if wg == 0:  # the producer (Algorithm 1 lines 3-8)
            if REALLOCATE:
                hopper.setmaxnreg_dec(PRODUCER_REGS)
            if tid == 0:
                hopper.mbarrier_arrive_expect_tx(smem, q_full(base), Q_BYTES)
                for x in range(BOXES):
                    load_q(smem, base + x * Q_BOX, map_q, q, x * BOX_ELEMS, m0, h, b, q_full(base))
                for it in range(count):
                    s = it % stages
                    free = ((it // stages) & 1) ^ 1  # a fresh slot's previous phase counts as complete
                    n0 = walked_tile(listed, first, it) * block_n
                    k_at = k_slot(base, s)
                    hopper.mbarrier_wait(smem, k_empty(base, s), free)
                    hopper.mbarrier_arrive_expect_tx(smem, k_full(base, s), KV_BYTES)
                    for x in range(BOXES):
                        load_kv(smem, k_at + x * KV_BOX, map_k, k, x * BOX_ELEMS, n0, hk, b, k_full(base, s))
                    hopper.mbarrier_wait(smem, v_empty(base, s), free)
                    hopper.mbarrier_arrive_expect_tx(smem, v_full(base, s), KV_BYTES)
                    for x in range(V_BOXES):  # fp8: V^T's boxes of VT_ROW keys (columns), all D rows
                        load_v(smem, k_at + KV_BYTES + x * V_BOX, map_v, v, n0 + VT_ROW * x if FP8 else x * BOX_ELEMS,
                               0 if FP8 else n0, hk, b, v_full(base, s))
            return
        if REALLOCATE:
            hopper.setmaxnreg_inc(CONSUMER_REGS)
        c = wg - 1
        lane = tid % WARPGROUP
        w = lane // 32
        g = (lane % 32) // 4
        t = lane % 4
        row = m0 + 64 * c + 16 * w + g  # this thread's rows: row and row + 8
        first_keys = cuda.local.array(2, dtype=int32)
        last_keys = cuda.local.array(2, dtype=int32)
        for r in range(2):
            first_keys[r] = first_visible_key(row + 8 * r, n_q, n_k, WINDOW)
            last_keys[r] = last_visible_key(row + 8 * r, n_q, n_k, WINDOW)
        slopes = cuda.local.array(2, dtype=float32)  # ALiBi: each row's slope and diagonal key (score_mods)
        diags = cuda.local.array(2, dtype=int32)
        shifts = cuda.local.array(2, dtype=float32)  # ALiBi folded: each row's shift (folded_alibi)
        positions = cuda.local.array(2, dtype=int32)  # a user's mods: each row's query position and head
        heads = cuda.local.array(2, dtype=int32)
        if ALIBI:
            row_alibi(alibi, b, h, row, n_q, n_k, 1, slopes, diags)
            if ALIBI_FOLDED:
                for r in range(2):
                    slopes[r] = slopes[r] / scale_log2
        if USER:
            row_queries(h, row, n_q, 1, positions, heads)
        # Only the tiles a bound crosses take the element-wise mask (block-uniform test)
        first_row_last_key = last_visible_key(m0, n_q, n_k, WINDOW)
        last_row_first_key = first_visible_key(last_row, n_q, n_k, WINDOW)
        s_acc = cuda.local.array(S_SHAPE, dtype=float32)  # (8-key column tile, entry): the accumulator layout
        o_acc = cuda.local.array(O_N, dtype=float32)
        p = cuda.local.array(P_WORDS, dtype=uint32)
        m = cuda.local.array(2, dtype=float32)
        m_ref = cuda.local.array(2, dtype=float32)
        alpha = cuda.local.array(2, dtype=float32)
        tile_max = cuda.local.array(2, dtype=float32)
        l_run = cuda.local.array(2, dtype=float32)
        for i in range(O_N):
            o_acc[i] = float32(0.0)
        for r in range(2):
            m[r] = float32(NEG_INF)
            m_ref[r] = float32(0.0)
            l_run[r] = float32(0.0)
        q_at = base + 64 * c * 128  # this warpgroup's 64 rows of each Q box
        if PINGPONG and c == CONSUMERS - 1 and count > 0:
            hopper.named_barrier_arrive(smem, 1, TURN)  # the first turn is the first warpgroup's
        hopper.mbarrier_wait(smem, q_full(base), 0)
        if overlap and count > 0:  # FA-3 Algorithm 2: the softmax of S_j under the product P_{j-1} V_{j-1}
            s_step(smem, base, s_acc, q_at, 0, c, False)
            col0 = walked_tile(listed, first, 0) * block_n
            softmax_step(smem, s_acc, col0,
                         tile_needs_mask(col0, block_n, first_row_last_key, last_row_first_key, WINDOW),
                         t, first_keys, last_keys, m, m_ref, alpha, tile_max, l_run, scale_log2,
                         (softcap_log2, slopes, diags, shifts, n_k, b, positions, heads, mod_args,
                          walked_partial(listed, first, 0)))
            to_fragments(s_acc, p)
            for it in range(1, count):
                s = it % stages
                prev = (it - 1) % stages
                hopper.mbarrier_wait(smem, k_full(base, s), (it // stages) & 1)
                hopper.mbarrier_wait(smem, v_full(base, prev), ((it - 1) // stages) & 1)
                take_turn(smem, c)
                fence_s(s_acc)
                hopper.wgmma_fence()
                s_product(smem, base, s_acc, q_at, s)  # S_j = Q K_j^T, issued
                hopper.wgmma_commit()
                fence_p(p)
                pv_product(smem, base, o_acc, p, prev)  # O += P_{j-1} V_{j-1}, issued
                hopper.wgmma_commit()
                pass_turn(smem, c, False)
                hopper.wgmma_wait(1)  # S_j is in
                fence_s(s_acc)
                hopper.mbarrier_arrive(smem, k_empty(base, s))
                col0 = walked_tile(listed, first, it) * block_n
                needs_mask = tile_needs_mask(col0, block_n, first_row_last_key, last_row_first_key, WINDOW)
                softmax_step(smem, s_acc, col0, needs_mask, t, first_keys, last_keys, m, m_ref, alpha, tile_max,
                             l_run, scale_log2, (softcap_log2, slopes, diags, shifts, n_k, b, positions, heads,
                                                 mod_args, walked_partial(listed, first, it)))
                # P_{j-1} V_{j-1} is in: O can be rescaled, P and V_{j-1}'s slot reused. The wait follows a
                # store of the row sums, so ptxas cannot hoist it above S_j's exponentials (perf log 19)
                hopper.wgmma_wait_after(smem, base + SINK + 4 * tid, l_run[0] + l_run[1])
                fence_o(o_acc)
                fence_p(p)
                hopper.mbarrier_arrive(smem, v_empty(base, prev))
                rescale_o(o_acc, alpha)
                to_fragments(s_acc, p)
            pv_step(smem, base, o_acc, p, count - 1, c, True)
        else:  # Algorithm 1 as written: each step's products and softmax in turn
            for it in range(count):
                s_step(smem, base, s_acc, q_at, it, c, False)
                col0 = walked_tile(listed, first, it) * block_n
                needs_mask = tile_needs_mask(col0, block_n, first_row_last_key, last_row_first_key, WINDOW)
                softmax_step(smem, s_acc, col0, needs_mask, t, first_keys, last_keys, m, m_ref, alpha, tile_max, l_run,
                             scale_log2, (softcap_log2, slopes, diags, shifts, n_k, b, positions, heads, mod_args,
                                          walked_partial(listed, first, it)))
                rescale_o(o_acc, alpha)
                to_fragments(s_acc, p)
                pv_step(smem, base, o_acc, p, it, c, it == count - 1)
        # Lines 21-23: O = diag(l)^-1 O~, L = m + log l; rows past Nq unwritten
        for r in range(2):
            total = quad_sum(smem, l_run[r])
            l_run[r] = reciprocal_or_zero(total)
            if t == 0 and row + 8 * r < n_q:
                if total == 0:
                    lse[b_out, h, row + 8 * r] = float32(NEG_INF)
                else:
                    lse[b_out, h, row + 8 * r] = (m[r] + math.log2(total) - float32(P_OFFSET)) * float32(LN2)
        if TMA_STORE:  # O through shared memory: this warpgroup's rows of the Q tile's boxes, then TMA
            for r in range(2):
                at = q_at + (16 * w + g + 8 * r) * hopper.BOX_BYTES + 4 * t  # the row's word t of box 0
                for j in range(D // 8):  # columns 8j + 2t, 8j + 2t + 1: box j // 8, 16-byte chunk j % 8 of the
                    # row, which the 128-byte swizzle (hopper.swizzle) puts at chunk (j % 8) ^ (row % 8)
                    hopper.st_shared_b32(smem, at + (j // 8) * Q_BOX + ((j % 8) ^ g) * 16,
                                         pack(o_acc[4 * j + 2 * r] * l_run[r], o_acc[4 * j + 2 * r + 1] * l_run[r]))
            hopper.fence_proxy_async()
            hopper.named_barrier_sync(smem, STORE_BAR + c, WARPGROUP)
            if lane == 0:
                for x in range(BOXES):
                    store_o(smem, q_at + x * Q_BOX, map_o, o, x * BOX_ELEMS, m0 + 64 * c, h, b)
                hopper.bulk_commit()
                hopper.bulk_wait_read()
            return
        for r in range(2):  # o: the caller's (or a padded) output as pairs of 16-bit values; split: float32
            if row + 8 * r < n_q:
                inv = l_run[r]
                if FP8:
                    inv = inv * v_descale[b, hk]
                for j in range(D // 8):
                    if SPLIT:
                        o[b_out, h, row + 8 * r, 8 * j + 2 * t] = o_acc[4 * j + 2 * r] * inv
                        o[b_out, h, row + 8 * r, 8 * j + 2 * t + 1] = o_acc[4 * j + 2 * r + 1] * inv
                    else:
                        o[b, h, row + 8 * r, 4 * j + t] = pack(o_acc[4 * j + 2 * r] * inv, o_acc[4 * j + 2 * r + 1] * inv)

    threads = WARPGROUP * (CONSUMERS + 1)
    if not USER:
        def kernel(q, k, v, o, lse, tmap_q, tmap_k, tmap_v, tmap_o, scale_log2, n_q, n_k, group, q_descale, k_descale,
                   v_descale, softcap_log2, alibi, seqlens):
            body(q, k, v, o, lse, tmap_q, tmap_k, tmap_v, tmap_o, scale_log2, n_q, n_k, group, q_descale, k_descale,
                 v_descale, softcap_log2, alibi, seqlens, (), (), ())
    elif not SPARSE:
        def kernel(q, k, v, o, lse, tmap_q, tmap_k, tmap_v, tmap_o, scale_log2, n_q, n_k, group, q_descale, k_descale,
                   v_descale, softcap_log2, alibi, seqlens, mod_args):
            body(q, k, v, o, lse, tmap_q, tmap_k, tmap_v, tmap_o, scale_log2, n_q, n_k, group, q_descale, k_descale,
                 v_descale, softcap_log2, alibi, seqlens, mod_args, (), ())
    else:  # a block mask's lists (int32 (B or 1, H or 1, tiles) counts and (.., tiles, tiles) entries) after mod_args
        def kernel(q, k, v, o, lse, tmap_q, tmap_k, tmap_v, tmap_o, scale_log2, n_q, n_k, group, q_descale, k_descale,
                   v_descale, softcap_log2, alibi, seqlens, mod_args, walk_counts, walk_lists):
            body(q, k, v, o, lse, tmap_q, tmap_k, tmap_v, tmap_o, scale_log2, n_q, n_k, group, q_descale, k_descale,
                 v_descale, softcap_log2, alibi, seqlens, mod_args, walk_counts, walk_lists)
    jitted = kernel_jit(fastmath=FASTMATH, launch_bounds=(threads, 1))(kernel)
    jitted.fa3_threads = threads
    jitted.fa3_smem = L.smem_bytes
    return jitted
