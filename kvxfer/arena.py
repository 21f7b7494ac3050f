"""The L1 arena: one shared-memory file that holds every stored chunk.

The server creates it (:class:`Arena`) in a private directory (mode 0700; the file 0600),
reserves its pages with ``posix_fallocate`` (so a too-small tmpfs fails now, not with SIGBUS
later) and maps it with ``MAP_POPULATE`` (pre-faulted: first touch costs ~7x a warm copy).
Client-driven data paths map the same file (:class:`ArenaMapping`) and copy straight into its
slots. Both halves live here, outside :mod:`kvxfer.server`, so that no client-side module
imports the server.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import shutil
import stat
from pathlib import Path
from typing import Final

import torch

from kvxfer.errors import ConfigError
from kvxfer.units import format_bytes

__all__ = ["Arena", "ArenaMapping", "DEFAULT_SHM_DIR"]

DEFAULT_SHM_DIR: Final = "/dev/shm"
_DIR_PREFIX: Final = "kvxfer-"


def _map(fd: int, size: int) -> mmap.mmap:
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _as_tensor(mm: mmap.mmap) -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():  # the mmap is writable; torch warns for any buffer
        warnings.simplefilter("ignore")
        return torch.frombuffer(mm, dtype=torch.uint8)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Arena:
    """The server's arena. ``tensor`` is a uint8 view of all of it."""

    def __init__(self, path: Path, size: int, mm: mmap.mmap) -> None:
        self.path = path
        self.size = size
        self._mm = mm
        self.tensor = _as_tensor(mm)

    @classmethod
    def create(cls, size: int, shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR) -> Arena:
        """Create, reserve and pre-fault an arena of ``size`` bytes under ``shm_dir``.

        Raises :class:`ConfigError` naming the size needed when ``shm_dir`` is too small.
        """
        if size <= 0:
            raise ConfigError(f"the arena size must be positive, got {size}")
        base = Path(shm_dir)
        if not base.is_dir():
            raise ConfigError(f"shared-memory directory {base} does not exist; pass --shm-dir DIR")
        cls.remove_stale(base)
        vfs = os.statvfs(base)
        free = vfs.f_bavail * vfs.f_frsize
        if free < size:
            raise ConfigError(
                f"the L1 arena needs {format_bytes(size)} but {base} has only {format_bytes(free)} free. "
                f"Give it more (Docker: `docker run --shm-size={(size >> 30) + 1}g ...`), pass a smaller "
                f"--l1-size, or put the arena in another tmpfs directory with --shm-dir DIR"
            )
        directory = base / f"{_DIR_PREFIX}{os.getuid()}-{os.getpid()}-{secrets.token_hex(4)}"
        directory.mkdir(mode=0o700)
        path = directory / "arena"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
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
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        return cls(path, size, mm)

    @staticmethod
    def remove_stale(base: Path) -> int:
        """Remove arenas of this user whose server process is gone; returns how many."""
        removed = 0
        pattern = re.compile(rf"{_DIR_PREFIX}{os.getuid()}-(\d+)-[0-9a-f]+")
        with contextlib.suppress(OSError):
            for entry in base.iterdir():
                m = pattern.fullmatch(entry.name)
                if m and not _pid_alive(int(m.group(1))):
                    shutil.rmtree(entry, ignore_errors=True)
                    removed += 1
        return removed

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.tensor[offset:offset + nbytes]

    def memoryview(self, offset: int, nbytes: int) -> memoryview:
        """The slot as a writable byte buffer (sockets and files read into it, ``writev`` from it)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"slot [{offset}, {offset + nbytes}) is outside the arena of {self.size} bytes")
        return memoryview(self._mm)[offset:offset + nbytes]

    def close(self) -> None:
        """Unmap and delete the file. Views must no longer be used."""
        del self.tensor
        with contextlib.suppress(BufferError):
            self._mm.close()
        shutil.rmtree(self.path.parent, ignore_errors=True)


class ArenaMapping:
    """A client's mapping of the server's arena (for client-driven transports)."""

    def __init__(self, path: str, size: int) -> None:
        p = Path(path)
        try:
            st = p.stat()
        except FileNotFoundError:
            raise ConfigError(
                f"the server's arena {path} does not exist here: client-driven transports need "
                "the client on the server's host and in its /dev/shm (same container)"
            ) from None
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise ConfigError(f"refusing arena {path}: not a private file of this user")
        if st.st_size != size:
            raise ConfigError(f"arena {path} is {st.st_size} bytes, the server announced {size}")
        fd = os.open(p, os.O_RDWR)
        try:
            self._mm = _map(fd, size)
        finally:
            os.close(fd)
        self.path = path
        self.size = size
        self.tensor = _as_tensor(self._mm)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"slot [{offset}, {offset + nbytes}) is outside the arena of {self.size} bytes")
        return self.tensor[offset:offset + nbytes]

    def close(self) -> None:
        self.tensor = None  # type: ignore[assignment]  # the mapping is closed: nothing may use the view
        with contextlib.suppress(BufferError):
            self._mm.close()
