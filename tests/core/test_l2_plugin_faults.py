"""A store plugin that breaks the store contract, behind a real server: ``test_faulty`` (the ``fs``
store of the really installed test plugin, faulty as its fault file says, turned on and off while
the server runs). Its faults are counted as store failures (the server answers from L1, never
``internal``), a short answer loses no chunk, a fault in ``stats()`` does not take L2 down, and a
fault in ``open()`` stops ``kvxfer serve`` with the store's name."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from kvxfer_core_helpers import BLOCK_SIZE, BLOCKS_PER_CHUNK, CHUNK_SIZE, env_with, flash_attn_kv, wait_until

from kvxfer import CacheClient, chunk_hashes
from kvxfer.errors import KvxferError
from kvxfer.protocol import messages as m
from kvxfer.testing.server import ServerProcess


def _server(test_plugin_path: Path, l2: Path) -> ServerProcess:
    return ServerProcess(l1_size="8MiB", chunk_size=CHUNK_SIZE, transports="cpu_gather", env=env_with(test_plugin_path),
                         extra_args=["--l2", "test_faulty", "--l2-url", f"file://{l2}", "--l2-timeout", "0.5"])


def _tier(c: CacheClient) -> m.TierStatus:
    return c.status().tiers[0]


def _internal_errors(c: CacheClient) -> int:
    return c.status().errors_by_code.get("internal", 0)


def _set_fault(fault_file: Path, word: str) -> None:
    """Switch the running store's fault at once: a rename, since ``write_text`` truncates first and
    a store reading the file in between would see no fault (a hung get then ends with good bytes)."""
    part = fault_file.with_name(fault_file.name + ".part")
    part.write_text(word)
    part.replace(fault_file)


@pytest.mark.parametrize("fault", ["exists_raises", "exists_exits", "exists_short", "exists_strings", "put_ints"])
def test_a_faulty_write_path_loses_no_chunk_and_is_counted(test_plugin_path: Path, tmp_path: Path, fault: str) -> None:
    """The writers check what L2 holds before they write: a check that raises or answers wrong
    (one size too few made chunks count as stored that were not) fails the batch, counted as a
    store error, never as written or skipped; a put answered wrong likewise. A check that raises
    SystemExit is the same fault (it ended the writer's thread, and the tier counted writers that
    were gone and dropped every later write). With the fault gone the same chunks are written and
    come back from L2, by as many writers as before."""
    l2 = tmp_path / "l2"
    fault_file = Path(f"{l2}.fault")
    with _server(test_plugin_path, l2) as srv, CacheClient(srv.url, timeout=30) as c:
        kv = c.register(flash_attn_kv(num_blocks=32), model_name="faulty", block_size=BLOCK_SIZE,
                        transport="cpu_gather")
        hashes = chunk_hashes(list(range(4 * CHUNK_SIZE)), CHUNK_SIZE, salt=fault)
        writers = _tier(c).writers
        _set_fault(fault_file, fault)
        assert kv.submit_store(hashes, list(range(4 * BLOCKS_PER_CHUNK))).result(30).stored == [0, 1, 2, 3]
        wait_until(lambda: _tier(c).errors >= 1 and _tier(c).queue_depth == 0, timeout=30)
        t = _tier(c)
        assert t.write_skipped == 0, f"a faulty check passed chunks as stored: {t}"
        assert t.writes == 0, f"a batch whose check or put was answered wrong counted as written: {t}"
        assert _internal_errors(c) == 0
        fault_file.unlink()
        wait_until(lambda: _tier(c).state == "up", timeout=30)
        # stored again with the store healthy: written, and loaded from L2 once L1 drops them
        c.clear("faulty")
        assert kv.submit_store(hashes, list(range(4 * BLOCKS_PER_CHUNK))).result(30).stored == [0, 1, 2, 3]
        wait_until(lambda: (x := _tier(c)).writes + x.write_skipped >= 4 and x.queue_depth == 0, timeout=30)
        assert c.clear("faulty") == 4
        lease = c.lookup_and_lease("faulty", hashes=hashes, lease_s=30)
        assert (lease.hits, lease.l2_hits) == (4, 4)
        got = kv.submit_retrieve(hashes, list(range(4 * BLOCKS_PER_CHUNK, 8 * BLOCKS_PER_CHUNK)),
                                 lease_id=lease.lease_id).result(30)
        assert got.loaded == [0, 1, 2, 3]
        t = _tier(c)
        assert (t.writers, t.writers_held) == (writers, 0), t


@pytest.mark.parametrize("fault", ["exists_raises", "exists_short", "exists_strings", "get_fails"])
def test_a_faulty_lookup_or_promotion_is_a_miss_from_l2_not_an_internal_error(test_plugin_path: Path, tmp_path: Path,
                                                                             fault: str) -> None:
    """Chunks only L2 holds: with the store's check or get faulty, a lookup answers what L1 has
    (an ``internal`` error before: ``TypeError``, ``KeyError``), the fault is counted, and a
    retrieve of a chunk whose promotion failed reports it missing."""
    l2 = tmp_path / "l2"
    with _server(test_plugin_path, l2) as srv, CacheClient(srv.url, timeout=30) as c:
        kv = c.register(flash_attn_kv(num_blocks=32), model_name="faulty", block_size=BLOCK_SIZE,
                        transport="cpu_gather")
        hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt=f"lookup-{fault}")
        assert kv.submit_store(hashes, list(range(2 * BLOCKS_PER_CHUNK))).result(30).stored == [0, 1]
        wait_until(lambda: (t := _tier(c)).writes == 2 and t.queue_depth == 0, timeout=30)
        assert c.clear("faulty") == 2
        _set_fault(Path(f"{l2}.fault"), fault)
        before = _tier(c).errors + _tier(c).promote_failures
        lease = c.lookup_and_lease("faulty", hashes=hashes, lease_s=30)
        if fault == "get_fails":  # the check works: both found in L2, their promotion fails
            assert (lease.hits, lease.l2_hits) == (2, 2)
            got = kv.submit_retrieve(hashes, list(range(2 * BLOCKS_PER_CHUNK, 4 * BLOCKS_PER_CHUNK)),
                                     lease_id=lease.lease_id).result(30)
            assert got.missing == [0, 1]
        else:
            assert (lease.hits, lease.l2_hits) == (0, 0)
        wait_until(lambda: _tier(c).errors + _tier(c).promote_failures > before, timeout=10)
        assert _internal_errors(c) == 0


def _stuck_server(test_plugin_path: Path, l2: Path, *, quick: bool = False, l1_size: str = "8MiB",
                  writers: int = 2, readers: int = 2, transports: str = "cpu_gather") -> ServerProcess:
    """A server whose tier gives up on a store operation after 4 x (0.2 + 0.5) = 2.8 s (``quick``:
    4 x (0.1 + 0.1) = 0.8 s) and the time its bytes take at 4 MiB/s, and on its close 5 s (to
    drain the writes) + that + 1 s."""
    timeouts = ["--l2-timeout", "0.1", "--l2-bulk-timeout", "0.1"] if quick else \
        ["--l2-timeout", "0.2", "--l2-bulk-timeout", "0.5"]
    return ServerProcess(l1_size=l1_size, chunk_size=CHUNK_SIZE, transports=transports, env=env_with(test_plugin_path),
                         extra_args=["--l2", "test_faulty", "--l2-url", f"file://{l2}", *timeouts,
                                     "--l2-writers", str(writers), "--l2-readers", str(readers)])


def test_a_get_that_never_ends_fails_its_promotion_and_keeps_its_slots(test_plugin_path: Path,
                                                                       tmp_path: Path) -> None:
    """A store whose get never ends (it does not bound its operations) held the chunks' retrieve
    until the client gave up, and the promotion for the server's life: after 4 x the store's
    timeouts the promotion fails for its waiters (missing), counted and logged as the plugin's
    fault; its slots stay reserved until the get ends, then are freed; the tier goes on."""
    l2 = tmp_path / "l2"
    fault = Path(f"{l2}.fault")
    with _stuck_server(test_plugin_path, l2) as srv, CacheClient(srv.url, timeout=30) as c:
        kv = c.register(flash_attn_kv(num_blocks=32), model_name="stuck", block_size=BLOCK_SIZE,
                        transport="cpu_gather")
        hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt="stuck-get")
        assert kv.submit_store(hashes, list(range(2 * BLOCKS_PER_CHUNK))).result(30).stored == [0, 1]
        wait_until(lambda: (t := _tier(c)).writes == 2 and t.queue_depth == 0, timeout=30)
        assert c.clear("stuck") == 2
        _set_fault(fault, "get_hangs")
        lease = c.lookup_and_lease("stuck", hashes=hashes, lease_s=30)
        assert (lease.hits, lease.l2_hits) == (2, 2)
        got = kv.submit_retrieve(hashes, list(range(2 * BLOCKS_PER_CHUNK, 4 * BLOCKS_PER_CHUNK)),
                                 lease_id=lease.lease_id).result(20)
        assert got.missing == [0, 1]
        t = _tier(c)
        assert t.promote_failures == 2 and t.promoting == 0, t
        assert re.search(r"a get has not ended after 2\.8\d* s", srv.log())
        assert c.status().reservations == 1  # the promotion's slots: the store may still write there
        fault.unlink()  # the get ends: its slots are freed, and the chunks promote again
        wait_until(lambda: c.status().reservations == 0, timeout=10)
        lease = c.lookup_and_lease("stuck", hashes=hashes, lease_s=30)
        assert (lease.hits, lease.l2_hits) == (2, 2)
        got = kv.submit_retrieve(hashes, list(range(2 * BLOCKS_PER_CHUNK, 4 * BLOCKS_PER_CHUNK)),
                                 lease_id=lease.lease_id).result(30)
        assert got.loaded == [0, 1] and _internal_errors(c) == 0


def test_gets_queued_behind_a_stuck_one_free_their_slots_when_given_up(test_plugin_path: Path,
                                                                       tmp_path: Path) -> None:
    """Three promotions through one read connection whose first get never ends: the two queued
    behind it are given up with it (no get ends), and the store withdraws their gets, so their
    slots are freed at once (they stayed reserved until each get had run out its own time after
    the stuck one); the stuck get's stay reserved until it ends. Then all three promote again."""
    l2 = tmp_path / "l2"
    fault = Path(f"{l2}.fault")
    with _stuck_server(test_plugin_path, l2, readers=1) as srv, CacheClient(srv.url, timeout=30) as c:
        kv = c.register(flash_attn_kv(num_blocks=32), model_name="queued", block_size=BLOCK_SIZE,
                        transport="cpu_gather")
        hashes = [chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE, salt=f"queued-{i}")[0] for i in range(3)]
        for h in hashes:
            assert kv.submit_store([h], list(range(BLOCKS_PER_CHUNK))).result(30).stored == [0]
        wait_until(lambda: (t := _tier(c)).writes == 3 and t.queue_depth == 0, timeout=30)
        assert c.clear("queued") == 3
        _set_fault(fault, "get_hangs")
        leases = [c.lookup_and_lease("queued", hashes=[h], lease_s=30) for h in hashes]
        assert all((r.hits, r.l2_hits) == (1, 1) for r in leases)
        wait_until(lambda: _tier(c).promote_failures == 3, timeout=20)
        wait_until(lambda: c.status().reservations == 1, timeout=5)  # the stuck get's: the store may write there
        assert c.status().reservations == 1 and _tier(c).promoting == 0
        fault.unlink()
        wait_until(lambda: c.status().reservations == 0, timeout=10)
        wait_until(lambda: _tier(c).state == "up", timeout=30)  # three failures opened the breaker
        for h in hashes:
            lease = c.lookup_and_lease("queued", hashes=[h], lease_s=30)
            assert (lease.hits, lease.l2_hits) == (1, 1)
            got = kv.submit_retrieve([h], list(range(BLOCKS_PER_CHUNK, 2 * BLOCKS_PER_CHUNK)),
                                     lease_id=lease.lease_id).result(30)
            assert got.loaded == [0], got
        assert _internal_errors(c) == 0


