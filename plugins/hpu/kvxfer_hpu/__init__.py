"""kvxfer-hpu: the client-driven transport for accelerators without CUDA IPC (Intel Gaudi first).

To store, the engine's process gathers each chunk's blocks of every layer on the device into a
staging buffer (one ``index_select`` per layer), then copies the buffer once into the chunk's
reserved slot of the server's shared-memory arena, which it pinned in place for the device's DMA
where the device API allows (CUDA: ``cudaHostRegister``). A retrieve is the reverse: one copy
into staging, then one ``index_copy_`` per layer. The server side is the core's (as for
cpu_gather), plus hpu's figures for the server's metrics (:mod:`kvxfer_hpu.server`).

Every device-specific step goes through :class:`DeviceOps` (:func:`ops_for` picks
:class:`HpuOps` for Gaudi, :class:`GenericOps` for any other torch device). Gaudi software
(``habana_frameworks``) is never imported by importing this package.
"""

from __future__ import annotations

from importlib.metadata import version

from kvxfer_hpu.ops import DeviceOps, GenericOps, HpuOps, Pinning, ops_for
from kvxfer_hpu.transport import PRIORITY, HpuContext, HpuRegistration, HpuTransport

__all__ = [
    "HpuTransport",
    "HpuContext",
    "HpuRegistration",
    "PRIORITY",
    "DeviceOps",
    "GenericOps",
    "HpuOps",
    "Pinning",
    "ops_for",
]
__version__ = version("kvxfer-hpu")  # defined once, in pyproject.toml
