"""V^T for FlashAttention-3's float8 products, in one pass over V (``numba_flash.fp8``).

8-bit ``wgmma`` operands are K-major, so O += P V needs V with its keys contiguous: for each head
dim row, the keys in the order P's accumulator registers hold them (``fp8.value_order``: within
each 32 keys, position ``4t + i`` holds key ``2t + (i & 1) + 8 (i >> 1)``, and 16 more for the
second half).

That order makes the transpose a word-sized one. An output word (positions ``4t .. 4t + 3`` of a
16-key half) holds keys ``2t, 2t + 1, 2t + 8, 2t + 9`` at one head-dim byte, so a thread loads
those four keys' words at head-dim bytes ``4w .. 4w + 3`` (the 32 threads of a warp read 128
contiguous bytes of each key row), transposes the 4 x 4 bytes in registers (four byte pairs, then
four columns: eight ``prmt``, :func:`byte_columns`), and has the four output words of rows
``4w .. 4w + 3``. A block stages a tile of ``TILE_KEYS`` keys x ``TILE_BYTES`` head-dim bytes in
shared memory as words (rows padded by one word), then writes each head-dim row's 128 keys as 32
consecutive words (coalesced). Keys past Nk are written as zeros; a tile inside V (almost all of
them) loads without bounds tests.

History (H200, performance logs 22 and 27): bytes moved one at a time through shared memory (944
instructions a thread for 16 bytes), 0.40 TB/s, 168 us of every float8 call at B4 H16 N4096
D128; then word-sized with shifts and masks (824 instructions a thread for 32 bytes, mostly
signed index arithmetic and the transposes), 59 us; now 64 bytes a thread, ``prmt`` transposes,
unsigned tile arithmetic (numba still widens it to 64 bits, without the sign handling), addresses
as one base a thread plus row multiples: 3.1 TB/s. Its shared stores are 4-way bank-conflicted
(rows of 33 words, a warp's lanes 4 rows apart); at this traffic that costs nothing measurable.
"""

from __future__ import annotations

from numba_flash._cuda import cuda  # first: chooses the world before numba.cuda loads

from numba import uint32, uint64  # noqa: E402

from numba_flash.kernels import hopper  # noqa: E402
from numba_flash.kernels.jit import device_jit, kernel_jit  # noqa: E402

TILE_KEYS = 128  # keys of a block's tile: 32 output words a head-dim row
TILE_BYTES = 128  # head-dim bytes of a block's tile: 32 input words a key (D = 128: one tile across)
THREADS = 256
GROUPS = TILE_KEYS // 4  # output words along a row (each: 4 keys)
IN_WORDS = TILE_BYTES // 4  # input words along a key's row
LOAD_TASKS = GROUPS * IN_WORDS // THREADS  # (group, input word) pairs a thread transposes
STORE_WORDS = TILE_BYTES * GROUPS // THREADS  # output words a thread writes
SHARED_SHAPE = (TILE_BYTES, GROUPS + 1)  # [head-dim byte][output word], one word of padding a row


@device_jit
def group_key(g, i):
    """The key (of the tile) at position ``i`` of output word ``g``: ``fp8.value_order``."""
    half, t = g // 4, g % 4  # 16-key halves: 4 words each
    return 16 * half + 2 * t + (i & 1) + 8 * (i >> 1)


# the four keys of an output word, from its first: group_key(g, i) - group_key(g, 0), any g
KEY_STEPS = tuple(group_key.py_func(0, i) for i in range(4))  # (0, 1, 8, 9)


@device_jit
def byte_columns(a, b, c, d, columns, row, g):
    """The 4 x 4 byte transpose of rows ``a``, ``b``, ``c``, ``d``: column ``e`` (byte ``e`` of each,
    ``a``'s lowest) into ``columns[row + e, g]``. Pairs first (``a0 b0 a1 b1`` and ``a2 b2 a3
    b3``, the same of c and d), then each column is two bytes of two pairs: eight ``prmt``."""
    low_ab, low_cd = hopper.byte_perm(a, b, uint32(0x5140)), hopper.byte_perm(c, d, uint32(0x5140))
    high_ab, high_cd = hopper.byte_perm(a, b, uint32(0x7362)), hopper.byte_perm(c, d, uint32(0x7362))
    columns[row, g] = hopper.byte_perm(low_ab, low_cd, uint32(0x5410))
    columns[row + 1, g] = hopper.byte_perm(low_ab, low_cd, uint32(0x7632))
    columns[row + 2, g] = hopper.byte_perm(high_ab, high_cd, uint32(0x5410))
    columns[row + 3, g] = hopper.byte_perm(high_ab, high_cd, uint32(0x7632))


