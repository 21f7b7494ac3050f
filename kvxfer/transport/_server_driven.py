"""Private: the server-driven data path (requests carry block ids; the server copies).

Per request, on the context's worker and in submission order: wait for a place in the window
of ``max_in_flight`` requests (a retrieve also waits until the stores ahead are answered), call
the transport's ``prepare``, send; or, for a transport whose ``prepare`` is cheap
(``prepare_inline``), on the submitting thread when nothing is queued ahead, a place is free and
nothing needs waiting for (a lone request then skips the hand-off to the worker). When the
reply arrives, on the finisher and in reply order: ``finish_retrieve`` (retrieves),
``release_params`` (every request), then the future resolves.
After a server restart the request is sent once more, synchronously, once the context is
registered again. A request's future can be cancelled until it is sent; then it is never sent
(its params are released). A store or retrieve carries a time a little before its client stops
waiting for the reply (``Store.deadline``, ``Retrieve.deadline``): a server that reaches the copy
later copies nothing. The params of a request whose answer the client stopped waiting for are
released once the server answers it late (or the session is opened anew, or the context
closes), not before: the server may still copy with them. A layer-wise
retrieve is sent as one request per group of layers (``Retrieve.layers``, servers with the
``retrieve_layers`` feature), each layer landed when its request is answered; a layer-wise
store as one request once every layer is written.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import msgspec

from kvxfer.errors import RemoteError, RequestTimeout
from kvxfer.protocol import codec
from kvxfer.protocol import messages as m
from kvxfer.transport._context import ContextCore, check_each_told_once

if TYPE_CHECKING:
    from kvxfer.transport.contract import Transfer

__all__ = ["ServerDrivenCore"]

T = TypeVar("T")

#: Most requests a context keeps the params of while their late answer may come (see _late_params).
_UNANSWERED_KEPT = 64


class ServerDrivenCore(ContextCore):
    """The machinery of :class:`~kvxfer.transport.contract.ServerDrivenContext`."""

    max_in_flight: ClassVar[int] = 1
    #: A layer-wise retrieve is this many requests at most (each a range of layers).
    max_layer_parts: ClassVar[int] = 8
    #: A layer-wise store is one request, sent once every layer is written: one token.
    _token_per_part: ClassVar[bool] = False
    #: See :attr:`~kvxfer.transport.contract.ServerDrivenContext.prepare_inline`.
    prepare_inline: ClassVar[bool] = False
    _core_names: ClassVar[frozenset[str]] = ContextCore._core_names | {"_window", "_jobs", "_stores_out",
                                                                       "_stores_answered", "_late_params"}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._window = threading.BoundedSemaphore(self.max_in_flight)
        #: Requests queued on the worker and not sent yet (under the context's lock).
        self._jobs = 0
        self._stores_out = 0
        self._stores_answered = threading.Condition()
        #: Requests whose answer the client stopped waiting for (their futures failed with
        #: RequestTimeout): id of the request sent -> (request, transfer, params, release). Their params
        #: are released once the server answers them late, the session is opened anew or the
        #: context closes (until then the server may still copy with what they name); the oldest
        #: past _UNANSWERED_KEPT is released at once, as not done (``Transfer.server_done``).
        self._late_params: collections.OrderedDict[
            int, tuple[Any, Transfer, Any, Callable[[Any], BaseException | None]]] = collections.OrderedDict()
        self._seal()

    # ------------------------------------------------------------------ hooks (see the contract)

    def prepare(self, transfer: Transfer) -> Any:
        raise NotImplementedError

    def finish_retrieve(self, transfer: Transfer, params: Any, result: m.RetrieveResult) -> None:
        raise NotImplementedError

    def release_params(self, transfer: Transfer, params: Any) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ requests

    @staticmethod
    def _raw(params: msgspec.Struct | None) -> msgspec.Raw:
        return msgspec.Raw(codec.encode(params)) if params is not None else m.NO_PARAMS

    def _start_store(self, transfer: Transfer, outer: Future[m.StoreResult]) -> Future[m.StoreResult]:
        from kvxfer.transport.contract import LayerwiseFuture

        def send(params: msgspec.Struct | None) -> m.Store:
            with self._stores_answered:
                self._stores_out += 1  # from here on, done() runs answered() exactly once
            return m.Store(self.instance_id, transfer.keys, transfer.blocks.tolist(), self._raw(params),
                           self._deadline())

        def answered() -> None:
            with self._stores_answered:
                self._stores_out -= 1
                self._stores_answered.notify_all()

        if not isinstance(outer, LayerwiseFuture):
            return self._pipelined(transfer, send, lambda res, params: res, answered, outer=outer)
        layered = outer
        started = threading.Lock()

        def when_ready() -> None:  # one request, queued once every layer is written (its token then)
            ready, token = layered.ready(self.layout.num_layers)
            if not ready and layered.abandoned is None:
                return
            if not started.acquire(blocking=False):
                return  # queued already
            if not ready:
                if layered.set_running_or_notify_cancel():  # not cancelled meanwhile
                    layered.set_exception(layered.abandoned)
                return
            transfer.token = token
            try:
                self._pipelined(transfer, send, lambda res, params: res, answered, outer=outer)
            except BaseException as exc:  # noqa: BLE001  (closed meanwhile: the caller's future carries it)
                if not outer.done():
                    outer.set_exception(exc)

        layered.on_ready(when_ready)
        when_ready()
        return outer

    def _start_retrieve(self, transfer: Transfer, lease_id: int,
                        outer: Future[m.RetrieveResult]) -> Future[m.RetrieveResult]:
        from kvxfer.transport.contract import LayerwiseFuture

        groups = self._layer_groups(self._transfer_bytes(transfer)) if isinstance(outer, LayerwiseFuture) else []
        if len(groups) < 2 or "retrieve_layers" not in self.connection.features:
            return self._retrieve_part(transfer, lease_id, outer)
        # one request per group of layers, in order; each its own token (the first is the
        # submit's); the lease goes with the last, so that it holds the chunks for every part
        assert isinstance(outer, LayerwiseFuture)
        parts = [dataclasses.replace(transfer, layers=groups[0])]
        parts += [dataclasses.replace(transfer, token=self._token("retrieve"), layers=group) for group in groups[1:]]
        results: list[m.RetrieveResult | BaseException | None] = [None] * len(groups)
        left = [len(groups)]
        lock = threading.Lock()
        started = _Started(outer)
        futs: list[Future[m.RetrieveResult]] = [_Part(started) for _ in groups]

        def part_done(i: int, f: Future[m.RetrieveResult]) -> None:
            exc = CancelledError() if f.cancelled() else f.exception()
            results[i] = exc if exc is not None else f.result()
            if exc is None:
                outer.mark_landed(groups[i])
            elif not f.cancelled():  # the transfer has failed: the parts not sent yet never are (a
                for other in futs:  # lease the last would have released expires on its own)
                    other.cancel()
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if not last:
                return
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                outer.set_exception(next((e for e in errors if not isinstance(e, CancelledError)), errors[0]))
                return
            got = [r for r in results if isinstance(r, m.RetrieveResult)]
            missed = set().union(*(r.missing for r in got))  # a chunk any part missed is not loaded
            loaded = [i for i in range(len(transfer.keys)) if i not in missed]
            outer.set_result(m.RetrieveResult(loaded, sorted(missed)))

        for i, (part, fut) in enumerate(zip(parts, futs)):
            fut.add_done_callback(functools.partial(part_done, i))
            self._retrieve_part(part, lease_id if i == len(groups) - 1 else 0, fut)
        return outer

    def _retrieve_part(self, transfer: Transfer, lease_id: int,
                       outer: Future[m.RetrieveResult]) -> Future[m.RetrieveResult]:
        """One retrieve request: the whole transfer, or the part of a layer-wise one that
        ``transfer.layers`` names (the server copies those layers, the hooks see them)."""
        skip_tokens = transfer.skip_blocks * self.layout.block_size
        layers = transfer.layers
        span = [layers.start, layers.stop] if layers is not None else []

        def wait_for_stores() -> None:  # a retrieve must not overtake the stores ahead of it
            with self._stores_answered:
                self._stores_answered.wait_for(lambda: self._stores_out == 0)

        def send(params: msgspec.Struct | None) -> m.Retrieve:
            return m.Retrieve(self.instance_id, transfer.keys, transfer.blocks.tolist(), skip_tokens, lease_id,
                              self._raw(params), self._deadline(), span)

        def finish(res: m.RetrieveResult, params: msgspec.Struct | None) -> m.RetrieveResult:
            with self._step("finish_retrieve"):
                self.finish_retrieve(transfer, params, res)
            return res

        return self._pipelined(transfer, send, finish, before=wait_for_stores, outer=outer)

    def _pipelined(
        self,
        transfer: Transfer,
        send: Callable[[msgspec.Struct | None], m.Store | m.Retrieve],
        finish: Callable[[Any, msgspec.Struct | None], T],
        answered: Callable[[], None] | None = None,
        before: Callable[[], None] | None = None,
        outer: Future[T] | None = None,
    ) -> Future[T]:
        """Prepare and send on the worker (waiting for a free place in the window), finish on
        the finisher thread in reply order, resolving ``outer`` (a new future when None);
        ``release_params`` runs exactly once either way."""
        if outer is None:
            outer = self._future()

        def release(params: msgspec.Struct | None) -> BaseException | None:
            try:
                with self._step("release_params"):
                    self.release_params(transfer, params)
            except BaseException as exc:  # noqa: BLE001  (returned: the caller's future carries it)
                return exc
            return None

        def done(reply: Future[Any], payload: m.Store | m.Retrieve, params: msgspec.Struct | None) -> None:
            value: Any = None
            error: BaseException | None = None
            late = False  # the server may still copy with the params: released on its late answer
            try:
                res = self._retried(reply, lambda: self._resend(payload))
                _check_result(payload, res, getattr(self.connection, "url", "?"))
            except RemoteError as exc:  # the server answered it (with an error): it is done with it
                error = exc
            except BaseException as exc:  # noqa: BLE001  (no answer: the server may still copy)
                error = exc
                # a first send that timed out gets its late answer; a resend's, or a lost
                # connection's, cannot be told apart: released now, as not done
                late = isinstance(exc, RequestTimeout) and reply.exception() is exc
                transfer.server_done = late
            else:
                try:
                    value = finish(res, params)
                except BaseException as exc:  # noqa: BLE001  (the caller's future carries it)
                    error = exc
            released: BaseException | None = None
            if late:
                self._await_answer(payload, transfer, params, release)
            else:  # the params' resources are free before the caller sees the result
                released = release(params)
            if answered is not None:
                answered()
            self._window.release()
            error = error or released
            if error is not None:
                outer.set_exception(error)
            else:
                outer.set_result(value)

        def start(acquired: bool = False) -> None:
            if not acquired:
                self._window.acquire()
            params: msgspec.Struct | None = None
            try:
                if before is not None:
                    before()
                with self._step("prepare"):
                    params = self.prepare(transfer)
                payload = send(params)
            except BaseException as exc:  # noqa: BLE001  (the caller's future carries it)
                release(params)
                self._window.release()
                if isinstance(exc, (SystemExit, KeyboardInterrupt)):  # an exit on the engine's main thread
                    outer.cancel()  # (plugin_step let it through): never a future's error, it goes on
                    raise
                if outer.set_running_or_notify_cancel():
                    outer.set_exception(exc)
                return
            if not outer.set_running_or_notify_cancel():  # cancelled before it was sent: no copy
                release(params)  # prepared in order (e.g. an event per request), never sent
                if answered is not None:
                    answered()
                self._window.release()
                return
            try:
                reply: Future[Any] = self.connection.submit(payload)
            except BaseException as exc:  # noqa: BLE001  (the reply future carries it)
                reply = Future()
                reply.set_exception(exc)
            reply.add_done_callback(lambda f: self._finisher.submit(done, f, payload, params))

        def queued() -> None:
            try:
                start()
            finally:
                with self._lock:
                    self._jobs -= 1

        try:
            with self._lock:
                self._check_open()
                # nothing queued or running ahead, a free place, nothing to wait for: prepare and
                # send on this thread, in order, without the hand-off to the worker
                inline = (self.prepare_inline and self._jobs == 0 and (before is None or self._stores_out == 0)
                          and self._window.acquire(blocking=False))
                if inline:
                    start(acquired=True)
                else:
                    self._jobs += 1
                    try:
                        self._executor.submit(queued)
                    except BaseException:
                        self._jobs -= 1
                        raise
        except BaseException:
            release(None)  # closed: the token on_submit made goes back now
            raise
        return outer

    def _await_answer(self, request: Any, transfer: Transfer, params: Any,
                      release: Callable[[Any], BaseException | None]) -> None:
        """Keep the params of ``request``, whose answer the client stopped waiting for, until the
        server answers it late (:meth:`_late_answer`), the session is opened anew or the context
        closes (:meth:`_settle_unanswered`)."""
        over = []
        with self._lock:
            self._late_params[id(request)] = (request, transfer, params, release)
            while len(self._late_params) > _UNANSWERED_KEPT:
                over.append(self._late_params.popitem(last=False)[1])
        for _, t, p, rel in over:  # kept too long: released as not done (the transport keeps what it must)
            t.server_done = False
            rel(p)

    def _late_answer(self, request: Any) -> None:
        """The server answered ``request`` after the client had stopped waiting (the connection's
        late-reply thread): it is done with it, and its params are released on the finisher."""
        with self._lock:
            got = self._late_params.pop(id(request), None)
        if got is None or got[0] is not request:
            return
        try:
            self._finisher.submit(got[3], got[2])
        except RuntimeError:  # the context closed meanwhile (its close released the others)
            got[3](got[2])

    def _settle_unanswered(self) -> None:
        """Release the params of every request still kept: the session was opened anew (the
        server that had them restarted, or ended the session and with it their registration) or
        the context closes (the server closes its side after its requests)."""
        with self._lock:
            kept = list(self._late_params.values())
            self._late_params.clear()
        for _, _, params, release in kept:
            release(params)

    def on_reconnect(self) -> None:
        renewed = self.epoch != self.connection.epoch  # a new session: the old one's requests are over
        super().on_reconnect()
        if renewed:
            self._settle_unanswered()

    def _drain(self) -> None:
        """Wait until every sent request has finished (their replies have deadlines)."""
        for _ in range(self.max_in_flight):
            self._window.acquire()
        for _ in range(self.max_in_flight):
            self._window.release()


def _check_result(request: m.Store | m.Retrieve, res: Any, url: str) -> None:
    """Raise ProtocolError unless ``res`` accounts for each chunk of ``request`` exactly once
    (:func:`check_each_told_once`): stored, present or failed; loaded or missing. (Released then
    as not done: a server that answers so is trusted with nothing.)"""
    told = [*res.stored, *res.present, *res.failed] if isinstance(res, m.StoreResult) else [*res.loaded, *res.missing]
    check_each_told_once(type(request).__name__.lower(), len(request.hashes), told, url)


class _Started:
    """Whether a layer-wise retrieve sent in parts has started: the first part about to be sent
    makes the whole transfer running (no longer cancellable); once it was cancelled, no part is."""

    def __init__(self, whole: Future[Any]) -> None:
        self.whole = whole
        self.lock = threading.Lock()
        self.decided: bool | None = None

    def may_send(self) -> bool:
        with self.lock:
            if self.decided is None:
                self.decided = self.whole.set_running_or_notify_cancel()
            return self.decided


class _Part(Future[T]):
    """The future of one part of a layer-wise retrieve (see :class:`_Started`)."""

    def __init__(self, started: _Started) -> None:
        super().__init__()
        self._started = started

    def set_running_or_notify_cancel(self) -> bool:
        if not self._started.may_send():
            return False  # the whole transfer was cancelled: this part is never sent
        return super().set_running_or_notify_cancel()
