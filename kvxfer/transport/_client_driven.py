"""Private: the client-driven data path (reserve, copy in the engine's process, commit).

Each request's reserve is sent when it is submitted (so its round trip overlaps the copies of
requests ahead of it); the worker waits for the reply, copies (the transport's ``gather`` or
``scatter``), and sends the commit without waiting (so it can start the next copy). A copy that
returns a waiter leaves the wait and the commit to the finisher thread; once one does, later
requests commit there too until it is idle, so commits keep request order. A store resolves
when its commit is answered (its chunks are then readable); a retrieve as soon as its copy has
landed, well within the time for which the server surely holds its pins (its commit, which
unpins and releases the lease, is answered in the background). A layer-wise transfer is copied
in parts, one range of layers each, in order (:meth:`ClientDrivenCore._copy_parts`). A request's
future can be cancelled until its copy starts; then it copies nothing and gives its reservation
back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import TYPE_CHECKING, Any, ClassVar, cast

from kvxfer.arena import ArenaMapping
from kvxfer.copies import ChunkRows, RowCopy, SlotViews, chunk_rows, layer_slice, plan_copies
from kvxfer.errors import InvalidRequest, KvxferError, NoSession, ProtocolError, UnknownInstance
from kvxfer.protocol import messages as m
from kvxfer.transport._context import ContextCore, check_each_told_once, guarded

if TYPE_CHECKING:
    import torch

    from kvxfer.transport.contract import LayerwiseFuture, Transfer, TransferContextBase, Waiter

__all__ = ["ClientDrivenCore"]

log = logging.getLogger(__name__)


class ClientDrivenCore(ContextCore):
    """The machinery of :class:`~kvxfer.transport.contract.ClientDrivenContext`."""

    _finisher_role: ClassVar[str] = "commit"
    _core_names: ClassVar[frozenset[str]] = ContextCore._core_names | {
        "_unmapping", "_views", "_mapped_epoch", "_map_lock", "_deferred", "_uncommitted", "_late", "_late_done"}
    _core_public: ClassVar[frozenset[str]] = ContextCore._core_public | {"arena"}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._unmapping: Callable[[], None] | None = None
        #: Held while the arena is remapped, and while a reserve reply's slots become views.
        self._map_lock = threading.Lock()
        self.arena = self._map_arena()
        #: Queued requests whose reserve is not sent yet / stores whose commit is not sent yet.
        self._deferred = 0
        self._uncommitted = 0
        #: Requests handed to the finisher (their copy's waiter, then their commit), not done yet.
        self._late = 0
        self._late_done = threading.Condition()
        self._seal()

    # ------------------------------------------------------------------ hooks (see the contract)

    def gather(self, copies: list[RowCopy], transfer: Transfer) -> Waiter | None:
        raise NotImplementedError

    def scatter(self, copies: list[RowCopy], transfer: Transfer) -> Waiter | None:
        raise NotImplementedError

    def on_arena(self, arena: ArenaMapping) -> Callable[[], None] | None:
        raise NotImplementedError

    # ------------------------------------------------------------------ the arena mapping

    def _map_arena(self) -> ArenaMapping:
        """Map the server's arena, and make the table of its slot views (:attr:`_views`)."""
        while True:  # the arena of one session, named with its epoch (a handshake may come meanwhile)
            epoch = self.connection.epoch
            try:
                mapping = ArenaMapping(self.connection.arena_path, self.connection.arena_size)
            except Exception:  # (the old session's arena, gone with its server): refused only if it was the current one
                if not self._stale(epoch):
                    raise
                time.sleep(0.01)
                continue
            if not self._stale(epoch):
                break
            mapping.close()
            time.sleep(0.01)  # a handshake under way: until it ends
        try:
            with self._step("on_arena"):
                self._unmapping = self.on_arena(mapping)
        except BaseException:
            mapping.close()
            raise
        #: The arena's slots as this context's layout sees them (its worker plans every copy), and
        #: the session whose server's arena that is (see :meth:`_slots_of`).
        self._views = SlotViews(mapping.view, self.layout, self.chunk_size)
        self._mapped_epoch = epoch
        return mapping

    def _unmap_arena(self) -> None:
        self._views.clear()
        undo, self._unmapping = self._unmapping, None
        try:
            if undo is not None:
                with self._step("on_arena (undo)"):
                    undo()
        finally:
            self.arena.close()

    def on_reconnect(self) -> None:
        self._drain()  # copies still in flight must land before their slots are unmapped
        with self._map_lock:
            self._unmap_arena()
            self.arena = self._map_arena()
        super().on_reconnect()

    def _released(self) -> None:
        self._unmap_arena()

    # Each request's reserve is sent when it is submitted (so its round trip overlaps the copies
    # of requests ahead of it); the worker waits for the reply, copies, and sends the commit
    # without waiting (so it can start the next copy). A copy that returns a waiter leaves the
    # wait and the commit to the finisher thread; once one does, later requests commit there too
    # until it is idle, so commits keep request order. A store resolves when its commit is
    # answered (its chunks are then readable); a retrieve as soon as its copy has landed, its
    # commit (unpin, release the lease) answered in the background, unless so much time passed
    # since its reserve that the server may have dropped its pins (then on the commit's reply).

    def _start_store(self, transfer: Transfer, outer: Future[m.StoreResult]) -> Future[m.StoreResult]:
        self._send_then(m.ReserveWrite(self.instance_id, transfer.keys), self._store, transfer, outer)
        return outer

    def _start_retrieve(self, transfer: Transfer, lease_id: int,
                        outer: Future[m.RetrieveResult]) -> Future[m.RetrieveResult]:
        first = min(len(transfer.keys), transfer.skip_blocks // self.blocks_per_chunk)  # wholly skipped: no read
        skipped = transfer.keys[:first] if lease_id else []
        self._send_then(m.ReserveRead(self.instance_id, transfer.keys[first:], lease_id, skipped), self._retrieve,
                        transfer, first, outer)
        return outer

    def _send_then(self, reserve: m.ReserveWrite | m.ReserveRead, job: Callable[..., None], *args: Any) -> None:
        """Queue ``job(reserved, *args)`` on the worker, in order, and send ``reserve`` now when
        that keeps submission order (no earlier request waits to send its reserve, and, for a
        read, no earlier store is uncommitted); otherwise the job sends it when it runs (a read
        once the commits left to the finisher are sent). The job always runs, and calls
        ``reserved()`` for ``(reply, sent_at, epoch)``: the reply (raises if the reserve failed),
        a ``time.monotonic()`` taken before the reserve that got it was sent, and the client's
        session epoch read then (the reply came from that session or a later one)."""
        write = isinstance(reserve, m.ReserveWrite)
        outer: Future[Any] = args[-1]

        def run(reply: Future[Any] | None, sent_at: float, epoch: int) -> None:
            def reserved() -> tuple[Any, float, int]:
                got = answer()
                self._check_reserved(reserve, got[0])
                return got

            def answer() -> tuple[Any, float, int]:
                if reply is not None:
                    try:
                        return reply.result(), sent_at, epoch
                    except (NoSession, UnknownInstance):
                        return self._again(reserve, time.monotonic())
                try:
                    if not write:  # the stores ahead must be committed before a read reserves
                        with self._late_done:
                            self._late_done.wait_for(lambda: self._late == 0)
                    at, now = time.monotonic(), self.connection.epoch
                    try:
                        return self.connection.request(reserve), at, now
                    except (NoSession, UnknownInstance):
                        return self._again(reserve, time.monotonic())
                finally:
                    with self._lock:
                        self._deferred -= 1

            try:
                job(reserved, *args)
            except BaseException as exc:  # noqa: BLE001  (the caller's future carries it)
                try:
                    if not outer.done():
                        outer.set_exception(exc)
                except InvalidStateError:  # cancelled meanwhile
                    pass
                finally:
                    if write:  # the job never reached its commit
                        self._commit_sent()

        with self._lock:
            self._check_open()
            early = self._deferred == 0 and (write or self._uncommitted == 0)
            sent_at, epoch = time.monotonic(), self.connection.epoch
            reply: Future[Any] | None = self.connection.submit(reserve) if early else None
            self._executor.submit(run, reply, sent_at, epoch)  # its job takes self._lock: counts are in first
            if not early:
                self._deferred += 1
            if write:
                self._uncommitted += 1

    def _check_reserved(self, reserve: m.ReserveWrite | m.ReserveRead,
                        rep: m.ReserveWriteReply | m.ReserveReadReply) -> None:
        """Raise ProtocolError unless ``rep`` accounts for each chunk of ``reserve`` exactly once
        (:func:`check_each_told_once`): a slot, or present or no space (a write), or missing (a
        read). The reservation is given back first, as far as it can be told."""
        n = len(reserve.hashes)
        told = [s.index for s in rep.slots]
        told += [*rep.present, *rep.no_space] if isinstance(rep, m.ReserveWriteReply) else rep.missing
        try:
            check_each_told_once("reserve", n, told, getattr(self.connection, "url", "?"))
        except ProtocolError:
            with contextlib.suppress(Exception):  # (a server that answers so may answer anything)
                if isinstance(rep, m.ReserveWriteReply):
                    self.connection.submit(m.CommitWrite(self.instance_id, rep.reservation_id,
                                                         [s.index for s in rep.slots if 0 <= s.index < n]))
                else:
                    self.connection.submit(m.CommitRead(self.instance_id, rep.reservation_id, 0.0, False))
            raise

    def _again(self, reserve: m.ReserveWrite | m.ReserveRead, at: float) -> tuple[Any, float, int]:
        """``reserved()``'s answer for a reserve the server answered NoSession or UnknownInstance:
        register again, then send it once more."""
        reply, epoch = self._resend_at(reserve)
        return reply, at, epoch

    def _stale(self, epoch: int) -> bool:
        """Whether a reply to a request sent in ``epoch`` may come from a session other than the
        client's now (see :meth:`_slots_of`)."""
        return bool(epoch % 2) or epoch != self.connection.epoch

    def _slots_of(self, epoch: int, slots: list[m.Slot], shift: int = 0) -> list[tuple[int, torch.Tensor]] | None:
        """The views of a reserve reply's ``slots`` (``epoch``: as ``reserved()`` gives it), or
        None if the client opened a session since that reserve was sent, or was opening one (an
        odd epoch): the server may have restarted, and the offsets name slots of an arena this
        context no longer maps (in the one it maps, other chunks). Views made here stay valid if
        the arena is remapped after: they keep the old mapping, and the reservation's commit
        tells what became of it. A context that mapped its arena while another thread opened a
        session maps the session's arena now."""
        for _ in range(2):
            with self._map_lock:
                if self._stale(epoch):
                    return None
                if epoch == self._mapped_epoch:
                    return self._slots(slots, shift)
            self.connection.reconnect(cast("TransferContextBase", self))  # (the session stays: no handshake)
        return None

    def _commit_sent(self) -> None:
        with self._lock:
            self._uncommitted -= 1

    def _slots(self, slots: list[m.Slot], shift: int = 0) -> list[tuple[int, torch.Tensor]]:
        rows = self._views.rows
        try:
            return [(s.index + shift, rows(s.offset)) for s in slots]
        except (ValueError, RuntimeError) as exc:  # a slot past the arena's end, or not aligned for the
            # chunk's dtype: the server's answer, not a fault here
            raise ProtocolError(f"the kvxfer server at {getattr(self.connection, 'url', '?')} handed out a slot "
                                f"this context cannot use ({exc}); nothing was copied") from None

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


    def _copy_parts(self, copy: Callable[[list[RowCopy], Transfer], Waiter | None], step: str,
                    copies: list[RowCopy], transfer: Transfer, layered: LayerwiseFuture[Any] | None,
                    done: Callable[[Waiter | None], None], fail: Callable[[BaseException], None],
                    in_time: Callable[[], bool] | None = None) -> None:
        """Call the transport's ``copy`` (gather or scatter) for the request, then ``done(waiter)``
        with one waiter for all of it; ``fail(exc)`` instead if a copy raises.

        ``in_time`` (a retrieve's): whether the server surely still holds the request's pins.
        Once it says no, nothing more is copied (``done`` follows once the copies under way
        ended), and no layer is marked landed whose copy ended late: the slots may hold other
        chunks by then (the caller resolves the request as loading nothing).

        Layer by layer (``layered``): once per layer group, in order, each group a job of its own
        on the worker. A retrieve's next group is queued behind the jobs already waiting, so the
        layer-wise loads of one step interleave (layer 0 of each before layer 1 of any); a store's
        once its layers are declared ready (with the token of that declaration), so the worker
        never waits for the caller's forward pass. The waiter marks each group's layers landed as
        its part completes."""
        if layered is None:
            if in_time is not None and not in_time():
                done(None)  # nothing copied: the caller finds out too
                return
            try:
                with self._step(step):
                    waiter = guarded(copy(copies, transfer), self.transport_name, f"{step} (waiter)")
            except BaseException as exc:  # noqa: BLE001  (fail() hands it to the caller's future)
                fail(exc)
                return
            done(waiter)
            return
        lw = layered
        groups = self._layer_groups(sum(c.slot.numel() * c.slot.element_size() for c in copies))
        parts: list[tuple[Waiter | None, range]] = []
        state: dict[str, Any] = {"next": 0, "queued": False, "over": False}
        lock = threading.Lock()
        store = transfer.kind == "store"

        def finish() -> None:
            if not parts:
                done(None)
                return

            def wait() -> None:
                for waiter, group in parts:
                    if waiter is not None:
                        waiter()
                    if in_time is None or in_time():
                        lw.mark_landed(group)

            done(wait)

        def advance() -> None:  # one group per job, on the worker
            error: BaseException | None = None
            with lock:
                state["queued"] = False
                if state["over"]:
                    return
                k = state["next"]
                group = groups[k]
                token: Any = transfer.token
                if store:
                    ready, token = lw.ready(group.stop)
                    if not ready:
                        if lw.abandoned is None:
                            return  # a later layer_ready queues this again
                        _over(state)
                        error = lw.abandoned
                late = error is None and in_time is not None and not in_time()
                if late:
                    _over(state)
                elif error is None:
                    if store and k == 0 and not (lw.running() or lw.set_running_or_notify_cancel()):
                        _over(state)  # cancelled before its first part: its slots were given back
                        return
                    state["next"] = k + 1
            if error is not None:
                fail(error)
                return
            if late:  # copy nothing more; the parts under way end first
                finish()
                return
            try:
                sliced = copies if group == range(self.layout.num_layers) else \
                    layer_slice(copies, group.start, group.stop)
                part = dataclasses.replace(transfer, token=token) if store else transfer
                with self._step(step):
                    waiter = guarded(copy(sliced, part), self.transport_name, f"{step} (waiter)")
            except BaseException as exc:  # noqa: BLE001  (fail() hands it to the caller's future)
                with lock:
                    _over(state)
                fail(exc)
                return
            if waiter is None and all(w is None for w, _ in parts):
                if in_time is None or in_time():
                    lw.mark_landed(group)
            else:
                parts.append((waiter, group))
            if k + 1 == len(groups):
                with lock:
                    _over(state)
                finish()
            elif not store or lw.ready(groups[k + 1].stop)[0] or lw.abandoned is not None:
                queue()

        def queue() -> None:
            with lock:
                if state["queued"] or state["over"]:
                    return
                state["queued"] = True
                run = state["advance"]
            try:
                self._executor.submit(run)
            except RuntimeError:  # the context is closing: its worker takes no new jobs
                run()

        # queue() reaches advance() through ``state`` (dropped when the transfer is over), not a
        # cell of its own: the two would hold each other, and with them the copies' views of the
        # arena, until the garbage collector found the cycle (the mapping outlived close())
        state["advance"] = advance

        if store:
            lw.on_ready(queue)
        advance()

    def _rows_early(self, transfer: Transfer) -> ChunkRows | None:
        """The request's row ids, computed while its reserve is in flight (a lone request then
        waits only for the pairing with its slots); None if that fails: :func:`plan_copies`
        computes them again where a failure gives the reservation back."""
        try:
            return chunk_rows(self.layout, self.chunk_size, transfer.blocks)
        except BaseException:  # noqa: BLE001  (the reply must still be read: planned again after it, with the cleanup there)
            return None

    def _store(self, reserved: Callable[[], tuple[m.ReserveWriteReply, float, int]], transfer: Transfer,
               outer: Future[m.StoreResult]) -> None:
        from kvxfer.transport.contract import LayerwiseFuture

        rows = self._rows_early(transfer)
        rep, _, epoch = reserved()
        layered = outer if isinstance(outer, LayerwiseFuture) else None

        def drop(cancelled: bool = False) -> None:  # commit every slot as failed: nothing half written becomes readable
            self.connection.submit(m.CommitWrite(self.instance_id, rep.reservation_id, [s.index for s in rep.slots],
                                                 abandoned=cancelled))

        if layered is None:
            if not outer.set_running_or_notify_cancel():  # cancelled before its copy: none happens
                drop(cancelled=True)
                self._commit_sent()
                return
        else:
            # layer by layer, the future runs once its first part is copied (after the caller's
            # first layer_ready), or once the core ends it otherwise (claim): until then it may
            # be cancelled, which gives the slots back
            def cancelled(f: Future[Any]) -> None:
                if f.cancelled():
                    try:
                        drop(cancelled=True)
                    finally:
                        self._commit_sent()

            outer.add_done_callback(cancelled)
            if outer.cancelled():
                return
        started = time.perf_counter()

        def claim() -> bool:
            """The request is the core's to end (False: the caller cancelled it, and the
            cancellation gave its slots back)."""
            return layered is None or layered.running() or layered.set_running_or_notify_cancel()

        def committed(f: Future[m.StoreResult]) -> None:
            try:
                res = f.result()
                outer.set_result(m.StoreResult(res.stored, sorted(rep.present), sorted(rep.no_space + res.failed)))
            except (NoSession, UnknownInstance, InvalidRequest) as exc:
                if self._stale(epoch):  # its reservation went with a session since replaced: nothing stored
                    outer.set_result(m.StoreResult([], [], list(range(len(transfer.keys)))))
                else:
                    outer.set_exception(exc)
            except BaseException as exc:  # noqa: BLE001  (the caller's future carries it)
                outer.set_exception(exc)

        def commit() -> None:
            if not claim():
                return
            try:  # the copy's time (gather and its waiter) goes to the server's figures
                copy_s = time.perf_counter() - started if rep.slots else 0.0
                # resolved on the thread that reads the reply (the caller's callbacks still run
                # on the finisher: TransferFuture), so that a waiting caller wakes at once
                self.connection.submit(m.CommitWrite(self.instance_id, rep.reservation_id,
                                                     copy_s=copy_s)).add_done_callback(committed)
            except BaseException as exc:  # noqa: BLE001  (the caller's future carries it)
                outer.set_exception(exc)
            finally:
                self._commit_sent()

        def abandon(exc: BaseException) -> None:
            if not claim():
                return
            try:
                drop()
            finally:
                outer.set_exception(exc)
                self._commit_sent()

        stale = self._stale(epoch)
        if not rep.slots and not stale:
            self._then(None, commit, abandon)
            return
        try:
            slots = self._slots_of(epoch, rep.slots)
            if slots is None:  # an answer of a replaced session (its "present" too): nothing is stored
                if claim():
                    log.info("%s: a store's slots came from a session this client has since replaced (the server "
                             "restarted, or the session was resumed on a new connection): nothing stored",
                             self.transport_name)
                    with contextlib.suppress(Exception):  # a resumed session's server parked the write:
                        drop()  # only its commit frees it (another session's server answers it with an error)
                    outer.set_result(m.StoreResult([], [], list(range(len(transfer.keys)))))
                    self._commit_sent()
                return
            copies = plan_copies(self.layout, self.chunk_size, transfer.blocks, slots, rows=rows)
        except BaseException:
            if not claim():
                return  # cancelled meanwhile: its slots were given back
            drop()
            raise
        self._copy_parts(self.gather, "gather", copies, transfer, layered,
                         lambda waiter: self._then(waiter, commit, abandon), abandon)

    def _retrieve(self, reserved: Callable[[], tuple[m.ReserveReadReply, float, int]], transfer: Transfer,
                  first: int, outer: Future[m.RetrieveResult]) -> None:
        from kvxfer.transport.contract import LayerwiseFuture

        rows = self._rows_early(transfer)
        rep, sent_at, epoch = reserved()
        keys = transfer.keys
        layered = outer if isinstance(outer, LayerwiseFuture) else None

        def unpin(copy_s: float = 0.0, loaded: bool = False) -> Future[m.Empty]:  # and release the lease
            return self.connection.submit(m.CommitRead(self.instance_id, rep.reservation_id, copy_s, loaded))

        if not outer.set_running_or_notify_cancel():  # cancelled before its copy: the blocks stay untouched
            unpin()
            return
        started = time.perf_counter()
        lost = {i + first for i in rep.missing}
        result = m.RetrieveResult([i for i in range(len(keys)) if i not in lost], sorted(lost))

        def committed(f: Future[m.Empty]) -> None:
            try:
                f.result()
            except (NoSession, UnknownInstance, InvalidRequest):
                # the server dropped the reservation while we copied (this client went silent past
                # the session timeout, or the server restarted: a new session has no such
                # reservation): its slots may have been reused under the copy, so nothing read
                # counts as loaded
                outer.set_result(m.RetrieveResult(list(range(first)), list(range(first, len(keys)))))
            except BaseException as exc:  # noqa: BLE001  (the caller's future carries it)
                outer.set_exception(exc)
            else:
                outer.set_result(result)

        since = [sent_at]

        def in_time() -> bool:
            # The server keeps a session, and so the reservation's pins, for session_timeout after
            # the last request it got from it, here at the latest the reserve (sent after sent_at).
            # A copy that starts and ends well within that cannot read reused slots. Past that,
            # a ping answered on the same session (no handshake since the reserve: a resumed
            # session's reads are parked, and their pins go a session timeout after the reserve)
            # shows the session, so the pins, lived until it was sent: the clock starts again there.
            if time.monotonic() - since[0] < self.connection.session_timeout / 2:
                return True
            asked = time.monotonic()
            if self.connection.epoch == epoch:
                try:
                    self.connection.request(m.Ping(), timeout=self.connection.session_timeout / 2)
                except KvxferError:  # the session is gone (or the server): the pins may have lapsed
                    pass
                else:
                    if self.connection.epoch == epoch:
                        since[0] = asked
                        return True
            late.append(True)
            return False

        late: list[bool] = []

        def commit() -> None:
            # Resolved as soon as the commit is submitted (not answered) when every copy ended in
            # time. Submitted first, so that whatever the caller sends next reaches the server
            # after the unpin (Connection.submit keeps order).
            if late:
                # a copy was not made (its pins may have lapsed before it: the blocks are left
                # as they were), or a layer-wise part ended late (the process was frozen, say: its
                # layers were never marked landed): nothing the request read counts as loaded
                try:
                    unpin(loaded=False)
                finally:
                    outer.set_result(m.RetrieveResult(list(range(first)), list(range(first, len(keys)))))
                return
            landed_in_time = in_time()
            try:  # the copy's time (scatter and its waiter) goes to the server's figures
                reply = unpin(time.perf_counter() - started if rep.slots else 0.0, loaded=True)
            except BaseException as exc:  # noqa: BLE001  (the caller's future carries it)
                outer.set_exception(exc)
                return
            if landed_in_time:
                reply.add_done_callback(self._log_late_commit)
                outer.set_result(result)
            else:
                reply.add_done_callback(committed)

        def abandon(exc: BaseException) -> None:
            try:
                unpin()
            finally:
                outer.set_exception(exc)

        if not rep.slots:
            self._then(None, commit, abandon)
            return
        try:
            slots = self._slots_of(epoch, rep.slots, first)
            if slots is None:  # pinned in a session since replaced: the blocks stay untouched
                log.info("%s: a retrieve's slots came from a session this client has since replaced (the server "
                         "restarted, or the session was resumed on a new connection): nothing loaded",
                         self.transport_name)
                unpin()
                outer.set_result(m.RetrieveResult(list(range(first)), list(range(first, len(keys)))))
                return
            copies = plan_copies(self.layout, self.chunk_size, transfer.blocks, slots, transfer.skip_blocks, rows=rows)
        except BaseException:
            unpin()
            raise
        self._copy_parts(self.scatter, "scatter", copies, transfer, layered,
                         lambda waiter: self._then(waiter, commit, abandon), abandon, in_time)

    def _log_late_commit(self, reply: Future[m.Empty]) -> None:
        """A retrieve that resolved before its commit_read was answered: report a failure."""
        exc = reply.exception()
        if exc is not None:
            log.warning("%s: unpinning a finished retrieve failed (the server frees its pins when the "
                        "session or reservation goes): %s", self.transport_name, exc)

    def _drain(self) -> None:
        """Wait until the finisher has sent every commit left to it."""
        with self._late_done:
            self._late_done.wait_for(lambda: self._late == 0)


def _over(state: dict[str, Any]) -> None:
    """A layer-wise transfer's parts are all queued or given up (lock held): drop what
    :meth:`ClientDrivenCore._copy_parts`'s ``queue`` reaches its next part through."""
    state["over"] = True
    state.pop("advance", None)
