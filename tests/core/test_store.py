"""The L1 store without a server: the allocator under churn, the index (LRU, leases, pins)."""

from __future__ import annotations

import random

import pytest

from kvxfer.errors import InvalidRequest, StoreUnavailable
from kvxfer.server.allocator import ALIGN, Allocator
from kvxfer.server.index import ChunkIndex, ChunkKey, State, Usage

# --------------------------------------------------------------------------- allocator


def _assert_disjoint(live: dict[int, int], capacity: int) -> None:
    spans = sorted((off, off + Allocator.rounded(n)) for off, n in live.items())
    for (s1, e1), (s2, _) in zip(spans, spans[1:]):
        assert e1 <= s2, f"extents overlap: [{s1}, {e1}) and [{s2}, ...)"
    assert all(s % ALIGN == 0 and 0 <= s and e <= capacity for s, e in spans)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_allocator_survives_churn_with_mixed_sizes(seed: int) -> None:
    rng = random.Random(seed)
    alloc = Allocator(64 * 1024 * 1024 + 123)  # not a multiple of ALIGN: rounded down
    assert alloc.capacity % ALIGN == 0
    live: dict[int, int] = {}
    sizes = [1, 100, ALIGN, ALIGN + 1, 3 * ALIGN, 64 * 1024, 1 << 20, (1 << 20) + 7, 5 << 20]
    failed = 0
    for step in range(3000):
        if live and (rng.random() < 0.45 or failed > 3):
            off = rng.choice(list(live))
            alloc.free(off, live.pop(off))
            failed = 0
        else:
            n = rng.choice(sizes) if rng.random() < 0.7 else rng.randrange(1, 2 << 20)
            off = alloc.alloc(n)
            if off is None:
                failed += 1
                # nothing fits only when no free extent is big enough
                assert alloc.largest_free < Allocator.rounded(n)
            else:
                assert off not in live
                live[off] = n
        if step % 50 == 0:
            alloc.check()
            _assert_disjoint(live, alloc.capacity)
            assert alloc.used == sum(Allocator.rounded(n) for n in live.values())
    for off, n in list(live.items()):
        alloc.free(off, n)
    alloc.check()
    assert alloc.used == 0
    assert alloc.free_extents == 1 and alloc.largest_free == alloc.capacity


def test_allocator_best_fit_and_coalescing() -> None:
    a = Allocator(10 * ALIGN)
    offs = [a.alloc(ALIGN) for _ in range(10)]
    assert offs == [i * ALIGN for i in range(10)]
    assert a.alloc(1) is None
    a.free(offs[2], ALIGN)
    a.free(offs[5], ALIGN)
    a.free(offs[6], ALIGN)
    assert a.free_extents == 2
    assert a.alloc(2 * ALIGN) == offs[5]  # the only hole that fits
    assert a.alloc(ALIGN) == offs[2]
    for off in offs[:2] + offs[3:5] + offs[7:]:
        a.free(off, ALIGN)
    a.free(offs[5], 2 * ALIGN)
    a.free(offs[2], ALIGN)
    a.check()
    assert a.free_extents == 1 and a.largest_free == 10 * ALIGN


def test_allocator_refuses_bad_frees() -> None:
    a = Allocator(4 * ALIGN)
    off = a.alloc(ALIGN)
    a.free(off, ALIGN)
    with pytest.raises(ValueError, match="double free"):
        a.free(off, ALIGN)
    with pytest.raises(ValueError, match="bad extent"):
        a.free(1, ALIGN)
    with pytest.raises(ValueError, match="bad extent"):
        a.free(3 * ALIGN, 2 * ALIGN)
    with pytest.raises(ValueError, match="positive"):
        a.alloc(0)
    assert a.alloc(5 * ALIGN) is None


# --------------------------------------------------------------------------- index

SIZE = 4 * ALIGN
#: The owner of the reservations and leases of these tests (a session, in the server).
OWNER = Usage()


def key(i: int, rank: int = 0, world: int = 1, model: str = "m") -> ChunkKey:
    return ChunkKey(model, world, rank, i.to_bytes(16, "little"))


def store(index: ChunkIndex, keys: list[ChunkKey], fmt: str = "f") -> tuple[list[int], list[int], list[int]]:
    res, present, no_space = index.reserve_write(keys, fmt, SIZE, 1, OWNER)
    stored = index.commit_write(res)
    return [i for i, _ in stored], present, no_space


def lease(index: ChunkIndex, model: str, world: int, hashes: list[bytes], ttl: float = 30) -> int:
    return index.lease(index.lease_keys(model, world, hashes), ttl, OWNER)


def read(index: ChunkIndex, keys: list[ChunkKey], lease_id: int = 0) -> list[int]:
    res, missing = index.reserve_read(keys, "f", 1, OWNER, lease_id)
    index.commit_read(res)
    return missing


class Recorder:
    def __init__(self) -> None:
        self.evicted: list[ChunkKey] = []

    def __call__(self, keys: list[ChunkKey]) -> None:
        self.evicted += keys


