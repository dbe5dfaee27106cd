"""FlashAttention-1 forward (Dao et al. 2022, "FlashAttention", Algorithm 1), in numba.cuda.

Loop order: one thread block per (batch, head) -- the paper parallelises over batch and
heads only. The outer loop walks the K/V tiles (line 5) and loads each once into
shared memory (line 6); the inner loop walks every Q tile (line 7), and each inner step
reads Q_i, O_i, l_i, m_i from global memory (line 8), merges the tile's contribution
into them, and writes O_i (normalised, line 12) and l_i, m_i (line 13) back. So O, l, m
make one round trip through HBM per K/V tile: the traffic that FA-2 removes.

The tile work (loads, scores, exp, P~V) is the same register micro-tiled code as FA-2's
(``tile_ops``). A thread always owns the same rows and output columns of every Q tile, so
the O round trip of an element is read and written by one thread. l_i and m_i are written
by the first thread of each row after a barrier that follows every thread's read of them.
"""

from __future__ import annotations

from numba_flash.kernels.engines import CudaCores
from numba_flash.kernels.forward import FA1, forward_kernel
from numba_flash.kernels.tiles import ROWS_PER_THREAD, register_cap
from numba_flash.kernels.mask import window_of


def casts_output(dtype: str) -> bool:
    """True when O lives in a float32 scratch in HBM and a final pass casts it to the
    output dtype (FA-1 keeps O, l, m in float32, line 2); float32 outputs are O itself."""
    return dtype != "float32"


def fa1_kernel(head_dim: int, block_m: int, block_n: int, window, permuted: bool = False, cast_out: bool = False,
               rows_per_thread: int = ROWS_PER_THREAD, maxreg: int | None = None, softcap: bool = False,
               alibi: bool = False, user_mods=None):
    """The FA-1 kernel: ``kernels.forward`` at its named point :data:`~numba_flash.kernels.forward.FA1`
    (K/V outer, one block per (batch, head), O normalised at every step, O_i read at the update).

    Launch: ``grid = (B * H,)``, ``block = (tile_layout(...).threads,)``; arguments: the
    skeleton's (``o_hbm``, ``l_hbm``, ``m_hbm``: the paper's O, l, m in global memory,
    initialised by the kernel, line 2; with ``cast_out`` O is cast into ``o`` at the end).
    """
    rows = int(rows_per_thread)
    return forward_kernel(FA1, CudaCores(head_dim, block_m, block_n, rows), window_of(window), bool(permuted), False,
                          bool(cast_out), max_registers=register_cap(head_dim, rows, maxreg), softcap=bool(softcap), alibi=bool(alibi),
                          user_mods=user_mods)
