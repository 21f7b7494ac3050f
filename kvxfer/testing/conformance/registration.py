"""Conformance: registration, and the typed errors of bad registrations."""

from __future__ import annotations

import re

import msgspec
import pytest

from kvxfer.errors import InvalidRequest, LayoutError, TransportNotFound
from kvxfer.layout import LayoutKind
from kvxfer.protocol import codec
from kvxfer.protocol import messages as m
from kvxfer.testing.harness import CHUNK_SIZE, Kit

__all__ = ["RegistrationTests"]

#: (field, bad value): each must be refused by the server with an error naming the field.
BAD_FIELDS = [
    ("dtype", "float7"),
    ("num_layers", 0),
    ("num_blocks", 0),
    ("block_size", -16),
    ("block_size", CHUNK_SIZE + 16),         # the server's chunk size is not a multiple of it
    ("hidden_dim_size", 0),
    ("layout", "paged"),
    ("use_mla", True),                        # contradicts a non-MLA layout
    ("world_size", 0),
    ("rank", 7),                              # not below world_size
    ("model_name", ""),
    ("instance_id", 0),
]


class RegistrationTests:
    def test_register_shows_in_status(self, kit: Kit) -> None:
        spec = kit.spec()
        ctx = kit.register(kit.kv(spec), spec)
        assert ctx.transport_name == kit.name
        found = [c for c in kit.client().status().contexts if c.instance_id == ctx.instance_id]
        assert len(found) == 1, "a registered context must be listed by the server's status"
        c = found[0]
        assert (c.transport, c.model_name, c.world_size, c.rank) == (kit.name, kit.model, 1, 0)
        assert (c.layout, c.num_layers, c.num_blocks, c.block_size, c.hidden_dim_size, c.dtype, c.use_mla) == (
            spec.kind.value, spec.num_layers, spec.num_blocks, spec.block_size, spec.hidden, spec.dtype,
            spec.kind is LayoutKind.MLA)

    @pytest.mark.parametrize("field,value", BAD_FIELDS, ids=[f"{f}={v!r}" for f, v in BAD_FIELDS])
    def test_bad_registration_field_is_refused(self, kit: Kit, field: str, value: object) -> None:
        """The transport's registration Struct, with one field made bad and sent as is."""
        kind = None
        if field == "use_mla":  # use_mla=True contradicts only a non-MLA layout
            kind = next((k for k in (LayoutKind.FLASH_ATTN, LayoutKind.FLASHINFER) if kit.claims(k)), None)
            if kind is None:
                pytest.skip(f"{kit.name} claims no non-MLA layout")
        spec = kit.spec(kind)
        ctx = kit.unregistered_context(kit.kv(spec), spec)
        make = getattr(ctx, "registration", None)
        if make is None:
            pytest.skip(f"{type(ctx).__name__} has no registration() (not built on TransferContextBase)")
        reg = msgspec.structs.replace(make(), **{field: value})
        payload = m.Register(kit.name, msgspec.Raw(codec.encode(reg)))
        with pytest.raises(InvalidRequest, match=rf"register: {field}:"):
            kit.client().request(payload)
        assert not any(c.model_name == kit.model for c in kit.client().status().contexts)

    def test_undecodable_registration_is_refused(self, kit: Kit) -> None:
        payload = m.Register(kit.name, msgspec.Raw(codec.encode({"instance_id": 5})))
        with pytest.raises(InvalidRequest, match=r"register: registration:"):
            kit.client().request(payload)

    def test_duplicate_instance_id_is_refused(self, kit: Kit) -> None:
        spec = kit.spec()
        ctx = kit.register(kit.kv(spec), spec)
        reg = ctx.registration()  # type: ignore[attr-defined]  # every context built on the core has registration()
        with pytest.raises(InvalidRequest, match=r"instance_id:.*already registered"):
            kit.client().request(m.Register(kit.name, msgspec.Raw(codec.encode(reg))))

    def test_unknown_transport_lists_installed(self, kit: Kit) -> None:
        spec = kit.spec()
        with pytest.raises(TransportNotFound, match=rf"installed:.*\b{re.escape(kit.name)}\b"):
            kit.register(kit.kv(spec), spec, transport="no_such_transport")

    def test_block_size_not_dividing_chunk_size_is_refused(self, kit: Kit) -> None:
        spec = kit.spec(block_size=CHUNK_SIZE + 16, num_blocks=4)
        with pytest.raises(LayoutError, match=r"block_size"):
            kit.register(kit.kv(spec), spec)

    def test_mismatched_layers_are_refused(self, kit: Kit) -> None:
        spec = kit.spec()
        layers = kit.kv(spec)
        layers[-1] = kit.kv(spec.with_blocks(spec.num_blocks + 1))[0]
        with pytest.raises(LayoutError, match=rf"layer {len(layers) - 1}"):
            kit.register(layers, spec)

    def test_tensors_not_matching_block_size_are_refused(self, kit: Kit) -> None:
        spec = kit.spec()
        with pytest.raises(LayoutError, match=r"block_size"):
            kit.client().register(kit.kv(spec), model_name=kit.model, block_size=spec.block_size * 2,
                                  transport=kit.name, layout=spec.kind)

    def test_layers_whose_last_dimension_is_strided_are_refused(self, kit: Kit) -> None:
        spec = kit.spec()
        layers = [t.transpose(-1, -2).contiguous().transpose(-1, -2) if t.dim() > 1 else t
                  for t in kit.kv(spec)]
        if all(t.is_contiguous() for t in layers):
            pytest.skip("layout has no second-to-last dimension to transpose")
        with pytest.raises(LayoutError, match=r"last dimension must be dense"):
            kit.register(layers, spec)

