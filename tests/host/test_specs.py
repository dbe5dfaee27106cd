"""Launch specifications (``numba_flash.specs``): one description of each kernel's launch, the
one that ``attention``, ``occupancy`` and ``compare`` read; and the occupancy of the tensor-core
kernels without a GPU (ptxas), with their dynamic shared memory counted."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
from helpers import ptxas_available

from numba_flash.arch import SMEM_OPTIN_LIMIT
from numba_flash.kernels.tc_ops import tc_layout
from numba_flash.kernels.tiles import smem_bytes, threads_per_block
from numba_flash.specs import kernel_spec


@pytest.mark.parametrize("algorithm", ["fa1", "fa2"])
@pytest.mark.parametrize("regime, dtype", [("ieee", "float32"), ("ieee", "float16"), ("f16", "float16"), ("bf16", "bfloat16"), ("tf32x3", "float32")])
def test_signature_has_one_type_per_kernel_parameter(algorithm, regime, dtype):
    spec = kernel_spec(algorithm, 40, dtype, 16 if regime != "ieee" else 4, 16, window=True, regime=regime)
    params = inspect.signature(spec.kernel.py_func).parameters
    assert len(spec.signature()) == len(params)


def test_grids_follow_the_loop_orders():
    fa1 = kernel_spec("fa1", 64, "float16", 64, 64, regime="f16")
    fa2 = kernel_spec("fa2", 64, "float16", 64, 64, regime="f16")
    assert fa1.grid(2, 3, 1000) == (6,)  # one block per (batch, head)
    assert fa2.grid(2, 3, 1000) == (16 * 6,)  # one per Q tile of each (batch, head)


def test_shared_memory_and_threads_of_each_regime():
    cc = kernel_spec("fa2", 100, "float32", 32, 16)
    assert (cc.threads, cc.static_smem, cc.dynamic_smem) == (threads_per_block(100, 32, 16), smem_bytes(100, 32, 16), 0)
    tc = kernel_spec("fa2", 100, "float16", 128, 64, regime="f16")
    layout = tc_layout("f16", 104, 128, 64)  # D = 100 is compiled as 104 (16-byte copies)
    assert tc.head_dim == 104 and tc.threads == 256 and tc.dynamic_smem == layout.smem_bytes
    assert tc.dynamic_smem == (128 + 2 * 64) * (112 + 8) * 2  # rows padded by 16 bytes
    split = kernel_spec("fa2", 64, "float32", 64, 32, regime="tf32x3")
    assert split.dynamic_smem == (64 + 2 * 32) * (64 + 4) * 4  # float32 rows padded by 16 bytes
    # tf32x3, D > 64, 128-row Q tiles: Q_i's and V_j's TF32 big/small fragments (two words per
    # element, unpadded) besides the K_j, V_j copies (tc_ops.presplit_operands)
    qv = tc_layout("tf32x3", 128, 128, 32, presplit="qv")
    assert qv.smem_bytes == (2 * 128 * 128 + 2 * 32 * (128 + 4) + 2 * 32 * 128) * 4 == 197632
    assert tc_layout("tf32x3", 128, 128, 32, presplit="qkv").smem_bytes == 230400 <= SMEM_OPTIN_LIMIT
    assert tc_layout("tf32x3", 128, 128, 64).smem_bytes <= SMEM_OPTIN_LIMIT  # "q" dropped: it would not fit
    assert tc_layout("tf32x3", 128, 64, 32).presplit == tc_layout("tf32x3", 64, 128, 32).presplit == ""


@pytest.mark.skipif(not ptxas_available(), reason="needs numba-flash[occupancy] (libNVVM and ptxas)")
def test_occupancy_of_tensor_core_kernels_without_gpu():
    """`numba-flash occupancy --precision default` on float16 profiles the tensor-core kernels:
    threads from the warp count, shared memory = the dynamic tiles, no spills."""
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    out = subprocess.run(
        [sys.executable, "-m", "numba_flash", "occupancy", "--json", "--source", "ptxas", "--algorithm", "fa2",
         "--dtype", "float16", "--head-dim", "64", "--block-m", "64", "--block-n", "64"],
        capture_output=True, text=True, env=env, check=True,
    ).stdout
    (row,) = json.loads(out)
    assert row["precision"] == "f16" and row["threads"] == 128
    assert row["smem_bytes"] >= (64 + 2 * 64) * 72 * 2 and row["local_bytes"] == 0
    assert 1 <= row["blocks_per_sm"] <= 4 and row["regs"] <= 255


def test_bfloat16_on_cuda_cores_is_the_float32_kernel():
    """api widens bfloat16 for the CUDA-core kernels: the spec names the kernel it launches."""
    bf = kernel_spec("fa1", 64, "bfloat16", 4, 4, regime="ieee")
    assert bf.kernel is kernel_spec("fa1", 64, "float32", 4, 4).kernel
    assert bf.signature() == kernel_spec("fa1", 64, "float32", 4, 4).signature()
