"""CacheServer: the request handlers, sessions and registered contexts around the L1 store.

One loop thread owns all state (sessions, contexts, the index); control requests run inline
on it. Transfer requests (register, unregister, server-driven store/retrieve) run their slow
part in the instance's lane of the worker pool (kvxfer.server.workers) and finish back on the
loop, so an instance's transfers stay in order and nothing blocks lookups. Every request gets
exactly one reply.

Clients are untrusted: sessions are bound to their connection and a server-issued secret
(kvxfer.server.sessions), everything a session can make the server hold is bounded
(kvxfer.server.limits), and every field of every request is validated before use.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import secrets
import signal
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast

import msgspec

import kvxfer
from kvxfer import liveness
from kvxfer.arena import Arena
from kvxfer.copies import (
    MAX_PREFETCH_CHUNKS,
    SlotViews,
    StoredSlot,
    check_transfer,
    layer_slice,
    plan_copies,
)
from kvxfer.errors import (
    ConfigError,
    ErrorCode,
    InvalidRequest,
    KvxferError,
    LayoutError,
    NoSession,
    RemoteError,
    TransportError,
    TransportFailed,
    UnknownInstance,
    UnknownRequest,
    VersionMismatch,
)
from kvxfer.layout import KVLayout, LayoutKind, dtype_from_name
from kvxfer.mq.server import MQServer, claim_socket
from kvxfer.mq.throttled_log import ThrottledLog
from kvxfer.protocol import codec
from kvxfer.protocol import messages as m
from kvxfer.protocol.table import REQUESTS, HandlerKind, RequestSpec
from kvxfer.server import figures
from kvxfer.server.allocator import Allocator
from kvxfer.server.config import ServerConfig
from kvxfer.server.context import RegisteredContext
from kvxfer.server.hooks import HookRelay
from kvxfer.server.index import ChunkIndex, ChunkKey, Entry, Reservation, State
from kvxfer.server.limits import Limits
from kvxfer.server.sessions import Parked, Peer, Session
from kvxfer.server.stats import ServerStats
from kvxfer.server.tier import L2Tier, StoreOpener, TierLookup, all_settled, settle_once
from kvxfer.server.warmth import Warmer
from kvxfer.server.workers import Lane, LaneSlot, WorkerPool
from kvxfer.store.base import Backend
from kvxfer.store.format import CHUNK_FORMAT_MAX_BYTES
from kvxfer.store.registry import get_store
from kvxfer.text_table import printable
from kvxfer.transport import registry
from kvxfer.transport._context import exits_on_the_main_thread_are_plugin_failures, guarded, plugin_step
from kvxfer.transport.contract import Queued, ServerContext, ServerTransport, Style, Transport, Waiter
from kvxfer.units import format_bytes

if TYPE_CHECKING:
    import torch

    from kvxfer.server.metrics import MetricsExporter

__all__ = ["CacheServer", "validate_registration"]

T = TypeVar("T")

log = logging.getLogger(__name__)

#: Largest world size a registration or lookup may name.
MAX_WORLD_SIZE: Final = 1 << 16
#: Most keys (chunks x ranks) one lookup may name: what a lookup through the L2 tier builds.
MAX_LOOKUP_KEYS: Final = 1 << 18
#: Longest a store waits for promotions from L2 of its chunks (the loop's tick, about 0.25 s,
#: may add to it); those still running then are reported not stored. Promotions take
#: milliseconds; a slow or stuck store's get would hold the store, and a server-driven one its
#: instance's transfers behind it, until the tier gave it up (42 s at the defaults).
STORE_WAIT_S: Final = 0.5
#: Longest error message sent (values a client sent are shown shortened).
MAX_ERROR_MESSAGE: Final = 2048
#: Largest copy time a client may report with a commit.
MAX_COPY_S: Final = 86400.0


@dataclass(frozen=True, slots=True)
class LoadedTransport:
    transport: Transport
    server: ServerTransport


class _Awaiting:
    """A handler's answer when it must first wait for ``future`` (resolved on any thread; a
    :class:`TierLookup` on the loop): the loop then answers with ``then()``, a reply or another
    deferred answer. ``release``: called if ``then()`` raises (a transfer gives up the place it
    took in its instance's lane while it waited, so that the transfers behind it go on). While
    it waits it counts against ``session``'s and the server's ``max_waiting`` limits, which the
    handler checks (``CacheServer._check_waiting``) before it starts anything it would wait for."""

    __slots__ = ("session", "future", "then", "release")

    def __init__(self, session: Session, future: Future[Any] | TierLookup,
                 then: Callable[[], msgspec.Struct | _Deferred | _Awaiting], release: Callable[[], None] | None = None):
        self.session = session
        self.future = future
        self.then = then
        self.release = release


class _Deferred:
    """A transfer handler's answer: ``work`` runs on the instance's worker (``executor``), then
    ``finish(future)`` on the loop makes the reply. ``transport`` names whose code ``work`` runs
    (for the error boundary around a waiter it returns). ``early`` (retrieves): the reply to send
    as soon as ``work`` returns :class:`Queued` (the client waits for the copies itself);
    ``finish`` then still runs once the copies are done, and its reply is dropped. ``quick``:
    the server context of ``work``, which may only queue copies (:attr:`ServerContext.queues_only`),
    so that a lone request's ``work`` may run on the loop itself. ``waiting``: the context's
    waiters still running (:attr:`RegisteredContext.waiting`), which its close waits for.
    ``slot``: the place in ``executor`` the request took earlier (:class:`_Awaiting`), which
    ``work`` fills instead of going to the back."""

    __slots__ = ("executor", "work", "finish", "transport", "early", "quick", "waiting", "slot")

    def __init__(self, executor: Lane, work: Callable[[], Any], finish: Callable[[Any], msgspec.Struct],
                 transport: str = "", early: Callable[[], msgspec.Struct] | None = None,
                 quick: ServerContext[Any, Any] | None = None, waiting: set[Future[Any]] | None = None,
                 slot: LaneSlot | None = None) -> None:
        self.executor = executor
        self.work = work
        self.finish = finish
        self.transport = transport
        self.early = early
        self.quick = quick
        self.waiting = waiting
        self.slot = slot


def _place_kept(ctx: RegisteredContext, waited: tuple[RegisteredContext, LaneSlot] | None,
                kind: str) -> LaneSlot | None:
    """The place in ``ctx``'s lane that a server-driven ``kind`` (store or retrieve) took before
    it waited for promotions from L2 (``waited``: the context and place then), or None if it did
    not wait. UnknownInstance if that context was dropped meanwhile, even if its id was
    registered again: the transfer then copies nothing."""
    if waited is None:
        return None
    if waited[0] is not ctx:
        done = "stored" if kind == "store" else "loaded"
        raise UnknownInstance(f"instance {ctx.instance_id} was unregistered while this {kind} waited for chunks "
                              f"promoted from L2: nothing {done}; {kind} again once registered")
    return waited[1]


def _invalid(field_name: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{field_name}: {message}")


def plugin_step_call(transport: str, step: str, call: Callable[[], Any]) -> Any:
    """``call()`` (plugin code of ``transport``) behind the core's error boundary, logging what it raised."""
    try:
        with plugin_step(transport, step):
            return call()
    except TransportFailed:
        log.exception("%s", step)
        return None


#: Why the session of a client that said goodbye ended (the log line's words).
_CLOSED_BY_CLIENT: Final = "closed by the client"
#: ... of a client whose process ended without saying goodbye (killed, or exited without closing).
_PROCESS_GONE: Final = "its process ended without closing it"
_CONNECTION_CLOSED: Final = "its connection closed"


def _show(value: object, limit: int = 64) -> str:
    """``repr(value)``, shortened: error messages never echo much of what a client sent."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def check_name(field_name: str, value: str, limits: Limits) -> None:
    """A model or client name: at most ``max_name_length`` bytes of UTF-8, printable characters
    only (names reach terminals through ``kvxfer status`` and ``kvxfer top``, and the server's
    log: no control, format or separator character other than the space)."""
    n = m.name_bytes(value)
    if n > limits.max_name_length:
        raise limits.exceeded("max_name_length", f"{field_name} has {n} bytes")
    problem = m.unprintable_in(value)
    if problem is not None:
        raise _invalid(field_name, problem)


def validate_registration(reg: m.Registration, chunk_size: int, arena_size: int, limits: Limits | None = None,
                          addressable: int | None = None) -> KVLayout:
    """The layout of a registration, or :class:`InvalidRequest` naming the bad field
    (:class:`kvxfer.errors.LimitExceeded` for a name or a KV cache over the server's limits).

    The KV cache a registration declares is the memory its layout spans (every field of the row
    geometry included): it must be within ``max_kv_cache_size`` and within ``addressable``,
    the most the transport's server side can address (:meth:`ServerTransport.addressable_bytes`;
    None: no bound of its own)."""
    limits = limits or Limits()
    if reg.instance_id <= 0 or reg.instance_id >= 1 << 63:
        raise _invalid("instance_id", f"must be in [1, 2**63), got {reg.instance_id}")
    if not reg.model_name:
        raise _invalid("model_name", "must not be empty")
    check_name("model_name", reg.model_name, limits)
    if not 0 < reg.world_size <= MAX_WORLD_SIZE:
        raise _invalid("world_size", f"must be in [1, {MAX_WORLD_SIZE}], got {reg.world_size}")
    if not 0 <= reg.rank < reg.world_size:
        raise _invalid("rank", f"must be in [0, world_size={reg.world_size}), got {reg.rank}")
    try:
        kind = LayoutKind(reg.layout)
    except ValueError:
        raise _invalid("layout", f"unknown layout {_show(reg.layout)}; expected one of "
                                 f"{', '.join(k.value for k in LayoutKind)}") from None
    for name in ("num_layers", "num_blocks", "block_size", "hidden_dim_size"):
        value = getattr(reg, name)
        if value <= 0:
            raise _invalid(name, f"must be positive, got {value}")
    try:
        dtype = dtype_from_name(reg.dtype)
    except ConfigError:
        raise _invalid("dtype", f"unsupported KV cache dtype {_show(reg.dtype)}; use a torch dtype name such as "
                                "bfloat16, float16, float32 or float8_e4m3fn") from None
    if reg.use_mla != (kind is LayoutKind.MLA):
        raise _invalid("use_mla", f"is {reg.use_mla} but layout is {kind.value}")
    if chunk_size % reg.block_size:
        raise _invalid("block_size", f"the server's chunk size {chunk_size} is not a multiple of "
                                     f"block_size {reg.block_size}; restart the server with --chunk-size "
                                     f"a multiple of {reg.block_size}")
    try:
        layout = KVLayout(kind, reg.num_layers, reg.num_blocks, reg.block_size, reg.hidden_dim_size, dtype,
                          reg.row_elems, reg.row_pitch, tuple(reg.run_offsets), reg.block_stride, reg.page)
    except LayoutError as exc:
        raise _invalid("layout", f"{str(exc)[:MAX_ERROR_MESSAGE // 2]} ({kind.value} layout of "
                                 f"{reg.num_layers} layers)") from None
    layer_elems = (layout.span_rows - 1) * layout.row_pitch + layout.row_elems
    kv_bytes = layout.num_layers * layer_elems * layout.itemsize
    if kv_bytes > limits.max_kv_cache_size:
        raise limits.exceeded("max_kv_cache_size", f"the registration declares {format_bytes(kv_bytes)} "
                                                   f"({reg.num_layers} layers of {reg.num_blocks} blocks)")
    if addressable is not None and kv_bytes > addressable:
        raise _invalid("num_blocks", f"the registration declares {format_bytes(kv_bytes)} of KV cache, more than "
                                     f"this transport can address here ({format_bytes(addressable)})")
    fmt = layout.chunk_format(chunk_size)
    if len(fmt.encode()) > CHUNK_FORMAT_MAX_BYTES:
        raise _invalid("page", f"the chunk format {_show(fmt)} takes {len(fmt.encode())} bytes, at most "
                               f"{CHUNK_FORMAT_MAX_BYTES} (a chunk's header in an L2 store records it): describe the "
                               "page with fewer dimensions")
    if layout.chunk_bytes(chunk_size) > arena_size:
        raise _invalid("num_layers", f"one chunk takes {format_bytes(layout.chunk_bytes(chunk_size))}, more "
                                     f"than the whole arena ({format_bytes(arena_size)}); raise --l1-size")
    return layout


def _check_copy_s(copy_s: float) -> None:
    if not 0.0 <= copy_s <= MAX_COPY_S:  # NaN fails too
        raise _invalid("copy_s", f"must be seconds in [0, {MAX_COPY_S:.0f}], got {copy_s!r}")


class _CopyClock:
    """A server-driven copy as the instance's worker runs it (``work``: the transport's ``store``
    or ``retrieve``), timed from its start to the end of its waiter: :meth:`seconds`, read by
    the request's finish on the loop."""

    __slots__ = ("_work", "_start", "_end")

    def __init__(self, work: Callable[[], Waiter | Queued | None]) -> None:
        self._work = work
        self._start = self._end = 0.0

    def __call__(self) -> Waiter | Queued | None:
        self._start = time.perf_counter()
        out = self._work()
        waiter = out.waiter if isinstance(out, Queued) else out
        if not callable(waiter):
            self._end = time.perf_counter()
            if waiter is not None:
                raise TypeError(f"a server context's copy returned {type(waiter).__name__}, not a waiter or None")
            return None

        def wait() -> None:
            try:
                waiter()
            finally:
                self._end = time.perf_counter()

        return Queued(wait) if isinstance(out, Queued) else wait

    def seconds(self) -> float:
        return max(0.0, self._end - self._start) if self._start else 0.0


