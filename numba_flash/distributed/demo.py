"""Ring attention on N GPUs, checked against one GPU and timed: run it with ``torchrun``.

    torchrun --nproc-per-node 2 -m numba_flash.distributed.demo \\
        --batch 1 --heads 16 --head-dim 128 --dtype float16 --seq 262144 --causal --repeats 3

Each rank is one process on one GPU (``LOCAL_RANK``), NCCL through torch.distributed's default
process group:

1. rank 0 draws the whole sequence's q, k, v (standard normal from ``--seed``) on its GPU and
   broadcasts them; every rank keeps its shard (``split_sequence``; zigzag when causal,
   contiguous otherwise, or ``--layout``);
2. ``ring_attention`` runs once (it compiles) and the shards of o and lse are gathered on rank 0,
   which runs ``numba_flash.attention`` on the whole sequence and checks both against float64 on
   rows spread over the sequence (``verify.py``: float32 relative error < 1e-5, 16-bit at most
   twice a plain 16-bit implementation's error), and the ring against the one GPU;
3. the ring is timed (CUDA events; warm-up; a barrier before each repeat; a repeat lasts as long
   as its slowest rank; the median), then one more ring call records each step's timeline
   (``TorchRing(timeline=True)``): the attention, the transfer, and the wait the transfer left
   exposed on the compute stream; then the one-GPU call on rank 0, timed the same way;
4. rank 0 prints the table on stdout (progress goes to stderr) and ``--json PATH`` writes every
   figure. The exit status is 1 when a check fails.

FLOPs: ``4 B H N^2 D``, halved for causal (``research.profiling.timing.attention_flops``), the
same for the ring (all ranks together) and the one GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

from numba_flash.distributed.layout import LAYOUTS, chunk_count, default_layout, gather_sequence, split_sequence
from numba_flash.distributed.schedule import RingSchedule
from numba_flash.research.cli import HelpFormatter, positive_int
from numba_flash.research.profiling.timing import attention_flops, tflops
from numba_flash.research.report import markdown_table
from numba_flash.tile_table import MAX_HEAD_DIM

DTYPES = ("float16", "float32")  # what verify.py checks (bfloat16: no CuPy dtype for its float64 check)
NCCL_PRIORITY_VARIABLE = "TORCH_NCCL_HIGH_PRIORITY"  # 1: ProcessGroupNCCL makes its streams high-priority
PRECISIONS = ("default", "ieee", "tf32", "tf32x3")


def parse_args(argv=None) -> argparse.Namespace:
    """The demo's flags (``--help`` lists them)."""
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m numba_flash.distributed.demo",
        description="Ring attention (numba_flash.distributed.ring_attention) over NCCL on every GPU that "
                    "torchrun starts, checked against numba_flash.attention on one GPU and float64, and timed.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--batch", type=positive_int, default=1, metavar="B", help="batch size")
    parser.add_argument("--heads", type=positive_int, default=16, metavar="H", help="query heads")
    parser.add_argument("--kv-heads", type=positive_int, metavar="HKV",
                        help="K/V heads, a divisor of --heads (GQA) (default: --heads)")
    parser.add_argument("--seq", type=positive_int, default=16384, metavar="N",
                        help="the whole sequence's length, a multiple of the layout's chunk count (ranks, twice that for zigzag)")
    parser.add_argument("--head-dim", type=positive_int, default=128, metavar="D", help="head dimension, 1 to 256")
    parser.add_argument("--dtype", choices=DTYPES, default="float16", help="input and output dtype")
    parser.add_argument("--precision", choices=PRECISIONS, default="default",
                        help="where the products run (as numba-flash compare): default = tensor cores for 16-bit dtypes, "
                             "CUDA cores for float32")
    parser.add_argument("--causal", action="store_true", help="causal mask by global position")
    parser.add_argument("--layout", choices=LAYOUTS, help="shard layout (default: zigzag when causal, else contiguous)")
    parser.add_argument("--repeats", type=positive_int, default=5,
                        help="timed calls of the ring and of the one GPU (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls before timing (after the first, checked call)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    parser.add_argument("--check-rows", type=positive_int, default=512, metavar="ROWS",
                        help="query rows checked against float64, spread over the sequence (every row when N is smaller)")
    parser.add_argument("--no-single", action="store_true",
                        help="skip the one-GPU call (for sequences that do not fit one GPU): no speed-up, "
                             "no ring-vs-one-GPU check")
    parser.add_argument("--nccl-priority", choices=("high", "normal"), default="high",
                        help="priority of NCCL's stream (TORCH_NCCL_HIGH_PRIORITY, unless already set): high lets the "
                             "transfer's kernels take SMs while the attention's grid still has blocks waiting")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON here ('-': stdout instead of the table)")
    args = parser.parse_args(argv)
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0; got {args.warmup}")
    if args.kv_heads is None:
        args.kv_heads = args.heads
    return args


