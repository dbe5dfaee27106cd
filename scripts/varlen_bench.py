"""Packed batches (issue 25): ``attention_varlen`` against its peers on the same documents, one run.

Documents of random lengths summing to ``--total`` tokens (seeded; each at least 128), causal,
float16: the time of

- ``numba_flash.attention_varlen`` (``--algorithm``: FA-2 by default, ``fa3`` FlashAttention-3's
  Hopper kernel; no padding: blocks over the real lengths);
- ``numba_flash.attention`` on a rectangle of the same tokens (``B = documents``, ``N = total /
  documents``): the rectangular kernel, compared by TFLOP/s since its work differs;
- PyTorch SDPA on the documents padded to the longest (``(documents, H, longest, D)``, flash
  backend, causal): what padding costs;
- PyTorch FlexAttention (``torch.compile``) on the packed tokens with a document mask
  (``create_block_mask`` once, outside the timing).

Queued timing (CUDA events around each of ``--repeats`` calls queued back to back, median);
FLOPs 4 H D sum(len^2) / 2 for the causal documents. Checks the varlen output against a float64
loop over the documents on the first 4 documents (FlashAttention's 2x rule against a plain
float16 one). Needs a GPU and torch.

    python scripts/varlen_bench.py [--algorithm fa3] --json docs/data/varlen_h200_<date>.json
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from mask_gallery import median_ms  # noqa: E402 (queued timing: events around each call, one synchronisation)


def document_lengths(total: int, n_docs: int, seed: int, shortest: int = 128) -> list[int]:
    """``n_docs`` random lengths of at least ``shortest`` summing to ``total`` (seeded)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, total // shortest), n_docs - 1, replace=False)) * shortest
    return np.diff(np.concatenate([[0], cuts, [total]])).astype(int).tolist()


