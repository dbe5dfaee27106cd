"""The `numba-flash` command, in whichever world this machine has (simulator in CI)."""

from __future__ import annotations

import json

import pytest

from numba_flash.research.cli import main


def test_compare_prints_both_algorithms_side_by_side(capsys):
    assert main(["compare", "--seq", "9", "--head-dim", "5", "--heads", "2", "--kv-heads", "1",
                 "--block-m", "4", "--block-n", "4", "--causal"]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    assert "FA-1" in header and "FA-2" in header
    for row in ("relative error", "shared memory / block", "modelled global traffic", "TFLOP/s"):
        assert row in out
    rel = [line for line in out.splitlines() if line.startswith("| relative error")][0]
    assert all(float(cell) < 1e-5 for cell in rel.strip("|").split("|")[1:])


def test_compare_json(capsys):
    assert main(["compare", "--seq", "6", "--head-dim", "3", "--block-m", "2", "--block-n", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["algorithm"] for r in rows] == ["fa1", "fa2"]
    assert all(r["rel_err"] < 1e-5 and r["modelled_bytes"] > 0 for r in rows)
    assert rows[0]["modelled_bytes"] > rows[1]["modelled_bytes"]  # FA-1's round trips


def test_compare_backward_adds_the_gradients(capsys):
    """--backward: the gradients' error of both loop orders under the forward's table; without
    it, no backward lines; ablate has no --backward (the backward has two loop orders only)."""
    argv = ["compare", "--seq", "7", "--seq-k", "10", "--head-dim", "4", "--heads", "2", "--kv-heads", "1",
            "--block-m", "4", "--block-n", "4", "--causal"]
    assert main([*argv, "--backward"]) == 0
    out = capsys.readouterr().out
    grads = [line for line in out.splitlines() if line.startswith("| backward: gradients' relative error")][0]
    assert all(float(cell) < 1e-5 for cell in grads.strip("|").split("|")[1:])
    assert main(argv) == 0
    assert "backward" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["ablate", "--backward"])


def test_compare_refuses_bad_problems_in_one_line(capsys):
    assert main(["compare", "--block-m", "3"]) == 2
    assert "block_m=3 is not supported" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["compare", "--seq", "0"])


def test_demo_prints_the_seed_example(capsys):
    assert main(["demo"]) == 0
    assert "1.0" in capsys.readouterr().out


def test_autotune_needs_a_gpu(capsys):
    from numba_flash._world import simulated

    if not simulated():
        pytest.skip("on a GPU autotune would run for minutes")
    assert main(["autotune"]) == 2
    assert "GPU" in capsys.readouterr().err


def test_version_comes_from_the_package_metadata(capsys):
    from importlib import metadata

    import numba_flash

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"numba-flash {numba_flash.__version__}"
    assert numba_flash.__version__ == metadata.version("numba-flash")


@pytest.mark.parametrize("argv, flag", [(["compare", "--seq", "abc"], "--seq"), (["compare", "--heads", "0"], "--heads"),
                                        (["occupancy", "--cc", "nine"], "--cc"), (["autotune", "--seq", "-3"], "--seq")])
def test_bad_values_are_named_without_private_names(argv, flag, capsys):
    """argparse names the type function of a bad value: it must read well, not `_positive`."""
    import re

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {flag}:" in err and not re.search(r"(^|[\s'(])_[a-z]", err), err


def _subcommands():
    from numba_flash.research.cli import _parser

    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction))
    return parser, sub.choices


def test_every_flag_has_help_and_shows_its_default():
    """Each option of each subcommand says what it does; a default that is a value is shown
    as ``(default: ...)`` (and one that depends on the machine is said in words)."""
    import argparse

    parser, commands = _subcommands()
    assert set(commands) >= {"compare", "occupancy", "autotune", "demo"}
    for name, sub in commands.items():
        text = sub.format_help()
        assert sub.description, name
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = action.option_strings[0] if action.option_strings else action.dest  # (a positional: cache's action)
            assert action.help, f"{name} {flag} has no help"
            if action.default is not None and action.default is not False:
                shown = sub._get_formatter()._get_help_string(action) % {"default": action.default}
                assert "default:" in shown, f"{name} {flag} does not show its default"
                assert "(default:" in text


def test_occupancy_says_what_is_missing(monkeypatch, capsys):
    """No libNVVM/NVRTC here: the command names each missing piece and the extra that gives it,
    before compiling anything."""
    from numba_flash.research.profiling import occupancy

    monkeypatch.setattr(occupancy, "missing_toolchain", lambda: [
        f"{occupancy.TOOLCHAIN['nvrtc']}: not found", f"{occupancy.TOOLCHAIN['ptxas']}: not found"])
    monkeypatch.setattr(occupancy, "profile", lambda *a, **k: pytest.fail("compiled despite a missing compiler"))
    assert main(["occupancy", "--source", "ptxas", "--head-dim", "16"]) == 2
    err = capsys.readouterr().err
    assert "NVRTC" in err and "nvidia-cuda-nvrtc" in err and "nvidia-cuda-nvcc" in err
    assert "pip install 'numba-flash[occupancy]'" in err


