"""Conformance: bit-exact store/retrieve over every claimed layout (the older kinds, and current
vLLM's bhnc views) and dtype, dedupe, partial hits, skip_first_n_tokens, ordering and request
validation."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import pytest
import torch

from kvxfer.errors import ConfigError
from kvxfer.layout import LayoutKind
from kvxfer.testing.harness import BLOCK_SIZE, CHUNK_SIZE, DTYPES, LAYOUTS, TIMEOUT, VIEWS, Kit, Layout, layout_id
from kvxfer.testing.kvdata import KVBytes, KVSpec, View, as_bytes, describe_diff, equal_bytes, put_chunks
from kvxfer.transport.contract import LayerwiseFuture, TransferContext

__all__ = ["RoundTripTests", "assert_retrieved"]

#: Every older layout with every dtype, and each bhnc view with its dtype (harness.VIEWS).
COMBOS: list[tuple[Layout, str]] = [*((k, d) for k in LAYOUTS for d in DTYPES), *VIEWS]
#: Cross-layer buffers in which other layers' pages, and padding, lie between a layer's pages.
OUTSIDE = [View("BLNHC", page_pad=40), View("BHLNC")]
#: Layer-wise transfers: the transport's first layout, and layers interleaved and padded.
LAYERWISE: list[Layout | None] = [None, View("BLNHC", page_pad=40)]
#: (block_size, heads, head_size, dtype): rows of 1, 6, 8, 12 and 24 bytes (copied as uint8,
#: int16, int64, int32 and int64 elements), and 32, 16 and 8 blocks per chunk.
ODD_ROWS: list[tuple[int, int, int, str]] = [(1, 1, 1, "float8_e4m3fn"), (2, 1, 3, "float8_e5m2"),
                                              (4, 1, 1, "float16"), (1, 3, 1, "float32"), (2, 3, 1, "bfloat16")]
#: Seconds the kit watches memory a finished transfer must no longer write.
LATE_S = 0.3
#: Seconds between the layers of a layer-wise store the kit declares written.
LAYER_S = 0.02


def assert_retrieved(kit: Kit, spec: KVSpec, layers: Sequence[torch.Tensor], before: KVBytes,
                     blocks: Sequence[int], chunks: torch.Tensor, skip_blocks: int = 0,
                     only: Sequence[int] | None = None) -> None:
    """``layers`` (after a retrieve into ``blocks``) equal ``before`` (:func:`as_bytes` of the
    same layers) with exactly ``chunks`` written where a correct retrieve writes them, bit for
    bit, and nothing else changed: not another block, not a byte of the memory behind the layers
    outside their pages (padding, the pages of layers not registered)."""
    want = before.clone()
    put_chunks(want, spec, blocks, spec.blocks_per_chunk(CHUNK_SIZE), chunks, skip_blocks, only)
    got = as_bytes(layers)
    assert equal_bytes(got, want), f"KV cache after retrieve differs: {describe_diff(got, want, spec)}"


def refill(kit: Kit, spec: KVSpec, layers: Sequence[torch.Tensor]) -> None:
    """New random bytes in every page of ``layers``, in place (as the engine writes its cache:
    the memory outside the pages, padding and unregistered layers, is left as it was)."""
    for layer, fresh in zip(layers, kit.kv(spec)):
        layer.copy_(fresh)


def _arena_filler(kit: Kit) -> tuple[KVSpec, list[torch.Tensor], TransferContext, int]:
    """A registered cache of wide chunks, to fill the arena with few requests: ``(spec, layers,
    context, bytes of a chunk)``."""
    spec = kit.spec(heads=8, head_size=64, num_blocks=64)
    layers = kit.kv(spec)
    ctx = kit.register(layers, spec)
    return spec, layers, ctx, ctx.layout.chunk_bytes(CHUNK_SIZE)


def _layers_differ(got: torch.Tensor, want: torch.Tensor, upto: int | None = None) -> str:
    """Which layers of ``got`` (``[chunks, layers, ...]`` bytes, as :meth:`Kit.chunks_of`) differ
    from ``want``, for the first ``upto``; one that holds another layer's bytes is named so (a
    copy of a range of layers that ignores ``RowCopy.first_layer`` writes from layer 0)."""
    n = got.shape[1] if upto is None else upto
    parts = []
    for i in range(n):
        if torch.equal(got[:, i], want[:, i]):
            continue
        other = next((j for j in range(want.shape[1]) if j != i and torch.equal(got[:, i], want[:, j])), None)
        if other is not None:
            parts.append(f"layer {i} holds layer {other}'s bytes (does the copy of a range of layers honour "
                         "RowCopy.first_layer, the range's first layer?)")
        else:
            parts.append(f"layer {i} differs (a layer copied before its layer_ready, or not copied?)")
    return "; ".join(parts) or "no layer differs"


def round_trip(kit: Kit, spec: KVSpec) -> None:
    """Random bytes from 3 random blocks of a cache of ``spec``, stored (the cache unchanged),
    checked in the server through the backdoor, then retrieved into 3 other random blocks of the
    same cache, bit for bit, nothing else of the memory behind the layers changed."""
    layers = kit.kv(spec)
    ctx = kit.register(layers, spec)
    keys = kit.keys(3)
    src = kit.blocks(spec, 3)
    before = as_bytes(layers)
    want = kit.chunks_of(before, spec, src)

    res = kit.store(ctx, keys, src)
    assert (res.stored, res.present, res.failed) == ([0, 1, 2], [], [])
    assert res.ok
    assert equal_bytes(as_bytes(layers), before), "a store must not modify the KV cache"
    held_res, held = kit.backdoor_read(spec, keys)
    assert held_res.loaded == [0, 1, 2]
    assert equal_bytes(held, want), "the server does not hold the canonical chunk bytes"

    dst = kit.blocks(spec, 3, exclude=src)
    got = kit.retrieve(ctx, keys, dst)
    assert (got.loaded, got.missing) == ([0, 1, 2], [])
    assert got.ok
    assert_retrieved(kit, spec, layers, before, dst, want)


class RoundTripTests:
    @pytest.mark.parametrize("layout,dtype", COMBOS, ids=[f"{layout_id(k)}-{d}" for k, d in COMBOS])
    def test_round_trip_is_bit_exact(self, kit: Kit, layout: Layout, dtype: str) -> None:
        """Random bytes (NaN payloads included) from random blocks, stored, checked in the server
        through the backdoor, then retrieved into other random blocks of the same cache; nothing
        else of the memory behind the layers changes."""
        round_trip(kit, kit.spec(layout, dtype))

    def test_round_trip_of_planes_that_are_not_adjacent(self, kit: Kit) -> None:
        """A flash_attn cache whose V plane starts 64 bytes after its K plane ends: its row view
        has rows closer than their length (they overlap in the view; a block's rows never do).
        Bit-exact both ways, and the 64 bytes between the planes are never written."""
        round_trip(kit, kit.spec(LayoutKind.FLASH_ATTN, plane_pad=64))

    @pytest.mark.parametrize("view", LAYERWISE, ids=["default", "bhnc-BLNHC-pad40"])
    def test_layer_by_layer_round_trip(self, kit: Kit, view: Layout | None) -> None:
        """A store and a retrieve moved layer by layer (``by_layer=True``, the vLLM connector's
        ``kvxfer.layerwise``): the store's layers declared written one at a time, the
        retrieve's waited for one at a time. A transport that claims ``layer_ranges`` is handed
        one range of layers per call (``RowCopy.first_layer``, ``slot`` holding only those
        layers): each must land in its own layers, bit for bit, and nothing else be written;
        each layer must have landed when ``wait_layer`` returns for it."""
        spec = kit.spec(view, num_layers=4)
        layers = kit.kv(spec)
        ctx = kit.register(layers, spec)
        keys, src = kit.keys(3), kit.blocks(spec, 3)
        written = kit.kv(spec)  # what the forward pass writes, a layer at a time, after the submit

        stored = ctx.submit_store(keys, src, by_layer=True)
        assert isinstance(stored, LayerwiseFuture)
        for layer in range(spec.num_layers):
            time.sleep(LAYER_S)  # the layer's compute: a copy of it started before layer_ready reads old bytes
            layers[layer].copy_(written[layer])
            stored.layer_ready(layer)
        assert stored.result(timeout=TIMEOUT).stored == [0, 1, 2]
        before = as_bytes(layers)
        want = kit.chunks_of(before, spec, src)
        held_res, held = kit.backdoor_read(spec, keys)
        assert held_res.loaded == [0, 1, 2]
        if not equal_bytes(held, want):  # (raised, not asserted: the message says which layers, no tensor dump)
            raise AssertionError("a layer-wise store left other bytes in the server than its layers held once each "
                                 f"was declared written: {_layers_differ(held, want)}")

        dst = kit.blocks(spec, 3, exclude=src)
        loading = ctx.submit_retrieve(keys, dst, by_layer=True)
        assert isinstance(loading, LayerwiseFuture)
        for layer in range(spec.num_layers):
            loading.wait_layer(layer, timeout=TIMEOUT)
            landed = kit.chunks_of(as_bytes(layers), spec, dst)  # read now: the layer may be used now
            if not equal_bytes(landed[:, layer], want[:, layer]):
                raise AssertionError(f"wait_layer({layer}) returned before layer {layer} had landed: "
                                     f"{_layers_differ(landed, want, upto=layer + 1)}")
        got = loading.result(timeout=TIMEOUT)
        assert (got.loaded, got.missing) == ([0, 1, 2], [])
        assert_retrieved(kit, spec, layers, before, dst, want)

    @pytest.mark.parametrize("block_size,heads,head_size,dtype", ODD_ROWS,
                             ids=[f"b{b}-h{h}x{d}-{t}" for b, h, d, t in ODD_ROWS])
    @pytest.mark.parametrize("kind", [LayoutKind.FLASH_ATTN, LayoutKind.FLASHINFER, LayoutKind.MLA],
                             ids=lambda k: k.value)
    def test_rows_of_any_width_and_blocks_of_any_size_round_trip(self, kit: Kit, kind: LayoutKind, block_size: int,
                                                                 heads: int, head_size: int, dtype: str) -> None:
        """Rows that are no multiple of 16 bytes (down to one byte) and chunks of 8 to 32
        blocks, a first chunk cut by a skip: bit-exact both ways, nothing else written."""
        spec = kit.spec(kind, dtype, block_size=block_size, heads=heads, head_size=head_size,
                        num_blocks=4 * CHUNK_SIZE // block_size)
        layers = kit.kv(spec)
        ctx = kit.register(layers, spec)
        keys, src = kit.keys(2), kit.blocks(spec, 2)
        before = as_bytes(layers)
        assert kit.store(ctx, keys, src).stored == [0, 1]
        _, held = kit.backdoor_read(spec, keys)
        assert equal_bytes(held, kit.chunks_of(before, spec, src)), "the server does not hold the chunks' bytes"
        dst = kit.blocks(spec, 2, exclude=src)
        assert kit.retrieve(ctx, keys, dst, skip_first_n_tokens=block_size).loaded == [0, 1]
        assert_retrieved(kit, spec, layers, before, dst, kit.chunks_of(before, spec, src), skip_blocks=1)

    def test_a_finished_transfer_writes_nothing_after_it(self, kit: Kit) -> None:
        """Once a store's future has resolved its slots are the server's and its blocks the
        engine's again: the chunks read back the same a while later, though the engine wrote new
        bytes into those blocks at once, across other transfers of the context. Once a
        retrieve's has, the blocks are the engine's: they hold what it wrote into them at once,
        a while later. (A transport that finished or repeated a copy late, on a thread of its
        own, would change chunks every engine loads, or blocks the engine has written since.)"""
        spec = kit.spec()
        layers = kit.kv(spec)
        ctx = kit.register(layers, spec)
        keys, src = kit.keys(3), kit.blocks(spec, 3)
        want = kit.chunks_of(layers, spec, src)
        assert kit.store(ctx, keys, src).stored == [0, 1, 2]
        refill(kit, spec, layers)  # the engine reuses the stored blocks at once
        dst = kit.blocks(spec, 3, exclude=src)
        assert kit.retrieve(ctx, keys, dst).loaded == [0, 1, 2]
        refill(kit, spec, layers)  # the engine computes into the loaded blocks at once
        after = as_bytes(layers)
        others = kit.keys(1)
        assert kit.store(ctx, others, src[:spec.blocks_per_chunk(CHUNK_SIZE)]).stored == [0]
        time.sleep(LATE_S)
        _, held = kit.backdoor_read(spec, keys)
        assert equal_bytes(held, want), f"the stored chunks changed in the server within {LATE_S} s of the store"
        assert equal_bytes(as_bytes(layers), after), f"the KV cache changed within {LATE_S} s of the retrieve"

    @pytest.mark.parametrize("view", [None, *OUTSIDE], ids=["default", "bhnc-BLNHC-pad40", "bhnc-BHLNC"])
    def test_a_store_stores_what_the_cache_holds_when_it_is_submitted(self, kit: Kit, view: Layout | None) -> None:
        """The engine fills its cache after registering it: a store moves the bytes its blocks
        hold when it is submitted, not those of registration time (a transport that read strided
        layers through a copy made at registration would store stale bytes)."""
        spec = kit.spec(view)
        layers = kit.kv(spec)
        ctx = kit.register(layers, spec)
        refill(kit, spec, layers)
        keys, src = kit.keys(2), kit.blocks(spec, 2)
        want = kit.chunks_of(layers, spec, src)
        assert kit.store(ctx, keys, src).stored == [0, 1]
        _, held = kit.backdoor_read(spec, keys)
        assert equal_bytes(held, want), (f"{spec.id}: the server holds other bytes than the blocks held when the "
                                         "store was submitted (bytes read before, at registration?)")

    def test_chunks_in_reused_slots_load_their_own_bytes(self, kit: Kit) -> None:
        """Rounds of a store and a lone retrieve of new chunks, with new bytes each round, until
        the arena has been filled twice: every retrieve loads its own chunks' bytes, though they
        lie in slots that earlier chunks held (a transport must keep nothing of a slot from one
        transfer to the next, or, server side, tell staged chunks apart by ``RowCopy.stamp``)."""
        spec, layers, ctx, chunk_bytes = _arena_filler(kit)
        per_round = spec.num_blocks // spec.blocks_per_chunk(CHUNK_SIZE) // 2
        rounds = -(-(2 * kit.client().status().arena.capacity // chunk_bytes + 8) // per_round)
        for i in range(rounds):
            refill(kit, spec, layers)
            keys, src = kit.keys(per_round), kit.blocks(spec, per_round)
            assert kit.store(ctx, keys, src).stored == list(range(per_round)), f"round {i}"
            before = as_bytes(layers)
            dst = kit.blocks(spec, per_round, exclude=src)
            got = kit.retrieve(ctx, keys, dst)
            assert (got.loaded, got.missing) == (list(range(per_round)), []), f"round {i}: {got}"
            assert_retrieved(kit, spec, layers, before, dst, kit.chunks_of(before, spec, src))

    def test_retrieve_into_the_blocks_it_came_from(self, kit: Kit) -> None:
        spec = kit.spec()
        layers = kit.kv(spec)
        ctx = kit.register(layers, spec)
        keys, blocks = kit.keys(2), kit.blocks(spec, 2)
        before = as_bytes(layers)
        kit.store(ctx, keys, blocks)
        fresh = kit.kv(spec)
        for t, f in zip(layers, fresh):
            t.copy_(f)           # the engine reused the blocks
        overwritten = as_bytes(layers)
        assert kit.retrieve(ctx, keys, blocks).loaded == [0, 1]
        assert_retrieved(kit, spec, layers, overwritten, blocks, kit.chunks_of(before, spec, blocks))

    def test_store_skips_chunks_already_present(self, kit: Kit) -> None:
        spec = kit.spec()
        layers = kit.kv(spec)
        ctx = kit.register(layers, spec)
        keys = kit.keys(4)
        first = kit.blocks(spec, 2)
        want_first = kit.chunks_of(layers, spec, first)
        assert kit.store(ctx, keys[:2], first).stored == [0, 1]

        again = kit.store(ctx, keys[:2], first)
        assert (again.stored, again.present, again.failed) == ([], [0, 1], [])

        other = kit.blocks(spec, 4, exclude=first)   # different bytes under the same keys
        mixed = kit.store(ctx, keys, other)
        assert (mixed.stored, mixed.present, mixed.failed) == ([2, 3], [0, 1], [])
        res, held = kit.backdoor_read(spec, keys)
        assert res.loaded == [0, 1, 2, 3]
        assert equal_bytes(held[:2], want_first), "a store of present chunks must not overwrite them"
        assert equal_bytes(held[2:], kit.chunks_of(layers, spec, other)[2:])

    def test_partial_hits(self, kit: Kit) -> None:
        """Chunk 2 of 4 never stored: lookup counts the leading 2; retrieve loads 0, 1, 3,
        reports 2 missing and leaves its blocks untouched."""
        spec = kit.spec()
        layers = kit.kv(spec)
        ctx = kit.register(layers, spec)
        keys = kit.keys(4)
        src = kit.blocks(spec, 4)
        bpc = kit.blocks_per_chunk
        stored = [0, 1, 3]
        src_stored = [b for i in stored for b in src[i * bpc:(i + 1) * bpc]]
        assert kit.store(ctx, [keys[i] for i in stored], src_stored).stored == [0, 1, 2]
        assert kit.client().lookup(kit.model, 1, hashes=keys) == 2
        assert kit.client().lookup(kit.model, 1, hashes=keys[2:]) == 0
        assert kit.client().lookup(kit.model, 1, hashes=[keys[3]]) == 1

        before = as_bytes(layers)
        dst = kit.blocks(spec, 4, exclude=src)
        res = kit.retrieve(ctx, keys, dst)
        assert (res.loaded, res.missing) == ([0, 1, 3], [2])
        assert not res.ok
        assert_retrieved(kit, spec, layers, before, dst, kit.chunks_of(before, spec, src), only=[0, 1, 3])

    def test_retrieve_of_unknown_keys_touches_nothing(self, kit: Kit) -> None:
        spec = kit.spec()
        layers = kit.kv(spec)
        ctx = kit.register(layers, spec)
        before = as_bytes(layers)
        res = kit.retrieve(ctx, kit.keys(3), kit.blocks(spec, 3))
        assert (res.loaded, res.missing) == ([], [0, 1, 2])
        assert equal_bytes(as_bytes(layers), before)

    @pytest.mark.parametrize("view", OUTSIDE, ids=[v.id for v in OUTSIDE])
    def test_bytes_outside_the_named_blocks_are_never_written(self, kit: Kit, view: View) -> None:
        """Every other layer of a four-layer buffer registered (as a hybrid model's KV cache
        groups share one buffer): a store writes nothing, and a retrieve with a missing chunk
        and a skipped first block writes exactly the named blocks' pages of the registered
        layers; the other layers' pages, the padding and every other block keep their bytes."""
        spec = kit.spec(view, num_layers=4)
        layers = kit.kv(spec)
        mine = layers[::2]
        group = dataclasses.replace(spec, num_layers=len(mine))
        ctx = kit.register(mine, group)
        keys, src = kit.keys(3), kit.blocks(spec, 3)
        bpc = kit.blocks_per_chunk
        before = as_bytes(mine)
        stored = kit.store(ctx, [keys[0], keys[2]], src[:bpc] + src[2 * bpc:])
        assert stored.stored == [0, 1]
        assert equal_bytes(as_bytes(mine), before), \
            f"a store wrote the KV cache: {describe_diff(as_bytes(mine), before, group)}"
        dst = kit.blocks(spec, 3, exclude=src)
        res = kit.retrieve(ctx, keys, dst, skip_first_n_tokens=BLOCK_SIZE)
        assert (res.loaded, res.missing) == ([0, 2], [1])
        assert_retrieved(kit, group, mine, before, dst, kit.chunks_of(before, group, src), skip_blocks=1,
                         only=[0, 2])

    @pytest.mark.parametrize("skip", [BLOCK_SIZE, CHUNK_SIZE, CHUNK_SIZE + BLOCK_SIZE, 3 * CHUNK_SIZE],
                             ids=["one-block", "one-chunk", "chunk-and-a-block", "everything"])
    def test_skip_first_n_tokens(self, kit: Kit, skip: int) -> None:
        """Blocks of the skipped tokens stay untouched, a partly skipped chunk loads its rest."""
        spec = kit.spec()
        layers = kit.kv(spec)
        ctx = kit.register(layers, spec)
        keys, src = kit.keys(3), kit.blocks(spec, 3)
        kit.store(ctx, keys, src)
        before = as_bytes(layers)
        dst = kit.blocks(spec, 3, exclude=src)
        res = kit.retrieve(ctx, keys, dst, skip_first_n_tokens=skip)
        assert res.missing == []
        assert_retrieved(kit, spec, layers, before, dst, kit.chunks_of(before, spec, src),
                         skip_blocks=skip // BLOCK_SIZE)

    def test_skip_first_n_tokens_with_a_missing_chunk(self, kit: Kit) -> None:
        spec = kit.spec()
        layers = kit.kv(spec)
        ctx = kit.register(layers, spec)
        keys, src = kit.keys(3), kit.blocks(spec, 3)
        bpc = kit.blocks_per_chunk
        kit.store(ctx, keys[:2], src[:2 * bpc])
        before = as_bytes(layers)
        dst = kit.blocks(spec, 3, exclude=src)
        res = kit.retrieve(ctx, keys, dst, skip_first_n_tokens=BLOCK_SIZE)
        assert res.missing == [2]
        assert_retrieved(kit, spec, layers, before, dst, kit.chunks_of(before, spec, src),
                         skip_blocks=1, only=[0, 1])

    def test_evicted_chunks_are_missing_and_slots_are_reused(self, kit: Kit) -> None:
        """Store more than the arena holds: the oldest chunks are evicted (lookup stops counting
        them, a retrieve reports them missing and leaves their blocks alone) and the newest,
        written into reused slots, come back exact."""
        spec, layers, ctx, chunk_bytes = _arena_filler(kit)
        bpc = spec.blocks_per_chunk(CHUNK_SIZE)
        status = kit.client().status()
        total = status.arena.capacity // chunk_bytes + 8
        per_request = spec.num_blocks // bpc
        keys = kit.keys(total)
        blocks_of: list[list[int]] = []
        for start in range(0, total, per_request):
            batch = keys[start:start + per_request]
            src = kit.blocks(spec, len(batch))
            res = kit.store(ctx, batch, src)
            assert res.stored == list(range(len(batch))), f"store {start // per_request} failed: {res}"
            blocks_of += [src[j * bpc:(j + 1) * bpc] for j in range(len(batch))]
        assert kit.client().status().arena.evictions > status.arena.evictions
        assert kit.client().lookup(kit.model, 1, hashes=keys[:2]) == 0, "the oldest chunks must be evicted"
        assert kit.client().lookup(kit.model, 1, hashes=keys[-2:]) == 2

        before = as_bytes(layers)
        wanted = [0, 1, total - 2, total - 1]
        dst = kit.blocks(spec, 4)
        got = kit.retrieve(ctx, [keys[i] for i in wanted], dst)
        assert (got.loaded, got.missing) == ([2, 3], [0, 1])
        chunks = kit.chunks_of(before, spec, [b for i in wanted for b in blocks_of[i]])
        assert_retrieved(kit, spec, layers, before, dst, chunks, only=[2, 3])

    def test_submissions_run_in_order(self, kit: Kit) -> None:
        """A retrieve submitted right after a store, without waiting, sees the stored chunks."""
        spec = kit.spec()
        layers = kit.kv(spec)
        ctx = kit.register(layers, spec)
        before = as_bytes(layers)
        rounds = []
        used: list[int] = []
        for _ in range(3):
            keys = kit.keys(2)
            src = kit.blocks(spec, 2, exclude=used)
            used += src
            rounds.append((keys, src, ctx.submit_store(keys, src)))
        dst = kit.blocks(spec, 2, exclude=used)
        last_keys, last_src, _ = rounds[-1]
        fut = ctx.submit_retrieve(last_keys, dst)
        for _keys, _src, f in rounds:
            assert f.result(timeout=30).stored == [0, 1]
        assert fut.result(timeout=30).loaded == [0, 1]
        assert_retrieved(kit, spec, layers, before, dst, kit.chunks_of(before, spec, last_src))

    def test_requests_submitted_together_each_move_their_own_bytes(self, kit: Kit) -> None:
        """16 stores of one chunk each, then 16 retrieves into other blocks, each submitted
        without waiting for the ones before: every chunk the server holds is the one stored under
        its key, and every retrieve writes its own chunk where it was asked to (a transport that
        shares one staging buffer or spool file among requests in flight mixes them up)."""
        n = 16
        spec = kit.spec(num_blocks=2 * n * kit.blocks_per_chunk)
        layers = kit.kv(spec)
        ctx = kit.register(layers, spec)
        keys = kit.keys(n)
        src = kit.blocks(spec, n)
        bpc = spec.blocks_per_chunk(CHUNK_SIZE)
        stores = [ctx.submit_store([k], src[i * bpc:(i + 1) * bpc]) for i, k in enumerate(keys)]
        assert [f.result(timeout=TIMEOUT).stored for f in stores] == [[0]] * n
        res, chunks = kit.backdoor_read(spec, keys)
        assert res.loaded == list(range(n))
        assert torch.equal(chunks, kit.chunks_of(layers, spec, src)), \
            "the server holds other bytes than were stored under some key"
        before = as_bytes(layers)
        dst = kit.blocks(spec, n, exclude=src)
        loads = [ctx.submit_retrieve([k], dst[i * bpc:(i + 1) * bpc]) for i, k in enumerate(keys)]
        assert [f.result(timeout=TIMEOUT).loaded for f in loads] == [[0]] * n
        assert_retrieved(kit, spec, layers, before, dst, chunks)

    def test_cancelled_requests_copy_nothing_and_give_back_what_they_took(self, kit: Kit) -> None:
        """40 stores and 40 retrieves, each cancelled right after its submit (a future may be
        cancelled until its copy starts): a store whose ``cancel()`` said True stores nothing, a
        retrieve whose ``cancel()`` said True writes nothing, and whatever a cancelled request
        took (its params, a buffer, a place in a pool; a server-driven one's go back through
        ``release_params``, as ``finish_retrieve`` never runs for it) is given back: the
        context then moves every byte of the next requests."""
        spec = kit.spec(num_blocks=6 * kit.blocks_per_chunk)
        layers = kit.kv(spec)
        ctx = kit.register(layers, spec)
        keys, src = kit.keys(2), kit.blocks(spec, 2)
        want = kit.chunks_of(layers, spec, src)
        assert kit.store(ctx, keys, src).stored == [0, 1]
        dst = kit.blocks(spec, 2, exclude=src)
        before = as_bytes(layers)
        stores, loads = [], []
        for _ in range(40):
            key = kit.keys(1)
            stored = ctx.submit_store(key, src[:spec.blocks_per_chunk(CHUNK_SIZE)])
            stores.append((key, stored))
            stored.cancel()
            loading = ctx.submit_retrieve(keys, dst)
            loads.append(loading)
            loading.cancel()
        ran = [f.result(timeout=TIMEOUT) for f in loads if not f.cancelled()]
        assert all(r.loaded == [0, 1] for r in ran)
        assert_retrieved(kit, spec, layers, before, dst, want, only=[0, 1] if ran else [])
        for _, fut in stores:
            if not fut.cancelled():
                assert fut.result(timeout=TIMEOUT).stored == [0]
        for key, fut in stores:  # after every store that ran has ended
            held_res, _ = kit.backdoor_read(spec, key)
            assert held_res.loaded == ([] if fut.cancelled() else [0]), "a cancelled store stored its chunk"
        again = kit.blocks(spec, 2, exclude=[*src, *dst])
        before = as_bytes(layers)
        assert kit.retrieve(ctx, keys, again).loaded == [0, 1], "the context fails after cancelled requests"
        assert_retrieved(kit, spec, layers, before, again, want)
        fresh = kit.keys(2)
        assert kit.store(ctx, fresh, dst).stored == [0, 1]
        _, held = kit.backdoor_read(spec, fresh)
        assert equal_bytes(held, kit.chunks_of(layers, spec, dst))

    @pytest.mark.parametrize("geometry", ["far_blocks", "many_layers"])
    def test_geometry_far_past_the_other_tests(self, kit: Kit, geometry: str) -> None:
        """``far_blocks``: 40,000 blocks, so that row ids pass 2**16 (a 16-bit descriptor field
        wraps), and 64 chunks in one request, stored from the last blocks and loaded into the
        ones before them; ``many_layers``: 64 layers, 32 chunks in one request (8,192 rows of
        layers: a path for large batches). Every byte is checked, as in the other round trips."""
        far = geometry == "far_blocks"
        if far:
            n, spec = 64, kit.spec(num_layers=4, num_blocks=40_000, heads=1, head_size=4)
        else:
            n, spec = 32, kit.spec(num_layers=64, num_blocks=128, heads=1, head_size=4)
        span = n * spec.blocks_per_chunk(CHUNK_SIZE)
        layers = kit.kv(spec)
        ctx = kit.register(layers, spec)
        keys = kit.keys(n)
        src = list(range(spec.num_blocks - span, spec.num_blocks)) if far else kit.blocks(spec, n)
        assert kit.store(ctx, keys, src).stored == list(range(n))
        res, chunks = kit.backdoor_read(spec, keys)
        assert res.loaded == list(range(n))
        assert torch.equal(chunks, kit.chunks_of(layers, spec, src)), "the server holds other bytes than were stored"
        before = as_bytes(layers)
        dst = list(range(spec.num_blocks - 2 * span, spec.num_blocks - span)) if far \
            else kit.blocks(spec, n, exclude=src)
        assert kit.retrieve(ctx, keys, dst).loaded == list(range(n))
        assert_retrieved(kit, spec, layers, before, dst, chunks)

    def test_empty_requests(self, kit: Kit) -> None:
        spec = kit.spec()
        ctx = kit.register(kit.kv(spec), spec)
        res = kit.store(ctx, [], [])
        assert (res.stored, res.present, res.failed) == ([], [], [])
        got = kit.retrieve(ctx, [], [])
        assert (got.loaded, got.missing) == ([], [])

    def test_lease_is_released_by_retrieve(self, kit: Kit) -> None:
        spec = kit.spec()
        layers = kit.kv(spec)
        ctx = kit.register(layers, spec)
        keys, src = kit.keys(2), kit.blocks(spec, 2)
        kit.store(ctx, keys, src)
        reply = kit.client().lookup_and_lease(kit.model, 1, hashes=keys, lease_s=60)
        assert reply.hits == 2 and reply.lease_id
        assert kit.client().status().leased_chunks >= 2
        before = as_bytes(layers)
        dst = kit.blocks(spec, 2, exclude=src)
        assert kit.retrieve(ctx, keys, dst, lease_id=reply.lease_id).loaded == [0, 1]
        # its commit releases it: a server-driven retrieve may be answered once its copies are
        # queued, and commits (unpins, releases) when they end
        deadline = time.monotonic() + 10
        while kit.client().status().leases and time.monotonic() < deadline:
            time.sleep(0.005)
        assert kit.client().status().leases == 0, "a retrieve naming the lease must release it"
        assert_retrieved(kit, spec, layers, before, dst, kit.chunks_of(before, spec, src))
        # the chunks a retrieve skips wholly too (an engine computed them itself): none reads them
        reply = kit.client().lookup_and_lease(kit.model, 1, hashes=keys, lease_s=60)
        assert reply.hits == 2 and reply.lease_id
        assert kit.retrieve(ctx, keys, dst, CHUNK_SIZE, lease_id=reply.lease_id).loaded == [0, 1]
        deadline = time.monotonic() + 10
        while kit.client().status().leases and time.monotonic() < deadline:
            time.sleep(0.005)
        assert kit.client().status().leases == 0, "a retrieve naming the lease must release the chunks it skips"

    def test_bad_requests_raise_config_error(self, kit: Kit) -> None:
        spec = kit.spec()
        ctx = kit.register(kit.kv(spec), spec)
        keys = kit.keys(2)
        with pytest.raises(ConfigError, match=r"need \d+ block ids"):
            ctx.submit_store(keys, kit.blocks(spec, 1))
        with pytest.raises(ConfigError, match=r"block ids must be in \[0, "):
            ctx.submit_store(keys, [spec.num_blocks] * (2 * kit.blocks_per_chunk))
        with pytest.raises(ConfigError, match=r"skip_first_n_tokens"):
            ctx.submit_retrieve(keys, kit.blocks(spec, 2), skip_first_n_tokens=BLOCK_SIZE // 2)
        with pytest.raises(ConfigError, match=r"skip_first_n_tokens must be an integer"):
            ctx.submit_retrieve(keys, kit.blocks(spec, 2), skip_first_n_tokens=float(BLOCK_SIZE))  # type: ignore[arg-type]
        for lease_id in (-1, 1 << 64, 1.0):
            with pytest.raises(ConfigError, match=r"lease_id must be 0 \(no lease\) or a lease id"):
                ctx.submit_retrieve(keys, kit.blocks(spec, 2), lease_id=lease_id)  # type: ignore[arg-type]
        res = kit.store(ctx, keys, kit.blocks(spec, 2))  # the context still works afterwards
        assert res.stored == [0, 1]

