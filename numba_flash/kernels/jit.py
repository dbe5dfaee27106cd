"""Compile options and constants shared by every kernel, for both worlds.

One kernel source runs on the GPU and in Numba's CUDA simulator. The simulator rejects
some ``cuda.jit`` options (``lineinfo``, ``max_registers``, ``launch_bounds``), so every
option that only the GPU understands is added here and nowhere else.
"""

from __future__ import annotations

import functools
import math

from numba_flash._cuda import cuda

from numba_flash._world import simulated

LOG2E = 1.4426950408889634  # 1 / ln(2): exp(x) = exp2(x * LOG2E); scores are kept in log2 units
LN2 = 0.6931471805599453  # ln(2): converts a log2-unit logsumexp back to natural log
NEG_INF = -math.inf  # the documented mask value (never a finite sentinel such as -1e4)


# Byte alignment of the kernels' shared tiles: 16 lets a 128-bit load read four floats
# (``ld.shared.v4``); the simulator rejects the argument, so there it is None.
SMEM_ALIGN = None if simulated() else 16


def kernel_jit(**gpu_only):
    """``cuda.jit`` for a kernel; ``gpu_only`` options are dropped in the simulator."""
    options = {} if simulated() else dict(gpu_only)
    return cuda.jit(**options)


def kernel_factory(factory):
    """Memoise a function that makes a kernel, and give each kernel it makes an identity that
    outlives the process: ``"module.factory(name=value, ...)"`` over every argument, defaults
    filled in (so ``f(64, causal=True)`` and ``f(64, True)`` are one kernel, where
    ``functools.lru_cache`` kept two). The identity is the kernel's part of the persistent
    compilation cache's key (``numba_flash.compile_cache``); a kernel whose arguments have no
    stable ``repr`` (an object address in it), or with an argument marked ``uncacheable`` (a
    user's functions: ``kernels.score_mods.UserMods``, the engines made with them), gets none and
    is never stored.

    ``cache_clear()`` forgets the kernels made, as ``lru_cache``'s does. A call spelled as an
    earlier one finds its kernel without binding the signature (``inspect``'s binding costs
    tens of microseconds, on every launch of an unplanned call)."""
    import inspect

    signature = inspect.signature(factory)
    made: dict = {}  # the bound arguments, defaults filled in -> the kernel
    spelled: dict = {}  # (args, kwargs) as a call gave them -> the same kernel

    @functools.wraps(factory)
    def make(*args, **kwargs):
        call = (args, tuple(kwargs.items()))
        kernel = spelled.get(call)
        if kernel is not None:
            return kernel
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        key = tuple(bound.arguments.items())
        kernel = made.get(key)
        if kernel is None:
            kernel = made[key] = factory(*args, **kwargs)
            identity = f"{factory.__module__}.{factory.__qualname__}(" + ", ".join(f"{k}={v!r}" for k, v in key) + ")"
            if " at 0x" not in identity and not any(getattr(v, "uncacheable", False) for _, v in key):
                kernel.numba_flash_identity = identity
        spelled[call] = kernel
        return kernel

    def cache_clear():
        made.clear()
        spelled.clear()

    make.cache_clear = cache_clear
    return make


def kernel_identity(kernel) -> str | None:
    """The identity :func:`kernel_factory` gave ``kernel`` (``None``: made elsewhere)."""
    return getattr(kernel, "numba_flash_identity", None)


def device_jit(func=None, *, fastmath=None):
    """``cuda.jit(device=True)``, inlined at the NVVM level (``alwaysinline``) so that the
    caller's local arrays (the S and O micro-tiles, the copy registers) can stay in registers.
    ``fastmath``: numba's flags for the function's own code (a kernel's body written as a device
    function takes the kernel's: they do not reach an inlined callee)."""
    if func is None:
        return functools.partial(device_jit, fastmath=fastmath)
    if simulated():
        return cuda.jit(device=True)(func)
    return cuda.jit(device=True, forceinline=True, **({} if fastmath is None else {"fastmath": fastmath}))(func)


def _tile_view(context, builder, signature, smem, at, count: int):
    """Codegen of the tile views: the 1-D array ``smem`` (``signature.args[0]``) seen from element
    ``at`` (an i64 value) on, ``count`` elements long, its stride kept: one ``gep`` from the
    shared base."""
    from numba import types
    from numba.cuda import cgutils

    base = context.make_array(signature.args[0])(context, builder, value=smem)
    out = context.make_array(signature.return_type)(context, builder)
    (stride,) = cgutils.unpack_tuple(builder, base.strides, 1)
    context.populate_array(
        out,
        data=builder.gep(base.data, [at], inbounds=True),
        shape=[context.get_constant(types.intp, count)],
        strides=[stride],
        itemsize=base.itemsize,
        meminfo=None,
    )
    return out._getvalue()


@functools.lru_cache(maxsize=None)
def shared_tile(offset: int, count: int):
    """A device function ``view(smem) -> smem[offset : offset + count]`` for carving a dynamic
    shared array (``cuda.shared.array(0, ...)``) into tiles, ``offset`` and ``count`` compile-time
    constants (elements; ``offset`` a multiple of 4 keeps a float32 tile 16-byte aligned).

    Not a slice: numba sizes a dynamic shared array by the launch (the ``%dynamic_smem_size``
    register), so a slice's start is clamped against a length known only at run time, and the
    compiler can no longer prove the tile 16-byte aligned: the four-float loads of the micro-tile
    products stay four ``LDS`` instead of one ``LDS.128`` (seen in the backward kernels' PTX:
    16 ``ld.shared.v4`` of 172 loads). On the GPU the view's data pointer is the base plus a
    constant, nothing else; the simulator slices."""
    if simulated():

        @device_jit
        def view_sim(smem):
            return smem[offset : offset + count]

        return view_sim

    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def view(typingctx, smem):
        if not (isinstance(smem, types.Array) and smem.ndim == 1):
            return None
        aryty = smem.copy(layout="C")
        sig = aryty(smem)

        def codegen(context, builder, signature, args):
            return _tile_view(context, builder, signature, args[0], ir.Constant(ir.IntType(64), offset), count)

        return sig, codegen

    return view


@functools.lru_cache(maxsize=None)
def shared_tile_pair(offset0: int, offset1: int, count: int):
    """A device function ``view(smem, which) -> smem[offset : offset + count]`` with ``offset``
    ``offset0`` when ``which == 0`` else ``offset1`` (a double buffer): the selection is on the
    offset, one ``gep`` from the shared base, so NVVM can keep the shared address space of the
    view's loads (selecting between two :func:`shared_tile` views made the tf32x3 backward's
    scalar reads generic ``LD``)."""
    if simulated():

        @device_jit
        def view_sim(smem, which):
            at = offset0 if which == 0 else offset1
            return smem[at : at + count]

        return view_sim

    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def view(typingctx, smem, which):
        if not (isinstance(smem, types.Array) and smem.ndim == 1 and isinstance(which, types.Integer)):
            return None
        aryty = smem.copy(layout="C")
        sig = aryty(smem, which)

        def codegen(context, builder, signature, args):
            i64 = ir.IntType(64)
            w = context.cast(builder, args[1], signature.args[1], types.int64)
            at = builder.select(builder.icmp_signed("==", w, ir.Constant(i64, 0)), ir.Constant(i64, offset0),
                                ir.Constant(i64, offset1))
            return _tile_view(context, builder, signature, args[0], at, count)

        return sig, codegen

    return view
