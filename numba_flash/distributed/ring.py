"""``ring_attention``: one rank's part of attention over a sequence sharded across a ring.

Each rank passes its own shard of q, k, v (``layout.py``). Over ``R`` steps the K/V shards
travel once around the ring (``comm.py``); at each step the rank runs ``api.forward`` on its
queries against the shard it holds, as :class:`~numba_flash.distributed.schedule.RingSchedule`
says (full blocks unmasked, its own shard causal, blocks after its queries skipped), and merges
each partial ``(o, lse)`` into its running result with split-KV's combine (``running.py``).
The result is exact, not an approximation: the merge of partial softmax states over disjoint key
sets is associative and commutative (``docs/theory/ring-attention.md``, section 2).

The loop is ring-flash-attention's (zhuzilin, ``ring_flash_attn.py``): start sending the held
shard on, compute with it, then wait for the next one, so that a GPU transport can hide the
transfer behind the step's attention (``torch_ring.py``: the NCCL transport, its streams).
"""

from __future__ import annotations

from numba_flash.distributed.comm import as_communicator
from numba_flash.distributed.layout import check_layout, chunks_per_rank, default_layout
from numba_flash.distributed.running import RunningResult
from numba_flash.distributed.schedule import RingSchedule

ATTENTION_OPTIONS = ("algorithm", "block_m", "block_n", "precision", "num_splits")


def forward(q, k, v, **kwargs):
    """``numba_flash.api.forward`` (imported on first use: it loads numba.cuda)."""
    from numba_flash.api import forward as api_forward

    return api_forward(q, k, v, **kwargs)


def ring_attention(q, k, v, *, causal=False, scale=None, group=None, layout=None, merge=None, **attention_options):
    """Attention of this rank's queries to the whole sharded sequence; returns ``(o, lse)``.

    Shapes, on every rank the same::

        q: (B, H,   n_q, D)     this rank's query shard        o:   (B, H, n_q, D), q's dtype
        k: (B, Hkv, n_k, D)     this rank's key/value shard    lse: (B, H, n_q), float32
        v: (B, Hkv, n_k, D)

    ``o`` and ``lse`` are this rank's rows of :func:`numba_flash.attention` on the full
    sequence (``gather_sequence`` of every rank's ``o`` is the whole output). ``causal=True``
    needs ``n_q == n_k`` (q and k are shards of one sequence) and masks by global position:
    query ``i`` sees key ``j`` iff ``j <= i``.

    ``layout``: how the shards cut the sequence (``layout.py``); ``None``: ``"zigzag"`` when
    causal (every rank does the same work), ``"contiguous"`` otherwise. Shard lengths must be a
    multiple of the chunks per shard (2 for zigzag). Split and gather full sequences with
    ``split_sequence(x, R, layout)`` / ``gather_sequence(shards, layout)``.

    ``group``: the transport (``comm.as_communicator``). ``None``: NCCL through torch.distributed's
    default process group (a :class:`~numba_flash.distributed.TorchRing` over it; each rank one
    process, e.g. started by ``torchrun``); a ``torch.distributed`` process group: NCCL over that
    group; a ring communicator (``comm.RingCommunicator``: ``rank``, ``world_size``,
    ``ring_shift``) as it is, e.g. a ``TorchRing`` kept across calls, or a
    :class:`~numba_flash.distributed.LocalRing`'s, which runs every rank in one process.
    Over NCCL, q, k, v are torch CUDA tensors or CuPy arrays on this rank's GPU, and the call
    returns once its work is queued on the caller's current stream (as ``attention`` does).

    Beyond the contract: ``merge`` (``"host"``: ``online.combine`` in float64, NumPy only;
    ``"device"``: the split-KV combine kernel; ``None``: host for NumPy, device otherwise) and the
    ``api.forward`` options ``algorithm``, ``block_m``, ``block_n``, ``precision``,
    ``num_splits``, passed to every local call.
    """
    comm = as_communicator(group)
    layout = default_layout(bool(causal)) if layout is None else check_layout(layout)
    unknown = sorted(set(attention_options) - set(ATTENTION_OPTIONS))
    if unknown:
        raise TypeError(f"ring_attention got unexpected keyword arguments {unknown}; it passes {list(ATTENTION_OPTIONS)} to forward")
    q_chunk, k_chunk = _check_shards(q, k, v, causal, scale, layout, attention_options)
    schedule = RingSchedule(comm.world_size, layout, bool(causal))
    running = RunningResult(q, merge)

    held = (k, v)
    for step in range(schedule.steps):
        last = step + 1 == schedule.steps
        pending = None if last else comm.ring_shift(*held)  # send on before computing (RingComm's prefetch)
        for call in schedule.calls(comm.rank, step):
            rows, keys = call.query_rows(q_chunk), call.key_rows(k_chunk)
            o_part, lse_part = forward(q[:, :, rows], held[0][:, :, keys], held[1][:, :, keys],
                                       causal=call.causal, scale=scale, **attention_options)
            running.add(rows, o_part, lse_part)
        if pending is not None:
            held = _check_received(pending.wait(), k, v, comm.rank)
    return running.result()


def _check_shards(q, k, v, causal, scale, layout, options) -> tuple[int, int]:
    """Every check before the first shift (an error after it would leave the other ranks
    waiting): what ``attention`` checks, and that the shards cut into the layout's chunks.
    Returns the query and key chunk lengths."""
    from numba_flash.api import configure
    from numba_flash.problem import describe

    problem = describe(q, k, v, causal=causal, scale=scale, algorithm=options.get("algorithm", "fa2"),
                       precision=options.get("precision"))
    configure(problem, options.get("block_m"), options.get("block_n"))  # the tiles' checks
    n_q, n_k = int(q.shape[2]), int(k.shape[2])
    if causal and n_q != n_k:
        raise ValueError(f"causal ring attention needs query and key shards of one sequence (n_q == n_k); got {n_q} and {n_k}")
    per_rank = chunks_per_rank(layout)
    for name, n in (("q", n_q), ("k", n_k)):
        if n % per_rank:
            raise ValueError(f"a {layout} shard holds {per_rank} equal chunks: {name}'s shard length {n} does not divide")
    return n_q // per_rank, n_k // per_rank


def _check_received(received, k, v, rank):
    """The shard that arrived must be shaped like this rank's own (same shapes on every rank)."""
    k_in, v_in = received
    for name, got, own in (("k", k_in, k), ("v", v_in, v)):
        if tuple(got.shape) != tuple(own.shape) or got.dtype != own.dtype:
            raise ValueError(f"rank {rank} received a {name} shard {tuple(got.shape)} {got.dtype} where its own is "
                             f"{tuple(own.shape)} {own.dtype}: every rank must pass the same shapes and dtypes")
    return k_in, v_in
