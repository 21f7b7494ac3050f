"""Conformance: chunks shared between transports and between instances."""

from __future__ import annotations

from typing import Any

import pytest

from kvxfer.errors import InvalidRequest
from kvxfer.layout import LayoutKind
from kvxfer.testing.conformance.roundtrip import assert_retrieved
from kvxfer.testing.harness import DTYPES, LAYOUTS, REFERENCE, VIEWS, Kit, Layout, layout_id
from kvxfer.testing.kvdata import View, as_bytes, equal_bytes

__all__ = ["SharingTests"]

#: Every older layout and every bhnc view of the kit (in the transport's first dtype).
EVERY_LAYOUT: list[Layout] = [*LAYOUTS, *(view for view, _ in VIEWS)]
#: bhnc views whose pages hold the same bytes in the same order, wherever the pages sit: the
#: first stores, the second retrieves.
SAME_PAGES = [(View("LBHNC"), View("BLHNC", page_pad=32)), (View("BHLNC"), View("LHBNC"))]


class SharingTests:
    @pytest.mark.parametrize("layout", EVERY_LAYOUT, ids=[layout_id(k) for k in EVERY_LAYOUT])
    def test_retrieves_chunks_stored_by_the_reference(self, kit: Kit, layout: Layout) -> None:
        """cpu_gather (host tensors) stores; the transport under test retrieves, bit-exact."""
        spec = kit.spec(layout)
        host = kit.kv(spec, device="cpu")
        ref = kit.register(host, spec, transport=REFERENCE, client=kit.client(new=True))
        keys, src = kit.keys(3), kit.blocks(spec, 3)
        assert kit.store(ref, keys, src).stored == [0, 1, 2]

        layers = kit.kv(spec)
        ctx = kit.register(layers, spec)
        before = as_bytes(layers)
        dst = kit.blocks(spec, 3)
        assert kit.retrieve(ctx, keys, dst).loaded == [0, 1, 2]
        assert_retrieved(kit, spec, layers, before, dst, kit.chunks_of(host, spec, src))

    @pytest.mark.parametrize("layout", EVERY_LAYOUT, ids=[layout_id(k) for k in EVERY_LAYOUT])
    def test_reference_retrieves_chunks_it_stored(self, kit: Kit, layout: Layout) -> None:
        """The transport under test stores; cpu_gather (host tensors) retrieves, bit-exact."""
        spec = kit.spec(layout)
        layers = kit.kv(spec)
        ctx = kit.register(layers, spec)
        keys, src = kit.keys(3), kit.blocks(spec, 3)
        assert kit.store(ctx, keys, src).stored == [0, 1, 2]

        host = kit.kv(spec, device="cpu")
        ref = kit.register(host, spec, transport=REFERENCE, client=kit.client(new=True))
        before = as_bytes(host)
        dst = kit.blocks(spec, 3)
        assert kit.retrieve(ref, keys, dst).loaded == [0, 1, 2]
        assert_retrieved(kit, spec, host, before, dst, kit.chunks_of(layers, spec, src))

    def test_another_instance_of_the_same_model_retrieves(self, kit: Kit) -> None:
        """Two instances (two connections, two KV caches) of one model and world size share chunks."""
        spec = kit.spec()
        a_layers = kit.kv(spec)
        a = kit.register(a_layers, spec)
        keys, src = kit.keys(3), kit.blocks(spec, 3)
        assert kit.store(a, keys, src).stored == [0, 1, 2]
        a.close()  # the chunks outlive the instance that stored them

        b_layers = kit.kv(spec)
        b = kit.register(b_layers, spec, client=kit.client(new=True))
        assert kit.store(b, keys, kit.blocks(spec, 3)).present == [0, 1, 2]
        before = as_bytes(b_layers)
        dst = kit.blocks(spec, 3)
        assert kit.retrieve(b, keys, dst).loaded == [0, 1, 2]
        assert_retrieved(kit, spec, b_layers, before, dst, kit.chunks_of(a_layers, spec, src))

    def test_flash_attn_and_flashinfer_share_chunks(self, kit: Kit) -> None:
        """Both layouts have the same canonical chunk: one stores, the other retrieves."""
        kit.require(LayoutKind.FLASH_ATTN)
        kit.require(LayoutKind.FLASHINFER)
        fa = kit.spec(LayoutKind.FLASH_ATTN)
        fi = kit.spec(LayoutKind.FLASHINFER, fa.dtype)
        fa_layers = kit.kv(fa)
        keys, src = kit.keys(2), kit.blocks(fa, 2)
        assert kit.store(kit.register(fa_layers, fa), keys, src).stored == [0, 1]
        fi_layers = kit.kv(fi)
        ctx = kit.register(fi_layers, fi, client=kit.client(new=True))
        before = as_bytes(fi_layers)
        dst = kit.blocks(fi, 2)
        assert kit.retrieve(ctx, keys, dst).loaded == [0, 1]
        assert_retrieved(kit, fi, fi_layers, before, dst, kit.chunks_of(fa_layers, fa, src))

    @pytest.mark.parametrize("stored_by,read_by", SAME_PAGES, ids=[f"{a.id}-to-{b.id}" for a, b in SAME_PAGES])
    def test_views_with_the_same_page_order_share_chunks(self, kit: Kit, stored_by: View, read_by: View) -> None:
        """A chunk is a page's bytes, not where the page sits: chunks stored from layer-compact
        views are retrieved into cross-layer ones (padded, or a run per head), and back."""
        first = kit.spec(stored_by)
        second = kit.spec(read_by, first.dtype)
        a_layers = kit.kv(first)
        a = kit.register(a_layers, first)
        keys, src = kit.keys(2), kit.blocks(first, 2)
        assert kit.store(a, keys, src).stored == [0, 1]
        b_layers = kit.kv(second)
        ctx = kit.register(b_layers, second, client=kit.client(new=True))
        before = as_bytes(b_layers)
        dst = kit.blocks(second, 2)
        assert kit.retrieve(ctx, keys, dst).loaded == [0, 1]
        assert_retrieved(kit, second, b_layers, before, dst, kit.chunks_of(a_layers, first, src))
        more, back = kit.keys(1), kit.blocks(second, 1, exclude=dst)
        assert kit.store(ctx, more, back).stored == [0]
        a_before = as_bytes(a_layers)
        a_dst = kit.blocks(first, 1, exclude=src)
        assert kit.retrieve(a, more, a_dst).loaded == [0]
        assert_retrieved(kit, first, a_layers, a_before, a_dst, kit.chunks_of(b_layers, second, back))

    def test_other_model_rank_or_dtype_does_not_share(self, kit: Kit) -> None:
        """Keys are (model, world size, rank, hash): no cross-talk. A KV cache of another
        format under the same model is refused with a typed error, and nothing is written."""
        spec = kit.spec()
        layers = kit.kv(spec)
        keys, src = kit.keys(2), kit.blocks(spec, 2)
        kit.store(kit.register(layers, spec), keys, src)
        others: list[dict[str, Any]] = [
            dict(model=kit.model + "-other"),
            dict(world_size=2, rank=1),
            dict(world_size=2, rank=0),
        ]
        for who in others:
            ctx = kit.register(kit.kv(spec), spec, **who)
            assert kit.retrieve(ctx, keys, kit.blocks(spec, 2)).missing == [0, 1], who
        other_dtype = next((d for d in DTYPES if d != spec.dtype and d in kit.caps.dtypes), None)
        if other_dtype is not None:
            odd = kit.spec(spec.kind, other_dtype)
            odd_layers = kit.kv(odd)
            before = as_bytes(odd_layers)
            with pytest.raises(InvalidRequest, match=r"model_name: chunks of .* are in format"):
                kit.register(odd_layers, odd)
            assert equal_bytes(as_bytes(odd_layers), before)
