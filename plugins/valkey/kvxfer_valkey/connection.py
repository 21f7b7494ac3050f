"""Connections of the ``valkey`` client whose own replies are bounded: :class:`BoundedConnection`.

The backend moves values through its own reader (:mod:`kvxfer_valkey.resp`), bounded in size and
time. Everything else a connection reads goes through valkey-py's parser: the handshake (AUTH,
CLIENT SETNAME, SELECT), PING, and on a cluster COMMAND and CLUSTER SLOTS. That parser waits for
a reply whole, however long it takes to come (its socket timeout bounds each read, not the
reply) and however large it says it is. So the connections the backend's clients make read
through a :class:`BoundedSocket`: whatever comes after a send must arrive within the connection's
socket timeout of that send and be at most :data:`REPLY_MAX_BYTES`, or the read fails (the client
then drops the connection). The backend's own reader uses the plain socket underneath
(:func:`raw_socket`), with its own bounds.

A CLUSTER SLOTS reply is checked before the cluster client uses it
(:func:`check_cluster_slots`): slot numbers are those of a cluster, and it names at most
:data:`MAX_CLUSTER_NODES` nodes, since the backend opens connections to every primary.
"""

from __future__ import annotations

import socket
import time
from typing import Any, Final

from valkey.connection import Connection, SSLConnection
from valkey.exceptions import DataError

__all__ = ["BoundedConnection", "BoundedSSLConnection", "BoundedSocket", "MAX_CLUSTER_NODES", "REPLY_MAX_BYTES",
           "check_cluster_slots", "raw_socket"]

#: Most bytes read through valkey-py's parser after one send: its largest reply is COMMAND's
#: (about 90 KiB from Valkey 8), then CLUSTER SLOTS (about 150 bytes per slot range).
REPLY_MAX_BYTES: Final = 4 << 20
#: Most nodes (primaries and replicas) a CLUSTER SLOTS reply may name: Valkey's own advice for a
#: cluster is at most about 1,000 nodes. The backend holds connections to every primary.
MAX_CLUSTER_NODES: Final = 1000
#: Hash slots of a Valkey cluster.
CLUSTER_SLOTS: Final = 16384
_NODE_NAME_MAX: Final = 255
_UNCHANGED: Final = object()


class BoundedSocket:
    """A connected socket (plain or TLS) whose reads after each send are bounded: they end within
    ``limit_s`` of the send and take at most ``max_bytes`` in all, else raise (``TimeoutError``, or
    ``OSError`` for too many bytes). Non-blocking reads (a timeout of 0: valkey-py's check for
    unread data before it lends a connection) are not timed. Everything else is the socket's."""

    __slots__ = ("raw", "_limit_s", "_max", "_deadline", "_got")

    def __init__(self, raw: socket.socket, limit_s: float, max_bytes: int = REPLY_MAX_BYTES) -> None:
        self.raw = raw
        self._limit_s = limit_s
        self._max = max_bytes
        self._start()

    def _start(self) -> None:
        self._deadline = time.monotonic() + self._limit_s
        self._got = 0

    def send(self, data: Any, *flags: int) -> int:
        self._start()
        return self.raw.send(data, *flags)

    def sendall(self, data: Any, *flags: int) -> None:
        self._start()
        self.raw.sendall(data, *flags)

    def recv(self, n: int, *flags: int) -> bytes:
        before = self._bound()
        try:
            data = self.raw.recv(n, *flags)
        finally:
            if before is not _UNCHANGED:
                self.raw.settimeout(before)
        self._count(len(data))
        return data

    def recv_into(self, buffer: Any, n: int = 0, *flags: int) -> int:
        before = self._bound()
        try:
            got = self.raw.recv_into(buffer, n, *flags)
        finally:
            if before is not _UNCHANGED:
                self.raw.settimeout(before)
        self._count(got)
        return got

    def _bound(self) -> Any:
        """Shorten the socket's timeout to what is left of the reply's time (returns the timeout
        to restore, or ``_UNCHANGED``); raise TimeoutError when none is left."""
        timeout = self.raw.gettimeout()
        if timeout == 0:
            return _UNCHANGED
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no whole reply within {self._limit_s:g} s")
        if timeout is None or timeout > left:
            self.raw.settimeout(left)
            return timeout
        return _UNCHANGED

    def _count(self, n: int) -> None:
        self._got += n
        if self._got > self._max:
            raise OSError(f"a reply of more than {self._max} bytes")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


