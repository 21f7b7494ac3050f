"""Faults with real processes: clients killed mid-transfer, the server killed and restarted."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import relkit
import torch
from relkit import Shape, Writer, key, read_event, shm_entries, wait_until

from kvxfer import CacheClient
from kvxfer.errors import ConfigError, ConnectionFailed, KvxferError

#: a killed client's session is dropped after 3 s of silence; the rest is slack for a loaded machine
DROP_WITHIN_S = 30.0

#: chunks of 2 MiB (8 layers x 2 x 64 tokens x 1024 x bf16): copies take long enough to be cut
BIG = Shape(layers=8, num_blocks=64, block_size=16, heads=8, head_dim=128)


def _gone(client, pid: int):
    """True once the server holds no registration of ``pid`` and no reservation at all."""
    st = client.status()
    return all(c.client_pid != pid for c in st.contexts) and st.reservations == 0


def _kill(proc) -> set[str]:
    """SIGKILL ``proc``; returns the /dev/shm files it had mapped just before."""
    mapped = shm_mapped(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return mapped


def shm_mapped(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as f:
        return {line.split(None, 5)[5].strip() for line in f
                if len(line.split(None, 5)) == 6 and line.split(None, 5)[5].startswith("/dev/shm/")}


def assert_no_shm_left(pid: int, mapped: set[str], arena_path: str, before: set[str]) -> None:
    """Nothing the dead client created in /dev/shm is left: every file it had mapped besides the
    server's arena is gone, and no new entry carries its pid."""
    left = {p for p in mapped if p != arena_path and os.path.exists(p.removesuffix(" (deleted)"))}
    assert left == set(), f"shared memory of the killed client left behind: {left}"
    assert arena_path in mapped, "the worker never mapped the arena: the check above proves nothing"
    new = {e for e in shm_entries() - before if str(pid) in e}
    assert new == set(), f"/dev/shm entries naming the killed client: {new}"


def test_the_ends_of_sessions_for_one_reason_do_not_hide_those_for_another(server, client_of, workers):
    """The server logs the end of sessions at most once a second per reason (with the count of
    those left out since). With one kind for every reason, the session a client closed a moment
    after a killed client's session was dropped was never logged (nothing came later to count
    it in); so was the reverse, where the same second allowed it."""
    w = workers("hold-write", "--url", server.url, "--model", "victim", "--chunks", "1", *BIG.args())
    read_event(w, "held")
    closing = Writer(client_of(server), model="other")
    assert closing.store([key("other", 0)]).stored == [0]
    _kill(w)
    wait_until(lambda: f"session of pid {w.pid} " in server.log(), DROP_WITHIN_S, "the killed client's session ended")
    closing.client.close()  # well within a second of that line
    wait_until(lambda: "ended (closed by the client)" in server.log(), 5.0,
               "the closed session's end logged, a moment after the killed one's")


