"""The client half of messaging: a DEALER socket, used under a lock, and a background I/O thread.

``submit`` may be called from any thread: it sends the frames at once (what the socket cannot
take yet waits in a backlog the I/O thread sends). The I/O thread matches replies to futures by
request id, fails requests that pass their deadline, and sends a heartbeat (``ping``) when the
connection has been quiet for ``heartbeat_s``; while a thread waits in :meth:`MQClient.request`
as the *leader*, that thread reads the socket instead. When the server stops answering
heartbeats for ``dead_after_s`` every pending future fails with
:class:`kvxfer.errors.ConnectionFailed`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import select
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import zmq

from kvxfer.errors import ConfigError, ConnectionFailed, ErrorCode, ProtocolError, RequestTimeout, remote_error
from kvxfer.mq.futures import ReplyFuture
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
    what = "the server's socket directory"
    if not os.path.lexists(path.parent):
        return False
    check_trusted_parents(path.parent, what, socket_dir_hint())
    check_private_dir(path.parent, what, socket_dir_hint(), private=False)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
        kind = "socket" if stat.S_ISSOCK(st.st_mode) else "file that is not a socket"
        raise ConfigError(f"refusing to talk to {url}: {path} is a {kind} of uid {st.st_uid}, not of you "
                          f"(uid {os.geteuid()}); nothing was sent. {socket_dir_hint()}")
    return True


_UNSET: Any = object()

Reply = TypeVar("Reply", bound=Message)


@dataclass(slots=True)
class _Pending:
    #: None for the request of the leader thread (see ``request``): it reads ``ok``/``value``
    future: ReplyFuture[Any] | None
    name: str
    deadline: float
    #: sent by the I/O thread to keep the session alive; nobody waits for it
    heartbeat: bool = False
    ok: bool = False
    value: Any = _UNSET
    #: when it was sent: silence counts against the server only while a request older than
    #: dead_after_s waits (a request sent just after an outage is not failed at once)
    sent: float = field(default_factory=time.monotonic)


class MQClient:
    """One DEALER connection to ``url`` with a background I/O thread.

    The socket is guarded by a lock. ``submit`` sends its frames at once on the calling thread
    (no hand-off to the I/O thread: that hop cost ~60 us per request on a loaded 2-core host)
    and every holder of the lock drains replies that have arrived before releasing it. The I/O
    thread waits on the socket's file descriptor (``zmq.FD``, edge-triggered, so it never
    polls the ZeroMQ socket without the lock), then receives replies, expires deadlines and
    sends heartbeats. Futures are completed outside the lock, so callbacks may submit again.
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
    ) -> None:
        self.url = url
        self.default_timeout = default_timeout
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self._on_session_lost = on_session_lost
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        #: requests that could not be sent yet (the send queue was full): the I/O thread retries
        self._backlog: collections.deque[list[Any]] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTING_ID, os.urandom(16))
        if curve is not None:
            self._sock.curve_publickey = curve.public
            self._sock.curve_secretkey = curve.secret
            self._sock.curve_serverkey = curve.server_public
        self._sock.connect(url)
        self._fd: int = self._sock.get(zmq.FD)  # type: ignore[assignment]  # FD is an int option
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
        self._leader_poller = select.poll()  # one leader at a time: shared
        self._leader_poller.register(self._fd, select.POLLIN)
        self._leader_poller.register(self._leader_r, select.POLLIN)
        self._thread = threading.Thread(target=self._run, name=f"kvxfer-io-{url}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public

    def submit(self, payload: Request[Reply], timeout: float | None = None) -> ReplyFuture[Reply]:
        """Send ``payload`` (its type names the request); the future resolves to the decoded
        reply. ValueError for a Struct that is no request."""
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
                self._pending[rid] = _Pending(fut, name, deadline)
                if self._backlog or not self._send(frames):
                    self._backlog.append(frames)
                    self._wake()
                elif self._leader is None and not self._io_watching:
                    self._wake()  # nobody watches the socket for the reply
                done = self._drain()
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
        t = self.default_timeout if timeout is None else timeout
        name = spec_of(payload).name
        data = codec.encode(payload)
        with self._lock:
            lead = self._leader is None and not self._closed
            if lead:
                self._leader = threading.get_ident()
                rid = next(self._ids)
                slot = _Pending(None, name, time.monotonic() + t)
                self._pending[rid] = slot
                frames = [codec.pack_id(rid), name.encode(), data]
                if self._backlog or not self._send(frames):
                    self._backlog.append(frames)
                    self._wake()
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
                if done:
                    _complete(done)
        finally:
            with self._lock:
                self._leader = None
                if slot.value is _UNSET:
                    self._pending.pop(rid, None)
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

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake()
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            os.close(self._wake_w)
            with self._lock:
                if self._leader is None:
                    os.close(self._leader_r)
                    os.close(self._leader_w)

    # ------------------------------------------------------------------ socket (lock held)

    def _send(self, frames: list[Any]) -> bool:
        sock = self._sock
        try:
            sock.send(frames[0], _MORE)  # multipart is atomic: only the first part can fail
        except zmq.Again:
            return False
        sock.send(frames[1], _MORE)
        sock.send(frames[2], _NOBLOCK)
        self._last_send = time.monotonic()
        return True

    def _drain(self, until: _Pending | None = None) -> list[tuple[ReplyFuture[Any], bool, Any]]:
        """Receive every reply that has arrived (lock held). Whoever uses the socket must drain
        before releasing the lock: ``zmq.FD`` is edge-triggered and only signals new events.
        ``until`` is the leader's own request (no need to wake the leader for it)."""
        done: list[tuple[ReplyFuture[Any], bool, Any]] = []
        sock = self._sock
        if sock.closed:
            return done
        woke_sync = False
        while sock.get(_EVENTS) & _POLLIN:  # type: ignore[operator]  # EVENTS is an int option
            try:
                frames = [sock.recv(_NOBLOCK)]
                while sock.get(_RCVMORE):
                    frames.append(sock.recv(_NOBLOCK))
            except zmq.Again:
                break
            self._last_recv = time.monotonic()
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
        if (done or woke_sync) and until is None and self._leader is not None:
            # the leader may be asleep on the fd whose edge this drain consumed
            try:
                os.write(self._leader_w, b"x")
            except (BlockingIOError, OSError):
                pass
        return done

    # ------------------------------------------------------------------ I/O thread

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (a wake-up is already pending) or closed

    def _run(self) -> None:
        with_fd = select.poll()
        with_fd.register(self._fd, select.POLLIN)
        with_fd.register(self._wake_r, select.POLLIN)
        without_fd = select.poll()
        without_fd.register(self._wake_r, select.POLLIN)
        try:
            while True:
                with self._lock:
                    if self._closed:
                        return
                    while self._backlog and self._send(self._backlog[0]):
                        self._backlog.popleft()
                    done = self._drain()
                    now = time.monotonic()
                    done += self._expire(now)
                    if self._heartbeat_enabled:
                        if now - self._last_send >= self.heartbeat_s:
                            rid = next(self._ids)
                            self._pending[rid] = _Pending(ReplyFuture(self.url, "ping"), "ping",
                                                          now + self.dead_after_s, heartbeat=True)
                            if not self._send([codec.pack_id(rid), b"ping", codec.encode(Ping())]):
                                self._pending.pop(rid)
                            done += self._drain()
                        if now - self._last_recv > self.dead_after_s and any(
                                now - p.sent > self.dead_after_s for p in self._pending.values()):
                            done += self._fail_all(ConnectionFailed(
                                f"the kvxfer server at {self.url} stopped answering "
                                f"(nothing for {self.dead_after_s:.0f} s)"
                            ))
                self._io_watching = self._leader is None
                poller = with_fd if self._io_watching else without_fd
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
                self._sock.close(0)
                os.close(self._wake_r)
                if self._leader is not None:
                    try:
                        os.write(self._leader_w, b"x")  # its request just failed: wake it
                    except OSError:
                        pass
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
        if pending is None:
            return None  # a reply after its deadline: the request already failed
        name = pending.name
        try:
            if frames[1] == codec.OK:
                return pending, True, codec.decode(frames[2], REQUESTS[name].reply)
            if frames[1] == codec.ERR:
                err = codec.ERROR_DECODER.decode(frames[2])
                if err.code == ErrorCode.NO_SESSION and self._on_session_lost is not None:
                    self._on_session_lost()
                return pending, False, remote_error(err.code, err.message, name)
            return pending, False, ProtocolError(f"reply to {name!r} has unknown status {frames[1]!r}")
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return pending, False, ProtocolError(f"undecodable reply to {name!r} from {self.url}: {exc}")

    def _expire(self, now: float) -> list[tuple[ReplyFuture[Any], bool, Any]]:
        late = [rid for rid, p in self._pending.items() if p.deadline < now]
        done = []
        for rid in late:
            p = self._pending.pop(rid)
            if p.heartbeat:
                continue
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
