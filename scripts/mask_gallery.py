"""The mask gallery: each mask numba_flash compiles into its kernels, checked and timed (issue 24).

    python scripts/mask_gallery.py [--seq 32768] [--heads 16] [--head-dim 128] [--dtype float16]
                                   [--algorithm fa2|fa3] [--backward] [--json out.json] [--only ALiBi ...]

For every entry (no mask, causal, sliding windows, tanh softcap, ALiBi, a causal ``mask_mod``,
document masking by ``mask_mod``), in one process on the GPU at hand:

1. correctness at a small shape (B1 H4 N1000, the entry's mask scaled to it) against float64
   torch with the same mask as a boolean matrix: FlashAttention's rule, the error at most twice a
   plain implementation's in the input dtype (forward; with ``--backward`` the gradients within
   2e-2 of the largest);
2. time at ``B1 H{heads} N{seq} D{head_dim}`` (CUDA events around each of 10 calls queued back to
   back after warm-up, their median; compilation excluded; until 2026-12-02's block-sparse run each
   call was synchronised, which counted a call's host work as GPU time), TFLOP/s over the *visible* (query, key) pairs
   (4 * D * pairs; FLOPs the mask hides are not counted), and the cost rule of issue 24: the
   time over (visible fraction of the causal mask's pairs x the causal time), which the issue
   wants at most 1.2 -- the cost follows the visible tiles; for the score modifications (softcap,
   ALiBi), ``mod_cost``: the time over the same mask's without the modification (the issue: at
   most 1.1);
3. peers in the same run: PyTorch SDPA with ``is_causal`` (its default backend: cuDNN or flash)
   for the causal entry, and with a dense boolean mask (its memory-efficient kernel: the only
   SDPA path that takes one) for every masked entry, so a mask's price in each library is on
   one line; for a ``mask_mod`` entry, PyTorch FlexAttention (``torch.compile``, its default 128 x
   128 block mask) on the same function, and for the causal ``mask_mod`` its time over the built-in
   ``causal=True`` (``vs_builtin``; issue 24: at most 1.05). The ``mask_mod`` entries walk their
   block mask: derived by the kernels at their own tiles, or (``block_mask 128``) FlexAttention's
   block size, made on the host with ``numba_flash.block_mask`` and carried to the kernel's tiles.

``--algorithm fa3``: every entry on FlashAttention-3's Hopper kernel (a forward: no ``--backward``).

One line per measurement goes to stderr as it runs; the table is printed at the end (Markdown)
and written with ``--json``. Needs a GPU, CuPy and torch.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time


def entries(n: int):
    """(name, numba_flash keyword arguments, (left, right) of the mask or None) at length n; the
    score modifications' cost is their time over the same mask's without them (issue 24: <= 1.1).
    ``"alibi_slopes": "standard"`` stands for ALiBi's own slopes (:func:`standard_slopes`)."""
    w = n // 8
    return [
        ("no mask", {}, None),
        ("causal", {"causal": True}, (-1, 0)),
        (f"sliding window ({w}, 0)", {"window_size": (w, 0)}, (w, 0)),
        (f"sliding window ({w // 2}, {w // 2})", {"window_size": (w // 2, w // 2)}, (w // 2, w // 2)),
        ("tanh softcap 50", {"softcap": 50.0}, None),
        ("causal, softcap 50", {"causal": True, "softcap": 50.0}, (-1, 0)),
        ("ALiBi", {"alibi_slopes": "standard"}, None),
        ("causal, ALiBi", {"causal": True, "alibi_slopes": "standard"}, (-1, 0)),
        ("causal (mask_mod)", {"mask_mod": "causal"}, None),
        (f"documents ({DOCUMENTS}, mask_mod)", {"mask_mod": "documents"}, None),
        (f"documents ({DOCUMENTS}, mask_mod, block_mask 128)", {"mask_mod": "documents", "block_mask": 128}, None),
    ]


DOCUMENTS = 8  # the document-masking entry: equal documents, each query sees its own (issue 24's 8 at N=32768)


def same_document(b, h, q_idx, kv_idx, doc):
    """FlexAttention's document mask: a query sees the keys of its own document (ids in mod_args)."""
    return doc[q_idx] == doc[kv_idx]


def causal_mod(b, h, q_idx, kv_idx):
    """The causal mask as a mask_mod (issue 24: within 5% of the built-in ``causal=True``)."""
    return q_idx >= kv_idx


def document_ids(n: int, torch):
    """Document ids of ``n`` positions: :data:`DOCUMENTS` equal runs."""
    return (torch.arange(n, device="cuda") * DOCUMENTS // n).to(torch.int32)


MODS = ("softcap", "alibi_slopes")  # the score modifications (entries timed against the same mask without them)


def standard_slopes(heads: int, torch):
    """ALiBi's slopes (Press et al. 2022): the geometric sequence 2^(-8 h / H), h = 1..H."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], dtype=torch.float32, device="cuda")


def resolved(kwargs: dict, heads: int, torch) -> dict:
    """``kwargs`` with ``"standard"`` slopes made for ``heads`` query heads."""
    out = dict(kwargs)
    if out.get("alibi_slopes") == "standard":
        out["alibi_slopes"] = standard_slopes(heads, torch)
    return out


def with_documents(kwargs: dict, n: int, torch) -> dict:
    """``kwargs`` with ``"documents"`` made the document mask of length ``n`` (mask_mod, mod_args),
    ``"causal"`` the causal mask_mod, and ``block_mask: size`` the mask's block mask at size x size
    tiles (``numba_flash.block_mask``, on the host; else the kernels derive theirs)."""
    import numba_flash

    out = dict(kwargs)
    if out.get("mask_mod") == "documents":
        out["mask_mod"], out["mod_args"] = same_document, (document_ids(n, torch),)
    elif out.get("mask_mod") == "causal":
        out["mask_mod"] = causal_mod
    if "block_mask" in out:
        size = out["block_mask"]
        host_args = tuple(a.cpu().numpy() for a in out.get("mod_args", ()))
        out["block_mask"] = numba_flash.block_mask(out["mask_mod"], None, None, n, n, block_m=size, block_n=size,
                                                   mod_args=host_args)
    return out


def flex_ms(kwargs: dict, q, k, v, n: int, torch):
    """PyTorch FlexAttention (torch.compile, its default 128 x 128 blocks) on the same mask_mod: a
    time in ms, or why it could not run."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if kwargs["mask_mod"] is causal_mod:
            def mod(b, h, q_idx, kv_idx):
                return q_idx >= kv_idx
        else:
            doc = kwargs["mod_args"][0]

            def mod(b, h, q_idx, kv_idx):
                return doc[q_idx] == doc[kv_idx]
        block = create_block_mask(mod, None, None, n, n, device="cuda")
        flex = torch.compile(flex_attention)
        return median_ms(lambda: flex(q, k, v, block_mask=block), torch)
    except Exception as e:  # noqa: BLE001 -- a peer that cannot run is reported, not fatal
        return f"failed: {type(e).__name__}: {str(e)[:80]}"


def document_visible(n: int, torch):
    """The document mask as a dense (n, n) bool matrix (the peers' and the check's)."""
    doc = document_ids(n, torch)
    return doc[:, None] == doc[None, :]


def visible(window, n_q, n_k, torch, device):
    from numba_flash.masking import MaskSpec

    spec = MaskSpec(*(window or (-1, -1)))
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    return spec.visible(i, j, n_q, n_k), spec.visible_pairs(n_q, n_k)


def check(kwargs, window, dtype, backward, seq, torch, algorithm="fa2") -> str:
    """The small-shape check of one entry (its window scaled from length ``seq`` to 1000): 'ok'
    or what failed."""
    import numba_flash

    n = 1000
    backward = backward and "mask_mod" not in kwargs  # (numba_flash.torch's operators take no Python functions)
    scaled = dict(kwargs)
    win = window
    if "window_size" in kwargs:  # the window at the small shape: the same fraction of N
        big = kwargs["window_size"]
        win = tuple(-1 if x < 0 else max(1, x * n // seq) for x in big)
        scaled["window_size"] = win
    gen = torch.Generator(device="cuda").manual_seed(0)
    dt = getattr(torch, dtype)
    q, k, v = (torch.randn(1, 4, n, 64, device="cuda", generator=gen).to(dt).requires_grad_(backward) for _ in range(3))
    seen, _ = visible(win, n, n, torch, "cuda")
    if kwargs.get("mask_mod") == "documents":
        seen = seen & document_visible(n, torch)
    elif kwargs.get("mask_mod") == "causal":
        seen = seen & visible((-1, 0), n, n, torch, "cuda")[0]
    if "mask_mod" in kwargs:
        scaled = with_documents(scaled, n, torch)

    cap = kwargs.get("softcap", 0.0)
    scaled = resolved(scaled, 4, torch)
    slopes = scaled.get("alibi_slopes")

    def plain(t):
        qq, kk, vv = (x.detach().to(t).requires_grad_(backward) for x in (q, k, v))
        s = (qq @ kk.transpose(-1, -2)) / 8.0
        if cap:
            s = cap * torch.tanh(s / cap)
        if slopes is not None:
            i = torch.arange(n, device="cuda")[:, None]
            j = torch.arange(n, device="cuda")[None, :]
            s = s - slopes.to(t)[None, :, None, None] * (i - j).abs().to(t)
        p = torch.softmax(s.masked_fill(~seen, -math.inf).float(), dim=-1).nan_to_num(0.0).to(t)
        return (qq, kk, vv), p @ vv

    (q64, k64, v64), ref = plain(torch.float64)
    _, base = plain(dt)
    if backward:
        import numba_flash.torch as nft

        o = nft.attention(q, k, v, algorithm=algorithm, **scaled)
    else:
        o = numba_flash.attention(q.detach(), k.detach(), v.detach(), algorithm=algorithm, **scaled)
    err = float((o.double() - ref).abs().max())
    bar = 2 * float((base.double() - ref).abs().max()) + 1e-6
    if err > bar:
        return f"forward error {err:.2e} > {bar:.2e}"
    if backward:
        do = torch.randn(o.shape, device="cuda", generator=gen).to(dt)
        o.backward(do)
        ref.backward(do.double())
        for name_, got, want in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
            rel = float((got.double() - want).abs().max() / want.abs().max())
            if rel > 2e-2:
                return f"{name_} error {rel:.2e}"
    return "ok"


def median_ms(fn, torch, repeats=10, warmup_s=0.2):
    """The median GPU time of ``repeats`` calls queued back to back (events around each, one
    synchronisation at the end: the host's launch work overlaps the GPU's, as in a model's step),
    after ``warmup_s`` seconds of the same call: on the H200 the first ~30 calls of a case timed right
    after another case's can read 5-15% slow (performance log 28), a warm-up of one call is not enough."""
    fn()
    torch.cuda.synchronize()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < warmup_s:  # queued as the timed calls are (at most 8 ahead)
        fn()
        calls += 1
        if calls % 8 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for a, b in events:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in events)
    return times[len(times) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--algorithm", default="fa2", choices=["fa2", "fa1", "fa3"],
                    help="the forward's loop design (fa3: FlashAttention-3 on Hopper)")
    ap.add_argument("--backward", action="store_true", help="also check and time the backward")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--only", nargs="+", metavar="TEXT",
                    help="only the entries whose name contains one of these (and 'no mask' and 'causal', the "
                         "baselines of every cost)")
    args = ap.parse_args(argv)
    if args.backward and args.algorithm == "fa3":
        ap.error("--backward times the backward, which fa3 does not have (it is a forward); drop one")
    from numba_flash import needs

    needs.exit_unless("mask_gallery.py", needs.gpu(), needs.module("cupy"), needs.module("torch"))
    import torch
    import torch.nn.functional as F

    import numba_flash
    from numba_flash.backward import attention_backward

    n = args.seq
    dt = getattr(torch, args.dtype)
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(1, args.heads, n, args.head_dim, device="cuda", generator=gen).to(dt) for _ in range(3))
    do = torch.randn(q.shape, device="cuda", generator=gen).to(dt)
    rows, causal_ms, causal_pairs, uncapped_ms = [], None, n * (n + 1) // 2, {}
    for name, kwargs, window in entries(n):
        if args.only and name not in ("no mask", "causal") and not any(s in name for s in args.only):
            continue
        t0 = time.time()
        status = check(kwargs, window, args.dtype, args.backward, n, torch, args.algorithm)
        documents = kwargs.get("mask_mod") == "documents"
        mod_causal = kwargs.get("mask_mod") == "causal"
        kwargs = with_documents(resolved(kwargs, args.heads, torch), n, torch)
        pairs = _pairs((-1, 0) if mod_causal else window, n) if not documents else int(document_visible(n, torch).sum())
        ms = median_ms(lambda kw=kwargs: numba_flash.attention(q, k, v, algorithm=args.algorithm, **kw), torch)
        row = dict(mask=name, check=status, ms=ms, visible=pairs / (n * n),
                   tflops=4 * args.head_dim * args.heads * pairs / ms / 1e9)
        capped = any(m in kwargs for m in MODS)
        if name == "causal":
            causal_ms = ms
        if mod_causal:  # issue 24: within 5% of the built-in causal=True
            row["vs_builtin"] = ms / causal_ms
        if "mask_mod" in kwargs:  # FlexAttention on the same mask, same run
            row["flex_ms"] = flex_ms(kwargs, q, k, v, n, torch)
        if capped:  # issue 24: softcap and ALiBi within 10% of the same call without them
            row["mod_cost"] = ms / uncapped_ms[window]
        elif "mask_mod" not in kwargs:
            uncapped_ms[window] = ms
            if causal_ms is not None and window is not None:  # issue 24: <= 1.2
                row["cost_rule"] = ms / (pairs / causal_pairs * causal_ms)
        if window == (-1, 0) and not capped:
            row["sdpa_causal_ms"] = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), torch)
        if (window is not None or documents) and not capped and "block_mask" not in kwargs:
            try:
                seen = document_visible(n, torch) if documents else visible(window, n, n, torch, "cuda")[0]
                row["sdpa_dense_mask_ms"] = median_ms(lambda m=seen: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                                                      torch)
                del seen
            except Exception as e:  # noqa: BLE001 -- a peer that cannot run is reported, not fatal
                row["sdpa_dense_mask_ms"] = f"failed: {type(e).__name__}"
        if args.backward and "mask_mod" not in kwargs:  # (a user's mods: the backward is timed without them here)
            o, lse = numba_flash.attention(q, k, v, return_lse=True, algorithm=args.algorithm, **kwargs)
            row["backward_ms"] = median_ms(
                lambda o=o, lse=lse, kw=kwargs: attention_backward(do, q, k, v, o, lse, **kw), torch)
        rows.append(row)
        print(f"[{time.time() - t0:6.1f} s] {json.dumps(row)}", file=sys.stderr, flush=True)
    print(f"\nB1 H{args.heads} N{n} D{args.head_dim} {args.dtype} {args.algorithm} ({torch.cuda.get_device_name()})\n")
    cols = ["mask", "check", "visible", "ms", "tflops", "cost_rule", "mod_cost", "vs_builtin", "sdpa_causal_ms",
            "sdpa_dense_mask_ms", "flex_ms"]
    if args.backward:
        cols.append("backward_ms")
    print("| " + " | ".join(cols) + " |")
    print("|" + " --- |" * len(cols))
    for r in rows:
        print("| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(shape=[1, args.heads, n, args.head_dim], dtype=args.dtype, algorithm=args.algorithm,
                           device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return 0 if all(r["check"] == "ok" for r in rows) else 1


def _pairs(window, n) -> int:
    from numba_flash.masking import MaskSpec

    return MaskSpec(*(window or (-1, -1))).visible_pairs(n, n)


def _fmt(x) -> str:
    return f"{x:.3f}" if isinstance(x, float) else str(x)


if __name__ == "__main__":
    sys.exit(main())
