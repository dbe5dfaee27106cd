"""Ring attention's transports without GPUs or torch: the receive slots (double buffering), the
choice of transport for ``group``, ``TorchRing``'s stream ordering against a fake
torch.distributed (``fake_nccl``), and the demo's arithmetic and report.

The claims under test: a rank never receives into the shard it is sending or into the caller's
arrays, with two slots for any number of steps, and a ring with one slot reads a shard still in
flight (the check can fail); ``group=None`` and process groups become the NCCL transport, which
says what is missing (torch, ``init_process_group``, an NCCL backend) and refuses anything else;
``TorchRing`` posts each step's sends to ``rank + 1`` and receives from ``rank - 1`` as one group
on its comm stream only after that stream waited for the compute stream, and makes the compute
stream wait for the transfer before returning the received shard; the demo refuses sequences its
layout cannot cut, finds zigzag's work equal per rank, and reports a ring call as long as its
slowest rank.
"""

from __future__ import annotations

import sys

import fake_nccl
import numpy as np
import pytest
from helpers import plain_fp16_attention, random_qkv

from numba_flash import distributed as dist
from numba_flash import reference
from numba_flash.distributed import LocalRing, TorchRing, buffers, demo, verify
from numba_flash.distributed.torch_ring import NO_TORCH, NOT_INITIALIZED

TILES = dict(block_m=4, block_n=4)


# --------------------------------------------------------------------------- receive slots


def test_receive_slots_alternate_and_never_take_what_is_sent():
    slots = buffers.ReceiveSlots()
    own = (np.zeros((2, 3)), np.zeros((2, 3)))
    held, seen = own, []
    for _ in range(6):  # the ring loop: send what is held, hold what arrives
        received = slots.take(held)
        assert not any(np.shares_memory(r, h) for r in received for h in held)
        assert not any(np.shares_memory(r, o) for r in received for o in own)  # the caller's k, v stay unwritten
        seen.append(received)
        held = received
    assert slots.allocations == 2
    assert seen[0] is seen[2] is seen[4] and seen[1] is seen[3] is seen[5] and seen[0] is not seen[1]
    assert slots.take(seen[0]) is seen[1] and slots.take(seen[1]) is seen[0]  # sending a slot: the other one
    assert slots.take((seen[1][0][:], seen[1][1][:])) is seen[0]  # a view of a slot counts as the slot
    bigger = slots.take((np.zeros((4, 3)), np.zeros((4, 3))))
    assert bigger[0].shape == (4, 3) and slots.allocations == 3  # new shapes: that slot is reallocated


def test_a_ring_with_one_receive_slot_reads_a_shard_in_flight(monkeypatch):
    """LocalRing writes NaN into a receive slot while its shift is in flight, as a wire may: with a
    single slot, step 1 receives into the shard it computes with, and the result is wrong. (Three
    ranks: two shifts; the two-slot ring passes the same check in tests/distributed/test_ring.py.)"""
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, 1, 1, 1, 6, 6, 4, "float32")

    def run():
        shards = [dist.split_sequence(x, 3, "contiguous") for x in (q, k, v)]
        results = LocalRing(3).run(dist.ring_attention, *shards, causal=False, **TILES)
        return dist.gather_sequence([o for o, _ in results], "contiguous")

    ref, _ = reference.attention(q, k, v)
    assert np.abs(run() - ref).max() < 1e-5
    monkeypatch.setattr(buffers.ReceiveSlots, "take", lambda self, sending: self.__dict__.setdefault(
        "only", tuple(np.empty_like(x) for x in sending)))
    assert np.isnan(run()).any()


def test_local_ring_reads_the_sent_arrays_late():
    """Writing an array between ring_shift and wait changes what the neighbour gets (so the
    protocol's 'do not write until wait()' is what the fake enforces too); the slot returned is
    not the array sent."""

    def shift_then_write(x, group):
        pending = group.ring_shift(x)
        x[...] = -1  # breaks the protocol on purpose
        (got,) = pending.wait()
        return got.copy(), got is x

    ring = LocalRing(2)
    results = ring.run(shift_then_write, [np.zeros(3), np.ones(3)])
    assert [r[0].tolist() for r in results] == [[-1, -1, -1]] * 2
    assert not any(r[1] for r in results)


