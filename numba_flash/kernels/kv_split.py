"""Split-KV: which K/V tiles a block of a split FA-2 launch walks, and where it writes.

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
