"""The transport contract: everything a transport plugin declares, overrides or receives.

A transport is a :class:`Transport` subclass named by an entry point in group
``kvxfer.transports``. It declares, once, on that class: ``name``, ``api_version``,
``capabilities``, ``probe()``, its :class:`Registration` subclass (``registration_type``), its
client context class (``context_type``) and, for the server-driven style, its server context
class (``server_context_type``). The core does the rest:

* **client-driven** (cpu_gather, hpu): ``context_type`` subclasses :class:`ClientDrivenContext`
  and implements :meth:`~ClientDrivenContext.gather` and :meth:`~ClientDrivenContext.scatter`;
  the server side is the core's (slots in the shared-memory arena, no copies).
* **server-driven** (cuda_ipc, the example ``file_debug``): ``context_type`` subclasses
  :class:`ServerDrivenContext` (optional hooks: :meth:`~ServerDrivenContext.prepare`,
  :meth:`~ServerDrivenContext.finish_retrieve`, :meth:`~ServerDrivenContext.release_params`),
  and ``server_context_type`` subclasses :class:`ServerContext` (``store`` and ``retrieve``
  copy on the server). A transport that needs per-server state (e.g. pinning the arena) also
  overrides :meth:`Transport.server_transport` with a :class:`ServerTransport` subclass.

The style follows from the context's base class. The threads, queues and locks behind both
styles are the core's (private modules); a transport never sees them.

**Threads and order.** Client side: each context runs its transfers on one worker thread in
submission order; its hooks run on that thread, never two at once, except
:meth:`TransferContextBase.on_submit` (the submitting thread; so does a server-driven
``prepare`` with :attr:`ServerDrivenContext.prepare_inline`, when nothing is queued ahead), waiters,
``finish_retrieve`` and ``release_params`` (the context's finisher thread, in request order)
and ``release`` (the thread that closes the context); the done-callbacks of the futures
``submit_*`` return run on that finisher too. Server side: :meth:`ServerTransport.start` runs on the
server's loop; ``open``, ``store``, ``retrieve`` and ``close`` of one registration run on that
registration's worker thread, one at a time, in arrival order; waiters on a separate thread.

**Errors.** Raise :class:`kvxfer.errors.ConfigError` ("field: what is wrong, what to do") for
input the user can fix. Anything else a hook raises (``SystemExit`` and ``KeyboardInterrupt``
included, but on the main thread of an engine's process, where signal handlers raise them) is
caught at the core's one boundary and re-raised as
:class:`kvxfer.errors.TransportFailed` naming the transport and the step, with the original as
``__cause__`` (server side: an ``internal`` error reply with that message). Client futures
therefore fail only with :class:`kvxfer.errors.KvxferError`.

**Defined beside it.** Four types and two functions a transport uses live with the code that
makes them and are re-exported by :mod:`kvxfer.transport`: :class:`~kvxfer.copies.RowCopy` and
:class:`~kvxfer.copies.StoredSlot` (what one copy moves; ``kvxfer.copies``),
:class:`~kvxfer.layout.KVLayout` with :func:`~kvxfer.layout.copy_dtype` and
:func:`~kvxfer.layout.copy_view` (``kvxfer.layout``: rows as wide integer elements, for copies at
memcpy speed) and :class:`~kvxfer.protocol.messages.Registration` (``kvxfer.protocol.messages``).
Their docstrings are part of this contract. :mod:`kvxfer.transport` also offers helpers a
transport may use and need not: :class:`~kvxfer.copies.HostRows` and
:func:`~kvxfer.copies.host_copy_threads` (row copies between host tensors and slots, in C),
``torch_build`` and ``cuda_devices`` (what ``probe()`` may ask without importing torch),
``Arena``, ``ArenaMapping`` and ``transport_dir_path`` (the server's arena and a private
directory), and ``MetricSample`` (figures for the ``kvxfer_metrics`` hook). The futures ``submit_*`` return
(:class:`~kvxfer.transport.futures.TransferFuture`, :class:`~kvxfer.transport.futures.LayerwiseFuture`)
are the engine's side of the API, in :mod:`kvxfer.transport.futures`: a transport's hooks never see them.
"""

from __future__ import annotations

import enum
import inspect
import os
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Final, Generic, Literal, Protocol, TypeVar, get_args, get_origin

import msgspec

from kvxfer.copies import RowCopy, StoredSlot
from kvxfer.layout import KVLayout, LayoutKind, dtype_name
from kvxfer.protocol.messages import Message, Registration, Request, RetrieveResult, StoreResult

if TYPE_CHECKING:  # the contract names tensors and devices; importing it imports no torch
    import torch

    from kvxfer.arena import Arena, ArenaMapping

