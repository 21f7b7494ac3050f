"""Private: what the core does for every client context, whichever its style.

The worker and finisher threads, validation, registration (and registering again after a
server restart), the one boundary around calls into plugin code, and close. The styles build
on it (:mod:`._client_driven`, :mod:`._server_driven`); :mod:`kvxfer.transport.contract`
is what a transport sees.
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast, overload

import msgspec

from kvxfer.copies import check_lease_id, check_transfer
from kvxfer.errors import (
    ConfigError,
    InvalidRequest,
    KvxferError,
    NoSession,
    ProtocolError,
    TransportFailed,
    UnknownInstance,
)
from kvxfer.layout import KVLayout
from kvxfer.protocol import codec
from kvxfer.protocol import messages as m

if TYPE_CHECKING:
    import torch

    from kvxfer.transport.contract import (
        Connection,
        InstanceIdentity,
        LayerwiseFuture,
        Transfer,
        TransferContextBase,
        TransferFuture,
        TransferKind,
        Transport,
        Waiter,
    )

__all__ = ["ContextCore", "check_each_told_once", "plugin_step", "guarded"]

T = TypeVar("T")
Reply = TypeVar("Reply", bound=m.Message)


#: Whether a SystemExit or KeyboardInterrupt raised on the main thread inside plugin code is
#: the plugin's failure too: only in a kvxfer server that handles its signals itself
#: (:func:`exits_on_the_main_thread_are_plugin_failures`). Elsewhere the main thread is where a
#: signal handler's ``sys.exit`` (vLLM's on SIGTERM) or the user's Ctrl-C arrives.
_MAIN_THREAD_EXITS_CONTAINED = [False]


def exits_on_the_main_thread_are_plugin_failures() -> None:
    """Called by a server whose signal handlers raise nothing (see :func:`plugin_step`)."""
    _MAIN_THREAD_EXITS_CONTAINED[0] = True


@contextlib.contextmanager
def plugin_step(transport: str, step: str) -> Iterator[None]:
    """The one boundary around plugin code: what it raises leaves as a
    :class:`~kvxfer.errors.KvxferError` (its own, e.g. ``ConfigError``, unchanged; anything else
    as :class:`~kvxfer.errors.TransportFailed` naming ``transport`` and ``step``, from it).
    ``SystemExit`` (a plugin that calls ``sys.exit``) and ``KeyboardInterrupt`` are a plugin's
    failure too, except on the main thread of a process other than a kvxfer server: signals
    are delivered there, and a signal handler's exit or the user's Ctrl-C passes on."""
    try:
        yield
    except KvxferError:
        raise
    except Exception as exc:
        raise TransportFailed(transport, step, exc) from exc
    except (SystemExit, KeyboardInterrupt) as exc:
        if threading.current_thread() is threading.main_thread() and not _MAIN_THREAD_EXITS_CONTAINED[0]:
            raise
        raise TransportFailed(transport, step, exc) from exc


def _note_thread(threads: set[int]) -> None:
    """A context's worker or finisher thread, as it starts: one of the context's own threads
    (the set, not the context, is what the thread holds: a context dropped unclosed is freed)."""
    threads.add(threading.get_ident())


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
    #: At most this many parts (ranges of layers) per layer-wise transfer, each of at least
    #: ``min_layer_part_bytes``, and of ``min_layer_chunk_bytes`` of each chunk (see the
    #: contract's TransferContextBase and each style).
    max_layer_parts: ClassVar[int] = 64
    min_layer_part_bytes: ClassVar[int] = 0
    min_layer_chunk_bytes: ClassVar[int] = 0
    #: Whether each part of a layer-wise store gets its own token (see :meth:`_layered`).
    _token_per_part: ClassVar[bool] = True
    #: The private attributes the core's ``__init__`` sets (each style adds its own): a
    #: transport's context class must not set them (:meth:`check_core_names`).
    _core_names: ClassVar[frozenset[str]] = frozenset({
        "_own_threads", "_executor", "_finisher", "_closed", "_close_ended", "_registered", "_lock", "_layer_feeds",
        "_dropped"})
    #: The public attributes the core's ``__init__`` sets (each style may add its own), which the
    #: contract documents: the core's to set, refused like the private ones.
    _core_public: ClassVar[frozenset[str]] = frozenset({
        "transport", "transport_name", "connection", "layers", "layout", "identity", "instance_id", "chunk_size",
        "blocks_per_chunk", "chunk_bytes", "epoch"})

    def __init__(
        self,
        transport: Transport,
        connection: Connection,
        layers: list[torch.Tensor],
        layout: KVLayout,
        identity: InstanceIdentity,
    ) -> None:
        self.__before = dict(vars(self))  # what the plugin's __init__ set before it called this one
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
        #: Threads that must not wait for a close of this context: its worker and finisher, and
        #: the thread running the first close (a close called again from below it: a signal
        #: handler, a finalizer)
        self._own_threads: set[int] = set()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"kvxfer-{name}-{identity.rank}",
                                            initializer=_note_thread, initargs=(self._own_threads,))
        self._finisher = ThreadPoolExecutor(1, thread_name_prefix=f"kvxfer-{name}-{self._finisher_role}",
                                            initializer=_note_thread, initargs=(self._own_threads,))
        self._closed = False
        #: Set once a close has finished (a second close waits for it).
        self._close_ended = threading.Event()
        self._registered = False
        self.epoch = -1
        self._lock = threading.Lock()
        #: Layer-wise transfers not finished yet: close() abandons the layers never declared ready.
        self._layer_feeds: weakref.WeakSet[LayerwiseFuture[Any]] = weakref.WeakSet()
        #: Queues the instance id it holds for the client to unregister once this context is
        #: collected unclosed (the server would keep the registration for the session's life);
        #: close() detaches it.
        self._dropped: tuple[weakref.finalize[Any, Any], list[int]] | None = None

    def _seal(self) -> None:
        """The end of the core's ``__init__`` (each style's calls it): remember what the core set
        under its private names, and refuse a plugin attribute of one of those names set before
        the plugin's ``super().__init__()`` (the core has just replaced it)."""
        before = self.__before
        del self.__before
        public = type(self)._core_public
        names = ContextCore._core_names | type(self)._core_names | public
        self.__core = {k: vars(self).get(k) for k in names}
        # a public one set to what the core then set (the same object) is no clash
        self._refuse_clashes(sorted(k for k in names & set(before)
                                    if k not in public or before[k] is not self.__core[k]))

    def check_core_names(self) -> None:
        """Raise ConfigError if the plugin's ``__init__`` replaced an attribute of the core's
        after the core set it (the client calls this once the context is made): the two would
        share, or lose, the core's lock, worker or counters, or send another transport's name."""
        self._refuse_clashes(sorted(k for k, v in self.__core.items() if vars(self).get(k) is not v))

    def _refuse_clashes(self, names: list[str]) -> None:
        if names:
            name = self.__core["transport_name"]
            raise ConfigError(f"transport {name!r}: its context class sets {', '.join(names)}, which "
                              "kvxfer's own context uses: give the transport's attributes names of their own (e.g. "
                              "with the transport's name as a prefix)")

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
        fields = self.identity.registration_fields(self.layout)
        taken = sorted(fields.keys() & extra.keys()) if isinstance(extra, dict) else []
        if taken:
            raise ConfigError(f"transport {self.transport_name!r}: registration_extra() returns {', '.join(taken)}, "
                              "which the core fills: give the transport's own fields names of their own")
        with self._step("registration"):
            return self.transport.registration_type(**fields, **extra)

    def register(self) -> None:
        """Send the registration; called by the client before any transfer, and again after the
        server restarted. Raises a :class:`kvxfer.errors.RemoteError` if the server refuses it,
        and :class:`ConfigError` if the server's chunks are not this context's (a server
        restarted with another chunk size: this context's block counts and slot sizes would be
        wrong for every transfer, its writes running past their slots into other chunks)."""
        if self.connection.chunk_size != self.chunk_size:
            raise self._other_chunks(None)

        def send() -> m.RegisterReply:
            registration = msgspec.Raw(codec.encode(self.registration()))
            return self.connection.request(m.Register(self.transport_name, registration))

        try:
            reply = send()
        except InvalidRequest as exc:
            if m.REGISTERED_ELSEWHERE not in str(exc):
                raise
            # another session registered this id (one that read it from status while this
            # client's session was lost, say): register under a fresh one
            self.identity = self.identity.renewed()
            self.instance_id = self.identity.instance_id
            reply = send()
        if reply.chunk_bytes != self.chunk_bytes:
            with contextlib.suppress(KvxferError, ConnectionError):  # registered, but unusable: taken back
                self.connection.request(m.Unregister(self.instance_id))
            raise self._other_chunks(reply.chunk_bytes)
        self._registered = True
        self.epoch = self.connection.epoch
        if self._dropped is None:
            ids = [self.instance_id]
            dropped = getattr(self.connection, "dropped", None)  # (CacheClient's; a stand-in may have none)
            finalizer = weakref.finalize(self, _note_dropped, dropped, ids)
            finalizer.atexit = False  # the session ends with the process anyway
            self._dropped = (finalizer, ids)
        else:
            self._dropped[1][0] = self.instance_id  # registered again (under a fresh id, maybe)

    def _other_chunks(self, server_chunk_bytes: int | None) -> ConfigError:
        """The error of a server whose chunks are not this context's."""
        size = f" ({server_chunk_bytes} bytes of this KV cache)" if server_chunk_bytes is not None else ""
        return ConfigError(
            f"the kvxfer server at {getattr(self.connection, 'url', '?')} uses chunks of {self.connection.chunk_size} "
            f"tokens{size}, this transfer context's are {self.chunk_size} tokens ({self.chunk_bytes} bytes): the "
            "server restarted with another --chunk-size. Nothing is copied; register the KV cache again through "
            "a new CacheClient to use the server's chunk size, or restart the server with the old one")

    def on_reconnect(self) -> None:
        """The client re-opened its session (the server restarted): register again."""
        self.register()

    def _resend(self, payload: m.Request[Reply]) -> Reply:
        """The server lost this context (it restarted): register again and send once more, as
        the request is now: under this context's instance id (renewed if another session took
        the old one). One with a deadline gets a new one, a timeout from now but at most one
        timeout past the first (registering again may take long, and whoever waits for the
        request, vLLM's connector say, counts on its end within two timeouts of the first send:
        then it gives the blocks up), and is waited for until then."""
        return self._resend_at(payload)[0]

    def _resend_at(self, payload: m.Request[Reply]) -> tuple[Reply, int]:
        """:meth:`_resend`, and the client's session epoch read just before the request went
        again (its reply came from that session or a later one)."""
        self.connection.reconnect(cast("TransferContextBase", self))
        fields: dict[str, Any] = {}
        if getattr(payload, "instance_id", self.instance_id) != self.instance_id:
            fields["instance_id"] = self.instance_id
        first: float = getattr(payload, "deadline", 0.0)
        epoch = self.connection.epoch
        if not first:
            return self.connection.request(msgspec.structs.replace(payload, **fields) if fields else payload), epoch
        wait = float(self.connection.timeout or 0.0)
        fields["deadline"] = min(self._deadline(), first + wait)
        left = max(0.0, fields["deadline"] - time.time()) + _deadline_margin(wait)
        return self.connection.request(msgspec.structs.replace(payload, **fields), timeout=left), epoch

    def _deadline(self) -> float:
        """A request's deadline as sent now: when this client stops waiting for its reply, less
        :func:`_deadline_margin`, so that a copy the server starts just before it has ended
        before the client gives up on it (the blocks may hold other KV by then; the server
        copies nothing after it); 0 without a timeout."""
        wait = float(self.connection.timeout or 0.0)
        return time.time() + wait - _deadline_margin(wait) if wait else 0.0

    # ------------------------------------------------------------------ submit

    def _submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        with self._lock:
            self._check_open()
            return self._executor.submit(fn, *args)

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError(f"transfer context {self.instance_id} ({self.transport_name}) is closed")

    def _transfer(self, kind: TransferKind, keys: list[bytes], blocks: torch.Tensor, skip_blocks: int = 0,
                  with_token: bool = True) -> Transfer:
        """The request's record for the hooks, with the token :meth:`on_submit` gives it."""
        from kvxfer.transport.contract import Transfer

        return Transfer(kind, keys, blocks, skip_blocks, self._token(kind) if with_token else None)

    def _token(self, kind: TransferKind) -> Any:
        with self._step("on_submit"):
            return self.on_submit(kind)

    def _future(self) -> TransferFuture[Any]:
        """A request's future: any of the core's threads may complete it, its done-callbacks
        run on the finisher."""
        from kvxfer.transport.contract import TransferFuture

        return TransferFuture(self._finisher)

    def _layered(self, kind: TransferKind) -> LayerwiseFuture[Any]:
        """A layer-wise transfer's future. A store's ``layer_ready`` calls make the tokens of
        its parts (each on the thread that declares layers ready): every call for a
        client-driven context, the last one only for a server-driven one (which sends one
        request once every layer is ready)."""
        from kvxfer.transport.contract import LayerwiseFuture

        def on_ready(last: bool) -> Any:
            return self._token(kind) if last or self._token_per_part else None

        fut: LayerwiseFuture[Any] = LayerwiseFuture(self.layout.num_layers, on_ready if kind == "store" else None,
                                                    self._finisher)
        with self._lock:
            self._layer_feeds.add(fut)
        return fut

    def submit_store(self, keys: Sequence[bytes], block_ids: Sequence[int] | torch.Tensor, *,
                     by_layer: bool = False) -> Future[m.StoreResult]:
        keys = list(keys)
        blocks = check_transfer(self.layout, self.chunk_size, len(keys), block_ids)
        with self._lock:
            self._check_open()
        if by_layer:  # the tokens come with the layers (layer_ready)
            return self._start_store(self._transfer("store", keys, blocks, with_token=False), self._layered("store"))
        return self._start_store(self._transfer("store", keys, blocks), self._future())

    def submit_retrieve(
        self,
        keys: Sequence[bytes],
        block_ids: Sequence[int] | torch.Tensor,
        skip_first_n_tokens: int = 0,
        lease_id: int = 0,
        *,
        by_layer: bool = False,
    ) -> Future[m.RetrieveResult]:
        keys = list(keys)
        blocks = check_transfer(self.layout, self.chunk_size, len(keys), block_ids, skip_first_n_tokens)
        lease_id = check_lease_id(lease_id)
        with self._lock:
            self._check_open()
        skip = int(skip_first_n_tokens) // self.layout.block_size
        outer: Future[m.RetrieveResult] = self._layered("retrieve") if by_layer else self._future()
        return self._start_retrieve(self._transfer("retrieve", keys, blocks, skip), lease_id, outer)

    def _start_store(self, transfer: Transfer, outer: Future[m.StoreResult]) -> Future[m.StoreResult]:
        """Start a validated store that resolves ``outer`` (a :class:`LayerwiseFuture` for a
        layer-wise one); the style implements it."""
        raise NotImplementedError

    def _start_retrieve(self, transfer: Transfer, lease_id: int,
                        outer: Future[m.RetrieveResult]) -> Future[m.RetrieveResult]:
        """Start a validated retrieve that resolves ``outer``; the style implements it."""
        raise NotImplementedError

    def _layer_groups(self, nbytes: int) -> list[range]:
        """The layer ranges a layer-wise transfer of ``nbytes`` is copied in, in order: at most
        ``max_layer_parts`` groups, their sizes at most one layer apart, as many as keep each
        moving at least ``min_layer_part_bytes`` in all and ``min_layer_chunk_bytes`` of each
        chunk; one range of every layer when the transport does not copy ranges of layers."""
        n = self.layout.num_layers
        if not self.transport.capabilities.layer_ranges:
            return [range(n)]
        parts = max(1, min(n, self.max_layer_parts))
        for floor, total in ((self.min_layer_part_bytes, nbytes), (self.min_layer_chunk_bytes, self.chunk_bytes)):
            if floor > 0 and total > 0:
                fewest = max(1, math.ceil(floor * n / total))  # layers a part needs to move that much
                parts = max(1, min(parts, n // fewest))
        base, extra = divmod(n, parts)
        groups, start = [], 0
        for i in range(parts):
            stop = start + base + (i < extra)
            groups.append(range(start, stop))
            start = stop
        return groups

    def _transfer_bytes(self, transfer: Transfer) -> int:
        """Bytes ``transfer`` copies at most (its chunks past the skipped blocks)."""
        blocks = transfer.blocks.numel() - transfer.skip_blocks
        return blocks * (self.chunk_bytes // self.blocks_per_chunk)

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        """Wait for the transfers submitted, unregister, release. A close while another is under
        way waits until that one has finished (the caller may end its session next: a copy
        must not outlive it), unless it runs on a thread of this context's own (a done-callback)
        or on the thread of that close (called again from below it: a signal handler)."""
        with self._lock:
            if self._closed:
                closing = True
            else:
                closing = False
                self._closed = True
                feeds = list(self._layer_feeds)
                self._own_threads.add(threading.get_ident())
        if closing:
            if threading.get_ident() not in self._own_threads:
                self._close_ended.wait()
            return
        try:
            self._close_now(feeds)
        finally:
            self._close_ended.set()

    def _close_now(self, feeds: list[LayerwiseFuture[Any]]) -> None:
        if self._dropped is not None:
            self._dropped[0].detach()  # unregistered below
        for fut in feeds:  # a layer-wise store whose caller never declares its last layers
            fut.abandon(ConfigError(f"transfer context {self.instance_id} ({self.transport_name}) closed before "
                                    "every layer of a layer-wise store was declared ready"))
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
        self._settle_unanswered()
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

    def _settle_unanswered(self) -> None:
        """At close, once unregistered: release what requests the server never answered still
        hold (none by default)."""

    def _drain(self) -> None:
        """Wait for transfers still in flight after the worker is idle (none by default)."""

    @staticmethod
    def _retried(reply: Future[Reply], resend: Callable[[], Reply]) -> Reply:
        """``reply``'s result; after a server restart (it lost this context), ``resend()``."""
        try:
            return reply.result()
        except (NoSession, UnknownInstance):
            return resend()


def check_each_told_once(request: str, n: int, told: Sequence[int], url: str) -> None:
    """Raise ProtocolError unless the indices ``told`` by a reply name each of the ``n`` chunks
    of a ``request`` exactly once. A chunk a reply left out would be taken for stored, or loaded
    with its blocks untouched; an index out of range would fail deep in the copy code."""
    if len(told) != n or sorted(told) != list(range(n)):
        raise ProtocolError(f"the kvxfer server at {url} answered a {request} of {n} chunks with {len(told)} "
                            "indices that do not name each of them once")


def _deadline_margin(wait: float) -> float:
    """How long before a client stops waiting for a request its deadline is: a tenth of the
    wait, at most 1 s."""
    return min(1.0, wait / 10)


def _note_dropped(dropped: collections.deque[int] | None, ids: list[int]) -> None:
    """A registered context collected without ``close()``: its client unregisters the instance
    at its next ``register()`` (the server kept such a registration for the session's life, and
    a program that dropped contexts ran out of --max-registrations-per-session). This runs
    inside whatever allocation the collector ran in, the client's own under its lock included:
    it only appends to a deque (atomic), never a lock or I/O."""
    if dropped is not None:
        dropped.append(ids[0])