def raw_socket(conn: Connection) -> socket.socket | None:
    """The plain socket of a connection (under its :class:`BoundedSocket`), or None."""
    sock = conn._sock
    return sock.raw if isinstance(sock, BoundedSocket) else sock


class _Bounded(Connection):
    """Reads through a :class:`BoundedSocket` (each reply within the socket timeout of its send,
    at most :data:`REPLY_MAX_BYTES`), and checks CLUSTER SLOTS replies."""

    _asked = ""

    def _connect(self) -> Any:
        raw = super()._connect()
        return BoundedSocket(raw, self.socket_timeout if self.socket_timeout else 5.0)

    def send_command(self, *args: Any, **kwargs: Any) -> None:
        self._asked = " ".join(str(a) for a in args[:2]).upper()
        super().send_command(*args, **kwargs)

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        asked, self._asked = self._asked, ""
        reply = super().read_response(*args, **kwargs)
        if asked.startswith("CLUSTER SLOTS"):
            try:
                check_cluster_slots(reply)
            except DataError:
                self.disconnect()
                raise
        return reply


class BoundedConnection(_Bounded, Connection):
    """A TCP connection of the backend's clients (see the module docstring)."""


class BoundedSSLConnection(_Bounded, SSLConnection):
    """A TLS connection of the backend's clients (``valkeys://``; see the module docstring)."""


def check_cluster_slots(reply: Any) -> None:
    """Raise DataError unless ``reply`` is a CLUSTER SLOTS reply a cluster could send: ranges of
    slots in [0, 16383], each with a primary and replicas named by host (at most 255 printable
    characters) and port, at most :data:`MAX_CLUSTER_NODES` nodes in all. The cluster client
    walks every slot of every range and connects to every node named: a node's reply must not
    choose how long that takes."""
    if not isinstance(reply, list) or len(reply) > CLUSTER_SLOTS:
        raise DataError(f"CLUSTER SLOTS answered {_what(reply)}, not a list of at most {CLUSTER_SLOTS} slot ranges")
    nodes: set[tuple[str, int]] = set()
    for entry in reply:
        if not isinstance(entry, list) or len(entry) < 3:
            raise DataError(f"CLUSTER SLOTS answered a slot range {_what(entry)}")
        first, last = entry[0], entry[1]
        if not (isinstance(first, int) and isinstance(last, int) and 0 <= first <= last < CLUSTER_SLOTS):
            raise DataError(f"CLUSTER SLOTS answered a slot range {_what(first)}..{_what(last)}, outside "
                            f"0..{CLUSTER_SLOTS - 1}")
        for node in entry[2:]:
            if not isinstance(node, list) or len(node) < 2:
                raise DataError(f"CLUSTER SLOTS answered a node {_what(node)}")
            host, port = node[0], node[1]
            if isinstance(host, bytes):
                host = host.decode("ascii", "replace")
            if not (isinstance(host, str) and len(host) <= _NODE_NAME_MAX and host.isprintable()
                    and host.isascii() and " " not in host):
                raise DataError(f"CLUSTER SLOTS answered a node host that is not a host name: {_what(node[0])}")
            if not (isinstance(port, int) and 0 < port < 65536):
                raise DataError(f"CLUSTER SLOTS answered a node port {_what(port)}")
            nodes.add((host, port))
            if len(nodes) > MAX_CLUSTER_NODES:
                raise DataError(f"CLUSTER SLOTS names more than {MAX_CLUSTER_NODES} nodes")


def _what(value: Any) -> str:
    """A short, printable description of something a node sent."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."
