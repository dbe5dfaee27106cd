"""``numba_flash.torch`` as PyTorch custom operators on a real GPU (``pytest -m gpu``; skipped in
the simulator and without PyTorch): ``torch.compile`` (default and ``fullgraph=True``) of a small
causal transformer trains with eager's losses and no graph break at our operator, and forward,
backward and decode captured in CUDA graphs (torch and CuPy) replay new inputs as eager runs them."""

from __future__ import annotations

import math

import numpy as np
import pytest

try:  # not importorskip at module level: tests/test_profiles.py imports every test module
    import torch
except ImportError:
    torch = None

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch is None, reason="needs torch")]


def _model(seed: int, dim: int = 128, heads: int = 4, layers: int = 2):
    """A two-layer pre-norm causal transformer whose attention is ``numba_flash.torch.attention``."""
    import numba_flash.torch as nft

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
            self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

        def forward(self, x):
            B, N, _ = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(B, N, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
            o = nft.attention(q, k, v, causal=True)
            x = x + self.proj(o.transpose(1, 2).reshape(B, N, dim))
            return x + self.mlp(self.norm2(x))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(64, dim)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))
            self.head = torch.nn.Linear(dim, 64)

        def forward(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    torch.manual_seed(seed)
    return Model().cuda()


def _train(model, steps: int, tokens) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64).float(), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


@pytest.fixture(autouse=True)
def _fresh_inductor_cache(tmp_path, monkeypatch):
    """Inductor's on-disk graph cache does not key on a custom operator's fake implementation:
    graphs compiled against an older one would be reused. A fresh folder per test."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()


@pytest.mark.parametrize("fullgraph", [False, True])
def test_compiled_transformer_trains_with_eager_losses(fullgraph):
    g = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, 64, (2, 97), device="cuda", generator=g)
    eager = _train(_model(0), 4, tokens)
    compiled_model = _model(0)
    compiled_model.forward = torch.compile(compiled_model.forward, fullgraph=fullgraph)
    compiled = _train(compiled_model, 4, tokens)
    assert all(math.isfinite(x) for x in eager) and eager[-1] < eager[0]
    np.testing.assert_allclose(compiled, eager, rtol=2e-4, atol=1e-5)  # (fused LayerNorm/GELU round otherwise)


def test_explain_finds_no_graph_break():
    import numba_flash.torch as nft

    q, k, v = (torch.randn(1, 2, 100, 64, device="cuda", requires_grad=True) for _ in range(3))

    def f(q, k, v):
        return (nft.attention(q, k, v, causal=True) * 2).sum()

    torch._dynamo.reset()
    explained = torch._dynamo.explain(f)(q, k, v)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    ops = [str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert any("numba_flash.attention_forward" in o for o in ops), ops


def test_torch_cuda_graph_replays_forward_backward_and_decode_with_new_inputs():
    import numba_flash
    import numba_flash.torch as nft

    shape = (2, 4, 130, 64)
    static = [torch.randn(shape, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3)]
    kc, vc = (torch.randn(2, 2, 500, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    qd = torch.randn(2, 4, 1, 64, device="cuda", dtype=torch.float16)
    lens = torch.tensor([500, 321], dtype=torch.int32, device="cuda")

    def step():
        for x in static:
            x.grad = None
        o = nft.attention(*static, causal=True)
        o.float().square().sum().backward()
        return o, nft.decode(qd, kc, vc, cache_seqlens=lens)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles, fills the plan caches
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, od_g = step()
    grads_g = [x.grad for x in static]
    for seed in (5, 6):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        with torch.no_grad():
            for x in [*static, qd, kc, vc]:
                x.copy_(torch.randn(x.shape, device="cuda", generator=gen))
            lens.copy_(torch.tensor([seed * 50, 499], dtype=torch.int32))
        graph.replay()
        fresh = [x.detach().clone().requires_grad_() for x in static]
        o = numba_flash.torch.attention(*fresh, causal=True)
        o.float().square().sum().backward()
        od = numba_flash.decode(qd, kc, vc, cache_seqlens=lens)
        torch.cuda.synchronize()
        assert torch.equal(o_g, o) and torch.equal(od_g, od)
        for got, x in zip(grads_g, fresh):
            torch.testing.assert_close(got, x.grad, rtol=1e-3, atol=1e-3)  # (dQ sums by atomics: order varies)


def test_cupy_graph_replays_forward_with_new_inputs():
    cp = pytest.importorskip("cupy")
    import numba_flash
    from numba_flash.api import forward  # (out=, lse_out=: nothing allocated while capturing)

    rng = cp.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, 4, 200, 64), dtype=cp.float32) for _ in range(3))
    out = cp.empty_like(q)
    lse = cp.empty(q.shape[:3], dtype=cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        forward(q, k, v, causal=True, out=out, lse_out=lse)  # warm-up: compile, plan
        stream.begin_capture()
        forward(q, k, v, causal=True, out=out, lse_out=lse)
        graph = stream.end_capture()
    for seed in (1, 2):
        fresh = cp.random.default_rng(seed)
        with stream:  # (a non-blocking stream: the new inputs written on it, before the replay)
            for x in (q, k, v):
                x[...] = fresh.standard_normal(x.shape, dtype=cp.float32)
            out.fill(cp.nan)
            graph.launch()
        stream.synchronize()
        want, want_lse = numba_flash.attention(q, k, v, causal=True, return_lse=True)
        assert cp.array_equal(out, want) and cp.array_equal(lse, want_lse)
