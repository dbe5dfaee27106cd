"""float8 (e4m3) inputs of ``attention(..., algorithm="fa3")``: FlashAttention-3's fp8 path, host side.

FA-3 (Shah et al. 2024, section 3.3) runs Q K^T and P V as e4m3 ``wgmma`` products (twice the
16-bit rate). Three things differ from 16-bit, and this module owns the host's part of each:

- **Descaling.** Quantized inputs carry per-tensor (or per batch and K/V head) factors:
  ``q_descale``, ``k_descale``, ``v_descale`` (FA-3's names: float32 scalars or ``(B, Hkv)``
  arrays; the real values are ``q * q_descale``, ...). :func:`descales` gives them to the kernel
  as three (B, Hkv) arrays without a copy (numbers: a cached device value seen with zero strides):
  ``q_descale k_descale`` joins the softmax scale, ``v_descale`` multiplies O at the end.
- **V's layout.** 8-bit ``wgmma`` operands must be K-major; for O += P V the K dimension is the
  keys, so V is needed as V^T (each head-dim row holding consecutive keys). FA-3 transposes V
  tiles in the kernel (its producer warps); here :func:`transposed_values` writes V^T once per
  call on the device (``kernels.value_transpose``: one pass over V).
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
    ``2t, 2t+1, 8+2t, 9+2t`` (and 16 more). The device pass's own rule
    (``kernels.value_transpose.group_key`` of output word ``p // 4``, position ``p % 4``), read on the host."""
    from numba_flash.kernels.value_transpose import group_key

    return np.array([group_key.py_func(p // 4, p % 4) for p in range(KEY_CHUNK)], np.int64)


def byte_view(x, kind: str):
    """An e4m3 array as its uint8 bit patterns: a CuPy view of a torch tensor, or a NumPy view."""
    if kind == "torch":
        from numba_flash.tensor_cores import torch_as_cupy

        return torch_as_cupy(x, "uint8")
    return x.view(np.uint8)


def transposed_values(v_bytes, stream_ptr: int = 0, device_id=None, recipe=None):
    """V^T of ``v_bytes`` (B, Hkv, Nk, D) uint8: (B, Hkv, D, Nk') C-contiguous, Nk' = Nk rounded up
    to 32 (zero keys past Nk), each 32 keys in :func:`value_order`. NumPy (the simulator): array
    operations; CuPy: one pass of ``kernels.value_transpose`` on the stream ``stream_ptr``.
    ``recipe`` (CuPy): a list that gets, where the pass read ``v_bytes`` where it lies (no copy),
    the pass prepared with pointer slots (V's, then V^T's; ``launch.prepare_launch``), for a
    plan's later calls."""
    B, H, N, D = v_bytes.shape
    padded_n = -(-N // KEY_CHUNK) * KEY_CHUNK
    if isinstance(v_bytes, np.ndarray):
        padded = np.zeros((B, H, padded_n, D), np.uint8)
        padded[:, :, :N] = v_bytes
        chunks = padded.reshape(B, H, padded_n // KEY_CHUNK, KEY_CHUNK, D)[:, :, :, value_order()]
        return np.ascontiguousarray(chunks.transpose(0, 1, 4, 2, 3)).reshape(B, H, D, padded_n)
    import cupy

    from numba_flash.kernels.value_transpose import THREADS, TILE_BYTES, TILE_KEYS, transpose_values
    from numba_flash.launch import device_array, launch

    words = in_place = _word_view(v_bytes)
    if words is None:  # rows that are not whole aligned words: a padded copy (D to a multiple of 16)
        from numba_flash.arrays import zero_padded

        words = _word_view(zero_padded(v_bytes, -(-D // 16) * 16))
    words = cupy.ascontiguousarray(words)  # (a strided view: one copy; the kernel reads flat rows)
    row_words = words.shape[3]
    vt = cupy.empty((B, H, D, padded_n), np.uint8)
    grid = (-(-padded_n // TILE_KEYS), -(-row_words * 4 // TILE_BYTES), B * H)
    args = [device_array(words.reshape(-1), "cupy"), device_array(vt.view(np.uint32).reshape(-1), "cupy"), np.int32(N),
            np.int32(row_words), np.int32(D), np.int32(padded_n // 4)]
    launch(transpose_values, grid, (THREADS,), stream_ptr, args, 0, device_id)
    if recipe is not None and in_place is not None and words.data.ptr == in_place.data.ptr:  # (no copy made)
        from numba_flash.launch import PointerSlot, prepare_launch

        slotted = [a._replace(ptr=PointerSlot(i)) for i, a in enumerate(args[:2])] + args[2:]
        recipe.append(prepare_launch(transpose_values, grid, (THREADS,), slotted, 0, device_id))
    return vt


def _word_view(x):
    """``x`` (B, H, N, D) uint8 CuPy as (B, H, N, D / 4) uint32 over the same memory, or ``None``
    when its rows are not whole aligned words."""
    import cupy

    B, H, N, D = x.shape
    if D % 4 or (x.strides[3] != 1 and D > 1) or x.data.ptr % 4 or any(s % 4 for s in x.strides[:3]):
        return None
    return cupy.ndarray((B, H, N, D // 4), np.uint32, memptr=x.data, strides=x.strides[:3] + (4,))


def descales(q_descale, k_descale, v_descale, batch: int, kv_heads: int, kind: str, device_id=None):
    """``(arguments, owners)``: the kernel's three (B, Hkv) float32 descale arguments (q's, k's,
    v's), each given as ``None`` (1), a positive finite number, or a float32 array of shape (B, Hkv)
    or () -- NumPy with NumPy inputs, a device array (torch or CuPy) on the inputs' GPU otherwise --
    and the device buffers made for this call (keep them until the launch is queued).

    Simulator: NumPy arrays. NumPy inputs on a GPU: numba device copies. torch / CuPy inputs:
    ``launch.DeviceArray`` views, no copy of an array (its values unread: keeping them positive is
    the caller's, as in FA-3); a number: 1 is a cached device value, any other a one-element buffer
    filled on the current CuPy stream (the caller's: ``fa3.forward`` runs this under it), both seen
    with zero strides."""
    from numba_flash._world import simulated

    host = simulated() or kind == "numpy"
    out, owners = [], []
    for name, value in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        value = 1.0 if value is None else value
        if isinstance(value, bool):
            raise TypeError(f"{name} must be a number or a float32 array of shape {(batch, kv_heads)}; got a bool")
        if isinstance(value, (int, float, np.integer, np.floating)):
            if not (math.isfinite(float(value)) and float(value) > 0):
                raise ValueError(f"{name} must be positive and finite; got {value}")
            if host:
                out.append(_host_or_device(np.full((batch, kv_heads), value, np.float32)))
            else:
                one = _one(device_id) if float(value) == 1.0 else _filled(float(value))
                owners.append(one)
                out.append(_broadcast(one, batch, kv_heads))
            continue
        array_kind = "torch" if type(value).__module__.startswith("torch") else (
            "numpy" if isinstance(value, np.ndarray) else "cupy" if type(value).__module__.startswith("cupy") else None)
        if array_kind is None:
            raise TypeError(f"{name} must be a number or a float32 array; got {type(value).__name__}")
        shape = tuple(value.shape)
        if shape not in ((batch, kv_heads), ()):
            raise ValueError(f"{name} must be a number or an array of shape {(batch, kv_heads)} (batch, K/V heads); "
                             f"got shape {shape}")
        if str(value.dtype).rsplit(".", 1)[-1] != "float32":
            raise TypeError(f"{name} must be float32; got {value.dtype}")
        if (array_kind == "numpy") != host:
            where = "NumPy arrays or numbers with NumPy inputs" if host else "device arrays or numbers with device inputs"
            raise TypeError(f"{name}: {where}; got a {array_kind} array with {kind} inputs")
        if array_kind == "numpy":
            if not (np.isfinite(value).all() and (value > 0).all()):
                raise ValueError(f"{name} must be positive and finite")
            out.append(_host_or_device(np.broadcast_to(value, (batch, kv_heads))))
            continue
        on = value.device.index if array_kind == "torch" else value.device.id
        if array_kind == "torch" and not value.is_cuda:
            on = None
        if on is None or (device_id is not None and on != device_id):
            raise ValueError(f"{name} must be on the inputs' GPU ({device_id}); got {value.device}")
        from numba_flash.launch import device_array

        out.append(_broadcast(device_array(value, array_kind), batch, kv_heads))
    return out, owners


_ONES: dict = {}  # device id -> a one-element CuPy float32 array holding 1


def _one(device_id):
    hit = _ONES.get(device_id)
    if hit is None:
        import cupy

        with cupy.cuda.Device(device_id if device_id is not None else cupy.cuda.runtime.getDevice()) as device:
            hit = _ONES[device_id] = cupy.ones((1,), np.float32)
            device.synchronize()  # made once; then read from any stream
    return hit


def _filled(value: float):
    """A one-element float32 buffer holding ``value``, filled on the current CuPy stream."""
    import cupy

    return cupy.full((1,), value, np.float32)


def _broadcast(x, batch: int, kv_heads: int):
    """A (B, Hkv) ``DeviceArray`` of ``x`` (a one-element CuPy array, or a (B, Hkv) / () DeviceArray);
    never C-contiguous, so every descale argument compiles to one signature."""
    from numba_flash.launch import DeviceArray, device_array

    d = x if isinstance(x, DeviceArray) else device_array(x, "cupy")
    strides = d.strides if len(d.shape) == 2 else (0, 0)
    return DeviceArray(d.ptr, (batch, kv_heads), strides, "float32", 4, batch * kv_heads, False)


def _host_or_device(x):
    """A host (B, Hkv) array as the kernel takes it: itself in the simulator, a numba device copy on a GPU."""
    from numba_flash._world import simulated

    if simulated():
        return np.array(x, np.float32)  # a writable copy (the simulator writes arguments back)
    from numba_flash._cuda import cuda

    return cuda.to_device(np.array(x, np.float32))