def test_gets_queued_behind_others_at_a_slow_store_are_not_stuck(test_plugin_path: Path, tmp_path: Path) -> None:
    """Twenty-four promotions through one read connection of a store that takes 0.3 s a get:
    the last waits 7.2 s, past the 6 s backstop, in the backend's queue. While gets end, none is
    given up (the backstop counted from the promotion's start, so a slow but healthy store had
    its promotions failed and its breaker opened). The lookups' own timeout (1 s) leaves a loaded
    machine room for each existence check."""
    l2 = tmp_path / "l2"
    fault = Path(f"{l2}.fault")
    srv = ServerProcess(l1_size="8MiB", chunk_size=CHUNK_SIZE, transports="cpu_gather", env=env_with(test_plugin_path),
                        extra_args=["--l2", "test_faulty", "--l2-url", f"file://{l2}", "--l2-timeout", "1",
                                    "--l2-bulk-timeout", "0.5", "--l2-readers", "1"])
    n = 24
    with srv, CacheClient(srv.url, timeout=30) as c:
        kv = c.register(flash_attn_kv(num_blocks=32), model_name="slow", block_size=BLOCK_SIZE, transport="cpu_gather")
        hashes = [chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE, salt=f"slow-{i}")[0] for i in range(n)]
        for i, h in enumerate(hashes):
            assert kv.submit_store([h], list(range(BLOCKS_PER_CHUNK))).result(30).stored == [0]
        wait_until(lambda: (t := _tier(c)).writes == n and t.queue_depth == 0, timeout=30)
        assert c.clear("slow") == n
        _set_fault(fault, "get_slow")
        leases = [c.lookup_and_lease("slow", hashes=[h], lease_s=60) for h in hashes]  # n promotions at once
        assert all((r.hits, r.l2_hits) == (1, 1) for r in leases)
        for h, r in zip(hashes, leases):
            got = kv.submit_retrieve([h], list(range(BLOCKS_PER_CHUNK, 2 * BLOCKS_PER_CHUNK)),
                                     lease_id=r.lease_id).result(30)
            assert got.loaded == [0], got
        t = _tier(c)
        assert (t.promotions, t.promote_failures, t.errors, t.state) == (n, 0, 0, "up"), t
        assert "has not ended" not in srv.log()