def layout_of(args) -> str:
    return args.layout or default_layout(args.causal)


def check_problem(args, world_size: int) -> None:
    """``ValueError`` (the same on every rank) for a problem the ring cannot cut or run."""
    if args.heads % args.kv_heads:
        raise ValueError(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    if args.head_dim > MAX_HEAD_DIM:
        raise ValueError(f"--head-dim must be at most {MAX_HEAD_DIM}; got {args.head_dim}")
    if args.precision in ("tf32", "tf32x3") and args.dtype != "float32":
        raise ValueError(f"--precision {args.precision} is for float32; got --dtype {args.dtype}")
    layout = layout_of(args)
    chunks = chunk_count(layout, world_size)
    if args.seq % chunks:
        lower, upper = args.seq // chunks * chunks, (args.seq // chunks + 1) * chunks
        nearest = f"nearest lengths that do: {lower} and {upper}" if lower else f"the shortest that does: {upper}"
        raise ValueError(f"--seq {args.seq} does not cut into {chunks} equal chunks ({world_size} ranks, {layout} layout); "
                         + nearest)


def rank_work(world_size: int, layout: str, causal: bool, seq: int) -> list[int]:
    """(query, key) score pairs each rank computes over the whole ring (``RingSchedule``)."""
    schedule = RingSchedule(world_size, layout, causal)
    chunk = seq // chunk_count(layout, world_size)
    return [sum(schedule.visible_pairs(r, t, chunk) for t in range(world_size)) for r in range(world_size)]


def shift_bytes(batch: int, kv_heads: int, seq: int, head_dim: int, dtype: str, world_size: int) -> int:
    """Bytes one rank sends per shift: its K and V shards."""
    itemsize = 4 if dtype == "float32" else 2
    return 2 * batch * kv_heads * (seq // world_size) * head_dim * itemsize


def summarize(args, world_size: int, device: str, ring_ms: list[list[float]], single_ms: list[float] | None,
              steps: list[list[dict]], accuracy: dict | None) -> dict:
    """Every figure of the run, from the raw measurements: ``ring_ms[rank][repeat]`` (each rank's
    time of each timed ring call), ``single_ms`` (rank 0's one-GPU calls, or ``None``),
    ``steps[rank]`` (``StepTimes`` as dicts) and rank 0's ``accuracy``."""
    layout = layout_of(args)
    flops = attention_flops(args.batch, args.heads, args.seq, args.seq, args.head_dim, args.causal)
    per_repeat = [max(times) for times in zip(*ring_ms)]  # a ring call ends with its slowest rank
    ring = dict(ms=statistics.median(per_repeat), ms_per_repeat=per_repeat,
                ms_per_rank=[statistics.median(times) for times in ring_ms])
    ring["tflops"] = tflops(flops, ring["ms"])
    ring["tflops_per_gpu"] = ring["tflops"] / world_size
    single = None
    if single_ms:
        single = dict(ms=statistics.median(single_ms), ms_per_repeat=list(single_ms))
        single["tflops"] = tflops(flops, single["ms"])
    work = rank_work(world_size, layout, args.causal, args.seq)
    result = dict(
        world_size=world_size, device=device,
        problem=dict(batch=args.batch, heads=args.heads, kv_heads=args.kv_heads, seq=args.seq, head_dim=args.head_dim,
                     dtype=args.dtype, precision=args.precision, causal=args.causal, layout=layout, seed=args.seed),
        nccl_high_priority=os.environ.get(NCCL_PRIORITY_VARIABLE),
        repeats=args.repeats, warmup=args.warmup, flops=flops,
        shift_bytes=shift_bytes(args.batch, args.kv_heads, args.seq, args.head_dim, args.dtype, world_size),
        ring=ring, single=single,
        time_ratio=ring["ms"] / single["ms"] if single else None,
        speedup=single["ms"] / ring["ms"] if single else None,
        work_per_rank=work, work_imbalance=max(work) / min(work) if min(work) else None,
        steps=[[dict(s, hidden_ms=max(0.0, s["transfer_ms"] - s["exposed_ms"])) for s in rank_steps] for rank_steps in steps],
        accuracy=accuracy,
    )
    result["passed"] = bool(accuracy and accuracy["passed"])
    return result


def format_report(result: dict) -> str:
    """The run as text: the time table (one GPU beside the ring), the checks, the per-step overlap
    and the work per rank."""
    p, R = result["problem"], result["world_size"]
    shape = (f"B{p['batch']} H{p['heads']}/{p['kv_heads']} N{p['seq']} D{p['head_dim']} {p['dtype']}"
             f"{' causal' if p['causal'] else ''}, {p['layout']} layout")
    ring, single = result["ring"], result["single"]
    lines = [f"ring attention on {R} x {result['device']}: {shape}", ""]

    def cells(fmt, one, many):
        return [fmt.format(one) if one is not None else "n/a", fmt.format(many) if many is not None else "n/a"]

    body = [
        ["time (ms, median of %d)" % result["repeats"], *cells("{:.3f}", single and single["ms"], ring["ms"])],
        ["TFLOP/s", *cells("{:.1f}", single and single["tflops"], ring["tflops"])],
        ["TFLOP/s per GPU", *cells("{:.1f}", single and single["tflops"], ring["tflops_per_gpu"])],
        ["time / one GPU's", *cells("{:.3f}", 1.0 if single else None, result["time_ratio"])],
        ["speed-up vs one GPU", *cells("{:.2f}x", 1.0 if single else None, result["speedup"])],
    ]
    lines += markdown_table(["", "1 GPU (attention)", f"ring, {R} GPUs"], body)
    lines.append("")
    accuracy = result["accuracy"]
    if accuracy:
        lines.append(f"checks ({'passed' if accuracy['passed'] else 'FAILED'}), against float64 on {accuracy['scope']}:")
        lines += [f"- {line}" for line in accuracy["lines"]]
        lines.append("")
    lines.append(f"per step: each rank sends and receives {result['shift_bytes'] / 1e6:.1f} MB (its K and V shards) "
                 "while it computes; exposed = time the compute stream waited for the transfer")
    step_rows = []
    for rank, rank_steps in enumerate(result["steps"]):
        for s in rank_steps:
            hidden = f"{s['hidden_ms'] / s['transfer_ms']:.0%}" if s["transfer_ms"] > 0 else "n/a"
            step_rows.append([f"rank {rank} step {s['step']}", f"{s['compute_ms']:.3f}", f"{s['transfer_ms']:.3f}",
                              f"{s['exposed_ms']:.3f}", hidden])
    if step_rows:
        header = ["", "attention + merge (ms)", "transfer (ms)", "exposed wait (ms)", "transfer hidden"]
        lines += markdown_table(header, step_rows)
    else:
        lines.append("(one rank: no transfer)")
    lines.append("")
    work = result["work_per_rank"]
    lines.append("work per rank (score pairs, schedule): " + ", ".join(f"{w:,}" for w in work)
                 + (f" (max / min {result['work_imbalance']:.4f})" if result["work_imbalance"] else ""))
    lines.append("ring time per rank (ms, median): " + ", ".join(f"{ms:.3f}" for ms in ring["ms_per_rank"]))
    lines.append(f"{NCCL_PRIORITY_VARIABLE}={result['nccl_high_priority']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the run (torch, NCCL)


class Progress:
    """Lines on stderr from rank 0, with the seconds since the start."""

    def __init__(self, rank: int):
        self.rank = rank
        self.started = time.perf_counter()

    def __call__(self, line: str) -> None:
        if self.rank == 0:
            print(f"[{time.perf_counter() - self.started:7.1f} s] {line}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    from numba_flash.distributed.torch_ring import require_torch

    try:
        torch = require_torch()
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    dist = torch.distributed
    if "LOCAL_RANK" not in os.environ:
        print("run it under torchrun, one process per GPU: torchrun --nproc-per-node 2 -m numba_flash.distributed.demo ...",
              file=sys.stderr)
        return 2
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    os.environ.setdefault(NCCL_PRIORITY_VARIABLE, "1" if args.nccl_priority == "high" else "0")  # read at the group's creation
    dist.init_process_group("nccl", device_id=device)
    try:
        try:
            check_problem(args, dist.get_world_size())
        except ValueError as exc:
            if dist.get_rank() == 0:
                print(f"error: {exc}", file=sys.stderr)
            return 2
        return run(args, torch, dist, device)
    finally:
        dist.destroy_process_group()


def run(args, torch, dist, device) -> int:
    """Steps 1-4 of the module's docstring on this rank; the exit status."""
    import numba_flash
    from numba_flash.distributed.ring import ring_attention
    from numba_flash.distributed.torch_ring import TorchRing

    rank, world = dist.get_rank(), dist.get_world_size()
    say = Progress(rank)
    layout = layout_of(args)
    say(f"{world} ranks, {layout} layout: drawing q, k, v (seed {args.seed}) on rank 0 and broadcasting ...")
    q, k, v = _whole_inputs(args, device, torch, dist)
    shards = [split_sequence(x, world, layout)[rank].contiguous() for x in (q, k, v)]
    if rank != 0:
        q = k = v = None  # only rank 0 runs the whole sequence
    options = dict(causal=args.causal, precision=None if args.precision == "default" else args.precision)
    ring = TorchRing()  # kept across calls: its receive slots and stream are reused

    def ring_call(group=ring):
        return ring_attention(*shards, layout=layout, group=group, **options)

    say("ring attention: first call (compiles the kernels) ...")
    o_shard, lse_shard = ring_call()
    o_ring = gather_sequence(_all_gather(o_shard, torch, dist), layout)
    lse_ring = gather_sequence(_all_gather(lse_shard, torch, dist), layout)
    del o_shard, lse_shard
    accuracy, single_o, single_lse = None, None, None
    if rank == 0:
        if not args.no_single:
            say("one GPU: numba_flash.attention on the whole sequence (compiles) ...")
            single_o, single_lse = numba_flash.attention(q, k, v, return_lse=True, **options)
        say("checking against float64 ...")
        accuracy = check_accuracy(args, q, k, v, (o_ring, lse_ring), None if args.no_single else (single_o, single_lse))
        say(f"checks {'passed' if accuracy['passed'] else 'FAILED'}")
    del o_ring, lse_ring, single_o, single_lse
    dist.barrier()

    say(f"timing the ring: {args.warmup} warm-up, {args.repeats} timed calls ...")
    ring_ms = _time_calls(ring_call, args.warmup, args.repeats, torch, dist.barrier)
    say("one more ring call, recording each step's timeline ...")
    recorder = TorchRing(timeline=True)
    ring_call(recorder)
    steps = [dataclasses.asdict(s) for s in recorder.step_times()]
    single_ms = None
    if rank == 0 and not args.no_single:
        say(f"timing one GPU: {args.warmup} warm-up, {args.repeats} timed calls ...")
        single_ms = _time_calls(lambda: numba_flash.attention(q, k, v, **options), args.warmup, args.repeats, torch)
    dist.barrier()
    gathered = [None] * world
    dist.all_gather_object(gathered, dict(ring_ms=ring_ms, steps=steps))
    passed = [None]
    if rank == 0:
        result = summarize(args, world, torch.cuda.get_device_name(device), [g["ring_ms"] for g in gathered], single_ms,
                           [g["steps"] for g in gathered], accuracy)
        if args.json == "-":
            print(json.dumps(result, indent=2))
        else:
            print(format_report(result), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(result, f, indent=2)
                say(f"wrote {args.json}")
        passed = [result["passed"]]
    dist.broadcast_object_list(passed, src=0)
    return 0 if passed[0] else 1


def check_accuracy(args, q, k, v, ring_out, single_out) -> dict:
    """Rank 0's checks of the gathered ring output (and the one GPU's) against float64 on
    ``verify``'s rows, and of the ring against the one GPU: ``passed``, the scope, the figures,
    and a line of words per check."""
    from numba_flash.distributed import verify

    rows = verify.check_rows(args.seq, args.check_rows)
    pairs = verify.check_heads(args.batch, args.heads)
    outputs = {"ring": ring_out}
    if single_out is not None:
        outputs["one GPU"] = single_out
    errors = verify.errors_against_float64(outputs, q, k, v, args.causal, rows, pairs)
    passed, rule = verify.passes(errors, "ring", args.dtype)
    lines = [f"ring: {rule}"]
    accuracy = dict(scope=verify.scope_label(args.seq, rows, pairs, args.batch, args.heads), errors=errors)
    if single_out is not None:
        lines.append(f"one GPU: {verify.passes(errors, 'one GPU', args.dtype)[1]}")
        rel = verify.relative_error(ring_out[0], single_out[0])
        lse_diff = float((ring_out[1] - single_out[1]).abs().max())
        accuracy.update(ring_vs_one_gpu_rel=rel, ring_vs_one_gpu_lse_max_abs=lse_diff)
        line = f"ring against one GPU, whole output: relative error {rel:.2e}, max |lse difference| {lse_diff:.1e}"
        if args.dtype == "float32":
            passed &= rel < verify.FLOAT32_REL_TOL
            line += f" ({'<' if rel < verify.FLOAT32_REL_TOL else '>='} {verify.FLOAT32_REL_TOL:g})"
        lines.append(line)
    accuracy.update(passed=bool(passed), lines=lines)
    return accuracy


def _whole_inputs(args, device, torch, dist):
    """q, k, v of the whole sequence on every rank: drawn on rank 0 (standard normal, float32,
    then the dtype), broadcast."""
    dtype = getattr(torch, args.dtype)
    shapes = [(args.batch, args.heads, args.seq, args.head_dim)] + [(args.batch, args.kv_heads, args.seq, args.head_dim)] * 2
    arrays = [torch.empty(shape, dtype=dtype, device=device) for shape in shapes]
    if dist.get_rank() == 0:
        generator = torch.Generator(device=device).manual_seed(args.seed)
        for x in arrays:
            x.copy_(torch.randn(x.shape, generator=generator, device=device, dtype=torch.float32))
    for x in arrays:
        dist.broadcast(x, src=0)
    return arrays


def _all_gather(x, torch, dist) -> list:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return parts


def _time_calls(fn, warmup: int, repeats: int, torch, barrier=None) -> list[float]:
    """Milliseconds of each of ``repeats`` calls of ``fn`` (CUDA events on the current stream),
    after ``warmup`` untimed ones; before each, ``barrier()`` (every rank starts together) and a
    device synchronisation (nothing else queued)."""
    for _ in range(warmup):
        fn()
    stream = torch.cuda.current_stream()
    times = []
    for _ in range(repeats):
        if barrier is not None:
            barrier()
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        stop.record(stream)
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return times


if __name__ == "__main__":
    sys.exit(main())
