"""The plugin contract, for transport authors. Import from here, not from submodules.

See docs/plugin-authoring.md for the walk-through.
"""

from kvxfer.layout import KVLayout, LayoutKind, copy_dtype, copy_view
from kvxfer.protocol.messages import Registration, RetrieveResult, StoreResult
from kvxfer.server.arena import Arena, ArenaMapping
from kvxfer.transport.base import (
    API_VERSION,
    Capabilities,
    Connection,
    InstanceIdentity,
    Probe,
    RowCopy,
    ServerContext,
    ServerTransport,
    Style,
    TransferContext,
    Transport,
    Waiter,
)
from kvxfer.transport.datapath import (
    ArenaServerTransport,
    ClientDrivenContext,
    ServerDrivenContext,
    TransferContextBase,
)
from kvxfer.transport.hooks import hookimpl
from kvxfer.transport.registry import get_transport, list_plugins, select

__all__ = [
    "API_VERSION",
    "Arena",
    "ArenaMapping",
    "ArenaServerTransport",
    "Capabilities",
    "ClientDrivenContext",
    "Connection",
    "InstanceIdentity",
    "KVLayout",
    "LayoutKind",
    "Probe",
    "Registration",
    "RetrieveResult",
    "RowCopy",
    "ServerContext",
    "ServerDrivenContext",
    "ServerTransport",
    "StoreResult",
    "Style",
    "TransferContext",
    "TransferContextBase",
    "Transport",
    "Waiter",
    "copy_dtype",
    "copy_view",
    "get_transport",
    "hookimpl",
    "list_plugins",
    "select",
]
