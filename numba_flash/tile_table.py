"""The tile table: the default tiles of every kernel path, in one place.

In the spirit of FlashAttention-3's ``hopper/tile_size.h``: one readable entry per path, problem
class -> (block_m, block_n, ...). Every host path reads its defaults here (the forward on CUDA
cores and on tensor cores, the backward in both regimes, decode); the kernels only check what
they are given (``kernels.tiles.check_tiles``, ``tc_ops.check_tc_tiles``,
``tc_bwd.check_tc_bwd_tiles``). The numbers were measured or chosen on an H200 (sm_90,
``numba_flash.arch.TARGET``): docs/performance-log.md has the runs. In the simulator, whose
problems are a few dozen rows and whose every thread is a Python thread, the paths take small
tiles (each entry says which). Experiment switches (``numba_flash.switches``) override two
entries: the forward's micro-tile height and the tensor-core backward's tiles.

=============================  ====================================================  ============
path                           GPU (sm_90)                                           simulator
=============================  ====================================================  ============
forward, CUDA cores            fa2 float32 D <= 64: 128 x 64 (8 rows per thread);    64 x 32 /
(:func:`forward_tiles`)        else D <= 64: 64 x 32, D > 64: 32 x 16 (4 rows)       32 x 16
comparisons (compare, ablate)  D <= 64: 64 x 32, D > 64: 32 x 16                     the same
forward, tensor cores          f16/bf16: D <= 64 64 x 64, else 64 x 32; tf32:         16 x 16
(:func:`forward_tc_tiles`)     D <= 64 128 x 64, else 64 x 64; tf32x3: 128 x 32
backward, CUDA cores           square: D <= 64: 64, D > 64: 32                       8
(:func:`backward_block`)
backward, tensor cores         f16/bf16: 64 x 128; tf32x3: 16 x 64                   16 x 16
(:func:`backward_tc_tiles`)
decode, tensor cores           block_m: 16-row warps holding the packed rows (<= 64), 16 x 32
(:func:`decode_tiles`)         block_n 64; one 16-row tile: 4 key warps, 2 stages
decode, float32                the forward's (CUDA cores)                            the same
D > 128 (``WIDE_HEAD_DIM``)    CUDA cores 64 x 16; tensor cores f16/bf16 64 x 64,     as above
                               tf32 64 x 32, tf32x3 128 x 32; backward: CUDA cores
                               16, tensor cores FA-2 64 x 64 (FA-1 32 x 64), tf32x3
                               16 x 32; decode as above
=============================  ====================================================  ============
"""

from __future__ import annotations

from numba_flash import switches
from numba_flash._world import simulated
from numba_flash.kernels.tiles import ROWS_PER_THREAD

MAX_HEAD_DIM = 256  # the largest head dim the library takes (API.md 2e): every entry below covers 1 .. 256

# ------------------------------------------------------------------------------------------
# Forward on CUDA cores (FFMA register micro-tiles: kernels.forward, kernels.tiles)
# ------------------------------------------------------------------------------------------

EIGHT_ROW_TILES = ((128, 64),)  # (block_m, block_n) that take 8 rows per thread by default, at D <= 64


WIDE_HEAD_DIM = 128  # above this head dim every path takes its "wide" entry (issue 25: D up to 256)
WIDE_COMPARISON_TILES = (64, 16)  # CUDA cores at D > 128 (offline, ptxas sm_90, D = 256: see comparison_tiles)


