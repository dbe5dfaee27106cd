"""V^T for FlashAttention-3's float8 products, in one pass over V (``numba_flash.fp8``).

8-bit ``wgmma`` operands are K-major, so O += P V needs V with its keys contiguous: for each head
dim row, the keys in the order P's accumulator registers hold them (``fp8.value_order``: within
each 32 keys, position ``4t + i`` holds key ``2t + (i & 1) + 8 (i >> 1)``, and 16 more for the
second half). A block transposes a tile of 64 keys x 64 head-dim bytes through shared memory:
32-bit loads along the head dim, 32-bit stores along the keys (four keys a word); keys past Nk
are written as zeros.
"""

from __future__ import annotations

from numba_flash._cuda import cuda  # first: chooses the world before numba.cuda loads

from numba import uint8, uint32  # noqa: E402

from numba_flash.kernels.jit import device_jit, kernel_jit

TILE = 64  # keys and head-dim bytes of a block's tile
THREADS = 256
WORDS = TILE // 4  # 32-bit words along a tile's row
PER_THREAD = TILE * WORDS // THREADS  # words each thread moves
SHARED_SHAPE = (TILE, TILE + 4)  # [key][d]; padded rows spread the banks (a constant: the GPU needs one)


@device_jit
def ordered_key(p):
    """The key (of a 64-key tile) stored at position ``p``: ``fp8.value_order`` within each 32."""
    chunk, p32 = p // 32, p % 32
    half, t, i = p32 // 16, (p32 % 16) // 4, p32 % 4
    return 32 * chunk + 16 * half + 2 * t + (i & 1) + 8 * (i >> 1)


@kernel_jit()
def transpose_values(v_words, vt_words, n_k):
    """vt (B, H, D, Nk' / 4) uint32 (four e4m3 keys a word) from v (B, H, Nk, D / 4) uint32 (four
    head-dim bytes a word); grid (ceil(Nk' / 64), ceil(D / 64), B H), 256 threads. Each thread's
    four loads (and four stores) are issued before any is used: the loops have constant trip
    counts, so they unroll and the block keeps 4 KiB in flight."""
    tile = cuda.shared.array(SHARED_SHAPE, dtype=uint8)
    words = cuda.local.array(PER_THREAD, dtype=uint32)
    heads = v_words.shape[1]
    b, h = cuda.blockIdx.z // heads, cuda.blockIdx.z % heads
    k0, d0 = cuda.blockIdx.x * TILE, cuda.blockIdx.y * TILE
    tid = cuda.threadIdx.x
    for r in range(PER_THREAD):  # read: 64 keys x 16 words of head dim
        key, w = (tid + THREADS * r) // WORDS, (tid + THREADS * r) % WORDS
        words[r] = uint32(0)
        if k0 + key < n_k and d0 // 4 + w < v_words.shape[3]:
            words[r] = v_words[b, h, k0 + key, d0 // 4 + w]
    for r in range(PER_THREAD):
        key, w = (tid + THREADS * r) // WORDS, (tid + THREADS * r) % WORDS
        for e in range(4):
            tile[key, 4 * w + e] = uint8((words[r] >> uint32(8 * e)) & uint32(0xFF))
    cuda.syncthreads()
    for r in range(PER_THREAD):  # write: 64 head-dim rows x 16 words of keys
        d, w = (tid + THREADS * r) // WORDS, (tid + THREADS * r) % WORDS
        word = uint32(0)
        for e in range(4):
            word |= uint32(tile[ordered_key(4 * w + e), d]) << uint32(8 * e)
        if d0 + d < vt_words.shape[2] and k0 // 4 + w < vt_words.shape[3]:
            vt_words[b, h, d0 + d, k0 // 4 + w] = word
