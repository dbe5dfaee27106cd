"""Hopper (sm_90a) primitives for numba.cuda: TMA, mbarriers, ``wgmma``, ``setmaxnreg``.

FlashAttention-3 (Shah et al. 2024) is built on four instructions that Ampere lacks, and numba-cuda
has none of them; so, as :mod:`numba_flash.kernels.mma` does for ``mma.sync``, each is one
inline-PTX instruction on the GPU (an llvmlite ``InlineAsm`` in a numba ``intrinsic``) and a
Python twin with the PTX semantics in the simulator, so that the ``fa3`` kernel runs in CI from
the same source (PTX ISA 8.x: "Tensor Memory Accelerator", "mbarrier", "Asynchronous Warpgroup
Level Matrix Multiply-Accumulate", "setmaxnreg").

Shared memory is one dynamic byte buffer ``smem`` per block; operands are named by **addresses**:
on the GPU the 32-bit shared-window address (:func:`tile_base` rounds the buffer's start up to
1024 bytes, the 128-byte swizzle's period), in the simulator the byte offset into ``smem`` (the
base is 0). Every primitive takes ``smem`` first so that its twin can reach the bytes.

- **Tiles** are 16-bit or 8-bit (e4m3), in boxes of 128-byte rows (64 or 128 columns) written by TMA with
  ``CU_TENSOR_MAP_SWIZZLE_128B``: byte ``a`` of a row-major box lands at ``a ^ (((a >> 7) & 7) << 4)``
  (the 16-byte chunk index XOR the row modulo 8; :func:`swizzle`), which is also the layout
  ``wgmma`` reads with the 128-byte swizzle mode. fp8's V^T may also come in boxes of 64- or
  32-byte rows (SWIZZLE_64B / 32B, :func:`swizzle`: the chunk index XOR fewer address bits), so
  that a K/V tile of 192 or 224 keys is whole boxes.
- **mbarrier** (``init``, ``arrive``, ``arrive.expect_tx``, ``try_wait.parity``): a phase completes
  when its pending arrivals reach 0 and its transaction bytes are all in; waiting on parity ``p``
  returns once the phase of that parity has completed (so a fresh barrier's "previous" phase,
  parity 1, counts as complete: the producer's first wait on an empty slot passes).
- **TMA** (``cp.async.bulk.tensor.4d``): a box of ``rows x 64`` elements at (d0, n0, h, b) of a
  ``(B, H, N, D)`` tensor, described by a ``CUtensorMap`` in global memory
  (``numba_flash.fa3.tensor_map``); rows or columns past the tensor's end read as zeros; the
  bytes are counted on an mbarrier.
- **wgmma** (``wgmma.mma_async.sync.aligned.m64nNk16.f32.{f16,bf16}``, and ``m64nNk32.f32.e4m3.e4m3``
  for fp8: 32 K-values per product, both operands K-major, A registers of four 8-bit values): one warpgroup (128 threads,
  warp ``w`` owning rows ``16w..16w+15``) multiplies a 64x16 A by a 16xN B into float32
  accumulators, ``acc[4j + e]`` = (row ``g`` or ``g + 8``, column ``8j + 2t + e % 2``) as the
  ``mma.m16n8`` C fragment (``g = lane / 4``, ``t = lane % 4``). A comes from shared memory (SS:
  a matrix descriptor) or from registers (RS: four f16x2 words in the ``mma.m16n8k16`` A layout);
  B from shared memory, K-major (rows of B^T, as K is stored) or N-major (``tnsp_b``: rows of B, as
  V is stored). Descriptors (:func:`descriptor`): start address, leading byte offset (LBO: between
  64-column boxes of an N-major operand), stride byte offset (SBO: between 8-row groups: 8 swizzled rows, 1024 at 128 bytes),
  swizzle mode (:data:`SWIZZLE_MODES`; 1: 128 bytes). Issue is asynchronous: ``wgmma_fence`` before a batch whose
  registers ordinary code wrote, ``wgmma_commit`` closes a group, ``wgmma_wait(n)`` waits until
  at most ``n`` groups are in flight. In the simulator a product completes when issued.
- **TMA stores** (``cp.async.bulk.tensor.4d.global.shared::cta``): a swizzled box of shared memory written
  out at (d0, n0, h, b), nothing past the tensor's ends; ordinary shared stores before it need
  ``fence_proxy_async``, and the issuing thread waits (``bulk_wait_read``) until the box is read
  before the memory is reused or the block exits.
- **setmaxnreg** (``inc``/``dec``): a warpgroup's register budget (a no-op in the simulator).
- **Named barriers** (``bar.sync id, n`` waits, ``bar.arrive id, n`` does not): ``n`` threads of some
  warps meet (FA-3's ping-pong hands the tensor cores from one consumer warpgroup to the other).

The simulator twins keep their state (mbarrier phases, the warpgroups' register exchanges) in
Python objects keyed by the block's buffer, because a simulated block's threads are Python threads
of one process; a wait that never completes raises after :data:`SIM_TIMEOUT` seconds instead of
hanging, naming the barrier.
"""

from __future__ import annotations

import functools
import threading

import numpy as np

from numba_flash._cuda import cuda, float32  # first: chooses the world before numba.cuda loads

from numba import uint32, uint64  # noqa: E402,F401

from numba_flash._world import simulated
from numba_flash.kernels.jit import device_jit