class _StoreIn(m.Store, frozen=True):
    """A store as the server decodes it: its block ids stay MessagePack until check_transfer has
    counted them against its hashes (a list of millions is refused at its header, unmade)."""

    block_ids: msgspec.Raw  # type: ignore[assignment]


class _RetrieveIn(m.Retrieve, frozen=True):
    """A retrieve as the server decodes it (see :class:`_StoreIn`)."""

    block_ids: msgspec.Raw  # type: ignore[assignment]


#: The types the server decodes payloads as, where they are not the table's own.
_DECODED_AS: dict[str, type[msgspec.Struct]] = {"store": _StoreIn, "retrieve": _RetrieveIn}


def _decode(name: str, spec: RequestSpec, payload: bytes) -> Any:
    """The payload of request ``name`` as its message (InvalidRequest if it is not one). Every
    list a request carries is bounded by its type (:data:`m.Hashes`, ...) as it is decoded."""
    try:
        return codec.decode(payload, _DECODED_AS.get(name, spec.payload))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InvalidRequest(f"payload of {name!r} does not decode as {spec.payload.__name__}: {exc}") from None


def _check_deadline(deadline: float) -> None:
    """A store's or retrieve's ``deadline``: a Unix time, or 0 (none)."""
    if not (math.isfinite(deadline) and deadline >= 0):
        raise _invalid("deadline", f"must be a Unix time (0: none), got {deadline!r}")


