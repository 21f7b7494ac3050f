"""The cache server: engine, registered contexts, the L1 index and its hooks.

``CacheServer`` and ``ServerConfig`` are loaded on first use, so that importing a light module
of this package (e.g. :mod:`kvxfer.server.hooks`) does not start up the whole server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvxfer.server.config import ServerConfig
    from kvxfer.server.engine import CacheServer

__all__ = ["CacheServer", "ServerConfig"]


def __getattr__(name: str) -> Any:
    if name == "CacheServer":
        from kvxfer.server.engine import CacheServer

        return CacheServer
    if name == "ServerConfig":
        from kvxfer.server.config import ServerConfig

        return ServerConfig
    raise AttributeError(f"module 'kvxfer.server' has no attribute {name!r}")
