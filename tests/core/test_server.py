"""The cache server as a real process: status, clear, data round trip, lost clients, shm size,
file modes."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvxfer import CacheClient, ConfigError, chunk_hashes
from kvxfer.server.allocator import Allocator
from kvxfer.testing.server import ServerProcess
from kvxfer_core_helpers import (
    BLOCK_SIZE,
    BLOCKS_PER_CHUNK,
    CHUNK_SIZE,
    after_ticks,
    flash_attn_kv,
    run_python,
    wait_until,
)


def tokens(n_chunks: int, seed: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7) % 50_000 for i in range(n_chunks * CHUNK_SIZE)]


def test_status_reports_contexts_arena_hits_and_leases(server, client) -> None:
    before = client.status()
    kv = client.register(flash_attn_kv(num_layers=2, num_blocks=32, heads=2, head_size=8),
                         model_name="status-model", block_size=BLOCK_SIZE, world_size=2, rank=1,
                         transport="cpu_gather")
    st = client.status()
    assert (st.url, st.pid, st.chunk_size) == (server.url, server.pid, CHUNK_SIZE)
    assert st.protocol_version == 1 and st.sessions >= 1 and st.uptime_s >= 0
    [ctx] = [c for c in st.contexts if c.model_name == "status-model"]
    assert (ctx.instance_id, ctx.world_size, ctx.rank, ctx.transport) == (kv.instance_id, 2, 1, "cpu_gather")
    assert (ctx.layout, ctx.num_layers, ctx.block_size, ctx.hidden_dim_size, ctx.dtype, ctx.use_mla,
            ctx.num_blocks) == ("flash_attn", 2, BLOCK_SIZE, 16, "bfloat16", False, 32)
    chunk_bytes = 2 * 2 * CHUNK_SIZE * 16 * 2
    assert ctx.chunk_bytes == chunk_bytes and ctx.client_pid == os.getpid()
    [tp] = st.transports
    assert (tp.name, tp.style, tp.contexts) == ("cpu_gather", "client_driven", 1)

    hashes = chunk_hashes(tokens(6, 1), CHUNK_SIZE)
    assert kv.submit_store(hashes[:4], list(range(4 * BLOCKS_PER_CHUNK))).result(30).ok
    # world_size 2: rank 0 has nothing, so a lookup sees no hits until rank 0 stores too
    assert client.lookup("status-model", 2, hashes=hashes) == 0
    kv0 = client.register(flash_attn_kv(seed=3), model_name="status-model", block_size=BLOCK_SIZE,
                          world_size=2, rank=0, transport="cpu_gather")
    assert kv0.submit_store(hashes[:4], list(range(4 * BLOCKS_PER_CHUNK))).result(30).ok
    assert client.lookup("status-model", 2, hashes=hashes) == 4
    lease = client.lookup_and_lease("status-model", 2, hashes=hashes, lease_s=60)
    assert lease.hits == 4 and lease.lease_id > 0

    st = client.status()
    assert st.arena.chunks - before.arena.chunks == 8
    assert st.arena.used - before.arena.used == 8 * Allocator.rounded(chunk_bytes)
    assert st.arena.capacity == 32 << 20 and st.arena.path
    assert (st.lookups - before.lookups, st.lookup_chunks - before.lookup_chunks,
            st.lookup_hits - before.lookup_hits) == (3, 18, 8)
    assert st.leases - before.leases == 1 and st.leased_chunks - before.leased_chunks == 8
    assert [c.stores for c in st.contexts if c.model_name == "status-model"] == [1, 1]

    client.release_lease(lease.lease_id)
    st = client.status()
    assert st.leases == before.leases and st.leased_chunks == before.leased_chunks
    kv.close()
    kv0.close()
    assert not [c for c in client.status().contexts if c.model_name == "status-model"]


def test_store_and_retrieve_are_bit_exact(client) -> None:
    src = flash_attn_kv(seed=5)
    dst = [torch.zeros_like(t) for t in src]
    a = client.register(src, model_name="exact", block_size=BLOCK_SIZE, transport="cpu_gather")
    b = client.register(dst, model_name="exact", block_size=BLOCK_SIZE, transport="cpu_gather")
    hashes = chunk_hashes(tokens(3, 2), CHUNK_SIZE)
    blocks = [5, 9, 1, 30, 2, 3, 4, 6, 7, 8, 10, 11]
    assert a.submit_store(hashes, blocks).result(30).stored == [0, 1, 2]
    assert a.submit_store(hashes, blocks).result(30).present == [0, 1, 2]
    out = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 0, 31]
    res = b.submit_retrieve(hashes, out, skip_first_n_tokens=BLOCK_SIZE).result(30)
    assert res.loaded == [0, 1, 2] and res.missing == []
    for s, d in zip(src, dst):
        assert not d[:, 20].any()  # skipped block left untouched
        assert torch.equal(d[:, out[1:]], s[:, blocks[1:]])
    a.close()
    b.close()


def test_block_ids_given_as_a_tensor_are_read_when_submitted(client) -> None:
    """Block ids given as a tensor are the ids of the moment of the submit: the caller may reuse
    the tensor at once (an engine's block table), for a store and for a retrieve. Before, the
    worker read them when it planned the copies, later: a store after ``ids += 8`` stored blocks
    8-15."""
    src = flash_attn_kv(seed=7)
    dst = [torch.zeros_like(t) for t in src]
    a = client.register(src, model_name="ids-at-submit", block_size=BLOCK_SIZE, transport="cpu_gather")
    b = client.register(dst, model_name="ids-at-submit", block_size=BLOCK_SIZE, transport="cpu_gather")
    hashes = chunk_hashes(tokens(2, 11), CHUNK_SIZE)
    ahead = a.submit_store(chunk_hashes(tokens(4, 12), CHUNK_SIZE), list(range(16, 32)))  # the worker's first job
    ids = torch.arange(2 * BLOCKS_PER_CHUNK, dtype=torch.int64)
    stored = a.submit_store(hashes, ids)
    ids += 8
    assert ahead.result(30).stored == [0, 1, 2, 3] and stored.result(30).stored == [0, 1]
    out = torch.arange(2 * BLOCKS_PER_CHUNK, dtype=torch.int64) + 8
    loaded = b.submit_retrieve(hashes, out)
    out -= 8
    assert loaded.result(30).loaded == [0, 1]
    for s, d in zip(src, dst):
        assert torch.equal(d[:, 8:16], s[:, 0:8]), "the chunks hold other blocks than those named at submit"
        assert not d[:, 0:8].any()
    a.close()
    b.close()


def test_clear(client) -> None:
    kv = client.register(flash_attn_kv(), model_name="clear-me", block_size=BLOCK_SIZE, transport="cpu_gather")
    hashes = chunk_hashes(tokens(2, 3), CHUNK_SIZE)
    kv.submit_store(hashes, list(range(2 * BLOCKS_PER_CHUNK))).result(30)
    assert client.clear("some-other-model") == 0
    assert client.lookup("clear-me", hashes=hashes) == 2
    assert client.clear("clear-me") == 2
    assert client.lookup("clear-me", hashes=hashes) == 0
    kv.close()


def test_a_client_dropped_without_close_ends_its_session_when_collected(server, client) -> None:
    """A CacheClient that is dropped unclosed is collected like any object: its connection, its
    I/O thread (whose heartbeats kept the session alive for good), its descriptors and its lock
    file go, and the server ends its session. Before, the connection's thread kept the client
    alive: ten dropped clients left ten sessions, ten threads and 60 descriptors."""
    import gc
    import threading

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    gc.collect()
    sessions, threads, files = client.status().sessions, threading.active_count(), fds()
    for _ in range(3):
        dropped = CacheClient(server.url, timeout=15)
        assert dropped.ping() > 0 and client.status().sessions > sessions
        del dropped
    gc.collect()
    wait_until(lambda: client.status().sessions == sessions, timeout=30)
    wait_until(lambda: threading.active_count() == threads and fds() == files, timeout=30)


def test_contexts_dropped_without_close_are_unregistered_when_collected(server, client) -> None:
    """A registered context dropped unclosed is unregistered on the server once it is collected
    (its transfers are over: a transfer in flight holds it), at the client's next register(). The
    server kept each such registration for the session's life: a program that registered again
    on reconfiguration, dropping the old context, ran out of --max-registrations-per-session (64)
    and was told to close contexts it could no longer reach. A client dropped with its contexts
    goes too."""
    import gc

    base = len(client.status().contexts)
    for n in range(70):  # past the per-session limit
        ctx = client.register(flash_attn_kv(num_blocks=8), model_name=f"dropped-{n % 3}", block_size=BLOCK_SIZE,
                              transport="cpu_gather")
        hashes = chunk_hashes(list(range(n * CHUNK_SIZE, (n + 1) * CHUNK_SIZE)), CHUNK_SIZE, salt="dropped")
        assert ctx.submit_store(hashes, list(range(BLOCKS_PER_CHUNK))).result(30).stored == [0]
        del ctx
        if n % 8 == 7:  # a few at a time (a collection with torch loaded takes ~0.3 s here)
            gc.collect()
    # collected by the cycle collector, which may run inside any allocation: the connection's own
    # under its lock too (the first finalizer sent the unregister itself, and waited for that lock)
    import threading

    ctx = client.register(flash_attn_kv(num_blocks=8), model_name="dropped-cycle", block_size=BLOCK_SIZE,
                          transport="cpu_gather")
    ctx.cycle = [ctx]  # type: ignore[attr-defined]
    del ctx
    collected = threading.Event()

    def collect_under_the_lock() -> None:
        with client._mq._lock:
            gc.collect()
        collected.set()

    threading.Thread(target=collect_under_the_lock, daemon=True).start()
    assert collected.wait(10), "collecting a dropped context under the connection's lock deadlocked"
    client.register(flash_attn_kv(num_blocks=8), model_name="dropped-last", block_size=BLOCK_SIZE,
                    transport="cpu_gather").close()  # the last dropped ones go at this register()
    wait_until(lambda: len(client.status().contexts) == base, timeout=30)
    other = CacheClient(server.url, timeout=15)
    other.register(flash_attn_kv(num_blocks=8), model_name="dropped-with-client", block_size=BLOCK_SIZE,
                   transport="cpu_gather")
    del other
    gc.collect()
    wait_until(lambda: len(client.status().contexts) == base, timeout=30)


_FORKED = """
import os, sys
from kvxfer import CacheClient, chunk_hashes
from kvxfer.errors import ConfigError
from kvxfer_core_helpers import BLOCK_SIZE, BLOCKS_PER_CHUNK, CHUNK_SIZE, flash_attn_kv

c = CacheClient(sys.argv[1])
kv = c.register(flash_attn_kv(), model_name="forked", block_size=BLOCK_SIZE, transport="cpu_gather")
hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt="forked")
assert kv.submit_store(hashes, list(range(2 * BLOCKS_PER_CHUNK))).result(30).stored == [0, 1]
lease = c.lookup_and_lease("forked", hashes=hashes, lease_s=30)
pid = os.fork()
if pid == 0:
    refused = 0
    for call in (c.ping, lambda: c.lookup("forked", hashes=hashes),
                 lambda: kv.submit_store(hashes, list(range(2 * BLOCKS_PER_CHUNK)))):
        try:
            call()
        except ConfigError as exc:
            refused += "forked from it" in str(exc)
    kv.close()
    c.close()
    os._exit(refused)
