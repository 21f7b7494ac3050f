"""Finding transports: entry points in group ``kvxfer.transports``, loaded lazily by name.

A plugin that fails to import, declares another ``api_version`` or names something that is not
a :class:`Transport` is reported (``kvxfer plugins``) and breaks nothing else. An unknown name
raises :class:`TransportNotFound` listing what is installed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Final

from stevedore import DriverManager, ExtensionManager

from kvxfer.errors import TransportBroken, TransportError, TransportNotFound, TransportUnavailable
from kvxfer.transport.contract import API_VERSION, Probe, Transport

if TYPE_CHECKING:
    import torch

__all__ = ["NAMESPACE", "PluginInfo", "get_transport", "list_plugins", "select", "refresh"]

log = logging.getLogger(__name__)

NAMESPACE: Final = "kvxfer.transports"
AUTO: Final = "auto"


@dataclass(frozen=True, slots=True)
class PluginInfo:
    """One installed transport entry point, as ``kvxfer plugins`` shows it."""

    name: str
    target: str
    distribution: str
    version: str
    #: "available", "unavailable" (probe said no) or "broken" (failed to load)
    health: str
    detail: str
    api_version: int | None
    style: str = ""


_lock = threading.Lock()
_entry_points: dict[str, EntryPoint] | None = None
_loaded: dict[str, Transport] = {}
_broken: dict[str, str] = {}


def _eps() -> dict[str, EntryPoint]:
    """Installed entry points by name, read from package metadata without importing them."""
    global _entry_points
    with _lock:
        if _entry_points is None:
            found: dict[str, EntryPoint] = {}
            for ep in entry_points(group=NAMESPACE):
                if ep.name in found:
                    log.warning("transport %r is installed twice; using %s", ep.name, found[ep.name].value)
                    continue
                found[ep.name] = ep
            _entry_points = found
        return _entry_points


def _import(name: str) -> object:
    """Import one plugin through stevedore; the plugin's own exception propagates."""
    def fail(_mgr: object, _ep: object, exc: BaseException) -> None:
        raise exc


    mgr: DriverManager[object] = DriverManager(NAMESPACE, name, invoke_on_load=False, on_load_failure_callback=fail)
    return mgr.driver


def refresh() -> None:
    """Forget what was discovered and loaded (tests that install plugins call this)."""
    global _entry_points
    with _lock:
        _entry_points = None
        _loaded.clear()
        _broken.clear()
        # stevedore keeps its own per-namespace list of entry points for the process' life
        ExtensionManager.ENTRY_POINT_CACHE.pop(NAMESPACE, None)


def installed_names() -> list[str]:
    return sorted(_eps())


def _load(name: str) -> Transport:
    with _lock:
        if name in _loaded:
            return _loaded[name]
        if name in _broken:
            raise TransportBroken(_broken[name])
    eps = _eps()
    ep = eps.get(name)
    if ep is None:
        installed = ", ".join(sorted(eps)) or "none"
        raise TransportNotFound(
            f"no transport named {name!r} in entry point group {NAMESPACE!r}; installed: {installed}. "
            f"Install its package (e.g. pip install kvxfer-{name.replace('_', '-')}) or pick another"
        )
    try:
        target = _import(name)
        transport = target() if isinstance(target, type) else target
        if not isinstance(transport, Transport):
            raise TypeError(f"{ep.value} is a {type(transport).__name__}, not a kvxfer Transport")
        declared = getattr(transport, "api_version", None)
        if declared != API_VERSION:
            raise TransportBroken(
                f"transport {name!r} ({_dist(ep)}) implements kvxfer transport api_version {declared}, "
                f"this kvxfer implements {API_VERSION}; install matching versions of kvxfer and the plugin"
            )
        if transport.name != name:
            raise TypeError(f"entry point {name!r} names a transport called {transport.name!r}")
        wrong = transport.contract_errors()
        if wrong:
            raise TransportBroken(f"transport {name!r} ({_dist(ep)}) breaks the kvxfer transport contract: "
                                  + "; ".join(wrong))
    except TransportBroken as exc:
        with _lock:
            _broken[name] = str(exc)
        raise
    except Exception as exc:  # any import-time failure of a third-party plugin
        msg = f"transport plugin {name!r} ({NAMESPACE}: {_dist(ep)}) failed to load: {type(exc).__name__}: {exc}"
        with _lock:
            _broken[name] = msg
        log.warning("%s", msg)
        raise TransportBroken(msg) from exc
    with _lock:
        _loaded[name] = transport
    return transport


def _dist(ep: object) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else str(getattr(ep, "value", ep))


def get_transport(name: str, *, require_available: bool = True) -> Transport:
    """The transport called ``name``; with ``require_available``, one whose probe says yes."""
    transport = _load(name)
    if require_available:
        probe = transport.probe()
        if not probe.available:
            raise TransportUnavailable(f"transport {name!r} cannot run here: {probe.reason}")
    return transport


def list_plugins() -> list[PluginInfo]:
    """Every installed transport with its health; loads each (import errors are reported)."""
    out = []
    for name, ep in sorted(_eps().items()):
        dist = getattr(ep, "dist", None)
        base = dict(name=name, target=getattr(ep, "value", ""), distribution=dist.name if dist else "?",
                    version=dist.version if dist else "?")
        try:
            t = _load(name)
        except TransportBroken as exc:
            out.append(PluginInfo(**base, health="broken", detail=str(exc), api_version=None))
            continue
        try:
            probe = t.probe()
        except Exception as exc:  # noqa: BLE001  (a probe must not raise; report it if it does)
            probe = Probe(False, f"probe() raised {type(exc).__name__}: {exc}")
        out.append(PluginInfo(
            **base,
            health="available" if probe.available else "unavailable",
            detail=probe.reason,
            api_version=t.api_version,
            style=t.style.value,
        ))
    return out


def select(name: str, device: torch.device, among: Collection[str] | None = None) -> Transport:
    """The transport for KV tensors on ``device``: ``name``, or, for ``"auto"``, the one with the
    highest :meth:`Transport.priority_for` among ``among`` (default: every installed one) that
    can serve the device here."""
    if name != AUTO:
        transport = get_transport(name)
        if not transport.serves(device):
            raise TransportUnavailable(
                f"transport {name!r} cannot move KV tensors on device {device} "
                f"(it serves {', '.join(sorted(transport.capabilities.device_types))}; here: "
                f"{transport.probe().reason or 'see kvxfer plugins'})"
            )
        return transport
    names = installed_names() if among is None else list(among)
    candidates = []
    for n in names:
        try:
            t = _load(n)
        except TransportError:  # not installed here, or broken: `kvxfer plugins` says which
            continue
        if t.serves(device):
            candidates.append(t)
    if not candidates:
        raise TransportNotFound(
            f"none of the transports {', '.join(names) or '(none)'} can move KV tensors on {device} here "
            f"(see `kvxfer plugins`)"
        )
    return max(candidates, key=lambda t: (t.priority_for(device), t.name))
