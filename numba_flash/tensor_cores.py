"""The launch of the tensor-core kernels.

``attention(..., precision=None)`` (API.md section 2a) picks one of two regimes
(``problem.regime``, the one place that decides):

- ``"ieee"``: the CUDA-core kernels (``kernels.fa1``, ``kernels.fa2``), exact FFMA; the research
  baseline. float32 by default; any dtype with ``precision="ieee"`` (bfloat16 inputs are
  widened to float32 for it, and the output narrowed back).
- tensor cores (``kernels.tc_fa1``, ``kernels.tc_fa2``): ``"f16"`` / ``"bf16"`` for float16 /
  bfloat16 inputs by default (``mma.sync`` m16n8k16, float32 accumulation), ``"tf32"`` /
  ``"tf32x3"`` for float32 inputs that ask for them (m16n8k8).

The tensor-core kernels read 16-byte chunks with ``cp.async``: the head dim and every row
stride must be multiples of 16 bytes, and the data 16-byte aligned. Inputs that are not (an
odd head dim, a strided slice) are copied once into zero-padded contiguous buffers here; the
output is then written into a padded buffer and copied into the caller's. 16-bit inputs reach
the kernel as ``uint16`` views of their bit patterns (one kernel source for float16 and
bfloat16; the products and conversions know which).

bfloat16 arrays: PyTorch CUDA tensors (``torch.bfloat16``) and NumPy arrays whose dtype is
``ml_dtypes.bfloat16`` (the simulator without a GPU, or copied to the GPU). CuPy has no
bfloat16 dtype; pass a torch tensor or a DLPack/CAI object of one.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from numba_flash._world import simulated
from numba_flash.arrays import cupy_stream, each, zero_padded
from numba_flash.alibi import no_slopes, slopes_argument
from numba_flash.kernels.jit import LOG2E
from numba_flash.kernels.tc_ops import check_tc_tiles, input_alignment, kernel_head_dim
from numba_flash.launch import device_array, launch, numba_launch
from numba_flash.problem import TENSOR_CORE_KIND
from numba_flash.specs import kernel_spec
from numba_flash.block_sparse import kernel_lists
from numba_flash.user_mods import compiling
from numba_flash.tile_table import forward_tc_tiles

if TYPE_CHECKING:
    from numba_flash.launch_config import LaunchConfig

CP_ASYNC_ALIGNMENT = 16  # bytes: the alignment of the inputs' data that cp.async reads in place


def tc_tiles(kind: str, head_dim: int, block_m, block_n) -> tuple[int, int]:
    """(block_m, block_n) for the tensor-core kernels: the caller's, checked, or the defaults
    (``tile_table.forward_tc_tiles``; the simulator: one warp)."""
    dm, dn = forward_tc_tiles(kind, kernel_head_dim(kind, head_dim))
    block_m = dm if block_m is None else block_m
    block_n = dn if block_n is None else block_n
    check_tc_tiles(kind, kernel_head_dim(kind, head_dim), block_m, block_n)
    return int(block_m), int(block_n)


# ------------------------------------------------------------------------------------------
# Arrays: bit-pattern views and 16-byte alignment
# ------------------------------------------------------------------------------------------


def bits_view(x, kind_of_array: str, sixteen: bool):
    """``x`` as the kernel's element type: uint16 bit patterns (16-bit kinds) or float32.
    torch tensors become CuPy views (:func:`torch_as_cupy`)."""
    if kind_of_array == "torch":
        return torch_as_cupy(x, "uint16" if sixteen else None)
    if kind_of_array == "numpy":
        return x.view(np.uint16) if sixteen else x
    return x.view("uint16") if sixteen else x


def torch_as_cupy(x, dtype=None):
    """A CuPy view of a torch CUDA tensor's memory (``dtype``: reinterpreted, same item size),
    made from its pointer, shape and strides. Not through ``__cuda_array_interface__`` (CuPy
    then synchronises the host with torch's stream: the protocol's default) nor DLPack (~10 us
    per array of stream bookkeeping); the view keeps the tensor alive."""
    import cupy

    x = x.detach()
    item = x.element_size()
    dtype = np.dtype(dtype) if dtype is not None else np.dtype(str(x.dtype).rsplit(".", 1)[-1])
    shape, strides = tuple(x.shape), tuple(s * item for s in x.stride())
    if x.numel() == 0:
        return cupy.empty(shape, dtype=dtype)
    extent = item + sum((n - 1) * s for n, s in zip(shape, strides))
    memory = cupy.cuda.UnownedMemory(x.data_ptr(), extent, x, x.device.index)
    return cupy.ndarray(shape, dtype=dtype, memptr=cupy.cuda.MemoryPointer(memory, 0), strides=strides)


def _aligned(x, head_dim: int, width: int) -> bool:
    """Can ``cp.async`` read ``x`` (4-D, kernel element type) in ``width``-element chunks?"""
    item = x.itemsize
    if head_dim % width or x.strides[3] != item:
        return False
    if any(s % (width * item) for s, n in zip(x.strides[:3], x.shape[:3]) if n > 1):
        return False
    ptr = x.ctypes.data if isinstance(x, np.ndarray) else x.data.ptr
    return ptr % 16 == 0


def _xp(x_or_kind):
    """NumPy for NumPy arrays (or kind "numpy"), else CuPy (torch arrays are CuPy views here)."""
    if isinstance(x_or_kind, np.ndarray) or (isinstance(x_or_kind, str) and x_or_kind == "numpy"):
        return np  # (an array compared with a str: CuPy 14 raises TypeError)
    import cupy

    return cupy


def kernel_inputs(kind: str, kind_of_array: str, q, k, v):
    """q, k, v as the tensor-core kernel reads them (views when they can be, else padded copies)."""
    return kernel_arrays(kind, kind_of_array, q, k, v)


def kernel_arrays(kind: str, kind_of_array: str, *arrays):
    """4-D inputs of one head dim as the tensor-core kernels read them with ``cp.async``: the
    kernel's element type, the kernel head dim, 16-byte aligned rows (views when they can be,
    else zero-padded copies). The forward's q, k, v; the backward's also do and o."""
    sixteen = kind in TENSOR_CORE_KIND.values()
    dim = kernel_head_dim(kind, int(arrays[0].shape[3]))
    width = input_alignment(kind)
    out = []
    for x in arrays:
        if kind_of_array == "numpy":  # a '>f2' array would view as byte-swapped bits
            x = x.astype(x.dtype.newbyteorder("="), copy=False)
        x = bits_view(x, kind_of_array, sixteen)
        if x.shape[3] != dim or not _aligned(x, dim, width):
            x = zero_padded(x, dim)
        out.append(x)
    return out


def launch_tc(ctx, call: LaunchConfig, q, k, v, o, lse, seqlens=None, n_splits=1, rows_per_query=1) -> None:
    """Run the tensor-core kernel of ``call`` (validated by ``api``) into ``o`` and ``lse``;
    on a GPU every copy and launch is queued on the caller's stream. With ``n_splits > 1``,
    ``o`` and ``lse`` are the float32 partials ``(S*B, H, Nq, kernel head dim)`` of
    ``kernels.block_info``; ``seqlens`` (int32 ``(B,)``) and ``rows_per_query``: ``decode``'s.
    A paged cache (``call.page_size``): ``k`` and ``v`` are ``(pages, block_table)`` each
    (``kernels.paged``)."""
    walk = (seqlens, n_splits, rows_per_query)
    if ctx.direct_launch and call.user_mods is None and _launch_in_place(ctx, call, q, k, v, o, lse, walk):
        return
    if ctx.kind == "torch":  # the CuPy copies of this call (padding, views) on torch's stream
        with cupy_stream(ctx.stream_ptr()):
            _launch_tc(ctx, call, q, k, v, o, lse, walk)
    else:  # CuPy: its current stream is the caller's already
        _launch_tc(ctx, call, q, k, v, o, lse, walk)


def _launch_tc(ctx, call: LaunchConfig, q, k, v, o, lse, walk) -> None:
    seqlens, n_splits, rows_per_query = walk
    B, H, Nq, D = call.q_shape
    partial = n_splits > 1  # o, lse: float32 partials of the kernel's head dim
    spec = kernel_spec(call.algorithm, D, call.dtype, call.block_m, call.block_n, call.window, call.regime,
                       ragged=seqlens is not None, split_out=partial, variant=call.variant, kv_stages=call.kv_stages,
                       key_warps=call.key_warps, softcap=call.softcap > 0, alibi=call.alibi,
                       user_mods=call.user_mods, varlen=call.varlen is not None, page_size=call.page_size)
    sixteen = spec.regime in TENSOR_CORE_KIND.values()
    dim, xp = spec.head_dim, _xp(ctx.kind)
    table = None
    if call.page_size:  # (pages, block_table): the pages as any K/V array, the table as it is
        (k, table), (v, _) = k, v
        table = bits_view(table, ctx.kind, False)
    kq, kk, kv = kernel_inputs(spec.regime, ctx.kind, q, k, v)
    if table is not None:
        kk, kv = (kk, table), (kv, table)
    # The output: the caller's buffer viewed as the kernel's element type, or a padded one
    # (the kernel writes O element by element: any strides will do).
    o_view = bits_view(o, ctx.kind, sixteen and not partial)
    o_kernel = o_view if o_view.shape[3] == dim else xp.empty((B, H, Nq, dim), dtype=o_view.dtype)
    lse_kernel = bits_view(lse, ctx.kind, False)
    q_scale = np.float32(call.scale * LOG2E)  # scores in log2 units
    written = [o_kernel, lse_kernel]
    if spec.kv_outer:  # the paper's O, l, m in global memory (float32)
        state = [xp.empty((B, H, Nq, dim), np.float32), xp.empty((B, H, Nq), np.float32), xp.empty((B, H, Nq), np.float32)]
        written += state
    else:
        state = list(_unread_state(ctx.kind, ctx.device_id))
    unread = _unread_lengths(ctx.kind, ctx.device_id)
    lengths = bits_view(seqlens, ctx.kind, False) if seqlens is not None else unread
    # the skeleton's arguments (kernels.forward), q_scale and the ints aside
    arrays = [kq, kk, kv, o_kernel, lse_kernel, *state, unread, lengths,
              slopes_argument(call.problem, "numpy" if xp is np else "cupy")]
    tail = [np.int32(n_splits), np.int32(rows_per_query), np.float32(call.softcap_log2)]
    grid = spec.grid(*call.grid_dims, n_splits)
    user = call.user_mods  # a user's mods: their arrays' tuple last (and a block-sparse walk's lists)
    with compiling(user):
        lists = kernel_lists(ctx, call) if user is not None and user.block_sparse else []  # (numba_flash.block_sparse)
        if ctx.direct_launch:  # (a tuple flattened as numba does: launch._pack)
            extra = [] if user is None else [
                tuple(device_array(a.detach() if ctx.kind == "torch" else a, ctx.kind) for a in call.problem.mod_args),
                *(device_array(x, "numba") for x in lists)]
            launch(spec.kernel, grid, (spec.threads,), ctx.stream_ptr(),
                   _ordered([each(lambda a: device_array(a, "cupy"), x) for x in arrays], q_scale, tail) + extra,
                   shared_mem_bytes=spec.dynamic_smem, device_id=ctx.device_id)
        else:
            mods = None if user is None else _mod_args(ctx, call.problem.mod_args)
            _numba_launch(ctx, spec, grid, arrays, written, q_scale, tail, mods, lists)
    if o_kernel is not o_view:
        o_view[...] = o_kernel[..., :D]


def _launch_in_place(ctx, call: LaunchConfig, q, k, v, o, lse, walk) -> bool:
    """The common case on a GPU, with no array made: the caller's arrays are what the kernel
    reads and writes (16-byte aligned rows of the kernel's head dim), launched on their own
    pointers. False (nothing launched) when one is not; then :func:`_launch_tc` pads."""
    seqlens, n_splits, rows_per_query = walk
    spec = _in_place_spec(call, seqlens is not None, n_splits)
    inputs = [each(lambda a: device_array(a, ctx.kind), x) for x in (q, k, v)]  # (a paged cache: (pages, table))
    if any(_pages(a).ptr % CP_ASYNC_ALIGNMENT for a in inputs):
        return False
    lengths = seqlens if seqlens is not None else _unread_lengths("cupy", ctx.device_id)
    unread = [device_array(x, "cupy") for x in (*_unread_state("cupy", ctx.device_id), _unread_lengths("cupy", ctx.device_id))]
    slopes_kind = ctx.kind if call.alibi else "cupy"  # (without ALiBi: the plans' placeholder, one per device)
    slopes = device_array(slopes_argument(call.problem, slopes_kind), slopes_kind)
    args = in_place_arguments(spec, call, *inputs, device_array(o, ctx.kind), device_array(lse, ctx.kind),
                              device_array(lengths, "cupy" if seqlens is None else ctx.kind), n_splits, rows_per_query,
                              unread, slopes)
    if args is None:
        return False
    launch(spec.kernel, spec.grid(*call.grid_dims, n_splits), (spec.threads,), ctx.stream_ptr(), args,
           shared_mem_bytes=spec.dynamic_smem, device_id=ctx.device_id)
    return True


def plan_in_place(builder, call: LaunchConfig, q, k, v, o, lse, seqlens, n_splits, rows_per_query) -> bool:
    """:func:`_launch_in_place` added to a plan (``plans.PlanBuilder``) for the call's arrays
    described with open pointers; the plan checks per call that q, k and v are
    :data:`CP_ASYNC_ALIGNMENT`-aligned. False when the kernel cannot read the inputs where they are (their layout)."""
    spec = _in_place_spec(call, seqlens is not None, n_splits)
    if seqlens is None:
        seqlens = builder.constant(_unread_lengths("cupy", builder.ctx.device_id), "cupy")
    unread = [builder.constant(x, "cupy") for x in (*_unread_state("cupy", builder.ctx.device_id),
                                                      _unread_lengths("cupy", builder.ctx.device_id))]
    if call.alibi:  # (the slopes are a per-call array: ALiBi calls are not planned)
        return False
    slopes = builder.constant(no_slopes("cupy", builder.ctx.device_id), "cupy")
    args = in_place_arguments(spec, call, q, k, v, o, lse, seqlens, n_splits, rows_per_query, unread, slopes)
    if args is None:
        return False
    builder.require_aligned(q.ptr.index, _pages(k).ptr.index, _pages(v).ptr.index)
    B, H, Nq, _ = call.q_shape
    builder.add_launch(spec.kernel, spec.grid(B, H, Nq, n_splits), (spec.threads,), args, spec.dynamic_smem)
    return True


def _in_place_spec(call: LaunchConfig, ragged: bool, n_splits: int):
    """The launch specification of the call's tensor-core kernel (float32 partials when split)."""
    D = call.q_shape[3]
    return kernel_spec(call.algorithm, D, call.dtype, call.block_m, call.block_n, call.window, call.regime,
                       ragged=ragged, split_out=n_splits > 1, variant=call.variant, kv_stages=call.kv_stages,
                       key_warps=call.key_warps, softcap=call.softcap > 0, alibi=call.alibi,
                       user_mods=call.user_mods, varlen=call.varlen is not None, page_size=call.page_size)


def in_place_arguments(spec, call: LaunchConfig, q, k, v, o, lse, lengths, n_splits, rows_per_query, unread, slopes):
    """The tensor-core FA-2 kernel's arguments on the caller's arrays (``launch.DeviceArray``):
    the skeleton's (``kernels.forward``), 16-bit inputs (and a 16-bit final output) as uint16
    bit patterns; ``unread``: the device arrays passed as o_hbm, l_hbm, m_hbm and kv_order,
    which a Q-outer walk never reads; ``slopes``: the ALiBi argument (``alibi.slopes_argument``).
    ``None`` when the kernel cannot read the inputs
    where they are: FA-1, a head dim it pads, rows that are not 16-byte multiples (the
    pointers' alignment is the caller's check)."""
    if spec.algorithm != "fa2" or spec.head_dim != call.q_shape[3]:
        return None
    sixteen = spec.regime in TENSOR_CORE_KIND.values()
    width = input_alignment(spec.regime)
    inputs = [q, k, v]
    if sixteen:  # (a paged cache's (pages, block_table): the pages as bit patterns, the table as it is)
        inputs = [(a[0]._replace(dtype="uint16"), a[1]) if type(a) is tuple else a._replace(dtype="uint16")
                  for a in inputs]
    if not all(_rows_laid_out(_pages(a), width) for a in inputs):
        return None
    if sixteen and not spec.split_out:
        o = o._replace(dtype="uint16")
    o_hbm, l_hbm, m_hbm, kv_order = unread
    return [*inputs, o, lse, o_hbm, l_hbm, m_hbm, np.float32(call.scale * LOG2E), kv_order, lengths, np.int32(n_splits),
            np.int32(rows_per_query), np.float32(call.softcap_log2), slopes]


def _pages(a):
    """The array of a kernel's K/V argument: itself, or a paged cache's pages (``kernels.paged``)."""
    return a[0] if type(a) is tuple else a  # (a plain tuple: a DeviceArray is a NamedTuple)


def _rows_laid_out(a, width: int) -> bool:
    """Can ``cp.async`` read the rows of the device array ``a`` in ``width``-element (16-byte)
    chunks, its pointer being 16-byte aligned?"""
    item = a.itemsize
    if a.strides[3] != item and a.shape[3] > 1:
        return False
    return not any(s % (width * item) for s, n in zip(a.strides[:3], a.shape[:3]) if n > 1)


@functools.lru_cache(maxsize=None)
def _unread(kind: str, device_id, shape: tuple, dtype):
    """An argument a kernel's specialisation never reads, one per (device, shape, dtype)."""
    xp = _xp(kind)
    if xp is np:
        return np.zeros(shape, dtype)
    with xp.cuda.Device(device_id if device_id is not None else xp.cuda.runtime.getDevice()):
        return xp.zeros(shape, dtype)


def _unread_lengths(kind: str, device_id):
    """The ``seqlens`` (or ``kv_order``) argument of a kernel compiled without it."""
    return _unread(kind, device_id, (1,), np.int32)


def _unread_state(kind: str, device_id):
    """The ``o_hbm``, ``l_hbm``, ``m_hbm`` arguments of a Q-outer walk (never read)."""
    return (_unread(kind, device_id, (1, 1, 1, 1), np.float32), _unread(kind, device_id, (1, 1, 1), np.float32),
            _unread(kind, device_id, (1, 1, 1), np.float32))


def _ordered(arrays, q_scale, tail) -> list:
    """The skeleton's arguments in order (``kernels.forward``): q, k, v, o, lse, o_hbm, l_hbm,
    m_hbm, q_scale, kv_order, seqlens, n_splits, rows_per_query, softcap_log2, alibi."""
    return [*arrays[:8], q_scale, *arrays[8:10], *tail, *arrays[10:]]


def _mod_args(ctx, mod_args) -> tuple:
    """A user's ``mod_args`` as the kernel reads them (C-ordered NumPy copies on the host; views
    of device arrays)."""
    from numba_flash._cuda import cuda

    if ctx.kind == "numpy":
        return tuple(np.array(a, order="C") if simulated() else cuda.to_device(np.ascontiguousarray(a)) for a in mod_args)
    return tuple(cuda.as_cuda_array(a.detach() if ctx.kind == "torch" else a, sync=False) for a in mod_args)


def _numba_launch(ctx, spec, grid, arrays, written, q_scale, tail, mods=None, lists=()) -> None:
    """numba's own launch: NumPy arrays (the simulator, or copied to and from a GPU); ``mods``: a
    user's ``mod_args`` (:func:`_mod_args`), the last argument of a kernel with user mods but for
    a block-sparse walk's tile ``lists`` (``block_sparse.kernel_lists``)."""
    from numba_flash._cuda import cuda

    host = ctx.kind == "numpy"
    if host and not simulated():
        dev = [each(lambda a: cuda.to_device(np.ascontiguousarray(a)), x) if not any(x is w for w in written)
               else cuda.device_array(x.shape, x.dtype) for x in arrays]
    elif host:
        # The simulator copies every NumPy argument back after the launch: outputs go as they
        # are (that is how they are written), inputs as C-ordered copies (never written, read-only
        # works; ``np.array`` alone keeps a strided view's order, which the simulator refuses).
        dev = [x if any(x is w for w in written) else each(lambda a: np.array(a, order="C"), x) for x in arrays]
    else:
        # (sync=False: every array is the caller's stream's, as the launch is; numba's default waits
        # for a CuPy array's stream, which serialised each call with the one before)
        dev = [each(lambda a: cuda.as_cuda_array(a, sync=False), x) for x in arrays]
    stream = ctx.stream()
    args = _ordered(dev, q_scale, tail) + ([] if mods is None else [mods]) + list(lists)
    numba_launch(spec.kernel, grid, spec.threads, stream, args, shared_mem_bytes=spec.dynamic_smem)
    if host and not simulated():
        for x, d in zip(arrays, dev):
            if any(x is w for w in written):
                d.copy_to_host(x, stream=stream)
        if stream is not None:
            stream.synchronize()
