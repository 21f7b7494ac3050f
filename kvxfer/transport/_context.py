"""Private: what the core does for every client context, whichever its style.

The worker and finisher threads, validation, registration (and registering again after a
server restart), the one boundary around calls into plugin code, and close. The styles build
on it (:mod:`._client_driven`, :mod:`._server_driven`); :mod:`kvxfer.transport.contract`
is what a transport sees.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast, overload

import msgspec
import torch

from kvxfer.copies import check_transfer
from kvxfer.errors import ConfigError, KvxferError, NoSession, TransportFailed, UnknownInstance
from kvxfer.layout import KVLayout
from kvxfer.protocol import codec
from kvxfer.protocol import messages as m

if TYPE_CHECKING:
    from kvxfer.transport.contract import (
        Connection,
        InstanceIdentity,
        Transfer,
        TransferContextBase,
        TransferKind,
        Transport,
        Waiter,
    )

__all__ = ["ContextCore", "plugin_step", "guarded"]

T = TypeVar("T")
Reply = TypeVar("Reply", bound=m.Message)


@contextlib.contextmanager
def plugin_step(transport: str, step: str) -> Iterator[None]:
    """The one boundary around plugin code: what it raises leaves as a
    :class:`~kvxfer.errors.KvxferError` (its own, e.g. ``ConfigError``, unchanged; anything else
    as :class:`~kvxfer.errors.TransportFailed` naming ``transport`` and ``step``, from it)."""
    try:
        yield
    except KvxferError:
        raise
    except Exception as exc:
        raise TransportFailed(transport, step, exc) from exc


@overload
def guarded(waiter: Waiter, transport: str, step: str) -> Waiter: ...
@overload
def guarded(waiter: None, transport: str, step: str) -> None: ...
def guarded(waiter: Waiter | None, transport: str, step: str) -> Waiter | None:
    """``waiter`` behind the same boundary (``step`` names what it waits for)."""
    if waiter is None:
        return None

    def wait() -> None:
        with plugin_step(transport, step):
            waiter()

    return wait


class ContextCore:
    """Ordering, validation, registration and close for both styles (see the contract's
    :class:`~kvxfer.transport.contract.TransferContextBase` for what a transport sees)."""

    #: Names the second thread, which finishes requests after the worker (see each style).
    _finisher_role: ClassVar[str] = "done"

    def __init__(
        self,
        transport: Transport,
        connection: Connection,
        layers: list[torch.Tensor],
        layout: KVLayout,
        identity: InstanceIdentity,
    ) -> None:
        self.transport = transport
        self.transport_name = transport.name
        self.connection = connection
        self.layers = layers
        self.layout = layout
        self.identity = identity
        self.instance_id = identity.instance_id
        self.chunk_size = connection.chunk_size
        self.blocks_per_chunk = layout.blocks_per_chunk(self.chunk_size)
        self.chunk_bytes = layout.chunk_bytes(self.chunk_size)
        name = transport.name
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"kvxfer-{name}-{identity.rank}")
        self._finisher = ThreadPoolExecutor(1, thread_name_prefix=f"kvxfer-{name}-{self._finisher_role}")
        self._closed = False
        self._registered = False
        self.epoch = -1
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ hooks (see the contract)

    def registration_extra(self) -> dict[str, Any]:
        raise NotImplementedError

    def on_submit(self, kind: TransferKind) -> Any:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError

    def _step(self, step: str) -> contextlib.AbstractContextManager[None]:
        """The boundary around a call into this context's plugin code."""
        return plugin_step(self.transport_name, step)

    # ------------------------------------------------------------------ registration

    def registration(self) -> m.Registration:
        """The registration Struct this context sends (the transport's ``registration_type``)."""
        with self._step("registration_extra"):
            extra = self.registration_extra()
        with self._step("registration"):
            return self.transport.registration_type(**self.identity.registration_fields(self.layout), **extra)

    def register(self) -> None:
        """Send the registration; called once by the client before any transfer. Raises a
        :class:`kvxfer.errors.RemoteError` if the server refuses it."""
        reg = self.registration()
        self.connection.request(m.Register(self.transport_name, msgspec.Raw(codec.encode(reg))))
        self._registered = True
        self.epoch = self.connection.epoch

    def on_reconnect(self) -> None:
        """The client re-opened its session (the server restarted): register again."""
        self.register()

    def _resend(self, payload: m.Request[Reply]) -> Reply:
        """The server lost this context (it restarted): register again and send once more."""
        self.connection.reconnect(cast("TransferContextBase", self))
        return self.connection.request(payload)

    # ------------------------------------------------------------------ submit

    def _submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        with self._lock:
            self._check_open()
            return self._executor.submit(fn, *args)

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError(f"transfer context {self.instance_id} ({self.transport_name}) is closed")

    def _transfer(self, kind: TransferKind, keys: list[bytes], blocks: torch.Tensor, skip_blocks: int = 0) -> Transfer:
        """The request's record for the hooks, with the token :meth:`on_submit` gives it."""
        from kvxfer.transport.contract import Transfer

        with self._step("on_submit"):
            token = self.on_submit(kind)
        return Transfer(kind, keys, blocks, skip_blocks, token)

    def submit_store(self, keys: Sequence[bytes], block_ids: Sequence[int] | torch.Tensor) -> Future[m.StoreResult]:
        keys = list(keys)
        blocks = check_transfer(self.layout, self.chunk_size, len(keys), block_ids)
        with self._lock:
            self._check_open()
        return self._start_store(self._transfer("store", keys, blocks))

    def submit_retrieve(
        self,
        keys: Sequence[bytes],
        block_ids: Sequence[int] | torch.Tensor,
        skip_first_n_tokens: int = 0,
        lease_id: int = 0,
    ) -> Future[m.RetrieveResult]:
        keys = list(keys)
        blocks = check_transfer(self.layout, self.chunk_size, len(keys), block_ids, skip_first_n_tokens)
        with self._lock:
            self._check_open()
        skip = skip_first_n_tokens // self.layout.block_size
        return self._start_retrieve(self._transfer("retrieve", keys, blocks, skip), lease_id)

    def _start_store(self, transfer: Transfer) -> Future[m.StoreResult]:
        """Start a validated store; the style implements it."""
        raise NotImplementedError

    def _start_retrieve(self, transfer: Transfer, lease_id: int) -> Future[m.RetrieveResult]:
        """Start a validated retrieve; the style implements it."""
        raise NotImplementedError

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
                timeout = min(10.0, float(self.connection.timeout))
                self.connection.request(m.Unregister(self.instance_id), timeout=timeout)
            except (KvxferError, ConnectionError):
                pass  # the server is gone or already dropped us: nothing left to release there
        self._registered = False
        self.connection.forget(cast("TransferContextBase", self))  # the contract's subclass is what reaches here
        try:
            with self._step("release"):
                self.release()
        finally:
            try:
                self._released()
            finally:
                self._finisher.shutdown(wait=True)

    def _released(self) -> None:
        """The style's own resources, after the transport's :meth:`release` (once, by close)."""

    def _drain(self) -> None:
        """Wait for transfers still in flight after the worker is idle (none by default)."""

    @staticmethod
    def _retried(reply: Future[Reply], resend: Callable[[], Reply]) -> Reply:
        """``reply``'s result; after a server restart (it lost this context), ``resend()``."""
        try:
            return reply.result()
        except (NoSession, UnknownInstance):
            return resend()
