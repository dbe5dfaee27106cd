"""``numba-flash ablate`` (issue 10) in the simulator: every variant's row, the JSON contract,
the FA-1 -> FA-2 path and its waterfall, refusals."""

from __future__ import annotations

import json

import pytest

from numba_flash.ablation import PATH, all_variants, barriers_per_kv_tile, parse_variant
from numba_flash.cli import main
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


@pytest.mark.parametrize("argv, message", [
    (["--variants", "kv_outer-everywhere-deferred"], "grid"),
    (["--variants", "q_outer-heads-deferred-split_v"], "warp_partition"),
    (["--dtype", "float16"], "precision ieee"),
])
def test_refusals(capsys, argv, message):
    assert main(["ablate", "--seq", "8", "--head-dim", "4", *argv]) == 2
    assert message in capsys.readouterr().err


def test_space_parsing_and_barriers():
    assert len(all_variants()) == 24 and parse_variant("fa1") is FA1 and parse_variant("fa2") is FA2
    assert parse_variant("kv_outer-heads_x_qtiles-deferred") == Variant("kv_outer", "heads_x_qtiles", "deferred")
    with pytest.raises(ValueError, match="a variant is"):
        parse_variant("kv_outer")
    # q_outer: 3 barriers per K/V tile; FA-1 at 4 Q tiles x 4 K/V tiles: 1 + 3 * 4 per K/V tile
    assert barriers_per_kv_tile(FA2, 32, 32, 8, 8, False) == 3
    assert barriers_per_kv_tile(FA1, 32, 32, 8, 8, False) == 13
    assert barriers_per_kv_tile(Variant("kv_outer", "heads_x_qtiles", "every_step"), 32, 32, 8, 8, False) == 4
    assert barriers_per_kv_tile(Variant("kv_outer", "heads", "every_step", "split_k"), 32, 32, 8, 8, False) == 17
