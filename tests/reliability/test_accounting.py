"""Exact accounting: pins, leases, reservations and refcounts balance under any sequence of
requests, checked by a hypothesis state machine against a real server process.

Clients (real ``CacheClient``s with ``cpu_gather`` contexts) store, look up with and without
leases (repeated hashes included), release, retrieve naming leases, hold read and write
reservations open and commit them (some writes as failed), clear, disconnect without a word
(their sessions time out; a client whose process "lives", i.e. still holds its liveness lock,
gets its open writes parked until the lock goes), and fill a 16-chunk arena so eviction runs.
Short leases expire on their own. A request past one of the server's limits (the arena is
small: reads repeating one chunk soon pass the bytes a session may hold) is refused whole,
holding nothing. Whatever the sequence, once every client let go of
everything, the server holds no lease, no reservation and not one pinned chunk (counted from
the chunks themselves, ``ArenaStatus.pinned_chunks``), and ``clear`` frees the whole arena.
"""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, rule, run_state_machine_as_test
from relkit import Writer, key, wait_until

from kvxfer import CacheClient
from kvxfer.errors import ConnectionFailed, LimitExceeded, RemoteError
from kvxfer.protocol import messages as m
from kvxfer.testing.server import ServerProcess

#: Sequences per run (each run draws new ones; KVXFER_ACCOUNTING_RUNS=200 for a deeper search).
RUNS = int(os.environ.get("KVXFER_ACCOUNTING_RUNS", "12"))
STEPS = int(os.environ.get("KVXFER_ACCOUNTING_STEPS", "30"))
MODEL = "acct"
KEYS = [key(MODEL, j) for j in range(24)]  # the arena holds 16 chunks: eviction runs
#: settles within the session timeout, a few ticks, and a loaded machine's slack
SETTLE_S = 30.0
#: Indices into KEYS, biased to a few hot keys so that requests repeat hashes and collide.
IDX = st.lists(st.one_of(st.integers(0, 3), st.integers(0, len(KEYS) - 1)), min_size=1, max_size=6)


@pytest.fixture(scope="module")
def acct_server():
    # a short session timeout, so that the sessions of gone clients end soon; not shorter, so that
    # a live client starved of the CPU on a loaded 2-core machine keeps its session
    with ServerProcess(l1_size="256KiB", chunk_size=16, transports="cpu_gather",
                       extra_args=["--session-timeout", "2.5"]) as server:
        yield server


