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
from ``authorized/`` revokes that client. A running server reads ``authorized/`` again on
SIGHUP (``kill -HUP PID``): the change holds from each client's next handshake.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path
from typing import Final

import zmq
import zmq.auth
from zmq.utils import z85

from kvxfer.errors import ConfigError
from kvxfer.mq.client import CurveClientKeys
from kvxfer.mq.server import CurveServerKeys
from kvxfer.private_dirs import make_missing_dirs

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
    """Create ``path`` (0700, and missing parents 0700) or check that an existing one is ours and
    open to nobody else (an existing directory is never changed: ``kvxfer keys /tmp`` must not
    make /tmp private). Nothing is made before the directories above it are checked
    (:func:`~kvxfer.private_dirs.make_missing_dirs`): keys made through another user's link, or
    inside a directory others can write, could be moved away or replaced by their owner."""
    if not str(path) or str(path) == ".":
        raise ConfigError("name the key directory to make or use, e.g. `kvxfer keys ~/.kvxfer-keys`")
    if not os.path.lexists(path):  # (an existing one is held to what a server holds its key directory to)
        make_missing_dirs(path, "key directory", "choose a directory of your own for the keys")
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
        fix = "" if mode & stat.S_ISVTX else f", or run `chmod 700 {path}` if this one is meant for keys alone"
        raise ConfigError(f"key directory {path} is open to others (mode {mode:o}), and kvxfer keeps secret keys "
                          f"in a directory only you can open: choose a new directory{fix}")


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
        try:  # never through a link planted there
            fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            why = "a symbolic link is there" if exc.errno == errno.ELOOP else exc.strerror or exc
            raise ConfigError(f"cannot authorize {public.name}: {dst}: {why}") from None
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


def check_client_name(name: str) -> str:
    """``name`` if it can name a client key pair (ConfigError otherwise): a file name in the key
    directory, never a path out of it."""
    if not _NAME.fullmatch(name) or name == SERVER_NAME:
        raise ConfigError(f"client name {name!r}: use letters, digits, '.', '_' or '-' (not {SERVER_NAME!r})"[:300])
    return name


def add_client(directory: Path, name: str) -> dict[str, Path]:
    """Make another client key pair named ``name`` in ``directory`` and authorize it.

    A running server lets the new client in once it reads ``authorized/`` again (on SIGHUP).
    """
    _require_curve()
    directory = Path(directory)
    check_client_name(name)
    if not (directory / f"{SERVER_NAME}.key").exists():
        raise ConfigError(f"{directory} has no server key; run `kvxfer keys {directory}` first")
    _private_dir(directory)
    if (directory / f"{name}.key_secret").exists():
        raise ConfigError(f"client {name!r} already has keys in {directory}")
    public, secret = _create_pair(directory, name)
    return {"client_public": public, "client_secret": secret, "authorized": _authorize(directory, public)}


#: Longest key file read: a ZeroMQ certificate is a few hundred bytes.
MAX_KEY_FILE_BYTES: Final = 4096
#: Most public keys in ``authorized/``.
MAX_AUTHORIZED_KEYS: Final = 10_000

_KEY_LINE = re.compile(rb"^\s*(public|secret)-key\s*=\s*[\"']?([^\"'\s]*)[\"']?\s*$", re.M)


def _check_trusted(path: Path, what: str, st: os.stat_result, read_only: bool) -> None:
    """Refuse a file or folder that decides whom kvxfer trusts (a server's ``authorized/`` and its
    key files, a key directory, a client's copy of the server's public key) unless it is this
    user's or root's, and no one else can write it (or it is on a read-only file system, as a
    Kubernetes Secret is), as ssh's StrictModes does: who can write it can make kvxfer trust them."""
    if st.st_uid not in (os.getuid(), 0):
        raise ConfigError(f"{what} {path} belongs to another user (uid {st.st_uid}); it decides whom kvxfer "
                          "trusts (the clients a server lets in, the server a client talks to), so it must be this "
                          "user's (or root's)")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022 and not read_only:
        raise ConfigError(f"{what} {path} is writable by others (mode {mode:o}), who could make kvxfer trust "
                          f"them: run `chmod go-w {path}`")


