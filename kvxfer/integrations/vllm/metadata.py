"""What the scheduler-side connector tells the workers each step.

Plain dataclasses of lists, ints and bytes: vLLM ships the metadata to its worker processes
inside ``SchedulerOutput`` (with its own serializer), so it must stay simple and importable
by module path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvxfer.integrations.vllm._compat import KVConnectorMetadata

__all__ = ["LoadOp", "StoreOp", "KvxferConnectorMetadata"]


@dataclass(slots=True)
class LoadOp:
    """Load ``keys`` (consecutive chunks) into ``block_ids``, leaving the blocks of the first
    ``skip_tokens`` tokens alone (vLLM computed those itself). ``failed_block_ids`` are blocks
    the scheduler promised but cannot load (reported as load errors without trying)."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    skip_tokens: int = 0
    lease_id: int = 0
    failed_block_ids: list[int] = field(default_factory=list)
    #: vLLM's KV cache group whose blocks these are.
    group: int = 0


@dataclass(slots=True)
class StoreOp:
    """Store ``keys`` (full chunks, computed by the end of this step) from ``block_ids`` of KV
    cache group ``group``. ``sync``: vLLM may free those blocks before the request finishes
    (a sliding-window group), so the store must be done before the next step's work starts."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    group: int = 0
    sync: bool = False


@dataclass
class KvxferConnectorMetadata(KVConnectorMetadata):
    """One step's work for every worker: loads to start, stores to submit after the forward
    pass, and requests preempted this step (their pending stores must finish before vLLM
    reuses their blocks)."""

    chunk_size: int = 0
    loads: list[LoadOp] = field(default_factory=list)
    stores: list[StoreOp] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
