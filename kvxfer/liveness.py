"""Whether a client's process still lives, seen through a lock file it holds next to the arena.

A client-driven transport copies straight into arena slots. When a client stops answering, the
server cannot tell a dead process from a frozen one (SIGSTOP, a paused VM, a debugger), and
giving a frozen writer's slots to someone else would let it overwrite their chunks when it
wakes. So every client on the server's host holds an exclusive ``flock`` on
``client-<token>.lock`` in the arena's private directory for as long as it lives; the kernel
drops the lock when the process dies, however it dies and in whichever pid namespace. The
server keeps a silent client's open writes while the lock is held (:func:`holder_alive`).
The token is issued by the server at the handshake (never chosen by the client), so a client
can only ever be judged by its own lock; no process id is ever consulted.

A client that cannot reach the arena's directory (another host, another mount namespace) holds
no lock and is treated as dead once silent: it cannot map the arena either, so it never writes
into slots.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import secrets
import stat
from pathlib import Path

from kvxfer.arena import check_arena_path
from kvxfer.errors import ConfigError
from kvxfer.private_dirs import check_private_dir

log = logging.getLogger(__name__)

_TOKEN = re.compile(r"[0-9a-f]{32}")


def new_token() -> str:
    """A fresh client token: 32 lowercase hex digits."""
    return secrets.token_hex(16)


def valid_token(token: str) -> bool:
    """Tokens come from the wire and name a file: only the exact form :func:`new_token` makes."""
    return _TOKEN.fullmatch(token) is not None


def lock_path(arena_path: str | os.PathLike[str], token: str) -> Path:
    if not valid_token(token):
        raise ValueError(f"not a client token: {token!r}")
    return Path(arena_path).parent / f"client-{token}.lock"


class ProcessLock:
    """The client's side: the lock file, created 0600 and held until :meth:`release` or death."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd

    @classmethod
    def hold(cls, arena_path: str | os.PathLike[str], token: str) -> ProcessLock | None:
        """Create and lock the file of ``token`` next to ``arena_path``; None when the directory
        cannot be reached from here (the server is elsewhere)."""
        path = lock_path(arena_path, token)
        try:
            check_arena_path(arena_path)
            check_private_dir(path.parent, "arena directory")
        except (ConfigError, OSError) as exc:
            log.debug("no liveness lock: %s", exc)
            return None
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            log.debug("no liveness lock at %s (%s): a silent session loses its writes at once", path, exc)
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return cls(path, fd)

    def release(self) -> None:
        """Remove the file, then drop the lock (idempotent)."""
        if self._fd < 0:
            return
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = -1


def holder_alive(arena_path: str | os.PathLike[str], token: str) -> bool:
    """The server's side: True while some process holds the lock of ``token``. False when the
    client never held one or its process is gone; the file is then removed."""
    return _lock_state(arena_path, token) == "held"


def holder_gone(arena_path: str | os.PathLike[str], token: str) -> bool:
    """True when the client of ``token`` held its lock and its process has ended (the file is
    there, and nobody holds it; it is then removed). False while it holds it, and for a client
    that never held one (on another host, or where the arena's directory is out of its reach):
    nothing is known of its process."""
    return _lock_state(arena_path, token) == "released"


def _lock_state(arena_path: str | os.PathLike[str], token: str) -> str:
    """:func:`lock_state` of the lock file of ``token`` (``none`` for a token of another form)."""
    if not valid_token(token):
        return "none"
    return lock_state(lock_path(arena_path, token))


def lock_state(path: Path) -> str:
    """``held`` (a process holds the ``flock`` on ``path``), ``released`` (the file was left by a
    process that ended: removed now) or ``none`` (no regular file there; a link is not followed)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return "none"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "none"  # not a lock file of ours (a FIFO, a directory): nobody holds it
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return "held"
    finally:
        os.close(fd)
    path.unlink(missing_ok=True)
    return "released"