def comparison_tiles(head_dim: int) -> tuple[int, int]:
    """The one CUDA-core tile choice for every kernel of a comparison (``numba-flash compare``,
    ``ablate``) whose caller names none: FA-1 and FA-2 at the same tiles, so that their ratio is
    the loop order's and not the tiles'. 64 x 32 (D <= 64: 128 threads, 43.5 KiB, 4 blocks/SM
    by registers; FA-2 D = 64: 29-30 TFLOP/s against 27-29 at 32 x 32 and 24-25 at 64 x 16)
    and 32 x 16 (D > 64: 64 threads, 35.8 KiB at D = 128; 26 TFLOP/s against 21 at 64 x 8), at
    4 rows per thread: measured for both loop orders on the H200 (2026-11-29). FA-2's own
    float32 default at D <= 64 is larger (:func:`forward_tiles`). Above D = 128
    (``WIDE_COMPARISON_TILES``): 64 x 16 (128 threads, 103 KiB of dynamic shared memory, 2 blocks
    per SM), chosen offline at D = 256 (ptxas sm_90): FA-2 244-252 registers and no spill, FA-1
    255 and 12-24 bytes; 32 x 16 spilled 28-100 bytes in FA-2 and 16 x 16 runs 32-thread blocks.
    At D = 256 every one of these keeps the output micro-tile (128 floats a thread) in local
    memory (a 512-byte stack frame): the CUDA-core path there is a correct baseline, not a fast one."""
    if head_dim > WIDE_HEAD_DIM:
        return WIDE_COMPARISON_TILES
    return (64, 32) if head_dim <= 64 else (32, 16)


def forward_tiles(algorithm: str, head_dim: int, dtype_name: str, causal: bool) -> tuple[int, int]:
    """(block_m, block_n) of the CUDA-core forward for a problem class (H200, see docs).

    FA-2 float32 at D <= 64: 128 x 64 at 8 rows per thread (:func:`forward_rows_per_thread`), in
    dynamic shared memory (103 KiB): 15% faster than 64 x 32 (2026-11-30). Not in the
    simulator, whose problems are a few dozen rows: there a 128 x 64 tile is mostly padding at
    4x the cost (tests/kernels/test_forward_tiles.py runs it by name). Otherwise one choice per head dim
    (:func:`comparison_tiles`): on the H200 (2026-11-29, docs/performance-log.md) the same tiles
    were best or within noise for FA-1 and FA-2, float32 and float16, causal or not."""
    if algorithm == "fa2" and dtype_name == "float32" and head_dim <= 64 and not simulated():
        return 128, 64
    del causal
    return comparison_tiles(head_dim)


def forward_rows_per_thread(head_dim: int = MAX_HEAD_DIM, block_m: int = 0, block_n: int = 0) -> int:
    """The CUDA-core forward's micro-tile height for these tiles: ``NUMBA_FLASH_FFMA_ROWS_PER_THREAD``
    (4 or 8, ``switches.ffma_rows_per_thread``) when set; else 8 for the tiles of
    ``EIGHT_ROW_TILES`` at D <= 64 (128 x 64, 128 threads, 255 registers, 2 blocks per SM: 8.67
    ms against 9.95 for 64 x 32 at 4 rows, B1 H8 N16384 D64 causal float32 on the H200;
    docs/performance-log.md, "Tiles above 48 KiB and 8 rows per thread"), and 4 for every other
    tile. Read when a kernel specification is first made for a configuration
    (``specs.kernel_spec`` is memoised): set the variable before the process's first call."""
    override = switches.ffma_rows_per_thread()
    if override is not None:
        return override
    if head_dim <= 64 and (block_m, block_n) in EIGHT_ROW_TILES:
        return 8
    return ROWS_PER_THREAD


# ------------------------------------------------------------------------------------------
# Forward on tensor cores (mma.sync: kernels.tc_fa1, kernels.tc_fa2)
# ------------------------------------------------------------------------------------------

