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



def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="numba-flash", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    cmp = sub.add_parser("compare", help="FA-1 and FA-2 on the same inputs, side by side")
    cmp.add_argument("--batch", type=_positive)
    cmp.add_argument("--heads", type=_positive)
    cmp.add_argument("--kv-heads", type=_positive, help="K/V heads (GQA); default: --heads")
    cmp.add_argument("--seq", type=_positive, help="query and key length")
    cmp.add_argument("--seq-k", type=_positive, help="key length when it differs from --seq")
    cmp.add_argument("--head-dim", type=_positive)
    cmp.add_argument("--causal", action="store_true")
    cmp.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    cmp.add_argument(
        "--precision", choices=["default", "ieee", "tf32", "tf32x3"], default="default",
        help="where the products run: default = tensor cores for float16/bfloat16, CUDA cores "
        "for float32; ieee = CUDA cores; tf32/tf32x3 = float32 on tensor cores",
    )
    cmp.add_argument("--block-m", type=int)
    cmp.add_argument("--block-n", type=int)
    cmp.add_argument("--repeats", type=_positive, default=20, help="timed runs (median reported)")
    cmp.add_argument("--seed", type=int, default=0)
    cmp.add_argument("--json", action="store_true", help="print the rows as JSON")

    occ = sub.add_parser(
        "occupancy",
        help="registers, shared memory and occupancy per tile configuration (GPU or ptxas)",
    )
    occ.add_argument("--algorithm", nargs="+", default=["fa1", "fa2"], choices=["fa1", "fa2"])
    occ.add_argument("--head-dim", nargs="+", type=int, default=[32, 64, 128])
    occ.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "float16", "bfloat16"])
    occ.add_argument(
        "--precision", nargs="+", default=["default"], choices=["default", "ieee", "tf32", "tf32x3"],
        help="regimes to profile (default: tensor cores for 16-bit dtypes, CUDA cores for float32)",
    )
    occ.add_argument("--block-m", nargs="+", type=int, default=[32, 64, 128, 256])
    occ.add_argument("--block-n", nargs="+", type=int, default=[16, 32])
    occ.add_argument("--causal", action="store_true")
    occ.add_argument("--source", choices=["driver", "ptxas"], help="default: driver on a GPU, else ptxas")
    occ.add_argument("--cc", default="9.0", help="compute capability for ptxas (default 9.0, H100/H200)")
    occ.add_argument("--json", action="store_true", help="print a JSON list of row objects")
    occ.add_argument("--plot", metavar="DIR", help="write occupancy/registers-vs-tile PNGs here")

    tune = sub.add_parser("autotune", help="time tile candidates on this GPU and cache the fastest")
    tune.add_argument("--algorithm", nargs="+", default=["fa2", "fa1"], choices=["fa1", "fa2"])
    tune.add_argument("--head-dim", nargs="+", type=int, default=[64, 128])
    tune.add_argument("--dtype", nargs="+", default=["float32", "float16"], choices=["float32", "float16"])
    tune.add_argument("--causal", choices=["both", "on", "off"], default="both")
    tune.add_argument("--seq", type=int, default=4096)
    tune.add_argument("--batch", type=int, default=4)
    tune.add_argument("--heads", type=int, default=16)

    sub.add_parser("demo", help="the online-softmax worked example of the seed, step by step")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "occupancy":
        return _occupancy(args)
    choose_world()
    if args.command == "autotune":
        return _autotune(args)
    if args.command == "demo":
        from numba_flash.seed_example import print_worked_example

        print_worked_example()
        return 0
    from numba_flash.compare import compare, format_table

    try:
        rows, notes = compare(args)
    except (ValueError, TypeError) as exc:  # a problem the kernels refuse, said in one line
        print(f"numba-flash compare: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rows, indent=2, default=_json_default))
        for note in notes:
            print(note, file=sys.stderr)
    else:
        print(format_table(rows, notes))
    return 0


def _autotune(args) -> int:
    from numba_flash._world import simulated

    if simulated():
        print("autotune measures on a GPU; none was found (Numba's CUDA simulator is active)", file=sys.stderr)
        return 2
    from numba_flash.tuning import autotune

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
    if source == "ptxas" and "numba.cuda" not in sys.modules:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "0"  # compile for real; no GPU is touched
    from numba_flash.profiling.occupancy import ROW_KEYS, configurations, profile

    cc = tuple(int(x) for x in args.cc.split("."))
    precisions = [None if p == "default" else p for p in args.precision]
    configs = configurations(
        args.algorithm, args.head_dim, args.dtype, args.block_m, args.block_n, (args.causal,), precisions
    )
    try:
        rows = profile(configs, cc=cc, source=source, progress=lambda m: print(m, file=sys.stderr, flush=True))
    except Exception as exc:
        if source != "ptxas":
            raise
        print(
            f"numba-flash occupancy: compiling without a GPU failed ({type(exc).__name__}: {exc}).\n"
            "It needs libNVVM and a recent ptxas: pip install 'numba-flash[occupancy]'",
            file=sys.stderr,
        )
        return 2
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(_markdown(rows, ROW_KEYS))
    if args.plot:
        from numba_flash.profiling.plots import plot_occupancy

        for path in plot_occupancy(rows, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def _markdown(rows, keys) -> str:
    def cell(v):
        return f"{v:.1%}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def _json_default(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    raise TypeError(type(x))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
