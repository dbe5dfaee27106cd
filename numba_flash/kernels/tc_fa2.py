"""FlashAttention-2 forward (Dao 2023, Algorithm 1) on tensor cores: ``kernels.forward`` at its
named point :data:`~numba_flash.kernels.forward.FA2` on the mma engine (``engines.mma_engine``,
``pipeline.cp_async``).

Grid over Q tiles x batch x heads (times the splits); each block walks the K/V tiles with O~, l,
m on chip and rescales once at the end. Products on ``mma.sync``, Q_i's fragments in registers
for the whole walk, P~ kept in registers and converted to the input type for P~V. Copies are
``cp.async`` and overlap the products: V_j is in flight while S = Q_i K_j^T is computed, K_{j+1}
while O~ += P~ V_j is; or, with ``kv_stages = S > 1`` (decode's knob), a ring of S K/V tiles.

Launch: ``grid = (ceil(Nq / block_m) * B * H * n_splits,)``, ``block = (layout.threads,)``,
dynamic shared memory ``tc_layout(kind, D, block_m, block_n, kv_stages, key_warps=...).smem_bytes``.
Arguments: the skeleton's (``kernels.forward``): 16-bit inputs as uint16 bit patterns (float32 for
TF32; D a multiple of 8 resp. 4, rows 16-byte aligned); ``o (S*B,H,Nq,D)`` of the input element
type, float32 when compiled ``f32_out`` (split partials); ``o_hbm``, ``l_hbm``, ``m_hbm`` and
``kv_order`` are not read.
"""

from __future__ import annotations

from numba_flash.kernels.engines import TensorCores
from numba_flash.kernels.forward import FA2, forward_kernel
from numba_flash.kernels.mask import window_of


def tc_fa2_kernel(kind: str, head_dim: int, block_m: int, block_n: int, window, ragged: bool = False,
                  f32_out: bool = False, max_registers=None, row_walk=None, kv_stages: int = 1, presplit=None,
                  key_warps: int = 1, softcap: bool = False, alibi: bool = False,
                  user_mods=None):
    """The tensor-core FA-2 kernel for one specialisation (memoised by ``forward_kernel``):
    ``max_registers``: the register cap (``tc_ops.tc_register_cap``, through the spec);
    ``row_walk``: the K/V copies' loop (``tc_ops.row_walk_default`` when ``None``);
    ``kv_stages``: 1 (K_j and V_j in flight in turn) or a ring of that many K/V tiles;
    ``presplit``: ``tc_ops.tc_layout``'s (tf32x3 at D > 64; only with ``kv_stages = 1``);
    ``key_warps`` (with a ring, 16-row Q tiles): the block's warps all hold the Q tile's 16 rows
    and split every K/V tile's keys, each warp with its own (m, l, O~), merged at the end of the
    walk (``engines.key_warp_merge``; docs/performance-log.md 9j)."""
    tiles = TensorCores(kind, head_dim, block_m, block_n, row_walk, presplit, int(kv_stages), int(key_warps))
    return forward_kernel(FA2, tiles, window_of(window), False, bool(ragged), f32_out=bool(f32_out),
                          max_registers=max_registers, softcap=bool(softcap), alibi=bool(alibi),
                          user_mods=user_mods)