def _check_trusted_dir(path: Path, what: str, hint: str = "") -> None:
    """:func:`_check_trusted` for a directory (the one a symbolic link names, if it is one);
    ``hint`` follows the error of one that does not exist."""
    try:
        st = os.stat(path)
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist{hint}") from None
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what} {path} is not a directory")
    _check_trusted(path, what, st, read_only)


def _read_key_file(path: Path, what: str, keys_dir: Path, trusted: bool = False) -> bytes:
    """The bytes of key file ``path`` (of key directory ``keys_dir``): a regular file of at most
    :data:`MAX_KEY_FILE_BYTES` (a FIFO would block the reader, ``/dev/zero`` fill its memory).
    With ``trusted`` (an authorized client key, the server's public key a client trusts):
    :func:`_check_trusted` of the file read (the
    one a symbolic link names: a Kubernetes Secret's files are links)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist; make keys with `kvxfer keys {keys_dir}`") from None
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what} {path} is not a regular file; a key file is what `kvxfer keys` writes")
        if trusted:
            _check_trusted(path, what, st, bool(os.fstatvfs(fd).f_flag & os.ST_RDONLY))
        data = os.read(fd, MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise ConfigError(f"{what} {path} has more than {MAX_KEY_FILE_BYTES} bytes; a ZeroMQ certificate has a "
                          "few hundred")
    return data


def _z85_key(text: bytes) -> bytes | None:
    """``text`` if it is a CURVE key in Z85 (40 characters, 32 bytes), else None."""
    if len(text) != 40:
        return None
    try:
        return text if len(z85.decode(text)) == 32 else None
    except Exception:  # noqa: BLE001  (pyzmq raises KeyError, struct.error, ... for what is no Z85)
        return None


def _load(path: Path, what: str, secret: bool, keys_dir: Path | None = None,
          trusted: bool = False) -> tuple[bytes, bytes | None]:
    """The public key (and, with ``secret``, the secret key) of certificate ``path`` (of key
    directory ``keys_dir``, its parent by default), read through :func:`_read_key_file` and
    checked: keys in Z85 of 32 bytes."""
    if secret:
        _check_private(path, what)
    keys: dict[bytes, bytes] = {}
    for kind, text in _KEY_LINE.findall(_read_key_file(path, what, keys_dir or path.parent, trusted)):
        keys.setdefault(kind, text)
    public = _z85_key(keys.get(b"public", b""))
    if public is None:
        raise ConfigError(f"{what} {path} is not a ZeroMQ certificate: it holds no public key of 40 Z85 "
                          "characters; make keys with `kvxfer keys DIR`")
    if not secret:
        return public, None
    secret_key = _z85_key(keys.get(b"secret", b""))
    if secret_key is None:
        raise ConfigError(f"{what} {path} holds no secret key of 40 Z85 characters")
    return public, secret_key


def reread_authorized_keys(authorized: Path, before: frozenset[bytes]) -> tuple[frozenset[bytes], str | None]:
    """What a running server authorizes once it reads its ``authorized`` folder again (on SIGHUP),
    and the error met, if any. A folder that reads as at start gives its keys. Otherwise (the
    folder gone or unreadable, no keys left, too many, a file that is no key) the keys of
    ``before`` that are still there as readable key files stay, and no other: a key taken out
    is refused even when the rest of the folder is wrong, and an emptied folder lets no client
    in; nor does a folder, or a key directory, that others may write (a revoked key's file put
    back by one of them would keep it in). A key added comes in only with a folder that reads
    cleanly."""
    authorized = Path(authorized)
    try:
        return _authorized_keys(authorized, authorized.parent), None
    except ConfigError as exc:
        error = str(exc)
    try:  # a folder others may write lets no one in: what it lists is anyone's word
        _check_trusted_dir(authorized.parent, "key directory")
        _check_trusted_dir(authorized, "authorized client keys")
        names = _key_names(authorized)[:MAX_AUTHORIZED_KEYS]
    except ConfigError:
        return frozenset(), error
    kept = set()
    for name in names:
        try:
            public = _authorized_key(authorized, name, authorized.parent)
        except ConfigError:
            continue
        if public in before:
            kept.add(public)
    return frozenset(kept), error


def _authorized_key(authorized: Path, name: str, directory: Path) -> bytes:
    """The public key of file ``name`` in ``authorized`` (of key directory ``directory``),
    read as a file that decides who gets in (:func:`_read_key_file` with ``trusted``)."""
    public, _ = _load(authorized / name, "authorized client key", secret=False, keys_dir=directory, trusted=True)
    return public


def _key_names(authorized: Path) -> list[str]:
    """The names of the ``.key`` files in ``authorized``, sorted (as pyzmq's own loader: hidden
    files are not keys, e.g. an editor's lock file .#c1.key)."""
    try:
        return sorted(e.name for e in os.scandir(authorized) if e.name.endswith(".key") and not e.name.startswith("."))
    except OSError as exc:
        raise ConfigError(f"authorized client keys {authorized}: {exc.strerror or exc}") from None


def _authorized_keys(authorized: Path, directory: Path) -> frozenset[bytes]:
    """The public keys of the ``.key`` files in ``authorized`` (at most
    :data:`MAX_AUTHORIZED_KEYS`), each checked: a file that is no public key stops the server
    with its name (pyzmq's own loader then let no client in at all, saying so only at start)."""
    _check_trusted_dir(directory, "key directory")
    _check_trusted_dir(authorized, "authorized client keys")
    names = _key_names(authorized)
    if not names:
        raise ConfigError(
            f"no client is authorized: {authorized} holds no public keys (.key files); "
            f"make some with `kvxfer keys {directory} --client NAME`"
        )
    if len(names) > MAX_AUTHORIZED_KEYS:
        raise ConfigError(f"{authorized} holds {len(names)} .key files, more than the {MAX_AUTHORIZED_KEYS} "
                          "clients a server authorizes")
    keys = set()
    for name in names:
        try:
            public = _authorized_key(authorized, name, directory)
        except ConfigError as exc:
            raise ConfigError(f"{exc}; remove it from {authorized}, or put a client's .key file there "
                              f"(`kvxfer keys {directory} --client NAME` makes one)") from None
        keys.add(public)
    return frozenset(keys)


def load_server_keys(directory: Path) -> CurveServerKeys:
    """The server's keys and its ``authorized`` folder, checked: the secret key must be a
    private file (0600) and at least one client must be authorized."""
    _require_curve()
    directory = Path(directory)
    public, secret = _load(directory / f"{SERVER_NAME}.key_secret", "server secret key", secret=True)
    authorized = directory / AUTHORIZED_DIR
    if not authorized.is_dir():
        raise ConfigError(
            f"no client is authorized: {authorized} is no directory of public keys (.key files); "
            f"make some with `kvxfer keys {directory} --client NAME`"
        )
    assert secret is not None
    return CurveServerKeys(public, secret, authorized, _authorized_keys(authorized, directory))


def load_client_keys(directory: Path, name: str = CLIENT_NAME) -> CurveClientKeys:
    """Client ``name``'s key pair and the server's public key, from ``directory``. The
    directory and the server's public key decide which server the client trusts: each must be
    this user's (or root's) and not writable by others (:func:`_check_trusted`)."""
    _require_curve()
    directory = Path(directory)
    check_client_name(name)
    _check_trusted_dir(directory, "key directory", f"; make keys with `kvxfer keys {directory}`")
    if not (directory / f"{name}.key_secret").exists() and (directory / f"{SERVER_NAME}.key").exists():
        raise ConfigError(f"client {name!r} has no keys in {directory}; add them with "
                          f"`kvxfer keys {directory} --client {name}`")
    public, secret = _load(directory / f"{name}.key_secret", f"client {name!r} secret key", secret=True)
    server_public, _ = _load(directory / f"{SERVER_NAME}.key", "server public key", secret=False, trusted=True)
    assert secret is not None
    return CurveClientKeys(public, secret, server_public)
