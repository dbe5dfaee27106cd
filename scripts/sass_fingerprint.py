"""SASS fingerprints and statistics of every kernel configuration the benchmarks cover, compiled
offline (no GPU).

A refactor that leaves a kernel's SASS identical leaves its speed identical: this script is how a
change proves "nothing slower" without device time. It compiles each configuration to PTX with
numba (``cuda.compile_ptx``, sm_90), through the ``occupancy`` extra's ptxas, dumps the SASS with
cuobjdump, and records a hash of the instructions (symbol names removed, so a kernel that moved
between modules still compares equal) with registers and spills.

    python scripts/sass_fingerprint.py --out after.json [--compare before.json] [--only forward]
    python scripts/sass_fingerprint.py --stats [--only backward] [--match d128] [--dump DIR]

``--stats`` prints one Markdown row per configuration instead: registers, spill stores and loads,
stack frame, instructions, the static count (each instruction once) of the opcode families that
decide these kernels' speed (HMMA, FFMA, shared loads and stores, ldmatrix, global loads and
cp.async, MUFU, shuffles, barriers, reductions and atomics, local memory), and the same for the
main loop: the largest backward-branch range holding an HMMA (tensor cores), else an FFMA (CUDA
cores). Loops ptxas keeps rolled inside the main loop count once; occupancy per configuration is
``numba-flash occupancy``'s. (The per-experiment analyses that weighted rolled loops by their trip
counts were ``scripts/{tc,ffma,bwd,combine}_sass_stats.py``, folded into this mode in issue 22;
docs/performance-log.md names the commit that has each.)

Families: ``forward`` (CUDA cores and tensor cores, FA-1 and FA-2, plain, ragged and split-output),
``decode`` (the key-warp ring), ``variants`` (ablation points), ``backward`` (CUDA cores and tensor
cores), ``combine``, ``masks`` (windows and softcap). Needs ``pip install -e '.[occupancy]'`` and cuobjdump (the
``nvidia-cuda-cuobjdump`` wheel, or ``CUOBJDUMP``, or on PATH).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")

NAME = re.compile(r"_Z\w+|\$__internal_\w+|__cuda_\w+")
PARAM = re.compile(r"c\[0x0\]\[0x[0-9a-f]+\]")
LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
# --stats: the opcode families counted (REDG, ATOM and ATOMG count as RED; LDS.128 also as LDS)
STAT_OPS = ("HMMA", "FFMA", "LDS", "LDS.128", "LDSM", "STS", "LDG", "LDGSTS", "MUFU", "SHFL", "BAR", "RED", "LDL",
            "STL")
LOOP_OPS = ("HMMA", "FFMA", "LDS", "LDSM", "BAR")


# ------------------------------------------------------------------ compiling to SASS


CUOBJDUMP_HINT = "not found: pip install nvidia-cuda-cuobjdump, or set CUOBJDUMP"


def find_cuobjdump() -> str | None:
    """cuobjdump: ``CUOBJDUMP``, else the nvidia-cuda-cuobjdump wheel's (beside the wheel's ptxas),
    else the first on PATH; ``None`` when there is none."""
    from numba_flash.research.profiling.occupancy import find_ptxas

    try:
        beside = os.path.join(os.path.dirname(find_ptxas()), "cuobjdump")
    except RuntimeError:  # no ptxas either
        beside = None
    for path in (os.environ.get("CUOBJDUMP"), beside, shutil.which("cuobjdump")):
        if path and os.path.exists(path):
            return path
    return None


def cuobjdump() -> str:
    """:func:`find_cuobjdump`'s path (``main`` checked that there is one)."""
    path = find_cuobjdump()
    if path is None:
        sys.exit(f"cuobjdump {CUOBJDUMP_HINT}")
    return path


def unmet_toolchain() -> str | None:
    """What compiling to SASS without a GPU lacks here, in one line (``numba_flash.needs``): the
    occupancy extra's libNVVM, NVRTC and ptxas (``occupancy.missing_toolchain``), and cuobjdump."""
    from numba_flash import needs
    from numba_flash.research.profiling.occupancy import OCCUPANCY_EXTRA, missing_toolchain

    missing = [f"{m} ({OCCUPANCY_EXTRA})" for m in missing_toolchain() if not m.startswith("ptxas") or m.endswith("not found")]
    if find_cuobjdump() is None:
        missing.append(f"cuobjdump ({CUOBJDUMP_HINT})")
    return needs.unmet("sass_fingerprint.py", *missing)


