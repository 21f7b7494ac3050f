"""Finding plugins: transports (entry points in group ``kvxfer.transports``) and store backends
(``kvxfer.stores``, see :mod:`kvxfer.store`), loaded lazily by name through one
:class:`EntryPointGroup` each. Both discovery and loading go through :mod:`importlib.metadata`,
which reads the installed metadata every time it is asked (a cache of entry points on disk, as
stevedore keeps one, can miss a plugin installed within two minutes of the previous change).

A plugin that fails to import, declares another ``api_version``, names something that is not
a plugin of its group or has a name another distribution also provides is reported (``kvxfer
plugins``) and breaks nothing else. An unknown name
raises :class:`TransportNotFound` (or :class:`~kvxfer.errors.StoreNotFound`) listing what is
installed and the distributions of the kvxfer project that provide more (:data:`DISTRIBUTIONS`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any, Final

from kvxfer.errors import (
    KvxferError,
    LayoutError,
    TransportBroken,
    TransportError,
    TransportNotFound,
    TransportUnavailable,
)
from kvxfer.transport.contract import API_VERSION, Probe, Transport

if TYPE_CHECKING:
    import torch

    from kvxfer.layout import KVLayout

__all__ = ["DISTRIBUTIONS", "NAMESPACE", "EntryPointGroup", "PluginInfo", "TRANSPORTS", "checked_probe",
           "get_transport", "list_plugins", "run_probe", "select", "refresh"]

log = logging.getLogger(__name__)

NAMESPACE: Final = "kvxfer.transports"
AUTO: Final = "auto"

#: The transports the kvxfer project publishes, by name: the distribution that provides each.
#: An unknown name is answered with these (never with a package name made up from the name). They
#: are not on PyPI: each is installed from a kvxfer checkout, where it is ``plugins/<name>``.
DISTRIBUTIONS: Final[dict[str, str]] = {
    "cpu_gather": "kvxfer-cpu-gather",
    "cuda_ipc": "kvxfer-cuda-ipc",
    "hpu": "kvxfer-hpu",
}


@dataclass(frozen=True, slots=True)
class PluginInfo:
    """One installed plugin entry point (transport or store), as ``kvxfer plugins`` shows it."""

    name: str
    target: str
    distribution: str
    version: str
    #: "available", "unavailable" (probe said no) or "broken" (failed to load)
    health: str
    detail: str
    api_version: int | None
    style: str = ""
    #: Whether a transport declares itself meant for production (``kvxfer serve`` loads only those
    #: by default); False for plugins without the notion (stores).
    production: bool = False


class EntryPointGroup:
    """Discovery and lazy loading of one entry point group of plugins (transports in
    ``kvxfer.transports``, store backends in ``kvxfer.stores``): the one place both kinds are
    found, loaded, checked against their contract version and reported.

    ``kind`` names the plugin kind in messages ("transport", "store"); ``base`` is the class a
    loaded plugin must be an instance of; ``api_version`` the contract version it must declare
    (kvxfer exports it as ``api_constant``, which messages to plugin authors name);
    ``not_found`` / ``broken`` the exceptions raised for an unknown name and for a plugin that
    fails to load; ``distributions`` the plugins of this kind the kvxfer project publishes
    (name -> distribution), which the error for an unknown name suggests. A plugin whose class
    has ``contract_errors()`` is refused when it returns any. Thread-safe.
    """

    def __init__(self, namespace: str, kind: str, base: type, api_version: int, api_constant: str,
                 not_found: type[KvxferError], broken: type[KvxferError],
                 distributions: dict[str, str] | None = None) -> None:
        self.namespace = namespace
        self.distributions = dict(distributions or {})
        self.kind = kind
        self.base = base
        self.api_version = api_version
        self.api_constant = api_constant
        self.not_found = not_found
        self.broken = broken
        self._lock = threading.Lock()
        self._entry_points: dict[str, EntryPoint] | None = None
        self._loaded: dict[str, Any] = {}
        self._broken: dict[str, str] = {}
        #: names that more than one distribution provides -> those distributions
        self._twice: dict[str, list[str]] = {}

    def entry_points(self) -> dict[str, EntryPoint]:
        """Installed entry points by name, read from package metadata without importing them."""
        with self._lock:
            if self._entry_points is None:
                found: dict[str, EntryPoint] = {}
                self._twice = {}
                for ep in entry_points(group=self.namespace):
                    if ep.name in found:
                        self._twice.setdefault(ep.name, [_dist(found[ep.name])]).append(_dist(ep))
                        continue
                    found[ep.name] = ep
                self._entry_points = found
            return self._entry_points

    def refresh(self) -> None:
        """Forget what was discovered and loaded (tests that install plugins call this)."""
        with self._lock:
            self._entry_points = None
            self._loaded.clear()
            self._broken.clear()

    def names(self) -> list[str]:
        return sorted(self.entry_points())

    def load(self, name: str) -> Any:
        """The plugin object called ``name`` (an instance of ``base``); raises ``not_found`` or
        ``broken`` with a message naming the group, the plugin and its distribution."""
        with self._lock:
            if name in self._loaded:
                return self._loaded[name]
            if name in self._broken:
                raise self.broken(self._broken[name])
        eps = self.entry_points()
        ep = eps.get(name)
        if ep is None:
            raise self.not_found(self._unknown(name, eps))
        try:
            twice = self._twice.get(name)
            if twice:  # which one would load depends on the order of sys.path and of directory listings
                raise self.broken(f"{self.kind} {name!r} is provided by {len(twice)} distributions "
                                  f"({', '.join(twice)}); uninstall all but one")
            target = ep.load()  # the entry point just read from metadata (no cache that could be stale)
            plugin = target() if isinstance(target, type) else target
            if not isinstance(plugin, self.base):
                raise TypeError(f"{ep.value} is a {type(plugin).__name__}, not a kvxfer {self.base.__name__}")
            declared = getattr(plugin, "api_version", None)
            if declared != self.api_version:
                raise self.broken(
                    f"{self.kind} {name!r} ({_dist(ep)}) implements kvxfer {self.kind} api_version {declared}, "
                    f"this kvxfer implements {self.api_version}; install matching versions of kvxfer and the plugin "
                    f"(a plugin declares api_version = {self.api_constant})"
                )
            called = getattr(plugin, "name", None)
            if called != name:
                raise TypeError(f"entry point {name!r} names a {self.kind} called {called!r}; the two must be equal "
                                f"(set name = {name!r} on {type(plugin).__name__}, or rename the entry point)")
            check = getattr(plugin, "contract_errors", None)
            wrong = check() if callable(check) else []
            if wrong:
                raise self.broken(f"{self.kind} {name!r} ({_dist(ep)}) breaks the kvxfer {self.kind} contract: "
                                  + "; ".join(wrong))
        except self.broken as exc:
            with self._lock:
                self._broken[name] = str(exc)
            log.warning("%s", exc)
            raise
        except Exception as exc:  # noqa: BLE001  (any import-time failure of a third-party plugin)
            msg = (f"{self.kind} plugin {name!r} ({self.namespace}: {_dist(ep)}) failed to load: "
                   f"{type(exc).__name__}: {exc}")
            with self._lock:
                self._broken[name] = msg
            log.warning("%s", msg)
            raise self.broken(msg) from exc
        with self._lock:
            self._loaded[name] = plugin
        return plugin

    def _unknown(self, name: str, eps: dict[str, EntryPoint]) -> str:
        """The message for a name no installed entry point has: what is installed, and what the
        kvxfer project publishes that is not (a distribution only where one exists)."""
        installed = ", ".join(f"{n} ({_dist_name(ep)})" for n, ep in sorted(eps.items())) or "none"
        msg = f"no {self.kind} named {name!r} in entry point group {self.namespace!r}; installed: {installed}"
        if name in self.distributions:
            dist = self.distributions[name]
            return (f"{msg}. {name!r} comes with the distribution {dist}: pip install plugins/{name} in a kvxfer "
                    "checkout, or pick an installed one")
        missing = {n: d for n, d in sorted(self.distributions.items()) if n not in eps}
        more = (f"; the kvxfer project also publishes "
                f"{', '.join(f'{n} ({d}: pip install plugins/{n})' for n, d in missing.items())}, "
                "installed from a kvxfer checkout") if missing else ""
        return (f"{msg}{more}. Pick one of these, or install a third-party plugin that provides {name!r} "
                f"(`kvxfer plugins` lists what is installed)")

    def list(self) -> list[PluginInfo]:
        """Every installed plugin of the group with its health; loads each (import errors are
        reported, not raised). ``style`` is filled by plugins that have one (transports)."""
        out = []
        for name, ep in sorted(self.entry_points().items()):
            dist = getattr(ep, "dist", None)
            base: dict[str, Any] = dict(name=name, target=getattr(ep, "value", ""),
                                        distribution=dist.name if dist else "?", version=dist.version if dist else "?")
            try:
                plugin = self.load(name)
            except self.broken as exc:
                out.append(PluginInfo(**base, health="broken", detail=str(exc), api_version=None))
                continue
            probe = checked_probe(plugin)
            problem = getattr(plugin, "probe_problem", lambda _: None)(probe)  # transports: no device named
            if problem is not None:
                probe = Probe(False, problem)
            style = getattr(plugin, "style", "")
            out.append(PluginInfo(
                **base,
                health="available" if probe.available else "unavailable",
                detail=probe.reason,
                api_version=plugin.api_version,
                style=str(getattr(style, "value", style)),
                production=bool(getattr(plugin, "production", False)),
            ))
        return out


def run_probe(plugin: Any) -> tuple[Probe, bool]:
    """``(plugin.probe(), False)``; ``(an unavailable Probe saying what was wrong, True)`` when the
    probe broke its contract (it must not raise, and returns a :class:`Probe`): one plugin's fault
    is its own, never every plugin's (``kvxfer plugins``) or a traceback (``kvxfer serve``)."""
    try:
        probe = plugin.probe()
    except Exception as exc:  # noqa: BLE001  (a probe must not raise; report it if it does)
        return Probe(False, f"probe() raised {type(exc).__name__}: {exc}"), True
    if not isinstance(probe, Probe) or not isinstance(probe.available, bool) or not isinstance(probe.reason, str):
        return Probe(False, f"probe() returned {probe!r:.200}, not a kvxfer Probe(available: bool, reason: str)"), True
    return probe, False


