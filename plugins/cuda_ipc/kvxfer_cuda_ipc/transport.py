"""The cuda_ipc transport: wire Structs, probe, the client context and the plugin object.

Importing it imports no torch (``kvxfer plugins`` loads it to probe it): torch is imported where
tensors are handled.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from kvxfer import ConfigError
from kvxfer.transport import (
    API_VERSION,
    MAX_LAYERS,
    Capabilities,
    Probe,
    Registration,
    RetrieveResult,
    ServerDrivenContext,
    ServerTransport,
    Transfer,
    TransferKind,
    Transport,
    cuda_devices,
    torch_build,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "CudaIpcTensor",
    "CudaIpcRegistration",
    "CudaIpcParams",
    "CudaIpcContext",
    "CudaIpcTransport",
    "cuda_probe",
    "device_uuid",
]

# --------------------------------------------------------------------------- wire Structs

#: Most dimensions a registered tensor's shape and stride may have (a KV layer has at most 6):
#: longer lists are refused as they are decoded, before they are made into objects.
MAX_DIMS = 16
#: Longest of the small fields a server keeps for a registration's life or echoes in errors:
#: device names and UUIDs, dtype names, torch's reference-counter file names and interprocess
#: event handles (real ones: under 64 bytes; CUDA's event handle is 64). Longer ones are refused
#: as they are decoded. (A storage's handle grows with its allocation: bounded by the
#: registration's own bound, ``--max-registration-bytes``.)
MAX_SMALL_FIELD = 256
_Small = msgspec.Meta(max_length=MAX_SMALL_FIELD)
_NotNegative = msgspec.Meta(ge=0)


class CudaIpcTensor(msgspec.Struct, frozen=True, kw_only=True):
    """One layer's KV tensor as CUDA IPC shares it: the fields of
    ``torch.UntypedStorage._share_cuda_()`` plus the tensor's geometry. Nothing here is pickled."""

    #: ``cudaIpcMemHandle_t`` (or torch's expandable-segment handle) of the allocation.
    handle: bytes
    #: Bytes of the tensor's storage, and where the storage starts inside the allocation (the
    #: server checks that both lie inside the allocation the handle opens).
    storage_size_bytes: Annotated[int, _NotNegative]
    storage_offset_bytes: Annotated[int, _NotNegative]
    #: torch's producer-side reference counter (shared-memory file name and slot): the engine
    #: keeps the allocation alive while the server holds it open.
    ref_counter_handle: Annotated[bytes, _Small]
    ref_counter_offset: int
    #: Event the server waits on once when it opens the storage (torch's own IPC protocol).
    event_handle: Annotated[bytes, _Small]
    event_sync_required: bool
    #: The tensor inside its storage: offset in elements, shape, stride (elements), dtype name.
    storage_offset: int
    shape: Annotated[list[int], msgspec.Meta(max_length=MAX_DIMS)]
    stride: Annotated[list[int], msgspec.Meta(max_length=MAX_DIMS)]
    dtype: Annotated[str, _Small]
    #: UUID of the GPU that holds it (as ``str(torch.cuda.get_device_properties(i).uuid)``).
    device_uuid: Annotated[str, _Small]


class CudaIpcRegistration(Registration, frozen=True, kw_only=True):
    """The core's identity and layout fields (its ``pid`` among them: the server refuses its own,
    as CUDA IPC needs two processes, and an expandable segment's handle must name it), plus one
    :class:`CudaIpcTensor` per layer."""

    #: The engine's name of the device (``cuda:1 NVIDIA H100 80GB HBM3``), for error messages.
    device_name: Annotated[str, _Small] = ""
    tensors: Annotated[list[CudaIpcTensor], msgspec.Meta(max_length=MAX_LAYERS)] = []


