"""KVLayout: how an engine's paged KV cache is laid out in memory, and how a chunk of it sits in
the server.

Per-layer tensors kvxfer understands (the logical axes; any strides)::

    bhnc         [num_blocks, heads, block_size, content]             current vLLM (every KVCacheLayout)
    flash_attn   [2, num_blocks, block_size, heads, head_size]        older vLLM: K and V planes
    flashinfer   [num_blocks, 2, block_size, heads, head_size]        older vLLM: K and V per block
    mla          [num_blocks, block_size, latent_dim]                 older vLLM: MLA

``content`` is K and V side by side (``2 * head_size``) or, for MLA, the latent vector (then
``heads`` is 1). The memory order is read from the tensors' strides, never guessed from shapes:
current vLLM builds each layer with ``torch.as_strided`` over one buffer, following one of its
``KVCacheLayout``\\ s (``LBHNC``, ``LBNHC``, ``LHBNC``, ``BLHNC``, ``BLNHC``, ``BHLNC``), so a
layer may be strided, several layers may interleave in one buffer, and pages may be padded.
The ``block_size`` dimension may be a *kernel* block that subdivides vLLM's block (its
``kernel_block_size``): then ``block_size / size`` consecutive kernel blocks make one block.

**Runs and the row view.** One block's page in one layer is a set of *runs*: maximal spans
of contiguous memory (the innermost dense dimensions of the page; the K/V plane of the older
5-D layouts is never merged into a run, so those keep one run per plane). For every such
layout the start of each run lies on a lattice: with the layer's first element as its base, run
``r`` of block ``b`` starts ``(run_offsets[r] + b * block_stride) * row_pitch`` elements in.
So a layer is seen as a 2-D *row view* ``as_strided(layer, [span_rows, row_elems],
[row_pitch, 1], layer.storage_offset())`` (a view: no copy), and :meth:`KVLayout.rows` maps
block ids to row ids. A gather copies each chunk's rows of every layer (``index_select`` per
layer on a device, :class:`kvxfer.copies.HostRows` on the host), whatever the layout; a scatter
the reverse. Rows may overlap in the view when
``row_pitch < row_elems`` (padded, interleaved layouts); the rows a block's runs name never do.

**Chunks.** The server keeps a chunk of ``chunk_size`` tokens as ``[num_layers, runs,
blocks_per_chunk, row_elems]`` contiguous (runs-major), the same for every transport, so a
chunk stored through one transport can be retrieved through another. :meth:`KVLayout.chunk_format`
includes the page's memory order (:attr:`KVLayout.page`), so caches whose page bytes are
ordered differently (``LBHNC`` vs ``LBNHC``, K/V planes vs side by side) never share chunks,
while layouts that differ only in where pages sit (``LBHNC`` vs ``BLHNC``) do.
"""

from __future__ import annotations

import bisect
import enum
import functools
import itertools
import math
import re
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from kvxfer.errors import LayoutError

if TYPE_CHECKING:  # torch is imported where tensors are handled: importing this module needs none
    import torch

__all__ = [
    "LayoutKind",
    "KVLayout",
    "dtype_from_name",
    "dtype_name",
    "as_layer_list",
    "copy_view",
    "copy_dtype",
    "MAX_RUNS",
    "MAX_LAYERS",
]


class LayoutKind(str, enum.Enum):
    """The logical axes of a per-layer KV tensor (see the module docstring)."""

    BHNC = "bhnc"
    FLASH_ATTN = "flash_attn"
    FLASHINFER = "flashinfer"
    MLA = "mla"


#: Axis letters of each kind: B block, P K/V plane, N token, H head, D head dim, C content
#: (K and V side by side, or an MLA latent). Derived: S, kernel blocks inside a block.
_AXES: Final[dict[LayoutKind, str]] = {
    LayoutKind.BHNC: "BHNC",
    LayoutKind.FLASH_ATTN: "PBNHD",
    LayoutKind.FLASHINFER: "BPNHD",
    LayoutKind.MLA: "BNC",
}
_SHAPES: Final[dict[LayoutKind, str]] = {
    LayoutKind.BHNC: "[num_blocks, heads, block_size, content]",
    LayoutKind.FLASH_ATTN: "[2, num_blocks, block_size, heads, head_size]",
    LayoutKind.FLASHINFER: "[num_blocks, 2, block_size, heads, head_size]",
    LayoutKind.MLA: "[num_blocks, block_size, latent_dim]",
}
_SUPPORTED: Final = "; ".join(f"{k.value} {s}" for k, s in _SHAPES.items())

