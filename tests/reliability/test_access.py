"""Access control: private ipc:// socket and arena, CURVE keys for tcp:// (loopback only)."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
from relkit import TcpServer, Writer, free_port, key

from kvxfer import CacheClient, ConnectionFailed
from kvxfer.errors import ConfigError
from kvxfer.mq.client import CurveClientKeys
from kvxfer.security import add_client, load_client_keys, load_server_keys, make_keys, reread_authorized_keys


def mode(p: Path | str) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def kvxfer_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvxfer", *args], capture_output=True, text=True, timeout=timeout)


# --------------------------------------------------------------------------- ipc:// and the arena


def test_ipc_socket_and_arena_are_private(server, client_of):
    sock = Path(server.url.removeprefix("ipc://"))
    assert stat.S_ISSOCK(os.stat(sock).st_mode)
    assert mode(sock) == 0o600
    assert mode(sock.parent) == 0o700
    client = client_of(server)
    arena = Path(client.arena_path)
    assert arena.is_file() and mode(arena) == 0o600
    assert mode(arena.parent) == 0o700
    # named without a pid (pids repeat across pid namespaces); its server holds server.lock
    assert re.fullmatch(rf"kvxfer-{os.getuid()}-[0-9a-f]{{32}}", arena.parent.name), arena.parent.name
    assert sorted(p.name for p in arena.parent.iterdir() if not p.name.startswith("client-")) == ["arena", "server.lock"]


def test_ipc_socket_in_a_shared_directory_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    r = kvxfer_cli("serve", "--url", f"ipc://{shared}/kvxfer.sock", "--l1-size", "8MiB")
    assert r.returncode == 2
    assert "writable by others" in r.stderr and "0700" in r.stderr
    assert not (shared / "kvxfer.sock").exists()


# --------------------------------------------------------------------------- keys


def test_kvxfer_keys_makes_private_keys(tmp_path):
    d = tmp_path / "keys"
    r = kvxfer_cli("keys", str(d))
    assert r.returncode == 0, r.stderr
    assert f"server_secret: {d / 'server.key_secret'}" in r.stdout
    assert mode(d) == 0o700 and mode(d / "authorized") == 0o700
    files = sorted(p.name for p in d.iterdir() if p.is_file())
    assert files == ["client.key", "client.key_secret", "server.key", "server.key_secret"]
    for p in [*d.iterdir(), *(d / "authorized").iterdir()]:
        if p.is_file():
            assert mode(p) == 0o600, p
    assert sorted(p.name for p in (d / "authorized").iterdir()) == ["client.key"]
    server, client = load_server_keys(d), load_client_keys(d)
    assert client.server_public == server.public and client.public != server.public
    assert (d / "authorized" / "client.key").read_bytes() == (d / "client.key").read_bytes()
    assert b"secret" not in (d / "authorized" / "client.key").read_bytes().split(b"\n#")[-1]

    r = kvxfer_cli("keys", str(d))  # never overwrites keys
    assert r.returncode == 2 and "already holds keys" in r.stderr
    assert load_server_keys(d) == server

    r = kvxfer_cli("keys", str(d), "--client", "worker2")
    assert r.returncode == 0, r.stderr
    assert mode(d / "worker2.key_secret") == 0o600
    assert (d / "authorized" / "worker2.key").exists()
    assert load_client_keys(d, "worker2").server_public == server.public


def test_keys_that_others_can_read_are_refused(tmp_path):
    d = tmp_path / "keys"
    make_keys(d)
    os.chmod(d / "server.key_secret", 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_server_keys(d)
    os.chmod(d / "server.key_secret", 0o600)
    os.chmod(d / "client.key_secret", 0o640)
    with pytest.raises(ConfigError, match="readable by others"):
        load_client_keys(d)
    for p in (d / "authorized").iterdir():
        p.unlink()
    with pytest.raises(ConfigError, match="no client is authorized"):
        load_server_keys(d)
    with pytest.raises(ConfigError, match="does not exist"):
        load_server_keys(tmp_path / "nowhere")


def test_a_client_trusts_only_a_server_key_and_key_directory_no_one_else_can_write(tmp_path):
    """The server's public key in a client's key directory decides which server the client
    talks to: whoever can write it (or swap the directory's files) can point the client at a
    server of theirs. So both are held to what a server's authorized/ folder is: this user's
    (or root's) and not writable by others."""
    d = tmp_path / "keys"
    make_keys(d)
    os.chmod(d / "server.key", 0o666)
    with pytest.raises(ConfigError, match=rf"server public key {re.escape(str(d / 'server.key'))} is writable by "
                                          "others"):
        load_client_keys(d)
    os.chmod(d / "server.key", 0o644)
    os.chmod(d, 0o777)
    with pytest.raises(ConfigError, match=rf"key directory {re.escape(str(d))} is writable by others"):
        load_client_keys(d)
    os.chmod(d, 0o700)
    assert load_client_keys(d).server_public == load_server_keys(d).public


def test_key_files_that_are_no_keys_are_refused_by_name_and_never_block(tmp_path):
    """A stray file in authorized/ is refused at start, with its name (pyzmq's loader logged an
    error and let no client in at all); key files that are FIFOs (a read would block), device
    files (/dev/zero: a read would fill memory) or too large are refused before they are read."""
    d = tmp_path / "keys"
    make_keys(d)
    (d / "authorized" / ".#client.key").symlink_to("nowhere")  # an editor's lock file: hidden, no key
    (d / "authorized" / "._client.key").write_bytes(b"\0\5\26\7")  # a macOS resource file
    assert len(load_server_keys(d).authorized) == 1  # hidden files are skipped, as pyzmq's loader does
    stray = d / "authorized" / "stray.key"
    stray.write_text("garbage\n")
    with pytest.raises(ConfigError, match=rf"authorized client key {re.escape(str(stray))} is not a ZeroMQ "
                                          r"certificate.*remove it from"):
        load_server_keys(d)
    stray.write_text('public-key = "' + "#" * 40 + '"\n')  # 40 Z85 characters that decode past 32 bits
    with pytest.raises(ConfigError, match="holds no public key of 40 Z85 characters"):
        load_server_keys(d)
    stray.unlink()
    os.mkfifo(stray, 0o600)
    with pytest.raises(ConfigError, match="is not a regular file"):
        load_server_keys(d)
    stray.unlink()
    stray.symlink_to("nowhere")
    with pytest.raises(ConfigError, match=rf"does not exist; make keys with `kvxfer keys {re.escape(str(d))}`"):
        load_server_keys(d)
    stray.unlink()
    stray.symlink_to("/dev/zero")
    with pytest.raises(ConfigError, match="is not a regular file"):
        load_server_keys(d)
    stray.unlink()
    stray.write_bytes(b"#" * 5000)
    with pytest.raises(ConfigError, match="has more than 4096 bytes"):
        load_server_keys(d)
    stray.unlink()
    (d / "server.key").unlink()
    os.mkfifo(d / "server.key", 0o600)
    with pytest.raises(ConfigError, match="server public key .* is not a regular file"):
        load_client_keys(d)
    (d / "server.key_secret").write_text('public-key = "short"\nsecret-key = "short"\n')
    with pytest.raises(ConfigError, match="server secret key .* holds no public key of 40 Z85 characters"):
        load_server_keys(d)
    r = kvxfer_cli("serve", "--url", f"tcp://127.0.0.1:{free_port()}", "--curve-dir", str(d), "--l1-size", "8MiB")
    assert r.returncode == 2 and "holds no public key" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_kvxfer_keys_never_changes_an_existing_directory_and_names_what_it_cannot_use(tmp_path):
    """`kvxfer keys /tmp` must not make /tmp private: an existing directory open to others is
    refused with what to do, and left as it was; paths that cannot be a directory, and key
    folders that are files, are one-line errors."""
    shared = tmp_path / "scratch"
    shared.mkdir()
    shared.chmod(0o1777)
    r = kvxfer_cli("keys", str(shared))
    assert r.returncode == 2 and f"key directory {shared} is open to others (mode 1777)" in r.stderr, r.stderr
    # a shared (sticky) directory is never to be made private: only a new one is suggested
    assert "chmod" not in r.stderr and mode(shared) == 0o1777 and not list(shared.iterdir())
    own = tmp_path / "own"
    own.mkdir(mode=0o755)
    own.chmod(0o755)
    r = kvxfer_cli("keys", str(own))
    assert r.returncode == 2 and f"or run `chmod 700 {own}` if this one is meant for keys alone" in r.stderr
    for bad, says in ((str(tmp_path / "file" / "keys"), f"cannot be checked: {tmp_path / 'file'} is not a directory"),
                      (str(tmp_path / "file"), "exists and is not a directory"),
                      ("", "name the key directory")):
        (tmp_path / "file").write_text("x")
        r = kvxfer_cli("keys", bad)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = kvxfer_cli("status", "--url", "tcp://127.0.0.1:1", "--curve-dir", "/dev/null", "--timeout", "1")
    assert r.returncode == 2 and "key directory /dev/null is not a directory" in r.stderr, r.stderr


# --------------------------------------------------------------------------- tcp://


def test_tcp_without_authentication_refuses_to_start(tmp_path):
    port = free_port()
    r = kvxfer_cli("serve", "--url", f"tcp://127.0.0.1:{port}", "--l1-size", "8MiB")
    assert r.returncode == 2
    assert "refusing to serve" in r.stderr and "kvxfer keys" in r.stderr and "--curve-dir" in r.stderr
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o700)
    r = kvxfer_cli("serve", "--url", f"tcp://127.0.0.1:{port}", "--curve-dir", str(empty), "--l1-size", "8MiB")
    assert r.returncode == 2 and "kvxfer keys" in r.stderr


@pytest.fixture(scope="module")
def tcp_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("curve") / "keys"
    make_keys(d)
    add_client(d, "second")
    server = TcpServer(d)
    try:
        server.wait_ready(load_client_keys(d))
        yield server
    finally:
        server.stop()


def test_tcp_authorized_clients_store_and_retrieve(tcp_server):
    for name in ("client", "second"):
        with CacheClient(tcp_server.url, curve=load_client_keys(tcp_server.curve_dir, name), timeout=20) as c:
            w = Writer(c, model=f"tcp-{name}")
            ks = [key(name, j) for j in range(4)]
            assert w.store(ks).stored == [0, 1, 2, 3]
            res, bad = w.retrieve(ks)
            assert res.loaded == [0, 1, 2, 3] and bad == []
    r = kvxfer_cli("status", "--url", tcp_server.url, "--curve-dir", str(tcp_server.curve_dir), "--json")
    assert r.returncode == 0, r.stderr
    assert '"url": "' + tcp_server.url in r.stdout


def _stranger_keys(server_public: bytes) -> CurveClientKeys:
    public, secret = zmq.curve_keypair()
    return CurveClientKeys(public, secret, server_public)


def test_a_peer_without_a_key_stalled_in_its_handshake_is_dropped(tcp_server):
    """Before a peer's CURVE handshake is done ZeroMQ already takes a frame of up to
    --max-message-size from it (16 MiB held per connection): one that never finishes its
    handshake is dropped after HANDSHAKE_MS (ZeroMQ's default kept it 30 s), and the server
    serves its authorized clients meanwhile."""
    import socket
    import time

    from kvxfer.mq.server import HANDSHAKE_MS

    host, port = tcp_server.url.removeprefix("tcp://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=30)
    try:
        # ZMTP 3 greeting naming CURVE, then the head of a 16 MiB frame and all of it but its last byte
        s.sendall(b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"CURVE".ljust(20, b"\0") + bytes(32))
        greeting = b""
        while len(greeting) < 64:
            got = s.recv(64 - len(greeting))
            assert got, "the server closed the connection before its greeting"
            greeting += got
        s.sendall(bytes([0x06]) + (16 << 20).to_bytes(8, "big") + b"B" * ((16 << 20) - 1))
        start = time.monotonic()
        with CacheClient(tcp_server.url, curve=load_client_keys(tcp_server.curve_dir), connect_timeout=10) as c:
            assert c.status().url == tcp_server.url
        assert s.recv(16) == b"", "a peer stalled in its handshake got an answer"
        held = time.monotonic() - start
    finally:
        s.close()
    assert held < 3 * HANDSHAKE_MS / 1e3, f"the stalled peer was held {held:.1f} s"


@pytest.mark.parametrize("who", ["no keys", "unknown client key", "wrong server key", "raw zmq, no keys"])
def test_tcp_client_without_the_key_is_refused(tcp_server, who):
    server_public = load_server_keys(tcp_server.curve_dir).public
    good = load_client_keys(tcp_server.curve_dir)
    if who == "raw zmq, no keys":
        # a bare DEALER speaking the protocol in the clear gets no answer, not even an error
        ctx = zmq.Context.instance()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(tcp_server.url)
        from kvxfer.protocol import codec
        from kvxfer.protocol.messages import PROTOCOL_VERSION, Handshake, StatusRequest

        s.send_multipart([codec.pack_id(1), b"handshake", codec.encode(Handshake(PROTOCOL_VERSION))])
        s.send_multipart([codec.pack_id(2), b"status", codec.encode(StatusRequest())])
        assert s.poll(1500) == 0
        s.close(0)
    elif who == "no keys":  # refused at once: a tcp:// server never answers a client without a key
        with pytest.raises(ConfigError, match=f"{tcp_server.url} is a tcp:// server: it answers only clients with an "
                                              "authorized CURVE key") as refused:
            CacheClient(tcp_server.url, connect_timeout=30.0)
        assert "nothing was sent" in str(refused.value)
    else:
        curve = {"unknown client key": _stranger_keys(server_public),
                 "wrong server key": CurveClientKeys(good.public, good.secret, zmq.curve_keypair()[0])}[who]
        with pytest.raises(ConnectionFailed, match=f"a process listens at {tcp_server.url} but did not answer "
                                                   "kvxfer's handshake") as info:
            CacheClient(tcp_server.url, curve=curve, connect_timeout=1.0)
        text = str(info.value)  # the keys, the likeliest cause, come first
        assert "authorized CURVE key" in text and text.index("refused this client's keys") < text.index("still starting")
        # one message: no second server suggested (one listens), and the timeout is not repeated
        assert "kvxfer serve --url" not in str(info.value)
        assert "got no reply" not in str(info.value)
        if who == "unknown client key":  # the operator learns which key knocked (the ZAP handler's words were DEBUG)
            line = f"refused a tcp:// client: its CURVE public key {curve.public.decode()!r} is not in the server's"
            assert any(line in ln for ln in tcp_server.log().splitlines()), tcp_server.log()[-2000:]
    if who == "no keys":
        r = kvxfer_cli("status", "--url", tcp_server.url, "--timeout", "1")
        assert r.returncode == 2 and "--curve-dir" in r.stderr
    # the server keeps serving its authorized clients
    with CacheClient(tcp_server.url, curve=good, connect_timeout=10) as c:
        assert c.status().url == tcp_server.url


def test_sighup_reads_the_authorized_keys_again(tmp_path):
    """A client added to ``authorized/`` while the server ran was refused until a restart (which
    empties the cache). On SIGHUP the server reads the folder again: a key added gets in; a key
    removed is refused from its next handshake, and what its open connection sends is dropped
    unanswered. A folder that no longer reads as one of keys adds no key and keeps only those of
    the keys before that it still lists: a revocation beside a broken file holds, and an emptied
    folder lets no client in (it kept every key before)."""
    import signal
    import time

    d = tmp_path / "keys"
    make_keys(d)
    server = TcpServer(d)

    def reloaded(n: int) -> str:
        server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            lines = [ln for ln in server.log().splitlines() if "authorized client keys" in ln]
            if len(lines) >= n:
                return lines[n - 1]
            time.sleep(0.05)
        raise AssertionError(server.log()[-3000:])

    def refused(name: str, wait: float = 1.0) -> bool:
        """Whether the server turns ``name``'s key away: no handshake within ``wait`` seconds (a
        refused CURVE handshake is never answered). A check that expects it let in waits longer."""
        try:
            CacheClient(server.url, curve=load_client_keys(d, name), connect_timeout=wait).close()
        except ConnectionFailed:
            return True
        return False

    try:
        server.wait_ready(load_client_keys(d))
        paths = add_client(d, "late")
        assert refused("late")
        assert "reloaded" in reloaded(1) and "1 added, 0 removed" in server.log()
        with CacheClient(server.url, curve=load_client_keys(d, "late"), timeout=2) as late:
            assert late.status().url == server.url
            paths["authorized"].unlink()
            assert "0 added, 1 removed" in reloaded(2)
            assert refused("late")
            with pytest.raises(ConnectionFailed):  # its open connection is answered no more
                late.status()
        assert "whose CURVE public key" in server.log() and "is no longer in the server's authorized/" in server.log()
        with CacheClient(server.url, curve=load_client_keys(d), timeout=20) as c:
            assert c.status().url == server.url  # the others are served as before
        # a key removed beside a broken file and a new one: revoked, and the new one stays out
        add_client(d, "third")
        assert "1 added" in reloaded(3) and not refused("third", wait=10.0)
        (d / "authorized" / "third.key").unlink()
        add_client(d, "fourth")
        (d / "authorized" / "broken.key").write_text("no key here\n")
        line = reloaded(4)
        assert "with an error, so no key was added" in line and "broken.key" in line, line
        assert refused("third") and refused("fourth") and not refused("client", wait=10.0)
        for key in (d / "authorized").iterdir():  # no key left: every client is refused
            key.unlink()
        assert "no client is let in" in reloaded(5)
        assert refused("client")
        add_client(d, "client2")  # and a clean folder lets clients in again
        assert "1 added" in reloaded(6) and not refused("client2", wait=10.0)
        assert server.proc.poll() is None
    finally:
        server.stop()


def test_a_key_folder_others_can_write_lets_no_one_in(tmp_path):
    """Who can write ``authorized/``, one of its key files or the key directory can let
    themselves in; like ssh's StrictModes, the server refuses them unless they are its user's
    (or root's) and no one else can write them, at start and when it reads the folder again.
    (Not tried here: the exemption of a read-only file system, where a Kubernetes Secret lives.)"""
    d = tmp_path / "keys"
    make_keys(d)
    key = d / "authorized" / "client.key"
    authorized = load_server_keys(d).authorized
    for path, mode, what in ((d, 0o777, "key directory"), (d / "authorized", 0o1777, "authorized client keys"),
                             (key, 0o620, "authorized client key")):
        before = stat.S_IMODE(path.stat().st_mode)
        path.chmod(mode)
        with pytest.raises(ConfigError, match=rf"{what} {re.escape(str(path))} is writable by others"):
            load_server_keys(d)
        # read again on SIGHUP, it keeps no key either (it kept those let in before and still
        # listed: another user could put a revoked key's file, or a link to it, back in)
        keys, error = reread_authorized_keys(d / "authorized", authorized)
        assert keys == frozenset() and error is not None and "writable by others" in error
        path.chmod(before)
    assert len(load_server_keys(d).authorized) == 1
    if os.getuid() == 0:  # only root can give a file away
        os.chown(key, 65534, -1)
        with pytest.raises(ConfigError, match=rf"authorized client key {re.escape(str(key))} belongs to another user"):
            load_server_keys(d)
        os.chown(key, 0, -1)
    # a key file that is a link (a Kubernetes Secret's are) is checked as the file it names
    outside = tmp_path / "outside.key"
    outside.write_bytes(key.read_bytes())
    outside.chmod(0o666)
    linked = d / "authorized" / "linked.key"
    linked.symlink_to(outside)
    with pytest.raises(ConfigError, match=rf"authorized client key {re.escape(str(linked))} is writable by others"):
        load_server_keys(d)
    outside.chmod(0o644)
    assert len(load_server_keys(d).authorized) == 1  # the same key twice
    linked.unlink()
    (d / "authorized" / "late.key").symlink_to(key)  # add_client never writes through a link there
    with pytest.raises(ConfigError, match="a symbolic link is there"):
        add_client(d, "late")


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (its SigCgt mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    raise AssertionError(f"no SigCgt in /proc/{pid}/status")


def test_a_tcp_peer_is_never_taken_for_an_ipc_process():
    """A tcp:// peer whose IPv6 address ends in three decimal groups was read as an ipc:// peer's
    ``PATH:UID:GID:PID`` (``2001:db8::10:20:30``: uid 10, pid 30): its log label and the count of
    its process's parked writes were another's. The server marks tcp:// peers as such."""
    from kvxfer.server.sessions import Peer

    tcp = Peer.parse("tcp:2001:db8::10:20:30|rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7")
    assert (tcp.uid, tcp.pid, tcp.curve_key) == (None, None, "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7")
    assert tcp.label().startswith("CURVE key rq:rM>}U?@Ln… at tcp:2001:db8::10:20:30")
    ipc = Peer.parse("/run/user/1000/kvxfer.sock:1000:1000:4242")
    assert (ipc.uid, ipc.pid) == (1000, 4242)


def test_sighup_reloads_a_tcp_servers_keys_and_stops_an_ipc_one_cleanly(tmp_path):
    """A tcp:// server reads its keys again on SIGHUP. An ipc:// one stops on it as on SIGTERM (its
    socket and arena removed), as a closed terminal should end it, and a second SIGHUP (a closing
    terminal sends two) does not make it exit at once, leaving its arena; started with SIGHUP ignored
    (under nohup) it keeps ignoring it. Until then SIGHUP's default ended it at once, leaving its
    socket, while kvxfer keys --client says to send SIGHUP to a server. Read from the kernel, so
    that the test holds whichever disposition this process passes on."""
    import signal

    from kvxfer.testing import ServerProcess

    ignored = signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    with ServerProcess(l1_size="8MiB") as srv:
        assert srv.proc is not None and _catches(srv.proc.pid, signal.SIGHUP) is not ignored
        if not ignored:
            sock = Path(srv.url.removeprefix("ipc://"))
            assert sock.exists()
            srv.proc.send_signal(signal.SIGHUP)  # a closing terminal's two: never the second signal's exit at once
            time.sleep(0.005)
            srv.proc.send_signal(signal.SIGHUP)
            assert srv.proc.wait(60) == 0, srv.log()
            assert not sock.exists() and "stopped: its arena and socket are removed" in srv.log()
    d = tmp_path / "keys"
    make_keys(d)
    server = TcpServer(d)
    try:
        server.wait_ready(load_client_keys(d))
        assert _catches(server.proc.pid, signal.SIGHUP)
    finally:
        server.stop()


def test_a_sighup_while_a_tcp_server_starts_is_a_reload_once_it_serves(tmp_path):
    """``kvxfer keys --client`` tells the operator to send SIGHUP; one sent while the server still
    fills its arena in (seconds for a large one) ended it (exit 129), as the handler came only
    when it began to serve. It is caught from the start and acted on once the server serves."""
    import signal

    d = tmp_path / "keys"
    make_keys(d)
    server = TcpServer(d, l1_size="2GiB")  # seconds to fill in on these machines
    try:
        deadline = time.monotonic() + 30
        while not _catches(server.proc.pid, signal.SIGHUP):
            assert server.proc.poll() is None and time.monotonic() < deadline, server.log()
            time.sleep(0.01)
        assert "serving" not in server.log()  # still starting
        add_client(d, "late")
        server.proc.send_signal(signal.SIGHUP)
        server.wait_ready(load_client_keys(d), timeout=120)
        wait = time.monotonic() + 20
        while "authorized client keys reloaded" not in server.log():
            assert time.monotonic() < wait, server.log()
            time.sleep(0.05)
        with CacheClient(server.url, curve=load_client_keys(d, "late"), timeout=20) as c:
            assert c.status().url == server.url
    finally:
        server.stop()
