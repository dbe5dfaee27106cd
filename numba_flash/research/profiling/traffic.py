"""The global-memory traffic model: bytes each algorithm must move, from its loop nest.

Counts what the kernels ask of global memory (HBM in the FlashAttention papers' IO
analysis, which assumes no cache between them and HBM), for the tiles actually visited:

- ``standard``: materialised attention as the CuPy baseline (``baselines.cupy_attention``)
  runs it, pass by pass: 10 passes over the N^2 scores (12 causal) and float32 copies of the
  inputs; ``standard-paper``: the FlashAttention paper's count of the same algorithm, read
  Q, K, V; write S, read S (softmax), write P, read P (second matmul); write O. Both
  Theta(N d + N^2); measured DRAM bytes (ncu) are 1.00-1.07x the first, 0.40x the second.
- ``fa2``: every Q tile reads its Q rows once and every K/V tile it does not skip;
  writes O and the logsumexp once. Theta(N^2 d^2 / M) with M ~ block_m * d.
- ``fa1``: every K/V tile is read once; every (K/V tile, Q tile) pair it visits reads
  Q_i, l_i and m_i (FlashAttention Alg. 1 line 8), and, for the rows of Q_i that see a
  key of K_j (under the causal mask some do not: the kernels skip their update), reads and
  writes O_i (float32) and writes l_i, m_i (lines 12, 13); plus the initialisation
  (line 2) and the final logsumexp/cast pass.

All counts are exact functions of the shapes, tiles and dtype; they are checked against
hand counts in ``tests/research/test_traffic.py``, and per array against the elements the simulated
kernels read and write in ``tests/research/test_traffic_counts.py`` (:func:`traffic_breakdown`).
"""

from __future__ import annotations

import numpy as np

from numba_flash.masking import mask_spec

F32 = 4


