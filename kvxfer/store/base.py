"""The store-backend contract: what an L2 store plugin implements, who calls it, and when.

A store plugin is an entry point in group ``kvxfer.stores`` whose target is a :class:`Store`
subclass (or instance): ``name``, ``api_version`` (refused when it differs from
:data:`STORE_API_VERSION`), ``capabilities``, ``probe()`` and ``open(url, options)``, which
returns a :class:`Backend`: one open connection to one store (a Valkey node or cluster, a
directory). They are found by the same machinery as transports and listed by ``kvxfer plugins``.

The cache server's L2 tier (:mod:`kvxfer.server.tier`) is the only caller. What it asks of a
backend is small and batched:

* ``submit_exists(keys)``: the size of each value, for many keys in one round trip (a lookup);
* ``submit_get(items)``: read values into caller-provided buffers (a promotion into the arena);
* ``submit_put(items)``: write values from caller-provided buffers (the tier's writers);
* ``submit_delete(keys)``: remove values (the tier deletes those that failed their checks);
* ``ping()`` and ``stats()`` for health and status; ``close()``.

**Values are opaque and come in parts.** The core writes a value as ``[header, chunk bytes]``
(:mod:`kvxfer.store.format`) and reads it back into ``[header buffer, arena slot]``, so a backend
moves bytes between its medium and the caller's memory with no copy of its own (scatter/gather:
``readv``/``writev``, or ``recv_into`` on a socket). A value is read only whole: when its size
differs from the parts' total the backend reports :attr:`GetStatus.WRONG_SIZE` and may leave
garbage in the parts (the core never uses them then). Keys are short ASCII byte strings made by
the core (:func:`kvxfer.store.format.l2_key`); a backend stores them as given.

**Non-blocking, with bounded waits.** Every ``submit_*`` may be called from any thread and
returns at once with a :class:`~concurrent.futures.Future`; the backend runs the operation on its
own threads. A future resolves to the result documented below or raises
:class:`~kvxfer.errors.StoreUnavailable` (unreachable, timed out after ``options.timeout_s`` of
silence, refused, out of room for now), never another exception, and never waits forever (a put
the store refuses for good, a value larger than it will ever hold, is ``False`` for that item,
not an error). Done-callbacks run on a backend thread: they must be quick and must not wait for
another operation of the same backend. A get writes into its parts only while its future is
pending, and never after; a put only reads its parts (the server passes its arena's slots
read-only), which do not change until its future is done, and the store keeps no reference to
them after that. A put replaces a value atomically: a get reads the old value or the new one,
whole. ``withdraw(fut)`` takes back an operation that has not started (optional:
the default says it cannot, and the operation runs to its end).

:class:`ThreadedBackend` builds the ``submit_*`` methods from blocking ones on a few threads
(separate ones for lookups, reads and writes, so a lookup never waits behind a bulk transfer);
both backends that ship with kvxfer use it. :class:`LoopExists` is an optional surface for
existence checks done by the server's loop thread itself (the Valkey backend has it).
"""

from __future__ import annotations

import enum
import logging
import re
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Final, Protocol, TypeVar, runtime_checkable

from kvxfer.errors import StoreUnavailable
from kvxfer.transport.contract import Probe

__all__ = [
    "PASSWORD_ENV",
    "STORE_API_VERSION",
    "Backend",
    "GetItem",
    "GetStatus",
    "LocalInstance",
    "LoopExists",
    "Probe",
    "PutItem",
    "Store",
    "StoreCapabilities",
    "StoreOptions",
    "ThreadedBackend",
    "password_apart",
    "redact_url",
    "split_hosts",
]

log = logging.getLogger(__name__)

#: The nice value of the threads that write to L2 (background_thread()).
BACKGROUND_NICE: Final = 10

#: The store contract version this core implements. A plugin declaring another is refused.
STORE_API_VERSION: Final = 1

T = TypeVar("T")


class GetStatus(enum.Enum):
    """What a get found for one key."""

    #: The value was read whole into the parts.
    HIT = "hit"
    #: No value under the key: the parts are untouched.
    MISS = "miss"
    #: A value exists but its size differs from the parts' total: nothing usable was read.
    WRONG_SIZE = "wrong_size"


