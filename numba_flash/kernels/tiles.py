"""Tile sizes: which (block_m, block_n) the kernels can run, and the tuned defaults.

block_m: Q-tile rows = threads per block (one query row per thread).
block_n: K/V-tile rows held in shared memory.

Limits, both kernels alike:
- block_m is a power of two from 1 to 256 (one thread a row; 256 threads x 255
  registers is the register file of one SM);
- block_n is a power of two from 1 to 128;
- shared memory per block, ``4 * (2 * block_n * head_dim + block_n * block_m)`` bytes
  (K_j and V_j tiles plus the score column of each thread, all float32), must fit the
  48 KiB that a kernel may use statically.
"""

from __future__ import annotations

import operator

BLOCK_M_CHOICES = tuple(2**p for p in range(0, 9))  # 1 .. 256
BLOCK_N_CHOICES = tuple(2**p for p in range(0, 8))  # 1 .. 128
STATIC_SMEM_LIMIT = 48 * 1024
MAX_HEAD_DIM = 128


def smem_bytes(head_dim: int, block_m: int, block_n: int) -> int:
    """Static shared memory of one block: K_j and V_j (block_n x D) and S (block_n x block_m)."""
    return 4 * (2 * block_n * head_dim + block_n * block_m)


def default_tiles(algorithm: str, head_dim: int, dtype_name: str, causal: bool) -> tuple[int, int]:
    """The tuned (block_m, block_n) for a problem class (measured on an H200, see docs)."""
    del algorithm, dtype_name, causal  # one choice fits all for now; see docs/results.md
    # H200, 2026-11-29 (docs/performance-log.md): at D = 64, within run-to-run noise of the
    # best (128 x 16); at D = 128 the best (9.9 TFLOP/s against 7.7 for 64 x 16; it fills
    # the 48 KiB exactly). `numba-flash autotune` caches a per-GPU choice instead.
    return 128, 32


def check_tiles(head_dim: int, block_m: int, block_n: int) -> None:
    """Raise ``ValueError`` naming the argument when a kernel cannot run these tiles."""
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
    need = smem_bytes(head_dim, block_m, block_n)
    if need > STATIC_SMEM_LIMIT:
        fitting = [n for n in BLOCK_N_CHOICES if smem_bytes(head_dim, block_m, n) <= STATIC_SMEM_LIMIT]
        raise ValueError(
            f"block_m={block_m}, block_n={block_n} with head_dim={head_dim} need {need} bytes of "
            f"shared memory, more than the {STATIC_SMEM_LIMIT} a block can have; with this "
            f"block_m, block_n can be one of {fitting}"
        )


def register_cap(head_dim: int) -> int | None:
    """Registers per thread the FA-2 kernel is held to (``None``: the compiler's choice).

    Up to D = 64 the kernel needs ~167 registers (q row and O row, 2 x D, plus
    addressing); 168 lets three 128-thread blocks share an SM. Without the cap the causal
    kernel, whose mask bound differs per thread, was given 222 registers by ptxas and
    ran two blocks per SM (H200, 2026-11-29). Above D = 64 nothing fits: no cap.
    """
    return 168 if head_dim <= 64 else None
