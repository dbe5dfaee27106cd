"""The float32 backward on split-precision tensor cores (``kernels.tc_bwd`` with kind
``"tf32x3"``), in the simulator: ``gradients(precision="tf32x3")``, and ``attention_backward``
for float32 (``backward.TF32X3_BACKWARD``, on since the H200 check).

Every loop order against the float64 reference on small awkward shapes: causal with Nq > Nk
(rows that see no key: zero dq), GQA, lengths off a tile multiple, head dims padded to the
k-step (12 -> 16, 20 -> 32, 40 -> 48: two warps split a 16-query group's three dQ chunks), and
tiles of one and two warps either way. The bound is float32's: the simulated products are exact
float32 FMAs, so this checks the fragment layouts, the TF32 A operand of P^T / dS^T from the
accumulators (keys permuted within each 8-key step), dS^T's float32 round trip through shared
memory and the masks, not the TF32 rounding (tests/gpu/test_gpu_backward.py does, at 1e-4).
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from helpers import gradient_error

import numba_flash
from numba_flash import backward, reference
from numba_flash.backward import attention_backward, gradients

TOL = 2e-5  # relative to the largest reference gradient; the simulator measured ~6e-7


def problem(rng, B, H, Hkv, Nq, Nk, D, causal, scale=1.0):
    q = (scale * rng.standard_normal((B, H, Nq, D))).astype(np.float32)
    k = rng.standard_normal((B, Hkv, Nk, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, Nk, D)).astype(np.float32)
    o, lse = numba_flash.attention(q, k, v, causal=causal, return_lse=True, precision="ieee")
    do = rng.standard_normal(o.shape).astype(np.float32)
    return do, q, k, v, o, lse


def check(grads, inputs, causal):
    do, q, k, v = inputs[:4]
    refs = reference.attention_backward(*(x.astype(np.float64) for x in (do, q, k, v)), causal=causal)
    for name, got, ref, x in zip(("dq", "dk", "dv"), grads, refs, (q, k, v)):
        assert got.shape == x.shape and got.dtype == np.float32, name
        assert np.isfinite(got).all(), name
        err = gradient_error(got, ref, refs)
        assert err < TOL, (name, err)


@pytest.mark.parametrize("variant, tiles, shape, causal", [
    (("fa2", False), (16, 16), (1, 2, 1, 21, 6, 8), True),  # GQA; Nq > Nk: 15 rows see no key
    (("fa2", True), (32, 16), (1, 2, 1, 33, 40, 12), True),  # GQA, deterministic dQ kernel, D 12 -> 16
    (("fa1", False), (16, 32), (1, 1, 1, 17, 33, 20), False),  # a K/V tile holding one key (one head: several
    # K/V heads are indexed by the same tc_bwd source for every kind: test_varlen's FA-2 backward, 4 heads on 2)
    (("fa2", False), (16, 32), (1, 1, 1, 17, 32, 40), True),  # two warps split three 16-column dQ chunks
])
def test_tf32x3_gradients_match_float64_reference(variant, tiles, shape, causal):
    algorithm, deterministic = variant
    B, H, Hkv, Nq, Nk, D = shape
    inputs = problem(np.random.default_rng(sum(shape)), B, H, Hkv, Nq, Nk, D, causal, scale=2.0)
    grads = gradients(*inputs, causal=causal, algorithm=algorithm, deterministic=deterministic, precision="tf32x3",
                      tiles=tiles)
    check(grads, inputs, causal)
    if Nq > Nk and causal:
        assert np.isneginf(inputs[5][0, :, : Nq - Nk]).all()
        assert (grads[0][0, :, : Nq - Nk] == 0).all()


def test_switch_routes_float32_and_precision_is_checked():
    """``attention_backward`` runs float32 in tf32x3 (``TF32X3_BACKWARD``, on since the H200
    check), CUDA cores when it is unset; ``precision="tf32x3"`` needs float32 inputs."""
    assert backward.TF32X3_BACKWARD is True
    with mock.patch.object(backward, "TF32X3_BACKWARD", False):
        assert backward.backward_regime(None, "float32") == "ieee"
    assert backward.backward_regime("tf32x3", "float32") == "tf32x3"
    with pytest.raises(ValueError, match="float32"):
        backward.backward_regime("tf32x3", "float16")
    inputs = problem(np.random.default_rng(5), 1, 1, 1, 9, 11, 8, True)
    ran = []
    real_tc = backward._run_tc
    with mock.patch.object(backward, "_run_tc", lambda ctx, call, kind, *a, **kw: ran.append(kind) or real_tc(ctx, call, kind, *a, **kw)), \
            mock.patch.object(backward, "TF32X3_BACKWARD", True):
        assert backward.backward_regime(None, "float32") == "tf32x3"
        grads = attention_backward(*inputs, causal=True)
    assert ran == ["tf32x3"]
    check(grads, inputs, True)


def test_tf32x3_layout_fits_shared_memory(monkeypatch):
    """The tf32x3 default tiles (float32 tiles: twice the bytes of the 16-bit ones) fit a block
    at every head dim up to 128, with the deterministic dQ kernel's."""
    from numba_flash import tile_table
    from numba_flash.kernels import tc_bwd

    monkeypatch.setattr(tile_table, "simulated", lambda: False)  # the GPU's tiles
    monkeypatch.delenv("NUMBA_FLASH_TC_BWD_TILES", raising=False)
    for d in (8, 40, 64, 100, 128):
        bm, bn = tile_table.backward_tc_tiles(d, "tf32x3")
        tc_bwd.check_tc_bwd_tiles("tf32x3", d, bm, bn)
        assert tc_bwd.tc_bwd_layout("fa2", "tf32x3", d, bm, bn).elem_bytes == 4
    assert tc_bwd.tc_bwd_layout("fa2", "tf32x3", 64, 32, 64).stride == 68  # 16 bytes of padding
    assert tc_bwd.tc_bwd_layout("fa2", "tf32x3", 64, 32, 64).ds_stride == 36
