"""scripts/decode_sweep.py without a GPU: its arguments, and (on the fake GPU of
``tests/fake_gpu.py``) that a candidate launches what ``numba_flash.decode`` launches for the
same configuration, so that its timings stand for the library's kernels."""

from __future__ import annotations

import argparse
import sys

import fake_gpu
import pytest
from helpers import load_script

import numba_flash
from numba_flash import plans


@pytest.fixture(scope="module")
def sweep():
    return load_script("decode_sweep.py", "decode_sweep_script")


def test_candidates_parse(sweep):
    assert sweep.candidate("64:walk:auto") == (64, "walk", None, 1, 1)
    assert sweep.candidate("32:indexed:63:4") == (32, "indexed", 63, 4, 1)
    assert sweep.candidate("64:walk:32:2:4") == (64, "walk", 32, 2, 4)
    for bad in ("48:walk:auto", "64:fast:auto", "64:walk:0", "64:walk", "64:walk:auto:0", "64:walk:auto:1:4",
                "32:walk:auto:2:4", "64:walk:auto:2:3"):
        with pytest.raises(argparse.ArgumentTypeError):
            sweep.candidate(bad)
    assert all(c[3] >= 1 for c in sweep.parse_args([]).candidates)


@pytest.mark.parametrize("cache", [4096, 131072])
def test_a_candidate_launches_what_decode_launches(sweep, monkeypatch, cache):
    record = fake_gpu.install(monkeypatch.setattr, monkeypatch.setitem)
    cupy = sys.modules["cupy"]
    for name in ("float16", "float32", "uint16"):
        monkeypatch.setattr(cupy, name, name, raising=False)
    plans.clear()
    try:
        q = fake_gpu.cupy_array((1, 32, 1, 128), "float16")
        k, v = (fake_gpu.cupy_array((1, 8, cache, 128), "float16") for _ in range(2))
        seqlens = fake_gpu.cupy_array((1,), "int32")
        library = fake_gpu.launches(record, lambda: numba_flash.decode(q, k, v, cache_seqlens=seqlens, return_lse=True))
        from numba_flash.tile_table import (
            DECODE_BLOCK_N,
            DECODE_KEY_WARP_STAGES,
            DECODE_KEY_WARPS,
        )

        c = sweep.Candidate(DECODE_BLOCK_N, "walk", None, DECODE_KEY_WARP_STAGES, DECODE_KEY_WARPS, q, k, v, seqlens,
                            128**-0.5)

        def run():
            c()
            return c.o, c.lse

        assert fake_gpu.launches(record, run) == library
        assert len(library[0]) == (2 if c.splits > 1 else 1)
    finally:
        plans.clear()
        fake_gpu.clear_host_caches()
