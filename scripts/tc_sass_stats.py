"""Offline SASS statistics of the tensor-core kernels (no GPU): registers, spills, blocks per SM,
and the instruction mix of the K/V loop body (per warp and tile).

Run with numba's CUDA target (``NUMBA_ENABLE_CUDASIM=0``) and the ptxas of the ``occupancy``
extra; needs ``cuobjdump`` (nvidia-cuda-cuobjdump wheel) on PATH or in ``CUOBJDUMP``.

    python scripts/tc_sass_stats.py --precision tf32x3 --head-dim 64 128 --tiles 128x32 64x64

The loop body is the largest backward-branch range of the SASS that holds HMMA instructions;
counts are static (each instruction once), which is per warp and K/V tile for the straight-line
body (the rescale and mask branches are counted once each).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")

# opcode families reported (the rest are summed as "other")
CONVERT = ("F2F", "FADD", "LOP3", "FMUL", "IMAD", "FFMA", "I2F", "F2I", "SHF", "PRMT", "MOV")
LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")


def cuobjdump() -> str:
    path = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump") or "/tmp/tc/tools/nvidia/cu13/bin/cuobjdump"
    if not os.path.exists(path):
        sys.exit("cuobjdump not found: pip download nvidia-cuda-cuobjdump, unzip, set CUOBJDUMP")
    return path


def compile_sass(cfg, max_registers=None):
    from numba_flash.research.profiling.occupancy import compile_ptx

    return sass_of_ptx(compile_ptx(cfg), max_registers)


def compile_sass_of(pyfunc, signature, fastmath=None, max_registers=None, cc=(9, 0)):
    """``compile_sass`` for any kernel: its Python function, argument types and fastmath flags."""
    from numba_flash._cuda import cuda
    from numba_flash.research.profiling.occupancy import no_device_compilation

    with no_device_compilation(cc):
        ptx, _ = cuda.compile_ptx(pyfunc, signature, cc=cc, fastmath=fastmath)
    return sass_of_ptx(ptx, max_registers)


def sass_of_ptx(ptx, max_registers=None):
    """(ptx, SASS, resources) of PTX through ptxas -v (sm_90) and cuobjdump."""
    from numba_flash.research.profiling.occupancy import find_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [find_ptxas(), "-v", "-arch=sm_90", src, "-o", cubin]
        if max_registers:
            cmd.insert(2, f"-maxrregcount={max_registers}")
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        sass = subprocess.run([cuobjdump(), "-sass", cubin], capture_output=True, text=True, check=True).stdout
    info = done.stderr
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    spill_st = int(re.search(r"(\d+) bytes spill stores", info).group(1))
    spill_ld = int(re.search(r"(\d+) bytes spill loads", info).group(1))
    stack = int(re.search(r"(\d+) bytes stack frame", info).group(1))
    return ptx, sass, dict(regs=regs, spill_stores=spill_st, spill_loads=spill_ld, stack=stack)


def parse(sass):
    """[(address, opcode, operands)] of the kernel's instructions."""
    out = []
    for line in sass.splitlines():
        m = LINE.search(line)
        if m:
            op = m.group(3)
            if (m.group(2) or "").strip() == "@!UPT" and op == "UIADD3":
                op = "NOP"  # never-executed filler ptxas puts between dependent HMMAs
            out.append((int(m.group(1), 16), op, m.group(4)))
    return out


def loops(instrs):
    """(first, last) addresses of every backward branch's range."""
    out = []
    for addr, op, args in instrs:
        if op.startswith("BRA"):
            t = re.search(r"0x([0-9a-f]+)", args)
            if t and int(t.group(1), 16) < addr:
                out.append((int(t.group(1), 16), addr))
    return out


