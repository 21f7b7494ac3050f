"""Device operations behind one small interface, one implementation per device type.

The transport's data path (:mod:`kvxfer_hpu.transport`) touches the accelerator only through
:class:`DeviceOps`: availability, synchronization, the lazy-mode flush, pinning host memory in
place, staging buffers, the element type of row copies, streams and events.

* :class:`GenericOps` works for any torch device type through torch's own per-device module
  (``torch.cuda``, ``torch.xpu``, ...): streams and events where the module has them, and on
  CUDA the client's arena mapping pinned in place with ``cudaHostRegister``.
* :class:`HpuOps` is for Intel Gaudi. It imports ``habana_frameworks`` only when first used
  (never at module load, never from :meth:`DeviceOps.probe`), flushes lazy mode with
  ``mark_step`` and synchronizes through the Habana bridge. Nothing of it has run on Gaudi
  hardware: see docs/hpu.md.

:func:`ops_for` picks the implementation for a device type. Importing this module imports no
torch, and neither does probing cpu, hpu, or cuda and xpu where torch was built without them or
(cuda) the CUDA driver answers (:mod:`kvxfer.accelerators`): ``kvxfer plugins`` probes hpu.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final, Protocol, runtime_checkable

from kvxfer.transport import copy_dtype, cuda_devices, torch_build

if TYPE_CHECKING:
    import torch

__all__ = ["DeviceOps", "Pinning", "GenericOps", "HpuOps", "ops_for", "KNOWN_DEVICE_TYPES"]

log = logging.getLogger(__name__)

#: Device types :func:`kvxfer_hpu.HpuTransport.probe` reports on by name (any other torch
#: device type is still served when its torch module says it is available).
KNOWN_DEVICE_TYPES: Final = ("cpu", "cuda", "hpu", "xpu")

#: cudaHostRegisterPortable: pinned for every CUDA context of the process, not only the current one.
_CUDA_HOST_REGISTER_PORTABLE: Final = 1


@dataclass(slots=True)
class Pinning:
    """The outcome of :meth:`DeviceOps.pin`: whether host memory is now page-locked for the
    device's DMA engines, a note for status and logs, and how to undo it."""

    pinned: bool
    note: str
    _undo: Callable[[], None] | None = field(default=None, repr=False)

    def release(self) -> None:
        """Unpin (idempotent). Must run before the memory is unmapped."""
        undo, self._undo = self._undo, None
        if undo is not None:
            undo()