def _itemsize(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize


def visible_tiles(n_q: int, n_k: int, block_m: int, block_n: int, causal: bool):
    """Per Q tile: rows in it, and how many K/V tiles and keys it visits (not skipped): the
    kernels walk the K/V tiles from the first up to the last one holding a key that a row of
    the Q tile sees (``masking.MaskSpec.key_span``)."""
    mask = mask_spec(causal)
    tiles = []
    for i0 in range(0, n_q, block_m):
        rows = min(block_m, n_q - i0)
        _, last_key = mask.key_span(i0, i0 + rows, n_q, n_k)
        n_tiles = 0 if last_key < 0 else last_key // block_n + 1
        keys = min(n_k, n_tiles * block_n)
        tiles.append((rows, n_tiles, keys))
    return tiles


def traffic_breakdown(
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
    variant=None,
) -> dict:
    """Modelled global-memory bytes of one forward pass, per array: ``{role: (read, written)}``.

    ``variant`` (a ``kernels.forward.Variant``, CUDA cores): a point of the ablation space
    instead of ``algorithm``'s named point. q_outer variants move FA-2's bytes whatever their
    grid and rescale; kv_outer variants FA-1's, except that one block per Q tile
    (``heads_x_qtiles``) reads the K/V tiles its Q tile sees once per Q tile (as FA-2 does), ``o_load="with_q"`` reads O_i of
    every row of a visited pair (not only of the rows the tile updates), and a deferred rescale
    reads l once more and, when O is the float32 output itself, reads and writes it once more
    (the final normalisation).

    Roles: ``q``, ``k``, ``v``, ``o`` (the output, in ``dtype``), ``lse``; FA-1 adds ``l``,
    ``m`` and, when it keeps O in a float32 buffer apart from the output (16-bit dtypes, or
    ``tensor_cores``), ``o_acc`` (that buffer); ``standard`` has ``scores`` (S and P).
    :func:`traffic_bytes` is the sum. ``tests/research/test_traffic_counts.py`` checks every role
    against the elements the simulated kernels read and write.
    """
    e = _itemsize(dtype)
    d = head_dim
    bh = batch * heads
    if variant is not None:
        algorithm = "fa1" if variant.loop_order == "kv_outer" else "fa2"
        if algorithm == "fa1" and (variant.grid, variant.rescale, variant.o_load) != ("heads", "every_step", "at_update"):
            return _kv_outer_variant(variant, batch, heads, kv_heads, n_q, n_k, head_dim, block_m, block_n, dtype,
                                     causal, tensor_cores)
    if algorithm == "standard-paper":
        return {
            "q": (bh * n_q * d * e, 0),
            "k": (batch * kv_heads * n_k * d * e, 0),
            "v": (batch * kv_heads * n_k * d * e, 0),
            "scores": (2 * bh * n_q * n_k * F32, 2 * bh * n_q * n_k * F32),  # S, P written and read
            "o": (0, bh * n_q * d * e),
        }
    if algorithm == "standard":
        return _cupy_baseline(batch, heads, kv_heads, n_q, n_k, d, e, causal)
    mask = mask_spec(causal)
    tiles = visible_tiles(n_q, n_k, block_m, block_n, causal)
    if algorithm == "fa2":
        q = kv = o = lse = 0
        for rows, _, keys in tiles:
            q += rows * d * e  # line 4: Q_i
            kv += keys * d * e  # line 7: K_j, V_j for every tile not skipped
            o += rows * d * e  # line 14: O_i
            lse += rows * F32  # line 15: L_i
        return {"q": (bh * q, 0), "k": (bh * kv, 0), "v": (bh * kv, 0), "o": (0, bh * o), "lse": (0, bh * lse)}
    if algorithm == "fa1":
        # Line 2: O, l, m initialised in HBM; line 16: l, m read, L written (and O cast).
        q = 0
        o_read, o_written = 0, n_q * d * F32
        lm_read, lm_written = n_q, n_q  # elements, each of l and m
        for j in range(-(-n_k // block_n)):
            col0 = j * block_n
            for i, (rows, n_tiles, _) in enumerate(tiles):
                if j >= n_tiles:  # (K_j, Q_i) not visited: every key of K_j is masked for Q_i
                    continue
                q += rows * d * e  # line 8: Q_i
                lm_read += rows  # line 8: l_i, m_i
                # Lines 12-13: O_i read and written, l_i, m_i written, for the rows that see
                # a key of K_j (the tile adds nothing to the others, and they are skipped).
                row0 = i * block_m
                active = sum(1 for r in range(row0, row0 + rows) if mask.last_visible_key(r, n_q, n_k) >= col0)
                o_read += active * d * F32
                o_written += active * d * F32
                lm_written += active
        out = {
            "q": (bh * q, 0),
            "k": (bh * n_k * d * e, 0),  # line 6: each K_j, V_j once
            "v": (bh * n_k * d * e, 0),
            "l": (bh * lm_read * F32, bh * lm_written * F32),
            "m": (bh * lm_read * F32, bh * lm_written * F32),
            "lse": (0, bh * n_q * F32),
        }
        if e != F32 or tensor_cores:  # O kept in float32, cast to the output dtype at the end
            out["o_acc"] = (bh * (o_read + n_q * d * F32), bh * o_written)
            out["o"] = (0, bh * n_q * d * e)
        else:
            out["o"] = (bh * o_read, bh * o_written)
        return out
    raise ValueError(f"algorithm must be 'standard', 'standard-paper', 'fa1' or 'fa2'; got {algorithm!r}")


def _cupy_baseline(batch, heads, kv_heads, n_q, n_k, d, e, causal) -> dict:
    """What ``baselines.cupy_attention`` moves, pass by pass (one CuPy kernel each): the inputs
    copied to float32 (``astype`` copies even within a dtype; K and V first repeated over the
    query heads under GQA), S = Q K^T written, scaled in place, masked (causal: a new array),
    its row max read, S - m written and exponentiated into P, P's row sums read, P V read by
    the second matmul, O divided by l and cast back. The paper's count (``standard-paper``) has
    4 S-sized passes; this baseline makes 10 (12 causal). Row statistics (O(Nq) bytes) are left
    out."""
    bh, f = batch * heads, F32
    nd_q, n_s = bh * n_q * d, bh * n_q * n_k
    kv_in, kv_rep = batch * kv_heads * n_k * d, bh * n_k * d

    def kv_role():
        if heads != kv_heads:  # cp.repeat (read, write repeated), astype (read, write f32), matmul read
            return (kv_in * e + kv_rep * e + kv_rep * f, kv_rep * e + kv_rep * f)
        return (kv_in * e + kv_in * f, kv_in * f)  # astype (read, write f32), matmul read

    passes_read, passes_written = (7, 5) if causal else (6, 4)  # S: see the docstring
    return {
        "q": (nd_q * (e + f), nd_q * f),  # astype: read, write; matmul: read
        "k": kv_role(),
        "v": kv_role(),
        "scores": (passes_read * n_s * f, passes_written * n_s * f),
        "o": (nd_q * 2 * f, nd_q * (2 * f + e)),  # matmul writes; divide reads, writes; cast reads, writes
    }


def _kv_outer_variant(variant, batch, heads, kv_heads, n_q, n_k, head_dim, block_m, block_n, dtype, causal,
                      tensor_cores) -> dict:
    """:func:`traffic_breakdown` of a kv_outer variant other than FA-1 (the differences: its doc)."""
    out = traffic_breakdown("fa1", batch, heads, kv_heads, n_q, n_k, head_dim, block_m, block_n, dtype, causal,
                            tensor_cores)
    e, d, bh = _itemsize(dtype), head_dim, batch * heads
    mask = mask_spec(causal)
    tiles = visible_tiles(n_q, n_k, block_m, block_n, causal)
    cast = e != F32 or tensor_cores
    o_role = "o_acc" if cast else "o"
    if variant.grid == "heads_x_qtiles":  # every Q tile's block walks the K/V tiles it sees
        keys = sum(keys for _, _, keys in tiles)
        out["k"] = out["v"] = (bh * keys * d * e, 0)
    if variant.o_load == "with_q":  # O_i of every row of a visited pair, read with Q_i
        extra = 0
        for j in range(-(-n_k // block_n)):
            col0 = j * block_n
            for i, (rows, n_tiles, _) in enumerate(tiles):
                if j < n_tiles:
                    row0 = i * block_m
                    idle = sum(1 for r in range(row0, row0 + rows) if mask.last_visible_key(r, n_q, n_k) < col0)
                    extra += idle * d * F32
        read, written = out[o_role]
        out[o_role] = (read + bh * extra, written)
    if variant.rescale == "deferred":
        read, written = out["l"]
        out["l"] = (read + bh * n_q * F32, written)  # l_i for the final division
        if not cast:  # O normalised in place (cast: in the cast pass, which reads it anyway)
            read, written = out["o"]
            out["o"] = (read + bh * n_q * d * F32, written + bh * n_q * d * F32)
    return out


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
    variant=None,
) -> int:
    """Modelled global-memory bytes (reads + writes) of one forward pass: the sum of
    :func:`traffic_breakdown` (``variant``: a point of the ablation space, as there).

    ``tensor_cores``: the tensor-core kernels, whose loop nests are the same; they differ in
    that FA-1 keeps O in a float32 buffer for every dtype (float32 too) and casts it at the end.
    """
    parts = traffic_breakdown(
        algorithm, batch, heads, kv_heads, n_q, n_k, head_dim, block_m, block_n, dtype, causal, tensor_cores, variant
    )
    return sum(read + written for read, written in parts.values())


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
    if algorithm in ("standard", "standard-paper"):
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
        raise ValueError(f"algorithm must be 'standard', 'standard-paper', 'fa1' or 'fa2'; got {algorithm!r}")
    reuse = max(0, total - compulsory)
    return compulsory if working_set <= l2_bytes else compulsory + reuse