#: ``(key, parts)``: read the value of ``key`` into the buffers ``parts``, in order.
GetItem = tuple[bytes, Sequence[memoryview]]
#: ``(key, parts)``: write the concatenation of ``parts`` as the value of ``key``.
PutItem = tuple[bytes, Sequence[memoryview]]


@dataclass(frozen=True, slots=True)
class StoreCapabilities:
    """What a store claims. The conformance kit tests these claims: ``shared`` by another process
    using the store at the same URL, ``persistent`` by a restart, ``max_value_bytes`` (at least
    64 MiB: a 256-token chunk of an 8B model is 32 MiB) with a value that large, up to 64 MiB."""

    #: Several kvxfer servers on several hosts can share one store (Valkey: yes; a local directory: no).
    shared: bool
    #: Values outlive the kvxfer server that wrote them (its restart finds them).
    persistent: bool
    #: The largest value it accepts, in bytes.
    max_value_bytes: int = 512 << 20


@dataclass(frozen=True, slots=True)
class StoreOptions:
    """What the server passes to :meth:`Store.open` besides the URL."""

    #: Longest wait of a lookup (``exists``), a delete or a ping for the store (seconds).
    timeout_s: float = 0.5
    #: Longest silence while a get or put moves values (seconds): a loaded store serving several
    #: large values at once may pause one connection for a while without being down.
    bulk_timeout_s: float = 10.0
    #: Threads (and connections) for gets, and for puts.
    read_workers: int = 2
    write_workers: int = 2


class Backend(ABC):
    """One open store. Made by :meth:`Store.open`; closed by the server at shutdown."""

    @abstractmethod
    def submit_exists(self, keys: Sequence[bytes]) -> Future[list[int]]:
        """Size in bytes of each key's value, 0 where there is none, in ``keys`` order, in one
        round trip to the store (per node of a cluster) however many keys there are."""

    @abstractmethod
    def submit_get(self, items: Sequence[GetItem]) -> Future[list[GetStatus]]:
        """Read each item's value into its parts; one :class:`GetStatus` per item, in order."""

    @abstractmethod
    def submit_put(self, items: Sequence[PutItem]) -> Future[list[bool]]:
        """Write each item's value (replacing any old one, atomically: a reader sees the old
        value or the new one, whole); per item True, or False when the store refused it for
        lack of room that it will not make (e.g. a value larger than its budget)."""

    @abstractmethod
    def submit_delete(self, keys: Sequence[bytes]) -> Future[int]:
        """Delete the keys; resolves to how many existed."""

    def withdraw(self, fut: Future[Any]) -> bool:
        """Withdraw the operation this backend returned ``fut`` for, if it has not started: True
        only if it never will (a get never writes into its parts) and ``fut`` is cancelled; False
        if it started or ended, or the backend cannot tell (the default), and then it runs to its
        end as ever. The tier calls it from its loop for the gets of a promotion it gave up (so
        that those queued behind a stuck one free their arena slots at once); it must return at
        once."""
        return False

    @abstractmethod
    def ping(self) -> None:
        """One round trip to the store (the server's health check, off its loop thread).
        Blocks at most ``timeout_s``; raises :class:`~kvxfer.errors.StoreUnavailable`."""

    def stats(self) -> dict[str, str]:
        """Figures for ``kvxfer status`` (e.g. bytes used, values, nodes); may block up to
        ``timeout_s``, called off the loop thread every few seconds. Raises
        :class:`~kvxfer.errors.StoreUnavailable` when the store cannot answer."""
        return {}

    @abstractmethod
    def close(self) -> None:
        """Release connections and threads, returning once every operation submitted before it
        has ended (its future done: a result, or StoreUnavailable) and its connections and threads
        are gone. Idempotent; every ``submit_*`` raises
        :class:`~kvxfer.errors.StoreUnavailable` afterwards."""


