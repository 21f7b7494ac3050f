"""The staging ring's stream and event ordering, checked on any host.

CUDA cannot run here, so CUDA's ordering is stood in for (a mock, the only one of this file):
fake streams and events record every queued operation and what it follows, as CUDA orders
them: an operation follows the one before it on its stream and every record its stream waited
on; an event holds the last operation of its stream when it was recorded, and a wait takes the
event's latest record at the time of the wait; a host synchronize orders everything queued
after it behind what it waited for. The real :class:`CudaIpcServerContext` methods
(``prefetch``, ``_transfer``, ``_ring_plan``, ``_retrieve``, ``_store``, ``_ensure_staging``)
run against them over CPU tensors, through random sequences of prefetches, stores and retrieves
(duplicate keys, skips cutting the first chunk, layer parts, more chunks than buffers, chunks
stored again in the same slots, waiters run late or not yet), and every read of a staging
buffer is checked: the last write into that buffer ordered before it holds exactly the bytes it
must move (its own chunk, as stored now), and no write into that buffer is unordered with it.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from kvxfer.transport import RowCopy, StoredSlot
from kvxfer_cuda_ipc import server as srv

LAYERS, ROWS, ROW_BYTES = 4, 4, 8
CHUNK = LAYERS * ROWS * ROW_BYTES


@dataclass(eq=False)
class _Op:
    n: int
    after: frozenset[int]  # every operation ordered before this one
    buf: int
    write: bool
    content: tuple[Any, ...]


class _Sim:
    """Queued operations and what orders them."""

    def __init__(self) -> None:
        self.ops: list[_Op] = []
        self.host: frozenset[int] = frozenset()  # ordered before anything queued from now on
        self.current: _Stream | None = None
        self.buffers: dict[int, int] = {}  # staging buffer's address -> its number
        self.keep: list[torch.Tensor] = []  # buffers ever made: their addresses stay unique
        self.torn: set[int] = set()  # DMAs whose source was rewritten before they surely ran

    def queue(self, stream: _Stream, buf: int, write: bool, content: tuple[Any, ...]) -> None:
        deps = set(stream.waits) | ({stream.last} if stream.last is not None else set())
        stream.waits.clear()
        after = set(self.host)
        for d in deps:
            after |= self.ops[d].after | {d}
        op = _Op(len(self.ops), frozenset(after), buf, write, content)
        self.ops.append(op)
        stream.last = op.n

    def sync(self, n: int | None) -> None:
        if n is not None:
            self.host = self.host | self.ops[n].after | {n}

    def buffer_of(self, t: torch.Tensor) -> int | None:
        for b in self.keep:  # a staging view starts where its buffer does
            if b.data_ptr() not in self.buffers:
                self.buffers[b.data_ptr()] = len(self.buffers)
        return self.buffers.get(t.data_ptr())


class _Stream:
    def __init__(self, sim: _Sim) -> None:
        self.sim = sim
        self.last: int | None = None
        self.waits: set[int] = set()

    def wait_event(self, ev: _Event) -> None:
        if ev.op is not None:
            self.waits.add(ev.op)

    def synchronize(self) -> None:
        self.sim.sync(self.last)

    def query(self) -> bool:
        return self.last is None or self.last in self.sim.host


class _Event:
    def __init__(self, sim: _Sim) -> None:
        self.sim = sim
        self.op: int | None = None

    def record(self, stream: _Stream) -> None:
        self.op = stream.last

    def synchronize(self) -> None:
        self.sim.sync(self.op)

    def query(self) -> bool:
        return self.op is None or self.op in self.sim.host


class _FakeCuda:
    def __init__(self, sim: _Sim) -> None:
        self.sim = sim

    def Event(self) -> _Event:  # noqa: N802  (torch.cuda.Event)
        return _Event(self.sim)

    @contextlib.contextmanager
    def stream(self, s: _Stream) -> Iterator[None]:
        prev, self.sim.current = self.sim.current, s
        try:
            yield
        finally:
            self.sim.current = prev

    def device(self, _d: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class _Torch:
    """``torch`` for the server module: real, but for ``torch.cuda``."""

    def __init__(self, sim: _Sim) -> None:
        self.cuda = _FakeCuda(sim)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class _Totals:
    def __init__(self) -> None:
        self.prefetched = self.hits = 0

    def add(self, op: str, nbytes: int, seconds: float) -> None:
        pass

    def add_prefetch(self, staged: int, hits: int) -> None:
        self.prefetched += staged
        self.hits += hits


@dataclass
class _Arena:
    """Chunks in slots of one host tensor; a chunk stored again gets a new stamp (and bytes)."""

    n: int
    tensor: torch.Tensor = field(init=False)
    stamps: list[int] = field(init=False)
    next_stamp: int = 1

    def __post_init__(self) -> None:
        self.tensor = torch.zeros(self.n * CHUNK, dtype=torch.uint8)
        self.stamps = []
        for _ in range(self.n):
            self.stamps.append(self.next_stamp)
            self.next_stamp += 1

    def slot(self, i: int) -> torch.Tensor:
        return self.tensor[i * CHUNK:(i + 1) * CHUNK]

    def content(self, t: torch.Tensor) -> tuple[Any, ...]:
        """What a copy from ``t`` (a view of a slot) moves: where, how much, and which bytes."""
        i = (t.data_ptr() - self.tensor.data_ptr()) // CHUNK
        return ("arena", t.data_ptr(), t.numel() * t.element_size(), self.stamps[i])


class _Harness:
    def __init__(self, monkeypatch: pytest.MonkeyPatch, staging_chunks: int) -> None:
        self.sim = sim = _Sim()
        self.arena = _Arena(8)
        self.out = _Arena(4)  # slots stores write
        self.expect: dict[int, tuple[Any, ...]] = {}  # row ids' address -> what their copy moves
        self.rows: list[torch.Tensor] = []
        self.totals = _Totals()
        monkeypatch.setattr(srv, "torch", _Torch(sim))
        monkeypatch.setattr(srv, "_staging_bytes", lambda: staging_chunks * CHUNK)
        monkeypatch.setattr(srv, "_copy", self._copy)
        ctx = srv.CudaIpcServerContext.__new__(srv.CudaIpcServerContext)
        ctx.device = torch.device("cpu")
        ctx._elem = torch.uint8
        ctx._direct = False
        ctx._totals = self.totals  # type: ignore[assignment]
        ctx._compute = _Stream(sim)  # type: ignore[assignment]
        ctx._copy = _Stream(sim)  # type: ignore[assignment]
        ctx._ring, ctx._ready, ctx._free = [], [], []
        ctx._staged = {}
        ctx._warm = set()
        ctx._index_uploaded = None
        ctx._upload_rows = lambda copies, with_addresses=False: [c.rows for c in copies]  # type: ignore[method-assign]
        ctx._scatter = self._scatter  # type: ignore[method-assign]
        ctx._gather = self._gather  # type: ignore[method-assign]
        self.ctx = ctx

    # the copies, as operations
    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        s = self.sim.current
        assert s is not None, "a copy outside a stream context"
        self._note_buffers()
        buf = self.sim.buffer_of(dst)
        if buf is not None:  # H2D: arena slot -> staging
            self.sim.queue(s, buf, True, self.arena.content(src))
        else:  # D2H (store): staging -> slot; it must move what the store's gather put there
            buf = self.sim.buffer_of(src)
            assert buf is not None, "a copy neither into nor out of a staging buffer"
            self.sim.queue(s, buf, False, ("gathered", dst.data_ptr()))

    def _scatter(self, rows: torch.Tensor, stage: torch.Tensor, first: int) -> None:
        assert self.sim.current is self.ctx._compute
        self._note_buffers()
        buf = self.sim.buffer_of(stage)
        assert buf is not None
        self.sim.queue(self.sim.current, buf, False, self.expect[rows.data_ptr()])

    def _gather(self, rows: torch.Tensor, stage: torch.Tensor, first: int) -> None:
        assert self.sim.current is self.ctx._compute
        self._note_buffers()
        buf = self.sim.buffer_of(stage)
        assert buf is not None
        self.sim.queue(self.sim.current, buf, True, self.expect[rows.data_ptr()])

    def _note_buffers(self) -> None:
        for b in self.ctx._ring:
            if all(b is not k for k in self.sim.keep):
                self.sim.keep.append(b)

    def _rows(self, expect: tuple[Any, ...]) -> torch.Tensor:
        r = torch.empty(2, dtype=torch.int64)
        self.rows.append(r)
        self.expect[r.data_ptr()] = expect
        return r

    # what the server does
    def prefetch(self, chunks: list[int]) -> None:
        self.ctx.prefetch([StoredSlot(self.arena.slot(i), self.arena.stamps[i]) for i in chunks])
        self._note_buffers()

    def retrieve(self, chunks: list[int], cut: int, layers: tuple[int, int] | None) -> Callable[[], None] | None:
        """Copies as plan_copies/layer_slice make them: whole chunks carry their stamp; the first
        chunk cut by a skip (``cut`` rows) and layer parts carry none."""
        copies = []
        for n, i in enumerate(chunks):
            view = self.arena.slot(i).view(LAYERS, ROWS, ROW_BYTES)
            stamp = self.arena.stamps[i]
            first = 0
            if n == 0 and cut:
                view, stamp = view[:, cut:], 0
            if layers is not None:
                view, stamp, first = view[layers[0]:layers[1]], 0, layers[0]
            copies.append(RowCopy(self._rows(self.arena.content(view)), view, first, stamp))
        waiter = self.ctx._transfer(copies, None, write_arena=False)
        self._note_buffers()
        return waiter  # type: ignore[return-value]

    def store(self, n: int) -> Callable[[], None] | None:
        copies = []
        for i in range(n):
            view = self.out.slot(i % self.out.n).view(LAYERS, ROWS, ROW_BYTES)
            copies.append(RowCopy(self._rows(("gathered", view.data_ptr())), view))
        waiter = self.ctx._transfer(copies, None, write_arena=True)
        self._note_buffers()
        return waiter  # type: ignore[return-value]

    def warm(self) -> None:
        """A whole chunk retrieved and the device idle, as before the first prefetch the server
        asks of a context (it asks only once the context has stored and retrieved)."""
        w = self.retrieve([self.arena.n - 1], 0, None)
        assert w is not None
        w()
        self.sim.sync(self.ctx._copy.last)  # type: ignore[attr-defined]

    def store_again(self, i: int) -> None:
        """Chunk ``i`` dropped and another stored in its slot (the host writes it): DMAs from
        that slot not known to be done read torn bytes."""
        lo, hi = self.arena.slot(i).data_ptr(), self.arena.slot(i).data_ptr() + CHUNK
        for op in self.sim.ops:
            if op.write and op.content[0] == "arena" and lo <= op.content[1] < hi and op.n not in self.sim.host:
                self.sim.torn.add(op.n)
        self.arena.stamps[i] = self.arena.next_stamp
        self.arena.next_stamp += 1

    def check(self) -> None:
        """Every read of a staging buffer: its last ordered write is its bytes; none unordered."""
        ops = self.sim.ops
        for r in (op for op in ops if not op.write):
            writes = [w for w in ops if w.write and w.buf == r.buf]
            racing = [w.n for w in writes if w.n not in r.after and r.n not in w.after]
            assert not racing, f"operation {r.n} reads buffer {r.buf} unordered with writes {racing}"
            before = [w for w in writes if w.n in r.after]
            last = [w for w in before if all(o.n in w.after for o in before if o is not w)]
            assert len(last) == 1, f"operation {r.n}: no one last write into buffer {r.buf} before it"
            assert last[0].n not in self.sim.torn, f"operation {r.n} reads a DMA of a slot stored again meanwhile"
            assert last[0].content == r.content, (
                f"operation {r.n} reads buffer {r.buf}: {last[0].content}, expected {r.content}")


def _scenario(h: _Harness, rng: random.Random, steps: int) -> None:
    waiting: list[tuple[Callable[[], None], set[int]]] = []  # retrieves not waited for, their chunks
    looked_up: list[int] = []
    if rng.random() < 0.5:  # else the first transfers may be layer parts: a ring made anew, smaller first
        h.warm()

    def pinned() -> set[int]:
        return set().union(*(c for _, c in waiting)) if waiting else set()

    for _ in range(steps):
        what = rng.choice(["prefetch", "prefetch", "retrieve", "retrieve", "retrieve", "store", "wait", "again",
                           "idle", "idle", "dmas"])
        if what == "idle":  # the GPU ran everything queued (a query would say so)
            h.sim.sync(h.ctx._copy.last)  # type: ignore[attr-defined]
            h.sim.sync(h.ctx._compute.last)  # type: ignore[attr-defined]
        elif what == "dmas":  # the DMA engine is done; scatters may still run
            h.sim.sync(h.ctx._copy.last)  # type: ignore[attr-defined]
        elif what == "prefetch":
            looked_up = [rng.randrange(h.arena.n) for _ in range(rng.randint(1, 6))]
            h.prefetch(looked_up)
        elif what == "retrieve":
            chunks = [rng.randrange(h.arena.n) for _ in range(rng.randint(1, 7))]
            if looked_up and rng.random() < 0.6:  # what was looked up last, or part of it, and more
                chunks = looked_up[rng.randrange(len(looked_up)):] + chunks[:rng.randint(0, 3)]
            cut = rng.choice([0, 0, 0, 1, ROWS - 1])
            layers = rng.choice([None, None, None, (0, 1), (1, 3), (0, LAYERS)])
            if layers is None and not waiting and rng.random() < 0.5:  # a lone retrieve: the server stages
                h.prefetch(chunks[1 if cut else 0:])  # its whole chunks before planning its copies
            w = h.retrieve(chunks, cut, layers)
            if w is not None:
                waiting.append((w, set(chunks)))
        elif what == "store":
            w = h.store(rng.randint(1, 5))
            if w is not None and rng.random() < 0.5:
                w()
        elif what == "wait" and waiting:
            w, _ = waiting.pop(rng.randrange(len(waiting)))
            w()
        elif what == "again":
            free = [i for i in range(h.arena.n) if i not in pinned()]
            if free:
                h.store_again(rng.choice(free))
    for w, _ in waiting:
        w()
    h.check()


@pytest.mark.parametrize("staging_chunks", [2, 3, 5])
def test_every_scatter_reads_its_own_chunks_bytes_whatever_was_prefetched(
        monkeypatch: pytest.MonkeyPatch, staging_chunks: int) -> None:
    rng = random.Random(staging_chunks)
    hits = 0
    for _ in range(400):
        with monkeypatch.context() as mp:
            h = _Harness(mp, staging_chunks)
            _scenario(h, rng, steps=14)
            hits += h.totals.hits

    assert hits > 50  # the scatters from staging were exercised, not only the DMAs


def test_a_prefix_prefetched_is_scattered_from_staging_without_a_dma(monkeypatch: pytest.MonkeyPatch) -> None:
    """The case the prefetch is for: the retrieve of the prefetched prefix queues no DMA for
    the chunks staged, and the chunks beyond the ring are copied through the freed buffers."""
    h = _Harness(monkeypatch, 3)
    h.warm()
    warm = len(h.sim.ops)
    h.prefetch([0, 1, 2, 3, 4])
    staged = len(h.sim.ops)
    assert staged - warm == 3 and h.totals.prefetched == 3
    w = h.retrieve([0, 1, 2, 3, 4], 0, None)
    assert w is not None
    w()
    dmas = [op for op in h.sim.ops[staged:] if op.write]
    assert [op.content[3] for op in dmas] == [h.arena.stamps[3], h.arena.stamps[4]]
    assert h.totals.hits == 3
    h.check()


def test_a_prefetch_does_not_queue_behind_an_earlier_prefetch_still_running(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client can ask for prefetches as fast as it sends lookups: while the copy stream still
    runs the last one's DMAs, another is not queued (else DMAs nobody loads pile up on the copy
    engine ahead of the next retrieve); what the first staged stays usable."""
    h = _Harness(monkeypatch, 2)
    h.warm()
    warm = len(h.sim.ops)
    h.prefetch([0, 1])
    h.prefetch([2, 3])
    h.prefetch([4, 5])
    assert len(h.sim.ops) - warm == 2 and h.totals.prefetched == 2
    w = h.retrieve([0, 1], 0, None)
    assert w is not None and h.totals.hits == 2
    w()
    h.prefetch([2, 3])  # the stream is idle again
    assert h.totals.prefetched == 4
    h.check()


