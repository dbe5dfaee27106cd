"""Which part of the sequence each rank holds: the shard layouts, and the helpers that split a
full sequence into shards and gather shards back (axis 2 of ``(B, H, N, D)`` and ``(B, H, N)``).

The sequence of ``N`` positions is cut into equal **chunks**; a rank's shard is the
concatenation of its chunks, in ascending order of position:

- ``"contiguous"``: ``R`` chunks, rank ``r`` holds chunk ``r``. Any attention without a mask is
  indifferent to the layout (softmax over a set of keys does not care about their order), so
  this is the layout for ``causal=False``.
- ``"zigzag"``: ``2R`` chunks, rank ``r`` holds chunks ``r`` and ``2R - 1 - r`` (one from each end
  of the sequence). Under a causal mask a late chunk sees many keys and an early one few; pairing
  them gives every rank the same causal work (``docs/theory/ring-attention.md``, section 3). The
  idea is the zigzag variant of zhuzilin/ring-flash-attention (``zigzag_ring_flash_attn.py``).
  For ``R = 2``, ``N = 8`` (chunks of 2): rank 0 holds positions ``0 1 6 7``, rank 1 ``2 3 4 5``.

Both layouts keep a shard's chunks ascending, so within a shard local order is global order:
the causal mask of a shard against itself is the shard's own causal mask (``schedule.py``
relies on it). ``split_sequence`` and ``gather_sequence`` are exact inverses (views and one
concatenation; no arithmetic).
"""

from __future__ import annotations

LAYOUTS = ("contiguous", "zigzag")
SEQUENCE_AXIS = 2  # (B, H, N, D) and (B, H, N): the sequence is axis 2 of both


def check_layout(layout) -> str:
    """``layout`` if it names a layout (``ValueError`` listing them otherwise)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {list(LAYOUTS)}; got {layout!r}")
    return layout


def default_layout(causal: bool) -> str:
    """``"zigzag"`` for causal attention (balanced work), ``"contiguous"`` otherwise."""
    return "zigzag" if causal else "contiguous"


def chunks_per_rank(layout: str) -> int:
    """Chunks in one shard: 1 (contiguous) or 2 (zigzag)."""
    return 2 if check_layout(layout) == "zigzag" else 1


def chunk_count(layout: str, world_size: int) -> int:
    """Chunks the whole sequence is cut into: ``world_size`` times :func:`chunks_per_rank`."""
    return chunks_per_rank(layout) * _check_world_size(world_size)


def shard_chunks(layout: str, rank: int, world_size: int) -> tuple[int, ...]:
    """The chunks of the sequence that ``rank`` holds, ascending (their order in its shard)."""
    world_size = _check_world_size(world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be from 0 to world_size - 1 = {world_size - 1}; got {rank}")
    if check_layout(layout) == "contiguous":
        return (rank,)
    return (rank, 2 * world_size - 1 - rank)


def split_sequence(x, world_size: int, layout: str) -> list:
    """The ``world_size`` shards of a full sequence ``x`` (``(B, H, N, D)`` or ``(B, H, N)``) along
    axis 2: shard ``r`` holds the positions of ``shard_chunks(layout, r, world_size)``.

    ``N`` must be a multiple of the chunk count (``R``, or ``2R`` for zigzag). Arrays of any
    library that slices like NumPy; a contiguous shard is a view of ``x``, a zigzag one a copy.
    """
    chunks = chunk_count(layout, world_size)
    if len(x.shape) < 3:
        raise ValueError(f"x must be (B, H, N, D) or (B, H, N); got shape {tuple(x.shape)}")
    n = int(x.shape[SEQUENCE_AXIS])
    if n % chunks:
        raise ValueError(
            f"the sequence (axis 2, length {n}) must cut into {chunks} equal chunks "
            f"({world_size} ranks, {layout} layout)")
    c = n // chunks
    shards = []
    for rank in range(world_size):
        pieces = [_positions(x, g * c, (g + 1) * c) for g in shard_chunks(layout, rank, world_size)]
        shards.append(pieces[0] if len(pieces) == 1 else concatenate(pieces))
    return shards


def gather_sequence(shards, layout: str):
    """The full sequence from the shards of every rank (rank order), inverse of
    :func:`split_sequence`: ``gather_sequence(split_sequence(x, R, layout), layout)`` equals ``x``."""
    shards = list(shards)
    if not shards:
        raise ValueError("shards must hold one array per rank; got none")
    world_size = len(shards)
    shape = tuple(shards[0].shape)
    for rank, shard in enumerate(shards):
        if tuple(shard.shape) != shape:
            raise ValueError(f"every shard must have shard 0's shape {shape}; shard {rank} has {tuple(shard.shape)}")
    if len(shape) < 3:
        raise ValueError(f"shards must be (B, H, n, D) or (B, H, n); got shape {shape}")
    per_rank = chunks_per_rank(layout)
    n = shape[SEQUENCE_AXIS]
    if n % per_rank:
        raise ValueError(f"a {layout} shard holds {per_rank} equal chunks; its length {n} does not divide")
    c = n // per_rank
    pieces = [None] * chunk_count(layout, world_size)
    for rank, shard in enumerate(shards):
        for local, g in enumerate(shard_chunks(layout, rank, world_size)):
            pieces[g] = _positions(shard, local * c, (local + 1) * c)
    return concatenate(pieces)


def _check_world_size(world_size) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1; got {world_size!r}")
    return world_size


def _positions(x, start: int, stop: int):
    """Positions ``[start, stop)`` of the sequence axis (a view)."""
    return x[:, :, start:stop]


def concatenate(pieces, axis: int = SEQUENCE_AXIS):
    """The arrays ``pieces`` joined along ``axis`` by their own library (NumPy, CuPy or torch)."""
    library = type(pieces[0]).__module__.split(".")[0]
    if library == "torch":
        import torch

        return torch.cat(pieces, dim=axis)
    if library == "cupy":
        import cupy

        return cupy.concatenate(pieces, axis=axis)
    import numpy as np

    return np.concatenate(pieces, axis=axis)
