"""What plain loads can read from HBM on this GPU: the ceiling a bandwidth-bound kernel (decode)
is measured against, besides the datasheet peak.

Two CuPy RawKernels read a buffer once with 16-byte streaming loads (``ld.global.cs``) and fold
it into a value nobody uses (so nothing is elided): a grid-stride loop (every block everywhere),
and contiguous chunks (block ``b`` reads chunk ``b``, as a split reads its range). Times are CUDA
events, median of ``--repeats`` after 3 warm-up runs. Default size: the K+V bytes of issue 11's
1M-key decode (B1 Hkv8 D128 float16), 4.29 GB. Measured: docs/performance-log.md ("Decode, fifth
session").

``--rings``: the decode kernel's copies without its math. 256 one-warp blocks (8 KV heads x 32
splits) each stream their K and V halves through a ring of ``cp.async`` tiles (64 rows of 256
bytes of K and of V per tile, one word of each read per tile), with shared rows at a 256-byte
pitch (as swizzled tiles) or a 272-byte one (padded by 16 bytes, as the tensor-core kernels
pad), K and V copies interleaved or K's tile then V's: performance-log 9j, where the padding
cost ~8%."""

from __future__ import annotations

import argparse

KERNELS = r'''
extern "C" __global__ void grid_stride(const int4* __restrict__ a, long n, int* out) {
  int4 acc = make_int4(0, 0, 0, 0);
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
    int4 x = __ldcs(a + i); acc.x ^= x.x; acc.y ^= x.y; acc.z ^= x.z; acc.w ^= x.w;
  }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x12345678) out[0] = 1;
}
extern "C" __global__ void chunks(const int4* __restrict__ a, long per_block, int* out) {
  const int4* p = a + blockIdx.x * per_block;
  int4 acc = make_int4(0, 0, 0, 0);
  for (long i = threadIdx.x; i < per_block; i += blockDim.x) {
    int4 x = __ldcs(p + i); acc.x ^= x.x; acc.y ^= x.y; acc.z ^= x.z; acc.w ^= x.w;
  }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x12345678) out[0] = 1;
}
'''

