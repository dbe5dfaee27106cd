"""Proof of the loop order (issue 10): the kernels' global-memory traffic, counted, against the model.

In the simulator every element a kernel reads or writes through an array argument is recorded
(``numba_flash.research.profiling.counting``), so two things can be checked exactly, per variant:

- the bytes read and written of each array (Q, K, V, O, the logsumexp, FA-1's l and m) equal
  ``traffic.traffic_breakdown`` (requests: one per distinct element per warp and barrier
  epoch, as a GPU's broadcast loads count);
- the tiles each block read, in order, are the loop nest of the algorithm: FA-1 (one block per
  head) K_j V_j, then every Q_i that sees K_j, for j in ``kv_tile_order``; FA-2 (one block per
  Q tile) Q_i, then each K_j V_j it sees, in ``kv_tile_order``.

Output values cannot tell the loop orders apart (both are exact attention, and invariant under
the K/V tile order), so the tests at the end run mutated variants -- the FA-2 kernel launched
where FA-1 is asked for, and kernels that ignore ``kv_tile_order`` -- and show that their
outputs still pass while these checks fail.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import examples, random_qkv
from hypothesis import given, settings
from hypothesis import strategies as st

from numba_flash import api, kernels, reference
from numba_flash._world import simulated
from numba_flash.research.profiling.counting import count_traffic
from numba_flash.research.profiling.traffic import traffic_breakdown, traffic_bytes

needs_simulator = pytest.mark.skipif(not simulated(), reason="counts element accesses of kernels run as Python (simulator)")

INDEX_ARGS = ("kv_order", "seqlens")  # tile order and lengths: a few int32 reads, not modelled


def run_counted(algorithm, q, k, v, block_m, block_n, causal, order=None, precision="ieee", variant=None):
    with count_traffic() as log:
        o, lse = api.forward(q, k, v, algorithm=algorithm, precision=precision, block_m=block_m, block_n=block_n,
                             causal=causal, kv_tile_order=order, num_splits=1,  # the model is of one unsplit walk
                             variant=variant)
    return log.only(), o, lse


def counted_roles(launch, cast: bool = False) -> dict:
    """{role: (bytes read, bytes written)} of one launch, roles named as in the model."""
    roles = {}
    # Every variant of the skeleton (kernels.forward) takes o_hbm, l_hbm, m_hbm; those that keep
    # the state on chip (q_outer) never touch them, and kv_outer ones keep O in o_hbm.
    state_in_hbm = "o_hbm" in launch.arrays and launch.read_bytes("o_hbm") + launch.write_bytes("o_hbm") > 0
    for name in launch.arrays:
        if name in INDEX_ARGS:
            continue
        role = {"l_hbm": "l", "m_hbm": "m"}.get(name, name)
        if name == "o_hbm":
            role = "o_acc" if cast else "o"
        elif name == "o" and state_in_hbm and not cast:
            role = "o (placeholder, never touched)"
        rw = (launch.read_bytes(name), launch.write_bytes(name))
        if rw != (0, 0):
            roles[role] = rw
    return roles


def last_key(row, n_q, n_k, causal):
    return min(n_k - 1, row + n_k - n_q) if causal else n_k - 1


def expected_traces(algorithm, shape, block_m, block_n, causal, order, variant=None):
    """Each block's (name, b, h, tile) reads, in order, as the algorithm's (or the variant's)
    loop nest makes them."""
    B, H, Hk, n_q, n_k, _ = shape
    n_q_tiles = -(-n_q // block_m)
    order = list(range(-(-n_k // block_n))) if order is None else [int(j) for j in order]

    def sees(i, j):  # does some row of Q tile i see a key of K/V tile j?
        return j * block_n <= last_key(min((i + 1) * block_m, n_q) - 1, n_q, n_k, causal)

    kv_outer = algorithm == "fa1" if variant is None else variant.loop_order == "kv_outer"
    per_tile = algorithm == "fa2" if variant is None else variant.grid == "heads_x_qtiles"
    # the Q tiles of each block: all of its head's, or one
    groups = [[i] for i in range(n_q_tiles)] if per_tile else [list(range(n_q_tiles))]
    traces = []
    for b in range(B):
        for h in range(H):
            hk = h // (H // Hk)
            for tiles in groups:
                trace = []
                if kv_outer:  # K/V outer (line 5), Q inner (line 7)
                    for j in order:
                        if per_tile and not sees(tiles[0], j):
                            continue  # one Q tile per block: only the K/V tiles it sees
                        trace += [("k", b, hk, j), ("v", b, hk, j)]
                        trace += [("q", b, h, i) for i in tiles if sees(i, j)]
                else:  # Q outer, K/V inner
                    for i in tiles:
                        trace += [("q", b, h, i)]
                        for j in order:
                            if sees(i, j):
                                trace += [("k", b, hk, j), ("v", b, hk, j)]
                traces.append(trace)
    return sorted(traces)


def observed_traces(launch, block_m, block_n):
    units = {"q": block_m, "k": block_n, "v": block_n}
    return sorted(launch.read_trace(block, units) for block in np.ndindex(*launch.grid))


def check_loop_nest(launch, algorithm, shape, block_m, block_n, causal, order=None, dtype="float32",
                    tensor_cores=False, variant=None):
    """The launch moved exactly the modelled bytes of every array, and read its tiles in the
    algorithm's (or the variant's) loop order. Raises AssertionError otherwise."""
    B, H, Hk, n_q, n_k, D = shape
    model = traffic_breakdown(algorithm, B, H, Hk, n_q, n_k, D, block_m, block_n, dtype, causal, tensor_cores,
                              variant)
    counted = counted_roles(launch, cast=dtype != "float32" or tensor_cores)
    assert counted == model, f"{launch.kernel} as {algorithm}: counted {counted} != modelled {model}"
    observed = observed_traces(launch, block_m, block_n)
    expected = expected_traces(algorithm, shape, block_m, block_n, causal, order, variant)
    assert observed == expected, f"{launch.kernel} as {algorithm}: tile reads {observed} != loop nest {expected}"


def inputs(shape, seed=0):
    B, H, Hk, n_q, n_k, D = shape
    return random_qkv(np.random.default_rng(seed), B, H, Hk, n_q, n_k, D, np.float32)


def assert_attention(q, k, v, o, lse, causal):
    ref_o, ref_lse = reference.attention(q, k, v, causal=causal)
    np.testing.assert_allclose(o, ref_o, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-4, atol=1e-4)


# (B, H, Hkv, Nq, Nk, D), block_m, block_n, causal, kv_tile_order
CASES = {
    "aligned": ((1, 1, 1, 16, 16, 8), 4, 4, False, None),
    "ragged-lengths": ((1, 1, 1, 13, 10, 5), 8, 4, False, None),
    "causal-nq-gt-nk": ((1, 1, 1, 13, 10, 8), 8, 4, True, None),  # rows with no key; rows idle in a K tile
    "causal-gqa-nk-gt-nq": ((1, 2, 1, 10, 23, 5), 4, 8, True, None),
    "batch2-tall-tiles": ((2, 1, 1, 7, 7, 3), 16, 2, True, None),
    "permuted": ((1, 1, 1, 9, 30, 4), 4, 4, False, [3, 0, 7, 5, 1, 6, 2, 4]),
    "permuted-causal-gqa": ((1, 2, 1, 21, 17, 6), 8, 4, True, [4, 1, 3, 0, 2]),
}


@needs_simulator
@pytest.mark.parametrize("algorithm", ["fa1", "fa2"])
@pytest.mark.parametrize("case", list(CASES))
def test_counted_traffic_is_the_model_and_the_loop_nest(algorithm, case):
    shape, bm, bn, causal, order = CASES[case]
    q, k, v = inputs(shape)
    launch, o, lse = run_counted(algorithm, q, k, v, bm, bn, causal, order)
    check_loop_nest(launch, algorithm, shape, bm, bn, causal, order)
    assert_attention(q, k, v, o, lse, causal)


@needs_simulator
@settings(max_examples=examples(25))
@given(
    algorithm=st.sampled_from(["fa1", "fa2"]),
    heads=st.sampled_from([(1, 1), (2, 1), (2, 2)]),
    n_q=st.integers(1, 24),
    n_k=st.integers(1, 24),
    head_dim=st.integers(1, 9),
    block_m=st.sampled_from([1, 2, 4, 8, 16]),
    block_n=st.sampled_from([1, 2, 4, 8, 16]),
    causal=st.booleans(),
    order_seed=st.one_of(st.none(), st.integers(0, 2**16)),
)
def test_counted_traffic_property(algorithm, heads, n_q, n_k, head_dim, block_m, block_n, causal, order_seed):
    shape = (1, heads[0], heads[1], n_q, n_k, head_dim)
    order = None
    if order_seed is not None:
        order = np.random.default_rng(order_seed).permutation(-(-n_k // block_n))
    q, k, v = inputs(shape)
    launch, _, _ = run_counted(algorithm, q, k, v, block_m, block_n, causal, order)
    check_loop_nest(launch, algorithm, shape, block_m, block_n, causal, order)


@needs_simulator
@pytest.mark.parametrize("algorithm", ["fa1", "fa2"])
@pytest.mark.parametrize("dtype, precision", [("float16", None), ("float32", "tf32")])
@pytest.mark.parametrize("shape, causal", [((1, 1, 1, 20, 37, 16), False), ((1, 2, 1, 37, 20, 16), True)],
                         ids=["nk-gt-nq", "causal-gqa-nq-gt-nk"])
def test_tensor_core_kernels_traffic(algorithm, dtype, precision, shape, causal):
    """The tensor-core kernels (FA-1's O in a float32 buffer, cast at the end) run the same
    loop nests and move the modelled bytes (``tensor_cores=True``)."""
    q, k, v = (x.astype(dtype) for x in inputs(shape))
    launch, _, _ = run_counted(algorithm, q, k, v, 16, 16, causal, precision=precision)
    assert launch.block == (32, 1, 1)  # one warp per 16 query rows: the mma engine's layout
    check_loop_nest(launch, algorithm, shape, 16, 16, causal, dtype=dtype, tensor_cores=True)


def test_model_fa1_causal_hand_count():
    """FA-1's update (lines 11-13) skips a row that sees no key of K_j: no O_i read or
    write, no l_i, m_i write for it (its l_i, m_i are still read, line 8). Nq = Nk = 4, D = 2,
    block_m = 4, block_n = 2, causal, float32: one Q tile, two K/V tiles; row r sees keys <= r.
    K, V once 64; init O, l, m 64. j = 0: Q 32, l, m read 32, all 4 rows update: O 64, l, m 32.
    j = 1: Q 32, l, m read 32, rows 2, 3 update: O 32, l, m 16. Final: l, m read 32, L 16."""
    expected = 64 + 64 + (32 + 32 + 64 + 32) + (32 + 32 + 32 + 16) + 32 + 16
    assert traffic_bytes("fa1", 1, 1, 1, 4, 4, 2, 4, 2, causal=True) == expected
    parts = traffic_breakdown("fa1", 1, 1, 1, 4, 4, 2, 4, 2, causal=True)
    assert parts["o"] == (4 * (4 + 2) * 2, 4 * (4 + 4 + 2) * 2)  # reads 6 rows, writes init + 6 rows
    assert parts["l"] == parts["m"] == (4 * (4 + 4 + 4), 4 * (4 + 4 + 2))
    assert sum(r + w for r, w in parts.values()) == expected


def test_fa1_and_fa2_models_differ_on_these_cases():
    """The checks can only tell the two loop nests apart where the models differ."""
    for shape, bm, bn, causal, _ in CASES.values():
        args = (*shape, bm, bn, "float32", causal)
        assert traffic_breakdown("fa1", *args) != traffic_breakdown("fa2", *args)


# --------------------------------------------------------------------------------------------
# Mutations: variants that run the wrong loop nest or ignore the tile order give the right
# attention, so only these checks can catch them.
# --------------------------------------------------------------------------------------------


def fa2_posing_as_fa1(head_dim, block_m, block_n, causal, permuted=False, cast_out=False):
    """A stand-in for the FA-1 factory that launches the FA-2 kernel (FA-1's launch, FA-2's
    loop nest): what ``KERNEL_FACTORIES["fa1"] = fa2_kernel`` would be if the arguments matched."""
    fa2 = kernels.fa2_kernel(head_dim, block_m, block_n, causal, permuted, False)

    class Launcher:
        def __getitem__(self, config):
            grid, threads = config[:2]

            def launch(q, k, v, o, lse, o_hbm, l_hbm, m_hbm, q_scale, kv_order, seqlens, n_splits, rows_per_query,
                       softcap_log2, alibi):
                n_q_tiles = -(-q.shape[2] // block_m)
                # FA-2 never reads the state arguments: fresh ones (the simulator copies every
                # argument back after a launch, so passing the output twice would undo it)
                unused4, unused3 = np.zeros((1, 1, 1, 1), np.float32), np.zeros((1, 1, 1), np.float32)
                fa2[(n_q_tiles * grid[0],), threads](q, k, v, o if cast_out else o_hbm, lse, unused4, unused3, unused3,
                                                     q_scale, kv_order, seqlens, n_splits, rows_per_query, softcap_log2,
                                                     alibi)

            return launch

    return Launcher()


@needs_simulator
def test_fa2_kernel_run_as_fa1_is_caught(monkeypatch):
    shape, bm, bn, causal, order = CASES["causal-gqa-nk-gt-nq"]
    q, k, v = inputs(shape)
    monkeypatch.setitem(kernels.KERNEL_FACTORIES, "fa1", fa2_posing_as_fa1)
    launch, o, lse = run_counted("fa1", q, k, v, bm, bn, causal, order)
    assert launch.kernel == "forward"  # the skeleton, at the FA-2 point
    assert_attention(q, k, v, o, lse, causal)  # the values cannot tell
    with pytest.raises(AssertionError, match="counted"):
        check_loop_nest(launch, "fa1", shape, bm, bn, causal, order)


def ignoring_order(factory):
    """The factory, but its kernels compiled to walk the K/V tiles in index order whatever
    ``kv_tile_order`` says (the kernel is still handed the order)."""
    def make(head_dim, block_m, block_n, causal, permuted=False, *rest):
        return factory(head_dim, block_m, block_n, causal, False, *rest)

    return make


@needs_simulator
@pytest.mark.parametrize("algorithm", ["fa1", "fa2"])
@pytest.mark.parametrize("case", ["permuted", "permuted-causal-gqa"])
def test_ignored_kv_tile_order_is_caught(monkeypatch, algorithm, case):
    shape, bm, bn, causal, order = CASES[case]
    q, k, v = inputs(shape)
    monkeypatch.setitem(kernels.KERNEL_FACTORIES, algorithm, ignoring_order(kernels.KERNEL_FACTORIES[algorithm]))
    launch, o, lse = run_counted(algorithm, q, k, v, bm, bn, causal, order)
    assert_attention(q, k, v, o, lse, causal)  # the values cannot tell
    B, H, Hk, n_q, n_k, D = shape
    model = traffic_breakdown(algorithm, B, H, Hk, n_q, n_k, D, bm, bn, "float32", causal)
    assert counted_roles(launch) == model  # nor can the byte counts: the same tiles, another order
    with pytest.raises(AssertionError, match="loop nest"):
        check_loop_nest(launch, algorithm, shape, bm, bn, causal, order)


# --------------------------------------------------------------------------------------------
# Every point of the ablation space (kernels.forward.Variant): its own bytes and loop nest
# --------------------------------------------------------------------------------------------


def _all_variants():
    import itertools

    from numba_flash.research.ablation import all_variants

    return all_variants()


@needs_simulator
@pytest.mark.parametrize("variant", _all_variants(), ids=lambda v: v.name)
@pytest.mark.parametrize("case", ["causal-nq-gt-nk", "permuted-causal-gqa"])
def test_every_variant_moves_its_bytes_in_its_loop_order(variant, case):
    shape, bm, bn, causal, order = CASES[case]
    q, k, v = inputs(shape)
    algorithm = "fa1" if variant.loop_order == "kv_outer" else "fa2"
    launch, o, lse = run_counted(algorithm, q, k, v, bm, bn, causal, order, variant=variant)
    check_loop_nest(launch, algorithm, shape, bm, bn, causal, order, variant=variant)
    assert_attention(q, k, v, o, lse, causal)


@needs_simulator
def test_a_variant_that_runs_another_loop_nest_is_caught():
    """The per-tile kv_outer variant checked against the model and traces of kv_outer per
    head (what a grid switch that did nothing would run): caught."""
    from numba_flash.kernels.forward import Variant

    shape, bm, bn, causal, order = CASES["causal-gqa-nk-gt-nq"]
    q, k, v = inputs(shape)
    per_tile = Variant("kv_outer", "heads_x_qtiles", "every_step")
    launch, o, lse = run_counted("fa1", q, k, v, bm, bn, causal, order, variant=per_tile)
    assert_attention(q, k, v, o, lse, causal)
    with pytest.raises(AssertionError, match="counted"):
        check_loop_nest(launch, "fa1", shape, bm, bn, causal, order, variant=Variant("kv_outer", "heads", "every_step"))


@needs_simulator
def test_the_rescale_switch_of_q_outer_runs_its_own_code():
    """every_step and deferred move the same bytes in the same order (q_outer); every_step sums
    each tile's row sums across the row's threads at every step, deferred once at the end: in
    the simulator each of those sums is two barriers, so the walks differ in barrier count."""
    from numba_flash.kernels.forward import Variant

    shape, bm, bn, causal, order = CASES["aligned"]
    q, k, v = inputs(shape)
    epochs = {}
    for rescale in ("every_step", "deferred"):
        variant = Variant("q_outer", "heads_x_qtiles", rescale)
        launch, o, lse = run_counted("fa2", q, k, v, bm, bn, causal, order, variant=variant)
        assert_attention(q, k, v, o, lse, causal)
        epochs[rescale] = max(epoch for _, _, epoch, _ in launch.touched("o", "w"))
    n_kv_tiles = -(-shape[4] // bn)
    assert epochs["every_step"] - epochs["deferred"] == 2 * n_kv_tiles - 2
