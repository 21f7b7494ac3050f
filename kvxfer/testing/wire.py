"""A bare connection that speaks the ``ipc://`` wire by hand (:mod:`kvxfer.mq.stream`).

For tests of what a broken or hostile client can send: any frames, any bytes, no kvxfer client
code in between. Blocking, one thread.
"""

from __future__ import annotations

import select
import socket

from kvxfer.mq.stream import READ_SIZE, FrameReader, pack
from kvxfer.urls import ipc_path

__all__ = ["RawConnection"]


class RawConnection:
    """One Unix stream connection to the server at an ``ipc://`` url."""

    def __init__(self, url: str, *, rcvbuf: int | None = None, max_reply: int = 256 << 20) -> None:
        path = ipc_path(url)
        if path is None:
            raise ValueError(f"RawConnection speaks ipc:// only, not {url!r}")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if rcvbuf is not None:  # a small buffer: the server's replies back up sooner
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.connect(str(path))
        self._reader = FrameReader(max_reply)

    def send(self, frames: list[bytes]) -> None:
        """Send one message of ``frames`` (blocks while the server does not read)."""
        for buf in pack(frames):
            self.sock.sendall(buf)

    def send_bytes(self, data: bytes) -> None:
        """Send ``data`` as it is: a message made by hand, or no message at all."""
        self.sock.sendall(data)

    def recv(self, timeout: float = 5.0) -> list[bytes] | None:
        """The next message's frames; None when none came within ``timeout`` seconds or the
        server closed the connection (see :meth:`closed`)."""
        while True:
            frames = self._reader.next()
            if frames is not None:
                return frames
            if not select.select([self.sock], [], [], timeout)[0]:
                return None
            data = self.sock.recv(READ_SIZE)
            if not data:
                return None
            self._reader.feed(data)

    def closed(self, timeout: float = 5.0) -> bool:
        """Whether the server closes the connection within ``timeout`` seconds (whatever it
        sends before is read and dropped)."""
        while select.select([self.sock], [], [], timeout)[0]:
            try:
                if not self.sock.recv(READ_SIZE):
                    return True
            except ConnectionResetError:
                return True
        return False

    def close(self) -> None:
        self.sock.close()