#: Most runs one block's page may have in one layer (a bound for what a registration names).
MAX_RUNS: Final = 4096
#: Most layers one registration may name (the largest models have a few hundred): a bound for
#: what a server keeps per registration, per layer.
MAX_LAYERS: Final = 4096



#: The dtypes a KV cache may have, by name, and their sizes in bytes (what chunk formats name).
DTYPE_SIZES: Final = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1,
                      "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "int8": 1, "uint8": 1}


@functools.cache
def _dtypes() -> dict[str, torch.dtype]:
    """The dtypes of :data:`DTYPE_SIZES` this torch has. Byte-wise copies only: any dtype of
    these sizes round-trips."""
    import torch

    return {name: getattr(torch, name) for name in DTYPE_SIZES if hasattr(torch, name)}

_PAGE_DIM: Final = re.compile(r"([A-Z])([1-9][0-9]{0,9})")


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``"bfloat16"`` or ``"torch.bfloat16"``)."""
    key = name.removeprefix("torch.")
    dtypes = _dtypes()
    try:
        return dtypes[key]
    except KeyError:
        raise LayoutError(
            f"unsupported KV cache dtype {name!r}; supported: {', '.join(sorted(dtypes))}"
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    dtype_from_name(name)
    return name


def as_layer_list(kv_caches: Sequence[torch.Tensor] | Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """Per-layer tensors in layer order, from a list or a dict (vLLM's ``{layer_name: tensor}``,
    whose insertion order is layer order)."""
    import torch

    layers = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else list(kv_caches)
    if not layers:
        raise LayoutError("kv_caches is empty: pass one tensor per layer")
    for i, t in enumerate(layers):
        if not isinstance(t, torch.Tensor):
            raise LayoutError(f"kv_caches[{i}] is a {type(t).__name__}, not a torch.Tensor")
    return layers


@functools.cache
def _copy_dtypes() -> tuple[tuple[int, torch.dtype], ...]:
    """Element types for row copies by size, widest first: scatter/gather kernels run near
    memcpy speed on 16-byte elements and far below it on 2-byte ones (measured: bf16 index_put_
    0.38x memcpy, complex128 1.0x)."""
    import torch

    return ((16, torch.complex128), (8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _fits(t: torch.Tensor, size: int) -> bool:
    """Whether ``t`` (dense in its last dim) can be reinterpreted with ``size``-byte elements."""
    item = t.element_size()
    if item > size or (t.shape[-1] * item) % size or (t.storage_offset() * item) % size:
        return False
    return all((s * item) % size == 0 for n, s in zip(t.shape[:-1], t.stride()[:-1]) if n > 1)


def copy_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype:
    """The widest element type every one of ``tensors`` (each dense in its last dim) can be
    reinterpreted with by :func:`copy_view`: its last dimension's bytes, its other strides and
    its storage offset are multiples of the element size. Use one for both sides of a copy.
    One of ``complex128``, ``int64``, ``int32``, ``int16``, ``uint8`` (16 to 1 bytes): each has a
    numpy equivalent, whatever the KV dtype (bf16 and fp8 have none)."""
    ts = list(tensors)
    for size, dt in _copy_dtypes():
        if all(_fits(t, size) for t in ts):
            return dt
    return _copy_dtypes()[-1][1]  # bytes


def copy_view(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` (dense in its last dim) reinterpreted with element type ``dtype`` (default: the
    widest that fits ``t``, :func:`copy_dtype`). For byte copies only: never compute on the result."""
    return t.view(dtype if dtype is not None else copy_dtype([t]))


@dataclass(frozen=True, slots=True)
class _Dim:
    axis: str
    size: int
    stride: int


@dataclass(frozen=True, slots=True)
class _Geometry:
    num_blocks: int
    hidden_dim_size: int
    row_elems: int
    row_pitch: int
    run_offsets: tuple[int, ...]
    block_stride: int
    page: str


