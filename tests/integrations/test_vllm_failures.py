"""KvxferConnector when the kvxfer server dies or restarts (one server per module, killed and
restarted by the tests; each test starts it if the previous one left it dead)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
from kvxfer_vllm_harness import MiniEngine, Request, feed, make_vllm_config, workload

from kvxfer.errors import ConfigError, ConnectionFailed
from kvxfer.testing.server import ServerProcess

CHUNK = 16


@pytest.fixture(scope="module")
def victim() -> Iterator[ServerProcess]:
    srv = ServerProcess(l1_size="32MiB", chunk_size=CHUNK, transports="cpu_gather")
    with srv:
        yield srv


@pytest.fixture
def srv(victim: ServerProcess) -> ServerProcess:
    if victim.proc is None or victim.proc.poll() is not None:
        victim.start()
    return victim


def _until_up(engine: MiniEngine, probes: int, limit_s: float = 15) -> int:
    """Steps one-chunk probe requests (tokens no other request has) until both connector
    halves use the server again: a link that lost it looks for it in the background when a step
    asks for it. Returns the number of probes sent so far."""
    links = (engine.scheduler.scheduler.link, engine.worker.worker.link)
    deadline = time.monotonic() + limit_s
    while any(link.down for link in links):
        assert time.monotonic() < deadline, f"the connector did not use the server again within {limit_s} s"
        probes += 1
        first = 1_000_000 + probes * (CHUNK + 1)
        feed(engine, [Request(f"probe-{probes}", list(range(first, first + CHUNK + 1)))], per_step=1)
        time.sleep(0.05)  # a polling interval: the reconnect runs on a thread of its own
    return probes


def test_server_dies_mid_run_recompute_mode_carries_on_and_recovers(srv: ServerProcess) -> None:
    cfg = make_vllm_config(srv.url, model_name="dies", on_server_error="recompute", timeout_s=1, retry_s=0.2)
    engine = MiniEngine(cfg, enable_prefix_caching=False)
    sched, work = engine.scheduler.scheduler, engine.worker.worker
    try:
        reqs = workload("e", n=16, seed=4)
        feed(engine, reqs[:6], per_step=3)
        assert sched.stats["lookups"] >= 6 and sched.stats["unanswered_lookups"] == 0
        srv.kill()
        feed(engine, reqs[6:], per_step=3)  # no server: every request recomputes, none fails
        engine.check_drained()
        assert sched.link.outages >= 1 and work.link.outages >= 1
        assert sched.link.down and work.link.down
        # each prompt with a whole chunk to ask about, computed without the cache, is counted
        # (vllm:kvxfer_unanswered_lookups_total); shorter ones had nothing to ask
        askable = sum(len(r.prompt_token_ids) >= CHUNK for r in reqs[6:])
        assert askable > 0 and sched.stats["unanswered_lookups"] >= askable, (askable, sched.stats)

        srv.start()  # same address, empty cache: the connector finds it again by itself
        probes = _until_up(engine, 0)
        before = work.stats["loaded_chunks"]
        # a request slower than timeout_s=1 on a loaded machine sends the link back to recompute
        # mode; it recovers by itself, so a few rounds of store-then-load must load something
        for round_ in range(5):
            again = [Request(f"r{round_}-{i}", list(range(1000 * round_ + 200 + i, 1000 * round_ + 240 + i)))
                     for i in range(3)]
            feed(engine, again, per_step=3)
            feed(engine, [Request(f"again-{r.request_id}", list(r.prompt_token_ids)) for r in again], per_step=3)
            engine.check_drained()
            if work.stats["loaded_chunks"] > before:
                break
            probes = _until_up(engine, probes)
        assert work.stats["loaded_chunks"] > before
    finally:
        engine.shutdown()


def test_a_server_back_while_vllm_idles_is_used_by_the_next_request(srv: ServerProcess) -> None:
    """A lost server was looked for only when a step asked for it: a server that came back while
    vLLM idled was found by the next request, which still ran without the cache (neither looked
    up nor stored). The links now look for it every retry_s from the moment it was lost: the
    worker registers again with no step at all, and the next request stores and the one after
    it loads."""
    from kvxfer import CacheClient

    cfg = make_vllm_config(srv.url, model_name="idle", on_server_error="recompute", timeout_s=1, retry_s=0.2)
    engine = MiniEngine(cfg, enable_prefix_caching=False)
    sched, work = engine.scheduler.scheduler, engine.worker.worker
    try:
        srv.kill()
        feed(engine, workload("i", n=2, seed=8), per_step=2)  # both halves find it gone
        engine.check_drained()
        assert sched.link.down and work.link.down
        srv.start()
        with CacheClient(srv.url, timeout=10) as c:
            deadline = time.monotonic() + 30
            while engine.worker.identity not in [x.model_name for x in c.status().contexts]:
                assert time.monotonic() < deadline, "the worker did not register again while vLLM idled"
                time.sleep(0.1)
        tokens = list(range(700, 740))
        feed(engine, [Request("idle-store", tokens)], per_step=1)
        feed(engine, [Request("idle-load", tokens)], per_step=1)
        engine.check_drained()
        assert any(op.req_id == "idle-load" for op in engine.loads), "the first requests ran without the cache"
        assert not sched.link.down and not work.link.down
    finally:
        engine.shutdown()


def test_a_start_up_connect_and_the_background_one_make_one_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the server missing at start (recompute), the link looks for it in the background at
    once, and vLLM's register_kv_caches connects again at start-up: both once made a client when
    the server came, and the one overwritten lived on (its session, heartbeat and lock) until the
    process ended. They now connect one at a time, and one client is made. (The CacheClient
    subclass only counts the clients the link makes; they are real.)"""
    from kvxfer import CacheClient
    from kvxfer.integrations.vllm import link as link_module
    from kvxfer.integrations.vllm.config import ConnectorConfig

    made: list[CacheClient] = []

    class Counted(CacheClient):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            made.append(self)

    monkeypatch.setattr(link_module, "CacheClient", Counted)
    late = ServerProcess(l1_size="16MiB", chunk_size=CHUNK, transports="cpu_gather")
    cfg = ConnectorConfig.from_vllm(make_vllm_config(late.url, on_server_error="recompute", timeout_s=1,
                                                     retry_s=0.1))
    link = link_module.ServerLink(cfg, "worker", lambda client: time.sleep(0.2))  # a slow registration
    try:
        assert link.get(startup=True) is None and link.down  # no server: the background thread looks
        with late:
            deadline = time.monotonic() + 30
            while link.get(startup=True) is None:  # as register_kv_caches does, racing the thread
                assert time.monotonic() < deadline, "never connected"
            assert not link.down and link.get() is link.client
            time.sleep(0.5)  # a background attempt still running would make its client now
            assert len(made) == 1, f"{len(made)} clients made"
            link.close()
            with CacheClient(late.url, timeout=10) as probe:
                assert probe.status().sessions == 1, "a client of the link still holds a session"
    finally:
        link.close()


