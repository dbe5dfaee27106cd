"""The kernels (device code) and what they share: the forward, the backward, split-KV's combine.

- ``tile_ops``: device functions both kernels call (tile loads, S = Q K^T for one
  tile as register micro-tiles, masking, row max, P~ = exp(S - m) and its row sums,
  P~ V, NaN-propagating max).
- ``row_reduce``: a row statistic combined across the threads of a row (warp shuffles;
  shared memory in the simulator).
- ``fa1``: FlashAttention Algorithm 1 (outer K/V, inner Q, O/l/m round-trip via HBM).
- ``fa2``: FlashAttention-2 Algorithm 1 (outer Q, inner K/V, accumulators on chip).
- ``tiles``: the thread layout of a tile, which (block_m, block_n) a kernel can run, and
  the tuned defaults.
- ``jit``: compile options that differ between the GPU and the simulator.
- ``mask``: which keys a query row sees (the causal rule, in both directions: last visible key
  of a row of S, first visible query of a row of S^T), tile-level mask questions, and the one
  routine that masks an engine's register tile of scores.
- ``softmax``: the online-softmax algebra on the device (edge cases, the row update of FA-2
  lines 9-10, the merge weights of two states), shared by every kernel.
- ``block_info``: how a block's index maps to its tiles, batch, head and split (grids and
  split-KV ranges), for every kernel.

Tensor cores (``precision``, API.md section 2a):

- ``mma``: the primitives (``mma.sync``, ``ldmatrix``, ``cp.async``, conversions) as inline
  PTX, each with a simulator twin of the same per-lane semantics.
- ``tc_ops``: one (Q tile, K/V tile) step on them (split-Q warps, P~ kept in registers).
- ``engines``: the forward's engine interface over ``tile_ops`` and ``tc_ops``; ``pipeline``:
  the copy policies; ``forward``: FA-1's and FA-2's loop nests, once, over both.
- ``tc_fa1``, ``tc_fa2``: the skeleton at FA-1's and FA-2's points on tensor cores.

The backward (FlashAttention Alg. 4, FlashAttention-2 Alg. 2):

- ``backward``: its two loop nests, once each (dK/dV with K/V outside; the deterministic dQ
  with Q outside), over a backward engine;
- ``bwd``, ``tc_bwd``: the engines on CUDA cores and tensor cores, their layouts, and the named
  points the host launches.

``combine``: split-KV's merge of the forward's partial results (``online.merge`` on the device).
"""

from numba_flash.kernels.fa1 import fa1_kernel
from numba_flash.kernels.fa2 import fa2_kernel

KERNEL_FACTORIES = {"fa1": fa1_kernel, "fa2": fa2_kernel}

__all__ = ["KERNEL_FACTORIES", "fa1_kernel", "fa2_kernel"]
