"""The L2 store contract, for store-backend authors. Import from here, not from submodules.

See :mod:`kvxfer.store.base` for the contract and docs/l2.md for the tier built on it.
"""

from kvxfer.errors import StoreBroken, StoreError, StoreNotFound, StoreUnavailable
from kvxfer.store.base import (
    PASSWORD_ENV,
    STORE_API_VERSION,
    Backend,
    GetItem,
    GetStatus,
    LocalInstance,
    LoopExists,
    Probe,
    PutItem,
    Store,
    StoreCapabilities,
    StoreOptions,
    ThreadedBackend,
    password_apart,
    redact_url,
    split_hosts,
)
from kvxfer.store.registry import NAMESPACE, get_store, list_stores

__all__ = [
    "NAMESPACE",
    "PASSWORD_ENV",
    "STORE_API_VERSION",
    "Backend",
    "GetItem",
    "GetStatus",
    "LocalInstance",
    "LoopExists",
    "Probe",
    "PutItem",
    "Store",
    "StoreBroken",
    "StoreCapabilities",
    "StoreError",
    "StoreNotFound",
    "StoreOptions",
    "StoreUnavailable",
    "ThreadedBackend",
    "get_store",
    "list_stores",
    "password_apart",
    "redact_url",
    "split_hosts",
]
