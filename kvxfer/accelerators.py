"""What a transport's ``probe()`` needs to know about this host, found without importing torch.

``kvxfer plugins`` and the server probe every installed transport; importing torch takes about a
second, so probes ask these instead of ``torch.cuda.is_available()``:

* :func:`torch_build`: the installed torch's version and the backends it was built with, read
  from its ``torch/version.py`` (parsed, never executed);
* :func:`cuda_devices`: how many NVIDIA GPUs torch's CUDA can use here, from torch's build and
  the CUDA driver's C API (``libcuda.so.1``: ``cuInit``, ``cuDriverGetVersion``,
  ``cuDeviceGetCount``), or why none.

Like ``torch.cuda.is_available()``, :func:`cuda_devices` initializes the CUDA driver in the
calling process: a process that forks afterwards cannot use CUDA in the child.
"""

from __future__ import annotations

import ast
import ctypes
import functools
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = ["TorchBuild", "torch_build", "cuda_devices"]

#: cuInit's answer when the driver is installed but finds no device (or none is visible).
_CUDA_ERROR_NO_DEVICE: Final = 100


@dataclass(frozen=True, slots=True)
class TorchBuild:
    """The installed torch, as ``torch.__version__`` and ``torch.version`` describe it."""

    #: e.g. ``"2.13.0+cpu"``.
    version: str
    #: The CUDA version it was built for (``torch.version.cuda``); None: built without CUDA.
    cuda: str | None
    #: The HIP version of a ROCm build (``torch.version.hip``); None otherwise.
    hip: str | None
    #: The XPU (SYCL) version it was built with (``torch.version.xpu``); None otherwise.
    xpu: str | None


@functools.cache
def torch_build() -> TorchBuild | None:
    """The installed torch's build, or None when torch is not installed. Read from its
    ``version.py`` without importing torch (from ``torch.version`` when torch is imported already
    or that file cannot be read). Never raises."""
    if "torch" not in sys.modules:
        try:
            spec = importlib.util.find_spec("torch")
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            return None
        fields = _literals([Path(loc) / "version.py" for loc in spec.submodule_search_locations or ()])
        if isinstance(fields.get("__version__"), str):
            return TorchBuild(str(fields["__version__"]), _str(fields.get("cuda")), _str(fields.get("hip")),
                              _str(fields.get("xpu")))
    try:  # imported already, or its version.py is unreadable: ask torch itself
        import torch
    except Exception:  # noqa: BLE001  (a torch that fails to import is no usable torch; never raised)
        return None
    v = torch.version
    return TorchBuild(str(torch.__version__), getattr(v, "cuda", None), getattr(v, "hip", None),
                      getattr(v, "xpu", None))


def _literals(paths: list[Path]) -> dict[str, object]:
    """The module-level ``NAME = <literal>`` (and ``NAME: T = <literal>``) assignments of the
    first of ``paths`` that parses."""
    for path in paths:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, ValueError):
            continue
        out: dict[str, object] = {}
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                target, value = node.target, node.value
            else:
                continue
            if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
                out[target.id] = value.value
        return out
    return {}


def _str(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


@dataclass(frozen=True, slots=True)
class _Driver:
    """What ``libcuda.so.1`` says: visible devices, the newest CUDA it supports, why none."""

    devices: int
    version: str
    error: str


@functools.cache
def _cuda_driver() -> _Driver:
    """Asked once per process: after ``cuInit`` the driver's answer (``CUDA_VISIBLE_DEVICES``
    included) no longer changes."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return _Driver(0, "", f"finds no NVIDIA driver ({exc}): install one, or use a transport for this device")
    try:
        found = ctypes.c_int(0)
        driver = ""
        if lib.cuDriverGetVersion(ctypes.byref(found)) == 0:
            driver = f"{found.value // 1000}.{found.value % 1000 // 10}"
        found.value = 0
        call, rc = "cuInit", lib.cuInit(0)
        if rc == 0:
            call, rc = "cuDeviceGetCount", lib.cuDeviceGetCount(ctypes.byref(found))
        if rc not in (0, _CUDA_ERROR_NO_DEVICE):
            return _Driver(0, driver, f"cannot use the NVIDIA driver (CUDA {driver or '?'}): {call} failed with "
                                      f"{_error_name(lib, rc)}")
    except (AttributeError, OSError) as exc:  # a libcuda.so.1 without the driver API
        return _Driver(0, "", f"cannot use libcuda.so.1: {exc}")
    if found.value > 0:
        return _Driver(found.value, driver, "")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return _Driver(0, driver, "sees no CUDA device" + (f" (CUDA_VISIBLE_DEVICES={visible!r})"
                                                       if visible is not None else ""))


def _error_name(lib: ctypes.CDLL, rc: int) -> str:
    name = ctypes.c_char_p()
    if lib.cuGetErrorName(rc, ctypes.byref(name)) == 0 and name.value:
        return f"{name.value.decode(errors='replace')} ({rc})"
    return f"error {rc}"


def cuda_devices() -> tuple[int, str]:
    """``(n, note)``: the NVIDIA GPUs torch's CUDA can use in this process, and the CUDA versions;
    ``(0, why)`` when there are none, saying what to do. Never raises; imports no torch."""
    build = torch_build()
    if build is None:
        return 0, "torch is not installed (pip install torch, a CUDA build)"
    if build.cuda is None:
        if build.hip is not None:
            return 0, f"torch {build.version} is a ROCm build (HIP {build.hip}), without NVIDIA CUDA"
        return 0, f"torch {build.version} was built without CUDA (install a CUDA build of torch)"
    driver = _cuda_driver()
    if not driver.devices:
        return 0, f"torch {build.version} (CUDA {build.cuda}) {driver.error}"
    if driver.version and _major(driver.version) < _major(build.cuda):
        return 0, (f"torch {build.version} needs CUDA {build.cuda}, and the NVIDIA driver supports CUDA "
                   f"{driver.version} at most: update the driver, or install a torch built for CUDA {driver.version}")
    return driver.devices, f"CUDA {build.cuda}, driver CUDA {driver.version or '?'}"


def _major(cuda_version: str) -> int:
    try:
        return int(cuda_version.split(".")[0])
    except ValueError:
        return 0