def compile_sass_of(pyfunc, signature, fastmath=None, max_registers=None, cc=(9, 0)):
    """(ptx, SASS, resources) of a kernel: its Python function, argument types and fastmath flags."""
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


def normalised(sass: str) -> str:
    """The instruction lines of ``sass`` with symbol names replaced (kernel names carry the module)."""
    lines = [ln for ln in sass.splitlines() if "/*" in ln and ";" in ln]
    return "\n".join(NAME.sub("SYM", ln.strip()) for ln in lines)


# ------------------------------------------------------------------ reading SASS (--stats)


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


def op_counts(instrs) -> collections.Counter:
    """Static count of each opcode family (``STAT_OPS``) and ``total``."""
    c = collections.Counter()
    for _, op, _ in instrs:
        family = op.split(".")[0]
        c["RED" if family in ("REDG", "ATOM", "ATOMG") else family] += 1
        if family == "LDS" and ".128" in op:
            c["LDS.128"] += 1
        c["total"] += 1
    return c


def main_loop(instrs):
    """The instructions of the largest backward-branch range holding an HMMA, else an FFMA
    (the K/V loop of a forward, the Q-tile step of a backward); [] when there is none."""
    ranges = loops(instrs)
    for marker in ("HMMA", "FFMA"):
        holding = [r for r in ranges if any(r[0] <= a <= r[1] and o.startswith(marker) for a, o, _ in instrs)]
        if holding:
            lo, hi = max(holding, key=lambda r: r[1] - r[0])
            return [x for x in instrs if lo <= x[0] <= hi]
    return []


def sass_stats(sass: str, resources: dict) -> dict:
    """The ``--stats`` row of one kernel (module doc)."""
    instrs = parse(sass)
    whole, loop = op_counts(instrs), op_counts(main_loop(instrs))
    return dict(**resources, instructions=whole["total"], **{op: whole[op] for op in STAT_OPS},
                loop=loop["total"], **{f"loop {op}": loop[op] for op in LOOP_OPS})


def forward_configs():
    from numba_flash.tile_table import comparison_tiles
    from numba_flash.tile_table import forward_tc_tiles as default_tc_tiles
    from numba_flash.tile_table import forward_tiles as default_tiles
    from numba_flash.specs import kernel_spec

    for alg in ("fa1", "fa2"):
        for d in (40, 64, 128):
            for causal in (False, True):
                for dtype in ("float32", "float16"):
                    bm, bn = default_tiles(alg, d, dtype, causal)
                    yield f"ieee-{alg}-{dtype}-d{d}-{'causal' if causal else 'full'}-{bm}x{bn}", kernel_spec(
                        alg, d, dtype, bm, bn, causal)
                bm, bn = comparison_tiles(d)
                yield f"ieee-{alg}-float32-d{d}-{'causal' if causal else 'full'}-cmp{bm}x{bn}", kernel_spec(
                    alg, d, "float32", bm, bn, causal)
                for kind in ("f16", "bf16", "tf32", "tf32x3"):
                    dtype = "float32" if kind.startswith("tf32") else ("float16" if kind == "f16" else "bfloat16")
                    bm, bn = default_tc_tiles(kind, d)
                    yield f"tc-{kind}-{alg}-d{d}-{'causal' if causal else 'full'}", kernel_spec(
                        alg, d, dtype, bm, bn, causal, regime=kind)
    for alg in ("fa1", "fa2"):  # issue 25: D = 256 at the wide tiles (tile_table.WIDE_HEAD_DIM), causal
        bm, bn = default_tiles(alg, 256, "float32", True)
        yield f"ieee-{alg}-float32-d256-causal-{bm}x{bn}", kernel_spec(alg, 256, "float32", bm, bn, True)
        for kind in ("f16", "tf32"):
            dtype = "float32" if kind.startswith("tf32") else "float16"
            bm, bn = default_tc_tiles(kind, 256)
            yield f"tc-{kind}-{alg}-d256-causal", kernel_spec(alg, 256, dtype, bm, bn, True, regime=kind)
    for d in (64, 128):
        bm, bn = default_tiles("fa2", d, "float32", False)
        yield f"ieee-fa2-float32-d{d}-ragged-split", kernel_spec("fa2", d, "float32", bm, bn, True, ragged=True,
                                                                 split_out=True)
        for kind in ("f16", "tf32x3"):
            dtype = "float32" if kind == "tf32x3" else "float16"
            bm, bn = default_tc_tiles(kind, d)
            yield f"tc-{kind}-fa2-d{d}-ragged-split", kernel_spec("fa2", d, dtype, bm, bn, True, regime=kind,
                                                                  ragged=True, split_out=True)


