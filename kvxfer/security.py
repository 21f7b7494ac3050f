"""ZeroMQ CURVE keys for ``tcp://`` serving: who may talk to a kvxfer server.

An ``ipc://`` server is guarded by file permissions (socket 0600 in a 0700 directory). A
``tcp://`` server is refused unless it has CURVE keys: every connection is encrypted, and only
clients whose public key is in the server's ``authorized`` folder get in (others are dropped
during the ZeroMQ handshake and see :class:`kvxfer.errors.ConnectionFailed`).

``kvxfer keys DIR`` (:func:`make_keys`) lays out a key directory::

    DIR/                        0700
      server.key                0600  the server's public key (clients need it)
      server.key_secret         0600  the server's secret key (only the server reads it)
      client.key                0600  a client's public key
      client.key_secret         0600  that client's secret key (only the client reads it)
      authorized/               0700  public keys of the clients allowed in
        client.key              0600

The server loads ``DIR`` with :func:`load_server_keys` (``kvxfer serve --curve-dir DIR``); a
client with :func:`load_client_keys` (``CacheClient(url, curve=load_client_keys(DIR))`` or
``kvxfer status --curve-dir DIR``). To run clients on another host, copy ``server.key`` and
one client's two files there (never ``server.key_secret``). :func:`add_client` makes another
client key pair and authorizes it (``kvxfer keys DIR --client NAME``); deleting a public key
from ``authorized/`` and restarting the server revokes that client.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Final

import zmq
import zmq.auth

from kvxfer.errors import ConfigError
from kvxfer.mq.client import CurveClientKeys
from kvxfer.mq.server import CurveServerKeys

__all__ = [
    "SERVER_NAME",
    "CLIENT_NAME",
    "AUTHORIZED_DIR",
    "make_keys",
    "add_client",
    "load_server_keys",
    "load_client_keys",
]

SERVER_NAME: Final = "server"
CLIENT_NAME: Final = "client"
AUTHORIZED_DIR: Final = "authorized"

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def _require_curve() -> None:
    if not zmq.has("curve"):
        raise ConfigError(
            f"this libzmq ({zmq.zmq_version()}) was built without CURVE support; install a pyzmq "
            "wheel (pip install --force-reinstall pyzmq), which bundles a libzmq with CURVE"
        )


def _private_dir(path: Path) -> None:
    """Create ``path`` (0700) or check that an existing one is ours and open to nobody else (an
    existing directory is never changed: ``kvxfer keys /tmp`` must not make /tmp private)."""
    if not str(path) or str(path) == ".":
        raise ConfigError("name the key directory to make or use, e.g. `kvxfer keys ~/.kvxfer-keys`")
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"cannot make the key directory {path}: {exc.strerror or exc}") from None
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError as exc:
        raise ConfigError(f"key directory {path}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"key directory {path} exists and is not a directory; choose another directory")
    if st.st_uid != os.getuid():
        raise ConfigError(f"key directory {path} belongs to another user; choose another directory")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise ConfigError(f"key directory {path} is open to others (mode {mode:o}), and kvxfer keeps secret keys "
                          f"in a directory only you can open: choose a new directory, or run `chmod 700 {path}` "
                          "if this one is meant for keys alone")


def _check_private(path: Path, what: str) -> None:
    """Refuse a secret that others could read (as ssh does)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist; make keys with `kvxfer keys {path.parent}`") from None
    except OSError as exc:  # a file where the directory should be, no permission, ...
        raise ConfigError(f"{what} {path}: {exc.strerror or exc}; make keys with `kvxfer keys DIR`") from None
    if st.st_uid != os.getuid():
        raise ConfigError(f"{what} {path} belongs to another user; refusing to use it")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise ConfigError(
            f"{what} {path} is readable by others (mode {oct(stat.S_IMODE(st.st_mode))}); "
            f"run `chmod 600 {path}` (and consider the key leaked)"
        )


def _create_pair(directory: Path, name: str) -> tuple[Path, Path]:
    old = os.umask(0o077)
    try:
        public, secret = zmq.auth.create_certificates(directory, name)
    finally:
        os.umask(old)
    for p in (public, secret):
        os.chmod(p, 0o600)
    return Path(public), Path(secret)


