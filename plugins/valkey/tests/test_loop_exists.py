"""The existence checks that a server's loop sends and reads itself (``LoopExists``): answers in
order, pipelined, without blocking; a lost or restarted Valkey is noticed, never misread."""

from __future__ import annotations

import select
from pathlib import Path

from kvxfer.store import LoopExists, StoreOptions
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
    from valkey.crc import key_slot

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
            # counts as absent for this check, and the health thread's ping refreshes the map
            slot = key_slot(keys[0])
            cache = backend.client.nodes_manager.slots_cache
            right = cache[slot]
            wrong = next(v for s, v in cache.items() if v[0].name != right[0].name)
            cache[slot] = wrong
            results.clear()
            assert backend.exists_nowait(keys[:3], results.append)
            pump(backend, results, 1)
            assert results == [[0, 0, 2]] and backend.redirects == 1
            backend.ping()
            results.clear()
            assert backend.exists_nowait(keys[:1], results.append)
            pump(backend, results, 1)
            assert results == [[1]], "the map was refreshed"
        finally:
            backend.close()