def test_lru_eviction_order() -> None:
    ev = Recorder()
    index = ChunkIndex(4 * SIZE, on_evict=ev)
    assert store(index, [key(i) for i in range(4)]) == ([0, 1, 2, 3], [], [])
    assert read(index, [key(0)]) == []  # 0 becomes most recently used
    store(index, [key(4)])
    assert ev.evicted == [key(1)]
    assert index.lookup("m", 1, [key(0).chunk_hash]) == 1
    store(index, [key(5), key(6)])
    assert ev.evicted == [key(1), key(2), key(3)]
    assert index.evictions == 3
    assert index.lookup("m", 1, [key(i).chunk_hash for i in (0, 4, 5, 6)]) == 4
    index.allocator.check()


def test_a_lookup_repeating_one_hash_asks_the_index_once_per_distinct_key() -> None:
    """Leading chunks of a lookup that names one stored hash 16,384 times for 16 ranks: all
    present, found with 16 index reads, not 262,144 (one stored hash per rank let a 164 KB
    request cost the server's loop 0.1 s); a lease of them holds the 16 entries once each."""
    index = ChunkIndex(64 * SIZE)
    store(index, [key(1, rank=r, world=16) for r in range(16)])
    one, other = key(1).chunk_hash, key(2).chunk_hash

    class Counted(dict):  # the index's own dict, its reads counted
        gets = 0

        def get(self, k, default=None):  # type: ignore[no-untyped-def]
            Counted.gets += 1
            return super().get(k, default)

    index.entries = Counted(index.entries)
    assert index.lookup("m", 16, [one] * 16384) == 16384
    assert Counted.gets == 16
    assert index.lookup("m", 16, [one] * 100 + [other] + [one] * 100) == 100  # still the leading run
    assert len(index.lease_keys("m", 16, [one] * 16384)) == 16


def test_a_chunk_no_eviction_can_make_room_for_evicts_nothing() -> None:
    """Small chunks leased every 8th across the arena leave no 8-chunk window free of pins: a
    chunk of 8 times their size gets no_space at once, and every unleased chunk stays (before,
    each such store evicted the whole arena for nothing). With the leased chunks together, the
    same store evicts, least recently used first, until it fits."""
    for spread, fits in ((8, False), (1, True)):
        ev = Recorder()
        index = ChunkIndex(64 * SIZE, on_evict=ev)
        store(index, [key(i) for i in range(64)])
        leased = [key(i * spread).chunk_hash for i in range(8)]
        lease(index, "m", 1, leased)
        res, present, no_space = index.reserve_write([key(0, model="big")], "g", 8 * SIZE, 1, OWNER)
        assert (no_space == [], present) == (fits, []), (spread, no_space)
        if fits:
            assert len(ev.evicted) >= 8 and not set(ev.evicted) & {key(i) for i in range(8)}
            index.commit_write(res)
        else:
            assert ev.evicted == [] and len(index.entries) == 64
            index.abort(res)
        index.allocator.check()


class _CountedKeys(dict):  # type: ignore[type-arg]
    """The index's entries, counting the passes over all their keys (``keys()``)."""

    passes = 0

    def keys(self):  # type: ignore[no-untyped-def]
        type(self).passes += 1
        return super().keys()


def test_a_store_of_many_large_chunks_over_many_small_ones_passes_over_the_entries_once() -> None:
    """An arena full of small chunks, one leased at the front: each large chunk of one store
    must evict, and the least recently used entry is smaller than it, so whether eviction can
    make room at all is asked for every one. The entries are walked once per store; before,
    once per chunk (a 1,024-chunk store over 65,536 small chunks held the server's loop 4 s).
    What is evicted, and what fits, are as before: every large chunk but the one the leased
    small chunk leaves no room for."""
    small, n_big = SIZE, 16
    index = ChunkIndex(64 * small)
    index.entries = _CountedKeys()
    store(index, [key(i) for i in range(64)])
    lease(index, "m", 1, [key(0).chunk_hash])
    _CountedKeys.passes = 0
    res, present, no_space = index.reserve_write([key(i, model="big") for i in range(n_big)], "g",
                                                 4 * small, 1, OWNER)
    assert _CountedKeys.passes == 1
    assert present == [] and no_space == [n_big - 1], no_space  # 16 x 4 slots less the leased one
    assert key(0) in index.entries
    assert sum(k.model_name == "big" for k in index.entries) == n_big - 1
    assert sum(k.model_name == "m" for k in index.entries) == 64 - 4 * (n_big - 1)  # the rest evicted
    index.commit_write(res)
    index.allocator.check()


class Calls:
    def __init__(self) -> None:
        self.calls: list[list[ChunkKey]] = []

    def __call__(self, keys: list[ChunkKey]) -> None:
        self.calls.append(list(keys))


def test_a_requests_evictions_are_reported_in_one_call() -> None:
    ev = Calls()
    index = ChunkIndex(4 * SIZE, on_evict=ev)
    store(index, [key(i) for i in range(4)])
    store(index, [key(i) for i in range(4, 7)])
    assert ev.calls == [[key(0), key(1), key(2)]] and index.evictions == 3
    index.allocator.check()


