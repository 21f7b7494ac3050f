"""The client half of messaging: a DEALER socket owned by one background I/O thread.

``submit`` may be called from any thread: it queues the frames and wakes the I/O thread, which
sends them, matches replies to futures by request id, fails requests that pass their deadline,
and sends a heartbeat (``ping``) when the connection has been quiet for ``heartbeat_s``. When
the server stops answering heartbeats for ``dead_after_s`` every pending future fails with
:class:`kvxfer.errors.ConnectionFailed`.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from kvxfer.errors import ConnectionFailed, ProtocolError, RequestTimeout, remote_error
from kvxfer.mq.futures import ReplyFuture
from kvxfer.protocol import codec
from kvxfer.protocol.messages import Ping
from kvxfer.protocol.table import REQUESTS

__all__ = ["MQClient", "CurveClientKeys"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CurveClientKeys:
    """ZeroMQ CURVE keys for a tcp:// connection (z85 bytes)."""

    public: bytes
    secret: bytes
    server_public: bytes


@dataclass(slots=True)
class _Pending:
    future: ReplyFuture
    name: str
    deadline: float


class MQClient:
    """One DEALER connection to ``url`` with a background I/O thread."""

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
        self._ctx = zmq.Context.instance()
        self._outbox: queue.SimpleQueue[tuple[int, list[bytes], _Pending] | None] = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._wake_addr = f"inproc://kvxfer-wake-{id(self)}-{os.getpid()}"
        self._wake_recv = self._ctx.socket(zmq.PAIR)
        self._wake_recv.bind(self._wake_addr)
        self._wake_send = self._ctx.socket(zmq.PAIR)
        self._wake_send.connect(self._wake_addr)
        self._wake_lock = threading.Lock()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTING_ID, os.urandom(16))
        if curve is not None:
            self._sock.curve_publickey = curve.public
            self._sock.curve_secretkey = curve.secret
            self._sock.curve_serverkey = curve.server_public
        self._sock.connect(url)
        self._pending: dict[int, _Pending] = {}
        self._closed = False
        self._last_recv = time.monotonic()
        self._heartbeat_enabled = False
        self._thread = threading.Thread(target=self._run, name=f"kvxfer-io-{url}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public

    def submit(self, name: str, payload: msgspec.Struct, timeout: float | None = None) -> ReplyFuture:
        """Send request ``name`` with ``payload``; the future resolves to the decoded reply."""
        fut = ReplyFuture(self.url, name)
        if self._closed:
            fut.set_exception(ConnectionFailed(f"client for {self.url} is closed"))
            return fut
        if name not in REQUESTS:
            raise ValueError(f"unknown request {name!r}")
        rid = next(self._ids)
        deadline = time.monotonic() + (self.default_timeout if timeout is None else timeout)
        frames = [codec.pack_id(rid), name.encode(), codec.encode(payload)]
        self._outbox.put((rid, frames, _Pending(fut, name, deadline)))
        self._wake()
        return fut

    def request(self, name: str, payload: msgspec.Struct, timeout: float | None = None) -> Any:
        t = self.default_timeout if timeout is None else timeout
        # the I/O thread enforces the deadline; the extra second only covers scheduling
        return self.submit(name, payload, t).result(t + 1.0)

    def enable_heartbeat(self, heartbeat_s: float, dead_after_s: float) -> None:
        """Start heartbeats (after the handshake opened a session)."""
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self._last_recv = time.monotonic()
        self._heartbeat_enabled = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._outbox.put(None)
        self._wake()
        self._thread.join(timeout=5)
        self._wake_send.close(0)

    # ------------------------------------------------------------------ I/O thread

    def _wake(self) -> None:
        with self._wake_lock:
            if not self._wake_send.closed:
                self._wake_send.send(b"", zmq.NOBLOCK)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_recv, zmq.POLLIN)
        last_send = time.monotonic()
        try:
            while True:
                timeout_ms = max(1, int(min(self.heartbeat_s, 0.25) * 1000))
                events = dict(poller.poll(timeout_ms))
                if self._wake_recv in events:
                    while True:
                        try:
                            self._wake_recv.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                # send everything queued
                while True:
                    try:
                        item = self._outbox.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:
                        return
                    rid, frames, pending = item
                    self._pending[rid] = pending
                    self._sock.send_multipart(frames, copy=False)
                    last_send = time.monotonic()
                if self._sock in events:
                    while True:
                        try:
                            frames = self._sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._last_recv = time.monotonic()
                        self._on_reply(frames)
                now = time.monotonic()
                self._expire(now)
                if self._heartbeat_enabled:
                    if now - last_send >= self.heartbeat_s:
                        rid = next(self._ids)
                        fut = ReplyFuture(self.url, "ping")
                        self._pending[rid] = _Pending(fut, "ping", now + self.dead_after_s)
                        self._sock.send_multipart([codec.pack_id(rid), b"ping", codec.encode(Ping())])
                        last_send = now
                    if now - self._last_recv > self.dead_after_s and self._pending:
                        self._fail_all(ConnectionFailed(
                            f"the kvxfer server at {self.url} stopped answering "
                            f"(nothing for {self.dead_after_s:.0f} s)"
                        ))
        finally:
            self._fail_all(ConnectionFailed(f"client for {self.url} is closed"))
            self._sock.close(0)
            self._wake_recv.close(0)

    def _on_reply(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            log.warning("dropping a reply of %d frames from %s", len(frames), self.url)
            return
        try:
            rid = codec.unpack_id(frames[0])
        except ValueError:
            log.warning("dropping a reply with a bad request id from %s", self.url)
            return
        pending = self._pending.pop(rid, None)
        if pending is None:
            return  # a reply after its deadline: the future already failed
        fut, name = pending.future, pending.name
        try:
            if frames[1] == codec.OK:
                fut.set_result(codec.decode(frames[2], REQUESTS[name].reply))
            elif frames[1] == codec.ERR:
                err = codec.ERROR_DECODER.decode(frames[2])
                exc = remote_error(err.code, err.message, name)
                if err.code == "no_session" and self._on_session_lost is not None:
                    self._on_session_lost()
                fut.set_exception(exc)
            else:
                fut.set_exception(ProtocolError(f"reply to {name!r} has unknown status {frames[1]!r}"))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            fut.set_exception(ProtocolError(f"undecodable reply to {name!r} from {self.url}: {exc}"))

    def _expire(self, now: float) -> None:
        late = [rid for rid, p in self._pending.items() if p.deadline < now]
        for rid in late:
            p = self._pending.pop(rid)
            if p.name == "ping":
                continue
            p.future.set_exception(RequestTimeout(
                f"request {p.name!r} to the kvxfer server at {self.url} got no reply in time; "
                f"is the server running? (`kvxfer status --url {self.url}`)"
            ))

    def _fail_all(self, exc: Exception) -> None:
        pending, self._pending = self._pending, {}
        for p in pending.values():
            if not p.future.done():
                p.future.set_exception(exc)
