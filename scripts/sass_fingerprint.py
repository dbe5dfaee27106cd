"""SASS fingerprints of every kernel configuration the benchmarks cover, compiled offline (no GPU).

A refactor that leaves a kernel's SASS identical leaves its speed identical: this script is how a
change proves "nothing slower" without device time. It compiles each configuration to PTX with
numba (``cuda.compile_ptx``, sm_90), through the ``occupancy`` extra's ptxas, dumps the SASS with
cuobjdump, and records a hash of the instructions (symbol names removed, so a kernel that moved
between modules still compares equal) with registers and spills.

    python scripts/sass_fingerprint.py --out after.json [--compare before.json] [--only forward]

Families: ``forward`` (CUDA cores and tensor cores, FA-1 and FA-2, plain, ragged and split-output),
``decode`` (the key-warp ring), ``variants`` (ablation points), ``backward`` (CUDA cores and tensor
cores), ``combine``. Needs ``pip install -e '.[occupancy]'`` and ``nvidia-cuda-cuobjdump``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tc_sass_stats import compile_sass_of  # noqa: E402

NAME = re.compile(r"_Z\w+|\$__internal_\w+|__cuda_\w+")
PARAM = re.compile(r"c\[0x0\]\[0x[0-9a-f]+\]")


def normalised(sass: str) -> str:
    """The instruction lines of ``sass`` with symbol names replaced (kernel names carry the module)."""
    lines = [ln for ln in sass.splitlines() if "/*" in ln and ";" in ln]
    return "\n".join(NAME.sub("SYM", ln.strip()) for ln in lines)


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

    for d in (64, 128):
        for causal in (False, True):
            yield f"decode-f16-d{d}-{'causal' if causal else 'full'}-16x64-ring2-w4", kernel_spec(
                "fa2", d, "float16", 16, 64, causal, regime="f16", ragged=True, split_out=True, kv_stages=2, key_warps=4)
        yield f"decode-f16-d{d}-64x64-ring1", kernel_spec("fa2", d, "float16", 64, 64, True, regime="f16", ragged=True,
                                                         split_out=True)


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
    u4 = types.Array(types.uint16, 4, "C")
    for d in (64, 128):
        for causal in (False, True):
            c = "causal" if causal else "full"
            block = tile_table.backward_block(d)
            kv_sig = (f4,) * 5 + (f3, f3, f4, f4, f4, f)
            yield f"bwd-ieee-fa2-d{d}-{c}", Raw(bwd.bwd_kernel("fa2", d, block, causal, True), kv_sig)
            yield f"bwd-ieee-fa2det-d{d}-{c}", Raw(bwd.bwd_kernel("fa2", d, block, causal, False), kv_sig)
            yield f"bwd-ieee-fa1-d{d}-{c}", Raw(bwd.bwd_kernel("fa1", d, block, causal, True), kv_sig)
            yield f"bwd-ieee-dq-d{d}-{c}", Raw(bwd.bwd_dq_kernel(d, block, causal), (f4,) * 4 + (f3, f3, f4, f))
            for kind in ("f16", "bf16", "tf32x3"):
                x4 = u4 if kind in tc_bwd.HALF_KINDS else f4
                kv = (x4,) * 5 + (f3, f3, f4, x4, x4, f)
                bm, bn = tile_table.backward_tc_tiles(d, kind)
                for order, dq in (("fa2", True), ("fa2", False), ("fa1", True)):
                    yield f"bwd-{kind}-{order}{'' if dq else 'det'}-d{d}-{c}", Raw(
                        tc_bwd.tc_bwd_kernel(order, kind, d, bm, bn, causal, dq), kv)
                dm, dn = tc_bwd.dq_kernel_tiles(bm, bn, kind)
                yield f"bwd-{kind}-dq-d{d}-{c}", Raw(tc_bwd.tc_bwd_dq_kernel(kind, d, dm, dn, causal),
                                                     (x4,) * 4 + (f3, f3, f4, f))


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


FAMILIES = {"forward": forward_configs, "decode": decode_configs, "variants": variant_configs,
            "backward": backward_configs, "combine": combine_configs}


def fingerprint(spec):
    kernel = spec.kernel
    _, sass, res = compile_sass_of(kernel.py_func, spec.signature(), kernel.targetoptions.get("fastmath"),
                                   spec.register_cap)
    body = normalised(sass)
    # code: the same hash with kernel-parameter offsets masked (a kernel given more or other
    # arguments reads them from other constant-bank offsets; its instructions are the same)
    code = re.sub(r"/\* [0-9a-f]+ \*/", "", PARAM.sub("c[0x0][PARAM]", body))
    return dict(sha=hashlib.sha256(body.encode()).hexdigest()[:16],
                code=hashlib.sha256(code.encode()).hexdigest()[:16], instructions=body.count("\n") + 1, **res)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file of {configuration: fingerprint}")
    p.add_argument("--compare", help="a JSON written before: list what differs")
    p.add_argument("--only", nargs="*", choices=sorted(FAMILIES), help="families to compile (default: all)")
    p.add_argument("--match", help="only configurations whose name contains this")
    args = p.parse_args(argv)
    out = {}
    t0 = time.time()
    for fam in args.only or list(FAMILIES):
        for name, spec in FAMILIES[fam]():
            if args.match and args.match not in name:
                continue
            try:
                out[name] = fingerprint(spec)
            except Exception as e:  # a configuration that does not compile is a result too
                out[name] = dict(error=f"{type(e).__name__}: {e}"[:300])
            print(f"[{time.time() - t0:6.0f} s] {name}: {out[name]}", flush=True)
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
              f"{len(differ)} differ, {len([n for n in out if n not in before])} new")
        for n in differ:
            print(f"  DIFFERS {n}: {before[n]} -> {out[n]}")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