# --------------------------------------------------------------------------- choosing the transport


def test_group_none_without_torch_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    q = np.zeros((1, 1, 4, 4), np.float32)
    with pytest.raises(RuntimeError, match="torch is not installed") as info:
        dist.ring_attention(q, q, q)
    assert str(info.value) == NO_TORCH and "LocalRing" in NO_TORCH


def test_anything_else_as_group_is_refused():
    q = np.zeros((1, 1, 4, 4), np.float32)

    class ProcessGroupLookalike:  # not torch's, no ring_shift
        rank, world_size = 0, 2

    with pytest.raises(TypeError, match="ProcessGroupLookalike; ring_attention takes as group: None"):
        dist.ring_attention(q, q, q, group=ProcessGroupLookalike())


def test_group_none_and_process_groups_become_the_nccl_ring(monkeypatch):
    nccl = fake_nccl.install(monkeypatch, rank=1, world_size=3)
    ring = dist.as_communicator(None)
    assert isinstance(ring, TorchRing) and isinstance(ring, dist.RingCommunicator)
    assert (ring.rank, ring.world_size, ring.next_peer, ring.previous_peer) == (1, 3, 2, 0)
    group = fake_nccl.ProcessGroup(members=[4, 6, 7, 9], rank=0)  # global ranks of a subgroup
    ring = dist.as_communicator(group)
    assert ring.group is group and (ring.rank, ring.world_size, ring.next_peer, ring.previous_peer) == (0, 4, 6, 9)
    assert dist.as_communicator(ring) is ring  # a ring communicator is taken as it is
    assert nccl.log == []  # nothing posted by making one


@pytest.mark.parametrize("state, group, error, message", [
    (dict(initialized=False), None, RuntimeError, "not initialised"),
    (dict(backend="gloo"), None, ValueError, "needs an NCCL process group.*'gloo'"),
    ({}, fake_nccl.ProcessGroup(members=[0, 1], rank=-1), ValueError, "not a member"),
])
def test_the_nccl_ring_refuses_groups_it_cannot_use(monkeypatch, state, group, error, message):
    fake_nccl.install(monkeypatch, **state)
    with pytest.raises(error, match=message):
        TorchRing(group)
    assert "torchrun" in NOT_INITIALIZED


# --------------------------------------------------------------------------- TorchRing's stream order


def sketch(log):
    """The log with each posted group's operations left out (checked apart)."""
    return [entry[:2] if entry[0] == "post" else entry for entry in log]


def run_shifts(ring, nccl, held, steps):
    """The ring loop's use of the transport (ring.py): shift, queue attention, wait."""
    received = []
    for _ in range(steps):
        pending = ring.ring_shift(*held)
        nccl.log.append(("attention", nccl.current().name))
        held = pending.wait()
        received.append(held)
    return received


def test_torch_ring_orders_streams_around_each_transfer(monkeypatch):
    nccl = fake_nccl.install(monkeypatch, rank=2, world_size=4)
    ring = TorchRing()
    k, v = fake_nccl.tensor((1, 2, 8, 16)), fake_nccl.tensor((1, 2, 8, 16))
    received = run_shifts(ring, nccl, (k, v), 3)
    comm = nccl.posts()[0][0]
    assert comm.startswith("comm") and nccl.current() is nccl.compute  # the caller's stream is current again
    step = [("wait_stream", comm, "compute"), ("post", comm), ("attention", "compute"),
            ("work.wait", comm), ("wait_stream", "compute", comm)]
    assert sketch(nccl.log) == step * 3
    held = (k, v)
    for (stream, ops), got in zip(nccl.posts(), received):
        assert [(name, peer) for name, _, peer in ops] == [("isend", 3), ("isend", 3), ("irecv", 1), ("irecv", 1)]
        assert [t for _, t, _ in ops] == [*held, *got]  # sends what it holds, receives what wait() returns
        assert not {id(t) for t in got} & {id(t) for t in held}  # never into the shard being sent
        assert all(t.is_contiguous() and t.shape == k.shape and t.dtype == k.dtype for t in got)
        held = got
    assert received[0] is received[2] and received[0] is not received[1]  # two slots, in turn
    assert not {id(t) for r in received for t in r} & {id(k), id(v)}  # the caller's k, v are only sent


