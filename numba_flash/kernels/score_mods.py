"""Score modifications on the device: what a scaled score goes through before the mask.

API.md section 2c's order on each score: scale, softcap, (ALiBi, ``score_mod``), then the masks.
The kernels keep scores in log2 units (``scale * log2(e)``, so that exp is one exp2), and so do
these functions: a natural-log cap ``c`` is ``c * log2(e)`` here (the host passes it so,
``softcap_log2``), and ``c tanh(s / c)`` is the same function in either unit.

:func:`soft_capper` gives, for an engine, the forward's ``s -> c tanh(s / c)`` (Gemma 2's logit
soft-capping) and the backward's pair (the same, and its derivative ``1 - tanh(s / c)^2``, by
which dS is multiplied: the gradient reaches the score before the cap through it), and
:func:`tile_soft_capper` the forward's routine over a register tile. The 16-bit tensor-core
engines take ``tanh.approx.f32`` (one MUFU instruction, relative error about 2^-11, as
FlashAttention's ``fast_tanh``: below the inputs' rounding); the float32 ones the exact
``tanhf``. In the simulator both are ``math.tanh``.

Each is compiled in only where the kernel's ``softcap`` flag (a compile-time constant) is set:
a kernel without it has not one instruction more.
"""

from __future__ import annotations

import functools
import math

from numba_flash._cuda import cuda, float32
from numba_flash._world import simulated

from numba_flash.kernels import mask
from numba_flash.kernels.jit import device_jit


@device_jit
def exact_tanh(x):
    return math.tanh(x)


if simulated():
    fast_tanh = exact_tanh
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def _tanh_approx(typingctx, x):
        sig = types.float32(types.float32)

        def codegen(context, builder, signature, args):
            f32 = ir.FloatType()
            asm = ir.InlineAsm(ir.FunctionType(f32, [f32]), "tanh.approx.f32 $0, $1;", "=f,f")
            return builder.call(asm, [args[0]])

        return sig, codegen

    @device_jit
    def fast_tanh(x):
        """``tanh.approx.f32`` (sm_75 and later)."""
        return _tanh_approx(float32(x))


@functools.lru_cache(maxsize=None)
def soft_capper(fast: bool):
    """``(soft_cap(x, cap), soft_cap_with_slope(x, cap))`` on :func:`fast_tanh` (``fast``) or
    :func:`exact_tanh`: ``cap * tanh(x / cap)`` (``cap > 0``; NaN stays NaN, +-inf goes to
    +-cap), and that with its derivative ``1 - tanh(x / cap)^2``."""
    tanh = fast_tanh if fast else exact_tanh

    @device_jit
    def soft_cap(x, cap):
        return cap * tanh(x / cap)

    @device_jit
    def soft_cap_with_slope(x, cap):
        t = tanh(x / cap)
        return cap * t, float32(1.0) - t * t

    return soft_cap, soft_cap_with_slope


@functools.lru_cache(maxsize=None)
def tile_soft_capper(n_i: int, n_j: int, fast: bool = False):
    """``cap_tile(s, cap)``: the soft cap on each entry of an ``n_i x n_j`` register tile."""
    soft_cap, _ = soft_capper(fast)

    @device_jit
    def cap_tile(s, cap):
        for i in range(n_i):
            for j in range(n_j):
                s[i, j] = soft_cap(s[i, j], cap)

    return cap_tile


# ---------------------------------------------------------------- ALiBi
#
# Press, Smith and Lewis (2022), with FlashAttention's bottom-right alignment (API.md section 2c):
# query i's score of key j gains -slope * |i + (Nk - Nq) - j|, the slope of its (batch, query
# head). The kernels take the slopes as a (B, H) float32 array already in log2 units (the host
# multiplies by log2(e)), and hold, per row a thread owns, the slope and the row's *diagonal*
# key d = i + (Nk - Nq): the bias of key j is then -slope * |d - j|, one subtraction, one
# absolute value and one FMA per score. A thread's row values are set once per Q tile
# (:func:`row_alibi`, beside ``mask.row_bounds``), so the walk's inner loop reads registers.


