"""The transport conformance suite: one umbrella class, :class:`TransportConformance`.

A transport proves it works by subclassing it in its own tests::

    from kvxfer.testing import TransportConformance

    class TestMyTransport(TransportConformance):
        transport = "my_transport"   # entry-point name of the transport under test
        device = "cpu"               # torch device type of the test KV tensors (default "cpu")

Every test of the kit reaches every subclass: tests added to the kit later run without the
author doing anything. The kit decides what to skip, from the transport's ``probe()``, its
``capabilities`` and the devices present; a subclass may add its own tests but may not
override, remove or skip the kit's (that is refused when the class is defined, and checked
again when its tests run).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar, Final

import pytest

from kvxfer.testing.conformance._base import KitBase
from kvxfer.testing.conformance.lifecycle import LifecycleTests
from kvxfer.testing.conformance.registration import RegistrationTests
from kvxfer.testing.conformance.roundtrip import RoundTripTests
from kvxfer.testing.conformance.sharing import SharingTests
from kvxfer.testing.plugin import SILENCING_MARKS

__all__ = ["TransportConformance", "OverrideError", "refuse_overrides", "guard_test"]

#: What a subclass may set.
CONFIGURABLE: Final = frozenset({"transport", "device"})
#: Marks that would silence the kit's tests; the kit skips by itself.


class OverrideError(TypeError):
    """A subclass of :class:`TransportConformance` tried to replace or silence a kit test."""


class TransportConformance(RegistrationTests, RoundTripTests, SharingTests, LifecycleTests, KitBase):
    """Every conformance test of kvxfer's transport kit. Subclass it; set ``transport`` and
    ``device``; add tests if you like; do not override the kit's tests or fixtures."""

    #: Names the kit owns (filled in below, once the class exists).
    kit_names: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        refuse_overrides(cls, TransportConformance, CONFIGURABLE, "transport",
                         "(Transport.capabilities) or cannot run here (probe())")

    @pytest.fixture(autouse=True)
    def _kit_guard(self, request: pytest.FixtureRequest) -> Iterator[None]:
        """Fails a kit test that was replaced after the class was defined (``setattr``)."""
        guard_test(request, TransportConformance)
        yield


def refuse_overrides(cls: type, kit: type, configurable: frozenset[str], what: str, claims: str) -> None:
    """Raise :class:`OverrideError` when ``cls``, a subclass of the conformance kit ``kit``,
    overrides one of the kit's names or silences the whole kit with a mark. Both kits (transports
    and stores) call this from ``__init_subclass__``."""
    clash = sorted(n for n in vars(cls) if n in kit.kit_names)  # type: ignore[attr-defined]
    if clash:
        raise OverrideError(
            f"{cls.__qualname__} overrides {', '.join(clash)} of the kvxfer conformance kit. Kit tests "
            f"and fixtures must not be overridden: the kit skips what the {what} does not claim "
            f"{claims}. Set only {', '.join(sorted(configurable))}; add your own tests under other names."
        )
    silencing = [m.name for m in _marks(vars(cls).get("pytestmark")) if m.name in SILENCING_MARKS]
    if silencing:
        raise OverrideError(
            f"{cls.__qualname__} marks the whole kvxfer conformance kit with {', '.join(silencing)}; "
            f"let probe() say why the {what} cannot run here instead"
        )


def guard_test(request: pytest.FixtureRequest, kit: type) -> None:
    """Fail the running test if it is a test of ``kit`` replaced after its class was defined."""
    name = getattr(request.node, "originalname", request.node.name)
    cls = request.cls
    if cls is not None and name in kit.kit_names:  # type: ignore[attr-defined]
        mine = getattr(kit, name)
        if getattr(cls, name) is not mine:
            pytest.fail(f"{cls.__qualname__}.{name} was replaced; kvxfer conformance tests must run "
                        f"as the kit defines them", pytrace=False)


def _marks(value: object) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


TransportConformance.kit_names = frozenset(
    n for n in dir(TransportConformance)
    if n.startswith(("test_", "kit", "_kit")) or n in {"kit_device_name"}
)