@pytest.mark.parametrize("mode", ["hold-write", "hold-read"])
def test_client_killed_holding_a_reservation_is_cleaned_up(server, client_of, workers, mode):
    """A client dies between reserve and commit (a write half copied, or a read pinned)."""
    shm_before = shm_entries()
    other = Writer(client_of(server), model="other")
    ref = [key("other", j) for j in range(4)]
    assert other.store(ref).stored == [0, 1, 2, 3]

    w = workers(mode, "--url", server.url, "--model", "victim", "--chunks", "4", *BIG.args())
    held = read_event(w, "held")
    assert held["slots"] == 4
    st = other.client.status()
    assert any(c.client_pid == w.pid for c in st.contexts) and st.reservations == 1

    mapped = _kill(w)
    wait_until(lambda: _gone(other.client, w.pid), DROP_WITHIN_S, "registration and reservation of the killed client dropped")
    assert_no_shm_left(w.pid, mapped, other.client.arena_path, shm_before)
    # the open store's chunks, never stored, are counted (abandoned: its client gave up on them)
    victim = [t for t in other.client.status().traffic if t.model == "victim"]
    assert [(t.stored_chunks, t.abandoned_chunks) for t in victim] == [(0, 4) if mode == "hold-write" else (4, 0)], \
        victim  # (hold-read stores its chunks first)
    # the log says the client died, not that it stopped answering
    wait_until(lambda: f"session of pid {w.pid} " in server.log(), DROP_WITHIN_S, "the killed client's session ended")
    ended = [ln for ln in server.log().splitlines() if f"session of pid {w.pid} " in ln]
    assert ended and all("ended (its process ended without closing it)" in ln for ln in ended), ended

    # the same, as an operator sees it
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kvxfer", "status", "--url", server.url, "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["reservations"] == 0
    assert [c["client_pid"] for c in report["contexts"]] == [os.getpid()]

    victim = [key("victim", j) for j in range(4)]
    if mode == "hold-write":
        # the half-written slots never became readable and their space came back
        assert other.client.lookup("victim", hashes=victim) == 0
    else:
        # the read pins are gone: the chunks are evictable again (clear drops only unpinned ones)
        assert other.client.lookup("victim", hashes=victim) == 4
        assert other.client.clear("victim") == 4
    res, bad = other.retrieve(ref)
    assert res.loaded == [0, 1, 2, 3] and bad == []
    assert other.store([key("other", j) for j in range(4, 8)]).stored == [0, 1, 2, 3]


@pytest.mark.parametrize("mode", ["store-loop", "retrieve-loop"])
def test_client_killed_mid_transfer_loop(server, client_of, workers, mode):
    """A client storing (or retrieving) 16 MiB requests in a loop is SIGKILLed while a
    reservation of its is open: its registration and reservations go, /dev/shm holds nothing
    of it, every chunk it left readable is bit-exact, and another client is unaffected."""
    shm_before = shm_entries()
    other = Writer(client_of(server), model="other")
    ref = [key("other", j) for j in range(4)]
    assert other.store(ref).stored == [0, 1, 2, 3]
    # the victim's loop fills the 64 MiB arena and evicts the least recently used chunks, ours
    # first: a lease keeps them, so their survival below checks isolation and not timing
    lease = other.client.lookup_and_lease("other", hashes=ref, lease_s=300.0)
    assert lease.hits == 4

    w = workers(mode, "--url", server.url, "--model", "victim", "--chunks", "8", *BIG.args())
    read_event(w, "ready")
    read_event(w, "stored" if mode == "store-loop" else "retrieved")
    # kill while the server holds one of its reservations: mid-copy
    wait_until(lambda: other.client.status().reservations > 0, 30.0, "a reservation of the worker", interval=0.002)
    mapped = _kill(w)
    wait_until(lambda: _gone(other.client, w.pid), DROP_WITHIN_S, "registration and reservations of the killed client dropped")
    assert_no_shm_left(w.pid, mapped, other.client.arena_path, shm_before)

    # whatever the victim left readable is bit-exact (nothing half-copied became visible)
    checker = Writer(client_of(server), shape=BIG, model="victim")
    last = 8 * 64
    seen = 0
    for first in range(0, last, 8):
        keys = [key("victim", n) for n in range(first, first + 8)]
        res, bad = checker.retrieve(keys)
        assert bad == [], f"corrupted victim chunks {bad} of batch {first}"
        seen += len(res.loaded)
    assert seen > 0
    res, bad = other.retrieve(ref, lease_id=lease.lease_id)
    assert res.loaded == [0, 1, 2, 3] and bad == []
    assert other.client.status().reservations == 0


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.parametrize("mode", ["freeze-write", "freeze-read", "freeze-read-by-layer"])
def test_client_frozen_mid_copy_past_its_session_corrupts_nothing(small_server, client_of, workers, mode):
    """A client-driven client SIGSTOPped right before its copy into (or out of) arena slots, for
    longer than the session timeout, then continued: its session is dropped meanwhile and another
    client fills the arena. A frozen writer's slots are not handed out while its process lives, so
    its late copy lands in slots nobody else owns; a frozen reader whose slots were reused reports
    nothing loaded. Every chunk of the other client stays bit-exact. Layer by layer, a layer whose
    copy ended late is not said to have landed: ``wait_layer`` returns only with the transfer
    done, reporting nothing loaded (it returned first, while the blocks held another chunk's
    bytes, which an engine's attention would have read)."""
    by_layer = mode.endswith("-by-layer")
    mode = mode.removesuffix("-by-layer")
    w = workers(mode, "--url", small_server.url, "--model", "victim", "--chunks", "4",
                *(["--by-layer"] if by_layer else []))
    read_event(w, "freezing")
    wait_until(lambda: _stopped(w.pid), 10.0, "the worker stopped itself")
    other = Writer(client_of(small_server), model="other")
    wait_until(lambda: all(c.client_pid != w.pid for c in other.client.status().contexts), DROP_WITHIN_S,
               "the frozen client's registration dropped")
    st = other.client.status()
    assert st.reservations == (1 if mode == "freeze-write" else 0), st  # the frozen write is kept

    # fill the 16-slot arena (evicting the victim's chunks in freeze-read), then wake the victim
    ref = [key("other", j) for j in range(16)]
    for first in range(0, 16, 4):
        assert other.store(ref[first:first + 4]).stored == [0, 1, 2, 3]
    os.kill(w.pid, signal.SIGCONT)
    if mode == "freeze-write":
        read_event(w, ("stored", "failed"))  # its commit finds no session: either is fine
    else:
        event = read_event(w, ("layer0", "failed")) if by_layer else {"event": ""}
        assert event["event"] != "layer0" or event["done"] or all(event["right"]), event
        if event["event"] != "failed":
            event = read_event(w, ("retrieved", "failed"))
        assert event["event"] == "failed" or (event["loaded"] == [] and event["missing"] == [0, 1, 2, 3]), event

    seen = 0
    for first in range(0, 16, 4):
        res, bad = other.retrieve(ref[first:first + 4])
        assert bad == [], f"chunks {[first + j for j in bad]} of the other client were overwritten"
        seen += len(res.loaded)
    assert seen >= 12

    w.stdin.write("exit\n")  # the victim exits: its parked slots are freed
    w.stdin.flush()
    w.wait(30)
    wait_until(lambda: other.client.status().reservations == 0, DROP_WITHIN_S, "the parked write freed")