def test_a_request_refused_for_its_format_evicts_nothing() -> None:
    ev = Calls()
    index = ChunkIndex(2 * SIZE, on_evict=ev)
    store(index, [key(0), key(1)])
    with pytest.raises(InvalidRequest, match="format"):
        index.reserve_write([key(2), key(1)], "other-format", SIZE, 1, OWNER)
    assert ev.calls == [] and index.evictions == 0 and not index.reservations
    assert index.lookup("m", 1, [key(0).chunk_hash, key(1).chunk_hash]) == 2
    index.allocator.check()


def test_a_key_a_store_reports_present_is_not_evicted_by_that_store() -> None:
    """A full arena, a store of [K (present, the least recently used), new]: room for the new
    chunk is made from the others; K stays, used by that store (the new chunk, readable only
    at its commit, is used later still)."""
    ev = Calls()
    index = ChunkIndex(2 * SIZE, on_evict=ev)
    store(index, [key(0), key(1)])
    stored, present, no_space = store(index, [key(0), key(2)])
    assert (stored, present, no_space) == ([1], [0], [])
    assert ev.calls == [[key(1)]]
    assert index.lookup("m", 1, [key(0).chunk_hash, key(2).chunk_hash]) == 2
    store(index, [key(1)])
    assert ev.calls[-1] == [key(0)]  # then key(2)
    store(index, [key(3)])
    assert ev.calls[-1] == [key(2)]
    index.allocator.check()


def test_a_failing_eviction_report_leaves_the_index_whole(caplog: pytest.LogCaptureFixture) -> None:
    def broken(keys: list[ChunkKey]) -> None:
        raise RuntimeError("stats broke")

    index = ChunkIndex(1 * SIZE, on_evict=broken)
    store(index, [key(0)])
    assert store(index, [key(1)]) == ([0], [], [])  # reserved, committed, readable
    assert index.evictions == 1 and not index.reservations and "evicted chunks failed" in caplog.text
    index.allocator.check()


def test_present_and_duplicate_keys_are_not_written_twice() -> None:
    index = ChunkIndex(8 * SIZE)
    store(index, [key(0)])
    stored, present, no_space = store(index, [key(0), key(1), key(1)])
    assert (stored, present, no_space) == ([1], [0, 2], [])
    with pytest.raises(InvalidRequest, match="format"):
        index.reserve_write([key(1)], "other-format", SIZE, 1, OWNER)
    assert not index.reservations  # the refused reservation was undone


def test_a_key_named_again_is_what_its_first_copy_is() -> None:
    """A store naming a new key twice reported the second copy present even when the first got
    no room: nothing was stored, yet the store said one copy was (found by a stress run)."""
    index = ChunkIndex(1 * SIZE)
    assert store(index, [key(9)])[0] == [0]
    lease_id = lease(index, "m", 1, [key(9).chunk_hash])  # the one slot is held: nothing can be evicted
    assert store(index, [key(0), key(0)]) == ([], [], [0, 1])
    assert store(index, [key(0), key(9), key(0)]) == ([], [1], [0, 2])
    index.release_lease(lease_id)
    assert store(index, [key(0), key(1), key(0)]) == ([0], [2], [1])  # key 0 takes the slot, key 1 finds none


def test_lookup_counts_leading_chunks_present_for_every_rank() -> None:
    index = ChunkIndex(16 * SIZE)
    hashes = [key(i).chunk_hash for i in range(3)]
    store(index, [key(i, rank=0, world=2) for i in range(3)])
    assert index.lookup("m", 2, hashes) == 0  # rank 1 has nothing yet
    store(index, [key(i, rank=1, world=2) for i in (0, 2)])
    assert index.lookup("m", 2, hashes) == 1  # a gap at chunk 1 for rank 1
    assert index.lookup("m", 1, hashes) == 0  # world size is part of the key
    assert index.lookup("other", 2, hashes) == 0


def test_writing_chunks_are_invisible_and_pinned() -> None:
    ev = Recorder()
    index = ChunkIndex(2 * SIZE, on_evict=ev)
    res, _, _ = index.reserve_write([key(0), key(1)], "f", SIZE, 1, OWNER)
    assert index.lookup("m", 1, [key(0).chunk_hash]) == 0
    assert index.reserve_read([key(0)], "f", 1, OWNER)[1] == [0]  # WRITING: missing for readers
    _, _, no_space = index.reserve_write([key(2)], "f", SIZE, 1, OWNER)
    assert no_space == [0] and ev.evicted == []  # nothing evictable: both slots being written
    index.commit_write(res, failed=[1])
    assert index.entries[key(0)].state is State.READY and key(1) not in index.entries
    assert index.lookup("m", 1, [key(0).chunk_hash, key(1).chunk_hash]) == 1


