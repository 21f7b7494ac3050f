"""The server side of the ``ipc://`` wire: a listening Unix socket and its connections.

Owned by the server's loop thread (:class:`kvxfer.mq.server.MQServer`), which polls the
descriptors this class registers in its poller and calls :meth:`UnixListener.on_event` for them.
Each connection gets a routing id of its own (random, never reused) and its peer string from the
kernel (``SO_PEERCRED``), in the form libzmq gives on ``ipc://``:
``PATH:UID:GID:PID`` (:class:`kvxfer.server.sessions.Peer`).

What a connection can make the server hold is bounded: at most ``max_connections`` are open
(one more is accepted and closed at once, and logged; when the process has no descriptor left
for one, the listening socket is not polled until a connection closes or the loop's next tick,
so the loop does not spin on it); a connection's receive buffer holds at
most one message of ``max_body`` bytes plus one read, because the loop reads a connection only
when no whole message of it is waiting (until then the kernel's buffer fills and the peer's
sends wait: backpressure, nothing dropped); a reply the socket cannot take at once waits as its
unsent rest, one per connection (:meth:`UnixListener.try_send` says False while one does: the
server's counted backlog takes the next). A malformed stream closes its connection.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvxfer.mq.stream import READ_SIZE, FrameReader, FramingError, pack, peer_credentials, send_some

__all__ = ["UnixListener"]

log = logging.getLogger(__name__)

_IN = select.EPOLLIN
_OUT = select.EPOLLOUT
_ERR = select.EPOLLERR | select.EPOLLHUP


@dataclass(eq=False, slots=True)
class _Conn:
    sock: socket.socket
    fd: int
    identity: bytes
    peer: str
    reader: FrameReader
    #: the unsent rest of the reply being sent (the socket took only part of it)
    out: list[memoryview] = field(default_factory=list)
    #: whether the poller watches it for room to write (while ``out`` waits)
    watching_out: bool = False


class UnixListener:
    """Accepts connections on ``sock`` (bound and listening) and frames their messages."""

    def __init__(
        self,
        sock: socket.socket,
        path: str,
        poller: select.epoll,
        *,
        max_body: int,
        max_connections: int,
    ) -> None:
        self._sock = sock
        self._sock.setblocking(False)
        self.fd = sock.fileno()
        self._path = path
        self._poller = poller
        self._max_body = max_body
        self._max_connections = max_connections
        self._conns: dict[int, _Conn] = {}
        self._by_id: dict[bytes, _Conn] = {}
        #: connections with a whole message buffered, not handled yet (the loop polls with no wait)
        self.ready: dict[int, _Conn] = {}
        self._prefix = os.urandom(8)
        self._serial = 0
        #: connections closed for a malformed stream, and refused for being over the limit
        self.malformed = 0
        self.refused = 0
        #: the listening socket is not polled: an accept failed (no descriptor left)
        self.paused = False
        self._accept_failing = False
        poller.register(self.fd, _IN)

    def owns(self, fd: int) -> bool:
        return fd in self._conns

    def __len__(self) -> int:
        return len(self._conns)

    # ------------------------------------------------------------------ events

    def accept(self) -> None:
        """Accept every connection waiting (the listening socket polled readable)."""
        while True:
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # EMFILE and the like: the connection stays queued and the listening socket
                # readable, so polling it again at once would spin. It is polled again once a
                # connection closes, or at the loop's next tick (:meth:`resume`).
                if not self._accept_failing:
                    log.warning("accepting a connection failed (tried again as connections close): %s", exc)
                self._accept_failing = True
                self._pause()
                return
            self._accept_failing = False
            if len(self._conns) >= self._max_connections:
                self.refused += 1
                log.warning("refused a connection: %d are open (--max-connections)", len(self._conns))
                sock.close()
                continue
            sock.setblocking(False)
            pid, uid, gid = peer_credentials(sock)
            self._serial += 1
            conn = _Conn(sock, sock.fileno(), self._prefix + self._serial.to_bytes(8, "little"),
                         f"{self._path}:{uid}:{gid}:{pid}", FrameReader(self._max_body))
            self._conns[conn.fd] = conn
            self._by_id[conn.identity] = conn
            self._poller.register(conn.fd, _IN)

    def _pause(self) -> None:
        if not self.paused:
            self._poller.unregister(self.fd)
            self.paused = True

    def resume(self) -> None:
        """Poll the listening socket again after an accept failed (loop thread; the loop calls
        it at every tick)."""
        if self.paused:
            self._poller.register(self.fd, _IN)
            self.paused = False

    def on_event(self, fd: int, event: int) -> None:
        """A connection's descriptor polled ``event``: send what waits, read what came."""
        conn = self._conns.get(fd)
        if conn is None:
            return
        if event & _OUT and conn.out:
            self._flush(conn)
            if conn.fd not in self._conns:
                return
        if event & (_IN | _ERR) and conn.fd not in self.ready:
            self._read(conn)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not data:
            self._close(conn)
            return
        conn.reader.feed(data)
        try:
            whole = conn.reader.complete()
        except FramingError as exc:
            self._malformed(conn, exc)
            return
        if whole:
            self.ready[conn.fd] = conn

    def messages(self, budget: int) -> Iterator[tuple[bytes, str, list[bytes]]]:
        """Up to ``budget`` buffered messages, as ``(identity, peer, frames)``, a few of each
        ready connection in turn; connections with more left stay ready."""
        while self.ready and budget > 0:
            for fd, conn in list(self.ready.items()):
                if self.ready.get(fd) is not conn:
                    continue  # closed since this pass began (a reply to another message overflowed it)
                try:
                    frames = conn.reader.next()
                except FramingError as exc:
                    self._malformed(conn, exc)
                    continue
                if frames is None:
                    del self.ready[fd]
                    if conn.fd in self._conns:
                        self._read(conn)  # the poll saw it readable before; more may be there
                    continue
                budget -= 1
                yield conn.identity, conn.peer, frames
                if budget <= 0:
                    return

    # ------------------------------------------------------------------ sending

    def try_send(self, identity: bytes, frames: list[bytes]) -> bool:
        """True when sent, or dropped for good (the connection is gone); False while the
        connection still sends an earlier reply (the caller keeps this one)."""
        conn = self._by_id.get(identity)
        if conn is None:
            return True
        if conn.out:
            return False
        conn.out = [memoryview(b) for b in pack(frames)]
        self._flush(conn)
        return True

    def _flush(self, conn: _Conn) -> None:
        try:
            done = send_some(conn.sock, conn.out)
        except OSError as exc:
            if exc.errno not in (errno.EPIPE, errno.ECONNRESET):
                log.warning("reply to %s dropped: %s", conn.peer, exc)
            self._close(conn)
            return
        if conn.watching_out == done:  # changed: one epoll_ctl, not one per reply
            conn.watching_out = not done
            self._poller.modify(conn.fd, _IN | _OUT if conn.watching_out else _IN)

    # ------------------------------------------------------------------ closing

    def _malformed(self, conn: _Conn, exc: FramingError) -> None:
        self.malformed += 1
        log.warning("closing the connection of %s: %s", conn.peer, exc)
        self._close(conn)

    def _close(self, conn: _Conn) -> None:
        if self._conns.pop(conn.fd, None) is None:
            return
        self._by_id.pop(conn.identity, None)
        self.ready.pop(conn.fd, None)
        self._poller.unregister(conn.fd)
        conn.sock.close()
        conn.out = []
        self.resume()  # a descriptor is free: accept what waits

    def drop(self, identity: bytes) -> None:
        """Close the connection of ``identity`` (its peer let too many replies wait)."""
        conn = self._by_id.get(identity)
        if conn is not None:
            self._close(conn)

    def close(self) -> None:
        for conn in list(self._conns.values()):
            self._close(conn)
        self._pause()
        self._sock.close()