@functools.lru_cache(maxsize=None)
def alibi_rows(rows: int, thread_row):
    """``row_alibi(alibi, b, h, row0, n_q, n_k, rows_per_query, slopes, diags)``: the slope and
    diagonal key of each of a thread's ``rows`` rows (tile row ``thread_row(i)`` from ``row0``).
    ``h`` is the kernel's head: with ``rows_per_query`` > 1 (decode packs the query heads of one
    KV head: row = position * group + head), row ``r``'s query head is ``h * group + r % group``
    and its position ``r // group``."""

    @device_jit
    def row_alibi(alibi, b, h, row0, n_q, n_k, rows_per_query, slopes, diags):
        for i in range(rows):
            row = row0 + thread_row(i)
            if rows_per_query == 1:  # (no division where no rows are packed: the common case)
                slopes[i] = alibi[b, h]
                diags[i] = row + n_k - n_q
            else:
                pos, head = mask.packed_query(row, rows_per_query, h)
                slopes[i] = alibi[b, head]
                diags[i] = pos + n_k - n_q // rows_per_query

    return row_alibi


@device_jit
def alibi_bias(slope, diag, key):
    """-slope |diag - key| (log2 units when ``slope`` is): the ALiBi bias of ``key`` for the row
    whose diagonal key is ``diag``."""
    return -slope * abs(float32(diag - key))


@functools.lru_cache(maxsize=None)
def tile_alibi(n_i: int, n_j: int, key_of, row_of):
    """``add_alibi(s, col0, slopes, diags)``: the ALiBi bias added to each entry of an engine's
    ``n_i x n_j`` register tile, entry ``(i, j)`` holding key ``col0 + key_of(i, j)`` of row
    ``row_of(i, j)`` (the engine's layout, as ``mask.tile_masker`` takes it).

    The distance ``key - diag`` is formed in float32 from two parts: ``key_of(i, j) - key_of(0,
    0)``, a constant once the loops unroll (an engine's keys differ from its first by constants),
    and ``col0 + key_of(0, 0) - diag``, converted once per row. So a score costs one FADD and one
    FFMA (``|t|`` is an operand modifier: the FMA is written out, so it is one instruction in every
    engine's flags), not an integer-to-float conversion (I2F runs at a quarter of the FP32 rate or
    less) -- exact, as every distance is below 2^24. The tile may hold unscaled scores: with the
    slopes divided by the scale, ``(s - slope / scale |t|) scale`` is the scaled score plus its bias,
    and the scale stays folded into the softmax's exponentials (fa3 without a cap)."""

    @device_jit
    def add_alibi(s, col0, slopes, diags):
        k0 = key_of(0, 0)
        for i in range(n_i):
            for j in range(n_j):
                r = row_of(i, j)
                t = float32(key_of(i, j) - k0) + float32(col0 + k0 - diags[r])
                s[i, j] = cuda.fma(-slopes[r], abs(t), s[i, j])

    return add_alibi


@functools.lru_cache(maxsize=None)
def tile_alibi_one_side(n_i: int, n_j: int, key_of):
    """``add_linear(s, slope)``: ``s[i, j] += slope (key_of(i, j) - key_of(0, 0))`` on an engine's
    register tile: ALiBi's bias on a tile whose keys all lie on one side of its rows' diagonals,
    less a part that is constant along each row.

    Left of the diagonal (key <= diag) the bias ``-slope |diag - key|`` is ``slope (key - k) +
    slope (k - diag)`` for any key ``k``, right of it the same with ``-slope``: linear in the key.
    With ``k`` the thread's first key of the tile, the first term is the slope times a constant
    once the loops unroll (``FFMA`` with an immediate: one instruction a score, where
    :func:`tile_alibi` takes two), and the second, the row's *shift*, is the same for every score
    the thread holds in the row. Softmax does not see a row constant, so the engine adds the shift
    once per row to the tile's row max (before the row's threads reduce it: their shifts differ)
    and subtracts it from the exponentials' bias, never from a score. All rows of the tile take one
    slope (one head; not decode's packed query heads)."""

    @device_jit
    def add_linear(s, slope):
        k0 = key_of(0, 0)
        for i in range(n_i):
            for j in range(n_j):
                if key_of(i, j) != k0:  # (the first key's term is 0: no instruction)
                    s[i, j] = cuda.fma(slope, float32(key_of(i, j) - k0), s[i, j])

    return add_linear


