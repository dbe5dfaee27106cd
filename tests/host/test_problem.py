"""``numba_flash.problem``: the checked description of a call (no tile choice in it), and the
launch configuration ``api.configure`` makes of it. The messages of the checks are tested
through the public functions in ``tests/host/test_attention_errors.py``."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from numba_flash import api, problem
from numba_flash.kernels import KERNEL_FACTORIES
from numba_flash.masking import CAUSAL, FULL


def _qkv(B=2, H=4, Hkv=2, Nq=5, Nk=7, D=8, dtype=np.float32):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((B, H, Nq, D)).astype(dtype), rng.standard_normal((B, Hkv, Nk, D)).astype(dtype),
            rng.standard_normal((B, Hkv, Nk, D)).astype(dtype))


def test_describe_reads_the_shapes_and_options():
    p = problem.describe(*_qkv(), causal=True)
    assert (p.batch, p.heads, p.kv_heads, p.n_q, p.n_k, p.head_dim, p.group) == (2, 4, 2, 5, 7, 8, 2)
    assert p.q_shape == (2, 4, 5, 8) and p.kv_shape == (2, 2, 7, 8)
    assert (p.kind, p.dtype, p.algorithm, p.regime) == ("numpy", "float32", "fa2", "ieee")
    assert p.scale == 1 / math.sqrt(8) and p.mask == CAUSAL and p.causal
    assert problem.describe(*_qkv(), scale=2, algorithm="fa1").mask == FULL
    assert problem.describe(*_qkv(dtype=np.float16)).regime == "f16"
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.n_q = 3


def test_a_problem_has_no_tiles():
    fields = {f.name for f in dataclasses.fields(problem.Problem)}
    assert not any("block" in name or "tile" in name for name in fields)


def test_the_algorithms_are_the_kernels():
    assert problem.ALGORITHMS == tuple(KERNEL_FACTORIES)


@pytest.mark.parametrize("precision, dtype, expected", [(None, "float32", "ieee"), (None, "bfloat16", "bf16"),
                                                        ("ieee", "float16", "ieee"), ("tf32x3", "float32", "tf32x3")])
def test_regime_is_decided_once(precision, dtype, expected):
    assert problem.regime(precision, dtype) == expected


def test_describe_raises_before_tiles_are_chosen():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="algorithm"):
        problem.describe(q, k, v, algorithm="fa3")
    with pytest.raises(TypeError, match="causal"):
        problem.describe(q, k, v, causal=1)
    with pytest.raises(ValueError, match="multiple"):
        problem.describe(q[:, :3], k, v)


def test_configure_adds_the_tiles_and_reads_through():
    p = problem.describe(*_qkv(), causal=True)
    call = api.configure(p, 16, 16, num_splits=1)
    assert (call.block_m, call.block_n, call.num_splits) == (16, 16, 1)
    assert (call.q_shape, call.n_k, call.dtype, call.causal, call.scale, call.kind) == (
        p.q_shape, p.n_k, p.dtype, True, p.scale, "numpy")
    assert call.with_dtype("float16").dtype == "float16" and call.dtype == "float32"
    with pytest.raises(ValueError, match="block_m"):
        api.configure(p, 7, 16)
