"""Deliberately broken transports (cpu_gather with one bug each) that the conformance kit must
reject, and ``contiguous_only``, the honest twin of ``mutant_contiguous``: the same copies,
with the capabilities they have. Installed for a test run only, through the dist-info next to
this file."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvxfer import RetrieveResult
from kvxfer.transport import Capabilities, HostRows, RowCopy, Transfer, copy_view
from kvxfer_cpu_gather import CpuGatherContext, CpuGatherTransport


class FlipContext(CpuGatherContext):
    """Stores one wrong bit."""

    def gather(self, copies: list[RowCopy], transfer: Transfer) -> None:
        super().gather(copies, transfer)
        if copies:
            first = copies[0].slot.view(torch.uint8)
            first[0, 0, 0] = first[0, 0, 0] ^ 1


class IgnoreSkipContext(CpuGatherContext):
    """Loads the blocks of skipped tokens too."""

    def submit_retrieve(self, keys: Sequence[bytes], block_ids: Any, skip_first_n_tokens: int = 0,
                        lease_id: int = 0) -> Future[RetrieveResult]:
        return super().submit_retrieve(keys, block_ids, 0, lease_id)


class ThroughFloatContext(CpuGatherContext):
    """Scatters through a float64 round trip: fine for numbers, wrong for NaN payloads."""

    def scatter(self, copies: list[RowCopy], transfer: Transfer) -> None:
        super().scatter([RowCopy(c.rows, c.slot.to(torch.float64).to(c.slot.dtype)) for c in copies], transfer)


class ClobberContext(CpuGatherContext):
    """Zeroes every block of a retrieve first, missing chunks' and skipped tokens' included."""

    def submit_retrieve(self, keys: Sequence[bytes], block_ids: Any, skip_first_n_tokens: int = 0,
                        lease_id: int = 0) -> Future[RetrieveResult]:
        rows = self.layout.rows(torch.as_tensor(list(block_ids), dtype=torch.int64))
        for layer in self.layers:
            self.layout.row_view(layer)[rows] = 0
        return super().submit_retrieve(keys, block_ids, skip_first_n_tokens, lease_id)


class ContiguousContext(CpuGatherContext):
    """Copies as if each layer were contiguous: the rows of its row view back to back from the
    layer's first element (``row_pitch`` taken to be ``row_elems``). Right for the older kinds
    and for vLLM's layer-compact views without padding (LBHNC, LBNHC, LHBNC); wrong wherever
    pages are padded or the layers of a block interleave in one buffer."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        lay = self.layout
        self._rows = [copy_view(t.as_strided((lay.span_rows, lay.row_elems), (lay.row_elems, 1), t.storage_offset()),
                                self._elem) for t in self.layers]
        if self._host is not None:  # the host copies too
            self._host = HostRows([t.as_strided((lay.span_rows, lay.row_elems), (lay.row_elems, 1), t.storage_offset())
                                   for t in self.layers], self.copy_threads)


class FirstLayerContext(CpuGatherContext):
    """Claims ``layer_ranges`` (as cpu_gather does) but copies every range as if it began at
    layer 0: right for whole transfers, wrong for each part of a layer-wise one but the first."""

    def gather(self, copies: list[RowCopy], transfer: Transfer) -> None:
        super().gather([RowCopy(c.rows, c.slot) for c in copies], transfer)

    def scatter(self, copies: list[RowCopy], transfer: Transfer) -> None:
        super().scatter([RowCopy(c.rows, c.slot) for c in copies], transfer)


class LeakContext(CpuGatherContext):
    """Keeps a descriptor (a duplicate of its arena mapping's, say) for every request it copies."""

    def gather(self, copies: list[RowCopy], transfer: Transfer) -> None:
        _KEPT.append(os.open("/dev/null", os.O_RDONLY))
        super().gather(copies, transfer)


#: What LeakContext keeps (never closed while the test process lives).
_KEPT: list[int] = []


