"""Tile visibility of a mask: which (Q tile, K/V tile) pairs a kernel must visit (API.md 2c).

A mask hides some (query, key) pairs; at tile granularity a pair of tiles is **hidden** (every
entry masked: the kernel neither loads nor computes it), **full** (every entry visible: the
kernel skips the elementwise mask) or **partial** (the kernel applies the mask entry by entry).
:func:`block_mask` derives that table once per shape from the built-in masks (``causal``,
``window_size``: ``masking.MaskSpec``) and a user ``mask_mod(b, h, q_idx, kv_idx, *mod_args)``
(FlexAttention's ``create_block_mask``); :class:`BlockMask` holds it and gives both walks their
lists: for each Q tile the K/V tiles it visits (the Q-outer walks: FA-2's forward, the
deterministic dQ), and for each K/V tile the Q tiles (the K/V-outer walks: FA-1's forward, the
backward's dK/dV), each split into partial and full tiles, in FlexAttention's layout
(``kv_num_blocks``, ``kv_indices``, ``full_kv_num_blocks``, ``full_kv_indices``).

The table is exact: a tile is full or hidden only when the mask says so for each of its entries
(the mask is evaluated on every entry, tile row by tile row, on the host), and entries past
``Nq`` or ``Nk`` (a last tile's padding) count as neither. ``B`` or ``H`` of 1 (or ``None``)
stands for a mask that does not depend on the batch or the head.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from numba_flash.checks import whole_number
from numba_flash.masking import MaskSpec, evaluate_mask_mod, mask_spec

__all__ = ["BlockMask", "block_mask", "HIDDEN", "PARTIAL", "FULL"]

HIDDEN, PARTIAL, FULL = 0, 1, 2  # a tile pair's kind


@dataclass(frozen=True, eq=False)
class BlockMask:
    """The kinds of every (batch, head, Q tile, K/V tile): int8 ``kinds`` of shape
    ``(B, H, ceil(Nq / block_m), ceil(Nk / block_n))`` (B, H: 1 when the mask does not depend
    on them), :data:`HIDDEN`, :data:`PARTIAL` or :data:`FULL`."""

    kinds: np.ndarray = field(repr=False)
    seq_lengths: tuple[int, int]  # (Nq, Nk)
    block_m: int
    block_n: int
    # what it was made from: the mask_mod (None: the built-ins alone) and the built-in masks
    # (numba_flash.block_sparse checks them against a call that takes it)
    mask_mod: object = field(default=None, repr=False)
    builtins: MaskSpec = field(default_factory=MaskSpec.of, repr=False)
    _made: dict = field(default_factory=dict, init=False, repr=False)  # the walks' lists, made once each

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, H, Nq, Nk)`` of the mask (B, H: 1 when broadcast)."""
        return (*self.kinds.shape[:2], *self.seq_lengths)

    def _lists(self, kind: int, axis: int):
        """(counts, indices): per row of the ``axis`` view, how many tiles of ``kind`` and which,
        in ascending order, padded with 0 (FlexAttention's layout). Made once, read-only."""
        if (kind, axis) not in self._made:
            self._made[kind, axis] = self._make_lists(kind, axis)
        return self._made[kind, axis]

    def _make_lists(self, kind: int, axis: int):
        kinds = self.kinds if axis == 3 else self.kinds.swapaxes(2, 3)
        chosen = kinds == kind
        counts = chosen.sum(axis=-1, dtype=np.int32)
        # stable sort: chosen tiles first, in index order
        order = np.argsort(~chosen, axis=-1, kind="stable").astype(np.int32)
        width = chosen.shape[-1]
        keep = np.arange(width) < counts[..., None]
        indices = np.where(keep, order, 0).astype(np.int32)
        counts.flags.writeable = indices.flags.writeable = False
        return counts, indices

    def walk(self, over: str = "q", full: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """``(counts, indices)`` of one walk's lists: ``over="q"``, each Q tile's K/V tiles
        (int32 ``(B, H, n_q_tiles)`` and ``(B, H, n_q_tiles, n_kv_tiles)``); ``over="kv"``, each
        K/V tile's Q tiles; ``full``: the full tiles, else the partial ones."""
        if over not in ("q", "kv"):
            raise ValueError(f"over must be 'q' (each Q tile's K/V tiles) or 'kv'; got {over!r}")
        return self._lists(FULL if full else PARTIAL, 3 if over == "q" else 2)

    # FlexAttention's names for the same lists
    kv_num_blocks = property(lambda self: self.walk("q")[0], doc="int32 (B, H, n_q_tiles): each Q tile's partial K/V tiles")
    kv_indices = property(lambda self: self.walk("q")[1], doc="their indices, ascending, then 0s")
    full_kv_num_blocks = property(lambda self: self.walk("q", True)[0], doc="each Q tile's full K/V tiles")
    full_kv_indices = property(lambda self: self.walk("q", True)[1])
    q_num_blocks = property(lambda self: self.walk("kv")[0], doc="each K/V tile's partial Q tiles (K/V-outer walks)")
    q_indices = property(lambda self: self.walk("kv")[1])
    full_q_num_blocks = property(lambda self: self.walk("kv", True)[0])
    full_q_indices = property(lambda self: self.walk("kv", True)[1])

    def sparsity(self) -> float:
        """The fraction of tile pairs hidden (the work the kernels skip)."""
        return float((self.kinds == HIDDEN).mean()) if self.kinds.size else 0.0

    def to_dense(self) -> np.ndarray:
        """The bool ``(B, H, Nq, Nk)`` visibility the tiles allow: every entry of a full or
        partial tile (an upper bound of the mask; equal to it exactly on full tiles)."""
        n_q, n_k = self.seq_lengths
        visited = self.kinds != HIDDEN
        dense = visited.repeat(self.block_m, axis=2).repeat(self.block_n, axis=3)
        return dense[:, :, :n_q, :n_k]

    def __repr__(self) -> str:
        b, h, n_q, n_k = self.shape
        return (f"BlockMask(B={b}, H={h}, Nq={n_q}, Nk={n_k}, block_m={self.block_m}, block_n={self.block_n}, "
                f"sparsity={self.sparsity():.1%})")


def block_mask(mask_mod=None, B=None, H=None, Nq=None, Nk=None, *, block_m: int = 128, block_n: int = 128,
               causal: bool = False, window_size=(-1, -1), mod_args: tuple = ()) -> BlockMask:
    """The :class:`BlockMask` of ``mask_mod`` (and ``causal``, ``window_size``: a key is visible
    when every mask given says so, as API.md 2c orders them) for ``B`` x ``H`` x ``Nq`` queries x
    ``Nk`` keys in ``block_m`` x ``block_n`` tiles. ``B`` or ``H`` ``None``: 1, the mask taken not
    to depend on it. ``mask_mod`` ``None``: the built-in masks alone. Memoised per arguments when
    ``mod_args`` is empty (arrays may change between calls; with them, derived afresh)."""
    if mask_mod is not None and not callable(mask_mod):
        raise TypeError(f"mask_mod must be a callable, got {type(mask_mod).__name__}")
    if Nq is None or Nk is None:
        raise TypeError("block_mask needs Nq and Nk (the query and key lengths)")
    batch = 1 if B is None else whole_number(B, "B", 1)
    heads = 1 if H is None else whole_number(H, "H", 1)
    n_q, n_k = whole_number(Nq, "Nq", 0), whole_number(Nk, "Nk", 0)
    bm, bn = whole_number(block_m, "block_m", 1), whole_number(block_n, "block_n", 1)
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__") or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right) of ints, got {window_size!r}")
    spec = mask_spec(bool(causal), tuple(window_size))
    if not isinstance(mod_args, tuple):
        raise TypeError(f"mod_args must be a tuple of arrays, got {type(mod_args).__name__}")
    if mod_args:
        return _derive(mask_mod, batch, heads, n_q, n_k, bm, bn, spec, mod_args)
    return _derive_cached(mask_mod, batch, heads, n_q, n_k, bm, bn, spec)


