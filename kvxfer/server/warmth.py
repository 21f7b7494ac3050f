"""Keeps the steps of a request warm while the server idles (``kvxfer serve --warm-us``).

After an idle gap of a few milliseconds every torch call a request makes runs several times
slower than back to back (on this project's 2-core VM a small torch op takes 3 us back to back
and 32-56 us after a 5 ms sleep; docs/performance.md, "Keeping the steps warm"): the code and
data those calls walk have left the CPU's caches. A lone request is exactly such a request. The
:class:`Warmer` thread runs the core's per-request CPU steps that a server-driven transfer makes
in the server (the wire's block ids decoded and checked, the row ids of a chunk, the copies
planned, the row ids joined) on a chunk of its own, every ``period`` while the server is idle (no
message being handled, no request in flight), so that the request that comes next finds them
nearer their back-to-back cost.

It reads only the layouts of the registered contexts (immutable) and tensors of its own: it
never touches the arena, the index or a transport's buffers. Its cost is those steps once per
period (tens of microseconds: a few percent of one CPU at a period of 1 ms; never more than
:data:`MAX_SHARE` of one, whatever the layouts), and the GIL for as long, which a request
arriving then waits for. Off by default: it keeps single steps warm, and
shortened no whole request where it was measured (a lone cuda_ipc request on an H100 host,
file_debug on a 2-core VM: docs/performance.md).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Final

import msgspec

from kvxfer.copies import check_transfer, chunk_rows, plan_copies
from kvxfer.layout import KVLayout
from kvxfer.protocol import codec
from kvxfer.server.tuning import MAX_WARM_S, MIN_WARM_S

__all__ = ["Warmer"]

log = logging.getLogger(__name__)

#: Most distinct layouts warmed per period (a server with more runs the first ones).
MAX_WARM_LAYOUTS: Final = 4
#: How long the thread waits while no server-driven context is registered (nothing to warm) or
#: the server is busy (requests keep the steps warm themselves).
_NOTHING_S: Final = 0.05
_BUSY_S: Final = 0.01
#: Most of one CPU the thread takes: after a run that took ``t``, it waits at least
#: ``t / MAX_SHARE - t`` (a client's layout may make a run take milliseconds: 1M rows a chunk).
MAX_SHARE: Final = 0.1
#: prctl's PR_SET_NAME: the thread's name as ps, top -H and /proc show it.
_PR_SET_NAME: Final = 15
THREAD_NAME: Final = "kvxfer-warm"


class Warmer:
    """A daemon thread that every ``period_s`` calls :meth:`warm_once` while ``idle()`` says the
    server is idle. ``layouts()``: the (layout, chunk size) of each context to warm for, called
    on this thread (it must be safe there: e.g. a copy of the server's contexts made in one step)."""

    def __init__(self, period_s: float, layouts: Callable[[], Iterable[tuple[KVLayout, int]]],
                 idle: Callable[[], bool]) -> None:
        if not MIN_WARM_S <= period_s <= MAX_WARM_S:  # NaN fails too
            raise ValueError(f"warm period must be in [{MIN_WARM_S:g}, {MAX_WARM_S:g}] s, got {period_s!r}")
        self.period_s = period_s
        self._layouts = layouts
        self._idle = idle
        self._stop = threading.Event()
        self._ids: dict[int, msgspec.Raw] = {}  # blocks per chunk -> one chunk's block ids on the wire
        #: Periods in which the steps ran (tests).
        self.runs = 0
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop and join the thread (idempotent)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        try:  # named for the operator's tools (Linux; elsewhere, or if refused, it keeps no name)
            ctypes.CDLL(None).prctl(_PR_SET_NAME, THREAD_NAME.encode(), 0, 0, 0)
        except (OSError, AttributeError):
            pass
        wait = self.period_s
        while not self._stop.wait(wait):
            try:
                if not self._idle():
                    wait = max(self.period_s, _BUSY_S)
                    continue
                start = time.perf_counter()
                warmed = self.warm_once()
                took = time.perf_counter() - start
                wait = max(self.period_s, took / MAX_SHARE - took) if warmed else _NOTHING_S
            except Exception:  # noqa: BLE001  (warmth is an optimization: it stops, the server goes on)
                log.exception("keeping the request path warm failed; stopped (--warm-us)")
                return

    def warm_once(self) -> int:
        """The core's CPU steps of one request of one chunk, for each distinct layout (at most
        :data:`MAX_WARM_LAYOUTS`); returns how many layouts were warmed."""
        import torch

        seen: set[tuple[KVLayout, int]] = set()
        warmed = 0
        for layout, chunk_size in self._layouts():
            if (layout, chunk_size) in seen:
                continue
            seen.add((layout, chunk_size))
            if len(seen) > MAX_WARM_LAYOUTS:
                break
            bpc = layout.blocks_per_chunk(chunk_size)
            if bpc > layout.num_blocks:
                continue  # no chunk fits the cache (refused at registration): nothing to warm
            ids = self._ids.get(bpc)
            if ids is None:
                ids = self._ids[bpc] = msgspec.Raw(codec.encode(list(range(bpc))))
            blocks = check_transfer(layout, chunk_size, 1, ids)
            rows = chunk_rows(layout, chunk_size, blocks)
            _, runs, per_chunk, row = layout.chunk_shape(chunk_size)
            # a slot-shaped view of one element: the plan only makes views of it
            slot = torch.empty(1, dtype=layout.dtype).as_strided((layout.num_layers, runs * per_chunk, row), (0, 0, 0))
            plan_copies(layout, chunk_size, blocks, [(0, slot)], rows=rows)
            torch.cat(rows.flat + rows.flat)
            blocks.tolist()
            warmed += 1
        if warmed:
            self.runs += 1
        return warmed