def test_missing_toolchain_names_nvvm_and_nvrtc(monkeypatch):
    import cuda.pathfinder

    from numba_flash.research.profiling import occupancy

    def not_found(lib):
        raise cuda.pathfinder.DynamicLibNotFoundError(f"lib{lib}.so not found")

    monkeypatch.setattr(cuda.pathfinder, "load_nvidia_dynamic_lib", not_found)
    missing = " ".join(occupancy.missing_toolchain())
    assert "libNVVM" in missing and "NVRTC" in missing


def test_ptxas_failure_shows_ptxas_own_message(monkeypatch, tmp_path):
    """An old ptxas exits 255 on new PTX; its own words must reach the user."""
    from numba_flash.research.profiling import occupancy

    fake = tmp_path / "ptxas"
    fake.write_text("#!/bin/sh\necho \"ptxas fatal   : Unsupported .version 9.5; current version is '9.0'\" >&2\nexit 255\n")
    fake.chmod(0o755)
    monkeypatch.setattr(occupancy, "find_ptxas", lambda: str(fake))
    with pytest.raises(RuntimeError, match=r"exit status 255.*Unsupported \.version 9\.5"):
        occupancy.ptxas_resources(".version 9.5\n")


def test_the_wheel_ptxas_wins_over_path(monkeypatch, tmp_path):
    """An older ptxas first on PATH must not shadow the one the occupancy extra installs."""
    from numba_flash.research.profiling import occupancy

    wheel = occupancy._wheel_ptxas()
    if wheel is None:
        pytest.skip("the nvidia-cuda-nvcc wheel is not installed (numba-flash[occupancy])")
    old = tmp_path / "ptxas"
    old.write_text("#!/bin/sh\nexit 255\n")
    old.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    assert occupancy.find_ptxas() == wheel


def test_compare_prints_a_line_per_stage(capsys):
    """Progress on stderr as each stage starts and ends (stdout keeps the table or JSON)."""
    assert main(["compare", "--seq", "6", "--head-dim", "3", "--block-m", "2", "--block-n", "2", "--json"]) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)
    err = captured.err
    for stage in ("[1/2] FA-1:", "[2/2] FA-2:", "done in"):
        assert stage in err, err
    from numba_flash._world import simulated

    if simulated():
        assert "Numba's CUDA simulator, about" in err


def test_default_simulated_compare_is_expected_within_a_minute():
    """The README's main job without a GPU: the default problem, by the simulator's cost model."""
    import argparse

    from numba_flash._world import simulated
    from numba_flash.research.compare import problem_of, simulated_seconds

    if not simulated():
        pytest.skip("the simulator's default problem")
    args = argparse.Namespace(batch=None, heads=None, kv_heads=None, seq=None, seq_k=None, head_dim=None,
                              block_m=None, block_n=None, causal=False, dtype="float32", precision="default")
    assert simulated_seconds(problem_of(args)) < 30


def test_compare_runs_fa1_and_fa2_at_the_same_cuda_core_tiles(monkeypatch):
    """On a GPU, ``compare`` without tiles runs both loop orders at ``tile_table.comparison_tiles``
    (FA-2's own float32 default at D <= 64 is larger: a ratio at each kernel's defaults would
    mix the tiles into the loop order); tensor-core problems keep each kernel's defaults."""
    import argparse

    from numba_flash.research import compare
    from numba_flash import tile_table
    from numba_flash.tile_table import comparison_tiles
    from numba_flash.tile_table import forward_tiles as default_tiles

    monkeypatch.setattr(compare, "simulated", lambda: False)
    monkeypatch.setattr(tile_table, "simulated", lambda: False)
    blank = dict(batch=None, heads=None, seq=None, head_dim=None, block_m=None, block_n=None, causal=False,
                 kv_heads=None, seq_k=None)
    p = compare.problem_of(argparse.Namespace(**blank, precision="default", dtype="float32"))
    assert (p["block_m"], p["block_n"]) == comparison_tiles(64) == default_tiles("fa1", 64, "float32", False)
    assert default_tiles("fa2", 64, "float32", False) != comparison_tiles(64)
    p = compare.problem_of(argparse.Namespace(**blank, precision="default", dtype="float16"))
    assert p["block_m"] is None and p["block_n"] is None
    p = compare.problem_of(argparse.Namespace(**{**blank, "block_m": 128, "block_n": 64}, precision="ieee", dtype="float32"))
    assert (p["block_m"], p["block_n"]) == (128, 64)
