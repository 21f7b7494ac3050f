"""KVLayout: inference from tensors, errors that name the shape, row mapping, chunk format."""

from __future__ import annotations

import pytest
import torch

from kvxfer import KVLayout, LayoutKind
from kvxfer.errors import LayoutError

L, NB, BS, HEADS, HD, LAT = 3, 10, 16, 4, 8, 72


def layers(shape: tuple[int, ...], n: int = L, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(*shape, generator=g).to(dtype) for _ in range(n)]


@pytest.mark.parametrize(("shape", "kind", "num_blocks", "hidden"), [
    ((2, NB, BS, HEADS, HD), LayoutKind.FLASH_ATTN, NB, HEADS * HD),
    ((NB, 2, BS, HEADS, HD), LayoutKind.FLASHINFER, NB, HEADS * HD),
    ((NB, BS, LAT), LayoutKind.MLA, NB, LAT),
])
def test_inference(shape, kind, num_blocks, hidden) -> None:
    lay = KVLayout.infer(layers(shape), BS)
    assert (lay.kind, lay.num_layers, lay.num_blocks, lay.block_size, lay.hidden_dim_size, lay.dtype) == \
        (kind, L, num_blocks, BS, hidden, torch.bfloat16)
    assert lay.use_mla == (kind is LayoutKind.MLA) and lay.planes == (1 if lay.use_mla else 2)
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


@pytest.mark.parametrize(("ts", "block_size", "kind", "needle"), [
    (layers((3, NB, BS, HEADS, HD)), BS, None, "[3, 10, 16, 4, 8]"),
    (layers((2, NB, BS, HEADS, HD)), 32, None, "block_size=32"),
    (layers((NB, BS, LAT)), BS, "flash_attn", "[10, 16, 72] do not match layout flash_attn"),
    (layers((2, NB, BS, HEADS, HD)), BS, "mla", "[2, 10, 16, 4, 8] do not match layout mla"),
    (layers((NB, BS, LAT, 1, 1, 1)), BS, None, "[10, 16, 72, 1, 1, 1]"),
])
def test_errors_name_the_shape(ts, block_size, kind, needle) -> None:
    with pytest.raises(LayoutError) as info:
        KVLayout.infer(ts, block_size, kind)
    assert needle in str(info.value)


def test_errors_name_the_layer() -> None:
    ts = layers((2, NB, BS, HEADS, HD))
    with pytest.raises(LayoutError, match="layer 2 is"):
        KVLayout.infer(ts[:2] + [torch.zeros(2, NB + 1, BS, HEADS, HD, dtype=torch.bfloat16)], BS)
    with pytest.raises(LayoutError, match="layer 1 is not contiguous"):
        KVLayout.infer([ts[0], torch.zeros(2, NB, BS, HD, HEADS, dtype=torch.bfloat16).transpose(3, 4)], BS)
    with pytest.raises(LayoutError, match="empty"):
        KVLayout.infer([], BS)
    with pytest.raises(LayoutError, match="unsupported KV cache dtype"):
        KVLayout.infer([torch.zeros(2, NB, BS, HEADS, HD, dtype=torch.complex64)], BS)
    with pytest.raises(LayoutError, match="block_size"):
        KVLayout.infer(ts, 0)


def reference_chunk(kind: LayoutKind, layer: torch.Tensor, blocks: list[int]) -> torch.Tensor:
    """``[planes, len(blocks) * BS, hidden]`` by plain indexing, plane by plane, block by block."""
    if kind is LayoutKind.FLASH_ATTN:
        planes = [torch.cat([layer[p, b] for b in blocks]) for p in range(2)]
    elif kind is LayoutKind.FLASHINFER:
        planes = [torch.cat([layer[b, p] for b in blocks]) for p in range(2)]
    else:
        planes = [torch.cat([layer[b] for b in blocks])]
    return torch.stack([p.reshape(len(blocks) * BS, -1) for p in planes])


