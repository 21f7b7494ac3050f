"""Hostile clients against the ``ipc://`` wire itself (:mod:`kvxfer.mq.listener`): connections
that hold descriptors, memory or the loop rather than sessions.

Each test reproduces something that worked against the first server on a plain Unix stream
socket (real server processes, raw sockets speaking the framing by hand through
:class:`kvxfer.testing.wire.RawConnection`) and checks that it no longer does.
"""

from __future__ import annotations

import os
import resource
import socket
import struct
from collections.abc import Iterator

import pytest
from relkit import proc_kib

from kvxfer import CacheClient
from kvxfer.mq.stream import pack
from kvxfer.testing.server import ServerProcess
from kvxfer.testing.wire import RawConnection

#: --max-message-size and --max-unread-reply-bytes of the module's server (small, so that what a
#: connection can make the server buffer shows in its RSS at once)
MESSAGE = 1 << 20
UNREAD = 1 << 20


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(l1_size="8MiB", chunk_size=64, extra_args=[
            "--max-message-size", str(MESSAGE), "--max-unread-reply-bytes", str(UNREAD)]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[CacheClient]:
    with CacheClient(server.url, timeout=60) as c:
        yield c


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_running_out_of_file_descriptors_refuses_connections_and_keeps_serving(server, client):
    """A server at its open file limit closes each connection it cannot take and serves the
    ones it has. It used to leave them queued in the listening socket, which then polled
    readable forever: the loop spun at full CPU writing a log line each turn (176,248 lines,
    25 MB of log in 2 s), and the connections waited for an answer that never came."""
    assert client.ping() > 0
    soft, hard = resource.prlimit(server.pid, resource.RLIMIT_NOFILE)
    resource.prlimit(server.pid, resource.RLIMIT_NOFILE, (open_fds(server.pid) + 4, hard))
    conns: list[RawConnection] = []
    try:
        conns = [RawConnection(server.url) for _ in range(12)]
        assert all(c.closed(30.0) for c in conns[-4:]), "a connection past the open file limit was left waiting"
        assert client.ping() > 0
        assert "out of file descriptors" in server.log()
        assert server.log().count("refused") < 12, "every refusal was logged: a storm floods the log"
    finally:
        for c in conns:
            c.close()
        resource.prlimit(server.pid, resource.RLIMIT_NOFILE, (soft, hard))
    with CacheClient(server.url, timeout=60) as again:
        assert again.ping() > 0


def test_unfinished_messages_of_many_connections_are_bounded_in_all(server, client):
    """Connections that each send all but the last byte of a message of the largest size cannot
    make the server hold one such message per connection (1,088 x 16 MiB at the defaults):
    past ``4 x max(--max-unread-reply-bytes, --max-message-size)`` of unfinished messages in
    all, the connection holding the largest one is closed."""
    body = MESSAGE  # within max_body (max-message-size + 1 KiB)
    partial = struct.pack("<IBI", body, 1, body - 5) + b"x" * (body - 5 - 1)
    rss0 = proc_kib(server.pid, "VmRSS")
    conns: list[RawConnection] = []
    cut = 0
    try:
        for _ in range(48):
            c = RawConnection(server.url)
            conns.append(c)
            try:
                c.send_bytes(partial)
            except OSError:  # closed while sending: refused already
                cut += 1
        assert client.ping() > 0  # every byte sent so far was read
        grown_mib = (proc_kib(server.pid, "VmRSS") - rss0) / 1024
        cut = sum(c.closed(2.0) for c in conns)
        assert cut >= 48 - 8, f"only {cut} of 48 connections holding an unfinished {MESSAGE >> 20} MiB message were cut"
        assert grown_mib < 24, f"the server grew by {grown_mib:.0f} MiB for 48 unfinished messages"
        assert "unfinished message" in server.log()
    finally:
        for c in conns:
            c.close()
    assert client.ping() > 0


def test_peers_that_vanish_or_half_close_mid_reply_cost_the_server_nothing(server, client):
    """A peer that stops reading and then closes (its unread replies make the close a reset), one
    that shuts down its sending side after its requests, and one whose process is killed while
    the server writes to it: the server's writes fail (EPIPE, ECONNRESET, never a SIGPIPE that
    would kill it), their connections are closed, and it serves the others."""
    import signal
    import subprocess
    import sys

    from kvxfer.protocol import codec

    pings = b"".join(b"".join(pack([codec.pack_id(i), b"ping", b""])) for i in range(1, 2001))
    reset = RawConnection(server.url, rcvbuf=4096)
    reset.send_bytes(pings)
    half = RawConnection(server.url)
    half.send_bytes(pings)
    half.sock.shutdown(socket.SHUT_WR)
    # a child process floods pings and never reads; it is killed mid-reply
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from kvxfer.mq.stream import pack\n"
        "from kvxfer.protocol import codec\n"
        "from kvxfer.testing.wire import RawConnection\n"
        f"c = RawConnection({server.url!r}, rcvbuf=4096)\n"
        "pings = b''.join(b''.join(pack([codec.pack_id(i), b'ping', b''])) for i in range(1, 2001))\n"
        "sys.stdout.write('ready\\n'); sys.stdout.flush()\n"
        "try:\n"
        "    while True: c.send_bytes(pings)\n"
        "except OSError:\n"  # cut off for not reading: wait to be killed
        "    time.sleep(3600)\n")], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        assert client.ping() > 0
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        reset.close()
        assert half.recv(30.0) is not None, "no reply reached a half-closed connection"
        assert half.closed(30.0)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        assert child.stdout is not None
        child.stdout.close()
        half.close()
    assert server.proc.poll() is None, server.log()[-3000:]
    assert client.ping() > 0
    assert "Traceback" not in server.log()