def decode_configs():
    from numba_flash.specs import kernel_spec

    yield "decode-f16-d256-causal-16x64-ring2-w4-paged16", kernel_spec(  # issue 25's head dims above 128
        "fa2", 256, "float16", 16, 64, True, regime="f16", ragged=True, split_out=True, kv_stages=2, key_warps=4,
        page_size=16)
    for d in (64, 128):
        for causal in (False, True):
            yield f"decode-f16-d{d}-{'causal' if causal else 'full'}-16x64-ring2-w4", kernel_spec(
                "fa2", d, "float16", 16, 64, causal, regime="f16", ragged=True, split_out=True, kv_stages=2, key_warps=4)
        yield f"decode-f16-d{d}-64x64-ring1", kernel_spec("fa2", d, "float16", 64, 64, True, regime="f16", ragged=True,
                                                         split_out=True)
        for page in (16, 64, 256):  # a paged cache (kernels.paged): the key-warp ring's copies through the table
            yield f"decode-f16-d{d}-causal-16x64-ring2-w4-paged{page}", kernel_spec(
                "fa2", d, "float16", 16, 64, True, regime="f16", ragged=True, split_out=True, kv_stages=2, key_warps=4,
                page_size=page)


def variant_configs():
    from numba_flash.kernels.forward import Variant
    from numba_flash.specs import kernel_spec

    points = [Variant("kv_outer", "heads_x_qtiles", "every_step"), Variant("q_outer", "heads", "deferred"),
              Variant("q_outer", "heads_x_qtiles", "every_step"), Variant("kv_outer", "heads", "deferred", "split_k"),
              Variant("q_outer", "heads_x_qtiles", "deferred", "split_k"),
              Variant("kv_outer", "heads", "every_step", "split_q", "with_q")]
    for p in points:
        for causal in (False, True):
            yield f"variant-{p.name}-d64-{'causal' if causal else 'full'}", kernel_spec(
                "fa2", 64, "float32", 64, 32, causal, variant=p)


class Raw:
    """A kernel given as (dispatcher, signature): the backward's and the combine's."""

    def __init__(self, kernel, signature, register_cap=None):
        self.kernel, self._sig, self.register_cap = kernel, signature, register_cap

    def signature(self):
        return self._sig


