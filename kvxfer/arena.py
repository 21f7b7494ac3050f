"""The L1 arena: one shared-memory file that holds every stored chunk.

The server creates it in a private directory of its own under ``--shm-dir`` (mode 0700, made
and checked without following links, :mod:`kvxfer.private_dirs`; the file 0600), reserves its
pages with ``posix_fallocate`` (so a too-small tmpfs fails now, not with SIGBUS later) and maps
it with ``MAP_POPULATE`` (pre-faulted: first touch costs ~7x a warm copy). Client-driven data
paths map the same file (:class:`ArenaMapping`) and copy straight into its slots. Both halves
live here, outside :mod:`kvxfer.server`, so that no client-side module imports the server.

Liveness: the server holds an exclusive ``flock`` on ``server.lock`` in that directory for as
long as it lives; the kernel drops it when the process dies, however it dies and whichever pid
namespace it runs in. A starting server removes the directories of this user whose lock nobody
holds (servers that died without cleaning up), and never one whose lock is held. The directory
is named ``kvxfer-<uid>-<32 random hex digits>`` (no pid: pids repeat across namespaces) and
gets that name only once it holds its lock and its arena (it is built under a hidden name and
renamed), so no other server can ever see it unlocked.

Nothing else in the directory is ever opened by a path a client chose: clients' liveness locks
are ``client-<token>.lock`` with server-issued tokens, and transports get subdirectories the
server makes for them (:meth:`Arena.transport_dir`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Final

from kvxfer.errors import ConfigError
from kvxfer.private_dirs import check_private_dir, check_trusted_parents, open_private_dir
from kvxfer.units import format_bytes

if TYPE_CHECKING:
    import torch

__all__ = ["Arena", "ArenaMapping", "DEFAULT_SHM_DIR", "check_arena_path", "transport_dir_path"]

DEFAULT_SHM_DIR: Final = "/dev/shm"
_DIR_PREFIX: Final = "kvxfer-"
#: Age after which an arena directory still being made (``.kvxfer-...``) whose lock nobody holds
#: is a dead server's (see :meth:`Arena.remove_stale`).
BUILDING_GRACE_S: Final = 10.0
#: Arenas from this size up are announced in the log before they are made: pre-faulting takes
#: seconds per GiB on some hosts (2.5 s per GiB on a 2-core VM), and the server says nothing else meanwhile.
ANNOUNCE_BYTES: Final = 1 << 30
_LOCK: Final = "server.lock"
_ARENA: Final = "arena"
_TRANSPORT_DIR: Final = re.compile(r"[a-z][a-z0-9_]{0,63}")
#: How /proc/self/mounts writes a space, tab, newline or backslash of a mount point.
_OCTAL_ESCAPE: Final = re.compile(r"\\([0-7]{3})")


def _map(fd: int, size: int) -> mmap.mmap:
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _unmap(mm: mmap.mmap, what: str) -> bool:
    """Close ``mm``; False where views of it still live: the caller then drops its reference, and
    the mapping goes with the last view (the memoryview of :func:`_as_tensor` holds the rest)."""
    try:
        mm.close()
    except BufferError:
        logging.getLogger("kvxfer.arena").debug(  # not news: every context remapped after a restart says it
            "%s: views of it still live (a traceback or a thread holds one); its memory is unmapped when "
            "the last of them goes", what)
        return False
    return True


def _as_tensor(mm: mmap.mmap) -> torch.Tensor:
    """All of ``mm`` as a uint8 tensor that keeps it mapped: through a memoryview, which holds
    an export of the mapping for as long as any view of the tensor lives, so that ``close()``
    leaves the mapping to the last view (``torch.frombuffer`` of the mmap itself keeps only the
    object: ``close()`` unmapped it under live views, and touching one crashed the process)."""
    import warnings

    import torch

    with warnings.catch_warnings():  # the mmap is writable; torch warns for any buffer
        warnings.simplefilter("ignore")
        return torch.frombuffer(memoryview(mm), dtype=torch.uint8)


#: The name of any server's arena directory (whose user it is, the checks of the directory and
#: the file tell: a server in a user namespace names it by a uid its clients may not share).
_ANY_ARENA_DIR: Final = re.compile(rf"{_DIR_PREFIX}[0-9]+-[0-9a-f]{{32}}")


def _dir_name_pattern() -> re.Pattern[str]:
    return re.compile(rf"{_DIR_PREFIX}{os.getuid()}-[0-9a-f]{{32}}")


def check_arena_path(path: str | os.PathLike[str]) -> Path:
    """``path`` as a client may use it: the ``arena`` file of a server's arena directory
    (``kvxfer-<uid>-<32 hex digits>``; that it is this user's, the checks of the directory and
    the file tell). The path comes from the server's handshake reply; a
    client opens nothing else by it, so a server (anyone holding its key, over ``tcp://``) cannot
    make the client map another file of its user, or make a lock file in another directory.
    Raises :class:`ConfigError`."""
    p = Path(path)
    if p.name != _ARENA or not _ANY_ARENA_DIR.fullmatch(p.parent.name) or not p.is_absolute():
        shape = f"<shm dir>/{_DIR_PREFIX}<uid>-<32 hex digits>/{_ARENA}"
        raise ConfigError(f"the server announced {str(path)[:256]!r} as its arena, which is not the arena file of a "
                          f"kvxfer server ({shape}): refusing to map it")
    return p


def transport_dir_path(arena_path: str | os.PathLike[str], name: str) -> Path:
    """Where :meth:`Arena.transport_dir` puts transport ``name``'s private directory (for the
    transport's client side, which finds it next to the arena the handshake named)."""
    if not _TRANSPORT_DIR.fullmatch(name):
        raise ConfigError(f"transport name {name!r} cannot name a directory")
    return Path(arena_path).parent / f"transport-{name}"


class Arena:
    """The server's arena. ``tensor`` is a uint8 view of all of it."""

    def __init__(self, path: Path, size: int, mm: mmap.mmap, lock_fd: int) -> None:
        self.path = path
        self.size = size
        self._mm = mm
        self._lock_fd = lock_fd
        self.tensor = _as_tensor(mm)

    @classmethod
    def create(cls, size: int, shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR) -> Arena:
        """Create, reserve and pre-fault an arena of ``size`` bytes under ``shm_dir``.

        Raises :class:`ConfigError` naming the size needed when ``shm_dir`` is too small, and
        naming the directory when it cannot be trusted.
        """
        if size <= 0:
            raise ConfigError(f"the arena size must be positive, got {size}")
        base = Path(os.path.abspath(shm_dir))  # clients are told the arena's path: whole, wherever they run
        if not base.is_dir():
            what = "is not a directory" if os.path.lexists(base) else "does not exist"
            raise ConfigError(f"shared-memory directory {base} {what}; pass --shm-dir DIR (a tmpfs directory)")
        fs = filesystem_type(base)
        if fs not in (None, "tmpfs", "hugetlbfs", "ramfs"):
            logging.getLogger("kvxfer.arena").warning(
                "%s is on a %s file system, not tmpfs: the arena's pages may be written back to disk; "
                "pass --shm-dir with a tmpfs directory such as /dev/shm", base, fs)
        hint = "pass --shm-dir with a tmpfs directory of yours (or a sticky one such as /dev/shm)"
        check_trusted_parents(base / "x", "shared-memory directory", hint)
        cls.remove_stale(base)
        vfs = os.statvfs(base)
        free = vfs.f_bavail * vfs.f_frsize
        if free < size:
            raise ConfigError(
                f"the L1 arena needs {format_bytes(size)} but {base} has only {format_bytes(free)} free. "
                f"Give it more (Docker: `docker run --shm-size={(size >> 30) + 1}g ...`), pass a smaller "
                f"--l1-size, or put the arena in another tmpfs directory with --shm-dir DIR"
            )
        if size >= ANNOUNCE_BYTES:
            logging.getLogger("kvxfer.arena").info(
                "making the L1 arena: %s in %s, reserved and pre-faulted before the server is ready "
                "(seconds per GiB on some hosts)", format_bytes(size), base)
        name = f"{_DIR_PREFIX}{os.getuid()}-{secrets.token_hex(16)}"
        building = base / f".{name}"
        try:
            os.mkdir(building, 0o700)
        except OSError as exc:  # read-only, not ours to write in, out of inodes
            raise ConfigError(f"cannot make the L1 arena in {base}: {exc.strerror}; pass --shm-dir with a tmpfs "
                              "directory this user may write in (such as /dev/shm)") from None
        dir_fd = lock_fd = -1
        try:
            dir_fd = open_private_dir(building, "arena directory")
            lock_fd = os.open(_LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                              dir_fd=dir_fd)
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fd = os.open(_ARENA, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dir_fd)
            try:
                os.fchmod(fd, 0o600)
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    raise ConfigError(
                        f"could not reserve {format_bytes(size)} in {base}: {exc.strerror}. "
                        "Pass a smaller --l1-size or another --shm-dir"
                    ) from None
                mm = _map(fd, size)
            finally:
                os.close(fd)
            directory = base / name
            os.rename(building, directory)  # visible under its real name only now: locked and full
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            if lock_fd >= 0:
                os.close(lock_fd)
            raise
        finally:
            if dir_fd >= 0:
                os.close(dir_fd)
        return cls(directory / _ARENA, size, mm, lock_fd)

    @staticmethod
    def remove_stale(base: Path) -> int:
        """Remove arena directories of this user whose server is gone (nobody holds their
        lock); returns how many. A directory whose lock is held is never touched. So are those
        of servers killed while making their arena (``.kvxfer-...``, renamed once made), once
        :data:`BUILDING_GRACE_S` old, whether they got as far as their lock file or not: a server
        starting now makes its lock file and holds it a moment after it made the directory."""
        removed = 0
        pattern = _dir_name_pattern()
        with contextlib.suppress(OSError):
            for entry in base.iterdir():
                name = entry.name
                building = name.startswith(".") and pattern.fullmatch(name[1:]) is not None
                if building:
                    with contextlib.suppress(OSError):
                        if time.time() - os.lstat(entry).st_mtime < BUILDING_GRACE_S:
                            continue
                if (building or pattern.fullmatch(name)) and _unlocked_then(entry, shutil.rmtree):
                    removed += 1
                elif building and _lockless(entry):  # killed between its mkdir and its lock file
                    shutil.rmtree(entry, ignore_errors=True)
                    removed += 1
        return removed

    def transport_dir(self, name: str) -> Path:
        """A private directory (0700) for transport ``name``'s own files, made by the server
        next to the arena (and removed with it). A transport keeps there what it must put in
        files, under names it derives itself: never a path a client chose."""
        path = transport_dir_path(self.path, name)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        check_private_dir(path, f"directory of transport {name}")
        return path

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        self._check_open()
        return self.tensor[offset:offset + nbytes]

    def memoryview(self, offset: int, nbytes: int) -> memoryview:
        """The slot as a writable byte buffer (sockets and files read into it, ``writev`` from it)."""
        self._check_open()
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"slot [{offset}, {offset + nbytes}) is outside the arena of {self.size} bytes")
        return memoryview(self._mm)[offset:offset + nbytes]

    def _check_open(self) -> None:
        if self._mm is None:
            raise ValueError(f"the arena {self.path} is closed")

    def close(self) -> None:
        """Unmap and delete the directory, then drop the lock (idempotent). Views that still
        live keep the mapping (not the directory) until they go."""
        if self._mm is None:
            return
        self.tensor = None  # type: ignore[assignment]  # closed: nothing may use the view
        _unmap(self._mm, f"the arena {self.path} closed")
        self._mm = None  # type: ignore[assignment]  # closed (or left to the views that live)
        shutil.rmtree(self.path.parent, ignore_errors=True)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def _lockless(directory: Path) -> bool:
    """Whether ``directory`` is ours (checked as :func:`_unlocked_then` does) and has no lock file."""
    try:
        check_private_dir(directory, "arena directory")
    except (ConfigError, OSError):
        return False
    try:
        os.lstat(directory / _LOCK)
    except FileNotFoundError:
        return True
    except OSError:
        pass
    return False