_, status = os.waitpid(pid, 0)
got = kv.submit_retrieve(hashes, list(range(8, 8 + 2 * BLOCKS_PER_CHUNK)), lease_id=lease.lease_id).result(30)
print(os.waitstatus_to_exitcode(status), c.ping() > 0, got.loaded)
c.close()
"""


def test_a_forked_child_cannot_use_its_parents_client_and_leaves_it_whole(server, tmp_path: Path) -> None:
    """After os.fork(), the child's copy of a CacheClient refuses every request with a
    ConfigError (they would go out on the parent's socket and take its replies, or hang: the
    worker threads are not in the child), and its close() ends nothing of the parent's: the
    parent's session, registration, lease and lock file stay, and it loads what it leased.
    Before, the child's close() sent the parent's goodbye: the parent's next request failed with
    NoSession."""
    done = run_python(_FORKED, server.url, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["3", "True", "[0,", "1]"], done.stdout + done.stderr


def test_a_client_that_closes_ends_its_session_at_once(server, client) -> None:
    """close() says goodbye: the server drops the session (and its registrations) right away,
    not after its session timeout, and says why in its log."""
    before = client.status().sessions
    other = CacheClient(server.url, name="goodbye-test")
    other.register(flash_attn_kv(), model_name="goodbye", block_size=BLOCK_SIZE, transport="cpu_gather")
    assert client.status().sessions == before + 1
    time.sleep(1.1)  # the server logs one such line a second at most: the tests before ended sessions too
    other.close()
    st = client.status()  # answered after the goodbye: the same loop handled that first
    assert st.sessions == before and not [c for c in st.contexts if c.model_name == "goodbye"]
    assert "(goodbye-test) ended (closed by the client)" in server.log()
    with CacheClient(server.url, name="quiet-poller") as poller:  # as `kvxfer status`: registers nothing
        poller.status()
    client.status()
    assert "(quiet-poller) ended" not in server.log(), "every status poll added a line to the log"


def test_socket_and_arena_are_private(server, client) -> None:
    sock = Path(server.url.removeprefix("ipc://"))
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
    arena = Path(client.arena_path)
    assert stat.S_IMODE(arena.stat().st_mode) == 0o600
    assert stat.S_IMODE(arena.parent.stat().st_mode) == 0o700
    assert arena.stat().st_size == client.arena_size == 32 << 20


# --------------------------------------------------------------------------- lost clients

CLIENT = textwrap.dedent("""
    import os, sys, time, torch
    from kvxfer import CacheClient, chunk_hashes
    from kvxfer.protocol import messages as m
    url, mode = sys.argv[1], sys.argv[2]
    c = CacheClient(url)
    layers = [torch.zeros(2, 8, 16, 1, 8, dtype=torch.float16) for _ in range(2)]
    kv = c.register(layers, model_name="lost-" + mode, block_size=16, transport="cpu_gather")
    hashes = chunk_hashes(list(range(2 * 64)), 64)
    rep = c.request(m.ReserveWrite(kv.instance_id, hashes))  # never committed
    print("READY", kv.instance_id, flush=True)
    if mode == "exit":
        sys.stdin.readline()  # the test has seen the reservation
        os._exit(0)  # no close, no unregister
    if mode == "wake":  # frozen and continued by the test: reconnect, then the late commit
        sys.stdin.readline()
        c.reconnect(kv)
        try:
            c.request(m.CommitWrite(kv.instance_id, rep.reservation_id))
            print("COMMITTED", flush=True)
        except Exception as exc:
            print("REFUSED", type(exc).__name__, exc, flush=True)
        sys.stdin.readline()
        os._exit(0)
    time.sleep(60)
