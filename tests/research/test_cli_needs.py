"""`numba-flash` commands check the optional extras they need before any work: one line naming
what is missing and the extra that installs it, exit status 2 (here, as in an install without
the extra: the package made unimportable)."""

from __future__ import annotations

import sys

import pytest

from numba_flash.research.cli import main


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_compare_bfloat16_without_its_package(monkeypatch, capsys):
    """bfloat16 arrays are ml_dtypes' in the simulator and torch's on a GPU: without them, one
    line before the inputs are even made."""
    from numba_flash.research import compare

    for name in ("ml_dtypes", "torch"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr(compare, "make_problem", lambda *a: pytest.fail("worked before saying what it needs"))
    assert main(["compare", "--dtype", "bfloat16", "--seq", "4", "--head-dim", "4"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("numba-flash compare --dtype bfloat16 needs ")
    assert "pip install 'numba-flash[bfloat16]'" in line or "pip install 'numba-flash[torch]'" in line


@pytest.mark.parametrize("command", ["ablate", "occupancy"])
def test_plot_without_matplotlib_is_refused_before_any_work(command, monkeypatch, capsys, tmp_path):
    from numba_flash.research import ablation
    from numba_flash.research.profiling import occupancy

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(ablation, "ablate", lambda *a, **k: pytest.fail("worked before saying what it needs"))
    monkeypatch.setattr(occupancy, "profile", lambda *a, **k: pytest.fail("worked before saying what it needs"))
    assert main([command, "--plot", str(tmp_path)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line == f"numba-flash {command} --plot needs matplotlib (pip install 'numba-flash[plot]')"
