"""Private: the client-driven data path (reserve, copy in the engine's process, commit).

Each request's reserve is sent when it is submitted (so its round trip overlaps the copies of
requests ahead of it); the worker waits for the reply, copies (the transport's ``gather`` or
``scatter``), and sends the commit without waiting (so it can start the next copy). A copy that
returns a waiter leaves the wait and the commit to the finisher thread; once one does, later
requests commit there too until it is idle, so commits keep request order. A request resolves
when its commit is answered: a store's chunks are then readable, a retrieve's read pins and
lease released. A request's future can be cancelled until its copy starts; then it copies
nothing and gives its reservation back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvxfer.arena import ArenaMapping
from kvxfer.copies import RowCopy, plan_copies
from kvxfer.errors import NoSession, UnknownInstance
from kvxfer.protocol import messages as m
from kvxfer.transport._context import ContextCore, guarded

if TYPE_CHECKING:
    from kvxfer.transport.contract import Transfer, Waiter

__all__ = ["ClientDrivenCore"]


class ClientDrivenCore(ContextCore):
    """The machinery of :class:`~kvxfer.transport.contract.ClientDrivenContext`."""

    _finisher_role: ClassVar[str] = "commit"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._unmapping: Callable[[], None] | None = None
        self.arena = self._map_arena()
        #: Queued requests whose reserve is not sent yet / stores whose commit is not sent yet.
        self._deferred = 0
        self._uncommitted = 0
        #: Requests handed to the finisher (their copy's waiter, then their commit), not done yet.
        self._late = 0
        self._late_done = threading.Condition()

    # ------------------------------------------------------------------ hooks (see the contract)

    def gather(self, copies: list[RowCopy], transfer: Transfer) -> Waiter | None:
        raise NotImplementedError

    def scatter(self, copies: list[RowCopy], transfer: Transfer) -> Waiter | None:
        raise NotImplementedError

    def on_arena(self, arena: ArenaMapping) -> Callable[[], None] | None:
        raise NotImplementedError

    # ------------------------------------------------------------------ the arena mapping

    def _map_arena(self) -> ArenaMapping:
        mapping = ArenaMapping(self.connection.arena_path, self.connection.arena_size)
        try:
            with self._step("on_arena"):
                self._unmapping = self.on_arena(mapping)
        except BaseException:
            mapping.close()
            raise
        return mapping

    def _unmap_arena(self) -> None:
        undo, self._unmapping = self._unmapping, None
        try:
            if undo is not None:
                with self._step("on_arena (undo)"):
                    undo()
        finally:
            self.arena.close()

    def on_reconnect(self) -> None:
        self._drain()  # copies still in flight must land before their slots are unmapped
        self._unmap_arena()
        self.arena = self._map_arena()
        super().on_reconnect()

    def _released(self) -> None:
        self._unmap_arena()

    # Each request's reserve is sent when it is submitted (so its round trip overlaps the copies
    # of requests ahead of it); the worker waits for the reply, copies, and sends the commit
    # without waiting (so it can start the next copy). A copy that returns a waiter leaves the
    # wait and the commit to the finisher thread; once one does, later requests commit there too
    # until it is idle, so commits keep request order. A request resolves when its commit is
    # answered: a store's chunks are then readable, a retrieve's read pins and lease released.

    def _start_store(self, transfer: Transfer) -> Future[m.StoreResult]:
        outer: Future[m.StoreResult] = Future()
        self._send_then(m.ReserveWrite(self.instance_id, transfer.keys), self._store, transfer, outer)
        return outer

    def _start_retrieve(self, transfer: Transfer, lease_id: int) -> Future[m.RetrieveResult]:
        outer: Future[m.RetrieveResult] = Future()
        first = min(len(transfer.keys), transfer.skip_blocks // self.blocks_per_chunk)  # wholly skipped: no read
        self._send_then(m.ReserveRead(self.instance_id, transfer.keys[first:], lease_id), self._retrieve,
                        transfer, first, outer)
        return outer

    def _send_then(self, reserve: m.ReserveWrite | m.ReserveRead, job: Callable[..., None], *args: Any) -> None:
        """Queue ``job(reserved, *args)`` on the worker, in order, and send ``reserve`` now when
        that keeps submission order (no earlier request waits to send its reserve, and, for a
        read, no earlier store is uncommitted); otherwise the job sends it when it runs (a read
        once the commits left to the finisher are sent). The job always runs, and calls
        ``reserved()`` for the reply (which raises if the reserve failed)."""
        write = isinstance(reserve, m.ReserveWrite)
        outer: Future[Any] = args[-1]

        def run(reply: Future[Any] | None) -> None:
            def reserved() -> Any:
                if reply is not None:
                    return self._retried(reply, lambda: self._resend(reserve))
                try:
                    if not write:  # the stores ahead must be committed before a read reserves
                        with self._late_done:
                            self._late_done.wait_for(lambda: self._late == 0)
                    try:
                        return self.connection.request(reserve)
                    except (NoSession, UnknownInstance):
                        return self._resend(reserve)
                finally:
                    with self._lock:
                        self._deferred -= 1

            try:
                job(reserved, *args)
            except BaseException as exc:  # noqa: BLE001  (the caller's future carries it)
                if not outer.done():
                    outer.set_exception(exc)
                if write:  # the job never reached its commit
                    self._commit_sent()

        with self._lock:
            self._check_open()
            early = self._deferred == 0 and (write or self._uncommitted == 0)
            reply: Future[Any] | None = self.connection.submit(reserve) if early else None
            self._executor.submit(run, reply)  # its job takes self._lock: counts are in first
            if not early:
                self._deferred += 1
            if write:
                self._uncommitted += 1

    def _commit_sent(self) -> None:
        with self._lock:
            self._uncommitted -= 1

    def _slots(self, slots: list[m.Slot], nbytes: int, shift: int = 0) -> list[tuple[int, torch.Tensor]]:
        return [(s.index + shift, self.arena.view(s.offset, nbytes)) for s in slots]

    def _then(self, waiter: Waiter | None, commit: Callable[[], None],
              abandon: Callable[[BaseException], None]) -> None:
        """Run ``commit()`` now if there is nothing to wait for and nothing is left to the
        finisher; else on the finisher after ``waiter()`` (``abandon(exc)`` if it raises)."""
        with self._late_done:
            now = waiter is None and self._late == 0
            if not now:
                self._late += 1
        if now:
            commit()
            return

        def done() -> None:
            with self._late_done:
                self._late -= 1
                self._late_done.notify_all()

        def finish() -> None:
            try:
                try:
                    if waiter is not None:
                        waiter()
                except BaseException as exc:  # noqa: BLE001  (the request is abandoned with it)
                    abandon(exc)
                else:
                    commit()
            finally:
                done()

        try:
            self._finisher.submit(finish)
        except RuntimeError as exc:  # no finisher any more (interpreter exit): give up the request
            done()
            abandon(exc)

    def _resolve(self, commit_reply: Future[Any], resolve: Callable[[Future[Any]], None]) -> None:
        """``resolve(commit_reply)`` once it is done, on the finisher: the caller's callbacks then
        never run on a thread that holds this context's locks (replies are completed by
        whichever thread drains the socket, e.g. one inside :meth:`_send_then`)."""
        def later(f: Future[Any]) -> None:
            try:
                self._finisher.submit(resolve, f)
            except RuntimeError:  # closed: nothing of ours is held any more
                resolve(f)

        commit_reply.add_done_callback(later)

    def _store(self, reserved: Callable[[], m.ReserveWriteReply], transfer: Transfer,
               outer: Future[m.StoreResult]) -> None:
        rep = reserved()
        nbytes = self.chunk_bytes

        def drop() -> None:  # commit every slot as failed: nothing half written becomes readable
            self.connection.submit(m.CommitWrite(self.instance_id, rep.reservation_id, [s.index for s in rep.slots]))

        if not outer.set_running_or_notify_cancel():  # cancelled before its copy: none happens
            drop()
            self._commit_sent()
            return
        started = time.perf_counter()
        try:
            waiter = None
            if rep.slots:
                copies = plan_copies(self.layout, self.chunk_size, transfer.blocks, self._slots(rep.slots, nbytes))
                with self._step("gather"):
                    waiter = guarded(self.gather(copies, transfer), self.transport_name, "gather (waiter)")
        except BaseException:
            drop()
            raise

        def committed(f: Future[m.StoreResult]) -> None:
            try:
                res = f.result()
                outer.set_result(m.StoreResult(res.stored, sorted(rep.present), sorted(rep.no_space + res.failed)))
            except BaseException as exc:  # noqa: BLE001  (the caller's future carries it)
                outer.set_exception(exc)

        def commit() -> None:
            try:  # the copy's time (gather and its waiter) goes to the server's figures
                copy_s = time.perf_counter() - started if rep.slots else 0.0
                self._resolve(self.connection.submit(m.CommitWrite(self.instance_id, rep.reservation_id,
                                                                   copy_s=copy_s)), committed)
            except BaseException as exc:  # noqa: BLE001  (the caller's future carries it)
                outer.set_exception(exc)
            finally:
                self._commit_sent()

        def abandon(exc: BaseException) -> None:
            try:
                drop()
            finally:
                outer.set_exception(exc)
                self._commit_sent()

        self._then(waiter, commit, abandon)

    def _retrieve(self, reserved: Callable[[], m.ReserveReadReply], transfer: Transfer, first: int,
                  outer: Future[m.RetrieveResult]) -> None:
        rep = reserved()
        nbytes = self.chunk_bytes
        keys = transfer.keys

        def unpin(copy_s: float = 0.0, loaded: bool = False) -> Future[m.Empty]:  # and release the lease
            return self.connection.submit(m.CommitRead(self.instance_id, rep.reservation_id, copy_s, loaded))

        if not outer.set_running_or_notify_cancel():  # cancelled before its copy: the blocks stay untouched
            unpin()
            return
        started = time.perf_counter()
        try:
            waiter = None
            if rep.slots:
                copies = plan_copies(self.layout, self.chunk_size, transfer.blocks,
                                     self._slots(rep.slots, nbytes, first), transfer.skip_blocks)
                with self._step("scatter"):
                    waiter = guarded(self.scatter(copies, transfer), self.transport_name, "scatter (waiter)")
        except BaseException:
            unpin()
            raise
        lost = {i + first for i in rep.missing}

        def committed(f: Future[m.Empty]) -> None:
            try:
                f.result()
            except (NoSession, UnknownInstance):
                # the server dropped the reservation while we copied (this client went silent past
                # the session timeout, or the server restarted): its slots may have been reused
                # under the copy, so nothing read counts as loaded
                outer.set_result(m.RetrieveResult(list(range(first)), list(range(first, len(keys)))))
            except BaseException as exc:  # noqa: BLE001  (the caller's future carries it)
                outer.set_exception(exc)
            else:
                outer.set_result(m.RetrieveResult([i for i in range(len(keys)) if i not in lost], sorted(lost)))

        def commit() -> None:
            try:  # the copy's time (scatter and its waiter) goes to the server's figures
                self._resolve(unpin(time.perf_counter() - started if rep.slots else 0.0, loaded=True), committed)
            except BaseException as exc:  # noqa: BLE001  (the caller's future carries it)
                outer.set_exception(exc)

        def abandon(exc: BaseException) -> None:
            try:
                unpin()
            finally:
                outer.set_exception(exc)

        self._then(waiter, commit, abandon)

    def _drain(self) -> None:
        """Wait until the finisher has sent every commit left to it."""
        with self._late_done:
            self._late_done.wait_for(lambda: self._late == 0)