def test_readers_pin_chunks() -> None:
    ev = Recorder()
    index = ChunkIndex(2 * SIZE, on_evict=ev)
    store(index, [key(0), key(1)])
    res, missing = index.reserve_read([key(0), key(1)], "f", 1, OWNER)
    assert missing == []
    assert store(index, [key(2)])[2] == [0]  # both pinned by the reader: no space
    index.commit_read(res)
    assert store(index, [key(2)])[0] == [0]
    assert ev.evicted == [key(0)]


def test_leases_are_honoured_until_they_expire() -> None:
    ev = Recorder()
    index = ChunkIndex(3 * SIZE, on_evict=ev)
    store(index, [key(0), key(1), key(2)])
    lease(index, "m", 1, [key(0).chunk_hash, key(1).chunk_hash])
    assert index.leased_chunks == 2
    assert store(index, [key(3)])[0] == [0]
    assert ev.evicted == [key(2)]  # the only unleased chunk went, although 0 and 1 are older
    reader, _ = index.reserve_read([key(3)], "f", 1, OWNER)
    assert store(index, [key(4)])[2] == [0]  # leased or being read: nothing may go
    index.commit_read(reader)
    assert index.expire_leases(now=0.0) == 0  # not yet
    assert index.expire_leases(now=float("inf")) == 1
    assert not index.leases and index.leased_chunks == 0
    assert index.entries[key(0)].leases == 0
    store(index, [key(5), key(6)])
    # evictable again as the most recently used (their lease ended after 3's read): 3 goes first
    assert ev.evicted == [key(2), key(3), key(0)]
    assert key(1) in index.entries
    index.allocator.check()


def test_a_chunk_leased_while_it_is_written_stays_pinned_once_committed() -> None:
    """A promotion from L2 writes chunks that its lookup (and any lookup counting chunks being
    promoted) leases before they are READY: committing them must not make them evictable while
    the lease holds them, or the load that follows finds them gone."""
    ev = Recorder()
    index = ChunkIndex(3 * SIZE, on_evict=ev)
    res, _, _ = index.reserve_write([key(0), key(1)], "f", SIZE, 1, Usage())  # a promotion's slots
    lid = lease(index, "m", 1, [key(0).chunk_hash, key(1).chunk_hash])
    index.commit_write(res)
    assert index.pinned_chunks() == 2 and not index._lru
    assert store(index, [key(2)])[0] == [0]
    assert store(index, [key(3)])[0] == [0]  # room made from 2, never from the leased 0 and 1
    assert ev.evicted == [key(2)]
    assert read(index, [key(0), key(1)], lid) == []  # the load the lease was for finds them
    assert not index.leases and index.pinned_chunks() == 0
    assert store(index, [key(4)])[0] == [0]
    assert ev.evicted == [key(2), key(3)]  # 0 and 1 are evictable again, more recently used than 3
    index.allocator.check()


def test_a_read_naming_the_lease_releases_its_rank_only() -> None:
    index = ChunkIndex(8 * SIZE)
    store(index, [key(0, 0, 2), key(1, 0, 2), key(0, 1, 2), key(1, 1, 2)])
    hashes = [key(0).chunk_hash, key(1).chunk_hash]
    lease_id = lease(index, "m", 2, hashes)
    assert index.leased_chunks == 4
    assert read(index, [key(0, 0, 2), key(1, 0, 2)], lease_id=lease_id) == []
    assert index.leased_chunks == 2
    assert index.entries[key(0, 0, 2)].leases == 0 and index.entries[key(0, 1, 2)].leases == 1
    assert lease_id in index.leases
    read(index, [key(0, 1, 2), key(1, 1, 2)], lease_id=lease_id)
    assert lease_id not in index.leases and index.leased_chunks == 0
    index.release_lease(lease_id)  # unknown or finished ids are ignored


def test_abort_undoes_reservations() -> None:
    index = ChunkIndex(4 * SIZE)
    store(index, [key(0)])
    w, _, _ = index.reserve_write([key(1), key(2)], "f", SIZE, 7, OWNER)
    r, _ = index.reserve_read([key(0)], "f", 7, OWNER)
    assert index.entries[key(0)].readers == 1 and len(index.reservations) == 2
    index.abort(w)
    index.abort(r)
    assert not index.reservations
    assert index.entries[key(0)].readers == 0
    assert key(1) not in index.entries and index.allocator.used == Allocator.rounded(SIZE)


def test_clear_drops_only_unpinned_chunks_of_the_model() -> None:
    index = ChunkIndex(8 * SIZE)
    store(index, [key(0), key(1)])
    store(index, [key(2, model="other")])
    r, _ = index.reserve_read([key(1)], "f", 1, OWNER)
    assert index.clear("m") == [key(0)]
    assert set(index.entries) == {key(1), key(2, model="other")}
    index.commit_read(r)
    assert sorted(index.clear()) == sorted([key(1), key(2, model="other")])
    assert index.allocator.used == 0