TC_FORWARD_TILES = {  # kind -> ((block_m, block_n) at D <= 64, at D > 64); H200 sweep, B4 H16 N4096, 2026-11-30
    "f16": ((64, 64), (64, 32)),  # D64: 64 x 64 187-200 TFLOP/s; D128: 64 x 32 216 (64 x 64 196)
    "bf16": ((64, 64), (64, 32)),  # as f16
    "tf32": ((128, 64), (64, 64)),  # D64: 128 x 64 88 TFLOP/s; D128: 64 x 64 80
    "tf32x3": ((128, 32), (128, 32)),  # D64 41 TFLOP/s (128 x 64 alike), D128 35 before the per-tile split
}
# D > 128 (issue 25), offline at D = 256 (ptxas sm_90, docs/performance-log.md 18): 16-bit 64 x 64
# (254 registers, no spill, 99 KiB, 2 blocks per SM; 230 TFLOP/s on the H200, 0.70x flash: perf
# log 17); tf32 64 x 32 (237, no spill; 64 x 64 keeps 128 bytes of stack, 128 x 32 spills 72);
# tf32x3 as below.
TC_FORWARD_WIDE_TILES = {"f16": (64, 64), "bf16": (64, 64), "tf32": (64, 32), "tf32x3": (128, 32)}
TC_SIM_TILES = (16, 16)  # the simulator: one warp (every thread a Python thread, every product a barrier)


def forward_tc_tiles(kind: str, head_dim: int) -> tuple[int, int]:
    """(block_m, block_n) of the tensor-core forward (docs/performance-log.md version 8);
    ``head_dim``: the kernel's (``tc_ops.kernel_head_dim``). The simulator: 16 x 16."""
    if simulated():
        return TC_SIM_TILES
    if head_dim > WIDE_HEAD_DIM:
        return TC_FORWARD_WIDE_TILES[kind]
    small, large = TC_FORWARD_TILES[kind]
    return small if head_dim <= 64 else large


# FlashAttention-3 on Hopper (kernels.fa3): (block_m, block_n, K/V stages) by the kernel's head dim,
# FA-3's own choices where they fit (its tile_size_fwd_sm90): 192 x 128 at D = 64 (three consumer
# warpgroups; the H200 sweep of results section 16b: 1.06-1.20x our 128 x 128 there, and better than
# 128 x 176, 128 x 192 or three stages; its three warpgroups take no turns, fa3.takes_turns), 128 x 128
# at 128; at 256 128 x 64 (FA-3 takes 128 x 80 there, which spills 44 bytes in our kernel and filled
# 226 KiB; 128 x 64 spills none, 192 KiB, and ran 1-4% faster at B4 N4096, in 6 of 6 medians of
# alternating pairs over three runs on the H200, even at B1 N16384, results 16n). 128 x 176 at D = 128
# (FA-3's non-causal tile) measured even with 128 x 128 in the same pairs. The simulator: one consumer
# warpgroup, 64-key tiles.
FA3_TILES = {64: (192, 128, 2), 128: (128, 128, 2), 256: (128, 64, 2)}
FA3_SIM_TILES = (64, 64, 2)
# float8 (e4m3): block_n a multiple of 32 (the e4m3 product's K; V^T in boxes of 128-, 64- or 32-byte
# rows, kernels.fa3.value_row_bytes). At D = 128, 192 x 96 (three consumer warpgroups: two softmaxes
# share each sub-partition, and fp8's softmax is what bounds it): on the H200 faster than 128 x 128 in
# 18 of 19 same-process pairs over three processes (by 1-14%), and than FA-3's own 128 x 224 but at B1
# N16384 causal (results 16j); the 0.86 ms once measured for it was the timing's order, not the tile
# (performance log 28).
# D = 256: 128 x 128 (192 rows do not compile there, check_fa3_tiles).
FA3_FP8_TILES = {128: (192, 96, 2), 256: (128, 128, 2)}
FA3_FP8_SIM_TILES = (64, 128, 2)


def fa3_tiles(head_dim: int, fp8: bool = False) -> tuple[int, int, int]:
    """(block_m, block_n, stages) of the FA-3 forward; ``head_dim``: the kernel's (64, 128 or 256;
    fp8: 128 or 256)."""
    if fp8:
        return FA3_FP8_SIM_TILES if simulated() else FA3_FP8_TILES[head_dim]
    return FA3_SIM_TILES if simulated() else FA3_TILES[head_dim]


# ------------------------------------------------------------------------------------------
# Backward on CUDA cores (kernels.bwd: square block x block tiles)
# ------------------------------------------------------------------------------------------

