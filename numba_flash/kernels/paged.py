"""A paged KV cache as the kernels read it (API.md section 2e; FlashAttention's and vLLM's layout).

The cache is ``num_blocks`` pages of ``page_size`` keys, ``(num_blocks, page_size, Hkv, D)``,
and a block table ``(B, max_blocks)`` int32: sequence ``b``'s key ``j`` lives in page
``block_table[b, j // page_size]``, row ``j % page_size``. A page of 16 keys is smaller than a
K/V tile (64 keys in decoding), so a tile gathers its rows from several pages.

The kernels take a paged cache where they take ``k`` (and ``v``): as the pair ``(pages,
block_table)``, ``pages`` the view ``(num_blocks, Hkv, page_size, D)`` of the cache (its axes 1
and 2 swapped: no copy), so that row ``s`` of head ``h`` of page ``p`` is ``pages[p, h, s]``, as
key ``j`` of head ``h`` of sequence ``b`` is ``k[b, h, j]`` in a contiguous cache. The copy loops
then only turn ``(b, j)`` into ``(page, s)`` (:func:`kv_source`'s ``locate``) and copy as they do
from a contiguous cache; everything else in a kernel (masks, splits, the walk) sees key indices,
not pages. ``page_size`` is a compile-time constant: ``j // page_size`` and ``j % page_size``
are a multiply and a shift, not a division.

The host checks every page a sequence uses before the launch (``numba_flash.checks.paged_cache``);
the kernels trust the table.
"""

from __future__ import annotations

import functools
from types import ModuleType

from numba_flash.kernels.jit import device_jit


@functools.lru_cache(maxsize=None)
def kv_source(page_size: int) -> ModuleType:
    """How a kernel reads its ``k`` / ``v`` argument: a contiguous ``(B, Hkv, N, D)`` array
    (``page_size = 0``) or a paged cache's ``(pages, block_table)`` (module doc). Device functions:

    ``heads(k)``: the KV heads; ``capacity(k)``: the keys a sequence can hold (N, or
    ``max_blocks * page_size``); ``locate(k, b, j)``: ``(index, row)``, where ``k``'s array (``k``
    itself, or ``pages``) holds sequence ``b``'s key ``j``: ``(b, j)`` contiguous, ``(page, row
    in the page)`` paged."""
    P = int(page_size)
    if P < 0:
        raise ValueError(f"page_size must be 0 (a contiguous cache) or positive; got {page_size}")
    source = ModuleType(f"numba_flash.kernels.paged_p{P}")
    source.PAGED = P > 0
    source.PAGE_SIZE = P

    if P:

        @device_jit
        def heads(k):
            return k[0].shape[1]

        @device_jit
        def capacity(k):
            return k[1].shape[1] * P

        @device_jit
        def locate(k, b, j):
            """Page and row of sequence ``b``'s key ``j`` (``j >= 0``; its page in the table)."""
            page_index = j // P
            return k[1][b, page_index], j - page_index * P

    else:

        @device_jit
        def heads(k):
            return k.shape[1]

        @device_jit
        def capacity(k):
            return k.shape[2]

        @device_jit
        def locate(k, b, j):
            return b, j

    source.heads, source.capacity, source.locate = heads, capacity, locate
    return source


CONTIGUOUS = kv_source(0)