def test_index_churn_keeps_allocator_consistent() -> None:
    rng = random.Random(11)
    index = ChunkIndex(64 * SIZE)
    open_reads = []
    for step in range(2000):
        keys = [key(rng.randrange(200)) for _ in range(rng.randrange(1, 6))]
        op = rng.random()
        if op < 0.5:
            res, _, _ = index.reserve_write(keys, "f", SIZE, 1, OWNER)
            index.commit_write(res, failed=[i for i, _ in res.entries if rng.random() < 0.1])
        elif op < 0.8:
            res, _ = index.reserve_read(keys, "f", 1, OWNER)
            open_reads.append(res)
        elif open_reads:
            index.commit_read(open_reads.pop(rng.randrange(len(open_reads))))
        if step % 100 == 0:
            index.allocator.check()
            assert index.allocator.used == len(index.entries) * SIZE
            for e in index.entries.values():
                assert e.readers >= 0 and e.leases >= 0
    for res in open_reads:
        index.commit_read(res)
    index.clear()
    assert index.allocator.used == 0 and index.allocator.free_extents == 1


def test_one_format_per_identity_until_its_last_chunk_goes() -> None:
    index = ChunkIndex(16 * SIZE)
    assert index.format_of("m", 1) is None
    res, _, _ = index.reserve_write([key(1), key(2)], "fmt-a", SIZE, 1, OWNER)
    # being written counts: once it is readable, a registration of another format would find
    # every request that names it refused
    assert index.format_of("m", 1) == "fmt-a"
    index.commit_write(res, failed=[0])
    assert index.format_of("m", 1) == "fmt-a" and index.format_of("m", 2) is None  # one entry left
    assert index.clear("m") and index.format_of("m", 1) is None


def test_a_lease_of_repeated_hashes_holds_each_chunk_once() -> None:
    """A lookup may repeat a hash: the lease pins the chunk once and releases it once, so the
    chunk is evictable and clearable again afterwards, whichever way the lease ends."""
    for end in ("release", "expire", "read"):
        index = ChunkIndex(4 * SIZE)
        owner = Usage()
        store(index, [key(0), key(1)])
        h0, h1 = key(0).chunk_hash, key(1).chunk_hash
        lease_id = index.lease(index.lease_keys("m", 1, [h0, h0, h1, h0]), 30, owner)
        assert index.entries[key(0)].leases == 1 and index.leased_chunks == 2
        assert owner.leased_bytes == 2 * Allocator.rounded(SIZE) and list(owner.leases) == [lease_id]
        if end == "release":
            index.release_lease(lease_id)
        elif end == "expire":
            index.expire_leases(float("inf"))
        else:
            assert read(index, [key(0), key(0), key(1)], lease_id=lease_id) == []
        assert index.pinned_chunks() == 0 and not index.leases, end
        assert owner.leased_bytes == 0 and not owner.leases
        assert sorted(index.clear()) == [key(0), key(1)], end


def test_usage_follows_every_reservation_and_lease_exactly() -> None:
    index = ChunkIndex(16 * SIZE)
    a, b = Usage(), Usage()
    store(index, [key(0), key(1)])
    w, _, _ = index.reserve_write([key(2), key(3), key(3)], "f", SIZE, 1, a)
    r, _ = index.reserve_read([key(0), key(0), key(9)], "f", 1, b)
    assert index.write_need([key(4), key(4), key(0)]) == 1
    assert index.read_pins([key(0), key(0), key(9)], a) == (2, Allocator.rounded(SIZE))
    assert index.read_pins([key(0), key(1)], b) == (2, Allocator.rounded(SIZE))  # key 0 is b's already
    assert (len(a.reservations), a.reserved_bytes) == (1, 2 * Allocator.rounded(SIZE))
    assert (len(b.reservations), b.reserved_bytes) == (1, Allocator.rounded(SIZE))  # one entry, pinned twice
    r2, _ = index.reserve_read([key(0), key(1)], "f", 1, b)  # as a layer-wise read's next range does
    assert (len(b.reservations), b.reserved_bytes) == (2, 2 * Allocator.rounded(SIZE))
    assert index.pinned_chunks() == 4  # two being written, two being read (key 0 three times)
    index.commit_write(w)
    index.abort(r)
    assert b.reserved_bytes == 2 * Allocator.rounded(SIZE)  # r2 still pins both
    index.commit_read(r2)
    assert not a.reservations and not b.reservations and a.reserved_bytes == b.reserved_bytes == 0
    assert not b.read_pins
    assert index.pinned_chunks() == 0


def test_reservation_and_lease_ids_are_random() -> None:
    index = ChunkIndex(16 * SIZE)
    store(index, [key(0)])
    ids = {index.reserve_read([key(0)], "f", 1, OWNER)[0].id for _ in range(20)}
    ids |= {lease(index, "m", 1, [key(0).chunk_hash]) for _ in range(20)}
    assert len(ids) == 40 and min(ids) > 1 << 20  # not small sequential numbers


