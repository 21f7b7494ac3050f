"""Failed loads are truthful: a load that fails, or misses ``kvxfer.load_timeout_ms``, reports
exactly the blocks it did not fill, and a late copy never writes blocks vLLM has been told are
free again. Faults are injected between a load's submit and its completion, which real vLLM on
CPU gives no way to time: a real server stalled (SIGSTOP) or killed mid-load, driven through
the connector's worker (and, for the whole scheduler/worker flow, the replay harness).

"Written late" is checked directly: once a load is reported failed the test overwrites its
blocks (as vLLM would, reusing them), lets the stalled server go on, waits until the server has
dealt with the stale request, and checks the overwrite is intact.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from kvxfer_vllm_harness import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MiniEngine,
    Request,
    feed,
    make_vllm_config,
)

from kvxfer import CacheClient, ConfigError, chunk_hashes
from kvxfer.errors import RequestTimeout
from kvxfer.integrations.vllm import KvxferConnector, KvxferConnectorMetadata, LoadOp, StoreOp
from kvxfer.integrations.vllm._compat import KVConnectorRole
from kvxfer.testing.server import ServerProcess

CHUNK, BS, BLOCKS = 16, 4, 32
POISON = -7.0


@pytest.fixture(scope="module")
def victim() -> Iterator[ServerProcess]:
    # a long session timeout: a stalled server must not drop the session when it goes on
    srv = ServerProcess(l1_size="32MiB", chunk_size=CHUNK, transports="cpu_gather,file_debug",
                        extra_args=["--session-timeout", "60"])
    with srv:
        yield srv


@pytest.fixture
def srv(victim: ServerProcess) -> Iterator[ServerProcess]:
    if victim.proc is None or victim.proc.poll() is not None:
        victim.start()
    yield victim
    if victim.proc is not None and victim.proc.poll() is None:
        os.kill(victim.pid, signal.SIGCONT)  # never leave it stopped for the next test


def _worker(url: str, name: str, transport: str = "cpu_gather", groups: int = 1,
            **extra: object) -> tuple[KvxferConnector, dict[str, torch.Tensor]]:
    kv = {f"g{g}.l{i}": torch.randn(2, BLOCKS, BS, 2, 4) for g in range(groups) for i in range(2)}
    specs = [KVCacheGroupSpec([n for n in kv if n.startswith(f"g{g}.")], FullAttentionSpec(BS)) for g in range(groups)]
    cfg = make_vllm_config(url, model_name=name, transport=transport, **extra)
    worker = KvxferConnector(cfg, KVConnectorRole.WORKER, KVCacheConfig(BLOCKS, specs))
    worker.register_kv_caches(kv)
    return worker, kv


def _store(worker: KvxferConnector, keys: list[bytes], blocks: list[int]) -> None:
    for ctx in worker.worker.contexts.values():
        assert ctx.submit_store(keys, blocks).result(30).stored == list(range(len(keys)))


def _load(worker: KvxferConnector, op: LoadOp) -> None:
    worker.bind_connector_metadata(KvxferConnectorMetadata(CHUNK, loads=[op]))
    worker.start_load_kv(None)
    worker.clear_connector_metadata()


def _step(worker: KvxferConnector, meta: KvxferConnectorMetadata) -> None:
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    worker.clear_connector_metadata()


def _until_received(worker: KvxferConnector, rid: str, limit_s: float = 60) -> tuple[set[int], set[str]]:
    """Steps until ``rid`` is reported received; its block errors and failed requests."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        results = worker.get_transfer_results(set())
        errors = worker.get_block_ids_with_load_errors()
        if rid in results.finished_recving:
            return errors, results.failed_recving
        assert not errors and not results.failed_recving
        time.sleep(0.01)
    raise AssertionError(f"{rid} was not reported received in {limit_s} s")


def _until_log(srv: ServerProcess, needle: str, limit_s: float = 60) -> None:
    deadline = time.monotonic() + limit_s
    while needle not in srv.log():
        assert time.monotonic() < deadline, f"the server never logged {needle!r}"
        time.sleep(0.05)


def _until_reads_released(url: str, limit_s: float = 60) -> None:
    deadline = time.monotonic() + limit_s
    with CacheClient(url) as c:
        while c.status().reservations:
            assert time.monotonic() < deadline, "the stale read reservation was never released"
            time.sleep(0.05)


