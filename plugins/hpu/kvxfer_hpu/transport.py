"""The hpu transport: plugin object, registration Struct and client context.

Data path of one store::

    engine KV (device) --index_select per layer, for a group of chunks at once--> gather buffer
    gather buffer      --one device copy per chunk (layer-major -> chunk-major)--> chunk buffer
    chunk buffer       --one copy per chunk-->  reserved arena slot (host, pinned in place where
                                                the device API can: CUDA cudaHostRegister)

and a retrieve is the reverse (one copy per chunk into a chunk buffer, one device copy into the
gather buffer, then one ``index_copy_`` per layer for the group). Small chunks are gathered
several at a time (up to :attr:`HpuContext.GROUP_BYTES` per index kernel), so that the number of
kernel launches per request stays small. Where the device has streams, the index kernels run on
one stream and the host copies on another, with two chunk buffers alternating, so that the copy
engine stays busy while the next chunk is gathered.
KV tensors in host memory (cpu) skip all of this: rows are copied straight between the KV tensors
and the slot, as cpu_gather does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final

from kvxfer import ConfigError, TransportUnavailable
from kvxfer.transport import (
    API_VERSION,
    ArenaMapping,
    Capabilities,
    ClientDrivenContext,
    Connection,
    HostRows,
    InstanceIdentity,
    KVLayout,
    Probe,
    Registration,
    RowCopy,
    ServerTransport,
    Transfer,
    TransferKind,
    Transport,
    Waiter,
)
from kvxfer_hpu.ops import KNOWN_DEVICE_TYPES, DeviceOps, Pinning, ops_for
from kvxfer_hpu.server import HpuServerTransport

if TYPE_CHECKING:  # imported where tensors are handled: `kvxfer plugins` imports this module
    import torch

__all__ = ["HpuTransport", "HpuContext", "HpuRegistration", "PRIORITY"]

log = logging.getLogger(__name__)

#: Rank of hpu in ``"auto"`` per device type (cpu_gather, the fallback for every device, is 10).
#: hpu: the transport made for it. cpu: below cpu_gather, which does the same copies with less
#: machinery. Other accelerators: above cpu_gather (pinned, pipelined staging) but below
#: transports made for them (cuda_ipc ranks higher for cuda).
PRIORITY: Final[dict[str, int]] = {"hpu": 50, "cpu": 5}
_OTHER_ACCELERATORS: Final = 15


class HpuRegistration(Registration, frozen=True, kw_only=True):
    """Scalars only: the core's identity and layout fields, plus two informational fields."""

    #: torch device type of the KV tensors (the server never touches them).
    device: str = "cpu"
    #: Whether the client pinned its arena mapping for the device's DMA.
    host_pinned: bool = False
    #: Device bytes the context's staging buffers take once it has run a transfer (0: none).
    staging_bytes: int = 0


@dataclass(slots=True)
class _Pipeline:
    """Streams, events and staging buffers of one context (made on first use)."""

    compute: Any | None  # index kernels and device-side reorders
    copy: Any | None  # device <-> host copies
    filled: list[Any | None]  # per chunk buffer: its bytes are ready for the next stage
    free: list[Any | None]  # per chunk buffer: the next stage is done with it
    chunks: list[torch.Tensor]  # chunk buffers (uint8, chunk_bytes each): chunk-major rows
    group: torch.Tensor  # gather buffer (uint8, group_chunks * chunk_bytes): layer-major rows
    group_rows: int  # rows per layer the gather buffer holds
    n: int = 0  # chunk buffers handed out so far (the next one is n % len(chunks))

    @staticmethod
    def wait(stream: Any | None, event: Any | None) -> None:
        if stream is not None and event is not None:
            stream.wait_event(event)

    @staticmethod
    def record(event: Any | None, stream: Any | None) -> None:
        if stream is not None and event is not None:
            event.record(stream)


