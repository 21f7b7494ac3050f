"""The one boundary around a store plugin's backend, as the L2 tier calls it.

The contract (:mod:`kvxfer.store.base`): a backend's ``submit_*`` raise nothing but
:class:`~kvxfer.errors.StoreUnavailable`, and their futures resolve to the documented results or
fail with it. :class:`GuardedBackend` holds a backend to that. An ``OSError`` becomes a
StoreUnavailable (the store's connection or disk failed); anything else it raises or a future
fails with, and any result of the wrong type or length, becomes a :class:`PluginFault`: a
StoreUnavailable naming the store, the method and what was wrong. So the tier counts a plugin's
bug as a store failure (its breaker opens, the server answers from L1): a lookup never gets
``internal``, and a short answer never passes for one that found nothing. ``stats()`` is held to
its ``dict[str, str]`` and to the status reply's bounds; a fault there is not a failure of the
store (its data operations may work), so the tier logs it instead of opening the breaker.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from kvxfer.errors import StoreUnavailable
from kvxfer.protocol.messages import MAX_STATUS_ENTRIES, MAX_STATUS_TEXT
from kvxfer.store.base import Backend, GetItem, GetStatus, PutItem

__all__ = ["GuardedBackend", "PluginFault", "check_sizes", "close_within"]

log = logging.getLogger(__name__)

T = TypeVar("T")

class PluginFault(StoreUnavailable):
    """A store plugin broke its contract (raised something else, or returned a wrong result)."""


class _Outer(Future[T]):
    """The future the boundary hands out for the plugin's ``inner`` one."""

    def __init__(self, inner: Future[Any]) -> None:
        super().__init__()
        self.inner = inner
        #: the tier asked the plugin to withdraw the operation (a cancelled ``inner`` is no fault then)
        self.withdrawing = False