@functools.lru_cache(maxsize=None)
def tile_alibi_scaled(n_i: int, n_j: int, key_of, row_of):
    """``scale_add_alibi(s, q_scale, col0, slopes, diags)``: ``s <- s q_scale + bias`` on an
    engine's register tile, for masks whose every visible key is at or left of its row's diagonal
    (a right edge at 0: ``causal``, ``window_size=(left, 0)``). There the bias is
    ``slope (key - diag)``, linear in the key, so with the row's part ``slope (col0 + key_of(0, 0)
    - diag)`` formed once per row, a score costs two FFMAs (the bias, then the scale fused with
    it) in place of the scale's FMUL: one instruction more, where :func:`tile_alibi` after the
    scale adds two. Keys right of the diagonal get a wrong bias here, and the mask hides them
    (every tile holding one is masked)."""

    @device_jit
    def scale_add_alibi(s, q_scale, col0, slopes, diags):
        k0 = key_of(0, 0)
        for i in range(n_i):
            for j in range(n_j):
                r = row_of(i, j)
                row_part = slopes[r] * float32(col0 + k0 - diags[r])
                s[i, j] = s[i, j] * q_scale + (slopes[r] * float32(key_of(i, j) - k0) + row_part)

    return scale_add_alibi


# ---------------------------------------------------------------- user mods (mask_mod, score_mod)
#
# FlexAttention's hooks (API.md section 2c): ``mask_mod(b, h, q_idx, kv_idx, *mod_args) -> bool``
# and ``score_mod(score, b, h, q_idx, kv_idx, *mod_args) -> float``, a user's plain Python
# functions (or numba device functions) compiled into the kernel, inlined. A kernel with them is
# specialised on the functions themselves (:class:`UserMods`, a compile-time constant) and on the
# number of ``mod_args`` arrays, which it receives as one tuple argument. The kernels hold scores in
# log2 units, the user's functions see natural-log ones: ``score_mod`` is called on ``s ln 2`` and
# its result multiplied by ``log2(e)``. Only real (query, key) pairs reach a user's function --
# rows past Nq and keys past Nk are skipped (the built-in mask hides those keys) -- so a mod may
# index its arrays by ``q_idx`` and ``kv_idx``.

MAX_MOD_ARGS = 4  # arrays a mod takes after its indices


class UserMods:
    """The compile-time part of a call's user mods: the functions and the number of ``mod_args``.
    Equal (and hashing alike) for the same function objects and count, so a kernel compiled for
    them is reused; a function's ``repr`` holds its address, so such kernels are never written to
    the persistent compilation cache (``kernels.jit.kernel_factory``)."""

    uncacheable = True  # (kernels.jit.kernel_factory: a kernel of a user's functions is never stored)

    def __init__(self, mask_mod=None, score_mod=None, n_args: int = 0, score_mod_grad=None, block_sparse: bool = False):
        self.mask_mod, self.score_mod, self.score_mod_grad = mask_mod, score_mod, score_mod_grad
        self.n_args = int(n_args)
        # block_sparse: the kernel walks a block mask's tile lists (``numba_flash.block_sparse``):
        # two more arguments, and mask_mod evaluated on its partial tiles only
        self.block_sparse = bool(block_sparse)
        if not 0 <= self.n_args <= MAX_MOD_ARGS:
            raise ValueError(f"mod_args takes at most {MAX_MOD_ARGS} arrays; got {self.n_args}")
        if self.block_sparse and mask_mod is None:
            raise ValueError("a block-sparse walk comes with a mask_mod (its partial tiles apply it)")

    def _key(self):
        return (self.mask_mod, self.score_mod, self.n_args, self.score_mod_grad, self.block_sparse)

    def __eq__(self, other):
        return isinstance(other, UserMods) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        return (f"UserMods(mask_mod={self.mask_mod!r}, score_mod={self.score_mod!r}, n_args={self.n_args}, "
                f"score_mod_grad={self.score_mod_grad!r}" + (", block_sparse=True)" if self.block_sparse else ")"))

    def dense(self) -> "UserMods":
        """The same mods for a kernel that walks every tile (no block mask)."""
        return UserMods(self.mask_mod, self.score_mod, self.n_args, self.score_mod_grad) if self.block_sparse else self


def user_engine(name: str, user_mods):
    """The module of a backward engine made with ``user_mods`` (``None``: none): its name carries
    them (the kernel's identity), and it is ``uncacheable`` with them (``kernels.jit``)."""
    from types import ModuleType

    engine = ModuleType(name + ("" if user_mods is None else f"_user_{user_mods!r}"))
    engine.user_mods = user_mods
    engine.uncacheable = user_mods is not None
    return engine


