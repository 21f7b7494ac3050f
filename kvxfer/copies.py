"""Copy planning, shared by both sides: what a request may name, and which rows go where.

* :data:`MAX_CHUNKS_PER_REQUEST` bounds every request (client and server check it);
* :func:`check_transfer` validates a store's or retrieve's block ids;
* :func:`plan_copies` turns block ids (:func:`chunk_rows`) and arena slots into :class:`RowCopy` lists, the unit
  every transport's copy code receives (row ids of every chunk computed in one vectorized
  step, so planning a request costs about as much for 32 chunks as for one);
* :class:`SlotViews` remembers the views of one layout's arena slots (a lone request waits for
  every tensor view it makes);
* :func:`layer_slice` narrows copies to a range of layers (layer-by-layer transfers);
* :class:`HostRows` runs copies between KV tensors in host memory and arena slots (the C row
  copy of ``kvxfer._rowcopy``: cpu_gather's copies, and hpu's on host tensors).

Neither side's machinery lives here: the client's data paths (:mod:`kvxfer.transport`) and the
server (:mod:`kvxfer.server.engine`) both call these.
"""

from __future__ import annotations

import array
import functools
import numbers
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

import msgspec

from kvxfer.errors import ConfigError
from kvxfer.protocol import codec
from kvxfer.protocol.messages import MAX_CHUNKS_PER_REQUEST

if TYPE_CHECKING:
    import torch

    from kvxfer.layout import KVLayout

__all__ = ["MAX_CHUNKS_PER_REQUEST", "MAX_PREFETCH_CHUNKS", "ChunkRows", "HostRows", "RowCopy", "SlotViews",
           "StoredSlot", "check_lease_id", "check_transfer", "chunk_rows", "host_copy_threads", "layer_slice",
           "plan_copies"]

#: Hosts with at most this many CPUs copy on one thread by default (:func:`host_copy_threads`).
SMALL_HOST_CPUS: Final = 4

#: Most chunks one :meth:`ServerContext.prefetch` is given (the first of a lookup's leased run):
#: a prefetch into device staging holds a few, and each one given costs the server's loop a slot
#: view (a lookup may lease hundreds of thousands).
MAX_PREFETCH_CHUNKS: Final = 32


@dataclass(frozen=True, slots=True)
class RowCopy:
    """One copy between engine rows and one arena slot, for a range of layers.

    ``rows`` are row ids (int64, CPU) into each layer's row view (:meth:`KVLayout.row_view`);
    ``slot`` is ``[n, len(rows), row_elems]`` of the layout's dtype, a view of the arena, whose
    ``slot[i]`` belongs to layer ``first_layer + i`` (every layer, ``first_layer == 0``, unless
    the core moves a transfer layer by layer). The core hands the same slot view to later
    transfers of the slot: copy into or out of it, never change the view itself (``resize_``,
    ``as_strided_``). Store copies ``layer_rows[rows] -> slot[i]``; retrieve the reverse.
    ``stamp`` (server side, retrieves): the stored chunk whose whole slot this copy moves, the
    number :meth:`ServerContext.prefetch` was given for it (0: part of a chunk, or not known).
    """

    rows: torch.Tensor
    slot: torch.Tensor
    first_layer: int = 0
    stamp: int = 0

    @property
    def layers(self) -> range:
        """The layers this copy moves (indices into the context's layers)."""
        return range(self.first_layer, self.first_layer + self.slot.shape[0])


@dataclass(frozen=True, slots=True)
class StoredSlot:
    """A stored chunk as :meth:`ServerContext.prefetch` gets it: its whole arena slot (uint8,
    ``chunk_bytes`` long) and its stamp (see :attr:`RowCopy.stamp`)."""

    slot: torch.Tensor
    stamp: int


