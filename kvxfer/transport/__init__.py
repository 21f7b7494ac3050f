"""The plugin contract, for transport authors: import from here (the names are those of
:mod:`kvxfer.transport.contract`, plus the layout helpers copy code uses, what ``probe()`` may
ask without importing torch (:mod:`kvxfer.accelerators`) and the registry).

See docs/plugin-authoring.md for the walk-through.
"""

from kvxfer.accelerators import TorchBuild, cuda_devices, torch_build
from kvxfer.arena import Arena, ArenaMapping, transport_dir_path
from kvxfer.copies import HostRows, host_copy_threads
from kvxfer.layout import MAX_LAYERS, KVLayout, LayoutKind, copy_dtype, copy_view
from kvxfer.protocol.messages import MetricSample, Registration, RetrieveResult, StoreResult
from kvxfer.transport.contract import (
    API_VERSION,
    Capabilities,
    ClientDrivenContext,
    Connection,
    InstanceIdentity,
    LayerwiseFuture,
    Probe,
    Queued,
    RowCopy,
    ServerContext,
    ServerDrivenContext,
    ServerTransport,
    StoredSlot,
    Style,
    Transfer,
    TransferContext,
    TransferContextBase,
    TransferFuture,
    TransferKind,
    Transport,
    Waiter,
)
from kvxfer.transport.registry import get_transport, list_plugins, select

__all__ = [
    "API_VERSION",
    "Arena",
    "ArenaMapping",
    "Capabilities",
    "ClientDrivenContext",
    "Connection",
    "HostRows",
    "InstanceIdentity",
    "KVLayout",
    "LayerwiseFuture",
    "LayoutKind",
    "MetricSample",
    "Probe",
    "Queued",
    "Registration",
    "RetrieveResult",
    "RowCopy",
    "ServerContext",
    "ServerDrivenContext",
    "ServerTransport",
    "StoreResult",
    "StoredSlot",
    "Style",
    "TorchBuild",
    "Transfer",
    "TransferContext",
    "TransferContextBase",
    "TransferFuture",
    "TransferKind",
    "Transport",
    "Waiter",
    "MAX_LAYERS",
    "copy_dtype",
    "copy_view",
    "cuda_devices",
    "get_transport",
    "host_copy_threads",
    "list_plugins",
    "select",
    "torch_build",
    "transport_dir_path",
]
