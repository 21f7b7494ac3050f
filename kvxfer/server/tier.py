"""The L2 tier: a store backend (:mod:`kvxfer.store`) under the L1 arena.

What it does for the server (:class:`~kvxfer.server.engine.CacheServer` calls it on the loop
thread, at the points named below):

* **write path** (:meth:`L2Tier.offer` after a store commits, :meth:`L2Tier.count_hits` after a
  lookup): new chunks are admitted (``all``, or once ``N`` lookups found them), *pinned* in L1 (so
  neither eviction nor a new store can touch their slots while a writer reads them) and queued.
  ``writers`` threads take batches off the queue, checksum them, skip those the store already
  holds (one pipelined existence check) and put the rest straight from the arena. A full queue,
  or a store that is down, drops the write (counted), never blocks a store. Writers run at nice
  10 and start a batch only once no client's store has been filling arena slots for a moment
  (at most ``write_yield_s`` later).
* **lookup** (:meth:`L2Tier.begin_lookup`, then :meth:`L2Tier.finish_lookup`): the chunks after
  the L1 hits are checked in the store in one pipelined round trip, bounded by ``timeout_s``;
  the hits continue through them. A backend with :class:`~kvxfer.store.LoopExists` has the
  loop send the check and read its answer itself (the loop polls its connections); others run it
  on a store thread. The check is sent first; reading L1 for the keys asked (:meth:`_plan`)
  overlaps the answer. With ``promote``, each L2 hit becomes an L1
  entry that is not yet readable (a write reservation of the tier, pinned, under the lookup's
  lease) and the store reads the value straight into its arena slot.
* **promotion**: when the get returns, the header (identity, format, length) and the checksum
  are verified off the loop; on the loop the good chunks become readable and the bad ones are
  dropped (a miss, counted, never loaded). A value that no reader of its key could load
  (damaged bytes or header, a length that does not match, a size changed since the lookup) is
  also deleted from the store, from the get's own thread without waiting for it: otherwise every
  later lookup would count it again and the writers, which skip values the store holds, would
  never replace it. An intact value of another layout is left alone (it may be another
  server's). A retrieve that names a chunk still being promoted waits for it
  (:meth:`L2Tier.pending`), without blocking the loop.
* **faults**: every store operation is bounded; failures feed a circuit breaker. While it is
  open the tier does not touch the store (lookups answer from L1 at once, writes are dropped),
  and a health thread pings it with exponential backoff, reopening the backend when it must;
  the first good ping closes the breaker. The server serves from L1 throughout.

Threads: the loop (everything that touches the index; its tick also ends lookups that outlive
``timeout_s``), ``writers`` writer threads, the backend's own threads (promotion checks run in
its get callbacks) and one health thread. Figures for status and metrics are plain counters on the
:class:`L2Tier` object.
"""

from __future__ import annotations

import bisect
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar, cast

from kvxfer.arena import Arena
from kvxfer.errors import ConfigError, InvalidRequest, StoreUnavailable
from kvxfer.mq.throttled_log import ThrottledLog
from kvxfer.protocol.messages import TierStatus
from kvxfer.server.allocator import Allocator
from kvxfer.server.index import ChunkIndex, ChunkKey, Entry, Reservation, State, Usage
from kvxfer.store.base import Backend, GetStatus, LoopExists, Store, StoreOptions, background_thread, url_secrets
from kvxfer.store.format import (
    HEADER_SIZE,
    ChunkL2Keys,
    DamagedValue,
    IntegrityError,
    checksum,
    chunk_format_bytes,
    decode_header,
    encode_header,
    l2_key,
)
from kvxfer.store.guard import GuardedBackend, PluginFault, check_sizes, close_within
from kvxfer.store.registry import get_store
from kvxfer.text_table import printable

__all__ = ["TierConfig", "L2Tier", "Breaker", "parse_admission"]


T = TypeVar("T")

log = logging.getLogger(__name__)

#: Instance id of the tier's own write reservations (promotions); no client has it.
PROMOTER: Final = 0
#: The store's own figures (status) are read this often...
_STATS_EVERY_S: Final = 5.0
#: ... and again this soon after a failure.
_STATS_RETRY_S: Final = 0.5


#: The most lookups ``hits:N`` may wait for (a chunk found more often than this is hot by any measure).
MAX_ADMISSION_HITS: Final = 1_000_000
#: Longest text of a store error the log and ``kvxfer status`` show (a node chooses its words).
ERROR_TEXT_MAX: Final = 512
#: The same for a configuration error, which says what to change after what went wrong.
CONFIG_ERROR_TEXT_MAX: Final = 2048


def parse_admission(text: str) -> int:
    """``"all"`` -> 0; ``"hits:N"`` -> N (write a chunk to L2 once N lookups found it in L1): ASCII
    digits only (``int()`` takes " 3" and other scripts' digits, and refuses 4,300 digits with a
    ValueError of its own)."""
    if text == "all":
        return 0
    digits = text[5:] if text.startswith("hits:") else ""
    if digits.isascii() and digits.isdigit() and len(digits) <= 7 and 0 < int(digits) <= MAX_ADMISSION_HITS:
        return int(digits)
    raise ConfigError(f"--l2-admission {text!r}: use 'all' (every stored chunk) or 'hits:N' (a chunk once N "
                      f"lookups found it, N in [1, {MAX_ADMISSION_HITS}])")


@dataclass(frozen=True)
class TierConfig:
    """The L2 settings of ``kvxfer serve`` (``--l2 NAME --l2-url URL`` and the ``--l2-*`` options)."""

    #: Store backend (entry point name in ``kvxfer.stores``).
    store: str
    #: Where the store is; secrets in it are never logged (see ``Store.redact``).
    url: str
    #: ``all`` or ``hits:N``.
    admission: str = "all"
    #: Chunks waiting for a writer; more are dropped (counted).
    queue: int = 64
    #: Writer threads (and store connections for puts); store connections for gets.
    writers: int = 2
    readers: int = 2
    #: Longest wait for the store in a lookup (and pings, deletes); a lookup pays at most this.
    timeout_s: float = 0.5
    #: Longest silence while values move (promotions, writes).
    bulk_timeout_s: float = 10.0
    #: Chunks per put batch (small: the writers' connections then share a store's load).
    batch: int = 2
    #: Consecutive failures that open the circuit breaker; first and longest retry delay.
    breaker_failures: int = 3
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    #: At shutdown, how long queued writes may still run before they are dropped.
    drain_s: float = 5.0
    #: Longest a writer waits for the arena to be quiet (no store copying into it, no promotion)
    #: before it writes anyway; 0: writes run beside stores.
    write_yield_s: float = 0.1

    def __post_init__(self) -> None:
        parse_admission(self.admission)
        for name in ("queue", "writers", "readers", "batch", "breaker_failures"):
            # writers and readers are a thread and a store connection each
            most = MAX_L2_CONNECTIONS if name in ("writers", "readers") else _MAX_COUNT
            if not 1 <= getattr(self, name) <= most:
                raise ConfigError(f"--l2-{name.replace('_', '-')} must be in [1, {most}], got {getattr(self, name)}")
        if not 0 < self.timeout_s <= 60:
            raise ConfigError(f"--l2-timeout must be in (0, 60] seconds, got {self.timeout_s}")
        if not 0 <= self.write_yield_s <= 60:
            raise ConfigError(f"--l2-write-yield must be in [0, 60] seconds, got {self.write_yield_s}")
        if not 0 < self.bulk_timeout_s <= 600:
            raise ConfigError(f"--l2-bulk-timeout must be in (0, 600] seconds, got {self.bulk_timeout_s}")
        if not self.url:
            raise ConfigError(f"--l2 {self.store} needs --l2-url ({_url_hint(self.store)}; docs/l2.md)")

    @property
    def stuck_s(self) -> float:
        """How long the tier waits, beyond the time its bytes take at :data:`STUCK_RATE`, for a
        store's write, get or close before it gives up on it: a backstop for a plugin that does
        not bound its operations by ``timeout_s`` and ``bulk_timeout_s``, as the store contract
        says they must be."""
        return STUCK_FACTOR * (self.timeout_s + self.bulk_timeout_s)

    def stuck_after(self, nbytes: int) -> float:
        """:attr:`stuck_s` for an operation that moves ``nbytes``."""
        return self.stuck_s + nbytes / STUCK_RATE


#: :attr:`TierConfig.stuck_s` is this many times a store operation's own bounds, summed.
STUCK_FACTOR: Final = 4
#: Bytes a second below which a store operation's bytes alone would not excuse its time (the
#: Valkey backend bounds a get or put as a whole by its bytes at 16 MiB/s, over its silence bound).
STUCK_RATE: Final = 4 << 20

#: A backend's submit_exists that takes longer than this on the loop is reported (it must not block;
#: a garbage collection or a first thread's start may take a few ms).
_SUBMIT_BLOCKED_S: Final = 0.02


def _url_hint(store: str) -> str:
    """What an URL of ``store`` looks like, from its ``url_schemes`` (when it loads)."""
    try:
        schemes = get_store(store, require_available=False).url_schemes
    except Exception:  # noqa: BLE001  (a store that does not load is reported when the tier starts)
        schemes = ()
    return f"a URL of scheme {', '.join(f'{x}://' for x in schemes)}" if schemes else "where the store is"