class CudaIpcParams(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request parameters of a store or retrieve."""

    #: IPC handle of an interprocess event the client recorded on the engine's current stream
    #: when it submitted the request; the server's copies wait on it. Empty: no wait.
    event_handle: Annotated[bytes, _Small] = b""
    #: Retrieves: IPC handle of an interprocess event of the client's that the server records
    #: after the request's copies. The server may then answer as soon as the copies are queued,
    #: and the client waits for this event before the retrieve is complete. Empty: the server
    #: answers once the copies are done.
    done_event: Annotated[bytes, _Small] = b""


# --------------------------------------------------------------------------- CUDA helpers


def cuda_probe() -> Probe:
    """Whether this process can share or open CUDA IPC memory: torch's build and the CUDA
    driver, asked without importing torch. Never raises."""
    build = torch_build()
    if build is not None and build.hip is not None:
        return Probe(False, f"torch {build.version} is a ROCm/HIP build: cuda_ipc needs NVIDIA CUDA IPC")
    n, note = cuda_devices()
    if not n:
        return Probe(False, f"no usable NVIDIA GPU: {note}")
    return Probe(True, f"{n} CUDA device(s), {note}", ("cuda",))


def device_uuid(index: int) -> str:
    """The UUID of local CUDA device ``index``, in the form both sides compare."""
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def device_label(index: int) -> str:
    import torch

    return f"cuda:{index} {torch.cuda.get_device_name(index)} (UUID {device_uuid(index)})"


# --------------------------------------------------------------------------- client side


#: How often finish_retrieve looks at a retrieve's done event (the sleep releases the GIL).
_DONE_POLL_S = 20e-6
#: The timer slack, in ns, that the polling thread asks Linux for: a sleep may end up to its
#: thread's slack after the time asked (50 us by default), which made each poll ~70 us apart.
POLL_SLACK_NS = 1000
_PR_SET_TIMERSLACK = 29
_polling = threading.local()
#: Longest finish_retrieve waits for the copies when the connection has no timeout.
_DONE_WAIT_S = 60.0


def fine_timer() -> None:
    """Ask Linux, once per thread, for :data:`POLL_SLACK_NS` of timer slack for the calling
    thread (the one that polls the done events; elsewhere, or if the call fails, nothing
    changes): its polls are then ~25 us apart, not ~70 us."""
    if getattr(_polling, "fine", False):
        return
    _polling.fine = True
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, POLL_SLACK_NS, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class _EventPool:
    """Interprocess CUDA events of one device, reused; their IPC handles are cached."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._free: list[torch.cuda.Event] = []
        self._all: list[torch.cuda.Event] = []
        self._handles: dict[int, bytes] = {}
        self._lock = threading.Lock()

    def acquire(self) -> torch.cuda.Event:
        with self._lock:
            if self._free:
                return self._free.pop()
        import torch

        ev = torch.cuda.Event(interprocess=True)  # implies disable_timing
        with self._lock:
            self._all.append(ev)
        return ev

    def release(self, ev: torch.cuda.Event) -> None:
        with self._lock:
            self._free.append(ev)

    def handle(self, ev: torch.cuda.Event) -> bytes:
        """The event's IPC handle (the event must have been recorded once)."""
        h = self._handles.get(id(ev))
        if h is None:
            import torch

            with torch.cuda.device(self.device):
                h = bytes(ev.ipc_handle())
            self._handles[id(ev)] = h
        return h

    def discard(self, ev: torch.cuda.Event) -> None:
        """Drop ``ev`` for good (it is not lent again)."""
        with self._lock:
            self._handles.pop(id(ev), None)
            self._all = [e for e in self._all if e is not ev]

    def acquire_shared(self) -> tuple[torch.cuda.Event, bytes]:
        """An event and its IPC handle, for the server to record (a new one is recorded once on
        the current stream first: only a recorded event has a handle)."""
        import torch

        ev = self.acquire()
        if id(ev) not in self._handles:  # never lent before: not recorded yet
            ev.record(torch.cuda.current_stream(self.device))
        return ev, self.handle(ev)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._all.clear()
            self._handles.clear()


class CudaIpcContext(ServerDrivenContext[CudaIpcParams]):
    """Client side: shares the KV tensors once, then sends block ids and an event per request.

    :meth:`on_submit` records an interprocess event on the submitting thread's current CUDA
    stream (the engine's): the server's copies wait for everything the engine enqueued before
    the submit. The future completes after the server's copies are complete.
    """

    #: Requests at the server at once: the server copies the next request while a reply travels
    #: back, so a connector with several transfers outstanding gets the copy engine's rate.
    max_in_flight = 4
    #: prepare() only looks up the cached IPC handle of the request's event: a lone request is
    #: sent from the submitting thread, without the hand-off to the context's worker.
    prepare_inline = True
    #: A layer-wise retrieve is one request per part of at least 128 MiB, and 16 MiB of each
    #: chunk: a request costs 1-2 ms of host work besides its copies, and each chunk in it about
    #: 0.1 ms more. On an H200, as 2 requests a 256 MiB prefix hid up to 0.26 of its load behind
    #: the forward pass and a 1 GiB one up to 0.41; as 8, both were slower than loaded first; a
    #: 64 MiB prefix lost nothing as 1 (docs/cuda_ipc.md).
    min_layer_part_bytes = 128 << 20
    min_layer_chunk_bytes = 16 << 20

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import torch

        super().__init__(*args, **kwargs)
        dev = self.layers[0].device
        if dev.type != "cuda":
            raise ConfigError(f"cuda_ipc moves KV tensors on CUDA devices; these are on {dev}. "
                              "Use transport='cpu_gather' (or 'auto')")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self.device_uuid = device_uuid(index)
        self.device_name = f"cuda:{index} {torch.cuda.get_device_name(index)}"
        self._shared = self._share_layers()
        self._events = _EventPool(self.device)
        #: retrieves in flight: the IPC handle of each one's done event -> the event
        self._done: dict[bytes, torch.cuda.Event] = {}
        self._done_lock = threading.Lock()

    # ------------------------------------------------------------------ registration

    def _share_layers(self) -> list[CudaIpcTensor]:
        """One descriptor per layer; a storage shared by several layers is exported once."""
        exported: dict[int, tuple[Any, ...]] = {}
        out = []
        for t in self.layers:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            fields = exported.get(key)
            if fields is None:
                # (device, handle, size_bytes, offset_bytes, ref_counter_handle, ref_counter_offset,
                #  event_handle, event_sync_required): torch's own CUDA IPC export, without pickle
                fields = storage._share_cuda_()
                exported[key] = fields
            _, handle, size_bytes, offset_bytes, ref_handle, ref_offset, ev_handle, ev_sync = fields
            out.append(CudaIpcTensor(
                handle=bytes(handle),
                storage_size_bytes=int(size_bytes),
                storage_offset_bytes=int(offset_bytes),
                ref_counter_handle=bytes(ref_handle),
                ref_counter_offset=int(ref_offset),
                event_handle=bytes(ev_handle or b""),
                event_sync_required=bool(ev_sync),
                storage_offset=int(t.storage_offset()),
                shape=list(t.shape),
                stride=list(t.stride()),
                dtype=str(t.dtype).removeprefix("torch."),
                device_uuid=self.device_uuid,
            ))
        return out

    def registration_extra(self) -> dict[str, Any]:
        return {"device_name": self.device_name, "tensors": self._shared}

    # ------------------------------------------------------------------ transfers

    def on_submit(self, kind: TransferKind) -> torch.cuda.Event:
        """The request's token: a pooled interprocess event recorded on the caller's stream."""
        import torch

        ev = self._events.acquire()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def prepare(self, transfer: Transfer) -> CudaIpcParams:
        """The submit's event; a retrieve also gets an event for the server to record after its
        copies, so that the server answers once they are queued (see :meth:`finish_retrieve`)."""
        event = self._events.handle(transfer.token)
        if transfer.kind != "retrieve":
            return CudaIpcParams(event_handle=event)
        done, handle = self._events.acquire_shared()
        with self._done_lock:
            self._done[handle] = done
        return CudaIpcParams(event_handle=event, done_event=handle)

    def finish_retrieve(self, transfer: Transfer, params: CudaIpcParams | None, result: RetrieveResult) -> None:
        """Wait for the server's copies: it may answer once they are queued, having recorded the
        request's ``done_event`` after them (a server that answered after its copies recorded it
        before, or never: then the event is complete already). Polled, so that a server that dies
        mid-copy costs at most the client's timeout, not a wait forever."""
        done = self._done.get(params.done_event) if params is not None and params.done_event else None
        if done is None or done.query():
            return
        limit = float(self.connection.timeout or 0.0) or _DONE_WAIT_S
        deadline = time.monotonic() + limit
        fine_timer()
        while not done.query():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server's copies of a retrieve did not end within {limit:.0f} s "
                                   "of its answer (the server may have failed mid-copy)")
            time.sleep(_DONE_POLL_S)

    def release_params(self, transfer: Transfer, params: CudaIpcParams | None) -> None:
        """The server has answered (or the request failed): the events go back to the pool (a
        layer-wise store that never got its last layer has none). Those of a request whose
        answer the client stopped waiting for are never lent again: the server may still wait
        on the one and record the other."""
        keep = transfer.server_done
        if transfer.token is not None:
            (self._events.release if keep else self._events.discard)(transfer.token)
        if params is not None and params.done_event:
            with self._done_lock:
                done = self._done.pop(params.done_event, None)
            if done is not None and keep and done.query():
                self._events.release(done)
            elif done is not None:  # still pending (the wait timed out), or the server may record it
                self._events.discard(done)

    def release(self) -> None:
        """After unregister (the server closed its mappings): drop events and export records."""
        self._events.clear()
        self._shared = []


# --------------------------------------------------------------------------- the plugin


class CudaIpcTransport(Transport):
    """Entry point ``cuda_ipc``: preferred by "auto" for CUDA tensors (cpu_gather has 10)."""

    name = "cuda_ipc"
    api_version = API_VERSION
    registration_type = CudaIpcRegistration
    context_type = CudaIpcContext
    capabilities = Capabilities(device_types=frozenset({"cuda"}), layer_ranges=True)
    auto_priority = 50
    production = True

    def probe(self) -> Probe:
        return cuda_probe()

    def server_transport(self) -> ServerTransport:
        """The server half (pins the arena; its contexts copy through Triton kernels): imported
        here, so that an engine's process never loads it."""
        from kvxfer_cuda_ipc.server import CudaIpcServerTransport

        return CudaIpcServerTransport(self)
