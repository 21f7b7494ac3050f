"""The ``ipc://`` listener (:class:`kvxfer.mq.listener.UnixListener`) driven by hand: a real
listening socket, real connections, the loop's calls made one by one so that their order is
exact."""

from __future__ import annotations

import select
import socket
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