__all__ = [
    "API_VERSION",
    "Capabilities",
    "ClientDrivenContext",
    "Connection",
    "InstanceIdentity",
    "LayerwiseFuture",
    "TransferFuture",
    "Probe",
    "RowCopy",
    "StoredSlot",
    "ServerContext",
    "ServerDrivenContext",
    "Queued",
    "ServerTransport",
    "Style",
    "Transfer",
    "TransferContext",
    "TransferContextBase",
    "TransferKind",
    "Transport",
    "Waiter",
]

#: The contract version this core implements. A plugin declaring another is refused.
API_VERSION: Final = 2

R = TypeVar("R", bound=Registration)
LT = TypeVar("LT")
P = TypeVar("P", bound=msgspec.Struct)
Reply = TypeVar("Reply", bound=Message)

#: What a copy may return instead of waiting for it: a callable that returns once the copy is
#: done and raises if it failed. The core calls it on another thread (see each style).
Waiter = Callable[[], None]



class Queued:
    """What :meth:`ServerContext.retrieve` returns, instead of a :data:`Waiter`, when the copies
    are queued and the request's params gave the client a way to wait for their end itself (e.g.
    an interprocess event of the engine's that the copies record): the core then answers the
    request at once, and runs ``waiter`` on another thread to unpin the chunks once the copies
    are done. The client transport's :meth:`ServerDrivenContext.finish_retrieve` must wait for
    that end before it returns. A copy that fails after the answer can no longer fail the
    request: the server logs it and counts the chunks as not loaded. Return it only when the
    copies are certain to end (queued on a device, nothing left that may raise)."""

    __slots__ = ("waiter",)

    def __init__(self, waiter: Waiter) -> None:
        self.waiter = waiter


#: A request's kind, as the hooks see it.
TransferKind = Literal["store", "retrieve"]


class Style(str, enum.Enum):
    """Who copies: the engine's process (client-driven) or the server (server-driven)."""

    CLIENT_DRIVEN = "client_driven"
    SERVER_DRIVEN = "server_driven"


@dataclass(frozen=True, slots=True)
class Probe:
    """Whether a transport can run in this process, and if not, why."""

    available: bool
    #: Why not (when unavailable, with what to do), or a note such as which devices it found.
    reason: str = ""
    #: torch device types it can serve here (``"cpu"``, ``"cuda"``, ``"hpu"``, ``"*"``: any).
    device_types: tuple[str, ...] = ()


