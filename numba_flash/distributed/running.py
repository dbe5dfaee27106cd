"""A rank's output rows so far: every computed block's partial ``(o, lse)`` merged into one.

The blocks a rank computes over the ring see disjoint sets of keys, so their partials merge
exactly as split-KV's do (``docs/theory/split-kv.md``: a finalised partial is the softmax state
``(m = lse, l = 1, acc = o)``, and the merge of states over disjoint key sets is associative and
commutative, ``docs/theory/online-softmax.md`` section 5). This module writes no merge of its
own; it calls split-KV's combine on two partials, the running one and the new one:

- NumPy arrays (the simulator, or a host caller): ``online.combine``, the float64 NumPy twin;
- CuPy / torch arrays (``merge="device"``, also NumPy in the simulator for the tests):
  ``split_kv.combine``, i.e. ``kernels.combine`` on the caller's stream, float32.

For two partials the combine is ``lse = log(e^lse_a + e^lse_b)`` and
``o = e^(lse_a - lse) o_a + e^(lse_b - lse) o_b``: PyTorch's context-parallel merge
(``torch/distributed/tensor/experimental/_context_parallel/_attention.py``:
``out - sigmoid(lse_b - lse_a) (out - out_b)``, since ``e^(lse_b - lse) = sigmoid(lse_b - lse_a)``)
in the max-shifted form. The running result starts as the merge identity ``o = 0, lse = -inf``;
a row that no block reached finishes there, never NaN.
"""

from __future__ import annotations

import math

import numpy as np

from numba_flash import online
from numba_flash.arrays import ArrayContext, dtype_name, kind_of
from numba_flash.distributed.layout import concatenate

MERGES = ("host", "device")


class RunningResult:
    """The merged ``(o, lse)`` of the query rows of ``q`` (``(B, H, N, D)``) so far.

    ``merge``: ``"host"`` (``online.combine``, float64; NumPy only), ``"device"``
    (``split_kv.combine``, float32), or ``None``: host for NumPy, device otherwise.
    """

    def __init__(self, q, merge: str | None = None):
        self.kind = kind_of(q)
        if merge is None:
            merge = "host" if self.kind == "numpy" else "device"
        if merge not in MERGES:
            raise ValueError(f"merge must be one of {list(MERGES)} or None; got {merge!r}")
        if merge == "host" and self.kind != "numpy":
            raise ValueError(f"merge='host' merges NumPy arrays; these are {self.kind} arrays (use 'device')")
        self.merge = merge
        self.dtype = dtype_name(q, self.kind)
        self.template = q
        B, H, N, D = (int(n) for n in q.shape)
        if merge == "host":
            self.o = np.zeros((B, H, N, D))
            self.lse = np.full((B, H, N), -math.inf)
        else:
            self.ctx = ArrayContext(self.kind, q)
            self.o = self.ctx.empty((B, H, N, D), "float32")
            self.lse = self.ctx.empty((B, H, N), "float32")
            self.o[...] = 0
            self.lse[...] = -math.inf

    def add(self, rows: slice, o_part, lse_part) -> None:
        """Merge the partial ``(o_part, lse_part)`` (``(B, H, n, D)``, ``(B, H, n)``: what
        ``api.forward`` returned for rows ``rows`` against some keys) into those rows."""
        if self.merge == "host":
            self._add_on_host(rows, o_part, lse_part)
        else:
            self._add_on_device(rows, o_part, lse_part)

    def _add_on_host(self, rows, o_part, lse_part):
        B, H, n, D = (int(s) for s in o_part.shape)
        o_parts = np.stack([self.o[:, :, rows], np.asarray(o_part, dtype=np.float64)]).reshape(2, B * H * n, D)
        lse_parts = np.stack([self.lse[:, :, rows], np.asarray(lse_part, dtype=np.float64)]).reshape(2, B * H * n)
        o, lse = online.combine(o_parts, lse_parts)
        self.o[:, :, rows] = o.reshape(B, H, n, D)
        self.lse[:, :, rows] = lse.reshape(B, H, n)

    def _add_on_device(self, rows, o_part, lse_part):
        from numba_flash.simulator import quiet_kernels
        from numba_flash.split_kv import combine

        B, H, n, D = (int(s) for s in o_part.shape)
        # split s of batch b at s * B + b: the layout kernels.combine reads (S = 2)
        o_parts = concatenate([self.o[:, :, rows], _as_float32(o_part, self.kind)], axis=0)
        lse_parts = concatenate([self.lse[:, :, rows], lse_part], axis=0)
        o = self.ctx.empty((B, H, n, D), "float32")
        lse = self.ctx.empty((B, H, n), "float32")
        with quiet_kernels():
            combine(self.ctx, o_parts, lse_parts, o, lse)
        self.o[:, :, rows] = o
        self.lse[:, :, rows] = lse

    def result(self):
        """``(o, lse)``: ``o`` in ``q``'s dtype, ``lse`` float32, arrays of ``q``'s library."""
        if self.merge == "host":
            o = self.o.astype(self.template.dtype)
            return o, self.lse.astype(np.float32)
        if self.dtype == "float32":
            return self.o, self.lse
        if self.kind == "torch":
            return self.o.to(self.template.dtype), self.lse
        return self.o.astype(self.template.dtype), self.lse


def _as_float32(x, kind):
    if kind == "torch":
        return x.float()
    return x.astype(np.float32) if x.dtype != np.float32 else x