def _geometry(shape: Sequence[int], strides: Sequence[int], kind: LayoutKind, block_size: int) -> _Geometry:
    """Runs, row pitch and page order of one layer of ``kind`` with these shape and strides
    (in elements). Raises :class:`LayoutError` saying what does not fit."""
    axes = _AXES[kind]
    where = f"per-layer shape {list(shape)} with strides {list(strides)} ({kind.value} {_SHAPES[kind]})"
    if len(shape) != len(axes):
        raise LayoutError(f"{where}: a {kind.value} layer has {len(axes)} dimensions")
    dims = {a: _Dim(a, int(n), int(s)) for a, n, s in zip(axes, shape, strides)}
    if "P" in dims and dims["P"].size != 2:
        raise LayoutError(f"{where}: the K/V dimension must have size 2")
    tokens = dims["N"].size
    if kind is not LayoutKind.BHNC and tokens != block_size:  # no kernel blocks before bhnc
        raise LayoutError(f"{where}: its block_size dimension is {tokens}, not block_size={block_size} "
                          "(pass the engine's block size)")
    if tokens <= 0 or block_size % tokens:
        raise LayoutError(f"{where}: its block_size dimension ({tokens}) does not divide block_size={block_size} "
                          "(pass the engine's block size)")
    ratio = block_size // tokens
    blocks = dims.pop("B")
    if blocks.size <= 0 or blocks.size % ratio:
        raise LayoutError(f"{where}: {blocks.size} kernel blocks of {tokens} tokens do not make whole blocks "
                          f"of {block_size}")
    num_blocks = blocks.size // ratio
    inner = [d for d in dims.values() if d.size > 1]
    if ratio > 1:
        inner.append(_Dim("S", ratio, blocks.stride))
    if any(d.stride <= 0 for d in inner) or (num_blocks > 1 and blocks.stride <= 0):
        raise LayoutError(f"{where}: strides must be positive")
    last = dims[axes[-1]]
    if last.size > 1 and last.stride != 1:
        raise LayoutError(f"{where}: the last dimension must be dense (stride 1)")
    # the run: the innermost dimensions, each exactly as long a stride as everything inside it
    run, content = 1, list[_Dim]()
    rest = sorted(inner, key=lambda d: d.stride)
    while rest and rest[0].axis != "P" and rest[0].stride == run:
        d = rest.pop(0)
        content.insert(0, d)
        run *= d.size
    # the same bytes get the same name: kernel blocks laid end to end are one longer block, and
    # heads next to their contents are one wider token
    for outer_axis, inner_axes in (("S", "N"), ("H", "CD")):
        for i in range(len(content) - 1):
            if content[i].axis == outer_axis and content[i + 1].axis in inner_axes:
                merged = _Dim(content[i + 1].axis, content[i].size * content[i + 1].size, content[i + 1].stride)
                content[i:i + 2] = [merged]
                break
    outer = sorted(rest, key=lambda d: -d.stride)  # the runs' dimensions, outermost first
    # pages of different blocks, and runs of one page, must not overlap
    extent = run
    lattice = [*rest, _Dim("B", num_blocks, blocks.stride * ratio)]
    for d in sorted(lattice, key=lambda d: d.stride):
        if d.size <= 1:
            continue
        if d.stride < extent:
            raise LayoutError(f"{where}: its blocks' pages overlap in memory (a {d.axis} stride of {d.stride} "
                              f"inside a span of {extent} elements); pass the engine's own KV tensors")
        extent += d.stride * (d.size - 1)
    block_stride = blocks.stride * ratio
    pitch = 0
    for d in lattice:
        if d.size > 1:
            pitch = math.gcd(pitch, d.stride)
    pitch = pitch or run
    offsets = tuple(
        sum(i * d.stride for i, d in zip(index, outer)) // pitch
        for index in itertools.product(*(range(d.size) for d in outer))
    )
    if len(offsets) > MAX_RUNS:
        raise LayoutError(f"{where}: {len(offsets)} separate runs per page; at most {MAX_RUNS}")
    planes = dims["P"].size if "P" in dims else 1
    page = ",".join(f"{d.axis}{d.size}" for d in outer) + "|" + ",".join(f"{d.axis}{d.size}" for d in content)
    # one block: its stride names no memory (it may even be less than a page); any that keeps
    # the page's rows apart will do
    stride_rows = block_stride // pitch if num_blocks > 1 else max(1, block_stride // pitch, -(-extent // pitch))
    return _Geometry(num_blocks, len(offsets) * run // (planes * block_size), run, pitch, offsets, stride_rows, page)


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides, step = list[int](), 1
    for n in reversed(shape):
        strides.insert(0, step)
        step *= n
    return strides


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The scalar description of one registered paged KV cache (all layers alike).

    ``KVLayout(kind, num_layers, num_blocks, block_size, hidden_dim_size, dtype)`` describes
    contiguous tensors of an older kind (flash_attn, flashinfer, mla); :meth:`infer` reads any
    layout from the tensors themselves. The geometry fields (row_elems and after) are what the
    registration carries; a ``bhnc`` layout must give them.
    """

    kind: LayoutKind
    num_layers: int
    num_blocks: int
    block_size: int
    #: Elements per token of one layer and one K/V plane (heads * head_size); for bhnc, of the
    #: whole page (heads * content); MLA: the latent dim.
    hidden_dim_size: int
    dtype: torch.dtype
    #: Elements of one run (one row of the row view).
    row_elems: int = 0
    #: Elements between consecutive rows of a layer's row view.
    row_pitch: int = 0
    #: Row ids of block 0's runs, in the order runs take in a chunk.
    run_offsets: tuple[int, ...] = ()
    #: Rows between block ``b`` and block ``b + 1``.
    block_stride: int = 0
    #: The page's memory order: the runs' dimensions, outermost first, ``|``, each run's
    #: dimensions, e.g. ``"H8|N16,C256"`` (axis letter and size).
    page: str = ""
    _span: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", LayoutKind(self.kind))
        for name in ("num_layers", "num_blocks", "block_size", "hidden_dim_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")
        if self.num_layers > MAX_LAYERS:
            raise LayoutError(f"num_layers is {self.num_layers}; kvxfer takes at most {MAX_LAYERS} layers")
        object.__setattr__(self, "run_offsets", tuple(self.run_offsets))
        given = bool(self.row_elems or self.row_pitch or self.run_offsets or self.block_stride or self.page)
        if not given and self.kind is not LayoutKind.BHNC:  # contiguous tensors of an older kind
            derived = self._legacy_geometry()
            for name in ("row_elems", "row_pitch", "run_offsets", "block_stride", "page"):
                object.__setattr__(self, name, getattr(derived, name))
        elif not given:
            raise LayoutError("a bhnc layout needs its geometry (row_elems, row_pitch, run_offsets, "
                              "block_stride, page): build it with KVLayout.infer(tensors, block_size)")
        self._check_geometry()
        object.__setattr__(self, "_span", max(self.run_offsets) + (self.num_blocks - 1) * self.block_stride + 1)

    def _legacy_geometry(self) -> _Geometry:
        shape = self.layer_shape()
        return _geometry(shape, _contiguous_strides(shape), self.kind, self.block_size)

    def _check_geometry(self) -> None:
        for name in ("row_elems", "row_pitch", "block_stride"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")
        offsets = self.run_offsets
        if not offsets or len(offsets) > MAX_RUNS:
            raise LayoutError(f"run_offsets must name 1 to {MAX_RUNS} runs, got {len(offsets)}")
        if (any(not isinstance(o, int) or isinstance(o, bool) or o < 0 for o in offsets)
                or len(set(offsets)) != len(offsets)):
            raise LayoutError(f"run_offsets must be distinct non-negative integers, got {list(offsets)[:16]}")
        if not isinstance(self.page, str) or len(self.page) > 256 or self.page.count("|") != 1:
            raise LayoutError(f"page must be '<run dims>|<row dims>' (e.g. 'H8|N16,C256'), got {self.page!r}")
        sizes = []
        for part in self.page.split("|"):
            dims = part.split(",") if part else []
            if not all(_PAGE_DIM.fullmatch(d) for d in dims):
                raise LayoutError(f"page: each dimension is an axis letter and a size (e.g. 'N16'), got {self.page!r}")
            sizes.append(math.prod(int(d[1:]) for d in dims))
        if sizes != [len(offsets), self.row_elems]:
            raise LayoutError(f"page {self.page!r} describes {sizes[0]} runs of {sizes[1]} elements, but the layout "
                              f"has {len(offsets)} runs of {self.row_elems}")
        planes = 2 if self.kind in (LayoutKind.FLASH_ATTN, LayoutKind.FLASHINFER) else 1
        if len(offsets) * self.row_elems != planes * self.block_size * self.hidden_dim_size:
            raise LayoutError(f"{len(offsets)} runs of {self.row_elems} elements are not a page of {self.block_size} "
                              f"tokens x {self.hidden_dim_size} elements")
        self._check_disjoint()

    def _check_disjoint(self) -> None:
        """No two runs of the cache share memory (a registration from the wire says what
        :meth:`infer` would have checked on tensors). Run ``o`` of block ``b`` is row
        ``x = o + b * block_stride`` of the row view, elements ``[x * row_pitch, + row_elems)``;
        rows closer than ``k = ceil(row_elems / row_pitch)`` overlap. Each offset is a residue
        ``r`` and a quotient ``q`` modulo the stride: two offsets whose residues are less than
        ``k`` apart (on the circle of the stride) overlap exactly when their blocks' quotient
        ranges ``[q, q + num_blocks)`` meet. Swept in residue order (about 8 ms on a 2-core VM
        for MAX_RUNS runs packed close, far less for real layouts)."""
        stride, blocks = self.block_stride, self.num_blocks
        k = -(-self.row_elems // self.row_pitch)
        if blocks == 1:
            stride = max(stride, k)  # one block: its stride names no memory, and the sweep needs >= k
        elif stride < k:
            raise LayoutError(f"block_stride {stride} rows is less than a run ({self.row_elems} elements at a "
                              f"row_pitch of {self.row_pitch}): consecutive blocks would overlap")
        items = sorted((o % stride, o // stride) for o in self.run_offsets)
        # a run near the stride's end meets runs at its start one block later: the same rows as
        # residue r + stride, quotient q - 1
        items += [(r + stride, q - 1) for r, q in items if r < k]
        window: deque[tuple[int, int]] = deque()  # (residue, quotient), residues within k of the newest
        quotients: list[int] = []  # the window's quotients, sorted: pairwise at least blocks apart
        for r, q in items:
            while window and window[0][0] <= r - k:
                quotients.pop(bisect.bisect_left(quotients, window.popleft()[1]))
            i = bisect.bisect_left(quotients, q)
            if (i < len(quotients) and quotients[i] - q < blocks) or (i > 0 and q - quotients[i - 1] < blocks):
                raise LayoutError(f"run_offsets {list(self.run_offsets)[:16]} with block_stride {stride}, "
                                  f"{blocks} blocks and rows of {self.row_elems} elements {self.row_pitch} apart "
                                  "make two runs share memory")
            quotients.insert(i, q)
            window.append((r, q))

    # ------------------------------------------------------------------ derived sizes

    @property
    def use_mla(self) -> bool:
        """Older 3-D MLA tensors (a bhnc MLA cache is a bhnc layout with one head)."""
        return self.kind is LayoutKind.MLA

    @property
    def runs(self) -> int:
        """Runs per block in one layer (the older 5-D kinds: the K and V planes)."""
        return len(self.run_offsets)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        return self.row_elems * self.itemsize

    @property
    def span_rows(self) -> int:
        """Rows in a layer's row view."""
        return self._span

    def blocks_per_chunk(self, chunk_size: int) -> int:
        if chunk_size <= 0 or chunk_size % self.block_size:
            raise LayoutError(
                f"chunk_size {chunk_size} is not a positive multiple of block_size "
                f"{self.block_size}; start the server with --chunk-size a multiple of it"
            )
        return chunk_size // self.block_size

    def chunk_shape(self, chunk_size: int) -> tuple[int, int, int, int]:
        """Shape of one chunk in the arena: ``[num_layers, runs, blocks_per_chunk, row_elems]``."""
        return (self.num_layers, self.runs, self.blocks_per_chunk(chunk_size), self.row_elems)

    def chunk_bytes(self, chunk_size: int) -> int:
        return math.prod(self.chunk_shape(chunk_size)) * self.itemsize

    def chunk_format(self, chunk_size: int) -> str:
        """A string that two layouts share iff their chunks are interchangeable in the arena:
        dtype, chunk shape and the page's memory order."""
        layers, runs, blocks, row = self.chunk_shape(chunk_size)
        return f"{dtype_name(self.dtype)}:{layers}x{runs}x{blocks}x{row}:{self.page}"

    def layer_shape(self, num_heads: int | None = None) -> tuple[int, ...]:
        """The per-layer tensor shape of an older kind (heads folded unless ``num_heads`` given)."""
        tail: tuple[int, ...] = (self.hidden_dim_size,)
        if num_heads is not None and self.kind in (LayoutKind.FLASH_ATTN, LayoutKind.FLASHINFER):
            if self.hidden_dim_size % num_heads:
                raise LayoutError(f"hidden_dim_size {self.hidden_dim_size} not divisible by {num_heads} heads")
            tail = (num_heads, self.hidden_dim_size // num_heads)
        if self.kind is LayoutKind.FLASH_ATTN:
            return (2, self.num_blocks, self.block_size, *(tail if len(tail) == 2 else (1, *tail)))
        if self.kind is LayoutKind.FLASHINFER:
            return (self.num_blocks, 2, self.block_size, *(tail if len(tail) == 2 else (1, *tail)))
        if self.kind is LayoutKind.MLA:
            return (self.num_blocks, self.block_size, self.hidden_dim_size)
        raise LayoutError("a bhnc layout's tensors come from the engine (vLLM's create_kv_cache_views); "
                          "kvxfer does not make them")

    # ------------------------------------------------------------------ row view

    def rows(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Row ids (int64, on ``block_ids``' device) of ``block_ids`` in chunk order: run 0 of
        every block in order, then run 1, ..."""
        import torch

        b = block_ids.to(torch.int64).reshape(1, -1)
        runs = torch.tensor(self.run_offsets, dtype=torch.int64, device=b.device).reshape(-1, 1)
        return (runs + b * self.block_stride).reshape(-1)

    def row_view(self, layer: torch.Tensor) -> torch.Tensor:
        """One layer's tensor as ``[span_rows, row_elems]`` rows ``row_pitch`` apart (a view of
        its memory; no copy). ``layer`` must be a layer of this layout (:meth:`check_tensors`)."""
        return layer.as_strided((self.span_rows, self.row_elems), (self.row_pitch, 1), layer.storage_offset())

    def chunk_rows_view(self, slot: torch.Tensor, chunk_size: int) -> torch.Tensor:
        """An arena slot (uint8, ``chunk_bytes`` long) as ``[num_layers, rows, row_elems]`` of
        this layout's dtype; row ``r * blocks_per_chunk + i`` is run ``r`` of block ``i``."""
        layers, runs, blocks, row = self.chunk_shape(chunk_size)
        return slot.view(self.dtype).view(layers, runs * blocks, row)

    # ------------------------------------------------------------------ construction

    @classmethod
    def infer(
        cls,
        kv_caches: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
        block_size: int,
        kind: LayoutKind | str | None = None,
    ) -> KVLayout:
        """The layout of ``kv_caches`` (one tensor per layer) with blocks of ``block_size``
        tokens, read from their shapes and strides.

        4-D tensors are bhnc; ``kind`` settles the one ambiguous case of the older kinds (a
        flash_attn cache of exactly two blocks looks like a flashinfer one). Raises
        :class:`LayoutError` naming the offending layer, its shape and strides and what is supported.
        """
        layers = as_layer_list(kv_caches)
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
            raise LayoutError(f"block_size must be a positive integer, got {block_size!r}")
        first = layers[0]
        for i, t in enumerate(layers):
            if t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype \
                    or t.device != first.device:
                raise LayoutError(
                    f"layer {i} is {list(t.shape)} with strides {list(t.stride())}, {t.dtype} on {t.device}, but "
                    f"layer 0 is {list(first.shape)} with strides {list(first.stride())}, {first.dtype} on "
                    f"{first.device}; all layers of one registration must match (register each KV cache "
                    f"group, or each set of alike layers, separately)"
                )
        shape, strides = tuple(first.shape), tuple(first.stride())
        dtype_name(first.dtype)
        kind = LayoutKind(kind) if kind is not None else cls._guess_kind(shape, block_size)
        try:
            geo = _geometry(shape, strides, kind, block_size)
        except LayoutError as exc:
            raise LayoutError(f"layer 0: {exc}; supported: {_SUPPORTED}") from None
        return cls(kind, len(layers), geo.num_blocks, block_size, geo.hidden_dim_size, first.dtype,
                   geo.row_elems, geo.row_pitch, geo.run_offsets, geo.block_stride, geo.page)

    @staticmethod
    def _guess_kind(shape: tuple[int, ...], block_size: int) -> LayoutKind:
        if len(shape) == 4:
            return LayoutKind.BHNC
        if len(shape) == 3:
            return LayoutKind.MLA
        if len(shape) == 5:
            if shape[0] == 2:
                return LayoutKind.FLASH_ATTN
            if shape[1] == 2:
                return LayoutKind.FLASHINFER
        raise LayoutError(
            f"cannot infer a KV layout from per-layer shape {list(shape)} with block_size={block_size}; "
            f"supported: {_SUPPORTED}"
        )

    def check_tensors(self, layers: Sequence[torch.Tensor]) -> None:
        """Raise :class:`LayoutError` unless ``layers`` are tensors of exactly this layout."""
        if len(layers) != self.num_layers:
            raise LayoutError(f"expected {self.num_layers} layers, got {len(layers)}")
        other = KVLayout.infer(layers, self.block_size, self.kind)
        if other != self:
            raise LayoutError(f"KV tensors describe {other}, registration says {self}")
