"""KvxferConnector driven through vLLM's call sequence (MiniEngine) against a real server."""

from __future__ import annotations

import time

import pytest
from kvxfer_vllm_harness import MiniEngine, Request, make_vllm_config, workload

from kvxfer.errors import ConnectionFailed
from kvxfer.testing.server import ServerProcess

CHUNK = 16


def _feed(engine: MiniEngine, reqs: list[Request], per_step: int, max_steps: int = 5000) -> None:
    """Add ``per_step`` requests before each step, then run until idle. A step that computes
    nothing (waiting for loads or stores) pauses 2 ms, as an idle engine would not spin."""
    pending = list(reqs)
    for _ in range(max_steps):
        for _ in range(per_step):
            if pending:
                engine.add(pending.pop(0))
        if not pending and engine.idle():
            return
        before = sum(r.num_computed_tokens for r in engine.requests.values())
        engine.step()
        if sum(r.num_computed_tokens for r in engine.requests.values()) == before:
            time.sleep(0.002)
    raise AssertionError("workload did not finish")


def test_many_requests_misses_partial_and_full_hits(server: ServerProcess) -> None:
    # 64 blocks: the local prefix cache evicts tails of cached prefixes, so vLLM's own hit
    # often ends inside a chunk that kvxfer has
    engine = MiniEngine(make_vllm_config(server.url, model_name="replay-1"), num_blocks=64)
    try:
        reqs = workload("a", n=40)
        # a prompt of whole chunks, then the same prompt again: found in full
        whole = reqs[2].prompt_token_ids[:2 * CHUNK]
        reqs.insert(0, Request("full-0", list(whole)))
        reqs.append(Request("full-hit-0", list(whole)))
        _feed(engine, reqs, per_step=3)
        engine.check_drained()
        sched, work = engine.scheduler.scheduler.stats, engine.worker.worker.stats
        assert work["loaded_chunks"] > 0 and sched["lookup_hit_tokens"] > 0
        assert work["stored_chunks"] > 0
        assert engine.load_error_blocks == 0 and work["failed_load_blocks"] == 0
        # partial hits after vLLM's own prefix-cache hit: the load skipped vLLM's blocks
        assert any(op.skip_tokens > 0 for op in engine.loads)
        assert any(op.skip_tokens == 0 for op in engine.loads)
        # every request that held its blocks for a store was released exactly once
        assert engine.delayed and engine.delayed == engine.reported_sending
        # a prompt of whole chunks found in full: everything but its last token was loaded
        assert any(op.req_id == "full-hit-0" for op in engine.loads)
        assert engine.first_computed["full-hit-0"] == 2 * CHUNK - 1
    finally:
        engine.shutdown()


def test_without_local_prefix_cache_every_hit_comes_from_kvxfer(server: ServerProcess) -> None:
    engine = MiniEngine(make_vllm_config(server.url, model_name="replay-2"), enable_prefix_caching=False)
    try:
        first = workload("b", n=8, seed=1)
        _feed(engine, first, per_step=8)
        again = [Request(f"again-{r.request_id}", list(r.prompt_token_ids)) for r in first]
        _feed(engine, again, per_step=8)
        engine.check_drained()
        loaded = {op.req_id for op in engine.loads}
        for r in again:
            if len(r.prompt_token_ids) >= CHUNK:
                assert r.request_id in loaded, r.request_id
        assert all(op.skip_tokens == 0 for op in engine.loads)
    finally:
        engine.shutdown()


def test_preemption_keeps_kv_correct_and_frees_every_block(server: ServerProcess) -> None:
    # 40 blocks of 4 tokens for requests of up to 60 tokens: the scheduler must preempt
    engine = MiniEngine(make_vllm_config(server.url, model_name="replay-3"), num_blocks=40, token_budget=64)
    try:
        reqs = workload("c", n=24, seed=2, max_tokens=8)
        _feed(engine, reqs, per_step=6)
        engine.check_drained()
        assert engine.preemptions > 0
        assert engine.worker.worker.stats["loaded_chunks"] > 0
    finally:
        engine.shutdown()


def test_load_of_evicted_chunks_is_reported_and_recomputed(server: ServerProcess) -> None:
    """Chunks vanish between lookup and load (lease expired, cache cleared): the worker reports
    their blocks through get_block_ids_with_load_errors and vLLM recomputes them."""
    cfg = make_vllm_config(server.url, model_name="replay-4", lease_s=0.05)
    engine = MiniEngine(cfg, enable_prefix_caching=False)
    try:
        first = [Request("d-0", list(range(100, 148)))]  # three chunks
        _feed(engine, first, per_step=1)
        cleared: list[int] = []

        def clear_before_load(eng: MiniEngine, meta: object) -> None:
            if meta.loads and not cleared:
                time.sleep(0.3)  # the lease expires (the server drops expired leases every tick)
                cleared.append(eng.scheduler.scheduler.link.client.clear("replay-4"))

        engine.after_build = clear_before_load
        _feed(engine, [Request("d-1", list(range(100, 148)) + [7, 8])], per_step=1)
        engine.check_drained()
        assert cleared and cleared[0] > 0
        assert engine.load_error_blocks > 0 and engine.recomputed_tokens > 0
    finally:
        engine.shutdown()