def test_a_session_pinning_the_same_chunks_again_holds_no_more_bytes() -> None:
    """Leases of the same prefix (a scheduler looking up a waiting request again) and reads of the
    same chunks (a layer-wise read's ranges in flight) count each entry once toward the session's
    byte limits, and the count falls back to zero exactly."""
    index = ChunkIndex(16 * SIZE)
    owner = Usage()
    store(index, [key(0), key(1)])
    one = Allocator.rounded(SIZE)
    entries = index.lease_keys("m", 1, [key(0).chunk_hash, key(1).chunk_hash])
    assert owner.lease_need(entries.values()) == 2 * one
    leases = [index.lease(entries, 30, owner) for _ in range(3)]
    assert owner.leased_bytes == 2 * one and owner.lease_need(entries.values()) == 0
    index.release_lease(leases[0])
    index.release_lease(leases[1], [key(0)])
    assert owner.leased_bytes == 2 * one
    index.release_lease(leases[2])
    assert owner.leased_bytes == one  # key 1 is still in leases[1]
    index.release_lease(leases[1])
    assert owner.leased_bytes == 0 and not owner.lease_pins and not owner.leases
    reads = [index.reserve_read([key(0), key(1)], "f", 1, owner)[0] for _ in range(4)]
    assert owner.reserved_bytes == 2 * one and index.read_pins([key(0)], owner) == (1, 0)
    for r in reads:
        index.commit_read(r)
    assert owner.reserved_bytes == 0 and not owner.read_pins


@pytest.mark.parametrize("seed", range(6))
def test_the_lru_holds_exactly_the_evictable_entries_in_the_order_of_their_last_use(seed: int) -> None:
    """Random stores, leases, reads (committed or aborted), L2-writer holds and releases against
    a model: after every step the LRU is the READY entries nothing pins but holds, the least
    recently used (unpinned, or stored again) first, and eviction takes from its front only
    (never a pinned or held entry, nor one its own store names). A hold is no use: the entry
    keeps its place (it became the most recently used, so that chunks written to L2 outlived
    the ones whose write was dropped), and one that eviction passed over goes back to the front."""
    import random

    rng = random.Random(seed)
    ev = Recorder()
    index = ChunkIndex(12 * SIZE, on_evict=ev)
    model: dict[ChunkKey, int] = {}  # key in the LRU -> its place (when it last became evictable)
    passed: set[ChunkKey] = set()  # held keys eviction passed over (out of the LRU until released)
    clock = iter(range(10**9))
    front = iter(range(-1, -10**9, -1))
    leases: list[int] = []
    held: list = []
    owner = Usage()

    def holds(k: ChunkKey) -> int:
        return sum(1 for e in held if e.key == k)

    def refresh(keys) -> None:  # a use of ``keys``: out of the LRU while pinned, else the most recent
        for k in keys:
            passed.discard(k)
            e = index.entries.get(k)
            if e is not None and not e.pinned:
                model[k] = next(clock)
            else:
                model.pop(k, None)

    for _ in range(500):
        op = rng.choice(["store", "store", "lease", "release", "read", "abort", "hold", "unhold"])
        ready = [k for k, e in index.entries.items() if e.state is State.READY]
        if op == "store":
            keys = [key(rng.randrange(40)) for _ in range(rng.randint(1, 3))]
            in_order = sorted(model, key=model.__getitem__)
            res, present, no_space = index.reserve_write(keys, "f", SIZE, 1, owner)
            refresh([keys[i] for i in present])  # a store of a present chunk uses it
            stored = index.commit_write(res)
            if ev.evicted:  # a chunk with no room evicts nothing (no eviction would make room) and passes nothing
                last = max(in_order.index(k) for k in ev.evicted)
                for k in in_order[:last]:  # what eviction met before its last victim: evicted, or held and passed
                    if k not in ev.evicted and k not in keys:  # (the store's own present chunks were out of the LRU)
                        assert holds(k), f"{k} was passed over but is not held"
                        passed.add(k)
                        del model[k]
            for k in ev.evicted:
                assert k not in keys, f"{k} was evicted by a store that names it"
                assert k in model and not holds(k), f"{k} was evicted while pinned or held"
                del model[k]
            ev.evicted.clear()
            refresh([e.key for _, e in stored])
        elif op == "lease" and ready:
            picked = rng.sample(ready, min(len(ready), rng.randint(1, 3)))
            leases.append(index.lease({k: index.entries[k] for k in picked}, 30, owner))
            refresh(picked)
        elif op == "release" and leases:
            lid = leases.pop(rng.randrange(len(leases)))
            was = list(index.leases[lid].entries) if lid in index.leases else []
            index.release_lease(lid)
            refresh([k for k in was if not holds(k)])  # a held one is released to the LRU by its last hold
        elif op in ("read", "abort") and ready:
            picked = rng.sample(ready, min(len(ready), rng.randint(1, 3)))
            res, _ = index.reserve_read(picked, "f", 1, owner)
            refresh(picked)
            assert not any(k in model for k in picked)
            (index.commit_read if op == "read" else index.abort)(res)
            refresh([k for k in picked if not holds(k)])
        elif op == "hold" and ready:
            e = index.entries[rng.choice(ready)]
            index.hold(e)
            held.append(e)  # no use: its place stays
        elif op == "unhold" and held:
            e = held.pop(rng.randrange(len(held)))
            index.release(e)
            k = e.key
            if not holds(k) and not e.pinned:
                if k in passed:
                    passed.discard(k)
                    model[k] = next(front)  # back at the front, where eviction met it
                elif k not in model:
                    model[k] = next(clock)  # used while held: the most recent
        in_order = sorted(model, key=model.__getitem__)
        assert list(index._lru) == in_order
        assert index.pinned_chunks() == sum(1 for e in index.entries.values() if e.pinned)
        pins = sum(len(lease.entries) for lease in index.leases.values()) + \
            sum(len(r.entries) for r in index.reservations.values() if not r.write)
        assert index.chunk_pins == owner.chunk_pins == pins
        assert index._by_model == ({"m": set(index.entries)} if index.entries else {})
    index.allocator.check()