def test_server_restart_between_requests_needs_no_vllm_restart(srv: ServerProcess) -> None:
    """A server restarted while vLLM idles answers NoSession; the core client re-handshakes and
    the worker re-registers its KV caches, even in 'fail' mode."""
    engine = MiniEngine(make_vllm_config(srv.url, model_name="restart"), enable_prefix_caching=False)
    try:
        feed(engine, workload("h", n=4, seed=7), per_step=4)
        old_pid = srv.pid
        srv.kill()
        srv.start()
        assert srv.pid != old_pid
        reqs = [Request(f"k-{i}", list(range(300, 340)) + [i]) for i in range(2)]
        feed(engine, reqs[:1], per_step=1)  # stored into the new server
        feed(engine, reqs[1:], per_step=1)  # loaded from it
        engine.check_drained()
        assert any(op.req_id == "k-1" for op in engine.loads)
        assert engine.load_error_blocks == 0
        status = engine.worker.worker.link.client.status()
        assert [c.model_name for c in status.contexts] == [engine.worker.identity]
        assert engine.worker.identity.startswith("restart#")  # the label, then the fingerprint
    finally:
        engine.shutdown()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_server_restarted_with_another_chunk_size_is_not_used(srv: ServerProcess, policy: str,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """A server restarted with another chunk size answers the scheduler's next lookup NoSession;
    its side opened a new session and went on hashing prompts in the old chunks (every lookup a
    miss, nothing said). Now the scheduler checks the chunk size of every new session: with
    'recompute' it stops using that server and says why; with 'fail' the step raises."""
    cfg = make_vllm_config(srv.url, model_name="rechunk", on_server_error=policy, timeout_s=1, retry_s=0.2)
    engine = MiniEngine(cfg, enable_prefix_caching=False)
    sched = engine.scheduler.scheduler
    other = ServerProcess(l1_size="32MiB", chunk_size=CHUNK * 2, transports="cpu_gather", url=srv.url)
    try:
        feed(engine, workload("r", n=2, seed=8), per_step=2)
        assert sched.chunk_size == CHUNK and not sched.link.down
        srv.kill()
        other.start()
        reqs = [Request(f"rc-{i}", list(range(500, 500 + 4 * CHUNK)) + [i]) for i in range(2)]
        if policy == "fail":
            with pytest.raises(ConfigError, match=f"uses chunk size {2 * CHUNK} but this vLLM expects {CHUNK}"):
                feed(engine, reqs, per_step=1)
            return
        before = sched.stats["unanswered_lookups"]
        with caplog.at_level(logging.DEBUG, logger="kvxfer.integrations.vllm"):
            feed(engine, reqs, per_step=1)
            engine.check_drained()
            assert sched.link.down and sched.stats["unanswered_lookups"] - before == 2
            assert sched.chunk_size == CHUNK
            deadline = time.monotonic() + 10
            while sum("still unusable" in r.message for r in caplog.records) < 4:  # four retries, 0.2 s apart
                assert time.monotonic() < deadline, "the scheduler did not retry the server"
                time.sleep(0.05)
        # the reason is said once as an ERROR by each half that met the server, not at every
        # retry (0.2 s here); the scheduler always does, the worker when a store of its met it
        unusable = [r for r in caplog.records if "still unusable" in r.message]
        for side in ("scheduler", "worker rank 0"):
            errors = [r for r in unusable if r.levelno == logging.ERROR and f"kvxfer {side}:" in r.getMessage()]
            assert (len(errors) == 1) if side == "scheduler" else (len(errors) <= 1), unusable
            assert all(f"uses chunk size {2 * CHUNK}" in r.getMessage() or f"uses chunks of {2 * CHUNK} tokens"
                       in r.getMessage() for r in errors), errors
        from kvxfer import CacheClient

        with CacheClient(other.url) as probe:  # the worker's KV cache was never registered with it
            assert probe.status().contexts == [], probe.status().contexts
    finally:
        other.stop()
        engine.worker.worker.link.close()
        sched.link.close()


def test_server_dies_fail_mode_raises_clearly(srv: ServerProcess) -> None:
    engine = MiniEngine(make_vllm_config(srv.url, model_name="fails", timeout_s=1), enable_prefix_caching=False)
    try:
        feed(engine, workload("f", n=4, seed=5), per_step=2)
        srv.kill()
        with pytest.raises(ConnectionFailed, match=r"on_server_error.*recompute") as info:
            feed(engine, workload("g", n=4, seed=6), per_step=2)
        assert srv.url in str(info.value)
    finally:
        engine.worker.worker.link.close()
        engine.scheduler.scheduler.link.close()


def test_a_store_the_dead_server_failed_is_counted_as_dropped(srv: ServerProcess) -> None:
    """A store submitted to a server that died is counted in vLLM's kvxfer_dropped_stores (it
    was counted nowhere: the figures said every store went through)."""
    cfg = make_vllm_config(srv.url, model_name="counted", on_server_error="recompute", timeout_s=1, retry_s=0.2)
    engine = MiniEngine(cfg, enable_prefix_caching=False)
    work = engine.worker.worker
    try:
        feed(engine, workload("c", n=1, seed=5), per_step=1)
        engine.check_drained()
        stats = dict(work.stats)
        assert stats["stores"] >= 1 and stats["stored_chunks"] >= 1 and stats["dropped_stores"] == 0
        srv.kill()
        feed(engine, workload("d", n=1, seed=6), per_step=1)
        engine.check_drained()
        submitted = work.stats["stores"] - stats["stores"]
        assert work.stats["stored_chunks"] == stats["stored_chunks"]
        assert work.stats["dropped_stores"] - stats["dropped_stores"] >= max(1, submitted), work.stats
    finally:
        engine.shutdown()


def test_a_late_server_that_refuses_the_registration_costs_a_step_nothing_under_recompute() -> None:
    """recompute: the server was not there when vLLM registered its KV caches, and the one that
    came later does not load the configured transport. The registration, tried again inside a
    step's start_load_kv, raised out of vLLM's step and killed the engine (and the step's load
    would never have been reported). Now it is a server error like any other: the step goes on,
    its load is reported finished with its blocks not loaded. Under fail it raises, as before."""
    import torch
    from kvxfer_vllm_harness import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvxfer import chunk_hashes
    from kvxfer.integrations.vllm import KvxferConnector, KvxferConnectorMetadata, LoadOp
    from kvxfer.integrations.vllm._compat import KVConnectorRole

    late = ServerProcess(l1_size="16MiB", chunk_size=CHUNK, transports="hpu")  # not cpu_gather
    specs = KVCacheConfig(32, [KVCacheGroupSpec(["l0"], FullAttentionSpec(4))])
    for policy in ("recompute", "fail"):
        cfg = make_vllm_config(late.url, model_name=f"late-{policy}", on_server_error=policy, timeout_s=1,
                               retry_s=0.1)
        if policy == "fail":
            with pytest.raises(ConnectionFailed):  # no server at start-up: fail refuses to start
                KvxferConnector(cfg, KVConnectorRole.WORKER, specs)
            continue
        worker = KvxferConnector(cfg, KVConnectorRole.WORKER, specs)
        worker.register_kv_caches({"l0": torch.zeros(2, 32, 4, 2, 4)})
        assert not worker.worker.contexts
        try:
            with late:
                deadline = time.monotonic() + 30
                while worker.worker.link.get() is None:  # the background reconnect finds it
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                keys = chunk_hashes(list(range(2 * CHUNK)), CHUNK, salt="late")
                worker.bind_connector_metadata(KvxferConnectorMetadata(CHUNK, loads=[LoadOp("r", keys, list(range(8)))]))
                worker.start_load_kv(None)  # raised TransportUnavailable here
                worker.wait_for_save()
                sending, recving = worker.get_finished(set())
                assert recving == {"r"} and worker.get_block_ids_with_load_errors() == set(range(8))
                worker.clear_connector_metadata()
                assert worker.worker.link.down
        finally:
            worker.shutdown()


def _slot_of_one_chunk() -> int:
    """Arena bytes of one chunk of MiniEngine's KV cache (2 layers of [2, blocks, 4, 2, 4] float32)."""
    from kvxfer.server.allocator import Allocator

    return Allocator.rounded(2 * 2 * CHUNK * 2 * 4 * 4)


def test_a_store_a_live_server_refuses_fails_alone() -> None:
    """A store the server refuses for one of its limits (here --max-reserved-bytes-per-session
    of one chunk; by default a step that stores more than the arena holds) is a reply of a live
    server about that store. It killed the engine under fail (the refusal was taken for an
    outage), and under recompute turned the cache off as if the server were gone. Now that
    store alone fails, counted in failed_store_chunks; the cache stays on, and the next store
    that fits is stored."""
    with ServerProcess(l1_size="16MiB", chunk_size=CHUNK, transports="cpu_gather",
                       extra_args=["--max-reserved-bytes-per-session", str(_slot_of_one_chunk())]) as srv:
        engine = MiniEngine(make_vllm_config(srv.url, model_name="refused-store", timeout_s=5),
                            enable_prefix_caching=False)
        work = engine.worker.worker
        try:
            feed(engine, workload("rs", n=2, seed=7), per_step=2)  # several chunks a request: refused
            engine.check_drained()
            assert work.stats["failed_store_chunks"] >= 2 and work.stats["dropped_stores"] == 0, work.stats
            assert not work.link.down and not engine.scheduler.scheduler.link.down
            before = work.stats["stored_chunks"]
            feed(engine, [Request("one-chunk", list(range(2_000_000, 2_000_000 + CHUNK + 1)))], per_step=1)
            engine.check_drained()
            assert work.stats["stored_chunks"] == before + 1
        finally:
            engine.shutdown()


def test_a_lookup_a_live_server_refuses_fails_alone() -> None:
    """A lookup whose lease the server refuses (here --max-chunk-pins-per-session 1, and the
    prompts' prefixes stored, several chunks each) is answered by vLLM computing the prefix,
    counted in unanswered_lookups: under fail it killed the engine."""
    with ServerProcess(l1_size="16MiB", chunk_size=CHUNK, transports="cpu_gather",
                       extra_args=["--max-chunk-pins-per-session", "1"]) as srv:
        engine = MiniEngine(make_vllm_config(srv.url, model_name="refused-lookup", timeout_s=5),
                            enable_prefix_caching=False)
        sched = engine.scheduler.scheduler
        try:
            reqs = workload("rl", n=2, seed=8)
            feed(engine, reqs, per_step=2)
            engine.check_drained()
            assert engine.worker.worker.stats["stored_chunks"] >= 4
            feed(engine, workload("rl-again", n=2, seed=8), per_step=2)  # the same prompts: leases of 2+ chunks
            engine.check_drained()
            assert sched.stats["unanswered_lookups"] >= 2 and not sched.link.down, sched.stats
        finally:
            engine.shutdown()


def test_a_kv_cache_the_server_refuses_to_register_is_refused_at_start_up() -> None:
    """A server that holds a model's chunks in one format refuses a KV cache of another under
    the same name (kvxfer.model_name set, the fingerprint off). That refusal is no outage: it is
    raised when vLLM registers its KV caches, under recompute too (it was logged as an outage,
    and every load the scheduler then planned failed, for good), and without the advice to
    start a server."""
    import torch
    from kvxfer_vllm_harness import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvxfer.integrations.vllm import KvxferConnector
    from kvxfer.integrations.vllm._compat import KVConnectorRole

    specs = KVCacheConfig(32, [KVCacheGroupSpec(["l0"], FullAttentionSpec(4))])
    with ServerProcess(l1_size="16MiB", chunk_size=CHUNK, transports="cpu_gather") as srv:
        first = KvxferConnector(make_vllm_config(srv.url, model_name="one-name", fingerprint=False),
                                KVConnectorRole.WORKER, specs)
        try:
            first.register_kv_caches({"l0": torch.zeros(2, 32, 4, 2, 4)})
            ctx = next(iter(first.worker.contexts.values()))
            assert ctx.submit_store(chunk_hashes_of("one-name"), list(range(CHUNK // 4))).result(10).stored == [0]
        finally:
            first.shutdown()
        for policy in ("recompute", "fail"):
            other = KvxferConnector(make_vllm_config(srv.url, model_name="one-name", fingerprint=False,
                                                     on_server_error=policy, retry_s=0.1),
                                    KVConnectorRole.WORKER, specs)
            try:
                with pytest.raises(ConfigError, match="refused this KV cache") as info:
                    other.register_kv_caches({"l0": torch.zeros(2, 32, 4, 2, 4, dtype=torch.bfloat16)})
                assert "start one with" not in str(info.value)
            finally:
                other.shutdown()


def chunk_hashes_of(salt: str) -> list[bytes]:
    from kvxfer import chunk_hashes

    return chunk_hashes(list(range(CHUNK)), CHUNK, salt=salt)
