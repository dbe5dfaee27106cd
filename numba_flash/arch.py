"""Hardware limits of the GPUs the kernels run on: one place for every per-SM and per-block number.

:class:`ArchLimits` holds the limits of one compute capability (CUDA C Programming Guide, table
"Technical Specifications per Compute Capability"; allocation granularities from the CUDA
Occupancy Calculator) and :data:`ARCH` those of the architectures ``numba-flash occupancy``
knows. The kernels are tuned for one target, the H100/H200 (sm_90, :data:`TARGET`): the
module-level constants below are its limits, and every tile check, shared-memory opt-in and
tile rule reads them from here.

Library limits that are not hardware (the largest head dim, the tile choices) live with the
tile table (``numba_flash.tile_table``) and the kernels' layouts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchLimits:
    """Per-SM and per-block limits of one compute capability (defaults: sm_90)."""

    max_threads: int = 2048
    max_warps: int = 64
    max_blocks: int = 32
    registers: int = 65536  # registers of one SM: threads x registers of one block must fit
    sub_partitions: int = 4  # the register file is split among 4 schedulers; a warp lives in one
    reg_alloc_unit: int = 256  # registers are given to a warp in chunks of 256
    smem_per_sm: int = 228 * 1024
    smem_alloc_unit: int = 128
    smem_reserved_per_block: int = 1024  # taken by the system for every resident block
    smem_static_per_block: int = 48 * 1024  # what a kernel may declare statically / launch without opting in
    smem_optin_per_block: int = 227 * 1024  # the opt-in maximum of dynamic shared memory per block


ARCH = {
    (8, 0): ArchLimits(smem_per_sm=164 * 1024, smem_optin_per_block=163 * 1024),
    (8, 6): ArchLimits(max_threads=1536, max_warps=48, max_blocks=16, smem_per_sm=100 * 1024,
                       smem_optin_per_block=99 * 1024),
    (8, 9): ArchLimits(max_threads=1536, max_warps=48, max_blocks=24, smem_per_sm=100 * 1024,
                       smem_optin_per_block=99 * 1024),
    (9, 0): ArchLimits(),
}

TARGET_CC = (9, 0)  # H100 / H200: what the tiles, shared-memory sizes and register caps are chosen for
TARGET = ARCH[TARGET_CC]

STATIC_SMEM_LIMIT = TARGET.smem_static_per_block  # 48 KiB: static shared memory / dynamic without opting in
SMEM_OPTIN_LIMIT = TARGET.smem_optin_per_block  # 227 KiB (232448 B): the most a block may opt in to
SMEM_PER_SM = TARGET.smem_per_sm  # 228 KiB: shared memory of one SM
SMEM_RESERVED = TARGET.smem_reserved_per_block  # 1 KiB taken by the system for every resident block
SM_REGISTERS = TARGET.registers  # 64K registers of one SM
MAX_GRID_YZ = 65535  # a launch grid's y and z extents (x: 2^31 - 1), every compute capability


def blocks_per_sm_by_smem(smem_bytes: int, arch: ArchLimits = TARGET) -> int:
    """Blocks of ``smem_bytes`` of shared memory each that one SM holds (the system's reserve
    counted, allocation granularity not: the backward's tile rule)."""
    return arch.smem_per_sm // (smem_bytes + arch.smem_reserved_per_block)
