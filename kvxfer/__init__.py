"""kvxfer: store LLM KV cache in a host-memory cache server and load it back, over pluggable
transports (see docs/architecture.md).

Names that need torch (``KVLayout``, ``LayoutKind``, ``TransferContext``) are loaded on first
use, so ``import kvxfer`` and the ``kvxfer`` command start without importing torch.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from kvxfer.client import CacheClient
from kvxfer.errors import (
    ConfigError,
    ConnectionFailed,
    KvxferError,
    LayoutError,
    RemoteError,
    RequestTimeout,
    TransportError,
    TransportFailed,
    TransportNotFound,
    TransportUnavailable,
)
from kvxfer.hashing import chunk_hashes
from kvxfer.protocol.messages import RetrieveResult, StoreResult
from kvxfer.server.hooks import hookimpl

if TYPE_CHECKING:
    from kvxfer.layout import KVLayout, LayoutKind
    from kvxfer.transport.contract import LayerwiseFuture, TransferContext

try:  # the version is the distribution's (pyproject.toml), defined there once
    __version__ = version("kvxfer")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "__version__",
    "CacheClient",
    "chunk_hashes",
    "hookimpl",
    "KVLayout",
    "LayoutKind",
    "TransferContext",
    "LayerwiseFuture",
    "StoreResult",
    "RetrieveResult",
    "KvxferError",
    "ConfigError",
    "LayoutError",
    "ConnectionFailed",
    "RequestTimeout",
    "RemoteError",
    "TransportError",
    "TransportFailed",
    "TransportNotFound",
    "TransportUnavailable",
]

_LAZY = {
    "KVLayout": "kvxfer.layout",
    "LayoutKind": "kvxfer.layout",
    "TransferContext": "kvxfer.transport.contract",
    "LayerwiseFuture": "kvxfer.transport.contract",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvxfer' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