def _authorize(directory: Path, public: Path) -> Path:
    auth = directory / AUTHORIZED_DIR
    _private_dir(auth)
    dst = auth / public.name
    old = os.umask(0o077)
    try:
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(public.read_bytes())
    finally:
        os.umask(old)
    os.chmod(dst, 0o600)
    return dst


def make_keys(directory: Path) -> dict[str, Path]:
    """Create a server key pair and one authorized client key pair in ``directory``.

    Returns the paths by role: ``server_public``, ``server_secret``, ``client_public``,
    ``client_secret``, ``authorized``. Refuses (``ConfigError``) to overwrite existing keys.
    """
    _require_curve()
    directory = Path(directory)
    _private_dir(directory)
    existing = [p.name for p in (directory / f"{SERVER_NAME}.key_secret", directory / f"{CLIENT_NAME}.key_secret")
                if p.exists()]
    if existing:
        raise ConfigError(
            f"{directory} already holds keys ({', '.join(existing)}); remove them or choose another "
            f"directory (to add a client: `kvxfer keys {directory} --client NAME`)"
        )
    server_public, server_secret = _create_pair(directory, SERVER_NAME)
    client_public, client_secret = _create_pair(directory, CLIENT_NAME)
    _authorize(directory, client_public)
    return {
        "server_public": server_public,
        "server_secret": server_secret,
        "client_public": client_public,
        "client_secret": client_secret,
        "authorized": directory / AUTHORIZED_DIR,
    }


def add_client(directory: Path, name: str) -> dict[str, Path]:
    """Make another client key pair named ``name`` in ``directory`` and authorize it.

    The server reads ``authorized/`` when it starts: restart it to let the new client in.
    """
    _require_curve()
    directory = Path(directory)
    if not _NAME.fullmatch(name) or name == SERVER_NAME:
        raise ConfigError(f"client name {name!r}: use letters, digits, '.', '_' or '-' (not {SERVER_NAME!r})")
    if not (directory / f"{SERVER_NAME}.key").exists():
        raise ConfigError(f"{directory} has no server key; run `kvxfer keys {directory}` first")
    _private_dir(directory)
    if (directory / f"{name}.key_secret").exists():
        raise ConfigError(f"client {name!r} already has keys in {directory}")
    public, secret = _create_pair(directory, name)
    return {"client_public": public, "client_secret": secret, "authorized": _authorize(directory, public)}


def _load(path: Path, what: str, secret: bool) -> tuple[bytes, bytes | None]:
    if secret:
        _check_private(path, what)
    elif not path.exists():
        raise ConfigError(f"{what} {path} does not exist; make keys with `kvxfer keys {path.parent}`")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{what} {path} is not a ZeroMQ certificate: {exc}") from None
    if secret and not secret_key:
        raise ConfigError(f"{what} {path} holds no secret key")
    return public, secret_key


def load_server_keys(directory: Path) -> CurveServerKeys:
    """The server's keys and its ``authorized`` folder, checked: the secret key must be a
    private file (0600) and at least one client must be authorized."""
    _require_curve()
    directory = Path(directory)
    public, secret = _load(directory / f"{SERVER_NAME}.key_secret", "server secret key", secret=True)
    authorized = directory / AUTHORIZED_DIR
    if not authorized.is_dir() or not any(p.suffix == ".key" for p in authorized.iterdir()):
        raise ConfigError(
            f"no client is authorized: {authorized} holds no public keys (.key files); "
            f"make some with `kvxfer keys {directory} --client NAME`"
        )
    assert secret is not None
    return CurveServerKeys(public, secret, authorized)


def load_client_keys(directory: Path, name: str = CLIENT_NAME) -> CurveClientKeys:
    """Client ``name``'s key pair and the server's public key, from ``directory``."""
    _require_curve()
    directory = Path(directory)
    if not (directory / f"{name}.key_secret").exists() and (directory / f"{SERVER_NAME}.key").exists():
        raise ConfigError(f"client {name!r} has no keys in {directory}; add them with "
                          f"`kvxfer keys {directory} --client {name}`")
    public, secret = _load(directory / f"{name}.key_secret", f"client {name!r} secret key", secret=True)
    server_public, _ = _load(directory / f"{SERVER_NAME}.key", "server public key", secret=False)
    assert secret is not None
    return CurveClientKeys(public, secret, server_public)
