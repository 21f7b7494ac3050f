"""The server side of the ``ipc://`` wire: a listening Unix socket and its connections.

Owned by the server's loop thread (:class:`kvxfer.mq.server.MQServer`), which polls the
descriptors this class registers in its poller and calls :meth:`UnixListener.on_event` for them.
Each connection gets a routing id of its own (random, never reused) and its peer string from the
kernel (``SO_PEERCRED``), in the form libzmq gives on ``ipc://``:
``PATH:UID:GID:PID`` (:class:`kvxfer.server.sessions.Peer`).

What a connection can make the server hold is bounded: at most ``max_connections`` are open
(one more is accepted and closed at once, and logged; so is one that comes when the process has
no descriptor left, see below); a connection's receive buffer holds at
most one message of ``max_body`` bytes plus one read, because the loop reads a connection only
when no whole message of it is waiting (until then the kernel's buffer fills and the peer's
sends wait: backpressure, nothing dropped), and all connections together hold at most
``max_buffered`` bytes of messages (past it the connection holding the largest unfinished
message is closed, see :meth:`UnixListener._shed_buffered`); a reply the socket cannot take at once waits as its
unsent rest, one per connection (:meth:`UnixListener.try_send` says False while one does: the
server's counted backlog takes the next). A malformed stream closes its connection.

Running out of file descriptors does not stop the loop: the listener keeps one spare descriptor,
and when ``accept`` fails for want of descriptors (``EMFILE``, ``ENFILE``) it frees the spare,
accepts the waiting connection and closes it at once (refused, as one past ``max_connections``).
Without that the connection stayed queued in the listening socket, which polled readable
forever: the loop spun at full CPU writing a log line per turn, and the peer waited for a reply
that never came. On any other failure of ``accept`` the listening socket is not polled until the
next :meth:`UnixListener.tick` or until a connection closes. At start the soft ``RLIMIT_NOFILE``
is raised (up to the hard one) to fit ``max_connections`` and the descriptors the server needs
besides.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import select
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvxfer.mq.stream import READ_SIZE, FrameReader, FramingError, pack, peer_credentials, send_some
from kvxfer.mq.throttled_log import ThrottledLog

__all__ = ["UnixListener"]

log = logging.getLogger(__name__)

_IN = select.EPOLLIN
_OUT = select.EPOLLOUT
_ERR = select.EPOLLERR | select.EPOLLHUP

#: Descriptors the server needs besides its connections (arena, log, ZeroMQ, plugins, L2 store).
FD_HEADROOM = 256
#: A connection refused or closed by the listener is logged at most once per this many seconds
#: for each reason (with a count).


def ensure_fd_room(connections: int) -> int:
    """Raise the soft ``RLIMIT_NOFILE`` (never past the hard one) so that ``connections`` plus
    :data:`FD_HEADROOM` descriptors fit; returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + FD_HEADROOM
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open file limit to %d: %s", new, exc)
        if soft < want:
            log.warning("the open file limit (ulimit -n %d) is below the %d descriptors --max-connections "
                        "needs: connections past it are refused; raise the hard limit or lower "
                        "--max-connections", soft, want)
    return int(soft)


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
        max_buffered: int,
    ) -> None:
        self._sock = sock
        self._sock.setblocking(False)
        self.fd = sock.fileno()
        self._path = path
        self._poller = poller
        self._max_body = max_body
        self._max_buffered = max_buffered
        #: bytes the connections' readers hold, whole messages and unfinished ones
        self.buffered = 0
        self._max_connections = max_connections
        self._conns: dict[int, _Conn] = {}
        self._by_id: dict[bytes, _Conn] = {}
        #: connections with a whole message buffered, not handled yet (the loop polls with no wait)
        self.ready: dict[int, _Conn] = {}
        self._prefix = os.urandom(8)
        self._serial = 0
        #: the routing ids of connections closed since the loop last took them (:meth:`take_closed`)
        self._closed_ids: list[bytes] = []
        #: connections closed for a malformed stream, and refused for being over the limit
        self.malformed = 0
        self.refused = 0
        #: the warnings a peer can cause at will (connections refused or closed), at most one a second per kind
        self._throttled = ThrottledLog(log)
        self.fd_limit = ensure_fd_room(max_connections)
        #: freed to accept (and close) a connection when no descriptor is left; see the module doc
        self._spare: int | None = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        #: the listening socket is not polled (accept failed for a reason it cannot shed)
        self._accept_paused = False
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
                if exc.errno in (errno.EMFILE, errno.ENFILE) and self._shed_one():
                    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
                    self._refuse(f"out of file descriptors (ulimit -n {limit}): raise it or lower --max-connections")
                    continue
                if exc.errno == errno.ECONNABORTED:  # the peer gave up while queued
                    continue
                log.warning("accepting a connection failed: %s; accepting again in a moment", exc)
                self._poller.unregister(self.fd)
                self._accept_paused = True
                return
            if len(self._conns) >= self._max_connections:
                sock.close()
                self._refuse(f"{len(self._conns)} are open (--max-connections)")
                continue
            sock.setblocking(False)
            pid, uid, gid = peer_credentials(sock)
            self._serial += 1
            conn = _Conn(sock, sock.fileno(), self._prefix + self._serial.to_bytes(8, "little"),
                         f"{self._path}:{uid}:{gid}:{pid}", FrameReader(self._max_body))
            self._conns[conn.fd] = conn
            self._by_id[conn.identity] = conn
            self._poller.register(conn.fd, _IN)

    def _shed_one(self) -> bool:
        """Accept the waiting connection on the spare descriptor and close it (no descriptor is
        left); False when there was no spare or nothing to accept."""
        if self._spare is None:
            return False
        os.close(self._spare)
        self._spare = None
        shed = False
        try:
            sock, _ = self._sock.accept()
            sock.close()
            shed = True
        except OSError:
            pass
        try:
            self._spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # another thread took it: tick() tries again
            pass
        return shed

    def _refuse(self, why: str) -> None:
        """Count a connection closed at accept and log it."""
        self.refused += 1
        self._throttled.warning("refused", f"refused a connection: {why}")

    def tick(self) -> None:
        """Periodic (the loop's tick): poll the listening socket again after a failed accept,
        and take the spare descriptor back if it could not be reopened."""
        if self._spare is None:
            try:
                self._spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                pass
        self._resume()

    def _resume(self) -> None:
        """Poll the listening socket again after an accept failed."""
        if self._accept_paused:
            self._accept_paused = False
            self._poller.register(self.fd, _IN)

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
        self.buffered += len(data)
        try:
            whole = conn.reader.complete()
        except FramingError as exc:
            self._malformed(conn, exc)
            return
        if whole:
            self.ready[conn.fd] = conn
        if self.buffered > self._max_buffered:
            self._shed_buffered()

    def messages(self, budget: int) -> Iterator[tuple[bytes, str, list[bytes]]]:
        """Up to ``budget`` buffered messages, as ``(identity, peer, frames)``, one of each ready
        connection in turn; connections with more left stay ready. What a connection sent since
        its last read waits for the next poll (the turn ends once what was read is handed out):
        a peer that keeps its socket full never keeps the others' requests unread."""
        while self.ready and budget > 0:
            for fd, conn in list(self.ready.items()):
                if self.ready.get(fd) is not conn:
                    continue  # closed since this pass began (a reply to another message overflowed it)
                try:
                    held = len(conn.reader)
                    frames = conn.reader.next()
                    self.buffered -= held - len(conn.reader)
                except FramingError as exc:
                    self._malformed(conn, exc)
                    continue
                if frames is None:  # the rest of its stream is read when the poll next says so
                    self.ready.pop(fd, None)
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
        # a peer may open connections and send a bad head as fast as it likes: throttled
        self._throttled.warning("malformed", f"closing the connection of {conn.peer}: {exc}")
        self._close(conn)

    def _shed_buffered(self) -> None:
        """All connections together buffer more than ``max_buffered``: close the connections
        holding the largest unfinished messages until they fit.

        Without it each connection could hold one message of the largest size (``max_body``,
        16 MiB at the defaults) that it never finishes: 1,088 connections made the server hold
        17 GiB. An honest client sends a message at the speed of a local socket, so the largest
        unfinished ones are those of peers that stopped mid-message; a whole message waiting for
        the loop is never the one closed (the loop takes it soon)."""
        while self.buffered > self._max_buffered:
            held = [c for c in self._conns.values() if c.fd not in self.ready and len(c.reader)]
            if not held:
                return
            victim = max(held, key=lambda c: len(c.reader))
            self._throttled.warning(
                "buffered", f"closed the connection of {victim.peer}: it holds {len(victim.reader)} bytes of an "
                f"unfinished message while all connections hold {self.buffered}, more than {self._max_buffered} "
                "(4 x max(--max-unread-reply-bytes, --max-message-size))")
            self._close(victim)

    def _close(self, conn: _Conn) -> None:
        if self._conns.pop(conn.fd, None) is None:
            return
        self._closed_ids.append(conn.identity)
        self.buffered -= len(conn.reader)
        conn.reader = FrameReader(0)  # its memory goes now, not when the last reference does
        self._by_id.pop(conn.identity, None)
        self.ready.pop(conn.fd, None)
        self._poller.unregister(conn.fd)
        conn.sock.close()
        conn.out = []
        self._resume()  # a descriptor is free: accept what waits

    def take_closed(self) -> list[bytes]:
        """The routing ids of the connections closed (by their peer or by the server) since the
        last call."""
        closed, self._closed_ids = self._closed_ids, []
        return closed

    def drop(self, identity: bytes) -> None:
        """Close the connection of ``identity`` (its peer let too many replies wait)."""
        conn = self._by_id.get(identity)
        if conn is not None:
            self._close(conn)

    def close(self) -> None:
        for conn in list(self._conns.values()):
            self._close(conn)
        if not self._accept_paused:
            self._poller.unregister(self.fd)
        self._sock.close()
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None
