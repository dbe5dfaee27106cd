"""Tile sizes and the thread layout inside a tile: what the kernels can run, and the defaults.

block_m: Q-tile rows; block_n: K/V-tile rows. Both kernels share one layout per
(head_dim, block_m, block_n), described by :class:`TileLayout`:

- Register micro-tiles. Thread ``(ty, tx)`` (``tid = ty * threads_per_row + tx``) owns
  ``rows_per_thread`` query rows, ``ty + (block_m / rows_per_thread) * i``; of each row it
  owns the score columns ``tx + threads_per_row * j`` (strided: the threads of a row read
  consecutive K rows, conflict-free) and the output columns
  ``4 * tx + 4 * threads_per_row * g + u`` (groups of four: one 128-bit shared load of V).
  So one shared-memory load feeds several FMAs: 4 rows x 4 keys per Q/K load pair.
- The threads of a row are consecutive lanes of one warp, so row statistics (max, sum)
  combine with warp shuffles (``row_reduce``).
- The head dim is padded with zeros to ``padded_dim``, a power of two and a multiple of
  ``4 * threads_per_row``: exact for D = 32, 64, 128; with 8 threads per row (block_n >= 8)
  D = 16 is computed as 32.
- Shared-memory rows are padded so that the 128-bit loads of one warp hit distinct banks:
  Q_i and K_j rows by 4 floats (neighbouring rows start 4 banks apart), P~ rows by
  ``max(threads_per_row, 4)`` (a warp's 4 x 8 stores of P~ cover the 32 banks once).

- Micro-tile height: ``rows_per_thread`` is 4 (``ROWS_PER_THREAD``), or 8 for the forward's
  128 x 64 tiles at D <= 64 (FA-2's float32 default there; ``tile_table.forward_rows_per_thread``,
  which ``NUMBA_FLASH_FFMA_ROWS_PER_THREAD`` overrides): 8 rows halve the shared loads and loop
  overhead per FFMA of both products at the cost of registers. The backward always uses 4.

The default tiles of every path are in ``numba_flash.tile_table``; the hardware limits below
(``STATIC_SMEM_LIMIT``, ``SMEM_OPTIN_LIMIT``, ``SM_REGISTERS``) in ``numba_flash.arch``.

Limits, both kernels alike:
- block_m and block_n are powers of two, 1 to 256 and 1 to 128;
- shared memory per block (:func:`smem_bytes`: Q_i, K_j, V_j and P~ tiles, float32) must fit
  the 227 KiB a block may opt in to; up to 48 KiB the forward declares its tiles statically,
  above it carves them from dynamic shared memory (:func:`uses_dynamic_smem`);
- threads x registers must fit an SM's 64K registers: at most 512 threads under the 128-register
  cap (D <= 64), 256 without a cap.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

from numba_flash.arch import SM_REGISTERS, SMEM_OPTIN_LIMIT, STATIC_SMEM_LIMIT

BLOCK_M_CHOICES = tuple(2**p for p in range(0, 9))  # 1 .. 256
BLOCK_N_CHOICES = tuple(2**p for p in range(0, 8))  # 1 .. 128
ROWS_PER_THREAD = 4  # query rows a thread owns (fewer when block_m < 4)
THREADS_PER_ROW = 8  # threads that share a query row (fewer when block_n < 8)
VEC = 4  # floats per 128-bit shared load


@dataclass(frozen=True)
class TileLayout:
    """Sizes derived from (head_dim, block_m, block_n); all compile-time constants."""

    head_dim: int
    block_m: int
    block_n: int
    rows_per_thread: int  # TM
    threads_per_row: int  # TX
    threads: int  # threads per block: (block_m / TM) * TX
    cols_per_thread: int  # TN: score columns of a row that one thread owns
    padded_dim: int  # DP: head dim rounded up to a power of two >= 4 * TX (zero-filled)
    dim_groups: int  # DG: groups of four output columns a thread owns
    q_stride: int  # floats per Q row in shared memory (DP + 4)
    k_stride: int  # floats per K row in shared memory (DP + 4)
    p_stride: int  # floats per P~ row in shared memory (block_n + max(TX, 4))
    key_chunk: int  # keys per step of the P~V loop (one 128-bit load of P~ per row)

    @property
    def q_floats(self) -> int:
        return self.block_m * self.q_stride

    @property
    def k_floats(self) -> int:
        return self.block_n * self.k_stride

    @property
    def v_floats(self) -> int:
        return self.block_n * self.padded_dim

    @property
    def p_floats(self) -> int:
        return self.block_m * self.p_stride

    # Copies from global to shared memory: ``copy_threads`` threads span the padded head dim
    # (a thread keeps the same d, or d_passes of them), the rest of the block other rows.
    @property
    def copy_threads(self) -> int:
        return min(self.threads, self.padded_dim)

    @property
    def copy_rows_per_pass(self) -> int:
        return self.threads // self.copy_threads

    @property
    def copy_d_passes(self) -> int:
        return self.padded_dim // self.copy_threads

    def copy_loads(self, tile_rows: int) -> int:
        """Elements each thread copies of a ``tile_rows`` x D tile."""
        return -(-tile_rows // self.copy_rows_per_pass) * self.copy_d_passes

    @property
    def kv_loads(self) -> int:
        """Elements of K_j (and of V_j) each thread copies from global memory."""
        return self.copy_loads(self.block_n)

    @property
    def smem_bytes(self) -> int:
        return 4 * (self.q_floats + self.k_floats + self.v_floats + self.p_floats)


@functools.lru_cache(maxsize=None)
def tile_layout(head_dim: int, block_m: int, block_n: int, rows_per_thread: int = ROWS_PER_THREAD) -> TileLayout:
    """The thread layout for one specialisation (see the module docstring)."""
    tm = min(rows_per_thread, block_m)
    tx = min(THREADS_PER_ROW, block_n)
    dp = max(VEC * tx, 1 << (head_dim - 1).bit_length())  # a power of two
    return TileLayout(
        head_dim=head_dim,
        block_m=block_m,
        block_n=block_n,
        rows_per_thread=tm,
        threads_per_row=tx,
        threads=(block_m // tm) * tx,
        cols_per_thread=block_n // tx,
        padded_dim=dp,
        dim_groups=dp // (VEC * tx),
        q_stride=dp + VEC,
        k_stride=dp + VEC,
        p_stride=block_n + max(tx, VEC),
        key_chunk=min(VEC, block_n),
    )


def smem_bytes(head_dim: int, block_m: int, block_n: int) -> int:
    """Shared memory of one block: the Q_i, K_j, V_j and P~ tiles (float32; the same for every
    micro-tile height)."""
    return tile_layout(head_dim, block_m, block_n).smem_bytes


def uses_dynamic_smem(head_dim: int, block_m: int, block_n: int) -> bool:
    """Does the forward carve its tiles from dynamic shared memory? Only when they need more
    than the 48 KiB a kernel may declare statically (below, the static declaration keeps the
    kernels as they were measured)."""
    return smem_bytes(head_dim, block_m, block_n) > STATIC_SMEM_LIMIT


def threads_per_block(head_dim: int, block_m: int, block_n: int, rows_per_thread: int = ROWS_PER_THREAD) -> int:
    return tile_layout(head_dim, block_m, block_n, rows_per_thread).threads


def max_threads(head_dim: int, rows_per_thread: int = ROWS_PER_THREAD, maxreg: int | None = None) -> int:
    """Threads a block may have so that it fits an SM's registers at the register cap (255,
    rounded up to 256, without one); ``maxreg``: :func:`register_cap`'s."""
    return SM_REGISTERS // (register_cap(head_dim, rows_per_thread, maxreg) or 256)


