"""KVLayout: inference from tensors (strides included), errors that name the layer and shape,
the row view, the chunk format. vLLM's own views are tested in tests/integrations/test_vllm_layouts.py."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvxfer import KVLayout, LayoutKind
from kvxfer.copies import SlotViews, check_transfer, plan_copies
from kvxfer.errors import ConfigError, LayoutError
from kvxfer.layout import copy_dtype, copy_view

L, NB, BS, HEADS, HD, LAT = 3, 10, 16, 4, 8, 72


def layers(shape: tuple[int, ...], n: int = L, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(*shape, generator=g).to(dtype) for _ in range(n)]


def bhnc(order: str, nb: int = NB, heads: int = 2, tokens: int = BS, content: int = 16, n: int = L,
         pad: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``n`` layers ``[nb, heads, tokens, content]`` whose memory order is ``order``, a permutation
    of ``"LBHNC"`` (as vLLM's KVCacheLayout names them), over one buffer filled with 0, 1, 2, ...
    ``pad`` elements follow each page when L and B are the two outermost axes."""
    sizes = {"L": n, "B": nb, "H": heads, "N": tokens, "C": content}
    strides, step = {}, 1
    for i, axis in enumerate(reversed(order)):
        strides[axis] = step
        step *= sizes[axis]
        if pad and i == 2:  # after the page [H, N, C]
            assert set(order[:2]) == {"L", "B"}
            step += pad
    buf = torch.arange(step, dtype=torch.float32)
    views = [buf.as_strided([nb, heads, tokens, content], [strides[a] for a in "BHNC"], li * strides["L"])
             for li in range(n)]
    return buf, views


def page_elems(t: torch.Tensor, b: int) -> torch.Tensor:
    return t[b].reshape(-1).sort().values


