"""The server half of messaging: one loop thread serving every connection.

On ``ipc://`` the loop serves a listening Unix stream socket itself (:mod:`kvxfer.mq.listener`,
framing in :mod:`kvxfer.mq.stream`); on ``tcp://`` (CURVE) a ZeroMQ ROUTER socket. Either way it
receives ``[identity, request_id, name, payload]`` and hands it to a dispatcher, with the peer as
the connection tells it (on ``ipc://`` the socket path and the connecting process's
``SO_PEERCRED`` uid, gid and pid, ``PATH:UID:GID:PID``; on CURVE connections ``tcp:``, ZeroMQ's
``Peer-Address``, ``|`` and the ``User-Id`` the ZAP handler set, the client's public key), which
returns the reply frames at once (control requests) or ``None`` after arranging for
:meth:`MQServer.send` to be called later on the loop (transfers). Only the loop touches the
sockets. Frames that cannot be answered (no request id) are dropped and counted; everything else
gets a reply; a malformed ``ipc://`` stream closes its connection.

Unread replies are bounded per connection. ZeroMQ queues at most :data:`REPLY_QUEUE` replies
for a peer (``SNDHWM``; ``ROUTER_MANDATORY`` makes a full queue an error instead of a silent
drop), a Unix connection what its socket buffer takes plus the unsent rest of one reply;
replies beyond it wait in the server's own per-peer backlog, counted in bytes, and are
sent as the peer reads. A peer whose backlog passes ``max_unread_reply_bytes`` has its backlog
dropped and is reported to ``on_unread_overflow`` (the engine ends its session): what the
server holds for one connection is bounded by that limit plus :data:`REPLY_QUEUE` replies. All
backlogs together are bounded by :data:`BACKLOG_CONNECTIONS` times the limit: past it, the
largest one is dropped the same way.

Requests waiting to be read are bounded per connection too. A Unix connection is read only when
none of its messages waits, so it holds at most one message and one read (then the kernel's
buffer fills and the peer's sends wait); at most ``max_connections`` are open, and all of them
together buffer at most :data:`BACKLOG_CONNECTIONS` times the larger of ``max_unread_reply_bytes``
and ``max_message_size`` (past it the connection with the largest unfinished message is closed). ZeroMQ queues at most
:func:`request_queue` requests of a peer (``RCVHWM``; then it stops reading that peer's socket,
so the peer's sends wait: backpressure, nothing is dropped), about ``max_unread_reply_bytes`` of
requests of the largest size. With ZeroMQ's default (1,000 per peer) a peer that sent 16 MiB
requests while the loop was busy made the server hold gigabytes.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import math
import os
import queue
import select
import socket
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq

from kvxfer.errors import ConfigError, ErrorCode
from kvxfer.mq.claim import CLAIM_SUFFIX, SocketClaim, socket_claimed
from kvxfer.mq.claim import take as take_claim
from kvxfer.mq.listener import UnixListener
from kvxfer.mq.throttled_log import ThrottledLog
from kvxfer.private_dirs import ensure_private_dir
from kvxfer.protocol import codec
from kvxfer.protocol.messages import ErrorReply
from kvxfer.urls import ipc_path, socket_dir_hint

__all__ = ["MQServer", "CurveServerKeys", "Dispatcher", "claim_socket", "ipc_path", "refuse_if_served",
           "request_queue", "require_curve"]

log = logging.getLogger(__name__)

_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)
_RCVMORE = int(zmq.RCVMORE)
_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)

#: (identity, peer, request_id frame, name, payload) -> (status, payload) now, or None (reply later)
Dispatcher = Callable[[bytes, str, bytes, bytes, bytes], "tuple[bytes, bytes] | None"]

#: Replies ZeroMQ queues for one peer (SNDHWM); more wait in the server's counted backlog.
REPLY_QUEUE = 64
#: Bounds of the requests ZeroMQ queues for one peer (RCVHWM), see request_queue().
REQUEST_QUEUE_MIN = 4
REQUEST_QUEUE_MAX = 1000


def request_queue(max_message_size: int, max_unread_reply_bytes: int) -> int:
    """Requests ZeroMQ queues for one peer (``RCVHWM``): as many of the largest size as fit in
    ``max_unread_reply_bytes``, within [REQUEST_QUEUE_MIN, REQUEST_QUEUE_MAX] (4 at the defaults:
    64 MiB of 16 MiB requests)."""
    return max(REQUEST_QUEUE_MIN, min(REQUEST_QUEUE_MAX, max_unread_reply_bytes // max(1, max_message_size)))


#: How long a tcp:// peer may take to finish its CURVE handshake (ZeroMQ's default: 30 s). Before
#: it has, ZeroMQ already takes a frame of up to --max-message-size from it, so a peer without a
#: key can make the server hold that much per connection for this long: at most what it uploads
#: in this time. A handshake is four short messages: a second on the slowest link.
HANDSHAKE_MS = 5000
#: What the backlog counts for a reply besides its bytes (Python objects, ZeroMQ frames).
_REPLY_OVERHEAD = 256
#: All connections' backlogs together hold at most this many times max_unread_reply_bytes.
BACKLOG_CONNECTIONS = 4


@dataclass(frozen=True, slots=True)
class CurveServerKeys:
    """The server's CURVE key pair (z85 bytes), the folder of client public keys allowed in,
    and those keys (z85 bytes, as read and checked at start; :meth:`MQServer.reload_authorized`
    reads the folder again)."""

    public: bytes
    secret: bytes
    authorized_dir: Path
    authorized: frozenset[bytes]


def refuse_if_served(url: str) -> None:
    """Raise ConfigError if a server already listens at ``ipc://`` ``url``, or the port of a
    ``tcp://`` one is taken: a server checks it before it makes its arena (seconds for a large
    one), and again when it binds."""
    path = ipc_path(url)
    if path is not None and os.path.isdir(path) and not os.path.islink(path):
        raise ConfigError(f"{url} names the directory {path}: name the socket to make in it, e.g. "
                          f"--url ipc://{path / 'kvxfer.sock'}")
    if path is not None:
        try:
            st = os.lstat(path)
        except OSError:  # nothing there (or gone since): the bind says the rest
            return
        # another user's socket is left to the socket directory's own checks (not private)
        if stat.S_ISSOCK(st.st_mode) and st.st_uid == os.geteuid() and _socket_is_live(path):
            raise ConfigError(f"a server is already listening at {url}; stop it or choose another --url")
        return
    if url.startswith("tcp://"):
        host, _, port = url[len("tcp://"):].rpartition(":")
        host = host.strip("[]")
        # ZeroMQ binds IPv4 unless given an IPv6 address: check the addresses it will take
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            infos = socket.getaddrinfo(None if host in ("*", "0.0.0.0") else host, int(port), family,
                                       socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except (OSError, ValueError):
            return  # a name ZeroMQ resolves its own way (an interface): its bind says
        for fam, kind, proto, _, address in infos:
            try:
                with socket.socket(fam, kind, proto) as s:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
                    s.bind(address)
            except OSError as exc:  # anything but a port in use is the real bind's to report
                if exc.errno == errno.EADDRINUSE:
                    raise ConfigError(f"cannot listen at {url}: its port is in use (another server?); stop "
                                      "that or choose another port") from None


def claim_socket(url: str) -> SocketClaim | None:
    """Claim the socket of ``ipc://`` ``url`` for this server (:mod:`kvxfer.mq.claim`), before
    it makes its arena, making the socket's private directory if missing; None for other
    schemes, which are only checked (:func:`refuse_if_served`). Raises ConfigError if another
    server holds the claim (one starting, or listening) or listens there already: without the
    claim two servers started at once would both find the path free, and the later bind would
    take the socket from the earlier server."""
    refuse_if_served(url)  # a directory named for the socket, a live server, a tcp:// port in use
    path = ipc_path(url)
    if path is None:
        return None
    ensure_private_dir(path.parent, "socket directory", socket_dir_hint())
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:  # what the bind would refuse after the arena is made
        if not stat.S_ISSOCK(st.st_mode):
            owner = path.with_name(path.name.removesuffix(CLAIM_SUFFIX))
            held = (" (the lock a kvxfer server holds for its socket beside it)"
                    if owner != path and socket_claimed(f"ipc://{owner}") else "")
            raise ConfigError(f"cannot listen at {url}: {path} exists and is not a socket{held}; choose another --url")
    claim = take_claim(url, path)
    try:
        refuse_if_served(url)  # a live socket of a server that holds no claim
    except BaseException:
        claim.release()
        raise
    return claim


def _socket_is_live(path: Path) -> bool:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def require_curve(url: str, curve: CurveServerKeys | None) -> None:
    """ConfigError for a tcp:// ``url`` without CURVE keys: kvxfer never serves tcp:// unauthenticated."""
    if url.startswith("tcp://") and curve is None:
        raise ConfigError(
            f"refusing to serve {url} without authentication: tcp:// needs CURVE keys "
            "(make them with `kvxfer keys DIR`, then `kvxfer serve --curve-dir DIR`), "
            "or use an ipc:// url"
        )


