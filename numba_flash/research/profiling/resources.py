"""Resource use of a compiled kernel on the GPU at hand, and its theoretical occupancy.

Asks numba's dispatcher (registers, shared and local memory per thread/block, as
ptxas reported them) and the CUDA driver's occupancy API (resident blocks per SM).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class KernelResources:
    regs: int
    smem_bytes: int
    local_bytes: int
    threads: int
    blocks_per_sm: int
    warps_per_sm: int
    occupancy: float  # resident warps / the SM's maximum warps

    def as_dict(self) -> dict:
        return asdict(self)


def compiled_resources(kernel, threads: int, dynamic_smem: int = 0) -> KernelResources:
    """Resources on this GPU of a compiled kernel (what ``dispatcher.compile(sig)``
    returns), or of a dispatcher's most recently compiled signature, or, when its dispatcher
    compiled nothing because the compilation cache had it, of the function this process loaded
    and launched (``launch.loaded_function``); launched with ``dynamic_smem`` bytes of dynamic
    shared memory (counted in ``smem_bytes``)."""
    from numba_flash._cuda import cuda
    from numba_flash.launch import loaded_function

    if hasattr(kernel, "regs_per_thread"):
        cufunc = kernel._codelibrary.get_cufunc()
    elif kernel.overloads:
        cufunc = list(kernel.overloads.values())[-1]._codelibrary.get_cufunc()
    else:
        cufunc = loaded_function(kernel)
        if cufunc is None:
            raise ValueError("the kernel was neither compiled nor launched in this process: launch it first")
    regs, smem, local = cufunc.attrs.regs, cufunc.attrs.shared + dynamic_smem, cufunc.attrs.local
    ctx = cuda.current_context()
    if dynamic_smem:
        from numba_flash.launch import opt_in_shared_memory

        opt_in_shared_memory(cufunc, dynamic_smem)  # else the occupancy API counts 0 blocks above 48 KiB
    blocks = ctx.get_active_blocks_per_multiprocessor(cufunc, threads, dynamic_smem)
    max_warps = ctx.device.MAX_THREADS_PER_MULTIPROCESSOR // 32
    warps = blocks * -(-threads // 32)
    return KernelResources(regs, smem, local, threads, blocks, warps, warps / max_warps)