@pytest.mark.parametrize("shape", [(2, NB, BS, HEADS, HD), (NB, 2, BS, HEADS, HD), (NB, BS, LAT)])
def test_rows_match_direct_slicing(shape) -> None:
    ts = layers(shape)
    lay = KVLayout.infer(ts, BS)
    blocks = [7, 0, 3, 9]
    rows = lay.rows(torch.tensor(blocks))
    assert rows.dtype == torch.int64 and rows.numel() == lay.planes * len(blocks)
    for t in ts:
        got = lay.row_view(t)[rows]  # [planes * n, row_elems]
        want = reference_chunk(lay.kind, t, blocks)
        assert torch.equal(got.view(lay.planes, len(blocks) * BS, -1), want)
    # the row view is a view: writing through it writes the engine's tensor
    lay.row_view(ts[0])[rows[0]] = 0  # plane 0 (K) of block 7
    assert not reference_chunk(lay.kind, ts[0], [7])[0].any()
    assert reference_chunk(lay.kind, ts[0], [0])[0].any()


@pytest.mark.parametrize("shape", [(2, NB, BS, HEADS, HD), (NB, 2, BS, HEADS, HD), (NB, BS, LAT)])
def test_chunk_rows_view_is_the_arena_format(shape) -> None:
    ts = layers(shape)
    lay = KVLayout.infer(ts, BS)
    chunk = 2 * BS
    slot = torch.zeros(lay.chunk_bytes(chunk), dtype=torch.uint8)
    view = lay.chunk_rows_view(slot, chunk)
    blocks = [4, 1]
    for layer, t in enumerate(ts):
        view[layer] = lay.row_view(t)[lay.rows(torch.tensor(blocks))]
    arena = slot.view(lay.dtype).view(lay.chunk_shape(chunk))  # [layers, planes, tokens, hidden]
    for layer, t in enumerate(ts):
        assert torch.equal(arena[layer], reference_chunk(lay.kind, t, blocks))


def test_chunk_format_and_sizes() -> None:
    fa = KVLayout(LayoutKind.FLASH_ATTN, 32, 100, 16, 1024, torch.bfloat16)
    fi = KVLayout(LayoutKind.FLASHINFER, 32, 7, 16, 1024, torch.bfloat16)
    assert fa.chunk_shape(256) == (32, 2, 256, 1024)
    assert fa.chunk_bytes(256) == 32 * 2 * 256 * 1024 * 2 == 32 << 20
    # block counts and engine layout differ, chunks are interchangeable
    assert fa.chunk_format(256) == fi.chunk_format(256) == "bfloat16:32x2x256x1024"
    assert KVLayout(LayoutKind.FLASH_ATTN, 32, 100, 32, 1024, torch.bfloat16).chunk_format(256) == \
        fa.chunk_format(256)
    assert KVLayout(LayoutKind.FLASH_ATTN, 32, 100, 16, 1024, torch.float16).chunk_format(256) != \
        fa.chunk_format(256)
    mla = KVLayout(LayoutKind.MLA, 61, 100, 64, 576, torch.bfloat16)
    assert mla.chunk_format(256) == "bfloat16:61x1x256x576"
    with pytest.raises(LayoutError, match="not a positive multiple of block_size 16"):
        fa.chunk_format(100)
    with pytest.raises(LayoutError, match="num_layers"):
        KVLayout(LayoutKind.MLA, 0, 1, 1, 1, torch.bfloat16)


def test_check_tensors() -> None:
    ts = layers((2, NB, BS, HEADS, HD))
    lay = KVLayout.infer(ts, BS)
    lay.check_tensors(ts)
    with pytest.raises(LayoutError, match="expected 3 layers, got 2"):
        lay.check_tensors(ts[:2])
    with pytest.raises(LayoutError, match="registration says"):
        lay.check_tensors([t.to(torch.float16) for t in ts])