@runtime_checkable
class DeviceOps(Protocol):
    """What the hpu transport needs of a device type. One instance serves every device of
    that type in the process; methods may be called from any thread."""

    #: The torch device type served (``"hpu"``, ``"cuda"``, ``"cpu"``, ...).
    device_type: str
    #: True when device memory is host memory (cpu): rows are copied straight between the KV
    #: tensors and the arena slot, with no staging buffer.
    direct: bool

    def probe(self) -> tuple[bool, str]:
        """(usable here, why or why not). Cheap; never raises; imports no vendor software."""
        ...

    def synchronize(self, device: torch.device) -> None:
        """Block until all work queued on ``device`` is done."""
        ...

    def flush(self, device: torch.device) -> None:
        """Submit queued lazy-mode work for execution (Gaudi's ``mark_step``); else nothing."""
        ...

    def pin(self, host: torch.Tensor) -> Pinning:
        """Page-lock ``host`` (a contiguous CPU tensor, e.g. the arena mapping) in place for
        this device's DMA, if the device's API can; never raises (``Pinning(False, why)``)."""
        ...

    def copy_dtype(self, rows: list[torch.Tensor]) -> torch.dtype:
        """The element type in which this device copies the rows of ``rows`` (each layer's row
        view, ``[n, row_elems]``, dense in its last dim); the context reinterprets its rows and
        the arena slots with it. Byte copies only."""
        ...

    def staging(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A device buffer of ``nbytes`` (uint8) for gathering rows before one copy to the host."""
        ...

    def new_stream(self, device: torch.device) -> Any | None:
        """A new stream on ``device``, or None where the device has no streams."""
        ...

    def use_stream(self, stream: Any | None) -> AbstractContextManager[Any]:
        """Context in which work is queued on ``stream`` (nothing when None)."""
        ...

    def new_event(self) -> Any | None:
        """A new event (``record(stream)``, ``stream.wait_event(event)``), or None."""
        ...

    def current_stream(self, device: torch.device) -> Any | None:
        """The calling thread's current stream on ``device``, or None."""
        ...


class GenericOps:
    """:class:`DeviceOps` for any torch device type, through ``torch.<device_type>``."""

    def __init__(self, device_type: str, *, direct: bool | None = None) -> None:
        """``direct`` (default: True for cpu only) copies rows straight between KV tensors and
        arena slots; False forces the staging path (on cpu: to exercise it without a device)."""
        self.device_type = device_type
        self.direct = device_type == "cpu" if direct is None else direct
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device_type!r}, direct={self.direct})"

    # ------------------------------------------------------------------ the torch module

    def module(self) -> ModuleType | None:
        """``torch.<device_type>`` (e.g. ``torch.cuda``), or None if torch has none."""
        import torch

        mod = getattr(torch, self.device_type, None)
        return mod if isinstance(mod, ModuleType) else None

    def _has_streams(self) -> bool:
        mod = self.module()
        return self.device_type != "cpu" and mod is not None and all(
            hasattr(mod, name) for name in ("Stream", "Event", "stream", "current_stream"))

    # ------------------------------------------------------------------ DeviceOps

    def probe(self) -> tuple[bool, str]:
        if self.device_type == "cpu":
            return True, "host memory: rows copied straight into the arena slots"
        known = self._probe_without_torch()
        return known if known is not None else self._probe_with_torch()

    def _probe_without_torch(self) -> tuple[bool, str] | None:
        """The answer from torch's build and the CUDA driver, or None where only torch can tell
        (cuda on ROCm, xpu on a torch built with it, other device types)."""
        build = torch_build()
        if build is None:
            return False, "torch is not installed"
        if self.device_type == "cuda" and build.hip is None:
            n, note = cuda_devices()
            if not n:
                return False, note
            # torch.cuda always has streams and events
            return True, f"{n} device(s) ({note}), streams: yes, host pinning: cudaHostRegister"
        if self.device_type == "xpu" and build.xpu is None:
            return False, f"torch {build.version} was built without XPU"
        return None

    def _probe_with_torch(self) -> tuple[bool, str]:
        import torch

        mod = self.module()
        if mod is None or not callable(getattr(mod, "is_available", None)):
            return False, f"this torch ({torch.__version__}) has no torch.{self.device_type} module"
        try:
            available = bool(mod.is_available())
        except Exception as exc:  # noqa: BLE001  (a broken driver install must not break probing)
            return False, f"torch.{self.device_type}.is_available() raised {type(exc).__name__}: {exc}"
        if not available:
            return False, f"torch.{self.device_type}.is_available() is False (no device, or torch built without it)"
        count = getattr(mod, "device_count", lambda: 1)()
        pin = "cudaHostRegister" if self.device_type == "cuda" else "none (pageable copies)"
        return True, f"{count} device(s), streams: {'yes' if self._has_streams() else 'no'}, host pinning: {pin}"

    def synchronize(self, device: torch.device) -> None:
        mod = self.module()
        sync = getattr(mod, "synchronize", None) if self.device_type != "cpu" else None
        if sync is not None:
            sync(device)

    def flush(self, device: torch.device) -> None:
        return None

    def pin(self, host: torch.Tensor) -> Pinning:
        if self.device_type != "cuda":
            return Pinning(False, f"{self.device_type}: torch has no in-place host registration; pageable copies")
        return _cuda_host_register(host)

    def copy_dtype(self, rows: list[torch.Tensor]) -> torch.dtype:
        # 16-byte elements where every layer's rows allow: torch's index kernels run at copy
        # speed on them (see kvxfer.layout).
        return copy_dtype(rows)

    def staging(self, nbytes: int, device: torch.device) -> torch.Tensor:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def new_stream(self, device: torch.device) -> Any | None:
        if not self._has_streams():
            return None
        return self.module().Stream(device=device)  # type: ignore[union-attr]  # module() is set when there are streams

    def use_stream(self, stream: Any | None) -> AbstractContextManager[Any]:
        if stream is None:
            return contextlib.nullcontext()
        return self.module().stream(stream)  # type: ignore[union-attr]  # module() is set when there are streams

    def new_event(self) -> Any | None:
        return self.module().Event() if self._has_streams() else None  # type: ignore[union-attr]  # module() is set when there are streams

    def current_stream(self, device: torch.device) -> Any | None:
        if not self._has_streams():
            return None
        return self.module().current_stream(device)  # type: ignore[union-attr]  # module() is set when there are streams


