"""The ``kit`` object the conformance tests use: clients, registrations, keys, block ids, and a
backdoor that reads what the server holds through the reference transport.

One :class:`Kit` per test; :meth:`Kit.close` (run by the fixture) closes every context and
client it made, so a failing test leaves nothing registered behind.
"""

from __future__ import annotations

import secrets
import uuid
import zlib
from collections.abc import Sequence
from typing import Any, Final

import pytest
import torch

from kvxfer.client import CacheClient
from kvxfer.layout import KVLayout, LayoutKind
from kvxfer.protocol.messages import RetrieveResult, StoreResult
from kvxfer.testing.kvdata import KVBytes, KVSpec, View, as_bytes, get_chunks, make_kv
from kvxfer.transport.contract import Capabilities, InstanceIdentity, TransferContext, Transport

__all__ = ["Kit", "REFERENCE", "LAYOUTS", "VIEWS", "DTYPES", "Layout", "layout_id", "CHUNK_SIZE", "BLOCK_SIZE",
           "TIMEOUT"]

#: The reference transport: the backdoor and the cross-transport tests go through it.
REFERENCE: Final = "cpu_gather"
#: The older layouts (one contiguous tensor per layer) and the dtypes the kit knows; a transport
#: is tested on those it claims.
LAYOUTS: Final = (LayoutKind.FLASH_ATTN, LayoutKind.FLASHINFER, LayoutKind.MLA)
DTYPES: Final = ("float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2", "uint8", "int8")
#: Current vLLM's bhnc views, built as vLLM builds them (kvdata.bhnc_views), each with a dtype.
#: Not the cross product of vLLM's six KVCacheLayouts with padding, kernel blocks, MLA and
#: dtypes: one case per way the memory can differ from a contiguous tensor, each with something
#: besides it, so that every run geometry and every copy element width is met:
#:
#: * LBHNC: contiguous (vLLM's CPU backend); LBNHC: strided, heads and tokens permuted, dense;
#: * LHBNC: a run per head, the runs of a block a layer apart (layer-compact);
#: * BLHNC, BHLNC: layers interleaved in one buffer, a run per page or per head;
#: * BLNHC with 40 bytes of padding after each page (cross-layer; rows not a multiple of 16 bytes
#:   apart), LBHNC with 32 (layer-compact);
#: * LBNHC with two kernel blocks per block (kernel blocks merged into the block's run);
#: * MLA as bhnc with one head, in BLHNC (interleaved).
#:
#: The dtypes rotate over them so that each of the kit's dtypes meets a strided view.
VIEWS: Final = (
    (View("LBHNC"), "bfloat16"),
    (View("LBNHC"), "float16"),
    (View("LHBNC"), "float32"),
    (View("BLHNC"), "float8_e4m3fn"),
    (View("BHLNC"), "uint8"),  # vLLM holds an fp8 cache as uint8
    (View("BLNHC", page_pad=40), "float8_e5m2"),
    (View("LBHNC", page_pad=32), "float16"),
    (View("LBNHC", kernel_blocks=2), "int8"),
    (View("BLHNC", mla=True), "bfloat16"),
)
#: What a kit test of "every layout" is parametrized over: a layout kind or a bhnc view.
Layout = LayoutKind | View
#: Small chunks keep the suite fast: 2 blocks of 16 tokens per chunk.
CHUNK_SIZE: Final = 32
BLOCK_SIZE: Final = 16
#: Seconds any single transfer of the kit may take before the test fails.
TIMEOUT: Final = 30.0


def layout_id(layout: Layout) -> str:
    """The test id of a layout kind or bhnc view (``flash_attn``, ``bhnc-BLNHC-pad40``)."""
    return layout.value if isinstance(layout, LayoutKind) else f"bhnc-{layout.id}"


