"""``numba-flash ablate`` (issue 10) in the simulator: every variant's row, the JSON contract,
the FA-1 -> FA-2 path and its waterfall, refusals."""

from __future__ import annotations

import json

import pytest

from numba_flash.research.ablation import PATH, all_variants, barriers_per_kv_tile, parse_variant
from numba_flash.research.cli import main
from numba_flash.kernels.forward import FA1, FA2, Variant

JSON_KEYS = {"loop_order", "grid", "rescale", "warp_partition", "o_load", "rel_err", "ms", "tflops"}


def test_json_rows_have_the_contract_keys_and_the_path_is_measured(capsys):
    assert main(["ablate", "--variants", "fa1", "q_outer-heads-deferred", "--seq", "20", "--head-dim", "8",
                 "--block-m", "8", "--block-n", "8", "--json"]) == 0
    out = capsys.readouterr()
    rows = json.loads(out.out)
    names = [r["variant"] for r in rows]
    assert names[:2] == ["fa1", "q_outer-heads-deferred-split_q-at_update"]
    assert all(p.name in names for p in PATH)  # the path's points are added
    for r in rows:
        assert JSON_KEYS <= set(r) and r["ms"] is None and r["tflops"] is None  # no timings in the simulator
        assert r["rel_err"] < 1e-5
    fa1, fa2 = (next(r for r in rows if r["variant"] == n) for n in ("fa1", "fa2"))
    assert fa1["modelled_bytes"] > fa2["modelled_bytes"]  # the O, l, m round trips
    assert "one factor at a time" in out.err and "loop_order: kv_outer -> q_outer" in out.err


