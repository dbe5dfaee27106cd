"""The ``numba-flash`` command (also ``python -m numba_flash``).

    numba-flash compare [--batch B --heads H --seq N --head-dim D --causal --dtype float16]
    numba-flash occupancy [--json] [--source driver|ptxas] [--plot DIR]
    numba-flash autotune [--algorithm fa2 --head-dim 64 --dtype float32 --causal both]
    numba-flash demo        the seed's worked example of the online softmax, step by step
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

from numba_flash._world import choose_world


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (its name is what argparse shows for a bad value)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each flag's default after its help, except where there is none to show (a flag
    that is off unless given, or a default that depends on the machine and is said in words)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return action.help
        if "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _version() -> str:
    from numba_flash import __version__

    return __version__


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="numba-flash",
        description="FlashAttention-1 and FlashAttention-2 in numba.cuda, side by side "
        "(also: python -m numba_flash). Without a GPU the kernels run in Numba's CUDA simulator.",
        epilog="numba-flash COMMAND --help describes a command's options.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, help_text):
        return sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)

    cmp = add("compare", "FA-1 and FA-2 on the same inputs, side by side")
    cmp.add_argument("--batch", type=positive_int, metavar="B", help="batch size (default: 4 on a GPU, 1 in the simulator)")
    cmp.add_argument("--heads", type=positive_int, metavar="H", help="query heads (default: 16 on a GPU, 2 in the simulator)")
    cmp.add_argument("--kv-heads", type=positive_int, metavar="HKV", help="K/V heads, a divisor of --heads (GQA) (default: --heads)")
    cmp.add_argument("--seq", type=positive_int, metavar="N", help="query and key length (default: 4096 on a GPU, 48 in the simulator)")
    cmp.add_argument("--seq-k", type=positive_int, metavar="NK", help="key length when it differs from --seq (default: --seq)")
    cmp.add_argument("--head-dim", type=positive_int, metavar="D", help="head dimension, 1 to 256 (default: 64 on a GPU, 16 in the simulator)")
    cmp.add_argument("--causal", action="store_true", help="causal mask, bottom-right aligned")
    cmp.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32", help="input and output dtype")
    cmp.add_argument(
        "--precision", choices=["default", "ieee", "tf32", "tf32x3"], default="default",
        help="where the products run: default = tensor cores for float16/bfloat16, CUDA cores "
        "for float32; ieee = CUDA cores; tf32/tf32x3 = float32 on tensor cores (default: default)",
    )
    cmp.add_argument("--block-m", type=int, metavar="BM", help="Q-tile rows, a power of two (default: tuned per head dim)")
    cmp.add_argument("--block-n", type=int, metavar="BN", help="K/V-tile rows, a power of two (default: tuned per head dim)")
    cmp.add_argument("--repeats", type=positive_int, default=20, help="timed runs on a GPU (median reported)")
    cmp.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    cmp.add_argument("--json", action="store_true", help="print the rows as JSON (progress and notes go to stderr)")
    cmp.add_argument("--force", action="store_true",
                     help="run in the simulator (no GPU) even when that is expected to take more than 10 minutes")

    cmp.add_argument("--algorithms", nargs="+", choices=["fa1", "fa2", "fa3"], default=["fa1", "fa2"], metavar="ALG",
                     help="the kernels side by side: fa1, fa2, fa3 (FlashAttention-3 on Hopper: float16/bfloat16, "
                          "compute capability 9.0 or the simulator) (default: fa1 fa2)")
    abl = add("ablate", "every point of the FA-1 -> FA-2 space (loop order, grid, rescale, O load) on the same inputs")
    for action in cmp._actions:  # compare's problem flags, the same defaults
        if action.dest in ("help", "precision", "algorithms"):
            continue
        abl._add_action(action)
    # After ablate copied compare's flags: the backward has its two loop orders only (no variants).
    cmp.add_argument("--backward", action="store_true",
                     help="also the backward pass (attention_backward of each algorithm's o and lse; PyTorch SDPA "
                          "backward for the peers): gradients' error against float64, time, TFLOP/s at 2.5x the "
                          "forward's FLOPs")
    abl.add_argument("--precision", choices=["default", "ieee", "tf32", "tf32x3"], default="default",
                     help="the engine of every variant: default = CUDA cores for float32, tensor cores for 16-bit "
                          "dtypes; ieee = CUDA cores; tf32/tf32x3 = float32 on tensor cores")
    abl.add_argument("--variants", nargs="+", metavar="V",
                     help="fa1, fa2 or loop_order-grid-rescale[-warp_partition[-o_load]] (default: all 24)")
    abl.add_argument("--plot", metavar="DIR", help="write the FA-1 -> FA-2 waterfall (PNG) here")
    abl.add_argument("--ncu", nargs="?", const="ncu", metavar="NCU",
                     help="also measure each variant's DRAM bytes and achieved occupancy with Nsight Compute "
                          "(the ncu binary; GPU only)")
    abl.add_argument("--ncu-dir", default="ablate-ncu", metavar="DIR", help="where --ncu writes its plan and raw CSV")
    abl.add_argument("--fa3", action="store_true",
                     help="the FA-2 -> FA-3 ablation instead: FA-2 beside the Hopper kernel with ping-pong, the "
                          "intra-warpgroup overlap, setmaxnreg, the TMA store of O and the conditional rescale switched off in turn (16-bit: float32 runs as "
                          "float16; default problem B4 H16 N4096 D128; FA-3's Table 2 beside it)")

    occ = add("occupancy", "registers, shared memory and occupancy per tile configuration (GPU or ptxas)")
    occ.add_argument("--algorithm", nargs="+", default=["fa1", "fa2"], choices=["fa1", "fa2"], help="kernels to profile")
    occ.add_argument("--head-dim", nargs="+", type=positive_int, default=[32, 64, 128], metavar="D", help="head dims")
    occ.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "float16", "bfloat16"], help="input dtypes")
    occ.add_argument(
        "--precision", nargs="+", default=["default"], choices=["default", "ieee", "tf32", "tf32x3"],
        help="regimes to profile (default: tensor cores for 16-bit dtypes, CUDA cores for float32)",
    )
    occ.add_argument("--block-m", nargs="+", type=positive_int, default=[32, 64, 128, 256], metavar="BM", help="Q-tile rows")
    occ.add_argument("--block-n", nargs="+", type=positive_int, default=[16, 32], metavar="BN", help="K/V-tile rows")
    occ.add_argument("--causal", action="store_true", help="profile the causal kernels")
    occ.add_argument("--source", choices=["driver", "ptxas"],
                     help="driver: the GPU's own figures; ptxas: compile offline, no GPU needed (default: driver on a GPU, else ptxas)")
    occ.add_argument("--cc", type=compute_capability, default="9.0", metavar="MAJOR.MINOR",
                     help="compute capability to compile for with ptxas (9.0: H100/H200)")
    occ.add_argument("--json", action="store_true", help="print a JSON list of row objects")
    occ.add_argument("--plot", metavar="DIR", help="write occupancy/registers-vs-tile PNGs here")

    tune = add("autotune", "time tile candidates on this GPU and cache the fastest")
    tune.add_argument("--algorithm", nargs="+", default=["fa2", "fa1"], choices=["fa1", "fa2"], help="kernels to tune")
    tune.add_argument("--head-dim", nargs="+", type=positive_int, default=[64, 128], metavar="D", help="head dims to tune")
    tune.add_argument("--dtype", nargs="+", default=["float32", "float16"], choices=["float32", "float16"], help="dtypes to tune")
    tune.add_argument("--causal", choices=["both", "on", "off"], default="both", help="tune the causal kernels, the full ones, or both")
    tune.add_argument("--seq", type=positive_int, default=4096, metavar="N", help="sequence length of the timed problem")
    tune.add_argument("--batch", type=positive_int, default=4, metavar="B", help="batch size of the timed problem")
    tune.add_argument("--heads", type=positive_int, default=16, metavar="H", help="heads of the timed problem")

    add("demo", "the online-softmax worked example of the seed, step by step")

    warm = add("warmup", "compile the common configurations into the compilation cache ahead of time (GPU)")
    warm.add_argument("--dtype", nargs="+", default=["float16", "bfloat16", "float32"],
                      choices=["float16", "bfloat16", "float32"], help="input dtypes")
    warm.add_argument("--head-dim", nargs="+", type=positive_int, default=[64, 128], metavar="D", help="head dims")
    warm.add_argument("--causal", choices=["both", "on", "off"], default="both", help="the causal kernels, the full ones, or both")
    warm.add_argument("--algorithm", nargs="+", default=["fa2"], choices=["fa1", "fa2"], help="loop orders")
    warm.add_argument("--backward", action="store_true", help="also attention_backward's kernels")
    warm.add_argument("--decode", action="store_true", help="also decode's kernels (float16, bfloat16)")
    warm.add_argument("--dry-run", action="store_true", help="print the cases and exit (no GPU needed)")
    warm.add_argument("--json", action="store_true", help="print one JSON row per case (progress goes to stderr)")

    cache = add("cache", "the persistent compilation cache: what it holds, or empty it")
    cache.add_argument("action", choices=["info", "clear"], help="info: folder, entries, size; clear: delete the entries")
    cache.add_argument("--stale", action="store_true", help="clear only the entries this install cannot use (other sources)")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "cache":
        return _cache(args)
    if args.command == "warmup":
        return _warmup(args)
    if args.command == "occupancy":
        return _occupancy(args)
    choose_world()
    unmet = unmet_needs(args)
    if unmet is not None:  # before any work
        print(unmet, file=sys.stderr)
        return 2
    if args.command == "autotune":
        return _autotune(args)
    if args.command == "demo":
        from numba_flash.seed_example import print_worked_example

        print_worked_example()
        return 0
    if args.command == "ablate":
        return _ablate(args)
    from numba_flash.research.compare import compare, format_table

    result = _measure_rows("compare", compare, args)
    if result is None:
        return 2
    _print_rows(*result, args, format_table)
    return 0


def _cache(args) -> int:
    """``numba-flash cache info|clear``: no GPU needed, nothing compiled."""
    from numba_flash import compile_cache

    if args.action == "clear":
        removed, freed = compile_cache.clear(stale_only=args.stale)
        print(f"removed {removed} {'stale ' if args.stale else ''}compiled kernels ({freed / 2**20:.1f} MiB) "
              f"from {compile_cache.kernels_dir()}")
        return 0
    found = compile_cache.info()
    print(f"folder:   {found['folder']} (${compile_cache.CACHE_DIR_VAR} overrides)")
    print(f"kernels:  {found['entries']} ({found['bytes'] / 2**20:.1f} MiB): {found['usable']} for these sources "
          f"({found['sources']}), {found['stale']} stale")
    return 0


def _warmup(args) -> int:
    """``numba-flash warmup``: the plan's calls on a GPU, one progress line each; exit 1 when a
    case failed, 2 when this machine cannot run them (one line saying what is missing)."""
    from numba_flash import compile_cache, needs
    from numba_flash.warmup import plan, warmup

    cases = plan(tuple(args.dtype), tuple(args.head_dim), {"both": (False, True), "on": (True,), "off": (False,)}[args.causal],
                 tuple(args.algorithm), args.backward, args.decode)
    if args.dry_run:
        for case in cases:
            print(case.label)
        return 0
    from numba_flash.warmup import needs_for

    line = needs.unmet("numba-flash warmup", *needs_for(cases))
    if line is not None:
        print(f"{line}; --dry-run lists the cases", file=sys.stderr)
        return 2
    print(f"numba-flash warmup: {len(cases)} cases into {compile_cache.kernels_dir()}", file=sys.stderr, flush=True)
    rows = warmup(cases, progress=lambda text: print(f"numba-flash warmup: {text}", file=sys.stderr, flush=True))
    failed = [r for r in rows if "error" in r]
    if args.json:
        print(json.dumps(rows, indent=2))
    found = compile_cache.info()
    print(f"numba-flash warmup: {sum(r['new_kernels'] for r in rows)} kernels compiled and stored in "
          f"{sum(r['seconds'] for r in rows):.0f} s; the cache holds {found['usable']} for these sources"
          + (f"; {len(failed)} cases FAILED" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


def unmet_needs(args, occupancy_source=None) -> str | None:
    """What the command of ``args`` needs that is not installed here, in one line naming the
    flags that need it and the install hints (``numba_flash.needs``); ``None`` when nothing is
    missing. ``occupancy_source``: the ``occupancy`` command's source (``driver``: a GPU)."""
    from numba_flash import needs

    asked = []  # (the flag that asks for it, or "", what it needs)
    if args.command in ("compare", "ablate"):
        from numba_flash._world import simulated

        bfloat16 = args.dtype == "bfloat16"
        if simulated():  # NumPy arrays: bfloat16 is ml_dtypes'
            asked.append(("--dtype bfloat16", needs.module("ml_dtypes") if bfloat16 else None))
        else:  # CuPy arrays; bfloat16 as torch tensors (CuPy has no bfloat16)
            asked.append(("--dtype bfloat16" if bfloat16 else "", needs.module("torch" if bfloat16 else "cupy")))
    if args.command == "ablate" and args.ncu:
        asked += [("--ncu", needs.gpu()),
                  ("--ncu", needs.tool(args.ncu, "Nsight Compute's command line, from the CUDA toolkit; or give its path to --ncu"))]
    if args.command in ("ablate", "occupancy") and args.plot:
        asked.append(("--plot", needs.module("matplotlib")))
    if occupancy_source == "driver":
        asked.append(("--source driver", needs.gpu()))
    if args.command == "autotune":
        asked += [("", needs.gpu()), ("", needs.module("cupy"))]
    missing = [(flag, need) for flag, need in asked if need]
    flags = [flag for flag in dict.fromkeys(flag for flag, _ in missing) if flag]
    return needs.unmet(" ".join(["numba-flash", args.command, *flags]), *(need for _, need in missing))