def test_a_put_that_never_ends_is_dropped_and_does_not_hold_shutdown(test_plugin_path: Path, tmp_path: Path) -> None:
    """A put that never ends held its writer, its chunks' pins and then ``kvxfer serve``'s exit
    for ever, with nothing logged: it is dropped after 4 x the store's timeouts, and at shutdown
    the server exits without it, saying so. A submit_put that never returns (holding the writer's
    thread itself) kept its chunks pinned for good, silently: it is dropped too, a second later."""
    l2 = tmp_path / "l2"
    fault = Path(f"{l2}.fault")
    _set_fault(fault, "submit_put_blocks")
    srv = _stuck_server(test_plugin_path, l2, quick=True)
    srv.stop_timeout = 60
    with srv, CacheClient(srv.url, timeout=30) as c:
        kv = c.register(flash_attn_kv(num_blocks=32), model_name="stuckput", block_size=BLOCK_SIZE,
                        transport="cpu_gather")
        held = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt="held-writer")
        assert kv.submit_store(held, list(range(2 * BLOCKS_PER_CHUNK))).result(30).stored == [0, 1]
        assert wait_until(lambda: (t := _tier(c)).queue_depth == 0 and t.pinned_bytes == 0 and t.drops == 2,
                          timeout=30), _tier(c)
        assert re.search(r"writer\(s\) have not come back from the store plugin after \d+\.\d s", srv.log()), srv.log()
        # the held writer goes on once the plugin lets it (into a put that never ends): counted once
        _set_fault(fault, "put_hangs")
        hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt="stuck-put")
        assert kv.submit_store(hashes, list(range(2 * BLOCKS_PER_CHUNK))).result(30).stored == [0, 1]
        assert wait_until(lambda: (t := _tier(c)).queue_depth == 0 and t.pinned_bytes == 0 and t.drops == 4,
                          timeout=30), _tier(c)
        assert _tier(c).writes == 0 and re.search(r"submit_put has not ended after 0\.8\d* s", srv.log())
        time.sleep(1.0)
        assert _tier(c).drops == 4
        kv.close()
        start = time.monotonic()
        assert srv.stop() == 0
        assert time.monotonic() - start < 30
        assert "did not close within 6.8 s" in srv.log() and "stopped: its arena and socket are removed" in srv.log()


