"""The request table: each request's name, payload type, reply type and handler kind.

This is the whole wire surface of the server. ``docs/protocol.md`` documents it and a test
checks that the two agree. The kind drives the server's dispatch: a control handler answers
inline on the loop, a transfer handler's slow part runs on the instance's worker thread.
:func:`spec_of` finds a payload's entry, so a client sends ``submit(payload)`` and gets a
future of the reply type that the payload's class names (``Lookup`` is a
``Request[LookupReply]``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

import msgspec

from kvxfer.protocol import messages as m

__all__ = ["HandlerKind", "RequestSpec", "REQUESTS", "spec_of"]


class HandlerKind(enum.Enum):
    #: Runs inline on the server's loop: must be quick and never block.
    CONTROL = "control"
    #: Runs on the instance's worker thread, in order with its other transfers.
    TRANSFER = "transfer"


@dataclass(frozen=True, slots=True)
class RequestSpec:
    name: str
    payload: type[msgspec.Struct]
    reply: type[msgspec.Struct]
    kind: HandlerKind
    doc: str


def _specs(*specs: RequestSpec) -> dict[str, RequestSpec]:
    return {s.name: s for s in specs}


C, T = HandlerKind.CONTROL, HandlerKind.TRANSFER

REQUESTS: Final[dict[str, RequestSpec]] = _specs(
    RequestSpec("handshake", m.Handshake, m.HandshakeReply, C,
                "First request of a connection; checks protocol versions, opens a session."),
    RequestSpec("ping", m.Ping, m.Pong, C, "Liveness; also the client's heartbeat."),
    RequestSpec("goodbye", m.Goodbye, m.Empty, C, "The client is closing: end its session now."),
    RequestSpec("register", m.Register, m.RegisterReply, T,
                "Register one KV cache through a transport."),
    RequestSpec("unregister", m.Unregister, m.Empty, T,
                "Drop a registration and its reservations."),
    RequestSpec("lookup", m.Lookup, m.LookupReply, C,
                "Leading chunks present for every rank; optional lease."),
    RequestSpec("release_lease", m.ReleaseLease, m.Empty, C, "Drop a lease early."),
    RequestSpec("reserve_write", m.ReserveWrite, m.ReserveWriteReply, C,
                "Client-driven store, step 1: slots for the chunks the server lacks."),
    RequestSpec("commit_write", m.CommitWrite, m.StoreResult, C,
                "Client-driven store, step 2: the slots are filled."),
    RequestSpec("reserve_read", m.ReserveRead, m.ReserveReadReply, C,
                "Client-driven retrieve, step 1: pin the chunks, return their slots."),
    RequestSpec("commit_read", m.CommitRead, m.Empty, C,
                "Client-driven retrieve, step 2: the slots were read; unpin."),
    RequestSpec("store", m.Store, m.StoreResult, T,
                "Server-driven store: the server copies blocks into the arena."),
    RequestSpec("retrieve", m.Retrieve, m.RetrieveResult, T,
                "Server-driven retrieve: the server copies chunks into blocks."),
    RequestSpec("status", m.StatusRequest, m.StatusReply, C, "The server's report."),
    RequestSpec("clear", m.Clear, m.ClearReply, C, "Drop stored chunks that are not in use."),
)

del C, T

_BY_PAYLOAD: Final[dict[type[msgspec.Struct], RequestSpec]] = {s.payload: s for s in REQUESTS.values()}


def spec_of(payload: msgspec.Struct) -> RequestSpec:
    """The table entry of ``payload``'s request; ValueError for a Struct that is no request."""
    try:
        return _BY_PAYLOAD[type(payload)]
    except KeyError:
        raise ValueError(f"{type(payload).__name__} is not a request payload of the kvxfer protocol") from None

