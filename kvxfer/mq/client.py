"""The client half of messaging: one connection, used under a lock, and a background I/O thread.

The connection is a Unix stream socket on ``ipc://`` (:mod:`kvxfer.mq.stream`; connected at the
first send, and again at the first send after the server closed it) and a ZeroMQ DEALER socket on
``tcp://`` (CURVE). ``submit`` may be called from any thread: it sends the frames at once (what
the socket cannot take yet waits in a backlog the I/O thread sends). The I/O thread matches replies to futures by
request id, fails requests that pass their deadline, and sends a heartbeat (``ping``) when the
connection has been quiet for ``heartbeat_s``; while a thread waits in :meth:`MQClient.request`
as the *leader*, that thread reads the socket instead. When the server stops answering
heartbeats for ``dead_after_s``, or closes the connection, every pending future fails with
:class:`kvxfer.errors.ConnectionFailed`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import select
import socket
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import zmq

from kvxfer.errors import ConfigError, ConnectionFailed, ErrorCode, ProtocolError, RequestTimeout, remote_error
from kvxfer.mq.futures import ReplyFuture
from kvxfer.mq.stream import READ_SIZE, FrameReader, FramingError, pack, peer_credentials, send_some
from kvxfer.private_dirs import check_private_dir, check_trusted_parents
from kvxfer.protocol import codec
from kvxfer.protocol.messages import Message, Ping, Request
from kvxfer.protocol.table import REQUESTS, spec_of
from kvxfer.urls import ipc_path, socket_dir_hint

__all__ = ["MQClient", "CurveClientKeys", "ipc_server_ready", "knock"]

log = logging.getLogger(__name__)

_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)
_RCVMORE = int(zmq.RCVMORE)
_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)


@dataclass(frozen=True, slots=True)
class CurveClientKeys:
    """ZeroMQ CURVE keys for a tcp:// connection (z85 bytes)."""

    public: bytes
    secret: bytes
    server_public: bytes


def knock(url: str, timeout: float = 1.0) -> str:
    """One plain connection attempt to the address of ``url`` (``ipc://`` or ``tcp://``), closed at
    once, nothing sent: ``"accepted"`` (a process listens there), ``"refused"`` (nothing does:
    for ``ipc://``, a socket file left by a process that is gone) or what else went wrong, in
    words. Says why a server did not answer; the caller has checked the socket file
    (:func:`ipc_server_ready`)."""
    import socket

    address: str | tuple[str, int]
    path = ipc_path(url)
    if path is not None:
        family, address = socket.AF_UNIX, str(path)
    elif url.startswith("tcp://"):
        host, _, port = url[len("tcp://"):].rpartition(":")
        family, address = socket.AF_INET6 if ":" in host else socket.AF_INET, (host.strip("[]"), int(port))
    else:
        return "not a socket address"
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(address)
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return f"no reply to a connection attempt within {timeout:g} s"
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return "accepted"


def ipc_server_ready(url: str) -> bool:
    """Whether a client may send to ``url`` now. For ``ipc://``: True once the socket is there
    in a directory that nobody else can write to (so nobody else can have put it there), and the
    socket is this user's; False while the socket or its directory is not there yet; raises
    :class:`kvxfer.errors.ConfigError` naming the path when either cannot be trusted (another
    user's socket, a directory others could write to, a symbolic link). Other urls: True (tcp://
    is authenticated by CURVE)."""
    path = ipc_path(url)
    if path is None:
        return True
    if "\0" in url:  # (check_url refuses it first for every client; the os functions raise ValueError)
        raise ConfigError(f"cannot reach {url!r}: its path holds a NUL character")
    try:
        return _socket_ready(url, path)
    except OSError as exc:  # a directory this user may not enter, a name too long, ...
        raise ConfigError(f"cannot reach {url}: {exc.filename or path}: {exc.strerror or exc}") from None


