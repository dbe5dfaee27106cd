"""FA-1's and FA-2's loop nests in NumPy, tile by tile, on the online-softmax algebra.

The kernels (``numba_flash.kernels``) and these functions walk the same tiles in the same
order and keep the same per-row state; here every step is a call of :mod:`numba_flash.online`
in float64, so they are the tile-level oracle the kernels are tested against (besides the
materialised-S reference), and the plainest statement of what each algorithm does:

- :func:`fa2_tiled` (FlashAttention-2, Algorithm 1): for each Q tile, walk the K/V tiles with
  :func:`~numba_flash.online.update` -- unnormalised accumulator on chip, one final division
  (:func:`~numba_flash.online.finalize`).
- :func:`fa1_tiled` (FlashAttention, Algorithm 1): for each K/V tile, walk the Q tiles; each
  step reads O_i (normalised), l_i, m_i from "HBM", computes the tile's own state
  (``update`` of the empty state: m~_ij, l~_ij, P~_ij V_j, lines 9-10), combines them with
  :func:`~numba_flash.online.merge` (line 11) and writes O_i normalised again (lines 12-13).

Scores are ``scale * q . k`` with ``-inf`` where the mask hides a key: ``causal`` (bottom-right
aligned), a ``window_size`` and a user ``mask_mod(b, h, q_idx, kv_idx, *mod_args)`` (API.md 2c;
a key is visible when every mask says so). The kernels skip K/V tiles that are masked for a
whole Q tile, which here is an update by all ``-inf`` scores: the identity. With a
``block_mask`` (``numba_flash.block_mask`` of the same masks) both nests walk as block-sparse
kernels do: only the tiles it lists (FA-2: each Q tile's K/V tiles; FA-1: each K/V tile's Q
tiles), with the elementwise mask only on partial tiles -- so a tile the table wrongly calls full
or hidden changes the result. Shapes as ``attention``: q (B, H, Nq, D), k and v (B, Hkv, Nk, D),
GQA by ``h // (H // Hkv)``.
"""

from __future__ import annotations

import math

import numpy as np

from numba_flash.masking import evaluate_mask_mod, mask_spec
from numba_flash.online import SoftmaxState, empty_state, finalize, merge, update
from numba_flash.tile_visibility import FULL, HIDDEN

__all__ = ["fa1_tiled", "fa2_tiled"]


def _prepare(q, k, v, scale):
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    B, H, Nq, D = q.shape
    group = H // k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    return q, k, v, B, H, Nq, k.shape[2], D, group, scale


class _Masks:
    """The masks of one call: the window form of ``causal`` and ``window_size``, a ``mask_mod``
    with its ``mod_args``, and an optional tile table (``block_mask``) to walk by."""

    def __init__(self, causal, window_size, mask_mod, mod_args, block_mask, shape, block_m, block_n):
        self.spec = mask_spec(causal, tuple(window_size))
        self.mask_mod = getattr(mask_mod, "py_func", mask_mod)
        self.mod_args = tuple(mod_args)
        self.table = None
        if block_mask is not None:
            b, h, n_q, n_k = shape
            if block_mask.seq_lengths != (n_q, n_k) or (block_mask.block_m, block_mask.block_n) != (block_m, block_n):
                raise ValueError(f"block_mask is for Nq, Nk = {block_mask.seq_lengths} in {block_mask.block_m} x "
                                 f"{block_mask.block_n} tiles; this call has {(n_q, n_k)} in {block_m} x {block_n}")
            self.table = block_mask.kinds

    def kind(self, b, h, i_tile, j_tile) -> int | None:
        """The table's kind of a tile pair (``None`` without a table: mask every tile)."""
        if self.table is None:
            return None
        kinds = self.table
        return int(kinds[b % kinds.shape[0], h % kinds.shape[1], i_tile, j_tile])

    def scores(self, q_tile, k_tile, b, h, rows, cols, n_q, n_k, scale, kind):
        """S_ij = scale Q_i K_j^T, -inf where query row i may not see key j (not on a tile the
        table calls full: there no entry is masked)."""
        s = scale * (q_tile @ k_tile.T)
        if kind == FULL:
            return s
        seen = self.spec.visible(rows[:, None], cols[None, :], n_q, n_k)
        if self.mask_mod is not None:
            grid = (np.array(b).reshape(1, 1), np.array(h).reshape(1, 1), rows[:, None], cols[None, :])
            seen = seen & evaluate_mask_mod(self.mask_mod, grid, self.mod_args, s.shape)
        return np.where(seen, s, -np.inf)


def _tiles(n: int, size: int):
    return [np.arange(start, min(start + size, n)) for start in range(0, n, size)]