#: What a transport claims by default: the dtypes the kit tests, 16-, 32- and 8-bit (``uint8`` is
#: how vLLM holds an fp8 KV cache, ``--kv-cache-dtype fp8``). Copies must be byte-wise (bytes
#: reinterpreted, never converted: a value conversion keeps 16- and 32-bit numbers and integers
#: yet changes NaN payloads and fp8 bytes), and the kit checks every claimed dtype.
_ALL_DTYPES: Final = frozenset({"float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2", "uint8", "int8"})


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a transport claims to support. The conformance kit tests exactly these claims, and
    the core registers nothing else with it (:meth:`refusal`; ``"auto"`` passes it over). Every
    field but ``device_types`` is a keyword (two are bools, easy to swap by position)."""

    #: torch device types whose KV tensors it can move (``"*"``: any).
    device_types: frozenset[str]
    _: KW_ONLY
    layouts: frozenset[LayoutKind] = field(default_factory=lambda: frozenset(LayoutKind))
    dtypes: frozenset[str] = _ALL_DTYPES
    #: Its copy code honours :attr:`RowCopy.first_layer` (copies of a range of layers, for
    #: transfers moved layer by layer). Without it, a layer-by-layer transfer still works, but
    #: each of its layers completes only when the whole transfer does.
    layer_ranges: bool = False
    #: Whether it moves layers that are not contiguous tensors: current vLLM's views in most of
    #: its ``KVCacheLayout``\ s (pages permuted, padded, a run per head, several layers
    #: interleaved in one buffer). False: it is handed only layers whose
    #: ``Tensor.is_contiguous()`` is true (the older kinds; vLLM's ``LBHNC`` without padding).
    strided_layers: bool = True

    def serves(self, device: torch.device) -> bool:
        return "*" in self.device_types or device.type in self.device_types

    def refusal(self, layout: KVLayout, layers: Sequence[torch.Tensor]) -> str | None:
        """Why a transport with these capabilities cannot move ``layers`` (of ``layout``), or None."""
        if layout.kind not in self.layouts:
            return (f"does not move {layout.kind.value} KV caches (it claims "
                    f"{', '.join(sorted(k.value for k in self.layouts)) or 'none'})")
        dtype = dtype_name(layout.dtype)
        if dtype not in self.dtypes:
            return f"does not move {dtype} KV caches (it claims {', '.join(sorted(self.dtypes)) or 'none'})"
        if not self.strided_layers:
            for i, t in enumerate(layers):
                if not t.is_contiguous():
                    return (f"moves only contiguous layers, and layer {i} is a {list(t.shape)} view with strides "
                            f"{list(t.stride())} (with vLLM, VLLM_KV_CACHE_LAYOUT=LBHNC gives contiguous layers "
                            f"unless pages are padded)")
        return None


@dataclass(frozen=True, slots=True)
class InstanceIdentity:
    """Who a registration is: the fields of :class:`Registration` that are not layout."""

    instance_id: int
    model_name: str
    world_size: int
    rank: int

    @classmethod
    def fresh(cls, model_name: str, world_size: int, rank: int) -> InstanceIdentity:
        """A new identity under a random instance id (62 bits, never 0)."""
        return cls(secrets.randbits(62) + 1, model_name, world_size, rank)

    def renewed(self) -> InstanceIdentity:
        """The same identity under a fresh instance id."""
        return InstanceIdentity.fresh(self.model_name, self.world_size, self.rank)

    def registration_fields(self, layout: KVLayout) -> dict[str, Any]:
        """Keyword arguments for a :class:`Registration` (sub)class, identity plus layout."""
        return dict(
            instance_id=self.instance_id, model_name=self.model_name, world_size=self.world_size,
            rank=self.rank, layout=layout.kind.value, num_layers=layout.num_layers,
            num_blocks=layout.num_blocks, block_size=layout.block_size,
            hidden_dim_size=layout.hidden_dim_size, dtype=dtype_name(layout.dtype), use_mla=layout.use_mla,
            row_elems=layout.row_elems, row_pitch=layout.row_pitch, run_offsets=list(layout.run_offsets),
            block_stride=layout.block_stride, page=layout.page, pid=os.getpid(),
        )


@dataclass(slots=True)
class Transfer:
    """One store or retrieve, as the hooks of a context see it (made by the core at submit)."""

    kind: TransferKind
    #: Chunk hashes, one per chunk.
    keys: list[bytes]
    #: The engine's block ids (int64, CPU), ``blocks_per_chunk`` per key, already validated.
    blocks: torch.Tensor
    #: Leading blocks a retrieve leaves untouched (``skip_first_n_tokens // block_size``).
    skip_blocks: int = 0
    #: What :meth:`TransferContextBase.on_submit` returned for this request.
    token: Any = None
    #: Server-driven, as :meth:`ServerDrivenContext.release_params` sees it: False where the
    #: server may still be copying with what the params name (the connection was lost, or the
    #: core could not wait for a late answer); True when it answered (in time or late), never
    #: got the request, or its session ended.
    server_done: bool = True
    #: Server-driven: the layers this request moves, when a layer-wise retrieve is sent as one
    #: request per group of layers (``layer_ranges`` claimed, the server has the
    #: ``retrieve_layers`` feature, and the transfer makes two groups or more). Each such part is
    #: a request of its own to every hook: its own token (made at submit, on the submitting
    #: thread), its own ``finish_retrieve`` with that part's result (only the last part carries
    #: the lease, so a chunk may load in one part and be missing in another), its own
    #: ``release_params``; once one part fails, those not sent yet never are. None: every layer
    #: (every store; a retrieve sent whole). A client-driven context's copies carry their layers
    #: instead (:attr:`RowCopy.first_layer`).
    layers: range | None = None


class Connection(Protocol):
    """What a context uses of its :class:`kvxfer.CacheClient` (one handshaked connection to the
    server; thread-safe). The core's data paths use exactly this; a transport rarely needs it."""

    url: str
    chunk_size: int
    arena_path: str
    arena_size: int
    #: Default seconds a request may take.
    timeout: float
    #: Seconds of silence after which the server drops this client's session (its handshake).
    session_timeout: float
    #: Optional server features named in its handshake (e.g. ``"retrieve_layers"``).
    features: frozenset[str]

    @property
    def epoch(self) -> int:
        """Changes with each handshake: odd while one is under way, a new even number once it
        is done. A context registered in an older epoch must register again."""
        ...

    def submit(self, payload: Request[Reply], timeout: float | None = None) -> Future[Reply]:
        """Send ``payload`` (its type names the request); the future resolves to the request's
        reply Struct or raises a :class:`kvxfer.errors.KvxferError`. Messages reach the server
        in the order they were submitted, whichever threads submit them."""
        ...

    def request(self, payload: Request[Reply], timeout: float | None = None) -> Reply:
        """``submit(payload).result()``."""
        ...

    def reconnect(self, context: TransferContextBase | None = None) -> None:
        """Re-open the session if the server lost it and register ``context`` again."""
        ...

    def forget(self, context: TransferContextBase) -> None:
        """``context`` closed: stop re-registering it."""
        ...