""")


@pytest.fixture(scope="module")
def short_session_server():
    with ServerProcess(l1_size="16MiB", chunk_size=CHUNK_SIZE, transports="cpu_gather",
                       extra_args=["--session-timeout", "3", "--metrics-port", "0"]) as srv:
        yield srv


def _client_locks(observer: CacheClient) -> set[str]:
    return {p.name for p in Path(observer.arena_path).parent.glob("client-*.lock")}


@pytest.mark.parametrize("mode", ["exit", "silent"])
def test_a_lost_client_loses_its_registrations_and_reservations(short_session_server, mode) -> None:
    """A client that exits without a word loses everything once its session times out. One
    that is frozen (SIGSTOP) loses its registration and read pins too, but the slots of its open
    write stay reserved (it could wake mid-copy and write into them) until its process dies."""
    srv = short_session_server
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, srv.url, mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        with CacheClient(srv.url) as observer:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            assert line.startswith("READY"), line
            st = observer.status()
            [ctx] = [c for c in st.contexts if c.model_name == f"lost-{mode}"]
            assert ctx.client_pid == proc.pid and st.reservations == 1
            held = st.arena.used
            assert held > 0 and len(_client_locks(observer)) == 2  # the client's and the observer's
            if mode == "silent":
                os.kill(proc.pid, signal.SIGSTOP)  # alive, holding its socket, but says nothing
            else:
                proc.stdin.write("exit\n")  # type: ignore[union-attr]
                proc.stdin.flush()  # type: ignore[union-attr]

            def registration_gone() -> bool:
                return not [c for c in observer.status().contexts if c.model_name == f"lost-{mode}"]

            def everything_gone() -> bool:
                return registration_gone() and observer.status().reservations == 0

            if mode == "silent":
                assert wait_until(registration_gone, timeout=15), observer.status()
                st = after_ticks(observer)  # periodic passes after its session went: its slots stay reserved
                assert st.reservations == 1 and st.arena.used == held, st
                proc.kill()  # dies while frozen: the kernel drops its lock
            assert wait_until(everything_gone, timeout=15), observer.status()
            assert observer.status().arena.used == 0  # the aborted write slots were freed
            assert len(_client_locks(observer)) == 1  # the dead client's lock file was removed
    finally:
        if proc.poll() is None:
            proc.kill()  # SIGKILL ends a stopped process too
        proc.wait(10)


def test_a_woken_writer_frees_its_parked_slots_with_its_late_commit(short_session_server) -> None:
    """A frozen writer's parked reservation is out of every context's reach: when the process
    wakes, reconnects (same client token, same instance id) and sends its late commit, the server
    refuses it and frees the slots; its exit later frees nothing twice."""
    srv = short_session_server
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, srv.url, "wake"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        with CacheClient(srv.url) as observer:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            assert line.startswith("READY"), line
            held = observer.status().arena.used
            os.kill(proc.pid, signal.SIGSTOP)
            assert wait_until(lambda: not [c for c in observer.status().contexts if c.model_name == "lost-wake"],
                              timeout=15), observer.status()
            st = observer.status()
            assert st.reservations == 1 and st.arena.used == held, st
            # the metrics count it once, as parked (it was counted as an open write too)
            samples = {s.labels["kind"]: s.value for fam in text_string_to_metric_families(
                urllib.request.urlopen(st.metrics_url, timeout=30).read().decode())
                for s in fam.samples if s.name == "kvxfer_reservations"}
            assert samples == {"write": 0, "read": 0, "parked": 1}, samples
            proc.stdin.write("go\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
            os.kill(proc.pid, signal.SIGCONT)
            line = proc.stdout.readline()  # type: ignore[union-attr]
            assert line.startswith("REFUSED InvalidRequest") and "silent past the session timeout" in line, line
            st = observer.status()
            assert st.reservations == 0 and st.arena.used == 0, st  # freed while the process lives
            # the same chunks, stored by someone else, survive the woken client's exit
            layers = [torch.zeros(2, 8, 16, 1, 8, dtype=torch.float16) for _ in range(2)]
            kv = observer.register(layers, model_name="lost-wake", block_size=16, transport="cpu_gather")
            hashes = chunk_hashes(list(range(2 * 64)), 64)
            assert kv.submit_store(hashes, list(range(8))).result(30).stored == [0, 1]
            proc.stdin.write("exit\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
            proc.wait(10)
            assert wait_until(lambda: len(observer.status().contexts) == 1, timeout=15), observer.status()
            after_ticks(observer)  # periodic passes after its session went: nothing parked is freed twice
            assert observer.lookup("lost-wake", hashes=hashes) == 2
            st = observer.status()
            assert st.reservations == 0 and st.arena.used == 2 * kv.chunk_bytes, st
            kv.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


# --------------------------------------------------------------------------- shm too small


def _small_tmpfs(path: Path) -> bool:
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(path)],
                       capture_output=True)
    return r.returncode == 0


def test_serve_stops_at_once_when_the_shm_dir_is_too_small(tmp_path: Path) -> None:
    mnt = tmp_path / "small-shm"
    mounted = _small_tmpfs(mnt)
    if mounted:
        shm_dir, size, needle = mnt, "64MiB", "64.0 MiB"
    else:  # no mount here: ask for more than /dev/shm has free (refused before allocating)
        vfs = os.statvfs("/dev/shm")
        free = vfs.f_bavail * vfs.f_frsize
        shm_dir, size, needle = Path("/dev/shm"), str(free + (1 << 30)), "GiB"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kvxfer", "serve", "--url", f"ipc://{tmp_path}/run/s.sock", "--l1-size", size,
             "--shm-dir", str(shm_dir), "--transports", "cpu_gather"],
            capture_output=True, text=True, timeout=120,
        )
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)], check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr
    assert "kvxfer serve: error:" in err and needle in err and "--shm-dir" in err and str(shm_dir) in err, err
    assert not (tmp_path / "run" / "s.sock").exists()


# --------------------------------------------------------------------------- busy polling, warmth


@pytest.mark.parametrize("option,value,message", [
    *[("--busy-poll-us", v, "--busy-poll-us must be in [0, 1000000]") for v in ("-1", "nan", "1000001")],
    *[("--warm-us", v, "--warm-us must be 0 (off) or in [100, 5000] microseconds") for v in ("-1", "nan", "50", "5001")],
])
def test_a_loop_timing_out_of_range_is_refused_at_start(tmp_path: Path, option: str, value: str, message: str) -> None:
    """--busy-poll-us and --warm-us (kvxfer.server.warmth) out of their bounds stop the server
    before it serves."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvxfer", "serve", "--url", f"ipc://{tmp_path}/run/s.sock", "--l1-size", "16MiB",
         "--transports", "cpu_gather", option, value],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr, proc.stderr
    assert not (tmp_path / "run" / "s.sock").exists()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_over(pid: int, seconds: float) -> float:
    import time

    before = _cpu_seconds(pid)
    time.sleep(seconds)
    return _cpu_seconds(pid) - before


