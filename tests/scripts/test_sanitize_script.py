"""scripts/sanitize.py without a GPU: its report parser on compute-sanitizer output (kernel
errors fail, host API errors do not), its case list, and a few cases run in the simulator."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import script_module


@pytest.fixture(scope="module")
def sanitize():
    yield from script_module("sanitize.py", "sanitize_script")


DONE = "SANITIZE-CHILD-DONE 200 cases, 0 failed, 95 s"

HOST_NOISE = """\
========= COMPUTE-SANITIZER
========= Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to "invalid argument" on CUDA API call to cuGetProcAddress_v2.
=========     Saved host backtrace up to driver entry point at error
=========         Host Frame: [0x2f0c3] in libcuda.so.1
========= Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to "invalid argument" on CUDA API call to cuGetProcAddress_v2.
=========     Saved host backtrace up to driver entry point at error
"""

INVALID_READ = """\
========= Invalid __global__ read of size 4 bytes
=========     at fa2_forward+0x1a40
=========     by thread (3,0,0) in block (1,0,0)
=========     Address 0x7f0000001000 is out of bounds
"""

FAULT = """\
========= Program hit CUDA_ERROR_ILLEGAL_ADDRESS (error 700) due to "an illegal memory access was encountered" on CUDA API call to cuStreamSynchronize.
"""


def test_host_api_errors_alone_are_clean(sanitize):
    report = sanitize.parse_report(HOST_NOISE + "========= ERROR SUMMARY: 2 errors\n" + DONE, "memcheck")
    assert report.ok and len(report.host_errors) == 2 and report.unexplained == 0
    assert "cuGetProcAddress_v2" in "\n".join(report.lines())


def test_an_invalid_access_fails(sanitize):
    report = sanitize.parse_report(HOST_NOISE + INVALID_READ + "========= ERROR SUMMARY: 3 errors\n" + DONE, "memcheck")
    assert not report.ok and len(report.kernel_errors) == 1
    assert report.kernel_errors[0].startswith("Invalid __global__ read")


@pytest.mark.parametrize("line", [
    "========= Invalid __shared__ write of size 16 bytes",
    "========= Misaligned Shared or Local Address",
    "========= Out-of-range Shared or Local Address",
    "========= Barrier error detected. Divergent thread(s) in block",
    "========= Uninitialized __global__ memory read of size 4 bytes",
    "========= Error: Race reported between Write access at fa1_forward+0x100 and Read access at fa1_forward+0x200",
])
def test_kernel_error_kinds(sanitize, line):
    assert not sanitize.parse_report(line + "\n" + DONE, "memcheck").ok


def test_a_kernel_fault_surfacing_on_an_api_call_fails(sanitize):
    report = sanitize.parse_report(FAULT + "========= ERROR SUMMARY: 1 error\n" + DONE, "memcheck")
    assert not report.ok and report.kernel_errors and not report.host_errors


def test_errors_the_report_does_not_explain_fail(sanitize):
    report = sanitize.parse_report(HOST_NOISE + "========= ERROR SUMMARY: 5 errors\n" + DONE, "memcheck")
    assert report.unexplained == 3 and not report.ok


@pytest.mark.parametrize("hazards, ok", [(0, True), (4, False)])
def test_racecheck_hazards(sanitize, hazards, ok):
    text = f"========= RACECHECK SUMMARY: {hazards} hazards displayed ({hazards} errors, 0 warnings)\n" + DONE
    assert sanitize.parse_report(text, "racecheck").ok is ok


def test_a_failed_case_or_an_unfinished_child_fails(sanitize):
    assert not sanitize.parse_report("SANITIZE-CASE-FAILED ieee-fa1-x: AssertionError: NaN\n" + DONE, "memcheck").ok
    assert not sanitize.parse_report(HOST_NOISE, "memcheck").ok  # crashed before the end


def test_the_cases_cover_the_matrix(sanitize):
    names = [name for name, _ in sanitize.build_cases(("ieee",), "default", xp=np)]
    assert len(names) == len(set(names)) == 2 * 2 * 2 * 5 * 5
    for part in ("fa1", "fa2", "float16", "float32", "causal", "full", "D8", "D40", "D100", "D128",
                 "Nq1-", "Nk17", "Nq33", "H4/2"):
        assert any(part in n for n in names), part
    tensor = [name for name, _ in sanitize.build_cases(("f16", "tf32x3"), "default", xp=np)]
    assert tensor and all(n.startswith(("f16-", "tf32x3-")) for n in tensor)
    assert len(sanitize.build_cases(("ieee",), "all", xp=np)) > len(names)


def test_cases_run_in_the_simulator(sanitize):
    """The cases' own checks (every element written, close to float64) on NumPy arrays."""
    from numba_flash._world import simulated

    if not simulated():
        pytest.skip("the script's child runs them on the GPU")
    cases = dict(sanitize.build_cases(("ieee",), "all", xp=np))  # small tiles: fast in the simulator
    for name in ("ieee-fa1-float16-causal-D40-Nq33-Nk17-B2H4/2-8x2", "ieee-fa2-float32-full-D8-Nq1-Nk33-B2H4/2-2x4"):
        cases[name]()