class MQServer:
    def __init__(
        self,
        url: str,
        dispatcher: Dispatcher,
        *,
        max_message_size: int,
        curve: CurveServerKeys | None = None,
        on_tick: Callable[[], None] | None = None,
        tick_s: float = 0.25,
        max_unread_reply_bytes: int = 64 << 20,
        on_unread_overflow: Callable[[bytes, int], None] | None = None,
        busy_poll_s: float = 0.0,
        max_connections: int = 1024,
        on_disconnect: Callable[[bytes], None] | None = None,
    ) -> None:
        self.url = url
        #: After any activity the loop polls without blocking for this long (see serve_forever).
        self._busy_poll_s = busy_poll_s
        self._dispatch = dispatcher
        self._on_tick = on_tick
        self._tick_s = tick_s
        self._max_unread = max_unread_reply_bytes
        self._on_overflow = on_unread_overflow
        #: Told the routing id of each ipc:// connection that closed, on the loop, outside any
        #: handler (ZeroMQ does not tell when a tcp:// peer goes).
        self._on_disconnect = on_disconnect
        self._curve = curve is not None and url.startswith("tcp://")
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._auth = None
        self._authorized: _Authorized | None = None
        self._authorized_dir: Path | None = None
        self._reload_lock = threading.Lock()
        self.dropped_frames = 0
        self._malformed = ThrottledLog(log)
        #: Replies waiting for a peer whose ZeroMQ queue is full, and their counted bytes.
        self._backlog: dict[bytes, collections.deque[tuple[bytes, bytes, bytes, int]]] = {}
        self._backlog_bytes: dict[bytes, int] = {}
        self._backlog_total = 0
        require_curve(url, curve)
        if url.startswith("tcp://"):
            assert curve is not None
            from zmq.auth.thread import ThreadAuthenticator

            self._auth = ThreadAuthenticator(self._ctx, log=_AuthLog())
            self._auth.start()
            self._authorized = _Authorized(curve.authorized)
            self._authorized_dir = curve.authorized_dir
            self._auth.configure_curve_callback(domain="*", credentials_provider=self._authorized)
            log.info("%s admits the %d client keys in %s (SIGHUP reads them again)", url, len(curve.authorized),
                     curve.authorized_dir)
        elif not url.startswith(("ipc://", "inproc://")):
            raise ConfigError(f"unsupported url {url!r}: use ipc://PATH or tcp://HOST:PORT")
        #: every descriptor the loop waits on (Linux epoll: one system call a wait, nothing rebuilt)
        self._poller = select.epoll()
        #: the ipc:// connections (None on tcp:// and inproc://, served by the ROUTER socket)
        self._unix: UnixListener | None = None
        #: (device, inode) of the socket file this server bound: the only file at its path it removes
        self._socket_file: tuple[int, int] | None = None
        try:
            self._listen(url, curve, max_message_size, max_unread_reply_bytes, max_connections)
        except BaseException:  # a refused bind leaves no thread or descriptor behind
            if self._unix is not None:
                self._unix.close()
            self._poller.close()
            if self._auth is not None:
                self._auth.stop()
            raise
        self._closed = False
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        #: written by call_soon and stop (any thread), read by the loop
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._wake_closed = False
        self._wake_lock = threading.Lock()
        self._stop = threading.Event()
        self._poller.register(self._wake_fd, select.EPOLLIN)
        #: What after_reply() queued, run once the current reply is sent.
        self._after: list[Callable[[], None]] = []
        #: Other file descriptors the loop polls (see watch()).
        self._watched: dict[int, Callable[[], None]] = {}
        self._loop_ident = 0
        #: When the loop next runs on_tick (see tick_by).
        self._next_tick = math.inf

    def _listen(self, url: str, curve: CurveServerKeys | None, max_message_size: int, max_unread_reply_bytes: int,
                max_connections: int) -> None:
        """Listen at ``url``: the Unix socket of ipc://, else the ROUTER socket (its fd polled)."""
        path = ipc_path(url)
        if path is not None:
            self._unix = UnixListener(
                self._bind_unix(path), str(path), self._poller, max_body=max_message_size + 1024,
                max_connections=max_connections,
                max_buffered=BACKLOG_CONNECTIONS * max(max_unread_reply_bytes, max_message_size + 1024))
        #: the ROUTER socket of tcp:// and inproc:// (None on ipc://) and its notification fd
        #: (edge-like: see serve_forever)
        self._router: zmq.Socket[bytes] | None = None
        self._router_fd = -1
        if self._unix is None:
            router = self._router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.MAXMSGSIZE, max_message_size)
            router.setsockopt(zmq.SNDHWM, REPLY_QUEUE)
            router.setsockopt(zmq.RCVHWM, request_queue(max_message_size, max_unread_reply_bytes))
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            router.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
            if curve is not None and url.startswith("tcp://"):
                router.curve_server = True
                router.curve_publickey = curve.public
                router.curve_secretkey = curve.secret
            try:
                router.bind(url)
            except zmq.ZMQError as exc:
                router.close(0)
                raise ConfigError(f"cannot listen at {url}: {exc}") from None
            self._router_fd = int(router.get(zmq.FD))
            self._poller.register(self._router_fd, select.EPOLLIN)

    def _bind_unix(self, path: Path) -> socket.socket:
        """The listening socket at ``path``: made 0600 in a private directory, after checking
        that nothing but a socket left by a dead server is there."""
        parent = path.parent
        refuse_if_served(self.url)  # a directory named for the socket, a live server: said as before the arena
        ensure_private_dir(parent, "socket directory", socket_dir_hint())
        try:
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise ConfigError(f"{path} exists and is not a socket; remove it or choose another --url")
            path.unlink()  # left behind by a server that died (refuse_if_served found nothing listening)
        except FileNotFoundError:  # nothing there, or gone meanwhile (a server that was stopping)
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is made 0600
        try:
            sock.bind(str(path))
        except OSError as exc:
            sock.close()
            raise ConfigError(f"cannot listen at {self.url}: {exc.strerror or exc}") from None
        finally:
            os.umask(old)
        sock.listen(128)
        st = os.lstat(path)
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            sock.close()
            raise ConfigError(f"the socket {path} is not what this server just bound (replaced?); "
                              f"{socket_dir_hint()}")
        self._socket_file = (st.st_dev, st.st_ino)
        return sock

    # ------------------------------------------------------------------ thread-safe

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop thread (from any thread): how workers finish requests."""
        self._calls.put(fn)
        self._wake()

    def stop(self) -> None:
        self._stop.set()
        self._wake()

    def _wake(self) -> None:
        with self._wake_lock:
            if not self._wake_closed:
                os.eventfd_write(self._wake_fd, 1)

    # ------------------------------------------------------------------ loop

    # ------------------------------------------------------------------ loop thread

    def in_loop(self) -> bool:
        """Whether the calling thread is the loop's."""
        return threading.get_ident() == self._loop_ident

    def tick_by(self, when: float) -> None:
        """Run the periodic task (``on_tick``) at ``when`` (``time.monotonic()``) at the latest,
        instead of at its next period (loop thread only): a deadline that must not wait for it."""
        if when < self._next_tick:
            self._next_tick = when

    def watch(self, fd: int, on_readable: Callable[[], None]) -> None:
        """Poll ``fd`` with the ROUTER socket and call ``on_readable`` on the loop when it is
        readable (loop thread only; the L2 tier's lookups use it). ``on_readable`` must not
        block; :meth:`unwatch` the fd before closing it."""
        try:
            self._poller.register(fd, select.EPOLLIN)
        except FileExistsError:  # still registered under a file this number named before
            self._poller.modify(fd, select.EPOLLIN)
        self._watched[fd] = on_readable

    def unwatch(self, fd: int) -> None:
        if self._watched.pop(fd, None) is not None:
            try:
                self._poller.unregister(fd)
            except OSError:  # closed already (epoll forgot it then)
                pass

    def serve_forever(self) -> None:
        poll = self._poller.poll
        unix = self._unix
        router = self._router
        wake_fd = self._wake_fd
        self._loop_ident = threading.get_ident()
        self._next_tick = time.monotonic() + self._tick_s
        busy_s = self._busy_poll_s
        hot_until = 0.0
        try:
            while not self._stop.is_set():
                # ZeroMQ signals its fd only for what comes after the socket was last used (a send
                # may take the signal of a request that came meanwhile): ask it before waiting
                router_ready = router is not None and router.get(_EVENTS) & _POLLIN  # type: ignore[operator]
                if busy_s and time.monotonic() < hot_until:
                    # busy polling: the thread keeps its CPU (no sleep to wake from), so a request
                    # that comes now finds the loop running (its own steps may still run cold:
                    # docs/performance.md, "Busy polling")
                    events = dict(poll(0))
                elif router_ready or (unix is not None and unix.ready):  # messages not handled yet
                    events = dict(poll(0))
                else:
                    timeout = max(0.0, self._next_tick - time.monotonic())
                    if self._backlog:  # retry soon: ZeroMQ does not say when a peer's queue has room
                        timeout = min(timeout, 0.005)
                    events = dict(poll(timeout + 0.0005))
                if busy_s and events:
                    hot_until = time.monotonic() + busy_s
                if self._backlog:
                    self._flush_backlog()
                if wake_fd in events:
                    try:
                        os.eventfd_read(wake_fd)
                    except BlockingIOError:
                        pass
                if not self._calls.empty():
                    self._flush_replies()
                if unix is not None:
                    if unix.fd in events:
                        unix.accept()
                    for fd, event in events.items():
                        if unix.owns(fd):
                            unix.on_event(fd, event)
                    if unix.ready:
                        for identity, peer, frames in unix.messages(256):  # bounded burst
                            self._handle([identity, *frames], peer)
                        if not self._calls.empty():
                            self._flush_replies()
                    closed = unix.take_closed()
                    if closed and self._on_disconnect is not None:
                        for identity in closed:
                            try:
                                self._on_disconnect(identity)
                            except Exception:  # must never stop the loop
                                log.exception("handling a closed connection failed")
                        self._run_after_reply()
                elif router is not None and (router_ready or self._router_fd in events):
                    # Bounded burst, then look at replies and ticks again. Asking EVENTS first
                    # avoids the zmq.Again exception of an empty recv (~10 us a request).
                    sock = router
                    authorized = self._authorized
                    for _ in range(256):
                        if not sock.get(_EVENTS) & _POLLIN:  # type: ignore[operator]  # EVENTS is an int option
                            break
                        first = sock.recv(_NOBLOCK, copy=False)
                        frames = [first.bytes]
                        while sock.get(_RCVMORE):
                            frames.append(sock.recv(_NOBLOCK))
                        peer = self._peer(first)
                        if authorized is not None and peer.rpartition("|")[2].encode() not in authorized.keys:
                            self._revoked(peer)  # its key was taken out of authorized/ since its handshake
                            continue
                        self._handle(frames, peer)
                    if not self._calls.empty():
                        self._flush_replies()
                if self._watched:
                    for fd in [fd for fd in self._watched if fd in events]:
                        callback = self._watched.get(fd)
                        try:
                            if callback is not None:
                                callback()
                        except Exception:  # a watcher must never stop the loop
                            log.exception("reading watched descriptor %d failed", fd)
                        self._run_after_reply()
                if time.monotonic() >= self._next_tick:
                    self._next_tick = time.monotonic() + self._tick_s
                    if unix is not None:
                        unix.tick()
                    if self._on_tick is not None:
                        try:
                            self._on_tick()
                        except Exception:  # a periodic task must never stop the loop
                            log.exception("periodic server task failed")
                        self._run_after_reply()  # its replies' (a lookup whose L2 read timed out)
        finally:
            self._flush_replies()
            self.close()

    def _revoked(self, peer: str) -> None:
        self.dropped_frames += 1
        self._malformed.warning("revoked", f"dropped a request of a tcp:// client whose CURVE public key "
                                           f"{peer.rpartition('|')[2][:40]!r} is no longer in the server's authorized/ "
                                           "folder (its connection stays open until it closes; nothing it sends "
                                           "is answered)")

    def _peer(self, frame: zmq.Frame) -> str:
        """Who sent ``frame``, as its connection says (see the module docstring)."""
        try:
            peer = "tcp:" + str(frame.get("Peer-Address"))  # (an IPv6 address is never read as an ipc:// peer)
        except zmq.ZMQError:  # (inproc:// has none)
            peer = ""
        if self._curve:
            try:
                peer += "|" + str(frame.get("User-Id"))
            except zmq.ZMQError:
                peer += "|"
        return peer

    def send(self, identity: bytes, request_id: bytes, status: bytes, payload: bytes) -> None:
        """Send a reply (loop thread only); it waits in the peer's backlog if ZeroMQ's queue for
        the peer is full, and is dropped if the peer is gone."""
        backlog = self._backlog.get(identity)
        if backlog is None and self._try_send(identity, request_id, status, payload):
            return
        if backlog is None:
            backlog = self._backlog[identity] = collections.deque()
            self._backlog_bytes[identity] = 0
        n = len(request_id) + len(status) + len(payload) + _REPLY_OVERHEAD
        backlog.append((request_id, status, payload, n))
        self._backlog_bytes[identity] += n
        self._backlog_total += n
        if self._backlog_bytes[identity] > self._max_unread:
            self._drop_backlog(identity)
        elif self._backlog_total > BACKLOG_CONNECTIONS * self._max_unread:
            self._drop_backlog(max(self._backlog_bytes, key=self._backlog_bytes.__getitem__))

    def _drop_backlog(self, identity: bytes) -> None:
        unread = self._backlog_bytes.pop(identity)
        self._backlog_total -= unread
        log.debug("dropped %d unread replies of a peer", len(self._backlog.pop(identity)))
        if self._unix is not None:
            self._unix.drop(identity)  # and its connection: nothing it sends is answered any more
        if self._on_overflow is not None:
            self._on_overflow(identity, unread)

    def _try_send(self, identity: bytes, request_id: bytes, status: bytes, payload: bytes) -> bool:
        """True when sent or dropped for good (peer gone); False when the peer's queue is full."""
        if self._unix is not None:
            return self._unix.try_send(identity, [request_id, status, payload])
        sock = self._router
        assert sock is not None
        try:
            # int flags and single sends: pyzmq's send_multipart does enum flag arithmetic per frame
            sock.send(identity, _MORE)  # multipart is atomic: only the first part can fail
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:  # EHOSTUNREACH: the peer is gone, nobody will read it
                log.warning("reply dropped: %s", exc)
            return True
        sock.send(request_id, _MORE)
        sock.send(status, _MORE)
        sock.send(payload, _NOBLOCK)
        return True

    def _flush_backlog(self) -> None:
        for identity in list(self._backlog):
            backlog = self._backlog[identity]
            while backlog:
                rid, status, payload, n = backlog[0]
                if not self._try_send(identity, rid, status, payload):
                    break
                backlog.popleft()
                self._backlog_bytes[identity] -= n
                self._backlog_total -= n
            if not backlog:
                del self._backlog[identity]
                del self._backlog_bytes[identity]

    def _flush_replies(self) -> None:
        while True:
            try:
                fn = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                fn()
            except Exception:
                log.exception("a deferred server task failed")
            self._run_after_reply()

    def after_reply(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop as soon as the reply being made now is sent, before anything
        else is handled (loop thread only: a handler's follow-up work that must not delay its
        reply, e.g. a prefetch after a lookup)."""
        self._after.append(fn)

    def _run_after_reply(self) -> None:
        while self._after:
            fn = self._after.pop(0)
            try:
                fn()
            except Exception:
                log.exception("a server task after a reply failed")

    def _handle(self, frames: list[bytes], peer: str) -> None:
        if len(frames) != 4 or len(frames[1]) != 8:
            self.dropped_frames += 1
            self._malformed.warning("frames", f"dropping a request of {len(frames)} frames (no request id to answer)")
            if len(frames) >= 2 and len(frames[1]) == 8:
                err = codec.encode(ErrorReply(ErrorCode.INVALID_REQUEST,
                                              f"a request has 3 frames [id, name, payload], got {len(frames) - 1}"))
                self.send(frames[0], frames[1], codec.ERR, err)
            return
        identity, rid, name, payload = frames
        out = self._dispatch(identity, peer, rid, name, payload)
        if out is not None:
            self.send(identity, rid, out[0], out[1])
        self._run_after_reply()

    @property
    def curve(self) -> bool:
        """Whether clients need an authorized CURVE key (a ``tcp://`` server)."""
        return self._authorized is not None

    def reload_authorized(self) -> int | None:
        """Read the ``authorized/`` folder of a ``tcp://`` server again (``kvxfer serve`` does on
        SIGHUP; any thread): the clients whose key is there now get in from their next handshake;
        the others are refused from theirs, and what they send on a connection already open is
        dropped unanswered from now on (as a handshake with an unknown key is). A folder that no
        longer reads as one of keys (gone, emptied, too many, a file that does not parse) is
        logged as an error and lets in only the clients it still lists readably of those let in
        before (:func:`kvxfer.security.reread_authorized_keys`): a revocation is never undone by
        a mistake elsewhere in the folder (a folder others may write lets no one in). Returns the
        number of keys now authorized, or None for an ``ipc://`` server."""
        from kvxfer.security import reread_authorized_keys

        if self._authorized is None or self._authorized_dir is None:
            log.warning("reload of authorized client keys asked for: %s uses no CURVE keys (ipc://)", self.url)
            return None
        with self._reload_lock:  # one at a time: the folder read last is the one kept
            before = self._authorized.keys
            keys, error = reread_authorized_keys(self._authorized_dir, before)
            self._authorized.keys = keys
        added, removed = len(keys - before), len(before - keys)
        if error is not None:
            log.error("authorized client keys read again from %s with an error, so no key was added: %s; %d of the "
                      "%d keys before stay (those still listed readably; %d removed)%s", self._authorized_dir,
                      error, len(keys), len(before), removed,
                      ": no client is let in until the folder lists one" if not keys else "")
        else:
            log.warning("authorized client keys reloaded from %s: %d now (%d added, %d removed; what a removed "
                        "key's open connections send is dropped unanswered)", self._authorized_dir, len(keys),
                        added, removed)
        return len(keys)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._router is not None:
            self._router.close(0)
        if self._unix is not None:
            self._unix.close()
        with self._wake_lock:
            self._wake_closed = True
            os.close(self._wake_fd)
        self._poller.close()
        if self._auth is not None:
            self._auth.stop()
        path = ipc_path(self.url)
        if path is not None and self._socket_file is not None:
            # only the file this server bound: its directory removed and a new server started
            # there meanwhile, the socket at the path is that server's, which would be cut off
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(path)
                if (st.st_dev, st.st_ino) == self._socket_file:
                    path.unlink()


class _Authorized:
    """The CURVE authenticator's check of a client's public key (z85): one of the authorized.
    ``keys`` is replaced whole (:meth:`MQServer.reload_authorized`), never changed in place."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


class _AuthLog:
    """The log of the CURVE authenticator (pyzmq's ZAP handler, which says everything at DEBUG):
    a client refused for a public key not in ``authorized/`` is a WARNING, at most one a second
    (anyone who reaches the port can cause it); the rest stays DEBUG on ``zmq.auth``. A client
    that has the wrong server public key fails before this handler: nothing says so."""

    def __init__(self) -> None:
        self._zmq = logging.getLogger("zmq.auth")
        self._refused = ThrottledLog(log)

    def debug(self, msg: str, *args: object) -> None:
        if msg.startswith("%s (CURVE") and len(args) == 3 and args[0] == "DENIED":
            key = args[2].decode("ascii", "replace") if isinstance(args[2], bytes) else str(args[2])
            self._refused.warning("curve refused", f"refused a tcp:// client: its CURVE public key {key[:40]!r} is not "
                                                   "in the server's authorized/ folder (add its .key file there and "
                                                   "send the server SIGHUP to let it in)")
        else:
            self._zmq.debug(msg, *args)

    def __getattr__(self, name: str) -> object:
        return getattr(self._zmq, name)