def test_a_busy_polling_server_keeps_its_cpu_after_a_request_then_sleeps(tmp_path: Path) -> None:
    """--busy-poll-us: after a request the loop polls without sleeping for that long (the
    server's CPU time grows by most of the window), then sleeps again until the next message
    (the clients' heartbeats come once a second); a server without it sleeps right after
    answering. CPU seconds, with wide margins: not a timing."""
    with ServerProcess(l1_size="16MiB", transports="cpu_gather", extra_args=["--busy-poll-us", "300000"]) as busy, \
            ServerProcess(l1_size="16MiB", transports="cpu_gather") as idle:
        with CacheClient(busy.url) as a, CacheClient(idle.url) as b:
            assert wait_until(lambda: _cpu_over(busy.pid, 0.2) < 0.05, timeout=30), "it never stops polling"
            assert a.ping() > 0 and b.ping() > 0
            spun, slept = _cpu_over(busy.pid, 0.25), _cpu_over(idle.pid, 0.25)
            assert spun > 0.1, f"the busy-polling server used {spun:.3f} s of CPU in the 0.25 s after a request"
            assert slept < 0.05, f"the server without busy polling used {slept:.3f} s of CPU after a request"
            assert wait_until(lambda: _cpu_over(busy.pid, 0.2) < 0.05, timeout=30), "it never stops polling"
            assert a.ping() > 0  # and it answers as before


