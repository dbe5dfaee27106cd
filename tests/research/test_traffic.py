"""The memory-traffic model against hand counts on small cases."""

from __future__ import annotations

import pytest

from numba_flash.research.profiling.traffic import dram_bytes, traffic_breakdown, traffic_bytes


def test_standard_attention_paper_hand_count():
    # B=1 H=1 Nq=Nk=4 D=2 float32: read Q,K,V 3*4*2*4 = 96; S,P passes 4*16*4 = 256; O 32.
    assert traffic_bytes("standard-paper", 1, 1, 1, 4, 4, 2, 1, 1) == 96 + 256 + 32


def test_cupy_baseline_hand_count():
    """What baselines.cupy_attention does, B=1 H=1 Nq=Nk=4 D=2 float32 (N d = 8 elements of 4 B = 32 B;
    S = 16 elements = 64 B): Q, K, V each copied (read 32, write 32) and read by a matmul (32): 3 * 96;
    S: matmul write, scale read+write, max read, S - m read+write, exp read+write, sum read, matmul
    read = 10 passes = 640; O: matmul write 32, divide read+write 64, cast read+write 64."""
    assert traffic_bytes("standard", 1, 1, 1, 4, 4, 2, 1, 1) == 3 * 96 + 640 + 160
    # causal adds the mask's new array: read S and write it (128); GQA (H=2 on 1 KV head, float16):
    # K repeated (read 16, write 32), widened (read 32, write 64), read by the matmul (64) = 208.
    assert traffic_bytes("standard", 1, 1, 1, 4, 4, 2, 1, 1, causal=True) == 3 * 96 + 640 + 128 + 160
    parts = traffic_breakdown("standard", 1, 2, 1, 4, 4, 2, 1, 1, "float16")
    assert parts["k"] == parts["v"] == (16 + 32 + 64, 32 + 64)


def test_cupy_baseline_model_matches_the_measured_dram_bytes():
    """ncu's DRAM bytes of cupy_attention (docs/data/ncu_h200_2026-11-29.csv, B4 H16 D64 float32,
    N = 1024, 2048, 4096): the pass-by-pass model within 7%, the paper's count at 0.40x."""
    measured = {1024: 2739945472.0, 2048: 11062446592.0, 4096: 43809131520.0}
    for n, dram in measured.items():
        assert 0.99 < traffic_bytes("standard", 4, 16, 16, n, n, 64, 1, 1) / dram < 1.07
        assert 0.39 < traffic_bytes("standard-paper", 4, 16, 16, n, n, 64, 1, 1) / dram < 0.42


def test_fa2_hand_count():
    # Nq=Nk=4, D=2, block_m=2, block_n=2, float32: two Q tiles, each reads its Q (2*2*4=16),
    # all of K and V (2*4*2*4=64), writes O (16) and L (2*4=8): 2 * (16+64+16+8) = 208.
    assert traffic_bytes("fa2", 1, 1, 1, 4, 4, 2, 2, 2) == 208


def test_fa2_causal_skips_masked_tiles():
    # Causal, Nq=Nk=4: Q tile 0 (rows 0-1) sees K tile 0 only; Q tile 1 sees both.
    # Tile 0: 16 + 2*2*2*4 (one K/V tile: 32) + 16 + 8 = 72; tile 1: 16 + 64 + 16 + 8 = 104.
    assert traffic_bytes("fa2", 1, 1, 1, 4, 4, 2, 2, 2, causal=True) == 72 + 104


def test_fa1_hand_count():
    # Nq=Nk=4, D=2, block_m=block_n=2, float32.
    # K,V once: 2*4*2*4 = 64; init O,l,m: 4*(2+2)*4 = 64.
    # 2 K/V tiles x 2 Q tiles = 4 visits, each: Q_i 2*2*4=16, O_i r+w 2*2*2*4=32, l,m r+w 4*2*4=32 -> 80.
    # final pass: read l,m 4*2*4=32, write L 4*4=16.
    assert traffic_bytes("fa1", 1, 1, 1, 4, 4, 2, 2, 2) == 64 + 64 + 4 * 80 + 32 + 16


def test_fa1_float16_adds_the_cast_pass():
    # float16 inputs: K,V 32, Q reads halve (8 per visit); the final cast reads O in float32
    # and writes it in float16: 4*2*(4+2) = 48.
    expected = 32 + 64 + 4 * (8 + 32 + 32) + 32 + 16 + 48
    assert traffic_bytes("fa1", 1, 1, 1, 4, 4, 2, 2, 2, dtype="float16") == expected


def test_scales_with_batch_heads():
    one = traffic_bytes("fa2", 1, 1, 1, 64, 64, 8, 16, 16)
    assert traffic_bytes("fa2", 2, 3, 3, 64, 64, 8, 16, 16) == 6 * one


def test_fa1_moves_more_than_fa2_and_grows_with_sequence():
    """The IO story of the papers: FA-1's O/l/m round trips are quadratic in N / block_n."""
    small = [traffic_bytes(a, 1, 1, 1, 1024, 1024, 64, 128, 32) for a in ("fa1", "fa2")]
    large = [traffic_bytes(a, 1, 1, 1, 4096, 4096, 64, 128, 32) for a in ("fa1", "fa2")]
    assert small[0] > small[1] and large[0] > large[1]
    assert large[0] / small[0] > 10  # ~16x: quadratic


def test_unknown_algorithm():
    with pytest.raises(ValueError, match="algorithm must be"):
        traffic_bytes("fa3", 1, 1, 1, 4, 4, 2, 2, 2)


def test_dram_model_small_working_set_is_compulsory():
    # Everything fits in L2: each input read once, each output written once.
    # fa2, B=H=1, N=4, D=2, fp32: Q 32 + K,V 64 + O 32 + L 16 = 144.
    assert dram_bytes("fa2", 1, 1, 1, 4, 4, 2, 2, 2) == 144
    # fa1 adds l and m written once (2*4*4 = 32) to the same compulsory traffic.
    assert dram_bytes("fa1", 1, 1, 1, 4, 4, 2, 2, 2) == 144 + 32


def test_dram_model_without_cache_is_the_global_model():
    args = ("fa1", 1, 1, 1, 64, 64, 8, 16, 16)
    assert dram_bytes(*args, l2_bytes=0) == traffic_bytes(*args)
    args = ("fa2", 1, 1, 1, 64, 64, 8, 16, 16)
    assert dram_bytes(*args, l2_bytes=0) == traffic_bytes(*args)


def test_dram_model_is_all_or_nothing_at_the_l2_size():
    # fa1 working set: N*(D*(4+4) + 8) = 64*(64+8) = 4608 bytes: a cyclic sweep over it is
    # served from L2 entirely when it fits and not at all when it is one byte larger.
    args = ("fa1", 1, 1, 1, 64, 64, 8, 16, 16)
    assert dram_bytes(*args, l2_bytes=4608) == dram_bytes(*args, l2_bytes=10**9)
    assert dram_bytes(*args, l2_bytes=4607) == traffic_bytes(*args)
