"""The autotune cache: keyed by GPU and problem class, written atomically, read back."""

from __future__ import annotations

import json

import pytest

from numba_flash import tuning
from numba_flash.kernels.tiles import STATIC_SMEM_LIMIT, smem_bytes


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(tuning, "_gpu_name", lambda: "Test GPU")
    tuning._load.cache_clear()
    yield tmp_path
    tuning._load.cache_clear()


def test_cache_lives_in_the_user_cache_dir(cache):
    assert tuning.cache_path() == cache / "numba_flash" / "tiles.json"


def test_save_then_lookup(cache):
    assert tuning.tuned_tiles("fa2", 64, "float32", False) is None
    tuning.save("fa2", 64, "float32", False, (32, 16), 19.5)
    assert tuning.tuned_tiles("fa2", 64, "float32", False) == (32, 16)
    assert tuning.tuned_tiles("fa2", 64, "float32", True) is None  # another class
    tuning.save("fa1", 64, "float32", False, (64, 32), 3.0)
    data = json.loads(tuning.cache_path().read_text())
    assert set(data) == {"v2|Test GPU|fa2|d64|float32|full", "v2|Test GPU|fa1|d64|float32|full"}


def test_entries_from_older_kernels_or_unrunnable_tiles_are_ignored(cache):
    """A choice timed on the layout-1 kernels (key without version; 128 x 32 was their
    default and no longer fits shared memory) must not break a plain call."""
    tuning.cache_path().parent.mkdir(parents=True)
    tuning.cache_path().write_text(json.dumps({
        "Test GPU|fa2|d64|float32|full": {"tiles": [128, 16], "tflops": 19.0},
        "v2|Test GPU|fa2|d128|float32|full": {"tiles": [128, 32], "tflops": 9.0},
    }))
    assert tuning.tuned_tiles("fa2", 64, "float32", False) is None
    assert tuning.tuned_tiles("fa2", 128, "float32", False) is None


def test_other_gpu_does_not_see_the_entry(cache, monkeypatch):
    tuning.save("fa2", 64, "float32", False, (32, 16), 19.5)
    monkeypatch.setattr(tuning, "_gpu_name", lambda: "Other GPU")
    assert tuning.tuned_tiles("fa2", 64, "float32", False) is None


def test_corrupt_cache_is_ignored(cache):
    tuning.cache_path().parent.mkdir(parents=True)
    tuning.cache_path().write_text("{not json")
    assert tuning.tuned_tiles("fa2", 64, "float32", False) is None


def test_candidates_fit_shared_memory():
    for d in (16, 64, 128):
        cands = tuning.candidates(d)
        assert cands and all(smem_bytes(d, m, n) <= STATIC_SMEM_LIMIT for m, n in cands)
    assert (256, 64) not in tuning.candidates(128)