def _device(fn):
    """A user's function as an inlined device function (a numba device function as it is)."""
    if fn is None:
        return None
    if getattr(fn, "targetoptions", {}).get("device"):  # numba's cuda.jit(device=True) dispatcher
        return fn
    return device_jit(fn)


def _with_args(fn, has_score: bool):
    """``call(x, b, h, q, k, args)`` of a user's function (``has_score``: ``score_mod``'s signature,
    else ``mask_mod``'s, which takes no ``x``) with the arrays of the tuple ``args`` spread after
    the indices."""
    f = _device(fn)
    if has_score:
        return device_jit(lambda x, b, h, q, k, args: f(x, b, h, q, k, *args))
    return device_jit(lambda x, b, h, q, k, args: f(b, h, q, k, *args))


LN2_F32 = 0.6931471805599453
LOG2E_F32 = 1.4426950408889634


@device_jit
def _every_key(x, b, h, q, k, args):
    return True  # (no mask_mod; never called: the kernels test for it first)


@device_jit
def _same_score(x, b, h, q, k, args):
    return x  # (no score_mod)


@device_jit
def _unit_slope(x, b, h, q, k, args):
    return float32(1.0)  # (no score_mod_grad)


@functools.lru_cache(maxsize=None)
def user_mod_calls(user: UserMods):
    """``(modded(x, b, h, q, k, args), modded_with_grad(x, b, h, q, k, args))`` of a kernel's user
    mods, on a score ``x`` in log2 units: ``score_mod`` (in natural-log units, as the user wrote
    it), then ``-inf`` where ``mask_mod`` says False; the second also returns d score_mod / d score
    (``score_mod_grad``; 1 without a ``score_mod``) for the backward's dS."""
    MASK, SCORE, GRAD = user.mask_mod is not None, user.score_mod is not None, user.score_mod_grad is not None
    mask_call = _with_args(user.mask_mod, False) if MASK else _every_key
    score_call = _with_args(user.score_mod, True) if SCORE else _same_score
    grad_call = _with_args(user.score_mod_grad, True) if GRAD else _unit_slope

    @device_jit
    def modded(x, b, h, q, k, args):
        if SCORE:
            x = float32(score_call(x * float32(LN2_F32), b, h, q, k, args)) * float32(LOG2E_F32)
        if MASK:
            if not mask_call(x, b, h, q, k, args):
                x = float32(-math.inf)
        return x

    @device_jit
    def modded_with_grad(x, b, h, q, k, args):
        slope = float32(1.0)
        if SCORE:
            natural = x * float32(LN2_F32)
            if GRAD:
                slope = float32(grad_call(natural, b, h, q, k, args))
            x = float32(score_call(natural, b, h, q, k, args)) * float32(LOG2E_F32)
        if MASK:
            if not mask_call(x, b, h, q, k, args):
                x = float32(-math.inf)
        return x, slope

    return modded, modded_with_grad


@functools.lru_cache(maxsize=None)
def user_mask_call(user: UserMods):
    """``visible(b, h, q, k, args)``: a kernel's user ``mask_mod`` alone (the block mask's
    derivation, ``kernels.block_kinds``)."""
    call = _with_args(user.mask_mod, False)

    @device_jit
    def visible(b, h, q, k, args):
        return bool(call(float32(0.0), b, h, q, k, args))

    return visible


@functools.lru_cache(maxsize=None)
def query_rows(rows: int, thread_row):
    """``row_queries(h, row0, n_q, rows_per_query, positions, heads)``: the query position and
    query head of each of a thread's ``rows`` rows (rows packed as in :func:`alibi_rows`);
    position -1 for a row past the last (no user function sees it)."""

    @device_jit
    def row_queries(h, row0, n_q, rows_per_query, positions, heads):
        for i in range(rows):
            row = row0 + thread_row(i)
            if rows_per_query == 1:
                positions[i] = row
                heads[i] = h
            else:
                positions[i], heads[i] = mask.packed_query(row, rows_per_query, h)
            if row >= n_q:
                positions[i] = -1

    return row_queries


