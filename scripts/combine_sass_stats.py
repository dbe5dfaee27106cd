"""Offline SASS statistics of the split-KV combine kernel (no GPU): registers, instructions,
global loads, how many of them are issued before the first one is waited for, shuffles,
barriers. Optionally the same for the kernel of another revision (``--baseline REV``: its
``numba_flash/kernels/combine.py``, as ``git show`` gives it).

Run with numba's CUDA target; needs ptxas and cuobjdump as ``tc_sass_stats.py`` does.

    python scripts/combine_sass_stats.py --splits 2 32 128 --head-dim 64 128 --baseline fc68d13

"Loads in flight" is static: the most global loads issued in a row before an instruction
reads the register of one of them (a warp issues in order, so that instruction waits for its
load while the ones before it are in flight).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import types as pytypes

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tc_sass_stats import compile_sass_of, parse  # noqa: E402

REG = re.compile(r"\bR(\d+)\b")


def loads_in_flight(instrs):
    """The largest number of LDGs issued before one of their destinations is read."""
    pending, best = {}, 0
    for _, op, args in instrs:
        regs = REG.findall(args)
        if op.startswith("LDG"):
            srcs = regs[1:]
        else:
            srcs = regs[1:] if not op.startswith(("ST", "BRA", "SHFL")) else regs
            if op.startswith("SHFL"):
                srcs = regs[1:]
        if any(r in pending for r in srcs):
            best = max(best, len(pending))
            pending.clear()
        if op.startswith("LDG") and regs:
            pending[regs[0]] = True
        elif regs and regs[0] in pending:  # overwritten before being read
            pending.pop(regs[0])
    return max(best, len(pending))


def kernel_stats(kernel, out_dtype):
    from numba.cuda import types

    A = lambda dt, n: types.Array(dt, n, "C")  # noqa: E731
    sig = (A(types.float32, 4), A(types.float32, 3), A(getattr(types, out_dtype), 4), A(types.float32, 3))
    _, sass, res = compile_sass_of(kernel.py_func, sig, kernel.targetoptions.get("fastmath"))
    instrs = parse(sass)
    ops = collections.Counter(op.split(".")[0] for _, op, _ in instrs)
    return dict(regs=res["regs"], stack=res["stack"], instructions=len(instrs), LDG=ops["LDG"],
                in_flight=loads_in_flight(instrs), SHFL=ops["SHFL"], BAR=ops["BAR"], LDS=ops["LDS"],
                STS=ops["STS"], MUFU=ops["MUFU"], BRA=ops["BRA"])


def baseline_module(rev):
    """``numba_flash/kernels/combine.py`` of revision ``rev``, loaded as a module."""
    source = subprocess.run(["git", "show", f"{rev}:numba_flash/kernels/combine.py"], capture_output=True,
                            text=True, check=True).stdout
    module = pytypes.ModuleType(f"combine_{rev}")
    exec(compile(source, f"{rev}:combine.py", "exec"), module.__dict__)
    return module


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--splits", type=int, nargs="+", default=[2, 4, 8, 32, 64, 128])
    p.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    p.add_argument("--out", default="float16", help="o's dtype: float32, float16 (values) or uint16 (bf16 patterns)")
    p.add_argument("--baseline", help="a git revision whose combine kernel is reported too")
    args = p.parse_args(argv)
    from numba_flash.kernels.combine import combine_launch

    bits = "bf16" if args.out == "uint16" else None
    cols = "regs stack instructions LDG in_flight SHFL BAR LDS STS MUFU BRA".split()
    print("kernel | S | D | block | " + " | ".join(cols))
    if args.baseline:
        old = baseline_module(args.baseline)
        s = kernel_stats(old.combine_kernel(bits), args.out)
        print(f"{args.baseline} | any | any | {old.COMBINE_THREADS} | " + " | ".join(str(s[c]) for c in cols))
    for d in args.head_dim:
        for n in args.splits:
            kernel, _, block = combine_launch(n, (1, 32, 1, d), bits)
            s = kernel_stats(kernel, args.out)
            print(f"now | {n} | {d} | {block} | " + " | ".join(str(s[c]) for c in cols))


if __name__ == "__main__":
    main()
