"""A best-fit extent allocator over the arena, with coalescing on free.

Extents are ``ALIGN``-aligned. Free extents are indexed three ways (by start, by end, and by size
in a sorted list of distinct sizes) so that allocation is O(log n) best fit and a free merges
with both neighbours in O(log n). Survives churn with mixed object sizes: freeing everything
always gives back one extent of the whole arena.
"""

from __future__ import annotations

import bisect
from typing import Final

__all__ = ["Allocator", "ALIGN"]

ALIGN: Final = 4096


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Allocator:
    __slots__ = ("capacity", "_by_start", "_by_end", "_sizes", "_starts_of", "used")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity // ALIGN * ALIGN
        self._by_start: dict[int, int] = {}
        self._by_end: dict[int, int] = {}
        self._sizes: list[int] = []
        self._starts_of: dict[int, set[int]] = {}
        self.used = 0
        if self.capacity:
            self._add(0, self.capacity)

    @staticmethod
    def rounded(nbytes: int) -> int:
        """Bytes an allocation of ``nbytes`` takes."""
        return _round_up(nbytes)

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    @property
    def free_extents(self) -> int:
        return len(self._by_start)

    @property
    def largest_free(self) -> int:
        return self._sizes[-1] if self._sizes else 0

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new extent of ``nbytes`` (rounded up), or None when nothing fits."""
        if nbytes <= 0:
            raise ValueError(f"allocation size must be positive, got {nbytes}")
        need = _round_up(nbytes)
        i = bisect.bisect_left(self._sizes, need)
        if i == len(self._sizes):
            return None
        size = self._sizes[i]
        start = next(iter(self._starts_of[size]))
        self._remove(start, size)
        if size > need:
            self._add(start + need, size - need)
        self.used += need
        return start

    def free(self, start: int, nbytes: int) -> None:
        size = _round_up(nbytes)
        end = start + size
        if start < 0 or end > self.capacity or start % ALIGN:
            raise ValueError(f"bad extent [{start}, {end})")
        if start in self._by_start or end in self._by_end:
            raise ValueError(f"double free of [{start}, {end})")
        self.used -= size
        prev_start = self._by_end.get(start)
        if prev_start is not None:
            self._remove(prev_start, start - prev_start)
            start = prev_start
        next_size = self._by_start.get(end)
        if next_size is not None:
            self._remove(end, next_size)
            end += next_size
        self._add(start, end - start)

    def _add(self, start: int, size: int) -> None:
        self._by_start[start] = size
        self._by_end[start + size] = start
        starts = self._starts_of.get(size)
        if starts is None:
            self._starts_of[size] = {start}
            bisect.insort(self._sizes, size)
        else:
            starts.add(start)

    def _remove(self, start: int, size: int) -> None:
        del self._by_start[start]
        del self._by_end[start + size]
        starts = self._starts_of[size]
        starts.discard(start)
        if not starts:
            del self._starts_of[size]
            del self._sizes[bisect.bisect_left(self._sizes, size)]

    def check(self) -> None:
        """Assert internal invariants (tests)."""
        total = sum(self._by_start.values())
        assert total == self.capacity - self.used, (total, self.capacity, self.used)
        ends = sorted((s, s + n) for s, n in self._by_start.items())
        for (_, e1), (s2, _) in zip(ends, ends[1:]):
            assert e1 < s2, "adjacent free extents were not merged"
        assert self._sizes == sorted(self._starts_of)