def test_a_writer_given_up_while_held_never_writes_what_its_slots_hold_since(test_plugin_path: Path,
                                                                            tmp_path: Path) -> None:
    """A writer held in the plugin's submit_exists is given up and its chunk's pins released; the
    chunk is then evicted and its slot holds another chunk. When the plugin lets the writer go,
    it once checksummed and wrote that other chunk's bytes under the first chunk's key, with a
    valid checksum: wrong KV loaded on every host. It now writes nothing for the given-up batch.
    With one writer: a writer is started in its place, held too, given up too (no writer left:
    writes are dropped); once the plugin lets them go, both write again."""
    l2 = tmp_path / "l2"
    fault = Path(f"{l2}.fault")
    _set_fault(fault, "writer_exists_blocks")
    srv = _stuck_server(test_plugin_path, l2, quick=True, l1_size="1MiB", writers=1)
    try:
        with srv, CacheClient(srv.url, timeout=30) as c:
            kv = flash_attn_kv(num_blocks=32)
            ctx = c.register(kv, model_name="held", block_size=BLOCK_SIZE, transport="cpu_gather")
            (first,) = chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE, salt="held-first")
            assert ctx.submit_store([first], list(range(BLOCKS_PER_CHUNK))).result(30).stored == [0]
            assert wait_until(lambda: "writer(s) have not come back from the store plugin" in srv.log(), timeout=30)
            # other chunks (other bytes) fill the arena: the first one, no longer pinned, is evicted
            others = chunk_hashes(list(range(160 * CHUNK_SIZE)), CHUNK_SIZE, salt="held-others")
            for i in range(0, len(others), 8):
                ctx.submit_store(others[i:i + 8], list(range(BLOCKS_PER_CHUNK, 2 * BLOCKS_PER_CHUNK)) * 8).result(30)
            assert c.status().arena.chunks < len(others), "the arena is larger than the test assumes"
            assert wait_until(lambda: "writers not held now: 0" in srv.log(), timeout=30), "the replacement was held"
            t = _tier(c)
            assert (t.writers, t.writers_held) == (0, 2), t  # the first writer and the one started in its place
            shown = subprocess.run([sys.executable, "-m", "kvxfer", "status", "--url", srv.url], capture_output=True,
                                   text=True, timeout=60)
            assert "writers: 0 (2 more held by the store plugin" in shown.stdout, shown.stdout + shown.stderr
            fault.unlink()  # the held writers come back
            assert wait_until(lambda: (t := _tier(c)).queue_depth == 0 and t.pinned_bytes == 0, timeout=30)
            assert wait_until(lambda: ((t := _tier(c)).writers, t.writers_held) == (2, 0), timeout=30), _tier(c)
            time.sleep(0.5)
            c.clear("held")
            lease = c.lookup_and_lease("held", hashes=[first], lease_s=30)
            if lease.hits:  # written after all: it must be the first chunk's bytes
                dst = list(range(2 * BLOCKS_PER_CHUNK, 3 * BLOCKS_PER_CHUNK))
                assert ctx.submit_retrieve([first], dst, lease_id=lease.lease_id).result(30).loaded == [0]
                for layer in kv:
                    assert torch.equal(layer[:, dst], layer[:, :BLOCKS_PER_CHUNK]), "another chunk's bytes loaded"
            written = _tier(c).writes
            (last,) = chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE, salt="held-last")
            assert ctx.submit_store([last], list(range(BLOCKS_PER_CHUNK))).result(30).stored == [0]
            assert wait_until(lambda: _tier(c).writes > written, timeout=30), "no writer writes again"
            ctx.close()
    finally:
        fault.unlink(missing_ok=True)


def _only_in_l2(c: CacheClient, model: str, n: int = 2) -> list[bytes]:
    """``n`` chunks of ``model`` stored, written to L2 and cleared from L1."""
    kv = c.register(flash_attn_kv(num_blocks=32), model_name=model, block_size=BLOCK_SIZE, transport="cpu_gather")
    hashes = chunk_hashes(list(range(n * CHUNK_SIZE)), CHUNK_SIZE, salt=model)
    assert kv.submit_store(hashes, list(range(n * BLOCKS_PER_CHUNK))).result(30).stored == list(range(n))
    wait_until(lambda: (t := _tier(c)).writes == n and t.queue_depth == 0, timeout=30)
    assert c.clear(model) == n
    return hashes


