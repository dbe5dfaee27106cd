"""Rows as text: the aligned Markdown tables of ``compare``, ``ablate``, ``occupancy`` and
``scripts/bench.py``, and the names they give implementations and shapes."""

from __future__ import annotations

# A problem's shape as the tables show it: query heads / K/V heads, query / key length.
SHAPE = "B{batch} H{heads}/{kv_heads} Nq{seq} Nk{seq_k} D{head_dim}"


def shape_label(row: dict) -> str:
    """The shape of a harness problem or row (``harness.describe``, ``harness.new_row``),
    e.g. ``B4 H16/16 Nq4096 Nk4096 D64``."""
    return SHAPE.format(**row)


def display_name(impl: str) -> str:
    """``FA-1`` / ``FA-2`` / ``FA-3`` for the numba_flash kernels; a peer's own name (``cupy``, ``torch-flash``)."""
    return impl.upper().replace("FA", "FA-") if impl in ("fa1", "fa2", "fa3") else impl


def markdown_table(header: list[str], body: list[list[str]]) -> list[str]:
    """The lines of a Markdown table, every column padded to its widest cell: the first
    left-aligned (labels), the others right-aligned (figures)."""
    lines = [header, *body]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]

    def text(cells):
        padded = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    return [text(header), rule, *(text(cells) for cells in body)]
