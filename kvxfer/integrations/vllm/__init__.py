"""kvxfer's vLLM KV connector.

Use it with ``kv_connector_module_path="kvxfer.integrations.vllm"`` and
``kv_connector="KvxferConnector"``, or by name alone: the ``vllm.general_plugins`` entry point
``kvxfer`` calls :func:`register_connector` in every vLLM process. See docs/vllm.md.

Imports without vLLM (see :mod:`kvxfer.integrations.vllm._compat`): the class then derives
from stand-ins with vLLM's names, which is what the tests exercise.
"""

from __future__ import annotations

import logging

from kvxfer.integrations.vllm._compat import HAVE_VLLM
from kvxfer.integrations.vllm.config import ConnectorConfig
from kvxfer.integrations.vllm.connector import KvxferConnector
from kvxfer.integrations.vllm.metadata import KvxferConnectorMetadata, LoadOp, StoreOp
from kvxfer.integrations.vllm.scheduler import SchedulerConnector
from kvxfer.integrations.vllm.worker import WorkerConnector

__all__ = [
    "HAVE_VLLM",
    "CONNECTOR_NAME",
    "ConnectorConfig",
    "KvxferConnector",
    "KvxferConnectorMetadata",
    "LoadOp",
    "SchedulerConnector",
    "StoreOp",
    "WorkerConnector",
    "register_connector",
]

#: The name under which :func:`register_connector` registers the class with vLLM.
CONNECTOR_NAME = "KvxferConnector"

log = logging.getLogger("kvxfer.integrations.vllm")


def register_connector() -> bool:
    """``vllm.general_plugins`` entry point: register ``KvxferConnector`` with vLLM's
    ``KVConnectorFactory`` so that ``kv_connector="KvxferConnector"`` works without a module path.

    vLLM runs general plugins in every process, possibly more than once; its factory raises on a
    second registration of a name, which is tolerated here. Returns True if this call registered
    it. Without vLLM it does nothing.
    """
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import (
            KVConnectorFactory,
        )
    except ImportError:
        return False
    if CONNECTOR_NAME in getattr(KVConnectorFactory, "_registry", {}):
        return False
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, __name__, "KvxferConnector")
    except ValueError:  # "Connector 'KvxferConnector' is already registered." (a race or a re-run)
        return False
    log.debug("registered %s with vLLM's KVConnectorFactory", CONNECTOR_NAME)
    return True
