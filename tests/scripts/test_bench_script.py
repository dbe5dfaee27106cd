"""scripts/bench.py without a GPU: the plan, CSV and Markdown writing, plots, the entry point.

The measurements themselves need a GPU; everything around them is pure and tested here
on synthetic result rows whose expected ratios are worked out by hand.
"""

from __future__ import annotations

import csv

import pytest
from helpers import script_module

from numba_flash._world import simulated


@pytest.fixture(scope="module")
def bench():
    yield from script_module("bench.py", "bench_script")


def plan_for(bench, *argv, sdpa=None):
    return bench.build_plan(bench.parse_args(list(argv)), sdpa or {})


# ------------------------------------------------------------------------ the plan


def test_sweep_is_the_full_product_dtype_outermost(bench):
    plan = plan_for(bench, "--seq", "512", "1024", "2048", "--head-dim", "64", "128", "--dtype", "float32", "float16")
    configs = [cfg for cfg, _ in plan]
    assert len(configs) == 3 * 2 * 2 * 2  # seq x head_dim x causal (both) x dtype
    assert len(set(configs)) == len(configs)
    assert [c.dtype for c in configs] == ["float32"] * 12 + ["float16"] * 12
    assert {(c.batch, c.heads) for c in configs} == {(4, 16)}


@pytest.mark.parametrize("causal, expected", [("both", {False, True}), ("on", {True}), ("off", {False})])
def test_causal_choice(bench, causal, expected):
    plan = plan_for(bench, "--seq", "512", "--head-dim", "64", "--dtype", "float32", "--causal", causal)
    assert len(plan) == len(expected)
    assert {cfg.causal for cfg, _ in plan} == expected


def test_fa1_above_the_limit_is_recorded_as_skipped_not_dropped(bench):
    plan = plan_for(
        bench, "--seq", "4096", "8192", "16384", "--head-dim", "64", "--dtype", "float32", "--causal", "off",
        "--impl", "fa1", "fa2", "cupy", "--skip-fa1-above", "8192",
    )  # fmt: skip
    assert [len(entries) for _, entries in plan] == [3, 3, 3]
    statuses = {(cfg.seq, impl): status for cfg, entries in plan for impl, status in entries}
    assert statuses[(4096, "fa1")] is None and statuses[(8192, "fa1")] is None
    assert statuses[(16384, "fa1")].startswith("skipped: N=16384")
    assert statuses[(16384, "fa2")] is None and statuses[(16384, "cupy")] is None


def test_torch_expands_to_its_backends_or_is_recorded_missing(bench):
    sdpa = {"float16": ["torch-math", "torch-mem_efficient", "torch-flash"]}
    plan = plan_for(bench, "--seq", "512", "--head-dim", "64", "--causal", "off", "--impl", "fa2", "torch", sdpa=sdpa)
    entries = {cfg.dtype: entries for cfg, entries in plan}
    assert entries["float16"] == [("fa2", None), ("torch-math", None), ("torch-mem_efficient", None),
                                  ("torch-flash", None)]  # fmt: skip
    (impl, status), = entries["float32"][1:]
    assert impl == "torch" and status.startswith("missing")


def test_long_context_adds_one_fa2_row(bench):
    plain = plan_for(bench, "--seq", "512", "--head-dim", "64", "--dtype", "float32", "--causal", "off")
    plan = plan_for(bench, "--seq", "512", "--head-dim", "64", "--dtype", "float32", "--causal", "off",
                    "--long-context")  # fmt: skip
    assert len(plan) == len(plain) + 1
    cfg, entries = plan[-1]
    assert (cfg.batch, cfg.heads, cfg.seq, cfg.head_dim, cfg.dtype) == (1, 8, 131072, 64, "float32")
    assert cfg.suite == "long-context" and entries == [("fa2", None)]


def test_tokens_keeps_batch_times_seq_constant(bench):
    plan = plan_for(bench, "--tokens", "16384", "--seq", "1024", "4096", "--head-dim", "64", "--causal", "off",
                    "--dtype", "float32")  # fmt: skip
    assert [(cfg.seq, cfg.batch) for cfg, _ in plan] == [(1024, 16), (4096, 4)]
    with pytest.raises(SystemExit):
        bench.parse_args(["--tokens", "1000", "--seq", "4096"])


# -------------------------------------------------------------- synthetic results


