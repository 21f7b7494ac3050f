"""Reference KV data for tests: random-byte KV caches and the canonical chunk format, computed
from tensor shapes alone (independent of :meth:`kvxfer.KVLayout.rows` and of every transport).

Two families of KV caches:

* the older kinds (``flash_attn``, ``flashinfer``, ``mla``): one contiguous tensor per layer;
* ``bhnc``, as current vLLM builds it: one buffer, and per layer a ``[num_blocks, heads,
  block_size, content]`` view whose strides follow one of vLLM's ``KVCacheLayout``\\ s
  (:class:`View`: the layout, page padding, kernel blocks, MLA). :func:`bhnc_views` builds
  those views with ``torch.as_strided`` the way vLLM's ``create_kv_cache_views`` does (a test
  under ``tests/integrations`` checks it against vLLM's own code), so no vLLM is needed: several
  layers may interleave in one buffer, pages may be padded, a page may be one run per head.

Everything here works on *byte views* (``uint8``): random bytes cover every bit pattern of the
dtype (NaNs with payloads, infinities, negative zero, fp8 patterns that have no value), and
comparing bytes is the only comparison that is exact for all of them. :func:`as_bytes` copies
the whole memory *behind* the layers (every storage they view), so :func:`equal_bytes` also sees
the bytes outside every layer's pages: padding, and the pages of layers that were not registered.

Canonical chunk (what the server holds for every transport), per layer:

* older kinds: ``[planes, chunk_size, hidden_bytes]``, planes K then V (MLA: one plane);
* bhnc: ``[runs, blocks_per_chunk, run_bytes]``: a run is a maximal contiguous span of a page in
  memory order: the whole page (``[heads, block_size, content]`` or ``[block_size, heads,
  content]``, kernel blocks end to end), or one head's ``[block_size, content]`` where a layer
  or a block lies between heads and tokens (``LHBNC``, ``BHLNC``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import torch

from kvxfer.layout import LayoutKind, dtype_from_name

__all__ = ["VLLM_LAYOUTS", "View", "KVSpec", "make_kv", "bhnc_buffer_bytes", "bhnc_views", "KVBytes",
           "as_bytes", "get_chunks", "put_chunks", "equal_bytes", "describe_diff"]

#: vLLM's ``KVCacheLayout`` names (``vllm/v1/kv_cache_layout.py``); each spells the memory order,
#: outermost first, of the logical axes L (layer), B (block), H (head), N (token), C (content).
VLLM_LAYOUTS: Final = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


@dataclass(frozen=True, slots=True)
class View:
    """How a bhnc KV cache sits in its buffer, as vLLM lays it out.

    vLLM refuses some combinations, and so does this class (``ValueError``): kernel blocks need
    a block to be one dense page (``LBHNC``, ``LBNHC``, no padding); padding needs only L and B
    outside the page (not ``LHBNC``/``BHLNC`` with several heads: checked by :class:`KVSpec`).
    """

    #: A ``KVCacheLayout`` name (:data:`VLLM_LAYOUTS`).
    order: str = "LBHNC"
    #: Bytes between the end of one page and the start of the next (vLLM's ``page_size_padded``
    #: minus the page size).
    page_pad: int = 0
    #: Kernel blocks per block (vLLM's ``block_size // kernel_block_size``).
    kernel_blocks: int = 1
    #: An MLA cache: one head whose content is the latent vector (else K and V side by side).
    mla: bool = False

    def __post_init__(self) -> None:
        if self.order not in VLLM_LAYOUTS:
            raise ValueError(f"order must be one of {', '.join(VLLM_LAYOUTS)}, got {self.order!r}")
        if self.page_pad < 0 or self.kernel_blocks < 1:
            raise ValueError(f"page_pad must be >= 0 and kernel_blocks >= 1, got {self.page_pad}, "
                             f"{self.kernel_blocks}")
        if self.kernel_blocks > 1 and (not self.order.startswith("LB") or self.page_pad):
            raise ValueError(f"vLLM splits a block into kernel blocks only where the block is one dense "
                             f"page (LBHNC, LBNHC, no padding), not {self.id}")

    @property
    def id(self) -> str:
        """A short readable name, e.g. ``BLNHC-pad40`` or ``mla-BHLNC``."""
        parts = [("mla-" if self.mla else "") + self.order]
        if self.page_pad:
            parts.append(f"pad{self.page_pad}")
        if self.kernel_blocks > 1:
            parts.append(f"kernel{self.kernel_blocks}")
        return "-".join(parts)

    @property
    def cross_layer(self) -> bool:
        """Whether the layers interleave in one buffer (block outermost)."""
        return self.order[0] == "B"

    @property
    def runs_per_head(self) -> bool:
        """Whether a layer or a block lies between a head and its tokens (``LHBNC``, ``BHLNC``),
        so that a page is one run per head."""
        return set(self.order[2:]) != set("HNC")


@dataclass(frozen=True, slots=True)
class KVSpec:
    """Shape of a small test KV cache. Older kinds: ``hidden = heads * head_size`` (MLA: latent =
    hidden). bhnc: ``content = 2 * head_size`` (K and V side by side; MLA: ``head_size``, one head)
    and ``hidden = heads * content``; ``view`` says how the buffer holds it (default ``View()``)."""

    kind: LayoutKind
    dtype: str
    num_layers: int = 2
    num_blocks: int = 32
    block_size: int = 16
    heads: int = 2
    head_size: int = 16
    view: View | None = None
    #: flash_attn: bytes between the end of a layer's K plane and the start of its V plane (K and
    #: V not adjacent in memory: the row view's rows then overlap; a block's rows never do).
    plane_pad: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", LayoutKind(self.kind))
        if self.plane_pad and (self.kind is not LayoutKind.FLASH_ATTN or self.plane_pad < 0
                               or self.plane_pad % self.torch_dtype.itemsize):
            raise ValueError(f"plane_pad is a non-negative multiple of the element of a flash_attn cache, "
                             f"not {self.plane_pad} of {self.kind.value} {self.dtype}")
        if self.kind is not LayoutKind.BHNC:
            if self.view is not None:
                raise ValueError(f"a view describes bhnc caches, not {self.kind.value}")
            return
        view = self.view or View()
        object.__setattr__(self, "view", view)
        if view.mla and self.heads != 1:
            raise ValueError(f"an MLA bhnc cache has one head, not {self.heads}")
        if self.block_size % view.kernel_blocks:
            raise ValueError(f"block_size {self.block_size} is not {view.kernel_blocks} kernel blocks")
        if view.page_pad and view.runs_per_head and self.heads > 1:
            raise ValueError(f"vLLM pads pages only where L and B alone lie outside the page, not {view.order} "
                             f"with {self.heads} heads")
        if view.page_pad % self.torch_dtype.itemsize:
            raise ValueError(f"page_pad {view.page_pad} is not a multiple of the {self.dtype} element")

    @property
    def id(self) -> str:
        """A short readable name of the layout, e.g. ``flash_attn``, ``flash_attn-planes64``
        (:attr:`plane_pad`) or ``bhnc-BLNHC-pad40``."""
        if self.view is not None:
            return f"bhnc-{self.view.id}"
        return self.kind.value + (f"-planes{self.plane_pad}" if self.plane_pad else "")

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def content(self) -> int:
        """bhnc: elements of one head of one token (K and V side by side, or the MLA latent)."""
        return self.head_size if self.view is not None and self.view.mla else 2 * self.head_size

    @property
    def hidden(self) -> int:
        return self.heads * (self.content if self.kind is LayoutKind.BHNC else self.head_size)

    @property
    def planes(self) -> int:
        return 2 if self.kind in (LayoutKind.FLASH_ATTN, LayoutKind.FLASHINFER) else 1

    @property
    def kernel_blocks(self) -> int:
        return 1 if self.view is None else self.view.kernel_blocks

    def layer_shape(self) -> tuple[int, ...]:
        nb, bs = self.num_blocks, self.block_size
        if self.kind is LayoutKind.FLASH_ATTN:
            return (2, nb, bs, self.heads, self.head_size)
        if self.kind is LayoutKind.FLASHINFER:
            return (nb, 2, bs, self.heads, self.head_size)
        if self.kind is LayoutKind.BHNC:
            r = self.kernel_blocks
            return (nb * r, self.heads, bs // r, self.content)
        return (nb, bs, self.hidden)

    def blocks_per_chunk(self, chunk_size: int) -> int:
        return chunk_size // self.block_size

    def with_blocks(self, num_blocks: int) -> KVSpec:
        return dataclasses.replace(self, num_blocks=num_blocks)


# --------------------------------------------------------------------------- bhnc views


def _bhnc_strides(spec: KVSpec) -> tuple[dict[str, int], dict[str, int], int]:
    """Sizes and byte strides of the axes L, B (kernel blocks), H, N, C (bytes) of ``spec``'s
    buffer, and its length in bytes: vLLM's ``compute_layout_strides``: strides follow the
    layout's order, innermost first, and the page grid's innermost axis (L or B) starts pages
    ``page + page_pad`` bytes apart."""
    view = spec.view
    if view is None:
        raise ValueError(f"{spec.kind.value} caches are one tensor per layer, not views of one buffer")
    item = spec.torch_dtype.itemsize
    shape = spec.layer_shape()
    sizes = {"L": spec.num_layers, "B": shape[0], "H": shape[1], "N": shape[2], "C": shape[3] * item}
    grid_inner = max(view.order.index("L"), view.order.index("B"))
    strides: dict[str, int] = {}
    step = 1
    for i in reversed(range(len(view.order))):
        axis = view.order[i]
        if i == grid_inner:
            step += view.page_pad
        strides[axis] = step
        step *= sizes[axis]
    return sizes, strides, step


def bhnc_buffer_bytes(spec: KVSpec) -> int:
    """Bytes of the buffer that holds every layer of the bhnc ``spec``."""
    return _bhnc_strides(spec)[2]


def bhnc_views(buf: torch.Tensor, spec: KVSpec) -> list[torch.Tensor]:
    """The layers of the bhnc ``spec`` as views of ``buf`` (``uint8``, :func:`bhnc_buffer_bytes`
    long, on any device): ``[num_blocks * kernel_blocks, heads, block_size / kernel_blocks,
    content]`` of ``spec.dtype`` each, made with ``torch.as_strided`` as vLLM's
    ``create_kv_cache_views`` makes them."""
    sizes, strides, total = _bhnc_strides(spec)
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < total:
        raise ValueError(f"buf must be a 1-D uint8 tensor of at least {total} bytes")
    shape = [sizes[a] for a in "BHNC"]
    layer_strides = [strides[a] for a in "BHN"] + [1]
    return [buf.as_strided(shape, layer_strides, buf.storage_offset() + i * strides["L"]).view(spec.torch_dtype)
            for i in range(spec.num_layers)]


def make_kv(spec: KVSpec, device: str | torch.device = "cpu", seed: int = 0) -> list[torch.Tensor]:
    """One tensor per layer of ``spec``'s shape and dtype on ``device``, filled with random bytes
    (deterministic for a given ``seed``). bhnc: views of one buffer (:func:`bhnc_views`) whose
    every byte is random, padding included."""
    gen = torch.Generator().manual_seed(seed)
    if spec.kind is LayoutKind.BHNC:
        raw = torch.randint(0, 256, (bhnc_buffer_bytes(spec),), dtype=torch.uint8, generator=gen)
        return bhnc_views(raw.to(device), spec)
    itemsize = spec.torch_dtype.itemsize
    shape = spec.layer_shape()
    byte_shape = (*shape[:-1], shape[-1] * itemsize)
    layers = []
    if spec.plane_pad:  # each layer a [2, ...] view of one buffer, the V plane plane_pad bytes after K's end
        plane = byte_shape[1:]
        strides = _contiguous_strides(plane)
        apart = strides[0] * plane[0] + spec.plane_pad
        for _ in range(spec.num_layers):
            raw = torch.randint(0, 256, (apart + strides[0] * plane[0],), dtype=torch.uint8, generator=gen)
            layers.append(raw.to(device).as_strided(byte_shape, (apart, *strides)).view(spec.torch_dtype))
        return layers
    for _ in range(spec.num_layers):
        raw = torch.randint(0, 256, byte_shape, dtype=torch.uint8, generator=gen)
        layers.append(raw.view(spec.torch_dtype).to(device))
    return layers


# --------------------------------------------------------------------------- bytes


class KVBytes(list[torch.Tensor]):
    """CPU copies of the memory behind a KV cache: :attr:`storages` holds every storage its
    layers view, whole (padding and other layers' pages included); the list holds each layer as
    a ``uint8`` view into them whose last dimension counts bytes. Made by :func:`as_bytes`."""

    def __init__(self, storages: list[torch.Tensor],
                 where: list[tuple[int, tuple[int, ...], tuple[int, ...], int]]) -> None:
        super().__init__(storages[i].as_strided(shape, stride, offset) for i, shape, stride, offset in where)
        self.storages = storages
        self._where = where

    def clone(self) -> KVBytes:
        """An independent copy: the layers still alias each other as the originals do."""
        return KVBytes([s.clone() for s in self.storages], list(self._where))

    def same_places(self, other: KVBytes) -> bool:
        """Whether both describe layers at the same places of equally long storages."""
        return self._where == other._where and [s.numel() for s in self.storages] == [
            s.numel() for s in other.storages]


def as_bytes(layers: Sequence[torch.Tensor]) -> KVBytes:
    """CPU ``uint8`` copies of the memory behind ``layers`` (see :class:`KVBytes`). A layer whose
    last dimension is not dense is copied on its own (its storage is not shared)."""
    storages: list[torch.Tensor] = []
    index: dict[tuple[str, int], int] = {}
    where = []
    for t in layers:
        t = t.detach()
        item = t.element_size()
        byte_shape = (*t.shape[:-1], t.shape[-1] * item) if t.dim() else (item,)
        if t.dim() == 0 or (t.shape[-1] > 1 and t.stride(-1) != 1):
            flat = t.to("cpu").contiguous().view(torch.uint8).reshape(-1).clone()
            storages.append(flat)
            where.append((len(storages) - 1, byte_shape, tuple(_contiguous_strides(byte_shape)), 0))
            continue
        key = (str(t.device), t.untyped_storage().data_ptr())
        if key not in index:
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
            index[key] = len(storages)
            storages.append(whole.to("cpu", copy=True))
        byte_strides = (*(s * item for s in t.stride()[:-1]), 1)
        where.append((index[key], byte_shape, byte_strides, int(t.storage_offset()) * item))
    return KVBytes(storages, where)


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides, step = list[int](), 1
    for n in reversed(shape):
        strides.insert(0, step)
        step *= n
    return strides


# --------------------------------------------------------------------------- canonical chunks


def _bhnc_pages(t: torch.Tensor, spec: KVSpec) -> torch.Tensor:
    """A bhnc layer's byte view as ``[num_blocks, kernel_blocks, heads, tokens, content_bytes]`` (a view)."""
    return t.unflatten(0, (-1, spec.kernel_blocks))


def _one_layer_get(t: torch.Tensor, spec: KVSpec, blocks: torch.Tensor) -> torch.Tensor:
    """One layer's canonical chunk data (``[planes, n * block_size, hidden_bytes]``, or for
    bhnc ``[runs, n, run_bytes]``) of ``blocks`` of its byte view."""
    n = blocks.numel()
    if spec.kind is LayoutKind.FLASH_ATTN:      # [2, NB, bs, H, Db]
        return t[:, blocks].reshape(2, n * t.shape[2], -1)
    if spec.kind is LayoutKind.FLASHINFER:      # [NB, 2, bs, H, Db]
        return t[blocks].transpose(0, 1).reshape(2, n * t.shape[2], -1)
    if spec.kind is LayoutKind.BHNC:
        assert spec.view is not None
        x = _bhnc_pages(t, spec)[blocks]        # [n, r, H, tokens, Cb]
        if spec.view.runs_per_head:             # a run per head: [tokens, Cb] (r is 1)
            return x.permute(2, 0, 1, 3, 4).reshape(x.shape[2], n, -1)
        if spec.view.order.index("N") < spec.view.order.index("H"):
            x = x.permute(0, 1, 3, 2, 4)        # pages of [r, tokens, H, Cb]
        return x.reshape(1, n, -1)
    return t[blocks].reshape(1, n * t.shape[1], -1)   # [NB, bs, Lb]


def _one_layer_put(t: torch.Tensor, spec: KVSpec, blocks: torch.Tensor, data: torch.Tensor) -> None:
    n = blocks.numel()
    if spec.kind is LayoutKind.FLASH_ATTN:
        t[:, blocks] = data.reshape(2, n, *t.shape[2:])
    elif spec.kind is LayoutKind.FLASHINFER:
        t[blocks] = data.reshape(2, n, *t.shape[2:]).transpose(0, 1)
    elif spec.kind is LayoutKind.BHNC:
        assert spec.view is not None
        pages = _bhnc_pages(t, spec)
        r, heads, tokens, cb = pages.shape[1:]
        if spec.view.runs_per_head:
            x = data.reshape(heads, n, r, tokens, cb).permute(1, 2, 0, 3, 4)
        elif spec.view.order.index("N") < spec.view.order.index("H"):
            x = data.reshape(n, r, tokens, heads, cb).permute(0, 1, 3, 2, 4)
        else:
            x = data.reshape(n, r, heads, tokens, cb)
        pages[blocks] = x
    else:
        t[blocks] = data.reshape(n, *t.shape[1:])


def get_chunks(layer_bytes: Sequence[torch.Tensor], spec: KVSpec, block_ids: Sequence[int],
               blocks_per_chunk: int) -> torch.Tensor:
    """The canonical chunks held in ``block_ids`` (``blocks_per_chunk`` per chunk) of
    ``layer_bytes`` (:func:`as_bytes` of a cache of ``spec``): ``[chunks, num_layers, planes,
    chunk_size, hidden_bytes]`` uint8 (bhnc: ``[chunks, num_layers, runs, blocks_per_chunk, run_bytes]``)."""
    ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
    n = ids.numel() // blocks_per_chunk
    out = []
    for c in range(n):
        b = ids[c * blocks_per_chunk:(c + 1) * blocks_per_chunk]
        out.append(torch.stack([_one_layer_get(t, spec, b) for t in layer_bytes]))
    if not out:
        return torch.empty(0, dtype=torch.uint8)
    return torch.stack(out)


def put_chunks(layer_bytes: Sequence[torch.Tensor], spec: KVSpec, block_ids: Sequence[int],
               blocks_per_chunk: int, chunks: torch.Tensor, skip_blocks: int = 0,
               only: Sequence[int] | None = None) -> None:
    """Write canonical ``chunks`` into ``block_ids`` of ``layer_bytes`` in place, as a correct
    retrieve would: the first ``skip_blocks`` blocks of the request are left alone, and with
    ``only`` just those chunk indices are written. Views into a :class:`KVBytes` write into its
    storages."""
    ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
    wanted = range(ids.numel() // blocks_per_chunk) if only is None else only
    for c in wanted:
        local_skip = min(blocks_per_chunk, max(0, skip_blocks - c * blocks_per_chunk))
        if local_skip == blocks_per_chunk:
            continue
        b = ids[c * blocks_per_chunk + local_skip:(c + 1) * blocks_per_chunk]
        for t, data in zip(layer_bytes, chunks[c]):
            per_block = data.shape[1] // blocks_per_chunk
            _one_layer_put(t, spec, b, data[:, local_skip * per_block:].contiguous())


def equal_bytes(a: Sequence[torch.Tensor] | torch.Tensor, b: Sequence[torch.Tensor] | torch.Tensor) -> bool:
    """Bitwise equality of tensors (or lists of tensors) of bytes; of two :class:`KVBytes`, of
    the whole memory behind them (bytes outside every layer's pages included)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, KVBytes) and isinstance(b, KVBytes):
        return a.same_places(b) and all(torch.equal(x, y) for x, y in zip(a.storages, b.storages))
    la, lb = list(a), list(b)
    return len(la) == len(lb) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(la, lb))


def describe_diff(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], spec: KVSpec) -> str:
    """Which layers and blocks differ, and bytes outside them, for assertion messages."""
    block_dim = 1 if spec.kind is LayoutKind.FLASH_ATTN else 0
    parts = []
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape:
            parts.append(f"layer {i}: shape {tuple(g.shape)} != {tuple(w.shape)}")
            continue
        diff = g != w
        if diff.any():
            per_block = diff.movedim(block_dim, 0).reshape(diff.shape[block_dim], -1).any(1)
            bad = sorted(set((torch.nonzero(per_block).flatten() // spec.kernel_blocks).tolist()))
            parts.append(f"layer {i}: blocks {bad[:16]}{' ...' if len(bad) > 16 else ''} differ")
    if not parts and isinstance(got, KVBytes) and isinstance(want, KVBytes):
        for i, (g, w) in enumerate(zip(got.storages, want.storages)):
            if g.shape == w.shape and not torch.equal(g, w):
                where = torch.nonzero(g != w).flatten()
                parts.append(f"{where.numel()} bytes outside every layer's blocks differ (padding, or pages of "
                             f"layers not registered), the first at byte {int(where[0])} of buffer {i} "
                             f"(of {g.numel()} bytes)")
    return "; ".join(parts) or "no difference"