# --------------------------------------------------------------------------- client side

# What submit_* return (engines and connectors wait on them; a transport's hooks never see them).
from kvxfer.transport.futures import LayerwiseFuture, TransferFuture  # noqa: E402


class TransferContext(ABC):
    """One registered KV cache, client side: what a connector calls.

    Made and registered by :meth:`kvxfer.CacheClient.register`. ``submit_*`` may be called from
    any thread; the transfers run in submission order. A future resolves when the bytes have
    arrived (in the server for a store, in the engine's blocks for a retrieve) or raises a
    :class:`kvxfer.errors.KvxferError`. After :meth:`close`, ``submit_*`` raise. Each future is a
    :class:`TransferFuture`: its done-callbacks run on the context's finisher thread (never one
    inside ``submit_*``), so they may submit the next request; they must not call :meth:`close`,
    which waits for that thread.

    ``keys`` are chunk hashes from :func:`kvxfer.chunk_hashes`; ``block_ids`` are the engine's
    blocks for those chunks in order, ``chunk_size // block_size`` per chunk.
    """

    transport_name: str
    instance_id: int
    layout: KVLayout
    chunk_size: int

    @abstractmethod
    def submit_store(self, keys: Sequence[bytes], block_ids: Sequence[int] | torch.Tensor, *,
                     by_layer: bool = False) -> Future[StoreResult]:
        """Store the chunks ``keys`` from ``block_ids``; chunks the server has are skipped.
        The engine must not overwrite those blocks before the future is done (or cancelled:
        ``cancel()`` succeeds until the copy starts, and then nothing is stored). ``block_ids``
        itself is read before this returns (a tensor is copied): the caller may reuse it at once;
        so for :meth:`submit_retrieve`.

        ``by_layer``: the blocks are still being computed, layer after layer; the future is a
        :class:`LayerwiseFuture` and the caller tells it, with ``layer_ready(i)``, when layers
        ``0..i`` are written (the reservation goes out at once, each layer is copied as it
        becomes ready where the transport allows). Nothing waits for those declarations on the
        context's threads: a retrieve submitted while such a store still awaits layers is not
        held back for it (it may not see that store's chunks)."""

    @abstractmethod
    def submit_retrieve(
        self,
        keys: Sequence[bytes],
        block_ids: Sequence[int] | torch.Tensor,
        skip_first_n_tokens: int = 0,
        lease_id: int = 0,
        *,
        by_layer: bool = False,
    ) -> Future[RetrieveResult]:
        """Load the chunks ``keys`` into ``block_ids``, leaving the blocks of the first
        ``skip_first_n_tokens`` tokens (a multiple of the block size) untouched. Missing
        chunks are reported in the result and their blocks left untouched. A block named twice
        gets the rows of one of its chunks, which one is not defined (the copies run in no set
        order). ``lease_id`` (from :meth:`kvxfer.CacheClient.lookup_and_lease`) is released for
        this rank when done.

        The future's ``cancel()`` succeeds until the copy starts (client-driven: before the
        copy into the blocks; server-driven: before the request is sent), and a cancelled
        retrieve never writes the blocks. Once ``cancel()`` returns False the copy may be
        running: the blocks are the engine's again only when the future is done. A server-driven
        server copies nothing once the client has stopped waiting for the reply.

        ``by_layer``: the future is a :class:`LayerwiseFuture` whose ``wait_layer(i)`` returns
        once layer ``i`` has landed (the core copies layer after layer); it can be cancelled
        until its first part's copy starts."""

    @abstractmethod
    def close(self) -> None:
        """Wait for submitted transfers, unregister, release resources. Idempotent."""

    def __enter__(self) -> TransferContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# The core's machinery behind both styles (threads, queues, locks). Imported here, after the
# types above, because it builds Transfer records; a transport never imports these modules.
from kvxfer.transport._client_driven import ClientDrivenCore  # noqa: E402  (needs the types above)
from kvxfer.transport._context import ContextCore  # noqa: E402  (needs the types above)
from kvxfer.transport._server_driven import ServerDrivenCore  # noqa: E402  (needs the types above)