def config(bench, seq, causal, dtype="float32", head_dim=64):
    return bench.Config(seq=seq, head_dim=head_dim, causal=causal, dtype=dtype, batch=4, heads=16)


def timed(bench, cfg, impl, ms, rel_err=None):
    from numba_flash.research.profiling.timing import tflops

    row = bench.new_row(cfg, impl, "ok")
    row.update(ms=ms, tflops=tflops(cfg.flops, ms), rel_err=rel_err, rel_err_scope=None if rel_err is None else "all")
    return row


def one_config_rows(bench):
    cfg = config(bench, 1024, False)
    return [
        timed(bench, cfg, "fa1", 4.0, rel_err=1e-7),
        timed(bench, cfg, "fa2", 1.0, rel_err=2e-7),
        timed(bench, cfg, "cupy", 2.0),
        timed(bench, cfg, "torch-mem_efficient", 1.5),
        bench.new_row(cfg, "torch-flash", "failed: RuntimeError: No available kernel"),
    ]


def test_ratios_are_peer_time_over_own_time(bench):
    rows = one_config_rows(bench)
    bench.add_ratios(rows)
    by_impl = {r["impl"]: r for r in rows}
    assert by_impl["fa2"]["vs_cupy"] == pytest.approx(2.0 / 1.0)
    assert by_impl["fa1"]["vs_cupy"] == pytest.approx(2.0 / 4.0)
    assert by_impl["cupy"]["vs_cupy"] == pytest.approx(1.0)
    assert by_impl["fa2"]["vs_sdpa_mem_efficient"] == pytest.approx(1.5 / 1.0)
    assert by_impl["fa1"]["vs_sdpa_mem_efficient"] == pytest.approx(1.5 / 4.0)
    assert by_impl["torch-flash"]["vs_cupy"] is None


def test_csv_has_the_columns_and_one_row_per_impl(bench, tmp_path):
    rows = one_config_rows(bench)
    bench.add_ratios(rows)
    path = tmp_path / "bench.csv"
    bench.write_csv(rows, path)
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        read = list(reader)
    assert reader.fieldnames[:13] == [
        "seq", "head_dim", "causal", "dtype", "batch", "heads", "impl",
        "ms", "tflops", "rel_err", "vs_cupy", "vs_sdpa_mem_efficient", "status",
    ]  # fmt: skip
    assert [r["impl"] for r in read] == ["fa1", "fa2", "cupy", "torch-mem_efficient", "torch-flash"]
    fa2 = read[1]
    assert float(fa2["ms"]) == 1.0 and float(fa2["vs_cupy"]) == 2.0 and float(fa2["rel_err"]) == 2e-7
    assert read[-1]["status"].startswith("failed: RuntimeError") and read[-1]["ms"] == ""


def sweep_rows(bench):
    """Two groups (non-causal, causal) x two lengths, with hand-picked times."""
    rows = []
    nc1, nc2, c1, c2 = (config(bench, n, causal) for causal in (False, True) for n in (1024, 2048))
    rows += [timed(bench, nc1, "fa1", 4.0, 1e-7), timed(bench, nc1, "fa2", 1.0, 1e-7),
             timed(bench, nc1, "cupy", 2.0), timed(bench, nc1, "torch-mem_efficient", 1.5)]  # fmt: skip
    rows += [timed(bench, nc2, "fa1", 10.0, 1e-7), timed(bench, nc2, "fa2", 4.0, 1e-7),
             timed(bench, nc2, "cupy", 9.0), timed(bench, nc2, "torch-mem_efficient", 5.0)]  # fmt: skip
    rows += [timed(bench, c1, "fa1", 3.0, 1e-7), timed(bench, c1, "fa2", 2.0, 1e-7),
             timed(bench, c1, "cupy", 2.5), timed(bench, c1, "torch-mem_efficient", 1.0)]  # fmt: skip
    rows += [bench.new_row(c2, "fa1", "skipped: N=2048 > --skip-fa1-above 1024"),
             timed(bench, c2, "fa2", 5.0, 1e-7), timed(bench, c2, "cupy", 6.0),
             bench.new_row(c2, "torch-mem_efficient", "failed: OutOfMemoryError: x")]  # fmt: skip
    return rows