def test_server_killed_and_restarted(client_of):
    """SIGKILL the server: requests fail with a clear ConnectionFailed; after a restart on the
    same url, the same context stores and retrieves again (transparent re-handshake and
    re-registration), and the dead server's arena is gone from /dev/shm."""
    from kvxfer.testing.server import ServerProcess

    with ServerProcess(l1_size="16MiB", chunk_size=64, transports="cpu_gather") as server:
        w = Writer(client_of(server, timeout=3.0, connect_timeout=5.0))
        keys = [key("m", j) for j in range(4)]
        assert w.store(keys).stored == [0, 1, 2, 3]
        old_arena = w.client.arena_path
        old_pid = server.pid

        server.kill()
        with pytest.raises(ConnectionFailed) as info:
            w.store([key("m", j) for j in range(4, 8)], timeout=30)
        assert server.url in str(info.value)
        with pytest.raises(ConnectionFailed):
            w.client.lookup("m", hashes=keys)

        server.start()
        assert server.pid != old_pid
        assert not os.path.exists(old_arena), "the killed server's arena was left in /dev/shm"
        # the arena was lost with the server: the chunks are gone, stores work again
        res = w.store(keys)
        assert res.stored == [0, 1, 2, 3]
        assert w.client.arena_path != old_arena
        assert w.client.lookup("m", hashes=keys) == 4
        res, bad = w.retrieve(keys)
        assert res.loaded == [0, 1, 2, 3] and bad == []
        st = w.client.status()
        assert [c.client_pid for c in st.contexts] == [os.getpid()]
        w.client.close()