class Breaker:
    """Consecutive-failure circuit breaker with exponential backoff. Thread-safe.

    Closed: operations run. ``threshold`` consecutive failures open it; while open nothing
    touches the store except the health thread's probe, due at ``retry_at``; a failed probe
    doubles the delay (up to ``max_backoff``), a good one closes the breaker. A store that
    passes the probe but fails again before any operation succeeds (it answers pings, not the
    work: hung on it, or refusing it) reopens it with the delay doubled, not started over."""

    def __init__(self, threshold: int, backoff: float, max_backoff: float) -> None:
        self.threshold = threshold
        self.base = backoff
        self.max_backoff = max_backoff
        self._lock = threading.Lock()
        self.closed = True
        self.failures = 0
        self.delay = backoff
        self.retry_at = 0.0
        self.last_error = ""
        self.opened = 0
        #: An operation succeeded since a probe last closed the breaker (or none ever opened it).
        self.proven = True

    def success(self) -> None:
        with self._lock:
            self.failures = 0
            self.proven = True

    def failure(self, error: str) -> bool:
        """Count a failure; True if this one opened the breaker."""
        with self._lock:
            self.last_error = error
            self.failures += 1
            if self.closed and self.failures >= self.threshold:
                self._open()
                return True
            return False

    def trip(self, error: str) -> None:
        """Open now (the store could not even be opened)."""
        with self._lock:
            self.last_error = error
            if self.closed:
                self._open()

    def _open(self) -> None:
        self.closed = False
        self.opened += 1
        self.delay = self.base if self.proven else min(self.max_backoff, self.delay * 2)
        self.retry_at = time.monotonic() + self.delay

    def probe_due(self) -> bool:
        with self._lock:
            return not self.closed and time.monotonic() >= self.retry_at

    def probed(self, ok: bool, error: str = "") -> None:
        with self._lock:
            if ok:
                self.closed = True
                self.failures = 0
                self.proven = False  # until an operation succeeds: see the class docstring
                return
            self.last_error = error or self.last_error
            self.delay = min(self.max_backoff, self.delay * 2)
            self.retry_at = time.monotonic() + self.delay


def settle_once(fut: Future[Any], value: Any = None, exc: BaseException | None = None) -> bool:
    """Resolve ``fut`` unless it already is; True if this call did."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)
    except InvalidStateError:
        return False
    return True


def all_settled(futures: Sequence[Future[Any]]) -> Future[None]:
    """A future that resolves (to None) once every one of ``futures`` is done, however."""
    out: Future[None] = Future()
    left = [len(futures)]
    lock = threading.Lock()

    def one(_f: Future[Any]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            settle_once(out)

    if not futures:
        settle_once(out)
    for f in futures:
        f.add_done_callback(one)
    return out


@dataclass(slots=True, eq=False)
class _Write:
    key: ChunkKey
    entry: Entry
    fmt: str
    #: Queued again after a dropped write (see L2Tier.count_hits): a failure or refusal of this
    #: one is final.
    again: bool = False


class _GivenUp(Exception):
    """A writer's batch was given up while the writer was held in the store plugin: its pins are
    gone, so the writer must not read the arena for it any more."""


@dataclass(slots=True, eq=False)
class _Batch:
    """A writer's batch from the moment it goes to the store until its pins are released: by
    the writer when it returns, or by :meth:`L2Tier._abandon_held_writers` when a ``submit_*``
    call of the plugin holds the writer's thread (whichever comes first; ``settled`` says it
    happened)."""

    writes: list[_Write]
    started: float
    settled: bool = False
    #: The writer is checksumming the batch's arena bytes (it cannot be given up meanwhile), and
    #: how long that took (not counted against its operations' time).
    reading: bool = False
    read_s: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(w.entry.size for w in self.writes)


@dataclass(slots=True, eq=False)
class _Promotion:
    """One reservation's promotions: the tier's write reservation, and per reserved entry (in
    ``res.entries`` order) the header buffer the get fills, the format expected (None: whatever
    the header says) and, once checked, the format found (None: not loadable)."""

    res: Reservation
    headers: list[bytearray]
    expected: list[str | None]
    found: list[str | None]
    done: dict[ChunkKey, Future[None]]
    #: Gets still running (the entries are split among the store's read connections).
    left: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: When it started (time.monotonic()); whether its waiters were told it failed because a
    #: get did not end within ``stuck_s`` (its slots stay reserved until the gets end).
    started: float = field(default_factory=time.monotonic)
    abandoned: bool = False
    #: Its gets' futures (the store may withdraw those not started once it is abandoned).
    gets: list[Future[list[GetStatus]]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Arena bytes it reads."""
        return sum(e.size for _, e in self.res.entries)


#: How long the arena must have had no slot being filled before an L2 writer starts (seconds).
_QUIET_S: Final = 0.002
#: Most ``writers`` and ``readers`` (each is a thread and a connection to the store).
MAX_L2_CONNECTIONS: Final = 64
#: Largest count an L2 option takes (queue entries, batch, failures before the breaker opens).
_MAX_COUNT: Final = 1 << 31
#: Chunks whose dropped L2 write the tier remembers (then it forgets the oldest).
_UNWRITTEN_KEPT: Final = 1 << 16
#: Chunk keys the tier remembers for lookups (then it forgets them all and starts again).
_KEYS_KEPT: Final = 1 << 16
#: Keys whose L2 value is intact but in a chunk format this server does not load (another KV
#: layout's value of the same size), remembered at most this many and for this long: lookups count
#: them as misses instead of as hits whose promotion fails every time.
_UNLOADABLE_KEPT: Final = 1 << 14
_UNLOADABLE_S: Final = 60.0
#: Most keys one lookup asks the store about (every rank's key of the chunks after L1's hits):
#: the chunks past them count as misses. Each key costs the loop time every other client waits
#: for, and a lookup names up to 262,144 keys in a hundred bytes (kvxfer.server.engine.
#: MAX_LOOKUP_KEYS): at 32,768 keys such a lookup took about 250 ms on a 2-core VM, and a few in
#: flight stalled every client for seconds (docs/l2.md).
#: 8,192 keys: 1,024 chunks at world size 8 (262,144 tokens of 256-token chunks).
L2_LOOKUP_KEYS: Final = 1 << 13
#: Most keys the existence checks of lookups may have at the store at once: a lookup that would
#: pass it does not ask the store (answered from L1, counted as busy). Clients pipelining wide
#: lookups would otherwise queue checks at the store until lookups time out, which the breaker
#: counts as failures of a healthy store: L2 down for every client.
L2_KEYS_IN_FLIGHT: Final = 2 * L2_LOOKUP_KEYS
#: A lookup's check still running this long after the lookup timed out is warned about.
_LATE_CHECK_S: Final = 30.0


class TierLookup:
    """The L2 part of one lookup (:meth:`L2Tier.begin_lookup`), on the loop thread: the chunk
    keys asked (every rank's key of each chunk after the L1 hits, chunk by chunk) and, once the
    store answered, their value sizes (empty after a failure or a timeout: misses). The server
    waits for it with :meth:`add_done_callback` (callbacks run on the loop), then calls
    :meth:`L2Tier.finish_lookup`."""

    __slots__ = ("tier", "model_name", "world_size", "hashes", "l1_hits", "keys", "sizes", "deadline", "changes",
                 "need", "stop", "l2_chunks", "in_flight", "_callbacks", "_done")

    def __init__(self, tier: L2Tier, model_name: str, world_size: int, hashes: Sequence[bytes], l1_hits: int,
                 keys: list[ChunkKey]) -> None:
        self.tier = tier
        self.model_name = model_name
        self.world_size = world_size
        self.hashes = hashes
        self.l1_hits = l1_hits
        self.keys = keys
        self.sizes: list[int] = []
        self.deadline = 0.0
        # What L1 said while the store answered (L2Tier._plan); valid while ``changes`` holds:
        #: the index's and the promotions' change counts when it was read;
        self.changes = (-1, -1)
        #: the keys that only L2 can have: (chunk, position in ``keys``, key, chunk bytes of the
        #: registered layout or 0), in order;
        self.need: list[tuple[int, int, ChunkKey, int]] = []
        #: the first chunk that L1 holds up (an entry being written by a client), or the count;
        self.stop = 0
        #: the chunks (counted from ``l1_hits``) that come from L2, in part or whole.
        self.l2_chunks: list[int] = []
        #: keys its check holds in the tier's count of keys at the store, until answered or failed
        self.in_flight = 0
        self._callbacks: list[Callable[[TierLookup], None]] = []
        self._done = False

    def done(self) -> bool:
        return self._done

    def add_done_callback(self, fn: Callable[[TierLookup], None]) -> None:
        if self._done:
            fn(self)
        else:
            self._callbacks.append(fn)

    def arrived(self, sizes: list[int] | None, error: BaseException | None = None, checked: bool = False) -> None:
        """The store's answer (None: the check failed, with ``error`` when known), on the loop;
        ``checked``: by the guard already (a threaded check), else checked here (a loop check)."""
        tier = self.tier
        tier._landed(self)
        if sizes is None:
            if not self._done:  # (a lookup that timed out was counted as failed then)
                if self.deadline and time.monotonic() >= self.deadline:  # the store's own timeout came first
                    tier._count("timeouts")
                tier._failed(error or ConnectionError("the store's connection failed during a lookup"), "lookup")
            self.resolve([])
            return
        if not checked and sizes != []:  # ([]: the store was not asked) a loop check: checked as the guard does
            try:
                sizes = check_sizes(sizes, len(self.keys))
            except ValueError as why:
                if not self._done:
                    tier._failed(PluginFault(f"store {tier.store.name!r}: its loop existence check (LoopExists) "
                                             f"{why} (a fault of the store plugin)"), "lookup")
                self.resolve([])
                return
        if sizes and not self._done and (tier.breaker.failures or not tier.breaker.proven):
            tier.breaker.success()  # ([]: the store was not asked; an answer past the timeout proves nothing)
        self.resolve(sizes)

    def resolve(self, sizes: list[int]) -> bool:
        """End the lookup with ``sizes`` unless it already ended; True if this call did."""
        if self._done:
            return False
        self._done = True
        self.sizes = sizes
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)
        return True


