"""The worker side on its own against a real server: what get_finished and
get_block_ids_with_load_errors report, and when."""

from __future__ import annotations

import time

import torch
from kvxfer_vllm_harness import KVCacheConfig, KVCacheGroupSpec, make_vllm_config

from kvxfer import chunk_hashes
from kvxfer.integrations.vllm import KvxferConnector, KvxferConnectorMetadata, LoadOp, StoreOp
from kvxfer.integrations.vllm._compat import KVConnectorRole
from kvxfer.testing.server import ServerProcess

CHUNK, BS, BLOCKS = 16, 4, 32


def _step(worker: KvxferConnector, meta: KvxferConnectorMetadata, finished: set[str],
          forward: bool = True) -> tuple[set[str] | None, set[str] | None, set[int]]:
    worker.handle_preemptions(meta)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    if forward:
        worker.wait_for_save()
    sending, recving = worker.get_finished(finished)
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    return sending, recving, errors


def _until(worker: KvxferConnector, finished: set[str], want_send: set[str], want_recv: set[str],
           first: tuple[set[str] | None, set[str] | None, set[int]] | None = None) -> set[int]:
    """Empty steps until the wanted reports came, each exactly once; returns the load errors.
    ``first``: what the step that submitted the transfer returned (a load may land within it)."""
    sent, recv, errors = set(), set(), set()
    if first is not None:
        sent |= set(first[0] or ())
        recv |= set(first[1] or ())
        errors |= first[2]
    for _ in range(2000):
        s, r, e = _step(worker, KvxferConnectorMetadata(CHUNK), finished, forward=False)
        finished = set()
        assert not (set(s or ()) & sent) and not (set(r or ()) & recv), "reported twice"
        sent |= set(s or ())
        recv |= set(r or ())
        errors |= e
        if sent >= want_send and recv >= want_recv:
            break
        time.sleep(0.002)
    assert (sent, recv) == (want_send, want_recv)
    for _ in range(3):  # and never again
        assert _step(worker, KvxferConnectorMetadata(CHUNK), set(), forward=False)[:2] == (None, None)
    return errors


def test_stores_report_once_after_finish_and_loads_report_errors(server: ServerProcess) -> None:
    cfg = make_vllm_config(server.url, model_name="worker-unit")
    kv = {f"l{i}": torch.randn(2, BLOCKS, BS, 2, 4) for i in range(2)}
    worker = KvxferConnector(cfg, KVConnectorRole.WORKER, KVCacheConfig(BLOCKS, [KVCacheGroupSpec(list(kv))]))
    try:
        worker.register_kv_caches(kv)
        keys = chunk_hashes(list(range(3 * CHUNK)), CHUNK)
        # step 1: store chunks 0-1 of request "a" from blocks 0-7; "a" is not finished yet
        s, r, e = _step(worker, KvxferConnectorMetadata(CHUNK, stores=[StoreOp("a", keys[:2], list(range(8)))]),
                        set())
        assert (s, r, e) == (None, None, set())
        # "a" finishes: reported in finished_sending once its stores are done, and only once
        _until(worker, {"a"}, {"a"}, set())
        assert worker.worker.stats["stored_chunks"] == 2

        # load chunks 0-1 into blocks 8-15, vLLM having computed the first block itself
        before = {n: t[:, 8].clone() for n, t in kv.items()}
        meta = KvxferConnectorMetadata(CHUNK, loads=[LoadOp("b", keys[:2], list(range(8, 16)), skip_tokens=BS)])
        first = _step(worker, meta, set())
        assert _until(worker, set(), set(), {"b"}, first) == set()
        for n, t in kv.items():
            assert torch.equal(t[:, 8], before[n]), "the skipped block was written"
            assert torch.equal(t[:, 9:16], t[:, 1:8])

        # chunk 2 was never stored: its blocks are reported, the loaded chunk's are not
        meta = KvxferConnectorMetadata(CHUNK, loads=[LoadOp("c", keys[1:3], list(range(16, 24)))])
        first = _step(worker, meta, set())
        assert _until(worker, set(), set(), {"c"}, first) == set(range(20, 24))
        # a finished request without stores is never reported
        assert _step(worker, KvxferConnectorMetadata(CHUNK), {"c", "zzz"}, forward=False)[:2] == (None, None)
    finally:
        worker.shutdown()


def test_preemption_waits_for_pending_stores_and_forgets_the_request(server: ServerProcess) -> None:
    cfg = make_vllm_config(server.url, model_name="worker-preempt")
    kv = {"l0": torch.randn(2, BLOCKS, BS, 2, 4)}
    worker = KvxferConnector(cfg, KVConnectorRole.WORKER, KVCacheConfig(BLOCKS, [KVCacheGroupSpec(list(kv))]))
    try:
        worker.register_kv_caches(kv)
        keys = chunk_hashes(list(range(100, 100 + 4 * CHUNK)), CHUNK)
        _step(worker, KvxferConnectorMetadata(CHUNK, stores=[StoreOp("p", keys, list(range(16)))]), set())
        # next step: "p" preempted; by the end of handle_preemptions its store is done
        worker.handle_preemptions(KvxferConnectorMetadata(CHUNK, preempted=["p"]))
        assert worker.worker.stats["stored_chunks"] == 4
        # its blocks are vLLM's again: a later finish of "p" is not reported as a send
        assert _step(worker, KvxferConnectorMetadata(CHUNK, preempted=["p"]), {"p"}, forward=False)[:2] == (None, None)
    finally:
        worker.shutdown()