def test_torch_ring_copies_a_strided_shard_on_the_compute_stream_before_sending(monkeypatch):
    nccl = fake_nccl.install(monkeypatch)
    whole = fake_nccl.tensor((2, 2, 8, 16))
    shard = whole[:, :, :4]  # a contiguous-layout shard of a batched sequence: strided
    assert not shard.is_contiguous()
    run_shifts(TorchRing(), nccl, (shard, shard), 1)
    assert sketch(nccl.log[:3]) == [("copy", "compute"), ("copy", "compute"), ("wait_stream", "comm 0", "compute")]
    (_, ops), = nccl.posts()
    assert all(t.is_contiguous() for _, t, _ in ops)


def test_torch_ring_refuses_a_second_shift_before_the_wait_and_numpy_arrays(monkeypatch):
    fake_nccl.install(monkeypatch)
    ring = TorchRing()
    k = fake_nccl.tensor((1, 1, 4, 8))
    pending = ring.ring_shift(k)
    with pytest.raises(RuntimeError, match="before waiting for the previous one"):
        ring.ring_shift(k)
    pending.wait()
    with pytest.raises(RuntimeError, match="already waited"):
        pending.wait()
    with pytest.raises(TypeError, match="torch CUDA tensors or CuPy arrays.*LocalRing"):
        ring.ring_shift(np.zeros(3))


def test_torch_ring_timeline_marks_compute_and_transfer_on_their_streams(monkeypatch):
    nccl = fake_nccl.install(monkeypatch)
    ring = TorchRing(timeline=True)
    k = fake_nccl.tensor((1, 1, 4, 8))
    run_shifts(ring, nccl, (k,), 2)
    comm = nccl.posts()[0][0]
    one_step = [("record", "compute"), ("wait_stream", comm, "compute"), ("record", comm), ("post", comm),
                ("attention", "compute"), ("work.wait", comm), ("record", comm), ("record", "compute"),
                ("wait_stream", "compute", comm), ("record", "compute")]
    assert sketch(nccl.log) == one_step * 2
    times = ring.step_times()
    assert [t.step for t in times] == [0, 1] and ring.step_times() == []
    # the fake's clock ticks once per event: posted 0, transfer start 1, transfer end 2, computed 3, resumed 4
    assert (times[0].compute_ms, times[0].transfer_ms, times[0].exposed_ms, times[0].hidden_ms) == (3.0, 1.0, 1.0, 0.0)
    with pytest.raises(RuntimeError, match="timeline=True"):
        TorchRing().step_times()


def test_cupy_arrays_use_cupys_stream_as_the_compute_stream(monkeypatch):
    from numba_flash.distributed import torch_ring

    nccl = fake_nccl.install(monkeypatch)
    torch = sys.modules["torch"]
    current = type("S", (), {"ptr": 0})()
    cupy = type(sys)("cupy")
    cupy.cuda = type(sys)("cupy.cuda")
    cupy.cuda.get_current_stream = lambda: current
    cupy.cuda.Device = lambda index: __import__("contextlib").nullcontext()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    device = torch.device("cuda", 0)
    assert torch_ring._compute_stream("cupy", device, torch) is nccl.compute  # the null stream: the default one
    current.ptr = 0x1234
    assert torch_ring._compute_stream("cupy", device, torch).name == "external 0x1234"


# --------------------------------------------------------------------------- the demo


