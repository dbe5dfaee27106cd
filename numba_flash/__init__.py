"""numba_flash: FlashAttention-1 and FlashAttention-2 in numba.cuda, side by side.

``numba_flash.attention`` is the entry point (see ``numba_flash.api``), ``numba_flash.decode``
its form for a few queries against a KV cache (``numba_flash.decoding``),
``numba_flash.attention_varlen`` its form for a packed batch of sequences (``numba_flash.varlen``),
``numba_flash.attention_backward`` its gradients (``numba_flash.backward``) and
``numba_flash.torch.attention`` the PyTorch autograd function over both;
``numba_flash.online`` states the online-softmax algebra in NumPy and
``numba_flash.reference`` is the float64 oracle.

Importing the package does not import numba.cuda: that happens on first use of
``attention`` (through ``numba_flash._cuda``), after the package has chosen between a
real GPU and Numba's CUDA simulator (``numba_flash._world``).
"""

from importlib import metadata as _metadata

from numba_flash import online, reference

try:
    __version__ = _metadata.version("numba-flash")  # the installed distribution's version
except _metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "0+unknown"
__all__ = ["attention", "attention_backward", "attention_varlen", "attention_backward_varlen", "decode", "page_table", "PageTable", "block_mask", "BlockMask", "online", "reference", "__version__"]


def __getattr__(name):
    """The entry points, imported on first use and then kept as attributes of the package (so
    that ``numba_flash.attention(...)`` in a loop does not import each time)."""
    if name == "attention":
        from numba_flash.api import attention as value
    elif name == "attention_backward":
        from numba_flash.backward import attention_backward as value
    elif name == "attention_varlen":
        from numba_flash.varlen import attention_varlen as value
    elif name == "attention_backward_varlen":
        from numba_flash.varlen import attention_backward_varlen as value
    elif name == "decode":
        from numba_flash.decoding import decode as value
    elif name == "page_table":
        from numba_flash.paging import page_table as value
    elif name == "PageTable":
        from numba_flash.paging import PageTable as value
    elif name == "block_mask":
        from numba_flash.tile_visibility import block_mask as value
    elif name == "BlockMask":
        from numba_flash.tile_visibility import BlockMask as value
    else:
        raise AttributeError(f"module 'numba_flash' has no attribute {name!r}")
    globals()[name] = value
    return value