class TransferContextBase(ContextCore, TransferContext):
    """What both styles share; a transport subclasses one of the two styles below.

    Made by the core as ``context_type(transport, connection, layers, layout, identity)``
    (override :meth:`Transport.client_context` to pass more). Attributes for the hooks, the
    core's to set (a context class that sets one, or a private name of the core's, is refused at
    registration): ``transport``, ``transport_name``, ``connection``, ``layers`` (the KV tensors,
    checked against ``layout``), ``layout``, ``identity``, ``instance_id``, ``chunk_size``,
    ``blocks_per_chunk``, ``chunk_bytes``, ``epoch`` (the session it is registered in), and for a
    client-driven context ``arena``. Name the transport's own attributes apart (``_spool_lock``).

    A layer-wise transfer (``by_layer=True``) is copied in parts, each a range of layers: a
    request each (server-driven) or a round of :meth:`~ClientDrivenContext.gather`/
    :meth:`~ClientDrivenContext.scatter` calls (client-driven). Three class attributes bound
    them: at most ``max_layer_parts`` parts (one per layer at most), each part moving at least
    ``min_layer_part_bytes`` in all (a transfer of fewer bytes is one part) and at least
    ``min_layer_chunk_bytes`` of each of its chunks. A part costs a fixed time besides its copy,
    and each chunk in it a little more (a copy to queue, a kernel to launch); set the floors
    where the copies outlast those, or the parts run slower than the whole transfer would
    (defaults: 64 parts, no floors; a server-driven transfer, 8 parts).
    """

    def registration_extra(self) -> dict[str, Any]:
        """The transport's own registration fields (those of its ``registration_type`` beyond
        :class:`Registration`). Called on the caller's thread at registration, and again on the
        worker when the context registers again after a server restart."""
        return {}

    def on_submit(self, kind: TransferKind) -> Any:
        """Called on the submitting thread inside ``submit_store``/``submit_retrieve``, once the
        request is validated and before it is queued; the core hands what it returns to this
        request's hooks as ``transfer.token`` (e.g. an event recorded on the caller's current
        device stream, which the copies then wait for). Requests and tokens pair up whatever
        threads submit. Default: None."""
        return None

    def release(self) -> None:
        """Free client-side resources (mappings, pinned memory, files). Called once, by
        :meth:`close`, after the last transfer and the unregister."""


class ClientDrivenContext(ClientDrivenCore, TransferContextBase):
    """Client-driven style: the engine's process copies between its KV cache and the server's
    shared-memory arena (mapped once, ``self.arena``).

    Store: ``reserve_write`` -> :meth:`gather` into the reserved slots -> ``commit_write``.
    Retrieve: ``reserve_read`` -> :meth:`scatter` out of the pinned slots -> ``commit_read``.
    Each request's reserve is sent at submit, so its round trip overlaps earlier copies. If a
    copy (or its waiter) raises, the reservation is committed as failed (nothing half written
    becomes readable) and the future raises :class:`kvxfer.errors.TransportFailed`. Chunks the
    server already has, or lacks, never reach the copy methods.
    """

    def on_arena(self, arena: ArenaMapping) -> Callable[[], None] | None:
        """Called once the arena is mapped (when the context is made, before your ``__init__``
        body runs, and again after a server restart); return a callable that the core calls
        before it unmaps the arena (e.g. pin the mapping for the device's DMA, and unpin).
        Default: nothing."""
        return None

    @abstractmethod
    def gather(self, copies: list[RowCopy], transfer: Transfer) -> Waiter | None:
        """Copy, for every layer ``l``, ``row_view(layers[l])[copy.rows]`` into ``copy.slot[l]``.

        Return None once the bytes are in the slots, or a :data:`Waiter` that returns once they
        are. The core calls a waiter on the context's finisher thread and commits after it, so
        the worker can queue the next request's copies meanwhile; the transport must then order
        consecutive requests' copies itself (e.g. on one stream).

        The core may split one transfer's copies over several calls (in order, each call's
        waiter covering its own copies): write copy code that depends only on the copies it is
        given and on ``transfer``, never on seeing a whole request at once."""

    @abstractmethod
    def scatter(self, copies: list[RowCopy], transfer: Transfer) -> Waiter | None:
        """Copy, for every layer ``l``, ``copy.slot[l]`` into ``row_view(layers[l])[copy.rows]``.
        Return None once the slots have been read and the engine can read the blocks (or its
        stream is ordered after the copy), or a :data:`Waiter` that returns once that is so."""


