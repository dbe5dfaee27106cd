"""Ring attention over NCCL on two GPUs (``pytest -m gpu``; skipped in the simulator, without torch or
NCCL, or with fewer than two GPUs).

One pair of processes (``torch.multiprocessing``, NCCL rendezvous on a free local TCP port) runs
every case once, so that each kernel compiles once per process, and rank 0 writes each case's
verdict to a file; each test then reads its case's verdict. Each case: the whole sequence drawn
on rank 0 and broadcast, split (zigzag when causal, contiguous otherwise, or the case's layout),
``ring_attention`` on both ranks, o and lse gathered on rank 0 and checked against float64 on
every row (``numba_flash.distributed.verify``: float32 relative error < 1e-5, float16 at most twice
a plain float16 implementation's error, lse within 1e-4 (1 + |lse|)) and against
``numba_flash.attention`` on one GPU (float32: relative error < 1e-5); the caller's shards must
come back unwritten. Cases: causal and not, GQA, float32 and float16, odd shard lengths, strided
shards, CuPy arrays, a ``torch.distributed`` process group as ``group``, a ``TorchRing`` kept
across calls on a non-default stream with its timeline.
"""

from __future__ import annotations

import datetime
import json
import socket
import time
import traceback

import pytest

pytestmark = pytest.mark.gpu

WORLD_SIZE = 2
DEADLINE_S = 420  # both ranks, every case, compilation included

