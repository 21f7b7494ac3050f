"""Plain-text tables, as the CLI and the benchmarks print them."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TextIO, TypeVar

T = TypeVar("T")

__all__ = ["percent", "print_table", "printable", "printable_lines", "printable_struct"]


def printable(text: object) -> str:
    """``str(text)`` safe to print on a terminal: every character that is not printable (control
    characters such as ESC, which would drive the terminal, and format characters that reorder
    text) is shown as its escape (``\\x1b``, ``\\u202e``). Names come from clients and plugins."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)


def printable_lines(text: object) -> str:
    """:func:`printable` line by line: the line breaks are kept (an error's message may have
    several lines; a server's text, too, goes to a terminal)."""
    return "\n".join(printable(line) for line in str(text).split("\n"))


def printable_struct(value: T) -> T:
    """``value`` (a decoded message: Structs, lists, dicts, strings, numbers) with every string in
    it :func:`printable`, keys too: what a server sent, made safe to show on a terminal."""
    import msgspec

    if isinstance(value, str):
        return printable(value)  # type: ignore[return-value]
    if isinstance(value, msgspec.Struct):
        changes = {f: printable_struct(getattr(value, f)) for f in value.__struct_fields__}
        return msgspec.structs.replace(value, **changes)
    if isinstance(value, (list, tuple)):
        return type(value)(printable_struct(v) for v in value)
    if isinstance(value, dict):
        return {printable_struct(k): printable_struct(v) for k, v in value.items()}  # type: ignore[return-value]
    return value


def percent(part: float, whole: float) -> str:
    """``part`` of ``whole`` as ``"12.5%"``; ``"-"`` unless 0 <= part <= whole and whole > 0 (a
    rate of figures that came from a server: a broken one's showed "-500.0%")."""
    return f"{100 * part / whole:.1f}%" if 0 <= part <= whole and whole > 0 else "-"


#: Widest a column is padded to, in characters: a longer cell is printed whole and pushes its row
#: on (every row was padded to the widest cell: one cell of a megabyte, in a server's reply, made
#: every row as long).
MAX_CELL = 120


def print_table(rows: Sequence[Sequence[object]], headers: Sequence[str], file: TextIO | None = None) -> None:
    """A plain-text table, columns padded to their widest cell (at most :data:`MAX_CELL`
    characters), a rule under the headers."""
    out = file or sys.stdout
    cells = [[printable(h) for h in headers]] + [[printable(c) for c in r] for r in rows]
    widths = [min(MAX_CELL, max(len(r[i]) for r in cells)) for i in range(len(headers))]
    for n, r in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip(), file=out)
        if n == 0:
            print("  ".join("-" * w for w in widths), file=out)
