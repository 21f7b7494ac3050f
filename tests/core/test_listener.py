"""The ``ipc://`` listener (:class:`kvxfer.mq.listener.UnixListener`) driven by hand: a real
listening socket, real connections, the loop's calls made one by one so that their order is
exact."""

from __future__ import annotations

import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvxfer.mq.listener import UnixListener
from kvxfer.testing.wire import RawConnection


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[UnixListener, str]]:
    path = tmp_path / "kvxfer.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(8)
    lis = UnixListener(sock, str(path), select.epoll(), max_body=1 << 20, max_connections=8, max_buffered=8 << 20)
    yield lis, f"ipc://{path}"
    lis.close()


def test_a_connection_closed_while_the_loop_handles_another_is_skipped(listener) -> None:
    """The loop hands out one message of each ready connection in turn. Handling one may close
    another (the server drops the connection whose backlog is largest when all backlogs pass
    their bound); meeting the closed one later in the same turn raised KeyError out of the
    loop, which stopped the server."""
    lis, url = listener
    b, a = RawConnection(url), RawConnection(url)
    try:
        b.send([b"b1______", b"ping", b""])
        b.send([b"b2______", b"ping", b""])
        a.send([b"a1______", b"ping", b""])
        lis.accept()
        fd_b, fd_a = list(lis._conns)  # in the order accepted
        lis.on_event(fd_b, select.EPOLLIN)  # both of b's messages in one read
        lis.on_event(fd_a, select.EPOLLIN)
        seen = []
        for identity, _peer, frames in lis.messages(16):
            seen.append(frames[0])
            if frames[0] == b"b2______":  # handling it drops a, which is still in this turn
                lis.drop(lis._conns[fd_a].identity)
        assert seen == [b"b1______", b"a1______", b"b2______"]
        assert a.closed(5.0)
        assert len(lis) == 1 and lis.buffered == 0
    finally:
        a.close()
        b.close()


def test_a_turn_reads_no_connection_again_so_one_that_keeps_sending_never_keeps_the_others_out(listener) -> None:
    """A turn hands out the messages its reads buffered, and ends: the next poll sees the other
    connections. It read a connection again once its buffered messages ran out, so one peer that
    kept its socket full (pipelined requests, each dear to handle) was served for the whole turn,
    256 messages, while a request that came on another connection meanwhile was not even read
    (a ping waited 26 s behind 0.1 s lookups). The hog is a process of its own, as it would be."""
    lis, url = listener
    hog = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from kvxfer.testing.wire import RawConnection\n"
        "c = RawConnection(sys.argv[1])\n"
        "for i in range(40):\n"
        "    c.send([b'h%07d' % i, b'ping', b'x' * (100 << 10)])\n"  # two or three fill a read
        "time.sleep(60)\n"), url])
    victim = RawConnection(url)
    try:
        deadline = time.monotonic() + 30
        while len(lis) < 2:
            assert time.monotonic() < deadline, "the hog never connected"
            lis.accept()
            time.sleep(0.01)
        (fd_hog,) = [fd for fd, c in lis._conns.items() if c.peer.endswith(f":{hog.pid}")]
        (fd_victim,) = [fd for fd in lis._conns if fd != fd_hog]
        time.sleep(0.3)  # the hog's socket is full
        lis.on_event(fd_hog, select.EPOLLIN)  # the poll saw only the hog
        turn = lis.messages(256)
        assert next(turn)[2][0] == b"h0000000"
        victim.send([b"victim__", b"ping", b""])  # comes while the turn is being handled
        rest = []
        for _, _, frames in turn:
            rest.append(frames[0])
            time.sleep(0.01)  # handling each takes a while: the hog sends faster
        assert len(rest) < 5, f"the turn read the hog's socket again: {len(rest) + 1} of its messages in one turn"
        # the next poll sees both: the victim's message comes first or second
        for fd in (fd_hog, fd_victim):
            lis.on_event(fd, select.EPOLLIN)
        order = [frames[0] for _, _, frames in lis.messages(256)]
        assert b"victim__" in order[:2], order[:4]
    finally:
        hog.kill()
        hog.wait(10)
        victim.close()
