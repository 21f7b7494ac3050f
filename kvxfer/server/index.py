"""The key index of the L1 store: entries, LRU eviction, leases and reservations.

Owned by the server's loop thread (no locks): every method runs there.

Life of a chunk: ``reserve_write`` allocates a slot and adds a WRITING entry (pinned); the writer
fills the slot; ``commit_write`` makes it READY (and evictable, most recently used). A reader's
``reserve_read`` pins READY entries (``readers``), ``commit_read`` unpins them. A lease pins
entries until it expires or its readers release it. Only READY entries with no readers and no
leases are ever evicted, least recently used first, and only to make room for a new slot.

The LRU holds the evictable entries (READY, unpinned), least recently used first: an entry
leaves it when pinned and comes back, as the most recently used, when the last pin goes, so
that making room evicts from its front in constant time per chunk, however much is pinned. The
one exception is a *hold* (the L2 writer reading a slot, which is no use of the chunk): a held
entry keeps its place; eviction takes it out of the LRU when it meets it, and its release puts
it back at the front.

Accounting is exact by construction: an entry's ``leases`` counts the leases that hold it (a
lease holds each key once, however often a request repeats it) and ``readers`` the read
reservations' pins (one per occurrence, released per occurrence). Every reservation and lease
belongs to a :class:`Usage` (the session's), updated in the one place each leaves the index.
Reservation and lease ids are random 63-bit numbers: knowing one proves it was handed out.
"""

from __future__ import annotations

import bisect
import enum
import itertools
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvxfer.errors import InvalidRequest
from kvxfer.server.allocator import Allocator

__all__ = ["ChunkKey", "Entry", "ChunkIndex", "Reservation", "Lease", "Usage"]

log = logging.getLogger(__name__)


class ChunkKey(NamedTuple):
    model_name: str
    world_size: int
    rank: int
    chunk_hash: bytes


class State(enum.Enum):
    WRITING = 1
    READY = 2


#: Stamps of entries: one number per stored chunk for the server's life (see :class:`Entry`).
_next_stamp = itertools.count(1).__next__


@dataclass(slots=True, eq=False)
class Entry:
    key: ChunkKey
    offset: int
    size: int
    fmt: str
    state: State = State.WRITING
    readers: int = 0
    leases: int = 0
    #: This entry's bytes and no other's, for the server's life: a slot reused for another chunk
    #: (or the same chunk stored again) gets another stamp (what a transport's prefetch matches).
    stamp: int = field(default_factory=_next_stamp)

    @property
    def pinned(self) -> bool:
        return self.state is State.WRITING or self.readers > 0 or self.leases > 0


@dataclass(slots=True, eq=False)
class Usage:
    """What one owner (a session) holds in the index; :class:`ChunkIndex` keeps it exact."""

    reservations: dict[int, Reservation] = field(default_factory=dict)
    #: Arena bytes (allocation-rounded) its open reservations hold: the slots of its writes, and
    #: each entry its reads pin, once however many of its reads pin it (a layer-wise read pins
    #: the same chunks once per range of layers in flight).
    reserved_bytes: int = 0
    #: Entries its open reads pin -> how many of them pin each.
    read_pins: dict[Entry, int] = field(default_factory=dict)
    leases: dict[int, Lease] = field(default_factory=dict)
    #: Arena bytes its leases pin, each entry once however many of its leases hold it (a
    #: scheduler looks the same prefix up again while its request waits).
    leased_bytes: int = 0
    #: Entries its leases hold -> how many of them hold each.
    lease_pins: dict[Entry, int] = field(default_factory=dict)
    #: Chunk references its leases and read reservations hold (an entry held twice counts twice).
    chunk_pins: int = 0

    def lease_need(self, entries: Iterable[Entry]) -> int:
        """Bytes a lease of ``entries`` would add to :attr:`leased_bytes`."""
        return sum(Allocator.rounded(e.size) for e in entries if e not in self.lease_pins)