def test_chunks_a_prefetch_staged_are_not_copied_again_by_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server stages a lone retrieve's chunks after its lookup's prefetch staged some of
    them: those stay where they are, without a second DMA, and only the others are copied
    (into buffers no kept chunk holds); what the first staged and the second does not name is
    dropped."""
    h = _Harness(monkeypatch, 3)
    h.warm()
    h.prefetch([0, 1, 2])
    h.sim.sync(h.ctx._copy.last)  # type: ignore[attr-defined]  # the DMAs are done
    before = len(h.sim.ops)
    h.prefetch([1, 2, 3])
    dmas = [op for op in h.sim.ops[before:] if op.write]
    assert [op.content[3] for op in dmas] == [h.arena.stamps[3]]
    assert h.totals.prefetched == 4
    assert sorted(h.ctx._staged) == sorted(h.arena.stamps[i] for i in (1, 2, 3))
    assert len({v[0] for v in h.ctx._staged.values()}) == 3  # one buffer each
    w = h.retrieve([1, 2, 3], 0, None)
    assert w is not None and h.totals.hits == 3
    w()
    h.check()


def test_a_chunk_named_twice_is_staged_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A retrieve may name one hash twice: the server hands its chunk twice, and one DMA stages
    it (the retrieve can take one staged copy of a stamp only), also when it is staged already."""
    h = _Harness(monkeypatch, 3)
    h.warm()
    before = len(h.sim.ops)
    h.prefetch([0, 0, 1])
    assert [op.content[3] for op in h.sim.ops[before:] if op.write] == [h.arena.stamps[0], h.arena.stamps[1]]
    h.sim.sync(h.ctx._copy.last)  # type: ignore[attr-defined]  # the DMAs are done
    before = len(h.sim.ops)
    h.prefetch([0, 0, 2])
    assert [op.content[3] for op in h.sim.ops[before:] if op.write] == [h.arena.stamps[2]]
    assert h.totals.prefetched == 3
    w = h.retrieve([0, 0, 2], 0, None)
    assert w is not None and h.totals.hits == 2
    w()
    h.check()