def test_a_second_stop_signal_ends_a_server_whose_loop_a_plugin_holds(test_plugin_path: Path, tmp_path: Path) -> None:
    """A store's submit_get that never returns holds the server's loop (submits must return at
    once): no client is answered and SIGTERM, which asks the loop to stop, did nothing. A second
    SIGTERM exits at once, logging where the loop is."""
    l2 = tmp_path / "l2"
    fault = Path(f"{l2}.fault")
    srv = _stuck_server(test_plugin_path, l2)
    try:
        with srv, CacheClient(srv.url, timeout=30) as c:
            hashes = _only_in_l2(c, "held")
            _set_fault(fault, "submit_get_blocks")
            asker = threading.Thread(target=_lookup_quietly, args=(srv.url, hashes), daemon=True)
            asker.start()
            wait_until(lambda: _loop_held(srv.url), timeout=30)
            assert srv.proc is not None
            srv.proc.send_signal(signal.SIGTERM)
            time.sleep(1.0)
            assert srv.proc.poll() is None, "the loop is held: the first signal cannot stop it"
            srv.proc.send_signal(signal.SIGTERM)
            assert srv.proc.wait(15) == 1
            log = srv.log()
            assert "a second SIGTERM before the server stopped: exiting at once" in log and "submit_get" in log, log
    finally:
        fault.unlink(missing_ok=True)


def _lookup_quietly(url: str, hashes: list[bytes]) -> None:
    with contextlib.suppress(KvxferError), CacheClient(url, timeout=30) as c:
        c.lookup_and_lease("held", hashes=hashes, lease_s=30)


def _loop_held(url: str) -> bool:
    """Whether the server at ``url`` leaves a status request unanswered for a second."""
    try:
        with CacheClient(url, timeout=1, connect_timeout=1) as c:
            c.status()
    except KvxferError:
        return True
    return False


def test_a_backend_that_closes_with_gets_running_does_not_hold_the_exit(test_plugin_path: Path,
                                                                         tmp_path: Path) -> None:
    """A backend whose close() returned while a get still ran in it left ``kvxfer serve`` alive
    after its last line: Python waits for the plugin's threads at exit. The server says so and
    exits without them."""
    l2 = tmp_path / "l2"
    fault = Path(f"{l2}.fault")
    srv = _stuck_server(test_plugin_path, l2)
    srv.stop_timeout = 60
    try:
        with srv, CacheClient(srv.url, timeout=30) as c:
            hashes = _only_in_l2(c, "late")
            _set_fault(fault, "get_hangs_close_returns")
            assert c.lookup_and_lease("late", hashes=hashes, lease_s=30).l2_hits == 2  # its promotion hangs
            assert srv.stop() == 0
            assert "closed with gets still running in it: the server exits without them" in srv.log()
    finally:
        fault.unlink(missing_ok=True)


def test_a_submit_that_blocks_the_loop_is_reported(test_plugin_path: Path, tmp_path: Path) -> None:
    """A ``submit_exists`` that does its work before it returns holds the server's loop, and so
    every client, for as long (the store kit cannot tell it from a fast store): the server logs
    how long, once a second at most."""
    l2 = tmp_path / "l2"
    with _server(test_plugin_path, l2) as srv, CacheClient(srv.url, timeout=30) as c:
        _set_fault(Path(f"{l2}.fault"), "exists_blocks")
        hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt="blocks")
        for _ in range(6):  # 0.3 s of blocked loop
            c.lookup_and_lease("faulty", hashes=hashes, lease_s=1, promote=False)
        wait_until(lambda: "submit_exists took" in srv.log(), timeout=10)
        assert srv.log().count("submit_exists took") < 6, "once a second at most"
        assert "a submit must return at once" in srv.log()


def test_a_fault_in_stats_does_not_take_l2_down(test_plugin_path: Path, tmp_path: Path) -> None:
    """``stats()`` raising is the plugin's bug, not the store gone: its data operations work, so
    the tier stays up (before, it went down every few seconds, its breaker opened by the health
    thread's stats calls); the figures are left out, and status says why (it showed "size: -")."""
    l2 = tmp_path / "l2"
    _set_fault(Path(f"{l2}.fault"), "stats_raises")
    with _server(test_plugin_path, l2) as srv, CacheClient(srv.url, timeout=30) as c:
        deadline = time.monotonic() + 7  # the health thread asks for stats every few seconds
        while time.monotonic() < deadline:
            t = _tier(c)
            assert t.state == "up" and t.outages == 0 and t.errors == 0, t
            time.sleep(0.25)
        assert list(t.store_stats) == ["unknown"] and "stats exploded" in t.store_stats["unknown"], t.store_stats


