"""Hostile clients and hostile neighbours: what a client sends, what another local user plants,
and what a session can make the server hold.

Each test reproduces one way a client or a local user could hurt the server or another client,
with real server processes, real client processes, raw frames and real files, and checks that it
no longer can. Servers are shared per module where a test leaves them as it found them.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import pytest
import torch
from relkit import RawPeer, Shape, Writer, key, proc_kib, read_event, threads, wait_until

from kvxfer import CacheClient, liveness
from kvxfer.errors import KvxferError, RemoteError
from kvxfer.layout import MAX_LAYERS, KVLayout, LayoutError, LayoutKind
from kvxfer.protocol import codec
from kvxfer.protocol import messages as m
from kvxfer.server.allocator import Allocator
from kvxfer.testing.server import ServerProcess

#: a killed or silent client's session is dropped after 3 s; the rest is slack for a loaded machine
DROP_WITHIN_S = 30.0
NOBODY = 65534


def kvxfer_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvxfer", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def error_of(fn) -> RemoteError:
    with pytest.raises(RemoteError) as info:
        fn()
    return info.value


def _private_shm_dir():
    d = Path(tempfile.mkdtemp(prefix="kvxfer-hostile-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


#: Private directories under /dev/shm for the arenas of this module's servers: what a server
#: there removes as stale can only be ours, never another test run's. The pid-namespace tests
#: get one of their own.
shm_dir = pytest.fixture(scope="module")(_private_shm_dir)
ns_shm_dir = pytest.fixture(_private_shm_dir)


@pytest.fixture(scope="module")
def debug_server(shm_dir):
    """cpu_gather and the example file_debug (named, so loaded although not for production)."""
    with ServerProcess(l1_size="32MiB", chunk_size=64, transports="cpu_gather,file_debug",
                       extra_args=["--shm-dir", str(shm_dir)]) as server:
        yield server


def registration(ref: Writer, transport: str, instance_id: int, **extra: object) -> m.Register:
    """A registration with ``ref``'s layout (and ``extra`` fields, of any version) as a raw map."""
    reg = msgspec.structs.asdict(ref.ctx.registration())
    for name in ("row_elems", "row_pitch", "run_offsets", "block_stride", "page"):
        reg.pop(name, None)  # a contiguous flash-attention cache: the server derives its geometry
    reg.update(instance_id=instance_id, **extra)
    if transport != "cpu_gather":
        reg.pop("device", None)
    return m.Register(transport, msgspec.Raw(codec.encode(reg)))


def file_debug_registration(ref: Writer, instance_id: int, **extra: object) -> bytes:
    return codec.encode(registration(ref, "file_debug", instance_id, **extra))


# --------------------------------------------------------------------------- 1. transports


def test_a_default_server_leaves_transports_not_meant_for_production_alone(shm_dir):
    with ServerProcess(l1_size="8MiB", chunk_size=64, extra_args=["--shm-dir", str(shm_dir)]) as server:
        with CacheClient(server.url) as c:
            assert "cpu_gather" in c.server_transports
            assert "file_debug" not in c.server_transports, "loaded without being named in --transports"


def test_no_request_can_create_truncate_or_write_a_file_of_its_choosing(debug_server, tmp_path):
    """Through the example transport: a registration naming a directory (a home's .ssh, the
    arena's own) and params naming files in it (authorized_keys, the arena) write nothing there,
    and the arena keeps its size: the server lives on (no SIGBUS) and every chunk is intact."""
    with CacheClient(debug_server.url, timeout=10) as client:
        ref = Writer(client, model="fd")
        keys = [key("fd", j) for j in range(2)]
        assert ref.store(keys).stored == [0, 1]
        arena = Path(client.arena_path)
        size = arena.stat().st_size
        ssh = tmp_path / "home" / ".ssh"
        ssh.mkdir(parents=True, mode=0o700)
        rows = ref.ctx.layout.rows(torch.tensor(ref.blocks(1))).tolist()
        peer = RawPeer(debug_server.url)
        try:
            for n, (directory, name) in enumerate([(ssh, "authorized_keys"), (arena.parent, "arena")]):
                iid = 4242_0000 + n
                peer.call(b"register", file_debug_registration(ref, iid, spool_dir=str(directory)))
                for params in ({"file": name, "rows": rows}, {"slot": 0, "file": name, "rows": rows}):
                    peer.call(b"retrieve", codec.encode(m.Retrieve(iid, keys[:1], ref.blocks(1),
                                                                   params=msgspec.Raw(codec.encode(params)))))
        finally:
            peer.close()
        assert not (ssh / "authorized_keys").exists(), "a request created a file of its choosing"
        assert arena.stat().st_size == size, "a request truncated the arena"
        res, bad = ref.retrieve(keys)  # the server lives and its chunks are intact
        assert res.loaded == [0, 1] and bad == []


# --------------------------------------------------------------------------- 2. exact accounting


@pytest.mark.parametrize("end", ["release", "expiry"])
def test_a_lease_of_repeated_hashes_pins_nothing_once_it_ends(debug_server, end):
    with CacheClient(debug_server.url, timeout=10) as client:
        w = Writer(client, model=f"lease-{end}")
        k = key(w.model, 0)
        assert w.store([k]).stored == [0]
        reply = client.request(m.Lookup(w.model, 1, [k, k, k], 1.0))
        assert reply.hits == 3 and reply.lease_id
        if end == "release":
            client.release_lease(reply.lease_id)
        wait_until(lambda: client.status().leases == 0, 30.0, "the lease ended")
        assert client.clear(w.model) == 1, "the chunk stayed pinned after its lease ended"
        assert getattr(client.status().arena, "pinned_chunks", 0) == 0


# --------------------------------------------------------------------------- 3. forged identity


def test_another_connection_cannot_free_the_parked_writes_of_a_frozen_client(server, client_of, workers):
    """A client frozen mid-write keeps its slots (parked) while it lives. A second connection
    that claims its identity (its liveness token, read from the lock file's name; its instance
    and reservation ids, however learnt) cannot commit or abort that write: the slots stay
    reserved, so nobody else's chunks go where the frozen writer will copy when it wakes."""
    observer = client_of(server)
    mine = {observer._token}
    w = workers("hold-write", "--url", server.url, "--model", "frozen", "--chunks", "4")
    held = read_event(w, "held")
    locks = Path(observer.arena_path).parent.glob("client-*.lock")
    tokens = [p.name[len("client-"):-len(".lock")] for p in locks if p.name[len("client-"):-len(".lock")] not in mine]
    assert len(tokens) == 1, tokens
    os.kill(w.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: all(c.client_pid != w.pid for c in observer.status().contexts), DROP_WITHIN_S,
                   "the frozen client's registration dropped")
        before = observer.status()
        assert before.reservations == 1, before  # its write is parked, not freed
        attacker = RawPeer(server.url)
        try:
            attacker.handshake(client_token=tokens[0], client_name="attacker")
            for _ in range(2):
                attacker.call(b"commit_write", codec.encode(
                    m.CommitWrite(held["instance_id"], held["reservation_id"])))
            attacker.call(b"commit_write", codec.encode(
                m.CommitWrite(held["instance_id"], held["reservation_id"], list(range(4)))))
        finally:
            attacker.close()
        after = observer.status()
        assert after.reservations == 1 and after.arena.used == before.arena.used, \
            "another connection freed the frozen client's parked slots"
    finally:
        os.kill(w.pid, signal.SIGKILL)
        w.wait()
    wait_until(lambda: observer.status().reservations == 0, DROP_WITHIN_S, "the dead client's slots freed")