class ServerDrivenContext(ServerDrivenCore, TransferContextBase, Generic[P]):
    """Server-driven style, client half: requests carry block ids (and the transport's params
    Struct ``P``); the server's :class:`ServerContext` copies.

    Per request, on the worker and in submission order, :meth:`prepare` makes the params, and
    the request is sent (on the submitting thread instead, with :attr:`prepare_inline`, when
    nothing is queued ahead). When its reply arrives, on the finisher and in the same order,
    :meth:`finish_retrieve` runs (retrieves only), then :meth:`release_params` (every request,
    failed or not), and only then does the future resolve. A request cancelled before it was
    sent has been prepared and is never sent: :meth:`finish_retrieve` does not run for it,
    :meth:`release_params` does (free what a request holds there, not in ``finish_retrieve``).

    ``max_in_flight`` requests may be at the server at once. With 1 (the default), a request is
    prepared only after the previous one finished. With more, the server starts the next copy
    while a reply travels back; the hooks must then tolerate overlapping requests (give each
    its own staging resources). A retrieve is never sent before the stores ahead of it are
    answered.
    """

    #: Requests at the server at once.
    max_in_flight: ClassVar[int] = 1
    #: Your :meth:`prepare` is cheap and thread-safe: the core may run it (and send the request)
    #: on the submitting thread, inside ``submit_*``, when no request of this context is queued
    #: ahead, a place in the window is free and nothing needs waiting for; a lone request then
    #: skips the hand-off to the worker thread. Requests keep submission order either way.
    prepare_inline: ClassVar[bool] = False

    def prepare(self, transfer: Transfer) -> P | None:
        """The params of ``transfer`` (a Struct the server decodes with its ``params_type``), made
        right before it is sent; stage data that depends on its blocks here. Default: None."""
        return None

    def finish_retrieve(self, transfer: Transfer, params: P | None, result: RetrieveResult) -> None:
        """Runs once the server answered a retrieve, before its future resolves: place staged
        bytes into the blocks of the chunks in ``result.loaded`` only, past the request's first
        ``transfer.skip_blocks`` blocks (those stay as they are), and only their layers in
        ``transfer.layers`` (every layer when None); where the server context may answer before
        its copies end (:class:`Queued`), wait here for their end, as ``params`` told the server
        to signal it. Default: nothing."""

    def release_params(self, transfer: Transfer, params: P | None) -> None:
        """Runs once after every request that reached :meth:`prepare` or got a token (answered,
        failed, or cancelled before it was sent), before its future resolves: free what
        :meth:`prepare` and :meth:`on_submit` took. For a request whose answer the client stopped
        waiting for (its future failed with ``RequestTimeout``) it runs once the server has
        answered it late, the session is opened anew or the context closes: until then the
        server may still copy with what ``params`` name. Where ``transfer.server_done`` is False
        (the core could not wait for that), give what ``params`` name to no other request.
        Default: nothing."""


# --------------------------------------------------------------------------- server side


def _type_args(cls: type, base: type) -> tuple[Any, ...]:
    """The type arguments ``cls`` (or its nearest ancestor) gave the generic ``base``."""
    for klass in cls.__mro__:
        for orig in getattr(klass, "__orig_bases__", ()):
            if get_origin(orig) is base:
                return get_args(orig)
    return ()


