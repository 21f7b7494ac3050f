"""Client-driven copies that return a waiter: the commit waits for it off the worker thread.

A real server and a real cpu_gather context; its gather/scatter are wrapped (the real copy runs
first) so that they return a waiter that blocks, or fails, as a device copy still in flight
would. The hpu plugin returns waiters on its staging path; the conformance kit runs it on CPU.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from kvxfer import CacheClient, TransportFailed, chunk_hashes
from kvxfer_core_helpers import BLOCK_SIZE, BLOCKS_PER_CHUNK, CHUNK_SIZE, flash_attn_kv, wait_until


class CopyFailed(RuntimeError):
    pass


def _with_waiter(ctx, name: str, wait: Callable[[], None], log: list[str] | None = None) -> None:
    copy = getattr(ctx, name)

    def copy_then_wait(copies, transfer):
        copy(copies, transfer)
        if log is not None:
            log.append(f"{name} queued")

        def waiter() -> None:
            wait()
            if log is not None:
                log.append(f"{name} done on {threading.current_thread().name}")

        return waiter

    setattr(ctx, name, copy_then_wait)


def _register(client: CacheClient, model: str):
    kv = flash_attn_kv(num_blocks=32, seed=hash(model) % 1000)
    return kv, client.register(kv, model_name=model, block_size=BLOCK_SIZE, transport="cpu_gather")


def _chunk(kv: list[torch.Tensor], chunk: int) -> list[torch.Tensor]:
    sl = slice(chunk * BLOCKS_PER_CHUNK, (chunk + 1) * BLOCKS_PER_CHUNK)
    return [layer[:, sl].clone() for layer in kv]


def test_a_slow_waiter_delays_the_commit_not_the_next_copy(client: CacheClient) -> None:
    kv, ctx = _register(client, "waiter-slow")
    log: list[str] = []
    release = threading.Event()  # the "device copy" of both stores ends only when the test says
    _with_waiter(ctx, "gather", lambda: release.wait(30), log)
    hashes = chunk_hashes(list(range(4 * CHUNK_SIZE)), CHUNK_SIZE, salt="slow")
    first = ctx.submit_store(hashes[:2], list(range(2 * BLOCKS_PER_CHUNK)))
    second = ctx.submit_store(hashes[2:], list(range(2 * BLOCKS_PER_CHUNK, 4 * BLOCKS_PER_CHUNK)))
    dst = list(range(4 * BLOCKS_PER_CHUNK, 8 * BLOCKS_PER_CHUNK))
    back = ctx.submit_retrieve(hashes, dst)  # right away: must still see both stores
    assert wait_until(lambda: log.count("gather queued") == 2, timeout=30, step=0.01), log  # both queued, the first still waits
    assert not first.done() and not second.done() and not back.done()
    release.set()
    assert first.result(30).stored == [0, 1] and second.result(30).stored == [0, 1]
    assert back.result(30).loaded == [0, 1, 2, 3]
    for c in range(4):
        assert all(torch.equal(a, b) for a, b in zip(_chunk(kv, 4 + c), _chunk(kv, c)))
    # the worker queued the second copy while the first one's waiter still ran, on the finisher
    assert log == ["gather queued", "gather queued"] + ["gather done on kvxfer-cpu_gather-commit_0"] * 2, log
    ctx.close()


def test_a_failing_waiter_fails_the_store_and_stores_nothing(client: CacheClient) -> None:
    kv, ctx = _register(client, "waiter-fails")

    def fail() -> None:
        raise CopyFailed("device copy failed")

    _with_waiter(ctx, "gather", fail)
    hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt="fails")
    with pytest.raises(TransportFailed, match="'cpu_gather' failed in gather \\(waiter\\): CopyFailed: device copy") as info:
        ctx.submit_store(hashes, list(range(2 * BLOCKS_PER_CHUNK))).result(30)
    assert isinstance(info.value.__cause__, CopyFailed)
    assert client.lookup("waiter-fails", hashes=hashes) == 0
    assert client.status().reservations == 0
    ctx.close()
    kv2, again = _register(client, "waiter-fails")
    assert again.submit_store(hashes, list(range(2 * BLOCKS_PER_CHUNK))).result(30).stored == [0, 1]
    again.close()


def test_a_failing_read_waiter_fails_the_retrieve_and_unpins(client: CacheClient) -> None:
    kv, ctx = _register(client, "waiter-read")
    hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt="read")
    assert ctx.submit_store(hashes, list(range(2 * BLOCKS_PER_CHUNK))).result(30).stored == [0, 1]

    def fail() -> None:
        raise CopyFailed("device copy failed")

    _with_waiter(ctx, "scatter", fail)
    with pytest.raises(TransportFailed, match="failed in scatter \\(waiter\\)") as info:
        ctx.submit_retrieve(hashes, list(range(2 * BLOCKS_PER_CHUNK, 4 * BLOCKS_PER_CHUNK))).result(30)
    assert isinstance(info.value.__cause__, CopyFailed)
    assert client.status().reservations == 0  # unpinned: the chunks can be cleared
    assert client.clear("waiter-read") == 2
    ctx.close()


def test_close_waits_for_commits_left_to_the_finisher(client: CacheClient) -> None:
    kv, ctx = _register(client, "waiter-close")
    _with_waiter(ctx, "gather", lambda: time.sleep(0.5))
    hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt="close")
    fut = ctx.submit_store(hashes, list(range(2 * BLOCKS_PER_CHUNK)))
    ctx.close()
    assert fut.done() and fut.result().stored == [0, 1]
    assert client.lookup("waiter-close", hashes=hashes) == 2


EXIT_WITH_REQUESTS_QUEUED = """
import sys, time
from kvxfer import CacheClient, TransportFailed, chunk_hashes
from kvxfer_core_helpers import BLOCK_SIZE, BLOCKS_PER_CHUNK, CHUNK_SIZE, flash_attn_kv, wait_until
client = CacheClient(sys.argv[1], timeout=10)
kv = flash_attn_kv(num_blocks=32)
ctx = client.register(kv, model_name="waiter-exit", block_size=BLOCK_SIZE, transport="cpu_gather")
copy = ctx.gather
def slow(copies, transfer):
    time.sleep(0.3)  # a slow device copy
    copy(copies, transfer)
    return lambda: time.sleep(0.05)
