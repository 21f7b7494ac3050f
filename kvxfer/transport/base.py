"""The transport contract: what a plugin implements, who calls it, and in what order.

A transport plugin is an entry point in group ``kvxfer.transports`` whose target is a
:class:`Transport` subclass (or instance). It has two halves:

* client side, in the engine's process: a :class:`TransferContext` per registered KV cache,
  made by :meth:`Transport.client_context`; the connector calls ``submit_store`` and
  ``submit_retrieve`` and tracks the futures they return;
* server side, in the cache server: a :class:`ServerTransport`, made once per server by
  :meth:`Transport.server_transport`, which opens a :class:`ServerContext` per registration.

Two data-path styles, both served by the core so that transports stay small:

* ``Style.CLIENT_DRIVEN`` (cpu_gather, hpu): subclass
  :class:`kvxfer.transport.ClientDrivenContext` and implement two copy methods; the server side
  is the core's :class:`kvxfer.transport.ArenaServerTransport`, which copies nothing.
* ``Style.SERVER_DRIVEN`` (cuda_ipc): subclass :class:`kvxfer.transport.ServerDrivenContext`
  (client) and implement a :class:`ServerContext` whose ``store``/``retrieve`` do the copies.

Threading and ordering: each :class:`TransferContext` runs its transfers on one worker thread
in submission order; the server runs each instance's transfer requests in arrival order on
that instance's worker thread. A transport's methods are never called concurrently for one
context.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Final, Protocol, TypeVar, runtime_checkable

import msgspec
import torch

from kvxfer.layout import KVLayout, LayoutKind
from kvxfer.protocol.messages import Registration, RetrieveResult, StoreResult

if TYPE_CHECKING:
    from kvxfer.server.arena import Arena

__all__ = [
    "API_VERSION",
    "Style",
    "Probe",
    "Capabilities",
    "Connection",
    "RowCopy",
    "Transport",
    "TransferContext",
    "ServerTransport",
    "ServerContext",
]

#: The contract version this core implements. A plugin declaring another is refused.
API_VERSION: Final = 1

M = TypeVar("M", bound=msgspec.Struct)


class Style(str, enum.Enum):
    CLIENT_DRIVEN = "client_driven"
    SERVER_DRIVEN = "server_driven"


@dataclass(frozen=True, slots=True)
class Probe:
    """Whether a transport can run in this process, and if not, why."""

    available: bool
    #: Why not (when unavailable), or a note such as which devices it found.
    reason: str = ""
    #: torch device types it can serve here (``"cpu"``, ``"cuda"``, ``"hpu"``, ...).
    device_types: tuple[str, ...] = ()


_ALL_DTYPES: Final = frozenset(
    {"float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2"}
)


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a transport claims to support. The conformance kit tests exactly these claims."""

    #: torch device types whose KV tensors it can move (``"*"``: any).
    device_types: frozenset[str]
    layouts: frozenset[LayoutKind] = field(default_factory=lambda: frozenset(LayoutKind))
    dtypes: frozenset[str] = _ALL_DTYPES

    def serves(self, device: torch.device) -> bool:
        return "*" in self.device_types or device.type in self.device_types


@runtime_checkable
class Connection(Protocol):
    """What a transfer context may use of its :class:`kvxfer.CacheClient` (one handshaked
    connection to the server). Thread-safe."""

    url: str
    chunk_size: int
    arena_path: str
    arena_size: int

    def submit(self, name: str, payload: msgspec.Struct, timeout: float | None = None) -> Future[Any]:
        """Send request ``name``; the future resolves to its reply Struct or raises a
        :class:`kvxfer.errors.KvxferError`."""
        ...

    def request(self, name: str, payload: msgspec.Struct, timeout: float | None = None) -> Any:
        """``submit(...).result()``."""
        ...