def loop_body(instrs, trip, step_hmma=None):
    """[(weight, instruction)] of the K/V loop: the largest backward-branch range holding an
    HMMA. Loops nested in it (ptxas keeps e.g. the head-dim steps of S rolled at D = 128) run
    over the head dim: their instructions are weighted by ``trip`` (DP / k-step), divided by the
    steps one iteration makes when ``step_hmma`` (HMMAs per head-dim step) is given and the
    nested loop holds a multiple of it (ptxas may unroll the rolled loop by 2); the caller
    checks the weighted HMMA count against the products a tile must make."""
    ranges = [r for r in loops(instrs) if any(r[0] <= a <= r[1] and o.startswith("HMMA") for a, o, _ in instrs)]
    if not ranges:
        return [], []
    lo, hi = max(ranges, key=lambda r: r[1] - r[0])
    inner = [r for r in loops(instrs) if lo <= r[0] and r[1] <= hi and r != (lo, hi)]
    body = [x for x in instrs if lo <= x[0] <= hi]
    trips = {}
    for r0, r1 in inner:
        n = sum(1 for a, o, _ in body if r0 <= a <= r1 and o.startswith("HMMA"))
        steps = n // step_hmma if step_hmma and n and n % step_hmma == 0 else 1
        trips[(r0, r1)] = max(1, trip // steps)
    out = []
    for a, o, r in body:
        w = 1
        for r0, r1 in inner:
            if r0 <= a <= r1:
                w *= trips[(r0, r1)]
        out.append((w, (a, o, r)))
    return out, inner


def mix(body):
    c = collections.Counter()
    for w, (_, op, _) in body:
        c[op.split(".")[0]] += w
        if op.startswith("LDS.") and not op.startswith("LDS.U."):
            c["LDS." + op.split(".")[1]] += w  # LDS.64, LDS.128
    hmma = c["HMMA"]
    lds = c["LDS"]
    ldsm = c["LDSM"]
    # cvt.rna.tf32.f32 is FSETP (inf/NaN), VIADD (+0x1000), SEL, LOP3 (mask) on sm_90
    conv = sum(c[k] for k in ("F2F", "FADD", "LOP3", "VIADD", "FSETP", "SEL", "IADD3"))
    return dict(
        body=sum(w for w, _ in body), HMMA=hmma, LDS=lds, LDSM=ldsm, F2F=c["F2F"], FADD=c["FADD"], LOP3=c["LOP3"],
        conv=conv, VIADD=c["VIADD"], FSETP=c["FSETP"], SEL=c["SEL"], FMUL=c["FMUL"], FFMA=c["FFMA"], MUFU=c["MUFU"], IMAD=c["IMAD"], BAR=c["BAR"],
        LDL=c["LDL"], STL=c["STL"], MOV=c["MOV"], NOP=c["NOP"], LDS128=c["LDS.128"], STS=c["STS"],
    )


def blocks_per_sm(regs, smem, threads):
    from numba_flash.arch import ARCH
    from numba_flash.research.profiling.occupancy import occupancy_from_resources

    return occupancy_from_resources(regs, smem, threads, ARCH[(9, 0)])


def stats(precision, head_dim, block_m, block_n, algorithm="fa2", causal=False, max_registers=None):
    from numba_flash.kernels.tc_ops import tc_layout
    from numba_flash.specs import kernel_spec

    cfg = dict(algorithm=algorithm, precision=precision, head_dim=head_dim, dtype="float32",
               block_m=block_m, block_n=block_n, causal=causal)
    spec = kernel_spec(algorithm, head_dim, "float32", block_m, block_n, causal, precision)
    if max_registers is None:  # the cap the kernel is launched with (tc_ops.tc_register_cap)
        max_registers = spec.register_cap
    _, sass, res = compile_sass(cfg, max_registers or None)
    L = tc_layout(precision, spec.head_dim, block_m, block_n)
    kstep = 16 if precision in ("f16", "bf16") else 8
    expected = (3 if precision == "tf32x3" else 1) * L.score_tiles * (L.padded_dim // kstep + L.out_tiles * 8 // kstep)
    body, inner = loop_body(parse(sass), L.padded_dim // kstep, (3 if precision == "tf32x3" else 1) * L.score_tiles)
    m = mix(body)
    if m["HMMA"] != expected:
        m["note_hmma"] = f"HMMA {m['HMMA']} != {expected} expected: inner-loop weights wrong"
        print("WARNING", cfg, m["note_hmma"], file=sys.stderr)
    blocks, limiter = blocks_per_sm(res["regs"], spec.dynamic_smem, spec.threads)
    return dict(cfg, threads=spec.threads, smem=spec.dynamic_smem, maxrreg=max_registers, **res,
                blocks=blocks, limiter=limiter, inner_loops=len(inner), **m), sass


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precision", nargs="+", default=["tf32x3"])
    p.add_argument("--head-dim", nargs="+", type=int, default=[64, 128])
    p.add_argument("--tiles", nargs="+", default=["128x32"])
    p.add_argument("--algorithm", nargs="+", default=["fa2"])
    p.add_argument("--max-registers", nargs="+", type=int, default=[-1],
                   help="ptxas -maxrregcount; -1: the kernel's own cap (default), 0: none")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--note", default="")
    p.add_argument("--dump", help="directory to write each SASS into")
    a = p.parse_args(argv)
    import numba_flash

    print(f"# numba_flash from {os.path.dirname(numba_flash.__file__)}", file=sys.stderr)
    keys = ("algorithm", "precision", "head_dim", "block_m", "block_n", "maxrreg", "threads", "smem", "regs",
            "spill_stores", "spill_loads", "blocks", "limiter", "inner_loops", "HMMA", "conv", "FADD", "LOP3", "VIADD", "FSETP", "SEL", "LDS",
            "LDS128", "LDSM", "STS", "FMUL", "FFMA", "IMAD", "MOV", "LDL", "STL", "NOP", "BAR", "body", "note")
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for alg in a.algorithm:
        for prec in a.precision:
            for d in a.head_dim:
                for t in a.tiles:
                    bm, bn = map(int, t.split("x"))
                    for cap in a.max_registers:
                        row, sass = stats(prec, d, bm, bn, alg, a.causal, None if cap < 0 else cap)
                        row["note"] = a.note
                        if a.dump:
                            os.makedirs(a.dump, exist_ok=True)
                            with open(os.path.join(a.dump, f"{alg}_{prec}_d{d}_{bm}x{bn}_r{cap}.sass"), "w") as f:
                                f.write(sass)
                        print("| " + " | ".join(str(row[k]) for k in keys) + " |", flush=True)


if __name__ == "__main__":
    main()
