"""The host row copy: ``kvxfer._rowcopy.copy_rows`` against torch's indexing, byte for byte
(rows of any length with every copy kernel this CPU runs: the streaming copy's aligned body, its
head and its tail; destinations at any alignment, padded row pitches, layer ranges, several
threads, and the calling thread alone where none can start; nonsense sizes and row ids out of
range refused before a byte moves), and :class:`kvxfer.copies.HostRows`, which checks each copy
before the C code sees its addresses. cpu_gather's conformance run covers the transports that
use it (plugins/cpu_gather/tests, plugins/hpu/tests on host tensors)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvxfer_core_helpers import run_python

from kvxfer import _rowcopy
from kvxfer.copies import HostRows, RowCopy
from kvxfer.layout import KVLayout


@pytest.fixture(params=_rowcopy._kernels())
def kernel(request: pytest.FixtureRequest) -> Iterator[str]:
    """The test runs with each kernel this CPU runs; the best one is put back after."""
    best = _rowcopy.kernel()
    _rowcopy._use_kernel(request.param)
    try:
        yield request.param
    finally:
        _rowcopy._use_kernel(best)


def _copy(to_slot: bool, slot: torch.Tensor, layers: list[torch.Tensor], rows: torch.Tensor, first: int = 0,
          threads: int = 1) -> int:
    """``layers`` as [span, pitch] uint8 views of one buffer each; ``slot`` [n, rows, row_bytes]
    uint8 (any strides, dense rows); copies layers ``first..first + n``; returns the threads that copied."""
    ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)
    span, pitch = layers[0].shape[0], layers[0].stride(0)
    return _rowcopy.copy_rows(to_slot, slot.data_ptr(), ptrs.data_ptr() + 8 * first, slot.shape[0], span, pitch,
                              slot.shape[2], slot.stride(0), slot.stride(1), rows.data_ptr(), rows.numel(), threads)


def _layers(n: int, span: int, pitch: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (span, pitch), generator=g, dtype=torch.uint8) for _ in range(n)]


#: (row bytes, destination misalignment): shorter than a vector, a vector step (16 / 64 bytes for
#: SSE2, 32 / 128 for AVX) and one byte either side of it, long rows with a tail; every
#: misalignment (none, odd, half a vector, one short of a whole) meets several lengths.
ROWS = [(1, 0), (15, 1), (16, 8), (17, 31), (63, 0), (64, 1), (65, 8), (127, 31), (128, 0), (129, 1),
        (1000, 8), (4096, 31), (32768 + 5, 0), (32768 + 5, 1)]


@pytest.mark.parametrize(("row_bytes", "misalign"), ROWS)
def test_rows_of_any_length_at_any_alignment_round_trip(row_bytes: int, misalign: int, kernel: str) -> None:
    pitch = row_bytes + 3  # padded rows: only row_bytes of each are the row's
    layers = _layers(3, 40, pitch, seed=row_bytes)
    rows = torch.tensor([7, 0, 39, 7, 12], dtype=torch.int64)
    raw = torch.zeros(3 * len(rows) * row_bytes + misalign, dtype=torch.uint8)
    slot = raw[misalign:].view(3, len(rows), row_bytes)
    _copy(True, slot, layers, rows)
    for i, layer in enumerate(layers):
        assert torch.equal(slot[i], layer[rows, :row_bytes])
    assert not raw[:misalign].any()

    back = [t.clone() for t in layers]
    for t in back:
        t[rows, :row_bytes] = 0
    _copy(False, slot, back, rows)
    for got, want in zip(back, layers):
        assert torch.equal(got, want)  # rows restored, padding and other rows untouched


def test_a_layer_range_and_a_strided_slot(kernel: str) -> None:
    layers = _layers(6, 16, 256, seed=1)
    rows = torch.tensor([3, 9, 1], dtype=torch.int64)
    wide = torch.zeros(2, 3, 300, dtype=torch.uint8)  # rows 300 bytes apart in the slot, 256 used
    slot = wide[:, :, :256]
    _copy(True, slot, layers, rows, first=4)
    for i in range(2):
        assert torch.equal(slot[i], layers[4 + i][rows])
    assert not wide[:, :, 256:].any()


@pytest.mark.parametrize(("threads", "started"), [(2, 2), (3, 3), (8, 6)])  # 24 MiB: at most 6 of 4 MiB
@pytest.mark.parametrize("fail", [False, True], ids=["threads", "no-thread-starts"])
def test_several_threads_copy_what_one_does(threads: int, started: int, fail: bool) -> None:
    layers = _layers(8, 64, 1 << 16, seed=threads)  # 8 layers x 48 rows x 64 KiB
    rows = torch.randperm(64, generator=torch.Generator().manual_seed(threads))[:48].contiguous()
    one = torch.empty(8, 48, 1 << 16, dtype=torch.uint8)
    many = torch.empty_like(one)
    assert _copy(True, one, layers, rows) == 1
    _rowcopy._fail_threads(fail)
    try:
        assert _copy(True, many, layers, rows, threads=threads) == (1 if fail else started)
        assert torch.equal(one, many)
        back = [torch.zeros_like(t) for t in layers]
        assert _copy(False, many, back, rows, threads=threads) == (1 if fail else started)
    finally:
        _rowcopy._fail_threads(False)
    for got, want in zip(back, layers):
        assert torch.equal(got[rows], want[rows])
        assert not got[[r for r in range(64) if r not in set(rows.tolist())]].any()


def test_a_scatter_that_names_a_row_twice_runs_on_one_thread_and_its_last_write_wins() -> None:
    """One layer of 128 rows of 64 KiB: 8 MiB, two threads of 4 MiB (rows 0-63, 64-127) without
    the repeat. Row 70 is named at positions 63 and 64: across that boundary the second thread
    would write it first and the first thread last, leaving position 63's bytes where the last
    write (64's) belongs, when the second thread starts at once; the thread count fails on two
    threads whatever the timing."""
    ids = list(range(128))
    ids[63] = ids[64] = 70
    ids[70] = 200  # 70 is named only at 63 and 64
    rows = torch.tensor(ids, dtype=torch.int64)
    slot = torch.randint(0, 256, (1, 128, 1 << 16), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    layer = torch.zeros(256, 1 << 16, dtype=torch.uint8)
    assert _copy(False, slot, [layer], rows, threads=4) == 1
    want = torch.zeros_like(layer)
    for i, r in enumerate(ids):  # in order: the last write of a row wins
        want[r] = slot[0, i]
    assert torch.equal(layer[70], slot[0, 64])
    assert torch.equal(layer, want)
    assert _copy(True, slot, [layer], rows, threads=4) == 2  # a gather may read a row twice
    assert _copy(False, slot, [layer], torch.arange(128, dtype=torch.int64), threads=4) == 2  # no repeats


def test_repeats_among_few_rows_of_a_large_span_are_found_too() -> None:
    """Few rows of many (span > 128 x rows) are checked through a sorted copy, not a bitmap. The
    one 64 MiB buffer stands for all 2,048 layers here, so only the thread counts are asserted."""
    rows = torch.tensor([700, 3, 65_000, 3], dtype=torch.int64)
    buf = torch.zeros(65_536, 1024, dtype=torch.uint8)
    ptrs = torch.full((2048,), buf.data_ptr(), dtype=torch.int64)
    slot = torch.zeros(2048, 4, 1024, dtype=torch.uint8)  # 8 MiB

    def scatter(ids: torch.Tensor) -> int:
        return _rowcopy.copy_rows(False, slot.data_ptr(), ptrs.data_ptr(), 2048, 65_536, 1024, 1024,
                                  slot.stride(0), slot.stride(1), ids.data_ptr(), ids.numel(), 2)

    assert scatter(rows) == 1
    assert scatter(torch.tensor([700, 3, 65_000, 4], dtype=torch.int64)) == 2


@pytest.mark.parametrize("bad", [-1, 16, 1 << 40])
def test_a_row_id_out_of_range_copies_nothing(bad: int) -> None:
    layers = _layers(2, 16, 64, seed=2)
    rows = torch.tensor([1, 2, bad, 3], dtype=torch.int64)
    slot = torch.zeros(2, 4, 64, dtype=torch.uint8)
    with pytest.raises(IndexError, match=f"row id {bad} out of range"):
        _copy(True, slot, layers, rows)
    assert not slot.any()
    before = [t.clone() for t in layers]
    with pytest.raises(IndexError):
        _copy(False, torch.ones_like(slot), layers, rows)
    assert all(torch.equal(a, b) for a, b in zip(layers, before))


def test_nonsense_sizes_are_refused() -> None:
    layers = _layers(1, 4, 64, seed=3)
    rows = torch.tensor([0], dtype=torch.int64)
    slot = torch.zeros(1, 1, 64, dtype=torch.uint8)
    ptrs = torch.tensor([layers[0].data_ptr()], dtype=torch.int64).data_ptr()
    s, r = slot.data_ptr(), rows.data_ptr()
    with pytest.raises(ValueError, match="negative sizes or strides"):
        _rowcopy.copy_rows(True, s, ptrs, 1, 4, -64, 64, 64, 64, r, 1, 1)
    with pytest.raises(ValueError, match="slot rows closer than their length"):  # slot rows 32 apart
        _rowcopy.copy_rows(True, s, ptrs, 1, 4, 64, 64, 64, 32, r, 1, 1)
    with pytest.raises(ValueError, match="no thread"):
        _rowcopy.copy_rows(True, s, ptrs, 1, 4, 64, 64, 64, 64, r, 1, 0)
    with pytest.raises(OverflowError, match="overflow"):  # layers x rows x row bytes beyond 64 bits
        _rowcopy.copy_rows(True, s, ptrs, 2**62 + 1, 4, 64, 64, 64, 64, r, 4, 1)
    assert _rowcopy.copy_rows(True, s, ptrs, 0, 4, 64, 64, 64, 64, r, 1, 1) == 0  # nothing to copy
    assert not slot.any()


def test_the_kernel_in_use_is_named_and_a_missing_one_is_refused() -> None:
    assert _rowcopy.kernel() in _rowcopy._kernels()
    assert _rowcopy._kernels()[-1] == "memcpy"
    with pytest.raises(ValueError, match="no kernel neon-stream"):
        _rowcopy._use_kernel("neon-stream")


def test_host_rows_copies_a_layout_and_refuses_what_does_not_fit() -> None:
    """HostRows over padded row views (rows 80 bytes apart, 64 used) of 4 layers."""
    buf = [torch.randint(0, 256, (16, 80), dtype=torch.uint8) for _ in range(4)]
    views = [b[:, :64] for b in buf]
    host = HostRows(views, threads=2)
    assert (host.span_rows, host.row_pitch, host.row_bytes, host.threads) == (16, 80, 64, 2)
    rows = torch.tensor([5, 0, 15], dtype=torch.int64)
    slot = torch.zeros(3, 3, 64, dtype=torch.uint8)
    host.copy([RowCopy(rows, slot, first_layer=1)], to_slot=True)
    for i in range(3):
        assert torch.equal(slot[i], views[1 + i][rows])
    good = torch.ones(4, 3, 64, dtype=torch.uint8)
    before = [b.clone() for b in buf]
    bad = {
        "rows on the meta device": RowCopy(rows.to("meta"), good),
        "a slot on the meta device": RowCopy(rows, good.to("meta")),
        "a 4-D slot with an empty last dimension": RowCopy(rows, torch.ones(4, 3, 64, 0, dtype=torch.uint8)),
        "slot rows that overlap": RowCopy(rows, torch.ones(4, 1, 64, dtype=torch.uint8).expand(4, 3, 64)),
        "layers that overlap": RowCopy(rows, torch.ones(1, 3, 64, dtype=torch.uint8).expand(4, 3, 64)),
        "layers beyond the rows'": RowCopy(rows, good, first_layer=1),
        "a negative first layer": RowCopy(rows, good[:1], first_layer=-1),
        "int32 rows": RowCopy(rows.to(torch.int32), good),
        "fewer rows than the slot's": RowCopy(rows[:2], good),
        "rows of another length": RowCopy(rows, torch.ones(4, 3, 72, dtype=torch.uint8)),
    }
    for what, copy in bad.items():
        for to_slot in (True, False):
            with pytest.raises(ValueError, match="does not fit"):
                host.copy([copy], to_slot=to_slot)
            assert torch.equal(good, torch.ones_like(good)), what
    with pytest.raises(IndexError, match="out of range"):
        host.copy([RowCopy(torch.tensor([0, 16], dtype=torch.int64), good[:, :2])], to_slot=False)
    assert all(torch.equal(a, b) for a, b in zip(buf, before))


def test_host_rows_refuses_layers_it_cannot_copy() -> None:
    a = torch.zeros(8, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="one shape and pitch"):
        HostRows([a, torch.zeros(8, 16, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="dense in the row"):
        HostRows([a.t()])
    with pytest.raises(ValueError, match="at least one thread"):
        HostRows([a], threads=0)


def test_host_rows_copy_a_layout_whose_rows_overlap_in_the_view() -> None:
    """A flash_attn cache whose K/V planes are not adjacent: its row view has rows 64 elements
    apart and 512 long (tests/core/test_layout.py::test_strided_older_kinds_work_too); a
    block's rows never overlap, and HostRows copies them as torch's indexing does."""
    nb, bs, heads, hd = 16, 16, 4, 8
    plane = nb * bs * heads * hd + 64
    buf = torch.randn(2 * plane, dtype=torch.float32)
    layers = [buf.as_strided((2, nb, bs, heads, hd), (plane, bs * heads * hd, heads * hd, hd, 1))]
    lay = KVLayout.infer(layers, bs)
    assert lay.row_pitch < lay.row_elems
    view = lay.row_view(layers[0])
    rows = lay.rows(torch.tensor([3, 9, 0]))
    host = HostRows([view], threads=1)
    slot = torch.zeros(1, rows.numel(), lay.row_elems, dtype=torch.float32)
    host.copy([RowCopy(rows, slot)], to_slot=True)
    assert torch.equal(slot[0], view[rows])
    before = buf.clone()
    view[rows] = 0
    host.copy([RowCopy(rows, slot)], to_slot=False)
    assert torch.equal(buf, before)


def test_host_rows_without_its_c_extension_says_how_to_build_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A source tree whose C extension was never built (no compiler, or kvxfer run from a plain
    checkout): the first host copy's context says what to do, not just that a name is missing."""
    import sys

    import kvxfer

    monkeypatch.setitem(sys.modules, "kvxfer._rowcopy", None)  # as if the .so were absent
    monkeypatch.delattr(kvxfer, "_rowcopy", raising=False)
    with pytest.raises(ImportError, match=r"C row copy .* is not built .*pip install \."):
        HostRows([torch.zeros(4, 8, dtype=torch.uint8)])


_FREED = """
import torch
from kvxfer.copies import HostRows, RowCopy
from kvxfer.errors import ConfigError

layers = [torch.zeros(64, 256, dtype=torch.bfloat16) for _ in range(2)]
host = HostRows(layers)
slot = torch.ones(2, 4, 256, dtype=torch.bfloat16)
rows = torch.arange(4, dtype=torch.int64)
host.copy([RowCopy(rows, slot)], to_slot=False)  # registered memory: copied
assert int(layers[0][:4].sum()) == 4 * 256
{change}
filler = [torch.full((64, 256), 7, dtype=torch.bfloat16) for _ in range(8)]  # may take the freed memory
try:
    host.copy([RowCopy(rows, slot)], to_slot=False)
except ConfigError as exc:
    assert "freed or moved after it was registered" in str(exc), exc
    print("refused")
else:
    print("copied")
"""


@pytest.mark.parametrize("change", ["layers[0].untyped_storage().resize_(0)",
                                    "layers[1].resize_(128, 256)"], ids=["freed", "moved"])
def test_layers_freed_or_moved_after_registration_are_refused(change: str, tmp_path) -> None:
    """A KV cache freed or grown after registration (its storage ``resize_``d): the copy is
    refused with a ConfigError before the C code writes into memory that is not the cache's any
    more (before, a retrieve wrote into freed memory, and a new tensor there made it segfault).
    In a child process: a copy through a stale address could crash it."""
    done = run_python(_FREED.replace("{change}", change), cwd=tmp_path, timeout=60)
    assert done.returncode == 0, f"the child died ({done.returncode}): {done.stderr[-2000:]}"
    assert done.stdout.split() == ["refused"]
