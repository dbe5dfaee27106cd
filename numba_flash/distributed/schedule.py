"""The ring schedule: at each step, which K/V shard a rank holds and which attention calls it runs.

``R`` ranks stand in a ring. At step ``t`` (``0 <= t < R``) rank ``r`` holds the K/V shard that
rank ``(r - t) mod R`` started with: each step every rank sends the shard it holds to rank
``r + 1`` and receives one from rank ``r - 1`` (``comm.RingCommunicator.ring_shift``). After
``R`` steps every rank has seen every shard once; ``R - 1`` shifts suffice, the last shard
needs no onward send.

A (query chunk, key chunk) pair is, by global chunk index (``layout.py``):

- ``FULL`` when every query of it sees every key (``causal=False``, or the key chunk comes
  first): one unmasked call;
- ``DIAGONAL`` when the two chunks are the same chunk (causal only): a causal call on a square
  block, where ``attention``'s bottom-right alignment (key ``j`` visible to query ``i`` iff
  ``j <= i + Nk - Nq``) is the plain ``j <= i``;
- ``SKIPPED`` when the key chunk comes after the query chunk (causal only): every score is
  masked, nothing is computed (its partial would be ``o = 0``, ``lse = -inf``, the merge's
  identity).

:meth:`RingSchedule.calls` turns a step's pairs into few ``forward`` calls: the step where a
rank holds its own shard is one causal call over the whole shard (its chunks ascend, so the
shard's own causal mask is the global one restricted to it); the other steps are rectangles of
``FULL`` pairs. For zigzag this gives ring-flash-attention's three cases (step 0: causal on the
shard; source rank below: all queries against the first key chunk; above: the second query chunk
against all keys) without writing them out by hand.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from numba_flash.distributed.layout import check_layout, chunks_per_rank, shard_chunks
from numba_flash.masking import mask_spec


class BlockKind(enum.Enum):
    """What a (query chunk, key chunk) pair costs: a full block, a causal diagonal, nothing."""

    FULL = "full"
    DIAGONAL = "diagonal"
    SKIPPED = "skipped"


def block_kind(query_chunk: int, key_chunk: int, causal: bool) -> BlockKind:
    """The kind of the pair of global chunks (``query_chunk``, ``key_chunk``)."""
    if not causal or key_chunk < query_chunk:
        return BlockKind.FULL
    return BlockKind.DIAGONAL if key_chunk == query_chunk else BlockKind.SKIPPED


@dataclass(frozen=True)
class BlockCall:
    """One local attention call: the rank's query chunks ``query_chunks`` (local indices in its
    shard) against the held shard's key chunks ``key_chunks``, causal or not."""

    query_chunks: range
    key_chunks: range
    causal: bool

    def query_rows(self, chunk_len: int) -> slice:
        """The rows of the rank's query shard this call reads and writes."""
        return slice(self.query_chunks.start * chunk_len, self.query_chunks.stop * chunk_len)

    def key_rows(self, chunk_len: int) -> slice:
        """The rows of the held K/V shard this call reads."""
        return slice(self.key_chunks.start * chunk_len, self.key_chunks.stop * chunk_len)

    def visible_pairs(self, query_chunk_len: int, key_chunk_len: int) -> int:
        """(query, key) pairs whose score this call computes and keeps: its work."""
        n_q = len(self.query_chunks) * query_chunk_len
        n_k = len(self.key_chunks) * key_chunk_len
        return mask_spec(self.causal).visible_pairs(n_q, n_k)


@dataclass(frozen=True)
class RingSchedule:
    """The ring of ``world_size`` ranks, sequence ``layout``, causal or not."""

    world_size: int
    layout: str
    causal: bool

    def __post_init__(self):
        check_layout(self.layout)
        shard_chunks(self.layout, 0, self.world_size)  # checks world_size

    @property
    def steps(self) -> int:
        """Steps of the ring: one per shard."""
        return self.world_size

    @property
    def chunks_per_rank(self) -> int:
        return chunks_per_rank(self.layout)

    def kv_source(self, rank: int, step: int) -> int:
        """The rank whose K/V shard ``rank`` holds at ``step`` (it came ``step`` hops)."""
        if not 0 <= step < self.steps:
            raise ValueError(f"step must be from 0 to {self.steps - 1}; got {step}")
        return (rank - step) % self.world_size

    def query_chunks(self, rank: int) -> tuple[int, ...]:
        """Global chunks of ``rank``'s queries (and of the K/V shard it starts with)."""
        return shard_chunks(self.layout, rank, self.world_size)

    def key_chunks(self, rank: int, step: int) -> tuple[int, ...]:
        """Global chunks of the K/V shard ``rank`` holds at ``step``."""
        return shard_chunks(self.layout, self.kv_source(rank, step), self.world_size)

    def kinds(self, rank: int, step: int) -> tuple[tuple[BlockKind, ...], ...]:
        """``kinds[a][b]``: the kind of the rank's query chunk ``a`` against held key chunk ``b``."""
        keys = self.key_chunks(rank, step)
        return tuple(tuple(block_kind(qc, kc, self.causal) for kc in keys) for qc in self.query_chunks(rank))

    def calls(self, rank: int, step: int) -> tuple[BlockCall, ...]:
        """The step's attention calls, covering each ``FULL`` and ``DIAGONAL`` pair once and no
        ``SKIPPED`` one (``tests/distributed/test_ring.py`` checks this position by position)."""
        kinds = self.kinds(rank, step)
        n_q, n_k = len(kinds), len(kinds[0])
        if any(BlockKind.DIAGONAL in row for row in kinds):
            # Only the own shard shares chunks with the queries, and its chunks ascend: the causal
            # mask of the whole shard against itself is the global mask restricted to it.
            assert self.query_chunks(rank) == self.key_chunks(rank, step), "a diagonal pair in another rank's shard"
            return (BlockCall(range(n_q), range(n_k), causal=True),)
        full = [tuple(b for b, kind in enumerate(row) if kind is BlockKind.FULL) for row in kinds]
        calls = []
        first = 0
        while first < n_q:  # consecutive query chunks that see the same key chunks: one call per run of keys
            stop = first + 1
            while stop < n_q and full[stop] == full[first]:
                stop += 1
            calls.extend(BlockCall(range(first, stop), keys, causal=False) for keys in _runs(full[first]))
            first = stop
        return tuple(calls)

    def visible_pairs(self, rank: int, step: int, query_chunk_len: int, key_chunk_len: int | None = None) -> int:
        """(query, key) pairs ``rank`` computes at ``step``: its work there."""
        key_chunk_len = query_chunk_len if key_chunk_len is None else key_chunk_len
        return sum(call.visible_pairs(query_chunk_len, key_chunk_len) for call in self.calls(rank, step))


def _runs(indices: tuple[int, ...]) -> list[range]:
    """Maximal runs of consecutive integers in ascending ``indices``: ``(0, 1, 3) -> [0:2, 3:4]``."""
    runs = []
    for i in indices:
        if runs and runs[-1].stop == i:
            runs[-1] = range(runs[-1].start, i + 1)
        else:
            runs.append(range(i, i + 1))
    return runs
