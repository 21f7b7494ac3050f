"""pytest plugin of kvxfer (``pytest11`` entry point ``kvxfer``): the conformance kit's
options and markers.

* ``--kvxfer-transport=NAME`` picks the transport of :mod:`kvxfer.testing.suite` (and of any
  :class:`~kvxfer.testing.TransportConformance` subclass that sets no ``transport``);
* ``--kvxfer-device=TYPE`` likewise picks the torch device type of the test KV tensors;
* every kit test gets the marker ``kvxfer_conformance`` (select with ``-m kvxfer_conformance``),
  and those of a class whose ``device`` is ``cuda`` also ``gpu``.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvxfer")
    group.addoption("--kvxfer-transport", default=None, metavar="NAME", dest="kvxfer_transport",
                    help="run the kvxfer transport conformance suite against transport NAME "
                         "(pytest --kvxfer-transport=NAME --pyargs kvxfer.testing.suite)")
    group.addoption("--kvxfer-device", default=None, metavar="TYPE", dest="kvxfer_device",
                    help="torch device type of the conformance suite's KV tensors (default: cpu)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (skipped without one)")
    config.addinivalue_line("markers", "kvxfer_conformance: a test of kvxfer's transport conformance kit")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from kvxfer.testing.conformance import TransportConformance

    for item in items:
        cls = getattr(item, "cls", None)
        if cls is None or not issubclass(cls, TransportConformance):
            continue
        if getattr(item, "originalname", item.name) in TransportConformance.kit_names:
            item.add_marker(pytest.mark.kvxfer_conformance)
        device = getattr(cls, "device", None) or config.getoption("kvxfer_device", None) or "cpu"
        if str(device).startswith("cuda"):
            item.add_marker(pytest.mark.gpu)
