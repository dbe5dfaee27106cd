"""A user's ``mask_mod`` and ``score_mod`` on the host: their checks, and what the kernels receive.

API.md section 2c: ``mask_mod(b, h, q_idx, kv_idx, *mod_args) -> bool`` (True: the key is visible)
and ``score_mod(score, b, h, q_idx, kv_idx, *mod_args) -> float`` (``score``: the scaled score,
after softcap and ALiBi), FlexAttention's signatures, plain Python functions or numba device
functions. The kernels compile them in (``kernels.score_mods``: one specialisation per function
object and number of ``mod_args``, memoised); ``mod_args`` are arrays of the inputs' library on
their device, read-only, passed to the kernel as one tuple. The float64 reference
(``numba_flash.reference``) calls the same functions on NumPy arrays, so one function serves both.
"""

from __future__ import annotations

import contextlib

from numba_flash.arrays import device_id_of, kind_of
from numba_flash.kernels.score_mods import MAX_MOD_ARGS, UserMods

__all__ = ["check_mods", "compiling", "none_given", "user_mods_of"]


def check_mods(mask_mod, score_mod, mod_args, kind: str, device_id=None) -> tuple:
    """``mod_args`` as a tuple, once ``mask_mod`` and ``score_mod`` are each ``None`` or callable
    (``TypeError``), and ``mod_args`` is a tuple or list of at most :data:`MAX_MOD_ARGS` arrays of the
    inputs' library (``TypeError``) on their device (``ValueError``), given only with a mod."""
    for name, fn in (("mask_mod", mask_mod), ("score_mod", score_mod)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be a function or None; got {type(fn).__name__}")
    if not isinstance(mod_args, (tuple, list)):
        raise TypeError(f"mod_args must be a tuple of arrays; got {type(mod_args).__name__}")
    mod_args = tuple(mod_args)
    if mod_args and mask_mod is None and score_mod is None:
        raise ValueError("mod_args are the arguments of mask_mod and score_mod: give one of them")
    if len(mod_args) > MAX_MOD_ARGS:
        raise ValueError(f"mod_args takes at most {MAX_MOD_ARGS} arrays; got {len(mod_args)}")
    for i, a in enumerate(mod_args):
        a_kind = kind_of(a, f"mod_args[{i}]")
        if a_kind != kind:
            raise TypeError(f"mod_args[{i}] must be an array of the inputs' library ({kind}); got {a_kind}")
        if device_id is not None and device_id_of(a, kind) != device_id:
            raise ValueError(f"mod_args[{i}] must be on the inputs' device (cuda:{device_id})")
    return mod_args


def none_given(mask_mod, score_mod, mod_args) -> bool:
    """No mod and no ``mod_args`` (an empty tuple or list): a call the plans may keep (with any
    of them, each call is checked in full: ``mod_args`` alone is an error to raise every time)."""
    return mask_mod is None and score_mod is None and isinstance(mod_args, (tuple, list)) and len(mod_args) == 0


def user_mods_of(mask_mod, score_mod, mod_args, score_mod_grad=None, block_sparse=False):
    """The kernels' compile-time ``score_mods.UserMods`` of a call, or ``None`` without mods
    (``block_sparse``: the kernel walks ``mask_mod``'s block mask, if there is a ``mask_mod``)."""
    if mask_mod is None and score_mod is None:
        return None
    return UserMods(mask_mod, score_mod, len(mod_args), score_mod_grad, block_sparse and mask_mod is not None)


@contextlib.contextmanager
def compiling(user):
    """Around a launch of a kernel with a user's mods (``user``: a ``score_mods.UserMods``, or
    ``None``: nothing happens): numba's typing error, when the mods cannot be compiled for the GPU,
    re-raised as a ``TypeError`` that names them and says what a mod may do. (The simulator runs a
    mod as Python, so a mod that calls a plain Python function, or uses a Python object, runs there
    and fails only here.)"""
    try:
        yield
    except Exception as exc:
        from numba.core.errors import TypingError

        if user is None or not isinstance(exc, TypingError):
            raise
        names = ", ".join(f"{n}={getattr(f, '__name__', f)!r}" for n, f in (("mask_mod", user.mask_mod),
                          ("score_mod", user.score_mod), ("score_mod_grad", user.score_mod_grad)) if f is not None)
        raise TypeError(f"numba could not compile {names} into the kernel: a mod may use its arguments, arithmetic, "
                        "indexing of its mod_args arrays and calls of numba device functions (cuda.jit(device=True)), "
                        f"not plain Python functions or objects. numba said: {exc}") from exc