class Store(ABC):
    """The object an entry point in ``kvxfer.stores`` names (a subclass or an instance).

    ``name`` equals the entry point name (what users pass to ``kvxfer serve --l2``);
    ``api_version`` must equal :data:`STORE_API_VERSION`; ``url_schemes`` lists the URL schemes
    it opens (the message for a missing ``--l2-url`` names them); ``capabilities`` states what it
    claims.
    """

    name: ClassVar[str]
    api_version: ClassVar[int]
    capabilities: ClassVar[StoreCapabilities]
    url_schemes: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def probe(self) -> Probe:
        """Can this store's client run in this process? Cheap, never raises, contacts nothing."""

    @abstractmethod
    def open(self, url: str, options: StoreOptions) -> Backend:
        """Connect to the store at ``url`` and return a :class:`Backend`. Called once per server,
        at start, off any loop. Raise :class:`~kvxfer.errors.ConfigError` for a URL it cannot
        use (the message says what a valid one looks like) and
        :class:`~kvxfer.errors.StoreUnavailable` when the store does not answer (the server
        then starts with L2 down and keeps retrying)."""

    def redact(self, url: str) -> str:
        """``url`` as logs and status show it: secrets (passwords) removed."""
        return redact_url(url)


@runtime_checkable
class LocalInstance(Protocol):
    """Optional: a store that can start a throwaway instance of itself on this machine (the
    demo and the conformance kit use it when given no URL)."""

    def local_instance(self, directory: Path) -> AbstractContextManager[str]:
        """A context manager that starts a private instance (its files under ``directory``),
        yields its URL, and stops it on exit. Private: a network store listening where other
        local users reach it (127.0.0.1) takes a password, in the URL's user info (the demo
        hands it to its servers as ``$KVXFER_L2_PASSWORD``, off their command lines)."""
        ...


@runtime_checkable
class LoopExists(Protocol):
    """Optional: existence checks that the server's loop thread sends and reads itself, with no
    thread hand-off (a lookup then costs about one round trip more than an L1 lookup).

    Every method runs on the loop thread and never blocks. The backend keeps connections for it
    (e.g. one per node of a cluster); the loop polls their descriptors (:meth:`loop_fds`) with
    its own sockets and calls :meth:`on_readable` for each readable one. A backend that cannot
    now (a connection missing or failed, TLS) answers False and the server uses
    :meth:`Backend.submit_exists`.

    The server counts a check's keys against its bound on keys at the store until its ``done``
    is called, also after the lookup timed out: a check must end (answered, or its connection
    dropped) in bounded time, even when no new check is sent. The loop calls :meth:`loop_fds` on
    each of its periodic passes (about 4 a second), where a backend can drop a connection that
    went silent.
    """

    def loop_fds(self) -> Sequence[int]:
        """The descriptors of the healthy loop connections (the same object while they do not
        change: the loop compares it with the last one it saw). Called on each periodic pass of
        the loop too: a connection that went silent with checks unanswered may be dropped here
        (their ``done`` called with None)."""
        ...

    def exists_nowait(self, keys: Sequence[bytes], done: Callable[[list[int] | None], None]) -> bool:
        """Send an existence check of ``keys`` (sizes, 0 where absent) without blocking. ``done``
        is called on the loop, from :meth:`on_readable`, with the sizes, or with None if a
        connection failed, or with ``[]`` (no hits, not a failure) when a check going to several
        connections could be sent on some only (either possibly before this returns). Returns
        False (and never calls ``done``) when it cannot send now: the check then goes through
        :meth:`Backend.submit_exists`."""
        ...

    def on_readable(self, fd: int) -> None:
        """Read what the loop connection ``fd`` has (never blocking) and call ``done`` of every
        check that is complete. A connection that failed leaves :meth:`loop_fds`."""
        ...

    def drop_loop_fd(self, fd: int) -> None:
        """Close an old loop connection, after the caller stopped polling ``fd``."""
        ...


def background_thread() -> None:
    """Lower the calling thread's CPU priority to nice 10: writes to L2 are off the request's
    path and should not take cores from it on a host short of them, yet not starve next to busy
    neighbours either (against one busy thread at nice 0, a nice-10 thread gets about a tenth of
    a core, a nice-19 one about 1.5%). Linux only; elsewhere, and when refused, it does nothing."""
    import os

    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):
        pass


#: A query option whose name (decoded) says it carries a secret: ``password``, ``ssl_password``, ...
_SECRET_OPTION: Final = re.compile(r"(?i)password|passwd|secret|token")
#: What URL parsers drop from a URL before they read it (urllib's rule, the clients' too).
_URL_BLANKS: Final = str.maketrans("", "", "\t\r\n")


