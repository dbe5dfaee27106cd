"""Test set-up for both worlds: a real GPU, or Numba's CUDA simulator (CI).

The simulator must be chosen before numba.cuda is imported, so this module asks the
driver first (``numba_flash._world``) and only then imports anything that loads numba.
"""

import os
import sys

# The shared modules beside this file (helpers, fake_gpu, fake_nccl) are imported by name from
# the test subdirectories (kernels/, host/, research/, distributed/, scripts/, gpu/): this
# directory on sys.path, whichever import mode pytest runs in.
TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

from numba_flash._world import choose_world  # noqa: E402

choose_world()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from numba_flash._world import simulated  # noqa: E402

SIMULATED = simulated()

# Hypothesis profiles: "ci" is the fast default; HYPOTHESIS_PROFILE=thorough runs many more.
settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile(
    "thorough",
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if not SIMULATED:
        return
    skip = pytest.mark.skip(reason="needs a real CUDA GPU; this run uses Numba's CUDA simulator")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def xp():
    """The array module the kernels run on: NumPy in the simulator, CuPy on a GPU."""
    if SIMULATED:
        return np
    import cupy

    return cupy


@pytest.fixture
def rng():
    """A fresh generator per test (new inputs every run), its seed printed so that pytest
    shows it with a failure; rerun with NUMBA_FLASH_TEST_SEED=<seed> to reproduce."""
    seed = int(os.environ.get("NUMBA_FLASH_TEST_SEED") or np.random.SeedSequence().entropy % 2**63)
    print(f"rng seed: NUMBA_FLASH_TEST_SEED={seed}")
    return np.random.default_rng(seed)