class SlotViews:
    """The chunk slots of one arena as one layout sees them, made once per slot and remembered by
    offset: its bytes (uint8, ``chunk_bytes`` long) and its ``[num_layers, rows, row_elems]``
    view (:meth:`KVLayout.chunk_rows_view`). Making the two views costs three tensor calls per
    chunk (about 4 us here, 15-30 us on a GPU host), which a lone request waits for.

    ``table``: where the views are kept, keyed by offset and chunk format, and shared by every
    SlotViews given the same one (a server's contexts: views of one format are the same for all
    of them, and the table's bound is the server's). It holds at most ``limit`` slots (about
    1.6 KB each); past that the one made first is forgotten for each new one. Every view
    holds the arena's memory: clear the table before the arena is unmapped. Not thread-safe:
    one thread plans (the server's loop, a client context's worker).
    """

    __slots__ = ("_view", "layout", "chunk_size", "nbytes", "limit", "_fmt", "_table")

    def __init__(self, arena_view: Callable[[int, int], torch.Tensor], layout: KVLayout, chunk_size: int,
                 table: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] | None = None,
                 limit: int = 8192) -> None:
        self._view = arena_view
        self.layout = layout
        self.chunk_size = chunk_size
        self.nbytes = layout.chunk_bytes(chunk_size)
        self.limit = limit
        self._fmt = layout.chunk_format(chunk_size)
        self._table = table if table is not None else {}

    def bytes(self, offset: int) -> torch.Tensor:
        """The slot at ``offset`` as uint8 bytes."""
        return self._of(offset)[0]

    def rows(self, offset: int) -> torch.Tensor:
        """The slot at ``offset`` as ``[num_layers, rows, row_elems]`` (what :func:`plan_copies` takes)."""
        return self._of(offset)[1]

    def _of(self, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (offset, self._fmt)
        table = self._table
        views = table.get(key)
        if views is None:
            if len(table) >= self.limit:  # the oldest goes (one at a time: no stall on the loop)
                del table[next(iter(table))]
            raw = self._view(offset, self.nbytes)
            views = table[key] = (raw, self.layout.chunk_rows_view(raw, self.chunk_size))
        return views

    def clear(self) -> None:
        """Forget every view of the table (those of the SlotViews that share it too)."""
        self._table.clear()


@functools.lru_cache(maxsize=64)
def _run_offsets(offsets: tuple[int, ...]) -> torch.Tensor:
    """``offsets`` as an int64 tensor shaped ``[1, runs, 1]`` (read only: shared by every plan)."""
    import torch

    return torch.tensor(offsets, dtype=torch.int64).view(1, -1, 1)


def check_lease_id(lease_id: object) -> int:
    """A lease id as :meth:`kvxfer.CacheClient.lookup_and_lease` hands them out (0: none); a
    ConfigError names anything else."""
    if isinstance(lease_id, bool) or not isinstance(lease_id, numbers.Integral) or not 0 <= int(lease_id) < 1 << 63:
        raise ConfigError(f"lease_id must be 0 (no lease) or a lease id from lookup_and_lease, got {lease_id!r}")
    return int(lease_id)


def check_transfer(
    layout: KVLayout,
    chunk_size: int,
    n_keys: int,
    block_ids: Sequence[int] | torch.Tensor | msgspec.Raw,
    skip_first_n_tokens: int = 0,
) -> torch.Tensor:
    """Validate a transfer's block ids; returns them as an int64 CPU tensor of their own (never
    a view of ``block_ids``, which the caller may change once this returns). The server passes
    them as the wire's MessagePack (``Raw``): their count is read from the array's header, and
    they are decoded only if it is right.

    Raises :class:`ConfigError` (client side) naming what is wrong: block count, range, skip.
    """
    import torch

    bpc = layout.blocks_per_chunk(chunk_size)
    if n_keys > MAX_CHUNKS_PER_REQUEST:
        raise ConfigError(f"{n_keys} chunks in one request; at most {MAX_CHUNKS_PER_REQUEST}")
    need = n_keys * bpc

    def check_count(got: int) -> None:
        if got != need:
            raise ConfigError(f"{n_keys} chunks of {chunk_size} tokens need {need} block ids "
                              f"({bpc} per chunk at block_size {layout.block_size}), got {got}")

    lo_hi: tuple[int, int] | None = None
    try:
        if isinstance(block_ids, msgspec.Raw):
            check_count(codec.array_length(block_ids))
            block_ids = codec.decode(block_ids, list[int])
        if isinstance(block_ids, (list, tuple, range)):  # as decoded from the wire: counted first, then
            check_count(len(block_ids))  # checked and converted in a few C loops (a lone request waits on this)
            packed = array.array("q", block_ids)
            blocks = torch.frombuffer(packed, dtype=torch.int64) if packed else torch.empty(0, dtype=torch.int64)
            lo_hi = (min(packed), max(packed)) if packed else None
        else:
            blocks = torch.as_tensor(block_ids, device="cpu")
            if blocks.is_floating_point() or blocks.is_complex():
                raise TypeError(f"got {blocks.dtype}")
            if blocks.dtype == torch.uint64:  # int64 would wrap values past 2**63 - 1 (and name them so)
                wide = max(blocks.reshape(-1).tolist(), default=0)
                if wide >= layout.num_blocks:
                    raise ConfigError(f"block ids must be in [0, {layout.num_blocks}); got max {wide}")
            # a copy whatever the dtype, unless one was made already (from another device): the
            # caller may reuse its buffer (an engine's block table) once the submit returns
            shares = not isinstance(block_ids, torch.Tensor) or block_ids.device.type == "cpu"
            blocks = blocks.to(torch.int64, copy=shares).reshape(-1)
    except ConfigError:  # (a ValueError) the count or the range: said as it is
        raise
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise ConfigError(f"block_ids must be a sequence of integers: {exc}") from None
    check_count(blocks.numel())
    if lo_hi is None and blocks.numel():
        lo, hi = torch.aminmax(blocks)
        lo_hi = (int(lo), int(hi))
    if lo_hi is not None and (lo_hi[0] < 0 or lo_hi[1] >= layout.num_blocks):
        raise ConfigError(f"block ids must be in [0, {layout.num_blocks}); got min {lo_hi[0]}, max {lo_hi[1]}")
    if isinstance(skip_first_n_tokens, bool) or not isinstance(skip_first_n_tokens, numbers.Integral):
        raise ConfigError(f"skip_first_n_tokens must be an integer number of tokens, got {skip_first_n_tokens!r}")
    if skip_first_n_tokens < 0 or skip_first_n_tokens % layout.block_size:
        raise ConfigError(
            f"skip_first_n_tokens must be a non-negative multiple of the block size "
            f"{layout.block_size}, got {skip_first_n_tokens}"
        )
    return blocks


@dataclass(frozen=True, slots=True)
class ChunkRows:
    """Every chunk's row ids of a request (:func:`chunk_rows`): ``all`` as ``[chunks, runs,
    blocks_per_chunk]`` (run-major inside a chunk, as the slot) and ``flat``, one row tensor per
    chunk (views of ``all``)."""

    all: torch.Tensor
    flat: tuple[torch.Tensor, ...]


def chunk_rows(layout: KVLayout, chunk_size: int, blocks: torch.Tensor) -> ChunkRows:
    """The row ids of every chunk of a request (``blocks``: int64, as :func:`check_transfer`
    returns them), in one vectorized step. It needs no slot: a client-driven request computes it
    while its reserve is in flight, and :func:`plan_copies` pairs it with the slots."""
    bpc = layout.blocks_per_chunk(chunk_size)
    n_chunks = blocks.numel() // bpc
    per_chunk = blocks.view(n_chunks, 1, bpc)
    if layout.block_stride != 1:
        per_chunk = per_chunk * layout.block_stride
    all_rows = per_chunk + _run_offsets(layout.run_offsets)  # a new contiguous tensor
    return ChunkRows(all_rows, all_rows.view(n_chunks, -1).unbind(0))  # the views in one call


def plan_copies(
    layout: KVLayout,
    chunk_size: int,
    blocks: torch.Tensor,
    slots: Sequence[tuple[int, torch.Tensor]],
    skip_blocks: int = 0,
    stamps: Sequence[int] = (),
    rows: ChunkRows | None = None,
) -> list[RowCopy]:
    """RowCopies for ``slots`` (``(chunk index, the slot as [num_layers, rows, row_elems]``: see
    :meth:`SlotViews.rows`), skipping the first ``skip_blocks`` blocks of the request (``blocks``:
    int64, as :func:`check_transfer` returns them). A chunk with a partial skip gives one copy per run
    (the slot rows it needs are not contiguous across runs); fully skipped chunks none.
    ``stamps`` (one per slot, or none): the :attr:`RowCopy.stamp` of each whole-chunk copy.
    ``rows``: :func:`chunk_rows` of the same ``blocks``, when computed already."""
    if not slots:
        return []
    bpc = layout.blocks_per_chunk(chunk_size)
    if rows is None:
        rows = chunk_rows(layout, chunk_size, blocks)
    all_rows, flat = rows.all, rows.flat
    copies = []
    for n, (index, view) in enumerate(slots):
        if view.dim() != 3:
            raise TypeError(f"plan_copies takes each slot as [num_layers, rows, row_elems] (SlotViews.rows), "
                            f"got shape {list(view.shape)}")
        local_skip = min(bpc, max(0, skip_blocks - index * bpc))
        if local_skip == bpc:
            continue
        if local_skip == 0:
            copies.append(RowCopy(flat[index], view, 0, stamps[n] if stamps else 0))
            continue
        per_run = view.view(layout.num_layers, layout.runs, bpc, layout.row_elems)
        for r in range(layout.runs):
            copies.append(RowCopy(all_rows[index, r, local_skip:], per_run[:, r, local_skip:]))
    return copies


def layer_slice(copies: Sequence[RowCopy], first: int, stop: int) -> list[RowCopy]:
    """``copies`` narrowed to layers ``[first, stop)`` (views of the same slots; no stamps: each
    moves part of its chunk)."""
    return [RowCopy(c.rows, c.slot[first - c.first_layer:stop - c.first_layer], first) for c in copies]


def host_copy_threads() -> int:
    """The default threads per host copy: 1 on hosts of at most :data:`SMALL_HOST_CPUS` CPUs
    (another thread there takes a core the engine or the server needs), else torch's intra-op
    count of the calling thread."""
    if (os.cpu_count() or 1) <= SMALL_HOST_CPUS:
        return 1
    import torch

    return torch.get_num_threads()


class HostRows:
    """Copies between KV tensors in host memory and arena slots: each :class:`RowCopy`'s rows of
    its layers in one call of the C row copy (``kvxfer._rowcopy``), without the GIL, on the
    calling thread and up to ``threads - 1`` more (at least 4 MiB of the copy each).

    Its stores stream past the caches (AVX, else SSE2, non-temporal stores, picked at import;
    memcpy elsewhere): a chunk is larger than the caches, and a cached store first reads each
    line it writes. On a 2-core VM it gathers 32 KiB rows at 1.1-1.3x the speed of torch's own
    memcpy of the same bytes, where ``index_select`` ran at 0.8x (docs/performance.md, "Host
    copies in C").

    ``rows``: every layer's row view (:meth:`KVLayout.row_view`: ``[span_rows, row_elems]``, rows
    ``row_pitch`` apart, which may overlap in the view; alike for every layer), host tensors, kept
    alive by this object. Every copy is checked against them before the C code sees an address
    (:meth:`copy`).
    """

    def __init__(self, rows: Sequence[torch.Tensor], threads: int | None = None) -> None:
        import torch

        try:
            from kvxfer import _rowcopy
        except ImportError as exc:
            raise ImportError(
                f"kvxfer's C row copy (kvxfer._rowcopy) is not built in {Path(__file__).parent}: install kvxfer "
                "with pip (`pip install .`, or `bash scripts/setup.sh` in a checkout; a C compiler is needed to "
                "build it from source) rather than running it from an unbuilt source tree") from exc
        first = rows[0]
        size = first.element_size()
        shape, stride = tuple(first.shape), first.stride()
        for r in rows:
            if (r.device.type != "cpu" or r.dim() != 2 or tuple(r.shape) != shape or r.stride() != stride
                    or r.element_size() != size or stride[1] != 1):
                raise ValueError(f"HostRows needs every layer as host rows of one shape and pitch, dense in the "
                                 f"row: got {r.device.type} {tuple(r.shape)} strides {r.stride()} against "
                                 f"{shape} strides {stride}")
        self._copy = _rowcopy.copy_rows
        #: The copy kernel in use (``"avx-stream"``, ``"sse2-stream"`` or ``"memcpy"``).
        self.kernel = _rowcopy.kernel()
        self.threads = threads if threads is not None else host_copy_threads()
        if self.threads < 1:
            raise ValueError(f"HostRows needs at least one thread, got {self.threads}")
        self._layers = len(rows)
        self._rows = list(rows)  # the memory the addresses below point into, kept alive
        #: Each distinct storage of the layers, with its address and size when registered: a
        #: storage freed (``resize_(0)``) or moved (a ``resize_`` that grew it) since is refused
        #: before the C code sees an address into it.
        storages: dict[int, tuple[torch.UntypedStorage, int, int]] = {}
        for r in rows:
            st = r.untyped_storage()
            storages.setdefault(st.data_ptr(), (st, st.data_ptr(), st.nbytes()))
        self._storages = list(storages.values())
        self._layer_ptrs = torch.tensor([r.data_ptr() for r in rows], dtype=torch.int64)
        #: Rows per layer, bytes from one row to the next, bytes of a row.
        self.span_rows, self.row_pitch, self.row_bytes = shape[0], stride[0] * size, shape[1] * size

    def copy(self, copies: Sequence[RowCopy], to_slot: bool) -> None:
        """Each copy's rows of its layers into its slot (``to_slot``: a store's gather) or out of
        it (a retrieve's scatter). A copy unlike those the core makes (host tensors; ``slot``
        ``[n, len(rows), row]`` with dense, non-overlapping rows and layers; int64 ``rows`` of
        ``[0, span_rows)``; layers within these) is a ValueError or IndexError, with nothing of
        it copied (copies before it in ``copies`` are). A scatter whose rows name one row twice
        runs on one thread: the row ends as its last write in ``rows`` left it. Layers whose
        memory was freed or moved since (:meth:`torch.UntypedStorage.resize_`) are a ConfigError,
        with nothing copied."""
        import torch

        for st, ptr, nbytes in self._storages:
            if st.data_ptr() != ptr or st.nbytes() != nbytes:
                raise ConfigError(f"the KV cache's memory was freed or moved after it was registered (a storage of "
                                  f"{nbytes} bytes at {ptr:#x} is now {st.nbytes()} bytes at {st.data_ptr():#x}): "
                                  "close the transfer context before freeing or resizing the KV cache, then "
                                  "register it again")
        layers = self._layer_ptrs.data_ptr()
        row_bytes = self.row_bytes
        for c in copies:
            slot, rows = c.slot, c.rows.contiguous()
            size = slot.element_size()
            if not (slot.dim() == 3 and rows.dim() == 1 and slot.device.type == "cpu" and rows.device.type == "cpu"
                    and rows.dtype == torch.int64 and c.first_layer >= 0
                    and c.first_layer + slot.shape[0] <= self._layers and slot.shape[1] == rows.numel()
                    and slot.shape[2] * size == row_bytes and slot.stride(2) == 1
                    and slot.stride(1) * size >= row_bytes
                    and slot.stride(0) * size >= max(slot.shape[1], 1) * slot.stride(1) * size):
                raise ValueError(f"a copy of {slot.shape[0] if slot.dim() else 0} layers from layer {c.first_layer} "
                                 f"with a {slot.device.type} slot {tuple(slot.shape)} (strides {slot.stride()}) "
                                 f"and {rows.numel()} {rows.dtype} rows on {rows.device.type} does not fit "
                                 f"{self._layers} layers of {row_bytes}-byte rows")
            if slot.numel() == 0:
                continue
            self._copy(to_slot, slot.data_ptr(), layers + 8 * c.first_layer, slot.shape[0], self.span_rows,
                       self.row_pitch, row_bytes, slot.stride(0) * size, slot.stride(1) * size, rows.data_ptr(),
                       rows.numel(), self.threads)
