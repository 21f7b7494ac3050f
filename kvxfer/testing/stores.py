"""The store-backend conformance kit: one umbrella class, :class:`StoreConformance`.

A store backend proves it keeps the contract of :mod:`kvxfer.store` by subclassing it::

    from kvxfer.testing import StoreConformance

    class TestMyStore(StoreConformance):
        store = "my_store"            # entry-point name in kvxfer.stores

        @pytest.fixture(scope="class")
        @classmethod
        def store_url(cls):           # optional: where a store to test is
            return "my://127.0.0.1:1234"

Without a ``store_url`` fixture the kit takes ``--kvxfer-store-url``, or starts a private
instance through the store's optional ``local_instance()`` (:class:`kvxfer.store.LocalInstance`).
Or, for any installed store: ``pytest --kvxfer-store=NAME [--kvxfer-store-url=URL] --pyargs
kvxfer.testing.store_suite``.

The kit tests the backend directly (batched existence checks, gets into caller buffers in parts,
puts from them, sizes that do not match, deletes, large values, threads, close) and through a
real ``kvxfer serve --l2 NAME`` (chunks stored through the reference transport come back byte
for byte after L1 is cleared and after a server restart; a damaged value is reported missing,
never loaded). Like the transport kit, it refuses subclasses that override or silence its tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, ClassVar, Final

import pytest
import torch

from kvxfer.client import CacheClient
from kvxfer.errors import StoreBroken, StoreNotFound, StoreUnavailable
from kvxfer.layout import LayoutKind
from kvxfer.store import (
    Backend,
    GetStatus,
    LocalInstance,
    Store,
    StoreCapabilities,
    StoreOptions,
    password_apart,
    redact_url,
)
from kvxfer.store.format import HEADER_SIZE
from kvxfer.store.guard import close_within
from kvxfer.store.registry import get_store
from kvxfer.testing.conformance import guard_test, refuse_overrides
from kvxfer.testing.kvdata import KVSpec, as_bytes, get_chunks, make_kv
from kvxfer.testing.plugin import not_here
from kvxfer.testing.server import ServerProcess
from kvxfer.transport.registry import run_probe

__all__ = ["StoreConformance"]

#: What a subclass may set (besides defining a ``store_url`` fixture).
CONFIGURABLE: Final = frozenset({"store", "store_url"})
#: Seconds any single operation of the kit may take.
TIMEOUT: Final = 30.0
#: The largest value the kit round-trips (a store claims at least this much: max_value_bytes).
LARGE_VALUE: Final = 64 << 20
CHUNK_SIZE: Final = 32
#: Seconds a submit may take to return (it must return at once).
SUBMIT_S: Final = 2.0
#: Seconds after a get's future is done when its parts are read again (nothing may write them).
LATE_S: Final = 0.3
#: Every key the kit has written to (or may have: a server's L2 writes), deleted after each class.
_MADE: list[bytes] = []


def _parts(data: bytes | bytearray, cut: int = HEADER_SIZE) -> list[memoryview]:
    mv = memoryview(data)
    return [mv[:cut], mv[cut:]]


class StoreConformance:
    """Every conformance test of kvxfer's store kit. Subclass it; set ``store``; optionally
    define a class-scoped ``store_url`` fixture; do not override the kit's tests."""

    #: Entry-point name of the store under test; None takes ``--kvxfer-store``.
    store: ClassVar[str | None] = None
    kit_names: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        refuse_overrides(cls, StoreConformance, CONFIGURABLE, "store", "(Store.capabilities)")

    @pytest.fixture(autouse=True)
    def _kit_guard(self, request: pytest.FixtureRequest) -> Iterator[None]:
        guard_test(request, StoreConformance)
        yield

    # ------------------------------------------------------------------ fixtures

    @pytest.fixture(scope="class")
    @classmethod
    def kit_store(cls, request: pytest.FixtureRequest) -> Store:
        """The store plugin under test, loaded; skips with its probe's reason when it cannot run."""
        name = getattr(request.cls, "store", None) or request.config.getoption("kvxfer_store", None)
        if not name:
            pytest.fail("store conformance kit: no store under test: set `store = \"NAME\"` on the class or pass "
                        "--kvxfer-store=NAME", pytrace=False)  # a usage error: skipping every test would pass the kit
        try:
            store = get_store(name, require_available=False)
        except (StoreNotFound, StoreBroken) as exc:
            pytest.fail(f"store conformance kit: {exc}", pytrace=False)
        probe, faulty = run_probe(store)
        if faulty:  # a probe that raises, or returns something else, breaks the contract: say so once
            pytest.fail(f"store conformance kit: store {name!r}: {probe.reason}; a probe never raises and returns "
                        "a Probe: Probe(False, reason) where the store cannot run", pytrace=False)
        if not probe.available:
            not_here(request.config, f"store {name!r} cannot run here: {probe.reason}")
        return store

    @pytest.fixture(scope="class")
    @classmethod
    def store_url(cls, request: pytest.FixtureRequest, kit_store: Store,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
        """Where the store under test is: ``--kvxfer-store-url``, else a private local instance."""
        url = request.config.getoption("kvxfer_store_url", None)
        if url:
            yield url
            return
        if not isinstance(kit_store, LocalInstance):  # nothing to test: a failure, not a skip that reads as a pass
            pytest.fail(f"store conformance kit: store {kit_store.name!r} has no local_instance(): pass "
                        "--kvxfer-store-url=URL or define a store_url fixture", pytrace=False)
        with kit_store.local_instance(tmp_path_factory.mktemp(f"kit-{kit_store.name}")) as url:
            yield url

    @pytest.fixture
    def kit_backend(self, kit_store: Store, store_url: str) -> Iterator[Backend]:
        backend = kit_store.open(store_url, StoreOptions(timeout_s=5.0))
        try:
            yield backend
        finally:
            _close_within(backend, TIMEOUT)

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def kit_cleanup(cls, kit_store: Store, store_url: str) -> Iterator[None]:
        """After the class's tests, delete the keys they wrote: a store given by URL may be a
        shared one, and is left as it was (best effort, bounded: the test results stand)."""
        start = len(_MADE)
        yield
        keys, _MADE[start:] = _MADE[start:], []
        if not keys:
            return
        try:
            backend = kit_store.open(store_url, StoreOptions(timeout_s=5.0))
        except Exception:  # noqa: BLE001  (the store's own failures are the tests')
            return
        try:
            for i in range(0, len(keys), 256):
                backend.submit_delete(keys[i:i + 256]).result(TIMEOUT)
        except Exception:  # noqa: BLE001
            pass
        finally:
            close_within(backend, TIMEOUT)

    @staticmethod
    def kit_keys(n: int) -> list[bytes]:
        """``n`` new keys (deleted from the store after the class's tests)."""
        prefix = f"kvxfer:kit:{uuid.uuid4().hex}:".encode()
        keys = [prefix + b"%d" % i for i in range(n)]
        _MADE.extend(keys)
        return keys

    # ------------------------------------------------------------------ the plugin

    def test_kit_plugin_declares_the_contract(self, kit_store: Store) -> None:
        from kvxfer.store import STORE_API_VERSION

        assert kit_store.api_version == STORE_API_VERSION
        assert isinstance(kit_store.capabilities, StoreCapabilities)
        assert kit_store.capabilities.max_value_bytes >= LARGE_VALUE, "a store must hold at least 64 MiB values"
        assert kit_store.probe().available
        assert "secret" not in kit_store.redact("x://user:secret@host:1")

    def test_kit_ping_and_stats(self, kit_backend: Backend) -> None:
        """The server pings an open store for its health, and shows its ``stats()`` in status:
        strings to strings, at most 64 of them (more are cut)."""
        rule = "it must return within StoreOptions.timeout_s (5 s here)"
        _within(kit_backend.ping, 6.0, "ping()", rule)
        stats = _within(kit_backend.stats, 6.0, "stats()", rule)
        assert isinstance(stats, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in stats.items()), \
            f"stats() must return a dict of str to str, got {stats!r:.200}"

    # ------------------------------------------------------------------ the backend

    def test_kit_absent_keys_have_size_zero_and_get_as_miss(self, kit_backend: Backend) -> None:
        keys = self.kit_keys(3)
        assert kit_backend.submit_exists(keys).result(TIMEOUT) == [0, 0, 0]
        buf = bytearray(b"\xaa" * (HEADER_SIZE + 300))
        assert kit_backend.submit_get([(keys[0], _parts(buf))]).result(TIMEOUT) == [GetStatus.MISS]
        _unchanged(buf, b"\xaa" * len(buf), "a get of an absent key wrote into its parts (a miss leaves them as they "
                   "were)")

    def test_kit_put_then_get_into_parts_exactly(self, kit_backend: Backend) -> None:
        """Values put from two parts come back whole into two parts. A put only reads its parts
        (here writable buffers, which must be as they were once it is done: the server's are the
        arena's slots of chunks being loaded); a get writes into its parts only until its future
        is done (they are read again later: the server's are slots that other chunks take)."""
        keys = self.kit_keys(5)
        values = [os.urandom(HEADER_SIZE + 1000 * (i + 1)) for i in range(5)]
        sent = [bytearray(v) for v in values]
        assert kit_backend.submit_put([(k, _parts(v)) for k, v in zip(keys, sent)]).result(TIMEOUT) == [True] * 5
        for i, (b, v) in enumerate(zip(sent, values)):
            _unchanged(b, v, f"the parts of put {i} of 5 were written into: a put only reads its parts")
        assert kit_backend.submit_exists(keys).result(TIMEOUT) == [len(v) for v in values]
        bufs = [bytearray(len(v)) for v in values]
        items = [(k, [memoryview(b)[:HEADER_SIZE], memoryview(b)[HEADER_SIZE:]]) for k, b in zip(keys, bufs)]
        assert kit_backend.submit_get(items).result(TIMEOUT) == [GetStatus.HIT] * 5
        for i, (b, v) in enumerate(zip(bufs, values)):
            _same(b, v, f"value {i} of 5, read into two parts")
        for b in bufs:  # the slots now hold other chunks: nothing of the gets may land there any more
            b[:] = b"\x55" * len(b)
        for b in sent:  # nor may a later get be answered from the parts of the puts (slots reused too)
            b[:] = b"\x66" * len(b)
        time.sleep(LATE_S)
        for i, b in enumerate(bufs):
            _unchanged(b, b"\x55" * len(b), f"get {i} of 5 wrote into its parts after its future was done")
        again = [bytearray(len(v)) for v in values]
        assert kit_backend.submit_get([(k, _parts(b)) for k, b in zip(keys, again)]).result(TIMEOUT) == \
            [GetStatus.HIT] * 5
        for i, (b, v) in enumerate(zip(again, values)):
            _same(b, v, f"value {i} of 5, read after the parts it was put from changed (a put's parts are its "
                  "caller's again once the put is done: the store keeps its own copy)")

    def test_kit_exists_answers_many_keys_in_one_call(self, kit_backend: Backend) -> None:
        keys = self.kit_keys(64)
        kit_backend.submit_put([(k, [memoryview(b"v" * (i + 1))]) for i, k in enumerate(keys) if i % 2]).result(TIMEOUT)
        sizes = kit_backend.submit_exists(keys).result(TIMEOUT)
        assert sizes == [(i + 1) if i % 2 else 0 for i in range(64)]

    def test_kit_wrong_size_is_reported_and_the_backend_keeps_working(self, kit_backend: Backend) -> None:
        k1, k2 = self.kit_keys(2)
        v1, v2 = os.urandom(5000), os.urandom(3000)
        kit_backend.submit_put([(k1, [memoryview(v1)]), (k2, [memoryview(v2)])]).result(TIMEOUT)
        short, right = bytearray(4999), bytearray(3000)
        got = kit_backend.submit_get([(k1, [memoryview(short)]), (k2, [memoryview(right)])]).result(TIMEOUT)
        assert got == [GetStatus.WRONG_SIZE, GetStatus.HIT]
        _same(right, v2, "the value after a wrong-size one (it must not be disturbed)")
        longer = bytearray(5001)  # a value is read only whole: parts with room to spare are a wrong size too
        assert kit_backend.submit_get([(k1, _parts(longer))]).result(TIMEOUT) == [GetStatus.WRONG_SIZE], \
            "a get into parts one byte longer than the value must be WRONG_SIZE (a value is read only whole)"
        again = bytearray(5000)
        assert kit_backend.submit_get([(k1, [memoryview(again)])]).result(TIMEOUT) == [GetStatus.HIT]
        _same(again, v1, "a value read again after a wrong-size get")

    def test_kit_overwrite_replaces_the_value_whole(self, kit_backend: Backend) -> None:
        """A put replaces a value that was read before (the same size: nothing cached from the
        read may answer the next get), then with one of another size."""
        (key,) = self.kit_keys(1)
        for fill in (b"a", b"c"):
            kit_backend.submit_put([(key, [memoryview(fill * 4096)])]).result(TIMEOUT)
            buf = bytearray(4096)
            assert kit_backend.submit_get([(key, [memoryview(buf)])]).result(TIMEOUT) == [GetStatus.HIT]
            _same(buf, fill * 4096, "a value read after a put replaced one of the same size that had been read")
        kit_backend.submit_put([(key, [memoryview(b"b" * 100)])]).result(TIMEOUT)
        assert kit_backend.submit_exists([key]).result(TIMEOUT) == [100]
        buf = bytearray(100)
        assert kit_backend.submit_get([(key, [memoryview(buf)])]).result(TIMEOUT) == [GetStatus.HIT]
        _same(buf, b"b" * 100, "an overwritten value")

    def test_kit_delete_removes_values(self, kit_store: Store, kit_backend: Backend, store_url: str) -> None:
        """A deleted value is gone for existence checks and gets (a get of it is a miss that leaves
        its parts as they were) and, where ``persistent``, for a backend opened afterwards."""
        keys = self.kit_keys(3)
        kit_backend.submit_put([(k, [memoryview(b"x" * 100)]) for k in keys[:2]]).result(TIMEOUT)
        assert kit_backend.submit_delete(keys).result(TIMEOUT) == 2
        assert kit_backend.submit_exists(keys).result(TIMEOUT) == [0, 0, 0]
        buf = bytearray(b"\xaa" * 100)
        assert kit_backend.submit_get([(keys[0], [memoryview(buf)])]).result(TIMEOUT) == [GetStatus.MISS], \
            "a get of a deleted value must be a miss"
        _unchanged(buf, b"\xaa" * 100, "a get of a deleted value wrote into its parts")
        if kit_store.capabilities.persistent:
            _close_within(kit_backend, TIMEOUT)  # (a store may be held by one backend at a time: fs is)
            later = kit_store.open(store_url, StoreOptions(timeout_s=5.0))
            try:
                assert later.submit_exists(keys[:2]).result(TIMEOUT) == [0, 0], \
                    "a deleted value came back for a backend opened afterwards"
            finally:
                _close_within(later, TIMEOUT)

    def test_kit_a_value_read_while_it_is_replaced_is_whole(self, kit_backend: Backend) -> None:
        """A put replaces a value atomically: gets of it while puts replace it, over and over,
        read the old value or the new one, whole, never a mix (for about a second)."""
        (key,) = self.kit_keys(1)
        values = [bytes([c]) * (2 << 20) for c in b"ab"]
        assert kit_backend.submit_put([(key, _parts(values[0]))]).result(TIMEOUT) == [True]
        stop = threading.Event()
        errors: list[BaseException] = []

        def replace() -> None:
            try:
                i = 0
                while not stop.is_set():
                    i ^= 1
                    kit_backend.submit_put([(key, _parts(values[i]))]).result(TIMEOUT)
            except BaseException as exc:  # noqa: BLE001  (reported by the test's thread)
                errors.append(exc)

        writer = threading.Thread(target=replace, name="kit-replace")
        writer.start()
        torn = reads = 0
        buf = bytearray(len(values[0]))
        try:
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline or reads < 8:
                if kit_backend.submit_get([(key, _parts(buf))]).result(TIMEOUT) == [GetStatus.HIT]:
                    reads += 1
                    torn += buf != values[0] and buf != values[1]
        finally:
            stop.set()
            writer.join(TIMEOUT)
        assert not errors, errors[0]
        assert not torn, (f"{torn} of {reads} gets read a value that was neither the old one nor the new one whole: "
                          "a put must replace a value atomically")

    def test_kit_large_value_round_trips(self, kit_store: Store, kit_backend: Backend) -> None:
        """A value as large as the store claims to hold (``max_value_bytes``), up to 64 MiB: a
        2,048-token chunk of a 70B model is 10 MiB, of an 8B one 64 MiB at 512 tokens."""
        (key,) = self.kit_keys(1)
        value = os.urandom(min(kit_store.capabilities.max_value_bytes, LARGE_VALUE))
        assert kit_backend.submit_put([(key, _parts(value))]).result(TIMEOUT) == [True]
        buf = bytearray(len(value))
        assert kit_backend.submit_get([(key, _parts(buf))]).result(TIMEOUT) == [GetStatus.HIT]
        _same(buf, value, f"a value of {len(value)} bytes (max_value_bytes, at most 64 MiB)")
        kit_backend.submit_delete([key]).result(TIMEOUT)

    def test_kit_withdraw_takes_back_only_what_has_not_started(self, kit_backend: Backend) -> None:
        """``withdraw``: a get it takes back (True) is cancelled and never writes into its parts;
        one it does not take back runs whole. Sixteen gets of 1 MiB are queued, then withdrawn
        (a backend that never withdraws passes too); a get that ended is never taken back."""
        (key,) = self.kit_keys(1)
        value = os.urandom(1 << 20)
        assert kit_backend.submit_put([(key, _parts(value))]).result(TIMEOUT) == [True]
        bufs = [bytearray(b"\xaa" * len(value)) for _ in range(16)]
        futs = [kit_backend.submit_get([(key, _parts(b))]) for b in bufs]
        withdrawn = [kit_backend.withdraw(f) for f in futs]
        for i, (fut, took, buf) in enumerate(zip(futs, withdrawn, bufs)):
            if took:
                assert fut.cancelled(), f"get {i} was withdrawn, but its future is not cancelled"
            else:
                assert fut.result(TIMEOUT) == [GetStatus.HIT], f"get {i}, not withdrawn, must run whole"
                _same(buf, value, f"get {i}, not withdrawn")
        for f in futs:  # every get that was not withdrawn has ended: none may write any more
            if not f.cancelled():
                f.result(TIMEOUT)
        time.sleep(LATE_S)  # a withdrawn get whose work ran on regardless writes late
        for i, (took, buf) in enumerate(zip(withdrawn, bufs)):
            if took:
                assert buf == b"\xaa" * len(value), f"get {i} was withdrawn, yet wrote into its parts"
            else:
                _unchanged(buf, value, f"get {i} wrote into its parts after its future was done")
        done = kit_backend.submit_get([(key, [memoryview(bytearray(len(value)))])])
        assert done.result(TIMEOUT) == [GetStatus.HIT]
        assert kit_backend.withdraw(done) is False and done.result() == [GetStatus.HIT], "an ended get is kept"
        kit_backend.submit_delete([key]).result(TIMEOUT)

    def test_kit_operations_from_many_threads(self, kit_backend: Backend) -> None:
        errors: list[BaseException] = []

        def worker(n: int) -> None:
            try:
                keys = self.kit_keys(4)
                values = [os.urandom(2000 + n) for _ in keys]
                kit_backend.submit_put([(k, [memoryview(v)]) for k, v in zip(keys, values)]).result(TIMEOUT)
                bufs = [bytearray(len(v)) for v in values]
                st = kit_backend.submit_get([(k, [memoryview(b)]) for k, b in zip(keys, bufs)]).result(TIMEOUT)
                assert st == [GetStatus.HIT] * 4 and [bytes(b) for b in bufs] == values
            except BaseException as exc:  # noqa: BLE001  (reported by the test's thread)
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert not errors, errors[0]

    def test_kit_submits_and_health_calls_return_in_time(self, kit_backend: Backend) -> None:
        """Every ``submit_*`` returns at once (the server calls them on its loop thread and on its
        writers: one that blocks holds every client); ``ping()`` and ``stats()`` return within
        ``timeout_s`` (the server's health thread gives up on them after that)."""
        (key,) = self.kit_keys(1)
        buf = bytearray(8)
        for what, call in (("submit_put", lambda: kit_backend.submit_put([(key, [memoryview(b"12345678")])])),
                           ("submit_exists", lambda: kit_backend.submit_exists([key])),
                           ("submit_get", lambda: kit_backend.submit_get([(key, [memoryview(buf)])])),
                           ("submit_delete", lambda: kit_backend.submit_delete([key]))):
            fut = _within(call, SUBMIT_S, what, "submits must return at once, running the operation on the backend's "
                          "own threads")
            _within(lambda f=fut: f.result(TIMEOUT), TIMEOUT, f"the future of {what}", "an operation must end within "
                    "StoreOptions.timeout_s (bulk_timeout_s of silence for gets and puts)")
        for what in ("ping", "stats"):
            _within(getattr(kit_backend, what), 5.0 + 1.0, f"{what}()", "it must return within StoreOptions.timeout_s "
                    "(5 s here)")

    def test_kit_leaves_no_thread_or_descriptor_behind(self, kit_store: Store, store_url: str) -> None:
        """A backend's threads and descriptors are gone once ``close()`` returned (after a first
        open and close, so that what a library makes once for the process is not counted): one
        per operation would grow the server by a thread or a socket for every chunk it writes."""
        kept: list[Backend] = []  # the server holds its backend until it exits: only close() may end its threads

        def work() -> None:
            backend = kit_store.open(store_url, StoreOptions(timeout_s=5.0))
            kept.append(backend)
            try:
                keys = self.kit_keys(40)
                for k in keys:
                    backend.submit_put([(k, [memoryview(b"x" * 64)])]).result(TIMEOUT)
                    backend.submit_get([(k, [memoryview(bytearray(64))])]).result(TIMEOUT)
                backend.submit_exists(keys).result(TIMEOUT)
                backend.submit_delete(keys).result(TIMEOUT)
            finally:
                _close_within(backend, TIMEOUT)

        work()
        threads, fds = threading.active_count(), _open_fds()
        work()
        deadline = time.monotonic() + 5.0
        while (threading.active_count() > threads or _open_fds() > fds) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [t.name for t in threading.enumerate()][threads:]
        assert threading.active_count() <= threads, \
            f"store conformance kit: {threading.active_count() - threads} thread(s) left after close(): {left}"
        assert _open_fds() <= fds, f"store conformance kit: {_open_fds() - fds} file descriptor(s) left after close()"

    def test_kit_close_ends_every_operation_and_later_submits_raise(self, kit_store: Store, store_url: str) -> None:
        """``close()`` returns once every operation submitted before it has ended (its future
        done: a result, or StoreUnavailable); it is idempotent; every ``submit_*`` raises
        StoreUnavailable afterwards."""
        backend = kit_store.open(store_url, StoreOptions(timeout_s=5.0))
        _within(backend.ping, 6.0, "ping()", "it must return within StoreOptions.timeout_s (5 s here)")
        keys = self.kit_keys(24)
        value = os.urandom(1 << 20)
        futs: list[Future[Any]] = [backend.submit_put([(k, _parts(value))]) for k in keys[:16]]
        futs += [backend.submit_get([(k, _parts(bytearray(len(value))))]) for k in keys[:8]]
        futs += [backend.submit_exists(keys), backend.submit_delete(keys[16:])]
        _close_within(backend, TIMEOUT)
        running = sum(not f.done() for f in futs)
        assert not running, (f"{running} of {len(futs)} operations still ran after close() returned: close() waits "
                             "for them (or fails them) and only then releases their connections and threads")
        for f in futs:
            assert not f.cancelled(), ("an operation was cancelled by close(): it ends with a result or "
                                       "StoreUnavailable (the server waits on each)")
            exc = f.exception()
            assert exc is None or isinstance(exc, StoreUnavailable), \
                f"an operation ended by close() raised {type(exc).__name__}: {exc} (only StoreUnavailable)"
        backend.close()
        buf = bytearray(1)
        for what, call in (("submit_exists", lambda: backend.submit_exists([keys[0]])),
                           ("submit_get", lambda: backend.submit_get([(keys[0], [memoryview(buf)])])),
                           ("submit_put", lambda: backend.submit_put([(keys[0], [memoryview(b"x")])])),
                           ("submit_delete", lambda: backend.submit_delete([keys[0]]))):
            try:
                call()
            except StoreUnavailable:
                continue
            except Exception as exc:  # noqa: BLE001  (the kit's report)
                pytest.fail(f"store conformance kit: {what} after close() raised {type(exc).__name__}: {exc}; it "
                            "must raise StoreUnavailable", pytrace=False)
            pytest.fail(f"store conformance kit: {what} after close() returned; it must raise StoreUnavailable",
                        pytrace=False)

    def test_kit_a_shared_store_is_shared_with_another_process(self, kit_store: Store, kit_backend: Backend,
                                                               store_url: str) -> None:
        """``shared``: kvxfer servers on other hosts use the store at the same URL. Another process
        opens it there, finds a value written here, and writes one that is read here."""
        if not kit_store.capabilities.shared:
            pytest.skip(f"{kit_store.name} does not claim to be shared (StoreCapabilities.shared)")
        mine, theirs = self.kit_keys(2)
        kit_backend.submit_put([(mine, [memoryview(b"written here")])]).result(TIMEOUT)
        script = ("import os, sys\nfrom kvxfer.store import StoreOptions, get_store\n"
                  "b = get_store(sys.argv[1]).open(os.environ['KVXFER_KIT_STORE_URL'], StoreOptions(timeout_s=5.0))\n"
                  "print(b.submit_exists([sys.argv[2].encode()]).result(60)[0])\n"
                  "b.submit_put([(sys.argv[3].encode(), [memoryview(b'written there')])]).result(60)\n"
                  "b.close()\n")
        # the URL in the environment, not on the command line: it may hold a password
        out = subprocess.run([sys.executable, "-c", script, kit_store.name, mine.decode(), theirs.decode()],
                             capture_output=True, text=True, timeout=120,
                             env={**os.environ, "KVXFER_KIT_STORE_URL": store_url})
        assert out.returncode == 0, \
            f"another process could not use the store at {redact_url(store_url)!r}: {out.stderr}"
        assert out.stdout.split() == [str(len(b"written here"))], \
            f"another process found no value written here (it saw size {out.stdout.strip()!r})"
        buf = bytearray(len(b"written there"))
        assert kit_backend.submit_get([(theirs, [memoryview(buf)])]).result(TIMEOUT) == [GetStatus.HIT]
        assert buf == b"written there"

    def test_kit_values_outlive_the_backend_that_wrote_them(self, kit_store: Store, store_url: str) -> None:
        if not kit_store.capabilities.persistent:
            pytest.skip(f"{kit_store.name} does not claim persistence (StoreCapabilities.persistent)")
        (key,) = self.kit_keys(1)
        first = kit_store.open(store_url, StoreOptions(timeout_s=5.0))
        try:
            first.submit_put([(key, [memoryview(b"kept")])]).result(TIMEOUT)
        finally:
            first.close()
        second = kit_store.open(store_url, StoreOptions(timeout_s=5.0))
        try:
            assert second.submit_exists([key]).result(TIMEOUT) == [4]
        finally:
            second.close()

    # ------------------------------------------------------------------ through a server

    def test_kit_chunks_round_trip_through_a_server(self, kit_store: Store, store_url: str, tmp_path: Path) -> None:
        """Chunks stored through the reference transport come back byte for byte from L2 after L1
        is cleared and after a server restart. A damaged value is reported missing once, never
        loaded, and deleted from the store: the next lookup finds no L2 hit there, and the chunk
        stored again is written to L2 and loads byte for byte. An intact value of another layout
        under a chunk's key (another server's) is a miss too, and is left in the store."""
        from kvxfer.server.index import ChunkKey
        from kvxfer.store.format import decode_header, encode_header, l2_key

        spec = KVSpec(LayoutKind.FLASH_ATTN, "bfloat16", num_blocks=32)
        kv = make_kv(spec, "cpu", seed=11)
        keys = [os.urandom(16) for _ in range(5)]
        src, dst = list(range(10)), list(range(10, 20))
        model = f"kit-store-{uuid.uuid4().hex[:8]}"
        _MADE.extend(l2_key(ChunkKey(model, 1, 0, k)) for k in keys)
        bare, env = password_apart(store_url)  # a password goes in the environment, off the command line
        server = ServerProcess(l1_size="16MiB", chunk_size=CHUNK_SIZE, transports="cpu_gather", env=env,
                               extra_args=["--l2", kit_store.name, "--l2-url", bare])
        with server:
            with CacheClient(server.url, timeout=TIMEOUT) as client:
                ctx = client.register(kv, model_name=model, block_size=spec.block_size, transport="cpu_gather")
                assert ctx.submit_store(keys, src).result(TIMEOUT).stored == [0, 1, 2, 3, 4]
                _wait_l2_writes(client, 5)
                assert client.clear(model) == 5
                reply = client.lookup_and_lease(model, hashes=keys, lease_s=30)
                assert (reply.hits, reply.l2_hits) == (5, 5)
                assert ctx.submit_retrieve(keys, dst, lease_id=reply.lease_id).result(TIMEOUT).loaded == [0, 1, 2, 3, 4]
                ctx.close()
            server.stop()
            a, b = (get_chunks(as_bytes(kv), spec, ids, 2) for ids in (src, dst))
            assert torch.equal(a, b), "chunks promoted from L2 differ from those stored"
            if not kit_store.capabilities.persistent:
                return  # the rest needs values that outlive the server (a restart, the store opened here)
            # behind the server's back: damage chunk 2's value (a bit flipped after the header), and
            # give chunk 4's value the intact header of another layout of the same size (float16
            # for bfloat16), as a server of that layout would have written it under the same key
            k2, k4 = (l2_key(ChunkKey(model, 1, 0, keys[i])) for i in (2, 4))
            backend = kit_store.open(store_url, StoreOptions(timeout_s=5.0))
            try:
                size, size4 = backend.submit_exists([k2, k4]).result(TIMEOUT)
                assert size > HEADER_SIZE and size4 == size
                value, foreign = bytearray(size), bytearray(size)
                read = backend.submit_get([(k2, [memoryview(value)]), (k4, [memoryview(foreign)])]).result(TIMEOUT)
                assert read == [GetStatus.HIT, GetStatus.HIT]
                good = bytes(value)
                value[HEADER_SIZE + 5] ^= 0x10
                fmt = decode_header(foreign[:HEADER_SIZE], ChunkKey(model, 1, 0, keys[4])).fmt
                other = fmt.replace("bfloat16", "float16", 1)
                assert other != fmt
                foreign[:HEADER_SIZE] = encode_header(ChunkKey(model, 1, 0, keys[4]), other, foreign[HEADER_SIZE:])
                backend.submit_put([(k2, [memoryview(value)]), (k4, [memoryview(foreign)])]).result(TIMEOUT)
            finally:
                backend.close()
            server.start()  # a restarted server finds its chunks in L2
            kv2 = make_kv(spec, "cpu", seed=12)
            with CacheClient(server.url, timeout=TIMEOUT) as client:
                ctx = client.register(kv2, model_name=model, block_size=spec.block_size, transport="cpu_gather")
                reply = client.lookup_and_lease(model, hashes=keys, lease_s=30)
                assert reply.hits == 5
                res = ctx.submit_retrieve(keys, dst, lease_id=reply.lease_id).result(TIMEOUT)
                assert (res.loaded, res.missing) == ([0, 1, 3], [2, 4]), \
                    "a damaged value, and one of another layout, must be reported missing"
                got = get_chunks(as_bytes(kv2), spec, dst, 2)
                for i in (0, 1, 3):
                    assert torch.equal(got[i], a[i])
                untouched = get_chunks(as_bytes(make_kv(spec, "cpu", seed=12)), spec, dst, 2)
                assert torch.equal(got[2], untouched[2]), "a chunk that failed its checksum must not be loaded"
                assert torch.equal(got[4], untouched[4]), "a chunk of another layout must not be loaded"
                tier = client.status().tiers[0]
                assert tier.integrity_failures >= 2 and tier.promote_failures >= 2

                # the damaged value is deleted (once the promotion's delete is done), not counted again
                deadline = time.monotonic() + TIMEOUT
                while (tier := client.status().tiers[0]).damaged_deleted < 1:
                    assert time.monotonic() < deadline, f"the damaged value was not deleted from the store: {tier}"
                    time.sleep(0.02)
                reply = client.lookup_and_lease(model, hashes=keys, lease_s=1, promote=False)
                assert (reply.hits, reply.l2_hits) == (2, 0), "a deleted value is no L2 hit"
                client.release_lease(reply.lease_id)
                assert client.status().tiers[0].damaged_deleted == 1

                # the chunk stored again is written to L2 (not skipped), and loads byte for byte from there
                before = client.status().tiers[0]
                again = client.register(kv, model_name=model, block_size=spec.block_size, transport="cpu_gather")
                assert again.submit_store(keys[2:3], src[4:6]).result(TIMEOUT).stored == [0]
                _wait_l2_writes(client, before.writes + before.write_skipped + 1)
                after = client.status().tiers[0]
                assert (after.writes, after.write_skipped) == (before.writes + 1, before.write_skipped)
                assert client.clear(model) == 4
                reply = client.lookup_and_lease(model, hashes=keys[:4], lease_s=30)
                assert (reply.hits, reply.l2_hits) == (4, 4)
                assert ctx.submit_retrieve(keys[:4], dst[:8], lease_id=reply.lease_id).result(TIMEOUT).loaded == \
                    [0, 1, 2, 3]
                assert torch.equal(get_chunks(as_bytes(kv2), spec, dst[:8], 2), a[:4])
                again.close()
                ctx.close()
            server.stop()  # (an fs store is held by one server at a time)
            backend = kit_store.open(store_url, StoreOptions(timeout_s=5.0))
            try:
                rewritten, kept = bytearray(size), bytearray(size)
                read = backend.submit_get([(k2, [memoryview(rewritten)]), (k4, [memoryview(kept)])]).result(TIMEOUT)
                assert read == [GetStatus.HIT, GetStatus.HIT]
                assert rewritten == good, "the chunk stored again must be in the store as first written"
                assert kept == foreign, "another layout's value must be left as it was"
            finally:
                backend.close()


def _same(got: bytes | bytearray, want: bytes, what: str) -> None:
    """Fail saying where ``got`` first differs from ``want`` (a byte diff of megabytes says little)."""
    if got == want:
        return
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    pytest.fail(f"store conformance kit: {what}: the get returned other bytes than were put: {len(got)} bytes "
                f"read, {len(want)} put, first difference at byte {at}", pytrace=False)


def _unchanged(got: bytes | bytearray, want: bytes, what: str) -> None:
    """Fail with ``what`` unless ``got`` still holds ``want``."""
    if got != want:
        pytest.fail(f"store conformance kit: {what}", pytrace=False)


def _within(call: Any, timeout: float, what: str, rule: str) -> Any:
    """``call()`` on a thread of its own; fail saying ``what`` did not return within ``timeout``
    (and ``rule``) rather than hang the kit."""
    out: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            out.append((True, call()))
        except BaseException as exc:  # noqa: BLE001  (raised again on the test's thread)
            out.append((False, exc))

    t = threading.Thread(target=run, daemon=True, name=f"kit-{what}")
    t.start()
    t.join(timeout)
    if not out:
        pytest.fail(f"store conformance kit: {what} did not return within {timeout:g} s: {rule}", pytrace=False)
    ok, value = out[0]
    if not ok:
        raise value
    return value


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0


def _close_within(backend: Backend, timeout: float) -> None:
    """``backend.close()``, failing the test if it does not return within ``timeout`` (it waits
    for the backend's operations: one that never ends would hang the kit)."""
    if not close_within(backend, timeout):
        pytest.fail(f"store conformance kit: close() did not return within {timeout:g} s: an operation of the "
                    "backend never ended (operations must end within StoreOptions.timeout_s and bulk_timeout_s; "
                    "the server gives up on them after 4 x their sum)", pytrace=False)


def _wait_l2_writes(client: CacheClient, n: int, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while True:
        t = client.status().tiers[0]
        if t.writes + t.write_skipped >= n and t.queue_depth == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"L2 writes did not finish: {t}")
        time.sleep(0.02)


StoreConformance.kit_names = frozenset(n for n in dir(StoreConformance) if n.startswith(("test_", "kit", "_kit")))