def _unlocked_then(directory: Path, action: Callable[[Path], object]) -> bool:
    """Run ``action(directory)`` while holding its server lock, if nobody else holds it and the
    directory is ours (not a link, owner and mode checked). True when it ran."""
    try:
        check_private_dir(directory, "arena directory")
        fd = os.open(directory / _LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except (ConfigError, OSError):
        return False  # not ours, or no lock file: nothing to judge it by
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False  # its server lives
            raise
        action(directory)
        return True
    finally:
        os.close(fd)


class ArenaMapping:
    """A client's mapping of the server's arena (for client-driven transports)."""

    def __init__(self, path: str, size: int) -> None:
        if not Path(path).parent.exists():
            raise ConfigError(
                f"the server's arena {str(path)[:256]} does not exist here: client-driven transports need "
                "the client on the server's host and in its /dev/shm (same container)"
            )
        p = check_arena_path(path)
        dir_fd = open_private_dir(p.parent, "the server's arena directory")
        try:
            fd = os.open(p.name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError as exc:
            raise ConfigError(f"cannot open the server's arena {path}: {exc.strerror}") from None
        finally:
            os.close(dir_fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
                raise ConfigError(f"refusing arena {path}: not a private file of this user")
            if st.st_size != size:
                raise ConfigError(f"arena {path} is {st.st_size} bytes, the server announced {size}")
            self._mm = _map(fd, size)
        finally:
            os.close(fd)
        self.path = path
        self.size = size
        self.tensor = _as_tensor(self._mm)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        if self._mm is None:
            raise ValueError(f"the mapping of the server's arena {self.path} is closed")
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"slot [{offset}, {offset + nbytes}) is outside the arena of {self.size} bytes")
        return self.tensor[offset:offset + nbytes]

    def close(self) -> None:
        """Unmap, or leave the mapping to the slot views that still live (see :func:`_as_tensor`);
        idempotent."""
        if self._mm is None:
            return
        self.tensor = None  # type: ignore[assignment]  # the mapping is closed: nothing may use the view
        _unmap(self._mm, f"the mapping of the server's arena {self.path} closed")
        self._mm = None  # type: ignore[assignment]  # closed (or left to the views that live)


def filesystem_type(path: Path) -> str | None:
    """The type of the file system ``path`` is on (``tmpfs``, ``ext4``, ...), from the longest
    mount point above it in ``/proc/self/mounts``; None where that cannot be read."""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    real = os.path.realpath(path)
    best, kind = "", None
    for fields in mounts:
        if len(fields) < 3:
            continue
        point = _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), fields[1])  # space, tab, newline, backslash
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind
