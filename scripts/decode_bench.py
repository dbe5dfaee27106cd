"""Decode-bench sweep: achieved HBM bandwidth of ``numba_flash.decode`` against the GPU's peak
and PyTorch SDPA, over KV-cache lengths and batch sizes (issue 11).

The H200 run of the issue:

    python scripts/decode_bench.py --num-splits auto 1 --json decode.json --plot decode-plots

For every configuration (batch B, cache length N), in one process:

1. fresh standard-normal inputs, made once per configuration: q (B, H, Nq, D) and the caches
   k, v (B, Hkv, N, D) as CuPy arrays (torch tensors for bfloat16, which CuPy lacks), and
   ``cache_seqlens`` = N for every sequence (full caches: the peers compute the same problem);
2. numba_flash.decode for each ``--num-splits`` value (``auto``: the library's heuristic),
   checked against a float64 reference of batch 0, all heads (K/V upcast in chunks of
   ``REF_CHUNK`` keys, the scores materialised: an independent computation, not the merge)
   and timed by ``median_ms`` (CUDA events, median of ``--repeats`` runs after untimed warm-up
   calls; the first call, which compiles, is never timed);
3. the peers, where torch with CUDA is installed: SDPA restricted to its flash, memory-efficient
   and cuDNN backends, same dtype, ``enable_gqa=True``; a backend that refuses GQA is run on
   K/V expanded by ``repeat_interleave`` outside the timed region (noted "expanded kv": it reads
   H/Hkv times the K/V bytes); a backend that fails is recorded with its reason.

Headline bandwidth: the K and V bytes of the problem, 2 * B * Hkv * N * D * itemsize, over the
median time (q and o are counted in ``io_tbs`` only; peers are rated on the same K/V bytes, so
an expanded-kv peer's figure is its effective, not its raw, bandwidth). ``vs_best_sdpa`` is
the best peer's time over numba_flash's (> 1: numba_flash faster), the convention of
scripts/bench.py.

Outputs: a Markdown table on stdout, one progress line per measurement on stderr, ``--json``
(rewritten after every configuration, so a killed run keeps what it measured), ``--plot DIR``
(TB/s against N, one line per batch, peers dashed, the ``--peak-tbs`` line; ``--replot JSON
--plot DIR`` re-draws them and reprints the table from a saved ``--json``, no GPU). Configurations
whose K+V exceed ``--skip-above-gib`` are recorded as skipped. Exit status: 0, or 1 when a
numba_flash row failed or exceeded its error tolerance, 2 for bad arguments or no GPU.

Needs a CUDA GPU and CuPy (torch optional); ``--help`` and ``--dry-run`` need neither.
``--simulate`` runs one tiny configuration in Numba's CUDA simulator (timings null): what CI
exercises.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from numba_flash.research.cli import positive_int  # argparse type: an integer >= 1
from numba_flash.tile_table import MAX_HEAD_DIM

DTYPES = ("float16", "bfloat16", "float32")
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 3e-2}  # rel_err above: "inaccurate"
PEERS = ("flash", "mem_efficient", "cudnn")  # SDPA backends, by the names baselines.py gives them
WARMUP = 3  # untimed calls before timing (the correctness check before them has compiled)
REF_CHUNK = 65536  # keys upcast to float64 at a time by the reference
GIB = 2**30

# Defaults: the GPU sweep, and the one tiny configuration --simulate runs.
GPU_DEFAULTS = dict(cache=[1024, 4096, 16384, 65536, 131072, 262144, 1048576], batch=[1, 8, 64],
                    heads=32, kv_heads=8, head_dim=128, repeats=20)  # fmt: skip
SIM_DEFAULTS = dict(cache=[40], batch=[2], heads=4, kv_heads=2, head_dim=16, repeats=1)

# The keys of every --json row (the contract of the output; tests hold it).
ROW_KEYS = ("batch", "heads", "kv_heads", "q_len", "head_dim", "dtype", "cache_len", "num_splits",
            "ms", "kv_bytes", "tbs", "pct_peak", "rel_err", "peers", "vs_best_sdpa",
            "page_size", "paged_ms", "paged_tbs", "paged_rel_err", "paged_vs_contiguous",
            "paged_checked_ms", "paged_checked_vs_contiguous")  # fmt: skip


# ----------------------------------------------------------------------------- arguments


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number; got {text!r}") from None
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected a positive number; got {text}")
    return value


def splits_value(text: str) -> int | None:
    """``auto`` (or ``none``): the library's heuristic (None); else a positive integer."""
    if text.lower() in ("auto", "none"):
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a positive integer; got {text!r}")
    return value


