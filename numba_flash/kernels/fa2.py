"""FlashAttention-2 forward (Dao 2023, "FlashAttention-2", Algorithm 1), in numba.cuda.

Loop order: the grid runs over (Q tiles x batch x heads) -- sequence parallelism, one
block per Q tile -- and each block walks the K/V tiles (the inner loop of the paper,
line 6). The block keeps its Q tile in shared memory and the unnormalised accumulators
O~, l, m in registers for the whole walk, rescales once at the end (line 12), and writes
O and the logsumexp L only (lines 14-15). With ``causal=True`` the K/V tiles that are
masked for every row of the Q tile are skipped (section 3.1.1).

Each thread holds a register micro-tile of O~ (its rows x its slice of the head dim) and
its share of l (the row sum is linear, so the threads of a row keep partial sums and add
them once at the end); m is combined across the row's threads every tile (``row_max``).
The per-tile work (load, scores, exp, P~V) is shared with FA-1 in ``tile_ops``.
"""

from __future__ import annotations

from numba_flash.kernels.engines import CudaCores
from numba_flash.kernels.forward import FA2, forward_kernel
from numba_flash.kernels.tiles import ROWS_PER_THREAD, register_cap
from numba_flash.kernels.mask import window_of


def fa2_kernel(head_dim: int, block_m: int, block_n: int, window, permuted: bool = False, ragged: bool = False,
               rows_per_thread: int = ROWS_PER_THREAD, maxreg: int | None = None, softcap: bool = False,
               alibi: bool = False, user_mods=None):
    """The FA-2 kernel: ``kernels.forward`` at its named point :data:`~numba_flash.kernels.forward.FA2`
    (Q outer, one block per Q tile, the rescale deferred to the end).

    Launch: ``grid = (ceil(Nq / block_m) * B * H * n_splits,)``, ``block = (tile_layout(...).threads,)``;
    arguments: the skeleton's (``o_hbm``, ``l_hbm``, ``m_hbm`` never read), ``o (S*B,H,Nq,D)``
    and ``lse (S*B,H,Nq)`` for ``S = n_splits`` (``block_info``); ``seqlens`` read when ``ragged``.
    """
    rows = int(rows_per_thread)
    return forward_kernel(FA2, CudaCores(head_dim, block_m, block_n, rows), window_of(window), bool(permuted),
                          bool(ragged), max_registers=register_cap(head_dim, rows, maxreg), softcap=bool(softcap), alibi=bool(alibi),
                          user_mods=user_mods)
