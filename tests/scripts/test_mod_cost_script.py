"""scripts/mod_cost.py's host side: the mods it parses, the alternating pairs it times, the shapes."""

from __future__ import annotations

import pathlib
import runpy

import pytest

MOD_COST = runpy.run_path(str(pathlib.Path(__file__).resolve().parents[2] / "scripts" / "mod_cost.py"))


def test_mods_parse():
    parse = MOD_COST["parse_mod"]
    assert parse("alibi") == ("alibi", 0.0, None)
    assert parse("softcap50") == ("softcap", 50.0, None)
    assert parse("softcap2.5") == ("softcap", 2.5, None)
    assert parse("alibi@192x96") == ("alibi", 0.0, (192, 96))
    assert parse("softcap30@128x64") == ("softcap", 30.0, (128, 64))
    for bad in ("softcap", "softcap0", "softcap-3", "softcapx", "softcapinf", "softcapnan", "window", "", "window@128x64"):
        with pytest.raises(ValueError, match="unknown mod"):
            parse(bad)
    for bad in ("alibi@192", "alibi@192x", "alibi@0x96", "alibi@192x96x2", "softcap50@axb"):
        with pytest.raises(ValueError, match="tile"):
            parse(bad)


def test_a_mods_tile_goes_to_the_modified_call_only():
    args = MOD_COST["mod_arguments"]
    assert args(("softcap", 50.0, None), 16, None) == {"softcap": 50.0}
    assert args(("softcap", 50.0, (192, 96)), 16, None) == {"softcap": 50.0, "block_m": 192, "block_n": 96}


def test_pairs_alternate_and_the_cost_is_the_median_of_their_ratios():
    calls = []
    plain_times = iter([1.0, 2.0, 1.0, 1.0, 1.0])  # a slow round for both: its ratio is still 1.1
    mod_times = iter([1.1, 2.2, 1.3, 1.05, 1.2])

    def plain():
        calls.append("plain")
        return next(plain_times)

    def mod():
        calls.append("mod")
        return next(mod_times)

    cost = MOD_COST["paired_cost"](plain, mod, 5)
    assert calls == ["plain", "mod", "mod", "plain"] * 2 + ["plain", "mod"]  # the order swapped every round
    assert cost["ratio"] == pytest.approx(1.1)  # ratios 1.1, 1.1, 1.3, 1.05, 1.2
    assert cost["ratio_min"] == pytest.approx(1.05) and cost["ratio_max"] == pytest.approx(1.3)
    assert cost["plain_ms"] == 1.0 and cost["mod_ms"] == pytest.approx(1.2)
    with pytest.raises(ValueError, match="rounds"):
        MOD_COST["paired_cost"](plain, mod, 0)


def test_shapes_parse():
    parse = MOD_COST["parse_shapes"]
    assert parse("4,16,4096,128; 1,16,16384,64;") == [(4, 16, 4096, 128), (1, 16, 16384, 64)]
    for bad in ("4,16,4096", "4,16,0,128", "a,b,c,d", ";"):
        with pytest.raises(ValueError):
            parse(bad)
