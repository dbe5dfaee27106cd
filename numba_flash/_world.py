"""Which world the kernels run in: a real CUDA GPU, or Numba's CUDA simulator.

Numba reads ``NUMBA_ENABLE_CUDASIM`` once, when ``numba.cuda`` is first imported, so
the decision has to be taken before that import. :func:`choose_world` asks the CUDA
driver directly (through ``ctypes``, without importing numba) whether a device exists,
and switches the simulator on when none does. A value the user already put in the
environment always wins.
"""

from __future__ import annotations

import ctypes
import os
import sys

_SIM_VAR = "NUMBA_ENABLE_CUDASIM"


def gpu_present() -> bool:
    """True when the CUDA driver loads, initialises, and reports at least one device."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        try:
            if lib.cuInit(0) != 0:
                return False
            count = ctypes.c_int(0)
            if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
                return False
            return count.value > 0
        except AttributeError:
            return False
    return False


def choose_world() -> None:
    """Set ``NUMBA_ENABLE_CUDASIM=1`` when there is no GPU, unless already decided.

    Must run before ``numba.cuda`` is imported; afterwards it changes nothing.
    """
    if _SIM_VAR in os.environ or "numba.cuda" in sys.modules:
        return
    if not gpu_present():
        os.environ[_SIM_VAR] = "1"


def simulated() -> bool:
    """True when ``numba.cuda`` runs (or will run) in the simulator."""
    from numba import config

    return bool(config.ENABLE_CUDASIM)
