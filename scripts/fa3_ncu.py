"""What limits fa3: Nsight Compute on one call per configuration (issue 23: "ncu says what limits each").

    python scripts/fa3_ncu.py --out ncu-fa3                       # on a Hopper GPU with ncu and torch
    python scripts/fa3_ncu.py --out ncu-fa3 --configs fp16,softcap50,fp8 --shape 4,16,4096,128

For each configuration (``fp16``, ``bf16``, ``fp8``, ``softcap<C>``, ``alibi``, each optionally
``-causal``) one ncu process profiles one fa3 call after a warm-up (``--profile-from-start off``;
the call framed by ``cudaProfilerStart``/``Stop``), with the sections that say where a kernel's time
goes: speed of light, the pipes' utilization (tensor, FMA, ALU, XU = the MUFU), warp states and the
scheduler's issue rate, and the source counters: per SASS instruction, how often a warp was seen
stalled there and on what. The report is imported back as CSV and summarised:

- ``summary.md`` / ``summary.json``: per configuration, the fa3 kernel's duration, issue-slot use,
  every pipe's utilization, the top stall reasons (share of samples), and the stall samples
  grouped by the instruction's opcode (``MUFU``, ``FFMA``, ``WARPGROUP.DEPBAR``, ``SYNCS``, ...):
  where in the code warps wait;
- the raw CSVs (``<config>.raw.csv``, ``<config>.source.csv``) for a closer look.

Comparing ``fp16`` with ``softcap50`` says what the cap's 64 more ``MUFU.TANH`` and FMULs a tile
cost and where; ``fp16`` with ``fp8``, why e4m3's products at twice the rate do not give twice the
speed. Needs ncu on the PATH (``--ncu``), torch and a Hopper GPU.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import subprocess
import sys

from numba_flash.research.profiling.ncu import csv_rows, parse_ncu_csv

SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "WarpStateStats", "SchedulerStats", "InstructionStats",
            "SourceCounters", "LaunchStats", "Occupancy")
PIPES = {  # raw metric -> label (utilization in % of peak over active cycles)
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active": "tensor",
    "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active": "xu (MUFU)",
    "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active": "fma",
    "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active": "alu",
    "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active": "lsu",
    "sm__pipe_fmaheavy_cycles_active.avg.pct_of_peak_sustained_active": "fmaheavy",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue slots",
}
DURATION = "gpu__time_duration.sum"


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="ncu-fa3", help="folder for the reports, CSVs and summary")
    ap.add_argument("--configs", default="fp16,softcap50,fp8,alibi", help="comma-separated: fp16, bf16, fp8, "
                    "softcapC, alibi, each with an optional -causal")
    ap.add_argument("--shape", default="4,16,4096,128", help="B,H,N,D")
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("--target", help=argparse.SUPPRESS)  # inside ncu: run this configuration
    return ap.parse_args(argv)


def config_call(name: str, shape, torch, numba_flash):
    """The fa3 call of configuration ``name`` on fresh random inputs of ``shape``."""
    B, H, N, D = shape
    causal = name.endswith("-causal")
    base = name[: -len("-causal")] if causal else name
    dtype = torch.bfloat16 if base == "bf16" else torch.float16
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    kwargs = dict(causal=causal, algorithm="fa3")
    if base == "fp8":
        q, k, v = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
    elif base.startswith("softcap"):
        kwargs["softcap"] = float(base[7:])
    elif base == "alibi":
        kwargs["alibi_slopes"] = torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], dtype=torch.float32,
                                              device="cuda")
    elif base not in ("fp16", "bf16"):
        raise SystemExit(f"unknown configuration {name!r}")
    return lambda: numba_flash.attention(q, k, v, **kwargs)


def run_target(name: str, shape) -> None:
    """Inside ncu: warm up (compiles), then one profiled call."""
    import torch

    import numba_flash

    call = config_call(name, shape, torch, numba_flash)
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def number(cell: str) -> float:
    cell = cell.replace(",", "").strip()
    try:
        return float(cell)
    except ValueError:
        return float("nan")


UNIT_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def raw_kernels(text: str):
    """``--page raw --csv``: (kernel name, {metric: value}) per profiled kernel, and the units row
    (``research.profiling.ncu.parse_ncu_csv`` over every column)."""
    units: dict = {}
    return parse_ncu_csv(text, metrics=None, units=units), units


def stall_reasons(metrics: dict, top: int = 8):
    """The warp-stall reasons' shares of the issue-stall samples (``smsp__pcsamp_warps_issue_stalled_*``)."""
    prefix = "smsp__pcsamp_warps_issue_stalled_"
    samples = {k[len(prefix):]: v for k, v in metrics.items() if k.startswith(prefix) and v == v
               and not k.endswith("_not_issued")}
    total = sum(samples.values()) or 1.0
    return [(k, v / total) for k, v in sorted(samples.items(), key=lambda kv: -kv[1])[:top]]


