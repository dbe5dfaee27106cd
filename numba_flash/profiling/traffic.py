"""The global-memory traffic model: bytes each algorithm must move, from its loop nest.

Counts what the kernels ask of global memory (HBM in the FlashAttention papers' IO
analysis, which assumes no cache between them and HBM), for the tiles actually visited:

- ``standard``: materialised attention (the CuPy baseline): read Q, K, V; write S,
  read S (softmax), write P, read P (second matmul) in float32; write O.
  Theta(N d + N^2).
- ``fa2``: every Q tile reads its Q rows once and every K/V tile it does not skip;
  writes O and the logsumexp once. Theta(N^2 d^2 / M) with M ~ block_m * d.
- ``fa1``: every K/V tile is read once; every (K/V tile, Q tile) pair it visits reads
  Q_i, and reads and writes O_i (float32), l_i and m_i (FlashAttention Alg. 1 lines
  8, 12, 13); plus the initialisation (line 2) and the final logsumexp/cast pass.

All counts are exact functions of the shapes, tiles and dtype; they are checked against
hand counts in ``tests/test_traffic.py``.
"""

from __future__ import annotations

import numpy as np

F32 = 4


def _itemsize(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize


def _visible_counts(n_q: int, n_k: int, block_m: int, block_n: int, causal: bool):
    """Per Q tile: rows in it, and how many K/V tiles and keys it visits (not skipped)."""
    tiles = []
    for i0 in range(0, n_q, block_m):
        rows = min(block_m, n_q - i0)
        last_key = n_k - 1
        if causal:
            last_key = min(n_k - 1, i0 + rows - 1 + n_k - n_q)
        n_tiles = 0 if last_key < 0 else last_key // block_n + 1
        keys = min(n_k, n_tiles * block_n)
        tiles.append((rows, n_tiles, keys))
    return tiles


def traffic_bytes(
    algorithm: str,
    batch: int,
    heads: int,
    kv_heads: int,
    n_q: int,
    n_k: int,
    head_dim: int,
    block_m: int,
    block_n: int,
    dtype: str = "float32",
    causal: bool = False,
    tensor_cores: bool = False,
) -> int:
    """Modelled global-memory bytes (reads + writes) of one forward pass.

    ``tensor_cores``: the tensor-core kernels, whose loop nests are the same; they differ in
    that FA-1 keeps O in a float32 buffer for every dtype (float32 too) and casts it at the end.
    """
    e = _itemsize(dtype)
    d = head_dim
    bh = batch * heads
    if algorithm == "standard":
        reads = bh * n_q * d * e + 2 * batch * kv_heads * n_k * d * e
        scores = 4 * bh * n_q * n_k * F32  # S written, S read, P written, P read
        return reads + scores + bh * n_q * d * e
    tiles = _visible_counts(n_q, n_k, block_m, block_n, causal)
    if algorithm == "fa2":
        per_head = 0
        for rows, _, keys in tiles:
            per_head += rows * d * e  # line 4: Q_i
            per_head += 2 * keys * d * e  # line 7: K_j, V_j for every tile not skipped
            per_head += rows * d * e + rows * F32  # lines 14-15: O_i, L_i
        return bh * per_head
    if algorithm == "fa1":
        n_kv_tiles = -(-n_k // block_n)
        per_head = 2 * n_k * d * e  # line 6: each K_j, V_j once
        per_head += n_q * (d + 2) * F32  # line 2: O, l, m initialised in HBM
        for j in range(n_kv_tiles):
            for rows, n_tiles, _ in tiles:
                if j < n_tiles:  # this (K_j, Q_i) pair is visited
                    per_head += rows * d * e  # line 8: Q_i
                    per_head += 2 * rows * d * F32  # lines 8, 12: O_i read and written
                    per_head += 4 * rows * F32  # lines 8, 13: l_i, m_i read and written
        per_head += n_q * 2 * F32 + n_q * F32  # line 16: read l, m; write L
        if e != F32 or tensor_cores:  # O kept in float32, cast to the output dtype at the end
            per_head += n_q * d * (F32 + e)
        return bh * per_head
    raise ValueError(f"algorithm must be 'standard', 'fa1' or 'fa2'; got {algorithm!r}")


def dram_bytes(
    algorithm: str,
    batch: int,
    heads: int,
    kv_heads: int,
    n_q: int,
    n_k: int,
    head_dim: int,
    block_m: int,
    block_n: int,
    dtype: str = "float32",
    causal: bool = False,
    l2_bytes: int = 60 * 2**20,
    resident_blocks: int = 132 * 3,
) -> int:
    """Modelled DRAM bytes: :func:`traffic_bytes` less what the L2 cache catches.

    Each algorithm's traffic splits into a compulsory part (every input read once, every
    output written once) and re-use traffic that repeats it over a working set ``W`` in a
    cyclic sweep. Under LRU a cyclic sweep hits every time when ``W`` fits in L2 and
    never when it does not (each line is evicted just before it is needed again), so the
    re-use traffic is served from L2 when ``W <= l2_bytes`` and from DRAM otherwise:

    - ``fa2``: re-reads of K/V by the Q tiles of one head; ``W`` = K and V of the heads
      in flight (``resident_blocks / Tr`` heads at a time, Q tiles of a head being
      consecutive blocks of the grid).
    - ``fa1``: the O/l/m round trips and Q re-reads; ``W`` = O, l, m and Q of every
      (batch, head) block, all resident at once.
    - ``standard``: S and P (``B H Nq Nk`` float32) are far larger than L2: no re-use.
    """
    e = _itemsize(dtype)
    d = head_dim
    bh = batch * heads
    total = traffic_bytes(algorithm, batch, heads, kv_heads, n_q, n_k, head_dim, block_m, block_n, dtype, causal)
    q_o_lse = bh * n_q * (2 * d * e + F32)
    kv_once = 2 * batch * kv_heads * n_k * d * e
    if algorithm == "standard":
        return total
    if algorithm == "fa2":
        compulsory = q_o_lse + kv_once
        n_q_tiles = -(-n_q // block_m)
        heads_in_flight = max(1, min(bh, resident_blocks // n_q_tiles))
        working_set = heads_in_flight * 2 * n_k * d * e
    elif algorithm == "fa1":
        compulsory = q_o_lse + kv_once + bh * n_q * 2 * F32  # + l, m written once
        if e != F32:
            compulsory += bh * n_q * d * F32  # O in float32 written once
        working_set = bh * n_q * (d * (F32 + e) + 2 * F32)
    else:
        raise ValueError(f"algorithm must be 'standard', 'fa1' or 'fa2'; got {algorithm!r}")
    reuse = max(0, total - compulsory)
    return compulsory if working_set <= l2_bytes else compulsory + reuse
