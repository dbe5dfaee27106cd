"""Ring attention (API.md section 6) without GPUs: every rank in one process (``LocalRing``), the
kernels in the simulator.

The claims under test: gathering every rank's ``(o, lse)`` gives attention on the whole sequence
(against the float64 reference, not against another run of the ring); the schedule computes each
visible (query, key) pair exactly once over the ring and no masked one; the zigzag layout gives
every rank the same causal work at every step (the contiguous one does not, which shows that the
check can fail); split and gather are inverses; a partial whose rows see no key merges as the
identity (o = 0, lse = -inf, never NaN). The transports themselves (receive slots, the NCCL
ring's stream order against a fake torch.distributed): ``tests/distributed/test_ring_transport.py``.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers import examples, lse_matches, plain_fp16_attention, random_qkv, rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

from numba_flash import distributed as dist
from numba_flash import reference
from numba_flash.api import forward
from numba_flash.distributed import BlockKind, LocalRing, RingSchedule
from numba_flash.distributed.running import RunningResult
from numba_flash.distributed.schedule import block_kind

TILES = dict(block_m=4, block_n=4)  # tiny tiles: the simulator's cost grows with the block's threads
REL_TOL = 1e-5  # float32 inputs against the float64 reference on the whole sequence


def run_ring(q, k, v, world_size, layout, causal, ring=None, **kw):
    """Split q, k, v, run ``ring_attention`` on every rank of a LocalRing, gather o and lse."""
    ring = LocalRing(world_size) if ring is None else ring
    shards = [dist.split_sequence(x, world_size, layout) for x in (q, k, v)]
    results = ring.run(dist.ring_attention, *shards, causal=causal, layout=layout, **TILES, **kw)
    o = dist.gather_sequence([o for o, _ in results], layout)
    lse = dist.gather_sequence([lse for _, lse in results], layout)
    return o, lse, results


def assert_matches_reference(o, lse, q, k, v, causal):
    ref_o, ref_lse = reference.attention(q, k, v, causal=causal)
    assert o.dtype == np.float32 and lse.dtype == np.float32
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    assert rel_err(o, ref_o) < REL_TOL
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    seen = np.isfinite(ref_lse)
    assert np.abs(lse[seen] - ref_lse[seen]).max(initial=0) / max(1.0, np.abs(ref_lse[seen]).max(initial=0)) < REL_TOL


# --------------------------------------------------------------------------- the ring against the reference


@settings(max_examples=examples(10), deadline=None)
@given(
    world_size=st.integers(1, 4),
    batch=st.integers(1, 2),
    chunk_len=st.integers(1, 3),
    key_chunk_len=st.integers(1, 3),
    causal=st.booleans(),
    layout=st.sampled_from(dist.LAYOUTS),
    gqa=st.booleans(),
    head_dim=st.sampled_from([4, 8]),
    seed=st.integers(0, 2**32 - 1),
)
def test_gathered_ring_equals_attention_on_the_whole_sequence(world_size, batch, chunk_len, key_chunk_len, causal, layout, gqa,
                                                              head_dim, seed):
    if causal:
        key_chunk_len = chunk_len  # q and k shards of one sequence
    chunks = dist.chunk_count(layout, world_size)
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, batch, 2, 1 if gqa else 2, chunks * chunk_len, chunks * key_chunk_len, head_dim, "float32")
    o, lse, results = run_ring(q, k, v, world_size, layout, causal)
    rows = q.shape[2] // world_size
    assert all(r_o.shape == (batch, 2, rows, head_dim) and r_lse.shape == (batch, 2, rows) for r_o, r_lse in results)
    assert_matches_reference(o, lse, q, k, v, causal)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("world_size, causal", [(2, True), (3, False)])
def test_16_bit_ring_meets_flash_attentions_rule(dtype, world_size, causal):
    """float16 / bfloat16 on the tensor-core kernels (their default regime): each step's partial o
    is rounded to the input dtype before the merge, and the gathered result is still within twice
    the error of a plain 16-bit implementation on the whole sequence (FlashAttention's rule)."""
    import ml_dtypes

    np_dtype = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    rng = np.random.default_rng(11)
    layout = dist.default_layout(causal)
    n = dist.chunk_count(layout, world_size) * 4
    q, k, v = (x.astype(np_dtype) for x in random_qkv(rng, 1, 2, 1, n, n, 16, "float32"))
    ring = LocalRing(world_size)
    results = ring.run(dist.ring_attention, *(dist.split_sequence(x, world_size, layout) for x in (q, k, v)), causal=causal)
    o = dist.gather_sequence([o for o, _ in results], layout)
    lse = dist.gather_sequence([lse for _, lse in results], layout)
    assert o.dtype == np_dtype and lse.dtype == np.float32
    wide = [x.astype(np.float64) for x in (q, k, v)]
    ref_o, ref_lse = reference.attention(*wide, causal=causal)
    plain = plain_fp16_attention(q, k, v, causal, dtype=np_dtype).astype(np.float64)
    err, base = np.abs(o.astype(np.float64) - ref_o).max(), np.abs(plain - ref_o).max()
    assert err <= 2 * base + 1e-6, f"{dtype} ring error {err:.3g} > 2 x plain {dtype} error {base:.3g}"
    assert lse_matches(lse, ref_lse, atol=1e-4, rtol=1e-4)


def test_ring_with_the_combine_kernel_as_merge():
    """``merge="device"``: the partials merge through split-KV's combine kernel (the GPU path)."""
    rng = np.random.default_rng(7)
    q, k, v = random_qkv(rng, 1, 2, 1, 8, 8, 4, "float32")
    o, lse, _ = run_ring(q, k, v, 2, "zigzag", True, merge="device")
    assert_matches_reference(o, lse, q, k, v, True)
    q3, k3, v3 = random_qkv(rng, 1, 1, 1, 6, 3, 4, "float32")
    o, lse, _ = run_ring(q3, k3, v3, 3, "contiguous", False, merge="device")
    assert_matches_reference(o, lse, q3, k3, v3, False)


def test_ring_sends_one_kv_shard_per_step_to_the_next_rank():
    rng = np.random.default_rng(1)
    world_size = 3
    q, k, v = random_qkv(rng, 1, 2, 2, 6, 6, 4, "float32")
    ring = LocalRing(world_size)
    run_ring(q, k, v, world_size, "contiguous", False, ring=ring)
    shard_bytes = 2 * k.nbytes // world_size  # one K and one V shard
    assert sorted(ring.transfers) == sorted((r, shard_bytes) for r in range(world_size) for _ in range(world_size - 1))

    def who_arrives(step_count, group):  # each rank passes its own id on; after t shifts it holds r - t
        held = (np.array([group.rank]),)
        seen = []
        for _ in range(step_count):
            held = group.ring_shift(*held).wait()
            seen.append(int(held[0][0]))
        return seen

    ring = LocalRing(4)
    got = ring.run(who_arrives, [3] * 4)
    assert got == [[(r - t) % 4 for t in (1, 2, 3)] for r in range(4)]
    assert all(r == RingSchedule(4, "contiguous", False).kv_source(r, 0) for r in range(4))


# --------------------------------------------------------------------------- the schedule


def coverage(schedule: RingSchedule, chunk_len: int) -> np.ndarray:
    """How many times the ring's calls compute each (query position, key position) score."""
    n = schedule.world_size * schedule.chunks_per_rank * chunk_len
    count = np.zeros((n, n), dtype=int)
    for rank in range(schedule.world_size):
        for step in range(schedule.steps):
            q_pos = np.concatenate([np.arange(g * chunk_len, (g + 1) * chunk_len) for g in schedule.query_chunks(rank)])
            k_pos = np.concatenate([np.arange(g * chunk_len, (g + 1) * chunk_len) for g in schedule.key_chunks(rank, step)])
            for call in schedule.calls(rank, step):
                rows, keys = q_pos[call.query_rows(chunk_len)], k_pos[call.key_rows(chunk_len)]
                local = np.ones((len(rows), len(keys)), dtype=int)
                if call.causal:  # attention's bottom-right mask on the call's own block
                    local = np.tril(local, k=len(keys) - len(rows))
                np.add.at(count, (rows[:, None], keys[None, :]), local)
    return count


@settings(max_examples=examples(40), deadline=None)
@given(world_size=st.integers(1, 8), chunk_len=st.integers(1, 3), causal=st.booleans(), layout=st.sampled_from(dist.LAYOUTS))
def test_schedule_computes_every_visible_pair_once_and_no_masked_one(world_size, chunk_len, causal, layout):
    schedule = RingSchedule(world_size, layout, causal)
    count = coverage(schedule, chunk_len)
    n = count.shape[0]
    visible = np.tril(np.ones((n, n), dtype=int)) if causal else np.ones((n, n), dtype=int)
    np.testing.assert_array_equal(count, visible)


@settings(max_examples=examples(40), deadline=None)
@given(world_size=st.integers(1, 8), causal=st.booleans(), layout=st.sampled_from(dist.LAYOUTS))
def test_every_chunk_pair_meets_once_with_its_kind(world_size, causal, layout):
    schedule = RingSchedule(world_size, layout, causal)
    met = {}
    for rank in range(world_size):
        for step in range(schedule.steps):
            kinds = schedule.kinds(rank, step)
            for a, qc in enumerate(schedule.query_chunks(rank)):
                for b, kc in enumerate(schedule.key_chunks(rank, step)):
                    assert (qc, kc) not in met
                    met[qc, kc] = kinds[a][b]
    chunks = dist.chunk_count(layout, world_size)
    assert set(met) == {(i, j) for i in range(chunks) for j in range(chunks)}
    for (qc, kc), kind in met.items():
        expected = BlockKind.FULL if not causal or kc < qc else (BlockKind.DIAGONAL if kc == qc else BlockKind.SKIPPED)
        assert kind is expected is block_kind(qc, kc, causal)


@pytest.mark.parametrize("chunk_len", [1, 4, 5])
@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_zigzag_gives_every_rank_the_same_causal_work_at_every_step(world_size, chunk_len):
    """Ranks wait for each other at every shift, so the balance that counts is per step: with
    zigzag no rank's work differs from another's by more than one chunk pair (c^2 scores); with
    contiguous shards the ranks that hold early queries idle (the property can fail)."""
    c = chunk_len
    n = 2 * world_size * c  # the same sequence in both layouts: zigzag chunks of c, contiguous of 2c
    work = {layout: np.array([[RingSchedule(world_size, layout, True).visible_pairs(r, t, n // dist.chunk_count(layout, world_size))
                               for t in range(world_size)] for r in range(world_size)]) for layout in dist.LAYOUTS}
    zigzag, contiguous = work["zigzag"], work["contiguous"]
    assert (zigzag.max(axis=0) - zigzag.min(axis=0) <= c * c).all()
    assert zigzag.sum(axis=1).max() - zigzag.sum(axis=1).min() <= c * c
    assert zigzag.sum() == contiguous.sum() == n * (n + 1) // 2  # all of the causal triangle, no more
    assert (contiguous.max(axis=0) - contiguous.min(axis=0) > c * c).any()  # steps where some ranks idle
    assert contiguous.sum(axis=1).max() - contiguous.sum(axis=1).min() == (world_size - 1) * (2 * c) ** 2


def test_ring_runs_the_schedule_calls_and_skips_masked_blocks(monkeypatch):
    """The ring's actual forward calls (recorded per rank): each rank's score count equals the
    schedule's, equal across ranks for zigzag, and the causal triangle in total."""
    import numba_flash.distributed.ring as ring_module

    done = {}

    def counting_forward(q, k, v, **kw):
        n_q, n_k = q.shape[2], k.shape[2]
        pairs = sum(min(n_k, max(0, i + 1 + n_k - n_q)) for i in range(n_q)) if kw["causal"] else n_q * n_k
        rank = threading.current_thread().name
        done[rank] = done.get(rank, 0) + pairs
        return forward(q, k, v, **kw)

    monkeypatch.setattr(ring_module, "forward", counting_forward)
    world_size, c = 3, 2
    rng = np.random.default_rng(2)
    q, k, v = random_qkv(rng, 1, 1, 1, 2 * world_size * c, 2 * world_size * c, 4, "float32")
    o, lse, _ = run_ring(q, k, v, world_size, "zigzag", True)
    assert_matches_reference(o, lse, q, k, v, True)
    schedule = RingSchedule(world_size, "zigzag", True)
    expected = {f"ring-rank-{r}": sum(schedule.visible_pairs(r, t, c) for t in range(world_size)) for r in range(world_size)}
    assert done == expected
    assert len(set(done.values())) == 1
    n = q.shape[2]
    assert sum(done.values()) == n * (n + 1) // 2


# --------------------------------------------------------------------------- layouts


def test_zigzag_pairs_opposite_chunks():
    x = np.arange(8).reshape(1, 1, 8)
    shards = dist.split_sequence(x, 2, "zigzag")
    assert [s[0, 0].tolist() for s in shards] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [s[0, 0].tolist() for s in dist.split_sequence(x, 2, "contiguous")] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dist.shard_chunks("zigzag", 1, 4) == (1, 6)


@settings(max_examples=examples(20), deadline=None)
@given(
    world_size=st.integers(1, 6),
    chunk_len=st.integers(1, 4),
    layout=st.sampled_from(dist.LAYOUTS),
    with_head_dim=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_split_then_gather_is_the_identity(world_size, chunk_len, layout, with_head_dim, seed):
    rng = np.random.default_rng(seed)
    n = dist.chunk_count(layout, world_size) * chunk_len
    x = rng.standard_normal((2, 3, n, 5) if with_head_dim else (2, 3, n))
    shards = dist.split_sequence(x, world_size, layout)
    assert len(shards) == world_size and all(s.shape[2] == n // world_size for s in shards)
    assert np.array_equal(dist.gather_sequence(shards, layout), x)
    again = dist.split_sequence(dist.gather_sequence(shards, layout), world_size, layout)
    assert all(np.array_equal(a, b) for a, b in zip(again, shards))
    positions = np.concatenate([dist.split_sequence(np.arange(n).reshape(1, 1, n), world_size, layout)[r][0, 0]
                                for r in range(world_size)])
    assert sorted(positions.tolist()) == list(range(n))  # every position on exactly one rank


def test_split_rejects_a_sequence_that_does_not_cut_into_chunks():
    with pytest.raises(ValueError, match="4 equal chunks"):
        dist.split_sequence(np.zeros((1, 1, 6, 2)), 2, "zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        dist.split_sequence(np.zeros((1, 1, 6, 2)), 2, "striped")


# --------------------------------------------------------------------------- the merge of partials


@pytest.mark.parametrize("merge", ["host", "device"])
def test_a_partial_that_sees_no_key_is_the_merge_identity(merge):
    """A real fully masked partial (causal, Nq > Nk: rows 0-3 see no key) merged into a running
    result: those rows stay o = 0, lse = -inf, never NaN; merged with a second partial, they take
    the second one's values and the other rows equal the two merged by online.combine."""
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, 1, 1, 1, 6, 2, 4, "float32")
    masked_o, masked_lse = forward(q, k, v, causal=True, **TILES)
    assert np.isneginf(masked_lse[0, 0, :4]).all() and (masked_o[0, 0, :4] == 0).all()

    fresh_o, fresh_lse = RunningResult(q, merge).result()
    assert (fresh_o == 0).all() and np.isneginf(fresh_lse).all()

    running = RunningResult(q, merge)
    running.add(slice(0, 6), masked_o, masked_lse)
    o, lse = running.result()
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    assert (o[0, 0, :4] == 0).all() and np.isneginf(lse[0, 0, :4]).all()
    np.testing.assert_allclose(o[0, 0, 4:], masked_o[0, 0, 4:], rtol=1e-6, atol=1e-7)

    _, k2, v2 = random_qkv(rng, 1, 1, 1, 1, 3, 4, "float32")
    other_o, other_lse = forward(q, k2, v2, causal=False, **TILES)
    running.add(slice(0, 6), other_o, other_lse)
    o, lse = running.result()
    np.testing.assert_allclose(o[0, 0, :4], other_o[0, 0, :4], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(lse[0, 0, :4], other_lse[0, 0, :4], rtol=1e-6)
    # rows 4-5 saw keys of both partials: attention over the union of the keys they see
    for i in (4, 5):
        keys = np.concatenate([k[0, 0, : i - 3], k2[0, 0]]).astype(np.float64)
        values = np.concatenate([v[0, 0, : i - 3], v2[0, 0]]).astype(np.float64)
        s = keys @ q[0, 0, i].astype(np.float64) / 2.0  # scale 1/sqrt(4)
        w = np.exp(s - s.max())
        np.testing.assert_allclose(o[0, 0, i], w @ values / w.sum(), rtol=2e-6, atol=1e-6)
        np.testing.assert_allclose(lse[0, 0, i], s.max() + np.log(w.sum()), rtol=1e-6)


# --------------------------------------------------------------------------- transport and errors


def test_a_rank_with_other_shapes_stops_the_ring_with_an_error():
    q = np.ones((1, 1, 4, 4), np.float32)
    small = q[:, :, :2]
    with pytest.raises(ValueError, match="every rank must pass the same shapes"):
        LocalRing(2).run(dist.ring_attention, [small, q], [small, q], [small, q], **TILES)


def test_bad_shards_are_refused_before_any_shift():
    ring = LocalRing(2)
    odd = np.ones((1, 1, 3, 4), np.float32)
    with pytest.raises(ValueError, match="zigzag shard holds 2 equal chunks"):
        ring.run(dist.ring_attention, [odd, odd], [odd, odd], [odd, odd], causal=True, **TILES)
    q, k = np.ones((1, 1, 2, 4), np.float32), np.ones((1, 1, 4, 4), np.float32)
    with pytest.raises(ValueError, match="n_q == n_k"):
        ring.run(dist.ring_attention, [q, q], [k, k], [k, k], causal=True, **TILES)
    with pytest.raises(TypeError, match="unexpected keyword"):
        ring.run(dist.ring_attention, [q, q], [q, q], [q, q], kv_tile_order=[0])
    assert ring.transfers == []


def test_a_local_ring_member_shifts_only_inside_run():
    member = LocalRing(2).communicator(0)
    assert isinstance(member, dist.RingCommunicator)
    with pytest.raises(RuntimeError, match="inside LocalRing.run"):
        member.ring_shift(np.zeros(1))
