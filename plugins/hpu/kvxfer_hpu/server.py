"""The server half of hpu: the core's (slots in the arena, no copies), plus what hpu adds to the
server's metrics (hook ``kvxfer_metrics``). Importable without any accelerator.

The copies of a client-driven transport run in the engine's process; the client reports each
copy's time with its commit, and the server hands it to :meth:`HpuServerTransport.kvxfer_transfer_finished`.
Each registration says which device type its KV cache is on, whether the client pinned its arena
mapping, and how much device memory its staging takes. Samples (see docs/metrics.md):

* ``kvxfer_hpu_copies_total{device,op}``, ``kvxfer_hpu_copied_bytes_total{device,op}``,
  ``kvxfer_hpu_copy_seconds_total{device,op}``: transfers of hpu contexts since the server
  started, by device type and ``op`` (``store``/``retrieve``), and the clients' copy time;
* ``kvxfer_hpu_staging_bytes{device}``: device memory the open registrations' staging takes once
  each has run a transfer (none for KV tensors in host memory);
* ``kvxfer_hpu_contexts{device,pinned}``: open registrations, by device type and whether the
  arena mapping is pinned for DMA.

A registration names its device type, and a client may name any: the figures keep at most
:data:`MAX_DEVICE_LABELS` device types. A new one takes the place of one that no open
registration names (whose totals move to ``device="_other"``, so that the sums stay
monotonic); where every kept one is in use, the new registration's figures go to ``_other``.
A registration counts from the core's ``kvxfer_context_registered`` on, with what its
``context.registration`` declares (:meth:`HpuServerTransport.open` only checks it: the core can
still refuse a registration after ``open()``, and then nothing closes it).
"""

from __future__ import annotations

import dataclasses
import re
import threading
from dataclasses import dataclass
from typing import Any, Final

from kvxfer import ConfigError, hookimpl
from kvxfer.transport import KVLayout, MetricSample, Registration, ServerContext, ServerTransport

__all__ = ["HpuServerTransport", "MAX_DEVICE_LABELS", "MAX_STAGING_BYTES", "OTHER_DEVICE"]

#: Largest staging a registration may declare (a sanity bound on a figure from the wire).
MAX_STAGING_BYTES: Final = 1 << 40
#: Most device types the figures keep by name (a host has one or two).
MAX_DEVICE_LABELS: Final = 8
#: The ``device`` label of the figures of device types past :data:`MAX_DEVICE_LABELS`.
OTHER_DEVICE: Final = "_other"  # no device type matches it: they start with a letter
_DEVICE_TYPE: Final = re.compile(r"[a-z][a-z0-9_]{0,15}")
_OPS: Final = ("store", "retrieve")


@dataclass(frozen=True, slots=True)
class _Declared:
    """What one hpu registration declared."""

    device: str
    pinned: bool
    staging_bytes: int


def _declared(registration: Registration) -> _Declared:
    """What ``registration`` (an :class:`~kvxfer_hpu.HpuRegistration`) declares; ConfigError for
    a device type or staging size hpu does not accept."""
    device = getattr(registration, "device", "cpu")
    staging = getattr(registration, "staging_bytes", 0)
    if not isinstance(device, str) or not _DEVICE_TYPE.fullmatch(device):
        raise ConfigError(f"hpu registration: device must be a torch device type such as 'hpu', got {device!r}")
    if not 0 <= staging <= MAX_STAGING_BYTES:
        raise ConfigError(f"hpu registration: staging_bytes must be in [0, {MAX_STAGING_BYTES}], got {staging}")
    return _Declared(device, bool(getattr(registration, "host_pinned", False)), staging)


