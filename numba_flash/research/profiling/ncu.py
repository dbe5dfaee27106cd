"""Nsight Compute on marked runs: measured DRAM bytes and achieved occupancy per run.

A *target* process launches each run framed by a tiny marker kernel; ``ncu --csv --page raw``
profiles every kernel; :func:`group_runs` splits ncu's kernel list at the markers and sums each
run's ``dram__bytes_read.sum + dram__bytes_write.sum`` and its duration-weighted achieved
occupancy (``sm__warps_active.avg.pct_of_peak_sustained_active``); asked for them, also the
warps' shared-memory load and store instructions and the share of warps stalled at a barrier
(:data:`WARP_METRICS`: what split-K costs over split-Q). Used by
``scripts/ncu_traffic.py`` (the traffic model against ncu) and ``numba-flash ablate --ncu``.
"""

from __future__ import annotations

import csv
import subprocess

METRICS = (
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "gpu__time_duration.sum",
)
# Inside the SM: shared-memory instructions (warp level) and barrier stalls (``syncthreads``).
WARP_METRICS = (
    "smsp__inst_executed_op_shared_ld.sum",
    "smsp__inst_executed_op_shared_st.sum",
    "smsp__warp_issue_stalled_barrier_per_warp_active.pct",
)
MARKER = "ncu_run_marker"


def marker():
    """A callable that launches the marker kernel (on a GPU; compiled on first use)."""
    import numpy as np

    from numba_flash._cuda import cuda

    @cuda.jit
    def ncu_run_marker(x):
        x[0] = 1

    flag = cuda.device_array(1, dtype=np.int32)

    def launch():
        ncu_run_marker[1, 1](flag)

    return launch


def ncu_command(ncu: str, log_file: str, target: list[str], metrics=METRICS) -> list[str]:
    """The ncu command line that profiles ``target`` (an argv) into ``log_file`` (CSV)."""
    return [ncu, "--clock-control", "none", "--metrics", ",".join(metrics), "--csv", "--page", "raw",
            "--log-file", log_file, *target]


def run_ncu(ncu: str, log_file: str, target: list[str], metrics=METRICS) -> list:
    """Run ``target`` under ncu; its kernels as (name, metric -> float), in launch order."""
    subprocess.run(ncu_command(ncu, log_file, target, metrics), check=True)
    with open(log_file) as f:
        return parse_ncu_csv(f.read())


def csv_rows(text):
    """The rows of ncu's ``--csv`` output (its own messages, which do not start with a quote, left out)."""
    return list(csv.reader(line for line in text.splitlines() if line.startswith('"')))


def parse_ncu_csv(text, metrics=(*METRICS, *WARP_METRICS), units=None):
    """Kernel rows (name, metric -> float) in launch order from ``ncu --csv --page raw``: the columns
    ``metrics`` names (``None``: every column; a cell that is not a number reads 0). ``units``: a dict
    that gets each column's unit (ncu's second row)."""
    rows = csv_rows(text)
    header = rows[0]
    name_col, id_col = header.index("Kernel Name"), header.index("ID")
    wanted = [(i, m) for i, m in enumerate(header) if metrics is None or m in metrics]
    kernels = []
    for row in rows[1:]:
        if len(row) != len(header) or not row[id_col].isdigit():
            if units is not None and len(row) == len(header) and not units:
                units.update(zip(header, row))  # the units row
            continue  # (or a truncated line)
        values = {}
        for i, m in wanted:
            cell = row[i].replace(",", "")
            try:
                values[m] = float(cell)
            except ValueError:
                values[m] = 0.0
        kernels.append((row[name_col], values))
    return kernels


def group_runs(kernels, runs):
    """Split the kernel list at the markers; one group of kernels per planned run, each the run
    dict with ``kernels``, ``dram_bytes``, ``achieved_occupancy`` and ``time_ms`` added (and,
    where ncu measured :data:`WARP_METRICS`, ``shared_ld``, ``shared_st`` warp instructions and
    ``barrier_stall``, the time-weighted share of active warps stalled at a barrier)."""
    groups, current = [], None
    for name, values in kernels:
        if MARKER in name:
            if current is not None:
                groups.append(current)
            current = []
        elif current is not None:
            current.append(values)
    if len(groups) != len(runs):
        raise RuntimeError(f"found {len(groups)} marked runs in the ncu output, planned {len(runs)}")
    out = []
    for run, ks in zip(runs, groups):
        dram = sum(k.get("dram__bytes_read.sum", 0) + k.get("dram__bytes_write.sum", 0) for k in ks)
        time_ns = sum(k.get("gpu__time_duration.sum", 0) for k in ks)
        occ = sum(k.get(METRICS[2], 0) * k.get("gpu__time_duration.sum", 0) for k in ks)
        row = dict(run, kernels=len(ks), dram_bytes=dram, achieved_occupancy=occ / time_ns / 100 if time_ns else 0.0,
                   time_ms=time_ns / 1e6)
        if any(WARP_METRICS[0] in k for k in ks):
            stall = sum(k.get(WARP_METRICS[2], 0) * k.get("gpu__time_duration.sum", 0) for k in ks)
            row.update(shared_ld=sum(k.get(WARP_METRICS[0], 0) for k in ks), shared_st=sum(k.get(WARP_METRICS[1], 0) for k in ks),
                       barrier_stall=stall / time_ns / 100 if time_ns else 0.0)
        out.append(row)
    return out
