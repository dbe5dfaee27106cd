"""The problem of an attention call: what it computes, checked, with no tile choice in it.

:func:`describe` checks ``q``, ``k``, ``v`` and the call's options as ``attention`` documents
(API.md section 2: ``ValueError`` for shapes and values, ``TypeError`` for dtypes and array
kinds, each naming the argument) and returns a frozen :class:`Problem`: the shapes, the GQA
group, the dtype and array library, the scale, the mask (``masking.MaskSpec``), the
algorithm and the precision regime (:func:`regime`: the one place that picks CUDA cores or a
tensor-core kind for the forward). Every host entry point asks it: ``api`` (forward),
``decoding`` (on the GQA-packed queries), ``backward``, ``distributed.ring`` and ``compare``.

What a launch then needs besides -- tiles, splits, the kernel's pipeline -- is the launch
configuration's (``api.configure``), not the problem's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from numba_flash.alibi import check_slopes
from numba_flash.arrays import device_id_of, dtype_name, kind_of
from numba_flash.checks import softcap_value
from numba_flash.kernels.jit import LOG2E
from numba_flash.tile_table import MAX_HEAD_DIM
from numba_flash.block_sparse import check_block_mask
from numba_flash.user_mods import check_mods, user_mods_of
from numba_flash.masking import MaskSpec, window_spec

__all__ = ["ALGORITHMS", "DTYPES", "TENSOR_CORE_KIND", "Problem", "describe", "regime"]

ALGORITHMS = ("fa1", "fa2")  # the loop nests of kernels.KERNEL_FACTORIES
DTYPES = ("float16", "bfloat16", "float32")
FP8_DTYPE = "float8_e4m3fn"  # fa3 only (numba_flash.fp8)
FLOAT32_MAX = float(np.finfo(np.float32).max)
TENSOR_CORE_KIND = {"float16": "f16", "bfloat16": "bf16"}  # precision=None: the 16-bit dtypes' kinds


@dataclass(frozen=True)
class Problem:
    """A checked attention problem: ``q`` ``(batch, heads, n_q, head_dim)`` against ``k``, ``v``
    ``(batch, kv_heads, n_k, head_dim)``; query head ``h`` reads kv head ``h // group``."""

    kind: str  # the arrays' library: "numpy", "cupy", "torch"
    batch: int
    heads: int
    kv_heads: int
    n_q: int
    n_k: int
    head_dim: int
    dtype: str  # "float16", "bfloat16" or "float32"
    scale: float  # multiplies q . k (natural-log units)
    mask: MaskSpec
    algorithm: str  # "fa1" or "fa2"
    regime: str  # "ieee" (CUDA cores) or a tensor-core kind: "f16", "bf16", "tf32", "tf32x3"
    device_id: int | None = None  # the GPU the arrays live on (None: numba's current one, or the host)
    softcap: float = 0.0  # > 0: scores soft-capped, softcap * tanh(score / softcap) (API.md 2c); 0: off
    # ALiBi: the caller's float32 (H,) or (B, H) slopes, checked (numba_flash.alibi); None: off. An array,
    # so not part of the problem's identity (equality, hash): ``alibi`` is.
    alibi_slopes: object = field(default=None, compare=False, repr=False)
    alibi: bool = False
    # A user's mask_mod / score_mod (numba_flash.user_mods; compared by identity) and their arrays.
    mask_mod: object = None
    score_mod: object = None
    mod_args: tuple = field(default=(), compare=False, repr=False)
    n_mod_args: int = 0
    # The forward walks mask_mod's block mask (numba_flash.block_sparse: ``sparse_walk``), the caller's
    # (``mask_table``, a checked BlockMask), or derived from mask_mod (None). An object, so not part of
    # the identity: ``sparse_walk`` is.
    mask_table: object = field(default=None, compare=False, repr=False)
    sparse_walk: bool = False

    @property
    def user_mods(self):
        """The kernels' ``score_mods.UserMods`` of the call's mods (``None``: none)."""
        return user_mods_of(self.mask_mod, self.score_mod, self.mod_args, block_sparse=self.sparse_walk)

    def __post_init__(self):
        if self.alibi != (self.alibi_slopes is not None):
            raise ValueError("alibi must say whether alibi_slopes is given")

    @property
    def group(self) -> int:
        """Query heads per kv head (GQA; 1: multi-head attention)."""
        return self.heads // self.kv_heads

    @property
    def q_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads, self.n_q, self.head_dim)

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.kv_heads, self.n_k, self.head_dim)

    @property
    def causal(self) -> bool:
        """Exactly the public ``causal=True`` mask (no window beside it)."""
        return self.mask.is_causal

    @property
    def window(self) -> tuple[int, int]:
        """The mask as the kernels take it: ``(left, right)`` (``kernels.mask``)."""
        return self.mask.window

    @property
    def tensor_cores(self) -> bool:
        return self.regime != "ieee"


def regime(precision, dtype: str) -> str:
    """``"ieee"`` (CUDA cores) or the tensor-core kind for this precision and input dtype
    (API.md section 2a): ``None`` puts float16 and bfloat16 on tensor cores, float32 on CUDA
    cores; ``"ieee"``: CUDA cores; ``"tf32"``/``"tf32x3"``: float32 on tensor cores."""
    if precision is None:
        return TENSOR_CORE_KIND.get(dtype, "ieee")
    if isinstance(precision, str) and precision == "ieee":
        return "ieee"
    if isinstance(precision, str) and precision in ("tf32", "tf32x3"):
        if dtype != "float32":
            raise ValueError(
                f"precision={precision!r} is for float32 inputs; got {dtype} (float16 and bfloat16 "
                "use tensor cores with precision=None)"
            )
        return precision
    raise ValueError(f"precision must be one of None, 'ieee', 'tf32', 'tf32x3'; got {precision!r}")


