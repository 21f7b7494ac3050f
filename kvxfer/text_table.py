"""Plain-text tables, as the CLI and the benchmarks print them."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TextIO

__all__ = ["print_table"]


def print_table(rows: Sequence[Sequence[object]], headers: Sequence[str], file: TextIO | None = None) -> None:
    """A plain-text table, columns padded to their widest cell, a rule under the headers."""
    out = file or sys.stdout
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, r in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip(), file=out)
        if n == 0:
            print("  ".join("-" * w for w in widths), file=out)
