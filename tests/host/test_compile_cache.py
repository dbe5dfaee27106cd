"""The persistent compilation cache (``numba_flash.compile_cache``) and its use by the launch
path, on the CPU: keys, invalidation, whole entries under concurrent writers, ``numba-flash
cache info|clear``. The GPU side (a second process loads what the first compiled, and compiles
nothing) is ``tests/gpu/test_gpu_host.py::test_second_process_compiles_nothing``."""

from __future__ import annotations

import multiprocessing
import pathlib
import shutil
import types

import pytest

from numba_flash import compile_cache, launch
from numba_flash.kernels.jit import kernel_factory, kernel_identity

CC = (9, 0)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(compile_cache.CACHE_DIR_VAR, str(tmp_path / "cache"))
    monkeypatch.setattr(compile_cache, "toolchain", lambda: {"numba-cuda": "test", "nvvm": "test"})
    return tmp_path / "cache"


def test_round_trip_and_every_key_part_invalidates(cache_dir, monkeypatch):
    assert compile_cache.lookup("k(d=64)", "float32", CC) is None
    assert compile_cache.store("k(d=64)", "float32", CC, "_Z6kernel", b"\x7fELF-cubin")
    assert compile_cache.lookup("k(d=64)", "float32", CC) == ("_Z6kernel", b"\x7fELF-cubin")
    assert compile_cache.entry_path(compile_cache.entry_key("k(d=64)", "float32", CC)[0]).is_relative_to(cache_dir)
    # another kernel, signature, GPU, toolchain, environment or source: not found
    assert compile_cache.lookup("k(d=128)", "float32", CC) is None
    assert compile_cache.lookup("k(d=64)", "float16", CC) is None
    assert compile_cache.lookup("k(d=64)", "float32", (8, 0)) is None
    monkeypatch.setenv("NUMBA_FLASH_TC_MAXREG", "128")
    assert compile_cache.lookup("k(d=64)", "float32", CC) is None
    monkeypatch.delenv("NUMBA_FLASH_TC_MAXREG")
    monkeypatch.setattr(compile_cache, "toolchain", lambda: {"numba-cuda": "other", "nvvm": "test"})
    assert compile_cache.lookup("k(d=64)", "float32", CC) is None
    monkeypatch.setattr(compile_cache, "toolchain", lambda: {"numba-cuda": "test", "nvvm": "test"})
    monkeypatch.setattr(compile_cache, "source_digest", lambda package=None: "edited")
    assert compile_cache.lookup("k(d=64)", "float32", CC) is None


def test_a_torn_or_foreign_file_is_not_loaded(cache_dir):
    compile_cache.store("k()", "int32", CC, "_Z1k", b"cubin-bytes" * 10)
    path = compile_cache.entry_path(compile_cache.entry_key("k()", "int32", CC)[0])
    whole = path.read_bytes()
    path.write_bytes(whole[:-5])  # a write cut short
    assert compile_cache.lookup("k()", "int32", CC) is None
    path.write_bytes(b"not an entry")
    assert compile_cache.lookup("k()", "int32", CC) is None
    path.write_bytes(whole)
    assert compile_cache.lookup("k()", "int32", CC) == ("_Z1k", b"cubin-bytes" * 10)


def _writer(seed: int, rounds: int) -> None:
    """(forked: the test's cache folder and toolchain are this process's too)"""
    for i in range(rounds):
        compile_cache.store("shared()", "", CC, f"_Z{seed}", bytes([seed]) * (1000 + 97 * ((seed + i) % 13)))


def test_concurrent_writers_leave_whole_entries(cache_dir):
    """Four processes store one key 50 times each while this one reads it: every read is one
    writer's whole cubin, and no temporary file is left behind."""
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(s, 50)) for s in (1, 2, 3, 4)]
    for p in procs:
        p.start()
    seen = 0
    while any(p.is_alive() for p in procs) or not seen:
        hit = compile_cache.lookup("shared()", "", CC)
        if hit is not None:
            name, cubin = hit
            seed = int(name[2:])
            assert cubin == bytes([seed]) * len(cubin) and (len(cubin) - 1000) % 97 == 0
            seen += 1
    for p in procs:
        p.join()
        assert p.exitcode == 0
    assert seen and not list(cache_dir.rglob(".tmp-*"))


def test_same_sources_same_digest_any_edit_another(tmp_path):
    """A reinstall of unchanged sources keeps the cache; an edited file invalidates it."""
    package = pathlib.Path(compile_cache.__file__).parent
    a, b = (shutil.copytree(package, tmp_path / name / "numba_flash",
                            ignore=shutil.ignore_patterns("__pycache__")) for name in ("a", "b"))
    assert compile_cache.source_digest(a) == compile_cache.source_digest(b) == compile_cache.source_digest()
    kernel = pathlib.Path(b) / "kernels" / "softmax.py"
    kernel.write_text(kernel.read_text() + "\n# an edit\n")
    compile_cache.source_digest.cache_clear()
    assert compile_cache.source_digest(b) != compile_cache.source_digest(a)


