"""The launch configuration of a checked forward call: its problem and the choices made for it.

:class:`LaunchConfig` is what the host passes down the forward's launch path (``api``,
``tensor_cores``, ``decoding``, ``plans``): a :class:`~numba_flash.problem.Problem` (what is
asked, no tiles) and how it runs (tiles, splits, variant, the tensor-core pipeline). Made by
``api.configure``, which chooses the tiles (``tile_table``, ``tile_cache``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from numba_flash.kernels.jit import LOG2E
from numba_flash.problem import Problem


@dataclass(frozen=True)
class LaunchConfig:
    """A checked call of the forward kernels: its :class:`~numba_flash.problem.Problem` and what
    running it takes besides -- the tiles (``api.choose_tiles``), the split count, the ablation
    variant (``None``: the named points' kernels), the tensor-core pipeline (``kv_stages``,
    ``key_warps``: ``decode``'s). Made by ``api.configure``; read by ``api.run``,
    ``api.plan_run``, ``tensor_cores`` and ``decoding``; a plan's ``call`` (``plans``).
    The problem's fields read through it (``call.q_shape``, ``call.dtype``, ...)."""

    problem: Problem
    block_m: int
    block_n: int
    num_splits: int | None = None
    variant: object = None
    kv_stages: int = 1
    key_warps: int = 1
    varlen: tuple | None = None  # a packed batch (numba_flash.varlen): (sequences, max_seqlen_q)
    page_size: int = 0  # k, v are a paged cache (decode's block_table; kernels.paged): its page size

    kind = property(lambda self: self.problem.kind)
    q_shape = property(lambda self: self.problem.q_shape)
    n_k = property(lambda self: self.problem.n_k)
    dtype = property(lambda self: self.problem.dtype)
    causal = property(lambda self: self.problem.causal)
    window = property(lambda self: self.problem.window)
    softcap = property(lambda self: self.problem.softcap)
    softcap_log2 = property(lambda self: self.problem.softcap * LOG2E)  # the kernels' unit
    alibi = property(lambda self: self.problem.alibi)

    @property
    def user_mods(self):
        """A user's mask_mod / score_mod (``score_mods.UserMods``; None: none). A ring of K/V
        tiles or key warps (decode's) walk every tile: no block mask then."""
        user = self.problem.user_mods
        if user is not None and user.block_sparse and (self.kv_stages > 1 or self.key_warps > 1):
            return user.dense()
        return user
    scale = property(lambda self: self.problem.scale)
    algorithm = property(lambda self: self.problem.algorithm)
    regime = property(lambda self: self.problem.regime)

    @property
    def grid_dims(self) -> tuple:
        """(batch, heads, Nq) the grid is laid over: the problem's, or a packed batch's
        (sequences, heads, longest sequence): its arrays are ``(1, heads, total, ...)`` views."""
        if self.varlen is None:
            return self.q_shape[:3]
        return (self.varlen[0], self.q_shape[1], self.varlen[1])

    def with_dtype(self, dtype: str) -> LaunchConfig:
        """The same launch on inputs of another dtype (bfloat16 widened to float32)."""
        return replace(self, problem=replace(self.problem, dtype=dtype))