TILE_ALIGN = 1024  # the 128-byte swizzle repeats every 8 rows of 128 bytes
SBO_128B = 1024  # bytes between 8-row groups of a 128-byte-swizzled operand
BOX_COLS = 64  # 16-bit columns of a 128-byte swizzled box (TMA's box and wgmma's atom)
BOX_BYTES = 128  # a swizzled box's row
K_BYTES = 32  # the K extent of one wgmma in bytes: 16 16-bit values, 32 e4m3 ones
# a swizzled row's bytes -> the mode in bits 62-63 of a wgmma matrix descriptor (TMA's
# CU_TENSOR_MAP_SWIZZLE_{32,64,128}B write the same layouts)
SWIZZLE_MODES = {128: 1, 64: 2, 32: 3}


def element_bytes(kind: str) -> int:
    """Bytes of one operand element: 2 for "f16" / "bf16", 1 for "e4m3"."""
    return 1 if kind == "e4m3" else 2


_ALIGN_MASK = 0xFFFFFFFF & ~(TILE_ALIGN - 1)
SIM_TIMEOUT = 300.0  # seconds a simulated wait may take before it is called a hang


def smem_bytes(tile_bytes: int) -> int:
    """Dynamic shared memory for ``tile_bytes`` of 1024-aligned tiles (the start rounded up)."""
    return tile_bytes + (0 if simulated() else TILE_ALIGN)