ctx.gather = slow
hashes = chunk_hashes(list(range(8 * CHUNK_SIZE)), CHUNK_SIZE, salt="exit")
for c in range(6):
    ctx.submit_store([hashes[c]], list(range(c * BLOCKS_PER_CHUNK, (c + 1) * BLOCKS_PER_CHUNK)))
ctx.submit_retrieve([hashes[0]], list(range(28, 32)))
print("leaving with requests queued", flush=True)
"""


def test_the_process_exits_with_requests_left_to_the_finisher(server, tmp_path) -> None:
    """No close(): at interpreter exit the finisher takes no more work; the worker's queued
    requests give up instead of waiting for commits that will never be sent."""
    import subprocess
    import sys
    from pathlib import Path

    from kvxfer_core_helpers import env_with

    out = subprocess.run([sys.executable, "-c", EXIT_WITH_REQUESTS_QUEUED, server.url], capture_output=True,
                         text=True, timeout=60, env=env_with(Path(__file__).resolve().parent))
    assert "leaving with requests queued" in out.stdout, out.stderr


def test_callbacks_may_submit_on_the_same_context(client: CacheClient) -> None:
    """A future's callbacks run on the context's finisher, never on a thread that holds the
    context's locks: a callback that submits the next request on the same context chains on."""
    kv, ctx = _register(client, "waiter-chain")
    hashes = chunk_hashes(list(range(8 * CHUNK_SIZE)), CHUNK_SIZE, salt="chain")
    done = threading.Event()
    results: list[object] = []

    def step(i: int) -> None:
        fut = (ctx.submit_store([hashes[i // 2]], list(range(BLOCKS_PER_CHUNK))) if i % 2 == 0 else
               ctx.submit_retrieve([hashes[i // 2]], list(range(BLOCKS_PER_CHUNK, 2 * BLOCKS_PER_CHUNK))))

        def next_step(f) -> None:
            results.append(f.result())
            if i + 1 < 16:
                step(i + 1)
            else:
                done.set()

        fut.add_done_callback(next_step)

    step(0)
    assert done.wait(60), f"the chain stopped after {len(results)} requests"
    assert [getattr(r, "stored", None) or getattr(r, "loaded", None) for r in results] == [[0]] * 16
    ctx.close()


def test_callbacks_run_on_the_finisher_whichever_thread_completes(client: CacheClient) -> None:
    """A store completes on the thread that reads its commit's reply, a retrieve on the worker
    that copied it (a caller waiting in result() wakes at once); their callbacks still run on
    the context's finisher."""
    kv, ctx = _register(client, "waiter-callback-thread")
    hashes = chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE, salt="callback-thread")
    threads: list[str] = []
    seen = threading.Event()

    def record(f) -> None:
        threads.append(threading.current_thread().name)
        seen.set()

    for fut in (ctx.submit_store(hashes, list(range(BLOCKS_PER_CHUNK))),
                ctx.submit_retrieve(hashes, list(range(BLOCKS_PER_CHUNK, 2 * BLOCKS_PER_CHUNK)))):
        seen.clear()
        fut.add_done_callback(record)
        fut.result(30)
        assert seen.wait(30)
    assert threads == ["kvxfer-cpu_gather-commit_0"] * 2, threads
    ctx.close()


def test_a_callback_that_raises_is_logged(client: CacheClient, caplog: pytest.LogCaptureFixture) -> None:
    kv, ctx = _register(client, "waiter-callback-raises")
    hashes = chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE, salt="callback-raises")
    fut = ctx.submit_store(hashes, list(range(BLOCKS_PER_CHUNK)))

    def fail(f) -> None:
        raise RuntimeError("a caller's callback failed")

    fut.add_done_callback(fail)
    assert fut.result(30).stored == [0]
    wait_until(lambda: "a caller's callback failed" in caplog.text, 10)
    assert "exception calling callback" in caplog.text
    ctx.close()
    fut.add_done_callback(fail)  # after close: runs on the calling thread, logged all the same


class _HeldCommits:
    """A spy on a context's real connection: the replies to its commits of one kind reach the
    core only once :meth:`release` is called; ``done_when_submitted`` records, at each such
    commit's submission, whether the future in ``fut`` was done already."""

    def __init__(self, ctx, commit: str) -> None:
        self.conn, self.commit = ctx.connection, commit
        self.submit = self.conn.submit
        self.answered = threading.Event()
        self.done_when_submitted: list[bool | None] = []
        self.holders: list[threading.Thread] = []
        self.fut: Future[Any] | None = None

    def __enter__(self) -> _HeldCommits:
        self.conn.submit = self.spy
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
        del self.conn.submit
        for t in self.holders:
            t.join(30)

    def release(self) -> None:
        self.answered.set()

    def spy(self, payload, timeout=None):
        reply = self.submit(payload, timeout)
        if type(payload).__name__ != self.commit:
            return reply
        self.done_when_submitted.append(None if self.fut is None else self.fut.done())
        held: Future[Any] = Future()

        def hold() -> None:
            self.answered.wait(30)
            try:
                held.set_result(reply.result(30))
            except BaseException as exc:  # noqa: BLE001  (handed on to the held future)
                held.set_exception(exc)

        self.holders.append(threading.Thread(target=hold, daemon=True))
        self.holders[-1].start()
        return held


def test_a_retrieve_resolves_once_its_commit_is_submitted_not_answered(client: CacheClient) -> None:
    """A lone load's end waits for no round trip, and what the caller sends next reaches the
    server after the unpin: the commit is submitted before the future resolves (the connection
    keeps the order of submission), and its reply (here held back by a spy on the real
    connection) is not waited for."""
    model = "waiter-commit-after"
    kv, ctx = _register(client, model)
    hashes = chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE, salt=model)
    dst = list(range(BLOCKS_PER_CHUNK, 2 * BLOCKS_PER_CHUNK))
    try:
        assert ctx.submit_store(hashes, list(range(BLOCKS_PER_CHUNK))).result(30).stored == [0]
        for _ in range(5):  # (a commit submitted before submit_retrieve returned is seen as None: again)
            with _HeldCommits(ctx, "CommitRead") as held:
                held.fut = ctx.submit_retrieve(hashes, dst)
                assert held.fut.result(10).loaded == [0]  # while its commit's reply is held back
                if held.done_when_submitted == [None]:
                    continue
                assert held.done_when_submitted == [False]  # resolved after its commit was submitted ...
                assert client.status().reservations == 0  # ... so a request sent next finds it unpinned
                break
        else:
            pytest.fail("every commit was submitted before submit_retrieve returned: nothing was observed")
    finally:
        ctx.close()
    assert all(torch.equal(layer[:, dst], want) for layer, want in zip(kv, _chunk(kv, 0)))
    assert client.status().arena.pinned_chunks == 0


def test_a_store_resolves_once_its_commit_is_answered(server, client: CacheClient) -> None:
    """A store's result is what the server's commit says, and once it resolves its chunks are
    readable from every connection, not only the storing client's: another client's lookup
    right after it finds them. (Resolving at the commit's submission, as a retrieve does, was
    measured and not kept: docs/performance.md.)"""
    model = "waiter-store-answered"
    kv, ctx = _register(client, model)
    try:
        with CacheClient(server.url) as other:
            for attempt in range(5):  # (a commit submitted before submit_store returned is seen as None: again)
                hashes = chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE, salt=f"{model}-{attempt}")
                with _HeldCommits(ctx, "CommitWrite") as held:
                    held.fut = ctx.submit_store(hashes, list(range(BLOCKS_PER_CHUNK)))
                    wait_until(lambda: held.done_when_submitted, 10)
                    time.sleep(0.2)
                    assert held.done_when_submitted in ([False], [None]) and not held.fut.done()  # waits for the answer
                    held.release()
                    assert held.fut.result(10).stored == [0]
                assert other.lookup(model, hashes=hashes) == 1
                if held.done_when_submitted == [False]:
                    break
            else:
                pytest.fail("every commit was submitted before submit_store returned: nothing was observed")
    finally:
        ctx.close()
