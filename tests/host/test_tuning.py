"""The autotune cache (``tile_cache``): keyed by GPU and problem class, written atomically, read
back; the GPU's name asked once per device."""

from __future__ import annotations

import json

import pytest

from numba_flash import tile_cache
from numba_flash.arch import STATIC_SMEM_LIMIT
from numba_flash.kernels.tiles import smem_bytes
from numba_flash.research import tuning


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(tile_cache, "gpu_name", lambda device_id: "Test GPU")
    tile_cache.load.cache_clear()
    yield tmp_path
    tile_cache.load.cache_clear()


def test_cache_lives_in_the_user_cache_dir(cache):
    assert tile_cache.cache_path() == cache / "numba_flash" / "tiles.json"


def test_save_then_lookup(cache):
    assert tile_cache.tuned_tiles("fa2", 64, "float32", False, 0) is None
    tile_cache.save("fa2", 64, "float32", False, (32, 16), 19.5, device_id=0)
    assert tile_cache.tuned_tiles("fa2", 64, "float32", False, 0) == (32, 16)
    assert tile_cache.tuned_tiles("fa2", 64, "float32", True, 0) is None  # another class
    tile_cache.save("fa1", 64, "float32", False, (64, 32), 3.0, device_id=0)
    data = json.loads(tile_cache.cache_path().read_text())
    assert set(data) == {"v2|Test GPU|fa2|d64|float32|full", "v2|Test GPU|fa1|d64|float32|full"}


def test_entries_from_older_kernels_or_unrunnable_tiles_are_ignored(cache):
    """A choice timed on the layout-1 kernels (key without version) and one the kernels cannot
    run (256 x 32 at D = 128: 512 threads of up to 255 registers) must not break a plain call."""
    tile_cache.cache_path().parent.mkdir(parents=True)
    tile_cache.cache_path().write_text(json.dumps({
        "Test GPU|fa2|d64|float32|full": {"tiles": [128, 16], "tflops": 19.0},
        "v2|Test GPU|fa2|d128|float32|full": {"tiles": [256, 32], "tflops": 9.0},
    }))
    assert tile_cache.tuned_tiles("fa2", 64, "float32", False, 0) is None
    assert tile_cache.tuned_tiles("fa2", 128, "float32", False, 0) is None


def test_other_gpu_does_not_see_the_entry(cache, monkeypatch):
    tile_cache.save("fa2", 64, "float32", False, (32, 16), 19.5, device_id=0)
    monkeypatch.setattr(tile_cache, "gpu_name", lambda device_id: "Other GPU")
    assert tile_cache.tuned_tiles("fa2", 64, "float32", False, 0) is None


def test_corrupt_cache_is_ignored(cache):
    tile_cache.cache_path().parent.mkdir(parents=True)
    tile_cache.cache_path().write_text("{not json")
    assert tile_cache.tuned_tiles("fa2", 64, "float32", False, 0) is None


def test_candidates_fit_shared_memory():
    for d in (16, 64, 128):
        cands = tuning.candidates(d)
        assert cands and all(smem_bytes(d, m, n) <= STATIC_SMEM_LIMIT for m, n in cands)
    assert (256, 64) not in tuning.candidates(128)


def test_gpu_name_is_asked_once_per_device(monkeypatch):
    """The driver is asked a device's name once, then never again on the call path."""
    import types

    from numba_flash import _cuda

    asked = []

    class Gpu:
        def __init__(self, i):
            self.i = i

        @property
        def name(self):
            asked.append(self.i)
            return f"GPU {self.i}".encode()

    fake = types.SimpleNamespace(gpus=[Gpu(0), Gpu(1)])
    monkeypatch.setattr(_cuda, "cuda", fake)
    tile_cache.gpu_name.cache_clear()
    try:
        for _ in range(3):
            assert tile_cache.gpu_name(1) == "GPU 1" and tile_cache.gpu_name(0) == "GPU 0"
        assert sorted(asked) == [0, 1]
    finally:
        tile_cache.gpu_name.cache_clear()


def test_no_cache_file_needs_no_gpu_name(cache, monkeypatch):
    """Without tuned entries the lookup answers without asking which GPU this is."""
    def boom(*_):
        raise AssertionError("asked the driver")

    monkeypatch.setattr(tile_cache, "gpu_name", boom)
    monkeypatch.setattr(tile_cache, "current_device_id", boom)
    assert tile_cache.tuned_tiles("fa2", 64, "float32", False) is None