def test_a_silent_client_s_open_writes_with_no_slot_are_not_parked(server, client_of, workers):
    """Writes of chunks the server had already hold no slot: when their client goes silent while
    it lives, nothing of them is kept (parking them would only use up --max-reservations)."""
    observer = Writer(client_of(server), model="frozen-empty")
    keys = [key("frozen-empty", j) for j in range(4)]
    assert observer.store(keys).stored == list(range(4))
    w = workers("hold-write", "--url", server.url, "--model", "frozen-empty", "--chunks", "4")
    assert read_event(w, "held")["slots"] == 0
    os.kill(w.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: all(c.client_pid != w.pid for c in observer.client.status().contexts), DROP_WITHIN_S,
                   "the frozen client's registration dropped")
        assert observer.client.status().reservations == 0
    finally:
        os.kill(w.pid, signal.SIGKILL)
        w.wait()


class _Resumer:
    """Sessions of one client over raw connections, each a new one that resumes the last (as a
    CacheClient does after its connection broke): the client token's lock held throughout."""

    def __init__(self, url: str, ref: Writer) -> None:
        self.url, self.ref = url, ref
        self.peers: list[RawPeer] = []
        self.secret = b""
        self.token = ""
        self.lock: liveness.ProcessLock | None = None

    def connect(self) -> RawPeer:
        peer = RawPeer(self.url)
        self.peers.append(peer)
        reply = peer.handshake(resume=self.secret)
        self.secret, token = reply["session_secret"], reply["client_token"]
        if token != self.token:
            if self.lock is not None:
                self.lock.release()
            self.lock = liveness.ProcessLock.hold(reply["arena_path"], token)
            self.token = token
        return peer

    def open_write(self, peer: RawPeer, instance_id: int, n: int) -> int:
        assert peer.call(b"register", codec.encode(registration(self.ref, "cpu_gather", instance_id)))[0] == codec.OK
        status, body = peer.call(b"reserve_write", codec.encode(m.ReserveWrite(instance_id, [key("resume", n)])))
        assert status == codec.OK, body
        reply = codec.decode(body, m.ReserveWriteReply)
        assert reply.slots
        return reply.reservation_id

    def open_read(self, peer: RawPeer, instance_id: int, k: bytes) -> int:
        """Register ``instance_id`` on ``peer`` and reserve a read of chunk ``k``: its reservation id."""
        assert peer.call(b"register", codec.encode(registration(self.ref, "cpu_gather", instance_id)))[0] == codec.OK
        status, body = peer.call(b"reserve_read", codec.encode(m.ReserveRead(instance_id, [k])))
        assert status == codec.OK, body
        return codec.decode(body, m.ReserveReadReply).reservation_id

    def close(self) -> None:
        for peer in self.peers:
            peer.close()
        if self.lock is not None:
            self.lock.release()


def test_a_client_that_resumes_its_open_session_on_a_new_connection_keeps_its_open_write(server, client_of):
    """A client whose connection broke while a write of its was open (its copy still running)
    resumes its session on a new connection before the server timed the old one out: the old
    session ends at once with the write parked, the new one keeps the client's token (so the
    lock the client holds keeps the write parked), and the late commit frees the slots. Before,
    the new session got a new token, the client let the old lock go, and the write's slots were
    freed at the old session's timeout while the client still copied into them: another
    client's chunk stored there was overwritten."""
    observer = client_of(server)
    ref = Writer(observer, model="resume-ref")
    client = _Resumer(server.url, ref)
    try:
        first = client.connect()
        token = client.token
        rid = client.open_write(first, 4343_0001, 0)
        used = observer.status().arena.used
        again = client.connect()
        assert client.token == token, "the resumed session got another client token"
        st = observer.status()
        assert st.reservations == 1 and st.arena.used == used, st  # parked, not freed
        assert all(c.instance_id != 4343_0001 for c in st.contexts)  # the old session ended
        err = again.error(b"commit_write", codec.encode(m.CommitWrite(4343_0001, rid)))
        assert err is not None and "resumed the session on a new connection" in err[1], err
        st = observer.status()
        assert st.reservations == 0 and st.arena.used == used - ref.ctx.chunk_bytes, st
        assert first.error(b"ping", codec.encode(m.Ping()))[0] == "no_session"  # the old connection has no session
    finally:
        client.close()


def test_a_client_that_says_goodbye_with_an_open_write_keeps_nothing_parked(server, client_of):
    """A goodbye ends a session whose client has closed its contexts (their copies are over):
    its open writes are aborted, not parked, however alive the client is."""
    observer = client_of(server)
    client = _Resumer(server.url, Writer(observer, model="goodbye-ref"))
    try:
        peer = client.connect()
        client.open_write(peer, 4343_0002, 0)
        assert observer.status().reservations == 1
        assert peer.call(b"goodbye", codec.encode(m.Goodbye()))[0] == codec.OK
        st = observer.status()
        assert st.reservations == 0 and st.arena.used == 0, st
    finally:
        client.close()


def test_a_client_that_ends_sessions_as_fast_as_it_opens_them_does_not_flood_the_log(shm_dir):
    """Each session that registered something logs a line when it ends, with the client's name
    (up to --max-name-length characters): one client cycling handshake, register and goodbye
    wrote 1 MB of log a second. Those lines are throttled (the first at once, then at most one a
    second with the count of those left out) and show at most 64 characters of the name."""
    name = "n" * 500
    with ServerProcess(l1_size="32MiB", chunk_size=64, transports="cpu_gather",
                       extra_args=["--shm-dir", str(shm_dir)]) as server, \
            CacheClient(server.url, timeout=20) as observer:
        ref = Writer(observer, model="log-ref")
        for n in range(60):
            peer = RawPeer(server.url)
            try:
                peer.handshake(client_name=name)
                assert peer.call(b"register", codec.encode(registration(ref, "cpu_gather", 4343_0500 + n)))[0] \
                    == codec.OK
                assert peer.call(b"goodbye", codec.encode(m.Goodbye()))[0] == codec.OK
            finally:
                peer.close()
        wait_until(lambda: observer.status().sessions == 1, 10.0, "the cycled sessions ended")
        ended = [ln for ln in server.log().splitlines() if "ended (closed by the client)" in ln]
        assert 1 <= len(ended) <= 5, len(ended)
        assert all(name[:65] not in ln for ln in ended), ended[0]


_OTHER_PROCESS_STORES = """
import sys, torch
from kvxfer import CacheClient
with CacheClient(sys.argv[1], timeout=20) as c:
    kv = [torch.zeros(2, 16, 16, 2, 64, dtype=torch.bfloat16) for _ in range(2)]
    ctx = c.register(kv, model_name="other-process", block_size=16, transport="cpu_gather")
    print(ctx.submit_store([bytes(16)], list(range(c.chunk_size // 16))).result(20).stored)
    ctx.close()
"""