class Kit:
    """Helpers bound to one test: the transport under test, its device and the kit's server."""

    def __init__(self, url: str, transport: Transport, device: str, test_name: str) -> None:
        self.url = url
        self.transport = transport
        self.name = transport.name
        self.device = device
        self.caps: Capabilities = transport.capabilities
        #: Model name unique to this test, so tests never see each other's chunks.
        self.model = f"kit-{test_name[:40]}-{uuid.uuid4().hex[:8]}"
        self._clients: list[CacheClient] = []
        self._contexts: list[TransferContext] = []
        self._client: CacheClient | None = None
        #: KV bytes and block ids are drawn from this, seeded by the test's name: a failure
        #: reproduces when the test is run again.
        self.rng = torch.Generator().manual_seed(zlib.crc32(test_name.encode()))

    # ------------------------------------------------------------------ capabilities

    def claims(self, kind: LayoutKind | None = None, dtype: str | None = None) -> bool:
        return (kind is None or kind in self.caps.layouts) and (dtype is None or dtype in self.caps.dtypes)

    def require(self, kind: LayoutKind | None = None, dtype: str | None = None) -> None:
        """Skip the test unless the transport claims ``kind`` and ``dtype``."""
        if kind is not None and kind not in self.caps.layouts:
            pytest.skip(f"{self.name} does not claim layout {kind.value} (Capabilities.layouts)")
        if dtype is not None and dtype not in self.caps.dtypes:
            pytest.skip(f"{self.name} does not claim dtype {dtype} (Capabilities.dtypes)")

    def spec(self, layout: Layout | None = None, dtype: str | None = None, **fields: Any) -> KVSpec:
        """A small KV spec of ``layout`` (a kind, or a bhnc view) and ``dtype`` (default: the
        first the transport claims); skips what the transport's capabilities rule out."""
        if layout is None:
            layout = next((k for k in (*LAYOUTS, LayoutKind.BHNC) if k in self.caps.layouts), None)
        if dtype is None:
            dtype = next((d for d in ("bfloat16", *DTYPES) if d in self.caps.dtypes), None)
        if layout is None or dtype is None:
            pytest.skip(f"{self.name} claims none of the kit's layouts or dtypes")
        if isinstance(layout, View):
            if layout.mla:
                fields.setdefault("heads", 1)
            spec = KVSpec(LayoutKind.BHNC, dtype, view=layout, **fields)
        else:
            spec = KVSpec(layout, dtype, **fields)
        self.require(spec.kind, dtype)
        if not self.caps.strided_layers and not all(t.is_contiguous() for t in make_kv(spec)):
            pytest.skip(f"{self.name} moves only contiguous layers (Capabilities.strided_layers), and "
                        f"{spec.id} layers are strided")
        return spec

    @property
    def blocks_per_chunk(self) -> int:
        """Blocks per chunk of the kit's default block size."""
        return CHUNK_SIZE // BLOCK_SIZE

    # ------------------------------------------------------------------ clients and contexts

    def client(self, *, new: bool = False) -> CacheClient:
        """The test's client (``new=True``: another connection, like another process has)."""
        if self._client is not None and not new:
            return self._client
        c = CacheClient(self.url, timeout=TIMEOUT, name="kvxfer-conformance")
        self._clients.append(c)
        if not new:
            self._client = c
        return c

    def kv(self, spec: KVSpec, seed: int | None = None, device: str | None = None) -> list[torch.Tensor]:
        """A random-byte KV cache of ``spec`` on the test's device."""
        if seed is None:
            seed = int(torch.randint(0, 2**31 - 1, (), generator=self.rng))
        return make_kv(spec, device or self.device, seed)

    def register(self, layers: list[torch.Tensor], spec: KVSpec, *, transport: str | None = None,
                 model: str | None = None, world_size: int = 1, rank: int = 0,
                 client: CacheClient | None = None) -> TransferContext:
        """Register ``layers`` through ``transport`` (default: the one under test)."""
        ctx = (client or self.client()).register(
            layers, model_name=model or self.model, block_size=spec.block_size, world_size=world_size,
            rank=rank, transport=transport or self.name, layout=spec.kind)
        self._contexts.append(ctx)
        return ctx

    def unregistered_context(self, layers: list[torch.Tensor], spec: KVSpec) -> TransferContext:
        """A client context of the transport under test, made but not registered."""
        layout = KVLayout.infer(layers, spec.block_size, spec.kind)
        identity = InstanceIdentity(secrets.randbits(62) + 1, self.model, 1, 0)
        ctx = self.transport.client_context(self.client(), layers, layout, identity)
        self._contexts.append(ctx)
        return ctx

    # ------------------------------------------------------------------ keys and blocks

    @staticmethod
    def keys(n: int) -> list[bytes]:
        """``n`` fresh random chunk keys."""
        return [secrets.token_bytes(16) for _ in range(n)]

    def blocks(self, spec: KVSpec, n_chunks: int, exclude: Sequence[int] = ()) -> list[int]:
        """Distinct random block ids for ``n_chunks`` chunks, none in ``exclude``."""
        free = torch.tensor(sorted(set(range(spec.num_blocks)) - set(exclude)), dtype=torch.int64)
        need = n_chunks * spec.blocks_per_chunk(CHUNK_SIZE)
        if need > free.numel():
            raise ValueError(f"{need} blocks wanted, {free.numel()} free in a {spec.num_blocks}-block cache")
        return free[torch.randperm(free.numel(), generator=self.rng)[:need]].tolist()

    # ------------------------------------------------------------------ transfers

    def store(self, ctx: TransferContext, keys: Sequence[bytes], blocks: Sequence[int]) -> StoreResult:
        return ctx.submit_store(keys, blocks).result(timeout=TIMEOUT)

    def retrieve(self, ctx: TransferContext, keys: Sequence[bytes], blocks: Sequence[int],
                 skip_first_n_tokens: int = 0, lease_id: int = 0) -> RetrieveResult:
        return ctx.submit_retrieve(keys, blocks, skip_first_n_tokens, lease_id).result(timeout=TIMEOUT)

    def chunks_of(self, layers: Sequence[torch.Tensor], spec: KVSpec, blocks: Sequence[int]) -> torch.Tensor:
        """Reference canonical chunks held in ``blocks`` of ``layers`` (uint8; ``layers`` may be
        the :class:`~kvxfer.testing.kvdata.KVBytes` of a cache)."""
        layer_bytes = layers if isinstance(layers, KVBytes) else as_bytes(layers)
        return get_chunks(layer_bytes, spec, blocks, spec.blocks_per_chunk(CHUNK_SIZE))

    # ------------------------------------------------------------------ backdoor

    def backdoor_read(self, spec: KVSpec, keys: Sequence[bytes], *, model: str | None = None,
                      world_size: int = 1, rank: int = 0) -> tuple[RetrieveResult, torch.Tensor]:
        """What the server holds for ``keys``, read through the reference transport on the CPU
        by a separate connection: ``(result, chunks)``; chunks of missing keys are garbage."""
        n = max(1, len(keys))
        bpc = spec.blocks_per_chunk(CHUNK_SIZE)
        bspec = spec.with_blocks(n * bpc)
        layers = make_kv(bspec, "cpu", seed=1)
        client = self.client(new=True)
        ctx = self.register(layers, bspec, transport=REFERENCE, model=model, world_size=world_size,
                            rank=rank, client=client)
        try:
            ids = list(range(len(keys) * bpc))
            res = self.retrieve(ctx, keys, ids)
            return res, self.chunks_of(layers, bspec, ids)
        finally:
            ctx.close()

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        errors = []
        for ctx in reversed(self._contexts):
            try:
                ctx.close()
            except Exception as exc:  # noqa: BLE001  (report after closing everything else)
                errors.append(exc)
        for c in self._clients:
            c.close()
        if errors:
            raise errors[0]
