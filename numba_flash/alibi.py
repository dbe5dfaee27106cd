"""ALiBi slopes on the host: their check, and the array the kernels read (API.md section 2c).

ALiBi (Press, Smith and Lewis 2022) adds ``-slope * |i + (Nk - Nq) - j|`` to query ``i``'s
scaled score of key ``j`` (FlashAttention's bottom-right alignment, as ``causal`` and
``window_size``), one slope per query head, or per (batch, query head). The caller passes
``alibi_slopes`` float32 ``(H,)`` or ``(B, H)``, an array of the inputs' library on their device;
the kernels read a C-contiguous ``(B, H)`` float32 array of slopes times log2(e) (their scores are
in log2 units: ``kernels.score_mods``), which :func:`kernel_slopes` makes on the device, with no
copy to the host.
"""

from __future__ import annotations

import functools

import numpy as np

from numba_flash.arrays import device_id_of, dtype_name, kind_of
from numba_flash.kernels.jit import LOG2E

__all__ = ["check_slopes", "kernel_slopes", "no_slopes", "slopes_argument"]


def check_slopes(alibi_slopes, kind: str, batch: int, heads: int, device_id=None) -> None:
    """``TypeError`` unless ``alibi_slopes`` is a float32 array of the inputs' library (``kind``)
    on their device, ``ValueError`` unless its shape is ``(heads,)`` or ``(batch, heads)``."""
    slopes_kind = kind_of(alibi_slopes, "alibi_slopes")
    if slopes_kind != kind:
        raise TypeError(f"alibi_slopes must be an array of the inputs' library ({kind}); got {slopes_kind}")
    dtype = dtype_name(alibi_slopes, kind)
    if dtype != "float32":
        raise TypeError(f"alibi_slopes must be float32; got {dtype}")
    shape = tuple(int(s) for s in alibi_slopes.shape)
    if shape not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes must have shape ({heads},) or ({batch}, {heads}) (query heads, or batch and "
                         f"query heads); got {shape}")
    if device_id is not None and device_id_of(alibi_slopes, kind) != device_id:
        raise ValueError(f"alibi_slopes must be on the inputs' device (cuda:{device_id}); got cuda:"
                         f"{device_id_of(alibi_slopes, kind)}")


def kernel_slopes(alibi_slopes, batch: int, kind: str):
    """The kernels' argument: ``(batch, heads)`` float32 slopes times log2(e), C-contiguous, of
    library ``kind`` (``"numpy"``, ``"cupy"`` or ``"torch"``) on the slopes' device; ``heads``
    are the slopes' (the query heads: ``decode`` packs them into rows of KV heads, and its
    kernels index the slopes by query head). A torch tensor is read as a CuPy array for
    ``kind="cupy"`` (the tensor-core launch's library)."""
    heads = int(alibi_slopes.shape[-1])
    if len(alibi_slopes.shape) == 2:  # (batch, heads) as given (a packed batch's: a row per sequence)
        batch = int(alibi_slopes.shape[0])
    if kind == "torch":
        return (alibi_slopes.float().expand(batch, heads) * LOG2E).contiguous()
    if kind == "cupy":
        import cupy

        slopes = cupy.asarray(alibi_slopes)
        with cupy.cuda.Device(slopes.device.id):
            return cupy.ascontiguousarray(cupy.broadcast_to(slopes, (batch, heads)) * np.float32(LOG2E))
    return np.ascontiguousarray(np.broadcast_to(np.asarray(alibi_slopes, np.float32), (batch, heads))
                                * np.float32(LOG2E))


@functools.lru_cache(maxsize=None)
def no_slopes(kind: str, device_id=None):
    """The ``alibi`` argument of a kernel compiled without ALiBi (never read): a ``(1, 1)`` float32
    array of library ``kind`` on the device, made once (a call captured in a CUDA graph allocates
    nothing: the first call, before the capture, made it)."""
    if kind == "numpy":
        return np.zeros((1, 1), np.float32)
    if kind == "torch":
        import torch

        return torch.zeros((1, 1), dtype=torch.float32, device="cuda" if device_id is None else f"cuda:{device_id}")
    import cupy

    with cupy.cuda.Device(device_id if device_id is not None else cupy.cuda.runtime.getDevice()):
        return cupy.zeros((1, 1), np.float32)


def slopes_argument(problem, kind: str):
    """The kernels' ``alibi`` argument for a checked problem, of library ``kind``: its slopes as
    :func:`kernel_slopes` makes them, or :func:`no_slopes` (a kernel without ALiBi never reads it)."""
    if problem.alibi:
        return kernel_slopes(problem.alibi_slopes, problem.batch, kind)
    return no_slopes(kind, problem.device_id)
