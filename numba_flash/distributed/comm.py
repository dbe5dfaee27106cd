"""How K/V shards travel around the ring: the communicator protocol, the choice of transport, and a
fake ring in one process.

The ring code (``ring.py``) needs three things of a transport: its ``rank``, its ``world_size``,
and ``ring_shift(*arrays)``, which starts sending ``arrays`` to rank ``rank + 1`` and receiving
the same number of arrays, of the same shapes, from rank ``rank - 1``, and returns a handle whose
``wait()`` gives the received arrays. Starting the shift *before* computing with the arrays and
waiting *after* is what lets a GPU transport overlap the next shard's transfer with the current
step's attention: the idea of ``RingComm`` in zhuzilin/ring-flash-attention (``utils.py``: post
the send and receive, compute, then wait), stated here as a protocol rather than copied. The
received arrays are the transport's receive slots (``buffers.py``: two, used in turn).

:func:`as_communicator` picks the transport from ``ring_attention``'s ``group``: a ring
communicator as it is; ``None`` or a ``torch.distributed`` process group: :class:`TorchRing`
(``torch_ring.py``), NCCL point-to-point through ``torch.distributed`` (imported only then).

:class:`LocalRing` is the transport with every rank in one process: one thread per rank, each
rank copying its neighbour's arrays into its own receive slot at a barrier. It runs the same
schedule, local attention, merge and double buffering as the NCCL ring, so the tests exercise
all of it without GPUs, and it models what a GPU transport may do while a shift is in flight:
the receive slot holds garbage (NaN) from ``ring_shift`` until ``wait()``, and the sent arrays
are read only at ``wait()`` (a rank that wrote them in between would corrupt its neighbour's
copy, as it would on a wire). Only one rank computes at a time (a lock the ranks pass at each
shift): Numba's CUDA simulator runs one kernel at a time (``numba.cuda.simulator.kernel``:
"concurrent simulated kernel not supported"), and nothing in the algorithm depends on ranks
computing at once.

Why ``torch.distributed`` and not ``cupyx.distributed`` (``docs/theory/ring-attention.md``,
section 6): ``batch_isend_irecv`` posts the send to ``r + 1`` and the receive from ``r - 1`` as
one NCCL group (no deadlock for any ring size), returns asynchronous work handles (exactly
``ring_shift`` / ``wait``), and ``torchrun`` is the one-command launcher. ``cupyx.distributed``
has ``send`` and ``recv`` as separate NCCL calls and a ``send_recv`` grouped with a single peer
(the ring only for ``R = 2``); for ``R > 2`` one would group them by hand with
``cupy.cuda.nccl.groupStart`` / ``groupEnd``, order the streams by hand (no work handles) and
start every rank's process by hand (no launcher).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Protocol, runtime_checkable

from numba_flash.distributed.buffers import ReceiveSlots, copy_into

GROUP_KINDS = ("None (torch.distributed's default process group)", "a torch.distributed ProcessGroup",
               "a ring communicator (rank, world_size, ring_shift), e.g. a LocalRing's")


class PendingShift(Protocol):
    """A shift in flight."""

    def wait(self) -> tuple:
        """Block until the shift is done (on a GPU: until the caller's stream is ordered after
        it); the arrays received from rank ``rank - 1``."""


@runtime_checkable
class RingCommunicator(Protocol):
    """What ``ring_attention`` needs of a transport."""

    rank: int
    world_size: int

    def ring_shift(self, *arrays) -> PendingShift:
        """Start sending ``arrays`` to rank ``(rank + 1) % world_size`` and receiving as many
        arrays of the same shapes and dtypes from rank ``(rank - 1) % world_size``. The caller
        must not write ``arrays`` until ``wait()`` returns. The received arrays are the
        communicator's receive slots: valid until the second shift after this one starts."""


def as_communicator(group) -> RingCommunicator:
    """``group`` as a ring communicator: a ring communicator as it is; ``None`` (the default
    process group) or a ``torch.distributed`` process group as a :class:`TorchRing` over it
    (``RuntimeError`` when torch is missing or not initialised); ``TypeError`` for anything else."""
    if isinstance(group, RingCommunicator):
        if not 0 <= group.rank < group.world_size:
            raise ValueError(f"group.rank must be from 0 to group.world_size - 1; got rank {group.rank} of {group.world_size}")
        return group
    if group is None or _is_torch_process_group(group):
        from numba_flash.distributed.torch_ring import TorchRing

        return TorchRing(group)
    kind = f"{type(group).__module__}.{type(group).__qualname__}"
    raise TypeError(f"group is a {kind}; ring_attention takes as group: " + "; ".join(GROUP_KINDS))


def _is_torch_process_group(group) -> bool:
    """Is ``group`` a ``torch.distributed.ProcessGroup``? (No import: if torch is not imported,
    nothing can be one.)"""
    torch = sys.modules.get("torch")
    distributed = getattr(torch, "distributed", None)
    process_group = getattr(distributed, "ProcessGroup", None) if distributed is not None else None
    return process_group is not None and isinstance(group, process_group)