def splits_label(num_splits: int | None) -> str:
    return "auto" if num_splits is None else str(num_splits)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="decode_bench.py", description=__doc__.split("\n\n")[0],
        epilog="Method and outputs: the docstring of scripts/decode_bench.py; theory: docs/theory/split-kv.md.",
    )  # fmt: skip
    gpu, sim = GPU_DEFAULTS, SIM_DEFAULTS
    ap.add_argument("--cache", type=positive_int, nargs="+", metavar="N",
                    help=f"KV-cache lengths (default: {' '.join(map(str, gpu['cache']))}; with --simulate: {sim['cache'][0]})")
    ap.add_argument("--batch", type=positive_int, nargs="+", metavar="B",
                    help=f"batch sizes (default: {' '.join(map(str, gpu['batch']))}; with --simulate: {sim['batch'][0]})")
    ap.add_argument("--heads", type=positive_int, help=f"query heads H (default: {gpu['heads']}; with --simulate: {sim['heads']})")
    ap.add_argument("--kv-heads", type=positive_int,
                    help=f"K/V heads Hkv, dividing H (default: {gpu['kv_heads']}; with --simulate: {sim['kv_heads']})")
    ap.add_argument("--q-len", type=positive_int, default=1, help="queries per sequence Nq (default: 1)")
    ap.add_argument("--head-dim", type=positive_int,
                    help=f"head dim D, 1..128 (default: {gpu['head_dim']}; with --simulate: {sim['head_dim']})")
    ap.add_argument("--dtype", choices=DTYPES, default="float16", help="input dtype (default: float16)")
    ap.add_argument("--num-splits", type=splits_value, nargs="+", default=[None], metavar="S",
                    help="num_splits values to time, 'auto' for the heuristic, e.g. 'auto 1' (default: auto)")
    ap.add_argument("--repeats", type=positive_int,
                    help=f"timed runs, median reported (default: {gpu['repeats']}; with --simulate: {sim['repeats']})")
    ap.add_argument("--peak-tbs", type=positive_float, default=4.8, help="the GPU's HBM peak in TB/s (default: 4.8, H200)")
    ap.add_argument("--skip-above-gib", type=positive_float, default=40.0,
                    help="record configurations whose K+V exceed this many GiB as skipped (default: 40)")
    ap.add_argument("--page-size", type=positive_int, metavar="P",
                    help="also time the keys paged (pages of P keys, a multiple of 16, in random order): "
                         "through a PageTable checked once, and the table checked per call (API.md 2e)")
    ap.add_argument("--no-peers", action="store_true", help="do not run PyTorch SDPA")
    ap.add_argument("--seed", type=int, default=0, help="random seed of the inputs (default: 0)")
    ap.add_argument("--json", metavar="PATH", help="write the rows (and the run's metadata) as JSON")
    ap.add_argument("--plot", metavar="DIR", help="write bandwidth plots (PNG, matplotlib) to DIR")
    ap.add_argument("--dry-run", action="store_true", help="print the planned configurations and exit")
    ap.add_argument("--replot", metavar="JSON",
                    help="no run: re-draw --plot DIR (and print the report) from a --json file of an earlier run")
    ap.add_argument("--simulate", action="store_true",
                    help="no GPU needed: run in Numba's CUDA simulator (tiny defaults, timings null)")
    return ap


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    for name, value in (SIM_DEFAULTS if args.simulate else GPU_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.heads % args.kv_heads:
        ap.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if args.head_dim > MAX_HEAD_DIM:
        ap.error(f"--head-dim must be 1..{MAX_HEAD_DIM}; got {args.head_dim}")
    if args.replot and not args.plot:
        ap.error("--replot needs --plot DIR (where the plots go)")
    # Repeats dropped, order kept.
    args.cache = list(dict.fromkeys(args.cache))
    args.batch = list(dict.fromkeys(args.batch))
    args.num_splits = list(dict.fromkeys(args.num_splits))
    return args


# ---------------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Config:
    """One problem: inputs made once, numba_flash timed per num_splits, the peers once."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    head_dim: int
    dtype: str
    cache_len: int

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V the problem reads: the headline bandwidth's numerator."""
        return 2 * self.batch * self.kv_heads * self.cache_len * self.head_dim * ITEMSIZE[self.dtype]

    @property
    def io_bytes(self) -> int:
        """K and V, plus q read and o written."""
        return self.kv_bytes + 2 * self.batch * self.heads * self.q_len * self.head_dim * ITEMSIZE[self.dtype]

    def label(self) -> str:
        return (f"{self.dtype} B{self.batch} H{self.heads}/{self.kv_heads} Nq{self.q_len} "
                f"D{self.head_dim} N{self.cache_len}")  # fmt: skip


def build_plan(args: argparse.Namespace) -> list[tuple[Config, str | None]]:
    """``[(Config, skip reason or None)]``: batch outermost, cache length inner."""
    plan = []
    for b in args.batch:
        for n in args.cache:
            cfg = Config(b, args.heads, args.kv_heads, args.q_len, args.head_dim, args.dtype, n)
            reason = None
            if cfg.kv_bytes > args.skip_above_gib * GIB:
                reason = f"skipped: K+V {cfg.kv_bytes / GIB:.1f} GiB > --skip-above-gib {args.skip_above_gib:g}"
            plan.append((cfg, reason))
    return plan


def format_plan(plan, num_splits) -> str:
    splits = ", ".join(splits_label(s) for s in num_splits)
    lines = [f"{i:3d}. {cfg.label()} (K+V {human_bytes(cfg.kv_bytes)}): "
             f"{reason or 'num_splits ' + splits + ' and the peers'}" for i, (cfg, reason) in enumerate(plan, 1)]  # fmt: skip
    run = sum(reason is None for _, reason in plan)
    lines.append(f"{len(plan)} configurations, {run} to run, {len(plan) - run} skipped")
    return "\n".join(lines)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# ------------------------------------------------------------------------ rows and ratios


def new_row(cfg: Config, num_splits: int | None, status: str) -> dict:
    row = dict.fromkeys(ROW_KEYS)
    row.update(batch=cfg.batch, heads=cfg.heads, kv_heads=cfg.kv_heads, q_len=cfg.q_len, head_dim=cfg.head_dim,
               dtype=cfg.dtype, cache_len=cfg.cache_len, num_splits=num_splits, kv_bytes=cfg.kv_bytes, peers={},
               status=status, best_sdpa=None, io_tbs=None)  # fmt: skip
    return row


def tbs(n_bytes: int, ms: float | None) -> float | None:
    return None if not ms else n_bytes / (ms * 1e-3) / 1e12


def set_time(row: dict, cfg: Config, ms: float | None, peak_tbs: float) -> None:
    row["ms"] = ms
    row["tbs"] = tbs(cfg.kv_bytes, ms)
    row["io_tbs"] = tbs(cfg.io_bytes, ms)
    row["pct_peak"] = None if row["tbs"] is None else 100 * row["tbs"] / peak_tbs


def best_peer(peers: dict) -> tuple[str, dict] | None:
    timed = [(name, p) for name, p in peers.items() if p.get("ms")]
    return min(timed, key=lambda item: item[1]["ms"]) if timed else None


def add_peers(row: dict, peers: dict) -> None:
    """Attach the configuration's peers to a numba_flash row; ``vs_best_sdpa`` = best peer ms / own ms."""
    row["peers"] = {name: dict(p) for name, p in peers.items()}
    best = best_peer(peers)
    row["best_sdpa"] = best[0] if best else None
    row["vs_best_sdpa"] = best[1]["ms"] / row["ms"] if best and row["ms"] else None


def accuracy_status(rel_err: float | None, dtype: str) -> str:
    if rel_err is not None and not rel_err <= TOLERANCE[dtype]:  # NaN lands here too
        return f"inaccurate: rel_err {rel_err:.1e} > {TOLERANCE[dtype]:.0e}"
    return "ok"


def failure(exc: BaseException, caught: list | None = None) -> str:
    """``failed: Type: first line``, and the first warning torch gave its reason in."""
    first_line = (str(exc).strip().splitlines() or [""])[0]
    text = f"failed: {type(exc).__name__}: {first_line[:160]}"
    reasons = [str(w.message).strip().splitlines()[0] for w in caught or [] if str(w.message).strip()]
    if reasons:
        text += f" ({reasons[0][:200]})"
    return text


# --------------------------------------------------------------------------- the arrays


class Arrays:
    """Where the inputs live: NumPy (simulator), CuPy, or torch (bfloat16 on the GPU)."""

    def __init__(self, kind: str):
        self.kind = kind

    def random(self, rng, shape, dtype: str):
        """Standard-normal values (never zeros) of ``dtype``; ``rng`` of the same kind."""
        if self.kind == "numpy":
            import numpy as np

            if dtype == "bfloat16":
                import ml_dtypes

                return rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)
            return rng.standard_normal(shape, dtype=np.float32).astype(dtype)
        if self.kind == "cupy":
            import cupy as cp

            out = cp.empty(shape, dtype=dtype)
            for b in range(shape[0]):  # a sequence at a time: no float32 copy of a whole cache
                out[b] = rng.standard_normal(shape[1:], dtype=cp.float32)
            return out
        import torch

        return torch.randn(shape, generator=rng, device="cuda", dtype=getattr(torch, dtype))

    def full_int32(self, n: int, value: int):
        if self.kind == "numpy":
            import numpy as np

            return np.full(n, value, dtype=np.int32)
        if self.kind == "cupy":
            import cupy as cp

            return cp.full(n, value, dtype=cp.int32)
        import torch

        return torch.full((n,), value, dtype=torch.int32, device="cuda")

    def rng(self, seed: int):
        if self.kind == "numpy":
            import numpy as np

            return np.random.default_rng(seed)
        if self.kind == "cupy":
            import cupy as cp

            return cp.random.default_rng(seed)
        import torch

        return torch.Generator(device="cuda").manual_seed(seed)

    @property
    def xp(self):
        """The array module the reference computes in: NumPy, or CuPy on the GPU."""
        if self.kind == "numpy":
            import numpy

            return numpy
        import cupy

        return cupy

    def float64(self, x):
        """``x`` (any of the three kinds) as a float64 array of :attr:`xp`."""
        if hasattr(x, "detach"):  # torch
            import cupy as cp

            return cp.from_dlpack(x.detach().double().contiguous())
        return self.xp.asarray(x).astype(self.xp.float64)