def tiles_fit(head_dim: int, block_m: int, block_n: int, maxreg: int | None = None) -> bool:
    """Can the CUDA-core kernels run these tiles (:func:`check_tiles` raises nothing)?"""
    try:
        check_tiles(head_dim, block_m, block_n, maxreg=maxreg)
    except ValueError:
        return False
    return True


def check_tiles(head_dim: int, block_m: int, block_n: int, rows_per_thread: int = ROWS_PER_THREAD,
                maxreg: int | None = None) -> None:
    """Raise ``ValueError`` naming the argument when a kernel cannot run these tiles (``maxreg``:
    :func:`register_cap`'s, for the registers a block needs)."""
    for name, value, choices in (
        ("block_m", block_m, BLOCK_M_CHOICES),
        ("block_n", block_n, BLOCK_N_CHOICES),
    ):
        try:
            as_int = None if isinstance(value, bool) else operator.index(value)  # NumPy ints too
        except TypeError:
            as_int = None
        if as_int not in choices:
            raise ValueError(
                f"{name}={value!r} is not supported: {name} must be a power of two from "
                f"{choices[0]} to {choices[-1]}, one of {list(choices)}"
            )
    need = smem_bytes(head_dim, int(block_m), int(block_n))
    if need > SMEM_OPTIN_LIMIT:
        fitting = [n for n in BLOCK_N_CHOICES if smem_bytes(head_dim, int(block_m), n) <= SMEM_OPTIN_LIMIT]
        hint = (
            f"with this block_m, block_n can be one of {fitting}"
            if fitting
            else f"no block_n fits with block_m={block_m}; block_m can be one of "
            f"{[m for m in BLOCK_M_CHOICES if smem_bytes(head_dim, m, 1) <= SMEM_OPTIN_LIMIT]}"
        )
        raise ValueError(
            f"block_m={block_m}, block_n={block_n} with head_dim={head_dim} need {need} bytes of "
            f"shared memory, more than the {SMEM_OPTIN_LIMIT} a block can have; {hint}"
        )
    threads = threads_per_block(head_dim, int(block_m), int(block_n), rows_per_thread)
    if threads > max_threads(head_dim, rows_per_thread, maxreg):
        raise ValueError(
            f"block_m={block_m}, block_n={block_n} with head_dim={head_dim} need {threads} threads per block, "
            f"more than the {max_threads(head_dim, rows_per_thread, maxreg)} whose registers fit an SM; use a smaller "
            f"block_m or block_n"
        )


def register_cap(head_dim: int, rows_per_thread: int = ROWS_PER_THREAD, maxreg: int | None = None) -> int | None:
    """Registers per thread the forward kernels are held to (``None``: the compiler's choice).

    128 lets four 128-thread blocks share an SM's 64K registers (the 4-row micro-tile at
    D <= 64). The 8-row micro-tile holds twice the accumulators: uncapped (offline, ptxas sm_90,
    D=64: 238-255 registers; at 168, three blocks of 128 threads, 128 x 32 spills 420 bytes, 35
    local loads and stores per K/V tile outside the products). ``maxreg`` overrides both: the
    value of ``NUMBA_FLASH_FFMA_MAXREG`` (``switches.ffma_maxreg``, an experiment knob like
    ``NUMBA_FLASH_TC_MAXREG``; 0: no cap) that the host read when it made the configuration;
    ``None``: the default.
    """
    if maxreg is not None:
        return int(maxreg) or None
    return 128 if head_dim <= 64 and rows_per_thread == ROWS_PER_THREAD else None
