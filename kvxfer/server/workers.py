"""A bounded pool of worker threads shared by every registered instance, in per-instance lanes.

The server runs the slow part of transfer requests (a registration's ``open``, server-driven
copies, ``close``) off its loop. Each registered instance gets a :class:`Lane`: work submitted to
one lane runs one item at a time, in submission order (an instance's transfers stay in order),
while lanes share at most ``size`` threads (:class:`WorkerPool`), so the number of threads does
not grow with the number of registrations. A lane holds a thread only while it has work, and
gives it back after each item, so busy lanes take turns.

A lane is used like a one-thread executor: ``submit`` from any thread, ``shutdown`` once.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["WorkerPool", "Lane"]

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


class Lane:
    """Runs its work items one at a time, in order, on the pool's threads."""

    def __init__(self, executor: ThreadPoolExecutor) -> None:
        self._executor = executor
        self._queue: collections.deque[tuple[Future[Any], Callable[[], Any]]] = collections.deque()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._running = False
        #: The running item's work has returned (its future is being resolved).
        self._finishing = False
        self._closed = False

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue ``fn(*args)``; raises RuntimeError once the lane is shut down."""
        fut: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new work after the lane was shut down")
            self._queue.append((fut, lambda: fn(*args)))
            start = not self._running
            self._running = True
        if start:
            self._executor.submit(self._run_one)
        return fut

    def idle(self) -> bool:
        """Nothing queued, and no work running: none started, or the last one has returned and
        only its future is being resolved (a snapshot: true until the next ``submit``)."""
        with self._lock:
            return not self._closed and not self._queue and (not self._running or self._finishing)

    def _run_one(self) -> None:
        with self._lock:
            fut, work = self._queue.popleft()
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
            more = bool(self._queue)
            if not more:
                self._running = False
                self._idle.notify_all()
        if more:  # back of the pool's queue: other lanes get their turn
            self._executor.submit(self._run_one)

    def shutdown(self, wait: bool = True) -> None:
        """Take no more work; with ``wait``, return once the work already queued has run."""
        with self._lock:
            self._closed = True
            if wait:
                self._idle.wait_for(lambda: not self._running)
