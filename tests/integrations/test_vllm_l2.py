"""The connector's scheduler half against a server with an L2 tier: the leased lookups that
vLLM's scheduler sends promote chunks that only L2 holds, and the loads that follow read them,
byte for byte (the harness checks every context position's KV before each forward pass)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from kvxfer_vllm_harness import MiniEngine, Request, feed, make_vllm_config, workload

from kvxfer import CacheClient
from kvxfer.testing.server import ServerProcess

CHUNK = 16
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def l2_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    store = tmp_path_factory.mktemp("l2") / "store"
    with ServerProcess(l1_size="64MiB", chunk_size=CHUNK, transports="cpu_gather",
                       extra_args=["--l2", "fs", "--l2-url", f"file://{store}"]) as srv:
        yield srv


def settle(client: CacheClient) -> int:
    """Wait until the L2 writes queued so far are done; returns the chunks written."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        t = client.status().tiers[0]
        if t.queue_depth == 0 and t.writes + t.write_skipped + t.drops >= 1:
            return t.writes
        if time.monotonic() > deadline:
            raise AssertionError(f"L2 writes did not settle: {t}")
        time.sleep(0.05)


def test_leased_lookups_promote_from_l2_and_loads_read_them(l2_server: ServerProcess) -> None:
    reqs = workload("l2", n=12, seed=5)
    producer = MiniEngine(make_vllm_config(l2_server.url, model_name="l2-promote"), enable_prefix_caching=False)
    try:
        feed(producer, reqs, per_step=4)
        producer.check_drained()
        assert producer.worker.worker.stats["stored_chunks"] > 0
        identity = producer.scheduler.identity  # the server's name for this model's chunks
    finally:
        producer.shutdown()
    with CacheClient(l2_server.url, timeout=TIMEOUT) as c:
        assert settle(c) >= producer.worker.worker.stats["stored_chunks"]
        assert c.clear(identity) > 0  # L1 forgets them: only L2 has them now
        before = c.status().tiers[0]
    consumer = MiniEngine(make_vllm_config(l2_server.url, model_name="l2-promote"), enable_prefix_caching=False)
    try:
        feed(consumer, [Request(f"again-{r.request_id}", list(r.prompt_token_ids)) for r in reqs], per_step=4)
        consumer.check_drained()
        loaded = {op.req_id for op in consumer.loads}
        for r in reqs:  # every prompt of a whole chunk or more was found, in L2
            if len(r.prompt_token_ids) >= CHUNK:
                assert f"again-{r.request_id}" in loaded, r.request_id
        work = consumer.worker.worker.stats
        assert work["loaded_chunks"] > 0 and work["failed_load_blocks"] == 0
        assert consumer.load_error_blocks == 0
    finally:
        consumer.shutdown()
    with CacheClient(l2_server.url, timeout=TIMEOUT) as c:
        after = c.status().tiers[0]
    # the scheduler's lookups asked for promotion: the chunks came into the arena from L2 (a
    # prefix that several requests share is promoted once and loaded by each)
    assert after.promotions > before.promotions
    assert after.promote_failures == before.promote_failures and after.integrity_failures == 0
    assert after.lookup_hits > before.lookup_hits


def test_loads_admitted_at_once_all_finish_when_blocks_are_scarce(l2_server: ServerProcess) -> None:
    """Every request comes in one step, so each is admitted with its async load before any load
    lands; their whole prompts need more blocks than the engine has (96). The scheduler admits
    a load only while it fits beside what the loads in flight still need (vLLM's gate): without
    it every block went to waiting loads, and the first one that landed found none to finish
    its prompt, with nothing running to free one."""
    reqs = workload("l2-all", n=12, seed=5)
    producer = MiniEngine(make_vllm_config(l2_server.url, model_name="l2-at-once"), enable_prefix_caching=False)
    try:
        feed(producer, reqs, per_step=4)
        producer.check_drained()
        identity = producer.scheduler.identity
    finally:
        producer.shutdown()
    with CacheClient(l2_server.url, timeout=TIMEOUT) as c:
        settle(c)
        assert c.clear(identity) > 0
    consumer = MiniEngine(make_vllm_config(l2_server.url, model_name="l2-at-once"), enable_prefix_caching=False)
    bs = consumer.bs
    assert sum(-(-len(r.prompt_token_ids) // bs) for r in reqs) > consumer.num_blocks  # they cannot all fit
    try:
        feed(consumer, [Request(f"again-{r.request_id}", list(r.prompt_token_ids)) for r in reqs], per_step=len(reqs))
        consumer.check_drained()
        assert consumer.worker.worker.stats["loaded_chunks"] > 0
        assert consumer.load_error_blocks == 0
    finally:
        consumer.shutdown()