def checked_probe(plugin: Any) -> Probe:
    """``plugin.probe()``, or an unavailable Probe saying how it broke its contract (:func:`run_probe`)."""
    return run_probe(plugin)[0]


#: The transports' group.
TRANSPORTS: Final = EntryPointGroup(NAMESPACE, "transport", Transport, API_VERSION, "kvxfer.transport.API_VERSION",
                                    TransportNotFound, TransportBroken, DISTRIBUTIONS)


def refresh() -> None:
    """Forget what was discovered and loaded (tests that install plugins call this)."""
    TRANSPORTS.refresh()


def installed_names() -> list[str]:
    return TRANSPORTS.names()


def _load(name: str) -> Transport:
    transport: Transport = TRANSPORTS.load(name)
    return transport


def _dist_name(ep: object) -> str:
    dist = getattr(ep, "dist", None)
    return str(dist.name) if dist is not None else str(getattr(ep, "value", ep))


def _dist(ep: object) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else str(getattr(ep, "value", ep))


def get_transport(name: str, *, require_available: bool = True) -> Transport:
    """The transport called ``name``; with ``require_available``, one whose probe says yes."""
    transport = _load(name)
    if require_available:
        probe = checked_probe(transport)
        if not probe.available:
            raise TransportUnavailable(f"transport {name!r} cannot run here: {probe.reason}")
    return transport