def test_kernel_factory_memoises_over_defaults_and_names_the_kernel():
    made = []

    @kernel_factory
    def make(head_dim, causal=False, tiles=(64, 32)):
        made.append(1)
        return types.SimpleNamespace()

    assert make(64) is make(64, False) is make(head_dim=64, causal=False, tiles=(64, 32))
    assert len(made) == 1
    assert kernel_identity(make(64)).endswith("make(head_dim=64, causal=False, tiles=(64, 32))")
    assert make(64, True) is not make(64)
    assert make(64, True) is make(64, causal=True) is make(64, True)  # each spelling remembered, one kernel
    assert len(made) == 2
    make.cache_clear()
    make(64)
    make(64)
    assert len(made) == 3

    @kernel_factory
    def by_object(thing):
        return types.SimpleNamespace()

    assert kernel_identity(by_object(object())) is None  # no stable repr: never stored


class _FakeLibrary:
    def __init__(self):
        self._setup_functions = []
        self._entry_name = "_Z4fake"

    def get_cufunc(self):
        return "compiled cufunc"

    def get_cubin(self):
        return types.SimpleNamespace(code=b"fake cubin")


class _FakeDispatcher:
    def __init__(self):
        self.compiled = 0
        self.numba_flash_identity = "tests.fake(d=64)"

    def compile(self, signature):
        self.compiled += 1
        return types.SimpleNamespace(_codelibrary=_FakeLibrary())


def test_launch_path_stores_what_it_compiles_and_loads_it_next_time(cache_dir, monkeypatch):
    """The first process compiles and stores; a later one (here: a new dispatcher of the same
    identity) loads the stored cubin and compiles nothing."""
    monkeypatch.setattr(launch, "_compute_capability", lambda device_id: CC)
    loaded = []
    monkeypatch.setattr(launch, "load_cubin", lambda name, cubin: loaded.append((name, cubin)) or "loaded cufunc")
    first = _FakeDispatcher()
    assert launch._load_or_compile(first, ("float32",), 0) == "compiled cufunc" and first.compiled == 1
    second = _FakeDispatcher()
    assert launch._load_or_compile(second, ("float32",), 0) == "loaded cufunc"
    assert second.compiled == 0 and loaded == [("_Z4fake", b"fake cubin")]
    anonymous = _FakeDispatcher()
    del anonymous.numba_flash_identity
    assert launch._load_or_compile(anonymous, ("float32",), 0) == "compiled cufunc" and len(loaded) == 1


def test_cache_command_counts_and_clears(cache_dir, monkeypatch, capsys):
    from numba_flash.research.cli import main

    compile_cache.store("a()", "", CC, "_Za", b"x" * 100)
    compile_cache.store("b()", "", CC, "_Zb", b"y" * 100)
    monkeypatch.setattr(compile_cache, "source_digest", lambda package=None: "older sources")
    compile_cache.store("c()", "", CC, "_Zc", b"z" * 100)
    monkeypatch.undo()
    monkeypatch.setenv(compile_cache.CACHE_DIR_VAR, str(cache_dir))
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert str(cache_dir) in out and "kernels:  3" in out and "2 for these sources" in out and "1 stale" in out
    assert main(["cache", "clear", "--stale"]) == 0
    assert "removed 1 stale" in capsys.readouterr().out and len(compile_cache.entries()) == 2
    assert main(["cache", "clear"]) == 0
    assert "removed 2" in capsys.readouterr().out and compile_cache.entries() == []


def test_resources_of_a_kernel_the_cache_supplied(monkeypatch):
    """A dispatcher whose kernel came from the cache compiled nothing (no overloads): its
    registers, shared and local bytes and occupancy come from the function this process loaded
    and launched (the harness reports them for every compare/ablate row on a GPU)."""
    from numba_flash._cuda import cuda
    from numba_flash.research.profiling.resources import compiled_resources

    dispatcher = types.SimpleNamespace(overloads={})
    loaded = types.SimpleNamespace(attrs=types.SimpleNamespace(regs=96, shared=1024, local=0), handle="h")
    context = types.SimpleNamespace(get_active_blocks_per_multiprocessor=lambda f, threads, smem: 4 if f is loaded else 0,
                                    device=types.SimpleNamespace(MAX_THREADS_PER_MULTIPROCESSOR=2048))
    monkeypatch.setattr(cuda, "current_context", lambda: context, raising=False)
    monkeypatch.setattr(launch, "_KERNELS", {})
    with pytest.raises(ValueError, match="launch it first"):
        compiled_resources(dispatcher, 128)
    launch._KERNELS[(id(dispatcher), 0, "float32")] = (dispatcher, "cuda.core kernel", 0, loaded)
    res = compiled_resources(dispatcher, 128)
    assert (res.regs, res.smem_bytes, res.local_bytes, res.blocks_per_sm, res.warps_per_sm) == (96, 1024, 0, 4, 16)
