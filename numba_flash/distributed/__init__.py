"""``numba_flash.distributed``: attention over a sequence sharded across ranks (ring attention).

API.md section 6; theory and cost model: ``docs/theory/ring-attention.md``.

- :func:`ring_attention` (``ring.py``): each rank's queries against every rank's K/V shard, the
  shards passed around a ring, partial ``(o, lse)`` merged by split-KV's combine (``running.py``);
- the shard layouts and :func:`split_sequence` / :func:`gather_sequence` (``layout.py``):
  contiguous, or zigzag for causal attention (rank ``r`` holds chunks ``r`` and ``2R - 1 - r``);
- :class:`RingSchedule` (``schedule.py``): what each rank holds and computes at each step;
- the transport (``comm.py``): the :class:`RingCommunicator` protocol, :func:`as_communicator`
  (``group=None`` or a process group: NCCL), and :class:`LocalRing`, every rank in one process
  (tests, CI, the simulator); the receive slots both transports share (``buffers.py``: double
  buffering);
- :class:`TorchRing` (``torch_ring.py``): NCCL point-to-point through ``torch.distributed``
  (``batch_isend_irecv`` of the K/V shard to ``rank + 1`` and from ``rank - 1``, overlapped with
  the step's attention on a stream of its own); torch is imported only when it is used;
- ``python -m numba_flash.distributed.demo`` under ``torchrun`` (``demo.py``): the ring on N GPUs
  checked against one GPU, timed, with the per-step overlap of transfer and attention.
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
from numba_flash.distributed.torch_ring import StepTimes, TorchRing

__all__ = [
    "LAYOUTS",
    "BlockCall",
    "BlockKind",
    "LocalRing",
    "RingCommunicator",
    "RingSchedule",
    "StepTimes",
    "TorchRing",
    "as_communicator",
    "chunk_count",
    "default_layout",
    "gather_sequence",
    "ring_attention",
    "shard_chunks",
    "split_sequence",
]
