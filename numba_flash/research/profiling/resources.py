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
    returns), or of a dispatcher's most recently compiled signature, launched with
    ``dynamic_smem`` bytes of dynamic shared memory (counted in ``smem_bytes``)."""
    from numba_flash._cuda import cuda

    compiled = kernel if hasattr(kernel, "regs_per_thread") else list(kernel.overloads.values())[-1]
    regs = compiled.regs_per_thread
    smem = compiled.shared_mem_per_block + dynamic_smem
    local = compiled.local_mem_per_thread
    ctx = cuda.current_context()
    cufunc = compiled._codelibrary.get_cufunc()
    if dynamic_smem:
        from numba_flash.launch import opt_in_shared_memory

        opt_in_shared_memory(cufunc, dynamic_smem)  # else the occupancy API counts 0 blocks above 48 KiB
    blocks = ctx.get_active_blocks_per_multiprocessor(cufunc, threads, dynamic_smem)
    max_warps = ctx.device.MAX_THREADS_PER_MULTIPROCESSOR // 32
    warps = blocks * -(-threads // 32)
    return KernelResources(regs, smem, local, threads, blocks, warps, warps / max_warps)
