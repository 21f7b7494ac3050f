"""ServerConfig: everything `kvxfer serve` can set."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvxfer.arena import DEFAULT_SHM_DIR
from kvxfer.errors import ConfigError
from kvxfer.mq.server import CurveServerKeys
from kvxfer.server.limits import Limits
from kvxfer.server.tier import TierConfig
from kvxfer.urls import default_url

__all__ = ["ServerConfig"]


@dataclass(frozen=True)
class ServerConfig:
    #: ipc://PATH (default: a private runtime directory) or tcp://HOST:PORT (needs ``curve``).
    url: str = field(default_factory=default_url)
    #: Bytes of the L1 arena (host memory for chunks).
    l1_size: int = 1 << 30
    #: Tokens per chunk; a multiple of every registered block size.
    chunk_size: int = 256
    #: Transports to load; None loads every installed production transport that can run here
    #: (a transport that is not meant for production is loaded only when named).
    transports: tuple[str, ...] | None = None
    #: Directory (a tmpfs) for the arena file.
    shm_dir: str = DEFAULT_SHM_DIR
    #: How often clients send heartbeats, and after how much silence a client is dropped.
    heartbeat_s: float = 1.0
    session_timeout_s: float = 3.0
    #: Largest message accepted; bigger ones are dropped by ZeroMQ before decoding.
    max_message_size: int = 16 << 20
    curve: CurveServerKeys | None = None
    #: The L2 tier under the arena (``--l2``), or None for L1 only.
    l2: TierConfig | None = None
    #: What clients can make the server hold (kvxfer.server.limits).
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        if self.chunk_size <= 0:
            raise ConfigError(f"chunk_size must be positive, got {self.chunk_size}")
        if self.l1_size <= 0:
            raise ConfigError(f"l1_size must be positive, got {self.l1_size}")
        if self.session_timeout_s <= self.heartbeat_s:
            raise ConfigError("session_timeout_s must be longer than heartbeat_s")
