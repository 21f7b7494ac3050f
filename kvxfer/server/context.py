"""RegisteredContext: the server's record of one registered engine instance."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvxfer.copies import SlotViews
from kvxfer.layout import KVLayout, dtype_name
from kvxfer.protocol.messages import ContextStatus, Registration
from kvxfer.server.index import ChunkKey
from kvxfer.server.workers import Lane
from kvxfer.transport.contract import ServerContext

__all__ = ["RegisteredContext", "ChunkDescription"]


@dataclass(frozen=True, slots=True)
class ChunkDescription:
    """What one chunk of a context looks like in the arena."""

    shape: tuple[int, int, int, int]
    dtype: str
    nbytes: int
    fmt: str


@dataclass(eq=False)
class RegisteredContext:
    """One registered KV cache. Owned by the loop thread except ``server_context``'s copies,
    which run in ``executor`` (the instance's lane of the worker pool: its transfers stay in
    order). ``server_context`` is None for client-driven transports (the core serves the arena)."""

    instance_id: int
    model_name: str
    world_size: int
    rank: int
    layout: KVLayout
    transport: str
    #: The registration as the client sent it, decoded as its transport's ``registration_type``
    #: and validated (read-only: hooks read what a transport's registration declared from it).
    registration: Registration
    server_context: ServerContext[Any, Any] | None
    session: bytes
    client_pid: int
    chunk_size: int
    executor: Lane
    #: Its layout's views of the arena's slots, in the server's table (loop thread).
    views: SlotViews = field(repr=False)
    #: The session that registered it (kvxfer.server.sessions.Session).
    owner: Any = field(default=None, repr=False)
    stores: int = 0
    retrieves: int = 0
    #: Waiters of its transfers still waiting for their copies (added by the thread that queues
    #: them, removed by the waiter's thread): the server context closes only after they end.
    waiting: set[Future[Any]] = field(default_factory=set, repr=False)
    chunk: ChunkDescription = field(init=False)

    def __post_init__(self) -> None:
        self.chunk = ChunkDescription(
            shape=self.layout.chunk_shape(self.chunk_size),
            dtype=dtype_name(self.layout.dtype),
            nbytes=self.layout.chunk_bytes(self.chunk_size),
            fmt=self.layout.chunk_format(self.chunk_size),
        )

    def key(self, chunk_hash: bytes) -> ChunkKey:
        return ChunkKey(self.model_name, self.world_size, self.rank, chunk_hash)

    def keys(self, hashes: list[bytes]) -> list[ChunkKey]:
        return [ChunkKey(self.model_name, self.world_size, self.rank, h) for h in hashes]

    def status(self) -> ContextStatus:
        lay = self.layout
        return ContextStatus(
            instance_id=self.instance_id,
            model_name=self.model_name,
            world_size=self.world_size,
            rank=self.rank,
            transport=self.transport,
            layout=lay.kind.value,
            num_layers=lay.num_layers,
            block_size=lay.block_size,
            hidden_dim_size=lay.hidden_dim_size,
            dtype=self.chunk.dtype,
            use_mla=lay.use_mla,
            num_blocks=lay.num_blocks,
            chunk_bytes=self.chunk.nbytes,
            client_pid=self.client_pid,
            stores=self.stores,
            retrieves=self.retrieves,
            page=lay.page,
        )