def test_a_chunk_written_to_l2_keeps_its_place_in_the_lru() -> None:
    """The L2 writer's read of a chunk is no use of it: the chunk keeps its place (it became the
    most recently used, so the chunks whose L2 write was dropped, the only copies, went first)."""
    ev = Recorder()
    index = ChunkIndex(3 * SIZE, on_evict=ev)
    a, b, c, d = (key(i) for i in range(4))
    store(index, [a, b, c])
    index.hold(index.entries[a])  # written to L2 ...
    index.release(index.entries[a])  # ... and done
    store(index, [d])
    assert ev.evicted == [a]
    index.hold(index.entries[b])  # held while eviction meets it: passed over, then back at the front
    store(index, [a])
    assert ev.evicted == [a, c]
    index.release(index.entries[b])
    assert list(index._lru) == [b, d, a]


def test_clear_and_format_of_look_at_one_model_only() -> None:
    index = ChunkIndex(16 * SIZE)
    a = [key(i, model="a") for i in range(4)]
    b = [key(i, model="b") for i in range(4)]
    store(index, a, fmt="fa")
    store(index, b, fmt="fb")
    lease(index, "a", 1, [a[0].chunk_hash])
    assert (index.format_of("a", 1), index.format_of("b", 1), index.format_of("b", 2)) == ("fa", "fb", None)
    assert sorted(index.clear("a")) == sorted(a[1:])  # the leased chunk stays
    assert set(index.entries) == {a[0], *b} and index.format_of("a", 1) == "fa"
    assert sorted(index.clear("b")) == sorted(b)
    assert index.format_of("b", 1) is None and index.clear("nobody") == []
    index.allocator.check()


class _Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no text")


def test_the_guard_resolves_every_future_it_hands_out() -> None:
    """A plugin's future that is cancelled, or whose result cannot even be read, must still end
    the tier's: the writers wait on them without a timeout. (An in-process stand-in for a broken
    plugin: the real broken stores behind a server are in test_l2_plugin_faults.py.)"""
    from concurrent.futures import Future

    from kvxfer.store import Backend
    from kvxfer.store.guard import GuardedBackend, PluginFault

    class Weird(list):  # a list whose items cannot be looked at
        def __iter__(self):  # type: ignore[no-untyped-def]
            raise RuntimeError("no items")

    class Broken(Backend):
        def submit_exists(self, keys):  # type: ignore[no-untyped-def]
            fut: Future[object] = Future()
            fut.cancel()
            return fut

        def submit_get(self, items):  # type: ignore[no-untyped-def]
            fut: Future[object] = Future()
            fut.set_result(Weird([None]))
            return fut

        def submit_put(self, items):  # type: ignore[no-untyped-def]
            return [True]  # not a future

        def submit_delete(self, keys):  # type: ignore[no-untyped-def]
            fut: Future[object] = Future()
            fut.set_result(True)  # a bool is no count
            return fut

        def ping(self) -> None:
            raise ConnectionResetError("gone")

        def stats(self):  # type: ignore[no-untyped-def]
            return {_Unprintable(): 1}

        def close(self) -> None:
            raise RuntimeError("close exploded")

    g = GuardedBackend("broken", Broken())
    with pytest.raises(PluginFault, match="cancelled"):
        g.submit_exists([b"k"]).result(1)
    with pytest.raises(PluginFault, match="could not be read"):
        g.submit_get([(b"k", [])]).result(1)
    with pytest.raises(PluginFault, match="not a concurrent.futures.Future"):
        g.submit_put([(b"k", [])])
    with pytest.raises(PluginFault, match="not a count"):
        g.submit_delete([b"k"]).result(1)
    with pytest.raises(StoreUnavailable) as gone:  # an OSError is the store gone, not the plugin's fault
        g.ping()
    assert not isinstance(gone.value, PluginFault)
    with pytest.raises(PluginFault, match="cannot be read as text"):
        g.stats()
    g.close()  # logged, not raised