class refused_whole:
    """Let a request past a limit fail (it holds nothing); anything else propagates."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: object) -> bool:
        return kind is not None and issubclass(kind, LimitExceeded)


class Client:
    """One connection and its registered context; ``alive`` until it disconnects."""

    def __init__(self, url: str) -> None:
        self.client = CacheClient(url, timeout=20)
        self.writer = Writer(self.client, model=MODEL)
        self.alive = True

    @property
    def iid(self) -> int:
        return self.writer.ctx.instance_id


class Accounting(RuleBasedStateMachine):
    url = ""

    leases = Bundle("leases")
    reads = Bundle("reads")
    writes = Bundle("writes")

    @initialize()
    def start(self) -> None:
        self.clients = [Client(self.url) for _ in range(3)]
        self.gone: list[Client] = []
        self.lease_ids: list[int] = []
        self.clients[0].writer.store(KEYS[:4])  # a warm cache: the hot keys are there to hit

    def live(self, n: int) -> Client | None:
        c = self.clients[n % len(self.clients)]
        return c if c.alive else None

    # ------------------------------------------------------------------ requests

    @rule(n=st.integers(0, 2), idx=IDX)
    def store(self, n: int, idx: list[int]) -> None:
        c = self.live(n)
        if c is not None:
            with refused_whole():
                c.writer.store([KEYS[i] for i in dict.fromkeys(idx)])

    @rule(target=leases, n=st.integers(0, 2), idx=IDX,
          ttl=st.sampled_from([0.2, 30.0]))
    def lookup_and_lease(self, n: int, idx: list[int], ttl: float) -> int:
        c = self.live(n)
        if c is None:
            return 0
        try:
            lease_id = c.client.request(m.Lookup(MODEL, 1, [KEYS[i] for i in idx], ttl)).lease_id
        except LimitExceeded:
            return 0
        self.lease_ids.append(lease_id)
        return lease_id

    @rule(n=st.integers(0, 2), lease=consumes(leases))
    def release(self, n: int, lease: int) -> None:
        c = self.live(n)
        if c is not None and lease:
            c.client.release_lease(lease)  # any client may release a lease it was given

    @rule(n=st.integers(0, 2), lease=leases, idx=IDX)
    def retrieve_naming_a_lease(self, n: int, lease: int, idx: list[int]) -> None:
        c = self.live(n)
        if c is not None:
            with refused_whole():
                c.writer.retrieve([KEYS[i] for i in idx], lease_id=lease)  # (raw writes stored unchecked bytes)

    @rule(target=reads, n=st.integers(0, 2), idx=IDX,
          lease=st.one_of(st.just(0), leases))
    def open_read(self, n: int, idx: list[int], lease: int) -> tuple[Client, int] | None:
        c = self.live(n)
        if c is None:
            return None
        try:
            rep = c.client.request(m.ReserveRead(c.iid, [KEYS[i] for i in idx], lease))
        except LimitExceeded:
            return None
        return c, rep.reservation_id

    @rule(held=consumes(reads))
    def commit_read(self, held: tuple[Client, int] | None) -> None:
        if held is not None and held[0].alive:
            held[0].client.request(m.CommitRead(held[0].iid, held[1]))

    @rule(target=writes, n=st.integers(0, 2), idx=IDX)
    def open_write(self, n: int, idx: list[int]) -> tuple[Client, int, int] | None:
        c = self.live(n)
        if c is None:
            return None
        try:
            rep = c.client.request(m.ReserveWrite(c.iid, [KEYS[i] for i in idx]))
        except LimitExceeded:
            return None
        return c, rep.reservation_id, len(rep.slots)

    @rule(held=consumes(writes), fail=st.booleans())
    def commit_write(self, held: tuple[Client, int, int] | None, fail: bool) -> None:
        if held is not None and held[0].alive:
            c, rid, n = held
            c.client.request(m.CommitWrite(c.iid, rid, list(range(n)) if fail else []))

    @rule(n=st.integers(0, 2))
    def clear(self, n: int) -> None:
        c = self.live(n)
        if c is not None:
            c.client.clear(MODEL)

    @rule(n=st.integers(0, 2), lives_on=st.booleans())
    def disconnect(self, n: int, lives_on: bool) -> None:
        """The client goes silent without unregistering anything; with ``lives_on`` its process
        still holds its liveness lock for a while (its open writes are parked until it lets go)."""
        c = self.live(n)
        if c is None:
            return
        c.alive = False
        c.client._mq.close()
        if not lives_on:
            c.client._liveness.release()
        self.gone.append(c)
        self.clients[n % len(self.clients)] = Client(self.url)

    # ------------------------------------------------------------------ the end of a run

    def teardown(self) -> None:
        for c in getattr(self, "clients", []):
            try:
                c.writer.ctx.close()  # unregister: its open reservations go with it
            except (RemoteError, ConnectionFailed):
                pass
        for c in getattr(self, "gone", []):
            if c.client._liveness is not None:
                c.client._liveness.release()  # the "process" that froze dies now
        with CacheClient(self.url) as observer:
            for lease_id in getattr(self, "lease_ids", []):
                if lease_id:
                    observer.release_lease(lease_id)

            def settled() -> bool:
                st = observer.status()
                return st.reservations == 0 and st.leases == 0 and len(st.contexts) == 0

            wait_until(settled, SETTLE_S, "every session's reservations, leases and contexts gone")
            st = observer.status()
            assert getattr(st.arena, "pinned_chunks", 0) == 0, st.arena
            observer.clear()
            st = observer.status()
            assert (st.arena.chunks, st.arena.used) == (0, 0), st.arena
        for c in getattr(self, "clients", []):
            c.client.close()


def test_pins_balance_under_any_sequence_of_requests(acct_server):
    Accounting.url = acct_server.url
    t0 = time.monotonic()
    run_state_machine_as_test(Accounting, settings=settings(
        max_examples=RUNS, stateful_step_count=STEPS, deadline=None, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    print(f"\n{RUNS} runs of up to {STEPS} steps in {time.monotonic() - t0:.1f} s")
    assert "Traceback" not in acct_server.log()