def _measure_rows(command, run, args):
    """``run(args, progress)`` with its stages on stderr; ``None`` after a one-line error for a
    problem the kernels refuse, or one the simulator would take too long for."""
    from numba_flash.research.compare import SimulatorTooSlow

    try:
        return run(args, progress=lambda line: print(f"numba-flash {command}: {line}", file=sys.stderr, flush=True))
    except (ValueError, TypeError, SimulatorTooSlow) as exc:  # a problem the kernels refuse (or too slow here), in one line
        print(f"numba-flash {command}: error: {exc}", file=sys.stderr)
        return None


def _print_rows(rows, notes, args, format_rows) -> None:
    """The rows as JSON (notes on stderr) or as the command's table with its notes."""
    if args.json:
        print(json.dumps(rows, indent=2, default=_json_default))
        for note in notes:
            print(note, file=sys.stderr)
    else:
        print(format_rows(rows, notes))


def _ablate(args) -> int:
    from numba_flash.research.ablation import ablate, add_ncu, format_ablation, plot_waterfall

    if args.fa3:
        from numba_flash.research.fa3_ablation import ablate_fa3, format_fa3_ablation

        result = _measure_rows("ablate", ablate_fa3, args)
        if result is None:
            return 2
        _print_rows(*result, args, format_fa3_ablation)
        return 0

    result = _measure_rows("ablate", ablate, args)
    if result is None:
        return 2
    rows, notes = result
    if args.ncu:
        print(f"numba-flash ablate: profiling {len(rows)} variants under {args.ncu} ...", file=sys.stderr, flush=True)
        add_ncu(rows, args, args.ncu, args.ncu_dir)
    _print_rows(rows, notes, args, format_ablation)
    if args.plot:
        os.makedirs(args.plot, exist_ok=True)
        path = plot_waterfall(rows, os.path.join(args.plot, "ablation_waterfall.png"))
        print(f"numba-flash ablate: wrote {path}", file=sys.stderr)
    return 0


