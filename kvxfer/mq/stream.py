"""Messages on a Unix stream socket: the ``ipc://`` wire.

On ``ipc://`` client and server talk over a plain ``AF_UNIX`` stream socket, each message a list
of frames (the same frames ZeroMQ carries on ``tcp://``), framed by lengths:

``body_len:u32le  count:u8  len_1:u32le ... len_count:u32le  frame_1 ... frame_count``

where ``body_len`` counts everything after itself. A sender writes its message from its own
thread and a receiver reads it on the thread that waits for it: no I/O thread in between. On
the hosts of ``docs/performance.md`` ZeroMQ's I/O threads cost 3-5x a bare socket's round trip
(two thread wake-ups per message each way), which a lone request pays on its critical path.

A :class:`FrameReader` refuses, before buffering it, a message longer than its limit or of more
than :data:`MAX_FRAMES` frames, and a message whose frame lengths do not add up to its body
(:class:`FramingError`): what a reader holds is one message of at most its limit plus one read.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence

__all__ = ["FrameReader", "FramingError", "MAX_FRAMES", "pack", "peer_credentials", "READ_SIZE", "send_some"]

_BODY = struct.Struct("<I")
_COUNT = struct.Struct("<B")
_LEN = struct.Struct("<I")
_CRED = struct.Struct("3i")

#: Frames of one message: a request has 3, a reply 3; 4 leaves room for nothing else.
MAX_FRAMES = 4
#: Bytes asked of the socket per read.
READ_SIZE = 256 << 10
#: Messages at most this long go out as one joined buffer (one copy, one system call).
_JOIN_BELOW = 64 << 10


class FramingError(Exception):
    """The byte stream is not a sequence of well-formed messages (the connection is closed)."""


def pack(frames: Sequence[bytes]) -> list[bytes]:
    """The buffers of one message of ``frames``, to send in order (one buffer when short)."""
    count = len(frames)
    if not 0 < count <= MAX_FRAMES:
        raise ValueError(f"a message has 1 to {MAX_FRAMES} frames, got {count}")
    lens = [len(f) for f in frames]
    head = _BODY.pack(1 + 4 * count + sum(lens)) + _COUNT.pack(count) + struct.pack(f"<{count}I", *lens)
    if sum(lens) < _JOIN_BELOW:
        return [b"".join([head, *frames])]
    return [head, *frames]


def send_some(sock: socket.socket, out: list[memoryview]) -> bool:
    """Send what ``out`` holds without blocking, dropping what was sent from it; True once
    nothing is left. Raises the socket's OSError when the connection failed."""
    while out:
        try:
            n = sock.sendmsg(out) if len(out) > 1 else sock.send(out[0])
        except (BlockingIOError, InterruptedError):
            return False
        while n and out:
            if n >= len(out[0]):
                n -= len(out[0])
                out.pop(0)
            else:
                out[0] = out[0][n:]
                n = 0
    return True


class FrameReader:
    """Bytes read from a stream in, whole messages out (one connection's receiving side).

    ``max_body`` bounds the body of one message; a longer one, a frame count out of range or
    frame lengths that do not add up raise :class:`FramingError` as soon as its head is read.
    """

    __slots__ = ("_buf", "_max_body")

    def __init__(self, max_body: int) -> None:
        self._buf = bytearray()
        self._max_body = max_body

    def feed(self, data: bytes) -> None:
        self._buf += data

    def __len__(self) -> int:
        """Bytes buffered, whole messages and a part of the next."""
        return len(self._buf)

    def _head(self) -> tuple[int, int] | None:
        """``(body_len, count)`` of the first message once its first 5 bytes are here, checked."""
        buf = self._buf
        if len(buf) < 5:
            return None
        body = _BODY.unpack_from(buf, 0)[0]
        count = buf[4]
        if body > self._max_body:
            raise FramingError(f"a message of {body} bytes, over the limit of {self._max_body}")
        if not 0 < count <= MAX_FRAMES:
            raise FramingError(f"a message of {count} frames (1 to {MAX_FRAMES} allowed)")
        if body < 1 + 4 * count:
            raise FramingError(f"a message of {count} frames whose body is {body} bytes")
        return body, count

    def complete(self) -> bool:
        """Whether a whole message is buffered; raises :class:`FramingError` as soon as the head
        of the first one is bad (so that no bad message is ever buffered whole)."""
        head = self._head()
        return head is not None and len(self._buf) >= 4 + head[0]

    def next(self) -> list[bytes] | None:
        """The next whole message's frames, or None until more bytes come."""
        head = self._head()
        if head is None:
            return None
        body, count = head
        buf = self._buf
        end = 4 + body
        if len(buf) < end:
            return None
        lens = struct.unpack_from(f"<{count}I", buf, 5)
        if 1 + 4 * count + sum(lens) != body:
            raise FramingError(f"frame lengths {list(lens)} do not add up to a body of {body} bytes")
        frames = []
        at = 5 + 4 * count
        for n in lens:
            frames.append(bytes(buf[at:at + n]))
            at += n
        del buf[:end]
        return frames


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process that connected ``sock``, from the kernel
    (``SO_PEERCRED``): what the peer cannot claim otherwise."""
    pid, uid, gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid, gid
