"""KVLayout: how an engine's paged KV cache is shaped, and how a chunk of it sits in the server.

Supported per-layer shapes (vLLM's common layouts)::

    flash_attn   [2, num_blocks, block_size, num_heads, head_size]   K and V planes
    flashinfer   [num_blocks, 2, block_size, num_heads, head_size]   K and V per block
    mla          [num_blocks, block_size, latent_dim]                one plane (MLA)

Every layout is handled through one idea, the *row view*: a layer's tensor is seen as
``[rows, row_elems]`` where one row is one block of one plane (K or V), i.e.
``block_size * hidden_dim_size`` contiguous elements. :meth:`KVLayout.rows` maps block ids to
row ids in the server's canonical order, so a gather is one ``index_select`` per layer and a
scatter one ``index_put_`` per layer, whatever the layout.

The server keeps a chunk of ``chunk_size`` tokens as ``[num_layers, planes, chunk_size,
hidden_dim_size]`` contiguous (planes: K then V; MLA has one), the same for every transport,
so a chunk stored through one transport can be retrieved through another.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import torch

from kvxfer.errors import LayoutError

__all__ = ["LayoutKind", "KVLayout", "dtype_from_name", "dtype_name", "as_layer_list", "copy_view"]


class LayoutKind(str, enum.Enum):
    FLASH_ATTN = "flash_attn"
    FLASHINFER = "flashinfer"
    MLA = "mla"


#: dtypes a KV cache may have. Byte-wise copies only: any dtype of these sizes round-trips.
_DTYPES: Final[dict[str, torch.dtype]] = {
    name: getattr(torch, name)
    for name in (
        "float16", "bfloat16", "float32", "float64",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
        "int8", "uint8",
    )
    if hasattr(torch, name)
}


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``"bfloat16"`` or ``"torch.bfloat16"``)."""
    key = name.removeprefix("torch.")
    try:
        return _DTYPES[key]
    except KeyError:
        raise LayoutError(
            f"unsupported KV cache dtype {name!r}; supported: {', '.join(sorted(_DTYPES))}"
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    dtype_from_name(name)
    return name


def as_layer_list(kv_caches: Sequence[torch.Tensor] | Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """Per-layer tensors in layer order, from a list or a dict (vLLM's ``{layer_name: tensor}``,
    whose insertion order is layer order)."""
    layers = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else list(kv_caches)
    if not layers:
        raise LayoutError("kv_caches is empty: pass one tensor per layer")
    for i, t in enumerate(layers):
        if not isinstance(t, torch.Tensor):
            raise LayoutError(f"kv_caches[{i}] is a {type(t).__name__}, not a torch.Tensor")
    return layers


#: Widest element types first: scatter/gather kernels run near memcpy speed on 16-byte elements
#: and far below it on 2-byte ones (measured: bf16 index_put_ 0.38x memcpy, complex128 1.0x).
_COPY_DTYPES: Final = ((16, torch.complex128), (8, torch.int64), (4, torch.int32),
                       (2, torch.int16), (1, torch.uint8))


def copy_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous in its last dim) reinterpreted with the widest element type that divides
    its last dimension's bytes. For byte copies only: never compute on the result."""
    nbytes = t.shape[-1] * t.element_size()
    for size, dt in _COPY_DTYPES:
        if nbytes % size == 0 and t.element_size() <= size:
            return t.view(dt)
    return t.view(torch.uint8)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The scalar description of one registered paged KV cache (all layers alike)."""

    kind: LayoutKind
    num_layers: int
    num_blocks: int
    block_size: int
    #: Elements per token of one plane in one layer (heads * head_size; MLA: latent dim).
    hidden_dim_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_blocks", "block_size", "hidden_dim_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise LayoutError(f"{field} must be a positive integer, got {value!r}")
        object.__setattr__(self, "kind", LayoutKind(self.kind))

    # ------------------------------------------------------------------ derived sizes

    @property
    def use_mla(self) -> bool:
        return self.kind is LayoutKind.MLA

    @property
    def planes(self) -> int:
        """2 (K and V) or 1 (MLA)."""
        return 1 if self.use_mla else 2

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def row_elems(self) -> int:
        return self.block_size * self.hidden_dim_size

    @property
    def row_bytes(self) -> int:
        return self.row_elems * self.itemsize

    def blocks_per_chunk(self, chunk_size: int) -> int:
        if chunk_size <= 0 or chunk_size % self.block_size:
            raise LayoutError(
                f"chunk_size {chunk_size} is not a positive multiple of block_size "
                f"{self.block_size}; start the server with --chunk-size a multiple of it"
            )
        return chunk_size // self.block_size

    def chunk_shape(self, chunk_size: int) -> tuple[int, int, int, int]:
        """Shape of one chunk in the arena: ``[num_layers, planes, chunk_size, hidden]``."""
        self.blocks_per_chunk(chunk_size)
        return (self.num_layers, self.planes, chunk_size, self.hidden_dim_size)

    def chunk_bytes(self, chunk_size: int) -> int:
        n = 1
        for d in self.chunk_shape(chunk_size):
            n *= d
        return n * self.itemsize

    def chunk_format(self, chunk_size: int) -> str:
        """A string that two layouts share iff their chunks are interchangeable in the arena."""
        layers, planes, tokens, hidden = self.chunk_shape(chunk_size)
        return f"{dtype_name(self.dtype)}:{layers}x{planes}x{tokens}x{hidden}"

    def layer_shape(self, num_heads: int | None = None) -> tuple[int, ...]:
        """The engine's per-layer tensor shape (with heads folded unless ``num_heads`` given)."""
        tail: tuple[int, ...] = (self.hidden_dim_size,)
        if num_heads is not None and not self.use_mla:
            if self.hidden_dim_size % num_heads:
                raise LayoutError(f"hidden_dim_size {self.hidden_dim_size} not divisible by {num_heads} heads")
            tail = (num_heads, self.hidden_dim_size // num_heads)
        if self.kind is LayoutKind.FLASH_ATTN:
            return (2, self.num_blocks, self.block_size, *tail)
        if self.kind is LayoutKind.FLASHINFER:
            return (self.num_blocks, 2, self.block_size, *tail)
        return (self.num_blocks, self.block_size, self.hidden_dim_size)

    # ------------------------------------------------------------------ row view

    def rows(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Row ids (int64, on ``block_ids``' device) of ``block_ids`` in canonical chunk order:
        all K rows of the blocks in order, then all V rows."""
        b = block_ids.to(torch.int64)
        if self.kind is LayoutKind.FLASH_ATTN:
            return torch.cat((b, b + self.num_blocks))
        if self.kind is LayoutKind.FLASHINFER:
            return torch.cat((b * 2, b * 2 + 1))
        return b

    def row_view(self, layer: torch.Tensor) -> torch.Tensor:
        """One layer's tensor as ``[rows, row_elems]`` (a view; no copy)."""
        return layer.view(self.planes * self.num_blocks, self.row_elems)

    def chunk_rows_view(self, slot: torch.Tensor, chunk_size: int) -> torch.Tensor:
        """An arena slot (uint8, ``chunk_bytes`` long) as ``[num_layers, rows, row_elems]``
        of this layout's dtype; row ``p * blocks_per_chunk + i`` is plane ``p`` of block ``i``."""
        bpc = self.blocks_per_chunk(chunk_size)
        return slot.view(self.dtype).view(self.num_layers, self.planes * bpc, self.row_elems)

    # ------------------------------------------------------------------ construction

    @classmethod
    def infer(
        cls,
        kv_caches: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
        block_size: int,
        kind: LayoutKind | str | None = None,
    ) -> KVLayout:
        """The layout of ``kv_caches`` (one tensor per layer) with pages of ``block_size``.

        ``kind`` settles the one ambiguous case (a flash-attention cache of exactly two blocks
        looks like a flashinfer one); otherwise it is read from the shapes. Raises
        :class:`LayoutError` naming the offending layer and what was expected.
        """
        layers = as_layer_list(kv_caches)
        first = layers[0]
        for i, t in enumerate(layers):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise LayoutError(
                    f"layer {i} is {tuple(t.shape)} {t.dtype} on {t.device} but layer 0 is "
                    f"{tuple(first.shape)} {first.dtype} on {first.device}; all layers must match"
                )
            if not t.is_contiguous():
                raise LayoutError(f"layer {i} is not contiguous; pass the engine's own KV tensors")
        shape = tuple(first.shape)
        if not isinstance(block_size, int) or block_size <= 0:
            raise LayoutError(f"block_size must be a positive integer, got {block_size!r}")
        dtype_name(first.dtype)
        kind = LayoutKind(kind) if kind is not None else cls._guess_kind(shape, block_size)
        expected = {
            LayoutKind.FLASH_ATTN: "[2, num_blocks, block_size, heads, head_size]",
            LayoutKind.FLASHINFER: "[num_blocks, 2, block_size, heads, head_size]",
            LayoutKind.MLA: "[num_blocks, block_size, latent_dim]",
        }[kind]
        ok = (
            (kind is LayoutKind.MLA and len(shape) == 3 and shape[1] == block_size)
            or (kind is LayoutKind.FLASH_ATTN and len(shape) == 5 and shape[0] == 2 and shape[2] == block_size)
            or (kind is LayoutKind.FLASHINFER and len(shape) == 5 and shape[1] == 2 and shape[2] == block_size)
        )
        if not ok:
            raise LayoutError(
                f"KV tensors of shape {list(shape)} do not match layout {kind.value} {expected} "
                f"with block_size={block_size}"
            )
        if kind is LayoutKind.MLA:
            num_blocks, hidden = shape[0], shape[2]
        elif kind is LayoutKind.FLASH_ATTN:
            num_blocks, hidden = shape[1], shape[3] * shape[4]
        else:
            num_blocks, hidden = shape[0], shape[3] * shape[4]
        return cls(kind, len(layers), num_blocks, block_size, hidden, first.dtype)

    @staticmethod
    def _guess_kind(shape: tuple[int, ...], block_size: int) -> LayoutKind:
        if len(shape) == 3 and shape[1] == block_size:
            return LayoutKind.MLA
        if len(shape) == 5 and shape[2] == block_size:
            if shape[0] == 2:
                return LayoutKind.FLASH_ATTN
            if shape[1] == 2:
                return LayoutKind.FLASHINFER
        raise LayoutError(
            f"cannot infer a KV layout from per-layer shape {list(shape)} with "
            f"block_size={block_size}; supported: flash_attn [2, num_blocks, block_size, heads, "
            f"head_size], flashinfer [num_blocks, 2, block_size, heads, head_size], mla "
            f"[num_blocks, block_size, latent_dim] (check block_size)"
        )

    def check_tensors(self, layers: Sequence[torch.Tensor]) -> None:
        """Raise :class:`LayoutError` unless ``layers`` are tensors of exactly this layout."""
        if len(layers) != self.num_layers:
            raise LayoutError(f"expected {self.num_layers} layers, got {len(layers)}")
        other = KVLayout.infer(layers, self.block_size, self.kind)
        if other != self:
            raise LayoutError(f"KV tensors describe {other}, registration says {self}")
