"""numba_flash: FlashAttention-1 and FlashAttention-2 in numba.cuda, side by side.

``numba_flash.attention`` is the entry point (see ``numba_flash.api``);
``numba_flash.online`` states the online-softmax algebra in NumPy and
``numba_flash.reference`` is the float64 oracle.

Importing the package does not import numba.cuda: that happens on first use of
``attention`` (through ``numba_flash._cuda``), after the package has chosen between a
real GPU and Numba's CUDA simulator (``numba_flash._world``).
"""

from numba_flash import online, reference

__version__ = "0.1.0"
__all__ = ["attention", "online", "reference", "__version__"]


def __getattr__(name):
    if name == "attention":
        from numba_flash.api import attention

        return attention
    raise AttributeError(f"module 'numba_flash' has no attribute {name!r}")
