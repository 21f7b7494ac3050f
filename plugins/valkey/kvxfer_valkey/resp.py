"""RESP on a connection's socket, with bulk strings read straight into caller buffers.

The ``valkey`` client hands us a connected, idle connection (nothing buffered, nothing pending);
we send pipelined commands with its ``send_packed_command`` and read their replies here:
the line of a reply into a small carry buffer, the bytes of a bulk string with ``recv_into`` the
caller's memoryviews (an arena slot), so a 32 MiB value crosses from the kernel into the arena
once. Anything unexpected raises :class:`RespError` or an ``OSError`` (``TimeoutError`` past the
reader's deadline); the caller then disconnects the connection (its stream position is unknown).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from typing import Final

__all__ = ["RespReader", "RespError", "ErrorReply", "pack", "pack_bulk_header", "BULK_MAX"]

_CRLF: Final = b"\r\n"
_LINE_MAX: Final = 64 << 10
#: Longest bulk string Valkey sends (its ``proto-max-bulk-len`` default, and the backend's
#: ``max_value_bytes``): a longer length is not a reply, and is never skipped.
BULK_MAX: Final = 512 << 20


class RespError(Exception):
    """The reply stream is not what the protocol allows (the connection must be dropped)."""


class ErrorReply(Exception):
    """The server answered one command with an error (``-ERR ...``, ``-MOVED ...``)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text
        self.kind = text.split(" ", 1)[0]


def pack(*args: bytes) -> bytes:
    """One command as a RESP array of bulk strings."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def pack_bulk_header(command: bytes, key: bytes, value_len: int) -> bytes:
    """``COMMAND key <value>`` up to the value's bytes: send the value and ``\\r\\n`` after it."""
    return b"*3\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n$%d\r\n" % (len(command), command, len(key), key, value_len)


class RespReader:
    """Reads replies from ``sock``; the bytes read past the current reply stay in a carry buffer.
    Each read waits at most the socket's timeout; with ``deadline`` (``time.monotonic()``), all of
    them together end by then too (``TimeoutError``), however slowly the bytes trickle in."""

    def __init__(self, sock: socket.socket, deadline: float | None = None) -> None:
        self.sock = sock
        self.deadline = deadline
        self._buf = bytearray(4096)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    @property
    def buffered(self) -> int:
        return self._end - self._start

    def _recv_into(self, view: memoryview, nbytes: int = 0) -> int:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the store's replies did not arrive whole within the operation's time")
            timeout = self.sock.gettimeout()
            if timeout is None or left < timeout:
                self.sock.settimeout(left)
        return self.sock.recv_into(view, nbytes)

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            if self._start == 0:
                raise RespError(f"a reply line longer than {len(self._buf)} bytes")
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start:self._end]
            self._start, self._end = 0, n
        got = self._recv_into(self._view[self._end:])
        if got == 0:
            raise ConnectionError("the server closed the connection")
        self._end += got

    def line(self) -> bytes:
        """The next reply line, without its CRLF."""
        while True:
            i = self._buf.find(_CRLF, self._start, self._end)
            if i >= 0:
                out = bytes(self._buf[self._start:i])
                self._start = i + 2
                return out
            self._fill()

    def into(self, dest: memoryview) -> None:
        """Fill ``dest`` from the stream (carry first, then ``recv_into``)."""
        pos = 0
        n = len(dest)
        have = self._end - self._start
        if have:
            k = min(have, n)
            dest[:k] = self._view[self._start:self._start + k]
            self._start += k
            pos = k
        recv_into = self._recv_into
        while pos < n:
            got = recv_into(dest[pos:], n - pos)
            if got == 0:
                raise ConnectionError("the server closed the connection mid-value")
            pos += got

    def skip(self, n: int) -> None:
        """Discard ``n`` bytes of the stream."""
        have = min(self._end - self._start, n)
        self._start += have
        n -= have
        while n > 0:
            self._start = self._end = 0
            got = self._recv_into(self._view, min(n, len(self._buf)))
            if got == 0:
                raise ConnectionError("the server closed the connection mid-value")
            n -= got

    def reply_simple(self) -> bytes | int | None:
        """A non-bulk reply: ``+OK`` -> b"OK", ``:5`` -> 5, null -> None; ``-ERR`` raises
        :class:`ErrorReply`; a bulk string is read whole (small values only)."""
        line = self.line()
        kind = line[:1]
        if kind == b"+":
            return line[1:]
        if kind == b":":
            return int(line[1:])
        if kind == b"-":
            raise ErrorReply(line[1:].decode("utf-8", "replace"))
        if kind == b"_":
            return None
        if kind == b"$":
            n = int(line[1:])
            if n < 0:
                return None
            if n > _LINE_MAX:
                raise RespError(f"unexpected bulk reply of {n} bytes")
            data = bytearray(n + 2)
            self.into(memoryview(data))
            return bytes(data[:n])
        raise RespError(f"unexpected reply {line[:40]!r}")

    def bulk_into(self, parts: Sequence[memoryview]) -> int | None:
        """A bulk-string reply read into ``parts`` when its length equals theirs. Returns the
        value's length (the parts hold it only if it equals their total; otherwise the bytes are
        skipped), or None for a null reply (no such key); ``-ERR`` raises :class:`ErrorReply`."""
        line = self.line()
        kind = line[:1]
        if kind == b"$":
            n = int(line[1:])
            if n < 0:
                return None
            if n > BULK_MAX:
                raise RespError(f"a bulk reply of {n} bytes, more than any value has")
            if n != sum(len(p) for p in parts):
                self.skip(n + 2)
                return n
            for p in parts:
                self.into(p)
            if self._end - self._start < 2:
                crlf = bytearray(2)
                self.into(memoryview(crlf))
            else:
                crlf = self._buf[self._start:self._start + 2]
                self._start += 2
            if crlf != _CRLF:
                raise RespError("a bulk string not followed by CRLF")
            return n
        if kind == b"_":
            return None
        if kind == b"-":
            raise ErrorReply(line[1:].decode("utf-8", "replace"))
        raise RespError(f"unexpected reply to GET {line[:40]!r}")
