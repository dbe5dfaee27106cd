"""Decode sweep (issue 11): candidate configurations of the decode kernel against the library's
call and PyTorch's, one GPU run of ~2-3 minutes.

    python scripts/decode_sweep.py      # B1 H32 Hkv8 Nq1 D128 float16, caches 131072 and 1048576

Per cache length, on one set of inputs (``decode_bench``'s: standard normal, full caches,
``cache_seqlens`` given), every row checked against ``decode_bench``'s float64 reference before
it is timed (``median_ms``: CUDA events, calls back to back, median of ``--repeats``):

- ``decode()``: the library's call as a user makes it (its tiles, copies and split heuristic).
  ``host_us``: Python time per call while the GPU is busy (the enqueue rate); when it reaches
  the GPU time the figure is the host's, not the kernels'.
- candidates ``BN:copies:splits[:stages[:warps]]`` (``--candidates``): the FA-2 kernel with
  16 x BN tiles (one warp, or ``warps`` warps that split each tile's keys: a ring only), its full K/V tiles copied by row walks (``walk``) or by the indexed copies
  of every other configuration (``indexed``: the decode kernel before this sweep), ``splits``
  ranges of K/V tiles (``auto``: ``split_kv.num_splits_heuristic``), ``stages`` K/V tiles in
  shared memory (1, the default: K_j and V_j in flight in turn; more: a ring, tiles j + 1 ..
  j + stages - 1 in flight during tile j), then the combine kernel. Launched prepared
  (``launch.prepare_launch``): ~no host work per call. ``decode()`` is ``64:walk:auto:2:4``
  (one warp per block, ``64:walk:auto``, until the sixth session).
- peers: torch SDPA flash and cuDNN (``decode_bench.measure_peer``, ``enable_gqa=True``).

``fa2_us`` / ``comb_us``: each kernel's own GPU time per call, from torch.profiler (CUPTI), when
torch is there; ``ms`` minus their sum is the gap between the launches. ``blk/SM``: blocks per
SM of the grid (8 KV heads x splits over the SMs) and the resident limit by shared memory.
Exit status 1 when a row fails or is inaccurate.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
# Kernels to compile (~10 s each): decode()'s (4 key warps over a ring of 2 swizzled 16x64 tiles)
# and its neighbours (ring of 3, one block per SM, indexed copies, 16x128), and the one-warp
# kernel decode() used before the sixth session (performance log 9j).
DEFAULT_CANDIDATES = ["64:walk:auto:2:4", "64:walk:auto:3:4", "64:walk:16:3:4", "64:indexed:auto:2:4",
                      "128:walk:16:3:4", "64:walk:32"]  # fmt: skip


def _bench():
    """scripts/decode_bench.py as a module: its inputs, reference, peers and timing."""
    spec = importlib.util.spec_from_file_location("decode_bench_script", HERE / "decode_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def candidate(text: str) -> tuple[int, str, int | None, int]:
    """``BN:copies:splits[:stages[:warps]]`` -> (block_n, "walk" | "indexed", splits or None for
    the heuristic, stages, warps)."""
    try:
        bn, copies, splits, *extra = text.split(":")
        bn, stages = int(bn), int(extra[0]) if extra else 1
        warps = int(extra[1]) if len(extra) > 1 else 1
        splits = None if splits == "auto" else int(splits)
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"expected BN:walk|indexed:S|auto[:stages[:warps]]; got {text!r}") from None
    if (bn not in (16, 32, 64, 128) or copies not in ("walk", "indexed") or not 1 <= stages <= 8
            or (splits is not None and not 1 <= splits <= 128) or warps not in (1, 2, 4, 8) or bn // warps < 16
            or (warps > 1 and stages < 2)):
        raise argparse.ArgumentTypeError(f"expected BN in 16/32/64/128, walk|indexed, 1 <= S <= 128, 1 <= stages <= 8, "
                                         f"warps 1/2/4/8 of >= 16 keys each (> 1 only with stages >= 2); got {text!r}")
    return bn, copies, splits, stages, warps


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=int, nargs="+", default=[131072, 1048576], help="KV-cache lengths")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--candidates", type=candidate, nargs="*", default=[candidate(c) for c in DEFAULT_CANDIDATES],
                    help=f"BN:walk|indexed:S|auto[:stages[:warps]] (default: {' '.join(DEFAULT_CANDIDATES)})")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--no-profile", action="store_true", help="skip the per-kernel times of torch.profiler")
    ap.add_argument("--peak-tbs", type=float, default=4.8)
    return ap.parse_args(argv)


# ------------------------------------------------------------------------------ launches


class Candidate:
    """The FA-2 decode kernel of one (block_n, copies, splits, stages, warps), prepared on given
    arrays, then the combine: ``__call__`` queues both on CuPy's current stream."""

    def __init__(self, block_n, copies, splits, stages, warps, q, k, v, seqlens, scale):
        import cupy as cp

        from numba_flash.kernels.combine import combine_launch
        from numba_flash.kernels.jit import LOG2E
        from numba_flash.kernels.tc_fa2 import tc_fa2_kernel
        from numba_flash.kernels.tc_ops import row_walk_default
        from numba_flash.alibi import no_slopes
        from numba_flash.launch import core_stream, device_array, prepare_launch
        from numba_flash.specs import kernel_spec
        from numba_flash.split_kv import multiprocessors, num_splits_heuristic, resident_blocks

        B, H, Nq, D = q.shape
        Hkv, N = k.shape[1], k.shape[2]
        group, rows = H // Hkv, Nq * H // Hkv
        spec = kernel_spec("fa2", D, "float16", 16, block_n, False, "f16", ragged=True, split_out=True, kv_stages=stages,
                           key_warps=warps)
        sms = multiprocessors(None)
        self.resident = resident_blocks(spec.threads, spec.smem_bytes)
        blocks = spec.grid(B, Hkv, rows)[0]
        if splits is None:
            splits = num_splits_heuristic(blocks, sms, self.resident, -(-N // block_n))
        self.splits, self.per_sm = splits, blocks * splits / sms
        self.label = (f"16x{block_n} {copies}" + (f" {stages} stages" if stages > 1 else "")
                      + (f" {warps} warps" if warps > 1 else ""))
        walk = copies == "walk"
        if walk == row_walk_default("f16", spec.head_dim, 16, block_n, warps):  # the library's kernel: compiled once
            kernel = spec.kernel
        else:
            kernel = tc_fa2_kernel("f16", spec.head_dim, 16, block_n, False, True, True, spec.register_cap, walk, stages,
                                   key_warps=warps)
        self.o = cp.empty((B, H, Nq, D), cp.float16)
        self.lse = cp.empty((B, H, Nq), cp.float32)
        self.o_parts = cp.empty((splits * B, Hkv, rows, D), cp.float32)
        self.lse_parts = cp.empty((splits * B, Hkv, rows), cp.float32)
        packed = [x.view(cp.uint16) for x in (q.reshape(B, Hkv, rows, D), k, v)]
        # the skeleton's arguments (kernels.forward): o_hbm, l_hbm, m_hbm and kv_order are not read by a Q-outer
        # walk (one array per shape, as the library passes them)
        self.unread = [cp.zeros((1, 1, 1, 1), np.float32), cp.zeros((1, 1, 1), np.float32), cp.zeros(1, np.int32),
                       no_slopes("cupy", cp.cuda.runtime.getDevice())]  # (and the ALiBi slopes: none)
        o_hbm, state, kv_order, slopes = self.unread
        arrays = [device_array(x, "cupy") for x in (*packed, self.o_parts, self.lse_parts, o_hbm, state, state)]
        args = [*arrays, np.float32(scale * LOG2E), device_array(kv_order, "cupy"), device_array(seqlens, "cupy"),
                np.int32(splits), np.int32(group), np.float32(0.0), device_array(slopes, "cupy")]
        device = cp.cuda.runtime.getDevice()
        self.main = prepare_launch(kernel, spec.grid(B, Hkv, rows, splits), (spec.threads,), args, spec.dynamic_smem, device)
        comb = [device_array(x, "cupy") for x in (self.o_parts, self.lse_parts, self.o.reshape(B, Hkv, rows, D),
                                                  self.lse.reshape(B, Hkv, rows))]  # float16 o: as decode() passes it
        comb_kernel, comb_grid, comb_block = combine_launch(splits, (B, Hkv, rows, D))
        self.combine = prepare_launch(comb_kernel, comb_grid, comb_block, comb, 0, device)
        self.stream = core_stream(cp.cuda.get_current_stream().ptr, device)

    def __call__(self):
        self.main(self.stream)
        self.combine(self.stream)
        return self.o


def kernel_times(fn, calls: int = 10) -> dict:
    """GPU microseconds per call of each kernel ``fn`` launches, by torch.profiler (CUPTI):
    ``{"fa2": us, "combine": us, "other": us}``; ``{}`` when the profiler is not there."""
    try:
        import cupy as cp
        from torch.profiler import ProfilerActivity, profile

        cp.cuda.get_current_stream().synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            cp.cuda.get_current_stream().synchronize()
        out = {}
        for e in prof.key_averages():
            us = next((getattr(e, a) for a in ("self_device_time_total", "self_cuda_time_total", "device_time_total",
                                               "cuda_time_total") if getattr(e, a, 0)), 0)  # fmt: skip
            name = "fa2" if "tc_fa2" in e.key else "combine" if "combine" in e.key else "other"
            out[name] = out.get(name, 0.0) + us / calls
        return out
    except Exception as exc:  # no torch, no CUPTI: the rest of the row stands
        print(f"  (profiler: {type(exc).__name__}: {str(exc)[:120]})", file=sys.stderr)
        return {}


def host_us(fn, calls: int = 50) -> float:
    """Python microseconds per call, calls queued back to back (the GPU busy)."""
    import cupy as cp

    fn()
    cp.cuda.get_current_stream().synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    cp.cuda.get_current_stream().synchronize()
    return elapsed / calls * 1e6


# ---------------------------------------------------------------------------------- run


def measure(label, fn, cfg, ref, bench, arrays, args, extra=None) -> dict:
    row = dict(label=label, ms=None, tbs=None, pct=None, err=None, fa2=None, comb=None, host=None, status="ok", **(extra or {}))
    try:
        o = fn()
        row["err"] = bench.relative_error(o, ref, arrays)
        row["status"] = bench.accuracy_status(row["err"], cfg.dtype)
        row["ms"] = bench.time_ms(fn, args.repeats, False)
        row["tbs"] = bench.tbs(cfg.kv_bytes, row["ms"])
        row["pct"] = 100 * row["tbs"] / args.peak_tbs
        if not args.no_profile:
            t = kernel_times(fn)
            row["fa2"], row["comb"] = t.get("fa2"), t.get("combine")
    except Exception as exc:
        row["status"] = bench.failure(exc)
    print(f"  {label}: {fmt(row['ms'], '.4f')} ms {fmt(row['tbs'], '.2f')} TB/s err {fmt(row['err'], '.1e')} "
          f"{row['status']}", file=sys.stderr, flush=True)
    return row


def fmt(x, spec, none="-"):
    return none if x is None else format(x, spec)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from numba_flash import needs

    needs.exit_unless("decode_sweep.py", needs.gpu(), needs.module("cupy"))
    bench = _bench()
    import cupy as cp

    import numba_flash

    arrays = bench.Arrays("cupy")
    backends = {} if args.no_peers else bench.sdpa_backends()
    peer_args = argparse.Namespace(repeats=args.repeats, simulate=False, skip_above_gib=40.0)
    rng = arrays.rng(0)
    start = time.perf_counter()
    lines = [f"GPU {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, numba_flash "
             f"{Path(numba_flash.__file__).parent}", "",
             "| cache | config | splits | blk/SM (resident) | ms | TB/s | % peak | fa2_us | comb_us | host_us | rel_err | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    bad = False
    for n in args.cache:
        cfg = bench.Config(args.batch, args.heads, args.kv_heads, 1, args.head_dim, "float16", n)
        print(f"{cfg.label()} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
        q = arrays.random(rng, (cfg.batch, cfg.heads, 1, cfg.head_dim), "float16")
        k, v = (arrays.random(rng, (cfg.batch, cfg.kv_heads, n, cfg.head_dim), "float16") for _ in range(2))
        seqlens = arrays.full_int32(cfg.batch, n)
        ref = bench.reference(q, k, v, arrays)
        rows = []

        def library():
            return numba_flash.decode(q, k, v, cache_seqlens=seqlens)

        row = measure("decode()", library, cfg, ref, bench, arrays, args)
        row["host"] = host_us(library) if row["ms"] else None
        rows.append(row)
        for bn, copies, splits, stages, warps in args.candidates:
            try:
                c = Candidate(bn, copies, splits, stages, warps, q, k, v, seqlens, 1 / math.sqrt(cfg.head_dim))
            except Exception as exc:
                rows.append(dict(label=f"16x{bn} {copies}", status=bench.failure(exc)))
                continue
            rows.append(measure(c.label, c, cfg, ref, bench, arrays, args,
                                dict(splits=f"{c.splits}{'' if splits else ' (auto)'}", per_sm=f"{c.per_sm:.2f} ({c.resident})")))
            del c
        if backends:
            import torch

            tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
            for name, backend in backends.items():
                if "mem_efficient" in name:
                    continue
                p = bench.measure_peer(backend, cfg, tq, tk, tv, ref, arrays, peer_args)
                rows.append(dict(label=name, ms=p["ms"], tbs=p["tbs"], err=p["rel_err"],
                                 pct=None if p["tbs"] is None else 100 * p["tbs"] / args.peak_tbs,
                                 status=p["note"] or "ok"))
            del tq, tk, tv
        for r in rows:
            bad |= r["status"].startswith(("failed", "inaccurate"))
            lines.append(f"| {n} | {r['label']} | {r.get('splits', '-')} | {r.get('per_sm', '-')} | {fmt(r.get('ms'), '.4f')} | "
                         f"{fmt(r.get('tbs'), '.2f')} | {fmt(r.get('pct'), '.0f')} | {fmt(r.get('fa2'), '.1f')} | "
                         f"{fmt(r.get('comb'), '.1f')} | {fmt(r.get('host'), '.0f')} | {fmt(r.get('err'), '.1e')} | "
                         f"{r['status'][:60]} |")  # fmt: skip
        del q, k, v, seqlens, ref
        bench.release_memory()
    print("\n".join(lines), flush=True)
    print(f"({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