def _answer_on_loop(lk: TierLookup, fut: Future[list[int]]) -> None:
    """Hand a threaded existence check's outcome to its lookup, on the loop (any store failure
    is a miss, counted)."""
    exc = fut.exception()
    sizes = fut.result() if exc is None else None
    lk.tier.call_soon(lambda: lk.arrived(sizes, exc, checked=True))


class StoreOpener:
    """The store a tier's config names, and how it is opened: its URL redacted, its errors made
    safe to show. The tier opens it at start and again on every retry; the server opens it once
    before it makes its arena (seconds for a large one), so that a URL the store cannot use, or
    credentials it refuses, stop the server at once (:meth:`open_first`)."""

    def __init__(self, config: TierConfig) -> None:
        self.config = config
        self.store: Store = get_store(config.store)
        self.url = self.store.redact(config.url)
        self._secrets = url_secrets(config.url)
        self.options = StoreOptions(timeout_s=config.timeout_s, bulk_timeout_s=config.bulk_timeout_s,
                                    read_workers=config.readers, write_workers=config.writers)

    def open(self) -> Backend:
        """``Store.open`` of the URL, checked. Raises ConfigError for a URL the store cannot use
        (its text made safe to show) and for a fault of the plugin (``open`` raised anything but
        ConfigError or StoreUnavailable, or returned something other than a Backend);
        StoreUnavailable or OSError where the store does not answer."""
        name = self.store.name
        try:
            opened = self.store.open(self.config.url, self.options)
        except ConfigError as exc:  # its text may quote the node (credentials refused: the node's words)
            raise ConfigError(self.shown(str(exc), CONFIG_ERROR_TEXT_MAX)) from None
        except (StoreUnavailable, OSError):
            raise
        except Exception as exc:
            raise ConfigError(f"store {name!r}: open() raised {self.describe(exc)} (a fault of the store plugin: "
                              "the contract allows ConfigError for a bad URL and StoreUnavailable for a store "
                              "that does not answer)") from exc
        if not isinstance(opened, Backend):
            raise ConfigError(f"store {name!r}: open() returned {type(opened).__name__}, not a kvxfer.store.Backend "
                              "(a fault of the store plugin)")
        return opened

    def open_first(self) -> Backend | StoreUnavailable:
        """:meth:`open`, with a store that does not answer given back as its error (for
        :meth:`L2Tier.start`, which then serves from L1 and retries, without a second wait)."""
        try:
            return self.open()
        except StoreUnavailable as exc:
            return exc
        except OSError as exc:
            return StoreUnavailable(f"{type(exc).__name__}: {exc}")

    def describe(self, exc: BaseException) -> str:
        """``exc`` as the log and ``kvxfer status`` show it. Its text may quote a store node's
        (or a plugin's) words: those may hold the URL's secrets (a node can echo what it was
        sent), terminal escapes, or a lot of text; so the URL is redacted, any secret of it
        replaced, every unprintable character escaped, and the text cut at
        :data:`ERROR_TEXT_MAX` characters."""
        return self.shown(f"{type(exc).__name__}: {exc}")

    def shown(self, text: str, limit: int = ERROR_TEXT_MAX) -> str:
        """``text`` made safe to log and show (see :meth:`describe`), at most ``limit`` characters."""
        if self.config.url:
            text = text.replace(self.config.url, self.url)
        for secret in self._secrets:
            text = text.replace(secret, "***")
        text = printable(text)
        return text if len(text) <= limit else f"{text[:limit - 3]}..."


