"""Byte sizes as people write them: ``parse_size("4GiB")`` and ``format_bytes(n)``.

Used by the CLI, the server and the benchmarks; imports nothing heavy.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Final

from kvxfer.errors import ConfigError

__all__ = ["format_bytes", "parse_size"]

#: Units, case aside: ``KiB`` and ``K`` are powers of 1024 (as ``docker --shm-size`` and
#: ``dd`` read them), ``KB`` powers of 1000.
_UNITS: Final = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
                 "mib": 1 << 20, "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000**4,
                 "tib": 1 << 40}
#: What a size error says a size is.
_EXAMPLES: Final = "examples: 4GiB or 4G (4 x 1024^3 bytes), 4GB (4 x 1000^3), 512MiB, 1073741824"


#: The largest size a value may name (what a signed 64-bit count of bytes holds).
MAX_SIZE: Final = (1 << 63) - 1


def parse_size(text: str | int) -> int:
    """``"4GiB"``, ``"512MiB"``, ``"1.5g"`` or a byte count -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"not a size: {text!r} ({_EXAMPLES})")
    value = int(Decimal(m.group(1)) * _UNITS[m.group(2).lower()])
    if value > MAX_SIZE:
        shown = text if len(text) <= 40 else f"{text[:20]}...{text[-8:]}"
        raise ConfigError(f"not a size: {shown!r} is more than any host holds (at most {MAX_SIZE} bytes)")
    return value


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit below 1024 of it (``"1.5 GiB"``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable: TiB ends the loop")
