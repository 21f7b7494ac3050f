"""Layer-wise transfers of a client-driven transport: a real server and a real cpu_gather
context (its scatter is wrapped to hold each range of layers until the test lets it run, as a
slow copy would be).

A layer-wise retrieve lands layer after layer (``wait_layer(i)`` returns before later layers
have landed); a layer-wise store copies a layer only once the caller declared it written; a
context closed with a layer-wise store still waiting for layers fails that store and stores
nothing.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from kvxfer import CacheClient, ConfigError, LayerwiseFuture, RequestTimeout, chunk_hashes
from kvxfer_core_helpers import BLOCK_SIZE, BLOCKS_PER_CHUNK, CHUNK_SIZE, flash_attn_kv, run_python, wait_until

LAYERS = 4


def _register(client: CacheClient, model: str, seed: int = 0):
    kv = flash_attn_kv(num_layers=LAYERS, num_blocks=32, seed=seed)
    return kv, client.register(kv, model_name=model, block_size=BLOCK_SIZE, transport="cpu_gather")


def _blocks(first_chunk: int, chunks: int) -> list[int]:
    return list(range(first_chunk * BLOCKS_PER_CHUNK, (first_chunk + chunks) * BLOCKS_PER_CHUNK))


def test_a_layerwise_retrieve_lands_layer_by_layer(client: CacheClient) -> None:
    kv, ctx = _register(client, "lw-retrieve")
    hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt="lw")
    src, dst = _blocks(0, 2), _blocks(2, 2)
    assert ctx.submit_store(hashes, src).result(30).stored == [0, 1]
    gates = [threading.Event() for _ in range(LAYERS)]
    parts: list[list[int]] = []
    scatter = ctx.scatter

    def held(copies, transfer):
        layers = list(copies[0].layers)
        assert all(list(c.layers) == layers for c in copies)  # one range of layers per call
        parts.append(layers)
        gates[layers[0]].wait(30)
        return scatter(copies, transfer)

    ctx.scatter = held
    fut = ctx.submit_retrieve(hashes, dst, by_layer=True)
    assert isinstance(fut, LayerwiseFuture)
    with pytest.raises(RequestTimeout):
        fut.wait_layer(0, timeout=0.2)  # its part is held
    for i in range(LAYERS):
        gates[i].set()
        fut.wait_layer(i, timeout=30)
        assert torch.equal(kv[i][:, dst], kv[i][:, src]), f"layer {i} reported landed but differs"
        if i + 1 < LAYERS:
            assert not fut.layer_landed(i + 1)
            assert not torch.equal(kv[i + 1][:, dst], kv[i + 1][:, src])  # not copied yet
    assert fut.result(30).loaded == [0, 1]
    assert parts == [[i] for i in range(LAYERS)]
    assert client.status().reservations == 0  # its commit went out before the future resolved
    ctx.close()


@pytest.mark.parametrize(("floor_of", "max_parts", "want"), [
    (0, 64, [[0], [1], [2], [3]]),          # no floor: one layer per part
    (2, 64, [[0, 1], [2, 3]]),              # parts of at least half the transfer
    (0, 2, [[0, 1], [2, 3]]),               # max_layer_parts bounds the count
    (None, 64, [[0, 1, 2, 3]]),             # a transfer smaller than the floor is one part
])
def test_a_layerwise_retrieve_is_cut_into_parts_of_at_least_min_layer_part_bytes(
        client: CacheClient, floor_of: int | None, max_parts: int, want: list[list[int]]) -> None:
    """min_layer_part_bytes (a context's class attribute, set here on the instance) keeps the
    parts of a layer-wise transfer from being smaller than it; max_layer_parts bounds their
    count. Every layer still lands, byte-exact."""
    kv, ctx = _register(client, f"lw-parts-{floor_of}-{max_parts}", seed=3)
    hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt=f"lw-parts-{floor_of}")
    src, dst = _blocks(0, 2), _blocks(2, 2)
    assert ctx.submit_store(hashes, src).result(30).stored == [0, 1]
    nbytes = 2 * ctx.chunk_bytes
    ctx.min_layer_part_bytes = nbytes + 1 if floor_of is None else (nbytes // floor_of if floor_of else 0)
    ctx.max_layer_parts = max_parts
    parts: list[list[int]] = []
    scatter = ctx.scatter

    def recorded(copies, transfer):
        parts.append(list(copies[0].layers))
        return scatter(copies, transfer)

    ctx.scatter = recorded
    fut = ctx.submit_retrieve(hashes, dst, by_layer=True)
    for i in range(LAYERS):
        fut.wait_layer(i, timeout=30)
    assert fut.result(30).loaded == [0, 1]
    assert parts == want
    for i in range(LAYERS):
        assert torch.equal(kv[i][:, dst], kv[i][:, src])
    ctx.close()


@pytest.mark.parametrize(("layers", "mib", "floor_mib", "chunk_floor", "max_parts", "want"), [
    (32, 256, 128, 0, 8, [16, 16]),
    (32, 640, 128, 0, 8, [8, 8, 8, 8]),        # 4 parts of 160 MiB, not 7-layer parts and a 4-layer one
    (80, 384, 128, 0, 8, [40, 40]),            # none under the floor (27, 27, 26 layers had 124.8 MiB)
    (61, 256, 128, 0, 8, [61]),                # two parts would leave one under it
    (30, 64, 0, 0, 8, [4, 4, 4, 4, 4, 4, 3, 3]),  # no floor: sizes at most one layer apart
    (32, 64, 128, 0, 8, [32]),
    (32, 1024, 128, 2, 8, [16, 16]),           # 8 parts by bytes, 2 by each chunk's half (here: half of its bytes)
])
def test_layer_parts_are_even_and_none_is_under_the_floor(client: CacheClient, layers: int, mib: int, floor_mib: int,
                                                          chunk_floor: int, max_parts: int, want: list[int]) -> None:
    """The parts a layer-wise transfer is cut into: as many as keep every part at or above
    min_layer_part_bytes in all and min_layer_chunk_bytes of each chunk (``chunk_floor``: that
    floor as a fraction 1/chunk_floor of the chunk), at most max_layer_parts, their sizes at most
    one layer apart, in order and covering every layer once."""
    _, ctx = _register(client, f"lw-even-{layers}-{mib}-{floor_mib}-{chunk_floor}")
    try:
        ctx.min_layer_part_bytes = floor_mib << 20
        ctx.min_layer_chunk_bytes = ctx.chunk_bytes // chunk_floor if chunk_floor else 0
        ctx.max_layer_parts = max_parts
        ctx.layout = dataclasses.replace(ctx.layout, num_layers=layers)  # the sizing reads only the count
        groups = ctx._layer_groups(mib << 20)
        assert [len(g) for g in groups] == want
        assert [i for g in groups for i in g] == list(range(layers))
        if floor_mib:
            assert min(len(g) for g in groups) * (mib << 20) // layers >= floor_mib << 20 or len(groups) == 1
    finally:
        ctx.layout = dataclasses.replace(ctx.layout, num_layers=LAYERS)
        ctx.close()


def _worker_caught_up(ctx, salt: str) -> None:
    """Returns once the context's worker has run every job submitted before this call: a plain
    store submitted now is copied on that worker behind them (a layer-wise store's job goes as
    far as it may without more layers, and is not waited for)."""
    hashes = chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE, salt=salt)
    assert ctx.submit_store(hashes, _blocks(4, 1)).result(30).stored == [0]


def test_a_layerwise_store_copies_each_layer_once_it_is_declared_written(client: CacheClient) -> None:
    kv, ctx = _register(client, "lw-store", seed=1)
    hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt="lw-store")
    src, dst = _blocks(0, 2), _blocks(2, 2)
    fut = ctx.submit_store(hashes, src, by_layer=True)
    assert isinstance(fut, LayerwiseFuture)
    assert wait_until(lambda: client.status().reservations == 1, timeout=30, step=0.01)  # reserved at once
    g = torch.Generator().manual_seed(7)
    for i in range(LAYERS):  # the "forward pass" writes layer i, then declares it written
        # a layer copied before it is declared written would have been copied (old values) by now
        _worker_caught_up(ctx, f"lw-store-probe-{i}")
        assert not fut.done()
        kv[i][:, src] = torch.randn(kv[i][:, src].shape, generator=g).to(kv[i].dtype)
        fut.layer_ready(i)
    assert fut.result(30).stored == [0, 1]
    assert ctx.submit_retrieve(hashes, dst).result(30).loaded == [0, 1]
    for i in range(LAYERS):
        assert torch.equal(kv[i][:, dst], kv[i][:, src]), f"layer {i} was copied before it was written"
    ctx.close()


def test_closing_with_a_layerwise_store_waiting_for_layers_fails_it(client: CacheClient) -> None:
    kv, ctx = _register(client, "lw-close", seed=2)
    hashes = chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE, salt="lw-close")
    fut = ctx.submit_store(hashes, _blocks(0, 1), by_layer=True)
    fut.layer_ready(0)  # the rest never comes
    ctx.close()
    with pytest.raises(ConfigError, match="closed before every layer of a layer-wise store was declared ready"):
        fut.result(30)
    assert client.lookup("lw-close", hashes=hashes) == 0
    assert client.status().reservations == 0


def test_a_layerwise_store_cancelled_before_its_first_layer_gives_its_slots_back(client: CacheClient) -> None:
    """A layer-wise store may be cancelled until its first part is copied (after the caller's
    first ``layer_ready``), as the contract says: an engine that aborts a request before its
    forward pass wrote a layer cancels it, and its write reservation goes at once. (The future
    ran as soon as the reserve was answered, so cancel() said False, and each such store held
    its slots until the context closed: the session's byte limit then refused every store.)
    Once its first part is copied, cancel() says False and the store goes on. The server counts
    the cancelled stores' chunks as abandoned, not as failed copies."""
    kv, ctx = _register(client, "lw-cancel", seed=4)

    def not_stored() -> tuple[int, int]:  # chunks of failed copies, chunks abandoned
        traffic = [t for t in client.status().traffic if t.transport == ctx.transport.name]
        return sum(t.failed_chunks for t in traffic), sum(t.abandoned_chunks for t in traffic)

    failed, abandoned = not_stored()
    for n in range(12):
        hashes = chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE, salt=f"lw-cancel-{n}")
        fut = ctx.submit_store(hashes, _blocks(0, 1), by_layer=True)
        assert wait_until(lambda: client.status().reservations == 1, timeout=30, step=0.01)
        assert fut.cancel() and fut.cancelled()
        assert wait_until(lambda: client.status().reservations == 0, timeout=30, step=0.01), "slots kept"
    assert not_stored() == (failed, abandoned + 12)
    hashes = chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE, salt="lw-cancel-kept")
    fut = ctx.submit_store(hashes, _blocks(0, 1), by_layer=True)
    fut.layer_ready(0)
    _worker_caught_up(ctx, "lw-cancel-probe")
    assert not fut.cancel()  # its first part was copied
    fut.all_layers_ready()
    assert fut.result(30).stored == [0]
    assert client.lookup("lw-cancel", hashes=hashes) == 1
    ctx.close()


