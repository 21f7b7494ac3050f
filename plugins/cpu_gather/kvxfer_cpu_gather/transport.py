"""The cpu_gather transport: plugin object, registration Struct and client context."""

from __future__ import annotations

from typing import Any

import torch

from kvxfer.transport import (
    API_VERSION,
    Capabilities,
    ClientDrivenContext,
    Probe,
    Registration,
    RowCopy,
    Transfer,
    Transport,
    copy_dtype,
    copy_view,
)

__all__ = ["CpuGatherTransport", "CpuGatherContext", "CpuGatherRegistration"]


class CpuGatherRegistration(Registration, frozen=True, kw_only=True):
    """Scalars only: the core's identity and layout fields, plus the tensors' device type."""

    #: torch device type of the KV tensors (informational: the server never touches them).
    device: str = "cpu"


class CpuGatherContext(ClientDrivenContext):
    """Copies between the engine's KV tensors and arena slots in the engine's process."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.device = self.layers[0].device
        self.on_host = self.device.type == "cpu"
        # Each layer as [rows, row_elems] of the widest element type that fits every layer's
        # rows (and so the slots'): the indexing kernels run at memcpy speed on 16-byte elements,
        # at a third of it on 2-byte ones.
        rows = [self.layout.row_view(t) for t in self.layers]
        self._elem = copy_dtype(rows)
        self._rows = [copy_view(r, self._elem) for r in rows]

    def registration_extra(self) -> dict[str, Any]:
        return {"device": self.layers[0].device.type}

    def gather(self, copies: list[RowCopy], transfer: Transfer) -> None:
        for c in copies:
            slot = copy_view(c.slot, self._elem)
            if self.on_host:
                for layer, dst in zip(self._rows, slot):
                    torch.index_select(layer, 0, c.rows, out=dst)
            else:
                rows = c.rows.to(self.device, non_blocking=True)
                for layer, dst in zip(self._rows, slot):
                    dst.copy_(layer.index_select(0, rows))  # gathered on the device, then one D2H copy
        if not self.on_host:
            _synchronize(self.device)

    def scatter(self, copies: list[RowCopy], transfer: Transfer) -> None:
        for c in copies:
            slot = copy_view(c.slot, self._elem)
            rows = c.rows if self.on_host else c.rows.to(self.device, non_blocking=True)
            for layer, src in zip(self._rows, slot):
                layer.index_put_((rows,), src if self.on_host else src.to(self.device))
        if not self.on_host:
            _synchronize(self.device)


def _synchronize(device: torch.device) -> None:
    sync = getattr(getattr(torch, device.type, None), "synchronize", None)
    if sync is not None:
        sync(device)


class CpuGatherTransport(Transport):
    """Entry point ``cpu_gather``: the fallback "auto" picks when nothing device-specific serves."""

    name = "cpu_gather"
    api_version = API_VERSION
    registration_type = CpuGatherRegistration
    context_type = CpuGatherContext
    capabilities = Capabilities(device_types=frozenset({"*"}))
    auto_priority = 10
    production = True

    def probe(self) -> Probe:
        return Probe(True, "host shared memory; KV tensors on any torch device", ("*",))
