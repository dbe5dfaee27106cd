"""Where a rank's incoming K/V shards land: two receive slots, used in turn (double buffering).

At step ``t`` of the ring a rank sends the shard it holds, ``H_t``, and receives the next one into
a slot ``S_t`` while its attention reads ``H_t``; at step ``t + 1`` it holds ``S_t``. So the slot
that receives must never be the one being sent (its bytes are still on the wire, and the
attention is still reading them): with ``H_{t+1} = S_t`` that means ``S_{t+1} != S_t``. Two slots
used in turn satisfy it, and no third is needed: at step ``t + 1`` the slot ``S_{t-1} = H_t`` is
free again once the step-``t`` shift has been waited for (the transfer that read it is done, and
the attention that read it was queued before the new transfer is). Step 0 sends the caller's own
``k`` and ``v``, which are never received into: the slots are the communicator's own arrays.

So the arrays a shift's ``wait()`` returns stay valid until the second shift after it starts
(then their slot receives again); the ring loop (``ring.py``) drops them one shift earlier.

:class:`ReceiveSlots` is that rule, written once for every transport: ``LocalRing`` (``comm.py``)
and ``TorchRing`` (``torch_ring.py``) both take their receive arrays from it, so the simulator's
tests exercise the double buffering that the NCCL transport relies on.
"""

from __future__ import annotations

SLOT_COUNT = 2  # double buffering: the slot being received into and the slot being sent


class ReceiveSlots:
    """The receive arrays of one rank's shifts, two sets used in turn.

    ``allocate(x)``: a new C-contiguous array of ``x``'s library, shape, dtype and device (default
    :func:`empty_like`). A slot is allocated on first use and reallocated when the arrays it must
    receive change shape or dtype.
    """

    def __init__(self, allocate=None):
        self._allocate = empty_like if allocate is None else allocate
        self._slots: list = [None] * SLOT_COUNT
        self._next = 0
        self.allocations = 0  # slot sets allocated so far (the tests: two for any number of steps)

    def take(self, sending: tuple) -> tuple:
        """The arrays to receive into while ``sending`` (arrays like the ones expected) is on the
        wire: the next slot in turn, or the other one if the next is what is being sent."""
        index = self._next
        if self._slots[index] is not None and _shares_an_array(self._slots[index], sending):
            index = 1 - index  # never receive into the shard being sent
        slot = self._slots[index]
        if slot is None or not _fits(slot, sending):
            slot = self._slots[index] = tuple(self._allocate(x) for x in sending)
            self.allocations += 1
        self._next = 1 - index
        return slot


def _fits(slot: tuple, sending: tuple) -> bool:
    return len(slot) == len(sending) and all(
        tuple(a.shape) == tuple(x.shape) and a.dtype == x.dtype for a, x in zip(slot, sending))


def _shares_an_array(slot: tuple, sending: tuple) -> bool:
    """Is any array of ``sending`` one of ``slot``'s arrays (or a view of one)?"""
    return any(_same_memory(a, x) for a in slot for x in sending)


def _same_memory(a, b) -> bool:
    if a is b:
        return True
    library = _library(a)
    if library != _library(b):
        return False
    if library == "numpy":
        import numpy as np

        return bool(np.may_share_memory(a, b))
    from numba_flash.arrays import may_overlap

    return may_overlap(a, b, library)


def _library(x) -> str:
    return type(x).__module__.split(".")[0]


def empty_like(x):
    """A new C-contiguous, uninitialised array of ``x``'s library (NumPy, CuPy or torch), shape,
    dtype and device."""
    library = _library(x)
    if library == "torch":
        import torch

        return torch.empty(tuple(x.shape), dtype=x.dtype, device=x.device)
    if library == "cupy":
        import cupy

        with cupy.cuda.Device(x.device.id):
            return cupy.empty(x.shape, dtype=x.dtype)
    import numpy as np

    return np.empty(x.shape, dtype=x.dtype)


def copy_into(destination, source) -> None:
    """``destination[...] = source`` in their library (torch: ``copy_``)."""
    if _library(destination) == "torch":
        destination.copy_(source)
    else:
        destination[...] = source