# A ring of STAGES (K tile, V tile) pairs of TILE 16-byte chunks, rows of 16 chunks stored PITCH
# chunks apart; block x streams chunk (x % 8) * 32 + x / 8 of K and of V (head-major, as the
# split kernel's grid); KVSEQ: K's copies of a tile, then V's.
RING_KERNEL = r'''
#include <cuda_pipeline.h>
__device__ __forceinline__ int dst_of(int e) { return (e >> 4) * PITCH + (e & 15); }
__device__ __forceinline__ void copy_tile(int4* smem, int stage, const int4* pk, const int4* pv, long tile) {
  const int STG = (TILE / 16) * PITCH;
  if (KVSEQ) {
    for (int e = threadIdx.x; e < TILE; e += blockDim.x) __pipeline_memcpy_async(smem + (2 * stage) * STG + dst_of(e), pk + tile * TILE + e, 16);
    for (int e = threadIdx.x; e < TILE; e += blockDim.x) __pipeline_memcpy_async(smem + (2 * stage + 1) * STG + dst_of(e), pv + tile * TILE + e, 16);
  } else {
    for (int e = threadIdx.x; e < TILE; e += blockDim.x) {
      __pipeline_memcpy_async(smem + (2 * stage) * STG + dst_of(e), pk + tile * TILE + e, 16);
      __pipeline_memcpy_async(smem + (2 * stage + 1) * STG + dst_of(e), pv + tile * TILE + e, 16);
    }
  }
}
extern "C" __global__ void ring(const int4* __restrict__ k, const int4* __restrict__ v, long per_block, int* out) {
  extern __shared__ int4 smem[];
  const int STG = (TILE / 16) * PITCH;
  long chunk = (blockIdx.x % 8) * 32 + blockIdx.x / 8;
  const int4* pk = k + chunk * per_block; const int4* pv = v + chunk * per_block;
  long n_tiles = per_block / TILE;
  int acc = 0;
  for (int s = 0; s < STAGES - 1; ++s) { copy_tile(smem, s, pk, pv, s); __pipeline_commit(); }
  for (long j = 0; j < n_tiles; ++j) {
    __pipeline_wait_prior(STAGES - 2);
    __syncthreads();
    if (j + STAGES - 1 < n_tiles) copy_tile(smem, (j + STAGES - 1) % STAGES, pk, pv, j + STAGES - 1);
    __pipeline_commit();
    int st = j % STAGES;
    acc ^= smem[(2 * st) * STG + threadIdx.x].x ^ smem[(2 * st + 1) * STG + threadIdx.x].y;
  }
  if (acc == 0x12345678) out[0] = 1;
}
'''
RINGS = [(16, 0, 3), (17, 0, 3), (16, 1, 3), (17, 1, 3), (17, 1, 2)]  # (pitch in chunks, K then V, stages)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--bytes", type=int, default=2 * 1048576 * 8 * 128 * 2, help="bytes to read")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--peak-tbs", type=float, default=4.8, help="the GPU's HBM peak in TB/s (H200)")
    ap.add_argument("--rings", action="store_true",
                    help="also the cp.async rings of the decode kernel's copies (shared pitch 256 / 272 B)")
    args = ap.parse_args(argv)
    from numba_flash import needs

    needs.exit_unless("hbm_read_ceiling.py", needs.gpu(), needs.module("cupy"))
    import cupy as cp
    import numpy as np

    module = cp.RawModule(code=KERNELS)
    grid_stride, chunks = module.get_function("grid_stride"), module.get_function("chunks")
    n = args.bytes // 16
    buf = cp.random.randint(0, 2**31, n * 4, dtype=cp.int32)
    out = cp.zeros(1, cp.int32)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]

    def median_ms(kernel, grid, block, kernel_args, shared_mem=0):
        for _ in range(3):
            kernel(grid, block, kernel_args, shared_mem=shared_mem)
        start, end, times = cp.cuda.Event(), cp.cuda.Event(), []
        for _ in range(args.repeats):
            start.record()
            kernel(grid, block, kernel_args, shared_mem=shared_mem)
            end.record()
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end))
        return float(np.median(times))

    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}: reading {n * 16 / 1e9:.2f} GB, "
          f"{sms} SMs, peak {args.peak_tbs} TB/s")
    runs = [("grid-stride", grid_stride, blocks, threads, n) for blocks, threads in
            ((sms * 8, 256), (sms * 16, 256), (sms * 4, 1024))]
    runs += [("chunks", chunks, blocks, threads, n // blocks) for blocks, threads in ((1024, 128), (2048, 256))]
    for name, kernel, blocks, threads, count in runs:
        ms = median_ms(kernel, (blocks,), (threads,), (buf, np.int64(count), out))
        read = (count * blocks if name == "chunks" else n) * 16
        tbs = read / ms / 1e9
        print(f"{name:12s} {blocks:5d} blocks x {threads:4d} threads: {ms:.4f} ms {tbs:.2f} TB/s "
              f"({100 * tbs / args.peak_tbs:.0f}% of peak)", flush=True)
    if not args.rings:
        return
    half = n // 2  # K, then V: the two halves of the buffer
    k, v = buf[: half * 4], buf[half * 4 : 2 * half * 4]
    blocks, tile = 256, 1024  # 8 KV heads x 32 splits; 64 rows of 256 bytes
    per_block = half // blocks // tile * tile
    for pitch, kv_seq, stages in RINGS:
        options = (f"-DTILE={tile}", f"-DSTAGES={stages}", f"-DPITCH={pitch}", f"-DKVSEQ={kv_seq}")
        kernel = cp.RawModule(code=RING_KERNEL, options=options).get_function("ring")
        smem = stages * 2 * (tile // 16) * pitch * 16
        kernel.max_dynamic_shared_size_bytes = smem
        ms = median_ms(kernel, (blocks,), (32,), (k, v, np.int64(per_block), out), smem)
        tbs = 2 * per_block * blocks * 16 / ms / 1e9
        print(f"ring {stages} tiles, shared rows {pitch * 16} B apart, K and V "
              f"{'in turn' if kv_seq else 'interleaved'}: {ms:.4f} ms {tbs:.2f} TB/s "
              f"({100 * tbs / args.peak_tbs:.0f}% of peak)", flush=True)


if __name__ == "__main__":
    main()