def list_plugins() -> list[PluginInfo]:
    """Every installed transport with its health; loads each (import errors are reported)."""
    return TRANSPORTS.list()


def select(name: str, device: torch.device, among: Collection[str] | None = None, *,
           kv: tuple[KVLayout, Sequence[torch.Tensor]] | None = None) -> Transport:
    """The transport for KV tensors on ``device``: ``name``, or, for ``"auto"``, the one with the
    highest :meth:`Transport.priority_for` among ``among`` (default: every installed one) that
    can serve the device here. With ``kv`` (the layout and its layers), only a transport whose
    capabilities claim them (:meth:`Capabilities.refusal`); a named one that does not raises
    :class:`LayoutError`."""
    if name != AUTO:
        transport = get_transport(name)
        refusal = transport.refusal(device)
        if refusal is not None:
            raise TransportUnavailable(f"transport {name!r} cannot move KV tensors on device {device}: {refusal}")
        why = None if kv is None else transport.capabilities.refusal(*kv)
        if why is not None:
            raise LayoutError(f"transport {name!r} {why}; register through another transport, or 'auto'")
        return transport
    names = installed_names() if among is None else list(among)
    candidates = []
    refused = []
    for n in names:
        try:
            t = _load(n)
        except TransportError:  # not installed here, or broken: `kvxfer plugins` says which
            continue
        if not t.serves(device):
            continue
        why = None if kv is None else t.capabilities.refusal(*kv)
        if why is None:
            candidates.append(t)
        else:
            refused.append(f"{n} {why}")
    if not candidates:
        raise TransportNotFound(
            f"none of the transports {', '.join(names) or '(none)'} can move KV tensors on {device} here"
            + (f" ({'; '.join(refused)})" if refused else " (see `kvxfer plugins`)")
        )
    return max(candidates, key=lambda t: (t.priority_for(device), t.name))