class GuardedBackend(Backend):
    """``inner`` behind the boundary; ``store`` names it in every message."""

    def __init__(self, store: str, inner: Backend) -> None:
        self.store = store
        self.inner = inner

    def _fault(self, method: str, what: str) -> PluginFault:
        return PluginFault(f"store {self.store!r}: {method} {what} (a fault of the store plugin: see the "
                           "contract in kvxfer.store.base)")

    def _gone(self, method: str, exc: OSError) -> StoreUnavailable:
        """An OSError is the store's connection or disk failing, not the plugin's logic."""
        return StoreUnavailable(f"store {self.store!r}: {method}: {type(exc).__name__}: {exc}")

    def _failure(self, method: str, exc: BaseException, did: str) -> StoreUnavailable:
        """What ``exc``, which ``method`` ``did`` (raised, failed with), is at the boundary: itself
        if a StoreUnavailable, the store gone if an OSError, else a fault of the plugin."""
        if isinstance(exc, StoreUnavailable):
            return exc
        if isinstance(exc, OSError):
            return self._gone(method, exc)
        return self._fault(method, f"{did} {type(exc).__name__}: {exc}")

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self.inner, method)(*args)
        except BaseException as exc:  # SystemExit, asyncio's CancelledError: the plugin's fault too
            if isinstance(exc, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
                raise  # Ctrl-C, which only the main thread gets: not the plugin's
            failure = self._failure(method, exc, "raised")
            if failure is exc:
                raise
            raise failure from exc

    def _submit(self, method: str, check: Callable[[Any], T], *args: Any) -> Future[T]:
        fut = self._call(method, *args)
        if not isinstance(fut, Future):
            raise self._fault(method, f"returned {type(fut).__name__}, not a concurrent.futures.Future")
        out: _Outer[T] = _Outer(fut)

        def done(f: Future[Any]) -> None:  # resolves ``out`` in every case: a caller may wait without a timeout
            if f.cancelled() and out.withdrawing:  # the only other way ``out`` ends
                out.cancel()
                return
            try:
                if f.cancelled():
                    raise self._fault(method, "returned a future that was cancelled")
                exc = f.exception()
                if exc is not None:
                    raise self._failure(method, exc, "failed with")
                result = check(f.result())
            except StoreUnavailable as failed:
                out.set_exception(failed)
            except Exception as why:  # noqa: BLE001  (a check that found the result wrong, or broke on it)
                out.set_exception(self._fault(method, str(why) if isinstance(why, ValueError) else
                                              f"resolved to a result that could not be read: {why!r:.120}"))
            else:
                out.set_result(result)

        fut.add_done_callback(done)
        return out

    def submit_exists(self, keys: Sequence[bytes]) -> Future[list[int]]:
        n = len(keys)
        return self._submit("submit_exists", lambda r: check_sizes(r, n), keys)

    def submit_get(self, items: Sequence[GetItem]) -> Future[list[GetStatus]]:
        n = len(items)
        return self._submit("submit_get", lambda r: _list_of(r, n, _is_status, "GetStatus values"), items)

    def submit_put(self, items: Sequence[PutItem]) -> Future[list[bool]]:
        n = len(items)
        return self._submit("submit_put", lambda r: _list_of(r, n, _is_bool, "bools"), items)

    def submit_delete(self, keys: Sequence[bytes]) -> Future[int]:
        return self._submit("submit_delete", _count, keys)

    def withdraw(self, fut: Future[Any]) -> bool:
        """Ask the plugin to withdraw the operation of ``fut`` (a future this boundary handed
        out). True only if the plugin says so and its own future is cancelled (``fut`` is then
        cancelled too, by the plugin's future's callback); a plugin that says so with its future
        still pending may still be writing into the parts, and is taken at its future."""
        if not isinstance(fut, _Outer) or fut.done():
            return False
        fut.withdrawing = True
        try:
            said = self._call("withdraw", fut.inner) is True
        finally:
            if not fut.inner.cancelled():
                fut.withdrawing = False
        if said and not fut.inner.cancelled():
            log.warning("store %r: withdraw() said an operation was withdrawn, but its future is not cancelled "
                        "(a fault of the store plugin): it is waited for as if still running", self.store)
        return said and fut.inner.cancelled()

    def ping(self) -> None:
        self._call("ping")

    def stats(self) -> dict[str, str]:
        """The inner ``stats()`` as strings, at most the status reply's entries of at most
        :data:`~kvxfer.protocol.messages.MAX_STATUS_TEXT` characters each."""
        got = self._call("stats")
        if not isinstance(got, Mapping):
            raise self._fault("stats", f"returned {type(got).__name__}, not a dict of str to str")
        out: dict[str, str] = {}
        try:
            for k, v in got.items():
                if len(out) == MAX_STATUS_ENTRIES:
                    break
                out[str(k)[:MAX_STATUS_TEXT]] = str(v)[:MAX_STATUS_TEXT]
        except Exception as exc:
            raise self._fault("stats", f"returned what cannot be read as text: {type(exc).__name__}: {exc}") from exc
        return out

    def close(self) -> None:
        try:
            self.inner.close()
        except Exception:  # noqa: BLE001  (a close that raises leaves nothing to do but say so)
            log.exception("store %r: close() raised (a fault of the store plugin)", self.store)


def close_within(backend: Backend, timeout: float) -> bool:
    """Call ``backend.close()`` on a thread of its own; whether it returned within ``timeout``
    seconds (it waits for the backend's operations: one that never ends would hold the caller;
    the thread is a daemon's, left running if not)."""
    closer = threading.Thread(target=backend.close, name="kvxfer-l2-close", daemon=True)
    closer.start()
    closer.join(timeout)
    return not closer.is_alive()


def check_sizes(result: object, n: int) -> list[int]:
    """An existence check's answer for ``n`` keys, as a list of ``n`` ints >= 0 (a ``[]`` for a
    store that was not asked is the caller's to allow); ValueError saying what is wrong."""
    return _list_of(result, n, _is_size, "sizes (ints >= 0)")


def _is_size(x: object) -> bool:
    return type(x) is int and x >= 0


def _is_status(x: object) -> bool:
    return isinstance(x, GetStatus)


def _is_bool(x: object) -> bool:
    return type(x) is bool


def _list_of(result: object, n: int, ok: Callable[[object], bool], what: str) -> list[Any]:
    """``result`` as a list of ``n`` items that pass ``ok``; ValueError saying what is wrong."""
    if not isinstance(result, (list, tuple)):
        raise ValueError(f"resolved to {type(result).__name__}, not a list of {n} {what}")
    if len(result) != n:
        raise ValueError(f"resolved to {len(result)} results for {n} keys")
    for x in result:
        if not ok(x):
            raise ValueError(f"resolved to {x!r:.80} among its results, not one of {what}")
    return list(result)


def _count(result: object) -> int:
    if type(result) is not int or result < 0:
        raise ValueError(f"resolved to {result!r:.80}, not a count (an int >= 0)")
    return result
