"""Every payload that crosses the wire, as msgspec Structs (MessagePack on the wire).

Rules (msgspec's schema-evolution rules): a new field gets a default; an annotation never
changes; a removed request keeps its name reserved. Bump :data:`PROTOCOL_VERSION` for any
change an older peer cannot read.

Keys of stored chunks are ``(model_name, world_size, rank, chunk_hash)``. ``chunk_hash`` comes
from :func:`kvxfer.chunk_hashes` and already folds in the request's cache salt, so the server
never sees token ids or salts.
"""

from __future__ import annotations

from typing import Annotated, Generic, TypeVar

import msgspec

from kvxfer.layout import MAX_LAYERS, MAX_RUNS

PROTOCOL_VERSION = 1
#: How the refusal of a ``Register`` whose instance id is held says whose it is (see Register).
ALREADY_REGISTERED = "is already registered on this connection"
REGISTERED_ELSEWHERE = "is registered by another session"

#: ``params`` of a store/retrieve that carries none: MessagePack nil. (An empty ``Raw`` is not a
#: MessagePack value: a message holding one encodes truncated and no peer can decode it.)
NO_PARAMS = msgspec.Raw(b"\xc0")

#: Optional features a server names in its handshake reply (``HandshakeReply.features``):
#: ``retrieve_layers``: a ``Retrieve`` may name a range of layers (``Retrieve.layers``).
FEATURES: tuple[str, ...] = ("retrieve_layers",)

#: Bounds applied to every chunk hash on the wire.
HASH_MIN_BYTES = 8
HASH_MAX_BYTES = 64
#: Most chunks one request may name (a client checks it before sending).
MAX_CHUNKS_PER_REQUEST = 1 << 14

# The per-request lists, bounded as they are decoded: a peer's oversized list is refused at its
# length, before a Python object of it is made (objects take 5-12 times their bytes on the wire).
ChunkHash = Annotated[bytes, msgspec.Meta(min_length=HASH_MIN_BYTES, max_length=HASH_MAX_BYTES)]
Hashes = Annotated[list[ChunkHash], msgspec.Meta(max_length=MAX_CHUNKS_PER_REQUEST)]
#: Indices into a request's hashes.
Indices = Annotated[list[int], msgspec.Meta(max_length=MAX_CHUNKS_PER_REQUEST)]

#: The session timing a server may announce (``HandshakeReply``): a client sends something every
#: ``heartbeat_s`` and is dropped after ``session_timeout_s`` of silence. A reply outside these
#: (NaN, 0: a client pinging without pause) is refused as it is decoded.
MIN_HEARTBEAT_S = 0.01
MIN_SESSION_TIMEOUT_S = 0.5
MAX_SESSION_TIMEOUT_S = 3600.0
#: Longest chunk, in tokens (``kvxfer serve --chunk-size``): what clients accept in the handshake.
MAX_CHUNK_SIZE = 1 << 20
#: A handshake reply names at most this many transports and features, each at most
#: :data:`MAX_STATUS_TEXT` characters (a client keeps them for its life: a hostile server's
#: millions of names held hundreds of MB in every engine process), and its paths and versions
#: are as bounded.
MAX_HANDSHAKE_NAMES = 256
MAX_PATH_TEXT = 4096

#: A status reply holds at most this many status sections, and each plugin map in it (a
#: transport's ``state``, a section) at most this many entries: the server drops the rest, and a
#: client decoding a reply refuses more (a hostile server's millions of entries would take
#: gigabytes in ``kvxfer top``).
MAX_STATUS_ENTRIES = 64
#: ...of at most this many characters each key and value (the server cuts longer ones).
MAX_STATUS_TEXT = 256
PluginStrings = Annotated[dict[str, str], msgspec.Meta(max_length=MAX_STATUS_ENTRIES)]
#: ...and at most this many items in each of its lists and maps (registrations, models, traffic,
#: latency, figures, error codes; a server lists its first registrations only, by model and rank).
MAX_STATUS_ITEMS = 1 << 16


def name_bytes(name: str) -> int:
    """The length of a model or client name as the server bounds it (``--max-name-length``):
    UTF-8 bytes."""
    return len(name.encode("utf-8", "surrogatepass"))


def unprintable_in(name: str) -> str | None:
    """Why ``name`` cannot be a model or client name for want of printable characters (names
    reach terminals through ``kvxfer status`` and ``kvxfer top``, and the server's log), or
    None: it names the first control, format or separator character other than the space."""
    if name.isprintable():
        return None
    bad = next(c for c in name if not c.isprintable())
    return (f"must be printable text; it holds the character U+{ord(bad):04X} (control, format and "
            "separator characters other than the space are refused)")


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """Base of every wire payload."""


