"""What the core does for both data-path styles, so that transports stay small.

* :func:`check_transfer` validates a store or retrieve request (both sides call it);
* :func:`plan_copies` turns block ids and arena slots into :class:`RowCopy` lists;
* :class:`TransferContextBase` runs a context's transfers in order on its worker thread,
  registers, re-registers after a server restart, and unregisters on close;
* :class:`ClientDrivenContext` implements store/retrieve with reserve/commit requests around
  two transport methods, ``gather`` and ``scatter``;
* :class:`ServerDrivenContext` implements them with ``store``/``retrieve`` requests carrying
  the transport's per-request params;
* :class:`ArenaServerTransport` is the server half of every client-driven transport.
"""

from __future__ import annotations

import logging
import threading
from abc import abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar, TypeVar

import msgspec
import torch

from kvxfer.errors import ConfigError, KvxferError, NoSession, UnknownInstance
from kvxfer.layout import KVLayout
from kvxfer.protocol import codec
from kvxfer.protocol import messages as m
from kvxfer.server.arena import ArenaMapping
from kvxfer.transport.base import (
    Connection,
    InstanceIdentity,
    RowCopy,
    ServerContext,
    ServerTransport,
    TransferContext,
    Waiter,
)

__all__ = [
    "check_transfer",
    "plan_copies",
    "TransferContextBase",
    "ClientDrivenContext",
    "ServerDrivenContext",
    "ArenaServerTransport",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Most chunks one request may name.
MAX_CHUNKS_PER_REQUEST = 1 << 14


def check_transfer(
    layout: KVLayout,
    chunk_size: int,
    n_keys: int,
    block_ids: Sequence[int] | torch.Tensor,
    skip_first_n_tokens: int = 0,
) -> torch.Tensor:
    """Validate a transfer's block ids; returns them as an int64 CPU tensor.

    Raises :class:`ConfigError` (client side) naming what is wrong: block count, range, skip.
    """
    bpc = layout.blocks_per_chunk(chunk_size)
    if n_keys > MAX_CHUNKS_PER_REQUEST:
        raise ConfigError(f"{n_keys} chunks in one request; at most {MAX_CHUNKS_PER_REQUEST}")
    try:
        blocks = torch.as_tensor(block_ids, dtype=torch.int64, device="cpu").reshape(-1)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"block_ids must be a sequence of integers: {exc}") from None
    if blocks.numel() != n_keys * bpc:
        raise ConfigError(
            f"{n_keys} chunks of {chunk_size} tokens need {n_keys * bpc} block ids "
            f"({bpc} per chunk at block_size {layout.block_size}), got {blocks.numel()}"
        )
    if blocks.numel() and (int(blocks.min()) < 0 or int(blocks.max()) >= layout.num_blocks):
        raise ConfigError(
            f"block ids must be in [0, {layout.num_blocks}); got min {int(blocks.min())}, max {int(blocks.max())}"
        )
    if skip_first_n_tokens < 0 or skip_first_n_tokens % layout.block_size:
        raise ConfigError(
            f"skip_first_n_tokens must be a non-negative multiple of the block size "
            f"{layout.block_size}, got {skip_first_n_tokens}"
        )
    return blocks


def plan_copies(
    layout: KVLayout,
    chunk_size: int,
    blocks: torch.Tensor,
    slots: Sequence[tuple[int, torch.Tensor]],
    skip_blocks: int = 0,
) -> list[RowCopy]:
    """RowCopies for ``slots`` (``(chunk index, uint8 slot tensor)``), skipping the first
    ``skip_blocks`` blocks of the request. A chunk with a partial skip gives one copy per run
    (the slot rows it needs are not contiguous across runs); fully skipped chunks none."""
    bpc = layout.blocks_per_chunk(chunk_size)
    copies = []
    for index, slot in slots:
        local_skip = min(bpc, max(0, skip_blocks - index * bpc))
        if local_skip == bpc:
            continue
        chunk_blocks = blocks[index * bpc + local_skip:(index + 1) * bpc]
        view = layout.chunk_rows_view(slot, chunk_size)  # [L, runs * bpc, row_elems]
        if local_skip == 0:
            copies.append(RowCopy(layout.rows(chunk_blocks), view))
            continue
        runs = view.view(layout.num_layers, layout.runs, bpc, layout.row_elems)
        rows = layout.rows(chunk_blocks).view(layout.runs, -1)
        for r in range(layout.runs):
            copies.append(RowCopy(rows[r], runs[:, r, local_skip:]))
    return copies


