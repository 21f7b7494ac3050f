"""Messaging: futures, timeouts, concurrency of submit, callbacks, missing and dead servers."""

from __future__ import annotations

import concurrent.futures
import os
import resource
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvxfer import CacheClient, chunk_hashes
from kvxfer.errors import ConnectionFailed, NoSession, RequestTimeout
from kvxfer.mq.client import MQClient
from kvxfer.mq.futures import ReplyFuture
from kvxfer.mq.server import MQServer
from kvxfer.mq.stream import pack
from kvxfer.protocol import codec
from kvxfer.protocol import messages as m
from kvxfer.testing.server import ServerProcess
from kvxfer.testing.wire import RawConnection
from kvxfer_core_helpers import BLOCKS_PER_CHUNK, CHUNK_SIZE, flash_attn_kv, wait_until


def test_future_result_timeout_names_server_and_request() -> None:
    fut = ReplyFuture("ipc:///somewhere/kvxfer.sock", "lookup")
    assert not fut.done()
    with pytest.raises(RequestTimeout) as info:
        fut.result(timeout=0.01)
    assert "ipc:///somewhere/kvxfer.sock" in str(info.value) and "'lookup'" in str(info.value)
    assert isinstance(info.value, ConnectionFailed) and isinstance(info.value, TimeoutError)


def test_future_done_and_callbacks() -> None:
    fut = ReplyFuture("ipc:///x", "ping")
    seen: list[object] = []
    fut.add_done_callback(lambda f: seen.append(f.result()))
    fut.set_result(m.Pong(1.0))
    assert fut.done() and seen == [m.Pong(1.0)]
    fut.add_done_callback(lambda f: seen.append("late"))  # added after completion: runs at once
    assert seen == [m.Pong(1.0), "late"]


def test_no_server_gives_connection_failed_saying_how_to_start_one(tmp_path: Path) -> None:
    url = f"ipc://{tmp_path}/nobody.sock"
    with pytest.raises(ConnectionFailed) as info:
        CacheClient(url, connect_timeout=0.5)
    assert f"kvxfer serve --url {url}" in str(info.value)


@pytest.fixture
def silent_url(tmp_path: Path) -> Iterator[str]:
    """An ipc:// url where a socket listens and nothing ever answers (connections wait in its
    backlog): a server that hangs."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(tmp_path / "silent.sock"))
        s.listen(64)
        yield f"ipc://{tmp_path}/silent.sock"


def test_request_timeout_from_the_io_thread(silent_url: str) -> None:
    url = silent_url
    mq = MQClient(url)
    try:
        fut = mq.submit(m.Ping(), timeout=0.2)
        with pytest.raises(RequestTimeout) as info:
            fut.result(10)  # the I/O thread fails it at its deadline
        assert info.value is fut.exception(0), "result() must raise the request's own error"
        assert url in str(info.value) and "'ping'" in str(info.value)
        with pytest.raises(RequestTimeout, match="'status'"):
            mq.request(m.StatusRequest(), timeout=0.2)
    finally:
        mq.close()
    # after close, submits fail at once instead of hanging
    with pytest.raises(ConnectionFailed, match="closed"):
        mq.submit(m.Ping()).result(1)


def test_no_server_fails_a_request_at_once(tmp_path: Path) -> None:
    """ipc://: with no socket, or a socket nothing listens on (left by a server that died), a
    request fails at once with ConnectionFailed saying which; nothing waits for a timeout."""
    url = f"ipc://{tmp_path}/nobody.sock"
    mq = MQClient(url, default_timeout=60)
    try:
        with pytest.raises(ConnectionFailed, match="does not exist"):
            mq.request(m.Ping())
        with pytest.raises(ConnectionFailed, match="does not exist"):
            mq.submit(m.Ping()).result(5)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.bind(str(tmp_path / "nobody.sock"))  # bound, never listening: a dead server's file
        with pytest.raises(ConnectionFailed, match="its server is gone"):
            mq.request(m.Ping())
    finally:
        mq.close()


def test_a_server_that_accepts_no_connections_fails_a_request_in_time(tmp_path: Path) -> None:
    """A server whose queue of new connections is full (stuck, or stopped with SIGSTOP) makes
    connect() wait: the request fails with ConnectionFailed instead of hanging, and the client
    (its lock, its I/O thread) stays usable."""
    path = tmp_path / "stuck.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as queued:
        listener.bind(str(path))
        listener.listen(0)
        queued.connect(str(path))  # the one connection a backlog of 0 queues: the queue is full
        mq = MQClient(f"ipc://{path}")
        outcome: dict[str, BaseException] = {}

        def send() -> None:
            try:
                mq.submit(m.Ping(), timeout=60).result(60)
            except BaseException as exc:  # noqa: BLE001  (checked below)
                outcome["exc"] = exc

        th = threading.Thread(target=send, daemon=True)
        th.start()
        th.join(30)
        alive = th.is_alive()
        listener.close()  # lets a connect that hangs go on (refused), so that close() can finish
        th.join(30)
        mq.close()
    assert not alive, "connect() to a server that accepts nothing hung past the request's timeout"
    assert isinstance(outcome.get("exc"), ConnectionFailed) and "accepts no connections" in str(outcome["exc"])


def test_pending_requests_fail_when_the_client_closes(silent_url: str) -> None:
    mq = MQClient(silent_url)
    futs = [mq.submit(m.Ping(), timeout=60) for _ in range(5)]
    mq.close()
    for f in futs:
        with pytest.raises(ConnectionFailed):
            f.result(5)


@pytest.fixture(scope="module")
def stored(server):
    """8 chunks stored through cpu_gather; yields their hashes."""
    c = CacheClient(server.url, timeout=15)
    kv = c.register(flash_attn_kv(), model_name="msg-model", block_size=16, transport="cpu_gather")
    hashes = chunk_hashes(list(range(8 * CHUNK_SIZE)), CHUNK_SIZE)
    res = kv.submit_store(hashes, list(range(8 * BLOCKS_PER_CHUNK))).result(30)  # all 32 blocks
    assert res.ok and len(res.stored) == 8
    kv.close()
    c.close()
    return hashes


def test_submit_from_many_threads_at_once(client, stored) -> None:
    """16 threads x 40 requests on one client, request() and submit() mixed: every reply
    reaches its own caller (the hit count names the request)."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(16)

    def worker(t: int) -> None:
        try:
            barrier.wait(10)
            for i in range(40):
                k = (t + i) % 9
                if i % 2:
                    hits = client.lookup("msg-model", 1, hashes=stored[:k])
                else:
                    hits = client.submit(m.Lookup("msg-model", 1, stored[:k])).result(30).hits
                assert hits == k, (t, i, hits, k)
        except BaseException as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(16)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads)
    assert errors == []


