"""float8 (e4m3) inputs of ``attention(..., algorithm="fa3")``: FlashAttention-3's fp8 path, host side.

FA-3 (Shah et al. 2024, section 3.3) runs Q K^T and P V as e4m3 ``wgmma`` products (twice the
16-bit rate). Three things differ from 16-bit, and this module owns the host's part of each:

- **Descaling.** Quantized inputs carry per-tensor (or per batch and K/V head) factors:
  ``q_descale``, ``k_descale``, ``v_descale`` (FA-3's names: float32 scalars or ``(B, Hkv)``
  arrays; the real values are ``q * q_descale``, ...). :func:`descales` packs them as the
  kernel's ``(B, Hkv, 3)`` float32 array: ``q_descale k_descale`` joins the softmax scale,
  ``v_descale`` multiplies O at the end.
- **V's layout.** 8-bit ``wgmma`` operands must be K-major; for O += P V the K dimension is the
  keys, so V is needed as V^T (each head-dim row holding consecutive keys). FA-3 transposes V
  tiles in the kernel (its producer warps); here :func:`transposed_values` writes V^T once per
  call on the device (one pass of V, a few percent of the attention's time at N = 4096).
- **P's registers.** The S accumulator gives a thread keys ``2t, 2t+1, 8+2t, 9+2t`` of each 16,
  where the e4m3 A operand wants ``4t..4t+3`` (FA-3's "layout mismatch", which it fixes with
  register shuffles). A sum over keys does not care in which order it runs, so V^T's keys are
  stored in the accumulator's order instead (:func:`value_order`): P's registers are used as they
  stand.

The output is bfloat16 (FA-3's). ``numba_flash.kernels.e4m3`` has the format itself.
"""

from __future__ import annotations

import math

import numpy as np

from numba_flash.problem import FP8_DTYPE

KEY_CHUNK = 32  # keys of one e4m3 wgmma step (the permutation's period)


def is_fp8(x) -> bool:
    """Whether ``x`` (any array of the supported kinds) holds float8_e4m3fn values."""
    dt = getattr(x, "dtype", None)
    return dt is not None and str(dt).rsplit(".", 1)[-1] == FP8_DTYPE


def value_order() -> np.ndarray:
    """``order[p]``: the key (within a 32-key step) that column ``p`` of V^T holds, so that P's
    accumulator registers are the e4m3 A operand as they stand: the A register of thread ``t``
    holds k-positions ``4t..4t+3`` (and ``16+4t..``), the accumulator gives it keys
    ``2t, 2t+1, 8+2t, 9+2t`` (and 16 more)."""
    order = np.empty(KEY_CHUNK, np.int64)
    for half in (0, 16):
        for t in range(4):
            order[half + 4 * t: half + 4 * t + 4] = [half + 2 * t, half + 2 * t + 1, half + 8 + 2 * t, half + 9 + 2 * t]
    return order


def byte_view(x, kind: str):
    """An e4m3 array as its uint8 bit patterns: a CuPy view of a torch tensor, or a NumPy view."""
    if kind == "torch":
        from numba_flash.tensor_cores import torch_as_cupy

        return torch_as_cupy(x, "uint8")
    return x.view(np.uint8)


def transposed_values(v_bytes):
    """V^T of ``v_bytes`` (B, Hkv, Nk, D) uint8 (CuPy or NumPy): (B, Hkv, D, Nk') C-contiguous,
    Nk' = Nk rounded up to 32 (zero keys past Nk), each 32 keys in :func:`value_order`."""
    xp = _array_module(v_bytes)
    B, H, N, D = v_bytes.shape
    padded_n = -(-N // KEY_CHUNK) * KEY_CHUNK
    padded = xp.zeros((B, H, padded_n, D), np.uint8)
    padded[:, :, :N] = v_bytes
    chunks = padded.reshape(B, H, padded_n // KEY_CHUNK, KEY_CHUNK, D)[:, :, :, xp.asarray(value_order())]
    return xp.ascontiguousarray(chunks.transpose(0, 1, 4, 2, 3)).reshape(B, H, D, padded_n)


def descales(q_descale, k_descale, v_descale, batch: int, kv_heads: int, kind: str, like):
    """The kernel's (B, Hkv, 3) float32 descaling factors (q's, k's, v's) on ``like``'s device
    (``like``: a CuPy or NumPy array); each argument ``None`` (1), a positive finite number, or a
    float32 array of shape (B, Hkv) of the inputs' library (device arrays are not read back: their
    values are the caller's to keep positive, as in FA-3)."""
    xp = _array_module(like)
    parts = []
    for name, value in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if value is None:
            value = 1.0
        if isinstance(value, bool):
            raise TypeError(f"{name} must be a number or a float32 array of shape {(batch, kv_heads)}; got a bool")
        if isinstance(value, (int, float, np.integer, np.floating)):
            if not (math.isfinite(float(value)) and float(value) > 0):
                raise ValueError(f"{name} must be positive and finite; got {value}")
            parts.append(xp.full((batch, kv_heads), float(value), np.float32))
            continue
        array = _as_array(value, name, kind)
        if tuple(array.shape) not in ((batch, kv_heads), ()):
            raise ValueError(f"{name} must be a number or an array of shape {(batch, kv_heads)} (batch, K/V heads); "
                             f"got shape {tuple(array.shape)}")
        if array.dtype != np.float32:
            raise TypeError(f"{name} must be float32; got {array.dtype}")
        if isinstance(array, np.ndarray) and not (np.isfinite(array).all() and (array > 0).all()):
            raise ValueError(f"{name} must be positive and finite")
        parts.append(xp.broadcast_to(xp.asarray(array), (batch, kv_heads)))
    return xp.ascontiguousarray(xp.stack(parts, axis=-1).astype(np.float32))


def _as_array(value, name: str, kind: str):
    """A descale array as CuPy (torch, CuPy) or NumPy; TypeError for anything else."""
    if kind == "torch" and type(value).__module__.startswith("torch"):
        from numba_flash.tensor_cores import torch_as_cupy

        return torch_as_cupy(value)
    if isinstance(value, np.ndarray) or type(value).__module__.startswith("cupy"):
        return value
    raise TypeError(f"{name} must be a number or a float32 array of the inputs' library; got {type(value).__name__}")


def _array_module(x):
    if isinstance(x, np.ndarray):
        return np
    import cupy

    return cupy
