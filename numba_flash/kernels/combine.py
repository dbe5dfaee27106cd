"""The merge of partial softmax states on the GPU: split-KV's second kernel.

The partials of a split launch (``block_info``) are finalised states over disjoint key ranges:
(O_s, lse_s). As a state of the online softmax (``numba_flash.online``) a finalised partial is
(m = lse_s, l = 1, acc = O_s), and merging them all and finalising once gives::

    lse = m + log sum_s exp(lse_s - m)          m = max_s lse_s
    O   = sum_s exp(lse_s - lse) O_s

which is ``online.merge`` folded over the splits, then ``online.finalize`` (the NumPy twin,
``online.combine``, states it so; the merge is associative and commutative, so any number of
splits in any order gives the same result up to rounding). A split that saw no key (lse = -inf)
weighs exp(-inf) = 0; if every split is empty the row gives O = 0, lse = -inf, as an unsplit row
that sees no key. NaN propagates (a NaN lse makes m NaN).

Launch (``combine_launch(S, o.shape, bits)`` gives the kernel, grid and block): block
``(32, groups, rows)``, one warp per ``chunk`` splits of a row (``split_chunk``: S rounded up to
1, 2, 4 or 8; ``groups = ceil(S / chunk)``, 1 to 16 warps) and ``rows = BLOCK_WARPS // groups``
query rows (at least 1, at most Nq); grid ``(ceil(Nq / rows), H, B)``, so a thread finds its
row with no division. Arguments: ``o_parts (S*B, H, Nq, >= D) float32``, ``lse_parts (S*B, H,
Nq) float32`` (split s of batch b at ``s * B + b``, ``S <= MAX_PARTIALS``), ``o (B, H, Nq, D)``
out (float32 or float16 values, or uint16 bit patterns of the 16-bit ``bits`` kind), ``lse (B,
H, Nq) float32`` out.

Lane ``l`` of a warp owns columns ``l, l + 32, ...`` (``ceil(D / 32)`` of them, a compile-time
count); warp ``g`` of a row sums the splits ``chunk g .. chunk g + chunk - 1``. It first issues
all ``chunk ceil(D / 32)`` of their loads (they do not depend on the weights), then every lse of
the row (one load per lane and 32 splits; -inf past the last), and folds those by warp shuffles
(the max, then the sum of exp(lse_s - m)): no shared memory and no barrier, and the row waits on
about one L2 round trip. A partial's weight exp(lse_s - lse) is computed by every lane from
lse_s broadcast by the lane that holds it; an empty partial (lse_s = -inf) adds nothing,
whatever its o holds. A row of more than 8 splits adds its warps' sums through shared memory
after one barrier. ``docs/performance-log.md`` 9i compares the SASS with the kernel before (512
threads per row, the lse folded serially from shared memory by every thread, 4 loads in flight,
5 barriers: 9.7 us at 32 splits on the H200).
"""

from __future__ import annotations

import math

from numba_flash._cuda import cuda, float32

from numba_flash.kernels import mma
from numba_flash.kernels.jit import NEG_INF, device_jit, kernel_factory, kernel_jit
from numba_flash.kernels.row_reduce import add, issue_fence, lane_broadcast, row_allreduce, scratch_floats
from numba_flash.kernels.softmax import nan_max
from numba_flash.kernels.tile_ops import at

MAX_PARTIALS = 128  # partials a row may have: each lane of a warp holds up to 4 of their lse
WARP = 32
MAX_CHUNK = 8  # splits a warp sums in one pass (all of their loads issued before the first is used)
BLOCK_WARPS = 4  # warps a block holds when a row's splits need fewer (rows share the block)
MAX_WARPS = MAX_PARTIALS // MAX_CHUNK  # warps of a block: one row of 128 splits, or rows of fewer
MAX_THREADS = MAX_WARPS * WARP


def split_chunk(n_splits: int) -> int:
    """Splits a warp sums in one pass: ``n_splits`` rounded up to 1, 2, 4 or 8 (a kernel holds
    ``chunk x ceil(D / 32)`` loaded values per lane: fewer registers when there are fewer splits)."""
    return min(MAX_CHUNK, 1 << max(0, n_splits - 1).bit_length())


