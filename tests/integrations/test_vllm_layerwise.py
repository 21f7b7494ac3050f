"""``kvxfer.layerwise``: loads inside the forward pass, layer by layer, through vLLM's call
sequence (MiniEngine) against a real server and a real cpu_gather context.

The proof that attention of layer i never reads layer i's blocks before they landed: the
worker's copies of layer i are held until the connector's ``wait_for_layer_load`` of layer i
is called, and 50 ms more (a real copy still in flight when a wait that returned early lets
attention start), and the forward pass checks every context block of a layer against what
computing it would have written before it writes that layer. With the wait skipped, the first
layer's check fails.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from kvxfer_vllm_harness import HarnessError, MiniEngine, Request, feed, make_vllm_config, workload

from kvxfer.testing.server import ServerProcess

CHUNK = 16
#: How long a layer's copy is held after its wait began: a wait that does not wait for the copy
#: has attention read before the copy ends, every time (without it the copy, released at the
#: wait, usually won the race, and a wait that returned early passed in a third of the runs).
HELD_S = 0.05


def _stored_then_loaded(server: ServerProcess, model: str, **kw: object) -> tuple[MiniEngine, list[Request]]:
    """An engine whose first pass stored some prefixes; returns it with a second pass of the same
    prompts (no local prefix cache: every hit comes from kvxfer, loaded in the step that uses it)."""
    engine = MiniEngine(make_vllm_config(server.url, model_name=model, layerwise=True),
                        enable_prefix_caching=False, **kw)  # type: ignore[arg-type]
    first = workload(model, n=8, seed=3)
    feed(engine, first, per_step=4)
    return engine, [Request(f"again-{r.request_id}", list(r.prompt_token_ids)) for r in first]


def _scheduler(server: ServerProcess, engine: MiniEngine, model: str, layerwise: bool) -> Any:
    from kvxfer_vllm_harness import KVCacheConfig, KVCacheGroupSpec

    from kvxfer.integrations.vllm import KvxferConnector
    from kvxfer.integrations.vllm._compat import KVConnectorRole

    return KvxferConnector(make_vllm_config(server.url, model_name=model, layerwise=layerwise),
                           KVConnectorRole.SCHEDULER, KVCacheConfig(96, [KVCacheGroupSpec(list(engine.layer_names))]))


def test_layerwise_loads_run_in_the_step_and_keep_kv_correct(server: ServerProcess) -> None:
    engine, again = _stored_then_loaded(server, "lw-replay")
    try:
        feed(engine, again, per_step=4)
        engine.check_drained()
        work = engine.worker.worker.stats
        assert work["loaded_chunks"] > 0 and work["stored_chunks"] > 0
        assert engine.load_error_blocks == 0 and work["failed_load_blocks"] == 0
        assert engine.reported_recving == set()  # synchronous loads: never in finished_recving
        loaded = {op.req_id for op in engine.loads if op.keys}
        assert {r.request_id for r in again if len(r.prompt_token_ids) >= CHUNK} <= loaded
    finally:
        engine.shutdown()


def _hold_layers_until_waited(engine: MiniEngine) -> tuple[list[threading.Event], list[int]]:
    """Hold each layer's part of every load until the connector waits for that layer."""
    worker = engine.worker.worker
    ctx = worker.contexts[0]  # one KV cache group
    gates = [threading.Event() for _ in engine.layer_names]
    seen: list[int] = []
    scatter, wait = ctx.scatter, worker.wait_for_layer_load

    def held(copies, transfer):  # type: ignore[no-untyped-def]
        first = copies[0].first_layer
        seen.append(first)
        if not gates[first].wait(30):
            raise TimeoutError(f"layer {first} was never waited for")
        time.sleep(HELD_S)  # still copying when a wait that returned too soon lets attention read
        return scatter(copies, transfer)

    def opening(layer_name: str) -> None:
        gates[engine.layer_names.index(layer_name)].set()
        wait(layer_name)

    ctx.scatter = held  # type: ignore[method-assign]
    worker.wait_for_layer_load = opening  # type: ignore[method-assign]
    return gates, seen


