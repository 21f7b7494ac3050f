"""kvxfer-valkey: the ``valkey`` L2 store backend (entry point ``kvxfer.stores: valkey``).

``kvxfer serve --l2 valkey --l2-url valkey://HOST:6379[,HOST2:6379...]``: a single node or a
cluster (discovered). The ``valkey`` client (valkey-py, with its ``libvalkey`` parser) owns
connections, cluster topology, redirects, authentication and TLS; chunk bytes move between its
sockets and the arena without being parsed into Python objects (:mod:`kvxfer_valkey.resp`).
"""

from kvxfer_valkey.local import ValkeyCluster, ValkeyServer, valkey_binary
from kvxfer_valkey.store import ValkeyBackend, ValkeyStore

__all__ = ["ValkeyStore", "ValkeyBackend", "ValkeyServer", "ValkeyCluster", "valkey_binary"]
