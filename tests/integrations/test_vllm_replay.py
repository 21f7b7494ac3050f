"""KvxferConnector driven through vLLM's call sequence (MiniEngine) against a real server."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from kvxfer_vllm_harness import MiniEngine, Request, feed, make_vllm_config, workload

from kvxfer import chunk_hashes
from kvxfer.errors import ConnectionFailed
from kvxfer.testing.server import ServerProcess

CHUNK = 16


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
        feed(engine, reqs, per_step=3)
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
        feed(engine, first, per_step=8)
        again = [Request(f"again-{r.request_id}", list(r.prompt_token_ids)) for r in first]
        feed(engine, again, per_step=8)
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
        feed(engine, reqs, per_step=6)
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
        feed(engine, first, per_step=1)
        cleared: list[int] = []

        def clear_before_load(eng: MiniEngine, meta: object) -> None:
            if meta.loads and not cleared:
                # the lease expires, and the server drops expired leases on its next tick (~0.25 s):
                # until then clear() skips the leased chunks
                client = eng.scheduler.scheduler.link.client
                deadline = time.monotonic() + 15
                while (n := client.clear(eng.scheduler.identity)) == 0 and time.monotonic() < deadline:
                    time.sleep(0.05)
                cleared.append(n)

        engine.after_build = clear_before_load
        feed(engine, [Request("d-1", list(range(100, 148)) + [7, 8])], per_step=1)
        engine.check_drained()
        assert cleared and cleared[0] > 0
        assert engine.load_error_blocks > 0 and engine.recomputed_tokens > 0
    finally:
        engine.shutdown()


def test_kv_roles_producer_stores_consumer_loads(server: ServerProcess) -> None:
    producer = MiniEngine(make_vllm_config(server.url, kv_role="kv_producer", model_name="roles"))
    try:
        reqs = workload("p", n=8, seed=3)
        feed(producer, reqs, per_step=4)
        producer.check_drained()
        assert not producer.loads and producer.scheduler.scheduler.stats["lookups"] == 0
        assert producer.worker.worker.stats["stored_chunks"] > 0
    finally:
        producer.shutdown()
    consumer = MiniEngine(make_vllm_config(server.url, kv_role="kv_consumer", model_name="roles"),
                          enable_prefix_caching=False)
    try:
        feed(consumer, [Request(f"c-{r.request_id}", list(r.prompt_token_ids)) for r in reqs], per_step=4)
        consumer.check_drained()
        assert consumer.worker.worker.stats["loaded_chunks"] > 0
        assert consumer.worker.worker.stats["stores"] == 0 and not consumer.delayed
    finally:
        consumer.shutdown()


def test_cache_salt_and_lora_separate_cached_prefixes(server: ServerProcess, tmp_path: Path) -> None:
    """Salts, LoRA adapters (by name and path: a name pointed at another adapter is another
    cache, as in vLLM's own prefix cache) and a salt that spells another request's salt and
    adapter each keep a cache of their own; a prompt given as embeddings is neither looked up
    nor stored (its token ids do not say what was computed)."""
    engine = MiniEngine(make_vllm_config(server.url, model_name="salts"), enable_prefix_caching=False)
    try:
        prompt = list(range(10, 60))
        for version in (1, 2):  # adapters on disk (one whose files are gone moves no KV)
            (tmp_path / f"v{version}").mkdir()
            (tmp_path / f"v{version}" / "adapter_model.bin").write_bytes(bytes([version]) * 64)

        def lora(path: str) -> Any:
            path = str(tmp_path / path.removeprefix("/adapters/"))
            return type("LoRARequest", (), {"lora_name": "adapter-1", "lora_int_id": 1, "lora_path": path})()

        feed(engine, [Request("s-a", prompt, cache_salt="tenant-a")], per_step=1)
        feed(engine, [Request("s-b", prompt, cache_salt="tenant-b")], per_step=1)
        feed(engine, [Request("s-none", list(prompt))], per_step=1)
        feed(engine, [Request("s-lora", list(prompt), lora_request=lora("/adapters/v1"))], per_step=1)
        feed(engine, [Request("s-lora-v2", list(prompt), lora_request=lora("/adapters/v2"))], per_step=1)
        feed(engine, [Request("s-spelt", list(prompt), cache_salt="x|lora=adapter-1")], per_step=1)
        feed(engine, [Request("s-x-lora", list(prompt), cache_salt="x", lora_request=lora("/adapters/v1"))],
             per_step=1)
        assert not engine.loads  # seven different caches: no request may read another's KV
        stored = engine.worker.worker.stats["stored_chunks"]
        feed(engine, [Request("s-embeds", list(prompt), prompt_embeds=torch.zeros(len(prompt), 4))], per_step=1)
        assert engine.worker.worker.stats["stored_chunks"] == stored, "a prompt of embeddings is not stored"
        feed(engine, [Request("s-a2", list(prompt), cache_salt="tenant-a")], per_step=1)
        feed(engine, [Request("s-lora2", list(prompt), lora_request=lora("/adapters/v1"))], per_step=1)
        feed(engine, [Request("s-embeds2", list(prompt), prompt_embeds=torch.zeros(len(prompt), 4))], per_step=1)
        engine.check_drained()
        assert sorted(op.req_id for op in engine.loads) == ["s-a2", "s-lora2"]
    finally:
        engine.shutdown()


def test_a_repeated_lookup_keeps_one_lease(server: ServerProcess) -> None:
    """vLLM may ask get_num_new_matched_tokens again for a request it could not allocate; the
    connector drops the previous lease each time, and request_finished drops the last one."""
    engine = MiniEngine(make_vllm_config(server.url, model_name="leases"), enable_prefix_caching=False)
    try:
        prompt = list(range(500, 548))
        feed(engine, [Request("l-0", prompt)], per_step=1)
        engine.check_drained()
        sched = engine.scheduler
        client = sched.scheduler.link.client
        base = client.status().leases
        req = Request("l-1", list(prompt))
        for _ in range(5):
            assert sched.get_num_new_matched_tokens(req, 0) == (len(prompt) - 1, True)
        assert client.status().leases == base + 1
        assert sched.request_finished(req, []) == (False, None)
        assert client.status().leases == base
    finally:
        engine.shutdown()


def test_a_failed_load_is_not_offered_again_and_gives_its_lease_back(server: ServerProcess) -> None:
    """A worker that cannot load (here its own link to the server is down, while its
    scheduler's is up and keeps finding the chunks): vLLM asks about a request again after its
    load failed from its first block, and offering the same hits again planned and failed loads
    in a loop, each holding a lease (4,096 loads for 4 requests in real vLLM, until the server's
    lease limit). Now each request gets one load, then computes its prefix; the worker gives
    back the leases of the loads it did not run."""
    names = {"model_name": "one-load", "on_server_error": "recompute", "retry_s": 600}
    first = MiniEngine(make_vllm_config(server.url, **names), enable_prefix_caching=False)
    reqs = workload("one-load", n=4, seed=5)
    try:
        feed(first, reqs, per_step=4)
        first.check_drained()
    finally:
        first.shutdown()
    other = MiniEngine(make_vllm_config(server.url, **names), enable_prefix_caching=False)
    try:
        # the worker's connection lost (it looks for the server again only after kvxfer.retry_s)
        other.worker.worker.link.failed(ConnectionFailed("the worker's connection was lost"), "a stand-in outage")
        assert other.worker.worker.link.down and not other.scheduler.scheduler.link.down
        client = other.scheduler.scheduler.link.client
        base = client.status().leases
        again = [Request(f"again-{r.request_id}", list(r.prompt_token_ids)) for r in reqs]
        feed(other, again, per_step=4)
        other.check_drained()
        offered = [op.req_id for op in other.loads]
        assert offered and len(offered) == len(set(offered)), f"a request was offered a load twice: {offered}"
        assert other.scheduler.scheduler.stats["loads_not_offered_again"] == len(offered)
        assert other.recomputed_tokens > 0
        assert client.status().leases == base, "the loads the worker did not run left their leases"
    finally:
        other.shutdown()


def test_stores_are_submitted_when_vllm_finalizes_after_its_results(server: ServerProcess) -> None:
    """vLLM's V1 model runner with speculative decoding calls wait_for_save after
    get_transfer_results (once its drafter ran): the stores the step planned were dropped as if
    the step had no forward pass, and nothing was ever stored (seen in real vLLM with ngram
    speculation). They are stored now, and a request whose store was not yet submitted is not
    reported finished before it is (its blocks would be freed under the store)."""
    engine = MiniEngine(make_vllm_config(server.url, model_name="deferred"), enable_prefix_caching=False,
                        defer_finalize=True)
    try:
        reqs = workload("deferred", n=8, seed=7, max_tokens=1)
        feed(engine, reqs, per_step=4)
        engine.check_drained()
        work = engine.worker.worker.stats
        assert work["stored_chunks"] > 0 and work["dropped_stores"] == 0, work
        assert engine.delayed and engine.delayed == engine.reported_sending
        again = [Request(f"again-{r.request_id}", list(r.prompt_token_ids)) for r in reqs]
        feed(engine, again, per_step=4)
        engine.check_drained()
        assert work["loaded_chunks"] > 0 and engine.load_error_blocks == 0
    finally:
        engine.shutdown()


def test_a_reset_of_vllms_caches_leaves_what_was_stored_before_unread(server: ServerProcess) -> None:
    """vLLM resets its prefix cache with reset_connector (around a weight update, say): the
    connector did not implement reset_cache, vLLM took that for success, and the next request
    loaded KV of the old weights. Now nothing stored before the reset is looked up again, a
    request under way stores nothing more, and what is stored after it is found."""
    engine = MiniEngine(make_vllm_config(server.url, model_name="reset"), enable_prefix_caching=False)
    try:
        prompt = list(range(300, 348))
        feed(engine, [Request("r-0", prompt)], per_step=1)
        feed(engine, [Request("r-1", list(prompt))], per_step=1)
        assert [op.req_id for op in engine.loads] == ["r-1"]
        # a request under way at the reset (vLLM preempts running ones, and asks about them again)
        under_way = Request("r-x", list(prompt))
        assert engine.scheduler.get_num_new_matched_tokens(under_way, 0)[0] == len(prompt) - 1
        assert engine.scheduler.reset_cache() is True and engine.worker.reset_cache() is None
        assert engine.scheduler.get_num_new_matched_tokens(under_way, 0) == (0, False)
        engine.scheduler.request_finished(under_way, [])
        feed(engine, [Request("r-2", list(prompt))], per_step=1)  # computed anew, and stored anew
        feed(engine, [Request("r-3", list(prompt))], per_step=1)
        engine.check_drained()
        assert [op.req_id for op in engine.loads] == ["r-1", "r-3"]
    finally:
        engine.shutdown()


def test_after_a_reset_under_the_external_launcher_the_cache_is_off(server: ServerProcess) -> None:
    """Under vLLM's external launcher every rank runs its own scheduler: after a reset each
    would pick its own random epoch, and no chunk would ever be whole across ranks while every
    rank kept storing chunks nobody can read. The cache is off after a reset there (said in
    the log); a deterministic epoch could give one engine another's KV of other weights."""
    cfg = make_vllm_config(server.url, model_name="reset-launcher")
    cfg.parallel_config.world_size = 2
    cfg.parallel_config.distributed_executor_backend = "external_launcher"  # type: ignore[attr-defined]
    from kvxfer_vllm_harness import KVCacheConfig, KVCacheGroupSpec

    from kvxfer.integrations.vllm import KvxferConnector
    from kvxfer.integrations.vllm._compat import KVConnectorRole

    sched = KvxferConnector(cfg, KVConnectorRole.SCHEDULER, KVCacheConfig(64, [KVCacheGroupSpec(["l.0"])]))
    try:
        assert sched.reset_cache() is True and not sched.scheduler.moves_kv
        lookups = sched.scheduler.stats["lookups"]
        assert sched.get_num_new_matched_tokens(Request("x", list(range(64))), 0) == (0, False)
        assert sched.scheduler.stats["lookups"] == lookups
    finally:
        sched.shutdown()


def test_a_request_whose_prefix_vllm_will_not_read_is_not_looked_up(server: ServerProcess) -> None:
    """vLLM reads no prefix hit for a request that asks for prompt logprobs (or a token-level
    pooling task): its skip_reading_prefix_cache. The connector still looked it up, leased and
    counted the hit, which vLLM then ignored. Now it offers nothing and leases nothing."""
    engine = MiniEngine(make_vllm_config(server.url, model_name="no-read"), enable_prefix_caching=False)
    try:
        prompt = list(range(400, 448))
        feed(engine, [Request("n-0", prompt)], per_step=1)
        sched = engine.scheduler.scheduler
        client = sched.link.client
        lookups, leases = sched.stats["lookups"], client.status().leases
        req = Request("n-1", list(prompt), skip_reading_prefix_cache=True)
        assert engine.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
        assert (sched.stats["lookups"], client.status().leases) == (lookups, leases)
        engine.scheduler.request_finished(req, [])
    finally:
        engine.shutdown()


def test_a_load_vllm_gave_too_few_blocks_for_gives_its_lease_back(server: ServerProcess) -> None:
    """vLLM may allocate fewer blocks than the tokens offered need: the load is planned with no
    chunks, its blocks reported failed, and its lease, which no retrieve will name, is released
    at once (it kept the chunks pinned for kvxfer.lease_s)."""
    from kvxfer_vllm_harness import KVCacheBlocks

    engine = MiniEngine(make_vllm_config(server.url, model_name="few-blocks"), enable_prefix_caching=False)
    try:
        prompt = list(range(500, 548))
        feed(engine, [Request("f-0", prompt)], per_step=1)
        client = engine.scheduler.scheduler.link.client
        base = client.status().leases
        req = Request("f-1", list(prompt) + [1])
        ext, _ = engine.scheduler.get_num_new_matched_tokens(req, 0)
        assert ext == len(prompt) and client.status().leases == base + 1
        engine.scheduler.update_state_after_alloc(req, KVCacheBlocks(([1, 2, 3],)), ext)  # fewer than promised
        (op,) = engine.scheduler.scheduler._loads
        assert op.keys == [] and op.lease_id == 0 and op.failed_block_ids == [1, 2, 3]
        assert client.status().leases == base
        engine.scheduler.request_finished(req, [])
    finally:
        engine.shutdown()


def test_a_prompt_of_more_chunks_than_a_request_may_name_is_looked_up_by_its_leading_ones(
        server: ServerProcess) -> None:
    """A prompt of more chunks than one request may name (MAX_CHUNKS_PER_REQUEST: a long prompt
    and a small chunk size): its lookup named every chunk, which the server refuses, so the
    prompt was never looked up and counted unanswered. Now the lookup names its leading chunks."""
    from kvxfer.protocol.messages import MAX_CHUNKS_PER_REQUEST

    engine = MiniEngine(make_vllm_config(server.url, model_name="long-prompt"), enable_prefix_caching=False)
    try:
        sched = engine.scheduler.scheduler
        req = Request("long", [7] * ((MAX_CHUNKS_PER_REQUEST + 1) * CHUNK + 1))
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # nothing stored: a miss
        assert (sched.stats["lookups"], sched.stats["unanswered_lookups"]) == (1, 0)
    finally:
        engine.shutdown()


def test_a_step_that_completes_more_chunks_than_a_request_may_name_stores_them_all_in_parts(
        server: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that completes more chunks than one request may name stores them in parts, all
    in that step (chunks deferred to later steps were never stored by a request that finished in
    it, and a sliding-window group's blocks may be freed by then). The bound is lowered to 2
    chunks here: a real step of 16,384 chunks is too long for a test."""
    from kvxfer.integrations.vllm import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "MAX_CHUNKS_PER_REQUEST", 2)
    engine = MiniEngine(make_vllm_config(server.url, model_name="in-parts"), enable_prefix_caching=False,
                        token_budget=256)
    try:
        prompt = list(range(100, 100 + 6 * CHUNK + 1))
        feed(engine, [Request("p", prompt, max_tokens=1)], per_step=1)
        engine.check_drained()
        sched = engine.scheduler.scheduler
        assert (sched.stats["stores"], sched.stats["store_chunks"]) == (3, 6)
        # each part names its chunks' own blocks: together the prompt's, each block once
        bpc = CHUNK // 4  # (the harness's block size)
        assert [len(op.keys) for op in engine.stores] == [2, 2, 2]
        assert all(len(op.block_ids) == len(op.keys) * bpc for op in engine.stores)
        blocks = [b for op in engine.stores for b in op.block_ids]
        assert len(set(blocks)) == len(blocks) == 6 * bpc
        assert [k for op in engine.stores for k in op.keys] == chunk_hashes(prompt, CHUNK)
        client = sched.link.client
        reply = client.lookup_and_lease(sched.groups[0].name, 1, hashes=chunk_hashes(prompt, CHUNK), lease_s=1)
        client.release_lease(reply.lease_id)
        assert reply.hits == 6
    finally:
        engine.shutdown()
