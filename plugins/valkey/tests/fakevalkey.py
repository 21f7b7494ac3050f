"""A fake Valkey node for tests of a broken or hostile one: it speaks RESP2 on a loopback port,
answers the commands a client sends when it connects (``AUTH``, ``CLIENT``, ``INFO``, ``PING``) as a
single node would, and hands every other command to the test's ``reply`` function, whose bytes
it sends back as they are (None: no answer at all; a :class:`Trickle`: those bytes, a few at a
time). A real Valkey cannot be made to send these replies, hence the fake."""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

__all__ = ["FakeValkey", "Trickle"]


@dataclass(frozen=True)
class Trickle:
    """A reply sent ``step`` bytes every ``every_s`` seconds (a node that is slow, or pretends to be)."""

    data: bytes
    step: int
    every_s: float


Reply = Callable[[list[bytes]], bytes | Trickle | None]


def _read_command(f: BinaryIO) -> list[bytes] | None:
    line = f.readline()
    if not line:
        return None
    if line[:1] != b"*":
        raise ConnectionError(f"not a RESP command: {line[:40]!r}")
    out = []
    for _ in range(int(line[1:])):
        n = int(f.readline()[1:])
        out.append(f.read(n + 2)[:n])
    return out


class FakeValkey:
    """Use as a context manager; ``reply`` may be replaced while it runs."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        #: INFO's reply instead of a single node's few fields (None: those)
        self.info: bytes | Trickle | None = None
        #: the reply to AUTH (any user and password are taken)
        self.auth_reply: bytes = b"+OK\r\n"
        #: the reply to each CLIENT command (SETNAME, SETINFO: the client's handshake)
        self.client_reply: bytes | Trickle | None = b"+OK\r\n"
        #: bytes of replies sent whole or in part (sendall that failed: its bytes not counted)
        self.sent = 0
        #: read every command as it comes (a node whose socket never fills), answering them in
        #: order meanwhile; else one command, then its answer
        self.read_ahead = False
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"valkey://127.0.0.1:{self._sock.getsockname()[1]}"
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        #: every command received, in order (any connection)
        self.commands: list[list[bytes]] = []
        threading.Thread(target=self._accept, name="fake-valkey", daemon=True).start()

    def __enter__(self) -> FakeValkey:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), name="fake-valkey-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        f = conn.makefile("rb")
        if self.read_ahead:
            commands: queue.SimpleQueue[list[bytes] | None] = queue.SimpleQueue()

            def read() -> None:
                try:
                    while (cmd := _read_command(f)) is not None:
                        with self._lock:
                            self.commands.append(cmd)
                        commands.put(cmd)
                except (OSError, ValueError, ConnectionError):
                    pass
                commands.put(None)

            threading.Thread(target=read, name="fake-valkey-read", daemon=True).start()

            def next_command() -> list[bytes] | None:
                return commands.get()
        else:
            def next_command() -> list[bytes] | None:
                cmd = _read_command(f)
                if cmd is not None:
                    with self._lock:
                        self.commands.append(cmd)
                return cmd
        try:
            while (cmd := next_command()) is not None:
                name = cmd[0].upper()
                if name == b"CLIENT":
                    out: bytes | Trickle | None = self.client_reply
                elif name == b"INFO" and self.info is not None:
                    out = self.info
                elif name == b"INFO":
                    body = b"cluster_enabled:0\r\nused_memory:0\r\n"
                    out = b"$%d\r\n%s\r\n" % (len(body), body)
                elif name == b"AUTH":
                    out = self.auth_reply
                elif name == b"PING":
                    out = b"+PONG\r\n"
                elif name == b"DBSIZE":
                    out = b":0\r\n"
                else:
                    out = self.reply(cmd)
                if isinstance(out, Trickle):
                    for i in range(0, len(out.data), out.step):
                        conn.sendall(out.data[i:i + out.step])
                        self.sent += len(out.data[i:i + out.step])
                        time.sleep(out.every_s)
                elif out:
                    conn.sendall(out)
                    self.sent += len(out)
        except (OSError, ValueError, ConnectionError):
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self._sock.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()