def _cuda_host_register(host: torch.Tensor) -> Pinning:
    """Page-lock ``host`` with ``cudaHostRegister`` (portable), undone by ``cudaHostUnregister``."""
    if host.device.type != "cpu" or not host.is_contiguous():
        return Pinning(False, "cudaHostRegister needs a contiguous CPU tensor")
    nbytes = host.numel() * host.element_size()
    if nbytes == 0:
        return Pinning(False, "nothing to pin (empty)")
    try:
        import torch

        cudart = torch.cuda.cudart()
        ptr = host.data_ptr()
        rc = cudart.cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_PORTABLE)
        ok = _cuda_ok(rc)
    except Exception as exc:  # noqa: BLE001  (no driver, or torch built without CUDA)
        return Pinning(False, f"cudaHostRegister unavailable: {type(exc).__name__}: {exc}")
    if not ok:
        clear = getattr(cudart, "cudaGetLastError", None)
        if clear is not None:  # the runtime keeps the error; torch's next launch check would report it
            clear()
        return Pinning(False, f"cudaHostRegister of {nbytes} bytes failed ({rc}); pageable copies")

    def undo() -> None:
        try:
            rc2 = cudart.cudaHostUnregister(ptr)
            if not _cuda_ok(rc2):
                log.warning("cudaHostUnregister(%#x) failed: %s", ptr, rc2)
        except Exception as exc:  # noqa: BLE001  (release must not raise (it runs in close()))
            log.warning("cudaHostUnregister(%#x) raised %s: %s", ptr, type(exc).__name__, exc)

    return Pinning(True, f"cudaHostRegister ({nbytes} bytes)", undo)


def _cuda_ok(rc: Any) -> bool:
    """Whether a cudaError_t from ``torch.cuda.cudart()`` is cudaSuccess (0)."""
    return int(getattr(rc, "value", rc)) == 0