def test_the_guard_takes_back_only_what_the_plugins_future_says_is_withdrawn() -> None:
    """The tier frees a withdrawn get's arena slots: a plugin whose withdraw() says True while its
    future is still pending may still write into them. The boundary then keeps its own future
    pending, and it ends with the plugin's (the bytes the plugin wrote are the get's, as ever).
    A plugin that cancels its future is taken at its word. (In-process stand-ins for the plugins:
    the real ThreadedBackend is in the store kit's test_kit_withdraw_takes_back_only_what_has_not_started.)"""
    from concurrent.futures import Future

    from kvxfer.store import Backend, GetStatus
    from kvxfer.store.guard import GuardedBackend

    class Plugin(Backend):
        def __init__(self, honest: bool) -> None:
            self.honest = honest
            self.pending: list[Future[object]] = []

        def submit_get(self, items):  # type: ignore[no-untyped-def]
            fut: Future[object] = Future()
            self.pending.append(fut)
            return fut

        def withdraw(self, fut):  # type: ignore[no-untyped-def]
            return fut.cancel() if self.honest else True

        submit_exists = submit_put = submit_delete = submit_get

        def ping(self) -> None:
            pass

        def close(self) -> None:
            pass

    liar = Plugin(honest=False)
    g = GuardedBackend("liar", liar)
    out = g.submit_get([(b"k", [memoryview(bytearray(4))])])
    ended: list[bool] = []
    out.add_done_callback(lambda f: ended.append(f.cancelled()))
    assert g.withdraw(out) is False and not out.done() and not ended
    liar.pending[0].set_result([GetStatus.HIT])  # the plugin's get ran after all
    assert out.result(1) == [GetStatus.HIT] and ended == [False]

    honest = Plugin(honest=True)
    g = GuardedBackend("honest", honest)
    out = g.submit_get([(b"k", [memoryview(bytearray(4))])])
    out.add_done_callback(lambda f: ended.append(f.cancelled()))
    assert g.withdraw(out) is True and out.cancelled() and ended == [False, True]
    assert g.withdraw(out) is False  # ended: nothing left to withdraw


class _RoomFromScratch(ChunkIndex):
    """The index with the room eviction could make found anew at every allocation (one pass
    over the entries each time), the way it was before it was kept up to date per reservation."""

    def _room_after_eviction(self, size, room):  # type: ignore[no-untyped-def]
        room.clear()
        return super()._room_after_eviction(size, room)


@pytest.mark.parametrize("seed", range(6))
def test_the_room_kept_through_a_store_decides_as_one_found_anew_would(seed: int) -> None:
    """Random stores of chunks of two sizes, leases, reads and L2-writer holds, against an index
    that finds the room eviction could make anew at every allocation: every store gets the same
    slots, the same no_space and the same evictions from both."""
    rng = random.Random(seed)
    evs = (Recorder(), Recorder())
    kept, fresh = ChunkIndex(24 * SIZE, on_evict=evs[0]), _RoomFromScratch(24 * SIZE, on_evict=evs[1])
    leases: list[tuple[int, int]] = []
    held: list[ChunkKey] = []
    owner = Usage()
    for step in range(400):
        op = rng.choice(["store", "store", "store", "lease", "release", "read", "hold", "unhold"])
        ready = sorted((k for k, e in kept.entries.items() if e.state is State.READY), key=lambda k: k.chunk_hash)
        if op == "store":
            model = rng.choice(["small", "big"])
            size = SIZE if model == "small" else rng.choice([3, 4, 6]) * SIZE
            keys = [key(rng.randrange(30), model=model) for _ in range(rng.randint(1, 5))]
            out = [index.reserve_write(keys, model, size, 1, owner) for index in (kept, fresh)]
            (a, pa, na), (b, pb, nb) = out
            assert (pa, na) == (pb, nb), (step, pa, na, pb, nb)
            assert [(i, e.offset) for i, e in a.entries] == [(i, e.offset) for i, e in b.entries], step
            assert evs[0].evicted == evs[1].evicted, step
            kept.commit_write(a)
            fresh.commit_write(b)
        elif op == "lease" and ready:
            picked = rng.sample(ready, min(len(ready), rng.randint(1, 3)))
            leases.append(tuple(index.lease({k: index.entries[k] for k in picked}, 30, owner)
                                for index in (kept, fresh)))  # type: ignore[arg-type]
        elif op == "release" and leases:
            for index, lid in zip((kept, fresh), leases.pop(rng.randrange(len(leases)))):
                index.release_lease(lid)
        elif op == "read" and ready:
            model = rng.choice(ready).model_name
            of_model = [k for k in ready if k.model_name == model]
            picked = rng.sample(of_model, min(len(of_model), rng.randint(1, 3)))
            for index in (kept, fresh):
                index.commit_read(index.reserve_read(picked, model, 1, owner)[0])
        elif op == "hold" and ready:
            k = rng.choice(ready)
            held.append(k)
            for index in (kept, fresh):
                index.hold(index.entries[k])
        elif op == "unhold" and held:
            k = held.pop(rng.randrange(len(held)))
            for index in (kept, fresh):
                index.release(index.entries[k])
        evs[0].evicted.clear()
        evs[1].evicted.clear()
        held = [k for k in held if k in kept.entries]
    kept.allocator.check()
    fresh.allocator.check()