#: Where ``kvxfer serve`` takes a store's password from, for every host of ``--l2-url`` that
#: names none: a command line is there for every local user to read, an environment is not.
PASSWORD_ENV: Final = "KVXFER_L2_PASSWORD"


def password_apart(url: str) -> tuple[str, dict[str, str]]:
    """``url`` without the password of its user info, and the environment that gives that
    password to ``kvxfer serve`` (:data:`PASSWORD_ENV`; empty when there is none)."""
    from urllib.parse import unquote, urlsplit, urlunsplit

    s = urlsplit(url)
    if s.password is None:
        return url, {}
    user, _, host = s.netloc.rpartition("@")
    name = user.partition(":")[0]
    netloc = f"{name}@{host}" if name else host
    return urlunsplit((s.scheme, netloc, s.path, s.query, s.fragment)), {PASSWORD_ENV: unquote(s.password)}


def split_hosts(url: str) -> list[str]:
    """The comma-separated parts of a store URL, ``scheme://[USER[:PASSWORD]@]HOST[,HOST2...][?OPTIONS]``
    (each later part a host, or a URL of its own): split at the commas between the first URL's
    user info and the options only. The user info may hold commas (RFC 3986 allows them there,
    unescaped), and so may an option's value (``ssl_ciphers=A,B``); the options stay with the last
    part."""
    start = url.find("://")
    start = start + 3 if start >= 0 else 0
    ends = [i for i in (url.find(c, start) for c in "/?#") if i >= 0]
    at = url.rfind("@", start, min(ends, default=len(url)))
    rest = url[at + 1:]
    opts = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    parts = rest[:opts].split(",")
    parts[0] = url[:at + 1] + parts[0]
    parts[-1] += rest[opts:]
    return parts


def redact_url(url: str) -> str:
    """``url`` with every secret replaced by ``***``: the password of its user info and the value
    of any query option named like one (``?password=``, ``ssl_password=``, names decoded as the
    clients decode them), for every host of a comma-separated list (those without a scheme too:
    they inherit the first one's); the rest as written (hosts, IPv6 brackets, ports, a plain path)."""
    out = []
    for head, start, end, user_info, host, sep, query in _url_parts(url):
        if ":" in user_info:
            head = f"{head[:start]}{user_info.partition(':')[0]}:***@{host}{head[end:]}"
        options = []
        for option in query.split("&") if query else ():  # as parse_qs splits them
            name, eq, _ = option.partition("=")
            options.append(f"{name}=***" if eq and _secret_option(name) else option)
        out.append(head + sep + "&".join(options))
    return ",".join(out)


def url_secrets(url: str) -> list[str]:
    """The secrets :func:`redact_url` hides in ``url`` (passwords of user info, values of options
    named like one), each as written and as decoded, longest first: to take out of any text that
    may quote them (an error's text, which a node may have echoed them into)."""
    from urllib.parse import unquote, unquote_plus

    found: set[str] = set()
    for _, _, _, user_info, _, _, query in _url_parts(url):
        if ":" in user_info:
            password = user_info.partition(":")[2]
            found |= {password, unquote(password)}
        for option in query.split("&") if query else ():
            name, eq, value = option.partition("=")
            if eq and _secret_option(name):
                found |= {value, unquote_plus(value)}
    return sorted(found - {""}, key=lambda s: (-len(s), s))


def _secret_option(name: str) -> bool:
    from urllib.parse import unquote_plus

    return _SECRET_OPTION.search(unquote_plus(name)) is not None  # names decoded as the clients decode them


def _url_parts(url: str) -> Iterator[tuple[str, int, int, str, str, str, str]]:
    """Per host part of ``url`` (:func:`split_hosts`): its head (before ``?``), where its
    authority starts and ends in the head, its user info ("" without one) and the rest of the
    authority, and the ``?`` and the options."""
    for part in split_hosts(url.translate(_URL_BLANKS)):
        head, sep, query = part.partition("?")
        scheme = head.find("://")
        start = scheme + 3 if scheme >= 0 else 2 if head.startswith("//") else 0
        end = head.find("/", start)
        end = len(head) if end < 0 else end
        user_info, _, host = head[start:end].rpartition("@")
        yield head, start, end, user_info, host, sep, query