def test_attention_of_a_layer_waits_until_its_blocks_landed(server: ServerProcess) -> None:
    engine, again = _stored_then_loaded(server, "lw-order", num_layers=3)
    gates, seen = _hold_layers_until_waited(engine)
    try:
        feed(engine, again, per_step=4)  # every forward pass checks each layer's context KV
        engine.check_drained()
        assert engine.worker.worker.stats["loaded_chunks"] > 0
        assert seen and set(seen) == {0, 1, 2}  # the loads were moved one layer per copy
    finally:
        for g in gates:
            g.set()
        engine.shutdown()


def test_without_the_wait_attention_reads_blocks_that_have_not_landed(server: ServerProcess) -> None:
    engine, again = _stored_then_loaded(server, "lw-nowait", num_layers=3)
    gates, _ = _hold_layers_until_waited(engine)
    engine.worker.wait_for_layer_load = lambda layer_name: None  # type: ignore[method-assign]  # a connector that skips the wait
    try:
        with pytest.raises(HarnessError, match="attention of layer 0 read wrong KV .* had not landed"):
            feed(engine, again, per_step=4)
    finally:
        for g in gates:
            g.set()
        engine.shutdown()


def test_a_store_never_reads_blocks_another_requests_load_fills_in_that_step(server: ServerProcess) -> None:
    """A layer-by-layer load is synchronous: vLLM counts its blocks computed at once, and its
    prefix cache gives them to another request scheduled in the same step. That request's
    store of those chunks would read them in the step that fills them, and store garbage for
    every engine if the load failed (seen in real vLLM with a server restarted between lookup
    and load). The store stops before them in that step; the next step stores them. So do the
    chunks the loading request itself computes in that step (they attend to the loaded prefix).
    The scheduler's calls as vLLM makes them, with the harness's stand-ins for vLLM's objects."""
    from kvxfer_vllm_harness import (
        CachedRequestData,
        KVCacheBlocks,
        NewRequestData,
        SchedulerOutput,
    )

    engine, _ = _stored_then_loaded(server, "same-step")  # the server has the workload's prefixes
    try:
        stored = next(r for r in workload("same-step", n=8, seed=3) if len(r.prompt_token_ids) >= 3 * CHUNK)
        prefix = stored.prompt_token_ids[:2 * CHUNK]
        sched = _scheduler(server, engine, "same-step", layerwise=True)
        try:
            bpc = CHUNK // engine.bs
            a = Request("A", prefix + list(range(700, 700 + CHUNK)) + [1, 2, 3])
            ext, is_async = sched.get_num_new_matched_tokens(a, 0)
            assert (ext, is_async) == (2 * CHUNK, False)  # a synchronous (layer-by-layer) load
            a_blocks = list(range(10, 10 + 3 * bpc + 1))
            sched.update_state_after_alloc(a, KVCacheBlocks((a_blocks,)), ext)
            # B: vLLM's prefix cache hit on A's first two chunks' blocks, in the same step
            b = Request("B", prefix + list(range(900, 900 + CHUNK)) + [4])
            local = 2 * CHUNK
            assert sched.get_num_new_matched_tokens(b, local)[0] == 0
            b_blocks = a_blocks[:2 * bpc] + list(range(50, 50 + bpc + 1))
            sched.update_state_after_alloc(b, KVCacheBlocks((b_blocks,)), 0)
            out = SchedulerOutput([NewRequestData("A", a.prompt_token_ids, (a_blocks,), ext),
                                   NewRequestData("B", b.prompt_token_ids, (b_blocks,), local)],
                                  CachedRequestData([], set(), [], []), {"A": CHUNK + 3, "B": CHUNK + 1}, 2 * CHUNK + 4,
                                  set())
            meta = sched.build_connector_meta(out)
            assert [op.req_id for op in meta.loads] == ["A"]
            assert not meta.stores, meta.stores  # neither B's chunks on A's blocks, nor A's third chunk
            # the next step (the load has landed): B's chunks are stored from its first, A's third
            out = SchedulerOutput([], CachedRequestData(["A", "B"], set(), [None, None],
                                                        [3 * CHUNK + 3, local + CHUNK + 1]), {"A": 1, "B": 1}, 2, set())
            meta = sched.build_connector_meta(out)
            stores = {op.req_id: op for op in meta.stores}
            assert stores["B"].block_ids == b_blocks[:3 * bpc] and len(stores["B"].keys) == 3
            assert stores["A"].block_ids == a_blocks[2 * bpc:3 * bpc] and len(stores["A"].keys) == 1
        finally:
            sched.shutdown()
    finally:
        engine.shutdown()