@functools.lru_cache(maxsize=None)
def tile_user_mods(n_i: int, n_j: int, key_of, row_of, user: UserMods):
    """``apply_user_mods(s, col0, n_k, b, positions, heads, args, partial)``: a kernel's user mods
    on each entry of an engine's register tile (layout as ``mask.tile_masker`` takes it) whose row
    and key are real (``positions[r] >= 0``, key below ``n_k``). ``partial``: the tile's entries
    may be hidden, ``mask_mod`` is called; else (a block mask's full tile) ``score_mod`` only."""
    modded, _ = user_mod_calls(user)
    SCORE = user.score_mod is not None
    scored = user_mod_calls(UserMods(None, user.score_mod, user.n_args))[0] if SCORE else modded  # (unused without)

    @device_jit
    def apply_user_mods(s, col0, n_k, b, positions, heads, args, partial):
        if partial or SCORE:
            for i in range(n_i):
                for j in range(n_j):
                    r = row_of(i, j)
                    key = col0 + key_of(i, j)
                    if positions[r] >= 0 and key < n_k:
                        if partial:
                            s[i, j] = modded(s[i, j], b, heads[r], positions[r], key, args)
                        else:
                            s[i, j] = scored(s[i, j], b, heads[r], positions[r], key, args)

    return apply_user_mods


@functools.lru_cache(maxsize=None)
def backward_probs(fast: bool, user_mods=None, key_rows: bool = False):
    """``p_and_ds(x, l2, dp, dd, capped, cap, biased, slope, diag, row, col, user)``: the
    backward's P = exp2(x' - L) and dS = P (dP - D) (FA-2 Alg. 2 lines 11, 14) of one scaled score
    ``x`` (log2 units), where ``x'`` is ``x`` with every modification the forward made -- the soft
    cap (``capped``; :func:`soft_capper`'s, ``fast``: ``tanh.approx``), ALiBi's bias (``biased``:
    ``slope`` and the ``diag`` of the entry's row, the column index ``col``), a user's mods (an
    engine made with ``user_mods``: ``user = (b, h, row0, Nq, Nk, mod_args)`` and, block-sparse, the tile's ``partial``, the entry's row
    ``row0 + row``) -- and dS carries the derivative of the cap and of ``score_mod``. ``key_rows``:
    the engine's rows are keys and its columns queries (the dK/dV walk), else the reverse. An entry
    a ``mask_mod`` hides gets P = dS = 0. The one place the three backward engines take a score's
    modifications from."""
    _, soft_cap_with_slope = soft_capper(fast)
    USER, KEY_ROWS = user_mods is not None, bool(key_rows)
    _, user_modded = user_mod_calls(user_mods) if USER else (None, None)
    # a block-sparse walk's full tiles: score_mod alone (``user[6]``: the tile is partial)
    SPARSE = USER and user_mods.block_sparse
    SCORE = USER and user_mods.score_mod is not None
    scored_only = (user_mod_calls(UserMods(None, user_mods.score_mod, user_mods.n_args, user_mods.score_mod_grad))[1]
                   if SPARSE and SCORE else user_modded)

    @device_jit
    def p_and_ds(x, l2, dp, dd, capped, cap, biased, slope, diag, row, col, user):
        cap_slope = float32(1.0)
        if capped:  # the forward's soft cap, and its slope for dS
            x, cap_slope = soft_cap_with_slope(x, cap)
        if biased:  # the forward's ALiBi bias (a constant of the score: no factor in dS)
            x += alibi_bias(slope, diag, col)
        mod_slope = float32(1.0)
        if USER:  # a user's score_mod (and its slope for dS) and mask_mod, on real (query, key) pairs only
            if KEY_ROWS:
                query, key = col, user[2] + row
            else:
                query, key = user[2] + row, col
            if query < user[3] and key < user[4]:
                if SPARSE and not user[6]:  # a full tile: no mask_mod
                    if SCORE:
                        x, mod_slope = scored_only(x, user[0], user[1], query, key, user[5])
                else:
                    x, mod_slope = user_modded(x, user[0], user[1], query, key, user[5])
        p = math.exp2(x - l2)  # FA-2 Alg. 2 line 11 (Alg. 4 line 13)
        ds = p * (dp - dd)  # FA-2 line 14 (Alg. 4 line 20)
        if capped:
            ds *= cap_slope
        if USER:
            ds *= mod_slope
            if x == float32(-math.inf):  # hidden by mask_mod (0, not 0 times a dP a NaN made)
                p = float32(0.0)
                ds = float32(0.0)
        return p, ds

    return p_and_ds