def backward_configs():
    from numba import types

    from numba_flash import tile_table
    from numba_flash.kernels import bwd, tc_bwd

    f4, f3, f = types.Array(types.float32, 4, "C"), types.Array(types.float32, 3, "C"), types.float32
    f2, u4 = types.Array(types.float32, 2, "C"), types.Array(types.uint16, 4, "C")
    for d in (64, 128):
        for causal in (False, True):
            c = "causal" if causal else "full"
            block = tile_table.backward_block(d)
            kv_sig = (f4,) * 5 + (f3, f3, f4, f4, f4, f, f, f2)  # ..., scale, softcap_log2, alibi
            yield f"bwd-ieee-fa2-d{d}-{c}", Raw(bwd.bwd_kernel("fa2", d, block, causal, True), kv_sig)
            yield f"bwd-ieee-fa2det-d{d}-{c}", Raw(bwd.bwd_kernel("fa2", d, block, causal, False), kv_sig)
            yield f"bwd-ieee-fa1-d{d}-{c}", Raw(bwd.bwd_kernel("fa1", d, block, causal, True), kv_sig)
            yield f"bwd-ieee-dq-d{d}-{c}", Raw(bwd.bwd_dq_kernel(d, block, causal), (f4,) * 4 + (f3, f3, f4, f, f, f2))
            for kind in ("f16", "bf16", "tf32x3"):
                x4 = u4 if kind in tc_bwd.HALF_KINDS else f4
                kv = (x4,) * 5 + (f3, f3, f4, x4, x4, f, f, f2)
                bm, bn = tile_table.backward_tc_tiles(d, kind)
                for order, dq in (("fa2", True), ("fa2", False), ("fa1", True)):
                    yield f"bwd-{kind}-{order}{'' if dq else 'det'}-d{d}-{c}", Raw(
                        tc_bwd.tc_bwd_kernel(order, kind, d, bm, bn, causal, dq), kv)
                dm, dn = tc_bwd.dq_kernel_tiles(bm, bn, kind)
                yield f"bwd-{kind}-dq-d{d}-{c}", Raw(tc_bwd.tc_bwd_dq_kernel(kind, d, dm, dn, causal),
                                                     (x4,) * 4 + (f3, f3, f4, f, f, f2))
    d = 256  # issue 25: the column split (two warps per 16 keys; 16-bit: shared scores), causal, default tiles
    for kind in ("f16", "tf32x3"):
        x4 = u4 if kind in tc_bwd.HALF_KINDS else f4
        kv = (x4,) * 5 + (f3, f3, f4, x4, x4, f, f, f2)
        for order, dq in (("fa2", True), ("fa2", False), ("fa1", True)):
            bm, bn = tile_table.backward_tc_tiles(d, kind, order)
            yield f"bwd-{kind}-{order}{'' if dq else 'det'}-d{d}-causal-{bm}x{bn}", Raw(
                tc_bwd.tc_bwd_kernel(order, kind, d, bm, bn, True, dq), kv)
        dm, dn = tc_bwd.dq_kernel_tiles(*tile_table.backward_tc_tiles(d, kind), kind, d)
        yield f"bwd-{kind}-dq-d{d}-causal-{dm}x{dn}", Raw(tc_bwd.tc_bwd_dq_kernel(kind, d, dm, dn, True),
                                                          (x4,) * 4 + (f3, f3, f4, f, f, f2))


def combine_configs():
    from numba import types

    from numba_flash.kernels.combine import combine_launch

    A = lambda dt, n: types.Array(dt, n, "C")  # noqa: E731
    for splits in (4, 32):
        for d in (64, 128):
            for bits, out in ((None, types.float32), ("f16", types.uint16)):
                launch = combine_launch(splits, (1, 8, 16, d), bits)
                kernel = launch[0] if isinstance(launch, tuple) else launch
                sig = (A(types.float32, 4), A(types.float32, 3), A(out, 4), A(types.float32, 3))
                yield f"combine-s{splits}-d{d}-{bits or 'f32'}", Raw(kernel, sig)


