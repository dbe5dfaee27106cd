"""Device functions of the tensor-core kernels: one (Q tile, K/V tile) step on ``mma.sync``.

The tensor-core counterpart of ``tile_ops``: FA-1 and FA-2 (``tc_fa1``, ``tc_fa2``) call these
and differ only in their loop nests. The layout (FlashAttention-2's "split-Q"): a block has
``block_m / 16`` warps and warp ``w`` owns query rows ``16 w .. 16 w + 15`` of the Q tile; of
them lane ``(g, t)`` holds rows ``g`` and ``g + 8`` (``rows_per_thread = 2``), and of every
8-wide column tile of S and O the columns ``2t, 2t + 1`` (the mma accumulator layout, see
``mma``). A row's four lanes are consecutive, so row statistics combine by ``row_reduce``.

- :func:`load_tile_async`  rows of Q, K or V -> shared memory by 16-byte ``cp.async`` copies
  (rows past N and columns past D are zero-filled; the caller commits and waits)
- :func:`load_q_frags`     Q_i's A fragments into registers (kept for the whole K/V walk)
- :func:`score_tile`       S = Q_i K_j^T on tensor cores (K_j fragments by ``ldmatrix``)
- :func:`scale_mask`       S in log2 units (``scale * log2(e)``), masked keys -> -inf
- :func:`row_max`, :func:`exp_scores`  rowmax(S), P~ = exp2(S - m) in place, rowsum(P~)
- :func:`pv_tile`          O~ += P~ V_j: P~ is converted to the input type in registers (the
  accumulator layout of S is the A-fragment layout of P~: no shared-memory round trip, as in
  FlashAttention-2), V_j's fragments by ``ldmatrix.trans``

Precision kinds: ``"f16"``, ``"bf16"`` (m16n8k16, tiles in shared memory as 16-bit patterns),
``"tf32"`` and ``"tf32x3"`` (m16n8k8 on float32 tiles; ``tf32x3`` splits each operand into a
TF32 ``big`` part and a TF32 ``small`` remainder and sums ``big*big + big*small + small*big``,
which keeps the error close to float32's). For TF32 the keys of a P~ fragment are permuted
(A column ``t`` is key ``2t``, column ``t + 4`` key ``2t + 1``, and V's fragment rows follow the
same permutation), which lets P~ stay in the accumulator layout; the sum over keys does not
depend on their order.

Shared memory is dynamic (one buffer carved into Q_i, K_j, V_j; above 48 KiB the launcher opts
in), rows padded by 16 bytes so a warp's ``ldmatrix`` rows fall in distinct banks.

tf32x3 at D > 64 with 8 warps (``presplit_operands``): Q_i, V_j (and optionally K_j) are split
once into TF32 big/small fragments in shared memory, in fragment order (each lane's four words
of a fragment pair contiguous: one ``ld.shared.v4``, conflict-free), instead of by every warp at
every use; K_j and V_j then stage the copies and ``split_k_tile`` / ``split_v_tile`` fill the
fragments, four barriers per tile as before.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from types import ModuleType

from numba_flash._cuda import cuda, float32
from numba_flash.arch import SMEM_OPTIN_LIMIT
from numba_flash.kernels import mma
from numba_flash.kernels.jit import NEG_INF, device_jit
from numba_flash.kernels import mask, paged, score_mods
from numba_flash.kernels.row_reduce import add, row_allreduce
from numba_flash.kernels.softmax import exp2_diff, finite_or_zero, log_sum_exp, nan_max, reciprocal_or_zero

KINDS = ("f16", "bf16", "tf32", "tf32x3")
ROWS_PER_WARP = 16  # one m16 row tile per warp
ROWS_PER_THREAD = 2  # g and g + 8
BLOCK_M_CHOICES = (16, 32, 64, 128)  # 1 to 8 warps
BLOCK_N_CHOICES = (16, 32, 64, 128)


@dataclass(frozen=True)
class TcLayout:
    """Sizes of one tensor-core specialisation; all compile-time constants."""

    kind: str
    head_dim: int  # D of the arrays the kernel reads (a multiple of 8 for 16-bit, 4 for TF32)
    block_m: int
    block_n: int
    warps: int
    threads: int
    padded_dim: int  # DP: head dim rounded up to the k-step (16) of the products
    stride: int  # elements per shared row (DP + 16 bytes of padding)
    elem_bytes: int  # 2 (16-bit kinds) or 4 (TF32)
    chunk: int  # elements per 16-byte cp.async copy
    score_tiles: int  # 8-wide key tiles of S: block_n / 8
    out_tiles: int  # 8-wide head-dim tiles of O: DP / 8
    kv_stages: int = 1  # FA-2: K/V tiles in shared memory at once (``tc_fa2``: 1, or a ring)
    key_warps: int = 1  # FA-2 decode: warps that share each 16-row warp's rows, each on its own keys of every tile
    swizzle_mask: int = 0  # 16-bit tiles without padding, chunks exchanged by row (``mma.swizzled``); 0: padded rows
    presplit: str = ""  # tf32x3: the operands split once in shared memory, of "qkv" (``presplit_operands``)

    @property
    def q_elems(self) -> int:
        """Q_i's rows, or with "q" pre-split its A fragments (big and small, fragment order)."""
        if "q" in self.presplit:
            return 2 * self.block_m * self.padded_dim
        return self.block_m * self.stride

    @property
    def kv_elems(self) -> int:
        return self.block_n * self.stride

    @property
    def k_split_elems(self) -> int:
        """32-bit words of K_j's pre-split B fragments (big and small per element, fragment
        order, no padding); 0 unless "k" is pre-split."""
        return 2 * self.block_n * self.padded_dim if "k" in self.presplit else 0

    @property
    def v_split_elems(self) -> int:
        """The same for V_j ("v")."""
        return 2 * self.block_n * self.padded_dim if "v" in self.presplit else 0

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of one block: Q_i, K_j and V_j of each stage (and pre-split K_j, V_j)."""
        return (self.q_elems + 2 * self.kv_stages * self.kv_elems + self.k_split_elems + self.v_split_elems) * self.elem_bytes


PRESPLIT_DEFAULT = "q"  # measured on the H200 (docs/performance-log.md, 8g): D=128 10.22 ms against 10.91 (none), 11.00 (qv)
PRESPLIT_MODES = ("", "q", "v", "qv", "kv", "qkv")


def presplit_operands(kind: str, head_dim: int, block_m: int, mode: str = PRESPLIT_DEFAULT) -> str:
    """Which operands a tf32x3 kernel splits into TF32 big and small parts once, into shared
    memory, instead of in every warp at every use: "q" (Q_i's A fragments, once per Q tile),
    "v" (V_j's B fragments, once per K/V tile for all 8 warps), "k" (K_j's, only with "v").
    Each trades ALU work (3 instructions per element and use) for shared-memory traffic (the
    products read two words per element instead of one). Only at D > 64 with 8 warps (128-row Q
    tiles), where a block holds an SM alone (~240 registers) and larger tiles cost no
    occupancy; elsewhere "" (the kernels of version 8d, unchanged). ``mode`` (letters of "qkv")
    overrides the default: the host passes ``NUMBA_FLASH_TF32X3_PRESPLIT``'s value
    (``switches.tf32x3_presplit``, an experiment knob) through ``tc_layout``."""
    if kind != "tf32x3" or head_dim <= 64 or block_m != 8 * ROWS_PER_WARP:
        return ""
    if "k" in mode:
        mode += "v"  # K_j's split walks the loop that splits V_j
    return "".join(c for c in "qkv" if c in mode)


@functools.lru_cache(maxsize=None)
def tc_layout(kind: str, head_dim: int, block_m: int, block_n: int, kv_stages: int = 1,
              presplit: str | None = None, key_warps: int = 1, presplit_mode: str = PRESPLIT_DEFAULT) -> TcLayout:
    """Sizes of one specialisation. ``kv_stages``: FA-2's ring of K/V tiles (decode's knob; no
    pre-split with a ring). ``presplit`` None: ``presplit_operands``, less "q" and then "k" where
    the tiles would not fit the opt-in shared memory (D = 128 with block_n = 64), of
    ``presplit_mode`` (``presplit_operands``' ``mode``). ``key_warps``:
    the block has that many warps per 16 query rows, each on ``block_n / key_warps`` keys of
    every K/V tile (``tc_fa2``'s key-split decode, which needs a ring)."""
    sixteen = kind in mma.HALF_KINDS
    elem = 2 if sixteen else 4
    dp = -(-head_dim // 16) * 16
    warps = block_m // ROWS_PER_WARP
    # The key-split decode tiles (16-bit) are swizzled instead of padded: a warp's cp.async of
    # padded rows writes 128-byte segments that straddle two, and reads ~8% slower (measured on
    # the H200: a copy-only ring of 256 one-warp blocks, 1.050 ms against 0.969 at 4.3 GB;
    # docs/performance-log.md 9j). Rows of a power-of-two count of 16-byte chunks only.
    chunks = dp * elem // 16
    swizzle = min(7, chunks - 1) if key_warps > 1 and sixteen and chunks & (chunks - 1) == 0 else 0
    layout = TcLayout(
        kind=kind,
        head_dim=head_dim,
        block_m=block_m,
        block_n=block_n,
        warps=warps,
        threads=32 * warps * key_warps,
        padded_dim=dp,
        stride=dp if swizzle else dp + 16 // elem,
        elem_bytes=elem,
        chunk=16 // elem,
        score_tiles=block_n // 8,
        out_tiles=dp // 8,
        kv_stages=kv_stages,
        key_warps=key_warps,
        swizzle_mask=swizzle,
    )
    if kv_stages > 1:  # the ring (16-bit decode) splits nothing in advance
        if presplit:
            raise ValueError(f"presplit={presplit!r} needs kv_stages=1; got {kv_stages}")
        return layout
    if presplit is not None:
        return dataclasses.replace(layout, presplit=presplit)
    mode = presplit_operands(kind, head_dim, block_m, presplit_mode)
    for fallback in (mode, mode.replace("q", ""), mode.replace("q", "").replace("k", "")):
        split = dataclasses.replace(layout, presplit=fallback)
        if split.smem_bytes <= SMEM_OPTIN_LIMIT:
            return split
    return layout


def input_alignment(kind: str) -> int:
    """Elements the head dim and every row stride of the inputs must be a multiple of
    (16-byte ``cp.async`` copies); the API pads or copies inputs that are not."""
    return 8 if kind in mma.HALF_KINDS else 4


def kernel_head_dim(kind: str, head_dim: int) -> int:
    """The head dim a tensor-core kernel is compiled for: D rounded up to the copy width."""
    a = input_alignment(kind)
    return -(-head_dim // a) * a


def check_tc_tiles(kind: str, head_dim: int, block_m, block_n) -> None:
    """``ValueError`` naming the argument when the tensor-core kernels cannot run these tiles."""
    for name, value, choices in (("block_m", block_m, BLOCK_M_CHOICES), ("block_n", block_n, BLOCK_N_CHOICES)):
        if isinstance(value, bool) or value not in choices:
            raise ValueError(
                f"{name}={value!r} is not supported on tensor cores: {name} must be one of {list(choices)}"
            )
    need = tc_layout(kind, head_dim, int(block_m), int(block_n)).smem_bytes
    if need > SMEM_OPTIN_LIMIT:
        raise ValueError(
            f"block_m={block_m}, block_n={block_n} with head_dim={head_dim} need {need} bytes of shared "
            f"memory on tensor cores, more than the {SMEM_OPTIN_LIMIT} a block can have"
        )


def tc_register_cap(kind: str, head_dim: int, block_m: int, block_n: int, maxreg: int | None = None) -> int | None:
    """Registers per thread the tensor-core kernels are compiled under: ``None`` (no cap), unless
    ``maxreg`` asks for one: ``NUMBA_FLASH_TC_MAXREG``'s value (``switches.tc_maxreg``, an experiment knob the host reads when a configuration's spec is first made; 0: none). Measured on the H200
    (2026-11-30): tf32x3 D=128 128x32 capped at 128 registers (two blocks per SM, 164-172 bytes
    of spills) ran at 47.0 TFLOP/s against 49.9 uncapped (243 registers, one block)."""
    if maxreg is not None:
        return int(maxreg) or None
    return None


ROW_WALK_MIN_COPIES = 16  # 16-byte copies per thread and K/V tile from which the loader walks rows


def row_walk_default(kind: str, head_dim: int, block_m: int, block_n: int, key_warps: int = 1) -> bool:
    """Do the K/V copies walk rows (``tc_ops``' loader)? Yes when a thread makes at least
    ``ROW_WALK_MIN_COPIES`` copies per tile: the one-warp decode tiles (16 x 64 at D = 128: 32
    copies, which ptxas leaves in a loop of ~54 instructions per copy when indexed). The
    multi-warp forward tiles make 4 copies, which ptxas unrolls and folds; there the walk's
    64-bit addresses cost registers (f16 D = 128 64 x 32: 163 -> 235, 3 -> 2 blocks per SM).
    The key-split decode tiles (``key_warps > 1``) always walk."""
    if key_warps > 1:  # the key-split decode tiles: walked 952 us, indexed 969 at 1M keys (H200; 223 vs 244 registers)
        return True
    L = tc_layout(kind, head_dim, block_m, block_n)
    return L.block_n * (L.padded_dim // L.chunk) >= ROW_WALK_MIN_COPIES * L.threads


@functools.lru_cache(maxsize=None)
def tc_ops(kind: str, head_dim: int, block_m: int, block_n: int, row_walk=None,
           presplit: str | None = None, key_warps: int = 1, page_size: int = 0, col_split: int = 1) -> ModuleType:
    """Device functions for one (kind, head_dim, block_m, block_n) specialisation (memoised);
    ``row_walk``: the copies of full K/V tiles walk rows (``None``: :func:`row_walk_default`);
    ``presplit``: ``tc_layout``'s; ``key_warps``: the block's warps per 16 rows (``tc_layout``;
    the copies use every thread, the products and row statistics are each warp's own);
    ``page_size``: ``load_kv_tile`` reads a paged cache (``kernels.paged``); 0: contiguous.
    ``col_split``: the block has that many warps per 16 rows, and ``pv_tile``'s output columns are
    split among them (warp ``w`` of rows ``w % warps`` owns head-dim columns ``(w // warps) DP /
    col_split ..``, its accumulator ``DP / (8 col_split)`` tiles): the backward's K/V kernels above
    D = 128 (``tc_bwd``), whose dK_j, dV_j would not fit one warp's registers. Only the products
    and row indices know it; the forward's copies and O~ functions take ``col_split=1``."""
    L = tc_layout(kind, head_dim, block_m, block_n, presplit=presplit, key_warps=key_warps)
    ROW_WALK = row_walk_default(kind, head_dim, block_m, block_n, key_warps) if row_walk is None else bool(row_walk)
    D, BM, BN, DP, S = head_dim, block_m, block_n, L.padded_dim, L.stride
    NT, NS, DT, CH = L.threads, L.score_tiles, L.out_tiles, L.chunk
    TM = ROWS_PER_THREAD
    SIXTEEN = kind in mma.HALF_KINDS
    SPLIT = kind == "tf32x3"
    KSTEP = 16 if SIXTEEN else 8  # k of one product
    KT = DP // KSTEP  # products along the head dim
    # Q_i's A fragments stay in registers for the whole K/V walk, except for tf32x3: two per
    # element (128 registers at D = 128, 64 at D = 64) crowd out the accumulators; re-splitting
    # one step's fragment from shared memory (one ldmatrix, 12 ALU) costs less than the
    # occupancy (D = 64, 128x32: 126 registers and 2 blocks per SM instead of 164 and 1).
    # 16-bit: Q_i's fragments (DP / 4 registers) stay in registers up to D = 128; above, with the
    # O~ accumulators (DP / 2) they leave no room (D = 256, 64 x 32: 255 registers and 404 bytes of
    # spill, offline), and each step's fragment is read from shared memory again (one ldmatrix).
    Q_IN_REGS = (DP <= 128) if SIXTEEN else (KT * 4 <= 64 and not SPLIT)
    Q_FRAG_ROWS = KT if Q_IN_REGS else 1
    # tf32x3 at D > 64 with 8 warps (``presplit_operands``): operands split into their TF32 big
    # and small parts once, into shared memory in fragment order (``load_q_tile``,
    # ``split_k_tile``, ``split_v_tile``); the products then read ready fragments, one
    # ``ld.shared.v4`` per fragment pair, instead of every warp splitting the same tile.
    PRESPLIT = L.presplit != ""
    PRESPLIT_Q, PRESPLIT_K, PRESPLIT_V = ("q" in L.presplit), ("k" in L.presplit), ("v" in L.presplit)
    WARPS = L.warps
    K_PAIRS = KT * (NS // 2)  # (head-dim step, 16 keys) blocks of K_j: one ldmatrix each
    V_UNITS = NS * DT  # (8 keys, 8 head-dim columns) B fragments of V_j
    CHUNKS_PER_ROW = DP // CH
    if SIXTEEN:
        MMA, PACK, BITS = mma.MMA_16[kind], mma.PACK_16[kind], mma.BITS_16[kind]
        copy16, copy_at = mma.cp_async16, mma.cp_async16_at
    else:
        MMA = mma.mma_tf32
        copy16, copy_at = mma.cp_async16_f32, mma.cp_async16_at_f32
    to_tf32, tf32_value = mma.to_tf32, mma.tf32_value

    SWIZZLE = L.swizzle_mask

    if SWIZZLE:

        @device_jit
        def tile_index(row, d):
            """Shared-memory element of (row, d) of a tile (a multiple of the copy width)."""
            return mma.swizzled(row, d, S, SWIZZLE)

        @device_jit
        def ldsm(smem, row0, col0):
            return mma.ldsm_x4_swizzled(smem, row0, col0, S, SWIZZLE)

        @device_jit
        def ldsm_trans(smem, row0, col0):
            return mma.ldsm_x4_trans_swizzled(smem, row0, col0, S, SWIZZLE)

    else:

        @device_jit
        def tile_index(row, d):
            """Shared-memory element of (row, d) of a tile (rows padded to ``S`` elements)."""
            return row * S + d

        @device_jit
        def ldsm(smem, row0, col0):
            return mma.ldsm_x4(smem, row0, col0, S)

        @device_jit
        def ldsm_trans(smem, row0, col0):
            return mma.ldsm_x4_trans(smem, row0, col0, S)

    def make_loader(tile_rows, source=paged.CONTIGUOUS):
        COPIES = -(-tile_rows * CHUNKS_PER_ROW // NT)  # copies per thread
        EXACT = tile_rows * CHUNKS_PER_ROW % NT == 0
        # A row walk: when the block's threads cover whole rows (NT a multiple of the chunks per
        # row), thread ``tid`` copies the same 16-byte column of rows tid // CHUNKS_PER_ROW +
        # n * ROW_STEP, so the address of its next copy is the last one plus a constant: one
        # 64-bit add per copy, where the indexed copy spends ~50 instructions on a 64-bit signed
        # division, clamps and the element's full index (SASS of the 16 x 64 decode tile at D
        # = 128: 215 instructions per 4 LDGSTS). Full tiles only: every row valid, D == DP.
        WALK = ROW_WALK and D == DP and NT % CHUNKS_PER_ROW == 0 and tile_rows % (NT // CHUNKS_PER_ROW) == 0
        ROW_STEP = NT // CHUNKS_PER_ROW if WALK else 1
        WALK_COPIES = tile_rows // ROW_STEP
        # A paged cache (``kernels.paged``): the tile's rows lie in PARTS runs of PART rows, one
        # page each (a tile in one page, or pages that tile it: tiles start at multiples of
        # tile_rows); the walk looks the page up once per run. Other page sizes: indexed copies.
        PAGED, PAGE = source.PAGED, source.PAGE_SIZE
        PART = min(PAGE, tile_rows) if PAGED else tile_rows
        PAGE_WALK = PAGED and WALK and (PAGE % tile_rows == 0 or tile_rows % PAGE == 0) and PART % ROW_STEP == 0
        PARTS, PART_COPIES = tile_rows // PART, PART // ROW_STEP

        @device_jit
        def copy_indexed(src, kv, b, h, first, n_valid, x_s):
            """Sequence ``b``'s rows ``first ..`` of head ``h`` -> ``x_s``, one indexed 16-byte copy
            each (tails, and tiles no row walk covers): ``src`` holds the chunks (the array, or a
            paged cache's pages), ``source.locate(kv, b, row)`` says where (``kv``: the array, or
            ``(pages, block_table)``). Rows at or past ``n_valid`` and columns past D are zero."""
            tid = cuda.threadIdx.x
            for n in range(COPIES):
                c = tid + NT * n
                if EXACT or c < tile_rows * CHUNKS_PER_ROW:
                    r = c // CHUNKS_PER_ROW
                    d = (c - r * CHUNKS_PER_ROW) * CH
                    row = first + r
                    valid = row < n_valid and d < D
                    # an invalid copy reads nothing, but its source address must be in bounds
                    index, at = source.locate(kv, b, min(row, n_valid - 1))
                    copy16(x_s, tile_index(r, d), src, index, h, at, min(d, D - CH), valid)

        @device_jit
        def load_paged(kv, b, h, first, n_valid, x_s):
            """:func:`load` from a paged cache ``kv = (pages, block_table)``: sequence ``b``'s
            keys ``first ..`` of head ``h``, from the pages its table names."""
            pages = kv[0]
            tid = cuda.threadIdx.x
            if PAGE_WALK and first + tile_rows <= n_valid:  # a full tile: a row walk per page
                r = tid // CHUNKS_PER_ROW
                d = (tid - r * CHUNKS_PER_ROW) * CH
                step = mma.row_step(pages) * ROW_STEP
                for p in range(PARTS):
                    page, row = source.locate(kv, b, first + p * PART + r)
                    address = mma.row_address(pages, page, h, row, d)
                    for n in range(PART_COPIES):
                        copy_at(x_s, tile_index(p * PART + r + ROW_STEP * n, d), pages, page, h, d, address)
                        address += step
                return
            copy_indexed(pages, kv, b, h, first, n_valid, x_s)

        if PAGED:
            return load_paged

        @device_jit
        def load(x, b, h, first, n_valid, x_s):
            """Rows ``first ..`` of ``x[b, h]`` -> ``x_s`` (``tile_rows`` x DP, row stride S);
            rows at or past ``n_valid`` and columns past D are zero. Consecutive threads copy
            consecutive 16-byte chunks of a row (coalesced). Asynchronous: commit and wait."""
            tid = cuda.threadIdx.x
            if WALK and first + tile_rows <= n_valid:  # a full tile: the row walk
                r = tid // CHUNKS_PER_ROW
                d = (tid - r * CHUNKS_PER_ROW) * CH
                address = mma.row_address(x, b, h, first + r, d)
                step = mma.row_step(x) * ROW_STEP
                for n in range(WALK_COPIES):
                    copy_at(x_s, tile_index(r + ROW_STEP * n, d), x, b, h, d, address)
                    address += step
                return
            copy_indexed(x, x, b, h, first, n_valid, x_s)

        return load

    load_q_tile = make_loader(BM)
    load_kv_tile = make_loader(BN, paged.kv_source(page_size))

    if PRESPLIT_Q:

        @device_jit
        def load_q_tile(q, b, h, first, n_valid, q_s):  # noqa: F811 (replaces the row copy)
            """Q_i's tf32x3 A fragments -> ``q_s``, split once per Q tile: warp w's fragment of
            head-dim step kt is 256 words at ``(w KT + kt) 256``, lane l's big a0..a3 at ``4 l``
            and its small ones 128 words on (a0 = Q[16w + g, 8kt + t], a1 row g + 8, a2 and a3
            column t + 4). Plain loads from global memory by the lane that will read them back
            (once per Q tile: no copy to overlap, no barrier needed); rows at or past
            ``n_valid`` and columns past D are zero."""
            warp = cuda.threadIdx.x >> 5
            lane = cuda.threadIdx.x & 31
            g = lane >> 2
            t = lane & 3
            hi = cuda.local.array(4, mma.uint32)
            lo = cuda.local.array(4, mma.uint32)
            for kt in range(KT):
                for e in range(4):
                    row = first + 16 * warp + g + 8 * (e & 1)
                    d = KSTEP * kt + t + 4 * (e >> 1)
                    x = float32(0.0)
                    if row < n_valid and d < D:
                        x = q[b, h, row, d]
                    big, small = mma.split_tf32(x)
                    hi[e] = big
                    lo[e] = small
                i = (warp * KT + kt) * 256 + 4 * lane
                mma.sts_x4(q_s, i, hi[0], hi[1], hi[2], hi[3])
                mma.sts_x4(q_s, i + 128, lo[0], lo[1], lo[2], lo[3])

    COL_SPLIT = col_split > 1
    # 8-wide head-dim tiles of pv_tile's output: all of O~'s, or in the backward's column split
    # each warp's part, an even count (16-column ldmatrix steps). The last part's steps past DP
    # (DP = 208: parts of 112 and 96 columns) are made on the last 16 columns and never written:
    # every warp makes the same products (the simulated mma meets the block at a barrier).
    OUT_TILES = -(-(DT // 2) // col_split) * 2
    if col_split > 1 and (key_warps > 1 or PRESPLIT_V):
        raise ValueError(f"col_split={col_split} needs key_warps=1 and no pre-split V")

    if key_warps == 1 and not COL_SPLIT:

        @device_jit
        def warp_row0():
            """First Q-tile row of this thread's warp."""
            return (cuda.threadIdx.x >> 5) * 16

    else:

        @device_jit
        def warp_row0():
            """First Q-tile row of this thread's warp: warps ``w``, ``w + warps``, ... share rows."""
            return ((cuda.threadIdx.x >> 5) % WARPS) * 16

    @device_jit
    def key_warp():
        """Which of the ``key_warps`` (or ``col_split``) warps of its rows this thread's warp is (0 when 1)."""
        return (cuda.threadIdx.x >> 5) // WARPS

    @device_jit
    def out_col0():
        """The first head-dim column of this warp's part of ``pv_tile``'s output (``col_split``)."""
        if COL_SPLIT:
            return key_warp() * (OUT_TILES * 8)
        return 0

    @device_jit
    def thread_row(i):
        """Q-tile row of this thread's i-th row (g, then g + 8)."""
        return warp_row0() + ((cuda.threadIdx.x & 31) >> 2) + 8 * i

    @device_jit
    def lane_t():
        return cuda.threadIdx.x & 3

    @device_jit
    def col_of(tile, e):
        """Column (key in S, head-dim index in O) of accumulator element ``e`` of 8-wide tile ``tile``."""
        return 8 * tile + 2 * lane_t() + (e & 1)

    # ---------------------------------------------------------------- S = Q K^T

    if SIXTEEN:

        @device_jit
        def load_q_frags(q_s, qf, qf_small):
            """Q_i's A fragments of this warp's 16 rows, one per 16-wide step of the head dim
            (when they stay in registers: ``Q_IN_REGS``)."""
            if Q_IN_REGS:
                r0 = warp_row0()
                for kt in range(KT):
                    a = ldsm(q_s, r0, KSTEP * kt)
                    for e in range(4):
                        qf[kt, e] = a[e]

        @device_jit
        def score_tile(qf, qf_small, q_s, k_s, s, scratch):
            """S = Q_i K_j^T (this warp's 16 rows x block_n keys), float32 accumulators; above
            D = 128 each step's Q fragment is read from shared memory, once for all key tiles."""
            for nt in range(NS):
                for e in range(4):
                    s[nt, e] = float32(0.0)
            if Q_IN_REGS:
                for nt2 in range(NS // 2):  # 16 keys: two 8-key tiles per ldmatrix.x4
                    for kt in range(KT):
                        kb = ldsm(k_s, 16 * nt2, KSTEP * kt)
                        MMA(s, 2 * nt2, qf[kt, 0], qf[kt, 1], qf[kt, 2], qf[kt, 3], kb[0], kb[2], scratch)
                        MMA(s, 2 * nt2 + 1, qf[kt, 0], qf[kt, 1], qf[kt, 2], qf[kt, 3], kb[1], kb[3], scratch)
            else:
                r0 = warp_row0()
                for kt in range(KT):
                    a = ldsm(q_s, r0, KSTEP * kt)
                    for nt2 in range(NS // 2):
                        kb = ldsm(k_s, 16 * nt2, KSTEP * kt)
                        MMA(s, 2 * nt2, a[0], a[1], a[2], a[3], kb[0], kb[2], scratch)
                        MMA(s, 2 * nt2 + 1, a[0], a[1], a[2], a[3], kb[1], kb[3], scratch)

        @device_jit
        def pv_step(a0, a1, a2, a3, v_s, kk, c0, acc, scratch):
            """One 16-key step of P~ V_j: acc += A V_j[16 kk .., this warp's columns from ``c0``],
            A (16 rows x 16 keys) the 16-bit fragment a0..a3 (from registers here; from shared
            memory in the backward's shared scores, ``tc_bwd.pv_shared``)."""
            for dt2 in range(OUT_TILES // 2):
                if COL_SPLIT:
                    vb = ldsm_trans(v_s, 16 * kk, min(c0 + 16 * dt2, DP - 16))
                else:
                    vb = ldsm_trans(v_s, 16 * kk, 16 * dt2)
                MMA(acc, 2 * dt2, a0, a1, a2, a3, vb[0], vb[1], scratch)
                MMA(acc, 2 * dt2 + 1, a0, a1, a2, a3, vb[2], vb[3], scratch)

        @device_jit
        def pv_tile(p, v_s, acc, scratch):
            """O~ += P~ V_j: P~ (float32 accumulators) -> 16-bit A fragments in registers."""
            c0 = out_col0()  # (0 but in the backward's column split)
            for kk in range(NS // 2):  # 16 keys per product
                a0 = PACK(p[2 * kk, 0], p[2 * kk, 1])  # row g, keys 2t, 2t+1
                a1 = PACK(p[2 * kk, 2], p[2 * kk, 3])  # row g+8
                a2 = PACK(p[2 * kk + 1, 0], p[2 * kk + 1, 1])  # row g, keys 8+2t, 8+2t+1
                a3 = PACK(p[2 * kk + 1, 2], p[2 * kk + 1, 3])  # row g+8
                pv_step(a0, a1, a2, a3, v_s, kk, c0, acc, scratch)

        @device_jit
        def store_out(o, b, h, row, d, x):
            o[b, h, row, d] = BITS(x)

        @device_jit
        def split_k_tile(k_s, k_split):
            pass

        @device_jit
        def split_v_tile(v_s, v_split):
            pass

    else:
        pv_step = None  # (16-bit only)

        @device_jit
        def split(x, big, small, i, e):
            """TF32 operands of ``x``: big[i, e] = tf32(x); for tf32x3 small[i, e] = x - big
            (``mma.split_tf32``: three integer/float instructions, the tensor core drops the
            low bits of both)."""
            if SPLIT:
                hi, lo = mma.split_tf32(x)
                big[i, e] = hi
                small[i, e] = lo
            else:
                big[i, e] = to_tf32(x)

        @device_jit
        def tf32_product(acc, corr, ci, a_big, a_small, ai, b0, b1, scratch):
            """acc[ci] += A B with A = a_big[ai] (+ a_small[ai]) and B = (b0, b1) float32 values;
            tf32x3 sums its two small terms into ``corr[ci]`` (an independent accumulator: the
            three products are not one dependent chain; the caller adds ``corr`` to ``acc``)."""
            if SPLIT:
                hb0, lb0 = mma.split_tf32(b0)
                hb1, lb1 = mma.split_tf32(b1)
                MMA(acc, ci, a_big[ai, 0], a_big[ai, 1], a_big[ai, 2], a_big[ai, 3], hb0, hb1, scratch)
                MMA(corr, ci, a_small[ai, 0], a_small[ai, 1], a_small[ai, 2], a_small[ai, 3], hb0, hb1, scratch)
                MMA(corr, ci, a_big[ai, 0], a_big[ai, 1], a_big[ai, 2], a_big[ai, 3], lb0, lb1, scratch)
            else:
                MMA(acc, ci, a_big[ai, 0], a_big[ai, 1], a_big[ai, 2], a_big[ai, 3], to_tf32(b0), to_tf32(b1), scratch)

        @device_jit
        def presplit_product(acc, corr, ci, a_big, a_small, ai, w, scratch):
            """``tf32_product`` (tf32x3) with B given split: w = (big b0, big b1, small b0,
            small b1), one ``lds_x4`` of a pre-split tile; the same products in the same order."""
            MMA(acc, ci, a_big[ai, 0], a_big[ai, 1], a_big[ai, 2], a_big[ai, 3], w[0], w[1], scratch)
            MMA(corr, ci, a_small[ai, 0], a_small[ai, 1], a_small[ai, 2], a_small[ai, 3], w[0], w[1], scratch)
            MMA(corr, ci, a_big[ai, 0], a_big[ai, 1], a_big[ai, 2], a_big[ai, 3], w[2], w[3], scratch)

        @device_jit
        def split_k_tile(k_s, k_split):
            """K_j (``k_s``, rows of keys) -> its tf32x3 B fragments in ``k_split``, once for
            every warp: fragment (kt, nt) (keys 8nt.., head-dim step kt) is 128 words, lane
            l's four at ``((kt NS + nt) 32 + l) 4``: big b0, big b1, small b0, small b1 (b0 =
            K[8nt + g, 8kt + t], b1 = K[.., 8kt + t + 4]). Warp w splits the 16-key blocks
            w, w + warps, ..: one ``ldmatrix`` (two fragments), 12 ALU, two ``st.shared.v4``.
            The caller fences: K_j landed before, a barrier after."""
            warp = cuda.threadIdx.x >> 5
            lane = cuda.threadIdx.x & 31
            for r in range(-(-K_PAIRS // WARPS)):
                pair = warp + WARPS * r
                if K_PAIRS % WARPS == 0 or pair < K_PAIRS:
                    kt = pair // (NS // 2)
                    nt2 = pair - kt * (NS // 2)
                    kb = mma.ldsm_x4_f32(k_s, 16 * nt2, KSTEP * kt, S)
                    h0, l0 = mma.split_tf32(kb[0])  # key tile 2 nt2: b0, b1 = m0, m2
                    h2, l2 = mma.split_tf32(kb[2])
                    h1, l1 = mma.split_tf32(kb[1])  # key tile 2 nt2 + 1: m1, m3
                    h3, l3 = mma.split_tf32(kb[3])
                    i = ((kt * NS + 2 * nt2) * 32 + lane) * 4
                    mma.sts_x4(k_split, i, h0, h2, l0, l2)
                    mma.sts_x4(k_split, i + 128, h1, h3, l1, l3)

        @device_jit
        def split_v_tile(v_s, v_split):
            """V_j -> its tf32x3 B fragments in ``v_split`` (``pv_tile``'s permuted keys):
            fragment (kk, dt) at ``((kk DT + dt) 32 + l) 4``: big b0, big b1, small b0, small
            b1 with b0 = V[8kk + 2t, 8dt + g], b1 = V[8kk + 2t + 1, 8dt + g] (two conflict-free
            ``LDS``, 6 ALU, one ``st.shared.v4`` per fragment; warp w takes w, w + warps, ..)."""
            warp = cuda.threadIdx.x >> 5
            lane = cuda.threadIdx.x & 31
            g = lane >> 2
            t = lane & 3
            for r in range(-(-V_UNITS // WARPS)):
                u = warp + WARPS * r
                if V_UNITS % WARPS == 0 or u < V_UNITS:
                    kk = u // DT
                    dt = u - kk * DT
                    row = (8 * kk + 2 * t) * S + g + 8 * dt
                    h0, l0 = mma.split_tf32(v_s[row])
                    h1, l1 = mma.split_tf32(v_s[row + S])
                    mma.sts_x4(v_split, (u * 32 + lane) * 4, h0, h1, l0, l1)

        @device_jit
        def presplit_q_step(q_s, qf, qf_small, kt):
            """Q_i's split A fragment of head-dim step ``kt`` from ``q_s`` (``load_q_tile`` with
            "q"): two ``ld.shared.v4``, no ALU."""
            i = ((cuda.threadIdx.x >> 5) * KT + kt) * 256 + 4 * (cuda.threadIdx.x & 31)
            big = mma.lds_x4(q_s, i)
            small = mma.lds_x4(q_s, i + 128)
            for e in range(4):
                qf[0, e] = big[e]
                qf_small[0, e] = small[e]

        @device_jit
        def split_q_step(q_s, qf, qf_small, kt, at):
            """Q_i's A fragment of head-dim step ``kt`` (one ``ldmatrix``: (g, t), (g+8, t),
            (g, t+4), (g+8, t+4)), split into row ``at`` of ``qf`` / ``qf_small``."""
            a = mma.ldsm_x4_f32(q_s, warp_row0(), KSTEP * kt, S)
            for e in range(4):
                split(a[e], qf, qf_small, at, e)

        @device_jit
        def load_q_frags(q_s, qf, qf_small):
            """Q_i's A fragments, one per 8-wide step, when they stay in registers."""
            if Q_IN_REGS:
                for kt in range(KT):
                    split_q_step(q_s, qf, qf_small, kt, kt)

        @device_jit
        def score_tile(qf, qf_small, q_s, k_s, s, scratch):
            """S = Q_i K_j^T: B fragment of key tile nt is (K[8nt + g, 8kt + t], K[.., 8kt + t + 4]),
            two key tiles per ``ldmatrix`` (``ldsm_x4_f32`` of the 16 keys x 8 columns block).
            Without room for Q_i's fragments in registers (tf32x3, large D) each step's fragment
            is split from shared memory again, once per step for all key tiles."""
            corr = cuda.local.array((NS, 4), float32)
            for nt in range(NS):
                for e in range(4):
                    s[nt, e] = float32(0.0)
                    corr[nt, e] = float32(0.0)
            if Q_IN_REGS:
                for nt2 in range(NS // 2):
                    for kt in range(KT):
                        kb = mma.ldsm_x4_f32(k_s, 16 * nt2, KSTEP * kt, S)
                        tf32_product(s, corr, 2 * nt2, qf, qf_small, kt, kb[0], kb[2], scratch)
                        tf32_product(s, corr, 2 * nt2 + 1, qf, qf_small, kt, kb[1], kb[3], scratch)
            elif PRESPLIT:  # q_s, k_s: pre-split fragments where asked
                lane = cuda.threadIdx.x & 31
                kt = 0
                while kt < KT:  # not range(): its lowering keeps a 64-bit trip count (~17 instructions
                    # per step at D = 128); this loop NVVM unrolls by 4
                    if PRESPLIT_Q:
                        presplit_q_step(q_s, qf, qf_small, kt)
                    else:
                        split_q_step(q_s, qf, qf_small, kt, 0)
                    if PRESPLIT_K:
                        for nt in range(NS):
                            w = mma.lds_x4(k_s, ((kt * NS + nt) * 32 + lane) * 4)
                            presplit_product(s, corr, nt, qf, qf_small, 0, w, scratch)
                    else:
                        for nt2 in range(NS // 2):
                            kb = mma.ldsm_x4_f32(k_s, 16 * nt2, KSTEP * kt, S)
                            tf32_product(s, corr, 2 * nt2, qf, qf_small, 0, kb[0], kb[2], scratch)
                            tf32_product(s, corr, 2 * nt2 + 1, qf, qf_small, 0, kb[1], kb[3], scratch)
                    kt += 1
            else:
                for kt in range(KT):
                    split_q_step(q_s, qf, qf_small, kt, 0)
                    for nt2 in range(NS // 2):
                        kb = mma.ldsm_x4_f32(k_s, 16 * nt2, KSTEP * kt, S)
                        tf32_product(s, corr, 2 * nt2, qf, qf_small, 0, kb[0], kb[2], scratch)
                        tf32_product(s, corr, 2 * nt2 + 1, qf, qf_small, 0, kb[1], kb[3], scratch)
            if SPLIT:
                for nt in range(NS):
                    for e in range(4):
                        s[nt, e] += corr[nt, e]

        @device_jit
        def pv_tile(p, v_s, acc, scratch):
            """O~ += P~ V_j with the keys of each 8-key step permuted (A column t <-> key 2t,
            column t + 4 <-> key 2t + 1): P~'s A fragment is (p[.,0], p[.,2], p[.,1], p[.,3])."""
            g = (cuda.threadIdx.x & 31) >> 2
            t = lane_t()
            c0 = out_col0()  # (0 but in the backward's column split)
            if not SPLIT:
                pb = cuda.local.array((1, 4), mma.uint32)
                for kk in range(NS):
                    split(p[kk, 0], pb, pb, 0, 0)  # (g, key 2t)
                    split(p[kk, 2], pb, pb, 0, 1)  # (g+8, key 2t)
                    split(p[kk, 1], pb, pb, 0, 2)  # (g, key 2t+1)
                    split(p[kk, 3], pb, pb, 0, 3)  # (g+8, key 2t+1)
                    row = (8 * kk + 2 * t) * S + g
                    for dt in range(OUT_TILES):
                        col = min(c0 + 8 * dt, DP - 8) if COL_SPLIT else 8 * dt
                        tf32_product(acc, acc, dt, pb, pb, 0, v_s[row + col], v_s[row + S + col], scratch)
                return
            # tf32x3: the tensor cores' float32 accumulation truncates, and over thousands of
            # keys that bias reaches ~1e-5 relative (seen on the H200 at N = 3001). So each
            # tile's P~V is summed on the tensor cores from zero (block_n keys) and added to
            # O~ by a rounded float32 add.
            pb = cuda.local.array((NS, 4), mma.uint32)
            ps = cuda.local.array((NS, 4), mma.uint32)
            tile = cuda.local.array((1, 4), float32)
            for kk in range(NS):
                split(p[kk, 0], pb, ps, kk, 0)
                split(p[kk, 2], pb, ps, kk, 1)
                split(p[kk, 1], pb, ps, kk, 2)
                split(p[kk, 3], pb, ps, kk, 3)
            for dt in range(OUT_TILES):
                col = min(c0 + 8 * dt, DP - 8) if COL_SPLIT else 8 * dt
                for e in range(4):
                    tile[0, e] = float32(0.0)
                for kk in range(NS):
                    if PRESPLIT_V:  # v_s is V_j's pre-split fragments (``split_v_tile``)
                        w = mma.lds_x4(v_s, ((kk * DT + dt) * 32 + (cuda.threadIdx.x & 31)) * 4)
                        presplit_product(tile, tile, 0, pb, ps, kk, w, scratch)
                    else:
                        row = (8 * kk + 2 * t) * S + g + col
                        tf32_product(tile, tile, 0, pb, ps, kk, v_s[row], v_s[row + S], scratch)
                for e in range(4):
                    acc[dt, e] += tile[0, e]

        @device_jit
        def store_out(o, b, h, row, d, x):
            o[b, h, row, d] = x

    # ---------------------------------------------------------------- online softmax

    row_key_bounds = mask.row_bounds(TM, thread_row)

    @device_jit
    def tile_needs_mask(col0, first_row_last_key, last_row_first_key, window):
        return mask.tile_needs_mask(col0, BN, first_row_last_key, last_row_first_key, window)

    @device_jit
    def row_of(nt, e):
        """The row (0: g, 1: g + 8) of accumulator entry e of score tile nt."""
        return e >> 1

    mask_tile = mask.tile_masker(NS, 4, col_of, row_of)  # keys outside each row's visible ones -> -inf
    cap_tile = score_mods.tile_soft_capper(NS, 4, kind in ("f16", "bf16"))  # 16-bit: tanh.approx
    alibi_tile = score_mods.tile_alibi(NS, 4, col_of, row_of)
    scaled_alibi_tile = score_mods.tile_alibi_scaled(NS, 4, col_of, row_of)
    row_alibi = score_mods.alibi_rows(TM, thread_row)

    @device_jit
    def scale_mask(s, q_scale, col0, first_keys, last_keys, masked, window, capped, cap, biased, slopes, diags):
        """S *= scale * log2(e) (scores in log2 units, FA-2 section 3.1: exp is one exp2); soft-
        capped when ``capped`` and ALiBi-biased when ``biased`` (``score_mods``, API.md 2c's
        order); keys outside a row's visible ones -> -inf (only in tiles that need the mask). ALiBi
        alone under a right edge at the diagonal: the bias fused with the scale (linear there)."""
        if biased and not capped and window[1] == 0:
            scaled_alibi_tile(s, q_scale, col0, slopes, diags)
        else:
            for nt in range(NS):
                for e in range(4):
                    s[nt, e] *= q_scale
            if capped:
                cap_tile(s, cap)
            if biased:
                alibi_tile(s, col0, slopes, diags)
        if masked:
            mask_tile(s, col0, first_keys, last_keys, window)

    allreduce_max = row_allreduce(nan_max, TM, 4, NT)
    allreduce_sum = row_allreduce(add, TM, 4, NT)

    @device_jit
    def row_max(s, out, rscratch):
        """out[i] = rowmax(S) of row i over the tile (all threads must call)."""
        for i in range(TM):
            out[i] = float32(NEG_INF)
        for nt in range(NS):
            for e in range(4):
                out[e >> 1] = nan_max(out[e >> 1], s[nt, e])
        allreduce_max(out, rscratch)

    @device_jit
    def exp_scores(s, m_ref, row_sums):
        """P~ = exp2(S - m) in place; this thread's part of rowsum(P~)."""
        for i in range(TM):
            row_sums[i] = float32(0.0)
        for nt in range(NS):
            for e in range(4):
                p = math.exp2(s[nt, e] - m_ref[e >> 1])
                s[nt, e] = p
                row_sums[e >> 1] += p

    @device_jit
    def rescale_row(acc, i, alpha):
        """Row i of O~ *= alpha (diag(e^{m_old - m_new}) O~)."""
        for dt in range(DT):
            acc[dt, 2 * i] *= alpha
            acc[dt, 2 * i + 1] *= alpha

    @device_jit
    def zero(acc):
        for dt in range(OUT_TILES):
            for e in range(4):
                acc[dt, e] = float32(0.0)

    ops = ModuleType(f"numba_flash.kernels.tc_ops_{kind}_d{D}_m{BM}_n{BN}" + (f"_p{int(page_size)}" if page_size else "")
                     + (f"_c{int(col_split)}" if COL_SPLIT else ""))
    ops.layout = L
    ops.row_walk = ROW_WALK
    ops.q_frag_rows = Q_FRAG_ROWS  # rows of the kernel's qf / qf_small arrays
    ops.q_small_rows = Q_FRAG_ROWS if SPLIT else 1
    ops.out_tiles = OUT_TILES  # 8-wide tiles of pv_tile's output per warp (DT but in a column split)
    # the kernels call split_k_tile / split_v_tile where these are set and pass their tiles
    ops.presplit_k, ops.presplit_v = PRESPLIT_K, PRESPLIT_V
    for name, func in dict(
        load_q_tile=load_q_tile, load_kv_tile=load_kv_tile, load_q_frags=load_q_frags,
        score_tile=score_tile, pv_tile=pv_tile, store_out=store_out, warp_row0=warp_row0, key_warp=key_warp,
        out_col0=out_col0, pv_step=pv_step,
        thread_row=thread_row, lane_t=lane_t, col_of=col_of, last_visible_key=mask.last_visible_key, packed_last_visible_key=mask.packed_last_visible_key,
        row_key_bounds=row_key_bounds, row_alibi=row_alibi, tile_needs_mask=tile_needs_mask, scale_mask=scale_mask,
        mask_tile=mask_tile, score_key=col_of, score_row=row_of,
        row_max=row_max, allreduce_sum=allreduce_sum, exp_scores=exp_scores, rescale_row=rescale_row,
        zero=zero, finite_or_zero=finite_or_zero, exp2_diff=exp2_diff, log_sum_exp=log_sum_exp,
        reciprocal_or_zero=reciprocal_or_zero, nan_max=nan_max, split_k_tile=split_k_tile, split_v_tile=split_v_tile,
        commit=mma.cp_async_commit, wait_all=mma.cp_async_wait_all, wait_one=mma.cp_async_wait_one,
    ).items():
        setattr(ops, name, func)
    return ops
