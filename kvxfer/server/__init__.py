"""The cache server: engine, registered contexts, the L1 arena and its index."""

from kvxfer.server.config import ServerConfig
from kvxfer.server.engine import CacheServer

__all__ = ["CacheServer", "ServerConfig"]
