"""Experiment switches: the environment variables that override a kernel choice, read here only.

Each switch is a knob for sweeps and measurements on a GPU, not part of the API: unset, the
library runs its measured defaults (``numba_flash.tile_table``, the kernels' layouts). The host
reads a switch when it makes a configuration (``specs.kernel_spec``, ``api.choose_tiles``, the
tile table) and passes the value to the kernel-side functions as an argument; nothing under
``numba_flash/kernels/`` reads the environment. Configurations are memoised (specs, layouts,
kernels): set a variable before the process's first call that uses it.

========================================  ====================================================
``NUMBA_FLASH_FFMA_ROWS_PER_THREAD``      4 or 8: the CUDA-core forward's micro-tile height for
                                          every tile (:func:`ffma_rows_per_thread`; default:
                                          ``tile_table.forward_rows_per_thread``)
``NUMBA_FLASH_FFMA_MAXREG``               registers per thread of the CUDA-core forward, 0: no
                                          cap (:func:`ffma_maxreg`; default ``tiles.register_cap``)
``NUMBA_FLASH_TC_MAXREG``                 the same for the tensor-core forward
                                          (:func:`tc_maxreg`; default ``tc_ops.tc_register_cap``:
                                          none)
``NUMBA_FLASH_TF32X3_PRESPLIT``           tf32x3 at D > 64 with 8 warps: the operands split once
                                          in shared memory, letters of "qkv" or "none"
                                          (:func:`tf32x3_presplit`; default
                                          ``tc_ops.PRESPLIT_DEFAULT``)
``NUMBA_FLASH_TC_BWD_TILES``              ``"MxN"``: the tensor-core backward's tiles on a GPU
                                          (:func:`tc_bwd_tiles`; default
                                          ``tile_table.backward_tc_tiles``)
========================================  ====================================================
"""

from __future__ import annotations

import os

FFMA_ROWS_PER_THREAD = "NUMBA_FLASH_FFMA_ROWS_PER_THREAD"
FFMA_MAXREG = "NUMBA_FLASH_FFMA_MAXREG"
TC_MAXREG = "NUMBA_FLASH_TC_MAXREG"
TF32X3_PRESPLIT = "NUMBA_FLASH_TF32X3_PRESPLIT"
TC_BWD_TILES = "NUMBA_FLASH_TC_BWD_TILES"

SWITCHES = (FFMA_ROWS_PER_THREAD, FFMA_MAXREG, TC_MAXREG, TF32X3_PRESPLIT, TC_BWD_TILES)
ROWS_PER_THREAD_CHOICES = (4, 8)  # the CUDA-core forward's micro-tile heights


def raw(name: str) -> str | None:
    """The one read of the environment: switch ``name``'s text, ``None`` when unset."""
    if name not in SWITCHES:
        raise KeyError(f"{name!r} is not an experiment switch; one of {list(SWITCHES)}")
    return os.environ.get(name)


def ffma_rows_per_thread() -> int | None:
    """``NUMBA_FLASH_FFMA_ROWS_PER_THREAD``: 4 or 8, or ``None`` (unset or blank: the tile
    table's choice per tile). ``ValueError`` for anything else."""
    text = (raw(FFMA_ROWS_PER_THREAD) or "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) not in ROWS_PER_THREAD_CHOICES:
        raise ValueError(f"{FFMA_ROWS_PER_THREAD} must be one of {list(ROWS_PER_THREAD_CHOICES)}; got {text!r}")
    return int(text)


def ffma_maxreg() -> int | None:
    """``NUMBA_FLASH_FFMA_MAXREG``: the CUDA-core forward's register cap (0: no cap), or
    ``None`` (unset or blank: ``tiles.register_cap``'s default)."""
    text = (raw(FFMA_MAXREG) or "").strip()
    return int(text) if text else None


def tc_maxreg() -> int | None:
    """``NUMBA_FLASH_TC_MAXREG``: the tensor-core forward's register cap (0: no cap), or ``None``
    (unset: ``tc_ops.tc_register_cap``'s default, no cap)."""
    text = raw(TC_MAXREG)
    return None if text is None else int(text)


def tf32x3_presplit() -> str | None:
    """``NUMBA_FLASH_TF32X3_PRESPLIT``: the operands a tf32x3 kernel at D > 64 with 8 warps
    splits once in shared memory, in the canonical order of "qkv" ("" for "none" or "0"; "k"
    brings "v": K_j's split walks the loop that splits V_j), or ``None`` (unset: the default,
    ``tc_ops.PRESPLIT_DEFAULT``). ``ValueError`` for other letters."""
    text = raw(TF32X3_PRESPLIT)
    if text is None:
        return None
    mode = text.strip().lower()
    mode = "" if mode in ("none", "0") else mode
    if set(mode) - set("qkv"):
        raise ValueError(f"{TF32X3_PRESPLIT}={mode!r}: letters of 'qkv', or 'none'")
    if "k" in mode:
        mode += "v"
    return "".join(c for c in "qkv" if c in mode)


def tc_bwd_tiles() -> tuple[int, int] | None:
    """``NUMBA_FLASH_TC_BWD_TILES="MxN"``: (block_m, block_n) of the tensor-core backward on a
    GPU, or ``None`` (unset or empty: the tile table's)."""
    text = raw(TC_BWD_TILES)
    if not text:
        return None
    m, n = text.lower().split("x")
    return int(m), int(n)