def test_demo_flags_and_defaults():
    args = demo.parse_args(["--seq", "4096", "--heads", "16", "--kv-heads", "4", "--dtype", "float32", "--causal",
                            "--repeats", "3", "--json", "out.json"])
    assert (args.seq, args.heads, args.kv_heads, args.dtype, args.causal, args.repeats, args.json) == \
        (4096, 16, 4, "float32", True, 3, "out.json")
    assert demo.layout_of(args) == "zigzag" and demo.layout_of(demo.parse_args([])) == "contiguous"
    assert demo.parse_args([]).kv_heads == 16
    for bad in (["--seq", "0"], ["--warmup", "-1"], ["--dtype", "bfloat16"], ["--layout", "striped"]):
        with pytest.raises(SystemExit):
            demo.parse_args(bad)


@pytest.mark.parametrize("flags, world_size, message", [
    (["--seq", "8190", "--causal"], 2, "8190 does not cut into 4 equal chunks.*8188 and 8192"),
    (["--seq", "4095"], 2, "4095 does not cut into 2 equal chunks.*4094 and 4096"),
    (["--seq", "3", "--causal"], 2, "the shortest that does: 4"),
    (["--heads", "16", "--kv-heads", "5"], 2, "must divide"),
    (["--precision", "tf32"], 2, "is for float32"),
    (["--head-dim", "257"], 2, "at most 256"),
])
def test_demo_refuses_problems_the_ring_cannot_run(flags, world_size, message):
    with pytest.raises(ValueError, match=message):
        demo.check_problem(demo.parse_args(flags), world_size)
    demo.check_problem(demo.parse_args(["--seq", "8188", "--causal"]), 2)  # odd chunks of 2047: fine


def test_zigzag_gives_each_rank_of_the_target_run_the_same_work():
    n = 262144
    zigzag = demo.rank_work(2, "zigzag", True, n)
    assert zigzag[0] == zigzag[1] and sum(zigzag) == n * (n + 1) // 2
    contiguous = demo.rank_work(2, "contiguous", True, n)
    assert contiguous[1] / contiguous[0] > 2.9  # rank 1 does three times rank 0's work
    assert demo.shift_bytes(1, 16, n, 128, "float16", 2) == 2 * 16 * (n // 2) * 128 * 2  # 1.07 GB


def test_demo_report_takes_each_call_at_its_slowest_rank():
    args = demo.parse_args(["--seq", "1024", "--heads", "2", "--causal", "--repeats", "3"])
    steps = [[dict(step=0, compute_ms=4.0, transfer_ms=1.0, exposed_ms=0.25)],
             [dict(step=0, compute_ms=4.5, transfer_ms=2.0, exposed_ms=0.0)]]
    accuracy = dict(passed=True, scope="every row, every head", lines=["ring: relative error 1e-07 < 1e-05"])
    result = demo.summarize(args, 2, "Fake GPU", [[10.0, 12.0, 11.0], [13.0, 9.0, 11.5]], [20.0, 24.0, 22.0], steps,
                            accuracy)
    assert result["ring"]["ms_per_repeat"] == [13.0, 12.0, 11.5] and result["ring"]["ms"] == 12.0
    assert result["ring"]["ms_per_rank"] == [11.0, 11.5]
    assert result["single"]["ms"] == 22.0 and result["speedup"] == pytest.approx(22 / 12)
    assert result["time_ratio"] == pytest.approx(12 / 22) and result["passed"]
    flops = 4 * 2 * 1024 * 1024 * 128 / 2
    assert result["ring"]["tflops"] == pytest.approx(flops / 12e-3 / 1e12)
    assert result["ring"]["tflops_per_gpu"] == pytest.approx(result["ring"]["tflops"] / 2)
    assert [s[0]["hidden_ms"] for s in result["steps"]] == [0.75, 2.0]
    assert result["work_imbalance"] == 1.0
    text = demo.format_report(result)
    assert "ring attention on 2 x Fake GPU: B1 H2/2 N1024 D128 float16 causal, zigzag layout" in text
    assert "| time (ms, median of 3) |            22.000 |       12.000 |" in text
    assert "| speed-up vs one GPU" in text and "1.83x" in text
    assert "| rank 0 step 0 |" in text and "75%" in text and "100%" in text
    assert "checks (passed)" in text
    no_single = demo.summarize(args, 2, "Fake GPU", [[10.0], [11.0]], None, [[], []], None)
    assert no_single["speedup"] is None and not no_single["passed"]
    assert "n/a" in demo.format_report(no_single)


def test_demo_without_torch_or_torchrun_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)
    assert demo.main(["--seq", "64"]) == 2
    assert "torch is not installed" in capsys.readouterr().err
    fake_nccl.install(monkeypatch)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert demo.main(["--seq", "64"]) == 2
    assert "torchrun --nproc-per-node" in capsys.readouterr().err


