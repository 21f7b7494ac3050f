"""ServerConfig: everything `kvxfer serve` can set."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvxfer.arena import DEFAULT_SHM_DIR
from kvxfer.errors import ConfigError
from kvxfer.mq.server import CurveServerKeys, require_curve
from kvxfer.protocol import messages as m
from kvxfer.server.limits import Limits
from kvxfer.server.tier import TierConfig
from kvxfer.server.tuning import DEFAULT_WARM_S, MAX_BUSY_POLL_S, MAX_WARM_S, MIN_WARM_S
from kvxfer.urls import check_url, default_url

__all__ = ["ServerConfig", "MAX_BUSY_POLL_S", "MAX_METRICS_MODELS", "MIN_L1_SIZE", "MIN_MESSAGE_SIZE",
           "MAX_MESSAGE_SIZE", "MAX_SESSION_TIMEOUT_S", "MIN_SESSION_TIMEOUT_S", "MIN_HEARTBEAT_S", "MAX_CHUNK_SIZE"]

#: Upper bound of ``metrics_max_models``: every model label multiplies the series per metric.
MAX_METRICS_MODELS = 1024
#: Bounds of ``max_message_size``: a registration of a large cache through CUDA IPC takes some
#: hundreds of KiB; ZeroMQ's limit is a signed 64-bit count, a Python bytes object far less.
MIN_MESSAGE_SIZE = 64 << 10
MAX_MESSAGE_SIZE = 1 << 31
#: Smallest ``l1_size``: one page (a size given without a unit is bytes, and a few bytes are
#: never what was meant).
MIN_L1_SIZE = 4 << 10
#: Longest ``session_timeout_s`` (a dead client's registrations and reservations wait this long),
#: shortest (a millisecond timeout made every idle client send a heartbeat every few hundred
#: microseconds) and shortest ``heartbeat_s``: what clients accept in the handshake.
MAX_SESSION_TIMEOUT_S = m.MAX_SESSION_TIMEOUT_S
MIN_SESSION_TIMEOUT_S = m.MIN_SESSION_TIMEOUT_S
MIN_HEARTBEAT_S = m.MIN_HEARTBEAT_S
#: Longest chunk, in tokens (a chunk is at least one KV block of every layer).
MAX_CHUNK_SIZE = m.MAX_CHUNK_SIZE


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
    #: Serve Prometheus metrics at http://metrics_host:metrics_port/metrics (0: any free port);
    #: None serves none.
    metrics_port: int | None = None
    #: Address of the metrics endpoint; the default keeps it on this host.
    metrics_host: str = "127.0.0.1"
    #: Distinct model names that get their own label in figures and metrics; the rest share
    #: the label "__other__".
    metrics_max_models: int = 32
    #: After any activity the server's loop polls without blocking for this long (0: never):
    #: the loop's CPU stays busy, so a request that comes within it is handled without the
    #: wake-up of a sleeping thread (its own steps may still run cold; each client's heartbeat
    #: restarts the spin: docs/performance.md, "Busy polling").
    busy_poll_s: float = 0.0
    #: While the server is idle, a thread runs the CPU steps a server-driven request makes in the
    #: server on a chunk of its own this often, so that the next request's steps do not run cold
    #: (0: never, the default; kvxfer.server.warmth).
    warm_s: float = DEFAULT_WARM_S
    #: Stop, as on SIGTERM, once the process with this id is no longer the server's parent (it
    #: exited; ``--exit-with-parent``), checked on the loop's periodic pass; None: never. The
    #: server refuses to start unless it is its parent now.
    parent_pid: int | None = None

    def __post_init__(self) -> None:
        check_url(self.url)
        require_curve(self.url, self.curve)
        if not 0 < self.chunk_size <= MAX_CHUNK_SIZE:
            raise ConfigError(f"--chunk-size must be a positive number of tokens of at most {MAX_CHUNK_SIZE}, got "
                              f"{self.chunk_size}")
        if self.l1_size < MIN_L1_SIZE:
            raise ConfigError(f"--l1-size must be at least {MIN_L1_SIZE >> 10} KiB (a size takes a unit: 64MiB, 4GiB), "
                              f"got {self.l1_size} bytes")
        if not MIN_SESSION_TIMEOUT_S <= self.session_timeout_s <= MAX_SESSION_TIMEOUT_S:  # NaN fails too
            raise ConfigError(f"--session-timeout must be in [{MIN_SESSION_TIMEOUT_S:g}, {MAX_SESSION_TIMEOUT_S:g}] "
                              f"seconds, got {self.session_timeout_s!r}")
        if not MIN_HEARTBEAT_S <= self.heartbeat_s < self.session_timeout_s:
            raise ConfigError(f"heartbeat_s must be at least {MIN_HEARTBEAT_S:g} s and shorter than session_timeout_s "
                              f"({self.session_timeout_s:g} s), got {self.heartbeat_s!r}")
        if not MIN_MESSAGE_SIZE <= self.max_message_size <= MAX_MESSAGE_SIZE:
            raise ConfigError(f"--max-message-size must be in [{MIN_MESSAGE_SIZE >> 10} KiB, "
                              f"{MAX_MESSAGE_SIZE >> 30} GiB], got {self.max_message_size} bytes")
        if not 0 <= self.busy_poll_s <= MAX_BUSY_POLL_S:  # NaN fails too
            raise ConfigError(f"--busy-poll-us must be in [0, {round(MAX_BUSY_POLL_S * 1e6)}] microseconds, "
                              f"got {self.busy_poll_s * 1e6:.10g}")
        if self.warm_s != 0 and not MIN_WARM_S <= self.warm_s <= MAX_WARM_S:  # NaN fails too
            raise ConfigError(f"--warm-us must be 0 (off) or in [{MIN_WARM_S * 1e6:g}, {MAX_WARM_S * 1e6:g}] "
                              f"microseconds, got {self.warm_s * 1e6:.10g}")
        if self.parent_pid is not None and (isinstance(self.parent_pid, bool) or not isinstance(self.parent_pid, int)
                                            or self.parent_pid <= 0):
            raise ConfigError(f"parent_pid must be a positive process id or None, got {self.parent_pid!r}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics port must be in [0, 65535] (0: any free port), got {self.metrics_port}")
        if not self.metrics_host:
            raise ConfigError("metrics host must not be empty (127.0.0.1 keeps the endpoint on this host)")
        if not 0 <= self.metrics_max_models <= MAX_METRICS_MODELS:
            raise ConfigError(f"metrics max models must be in [0, {MAX_METRICS_MODELS}], "
                              f"got {self.metrics_max_models}")
