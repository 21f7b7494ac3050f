"""Default addresses: the server's ipc:// socket lives in a private (0700) directory.

The default directory is ``$XDG_RUNTIME_DIR/kvxfer`` when ``XDG_RUNTIME_DIR`` is set (systemd
makes ``/run/user/<uid>`` private to each user), else ``/tmp/kvxfer-<uid>``, a name another
local user could take first: the server and the client then refuse it with an error naming the
path and how to choose another (:func:`socket_dir_hint`), rather than trusting it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Final

from kvxfer.errors import ConfigError

__all__ = ["default_url", "has_control_character", "ipc_path", "private_runtime_dir", "socket_dir_hint", "check_url",
           "URL_ENV"]

#: The environment variable that names the server's address for clients and `kvxfer serve`.
URL_ENV = "KVXFER_URL"

#: Longest path of a Unix socket (``sun_path`` holds 108 bytes with the terminating NUL).
SUN_PATH_MAX: Final = 107


def private_runtime_dir() -> Path:
    """``$XDG_RUNTIME_DIR/kvxfer`` when set, else ``/tmp/kvxfer-<uid>`` (created 0700 by the server)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg) and os.path.isdir(xdg):  # (the XDG spec: absolute, or ignored)
        return Path(xdg) / "kvxfer"
    return Path("/tmp") / f"kvxfer-{os.getuid()}"


def default_url() -> str:
    """``$KVXFER_URL``, or ``ipc://<private runtime dir>/kvxfer.sock``."""
    return os.environ.get(URL_ENV) or f"ipc://{private_runtime_dir() / 'kvxfer.sock'}"


def socket_dir_hint() -> str:
    """How to choose another socket directory (for error messages)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and not os.path.isabs(xdg):
        xdg = None  # ignored (private_runtime_dir): no advice about it
    first = (f"XDG_RUNTIME_DIR is {xdg}: make sure it is a private directory of yours" if xdg else
             f"set XDG_RUNTIME_DIR to a private directory of yours (systemd's /run/user/{os.getuid()}) to "
             "move the default there")
    return (f"{first}, or choose the socket's place with --url ipc://DIR/kvxfer.sock (or KVXFER_URL) where "
            "DIR is a directory only you can write to")


def ipc_path(url: str) -> Path | None:
    """The socket path of an ``ipc://`` url, else None."""
    return Path(url[len("ipc://"):]) if url.startswith("ipc://") else None


#: The host of a tcp:// url: a name or IPv4 address, an IPv6 address in brackets, or * (serve:
#: every address); the port: ASCII digits (str.isdigit() takes "²" too).
_TCP_HOST: Final = re.compile(r"[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]|\*")
_PORT: Final = re.compile(r"[0-9]{1,5}")


def has_control_character(text: str) -> bool:
    """Whether ``text`` holds an ASCII control character (a NUL, a newline, DEL, ...)."""
    return any(ord(c) < 32 or ord(c) == 127 for c in text)


def check_url(url: str) -> str:
    """``url`` if a client can connect to it: ``ipc://PATH`` or ``tcp://HOST:PORT`` (port 1 to
    65535; ``inproc://NAME`` too); else ConfigError saying what is wrong and, when the url came
    from ``$KVXFER_URL``, that it did."""
    scheme, sep, rest = url.partition("://")
    why = ""
    if url != url.strip():
        why = "it begins or ends with white space (a stray space when it was pasted?)"
    elif not sep or scheme not in ("ipc", "tcp", "inproc"):
        why = "use ipc://PATH or tcp://HOST:PORT"
    elif not rest or "\0" in rest:
        why = "it names no address"
    elif has_control_character(rest):
        why = "it holds a control character (a newline?)"
    elif scheme == "ipc" and not rest.startswith("/"):
        why = (f"an ipc:// url takes an absolute path, with three slashes: ipc:///{rest} (or, for {rest} "
               f"in this directory, ipc://{os.path.abspath(rest)})")
    elif scheme == "ipc" and len(os.fsencode(rest)) > SUN_PATH_MAX:
        why = f"a Unix socket's path has at most {SUN_PATH_MAX} bytes, this one {len(os.fsencode(rest))}"
    elif scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not _TCP_HOST.fullmatch(host) or not _PORT.fullmatch(port) or not 1 <= int(port) <= 65535:
            why = ("a tcp:// url is tcp://HOST:PORT: a host name, an IPv4 address, an [IPv6] address or * (every "
                   "address, for kvxfer serve), and a port from 1 to 65535")
    if not why:
        return url
    where = f" (from ${URL_ENV})" if os.environ.get(URL_ENV) == url else ""
    # user info (a kvxfer address has none; an absolute ipc:// one is a path) may hold a password,
    # in which any character but "@" may be: all before the last "@" goes (a scheme written
    # before the first "@" stays), in the address and in what is said of it
    if "@" in url and not url.startswith("ipc:///"):
        head = url.rpartition("@")[0]
        lead, sep, info = head.partition("://")
        secret = info if sep and "@" not in lead else head
        if secret:
            url, why = url.replace(secret, "***"), why.replace(secret, "***")
    raise ConfigError(f"not a kvxfer server address: {url[:200]!r}{where}: {why}")
