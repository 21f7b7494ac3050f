"""pytest plugin of kvxfer (``pytest11`` entry point ``kvxfer``): the conformance kit's
options and markers.

* ``--kvxfer-transport=NAME`` picks the transport of :mod:`kvxfer.testing.suite` (and of any
  :class:`~kvxfer.testing.TransportConformance` subclass that sets no ``transport``);
* ``--kvxfer-device=TYPE`` likewise picks the torch device type of the test KV tensors;
* ``--kvxfer-store=NAME`` and ``--kvxfer-store-url=URL`` pick the store backend of
  :mod:`kvxfer.testing.store_suite` (and of any :class:`~kvxfer.testing.StoreConformance`
  subclass that sets no ``store``);
* a kit test replaced on a subclass after its definition stops the run (overriding one in
  the class body is refused when the class is defined), and so does one that a mark skips or
  expects to fail (a class decorator's, a module's ``pytestmark``, one added by a conftest);
* every kit test gets the marker ``kvxfer_conformance`` (select with ``-m kvxfer_conformance``),
  and those of a class whose ``device`` is ``cuda`` also ``gpu``.
"""

from __future__ import annotations

import sys
from typing import Final

import pytest

#: Marks that would silence a kit test: refused on a kit's class and on each kit test.
SILENCING_MARKS: Final = frozenset({"skip", "skipif", "xfail"})

# the kits' assertions say what they compared, however kvxfer is installed (pytest rewrites the
# modules of a plugin's distribution by itself only when its files are listed, not for an
# editable install)
pytest.register_assert_rewrite("kvxfer.testing.conformance", "kvxfer.testing.stores")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvxfer")
    group.addoption("--kvxfer-transport", default=None, metavar="NAME", dest="kvxfer_transport",
                    help="run the kvxfer transport conformance suite against transport NAME "
                         "(pytest --kvxfer-transport=NAME --pyargs kvxfer.testing.suite)")
    group.addoption("--kvxfer-device", default=None, metavar="TYPE", dest="kvxfer_device",
                    help="torch device type of the conformance suite's KV tensors (default: cpu)")
    group.addoption("--kvxfer-store", default=None, metavar="NAME", dest="kvxfer_store",
                    help="run the kvxfer store conformance suite against store backend NAME "
                         "(pytest --kvxfer-store=NAME --pyargs kvxfer.testing.store_suite)")
    group.addoption("--kvxfer-store-url", default=None, metavar="URL", dest="kvxfer_store_url",
                    help="the store the store conformance suite uses (default: a private local instance)")
    group.addoption("--kvxfer-require-available", action="store_true", dest="kvxfer_require_available",
                    help="fail the conformance kits' tests, rather than skip them, where the transport or store "
                         "under test cannot run here (its probe says no, or the device is missing): for a CI "
                         "job that must test it")


def not_here(config: pytest.Config, reason: str) -> None:
    """Skip the kit test that cannot run here for ``reason``; fail it with
    ``--kvxfer-require-available``."""
    if config.getoption("kvxfer_require_available", False):
        pytest.fail(f"conformance kit: {reason} (--kvxfer-require-available)", pytrace=False)
    pytest.skip(reason)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (skipped without one)")
    config.addinivalue_line("markers", "kvxfer_conformance: a test of kvxfer's transport or store conformance kit")
    _check_installed(config, "kvxfer_transport", "--kvxfer-transport", "kvxfer.transports", "transport")
    _check_installed(config, "kvxfer_store", "--kvxfer-store", "kvxfer.stores", "store backend")


def _check_installed(config: pytest.Config, dest: str, option: str, group: str, what: str) -> None:
    """A usage error, once, for a name no installed distribution provides (rather than every kit
    test failing at its setup with the same error): read from the entry points, nothing imported."""
    from importlib.metadata import entry_points

    name = config.getoption(dest, None)
    if not name:
        return
    names = sorted({ep.name for ep in entry_points(group=group)})
    if name not in names:
        raise pytest.UsageError(f"{option}={name}: no {what} of that name is installed (entry point group {group}); "
                                f"installed: {', '.join(names) or 'none'}")


@pytest.hookimpl(tryfirst=True)  # markers added here must exist before -m deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kits = []
    for module, attr in (("kvxfer.testing.conformance", "TransportConformance"),
                         ("kvxfer.testing.stores", "StoreConformance")):
        mod = sys.modules.get(module)
        if mod is not None:  # nothing collected uses a kit not imported (importing it imports torch)
            kits.append(getattr(mod, attr))
    replaced = []
    for item in items:
        cls = getattr(item, "cls", None)
        kit = next((k for k in kits if cls is not None and issubclass(cls, k)), None)
        if kit is None or cls is None:
            continue
        name = getattr(item, "originalname", item.name)
        if name in kit.kit_names:
            item.add_marker(pytest.mark.kvxfer_conformance)
            if getattr(cls, name, None) is not getattr(kit, name):
                replaced.append(f"{cls.__qualname__}.{name}")
        device = getattr(cls, "device", None) or config.getoption("kvxfer_device", None) or "cpu"
        if str(device).startswith("cuda"):
            item.add_marker(pytest.mark.gpu)
    if replaced:
        raise pytest.UsageError(
            f"kvxfer conformance kit tests were replaced: {', '.join(sorted(set(replaced)))}. The kit's "
            f"tests must run as defined; the kit skips what a transport does not claim by itself"
        )


# a second implementation of the hook, last: after every other plugin and conftest added its
# marks, and after -k and -m deselected what is not run
@pytest.hookimpl(trylast=True, specname="pytest_collection_modifyitems")
def pytest_collection_modifyitems_refuse_silenced(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A selected kit test marked to be skipped or to fail (a class decorator's mark, a module's
    ``pytestmark``, one a conftest adds) stops the run: the class would pass with nothing run."""
    silenced = []
    for item in items:
        if item.get_closest_marker("kvxfer_conformance") is None:
            continue
        marks = sorted({m.name for m in item.iter_markers() if m.name in SILENCING_MARKS})
        if marks:
            cls = getattr(item, "cls", None)
            silenced.append(f"{cls.__qualname__ if cls is not None else item.nodeid} ({', '.join(marks)})")
    if silenced:
        raise pytest.UsageError(
            f"kvxfer conformance kit tests are marked to be skipped or to fail: {', '.join(sorted(set(silenced)))}. "
            f"Let the probe() of what is under test say why it cannot run here instead: the kit then skips "
            f"(or, with --kvxfer-require-available, fails) with that reason"
        )