def combine_launch(n_splits: int, shape, bits: str | None = None):
    """``(kernel, grid, block)`` of the combine of ``n_splits`` partials into ``o`` of ``shape``
    ``(B, H, Nq, D)``: block ``(32, groups, rows)``, a warp per ``split_chunk`` splits of a row
    (``groups`` of them, 1 to 16) and ``rows`` query rows (``BLOCK_WARPS // groups``, at least
    one, at most Nq); grid ``(ceil(Nq / rows), H, B)``."""
    if not 1 <= n_splits <= MAX_PARTIALS:
        raise ValueError(f"the combine merges 1 to {MAX_PARTIALS} partials per row; got {n_splits}")
    B, H, n_q, head_dim = (int(n) for n in shape)
    chunk = split_chunk(n_splits)
    groups = -(-n_splits // chunk)
    rows = max(1, min(BLOCK_WARPS // groups, n_q))
    kernel = _combine_kernel(bits, -(-head_dim // WARP), chunk)
    return kernel, (-(-n_q // rows), H, B), (WARP, groups, rows)


@device_jit
def split_lse(lse_parts, s, batch, b, h, i):
    """lse of split ``s`` of row (b, h, i); -inf past the last split (``s B + b`` past the
    partials: the test needs no division)."""
    x = float32(NEG_INF)
    if s * batch + b < lse_parts.shape[0]:
        x = lse_parts[at(s * batch + b), at(h), at(i)]
    return x


@device_jit
def pick(k, x0, x1, x2, x3):
    """``(x0, x1, x2, x3)[k]`` by selects (a local array indexed at run time would sit in memory)."""
    x = x0
    if k == 1:
        x = x1
    if k == 2:
        x = x2
    if k == 3:
        x = x3
    return x


@kernel_factory
def _combine_kernel(bits, lane_cols: int, chunk: int):
    """The combine kernel for rows whose columns ``lane, lane + 32, ...`` make ``lane_cols`` per
    lane, summing ``chunk`` splits per warp and pass; ``bits``: ``None`` (``o`` holds values) or
    ``"f16"`` / ``"bf16"`` (``o`` holds the 16-bit patterns of that kind, as the tensor-core path
    passes it)."""
    BITS = None if bits is None else mma.BITS_16[bits]
    NCOL, CHUNK = lane_cols, chunk
    # Each warp's sums of its splits, one row per warp, when a row has several warps: only with
    # chunks of 8 (``combine_launch`` gives a smaller chunk to rows of one warp).
    SUMS = (MAX_WARPS if CHUNK == MAX_CHUNK else 1, WARP * NCOL)
    warp_max = row_allreduce(nan_max, 1, WARP, MAX_THREADS)
    warp_sum = row_allreduce(add, 1, WARP, MAX_THREADS)
    broadcast = lane_broadcast(MAX_THREADS)
    SCRATCH = scratch_floats(1, MAX_THREADS)  # the simulator's shuffles (1 float on the GPU: unused)

    @device_jit
    def load_chunk(parts, o_parts, first, batch, b, h, i, lane, dim):
        """``parts[j, c]``: o of split ``first + j`` at column ``lane + 32 c`` (0 past the
        splits or the columns); no load waits for another."""
        for j in range(CHUNK):
            s = first + j
            for c in range(NCOL):
                d = lane + WARP * c
                x = float32(0.0)
                if s * batch + b < o_parts.shape[0] and d < dim:
                    x = o_parts[at(s * batch + b), at(h), at(i), at(d)]
                parts[j, c] = x

    @device_jit
    def add_chunk(acc, parts, first, lse_lane, total, scratch):
        """``acc[c] += exp(lse_s - total) parts[j, c]`` over the chunk's splits ``s = first + j``,
        lse_s broadcast from the lane that holds it (``lse_lane``: this lane's lse of the
        32-split block of the chunk); an empty split (-inf, as past the last) adds nothing,
        whatever its o holds."""
        for j in range(CHUNK):
            lse_s = broadcast(lse_lane, first % WARP + j, scratch)
            empty = lse_s == NEG_INF
            weight = math.exp(float32(0.0) if empty else lse_s - total)
            if empty:
                weight = float32(0.0)
            for c in range(NCOL):
                x = parts[j, c]
                if empty:
                    x = float32(0.0)
                acc[c] += weight * x

    @kernel_jit(fastmath={"contract", "afn", "arcp"})
    def combine(o_parts, lse_parts, o, lse):
        batch, n_q, dim = o.shape[0], o.shape[2], o.shape[3]
        lane = cuda.threadIdx.x
        g = cuda.threadIdx.y  # the warp's share of the row's splits: chunk g, g + groups, ...
        groups = cuda.blockDim.y
        row_slot = cuda.threadIdx.z
        warp = row_slot * groups + g
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        i = cuda.blockIdx.x * cuda.blockDim.z + row_slot
        stores = i < n_q
        i = min(i, n_q - 1)  # a warp past the last row computes one and stores nothing: all reach the barrier
        scratch = cuda.shared.array(SCRATCH, float32)
        sums = cuda.shared.array(SUMS, float32)
        parts = cuda.local.array((CHUNK, NCOL), float32)
        acc = cuda.local.array(NCOL, float32)
        folded = cuda.local.array(1, float32)
        # The first chunk's o, then every lse (splits lane, lane + 32, lane + 64, lane + 96):
        # none of these loads waits for another.
        load_chunk(parts, o_parts, g * CHUNK, batch, b, h, i, lane, dim)
        # ptxas issues the o loads before the lse loads and the shuffles that wait for them
        # (without the fence it put 28 of a D = 128 chunk's 32 loads behind the first shuffle,
        # a second L2 round trip)
        issue_fence()
        lse0 = split_lse(lse_parts, lane, batch, b, h, i)
        lse1 = split_lse(lse_parts, lane + WARP, batch, b, h, i)
        lse2 = split_lse(lse_parts, lane + 2 * WARP, batch, b, h, i)
        lse3 = split_lse(lse_parts, lane + 3 * WARP, batch, b, h, i)
        # m = max_s lse_s (NaN if one is NaN), then lse = m + log sum_s exp(lse_s - m)
        folded[0] = nan_max(nan_max(lse0, lse1), nan_max(lse2, lse3))
        warp_max(folded, scratch)
        m = folded[0]
        shift = m
        if m == NEG_INF:  # every partial empty: the sum is 0 and lse stays -inf
            shift = float32(0.0)
        folded[0] = math.exp(lse0 - shift) + math.exp(lse1 - shift) + math.exp(lse2 - shift) + math.exp(lse3 - shift)
        warp_sum(folded, scratch)
        total = m
        if m != NEG_INF:
            total = m + math.log(folded[0])
        for c in range(NCOL):
            acc[c] = 0.0
        first = g * CHUNK
        add_chunk(acc, parts, first, pick(first // WARP, lse0, lse1, lse2, lse3), total, scratch)
        # A block of fewer warps than the row's chunks: the rest in rounds (none from combine_launch).
        t = 1
        while t * groups * CHUNK * batch < lse_parts.shape[0]:  # splits t G CHUNK, ... remain
            first = (t * groups + g) * CHUNK
            load_chunk(parts, o_parts, first, batch, b, h, i, lane, dim)
            add_chunk(acc, parts, first, pick(first // WARP, lse0, lse1, lse2, lse3), total, scratch)
            t += 1
        if groups == 1:
            if stores:
                for c in range(NCOL):
                    d = lane + WARP * c
                    if d < dim:
                        if BITS is None:
                            o[at(b), at(h), at(i), at(d)] = acc[c]
                        else:
                            o[at(b), at(h), at(i), at(d)] = BITS(acc[c])
        else:
            for c in range(NCOL):
                sums[warp, lane + WARP * c] = acc[c]
            cuda.syncthreads()
            if stores:
                first_warp = warp - g  # the row's warps: first_warp .. first_warp + groups - 1
                d = g * WARP + lane  # the row's columns over its warps' threads (a loop with no division)
                while d < dim:
                    x = sums[first_warp, d]
                    for gg in range(1, groups):
                        x += sums[first_warp + gg, d]
                    if BITS is None:
                        o[at(b), at(h), at(i), at(d)] = x
                    else:
                        o[at(b), at(h), at(i), at(d)] = BITS(x)
                    d += groups * WARP
        if stores and g == 0 and lane == 0:
            lse[at(b), at(h), at(i)] = total

    return combine
