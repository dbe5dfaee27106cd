"""``numba_flash.distributed``: attention over a sequence sharded across ranks (ring attention).

API.md section 6; theory and cost model: ``docs/theory/ring-attention.md``.

- :func:`ring_attention` (``ring.py``): each rank's queries against every rank's K/V shard, the
  shards passed around a ring, partial ``(o, lse)`` merged by split-KV's combine (``running.py``);
- the shard layouts and :func:`split_sequence` / :func:`gather_sequence` (``layout.py``):
  contiguous, or zigzag for causal attention (rank ``r`` holds chunks ``r`` and ``2R - 1 - r``);
- :class:`RingSchedule` (``schedule.py``): what each rank holds and computes at each step;
- the transport (``comm.py``): the :class:`RingCommunicator` protocol and :class:`LocalRing`, every
  rank in one process (tests, CI, the simulator).

Built and tested without GPUs: the schedule, layouts, merge and a fake ring. **Not built yet**
(issue 13): the NCCL transport. The plan is ``torch.distributed`` (``batch_isend_irecv`` of the
K/V shard to ``rank + 1`` and from ``rank - 1`` as one NCCL group, asynchronous handles for the
overlap on a second stream, ``torchrun`` as the launcher); ``group=None`` or a process group
raises ``NotImplementedError`` until then. Why not ``cupyx.distributed``: ``comm.py``.
"""

from numba_flash.distributed.comm import LocalRing, RingCommunicator, as_communicator
from numba_flash.distributed.layout import (
    LAYOUTS,
    chunk_count,
    default_layout,
    gather_sequence,
    shard_chunks,
    split_sequence,
)
from numba_flash.distributed.ring import ring_attention
from numba_flash.distributed.schedule import BlockCall, BlockKind, RingSchedule

__all__ = [
    "LAYOUTS",
    "BlockCall",
    "BlockKind",
    "LocalRing",
    "RingCommunicator",
    "RingSchedule",
    "as_communicator",
    "chunk_count",
    "default_layout",
    "gather_sequence",
    "ring_attention",
    "shard_chunks",
    "split_sequence",
]