def test_many_futures_in_flight_complete_in_any_wait_order(client, stored) -> None:
    futs = [client.submit(m.Lookup("msg-model", 1, stored[:k % 9])) for k in range(200)]
    for k, f in reversed(list(enumerate(futs))):
        assert f.result(30).hits == k % 9
    assert all(f.done() for f in futs)


def test_callbacks_run_and_may_submit_again(client) -> None:
    second: concurrent.futures.Future[concurrent.futures.Future[m.Pong]] = concurrent.futures.Future()

    def again(f: concurrent.futures.Future[m.Pong]) -> None:
        second.set_result(client.submit(m.Ping()))

    client.submit(m.Ping()).add_done_callback(again)
    assert second.result(10).result(10).server_time > 0


def test_waiting_requests_and_futures_share_one_socket(client, stored) -> None:
    """A thread blocked in request() receives replies that belong to other futures too."""
    futs = [client.submit(m.Lookup("msg-model", 1, stored[:3])) for _ in range(20)]
    assert client.lookup("msg-model", 1, hashes=stored) == 8
    assert [f.result(10).hits for f in futs] == [3] * 20


def test_a_request_larger_than_the_socket_buffer_is_sent_while_its_caller_waits(server) -> None:
    """ipc://: the socket takes a 15 MiB request a buffer at a time. While its caller waits in
    request() (the thread that reads the socket), the I/O thread sends the rest as the server
    reads it, and then what queued behind it: every reply (NoSession: no handshake here) comes
    well within its timeout."""
    mq = MQClient(server.url)
    try:
        big = m.Lookup("msg-model", 1, [bytes(32)] * ((15 << 20) // 34))  # the limit is 16 MiB
        with pytest.raises(NoSession):
            mq.request(big, timeout=5)
        futs = [mq.submit(big, timeout=5), mq.submit(m.Ping(), timeout=5)]  # the ping waits behind
        with pytest.raises(NoSession):
            mq.request(m.Ping(), timeout=5)
        for f in futs:
            with pytest.raises(NoSession):
                f.result(15)
    finally:
        mq.close()


def test_dead_server_fails_requests_with_connection_failed() -> None:
    with ServerProcess(l1_size="16MiB", chunk_size=CHUNK_SIZE, transports="cpu_gather") as srv:
        c = CacheClient(srv.url, timeout=5)
        assert c.ping() > 0
        srv.kill()
        with pytest.raises(ConnectionFailed) as info:
            c.request(m.Ping(), timeout=0.5)
        assert srv.url in str(info.value)
        c.close()


def test_close_fails_a_request_that_is_waiting(silent_url: str) -> None:
    """A thread blocked in request() (the one receiving for everybody) is woken by close()."""
    mq = MQClient(silent_url)
    outcome: dict[str, BaseException] = {}
    started = threading.Event()

    def wait() -> None:
        started.set()
        try:
            mq.request(m.Ping(), timeout=60)
        except BaseException as exc:  # noqa: BLE001  (checked below)
            outcome["exc"] = exc

    th = threading.Thread(target=wait)
    th.start()
    started.wait(10)
    # white box: wait until it is the receiving ("leader") thread, the case this test is about
    assert wait_until(lambda: mq._leader is not None, timeout=10)
    others = [mq.submit(m.Ping(), timeout=60) for _ in range(3)]
    mq.close()
    th.join(15)
    assert not th.is_alive(), "close() left a request waiting"
    assert isinstance(outcome.get("exc"), ConnectionFailed), outcome
    for f in others:
        with pytest.raises(ConnectionFailed):
            f.result(5)


def test_close_while_a_request_waits_leaves_no_descriptor_open(silent_url: str) -> None:
    """close() while a thread waits in request(): every descriptor of the client is closed,
    whether the waiting thread has left by the time close() returns or leaves after (20 times:
    either comes first)."""
    zmq.Context.instance()  # the process's ZeroMQ context (and its descriptors) is not the client's
    fds = set(os.listdir("/proc/self/fd"))
    for _ in range(20):
        mq = MQClient(silent_url)
        th = threading.Thread(target=lambda: pytest.raises(ConnectionFailed, mq.request, m.Ping(), timeout=60))
        th.start()
        assert wait_until(lambda: mq._leader is not None, timeout=10, step=0.001)  # white box: it waits
        mq.close()
        th.join(15)
        assert not th.is_alive()
    assert set(os.listdir("/proc/self/fd")) <= fds, "close() left descriptors of the client open"


def test_what_a_reply_sent_by_the_periodic_task_queued_runs_in_the_same_pass() -> None:
    """The loop's periodic task may send replies (a lookup answered when its L2 read timed
    out) whose handler queued work with after_reply (the lookup's prefetch): it runs right
    after the task, not once some later message arrives (none does here)."""
    ran = threading.Event()
    ticks = []

    def tick() -> None:
        ticks.append(1)
        if len(ticks) == 1:
            server.after_reply(ran.set)

    server = MQServer(f"inproc://after-reply-tick-{id(ran)}", lambda *_: None, max_message_size=1 << 20,
                      on_tick=tick, tick_s=0.01)
    loop = threading.Thread(target=server.serve_forever)
    loop.start()
    try:
        assert ran.wait(30), "what the periodic task queued did not run"
    finally:
        server.stop()
        loop.join(30)


def test_a_connection_closed_by_another_connections_reply_does_not_stop_the_server(tmp_path: Path) -> None:
    """ipc://: the server handles the messages of its ready connections a few of each in turn.
    When the reply to one connection's message overflows the backlogs of all connections
    together, the connection with the largest backlog is closed, and it may be one whose turn
    comes later in the same round: the round skips it, and the server goes on.

    The server loop here is MQServer's own with a dispatcher that answers each request with as
    many bytes as its payload names; the connections speak the wire by hand and never read
    (except the gate's), so replies pile up in the server's backlogs."""
    mib = 1 << 20
    gate, at_gate = threading.Event(), threading.Event()

    def dispatch(identity: bytes, peer: str, rid: bytes, name: bytes, payload: bytes) -> tuple[bytes, bytes]:
        if name == b"gate":
            at_gate.set()
            gate.wait(30)  # holds the loop while the others send: all are read in one pass
        return codec.OK, bytes(int(payload))

    url = f"ipc://{tmp_path}/overflow.sock"
    # 4 connections' backlogs of 2.5 MiB in all: 10 MiB
    server = MQServer(url, dispatch, max_message_size=1 << 20, max_unread_reply_bytes=5 * mib // 2)
    loop = threading.Thread(target=server.serve_forever)
    loop.start()
    conns: dict[str, RawConnection] = {}
    try:
        for who in "GBACDE":  # accepted, and so read and handled, in this order
            conns[who] = RawConnection(url)
            conns[who].send([codec.pack_id(1), b"hello", b"0"])
            assert conns[who].recv(30) is not None
        conns["G"].send([codec.pack_id(2), b"gate", b"0"])
        assert at_gate.wait(30)
        # replies (MiB) per message: the first of each waits half-sent in its socket, the rest in
        # the backlogs. After the third round A holds 2.4, B 1.0, C, D and E 2.0 each: 9.4 in
        # all; B's fourth (0.7) passes 10, and A, the largest, is closed in the round where A
        # has no message left
        sizes = {"B": [1.0, 0.5, 0.5, 0.7], "A": [1.2, 1.2, 1.2], "C": [1.0] * 3, "D": [1.0] * 3, "E": [1.0] * 3}
        for who, mibs in sizes.items():
            conns[who].send_bytes(b"".join(
                b"".join(pack([codec.pack_id(10 + i), b"echo", str(int(x * mib)).encode()]))
                for i, x in enumerate(mibs)))
        gate.set()
        assert conns["G"].recv(30) is not None
        # (not asserted: which connection's backlog the kernel's buffers leave largest, A's as
        # counted above in most runs)
        conns["A"].closed(5)
        conns["G"].send([codec.pack_id(3), b"hello", b"0"])
        assert conns["G"].recv(30) is not None, "the server stopped"
        assert loop.is_alive()
    finally:
        gate.set()
        for c in conns.values():
            c.close()
        server.stop()
        loop.join(30)


def test_a_reservation_or_lease_granted_after_its_request_timed_out_is_released(tmp_path: Path) -> None:
    """A server that stalls (SIGSTOP here) past a reserve's or a leasing lookup's timeout still
    grants it once it runs again; the client, which failed the request, releases the reservation
    or the lease when the late reply comes instead of leaving its slots held for the rest of the
    session (a vLLM worker kept them for the engine's life after each stall) or its chunks pinned
    for the lease's time (a vLLM scheduler's lookup that timed out)."""
    import signal
    import time

    with ServerProcess(l1_size="4MiB", chunk_size=CHUNK_SIZE, transports="cpu_gather") as srv, \
            CacheClient(srv.url, timeout=30) as c:
        ctx = c.register(flash_attn_kv(num_layers=2, num_blocks=16), model_name="late", block_size=16,
                         transport="cpu_gather")
        hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt="late")
        leased = chunk_hashes(list(range(100, 100 + CHUNK_SIZE)), CHUNK_SIZE, salt="late")
        assert ctx.submit_store(leased, list(range(BLOCKS_PER_CHUNK))).result(30).stored == [0]
        assert srv.proc is not None
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            writes = c.submit(m.ReserveWrite(ctx.instance_id, hashes), timeout=0.3)
            reads = c.submit(m.ReserveRead(ctx.instance_id, hashes), timeout=0.3)
            lookup = c.submit(m.Lookup("late", 1, leased, 600.0), timeout=0.3)
            for fut in (writes, reads, lookup):
                with pytest.raises(RequestTimeout):
                    fut.result(5)
            time.sleep(0.2)
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        assert wait_until(lambda: c.status().reservations == 0 and c.status().leases == 0, timeout=10), c.status()
        assert c.lookup("late", hashes=hashes) == 0  # the write's slots were dropped, not made readable
        assert ctx.submit_store(hashes, list(range(2 * BLOCKS_PER_CHUNK))).result(30).stored == [0, 1]
        ctx.close()


def test_an_idle_client_stops_pinging_a_restarted_server_that_lost_its_session(tmp_path: Path) -> None:
    """After a server restart, an idle client's heartbeat is answered no_session; it stops there
    (each ping once added a no_session error to the server's figures, every second, until the
    client's next request), and its next request opens a session again."""
    import time

    with ServerProcess(l1_size="4MiB", chunk_size=CHUNK_SIZE, transports="cpu_gather") as srv, \
            CacheClient(srv.url, timeout=30) as c:
        c.ping()
        srv.restart()
        time.sleep(3.5)  # heartbeats every second (the server's heartbeat_s)
        with CacheClient(srv.url, timeout=30) as other:
            errors = other.status().errors_by_code
        assert errors.get("no_session", 0) <= 1, errors
        c.reconnect()
        assert c.lookup("anything", hashes=[b"h" * 16]) == 0
