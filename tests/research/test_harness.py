"""numba_flash.research.harness, the measurement of compare, ablate and scripts/bench.py, in
whichever world this machine has (the simulator in CI: errors and launch shapes, no timings);
and the table writer of numba_flash.research.report that their reports share."""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash._world import simulated
from numba_flash.research import harness
from numba_flash.research.report import markdown_table


def test_check_scope():
    # The default budget is 16 GB: 4*16*4096*4096*8 = 8.6 GB (the research shape) fits;
    # 4*16*8192*8192*8 = 34 GB does not, one head (0.5 GB) does.
    assert harness.check_scope(4, 16, 4096, 4096) == (True, 4096, "all")
    assert harness.check_scope(4, 16, 8192, 8192) == (False, 8192, "head 0")
    # One head at N=131072 is 137 GB: the last 16e9 // (131072*8) = 15258 query rows.
    assert harness.check_scope(1, 8, 131072, 131072) == (False, 15258, "head 0, last 15258 rows")
    # The rows a budget holds are counted in keys: 1000 // (10*8) = 12 of 20 queries against 10 keys.
    assert harness.check_scope(1, 2, 20, 10, budget=1000) == (False, 12, "head 0, last 12 rows")


@pytest.mark.parametrize("budget, scope", [(harness.REF_BUDGET_BYTES, "all"), (24 * 8 * 5, "head 0, last 5 rows")])
def test_measure_checks_the_scoped_rows_against_their_reference(monkeypatch, budget, scope):
    """The checked part of o lines up with the reference of that part: the last query rows of
    head 0 under a causal mask with more keys than queries (bottom-right aligned)."""
    monkeypatch.setattr(harness, "REF_BUDGET_BYTES", budget)
    p = harness.describe(2, 2, 12, 4, causal=True, seq_k=24, block_m=4, block_n=4)
    problem = harness.make_problem(p, seed=1)
    row = harness.measure(problem, "fa2", repeats=1)
    assert row["rel_err_scope"] == scope and row["status"] == "ok"
    assert row["rel_err"] < 1e-5 and row["max_abs_err"] < 1e-5


def test_errors_read_only_the_checked_part(monkeypatch, xp):
    """Garbage outside the checked rows does not count; inside them it does."""
    from numba_flash import reference

    monkeypatch.setattr(harness, "REF_BUDGET_BYTES", 16 * 8 * 6)  # head 0, its last 6 of 16 rows
    problem = harness.make_problem(harness.describe(1, 2, 16, 4), seed=0)
    o = xp.asarray(reference.attention(problem["q"], problem["k"], problem["v"])[0])
    o[0, 1] = 1e3  # head 1
    o[0, 0, :10] = 1e3  # head 0, the rows before the checked ones
    assert harness._errors(o, problem)["rel_err"] < 1e-12
    o[0, 0, -1] += 1.0
    assert harness._errors(o, problem)["max_abs_err"] == pytest.approx(1.0)


@pytest.mark.skipif(not simulated(), reason="the simulator's reference is NumPy's, the one patched here")
def test_a_reference_that_cannot_be_built_fails_the_kernel_rows_only(monkeypatch):
    import numba_flash.reference

    def out_of_memory(*args, **kwargs):
        raise MemoryError("no room for S")

    problem = harness.make_problem(harness.describe(1, 1, 8, 4, block_m=4, block_n=4), seed=0)
    monkeypatch.setattr(numba_flash.reference, "attention", out_of_memory)
    assert harness.measure_or_fail(problem, "fa2", repeats=1)["status"] == "failed: MemoryError: no room for S"
    monkeypatch.undo()
    assert harness.measure_or_fail(problem, "fa2", repeats=1)["status"] == "ok"  # built on the next kernel's row


def test_a_measured_row_has_the_keys_of_new_row():
    p = harness.describe(1, 2, 8, 4, block_m=4, block_n=4)
    problem = harness.make_problem(p, seed=0)
    measured = harness.measure(problem, "fa1", repeats=1)
    assert measured.keys() == harness.new_row(p, "fa1").keys()
    assert (measured["impl"], measured["algorithm"], measured["block_m"], measured["blocks"]) == ("fa1", "fa1", 4, 2)
    assert measured["modelled_bytes"] > 0 and measured["smem_bytes"] > 0
    if problem["sim"]:
        assert measured["ms"] is None and measured["regs"] is None


def test_measure_or_fail_makes_the_failure_the_status():
    problem = harness.make_problem(harness.describe(1, 1, 8, 4, block_m=3), seed=0)
    with pytest.raises(ValueError, match="block_m=3"):
        harness.measure(problem, "fa2", repeats=1)
    row = harness.measure_or_fail(problem, "fa2", repeats=1)
    assert row["status"].startswith("failed: ValueError: block_m=3") and row["ms"] is None
    assert (row["impl"], row["seq"], row["head_dim"]) == ("fa2", 8, 4)


def test_a_peer_not_available_here_fails_in_its_row(monkeypatch):
    import numba_flash.baselines

    monkeypatch.setattr(numba_flash.baselines, "torch_sdpa_backends", lambda dtype: {})
    problem = harness.make_problem(harness.describe(1, 1, 8, 4), seed=0)
    row = harness.measure_or_fail(problem, "torch-flash", repeats=1)
    assert row["status"] == "failed: ValueError: no peer 'torch-flash' for float32 here (torch SDPA backends: none)"