def test_nothing_computed_over_the_blocks_of_a_failed_load_is_stored(server: ServerProcess) -> None:
    """A layer-by-layer load fails (vLLM hears of it from the step's invalid_block_ids), after
    vLLM's prefix cache handed its blocks to another request of that step. vLLM rolls the loader
    back to recompute them, but leaves the other request counting them as computed, and keeps
    them in its prefix cache. Neither request stores anything more (before, the sharer stored
    the loader's blocks before they were computed again, and its own later chunks, for every
    engine: seen in real vLLM), nor does a request that takes them from the prefix cache before
    they are computed again; one that takes them after stores as usual."""
    from types import SimpleNamespace

    from kvxfer_vllm_harness import (
        CachedRequestData,
        KVCacheBlocks,
        NewRequestData,
        SchedulerOutput,
    )

    engine, _ = _stored_then_loaded(server, "failed-step")
    try:
        stored = next(r for r in workload("failed-step", n=8, seed=3) if len(r.prompt_token_ids) >= 3 * CHUNK)
        prefix = stored.prompt_token_ids[:2 * CHUNK]
        sched = _scheduler(server, engine, "failed-step", layerwise=True)
        try:
            bpc = CHUNK // engine.bs
            a = Request("A", prefix + list(range(700, 700 + CHUNK)) + [1, 2, 3])
            ext, _ = sched.get_num_new_matched_tokens(a, 0)
            a_blocks = list(range(10, 10 + 3 * bpc + 1))
            sched.update_state_after_alloc(a, KVCacheBlocks((a_blocks,)), ext)
            b = Request("B", prefix + list(range(900, 900 + CHUNK)) + [4])
            local = 2 * CHUNK
            assert sched.get_num_new_matched_tokens(b, local)[0] == 0
            b_blocks = a_blocks[:2 * bpc] + list(range(50, 50 + bpc + 1))
            sched.update_state_after_alloc(b, KVCacheBlocks((b_blocks,)), 0)
            out = SchedulerOutput([NewRequestData("A", a.prompt_token_ids, (a_blocks,), ext),
                                   NewRequestData("B", b.prompt_token_ids, (b_blocks,), local)],
                                  CachedRequestData([], set(), [], []), {"A": CHUNK + 3, "B": CHUNK + 1},
                                  2 * CHUNK + 4, set())
            assert [op.req_id for op in sched.build_connector_meta(out).loads] == ["A"]
            # the load failed: vLLM rolls A back to its first block, B back to before the step
            sched.update_connector_output(SimpleNamespace(invalid_block_ids=set(a_blocks[:2 * bpc])))
            # A computes its first chunk again, B goes on: nothing of either is stored
            out = SchedulerOutput([], CachedRequestData(["A", "B"], set(), [None, None], [0, local]),
                                  {"A": CHUNK, "B": CHUNK + 1}, 2 * CHUNK + 1, set())
            assert sched.build_connector_meta(out).stores == []
            # C takes A's second chunk's blocks (not computed again yet) from the prefix cache: it
            # stores nothing; D, once A computed them again, stores as usual
            for rid, base in (("C", 60), ("D", 70)):
                r = Request(rid, prefix + list(range(base * 10, base * 10 + CHUNK)) + [5])
                assert sched.get_num_new_matched_tokens(r, local)[0] == 0
                r_blocks = a_blocks[:2 * bpc] + list(range(base, base + bpc + 1))
                sched.update_state_after_alloc(r, KVCacheBlocks((r_blocks,)), 0)
                out = SchedulerOutput([NewRequestData(rid, r.prompt_token_ids, (r_blocks,), local)],
                                      CachedRequestData(["A"], set(), [None], [CHUNK]), {rid: CHUNK + 1, "A": CHUNK},
                                      2 * CHUNK + 1, set())
                stores = {op.req_id: op for op in sched.build_connector_meta(out).stores}
                if rid == "C":
                    assert stores == {}, stores  # and A, whose load failed, stores nothing more
                else:
                    assert set(stores) == {"D"} and len(stores["D"].keys) == 3, stores
        finally:
            sched.shutdown()
    finally:
        engine.shutdown()