def test_a_server_that_fails_at_its_last_step_of_start_up_leaves_nothing_behind(tmp_path: Path) -> None:
    """The metrics exporter starts listening last: a failure there (its thread cannot start; made
    here by a stand-in for ``start``, since a real one cannot be provoked reliably) closes the
    socket, the L2 tier, the transports and the arena made before it, and frees the port."""
    import socket
    from unittest import mock

    from kvxfer.server import CacheServer, ServerConfig
    from kvxfer.server.metrics import MetricsExporter
    from kvxfer.server.tier import TierConfig

    shm = tmp_path / "shm"
    shm.mkdir()
    sock = tmp_path / "run" / "s.sock"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    def fails(self: MetricsExporter) -> None:
        raise RuntimeError("can't start new thread")

    config = ServerConfig(url=f"ipc://{sock}", l1_size=8 << 20, shm_dir=str(shm), metrics_port=port,
                          transports=("cpu_gather",), l2=TierConfig("fs", f"file://{tmp_path}/l2"))
    with mock.patch.object(MetricsExporter, "start", fails), pytest.raises(RuntimeError, match="new thread"):
        CacheServer(config)
    assert not sock.exists() and os.listdir(shm) == []
    with socket.socket() as again:
        again.bind(("127.0.0.1", port))  # the exporter's port is free again
    with ServerProcess(l1_size="8MiB", chunk_size=CHUNK_SIZE, transports="cpu_gather",
                       url=f"ipc://{sock}") as srv, CacheClient(srv.url) as c:
        assert c.ping() > 0  # the socket's claim was let go too


