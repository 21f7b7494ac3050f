"""The connector's figures in vLLM's own metrics: its connector stats API and Prometheus hooks.

vLLM asks each side of the connector for its stats once per step
(``KVConnectorBase_V1.get_kv_connector_stats``: the workers' travel with the model runner's
output to the engine core, where the scheduler side's are added with ``aggregate``), sends them
to its front end as a plain dict (``SchedulerStats.kv_connector_stats``), and there rebuilds them
with the connector class's ``build_kv_connector_stats`` for its periodic log line
(``KV Transfer metrics: ...``, from :meth:`KvxferConnectorStats.reduce`) and hands the dict to
the metrics that ``build_prom_metrics`` made (:class:`KvxferPromMetrics`: ``vllm:kvxfer_*``
counters in vLLM's ``/metrics``). So every report is an increment since the previous one
(:class:`StatsDelta`), and the payload is a flat ``{name: int}`` that any of vLLM's
serializers carries.

Checked against the installed vLLM 0.32 (``vllm/distributed/kv_transfer/kv_connector/v1/
metrics.py``, ``vllm/v1/metrics/loggers.py``, ``vllm/v1/core/sched/scheduler.py``). Without vLLM (or
with a vLLM older than this API), stand-ins with the same names let the module import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from kvxfer.integrations.vllm._compat import HAVE_VLLM

__all__ = ["FIELDS", "SCHEDULER_FIELDS", "WORKER_FIELDS", "KvxferConnectorStats", "KvxferPromMetrics", "StatsDelta"]

try:  # vLLM's connector metrics API (absent from vLLM without vLLM, or older than its stats API)
    if not HAVE_VLLM:
        raise ImportError("vLLM is not installed")
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
except ImportError:

    @dataclass
    class KVConnectorStats:  # type: ignore[no-redef]
        """Stand-in for vLLM's ``KVConnectorStats`` (a ``data`` dict)."""

        data: dict[str, Any] = field(default_factory=dict)

        def to_dict(self) -> dict[str, Any]:
            return self.data

    class KVConnectorPromMetrics:  # type: ignore[no-redef]
        """Stand-in for vLLM's ``KVConnectorPromMetrics`` (what its constructor keeps)."""

        def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                     per_engine_labelvalues: dict[int, list[object]]) -> None:
            self._kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
            types = {t.__name__: v for t, v in metric_types.items()}
            self._gauge_cls, self._counter_cls = types.get("Gauge"), types.get("Counter")
            self._histogram_cls = types.get("Histogram")
            self._labelnames = labelnames
            self.per_engine_labelvalues = per_engine_labelvalues


#: Every figure: name (``vllm:kvxfer_<name>_total`` in vLLM's /metrics) -> what it counts.
FIELDS: Final[dict[str, str]] = {
    "lookups": "Lookups kvxfer's scheduler side asked the cache server.",
    "unanswered_lookups": "Lookups of prompts with a whole chunk to ask about that the cache server did not "
                          "answer (unreachable or failing, with kvxfer.on_server_error=recompute) or refused (a "
                          "limit reached): vLLM computed them without the cache.",
    "lookup_tokens": "Prompt tokens (full chunks beyond vLLM's own prefix-cache hit) the lookups asked about.",
    "hit_tokens": "Tokens the cache server had and kvxfer offered vLLM to load instead of computing.",
    "loads_not_retried": "Requests vLLM asked about again after their load failed: kvxfer offered nothing (one "
                         "load per request until vLLM preempts it), and vLLM computed the prefix.",
    "loads": "Loads kvxfer's workers submitted (one per request and rank).",
    "loaded_chunks": "Chunks loaded from the cache server (summed over ranks).",
    "loaded_bytes": "Bytes loaded from the cache server into vLLM's KV cache.",
    "load_failures": "Loads that left blocks for vLLM to recompute (missing chunks, failed transfers, no server).",
    "failed_load_blocks": "Blocks vLLM had to recompute because a load did not fill them.",
    "expired_loads": "Loads abandoned at their deadline (kvxfer.load_timeout_ms) before their copy started.",
    "stores": "Stores kvxfer's workers submitted.",
    "stored_chunks": "Chunks stored into the cache server (summed over ranks).",
    "stored_bytes": "Bytes stored into the cache server.",
    "failed_store_chunks": "Chunks a store could not store (no room, a limit of the server's reached, or the copy "
                           "failed).",
    "dropped_stores": "Stores not sent (no server, or the server failed), or cancelled before their copy because "
                      "vLLM was about to reuse their blocks.",
}
#: What the scheduler side reports: its stats key -> field.
SCHEDULER_FIELDS: Final[dict[str, str]] = {"lookups": "lookups", "unanswered_lookups": "unanswered_lookups",
                                           "lookup_tokens": "lookup_tokens", "lookup_hit_tokens": "hit_tokens",
                                           "loads_not_offered_again": "loads_not_retried"}
