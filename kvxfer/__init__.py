"""kvxfer: store LLM KV cache in a host-memory cache server and load it back, over pluggable
transports (see docs/architecture.md)."""

__version__ = "0.1.0"

from kvxfer.client import CacheClient
from kvxfer.errors import (
    ConfigError,
    ConnectionFailed,
    KvxferError,
    LayoutError,
    RemoteError,
    RequestTimeout,
    TransportError,
    TransportNotFound,
    TransportUnavailable,
)
from kvxfer.hashing import chunk_hashes
from kvxfer.layout import KVLayout, LayoutKind
from kvxfer.protocol.messages import RetrieveResult, StoreResult
from kvxfer.transport.base import TransferContext

__all__ = [
    "__version__",
    "CacheClient",
    "chunk_hashes",
    "KVLayout",
    "LayoutKind",
    "TransferContext",
    "StoreResult",
    "RetrieveResult",
    "KvxferError",
    "ConfigError",
    "LayoutError",
    "ConnectionFailed",
    "RequestTimeout",
    "RemoteError",
    "TransportError",
    "TransportNotFound",
    "TransportUnavailable",
]