def markdown_tables(text: str) -> dict[str, list[dict]]:
    """``{section title: [{column: cell}]}`` for every ``###`` section's table."""
    tables, title, header = {}, None, None
    for line in text.splitlines():
        if line.startswith("### "):
            title, header = line[4:], None
            tables[title] = []
        elif line.startswith("|") and title is not None:
            cells = [c.strip() for c in line.strip("|").split("|")]
            if header is None:
                header = cells
            elif not set(line) <= set("|-: "):
                tables[title].append(dict(zip(header, cells)))
    return tables


META = {"command": "`python scripts/bench.py --seq 1024 2048`", "GPU": "Test GPU", "date": "2026-01-01"}


def test_markdown_one_table_per_group_with_hand_computed_ratios(bench):
    text = bench.markdown_report(sweep_rows(bench), META)
    assert "`python scripts/bench.py --seq 1024 2048`" in text and "Test GPU" in text
    tables = markdown_tables(text)
    assert list(tables) == ["float32, D=64, non-causal", "float32, D=64, causal"]
    noncausal, causal = (tables[t] for t in tables)
    assert [r["N"] for r in noncausal] == ["1024", "2048"] and [r["N"] for r in causal] == ["1024", "2048"]
    ratios = [(r["FA-2/FA-1"], r["FA-2/SDPA-mem-efficient"]) for r in noncausal + causal]
    # FA-1 ms / FA-2 ms and SDPA ms / FA-2 ms: 4/1, 1.5/1; 10/4, 5/4; 3/2, 1/2; FA-1 skipped, SDPA failed.
    assert ratios == [("4.00x", "1.50x"), ("2.50x", "1.25x"), ("1.50x", "0.50x"), ("—", "—")]
    # TFLOP/s cells: 4*B*H*N*N*D / time, halved for causal; 4*4*16*1024*1024*64 = 17.18e9 FLOP in 1 ms.
    assert noncausal[0]["fa2"] == "17.18" and causal[0]["fa2"] == "4.29"  # half the FLOPs in 2 ms
    assert causal[1]["fa1"] == "skipped" and causal[1]["torch-mem_efficient"] == "failed"
    assert noncausal[0]["rel err fa2"] == "1.0e-07"
    assert "N=2048 torch-mem_efficient: failed: OutOfMemoryError: x" in text


def test_markdown_long_context_section(bench):
    cfg = bench.Config(**bench.LONG_CONTEXT, suite="long-context")
    row = timed(bench, cfg, "fa2", 2000.0, rel_err=3e-7)
    row.update(rel_err_scope="head 0, last 7629 rows", extra_mem_bytes=1 * 8 * 131072 * 4)
    tables = markdown_tables(bench.markdown_report([row], META))
    (long_row,) = tables["Long context (FA-2)"]
    assert long_row["N"] == "131072" and long_row["ms"] == "2000.0"
    assert long_row["extra device memory"] == "4.0 MiB"  # 8 * 131072 * 4 B = 4 MiB: the logsumexp
    assert long_row["S in float32 (B*H*N*N*4)"] == "512.0 GiB"  # 4 MiB * 131072
    assert long_row["checked on"] == "head 0, last 7629 rows"


def test_backward_table_with_hand_computed_ratios(bench, tmp_path):
    """--backward rows: a backward table beside the group's (CuPy has no backward), its ratios
    from the backward times, FA's gradient errors; bench.csv carries the backward columns."""
    rows = one_config_rows(bench)
    for impl, bwd_ms, err in (("fa1", 8.0, 3e-7), ("fa2", 2.0, 4e-7), ("torch-mem_efficient", 5.0, None)):
        row = next(r for r in rows if r["impl"] == impl)
        row.update(bwd_ms=bwd_ms, bwd_tflops=2.5 * row["tflops"] * row["ms"] / bwd_ms, grad_rel_err=err,
                   grad_rel_err_scope=None if err is None else "batch 0, kv head 0")
    tables = markdown_tables(bench.markdown_report(rows, META))
    assert list(tables) == ["float32, D=64, non-causal", "float32, D=64, non-causal: backward"]
    (bwd,) = tables["float32, D=64, non-causal: backward"]
    assert "cupy" not in bwd and bwd["torch-flash"] == "failed"
    assert (bwd["FA-2/FA-1"], bwd["FA-2/SDPA-mem-efficient"]) == ("4.00x", "2.50x")  # 8/2, 5/2
    assert bwd["fa2"] == "21.47"  # 2.5 * 17.18e9 FLOP in 2 ms
    assert bwd["grad rel err fa2"] == "4.0e-07†"
    bench.write_csv(rows, tmp_path / "bench.csv")
    with open(tmp_path / "bench.csv", newline="") as f:
        read = {r["impl"]: r for r in csv.DictReader(f)}
    assert float(read["fa2"]["bwd_ms"]) == 2.0 and float(read["fa1"]["grad_rel_err"]) == 3e-7
    assert read["cupy"]["bwd_ms"] == ""
    assert "Backward" not in bench.markdown_report(one_config_rows(bench), META)  # only with --backward


