"""scripts/first_call.py without a GPU: one line saying what it needs, exit 2 (its measurement,
two fresh processes sharing a cache folder, is ``tests/gpu/test_gpu_host.py::
test_second_process_compiles_nothing``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from numba_flash._world import simulated

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "first_call.py"


@pytest.mark.skipif(not simulated(), reason="the refusal is for machines without a GPU")
def test_without_a_gpu_it_says_what_it_needs_and_exits_2():
    done = subprocess.run([sys.executable, str(SCRIPT), "--cases", "fwd_f32"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs" in lines[0] and "Traceback" not in done.stderr
