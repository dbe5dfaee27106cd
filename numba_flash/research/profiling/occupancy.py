"""Occupancy of the FA-1 / FA-2 kernels, with or without a GPU.

For every (algorithm, head_dim, dtype, block_m, block_n, causal) it reports registers
per thread, shared memory per block, local (spill) bytes per thread, threads per block,
resident blocks and warps per SM, theoretical occupancy, and the limiting resource.

Two sources, one signature (C-contiguous arrays, as CuPy allocates them):

- ``driver``: on a GPU, the kernel is compiled by numba for the device and the CUDA
  occupancy API (``cuOccupancyMaxActiveBlocksPerMultiprocessor``) gives blocks per SM.
- ``ptxas``: without a GPU, numba compiles the kernel to PTX for a chosen compute
  capability (``cuda.compile_ptx``), ``ptxas -v`` reports its resources, and
  :func:`occupancy_from_resources` applies that architecture's documented limits (CUDA
  C Programming Guide, "Compute Capabilities" table; CUDA Occupancy Calculator rules).
  Needs libNVVM and a ptxas that reads its PTX: ``pip install numba-flash[occupancy]``.

Both sources pass the kernels' register cap (``tiles.register_cap``) the same way:
numba passes it to the driver's JIT linker, here it is ``ptxas -maxrregcount``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from itertools import product

from numba_flash import switches
from numba_flash.arch import ARCH, SMEM_OPTIN_LIMIT, ArchLimits
from numba_flash.kernels.tiles import tiles_fit
from numba_flash.specs import kernel_spec


ROW_KEYS = (
    "algorithm", "precision", "head_dim", "dtype", "causal", "block_m", "block_n", "threads", "regs",
    "smem_bytes", "local_bytes", "blocks_per_sm", "warps_per_sm", "occupancy", "limiter", "source",
)


def occupancy_from_resources(regs: int, smem: int, threads: int, arch: ArchLimits) -> tuple[int, str]:
    """Resident blocks per SM and the limiting resource, by the occupancy calculator's rules."""
    warps = -(-threads // 32)
    regs_per_warp = -(-regs * 32 // arch.reg_alloc_unit) * arch.reg_alloc_unit
    # Each sub-partition holds whole warps: floor(its registers / regs per warp) of them.
    partition_regs = arch.registers // arch.sub_partitions
    warps_by_regs = (partition_regs // regs_per_warp) * arch.sub_partitions if regs else arch.max_warps
    limits = {
        "blocks": arch.max_blocks,
        "warps": arch.max_warps // warps,
        "registers": warps_by_regs // warps,
    }
    smem_block = -(-(smem + arch.smem_reserved_per_block) // arch.smem_alloc_unit) * arch.smem_alloc_unit
    limits["shared memory"] = arch.smem_per_sm // smem_block
    limiter = min(limits, key=limits.get)
    return limits[limiter], limiter


def signature(algorithm: str, head_dim: int, dtype: str):
    """The argument types ``attention`` launches the CUDA-core kernel with for CuPy inputs."""
    return kernel_spec(algorithm, head_dim, dtype, 1, 1).signature()


def configurations(algorithms, head_dims, dtypes, block_ms, block_ns, causal=(False,), precisions=(None,)):
    """Every runnable combination (tiles a kernel cannot run are left out). ``precisions``:
    the ``attention`` argument (``None``: tensor cores for 16-bit dtypes, CUDA cores for float32)."""
    from numba_flash.kernels.tc_ops import BLOCK_M_CHOICES, BLOCK_N_CHOICES
    from numba_flash.problem import regime

    for alg, d, dt, bm, bn, c, prec in product(algorithms, head_dims, dtypes, block_ms, block_ns, causal, precisions):
        try:
            mode = regime(prec, dt)
        except ValueError:
            continue  # e.g. tf32 asked of float16
        cfg = dict(algorithm=alg, precision=mode, head_dim=d, dtype=dt, block_m=bm, block_n=bn, causal=c)
        if mode == "ieee":
            if dt in ("float16", "float32") and tiles_fit(d, bm, bn, switches.ffma_maxreg()):  # (above 48 KiB: dynamic shared memory)
                yield cfg
        elif bm in BLOCK_M_CHOICES and bn in BLOCK_N_CHOICES and _spec(cfg).smem_bytes <= SMEM_OPTIN_LIMIT:
            yield cfg


# Wall time of the ptxas path (numba's PTX, then ptxas) on a 2-core x86 machine (2026-12-01): the
# default 44 configurations took 3 minutes (issue 26); the first configuration pays ~3 s more
# (numba's compiler warming up).
PTXAS_SECONDS_PER_CONFIG = 4.0
PTXAS_FIRST_SECONDS = 3.0


def ptxas_seconds(configs: int) -> float:
    """About how long the ptxas path takes for ``configs`` configurations."""
    return PTXAS_FIRST_SECONDS + configs * PTXAS_SECONDS_PER_CONFIG if configs else 0.0


def config_label(cfg: dict) -> str:
    """A configuration in words: ``fa2 D=64 float32, CUDA cores, 64 x 32`` (``, causal`` when it is)."""
    engine = "CUDA cores" if cfg.get("precision") in (None, "ieee") else f"tensor cores ({cfg['precision']})"
    return (f"{cfg['algorithm']} D={cfg['head_dim']} {cfg['dtype']}, {engine}, {cfg['block_m']} x {cfg['block_n']}"
            + (", causal" if cfg["causal"] else ""))


def profile(configs, cc=(9, 0), source=None, progress=None) -> list[dict]:
    """Rows of resource use and occupancy for ``configs``.

    ``source``: ``"driver"`` (needs a GPU), ``"ptxas"`` (needs none), or ``None``:
    the driver when a GPU is present, else ptxas. ``progress``: called with a line per
    configuration done (:func:`config_label`, its registers and occupancy, its seconds).
    """
    import time

    from numba_flash._world import gpu_present

    source = source or ("driver" if gpu_present() else "ptxas")
    measure = _driver_row if source == "driver" else _ptxas_row
    rows = []
    configs = list(configs)
    for n, cfg in enumerate(configs, 1):
        started = time.perf_counter()
        row = measure(cfg, cc)
        rows.append(row)
        if progress:
            progress(f"[{n}/{len(configs)}] {config_label(cfg)}: {row['regs']} registers, {row['smem_bytes']} B shared, "
                     f"occupancy {row['occupancy']:.1%} ({time.perf_counter() - started:.1f} s)")
    return rows


def _spec(cfg):
    return kernel_spec(
        cfg["algorithm"], cfg["head_dim"], cfg["dtype"], cfg["block_m"], cfg["block_n"], cfg["causal"],
        cfg.get("precision") or "ieee",
    )


def _kernel(cfg):
    return _spec(cfg).kernel


def _threads(cfg) -> int:
    return _spec(cfg).threads


def _row(cfg, regs, smem, local, blocks, limiter, max_warps, source) -> dict:
    threads = _threads(cfg)
    warps = blocks * -(-threads // 32)
    return dict(
        cfg, threads=threads, regs=regs, smem_bytes=smem, local_bytes=local, blocks_per_sm=blocks,
        warps_per_sm=warps, occupancy=warps / max_warps, limiter=limiter, source=source,
    )


def _driver_row(cfg, cc) -> dict:
    from numba_flash._cuda import cuda

    from numba_flash.research.profiling.resources import compiled_resources

    spec = _spec(cfg)
    compiled = spec.kernel.compile(spec.signature())
    res = compiled_resources(compiled, spec.threads, spec.dynamic_smem)
    arch = ARCH.get(cuda.get_current_device().compute_capability, ArchLimits())
    _, limiter = occupancy_from_resources(res.regs, res.smem_bytes, res.threads, arch)
    return _row(cfg, res.regs, res.smem_bytes, res.local_bytes, res.blocks_per_sm, limiter, arch.max_warps, "driver")


def _ptxas_row(cfg, cc) -> dict:
    spec = _spec(cfg)
    ptx = compile_ptx(cfg, cc)
    regs, smem, local = ptxas_resources(ptx, cc, spec.register_cap)
    smem += spec.dynamic_smem  # ptxas sees only the static part
    arch = ARCH[cc]
    blocks, limiter = occupancy_from_resources(regs, smem, spec.threads, arch)
    return _row(cfg, regs, smem, local, blocks, limiter, arch.max_warps, f"ptxas sm_{cc[0]}{cc[1]}")


@contextlib.contextmanager
def no_device_compilation(cc):
    """Let numba compile device functions with no GPU present.

    numba-cuda asks the current device for its compute capability when it compiles a
    device function (``dispatcher.get_current_device``); with no driver that raises. For
    the duration of an offline compile it is answered with ``cc``.
    """
    import numba.cuda.dispatcher as dispatcher

    class _Device:
        compute_capability = cc

    original = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: _Device()
    try:
        yield
    finally:
        dispatcher.get_current_device = original


def compile_ptx(cfg, cc=(9, 0)) -> str:
    """PTX of one kernel configuration for compute capability ``cc`` (no GPU needed)."""
    from numba_flash._cuda import cuda

    from numba_flash._world import simulated

    if simulated():
        raise RuntimeError(
            "PTX compilation needs numba's CUDA target, not the simulator: run with "
            "NUMBA_ENABLE_CUDASIM=0 (`numba-flash occupancy` does this itself)"
        )
    spec = _spec(cfg)
    kernel = spec.kernel
    with no_device_compilation(cc):
        ptx, _ = cuda.compile_ptx(kernel.py_func, spec.signature(), cc=cc, fastmath=kernel.targetoptions.get("fastmath"))
    return ptx


OCCUPANCY_EXTRA = "pip install 'numba-flash[occupancy]'"
# What compiling a kernel without a GPU needs, and which package provides it.
TOOLCHAIN = {
    "nvvm": "libNVVM (numba-cuda's compiler: Python -> PTX), from the CUDA 13 wheels of numba-cuda[cu13]",
    "nvrtc": "NVRTC (numba-cuda compiles its C++ helpers with it), from nvidia-cuda-nvrtc in numba-cuda[cu13]",
    "ptxas": "ptxas of CUDA >= 13.5 (PTX -> SASS and the resource report), from the nvidia-cuda-nvcc wheel",
}


def _wheel_ptxas() -> str | None:
    """The ptxas of the ``nvidia-cuda-nvcc`` wheel (``nvidia/cu13/bin``; ``nvidia/cuda_nvcc/bin``
    for CUDA 12), wherever ``nvidia`` is installed."""
    bases = list(sys.path)
    try:
        import nvidia

        bases = [os.path.dirname(p) for p in nvidia.__path__] + bases
    except ImportError:
        pass
    for base in bases:
        for sub in ("nvidia/cu13/bin/ptxas", "nvidia/cuda_nvcc/bin/ptxas"):
            path = os.path.join(base, sub)
            if os.path.isfile(path) and os.access(path, os.X_OK):
                return path
    return None


def find_ptxas() -> str:
    """A ptxas new enough for numba-cuda's PTX: the nvidia-cuda-nvcc wheel's (which the
    ``occupancy`` extra installs, matching numba-cuda's libNVVM), else the first on PATH
    (often an older CUDA's, which then refuses the PTX: its message says so)."""
    path = _wheel_ptxas() or shutil.which("ptxas")
    if path:
        return path
    raise RuntimeError(f"ptxas not found: {TOOLCHAIN['ptxas']}: {OCCUPANCY_EXTRA}")


def missing_toolchain() -> list[str]:
    """What offline compilation lacks here, each with the package that provides it ([] when
    nothing is known to be missing)."""
    missing = []
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except ImportError:  # older cuda-bindings: cannot tell, compilation will say
        load_nvidia_dynamic_lib = None
    for lib in ("nvvm", "nvrtc"):
        if load_nvidia_dynamic_lib is None:
            break
        try:
            load_nvidia_dynamic_lib(lib)
        except Exception:  # DynamicLibNotFoundError and kin
            missing.append(f"{TOOLCHAIN[lib]}: not found")
    if _wheel_ptxas() is None:
        found = shutil.which("ptxas")
        where = f"only {found} on PATH, which may be too old for the PTX" if found else "not found"
        missing.append(f"{TOOLCHAIN['ptxas']}: {where}")
    return missing


_RESOURCE_RE = {
    "regs": re.compile(r"Used (\d+) registers"),
    "smem": re.compile(r"(\d+) bytes smem"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
}


def ptxas_resources(ptx: str, cc=(9, 0), max_registers=None) -> tuple[int, int, int]:
    """(registers per thread, static shared bytes per block, local bytes per thread)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [find_ptxas(), "-v", f"-arch=sm_{cc[0]}{cc[1]}", src, "-o", os.path.join(tmp, "k.cubin")]
        if max_registers:
            cmd.insert(2, f"-maxrregcount={max_registers}")
        done = subprocess.run(cmd, capture_output=True, text=True)
        out = done.stderr
        if done.returncode != 0:
            message = (done.stderr.strip() or done.stdout.strip() or "(no message)").splitlines()
            raise RuntimeError(f"{cmd[0]} failed with exit status {done.returncode}: " + " / ".join(message[-5:]))
    found = {k: r.search(out) for k, r in _RESOURCE_RE.items()}
    if found["regs"] is None:
        raise RuntimeError(f"could not read ptxas output:\n{out}")
    value = {k: int(m.group(1)) if m else 0 for k, m in found.items()}
    return value["regs"], value["smem"], value["stack"]