def test_tiles_are_the_ones_that_ran(bench, tmp_path):
    rows = one_config_rows(bench)[:2]
    rows[0].update(block_m=64, block_n=32)
    rows[1].update(block_m=128, block_n=64)
    bench.write_csv(rows, tmp_path / "bench.csv")
    with open(tmp_path / "bench.csv", newline="") as f:
        assert [r["tiles"] for r in csv.DictReader(f)] == ["64x32", "128x64"]
    assert "Tiles (block_m x block_n): FA-1 64x32, FA-2 128x64." in bench.markdown_report(rows, META)


def test_plots_are_png_files(bench, tmp_path):
    written = bench.write_plots(sweep_rows(bench), tmp_path, "Test GPU")
    assert [p.name for p in written] == ["tflops_float32_d64_noncausal.png", "tflops_float32_d64_causal.png"]
    for path in written:
        data = path.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000


# ------------------------------------------------------------- measuring a config


def test_a_config_is_measured_on_one_problem_and_failures_stay_in_their_rows(bench):
    """The harness's rows, in whichever world: FA-2 checked against float64 with the tiles it ran,
    a peer that cannot run fails in its own row, a row the plan skipped keeps its status."""
    cfg = bench.Config(seq=16, head_dim=4, causal=True, dtype="float32", batch=1, heads=2)
    entries = [("fa2", None), ("torch-nothing", None), ("fa1", "skipped: N=16 > --skip-fa1-above 8")]
    reported = []
    rows = bench.measure_config(cfg, entries, 0, 2, lambda row, seconds: reported.append(row["impl"]))
    assert reported == ["fa2", "torch-nothing", "fa1"]
    fa2, peer, fa1 = rows
    assert (fa2["status"], fa2["rel_err_scope"], fa2["suite"]) == ("ok", "all", "sweep") and fa2["rel_err"] < 1e-5
    assert fa2["block_m"] and fa2["block_n"] and fa2["vs_cupy"] is None
    assert peer["status"].startswith("failed: ValueError: no peer 'torch-nothing'") and peer["ms"] is None
    assert fa1["status"] == "skipped: N=16 > --skip-fa1-above 8"


def test_backward_rows_check_the_gradients(bench):
    """--backward: FA-2's row holds its gradients' error against float64 (timed on a GPU only)."""
    cfg = bench.Config(seq=12, head_dim=4, causal=True, dtype="float32", batch=1, heads=2)
    (fa2,) = bench.measure_config(cfg, [("fa2", None)], 0, 2, lambda *_: None, backward=True)
    assert fa2["status"] == "ok" and fa2["grad_rel_err_scope"] == "all" and fa2["grad_rel_err"] < 1e-5
    assert (fa2["bwd_ms"] is None) == simulated()


def test_inputs_that_cannot_be_made_fail_every_row_to_run(bench, monkeypatch):
    def out_of_memory(p, seed):
        raise MemoryError("no room for q")

    monkeypatch.setattr(bench.harness, "make_problem", out_of_memory)
    cfg = config(bench, 1024, False)
    rows = bench.measure_config(cfg, [("fa2", None), ("fa1", "skipped: N"), ("cupy", None)], 0, 2, lambda *_: None)
    assert [r["status"] for r in rows] == ["failed: MemoryError: no room for q", "skipped: N",
                                           "failed: MemoryError: no room for q"]  # fmt: skip