def arrays_for(dtype: str, simulate: bool) -> Arrays:
    if simulate:
        return Arrays("numpy")
    return Arrays("torch" if dtype == "bfloat16" else "cupy")


def reference(q, k, v, arrays: Arrays, chunk: int = REF_CHUNK):
    """Float64 attention of batch 0, every head: (H, Nq, D), in ``arrays.xp``.

    Query head h reads K/V head h // (H // Hkv). K and V are upcast ``chunk`` keys at a time;
    the scores of all keys are materialised (H * Nq * N * 8 bytes: 256 MiB at H32 Nq1 N1M),
    then one softmax: an independent computation, not the online merge the kernels do.
    """
    xp = arrays.xp
    _, H, Nq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    q64 = arrays.float64(q[0]).reshape(Hkv, (H // Hkv) * Nq, D) * (1.0 / math.sqrt(D))
    s = xp.empty((Hkv, q64.shape[1], N), dtype=xp.float64)
    for a in range(0, N, chunk):
        s[:, :, a : a + chunk] = q64 @ arrays.float64(k[0, :, a : a + chunk]).transpose(0, 2, 1)
    s -= s.max(axis=-1, keepdims=True)
    p = xp.exp(s, out=s)
    l = p.sum(axis=-1, keepdims=True)
    o = xp.zeros((Hkv, q64.shape[1], D), dtype=xp.float64)
    for a in range(0, N, chunk):
        o += p[:, :, a : a + chunk] @ arrays.float64(v[0, :, a : a + chunk])
    return (o / l).reshape(H, Nq, D)


def relative_error(o, ref, arrays: Arrays) -> float:
    """||o - ref|| / ||ref|| on batch 0, all heads."""
    xp = arrays.xp
    diff = arrays.float64(o[0]) - ref
    return float(xp.linalg.norm(diff) / xp.linalg.norm(ref))


# ------------------------------------------------------------------------- measurements


def release_memory() -> None:
    """Return cached device memory (CuPy's pool, torch's cache) so the next measurement has it."""
    try:
        if "cupy" in sys.modules:
            cp = sys.modules["cupy"]
            cp.cuda.Device().synchronize()
            cp.get_default_memory_pool().free_all_blocks()
        if "torch" in sys.modules and sys.modules["torch"] is not None:
            sys.modules["torch"].cuda.empty_cache()
    except Exception:  # a broken context already failed the measurement; keep sweeping
        pass


def time_ms(fn, repeats: int, simulate: bool) -> float | None:
    """Median ms by CUDA events (``research.profiling.timing.median_ms``); None in the simulator."""
    if simulate:
        return None
    from numba_flash.research.profiling.timing import median_ms

    return median_ms(fn, warmup=WARMUP, repeats=repeats)


def measure_numba_flash(cfg, num_splits, q, k, v, seqlens, ref, arrays, args, paged=None) -> dict:
    """One numba_flash row: compile and check, then time; with ``paged`` (:func:`paged_cache`'s
    pages and table), the same call on the paged cache too. Never raises."""
    row = new_row(cfg, num_splits, "running")
    try:
        import numba_flash

        def fn():
            return numba_flash.decode(q, k, v, cache_seqlens=seqlens, num_splits=num_splits)

        o = fn()  # compiles
        row["rel_err"] = relative_error(o, ref, arrays)
        del o
        set_time(row, cfg, time_ms(fn, args.repeats, args.simulate), args.peak_tbs)
        row["status"] = accuracy_status(row["rel_err"], cfg.dtype)
        if paged is not None:  # a decode step's form: the table checked once (page_table), then each call
            k_pages, v_pages, table = paged
            checked = numba_flash.page_table(k_pages, table, seqlens)

            def paged_fn():
                return numba_flash.decode(q, k_pages, v_pages, block_table=checked, num_splits=num_splits)

            def checked_fn():  # the table itself: checked on the host at every call (a synchronising read)
                return numba_flash.decode(q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table,
                                          num_splits=num_splits)

            o = paged_fn()
            row["page_size"] = args.page_size
            row["paged_rel_err"] = relative_error(o, ref, arrays)
            del o
            row["paged_ms"] = time_ms(paged_fn, args.repeats, args.simulate)
            row["paged_tbs"] = tbs(cfg.kv_bytes, row["paged_ms"])
            checked_fn()
            row["paged_checked_ms"] = time_ms(checked_fn, args.repeats, args.simulate)
            if row["paged_ms"] and row["ms"]:
                row["paged_vs_contiguous"] = row["ms"] / row["paged_ms"]
                row["paged_checked_vs_contiguous"] = row["ms"] / row["paged_checked_ms"]
            if accuracy_status(row["paged_rel_err"], cfg.dtype) != "ok" and row["status"] == "ok":
                row["status"] = "inaccurate (paged)"
    except Exception as exc:
        row["status"] = failure(exc)
    finally:
        release_memory()
    return row


def paged_cache(k, v, page_size: int, arrays: Arrays, seed: int):
    """``k``, ``v`` ``(B, Hkv, N, D)`` as a paged cache: ``(k_pages, v_pages, block_table)``,
    pages ``(B * N / P, P, Hkv, D)`` in a random order (sequence ``b``'s keys ``j P ..`` in page
    ``block_table[b, j]``), the table int32 ``(B, N / P)``. N must be a multiple of P."""
    B, Hkv, N, D = (int(n) for n in k.shape)
    if N % page_size:
        raise ValueError(f"--page-size {page_size} must divide the cache length {N}")
    per_seq = N // page_size
    import numpy

    perm = numpy.random.default_rng(seed).permutation(B * per_seq)
    if arrays.kind == "numpy":
        xp = numpy
    elif arrays.kind == "cupy":
        import cupy as xp

        perm = xp.asarray(perm)
    else:
        import torch

        perm = torch.randperm(B * per_seq, generator=torch.Generator().manual_seed(seed)).cuda()
    out = []
    for cache in (k, v):
        blocks = cache.reshape(B, Hkv, per_seq, page_size, D)
        blocks = blocks.permute(0, 2, 3, 1, 4) if arrays.kind == "torch" else blocks.transpose(0, 2, 3, 1, 4)
        pages = cache.new_empty((B * per_seq, page_size, Hkv, D)) if arrays.kind == "torch" else \
            xp.empty((B * per_seq, page_size, Hkv, D), dtype=cache.dtype)
        pages[perm] = blocks.reshape(B * per_seq, page_size, Hkv, D)
        out.append(pages)
    table = perm.reshape(B, per_seq)
    table = table.to(dtype=__import__("torch").int32) if arrays.kind == "torch" else table.astype("int32")
    return out[0], out[1], table


def sdpa_backends() -> dict:
    """``{name: SDPBackend}`` of the peers this torch has; empty without torch or CUDA."""
    try:
        import torch
        from torch.nn.attention import SDPBackend
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    enum = {"flash": "FLASH_ATTENTION", "mem_efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
    return {f"torch-{name}": getattr(SDPBackend, enum[name]) for name in PEERS if hasattr(SDPBackend, enum[name])}


def measure_peer(backend, cfg: Config, tq, tk, tv, ref, arrays: Arrays, args) -> dict:
    """One SDPA backend on the configuration: ``{ms, tbs, note, rel_err}``. Never raises.

    GQA through ``enable_gqa=True``; a backend that refuses it runs on K/V expanded by
    ``repeat_interleave`` (outside the timed region, within the memory budget).
    """
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    peer = dict(ms=None, tbs=None, note="", rel_err=None)

    def attempt(k_, v_, **kw):
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(tq, k_, v_, **kw)  # compiles / picks, untimed
            err = relative_error(o, ref, arrays)
            del o
            ms = time_ms(lambda: F.scaled_dot_product_attention(tq, k_, v_, **kw), args.repeats, args.simulate)
        return ms, err

    gqa = cfg.group > 1
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                ms, err = attempt(tk, tv, **({"enable_gqa": True} if gqa else {}))
            except Exception as exc:
                if not gqa:
                    raise
                first = failure(exc, caught)
                expanded = cfg.kv_bytes * cfg.group
                if cfg.kv_bytes + expanded > args.skip_above_gib * GIB:
                    peer["note"] = f"{first}; expanded kv ({human_bytes(expanded)}) over --skip-above-gib: skipped"
                    return peer
                release_memory()
                seen = len(caught)
                ek, ev = (x.repeat_interleave(cfg.group, dim=1) for x in (tk, tv))
                try:
                    ms, err = attempt(ek, ev)
                except Exception as exc2:
                    raise RuntimeError(f"{failure(exc2, caught[seen:])}; with enable_gqa: {first}") from exc2
                finally:
                    del ek, ev
                peer["note"] = f"expanded kv: enable_gqa refused, reads {cfg.group}x the K/V bytes"
        peer.update(ms=ms, tbs=tbs(cfg.kv_bytes, ms), rel_err=err)
    except Exception as exc:
        text = str(exc) if str(exc).startswith("failed:") else failure(exc, caught)
        peer["note"] = text
    finally:
        release_memory()
    return peer


def measure_config(cfg: Config, args, arrays: Arrays, rng, backends: dict, report) -> list[dict]:
    """Every row of one configuration, on one set of inputs; ``report(row_or_peer, ...)`` after each."""
    try:
        q = arrays.random(rng, (cfg.batch, cfg.heads, cfg.q_len, cfg.head_dim), cfg.dtype)
        k, v = (arrays.random(rng, (cfg.batch, cfg.kv_heads, cfg.cache_len, cfg.head_dim), cfg.dtype) for _ in range(2))
        seqlens = arrays.full_int32(cfg.batch, cfg.cache_len)  # full caches: the peers' problem
        ref = reference(q, k, v, arrays)
    except Exception as exc:
        rows = [new_row(cfg, s, failure(exc)) for s in args.num_splits]
        for row in rows:
            report(row)
        release_memory()
        return rows
    paged = None
    if args.page_size:
        try:
            paged = paged_cache(k, v, args.page_size, arrays, args.seed)
        except Exception as exc:
            rows = [new_row(cfg, s, failure(exc)) for s in args.num_splits]
            for row in rows:
                report(row)
            return rows
    rows = []
    for num_splits in args.num_splits:
        start = time.perf_counter()
        row = measure_numba_flash(cfg, num_splits, q, k, v, seqlens, ref, arrays, args, paged)
        report(row, seconds=time.perf_counter() - start)
        rows.append(row)
    peers = {}
    if backends:
        import torch

        tq, tk, tv = (x if isinstance(x, torch.Tensor) else torch.from_dlpack(x) for x in (q, k, v))
        for name, backend in backends.items():
            start = time.perf_counter()
            peers[name] = measure_peer(backend, cfg, tq, tk, tv, ref, arrays, args)
            report(rows[0], peer=name, seconds=time.perf_counter() - start, peers=peers)
        del tq, tk, tv
    for row in rows:
        add_peers(row, peers)
    del q, k, v, paged
    release_memory()
    return rows


def fmt(value, spec: str, none: str = "null") -> str:
    return none if value is None else format(value, spec)


def progress_line(index: int, total: int, row: dict, seconds: float, elapsed: float,
                  peer: str | None = None, peers: dict | None = None) -> str:  # fmt: skip
    cfg = f"B{row['batch']} N{row['cache_len']}"
    if peer is not None:
        p = peers[peer]
        what = (f"{p['ms']:.4f} ms {p['tbs']:.2f} TB/s rel_err {p['rel_err']:.1e}" if p["ms"] is not None
                else "untimed" if p["rel_err"] is not None else "")  # fmt: skip
        what = "; ".join(x for x in (what, p["note"]) if x)
        return f"{'':>{2 * len(str(total)) + 3}}{cfg} {peer}: {what} ({seconds:.1f} s)"
    width = len(str(total))
    head = f"[{index:>{width}}/{total}] {cfg} numba_flash splits={splits_label(row['num_splits'])}:"
    if row["status"].startswith(("failed", "skipped")):
        return f"{head} {row['status']} ({elapsed:.0f} s elapsed)"
    what = f"{fmt(row['ms'], '.4f')} ms {fmt(row['tbs'], '.2f')} TB/s ({fmt(row['pct_peak'], '.0f')}% of peak)"
    what += f" rel_err {fmt(row['rel_err'], '.1e')}"
    if row.get("page_size"):
        what += (f"; paged P{row['page_size']}: {fmt(row['paged_ms'], '.4f')} ms {fmt(row['paged_tbs'], '.2f')} TB/s "
                 f"({fmt(row['paged_vs_contiguous'], '.3f')}x contiguous) rel_err {fmt(row['paged_rel_err'], '.1e')}; "
                 f"checked every call {fmt(row['paged_checked_ms'], '.4f')} ms "
                 f"({fmt(row['paged_checked_vs_contiguous'], '.3f')}x)")
    what += "" if row["status"] == "ok" else f" [{row['status']}]"
    return f"{head} {what} ({seconds:.1f} s; {elapsed:.0f} s elapsed)"


# ----------------------------------------------------------------------------- outputs


def markdown_table(header: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    return lines + ["| " + " | ".join(cells) + " |" for cells in body]


def peer_cell(p: dict | None) -> str:
    if p is None:
        return "—"
    if p["ms"] is None:
        return (p["note"].split(":")[0] or "untimed") if p["rel_err"] is None else "null"
    return f"{p['tbs']:.2f}" + (" (expanded kv)" if p["note"].startswith("expanded kv") else "")


def markdown_report(rows: list[dict], meta: dict) -> str:
    """The run's header, then one table: a row per (batch, cache length, num_splits)."""
    peer_names = list(dict.fromkeys(name for r in rows for name in r["peers"]))
    lines = ["## numba_flash decode bandwidth", ""] + [f"- {k}: {v}" for k, v in meta.items()] + [""]
    paged = any(r.get("page_size") for r in rows)
    header = ["B", "cache", "splits", "ms", "K/V TB/s", "% peak", "rel err",
              *(["paged ms", "paged TB/s", "paged / contiguous", "paged ms, table checked per call"] if paged else []),
              *(f"{n} TB/s" for n in peer_names), "vs best SDPA", "status"]  # fmt: skip
    body = []
    for r in rows:
        vs = "null" if r["vs_best_sdpa"] is None else f"{r['vs_best_sdpa']:.2f}x {r['best_sdpa']}"
        paged_cells = [fmt(r.get("paged_ms"), ".4f"), fmt(r.get("paged_tbs"), ".2f"),
                       fmt(r.get("paged_vs_contiguous"), ".3f"), fmt(r.get("paged_checked_ms"), ".4f")] if paged else []
        body.append([str(r["batch"]), str(r["cache_len"]), splits_label(r["num_splits"]), fmt(r["ms"], ".4f"),
                     fmt(r["tbs"], ".2f"), fmt(r["pct_peak"], ".0f"), fmt(r["rel_err"], ".1e"), *paged_cells,
                     *(peer_cell(r["peers"].get(n)) for n in peer_names), vs, r["status"]])  # fmt: skip
    lines += markdown_table(header, body)
    notes: dict[tuple, list[str]] = {}  # (peer, note) -> the configurations it applies to
    for r in rows:
        for name, p in r["peers"].items():
            where = f"B{r['batch']} N{r['cache_len']}"
            if p["note"] and where not in notes.setdefault((name, p["note"]), []):
                notes[(name, p["note"])].append(where)
    notes_lines = [f"- {name}: {note} ({', '.join(where)})" for (name, note), where in notes.items()]
    return "\n".join(lines + ([""] + notes_lines if notes_lines else []) + [""])


def write_json(rows: list[dict], meta: dict, path: Path) -> None:
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, allow_nan=True) + "\n")


def length_label(n: int) -> str:
    """1024 -> 1k, 1048576 -> 1M; others as they are."""
    for unit, size in (("M", 2**20), ("k", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def plot_name(dtype: str, head_dim: int, num_splits: int | None) -> str:
    return f"decode_bw_{dtype}_d{head_dim}_splits-{splits_label(num_splits)}.png"


def write_plots(rows: list[dict], out_dir: Path, gpu: str, peak_tbs: float) -> list[Path]:
    """Per num_splits setting: TB/s against cache length (log2), one line per batch,
    the peers dashed in the batch's colour, the peak as a horizontal line. Nothing untimed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullLocator

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    markers = ("s", "^", "v", "D", "x")
    for num_splits in dict.fromkeys(r["num_splits"] for r in rows):
        sel = [r for r in rows if r["num_splits"] == num_splits]
        if not any(r["tbs"] for r in sel):
            continue
        fig = Figure(figsize=(8, 5))
        FigureCanvasAgg(fig)  # the Agg backend, without touching pyplot's global state
        ax = fig.subplots()
        peer_names = list(dict.fromkeys(n for r in sel for n in r["peers"]))
        for i, batch in enumerate(dict.fromkeys(r["batch"] for r in sel)):
            color = f"C{i % 10}"
            mine = sorted((r["cache_len"], r["tbs"]) for r in sel if r["batch"] == batch and r["tbs"])
            if mine:
                ax.plot(*zip(*mine), marker="o", color=color, label=f"numba_flash B={batch}")
            for j, name in enumerate(peer_names):
                pts = sorted((r["cache_len"], r["peers"][name]["tbs"]) for r in sel
                             if r["batch"] == batch and r["peers"].get(name, {}).get("tbs"))  # fmt: skip
                if pts:
                    ax.plot(*zip(*pts), ls="--", marker=markers[j % len(markers)], color=color, alpha=0.7,
                            markersize=4, label=f"{name} B={batch}")  # fmt: skip
        ax.axhline(peak_tbs, color="k", ls=":", label=f"HBM peak {peak_tbs:g} TB/s")
        lengths = sorted({r["cache_len"] for r in sel})
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [length_label(n) for n in lengths])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_ylim(bottom=0)
        ax.set_xlabel("KV-cache length N")
        ax.set_ylabel("achieved bandwidth: K+V bytes / time (TB/s)")
        r0 = sel[0]
        ax.set_title(f"decode {r0['dtype']} H={r0['heads']} Hkv={r0['kv_heads']} Nq={r0['q_len']} "
                     f"D={r0['head_dim']}, num_splits={splits_label(num_splits)} -- {gpu}", fontsize=9)  # fmt: skip
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = out_dir / plot_name(r0["dtype"], r0["head_dim"], num_splits)
        fig.savefig(path, dpi=120)
        written.append(path)
    return written


def environment(argv: list[str], args: argparse.Namespace) -> dict:
    """The run's header: command, date, device, versions, method."""
    from numba_flash.research.profiling.run_info import gpu_name, versions

    meta = {
        "command": "`" + shlex.join(["python", "scripts/decode_bench.py", *argv]) + "`",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "GPU": "none: Numba's CUDA simulator (timings null)" if args.simulate else gpu_name(),
    }
    meta.update(
        versions=versions(gpu=not args.simulate),
        bandwidth=(f"K/V TB/s = 2*B*Hkv*N*D*itemsize (bytes of K and V) / median time, peers rated on the same "
                   f"bytes; % of a {args.peak_tbs:g} TB/s peak; io_tbs (JSON) adds q and o"),
        timing=("none: the simulator's times mean nothing (ms, TB/s null)" if args.simulate else
                f"median of {args.repeats} runs by CUDA events after {WARMUP} untimed warm-up runs (compilation "
                "never timed)") + "; cache_seqlens = N for every sequence (full caches, as the peers)",
        rel_err="||o - o_ref|| / ||o_ref|| against float64 attention of batch 0, all heads",
        vs_best_sdpa="time of the fastest SDPA backend / time of numba_flash (> 1: numba_flash faster)",
    )  # fmt: skip
    return meta


def replot(json_path: Path, out_dir: Path, peak_tbs: float) -> int:
    """``--replot``: the plots and the report of a saved run (no GPU, no CuPy, no torch)."""
    try:
        saved = json.loads(json_path.read_text())
        rows, meta = saved["rows"], saved["meta"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"--replot: cannot read {json_path} as a --json file of decode_bench.py: {exc}", file=sys.stderr)
        return 2
    try:
        plots = write_plots(rows, out_dir, meta.get("GPU", "unknown GPU"), peak_tbs)
    except ImportError:
        print("matplotlib is not installed: no plots (pip install 'numba-flash[plot]')", file=sys.stderr)
        return 2
    print(f"plots: {', '.join(str(p) for p in plots) or 'none (nothing timed)'}", file=sys.stderr, flush=True)
    print(markdown_report(rows, meta), flush=True)
    return 0


# ---------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    from numba_flash import needs

    if args.plot:  # before any work
        needs.exit_unless("decode_bench.py --plot", needs.module("matplotlib"))
    if args.replot:
        return replot(Path(args.replot), Path(args.plot), args.peak_tbs)
    plan = build_plan(args)
    if args.dry_run:
        print(format_plan(plan, args.num_splits))
        return 0
    if args.simulate and "numba.cuda" not in sys.modules:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"  # decided before numba.cuda is first imported
    import numba_flash  # noqa: F401
    from numba_flash._world import choose_world, simulated

    choose_world()
    if args.simulate and not simulated():
        print("--simulate: numba.cuda was already imported for the GPU in this process", file=sys.stderr)
        return 2
    if not args.simulate:
        needs.exit_unless("decode_bench.py", needs.gpu(), needs.module("cupy"),
                          instead="--simulate runs one tiny configuration in the simulator, --dry-run lists the plan")
    elif args.dtype == "bfloat16":  # NumPy bfloat16 arrays
        needs.exit_unless("decode_bench.py --simulate --dtype bfloat16", needs.module("ml_dtypes"))
    arrays = arrays_for(args.dtype, args.simulate)
    if arrays.kind == "torch" and not sdpa_backends():
        print("--dtype bfloat16 on the GPU needs torch with CUDA (CuPy has no bfloat16)", file=sys.stderr)
        return 2
    backends = {} if args.no_peers or args.simulate else sdpa_backends()
    meta = environment(argv, args)
    meta["peers"] = ", ".join(backends) or (
        "none (simulator)" if args.simulate else "none (--no-peers)" if args.no_peers else "none (needs torch with CUDA)"
    )

    total = len(plan) * len(args.num_splits)
    counter = iter(range(1, total + 1))
    start = time.perf_counter()
    index = 0

    def report(row, seconds=0.0, peer=None, peers=None):
        nonlocal index
        if peer is None:
            index = next(counter)
        line = progress_line(index, total, row, seconds, time.perf_counter() - start, peer, peers)
        print(line, file=sys.stderr, flush=True)

    print(f"{len(plan)} configurations on {meta['GPU']}; peers: {meta['peers']}", file=sys.stderr, flush=True)
    rng = arrays.rng(args.seed)
    rows: list[dict] = []
    for cfg, reason in plan:
        if reason is not None:
            new = [new_row(cfg, s, reason) for s in args.num_splits]
            for row in new:
                report(row)
        else:
            new = measure_config(cfg, args, arrays, rng, backends, report)
        rows.extend(new)
        if args.json:
            write_json(rows, meta, Path(args.json))
    if args.plot:
        try:
            plots = write_plots(rows, Path(args.plot), meta["GPU"], args.peak_tbs)
            print(f"plots: {', '.join(p.name for p in plots) or 'none (nothing timed)'}", file=sys.stderr, flush=True)
        except ImportError:
            print("matplotlib is not installed: no plots (pip install 'numba-flash[plot]')", file=sys.stderr)
    print(markdown_report(rows, meta), flush=True)
    bad = [r for r in rows if r["status"].startswith(("failed", "inaccurate"))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
