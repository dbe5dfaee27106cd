"""Tensor-core primitives for numba.cuda: ``mma.sync``, ``ldmatrix``, ``cp.async``, conversions.

numba-cuda has no tensor-core API, so on the GPU each primitive is one inline-PTX instruction
(an llvmlite ``InlineAsm`` inside a ``numba.cuda.extending.intrinsic``, the pattern of numba-cuda's
``cache_hints.py``). The simulator cannot run PTX, so in it each primitive is a Python device
function with the same per-lane semantics (PTX ISA, "Matrix fragments for mma.m16n8k16" and
"...m16n8k8", "ldmatrix"), so the tensor-core kernels run in CI from the same source.

Fragments are scalars: a ``uint32`` holds two 16-bit values (the lower column/row index in the
low half) or one TF32 value; accumulators are ``float32``. Lane ``l`` of a warp has
``g = l // 4`` (groupID) and ``t = l % 4`` (threadID_in_group):

==========================  ==============================================================
m16n8k16 (f16, bf16)        A (16x16): a0 (g, 2t:2t+2)  a1 (g+8, 2t:2t+2)  a2 (g, 2t+8:2t+10)
                            a3 (g+8, 2t+8:2t+10); B (16x8, k x n): b0 (2t:2t+2, g)
                            b1 (2t+8:2t+10, g); C/D (16x8): c0 c1 (g, 2t 2t+1) c2 c3 (g+8, ..)
m16n8k8 (tf32)              A (16x8): a0 (g, t) a1 (g+8, t) a2 (g, t+4) a3 (g+8, t+4);
                            B (8x8): b0 (t, g) b1 (t+4, g); C/D as above
==========================  ==============================================================

Copies (``cp.async``, 16 bytes each) are indexed (:func:`cp_async16`: the source element
``src[b, h, n, d]``, zero-filled when not valid) or walked (:func:`row_address` once, then
:func:`row_step` added per row, :func:`cp_async16_at`: no index arithmetic per copy; in the
simulator an "address" is the row index).

Loads from shared memory hide the lane addressing of ``ldmatrix``: :func:`ldsm_x4` reads the
16x16 block at (row0, col0) of a row-major 16-bit matrix as four 8x8 matrices
(rows 0-7 | 8-15) x (cols 0-7 | 8-15), in the order m0 = (0-7, 0-7), m1 = (8-15, 0-7),
m2 = (0-7, 8-15), m3 = (8-15, 8-15). Lane l receives of matrix j the pair
(row g, cols 2t, 2t+1) (``ldsm_x4``) or (rows 2t, 2t+1, col g) (``ldsm_x4_trans``). So one
``ldsm_x4`` of a Q block is an A fragment (a0..a3 = m0..m3); of a K block (keys x d) it is the
B fragments of two key tiles ((m0, m2) and (m1, m3)); ``ldsm_x4_trans`` of a V block
(keys x d) gives the B fragments of two head-dim tiles ((m0, m1) and (m2, m3)).

The backward adds :func:`ldsm_x4_a_trans` (the A fragment of the transpose of a stored block:
dS from dS^T), :func:`st_shared_u32` (a packed pair of 16-bit values to shared memory),
:func:`red_add_f32x2` (``red.global.add.v2.f32``: two float32 of a row added atomically) and
``f16_value`` / ``bf16_value`` (16-bit bits -> float32).

The simulated ``mma`` needs the other lanes' fragments: each thread writes its fragments to a
per-warp slot of a shared ``scratch`` array and meets the block at a barrier (double-buffered:
one barrier per product). So in the simulator every thread of the block must call every
product (as the kernels do); on the GPU ``scratch`` is unused (:func:`scratch_floats`).
"""

from __future__ import annotations

import numpy as np

from numba_flash._cuda import cuda, float32  # first: chooses the world before numba.cuda loads

from numba import uint16, uint32  # noqa: E402,F401  (fragment and tile element types, both worlds)

from numba_flash._world import simulated
from numba_flash.kernels.jit import device_jit

# Simulator scratch per warp: two buffers of A (16 x 16) and B (16 x 8) as float64-exact float32.
_SIM_A = 16 * 16
_SIM_SLOT = _SIM_A + 16 * 8


