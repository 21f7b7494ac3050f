"""Finding store backends: entry points in group ``kvxfer.stores``, through the same
:class:`~kvxfer.transport.registry.EntryPointGroup` machinery as transports."""

from __future__ import annotations

from typing import Final

from kvxfer.errors import StoreBroken, StoreNotFound, StoreUnavailable
from kvxfer.store.base import STORE_API_VERSION, Store
from kvxfer.transport.registry import EntryPointGroup, PluginInfo, checked_probe

__all__ = ["DISTRIBUTIONS", "NAMESPACE", "STORES", "get_store", "list_stores"]

NAMESPACE: Final = "kvxfer.stores"

#: The store backends the kvxfer project publishes outside the core (``fs`` comes with it), each
#: installed from a kvxfer checkout, where it is ``plugins/<name>``.
DISTRIBUTIONS: Final[dict[str, str]] = {"valkey": "kvxfer-valkey"}

STORES: Final = EntryPointGroup(NAMESPACE, "store", Store, STORE_API_VERSION, "kvxfer.store.STORE_API_VERSION",
                                StoreNotFound, StoreBroken, DISTRIBUTIONS)


def get_store(name: str, *, require_available: bool = True) -> Store:
    """The store backend called ``name``; with ``require_available``, one whose probe says yes."""
    store: Store = STORES.load(name)
    if require_available:
        probe = checked_probe(store)
        if not probe.available:
            raise StoreUnavailable(f"store {name!r} cannot run here: {probe.reason}")
    return store


def list_stores() -> list[PluginInfo]:
    """Every installed store backend with its health."""
    return STORES.list()
