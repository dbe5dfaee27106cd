"""exp2 on the FMA units: a cubic and an exponent shift, where ``ex2.approx`` takes the MUFU.

An SM has 16 MUFU lanes against 128 FP32 lanes. Where the softmax's exponentials are the
bound -- FA-3 at D = 64 or in fp8 (an exponential per 64 or 128 tensor-core FLOP per 32 bytes of
K), or with a soft cap, whose ``tanh`` is a second MUFU instruction per score -- FlashAttention-4
(``flash_attn/cute/utils.py: ex2_emulation``) computes a share of them with FMAs. The same here:

    2^x = 2^floor(x) * 2^f,  f = x - floor(x) in [0, 1)
    2^f ~ 1 + f (c1 + f (c2 + f c3))      (FA-4's cubic; relative error 8.8e-5 on [0, 1))

``floor`` is one ``add.rm`` of 1.5 * 2^23 (the integer lands in the low mantissa bits), the
product with 2^floor(x) an integer add of ``floor(x) << 23`` to the cubic's bits: nine
instructions, none of them MUFU (FMNMX, three FADD, three FFMA, SHL, IADD).

Edge cases, matching ``ex2.approx.ftz`` where it matters to attention:

- x <= -127 (a masked score's -inf among them) gives exactly +0: x is clamped at -127 (FA-4's
  clamp), where f = 0, the cubic is 1.0 exactly, and 1.0's bits plus -127 << 23 are 0. For
  -127 < x < -126 the result is a subnormal near 2^x (MUFU flushes it to 0; both are below
  anything a 16-bit P holds).
- NaN stays NaN in the clamp (``max.NaN``); what follows is not specified for it (a NaN row's max is
  NaN, so its exponentials through the MUFU make its sum NaN anyway).
- x up to 127 is exact in range (the softmax's x is at most 0, fp8's at most 8).

:func:`exp2_poly` is one inline-PTX block on the GPU and a NumPy twin with the same float32 steps
and bit arithmetic in the simulator (:func:`host_exp2_poly`, vectorised, for the tests).
"""

from __future__ import annotations

import numpy as np

from numba_flash._cuda import float32  # first: chooses the world before numba.cuda loads

from numba_flash._world import simulated
from numba_flash.kernels.jit import device_jit

COEFFS = (1.0, 0.695146143436431884765625, 0.227564394474029541015625, 0.077119089663028717041015625)
MAX_RELATIVE_ERROR = 8.8e-5  # of the cubic against 2^f on [0, 1) (float32 steps add ~1e-7)
CLAMP = -127.0
ROUNDER = float(2**23 + 2**22)  # 1.5 * 2^23: x + it, rounded down, holds floor(x) in its low bits


def _f32_hex(x: float) -> str:
    return "0f%08X" % int(np.float32(x).view(np.uint32))


def host_exp2_poly(x) -> np.ndarray:
    """The GPU's steps on the host (float32 arrays in, float32 out): the simulator's twin and the
    tests' statement of what the instruction sequence computes."""
    x = np.asarray(x, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        c = np.where(np.isnan(x), x, np.maximum(x, np.float32(CLAMP))).astype(np.float32)
        floor = np.floor(c).astype(np.float32)  # add.rm(c, 1.5 2^23) - 1.5 2^23: exact for |c| < 2^22
        f = (c - floor).astype(np.float32)  # exact (Sterbenz)
        p = np.float32(COEFFS[3])
        for coeff in COEFFS[2::-1]:  # fma.rn: the float64 product of two float32 is exact
            p = (p.astype(np.float64) * f + np.float64(np.float32(coeff))).astype(np.float32)
        shift = np.where(np.isnan(floor), 0, floor).astype(np.int64) << 23
        bits = (p.view(np.int32).astype(np.int64) + shift).astype(np.int64)
        out = ((bits + 2**31) % 2**32 - 2**31).astype(np.int32).view(np.float32)  # the 32-bit add wraps
    return np.where(np.isnan(x), np.float32(np.nan), out).astype(np.float32)


if simulated():

    @device_jit
    def exp2_poly(x):
        """2^x by the cubic (see the module's docstring)."""
        return float32(host_exp2_poly(np.float32(x))[()])

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    _F32 = ir.FloatType()
    _TEXT = "\n".join([
        "{",
        ".reg .f32 c, r, b, f, p;",
        ".reg .s32 ri, pi, o;",
        f"max.NaN.f32 c, $1, {_f32_hex(CLAMP)};",
        f"add.rm.f32 r, c, {_f32_hex(ROUNDER)};",
        f"sub.rn.f32 b, r, {_f32_hex(ROUNDER)};",
        "sub.rn.f32 f, c, b;",
        f"fma.rn.f32 p, f, {_f32_hex(COEFFS[3])}, {_f32_hex(COEFFS[2])};",
        f"fma.rn.f32 p, p, f, {_f32_hex(COEFFS[1])};",
        f"fma.rn.f32 p, p, f, {_f32_hex(COEFFS[0])};",
        "mov.b32 ri, r;",
        "mov.b32 pi, p;",
        "shl.b32 ri, ri, 23;",
        "add.s32 o, ri, pi;",
        "mov.b32 $0, o;",
        "}",
    ])

    @intrinsic
    def _exp2_poly(typingctx, x):
        def codegen(context, builder, sig, args):
            v = context.cast(builder, args[0], sig.args[0], types.float32)
            fn = ir.InlineAsm(ir.FunctionType(_F32, [_F32]), _TEXT, "=f,f", side_effect=False)
            return builder.call(fn, [v])

        return types.float32(x), codegen

    @device_jit
    def exp2_poly(x):
        """2^x by the cubic on the FMA units (see the module's docstring)."""
        return _exp2_poly(x)