@dataclass(slots=True, eq=False)
class Reservation:
    id: int
    write: bool
    instance_id: int
    owner: Usage
    #: (index in the request, entry)
    entries: list[tuple[int, Entry]]
    lease_id: int = 0
    #: A write's arena bytes (allocation-rounded), counted in ``owner.reserved_bytes`` (a read's pins
    #: are counted per entry: Usage.read_pins).
    nbytes: int = 0
    #: A server-driven copy is running on it: only the request's own finish may end it.
    in_flight: bool = False
    #: Counted in ChunkIndex.filling until committed or aborted.
    filling: bool = False
    #: An open write of a silent client kept until its process exits (see CacheServer).
    parked: bool = False
    #: When it was made (time.perf_counter), for the transfer's duration.
    opened: float = field(default_factory=time.perf_counter)
    #: Chunks a read asked for that were not there (for the server's figures).
    missing: int = 0


@dataclass(slots=True, eq=False)
class Lease:
    id: int
    expires: float
    owner: Usage
    entries: dict[ChunkKey, Entry] = field(default_factory=dict)


class _Room:
    """The gaps left by what no eviction may free (entries pinned, held or being written), for
    the allocations of one write reservation: found with one pass over the entries at the
    first allocation that must evict, then kept up to date with the reservation's own new slots,
    the only change to them while it allocates (evictions free evictable space only)."""

    __slots__ = ("_starts", "_stops", "_largest")

    def __init__(self, capacity: int, fixed: Iterable[tuple[int, int]]) -> None:
        self._starts: list[int] = []
        self._stops: list[int] = []
        end = 0
        for start, stop in sorted(fixed):
            if start > end:
                self._starts.append(end)
                self._stops.append(start)
            end = max(end, stop)
        if capacity > end:
            self._starts.append(end)
            self._stops.append(capacity)
        self._largest: int | None = None

    def largest(self) -> int:
        """The largest gap, in bytes."""
        if self._largest is None:
            self._largest = max((b - a for a, b in zip(self._starts, self._stops)), default=0)
        return self._largest

    def take(self, offset: int, size: int) -> None:
        """A new slot ``[offset, offset + size)`` (always inside a gap) is no longer free to evict."""
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0 or offset >= self._stops[i]:
            return
        start, stop = self._starts[i], self._stops[i]
        parts = [(a, b) for a, b in ((start, offset), (min(offset + size, stop), stop)) if b > a]
        self._starts[i:i + 1] = [a for a, _ in parts]
        self._stops[i:i + 1] = [b for _, b in parts]
        if self._largest is not None and stop - start >= self._largest:
            self._largest = None  # the largest gap may be the one cut