def scratch_floats(threads: int) -> int:
    """float32 elements of shared scratch the simulated products need (1 on the GPU)."""
    if not simulated():
        return 1
    warps = -(-threads // 32)
    return warps * 2 * _SIM_SLOT  # two buffers per warp


# --------------------------------------------------------------------------------------------
# Conversions (float32 -> 16-bit or TF32 bit patterns)
# --------------------------------------------------------------------------------------------


def _f16_bits(x) -> int:
    return int(np.asarray(x, np.float32).astype(np.float16).view(np.uint16))


def _bf16_bits(x) -> int:
    """float32 -> bfloat16 bits, round to nearest even (``cvt.rn.bf16.f32``)."""
    u = int(np.asarray(x, np.float32).view(np.uint32))
    if (u & 0x7F800000) == 0x7F800000 and (u & 0x7FFFFF):
        return 0x7FC0 | ((u >> 16) & 0x8000)  # NaN stays NaN
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def _tf32_bits(x) -> int:
    """float32 -> TF32 (10 mantissa bits) bits, round to nearest, ties away (``cvt.rna.tf32.f32``)."""
    u = int(np.asarray(x, np.float32).view(np.uint32))
    if (u & 0x7F800000) == 0x7F800000:
        return u  # inf and NaN pass through
    return ((u + 0x1000) & 0xFFFFE000) & 0xFFFFFFFF


def _split_bits(x) -> tuple[int, int]:
    """tf32x3's split of float32 ``x`` in three integer/float operations (``split_tf32``):
    big = bits(x) + 0x1000 (x rounded to TF32, half-way away from zero, once the tensor core
    drops the 13 low bits), small = x - big (exact in float32, |small| <= 2^-11 |x|), passed
    as its float32 bits (the tensor core truncates it to TF32: 2^-21 |x| at most)."""
    u = int(np.asarray(x, np.float32).view(np.uint32))
    big = (u + 0x1000) & 0xFFFFFFFF
    small = np.float32(np.float32(x) - np.uint32(big & 0xFFFFE000).view(np.float32))
    return big, int(np.asarray(small, np.float32).view(np.uint32))


HOST_HALF_BITS = {"f16": _f16_bits, "bf16": _bf16_bits}  # float32 -> 16-bit patterns on the host (simulator twins)


def _f16_value(bits: int) -> float:
    return float(np.uint16(bits).view(np.float16))


def _bf16_value(bits: int) -> float:
    return float(np.uint32((bits & 0xFFFF) << 16).view(np.float32))


def _f32_value(bits: int) -> float:
    return float(np.uint32(bits).view(np.float32))


_TF32_MASK = 0xFFFFE000
HALF_KINDS = ("f16", "bf16")  # 16-bit input kinds (float16, bfloat16) of m16n8k16


@device_jit
def swizzled(row, col, stride, mask):
    """Where element (row, col) of a 16-bit tile with rows of ``stride`` elements and no padding
    sits: its 16-byte chunk ``col >> 3`` exchanged with chunk ``(col >> 3) ^ (row & mask)`` of
    the same row. With ``mask = 7`` the 8 rows an ``ldmatrix`` reads at one column hit 8 distinct
    chunks of a 128-byte span (all 32 banks), as the 16 bytes of padding per row do, and a row
    stays whole 128-byte segments (a warp's ``cp.async`` of two rows writes four of them)."""
    return row * stride + ((((col >> 3) ^ (row & mask)) << 3) | (col & 7))

if simulated():
    import threading

    _u32 = int  # the simulator stores Python ints into uint32 arrays
    _THREAD = threading.local()

    @device_jit
    def pack_f16x2(lo, hi):
        return _u32(_f16_bits(lo) | (_f16_bits(hi) << 16))

    @device_jit
    def pack_bf16x2(lo, hi):
        return _u32(_bf16_bits(lo) | (_bf16_bits(hi) << 16))

    @device_jit
    def to_tf32(x):
        return _u32(_tf32_bits(x))

    @device_jit
    def tf32_value(bits):
        return float32(_f32_value(bits))

    @device_jit
    def split_tf32(x):
        big, small = _split_bits(x)
        return _u32(big), _u32(small)

    @device_jit
    def f16_bits(x):
        return _f16_bits(x)

    @device_jit
    def bf16_bits(x):
        return _bf16_bits(x)

    # ----------------------------------------------------------------------------------------
    # ldmatrix and cp.async: per-thread, no exchange needed
    # ----------------------------------------------------------------------------------------

    def _pair(smem, i0, i1):
        return _u32(int(smem[i0]) | (int(smem[i1]) << 16))

    @device_jit
    def ldsm_x4_swizzled(smem, row0, col0, stride, mask):
        lane = cuda.threadIdx.x % 32
        g, t = lane // 4, lane % 4
        out = []
        for j in range(4):
            r = row0 + 8 * (j % 2) + g
            i = swizzled(r, col0 + 8 * (j // 2) + 2 * t, stride, mask)
            out.append(_pair(smem, i, i + 1))
        return out[0], out[1], out[2], out[3]

    @device_jit
    def ldsm_x4_trans_swizzled(smem, row0, col0, stride, mask):
        lane = cuda.threadIdx.x % 32
        g, t = lane // 4, lane % 4
        out = []
        for j in range(4):
            r = row0 + 8 * (j % 2) + 2 * t
            c = col0 + 8 * (j // 2) + g
            out.append(_pair(smem, swizzled(r, c, stride, mask), swizzled(r + 1, c, stride, mask)))
        return out[0], out[1], out[2], out[3]

    @device_jit
    def ldsm_x4(smem, row0, col0, stride):
        """A padded tile is a swizzled one with mask 0 (no chunk exchanged)."""
        return ldsm_x4_swizzled(smem, row0, col0, stride, 0)

    @device_jit
    def ldsm_x4_trans(smem, row0, col0, stride):
        return ldsm_x4_trans_swizzled(smem, row0, col0, stride, 0)

    @device_jit
    def ldsm_x4_f32(smem, row0, col0, stride):
        lane = cuda.threadIdx.x % 32
        g, t = lane // 4, lane % 4
        out = []
        for j in range(4):
            r = row0 + 8 * (j % 2) + g
            c = col0 + 4 * (j // 2) + t
            out.append(float32(smem[r * stride + c]))
        return out[0], out[1], out[2], out[3]

    @device_jit
    def lds_x4(smem, index):
        """Four 32-bit words ``smem[index:index+4]`` (``ld.shared.v4.b32``) as uint32 bit patterns."""
        out = []
        for j in range(4):
            out.append(_u32(int(np.asarray(smem[index + j], np.float32).view(np.uint32))))
        return out[0], out[1], out[2], out[3]

    @device_jit
    def sts_x4(smem, index, w0, w1, w2, w3):
        """``smem[index:index+4] = w0..w3`` (uint32 bit patterns, ``st.shared.v4.b32``)."""
        for j, w in enumerate((w0, w1, w2, w3)):
            smem[index + j] = np.uint32(int(w) & 0xFFFFFFFF).view(np.float32)

    @device_jit
    def cp_async16(dst, dst_i, src, b, h, n, d, valid):
        """16 bytes (8 x 16-bit) from ``src[b, h, n, d:d+8]`` to ``dst[dst_i:dst_i+8]``; zeros
        when not ``valid`` (``cp.async``'s src-size 0)."""
        for e in range(8):
            dst[dst_i + e] = src[b, h, n, d + e] if valid else 0

    @device_jit
    def cp_async16_f32(dst, dst_i, src, b, h, n, d, valid):
        """16 bytes (4 x float32) from ``src[b, h, n, d:d+4]`` to ``dst[dst_i:dst_i+4]``."""
        for e in range(4):
            dst[dst_i + e] = src[b, h, n, d + e] if valid else float32(0.0)

    # Row walks (``tc_ops``' copy loop): an "address" is a row index here, and a row's step 1;
    # on the GPU they are a byte address and the row stride in bytes. Kernels only add steps.
    @device_jit
    def row_address(src, b, h, n, d):
        return n

    @device_jit
    def row_step(src):
        return 1

    @device_jit
    def cp_async16_at(dst, dst_i, src, b, h, d, address):
        """16 bytes (8 x 16-bit) of row ``address`` (a :func:`row_address`), columns d:d+8."""
        for e in range(8):
            dst[dst_i + e] = src[b, h, address, d + e]

    @device_jit
    def cp_async16_at_f32(dst, dst_i, src, b, h, d, address):
        for e in range(4):
            dst[dst_i + e] = src[b, h, address, d + e]

    @device_jit
    def cp_async_commit():
        pass

    @device_jit
    def cp_async_wait_all():
        pass

    @device_jit
    def cp_async_wait_one():
        """All but the most recent committed group are complete."""
        pass

    def cp_async_wait_group(n: int):
        """A device function: all but the ``n`` most recent committed groups are complete."""

        @device_jit
        def wait():
            pass

        return wait

    # ----------------------------------------------------------------------------------------
    # 16-bit values, shared stores of packed pairs, vector reductions (the backward's)
    # ----------------------------------------------------------------------------------------

    @device_jit
    def f16_value(bits):
        return float32(_f16_value(int(bits) & 0xFFFF))

    @device_jit
    def bf16_value(bits):
        return float32(_bf16_value(int(bits) & 0xFFFF))

    @device_jit
    def st_shared_u32(smem, i, bits):
        """``smem[i], smem[i + 1]`` (16-bit elements, ``i`` even) = the low, high half of ``bits``."""
        smem[i] = int(bits) & 0xFFFF
        smem[i + 1] = (int(bits) >> 16) & 0xFFFF

    @device_jit
    def red_add_f32x2(x, n, d, v0, v1):
        """``x[n, d] += v0`` and ``x[n, d + 1] += v1``, atomically (float32, 2-D)."""
        cuda.atomic.add(x, (n, d), v0)
        cuda.atomic.add(x, (n, d + 1), v1)

    # ----------------------------------------------------------------------------------------
    # mma.sync, through a shared scratch exchange
    # ----------------------------------------------------------------------------------------

    def _sim_mma(kind, acc, ci, a, b, scratch):
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        g, t = lane // 4, lane % 4
        # Which of the warp's two buffers: every thread counts its own products, and all
        # threads make the same products, so lanes agree (the simulator runs each CUDA thread
        # as a fresh Python thread: the count starts at 0 in every block).
        parity = getattr(_THREAD, "products", 0) & 1
        _THREAD.products = 1 - parity
        base = (warp * 2 + parity) * _SIM_SLOT
        A = scratch[base : base + _SIM_A]  # 16 x 16 (f16/bf16) or 16 x 8 (tf32), row-major
        B = scratch[base + _SIM_A : base + _SIM_SLOT]  # k x 8, row-major
        if kind == "tf32":
            K = 8
            # the tensor core reads the 19 high bits of a TF32 operand (the 13 low ones are
            # undefined in TF32 and dropped; CUTLASS's round_half_ulp_truncate relies on it)
            for r, c, bits in ((g, t, a[0]), (g + 8, t, a[1]), (g, t + 4, a[2]), (g + 8, t + 4, a[3])):
                A[r * K + c] = _f32_value(int(bits) & _TF32_MASK)
            B[t * 8 + g] = _f32_value(int(b[0]) & _TF32_MASK)
            B[(t + 4) * 8 + g] = _f32_value(int(b[1]) & _TF32_MASK)
        else:
            K = 16
            value = _f16_value if kind == "f16" else _bf16_value
            for r, c, bits in ((g, 2 * t, a[0]), (g + 8, 2 * t, a[1]), (g, 2 * t + 8, a[2]), (g + 8, 2 * t + 8, a[3])):
                A[r * K + c] = value(bits & 0xFFFF)
                A[r * K + c + 1] = value(bits >> 16)
            for k0, bits in ((2 * t, b[0]), (2 * t + 8, b[1])):
                B[k0 * 8 + g] = value(bits & 0xFFFF)
                B[(k0 + 1) * 8 + g] = value(bits >> 16)
        cuda.syncthreads()  # every lane's fragments are in the slot
        a_rows = np.asarray(A[: 16 * K], np.float64).reshape(16, K)
        b_cols = np.asarray(B[: K * 8], np.float64).reshape(K, 8)
        for e, (r, c) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))):
            acc[ci, e] = float32(float(acc[ci, e]) + float(a_rows[r] @ b_cols[:, c]))

    @device_jit
    def mma_f16(acc, ci, a0, a1, a2, a3, b0, b1, scratch):
        """acc[ci, 0:4] += A B, m16n8k16, float16 in, float32 accumulate."""
        _sim_mma("f16", acc, ci, (a0, a1, a2, a3), (b0, b1), scratch)

    @device_jit
    def mma_bf16(acc, ci, a0, a1, a2, a3, b0, b1, scratch):
        """acc[ci, 0:4] += A B, m16n8k16, bfloat16 in, float32 accumulate."""
        _sim_mma("bf16", acc, ci, (a0, a1, a2, a3), (b0, b1), scratch)

    @device_jit
    def mma_tf32(acc, ci, a0, a1, a2, a3, b0, b1, scratch):
        """acc[ci, 0:4] += A B, m16n8k8, TF32 in, float32 accumulate."""
        _sim_mma("tf32", acc, ci, (a0, a1, a2, a3), (b0, b1), scratch)

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    _I16, _I32, _F32 = ir.IntType(16), ir.IntType(32), ir.FloatType()

    def _asm(builder, ret, args_ty, text, constraints, args, side_effect=False):
        fnty = ir.FunctionType(ret, args_ty)
        return builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=side_effect), args)

    def _element_ptr(context, builder, aryty, ary, index_types, indices):
        """Generic pointer to ``ary[indices]`` (no negative-index wraparound)."""
        inds = [context.cast(builder, i, t, types.intp) for t, i in zip(index_types, indices)]
        arr = context.make_array(aryty)(context, builder, value=ary)
        return cgutils.get_item_pointer(context, builder, aryty, arr, inds, wraparound=False)

    def _shared_addr(builder, ptr):
        """The 32-bit shared-window address of a generic pointer into shared memory."""
        i8 = ir.IntType(8)
        generic = builder.bitcast(ptr, i8.as_pointer())
        shared = builder.addrspacecast(generic, i8.as_pointer(3))
        return builder.ptrtoint(shared, _I32)

    def _global_addr(builder, ptr):
        """The 64-bit global address of a generic pointer into global memory."""
        i8 = ir.IntType(8)
        generic = builder.bitcast(ptr, i8.as_pointer())
        glob = builder.addrspacecast(generic, i8.as_pointer(1))
        return builder.ptrtoint(glob, ir.IntType(64))

    # ---------------------------------- conversions ----------------------------------------

    def _pack2(mnemonic):
        @intrinsic
        def pack(typingctx, lo, hi):
            sig = types.uint32(types.float32, types.float32)

            def codegen(context, builder, signature, args):
                lo_v, hi_v = (context.cast(builder, a, t, types.float32) for a, t in zip(args, signature.args))
                # cvt.rn.{f16,bf16}x2.f32 d, a, b: a -> upper half, b -> lower half
                return _asm(builder, _I32, [_F32, _F32], f"cvt.rn.{mnemonic}x2.f32 $0, $2, $1;", "=r,f,f", [lo_v, hi_v])

            return sig, codegen

        return pack

    _pack_f16 = _pack2("f16")
    _pack_bf16 = _pack2("bf16")

    @intrinsic
    def _cvt_tf32(typingctx, x):
        sig = types.uint32(types.float32)

        def codegen(context, builder, signature, args):
            return _asm(builder, _I32, [_F32], "cvt.rna.tf32.f32 $0, $1;", "=r,f", [args[0]])

        return sig, codegen

    @intrinsic
    def _split_tf32(typingctx, x):
        sig = types.UniTuple(types.uint32, 2)(types.float32)

        def codegen(context, builder, signature, args):
            (xv,) = args
            u = builder.bitcast(xv, _I32)
            big = builder.add(u, ir.Constant(_I32, 0x1000))
            big_value = builder.bitcast(builder.and_(big, ir.Constant(_I32, 0xFFFFE000)), _F32)
            small = builder.bitcast(builder.fsub(xv, big_value), _I32)
            return context.make_tuple(builder, signature.return_type, [big, small])

        return sig, codegen

    @intrinsic
    def _bits_as_f32(typingctx, bits):
        sig = types.float32(types.uint32)

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], _F32)

        return sig, codegen

    def _half_bits(mnemonic):
        @intrinsic
        def bits16(typingctx, x):
            sig = types.uint16(types.float32)

            def codegen(context, builder, signature, args):
                return _asm(builder, _I16, [_F32], f"cvt.rn.{mnemonic}.f32 $0, $1;", "=h,f", [args[0]])

            return sig, codegen

        return bits16

    _f16_bits16 = _half_bits("f16")
    _bf16_bits16 = _half_bits("bf16")

    @device_jit
    def pack_f16x2(lo, hi):
        return _pack_f16(lo, hi)

    @device_jit
    def pack_bf16x2(lo, hi):
        return _pack_bf16(lo, hi)

    @device_jit
    def to_tf32(x):
        return _cvt_tf32(x)

    @device_jit
    def tf32_value(bits):
        return _bits_as_f32(bits)

    @device_jit
    def split_tf32(x):
        """(big, small) TF32 operands of float32 ``x``, 3 instructions (see ``_split_bits``)."""
        return _split_tf32(x)

    @device_jit
    def f16_bits(x):
        return _f16_bits16(x)

    @device_jit
    def bf16_bits(x):
        return _bf16_bits16(x)

    # ---------------------------------- ldmatrix -------------------------------------------

    def _ldmatrix(trans):
        suffix = ".trans" if trans else ""

        @intrinsic
        def ldmatrix(typingctx, smem, index):
            sig = types.UniTuple(types.uint32, 4)(smem, index)

            def codegen(context, builder, signature, args):
                aryty, idxty = signature.args
                ptr = _element_ptr(context, builder, aryty, args[0], [idxty], [args[1]])
                ret = ir.LiteralStructType([_I32] * 4)
                # Volatile, and clobbering memory: the asm reads shared memory that the
                # compiler cannot see, so it must not be hoisted out of a loop (the address of
                # K_j is the same in every iteration), merged, or moved across a barrier.
                r = _asm(
                    builder, ret, [_I32],
                    f"ldmatrix.sync.aligned.m8n8.x4{suffix}.shared.b16 {{$0,$1,$2,$3}}, [$4];",
                    "=r,=r,=r,=r,r,~{memory}", [_shared_addr(builder, ptr)], side_effect=True,
                )
                vals = [builder.extract_value(r, i) for i in range(4)]
                return context.make_tuple(builder, signature.return_type, vals)

            return sig, codegen

        return ldmatrix

    _ldmatrix_x4 = _ldmatrix(False)
    _ldmatrix_x4_trans = _ldmatrix(True)

    @device_jit
    def _lane_address(row0, col0, stride):
        """Lanes 0-7 give the rows of m0, 8-15 of m1 (rows + 8), 16-23 of m2 (cols + 8), 24-31 of m3."""
        lane = cuda.threadIdx.x & 31
        return (row0 + (lane & 7) + (lane & 8)) * stride + col0 + ((lane >> 4) << 3)

    @device_jit
    def ldsm_x4(smem, row0, col0, stride):
        return _ldmatrix_x4(smem, _lane_address(row0, col0, stride))

    @device_jit
    def ldsm_x4_trans(smem, row0, col0, stride):
        return _ldmatrix_x4_trans(smem, _lane_address(row0, col0, stride))

    @device_jit
    def _lane_address_swizzled(row0, col0, stride, mask):
        """:func:`_lane_address` in a :func:`swizzled` tile (col0 a multiple of 8)."""
        lane = cuda.threadIdx.x & 31
        return swizzled(row0 + (lane & 7) + (lane & 8), col0 + ((lane >> 4) << 3), stride, mask)

    @device_jit
    def ldsm_x4_swizzled(smem, row0, col0, stride, mask):
        """:func:`ldsm_x4` of a :func:`swizzled` tile."""
        return _ldmatrix_x4(smem, _lane_address_swizzled(row0, col0, stride, mask))

    @device_jit
    def ldsm_x4_trans_swizzled(smem, row0, col0, stride, mask):
        """:func:`ldsm_x4_trans` of a :func:`swizzled` tile."""
        return _ldmatrix_x4_trans(smem, _lane_address_swizzled(row0, col0, stride, mask))

    @device_jit
    def ldsm_x4_f32(smem, row0, col0, stride):
        """The 16 x 8 float32 block at (row0, col0) as four 8 x 4 matrices, m0 = (0-7, 0-3),
        m1 = (8-15, 0-3), m2 = (0-7, 4-7), m3 = (8-15, 4-7): lane (g, t) gets element (g, t)
        of each (an 8 x 8 b16 matrix is 8 rows of 16 bytes: word t of row g)."""
        lane = cuda.threadIdx.x & 31
        r = _ldmatrix_x4(smem, (row0 + (lane & 7) + (lane & 8)) * stride + col0 + ((lane >> 4) << 2))
        return _bits_as_f32(r[0]), _bits_as_f32(r[1]), _bits_as_f32(r[2]), _bits_as_f32(r[3])

    @intrinsic
    def _lds_v4(typingctx, smem, index):
        sig = types.UniTuple(types.uint32, 4)(smem, index)

        def codegen(context, builder, signature, args):
            aryty, idxty = signature.args
            ptr = _element_ptr(context, builder, aryty, args[0], [idxty], [args[1]])
            ret = ir.LiteralStructType([_I32] * 4)
            # volatile with a memory clobber, as ldmatrix: the tile is rewritten every K/V step
            r = _asm(
                builder, ret, [_I32], "ld.shared.v4.b32 {$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,r,~{memory}",
                [_shared_addr(builder, ptr)], side_effect=True,
            )
            vals = [builder.extract_value(r, i) for i in range(4)]
            return context.make_tuple(builder, signature.return_type, vals)

        return sig, codegen

    @intrinsic
    def _sts_v4(typingctx, smem, index, w0, w1, w2, w3):
        sig = types.void(smem, index, w0, w1, w2, w3)

        def codegen(context, builder, signature, args):
            aryty, idxty = signature.args[:2]
            ptr = _element_ptr(context, builder, aryty, args[0], [idxty], [args[1]])
            words = [context.cast(builder, a, t, types.uint32) for a, t in zip(args[2:], signature.args[2:])]
            _asm(
                builder, ir.VoidType(), [_I32] * 5, "st.shared.v4.b32 [$0], {$1,$2,$3,$4};", "r,r,r,r,r,~{memory}",
                [_shared_addr(builder, ptr)] + words, side_effect=True,
            )
            return context.get_dummy_value()

        return sig, codegen

    @device_jit
    def lds_x4(smem, index):
        """Four 32-bit words ``smem[index:index+4]`` (one ``ld.shared.v4``; ``index`` a multiple
        of 4 in a 16-byte aligned array) as uint32 bit patterns."""
        return _lds_v4(smem, index)

    @device_jit
    def sts_x4(smem, index, w0, w1, w2, w3):
        """``smem[index:index+4] = w0..w3`` as bit patterns (one ``st.shared.v4``)."""
        _sts_v4(smem, index, w0, w1, w2, w3)

    # ---------------------------------- cp.async -------------------------------------------

    @intrinsic
    def _cp_async_cg16(typingctx, dst, dst_i, src, b, h, n, d, valid):
        sig = types.void(dst, dst_i, src, b, h, n, d, valid)

        def codegen(context, builder, signature, args):
            dty, dity, sty, bt, ht, nt, dt, vt = signature.args
            dptr = _element_ptr(context, builder, dty, args[0], [dity], [args[1]])
            sptr = _element_ptr(context, builder, sty, args[2], [bt, ht, nt, dt], args[3:7])
            valid_v = context.cast(builder, args[7], vt, types.boolean)
            nbytes = builder.select(valid_v, ir.Constant(_I32, 16), ir.Constant(_I32, 0))
            _asm(
                builder, ir.VoidType(), [_I32, ir.IntType(64), _I32],
                "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r,~{memory}",
                [_shared_addr(builder, dptr), _global_addr(builder, sptr), nbytes], side_effect=True,
            )
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def _global_address(typingctx, src, b, h, n, d):
        sig = types.int64(src, b, h, n, d)

        def codegen(context, builder, signature, args):
            sty, *index_types = signature.args
            return _global_addr(builder, _element_ptr(context, builder, sty, args[0], index_types, args[1:]))

        return sig, codegen

    @intrinsic
    def _cp_async_cg16_at(typingctx, dst, dst_i, address):
        sig = types.void(dst, dst_i, address)

        def codegen(context, builder, signature, args):
            dty, dity, aty = signature.args
            dptr = _element_ptr(context, builder, dty, args[0], [dity], [args[1]])
            src = context.cast(builder, args[2], aty, types.int64)
            _asm(
                builder, ir.VoidType(), [_I32, ir.IntType(64)],
                "cp.async.cg.shared.global [$0], [$1], 16;", "r,l,~{memory}",
                [_shared_addr(builder, dptr), src], side_effect=True,
            )
            return context.get_dummy_value()

        return sig, codegen

    def _asm_statement(text):
        @intrinsic
        def statement(typingctx):
            sig = types.void()

            def codegen(context, builder, signature, args):
                # "memory" clobber: the compiler must not move shared loads across it
                _asm(builder, ir.VoidType(), [], text, "~{memory}", [], side_effect=True)
                return context.get_dummy_value()

            return sig, codegen

        return statement

    _commit = _asm_statement("cp.async.commit_group;")
    _wait_all = _asm_statement("cp.async.wait_group 0;")
    _wait_one = _asm_statement("cp.async.wait_group 1;")

    @device_jit
    def cp_async16(dst, dst_i, src, b, h, n, d, valid):
        """16 bytes from ``src[b, h, n, d:d+8]`` (16-bit elements) to ``dst[dst_i:]``, asynchronously;
        zeros when not ``valid`` (src-size 0: nothing is read, ``src`` must still be in bounds)."""
        _cp_async_cg16(dst, dst_i, src, b, h, n, d, valid)

    @device_jit
    def cp_async16_f32(dst, dst_i, src, b, h, n, d, valid):
        """16 bytes from ``src[b, h, n, d:d+4]`` (float32) to ``dst[dst_i:]``, asynchronously."""
        _cp_async_cg16(dst, dst_i, src, b, h, n, d, valid)

    @device_jit
    def row_address(src, b, h, n, d):
        """The global address of ``src[b, h, n, d]``: the start of a row walk, advanced by
        :func:`row_step` per row (one 64-bit add per copy instead of the element's full index)."""
        return _global_address(src, b, h, n, d)

    @device_jit
    def row_step(src):
        """Bytes from one row of ``src`` (B, H, N, D) to the next."""
        return src.strides[2]

    @device_jit
    def cp_async16_at(dst, dst_i, src, b, h, d, address):
        """16 bytes at global ``address`` (a :func:`row_address`; ``src``, ``b``, ``h``, ``d``
        name it for the simulator) to ``dst[dst_i:]``, asynchronously, always read."""
        _cp_async_cg16_at(dst, dst_i, address)

    @device_jit
    def cp_async16_at_f32(dst, dst_i, src, b, h, d, address):
        _cp_async_cg16_at(dst, dst_i, address)

    @device_jit
    def cp_async_commit():
        _commit()

    @device_jit
    def cp_async_wait_all():
        _wait_all()

    @device_jit
    def cp_async_wait_one():
        """All but the most recent committed group are complete."""
        _wait_one()

    def cp_async_wait_group(n: int):
        """A device function: all but the ``n`` most recent committed groups are complete
        (``cp.async.wait_group n``: ``n`` is an immediate, so one function per ``n``)."""
        statement = _asm_statement(f"cp.async.wait_group {int(n)};")

        @device_jit
        def wait():
            statement()

        return wait

    # --------------------- 16-bit values, packed shared stores, vector reductions -----------

    @intrinsic
    def _cvt_f16_f32(typingctx, bits):
        sig = types.float32(types.uint16)

        def codegen(context, builder, signature, args):
            return _asm(builder, _F32, [_I16], "cvt.f32.f16 $0, $1;", "=f,h", [args[0]])

        return sig, codegen

    @intrinsic
    def _bf16_as_f32(typingctx, bits):
        sig = types.float32(types.uint16)

        def codegen(context, builder, signature, args):
            return builder.bitcast(builder.shl(builder.zext(args[0], _I32), ir.Constant(_I32, 16)), _F32)

        return sig, codegen

    @intrinsic
    def _st_shared_b32(typingctx, smem, index, bits):
        sig = types.void(smem, index, types.uint32)

        def codegen(context, builder, signature, args):
            aryty, idxty, _ = signature.args
            ptr = _element_ptr(context, builder, aryty, args[0], [idxty], [args[1]])
            # volatile with a memory clobber, as ldmatrix: the compiler cannot see this store
            _asm(builder, ir.VoidType(), [_I32, _I32], "st.shared.b32 [$0], $1;", "r,r,~{memory}",
                 [_shared_addr(builder, ptr), args[2]], side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def _red_add_v2(typingctx, x, n, d, v0, v1):
        sig = types.void(x, n, d, types.float32, types.float32)

        def codegen(context, builder, signature, args):
            xty, nt, dt = signature.args[:3]
            ptr = _element_ptr(context, builder, xty, args[0], [nt, dt], args[1:3])
            _asm(builder, ir.VoidType(), [ir.IntType(64), _F32, _F32], "red.global.add.v2.f32 [$0], {$1, $2};",
                 "l,f,f,~{memory}", [_global_addr(builder, ptr), args[3], args[4]], side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    @device_jit
    def f16_value(bits):
        """The float32 value of float16 bits (``cvt.f32.f16``, exact)."""
        return _cvt_f16_f32(bits)

    @device_jit
    def bf16_value(bits):
        """The float32 value of bfloat16 bits (the high half of a float32, exact)."""
        return _bf16_as_f32(bits)

    @device_jit
    def st_shared_u32(smem, i, bits):
        """``smem[i], smem[i + 1]`` (16-bit elements of shared memory, ``i`` even) = the low and
        high half of ``bits``: one 32-bit store (``st.shared.b32``)."""
        _st_shared_b32(smem, i, bits)

    @device_jit
    def red_add_f32x2(x, n, d, v0, v1):
        """``x[n, d:d + 2] += (v0, v1)`` atomically, one ``red.global.add.v2.f32`` (sm_90; ``x``
        a 2-D float32 array in global memory, e.g. ``dq[b, h]``; the address 8-byte aligned:
        ``d`` and the row stride even)."""
        _red_add_v2(x, n, d, v0, v1)

    # ---------------------------------- mma.sync -------------------------------------------

    def _mma(shape, a_type):
        text = (
            f"mma.sync.aligned.{shape}.row.col.f32.{a_type}.{a_type}.f32 "
            "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};"
        )

        @intrinsic
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            sig = types.UniTuple(types.float32, 4)(*([types.uint32] * 6), *([types.float32] * 4))

            def codegen(context, builder, signature, args):
                ret = ir.LiteralStructType([_F32] * 4)
                r = _asm(builder, ret, [_I32] * 6 + [_F32] * 4, text, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", list(args))
                vals = [builder.extract_value(r, i) for i in range(4)]
                return context.make_tuple(builder, signature.return_type, vals)

            return sig, codegen

        return mma

    _mma_f16 = _mma("m16n8k16", "f16")
    _mma_bf16 = _mma("m16n8k16", "bf16")
    _mma_tf32 = _mma("m16n8k8", "tf32")

    def _accumulate(product):
        @device_jit
        def mma(acc, ci, a0, a1, a2, a3, b0, b1, scratch):
            d = product(a0, a1, a2, a3, b0, b1, acc[ci, 0], acc[ci, 1], acc[ci, 2], acc[ci, 3])
            acc[ci, 0] = d[0]
            acc[ci, 1] = d[1]
            acc[ci, 2] = d[2]
            acc[ci, 3] = d[3]

        return mma

    mma_f16 = _accumulate(_mma_f16)
    mma_bf16 = _accumulate(_mma_bf16)
    mma_tf32 = _accumulate(_mma_tf32)


@device_jit
def ldsm_x4_a_trans(smem, row0, col0, stride):
    """The m16n8k16 A fragment of the *transpose* of the 16x16 block at (row0, col0) of a
    row-major 16-bit matrix X: A = X^T (A's rows are X's columns), by one ``ldmatrix.trans``.
    Lane (g, t) of ``ldsm_x4_trans`` gets (X[2t, g], X[2t+1, g]) of each 8x8 matrix, i.e.
    (A[g, 2t], A[g, 2t+1]); A's a1 (rows 8-15 = X's columns 8-15) is matrix m2 and a2 (A's
    columns 8-15 = X's rows 8-15) is m1. The backward reads dS this way from dS^T."""
    x = ldsm_x4_trans(smem, row0, col0, stride)
    return x[0], x[2], x[1], x[3]


MMA_16 = {"f16": mma_f16, "bf16": mma_bf16}  # m16n8k16 product of a 16-bit kind
PACK_16 = {"f16": pack_f16x2, "bf16": pack_bf16x2}  # two float32 -> two 16-bit in a uint32
BITS_16 = {"f16": f16_bits, "bf16": bf16_bits}  # float32 -> one 16-bit pattern (uint16)
VALUE_16 = {"f16": f16_value, "bf16": bf16_value}  # one 16-bit pattern (uint16) -> float32