class ThreadedBackend(Backend):
    """A :class:`Backend` whose ``submit_*`` run blocking methods on the backend's threads.

    Subclasses implement :meth:`exists`, :meth:`get`, :meth:`put` and :meth:`delete` (blocking:
    ``exists`` and ``delete`` each bounded by ``options.timeout_s``, ``get`` and ``put`` by
    ``options.bulk_timeout_s`` of silence), plus ``ping``; they may raise
    anything: whatever is not a :class:`~kvxfer.errors.StoreUnavailable` is wrapped in one naming
    the store. Lookups and deletes run on a control thread pool, gets on ``read_workers``
    threads and puts on ``write_workers`` threads.
    """

    def __init__(self, store_name: str, options: StoreOptions) -> None:
        self.store_name = store_name
        self.options = options
        #: The futures this class' pools made: only those are withdrawn by cancelling them (a
        #: subclass' own future may be cancelled while its work runs on and writes)
        self._own: weakref.WeakSet[Future[Any]] = weakref.WeakSet()
        self._closed = False
        self._close_lock = threading.Lock()
        self._control = ThreadPoolExecutor(2, thread_name_prefix=f"kvxfer-l2-{store_name}-ctl")
        self._read = ThreadPoolExecutor(max(1, options.read_workers), thread_name_prefix=f"kvxfer-l2-{store_name}-rd")
        self._write = ThreadPoolExecutor(max(1, options.write_workers), thread_name_prefix=f"kvxfer-l2-{store_name}-wr",
                                         initializer=background_thread)

    # ------------------------------------------------------------------ blocking, for subclasses

    @abstractmethod
    def exists(self, keys: Sequence[bytes]) -> list[int]:
        """Blocking :meth:`submit_exists`."""

    @abstractmethod
    def get(self, items: Sequence[GetItem]) -> list[GetStatus]:
        """Blocking :meth:`submit_get`."""

    @abstractmethod
    def put(self, items: Sequence[PutItem]) -> list[bool]:
        """Blocking :meth:`submit_put`."""

    @abstractmethod
    def delete(self, keys: Sequence[bytes]) -> int:
        """Blocking :meth:`submit_delete`."""

    def close_connections(self) -> None:
        """Release the subclass' connections and files (after every operation ended)."""

    # ------------------------------------------------------------------ the contract

    def submit_exists(self, keys: Sequence[bytes]) -> Future[list[int]]:
        keys = list(keys)
        return self._submit(self._control, "exists", lambda: self.exists(keys))

    def submit_get(self, items: Sequence[GetItem]) -> Future[list[GetStatus]]:
        items = list(items)
        return self._submit(self._read, "get", lambda: self.get(items))

    def submit_put(self, items: Sequence[PutItem]) -> Future[list[bool]]:
        items = list(items)
        return self._submit(self._write, "put", lambda: self.put(items))

    def submit_delete(self, keys: Sequence[bytes]) -> Future[int]:
        keys = list(keys)
        return self._submit(self._control, "delete", lambda: self.delete(keys))

    def withdraw(self, fut: Future[Any]) -> bool:
        """An operation still queued on this class' threads is cancelled there: it never runs.
        Any other future (a subclass' own ``submit_*``) is not withdrawn: cancelling a future
        stops no work that already runs elsewhere (an asyncio task's, another pool's)."""
        return fut in self._own and fut.cancel()

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        for ex in (self._control, self._read, self._write):
            ex.shutdown(wait=True)
        self.close_connections()

    def _submit(self, executor: ThreadPoolExecutor, what: str, fn: Callable[[], T]) -> Future[T]:
        if self._closed:
            raise StoreUnavailable(f"store {self.store_name!r} is closed")
        try:
            fut = executor.submit(self._guard, what, fn)
        except RuntimeError:  # shut down between the check and the submit
            raise StoreUnavailable(f"store {self.store_name!r} is closed") from None
        self._own.add(fut)
        return fut

    def _guard(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except StoreUnavailable:
            raise
        except Exception as exc:
            log.debug("store %s: %s failed", self.store_name, what, exc_info=True)
            raise StoreUnavailable(f"store {self.store_name!r}: {what} failed: {type(exc).__name__}: {exc}") from exc
