"""scripts/fa3_bench.py's host side: the --tiles configurations it parses and calls, --pair's arguments."""

from __future__ import annotations

import pathlib
import runpy
import types

import pytest

FA3_BENCH = runpy.run_path(str(pathlib.Path(__file__).resolve().parents[2] / "scripts" / "fa3_bench.py"))


def test_tile_specs_parse():
    spec = FA3_BENCH["tile_spec"]
    assert spec("192x128x2-nopingpong") == ("192x128x2-nopingpong", (192, 128, 2), {"pingpong": False})
    assert spec("192x128x2-pingpong") == ("192x128x2-pingpong", (192, 128, 2), {"pingpong": True})
    assert spec("192x96x2-fp8-softcap50") == ("192x96x2-fp8-softcap50", (192, 96, 2), {"fp8": True, "softcap": 50.0})
    with pytest.raises(SystemExit, match="unknown knob"):
        spec("128x128x2-fast")
    for bad in ("192x128", "192x128x2x1", "0x128x2", "axbxc-nopingpong"):
        with pytest.raises(SystemExit, match="block_m x block_n x stages"):
            spec(bad)


def test_a_tile_call_runs_fa3_with_its_tiles_and_knobs_on_the_right_inputs():
    seen = []
    fake = types.SimpleNamespace(fa3=types.SimpleNamespace(forward=lambda *a, **kw: seen.append((a, kw))))
    spec = FA3_BENCH["tile_spec"]
    FA3_BENCH["tile_call"](None, fake, spec("192x96x2-fp8-nopingpong"), ("q", "k", "v"), ("q8", "k8", "v8"), True)()
    FA3_BENCH["tile_call"](None, fake, spec("128x128x3"), ("q", "k", "v"), (None,) * 3, False)()
    assert seen == [(("q8", "k8", "v8"), dict(causal=True, block_m=192, block_n=96, stages=2, pingpong=False)),
                    (("q", "k", "v"), dict(causal=False, block_m=128, block_n=128, stages=3))]
    # an fp8 configuration without fp8 inputs is skipped, not run on the 16-bit ones
    assert FA3_BENCH["tile_call"](None, fake, spec("128x128x2-fp8"), ("q", "k", "v"), (None,) * 3, False) is None


def test_pair_takes_two_configurations_and_shapes_are_checked_first():
    parse = FA3_BENCH["parse_args"]
    assert parse(["--pair", "192x128x2,192x128x2-nopingpong"]).pair == "192x128x2,192x128x2-nopingpong"
    assert parse(["--shapes", "4,16,4096,64; 1,16,16384,128;"]).shape_list == [(4, 16, 4096, 64), (1, 16, 16384, 128)]
    assert parse([]).shape_list is None  # (the default shapes)
    for bad in (["--pair", "192x128x2"], ["--pair", "a,b,c"], ["--pair", "a,b", "--rounds", "0"],
                ["--shapes", "4,16,4096"], ["--shapes", "4,16,0,64"]):
        with pytest.raises(SystemExit):
            parse(bad)