def test_a_layerwise_store_whose_future_was_dropped_is_given_up_at_close(client: CacheClient) -> None:
    """A caller that drops a layer-wise store's future without declaring its layers (a forward
    pass that raised): the store waits for its layers until the context closes (its reservation
    holds the keys meanwhile: a store of them answers 'present'), and closing the context gives
    it up, even with the future collected: its reservation goes and the chunks can be stored by
    anyone."""
    import gc

    _, ctx = _register(client, "lw-dropped", seed=3)
    hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt="lw-dropped")
    fut = ctx.submit_store(hashes, _blocks(0, 2), by_layer=True)
    wait_until(lambda: client.status().reservations == 1, timeout=30)  # reserved: waiting for layers
    del fut
    gc.collect()
    ctx.close()
    assert client.status().reservations == 0
    _, other = _register(client, "lw-dropped", seed=4)
    assert other.submit_store(hashes, _blocks(0, 2)).result(30).stored == [0, 1]
    other.close()


_MAPPED_AFTER_CLOSE = """
import gc, sys
from kvxfer import CacheClient, chunk_hashes
from kvxfer_core_helpers import BLOCK_SIZE, BLOCKS_PER_CHUNK, CHUNK_SIZE, flash_attn_kv

gc.disable()  # as an engine that freezes or turns off the collector runs
c = CacheClient(sys.argv[1])
path = c.arena_path
ctx = c.register(flash_attn_kv(num_layers=4), model_name="lw-maps", block_size=BLOCK_SIZE, transport="cpu_gather")
hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt="lw-maps")
store = ctx.submit_store(hashes, list(range(2 * BLOCKS_PER_CHUNK)), by_layer=True)
for layer in range(4):
    store.layer_ready(layer)
stored = store.result(30).stored
load = ctx.submit_retrieve(hashes, list(range(8, 8 + 2 * BLOCKS_PER_CHUNK)), by_layer=True)
print(stored, load.result(30).loaded)
del store, load
ctx.close()
c.close()
print(sum(path in line for line in open("/proc/self/maps")))
"""