class HpuOps(GenericOps):
    """:class:`DeviceOps` for Intel Gaudi (``hpu``) through the Habana PyTorch bridge.

    Imports ``habana_frameworks.torch`` on first use (a registered KV cache on ``hpu`` means the
    engine imported it already). Differences from :class:`GenericOps`:

    * ``flush`` runs ``habana_frameworks.torch.core.mark_step()`` in lazy mode, so that queued
      gathers and scatters execute;
    * no streams: gather -> ``mark_step`` -> copy, one chunk after another;
    * rows are copied in the KV cache's own dtype (the ops vLLM's Gaudi backend itself uses on
      its caches: ``index_select`` and ``index_copy_``), not reinterpreted as 16-byte elements;
    * no in-place pinning of the arena mapping: the bridge exposes page-locked *allocation*
      (``pin_memory(device="hpu")``) but, as far as we found, no Python call that registers
      existing memory (Synapse's ``synHostMap`` is C only), so copies use pageable memory.

    None of this has been verified on Gaudi hardware.
    """

    def __init__(self, *, direct: bool = False) -> None:
        super().__init__("hpu", direct=direct)
        self._hpu: ModuleType | None = None
        self._core: ModuleType | None = None
        self._lazy: bool | None = None

    @staticmethod
    def installed() -> bool:
        """Whether the Gaudi PyTorch bridge is installed (looked up without importing it)."""
        try:
            return importlib.util.find_spec("habana_frameworks") is not None
        except (ImportError, ValueError):
            return False

    @staticmethod
    def imported() -> bool:
        """Whether this process has imported the bridge (``import habana_frameworks.torch``)."""
        return "habana_frameworks.torch" in sys.modules

    def _modules(self) -> tuple[ModuleType, ModuleType]:
        with self._lock:
            if self._hpu is None or self._core is None:
                import habana_frameworks.torch.core as core  # noqa: PLC0415 (lazy on purpose)
                import habana_frameworks.torch.hpu as hpu  # noqa: PLC0415

                self._core, self._hpu = core, hpu
                self._lazy = _is_lazy()
            return self._hpu, self._core

    def module(self) -> ModuleType | None:
        return self._modules()[0] if self.imported() else None

    def probe(self) -> tuple[bool, str]:
        if not self.installed():
            return False, "habana_frameworks (the Intel Gaudi PyTorch bridge) is not installed"
        if not self.imported():
            return False, ("habana_frameworks is installed but not imported in this process; "
                           "import habana_frameworks.torch before registering hpu tensors")
        try:
            hpu, _ = self._modules()
            available = bool(hpu.is_available())
        except Exception as exc:  # noqa: BLE001  (a broken Gaudi install must not break probing)
            return False, f"habana_frameworks.torch.hpu failed: {type(exc).__name__}: {exc}"
        if not available:
            return False, "habana_frameworks.torch.hpu.is_available() is False (no Gaudi device visible)"
        mode = "lazy (mark_step)" if self._lazy else "eager"
        return True, f"{hpu.device_count()} Gaudi device(s), {mode} mode, host pinning: none (pageable copies)"

    def synchronize(self, device: torch.device) -> None:
        hpu, _ = self._modules()
        hpu.synchronize()

    def flush(self, device: torch.device) -> None:
        _, core = self._modules()
        if self._lazy:
            core.mark_step()

    def pin(self, host: torch.Tensor) -> Pinning:
        return Pinning(False, "hpu: the Habana bridge has no in-place host registration in Python; "
                              "pageable copies")

    def copy_dtype(self, rows: list[torch.Tensor]) -> torch.dtype:
        return rows[0].dtype

    def new_stream(self, device: torch.device) -> Any | None:
        return None

    def new_event(self) -> Any | None:
        return None

    def current_stream(self, device: torch.device) -> Any | None:
        return None


def _is_lazy() -> bool:
    """Whether the Habana bridge runs in lazy mode (ops queue until ``mark_step``)."""
    try:
        from habana_frameworks.torch.utils.internal import is_lazy  # noqa: PLC0415

        return bool(is_lazy())
    except Exception:  # noqa: BLE001  (older/newer bridges: fall back to the documented switch)
        return os.environ.get("PT_HPU_LAZY_MODE", "1") != "0"


_OPS: dict[str, DeviceOps] = {}
_OPS_LOCK = threading.Lock()


def ops_for(device_type: str) -> DeviceOps:
    """The shared :class:`DeviceOps` of ``device_type``: :class:`HpuOps` for ``"hpu"``,
    :class:`GenericOps` for every other type. Imports nothing vendor-specific."""
    with _OPS_LOCK:
        ops = _OPS.get(device_type)
        if ops is None:
            ops = HpuOps() if device_type == "hpu" else GenericOps(device_type)
            _OPS[device_type] = ops
        return ops