class L2Tier:
    """The L2 tier of one server. Made and started by the server; see the module docstring for
    which of its methods run on which thread."""

    def __init__(
        self,
        config: TierConfig,
        index: ChunkIndex,
        arena: Arena,
        call_soon: Callable[[Callable[[], None]], None],
        expected_format: Callable[[ChunkKey], str | None],
        watch: Callable[[int, Callable[[], None]], None] | None = None,
        unwatch: Callable[[int], None] | None = None,
        tick_by: Callable[[float], None] | None = None,
    ) -> None:
        self.config = config
        self.index = index
        #: The tier's own promotion reservations (no session's: they count in the server's total only).
        self.usage = Usage()
        self.arena = arena
        self.call_soon = call_soon
        self.expected_format = expected_format
        #: The loop's descriptor polling (lookups read by the loop itself: LoopExists), and the
        #: descriptor it watches now.
        self._watch = watch
        self._unwatch = unwatch
        #: Has the loop run :meth:`tick` by a lookup's deadline (it waits at most timeout_s).
        self._tick_by = tick_by
        #: The store's health checks failed in a row (:meth:`_ping_store`; health thread).
        self._pings_failed = 0
        #: A ping() or stats() of the plugin that has not returned in time (:meth:`_health_call`).
        self._health_stuck: threading.Thread | None = None
        self._watched_fds: Sequence[int] = ()
        self._loop_exists: LoopExists | None = None
        self.admission_hits = parse_admission(config.admission)
        self.opener = StoreOpener(config)
        self.store: Store = self.opener.store
        self.url = self.opener.url
        self.options = self.opener.options
        self.breaker = Breaker(config.breaker_failures, config.backoff_s, config.max_backoff_s)
        self.backend: Backend | None = None
        #: Never pin more than this much of the arena for queued writes.
        self.pin_limit = arena.size // 2
        # -------- loop-thread state
        self.promoting: dict[ChunkKey, Future[None]] = {}
        #: Promotions whose gets have not all ended, oldest first (dicts keep their order).
        self._running: dict[_Promotion, None] = {}
        #: Whether close() left the backend's operations running (then nothing must wait for them).
        self.left_running = False
        #: When a get last ended (time.monotonic(), any thread): gets queued behind others at a
        #: store that still answers are not stuck.
        self._got_at = time.monotonic()
        #: Promotions started or ended so far (see ChunkIndex.changes).
        self.promoting_changes = 0
        self._from_l2: set[ChunkKey] = set()
        #: Chunks (model, world size, hash) whose L2 write was dropped for some ranks still in L1
        #: (the value: a bit per such rank), oldest first, at most _UNWRITTEN_KEPT: a lookup that
        #: finds them queues those ranks again.
        self._unwritten: dict[tuple[str, int, bytes], int] = {}
        self._hits: dict[ChunkKey, int] = {}
        self.pinned_bytes = 0
        # -------- write queue (loop appends, writers take)
        self._queue: deque[_Write] = deque()
        self._cond = threading.Condition()
        self._writing = 0
        #: Batches at the store now (under ``_cond``), oldest first.
        self._batches: dict[_Batch, None] = {}
        #: Writer threads not held by the store plugin (all started: ``_threads``).
        self._live_writers = 0
        self._stopping = False
        self._drain_until = 0.0
        # -------- plain counters (status and metrics read them)
        self.lookups = self.lookup_chunks = self.lookup_hits = self.timeouts = 0
        #: Lookups that did not ask the store: L2_KEYS_IN_FLIGHT keys of earlier ones were there.
        self.lookups_busy = 0
        #: Keys of existence checks at the store now (loop thread): each lookup's, until answered
        #: or timed out.
        self._keys_in_flight = 0
        self.promotions = self.promoted = self.promote_failures = self.integrity_failures = 0
        #: Damaged values this tier deleted from the store (see _check).
        self.damaged_deleted = 0
        self.writes = self.write_bytes = self.write_skipped = self.write_refused = 0
        self.drops = self.errors = 0
        self.store_stats: dict[str, str] = {}
        self._counters = threading.Lock()
        #: Lookups waiting for the store; the loop's tick ends those past their deadline.
        self._waiting: list[TierLookup] = []
        #: Lookups that timed out while their checks still run at the store (their keys counted).
        self._late: list[TierLookup] = []
        #: Per (model, world size), per chunk hash: every rank's chunk key and L2 key.
        self._keys: dict[tuple[str, int], dict[bytes, tuple[tuple[ChunkKey, ...], tuple[bytes, ...]]]] = {}
        #: (model name, world size) -> its ranks' L2 key maker, forgotten with the keys
        self._key_makers: dict[tuple[str, int], ChunkL2Keys] = {}
        self._keys_kept = 0
        #: Chunk keys whose value this server found intact but of another chunk format: until when
        #: lookups count them as misses, and the format this server then wanted (one registered in
        #: the value's format since makes it loadable) (loop thread; see _UNLOADABLE_KEPT).
        self._unloadable: dict[ChunkKey, tuple[float, str | None]] = {}
        #: lines lookups can cause at will (another layout's values in a shared store): one a second
        self._throttled = ThrottledLog(log)
        self._threads: list[threading.Thread] = []
        self._health_thread: threading.Thread | None = None
        self._stop_health = threading.Event()

    # ------------------------------------------------------------------ life

    def start(self, first: Backend | StoreUnavailable | None = None) -> None:
        """Open the backend (a store that does not answer leaves the tier down, retrying) and
        start the writer and health threads. Called once, before the loop serves. ``first``:
        what :meth:`StoreOpener.open_first` gave before the arena was made (the backend, taken
        as opened here, or the error of a store that did not answer), in place of opening it."""
        self._open_backend(first)
        for i in range(self.config.writers):
            self._start_writer(f"kvxfer-l2-writer-{i}")
        t = threading.Thread(target=self._health, name="kvxfer-l2-health", daemon=True)
        t.start()
        self._health_thread = t

    def _start_writer(self, name: str) -> None:
        t = threading.Thread(target=self._writer, name=name, daemon=True)
        t.start()
        self._threads.append(t)
        self._live_writers += 1

    def _open_backend(self, first: Backend | StoreUnavailable | None = None) -> bool:
        """Open the store (or take ``first``: see :meth:`start`): True once open; False when it
        does not answer (the breaker then retries). A URL it cannot use, or a fault of the
        plugin, raises ConfigError (:meth:`StoreOpener.open`): at start that stops the server,
        naming the store."""
        name = self.store.name
        try:
            if isinstance(first, BaseException):
                raise first
            opened = first if first is not None else self.opener.open()
        except (StoreUnavailable, OSError) as exc:  # a store that does not answer leaves L2 down, retrying
            msg = self._describe(exc)
            if self.backend is None and self.breaker.closed:
                log.warning("L2 store %s at %s is unavailable (%s); serving from L1, retrying with backoff",
                            name, self.url, msg)
            self.breaker.trip(msg)
            return False
        backend = GuardedBackend(name, opened)
        if self._stop_health.is_set():  # closed while this opened (a slow store): not kept
            backend.close()
            return False
        #: The backend when the loop reads its lookups itself (checked once: isinstance of a
        #: runtime-checkable Protocol is slow); the sizes it reports are checked as they arrive.
        self._loop_exists = opened if self._watch is not None and isinstance(opened, LoopExists) else None
        self.backend = backend
        log.info("L2 store %s at %s is up", self.store.name, self.url)
        return True

    def close(self) -> None:
        """Drain queued writes for at most ``drain_s``, drop the rest, wait for promotions and
        writers, close the backend. Called by the server's shutdown, on the loop thread, before
        the arena is released; pins are not undone (the arena goes away)."""
        with self._cond:
            self._stopping = True
            self._drain_until = time.monotonic() + self.config.drain_s
            self._cond.notify_all()
        # one deadline for all: the writers drain, then their last operations end or are given up
        deadline = time.monotonic() + self.config.drain_s + self.config.stuck_s + 1
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._stop_health.set()
        if self._health_thread is not None:
            self._health_thread.join(self.config.timeout_s + 5)
        backend, self.backend = self.backend, None
        if backend is None:
            return
        # pending gets finish or fail: nothing writes into the arena after this; a store whose
        # operations never end is left running (kvxfer serve then exits without it; a process
        # that embeds the server waits for them at its exit, as Python waits for pool threads)
        started = time.monotonic()
        if not close_within(backend, max(5.0, deadline - started)):
            self.left_running = True
            log.error("L2 store %s did not close within %.1f s: operations stuck in the store plugin are left "
                      "running, and the server exits without them", self.store.name, time.monotonic() - started)
        elif any(p.left for p in self._running):
            # close() returned with gets still running in the plugin: the process must not wait for them
            self.left_running = True
            log.error("L2 store %s closed with gets still running in it: the server exits without them",
                      self.store.name)

    # ------------------------------------------------------------------ write path (loop thread)

    def offer(self, entries: Sequence[Entry]) -> None:
        """Chunks just committed to L1 by a store: queue them for L2 (admission permitting).
        Costs the store one lock and one wake-up of a writer, whatever the number of chunks."""
        fresh = [e for e in entries if e.key not in self._from_l2] if self._from_l2 else entries
        if self.admission_hits:
            for e in fresh:
                self._hits[e.key] = 0
        elif fresh:
            self._enqueue(fresh)

    @property
    def counts_hits(self) -> bool:
        """Whether :meth:`count_hits` has anything to do (the server skips the call otherwise)."""
        return bool(self.admission_hits or self._unwritten)

    def count_hits(self, model_name: str, world_size: int, hashes: Sequence[bytes]) -> None:
        """A lookup found ``hashes`` in L1 for every rank. ``hits:N`` admission: a chunk is
        queued for L2 once N lookups found it (each lookup counts a chunk once). And a chunk
        whose L2 write was dropped is queued again while the store is up and the queue has room
        (not counted as dropped again if it has none): an outage, a full queue or a failover
        leaves no lasting gap in L2 for the chunks still asked for. Its ranks already in the
        store are skipped by the writer's existence check."""
        again = bool(self._unwritten) and self.breaker.closed and self.backend is not None \
            and self._live_writers > 0
        if not self._hits and not again:
            return
        entries = self.index.entries
        ready = []
        retry = []
        unwritten = self._unwritten
        for h in dict.fromkeys(hashes):  # a hash named twice is one chunk found once
            if again and (model_name, world_size, h) in unwritten:
                ranks = unwritten.pop((model_name, world_size, h))
                for rank in range(world_size):
                    if ranks >> rank & 1:
                        e = entries.get(ChunkKey(model_name, world_size, rank, h))
                        if e is not None and e.state is State.READY:
                            retry.append(e)
                continue
            if not self._hits:
                continue
            for rank in range(world_size):
                key = ChunkKey(model_name, world_size, rank, h)
                n = self._hits.get(key)
                if n is None:
                    continue
                n += 1
                if n < self.admission_hits:
                    self._hits[key] = n
                    continue
                del self._hits[key]
                e = entries.get(key)
                if e is not None and e.state is State.READY:
                    ready.append(e)
        if ready:
            self._enqueue(ready)
        if retry:
            self._not_written(self._enqueue(retry, again=True))

    def forget(self, keys: Sequence[ChunkKey]) -> None:
        """Chunks left L1 (evicted or cleared)."""
        for key in keys:
            self._hits.pop(key, None)
            self._from_l2.discard(key)
            if self._unwritten:
                chunk = (key.model_name, key.world_size, key.chunk_hash)
                ranks = self._unwritten.get(chunk, 0) & ~(1 << key.rank)
                if ranks:
                    self._unwritten[chunk] = ranks
                else:
                    self._unwritten.pop(chunk, None)

    def _not_written(self, entries: Iterable[Entry]) -> None:
        """(Loop thread) remember chunks whose L2 write was dropped (see :meth:`count_hits`)."""
        u = self._unwritten
        index = self.index.entries
        for e in entries:
            if index.get(e.key) is e:  # (one evicted meanwhile is forgotten)
                k = e.key
                chunk = (k.model_name, k.world_size, k.chunk_hash)
                u[chunk] = u.pop(chunk, 0) | 1 << k.rank  # (to the end: the most recent)
        while len(u) > _UNWRITTEN_KEPT:
            del u[next(iter(u))]

    def _enqueue(self, entries: Sequence[Entry], again: bool = False) -> list[Entry]:
        """Queue ``entries`` for L2 (pinned). Returns those dropped, for a full queue or a store
        that is down: counted and remembered as not written (see :meth:`count_hits`), unless
        ``again`` (queued again: the caller remembers them, uncounted). Chunks larger than the
        store's values are counted as dropped, never remembered."""
        largest = self.store.capabilities.max_value_bytes - HEADER_SIZE
        too_big = [e for e in entries if e.size > largest]
        if too_big:  # the store would refuse them (Valkey: its connection too)
            self._count("drops", len(too_big))
            self._throttled.warning("too big", f"chunks of {too_big[0].size} bytes are more than the L2 store "
                                    f"{self.store.name} holds in one value ({largest} bytes and a header): not "
                                    "written to L2 (register with a smaller --chunk-size to share them)")
            entries = [e for e in entries if e.size <= largest]
        queued = 0
        if self.breaker.closed and self.backend is not None and self._live_writers > 0:
            with self._cond:
                for e in entries:
                    if len(self._queue) >= self.config.queue or self.pinned_bytes + e.size > self.pin_limit:
                        break
                    self.index.hold(e)  # until its write is done: not evicted, not overwritten, not "used"
                    self.pinned_bytes += e.size
                    self._queue.append(_Write(e.key, e, e.fmt, again))
                    queued += 1
                if queued:  # as many writers as there are batches
                    self._cond.notify(min(self.config.writers, -(-queued // self.config.batch)))
        dropped = list(entries[queued:])
        if dropped and not again:
            self._count("drops", len(dropped))
            self._not_written(dropped)
        return dropped

    def _count(self, name: str, n: int = 1) -> None:
        """Add to a counter that several threads update (drops, errors, timeouts, integrity
        failures, damaged values deleted); the others change on the loop thread only."""
        with self._counters:
            setattr(self, name, getattr(self, name) + n)

    def _unpin(self, batch: Sequence[_Write]) -> None:
        for w in batch:
            self.index.release(w.entry)
            self.pinned_bytes -= w.entry.size

    @property
    def queue_depth(self) -> int:
        return len(self._queue) + self._writing

    # ------------------------------------------------------------------ writers (their threads)

    def _writer(self) -> None:
        background_thread()
        try:
            self._write_batches()
        finally:  # counted while it runs and is not held (see _abandon_held_writers)
            with self._cond:
                self._live_writers -= 1

    def _write_batches(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                if self._stopping and time.monotonic() > self._drain_until:
                    dropped = list(self._queue)
                    self._queue.clear()
                    self._count("drops", len(dropped))
                    self._unpin(dropped)
                    return
                batch = [self._queue.popleft() for _ in range(min(self.config.batch, len(self._queue)))]
                self._writing += len(batch)
            self._yield_to_stores()
            at_store = _Batch(batch, time.monotonic())
            with self._cond:
                self._batches[at_store] = None
            lost: list[_Write] = []  # not written: queued again by later lookups (see count_hits)
            failed: Exception | None = None
            try:
                written, skipped, refused, nbytes = self._write(at_store, lost)
            except _GivenUp:
                written = skipped = refused = nbytes = 0
            except Exception as exc:  # noqa: BLE001  (the store failed: these writes are lost, L1 keeps them)
                written = skipped = refused = nbytes = 0
                failed = exc
            with self._cond:  # the batch is this writer's again, unless the loop gave it up meanwhile
                del self._batches[at_store]
                if at_store.settled:  # counted, unpinned and logged by the loop
                    self._live_writers += 1  # this thread is a writer again
                    continue
                self._writing -= len(batch)
            if failed is not None:
                self._failed(failed, "write")
                self._count("drops", len(batch))
                lost = [w for w in batch if not w.again]  # tried once more, no more: a failure may be lasting

            def done(batch: list[_Write] = batch, w: int = written, s: int = skipped, r: int = refused,
                     n: int = nbytes, lost: list[_Write] = lost) -> None:
                self._unpin(batch)
                if lost and not self._stopping:
                    self._not_written(x.entry for x in lost)
                self.writes += w
                self.write_skipped += s
                self.write_refused += r
                self._count("drops", r)  # refused by a full store that may not evict: not in L2
                self.write_bytes += n
                if r:  # not a full queue: the store said no (its budget, its largest value)
                    self._throttled.warning("refused", f"L2 store {self.store.name} refused {r} of {len(batch)} "
                                            "values (no room it will make: its size budget, or values larger "
                                            "than it holds; on a cluster, also values whose slot moved during "
                                            "the write); they stay in L1 (a lookup that finds them there has "
                                            "them written once more)")

            if self._stopping:
                done()  # the loop no longer runs; the arena outlives this thread (close joins it)
            else:
                self.call_soon(done)

    def _yield_to_stores(self) -> None:
        """Wait (at most ``write_yield_s``) until no client's store has been filling arena slots
        for ``_QUIET_S``: an L2 write reads its chunks from memory once to checksum them and once
        to send them (and the store's own receive, on the same host, twice more), which on a host
        short of cores and memory bandwidth is taken from the copy of a store in progress. A
        promotion does not count: its get may wait on the network for seconds (a slow node, up
        to ``--l2-bulk-timeout``), and every write batch yielded its whole ``write_yield_s`` to it
        meanwhile (40 chunks a second at the defaults, the rest dropped)."""
        index = self.index
        deadline = time.monotonic() + self.config.write_yield_s
        while not self._stopping:
            now = time.monotonic()
            if now >= deadline or (not index.filling and now - index.filled_at >= _QUIET_S):
                return
            time.sleep(_QUIET_S / 2)

    def _write(self, at_store: _Batch, lost: list[_Write]) -> tuple[int, int, int, int]:
        """Write a batch (a writer's thread): (values written, skipped as the store holds them,
        refused by the store, bytes written). Writes dropped because the store is down, and
        those the store refused but for writes queued again, are added to ``lost``. Raises
        :class:`_GivenUp` if the loop gave the batch up while the plugin held this thread: its
        chunks are no longer pinned, so their slots may hold other chunks by now."""
        batch = at_store.writes
        backend = self.backend
        if backend is None or not self.breaker.closed:
            self._count("drops", len(batch))
            lost += batch
            return 0, 0, 0, 0
        keys = [l2_key(w.key) for w in batch]
        views = [self.arena.memoryview(w.entry.offset, w.entry.size) for w in batch]
        sizes = self._bounded(backend.submit_exists(keys), "submit_exists")
        todo = [i for i, (w, size) in enumerate(zip(batch, sizes)) if size != HEADER_SIZE + w.entry.size]
        skipped = len(batch) - len(todo)
        if not todo:
            self.breaker.success()
            return 0, skipped, 0, 0
        with self._cond:  # the header's checksum is of the pinned chunk's bytes, or there is no header
            if at_store.settled:
                raise _GivenUp
            at_store.reading = True
        began = time.monotonic()
        try:
            # the arena's slots, read-only: a plugin that wrote into a put's parts (to transform
            # them in place, say) would change what readers of the chunk in L1 load meanwhile
            items = [(keys[i], [memoryview(encode_header(batch[i].key, batch[i].fmt, views[i])),
                                views[i].toreadonly()]) for i in todo]
        finally:
            with self._cond:
                at_store.reading = False
                at_store.read_s += time.monotonic() - began
        with self._cond:
            if at_store.settled:  # (given up after this, the plugin may send other bytes than the checksum's:
                raise _GivenUp    # a value that fails it, never loaded)
        stored = self._bounded(backend.submit_put(items), "submit_put", sum(batch[i].entry.size for i in todo))
        self.breaker.success()
        ok = sum(stored)
        # a refusal is tried once more (a cluster slot that moved twice during the write, a full
        # store that evicts by then), no more: a store that may not evict would refuse at every hit
        lost += [batch[i] for i, s in zip(todo, stored) if not s and not batch[i].again]
        return ok, skipped, len(stored) - ok, sum(batch[i].entry.size for i, s in zip(todo, stored) if s)

    def _bounded(self, fut: Future[T], what: str, nbytes: int = 0) -> T:
        """``fut``'s result, waited for at most ``stuck_after(nbytes)`` (a writer's thread, which
        has no other operation at the store); TimeoutError after, logged as the plugin's fault
        (the write is dropped, and the arena bytes it may still read can be reused: what it then
        writes fails its checksum and is never loaded)."""
        after = self.config.stuck_after(nbytes)
        try:
            return fut.result(timeout=after)
        except FutureTimeout:  # (not TimeoutError before Python 3.11)
            self._throttled.warning("stuck write", f"L2 store {self.store.name}: {what} has not ended after "
                                    f"{after:g} s; its writes are dropped (a fault of the store plugin: its "
                                    "operations must end within --l2-timeout and --l2-bulk-timeout)")
            raise TimeoutError(f"{what} did not end within {after:g} s") from None

    def _failed(self, exc: BaseException, what: str) -> None:
        self._count("errors")
        msg = self._describe(exc)
        if self.breaker.failure(msg):
            log.warning("L2 store %s at %s is down after %d failures (last: %s during %s); serving from L1 and "
                        "retrying with backoff", self.store.name, self.url, self.breaker.failures, msg, what)
        else:  # one failure is news too: a store that fails all its writes may never fail three in a row
            self._throttled.warning("failure", f"L2 store {self.store.name}: {what} failed: {msg}")

    def _describe(self, exc: BaseException) -> str:
        """:meth:`StoreOpener.describe`."""
        return self.opener.describe(exc)

    def _shown(self, text: str, limit: int = ERROR_TEXT_MAX) -> str:
        """:meth:`StoreOpener.shown`."""
        return self.opener.shown(text, limit)

    # ------------------------------------------------------------------ lookups (loop thread)

    def begin_lookup(self, model_name: str, world_size: int, hashes: Sequence[bytes],
                     l1_hits: int) -> TierLookup | None:
        """Send the existence check of every rank's key of the chunks after the first ``l1_hits``,
        at most :data:`L2_LOOKUP_KEYS` keys (one pipelined round trip). Returns the lookup, which
        resolves on the loop once the store answered, or after ``timeout_s`` (counted; the sizes
        are then empty); None when L2 is down or no chunk can be asked about.

        With a :class:`~kvxfer.store.LoopExists` backend the check is sent before anything else
        is done, so that the rest (bookkeeping here, returning to the loop's poll) overlaps the
        store's answer; the L2 keys of recently seen chunks are remembered, not derived again."""
        backend = self.backend
        asked = hashes[l1_hits:l1_hits + L2_LOOKUP_KEYS // world_size]
        if backend is None or not self.breaker.closed or not asked:
            return None
        if self._keys_in_flight + len(asked) * world_size > L2_KEYS_IN_FLIGHT:  # before any key is made
            self.lookups_busy += 1
            return None
        if self._keys_kept >= _KEYS_KEPT:  # forget them all (a lookup adds at most its own keys)
            self._keys.clear()
            self._key_makers.clear()
            self._keys_kept = 0
        cache = self._keys.get((model_name, world_size))
        if cache is None:
            cache = self._keys[(model_name, world_size)] = {}
        keys: list[ChunkKey] = []
        l2: list[bytes] = []
        for h in asked:
            known = cache.get(h)
            if known is None:
                known = self._chunk_keys(cache, model_name, world_size, h)
            keys += known[0]
            l2 += known[1]
        lk = TierLookup(self, model_name, world_size, hashes, l1_hits, keys)
        loop = self._loop_exists
        sent = False
        if loop is not None:
            try:  # plugin code on the loop: what it raises is a failed check, never the lookup's error
                if loop.loop_fds() is not self._watched_fds:
                    self._sync_watch(loop)
                sent = bool(self._watched_fds) and loop.exists_nowait(l2, lk.arrived)
            except Exception as exc:  # noqa: BLE001  (then through the backend's threads, as for any refusal)
                self._loop_fault("its loop existence check", exc)
                sent = False
        if not sent:
            start = time.perf_counter()
            try:
                fut = backend.submit_exists(l2)
            except StoreUnavailable as exc:
                self._failed(exc, "lookup")
                return None
            took = time.perf_counter() - start
            if took > _SUBMIT_BLOCKED_S:  # the loop waited: every client did
                self._throttled.warning("blocking submit", f"L2 store {self.store.name}: submit_exists took "
                                        f"{took * 1e3:.1f} ms on the server's loop; a submit must return at once "
                                        "and run the operation on the backend's threads (ThreadedBackend does)")
            fut.add_done_callback(functools.partial(_answer_on_loop, lk))
        if not lk.done():  # (an answer within the send has been counted out already)
            lk.in_flight = len(l2)
            self._keys_in_flight += len(l2)
        # after the send: this overlaps the store's answer
        self.lookups += 1
        self.lookup_chunks += len(keys)
        self._plan(lk)
        if not lk.done():
            lk.deadline = time.monotonic() + self.config.timeout_s
            self._waiting.append(lk)
            if self._tick_by is not None:
                self._tick_by(lk.deadline)
        return lk

    def _landed(self, lk: TierLookup) -> None:
        """``lk``'s check is no longer counted at the store: answered, failed or timed out (loop
        thread; once per lookup)."""
        self._keys_in_flight -= lk.in_flight
        lk.in_flight = 0

    def _chunk_keys(self, cache: dict[bytes, tuple[tuple[ChunkKey, ...], tuple[bytes, ...]]], model_name: str,
                    world_size: int, chunk_hash: bytes) -> tuple[tuple[ChunkKey, ...], tuple[bytes, ...]]:
        """Every rank's chunk key and L2 key of one chunk, remembered in ``cache``."""
        ck = tuple(ChunkKey(model_name, world_size, r, chunk_hash) for r in range(world_size))
        make = self._key_makers.get((model_name, world_size))
        if make is None:
            make = self._key_makers[(model_name, world_size)] = ChunkL2Keys(
                [ChunkKey(model_name, world_size, r, b"") for r in range(world_size)])
            self._keys_kept += world_size  # a hasher per rank, forgotten with the keys
        known = cache[chunk_hash] = (ck, make(chunk_hash))
        self._keys_kept += len(ck)  # keys, not chunks: a chunk of world_size 65536 has as many
        return known

    def _sync_watch(self, backend: LoopExists) -> None:
        """Have the loop poll the backend's current loop connections (and forget old ones)."""
        fds = backend.loop_fds()
        if fds is self._watched_fds:
            return
        old = set(self._watched_fds)
        for fd in old - set(fds):
            assert self._unwatch is not None
            self._unwatch(fd)
            backend.drop_loop_fd(fd)
        for fd in fds:
            if fd not in old:
                assert self._watch is not None
                self._watch(fd, functools.partial(self._readable, backend, fd))
        self._watched_fds = fds

    def _readable(self, backend: LoopExists, fd: int) -> None:
        try:  # plugin code on the loop (the lookups it left unanswered end at their timeout)
            backend.on_readable(fd)
            if backend.loop_fds() is not self._watched_fds:
                self._sync_watch(backend)
        except Exception as exc:  # noqa: BLE001  (counted as the store's failure, never the loop's)
            self._loop_fault("on_readable", exc)

    def _loop_fault(self, what: str, exc: Exception) -> None:
        """Plugin code the loop runs (LoopExists) raised: counted as the store's failure, never the loop's."""
        self._failed(PluginFault(f"store {self.store.name!r}: {what} raised {type(exc).__name__}: {exc} "
                                 "(a fault of the store plugin)"), "lookup")

    def tick(self) -> None:
        """On the loop, a few times a second: poll a new loop connection of the store (so that
        its loss is seen at once), and answer lookups whose store did not (a backstop: backends
        bound their own operations by ``timeout_s``)."""
        if self._loop_exists is not None:
            try:
                self._sync_watch(self._loop_exists)
            except Exception as exc:  # noqa: BLE001  (plugin code on the loop: counted, never the loop's)
                self._loop_fault("its loop connections", exc)
        if self._running:
            self._abandon_stuck()
        if self._batches:
            self._abandon_held_writers()
        now = time.monotonic()
        if self._late:
            self._warn_late(now)
        if not self._waiting:
            return
        keep = []
        for lk in self._waiting:
            if lk.done():
                continue
            if lk.deadline > now:
                keep.append(lk)
            elif lk.resolve([]):
                # its keys stay counted until the store answers or fails the check (a silent node's
                # loop connection is dropped, a threaded check ends by its timeout): a store slower
                # than the lookups must not have ever more of their checks queued at it
                if lk.in_flight:
                    self._late.append(lk)
                self._count("timeouts")
                self._failed(TimeoutError(f"no answer within {self.config.timeout_s:g} s"), "lookup")
        self._waiting = keep

    def _warn_late(self, now: float) -> None:
        """Forget the timed-out lookups whose checks the store has ended since; warn while one
        has not, :data:`_LATE_CHECK_S` after its timeout (a backend that leaves checks running
        keeps later lookups "busy": answered from L1)."""
        self._late = [lk for lk in self._late if lk.in_flight]
        if self._late and now - self._late[0].deadline > _LATE_CHECK_S:
            keys = sum(lk.in_flight for lk in self._late)
            self._throttled.warning("late checks", f"L2 store {self.store.name}: {len(self._late)} existence "
                                    f"checks ({keys} keys) have not ended {now - self._late[0].deadline:.0f} s "
                                    "after their lookups timed out; lookups answer from L1 (counted as busy) while "
                                    f"more than {L2_KEYS_IN_FLIGHT} keys are at the store (a store must end its "
                                    "operations within --l2-timeout)")

    def _abandon_stuck(self) -> None:
        """On the loop: promotions whose gets have not ended within ``stuck_after`` their bytes,
        while no get of the store ended either (or within :data:`STUCK_FACTOR` times that, while
        others did: one connection stuck among working ones), fail for their waiters (a retrieve
        reports their chunks missing), counted; their slots stay reserved until the gets end,
        since the store may still write into them."""
        now = time.monotonic()
        for p in list(self._running):
            if now - p.started <= self.config.stuck_s:
                break  # the rest started later
            after = self.config.stuck_after(p.nbytes)
            if p.abandoned or (now - max(p.started, self._got_at) <= after and now - p.started <= STUCK_FACTOR * after):
                continue  # (gets end meanwhile: this one waits its turn at a store that answers, for a while)
            p.abandoned = True
            self.promote_failures += len(p.res.entries)
            self._failed(TimeoutError(f"a get of {len(p.res.entries)} values did not end within {after:g} s"),
                         "promotion")
            self._throttled.warning("stuck get", f"L2 store {self.store.name}: a get has not ended after "
                                    f"{after:g} s; its {len(p.res.entries)} chunks are reported "
                                    "missing and their arena slots stay reserved until it ends (a fault of the "
                                    "store plugin: its operations must end within --l2-timeout and "
                                    "--l2-bulk-timeout)")
            self._end_waits(p)
            self._withdraw(p)

    def _withdraw(self, p: _Promotion) -> None:
        """On the loop: have the store withdraw the gets of ``p`` (given up) that have not started,
        queued behind a stuck one: their slots are freed with the promotion once its started gets
        end, instead of each get running out its own time first."""
        backend = self.backend
        if backend is None:
            return
        for fut in p.gets:
            try:
                backend.withdraw(fut)
            except Exception as exc:  # noqa: BLE001  (StoreUnavailable, a PluginFault: the get runs its course)
                self._throttled.warning("withdraw", f"L2 store {self.store.name}: withdrawing a get of a promotion "
                                        f"given up failed ({printable(str(exc))}): it runs its course")

    def _abandon_held_writers(self) -> None:
        """On the loop: a batch whose writer has not come back from the store after the longest
        its operations may take (``stuck_s`` for the existence check, ``stuck_after`` its bytes for
        the put, a second more) is held in a ``submit_*`` call of the plugin, which must return at
        once (a future that never ends is given up by the writer itself). Its writes are dropped,
        counted and logged as the plugin's fault, and its pins released. The writer, if it ever
        comes back, reads no more of the arena for it (:class:`_GivenUp`); bytes the plugin reads
        after this fail the checksum computed before and are never loaded. A writer is started in
        its place, at most ``writers`` times in the tier's life; with none left, the queue is
        dropped and writes are dropped as they come, until a held writer comes back."""
        now = time.monotonic()
        held = []
        queued: list[_Write] = []
        with self._cond:
            for b in self._batches:
                if now - b.started <= self.config.stuck_s:
                    break  # the rest went to the store later
                if b.settled or b.reading or now - b.started <= \
                        self.config.stuck_s + self.config.stuck_after(b.nbytes) + b.read_s + 1:
                    continue
                b.settled = True
                self._writing -= len(b.writes)
                self._live_writers -= 1
                held.append(b)
        for b in held:
            self._unpin(b.writes)
            self._count("drops", len(b.writes))
            self._not_written(w.entry for w in b.writes if not w.again)  # a failure: tried once more
            waited = now - b.started
            self._failed(PluginFault(f"store {self.store.name!r}: a submit call held a writer for {waited:.1f} s"),
                         "write")
        if not held:
            return
        with self._cond:
            for _ in held:
                started = len(self._threads) - self.config.writers  # in place of held ones so far
                if started >= self.config.writers or self._stopping:
                    break
                try:
                    self._start_writer(f"kvxfer-l2-writer-r{started + 1}")
                except RuntimeError:  # no thread can be started now: as if none were left to start
                    break
            if self._live_writers == 0:
                queued = list(self._queue)
                self._queue.clear()
        self._throttled.warning("held writer", f"L2 store {self.store.name}: {len(held)} writer(s) have not come "
                                f"back from the store plugin after {now - held[0].started:.1f} s (a submit_exists "
                                "or submit_put call that does not return: a fault of the plugin, whose submits must "
                                f"return at once); their {sum(len(b.writes) for b in held)} writes are dropped; "
                                f"writers not held now: {self._live_writers}")
        if queued:  # no writer left: as for a store that is down
            self._unpin(queued)
            self._count("drops", len(queued))
            self._not_written(w.entry for w in queued)

    def _plan(self, lk: TierLookup) -> None:
        """Read what L1 and the promotions say about the keys ``lk`` asked the store about, so
        that its answer only has to be compared (see :meth:`finish_lookup`)."""
        entries = self.index.entries
        promoting = self.promoting
        ws = lk.world_size
        keys = lk.keys
        need = lk.need
        l2_chunks = lk.l2_chunks
        expected: dict[int, int] = {}
        n = len(keys) // ws
        lk.stop = n
        for c in range(n):
            from_l2 = False
            for j in range(c * ws, c * ws + ws):
                key = keys[j]
                e = entries.get(key)
                if e is None:
                    want = expected.get(key.rank)
                    if want is None:
                        fmt = self.expected_format(key)
                        want = expected[key.rank] = chunk_format_bytes(fmt) if fmt is not None else 0
                    need.append((c, j, key, want))
                    from_l2 = True
                elif e.state is not State.READY:
                    if key not in promoting:
                        lk.stop = c
                        break
                    from_l2 = True
            if lk.stop == c:
                break
            if from_l2:
                l2_chunks.append(c)
        lk.changes = (self.index.changes, self.promoting_changes)

    def _loadable(self, lk: TierLookup) -> int:
        """How many keys the store answered for with a value this server could load: of the
        size of its rank's registered layout (any size that fits the arena where none is
        registered), and not found of another chunk format lately. A value of another size
        (another layout's, or junk) is no hit of this server's."""
        keys, sizes = lk.keys, lk.sizes
        if not sizes:
            return 0
        want_of: dict[int, int] = {}
        for key in keys[:lk.world_size]:  # the keys go chunk by chunk, every rank's in turn
            fmt = self.expected_format(key)
            want_of[key.rank] = chunk_format_bytes(fmt) if fmt is not None else 0
        wants = set(want_of.values())
        unloadable = self._unloadable
        if len(wants) == 1 and 0 not in wants and not unloadable:  # the usual case, at C speed
            return sizes.count(HEADER_SIZE + wants.pop())
        now = time.monotonic() if unloadable else 0.0
        n = 0
        room = self.arena.size
        for key, size in zip(keys, sizes):
            size -= HEADER_SIZE
            want = want_of.get(key.rank, 0)
            if size <= 0 or not (size == want if want else size <= room):
                continue
            seen = unloadable.get(key) if unloadable else None
            n += seen is None or seen[0] <= now or seen[1] != self.expected_format(key)
        return n

    def finish_lookup(self, lk: TierLookup, promote: bool,
                      before_promote: Callable[[list[Entry], int, int], None] | None = None,
                      ) -> tuple[int, int, int]:
        """Count the leading chunks present for every rank in L1, being promoted, or in L2 (the
        sizes the store answered); with ``promote``, start promoting the L2 ones. Returns
        ``(hits, l2_hits, leasable)``: leasable chunks have an L1 entry for every rank (readable,
        or being promoted). When the index or the promotions changed while the store answered,
        L1 is read again. ``before_promote(entries, keys, nbytes)`` is called with the L1
        entries of the leading chunks counted, the number of keys about to be promoted and their
        arena bytes; what it raises refuses the lookup with nothing promoted."""
        self.lookup_hits += self._loadable(lk)
        if lk.changes != (self.index.changes, self.promoting_changes):
            hits = self.index.lookup(lk.model_name, lk.world_size, lk.hashes[:lk.l1_hits])
            if hits < lk.l1_hits:  # L1 hits left meanwhile: answer with what is left
                return hits, 0, hits
            lk.need.clear()
            lk.l2_chunks.clear()
            self._plan(lk)
        sizes = lk.sizes
        end = lk.stop
        wanted: list[tuple[int, ChunkKey, int]] = []
        first = lk.l1_hits
        unloadable = self._unloadable
        now = time.monotonic() if unloadable else 0.0
        for c, j, key, want in lk.need:
            if c >= end:
                break
            size = sizes[j] - HEADER_SIZE if sizes else 0
            if unloadable and size > 0:
                seen = unloadable.get(key)
                if seen is not None and seen[0] > now and seen[1] == self.expected_format(key):
                    size = 0  # found of another chunk format lately: a miss, not a promotion that fails
            if size > 0 and (size == want if want else size <= self.arena.size):
                wanted.append((first + c, key, size))
                continue
            if size > 0 and want:
                self._wrong_size(key, size, want)
            end = c
        if promote:
            # only chunks an engine registered here can load are promoted: a chunk of a rank no
            # registered context names (its format unknown) ends what a promoting lookup counts,
            # so that no lookup alone fills the arena or fixes a model's format on this server
            for c, _, _, want in lk.need:
                if c >= end:
                    break
                if not want:
                    end = c
                    break
        while wanted and wanted[-1][0] >= first + end:  # the other ranks of the chunk that ended it
            wanted.pop()
        hits = first + end
        l2_hits = bisect.bisect_left(lk.l2_chunks, end)
        if not (promote and wanted):
            return hits, l2_hits, wanted[0][0] if wanted else hits
        held = self._entries_of(lk, hits)
        if before_promote is not None:
            before_promote(held, len(wanted), sum(Allocator.rounded(size) for _, _, size in wanted))
        # the readable L1 entries of the hits are pinned while the promotion makes room: its
        # slots must not come from the chunks this lookup counts (and then leases)
        readable = [e for e in held if e.state is State.READY]
        for e in readable:
            self.index.pin(e)
        try:
            hits = min(hits, self._promote(wanted))
        finally:
            for e in readable:
                self.index.unpin(e)
        return hits, bisect.bisect_left(lk.l2_chunks, hits - first), hits

    def _entries_of(self, lk: TierLookup, stop: int) -> list[Entry]:
        """The L1 entries (readable, or being written) of every rank of ``lk``'s chunks before
        ``stop``, each once (a lookup may name a chunk twice)."""
        entries = self.index.entries
        found = (entries.get(ChunkKey(lk.model_name, lk.world_size, rank, h))
                 for h in dict.fromkeys(lk.hashes[:stop]) for rank in range(lk.world_size))
        return [e for e in found if e is not None]  # distinct keys: distinct entries

    def _wrong_size(self, key: ChunkKey, size: int, want: int) -> None:
        self._count("integrity_failures")
        self._throttled.warning("wrong size", f"L2 value of chunk {key.chunk_hash.hex()[:16]} of {key.model_name!r} "
                                f"has {size} bytes; the registered layout {self.expected_format(key)} needs "
                                f"{want}: ignored")

    # ------------------------------------------------------------------ promotion

    def _promote(self, wanted: list[tuple[int, ChunkKey, int]]) -> int:
        """Reserve L1 slots for ``wanted`` (chunk index, key, bytes) and read them from the store.
        Returns the chunk index of the first one that found no room (or a large number)."""
        backend = self.backend
        limit = 1 << 62
        if backend is None:
            return min(i for i, _, _ in wanted)
        by_format: dict[tuple[int, str], list[tuple[int, ChunkKey]]] = {}
        for i, key, size in wanted:
            fmt = self.expected_format(key)  # each rank's own: a group may mix ranks
            if fmt is None:  # its context closed since the lookup was planned: nothing can load it
                limit = min(limit, i)
                continue
            by_format.setdefault((size, fmt), []).append((i, key))
        for (size, fmt), group in by_format.items():
            try:
                res, present, no_space = self.index.reserve_write([k for _, k in group], fmt, size,
                                                                  PROMOTER, self.usage, filling=False)
            except InvalidRequest:  # an entry appeared in another format meanwhile
                return min(i for i, _ in group)
            res.in_flight = True
            for j in no_space:
                limit = min(limit, group[j][0])
            if not res.entries:
                self.index.commit_write(res)
                continue
            n = len(res.entries)
            p = _Promotion(res, [bytearray(HEADER_SIZE) for _ in range(n)],
                           [self.expected_format(e.key) for _, e in res.entries], [None] * n, {})
            for _, e in res.entries:
                p.done[e.key] = self.promoting[e.key] = Future()
            self._running[p] = None
            self.promoting_changes += 1
            self.promotions += 1
            # split among the read connections: one Valkey thread serves two sockets faster than one
            ways = max(1, min(self.config.readers, n))
            parts = [list(range(k, n, ways)) for k in range(ways)]
            p.left = len(parts)
            for idx in parts:
                items = [(l2_key(res.entries[j][1].key),
                          [memoryview(p.headers[j]), self.arena.memoryview(res.entries[j][1].offset,
                                                                            res.entries[j][1].size)])
                         for j in idx]
                try:
                    fut = backend.submit_get(items)
                except Exception as exc:  # noqa: BLE001  (StoreUnavailable, or a backend's own error:
                    # either fails these chunks; the promotion still ends, so its waiters go on)
                    self._failed(exc, "promotion")
                    self._checked(p, idx, None)
                    limit = min(limit, min(i for i, _ in group))
                    continue
                p.gets.append(fut)
                fut.add_done_callback(functools.partial(self._check, p, idx))
        # promotions past the first chunk without room still run (their slots are taken and the
        # bytes are on their way); they are simply not counted as hits
        return limit

    def _check(self, p: _Promotion, idx: list[int], fut: Future[list[GetStatus]]) -> None:
        """On a store thread: verify what one get read (header, length, checksum). (On the
        loop, for a get withdrawn before it started: its promotion was given up and counted.)"""
        if fut.cancelled():
            self._checked(p, idx, None)
            return
        self._got_at = time.monotonic()
        try:
            statuses = fut.result()
        except Exception as exc:  # noqa: BLE001  (any store failure fails the promotion, counted)
            self._failed(exc, "promotion")
            self._checked(p, idx, None)
            return
        self.breaker.success()
        found: list[str | None] = []
        damaged: list[bytes] = []
        unloadable: list[tuple[ChunkKey, str | None]] = []
        for j, status in zip(idx, statuses):
            e = p.res.entries[j][1]
            found.append(None)
            try:
                if status is not GetStatus.HIT:  # gone, or replaced since the lookup (another
                    continue  # layout's value, say: not this server's to delete); a miss
                header = decode_header(p.headers[j], e.key, p.expected[j])
                if header.length != e.size:
                    raise DamagedValue(f"its header says {header.length} chunk bytes, the value has {e.size}")
                if checksum(self.arena.memoryview(e.offset, e.size)) != header.checksum:
                    raise DamagedValue("checksum mismatch: the bytes are damaged")
            except DamagedValue as exc:
                self._count("integrity_failures")
                damaged.append(l2_key(e.key))
                self._throttled.warning("damaged", f"L2 value of chunk {e.key.chunk_hash.hex()[:16]} of "
                                        f"{e.key.model_name!r} is damaged ({printable(exc)}): not loaded; deleting it "
                                        "from the store")
                continue
            except IntegrityError as exc:  # intact, but another layout's: left alone
                self._count("integrity_failures")
                unloadable.append((e.key, p.expected[j]))
                self._throttled.warning("unloadable", f"L2 value of chunk {e.key.chunk_hash.hex()[:16]} of "
                                        f"{e.key.model_name!r} is not loaded: {printable(exc)}")
                continue
            found[-1] = header.fmt
        if damaged:
            self._delete_damaged(damaged)
        if unloadable:
            self.call_soon(functools.partial(self._remember_unloadable, unloadable))
        self._checked(p, idx, found)

    def _remember_unloadable(self, keys: list[tuple[ChunkKey, str | None]]) -> None:
        """On the loop: have lookups count ``keys`` (each with the format the promotion wanted)
        as misses for :data:`_UNLOADABLE_S` seconds, while that is still the format wanted. Their
        values are another layout's (kept: they are that server's copies), so the size a lookup
        sees matches this server's layout and every promotion of them would fail again."""
        if len(self._unloadable) + len(keys) > _UNLOADABLE_KEPT:
            self._unloadable.clear()  # forget them all: each costs one failed promotion to learn again
        until = time.monotonic() + _UNLOADABLE_S
        for key, fmt in keys[:_UNLOADABLE_KEPT]:
            self._unloadable[key] = (until, fmt)

    def _delete_damaged(self, keys: list[bytes]) -> None:
        """On a store thread (a get's check): delete values that failed their checks, so that no
        lookup counts them again and the next write of their chunks is not skipped. Does not
        wait: the delete runs on the backend's threads. A failure (the store down) is a store
        error like any other, and fails no request; the value then stays until the store evicts
        it or a later promotion deletes it. Another server may have written a good value under a
        key between the get and this delete: it is deleted too, costing one later miss (the next
        store of that chunk writes it again)."""
        backend = self.backend
        if backend is None:  # closing
            return
        try:
            fut = backend.submit_delete(keys)
        except Exception as exc:  # noqa: BLE001  (StoreUnavailable, or a backend's own error: counted)
            self._failed(exc, "delete")
            return
        fut.add_done_callback(self._deleted)

    def _deleted(self, fut: Future[int]) -> None:
        """On a store thread: a delete of damaged values ended."""
        try:
            n = fut.result()
        except Exception as exc:  # noqa: BLE001  (any store failure: counted, nothing else to do)
            self._failed(exc, "delete")
            return
        self._count("damaged_deleted", n)

    def _checked(self, p: _Promotion, idx: list[int], found: list[str | None] | None) -> None:
        """One get of ``p`` is checked (``found`` None: it failed); the last one finishes ``p``."""
        with p.lock:
            if found is not None:
                for j, fmt in zip(idx, found):
                    p.found[j] = fmt
            p.left -= 1
            last = p.left == 0
        if last:
            self.call_soon(lambda: self._promoted(p))

    def _promoted(self, p: _Promotion) -> None:
        """On the loop: make the verified chunks readable, drop the others, wake the waiters
        (an abandoned promotion's chunks are dropped: its waiters were told they failed)."""
        self._running.pop(p, None)
        if p.abandoned:
            self.index.commit_write(p.res, [i for i, _ in p.res.entries])
            return
        failed = []
        for (i, e), fmt in zip(p.res.entries, p.found):
            now = self.expected_format(e.key)
            if fmt is None or (now is not None and now != fmt):
                # unverified, or its model registered again in another layout while it was read
                # (its context closed first): readable in this format, it would fail every
                # request of the new layout that names it, not count as a miss
                failed.append(i)
            else:
                e.fmt = fmt
                self._from_l2.add(e.key)
                self._unloadable.pop(e.key, None)
        self.index.commit_write(p.res, failed)
        self.promoted += len(p.res.entries) - len(failed)
        self.promote_failures += len(failed)
        self._end_waits(p)

    def _end_waits(self, p: _Promotion) -> None:
        """On the loop: ``p``'s chunks are no longer being promoted; wake their waiters."""
        for key, fut in p.done.items():
            if self.promoting.get(key) is fut:
                del self.promoting[key]
                self.promoting_changes += 1
            settle_once(fut)

    def pending(self, keys: Sequence[ChunkKey]) -> list[Future[None]]:
        """The promotions still running among ``keys`` (their futures, resolved on the loop), each
        once however often its keys are named: what a request waits for (:func:`all_settled`)."""
        promoting = self.promoting
        return list({id(f): f for f in (promoting.get(k) for k in keys) if f is not None}.values())

    # ------------------------------------------------------------------ health (its thread)

    def _health(self) -> None:
        next_stats = 0.0
        while not self._stop_health.wait(0.1):
            if self.breaker.probe_due():
                self._pings_failed = 0
                ok, err = self._probe()
                self.breaker.probed(ok, err)
                if ok:
                    log.info("L2 store %s at %s is back", self.store.name, self.url)
                    next_stats = 0.0
            elif self.breaker.closed and self.backend is not None and time.monotonic() >= next_stats:
                next_stats = time.monotonic() + _STATS_EVERY_S
                if not self._ping_store():
                    self.store_stats = {}
                    next_stats = time.monotonic() + _STATS_RETRY_S  # checked again soon
                    continue
                try:
                    self.store_stats = self._health_call("stats()", self.backend.stats)
                except PluginFault as exc:  # its data operations may work: a bug, not an outage
                    self.store_stats = {"unknown": self._shown(f"stats() failed: {exc}", 200)}  # (status says why)
                    self._throttled.warning("stats fault", self._describe(exc))
                    next_stats = time.monotonic() + _STATS_EVERY_S
                except Exception as exc:  # noqa: BLE001  (a store that cannot say its size may be gone)
                    # no stale figures; a failure like any other (soon again), so that a store that
                    # died while nothing else used it shows down within seconds, not up for ever
                    self.store_stats = {}
                    self._failed(exc, "stats")
                    next_stats = time.monotonic() + _STATS_RETRY_S

    def _health_call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` (the plugin's ``ping()`` or ``stats()``) on a thread of its own, waited for at
        most ``timeout_s`` + 1 s: the health thread never waits for a plugin that does not return
        (it would never probe, and so never bring the tier back, again). One that has not
        returned by then raises TimeoutError (logged as the plugin's fault), and the next calls
        raise at once until it has."""
        stuck = self._health_stuck
        if stuck is not None and stuck.is_alive():
            raise StoreUnavailable(f"store {self.store.name!r}: an earlier {stuck.name} has not returned")
        out: list[tuple[bool, Any]] = []

        def run() -> None:
            try:
                out.append((True, fn()))
            except BaseException as exc:  # noqa: BLE001  (handed to the health thread)
                out.append((False, exc))

        t = threading.Thread(target=run, name=what, daemon=True)
        t.start()
        limit = self.config.timeout_s + 1.0
        t.join(limit)
        if not out:
            self._health_stuck = t
            self._throttled.warning("stuck health call", f"L2 store {self.store.name}: its {what} has not returned "
                                    f"within {limit:g} s (a fault of the store plugin: ping() and stats() must "
                                    "return within --l2-timeout); it is counted as failed, and not called again "
                                    "until it has returned")
            raise TimeoutError(f"{what} did not return within {limit:g} s")
        ok, value = out[0]
        if not ok:
            raise value
        return cast(T, value)

    def _ping_store(self) -> bool:
        """The store's own health check, on the health thread while the breaker is closed (every
        5 s, and soon again after a failure). A store may answer its operations from memory while
        what it stands on is gone (fs: its directory removed), each answer resetting the
        breaker's count: so as many failed checks in a row as the breaker allows put the tier down,
        whatever else succeeds meanwhile; fewer (a store busy for a moment) are logged only."""
        backend = self.backend
        assert backend is not None
        try:
            self._health_call("ping()", backend.ping)
        except Exception as exc:  # noqa: BLE001  (whatever the plugin raised: a failed check)
            self._count("errors")
            msg = self._describe(exc)
            self._pings_failed += 1
            if self._pings_failed < self.breaker.threshold:
                self._throttled.warning("failure", f"L2 store {self.store.name}: its health check failed: {msg}")
                return False
            self._pings_failed = 0
            if self.breaker.closed:
                log.warning("L2 store %s at %s is down: its health check failed %d times in a row (last: %s); "
                            "serving from L1 and retrying with backoff", self.store.name, self.url,
                            self.breaker.threshold, msg)
            self.breaker.trip(msg)
            return False
        self._pings_failed = 0
        return True

    def _probe(self) -> tuple[bool, str]:
        if self.backend is None:
            try:
                opened = self._open_backend()
            except ConfigError as exc:  # e.g. credentials revoked while the store was away
                return False, self._shown(str(exc), CONFIG_ERROR_TEXT_MAX)
            if not opened:
                return False, self.breaker.last_error
        assert self.backend is not None
        try:
            self._health_call("ping()", self.backend.ping)
        except Exception as exc:  # noqa: BLE001  (a failed probe keeps the breaker open)
            return False, self._describe(exc)
        return True, ""

    # ------------------------------------------------------------------ status (loop thread)

    def status(self) -> TierStatus:
        b = self.breaker
        with self._cond:
            writers, held = self._live_writers, sum(1 for batch in self._batches if batch.settled)
        return TierStatus(
            name="l2",
            store=self.store.name,
            url=self.url,
            state="up" if b.closed and self.backend is not None else "down",
            detail="" if b.closed else f"retrying in {max(0.0, b.retry_at - time.monotonic()):.1f} s; {b.last_error}",
            admission=self.config.admission,
            lookups=self.lookups,
            lookup_chunks=self.lookup_chunks,
            lookup_hits=self.lookup_hits,
            timeouts=self.timeouts,
            busy_lookups=self.lookups_busy,
            promotions=self.promoted,
            promote_failures=self.promote_failures,
            promoting=len(self.promoting),
            integrity_failures=self.integrity_failures,
            damaged_deleted=self.damaged_deleted,
            writes=self.writes,
            write_bytes=self.write_bytes,
            write_skipped=self.write_skipped,
            queue_depth=self.queue_depth,
            queue_capacity=self.config.queue,
            pinned_bytes=self.pinned_bytes,
            pin_limit=self.pin_limit,
            drops=self.drops,
            writers=writers,
            writers_held=held,
            errors=self.errors,
            outages=b.opened,
            # a store that is down shows no size: the last one read is from before the outage
            store_stats=dict(self.store_stats) if b.closed and self.backend is not None else {},
        )