def test_a_put_that_writes_into_its_parts_changes_no_chunk_in_l1(test_plugin_path: Path, tmp_path: Path) -> None:
    """A put's parts are the arena's slots of chunks readers load meanwhile: the server hands
    them to the plugin read-only, so a plugin that writes into them (here: flips a byte; one
    that transforms a value in place and back is no better while loads read it) fails that
    write, counted as a store error, and changes nothing of the chunks in L1. Before, the flip
    landed in the arena, and every later load of those chunks returned it, reported good."""
    l2 = tmp_path / "l2"
    _set_fault(Path(f"{l2}.fault"), "put_writes_parts")
    src = flash_attn_kv(num_blocks=32, seed=3)
    with _server(test_plugin_path, l2) as srv, CacheClient(srv.url, timeout=30) as c:
        ctx = c.register(src, model_name="put-writes", block_size=BLOCK_SIZE, transport="cpu_gather")
        hashes = chunk_hashes(list(range(4 * CHUNK_SIZE)), CHUNK_SIZE, salt="put-writes")
        assert ctx.submit_store(hashes, list(range(4 * BLOCKS_PER_CHUNK))).result(30).stored == [0, 1, 2, 3]
        wait_until(lambda: _tier(c).errors >= 1 and _tier(c).queue_depth == 0, timeout=30)
        assert _tier(c).writes == 0 and _internal_errors(c) == 0, _tier(c)
        dst = flash_attn_kv(num_blocks=32, seed=9)
        dctx = c.register(dst, model_name="put-writes", block_size=BLOCK_SIZE, transport="cpu_gather")
        res = dctx.submit_retrieve(hashes, list(range(4 * BLOCKS_PER_CHUNK))).result(30)
        assert res.loaded == [0, 1, 2, 3]
        for a, b in zip(src, dst):
            assert torch.equal(a[:, :4 * BLOCKS_PER_CHUNK], b[:, :4 * BLOCKS_PER_CHUNK]), "a chunk in L1 changed"
        dctx.close()
        ctx.close()


def test_a_ping_that_never_returns_takes_l2_down_and_it_comes_back(test_plugin_path: Path, tmp_path: Path) -> None:
    """The health thread waits for the plugin's ``ping()`` at most ``--l2-timeout`` + 1 s: one
    that does not return counts as failed (and is not called again until it has), so the tier
    goes down, naming the stuck call, and comes back once the plugin answers again. Before, the
    health thread waited in it for good: the tier said up, and once down it never probed again."""
    l2 = tmp_path / "l2"
    fault = Path(f"{l2}.fault")
    _set_fault(fault, "ping_hangs")
    with _server(test_plugin_path, l2) as srv, CacheClient(srv.url, timeout=30) as c:
        wait_until(lambda: _tier(c).state == "down", timeout=30)
        assert "has not returned" in srv.log()
        _set_fault(fault, "")
        wait_until(lambda: _tier(c).state == "up", timeout=30)


def test_a_fault_in_open_stops_serve_naming_the_store(test_plugin_path: Path, tmp_path: Path) -> None:
    """``open()`` may raise ConfigError (a bad URL) or StoreUnavailable (no answer: L2 starts down
    and is retried); anything else is a fault of the plugin, which no retry mends."""
    l2 = tmp_path / "l2"
    _set_fault(Path(f"{l2}.fault"), "open_raises")
    out = subprocess.run([sys.executable, "-m", "kvxfer", "serve", "--url", f"ipc://{tmp_path}/s.sock", "--l1-size",
                          "8MiB", "--l2", "test_faulty", "--l2-url", f"file://{l2}"],
                         capture_output=True, text=True, timeout=120, env=env_with(test_plugin_path))
    assert out.returncode == 2, out.stderr
    assert "store 'test_faulty': open() raised ValueError: open exploded (a fault of the store plugin" in out.stderr