def mask_configs():
    """The forward with a sliding window, with softcap and with ALiBi (issue 24), beside the plain
    kernels of ``forward``: what a mask, a cap or a bias adds to the SASS."""
    from numba_flash.specs import kernel_spec
    from numba_flash.tile_table import forward_tc_tiles as default_tc_tiles

    for d in (64, 128):
        for kind, dtype in (("f16", "float16"), ("tf32x3", "float32")):
            bm, bn = default_tc_tiles(kind, d)
            yield f"mask-tc-{kind}-fa2-d{d}-window", kernel_spec("fa2", d, dtype, bm, bn, (256, 0), regime=kind)
            for window, label in (((-1, -1), "full"), ((-1, 0), "causal")):
                yield f"mask-tc-{kind}-fa2-d{d}-{label}-softcap", kernel_spec("fa2", d, dtype, bm, bn, window,
                                                                             regime=kind, softcap=True)
                yield f"mask-tc-{kind}-fa2-d{d}-{label}-alibi", kernel_spec("fa2", d, dtype, bm, bn, window,
                                                                           regime=kind, alibi=True)
    # A user's mask_mod over two int32 arrays (document ids), forward and deterministic backward:
    # that they compile for sm_90 at all (the simulator runs a mod as Python), and what they cost.
    from numba import types

    from numba_flash.kernels import tc_bwd
    from numba_flash.kernels.score_mods import UserMods
    from numba_flash.tile_table import backward_tc_tiles

    # the backward with softcap and with ALiBi (float16 tensor cores and CUDA cores; FA-2 with atomics,
    # deterministic dQ)
    from numba_flash.kernels import bwd

    f4_, f3_, f2_ = (types.Array(types.float32, n, "C") for n in (4, 3, 2))
    u4_ = types.Array(types.uint16, 4, "C")
    for d in (64, 128):
        m, n = backward_tc_tiles(d, "f16")
        dm, dn = tc_bwd.dq_kernel_tiles(m, n, "f16")
        blk = __import__("numba_flash.tile_table", fromlist=["backward_block"]).backward_block(d)
        for label, mods in (("softcap", dict(softcap=True)), ("alibi", dict(alibi=True))):
            kv16 = (u4_,) * 5 + (f3_, f3_, f4_, u4_, u4_, types.float32, types.float32, f2_)
            yield f"mask-bwd-f16-fa2-d{d}-causal-{label}", Raw(
                tc_bwd.tc_bwd_kernel("fa2", "f16", d, m, n, (-1, 0), True, **mods), kv16)
            yield f"mask-bwd-f16-dq-d{d}-causal-{label}", Raw(
                tc_bwd.tc_bwd_dq_kernel("f16", d, dm, dn, (-1, 0), **mods), (u4_,) * 4 + (f3_, f3_, f4_) + kv16[-3:])
            kv32 = (f4_,) * 5 + (f3_, f3_, f4_, f4_, f4_, types.float32, types.float32, f2_)
            yield f"mask-bwd-ieee-fa1-d{d}-causal-{label}", Raw(bwd.bwd_kernel("fa1", d, blk, (-1, 0), True, **mods), kv32)
            yield f"mask-bwd-ieee-dq-d{d}-causal-{label}", Raw(
                bwd.bwd_dq_kernel(d, blk, (-1, 0), **mods), (f4_,) * 4 + (f3_, f3_, f4_) + kv32[-3:])
    user = UserMods(same_document, None, 2)
    ids = types.UniTuple(types.Array(types.int32, 1, "C"), 2)
    f4, f3, f2 = (types.Array(types.float32, n, "C") for n in (4, 3, 2))
    f = types.float32
    u4 = types.Array(types.uint16, 4, "C")
    for d in (64, 128):
        bm, bn = default_tc_tiles("f16", d)
        spec = kernel_spec("fa2", d, "float16", bm, bn, (-1, -1), regime="f16", user_mods=user)
        yield f"mask-tc-f16-fa2-d{d}-user-documents", Raw(spec.kernel, spec.signature() + (ids,), spec.register_cap)
        sparse = kernel_spec("fa2", d, "float16", bm, bn, (-1, -1), regime="f16",
                             user_mods=UserMods(same_document, None, 2, block_sparse=True))
        lists = (types.Array(types.int32, 3, "C"), types.Array(types.int32, 4, "C"))
        yield f"mask-tc-f16-fa2-d{d}-user-documents-block-sparse", Raw(sparse.kernel, sparse.signature() + (ids,) + lists,
                                                                       sparse.register_cap)
        m, n = backward_tc_tiles(d, "f16")
        yield f"mask-bwd-f16-fa2det-d{d}-user-documents", Raw(
            tc_bwd.tc_bwd_kernel("fa2", "f16", d, m, n, (-1, -1), False, user_mods=user),
            (u4,) * 5 + (f3, f3, f4, u4, u4, f, f, f2, ids))


def same_document(b, h, q_idx, kv_idx, q_doc, kv_doc):
    """The masks family's user mask_mod: a query sees its own document's keys."""
    return q_doc[q_idx] == kv_doc[kv_idx]


FAMILIES = {"forward": forward_configs, "decode": decode_configs, "variants": variant_configs,
            "backward": backward_configs, "combine": combine_configs, "masks": mask_configs}


