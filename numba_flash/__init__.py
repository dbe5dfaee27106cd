"""numba_flash: FlashAttention-1 and FlashAttention-2 in numba.cuda, side by side.

``numba_flash.attention`` is the entry point (see ``numba_flash.api``);
``numba_flash.online`` states the online-softmax algebra in NumPy and
``numba_flash.reference`` is the float64 oracle.
"""

from numba_flash._world import choose_world as _choose_world

_choose_world()  # before numba.cuda is imported anywhere below

from numba_flash import online, reference  # noqa: E402
from numba_flash.api import attention  # noqa: E402

__version__ = "0.1.0"
__all__ = ["attention", "online", "reference", "__version__"]
