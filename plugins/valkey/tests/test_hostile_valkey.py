"""A broken or hostile Valkey node (tests/fakevalkey.py: a real one cannot be made to answer
like this): whatever it answers to the existence checks that the server's loop reads itself, no
exception reaches the loop, a reply is never misread as sizes, the bytes kept from it stay
bounded, a node that stops answering loses its loop connection (so lookups stop paying the L2
timeout and answers are never matched to the wrong check), and a new connection is made.
Whatever it answers to a get, nothing is reported read unless the value came whole, and a get
ends within its bounds however slowly the bytes trickle in."""

from __future__ import annotations

import select
import time
from collections.abc import Callable, Iterator

import pytest
from fakevalkey import FakeValkey, Trickle
from l2kit import CHUNK, TIMEOUT, loop_tier, tier, wait_for

from kvxfer import CacheClient
from kvxfer.errors import StoreUnavailable
from kvxfer.store import GetStatus, StoreOptions
from kvxfer.testing.server import ServerProcess
from kvxfer_valkey import ValkeyStore

KEYS = [b"kvxfer:t:a", b"kvxfer:t:b"]


def _strlen(first: bytes, rest: bytes = b":0\r\n"):
    """Answer the first STRLEN with ``first`` (raw bytes), every later one with ``rest``."""
    seen = [0]

    def reply(cmd: list[bytes]) -> bytes | None:
        if cmd[0].upper() != b"STRLEN":
            return b"-ERR unexpected\r\n"
        seen[0] += 1
        return first if seen[0] == 1 else rest

    return reply