BACKWARD_BLOCKS = ((64, 64), (WIDE_HEAD_DIM, 32), (MAX_HEAD_DIM, 16))  # (largest head dim, block): the first that covers D
BACKWARD_SIM_BLOCK = 8  # the simulator: 16 threads, one micro-tile column per thread
BACKWARD_BLOCK_CHOICES = (64, 32, 16, 8)  # the rule's candidates, largest first (64: a thread's registers stay < 255)
BACKWARD_MIN_BLOCKS_PER_SM = 2  # the rule: at least this many FA-2 K/V blocks resident per SM by shared memory


def backward_block(head_dim: int) -> int:
    """The square tile of the CUDA-core backward kernels (block_m = block_n = the result).

    On the GPU (sm_90), the rule: the largest of ``BACKWARD_BLOCK_CHOICES`` whose FA-2 K/V
    kernel (Q_i, dO_i, K_j, V_j, P^T, dS^T: the most shared memory of the FA-2 kernels) leaves
    ``BACKWARD_MIN_BLOCKS_PER_SM`` = 2 blocks resident on an SM by shared memory
    (tests/host/test_tile_table.py checks the table against it). D <= 64: 64 (104.5 KiB at D = 64, 2
    blocks of 128 threads, 8 warps per SM); 64 < D <= 128: 32 (76.3 KiB, 2 blocks of 64 threads;
    64 would need 168.5 KiB, one block per SM, and ~230 registers); D > 128: 16 (68.1 KiB at
    D = 256; offline, ptxas sm_90, the FA-2 kernel spills 1164 bytes there at 255 registers, as
    it does at 32: a thread's dK_j, dV_j micro-tiles outgrow the registers: a correct baseline,
    not a fast one). Square, because the K/V
    kernels run the forward's layout on the transposed scores: its rows are keys and its columns
    queries. 64 at most: at 128 a thread's dK_j, dV_j, S^T and dP^T micro-tiles alone exceed
    255 registers. In the simulator 8 (16 threads; the same code paths, each thread one column
    of the scores)."""
    if simulated():
        return BACKWARD_SIM_BLOCK
    for largest, block in BACKWARD_BLOCKS:
        if head_dim <= largest:
            return block
    return BACKWARD_BLOCKS[-1][1]


# ------------------------------------------------------------------------------------------
# Backward on tensor cores (kernels.tc_bwd)
# ------------------------------------------------------------------------------------------

TC_BACKWARD_TILES = {  # kind -> (block_m, block_n) on sm_90: queries per Q tile, keys per K/V tile
    # 64 x 128 (8 warps of 16 keys), FlashAttention-2's shape for its sm80 D = 128 backward.
    # Chosen offline, unmeasured (docs/performance-log.md, "Backward on tensor cores"): ptxas for
    # sm_90 gives the FA-2 kernel 254 registers at D = 64 and 248 at D = 128 with no spills, one
    # block of 8 warps per SM; 64 x 64 (4 warps, two blocks per SM: also 8 warps) has no spills
    # either but twice the dQ atomics and the L2 reads of Q_i, dO_i.
    "f16": (64, 128),
    "bf16": (64, 128),
    # tf32x3 (float32 tiles; docs/performance-log.md "Backward in tf32x3"; offline choice): the
    # same 16 x 64 at every head dim.
    "tf32x3": (16, 64),
}
# D > 128 (issue 25): the K/V kernels split dK_j, dV_j's columns between two warps per 16 keys,
# which split S^T, dP^T by queries (16-bit: ``tc_bwd.TcBwdLayout.col_split``, ``shared_scores``).
# H200, D = 256 f16 B4 H16 N4096 (docs/performance-log.md 18): FA-2 64 x 64 (8 warps, 232
# registers, no spill, 216 KiB) 17.99 ms, 0.622x flash (causal 0.633x); 32 x 64 19.40 ms; 32 x 32
# 23.25; 64 x 32 31.81. FA-1 (O_i's tiles too: 64 x 64 would need 282 KiB): 32 x 64. tf32x3
# (offline): 16 x 32, 380-504 bytes of spill, causal (16 x 64: FA-1 would need 233 KiB).
TC_BACKWARD_WIDE_TILES = {"f16": (64, 64), "bf16": (64, 64), "tf32x3": (16, 32)}
TC_BACKWARD_WIDE_FA1_TILES = {"f16": (32, 64), "bf16": (32, 64), "tf32x3": (16, 32)}
TC_BACKWARD_SIM_TILES = (16, 16)  # the simulator: one warp (two above D = 128)


