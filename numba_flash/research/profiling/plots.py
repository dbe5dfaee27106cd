"""Plots for the instruments (matplotlib, Agg backend; ``pip install numba-flash[plot]``)."""

from __future__ import annotations

import os
from collections import defaultdict


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_occupancy(rows, out_dir) -> list[str]:
    """Registers per thread and theoretical occupancy against block_m, one line per
    (algorithm, head_dim), one figure per (dtype, block_n)."""
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    groups = defaultdict(list)
    for r in rows:
        groups[(r["dtype"], r["block_n"])].append(r)
    paths = []
    for (dtype, block_n), grp in sorted(groups.items()):
        fig, (ax_r, ax_o) = plt.subplots(1, 2, figsize=(10, 4))
        lines = defaultdict(list)
        for r in grp:
            lines[(r["algorithm"], r["head_dim"])].append(r)
        for (alg, d), pts in sorted(lines.items()):
            pts.sort(key=lambda r: r["block_m"])
            x = [r["block_m"] for r in pts]
            style = "-o" if alg == "fa2" else "--s"
            ax_r.plot(x, [r["regs"] for r in pts], style, label=f"{alg.upper()} D={d}")
            ax_o.plot(x, [100 * r["occupancy"] for r in pts], style, label=f"{alg.upper()} D={d}")
        for ax, ylabel in ((ax_r, "registers / thread"), (ax_o, "theoretical occupancy (%)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("block_m (query rows per block)")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
        ax_o.legend(fontsize=8)
        source = grp[0]["source"]
        fig.suptitle(f"numba_flash kernels, {dtype}, block_n={block_n} ({source})")
        fig.tight_layout()
        path = os.path.join(out_dir, f"occupancy_{dtype}_bn{block_n}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