class ChunkIndex:
    def __init__(self, capacity: int, on_evict: Callable[[list[ChunkKey]], None] | None = None) -> None:
        self.allocator = Allocator(capacity)
        self.entries: dict[ChunkKey, Entry] = {}
        #: The evictable entries (READY, unpinned), and held ones in their places, least recently used first.
        self._lru: OrderedDict[ChunkKey, Entry] = OrderedDict()
        #: Entries held without being used (:meth:`hold`), with their hold counts: they stay in
        #: the LRU, where eviction passes over them.
        self._held: dict[Entry, int] = {}
        #: Held entries that eviction passed over at the LRU's front: they go back there.
        self._passed: set[ChunkKey] = set()
        #: The keys of every entry by model name: what clear(model) and format_of look at.
        self._by_model: dict[str, set[ChunkKey]] = {}
        self.leases: dict[int, Lease] = {}
        self.reservations: dict[int, Reservation] = {}
        #: Chunk references all leases and read reservations hold (each Usage's chunk_pins, summed).
        self.chunk_pins = 0
        self._on_evict = on_evict
        self.evictions = 0
        #: Entries added, made readable or removed so far: a lookup that waited for L2 sees
        #: whether what it read of the index still holds.
        self.changes = 0
        #: Write reservations whose slots a client's copy is filling, and when the last one ended
        #: (time.monotonic()): the L2 writers wait for quiet. Read by other threads.
        self.filling = 0
        self.filled_at = 0.0

    def _new_id(self) -> int:
        while True:
            rid = secrets.randbits(63)
            if rid and rid not in self.reservations and rid not in self.leases:
                return rid

    # ------------------------------------------------------------------ lookup and leases

    def lookup(self, model_name: str, world_size: int, hashes: Sequence[bytes]) -> int:
        """Leading chunks READY for every rank. A hash named again is not looked up again: a
        request repeating one stored hash costs its distinct hashes' keys, not all of its own."""
        entries = self.entries
        seen: set[bytes] = set()
        for i, h in enumerate(hashes):
            if h in seen:
                continue
            for rank in range(world_size):
                e = entries.get(ChunkKey(model_name, world_size, rank, h))
                if e is None or e.state is not State.READY:
                    return i
            seen.add(h)
        return len(hashes)

    def lease_keys(self, model_name: str, world_size: int, hashes: Sequence[bytes]) -> dict[ChunkKey, Entry]:
        """The distinct entries a lease of ``hashes`` (all present) for every rank would hold."""
        out: dict[ChunkKey, Entry] = {}
        for h in dict.fromkeys(hashes):  # each distinct hash once
            for rank in range(world_size):
                key = ChunkKey(model_name, world_size, rank, h)
                out[key] = self.entries[key]
        return out

    def lease(self, entries: dict[ChunkKey, Entry], ttl: float, owner: Usage) -> int:
        """Pin ``entries`` (from :meth:`lease_keys`) for ``ttl`` seconds; returns the lease id."""
        lease = Lease(self._new_id(), time.monotonic() + ttl, owner, dict(entries))
        pins = owner.lease_pins
        for e in lease.entries.values():
            e.leases += 1
            self._used(e.key)
            n = pins.get(e, 0)
            if not n:
                owner.leased_bytes += Allocator.rounded(e.size)
            pins[e] = n + 1
        self.leases[lease.id] = lease
        owner.leases[lease.id] = lease
        owner.chunk_pins += len(lease.entries)
        self.chunk_pins += len(lease.entries)
        return lease.id

    def release_lease(self, lease_id: int, keys: Iterable[ChunkKey] | None = None) -> None:
        """Release ``keys`` of a lease (all of it when None); unknown or expired ids are ignored."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return
        for key in list(lease.entries) if keys is None else keys:
            e = lease.entries.pop(key, None)
            if e is not None:
                e.leases -= 1
                self._evictable(e)
                lease.owner.chunk_pins -= 1
                self.chunk_pins -= 1
                pins = lease.owner.lease_pins
                n = pins[e] - 1
                if n:
                    pins[e] = n
                else:
                    del pins[e]
                    lease.owner.leased_bytes -= Allocator.rounded(e.size)
        if not lease.entries:
            del self.leases[lease_id]
            del lease.owner.leases[lease_id]

    def expire_leases(self, now: float) -> int:
        expired = [lid for lid, lease in self.leases.items() if lease.expires <= now]
        for lid in expired:
            self.release_lease(lid)
        return len(expired)

    @property
    def leased_chunks(self) -> int:
        return sum(len(lease.entries) for lease in self.leases.values())

    def pinned_chunks(self) -> int:
        """Entries that cannot be evicted now (being written, read, leased or held): zero
        whenever no reservation, lease or hold is open."""
        lru = self._lru
        return len(self.entries) - len(lru) + sum(1 for e in self._held if lru.get(e.key) is e)

    def pin(self, e: Entry) -> None:
        """Pin a READY entry as a reader (a read reservation's, a promoting lookup's hits): a
        use, after which it is the most recently used."""
        e.readers += 1
        self._used(e.key)

    def _used(self, key: ChunkKey) -> Entry | None:
        """A use of ``key``'s entry: out of the LRU (the caller pins it; the most recent once
        unpinned, even if eviction passed over it while held). Returns it if it was there."""
        self._passed.discard(key)
        return self._lru.pop(key, None)

    def hold(self, e: Entry) -> None:
        """Keep a READY entry from eviction without using it (the L2 writer reads its slot): it
        keeps its place in the LRU, eviction passes over it, and :meth:`release` puts it back
        where it was (an entry passed over at the front goes back to the front)."""
        e.readers += 1
        self._held[e] = self._held.get(e, 0) + 1

    def release(self, e: Entry) -> None:
        """Undo :meth:`hold`."""
        e.readers -= 1
        n = self._held.pop(e) - 1
        if n:
            self._held[e] = n
            return
        if e.key in self._passed:
            self._passed.discard(e.key)
            if not e.pinned and self.entries.get(e.key) is e:
                self._lru[e.key] = e
                self._lru.move_to_end(e.key, last=False)
            return
        self._evictable(e)  # in the LRU still (where it stays), or out of it since a use: the most recent

    def unpin(self, e: Entry) -> None:
        """Undo :meth:`pin`."""
        e.readers -= 1
        self._evictable(e)

    def _evictable(self, e: Entry) -> None:
        """``e`` back in the LRU, as the most recently used, if it is still indexed and nothing pins it."""
        if not e.pinned and self.entries.get(e.key) is e:
            self._lru[e.key] = e

    def _open(self, res: Reservation) -> Reservation:
        self.reservations[res.id] = res
        owner = res.owner
        owner.reservations[res.id] = res
        if res.write:
            owner.reserved_bytes += res.nbytes
        else:
            owner.chunk_pins += len(res.entries)
            self.chunk_pins += len(res.entries)
            for _, e in res.entries:
                n = owner.read_pins.get(e, 0)
                if not n:
                    owner.reserved_bytes += Allocator.rounded(e.size)
                owner.read_pins[e] = n + 1
        return res

    def _close(self, res: Reservation) -> None:
        """The one place a reservation leaves the index."""
        if self.reservations.pop(res.id, None) is None:
            return
        owner = res.owner
        del owner.reservations[res.id]
        if res.write:
            owner.reserved_bytes -= res.nbytes
            return
        owner.chunk_pins -= len(res.entries)
        self.chunk_pins -= len(res.entries)
        for _, e in res.entries:
            n = owner.read_pins[e] - 1
            if n:
                owner.read_pins[e] = n
            else:
                del owner.read_pins[e]
                owner.reserved_bytes -= Allocator.rounded(e.size)

    def write_need(self, keys: Sequence[ChunkKey]) -> int:
        """How many slots :meth:`reserve_write` of ``keys`` would allocate (no side effect)."""
        return len({k for k in keys if k not in self.entries})

    def read_pins(self, keys: Sequence[ChunkKey], owner: Usage) -> tuple[int, int]:
        """(pins, bytes) that :meth:`reserve_read` of ``keys`` by ``owner`` would take (no side
        effect): bytes of the entries ``owner`` does not pin yet, each once."""
        n = nbytes = 0
        new: set[ChunkKey] = set()
        for k in keys:
            e = self.entries.get(k)
            if e is not None and e.state is State.READY:
                n += 1
                if e not in owner.read_pins and k not in new:
                    new.add(k)
                    nbytes += Allocator.rounded(e.size)
        return n, nbytes

    # ------------------------------------------------------------------ writes

    def reserve_write(
        self, keys: Sequence[ChunkKey], fmt: str, size: int, instance_id: int, owner: Usage, filling: bool = True
    ) -> tuple[Reservation, list[int], list[int]]:
        """Slots for the keys not present. Returns (reservation, present, no_space). ``filling``:
        the slots are filled by a client's copy, counted in :attr:`filling` (a promotion from L2
        is not: the L2 writers yield to client copies only).

        Refused (InvalidRequest, before anything is evicted or reserved) when a key is stored in
        another format. A key named again after its first copy is present if that copy got a slot
        (this request writes it), else no space too. A present key counts as used: it is not
        evicted to make room for the request's other chunks, and becomes the most recently used.
        The request's evictions are reported in one ``on_evict`` call."""
        present: list[int] = []
        new: list[tuple[int, ChunkKey]] = []
        held: list[Entry] = []  # present entries, out of the LRU while this request allocates
        evicted: list[ChunkKey] = []
        res = Reservation(self._new_id(), True, instance_id, owner, [])
        no_space: list[int] = []
        entries = self.entries
        repeats: list[tuple[int, int]] = []  # (index, index of its first copy) of a key new here
        try:
            seen: dict[ChunkKey, int] = {}
            for i, key in enumerate(keys):
                e = entries.get(key)
                if e is None:
                    first = seen.get(key)
                    if first is None:
                        seen[key] = i
                        new.append((i, key))
                    else:
                        repeats.append((i, first))
                    continue
                if e is not None and e.fmt != fmt:
                    raise InvalidRequest(
                        f"chunk {key.chunk_hash.hex()} of {key.model_name!r} is stored in format {e.fmt}, "
                        f"this instance writes {fmt}: two registrations of one model_name must have "
                        "the same layout, dtype and number of layers"
                    )
                present.append(i)
                if e is not None and self._used(key) is not None:  # stored again: a use
                    held.append(e)
            room: list[_Room] = []  # made by the first allocation that must evict
            for i, key in new:
                offset = self._allocate(size, evicted, room)
                if offset is None:
                    no_space.append(i)
                    continue
                e = Entry(key, offset, size, fmt)
                entries[key] = e
                self._by_model.setdefault(key.model_name, set()).add(key)
                self.changes += 1
                res.entries.append((i, e))
                res.nbytes += Allocator.rounded(size)
        finally:
            for h in held:
                self._evictable(h)
            if evicted:
                self._report_evicted(evicted)
        if repeats:  # a repeat is what its first copy is: being written here, or refused for room
            refused = set(no_space)
            for i, first in repeats:
                (no_space if first in refused else present).append(i)
            present.sort()
            no_space.sort()
        if res.entries and filling:
            res.filling = True
            self.filling += 1
        return self._open(res), present, no_space

    def _report_evicted(self, keys: list[ChunkKey]) -> None:
        """Count ``keys`` evicted and tell ``on_evict`` (whose failure is logged: the index is
        consistent either way, and the request that evicted them goes on)."""
        self.evictions += len(keys)
        if self._on_evict is None:
            return
        try:
            self._on_evict(keys)
        except Exception:  # noqa: BLE001  (bookkeeping of the caller's: never the index's state)
            log.exception("reporting %d evicted chunks failed", len(keys))

    def commit_write(self, res: Reservation, failed: Iterable[int] = ()) -> list[tuple[int, Entry]]:
        """READY the reservation's entries except ``failed`` indices (dropped); each becomes
        evictable unless a lease took it while it was written (a promotion's entries)."""
        self._close(res)
        if res.filling:
            res.filling = False
            self.filling -= 1
            self.filled_at = time.monotonic()
        bad = set(failed)
        stored = []
        for i, e in res.entries:
            if i in bad:
                self._drop(e)
            else:
                e.state = State.READY
                self.changes += 1
                self._evictable(e)  # not while a lease holds it (a promotion's, leased as it was written)
                stored.append((i, e))
        return stored

    # ------------------------------------------------------------------ reads

    def reserve_read(
        self, keys: Sequence[ChunkKey], fmt: str, instance_id: int, owner: Usage, lease_id: int = 0
    ) -> tuple[Reservation, list[int]]:
        """Pin the READY entries of ``keys``. Returns (reservation, missing indices)."""
        res = Reservation(self._new_id(), False, instance_id, owner, [], lease_id)
        missing = []
        for i, key in enumerate(keys):
            e = self.entries.get(key)
            if e is None or e.state is not State.READY:
                missing.append(i)
                continue
            if e.fmt != fmt:
                self.abort(res)
                raise InvalidRequest(
                    f"chunk {key.chunk_hash.hex()} of {key.model_name!r} was stored in format {e.fmt}, "
                    f"this instance reads {fmt}: registrations of one model_name must match"
                )
            self.pin(e)
            res.entries.append((i, e))
        return self._open(res), missing

    def commit_read(self, res: Reservation) -> None:
        self._close(res)
        for _, e in res.entries:
            self.unpin(e)
        if res.lease_id:
            self.release_lease(res.lease_id, [e.key for _, e in res.entries])

    def abort(self, res: Reservation) -> None:
        """Undo a reservation that will never be committed (its client died, or it failed)."""
        if res.write:
            self.commit_write(res, failed=[i for i, _ in res.entries])
        else:
            self._close(res)
            for _, e in res.entries:
                self.unpin(e)

    # ------------------------------------------------------------------ space

    def _allocate(self, size: int, evicted: list[ChunkKey], room: list[_Room]) -> int | None:
        """A slot of ``size``, evicting the least recently used entries until one fits (their
        keys added to ``evicted``, which the caller reports); None when nothing is left to evict,
        or when no eviction could make room (:meth:`_room_after_eviction`). ``room`` holds the
        reservation's :class:`_Room` once one was made."""
        offset = self.allocator.alloc(size)
        if offset is None:
            lru = self._lru
            if lru and not self._room_after_eviction(size, room):
                return None
            while lru:  # the least recently used first; every entry here is evictable but the held
                key, e = lru.popitem(last=False)
                if e.pinned:  # held (see hold): back at the front once released
                    self._passed.add(key)
                    continue
                self._drop(e)
                evicted.append(key)
                offset = self.allocator.alloc(size)
                if offset is not None:
                    break
        if offset is not None and room:
            room[0].take(offset, Allocator.rounded(size))
        return offset

    def _room_after_eviction(self, size: int, room: list[_Room]) -> bool:
        """Whether evicting every evictable entry would leave ``size`` bytes in one piece, so
        that an allocation no eviction can serve evicts nothing: a few pinned chunks spread over
        the arena (small chunks of another model, leased) leave no room for a large one however
        much is evicted. True at once when the least recently used entry is evictable and at
        least that large (evicting it makes the room: always so with one chunk size); otherwise
        the gaps between what nothing may evict (pinned, held, being written) decide: found once
        per reservation, one pass over the entries (their keys set apart from the LRU's in C),
        and kept in ``room`` for its next allocations."""
        need = Allocator.rounded(size)
        lru = self._lru
        head = next(iter(lru.values()))
        if not head.pinned and Allocator.rounded(head.size) >= need:
            return True
        if not room:
            entries = self.entries
            fixed = [entries[k] for k in entries.keys() - lru.keys()]
            fixed += [e for e in self._held if lru.get(e.key) is e]
            room.append(_Room(self.allocator.capacity,
                              ((e.offset, e.offset + Allocator.rounded(e.size)) for e in fixed)))
        return room[0].largest() >= need

    def _drop(self, e: Entry) -> None:
        self.changes += 1
        del self.entries[e.key]
        self._lru.pop(e.key, None)
        self._passed.discard(e.key)
        keys = self._by_model[e.key.model_name]
        keys.discard(e.key)
        if not keys:
            del self._by_model[e.key.model_name]
        self.allocator.free(e.offset, e.size)

    def format_of(self, model_name: str, world_size: int) -> str | None:
        """The chunk format of the entries stored or being written (a store, a promotion from
        L2) under ``model_name`` and ``world_size`` (writes of another format are refused, so
        all share one), or None. Looks at that model's entries only, until one of that world size."""
        entries = self.entries
        for key in self._by_model.get(model_name, ()):
            if key.world_size == world_size:
                return entries[key].fmt
        return None

    def clear(self, model_name: str = "") -> list[ChunkKey]:
        """Drop READY, unpinned entries (of ``model_name`` only, when given)."""
        if model_name:  # that model's entries only, however many others the index holds
            gone = [k for k in self._by_model.get(model_name, ()) if k in self._lru and not self._lru[k].pinned]
        else:
            gone = [k for k, e in self._lru.items() if not e.pinned]
        for key in gone:
            self._drop(self.entries[key])
        return gone

    @property
    def used_bytes(self) -> int:
        return self.allocator.used