def _store_from_another_process(url: str) -> str:
    """What a store of one chunk by a CacheClient in a process of its own (this user's) returned."""
    out = subprocess.run([sys.executable, "-c", _OTHER_PROCESS_STORES, url], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 or "LimitExceeded" in out.stderr, out.stderr[-2000:]
    return out.stdout.strip() if out.returncode == 0 else out.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("namespace", ["same", "other"])
def test_the_parked_reservations_of_one_process_are_bounded_and_hold_back_no_other(ns_shm_dir, namespace):
    """Open writes outlive a session only as parked, and are freed only when their process is
    gone (it may still copy into them). A process that ended sessions with open writes, one
    after another, has them count as its next session's own: while
    --max-reservations-per-session of them are parked, its new sessions get no reservation, so
    it cannot hold every reservation of the server. Another process of the same user (on
    ipc:// every client has the server's uid) reserves as before: the bound was per user, and
    one frozen or hostile client refused every store of every engine. Once that client is
    gone, its parked writes go, and it reserves again. With the server in a pid namespace of
    its own (a container), where the kernel shows every client as pid 0, the bound is per client
    (its token): per pid, it was one bound for every client again."""
    server = ServerProcess(l1_size="32MiB", chunk_size=64, transports="cpu_gather",
                           extra_args=["--shm-dir", str(ns_shm_dir), "--max-reservations-per-session", "3"])
    if namespace == "other":
        server = _in_new_pid_namespace(server)
    with server, CacheClient(server.url, timeout=20) as observer:
        ref = Writer(observer, model="cap-ref")
        client = _Resumer(server.url, ref)
        try:
            for n in range(3):
                client.open_write(client.connect(), 4343_0100 + n, n)
            peer = client.connect()  # ends the third session with its write open
            assert observer.status().reservations == 3
            assert peer.call(b"register", codec.encode(registration(ref, "cpu_gather", 4343_0199)))[0] == codec.OK
            err = peer.error(b"reserve_write", codec.encode(m.ReserveWrite(4343_0199, [key("resume", 9)])))
            assert err is not None and err[0] == "limit_exceeded" and "max_reservations_per_session" in err[1], err
            assert _store_from_another_process(server.url) == "[0]"
            assert observer.status().reservations == 3  # none of the parked ones was freed
        finally:
            client.close()
        wait_until(lambda: observer.status().reservations == 0, DROP_WITHIN_S, "the gone client's parked slots freed")
        assert Writer(observer, model="cap-victim").store([key("cap-victim", 0)]).stored == [0]


def test_the_parked_bytes_of_one_process_count_against_its_sessions(shm_dir):
    """--max-reserved-bytes-per-session bounds what a process holds in parked writes as well:
    one that reserves its whole allowance, resumes (parking it) and reserves again gets no more
    than one session's bytes. Before, each resume gave it a fresh allowance, and one client
    held every slot of the arena in parked writes, so that every other client's stores found
    no room for as long as it lived."""
    slot = Allocator.rounded(Shape().chunk_bytes(64))
    with ServerProcess(l1_size="32MiB", chunk_size=64, transports="cpu_gather",
                       extra_args=["--shm-dir", str(shm_dir), "--max-reserved-bytes-per-session", str(2 * slot)]) \
            as server, CacheClient(server.url, timeout=20) as observer:
        ref = Writer(observer, model="bytes-ref")
        client = _Resumer(server.url, ref)
        try:
            for n in range(2):
                client.open_write(client.connect(), 4343_0400 + n, n)
            peer = client.connect()  # both writes parked: the process's whole allowance
            assert peer.call(b"register", codec.encode(registration(ref, "cpu_gather", 4343_0499)))[0] == codec.OK
            err = peer.error(b"reserve_write", codec.encode(m.ReserveWrite(4343_0499, [key("resume", 9)])))
            assert err is not None and err[0] == "limit_exceeded" and "max_reserved_bytes_per_session" in err[1], err
            assert _store_from_another_process(server.url) == "[0]"
        finally:
            client.close()


def test_a_client_that_resumes_its_open_session_keeps_the_pins_of_its_open_read(server, client_of):
    """A read reserved before the client's connection broke keeps its pins when the client
    resumes on a new connection: its copy may still run (the client counts on the pins for the
    session timeout after its reserve). Nothing can evict or clear the chunk until the late
    commit_read, answered as any commit, unpins it."""
    observer = client_of(server)
    ref = Writer(observer, model="resume-read")
    k = key("resume-read", 0)
    assert ref.store([k]).stored == [0]
    client = _Resumer(server.url, ref)
    try:
        rid = client.open_read(client.connect(), 4343_0301, k)
        again = client.connect()
        assert observer.status().reservations == 1
        assert observer.clear("resume-read") == 0, "a pinned chunk was cleared while its read may still copy"
        assert again.error(b"commit_read", codec.encode(m.CommitRead(4343_0301, rid, loaded=True))) is None
        assert observer.status().reservations == 0
        assert observer.clear("resume-read") == 1
    finally:
        client.close()


# --------------------------------------------------------------------------- 4. liveness across pid namespaces


def _arena_dirs(shm: Path) -> set[str]:
    return {p.name for p in shm.iterdir() if p.name.startswith("kvxfer-")}


def _in_new_pid_namespace(server: ServerProcess) -> ServerProcess:
    """Run ``server`` as pid 1 of a new pid namespace (killed with its ``unshare`` parent)."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--pid", "--fork", "true"]).returncode:
        pytest.skip("cannot create pid namespaces here (unshare --pid needs CAP_SYS_ADMIN)")
    server.args = ["unshare", "--pid", "--fork", "--kill-child", *server.args]
    server.exit_with_parent = False  # its parent is outside its namespace (getppid() 0): it dies with unshare
    return server


def test_a_server_in_another_pid_namespace_never_removes_a_live_arena(ns_shm_dir):
    shm_dir = ns_shm_dir
    with ServerProcess(l1_size="8MiB", chunk_size=64, transports="cpu_gather",
                       extra_args=["--shm-dir", str(shm_dir)]) as a, CacheClient(a.url) as client:
        arena = Path(client.arena_path)
        other = _in_new_pid_namespace(ServerProcess(l1_size="8MiB", chunk_size=64, transports="cpu_gather",
                                                    extra_args=["--shm-dir", str(shm_dir)]))
        with other:  # started: its first act was to look for stale arenas
            other.kill()  # (unshare --fork ignores SIGTERM: no need to wait for it)
        assert arena.exists(), "a server in another pid namespace removed a live server's arena"
        w = Writer(client, model="ns")
        assert w.store([key("ns", 0)]).stored == [0]
        res, bad = w.retrieve([key("ns", 0)])
        assert res.loaded == [0] and bad == []


def test_the_arena_of_a_dead_pid_1_server_is_removed(ns_shm_dir):
    """A server that was pid 1 of its namespace, killed: the next server removes its arena."""
    shm_dir = ns_shm_dir
    before = _arena_dirs(shm_dir)
    dead = _in_new_pid_namespace(ServerProcess(l1_size="8MiB", chunk_size=64, transports="cpu_gather",
                                               extra_args=["--shm-dir", str(shm_dir)])).start()
    left = _arena_dirs(shm_dir) - before
    assert len(left) == 1, left
    dead.kill()  # SIGKILL: nothing of it cleans up
    assert _arena_dirs(shm_dir) - before == left
    with ServerProcess(l1_size="8MiB", chunk_size=64, transports="cpu_gather",
                       extra_args=["--shm-dir", str(shm_dir)]):
        assert not left & _arena_dirs(shm_dir), "the dead server's arena was left behind"


# --------------------------------------------------------------------------- 5. socket directories


@pytest.fixture
def private_tmp():
    """A private directory whose parents only root can change (where another user's entries can
    be planted by chown, as root)."""
    d = Path(tempfile.mkdtemp(prefix="kvxfer-sock-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_squatted_default_socket_directory_is_refused_with_a_way_out(private_tmp, shm_dir):
    if os.geteuid() != 0:
        pytest.skip("planting another user's directory needs root")
    xdg = private_tmp / "xdg"
    xdg.mkdir(mode=0o700)
    squat = xdg / "kvxfer"
    squat.mkdir(mode=0o700)
    os.chown(squat, NOBODY, NOBODY)
    env = {"XDG_RUNTIME_DIR": str(xdg), "KVXFER_URL": ""}
    r = kvxfer_cli("serve", "--l1-size", "8MiB", "--transports", "cpu_gather", "--shm-dir", str(shm_dir), env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert str(squat) in r.stderr and "another user" in r.stderr
    assert "XDG_RUNTIME_DIR" in r.stderr and "--url" in r.stderr, r.stderr
    # a client refuses it too, before sending anything
    r = kvxfer_cli("status", "--timeout", "2", env=env)
    assert r.returncode == 2 and str(squat) in r.stderr and "XDG_RUNTIME_DIR" in r.stderr, r.stderr


def test_a_planted_symlink_is_never_followed(private_tmp, shm_dir):
    target = private_tmp / "target"
    target.mkdir(mode=0o700)
    link = private_tmp / "kvxfer"
    link.symlink_to(target)
    proc = subprocess.Popen([sys.executable, "-m", "kvxfer", "serve", "--url", f"ipc://{link}/kvxfer.sock",
                             "--l1-size", "8MiB", "--transports", "cpu_gather", "--shm-dir", str(shm_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the server started on a socket directory that is a symbolic link")
    assert proc.returncode == 2 and "symbolic link" in err, err
    assert list(target.iterdir()) == []


@pytest.mark.parametrize("planted", ["socket", "directory"])
def test_a_client_sends_nothing_to_a_socket_of_another_user(private_tmp, planted):
    """Another user's socket where the client expects its server's (or a directory of theirs):
    the client refuses before it sends its handshake, naming the path."""
    if os.geteuid() != 0:
        pytest.skip("planting another user's socket needs root")
    import select

    d = private_tmp / "run"
    d.mkdir(mode=0o700)
    url = f"ipc://{d}/kvxfer.sock"
    fake = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fake.bind(str(d / "kvxfer.sock"))
    fake.listen(8)
    try:
        os.chown(d / "kvxfer.sock", NOBODY, NOBODY)
        if planted == "directory":
            os.chown(d, NOBODY, NOBODY)
        with pytest.raises(KvxferError) as info:
            CacheClient(url, connect_timeout=2.0).close()
        assert str(d) in str(info.value), info.value
        assert not select.select([fake], [], [], 1.0)[0], "the client connected to another user's socket"
    finally:
        fake.close()


@pytest.mark.parametrize("owner", ["another user", "this user"])
def test_a_symbolic_link_on_the_way_to_a_private_directory_must_be_root_s_or_ours(private_tmp, owner):
    """In a sticky directory (``/tmp``) anyone may plant a symbolic link, and make it lead to a
    directory of theirs between the check of a path and its use (the server's socket directory,
    the fs store's directory, the key directory ``kvxfer keys`` makes, a client's way to its
    server). A link on the way is taken only
    when it is root's or ours: another user's is refused, by the server's and the client's
    checks alike (they resolved the path first, and so checked only where it led then)."""
    if os.geteuid() != 0:
        pytest.skip("planting another user's link needs root")
    from kvxfer.security import make_keys
    from kvxfer.store import StoreOptions
    from kvxfer.store.fs import FsStore

    sticky = private_tmp / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    good = private_tmp / "good"
    (good / "srv").mkdir(parents=True, mode=0o700)
    good.chmod(0o700)
    link = sticky / "kv"
    link.symlink_to(good)
    if owner == "another user":
        os.lchown(link, NOBODY, NOBODY)
        with pytest.raises(KvxferError, match=f"is reached through {link}, a symbolic link of uid {NOBODY}"):
            FsStore().open(f"file://{link}/l2", StoreOptions()).close_connections()
        assert not (good / "l2").exists()
        with pytest.raises(KvxferError, match=f"a symbolic link of uid {NOBODY}"):
            CacheClient(f"ipc://{link}/srv/kvxfer.sock", connect_timeout=2.0).close()
        with pytest.raises(KvxferError, match=f"a symbolic link of uid {NOBODY}"):
            make_keys(link / "keys")
        assert not (good / "keys").exists()
    else:
        FsStore().open(f"file://{link}/l2", StoreOptions()).close_connections()
        assert (good / "l2").is_dir()
        make_keys(link / "keys")
        assert (good / "keys" / "authorized").is_dir()


def test_kvxfer_keys_adds_a_client_where_the_server_takes_its_keys(private_tmp):
    """The directories above are checked when ``kvxfer keys`` makes a key directory; an existing
    one is held to what a server holds it to (ours and private), so a client can be added to a
    key directory the server loads, in a parent of another user that only that user may write."""
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    from kvxfer.security import add_client, load_server_keys, make_keys

    parent = private_tmp / "theirs"
    make_keys(parent / "keys")
    os.chown(parent, NOBODY, NOBODY)
    parent.chmod(0o755)
    assert len(load_server_keys(parent / "keys").authorized) == 1
    add_client(parent / "keys", "second")
    assert len(load_server_keys(parent / "keys").authorized) == 2
    with pytest.raises(KvxferError, match=f"which belongs to uid {NOBODY}"):
        make_keys(parent / "more")  # nothing is made in it


def test_dot_dot_after_a_symbolic_link_is_walked_as_the_kernel_walks_it(private_tmp):
    """``..`` applies to where the link before it leads, as in the kernel: a home reached through
    a link whose cache links to ``../../scratch/u`` is the scratch directory beside the home's
    real place (taken), and ``e/../mine`` through another user's link ``e`` is checked through
    ``e`` (refused), not read as ``mine`` beside it."""
    from kvxfer.private_dirs import ensure_private_dir

    data = private_tmp / "data"
    (data / "home" / "u").mkdir(parents=True, mode=0o700)
    (data / "scratch" / "u").mkdir(parents=True, mode=0o700)
    (private_tmp / "home").symlink_to(data / "home")
    (data / "home" / "u" / "cache").symlink_to("../../scratch/u")
    ensure_private_dir(private_tmp / "home" / "u" / "cache" / "l2", "fs store directory")
    assert (data / "scratch" / "u" / "l2").is_dir()
    if os.geteuid() != 0:
        return  # planting another user's link needs root
    sticky = private_tmp / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    (sticky / "mine").mkdir(mode=0o700)
    elsewhere = private_tmp / "elsewhere" / "sub"
    elsewhere.mkdir(parents=True, mode=0o700)
    (elsewhere.parent / "mine").mkdir(mode=0o700)
    (sticky / "e").symlink_to(elsewhere)
    os.lchown(sticky / "e", NOBODY, NOBODY)
    with pytest.raises(KvxferError, match=f"a symbolic link of uid {NOBODY}"):
        ensure_private_dir(sticky / "e" / ".." / "mine" / "l2", "fs store directory")
    assert not (elsewhere.parent / "mine" / "l2").exists() and not (sticky / "mine" / "l2").exists()


def test_a_client_sends_nothing_to_a_listener_of_another_user_behind_its_own_socket_file(private_tmp):
    """The socket file is the client's own user's and in its directory, but the process
    listening on it is another user's (the file was swapped under the client between its
    checks and its connect, or the socket handed over): the client reads the listener's
    credentials from the kernel once connected and sends nothing."""
    if os.geteuid() != 0:
        pytest.skip("listening as another user needs root")
    d = private_tmp / "run"
    d.mkdir(mode=0o700)
    path = d / "kvxfer.sock"
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(str(path))  # the file is ours: the client's path checks pass
    ready_r, ready_w = os.pipe()
    got_r, got_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the listener: another user (the kernel reports who called listen())
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            lsock.listen(8)
            os.write(ready_w, b"1")
            conn, _ = lsock.accept()
            conn.settimeout(10)
            data = b""
            try:
                while chunk := conn.recv(4096):
                    data += chunk
            except OSError:
                pass
            os.write(got_w, str(len(data)).encode())
        finally:
            os._exit(0)
    lsock.close()
    try:
        assert os.read(ready_r, 1) == b"1"
        with pytest.raises(KvxferError, match=f"listening there is of uid {NOBODY}"):
            CacheClient(f"ipc://{path}", connect_timeout=2.0).close()
        assert os.read(got_r, 32) == b"0", "the client sent bytes to another user's listener"
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        for fd in (ready_r, ready_w, got_r, got_w):
            os.close(fd)


# --------------------------------------------------------------------------- 6. per-session limits


def test_open_connections_are_bounded(shm_dir):
    """Connections that never send anything cannot pile up: past --max-connections (plus 64 let
    in to hear that limit's error) a new connection is closed at once and logged, and the server
    goes on serving the ones it has."""
    from kvxfer.testing.wire import RawConnection

    with ServerProcess(l1_size="8MiB", chunk_size=64, transports="cpu_gather",
                       extra_args=["--max-connections", "1"]) as server:
        with CacheClient(server.url, timeout=30) as client:
            conns = [RawConnection(server.url) for _ in range(70)]  # the client's makes 71: 65 fit
            try:
                assert all(c.closed(5.0) for c in conns[-5:]), "a connection past the limit stayed open"
                assert not conns[0].closed(0.5)
                assert client.ping() > 0
                assert "refused a connection" in server.log()
            finally:
                for c in conns:
                    c.close()
            assert client.ping() > 0


def test_sessions_of_closed_connections_that_hold_nothing_end_at_once(shm_dir):
    """A client that handshakes and closes its connection, in a loop, without a goodbye: each
    session outlived its connection for --session-timeout, and at a few hundred a second they
    held every place of --max-connections, so that other clients' handshakes and `kvxfer
    status` were refused. A session that holds nothing now ends with its ipc:// connection;
    one that holds a registration is kept for its client to resume, as before."""
    with ServerProcess(l1_size="8MiB", chunk_size=64, transports="cpu_gather",
                       extra_args=["--shm-dir", str(shm_dir), "--max-connections", "8",
                                   "--session-timeout", "60"]) as server:
        with CacheClient(server.url, timeout=30) as client:
            for _ in range(40):  # five times the limit, each session closed at once
                peer = RawPeer(server.url)
                peer.handshake()
                peer.close()
            wait_until(lambda: client.status().sessions == 1, 10, "the sessions of closed connections to end")
            with CacheClient(server.url, timeout=30) as other:  # a place for another client
                assert other.ping() > 0
            ref = Writer(client, model="kept")
            holder = RawPeer(server.url)
            holder.handshake()
            assert holder.call(b"register", codec.encode(registration(ref, "cpu_gather", 4242)))[0] == codec.OK
            holder.close()
            time.sleep(1.0)  # (the loop takes a closed connection at its next turn)
            st = client.status()
            assert st.sessions == 2, "a session holding a registration ended with its connection"
            assert any(c.instance_id == 4242 for c in st.contexts)
        assert "(its connection closed)" not in server.log()  # sessions of nothing end quietly


def test_open_reservations_of_a_session_are_bounded(debug_server):
    """A session that reserves and never commits is refused once it holds the limit
    (limit_exceeded naming the option), and others are served meanwhile; its reservations go
    with its session."""
    with CacheClient(debug_server.url, timeout=20) as c, CacheClient(debug_server.url) as other:
        w = Writer(c, model="resv")
        k = [key("resv", 0)]
        assert w.store(k).stored == [0]
        futures = [c.submit(m.ReserveRead(w.ctx.instance_id, k)) for _ in range(1100)]
        codes = []
        for f in futures:
            try:
                f.result(30)
                codes.append("ok")
            except RemoteError as exc:
                codes.append(exc.code)
                message = str(exc)
        assert codes.count("ok") <= 1024 and "limit_exceeded" in codes, codes.count("ok")
        # the arena bytes they pin (64 KiB chunks, 32 MiB arena) or their number, whichever first
        assert "--max-reserved-bytes-per-session" in message or "--max-reservations-per-session" in message, message
        assert other.lookup("resv", hashes=k) == 1
    with CacheClient(debug_server.url) as c:
        wait_until(lambda: c.status().reservations == 0, DROP_WITHIN_S, "the closed session's reservations gone")


def test_leases_are_bounded_and_end_with_their_session(debug_server):
    with CacheClient(debug_server.url, timeout=20) as c:
        w = Writer(c, model="leases")
        k = [key("leases", 0)]
        assert w.store(k).stored == [0]
        err = error_of(lambda: c.lookup_and_lease("leases", hashes=k, lease_s=3600))
        assert err.code == "limit_exceeded" and "--max-lease" in str(err), err
        assert c.lookup_and_lease("leases", hashes=k, lease_s=300).lease_id
        assert c.status().leases >= 1
    with CacheClient(debug_server.url) as c:
        wait_until(lambda: c.status().leases == 0, DROP_WITHIN_S, "the closed session's lease released")


def test_leases_and_reads_of_the_same_chunks_again_and_again_are_bounded_by_their_chunk_count(shm_dir):
    """Leasing the same chunks over and over pins no more bytes (each counts once), but each
    lease keeps its own list of them: the chunks all leases and read reservations hold, counted
    every time, are bounded per session and in all, and come back as they are released. A lookup
    refused for them counts as no lookup."""
    args = ["--shm-dir", str(shm_dir), "--max-chunk-pins-per-session", "32", "--max-chunk-pins", "40"]
    with ServerProcess(l1_size="8MiB", chunk_size=64, transports="cpu_gather", extra_args=args) as server, \
            CacheClient(server.url, timeout=20) as a, CacheClient(server.url, timeout=20) as b:
        w = Writer(a, model="pins")
        k = [key("pins", j) for j in range(8)]
        assert w.store(k).stored == list(range(8))
        leases = [a.lookup_and_lease("pins", hashes=k, lease_s=300).lease_id for _ in range(4)]
        err = error_of(lambda: a.lookup_and_lease("pins", hashes=k, lease_s=300))
        assert err.code == "limit_exceeded" and "--max-chunk-pins-per-session" in str(err), err
        err = error_of(lambda: w.retrieve(k))
        assert err.code == "limit_exceeded" and "--max-chunk-pins-per-session" in str(err), err
        a.release_lease(leases.pop())
        res, bad = w.retrieve(k)  # a read of 8 fits again
        assert res.loaded == list(range(8)) and bad == []
        for _ in range(2):  # 24 + 16 held: the server's 40
            b.lookup_and_lease("pins", hashes=k, lease_s=300)
        err = error_of(lambda: b.lookup_and_lease("pins", hashes=k, lease_s=300))
        assert err.code == "limit_exceeded" and "limit max_chunk_pins reached" in str(err), err
        # the refused lookups did nothing, and count in no figure (the hit rate among them)
        pins = next(x for x in a.status().models if x.model == "pins")
        assert (pins.lookups, pins.lookup_chunks, pins.lookup_hits) == (6, 48, 48), pins


def test_a_flood_of_requests_without_a_request_id_does_not_flood_the_log(debug_server):
    """Each is dropped (there is no id to answer); the warning comes at most once a second, with
    the count of those left out."""
    import time

    from kvxfer.testing.wire import RawConnection

    line = "no request id to answer"
    before = debug_server.log().count(line)
    conn = RawConnection(debug_server.url)
    try:
        for _ in range(2000):
            conn.send([b"1234567", b"ping", b""])  # a 7-byte id
        with CacheClient(debug_server.url, timeout=20) as c:
            c.ping()  # answered after the flood (in order on the loop)
            time.sleep(1.1)
            conn.send([b"1234567", b"ping", b""])
            wait_until(lambda: "more since the last such line" in debug_server.log(), 20, "the count of those left out")
    finally:
        conn.close()
    assert debug_server.log().count(line) - before <= 3, debug_server.log()[-2000:]


def test_retrieves_past_their_deadline_do_not_flood_the_log_and_a_bad_deadline_is_refused(debug_server, tmp_path):
    """A server-driven retrieve whose deadline has passed copies nothing and is logged; a client
    sending thousands of them gets that line at most once a second (with the count of those left
    out). So does a store, which stores nothing. A deadline that is no Unix time (NaN, infinite,
    negative) is an invalid request."""
    import math
    import time

    from kvxfer_file_transport.transport import FileParams

    line = "past the deadline its client stopped waiting at"
    before = debug_server.log().count(line)
    with CacheClient(debug_server.url, timeout=30) as client:
        ref = Writer(client, model="deadline")
        keys = [key("deadline", 0)]
        assert ref.store(keys).stored == [0]
        peer = RawPeer(debug_server.url)
        try:
            iid = 4343_0000
            assert peer.call(b"register", file_debug_registration(ref, iid, spool_dir=str(tmp_path)))[0] == codec.OK

            def retrieve(deadline: float) -> bytes:
                return codec.encode(m.Retrieve(iid, keys, ref.blocks(1), params=msgspec.Raw(codec.encode(FileParams(0))),
                                               deadline=deadline))

            peer.handshake()
            last = [peer.send(b"retrieve", retrieve(1.0)) for _ in range(1000)][-1]
            status, reply = peer.recv(last, 60)
            assert status == codec.OK and codec.decode(reply, m.RetrieveResult).missing == [0]  # nothing copied
            time.sleep(1.1)
            assert peer.call(b"retrieve", retrieve(1.0))[0] == codec.OK
            wait_until(lambda: "more since the last such line" in debug_server.log(), 20, "the count of those left out")
            for bad in (math.nan, math.inf, -1.0):
                code, message = peer.error(b"retrieve", retrieve(bad))
                assert code == "invalid_request" and "deadline: must be a Unix time" in message, message

            def store(deadline: float) -> bytes:
                return codec.encode(m.Store(iid, [key("deadline", 1)], ref.blocks(1),
                                            params=msgspec.Raw(codec.encode(FileParams(0))), deadline=deadline))

            # a store past its deadline copies nothing and stores nothing (its chunk is free to store)
            status, reply = peer.call(b"store", store(1.0))
            assert status == codec.OK and codec.decode(reply, m.StoreResult) == m.StoreResult([], [], [0])
            assert client.lookup("deadline", hashes=[key("deadline", 1)]) == 0
            for bad in (math.nan, math.inf, -1.0):
                code, message = peer.error(b"store", store(bad))
                assert code == "invalid_request" and "deadline: must be a Unix time" in message, message
        finally:
            peer.close()
    assert debug_server.log().count(line) - before <= 4, debug_server.log()[-2000:]


def test_a_connection_without_a_session_gets_no_payload_decoded(debug_server):
    """Decoding a large payload costs the loop time and memory: a request of a connection that
    has not handshaked is refused before its payload is looked at (a malformed one included)."""
    peer = RawPeer(debug_server.url)
    try:
        for name in (b"store", b"lookup", b"reserve_write"):
            status, reply = peer.recv(peer.send(name, b"\xc1 not msgpack"), 10)
            assert status == codec.ERR and codec.ERROR_DECODER.decode(reply).code == "no_session", name
    finally:
        peer.close()


def test_an_instance_id_another_session_took_is_left_to_it_and_the_client_takes_another(debug_server,
                                                                                       monkeypatch):
    """Instance ids show in status: another session may register one first (while its owner's
    session is lost, say). Its owner is told whose it is and registers under a fresh id, so its
    stores and loads go on; the squatter gets nothing of it."""
    import secrets

    ref = Writer(CacheClient(debug_server.url, timeout=20), model="iid")
    taken = 4242_4242
    squatter = RawPeer(debug_server.url)
    try:
        squatter.handshake()
        assert squatter.error(b"register", codec.encode(registration(ref, "cpu_gather", taken))) is None
        real = secrets.randbits
        ids = iter([taken - 1])  # the client's next instance id is `taken`, then random again
        monkeypatch.setattr(secrets, "randbits", lambda n: next(ids, None) or real(n))
        with CacheClient(debug_server.url, timeout=20) as c:
            w = Writer(c, model="iid")
            assert w.ctx.instance_id != taken
            k = [key("iid", j) for j in range(2)]
            assert w.store(k).stored == [0, 1]
            res, bad = w.retrieve(k)
            assert res.loaded == [0, 1] and bad == []
            code, message = squatter.error(b"register", codec.encode(registration(ref, "cpu_gather", taken)))
            assert code == "invalid_request" and "already registered on this connection" in message
    finally:
        squatter.close()
        ref.client.close()


# --------------------------------------------------------------------------- 7. threads


def test_registrations_share_a_bounded_pool_of_threads(debug_server):
    """180 registrations (60 from each of three clients) do not make 180 threads, and one
    session past its registration limit gets limit_exceeded."""
    clients = [CacheClient(debug_server.url, timeout=30) for _ in range(3)]
    try:
        base = threads(debug_server.pid)
        ref = Writer(clients[0], model="threads")
        for n, c in enumerate(clients):
            futures = [c.submit(registration(ref, "cpu_gather", 7_000_000 + 1000 * n + j))
                       for j in range(60)]
            for f in futures:
                f.result(60)
        assert len(clients[0].status().contexts) >= 180
        assert threads(debug_server.pid) < base + 40, (base, threads(debug_server.pid))
        err = error_of(lambda: [clients[0].request(registration(ref, "cpu_gather", 7_900_000 + j))
                                for j in range(10)])
        assert err.code == "limit_exceeded" and "--max-registrations-per-session" in str(err), err
    finally:
        for c in clients:
            c.close()


# --------------------------------------------------------------------------- 8. declared sizes


def test_a_declared_kv_cache_past_the_limit_is_refused(debug_server):
    """num_blocks = 2**40 is refused at registration, with a typed error naming the option."""
    with CacheClient(debug_server.url, timeout=20) as client:
        ref = Writer(client, model="sizes")
        err = error_of(lambda: client.request(registration(ref, "cpu_gather", 8_000_001,
                                                                         num_blocks=1 << 40)))
        assert err.code == "limit_exceeded" and "--max-kv-cache-size" in str(err), err


@pytest.mark.parametrize("field", ["device", "extra_field_of_a_newer_client"])
def test_a_registration_that_carries_megabytes_is_refused_before_it_is_decoded(debug_server, field):
    """A transport's own fields are the client's to fill: cpu_gather's ``device`` string took
    any length, and the server kept it for the registration's life (16 MiB a registration,
    1,024 of them). The registration as sent is bounded (``--max-registration-bytes``, 8 MiB),
    and ``device`` is a short device type name."""
    with CacheClient(debug_server.url, timeout=20) as client:
        ref = Writer(client, model="sizes")
        big = "x" * (9 << 20)
        err = error_of(lambda: client.request(registration(ref, "cpu_gather", 8_000_010, **{field: big})))
        assert err.code == "limit_exceeded" and "--max-registration-bytes" in str(err), err
        assert "this one is 943" in str(err), err
        if field == "device":  # under the bound, still not a device type
            for bad in ("x" * 100, "CPU; DROP", ""):
                err = error_of(lambda bad=bad: client.request(registration(ref, "cpu_gather", 8_000_011, device=bad)))
                assert err.code == "invalid_request" and "device" in str(err), err
        assert 8_000_010 not in {c.instance_id for c in client.status().contexts}


def test_a_small_store_costs_little_whatever_the_declared_size(debug_server, tmp_path):
    """num_blocks = 2**27 (under the limit) through file_debug: a one-chunk store allocates
    nothing proportional to it in the server."""
    with CacheClient(debug_server.url, timeout=20) as client:
        ref = Writer(client, model="sizes")
        # the spool file is put where this server's version of the transport reads it (the
        # server's directory, or a registration-named one), so the store reaches the copy
        iid = 8_000_002
        spool = tmp_path / "spool"
        spool.mkdir(mode=0o700)
        peer = RawPeer(debug_server.url)
        try:
            status, reply = peer.call(b"register", file_debug_registration(ref, iid, num_blocks=1 << 27,
                                                                           spool_dir=str(spool)))
            assert status == codec.OK, codec.ERROR_DECODER.decode(reply)
            lay = ref.ctx.layout
            bpc = client.chunk_size // lay.block_size
            rows = [*range(bpc), *range(1 << 27, (1 << 27) + bpc)]  # the K and V rows of blocks 0..bpc-1
            data = bytes(lay.num_layers * len(rows) * lay.row_bytes)
            server_dir = Path(client.arena_path).parent / "transport-file_debug" / f"{iid:016x}"
            for d, name in ((spool, "transfer-0"), (server_dir, "spool-0")):
                if d.is_dir():
                    (d / name).write_bytes(data)
            peak = proc_kib(debug_server.pid, "VmHWM")
            params = {"slot": 0, "file": "transfer-0", "rows": rows}
            status, reply = peer.call(b"store", codec.encode(m.Store(iid, [key("sizes", 1)], list(range(bpc)),
                                                                     msgspec.Raw(codec.encode(params)))))
            grown = proc_kib(debug_server.pid, "VmHWM") - peak
            assert grown < 256 << 10, f"a one-chunk store grew the server's peak memory by {grown >> 10} MiB"
            assert status == codec.OK, codec.ERROR_DECODER.decode(reply)
            assert codec.decode(reply, m.StoreResult).stored == [0]
        finally:
            peer.close()
        assert client.ping() > 0


def _map(**fields: bytes) -> bytes:
    """A MessagePack map of ``fields`` whose values are encoded already."""
    head = bytes([0x80 | len(fields)]) if len(fields) < 16 else b"\xde" + len(fields).to_bytes(2, "big")
    return head + b"".join(codec.encode(k) + v for k, v in fields.items())


def _array(n: int, item: bytes) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big") + item * n


def test_a_request_listing_millions_is_refused_at_its_length(debug_server):
    """A request just under --max-message-size listing millions of hashes, indices, block ids or
    a registration's runs:
    refused as invalid_request (a registration past --max-registration-bytes as limit_exceeded,
    undecoded), the list never made into objects (they take 5-12 times their
    bytes on the wire: the lookup and the commit_write had grown the server's peak memory by 76 and
    127 MiB)."""
    room = (16 << 20) - 4096  # the server's default --max-message-size, less the other fields
    one = codec.encode(1)
    hashes = _array(room // 10, b"\xc4\x08" + b"\x01" * 8)  # 8-byte hashes, the shortest allowed
    with CacheClient(debug_server.url, timeout=20) as client:
        ref = Writer(client, model="lists")
        peer = RawPeer(debug_server.url)
        try:
            iid = 8_000_003
            status, reply = peer.call(b"register", file_debug_registration(ref, iid))
            assert status == codec.OK, codec.ERROR_DECODER.decode(reply)
            block_ids = _array(room // 3, b"\xcd\x01\x01")  # block 257 (a new int object each), 3 bytes each
            two = codec.encode([key("lists", i) for i in range(2)])
            cases = {
                b"lookup": (_map(model_name=codec.encode("lists"), world_size=one, hashes=hashes), "hashes"),
                b"commit_write": (_map(instance_id=one, reservation_id=one, failed=block_ids), "failed"),
                b"store": (_map(instance_id=codec.encode(iid), hashes=two, block_ids=block_ids), "block ids"),
                b"retrieve": (_map(instance_id=codec.encode(iid), hashes=two, block_ids=block_ids), "block ids"),
                b"register": (_map(transport=codec.encode("cpu_gather"), registration=_map(
                    **{k: codec.encode(v) for k, v in msgspec.structs.asdict(ref.ctx.registration()).items()
                       if k != "run_offsets"}, run_offsets=block_ids)), "--max-registration-bytes"),
            }
            # a message as long, whose one long field is skipped unread, brings the peak the buffers
            # of a message this long make (read buffer, frames)
            status, _ = peer.call(b"ping", _map(padding=b"\xc6" + room.to_bytes(4, "big") + bytes(room)))
            assert status == codec.OK
            for name, (payload, field) in cases.items():
                assert len(payload) < 16 << 20
                peak = proc_kib(debug_server.pid, "VmHWM")
                status, reply = peer.call(name, payload, timeout=60)
                grown = proc_kib(debug_server.pid, "VmHWM") - peak
                err = codec.ERROR_DECODER.decode(reply)
                # (reading a message this long again varies the peak by up to its length: 16 MiB)
                assert grown < 32 << 10, f"{name.decode()} grew the server's peak memory by {grown >> 10} MiB"
                # (a registration this long is refused at its length, before anything of it is decoded)
                code = "limit_exceeded" if name == b"register" else "invalid_request"
                assert status == codec.ERR and err.code == code and field in err.message, (name, err)
        finally:
            peer.close()
        assert client.ping() > 0


# --------------------------------------------------------------------------- 9. names and unread replies


def test_names_are_bounded(debug_server):
    with CacheClient(debug_server.url, timeout=20) as client:
        ref = Writer(client, model="names")
        long = "m" * (64 << 10)  # (a registration of more than 8 MiB is refused at its length)
        err = error_of(lambda: client.request(registration(ref, "cpu_gather", 9_000_001,
                                                                         model_name=long)))
        assert err.code == "limit_exceeded" and "--max-name-length" in str(err), err
        assert len(str(err)) < 4096, "the error echoed the name"
        err = error_of(lambda: client.lookup(long, hashes=[key("names", 0)]))
        assert err.code == "limit_exceeded", err
        # and a lookup names a bounded number of keys (chunks x ranks), whatever tier it reaches
        err = error_of(lambda: client.request(m.Lookup("names", 1 << 16, [key("names", j) for j in range(16)])))
        assert err.code == "invalid_request" and "at most" in str(err), err


def test_a_registration_names_at_most_max_layers_layers(debug_server):
    """``num_layers`` past MAX_LAYERS is refused as the registration is decoded, naming the
    field (a server keeps a table entry per layer for the registration's life)."""
    with CacheClient(debug_server.url, timeout=20) as client:
        ref = Writer(client, model="layers")
        err = error_of(lambda: client.request(registration(ref, "cpu_gather", 9_000_002, num_layers=MAX_LAYERS + 1)))
        # msgspec's own words for the bound: refused as decoded (not later, by the arena's size)
        assert err.code == "invalid_request" and "<= 4096" in str(err) and "num_layers" in str(err), err
        with pytest.raises(LayoutError, match="at most 4096 layers"):
            KVLayout(LayoutKind.FLASH_ATTN, MAX_LAYERS + 1, 16, 16, 128, torch.bfloat16)


def test_a_registration_names_the_process_that_sends_it(debug_server):
    """A registration's ``pid`` is the engine's: over ipc:// the kernel names the connecting
    process, and a registration naming another is refused (cuda_ipc matches the process an
    expandable segment's handle names against it: another engine's would map that engine's
    memory). One naming its own, or none, is taken."""
    with CacheClient(debug_server.url, timeout=20) as client:
        ref = Writer(client, model="pid")
        other = os.getppid()
        err = error_of(lambda: client.request(registration(ref, "cpu_gather", 9_000_011, pid=other)))
        assert err.code == "invalid_request" and f"names process {other}" in str(err), err
        for i, pid in enumerate((os.getpid(), 0)):
            client.request(registration(ref, "cpu_gather", 9_000_012 + i, pid=pid))


_IN_ANOTHER_PID_NAMESPACE = """
import os, sys, torch
from kvxfer import CacheClient, chunk_hashes
assert os.getpid() == 1, os.getpid()  # the first process of its own PID namespace
with CacheClient(sys.argv[1], timeout=30) as c:
    layers = [torch.randn(2, 8, 16, 1, 8) for _ in range(2)]
    kv = c.register(layers, model_name="ns", block_size=16, transport="cpu_gather")
    hashes = chunk_hashes(list(range(64)), 64)
    assert kv.submit_store(hashes, list(range(4))).result(30).stored == [0]
    assert kv.submit_retrieve(hashes, list(range(4, 8))).result(30).loaded == [0]
    assert all(torch.equal(t[:, :4], t[:, 4:8]) for t in layers)
print("registered and round-tripped")
"""


def test_an_engine_in_another_pid_namespace_registers(debug_server, tmp_path):
    """An engine in a container of its own (another PID namespace) knows itself by another pid
    than the kernel reports to the server: its registration is taken (the server cannot compare
    the two, and gives the transport no pid), not refused as naming another process."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a new PID namespace needs root and unshare(1)")
    script = tmp_path / "ns.py"
    script.write_text(_IN_ANOTHER_PID_NAMESPACE)
    r = subprocess.run(["unshare", "--pid", "--fork", sys.executable, str(script), debug_server.url],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0 and "unshare failed" in r.stderr:
        pytest.skip(f"this machine makes no PID namespace: {r.stderr.strip()[-200:]}")
    assert r.returncode == 0 and "registered and round-tripped" in r.stdout, r.stdout + r.stderr


def test_a_connection_that_never_reads_its_replies_is_cut_off(debug_server):
    """A peer that sends requests and never reads the replies: once more than
    --max-unread-reply-bytes (64 MiB) wait for it, the server drops them, ends its session,
    closes its connection and says so in its log; its memory stays bounded and others are served throughout."""
    with CacheClient(debug_server.url, timeout=30) as client:
        ref = Writer(client, model="r" * 400)
        for j in range(60):  # a status reply of ~35 KiB
            client.request(registration(ref, "cpu_gather", 9_100_000 + j))
        rss = proc_kib(debug_server.pid, "VmRSS")
        peer = RawPeer(debug_server.url, rcvbuf=4096)
        try:
            peer.handshake()
            status = codec.encode(m.StatusRequest())
            for _ in range(4000):
                try:
                    peer.send(b"status", status)
                except (BrokenPipeError, ConnectionResetError):
                    break  # cut off: the server closed the connection
                if _ % 500 == 0:
                    assert client.ping() > 0  # others are served meanwhile
            wait_until(lambda: "does not read its replies" in debug_server.log(), 60.0,
                       "the server cut the non-reading connection off", interval=0.5)
            grown = proc_kib(debug_server.pid, "VmRSS") - rss
            assert grown < 400 << 10, f"the server grew by {grown >> 10} MiB for one connection"
            assert client.status().dropped_connections >= 1
        finally:
            peer.close()
        assert client.ping() > 0


# --------------------------------------------------------------------------- 10. nesting


def test_deeply_nested_messagepack_is_a_typed_error_without_a_traceback(debug_server):
    deep = b"\x91" * 100_000 + b"\xc0"
    peer = RawPeer(debug_server.url)
    try:
        peer.handshake()
        register = b"\x82" + codec.encode("transport") + codec.encode("cpu_gather") + codec.encode("registration") + deep
        unknown = b"\x83" + codec.encode("transport") + codec.encode("cpu_gather") + codec.encode("registration") + \
            codec.encode(b"") + codec.encode("zz") + deep
        for name, payload in ((b"register", register), (b"register", unknown), (b"lookup", deep),
                              (b"status", b"\x81" + codec.encode("zz") + deep)):
            code, _ = peer.error(name, payload)
            assert code == "invalid_request", (name, code)
    finally:
        peer.close()
    assert "Traceback" not in debug_server.log() and "RecursionError" not in debug_server.log()


def test_the_half_made_arena_of_a_server_killed_while_starting_is_removed(ns_shm_dir):
    """A server killed while its arena faults in leaves the directory it was making
    (``.kvxfer-...``): the next server removes it once it is older than a starting server's, and
    leaves a younger one alone (it may be a server starting now)."""
    import time

    from kvxfer.arena import BUILDING_GRACE_S

    shm_dir = ns_shm_dir
    proc = subprocess.Popen([sys.executable, "-m", "kvxfer", "serve", "--url", f"ipc://{shm_dir}/run/k.sock",
                             "--l1-size", "1GiB", "--shm-dir", str(shm_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not [p for p in shm_dir.iterdir() if p.name.startswith(".kvxfer-")] and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    half = [p for p in shm_dir.iterdir() if p.name.startswith(".kvxfer-")]
    if not half:
        pytest.skip("the arena was made before the kill: nothing half-made to find")
    with ServerProcess(l1_size="8MiB", chunk_size=64, transports="cpu_gather", extra_args=["--shm-dir", str(shm_dir)]):
        assert all(p.exists() for p in half), "a half-made arena younger than a start was removed"
    old = time.time() - BUILDING_GRACE_S - 5
    for p in half:
        os.utime(p, (old, old))
    with ServerProcess(l1_size="8MiB", chunk_size=64, transports="cpu_gather", extra_args=["--shm-dir", str(shm_dir)]):
        assert not any(p.exists() for p in half), "a dead server's half-made arena was left behind"


def test_a_half_made_arena_without_its_lock_file_is_removed_once_old(tmp_path):
    """A server killed between making its arena directory and its lock file leaves nothing to
    lock: once older than a start, the directory is removed all the same; a younger one, and one
    of another name, are left alone."""
    import secrets
    import time

    from kvxfer.arena import BUILDING_GRACE_S, Arena

    def half_made() -> Path:
        d = tmp_path / f".kvxfer-{os.getuid()}-{secrets.token_hex(16)}"
        d.mkdir(mode=0o700)
        return d

    old, young, other = half_made(), half_made(), tmp_path / ".kvxfer-other"
    other.mkdir(mode=0o700)
    then = time.time() - BUILDING_GRACE_S - 5
    for d in (old, other):
        os.utime(d, (then, then))
    assert Arena.remove_stale(tmp_path) == 1
    assert not old.exists() and young.exists() and other.exists()


def test_a_read_parked_at_a_resume_holds_its_pins_no_longer_than_a_session_timeout(shm_dir):
    """A parked read's pins need to outlast its copy only (its client waits for the commit's
    answer past half the session timeout): one whose commit_read never comes (lost with the old
    connection) lets its chunk go a session timeout after its reserve, though its client lives."""
    with ServerProcess(l1_size="32MiB", chunk_size=64, transports="cpu_gather",
                       extra_args=["--shm-dir", str(shm_dir), "--session-timeout", "3"]) as server, \
            CacheClient(server.url, timeout=20) as observer:
        ref = Writer(observer, model="read-expiry")
        k = key("read-expiry", 0)
        assert ref.store([k]).stored == [0]
        client = _Resumer(server.url, ref)
        try:
            client.open_read(client.connect(), 4343_0401, k)
            again = client.connect()
            assert observer.status().reservations == 1
            wait_until(lambda: again.call(b"ping", codec.encode(m.Ping()))[0] == codec.OK
                       and observer.status().reservations == 0, DROP_WITHIN_S, "the parked read's pins released")
            assert observer.clear("read-expiry") == 1
        finally:
            client.close()
