"""A server's claim on its ``ipc://`` socket path, and how others see it.

A server takes an exclusive lock on ``<socket>.lock``, beside its socket in the socket's private
directory, before it makes its arena, and holds it until it ends (:func:`take`); the kernel
drops it when the process ends, however it ends. So a second server started at the same socket
fails at once even while the first is still pre-faulting its arena, and a client or ``kvxfer
status`` can tell a server that is starting from none at all (:func:`socket_claimed`).

The lock is an open file description lock (``F_OFD_SETLK``): unlike ``flock`` it can be tested
without being taken (``F_OFD_GETLK``: a test that took it, however briefly, could make a server
starting at that moment fail), and unlike a process's POSIX lock it is not dropped when the same
process closes another descriptor of the file. The file stays when the server ends: removing it
would race a server taking it.
"""

from __future__ import annotations

import fcntl
import os
import stat
import struct
import weakref
from pathlib import Path
from typing import Final

from kvxfer.errors import ConfigError
from kvxfer.urls import ipc_path

__all__ = ["CLAIM_SUFFIX", "SocketClaim", "claim_path", "socket_claimed", "take"]

#: Appended to the socket's name: the file a server holds its lock on.
CLAIM_SUFFIX: Final = ".lock"
#: ``struct flock`` on Linux (l_type, l_whence, l_start, l_len, l_pid, padding).
_FLOCK: Final = "hhqqi4x"
_WHOLE_FILE_WRITE_LOCK: Final = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)


def claim_path(socket_path: Path) -> Path:
    """The lock file of the socket at ``socket_path``."""
    return socket_path.with_name(socket_path.name + CLAIM_SUFFIX)


class SocketClaim:
    """A server's hold on its socket path (see the module docstring); :meth:`release` ends it
    before the process does, and so does the claim's collection (a server made and dropped in
    one process)."""

    def __init__(self, fd: int, path: Path) -> None:
        self.path = path
        self._close = weakref.finalize(self, os.close, fd)  # closing the descriptor drops its lock

    def release(self) -> None:
        """Let the claim go (idempotent)."""
        self._close()


def _kind(mode: int) -> str:
    """What a file of ``mode`` is, in words ("" for a regular file)."""
    if stat.S_ISREG(mode):
        return ""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISLNK, "a symbolic link"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return "not a regular file"


def take(url: str, socket_path: Path) -> SocketClaim:
    """Claim ``socket_path`` (of ``url``, for messages), whose directory exists and is private;
    ConfigError if another server holds the claim, or the lock file is not a private regular file
    of this user (another user able to open it could hold a lock on it)."""
    lock = claim_path(socket_path)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as exc:  # a directory, a socket, a link in its place; no permission
        try:
            kind = _kind(os.lstat(lock).st_mode)
        except OSError:
            kind = ""
        why = f"is {kind}" if kind else ""
        raise ConfigError(f"cannot claim {url}: {lock} {why or exc.strerror or exc}; choose another --url") from None
    try:
        st = os.fstat(fd)
        mode = stat.S_IMODE(st.st_mode)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"cannot claim {url}: {lock} is {_kind(st.st_mode)}; choose another --url")
        if st.st_uid != os.geteuid() or mode & 0o077 or st.st_nlink != 1:
            why = (f"belongs to uid {st.st_uid}" if st.st_uid != os.geteuid() else
                   f"is open to other users (mode {mode:o})" if mode & 0o077 else "has other names (hard links)")
            raise ConfigError(f"cannot claim {url}: {lock} {why}, where a kvxfer server makes it 0600 with one "
                              "name: another user could hold a lock on it; remove it (no server of yours uses "
                              "it then) or choose another --url")
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _WHOLE_FILE_WRITE_LOCK)
        except (BlockingIOError, PermissionError):  # EAGAIN / EACCES: held by another
            raise ConfigError(f"another server is starting, listening or stopping at {url} (it holds {lock}); "
                              "stop it or choose another --url") from None
        except OSError as exc:  # ENOLCK and the like: a file system without such locks
            raise ConfigError(f"cannot claim {url}: locking {lock} failed ({exc.strerror or exc}); put the socket "
                              "on a local file system (--url ipc://DIR/kvxfer.sock)") from None
    except BaseException:
        os.close(fd)
        raise
    return SocketClaim(fd, lock)


def socket_claimed(url: str) -> bool:
    """Whether a server holds the claim on the socket of ``ipc://`` ``url`` (one starting or
    serving), tested without taking it. False for other urls, and where there is no lock file
    or it cannot be read."""
    path = ipc_path(url)
    if path is None:
        return False
    try:
        fd = os.open(claim_path(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _WHOLE_FILE_WRITE_LOCK)
    except OSError:
        return False
    finally:
        os.close(fd)
    return bool(struct.unpack(_FLOCK, got)[0] != fcntl.F_UNLCK)