ReplyT = TypeVar("ReplyT", bound=Message, covariant=True)


class Request(Message, Generic[ReplyT], frozen=True):
    """Base of every request payload: ``Request[R]`` is answered with an ``R`` (the request
    table, :data:`kvxfer.protocol.REQUESTS`, names each and is checked against these)."""


# --------------------------------------------------------------------------- handshake, ping


class Handshake(Request["HandshakeReply"], frozen=True):
    """First request of every connection. Refused with ``version_mismatch`` when
    ``protocol_version`` differs from the server's."""

    protocol_version: int
    client_name: str = ""
    #: Informational (status, logs); on ipc:// the server uses the kernel's word instead.
    pid: int = 0
    #: The ``session_secret`` of this client's previous session on this server, if it had one:
    #: its open writes kept while it was silent are handed back to it (see docs/protocol.md).
    resume: bytes = b""


HandshakeNames = Annotated[list[Annotated[str, msgspec.Meta(max_length=MAX_STATUS_TEXT)]],
                           msgspec.Meta(max_length=MAX_HANDSHAKE_NAMES)]


class HandshakeReply(Message, frozen=True):
    """What a client accepts of a server: every field bounded as it is decoded (a value out of
    its range is a ProtocolError of the handshake, and nothing else is sent)."""

    protocol_version: int
    server_version: Annotated[str, msgspec.Meta(max_length=MAX_STATUS_TEXT)]
    #: Tokens per chunk; every key names one full chunk of this many tokens.
    chunk_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHUNK_SIZE)]
    #: Names of the transports this server loaded and can serve.
    transports: HandshakeNames
    #: Path of the shared-memory arena file (client-driven transports map it).
    arena_path: Annotated[str, msgspec.Meta(max_length=MAX_PATH_TEXT)]
    arena_size: Annotated[int, msgspec.Meta(ge=0)]
    #: The client must send something (a ping will do) at least this often, or lose its session.
    heartbeat_s: Annotated[float, msgspec.Meta(ge=MIN_HEARTBEAT_S, le=MAX_SESSION_TIMEOUT_S)]
    session_timeout_s: Annotated[float, msgspec.Meta(ge=MIN_SESSION_TIMEOUT_S, le=MAX_SESSION_TIMEOUT_S)]
    max_message_size: Annotated[int, msgspec.Meta(ge=1)]
    #: Optional features this server implements (:data:`FEATURES`); older servers send none.
    features: HandshakeNames = []
    #: A secret of this session (16 bytes): the client presents it as ``Handshake.resume``.
    session_secret: bytes = b""
    #: Names the lock file the client holds while it lives (``client-<token>.lock`` next to the
    #: arena, :mod:`kvxfer.liveness`): 32 lowercase hex digits chosen by the server.
    client_token: str = ""
    #: The longest ``Lookup.lease_s`` this server grants (``--max-lease``); 0 from servers that do
    #: not say.
    max_lease_s: Annotated[float, msgspec.Meta(ge=0.0, le=float(1 << 63))] = 0.0
    #: The longest model or client name this server takes, in UTF-8 bytes (``--max-name-length``);
    #: 0 from servers that do not say.
    max_name_length: Annotated[int, msgspec.Meta(ge=0)] = 0

    def __post_init__(self) -> None:
        if not self.heartbeat_s < self.session_timeout_s:  # (a ValidationError of the decode)
            raise ValueError(f"heartbeat_s {self.heartbeat_s:g} s is not shorter than session_timeout_s "
                             f"{self.session_timeout_s:g} s")


class Ping(Request["Pong"], frozen=True):
    pass


class Pong(Message, frozen=True):
    server_time: float


class Goodbye(Request["Empty"], frozen=True):
    """The client is closing: the server ends its session now, as when it times out (its
    registrations, reservations and leases go), instead of ``session_timeout_s`` later."""


class Empty(Message, frozen=True):
    """A reply with nothing to say but success."""


# --------------------------------------------------------------------------- registration


