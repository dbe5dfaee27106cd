"""V^T for FlashAttention-3's float8 products, in one pass over V (``numba_flash.fp8``).

8-bit ``wgmma`` operands are K-major, so O += P V needs V with its keys contiguous: for each head
dim row, the keys in the order P's accumulator registers hold them (``fp8.value_order``: within
each 32 keys, position ``4t + i`` holds key ``2t + (i & 1) + 8 (i >> 1)``, and 16 more for the
second half).

That order makes the transpose a word-sized one. An output word (positions ``4t .. 4t + 3`` of a
16-key half) holds keys ``2t, 2t + 1, 2t + 8, 2t + 9`` at one head-dim byte, so a thread loads
those four keys' words at head-dim bytes ``4w .. 4w + 3`` (four 32-bit loads; the 16 threads
along ``w`` read 64 contiguous bytes of each key row), transposes the 4 x 4 bytes in registers
(:func:`byte_column`), and has the four output words of rows ``4w .. 4w + 3``. A block stages a
tile of ``TILE_KEYS`` keys x ``TILE_BYTES`` head-dim bytes in shared memory as words (rows padded
by one word: stores two-way bank-conflicted at most, loads conflict-free), then writes each
head-dim row's 128 keys as 32 consecutive words (coalesced). Keys past Nk are written as zeros.

The first version moved bytes one at a time through shared memory (944 instructions a thread
for 16 bytes): 0.40 TB/s on the H200, 168 us of every float8 call at B4 H16 N4096 D128
(performance log 22).
"""

from __future__ import annotations

from numba_flash._cuda import cuda  # first: chooses the world before numba.cuda loads

from numba import uint32  # noqa: E402

from numba_flash.kernels.jit import device_jit, kernel_jit

TILE_KEYS = 128  # keys of a block's tile: 32 output words a head-dim row
TILE_BYTES = 64  # head-dim bytes of a block's tile: 16 input words a key
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


@device_jit
def byte_column(a, b, c, d, e):
    """Byte ``e`` of ``a``, ``b``, ``c``, ``d``, packed low to high: one column of a 4 x 4 byte transpose."""
    s = uint32(8 * e)
    mask = uint32(0xFF)
    return ((a >> s) & mask) | (((b >> s) & mask) << uint32(8)) | (((c >> s) & mask) << uint32(16)) | \
        (((d >> s) & mask) << uint32(24))


@kernel_jit()
def transpose_values(v_words, vt_words, n_k, row_words, d_rows, vt_row):
    """vt (B, H, D, Nk' / 4) from v (B, H, Nk, Dw), both C-contiguous uint32 and passed flat
    (1-D: one base address a thread, small offsets, no 4-D index arithmetic a load): v's words
    hold four head-dim bytes, vt's four e4m3 keys in ``fp8.value_order``; ``row_words`` = Dw (4 Dw
    >= ``d_rows`` = D: head-dim bytes past D, padding, are not written), ``vt_row`` = Nk' / 4. Grid (ceil(Nk' / TILE_KEYS), ceil(D / TILE_BYTES), B H), ``THREADS``
    threads."""
    tile = cuda.shared.array(SHARED_SHAPE, dtype=uint32)
    bh = cuda.blockIdx.z
    k0, w0 = cuda.blockIdx.x * TILE_KEYS, cuda.blockIdx.y * IN_WORDS
    src = (bh * n_k + k0) * row_words + w0  # the tile's first word
    tid = cuda.threadIdx.x
    for r in range(LOAD_TASKS):  # read four keys' words, write four head-dim rows' words
        task = tid + THREADS * r
        g, w = task // IN_WORDS, task % IN_WORDS
        a = uint32(0)
        bb = uint32(0)
        c = uint32(0)
        d = uint32(0)
        key = group_key(g, 0)
        at = src + key * row_words + w
        if w0 + w < row_words:
            if k0 + key < n_k:
                a = v_words[at]
            if k0 + key + 1 < n_k:
                bb = v_words[at + row_words]
            if k0 + key + 8 < n_k:
                c = v_words[at + 8 * row_words]
            if k0 + key + 9 < n_k:
                d = v_words[at + 9 * row_words]
        for e in range(4):
            tile[4 * w + e, g] = byte_column(a, bb, c, d, e)
    cuda.syncthreads()
    dst = (bh * d_rows + 4 * w0) * vt_row + k0 // 4  # the tile's first output word
    for r in range(STORE_WORDS):  # each head-dim row: 32 consecutive words
        task = tid + THREADS * r
        row, g = task // GROUPS, task % GROUPS
        if 4 * w0 + row < d_rows and k0 // 4 + g < vt_row:
            vt_words[dst + row * vt_row + g] = tile[row, g]