@dataclass(frozen=True, slots=True)
class RowCopy:
    """One copy between engine rows and one arena slot, for all layers at once.

    ``rows`` are row ids (int64, CPU) into each layer's row view (:meth:`KVLayout.row_view`);
    ``slot`` is ``[num_layers, len(rows), row_elems]`` of the layout's dtype, a view of the
    arena. Store copies ``layer_rows[rows] -> slot[layer]``; retrieve the reverse.
    """

    rows: torch.Tensor
    slot: torch.Tensor


# --------------------------------------------------------------------------- client side


class TransferContext(ABC):
    """One registered KV cache, client side: what a connector calls.

    Made by :meth:`Transport.client_context`, registered by :meth:`register` (the client does
    both in :meth:`kvxfer.CacheClient.register`). ``submit_*`` may be called from any thread;
    the transfers run in submission order. A future resolves when the bytes have arrived (in
    the server for a store, in the engine's blocks for a retrieve) or raises a
    :class:`kvxfer.errors.KvxferError`. After :meth:`close`, ``submit_*`` raise. Done-callbacks
    run on a thread of the context (never one inside ``submit_*``), so they may submit the next
    request; they must not call :meth:`close`, which waits for that thread.

    ``keys`` are chunk hashes from :func:`kvxfer.chunk_hashes`; ``block_ids`` are the engine's
    blocks for those chunks in order, ``chunk_size // block_size`` per chunk.
    """

    transport_name: str
    instance_id: int
    layout: KVLayout

    @abstractmethod
    def register(self) -> None:
        """Send the registration; called once by the client before any transfer. Raises a
        :class:`kvxfer.errors.RemoteError` if the server refuses it."""

    @abstractmethod
    def submit_store(self, keys: Sequence[bytes], block_ids: Sequence[int] | torch.Tensor) -> Future[StoreResult]:
        """Store the chunks ``keys`` from ``block_ids``; chunks the server has are skipped.
        The engine must not overwrite those blocks before the future is done."""

    @abstractmethod
    def submit_retrieve(
        self,
        keys: Sequence[bytes],
        block_ids: Sequence[int] | torch.Tensor,
        skip_first_n_tokens: int = 0,
        lease_id: int = 0,
    ) -> Future[RetrieveResult]:
        """Load the chunks ``keys`` into ``block_ids``, leaving the blocks of the first
        ``skip_first_n_tokens`` tokens (a multiple of the block size) untouched. Missing
        chunks are reported in the result and their blocks left untouched. ``lease_id``
        (from :meth:`kvxfer.CacheClient.lookup`) is released for this rank when done."""

    @abstractmethod
    def close(self) -> None:
        """Wait for submitted transfers, unregister, release resources. Idempotent."""

    def __enter__(self) -> TransferContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- server side


#: What a server-driven copy may return: wait for the copy it started (see ServerContext.store).
Waiter = Callable[[], None]


class ServerContext(ABC):
    """One registration, server side. Its methods run on the instance's worker thread, one at
    a time, in request order."""

    #: Struct of per-request ``params`` of store/retrieve (server-driven), or None.
    params_type: ClassVar[type[msgspec.Struct] | None] = None

    def store(self, copies: list[RowCopy], params: Any) -> Waiter | None:
        """Server-driven only: copy engine rows into the arena slots of ``copies``. Raise to
        fail the request (the slots are then dropped).

        Return None when the bytes are in the slots, or a *waiter*: a callable that returns once
        they are (raising if the copy failed). The server calls a waiter off the instance's
        worker thread, so the next request's copies can be queued while this one finishes;
        the transport must then order consecutive requests' copies itself (e.g. one stream)."""
        raise NotImplementedError(f"{type(self).__name__} does not do server-driven stores")

    def retrieve(self, copies: list[RowCopy], params: Any) -> Waiter | None:
        """Server-driven only: copy arena slots into engine rows; returns as :meth:`store`."""
        raise NotImplementedError(f"{type(self).__name__} does not do server-driven retrieves")

    def status(self) -> dict[str, str]:
        return {}

    def close(self) -> None:
        """Release what :meth:`ServerTransport.open` acquired. Must not raise."""