def test_kv_roles_producer_stores_consumer_loads(server: ServerProcess) -> None:
    producer = MiniEngine(make_vllm_config(server.url, kv_role="kv_producer", model_name="roles"))
    try:
        reqs = workload("p", n=8, seed=3)
        _feed(producer, reqs, per_step=4)
        producer.check_drained()
        assert not producer.loads and producer.scheduler.scheduler.stats["lookups"] == 0
        assert producer.worker.worker.stats["stored_chunks"] > 0
    finally:
        producer.shutdown()
    consumer = MiniEngine(make_vllm_config(server.url, kv_role="kv_consumer", model_name="roles"),
                          enable_prefix_caching=False)
    try:
        _feed(consumer, [Request(f"c-{r.request_id}", list(r.prompt_token_ids)) for r in reqs], per_step=4)
        consumer.check_drained()
        assert consumer.worker.worker.stats["loaded_chunks"] > 0
        assert consumer.worker.worker.stats["stores"] == 0 and not consumer.delayed
    finally:
        consumer.shutdown()


# --------------------------------------------------------------------------- server failures


def test_server_dies_mid_run_recompute_mode_carries_on_and_recovers() -> None:
    with ServerProcess(l1_size="32MiB", chunk_size=CHUNK, transports="cpu_gather") as srv:
        cfg = make_vllm_config(srv.url, model_name="dies", on_server_error="recompute", timeout_s=1, retry_s=0.5)
        engine = MiniEngine(cfg, enable_prefix_caching=False)
        try:
            reqs = workload("e", n=16, seed=4)
            _feed(engine, reqs[:6], per_step=3)
            srv.kill()
            _feed(engine, reqs[6:], per_step=3)  # no server: every request recomputes
            engine.check_drained()
            assert engine.scheduler.scheduler.link.outages >= 1
            assert engine.worker.worker.link.outages >= 1

            srv.start()  # same address, empty cache: the connector finds it again by itself
            before = engine.worker.worker.stats["loaded_chunks"]
            again = [Request(f"r-{i}", list(range(200 + i, 240 + i))) for i in range(3)]
            _feed(engine, again, per_step=3)
            deadline = time.monotonic() + 10
            while engine.scheduler.scheduler.link.down and time.monotonic() < deadline:
                time.sleep(0.1)
                _feed(engine, [Request(f"probe-{time.monotonic()}", [1, 2, 3])], per_step=1)
            _feed(engine, [Request(f"again-{r.request_id}", list(r.prompt_token_ids)) for r in again], per_step=3)
            engine.check_drained()
            assert not engine.scheduler.scheduler.link.down and not engine.worker.worker.link.down
            assert engine.worker.worker.stats["loaded_chunks"] > before
        finally:
            engine.shutdown()


def test_server_dies_fail_mode_raises_clearly() -> None:
    with ServerProcess(l1_size="32MiB", chunk_size=CHUNK, transports="cpu_gather") as srv:
        engine = MiniEngine(make_vllm_config(srv.url, model_name="fails", timeout_s=1), enable_prefix_caching=False)
        try:
            _feed(engine, workload("f", n=4, seed=5), per_step=2)
            srv.kill()
            with pytest.raises(ConnectionFailed, match=r"on_server_error.*recompute") as info:
                _feed(engine, workload("g", n=4, seed=6), per_step=2)
            assert srv.url in str(info.value)
        finally:
            engine.worker.worker.link.close()
            engine.scheduler.scheduler.link.close()


def test_server_restart_between_requests_needs_no_vllm_restart() -> None:
    """A server restarted while vLLM idles answers NoSession; the core client re-handshakes and
    the worker re-registers its KV caches, even in 'fail' mode."""
    with ServerProcess(l1_size="32MiB", chunk_size=CHUNK, transports="cpu_gather") as srv:
        engine = MiniEngine(make_vllm_config(srv.url, model_name="restart"), enable_prefix_caching=False)
        try:
            _feed(engine, workload("h", n=4, seed=7), per_step=4)
            old_pid = srv.pid
            srv.kill()
            srv.start()
            assert srv.pid != old_pid
            reqs = [Request(f"k-{i}", list(range(300, 340)) + [i]) for i in range(2)]
            _feed(engine, reqs[:1], per_step=1)  # stored into the new server
            _feed(engine, reqs[1:], per_step=1)  # loaded from it
            engine.check_drained()
            assert any(op.req_id == "k-1" for op in engine.loads)
            assert engine.load_error_blocks == 0
            status = engine.worker.worker.link.client.status()
            assert [c.model_name for c in status.contexts] == ["restart"]
        finally:
            engine.shutdown()