class Registration(Message, frozen=True, kw_only=True):
    """What every transport's registration carries: who the engine instance is and the
    scalar description of its paged KV cache (see :class:`kvxfer.KVLayout`).

    A transport subclasses this Struct to add its own fields (for example CUDA IPC handles);
    the server decodes a registration with the transport's own subclass.
    """

    #: Chosen by the client, unique per server (random 63-bit); names the instance in requests.
    instance_id: int
    model_name: str
    world_size: int
    rank: int
    #: ``"bhnc"``, ``"flash_attn"``, ``"flashinfer"`` or ``"mla"`` (see :class:`kvxfer.LayoutKind`).
    layout: str
    #: At most :data:`kvxfer.layout.MAX_LAYERS`, refused as it is decoded.
    num_layers: Annotated[int, msgspec.Meta(le=MAX_LAYERS)]
    num_blocks: int
    block_size: int
    #: Elements of one token in one layer: heads * head_size per K/V plane (bhnc: heads *
    #: content; MLA: latent dim).
    hidden_dim_size: int
    #: torch dtype name without the ``torch.`` prefix, e.g. ``"bfloat16"``.
    dtype: str
    use_mla: bool
    #: The row geometry of each layer (see :class:`kvxfer.KVLayout`): elements per row, elements
    #: between row starts, row ids of block 0's runs, rows between blocks, the page's memory order
    #: (e.g. ``"H8|N16,C256"``). Required for ``bhnc``; for the older kinds, left at these
    #: defaults, they are those of contiguous tensors.
    row_elems: int = 0
    row_pitch: int = 0
    run_offsets: Annotated[list[int], msgspec.Meta(max_length=MAX_RUNS)] = []
    block_stride: int = 0
    page: str = ""
    #: The engine's process id (the client sends its own). Where the kernel names the connecting
    #: process in the server's own PID namespace (``ipc://``), the server refuses a registration
    #: naming another; the transport is given that pid, or 0 where the server cannot tell
    #: (``tcp://``, an engine in another PID namespace), so that it may rely on a pid it is given
    #: (cuda_ipc matches it against the process an expandable segment's handle names).
    pid: int = 0


class Register(Request["RegisterReply"], frozen=True):
    """Register one KV cache through ``transport``; ``registration`` is that transport's
    :class:`Registration` subclass, encoded, decoded by the server with the plugin's type.

    An ``instance_id`` that is registered already is refused (``invalid_request``); the message
    says whose it is: :data:`ALREADY_REGISTERED` (this session's: a client registering again
    after a reconnect is done) or :data:`REGISTERED_ELSEWHERE` (the client takes another id)."""

    transport: str
    registration: msgspec.Raw


class RegisterReply(Message, frozen=True):
    instance_id: int
    #: Bytes of one chunk of this KV cache in the arena.
    chunk_bytes: int


class Unregister(Request[Empty], frozen=True):
    instance_id: int


# --------------------------------------------------------------------------- lookup, leases


class Lookup(Request["LookupReply"], frozen=True):
    """How many leading chunks of ``hashes`` are present for every rank of ``world_size``.

    With ``lease_s > 0`` the hits are kept from eviction for that long, or until a read that
    names the lease releases them (rank by rank) or :class:`ReleaseLease`.
    """

    model_name: str
    world_size: int
    hashes: Hashes
    lease_s: float = 0.0
    #: Start promoting the hits found in L2 into L1, so that a retrieve that follows finds them
    #: there (it waits for chunks still being promoted).
    promote: bool = False
    #: With a lease: the server may start moving the leased chunks toward the engine that will
    #: load them, before its retrieve comes (a transport's ``ServerContext.prefetch``: cuda_ipc
    #: stages them in device memory). Where it cannot tell which engine that is (several
    #: registered instances of one model and rank) or that engine's transfers are busy, it
    #: does nothing. A hint: what is loaded is the same either way.
    prefetch: bool = False


class LookupReply(Message, frozen=True):
    hits: int
    lease_id: int = 0
    #: How many of the ``hits`` were found in L2 (or are being promoted from it).
    l2_hits: int = 0


class ReleaseLease(Request[Empty], frozen=True):
    lease_id: int


# --------------------------------------------------------------------------- client-driven path


class Slot(Message, frozen=True, array_like=True):
    """One arena slot: ``index`` into the request's hashes, ``offset`` in the arena file."""

    index: int
    offset: int


#: Slots of one reservation, at most one per chunk of its request.
Slots = Annotated[list[Slot], msgspec.Meta(max_length=MAX_CHUNKS_PER_REQUEST)]


class ReserveWrite(Request["ReserveWriteReply"], frozen=True):
    """Reserve arena slots for the chunks of ``hashes`` that the server lacks."""

    instance_id: int
    hashes: Hashes


