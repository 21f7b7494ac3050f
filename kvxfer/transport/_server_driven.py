"""Private: the server-driven data path (requests carry block ids; the server copies).

Per request, on the context's worker and in submission order: wait for a place in the window
of ``max_in_flight`` requests (a retrieve also waits until the stores ahead are answered), call
the transport's ``prepare``, send. When the reply arrives, on the finisher and in reply order:
``finish_retrieve`` (retrieves), ``release_params`` (every request), then the future resolves.
After a server restart the request is sent once more, synchronously, once the context is
registered again. A request's future can be cancelled until it is sent; then it is never sent
(its params are released). A retrieve carries the time its client stops waiting for the reply
(``Retrieve.deadline``): a server that reaches the copy later copies nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import msgspec

from kvxfer.protocol import codec
from kvxfer.protocol import messages as m
from kvxfer.transport._context import ContextCore

if TYPE_CHECKING:
    from kvxfer.transport.contract import Transfer

__all__ = ["ServerDrivenCore"]

T = TypeVar("T")


class ServerDrivenCore(ContextCore):
    """The machinery of :class:`~kvxfer.transport.contract.ServerDrivenContext`."""

    max_in_flight: ClassVar[int] = 1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._window = threading.BoundedSemaphore(self.max_in_flight)
        self._stores_out = 0
        self._stores_answered = threading.Condition()

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

    def _start_store(self, transfer: Transfer) -> Future[m.StoreResult]:
        def send(params: msgspec.Struct | None) -> m.Store:
            with self._stores_answered:
                self._stores_out += 1  # from here on, done() runs answered() exactly once
            return m.Store(self.instance_id, transfer.keys, transfer.blocks.tolist(), self._raw(params))

        def answered() -> None:
            with self._stores_answered:
                self._stores_out -= 1
                self._stores_answered.notify_all()

        return self._pipelined(transfer, send, lambda res, params: res, answered)

    def _start_retrieve(self, transfer: Transfer, lease_id: int) -> Future[m.RetrieveResult]:
        skip_tokens = transfer.skip_blocks * self.layout.block_size

        def wait_for_stores() -> None:  # a retrieve must not overtake the stores ahead of it
            with self._stores_answered:
                self._stores_answered.wait_for(lambda: self._stores_out == 0)

        def send(params: msgspec.Struct | None) -> m.Retrieve:
            # the server copies nothing once this client has stopped waiting for the reply
            wait = float(self.connection.timeout or 0.0)
            return m.Retrieve(self.instance_id, transfer.keys, transfer.blocks.tolist(), skip_tokens, lease_id,
                              self._raw(params), time.time() + wait if wait else 0.0)

        def finish(res: m.RetrieveResult, params: msgspec.Struct | None) -> m.RetrieveResult:
            with self._step("finish_retrieve"):
                self.finish_retrieve(transfer, params, res)
            return res

        return self._pipelined(transfer, send, finish, before=wait_for_stores)

    def _pipelined(
        self,
        transfer: Transfer,
        send: Callable[[msgspec.Struct | None], m.Store | m.Retrieve],
        finish: Callable[[Any, msgspec.Struct | None], T],
        answered: Callable[[], None] | None = None,
        before: Callable[[], None] | None = None,
    ) -> Future[T]:
        """Prepare and send on the worker (waiting for a free place in the window), finish on
        the finisher thread in reply order; ``release_params`` runs exactly once either way."""
        outer: Future[T] = Future()

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
            try:
                res = self._retried(reply, lambda: self._resend(payload))
                value = finish(res, params)
            except BaseException as exc:  # noqa: BLE001  (the caller's future carries it)
                error = exc
            released = release(params)  # the params' resources are free before the caller sees the result
            if answered is not None:
                answered()
            self._window.release()
            error = error or released
            if error is not None:
                outer.set_exception(error)
            else:
                outer.set_result(value)

        def start() -> None:
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

        try:
            self._submit(start)
        except BaseException:
            release(None)  # closed: the token on_submit made goes back now
            raise
        return outer

    def _drain(self) -> None:
        """Wait until every sent request has finished (their replies have deadlines)."""
        for _ in range(self.max_in_flight):
            self._window.acquire()
        for _ in range(self.max_in_flight):
            self._window.release()