def backward_tc_tiles(head_dim: int, kind: str = "f16", algorithm: str = "fa2") -> tuple[int, int]:
    """(block_m, block_n) of the tensor-core backward; ``head_dim``: the kernel's; ``algorithm``:
    the loop order (FA-1's kernel holds O_i's tiles too: above D = 128 it takes smaller ones). On a GPU
    ``NUMBA_FLASH_TC_BWD_TILES="MxN"`` (``switches.tc_bwd_tiles``) overrides the table (an
    experiment knob for sweeps); the simulator: 16 x 16, one warp, whatever the switch says."""
    if simulated():
        return TC_BACKWARD_SIM_TILES
    override = switches.tc_bwd_tiles()
    if override is not None:
        return override
    if head_dim > WIDE_HEAD_DIM:
        table = TC_BACKWARD_WIDE_FA1_TILES if algorithm == "fa1" else TC_BACKWARD_WIDE_TILES
    else:
        table = TC_BACKWARD_TILES
    return table.get(kind, table["tf32x3"])


# ------------------------------------------------------------------------------------------
# Decode (kernels.tc_fa2 on GQA-packed rows; float32: the CUDA-core forward)
# ------------------------------------------------------------------------------------------

DECODE_BLOCK_N = 64  # K/V rows per tile: 16 KiB of K (and of V) per tile at D = 128, 16-bit
DECODE_MAX_BLOCK_M = 64  # block_m grows by 16-row warps up to the packed rows, at most this
DECODE_KV_STAGES = 1  # K/V tiles in shared memory at once (tc_fa2_kernel's kv_stages; 1: K_j, V_j in turn)
# One 16-row tile (all packed queries of a KV head): warps that split each K/V tile's keys, over
# a ring of tiles (tc_fa2_kernel's key_warps and kv_stages; docs/performance-log.md 9j).
DECODE_KEY_WARPS = 4
DECODE_KEY_WARP_STAGES = 2  # 1M keys: 944.9 us with 2 stages (32 splits), 952.4 with 3 (H200, same process)
DECODE_SIM_TILES = (16, 32)  # the simulator


def decode_tiles(dtype: str, rows: int, head_dim: int):
    """(block_m, block_n) of a decode call of ``rows`` packed query rows: the fewest 16-row warps
    that hold them (at most 4), and K/V tiles of ``DECODE_BLOCK_N`` rows; float32 (CUDA cores):
    ``(None, None)``, the forward's defaults (:func:`forward_tiles`)."""
    del head_dim  # one entry at every head dim (so far)
    if dtype == "float32":
        return None, None
    if simulated():
        return DECODE_SIM_TILES
    block_m = 16
    while block_m < min(rows, DECODE_MAX_BLOCK_M):
        block_m *= 2
    return block_m, DECODE_BLOCK_N


def decode_pipeline(block_m: int, block_n: int) -> tuple[int, int]:
    """(kv_stages, key_warps) of a tensor-core decode kernel: with one 16-row tile, up to
    ``DECODE_KEY_WARPS`` warps of at least 16 keys each over a ring of
    ``DECODE_KEY_WARP_STAGES`` tiles; else ``DECODE_KV_STAGES``, one warp per 16 rows."""
    warps = min(DECODE_KEY_WARPS, block_n // 16) if block_m == 16 else 1
    if warps > 1:
        return DECODE_KEY_WARP_STAGES, warps
    return DECODE_KV_STAGES, 1
