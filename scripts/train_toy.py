"""A small training loop on ``numba_flash.torch.attention`` against the same model on PyTorch SDPA (issue 12).

    python scripts/train_toy.py [--steps 600 --json PATH --plot PATH]

The model: a two-layer causal transformer (token + position embeddings, two pre-norm blocks of
multi-head causal self-attention and an MLP, a linear read-out), float32, fitting a toy task
that needs attention to solve: **copying**. Each sequence is ``length`` random tokens, a
separator, and the same tokens again; the model predicts every token of the copy from the ones
before it (next-token cross-entropy over the copy). Without attention across positions it
cannot beat chance (``log(vocab - 1)``); attending ``length + 1`` positions back solves it.

Every backend trains from the same initial weights on the same batches (seeded), with Adam:

- ``numba_flash`` (``numba_flash.torch.attention``, ``algorithm="fa2"``, and ``"fa1"`` with
  ``--fa1``): the kernels under test, forward and backward;
- ``sdpa-efficient``: PyTorch SDPA's memory-efficient backend, the peer;
- ``sdpa-math``: PyTorch SDPA's math backend, also float32. Its distance from the efficient
  backend is the **float32 noise floor**: two correct float32 implementations that round
  differently drift apart step by step once training amplifies the rounding.

It prints each backend's loss every ``--log-every`` steps, and at the end the largest gap
between the loss curves of numba_flash and sdpa-efficient next to the noise floor (math
against efficient), over the whole run and over its first steps, where the drift has not yet
grown. ``--plot`` draws the curves and the gaps (matplotlib). Needs a CUDA GPU and torch.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--steps", type=int, default=600, help="optimizer steps per backend")
    ap.add_argument("--batch", type=int, default=64, help="sequences per batch")
    ap.add_argument("--length", type=int, default=24, help="tokens to copy; the model sees 2 * length + 1")
    ap.add_argument("--vocab", type=int, default=32, help="tokens (token 0 is the separator)")
    ap.add_argument("--width", type=int, default=128, help="model width")
    ap.add_argument("--heads", type=int, default=2, help="attention heads (head dim = width / heads)")
    ap.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    ap.add_argument("--early", type=int, default=50, help="the gap is also reported over the first EARLY steps")
    ap.add_argument("--log-every", type=int, default=50, help="print the losses every this many steps")
    ap.add_argument("--fa1", action="store_true", help="also train with algorithm='fa1'")
    ap.add_argument("--json", metavar="PATH", help="write the loss curves and the gaps as JSON")
    ap.add_argument("--plot", metavar="PATH", help="write the curves and gaps as a PNG")
    return ap


def make_model(torch, vocab: int, width: int, heads: int, length: int, attend):
    """A two-layer pre-norm causal transformer; ``attend(q, k, v)`` is the attention under test."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, heads, width // heads).permute(2, 0, 3, 1, 4)
            a = attend(q.contiguous(), k.contiguous(), v.contiguous())  # (b, heads, n, head_dim)
            x = x + self.proj(a.transpose(1, 2).reshape(b, n, width))
            return x + self.mlp(self.norm2(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(length, width)
            self.blocks = nn.ModuleList([Block(), Block()])
            self.norm, self.out = nn.LayerNorm(width), nn.Linear(width, vocab)

        def forward(self, ids):
            x = self.tokens(ids) + self.positions.weight[: ids.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.out(self.norm(x))  # next-token logits at every position

    return Model()


def copy_batch(torch, generator, batch: int, length: int, vocab: int, device):
    """The copy task: inputs ``x, 0, x[:-1]`` and targets ``x`` at the last ``length`` positions
    (tokens of ``x`` from 1 to ``vocab - 1``; 0 separates)."""
    x = torch.randint(1, vocab, (batch, length), generator=generator)
    ids = torch.cat([x, torch.zeros(batch, 1, dtype=x.dtype), x[:, :-1]], dim=1)
    return ids.to(device), x.to(device)


def train(torch, attend, args, initial_state, device) -> list[float]:
    """Losses of ``args.steps`` Adam steps from ``initial_state`` on the seeded batches."""
    model = make_model(torch, args.vocab, args.width, args.heads, 2 * args.length, attend).to(device)
    model.load_state_dict(initial_state)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(args.seed + 1)  # the same batches for every backend
    losses = []
    for _ in range(args.steps):
        ids, target = copy_batch(torch, generator, args.batch, args.length, args.vocab, device)
        logits = model(ids)[:, args.length:]  # the positions that predict the copy
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab), target.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def largest_gap(a: list[float], b: list[float], steps: int | None = None) -> float:
    """max over steps of |a - b| (the first ``steps`` steps when given)."""
    n = len(a) if steps is None else min(steps, len(a))
    return max(abs(x - y) for x, y in zip(a[:n], b[:n]))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.width % args.heads:
        raise SystemExit("--width must be a multiple of --heads")
    from numba_flash import needs

    needs.exit_unless("train_toy.py" + (" --plot" if args.plot else ""), needs.module("torch"), needs.gpu(),
                      needs.module("matplotlib") if args.plot else None)
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import numba_flash.torch

    if not torch.cuda.is_available():
        raise SystemExit("train_toy.py needs a CUDA GPU")
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 everywhere, as the kernels compute
    torch.backends.cudnn.allow_tf32 = False

    def sdpa(backend):
        def attend(q, k, v):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return attend

    backends = {
        "numba_flash": lambda q, k, v: numba_flash.torch.attention(q, k, v, causal=True, algorithm="fa2"),
        "sdpa-efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
        "sdpa-math": sdpa(SDPBackend.MATH),
    }
    if args.fa1:
        backends["numba_flash-fa1"] = lambda q, k, v: numba_flash.torch.attention(q, k, v, causal=True, algorithm="fa1")

    torch.manual_seed(args.seed)
    initial = make_model(torch, args.vocab, args.width, args.heads, 2 * args.length, None).state_dict()
    initial = {name: t.to(device) for name, t in initial.items()}
    curves = {}
    for name, attend in backends.items():
        t0 = time.perf_counter()
        curves[name] = train(torch, attend, args, initial, device)
        print(f"{name}: {args.steps} steps in {time.perf_counter() - t0:.1f} s (with the first compile); loss {curves[name][0]:.4f} -> "
              f"{curves[name][-1]:.4f} (chance {math.log(args.vocab - 1):.4f})", file=sys.stderr, flush=True)

    print("| step | " + " | ".join(curves) + " |")
    print("|---:|" + "---:|" * len(curves))
    for step in sorted({0, *range(args.log_every - 1, args.steps, args.log_every), args.steps - 1}):
        print(f"| {step + 1} | " + " | ".join(f"{c[step]:.4f}" for c in curves.values()) + " |")
    ref = curves["sdpa-efficient"]
    gaps = {}
    for name, curve in curves.items():
        if name == "sdpa-efficient":
            continue
        gaps[name] = dict(early=largest_gap(curve, ref, args.early), whole=largest_gap(curve, ref))
    print()
    print(f"largest |loss - sdpa-efficient loss|: first {args.early} steps / whole run")
    for name, gap in gaps.items():
        tag = " (the float32 noise floor)" if name == "sdpa-math" else ""
        print(f"- {name}: {gap['early']:.2e} / {gap['whole']:.2e}{tag}")

    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), device=torch.cuda.get_device_name(), curves=curves, gaps=gaps), f, indent=1)
    if args.plot:
        plot(curves, args.plot, args.vocab)
    return 0


def plot(curves: dict, path: str, vocab: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    ref = curves["sdpa-efficient"]
    for name, curve in curves.items():
        top.plot(range(1, len(curve) + 1), curve, label=name, lw=1)
        if name != "sdpa-efficient":
            gap = [abs(a - b) + 1e-12 for a, b in zip(curve, ref)]
            bottom.semilogy(range(1, len(curve) + 1), gap, label=f"{name} vs sdpa-efficient", lw=1)
    top.axhline(math.log(vocab - 1), color="gray", ls=":", lw=1, label="chance")
    top.set_ylabel("cross-entropy loss")
    top.set_title("Copy task, two-layer causal transformer, float32")
    top.legend()
    bottom.set_xlabel("step")
    bottom.set_ylabel("|loss gap|")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
