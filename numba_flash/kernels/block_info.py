"""Which tiles a block works on: the grids of every kernel, decoded on the device in one place.

A launch is a 1-D grid over (tile, batch, head) -- tile fastest -- or over (batch, head) alone
(FA-1's grid: the block walks every tile), times the splits of a split-KV launch. The host
sizes it with :func:`grid_blocks` and the device decodes a block with :func:`tile_of_block`,
:func:`batch_and_head` and :func:`split_of_block`; which K/V tiles a Q tile walks under the mask
is ``mask.kv_tiles_seen`` / ``mask.first_q_tile``, and a split's share of them
:func:`split_tiles`. The order: a grid over Q tiles with the causal mask runs the last Q tiles
first (the longest walks: fewer idle SMs at the grid's tail); a grid over K/V tiles runs in order
(its first tiles are the longest already).

Split-KV: which K/V tiles a block of a split FA-2 launch walks, and where it writes.

A split launch (``attention(..., num_splits=S)``, ``decode``; API.md section 2b) runs ``S``
times the blocks of an unsplit one: block ``x`` is split ``x // blocks_per_split`` of the
unsplit block ``x % blocks_per_split`` (with ``causal=True`` the FA-2 kernels walk those Q tiles in
reverse, the longest first). Split ``s`` walks a contiguous range of the K/V tiles its
rows see and writes a *partial* result, O_s normalised over its own keys and their logsumexp
lse_s, at batch index ``s * B + b`` of the partial buffers ``(S * B, H, Nq, D)`` and
``(S * B, H, Nq)``; ``kernels.combine`` merges the partials. ``S = 1`` is the unsplit kernel:
one range of every tile, written at ``b``.

A split whose range is empty (the causal mask hides its keys from every row of the tile, or the
sequence is shorter than the split's start) walks nothing and writes O = 0, lse = -inf: the
identity of the merge (``numba_flash.online.empty_state``), never a NaN.
"""

from __future__ import annotations

from numba_flash.kernels.jit import device_jit


def grid_blocks(n_tiles: int, batch: int, heads: int, per_tile: bool = True, n_splits: int = 1) -> int:
    """Host: blocks of a launch over ``n_tiles`` tiles (``per_tile``; else one block per
    (batch, head)) of every (batch, head), times ``n_splits``."""
    return (n_tiles if per_tile else 1) * batch * heads * n_splits


@device_jit
def tile_of_block(block, n_tiles, per_tile, reverse):
    """(first tile, end tile, batch-head index) of block ``block`` of a grid over ``n_tiles``
    tiles of every (batch, head) (``per_tile``: one tile each, the tile fastest; ``reverse``:
    tile ``n_tiles - 1`` first), or over (batch, head) alone (the block walks every tile)."""
    if per_tile:
        tile = block % n_tiles
        if reverse:
            tile = n_tiles - 1 - tile
        return tile, tile + 1, block // n_tiles
    return 0, n_tiles, block


@device_jit
def batch_and_head(bh, n_heads):
    """(batch, head) of batch-head index ``bh`` (head fastest)."""
    b = bh // n_heads
    return b, bh - b * n_heads


@device_jit
def split_of_block(block, blocks_per_split):
    """(split, block of the unsplit grid) of grid block ``block``."""
    split = block // blocks_per_split
    return split, block - split * blocks_per_split


@device_jit
def split_tiles(n_tiles, n_splits, split):
    """The K/V tiles ``[first, end)`` split ``split`` of ``n_splits`` walks, out of ``n_tiles``:
    ``ceil(n_tiles / n_splits)`` consecutive tiles each (the last splits may get fewer, or none)."""
    per_split = (n_tiles + n_splits - 1) // n_splits
    first = min(split * per_split, n_tiles)
    return first, min(first + per_split, n_tiles)


@device_jit
def valid_keys(seqlens, b, n_k, ragged):
    """Keys of batch ``b`` the kernel may read: ``seqlens[b]`` clamped to ``[0, n_k]`` when the
    launch is ragged (``decode``'s ``cache_seqlens``), else all ``n_k``."""
    if ragged:
        return max(0, min(seqlens[b], n_k))
    return n_k


# ---------------------------------------------------------------- block-sparse walks (issue 24)
#
# A block mask's tile lists (``numba_flash.block_sparse``): for each Q tile (a Q-outer walk) or
# each K/V tile (a K/V-outer walk) of each (batch, head), ``counts[b, h, t]`` tiles of the other
# kind are listed, ascending, as ``listed[b, h, t, i] = tile * 2 + partial`` (``partial``: some
# of the pair's entries are hidden, the elementwise mask applies; else every entry is visible).
# A mask that depends on neither the batch nor the head has lists of batch or head size 1.


@device_jit
def sequence_span(cu_seqlens, b):
    """A packed batch (varlen; ``cu_seqlens`` int32 ``(2, B + 1)``, the queries' and the keys'
    prefix sums): ``(q0, q1, k0, k1)``, sequence ``b``'s rows of the packed queries and keys. A
    kernel cuts them out of its ``(1, heads, total, ...)`` views (``x[:, :, q0:q1]``; numba returns
    no slice from a device function), after which the sequence is a one-sequence problem of its
    own lengths: the walks, masks and bottom-right alignment follow from the shapes."""
    return cu_seqlens[0, b], cu_seqlens[0, b + 1], cu_seqlens[1, b], cu_seqlens[1, b + 1]


@device_jit
def listed_tile(entry):
    """The tile of a tile list's ``entry``."""
    return entry >> 1


@device_jit
def listed_partial(entry):
    """Whether the pair of a tile list's ``entry`` is partial (else full)."""
    return (entry & 1) != 0


@device_jit
def list_row(counts, listed, b, h, t):
    """(count, list) of tile ``t`` of (batch ``b``, head ``h``): the lists' batch or head of size
    1 stands for every one."""
    bb = b if counts.shape[0] > 1 else 0
    hh = h if counts.shape[1] > 1 else 0
    return counts[bb, hh, t], listed[bb, hh, t]


@device_jit
def listed_from(row, n_listed, tile):
    """The first index of a tile list ``row`` (``n_listed`` entries, ascending) whose tile is at
    least ``tile`` (``n_listed`` if none): a binary search."""
    lo, hi = 0, n_listed
    while lo < hi:
        mid = (lo + hi) >> 1
        if listed_tile(row[mid]) < tile:
            lo = mid + 1
        else:
            hi = mid
    return lo


@device_jit
def listed_range(row, n_listed, tile0, n_tiles):
    """``[lo, hi)``: the indices of a tile list ``row`` (``n_listed`` entries, ascending) whose
    tiles lie in ``[tile0, tile0 + n_tiles)`` (a built-in mask's range of them)."""
    return listed_from(row, n_listed, tile0), listed_from(row, n_listed, tile0 + n_tiles)