# --------------------------------------------------------------------------- --exit-with-parent

_ORPHANING_PARENT = """
import os, signal, sys
from kvxfer.testing.server import ServerProcess

shm = sys.argv[1]
kept = ServerProcess(l1_size="8MiB", transports="cpu_gather", extra_args=["--shm-dir", shm]).start()
gone = ServerProcess(l1_size="8MiB", transports="cpu_gather", extra_args=["--shm-dir", shm],
                     exit_with_parent=False).start()
print(kept.pid, gone.pid, kept.url, gone.url, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # a test run that crashes: nothing of ServerProcess.stop runs
"""


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie that nobody reaped has). Each
    of its threads is looked at: while a process exits, its first thread shows as a zombie before
    the others have ended and released its files (the locks it holds among them)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return False
    for tid in tasks:
        try:
            state = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            continue
        if state != "Z":
            return True
    return False


def test_the_kits_server_stops_with_the_process_that_started_it(tmp_path: Path) -> None:
    """A process that starts servers with ServerProcess and dies by SIGKILL: the server started
    with --exit-with-parent (the kit's default) stops by itself and removes its arena and socket;
    the one started without it keeps serving (then stopped here). The next ServerProcess made
    removes the directory (the log) the first one left, and not the one of the server that runs."""
    shm = tmp_path / "shm"
    shm.mkdir()
    proc = subprocess.run([sys.executable, "-c", _ORPHANING_PARENT, str(shm)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    kept_pid, free_pid, kept_url, free_url = proc.stdout.split()
    kept, free = int(kept_pid), int(free_pid)
    try:
        assert wait_until(lambda: not _running(kept), timeout=30), "the server outlived the process that started it"
        kept_sock = Path(kept_url.removeprefix("ipc://"))
        assert not kept_sock.exists()
        assert _running(free), "the server started without --exit-with-parent stopped too"
        with CacheClient(free_url) as c:
            assert c.ping() > 0
            arena = c.arena_path
        assert os.listdir(shm) == [Path(arena).parent.name], "the stopped server left its arena"
        kept_dir, free_dir = (Path(url.removeprefix("ipc://")).parent.parent for url in (kept_url, free_url))
        assert kept_dir.is_dir(), "the killed process left its server's directory"
        ServerProcess().__exit__()  # made and never started: it sweeps the directories left
        assert not kept_dir.exists() and free_dir.is_dir()
        with CacheClient(free_url) as c:
            assert c.ping() > 0
    finally:
        for pid in (kept, free):
            if _running(pid):
                os.kill(pid, signal.SIGTERM)
        stopped = wait_until(lambda: not _running(kept) and not _running(free), timeout=30)
        for url in (kept_url, free_url):  # the kit's directories (its logs), which a killed process leaves
            shutil.rmtree(Path(url.removeprefix("ipc://")).parent.parent, ignore_errors=True)
    assert stopped and os.listdir(shm) == []


_EARLY_ORPHAN = """
import os, subprocess, sys
shm, sock = sys.argv[1], sys.argv[2]
proc = subprocess.Popen([sys.executable, "-m", "kvxfer", "serve", f"--url=ipc://{sock}", "--l1-size=8MiB",
                         "--transports=cpu_gather", "--shm-dir", shm, f"--exit-with-parent={os.getpid()}"],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(proc.pid, flush=True)
os._exit(0)  # gone before the server has even started Python
"""


def test_a_server_whose_parent_is_gone_before_it_starts_does_not_serve(tmp_path: Path) -> None:
    """--exit-with-parent=PID: a parent that ended before the server looked at it (the kit's
    process killed while its server starts) is seen too: the server refuses to start, and
    nothing of it is left."""
    shm = tmp_path / "shm"
    shm.mkdir()
    sock = tmp_path / "run" / "s.sock"
    proc = subprocess.run([sys.executable, "-c", _EARLY_ORPHAN, str(shm), str(sock)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    pid = int(proc.stdout)
    try:
        wait_until(lambda: not _running(pid), timeout=60)
    finally:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)
    assert os.listdir(shm) == [] and not sock.exists()


def test_exit_with_parent_names_the_parent_or_is_refused(tmp_path: Path) -> None:
    """A PID that is not the server's parent, or not a process id, is refused at start (exit
    code 2, saying why), before any arena is made."""
    shm = tmp_path / "shm"
    shm.mkdir()
    base = [sys.executable, "-m", "kvxfer", "serve", f"--url=ipc://{tmp_path}/run/s.sock", "--l1-size=8MiB",
            "--transports=cpu_gather", "--shm-dir", str(shm)]
    for value, says in [("1", "--exit-with-parent 1: process 1 is not this server's parent"),
                        ("0", "a process id is a positive integer, got '0'"),
                        ("me", "a process id is a positive integer, got 'me'")]:
        proc = subprocess.run([*base, f"--exit-with-parent={value}"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and says in proc.stderr, proc.stdout + proc.stderr
    assert os.listdir(shm) == []


def test_exit_with_parent_outside_the_pid_namespace_is_refused(tmp_path: Path) -> None:
    """A server whose parent is outside its PID namespace (getppid() answers 0: a container's entry
    point) cannot see its parent end: the bare option is refused, saying so."""
    try:
        ok = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, timeout=30).returncode == 0
    except FileNotFoundError:
        ok = False
    if not ok:
        pytest.skip("unshare --pid cannot run here (it needs util-linux and the right to make a PID namespace)")
    proc = subprocess.run(["unshare", "--pid", "--fork", sys.executable, "-m", "kvxfer", "serve",
                           f"--url=ipc://{tmp_path}/run/s.sock", "--l1-size=8MiB", "--transports=cpu_gather",
                           "--shm-dir", str(tmp_path), "--exit-with-parent"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--exit-with-parent: this server's parent is outside its PID namespace" in proc.stderr, proc.stderr


def test_exit_with_parent_is_off_unless_asked(tmp_path: Path) -> None:
    from kvxfer.server import ServerConfig

    assert ServerConfig().parent_pid is None
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ConfigError, match="parent_pid must be a positive process id"):
            ServerConfig(url=f"ipc://{tmp_path}/s.sock", parent_pid=bad)  # type: ignore[arg-type]
