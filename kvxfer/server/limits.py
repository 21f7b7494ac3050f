"""The server's limits on what clients can make it hold: defaults, options, and the checks.

Every resource a client can make the server hold has a limit here, per session and in all,
each with a ``kvxfer serve`` option (:data:`SPECS`, which the CLI and docs/reliability.md are
built from). A request that would pass one is refused with :class:`kvxfer.errors.LimitExceeded`,
whose message names the limit, its value and the option; nothing of that request is done.

Who checks what: :class:`kvxfer.server.engine.CacheServer` calls :meth:`Limits.check` on its
loop thread before it creates anything; the usage it checks is kept exact by
:class:`kvxfer.server.index.ChunkIndex` (reservations, leases) and by the engine (sessions,
registrations). ``max_unread_reply_bytes`` is enforced by :class:`kvxfer.mq.server.MQServer`,
``workers`` bounds :class:`kvxfer.server.workers.WorkerPool`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Final

from kvxfer.errors import ConfigError, LimitExceeded

__all__ = ["Limits", "LimitSpec", "SPECS"]


@dataclass(frozen=True, slots=True)
class LimitSpec:
    """How one limit is shown: its ``kvxfer serve`` option, what it counts, and the fix."""

    name: str
    option: str
    #: "count", "bytes" or "seconds"
    unit: str
    what: str
    #: What a client that hits it should do, besides asking for a higher limit.
    fix: str


SPECS: Final[dict[str, LimitSpec]] = {s.name: s for s in (
    LimitSpec("max_connections", "--max-connections", "count", "sessions open at once (handshaked connections)",
              "close idle clients"),
    LimitSpec("max_registrations", "--max-registrations", "count", "registered KV caches in all",
              "unregister (close) contexts no longer in use"),
    LimitSpec("max_registrations_per_session", "--max-registrations-per-session", "count",
              "registered KV caches of one session", "close contexts no longer in use"),
    LimitSpec("max_reservations", "--max-reservations", "count",
              "open reservations in all (uncommitted reserve_write/reserve_read, server-driven transfers; "
              "not promotions from L2)",
              "wait for transfers in flight"),
    LimitSpec("max_reservations_per_session", "--max-reservations-per-session", "count",
              "open reservations of one session", "commit the reservations it holds before reserving more"),
    LimitSpec("max_reserved_bytes_per_session", "--max-reserved-bytes-per-session", "bytes",
              "arena bytes held by one session's open reservations", "commit what it holds, or move less per request"),
    LimitSpec("max_leases", "--max-leases", "count", "open leases in all", "release leases once read"),
    LimitSpec("max_leases_per_session", "--max-leases-per-session", "count", "open leases of one session",
              "release leases once read (release_lease) or lease for less time"),
    LimitSpec("max_leased_bytes_per_session", "--max-leased-bytes-per-session", "bytes",
              "arena bytes pinned by one session's leases", "release leases once read"),
    LimitSpec("max_chunk_pins", "--max-chunk-pins", "count",
              "chunks held by open leases and read reservations in all (one held by two of them counts twice; "
              "each costs the server about 200 bytes)", "release leases once read and commit reads"),
    LimitSpec("max_chunk_pins_per_session", "--max-chunk-pins-per-session", "count",
              "chunks held by one session's open leases and read reservations (one held by two of them counts "
              "twice)", "release leases once read, commit reads, or look the same prefix up less often"),
    LimitSpec("max_waiting", "--max-waiting", "count",
              "requests waiting on the L2 store in all (lookups that ask it, reads and retrieves of chunks being "
              "promoted from it)", "wait for answers before sending more"),
    LimitSpec("max_waiting_per_session", "--max-waiting-per-session", "count",
              "requests of one session waiting on the L2 store", "wait for answers before sending more"),
    LimitSpec("max_lease_s", "--max-lease", "seconds", "longest lease", "ask for a shorter lease_s"),
    LimitSpec("max_name_length", "--max-name-length", "bytes", "longest model or client name (UTF-8)",
              "use a shorter name"),
    LimitSpec("max_registration_bytes", "--max-registration-bytes", "bytes",
              "one registration as sent (the transport's fields included: a client's strings and lists, which the "
              "server keeps while the KV cache is registered)",
              "check the registration's fields (a cuda_ipc one takes about 300 bytes a layer, more where "
              "PyTorch's expandable segments hold the KV cache: its handles grow 4 bytes per 20 MiB of it)"),
    LimitSpec("max_kv_cache_size", "--max-kv-cache-size", "bytes",
              "KV cache one registration may declare (layers x the bytes each layer's view spans, padding included)",
              "check num_blocks and the other sizes of the registration"),
    LimitSpec("max_unread_reply_bytes", "--max-unread-reply-bytes", "bytes",
              "reply bytes kept for a connection that does not read them (past it the connection's session "
              "is ended and its replies dropped)", "read replies"),
    LimitSpec("workers", "--workers", "count", "threads that run transfers (registrations share them; each "
              "registration's transfers stay in order)", ""),
)}


#: Most transfer threads ``--workers`` may ask for.
MAX_WORKERS: Final = 1024
#: The largest value of any limit (a signed 64-bit count: limits travel in status replies).
_MAX_LIMIT: Final = (1 << 63) - 1


def _fmt(spec: LimitSpec, value: float) -> str:
    if spec.unit == "bytes":
        from kvxfer.units import format_bytes

        return f"{format_bytes(value)}" if value >= 1024 else f"{value:.0f} bytes"
    if spec.unit == "seconds":
        return f"{value:g} s"
    return f"{value:.0f}"


@dataclass(frozen=True)
class Limits:
    """Every limit; ``None`` byte limits default to the arena's size (see :meth:`resolved`)."""

    #: Sessions open at once; a handshake beyond it is refused.
    max_connections: int = 1024
    max_registrations: int = 1024
    max_registrations_per_session: int = 64
    max_reservations: int = 16384
    max_reservations_per_session: int = 1024
    #: None: the arena's size.
    max_reserved_bytes_per_session: int | None = None
    max_leases: int = 65536
    max_leases_per_session: int = 4096
    #: None: the arena's size.
    max_leased_bytes_per_session: int | None = None
    #: Chunk references held by leases and read reservations (the index's memory for them).
    max_chunk_pins: int = 2 << 20
    max_chunk_pins_per_session: int = 1 << 18
    #: Requests waiting on L2 (each holds its message, a callback, a retrieve its lane place).
    max_waiting: int = 16384
    max_waiting_per_session: int = 1024
    max_lease_s: float = 600.0
    max_name_length: int = 512
    #: cuda_ipc: about 300 bytes a layer; with expandable segments each layer's handle grows 4
    #: bytes per 20 MiB of its storage (80 layers sharing an 80 GiB one: 1.3 MB).
    max_registration_bytes: int = 8 << 20
    max_kv_cache_size: int = 4 << 40
    max_unread_reply_bytes: int = 64 << 20
    workers: int = 16

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            most = MAX_WORKERS if f.name == "workers" else _MAX_LIMIT  # workers: threads
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= most:
                raise ConfigError(f"{SPECS[f.name].option} must be a positive number of at most {most}, "
                                  f"got {value!r}")

    def resolved(self, arena_size: int) -> Limits:
        """A copy whose ``None`` limits are set from the arena's size."""
        return dataclasses.replace(
            self,
            max_reserved_bytes_per_session=self.max_reserved_bytes_per_session or arena_size,
            max_leased_bytes_per_session=self.max_leased_bytes_per_session or arena_size,
        )

    def check(self, name: str, held: float, adding: float = 1) -> None:
        """Raise :class:`LimitExceeded` if ``held + adding`` passes limit ``name``."""
        limit = getattr(self, name)
        if held + adding > limit:
            raise self.exceeded(name, f"{_fmt(SPECS[name], held)} held, {_fmt(SPECS[name], adding)} more asked")

    def exceeded(self, name: str, detail: str) -> LimitExceeded:
        spec = SPECS[name]
        fix = f"{spec.fix}, or " if spec.fix else ""
        return LimitExceeded(
            f"limit {name} reached: {spec.what} may be at most {_fmt(spec, getattr(self, name))} ({detail}); "
            f"{fix}start the server with a higher `kvxfer serve {spec.option}`"
        )