def swizzle(address, row_bytes=BOX_BYTES):
    """Where byte ``address`` of a row-major box of ``row_bytes``-byte rows (128, 64 or 32) lives
    under TMA's SWIZZLE_{row_bytes}B, the layout ``wgmma`` reads in the same mode: the 16-byte chunk
    index XOR the address's bits 7 and up, modulo the row's chunks (CUTLASS's ``Swizzle<3|2|1, 4, 3>``
    on byte addresses; a 64-byte swizzle pairs rows, the pattern repeats every 8 x ``row_bytes``)."""
    return address ^ (((address >> 7) & (row_bytes // 16 - 1)) << 4)


if simulated():
    # ----------------------------------------------------------------------------------------
    # Simulator twins
    # ----------------------------------------------------------------------------------------
    from numba_flash.kernels.mma import HOST_HALF_BITS

    _LOCK = threading.Condition(threading.Lock())
    _BARRIERS: dict = {}  # (buffer, address) -> [count, pending, tx, phase]
    _GROUPS: dict = {}  # (buffer, group) -> (threading.Barrier, exchange dict)

    def _buffer_key(smem):
        return smem.__array_interface__["data"][0]

    def _operand_values(bits, kind):
        if kind == "e4m3":
            from numba_flash.kernels.e4m3 import values_of

            return values_of(bits)
        bits = np.asarray(bits, np.uint16)
        if kind == "f16":
            return bits.view(np.float16).astype(np.float64)
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)

    def _group(smem, group, parties):
        key = (_buffer_key(smem), group, parties)
        with _LOCK:
            hit = _GROUPS.get(key)
            if hit is None:
                hit = _GROUPS[key] = (threading.Barrier(parties, timeout=SIM_TIMEOUT), {})
        return hit

    def _exchange(smem, group, parties, slot, value):
        """Every one of ``parties`` threads of ``group`` posts ``value`` at ``slot``; returns all posts
        (a register exchange: what the hardware's warpgroup-wide operations see)."""
        barrier, posts = _group(smem, group, parties)
        posts[slot] = value
        barrier.wait()
        seen = dict(posts)
        barrier.wait()  # everyone has read before the next exchange overwrites
        return seen

    def _warpgroup_lane():
        tid = cuda.threadIdx.x
        return tid // 128, tid % 128

    @device_jit
    def tile_base(smem):
        """The address of the first 1024-aligned byte of ``smem`` (0 in the simulator)."""
        return 0

    @device_jit
    def mbarrier_init(smem, bar, count):
        """An mbarrier at ``bar`` expecting ``count`` arrivals per phase."""
        with _LOCK:
            _BARRIERS[(_buffer_key(smem), int(bar))] = [int(count), int(count), 0, 0]

    @device_jit
    def fence_barrier_init():
        """Make the mbarrier inits visible to the async proxy (TMA)."""
        return

    def _advance(state):
        if state[1] == 0 and state[2] == 0:
            state[1] = state[0]
            state[3] ^= 1
            _LOCK.notify_all()

    def _state(smem, bar):
        state = _BARRIERS.get((_buffer_key(smem), int(bar)))
        if state is None:
            raise RuntimeError(f"mbarrier at {int(bar)} used before mbarrier_init")
        return state

    @device_jit
    def mbarrier_arrive(smem, bar):
        """One arrival on the current phase."""
        with _LOCK:
            state = _state(smem, bar)
            state[1] -= 1
            _advance(state)

    @device_jit
    def mbarrier_arrive_expect_tx(smem, bar, nbytes):
        """``nbytes`` more transaction bytes expected on the current phase, and one arrival."""
        with _LOCK:
            state = _state(smem, bar)
            state[2] += int(nbytes)
            state[1] -= 1
            _advance(state)

    def _complete_tx(smem, bar, nbytes):
        with _LOCK:
            state = _state(smem, bar)
            state[2] -= int(nbytes)
            _advance(state)

    @device_jit
    def mbarrier_wait(smem, bar, parity):
        """Wait until the phase of parity ``parity`` has completed."""
        with _LOCK:
            state = _state(smem, bar)
            if not _LOCK.wait_for(lambda: state[3] != (int(parity) & 1), timeout=SIM_TIMEOUT):
                raise RuntimeError(f"mbarrier at {int(bar)}: phase {int(parity)} never completed (a hang on the GPU)")

    @functools.lru_cache(maxsize=None)
    def tma_box_loader(rows: int, elem_bytes: int = 2, row_bytes: int = BOX_BYTES):
        """``load(smem, dst, tmap, src, d0, n0, h, b, bar)``: the ``rows x (row_bytes / elem_bytes)``
        box of ``src`` (B, H, N, D) at (row ``n0``, column ``d0``) of head (b, h), swizzled into ``dst``
        (rows of ``row_bytes``: 128, 64 or 32, the map's swizzle), zeros past the tensor's ends, its
        bytes counted on mbarrier ``bar``."""
        cols, unit = row_bytes // elem_bytes, (np.uint8 if elem_bytes == 1 else np.uint16)

        @device_jit
        def load(smem, dst, tmap, src, d0, n0, h, b, bar):
            n_rows, n_cols = src.shape[2], src.shape[3]
            box = np.zeros((rows, cols), unit)
            r1, c1 = min(rows, max(0, n_rows - n0)), min(cols, max(0, n_cols - d0))
            if r1 > 0 and c1 > 0:
                box[:r1, :c1] = src[b, h, n0:n0 + r1, d0:d0 + c1]
            rr, cc = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
            smem.view(unit)[swizzle(int(dst) + rr * row_bytes + cc * elem_bytes, row_bytes) // elem_bytes] = box
            _complete_tx(smem, bar, rows * row_bytes)

        return load

    @device_jit
    def st_shared_b32(smem, address, bits):
        """The 32-bit word ``bits`` at shared ``address`` (a multiple of 4)."""
        smem.view(np.uint32)[int(address) // 4] = int(bits) & 0xFFFFFFFF

    @device_jit
    def fence_proxy_async():
        """Make this thread's ordinary shared-memory writes visible to TMA (one memory here)."""
        return

    @functools.lru_cache(maxsize=None)
    def tma_box_storer(rows: int, elem_bytes: int = 2):
        """``store(smem, src, tmap, dst, d0, n0, h, b)``: the swizzled ``rows x (128 / elem_bytes)`` box at
        ``src`` written to ``dst`` (B, H, N, D) at (row ``n0``, column ``d0``) of head (b, h); what
        falls past the tensor's ends is not written (done at issue here)."""
        cols, unit = BOX_BYTES // elem_bytes, (np.uint8 if elem_bytes == 1 else np.uint16)

        @device_jit
        def store(smem, src, tmap, dst, d0, n0, h, b):
            r1, c1 = min(rows, max(0, dst.shape[2] - n0)), min(cols, max(0, dst.shape[3] - d0))
            if r1 > 0 and c1 > 0:
                rr, cc = np.meshgrid(np.arange(r1), np.arange(c1), indexing="ij")
                words = smem.view(unit)[swizzle(int(src) + rr * BOX_BYTES + cc * elem_bytes) // elem_bytes]
                dst[b, h, n0:n0 + r1, d0:d0 + c1] = words

        return store

    @device_jit
    def bulk_commit():
        """Close the group of TMA stores issued since the last commit."""
        return

    @device_jit
    def bulk_wait_read():
        """Wait until every committed TMA store has read its shared memory (done at issue here)."""
        return

    @device_jit
    def wgmma_fence():
        """Order ordinary register writes before the next wgmma (nothing to order here)."""
        return

    @device_jit
    def wgmma_commit():
        """Close the group of wgmma issued since the last commit."""
        return

    @device_jit
    def wgmma_wait_after(smem, address, value):
        """``wgmma.wait_group 0`` after ``value`` is stored at shared ``address`` (the store kept: it
        is what orders the wait on the GPU)."""
        smem.view(np.float32)[int(address) // 4] = value

    @device_jit
    def wgmma_wait(n):
        """Wait until at most ``n`` committed groups are in flight (simulated ones complete at issue)."""
        return

    @device_jit
    def setmaxnreg_inc(n):
        """Raise the warpgroup's registers per thread to ``n`` (the simulator has no budget)."""
        return

    @functools.lru_cache(maxsize=None)
    def register_fence(n: int):
        """``fence(acc)``: pin ``acc[0:n]`` (nothing to pin here)."""

        @device_jit
        def fence(acc):
            return

        return fence

    @device_jit
    def setmaxnreg_dec(n):
        """Lower the warpgroup's registers per thread to ``n``."""
        return

    _NAMED: dict = {}  # (buffer, id) -> [arrived, generation]

    def _named(smem, bar_id, threads, wait):
        key = (_buffer_key(smem), int(bar_id))
        with _LOCK:
            state = _NAMED.setdefault(key, [0, 0])
            generation = state[1]
            state[0] += 1
            if state[0] == int(threads):
                state[0] = 0
                state[1] += 1
                _LOCK.notify_all()
            elif wait and not _LOCK.wait_for(lambda: state[1] != generation, timeout=SIM_TIMEOUT):
                raise RuntimeError(f"named barrier {int(bar_id)} never completed (a hang on the GPU)")

    @device_jit
    def named_barrier_sync(smem, bar_id, threads):
        """``bar.sync bar_id, threads``: arrive, and wait until ``threads`` threads have arrived."""
        _named(smem, bar_id, threads, True)

    @device_jit
    def named_barrier_arrive(smem, bar_id, threads):
        """``bar.arrive bar_id, threads``: arrive without waiting (the producer side of a hand-over)."""
        _named(smem, bar_id, threads, False)

    @device_jit
    def descriptor(address, lbo, sbo, mode):
        """A wgmma matrix descriptor of a swizzled operand at ``address`` (``mode``: :data:`SWIZZLE_MODES`)."""
        return ((int(address) & 0x3FFFF) >> 4) | (((int(lbo) >> 4) & 0x3FFF) << 16) | \
            (((int(sbo) >> 4) & 0x3FFF) << 32) | (int(mode) << 62)

    @device_jit
    def descriptor_at(desc, offset):
        """``desc`` moved ``offset`` bytes (a multiple of 16) along shared memory."""
        return int(desc) + (int(offset) >> 4)

    def _decode(desc):
        """(start address, LBO, SBO, the swizzled rows' bytes) of a descriptor."""
        desc = int(desc)
        row_bytes = {mode: row for row, mode in SWIZZLE_MODES.items()}[(desc >> 62) & 3]
        return (desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4, row_bytes

    def _k_major(smem, desc, rows, kind):
        """The rows x K operand (rows of K = 32 bytes of K-values: 16 or 32) a K-major descriptor
        names: rows of the swizzle's width, 8-row groups SBO apart."""
        start, _, sbo, row_bytes = _decode(desc)
        size = element_bytes(kind)
        unit = np.uint8 if size == 1 else np.uint16
        r, k = np.meshgrid(np.arange(rows), np.arange(K_BYTES // size), indexing="ij")
        addr = start + (r // 8) * sbo + (r % 8) * row_bytes + k * size
        return _operand_values(smem.view(unit)[swizzle(addr, row_bytes) // size], kind)

    def _n_major(smem, desc, n, kind):
        """The 16 x n operand (16 K-rows of n values, in 64-column boxes LBO apart) of an N-major
        descriptor (128-byte rows: the only N-major layout the kernels use)."""
        start, lbo, sbo, row_bytes = _decode(desc)
        if row_bytes != BOX_BYTES:
            raise ValueError(f"an N-major operand of {row_bytes}-byte swizzled rows (the twin reads 128)")
        k, c = np.meshgrid(np.arange(16), np.arange(n), indexing="ij")
        addr = start + (c // BOX_COLS) * lbo + (k // 8) * sbo + (k % 8) * 128 + (c % BOX_COLS) * 2
        return _operand_values(smem.view(np.uint16)[swizzle(addr) // 2], kind)

    def _accumulate(acc, a_rows, b, n, scale_d):
        """acc (this thread's fragment, any shape, read flat) = scale_d * acc + (A B) at the thread's entries."""
        acc = acc.reshape(-1)
        _, lane = _warpgroup_lane()
        w, g, t = lane // 32, (lane % 32) // 4, lane % 4
        for half, row in ((0, 16 * w + g), (1, 16 * w + g + 8)):
            prod = a_rows[row] @ b  # (n,)
            for j in range(n // 8):
                for e in range(2):
                    i = 4 * j + 2 * half + e
                    old = float(acc[i]) if int(scale_d) else 0.0
                    acc[i] = float32(old + float(prod[8 * j + 2 * t + e]))

    @functools.lru_cache(maxsize=None)
    def wgmma_ss(n: int, kind: str, tnsp_b: int = 0):
        """``mma(smem, acc, desc_a, desc_b, scale_d)``: acc = scale_d * acc + A B, A 64x16 and B
        16xn (K-major, or N-major with ``tnsp_b``) in shared memory."""

        @device_jit
        def mma(smem, acc, desc_a, desc_b, scale_d):
            a_rows = _k_major(smem, desc_a, 64, kind)
            b = _n_major(smem, desc_b, n, kind) if tnsp_b else _k_major(smem, desc_b, n, kind).T
            _accumulate(acc, a_rows, b, n, scale_d)

        return mma

    @functools.lru_cache(maxsize=None)
    def wgmma_rs(n: int, kind: str, tnsp_b: int = 1):
        """``mma(smem, acc, a0, a1, a2, a3, desc_b, scale_d)``: A from the warpgroup's registers."""

        @device_jit
        def mma(smem, acc, a0, a1, a2, a3, desc_b, scale_d):
            wg, lane = _warpgroup_lane()
            posts = _exchange(smem, ("wgmma", wg), 128, lane, (int(a0), int(a1), int(a2), int(a3)))
            per_word = 4 // element_bytes(kind)  # values in a register: 2 16-bit, 4 e4m3
            bits = np.zeros((64, 8 * per_word), np.uint16)
            for other, words in posts.items():  # mma.m16n8k16's A layout, or m16n8k32's for 8-bit
                w, g, t = other // 32, (other % 32) // 4, other % 4
                for i, word in enumerate(words):
                    r, c = g + 8 * (i % 2), per_word * t + 4 * per_word * (i // 2)
                    for e in range(per_word):
                        bits[16 * w + r, c + e] = (word >> (32 // per_word * e)) & (0xFFFF if per_word == 2 else 0xFF)
            a_rows = _operand_values(bits, kind)
            b = _n_major(smem, desc_b, n, kind) if tnsp_b else _k_major(smem, desc_b, n, kind).T
            _accumulate(acc, a_rows, b, n, scale_d)

        return mma

    @functools.lru_cache(maxsize=None)
    def pack_pair(kind: str):
        """``pack(lo, hi)``: two float32 -> one word of two 16-bit values (lo in the low half)."""
        to_bits = HOST_HALF_BITS[kind]  # (kernels.mma's: round to nearest even)

        @device_jit
        def pack(lo, hi):
            return uint32(to_bits(lo) | (to_bits(hi) << 16))

        return pack

    @device_jit
    def pack_e4m3(x0, x1, x2, x3):
        """Four float32 -> one word of four e4m3 values (``x0`` in the lowest byte; round to nearest
        even, saturated to +-448)."""
        from numba_flash.kernels.e4m3 import host_bits

        return uint32(host_bits(x0) | (host_bits(x1) << 8) | (host_bits(x2) << 16) | (host_bits(x3) << 24))

    @device_jit
    def byte_perm(a, b, selector):
        """``prmt.b32`` (default mode): byte ``i`` of the result is byte ``n & 7`` of the eight bytes
        of ``a`` (0-3) and ``b`` (4-7), ``n`` the selector's nibble ``i``; where ``n & 8``, that
        byte's sign bit copied into all eight bits."""
        both = int(a) | (int(b) << 32)
        out = 0
        for i in range(4):
            n = (int(selector) >> (4 * i)) & 0xF
            byte = (both >> (8 * (n & 7))) & 0xFF
            if n & 8:
                byte = 0xFF if byte & 0x80 else 0
            out |= byte << (8 * i)
        return uint32(out)

    @device_jit
    def max_nan(a, b):
        """max(a, b), NaN when either is NaN (``max.NaN.f32``: one instruction)."""
        if a != a or b != b:
            return float32(np.nan)
        return float32(max(float(a), float(b)))

    @functools.lru_cache(maxsize=None)
    def quad_reduce(combine):
        """``reduce(smem, x)``: ``combine`` over the four lanes of the thread's quad (the threads
        holding one accumulator row) -- two shuffles on the GPU."""

        @device_jit
        def reduce(smem, x):
            wg, lane = _warpgroup_lane()
            posts = _exchange(smem, ("quad", wg), 128, lane, x)
            first = lane - lane % 4
            out = posts[first]
            for i in range(1, 4):
                out = combine(out, posts[first + i])
            return out

        return reduce

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    _I16, _I32, _I64, _F32 = ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()

    def _asm(builder, ret, argtys, text, constraints, args, convergent=False, side_effect=True):
        fn = ir.InlineAsm(ir.FunctionType(ret, argtys), text, constraints, side_effect=side_effect)
        # .sync.aligned instructions are convergent: LLVM must not sink them into divergent code
        return builder.call(fn, args, attrs=("convergent",) if convergent else ())

    def _as(context, builder, val, ty, to):
        return context.cast(builder, val, ty, to)

    def _statement(text, convergent=False):
        @intrinsic
        def statement(typingctx):
            def codegen(context, builder, sig, args):
                _asm(builder, ir.VoidType(), [], text, "~{memory}", [], convergent)
                return context.get_dummy_value()

            return types.void(), codegen

        return statement

    def _literal_statement(fmt):
        """``f(N)`` emitting ``fmt.format(N)``, ``N`` an integer literal (a compile-time constant)."""

        @intrinsic
        def statement(typingctx, n):
            if not isinstance(n, types.IntegerLiteral):
                return None
            text = fmt.format(n.literal_value)

            def codegen(context, builder, sig, args):
                _asm(builder, ir.VoidType(), [], text, "~{memory}", [], True)
                return context.get_dummy_value()

            return types.void(n), codegen

        return statement

    def _u32_args(context, builder, arg_types, args):
        return [_as(context, builder, a, t, types.uint32) for a, t in zip(args, arg_types)]

    @intrinsic
    def _base(typingctx, smem):
        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, value=args[0])
            p = builder.bitcast(ary.data, ir.IntType(8).as_pointer())
            return builder.ptrtoint(builder.addrspacecast(p, ir.IntType(8).as_pointer(3)), _I32)

        return types.uint32(smem), codegen

    @intrinsic
    def _global_address(typingctx, arr):
        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, value=args[0])
            return builder.ptrtoint(ary.data, _I64)

        return types.uint64(arr), codegen

    @device_jit
    def tile_base(smem):
        """The shared-window address of the first 1024-aligned byte of ``smem``."""
        return (_base(smem) + uint32(TILE_ALIGN - 1)) & uint32(_ALIGN_MASK)

    def _barrier_op(text):
        @intrinsic
        def op(typingctx, smem, bar, value):
            def codegen(context, builder, sig, args):
                _asm(builder, ir.VoidType(), [_I32, _I32], text, "r,r,~{memory}",
                     _u32_args(context, builder, sig.args[1:], args[1:]))
                return context.get_dummy_value()

            return types.void(smem, bar, value), codegen

        return op

    mbarrier_init_ = _barrier_op("mbarrier.init.shared::cta.b64 [$0], $1;")
    _arrive_expect_tx = _barrier_op("mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;")
    # the labels live in a { } scope, so the loop can be inlined many times (CUTLASS's pattern)
    _wait_parity = _barrier_op(
        "{\n.reg .pred P1;\nLAB_WAIT:\nmbarrier.try_wait.parity.shared::cta.b64 P1, [$0], $1;\n"
        "@P1 bra DONE;\nbra LAB_WAIT;\nDONE:\n}")

    @intrinsic
    def _arrive(typingctx, smem, bar):
        def codegen(context, builder, sig, args):
            _asm(builder, ir.VoidType(), [_I32], "mbarrier.arrive.shared::cta.b64 _, [$0];", "r,~{memory}",
                 [_as(context, builder, args[1], sig.args[1], types.uint32)])
            return context.get_dummy_value()

        return types.void(smem, bar), codegen

    fence_barrier_init = _statement("fence.mbarrier_init.release.cluster;")

    @device_jit
    def mbarrier_init(smem, bar, count):
        """An mbarrier at ``bar`` expecting ``count`` arrivals per phase."""
        mbarrier_init_(smem, bar, count)

    @device_jit
    def mbarrier_arrive(smem, bar):
        """One arrival on the current phase."""
        _arrive(smem, bar)

    @device_jit
    def mbarrier_arrive_expect_tx(smem, bar, nbytes):
        """``nbytes`` more transaction bytes expected on the current phase, and one arrival."""
        _arrive_expect_tx(smem, bar, nbytes)

    @device_jit
    def mbarrier_wait(smem, bar, parity):
        """Wait until the phase of parity ``parity`` has completed."""
        _wait_parity(smem, bar, parity)

    @intrinsic
    def _tma_load_4d(typingctx, dst, tmap, d0, n0, h, b, bar):
        def codegen(context, builder, sig, args):
            vals = [_as(context, builder, args[0], sig.args[0], types.uint32),
                    _as(context, builder, args[1], sig.args[1], types.uint64)]
            vals += [_as(context, builder, a, t, types.uint32) for a, t in zip(args[2:], sig.args[2:])]
            _asm(builder, ir.VoidType(), [_I32, _I64, _I32, _I32, _I32, _I32, _I32],
                 "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [$0], [$1, {$2, $3, $4, $5}], [$6];", "r,l,r,r,r,r,r,~{memory}", vals)
            return context.get_dummy_value()

        return types.void(dst, tmap, d0, n0, h, b, bar), codegen

    @functools.lru_cache(maxsize=None)
    def tma_box_loader(rows: int, elem_bytes: int = 2, row_bytes: int = BOX_BYTES):
        """``load(smem, dst, tmap, src, d0, n0, h, b, bar)``: the ``rows x (row_bytes / elem_bytes)`` box at
        (row ``n0``, column ``d0``) of head (b, h) of the tensor ``tmap`` (a ``CUtensorMap`` in global
        memory, made for this box and its swizzle) describes, swizzled into ``dst``; zeros past its
        ends; bytes counted on ``bar``."""

        @device_jit
        def load(smem, dst, tmap, src, d0, n0, h, b, bar):
            _tma_load_4d(dst, _global_address(tmap), d0, n0, h, b, bar)

        return load

    @intrinsic
    def _tma_store_4d(typingctx, src, tmap, d0, n0, h, b):
        def codegen(context, builder, sig, args):
            vals = [_as(context, builder, args[0], sig.args[0], types.uint32),
                    _as(context, builder, args[1], sig.args[1], types.uint64)]
            vals += [_as(context, builder, a, t, types.uint32) for a, t in zip(args[2:], sig.args[2:])]
            _asm(builder, ir.VoidType(), [_I32, _I64, _I32, _I32, _I32, _I32],
                 "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [$1, {$2, $3, $4, $5}], [$0];",
                 "r,l,r,r,r,r,~{memory}", vals)
            return context.get_dummy_value()

        return types.void(src, tmap, d0, n0, h, b), codegen

    @functools.lru_cache(maxsize=None)
    def tma_box_storer(rows: int, elem_bytes: int = 2):
        """``store(smem, src, tmap, dst, d0, n0, h, b)``: the swizzled ``rows x (128 / elem_bytes)`` box at
        ``src`` written at (row ``n0``, column ``d0``) of head (b, h) of the tensor ``tmap`` describes
        (``dst``, that tensor, is the simulator's); nothing past its ends is written."""

        @device_jit
        def store(smem, src, tmap, dst, d0, n0, h, b):
            _tma_store_4d(src, _global_address(tmap), d0, n0, h, b)

        return store

    _st_shared_b32 = _barrier_op("st.shared.b32 [$0], $1;")

    @device_jit
    def st_shared_b32(smem, address, bits):
        """The 32-bit word ``bits`` at shared ``address`` (a multiple of 4)."""
        _st_shared_b32(smem, address, bits)

    fence_proxy_async = _statement("fence.proxy.async.shared::cta;")
    bulk_commit = _statement("cp.async.bulk.commit_group;")
    bulk_wait_read = _statement("cp.async.bulk.wait_group.read 0;")

    @intrinsic
    def _wait_after_store(typingctx, address, value):
        def codegen(context, builder, sig, args):
            a = _as(context, builder, args[0], sig.args[0], types.uint32)
            v = _as(context, builder, args[1], sig.args[1], types.float32)
            _asm(builder, ir.VoidType(), [_I32, _F32], "st.shared.f32 [$0], $1;\nwgmma.wait_group.sync.aligned 0;",
                 "r,f,~{memory}", [a, v], convergent=True)
            return context.get_dummy_value()

        return types.void(address, value), codegen

    @device_jit
    def wgmma_wait_after(smem, address, value):
        """``wgmma.wait_group 0`` after ``value`` is stored at shared ``address``: a wait ptxas cannot
        schedule before the instructions that compute ``value`` (it hoists a bare wait to the top of
        its block, ahead of independent work that Algorithm 2 wants under the products)."""
        _wait_after_store(address, value)

    wgmma_fence = _statement("wgmma.fence.sync.aligned;", convergent=True)
    wgmma_commit = _statement("wgmma.commit_group.sync.aligned;", convergent=True)
    wgmma_wait = _literal_statement("wgmma.wait_group.sync.aligned {};")
    setmaxnreg_inc = _literal_statement("setmaxnreg.inc.sync.aligned.u32 {};")
    setmaxnreg_dec = _literal_statement("setmaxnreg.dec.sync.aligned.u32 {};")

    def _bar(text):
        @intrinsic
        def bar(typingctx, bar_id, threads):
            def codegen(context, builder, sig, args):
                _asm(builder, ir.VoidType(), [_I32, _I32], text, "r,r,~{memory}",
                     _u32_args(context, builder, sig.args, args), convergent=True)
                return context.get_dummy_value()

            return types.void(bar_id, threads), codegen

        return bar

    _bar_sync = _bar("bar.sync $0, $1;")
    _bar_arrive = _bar("bar.arrive $0, $1;")

    @device_jit
    def named_barrier_sync(smem, bar_id, threads):
        """``bar.sync bar_id, threads``: arrive, and wait until ``threads`` threads have arrived."""
        _bar_sync(bar_id, threads)

    @device_jit
    def named_barrier_arrive(smem, bar_id, threads):
        """``bar.arrive bar_id, threads``: arrive without waiting (the producer side of a hand-over)."""
        _bar_arrive(bar_id, threads)

    @device_jit
    def descriptor(address, lbo, sbo, mode):
        """A wgmma matrix descriptor of a swizzled operand at ``address``: bits 0-13 address >> 4,
        16-29 LBO >> 4, 32-45 SBO >> 4, 62-63 the swizzle ``mode`` (:data:`SWIZZLE_MODES`: 1 for
        128-byte rows, 2 for 64, 3 for 32)."""
        d = uint64((address & 0x3FFFF) >> 4)
        d |= uint64((lbo >> 4) & 0x3FFF) << uint64(16)
        d |= uint64((sbo >> 4) & 0x3FFF) << uint64(32)
        return d | (uint64(mode) << uint64(62))

    @device_jit
    def descriptor_at(desc, offset):
        """``desc`` moved ``offset`` bytes (a multiple of 16, a constant once unrolled) along shared
        memory: the address field (bits 0-13) plus ``offset >> 4``, which cannot carry out of it (shared
        addresses are below 2^18). One 32-bit add on the low word where :func:`descriptor` of the moved
        address costs a mask, a shift and an or on 64 bits (CUTLASS's descriptor iterator does the same)."""
        lo = uint32(desc & uint64(0xFFFFFFFF)) + uint32(offset >> 4)
        return _words_to_b64(lo, uint32(desc >> uint64(32)))

    @intrinsic
    def _words_to_b64(typingctx, lo, hi):
        """``mov.b64 {lo, hi}``: a register pair, opaque to LLVM (which would otherwise fold the
        halves back into a 64-bit add and or: three uniform instructions a descriptor, not one)."""

        def codegen(context, builder, sig, args):
            x, y = (_as(context, builder, v, t, types.uint32) for v, t in zip(args, sig.args))
            return _asm(builder, _I64, [_I32, _I32], "mov.b64 $0, {$1, $2};", "=l,r,r", [x, y], side_effect=False)

        return types.uint64(lo, hi), codegen

    @functools.lru_cache(maxsize=None)
    def register_fence(n: int):
        """``fence(acc)``: an empty volatile asm that reads and writes ``acc[0:n]`` (CUTLASS's
        ``warpgroup_fence_operand``), so the compiler moves no use of a wgmma's registers across the
        ``wgmma_wait`` / ``wgmma_fence`` it is placed beside."""

        @intrinsic
        def fence(typingctx, acc):
            def codegen(context, builder, sig, args):
                ptrs = _accumulator_ptrs(context, builder, sig.args[0], args[0], n)
                dtype = ptrs[0].type.pointee
                code = "f" if isinstance(dtype, ir.FloatType) else "r"
                old = [builder.load(p) for p in ptrs]
                r = _asm(builder, dtype if n == 1 else ir.LiteralStructType([dtype] * n), [dtype] * n, "",
                         ",".join([f"={code}"] * n + [str(i) for i in range(n)]), old)
                for i, p in enumerate(ptrs):
                    builder.store(r if n == 1 else builder.extract_value(r, i), p)
                return context.get_dummy_value()

            return types.void(acc), codegen

        return fence

    def _accumulator_ptrs(context, builder, aryty, ary, n):
        data = context.make_array(aryty)(context, builder, value=ary).data
        return [builder.gep(data, [ir.Constant(_I64, i)], inbounds=True) for i in range(n)]

    _PTX_KIND = {"f16": "f16", "bf16": "bf16", "e4m3": "e4m3"}

    @functools.lru_cache(maxsize=None)
    def _wgmma(n: int, kind: str, tnsp_b: int, a_in_registers: bool):
        count = n // 2  # float32 accumulators per thread
        ab = _PTX_KIND[kind]
        k = K_BYTES // element_bytes(kind)
        if kind == "e4m3":  # 8-bit operands are K-major only: no transpose immediates
            if tnsp_b:
                raise ValueError("wgmma on e4m3 takes K-major B only (tnsp_b=0)")
            trans_rs, trans_ss = "", ""
        else:
            trans_rs, trans_ss = f", {tnsp_b}", f", 0, {tnsp_b}"
        outs = "{" + ",".join(f"${i}" for i in range(count)) + "}"
        if a_in_registers:
            operands = [_I32] * 4 + [_I64, _I32]
            a = "{" + ",".join(f"${count + i}" for i in range(4)) + "}"
            text = (f"{{\n.reg .pred p;\nsetp.ne.b32 p, ${count + 5}, 0;\n"
                    f"wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{ab}.{ab} {outs}, {a}, ${count + 4}, p, 1, 1{trans_rs};\n}}")
            constraints = ",".join(["=f"] * count + ["r"] * 4 + ["l", "r"] + [str(i) for i in range(count)])
        else:
            operands = [_I64, _I64, _I32]
            text = (f"{{\n.reg .pred p;\nsetp.ne.b32 p, ${count + 2}, 0;\n"
                    f"wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{ab}.{ab} {outs}, ${count}, ${count + 1}, p, 1, 1{trans_ss};\n}}")
            constraints = ",".join(["=f"] * count + ["l", "l", "r"] + [str(i) for i in range(count)])
        widths = [types.uint32] * 4 + [types.uint64, types.uint32] if a_in_registers else [types.uint64, types.uint64, types.uint32]

        def codegen(context, builder, sig, args):
            ptrs = _accumulator_ptrs(context, builder, sig.args[0], args[0], count)
            old = [builder.load(p) for p in ptrs]
            ops = [_as(context, builder, a, t, w) for a, t, w in zip(args[1:], sig.args[1:], widths)]
            r = _asm(builder, ir.LiteralStructType([_F32] * count), operands + [_F32] * count, text, constraints,
                     ops + old, convergent=True)
            for i, p in enumerate(ptrs):
                builder.store(builder.extract_value(r, i), p)
            return context.get_dummy_value()

        if a_in_registers:
            @intrinsic
            def mma(typingctx, acc, a0, a1, a2, a3, desc_b, scale_d):
                return types.void(acc, a0, a1, a2, a3, desc_b, scale_d), codegen
        else:
            @intrinsic
            def mma(typingctx, acc, desc_a, desc_b, scale_d):
                return types.void(acc, desc_a, desc_b, scale_d), codegen
        return mma

    @functools.lru_cache(maxsize=None)
    def wgmma_ss(n: int, kind: str, tnsp_b: int = 0):
        """``mma(smem, acc, desc_a, desc_b, scale_d)``: acc = scale_d * acc + A B, A 64x16 and B
        16xn (K-major, or N-major with ``tnsp_b``) in shared memory."""
        issue = _wgmma(n, kind, tnsp_b, False)

        @device_jit
        def mma(smem, acc, desc_a, desc_b, scale_d):
            issue(acc, desc_a, desc_b, scale_d)

        return mma

    @functools.lru_cache(maxsize=None)
    def wgmma_rs(n: int, kind: str, tnsp_b: int = 1):
        """``mma(smem, acc, a0, a1, a2, a3, desc_b, scale_d)``: A from the warpgroup's registers."""
        issue = _wgmma(n, kind, tnsp_b, True)

        @device_jit
        def mma(smem, acc, a0, a1, a2, a3, desc_b, scale_d):
            issue(acc, a0, a1, a2, a3, desc_b, scale_d)

        return mma

    def _pack(mnemonic):
        @intrinsic
        def pack(typingctx, lo, hi):
            def codegen(context, builder, sig, args):
                lo_v, hi_v = (_as(context, builder, a, t, types.float32) for a, t in zip(args, sig.args))
                return _asm(builder, _I32, [_F32, _F32], f"cvt.rn.{mnemonic}x2.f32 $0, $2, $1;", "=r,f,f",
                            [lo_v, hi_v], side_effect=False)

            return types.uint32(lo, hi), codegen

        return pack

    _PACKS = {"f16": _pack("f16"), "bf16": _pack("bf16")}

    @intrinsic
    def _pack_e4m3(typingctx, x0, x1, x2, x3):
        def codegen(context, builder, sig, args):
            vals = [_as(context, builder, a, t, types.float32) for a, t in zip(args, sig.args)]
            text = ("{\n.reg .b16 lo, hi;\ncvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
                    "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\nmov.b32 $0, {lo, hi};\n}")
            return _asm(builder, _I32, [_F32] * 4, text, "=r,f,f,f,f", vals, side_effect=False)

        return types.uint32(x0, x1, x2, x3), codegen

    @device_jit
    def pack_e4m3(x0, x1, x2, x3):
        """Four float32 -> one word of four e4m3 values (``x0`` in the lowest byte; round to nearest
        even, saturated to +-448): two ``cvt.rn.satfinite.e4m3x2.f32``."""
        return _pack_e4m3(x0, x1, x2, x3)

    @intrinsic
    def _prmt(typingctx, a, b, selector):
        def codegen(context, builder, sig, args):
            x, y, z = (_as(context, builder, v, t, types.uint32) for v, t in zip(args, sig.args))
            return _asm(builder, _I32, [_I32, _I32, _I32], "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [x, y, z],
                        side_effect=False)

        return types.uint32(a, b, selector), codegen

    @device_jit
    def byte_perm(a, b, selector):
        """``prmt.b32`` (one PRMT, default mode): byte ``i`` of the result is byte ``n & 7`` of the
        eight bytes of ``a`` (0-3) and ``b`` (4-7), ``n`` the selector's nibble ``i``; where ``n & 8``,
        that byte's sign bit copied into all eight bits."""
        return _prmt(a, b, selector)

    @intrinsic
    def _max_nan(typingctx, a, b):
        def codegen(context, builder, sig, args):
            x, y = (_as(context, builder, v, t, types.float32) for v, t in zip(args, sig.args))
            return _asm(builder, _F32, [_F32, _F32], "max.NaN.f32 $0, $1, $2;", "=f,f,f", [x, y], side_effect=False)

        return types.float32(a, b), codegen

    @device_jit
    def max_nan(a, b):
        """max(a, b), NaN when either is NaN (``max.NaN.f32``: one FMNMX.NAN, where a compare-and-select
        that keeps NaN takes four instructions)."""
        return _max_nan(a, b)

    @functools.lru_cache(maxsize=None)
    def pack_pair(kind: str):
        """``pack(lo, hi)``: two float32 -> one word of two 16-bit values (lo in the low half)."""
        cvt = _PACKS[kind]

        @device_jit
        def pack(lo, hi):
            return cvt(lo, hi)

        return pack

    @functools.lru_cache(maxsize=None)
    def quad_reduce(combine):
        """``reduce(smem, x)``: ``combine`` over the four lanes of the thread's quad (the threads
        holding one accumulator row): two shuffles."""

        @device_jit
        def reduce(smem, x):
            x = combine(x, cuda.shfl_xor_sync(0xFFFFFFFF, x, 1))
            return combine(x, cuda.shfl_xor_sync(0xFFFFFFFF, x, 2))

        return reduce