def test_inputs_are_standard_normal_and_seeded():
    p = harness.describe(1, 2, 64, 8, seq_k=32, kv_heads=1)
    a, b, c = (harness.make_problem(p, seed) for seed in (3, 3, 4))
    q, q_again, q_other = (x["q"] if x["sim"] else x["q"].get() for x in (a, b, c))
    assert q.shape == (1, 2, 64, 8) and a["k"].shape == (1, 1, 32, 8)
    assert abs(q.mean()) < 0.2 and 0.8 < q.std() < 1.2
    assert np.array_equal(q, q_again) and not np.array_equal(q, q_other)
    assert a["flops"] == 4 * 2 * 64 * 32 * 8


def test_time_ratio():
    assert harness.time_ratio({"ms": 4.0}, {"ms": 1.0}) == 4.0
    assert harness.time_ratio({"ms": None}, {"ms": 1.0}) is None
    assert harness.time_ratio(None, {"ms": 1.0}) is None


def test_markdown_table_pads_labels_left_and_figures_right():
    lines = markdown_table(["", "FA-1", "FA-2"], [["time (ms)", "12.5", "1.25"], ["regs", "128", "n/a (simulator)"]])
    assert lines == [
        "|           | FA-1 |            FA-2 |",
        "|-----------|-----:|----------------:|",
        "| time (ms) | 12.5 |            1.25 |",
        "| regs      |  128 | n/a (simulator) |",
    ]


def test_measure_reports_the_split_that_ran(monkeypatch):
    """FA-2 rows run attention's split-KV heuristic and say which count ran: with the SMs of an
    H200 a 2-Q-tile problem with 8 K/V tiles splits, its grid counts every split's blocks, and
    the result still matches the reference."""
    import numba_flash.split_kv as split_kv

    monkeypatch.setattr(split_kv, "multiprocessors", lambda device_id: 132)
    p = harness.describe(1, 1, 8, 4, seq_k=32, block_m=4, block_n=4)
    problem = harness.make_problem(p, seed=2)
    row = harness.measure(problem, "fa2", repeats=1)
    splits = split_kv.num_splits_heuristic(2, 132, split_kv.resident_blocks(row["threads"], row["smem_bytes"]), 8)
    assert splits > 1 and row["num_splits"] == splits
    assert row["blocks"] == 2 * splits and row["rel_err"] < 1e-5
    assert harness.measure(problem, "fa1", repeats=1)["num_splits"] == 1


def test_gradient_scope():
    # 2*4*64*64*8 = 262 KB fits the default budget: everything.
    assert harness.gradient_scope(2, 4, 2, 64, 64)[2] == "all"
    # Over a budget: batch 0, kv head 0 and its group of query heads (dK, dV need every query row).
    q_part, kv_part, label = harness.gradient_scope(2, 4, 2, 64, 64, budget=2 * 64 * 64 * 8)
    assert label == "batch 0, kv head 0" and q_part == (slice(0, 1), slice(0, 2)) and kv_part == (slice(0, 1), slice(0, 1))
    assert harness.gradient_scope(2, 4, 2, 64, 64, budget=64 * 64 * 8) is None  # one group does not fit


@pytest.mark.parametrize("algorithm", ["fa1", "fa2"])
def test_backward_row_checks_gradients(algorithm):
    """--backward: each kernel's gradients against float64 (GQA, causal, lengths off the tiles)."""
    p = harness.describe(1, 4, 9, 4, causal=True, kv_heads=2, seq_k=13, block_m=4, block_n=4)
    row = harness.measure(harness.make_problem(p, seed=3), algorithm, repeats=1, backward=True)
    assert row["grad_rel_err_scope"] == "all" and row["grad_rel_err"] < 1e-5
    assert row["bwd_ms"] is None  # no timings in the simulator


def test_backward_row_catches_a_wrong_gradient(monkeypatch):
    """A backward whose dK is off by 1% shows in the row's gradient error."""
    import numba_flash.backward as backward

    real = backward.attention_backward

    def off_by_one_percent(*args, **kwargs):
        dq, dk, dv = real(*args, **kwargs)
        return dq, dk * 1.01, dv

    monkeypatch.setattr(backward, "attention_backward", off_by_one_percent)
    p = harness.describe(1, 2, 8, 4, block_m=4, block_n=4)
    row = harness.measure(harness.make_problem(p, seed=4), "fa2", repeats=1, backward=True)
    assert 0.005 < row["grad_rel_err"] < 0.02


def test_upstream_gradient_is_seeded_and_kept():
    p = harness.describe(1, 1, 8, 4, block_m=4, block_n=4)
    a, b = harness.make_problem(p, seed=5), harness.make_problem(p, seed=5)
    do = harness.upstream_gradient(a)
    assert harness.upstream_gradient(a) is do and np.array_equal(do, harness.upstream_gradient(b))
    assert do.shape == a["q"].shape and not np.array_equal(do, a["q"])