def check(o, q, k, v, cu, torch, n_check: int = 4) -> str:
    """The varlen output of the first documents against float64 (2x a plain float16 error)."""
    for b in range(min(n_check, len(cu) - 1)):
        rows = slice(cu[b], cu[b + 1])
        qq, kk, vv = (x[rows].transpose(0, 1)[None] for x in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(qq.double(), kk.double(), vv.double(), is_causal=True)
        plain = _plain(qq, kk, vv, torch)
        base = float((plain - ref).abs().max())
        err = float((o[rows].transpose(0, 1)[None].double() - ref).abs().max())
        if not err <= 2 * base + 1e-6:
            return f"document {b}: error {err:.2e} above twice plain float16's {base:.2e}"
    return "ok"


def _plain(q, k, v, torch):
    """A plain float16 causal attention (S, P in float16), in float64 for the comparison."""
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    n = s.shape[-1]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), -math.inf)
    return (torch.softmax(s.float(), -1).half() @ v).double()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--total", type=int, default=65536)
    ap.add_argument("--documents", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--algorithm", default="fa2", choices=["fa2", "fa1", "fa3"],
                    help="the loop design of attention_varlen and of the rectangle (fa3: a forward)")
    ap.add_argument("--backward", action="store_true",
                    help="also time attention_backward_varlen against the rectangle's backward (FA-2, atomics)")
    ap.add_argument("--json", help="write the row here")
    args = ap.parse_args(argv)
    if args.backward and args.algorithm == "fa3":
        ap.error("--backward times the backward, which fa3 does not have (it is a forward); drop one")
    from numba_flash import needs

    needs.exit_unless("varlen_bench.py", needs.gpu(), needs.module("torch"))
    import numpy as np
    import torch

    import numba_flash

    H, D, total, n_docs = args.heads, args.head_dim, args.total, args.documents
    lens = document_lengths(total, n_docs, args.seed)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    longest = max(lens)
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    q, k, v = (torch.randn(total, H, D, device="cuda", generator=gen).half() for _ in range(3))
    flops = 4 * H * D * sum(n * n for n in lens) / 2
    row = dict(total=total, documents=n_docs, lengths=lens, heads=H, head_dim=D, dtype="float16", causal=True,
               algorithm=args.algorithm)
    print(f"{n_docs} documents, {total} tokens, longest {longest}; H{H} D{D} float16 causal, {args.algorithm}",
          flush=True)

    def varlen():
        return numba_flash.attention_varlen(q, k, v, cu, cu, longest, longest, causal=True, algorithm=args.algorithm)

    row["check"] = check(varlen(), q, k, v, cu.tolist(), torch)
    row["varlen_ms"] = median_ms(varlen, torch, args.repeats)
    row["varlen_tflops"] = flops / row["varlen_ms"] / 1e9
    print(f"  attention_varlen: {row['varlen_ms']:.3f} ms, {row['varlen_tflops']:.0f} TFLOP/s ({row['check']})", flush=True)

    n_rect = total // n_docs  # the rectangle of the same tokens
    rq, rk, rv = (x.reshape(n_docs, n_rect, H, D).transpose(1, 2).contiguous() for x in (q, k, v))
    row["rect_ms"] = median_ms(lambda: numba_flash.attention(rq, rk, rv, causal=True, algorithm=args.algorithm), torch,
                               args.repeats)
    row["rect_tflops"] = 4 * n_docs * H * n_rect * n_rect * D / 2 / row["rect_ms"] / 1e9
    row["varlen_vs_rect_throughput"] = row["varlen_tflops"] / row["rect_tflops"]
    print(f"  attention, B{n_docs} N{n_rect} (rectangle): {row['rect_ms']:.3f} ms, {row['rect_tflops']:.0f} TFLOP/s; "
          f"varlen's throughput {row['varlen_vs_rect_throughput']:.2f}x", flush=True)

    if args.backward:  # FLOPs 2.5x the forward's (FlashAttention's count)
        o, lse = numba_flash.attention_varlen(q, k, v, cu, cu, longest, longest, causal=True, return_lse=True)
        do = torch.randn_like(o)
        row["varlen_bwd_ms"] = median_ms(lambda: numba_flash.attention_backward_varlen(
            do, q, k, v, o, lse, cu, cu, longest, longest, causal=True), torch, args.repeats)
        ro, rlse = numba_flash.attention(rq, rk, rv, causal=True, return_lse=True)
        rdo = torch.randn_like(ro)
        row["rect_bwd_ms"] = median_ms(lambda: numba_flash.attention_backward(rdo, rq, rk, rv, ro, rlse, causal=True),
                                       torch, args.repeats)
        row["varlen_bwd_tflops"] = 2.5 * flops / row["varlen_bwd_ms"] / 1e9
        row["rect_bwd_tflops"] = 2.5 * row["rect_tflops"] * row["rect_ms"] / row["rect_bwd_ms"]
        print(f"  backward: varlen {row['varlen_bwd_ms']:.3f} ms, {row['varlen_bwd_tflops']:.0f} TFLOP/s; rectangle "
              f"{row['rect_bwd_ms']:.3f} ms, {row['rect_bwd_tflops']:.0f} TFLOP/s "
              f"({row['varlen_bwd_tflops'] / row['rect_bwd_tflops']:.2f}x)", flush=True)

    padded = [torch.zeros(n_docs, H, longest, D, device="cuda", dtype=torch.float16) for _ in range(3)]
    for b, n in enumerate(lens):
        for dst, src in zip(padded, (q, k, v)):
            dst[b, :, :n] = src[cu[b] : cu[b + 1]].transpose(0, 1)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            row["sdpa_padded_ms"] = median_ms(
                lambda: torch.nn.functional.scaled_dot_product_attention(*padded, is_causal=True), torch, args.repeats)
    except RuntimeError as e:
        row["sdpa_padded_ms"] = f"failed: {str(e)[:80]}"
    del padded

    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        doc = torch.repeat_interleave(torch.arange(n_docs, device="cuda"), torch.tensor(lens, device="cuda"))

        def document_causal(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        block = create_block_mask(document_causal, None, None, total, total, device="cuda")
        flex = torch.compile(flex_attention)
        fq, fk, fv = (x.transpose(0, 1)[None].contiguous() for x in (q, k, v))
        row["flex_ms"] = median_ms(lambda: flex(fq, fk, fv, block_mask=block), torch, args.repeats)
    except Exception as e:  # noqa: BLE001 -- a peer that cannot run is reported, not fatal
        row["flex_ms"] = f"failed: {type(e).__name__}: {str(e)[:80]}"
    for peer in ("sdpa_padded_ms", "flex_ms"):
        if isinstance(row[peer], float):
            row[peer.replace("_ms", "_over_varlen")] = row[peer] / row["varlen_ms"]
            print(f"  {peer[:-3]}: {row[peer]:.3f} ms ({row[peer] / row['varlen_ms']:.2f}x varlen's time)", flush=True)
        else:
            print(f"  {peer[:-3]}: {row[peer]}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)
    return 0 if row["check"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