@functools.lru_cache(maxsize=64)
def _derive_cached(mask_mod, batch, heads, n_q, n_k, bm, bn, spec: MaskSpec) -> BlockMask:
    return _derive(mask_mod, batch, heads, n_q, n_k, bm, bn, spec, ())


def _derive(mask_mod, batch, heads, n_q, n_k, bm, bn, spec: MaskSpec, mod_args) -> BlockMask:
    """Evaluate the masks one Q tile's rows at a time (memory: B x H x block_m x Nk booleans)
    and reduce each tile to its kind."""
    fn = getattr(mask_mod, "py_func", mask_mod)  # a numba device function: its Python source
    n_qt, n_kt = -(-n_q // bm), -(-n_k // bn)
    kinds = np.zeros((batch, heads, n_qt, n_kt), dtype=np.int8)
    b_idx = np.arange(batch).reshape(batch, 1, 1, 1)
    h_idx = np.arange(heads).reshape(1, heads, 1, 1)
    kv_idx = np.arange(n_k).reshape(1, 1, 1, n_k)
    for a in (b_idx, h_idx, kv_idx):
        a.flags.writeable = False
    pad = n_kt * bn - n_k
    for t in range(n_qt):
        rows = np.arange(t * bm, min(n_q, (t + 1) * bm))
        q_idx = rows.reshape(1, 1, -1, 1)
        q_idx.flags.writeable = False
        shape = (batch, heads, rows.size, n_k)
        seen = np.broadcast_to(spec.visible(q_idx, kv_idx, n_q, n_k), shape)
        if fn is not None:
            seen = seen & evaluate_mask_mod(fn, (b_idx, h_idx, q_idx, kv_idx), mod_args, shape)
        if pad:  # the last K/V tile's columns past Nk: neither visible nor hidden entries
            seen_any = np.concatenate([seen, np.zeros((*shape[:3], pad), bool)], axis=3)
            seen_all = np.concatenate([seen, np.ones((*shape[:3], pad), bool)], axis=3)
        else:
            seen_any = seen_all = seen
        tiles = (batch, heads, rows.size, n_kt, bn)
        any_seen = seen_any.reshape(tiles).any(axis=(2, 4))
        all_seen = seen_all.reshape(tiles).all(axis=(2, 4))
        kinds[:, :, t] = np.where(all_seen, FULL, np.where(any_seen, PARTIAL, HIDDEN))
    kinds.flags.writeable = False
    return BlockMask(kinds, (n_q, n_k), bm, bn, mask_mod, spec)