def _autotune(args) -> int:
    from numba_flash.research.tuning import autotune

    causal = {"both": (False, True), "on": (True,), "off": (False,)}[args.causal]
    for alg in args.algorithm:
        for d in args.head_dim:
            for dt in args.dtype:
                for c in causal:
                    autotune(alg, d, dt, c, batch=args.batch, heads=args.heads, seq=args.seq,
                             progress=lambda m: print(m, flush=True))
    return 0


def _occupancy(args) -> int:
    from numba_flash._world import gpu_present

    source = args.source or ("driver" if gpu_present() else "ptxas")
    unmet = unmet_needs(args, source)
    if unmet is not None:  # before any work
        print(unmet, file=sys.stderr)
        return 2
    if source == "ptxas" and "numba.cuda" not in sys.modules:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "0"  # compile for real; no GPU is touched
    from numba_flash.research.profiling.occupancy import ROW_KEYS, configurations, missing_toolchain, profile

    missing = missing_toolchain() if source == "ptxas" else []
    blocking = [m for m in missing if not m.startswith("ptxas") or m.endswith("not found")]  # an old ptxas may still do
    if blocking:
        _toolchain_error("cannot compile the kernels without a GPU here", missing)
        return 2
    cc = args.cc
    precisions = [None if p == "default" else p for p in args.precision]
    configs = list(configurations(
        args.algorithm, args.head_dim, args.dtype, args.block_m, args.block_n, (args.causal,), precisions
    ))
    if source == "ptxas":
        from numba_flash.research.profiling.occupancy import ptxas_seconds
        from numba_flash.simulator import format_seconds

        print(f"numba-flash occupancy: {len(configs)} kernel configurations, compiled for sm_{cc[0]}{cc[1]} by numba and "
              f"ptxas (no GPU), about {format_seconds(ptxas_seconds(len(configs)))}", file=sys.stderr, flush=True)
    else:
        print(f"numba-flash occupancy: {len(configs)} kernel configurations, compiled for this GPU", file=sys.stderr, flush=True)
    try:
        rows = profile(configs, cc=cc, source=source,
                       progress=lambda line: print(f"numba-flash occupancy: {line}", file=sys.stderr, flush=True))
    except Exception as exc:
        if source != "ptxas":
            raise
        _toolchain_error(f"compiling without a GPU failed: {type(exc).__name__}: {str(exc).strip()}", missing)
        return 2
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(_markdown(rows, ROW_KEYS))
    if args.plot:
        from numba_flash.research.profiling.plots import plot_occupancy

        for path in plot_occupancy(rows, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def _toolchain_error(what: str, missing: list[str]) -> None:
    """One line on stderr: why ``occupancy`` cannot compile here, what is missing, and the extra."""
    from numba_flash.research.profiling.occupancy import OCCUPANCY_EXTRA

    parts = [f"numba-flash occupancy: {' / '.join(what.splitlines())}"]
    if missing:
        parts.append(f"missing here: {'; '.join(missing)}")
    parts.append(f"all of them come with the occupancy extra: {OCCUPANCY_EXTRA}")
    print("; ".join(parts), file=sys.stderr)


def compute_capability(text: str) -> tuple[int, int]:
    """argparse type: ``MAJOR.MINOR``, e.g. 9.0."""
    try:
        major, minor = (int(x) for x in text.split("."))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MAJOR.MINOR such as 9.0, got {text!r}") from None
    return major, minor


def _markdown(rows, keys) -> str:
    from numba_flash.research.report import markdown_table

    def cell(v):
        return f"{v:.1%}" if isinstance(v, float) else str(v)

    return "\n".join(markdown_table(list(keys), [[cell(r[k]) for k in keys] for r in rows]))


def _json_default(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    raise TypeError(type(x))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
