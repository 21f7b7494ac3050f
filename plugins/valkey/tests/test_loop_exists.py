"""The existence checks that a server's loop sends and reads itself (``LoopExists``): answers in
order, pipelined, without blocking; a lost or restarted Valkey is noticed, never misread."""

from __future__ import annotations

import os
import select
import socket
import time
from pathlib import Path

import pytest
from l2kit import loop_tier, wait_for
from valkey.crc import key_slot

from kvxfer.store import GetStatus, LoopExists, StoreOptions
from kvxfer_valkey import ValkeyCluster, ValkeyServer, ValkeyStore


def pump(backend, results: list, want: int, timeout: float = 10.0) -> None:
    """Play the loop: wait for loop connections to be readable, let the backend read them."""
    while len(results) < want:
        fds = backend.loop_fds()
        assert fds
        ready, _, _ = select.select(list(fds), [], [], timeout)
        assert ready, "no answer"
        for fd in ready:
            backend.on_readable(fd)


def test_checks_are_answered_in_order_and_a_lost_valkey_is_noticed(tmp_path: Path) -> None:
    with ValkeyServer(tmp_path / "v") as node:
        backend = ValkeyStore().open(node.url, StoreOptions())
        try:
            assert isinstance(backend, LoopExists) and len(backend.loop_fds()) == 1
            backend.submit_put([(b"kvxfer:t:a", [memoryview(b"x" * 7)])]).result(10)
            results: list = []
            assert backend.exists_nowait([b"kvxfer:t:a", b"kvxfer:t:none"], results.append)
            assert backend.exists_nowait([b"kvxfer:t:none", b"kvxfer:t:a", b"kvxfer:t:a"], results.append)
            pump(backend, results, 2)
            assert results == [[7, 0], [0, 7, 7]]
            (old,) = backend.loop_fds()
            node.kill()
            node.start()  # same port, a new process: the old connection is dead
            results.clear()
            if backend.exists_nowait([b"kvxfer:t:a"], results.append):
                ready, _, _ = select.select([old], [], [], 10)
                backend.on_readable(old)
                assert results == [None], "a check on a dead connection fails, it is never answered with zeros"
            else:  # the loop had not read the closed connection yet: reading it now retires it
                backend.on_readable(old)
            assert backend.loop_fds() == ()
            backend.drop_loop_fd(old)
            assert not backend.exists_nowait([b"kvxfer:t:a"], results.append), "no connection: threads answer"
            assert backend.submit_exists([b"kvxfer:t:a"]).result(10) == [0]  # new Valkey is empty
            assert len(backend.loop_fds()) == 1, "a threaded check makes a new loop connection"
            results.clear()
            assert backend.exists_nowait([b"kvxfer:t:a"], results.append)
            pump(backend, results, 1)
            assert results == [[0]]
        finally:
            backend.close()


