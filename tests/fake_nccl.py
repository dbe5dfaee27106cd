"""A fake ``torch.distributed`` over NCCL, and CUDA streams and events that log what is queued where.

``TorchRing`` (``numba_flash.distributed.torch_ring``) is only correct if its stream operations
come in the right order: the comm stream waits for the compute stream before the NCCL group is
posted on it, the work is waited for on the comm stream, and the compute stream waits for the
comm stream before anything reads the received shard. On a machine without GPUs the order is
what can be tested: this fake records every ``wait_stream``, event ``record``, posted NCCL group
(its operations, peers and the stream current when posted), ``Work.wait`` and copy as a tuple in
:attr:`FakeNccl.log`. Tensors are ``fake_gpu``'s (layouts over no memory): no data moves.

:func:`install` puts the fake into ``sys.modules`` as ``torch`` and ``torch.distributed``.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import types

from fake_gpu import FakeDevice, FakeTensor, _torch_module


class Tensor(FakeTensor):
    """A fake CUDA tensor whose ``contiguous()`` copies (on the current stream, logged) when strided."""

    nccl = None  # the FakeNccl that logs, set by install

    def contiguous(self):
        if self.is_contiguous():
            return self
        self.nccl.log.append(("copy", self.nccl.current().name))
        return Tensor(self.shape, self.dtype, device=self.device)

    def _derived(self, operation, argument):
        view = super()._derived(operation, argument)
        return Tensor(view.shape, view.dtype, view.stride(), view.data_ptr(), view.device)


Tensor.__module__ = "torch"  # arrays.kind_of reads the library from the type's module


class Stream:
    def __init__(self, nccl, name, ptr=0):
        self.nccl, self.name, self.cuda_stream = nccl, name, ptr

    def wait_stream(self, other):
        self.nccl.log.append(("wait_stream", self.name, other.name))


class Event:
    def __init__(self, nccl, enable_timing=False):
        self.nccl, self.stream, self.time = nccl, None, None

    def record(self, stream):
        self.stream, self.time = stream.name, next(self.nccl.clock)
        self.nccl.log.append(("record", stream.name))

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return float(end.time - self.time)


class ProcessGroup:
    """A group of the global ranks ``members``, this process being ``members[rank]``."""

    def __init__(self, members, rank, backend="nccl"):
        self.members, self.rank, self.backend = members, rank, backend


class Work:
    def __init__(self, nccl, ops):
        self.nccl, self.ops = nccl, ops

    def wait(self):
        self.nccl.log.append(("work.wait", self.nccl.current().name))


class FakeNccl:
    """The state behind the fake modules: the log, a clock for events, the current stream per
    device, whether the default group is initialised and what it is."""

    def __init__(self, rank=0, world_size=2, backend="nccl", initialized=True):
        self.log: list[tuple] = []
        self.clock = itertools.count()
        self.compute = Stream(self, "compute")
        self._current = self.compute
        self.world = ProcessGroup(list(range(world_size)), rank, backend)
        self.initialized = initialized
        self._comm_count = itertools.count()

    def current(self):
        return self._current

    @contextlib.contextmanager
    def stream(self, stream):
        before, self._current = self._current, stream
        try:
            yield
        finally:
            self._current = before

    def posts(self):
        """The logged NCCL groups: ``(stream, [(op, tensor, peer), ...])``."""
        return [(entry[1], entry[2]) for entry in self.log if entry[0] == "post"]

    def modules(self):
        """Fake ``torch`` and ``torch.distributed`` modules backed by this state."""
        torch = _torch_module()
        torch.empty = lambda shape, dtype=None, device=None: Tensor(shape, dtype, device=device)
        torch.device = lambda type_, index=0: FakeDevice(type_, index)
        torch.from_dlpack = lambda x: x
        torch.cuda = types.SimpleNamespace(
            current_stream=lambda device=None: self._current,
            default_stream=lambda device=None: self.compute,
            ExternalStream=lambda ptr, device=None: Stream(self, f"external {ptr:#x}", ptr),
            Stream=lambda device=None: Stream(self, f"comm {next(self._comm_count)}"),
            stream=self.stream,
            device=lambda device: contextlib.nullcontext(),
            device_count=lambda: 1,
            Event=lambda enable_timing=False: Event(self, enable_timing),
        )
        dist = types.ModuleType("torch.distributed")
        dist.ProcessGroup = ProcessGroup
        dist.group = types.SimpleNamespace(WORLD=self.world)
        dist.is_available = lambda: True
        dist.is_initialized = lambda: self.initialized
        dist.get_backend = lambda group=None: (group or self.world).backend
        dist.get_rank = lambda group=None: (group or self.world).rank
        dist.get_world_size = lambda group=None: len((group or self.world).members)
        dist.get_global_rank = lambda group, group_rank: group.members[group_rank]

        def isend(*args):
            raise AssertionError("the ring posts sends only through batch_isend_irecv")

        def irecv(*args):
            raise AssertionError("the ring posts receives only through batch_isend_irecv")

        dist.isend, dist.irecv = isend, irecv
        dist.P2POp = lambda op, tensor, peer, group=None: (op.__name__, tensor, peer)

        def batch_isend_irecv(ops):
            self.log.append(("post", self._current.name, list(ops)))
            return [Work(self, ops)]

        dist.batch_isend_irecv = batch_isend_irecv
        torch.distributed = dist
        return torch, dist


def install(monkeypatch, **state) -> FakeNccl:
    """Fake torch with torch.distributed (``FakeNccl(**state)``) in ``sys.modules``; undone by
    ``monkeypatch`` after the test."""
    nccl = FakeNccl(**state)
    torch, dist = nccl.modules()
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.distributed", dist)
    monkeypatch.setattr(Tensor, "nccl", nccl)
    return nccl


def tensor(shape, dtype_name="float16", stride=None):
    """A fake CUDA tensor on device 0."""
    torch = sys.modules["torch"]
    return Tensor(shape, getattr(torch, dtype_name), stride)
