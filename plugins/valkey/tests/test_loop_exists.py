"""The existence checks that a server's loop sends and reads itself (``LoopExists``): answers in
order, pipelined, without blocking; a lost or restarted Valkey is noticed, never misread."""

from __future__ import annotations

import select
from pathlib import Path

from kvxfer.store import LoopExists, StoreOptions
from kvxfer_valkey import ValkeyServer, ValkeyStore


def pump(backend, results: list, want: int, timeout: float = 10.0) -> None:
    """Play the loop: wait for the loop connection to be readable, let the backend read."""
    while len(results) < want:
        fd = backend.loop_fd()
        assert fd is not None
        ready, _, _ = select.select([fd], [], [], timeout)
        assert ready, "no answer"
        backend.on_readable()


def test_checks_are_answered_in_order_and_a_lost_valkey_is_noticed(tmp_path: Path) -> None:
    with ValkeyServer(tmp_path / "v") as node:
        backend = ValkeyStore().open(node.url, StoreOptions())
        try:
            assert isinstance(backend, LoopExists) and backend.loop_fd() is not None
            backend.submit_put([(b"kvxfer:t:a", [memoryview(b"x" * 7)])]).result(10)
            results: list = []
            assert backend.exists_nowait([b"kvxfer:t:a", b"kvxfer:t:none"], results.append)
            assert backend.exists_nowait([b"kvxfer:t:none", b"kvxfer:t:a", b"kvxfer:t:a"], results.append)
            pump(backend, results, 2)
            assert results == [[7, 0], [0, 7, 7]]
            old = backend.loop_fd()
            node.kill()
            node.start()  # same port, a new process: the old connection is dead
            results.clear()
            if backend.exists_nowait([b"kvxfer:t:a"], results.append):
                ready, _, _ = select.select([old], [], [], 10)
                backend.on_readable()
                assert results == [None], "a check on a dead connection fails, it is never answered with zeros"
            assert backend.loop_fd() is None
            backend.drop_loop_fd(old)
            assert backend.submit_exists([b"kvxfer:t:a"]).result(10) == [0]  # new Valkey is empty
            assert backend.loop_fd() is not None, "a threaded check makes a new loop connection"
            results.clear()
            assert backend.exists_nowait([b"kvxfer:t:a"], results.append)
            pump(backend, results, 1)
            assert results == [[0]]
        finally:
            backend.close()