def test_server_restart_then_retrieve_first(client_of):
    """After a restart the first request may be a retrieve: it re-registers and reports the
    chunks missing (the arena died with the server) instead of failing."""
    from kvxfer.testing.server import ServerProcess

    with ServerProcess(l1_size="16MiB", chunk_size=64, transports="cpu_gather") as server:
        w = Writer(client_of(server, timeout=3.0, connect_timeout=5.0))
        keys = [key("m", j) for j in range(2)]
        w.store(keys)
        server.kill()
        server.start()
        res, bad = w.retrieve(keys)
        assert res.loaded == [] and res.missing == [0, 1] and bad == []
        assert w.store(keys).stored == [0, 1]
        w.client.close()


def test_a_kv_cache_registered_first_thing_after_a_restart_is_registered_with_the_new_server(client_of):
    """The first request after a restart is a registration (a new engine instance on a client
    that outlived the server): it opens the session again and maps the new server's arena,
    instead of failing with no_session, or on the old arena's file."""
    from kvxfer.testing.server import ServerProcess

    with ServerProcess(l1_size="16MiB", chunk_size=64, transports="cpu_gather") as server:
        w = Writer(client_of(server, timeout=5.0, connect_timeout=10.0))
        keys = [key("m", j) for j in range(2)]
        assert w.store(keys).stored == [0, 1]
        server.kill()
        server.start()
        fresh = Writer(w.client, model="after")
        assert fresh.store(keys).stored == [0, 1]
        res, bad = fresh.retrieve(keys)
        assert res.loaded == [0, 1] and bad == []
        assert w.store(keys).stored == [0, 1]  # the older context registered again too
        w.client.close()


def test_a_context_refuses_a_server_restarted_with_another_chunk_size(client_of):
    """A server restarted with another --chunk-size while no request of a client's was under
    way: the client opened its session again and registered its contexts again, at their old
    chunk size, unchecked. A cpu_gather store then wrote chunks of 64 tokens into the slots of 32
    the new server handed out, over other chunks (a vLLM worker, which checks the chunk size only
    when it connects itself, overwrote other engines' chunks and then crashed on a slot past the
    arena's end). Now registering again fails with ConfigError naming both sizes: nothing is
    written, and the other chunks stay as stored."""
    from kvxfer.testing.server import ServerProcess

    with ServerProcess(l1_size="8MiB", chunk_size=64, transports="cpu_gather") as server:
        w = Writer(client_of(server, timeout=5.0, connect_timeout=10.0))
        keys = [key("m", j) for j in range(2)]
        assert w.store(keys).stored == [0, 1]
        server.kill()
        server.args = ["--chunk-size=32" if a.startswith("--chunk-size=") else a for a in server.args]
        server.chunk_size = 32
        server.start()
        other = Writer(client_of(server, timeout=5.0, connect_timeout=10.0), model="other")
        other_keys = [key("o", j) for j in range(2)]
        assert other.store(other_keys).stored == [0, 1]
        for _ in range(2):  # and again: it stays refused, without a write
            with pytest.raises(ConfigError, match="uses chunks of 32 tokens, this transfer context's are 64 tokens"):
                w.store(keys)
        res, bad = other.retrieve(other_keys)
        assert res.loaded == [0, 1] and bad == []
        with CacheClient(server.url) as c:
            assert [ctx.model_name for ctx in c.status().contexts] == ["other"], "the refused one is not registered"
        w.client.close()


def _retrieve_held_in_its_copy(w: Writer, keys: list[bytes], gate: threading.Event, monkeypatch):
    """A retrieve of ``keys`` whose copy (the real one) starts once ``gate`` is set: the worker
    is held in it, and the requests submitted after it queue behind it with their reserves
    answered. Returns its future once the copy is reached."""
    held = threading.Event()
    scatter = w.ctx.scatter

    def long_copy(copies, transfer):
        if not held.is_set():
            held.set()
            assert gate.wait(60)
        return scatter(copies, transfer)

    monkeypatch.setattr(w.ctx, "scatter", long_copy)
    first = w.ctx.submit_retrieve(keys, w.blocks(len(keys), 4))
    assert held.wait(10)
    return first