def test_table_and_waterfall(capsys, tmp_path):
    assert main(["ablate", "--variants", "fa1", "--seq", "16", "--head-dim", "4", "--block-m", "8", "--block-n", "8",
                 "--plot", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| loop order" in out and "kv_outer" in out and "q_outer" in out
    assert (tmp_path / "ablation_waterfall.png").stat().st_size > 1000


def test_float16_runs_the_space_on_tensor_cores(capsys):
    """--dtype float16: the whole space on the mma engine, split_k's groups as key warps (the
    simulator's one-warp tiles widened to 32 keys so that each group has 16)."""
    assert main(["ablate", "--variants", "fa1", "--dtype", "float16", "--seq", "20", "--head-dim", "16",
                 "--json"]) == 0
    out = capsys.readouterr()
    rows = json.loads(out.out)
    names = [r["variant"] for r in rows]
    assert all(p.name in names for p in PATH)
    assert any(r["warp_partition"] == "split_k" for r in rows)
    for r in rows:
        assert "tensor cores" in r["regime"] and r["rel_err"] < 2e-3
        assert (r["block_m"], r["block_n"]) == (16, 32)
    assert "not built" not in out.err


@pytest.mark.parametrize("argv, message", [
    (["--variants", "kv_outer-everywhere-deferred"], "grid"),
    (["--variants", "q_outer-heads-deferred-split_v"], "warp_partition"),
])
def test_refusals(capsys, argv, message):
    assert main(["ablate", "--seq", "8", "--head-dim", "4", *argv]) == 2
    assert message in capsys.readouterr().err


def test_space_parsing_and_barriers():
    assert len(all_variants()) == 24 and parse_variant("fa1") is FA1 and parse_variant("fa2") is FA2
    assert parse_variant("kv_outer-heads_x_qtiles-deferred") == Variant("kv_outer", "heads_x_qtiles", "deferred")
    with pytest.raises(ValueError, match="a variant is"):
        parse_variant("kv_outer")
    # q_outer: 3 barriers per K/V tile (4 on tensor cores); FA-1 at 4 Q tiles x 4 K/V tiles: 1 + 3 * 4
    # per K/V tile, either engine; split_k merges through shared memory at every step: 2 more per pair
    assert barriers_per_kv_tile(FA2, 32, 32, 8, 8, False) == 3
    assert barriers_per_kv_tile(FA2, 32, 32, 8, 8, False, tensor_cores=True) == 4
    assert barriers_per_kv_tile(FA1, 32, 32, 8, 8, False) == 13 == barriers_per_kv_tile(FA1, 32, 32, 8, 8, False, True)
    assert barriers_per_kv_tile(Variant("kv_outer", "heads_x_qtiles", "every_step"), 32, 32, 8, 8, False) == 4
    assert barriers_per_kv_tile(Variant("kv_outer", "heads", "every_step", "split_k"), 32, 32, 8, 8, False) == 21


def test_ncu_needs_a_gpu(capsys):
    assert main(["ablate", "--variants", "fa1", "--seq", "8", "--head-dim", "4", "--block-m", "4", "--block-n", "4",
                 "--ncu"]) == 2
    assert "numba-flash ablate --ncu needs a CUDA GPU" in capsys.readouterr().err


def test_ncu_plan_and_command(tmp_path, monkeypatch):
    """What --ncu runs, without ncu: the plan holds the problem and the variants, the target is
    the ablation's ncu_target, and the measured figures land in the rows by marked run."""
    import numba_flash.research.profiling.ncu as ncu
    from numba_flash.research.ablation import add_ncu

    seen = {}

    def fake_run_ncu(binary, log_file, target, metrics=ncu.METRICS):
        seen.update(binary=binary, target=target, metrics=metrics)
        kernels = []
        for i in range(2):
            kernels.append((ncu.MARKER, {}))
            kernels.append(("forward", {"dram__bytes_read.sum": 100.0 * (i + 1), "dram__bytes_write.sum": 1.0,
                                        ncu.METRICS[2]: 50.0, "gpu__time_duration.sum": 10.0,
                                        ncu.WARP_METRICS[0]: 7.0 * (i + 1), ncu.WARP_METRICS[1]: 1.0,
                                        ncu.WARP_METRICS[2]: 20.0}))
        kernels.append((ncu.MARKER, {}))
        return kernels

    monkeypatch.setattr(ncu, "run_ncu", fake_run_ncu)

    class Args:
        batch, heads, kv_heads, seq, seq_k, head_dim = 1, 2, None, 16, None, 8
        causal, dtype, block_m, block_n, seed = True, "float32", 8, 8, 0

    rows = [dict(variant="fa1"), dict(variant="fa2")]
    add_ncu(rows, Args, "my-ncu", str(tmp_path))
    assert seen["binary"] == "my-ncu" and "ncu_target" in seen["target"][-1]
    plan = json.loads((tmp_path / "ablate_ncu_plan.json").read_text())
    assert plan["variants"] == ["fa1", "fa2"] and plan["args"]["causal"] is True
    assert [r["dram_bytes"] for r in rows] == [101.0, 201.0] and rows[0]["achieved_occupancy"] == 0.5
    assert set(ncu.WARP_METRICS) <= set(seen["metrics"])
    assert [r["shared_ld"] for r in rows] == [7.0, 14.0] and rows[1]["barrier_stall"] == 0.2


def test_ncu_without_warp_metrics_profiles_again(tmp_path, monkeypatch):
    """An ncu that refuses the shared-memory/barrier metrics: the run is repeated with the base
    metrics and the rows get DRAM bytes and occupancy only."""
    import subprocess

    import numba_flash.research.profiling.ncu as ncu
    from numba_flash.research.ablation import add_ncu

    calls = []

    def fake_run_ncu(binary, log_file, target, metrics=ncu.METRICS):
        calls.append(tuple(metrics))
        if ncu.WARP_METRICS[0] in metrics:
            raise subprocess.CalledProcessError(1, [binary])
        return [(ncu.MARKER, {}), ("forward", {"dram__bytes_read.sum": 5.0, "gpu__time_duration.sum": 1.0}), (ncu.MARKER, {})]

    monkeypatch.setattr(ncu, "run_ncu", fake_run_ncu)

    class Args:
        batch, heads, kv_heads, seq, seq_k, head_dim = 1, 2, None, 16, None, 8
        causal, dtype, block_m, block_n, seed = False, "float32", 8, 8, 0

    rows = [dict(variant="fa2")]
    add_ncu(rows, Args, "ncu", str(tmp_path))
    assert calls == [(*ncu.METRICS, *ncu.WARP_METRICS), ncu.METRICS]
    assert rows[0]["dram_bytes"] == 5.0 and "shared_ld" not in rows[0]


def test_ncu_target_runs_the_planned_variants(tmp_path):
    """The process ncu profiles, run here in the simulator: the plan's problem, each variant once."""
    from numba_flash.research.ablation import ncu_target

    plan = dict(args=dict(batch=1, heads=1, kv_heads=None, seq=8, seq_k=None, head_dim=4, causal=False,
                          dtype="float32", block_m=4, block_n=4, seed=0),
                variants=["fa1", "q_outer-heads-deferred-split_k"])
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    ncu_target(str(path))  # raises if a variant or the problem cannot run
