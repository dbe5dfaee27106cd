"""Backward pass of ``numba_flash.attention_backward`` against PyTorch SDPA's backward (issue 12).

    python scripts/bwd_timing.py [--batch 4 --heads 16 --seq 4096 --head-dim 64 128 --dtype float32 float16]
                                 [--precision default ieee tf32x3] [--tc-tiles 64x128 64x64] [--causal]

For each head dim and dtype: PyTorch's backward (memory-efficient SDPA for float32, flash for
16-bit) and numba_flash's FA-2 backward (atomics, and ``deterministic=True``) and FA-1 backward
(Algorithm 4) on the same torch tensors. ``--precision default`` times what
``attention_backward`` runs (tensor cores for float16/bfloat16, ``kernels.tc_bwd``; CUDA cores
for float32), ``ieee`` the CUDA-core kernels for every dtype (``backward.gradients(precision=
"ieee")``, the research baseline), ``tf32x3`` float32 on split-precision tensor cores
(``gradients(precision="tf32x3")``; skipped for 16-bit dtypes); each row names its ``regime``
("f16", "bf16", "tf32x3": tensor cores; "ieee": CUDA cores) and, on tensor cores, its ``tiles`` (block_m queries x block_n keys;
``--tc-tiles`` sweeps them). CUDA-event medians after warm-up (``profiling.timing.median_ms``,
calls back to back). FLOPs: 2.5x the forward's 4 B H N^2 D (halved when causal), as the
FlashAttention papers count the backward. One JSON object per row on stdout.
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
    ap.add_argument("--precision", nargs="+", default=["default"], choices=["default", "ieee", "tf32x3"],
                    help="default: attention_backward's regime (tensor cores for 16-bit); ieee: CUDA cores for every "
                         "dtype; tf32x3: float32 on split-precision tensor cores")
    ap.add_argument("--tc-tiles", nargs="+", default=[None],
                    help="tensor-core tiles 'MxN' (block_m queries x block_n keys) to time; default: the kernels' default")
    ap.add_argument("--causal", action="store_true", help="causal attention (PyTorch: is_causal=True)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per row (median)")
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import numba_flash
    from numba_flash.backward import backward_regime, gradients
    from numba_flash.kernels.tc_ops import kernel_head_dim
    from numba_flash.research.profiling.timing import attention_flops, median_ms, tflops
    from numba_flash.tile_table import backward_tc_tiles

    B, H, N = args.batch, args.heads, args.seq
    for D in args.head_dim:
        for name in args.dtype:
            dt = getattr(torch, name)
            q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dt) for _ in range(3))
            o, lse = numba_flash.attention(q, k, v, causal=args.causal, return_lse=True)
            do = torch.randn_like(o)
            flops = 2.5 * attention_flops(B, H, N, N, D, args.causal)
            backend = SDPBackend.EFFICIENT_ATTENTION if name == "float32" else SDPBackend.FLASH_ATTENTION
            qr, kr, vr = (x.detach().requires_grad_() for x in (q, k, v))
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(qr, kr, vr, is_causal=args.causal)
            peer_ms = median_ms(lambda: torch.autograd.grad(out, (qr, kr, vr), do, retain_graph=True), repeats=args.repeats)
            print(json.dumps(dict(D=D, dtype=name, causal=args.causal, impl=f"torch {backend.name.lower()}",
                                  ms=round(peer_ms, 3), tflops=round(tflops(flops, peer_ms), 2))), flush=True)
            for precision in args.precision:
                prec = None if precision == "default" else precision
                if prec == "tf32x3" and name != "float32":
                    continue
                regime = backward_regime(prec, name)
                tile_list = args.tc_tiles if regime != "ieee" else [None]
                for tiles_arg in tile_list:
                    tiles = tuple(int(x) for x in tiles_arg.lower().split("x")) if tiles_arg else None
                    shown = tiles or (backward_tc_tiles(kernel_head_dim(regime, D), regime) if regime != "ieee" else None)
                    for label in args.algorithms:
                        algorithm, deterministic = label.split("-")[0], label.endswith("deterministic")

                        def run():
                            return gradients(do, q, k, v, o, lse, causal=args.causal, algorithm=algorithm,
                                             deterministic=deterministic, precision=prec, tiles=tiles)

                        ms = median_ms(run, warmup=1, repeats=args.repeats if algorithm == "fa2" else 2)
                        row = dict(D=D, dtype=name, causal=args.causal, impl=label, regime=regime,
                                   tiles=f"{shown[0]}x{shown[1]}" if shown else None, ms=round(ms, 3),
                                   tflops=round(tflops(flops, ms), 2), vs_peer=round(peer_ms / ms, 3))
                        print(json.dumps(row), flush=True)
            del q, k, v, o, lse, do, qr, kr, vr, out
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