class ReserveWriteReply(Message, frozen=True):
    reservation_id: int
    #: Slots to fill, one per chunk the server lacks and had room for.
    slots: Slots
    #: Indices already stored (or being stored by someone else): skip them.
    present: Indices
    #: Indices that did not fit (everything else in the arena is leased or in use).
    no_space: Indices


class CommitWrite(Request["StoreResult"], frozen=True):
    """The slots of a write reservation are filled, except ``failed`` (indices), which are
    dropped."""

    instance_id: int
    reservation_id: int
    failed: Indices = []
    #: Seconds the client spent copying into the slots (for the server's figures); 0 if unknown.
    copy_s: float = 0.0
    #: The caller cancelled the store before its copy: ``failed`` names every slot, and the
    #: server counts them as abandoned, not as failed copies.
    abandoned: bool = False


class ReserveRead(Request["ReserveReadReply"], frozen=True):
    """Pin the chunks of ``hashes`` for reading; those missing are reported, not errors."""

    instance_id: int
    hashes: Hashes
    lease_id: int = 0
    #: Leading chunks of the request that its ``skip_first_n_tokens`` covers wholly: not read,
    #: but released from ``lease_id`` now (as a read releases the chunks it reads).
    skipped: Hashes = []


class ReserveReadReply(Message, frozen=True):
    reservation_id: int
    slots: Slots
    missing: Indices


class CommitRead(Request[Empty], frozen=True):
    """The slots of a read reservation have been copied out; unpin them."""

    instance_id: int
    reservation_id: int
    #: Seconds the client spent copying out of the slots (for the server's figures); 0 if unknown.
    copy_s: float = 0.0
    #: False when the client copied nothing (the copy failed or was cancelled): the server's
    #: figures count none of the chunks as loaded.
    loaded: bool = True


# --------------------------------------------------------------------------- server-driven path


class Store(Request["StoreResult"], frozen=True):
    """Server-driven store: the server copies ``block_ids`` of the instance's registered
    memory into the arena. ``params`` is the transport's per-request Struct (or empty).
    ``deadline`` (Unix time of the client's clock; 0: none): the client stops waiting for the
    reply then and the blocks may hold other KV by the time the copy would read them, so a
    server that gets to the copy later (it was stalled) copies nothing and reports every chunk
    failed, as :attr:`Retrieve.deadline`."""

    instance_id: int
    hashes: Hashes
    block_ids: list[int]
    params: msgspec.Raw = NO_PARAMS
    deadline: float = 0.0


class Retrieve(Request["RetrieveResult"], frozen=True):
    """Server-driven retrieve into ``block_ids``, skipping the first
    ``skip_first_n_tokens`` tokens (a multiple of the block size). ``deadline`` (Unix time of
    the client's clock; 0: none): the client stops waiting for the reply then and the blocks may
    be the engine's again, so a server that gets to the copy later (it was stalled) copies
    nothing and reports every chunk missing. Exact on one host; across hosts, as exact as
    their clocks agree."""

    instance_id: int
    hashes: Hashes
    block_ids: list[int]
    skip_first_n_tokens: int = 0
    lease_id: int = 0
    params: msgspec.Raw = NO_PARAMS
    deadline: float = 0.0
    #: ``[first, stop)``: copy only these layers of every chunk (one part of a retrieve moved
    #: layer by layer; servers with the ``retrieve_layers`` feature); empty: every layer.
    layers: Annotated[list[int], msgspec.Meta(max_length=2)] = []


class StoreResult(Message, frozen=True):
    """What a store did, by index into the request's keys."""

    #: Written by this request.
    stored: Indices
    #: Already present (or being written by another request): skipped.
    present: Indices = []
    #: Not stored: no room (everything else was leased or in use), still being promoted from L2
    #: after the store's wait for it, the copy failed, or the client gave up on the store before
    #: its copy (cancelled it, or a server-driven store's deadline passed).
    failed: Indices = []

    @property
    def ok(self) -> bool:
        """True when every key is now stored (by this request or before it)."""
        return not self.failed


class RetrieveResult(Message, frozen=True):
    """What a retrieve did, by index into the request's keys."""

    loaded: Indices
    #: Not in the server (never stored, or evicted): their blocks were not written.
    missing: Indices = []

    @property
    def ok(self) -> bool:
        return not self.missing


# --------------------------------------------------------------------------- status, clear


