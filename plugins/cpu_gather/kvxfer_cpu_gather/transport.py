"""The cpu_gather transport: plugin object, registration Struct and client context.

Importing it imports no torch (``kvxfer plugins`` loads it to probe it): the copy methods do.
"""

from __future__ import annotations

import os
import re
import threading
from typing import TYPE_CHECKING, Annotated, Any, Final

import msgspec

from kvxfer import ConfigError
from kvxfer.transport import (
    API_VERSION,
    Capabilities,
    ClientDrivenContext,
    HostRows,
    Probe,
    Registration,
    RowCopy,
    Transfer,
    Transport,
    copy_dtype,
    copy_view,
    host_copy_threads,
)

if TYPE_CHECKING:
    import torch

__all__ = ["CpuGatherTransport", "CpuGatherContext", "CpuGatherRegistration", "THREADS_ENV", "copy_threads",
           "set_thread_intra_op_threads"]

#: Threads per host copy, and intra-op threads of the worker thread's torch calls (see :func:`copy_threads`).
THREADS_ENV: Final = "KVXFER_CPU_GATHER_THREADS"
#: Most threads ``$KVXFER_CPU_GATHER_THREADS`` may ask for.
MAX_THREADS: Final = 1024


def copy_threads() -> int:
    """Threads per host copy (and the worker thread's intra-op threads): ``$KVXFER_CPU_GATHER_THREADS``;
    by default the core's :func:`~kvxfer.transport.host_copy_threads` (1 on small hosts, else
    torch's intra-op count)."""
    raw = os.environ.get(THREADS_ENV, "")
    if not raw:
        return host_copy_threads()
    n = int(raw) if re.fullmatch(r"[0-9]{1,9}", raw) else 0  # ASCII digits only: int() takes "1_6", "٤"
    if not 1 <= n <= MAX_THREADS:
        raise ConfigError(f"{THREADS_ENV} must be an integer in [1, {MAX_THREADS}] (threads per copy), got {raw!r}")
    return n


def set_thread_intra_op_threads(n: int) -> None:
    """Give the calling thread ``n`` intra-op threads (torch's setting is per thread), and leave
    the process's default, which threads take at their first use of torch, as it was.

    Calls ``torch._C.set_num_threads``, torch's own setter: vLLM's CPU worker replaces
    ``torch.set_num_threads`` with a no-op that logs a warning. A copy left on the default count
    forks an OpenMP team of its own beside the engine's, and with more OpenMP threads in the
    process than CPUs, libgomp stops spinning at its barriers: every parallel region of the
    engine's forward pass then puts its threads to sleep and wakes them, for as long as the
    process lives (measured with vLLM's CPU backend on 2 cores: decode steps 9.0 ms instead of
    6.5 ms after the first load). torch's setter also makes ``n`` the process's default; a
    short-lived thread sets that back.
    """
    import torch

    set_threads = torch._C.set_num_threads
    default = torch.get_num_threads()  # this thread's count, taken from the default at its first use of torch
    set_threads(n)
    if n != default:
        restore = threading.Thread(target=set_threads, args=(default,), name="kvxfer-threads-default")
        restore.start()
        restore.join()


class CpuGatherRegistration(Registration, frozen=True, kw_only=True):
    """Scalars only: the core's identity and layout fields, plus the tensors' device type."""

    #: torch device type of the KV tensors (informational: the server never touches them).
    device: Annotated[str, msgspec.Meta(max_length=16, pattern=r"^[a-z][a-z0-9_]*$")] = "cpu"


class CpuGatherContext(ClientDrivenContext):
    """Copies between the engine's KV tensors and arena slots in the engine's process.

    Host tensors: :class:`~kvxfer.transport.HostRows` (the core's C row copy: one call per chunk,
    no GIL, streaming stores) on the context's worker thread and up to ``copy_threads - 1``
    threads of its own (:func:`copy_threads`: ``$KVXFER_CPU_GATHER_THREADS``; by default one on
    small hosts, torch's intra-op count on larger ones; at least 4 MiB per thread). The worker's
    own torch calls (the copies' planning) run on ``copy_threads`` intra-op threads too (set by
    :func:`set_thread_intra_op_threads`, so the engine's threads keep theirs, under vLLM too).

    Tensors on another device: each layer's rows are gathered on the device (``index_select``),
    then copied to the slot by that device's copy; the reverse to retrieve.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.copy_threads = copy_threads()
        self._threads_set = threading.local()
        self.device = self.layers[0].device
        rows = [self.layout.row_view(t) for t in self.layers]
        #: Host tensors: their copies (None on another device).
        self._host = HostRows(rows, self.copy_threads) if self.device.type == "cpu" else None
        # Each layer as [rows, row_elems] of the widest element type that fits every layer's
        # rows (and so the slots'): a device's indexing kernels run fastest on wide elements.
        self._elem = copy_dtype(rows)
        self._rows = [copy_view(r, self._elem) for r in rows]

    def registration_extra(self) -> dict[str, Any]:
        return {"device": self.layers[0].device.type}

    def _use_copy_threads(self) -> None:
        """Set this thread's intra-op thread count for the copies (once per thread)."""
        if not getattr(self._threads_set, "done", False):
            set_thread_intra_op_threads(self.copy_threads)
            self._threads_set.done = True

    def gather(self, copies: list[RowCopy], transfer: Transfer) -> None:
        if self._host is not None:
            self._use_copy_threads()
            self._host.copy(copies, to_slot=True)
            return
        for c in copies:
            slot = copy_view(c.slot, self._elem)
            rows = c.rows.to(self.device, non_blocking=True)
            for layer, dst in zip(self._rows[c.first_layer:], slot):  # slot[i] is layer c.first_layer + i
                dst.copy_(layer.index_select(0, rows))  # gathered on the device, then one D2H copy
        _synchronize(self.device)

    def scatter(self, copies: list[RowCopy], transfer: Transfer) -> None:
        if self._host is not None:
            self._use_copy_threads()
            self._host.copy(copies, to_slot=False)
            return
        for c in copies:
            slot = copy_view(c.slot, self._elem)
            rows = c.rows.to(self.device, non_blocking=True)
            for layer, src in zip(self._rows[c.first_layer:], slot):
                layer.index_put_((rows,), src.to(self.device))
        _synchronize(self.device)


def _synchronize(device: torch.device) -> None:
    import torch

    sync = getattr(getattr(torch, device.type, None), "synchronize", None)
    if sync is not None:
        sync(device)


class CpuGatherTransport(Transport):
    """Entry point ``cpu_gather``: the fallback "auto" picks when nothing device-specific serves."""

    name = "cpu_gather"
    api_version = API_VERSION
    registration_type = CpuGatherRegistration
    context_type = CpuGatherContext
    capabilities = Capabilities(device_types=frozenset({"*"}), layer_ranges=True)
    auto_priority = 10
    production = True

    def probe(self) -> Probe:
        return Probe(True, "host shared memory; KV tensors on any torch device", ("*",))