class HpuContext(ClientDrivenContext):
    """Copies between an accelerator's KV tensors and arena slots through device staging.

    ``ops`` (default :func:`kvxfer_hpu.ops_for` of the tensors' device type) does every
    device-specific step. Stores and retrieves are ordered after the work queued on the
    caller's current stream when it submitted them (on devices with streams: :meth:`on_submit`
    records an event there, which a store's gather waits for before it reads the blocks and a
    retrieve's scatter before it writes them); a retrieve's future resolves once the blocks are
    written on the device.
    """

    #: Chunk buffers in flight: 2 overlaps preparing one chunk with copying the previous.
    STAGING_DEPTH: ClassVar[int] = 2
    #: Device bytes of the gather buffer: chunks gathered per layer with one index kernel
    #: (at least one chunk). Device memory used: this plus STAGING_DEPTH chunks. With 32 MiB
    #: chunks and 32 layers a request of 8 chunks takes 8 x 32 index kernels at 32 MiB and 2 x 32
    #: at 128 MiB: where the host launches slowly, 4 requests in flight were bound by the
    #: launches at 32 MiB (0.69-0.86x of the pinned copy on an H100, against 0.95x at 128 MiB in
    #: the same call; docs/hpu.md); on a faster host the sizes performed alike.
    GROUP_BYTES: ClassVar[int] = 128 << 20
    #: A layer-wise transfer is cut into parts of at least 128 MiB, and 16 MiB of each chunk: a
    #: part costs 1-2 ms of host work besides its copy, each chunk in it more. On an H200 (CUDA
    #: standing in), in 2 parts a 256 MiB prefix hid 0.09-0.22 of its load behind the forward pass
    #: and a 1 GiB one 0.25-0.44; in 32 (or 8) parts both were slower than loaded first; a 64 MiB
    #: prefix lost nothing in 1 part (docs/hpu.md).
    min_layer_part_bytes: ClassVar[int] = 128 << 20
    min_layer_chunk_bytes: ClassVar[int] = 16 << 20

    def __init__(
        self,
        transport: Transport,
        connection: Connection,
        layers: list[torch.Tensor],
        layout: KVLayout,
        identity: InstanceIdentity,
        *,
        ops: DeviceOps | None = None,
    ) -> None:
        self.device = layers[0].device
        self.ops = ops if ops is not None else ops_for(self.device.type)
        if self.ops.device_type != self.device.type:
            raise ConfigError(f"device ops for {self.ops.device_type!r} cannot move tensors on {self.device}")
        self.pinning = Pinning(False, "arena not mapped yet")
        super().__init__(transport, connection, layers, layout, identity)
        rows = [layout.row_view(t) for t in self.layers]
        #: The element type of row copies; each layer as [rows, row_elems] of it.
        self._elem = self.ops.copy_dtype(rows)
        self._rows = [r.view(self._elem) for r in rows]
        #: Host tensors (the direct path): the core's C row copy, as cpu_gather's.
        self._host = HostRows(rows) if self.ops.direct else None
        self._pipe: _Pipeline | None = None

    def on_arena(self, arena: ArenaMapping) -> Callable[[], None]:
        """Pin the arena mapping for the device's DMA (unpinned before it is unmapped)."""
        if self.ops.direct:
            self.pinning = Pinning(False, "host tensors: no device DMA")
        else:
            self.pinning = self.ops.pin(arena.tensor)
            if not self.pinning.pinned:
                log.info("hpu transport: arena mapping not pinned (%s)", self.pinning.note)
        return self.pinning.release

    def release(self) -> None:
        self._pipe = None

    def registration_extra(self) -> dict[str, Any]:
        return {"device": self.device.type, "host_pinned": self.pinning.pinned,
                "staging_bytes": 0 if self.ops.direct else self.staging_bytes()}

    def staging_bytes(self) -> int:
        """Device memory of the staging buffers (made at the first transfer): the gather buffer
        and ``STAGING_DEPTH`` chunk buffers."""
        return (self._group_chunks() + self.STAGING_DEPTH) * self.chunk_bytes

    def _group_chunks(self) -> int:
        return max(1, self.GROUP_BYTES // self.chunk_bytes)

    def on_submit(self, kind: TransferKind) -> Any:
        """The request's token: an event recorded on the caller's current stream of the device
        (None without streams), which a store's gather waits for before it reads the blocks and a
        retrieve's scatter before it writes them (the engine's work queued before the submit may
        still write or read them)."""
        if self.ops.direct:
            return None
        stream = self.ops.current_stream(self.device)
        event = self.ops.new_event() if stream is not None else None
        if event is not None:
            event.record(stream)
        return event

    # ------------------------------------------------------------------ copies

    def gather(self, copies: list[RowCopy], transfer: Transfer) -> Waiter | None:
        import torch

        if self._host is not None:
            self._host.copy(copies, to_slot=True)
            return None
        ops, p = self.ops, self._pipeline()
        layers = self._layers_of(copies)
        with ops.use_stream(p.compute):
            rows = self._device_rows(copies)  # (before the wait: an upload that waited would hold this thread)
            _Pipeline.wait(p.compute, transfer.token)
        for group, idx in self._groups(copies, rows, p.group_rows):
            gathered = self._rows_view(p.group, idx.numel(), len(layers))
            with ops.use_stream(p.compute):
                for layer, out in zip(layers, gathered):
                    torch.index_select(layer, 0, idx, out=out)
            offset = 0
            for c in group:
                n = c.rows.numel()
                k, buf = self._chunk_buffer(p, n, len(layers))
                dst = c.slot.view(self._elem)
                with ops.use_stream(p.compute):
                    _Pipeline.wait(p.compute, p.free[k])
                    buf.copy_(gathered[:, offset:offset + n])
                    ops.flush(self.device)
                    _Pipeline.record(p.filled[k], p.compute)
                with ops.use_stream(p.copy):
                    _Pipeline.wait(p.copy, p.filled[k])
                    dst.copy_(buf, non_blocking=self._async(dst))
                    _Pipeline.record(p.free[k], p.copy)
                offset += n
        return self._waiter(p.copy)

    def scatter(self, copies: list[RowCopy], transfer: Transfer) -> Waiter | None:
        if self._host is not None:
            self._host.copy(copies, to_slot=False)
            return None
        ops, p = self.ops, self._pipeline()
        layers = self._layers_of(copies)

        def dma(c: RowCopy) -> tuple[int, torch.Tensor]:  # the chunk from its slot into the next buffer
            k, buf = self._chunk_buffer(p, c.rows.numel(), len(layers))
            src = c.slot.view(self._elem)
            with ops.use_stream(p.copy):
                _Pipeline.wait(p.copy, p.free[k])
                buf.copy_(src, non_blocking=self._async(src))
                _Pipeline.record(p.filled[k], p.copy)
            return k, buf

        # the first chunks' DMAs (one per buffer) are queued before the row ids are uploaded,
        # which they do not need: the copy engine starts while this thread prepares the rest
        early = [dma(c) for c in copies[:len(p.chunks)]]
        with ops.use_stream(p.compute):
            rows = self._device_rows(copies)
            _Pipeline.wait(p.compute, transfer.token)  # the blocks are written after the engine's work on them
        i = 0
        for group, idx in self._groups(copies, rows, p.group_rows):
            gathered = self._rows_view(p.group, idx.numel(), len(layers))
            offset = 0
            for c in group:
                n = c.rows.numel()
                k, buf = early[i] if i < len(early) else dma(c)
                i += 1
                with ops.use_stream(p.compute):
                    _Pipeline.wait(p.compute, p.filled[k])
                    gathered[:, offset:offset + n].copy_(buf)
                    _Pipeline.record(p.free[k], p.compute)
                offset += n
            with ops.use_stream(p.compute):
                for layer, loaded in zip(layers, gathered):
                    layer.index_copy_(0, idx, loaded)
                ops.flush(self.device)
        return self._waiter(p.compute)

    # ------------------------------------------------------------------ helpers

    def _pipeline(self) -> _Pipeline:
        """Streams, events and staging buffers, made on the worker thread at first transfer."""
        if self._pipe is None:
            ops, dev = self.ops, self.device
            chunk_bytes = self.chunk_bytes
            group_chunks = self._group_chunks()
            depth = self.STAGING_DEPTH
            self._pipe = _Pipeline(
                ops.new_stream(dev), ops.new_stream(dev),
                filled=[ops.new_event() for _ in range(depth)],
                free=[ops.new_event() for _ in range(depth)],
                chunks=[ops.staging(chunk_bytes, dev) for _ in range(depth)],
                group=ops.staging(group_chunks * chunk_bytes, dev),
                group_rows=group_chunks * self.layout.runs * self.blocks_per_chunk,
            )
        return self._pipe

    @staticmethod
    def _groups(copies: list[RowCopy], rows: torch.Tensor,
                max_rows: int) -> list[tuple[list[RowCopy], torch.Tensor]]:
        """Consecutive copies whose rows fit the gather buffer together (a copy is at most one
        chunk, so each fits alone), each with its slice of ``rows`` (all copies' rows in order)."""
        groups: list[tuple[list[RowCopy], int, int]] = []
        for c in copies:
            n = c.rows.numel()
            if groups and groups[-1][2] + n <= max_rows:
                group, start, count = groups[-1]
                group.append(c)
                groups[-1] = (group, start, count + n)
            else:
                start = groups[-1][1] + groups[-1][2] if groups else 0
                groups.append(([c], start, n))
        return [(group, rows[start:start + count]) for group, start, count in groups]

    def _layers_of(self, copies: list[RowCopy]) -> list[torch.Tensor]:
        """The row views of the layers ``copies`` move (the core passes one range per call)."""
        span = copies[0].layers
        if any(c.layers != span for c in copies):
            raise ValueError("hpu copies one range of layers per call")
        return self._rows[span.start:span.stop]

    def _rows_view(self, flat: torch.Tensor, n_rows: int, n_layers: int) -> torch.Tensor:
        """The first bytes of ``flat`` (uint8) as ``[n_layers, n_rows, row_elems]`` of the
        row-copy element type."""
        like = self._rows[0]
        nbytes = n_layers * n_rows * like.shape[1] * like.element_size()
        return flat[:nbytes].view(like.dtype).view(n_layers, n_rows, like.shape[1])

    def _device_rows(self, copies: list[RowCopy]) -> torch.Tensor:
        """Every copy's row ids, in order, on the device: one small host-to-device copy per
        request (a copy from pageable memory waits for the stream, so only one, up front)."""
        import torch

        rows = torch.cat([c.rows for c in copies]) if len(copies) > 1 else copies[0].rows
        return rows.to(self.device, non_blocking=True)

    def _chunk_buffer(self, p: _Pipeline, n_rows: int, n_layers: int) -> tuple[int, torch.Tensor]:
        """The next chunk buffer (index, ``[n_layers, n_rows, row_elems]`` view)."""
        k = p.n % len(p.chunks)
        p.n += 1
        return k, self._rows_view(p.chunks[k], n_rows, n_layers)

    def _async(self, host: torch.Tensor) -> bool:
        """Copy without blocking only from/to pinned, contiguous host memory (torch stages a
        non-contiguous host side through a temporary that a non-blocking copy would race)."""
        return self.pinning.pinned and host.is_contiguous()

    def _waiter(self, stream: Any | None) -> Waiter:
        """Returns once the work queued so far on ``stream`` (the request's last stage) is done:
        an event recorded now, else the stream, else the whole device. The core calls it off the
        worker, which meanwhile queues the next request's copies behind this one's."""
        event = self.ops.new_event() if stream is not None else None
        if event is not None and hasattr(event, "synchronize"):
            event.record(stream)
            return event.synchronize
        sync = getattr(stream, "synchronize", None)
        if sync is not None:
            return sync
        ops, device = self.ops, self.device
        return lambda: ops.synchronize(device)


class HpuTransport(Transport):
    """Client-driven transport for accelerators without CUDA IPC (Intel Gaudi first)."""

    name = "hpu"
    api_version = API_VERSION
    registration_type = HpuRegistration
    context_type = HpuContext
    #: Any torch device type whose device ops say it is available here (see :meth:`serves`).
    capabilities = Capabilities(device_types=frozenset({"*"}), layer_ranges=True)
    auto_priority = PRIORITY["hpu"]
    production = True

    def priority_for(self, device: torch.device) -> int:
        return PRIORITY.get(device.type, _OTHER_ACCELERATORS)

    def probe(self) -> Probe:
        """Available everywhere (cpu at least). The reason is one line that starts with Intel
        Gaudi, what this plugin is for: its devices, or what is missing; then the device types
        it serves instead or as well, and why each other one is not served, e.g. ``no Intel
        Gaudi: habana_frameworks (...) is not installed; serves cpu (...) instead; not cuda: torch
        ... was built without CUDA; not xpu: ...``."""
        probes = {t: ops_for(t).probe() for t in KNOWN_DEVICE_TYPES}
        gaudi, gaudi_reason = probes.pop("hpu")
        served = {t: reason for t, (ok, reason) in probes.items() if ok}
        refused = {t: reason for t, (ok, reason) in probes.items() if not ok}
        also = ", ".join(f"{t} ({reason})" for t, reason in served.items())
        parts = [f"Intel Gaudi: {gaudi_reason}; also serves {also}" if gaudi else
                 f"no Intel Gaudi: {gaudi_reason}; serves {also} instead"]
        parts += [f"not {t}: {reason}" for t, reason in refused.items()]
        return Probe(True, "; ".join(parts), (("hpu",) if gaudi else ()) + tuple(served))

    def serves(self, device: torch.device) -> bool:
        return ops_for(device.type).probe()[0]

    def client_context(
        self, connection: Connection, layers: list[torch.Tensor], layout: KVLayout, identity: InstanceIdentity
    ) -> HpuContext:
        device = layers[0].device
        ok, reason = ops_for(device.type).probe()
        if not ok:
            raise TransportUnavailable(f"transport 'hpu' cannot move KV tensors on {device} here: {reason}")
        return HpuContext(self, connection, layers, layout, identity)

    def server_transport(self) -> ServerTransport:
        return HpuServerTransport(self)
