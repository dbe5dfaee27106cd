"""Print the seed's online-softmax worked example, computed by numba_flash.online.

    python scripts/online_softmax_demo.py

s = [1, 2, 3, 10], V = ones, chunks [1, 2] and [3, 10]: the state (m, l, acc) after
each chunk, the final o and lse, and the all-at-once softmax for comparison. The output
is pasted verbatim in docs/theory/online-softmax.md.
"""

from __future__ import annotations

import sys
from typing import TextIO

from numba_flash.seed_example import print_worked_example


def worked_example(file: TextIO | None = None) -> None:
    """Print the worked example to ``file`` (default: ``sys.stdout``)."""
    print_worked_example(file)


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    worked_example(sys.stdout)