class CacheServer:
    """The kvxfer cache server. ``serve_forever()`` runs it on the calling thread."""

    def __init__(self, config: ServerConfig, hooks: HookRelay | None = None) -> None:
        self.config = config
        # what can be checked at once is, before the arena: faulting that in may take minutes (the
        # url and its keys were, by ServerConfig)
        parent = config.parent_pid
        if parent is not None and os.getppid() != parent:
            raise ConfigError(f"--exit-with-parent {parent}: process {parent} is not this server's parent (that is "
                              f"process {os.getppid()}): the process that started the server has exited already, "
                              "or another one was named")
        if config.l2 is not None:  # an unknown store
            get_store(config.l2.store)
        for name in config.transports or ():  # a transport named that is not installed or cannot run here
            registry.get_transport(name)
        #: This server's hold on its ipc:// socket, from before its arena to its end: a second
        #: server at the socket fails here, whether the first listens yet or not.
        self._claim = claim_socket(config.url)
        self._metrics: MetricsExporter | None = None
        try:
            if config.metrics_port is not None:  # a port in use; served once the server is whole
                from kvxfer.server.metrics import MetricsExporter

                self._metrics = MetricsExporter(self, config.metrics_host, config.metrics_port)
            self._start(config, hooks)
        except BaseException:
            if self._metrics is not None:
                self._metrics.close()
            self._release_claim()
            raise

    def _release_claim(self) -> None:
        if self._claim is not None:
            self._claim.release()

    def _start(self, config: ServerConfig, hooks: HookRelay | None) -> None:
        """The rest of ``__init__``: the arena, transports, socket, L2 tier, metrics."""
        self.started = time.time()
        self.hooks = hooks if hooks is not None else HookRelay()
        # the L2 store first: a URL it cannot use, or credentials it refuses, stop the server at
        # once rather than after the arena is made (seconds for a large one)
        first = StoreOpener(config.l2).open_first() if config.l2 is not None else None
        mq: MQServer | None = None
        try:  # (whatever fails from here closes what was made: the store first opened included)
            self.arena = Arena.create(config.l1_size, config.shm_dir)
            self.limits = config.limits.resolved(self.arena.size)
            self.index = ChunkIndex(self.arena.size, on_evict=self._on_evict)
            self.contexts: dict[int, RegisteredContext] = {}
            #: The arena's slots as the registered layouts see them, shared by every context
            #: (kvxfer.copies.SlotViews: loop thread; one bound for the server)
            self._slot_views: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
            #: (model_name, world_size, rank) -> chunk format of the contexts registered now (built on
            #: demand by _chunk_format, dropped whenever a context comes or goes)
            self._formats: dict[tuple[str, int, int], str] | None = None
            self.sessions: dict[bytes, Session] = {}
            self.transports: dict[str, LoadedTransport] = {}
            self.transport_errors: dict[str, str] = {}
            self.dropped_connections = 0
            #: Running figures (status, `kvxfer top`, Prometheus metrics); loop thread only.
            self.stats = ServerStats(tuple(REQUESTS), config.metrics_max_models)
            #: warnings a client's requests can cause at will: at most one a second per kind
            self._throttled = ThrottledLog(log)
            #: Registrations sent to a worker and not finished yet (they count against the limits).
            self._registering = 0
            #: Open writes of silent clients whose process still lives, by the secret of the session
            #: that left them (kvxfer.server.sessions.Parked). They stay in the index's reservations,
            #: marked parked: no context reaches them; their slots are freed once the process is gone,
            #: or once the same client resumes its session and sends its late commit (a commit is sent
            #: only after the copy).
            self._parked: dict[bytes, Parked] = {}
            #: Periodic passes (:meth:`_tick`) completed: status ``ticks``.
            self.ticks = 0
            self._last_tick = time.monotonic()
            #: Runs the transfers of every registered instance, one lane each.
            self._pool = WorkerPool(self.limits.workers)
            #: Runs the waiters of server-driven copies (see ServerContext.store).
            self._waiters = ThreadPoolExecutor(4, thread_name_prefix="kvxfer-wait")
            #: Requests waiting on L2 (_Awaiting), in all; each session counts its own.
            self._waiting = 0
            #: Stores waiting for promotions: (when the wait ends, the future that ends it), ended
            #: by the tick at the latest (:meth:`_store_wait`).
            self._store_waits: list[tuple[float, Future[None]]] = []
            #: The L2 tier under the arena (``--l2``), or None.
            self.tier: L2Tier | None = None
            #: Whether a stop signal came (a second one exits at once: _on_signal).
            self._stop_signalled = False
            #: SIGHUP came: the loop's next tick has the authorized client keys read again
            self._reload_keys = False
            #: The thread reading them (10,000 key files take about 0.3 s: never the loop's time)
            self._reloader: threading.Thread | None = None
            #: Messages the loop is handling now (in :meth:`_dispatch`): with ``stats.in_flight``, what
            #: tells the warm thread the server is idle.
            self._handling = 0
            #: Runs the per-request steps while idle (``--warm-us``), from serve_forever; None: off.
            self.warmer = Warmer(config.warm_s, self._warm_layouts, self._idle) if config.warm_s else None
            self._load_transports()
            self._mq = mq = MQServer(
                config.url,
                self._dispatch,
                max_message_size=config.max_message_size,
                curve=config.curve,
                on_tick=self._tick,
                max_unread_reply_bytes=self.limits.max_unread_reply_bytes,
                on_unread_overflow=self._on_unread_overflow,
                busy_poll_s=config.busy_poll_s,
                # sessions past the limit are answered with an error that says so; a few more
                # connections are let in to hear it
                max_connections=self.limits.max_connections + 64,
                on_disconnect=self._on_disconnect,
            )
            if config.l2 is not None:
                self.tier = L2Tier(config.l2, self.index, self.arena, self._mq.call_soon, self._chunk_format,
                                   watch=self._mq.watch, unwatch=self._mq.unwatch, tick_by=self._mq.tick_by)
                taken, first = first, None  # the tier's from here: its close() closes it
                self.tier.start(taken)
            if self._metrics is not None:
                self._metrics.start()
        except BaseException:
            tier = getattr(self, "tier", None)
            if tier is not None:
                tier.close()
            if isinstance(first, Backend):
                first.close()
            if mq is not None:
                mq.close()
            if hasattr(self, "transports"):
                self._close_transports()
            for pool in (getattr(self, "_pool", None), getattr(self, "_waiters", None)):
                if pool is not None:
                    pool.shutdown(wait=False)
            if hasattr(self, "arena"):
                self.arena.close()
            raise
        #: The request table's kind picks the table a handler is in, and how its answer is sent.
        #: Either may answer later (_Awaiting): a lookup that asks L2, a read that waits for promotions.
        self._control: dict[str, Callable[[Session, Any], msgspec.Struct | _Awaiting]] = {
            name: getattr(self, f"_on_{name}") for name, spec in REQUESTS.items()
            if spec.kind is HandlerKind.CONTROL and name != "handshake"
        }
        self._transfer: dict[str, Callable[[Session, Any], _Deferred | _Awaiting]] = {
            name: getattr(self, f"_on_{name}") for name, spec in REQUESTS.items() if spec.kind is HandlerKind.TRANSFER
        }

    # ------------------------------------------------------------------ set-up

    def _load_transports(self) -> None:
        explicit = self.config.transports is not None
        names = list(self.config.transports or ()) if explicit else registry.installed_names()
        for name in names:
            try:
                transport = registry.get_transport(name)
                if not transport.production:
                    if not explicit:
                        self.transport_errors[name] = ("not meant for production; loaded only when named in "
                                                       "--transports")
                        log.info("transport %s not loaded: it is not meant for production (name it in --transports "
                                 "to load it)", name)
                        continue
                    log.warning("transport %s is not meant for production (it may trust what clients send it); "
                                "loaded because --transports names it", name)
                with plugin_step(name, "server_transport"):
                    st = transport.server_transport()
                with plugin_step(name, "start"):
                    st.start(self.arena)
            except (TransportError, Exception) as exc:
                if explicit:
                    raise
                self.transport_errors[name] = str(exc)
                log.info("transport %s not loaded: %s", name, exc)
                continue
            self.transports[name] = LoadedTransport(transport, st)
            try:  # its @hookimpl methods (e.g. kvxfer_metrics) take part in the server's hooks
                self.hooks.register(st, f"kvxfer.transport.{name}")
            except Exception:  # noqa: BLE001  (hooks that do not match the specs must not stop the server)
                self.hooks.errors += 1
                log.exception("the hooks of transport %s do not match the hook specs; ignoring them", name)
        if not self.transports:
            # every installed transport was tried: suggest installing kvxfer-cpu-gather only where it is not
            hint = ("" if "cpu_gather" in self.transport_errors else
                    "install one (kvxfer-cpu-gather: pip install plugins/cpu_gather in a kvxfer checkout) and ")
            raise ConfigError(
                f"no transport could be loaded; {hint}see `kvxfer plugins`"
                + "".join(f"\n  {n}: {e}" for n, e in self.transport_errors.items())
            )

    def _close_transports(self) -> None:
        for lt in self.transports.values():
            try:
                with plugin_step(lt.transport.name, "close"):
                    lt.server.close()
            except TransportFailed:
                log.exception("closing transport %s failed", lt.transport.name)

    @property
    def url(self) -> str:
        return self.config.url

    # ------------------------------------------------------------------ run

    def serve_forever(self, install_signal_handlers: bool = False) -> None:
        """Serve until :meth:`stop`. With ``install_signal_handlers`` (the main thread only),
        SIGTERM and SIGINT stop the server; a second one exits at once (see :meth:`_on_signal`);
        SIGHUP reads the authorized client keys again (:meth:`MQServer.reload_authorized`) on a
        ``tcp://`` server, and stops an ``ipc://`` one as SIGTERM does (however many come:
        :meth:`_on_terminal_closed`) unless it was ignored (``nohup``: ignored still; by default
        it ended the server, leaving its socket)."""
        if install_signal_handlers and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)
            if self._mq.curve:
                signal.signal(signal.SIGHUP, self._on_hangup)
            elif signal.getsignal(signal.SIGHUP) == signal.SIG_DFL:  # not under nohup: a closed terminal
                signal.signal(signal.SIGHUP, self._on_terminal_closed)  # stops it, removing its socket
            exits_on_the_main_thread_are_plugin_failures()  # its handlers raise nothing: any exit is a plugin's
        self.hooks.call("kvxfer_server_started", server=self)
        log.info("kvxfer %s serving %s: arena %s at %s, chunk size %d, transports %s%s",
                 kvxfer.__version__, self.url, format_bytes(self.arena.size), self.arena.path,
                 self.config.chunk_size, ", ".join(self.transports),
                 f", metrics at {self.metrics_url}" if self.metrics_url else "")
        try:
            if self.warmer is not None:
                self.warmer.start()
            self._mq.serve_forever()
        finally:
            self._shutdown()

    def stop(self) -> None:
        """Ask the loop to stop (any thread, or a signal handler)."""
        self._mq.stop()

    def _on_hangup(self, signum: int, frame: FrameType | None) -> None:
        """SIGHUP (a ``tcp://`` server): :meth:`reload_authorized_keys`."""
        self.reload_authorized_keys()

    def _on_terminal_closed(self, signum: int, frame: FrameType | None) -> None:
        """SIGHUP (an ``ipc://`` server): stop, as on the first SIGTERM, and never exit at once on
        a second one: a closing terminal sends its foreground job SIGHUP more than once (the
        shell passes its own on, then the kernel signals the foreground group), and a server that
        exited at once left its arena's memory behind."""
        if not self._stop_signalled:
            self._stop_signalled = True
            self.stop()

    def reload_authorized_keys(self) -> None:
        """Read the authorized client keys again (a ``tcp://`` server), from the loop's next tick
        (within about 0.25 s of serving) on a thread of its own, while the loop serves: safe from
        a signal handler, as it takes no lock. Calls that come before that tick, or while a read
        runs, are one reload more, of the folder as it is then."""
        self._reload_keys = True

    def _reload_authorized(self) -> None:
        """The reload thread's work: :meth:`MQServer.reload_authorized`, its failure logged (the
        keys let in before stay)."""
        try:
            self._mq.reload_authorized()
        except Exception:
            log.exception("reading the authorized client keys again failed; the keys let in before stay")

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """The first SIGTERM or SIGINT stops the server. A second one exits at once, logging
        where the main thread is: it is how an operator ends a server whose loop a plugin's call
        holds (a store's submit that never returns), or whose shutdown waits too long. The
        arena's directory is then left; the next server started removes it (its lock is free)."""
        if not self._stop_signalled:
            self._stop_signalled = True
            self.stop()
            return
        where = "".join(traceback.format_stack(frame, limit=8)) if frame is not None else "(unknown)\n"
        log.error("a second %s before the server stopped: exiting at once, without cleaning up. The server's "
                  "main thread was in:\n%s", signal.Signals(signum).name, where.rstrip())
        logging.shutdown()
        os._exit(1)

    @property
    def metrics_url(self) -> str:
        """Where Prometheus metrics are served, or "" when they are not."""
        return self._metrics.url if self._metrics is not None else ""

    @property
    def parked_writes(self) -> int:
        """Open writes kept for silent clients that still live (counted in the index's reservations)."""
        return sum(len(p.reservations) for p in self._parked_clients())

    def _parked_clients(self) -> list[Parked]:
        """Every Parked once (the secrets of the sessions of one client token name the same one)."""
        return list({id(p): p for p in self._parked.values()}.values())

    def call_on_loop(self, fn: Callable[[], T], timeout: float) -> T:
        """Run ``fn`` on the loop thread and return what it returns (from any other thread);
        raises :class:`TimeoutError` if the loop does not run it within ``timeout`` seconds
        (then it never runs)."""
        fut: Future[T] = Future()

        def run() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # noqa: BLE001  (handed to the caller)
                    fut.set_exception(exc)

        self._mq.call_soon(run)
        try:
            return fut.result(timeout)
        except FutureTimeout:
            fut.cancel()
            raise TimeoutError(f"the server's loop did not answer within {timeout} s") from None

    def _shutdown(self) -> None:
        # the loop has closed and removed the socket: a server started now may take the path
        # while this one finishes its transfers and drops its arena
        self._release_claim()
        if self.warmer is not None:
            self.warmer.stop()
        if self._metrics is not None:
            self._metrics.close()
        for ctx in list(self.contexts.values()):
            self._drop_context(ctx, "shutdown", wait=True)
        self._pool.shutdown(wait=True)
        self._waiters.shutdown(wait=True)
        if self.tier is not None:
            self.tier.close()
        self.hooks.call("kvxfer_server_stopped", server=self)
        self._close_transports()
        self._slot_views.clear()
        self.arena.close()

    # ------------------------------------------------------------------ dispatch

    def _dispatch(self, identity: bytes, peer: str, rid: bytes, name_b: bytes,
                  payload: bytes) -> tuple[bytes, bytes] | None:
        self._handling += 1  # (the warm thread's view of the loop: see _idle)
        try:
            t0 = time.perf_counter()
            name = name_b.decode("utf-8", "replace")
            spec = REQUESTS.get(name)
            out: msgspec.Struct | _Deferred | _Awaiting | None = None
            try:
                if spec is None:
                    raise UnknownRequest(f"unknown request {name[:64]!r}; this server ({kvxfer.__version__}) knows: "
                                         f"{', '.join(REQUESTS)}")
                if name == "handshake":
                    out = self._on_handshake(identity, peer, cast(m.Handshake, _decode(name, spec, payload)))
                else:
                    session = self.sessions.get(identity)  # before the payload is decoded: that may cost
                    if session is None or session.peer.raw != peer:
                        raise NoSession("this connection has no session (the server may have restarted, or the "
                                        "session timed out): send a handshake first (kvxfer.CacheClient: call "
                                        "reconnect(), which also registers its contexts again)")
                    session.last_seen = time.monotonic()
                    handler = self._transfer[name] if spec.kind is HandlerKind.TRANSFER else self._control[name]
                    out = handler(session, _decode(name, spec, payload))
                if not isinstance(out, (_Deferred, _Awaiting)):
                    reply = codec.OK, codec.encode(out)
            except Exception as exc:  # noqa: BLE001  (every handler error becomes a typed error reply)
                out = None
                reply = self._error(name, exc)
            if isinstance(out, (_Deferred, _Awaiting)):  # answered later, by _answer
                self.stats.in_flight += 1
                self._answer(identity, rid, name, out, t0)
                return None
            self.stats.on_request(name, time.perf_counter() - t0)
            return reply
        finally:
            self._handling -= 1

    def _answer(self, identity: bytes, rid: bytes, name: str, out: msgspec.Struct | _Deferred | _Awaiting,
                t0: float) -> None:
        """Send a handler's answer now, or once its deferred part is done (loop thread); the
        request arrived at ``t0`` and counts as in flight until then."""
        if isinstance(out, _Deferred):
            self._run_deferred(identity, rid, name, out, t0)
        elif isinstance(out, _Awaiting):
            session = out.session
            session.waiting += 1
            self._waiting += 1

            def resume() -> None:
                session.waiting -= 1
                self._waiting -= 1
                try:
                    nxt = out.then()
                except Exception as exc:  # noqa: BLE001  (every handler error becomes a typed error reply)
                    if out.release is not None:
                        out.release()
                    self._mq.send(identity, rid, *self._error(name, exc))
                    self._answered(name, t0)
                    return
                self._answer(identity, rid, name, nxt, t0)

            # resolved on the loop (a promotion, a lookup read by the loop): answer now
            out.future.add_done_callback(lambda _f: resume() if self._mq.in_loop() else self._mq.call_soon(resume))
        else:
            self._mq.send(identity, rid, codec.OK, codec.encode(out))
            self._answered(name, t0)

    def _answered(self, name: str, t0: float) -> None:
        """A request that waited got its reply (loop thread)."""
        self.stats.in_flight -= 1
        self.stats.on_request(name, time.perf_counter() - t0)

    def _error(self, name: str, exc: BaseException) -> tuple[bytes, bytes]:
        code: ErrorCode
        if isinstance(exc, RemoteError):
            code, msg = exc.code, exc.message
        elif isinstance(exc, MemoryError):
            log.warning("%s: out of memory: %s", name, exc)
            code, msg = ErrorCode.INVALID_REQUEST, f"{name}: the server ran out of memory for this request"
        elif isinstance(exc, TransportFailed):  # the plugin's own failure: the boundary named it
            log.error("%s: %s", name, exc, exc_info=exc.__cause__)
            code, msg = ErrorCode.INTERNAL, f"{exc} (see the server log)"
        elif isinstance(exc, (ConfigError, ValueError)):
            code, msg = ErrorCode.INVALID_REQUEST, str(exc)
        elif isinstance(exc, KvxferError):
            code, msg = ErrorCode.INVALID_REQUEST, f"{type(exc).__name__}: {exc}"
        else:
            log.exception("handler of %r raised", name)
            code = ErrorCode.INTERNAL
            msg = f"{name} failed in the server: {type(exc).__name__}: {exc} (see the server log)"
        if len(msg) > MAX_ERROR_MESSAGE:
            msg = msg[:MAX_ERROR_MESSAGE] + "..."
        self.stats.on_error(name, str(code))
        return codec.ERR, codec.encode(m.ErrorReply(code, msg))

    def _run_deferred(self, identity: bytes, rid: bytes, name: str, d: _Deferred, t0: float) -> None:
        def done(fut: Future[Any]) -> None:
            self._mq.call_soon(lambda: finish(fut))

        def finish(fut: Future[Any]) -> None:
            try:
                reply = d.finish(fut)
                out = codec.OK, codec.encode(reply)
            except Exception as exc:  # noqa: BLE001  (the deferred reply carries whatever failed)
                out = self._error(name, exc)
            self._mq.send(identity, rid, *out)
            self._answered(name, t0)

        def answer_early() -> None:  # the client waits for the copies itself
            assert d.early is not None
            try:
                out = codec.OK, codec.encode(d.early())
            except Exception as exc:  # noqa: BLE001  (the reply carries whatever failed)
                out = self._error(name, exc)
            self._mq.send(identity, rid, *out)
            self._answered(name, t0)

        def settle(fut: Future[Any]) -> None:  # after an early answer: commit, and say if the copy failed
            failed = fut.exception()
            if failed is not None:  # finish() unpins, then raises it again: said once, here
                log.error("%s: copies failed after the request was answered (the client was told they were "
                          "queued; its chunks are counted as not loaded): %s", name, failed,
                          exc_info=failed.__cause__ or failed)
            try:
                d.finish(fut)
            except Exception as exc:  # noqa: BLE001  (answered already: nothing to send it to)
                if exc is not failed:
                    log.exception("%s: finishing a request answered before its copies ended failed", name)

        def wait_off(waiter: Callable[[], None], then: Callable[[Future[Any]], None]) -> None:
            # off the instance's worker; the context's close waits for it (d.waiting)
            waited = self._waiters.submit(guarded(waiter, d.transport, f"{name} (waiter)"))
            if d.waiting is not None:
                d.waiting.add(waited)
                waited.add_done_callback(d.waiting.discard)
            waited.add_done_callback(then)

        def worked(fut: Future[Any]) -> None:
            waiter = fut.result() if fut.exception() is None else None
            if isinstance(waiter, Queued):
                if d.early is not None:  # answer now, commit once the copies are done
                    self._mq.call_soon(answer_early)
                    wait_off(waiter.waiter, lambda f: self._mq.call_soon(lambda: settle(f)))
                    return
                waiter = waiter.waiter  # only a retrieve may be answered early: wait, then answer
            if callable(waiter):  # the copy is queued: wait for it off the instance's worker
                wait_off(waiter, done)
            else:
                done(fut)

        if d.slot is None and self.stats.in_flight == 1 and d.executor.idle() and self._queues_only(d):
            # a lone request of a context whose copies only queue work: no hand-off to the
            # worker (the lane is idle, and only this loop submits to it)
            ran: Future[Any] = Future()
            ran.set_running_or_notify_cancel()
            try:
                ran.set_result(d.work())
            except BaseException as exc:  # noqa: BLE001  (handed on as the worker's future would)
                ran.set_exception(exc)
            worked(ran)
            return
        try:
            queued = d.executor.submit(d.work) if d.slot is None else d.executor.fill(d.slot, d.work)
            queued.add_done_callback(worked)
        except RuntimeError as exc:  # executor shut down: the context is being dropped
            self._mq.send(identity, rid, *self._error(name, UnknownInstance(f"instance is closing: {exc}")))
            self._answered(name, t0)

    @staticmethod
    def _queues_only(d: _Deferred) -> bool:
        """Whether ``d``'s server context says it only queues copies now (loop thread). It is the
        plugin's code: one that raises is logged and the request goes to the worker as usual."""
        if d.quick is None:
            return False
        try:
            with plugin_step(d.transport, "queues_only"):
                return bool(d.quick.queues_only)
        except TransportFailed:  # a plugin's error must not reach the loop
            log.exception("transport %s: reading its server context's queues_only failed: its requests run "
                          "on the instance's worker", d.transport)
            return False

    @staticmethod
    def _plugin(ctx: RegisteredContext, step: str, call: Callable[[], Any]) -> Callable[[], Any]:
        """``call`` (plugin code of ``ctx``'s transport) behind the core's error boundary."""
        def run() -> Any:
            with plugin_step(ctx.transport, step):
                return call()
        return run

    # ------------------------------------------------------------------ sessions

    def _on_handshake(self, identity: bytes, peer: str, msg: m.Handshake) -> m.HandshakeReply:
        if msg.protocol_version != m.PROTOCOL_VERSION:
            raise VersionMismatch(
                f"client speaks kvxfer protocol {msg.protocol_version}, this server ({kvxfer.__version__}) "
                f"speaks {m.PROTOCOL_VERSION}; install the same kvxfer version on both sides"
            )
        check_name("client_name", msg.client_name, self.limits)
        now = time.monotonic()
        session = self.sessions.get(identity)
        if session is not None and session.peer.raw == peer:
            session.last_seen = now  # the same connection again: the same session
        else:
            if session is not None:  # its connection went away and another took its routing id
                self._drop_session(identity, f"another connection ({Peer.parse(peer).label()}) took its routing id")
            self.limits.check("max_connections", len(self.sessions))
            who = Peer.parse(peer)
            token = self._end_resumed(msg.resume, who) if msg.resume else None
            parked = self._parked.get(msg.resume) if msg.resume else None
            if parked is not None and parked.peer.raw != peer:
                self._throttled.warning("foreign secret", f"{who.label()} presented the secret of a session of "
                                        f"{parked.peer.label()}: not resumed")
                parked = None
            if parked is not None:
                token = parked.token
            session = Session(identity, who, secrets.token_bytes(16), token or liveness.new_token(), msg.client_name,
                              who.pid if who.pid is not None else msg.pid, now, resumed=parked)
            self.sessions[identity] = session
        cfg = self.config
        return m.HandshakeReply(
            protocol_version=m.PROTOCOL_VERSION,
            server_version=kvxfer.__version__,
            chunk_size=cfg.chunk_size,
            transports=sorted(self.transports),
            arena_path=str(self.arena.path),
            arena_size=self.arena.size,
            heartbeat_s=cfg.heartbeat_s,
            session_timeout_s=cfg.session_timeout_s,
            max_message_size=cfg.max_message_size,
            features=list(m.FEATURES),
            session_secret=session.secret,
            client_token=session.token,
            max_lease_s=self.limits.max_lease_s,
            max_name_length=self.limits.max_name_length,
        )

    def _end_resumed(self, secret: bytes, who: Peer) -> str | None:
        """A handshake on a new connection resumes the session of ``secret`` that is still open
        (the client's connection broke, and the server has not seen that yet): end that session
        now, its open writes and reads parked (the client lives and may still copy into or out
        of their slots, and counts on a read's pins for the session timeout after its reserve),
        and return its liveness token for the new session, so that the lock the client holds
        keeps naming them. None if no open session of that peer has the secret."""
        old = next((s for s in self.sessions.values() if s.secret == secret), None)
        if old is None:
            return None
        if old.peer.raw != who.raw:
            self._throttled.warning("foreign secret", f"{who.label()} presented the secret of a session of "
                                    f"{old.peer.label()}: not resumed")
            return None
        self._drop_session(old.identity, "its client resumed it on a new connection", park_reads=True)
        return old.token

    def _tick(self) -> None:
        """The loop's periodic pass (MQServer's ``on_tick``, about every 0.25 s); ``ticks`` counts
        the passes completed (status)."""
        now = time.monotonic()
        if self._reload_keys and (self._reloader is None or not self._reloader.is_alive()):
            self._reload_keys = False  # (one asked for during a read is the next one: folders read in order)
            self._reloader = threading.Thread(target=self._reload_authorized, name="kvxfer-authorized-keys",
                                              daemon=True)
            self._reloader.start()
        parent = self.config.parent_pid
        if parent is not None and os.getppid() != parent and not self._stop_signalled:
            self._stop_signalled = True  # stopping, as for a signal: an operator's next one ends a shutdown that hangs
            log.warning("the process that started this server (pid %d) has exited: stopping (--exit-with-parent)",
                        parent)
            self.stop()
        # after a pass that kept the loop from reading for long, a client's heartbeat may be
        # waiting unread: nobody is judged silent until the loop has read again
        stalled = now - self._last_tick > self.config.session_timeout_s / 2
        self._last_tick = now
        self.index.expire_leases(now)
        if self._store_waits:
            for _, gate in [w for w in self._store_waits if w[0] <= now]:
                settle_once(gate)
            self._store_waits = [w for w in self._store_waits if not w[1].done()]
        if self.tier is not None:
            self.tier.tick()
        for identity, session in list(self.sessions.items()):
            if not stalled and now - session.last_seen > self.config.session_timeout_s:
                # a crash or a kill (an engine stopped with SIGKILL) reads differently in the log
                # from a client that stopped answering (one without a lock: nothing is known)
                gone = liveness.holder_gone(self.arena.path, session.token)
                self._drop_session(identity, _PROCESS_GONE if gone else "timed out")
        for parked in self._parked_clients():
            if not liveness.holder_alive(self.arena.path, parked.token):
                self._free_parked(parked)
                log.info("client %s is gone: freed the slots of its parked writes", parked.peer.label())
            else:
                self._expire_parked_reads(parked)
        self.ticks += 1

    def _free_parked(self, parked: Parked) -> None:
        self._forget_parked(parked)
        for res in parked.reservations.values():
            self.index.abort(res)
        parked.reservations.clear()

    def _expire_parked_reads(self, parked: Parked) -> None:
        """A parked read's pins need to outlast its copy only: its client takes a read as loaded
        without waiting for the commit's answer only within half the session timeout of its
        reserve. Past a whole session timeout they go, so that a commit_read lost with the
        client's old connection does not pin its chunks for the client's life."""
        now = time.perf_counter()
        old = [rid for rid, res in parked.reservations.items()
               if not res.write and now - res.opened > self.config.session_timeout_s]
        for rid in old:
            self.index.abort(parked.reservations.pop(rid))
        if old and not parked.reservations:
            self._forget_parked(parked)

    def _parked_of(self, peer: Peer, token: str) -> tuple[int, int]:
        """The reservations parked for the sessions of the client process of ``peer`` (its pid,
        on ipc:// in the server's pid namespace), else of the client of ``token`` (a client the
        kernel shows as pid 0, in another pid namespace; over tcp://, where one CURVE key may
        serve many engines), and their bytes. A process may end sessions with reservations open,
        one after another (resuming each on a new connection), faster than they go, and none is
        freed while it lives (it may still copy): so they count against each new session of that
        process (or client) as the session's own, and it gets no more than one session's worth
        (--max-reservations-per-session, --max-reserved-bytes-per-session) however many sessions
        it ends. Other processes, of the same user too, are not held back by them."""
        def owner(p: Peer, t: str) -> object:
            return ("pid", p.uid, p.pid) if p.pid else ("client", t)

        mine = owner(peer, token)
        n = nbytes = 0
        for p in self._parked_clients():
            if owner(p.peer, p.token) == mine:
                n += len(p.reservations)
                nbytes += sum(res.nbytes for res in p.reservations.values())
        return n, nbytes

    def _forget_parked(self, parked: Parked) -> None:
        for secret in [k for k, v in self._parked.items() if v is parked]:
            del self._parked[secret]

    def _on_disconnect(self, identity: bytes) -> None:
        """An ``ipc://`` connection closed. Its session ends now if it holds nothing (no
        registration, reservation or lease: a client that comes back has nothing to resume, and
        opens a session all the same); else at its timeout, as on ``tcp://``, so that its client
        may still resume it. One client opening sessions and closing their connections in a
        loop, without a goodbye, once held every place of ``--max-connections`` for others."""
        session = self.sessions.get(identity)
        if session is not None and not (session.instances or session.registering or session.usage.reservations
                                        or session.usage.leases):
            self._drop_session(identity, _CONNECTION_CLOSED)

    def _on_unread_overflow(self, identity: bytes, unread: int) -> None:
        """The connection left more than --max-unread-reply-bytes of replies unread (MQServer
        dropped them): end its session."""
        self.dropped_connections += 1
        session = self.sessions.get(identity)
        who = session.peer.label() if session is not None else "a connection without a session"
        limit = format_bytes(self.limits.max_unread_reply_bytes)
        self._throttled.warning("unread replies", f"{who} does not read its replies ({format_bytes(unread)} unread, "
                                f"more than --max-unread-reply-bytes {limit}): dropped them and ended its session")
        if session is not None:
            self._drop_session(identity, "stopped reading its replies")

    def _drop_session(self, identity: bytes, reason: str, park_reads: bool = False) -> None:
        """End a session: its registrations, reservations and leases go; the open writes of a
        client whose process still lives are parked (see Parked), and its open reads too with
        ``park_reads`` (a session its client resumed: the reads' copies rely on their pins)."""
        session = self.sessions.pop(identity)
        # a client that registered nothing and said goodbye (`kvxfer status`, polled) is no news
        quiet = (not session.registered and not session.usage.leases
                 and reason in (_CLOSED_BY_CLIENT, _CONNECTION_CLOSED))
        name = printable(session.name) if session.name else "unnamed"
        name = name if len(name) <= 64 else f"{name[:64]}..."
        line = (f"session of {session.peer.label()} ({name}) ended "
                f"({reason}): dropping its {len(session.instances)} registrations")
        if quiet:
            log.debug("%s", line)
        else:  # a client may end sessions as fast as it opens them (a kind per reason: a session
            # that timed out is not hidden behind one that was closed a moment before)
            self._throttled.log(logging.INFO, f"session ended ({reason[:24]})", line)
        # a silent client that still lives may wake mid-copy: keep its write slots until it dies
        # (one that said goodbye has closed its contexts, so copies no more: nothing is kept)
        parked = None
        if reason != _CLOSED_BY_CLIENT and liveness.holder_alive(self.arena.path, session.token):
            # one Parked per client token: the writes of each session it resumes join it
            parked = next((p for p in self._parked_clients() if p.token == session.token), None) \
                or Parked(session.secret, session.peer, session.token)
        for iid in list(session.instances):
            ctx = self.contexts.get(iid)
            if ctx is not None:
                self._drop_context(ctx, "session lost", park_into=parked, park_reads=park_reads)
        for lease_id in list(session.usage.leases):
            self.index.release_lease(lease_id)
        if parked is not None and parked.reservations:
            self._forget_parked(parked)  # the client presents its newest secret only
            self._parked[session.secret] = parked

    def _drop_context(self, ctx: RegisteredContext, reason: str, wait: bool = False,
                      park_into: Parked | None = None, park_reads: bool = False) -> None:
        """Forget a context now; close its server side after its in-flight transfers. Its open
        reservations are aborted, except writes (and, with ``park_reads``, reads) parked into
        ``park_into``."""
        self.contexts.pop(ctx.instance_id, None)
        self._formats = None
        session: Session = ctx.owner
        session.instances.discard(ctx.instance_id)
        slots = lost = 0
        for res in [r for r in session.usage.reservations.values()
                    if r.instance_id == ctx.instance_id and not r.parked]:
            if res.in_flight:
                continue
            if res.write:  # never stored now: a parked write's late commit is refused too
                lost += len(res.entries)
            if res.entries and park_into is not None and (res.write or park_reads):  # no slot: nothing to keep
                res.parked = True
                park_into.reservations[res.id] = res
                slots += len(res.entries)
            else:
                self.index.abort(res)
        if lost:
            self.stats.on_store(self.stats.traffic_of(ctx.model_name, ctx.transport), 0, lost, ctx.chunk.nbytes,
                                None, 0.0, abandoned=True)
        if slots:
            self._throttled.warning("parked", f"client {session.peer.label()} lost its session but lives: keeping the "
                                    f"{slots} slots of its open reservations until it exits or sends their late "
                                    "commits")
        ctx.executor.submit(self._close_server_context, ctx)
        ctx.executor.shutdown(wait=wait)
        self.hooks.call("kvxfer_context_unregistered", server=self, context=ctx, reason=reason)

    def _warm_layouts(self) -> list[tuple[KVLayout, int]]:
        """The layout and chunk size of each registered server-driven context: the server runs
        the warmed steps for those only (a client-driven client runs them itself). Called on the
        warm thread: the dict is copied in one step, under the GIL, and a context's layout never
        changes."""
        return [(ctx.layout, ctx.chunk_size) for ctx in tuple(self.contexts.values())
                if ctx.server_context is not None]

    def _idle(self) -> bool:
        """No message is being handled and no request is in flight (read on the warm thread)."""
        return self._handling == 0 and self.stats.in_flight == 0

    @staticmethod
    def _close_server_context(ctx: RegisteredContext) -> None:
        """On the instance's worker, after the transfers queued before: waits for their waiters
        (a retrieve answered early may still copy), then closes the server context."""
        futures_wait(list(ctx.waiting))
        if ctx.server_context is not None:
            plugin_step_call(ctx.transport, "close", ctx.server_context.close)

    def _context(self, session: Session, instance_id: int) -> RegisteredContext:
        ctx = self.contexts.get(instance_id)
        if ctx is None or ctx.owner is not session:
            raise UnknownInstance(
                f"instance {instance_id} is not registered on this connection (never registered, "
                "unregistered, or dropped when its session timed out): register again"
            )
        return ctx

    # ------------------------------------------------------------------ control requests

    def _on_goodbye(self, session: Session, msg: m.Goodbye) -> m.Empty:
        self._drop_session(session.identity, _CLOSED_BY_CLIENT)
        return m.Empty()

    def _on_ping(self, session: Session, msg: m.Ping) -> m.Pong:
        return m.Pong(time.time())

    def _on_register(self, session: Session, msg: m.Register) -> _Deferred:
        lt = self.transports.get(msg.transport)
        if lt is None:
            raise _invalid("transport", f"transport {_show(msg.transport)} is not loaded by this server; loaded: "
                                        f"{', '.join(sorted(self.transports))} (start it with --transports)")
        if len(msg.registration) > self.limits.max_registration_bytes:  # before anything of it is decoded
            raise self.limits.exceeded("max_registration_bytes", f"this one is {len(msg.registration)} bytes")
        try:
            reg = codec.decode(msg.registration, lt.transport.registration_type)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            wanted = lt.transport.registration_type.__name__
            raise _invalid("registration", f"does not decode as {wanted}: {exc}") from None
        here = session.peer.pid_here()  # Registration.pid: the kernel's word where it can be compared
        if reg.pid and here and reg.pid != here:
            raise _invalid("registration", f"names process {reg.pid}, but it comes from process {here}: a "
                                           "registration names the engine that sends it")
        if reg.pid != here:  # what the transport is given: that word, or 0 where there is none
            reg = msgspec.structs.replace(reg, pid=here)
        with plugin_step(msg.transport, "addressable_bytes"):
            addressable = lt.server.addressable_bytes()
        layout = validate_registration(reg, self.config.chunk_size, self.arena.size, self.limits, addressable)
        held = self.contexts.get(reg.instance_id)
        if held is not None:
            where = m.ALREADY_REGISTERED if held.session == session.identity else m.REGISTERED_ELSEWHERE
            raise _invalid("instance_id", f"{reg.instance_id} {where}")
        self._check_one_format(reg, layout.chunk_format(self.config.chunk_size))
        self.limits.check("max_registrations", len(self.contexts) + self._registering)
        self.limits.check("max_registrations_per_session", len(session.instances) + session.registering)
        executor = self._pool.lane()
        self._registering += 1
        session.registering += 1

        def finish(fut: Future[Any]) -> m.RegisterReply:
            self._registering -= 1
            session.registering -= 1
            try:
                server_context = fut.result()
            except BaseException:  # the transport refused it: nothing to close
                executor.shutdown(wait=False)
                raise
            if self.sessions.get(session.identity) is not session or reg.instance_id in self.contexts:
                if server_context is not None:
                    executor.submit(plugin_step_call, msg.transport, "close", server_context.close)
                executor.shutdown(wait=False)
                raise UnknownInstance("the session ended or the id was taken while registering")
            ctx = RegisteredContext(
                instance_id=reg.instance_id, model_name=reg.model_name, world_size=reg.world_size,
                rank=reg.rank, layout=layout, transport=msg.transport, registration=reg, server_context=server_context,
                session=session.identity, client_pid=session.pid, chunk_size=self.config.chunk_size,
                executor=executor, views=SlotViews(self.arena.view, layout, self.config.chunk_size, self._slot_views),
                owner=session,
            )
            self.contexts[ctx.instance_id] = ctx
            self._formats = None
            session.instances.add(ctx.instance_id)
            session.registered += 1
            self.stats.register_model(ctx.model_name)
            self.stats.traffic_of(ctx.model_name, ctx.transport)  # its series from now on (0 once it leaves)
            self.hooks.call("kvxfer_context_registered", server=self, context=ctx)
            return m.RegisterReply(ctx.instance_id, ctx.chunk.nbytes)

        def open_() -> ServerContext[Any, Any] | None:
            with plugin_step(msg.transport, "open"):
                return lt.server.open(reg, layout)

        return _Deferred(executor, open_, finish, msg.transport)

    def _check_one_format(self, reg: m.Registration, fmt: str) -> None:
        """Chunks stored under one identity (model_name, world_size) all have one format: refuse
        a registration whose KV cache would write or read another."""
        held = self.index.format_of(reg.model_name, reg.world_size)
        if held is None:
            held = next((c.chunk.fmt for c in self.contexts.values()
                         if c.model_name == reg.model_name and c.world_size == reg.world_size), None)
        if held is not None and held != fmt:
            raise _invalid("model_name", f"chunks of {reg.model_name!r} (world size {reg.world_size}) are in format "
                                         f"{held}, but this KV cache's are {fmt} (another layout, dtype, block size "
                                         f"or number of layers): register it under another model_name")

    def _on_unregister(self, session: Session, msg: m.Unregister) -> _Deferred:
        ctx = self._context(session, msg.instance_id)

        def finish(fut: Future[Any]) -> m.Empty:  # after the transfers queued before it
            if self.contexts.get(ctx.instance_id) is ctx:
                self._drop_context(ctx, "unregister")
            return m.Empty()

        return _Deferred(ctx.executor, lambda: None, finish, ctx.transport)

    def _on_lookup(self, session: Session, msg: m.Lookup) -> m.LookupReply | _Awaiting:
        if not 0 < msg.world_size <= MAX_WORLD_SIZE:
            raise _invalid("world_size", f"must be in [1, {MAX_WORLD_SIZE}], got {msg.world_size}")
        if not math.isfinite(msg.lease_s) or msg.lease_s < 0:
            raise _invalid("lease_s", f"must be a finite number of seconds >= 0, got {msg.lease_s}")
        check_name("model_name", msg.model_name, self.limits)
        if len(msg.hashes) * msg.world_size > MAX_LOOKUP_KEYS:
            raise _invalid("hashes", f"{len(msg.hashes)} chunks for world_size {msg.world_size} name "
                                     f"{len(msg.hashes) * msg.world_size} keys; a lookup names at most "
                                     f"{MAX_LOOKUP_KEYS}: look up fewer chunks at once")
        if msg.lease_s > self.limits.max_lease_s:
            raise self.limits.exceeded("max_lease_s", f"lease_s is {msg.lease_s:g}")
        hits = self.index.lookup(msg.model_name, msg.world_size, msg.hashes)
        tier = self.tier
        pending = None
        if tier is not None and hits < len(msg.hashes):
            self._check_waiting(session)
            # the L2 check is sent first: what follows overlaps the store's answer
            pending = tier.begin_lookup(msg.model_name, msg.world_size, msg.hashes, hits)
        if tier is not None:
            if hits and tier.counts_hits:
                tier.count_hits(msg.model_name, msg.world_size, msg.hashes[:hits])
            if pending is not None:
                return _Awaiting(session, pending, lambda: self._lookup_reply(
                    session, msg, *tier.finish_lookup(pending, msg.promote,
                                                      functools.partial(self._check_lease_of, session, msg))))
        return self._lookup_reply(session, msg, hits, 0, hits)

    def _check_lease_of(self, session: Session, msg: m.Lookup, held: list[Entry], promoted: int,
                        nbytes: int) -> None:
        """Before a lookup promotes ``promoted`` keys (``nbytes`` of arena) from L2: raise
        LimitExceeded if the lease it will then take (of ``held``, the L1 entries of every rank of
        its leading chunks, and of the promoted ones) is past the session's limits, so that a
        refused lookup has promoted nothing."""
        if msg.lease_s > 0 and self.sessions.get(session.identity) is session:  # else nothing is leased
            self._check_lease(session, session.usage.lease_need(held) + nbytes, len(held) + promoted)

    def _check_lease(self, session: Session, nbytes: int, pins: int) -> None:
        """Raise LimitExceeded unless ``session`` may take one more lease of ``pins`` chunks
        adding ``nbytes`` to its leased bytes."""
        usage = session.usage
        self.limits.check("max_leases", len(self.index.leases))
        self.limits.check("max_leases_per_session", len(usage.leases))
        self.limits.check("max_leased_bytes_per_session", usage.leased_bytes, nbytes)
        self._check_chunk_pins(session, pins)

    def _lookup_reply(self, session: Session, msg: m.Lookup, hits: int, l2_hits: int,
                      leasable: int) -> m.LookupReply:
        """Lease the hits that have L1 entries (all of them when promoting) and reply. The
        lease belongs to ``session`` (its limits, its end), unless that session ended meanwhile.
        A lookup refused for a lease limit counts in no lookup figure (the L2 tier's count the
        existence check it made)."""
        lease_id = 0
        leased = min(hits, leasable)
        if msg.lease_s > 0 and leased and self.sessions.get(session.identity) is session:
            entries = self.index.lease_keys(msg.model_name, msg.world_size, msg.hashes[:leased])
            self._check_lease(session, session.usage.lease_need(entries.values()), len(entries))
            lease_id = self.index.lease(entries, msg.lease_s, session.usage)
            if msg.prefetch:  # right after the reply is sent
                self._mq.after_reply(functools.partial(self._prefetch, msg, entries))
        self.stats.on_lookup(msg.model_name, len(msg.hashes), hits, l2_hits)
        return m.LookupReply(hits, lease_id, l2_hits)

    def _prefetch(self, msg: m.Lookup, entries: dict[ChunkKey, Entry]) -> None:
        """``Lookup.prefetch``: give the chunks a lookup leased (``entries``) to the server
        context of each rank's one registered instance of the model, if its transport
        prefetches and nothing is in flight (loop thread; errors are logged only)."""
        if self.stats.in_flight:
            return  # transfers are running: the copy engines are theirs
        by_rank: dict[int, RegisteredContext | None] = {}
        for c in self.contexts.values():
            if c.model_name == msg.model_name and c.world_size == msg.world_size:
                by_rank[c.rank] = None if c.rank in by_rank else c  # two of one rank: which one loads?
        for rank, ctx in by_rank.items():
            if ctx is None or not self._prefetches(ctx):
                continue
            chunks = []
            for h in msg.hashes[:MAX_PREFETCH_CHUNKS]:
                key = ChunkKey(msg.model_name, msg.world_size, rank, h)
                e = entries.get(key)
                if (e is None or self.index.entries.get(key) is not e or e.state is not State.READY or not e.leases
                        or e.fmt != ctx.chunk.fmt):
                    break  # a leading run of chunks still leased, as a retrieve loads them
                chunks.append(StoredSlot(ctx.views.bytes(e.offset), e.stamp))
            self._hand_prefetch(ctx, chunks)

    @staticmethod
    def _prefetches(ctx: RegisteredContext) -> bool:
        """Whether ``ctx``'s server context implements ``prefetch`` and its lane is idle (queues_only
        is not asked: a prefetch only queues work whatever it says)."""
        sc = ctx.server_context
        return sc is not None and type(sc).prefetch is not ServerContext.prefetch and ctx.executor.idle()

    @staticmethod
    def _hand_prefetch(ctx: RegisteredContext, chunks: list[StoredSlot]) -> None:
        """``ctx``'s server context's ``prefetch(chunks)`` behind the error boundary (loop
        thread; what it raises is logged only: a hint's failure costs a head start, no more)."""
        if not chunks or ctx.server_context is None:
            return
        try:
            with plugin_step(ctx.transport, "prefetch"):
                ctx.server_context.prefetch(chunks)
        except Exception:  # noqa: BLE001
            log.exception("transport %s: prefetching %d chunks for instance %d failed", ctx.transport,
                          len(chunks), ctx.instance_id)

    def _stage_lone(self, ctx: RegisteredContext, msg: m.Retrieve) -> None:
        """A lone retrieve (nothing in flight; a resumed one counts) hands the whole chunks it
        names that ``ctx`` holds to the context's prefetch first, before the request is checked
        or anything reserved, so that the first DMA starts now; its copies then find them by
        stamp, as after a lookup's prefetch. It only reads the index: what the retrieve reserves
        next decides what is copied (staged chunks are matched by stamp, address and size), and
        what a refused retrieve staged is dropped by the next transfer (a prefetch only fills
        the context's own staging, and only while its copy stream is idle). A lease whose lookup
        prefetched is handed again: the core cannot tell whether that prefetch staged anything
        or whether a transfer since took it, and the context keeps what it staged already."""
        skip = msg.skip_first_n_tokens
        block_size = ctx.layout.block_size
        if skip < 0 or skip % block_size:
            return  # refused below
        bpc = ctx.layout.blocks_per_chunk(ctx.chunk_size)
        first = -(-skip // (block_size * bpc))  # the first chunk no skip cuts
        entries, fmt, views = self.index.entries, ctx.chunk.fmt, ctx.views
        chunks = []
        for h in msg.hashes[first:first + MAX_PREFETCH_CHUNKS]:
            e = entries.get(ChunkKey(ctx.model_name, ctx.world_size, ctx.rank, h))
            if e is not None and e.state is State.READY and e.fmt == fmt:
                chunks.append(StoredSlot(views.bytes(e.offset), e.stamp))
        self._hand_prefetch(ctx, chunks)

    def _chunk_format(self, key: ChunkKey) -> str | None:
        """The chunk format of a registered context whose chunks ``key`` names, if any. The
        tier asks once per rank of a lookup: one dict read, not a walk of every context."""
        formats = self._formats
        if formats is None:
            formats = self._formats = {(c.model_name, c.world_size, c.rank): c.chunk.fmt
                                       for c in self.contexts.values()}
        return formats.get((key.model_name, key.world_size, key.rank))

    def _check_waiting(self, session: Session) -> None:
        """Raise LimitExceeded unless ``session`` may have one more request waiting on L2."""
        self.limits.check("max_waiting", self._waiting)
        self.limits.check("max_waiting_per_session", session.waiting)

    def _promotions_of(self, session: Session, ctx: RegisteredContext, hashes: list[bytes]) -> Future[None] | None:
        """A future that resolves once the promotions from L2 still running for chunks ``hashes``
        of ``ctx`` have ended (a transfer of them waits for it), or None when none is. Raises
        LimitExceeded, before it waits on anything, unless ``session`` may have one more request
        waiting (:meth:`_check_waiting`)."""
        if self.tier is None or not self.tier.promoting:
            return None
        futures = self.tier.pending(ctx.keys(hashes))
        if not futures:
            return None
        self._check_waiting(session)
        return all_settled(futures)

    def _store_wait(self, promoting: Future[None], deadline: float) -> Future[None]:
        """A future that resolves when ``promoting`` does, or at the loop's first tick past
        :data:`STORE_WAIT_S` from now (or past ``deadline``, a Unix time, if sooner; 0: none)."""
        until = time.monotonic() + STORE_WAIT_S
        if deadline:
            until = min(until, time.monotonic() + max(0.0, deadline - time.time()))
        gate: Future[None] = Future()
        promoting.add_done_callback(lambda _f: settle_once(gate))
        self._store_waits.append((until, gate))
        return gate

    def _reserve_write_unpromoted(self, session: Session, ctx: RegisteredContext,
                                  hashes: list[bytes]) -> tuple[Reservation, list[int], list[int]]:
        """:meth:`_reserve_write` of the chunks not being promoted from L2 (a store that waited
        :data:`STORE_WAIT_S` for them): (reservation, present, no_space), indices into ``hashes``;
        the promoting ones are neither reserved nor present (their bytes are not in): no space."""
        promoting = self.tier.promoting if self.tier is not None else None
        busy = [i for i, k in enumerate(ctx.keys(hashes)) if k in promoting] if promoting else []
        if not busy:  # (no key made twice on the store's path without promotions)
            return self._reserve_write(session, ctx, hashes)
        skip = set(busy)
        keep = [i for i in range(len(hashes)) if i not in skip]
        res, present, no_space = self._reserve_write(session, ctx, [hashes[i] for i in keep])
        res.entries = [(keep[i], e) for i, e in res.entries]
        return res, [keep[i] for i in present], sorted([keep[i] for i in no_space] + busy)

    def _on_release_lease(self, session: Session, msg: m.ReleaseLease) -> m.Empty:
        self.index.release_lease(msg.lease_id)
        return m.Empty()

    def _client_driven(self, session: Session, instance_id: int) -> RegisteredContext:
        ctx = self._context(session, instance_id)
        if self.transports[ctx.transport].transport.style is not Style.CLIENT_DRIVEN:
            raise InvalidRequest(f"instance {instance_id} uses server-driven transport {ctx.transport}: "
                                 "use store/retrieve, not reserve/commit")
        return ctx

    def _check_reservation(self, session: Session, nbytes: int, pins: int = 0) -> None:
        """Raise LimitExceeded unless ``session`` may open one more reservation of ``nbytes``
        (a read: that pins ``pins`` chunks). Promotions from L2 are the tier's reservations, bounded
        by the arena's slots: they do not count, so that one client's promoting lookups cannot use
        up the reservations every client's stores need."""
        promoting = len(self.tier.usage.reservations) if self.tier is not None else 0
        self.limits.check("max_reservations", len(self.index.reservations) - promoting)
        # what the process's ended sessions left parked counts as the session's own (see _parked_of)
        parked, parked_bytes = self._parked_of(session.peer, session.token) if self._parked else (0, 0)
        self.limits.check("max_reservations_per_session", len(session.usage.reservations) + parked)
        self.limits.check("max_reserved_bytes_per_session", session.usage.reserved_bytes + parked_bytes, nbytes)
        if pins:
            self._check_chunk_pins(session, pins)

    def _check_chunk_pins(self, session: Session, pins: int) -> None:
        """Raise LimitExceeded unless ``session`` may hold ``pins`` more chunk references."""
        self.limits.check("max_chunk_pins", self.index.chunk_pins, pins)
        self.limits.check("max_chunk_pins_per_session", session.usage.chunk_pins, pins)

    def _reserve_write(self, session: Session, ctx: RegisteredContext,
                       hashes: list[bytes]) -> tuple[Reservation, list[int], list[int]]:
        keys = ctx.keys(hashes)
        self._check_reservation(session, self.index.write_need(keys) * Allocator.rounded(ctx.chunk.nbytes))
        return self.index.reserve_write(keys, ctx.chunk.fmt, ctx.chunk.nbytes, ctx.instance_id, session.usage)

    def _reserve_read(self, session: Session, ctx: RegisteredContext, hashes: list[bytes], lease_id: int,
                      skipped: list[bytes]) -> tuple[Reservation, list[int]]:
        """Pin ``hashes`` for a read. Of ``lease_id``, what the read will not read goes now: the
        chunks it ``skipped`` wholly, and those missing (their promotion failed)."""
        if lease_id and skipped:
            self.index.release_lease(lease_id, ctx.keys(skipped))
        keys = ctx.keys(hashes)
        pins, nbytes = self.index.read_pins(keys, session.usage)
        self._check_reservation(session, nbytes, pins)
        res, missing = self.index.reserve_read(keys, ctx.chunk.fmt, ctx.instance_id, session.usage, lease_id)
        if lease_id and missing:
            self.index.release_lease(lease_id, [keys[i] for i in missing])
        return res, missing

    def _on_reserve_write(self, session: Session, msg: m.ReserveWrite,
                          waited: bool = False) -> m.ReserveWriteReply | _Awaiting:
        """Slots for a client-driven store. Chunks being promoted from L2 are present only once
        their bytes are (a promotion that fails frees the key, to be stored): it waits for them,
        at most :data:`STORE_WAIT_S`, then reports those still promoting as no space."""
        ctx = self._client_driven(session, msg.instance_id)
        if not waited:
            promoting = self._promotions_of(session, ctx, msg.hashes)
            if promoting is not None:
                return _Awaiting(session, self._store_wait(promoting, 0.0),
                                 lambda: self._on_reserve_write(session, msg, waited=True))
        res, present, no_space = self._reserve_write_unpromoted(session, ctx, msg.hashes)
        self.stats.on_reserve_write(self.stats.traffic_of(ctx.model_name, ctx.transport), len(present), len(no_space))
        slots = [m.Slot(i, e.offset) for i, e in res.entries]
        return m.ReserveWriteReply(res.id, slots, present, no_space)

    def _reservation(self, session: Session, ctx: RegisteredContext, rid: int, write: bool) -> Reservation:
        """One of the session's own open reservations for ``ctx``."""
        res = session.usage.reservations.get(rid)
        if res is None or res.instance_id != ctx.instance_id or res.write != write or res.parked or res.in_flight:
            raise _invalid("reservation_id", f"no open {'write' if write else 'read'} reservation {rid} "
                                             f"of instance {ctx.instance_id} on this connection")
        return res

    def _take_parked(self, session: Session, reservation_id: int) -> bool:
        """A late commit of a reservation parked when the session ``session`` resumed ended: its
        copy is over, so it is aborted (a write's slots freed, a read's pins let go). False if
        ``reservation_id`` is no such reservation."""
        resumed = session.resumed
        parked = resumed.reservations.pop(reservation_id, None) if resumed is not None else None
        if parked is None:
            return False
        self.index.abort(parked)
        assert resumed is not None
        if not resumed.reservations:
            self._forget_parked(resumed)
        return True

    def _on_commit_write(self, session: Session, msg: m.CommitWrite) -> m.StoreResult:
        _check_copy_s(msg.copy_s)
        if self._take_parked(session, msg.reservation_id):  # what it wrote is not trusted
            raise _invalid("reservation_id", f"write reservation {msg.reservation_id} was dropped when this "
                                             "client's session ended (it went silent past the session timeout, or "
                                             "resumed the session on a new connection); nothing was stored")
        ctx = self._client_driven(session, msg.instance_id)
        res = self._reservation(session, ctx, msg.reservation_id, write=True)
        return self._commit_write(ctx, res, msg.failed, msg.copy_s, msg.abandoned)

    def _commit_write(self, ctx: RegisteredContext, res: Reservation, failed: list[int],
                      copy_s: float, abandoned: bool = False) -> m.StoreResult:
        reserved = {i for i, _ in res.entries}
        bad = sorted(set(failed) & reserved)
        stored = self.index.commit_write(res, bad)
        ctx.stores += 1
        seconds = time.perf_counter() - res.opened
        copy_s = min(copy_s, seconds)  # a client's figure: its copy ran between the reserve and the commit
        self.stats.on_store(self.stats.traffic_of(ctx.model_name, ctx.transport), len(stored), len(bad),
                            ctx.chunk.nbytes, seconds, copy_s, abandoned)
        if stored and self.tier is not None:
            self.tier.offer([e for _, e in stored])
        if stored:
            self.hooks.call("kvxfer_chunks_stored", server=self, context=ctx, keys=[e.key for _, e in stored])
        self.hooks.call("kvxfer_transfer_finished", server=self, context=ctx, op="store", chunks=len(stored),
                        nbytes=len(stored) * ctx.chunk.nbytes, seconds=seconds, copy_seconds=copy_s)
        return m.StoreResult([i for i, _ in stored], [], bad)

    def _on_reserve_read(self, session: Session, msg: m.ReserveRead) -> m.ReserveReadReply | _Awaiting:
        ctx = self._client_driven(session, msg.instance_id)
        promoting = self._promotions_of(session, ctx, msg.hashes)
        if promoting is not None:
            return _Awaiting(session, promoting, lambda: self._on_reserve_read(session, msg))
        res, missing = self._reserve_read(session, ctx, msg.hashes, msg.lease_id, msg.skipped)
        res.missing = len(missing)
        return m.ReserveReadReply(res.id, [m.Slot(i, e.offset) for i, e in res.entries], missing)

    def _on_commit_read(self, session: Session, msg: m.CommitRead) -> m.Empty:
        _check_copy_s(msg.copy_s)
        if self._take_parked(session, msg.reservation_id):  # its pins held throughout: what it read is whole
            return m.Empty()
        ctx = self._client_driven(session, msg.instance_id)
        res = self._reservation(session, ctx, msg.reservation_id, write=False)
        self._commit_read(ctx, res, msg.copy_s, msg.loaded)
        return m.Empty()

    def _commit_read(self, ctx: RegisteredContext, res: Reservation, copy_s: float, loaded: bool) -> None:
        """Unpin a read's chunks; ``loaded`` is False when they were not copied (the copy failed,
        or was cancelled or expired): the figures count them as not loaded."""
        self.index.commit_read(res)
        ctx.retrieves += 1
        seconds = time.perf_counter() - res.opened
        copy_s = min(copy_s, seconds)  # a client's figure: its copy ran between the reserve and the commit
        n = len(res.entries) if loaded else 0
        self.stats.on_retrieve(self.stats.traffic_of(ctx.model_name, ctx.transport), n,
                               res.missing + len(res.entries) - n, ctx.chunk.nbytes, seconds, copy_s)
        if res.entries:
            self.hooks.call("kvxfer_chunks_retrieved", server=self, context=ctx, keys=[e.key for _, e in res.entries])
        self.hooks.call("kvxfer_transfer_finished", server=self, context=ctx, op="retrieve", chunks=n,
                        nbytes=n * ctx.chunk.nbytes, seconds=seconds, copy_seconds=copy_s)

    # ------------------------------------------------------------------ server-driven transfers

    def _server_driven(self, session: Session, instance_id: int) -> RegisteredContext:
        ctx = self._context(session, instance_id)
        if self.transports[ctx.transport].transport.style is not Style.SERVER_DRIVEN:
            raise InvalidRequest(f"instance {instance_id} uses client-driven transport {ctx.transport}: "
                                 "use reserve/commit requests, not store/retrieve")
        return ctx

    def _params(self, ctx: RegisteredContext, raw: msgspec.Raw) -> Any:
        tp = ctx.server_context.params_type if ctx.server_context is not None else None
        if tp is None:
            return None
        if bytes(raw) in (b"", b"\xc0"):  # no params sent: the transport's defaults
            try:
                return tp()
            except TypeError:
                raise _invalid("params", f"missing: this transport needs {tp.__name__}") from None
        try:
            return codec.decode(raw, tp)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise _invalid("params", f"do not decode as {tp.__name__}: {exc}") from None

    def _layer_range(self, ctx: RegisteredContext, span: list[int]) -> range | None:
        """``Retrieve.layers`` as a range (None: every layer), or InvalidRequest."""
        if not span:
            return None
        n = ctx.layout.num_layers
        if len(span) != 2 or not 0 <= span[0] < span[1] <= n:
            raise _invalid("layers", f"must be [first, stop) with 0 <= first < stop <= {n}, got {span[:4]}")
        if not self.transports[ctx.transport].transport.capabilities.layer_ranges:
            raise _invalid("layers", f"transport {ctx.transport} copies whole chunks only (it does not claim "
                                     "layer_ranges): retrieve every layer")
        return range(span[0], span[1])

    def _on_store(self, session: Session, msg: m.Store,
                  waited: tuple[RegisteredContext, LaneSlot] | None = None) -> m.StoreResult | _Deferred | _Awaiting:
        """A server-driven store. One of chunks being promoted from L2 waits for the promotion
        (a chunk is present once its bytes are; one whose promotion failed is stored), at most
        :data:`STORE_WAIT_S` or until its deadline, holding its place in the instance's lane as a
        waiting retrieve does (``waited``: see :meth:`_on_retrieve`); chunks still promoting then
        are reported not stored."""
        ctx = self._server_driven(session, msg.instance_id)
        slot = _place_kept(ctx, waited, "store")
        _check_deadline(msg.deadline)
        blocks = check_transfer(ctx.layout, ctx.chunk_size, len(msg.hashes), msg.block_ids)
        params = self._params(ctx, msg.params)
        if msg.deadline and time.time() > msg.deadline:  # its client gave up on it: evict, reserve nothing
            self._past_deadline(ctx, "store", msg.deadline)
            self.stats.on_store(self.stats.traffic_of(ctx.model_name, ctx.transport), 0, len(msg.hashes),
                                ctx.chunk.nbytes, None, 0.0, abandoned=True)
            if slot is not None:
                ctx.executor.cancel(slot)
            return m.StoreResult([], [], list(range(len(msg.hashes))))
        promoting = self._promotions_of(session, ctx, msg.hashes) if waited is None else None
        if promoting is not None:
            place = ctx.executor.reserve()
            return _Awaiting(session, self._store_wait(promoting, msg.deadline),
                             lambda: self._on_store(session, msg, (ctx, place)),
                             functools.partial(ctx.executor.cancel, place))
        res, present, no_space = self._reserve_write_unpromoted(session, ctx, msg.hashes)
        self.stats.on_reserve_write(self.stats.traffic_of(ctx.model_name, ctx.transport), len(present), len(no_space))
        res.in_flight = True
        rows = ctx.views.rows
        copies = plan_copies(ctx.layout, ctx.chunk_size, blocks, [(i, rows(e.offset)) for i, e in res.entries])
        server_context = ctx.server_context
        assert server_context is not None  # server-driven: checked above
        copy = _CopyClock(self._plugin(ctx, "store", lambda: server_context.store(copies, params)) if copies
                          else (lambda: None))
        expired = object()

        def work() -> Any:
            if msg.deadline and time.time() > msg.deadline:
                return expired  # the client gave up on it: its blocks may hold other KV by now
            return copy()

        def finish(fut: Future[Any]) -> m.StoreResult:
            failed = fut.exception() is not None
            if failed or ctx.instance_id not in self.contexts:
                self.index.abort(res)  # its chunks counted as a failed copy's, or as abandoned with the context
                self.stats.on_store(self.stats.traffic_of(ctx.model_name, ctx.transport), 0, len(res.entries),
                                    ctx.chunk.nbytes, None, 0.0, abandoned=not failed)
                fut.result()
                raise UnknownInstance(f"instance {ctx.instance_id} was dropped during the store")
            if fut.result() is expired:
                self._past_deadline(ctx, "store", msg.deadline)
                out = self._commit_write(ctx, res, [i for i, _ in res.entries], 0.0, abandoned=True)
            else:
                out = self._commit_write(ctx, res, [], copy.seconds())
            return m.StoreResult(out.stored, present, sorted(set(no_space) | set(out.failed)))

        return _Deferred(ctx.executor, work, finish, ctx.transport, quick=server_context, waiting=ctx.waiting,
                         slot=slot)

    def _past_deadline(self, ctx: RegisteredContext, kind: str, deadline: float) -> None:
        """A store or retrieve reached its copy past its client's deadline (logged at most once a
        second for each kind)."""
        self._throttled.warning(f"{kind} past deadline", f"instance {ctx.instance_id}: a {kind} reached its copy "
                                f"{time.time() - deadline:.1f} s past the deadline its client stopped waiting at: "
                                "nothing copied")

    def _on_retrieve(self, session: Session, msg: m.Retrieve,
                     waited: tuple[RegisteredContext, LaneSlot] | None = None) -> _Deferred | _Awaiting:
        """A server-driven retrieve. One that must wait for chunks being promoted from L2 takes
        its place in the instance's lane first, so that the instance's later transfers still run
        after it; ``waited``: the context and place it took, when it comes back after the wait.
        If that context was dropped meanwhile (even if its id was registered again), it fails
        with UnknownInstance and reserves nothing."""
        ctx = self._server_driven(session, msg.instance_id)
        slot = _place_kept(ctx, waited, "retrieve")
        _check_deadline(msg.deadline)
        if waited is None and not msg.layers and not self.stats.in_flight and self._prefetches(ctx) and not (
                msg.deadline and time.time() > msg.deadline):
            self._stage_lone(ctx, msg)
        blocks = check_transfer(ctx.layout, ctx.chunk_size, len(msg.hashes), msg.block_ids, msg.skip_first_n_tokens)
        params = self._params(ctx, msg.params)
        layers = self._layer_range(ctx, msg.layers)
        promoting = self._promotions_of(session, ctx, msg.hashes)
        if promoting is not None:
            place = slot if slot is not None else ctx.executor.reserve()
            return _Awaiting(session, promoting, lambda: self._on_retrieve(session, msg, (ctx, place)),
                             functools.partial(ctx.executor.cancel, place))
        skip_blocks = msg.skip_first_n_tokens // ctx.layout.block_size
        first = min(len(msg.hashes), skip_blocks // ctx.layout.blocks_per_chunk(ctx.chunk_size))
        res, missing = self._reserve_read(session, ctx, msg.hashes[first:], msg.lease_id, msg.hashes[:first])
        res.in_flight = True
        res.missing = len(missing)
        slot_views = ctx.views
        copies = plan_copies(ctx.layout, ctx.chunk_size, blocks,
                             [(i + first, slot_views.rows(e.offset)) for i, e in res.entries], skip_blocks,
                             [e.stamp for _, e in res.entries])
        if layers is not None:
            copies = layer_slice(copies, layers.start, layers.stop)
        lost = {i + first for i in missing}
        expired = object()
        server_context = ctx.server_context
        assert server_context is not None  # server-driven: checked above
        clock = _CopyClock(self._plugin(ctx, "retrieve", lambda: server_context.retrieve(copies, params)) if copies
                           else (lambda: None))

        def work() -> Any:
            if msg.deadline and time.time() > msg.deadline:
                return expired  # the client gave up on it: its blocks may be the engine's again
            return clock()

        def result(gone: set[int]) -> m.RetrieveResult:
            return m.RetrieveResult([i for i in range(len(msg.hashes)) if i not in gone], sorted(gone))

        def finish(fut: Future[Any]) -> m.RetrieveResult:
            copied = fut.exception() is None and fut.result() is not expired
            if ctx.instance_id in self.contexts:
                self._commit_read(ctx, res, clock.seconds(), copied)
            else:
                self.index.abort(res)
            gone = lost
            if fut.result() is expired:
                self._past_deadline(ctx, "retrieve", msg.deadline)
                gone = set(range(first, len(msg.hashes)))
            return result(gone)

        return _Deferred(ctx.executor, work, finish, ctx.transport, early=lambda: result(lost), quick=server_context,
                         waiting=ctx.waiting, slot=slot)

    # ------------------------------------------------------------------ status, clear

    def _on_status(self, session: Session, msg: m.StatusRequest) -> m.StatusReply:
        return self.status()

    def status(self) -> m.StatusReply:
        """The server's report (loop thread): what `kvxfer status` and `kvxfer top` show and the
        Prometheus exporter exports."""
        alloc = self.index.allocator
        plugin_metrics = figures.plugin_metrics(self)
        totals = self.stats.totals()
        sections: dict[str, dict[str, str]] = {}
        for res in self.hooks.call("kvxfer_status_section", server=self):
            if len(sections) == m.MAX_STATUS_ENTRIES:  # a client refuses a reply with more
                self.hooks.errors += 1
                log.warning("more than %d status sections; the rest are dropped", m.MAX_STATUS_ENTRIES)
                break
            try:
                title, values = res
                title = str(title)[:figures.MAX_PLUGIN_TEXT]
                sections[title] = figures.plugin_strings(self, f"status section {title[:64]!r}", values)
            except (TypeError, ValueError, AttributeError):
                self.hooks.errors += 1
                log.warning("a kvxfer_status_section hook returned %r, not (title, dict)", res)
        transports = []
        for name, lt in sorted(self.transports.items()):
            try:
                state = figures.plugin_strings(self, f"transport {name!r} status()", lt.server.status())
            except Exception as exc:  # noqa: BLE001  (a status() that raises is reported, not fatal)
                state = {"error": f"{type(exc).__name__}: {exc}"}
            transports.append(m.TransportStatus(
                name, lt.transport.style.value, sum(c.transport == name for c in self.contexts.values()), state))
        return m.StatusReply(
            server_version=kvxfer.__version__,
            protocol_version=m.PROTOCOL_VERSION,
            url=self.url,
            pid=os.getpid(),
            uptime_s=time.time() - self.started,
            chunk_size=self.config.chunk_size,
            sessions=len(self.sessions),
            contexts=[c.status() for c in sorted(self.contexts.values(),
                                                 key=lambda c: (c.model_name, c.rank))[:m.MAX_STATUS_ITEMS]],
            arena=m.ArenaStatus(str(self.arena.path), alloc.capacity, alloc.used, len(self.index.entries),
                                alloc.free_extents, alloc.largest_free, self.index.evictions,
                                self.index.pinned_chunks()),
            transports=transports,
            lookups=totals.lookups,
            lookup_chunks=totals.lookup_chunks,
            lookup_hits=totals.lookup_hits,
            lookup_l2_hits=totals.lookup_l2_hits,
            leases=len(self.index.leases),
            leased_chunks=self.index.leased_chunks,
            reservations=len(self.index.reservations),
            errors=self.stats.error_count,
            hook_errors=self.hooks.errors,
            dropped_connections=self.dropped_connections,
            sections=sections,
            tiers=[self.tier.status()] if self.tier is not None else [],
            metrics_url=self.metrics_url,
            requests_in_flight=self.stats.in_flight,
            errors_by_code=self.stats.errors_by_code(),
            models=figures.model_status(self),
            traffic=figures.traffic_status(self),
            latency=figures.latency_status(self.stats),
            plugin_metrics=plugin_metrics,
            ticks=self.ticks,
        )

    def _on_clear(self, session: Session, msg: m.Clear) -> m.ClearReply:
        check_name("model_name", msg.model_name, self.limits)
        gone = self.index.clear(msg.model_name)
        if self.tier is not None:
            self.tier.forget(gone)
        return m.ClearReply(len(gone))

    def _on_evict(self, keys: list[ChunkKey]) -> None:
        self.stats.on_evicted([k.model_name for k in keys])
        if self.tier is not None:
            self.tier.forget(keys)
        self.hooks.call("kvxfer_chunks_evicted", server=self, keys=keys)

