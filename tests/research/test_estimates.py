"""What the research commands say they will take without a GPU, and what they refuse: a
simulated run over ``compare.REFUSE_SECONDS`` only with ``--force``; the backward in
``compare --backward``'s estimate; ``occupancy``'s estimate and progress in words."""

from __future__ import annotations

import argparse

import pytest

from numba_flash._world import simulated
from numba_flash.research.cli import main

pytestmark = pytest.mark.skipif(not simulated(), reason="estimates of Numba's CUDA simulator (no GPU)")


class Started(Exception):
    """The command went on to make its inputs."""


def _default_problem(**flags):
    from numba_flash.research.compare import problem_of

    blank = dict(batch=None, heads=None, kv_heads=None, seq=None, seq_k=None, head_dim=None, block_m=None,
                 block_n=None, causal=False, dtype="float32", precision="default")
    return problem_of(argparse.Namespace(**{**blank, **flags}))


@pytest.mark.parametrize("command", ["compare", "ablate"])
def test_a_run_of_hours_is_refused_before_any_work_unless_forced(command, monkeypatch, capsys):
    from numba_flash.research import compare

    def started(*args):
        raise Started

    monkeypatch.setattr(compare, "make_problem", started)
    argv = [command, "--batch", "4", "--heads", "16", "--seq", "4096", "--head-dim", "64"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "hours in Numba's CUDA simulator" in err and "--force" in err, err
    with pytest.raises(Started):
        main([*argv, "--force"])


def test_the_backward_is_in_compare_backwards_estimate():
    """compare --backward runs each loop order's backward after its forward; the backward (float32:
    split-precision tensor cores, five products per tile pair) takes 3-4x the forward in the
    simulator, and grows with the problem as the forward does."""
    from numba_flash.research.compare import simulated_seconds
    from numba_flash.simulator import estimate_backward_seconds

    p = _default_problem()
    assert simulated_seconds(p, backward=True) > 3 * simulated_seconds(p)
    assert simulated_seconds(_default_problem(dtype="float16"), backward=True) < simulated_seconds(p, backward=True)
    small = estimate_backward_seconds("f16", 1, 1, 64, 64, 64, 16, 16)
    assert estimate_backward_seconds("f16", 1, 1, 128, 128, 64, 16, 16) > 3.5 * small
    assert estimate_backward_seconds("f16", 1, 1, 128, 128, 64, 16, 16, causal=True) < 2.5 * small
    assert estimate_backward_seconds("tf32x3", 1, 1, 64, 64, 64, 16, 16) > 2 * small


def test_ablate_estimates_each_variant_at_its_own_loop_order(monkeypatch):
    """q_outer variants run FA-2's grid (a block per Q tile), kv_outer ones FA-1's."""
    from numba_flash.research import compare

    seen = []

    def estimate(p, algorithms, backward=False):
        seen.append(algorithms)
        raise Started

    monkeypatch.setattr(compare, "simulated_seconds", estimate)
    with pytest.raises(Started):
        main(["ablate", "--variants", "fa1", "fa2", "--seq", "8", "--head-dim", "4"])
    assert seen == [("fa1", "fa2", "fa1", "fa1", "fa1")]  # and the path's three kv_outer points


def test_occupancy_says_how_long_and_what_each_configuration_gave(monkeypatch, capsys):
    from numba_flash.research.profiling import occupancy

    def fake_row(cfg, cc):  # what _ptxas_row gives, without compiling
        return dict(cfg, threads=128, regs=96, smem_bytes=18432, local_bytes=0, blocks_per_sm=4, warps_per_sm=16,
                    occupancy=0.25, limiter="registers", source="ptxas sm_90")

    monkeypatch.setattr(occupancy, "missing_toolchain", lambda: [])
    monkeypatch.setattr(occupancy, "_ptxas_row", fake_row)
    assert main(["occupancy", "--source", "ptxas", "--head-dim", "64", "--block-m", "64", "--block-n", "32",
                 "--dtype", "float16", "--causal"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("numba-flash occupancy: 2 kernel configurations, compiled for sm_90 by numba and ptxas (no GPU), "
                      f"about {occupancy.ptxas_seconds(2):.0f} s")
    assert err[1].startswith("numba-flash occupancy: [1/2] fa1 D=64 float16, tensor cores (f16), 64 x 32, causal: "
                             "96 registers, 18432 B shared, occupancy 25.0% (")
    assert len(err) == 3 and "{" not in "".join(err)
