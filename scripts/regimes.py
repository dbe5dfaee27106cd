"""FA-1 and FA-2 in both regimes (CUDA cores and tensor cores), with the peers, in one run.

    python scripts/regimes.py [--batch 4 --heads 16 --seq 4096 --fa1-seq 2048 --head-dim 64 128 --out DIR]

For each head dim it times, on the same inputs and in the same process:

- float16: FA-2 and FA-1 on tensor cores (``precision=None``) and on CUDA cores (``"ieee"``), the
  FA-2/FA-1 ratio of each regime (FA-1 at ``--fa1-seq``: one block per head is slow), FA-2
  causal; PyTorch SDPA flash and cuDNN;
- bfloat16: FA-2 on tensor cores (PyTorch tensors), PyTorch SDPA flash;
- float32: FA-2 exact (CUDA cores), ``tf32`` and ``tf32x3``; PyTorch SDPA memory-efficient.

Every row carries its relative error against a float64 reference (on the first heads), TFLOP/s
(4 B H Nq Nk D, halved for causal) and the ratio to its peer. Writes ``regimes.md`` and
``regimes.json`` to ``--out``. Needs a GPU, CuPy and PyTorch; ``--help`` needs neither.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--batch", type=int, default=4, help="batch size")
    ap.add_argument("--heads", type=int, default=16, help="heads")
    ap.add_argument("--seq", type=int, default=4096, help="sequence length of the FA-2 and peer rows")
    ap.add_argument("--fa1-seq", type=int, default=2048, help="sequence length of the FA-1 vs FA-2 rows")
    ap.add_argument("--head-dim", type=int, nargs="+", default=[64, 128], help="head dims")
    ap.add_argument("--repeats", type=int, default=10, help="timed runs per row (median)")
    ap.add_argument("--out", default=".", help="directory for regimes.md and regimes.json")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = _args(argv)
    from numba_flash import needs

    needs.exit_unless("regimes.py", needs.gpu(), needs.module("cupy"), needs.module("torch"))
    import cupy as cp
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import numba_flash
    from numba_flash.research.profiling.timing import attention_flops, median_ms, tflops

    B, H = args.batch, args.heads
    rows = []
    started = time.time()

    def record(**row):
        rows.append(row)
        ratio = f" ({row['vs_peer']:.2f}x {row['peer']})" if row.get("vs_peer") else ""
        err = f"  rel err {row['rel_err']:.1e}" if "rel_err" in row else ""
        print(f"[{time.time() - started:6.1f}s] D={row['D']} N={row['N']} {row['dtype']:8s} {row['name']:28s} "
              f"{row['tflops']:7.1f} TFLOP/s{err}{ratio}", flush=True)

    def sdpa(backend, causal):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run

    def rel_err(o, q, k, v, causal):
        """Against float64, on the first two heads of the first batch (the full S is large)."""
        q, k, v, o = (torch.as_tensor(x, device="cuda")[:1, :2].double() for x in (q, k, v, o))
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if causal:
            n = s.shape[-1]
            s = s.masked_fill(torch.ones(n, n, device="cuda", dtype=torch.bool).triu(1), -math.inf)
        ref = torch.softmax(s, dim=-1) @ v
        return float((o - ref).norm() / ref.norm())

    for D in args.head_dim:
        for N, causal_list in ((args.seq, (False, True)), (args.fa1_seq, (False,))):
            for causal in causal_list:
                flops = attention_flops(B, H, N, N, D, causal)
                rs = cp.random.default_rng(D + N)
                q, k, v = (rs.standard_normal((B, H, N, D), dtype=cp.float32).astype(cp.float16) for _ in range(3))
                tq, tk, tv = (torch.as_tensor(x, device="cuda") for x in (q, k, v))
                peer_ms = median_ms(lambda: sdpa(SDPBackend.FLASH_ATTENTION, causal)(tq, tk, tv), repeats=args.repeats)
                record(D=D, N=N, dtype="float16", causal=causal, name="torch-flash", tflops=tflops(flops, peer_ms), ms=peer_ms)
                if N == args.seq:
                    ms = median_ms(lambda: sdpa(SDPBackend.CUDNN_ATTENTION, causal)(tq, tk, tv), repeats=args.repeats)
                    record(D=D, N=N, dtype="float16", causal=causal, name="torch-cudnn", tflops=tflops(flops, ms), ms=ms)
                algs = ("fa2",) if N == args.seq else ("fa2", "fa1")
                for regime, precision in (("tensor cores", None), ("CUDA cores", "ieee")):
                    for alg in algs:
                        if N == args.seq and causal and precision == "ieee":
                            continue
                        fn = lambda: numba_flash.attention(q, k, v, causal=causal, algorithm=alg, precision=precision)  # noqa: E731
                        err = rel_err(fn(), q, k, v, causal)
                        ms = median_ms(fn, repeats=args.repeats if alg == "fa2" else 3)
                        record(D=D, N=N, dtype="float16", causal=causal, name=f"{alg} {regime}", tflops=tflops(flops, ms), ms=ms,
                               rel_err=err, vs_peer=peer_ms / ms, peer="torch-flash", algorithm=alg, regime=regime)
        N = args.seq
        flops = attention_flops(B, H, N, N, D, False)
        tq, tk, tv = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        peer_ms = median_ms(lambda: sdpa(SDPBackend.FLASH_ATTENTION, False)(tq, tk, tv), repeats=args.repeats)
        record(D=D, N=N, dtype="bfloat16", causal=False, name="torch-flash", tflops=tflops(flops, peer_ms), ms=peer_ms)
        fn = lambda: numba_flash.attention(tq, tk, tv)  # noqa: E731
        err = rel_err(fn(), tq, tk, tv, False)
        ms = median_ms(fn, repeats=args.repeats)
        record(D=D, N=N, dtype="bfloat16", causal=False, name="fa2 tensor cores", tflops=tflops(flops, ms), ms=ms,
               rel_err=err, vs_peer=peer_ms / ms, peer="torch-flash", algorithm="fa2", regime="tensor cores")
        rs = cp.random.default_rng(D)
        q, k, v = (rs.standard_normal((B, H, N, D), dtype=cp.float32) for _ in range(3))
        tq, tk, tv = (torch.as_tensor(x, device="cuda") for x in (q, k, v))
        peer_ms = median_ms(lambda: sdpa(SDPBackend.EFFICIENT_ATTENTION, False)(tq, tk, tv), repeats=args.repeats)
        record(D=D, N=N, dtype="float32", causal=False, name="torch-mem_efficient", tflops=tflops(flops, peer_ms), ms=peer_ms)
        for precision in ("ieee", "tf32", "tf32x3"):
            fn = lambda: numba_flash.attention(q, k, v, precision=precision)  # noqa: E731
            err = rel_err(fn(), q, k, v, False)
            ms = median_ms(fn, repeats=args.repeats)
            record(D=D, N=N, dtype="float32", causal=False, name=f"fa2 {precision}", tflops=tflops(flops, ms), ms=ms,
                   rel_err=err, vs_peer=peer_ms / ms, peer="torch-mem_efficient", algorithm="fa2", regime=precision)

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "regimes.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), batch=B, heads=H, rows=rows), f, indent=1)
    lines = ["| D | N | dtype | causal | kernel | TFLOP/s | vs peer | rel err |", "|---:|---:|---|---|---|---:|---:|---:|"]
    for r in rows:
        vs = f"{r['vs_peer']:.2f}x {r['peer']}" if r.get("vs_peer") else ""
        err = f"{r['rel_err']:.1e}" if "rel_err" in r else ""
        lines.append(f"| {r['D']} | {r['N']} | {r['dtype']} | {r['causal']} | {r['name']} | {r['tflops']:.1f} | {vs} | {err} |")
    for D in args.head_dim:  # the FA-2 / FA-1 ratio of each regime, same shape, same run
        for regime in ("tensor cores", "CUDA cores"):
            ms = {r["algorithm"]: r["ms"] for r in rows if r.get("regime") == regime and r["D"] == D and r["N"] == args.fa1_seq}
            if {"fa1", "fa2"} <= set(ms):
                lines.append(f"\nD={D} N={args.fa1_seq} float16, {regime}: FA-2 / FA-1 speed = {ms['fa1'] / ms['fa2']:.2f}x")
    text = "\n".join(lines)
    with open(os.path.join(args.out, "regimes.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