def test_slots_a_restarted_server_handed_out_are_never_used_in_the_new_ones_arena(client_of, monkeypatch):
    """A client-driven context's requests queued behind a long copy had their reserves answered
    by a server that then restarted. Another context of the same client reconnected meanwhile,
    and the context's arena was mapped anew: the old replies' slot offsets became views of the new
    server's arena. A retrieve then loaded another chunk's bytes and reported them loaded, and a
    store wrote over another client's chunk there. Now a reply from a session the client has
    since replaced is not copied with: the retrieve reports its chunk missing and leaves its
    blocks alone, the store stores nothing, and the new server's chunks stay as stored. (The long
    copy is the real one, held back at its start: the only stand-in here.)"""
    from kvxfer.testing.server import ServerProcess

    with ServerProcess(l1_size="8MiB", chunk_size=64, transports="cpu_gather") as server:
        client = client_of(server, timeout=10.0, connect_timeout=10.0)
        x, y = Writer(client, model="x"), Writer(client, model="y")
        mine = [key("x", j) for j in range(2)]
        assert x.store(mine[:1]).stored == [0]
        gate = threading.Event()
        first = _retrieve_held_in_its_copy(x, mine[:1], gate, monkeypatch)
        loaded = x.ctx.submit_retrieve(mine[:1], x.blocks(1, 6))  # reserves answered while the copy above waits
        stored = x.ctx.submit_store(mine[1:], x.blocks(1, 1))
        try:
            with CacheClient(server.url) as c:
                wait_until(lambda: c.status().reservations == 3, 10, "the three reserves answered")
            server.kill()
            server.start()
            other = Writer(client_of(server, timeout=10.0), model="o")  # the new arena's first slots: theirs
            theirs = [key("o", j) for j in range(4)]
            assert other.store(theirs).stored == [0, 1, 2, 3]
            for _ in range(3):  # y's next requests find the server gone, then reconnect: x maps the new arena
                try:
                    assert y.store([key("y", 0)]).stored == [0]
                    break
                except KvxferError:
                    pass
            else:
                pytest.fail("the client did not reach the restarted server")
        finally:
            gate.set()
        first.result(30)
        assert loaded.result(30).missing == [0]
        target = x.blocks(1, 6)
        assert all(int(layer[:, target].abs().sum()) == 0 for layer in x.kv), "a chunk reported missing was written"
        assert stored.result(30).failed == [0]
        res, bad = other.retrieve(theirs)
        assert res.loaded == [0, 1, 2, 3] and bad == [], "a chunk of the new server's was overwritten"
        assert "Traceback" not in server.log()


def test_a_store_answered_before_its_session_was_resumed_frees_its_parked_write(client_of, monkeypatch):
    """As above, but the server lives: the client's connection broke and it resumed its session
    on a new one, so the server parked the store's open write. The store is not copied (its slots
    came from a replaced session) and still sends its commit, which frees the parked write: it
    once held its slot, and its key as being written (another client's store of it skipped as
    present), for the client's whole life. A store of a key the replaced session called present
    (no slots) reports it not stored rather than raising on its commit. (The client's own socket
    is shut down under it: the broken connection.)"""
    import socket

    from kvxfer.testing.server import ServerProcess

    with ServerProcess(l1_size="8MiB", chunk_size=64, transports="cpu_gather") as server:
        client = client_of(server, timeout=10.0, connect_timeout=10.0)
        observer = client_of(server)
        x = Writer(client, model="x")
        mine = [key("x", j) for j in range(2)]
        assert x.store(mine[:1]).stored == [0]
        gate = threading.Event()
        first = _retrieve_held_in_its_copy(x, mine[:1], gate, monkeypatch)
        try:
            stored = x.ctx.submit_store(mine[1:], x.blocks(1, 1))
            present = x.ctx.submit_store(mine[:1], x.blocks(1, 2))
            wait_until(lambda: observer.status().reservations == 3, 10, "the three reserves answered")
            epoch = client.epoch
            client._mq._wire._sock.shutdown(socket.SHUT_RDWR)
            wait_until(lambda: _resumed(client, epoch), 10, "the session resumed on a new connection")
        finally:
            gate.set()
        first.result(30)
        assert stored.result(30).failed == [0] and present.result(30).failed == [0]
        wait_until(lambda: observer.status().reservations == 0, 10, "the parked write freed by its late commit")
        assert Writer(observer, model="x").store(mine[1:]).stored == [0]