class TransferContextBase(TransferContext):
    """Ordering, validation, registration and close for both styles."""

    #: The transport's Registration subclass (set by the transport's context class).
    registration_type: ClassVar[type[m.Registration]] = m.Registration
    #: Names the second thread, which finishes requests after the worker (see each style).
    _finisher_role: ClassVar[str] = "done"

    def __init__(
        self,
        transport_name: str,
        connection: Connection,
        layers: list[torch.Tensor],
        layout: KVLayout,
        identity: InstanceIdentity,
    ) -> None:
        self.transport_name = transport_name
        self.connection = connection
        self.layers = layers
        self.layout = layout
        self.identity = identity
        self.instance_id = identity.instance_id
        self.chunk_size = connection.chunk_size
        self.blocks_per_chunk = layout.blocks_per_chunk(self.chunk_size)
        self.chunk_bytes = layout.chunk_bytes(self.chunk_size)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"kvxfer-{transport_name}-{identity.rank}")
        self._finisher = ThreadPoolExecutor(1, thread_name_prefix=f"kvxfer-{transport_name}-{self._finisher_role}")
        self._closed = False
        self._registered = False
        self.epoch = -1
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ registration

    def registration_extra(self) -> dict[str, Any]:
        """Transport fields of the registration besides identity and layout."""
        return {}

    def registration(self) -> m.Registration:
        return self.registration_type(**self.identity.registration_fields(self.layout), **self.registration_extra())

    def register(self) -> None:
        reg = self.registration()
        self.connection.request(
            "register", m.Register(self.transport_name, msgspec.Raw(codec.encode(reg)))
        )
        self._registered = True
        self.epoch = getattr(self.connection, "epoch", 0)

    def on_reconnect(self) -> None:
        """The client re-opened its session (the server restarted): register again."""
        self.register()

    def _request(self, name: str, payload: msgspec.Struct) -> Any:
        """Send and wait; after a server restart, register again and send once more."""
        try:
            return self.connection.request(name, payload)
        except (NoSession, UnknownInstance):
            return self._resend(name, payload)

    def _resend(self, name: str, payload: msgspec.Struct) -> Any:
        """The server lost this context (it restarted): register again and send once more."""
        reconnect = getattr(self.connection, "reconnect", None)
        if reconnect is None:
            raise UnknownInstance(f"instance {self.instance_id} is not registered any more")
        reconnect(self)
        return self.connection.request(name, payload)

    # ------------------------------------------------------------------ submit

    def _submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        with self._lock:
            if self._closed:
                raise ConfigError(f"transfer context {self.instance_id} ({self.transport_name}) is closed")
            return self._executor.submit(fn, *args)

    def submit_store(self, keys: Sequence[bytes], block_ids: Sequence[int] | torch.Tensor) -> Future[m.StoreResult]:
        keys = list(keys)
        blocks = check_transfer(self.layout, self.chunk_size, len(keys), block_ids)
        return self._submit_store(keys, blocks)

    def submit_retrieve(
        self,
        keys: Sequence[bytes],
        block_ids: Sequence[int] | torch.Tensor,
        skip_first_n_tokens: int = 0,
        lease_id: int = 0,
    ) -> Future[m.RetrieveResult]:
        keys = list(keys)
        blocks = check_transfer(self.layout, self.chunk_size, len(keys), block_ids, skip_first_n_tokens)
        return self._submit_retrieve(keys, blocks, skip_first_n_tokens // self.layout.block_size, lease_id)

    @abstractmethod
    def _submit_store(self, keys: list[bytes], blocks: torch.Tensor) -> Future[m.StoreResult]:
        """Start a validated store; the style's base class implements it."""

    @abstractmethod
    def _submit_retrieve(self, keys: list[bytes], blocks: torch.Tensor, skip_blocks: int,
                         lease_id: int) -> Future[m.RetrieveResult]:
        """Start a validated retrieve; the style's base class implements it."""

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._executor.shutdown(wait=True)
        self._drain()
        if self._registered:
            try:
                # no longer than the client's own timeout: a dead server must not stall shutdown
                timeout = min(10.0, float(getattr(self.connection, "timeout", 10.0)))
                self.connection.request("unregister", m.Unregister(self.instance_id), timeout=timeout)
            except (KvxferError, ConnectionError):
                pass  # the server is gone or already dropped us: nothing left to release there
        self._registered = False
        detach = getattr(self.connection, "forget", None)
        if detach is not None:
            detach(self)
        self.release()
        self._finisher.shutdown(wait=True)

    def _drain(self) -> None:
        """Wait for transfers still in flight after the worker is idle (none by default)."""

    def release(self) -> None:
        """Free client-side resources (mappings, pinned memory). Called once by close()."""


class ClientDrivenContext(TransferContextBase):
    """Base of client-driven transports: the client copies between its KV cache and the arena.

    Subclasses implement :meth:`gather` and :meth:`scatter`. Store: ``reserve_write`` ->
    ``gather`` into the slots -> ``commit_write``. Retrieve: ``reserve_read`` -> ``scatter`` ->
    ``commit_read``. If a copy raises, the reservation is committed as failed (nothing half
    written becomes readable) and the future raises.
    """

    _finisher_role: ClassVar[str] = "commit"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.arena = self.map_arena()
        #: Queued requests whose reserve is not sent yet / stores whose commit is not sent yet.
        self._deferred = 0
        self._uncommitted = 0
        #: Requests handed to the finisher (their copy's waiter, then their commit), not done yet.
        self._late = 0
        self._late_done = threading.Condition()

    def map_arena(self) -> ArenaMapping:
        return ArenaMapping(self.connection.arena_path, self.connection.arena_size)

    def on_reconnect(self) -> None:
        self._drain()  # copies still in flight must land before their slots are unmapped
        self.unmap_arena()
        self.arena = self.map_arena()
        super().on_reconnect()

    def unmap_arena(self) -> None:
        self.arena.close()

    def release(self) -> None:
        self.unmap_arena()

    @abstractmethod
    def gather(self, copies: list[RowCopy]) -> Waiter | None:
        """Copy, for every layer ``l``, ``row_view(layers[l])[copy.rows]`` into ``copy.slot[l]``.

        Return None once the bytes are in the slots, or a *waiter*: a callable that returns once
        they are (raising if the copy failed). The core calls a waiter off the worker thread and
        commits after it, so the next request's copies can be queued meanwhile; the transport
        must then order consecutive requests' copies itself (e.g. on one stream)."""

    @abstractmethod
    def scatter(self, copies: list[RowCopy]) -> Waiter | None:
        """Copy, for every layer ``l``, ``copy.slot[l]`` into ``row_view(layers[l])[copy.rows]``.
        Return None once the slots have been read and the engine can read the blocks (or its
        stream is ordered after the copy), or a waiter that returns once that is so."""

    # Each request's reserve is sent when it is submitted (so its round trip overlaps the copies
    # of requests ahead of it); the worker waits for the reply, copies, and sends the commit
    # without waiting (so it can start the next copy). A copy that returns a waiter leaves the
    # wait and the commit to the finisher thread; once one does, later requests commit there too
    # until it is idle, so commits keep request order. A request resolves when its commit is
    # answered: a store's chunks are then readable, a retrieve's read pins and lease released.

    def _submit_store(self, keys: list[bytes], blocks: torch.Tensor) -> Future[m.StoreResult]:
        outer: Future[m.StoreResult] = Future()
        self._send_then(m.ReserveWrite(self.instance_id, keys), self._store, keys, blocks, outer)
        return outer

    def _submit_retrieve(self, keys: list[bytes], blocks: torch.Tensor, skip_blocks: int,
                         lease_id: int) -> Future[m.RetrieveResult]:
        outer: Future[m.RetrieveResult] = Future()
        first = min(len(keys), skip_blocks // self.blocks_per_chunk)  # chunks wholly skipped need no read
        self._send_then(m.ReserveRead(self.instance_id, keys[first:], lease_id), self._retrieve,
                        keys, blocks, skip_blocks, first, outer)
        return outer

    def _send_then(self, reserve: m.ReserveWrite | m.ReserveRead, job: Callable[..., None], *args: Any) -> None:
        """Queue ``job(reserved, *args)`` on the worker, in order, and send ``reserve`` now when
        that keeps submission order (no earlier request waits to send its reserve, and, for a
        read, no earlier store is uncommitted); otherwise the job sends it when it runs (a read
        once the commits left to the finisher are sent). The job always runs, and calls
        ``reserved()`` for the reply (which raises if the reserve failed)."""
        write = isinstance(reserve, m.ReserveWrite)
        name = "reserve_write" if write else "reserve_read"
        outer: Future[Any] = args[-1]

        def run(reply: Future[Any] | None) -> None:
            def reserved() -> Any:
                if reply is not None:
                    return self._reserved(reply, name, reserve)
                try:
                    if not write:  # the stores ahead must be committed before a read reserves
                        with self._late_done:
                            self._late_done.wait_for(lambda: self._late == 0)
                    return self._request(name, reserve)
                finally:
                    with self._lock:
                        self._deferred -= 1

            try:
                job(reserved, *args)
            except BaseException as exc:
                if not outer.done():
                    outer.set_exception(exc)
                if write:  # the job never reached its commit
                    self._commit_sent()

        with self._lock:
            if self._closed:
                raise ConfigError(f"transfer context {self.instance_id} ({self.transport_name}) is closed")
            early = self._deferred == 0 and (write or self._uncommitted == 0)
            reply = self.connection.submit(name, reserve) if early else None
            self._executor.submit(run, reply)  # its job takes self._lock: counts are in first
            if not early:
                self._deferred += 1
            if write:
                self._uncommitted += 1

    def _commit_sent(self) -> None:
        with self._lock:
            self._uncommitted -= 1

    def _reserved(self, reply: Future[Any], name: str, payload: msgspec.Struct) -> Any:
        """The reserve's reply; after a server restart, register again and reserve once more."""
        try:
            return reply.result()
        except (NoSession, UnknownInstance):
            return self._resend(name, payload)

    def _slots(self, slots: list[m.Slot], nbytes: int, shift: int = 0) -> list[tuple[int, torch.Tensor]]:
        return [(s.index + shift, self.arena.view(s.offset, nbytes)) for s in slots]

    def _then(self, waiter: Waiter | None, commit: Callable[[], None], abandon: Callable[[BaseException], None]) -> None:
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
                except BaseException as exc:
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

    def _store(self, reserved: Callable[[], m.ReserveWriteReply], keys: list[bytes], blocks: torch.Tensor,
               outer: Future[m.StoreResult]) -> None:
        rep = reserved()
        nbytes = self.chunk_bytes

        def drop() -> None:  # commit every slot as failed: nothing half written becomes readable
            self.connection.submit("commit_write", m.CommitWrite(
                self.instance_id, rep.reservation_id, [s.index for s in rep.slots]))

        try:
            waiter = self.gather(plan_copies(self.layout, self.chunk_size, blocks,
                                             self._slots(rep.slots, nbytes))) if rep.slots else None
        except BaseException:
            drop()
            raise

        def committed(f: Future[m.StoreResult]) -> None:
            try:
                res = f.result()
                outer.set_result(m.StoreResult(res.stored, sorted(rep.present), sorted(rep.no_space + res.failed)))
            except BaseException as exc:
                outer.set_exception(exc)

        def commit() -> None:
            try:
                self._resolve(self.connection.submit("commit_write", m.CommitWrite(self.instance_id,
                                                                                  rep.reservation_id)), committed)
            except BaseException as exc:
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

    def _retrieve(self, reserved: Callable[[], m.ReserveReadReply], keys: list[bytes], blocks: torch.Tensor,
                  skip_blocks: int, first: int, outer: Future[m.RetrieveResult]) -> None:
        rep = reserved()
        nbytes = self.chunk_bytes

        def unpin() -> Future[m.Empty]:  # and release the lease for this rank
            return self.connection.submit("commit_read", m.CommitRead(self.instance_id, rep.reservation_id))

        try:
            waiter = self.scatter(plan_copies(self.layout, self.chunk_size, blocks,
                                              self._slots(rep.slots, nbytes, first), skip_blocks)) \
                if rep.slots else None
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
            except BaseException as exc:
                outer.set_exception(exc)
            else:
                outer.set_result(m.RetrieveResult([i for i in range(len(keys)) if i not in lost], sorted(lost)))

        def commit() -> None:
            try:
                self._resolve(unpin(), committed)
            except BaseException as exc:
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


class ServerDrivenContext(TransferContextBase):
    """Base of server-driven transports: requests carry block ids; the server copies.

    Per request, on the context's worker thread and in submission order, :meth:`prepare_store`
    or :meth:`prepare_retrieve` makes the transport's params (a Struct the server's
    :class:`ServerContext` decodes with its ``params_type``) and the request is sent. When its
    reply arrives, on a second thread and in the same order, :meth:`finish_retrieve` runs (e.g.
    make the engine's stream wait, or place staged bytes), then :meth:`release_params` runs,
    failed or not, and only then does the future resolve.

    ``max_in_flight`` requests may be at the server at once. With 1 (the default), a request is
    prepared only after the previous one finished, so params may name per-context resources.
    With more, the server starts the next copy while a reply travels back (the fixed cost of a
    request overlaps the previous copy); the transport's prepare/finish must then tolerate
    overlapping requests. A retrieve is never sent before the stores sent ahead of it are
    answered: the server reserves a retrieve's chunks when it arrives, and must find them stored.
    """

    max_in_flight: ClassVar[int] = 1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._window = threading.BoundedSemaphore(self.max_in_flight)
        self._stores_out = 0
        self._stores_answered = threading.Condition()

    def store_params(self) -> msgspec.Struct | None:
        return None

    def retrieve_params(self) -> msgspec.Struct | None:
        return None

    def after_retrieve(self, params: msgspec.Struct | None) -> None:
        """Runs once the server has answered a retrieve, before its future resolves."""

    def prepare_store(self, keys: list[bytes], blocks: torch.Tensor) -> msgspec.Struct | None:
        """The params of a store of ``keys`` from ``blocks`` (int64, CPU), made right before the
        request is sent. Default: :meth:`store_params`."""
        return self.store_params()

    def prepare_retrieve(self, keys: list[bytes], blocks: torch.Tensor, skip_blocks: int) -> msgspec.Struct | None:
        """The params of a retrieve into ``blocks`` whose first ``skip_blocks`` blocks are left
        alone. Default: :meth:`retrieve_params`."""
        return self.retrieve_params()

    def finish_retrieve(self, params: msgspec.Struct | None, result: m.RetrieveResult, blocks: torch.Tensor,
                        skip_blocks: int) -> None:
        """Runs once the server answered a retrieve, before its future resolves; only the chunks
        in ``result.loaded`` may be written. Default: :meth:`after_retrieve`."""
        self.after_retrieve(params)

    def release_params(self, params: msgspec.Struct | None) -> None:
        """Runs after every request (answered, failed or timed out), before its future resolves,
        with the params it was sent with: free what :meth:`prepare_store` /
        :meth:`prepare_retrieve` took. An exception here fails a request that had succeeded."""

    @staticmethod
    def _raw(params: msgspec.Struct | None) -> msgspec.Raw:
        return msgspec.Raw(codec.encode(params)) if params is not None else m.NO_PARAMS

    def _submit_store(self, keys: list[bytes], blocks: torch.Tensor) -> Future[m.StoreResult]:
        def send() -> tuple[str, msgspec.Struct, msgspec.Struct | None]:
            params = self.prepare_store(keys, blocks)
            payload = m.Store(self.instance_id, keys, blocks.tolist(), self._raw(params))
            with self._stores_answered:
                self._stores_out += 1  # from here on, done() runs answered() exactly once
            return "store", payload, params

        def answered() -> None:
            with self._stores_answered:
                self._stores_out -= 1
                self._stores_answered.notify_all()

        return self._pipelined(send, lambda res, params: res, answered)

    def _submit_retrieve(self, keys: list[bytes], blocks: torch.Tensor, skip_blocks: int,
                         lease_id: int) -> Future[m.RetrieveResult]:
        def send() -> tuple[str, msgspec.Struct, msgspec.Struct | None]:
            with self._stores_answered:  # a retrieve must not overtake the stores ahead of it
                self._stores_answered.wait_for(lambda: self._stores_out == 0)
            params = self.prepare_retrieve(keys, blocks, skip_blocks)
            return "retrieve", m.Retrieve(self.instance_id, keys, blocks.tolist(), skip_blocks * self.layout.block_size,
                                          lease_id, self._raw(params)), params

        def finish(res: m.RetrieveResult, params: msgspec.Struct | None) -> m.RetrieveResult:
            self.finish_retrieve(params, res, blocks, skip_blocks)
            return res

        return self._pipelined(send, finish)

    def _pipelined(
        self,
        send: Callable[[], tuple[str, msgspec.Struct, msgspec.Struct | None]],
        finish: Callable[[Any, msgspec.Struct | None], T],
        answered: Callable[[], None] | None = None,
    ) -> Future[T]:
        """Prepare and send on the worker (waiting for a free place in the window), finish on
        the finisher thread in reply order. After a server restart the request is sent once
        more, synchronously, once the context is registered again."""
        outer: Future[T] = Future()

        def done(reply: Future[Any], name: str, payload: msgspec.Struct, params: msgspec.Struct | None) -> None:
            value: Any = None
            error: BaseException | None = None
            try:
                try:
                    res = reply.result()
                except (NoSession, UnknownInstance):
                    res = self._resend(name, payload)
                value = finish(res, params)
            except BaseException as exc:
                error = exc
            try:  # the params' resources are free before the caller sees the result
                self.release_params(params)
            except BaseException as exc:
                error = error or exc
            finally:
                if answered is not None:
                    answered()
                self._window.release()
            if error is not None:
                outer.set_exception(error)
            else:
                outer.set_result(value)

        def start() -> None:
            self._window.acquire()
            try:
                name, payload, params = send()
            except BaseException as exc:
                self._window.release()
                outer.set_exception(exc)
                return
            try:
                reply = self.connection.submit(name, payload)
            except BaseException as exc:
                done_now: Future[Any] = Future()
                done_now.set_exception(exc)
                self._finisher.submit(done, done_now, name, payload, params)
                return
            reply.add_done_callback(lambda f: self._finisher.submit(done, f, name, payload, params))

        self._submit(start)
        return outer

    def _drain(self) -> None:
        """Wait until every sent request has finished (their replies have deadlines)."""
        for _ in range(self.max_in_flight):
            self._window.acquire()
        for _ in range(self.max_in_flight):
            self._window.release()


class _ArenaOnlyContext(ServerContext):
    """Client-driven registrations need nothing on the server beyond the core's bookkeeping."""


class ArenaServerTransport(ServerTransport):
    """The server half of every client-driven transport: validation and slots, no copies."""

    def open(self, registration: m.Registration, layout: KVLayout) -> ServerContext:
        return _ArenaOnlyContext()
