"""``numba_flash.torch.attention`` (autograd) on a real GPU (``pytest -m gpu``; skipped in the
simulator and without PyTorch).

The kernels compute in float32, so ``torch.autograd.gradcheck`` (finite differences in the
inputs' dtype) cannot judge them directly; it is done in its float64-checked form instead:
the analytic gradients of our float32 function are compared with float64 gradients (PyTorch
autograd through a float64 attention, and ``numba_flash.reference.attention_backward``),
the whole Jacobian row by row (one-hot output gradients, as gradcheck builds it) on small
shapes and random output gradients on larger, awkward ones.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import rel_err, to_numpy

from numba_flash import reference

try:  # not importorskip at module level: tests/test_profiles.py imports every test module
    import torch
except ImportError:
    torch = None

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch is None, reason="needs torch")]

ALGORITHMS = ["fa1", "fa2"]
FLOAT32_REL = 1e-4  # norm-wise relative error of float32 gradients against float64

SHAPES = [  # (B, H, Hkv, Nq, Nk, D)
    (2, 4, 2, 97, 130, 40),  # GQA, Nq < Nk
    (1, 4, 1, 130, 97, 64),  # GQA 4:1, Nq > Nk: with causal the first 33 rows see no key
    (2, 2, 2, 256, 256, 128),
    (1, 3, 3, 33, 65, 1),  # D = 1
]


def _ids(shape):
    return "B{}H{}Hkv{}Nq{}Nk{}D{}".format(*shape)


def attention64(q, k, v, causal=False, scale=None):
    """Differentiable float64 attention of torch tensors: GQA by repetition (so autograd sums
    dk, dv over each kv head's query heads), bottom-right causal mask, rows that see no key
    give o = 0 and zero gradients (no NaN)."""
    q, k, v = (x.double() for x in (q, k, v))
    Nq, D, Nk = q.shape[2], q.shape[3], k.shape[2]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = 1 / math.sqrt(D) if scale is None else scale
    s = scale * (q @ k.transpose(-1, -2))
    sees = torch.ones(Nq, Nk, dtype=torch.bool, device=q.device)
    if causal:
        i = torch.arange(Nq, device=q.device)[:, None]
        j = torch.arange(Nk, device=q.device)[None, :]
        sees = j <= i + (Nk - Nq)
    # The row max is a constant of the softmax (it cancels), so it may be detached; masked
    # entries are -inf before exp (weight exactly 0, and masked_fill passes them no gradient).
    m = s.detach().masked_fill(~sees, -math.inf).amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # rows that see no key
    p = torch.exp((s - m).masked_fill(~sees, -math.inf))
    l = p.sum(dim=-1, keepdim=True)  # noqa: E741
    p = p / torch.where(l > 0, l, torch.ones_like(l))
    return p @ v


def _inputs(shape, dtype, seed, requires_grad=True):
    B, H, Hkv, Nq, Nk, D = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tensors = [
        torch.randn(s, device="cuda", generator=gen).to(dtype)
        for s in ((B, H, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D), (B, H, Nq, D))
    ]
    q, k, v, do = tensors
    if requires_grad:
        for x in (q, k, v):
            x.requires_grad_()
    return q, k, v, do


def _grads(q, k, v, do, **kw):
    import numba_flash.torch

    o = numba_flash.torch.attention(q, k, v, **kw)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    return o, (dq, dk, dv)


def _grads64(q, k, v, do, causal=False, scale=None):
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    o64 = attention64(q64, k64, v64, causal=causal, scale=scale)
    return o64, torch.autograd.grad(o64, (q64, k64, v64), do.double())


# --------------------------------------------------------------------------- (a) float32 vs autograd in float64


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_float32_gradients_match_float64_autograd(shape, causal, algorithm):
    q, k, v, do = _inputs(shape, torch.float32, seed=hash((shape, causal)) % 2**31)
    o, grads = _grads(q, k, v, do, causal=causal, algorithm=algorithm)
    o64, grads64 = _grads64(q, k, v, do, causal=causal)
    assert rel_err(o.detach(), to_numpy(o64)) <= FLOAT32_REL
    for got, want, x, name in zip(grads, grads64, (q, k, v), ("dq", "dk", "dv")):
        assert got.dtype == torch.float32 and got.shape == x.shape and got.device == x.device, name
        assert torch.isfinite(got).all(), name
        assert rel_err(got, to_numpy(want)) <= FLOAT32_REL, name
    if causal and shape[3] > shape[4]:  # rows that see no key: exactly zero dq
        assert (grads[0][:, :, : shape[3] - shape[4]] == 0).all()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("loss", ["sum", "squares"])
def test_scale_and_a_loss_through_the_output(loss, algorithm):
    """A non-default scale, ``o`` used through an ordinary loss and ``.backward()`` filling
    ``.grad`` on the leaves. ``o.sum()`` hands the backward an expanded (stride 0, not
    contiguous) output gradient."""
    import numba_flash.torch

    def through(o):
        return o.sum() if loss == "sum" else (o[:, :, ::2] ** 2).sum()

    shape = (2, 4, 2, 50, 70, 32)
    q, k, v, _ = _inputs(shape, torch.float32, seed=11)
    through(numba_flash.torch.attention(q, k, v, causal=True, scale=0.3, algorithm=algorithm)).backward()

    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    through(attention64(q64, k64, v64, causal=True, scale=0.3)).backward()
    for x, x64, name in ((q, q64, "dq"), (k, k64, "dk"), (v, v64, "dv")):
        assert x.grad is not None and x.grad.dtype == torch.float32, name
        assert rel_err(x.grad, to_numpy(x64.grad)) <= FLOAT32_REL, name


# --------------------------------------------------------------------------- (b) gradcheck, float64-checked


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize(
    "shape, causal",
    [((1, 2, 1, 5, 7, 4), True), ((1, 1, 1, 6, 3, 3), True), ((2, 2, 2, 3, 4, 8), False), ((1, 4, 2, 4, 4, 1), True)],
    ids=str,
)
def test_gradcheck_whole_jacobian_against_float64(shape, causal, algorithm):
    """gradcheck's analytic Jacobian, row by row (one vector-Jacobian product per output
    element, one-hot output gradient), against the float64 reference's, with gradcheck's
    elementwise rule ``|got - want| <= atol + rtol |want|`` (its default atol 1e-5, rtol 1e-3)."""
    import numba_flash.torch

    q, k, v, _ = _inputs(shape, torch.float32, seed=sum(shape) + causal)
    o = numba_flash.torch.attention(q, k, v, causal=causal, algorithm=algorithm)
    q64, k64, v64 = (to_numpy(x).astype(np.float64) for x in (q, k, v))
    for flat in range(o.numel()):
        onehot = torch.zeros_like(o).view(-1)
        onehot[flat] = 1.0
        onehot = onehot.view_as(o)
        got = torch.autograd.grad(o, (q, k, v), onehot, retain_graph=True)
        want = reference.attention_backward(to_numpy(onehot), q64, k64, v64, causal=causal)
        for g, w, name in zip(got, want, ("dq", "dk", "dv")):
            g = to_numpy(g).astype(np.float64)
            assert g.shape == w.shape, name
            np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-5, err_msg=f"{name}, output element {flat}")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("seed", range(4))
def test_gradients_match_the_numpy_reference_on_random_shapes(seed, algorithm):
    """Random awkward shapes (GQA, causal, Nq != Nk): float32 analytic gradients against
    ``numba_flash.reference.attention_backward``; that reference also agrees with float64
    autograd (the two oracles are independent)."""
    rng = np.random.default_rng(seed)
    Hkv = int(rng.integers(1, 3))
    shape = (
        int(rng.integers(1, 3)), Hkv * int(rng.integers(1, 4)), Hkv,
        int(rng.integers(1, 150)), int(rng.integers(1, 150)), int(rng.choice([8, 16, 40, 64, 72, 128])),
    )
    causal = bool(rng.integers(0, 2))
    q, k, v, do = _inputs(shape, torch.float32, seed=seed)
    _, grads = _grads(q, k, v, do, causal=causal, algorithm=algorithm)
    want = reference.attention_backward(do, q, k, v, causal=causal)
    _, grads64 = _grads64(q, k, v, do, causal=causal)
    for got, w, w64, name in zip(grads, want, grads64, ("dq", "dk", "dv")):
        np.testing.assert_allclose(to_numpy(w64), w, rtol=1e-10, atol=1e-12, err_msg=name)
        assert rel_err(got, w) <= FLOAT32_REL, (name, shape, causal)


# --------------------------------------------------------------------------- (c) 16-bit inputs


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype_name, bound", [("float16", 1e-2), ("bfloat16", 5e-2)])
def test_16_bit_inputs_give_gradients_of_their_dtype(dtype_name, bound, causal, algorithm):
    """Gradients come back in the inputs' dtype, finite, and near the float64 gradients of the
    same (16-bit) inputs; ``bound`` is a sanity bound (about 20x and 13x the unit roundoff of
    float16 and bfloat16), not an accuracy claim."""
    dtype = getattr(torch, dtype_name)
    shape = (2, 4, 2, 100, 130, 64)
    q, k, v, do = _inputs(shape, dtype, seed=3 + causal)
    o, grads = _grads(q, k, v, do, causal=causal, algorithm=algorithm)
    assert o.dtype == dtype
    _, grads64 = _grads64(q, k, v, do, causal=causal)
    for got, want, x, name in zip(grads, grads64, (q, k, v), ("dq", "dk", "dv")):
        assert got.dtype == dtype and got.shape == x.shape, name
        assert torch.isfinite(got).all(), name
        assert rel_err(got.float(), to_numpy(want)) <= bound, name


def test_non_tensor_inputs_are_refused():
    import numba_flash.torch

    q = np.zeros((1, 1, 2, 4), np.float32)
    with pytest.raises(TypeError, match="q must be a torch tensor"):
        numba_flash.torch.attention(q, q, q)
