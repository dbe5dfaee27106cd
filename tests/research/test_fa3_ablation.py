"""The FA-2 -> FA-3 ablation's table (``numba-flash ablate --fa3``): each row's ratio is to its base,
the row before it along the path to the full kernel, then the full kernel for each factor removed
from it. (Running the points needs a GPU for times; ``scripts/fa3_bench.py`` times the same knobs.)"""

import pytest

from numba_flash.research.fa3_ablation import FULL, POINTS, base_ratios, format_fa3_ablation


def _rows(times):
    return [dict(point=name, ms=ms, tflops=None, paper_h100_tflops=None, rel_err=1e-3)
            for (name, _), ms in zip(POINTS, times)]


def test_ratios_follow_the_path_then_compare_with_the_full_kernel():
    names = [name for name, _ in POINTS]
    at_full = names.index(FULL)
    assert at_full < len(POINTS) - 1  # factors removed from the full kernel follow it
    times = [2.0 + 0.1 * i for i in range(len(POINTS))]
    rows = _rows(times)
    base_ratios(rows)
    assert "vs_base" not in rows[0]
    for i in range(1, len(rows)):
        base = times[i - 1] if i <= at_full else times[at_full]
        if names[i] == "fa3, overlap only":  # one scheme added to neither, not swapped for ping-pong
            base = times[names.index("fa3, neither pipelining")]
        assert rows[i]["vs_base"] == pytest.approx(base / times[i]), names[i]
    table = format_fa3_ablation(rows, ["a note"])
    assert table.count("\n| ") == len(POINTS) + 1 and table.endswith("a note")


def test_untimed_rows_get_no_ratio():
    rows = _rows([None] * len(POINTS))  # the simulator: errors only
    base_ratios(rows)
    assert not any("vs_base" in row for row in rows)
    assert "x |" not in format_fa3_ablation(rows, [])


def test_the_points_name_fa3_knobs():
    import inspect

    from numba_flash import fa3

    knobs = set(inspect.signature(fa3.forward).parameters)
    for name, point in POINTS:
        assert point is None or set(point) <= knobs, name