def test_a_layerwise_store_copied_after_its_session_was_resumed_reports_nothing_stored(client_of):
    """A layer-wise store whose slots were taken before the client's session was resumed on a new
    connection, and whose layers were declared written after: its copy goes into the slots the
    server parked, and its commit is refused. It raised that refusal (InvalidRequest, which
    reads as a malformed request); it reports every chunk not stored, as a store that was never
    copied does, and the parked write is freed."""
    import socket

    from kvxfer.testing.server import ServerProcess

    with ServerProcess(l1_size="8MiB", chunk_size=64, transports="cpu_gather") as server:
        client = client_of(server, timeout=10.0, connect_timeout=10.0)
        observer = client_of(server)
        x = Writer(client, model="x")
        fut = x.ctx.submit_store([key("x", 0)], x.blocks(1), by_layer=True)
        wait_until(lambda: observer.status().reservations == 1, 10, "the store's slots reserved")
        epoch = client.epoch
        client._mq._wire._sock.shutdown(socket.SHUT_RDWR)
        wait_until(lambda: _resumed(client, epoch), 10, "the session resumed on a new connection")
        fut.layer_ready(x.ctx.layout.num_layers - 1)
        assert fut.result(30).failed == [0]
        wait_until(lambda: observer.status().reservations == 0, 10, "the parked write freed by its commit")


def _resumed(client, epoch: int) -> bool:
    try:
        client.reconnect()
    except KvxferError:
        return False
    return client.epoch != epoch


def test_a_slot_past_the_arena_is_a_protocol_error(client_of):
    """A slot offset past the mapped arena's end (a faulty server's answer) was a ValueError,
    which no caller takes for a server's fault: vLLM's worker ended on it. It is a ProtocolError
    (a KvxferError, which the connector treats as a server failure). The real context's own slot
    planning, given the offsets a faulty server would send."""
    from kvxfer.errors import ProtocolError
    from kvxfer.protocol import messages as m
    from kvxfer.testing.server import ServerProcess

    with ServerProcess(l1_size="8MiB", chunk_size=64, transports="cpu_gather") as server:
        w = Writer(client_of(server, timeout=5.0))
        size = w.client.arena_size
        assert len(w.ctx._slots([m.Slot(0, 0)])) == 1
        for offset in (size, size - 1, -w.ctx.chunk_bytes):
            with pytest.raises(ProtocolError, match="handed out a slot this context cannot use"):
                w.ctx._slots([m.Slot(0, offset)])
        w.client.close()