def test_a_stalled_client_driven_load_is_abandoned_at_its_deadline_and_never_writes_late(
        srv: ServerProcess) -> None:
    worker, kv = _worker(srv.url, "stall-cd", load_timeout_ms=200, timeout_s=30)
    try:
        keys = chunk_hashes(list(range(2 * CHUNK)), CHUNK, salt="stall-cd")
        _store(worker, keys, list(range(8)))
        dst = list(range(16, 24))
        os.kill(srv.pid, signal.SIGSTOP)  # the load's reserve goes out and gets no answer
        _load(worker, LoadOp("r", keys, dst, skip_tokens=BS))
        errors, failed = _until_received(worker, "r")
        assert errors == set(dst[1:]) and not failed  # exactly the blocks it was to write
        assert worker.worker.stats["expired_loads"] == 1
        for t in kv.values():  # vLLM reuses them
            t[:, dst] = POISON
        os.kill(srv.pid, signal.SIGCONT)  # the stale reserve is answered now, well within timeout_s
        _until_reads_released(srv.url)  # the abandoned load gave its read pins back, copying nothing
        assert all(bool((t[:, dst] == POISON).all()) for t in kv.values()), "a late load wrote reused blocks"
    finally:
        worker.shutdown()


def test_a_server_driven_load_the_client_gave_up_on_is_never_copied(srv: ServerProcess) -> None:
    """Sent before the stall, so it cannot be cancelled: the worker waits for it until the
    client's wait (timeout_s) ends, then reports it failed; the server, going on later, finds
    the client stopped waiting and copies nothing."""
    worker, kv = _worker(srv.url, "stall-sd", transport="file_debug", load_timeout_ms=100, timeout_s=1,
                         on_server_error="recompute")
    try:
        keys = chunk_hashes(list(range(2 * CHUNK)), CHUNK, salt="stall-sd")
        _store(worker, keys, list(range(8)))
        dst = list(range(16, 24))
        os.kill(srv.pid, signal.SIGSTOP)
        _load(worker, LoadOp("r", keys, dst))
        errors, _ = _until_received(worker, "r")
        assert errors == set(dst)
        assert worker.worker.stats["expired_loads"] == 0  # past its deadline, it was waited for
        for t in kv.values():
            t[:, dst] = POISON
        os.kill(srv.pid, signal.SIGCONT)
        _until_log(srv, "past the deadline its client stopped waiting at: nothing copied")
        _until_reads_released(srv.url)
        assert all(bool((t[:, dst] == POISON).all()) for t in kv.values()), "a late copy wrote reused blocks"
    finally:
        worker.shutdown()


def _store_counts(url: str, transport: str) -> tuple[int, int, int]:
    """Chunks stored, failed and abandoned by stores of ``transport``, over every model label."""
    with CacheClient(url) as c:
        traffic = [t for t in c.status().traffic if t.transport == transport]
    return (sum(t.stored_chunks for t in traffic), sum(t.failed_chunks for t in traffic),
            sum(t.abandoned_chunks for t in traffic))


def test_a_server_driven_store_the_client_gave_up_on_stores_nothing(srv: ServerProcess) -> None:
    """Sent before the stall: the client's wait (timeout_s) ends and the store fails, so vLLM may
    give its blocks to another request; the server, going on later, finds the client stopped
    waiting (Store.deadline) and copies nothing: the other request's KV never goes into the cache
    under this request's hashes. Its chunks count as abandoned, not as failed copies."""
    worker, kv = _worker(srv.url, "stall-store", transport="file_debug", timeout_s=1, on_server_error="recompute")
    try:
        keys = chunk_hashes(list(range(2 * CHUNK)), CHUNK, salt="stall-store")
        ctx = next(iter(worker.worker.contexts.values()))
        blocks = list(range(8))
        before = _store_counts(srv.url, "file_debug")
        os.kill(srv.pid, signal.SIGSTOP)
        fut = ctx.submit_store(keys, blocks)
        with pytest.raises(RequestTimeout):
            fut.result(30)
        for t in kv.values():  # vLLM reuses them
            t[:, blocks] = POISON
        os.kill(srv.pid, signal.SIGCONT)
        _until_log(srv, "a store reached its copy")
        res = ctx.submit_retrieve(keys, list(range(16, 24))).result(30)
        assert res.missing == [0, 1], "a store its client gave up on was copied after all"
        after = _store_counts(srv.url, "file_debug")
        assert [b - a for a, b in zip(before, after)] == [0, 0, 2]  # stored, failed, abandoned
    finally:
        worker.shutdown()


