"""What it takes to launch each kernel: one place, read by the API, occupancy, compare, benchmarks.

A :class:`KernelSpec` names a compiled-kernel dispatcher and its launch shape: threads per block,
dynamic shared memory, the grid for a problem, and the compile signature for CuPy inputs.
Two regimes (``tensor_cores.regime``):

- ``"ieee"``: the CUDA-core kernels (``kernels.fa1``, ``kernels.fa2``): static shared memory up
  to 48 KiB, dynamic above (``tiles.uses_dynamic_smem``), inputs in their own dtype (float16 or
  float32), a register cap at D <= 64, the micro-tile height of ``tile_table.forward_rows_per_thread``;
- a tensor-core kind (``"f16"``, ``"bf16"``, ``"tf32"``, ``"tf32x3"``; ``kernels.tc_fa1``,
  ``kernels.tc_fa2``): dynamic shared memory (opted in above 48 KiB), 16-bit inputs as uint16
  bit patterns, the head dim rounded up to 16 bytes.

The experiment switches (``numba_flash.switches``: register caps, tf32x3's pre-split operands,
the micro-tile height) are read here, when a configuration's spec is first made, and reach the
kernel factories as arguments.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from numba_flash import switches
from numba_flash.arch import SM_REGISTERS, SMEM_OPTIN_LIMIT
from numba_flash.kernels.mask import CAUSAL, window_of
from numba_flash.kernels.tiles import ROWS_PER_THREAD, register_cap
from numba_flash.tile_table import forward_rows_per_thread


@dataclass(frozen=True)
class KernelSpec:
    algorithm: str  # "fa1" or "fa2"
    regime: str  # "ieee" or a tensor-core kind
    head_dim: int  # the head dim the kernel is compiled for
    dtype: str  # the dtype the kernel reads (bfloat16 inputs of the CUDA-core kernels: float32)
    block_m: int
    block_n: int
    window: tuple  # the mask, (left, right) (``kernels.mask``): a compile-time constant of the kernel
    threads: int
    static_smem: int  # bytes of static shared memory (the CUDA-core tiles up to 48 KiB)
    dynamic_smem: int  # bytes of dynamic shared memory per block (the tensor-core tiles; CUDA-core above 48 KiB)
    register_cap: int | None  # registers per thread the kernel is compiled under
    ragged: bool = False  # FA-2: reads a valid key count per batch (``decode``'s cache_seqlens)
    split_out: bool = False  # FA-2: writes float32 partials for the combine (num_splits > 1)
    permuted: bool = False  # CUDA cores: walks the K/V tiles in a given order (``kv_tile_order``)
    variant: object = None  # a point of the ablation space (``kernels.forward.Variant``), not a named one
    kv_stages: int = 1  # tensor-core FA-2: K/V tiles in shared memory at once (``tc_fa2_kernel``; decode's knob)
    key_warps: int = 1  # tensor-core FA-2 with a ring: warps per 16 rows, splitting each tile's keys (decode's knob;
    # split_k's two key-warp groups are the variant's, not this field's)
    rows_per_thread: int = ROWS_PER_THREAD  # CUDA cores: the forward's micro-tile height (``tile_table.forward_rows_per_thread``)
    maxreg: int | None = None  # CUDA cores: NUMBA_FLASH_FFMA_MAXREG when set (``tiles.register_cap``'s override)
    presplit: str | None = None  # tf32x3: NUMBA_FLASH_TF32X3_PRESPLIT's layout when set (``tc_ops.tc_layout``'s presplit)
    softcap: bool = False  # the scores are soft-capped (``kernels.score_mods``; the cap is an argument)
    alibi: bool = False  # the scores gain ALiBi's bias (``kernels.score_mods``; the slopes are an argument)
    user_mods: object = None  # a user's mask_mod / score_mod (``kernels.score_mods.UserMods``; one more argument)
    varlen: bool = False  # a packed batch (``numba_flash.varlen``): seqlens holds cu_seqlens_q and cu_seqlens_k
    page_size: int = 0  # k, v are a paged cache's (pages, block_table) (``kernels.paged``; decode's block_table)

    @property
    def causal(self) -> bool:
        """Exactly the causal mask."""
        return self.window == CAUSAL

    @property
    def kv_outer(self) -> bool:
        """The loop order: K/V tiles outside (FA-1's), the state O, l, m in global memory."""
        if self.variant is not None:
            return self.variant.loop_order == "kv_outer"
        return self.algorithm == "fa1"

    @property
    def per_q_tile(self) -> bool:
        """The grid: one block per Q tile (FA-2's), or per (batch, head)."""
        if self.variant is not None:
            return self.variant.grid == "heads_x_qtiles"
        return self.algorithm == "fa2"

    @property
    def tensor_cores(self) -> bool:
        return self.regime != "ieee"

    @property
    def smem_bytes(self) -> int:
        return self.static_smem + self.dynamic_smem

    def grid(self, batch: int, heads: int, n_q: int, n_splits: int = 1) -> tuple:
        """FA-1: one block per (batch, head); FA-2: one per Q tile of each (batch, head) and
        split of the K/V tiles (``kernels.block_info``); a variant: by its grid and loop order
        (only Q-outer walks split)."""
        if self.variant is None:
            if self.algorithm == "fa1":
                return (batch * heads,)
            return (-(-n_q // self.block_m) * batch * heads * n_splits,)
        tiles = -(-n_q // self.block_m) if self.per_q_tile else 1
        return (batch * heads * tiles * (1 if self.kv_outer else n_splits),)

    @property
    def kernel(self):
        """The dispatcher (compiled on first use for the arguments it is launched with)."""
        if self.tensor_cores:  # the skeleton (kernels.forward) on the mma engine
            from numba_flash.kernels.engines import TensorCores
            from numba_flash.kernels.forward import FA1, FA2, forward_kernel

            point = self.variant if self.variant is not None else (FA1 if self.algorithm == "fa1" else FA2)
            tiles = TensorCores(self.regime, self.head_dim, self.block_m, self.block_n, None, self.presplit,
                                self.kv_stages, self.key_warps)
            return forward_kernel(point, tiles, self.window, False, self.ragged, cast_out=self.kv_outer,
                                  f32_out=self.split_out, max_registers=self.register_cap, softcap=self.softcap,
                                  alibi=self.alibi, user_mods=self.user_mods, varlen=self.varlen,
                                  page_size=self.page_size)
        from numba_flash.kernels import KERNEL_FACTORIES
        from numba_flash.kernels.fa1 import casts_output

        if self.variant is not None or self.varlen or self.page_size:  # (a named point's factory: no such switches)
            from numba_flash.kernels.engines import CudaCores
            from numba_flash.kernels.forward import FA1, FA2, forward_kernel

            point = self.variant if self.variant is not None else (FA1 if self.algorithm == "fa1" else FA2)
            tiles = CudaCores(self.head_dim, self.block_m, self.block_n, self.rows_per_thread)
            return forward_kernel(point, tiles, self.window, self.permuted, self.ragged,
                                  self.kv_outer and casts_output(self.dtype), max_registers=self.register_cap,
                                  softcap=self.softcap, alibi=self.alibi, user_mods=self.user_mods, varlen=self.varlen,
                                  page_size=self.page_size)
        options = {} if self.rows_per_thread == ROWS_PER_THREAD else {"rows_per_thread": self.rows_per_thread}
        if self.softcap:
            options["softcap"] = True
        if self.alibi:
            options["alibi"] = True
        if self.user_mods is not None:
            options["user_mods"] = self.user_mods
        if self.maxreg is not None:
            options["maxreg"] = self.maxreg
        if self.algorithm == "fa2":
            return KERNEL_FACTORIES["fa2"](self.head_dim, self.block_m, self.block_n, self.window, self.permuted, self.ragged,
                                           **options)
        return KERNEL_FACTORIES["fa1"](
            self.head_dim, self.block_m, self.block_n, self.window, self.permuted, casts_output(self.dtype), **options
        )

    def signature(self):
        """The argument types of a launch on C-contiguous CuPy arrays (as ``attention`` makes)."""
        from numba import types

        f4, f3 = types.Array(types.float32, 4, "C"), types.Array(types.float32, 3, "C")
        i1, i4 = types.Array(types.int32, 1, "C"), types.int32
        from numba_flash.kernels.fa1 import casts_output

        if self.tensor_cores:  # 16-bit inputs and outputs as bit patterns
            a4 = types.Array(types.float32 if self.regime.startswith("tf32") else types.uint16, 4, "C")
            out = f4 if self.split_out else a4
        else:
            a4 = types.Array({"float32": types.float32, "float16": types.float16}[self.dtype], 4, "C")
            if self.kv_outer:
                out = a4 if casts_output(self.dtype) else f4
            else:
                out = f4 if self.split_out else a4
        # kernels.forward: q, k, v, o, lse, o_hbm, l_hbm, m_hbm, q_scale, kv_order, seqlens, n_splits, rows_per_query,
        # softcap_log2, alibi
        f2 = types.Array(types.float32, 2, "C")
        kv = a4
        if self.page_size:  # (pages, block_table): pages a strided view of the cache (kernels.paged)
            kv = types.Tuple((types.Array(a4.dtype, 4, "A"), types.Array(types.int32, 2, "C")))
        return (a4, kv, kv, out, f3, f4, f3, f3, types.float32, i1, i1, i4, i4, types.float32, f2)


@functools.lru_cache(maxsize=1024)
def kernel_spec(algorithm, head_dim, dtype, block_m, block_n, window=False, regime="ieee", ragged=False,
                split_out=False, permuted=False, variant=None, kv_stages=1, key_warps=1,
                rows_per_thread=None, softcap=False, alibi=False, user_mods=None, varlen=False,
                page_size=0) -> KernelSpec:
    """The launch specification of one configuration (tiles as the caller gives them; ``api``
    checks them). ``window``: the mask's ``(left, right)`` (``kernels.mask``; a bool: the
    public ``causal``). ``head_dim`` is the problem's; a tensor-core kernel is compiled for it
    rounded up to its copy width. ``ragged`` and ``split_out`` (FA-2 only): a valid key count
    per batch, and float32 partial outputs for the split-KV combine. ``permuted`` and
    ``variant``: a given K/V tile order (CUDA cores), and a point of the ablation space
    (``algorithm`` then names its loop order's family: fa1 for kv_outer, fa2 for q_outer).
    ``kv_stages`` and ``key_warps`` (tensor-core FA-2 only, else 1): the K/V ring of
    ``tc_fa2_kernel`` and its warps per 16 rows. ``rows_per_thread`` (CUDA cores): the
    micro-tile height; ``None``: ``tile_table.forward_rows_per_thread``'s for the tiles (read once
    per configuration: this is memoised). ``softcap``: the kernel soft-caps the scores;
    ``alibi``: it adds ALiBi's bias; ``user_mods``: a ``score_mods.UserMods`` compiled in;
    ``varlen``: the kernel walks the sequences of a packed batch (``numba_flash.varlen``);
    ``page_size``: it reads K/V from a paged cache of pages that size (``kernels.paged``)."""
    window = window_of(window)
    if variant is not None:
        from numba_flash.kernels.forward import FA1, FA2

        algorithm = "fa1" if variant.loop_order == "kv_outer" else "fa2"
        if variant in (FA1, FA2):
            variant = None  # a named point: its own factory
    # (a packed batch's seqlens are its cu_seqlens: not cache lengths)
    ragged, split_out = bool(ragged) and algorithm == "fa2" and not varlen, bool(split_out) and algorithm == "fa2"
    if regime != "ieee":
        from numba_flash.kernels.forward import SPLIT_K_GROUPS, check_tensor_core_variant, tc_split_k_smem_bytes
        from numba_flash.kernels.tc_ops import kernel_head_dim, tc_layout, tc_register_cap

        check_tensor_core_variant(variant, block_n)
        d = kernel_head_dim(regime, head_dim)
        stages = int(kv_stages) if algorithm == "fa2" else 1
        warps = int(key_warps) if algorithm == "fa2" else 1
        mode = switches.tf32x3_presplit() if regime == "tf32x3" else None
        split = {} if mode is None else {"presplit_mode": mode}
        cap = tc_register_cap(regime, d, block_m, block_n, switches.tc_maxreg())
        if variant is not None and variant.warp_partition == "split_k":  # groups of key warps, no pre-split
            layout = tc_layout(regime, d, block_m, block_n, 1, presplit="", key_warps=SPLIT_K_GROUPS)
            smem = tc_split_k_smem_bytes(variant.loop_order, layout)
            if smem > SMEM_OPTIN_LIMIT:
                raise ValueError(f"split_k with block_m={block_m}, block_n={block_n} at head_dim={d} needs {smem} bytes "
                                 f"of shared memory on tensor cores, more than the {SMEM_OPTIN_LIMIT} a block can have")
            if layout.threads * 255 > SM_REGISTERS:  # two groups: up to 16 warps a block, which must fit an SM
                cap = min(cap or 255, SM_REGISTERS // layout.threads // 8 * 8)
            mode = None
        else:
            layout = tc_layout(regime, d, block_m, block_n, stages, key_warps=warps, **split)
            smem = layout.smem_bytes
        return KernelSpec(algorithm, regime, d, dtype, block_m, block_n, window, layout.threads, 0, smem,
                          cap, ragged and (variant is None or variant.loop_order == "q_outer"), split_out,
                          variant=variant, kv_stages=stages, key_warps=warps,
                          presplit=None if mode is None else layout.presplit, softcap=bool(softcap),
                          alibi=bool(alibi), user_mods=user_mods, varlen=bool(varlen), page_size=int(page_size))
    if dtype == "bfloat16":  # the CUDA-core kernels read float16 or float32: api widens bfloat16
        dtype = "float32"
    from numba_flash.kernels.forward import (FA1, FA2, variant_dynamic_smem_bytes, variant_smem_bytes,
                                             variant_threads)

    rows = forward_rows_per_thread(head_dim, block_m, block_n) if rows_per_thread is None else int(rows_per_thread)
    point = variant if variant is not None else (FA1 if algorithm == "fa1" else FA2)
    if point.warp_partition == "split_k":
        rows = ROWS_PER_THREAD
    threads = variant_threads(point, head_dim, block_m, block_n, rows)
    smem = variant_smem_bytes(point, head_dim, block_m, block_n)
    dynamic = variant_dynamic_smem_bytes(point, head_dim, block_m, block_n)
    if variant is not None:
        ragged = ragged and variant.loop_order == "q_outer"
    maxreg = switches.ffma_maxreg()
    return KernelSpec(
        algorithm, "ieee", head_dim, dtype, block_m, block_n, window, threads, smem - dynamic, dynamic,
        register_cap(head_dim, rows, maxreg), ragged, split_out, bool(permuted), variant, rows_per_thread=rows,
        maxreg=maxreg, softcap=bool(softcap), alibi=bool(alibi), user_mods=user_mods, varlen=bool(varlen),
        page_size=int(page_size),
    )