class ContextStatus(Message, frozen=True):
    instance_id: int
    model_name: str
    world_size: int
    rank: int
    transport: str
    layout: str
    num_layers: int
    block_size: int
    hidden_dim_size: int
    dtype: str
    use_mla: bool
    num_blocks: int
    chunk_bytes: int
    client_pid: int
    stores: int
    retrieves: int
    #: The page's memory order (:attr:`kvxfer.KVLayout.page`).
    page: str = ""


class ArenaStatus(Message, frozen=True):
    path: str
    capacity: int
    used: int
    chunks: int
    free_extents: int
    largest_free: int
    evictions: int
    #: Chunks that cannot be evicted now (being written, being read, leased, or written to L2),
    #: counted from the chunks themselves: zero whenever no reservation, lease or L2 write is open.
    pinned_chunks: int = 0


class TransportStatus(Message, frozen=True):
    name: str
    style: str
    contexts: int
    state: PluginStrings = {}


class TierStatus(Message, frozen=True):
    """A storage tier below the L1 arena (``kvxfer serve --l2``)."""

    name: str
    #: Store backend (its entry point name) and where it is (secrets removed).
    store: str
    url: str
    #: ``up``, or ``down``: the circuit breaker is open, the server serves from L1 and retries.
    state: str
    detail: str = ""
    admission: str = "all"
    #: Lookups that asked this tier, chunks asked, chunks found.
    lookups: int = 0
    lookup_chunks: int = 0
    lookup_hits: int = 0
    #: Lookups that gave up waiting for the store (answered from L1).
    timeouts: int = 0
    #: Lookups that did not ask the store: the checks of earlier lookups had as many keys there
    #: as the server allows at once (answered from L1).
    busy_lookups: int = 0
    #: Chunks promoted into L1; that failed to promote (store error or gone); being promoted now.
    promotions: int = 0
    promote_failures: int = 0
    promoting: int = 0
    #: Values whose header, length or checksum did not match: counted as misses, never loaded.
    integrity_failures: int = 0
    #: Of those, damaged values (no reader could load them, in any layout) that this server
    #: deleted from the store, so that the chunk can be stored again.
    damaged_deleted: int = 0
    #: Chunks written and their bytes; chunks the store already held.
    writes: int = 0
    write_bytes: int = 0
    write_skipped: int = 0
    #: Chunks queued or being written now, and the queue's size.
    queue_depth: int = 0
    queue_capacity: int = 0
    #: Arena bytes pinned by queued writes, and the most they may pin (half the arena).
    pinned_bytes: int = 0
    pin_limit: int = 0
    #: Writes dropped (queue full, pinned bytes at their limit, store down or failing).
    drops: int = 0
    #: Writer threads running and not held (idle ones included; more than ``--l2-writers`` once
    #: held writers came back), and writers the store plugin holds in a submit call that has not
    #: returned (given up: their writes dropped, a writer started in their place while the
    #: tier's limit allows).
    writers: int = 0
    writers_held: int = 0
    #: Store operations that failed, and times the circuit breaker opened.
    errors: int = 0
    outages: int = 0
    #: The store's own figures (bytes used, values, nodes), refreshed every few seconds.
    store_stats: PluginStrings = {}
class ModelStatus(Message, frozen=True):
    """Lookups and evictions of one model label since the server started. Labels are bounded:
    models beyond the server's ``--metrics-max-models`` (and lookups of models that never
    registered) share the label ``__other__``."""

    model: str
    lookups: int = 0
    lookup_chunks: int = 0
    lookup_hits: int = 0
    evicted_chunks: int = 0
    #: Registered contexts of this model now.
    contexts: int = 0
    #: Of ``lookup_hits``, those found in L2 (or being promoted from it); the rest were in L1.
    lookup_l2_hits: int = 0


class TrafficStatus(Message, frozen=True):
    """Stores and retrieves of one (model label, transport) since the server started."""

    model: str
    transport: str
    stores: int = 0
    stored_chunks: int = 0
    stored_bytes: int = 0
    #: Chunks skipped by a store because they were stored already.
    present_chunks: int = 0
    #: Chunks a store found no room for.
    no_space_chunks: int = 0
    #: Chunks whose copy failed.
    failed_chunks: int = 0
    store_copy_s: float = 0.0
    retrieves: int = 0
    loaded_chunks: int = 0
    loaded_bytes: int = 0
    #: Chunks a retrieve asked for and did not load (not in the server, or the copy failed,
    #: was cancelled or expired).
    missing_chunks: int = 0
    retrieve_copy_s: float = 0.0
    #: Stores and retrieves reserved and not committed now.
    stores_in_flight: int = 0
    retrieves_in_flight: int = 0
    #: Chunks a store did not copy because its client gave up on it: the caller cancelled it,
    #: or the server reached its copy past the client's deadline (:attr:`Store.deadline`).
    abandoned_chunks: int = 0