def test_a_row_past_the_tolerance_is_inaccurate_and_long_context_records_memory(bench, monkeypatch):
    seen = []

    def measured(problem, impl, repeats, **options):
        seen.append((repeats, options))
        row = bench.harness.new_row(problem["p"], impl, "ok")
        row.update(ms=2.0, rel_err=problem["rel_err"])
        return row

    monkeypatch.setattr(bench.harness, "measure_or_fail", measured)
    sweep, long = config(bench, 1024, False), bench.Config(**bench.LONG_CONTEXT, suite="long-context")
    assert bench.measure_row(sweep, {"p": sweep.problem(), "rel_err": 2e-4}, "fa2", 20)["status"] == (
        "inaccurate: rel_err 2.0e-04 > 1e-04")
    assert bench.measure_row(long, {"p": long.problem(), "rel_err": 5e-5}, "fa2", 5)["status"] == "ok"
    assert bench.measure_row(sweep, {"p": sweep.problem(), "rel_err": 0.0}, "fa2", 20, backward=True)["status"] == "ok"
    assert seen == [(20, dict(warmup=3, device_memory=False)), (5, dict(warmup=1, device_memory=True)),
                    (20, dict(warmup=3, device_memory=False, backward=True))]


# --------------------------------------------------------------------- entry point

H200_COMMAND = (
    "python scripts/bench.py --seq 1024 2048 4096 8192 --head-dim 64 128 "
    "--dtype float32 float16 --causal both --long-context --out bench-out"
)


def test_docstring_gives_the_h200_command_and_it_parses(bench):
    assert H200_COMMAND in bench.__doc__
    plan = plan_for(bench, *H200_COMMAND.split()[2:])
    assert len(plan) == 4 * 2 * 2 * 2 + 1  # the sweep and the long-context row


def test_backward_applies_to_the_sweep_not_the_long_context_row(bench, monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(bench, "measure_config",
                        lambda cfg, entries, seed, repeats, report, backward=False: seen.append((cfg.suite, backward))
                        or [])
    args = bench.parse_args(["--seq", "512", "--head-dim", "64", "--dtype", "float32", "--causal", "off",
                             "--long-context", "--backward"])
    bench.run_plan(bench.build_plan(args, {}), args, META, tmp_path)
    assert seen == [("sweep", True), ("long-context", False)]


def test_launch_overhead_adds_its_rows_to_the_plan_and_a_section(bench):
    plain = plan_for(bench, "--seq", "512", "--head-dim", "64", "--dtype", "float32", "--causal", "off")
    plan = plan_for(bench, "--seq", "512", "--head-dim", "64", "--dtype", "float32", "--causal", "off",
                    "--launch-overhead")  # fmt: skip
    assert plan[:-1] == plain
    cfg, entries = plan[-1]
    assert (cfg.suite, cfg.batch, cfg.heads, cfg.seq, cfg.head_dim) == ("launch-overhead", 1, 1, 128, 64)
    assert [impl for impl, _ in entries] == ["fa2", "fa1", bench.LAUNCH_FLOOR]
    rows = []
    for impl, loop_us, sync_us in (("fa2", 90.0, 116.0), ("fa1", 80.0, 105.5)):
        row = bench.new_row(cfg, impl, "ok")
        row.update(ms=loop_us / 1e3, sync_ms=sync_us / 1e3)
        rows.append(row)
    rows.append(bench.new_row(cfg, bench.LAUNCH_FLOOR, "failed: RuntimeError: x"))
    tables = markdown_tables(bench.markdown_report(rows, META))
    assert list(tables) == ["Launch overhead"]  # no sweep table for these rows
    fa2, fa1, floor = tables["Launch overhead"]
    assert (fa2["us per call in a loop"], fa2["us per synchronised call (median)"]) == ("90.0", "116.0")
    assert fa1["us per synchronised call (median)"] == "105.5" and floor["us per call in a loop"].startswith("failed")


def test_per_call_cost_counts_every_call_and_synchronises(bench):
    calls, syncs = [], []
    loop_us, sync_us = bench.per_call_us(lambda: calls.append(1), 50, lambda: syncs.append(len(calls)), single=7)
    assert len(calls) == bench.LAUNCH_WARMUP + 50 + 7
    assert syncs[:2] == [bench.LAUNCH_WARMUP, bench.LAUNCH_WARMUP + 50] and len(syncs) == 2 + 7
    assert 0 <= loop_us < 1e5 and 0 <= sync_us < 1e5


def test_dry_run_prints_the_plan(bench, capsys):
    assert bench.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "40 configurations" in out  # 5 seq x 2 head_dim x 2 causal x 2 dtype


@pytest.mark.skipif(not simulated(), reason="on a GPU main([]) would run the whole sweep")
def test_without_a_gpu_main_exits_2(bench, capsys):
    with pytest.raises(SystemExit) as stop:
        bench.main([])
    assert stop.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