class ServerContext(ABC, Generic[R, P]):
    """One registration of a server-driven transport, server side: ``ServerContext[R, P]`` with
    ``R`` the transport's registration Struct and ``P`` its params Struct.

    The core makes it as ``server_context_type(registration, layout)`` on the registration's
    worker thread (the registration already validated: layout, sizes, a unique instance id);
    ``__init__`` may block (e.g. open IPC handles) and raises ``ConfigError("field: ...")`` to
    refuse it. Then ``store``/``retrieve`` run on the same thread (or the server's loop, see
    :attr:`queues_only`), one at a time, in arrival order, with ``params`` decoded as ``P`` (bad
    params are refused before your code runs; absent ones are ``P()``), and :meth:`close` once,
    after the last of them.
    """

    #: ``P``, read from the class's type arguments (None when it takes no params).
    params_type: ClassVar[type[msgspec.Struct] | None] = None
    #: ``R``, read from the class's type arguments; the core checks it matches the transport's.
    registration_class: ClassVar[type[Registration]] = Registration
    #: Set it (per instance, any time) while ``store``/``retrieve`` only queue work that runs on
    #: a device and return at once: no blocking wait, no compilation, no file or network I/O.
    #: A request that finds the server otherwise idle may then run on the server's loop thread
    #: instead of this registration's worker (still one at a time, in arrival order), saving
    #: the hand-off to the worker.
    queues_only: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        args = _type_args(cls, ServerContext)
        if len(args) == 2:
            reg, params = args
            if isinstance(reg, type) and issubclass(reg, Registration):
                cls.registration_class = reg
            if isinstance(params, type) and issubclass(params, msgspec.Struct):
                cls.params_type = params

    def __init__(self, registration: R, layout: KVLayout) -> None:
        self.registration = registration
        self.layout = layout

    @abstractmethod
    def store(self, copies: list[RowCopy], params: P) -> Waiter | None:
        """Copy engine rows into the arena slots of ``copies`` (``slot[l] = layer_l[rows]``).
        Return None when the bytes are in the slots, or a :data:`Waiter`: the server runs it off
        the worker thread and commits when it returns, so the next request's copies can be
        queued meanwhile (the transport then orders consecutive requests' copies itself).
        Raising fails the request; its slots are dropped."""

    @abstractmethod
    def retrieve(self, copies: list[RowCopy], params: P) -> Waiter | Queued | None:
        """Copy arena slots into engine rows (``layer_l[rows] = slot[l]``); returns as
        :meth:`store`, or :class:`Queued` when ``params`` let the client wait for the copies
        itself (the answer then goes out before they end)."""

    def prefetch(self, chunks: list[StoredSlot]) -> None:
        """Optional hint: these stored chunks are about to be retrieved by this context; start
        moving them toward the device (e.g. into staging), so that a retrieve whose
        :attr:`RowCopy.stamp` matches a prefetched chunk need not copy it from the arena again.
        The default does nothing.

        When it is called, with at most :data:`kvxfer.copies.MAX_PREFETCH_CHUNKS` whole chunks
        (every layer):

        * after a lookup that asked for a prefetch: the leading run it leased, on the one
          registration of that model and rank;
        * as a retrieve of this context arrives while nothing else is in flight: the chunks of
          it the arena holds (less a first one a skip cuts), before the retrieve is checked,
          reserved and planned. That retrieve may still be refused, or reach its copy past its
          deadline; then it ends without using them, and their slots may take other chunks,
          under other stamps, while your copies run.

        Rules (it runs on the server's loop, only while this context has no request queued or
        running, whatever :attr:`queues_only` says):

        * only queue work; skip what needs a wait (e.g. before the first transfer made the
          staging), and queue nothing while an earlier prefetch still runs (lookups may come
          faster than a copy engine moves them, and from other clients of this model);
        * keep chunks staged already (the same stamp) rather than copy them again;
        * until a store or retrieve of this context has used or dropped what it staged, order
          any reuse of that staging after the prefetch's copies;
        * a retrieve must be correct whether it finds a chunk prefetched or not, and a
          prefetched chunk may never be retrieved.

        Errors are logged, never sent to a client."""

    def close(self) -> None:
        """Release what ``__init__`` acquired. Errors are logged, never raised to a client."""