def test_a_probe_that_breaks_its_contract_is_the_plugins_fault_alone(test_plugin_path: Path, tmp_path: Path) -> None:
    """A store whose ``probe()`` returns something other than a Probe crashed ``kvxfer plugins``
    (every plugin's listing) and ``kvxfer serve --l2`` with a traceback: it is listed as
    unavailable, saying what its probe returned, and ``serve`` stops with that message."""
    env = env_with(test_plugin_path)
    out = subprocess.run([sys.executable, "-m", "kvxfer", "plugins", "--json"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 1, out.stderr  # (the test transports include broken ones)
    stores = {p["name"]: p for p in json.loads(out.stdout)["stores"]}
    assert stores["test_wrongprobe"]["health"] == "unavailable"
    assert "probe() returned True, not a kvxfer Probe" in stores["test_wrongprobe"]["detail"]
    assert stores["fs"]["health"] == "available" and stores["test_faulty"]["health"] == "available"
    out = subprocess.run([sys.executable, "-m", "kvxfer", "serve", "--url", f"ipc://{tmp_path}/s.sock", "--l1-size",
                          "8MiB", "--l2", "test_wrongprobe", "--l2-url", f"file://{tmp_path}/l2"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and "probe() returned True, not a kvxfer Probe" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


_KIT_MUTANTS = '''
import pytest
from pathlib import Path
from kvxfer.testing import StoreConformance


def _url(tmp_path_factory, fault="", options=""):
    root = tmp_path_factory.mktemp("store") / "l2"
    if fault:
        Path(f"{root}.fault").write_text(fault)
    return f"file://{root}{options}"


class TestSharedClaim(StoreConformance):  # claims to be shared; a directory held by one process is not
    store = "test_sharedclaim"

    @pytest.fixture(scope="class")
    @classmethod
    def store_url(cls, tmp_path_factory):
        return _url(tmp_path_factory)


class TestSmallBudget(StoreConformance):  # a 32 MiB budget: less than the 64 MiB value the kit puts (fs claims 1 TiB values)
    store = "fs"

    @pytest.fixture(scope="class")
    @classmethod
    def store_url(cls, tmp_path_factory):
        return _url(tmp_path_factory, options="?max_size=32MiB")


class TestWrongProbe(StoreConformance):  # its probe() returns True
    store = "test_wrongprobe"
'''
#: (class, fault of the test_faulty store, what it does wrong): a kit class each, as above
_FAULTY = [
    ("TestShortExists", "exists_short", "existence checks one size short"),
    ("TestFlippedGet", "get_flips", "gets flip the last byte of a value"),
    ("TestPutWrites", "put_writes_parts", "puts write into their parts"),
    ("TestPingHangs", "ping_hangs", "ping() never returns while the fault file says so"),
    ("TestGetCached", "get_cached", "gets answered from a copy kept at an earlier get"),
    ("TestGetShortHits", "get_short_hits", "a get into longer parts answers HIT"),
    ("TestGetWritesLate", "get_writes_late", "gets write into their parts again after they ended"),
    ("TestPutTorn", "put_torn", "puts replace a value in two steps"),
    ("TestPutKeepsParts", "put_keeps_parts", "gets answered from the parts of an earlier put"),
    ("TestDeleteKeepsGets", "delete_keeps_gets", "deleted values still read"),
    ("TestCloseReturnsEarly", "close_returns_early", "close() does not wait for operations"),
    ("TestSubmitAfterCloseRaw", "submit_after_close_raw", "a put after close() raises RuntimeError"),
    ("TestCloseKeepsThreads", "close_keeps_threads", "close() leaves its threads running"),
]
_KIT_MUTANTS += "".join(f'''

class {cls}(StoreConformance):  # {what}
    store = "test_faulty"

    @pytest.fixture(scope="class")
    @classmethod
    def store_url(cls, tmp_path_factory):
        return _url(tmp_path_factory, fault="{fault}")
''' for cls, fault, what in _FAULTY)


def test_the_store_kit_fails_a_store_that_breaks_the_contract(test_plugin_path: Path, tmp_path: Path) -> None:
    """The store kit run against stores that break a claim or the contract (one pytest run, a
    class each, as a plugin's own tests subclass the kit): each fails, in the kit test that checks
    it, and says what it saw."""
    (tmp_path / "test_mutants.py").write_text(_KIT_MUTANTS)
    expected = (("TestSharedClaim", "test_kit_a_shared_store_is_shared_with_another_process"),
                ("TestShortExists", "test_kit_absent_keys_have_size_zero_and_get_as_miss"),
                ("TestSmallBudget", "test_kit_large_value_round_trips"),
                ("TestFlippedGet", "test_kit_put_then_get_into_parts_exactly"),
                ("TestPutWrites", "test_kit_put_then_get_into_parts_exactly"),
                ("TestPingHangs", "test_kit_submits_and_health_calls_return_in_time"),
                ("TestWrongProbe", "test_kit_plugin_declares_the_contract"),
                ("TestGetCached", "test_kit_overwrite_replaces_the_value_whole"),
                ("TestGetShortHits", "test_kit_wrong_size_is_reported_and_the_backend_keeps_working"),
                ("TestGetWritesLate", "test_kit_put_then_get_into_parts_exactly"),
                ("TestPutTorn", "test_kit_a_value_read_while_it_is_replaced_is_whole"),
                ("TestPutKeepsParts", "test_kit_put_then_get_into_parts_exactly"),
                ("TestDeleteKeepsGets", "test_kit_delete_removes_values"),
                ("TestCloseReturnsEarly", "test_kit_close_ends_every_operation_and_later_submits_raise"),
                ("TestSubmitAfterCloseRaw", "test_kit_close_ends_every_operation_and_later_submits_raise"),
                ("TestCloseKeepsThreads", "test_kit_leaves_no_thread_or_descriptor_behind"))
    # each class runs the kit test that must catch it (and TestShortExists the one fs skips); the
    # two that wait out the kit's limits (a hung ping, threads left after close) in runs of their own,
    # beside the rest: every run fails, each for its own mutants
    slow = ("TestPingHangs", "TestCloseKeepsThreads")
    runs = [[e for e in expected if e[0] == cls] for cls in slow] + [[e for e in expected if e[0] not in slow]]
    procs = []
    for i, group in enumerate(runs):
        only = " or ".join(f"({cls} and {test})" for cls, test in group)
        if i == len(runs) - 1:
            only += " or (TestShortExists and test_kit_a_shared_store_is_shared_with_another_process)"
        procs.append(subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
                                       "test_mutants.py", "-k", only], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env_with(test_plugin_path), cwd=tmp_path))
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:  # none left running on a timeout
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, group, (stdout, stderr) in zip(procs, runs, outs):
        assert p.returncode == 1, (group, stdout + stderr)
    stdout = "\n".join(o for o, _ in outs)
    failed = [line for line in stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    assert len(failed) == len(expected), stdout
    for cls, test in expected:
        assert any(f"{cls}::{test}" in line for line in failed), (cls, test, stdout)
    assert "1 skipped" in outs[-1][0], outs[-1][0]
    assert not any("TestShortExists::test_kit_a_shared" in line for line in failed), "fs claims no sharing: skipped"
    assert "probe() returned True, not a kvxfer Probe" in stdout and "[0, 0] == [0, 0, 0]" in stdout, stdout
    assert ("value 0 of 5, read into two parts: the get returned other bytes than were put: 1192 bytes read, 1192 "
            "put, first difference at byte 1191") in stdout, stdout
    assert "the parts of put 0 of 5 were written into: a put only reads its parts" in stdout, stdout
    assert "ping() did not return within 6 s" in stdout, stdout
    for said in ("a value read after a put replaced one of the same size that had been read",
                 "a get into parts one byte longer than the value must be WRONG_SIZE",
                 "get 0 of 5 wrote into its parts after its future was done",
                 "a put must replace a value atomically",
                 "read after the parts it was put from changed",
                 "a get of a deleted value must be a miss",
                 "operations still ran after close() returned",
                 "submit_put after close() raised RuntimeError",
                 "thread(s) left after close()"):
        assert said in stdout, (said, stdout)


def test_the_store_kit_fails_a_backend_whose_close_never_returns() -> None:
    """The kit's backend fixture closed its backend without a limit: a backend with an operation
    that never ended hung the whole kit run, with no report."""
    import threading

    from kvxfer.testing.stores import _close_within

    release = threading.Event()

    class Stuck:
        def close(self) -> None:
            release.wait(60)

    try:
        with pytest.raises(pytest.fail.Exception, match=r"close\(\) did not return within 0.5 s"):
            _close_within(Stuck(), 0.5)  # type: ignore[arg-type]
    finally:
        release.set()


@pytest.mark.parametrize("transport", ["cpu_gather", "file_debug"])
def test_a_store_of_chunks_being_promoted_waits_a_little_and_stores_what_the_promotion_lost(
        test_plugin_path: Path, tmp_path: Path, transport: str) -> None:
    """A store of chunks whose promotion from L2 is under way (another engine's lookup started it)
    was answered "present" at once, before their bytes were in L1. When the promotion then failed
    (here: the value turned out damaged), the chunks were in neither tier while the storing engine
    was told they were stored. Now the store waits for the promotion, at most STORE_WAIT_S (a
    stuck get would hold it, and a server-driven store its instance's transfers, until the tier
    gave the get up), reports the chunks still promoting then as not stored, and stores what a
    failed promotion lost (client-driven and server-driven stores alike)."""
    l2 = tmp_path / "l2"
    fault = Path(f"{l2}.fault")
    with _stuck_server(test_plugin_path, l2, transports=f"cpu_gather,{transport}") as srv, \
            CacheClient(srv.url, timeout=30) as c:
        kv = c.register(flash_attn_kv(num_blocks=32), model_name="promoting", block_size=BLOCK_SIZE,
                        transport=transport)
        hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt=f"promoting-{transport}")
        blocks = list(range(2 * BLOCKS_PER_CHUNK))
        assert kv.submit_store(hashes, blocks).result(30).stored == [0, 1]
        wait_until(lambda: (t := _tier(c)).writes == 2 and t.queue_depth == 0, timeout=30)
        assert c.clear("promoting") == 2
        _set_fault(fault, "get_hangs")
        lease = c.lookup_and_lease("promoting", hashes=hashes, lease_s=30)
        assert (lease.hits, lease.l2_hits) == (2, 2) and _tier(c).promoting == 2
        # the get hangs (the tier gives it up after 2.8 s): the store waits STORE_WAIT_S, no more
        result = kv.submit_store(hashes, blocks).result(30)
        assert (result.stored, result.present, result.failed) == ([], [], [0, 1])
        assert _tier(c).promoting == 2, "answered while the get still hangs"
        store = kv.submit_store(hashes, blocks)
        _set_fault(fault, "get_flips")  # the gets end with damaged values: the promotion fails
        result = store.result(30)
        assert (result.stored, result.present, result.failed) == ([0, 1], [], [])
        c.release_lease(lease.lease_id)
        assert c.lookup("promoting", hashes=hashes) == 2 and c.status().arena.chunks == 2
        got = kv.submit_retrieve(hashes, list(range(2 * BLOCKS_PER_CHUNK, 4 * BLOCKS_PER_CHUNK))).result(30)
        assert got.loaded == [0, 1]
        assert _internal_errors(c) == 0 and srv.proc.poll() is None


def test_a_tier_that_went_down_shows_no_size(test_plugin_path: Path, tmp_path: Path) -> None:
    """The store's size is read every few seconds while the tier is up; once requests take it down,
    status showed the last size read, from before the outage, for as long as it lasted
    (docs/l2.md: a store that is down shows no size)."""
    l2 = tmp_path / "l2"
    with _server(test_plugin_path, l2) as srv, CacheClient(srv.url, timeout=30) as c:
        wait_until(lambda: bool(_tier(c).store_stats), timeout=30)
        kv = c.register(flash_attn_kv(num_blocks=32), model_name="gone", block_size=BLOCK_SIZE, transport="cpu_gather")
        _set_fault(Path(f"{l2}.fault"), "exists_raises")  # its writers' checks fail: down until a probe
        deadline = time.monotonic() + 30
        while (t := _tier(c)).state != "down":  # (one status: the state and the size of one moment)
            assert time.monotonic() < deadline, t
            kv.submit_store(chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE, salt=f"{time.monotonic()}"),
                            list(range(BLOCKS_PER_CHUNK))).result(30)
            time.sleep(0.05)
        assert t.store_stats == {}, t
