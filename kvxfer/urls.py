"""Default addresses: the server's ipc:// socket lives in a private (0700) directory.

The default directory is ``$XDG_RUNTIME_DIR/kvxfer`` when ``XDG_RUNTIME_DIR`` is set (systemd
makes ``/run/user/<uid>`` private to each user), else ``/tmp/kvxfer-<uid>``, a name another
local user could take first: the server and the client then refuse it with an error naming the
path and how to choose another (:func:`socket_dir_hint`), rather than trusting it.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_url", "ipc_path", "private_runtime_dir", "socket_dir_hint"]


def private_runtime_dir() -> Path:
    """``$XDG_RUNTIME_DIR/kvxfer`` when set, else ``/tmp/kvxfer-<uid>`` (created 0700 by the server)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and Path(xdg).is_dir():
        return Path(xdg) / "kvxfer"
    return Path("/tmp") / f"kvxfer-{os.getuid()}"


def default_url() -> str:
    """``$KVXFER_URL``, or ``ipc://<private runtime dir>/kvxfer.sock``."""
    return os.environ.get("KVXFER_URL") or f"ipc://{private_runtime_dir() / 'kvxfer.sock'}"


def socket_dir_hint() -> str:
    """How to choose another socket directory (for error messages)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    first = (f"XDG_RUNTIME_DIR is {xdg}: make sure it is a private directory of yours" if xdg else
             f"set XDG_RUNTIME_DIR to a private directory of yours (systemd's /run/user/{os.getuid()}) to "
             "move the default there")
    return (f"{first}, or choose the socket's place with --url ipc://DIR/kvxfer.sock (or KVXFER_URL) where "
            "DIR is a directory only you can write to")


def ipc_path(url: str) -> Path | None:
    """The socket path of an ``ipc://`` url, else None."""
    return Path(url[len("ipc://"):]) if url.startswith("ipc://") else None