def compile_spec(spec):
    """(SASS, resources) of a configuration (a ``KernelSpec`` or a :class:`Raw`)."""
    kernel = spec.kernel
    _, sass, res = compile_sass_of(kernel.py_func, spec.signature(), kernel.targetoptions.get("fastmath"),
                                   spec.register_cap)
    return sass, res


def fingerprint(sass: str, resources: dict) -> dict:
    body = normalised(sass)
    # code: the same hash with kernel-parameter offsets masked (a kernel given more or other
    # arguments reads them from other constant-bank offsets; its instructions are the same)
    code = re.sub(r"/\* [0-9a-f]+ \*/", "", PARAM.sub("c[0x0][PARAM]", body))
    return dict(sha=hashlib.sha256(body.encode()).hexdigest()[:16],
                code=hashlib.sha256(code.encode()).hexdigest()[:16], instructions=body.count("\n") + 1, **resources)


def stats_table(stats: dict) -> str:
    """The ``--stats`` rows as one Markdown table (a configuration that did not compile: its error)."""
    from numba_flash.research.report import markdown_table

    keys = next((list(row) for row in stats.values() if "error" not in row), ["error"])
    body = []
    for name, row in stats.items():
        cells = [str(row[k]) for k in keys] if "error" not in row else [row["error"]] + [""] * (len(keys) - 1)
        body.append([name, *cells])
    return "\n".join(markdown_table(["configuration", *keys], body))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="JSON file of {configuration: fingerprint} (needed unless --stats)")
    p.add_argument("--compare", help="a JSON written before: list what differs")
    p.add_argument("--only", nargs="*", choices=sorted(FAMILIES), help="families to compile (default: all)")
    p.add_argument("--match", help="only configurations whose name contains this")
    p.add_argument("--stats", action="store_true",
                   help="print registers, spills and the instruction mix of each configuration (module doc)")
    p.add_argument("--dump", metavar="DIR", help="write each configuration's SASS into this directory")
    args = p.parse_args(argv)
    if not (args.out or args.stats):
        p.error("--out is required (or --stats)")
    if args.compare and not args.out:
        p.error("--compare needs --out")
    unmet = unmet_toolchain()
    if unmet is not None:  # before any work
        print(unmet, file=sys.stderr)
        return 2
    out, stats = {}, {}
    log = sys.stderr if args.stats else sys.stdout  # --stats: the table alone on stdout
    t0 = time.time()
    for fam in args.only or list(FAMILIES):
        for name, spec in FAMILIES[fam]():
            if args.match and args.match not in name:
                continue
            try:
                sass, res = compile_spec(spec)
            except Exception as e:  # a configuration that does not compile is a result too
                out[name] = stats[name] = dict(error=f"{type(e).__name__}: {e}"[:300])
            else:
                out[name] = fingerprint(sass, res)
                if args.stats:
                    stats[name] = sass_stats(sass, res)
                if args.dump:
                    os.makedirs(args.dump, exist_ok=True)
                    with open(os.path.join(args.dump, f"{name}.sass"), "w") as f:
                        f.write(sass)
            print(f"[{time.time() - t0:6.0f} s] {name}: {out[name]}", file=log, flush=True)
    failed = sum("error" in row for row in out.values())
    if failed == len(out):  # nothing compiled (or nothing matched): no fingerprint to keep or compare
        what = f"all {failed} configurations failed to compile" if out else "no configuration matched"
        print(f"sass_fingerprint.py: {what}", file=sys.stderr)
        return 1
    if args.stats:
        print(stats_table(stats), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, sort_keys=True)
    if args.compare:
        with open(args.compare) as f:
            before = json.load(f)
        same = [n for n in out if n in before and before[n] == out[n]]
        code_only = [n for n in out if n in before and n not in same and "code" in before[n]
                     and before[n].get("code") == out[n].get("code")]
        differ = [n for n in out if n in before and n not in same and n not in code_only]
        print(f"{len(same)} identical, {len(code_only)} identical but for kernel-parameter offsets, "
              f"{len(differ)} differ, {len([n for n in out if n not in before])} new", file=log)
        for n in differ:
            print(f"  DIFFERS {n}: {before[n]} -> {out[n]}", file=log)
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