def test_a_copy_cut_by_a_skip_waits_for_a_staged_buffer_instead_of_taking_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lone retrieve whose first chunk a skip cuts has its whole chunks staged in every
    buffer of the ring: the staged copies are scattered first, and the cut copy's DMA goes into
    the first of their buffers once it is free, so no staged chunk is copied twice."""
    h = _Harness(monkeypatch, 3)
    h.warm()
    h.prefetch([1, 2, 3])
    staged = len(h.sim.ops)
    w = h.retrieve([0, 1, 2, 3], 1, None)
    assert w is not None
    w()
    dmas = [op for op in h.sim.ops[staged:] if op.write]
    assert len(dmas) == 1 and h.totals.hits == 3  # the cut chunk's rows only
    h.check()


def test_a_prefetch_never_makes_the_ring_anew(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ring holds only layer parts so far: making it chunk-sized would wait for the device
    and allocate on the server's loop, so the prefetch does nothing; once a whole chunk has
    moved, it stages."""
    h = _Harness(monkeypatch, 2)
    w = h.retrieve([0, 1], 0, (0, 1))
    assert w is not None
    w()
    ring = list(h.ctx._ring)
    ops = len(h.sim.ops)
    h.prefetch([2, 3])
    assert h.ctx._ring == ring and len(h.sim.ops) == ops and h.totals.prefetched == 0
    w = h.retrieve([0], 0, None)
    assert w is not None
    w()
    h.prefetch([2, 3])
    assert h.totals.prefetched == 2
    h.check()
