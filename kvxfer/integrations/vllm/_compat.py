"""vLLM's connector base classes, or stand-ins when vLLM is not installed.

The connector must subclass vLLM's own ``KVConnectorBase_V1`` and ``SupportsHMA`` (vLLM's
factory checks ``issubclass`` for HMA support and calls the base ``__init__``), yet
``kvxfer.integrations.vllm`` must import on machines without vLLM (its wheel needs a CUDA
build of torch), so that the framework-neutral logic can be tested and documented anywhere.

Rule, decided once at import:

* vLLM not installed (no ``vllm`` package at all): minimal stand-ins below, with vLLM 0.32's
  names and the few behaviours the connector relies on (metadata binding, ``role``).
  :data:`HAVE_VLLM` is False.
* vLLM installed: its real classes, :data:`HAVE_VLLM` True. If the ``vllm`` package exists but
  the connector API cannot be imported (an incompatible vLLM version), importing this module
  raises an :class:`ImportError` that names the vLLM version and the API path, rather than
  silently falling back to stand-ins that vLLM would then refuse.

Setting ``KVXFER_VLLM_STANDINS=1`` forces the stand-ins (tests only).
"""

from __future__ import annotations

import enum
import importlib.util
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

__all__ = ["HAVE_VLLM", "KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole", "KVConnectorTransferResults",
           "SupportsHMA"]

_BASE_PATH = "vllm.distributed.kv_transfer.kv_connector.v1.base"


def _vllm_installed() -> bool:
    if os.environ.get("KVXFER_VLLM_STANDINS") == "1":
        return False
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


HAVE_VLLM: bool = _vllm_installed()

if HAVE_VLLM:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorBase_V1,
            KVConnectorMetadata,
            KVConnectorRole,
            SupportsHMA,
        )
    except ImportError as exc:  # vLLM present but without the V1 connector API we implement
        try:
            from importlib.metadata import version

            found = version("vllm")
        except Exception:  # noqa: BLE001  (metadata may be missing for a source checkout)
            found = "unknown"
        raise ImportError(
            f"kvxfer's vLLM connector needs vLLM's KV connector API ({_BASE_PATH}: KVConnectorBase_V1, "
            f"SupportsHMA), written against vLLM 0.32; the installed vLLM ({found}) does not provide it: "
            f"{exc}"
        ) from exc
    try:  # request-level load failures (vLLM refuses block-level ones for hybrid models)
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorTransferResults,
        )
    except ImportError:  # an older vLLM: get_finished and block-level errors only
        KVConnectorTransferResults = None  # type: ignore[assignment,misc]
else:

    @dataclass
    class KVConnectorTransferResults:  # type: ignore[no-redef]
        """Stand-in for vLLM's ``KVConnectorTransferResults``."""

        finished_sending: set[str] = field(default_factory=set)
        finished_recving: set[str] = field(default_factory=set)
        failed_recving: set[str] = field(default_factory=set)

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]  # stand-in when vLLM is absent
        """Stand-in for vLLM's ``KVConnectorRole`` (same members and values)."""

        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata(ABC):  # type: ignore[no-redef]  # noqa: B024
        """Stand-in for vLLM's ``KVConnectorMetadata``: scheduler -> worker, once per step."""

    class SupportsHMA(ABC):  # type: ignore[no-redef]  # stand-in when vLLM is absent
        """Stand-in for vLLM's ``SupportsHMA`` marker ABC."""

        @abstractmethod
        def request_finished_all_groups(
            self, request: Any, block_ids: tuple[list[int], ...]
        ) -> tuple[bool, dict[str, Any] | None]:
            raise NotImplementedError

    class KVConnectorBase_V1(ABC):  # type: ignore[no-redef]  # noqa: N801, B024
        """Stand-in for vLLM's ``KVConnectorBase_V1``: the constructor and the metadata binding
        that the real base implements; every other method is the connector's own."""

        def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
            self._connector_metadata: KVConnectorMetadata | None = None
            self._vllm_config = vllm_config
            if getattr(vllm_config, "kv_transfer_config", None) is None:
                raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._role = role

        @property
        def role(self) -> KVConnectorRole:
            return self._role

        def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def _get_connector_metadata(self) -> KVConnectorMetadata:
            assert self._connector_metadata is not None
            return self._connector_metadata

        def has_connector_metadata(self) -> bool:
            return self._connector_metadata is not None