class EarlyLayerContext(CpuGatherContext):
    """Claims ``layer_ranges`` but, to batch its copies, holds every range of a retrieve until
    its last one comes and copies them all then (which takes a while): every byte lands, but
    each layer but the last is reported landed before it has."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._held: list[list[RowCopy]] = []

    def scatter(self, copies: list[RowCopy], transfer: Transfer) -> None:
        if copies and any(c.first_layer + c.slot.shape[0] < len(self.layers) for c in copies):
            self._held.append(copies)
            return
        held, self._held = self._held, []
        if held:
            time.sleep(1.0)  # the batched copy takes a while
        for part in held:
            super().scatter(part, transfer)
        super().scatter(copies, transfer)


class LateWriteContext(CpuGatherContext):
    """Finishes each store's copy on a thread of its own a moment after saying it is done (one
    byte of each slot, late): the chunk is right when the store returns, wrong a moment later."""

    def gather(self, copies: list[RowCopy], transfer: Transfer) -> None:
        super().gather(copies, transfer)
        slots = [c.slot.view(torch.uint8) for c in copies]
        _LATE.submit(_flip_later, slots)


def _flip_later(slots: list[torch.Tensor]) -> None:
    time.sleep(0.05)
    for s in slots:
        s[0, 0, 0] = s[0, 0, 0] ^ 1


#: LateWriteContext's one thread, shared by every context (one per context would fail the kit's
#: leak test instead of the test of the bug itself).
_LATE = ThreadPoolExecutor(1, thread_name_prefix="late-write")


class WideRowsContext(CpuGatherContext):
    """Copies each row as whole 8-byte words, as if every row were a multiple of 8 bytes long:
    the last bytes of a shorter row are never copied (without a word to move, none of it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._bytes = [copy_view(self.layout.row_view(t), torch.uint8) for t in self.layers]
        self._width = self.layout.row_bytes // 8 * 8

    def gather(self, copies: list[RowCopy], transfer: Transfer) -> None:
        w = self._width
        for c in copies:
            for layer, dst in zip(self._bytes[c.first_layer:], c.slot.view(torch.uint8)):
                dst[:, :w] = layer[c.rows][:, :w]

    def scatter(self, copies: list[RowCopy], transfer: Transfer) -> None:
        w = self._width
        for c in copies:
            for layer, src in zip(self._bytes[c.first_layer:], c.slot.view(torch.uint8)):
                rows = layer[c.rows]
                rows[:, :w] = src[:, :w]
                layer[c.rows] = rows


class LateRetrieveContext(CpuGatherContext):
    """Copies each retrieve's rows again, from its slots, for a moment after saying it is done
    (the same bytes, on a thread shared by every context): right when the retrieve returns,
    wrong once the engine has written those blocks since."""

    def scatter(self, copies: list[RowCopy], transfer: Transfer) -> None:
        super().scatter(copies, transfer)
        _LATE.submit(_again_later, super().scatter, [RowCopy(c.rows, c.slot.clone(), c.first_layer) for c in copies],
                     transfer)


class LateStoreContext(CpuGatherContext):
    """Reads each store's rows again, into its slots, for a moment after saying it is done:
    right when the store returns, wrong once the engine has reused those blocks since."""

    def gather(self, copies: list[RowCopy], transfer: Transfer) -> None:
        super().gather(copies, transfer)
        _LATE.submit(_again_later, super().gather, copies, transfer)


def _again_later(copy: Any, copies: list[RowCopy], transfer: Transfer) -> None:
    for _ in range(5):  # again and again for 0.25 s: after the kit's engine wrote the blocks, before it looks
        time.sleep(0.05)
        copy(copies, transfer)


class _ByteRows(CpuGatherContext):
    """Copies through uint8 row views of its layers, from ``_source()`` on a store."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._bytes = [copy_view(self.layout.row_view(t), torch.uint8) for t in self.layers]

    def _source(self, first_layer: int) -> list[torch.Tensor]:
        return self._bytes

    def gather(self, copies: list[RowCopy], transfer: Transfer) -> None:
        for c in copies:
            for layer, dst in zip(self._source(c.first_layer)[c.first_layer:], c.slot.view(torch.uint8)):
                dst.copy_(layer[c.rows])


class SnapshotAtRegisterContext(_ByteRows):
    """Stores from a copy of its layers taken when it was registered (a transport that gathers
    strided layers through a contiguous copy made once): stale as soon as the engine writes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._snapshot = [b.clone() for b in self._bytes]

    def _source(self, first_layer: int) -> list[torch.Tensor]:
        return self._snapshot


class EarlyLayerStoreContext(_ByteRows):
    """Claims ``layer_ranges``; to batch its reads, reads every layer of a store when its first
    range comes, and copies the later ranges from that read: layers written after the first
    ``layer_ready`` are stored as they were before."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read: list[torch.Tensor] = self._bytes

    def _source(self, first_layer: int) -> list[torch.Tensor]:
        if first_layer == 0:
            self._read = [b.clone() for b in self._bytes]
        return self._read


class StagedBySlotContext(CpuGatherContext):
    """Keeps what it loaded from each slot, keyed by the slot's address, and loads a later
    retrieve of the same slot from there (a staging cache that ignores ``RowCopy.stamp``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._staged: dict[tuple[int, int], torch.Tensor] = {}

    def scatter(self, copies: list[RowCopy], transfer: Transfer) -> None:
        staged = []
        for c in copies:
            at = (c.slot.data_ptr(), c.first_layer)
            if at not in self._staged:
                self._staged[at] = c.slot.clone()
            staged.append(RowCopy(c.rows, self._staged[at], c.first_layer))
        super().scatter(staged, transfer)


class FolderPerContext(CpuGatherContext):
    """Makes a spool folder in the server's private directory for each context, and leaves it
    behind when the context closes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        (Path(self.arena.path).parent / f"spool-{os.getpid()}-{id(self)}").mkdir()


class FlipTransport(CpuGatherTransport):
    name = "mutant_flip"
    context_type = FlipContext


class IgnoreSkipTransport(CpuGatherTransport):
    name = "mutant_ignore_skip"
    context_type = IgnoreSkipContext


class ThroughFloatTransport(CpuGatherTransport):
    name = "mutant_through_float"
    context_type = ThroughFloatContext


class ClobberTransport(CpuGatherTransport):
    name = "mutant_clobber"
    context_type = ClobberContext


class ContiguousTransport(CpuGatherTransport):
    name = "mutant_contiguous"
    context_type = ContiguousContext


class FirstLayerTransport(CpuGatherTransport):
    name = "mutant_first_layer"
    context_type = FirstLayerContext


class LeakTransport(CpuGatherTransport):
    name = "mutant_leak"
    context_type = LeakContext


class EarlyLayerTransport(CpuGatherTransport):
    name = "mutant_early_layer"
    context_type = EarlyLayerContext


class LateWriteTransport(CpuGatherTransport):
    name = "mutant_late_write"
    context_type = LateWriteContext


class WideRowsTransport(CpuGatherTransport):
    name = "mutant_wide_rows"
    context_type = WideRowsContext


class LateRetrieveTransport(CpuGatherTransport):
    name = "mutant_late_retrieve"
    context_type = LateRetrieveContext


class LateStoreTransport(CpuGatherTransport):
    name = "mutant_late_store"
    context_type = LateStoreContext


class SnapshotAtRegisterTransport(CpuGatherTransport):
    name = "mutant_snapshot_at_register"
    context_type = SnapshotAtRegisterContext


class EarlyLayerStoreTransport(CpuGatherTransport):
    name = "mutant_early_layer_store"
    context_type = EarlyLayerStoreContext


class StagedBySlotTransport(CpuGatherTransport):
    name = "mutant_staged_by_slot"
    context_type = StagedBySlotContext


class FolderPerContextTransport(CpuGatherTransport):
    name = "mutant_folder_per_context"
    context_type = FolderPerContext


class ContiguousOnlyTransport(CpuGatherTransport):
    """Says what it moves: contiguous layers only. The core hands it nothing else, and the kit
    skips the strided views for it."""

    name = "contiguous_only"
    context_type = ContiguousContext
    capabilities = Capabilities(device_types=frozenset({"*"}), strided_layers=False)


class ProbeRaisesTransport(CpuGatherTransport):
    """Its probe raises instead of answering unavailable: the kit fails it with that said once."""

    name = "mutant_probe_raises"
    production = False

    def probe(self) -> Any:
        raise RuntimeError("driver library not found")


class CudaOnlyTransport(CpuGatherTransport):
    """Claims CUDA tensors only: the kit on cpu says how to pick the device under test."""

    name = "mutant_cuda_only"
    production = False
    capabilities = Capabilities(device_types=frozenset({"cuda"}))
