"""The wire contract: msgspec Structs, the request table, the codec and error codes."""

from kvxfer.protocol.messages import *  # noqa: F401,F403  (the module defines only Structs)
from kvxfer.protocol.messages import PROTOCOL_VERSION, Registration, RetrieveResult, StoreResult
from kvxfer.protocol.table import REQUESTS, HandlerKind, RequestSpec

__all__ = [
    "PROTOCOL_VERSION",
    "REQUESTS",
    "HandlerKind",
    "RequestSpec",
    "Registration",
    "StoreResult",
    "RetrieveResult",
]
