"""kvxfer: store LLM KV cache in a host-memory cache server and load it back, over pluggable
transports (see docs/architecture.md).

The data path's names (``KVLayout``, ``LayoutKind``, ``TransferContext``, ``TransferFuture``,
``LayerwiseFuture``) are loaded on first use, so that ``import kvxfer`` stays small. No module a plugin's entry point,
``kvxfer plugins`` or ``kvxfer status`` imports imports torch: torch is imported where tensors are
handled (it takes about a second).
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
    NoSession,
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
    from kvxfer.transport.contract import LayerwiseFuture, TransferContext, TransferFuture

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
    "TransferFuture",
    "LayerwiseFuture",
    "StoreResult",
    "RetrieveResult",
    "KvxferError",
    "ConfigError",
    "LayoutError",
    "ConnectionFailed",
    "RequestTimeout",
    "NoSession",
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
    "TransferFuture": "kvxfer.transport.contract",
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