def describe(q, k, v, *, causal=False, scale=None, algorithm="fa2", precision=None, names=("q", "k", "v"),
             window_size=(-1, -1), softcap=0.0, alibi_slopes=None, mask_mod=None, score_mod=None,
             mod_args=(), block_mask=None, block_sparse=False, fp8=False) -> Problem:
    """The checked :class:`Problem` of ``attention(q, k, v, causal=..., scale=..., algorithm=...,
    precision=..., window_size=..., softcap=..., alibi_slopes=..., mask_mod=..., ...)``; raises
    before anything runs, with a message naming the argument as the caller's signature spells it
    (``names``: ``decode``'s are ``q``, ``k_cache``, ``v_cache``). ``block_sparse``: the kernels
    may walk ``mask_mod``'s block mask (``block_mask``, checked, or derived at launch); the paths
    that cannot say ``False`` and refuse a ``block_mask``. ``fp8``: float8_e4m3fn inputs are taken too
    (``algorithm="fa3"``, ``numba_flash.fp8``)."""
    nq, nk, nv = names
    kinds = [kind_of(x, name) for x, name in zip((q, k, v), names)]
    if len(set(kinds)) != 1:
        raise TypeError(f"{nq}, {nk} and {nv} must be arrays of one library; got {kinds[0]}, {kinds[1]}, {kinds[2]}")
    kind = kinds[0]
    for name, x in zip(names, (q, k, v)):
        if len(x.shape) != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seq, head_dim); got shape {tuple(x.shape)}")
    B, H, Nq, D = (int(s) for s in q.shape)
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"{nk} and {nv} must have the same shape; got {nk} {tuple(k.shape)} and {nv} {tuple(v.shape)}")
    Bk, Hkv, Nk, Dk = (int(s) for s in k.shape)
    if Bk != B:
        raise ValueError(f"{nk} and {nv} must have {nq}'s batch size {B}; got {Bk}")
    if Dk != D:
        raise ValueError(f"{nk} and {nv} must have {nq}'s head_dim {D}; got {Dk}")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim (last axis of {nq}) must be from 1 to {MAX_HEAD_DIM}; got {D}")
    if Hkv == 0:
        raise ValueError(f"{nk} and {nv} must have at least one head; got shape {tuple(k.shape)}")
    if H % Hkv != 0:
        raise ValueError(f"{nq}'s heads ({H}) must be a multiple of {nk}'s and {nv}'s heads ({Hkv})")
    dtypes = [dtype_name(x, kind) for x in (q, k, v)]
    for name, dt in zip(names, dtypes):
        if dt not in DTYPES and not (fp8 and dt == FP8_DTYPE):
            allowed = "float16, bfloat16, float32 or float8_e4m3fn" if fp8 else "float16, bfloat16 or float32"
            hint = " (float8_e4m3fn inputs: algorithm='fa3', on Hopper)" if dt == FP8_DTYPE and not fp8 else ""
            raise TypeError(f"{name} must be {allowed}; got {dt}{hint}")
    if len(set(dtypes)) != 1:
        raise TypeError(f"{nq}, {nk} and {nv} must have one dtype; got {dtypes[0]}, {dtypes[1]}, {dtypes[2]}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {list(ALGORITHMS)}; got {algorithm!r}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool; got {type(causal).__name__}")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"scale must be a real number or None; got {type(scale).__name__}")
    elif not abs(float(scale)) * LOG2E < FLOAT32_MAX:  # scale * log2(e) is a float32 in the kernel
        raise ValueError(f"scale must be finite and below {FLOAT32_MAX / LOG2E:.3g} in magnitude; got {scale}")
    device_id = device_id_of(q, kind)
    if alibi_slopes is not None:
        check_slopes(alibi_slopes, kind, B, H, device_id)
    mod_args = check_mods(mask_mod, score_mod, mod_args, kind, device_id)
    mask = window_spec(bool(causal), window_size)
    if block_mask is not None:
        check_block_mask(block_mask, mask_mod, mask, B, H, Nq, Nk)
    return Problem(
        kind=kind, batch=B, heads=H, kv_heads=Hkv, n_q=Nq, n_k=Nk, head_dim=D, dtype=dtypes[0], scale=float(scale),
        mask=mask, algorithm=algorithm, regime=regime(precision, dtypes[0]),
        device_id=device_id, softcap=_kernel_softcap(softcap), alibi_slopes=alibi_slopes,
        alibi=alibi_slopes is not None, mask_mod=mask_mod, score_mod=score_mod, mod_args=mod_args,
        n_mod_args=len(mod_args), mask_table=block_mask, sparse_walk=bool(block_sparse) and mask_mod is not None,
    )


def _kernel_softcap(softcap) -> float:
    """``softcap`` checked (``checks.softcap_value``) and within what the kernels take: they get
    ``softcap * log2(e)`` as a float32."""
    value = softcap_value(softcap)
    if not value * LOG2E < FLOAT32_MAX:
        raise ValueError(f"softcap must be below {FLOAT32_MAX / LOG2E:.3g}; got {value}")
    return value

