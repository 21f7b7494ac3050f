"""A bounded pool of worker threads shared by every registered instance, in per-instance lanes.

The server runs the slow part of transfer requests (a registration's ``open``, server-driven
copies, ``close``) off its loop. Each registered instance gets a :class:`Lane`: work submitted to
one lane runs one item at a time, in submission order (an instance's transfers stay in order),
while lanes share at most ``size`` threads (:class:`WorkerPool`), so the number of threads does
not grow with the number of registrations. A lane holds a thread only while it has work, and
gives it back after each item, so busy lanes take turns.

A lane is used like a one-thread executor: ``submit`` from any thread, ``shutdown`` once. A request
that must wait before its work is known (a retrieve waiting for chunks promoted from L2) takes its
place in the order first (``reserve``) and fills it later: what is submitted meanwhile runs after
it.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["WorkerPool", "Lane", "LaneSlot"]

T = TypeVar("T")


class WorkerPool:
    """At most ``size`` threads, created as needed, named ``kvxfer-worker_N``."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._executor = ThreadPoolExecutor(size, thread_name_prefix="kvxfer-worker")

    def lane(self) -> Lane:
        """A new lane (one per registered instance)."""
        return Lane(self._executor)

    def shutdown(self, wait: bool = True) -> None:
        """After every lane is shut down: stop the threads."""
        self._executor.shutdown(wait=wait)


class LaneSlot:
    """A place in a :class:`Lane`'s order whose work comes later (:meth:`Lane.reserve`): the lane
    stops there until it is filled or cancelled. ``fill`` at most once."""

    __slots__ = ("future", "work", "cancelled")

    def __init__(self) -> None:
        self.future: Future[Any] = Future()
        self.work: Callable[[], Any] | None = None
        self.cancelled = False


class Lane:
    """Runs its work items one at a time, in order, on the pool's threads."""

    def __init__(self, executor: ThreadPoolExecutor) -> None:
        self._executor = executor
        self._queue: collections.deque[LaneSlot] = collections.deque()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._running = False
        #: The running item's work has returned (its future is being resolved).
        self._finishing = False
        self._closed = False

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue ``fn(*args)``; raises RuntimeError once the lane is shut down."""
        item = LaneSlot()
        item.work = lambda: fn(*args)
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new work after the lane was shut down")
            self._queue.append(item)
            start = self._start()
        if start:
            self._executor.submit(self._run_one)
        return item.future

    def reserve(self) -> LaneSlot:
        """Take the next place in the order now; its work comes with :meth:`fill` (or the place
        is given up with :meth:`cancel`). Raises RuntimeError once the lane is shut down."""
        slot = LaneSlot()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new work after the lane was shut down")
            self._queue.append(slot)
        return slot

    def fill(self, slot: LaneSlot, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Give ``slot`` its work, ``fn(*args)``: it runs once what is ahead of it has run.
        Raises RuntimeError if the lane was shut down (its unfilled places were given up) or
        the slot was cancelled or filled already."""
        with self._lock:
            if slot.cancelled or slot.work is not None:
                raise RuntimeError("this place in the lane was given up (the lane was shut down or the "
                                   "place cancelled) or filled already")
            slot.work = lambda: fn(*args)
            start = self._start()
        if start:
            self._executor.submit(self._run_one)
        return slot.future

    def cancel(self, slot: LaneSlot) -> None:
        """Give up an unfilled ``slot``: what is behind it runs (a filled one runs: no effect)."""
        with self._lock:
            if slot.work is not None or slot.cancelled:
                return
            slot.cancelled = True
            self._queue.remove(slot)
            start = self._start()
        slot.future.cancel()
        if start:
            self._executor.submit(self._run_one)

    def _start(self) -> bool:
        """Whether a thread must be started for the head of the queue (lock held): marks it."""
        if self._running or not self._queue or self._queue[0].work is None:
            return False
        self._running = True
        return True

    def idle(self) -> bool:
        """Nothing queued, and no work running: none started, or the last one has returned and
        only its future is being resolved (a snapshot: true until the next ``submit``)."""
        with self._lock:
            return not self._closed and not self._queue and (not self._running or self._finishing)

    def _run_one(self) -> None:
        with self._lock:
            item = self._queue.popleft()
        work = item.work
        assert work is not None  # _start() starts only a filled head
        fut = item.future
        if fut.set_running_or_notify_cancel():
            error: BaseException | None = None
            try:
                result = work()
            except BaseException as exc:  # noqa: BLE001 -- handed to the caller through its future
                error = exc
            with self._lock:
                self._finishing = True
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)
        with self._lock:
            self._finishing = False
            self._running = False
            more = self._start()  # the next item, unless it is a place not filled yet
            if not self._running:
                self._idle.notify_all()
        if more:  # back of the pool's queue: other lanes get their turn
            self._executor.submit(self._run_one)

    def shutdown(self, wait: bool = True) -> None:
        """Take no more work and give up the places not filled yet (their futures are
        cancelled); with ``wait``, return once the work already queued has run."""
        with self._lock:
            self._closed = True
            unfilled = [s for s in self._queue if s.work is None]
            for s in unfilled:
                s.cancelled = True
                self._queue.remove(s)
            start = self._start()
        for s in unfilled:
            s.future.cancel()
        if start:
            self._executor.submit(self._run_one)
        if wait:
            with self._lock:
                self._idle.wait_for(lambda: not self._running)