def test_a_cluster_check_goes_to_the_nodes_that_hold_the_keys(tmp_path: Path) -> None:
    with ValkeyCluster(tmp_path / "c") as cluster:
        backend = ValkeyStore().open(cluster.url, StoreOptions())
        try:
            assert len(backend.loop_fds()) == 3, "one loop connection per primary"
            keys = [b"kvxfer:t:%d" % i for i in range(24)]  # spread over the three nodes
            nodes = {backend.client.nodes_manager.get_node_from_slot(key_slot(k)).name for k in keys}
            assert len(nodes) == 3
            backend.submit_put([(k, [memoryview(b"v" * (i + 1))]) for i, k in enumerate(keys[::2])]).result(10)
            results: list = []
            first: list = []
            assert backend.exists_nowait(keys, lambda sizes: (first.append(sizes), results.append(1)))
            assert backend.exists_nowait(keys[:1], results.append)  # may end first: another node
            pump(backend, results, 2)
            assert first == [[(i // 2 + 1) if i % 2 == 0 else 0 for i in range(24)]]
            assert [1] in results
            # a stale slot map: the node that no longer holds the slot answers MOVED; the key
            # counts as absent for this check, and the slot map is read again at once
            slot = key_slot(keys[0])
            cache = backend.client.nodes_manager.slots_cache
            right = cache[slot]
            wrong = next(v for s, v in cache.items() if v[0].name != right[0].name)
            cache[slot] = wrong
            results.clear()
            assert backend.exists_nowait(keys[:3], results.append)
            pump(backend, results, 1)
            assert results == [[0, 0, 2]] and backend.redirects == 1
            assert until_exists(backend, keys[:1]) == [1], "the map was read again"
        finally:
            backend.close()


def until_exists(backend, keys: list[bytes], timeout: float = 10.0) -> list[int]:
    """Existence checks on the loop connections until every key is found (or ``timeout``); a
    check the loop connections cannot take goes through a store thread, as the tier sends it
    (which makes missing loop connections again)."""
    deadline = time.monotonic() + timeout
    while True:
        results: list = []
        if backend.exists_nowait(keys, results.append):
            pump(backend, results, 1)
            if results[0] and all(results[0]) or time.monotonic() > deadline:
                return results[0] or []
        else:
            backend.exists(keys)
            if time.monotonic() > deadline:
                return []
        time.sleep(0.05)


def test_keys_of_a_slot_moved_to_another_node_are_found_again(tmp_path: Path) -> None:
    """Redirects are not followed (a node's reply to the client's own command path is read whole):
    a key whose slot moved is absent, and a write to it dropped, until the slot map is read
    again, which a redirect starts at once, whether or not the store is failing (the health
    thread probes only a store found down: keys of a moved slot once stayed absent for good)."""
    with ValkeyCluster(tmp_path / "c") as cluster:
        backend = ValkeyStore().open(cluster.url, StoreOptions())
        try:
            key = b"kvxfer:moving"
            assert backend.submit_put([(key, [memoryview(b"v" * 7)])]).result(10) == [True]
            assert until_exists(backend, [key]) == [7]
            slot = str(key_slot(key))
            owner = next(n for n in cluster.nodes if "MOVED" not in n.cli("GET", key.decode()))
            target = next(n for n in cluster.nodes if n is not owner)
            owner_id, target_id = (n.cli("CLUSTER", "MYID").strip() for n in (owner, target))
            target.cli("CLUSTER", "SETSLOT", slot, "IMPORTING", owner_id)
            owner.cli("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
            owner.cli("MIGRATE", "127.0.0.1", str(target.port), key.decode(), "0", "5000")
            for n in cluster.nodes:
                n.cli("CLUSTER", "SETSLOT", slot, "NODE", target_id)
            assert until_exists(backend, [key]) == [7], "the key is found on the node that holds it now"
            assert backend.redirects >= 1
            view = memoryview(bytearray(7))
            assert backend.submit_get([(key, [view])]).result(10) == [GetStatus.HIT] and bytes(view) == b"v" * 7
            assert backend.submit_put([(b"kvxfer:moving", [memoryview(b"w" * 7)])]).result(10) == [True]
        finally:
            backend.close()


def test_a_cluster_of_one_node_reads_its_slot_map_again_after_an_outage(tmp_path: Path) -> None:
    """The client's own PING, on a connection error, drops the node it asked from the nodes it
    reads the slot map from: a cluster of one node then had none left, and never read its map
    again once the node was back. The backend pings every primary through its own reader."""
    from kvxfer.errors import StoreUnavailable
    from kvxfer_valkey import ValkeyServer

    node = ValkeyServer(tmp_path / "one", cluster=True).start()
    try:
        node.cli("CLUSTER", "ADDSLOTSRANGE", "0", "16383")
        deadline = time.monotonic() + 30
        while "cluster_state:ok" not in node.cli("CLUSTER", "INFO"):
            assert time.monotonic() < deadline, "the one-node cluster did not come up"
            time.sleep(0.1)
        backend = ValkeyStore().open(node.url, StoreOptions(timeout_s=0.5, bulk_timeout_s=1.0))
        try:
            key = b"kvxfer:one"
            assert backend.submit_put([(key, [memoryview(b"x" * 5)])]).result(10) == [True]
            node.stop()
            for _ in range(3):
                with pytest.raises(StoreUnavailable):
                    backend.ping()
            node.start()
            deadline = time.monotonic() + 30
            while True:
                try:
                    backend.ping()
                    break
                except StoreUnavailable:
                    assert time.monotonic() < deadline, "the backend did not reach its node again"
                    time.sleep(0.2)
            assert backend.client.nodes_manager.startup_nodes, "the node it starts from is kept"
            while "cluster_state:ok" not in node.cli("CLUSTER", "INFO"):
                assert time.monotonic() < deadline, "the one-node cluster did not come back"
                time.sleep(0.1)
            assert backend.submit_put([(key, [memoryview(b"y" * 5)])]).result(10) == [True]
            assert backend.exists([key]) == [5]  # as the tier's store threads ask
            assert until_exists(backend, [key]) == [5]
            assert not backend._stale_topology.is_set(), "the slot map was read again"
        finally:
            backend.close()
    finally:
        node.stop()


def test_a_primary_that_fails_a_probe_has_the_slot_map_read_again(tmp_path: Path) -> None:
    """After a failover the map must be read again for the promoted replica to be found: a probe
    that fails on a primary marks the map stale (it once pinged the dead address for good, and L2
    stayed down while the cluster was healthy again)."""
    from kvxfer.errors import StoreUnavailable

    with ValkeyCluster(tmp_path / "c") as cluster:
        backend = ValkeyStore().open(cluster.url, StoreOptions(timeout_s=0.5, bulk_timeout_s=1.0))
        try:
            backend.ping()
            before = backend._last_refresh
            cluster.nodes[2].stop()
            with pytest.raises(StoreUnavailable):
                backend.ping()
            deadline = time.monotonic() + 15  # past the longest backoff of a failed reading (8 s)
            while backend._last_refresh == before:
                assert time.monotonic() < deadline, "the slot map was not read again"
                time.sleep(0.05)
        finally:
            backend.close()


def test_a_failover_to_a_replica_is_found_at_the_next_probe_and_loses_no_write(tmp_path: Path) -> None:
    """Three primaries with a replica each (never tested before; the client's failover handling
    was trusted):

    * a primary SIGKILLed: once its replica took over, the first probe finds the store up (a
      probe read the slot map only when it was marked stale, and one read during the failover
      cleared the mark: the probe after it pinged the dead node again, and the breaker's backoff
      doubled, 38 s of outage after Valkey's own with its default timeouts);
    * a graceful ``CLUSTER FAILOVER``: a put to a slot that moved is answered ``MOVED`` by the
      old primary; it is sent again once the map is read again (the first writes to every slot
      a failover moved were lost). Every value reads back whole afterwards."""
    from kvxfer.errors import StoreUnavailable

    with ValkeyCluster(tmp_path / "c", replicas=1) as cluster:
        backend = ValkeyStore().open(cluster.url, StoreOptions(timeout_s=2.0, bulk_timeout_s=1.0))
        try:
            keys = [f"kvxfer:failover:{i}".encode() for i in range(24)]  # on every primary
            assert backend.put([(k, [memoryview(k)]) for k in keys]) == [True] * len(keys)
            victim, calm = cluster.primaries()[:2]
            heir = cluster.replica_of(victim)
            cluster.wait_replicated(victim)  # (replication is asynchronous: a write not yet copied dies with it)
            victim.kill()
            with pytest.raises(StoreUnavailable):
                backend.ping()  # the dead primary
            deadline = time.monotonic() + 30
            while "role:master" not in heir.cli("info", "replication"):
                assert time.monotonic() < deadline, "the replica was not promoted"
                time.sleep(0.1)
            cluster.wait_ok()
            backend.ping()  # the first probe after the failover
            deadline = time.monotonic() + 30
            while backend._refreshing:  # (a reading of the map it started must not see what follows)
                assert time.monotonic() < deadline, "the slot map's reading thread did not end"
                time.sleep(0.05)
            # a graceful failover the backend has not seen: its map still names the old primary
            successor = cluster.replica_of(calm)
            successor.cli("cluster", "failover")
            deadline = time.monotonic() + 30
            while "role:master" not in successor.cli("info", "replication"):
                assert time.monotonic() < deadline, "the graceful failover did not happen"
                time.sleep(0.05)
            moved = [k for k in keys if backend.client.get_node_from_key(k).port == calm.port]
            assert moved, "the map the backend holds still names the old primary"
            before = backend.redirects
            again = [b"{" + k + b"}:again" for k in moved]  # (a hash tag: the same slot as k)
            assert backend.put([(k, [memoryview(k)]) for k in again]) == [True] * len(again)
            assert backend.redirects >= before + len(again), "the put met the old primary (MOVED), as it should"
            for k in keys + again:
                buf = bytearray(len(k))
                assert backend.get([(k, [memoryview(buf)])]) == [GetStatus.HIT] and bytes(buf) == k, k
        finally:
            backend.close()


def _ends(fd: int) -> tuple[int, int]:
    """(local port, peer port) of the TCP socket ``fd``."""
    with socket.socket(fileno=os.dup(fd)) as s:
        return s.getsockname()[1], s.getpeername()[1]


def test_a_node_that_is_no_longer_a_primary_loses_its_loop_connection(tmp_path: Path) -> None:
    """In process: a real L2 tier over a real cluster with replicas, and a graceful failover while
    a check is in flight on the old primary's loop connection. Loop connections were only ever
    added: the old primary's stayed open and polled by the loop until it failed, next to the new
    primary's, so a cluster whose slot map names new primaries over time (failovers, resharding,
    or a node that names new addresses at each reading) had the server hold ever more sockets.
    Now, once the slot map is read again, the loop connection of a node that is no longer a
    primary takes no new check, is read until the checks sent before end, then leaves the
    descriptors the loop polls and is closed: the loop polls one connection per primary of the
    map, and every check's keys stop counting at the store."""
    with ValkeyCluster(tmp_path / "c", replicas=1) as cluster, \
            loop_tier(cluster.url, tmp_path, timeout_s=5.0) as (tier, pump):
        def polled() -> list[int]:
            """The ports of the nodes whose loop connections the loop polls."""
            return sorted(_ends(fd)[1] for fd in tier._watched_fds)

        def primaries() -> list[int]:
            return sorted(n.port for n in cluster.primaries())

        assert wait_for(lambda: (pump(0.05), polled() == primaries())[1], 30), "one loop connection per primary"
        backend = tier._loop_exists
        victim = cluster.primaries()[0]
        heir = cluster.replica_of(victim)
        (local,) = [_ends(fd)[0] for fd in tier._watched_fds if _ends(fd)[1] == victim.port]
        assert f"addr=127.0.0.1:{local} " in victim.cli("CLIENT", "LIST")
        # a check on every primary (64 keys: some on each), its answers not read yet
        lk = tier.begin_lookup("m", 1, [os.urandom(16) for _ in range(64)], 0)
        assert lk is not None and not lk.done() and backend._loops[victim.address].pending
        heir.cli("CLUSTER", "FAILOVER")
        assert wait_for(lambda: "role:master" in heir.cli("INFO", "replication"), 30), "the failover did not happen"
        cluster.wait_ok()
        backend.ping()  # the slot map read again (as a probe or a redirect has it read)
        assert wait_for(lambda: (pump(0.05), lk.done() and tier._keys_in_flight == 0)[1], 30), \
            "the check in flight on the old primary's connection ended"

        def settled() -> bool:  # lookups go on: one for a key of the new primary makes its connection
            tier.begin_lookup("m", 1, [os.urandom(16) for _ in range(64)], 0)
            pump(0.1)
            return polled() == primaries()

        assert wait_for(settled, 30), f"the loop polls {polled()}, the primaries are {primaries()}"
        assert heir.port in polled() and victim.port not in polled()
        assert wait_for(lambda: f"addr=127.0.0.1:{local} " not in victim.cli("CLIENT", "LIST"), 30), \
            "the old primary's loop connection is closed"
        assert wait_for(lambda: (pump(0.05), tier._keys_in_flight == 0)[1], 30), "every check ended"