def test_a_preempted_requests_store_still_queued_when_the_wait_ends_is_cancelled(srv: ServerProcess) -> None:
    """vLLM preempts a request whose store is queued behind loads that wait for a stalled server:
    past the connector's wait (twice timeout_s plus 5 s) the store is cancelled, so that it never
    reads the blocks vLLM then gives to another request (it would store that request's KV under
    this one's hashes, and every later load of them would get it, with no error)."""
    worker, kv = _worker(srv.url, "preempt", timeout_s=0.5)
    try:
        keys_a = chunk_hashes(list(range(CHUNK)), CHUNK, salt="preempt-a")
        keys_p = chunk_hashes(list(range(2 * CHUNK)), CHUNK, salt="preempt-p")
        p_blocks = list(range(8, 16))
        os.kill(srv.pid, signal.SIGSTOP)
        # a store the stalled server does not commit, loads queued behind it, then the store of "p"
        _step(worker, KvxferConnectorMetadata(CHUNK, stores=[StoreOp("a", keys_a, list(range(4)))]))
        loads = [LoadOp(f"l{i}", keys_a, list(range(16 + 4 * (i % 4), 20 + 4 * (i % 4)))) for i in range(16)]
        _step(worker, KvxferConnectorMetadata(CHUNK, loads=loads, stores=[StoreOp("p", keys_p, p_blocks)]))
        dropped = worker.worker.stats["dropped_stores"]
        worker.handle_preemptions(KvxferConnectorMetadata(CHUNK, preempted=["p"]))
        assert worker.worker.stats["dropped_stores"] == dropped + 1, "the preempted request's store was not cancelled"
        for t in kv.values():  # vLLM gives p's blocks to another request
            t[:, p_blocks] = POISON
        os.kill(srv.pid, signal.SIGCONT)
        ctx = next(iter(worker.worker.contexts.values()))
        ctx.submit_store(keys_a, list(range(4))).result(30)  # the queue ahead of it has run
        res = ctx.submit_retrieve(keys_p, list(range(24, 32))).result(30)
        assert res.missing == [0, 1], "the preempted request's store ran after vLLM reused its blocks"
    finally:
        worker.shutdown()


def test_a_server_killed_mid_load_reports_exactly_the_unloaded_blocks(srv: ServerProcess) -> None:
    worker, kv = _worker(srv.url, "killed", load_timeout_ms=300, timeout_s=2, on_server_error="recompute")
    try:
        keys = chunk_hashes(list(range(3 * CHUNK)), CHUNK, salt="killed")
        _store(worker, keys, list(range(12)))
        dst = list(range(16, 28))
        srv.kill()
        _load(worker, LoadOp("r", keys, dst, skip_tokens=2 * BS))
        errors, _ = _until_received(worker, "r")
        assert errors == set(dst[2:])
    finally:
        worker.shutdown()


def test_with_several_kv_cache_groups_a_failed_load_fails_its_request(srv: ServerProcess) -> None:
    """vLLM takes no block-level errors for hybrid models (block ids are per group): the request
    is reported in failed_recving, and no block ids."""
    worker, _ = _worker(srv.url, "groups", groups=2)
    try:
        keys = chunk_hashes(list(range(2 * CHUNK)), CHUNK, salt="groups")
        ctx0 = worker.worker.contexts[0]
        assert ctx0.submit_store(keys, list(range(8))).result(30).stored == [0, 1]  # group 1 lacks them
        worker.bind_connector_metadata(KvxferConnectorMetadata(CHUNK, loads=[
            LoadOp("r", keys, list(range(16, 24)), group=0), LoadOp("r", keys, list(range(24, 32)), group=1)]))
        worker.start_load_kv(None)
        worker.clear_connector_metadata()
        errors, failed = _until_received(worker, "r")
        assert failed == {"r"} and errors == set()
    finally:
        worker.shutdown()


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_layerwise_loads_of_a_model_with_several_kv_cache_groups_are_refused(srv: ServerProcess, role: str) -> None:
    """A failed layer-by-layer (synchronous) load of a hybrid model can only be reported as a
    failed request, which vLLM ignores for a running request: it would run on blocks the load
    did not fill (seen in real vLLM). Both sides refuse the combination at start-up, naming the
    way out; one group layer by layer, and several without it, start."""
    specs = [KVCacheGroupSpec([f"g{g}.l0"], FullAttentionSpec(BS)) for g in range(2)]
    cfg = make_vllm_config(srv.url, model_name="hybrid-layerwise", layerwise=True)
    with pytest.raises(ConfigError, match="2 KV cache groups.*kvxfer.layerwise false"):
        KvxferConnector(cfg, getattr(KVConnectorRole, role), KVCacheConfig(BLOCKS, specs))
    KvxferConnector(cfg, getattr(KVConnectorRole, role), KVCacheConfig(BLOCKS, specs[:1])).shutdown()
    KvxferConnector(make_vllm_config(srv.url, model_name="hybrid-layerwise"), getattr(KVConnectorRole, role),
                    KVCacheConfig(BLOCKS, specs)).shutdown()


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_layerwise_loads_while_vllm_keeps_several_steps_in_flight_are_refused(srv: ServerProcess, role: str) -> None:
    """With async scheduling (vLLM's default on GPUs) or pipeline parallelism, vLLM schedules the
    next step before it has seen this one's results: a failed layer-by-layer load is seen only
    after the chunks computed over its unfilled blocks were stored (garbage on the server, seen
    with vLLM's own AsyncScheduler). Refused at start-up, naming the way out. And with
    kvxfer.layerwise the connector asks vLLM for piecewise CUDA graphs: a replayed full graph
    skips the per-layer waits, and attention would read blocks before their load landed."""
    specs = [KVCacheGroupSpec(["g0.l0"], FullAttentionSpec(BS))]
    cfg = make_vllm_config(srv.url, model_name="async-layerwise", layerwise=True)
    cfg.max_concurrent_batches = 2  # type: ignore[attr-defined]  # vLLM's VllmConfig property
    with pytest.raises(ConfigError, match="keeps 2 steps in flight.*kvxfer.layerwise false"):
        KvxferConnector(cfg, getattr(KVConnectorRole, role), KVCacheConfig(BLOCKS, specs))
    cfg.max_concurrent_batches = 1  # type: ignore[attr-defined]
    KvxferConnector(cfg, getattr(KVConnectorRole, role), KVCacheConfig(BLOCKS, specs)).shutdown()
    assert KvxferConnector.requires_piecewise_for_cudagraph({"kvxfer.layerwise": True})
    assert KvxferConnector.requires_piecewise_for_cudagraph({"kvxfer.layerwise": "true"})
    assert not KvxferConnector.requires_piecewise_for_cudagraph({})
    assert not KvxferConnector.requires_piecewise_for_cudagraph({"kvxfer.layerwise": False})


