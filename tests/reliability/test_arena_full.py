"""A full arena: LRU eviction keeps stores going; leased and in-use chunks are never evicted;
a store that cannot fit says which chunks it stored.

The ``small_server`` arena holds exactly 16 chunks of 16 KiB.
"""

from __future__ import annotations

import torch
from relkit import Writer, expected, key

from kvxfer.protocol import messages as m
from kvxfer.copies import SlotViews, plan_copies
from kvxfer.transport import Transfer

CAPACITY = 16


def keys(prefix: str, n: int, start: int = 0) -> list[bytes]:
    return [key(prefix, j) for j in range(start, start + n)]


def present(w: Writer, ks: list[bytes]) -> list[bool]:
    return [w.client.lookup(w.model, hashes=[k]) == 1 for k in ks]


def test_lru_eviction_keeps_stores_going(small_server, client_of):
    w = Writer(client_of(small_server))
    a, b, c = keys("a", 8), keys("b", 8), keys("c", 8)
    assert w.store(a).stored == list(range(8))
    assert w.store(b).stored == list(range(8))
    assert w.client.status().arena.chunks == CAPACITY
    res, bad = w.retrieve(a)  # a is now more recently used than b
    assert res.loaded == list(range(8)) and bad == []
    assert w.store(c).stored == list(range(8)) and w.store(c).present == list(range(8))
    assert present(w, a) == [True] * 8
    assert present(w, b) == [False] * 8
    assert present(w, c) == [True] * 8
    for n in range(6):  # many more stores: every one fits, by evicting the oldest
        res = w.store(keys(f"d{n}", 8))
        assert res.stored == list(range(8)) and res.failed == []
    st = w.client.status()
    assert st.arena.chunks == CAPACITY and st.arena.evictions >= 8 + 6 * 8
    res, bad = w.retrieve(keys("d5", 8))
    assert res.loaded == list(range(8)) and bad == []


def test_leased_chunks_are_never_evicted(small_server, client_of):
    w = Writer(client_of(small_server))
    leased = keys("leased", 8)
    w.store(leased)
    lease = w.client.lookup_and_lease("m", hashes=leased, lease_s=120)
    assert lease.hits == 8 and lease.lease_id
    for n in range(10):
        res = w.store(keys(f"churn{n}", 4))
        assert res.stored == [0, 1, 2, 3]
    assert present(w, leased) == [True] * 8
    res, bad = w.retrieve(leased, lease_id=lease.lease_id)  # the read releases the lease
    assert res.loaded == list(range(8)) and bad == []
    assert w.client.status().leases == 0
    for n in range(4):
        w.store(keys(f"more{n}", 8))
    assert present(w, leased) == [False] * 8, "a released lease still pins its chunks"


def test_chunks_being_read_or_written_are_never_evicted(small_server, client_of):
    w = Writer(client_of(small_server))
    reading = keys("reading", 4)
    w.store(reading)
    iid = w.ctx.instance_id
    rd = w.client.request(m.ReserveRead(iid, reading))
    assert len(rd.slots) == 4
    writing = keys("writing", 4)
    wr = w.client.request(m.ReserveWrite(iid, writing))
    assert len(wr.slots) == 4
    # fill the write slots as a transport would, from blocks 40..43
    blocks = list(range(40, 44))
    for j, h in enumerate(writing):
        bits = expected(w.shape, "m", 0, h, w.bpc)
        for layer, b in zip(w.kv, bits):
            layer.view(torch.int16)[:, blocks[j]:blocks[j] + 1] = b
    views = SlotViews(w.ctx.arena.view, w.ctx.layout, w.client.chunk_size)
    copies = plan_copies(w.ctx.layout, w.client.chunk_size, torch.tensor(blocks),
                         [(s.index, views.rows(s.offset)) for s in wr.slots])
    w.ctx.gather(copies, Transfer("store", writing, torch.tensor(blocks)))

    for n in range(10):  # churn: 40 chunks through an arena with 8 free slots
        res = w.store(keys(f"churn{n}", 4))
        assert res.stored == [0, 1, 2, 3]
    assert w.client.status().arena.evictions >= 32

    w.client.request(m.CommitRead(iid, rd.reservation_id))
    done = w.client.request(m.CommitWrite(iid, wr.reservation_id))
    assert sorted(done.stored) == [0, 1, 2, 3]
    res, bad = w.retrieve(reading + writing)
    assert res.loaded == list(range(8)) and bad == [], "a pinned chunk was evicted or overwritten"


def test_store_that_cannot_fit_says_what_it_stored(small_server, client_of):
    w = Writer(client_of(small_server))
    leased = keys("leased", 14)
    w.store(leased)
    w.store(keys("filler", 2))
    lease = w.client.lookup_and_lease("m", hashes=leased, lease_s=120)
    assert lease.hits == 14
    new = keys("new", 4)
    res = w.store(new)
    assert res.stored == [0, 1] and res.failed == [2, 3] and not res.ok
    assert present(w, new) == [True, True, False, False]
    # everything pinned: nothing fits, nothing is lost, and the store says so
    w.client.lookup_and_lease("m", hashes=new[:2], lease_s=120)
    res = w.store(keys("none", 3))
    assert res.stored == [] and res.failed == [0, 1, 2]
    res, bad = w.retrieve(leased[:8])
    assert res.loaded == list(range(8)) and bad == []
    w.client.release_lease(lease.lease_id)
    res = w.store(keys("none", 3))
    assert res.stored == [0, 1, 2] and res.failed == []