def test_split_kv_cases_run_in_the_simulator(sanitize):
    """The split-KV cases (FA-2 with three splits, decode on a NaN-poisoned ragged cache) check
    their own results; the decode one runs in the simulator (an FA-2 split case there cost 23 s;
    its kernels are tests/host/test_split_kv.py's)."""
    from numba_flash._world import simulated

    if not simulated():
        pytest.skip("the script's child runs them on the GPU")
    cases = dict(sanitize.build_cases(("ieee", "f16"), "default", xp=np, split_kv=True))
    assert any(n.startswith("decode-float16") for n in cases) and any("split3" in n for n in cases)
    assert {n.split("-")[-2] for n in cases if "paged" in n} == {"paged16", "paged48"}
    assert "ieee-fa2-split3-float32-causal-D40-Nq1-Nk33-B2H4/2" in cases
    cases["decode-float32-causal-D40-Nq1-ragged"]()


def test_variant_cases_run_in_the_simulator(sanitize):
    """The ablation variants' cases check their own results (two of them, in the simulator: one
    on CUDA cores, split_k on tensor cores)."""
    from numba_flash._world import simulated

    if not simulated():
        pytest.skip("the script's child runs them on the GPU")
    cases = dict(sanitize.build_cases(("ieee",), "default", xp=np, variants=True))
    assert len(cases) == 24 * 12  # float32, float16 on CUDA cores, float16 on tensor cores; causal or not; 2 shapes
    cases["variant-q_outer-heads_x_qtiles-every_step-split_q-at_update-float32-causal-D40-Nq17-Nk33"]()
    cases["variant-kv_outer-heads-deferred-split_k-at_update-float16-tc-causal-D40-Nq33-Nk17"]()


def test_backward_cases_check_their_gradients(sanitize, monkeypatch):
    """The backward cases run every loop order and check dq, dk, dv against float64: one case
    passes with float64 results in the forward's and the backward's place, and fails when the
    backward returns a wrong dk. (The case's checking is under test here; the kernels it runs on the
    GPU are tests/host/test_backward*.py's: running them here cost ~40 s of the simulator.)"""
    from numba_flash._world import simulated

    if not simulated():
        pytest.skip("the script's child runs them on the GPU")
    cases = dict(sanitize.build_cases(("ieee",), "default", xp=np, backward=True))
    assert len(cases) == 3 * 3 * 2 * 2 * len(sanitize.LENGTHS)  # loop orders x (float32, float16 x 2 regimes) x ..
    assert {n.split("-float")[0] for n in cases} == {"backward-fa1", "backward-fa2", "backward-fa2-deterministic"}
    assert "backward-fa2-float16-causal-D40-Nq1-Nk33-B2H4/2" in cases  # tensor cores (run: test_backward_tc.py)
    assert "backward-fa2-float16-ieee-causal-D40-Nq1-Nk33-B2H4/2" in cases  # CUDA cores
    name = "backward-fa2-float32-causal-D40-Nq1-Nk33-B2H4/2"
    import numba_flash.backward as backward

    from numba_flash import reference

    def gradients(dk_error):
        def stand_in(do, q, k, v, o, lse, *, algorithm, deterministic, **mods):  # float64 gradients
            dq, dk, dv = reference.attention_backward(do, q, k, v, **mods)
            return dq, dk + dk_error, dv

        return stand_in

    import numba_flash.api as api

    monkeypatch.setattr(api, "forward", lambda q, k, v, *, precision, **mods: reference.attention(q, k, v, **mods))
    monkeypatch.setattr(backward, "attention_backward", gradients(0.0))
    cases[name]()
    monkeypatch.setattr(backward, "attention_backward", gradients(1.0))  # dk off by one
    with pytest.raises(AssertionError, match="dk"):
        cases[name]()


def test_mask_cases_pass_their_masks_on(sanitize, monkeypatch):
    """The mask cases (windows, softcap and ALiBi through every path; run under compute-sanitizer
    on the GPU) give the kernels the case's window, cap and slopes and check against the reference
    with the same ones: a stand-in forward that computes what it is asked passes, one that drops
    the window, or the slopes, fails. (The kernels themselves are tests/host/test_windows.py's,
    test_softcap.py's and test_alibi.py's.)"""
    from numba_flash import reference

    cases = dict(sanitize.build_cases(("ieee",), "default", xp=np, masks=True))
    assert len(cases) == len(sanitize.MASKS) * (3 * (2 * 3 + 2 + 3 * 2) + 2) + 8  # forward, split, backward; decode; user
    import numba_flash.api as api

    def stand_in(drop=None):
        def forward(q, k, v, *, out, lse_out, window_size=(-1, -1), softcap=0.0, causal=False, alibi_slopes=None,
                    **_):
            window = (-1, -1) if drop == "window" else window_size
            slopes = None if drop == "alibi" else alibi_slopes
            o, lse = reference.attention(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                         alibi_slopes=slopes)
            out[...], lse_out[...] = o, lse
            return out, lse_out

        return forward

    for name, drop in (("mask-w5_3-fa2-float32-ieee-Nq17-Nk33", "window"),
                       ("mask-w-1_-1-causal-alibi-fa2-float32-ieee-Nq17-Nk33", "alibi")):
        monkeypatch.setattr(api, "forward", stand_in())
        cases[name]()
        monkeypatch.setattr(api, "forward", stand_in(drop))
        with pytest.raises(AssertionError, match="max"):
            cases[name]()