def source_kernels(text: str):
    """``--page source --csv --print-source sass``: per kernel, its name and its instruction rows
    (dicts keyed by the header: ``Source``, ``Warp Stall Sampling (All Samples)``, ``stall_*``, ...)."""
    kernels, header = [], None
    for row in csv_rows(text):
        if row and row[0] == "Kernel Name":
            kernels.append((row[1] if len(row) > 1 else "", []))
            header = None
        elif row and row[0] == "Address":
            header = row
        elif header is not None and len(row) == len(header) and kernels:
            kernels[-1][1].append(dict(zip(header, row)))
    return kernels


def opcode(sass: str) -> str:
    """A SASS line's mnemonic without its predicate and modifiers (``WARPGROUP.*`` and ``SYNCS.*`` kept whole)."""
    m = re.match(r"\s*(@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass)
    if not m:
        return "?"
    op = m.group(2)
    return op if op.startswith(("WARPGROUP", "SYNCS", "MUFU")) else op.split(".")[0]


def source_by_opcode(text: str):
    """Stall samples and instructions executed summed by opcode, for the kernel with most samples."""
    kernels = source_kernels(text)
    if not kernels:
        return {}, {}
    key = "Warp Stall Sampling (All Samples)"
    _, rows = max(kernels, key=lambda k: sum(number(r.get(key, "0")) for r in k[1]))
    stalls, executed = {}, {}
    for r in rows:
        op = opcode(r.get("Source", ""))
        stalls[op] = stalls.get(op, 0.0) + number(r.get(key, "0"))
        executed[op] = executed.get(op, 0.0) + number(r.get("Instructions Executed", "0"))
    return stalls, executed


def profile(args, name: str, shape, out: pathlib.Path) -> dict:
    rep = out / f"{name}.ncu-rep"
    cmd = [args.ncu, "--profile-from-start", "off", "--clock-control", "none", "--force-overwrite", "-o", str(rep)]
    for s in SECTIONS:
        cmd += ["--section", s]
    cmd += ["--metrics", ",".join(PIPES)]
    cmd += [sys.executable, __file__, "--target", name, "--shape", ",".join(map(str, shape))]
    print(f"[{name}] profiling", flush=True)
    subprocess.run(cmd, check=True)
    raw = subprocess.run([args.ncu, "-i", str(rep), "--page", "raw", "--csv"], check=True, capture_output=True,
                         text=True).stdout
    (out / f"{name}.raw.csv").write_text(raw)
    source = subprocess.run([args.ncu, "-i", str(rep), "--page", "source", "--csv", "--print-source", "sass"],
                            capture_output=True, text=True).stdout
    (out / f"{name}.source.csv").write_text(source)
    kernels, units = raw_kernels(raw)
    name_k, metrics = max(kernels, key=lambda km: km[1].get(DURATION, 0.0))  # the fa3 kernel: the longest
    stalls, executed = source_by_opcode(source)
    total = sum(stalls.values()) or 1.0
    row = dict(config=name, shape=shape, kernel=name_k[:80], kernels=len(kernels),
               duration_us=metrics.get(DURATION, float("nan")) * UNIT_US.get(units.get(DURATION, "ns"), 1e-3),
               pipes={label: metrics.get(m, float("nan")) for m, label in PIPES.items()},
               stalls=stall_reasons(metrics),
               stall_by_opcode=[(op, s / total) for op, s in sorted(stalls.items(), key=lambda kv: -kv[1])[:12]],
               executed_by_opcode={op: n for op, n in sorted(executed.items(), key=lambda kv: -kv[1])[:16]})
    print(json.dumps(row, indent=1), flush=True)
    return row


def markdown(rows) -> str:
    pipes = list(PIPES.values())
    lines = ["| config | us | " + " | ".join(pipes) + " |", "|---|---:|" + "---:|" * len(pipes)]
    for r in rows:
        lines.append(f"| {r['config']} | {r['duration_us']:.1f} | " + " | ".join(f"{r['pipes'][p]:.1f}" for p in pipes) + " |")
    lines.append("")
    for r in rows:
        lines.append(f"**{r['config']}** stalls: " + ", ".join(f"{k} {v:.0%}" for k, v in r["stalls"]))
        lines.append(f"  by opcode: " + ", ".join(f"{k} {v:.0%}" for k, v in r["stall_by_opcode"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    shape = tuple(int(x) for x in args.shape.split(","))
    if args.target:
        run_target(args.target, shape)
        return 0
    from numba_flash import needs

    needs.exit_unless("fa3_ncu.py", needs.gpu(), needs.module("torch"),
                      needs.tool(args.ncu, "Nsight Compute's command line, from the CUDA toolkit; or give its path to --ncu"))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in [c for c in args.configs.split(",") if c]:
        try:
            rows.append(profile(args, name, shape, out))
        except Exception as e:  # noqa: BLE001 (one configuration's failure leaves the others' reports)
            print(f"[{name}] failed: {type(e).__name__}: {e}", flush=True)
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    (out / "summary.md").write_text(markdown(rows) + "\n")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