class ServerTransport:
    """A transport's server half: one per transport per server process. The default serves
    every transport; override it (:meth:`Transport.server_transport`) for per-server state."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    def start(self, arena: Arena) -> None:
        """Called once, on the server's loop, before any registration (e.g. to pin the arena
        for DMA). Raising disables the transport in this server, with the error in its log."""

    def open(self, registration: Registration, layout: KVLayout) -> ServerContext[Any, Any] | None:
        """The server context of a registration (on its worker thread): the transport's
        ``server_context_type(registration, layout)``; None for client-driven transports."""
        cls = self.transport.server_context_type
        return cls(registration, layout) if cls is not None else None

    def addressable_bytes(self) -> int | None:
        """The most bytes of one registered KV cache this server side can address here (e.g. a
        GPU's memory), or None when it has no bound of its own. The core refuses a registration
        that declares more, before :meth:`open`. Called on the loop; must be quick."""
        return None

    def status(self) -> dict[str, str]:
        """A few strings for ``kvxfer status``."""
        return {}

    def close(self) -> None:
        """Server shutdown, after every registration was closed."""


# --------------------------------------------------------------------------- the plugin


class Transport(ABC):
    """The object an entry point in ``kvxfer.transports`` names (a subclass or an instance).

    Declare on the class: ``name`` (what users type, equal to the entry point's name),
    ``api_version`` (must equal :data:`API_VERSION`), ``capabilities``, ``registration_type``
    (a :class:`Registration` subclass the server decodes registrations with; default the base),
    ``context_type`` (a :class:`ClientDrivenContext` or :class:`ServerDrivenContext` subclass:
    it fixes the style), ``server_context_type`` (server-driven only), ``auto_priority``
    (``"auto"`` picks the available transport with the highest priority for the tensors'
    device; cpu_gather, the fallback, has 10) and ``production``. Implement :meth:`probe`.
    """

    name: ClassVar[str]
    api_version: ClassVar[int]
    capabilities: ClassVar[Capabilities]
    registration_type: ClassVar[type[Registration]] = Registration
    context_type: ClassVar[type[TransferContextBase]]
    server_context_type: ClassVar[type[ServerContext[Any, Any]] | None] = None
    auto_priority: ClassVar[int] = 0
    #: Meant for production: it handles every field of its registration and params as hostile
    #: and never opens a path a client chose. ``kvxfer serve`` loads only production transports
    #: unless others are named in ``--transports`` (then with a warning). False by default: a
    #: transport says so on purpose.
    production: ClassVar[bool] = False

    @abstractmethod
    def probe(self) -> Probe:
        """Can this transport run in this process? Cheap, never raises, imports nothing heavy
        that may be absent (answer ``Probe(False, reason)`` instead)."""

    @property
    def style(self) -> Style:
        """Follows from ``context_type``'s base class."""
        if issubclass(self.context_type, ServerDrivenContext):
            return Style.SERVER_DRIVEN
        return Style.CLIENT_DRIVEN

    def priority_for(self, device: torch.device) -> int:
        """Rank in ``"auto"`` for KV tensors on ``device`` (higher wins): ``auto_priority``,
        unless a transport ranks device types differently."""
        return self.auto_priority

    def serves(self, device: torch.device) -> bool:
        """Whether it can move KV tensors on ``device`` here."""
        return self.refusal(device) is None

    @staticmethod
    def probe_problem(probe: Probe) -> str | None:
        """What makes an available ``probe`` one no device can use (``kvxfer plugins`` then shows
        the transport as unavailable), or None."""
        if probe.available and not probe.device_types:
            return ("its probe() answered available but named no device types "
                    "(Probe.device_types is empty: list those it serves here, e.g. ('cpu',), or '*' for any)")
        return None

    def refusal(self, device: torch.device) -> str | None:
        """Why it cannot move KV tensors on ``device`` here (what to do), or None when it can."""
        from kvxfer.transport.registry import checked_probe

        probe = checked_probe(self)
        if not probe.available:
            return probe.reason or "its probe() says it cannot run here"
        if not self.capabilities.serves(device):
            return f"its capabilities claim device types {', '.join(sorted(self.capabilities.device_types))}"
        problem = self.probe_problem(probe)
        if problem is not None:
            return problem
        if "*" not in probe.device_types and device.type not in probe.device_types:
            return f"its probe() found only {', '.join(probe.device_types)} here ({probe.reason})"
        return None

    def client_context(
        self, connection: Connection, layers: list[torch.Tensor], layout: KVLayout, identity: InstanceIdentity
    ) -> TransferContextBase:
        """A new, unregistered client context for ``layers`` (already checked against
        ``layout``). Raise :class:`kvxfer.errors.ConfigError` for tensors it cannot serve."""
        return self.context_type(self, connection, layers, layout, identity)

    def server_transport(self) -> ServerTransport:
        """The server half; called once per server process."""
        return ServerTransport(self)

    def contract_errors(self) -> list[str]:
        """What is inconsistent in the declarations (the registry refuses such a plugin)."""
        errors = []
        name = getattr(self, "name", None)
        if not (isinstance(name, str) and name):
            errors.append(f"name must be the entry point's name (a str), got {name!r}")
        caps = getattr(self, "capabilities", None)
        if not isinstance(caps, Capabilities):
            errors.append(f"capabilities must be a kvxfer.transport.Capabilities (the device types and layouts it "
                          f"serves), got {caps!r}")
        ctx = getattr(self, "context_type", None)
        if not (isinstance(ctx, type) and issubclass(ctx, (ClientDrivenContext, ServerDrivenContext))):
            errors.append(f"context_type must subclass ClientDrivenContext or ServerDrivenContext, got {ctx!r}")
        elif inspect.isabstract(ctx):
            missing = ", ".join(sorted(getattr(ctx, "__abstractmethods__", ())))
            errors.append(f"context_type {ctx.__name__} does not implement {missing}")
        elif (self.style is Style.SERVER_DRIVEN and self.server_context_type is None
              and type(self).server_transport is Transport.server_transport):
            errors.append("a server-driven transport declares server_context_type (a ServerContext subclass), "
                          "or a server_transport() whose open() makes its server contexts")
        elif self.style is Style.CLIENT_DRIVEN and self.server_context_type is not None:
            errors.append("a client-driven transport has no server_context_type (the core serves the arena)")
        reg = self.registration_type
        if not (isinstance(reg, type) and issubclass(reg, Registration)):
            errors.append(f"registration_type must subclass Registration, got {reg!r}")
        else:
            taken = sorted({f for cls in reg.__mro__[:reg.__mro__.index(Registration)]
                            for f in vars(cls).get("__annotations__", {})} & set(Registration.__struct_fields__))
            if taken:
                errors.append(f"registration_type {reg.__name__} declares {', '.join(taken)}, which the core's "
                              "Registration fills: give the transport's own fields names of their own")
        srv = self.server_context_type
        if srv is not None and isinstance(reg, type) and not issubclass(reg, srv.registration_class):
            errors.append(f"{srv.__name__} takes {srv.registration_class.__name__} registrations, but "
                          f"registration_type is {reg.__name__}")
        return errors