def test_a_stalled_load_is_recomputed_at_its_deadline_in_the_whole_flow(srv: ServerProcess) -> None:
    """The replay harness (scheduler, worker, block pool, KV checks every forward pass): the
    server stalls right after a load was planned; at the deadline the load's blocks are reported
    and recomputed (the lookup vLLM then repeats finds the server gone: recompute mode), and the
    request finishes with the KV computing gives while the server is still stopped."""
    producer = MiniEngine(make_vllm_config(srv.url, model_name="flow"), enable_prefix_caching=False)
    prompt = list(range(100, 100 + 3 * CHUNK)) + [1]
    try:
        feed(producer, [Request("p", prompt)], per_step=1)
        producer.check_drained()
    finally:
        producer.shutdown()
    consumer = MiniEngine(make_vllm_config(srv.url, model_name="flow", kv_role="kv_consumer", load_timeout_ms=200,
                                           timeout_s=1, on_server_error="recompute", retry_s=60),
                          enable_prefix_caching=False)
    stopped: list[bool] = []

    def stall(eng: MiniEngine, meta: object) -> None:
        if getattr(meta, "loads", None) and not stopped:
            os.kill(srv.pid, signal.SIGSTOP)
            stopped.append(True)

    consumer.after_build = stall
    try:
        feed(consumer, [Request("c", list(prompt))], per_step=1)
        consumer.check_drained()
        assert stopped and consumer.load_error_blocks > 0 and consumer.recomputed_tokens > 0
        assert consumer.worker.worker.stats["expired_loads"] == 1
    finally:
        os.kill(srv.pid, signal.SIGCONT)
        consumer.shutdown()


def test_leases_of_aborted_requests_are_given_back_without_waiting_for_a_stalled_server(srv: ServerProcess) -> None:
    """Requests vLLM could not admit yet hold the leases of their lookups; their HTTP clients go
    and vLLM finishes them. Each release waited for the server's answer inside the scheduler's
    step, up to kvxfer.timeout_s, and none marked the server down: with the server stalled, K
    aborts held the step K x timeout_s. Now a release is sent and not waited for; once the server
    goes on, it has them all."""
    engine = MiniEngine(make_vllm_config(srv.url, model_name="aborted", on_server_error="recompute", timeout_s=30),
                        enable_prefix_caching=False)
    try:
        prompt = list(range(100, 100 + 4 * CHUNK + 1))
        feed(engine, [Request("store-it", prompt)], per_step=1)
        engine.check_drained()
        sched = engine.scheduler.scheduler
        client = sched.link.client
        assert client is not None
        base = client.status().leases
        waiting = [Request(f"w{i}", list(prompt)) for i in range(5)]
        for r in waiting:  # asked, not admitted: each holds a lease
            assert sched.get_num_new_matched_tokens(r, 0) == (4 * CHUNK, True)
        assert client.status().leases == base + 5
        os.kill(srv.pid, signal.SIGSTOP)
        try:
            done = threading.Thread(target=lambda: [sched.request_finished(r, []) for r in waiting], daemon=True)
            done.start()
            done.join(15)  # (half of one timeout_s: not one release waited for the stalled server)
            assert not done.is_alive(), "request_finished waited for a stalled server"
        finally:
            os.kill(srv.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while client.status().leases != base and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.status().leases == base
        assert not sched.link.down
    finally:
        engine.shutdown()
