"""FA-2 float16 and bfloat16 on tensor cores against PyTorch's flash SDPA (issue 9's table).

    python scripts/tc16_timing.py [--batch 4 --heads 16 --seq 4096 --head-dim 64 128 --repeats 10]

For each head dim, dtype (float16, bfloat16) and causality: PyTorch's flash SDPA and
``numba_flash.attention`` on the same torch tensors, and for float16 also on CuPy views of them
(the CuPy path has less host work per call). CUDA-event medians after warm-up
(``profiling.timing.median_ms``): the calls are queued back to back, so a call's host work overlaps
the previous call's kernel, as in a loop of calls; ``--isolated`` synchronises after every call
instead, so that each time also holds the host work of one call (its latency). TFLOP/s uses
4 B H N^2 D, halved for causal. One JSON object per row on stdout.
"""

from __future__ import annotations

import argparse
import json


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--batch", type=int, default=4, help="batch size")
    ap.add_argument("--heads", type=int, default=16, help="heads")
    ap.add_argument("--seq", type=int, default=4096, help="sequence length (Nq = Nk)")
    ap.add_argument("--head-dim", type=int, nargs="+", default=[64, 128], help="head dims")
    ap.add_argument("--repeats", type=int, default=10, help="timed runs per row (median)")
    ap.add_argument("--isolated", action="store_true", help="synchronise after every timed call (latency, host work included)")
    args = ap.parse_args(argv)

    import cupy as cp
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import numba_flash
    from numba_flash.research.profiling.timing import attention_flops, median_ms, tflops

    B, H, N = args.batch, args.heads, args.seq
    for D in args.head_dim:
        for dt in (torch.float16, torch.bfloat16):
            q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dt) for _ in range(3))
            for causal in (False, True):
                flops = attention_flops(B, H, N, N, D, causal)

                def flash():
                    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                peer_ms = median_ms(flash, repeats=args.repeats, back_to_back=not args.isolated)
                ms = median_ms(lambda: numba_flash.attention(q, k, v, causal=causal), repeats=args.repeats,
                               back_to_back=not args.isolated)
                row = dict(D=D, dtype=str(dt).rsplit(".", 1)[-1], causal=causal, torch_in=round(tflops(flops, ms), 1),
                           flash=round(tflops(flops, peer_ms), 1), ratio=round(peer_ms / ms, 3))
                if dt == torch.float16:
                    qc, kc, vc = (cp.asarray(x.detach()) for x in (q, k, v))
                    ms_cupy = median_ms(lambda: numba_flash.attention(qc, kc, vc, causal=causal), repeats=args.repeats,
                                        back_to_back=not args.isolated)
                    row.update(cupy_in=round(tflops(flops, ms_cupy), 1))
                print(json.dumps(row), flush=True)
            del q, k, v
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