@kernel_jit()
def transpose_values(v_words, vt_words, n_k, row_words, d_rows, vt_row):
    """vt (B, H, D, Nk' / 4) from v (B, H, Nk, Dw), both C-contiguous uint32 and passed flat
    (1-D: one base address a thread, constant offsets, no 4-D index arithmetic a load): v's words
    hold four head-dim bytes, vt's four e4m3 keys in ``fp8.value_order``; ``row_words`` = Dw (4 Dw
    >= ``d_rows`` = D: head-dim bytes past D, padding, are not written), ``vt_row`` = Nk' / 4.
    Grid (ceil(Nk' / TILE_KEYS), ceil(Dw / IN_WORDS), B H), ``THREADS`` threads.

    Thread ``tid`` loads input word ``w = tid % 32`` of groups ``g = tid / 32 + 8 r`` (keys
    ``group_key(g, 0) + 32 r``...) and stores output word ``g = tid % 32`` of head-dim rows
    ``tid / 32 + 8 r``: each address is the thread's first plus a multiple of a row, and a tile
    wholly inside V and V^T (block-uniform) is read and written without bounds tests."""
    tile = cuda.shared.array(SHARED_SHAPE, dtype=uint32)
    bh = uint64(cuda.blockIdx.z)
    k0 = uint32(cuda.blockIdx.x) * uint32(TILE_KEYS)
    w0 = uint32(cuda.blockIdx.y) * uint32(IN_WORDS)
    keys, words, rows, out_row = uint32(n_k), uint32(row_words), uint32(d_rows), uint32(vt_row)
    tid = uint32(cuda.threadIdx.x)
    lane, warp = tid % uint32(32), tid // uint32(32)
    # loads: word `lane` of the four keys of group `warp + 8 r`: keys key0 + 32 r + KEY_STEPS
    key0 = uint32(group_key(warp, uint32(0)))
    at = (bh * uint64(keys) + uint64(k0 + key0)) * uint64(words) + uint64(w0 + lane)
    step = uint64(words)
    if k0 + uint32(TILE_KEYS) <= keys and w0 + uint32(IN_WORDS) <= words:  # inside V: no tests
        for r in range(LOAD_TASKS):
            first = at + uint64(32 * r) * step
            a = v_words[first]
            b = v_words[first + uint64(KEY_STEPS[1]) * step]
            c = v_words[first + uint64(KEY_STEPS[2]) * step]
            d = v_words[first + uint64(KEY_STEPS[3]) * step]
            byte_columns(a, b, c, d, tile, uint32(4) * lane, warp + uint32(8 * r))
    else:
        for r in range(LOAD_TASKS):
            first = at + uint64(32 * r) * step
            key = k0 + key0 + uint32(32 * r)
            a = uint32(0)
            b = uint32(0)
            c = uint32(0)
            d = uint32(0)
            if w0 + lane < words:
                if key < keys:
                    a = v_words[first]
                if key + uint32(KEY_STEPS[1]) < keys:
                    b = v_words[first + uint64(KEY_STEPS[1]) * step]
                if key + uint32(KEY_STEPS[2]) < keys:
                    c = v_words[first + uint64(KEY_STEPS[2]) * step]
                if key + uint32(KEY_STEPS[3]) < keys:
                    d = v_words[first + uint64(KEY_STEPS[3]) * step]
            byte_columns(a, b, c, d, tile, uint32(4) * lane, warp + uint32(8 * r))
    cuda.syncthreads()
    # stores: word `lane` of head-dim rows `warp + 8 r` (each row's 32 words: 128 contiguous bytes)
    row0 = uint32(4) * w0 + warp
    to = (bh * uint64(rows) + uint64(row0)) * uint64(out_row) + uint64(k0 // uint32(4) + lane)
    out_step = uint64(8) * uint64(out_row)
    if uint32(4) * w0 + uint32(TILE_BYTES) <= rows and k0 // uint32(4) + uint32(GROUPS) <= out_row:
        for r in range(STORE_WORDS):
            vt_words[to + uint64(r) * out_step] = tile[warp + uint32(8 * r), lane]
    else:
        for r in range(STORE_WORDS):
            if row0 + uint32(8 * r) < rows and k0 // uint32(4) + lane < out_row:
                vt_words[to + uint64(r) * out_step] = tile[warp + uint32(8 * r), lane]
