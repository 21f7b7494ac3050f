"""pytest plugin of kvxfer (``pytest11`` entry point): options and markers of the kit."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvxfer")
    group.addoption("--kvxfer-transport", default=None, metavar="NAME",
                    help="run the kvxfer transport conformance suite against transport NAME")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (skipped without one)")