def fa2_tiled(q, k, v, block_m, block_n, causal=False, scale=None, return_state=False, *, window_size=(-1, -1),
              mask_mod=None, mod_args=(), block_mask=None):
    """FlashAttention-2's loop nest: ``(o, lse)``, or ``(o, lse, m, l)`` with ``return_state``
    (``m``, ``l``: each row's final running max and denominator, natural-log units). With
    ``block_mask``: each Q tile walks only its listed K/V tiles (partial and full, in order)."""
    q, k, v, B, H, Nq, Nk, D, group, scale = _prepare(q, k, v, scale)
    masks = _Masks(causal, window_size, mask_mod, mod_args, block_mask, (B, H, Nq, Nk), block_m, block_n)
    o, lse = np.zeros((B, H, Nq, D)), np.full((B, H, Nq), -np.inf)
    m, l = np.full((B, H, Nq), -np.inf), np.zeros((B, H, Nq))  # noqa: E741
    for b in range(B):
        for h in range(H):
            hk = h // group
            for i_tile, rows in enumerate(_tiles(Nq, block_m)):  # line 3: one thread block per Q tile
                state = empty_state(len(rows), D)  # line 5: O~ = 0, l = 0, m = -inf
                for j_tile, cols in enumerate(_tiles(Nk, block_n)):  # line 6: the K/V tiles, in order
                    kind = masks.kind(b, h, i_tile, j_tile)
                    if kind == HIDDEN:
                        continue  # a tile the table hides is never loaded nor computed
                    s = masks.scores(q[b, h, rows], k[b, hk, cols], b, h, rows, cols, Nq, Nk, scale, kind)
                    state = update(state, s, v[b, hk, cols])  # lines 8-10
                o[b, h, rows], lse[b, h, rows] = finalize(state)  # lines 12-13: divide once
                m[b, h, rows], l[b, h, rows] = state.m, state.l
    return (o, lse, m, l) if return_state else (o, lse)


def fa1_tiled(q, k, v, block_m, block_n, causal=False, scale=None, return_state=False, *, window_size=(-1, -1),
              mask_mod=None, mod_args=(), block_mask=None):
    """FlashAttention's (FA-1) loop nest: ``(o, lse)``, or ``(o, lse, m, l)`` with
    ``return_state`` (the O, l, m that the kernel keeps in global memory, l and m at the end).
    With ``block_mask``: each K/V tile visits only its listed Q tiles -- the K/V-outer walk of a
    block-sparse mask, whose rows' O, l, m then round-trip only for the tiles they see."""
    q, k, v, B, H, Nq, Nk, D, group, scale = _prepare(q, k, v, scale)
    masks = _Masks(causal, window_size, mask_mod, mod_args, block_mask, (B, H, Nq, Nk), block_m, block_n)
    # Line 2: O = 0, l = 0, m = -inf in HBM.
    o_hbm, l_hbm, m_hbm = np.zeros((B, H, Nq, D)), np.zeros((B, H, Nq)), np.full((B, H, Nq), -np.inf)
    for b in range(B):
        for h in range(H):  # one thread block per (batch, head)
            hk = h // group
            for j_tile, cols in enumerate(_tiles(Nk, block_n)):  # line 5: outer loop over K/V tiles (line 6: load K_j, V_j)
                for i_tile, rows in enumerate(_tiles(Nq, block_m)):  # line 7: inner loop over Q tiles
                    kind = masks.kind(b, h, i_tile, j_tile)
                    if kind == HIDDEN:
                        continue  # this Q tile sees none of K_j: its O_i, l_i, m_i stay in HBM untouched
                    # Line 8: read O_i (normalised), l_i, m_i; as a state, acc = O_i l_i.
                    stored = SoftmaxState(m_hbm[b, h, rows], l_hbm[b, h, rows], o_hbm[b, h, rows] * l_hbm[b, h, rows, None])
                    s = masks.scores(q[b, h, rows], k[b, hk, cols], b, h, rows, cols, Nq, Nk, scale, kind)
                    tile = update(empty_state(len(rows), D), s, v[b, hk, cols])  # lines 9-10: m~, l~, P~ V
                    new = merge(stored, tile)  # line 11: m_new, l_new
                    o_hbm[b, h, rows], _ = finalize(new)  # line 12: O_i normalised, back to HBM
                    m_hbm[b, h, rows], l_hbm[b, h, rows] = new.m, new.l  # line 13
    lse = np.where(np.isneginf(m_hbm), -np.inf, m_hbm + np.log(np.where(l_hbm > 0, l_hbm, 1.0)))
    return (o_hbm, lse, m_hbm, l_hbm) if return_state else (o_hbm, lse)
