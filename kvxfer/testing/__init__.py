"""kvxfer.testing: the conformance kit for transport authors, and test helpers.

* :class:`TransportConformance`: subclass it in a test module to run every conformance test
  against your transport (see docs/plugin-authoring.md);
* :class:`StoreConformance`: the same for an L2 store backend (see docs/l2.md);
* :class:`ServerProcess`: a real ``kvxfer serve`` in a subprocess;
* :mod:`kvxfer.testing.kvdata`: random-byte KV caches and the canonical chunk format,
  computed from shapes alone (a reference independent of every transport).

The pytest plugin (:mod:`kvxfer.testing.plugin`, loaded through the ``pytest11`` entry point)
adds ``--kvxfer-transport=NAME``: ``pytest --kvxfer-transport=NAME --pyargs kvxfer.testing.suite``
runs the kit against any installed transport.

The kit imports pytest; it is loaded on first use, so :class:`ServerProcess` (used by the demo
and the benchmarks) works without pytest installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvxfer.testing.server import ServerProcess

if TYPE_CHECKING:
    from kvxfer.testing.conformance import OverrideError, TransportConformance
    from kvxfer.testing.stores import StoreConformance

__all__ = ["ServerProcess", "TransportConformance", "StoreConformance", "OverrideError"]


def __getattr__(name: str) -> Any:
    if name in ("TransportConformance", "OverrideError"):
        from kvxfer.testing import conformance

        return getattr(conformance, name)
    if name == "StoreConformance":
        from kvxfer.testing.stores import StoreConformance

        return StoreConformance
    raise AttributeError(f"module 'kvxfer.testing' has no attribute {name!r}")
