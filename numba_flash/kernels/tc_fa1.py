"""FlashAttention-1 forward (Dao et al. 2022, Algorithm 1) on tensor cores: ``kernels.forward`` at
its named point :data:`~numba_flash.kernels.forward.FA1` on the mma engine (``engines.mma_engine``).

One block per (batch, head); outer loop over K/V tiles, inner over Q tiles; O, l, m round-trip
through global memory in float32 (line 2), O normalised at every step. A thread always owns the
same rows and columns of every Q tile (the mma accumulator layout), so each O element's round
trip is read and written by one thread; l_i and m_i are written by the row's lane t = 0 after a
barrier that follows every lane's read of them.

Launch: ``grid = (B * H,)``, ``block = (layout.threads,)``, dynamic shared memory
``layout.smem_bytes``. Arguments: the skeleton's (``kernels.forward``): ``o_hbm (B,H,Nq,D)
float32``, ``l_hbm, m_hbm (B,H,Nq) float32`` (the paper's O, l, m; initialised here); ``o`` in the
input element type, written from ``o_hbm`` at the end; ``kv_order`` and ``seqlens`` not read.
"""

from __future__ import annotations

from numba_flash.kernels.engines import TensorCores
from numba_flash.kernels.forward import FA1, forward_kernel
from numba_flash.kernels.mask import window_of


def tc_fa1_kernel(kind: str, head_dim: int, block_m: int, block_n: int, window, max_registers=None,
                  presplit=None, softcap: bool = False, alibi: bool = False,
                  user_mods=None):
    """The tensor-core FA-1 kernel for one specialisation (memoised by ``forward_kernel``);
    ``max_registers``: the register cap (``tc_ops.tc_register_cap``, through the spec);
    ``presplit``: ``tc_ops.tc_layout``'s."""
    tiles = TensorCores(kind, head_dim, block_m, block_n, presplit=presplit)
    return forward_kernel(FA1, tiles, window_of(window), cast_out=True, max_registers=max_registers,
                          softcap=bool(softcap), alibi=bool(alibi), user_mods=user_mods)
