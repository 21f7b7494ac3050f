"""Reference KV data for tests: random-byte KV caches and the canonical chunk format, computed
from tensor shapes alone (independent of :meth:`kvxfer.KVLayout.rows` and of every transport).

Everything here works on *byte views* (``uint8``): random bytes cover every bit pattern of the
dtype (NaNs with payloads, infinities, negative zero, fp8 patterns that have no value), and
comparing bytes is the only comparison that is exact for all of them.

Canonical chunk (what the server holds for every transport): ``[num_layers, planes,
chunk_size, hidden_bytes]`` with planes K then V (MLA: one plane).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvxfer.layout import LayoutKind, dtype_from_name

__all__ = ["KVSpec", "make_kv", "as_bytes", "get_chunks", "put_chunks", "equal_bytes", "describe_diff"]


@dataclass(frozen=True, slots=True)
class KVSpec:
    """Shape of a small test KV cache; ``hidden = heads * head_size`` (MLA: latent = hidden)."""

    kind: LayoutKind
    dtype: str
    num_layers: int = 2
    num_blocks: int = 32
    block_size: int = 16
    heads: int = 2
    head_size: int = 16

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def hidden(self) -> int:
        return self.heads * self.head_size

    @property
    def planes(self) -> int:
        return 1 if self.kind is LayoutKind.MLA else 2

    def layer_shape(self) -> tuple[int, ...]:
        nb, bs = self.num_blocks, self.block_size
        if self.kind is LayoutKind.FLASH_ATTN:
            return (2, nb, bs, self.heads, self.head_size)
        if self.kind is LayoutKind.FLASHINFER:
            return (nb, 2, bs, self.heads, self.head_size)
        return (nb, bs, self.hidden)

    def blocks_per_chunk(self, chunk_size: int) -> int:
        return chunk_size // self.block_size

    def with_blocks(self, num_blocks: int) -> KVSpec:
        return KVSpec(self.kind, self.dtype, self.num_layers, num_blocks, self.block_size, self.heads,
                      self.head_size)


def make_kv(spec: KVSpec, device: str | torch.device = "cpu", seed: int = 0) -> list[torch.Tensor]:
    """One tensor per layer of ``spec``'s shape and dtype on ``device``, filled with random bytes
    (deterministic for a given ``seed``)."""
    gen = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=spec.torch_dtype).element_size()
    shape = spec.layer_shape()
    byte_shape = (*shape[:-1], shape[-1] * itemsize)
    layers = []
    for _ in range(spec.num_layers):
        raw = torch.randint(0, 256, byte_shape, dtype=torch.uint8, generator=gen)
        layers.append(raw.view(spec.torch_dtype).to(device))
    return layers


def as_bytes(layers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """CPU ``uint8`` copies of ``layers`` (last dimension in bytes)."""
    return [t.detach().to("cpu").contiguous().view(torch.uint8).clone() for t in layers]


def _one_layer_get(t: torch.Tensor, kind: LayoutKind, blocks: torch.Tensor) -> torch.Tensor:
    """``[planes, len(blocks) * block_size, hidden_bytes]`` of one layer's byte view."""
    n = blocks.numel()
    if kind is LayoutKind.FLASH_ATTN:      # [2, NB, bs, H, Db]
        return t[:, blocks].reshape(2, n * t.shape[2], -1)
    if kind is LayoutKind.FLASHINFER:      # [NB, 2, bs, H, Db]
        return t[blocks].transpose(0, 1).reshape(2, n * t.shape[2], -1)
    return t[blocks].reshape(1, n * t.shape[1], -1)   # [NB, bs, Lb]


def _one_layer_put(t: torch.Tensor, kind: LayoutKind, blocks: torch.Tensor, data: torch.Tensor) -> None:
    n = blocks.numel()
    if kind is LayoutKind.FLASH_ATTN:
        t[:, blocks] = data.reshape(2, n, *t.shape[2:])
    elif kind is LayoutKind.FLASHINFER:
        t[blocks] = data.reshape(2, n, *t.shape[2:]).transpose(0, 1)
    else:
        t[blocks] = data.reshape(n, *t.shape[1:])


def get_chunks(layer_bytes: Sequence[torch.Tensor], kind: LayoutKind, block_ids: Sequence[int],
               blocks_per_chunk: int) -> torch.Tensor:
    """The canonical chunks held in ``block_ids`` (``blocks_per_chunk`` per chunk):
    ``[chunks, num_layers, planes, chunk_size, hidden_bytes]`` uint8."""
    ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
    n = ids.numel() // blocks_per_chunk
    out = []
    for c in range(n):
        b = ids[c * blocks_per_chunk:(c + 1) * blocks_per_chunk]
        out.append(torch.stack([_one_layer_get(t, LayoutKind(kind), b) for t in layer_bytes]))
    if not out:
        return torch.empty(0, dtype=torch.uint8)
    return torch.stack(out)


def put_chunks(layer_bytes: Sequence[torch.Tensor], kind: LayoutKind, block_ids: Sequence[int],
               blocks_per_chunk: int, chunks: torch.Tensor, skip_blocks: int = 0,
               only: Sequence[int] | None = None) -> None:
    """Write canonical ``chunks`` into ``block_ids`` of ``layer_bytes`` in place, as a correct
    retrieve would: the first ``skip_blocks`` blocks of the request are left alone, and with
    ``only`` just those chunk indices are written."""
    ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
    wanted = range(ids.numel() // blocks_per_chunk) if only is None else only
    for c in wanted:
        local_skip = min(blocks_per_chunk, max(0, skip_blocks - c * blocks_per_chunk))
        if local_skip == blocks_per_chunk:
            continue
        b = ids[c * blocks_per_chunk + local_skip:(c + 1) * blocks_per_chunk]
        for t, data in zip(layer_bytes, chunks[c]):
            tokens = data.shape[1] // blocks_per_chunk
            _one_layer_put(t, LayoutKind(kind), b, data[:, local_skip * tokens:].contiguous())


def equal_bytes(a: Sequence[torch.Tensor] | torch.Tensor, b: Sequence[torch.Tensor] | torch.Tensor) -> bool:
    """Bitwise equality of tensors (or lists of tensors) of bytes."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.equal(a, b)
    la, lb = list(a), list(b)
    return len(la) == len(lb) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(la, lb))


def describe_diff(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], kind: LayoutKind) -> str:
    """Which layers and blocks differ, for assertion messages."""
    block_dim = 1 if LayoutKind(kind) is LayoutKind.FLASH_ATTN else 0
    parts = []
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape:
            parts.append(f"layer {i}: shape {tuple(g.shape)} != {tuple(w.shape)}")
            continue
        diff = g != w
        if diff.any():
            per_block = diff.movedim(block_dim, 0).reshape(diff.shape[block_dim], -1).any(1)
            bad = torch.nonzero(per_block).flatten().tolist()
            parts.append(f"layer {i}: blocks {bad[:16]}{' ...' if len(bad) > 16 else ''} differ")
    return "; ".join(parts) or "no difference"
