"""What plain loads can read from HBM on this GPU: the ceiling a bandwidth-bound kernel (decode)
is measured against, besides the datasheet peak.

Two CuPy RawKernels read a buffer once with 16-byte streaming loads (``ld.global.cs``) and fold
it into a value nobody uses (so nothing is elided): a grid-stride loop (every block everywhere),
and contiguous chunks (block ``b`` reads chunk ``b``, as a split reads its range). Times are CUDA
events, median of ``--repeats`` after 3 warm-up runs. Default size: the K+V bytes of issue 11's
1M-key decode (B1 Hkv8 D128 float16), 4.29 GB. Measured: docs/performance-log.md ("Decode, fifth
session")."""

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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--bytes", type=int, default=2 * 1048576 * 8 * 128 * 2, help="bytes to read")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--peak-tbs", type=float, default=4.8, help="the GPU's HBM peak in TB/s (H200)")
    args = ap.parse_args(argv)

    import cupy as cp
    import numpy as np

    module = cp.RawModule(code=KERNELS)
    grid_stride, chunks = module.get_function("grid_stride"), module.get_function("chunks")
    n = args.bytes // 16
    buf = cp.random.randint(0, 2**31, n * 4, dtype=cp.int32)
    out = cp.zeros(1, cp.int32)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]

    def median_ms(kernel, grid, block, kernel_args):
        for _ in range(3):
            kernel(grid, block, kernel_args)
        start, end, times = cp.cuda.Event(), cp.cuda.Event(), []
        for _ in range(args.repeats):
            start.record()
            kernel(grid, block, kernel_args)
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


if __name__ == "__main__":
    main()