def test_rows_checked_spread_over_the_whole_sequence():
    assert verify.check_rows(5, 10) == [0, 1, 2, 3, 4]
    rows = verify.check_rows(262144, 512)
    assert len(rows) == 512 and rows[0] == 0 and rows[-1] == 262143 and rows == sorted(set(rows))
    zigzag = dist.split_sequence(np.arange(262144).reshape(1, 1, -1), 2, "zigzag")
    for shard in zigzag:  # every rank's shard, and both chunks of it, hold checked rows
        half = shard.shape[2] // 2
        assert set(rows) & set(shard[0, 0, :half].tolist()) and set(rows) & set(shard[0, 0, half:].tolist())
    assert verify.check_heads(1, 16) == [(0, h) for h in range(16)]
    assert verify.check_heads(2, 16) == [(0, 0), (0, 15), (1, 0), (1, 15)]
    assert verify.scope_label(262144, rows, [(0, 0)], 1, 16) == "512 of 262144 rows (evenly spaced), 1 of 16 (batch, head) pairs"


@pytest.mark.parametrize("causal", [False, True])
def test_the_float64_check_of_rows_matches_the_whole_reference(causal):
    """verify.errors_against_float64 on a subset of rows and heads (GQA) gives the figures of
    reference.attention on the whole sequence restricted to them, its plain float16 rows are
    helpers.plain_fp16_attention's, and its rules pass the reference and fail a worse output."""
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng, 2, 4, 2, 40, 40, 16, "float32")
    ref_o, ref_lse = reference.attention(q, k, v, causal=causal)
    rows, pairs = verify.check_rows(40, 7), [(0, 1), (1, 3)]
    picked = (np.array([b for b, _ in pairs])[:, None], np.array([h for _, h in pairs])[:, None], np.array(rows)[None, :])

    o32 = ref_o.astype(np.float32)
    noisy = o32 + np.float32(1e-3) * rng.standard_normal(o32.shape, dtype=np.float32)
    errors = verify.errors_against_float64({"exact": (o32, ref_lse.astype(np.float32)), "noisy": (noisy, ref_lse + 1e-2)},
                                           q, k, v, causal, rows, pairs)
    assert errors["plain"] is None
    diff = noisy[picked].astype(np.float64) - ref_o[picked]
    assert errors["noisy"]["max_abs"] == pytest.approx(np.abs(diff).max())
    assert errors["noisy"]["rel"] == pytest.approx(np.linalg.norm(diff) / np.linalg.norm(ref_o[picked]))
    assert verify.passes(errors, "exact", "float32")[0] and errors["exact"]["lse_ok"]
    ok, rule = verify.passes(errors, "noisy", "float32")
    assert not ok and not errors["noisy"]["lse_ok"] and ">= 1e-05" in rule

    q16, k16, v16 = (x.astype(np.float16) for x in (q, k, v))
    ref16, _ = reference.attention(q16, k16, v16, causal=causal)
    plain = plain_fp16_attention(q16, k16, v16, causal).astype(np.float64)
    worse = (ref16 + 3 * (plain - ref16)).astype(np.float16)
    errors = verify.errors_against_float64({"good": (ref16.astype(np.float16), None), "worse": (worse, None)},
                                           q16, k16, v16, causal, rows, pairs)
    assert errors["plain"]["max_abs"] == pytest.approx(np.abs(plain[picked] - ref16[picked]).max(), rel=1e-3)
    assert verify.passes(errors, "good", "float16")[0] and not verify.passes(errors, "worse", "float16")[0]
    assert verify.relative_error(o32, ref_o) < 1e-7 < verify.relative_error(noisy, ref_o)