class LatencyStatus(Message, frozen=True):
    """Durations inside the server of one request kind (``name`` is a request name, or
    ``store``/``retrieve`` for whole transfers of ``transport``: reservation to commit)."""

    name: str
    transport: str = ""
    #: Observations since the server started.
    count: int = 0
    #: The most recent observations the percentiles come from (at most 1024).
    window: int = 0
    p50_s: float = 0.0
    p90_s: float = 0.0
    p99_s: float = 0.0
    max_s: float = 0.0


class MetricSample(Message, frozen=True):
    """One figure a hook plugin or transport contributes (hook ``kvxfer_metrics``): exported as a
    Prometheus sample by ``kvxfer serve --metrics-port`` and shown by ``kvxfer top``.

    ``name`` is a Prometheus metric name starting with ``kvxfer_`` (a counter's ends with
    ``_total``); ``kind`` is ``"counter"`` or ``"gauge"``; label values must be few (no ids)."""

    name: str
    kind: str
    value: float
    labels: PluginStrings = {}
    help: str = ""


class StatusRequest(Request["StatusReply"], frozen=True):
    pass


class StatusReply(Message, frozen=True):
    server_version: str
    protocol_version: int
    url: str
    pid: int
    uptime_s: float
    chunk_size: int
    sessions: int
    contexts: Annotated[list[ContextStatus], msgspec.Meta(max_length=MAX_STATUS_ITEMS)]
    arena: ArenaStatus
    transports: Annotated[list[TransportStatus], msgspec.Meta(max_length=MAX_STATUS_ENTRIES)]
    lookups: int
    lookup_chunks: int
    lookup_hits: int
    leases: int
    leased_chunks: int
    reservations: int
    errors: int
    hook_errors: int
    #: Connections whose session was ended because they left too many replies unread.
    dropped_connections: int = 0
    #: Extra sections contributed by hook plugins: name -> key -> value.
    sections: Annotated[dict[str, PluginStrings], msgspec.Meta(max_length=MAX_STATUS_ENTRIES)] = {}
    #: Storage tiers below the arena (``kvxfer serve --l2``); empty without one.
    tiers: Annotated[list[TierStatus], msgspec.Meta(max_length=MAX_STATUS_ENTRIES)] = []
    #: ``http://HOST:PORT/metrics`` when the server exports Prometheus metrics, else "".
    metrics_url: str = ""
    #: Requests received and not answered yet (transfers running on worker threads).
    requests_in_flight: int = 0
    #: Error replies since start, by error code.
    errors_by_code: Annotated[dict[str, int], msgspec.Meta(max_length=MAX_STATUS_ENTRIES)] = {}
    models: Annotated[list[ModelStatus], msgspec.Meta(max_length=MAX_STATUS_ITEMS)] = []
    traffic: Annotated[list[TrafficStatus], msgspec.Meta(max_length=MAX_STATUS_ITEMS)] = []
    latency: Annotated[list[LatencyStatus], msgspec.Meta(max_length=MAX_STATUS_ITEMS)] = []
    #: Figures contributed by plugins (hook ``kvxfer_metrics``).
    plugin_metrics: Annotated[list[MetricSample], msgspec.Meta(max_length=MAX_STATUS_ITEMS)] = []
    #: Periodic passes of the server's loop completed since it started (about 4 a second: leases
    #: expired, silent sessions dropped, parked writes of gone clients freed). They run on the
    #: thread that answers status: a reply with more ``ticks`` than an earlier one means a whole
    #: pass ran after the earlier reply was made.
    ticks: int = 0
    #: Of ``lookup_hits``, those found in L2 (or being promoted from it); the rest were in L1.
    lookup_l2_hits: int = 0


class Clear(Request["ClearReply"], frozen=True):
    """Drop every chunk (of ``model_name`` only, when given) that is not in use."""

    model_name: str = ""


class ClearReply(Message, frozen=True):
    removed: int


# --------------------------------------------------------------------------- errors


class ErrorReply(Message, frozen=True):
    """The reply to any request that failed: a code from :mod:`kvxfer.errors` and a message
    that says what to do."""

    code: str
    message: str
