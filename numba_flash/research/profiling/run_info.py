"""What a benchmark records about the machine it ran on: the GPU and the software versions."""

from __future__ import annotations

import importlib.metadata


def package_version(dist: str) -> str:
    """The installed version of a distribution, or ``"not installed"``."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def gpu_name() -> str:
    """The name of GPU 0 (CuPy)."""
    import cupy as cp

    name = cp.cuda.runtime.getDeviceProperties(0)["name"]
    return name.decode() if isinstance(name, bytes) else name


def versions(gpu: bool = True) -> str:
    """numba_flash, numba and numba-cuda; with ``gpu`` also CuPy, torch, the CUDA runtime and driver."""
    import numba

    import numba_flash

    line = f"numba_flash {numba_flash.__version__}, numba {numba.__version__}, numba-cuda {package_version('numba-cuda')}"
    if gpu:
        import cupy as cp

        line += (f", cupy {cp.__version__}, torch {package_version('torch')}, CUDA runtime "
                 f"{cp.cuda.runtime.runtimeGetVersion()}, driver {cp.cuda.runtime.driverGetVersion()}")
    return line