HOSTILE = {
    "a size that is not a number": (_strlen(b":abc\r\n"), [None]),
    "a size with a sign": (_strlen(b":-7\r\n"), [None]),
    "a size with spaces": (_strlen(b": 7\r\n"), [None]),
    "a size past any value": (_strlen(b":" + b"9" * 30 + b"\r\n"), [None]),
    "a bulk string": (_strlen(b"$1\r\n5\r\n"), [None]),
    "an array": (_strlen(b"*1\r\n:5\r\n"), [None]),
    "a RESP3 push": (_strlen(b">2\r\n$7\r\nmessage\r\n$1\r\nx\r\n"), [None]),
    "an error": (_strlen(b"-ERR no\r\n"), [None]),
    "a line that never ends": (_strlen(b":" + b"9" * 300_000), [None]),
    "a reply nobody asked for": (_strlen(b":1\r\n", b":2\r\n:3\r\n"), [[1, 2]]),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_reply_on_the_loop_connection_fails_that_connection_only(case: str) -> None:
    reply, expected = HOSTILE[case]
    with FakeValkey(reply) as fake:
        backend = ValkeyStore().open(fake.url, StoreOptions(timeout_s=2.0))
        try:
            results: list = []
            assert backend.exists_nowait(KEYS, results.append)
            deadline = time.monotonic() + 10
            while backend.loop_fds() and time.monotonic() < deadline:
                ready, _, _ = select.select(list(backend.loop_fds()), [], [], 0.5)
                for fd in ready:
                    backend.on_readable(fd)  # never raises, whatever the node sent
                for lc in backend._loops.values():
                    assert len(lc.buf) <= 4096, "the bytes kept from an unfinished reply are bounded"
            assert results == expected, "the check fails (None): a hostile reply is never read as sizes"
            assert backend.loop_fds() == (), "the connection is dropped: its stream position is unknown"
            fake.reply = _strlen(b":0\r\n")
            assert backend.submit_exists(KEYS).result(10) == [0, 0]
            assert len(backend.loop_fds()) == 1, "a new loop connection is made"
            results.clear()
            assert backend.exists_nowait(KEYS, results.append)
            (fd,) = backend.loop_fds()
            while not results:
                assert select.select([fd], [], [], 10)[0], "no answer on the new connection"
                backend.on_readable(fd)
            assert results == [[0, 0]]
        finally:
            backend.close()


def test_a_node_that_skips_a_reply_loses_its_loop_connection() -> None:
    skipped = [0]

    def reply(cmd: list[bytes]) -> bytes | None:
        skipped[0] += 1
        return None if skipped[0] <= len(KEYS) else b":0\r\n"  # the first check's answers never come

    with FakeValkey(reply) as fake:
        backend = ValkeyStore().open(fake.url, StoreOptions(timeout_s=0.2))
        try:
            first: list = []
            assert backend.exists_nowait(KEYS, first.append)
            time.sleep(0.3)  # past the lookup's timeout: the server's lookup has ended without it
            later: list = []
            assert not backend.exists_nowait(KEYS, later.append), \
                "a connection whose oldest check is past the timeout takes no more checks"
            assert first == [None] and backend.loop_fds() == ()
            assert backend.submit_exists(KEYS).result(10) == [0, 0]  # a threaded check; it makes a new loop connection
            (fd,) = backend.loop_fds()
            assert backend.exists_nowait(KEYS, later.append)
            while not later:
                assert select.select([fd], [], [], 10)[0], "no answer on the new connection"
                backend.on_readable(fd)
            assert later == [[0, 0]]
        finally:
            backend.close()


VALUE = bytes(range(256)) * 256  # 64 KiB


def _get(reply):
    """Answer every GET with ``reply`` (bytes or a Trickle)."""
    return lambda cmd: reply if cmd[0].upper() == b"GET" else b"-ERR unexpected\r\n"


def _value(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


HOSTILE_GETS = {
    "longer than announced": b"$4\r\n" + VALUE + b"\r\n",
    "more bytes after the value": _value(VALUE) + b":5\r\n",
    "an integer": b":65536\r\n",
    "an array": b"*1\r\n" + _value(VALUE),
    "a RESP3 push": b">1\r\n+x\r\n",
    "a length that is not a number": b"$abc\r\n",
    "a length past any value": b"$%d\r\n" % (1 << 40) + VALUE,
}


def _get_outcome(backend, buf: bytearray) -> str:
    """``"hit"``, another status's value, or the failure's text (the connection was dropped)."""
    try:
        (got,) = backend.submit_get([(b"kvxfer:t:v", [memoryview(buf)])]).result(30)
    except StoreUnavailable as exc:
        return str(exc)
    return got.value


@pytest.mark.parametrize("case", list(HOSTILE_GETS))
def test_a_hostile_reply_to_a_get_loads_only_a_whole_value(case: str) -> None:
    with FakeValkey(_get(HOSTILE_GETS[case])) as fake:
        backend = ValkeyStore().open(fake.url, StoreOptions(timeout_s=2.0, bulk_timeout_s=2.0))
        try:
            buf = bytearray(len(VALUE))
            outcome = _get_outcome(backend, buf)
            if case == "more bytes after the value":  # the value came whole; the pool drops the
                assert outcome == "hit" and buf == VALUE  # connection before its next command
            else:
                assert outcome != "hit", outcome
                assert "TimeoutError" not in outcome, "refused at once, not read until the timeout"
            buf[:] = bytes(len(buf))
            fake.reply = _get(_value(VALUE))
            assert _get_outcome(backend, buf) == "hit"
            assert buf == VALUE, "the next value is read whole, on a connection in step"
        finally:
            backend.close()


def test_a_get_that_trickles_in_ends_by_its_deadline() -> None:
    """Each read waits at most the bulk timeout; the whole get, at most the bulk timeout plus its
    bytes at 16 MiB/s: a node that sends a little at a time (slow, or pretending) cannot hold a
    store thread, and the promotions and retrieves waiting on it, for ever."""
    # 4.8 s, never silent for 1 s; the good get after it has 1 s too (a loaded machine's room)
    slow = Trickle(_value(VALUE), step=4096, every_s=0.3)
    with FakeValkey(_get(slow)) as fake:
        backend = ValkeyStore().open(fake.url, StoreOptions(timeout_s=2.0, bulk_timeout_s=1.0))
        try:
            buf = bytearray(len(VALUE))
            with pytest.raises(StoreUnavailable, match="TimeoutError"):
                backend.submit_get([(b"kvxfer:t:v", [memoryview(buf)])]).result(30)
            fake.reply = _get(_value(VALUE))
            assert backend.submit_get([(b"kvxfer:t:v", [memoryview(buf)])]).result(30) == [GetStatus.HIT]
            assert buf == VALUE
        finally:
            backend.close()


def test_lookups_reach_the_store_again_after_its_node_was_silent_past_their_timeout(tmp_path) -> None:
    """In process: a real L2 tier over a fake node that stops answering existence checks.
    Lookups time out or fail (the breaker opens); once the node answers again, later lookups ask
    it again. The keys of the unanswered checks count against the bound on keys at the store
    until the silent loop connection is dropped, which the loop's periodic pass does with no
    lookup sent (they once counted for ever: every later lookup was "busy", no L2 hit until a
    restart, while status said up)."""
    import os

    state = {"silent": True}

    def reply(cmd: list[bytes]) -> bytes | None:
        if cmd[0].upper() == b"STRLEN":
            return None if state["silent"] else b":0\r\n"
        return b"-ERR unexpected\r\n"

    # timeout_s: the 20-odd lookups that pass the bound must all be sent before the first of them
    # times out (on a loaded 2-CPU machine 2 s was not always enough: the silent node was then
    # taken for failed, and L2 down, before any lookup was busy)
    with FakeValkey(reply) as fake, loop_tier(fake.url, tmp_path, timeout_s=6.0, backoff_s=0.2) as (tier, pump):
        def lookups(n: int) -> None:
            for _ in range(n):
                tier.begin_lookup("m", 1, [os.urandom(16) for _ in range(3300)], 0)  # loop connection
                pump(0.02)

        pump(0.3)
        assert tier._watched_fds, "a loop connection"
        lookups(25)  # 82,500 keys asked of a silent node: past the bound, some are busy
        assert tier.lookups_busy > 0, (tier.lookups, tier.breaker.closed, tier._keys_in_flight)
        pump(7.0)  # past the lookups' timeout: the silent connection is dropped, with no lookup sent
        assert tier.timeouts + tier.errors > 0 and tier._keys_in_flight == 0, (tier.timeouts, tier.errors)
        state["silent"] = False
        assert wait_for(lambda: (pump(0.1), tier.breaker.closed)[1], 10), "the store is up again"
        asked = tier.lookups
        busy = tier.lookups_busy
        lookups(5)
        pump(0.5)
        assert tier.lookups - asked == 5 and tier.lookups_busy == busy, (tier.lookups, tier.lookups_busy)
        assert tier.breaker.closed and tier._keys_in_flight == 0


def test_a_node_slower_than_the_lookups_never_has_more_than_the_bound_of_their_keys(tmp_path) -> None:
    """In process: a real L2 tier over a fake node that reads every check at once and answers one
    key a millisecond (never silent, always behind). Lookups time out, but their keys stay counted
    until the node has answered them, so later lookups are "busy" (answered from L1) instead of
    queueing more: the keys waiting at the node stay within the tier's bound. Before, a timed-out
    lookup's keys stopped counting at once, and the checks queued without end (a server's memory
    grew by 300 MiB a minute at ten lookups a second)."""
    import os

    from kvxfer.server.tier import L2_KEYS_IN_FLIGHT, L2_LOOKUP_KEYS

    def reply(cmd: list[bytes]) -> bytes | Trickle | None:
        if cmd[0].upper() == b"STRLEN":
            return Trickle(b":0\r\n", step=4, every_s=0.001)
        return b"-ERR unexpected\r\n"

    with FakeValkey(reply) as fake:
        fake.read_ahead = True
        with loop_tier(fake.url, tmp_path, timeout_s=0.3, backoff_s=0.2) as (tier, pump):
            def waiting_at_the_node() -> int:
                loop = tier._loop_exists
                return sum(n for lc in list(loop._loops.values()) for n, _, _ in lc.pending) if loop else 0

            pump(0.3)
            assert tier._watched_fds, "a loop connection"
            most = 0
            for _ in range(120):  # 396,000 keys asked in about 3 s, at a node that answers 3,000
                tier.begin_lookup("m", 1, [os.urandom(16) for _ in range(3300)], 0)
                pump(0.02)
                most = max(most, waiting_at_the_node())
            assert tier.timeouts > 0 and tier.lookups_busy > 0, (tier.timeouts, tier.lookups_busy)
            assert most <= L2_KEYS_IN_FLIGHT + L2_LOOKUP_KEYS, f"{most} keys waited at the node"


def test_a_lookup_past_the_bound_of_keys_at_the_store_makes_none_of_its_keys(tmp_path) -> None:
    """In process, over a fake node that does not answer: once the checks at the store hold the
    bound of keys, a lookup is "busy" before any of its keys is made (a lookup of a hundred bytes
    at a wide world size had the loop derive every key first, busy or not), and a lookup never
    asks about more than L2_LOOKUP_KEYS keys."""
    import os

    from kvxfer.server.tier import L2_KEYS_IN_FLIGHT, L2_LOOKUP_KEYS

    with FakeValkey(lambda cmd: None) as fake:
        fake.read_ahead = True
        with loop_tier(fake.url, tmp_path, timeout_s=3.0) as (tier, pump):
            assert wait_for(lambda: (pump(0.01), tier._watched_fds)[1], 10), "a loop connection"
            for _ in range(L2_KEYS_IN_FLIGHT // L2_LOOKUP_KEYS):
                assert tier.begin_lookup("m", 8, [os.urandom(16) for _ in range(4096)], 0) is not None
            assert tier._keys_in_flight == L2_KEYS_IN_FLIGHT  # each asked about L2_LOOKUP_KEYS keys
            made = tier._keys_kept
            assert tier.begin_lookup("m", 4096, [os.urandom(16)], 0) is None
            assert tier.lookups_busy == 1 and tier._keys_kept == made, (tier.lookups_busy, tier._keys_kept, made)


INFO_BODY = b"used_memory:1000\r\nmaxmemory:0\r\nmaxmemory_policy:allkeys-lru\r\nevicted_keys:0\r\n"


@pytest.mark.parametrize("how", ["inflated", "trickled"])
def test_a_node_that_inflates_or_trickles_info_holds_neither_memory_nor_the_health_thread(how: str) -> None:
    """The tier's health thread asks the store for its figures (INFO, DBSIZE) and is the thread
    that probes a store found down: a node that answers INFO with hundreds of MB (read whole by
    the client library: 1.7 GB of the server's memory for a 300 MB reply) or a byte every so
    often (never silent for the socket timeout, so never ending) once held the server's memory
    or that thread, and L2 then stayed down for good. Each reply is now at most 64 KiB and read
    within the lookup timeout, at open as at every refresh."""
    timeout = 0.5
    bad = (b"$%d\r\n" % (300 << 20)) if how == "inflated" else \
        Trickle(b"$%d\r\n%s\r\n" % (len(INFO_BODY), INFO_BODY), step=1, every_s=0.1)
    with FakeValkey(_strlen(b":0\r\n")) as fake:
        backend = ValkeyStore().open(fake.url, StoreOptions(timeout_s=timeout, bulk_timeout_s=10.0))
        try:
            fake.info = b"$%d\r\n%s\r\n" % (len(INFO_BODY), INFO_BODY)
            assert backend.stats()["policy"] == "allkeys-lru"
            fake.info = bad
            start = time.monotonic()
            with pytest.raises(StoreUnavailable):
                backend.stats()
            assert time.monotonic() - start < timeout + 1.0
        finally:
            backend.close()
        start = time.monotonic()
        with pytest.raises(StoreUnavailable, match="no Valkey node answered"):
            ValkeyStore().open(fake.url, StoreOptions(timeout_s=timeout, bulk_timeout_s=10.0)).close()
        assert time.monotonic() - start < timeout + 1.0


# --------------------------------------------------------------------------- a kvxfer server on it

L2_TIMEOUT = 1.5  # room for the fake node (a thread of this process) on a loaded machine


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeValkey]:
    with FakeValkey(_strlen(b":0\r\n")) as node:
        yield node


@pytest.fixture(scope="module")
def client(fake: FakeValkey) -> Iterator[CacheClient]:
    args = ["--l2", "valkey", "--l2-url", fake.url, "--l2-timeout", str(L2_TIMEOUT)]
    with (ServerProcess(l1_size="8MiB", chunk_size=CHUNK, transports="cpu_gather", extra_args=args) as srv,
          CacheClient(srv.url, timeout=TIMEOUT) as c):
        assert wait_for(lambda: tier(c).state == "up", 30), tier(c)
        yield c


@pytest.mark.parametrize("first", [None, b":abc\r\n"], ids=["no answer", "garbage"])
def test_lookups_recover_from_a_node_that_skipped_or_garbled_an_answer(fake: FakeValkey, client: CacheClient,
                                                                        first: bytes | None) -> None:
    """On the loop connection, a check the node never answers (or answers with garbage) costs one
    lookup (its timeout, or a failure at once), not every lookup after it."""
    keys = [b"h" + bytes([i]) * 15 for i in range(4)]
    answered = [0]

    def reply(cmd: list[bytes]) -> bytes | None:
        answered[0] += 1
        if answered[0] == 1:
            return first
        return None if answered[0] <= len(keys) and first is None else b":0\r\n"

    wait_for(lambda: tier(client).state == "up", 30)
    before = tier(client)
    fake.reply = reply
    try:
        assert client.lookup("hostile", hashes=keys) == 0  # the node's answer is missing or garbled
        time.sleep(L2_TIMEOUT + 0.1)  # the check on the loop connection is now past the timeout
        for _ in range(4):
            assert client.lookup("hostile", hashes=keys) == 0
        after = tier(client)
        assert after.timeouts - before.timeouts <= 1, "later lookups are answered, not timed out"
        assert after.errors - before.errors <= 1 and after.outages == before.outages, after
        assert after.state == "up"
    finally:
        fake.reply = _strlen(b":0\r\n")


# --------------------------------------------------------------------------- what the client library reads

INFO_CLUSTER = b"cluster_enabled:1\r\nused_memory:0\r\n"


def _cluster_node(fake: FakeValkey, slots: bytes | None = None,
                  other: Callable[[list[bytes]], bytes | None] | None = None) -> None:
    """Make ``fake`` a node of a cluster whose CLUSTER SLOTS answers ``slots`` (default: every slot
    its own), COMMAND an empty table, and every other command ``other``."""
    port = int(fake.url.rsplit(":", 1)[1])
    mine = b"*3\r\n:0\r\n:16383\r\n*3\r\n$9\r\n127.0.0.1\r\n:%d\r\n$2\r\nid\r\n" % port
    fake.info = b"$%d\r\n%s\r\n" % (len(INFO_CLUSTER), INFO_CLUSTER)

    def reply(cmd: list[bytes]) -> bytes | None:
        name = b" ".join(cmd[:2]).upper()
        if name == b"CLUSTER SLOTS":
            return slots if slots is not None else b"*1\r\n" + mine
        if name.startswith(b"COMMAND"):
            return b"*0\r\n"
        return other(cmd) if other is not None else b"-ERR unexpected\r\n"

    fake.reply = reply


@pytest.mark.parametrize("how", ["trickled", "inflated"])
def test_a_handshake_reply_is_bounded_in_time_and_bytes(how: str) -> None:
    """The client's own handshake (CLIENT SETNAME on every new connection) is read by its parser,
    which waits for a reply whole: a node that sent it a byte every 0.2 s without an end held
    ``kvxfer serve`` at start for ever (each read was within the socket timeout), and one that
    declared a 3 GiB reply had it all read into memory. Every reply the client reads itself must
    now come whole within the socket timeout of its command, and be at most 4 MiB."""
    timeout = 0.5
    with FakeValkey(_strlen(b":0\r\n")) as fake:
        if how == "trickled":
            fake.client_reply = Trickle(b"+" + b"O" * 1000, step=1, every_s=0.2)
        else:  # 64 MiB of a declared 3 GiB, a MiB at a time: all of it is sent unless reading stops
            fake.client_reply = Trickle(b"$%d\r\n" % (3 << 30) + bytes(64 << 20), step=1 << 20, every_s=0.0)
        start = time.monotonic()
        with pytest.raises(StoreUnavailable, match="no Valkey node answered"):
            ValkeyStore().open(fake.url, StoreOptions(timeout_s=timeout, bulk_timeout_s=2.0)).close()
        assert time.monotonic() - start < timeout + 2.0
        if how == "inflated":
            wait_for(lambda: False, 0.5)  # the fake's last sends fail once the client has gone
            assert fake.sent < 32 << 20, f"the client read {fake.sent >> 20} MiB of a reply"


@pytest.mark.parametrize("slots, match", [
    (b"*1\r\n*3\r\n:0\r\n:%d\r\n*2\r\n$9\r\n127.0.0.1\r\n:7000\r\n" % (1 << 40), "outside 0..16383"),
    (b"*1\r\n*3\r\n:5\r\n:2\r\n*2\r\n$9\r\n127.0.0.1\r\n:7000\r\n", "outside 0..16383"),
    (b"*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:0\r\n", "node port 0"),
    (b"*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$7\r\n\x1b]0;x\x07\x07\r\n:7000\r\n", "not a host name"),
    (b"*1\r\n" + b"*%d\r\n:0\r\n:16383\r\n" % 1003 + b"".join(
        b"*2\r\n$9\r\n127.0.1.%d\r\n:%d\r\n" % (i % 10, 7000 + i) for i in range(1001)), "more than 1000 nodes"),
    (b":1\r\n", "not a list"),
], ids=["a slot past the last", "a range backwards", "a port out of range", "escapes for a host",
        "too many nodes", "not a list"])
def test_a_hostile_cluster_slots_reply_is_refused_before_the_client_walks_it(slots: bytes, match: str) -> None:
    """The cluster client walks every slot of every range CLUSTER SLOTS names and connects to every
    node: a range 0..2**40 took 4 GB of memory and never ended, and 4,000 nodes 4,000 loop
    connections. A reply a cluster could not send is refused (the store is unavailable)."""
    with FakeValkey(_strlen(b":0\r\n")) as fake:
        _cluster_node(fake, slots)
        start = time.monotonic()
        with pytest.raises(StoreUnavailable, match=match) as info:
            ValkeyStore().open(fake.url, StoreOptions(timeout_s=0.5, bulk_timeout_s=2.0)).close()
        assert time.monotonic() - start < 5.0
        assert "\x1b" not in str(info.value)


def test_a_redirect_is_never_followed() -> None:
    """A key's node answering MOVED had the key read or written again through the client's own
    command path, which reads a reply whole (a 3 GiB one: into memory) and connects wherever the
    node points. A redirect now leaves the key as it is for that call (a miss, not written,
    absent) and has the slot map read again; on a node not in cluster mode it is a failure. A
    put is sent once more once the map was read again (a failover moves slots), never twice."""
    moved = b"-MOVED 1234 127.0.0.1:1\r\n"
    with FakeValkey(lambda cmd: moved) as fake:
        backend = ValkeyStore().open(fake.url, StoreOptions(timeout_s=0.5, bulk_timeout_s=2.0))
        try:
            with pytest.raises(StoreUnavailable, match="GET failed: MOVED"):
                backend.get([(KEYS[0], [memoryview(bytearray(8))])])
        finally:
            backend.close()
    with FakeValkey(lambda cmd: None) as fake:
        _cluster_node(fake, other=lambda cmd: moved)
        backend = ValkeyStore().open(fake.url, StoreOptions(timeout_s=0.5, bulk_timeout_s=2.0))
        try:
            assert backend.get([(KEYS[0], [memoryview(bytearray(8))])]) == [GetStatus.MISS]
            assert backend.put([(KEYS[0], [memoryview(b"12345678")])]) == [False]
            assert backend.exists(KEYS) == [0, 0]
            assert backend.delete(KEYS) == 0
            assert backend.redirects == 7
            sent = [c[0].upper() for c in fake.commands]
            # a put answered MOVED is sent once more, to the node the map read again names: only once
            assert sent.count(b"GET") == 1 and sent.count(b"SET") == 2 and b"ASKING" not in sent, sent
        finally:
            backend.close()


def test_a_node_s_words_reach_the_log_and_status_escaped_and_without_the_password(tmp_path) -> None:
    """A node's error text goes into the server's log and ``kvxfer status``: one that answered
    with terminal escapes and echoed the password it was sent had both printed as they were."""
    with FakeValkey(_strlen(b":0\r\n")) as fake:
        fake.info = b"-ERR \x1b]0;pwned\x07\x1b[2J node says: password=S3cretPassw0rd\r\n"
        url = fake.url.replace("valkey://", "valkey://kvxfer:S3cretPassw0rd@")
        args = ["--l2", "valkey", "--l2-url", url, "--l2-timeout", "0.5"]
        with (ServerProcess(l1_size="8MiB", chunk_size=CHUNK, transports="cpu_gather", extra_args=args) as srv,
              CacheClient(srv.url, timeout=TIMEOUT) as c):
            detail = wait_for(lambda: "node says" in tier(c).detail and tier(c).detail, 30)
            assert detail and "S3cret" not in detail and "\x1b" not in detail and "password=***" in detail, detail
            log = srv.log()
            assert "node says" in log and "S3cret" not in log and "\x1b" not in log, log


def test_a_node_s_words_in_a_refusal_of_the_credentials_are_escaped_and_without_the_password(tmp_path) -> None:
    """A refusal of the credentials stops ``kvxfer serve`` (a configuration error); its message
    quoted the node's words as they came: terminal escapes, and the password the node echoed."""
    import subprocess
    import sys

    with FakeValkey(_strlen(b":0\r\n")) as fake:
        fake.auth_reply = b"-WRONGPASS \x1b]0;pwned\x07\x1b[2J you sent S3cretPassw0rd\r\n"
        url = fake.url.replace("valkey://", "valkey://kvxfer:S3cretPassw0rd@")
        out = subprocess.run([sys.executable, "-m", "kvxfer", "serve", "--url", f"ipc://{tmp_path}/s.sock", "--l1-size",
                              "8MiB", "--l2", "valkey", "--l2-url", url], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "refused kvxfer's credentials" in out.stderr, out.stderr
    assert "you sent ***" in out.stderr and "S3cret" not in out.stderr and "\x1b" not in out.stderr, out.stderr
