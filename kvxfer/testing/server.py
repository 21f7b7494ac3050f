"""A real kvxfer server in a subprocess, for tests and benchmarks.

::

    with ServerProcess(l1_size="256MiB") as server:
        client = CacheClient(server.url)

The server is ``python -m kvxfer serve`` in its own process with a private socket under a fresh
temporary directory. ``start()`` returns once the server has printed its ready line and answered
one handshake (whose session it then ends: no session of its own is left behind);
``stop()`` sends SIGTERM and waits (SIGKILL after ``stop_timeout``). ``start_timeout`` is by
default 30 s plus 5 s per GiB of ``l1_size`` (the arena is pre-faulted before the server is ready). With
``curve_dir`` (keys made by ``kvxfer keys``) it serves ``url`` (a ``tcp://`` address) with CURVE,
and waits for it with the keys of client ``curve_client``. The server runs with
``--exit-with-parent`` (unless ``exit_with_parent=False``): when the process that started it ends
without stopping it (a crash, SIGKILL), it stops by itself within a second and removes its arena.
Its temporary directory (the socket, the server's log) is removed by the next ``ServerProcess``
made by the same user once neither the process that made it nor the server lives (both hold a
lock in it for their lives).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

from kvxfer import liveness
from kvxfer.errors import ConfigError, ConnectionFailed, KvxferError
from kvxfer.units import parse_size

if TYPE_CHECKING:
    from kvxfer.mq.client import CurveClientKeys

__all__ = ["ServerProcess", "ServerStartFailed", "transports_for"]


class ServerStartFailed(KvxferError, RuntimeError):
    """A server :class:`ServerProcess` started exited or did not answer; the message ends with
    what its log says (its error line, else its last lines), and :attr:`log` is the whole log."""

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(message)
        self.log = log


#: Prefix of a server's temporary directory, and the lock its maker holds there for its life.
_DIR_PREFIX = "kvxfer-server-"
_OWNER_LOCK = "owner.lock"


def _hold_owner_lock(directory: Path) -> int:
    """Lock a new file in ``directory`` for as long as the returned descriptor is open, and name
    it :data:`_OWNER_LOCK` only once locked, so that a sweep never sees it unheld while its maker
    lives (a forked child keeps it held too)."""
    fd = os.open(directory / f"{_OWNER_LOCK}.new", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(directory / f"{_OWNER_LOCK}.new", directory / _OWNER_LOCK)
    return fd


def _sweep_left_directories() -> None:
    """Remove this user's server directories left behind (a test run killed): those with an owner
    lock that no process holds (neither their maker nor their server lives). Others (another
    user's, one without the lock, anything but a real directory) are left alone."""
    try:
        entries = list(os.scandir(tempfile.gettempdir()))
    except OSError:
        return
    for entry in entries:
        if not entry.name.startswith(_DIR_PREFIX):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and \
                liveness.lock_state(Path(entry.path) / _OWNER_LOCK) == "released":
            shutil.rmtree(entry.path, ignore_errors=True)


def _start_timeout(l1_size: str) -> float:
    """30 s plus 5 s per GiB of arena (30 s for a size the server itself will refuse)."""
    try:
        return 30.0 + 5.0 * parse_size(l1_size) / 2**30
    except ConfigError:
        return 30.0


class ServerProcess:
    def __init__(
        self,
        *,
        l1_size: str = "256MiB",
        chunk_size: int = 256,
        transports: str = "",
        url: str | None = None,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        start_timeout: float | None = None,
        stop_timeout: float = 10.0,
        curve_dir: str | os.PathLike[str] | None = None,
        curve_client: str = "client",
        exit_with_parent: bool = True,
    ) -> None:
        _sweep_left_directories()
        self._tmp = tempfile.TemporaryDirectory(prefix=_DIR_PREFIX)
        #: held by this process and the server: the directory is theirs while either lives
        self._owner = _hold_owner_lock(Path(self._tmp.name))
        weakref.finalize(self, os.close, self._owner)
        sock_dir = Path(self._tmp.name) / "run"
        self.url = url or f"ipc://{sock_dir / 'kvxfer.sock'}"
        self.chunk_size = chunk_size
        self.log_path = Path(self._tmp.name) / "server.log"
        self._runs = 0  # runs before this one (restarts): their logs are server.log.1, .2, ...
        # --opt=value: a value that starts with "-" (a negative size) is then refused as a value
        self.args = [sys.executable, "-m", "kvxfer", "serve", f"--url={self.url}", f"--l1-size={l1_size}",
                     f"--chunk-size={chunk_size}"]
        if transports:
            self.args += ["--transports", transports]
        self.curve_dir = Path(curve_dir) if curve_dir is not None else None
        self.curve_client = curve_client
        if self.curve_dir is not None:
            self.args += ["--curve-dir", str(self.curve_dir)]
        self.args += extra_args or []
        #: The server stops when the process that started it ends (a test run that crashes or is
        #: killed then leaves no server and no arena behind).
        self.exit_with_parent = exit_with_parent
        self.env = {**os.environ, **(env or {})}
        self.start_timeout = start_timeout if start_timeout is not None else _start_timeout(l1_size)
        self.stop_timeout = stop_timeout
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> ServerProcess:
        from kvxfer.cli import READY_LINE
        from kvxfer.client import CacheClient

        if self.log_path.exists() and self.log_path.stat().st_size:  # a restart: the last run's log is kept
            self._runs += 1
            self.log_path.rename(self.log_path.with_name(f"{self.log_path.name}.{self._runs}"))
        self._log = open(self.log_path, "wb")  # noqa: SIM115  (kept open for the server's life; closed in stop())
        args = self.args
        if self.exit_with_parent:  # this process's id: seen even if it ends before the server starts
            args = [*args, f"--exit-with-parent={os.getpid()}"]
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     pass_fds=(self._owner,))
        deadline = time.monotonic() + self.start_timeout
        # no probe before the server says it is ready: a probe that gave up before the server's
        # answer (a busy host) would leave a session behind until the session timeout
        while READY_LINE.encode() not in self.log_path.read_bytes():
            if self.proc.poll() is not None:
                raise self._failed(f"exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise self._failed(f"was not ready within {self.start_timeout:g} s")
            time.sleep(0.02)
        try:
            CacheClient(self.url, connect_timeout=max(1.0, deadline - time.monotonic()),
                        curve=self.client_keys()).close()
        except ConnectionFailed as exc:
            raise self._failed(f"did not answer within {self.start_timeout:g} s") from exc
        return self

    def _failed(self, what: str) -> ServerStartFailed:
        """Stop the server that failed to start and say why: its error lines, else its last
        lines (one line for a CLI to print), and the whole log."""
        self.kill()
        self._log.close()
        log = self.log()
        lines = [ln for ln in log.splitlines() if ln.strip()]
        errors = [ln for ln in lines if "error:" in ln or "Error:" in ln]
        why = "\n".join(errors[-3:] or lines[-8:]) or "(its log is empty)"
        return ServerStartFailed(f"the kvxfer server started at {self.url} {what}: {why}", log)

    def client_keys(self) -> CurveClientKeys | None:
        """The CURVE keys a client of this server needs (None for an ipc:// server)."""
        if self.curve_dir is None:
            return None
        from kvxfer.security import load_client_keys

        return load_client_keys(self.curve_dir, self.curve_client)

    def log(self) -> str:
        """This run's log (after a restart, the earlier runs' are ``server.log.1``, ... beside it)."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self) -> int | None:
        """SIGTERM, wait, SIGKILL if needed; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc is not None:
            self._log.close()

    def restart(self) -> ServerProcess:
        self.stop()
        return self.start()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._tmp.cleanup()


def transports_for(transport: str, given: str = "") -> str:
    """The ``--transports`` of a server started to serve ``transport`` (the benchmarks', the
    demo's): ``given`` when set, else ``transport`` itself, so that a transport the server's
    default leaves out (``file_debug``) is loaded too, or the default for ``auto``. An unknown
    name raises TransportNotFound (listing what is installed) before any server starts."""
    from kvxfer.transport import registry

    if given or transport == registry.AUTO:
        return given
    registry.get_transport(transport, require_available=False)
    return transport