def _socket_ready(url: str, path: Path) -> bool:
    if os.path.isdir(path) and not os.path.islink(path):
        raise ConfigError(f"{url} names the directory {path}, not a socket: name the server's socket in it "
                          f"(`kvxfer serve` prints its url, e.g. ipc://{path / 'kvxfer.sock'})")
    what = "the server's socket directory"
    if not os.path.lexists(path.parent):
        return False
    check_trusted_parents(path.parent, what, socket_dir_hint())
    check_private_dir(path.parent, what, socket_dir_hint(), private=False)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"{url} is no server's socket: {path} is a file of another kind; nothing was sent "
                          "(`kvxfer serve` prints the url of its socket)")
    if st.st_uid != os.geteuid():
        raise ConfigError(f"refusing to talk to {url}: {path} is a socket of uid {st.st_uid}, not of you "
                          f"(uid {os.geteuid()}); nothing was sent. {socket_dir_hint()}")
    return True


class _ZmqWire:
    """A ZeroMQ DEALER connection (tcp://): its routing id random, CURVE when given keys.
    Every method is called with the client's lock held."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], url: str, curve: CurveClientKeys | None) -> None:
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTING_ID, os.urandom(16))
        if curve is not None:
            self._sock.curve_publickey = curve.public
            self._sock.curve_secretkey = curve.secret
            self._sock.curve_serverkey = curve.server_public
        try:
            self._sock.connect(url)
        except zmq.ZMQError as exc:  # a host ZeroMQ cannot connect to (e.g. *, serve's every-address)
            self._sock.close(0)
            hint = "; * names every address for kvxfer serve: a client names the server's host" if "*" in url else ""
            raise ConfigError(f"cannot connect to {url}: {exc}{hint}") from None
        #: never set: a ZeroMQ connection reconnects by itself
        self.ended = ""
        #: zmq.FD is edge-triggered: whoever polls it must receive until nothing is left
        self._fd: int = self._sock.get(zmq.FD)  # type: ignore[assignment]  # FD is an int option

    def fileno(self) -> int:
        return self._fd

    def wants_write(self) -> bool:
        return False

    def send(self, frames: list[bytes]) -> bool:
        """False when the socket cannot take the message now (nothing of it was sent)."""
        sock = self._sock
        try:
            sock.send(frames[0], _MORE)  # multipart is atomic: only the first part can fail
        except zmq.Again:
            return False
        sock.send(frames[1], _MORE)
        sock.send(frames[2], _NOBLOCK)
        return True

    def receive(self) -> list[list[bytes]]:
        """Every message that has arrived."""
        out: list[list[bytes]] = []
        sock = self._sock
        if sock.closed:
            return out
        while sock.get(_EVENTS) & _POLLIN:  # type: ignore[operator]  # EVENTS is an int option
            try:
                frames = [sock.recv(_NOBLOCK)]
                while sock.get(_RCVMORE):
                    frames.append(sock.recv(_NOBLOCK))
            except zmq.Again:
                break
            out.append(frames)
        return out

    def close(self) -> None:
        self._sock.close(0)


#: The longest reply a client reads (the server's own limit on requests is 16 MiB by default).
MAX_REPLY = 256 << 20
#: How long a connect waits while the server's queue of new connections is full (the
#: client's lock is held meanwhile: every thread of the client waits).
CONNECT_WAIT_S = 1.0


class _UnixWire:
    """A Unix stream connection (ipc://), made at the first send and again at the first send
    after the server closed it. Every method is called with the client's lock held."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._sock: socket.socket | None = None
        self._reader = FrameReader(MAX_REPLY)
        #: the unsent rest of a message the socket took only part of
        self._out: list[memoryview] = []
        #: why the connection ended, once it did (the client reads and clears it)
        self.ended = ""

    def fileno(self) -> int:
        return -1 if self._sock is None else self._sock.fileno()

    def wants_write(self) -> bool:
        return bool(self._out)

    def _connect(self) -> socket.socket:
        path = ipc_path(self._url)
        assert path is not None
        if not ipc_server_ready(self._url):  # raises for a socket that cannot be trusted
            raise ConnectionFailed(f"no kvxfer server is listening at {self._url}: {path} does not exist")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Non-blocking: a blocking connect to a server whose queue of new connections is full
        # (a stuck or stopped server) would wait forever, with the client's lock held.
        sock.setblocking(False)
        give_up = time.monotonic() + CONNECT_WAIT_S
        while True:
            try:
                sock.connect(str(path))
                break
            except BlockingIOError:
                if time.monotonic() < give_up:
                    time.sleep(0.005)  # a burst of connections: the server accepts them soon
                    continue
                sock.close()
                raise ConnectionFailed(
                    f"the kvxfer server at {self._url} accepts no connections: its queue of new "
                    f"connections stayed full for {CONNECT_WAIT_S:g} s (is it stuck or stopped? "
                    f"`kvxfer status --url {self._url}`)") from None
            except OSError as exc:
                sock.close()
                why = ("nothing listens there: its server is gone" if isinstance(exc, ConnectionRefusedError)
                       else exc.strerror or type(exc).__name__)
                raise ConnectionFailed(f"cannot connect to the kvxfer server at {self._url} ({why})") from None
        # who listens, as the kernel knows it: the checks of the socket's path above cannot see a
        # file swapped after them, or a socket another user's process listens on
        _, uid, _ = peer_credentials(sock)
        if uid != os.geteuid():
            sock.close()
            raise ConfigError(f"refusing to talk to {self._url}: the process listening there is of uid {uid}, "
                              f"not of you (uid {os.geteuid()}); nothing was sent. {socket_dir_hint()}")
        self._reader = FrameReader(MAX_REPLY)
        self._out = []
        self._sock = sock
        return sock

    def send(self, frames: list[bytes]) -> bool:
        """False while an earlier message is still being sent; raises ConnectionFailed when no
        connection can be made."""
        if self._out and not self._flush():
            return False
        if self._sock is None:
            self._connect()
        self._out = [memoryview(b) for b in pack(frames)]
        self._flush()
        return True

    def _flush(self) -> bool:
        """Send what waits; True once nothing does."""
        out, sock = self._out, self._sock
        if sock is None:
            out.clear()
            return True
        try:
            return send_some(sock, out)
        except OSError:
            out.clear()  # the connection is gone: receive() reports it
            return True

    def receive(self) -> list[list[bytes]]:
        """Every whole message that has arrived. When the connection ended (the server closed
        it), :attr:`ended` says so after the messages that came before; the next send connects
        again."""
        out: list[list[bytes]] = []
        sock = self._sock
        if sock is None:
            return out
        if self._out:
            self._flush()
        reader = self._reader
        closed = ""
        while True:
            try:
                data = sock.recv(READ_SIZE)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                closed = exc.strerror or type(exc).__name__
                break
            if not data:
                closed = "closed by the server"
                break
            reader.feed(data)
        try:
            while (frames := reader.next()) is not None:
                out.append(frames)
        except FramingError as exc:
            closed = f"undecodable: {exc}"
        if closed:
            self.close()
            self.ended = f"the connection to the kvxfer server at {self._url} ended ({closed})"
        return out

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._out = []


_UNSET: Any = object()
#: Requests of ``late_names`` remembered after their deadline, for a reply that may still come.
_EXPIRED_KEPT = 1024

Reply = TypeVar("Reply", bound=Message)


@dataclass(slots=True)
class _Pending:
    #: None for the request of the leader thread (see ``request``): it reads ``ok``/``value``
    future: ReplyFuture[Any] | None
    name: str
    deadline: float
    #: sent by the I/O thread to keep the session alive; nobody waits for it
    heartbeat: bool = False
    #: the request, kept for ``on_late_reply`` (requests named in ``late_names`` only)
    payload: Any = None
    ok: bool = False
    value: Any = _UNSET
    #: when it was sent: silence counts against the server only while a request older than
    #: dead_after_s waits (a request sent just after an outage is not failed at once)
    sent: float = field(default_factory=time.monotonic)


class MQClient:
    """One connection to ``url`` (a Unix stream socket on ``ipc://``, a ZeroMQ DEALER on
    ``tcp://``) with a background I/O thread.

    The socket is guarded by a lock. ``submit`` sends its frames at once on the calling thread
    (no hand-off to the I/O thread: that hop cost ~60 us per request on a loaded 2-core host)
    and every holder of the lock drains replies that have arrived before releasing it. The I/O
    thread waits on the socket's file descriptor (for ZeroMQ ``zmq.FD``, edge-triggered, so it
    never polls the ZeroMQ socket without the lock) while no leader does, then receives
    replies, expires deadlines and sends heartbeats. Futures are completed outside the lock, so
    callbacks may submit again. Messages go out in the order they were submitted: one the socket
    cannot take now waits in a backlog, and later ones queue behind it.
    """

    def __init__(
        self,
        url: str,
        *,
        default_timeout: float = 30.0,
        heartbeat_s: float = 1.0,
        dead_after_s: float = 6.0,
        curve: CurveClientKeys | None = None,
        on_session_lost: Callable[[], None] | None = None,
        on_late_reply: Callable[[str, Any, Any], None] | None = None,
        late_names: frozenset[str] = frozenset(),
    ) -> None:
        """``on_late_reply(name, request, reply)`` is called, on a thread of its own, with the
        reply to a request named in ``late_names`` that came after the request had failed for its
        deadline (``reply`` None where the server answered with an error): the server is done with
        it (e.g. release what it granted)."""
        self.url = url
        #: The process that made this connection: a process forked from it may not use it (its
        #: requests would go out on the same socket and take the parent's replies).
        self.pid = os.getpid()
        self.default_timeout = default_timeout
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self._on_session_lost = on_session_lost
        self._on_late_reply = on_late_reply
        self._late_names = late_names
        #: requests of late_names that failed for their deadline: id -> (name, request), the newest kept
        self._expired: collections.OrderedDict[int, tuple[str, Any]] = collections.OrderedDict()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        #: requests that could not be sent yet (the send queue was full): the I/O thread retries
        self._backlog: collections.deque[list[Any]] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._wire: _ZmqWire | _UnixWire = (_UnixWire(url) if ipc_path(url) is not None
                                            else _ZmqWire(self._ctx, url, curve))
        self._pending: dict[int, _Pending] = {}
        self._closed = False
        self._last_recv = time.monotonic()
        self._last_send = time.monotonic()
        self._heartbeat_enabled = False
        #: a thread in request() that receives on the socket itself while it waits (one at a
        #: time); while there is one, the I/O thread leaves the socket's fd to it
        self._leader: int | None = None
        self._leader_r, self._leader_w = os.pipe()
        os.set_blocking(self._leader_r, False)
        os.set_blocking(self._leader_w, False)
        self._io_watching = False
        #: set by close() once the I/O thread is gone: the last leader closes its pipe
        self._pipes_closing = False
        #: the leader's poller (one leader at a time: shared) and the connection's fd it watches
        self._leader_poller = select.poll()
        self._leader_poller.register(self._leader_r, select.POLLIN)
        self._leader_fd = -1
        self._thread = threading.Thread(target=self._run, name=f"kvxfer-io-{url}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public

    def submit(self, payload: Request[Reply], timeout: float | None = None) -> ReplyFuture[Reply]:
        """Send ``payload`` (its type names the request); the future resolves to the decoded
        reply. ValueError for a Struct that is no request; ConfigError in a forked child."""
        self._check_process()
        name = spec_of(payload).name
        fut: ReplyFuture[Reply] = ReplyFuture(self.url, name)
        rid = next(self._ids)
        frames = [codec.pack_id(rid), name.encode(), codec.encode(payload)]
        deadline = time.monotonic() + (self.default_timeout if timeout is None else timeout)
        with self._lock:
            if self._closed:
                closed = True
            else:
                closed = False
                self._pending[rid] = _Pending(fut, name, deadline,
                                              payload=payload if name in self._late_names else None)
                done: list[tuple[ReplyFuture[Any], bool, Any]] = []
                if self._backlog:
                    self._backlog.append(frames)
                    self._wake()
                else:
                    sent, done = self._send_or_fail(frames)
                    if not sent and not done:
                        self._backlog.append(frames)
                        self._wake()
                    elif self._leader is None and not self._io_watching:
                        self._wake()  # nobody watches the socket for the reply
                done += self._drain()
        if closed:
            fut.set_exception(ConnectionFailed(f"client for {self.url} is closed"))
            return fut
        _complete(done)
        return fut

    def request(self, payload: Request[Reply], timeout: float | None = None) -> Reply:
        """Send and wait for the decoded reply (raises the request's error).

        The first thread waiting here becomes the *leader*: it receives on the socket itself
        (no thread hand-off on the way back, no future) and completes whatever other replies
        it reads; threads that come while there is a leader wait on futures.
        """
        self._check_process()
        t = self.default_timeout if timeout is None else timeout
        name = spec_of(payload).name
        data = codec.encode(payload)
        with self._lock:
            lead = self._leader is None and not self._closed
            if lead:
                self._leader = threading.get_ident()
                rid = next(self._ids)
                slot = _Pending(None, name, time.monotonic() + t,
                                payload=payload if name in self._late_names else None)
                self._pending[rid] = slot
                frames = [codec.pack_id(rid), name.encode(), data]
                try:
                    if self._backlog or not self._send(frames):
                        self._backlog.append(frames)
                        self._wake()
                except (ConnectionFailed, ConfigError):
                    self._pending.pop(rid, None)
                    self._leader = None
                    raise
                self._leader_watch()
        if not lead:
            # the I/O thread (or the leader) enforces the deadline; +1 s covers scheduling
            return self.submit(payload, t).result(t + 1.0)
        try:
            give_up = time.monotonic() + t + 1.0
            poll = self._leader_poller.poll
            while slot.value is _UNSET:
                remaining = give_up - time.monotonic()
                if remaining <= 0:
                    break
                for fd, _ in poll(max(1, min(int(remaining * 1000), 250))):
                    if fd == self._leader_r:
                        _read_all(self._leader_r)
                with self._lock:
                    done = self._drain(until=slot)
                    self._leader_watch()
                if done:
                    _complete(done)
        finally:
            with self._lock:
                self._leader = None
                if self._pipes_closing:
                    self._close_leader_pipe()  # close() came while this thread waited
                if slot.value is _UNSET and self._pending.pop(rid, None) is not None:
                    self._keep_expired(rid, slot)
                if self._pending and not self._io_watching:
                    self._wake()  # hand the socket (and what may be left in it) back to the I/O thread
        if slot.value is _UNSET:
            raise RequestTimeout(
                f"request {name!r} to the kvxfer server at {self.url} got no reply within {t:g} s; "
                f"is the server running and not overloaded? (`kvxfer status --url {self.url}`)"
            )
        if slot.ok:
            return slot.value
        raise slot.value

    def enable_heartbeat(self, heartbeat_s: float, dead_after_s: float) -> None:
        """Start heartbeats (after the handshake opened a session)."""
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self._last_recv = time.monotonic()
        self._heartbeat_enabled = True

    @property
    def forked(self) -> bool:
        """Whether this process is a child forked from the one that made the connection."""
        return os.getpid() != self.pid

    def _check_process(self) -> None:
        if self.forked:
            raise ConfigError(f"this connection to {self.url} was made by process {self.pid}, and process "
                              f"{os.getpid()} was forked from it: make a CacheClient of its own in the child (requests "
                              "on the inherited connection would go out on the parent's socket and take its replies)")

    def close(self) -> None:
        if self.forked:  # the parent's connection, thread and pipes are the parent's: only let go of them here
            self._closed = True
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake()
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            with self._lock:
                # -1 after closing: a late write fails (EBADF) instead of reaching a file that
                # reused the number
                os.close(self._wake_w)
                self._wake_w = -1
                self._pipes_closing = True
                if self._leader is None:
                    self._close_leader_pipe()

    def _close_leader_pipe(self) -> None:
        """Close the leader's wake-up pipe (lock held): by close(), or by the thread that was
        the leader when close() came, as it leaves."""
        if self._leader_r >= 0:
            os.close(self._leader_r)
            os.close(self._leader_w)
            self._leader_r = self._leader_w = -1

    # ------------------------------------------------------------------ socket (lock held)

    def _send(self, frames: list[Any]) -> bool:
        """False when the connection cannot take the message now; raises ConnectionFailed (or
        ConfigError, for an ipc:// socket that cannot be trusted) when no connection can be made."""
        wire = self._wire
        if not wire.send(frames):
            return False
        self._last_send = time.monotonic()
        if wire.wants_write():
            self._wake()  # the socket took part of it: the I/O thread sends the rest as it drains
        return True

    def _drain(self, until: _Pending | None = None) -> list[tuple[ReplyFuture[Any], bool, Any]]:
        """Receive every reply that has arrived (lock held). Whoever uses the socket must drain
        before releasing the lock: ``zmq.FD`` is edge-triggered and only signals new events.
        ``until`` is the leader's own request (no need to wake the leader for it). When the
        connection ended, every request still waiting fails with ConnectionFailed."""
        done: list[tuple[ReplyFuture[Any], bool, Any]] = []
        woke_sync = False
        messages = self._wire.receive()
        if messages:
            self._last_recv = time.monotonic()
        for frames in messages:
            out = self._on_reply(frames)
            if out is None:
                continue
            pending, ok, value = out
            if pending.future is None:
                # never stop early, even at the leader's own reply: only a read that finds the
                # socket empty re-arms the edge of zmq.FD for the next message
                pending.ok, pending.value = ok, value
                if pending is not until:
                    woke_sync = True
            else:
                done.append((pending.future, ok, value))
        if self._wire.ended:
            ended, self._wire.ended = self._wire.ended, ""
            self._backlog.clear()
            woke_sync = True  # the leader's own request fails too
            done += self._fail_all(ConnectionFailed(ended))
        if (done or woke_sync) and until is None:
            self._wake_leader()  # it may be asleep on the fd whose edge this drain consumed
        return done

    # ------------------------------------------------------------------ I/O thread

    def _wake(self) -> None:
        """Wake the I/O thread."""
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (a wake-up is already pending) or closed

    def _wake_leader(self) -> None:
        """Wake the thread waiting in request() as the leader, if there is one (lock held)."""
        if self._leader is not None:
            try:
                os.write(self._leader_w, b"x")
            except (BlockingIOError, OSError):
                pass  # a wake-up is already pending, or the pipe is closed

    def _send_or_fail(self, frames: list[Any]) -> tuple[bool, list[tuple[ReplyFuture[Any], bool, Any]]]:
        """:meth:`_send` for the I/O thread: when no connection can be made, every waiting
        request fails with the reason (lock held)."""
        try:
            return self._send(frames), []
        except (ConnectionFailed, ConfigError) as exc:
            self._backlog.clear()
            self._wake_leader()  # its request fails too
            return False, self._fail_all(exc)

    def _leader_watch(self) -> None:
        """Point the leader's poller at the connection's current fd, for replies (lock held; an
        ipc:// connection is made again after the server closed it). The rest of a message the
        socket took only in part is the I/O thread's to send, with the backlog behind it."""
        fd = self._wire.fileno()
        if fd != self._leader_fd:
            if self._leader_fd >= 0:
                self._leader_poller.unregister(self._leader_fd)
            if fd >= 0:
                self._leader_poller.register(fd, select.POLLIN)
            self._leader_fd = fd

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closed:
                        return
                    done = []
                    while self._backlog:
                        sent, failed = self._send_or_fail(self._backlog[0])
                        done += failed
                        if not sent:
                            break
                        self._backlog.popleft()
                    done += self._drain()
                    now = time.monotonic()
                    done += self._expire(now)
                    if self._heartbeat_enabled:
                        if now - self._last_send >= self.heartbeat_s:
                            rid = next(self._ids)
                            self._pending[rid] = _Pending(ReplyFuture(self.url, "ping"), "ping",
                                                          now + self.dead_after_s, heartbeat=True)
                            try:
                                sent = self._send([codec.pack_id(rid), b"ping", codec.encode(Ping())])
                            except (ConnectionFailed, ConfigError):
                                sent = False  # no server to connect to: requests fail on their own
                            if not sent:
                                self._pending.pop(rid)
                            done += self._drain()
                        if now - self._last_recv > self.dead_after_s and any(
                                now - p.sent > self.dead_after_s for p in self._pending.values()):
                            done += self._fail_all(ConnectionFailed(
                                f"the kvxfer server at {self.url} stopped answering "
                                f"(nothing for {self.dead_after_s:.0f} s)"
                            ))
                    # the socket is watched here only for replies nobody else waits on: never
                    # beside a leader (both would wake for its reply), nor with nothing pending
                    # (a submit wakes this thread). The rest of a message the socket took only
                    # part of is always sent from here, leader or not: nobody else waits for the
                    # socket to drain.
                    self._io_watching = self._leader is None and bool(self._pending)
                    poller = select.poll()
                    poller.register(self._wake_r, select.POLLIN)
                    fd = self._wire.fileno()
                    events = ((select.POLLIN if self._io_watching else 0)
                              | (select.POLLOUT if self._wire.wants_write() else 0))
                    if events and fd >= 0:
                        poller.register(fd, events)
                _complete(done)
                timeout_ms = max(1, int(min(self.heartbeat_s, 0.25) * 1000))
                for fd, _ in poller.poll(timeout_ms):
                    if fd == self._wake_r:
                        _read_all(self._wake_r)
        finally:
            with self._lock:
                done = self._fail_all(ConnectionFailed(f"client for {self.url} is closed"))
                self._backlog.clear()
                self._io_watching = False
                self._wire.close()
                os.close(self._wake_r)
                self._wake_leader()  # its request just failed
            _complete(done)

    def _on_reply(self, frames: list[bytes]) -> tuple[_Pending, bool, Any] | None:
        if len(frames) != 3:
            log.warning("dropping a reply of %d frames from %s", len(frames), self.url)
            return None
        try:
            rid = codec.unpack_id(frames[0])
        except ValueError:
            log.warning("dropping a reply with a bad request id from %s", self.url)
            return None
        pending = self._pending.pop(rid, None)
        if pending is None:  # a reply after its deadline: the request already failed
            late = self._expired.pop(rid, None)
            if late is not None and frames[1] in (codec.OK, codec.ERR) and self._on_late_reply is not None:
                self._late_reply(*late, frames[2] if frames[1] == codec.OK else None)
            return None
        name = pending.name
        try:
            if frames[1] == codec.OK:
                return pending, True, codec.decode(frames[2], REQUESTS[name].reply)
            if frames[1] == codec.ERR:
                err = codec.ERROR_DECODER.decode(frames[2])
                if err.code == ErrorCode.NO_SESSION and pending.heartbeat:
                    # the server lost the session (it restarted): pinging it again only adds
                    # no_session errors to its figures; the next request finds out and
                    # handshakes again, which restarts the heartbeat (enable_heartbeat)
                    self._heartbeat_enabled = False
                if err.code == ErrorCode.NO_SESSION and self._on_session_lost is not None:
                    self._on_session_lost()
                return pending, False, remote_error(err.code, err.message, name)
            return pending, False, ProtocolError(f"reply to {name!r} has unknown status {frames[1]!r}")
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return pending, False, ProtocolError(f"undecodable reply to {name!r} from {self.url}: {exc}")

    def _keep_expired(self, rid: int, p: _Pending) -> None:
        """Remember a request of ``late_names`` that failed for its deadline (lock held)."""
        if p.payload is None or self._on_late_reply is None:
            return
        self._expired[rid] = (p.name, p.payload)
        while len(self._expired) > _EXPIRED_KEPT:
            self._expired.popitem(last=False)

    def _late_reply(self, name: str, payload: Any, data: bytes | None) -> None:
        """Hand a late reply (``data`` None: an error reply) to ``on_late_reply`` on a thread of
        its own (it may send requests)."""
        try:
            reply = codec.decode(data, REQUESTS[name].reply) if data is not None else None
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        callback = self._on_late_reply
        assert callback is not None
        threading.Thread(target=callback, args=(name, payload, reply), name="kvxfer-late-reply", daemon=True).start()

    def _expire(self, now: float) -> list[tuple[ReplyFuture[Any], bool, Any]]:
        late = [rid for rid, p in self._pending.items() if p.deadline < now]
        done = []
        for rid in late:
            p = self._pending.pop(rid)
            if p.heartbeat:
                continue
            self._keep_expired(rid, p)
            exc = RequestTimeout(
                f"request {p.name!r} to the kvxfer server at {self.url} got no reply in time; "
                f"is the server running? (`kvxfer status --url {self.url}`)"
            )
            if p.future is None:
                p.ok, p.value = False, exc  # the leader sees it when it next wakes
            else:
                done.append((p.future, False, exc))
        return done

    def _fail_all(self, exc: Exception) -> list[tuple[ReplyFuture[Any], bool, Any]]:
        pending, self._pending = self._pending, {}
        done = []
        for p in pending.values():
            if p.future is None:
                p.ok, p.value = False, exc
            else:
                done.append((p.future, False, exc))
        return done


def _read_all(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except (BlockingIOError, OSError):
        pass


def _complete(done: list[tuple[ReplyFuture[Any], bool, Any]]) -> None:
    """Resolve futures (outside the socket lock: callbacks may submit)."""
    for fut, ok, value in done:
        if fut.done():
            continue
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)
