"""The one CUDA driver call the server needs that torch does not expose: which device allocation
holds an address (``cuMemGetAddressRange``), to check the storage a registration claims against
what its IPC handle opened. Called through ``ctypes`` on ``libcuda.so.1``, which torch has loaded
already wherever CUDA works."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

__all__ = ["allocation_range", "mapped_end"]


@functools.cache
def _get_address_range() -> Any:
    fn = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    fn.restype = ctypes.c_int
    return fn


def allocation_range(ptr: int) -> tuple[int, int] | None:
    """``(base, size)`` of the allocation of the calling thread's current CUDA context that
    holds device address ``ptr``; None where the driver knows no such allocation (or has no
    such call). The caller makes the device's context current (torch does for its device)."""
    if not 0 < ptr < 1 << 64:
        return None
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    try:
        rc = _get_address_range()(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    except (AttributeError, OSError):
        return None
    return (base.value, size.value) if rc == 0 else None


def mapped_end(start: int, end: int, pieces: bool) -> int:
    """How far memory is mapped from ``start`` (an allocation's first byte), looked at up to
    ``end``: the end of the allocation that starts there, or, with ``pieces``, of the run of
    allocations that follow it back to back (memory mapped page by page, as torch's expandable
    segments are); ``start`` itself where no allocation starts there."""
    at = start
    while at < end:
        found = allocation_range(at)
        if found is None or found[0] != at or found[1] <= 0:
            break
        at += found[1]
        if not pieces:
            break
    return at
