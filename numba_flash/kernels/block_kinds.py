"""A user's ``mask_mod`` reduced to tile kinds on the device: the block mask the kernels walk.

FlexAttention's ``create_block_mask`` on the GPU: each (batch, head, Q tile, K/V tile) is
**hidden** (the mask hides every entry: the walks neither load nor compute it), **full** (it
shows every entry: no elementwise mask) or **partial**, exactly -- ``mask_mod`` is evaluated on
every (query, key) pair of the tile inside ``(Nq, Nk)``; a last tile's padding counts as
neither. One block per tile pair; its threads evaluate the pairs in turn and meet in two shared
flags (any visible, all visible). The kinds are ``numba_flash.tile_visibility``'s (0, 1, 2), and
the host makes the walks' lists from them (``numba_flash.block_sparse``).

Launch: ``grid = (B * H * n_q_tiles * n_kv_tiles,)``, ``block = (threads,)``; arguments:
``kinds`` int8 ``(B, H, n_q_tiles, n_kv_tiles)`` out (B, H: 1 when the mask depends on neither),
``n_q``, ``n_k`` (int32), ``mod_args`` (the tuple of the mod's arrays).
"""

from __future__ import annotations

from numba_flash._cuda import cuda, int32
from numba_flash.kernels import score_mods
from numba_flash.kernels.jit import kernel_factory, kernel_jit

HIDDEN, PARTIAL, FULL = 0, 1, 2  # (numba_flash.tile_visibility's kinds)


@kernel_factory
def block_kinds_kernel(user, block_m: int, block_n: int, threads: int):
    """The kernel reducing ``user``'s ``mask_mod`` (a ``score_mods.UserMods``) to the kinds of
    ``block_m`` x ``block_n`` tiles with ``threads`` threads per block (memoised)."""
    visible = score_mods.user_mask_call(user)
    BM, BN, THREADS = int(block_m), int(block_n), int(threads)
    PAIRS = BM * BN

    @kernel_jit()
    def block_kinds(kinds, n_q, n_k, mod_args):
        n_heads, n_qt, n_kt = kinds.shape[1], kinds.shape[2], kinds.shape[3]
        x = cuda.blockIdx.x
        kt = x % n_kt
        rest = x // n_kt
        qt = rest % n_qt
        bh = rest // n_qt
        b = bh // n_heads
        h = bh - b * n_heads
        flags = cuda.shared.array(2, int32)  # [some pair visible, every pair visible]
        t = cuda.threadIdx.x
        if t == 0:
            flags[0] = 0
            flags[1] = 1
        cuda.syncthreads()
        seen_any = False
        seen_all = True
        for p in range(t, PAIRS, THREADS):
            r = p // BN
            q_idx = qt * BM + r
            kv_idx = kt * BN + (p - r * BN)
            if q_idx < n_q and kv_idx < n_k:
                if visible(b, h, q_idx, kv_idx, mod_args):
                    seen_any = True
                else:
                    seen_all = False
        if seen_any:
            cuda.atomic.max(flags, 0, 1)
        if not seen_all:
            cuda.atomic.min(flags, 1, 0)
        cuda.syncthreads()
        if t == 0:
            kind = HIDDEN
            if flags[1] != 0:
                kind = FULL
            elif flags[0] != 0:
                kind = PARTIAL
            kinds[b, h, qt, kt] = kind

    return block_kinds
