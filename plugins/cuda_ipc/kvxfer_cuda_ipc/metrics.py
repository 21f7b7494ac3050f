"""What cuda_ipc adds to the server's metrics (hook ``kvxfer_metrics``): copy counts, bytes and
time inside the server, staging and pinned memory. Importable without CUDA.

Samples (see docs/metrics.md):

* ``kvxfer_cuda_ipc_copies_total{op}``, ``kvxfer_cuda_ipc_copied_bytes_total{op}``,
  ``kvxfer_cuda_ipc_copy_seconds_total{op}``: requests copied by the server since it started
  (``op`` is ``store`` or ``retrieve``), their bytes, and the time from a request's start on
  the instance's worker to the end of its copies on the GPU;
* ``kvxfer_cuda_ipc_prefetched_chunks_total``, ``kvxfer_cuda_ipc_prefetch_hits_total``: chunks
  staged in device memory by a prefetch (at a lookup that asked for one, or ahead of a lone
  retrieve's copy plan), and the retrieved chunks that were found there (each one's DMA from the
  arena not run again);
* ``kvxfer_cuda_ipc_staging_bytes{device}``: device memory of the staging rings (``cuda:N``);
* ``kvxfer_cuda_ipc_contexts{device}``: registrations open per device;
* ``kvxfer_cuda_ipc_arena_pinned_bytes``: arena bytes registered as pinned host memory.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from kvxfer.transport import MetricSample

__all__ = ["CopyTotals", "metric_samples"]

OPS = ("store", "retrieve")


class CopyTotals:
    """Copies of every context since the server started (contexts come and go, these only
    grow). Any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = {op: [0, 0, 0.0] for op in OPS}
        self._prefetch = [0, 0]

    def add(self, op: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            t = self._totals[op]
            t[0] += 1
            t[1] += nbytes
            t[2] += seconds

    def add_prefetch(self, staged: int, hits: int) -> None:
        """Count ``staged`` chunks staged by a prefetch and ``hits`` retrieved from staging."""
        with self._lock:
            self._prefetch[0] += staged
            self._prefetch[1] += hits

    def read_prefetch(self) -> tuple[int, int]:
        """``(chunks prefetched, retrieved chunks found prefetched)``."""
        with self._lock:
            return self._prefetch[0], self._prefetch[1]

    def read(self) -> dict[str, tuple[int, int, float]]:
        """``op -> (copies, bytes, seconds)``."""
        with self._lock:
            return {op: (int(t[0]), int(t[1]), float(t[2])) for op, t in self._totals.items()}


def metric_samples(totals: Mapping[str, tuple[int, int, float]], staging: Mapping[str, int],
                   contexts: Mapping[str, int], pinned_bytes: int,
                   prefetch: tuple[int, int] = (0, 0)) -> list[MetricSample]:
    """The samples of one scrape: ``totals`` from :meth:`CopyTotals.read`, ``staging`` and
    ``contexts`` by device name (``cuda:N``), ``prefetch`` from :meth:`CopyTotals.read_prefetch`."""
    out = []
    for op, (n, nbytes, seconds) in totals.items():
        labels = {"op": op}
        out += [
            MetricSample("kvxfer_cuda_ipc_copies_total", "counter", n, labels,
                         "Requests whose copies the cuda_ipc server side ran."),
            MetricSample("kvxfer_cuda_ipc_copied_bytes_total", "counter", nbytes, labels,
                         "Bytes the cuda_ipc server side copied between GPU blocks and the arena."),
            MetricSample("kvxfer_cuda_ipc_copy_seconds_total", "counter", seconds, labels,
                         "Time from a request's start on its worker to the end of its GPU copies."),
        ]
    out += [
        MetricSample("kvxfer_cuda_ipc_prefetched_chunks_total", "counter", prefetch[0], {},
                     "Chunks staged in device memory by a prefetch (a lookup's, or ahead of a lone retrieve's plan)."),
        MetricSample("kvxfer_cuda_ipc_prefetch_hits_total", "counter", prefetch[1], {},
                     "Retrieved chunks found staged by a prefetch (no DMA from the arena)."),
    ]
    for device, nbytes in sorted(staging.items()):
        out.append(MetricSample("kvxfer_cuda_ipc_staging_bytes", "gauge", nbytes, {"device": device},
                                "Device memory of cuda_ipc's staging rings."))
    for device, n in sorted(contexts.items()):
        out.append(MetricSample("kvxfer_cuda_ipc_contexts", "gauge", n, {"device": device},
                                "Registrations open through cuda_ipc, per GPU."))
    out.append(MetricSample("kvxfer_cuda_ipc_arena_pinned_bytes", "gauge", pinned_bytes, {},
                            "Arena bytes registered as pinned host memory for the GPUs' DMA."))
    return out