def check_rows_cover_pages(lay: KVLayout, views: list[torch.Tensor]) -> None:
    """Each block's rows hold exactly that block's page elements (values are unique)."""
    for t in views:
        rv = lay.row_view(t)
        for b in range(t.shape[0] // (lay.block_size // t.shape[-2])):
            got = rv[lay.rows(torch.tensor([b]))].reshape(-1).sort().values
            if lay.block_size == t.shape[-2]:
                want = page_elems(t, b)
            else:  # kernel blocks
                r = lay.block_size // t.shape[-2]
                want = t[b * r:(b + 1) * r].reshape(-1).sort().values
            assert torch.equal(got, want), f"block {b}"


@pytest.mark.parametrize(("shape", "kind", "num_blocks", "hidden", "runs"), [
    ((2, NB, BS, HEADS, HD), LayoutKind.FLASH_ATTN, NB, HEADS * HD, 2),
    ((NB, 2, BS, HEADS, HD), LayoutKind.FLASHINFER, NB, HEADS * HD, 2),
    ((NB, BS, LAT), LayoutKind.MLA, NB, LAT, 1),
    ((NB, HEADS, BS, 2 * HD), LayoutKind.BHNC, NB, HEADS * 2 * HD, 1),
])
def test_inference(shape, kind, num_blocks, hidden, runs) -> None:
    lay = KVLayout.infer(layers(shape), BS)
    assert (lay.kind, lay.num_layers, lay.num_blocks, lay.block_size, lay.hidden_dim_size, lay.dtype) == \
        (kind, L, num_blocks, BS, hidden, torch.bfloat16)
    assert lay.use_mla == (kind is LayoutKind.MLA) and lay.runs == runs
    if kind is not LayoutKind.BHNC:  # the older kinds: the same as the scalar constructor's
        assert lay == KVLayout(kind, L, num_blocks, BS, hidden, torch.bfloat16)
        assert lay.layer_shape(HEADS if not lay.use_mla else None) == shape


def test_a_dict_of_layers_keeps_its_order() -> None:
    ts = layers((2, NB, BS, HEADS, HD))
    assert KVLayout.infer({f"layer.{i}": t for i, t in enumerate(ts)}, BS).num_layers == L


def test_ambiguous_shape_needs_an_explicit_kind() -> None:
    ts = layers((2, 2, BS, HEADS, HD))  # flash_attn with 2 blocks, or flashinfer with 2 blocks
    assert KVLayout.infer(ts, BS).kind is LayoutKind.FLASH_ATTN
    fi = KVLayout.infer(ts, BS, kind="flashinfer")
    assert fi.kind is LayoutKind.FLASHINFER and fi.num_blocks == 2
    assert torch.equal(fi.rows(torch.tensor([1])), torch.tensor([2, 3]))


@pytest.mark.parametrize("order", ["".join(p) for p in itertools.permutations("LBHNC") if p[-1] == "C"])
def test_every_memory_order_is_a_row_view(order) -> None:
    _, views = bhnc(order)
    lay = KVLayout.infer(views, BS)
    check_rows_cover_pages(lay, views)


@pytest.mark.parametrize(("order", "runs", "page"), [
    ("LBHNC", 1, "|H2,N16,C16"), ("LBNHC", 1, "|N16,C32"), ("LHBNC", 2, "H2|N16,C16"),
    ("BLHNC", 1, "|H2,N16,C16"), ("BLNHC", 1, "|N16,C32"), ("BHLNC", 2, "H2|N16,C16"),
])
def test_vllm_orders(order, runs, page) -> None:
    _, views = bhnc(order)
    lay = KVLayout.infer(views, BS)
    assert (lay.runs, lay.page, lay.row_elems) == (runs, page, 2 * BS * 16 // runs)
    check_rows_cover_pages(lay, views)


def test_chunk_format_names_the_page_order() -> None:
    fmt = {o: KVLayout.infer(bhnc(o)[1], BS).chunk_format(2 * BS) for o in ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BHLNC")}
    assert fmt["LBHNC"] == fmt["BLHNC"]  # pages alike, placed differently: interchangeable chunks
    assert fmt["LHBNC"] == fmt["BHLNC"]
    assert len({fmt["LBHNC"], fmt["LBNHC"], fmt["LHBNC"]}) == 3


def test_padded_pages_have_a_pitch() -> None:
    _, views = bhnc("LBHNC", pad=40)
    lay = KVLayout.infer(views, BS)
    assert lay.row_elems == 2 * BS * 16 and lay.row_pitch == 2 * BS * 16 + 40 and lay.runs == 1
    check_rows_cover_pages(lay, views)


def test_kernel_blocks_make_one_block() -> None:
    _, views = bhnc("LBHNC", nb=2 * NB, tokens=BS // 2)  # vLLM's kernel_block_size = BS / 2
    lay = KVLayout.infer(views, BS)
    assert lay.num_blocks == NB and lay.page == "|S2,H2,N8,C16"
    check_rows_cover_pages(lay, views)
    _, views = bhnc("LHBNC", nb=2 * NB, tokens=BS // 2)  # kernel blocks end to end: one run per head
    lay = KVLayout.infer(views, BS)
    assert lay.num_blocks == NB and lay.page == "H2|N16,C16"
    assert lay.chunk_format(2 * BS) == KVLayout.infer(bhnc("LHBNC")[1], BS).chunk_format(2 * BS)
    check_rows_cover_pages(lay, views)


def test_rows_write_through_to_the_tensor() -> None:
    buf, views = bhnc("BHLNC")
    lay = KVLayout.infer(views, BS)
    lay.row_view(views[1])[lay.rows(torch.tensor([4]))] = -1
    assert (views[1][4] == -1).all() and int((buf == -1).sum()) == views[1][4].numel()


@pytest.mark.parametrize(("ts", "block_size", "kind", "needle"), [
    (layers((3, NB, BS, HEADS, HD)), BS, None, "[3, 10, 16, 4, 8]"),
    (layers((2, NB, BS, HEADS, HD)), 32, None, "block_size=32"),
    (layers((NB, BS, LAT)), BS, "flash_attn", "[10, 16, 72] with strides [1152, 72, 1] (flash_attn"),
    (layers((2, NB, BS, HEADS, HD)), BS, "mla", "has 3 dimensions"),
    (layers((NB, BS, LAT, 1, 1, 1)), BS, None, "[10, 16, 72, 1, 1, 1]"),
    (layers((NB, 2, BS + 1, 8)), BS, None, "(17) does not divide block_size=16"),
    ([torch.zeros(NB, 2, BS, 64).transpose(0, 3)], BS, None, "last dimension must be dense"),
    ([torch.zeros(512).as_strided((NB, 2, BS, 2), (4, 2, 2, 1))], BS, None, "pages overlap"),
    ([torch.zeros(64).expand(NB, 2, BS, 64)], BS, None, "strides must be positive"),
])
def test_errors_name_the_shape(ts, block_size, kind, needle) -> None:
    with pytest.raises(LayoutError) as info:
        KVLayout.infer(ts, block_size, kind)
    assert needle in str(info.value)


def test_errors_name_the_layer() -> None:
    ts = layers((2, NB, BS, HEADS, HD))
    with pytest.raises(LayoutError, match="layer 2 is"):
        KVLayout.infer(ts[:2] + [torch.zeros(2, NB + 1, BS, HEADS, HD, dtype=torch.bfloat16)], BS)
    with pytest.raises(LayoutError, match=r"layer 1 is \[2, 10, 16, 4, 8\] with strides \[5120, 512, 32, 1, 4\]"):
        KVLayout.infer([ts[0], torch.zeros(2, NB, BS, HD, HEADS, dtype=torch.bfloat16).transpose(3, 4)], BS)
    with pytest.raises(LayoutError, match="empty"):
        KVLayout.infer([], BS)
    with pytest.raises(LayoutError, match="unsupported KV cache dtype"):
        KVLayout.infer([torch.zeros(2, NB, BS, HEADS, HD, dtype=torch.complex64)], BS)
    with pytest.raises(LayoutError, match="block_size"):
        KVLayout.infer(ts, 0)


def test_strided_older_kinds_work_too() -> None:
    """A flash_attn cache whose planes are not adjacent (each K/V plane its own allocation
    region): the row view follows the strides."""
    buf = torch.arange(2 * (NB * BS * HEADS * HD + 64), dtype=torch.float32)
    t = buf.as_strided((2, NB, BS, HEADS, HD), (NB * BS * HEADS * HD + 64, BS * HEADS * HD, HEADS * HD, HD, 1))
    lay = KVLayout.infer([t], BS)
    # rows 64 elements apart (the gcd of the block and plane strides): they overlap in the view
    assert (lay.runs, lay.row_elems, lay.row_pitch, lay.run_offsets, lay.block_stride) == (2, 512, 64, (0, 81), 8)
    rows = lay.rows(torch.tensor([3]))
    rv = lay.row_view(t)
    assert torch.equal(rv[rows[0]], t[0, 3].reshape(-1)) and torch.equal(rv[rows[1]], t[1, 3].reshape(-1))


def test_chunk_rows_view_is_the_arena_format() -> None:
    _, views = bhnc("LHBNC")
    lay = KVLayout.infer(views, BS)
    chunk = 2 * BS
    slot = torch.zeros(lay.chunk_bytes(chunk), dtype=torch.uint8)
    view = lay.chunk_rows_view(slot, chunk)
    blocks = [4, 1]
    for layer, t in enumerate(views):
        view[layer] = lay.row_view(t)[lay.rows(torch.tensor(blocks))]
    arena = slot.view(lay.dtype).view(lay.chunk_shape(chunk))  # [layers, runs, blocks, row]
    for layer, t in enumerate(views):
        for r in range(lay.runs):  # run r is head r: [tokens, content] of each block
            for i, b in enumerate(blocks):
                assert torch.equal(arena[layer, r, i], t[b, r].reshape(-1))


def test_chunk_format_and_sizes() -> None:
    fa = KVLayout(LayoutKind.FLASH_ATTN, 32, 100, 16, 1024, torch.bfloat16)
    fi = KVLayout(LayoutKind.FLASHINFER, 32, 7, 16, 1024, torch.bfloat16)
    assert fa.chunk_shape(256) == (32, 2, 16, 16 * 1024)
    assert fa.chunk_bytes(256) == 32 * 2 * 256 * 1024 * 2 == 32 << 20
    # block counts and engine layout differ, chunks are interchangeable
    assert fa.chunk_format(256) == fi.chunk_format(256) == "bfloat16:32x2x16x16384:P2|N16,D1024"
    assert KVLayout.infer(layers((2, 4, 16, 8, 128), n=32), 16).chunk_format(256) == fa.chunk_format(256)
    assert KVLayout(LayoutKind.FLASH_ATTN, 32, 100, 32, 1024, torch.bfloat16).chunk_format(256) != \
        fa.chunk_format(256)
    assert KVLayout(LayoutKind.FLASH_ATTN, 32, 100, 16, 1024, torch.float16).chunk_format(256) != \
        fa.chunk_format(256)
    mla = KVLayout(LayoutKind.MLA, 61, 100, 64, 576, torch.bfloat16)
    assert mla.chunk_format(256) == "bfloat16:61x1x4x36864:|N64,C576"
    # a 4-D MLA view of vLLM (one head) holds the same bytes as the older 3-D one
    assert KVLayout.infer(layers((100, 1, 64, 576), n=61), 64).chunk_format(256) == mla.chunk_format(256)
    with pytest.raises(LayoutError, match="not a positive multiple of block_size 16"):
        fa.chunk_format(100)
    with pytest.raises(LayoutError, match="num_layers"):
        KVLayout(LayoutKind.MLA, 0, 1, 1, 1, torch.bfloat16)


@pytest.mark.parametrize(("fields", "needle"), [
    ({}, "needs its geometry"),
    ({"row_elems": 512, "row_pitch": 512, "run_offsets": (0,), "block_stride": 1, "page": "H2,N16,C16"},
     "page must be"),
    ({"row_elems": 512, "row_pitch": 512, "run_offsets": (0,), "block_stride": 1, "page": "|H2,N16,C8"},
     "describes 1 runs of 256"),
    ({"row_elems": 512, "row_pitch": 512, "run_offsets": (0, 0), "block_stride": 1, "page": "H2|N16,C16"},
     "distinct"),
    ({"row_elems": 512, "row_pitch": 0, "run_offsets": (0,), "block_stride": 1, "page": "|H2,N16,C16"},
     "row_pitch must be a positive integer"),
    ({"row_elems": 512, "row_pitch": 512, "run_offsets": (0,), "block_stride": 1, "page": "|H2,N16,c16"},
     "axis letter and a size"),
    # memory shared by two runs: the server-driven copies of such a registration would overlap
    ({"row_elems": 512, "row_pitch": 100, "run_offsets": (0,), "block_stride": 1, "page": "|H2,N16,C16"},
     "consecutive blocks would overlap"),
    ({"row_elems": 256, "row_pitch": 256, "run_offsets": (0, 1), "block_stride": 1, "page": "H2|N16,C16"},
     "make two runs share memory"),
    ({"row_elems": 256, "row_pitch": 256, "run_offsets": (0, 9), "block_stride": 1, "page": "H2|N16,C16"},
     "make two runs share memory"),  # head 1 of block 0 is head 0 of block 9
    ({"row_elems": 256, "row_pitch": 256, "run_offsets": (0, 4), "block_stride": 2, "page": "H2|N16,C16"},
     "make two runs share memory"),  # row 4: run 1 of block 0 and run 0 of block 2
    ({"row_elems": 256, "row_pitch": 64, "run_offsets": (0, 2), "block_stride": 8, "page": "H2|N16,C16"},
     "make two runs share memory"),  # rows 4 apart make a run; 0 and 2 are 2 apart
    ({"row_elems": 256, "row_pitch": 64, "run_offsets": (1, 6), "block_stride": 8, "page": "H2|N16,C16"},
     "make two runs share memory"),  # row 6 of block b runs into row 1 of block b + 1 (9)
])
def test_geometry_is_validated(fields, needle) -> None:
    with pytest.raises(LayoutError, match=needle):
        KVLayout(LayoutKind.BHNC, 2, 10, 16, 32, torch.float16, **fields)


def test_runs_of_a_one_block_cache_may_not_overlap_whatever_its_stride() -> None:
    """One block: the stride names no memory, and a stride below a run once hid two runs two
    rows apart in rows 512 elements long."""
    one = {"row_elems": 256, "row_pitch": 1, "page": "H2|N16,C16"}
    with pytest.raises(LayoutError, match="make two runs share memory"):
        KVLayout(LayoutKind.BHNC, 2, 1, 16, 32, torch.float16, run_offsets=(0, 2), block_stride=1, **one)
    KVLayout(LayoutKind.BHNC, 2, 1, 16, 32, torch.float16, run_offsets=(0, 256), block_stride=1, **one)


@pytest.mark.parametrize(("kind", "shape", "stride"), [
    ("mla", [1, 4, 3], [3, 9, 1]),          # one block whose stride is less than its page
    ("bhnc", [1, 3, 4, 4], [4, 16, 4, 1]),
])
def test_a_one_block_cache_with_any_block_stride_is_inferred(kind: str, shape: list[int], stride: list[int]) -> None:
    """A cache of one block: its block stride names no memory and may be anything, even less
    than one page (it was taken for a row stride of 0 and refused). Its rows are exactly its
    elements."""
    base = torch.arange(256, dtype=torch.float32).to(torch.bfloat16)
    t = base.as_strided(shape, stride)
    lay = KVLayout.infer([t], shape[-2] if kind == "mla" else shape[2], kind)
    got = lay.row_view(t)[lay.rows(torch.tensor([0]))]
    assert sorted(got.flatten().tolist()) == sorted(t.flatten().tolist())
    assert got.numel() == t.numel()


@pytest.mark.parametrize("fields", [
    {"row_elems": 256, "row_pitch": 256, "run_offsets": (0, 10), "block_stride": 1, "page": "H2|N16,C16"},  # heads out
    {"row_elems": 256, "row_pitch": 256, "run_offsets": (0, 1), "block_stride": 2, "page": "H2|N16,C16"},  # blocks out
    {"row_elems": 256, "row_pitch": 300, "run_offsets": (1, 0), "block_stride": 3, "page": "H2|N16,C16"},  # padded
    {"row_elems": 256, "row_pitch": 64, "run_offsets": (0, 4), "block_stride": 8, "page": "H2|N16,C16"},  # 4 rows a run
    {"row_elems": 256, "row_pitch": 64, "run_offsets": (2, 80), "block_stride": 8, "page": "H2|N16,C16"},  # planes
])
def test_geometry_of_disjoint_runs_is_accepted(fields) -> None:
    KVLayout(LayoutKind.BHNC, 2, 10, 16, 32, torch.float16, **fields)


def test_check_tensors() -> None:
    ts = layers((2, NB, BS, HEADS, HD))
    lay = KVLayout.infer(ts, BS)
    lay.check_tensors(ts)
    with pytest.raises(LayoutError, match="expected 3 layers, got 2"):
        lay.check_tensors(ts[:2])
    with pytest.raises(LayoutError, match="registration says"):
        lay.check_tensors([t.to(torch.float16) for t in ts])
    _, views = bhnc("LBHNC")
    with pytest.raises(LayoutError, match="registration says"):
        KVLayout.infer(views, BS).check_tensors(bhnc("LBNHC")[1])


def test_copy_dtype_fits_every_tensor() -> None:
    dense = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert copy_dtype([dense]) is torch.complex128 and copy_view(dense).shape == (4, 8)
    rows_12_bytes_apart = torch.zeros(64, dtype=torch.bfloat16).as_strided((4, 4), (6, 1))
    assert copy_dtype([dense, rows_12_bytes_apart]) is torch.int32
    at_odd_offset = torch.zeros(64, dtype=torch.bfloat16)[1:].view(7, 9)[:, :8]
    assert copy_dtype([at_odd_offset]) is torch.int16
    assert copy_view(dense, torch.int32).shape == (4, 32)


def _slot_views(lay: KVLayout, chunk: int, n: int) -> tuple[torch.Tensor, SlotViews]:
    size = lay.chunk_bytes(chunk)
    arena = torch.zeros(n * size, dtype=torch.uint8)
    return arena, SlotViews(lambda offset, nbytes: arena[offset:offset + nbytes], lay, chunk)


@pytest.mark.parametrize("shape", [(2, NB, BS, HEADS, HD), (NB, 2, BS, HEADS, HD)], ids=["flash_attn", "flashinfer"])
def test_planned_copies_are_the_arena_format(shape) -> None:
    """plan_copies' slot views are chunk_rows_view's, and its rows those of each chunk's blocks
    (partial skips give one copy per run), for blocks one row apart and two (flashinfer's K and V)."""
    lay = KVLayout.infer(layers(shape), BS)
    chunk = 2 * BS
    size = lay.chunk_bytes(chunk)
    arena, views = _slot_views(lay, chunk, 3)
    blocks = check_transfer(lay, chunk, 3, [4, 1, 7, 0, 9, 2])
    copies = plan_copies(lay, chunk, blocks, [(i, views.rows(i * size)) for i in (0, 2)])
    assert [c.rows.tolist() for c in copies] == [lay.rows(torch.tensor(b)).tolist() for b in ([4, 1], [9, 2])]
    for i, c in zip((0, 2), copies):
        want = lay.chunk_rows_view(arena[i * size:(i + 1) * size], chunk)
        assert (c.slot.shape, c.slot.dtype, c.slot.data_ptr()) == (want.shape, want.dtype, want.data_ptr())
    skipped = plan_copies(lay, chunk, blocks, [(i, views.rows(i * size)) for i in (0, 2)], skip_blocks=5)
    assert len(skipped) == lay.runs and all(c.rows.numel() == 1 for c in skipped)  # chunk 2's second block only
    assert [c.rows.tolist() for c in skipped] == [[r] for r in lay.rows(torch.tensor([2])).tolist()]


def test_slot_views_are_made_once_and_forgotten_past_their_limit() -> None:
    """SlotViews gives the same views of a slot each time (bytes and rows over the same memory),
    makes them again after clear(), and past ``limit`` slots forgets the oldest one."""
    lay = KVLayout.infer(layers((2, NB, BS, HEADS, HD)), BS)
    chunk = 2 * BS
    size = lay.chunk_bytes(chunk)
    arena, views = _slot_views(lay, chunk, 4)
    views.limit = 2
    raw, rows = views.bytes(size), views.rows(size)
    assert views.bytes(size) is raw and views.rows(size) is rows
    assert raw.dtype == torch.uint8 and raw.numel() == size and raw.data_ptr() == arena[size:].data_ptr()
    assert rows.data_ptr() == raw.data_ptr() and rows.shape == lay.chunk_rows_view(raw, chunk).shape
    second = views.rows(2 * size)
    assert views.rows(size) is rows  # two held: within the limit
    views.rows(3 * size)  # a third: the oldest (slot 1) is forgotten, slot 2 kept
    assert views.rows(2 * size) is second
    again = views.rows(size)
    assert again is not rows and again.data_ptr() == rows.data_ptr()
    views.clear()
    assert views.bytes(size) is not raw


def test_slot_views_sharing_a_table_share_one_bound_and_keep_formats_apart() -> None:
    """SlotViews given one table (a server's contexts) reuse each other's views of a chunk
    format (flash_attn's and flashinfer's chunks are alike), keep another format's views of the
    same offset apart (another dtype), and count against one limit."""
    fa = KVLayout.infer(layers((2, NB, BS, HEADS, HD)), BS)
    fi = KVLayout.infer(layers((NB, 2, BS, HEADS, HD)), BS)
    half = KVLayout.infer(layers((2, NB, BS, HEADS, HD), dtype=torch.float16), BS)
    chunk = 2 * BS
    assert fa.chunk_format(chunk) == fi.chunk_format(chunk) != half.chunk_format(chunk)
    arena = torch.zeros(4 * fa.chunk_bytes(chunk), dtype=torch.uint8)

    def view(offset: int, nbytes: int) -> torch.Tensor:
        return arena[offset:offset + nbytes]

    table: dict = {}
    a, b, other = (SlotViews(view, fa, chunk, table, limit=3), SlotViews(view, fi, chunk, table, limit=3),
                   SlotViews(view, half, chunk, table, limit=3))
    assert b.rows(0) is a.rows(0)  # one format: one view, made once
    assert other.rows(0) is not a.rows(0) and other.rows(0).dtype == torch.float16
    assert len(table) == 2
    b.rows(4096)  # the third slot of the table
    assert len(table) == 3
    other.rows(8192)  # one more for any of them: the oldest of all goes
    assert len(table) == 3 and (0, a._fmt) not in table and b.rows(4096) is a.rows(4096)


def test_plan_copies_refuses_a_slot_that_is_not_shaped() -> None:
    lay = KVLayout.infer(layers((2, NB, BS, HEADS, HD)), BS)
    blocks = check_transfer(lay, 2 * BS, 1, [4, 1])
    with pytest.raises(TypeError, match=r"\[num_layers, rows, row_elems\]"):
        plan_copies(lay, 2 * BS, blocks, [(0, torch.zeros(lay.chunk_bytes(2 * BS), dtype=torch.uint8))])


def test_only_a_whole_chunks_copy_carries_its_stamp() -> None:
    """RowCopy.stamp (what a prefetch is matched by) is given to the copy that moves a whole
    chunk, its slot's own, whatever the skip dropped before it; a chunk cut by the skip and
    any layer slice carry none (they move part of a chunk)."""
    from kvxfer.copies import layer_slice

    lay = KVLayout.infer(layers((2, NB, BS, HEADS, HD)), BS)
    chunk = 2 * BS
    size = lay.chunk_bytes(chunk)
    arena, views = _slot_views(lay, chunk, 3)
    blocks = check_transfer(lay, chunk, 3, [4, 1, 7, 0, 9, 2])
    slots = [(i, views.rows(i * size)) for i in range(3)]
    whole = plan_copies(lay, chunk, blocks, slots, stamps=[11, 12, 13])
    assert [c.stamp for c in whole] == [11, 12, 13]
    for i, c in enumerate(whole):  # the whole slot, as the prefetch was given it
        assert c.slot.is_contiguous() and c.slot.data_ptr() == views.bytes(i * size).data_ptr()
        assert c.slot.numel() * c.slot.element_size() == size
    cut = plan_copies(lay, chunk, blocks, slots, skip_blocks=3, stamps=[11, 12, 13])
    assert [c.stamp for c in cut] == [0] * lay.runs + [13]  # chunk 0 skipped, chunk 1 cut
    assert all(c.stamp == 0 for c in layer_slice(whole, 0, 1))
    assert all(c.stamp == 0 for c in plan_copies(lay, chunk, blocks, slots))  # none given


@pytest.mark.parametrize(("ids", "needle"), [
    ([1.5, 2], "sequence of integers"),  # never truncated to a block id
    (torch.tensor([1.0, 2.0]), "sequence of integers"),
    ([[1], [2]], "sequence of integers"),
    ([2**70, 1], "sequence of integers"),
    (["1", 2], "sequence of integers"),
    ([1, NB], r"must be in \[0, 10\); got min 1, max 10"),
    ((-1, 2), r"got min -1, max 2"),
    (torch.tensor([3, -2]), r"got min -2, max 3"),
    (torch.tensor([1, 2**63 + 5], dtype=torch.uint64), rf"got max {2**63 + 5}$"),  # named, not wrapped
    ([1, 2, 3], "^1 chunks of 32 tokens need 2 block ids"),  # the count, not taken for a type error
    (torch.tensor([1, 2, 3]), "^1 chunks of 32 tokens need 2 block ids"),
])
def test_check_transfer_refuses_what_is_not_a_block_id(ids, needle) -> None:
    lay = KVLayout.infer(layers((2, NB, BS, HEADS, HD)), BS)
    with pytest.raises(ConfigError, match=needle):
        check_transfer(lay, 2 * BS, 1, ids)


@pytest.mark.parametrize("ids", [[3, 1], (3, 1), range(3, 0, -2), torch.tensor([3, 1]), torch.tensor([[3], [1]])])
def test_check_transfer_takes_any_sequence_of_integers(ids) -> None:
    lay = KVLayout.infer(layers((2, NB, BS, HEADS, HD)), BS)
    got = check_transfer(lay, 2 * BS, 1, ids)
    assert got.dtype == torch.int64 and got.tolist() == [3, 1]