class LocalRing:
    """A ring of ``world_size`` ranks in one process: one thread per rank (:meth:`run`).

    ``transfers`` records every shift a rank starts, as ``(rank, nbytes)``: what the ring put
    on the wire (the tests hold it to one K/V shard per step, ``R - 1`` steps per rank).
    """

    def __init__(self, world_size: int, timeout: float = 600.0):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1; got {world_size!r}")
        self.world_size = world_size
        self.transfers: list[tuple[int, int]] = []
        self._outbox: list = [None] * world_size
        self._barrier = threading.Barrier(world_size, timeout=timeout)
        self._turn = threading.Lock()  # held by the one rank that computes now
        self._holder = None  # thread id of the rank holding the turn
        self._members = [LocalRingMember(self, rank) for rank in range(world_size)]

    def communicator(self, rank: int) -> "LocalRingMember":
        """Rank ``rank``'s end of the ring (use it inside :meth:`run`)."""
        return self._members[rank]

    def run(self, fn, *per_rank_args, **shared_kwargs) -> list:
        """``fn(*args_r, group=communicator(r), **shared_kwargs)`` for every rank ``r`` at once,
        one thread each; ``args_r`` takes element ``r`` of each of ``per_rank_args`` (sequences
        of ``world_size`` items). Returns the ranks' results in rank order; an exception in any
        rank stops the others and is raised here."""
        for i, seq in enumerate(per_rank_args):
            if len(seq) != self.world_size:
                raise ValueError(f"per-rank argument {i} must hold world_size = {self.world_size} items; got {len(seq)}")
        results = [None] * self.world_size
        errors: list = [None] * self.world_size

        def rank_main(rank):
            try:
                with self._taking_turn():
                    results[rank] = fn(*(seq[rank] for seq in per_rank_args), group=self._members[rank], **shared_kwargs)
            except BaseException as exc:  # noqa: BLE001 -- handed to the caller below
                errors[rank] = exc
                self._barrier.abort()  # ranks waiting at a shift stop instead of hanging

        threads = [threading.Thread(target=rank_main, args=(r,), name=f"ring-rank-{r}") for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._barrier.reset()
        first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
        first = first or next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return results

    @contextlib.contextmanager
    def _taking_turn(self):
        """Hold the turn (the right to compute) while this rank runs, except while it waits at a shift."""
        self._turn.acquire()
        self._holder = threading.get_ident()
        try:
            yield
        finally:
            self._holder = None
            self._turn.release()


class LocalRingMember:
    """One rank's end of a :class:`LocalRing` (a :class:`RingCommunicator`)."""

    def __init__(self, ring: LocalRing, rank: int):
        self.ring = ring
        self.rank = rank
        self.world_size = ring.world_size
        self.slots = ReceiveSlots()
        self._in_flight = False

    def ring_shift(self, *arrays) -> "_LocalShift":
        ring = self.ring
        if ring._holder != threading.get_ident():
            raise RuntimeError("a LocalRing communicator shifts only inside LocalRing.run, which gives each rank its thread")
        if self._in_flight:
            raise RuntimeError(f"rank {self.rank} started a ring_shift before waiting for the previous one")
        self._in_flight = True
        receiving = self.slots.take(arrays)
        for x in receiving:
            _poison(x)  # in flight, the slot holds whatever the wire has written so far
        ring._outbox[self.rank] = arrays  # read by the next rank at wait(), as a wire reads them late
        ring.transfers.append((self.rank, sum(_nbytes(x) for x in arrays)))
        return _LocalShift(self, receiving)


class _LocalShift:
    def __init__(self, member: LocalRingMember, receiving: tuple):
        self.member = member
        self.receiving = receiving

    def wait(self) -> tuple:
        member, ring = self.member, self.member.ring
        ring._holder = None
        ring._turn.release()  # let the other ranks compute up to their own shift
        try:
            ring._barrier.wait()  # every rank has posted its arrays
            sent = ring._outbox[(member.rank - 1) % ring.world_size]
            _check_like(sent, self.receiving, member.rank)
            for slot, x in zip(self.receiving, sent):
                copy_into(slot, x)
            ring._barrier.wait()  # every rank has copied its arrays: the sent ones may be written again
        finally:
            ring._turn.acquire()
            ring._holder = threading.get_ident()
            member._in_flight = False
        return self.receiving


def _check_like(sent: tuple, slots: tuple, rank: int) -> None:
    """What arrives must be shaped like what the rank sends (NCCL would not say: a receive of another
    size than the send is undefined there)."""
    for i, (x, slot) in enumerate(zip(sent, slots)):
        if tuple(x.shape) != tuple(slot.shape) or x.dtype != slot.dtype:
            raise ValueError(f"rank {rank} received array {i} as {tuple(x.shape)} {x.dtype} where its own is "
                             f"{tuple(slot.shape)} {slot.dtype}: every rank must pass the same shapes and dtypes")
    if len(sent) != len(slots):
        raise ValueError(f"rank {rank} received {len(sent)} arrays where it sends {len(slots)}")


def _poison(x) -> None:
    """Fill a floating-point array with NaN (other dtypes keep their bytes)."""
    try:
        x[...] = float("nan")
    except (TypeError, ValueError):  # integers: NaN does not convert
        pass


def _nbytes(x) -> int:
    return int(x.nbytes) if hasattr(x, "nbytes") else int(x.numel() * x.element_size())