#: What a worker reports: its stats key -> field.
WORKER_FIELDS: Final[dict[str, str]] = {k: k for k in (
    "loads", "loaded_chunks", "loaded_bytes", "load_failures", "failed_load_blocks", "expired_loads", "stores",
    "stored_chunks", "stored_bytes", "failed_store_chunks", "dropped_stores")}


def _clean(data: Mapping[str, Any] | None) -> dict[str, int]:
    """Every field, from ``data`` where it holds a non-negative integer, else 0 (the payload
    comes from another process: unknown keys and odd values are ignored)."""
    out = dict.fromkeys(FIELDS, 0)
    for key, value in (data or {}).items():
        if key in out and isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
            out[key] = int(value)
    return out


@dataclass
class KvxferConnectorStats(KVConnectorStats):
    """kvxfer's figures of one interval, as vLLM carries them (``data``: field -> count)."""

    def __post_init__(self) -> None:
        self.data = _clean(self.data)

    def reset(self) -> None:
        self.data = dict.fromkeys(FIELDS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add ``other`` (another worker's, or the scheduler side's) into this one."""
        for key, value in _clean(getattr(other, "data", None)).items():
            self.data[key] += value
        return self

    def reduce(self) -> dict[str, int | float]:
        """The figures of vLLM's log line for the interval."""
        d = self.data
        return {
            "Lookups": d["lookups"],
            "Unanswered lookups": d["unanswered_lookups"],
            "Hit tokens": d["hit_tokens"],
            "Hit rate (%)": round(100 * d["hit_tokens"] / d["lookup_tokens"], 1) if d["lookup_tokens"] else 0.0,
            "Loaded chunks": d["loaded_chunks"],
            "Loaded MiB": round(d["loaded_bytes"] / 2**20, 1),
            "Load failures": d["load_failures"],
            "Expired loads": d["expired_loads"],
            "Stored chunks": d["stored_chunks"],
            "Stored MiB": round(d["stored_bytes"] / 2**20, 1),
            "Failed store chunks": d["failed_store_chunks"],
            "Dropped stores": d["dropped_stores"],
        }

    def is_empty(self) -> bool:
        return not any(self.data.values())


class StatsDelta:
    """Turns a side's running counts (``WorkerConnector.stats`` / ``SchedulerConnector.stats``)
    into the increment since the previous call, which is what vLLM wants per step."""

    def __init__(self, source: Mapping[str, str]) -> None:
        self._source = dict(source)
        self._last: dict[str, int] = {}

    def take(self, counts: Mapping[str, int]) -> KvxferConnectorStats | None:
        """The increment since the last call, or None if nothing was counted."""
        now = {key: int(counts.get(key, 0)) for key in self._source}
        data = {name: now[key] - self._last.get(key, 0) for key, name in self._source.items()}
        self._last = now
        stats = KvxferConnectorStats(data=data)
        return None if stats.is_empty() else stats


class KvxferPromMetrics(KVConnectorPromMetrics):
    """One ``vllm:kvxfer_<field>`` counter per field, labelled like vLLM's own metrics
    (``labelnames``: model name and engine index), made through vLLM's metric classes so they
    follow its registry (and multiprocess mode, when its API server uses one)."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        for name, doc in FIELDS.items():
            counter = self._counter_cls(name=f"vllm:kvxfer_{name}", documentation=doc, labelnames=labelnames)
            self.counters[name] = {idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in _clean(transfer_stats_data).items():
            if value:
                self.counters[name][engine_idx].inc(value)