def test_first_request_after_a_long_outage_reaches_the_restarted_server(client_of):
    """A server down for longer than the client's dead-peer limit, then back: requests fail at
    once while it is down (its connection ended, then nothing listens), and the first request
    sent afterwards gets the new server's answer (no_session, naming the call that recovers:
    ``reconnect()``), instead of being failed at once as "stopped answering" because of the old
    silence."""
    from kvxfer import NoSession
    from kvxfer.protocol import messages as m
    from kvxfer.testing.server import ServerProcess

    with ServerProcess(l1_size="8MiB", chunk_size=64, transports="cpu_gather") as server:
        client = client_of(server, timeout=10.0, connect_timeout=10.0)
        server.kill()
        # the connection ends with the server, and nothing listens until it is back
        with pytest.raises(ConnectionFailed, match="ended|server is gone"):
            client.submit(m.Ping(), timeout=10.0).result(15.0)
        with pytest.raises(ConnectionFailed, match="server is gone"):
            client.submit(m.Ping(), timeout=10.0).result(15.0)
        time.sleep(client._mq.dead_after_s + 0.5)  # silence longer than the client tolerates
        server.start()
        with pytest.raises(NoSession, match=r"CacheClient: call reconnect\(\)"):
            client.submit(m.Ping(), timeout=10.0).result(15.0)
        client.reconnect()
        assert client.lookup("m", hashes=[key("m", 0)]) == 0
        client.close()


def test_server_killed_mid_store_then_restarted(client_of, workers):
    """SIGKILL the server while a client's store holds a write reservation (its copy under way):
    the client gets a ConnectionFailed naming the server, and after a restart on the same url
    nothing of what was being written is readable; the same keys store and read back bit-exact."""
    from kvxfer.testing.server import ServerProcess

    with ServerProcess(l1_size="64MiB", chunk_size=64, transports="cpu_gather") as server:
        w = workers("store-loop", "--url", server.url, "--model", "victim", "--chunks", "8", *BIG.args())
        read_event(w, "ready")
        read_event(w, "stored")
        observer = client_of(server)
        old_arena = observer.arena_path
        wait_until(lambda: observer.status().reservations > 0, 30.0, "a write reservation of the worker", interval=0.002)
        server.kill()
        with pytest.raises(RuntimeError) as info:  # the worker's store fails, and it reports why
            while True:
                read_event(w, "stored", timeout=60)
        assert "ConnectionFailed" in str(info.value) or "RequestTimeout" in str(info.value), info.value
        assert server.url in str(info.value)
        server.start()
        assert not os.path.exists(old_arena), "the killed server's arena was left in /dev/shm"
        checker = Writer(client_of(server), shape=BIG, model="victim")
        written = [key("victim", n) for n in range(8 * 64)]
        assert checker.client.lookup("victim", hashes=written) == 0, "a chunk of the killed server is readable"
        assert checker.store(written[:8]).stored == list(range(8))
        res, bad = checker.retrieve(written[:8])
        assert res.loaded == list(range(8)) and bad == []


def test_concurrent_stores_of_one_key_with_different_bytes(server, client_of, workers):
    """Four processes store the same keys at once, each with bytes of its own: every chunk any of
    them reads back is one whole version (the one that reserved it first), never a mix of two;
    a key still being written by another is reported present to a store and missing to a read."""
    procs = [workers("race", "--url", server.url, "--model", "race", "--tag", str(v), "--versions", "4",
                     "--iters", "12", "--chunks", "4") for v in range(4)]
    for p in procs:
        read_event(p, "ready", timeout=120)
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    done = [read_event(p, "done", timeout=180) for p in procs]
    assert sum(d["mixed"] for d in done) == 0, done
    assert sum(d["stored"] for d in done) == 12 * 4, done  # each key stored by exactly one of them
    assert sum(d["other"] for d in done) > 0, "no racer ever read another's version: nothing raced"
    # afterwards every key holds exactly one whole version
    checker = Writer(client_of(server), model="race")
    for it in range(12):
        keys = [key(f"race/{it}", j) for j in range(4)]
        res, _ = checker.retrieve(keys)
        assert res.loaded == [0, 1, 2, 3]
        base = Shape().num_blocks // checker.bpc // 2
        for j in range(4):
            got = relkit.read_chunk(checker.kv, checker.blocks(4, base)[j * checker.bpc:(j + 1) * checker.bpc])
            versions = [relkit.expected(Shape(), f"race#{v}", 0, keys[j], checker.bpc) for v in range(4)]
            assert sum(torch.equal(got, v) for v in versions) == 1, f"round {it}, chunk {j}: not one whole version"
