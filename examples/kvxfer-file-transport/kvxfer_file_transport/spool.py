"""Spool files: a private directory per registered KV cache and one file per transfer.

A spool file holds ``[num_layers, rows, row_bytes]`` bytes: for each layer, the rows named by
the request's :class:`~kvxfer_file_transport.transport.FileParams` ``rows``, in that order.
Both sides open files relative to the directory's descriptor with ``O_NOFOLLOW``, so a path
in a request can never leave the directory the client registered.
"""

from __future__ import annotations

import os
import stat

import torch

from kvxfer import ConfigError

__all__ = ["check_private_dir", "check_name", "write_file", "read_file"]


def check_private_dir(path: str) -> int:
    """Open ``path`` (a directory of this user, mode 0700, not a link); returns its descriptor.

    Raises :class:`kvxfer.ConfigError` naming the field ``spool_dir`` otherwise.
    """
    if not os.path.isabs(path):
        raise ConfigError(f"spool_dir: must be an absolute path, got {path!r}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        raise ConfigError(f"spool_dir: cannot open {path!r} as a directory: {exc.strerror}") from None
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        os.close(fd)
        raise ConfigError(f"spool_dir: {path!r} must belong to uid {os.getuid()} with mode 0700 "
                          f"(it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")
    return fd


def check_name(name: str) -> str:
    """A spool file name: one plain path component."""
    if not name or "/" in name or name.startswith(".") or "\0" in name:
        raise ConfigError(f"params.file: {name!r} is not a plain file name")
    return name


def write_file(dir_fd: int, name: str, data: torch.Tensor) -> None:
    """Write ``data`` (a contiguous CPU tensor) as the file ``name`` (created 0600, replaced)."""
    raw = memoryview(bytearray(data.numel() * data.element_size()))
    if len(raw):
        torch.frombuffer(raw, dtype=torch.uint8).copy_(data.reshape(-1).view(torch.uint8))
    fd = os.open(check_name(name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
    try:
        done = 0
        while done < len(raw):
            done += os.write(fd, raw[done:])
    finally:
        os.close(fd)


def read_file(dir_fd: int, name: str, nbytes: int) -> torch.Tensor:
    """The file ``name`` as a uint8 tensor; raises :class:`ConfigError` unless it has ``nbytes``."""
    try:
        fd = os.open(check_name(name), os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except FileNotFoundError:
        raise ConfigError(f"params.file: spool file {name!r} does not exist") from None
    try:
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise ConfigError(f"params.file: spool file {name!r} has {size} bytes, the request needs {nbytes}")
        buf = bytearray(nbytes)
        view, done = memoryview(buf), 0
        while done < nbytes:
            n = os.readv(fd, [view[done:]])
            if n == 0:
                raise ConfigError(f"params.file: spool file {name!r} shrank while being read")
            done += n
    finally:
        os.close(fd)
    return torch.frombuffer(buf, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
