"""scripts/decode_bench.py without a GPU: --help, the plan, bad arguments, one tiny configuration
run by numba_flash.decode in the simulator (row, JSON keys, error), and the GPU-side bookkeeping
(peer ratios, the SDPA fallback to expanded K/V, Markdown, plots) on synthetic results."""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from helpers import script_module

from numba_flash._world import simulated

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "decode_bench.py"
JSON_KEYS = {"batch", "heads", "kv_heads", "q_len", "head_dim", "dtype", "cache_len", "num_splits", "ms",
             "kv_bytes", "tbs", "pct_peak", "rel_err", "peers", "vs_best_sdpa"}  # fmt: skip


@pytest.fixture(scope="module")
def bench():
    yield from script_module("decode_bench.py", "decode_bench_script")


# --------------------------------------------------------------------- arguments, plan


def test_help_works_without_cupy_torch_or_a_gpu():
    code = ("import runpy, sys\nsys.modules['cupy'] = None\nsys.modules['torch'] = None\n"
            "sys.argv = [sys.argv[1], '--help']\nrunpy.run_path(sys.argv[0], run_name='__main__')\n")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    for flag in ("--cache", "--batch", "--num-splits", "--skip-above-gib", "--peak-tbs", "--simulate", "--json"):
        assert flag in done.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--heads", "4", "--kv-heads", "3"], "--heads (4) must be a multiple of --kv-heads (3)"),
        (["--num-splits", "0"], "--num-splits: expected 'auto' or a positive integer; got '0'"),
        (["--num-splits", "two"], "--num-splits: expected 'auto' or a positive integer"),
        (["--cache", "-5"], "--cache: expected a positive integer"),
        (["--dtype", "float64"], "--dtype: invalid choice"),
        (["--head-dim", "257"], "--head-dim must be 1..256"),
        (["--peak-tbs", "0"], "--peak-tbs: expected a positive number"),
    ],
)
def test_bad_arguments_exit_2_naming_the_flag(bench, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_default_plan_and_the_memory_budget(bench, capsys):
    args = bench.parse_args([])
    plan = bench.build_plan(args)
    assert len(plan) == 7 * 3 and args.num_splits == [None]
    cfg = {(c.batch, c.cache_len): c for c, _ in plan}[(1, 131072)]
    assert cfg.kv_bytes == 2 * 1 * 8 * 131072 * 128 * 2 == 512 * 2**20  # K and V, float16
    skipped = [(c.batch, c.cache_len) for c, reason in plan if reason]
    assert skipped == [(64, 262144), (64, 1048576)]  # 64 GiB and 256 GiB > 40 GiB; B64 N131072 is 32 GiB
    assert bench.main(["--dry-run", "--skip-above-gib", "100", "--num-splits", "auto", "1"]) == 0
    out = capsys.readouterr().out
    assert "21 configurations, 20 to run, 1 skipped" in out and "num_splits auto, 1" in out


def test_simulate_defaults_are_tiny_and_explicit_values_win(bench):
    args = bench.parse_args(["--simulate", "--heads", "8"])
    assert (args.cache, args.batch, args.heads, args.kv_heads, args.head_dim, args.repeats) == ([40], [2], 8, 2, 16, 1)


@pytest.mark.skipif(not simulated(), reason="on a GPU main() would run the sweep")
def test_without_a_gpu_and_without_simulate_exit_2(bench, capsys):
    with pytest.raises(SystemExit) as stop:
        bench.main(["--cache", "40", "--batch", "1"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "--simulate" in err


# -------------------------------------------------------------- the simulated run


@pytest.fixture(scope="module")
def simulated_run(tmp_path_factory):
    """One tiny configuration in the simulator, three num_splits, in a fresh process (so that
    it runs in the simulator on a GPU machine too): (exit code, stdout, stderr, JSON)."""
    path = tmp_path_factory.mktemp("decode") / "decode.json"
    argv = [sys.executable, str(SCRIPT), "--simulate", "--num-splits", "auto", "1", "3", "--json", str(path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout, done.stderr, json.loads(path.read_text()) if path.exists() else None


def test_decode_exists():
    import numba_flash

    assert callable(getattr(numba_flash, "decode", None)), "numba_flash.decode is missing (issue 11, API.md 2b)"


def test_simulated_run_prints_rows_with_small_errors(simulated_run):
    code, out, err, _ = simulated_run
    assert code == 0, out + err
    rows = [line for line in out.splitlines() if line.startswith("| 2 | 40 |")]
    assert [row.split("|")[3].strip() for row in rows] == ["auto", "1", "3"], out
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[3] == "null" and cells[4] == "null"  # ms, TB/s: the simulator times nothing
        rel_err = float(cells[6])
        assert math.isfinite(rel_err) and rel_err < 1e-2, row  # float16 output rounding is ~5e-4
    assert err.count("numba_flash splits=") == 3  # one progress line per measurement


def test_simulated_json_has_the_keys(simulated_run):
    code, out, err, doc = simulated_run
    assert doc is not None, err
    assert [r["num_splits"] for r in doc["rows"]] == [None, 1, 3]
    for row in doc["rows"]:
        assert JSON_KEYS <= set(row), JSON_KEYS - set(row)
        assert (row["batch"], row["heads"], row["kv_heads"], row["q_len"], row["head_dim"], row["cache_len"]) == (
            2, 4, 2, 1, 16, 40)  # fmt: skip
        assert row["dtype"] == "float16" and row["kv_bytes"] == 2 * 2 * 2 * 40 * 16 * 2
        assert row["ms"] is None and row["tbs"] is None and row["pct_peak"] is None and row["vs_best_sdpa"] is None
        assert row["peers"] == {} and row["status"] == "ok", row["status"]
        assert 0 <= row["rel_err"] < 1e-2
    assert "simulator" in doc["meta"]["GPU"]


def test_reference_is_attention_with_gqa(bench, rng):
    """The script's chunked float64 reference against numba_flash.reference (H 4, Hkv 2)."""
    from numba_flash import reference

    q = rng.standard_normal((2, 4, 3, 8))
    k, v = rng.standard_normal((2, 2, 2, 37, 8))
    ref = bench.reference(q, k, v, bench.Arrays("numpy"), chunk=10)
    want, _ = reference.attention(q, k, v)
    np.testing.assert_allclose(ref, want[0], rtol=1e-12, atol=1e-14)


# ------------------------------------------------------ GPU bookkeeping, synthetic


def synthetic_rows(bench):
    """B1 and B8 at two cache lengths; peers with hand-picked times (ms)."""
    rows = []
    for batch in (1, 8):
        for n in (1024, 131072):
            cfg = bench.Config(batch, 32, 8, 1, 128, "float16", n)
            row = bench.new_row(cfg, None, "ok")
            bench.set_time(row, cfg, 0.5 * batch * n / 131072, peak_tbs=4.8)
            row["rel_err"] = 3e-4
            peers = {
                "torch-flash": dict(ms=0.6 * batch * n / 131072, note="", rel_err=3e-4),
                "torch-mem_efficient": dict(ms=2.0 * batch * n / 131072, rel_err=3e-4,
                                            note="expanded kv: enable_gqa refused, reads 4x the K/V bytes"),
                "torch-cudnn": dict(ms=None, note="failed: RuntimeError: No available kernel", rel_err=None),
            }  # fmt: skip
            for p in peers.values():
                p["tbs"] = bench.tbs(cfg.kv_bytes, p["ms"])
            bench.add_peers(row, peers)
            rows.append(row)
    return rows


def test_bandwidth_and_the_ratio_to_the_best_peer(bench):
    row = synthetic_rows(bench)[1]  # B1 N131072: 512 MiB of K and V in 0.5 ms
    assert row["tbs"] == pytest.approx(512 * 2**20 / 0.5e-3 / 1e12)  # 1.07 TB/s
    assert row["pct_peak"] == pytest.approx(100 * row["tbs"] / 4.8)
    assert row["best_sdpa"] == "torch-flash" and row["vs_best_sdpa"] == pytest.approx(0.6 / 0.5)
    assert row["peers"]["torch-cudnn"]["tbs"] is None


def test_markdown_marks_expanded_and_failed_peers(bench):
    text = bench.markdown_report(synthetic_rows(bench), {"GPU": "Test GPU"})
    assert "Test GPU" in text
    line = next(x for x in text.splitlines() if x.startswith("| 1 | 131072 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2:7] == ["auto", "0.5000", "1.07", "22", "3.0e-04"]
    assert cells[7:10] == ["0.89", "0.27 (expanded kv)", "failed"]  # flash, mem_efficient, cudnn TB/s
    assert cells[10] == "1.20x torch-flash"
    note = next(x for x in text.splitlines() if x.startswith("- torch-cudnn: failed: RuntimeError: No available kernel"))
    assert note.endswith("(B1 N1024, B1 N131072, B8 N1024, B8 N131072)")  # one note, where it applies


def test_plots_are_png_files(bench, tmp_path):
    rows = synthetic_rows(bench)
    written = bench.write_plots(rows, tmp_path, "Test GPU", 4.8)
    assert [p.name for p in written] == ["decode_bw_float16_d128_splits-auto.png"]
    data = written[0].read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000
    assert bench.write_plots([bench.new_row(bench.Config(1, 4, 2, 1, 16, "float16", 40), None, "ok")],
                             tmp_path / "none", "x", 4.8) == []  # fmt: skip  (nothing timed: no plot)


def test_replot_draws_a_saved_run_and_refuses_a_bad_file(bench, tmp_path, capsys):
    rows = synthetic_rows(bench)
    saved = tmp_path / "run.json"
    bench.write_json(rows, {"GPU": "Test GPU", "command": "decode_bench.py --json run.json"}, saved)
    assert bench.main(["--replot", str(saved), "--plot", str(tmp_path / "plots")]) == 0
    png = tmp_path / "plots" / "decode_bw_float16_d128_splits-auto.png"
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert "| 131072 |" in capsys.readouterr().out  # the saved rows' report
    (tmp_path / "bad.json").write_text('{"rows": []}')  # no meta: not a decode_bench.py file
    assert bench.main(["--replot", str(tmp_path / "bad.json"), "--plot", str(tmp_path / "p2")]) == 2
    assert "cannot read" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # where would the plots go?
        bench.main(["--replot", str(saved)])
    assert exit_info.value.code == 2 and "--replot needs --plot" in capsys.readouterr().err


# ----------------------------------------- the SDPA peers, on a stand-in for torch


class _Tensor(np.ndarray):
    def repeat_interleave(self, n, dim):
        return np.repeat(self, n, axis=dim).view(_Tensor)


def _fake_torch(monkeypatch, refuses_gqa: set, fails: set):
    """torch, torch.nn.functional and torch.nn.attention, just enough for measure_peer:
    SDPA computes attention with NumPy, raising (after a warning, as torch does) for backends
    in ``fails``, and for those in ``refuses_gqa`` when called with ``enable_gqa``."""
    from numba_flash import reference

    state = {"backend": None, "calls": []}

    @contextlib.contextmanager
    def sdpa_kernel(backend):
        state["backend"] = backend
        yield

    def sdpa(q, k, v, enable_gqa=False):
        import warnings

        state["calls"].append((state["backend"], enable_gqa, k.shape[1]))
        if state["backend"] in fails or (enable_gqa and state["backend"] in refuses_gqa):
            warnings.warn(f"{state['backend']} kernel not used because: reasons", UserWarning)
            raise RuntimeError("No available kernel. Aborting execution.")
        if k.shape[1] != q.shape[1] and not enable_gqa:
            raise RuntimeError("shape mismatch")
        return reference.attention(q, k, v)[0]

    torch = types.ModuleType("torch")
    nn = types.ModuleType("torch.nn")
    functional = types.ModuleType("torch.nn.functional")
    attention = types.ModuleType("torch.nn.attention")
    functional.scaled_dot_product_attention = sdpa
    attention.sdpa_kernel = sdpa_kernel
    torch.nn, nn.functional, nn.attention = nn, functional, attention
    for name, module in (("torch", torch), ("torch.nn", nn), ("torch.nn.functional", functional),
                         ("torch.nn.attention", attention)):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, module)
    return state


@pytest.mark.parametrize("backend", ["gqa-ok", "refuses-gqa", "broken"])
def test_peer_gqa_fallback_and_failures(bench, monkeypatch, rng, backend):
    state = _fake_torch(monkeypatch, refuses_gqa={"refuses-gqa"}, fails={"broken"})
    monkeypatch.setattr(bench, "time_ms", lambda fn, repeats, simulate: (fn(), 2.0)[1])
    cfg = bench.Config(1, 4, 2, 1, 8, "float32", 16)
    q = rng.standard_normal((1, 4, 1, 8)).view(_Tensor)
    k, v = (rng.standard_normal((1, 2, 16, 8)).view(_Tensor) for _ in range(2))
    arrays = bench.Arrays("numpy")
    ref = bench.reference(q, k, v, arrays)
    args = bench.parse_args(["--simulate", "--skip-above-gib", "1"])
    peer = bench.measure_peer(backend, cfg, q, k, v, ref, arrays, args)
    if backend == "broken":
        assert peer["ms"] is None and peer["rel_err"] is None
        assert peer["note"].startswith("failed: RuntimeError: No available kernel")
        assert "broken kernel not used because: reasons" in peer["note"]  # torch's reason, from its warning
        return
    assert peer["ms"] == 2.0 and peer["tbs"] == pytest.approx(cfg.kv_bytes / 2e-3 / 1e12)
    assert peer["rel_err"] < 1e-12
    if backend == "gqa-ok":
        assert peer["note"] == "" and {kv_heads for _, _, kv_heads in state["calls"]} == {2}
    else:  # K/V expanded to the 4 query heads, outside the timed call; the row says so
        assert peer["note"].startswith("expanded kv") and "2x" in peer["note"]
        assert state["calls"][-1] == ("refuses-gqa", False, 4)
