"""Spool files: one private directory per registered KV cache, a few files in it.

The server makes the directory (``<instance id>`` in the private directory the core gives the
transport, next to the arena) and names the files itself: ``spool-<slot>``, where ``slot`` is a
small integer of the request's params. A request can never name a path. Both sides open
everything relative to the directory's descriptor with ``O_NOFOLLOW``; a file is written by
removing the old one and creating a new one (never by truncating: a planted link to another
file, the arena included, is unlinked, not written through), and read only if it is a plain
file of this user with a single link and exactly the expected size.
"""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING

from kvxfer import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["MAX_SLOTS", "open_private_dir", "file_name", "write_file", "read_file"]

#: Spool files per registered KV cache (``params.slot`` is in [0, MAX_SLOTS)).
MAX_SLOTS = 8


def open_private_dir(path: str) -> int:
    """Open ``path`` (a directory of this user, mode 0700, not a link); returns its descriptor.

    Raises :class:`kvxfer.ConfigError` naming the directory otherwise.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"spool directory {path!r} cannot be opened: {exc.strerror} (is the client on the "
                          "server's host, as file_debug needs?)") from None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
        os.close(fd)
        raise ConfigError(f"spool directory {path!r} must belong to uid {os.geteuid()} with mode 0700 "
                          f"(it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")
    return fd


def file_name(slot: int) -> str:
    """The spool file of ``slot``; :class:`ConfigError` naming ``params.slot`` when out of range."""
    if not 0 <= slot < MAX_SLOTS:
        raise ConfigError(f"params.slot: must be in [0, {MAX_SLOTS}), got {slot}")
    return f"spool-{slot}"


def write_file(dir_fd: int, name: str, data: torch.Tensor) -> None:
    """Write ``data`` (a contiguous CPU tensor) as a new file ``name`` (0600), replacing any."""
    import torch

    raw = memoryview(bytearray(data.numel() * data.element_size()))
    if len(raw):
        torch.frombuffer(raw, dtype=torch.uint8).copy_(data.reshape(-1).view(torch.uint8))
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        done = 0
        while done < len(raw):
            done += os.write(fd, raw[done:])
    finally:
        os.close(fd)


def read_file(dir_fd: int, name: str, nbytes: int) -> torch.Tensor:
    """The file ``name`` as a uint8 tensor; :class:`ConfigError` unless it is a plain private file
    of this user with one link and ``nbytes`` bytes (checked before anything is allocated)."""
    import torch

    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        raise ConfigError(f"params.slot: spool file {name!r} cannot be opened: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != os.geteuid():
            raise ConfigError(f"params.slot: spool file {name!r} is not a plain file of its own")
        if st.st_size != nbytes:
            raise ConfigError(f"params.slot: spool file {name!r} has {st.st_size} bytes, the request needs {nbytes}")
        buf = bytearray(nbytes)
        view, done = memoryview(buf), 0
        while done < nbytes:
            n = os.readv(fd, [view[done:]])
            if n == 0:
                raise ConfigError(f"params.slot: spool file {name!r} shrank while being read")
            done += n
    finally:
        os.close(fd)
    return torch.frombuffer(buf, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
