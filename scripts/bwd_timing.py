"""Backward pass of ``numba_flash.attention_backward`` against PyTorch SDPA's backward (issue 12).

    python scripts/bwd_timing.py [--batch 4 --heads 16 --seq 4096 --head-dim 64 128 --dtype float32 float16]

For each head dim and dtype: PyTorch's backward (memory-efficient SDPA for float32, flash for
16-bit) and numba_flash's FA-2 backward (atomics, and ``deterministic=True``) and FA-1 backward
(Algorithm 4) on the same torch tensors, CUDA cores. CUDA-event medians after warm-up
(``profiling.timing.median_ms``, calls back to back). FLOPs: 2.5x the forward's 4 B H N^2 D, as
the FlashAttention papers count the backward. One JSON object per row on stdout.
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
    ap.add_argument("--dtype", nargs="+", default=["float32", "float16"], choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--algorithms", nargs="+", default=["fa2", "fa2-deterministic", "fa1"],
                    choices=["fa2", "fa2-deterministic", "fa1"], help="numba_flash backward kernels to time")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per row (median)")
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import numba_flash
    from numba_flash.backward import attention_backward
    from numba_flash.profiling.timing import attention_flops, median_ms, tflops

    B, H, N = args.batch, args.heads, args.seq
    for D in args.head_dim:
        for name in args.dtype:
            dt = getattr(torch, name)
            q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dt) for _ in range(3))
            o, lse = numba_flash.attention(q, k, v, return_lse=True)
            do = torch.randn_like(o)
            flops = 2.5 * attention_flops(B, H, N, N, D, False)
            backend = SDPBackend.EFFICIENT_ATTENTION if name == "float32" else SDPBackend.FLASH_ATTENTION
            qr, kr, vr = (x.detach().requires_grad_() for x in (q, k, v))
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(qr, kr, vr)
            peer_ms = median_ms(lambda: torch.autograd.grad(out, (qr, kr, vr), do, retain_graph=True), repeats=args.repeats)
            print(json.dumps(dict(D=D, dtype=name, impl=f"torch {backend.name.lower()}", ms=round(peer_ms, 3),
                                  tflops=round(tflops(flops, peer_ms), 2))), flush=True)
            for label in args.algorithms:
                algorithm, deterministic = label.split("-")[0], label.endswith("deterministic")

                def run():
                    return attention_backward(do, q, k, v, o, lse, algorithm=algorithm, deterministic=deterministic)

                ms = median_ms(run, warmup=1, repeats=args.repeats if algorithm == "fa2" else 2)
                print(json.dumps(dict(D=D, dtype=name, impl=label, ms=round(ms, 3), tflops=round(tflops(flops, ms), 2),
                                      vs_peer=round(peer_ms / ms, 3))), flush=True)
            del q, k, v, o, lse, do, qr, kr, vr, out
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