def test_a_request_vllm_cannot_admit_yet_is_looked_up_once_while_its_lease_holds(server: ServerProcess) -> None:
    """vLLM asks again each step about a request it could not admit (no free blocks). The answer
    stands while its lease has more than half its time left and vLLM's own hit is the same: no
    lookup and no lease release per step (each was two requests to the server, and counted
    again in the lookup figures). Another own hit asks the server again."""
    from kvxfer_vllm_harness import KVCacheBlocks, KVCacheConfig, KVCacheGroupSpec

    from kvxfer import CacheClient
    from kvxfer.integrations.vllm import KvxferConnector
    from kvxfer.integrations.vllm._compat import KVConnectorRole

    engine, _ = _stored_then_loaded(server, "not-yet")
    try:
        stored = next(r for r in workload("not-yet", n=8, seed=3) if len(r.prompt_token_ids) >= 3 * CHUNK)
        cfg = make_vllm_config(server.url, model_name="not-yet")
        sched = KvxferConnector(cfg, KVConnectorRole.SCHEDULER,
                                KVCacheConfig(96, [KVCacheGroupSpec(list(engine.layer_names))]))
        try:
            r = Request("R", list(stored.prompt_token_ids))
            first = sched.get_num_new_matched_tokens(r, 0)
            assert first[0] and first[0] >= 2 * CHUNK
            with CacheClient(server.url) as observer:
                leases = observer.status().leases
                for _ in range(5):  # five steps without room
                    assert sched.get_num_new_matched_tokens(r, 0) == first
                assert observer.status().leases == leases
            assert sched.scheduler.stats["lookups"] == 1
            assert sched.get_num_new_matched_tokens(r, CHUNK)[0] == first[0] - CHUNK  # another own hit: asked
            assert sched.scheduler.stats["lookups"] == 2
            asked = sched.scheduler.stats["lookups"] + sched.scheduler.stats["unanswered_lookups"]
            sched.scheduler.link.down = True  # the server stopped answering: the last answer no longer stands
            sched.get_num_new_matched_tokens(r, CHUNK)
            assert sched.scheduler.stats["lookups"] + sched.scheduler.stats["unanswered_lookups"] == asked + 1
            sched.scheduler.link.down = False
            assert sched.get_num_new_matched_tokens(r, CHUNK)[0] == first[0] - CHUNK
            bpc = CHUNK // engine.bs
            blocks = list(range(10, 10 + len(r.prompt_token_ids) // engine.bs + 1))
            sched.update_state_after_alloc(r, KVCacheBlocks((blocks,)), first[0] - CHUNK)
            [load] = sched.scheduler._loads  # past vLLM's own chunk, under the last lookup's lease
            assert load.block_ids[:bpc] == blocks[bpc:2 * bpc] and load.lease_id
        finally:
            sched.shutdown()
    finally:
        engine.shutdown()


def test_a_block_a_failed_load_left_stays_bad_until_computed_to_its_end(server: ServerProcess) -> None:
    """The loader computes a failed layer-by-layer load's first chunk again, but the step's
    token budget ends 2 tokens before the chunk's last block does: that block still holds
    garbage past them, and a request that takes the chunk from vLLM's prefix cache then stores
    nothing (before, the block counted as written once the step began it)."""
    from types import SimpleNamespace

    from kvxfer_vllm_harness import CachedRequestData, KVCacheBlocks, NewRequestData, SchedulerOutput

    engine, _ = _stored_then_loaded(server, "half-filled")
    try:
        stored = next(r for r in workload("half-filled", n=8, seed=3) if len(r.prompt_token_ids) >= 3 * CHUNK)
        prefix = stored.prompt_token_ids[:2 * CHUNK]
        sched = _scheduler(server, engine, "half-filled", layerwise=True)
        try:
            bpc = CHUNK // engine.bs
            a = Request("A", prefix + list(range(700, 700 + CHUNK)) + [1, 2, 3])
            ext, _ = sched.get_num_new_matched_tokens(a, 0)
            a_blocks = list(range(10, 10 + 3 * bpc + 1))
            sched.update_state_after_alloc(a, KVCacheBlocks((a_blocks,)), ext)
            sched.build_connector_meta(SchedulerOutput([NewRequestData("A", a.prompt_token_ids, (a_blocks,), ext)],
                                                       CachedRequestData([], set(), [], []), {"A": CHUNK + 3},
                                                       CHUNK + 3, set()))
            sched.update_connector_output(SimpleNamespace(invalid_block_ids=set(a_blocks[:bpc])))
            sched.build_connector_meta(SchedulerOutput([], CachedRequestData(["A"], set(), [None], [0]),
                                                       {"A": CHUNK - 2}, CHUNK - 2, set()))
            c = Request("C", prefix + list(range(600, 600 + CHUNK)) + [5])
            assert sched.get_num_new_matched_tokens(c, 2 * CHUNK)[0] == 0
            c_blocks = a_blocks[:2 * bpc] + list(range(60, 60 + bpc + 1))
            sched.update_state_after_alloc(c, KVCacheBlocks((c_blocks,)), 0)
            meta = sched.build_connector_meta(SchedulerOutput(
                [NewRequestData("C", c.prompt_token_ids, (c_blocks,), 2 * CHUNK)], CachedRequestData([], set(), [], []),
                {"C": CHUNK + 1}, CHUNK + 1, set()))
            assert meta.stores == [], "C stored chunks over a block its loader had computed only in part"
        finally:
            sched.shutdown()
    finally:
        engine.shutdown()


def test_a_load_into_a_failed_loads_block_ids_clears_them(server: ServerProcess) -> None:
    """vLLM frees the blocks of a failed asynchronous load, and may give their ids to another
    request's load, which fills them: that request stores its later chunks as usual (before,
    the ids stayed bad for good, and every request that got one stored nothing)."""
    from types import SimpleNamespace

    from kvxfer_vllm_harness import CachedRequestData, KVCacheBlocks, NewRequestData, SchedulerOutput

    engine, _ = _stored_then_loaded(server, "refilled")
    try:
        stored = next(r for r in workload("refilled", n=8, seed=3) if len(r.prompt_token_ids) >= 3 * CHUNK)
        prefix = stored.prompt_token_ids[:2 * CHUNK]
        sched = _scheduler(server, engine, "refilled", layerwise=False)
        try:
            bpc = CHUNK // engine.bs
            sched.update_connector_output(SimpleNamespace(invalid_block_ids=set(range(10, 10 + 2 * bpc))))
            e = Request("E", prefix + list(range(800, 800 + CHUNK)) + [6])
            ext, is_async = sched.get_num_new_matched_tokens(e, 0)
            assert (ext, is_async) == (2 * CHUNK, True)
            e_blocks = list(range(10, 10 + 2 * bpc)) + list(range(70, 70 + bpc + 1))
            sched.update_state_after_alloc(e, KVCacheBlocks((e_blocks,)), ext)
            meta = sched.build_connector_meta(SchedulerOutput([], CachedRequestData([], set(), [], []), {}, 0, set()))
            assert [op.req_id for op in meta.loads] == ["E"]
            # the load landed (finished_recving): vLLM schedules E as new, its prefix computed
            meta = sched.build_connector_meta(SchedulerOutput(
                [NewRequestData("E", e.prompt_token_ids, (e_blocks,), ext)], CachedRequestData([], set(), [], []),
                {"E": CHUNK + 1}, CHUNK + 1, set()))
            assert [(op.req_id, len(op.keys)) for op in meta.stores] == [("E", 1)], meta.stores
        finally:
            sched.shutdown()
    finally:
        engine.shutdown()
