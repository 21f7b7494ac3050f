"""What ``submit_store`` and ``submit_retrieve`` return: :class:`TransferFuture`, and for a
transfer submitted layer by layer :class:`LayerwiseFuture`. Engines and connectors use them; a
transport's hooks never see them (re-exported by :mod:`kvxfer.transport` and its contract)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

__all__ = ["LayerwiseFuture", "TransferFuture"]

LT = TypeVar("LT")


class TransferFuture(Future[LT]):
    """The future that ``submit_*`` return. The core completes it on whichever of its threads
    learns that the transfer ended, so that a caller waiting in ``result()`` wakes at once; its
    done-callbacks run on the context's finisher thread all the same (in the order the futures
    complete), not on the thread that completed it, which may hold a lock of the core. That holds
    for a callback added to a future already done too (it runs soon after, on the finisher, not
    inside ``add_done_callback``); once the context is closed, callbacks run on the thread that
    completes the future or adds them. A callback that raises is logged, as
    :class:`~concurrent.futures.Future` does."""

    def __init__(self, callbacks: Executor | None = None) -> None:
        super().__init__()
        self._callbacks = callbacks

    def add_done_callback(self, fn: Callable[[Future[LT]], object]) -> None:
        run_on = self._callbacks
        if run_on is None:
            super().add_done_callback(fn)
            return

        def hop(f: Future[LT]) -> None:
            try:
                run_on.submit(_run_callback, fn, f)
            except RuntimeError:  # the context closed: its finisher takes no more work
                _run_callback(fn, f)

        super().add_done_callback(hop)


def _run_callback(fn: Callable[[Future[LT]], object], f: Future[LT]) -> None:
    try:
        fn(f)
    except Exception:
        logging.getLogger(__name__).exception("exception calling callback for %r", f)


class LayerwiseFuture(TransferFuture[LT]):
    """The future of a transfer submitted with ``by_layer=True``: the whole transfer's result,
    plus per-layer progress.

    Retrieve: :meth:`wait_layer` returns once layer ``i`` of every chunk that loads has landed
    (chunks the result reports missing are left untouched in every layer, but for a copy that
    was under way when the process froze past half the session timeout: the result then
    reports every chunk missing, and no layer of it lands before the result is set). Store: the caller
    tells the core with :meth:`layer_ready` when layers are written; a layer is copied only
    after that call, and the transfer commits after the last layer. Layers complete in order
    only when the transport copies ranges of layers (:attr:`Capabilities.layer_ranges`);
    otherwise every layer completes with the whole transfer. Thread-safe.
    """

    def __init__(self, num_layers: int, on_ready: Callable[[bool], Any] | None = None,
                 callbacks: Executor | None = None) -> None:
        super().__init__(callbacks)
        self.num_layers = num_layers
        self._on_ready = on_ready
        self._cond = threading.Condition()
        self._landed = [False] * num_layers
        #: (layers ready, the token made when they were declared ready), latest last
        self._ready: list[tuple[int, Any]] = []
        self._abandoned: BaseException | None = None
        self._listener: Callable[[], None] | None = None

    # ------------------------------------------------------------------ the caller

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Return once ``layer`` has landed (or the transfer finished); raise what the transfer
        raised; :class:`kvxfer.errors.RequestTimeout` after ``timeout`` seconds."""
        self._check(layer)
        with self._cond:
            if not self._cond.wait_for(lambda: self._landed[layer] or self.done(), timeout):
                from kvxfer.errors import RequestTimeout

                raise RequestTimeout(f"layer {layer} of a layer-wise transfer did not land within {timeout} s")
        if not self._landed[layer]:
            self.result(0)  # raises the transfer's error (a finished transfer landed every layer)

    def layer_landed(self, layer: int) -> bool:
        self._check(layer)
        with self._cond:
            return self._landed[layer] or (self.done() and self.exception(0) is None)

    def layer_ready(self, layer: int) -> None:
        """Store: layers ``0..layer`` are written (call in order, on the thread whose device
        stream wrote them: the transport may record an event there)."""
        self._check(layer)
        with self._cond:
            done = self._ready[-1][0] if self._ready else 0
            if layer + 1 <= done:
                return
        token = self._on_ready(layer + 1 == self.num_layers) if self._on_ready is not None else None
        with self._cond:
            self._ready.append((layer + 1, token))
            self._cond.notify_all()
        if self._listener is not None:
            self._listener()

    def all_layers_ready(self) -> None:
        """Store: every layer is written."""
        self.layer_ready(self.num_layers - 1)

    def _check(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range: this transfer has {self.num_layers} layers")

    # ------------------------------------------------------------------ the core

    def set_result(self, result: Any) -> None:
        super().set_result(result)
        with self._cond:
            self._landed = [True] * self.num_layers
            self._cond.notify_all()

    def set_exception(self, exception: BaseException | None) -> None:
        super().set_exception(exception)
        with self._cond:
            self._cond.notify_all()

    def cancel(self) -> bool:
        """Cancel the transfer if no part of it has started copying (``wait_layer`` then raises
        :class:`concurrent.futures.CancelledError`)."""
        cancelled = super().cancel()
        if cancelled:
            with self._cond:
                self._cond.notify_all()
        return cancelled

    def mark_landed(self, layers: range) -> None:
        """The core: ``layers`` have landed."""
        with self._cond:
            for i in layers:
                self._landed[i] = True
            self._cond.notify_all()

    def ready(self, layers: int) -> tuple[bool, Any]:
        """The core: whether the first ``layers`` layers are declared ready, and the token made
        by the call that declared them."""
        with self._cond:
            for n, token in self._ready:
                if n >= layers:
                    return True, token
            return False, None

    @property
    def abandoned(self) -> BaseException | None:
        """The core: why the layers still awaited will never come (None while they may)."""
        return self._abandoned

    def on_ready(self, listener: Callable[[], None]) -> None:
        """The core: call ``listener()`` (on the declaring thread) after each declaration and
        once the transfer is abandoned."""
        self._listener = listener

    def abandon(self, error: BaseException) -> None:
        """The core: the layers still awaited will never be copied (the context closes)."""
        with self._cond:
            self._abandoned = error
            self._cond.notify_all()
        if self._listener is not None:
            self._listener()
