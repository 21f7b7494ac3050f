"""The connector's log lines in vLLM's log.

vLLM configures its own ``vllm`` logger (a handler, its level, ``propagate=False``) and leaves the
root logger bare, so the INFO lines of ``kvxfer.*`` loggers would go nowhere (Python's last-resort
handler shows WARNING and above only). :func:`follow_vllm_logging` sends them to vLLM's handlers,
unless the application configured logging for ``kvxfer`` or the root itself.
"""

from __future__ import annotations

import logging
from typing import Final

__all__ = ["follow_vllm_logging", "connected_line"]

#: The logger every kvxfer module's logger descends from.
KVXFER_LOGGER: Final = "kvxfer"
VLLM_LOGGER: Final = "vllm"


class _ToVllmHandlers(logging.Handler):
    """Hands each record to the handlers vLLM's logger has when the record comes (vLLM may
    configure its logging again, replacing them), as if it were logged there."""

    def emit(self, record: logging.LogRecord) -> None:
        for handler in logging.getLogger(VLLM_LOGGER).handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def follow_vllm_logging() -> bool:
    """Called by the connector in every vLLM process (after vLLM configured its logging): unless
    some handler already receives ``kvxfer`` records (the application's, or the root's), give
    the ``kvxfer`` logger vLLM's handlers and vLLM's level. Returns whether it did; a second
    call does nothing."""
    ours = logging.getLogger(KVXFER_LOGGER)
    vllm = logging.getLogger(VLLM_LOGGER)
    if ours.hasHandlers() or not vllm.handlers:
        return False
    ours.addHandler(_ToVllmHandlers())
    if ours.level == logging.NOTSET:
        ours.setLevel(vllm.getEffectiveLevel())
    return True


def connected_line(side: str, url: str, server_version: str, transport: str, instances: str) -> str:
    """The INFO line a connector side logs once it is connected to the server (and, on a
    worker, registered): whom it talks to and how, so that vLLM's log shows kvxfer is in use.
    ``url`` is logged without credentials."""
    from kvxfer.store.base import redact_url

    return (f"kvxfer {side}: connected to the kvxfer server at {redact_url(url)} (kvxfer {server_version}); "
            f"transport {transport}; {instances}")
