"""Plain-text tables, as the CLI and the benchmarks print them."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TextIO

__all__ = ["print_table", "printable"]


def printable(text: object) -> str:
    """``str(text)`` safe to print on a terminal: every character that is not printable (control
    characters such as ESC, which would drive the terminal, and format characters that reorder
    text) is shown as its escape (``\\x1b``, ``\\u202e``). Names come from clients and plugins."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)


def print_table(rows: Sequence[Sequence[object]], headers: Sequence[str], file: TextIO | None = None) -> None:
    """A plain-text table, columns padded to their widest cell, a rule under the headers."""
    out = file or sys.stdout
    cells = [[printable(h) for h in headers]] + [[printable(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, r in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip(), file=out)
        if n == 0:
            print("  ".join("-" * w for w in widths), file=out)