CASES = {
    "float32 non-causal, odd strided shards": dict(batch=2, heads=4, kv_heads=4, seq=2002, head_dim=64, dtype="float32",
                                                   causal=False),
    "float32 causal GQA 8/2": dict(batch=1, heads=8, kv_heads=2, seq=2004, head_dim=64, dtype="float32", causal=True),
    "float32 causal, contiguous layout": dict(batch=1, heads=2, kv_heads=2, seq=1024, head_dim=64, dtype="float32",
                                              causal=True, layout="contiguous"),
    "float16 causal": dict(batch=1, heads=8, kv_heads=8, seq=4096, head_dim=128, dtype="float16", causal=True),
    "float16 non-causal GQA 16/4": dict(batch=1, heads=16, kv_heads=4, seq=4094, head_dim=128, dtype="float16",
                                        causal=False),
    "float16 causal, CuPy arrays": dict(batch=1, heads=4, kv_heads=4, seq=2048, head_dim=128, dtype="float16", causal=True,
                                        arrays="cupy"),
    "float16 causal, a process group": dict(batch=1, heads=4, kv_heads=2, seq=2048, head_dim=128, dtype="float16",
                                            causal=True, group="process group"),
    "float16 causal, kept TorchRing on a side stream": dict(batch=1, heads=4, kv_heads=4, seq=4096, head_dim=128,
                                                            dtype="float16", causal=True, group="kept", calls=3),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    torch = pytest.importorskip("torch", reason="the NCCL transport needs torch")
    if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
        pytest.skip("this torch has no NCCL backend")
    if torch.cuda.device_count() < WORLD_SIZE:
        pytest.skip(f"needs {WORLD_SIZE} GPUs; this machine has {torch.cuda.device_count()}")
    path = tmp_path_factory.mktemp("ring") / "verdicts.json"
    context = torch.multiprocessing.spawn(_rank_main, args=(_free_port(), str(path)), nprocs=WORLD_SIZE, join=False)
    deadline = time.monotonic() + DEADLINE_S
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.terminate()
            pytest.fail(f"the two ranks did not finish within {DEADLINE_S} s (a hang in NCCL?)")
    return json.loads(path.read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_ring_over_nccl_equals_attention_on_one_gpu(verdicts, case):
    verdict = verdicts[case]
    print(f"{case}: {verdict['detail']}")  # shown with pytest -s (scripts/ring_check.sh)
    assert verdict["ok"], verdict["detail"]


# --------------------------------------------------------------------------- in each spawned rank


def _rank_main(rank: int, port: int, path: str) -> None:
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE,
                            device_id=device, timeout=datetime.timedelta(seconds=DEADLINE_S))
    verdicts = {}
    try:
        for name, case in CASES.items():
            try:
                verdict = _run_case(case, rank, device, torch, dist)
            except Exception:  # recorded; a rank that stopped before a collective leaves the other to the deadline
                verdict = dict(ok=False, detail=f"rank {rank}: " + traceback.format_exc()[-3000:])
            both = [None] * WORLD_SIZE
            dist.all_gather_object(both, verdict)
            verdicts[name] = dict(ok=all(v["ok"] for v in both), detail="; ".join(v["detail"] for v in both if v["detail"]))
        if rank == 0:
            with open(path, "w") as f:
                json.dump(verdicts, f)
    finally:
        dist.destroy_process_group()


def _run_case(case: dict, rank: int, device, torch, dist) -> dict:
    import numba_flash
    from numba_flash.distributed import TorchRing, default_layout, gather_sequence, ring_attention, split_sequence, verify

    B, H, Hkv, N, D = (case[key] for key in ("batch", "heads", "kv_heads", "seq", "head_dim"))
    dtype, causal = getattr(torch, case["dtype"]), case["causal"]
    layout = case.get("layout") or default_layout(causal)
    q = torch.empty(B, H, N, D, dtype=dtype, device=device)
    k, v = (torch.empty(B, Hkv, N, D, dtype=dtype, device=device) for _ in range(2))
    if rank == 0:
        generator = torch.Generator(device=device).manual_seed(N)
        for x in (q, k, v):
            x.copy_(torch.randn(x.shape, generator=generator, device=device))
    for x in (q, k, v):
        dist.broadcast(x, src=0)
    shards = [split_sequence(x, WORLD_SIZE, layout)[rank] for x in (q, k, v)]  # contiguous layout, B > 1: strided
    before = [s.clone() for s in shards]
    group = None  # torch.distributed's default group
    if case.get("group") == "process group":
        group = dist.new_group(list(range(WORLD_SIZE)))
    elif case.get("group") == "kept":
        group = TorchRing(timeline=True)
    problems, notes = [], []  # no assert before the gather below: a rank that stopped would leave the other waiting
    if case.get("arrays") == "cupy":
        import cupy

        cupy.cuda.Device(rank).use()
        o, lse = ring_attention(*(cupy.from_dlpack(s) for s in shards), causal=causal, layout=layout, group=group)
        if not (type(o).__module__.startswith("cupy") and type(lse).__module__.startswith("cupy")):
            problems.append(f"CuPy inputs gave {type(o)} and {type(lse)}")
        o, lse = torch.from_dlpack(o), torch.from_dlpack(lse)
    elif case.get("group") == "kept":
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(case["calls"]):
                o, lse = ring_attention(*shards, causal=causal, layout=layout, group=group)
        torch.cuda.current_stream(device).wait_stream(side)
        steps = group.step_times()
        if len(steps) != case["calls"] * (WORLD_SIZE - 1):
            problems.append(f"{len(steps)} steps recorded")
        if not all(s.compute_ms > 0 and s.transfer_ms >= 0 and s.exposed_ms >= 0 for s in steps):
            problems.append(f"odd step times {steps}")
        if group.slots.allocations > 2:
            problems.append(f"{group.slots.allocations} receive slots allocated")
        notes.append("steps: " + "; ".join(f"attention {s.compute_ms:.3f} ms, transfer {s.transfer_ms:.3f} ms, "
                                           f"exposed {s.exposed_ms:.3f} ms" for s in steps))
    else:
        o, lse = ring_attention(*shards, causal=causal, layout=layout, group=group)
    unwritten = all(torch.equal(a, b) for a, b in zip(shards, before))
    parts = {name: [torch.empty_like(x) for _ in range(WORLD_SIZE)] for name, x in (("o", o), ("lse", lse))}
    dist.all_gather(parts["o"], o.contiguous())
    dist.all_gather(parts["lse"], lse.contiguous())
    if not unwritten:
        problems.append(f"rank {rank} wrote its input shards")
    if rank != 0:
        return dict(ok=not problems, detail="; ".join(problems))
    o_ring, lse_ring = gather_sequence(parts["o"], layout), gather_sequence(parts["lse"], layout)
    o_one, lse_one = numba_flash.attention(q, k, v, causal=causal, return_lse=True)
    rows, pairs = list(range(N)), [(b, h) for b in range(B) for h in range(H)]
    errors = verify.errors_against_float64({"ring": (o_ring, lse_ring), "one GPU": (o_one, lse_one)}, q, k, v, causal,
                                           rows, pairs)
    ok, rule = verify.passes(errors, "ring", case["dtype"])
    rel = verify.relative_error(o_ring, o_one)
    if case["dtype"] == "float32":
        ok &= rel < verify.FLOAT32_REL_TOL
    ok &= not problems
    detail = (f"{rule}; one GPU: {verify.passes(errors, 'one GPU', case['dtype'])[1]}; ring vs one GPU relative error "
              f"{rel:.2e}" + "".join(f"; {n}" for n in problems + notes))
    return dict(ok=bool(ok), detail=detail)