def test_a_closed_context_unmaps_the_arena_after_layerwise_transfers_without_the_collector(
        client: CacheClient, tmp_path) -> None:
    """After layer-wise transfers and close(), the context's mapping of the arena is gone at once,
    with the garbage collector off. Before, the closures that queue a layer-wise transfer's parts
    held each other and the copies' slot views: the mapping (an arena's worth of shared memory,
    256 MiB in the case that showed it) stayed until a collection, never in an engine that turns
    the collector off."""
    done = run_python(_MAPPED_AFTER_CLOSE, client.url, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["[0,", "1]", "[0,", "1]", "0"], done.stdout


def test_layer_indices_are_checked(client: CacheClient) -> None:
    kv, ctx = _register(client, "lw-index", seed=3)
    fut = ctx.submit_store(chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE, salt="ix"), _blocks(0, 1), by_layer=True)
    with pytest.raises(IndexError, match="layer 4 out of range: this transfer has 4 layers"):
        fut.layer_ready(LAYERS)
    fut.all_layers_ready()
    assert fut.result(30).stored == [0]
    ctx.close()


def test_a_retrieve_that_waits_past_half_the_session_timeout_still_loads() -> None:
    """A retrieve queued behind a slow copy (here 1.5 s, against a session timeout of 2 s)
    starts its copy past half the session timeout after its reserve. Its session lived all along
    (heartbeats), so its pins held: a ping answered on that session shows it, and the retrieve
    copies and loads, byte for byte, whole and layer by layer. (Without that ping it reported
    every chunk missing; only a session the server dropped, or one resumed since the reserve,
    means the pins may have gone.)"""
    import time as _time

    from kvxfer.testing.server import ServerProcess

    with ServerProcess(l1_size="16MiB", chunk_size=CHUNK_SIZE, transports="cpu_gather",
                       extra_args=["--session-timeout", "2"]) as srv, CacheClient(srv.url, timeout=30) as c:
        kv, ctx = _register(c, "lw-slow", seed=5)
        hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt="lw-slow")
        assert ctx.submit_store(hashes, _blocks(0, 2)).result(30).stored == [0, 1]
        scatter = ctx.scatter
        slow = [True]

        def slow_first(copies, transfer):  # type: ignore[no-untyped-def]
            if slow:
                slow.clear()
                _time.sleep(1.5)
            return scatter(copies, transfer)

        ctx.scatter = slow_first  # type: ignore[method-assign]
        for by_layer in (False, True):
            slow.append(True)
            first = ctx.submit_retrieve(hashes[:1], _blocks(2, 1))
            second = ctx.submit_retrieve(hashes, _blocks(4, 2), by_layer=by_layer)
            assert first.result(30).loaded == [0]
            assert second.result(30).loaded == [0, 1], by_layer
            for layer in kv:
                assert torch.equal(layer[:, _blocks(4, 2)], layer[:, _blocks(0, 2)])
                layer[:, _blocks(4, 2)] = 0
        ctx.close()