class HpuServerTransport(ServerTransport):
    """The core's server half of a client-driven transport, keeping hpu's figures. The server
    registers it as a hook plugin (its hooks run on the server's loop thread; :meth:`open` on
    the registration's worker thread)."""

    def __init__(self, transport: Any) -> None:
        super().__init__(transport)
        self._lock = threading.Lock()
        #: instance id -> what its registration declared, from registered until unregistered
        self._open: dict[int, _Declared] = {}
        #: (device type, op) -> [transfers, bytes, seconds]
        self._copies: dict[tuple[str, str], list[float]] = {}

    def open(self, registration: Registration, layout: KVLayout) -> ServerContext[Any, Any] | None:
        _declared(registration)
        return None  # client-driven: the core keeps the registration; nothing to copy here

    @hookimpl
    def kvxfer_context_registered(self, context: Any) -> None:
        if context.transport != self.transport.name:
            return
        declared = _declared(context.registration)  # checked by open() already
        with self._lock:
            self._open[context.instance_id] = dataclasses.replace(declared, device=self._label(declared.device))

    def _label(self, device: str) -> str:
        """The ``device`` label for a new registration's figures (under the lock)."""
        in_use = {d.device for d in self._open.values()}
        kept = ({dev for dev, _ in self._copies} | in_use) - {OTHER_DEVICE}
        if device in kept or len(kept) < MAX_DEVICE_LABELS:
            return device
        idle = sorted(kept - in_use)
        if not idle:
            return OTHER_DEVICE
        for op in _OPS:  # the idle type's totals go on under _other
            gone = self._copies.pop((idle[0], op), None)
            if gone is not None:
                t = self._copies.setdefault((OTHER_DEVICE, op), [0, 0, 0.0])
                for i, v in enumerate(gone):
                    t[i] += v
        return device

    @hookimpl
    def kvxfer_context_unregistered(self, context: Any) -> None:
        with self._lock:
            self._open.pop(context.instance_id, None)

    @hookimpl
    def kvxfer_transfer_finished(self, context: Any, op: str, nbytes: int,
                                 copy_seconds: float) -> None:
        with self._lock:
            declared = self._open.get(context.instance_id) if context.transport == self.transport.name else None
            if declared is None:
                return
            t = self._copies.setdefault((declared.device, op), [0, 0, 0.0])
            t[0] += 1
            t[1] += nbytes
            t[2] += copy_seconds

    @hookimpl
    def kvxfer_metrics(self) -> list[MetricSample]:
        with self._lock:
            declared = list(self._open.values())
            copies = {k: tuple(v) for k, v in self._copies.items()}
        out: list[MetricSample] = []
        for (device, op), (n, nbytes, seconds) in sorted(copies.items()):
            labels = {"device": device, "op": op}
            out += [
                MetricSample("kvxfer_hpu_copies_total", "counter", n, labels,
                             "Transfers of hpu contexts (copies run in the engine's process)."),
                MetricSample("kvxfer_hpu_copied_bytes_total", "counter", nbytes, labels,
                             "Bytes hpu contexts copied between device blocks and the arena."),
                MetricSample("kvxfer_hpu_copy_seconds_total", "counter", seconds, labels,
                             "Copy time of hpu contexts, measured by the clients (gather or scatter, "
                             "staging and host copy)."),
            ]
        staging: dict[str, int] = {}
        count: dict[tuple[str, bool], int] = {}
        for d in declared:
            staging[d.device] = staging.get(d.device, 0) + d.staging_bytes
            count[(d.device, d.pinned)] = count.get((d.device, d.pinned), 0) + 1
        for device, total in sorted(staging.items()):
            out.append(MetricSample("kvxfer_hpu_staging_bytes", "gauge", total, {"device": device},
                                    "Device memory of the open hpu registrations' staging buffers."))
        for (device, pinned), n in sorted(count.items()):
            out.append(MetricSample("kvxfer_hpu_contexts", "gauge", n,
                                    {"device": device, "pinned": str(pinned).lower()},
                                    "Open hpu registrations, by device type and pinned arena mapping."))
        return out

    def status(self) -> dict[str, str]:
        with self._lock:
            copies = dict(self._copies)
        out: dict[str, str] = {}
        for (device, op), (n, nbytes, seconds) in sorted(copies.items()):
            out[f"{device}_{op}_n"], out[f"{device}_{op}_bytes"], out[f"{device}_{op}_s"] = (
                str(int(n)), str(int(nbytes)), f"{seconds:.6f}")
        return out
