"""The NCCL transport: :class:`TorchRing`, a ring communicator over a ``torch.distributed`` process group.

``ring_shift(k, v)`` posts, as one NCCL group (``torch.distributed.batch_isend_irecv``), the sends
of ``k`` and ``v`` to rank ``r + 1`` and the receives of the next shard from rank ``r - 1`` into
a receive slot (``buffers.py``: two slots used in turn), and returns at once; ``wait()`` orders the
caller's stream after the transfer and returns the slot. Neither blocks the host. The ring loop
(``ring.py``) posts the shift of step ``t`` before queueing step ``t``'s attention, so the
transfer runs on NCCL's stream while the attention runs on the caller's.

Three streams, ordered by events only (no host synchronisation):

- the **compute stream**: the caller's current stream, where ``numba_flash`` launches its kernels:
  torch's current stream for torch tensors, CuPy's for CuPy arrays (wrapped as a torch
  ``ExternalStream``);
- the ring's **comm stream** (one per device, the communicator's own): at ``ring_shift`` it waits
  for the compute stream, so the sent shard is read only after the kernels that wrote it and the
  slot is written only after the kernels that last read it (the attention of two steps back);
  the NCCL operations are posted with it as torch's current stream, and torch makes NCCL's
  internal stream wait for it;
- **NCCL's stream** (torch's, internal): at ``wait()`` the comm stream waits for the NCCL work
  (``Work.wait()``: a stream wait, the host does not block), then the compute stream waits for
  the comm stream. Only then are kernels that read the received shard queued.

The comm stream costs two event waits per step; what it buys is a stream of the ring's own on
which events mark the transfer's start and end, so that with ``timeline=True`` the ring records,
per shift, when the compute stream posted it, finished the step's attention and resumed after the
wait, and when the comm stream started and ended the transfer (:meth:`TorchRing.step_times`):
the evidence that the transfer hides behind the attention (``demo.py`` prints it).

NCCL moves the bytes with kernels of its own on its stream; while the attention's grid still has
blocks waiting, a kernel of equal priority may wait for SMs, so the demo makes NCCL's stream
high-priority (``TORCH_NCCL_HIGH_PRIORITY=1``, read when the process group is created).

What is sent must stay unwritten until ``wait()`` (the protocol); torch keeps the tensors it
sends and receives alive until their work is waited for, and the shift keeps its CuPy arrays and
their torch views alive as long. Sent arrays must be contiguous for NCCL: a strided shard (a
contiguous-layout view of a batched sequence) is copied once, on the compute stream, at its first
shift; the slots are contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass

from numba_flash.distributed.buffers import ReceiveSlots

NO_TORCH = (
    "ring_attention's NCCL transport uses torch.distributed, and torch is not installed "
    "(pip install 'numba-flash[torch]'); without it, run every rank in one process with "
    "numba_flash.distributed.LocalRing, or pass group= a ring communicator of your own"
)
NOT_INITIALIZED = (
    "torch.distributed is not initialised: call torch.distributed.init_process_group('nccl') in "
    "every rank first (torchrun sets the environment it reads), e.g. "
    "torchrun --nproc-per-node 2 -m numba_flash.distributed.demo"
)
ARRAY_KINDS = ("torch", "cupy")


def require_torch():
    """``torch`` with ``torch.distributed``; ``RuntimeError`` saying how to get it otherwise."""
    try:
        import torch
        import torch.distributed  # noqa: F401 -- the submodule the transport uses
    except ImportError as exc:
        raise RuntimeError(NO_TORCH) from exc
    if not torch.distributed.is_available():
        raise RuntimeError("this build of torch has no torch.distributed: " + NO_TORCH)
    return torch


@dataclass(frozen=True)
class StepTimes:
    """One shift's timeline, in milliseconds (CUDA events): ``compute_ms`` from posting the shift
    to the end of the step's attention and merge (compute stream); ``transfer_ms`` from the comm
    stream's start (the compute before the shift done) to the transfer's end, peer wait included;
    ``exposed_ms`` how long the compute stream stood still at ``wait()`` for the transfer."""

    step: int
    compute_ms: float
    transfer_ms: float
    exposed_ms: float

    @property
    def hidden_ms(self) -> float:
        """The part of the transfer that ran under the attention."""
        return max(0.0, self.transfer_ms - self.exposed_ms)


class TorchRing:
    """A :class:`~numba_flash.distributed.RingCommunicator` over NCCL through ``torch.distributed``.

    ``group``: a ``torch.distributed`` process group with an NCCL backend, or ``None`` for the
    default one (``init_process_group`` must have run). This process's rank and the ring's size
    are its rank and size in ``group``; the ring's neighbours are the group's ranks ``r + 1`` and
    ``r - 1``. Arrays: torch CUDA tensors or CuPy arrays (all of one kind per shift), on the
    current rank's GPU.

    ``timeline=True``: record each shift's events (:meth:`step_times`). Keep one ``TorchRing``
    and pass it as ``group=`` to reuse its receive slots and stream across calls.
    """

    def __init__(self, group=None, *, timeline: bool = False):
        torch = require_torch()
        dist = torch.distributed
        if not dist.is_initialized():
            raise RuntimeError(NOT_INITIALIZED)
        backend = str(dist.get_backend(group))
        if "nccl" not in backend.lower():
            raise ValueError(f"ring_attention's transport needs an NCCL process group (GPU arrays); "
                             f"this group's backend is {backend!r}")
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("this process is not a member of the process group passed as group")
        self.group = group
        self.rank = rank
        self.world_size = dist.get_world_size(group)
        whole = group if group is not None else dist.group.WORLD
        self.next_peer = dist.get_global_rank(whole, (rank + 1) % self.world_size)
        self.previous_peer = dist.get_global_rank(whole, (rank - 1) % self.world_size)
        self.slots = ReceiveSlots()
        self.timeline: list | None = [] if timeline else None
        self._comm_streams: dict = {}
        self._in_flight = False

    def ring_shift(self, *arrays) -> "TorchShift":
        if self._in_flight:
            raise RuntimeError(f"rank {self.rank} started a ring_shift before waiting for the previous one")
        torch = require_torch()
        dist = torch.distributed
        kind = _kind_of_all(arrays)
        device = _device_of(arrays[0], kind, torch)
        compute = _compute_stream(kind, device, torch)
        comm = self._comm_stream(device, torch)
        with torch.cuda.device(device), torch.cuda.stream(compute):
            sending = tuple(_contiguous(x, kind) for x in arrays)  # queued on the compute stream
            receiving = self.slots.take(sending)
            send_tensors = [_as_tensor(x, kind, torch) for x in sending]
            recv_tensors = [_as_tensor(x, kind, torch) for x in receiving]
        events = _ShiftEvents(torch) if self.timeline is not None else None
        if events is not None:
            events.posted.record(compute)
        with torch.cuda.device(device), torch.cuda.stream(comm):
            comm.wait_stream(compute)  # send what the compute stream wrote; receive after its last reads
            if events is not None:
                events.transfer_start.record(comm)
            ops = [dist.P2POp(dist.isend, t, self.next_peer, self.group) for t in send_tensors]
            ops += [dist.P2POp(dist.irecv, t, self.previous_peer, self.group) for t in recv_tensors]
            works = dist.batch_isend_irecv(ops)
        self._in_flight = True
        if events is not None:
            self.timeline.append(events)
        keep = (sending, send_tensors, recv_tensors)  # alive until the transfer is waited for
        return TorchShift(self, works, receiving, keep, compute, comm, device, events)

    def step_times(self) -> list[StepTimes]:
        """The recorded shifts' :class:`StepTimes` (``timeline=True``), oldest first; waits for
        the last recorded event. Clears the record."""
        if self.timeline is None:
            raise RuntimeError("this TorchRing records no timeline: make it with TorchRing(group, timeline=True)")
        times = []
        for step, events in enumerate(self.timeline):
            events.resumed.synchronize()
            times.append(StepTimes(step, events.posted.elapsed_time(events.computed),
                                   events.transfer_start.elapsed_time(events.transfer_end),
                                   events.computed.elapsed_time(events.resumed)))
        self.timeline = []
        return times

    def _comm_stream(self, device, torch):
        stream = self._comm_streams.get(device.index)
        if stream is None:
            stream = self._comm_streams[device.index] = torch.cuda.Stream(device=device)
        return stream


class TorchShift:
    """A :class:`TorchRing` shift in flight."""

    def __init__(self, ring, works, receiving, keep, compute, comm, device, events):
        self.ring, self.works, self.receiving, self._keep = ring, works, receiving, keep
        self.compute, self.comm, self.device, self.events = compute, comm, device, events

    def wait(self) -> tuple:
        """Order the compute stream after the transfer (the host does not block); the slot."""
        import torch

        if self.works is None:
            raise RuntimeError("this shift was already waited for")
        with torch.cuda.device(self.device):
            with torch.cuda.stream(self.comm):
                for work in self.works:
                    work.wait()  # the comm stream waits for NCCL's
            if self.events is not None:
                self.events.transfer_end.record(self.comm)
                self.events.computed.record(self.compute)
            self.compute.wait_stream(self.comm)  # the received shard is read only after it landed
            if self.events is not None:
                self.events.resumed.record(self.compute)
        self.works = self._keep = None
        self.ring._in_flight = False
        return self.receiving


class _ShiftEvents:
    """The five timing events of one shift."""

    def __init__(self, torch):
        event = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
        self.posted, self.computed, self.resumed = event(), event(), event()  # compute stream
        self.transfer_start, self.transfer_end = event(), event()  # comm stream


def _kind_of_all(arrays) -> str:
    from numba_flash.arrays import kind_of

    kinds = {kind_of(x) for x in arrays}
    if len(kinds) != 1 or not kinds <= set(ARRAY_KINDS):
        raise TypeError(f"TorchRing moves torch CUDA tensors or CuPy arrays, all of one kind; got {sorted(kinds)} "
                        "(NumPy arrays: run the ranks in one process with LocalRing)")
    return kinds.pop()


def _device_of(x, kind, torch):
    index = x.device.index if kind == "torch" else x.device.id
    return torch.device("cuda", index)


def _compute_stream(kind, device, torch):
    """The stream numba_flash launches on for arrays of ``kind``, as a torch stream."""
    if kind == "torch":
        return torch.cuda.current_stream(device)
    import cupy

    with cupy.cuda.Device(device.index):
        ptr = cupy.cuda.get_current_stream().ptr
    if ptr == 0:  # CuPy's null stream is the legacy default stream, torch's default stream
        return torch.cuda.default_stream(device)
    return torch.cuda.ExternalStream(ptr, device=device)


def _contiguous(x, kind):
    if kind == "torch":
        return x.contiguous()
    import cupy

    return cupy.ascontiguousarray(x)


def _as_tensor(x, kind, torch):
    """A torch view of ``x`` (no copy)."""
    return x if kind == "torch" else torch.from_dlpack(x)