class ServerTransport(ABC):
    """A transport's server half: one per transport per server process."""

    def start(self, arena: Arena) -> None:
        """Called once, on the server's loop, before any registration (e.g. to pin the arena
        for DMA). Raising disables the transport in this server, with the error in status."""

    @abstractmethod
    def open(self, registration: Registration, layout: KVLayout) -> ServerContext:
        """Open the server side of a registration already validated by the core (layout,
        sizes). Runs on the instance's worker thread; may block (e.g. open IPC handles).
        Raise :class:`kvxfer.errors.ConfigError` with a message for the user to refuse it."""

    def status(self) -> dict[str, str]:
        return {}

    def close(self) -> None:
        """Server shutdown."""


# --------------------------------------------------------------------------- the plugin


class Transport(ABC):
    """The object an entry point in ``kvxfer.transports`` names (a subclass or an instance).

    Class attributes state the contract: ``name`` (what users type, equal to the entry point
    name), ``api_version`` (must equal :data:`API_VERSION`), ``style``, ``registration_type``
    (a :class:`Registration` subclass, decoded by the server with this type),
    ``capabilities`` and ``auto_priority`` (``"auto"`` picks the available transport with the
    highest priority among those that serve the KV tensors' device).
    """

    name: ClassVar[str]
    api_version: ClassVar[int]
    style: ClassVar[Style]
    registration_type: ClassVar[type[Registration]] = Registration
    capabilities: ClassVar[Capabilities]
    auto_priority: ClassVar[int] = 0

    @abstractmethod
    def probe(self) -> Probe:
        """Can this transport run in this process? Cheap, never raises, imports nothing heavy
        that is absent (answer ``Probe(False, reason)`` instead)."""

    def priority_for(self, device: torch.device) -> int:
        """Rank in ``"auto"`` for KV tensors on ``device`` (higher wins): ``auto_priority``,
        unless a transport ranks device types differently (e.g. below the fallback for one)."""
        return self.auto_priority

    def serves(self, device: torch.device) -> bool:
        """Whether it can move KV tensors on ``device`` here."""
        probe = self.probe()
        return probe.available and self.capabilities.serves(device) and (
            "*" in probe.device_types or device.type in probe.device_types
        )

    @abstractmethod
    def client_context(
        self, connection: Connection, layers: list[torch.Tensor], layout: KVLayout, identity: InstanceIdentity
    ) -> TransferContext:
        """A new, unregistered client context for ``layers`` (already checked against
        ``layout``). Raise :class:`kvxfer.errors.ConfigError` for tensors it cannot serve."""

    @abstractmethod
    def server_transport(self) -> ServerTransport:
        """The server half; called once per server process."""


@dataclass(frozen=True, slots=True)
class InstanceIdentity:
    """Who a registration is: the fields of :class:`Registration` that are not layout."""

    instance_id: int
    model_name: str
    world_size: int
    rank: int

    def registration_fields(self, layout: KVLayout) -> dict[str, Any]:
        """Keyword arguments for a :class:`Registration` (sub)class, identity plus layout."""
        from kvxfer.layout import dtype_name

        return dict(
            instance_id=self.instance_id,
            model_name=self.model_name,
            world_size=self.world_size,
            rank=self.rank,
            layout=layout.kind.value,
            num_layers=layout.num_layers,
            num_blocks=layout.num_blocks,
            block_size=layout.block_size,
            hidden_dim_size=layout.hidden_dim_size,
            dtype=dtype_name(layout.dtype),
            use_mla=layout.use_mla,
            row_elems=layout.row_elems,
            row_pitch=layout.row_pitch,
            run_offsets=list(layout.run_offsets),
            block_stride=layout.block_stride,
            page=layout.page,
        )

