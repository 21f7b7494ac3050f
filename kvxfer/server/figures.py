"""The figures of ``status`` beyond the basics: per model, per (model, transport), latency
percentiles, and what plugins contribute through the ``kvxfer_metrics`` hook.

Every function here reads server state and runs on the server's loop thread (``status`` runs
there; the Prometheus exporter hops there to read). The Prometheus exporter
(:mod:`kvxfer.server.metrics`) builds its samples from the same :class:`~kvxfer.protocol.messages.StatusReply`,
so ``kvxfer status``, ``kvxfer top`` and ``/metrics`` show the same numbers.
"""

from __future__ import annotations

import logging
import math
import re
from typing import TYPE_CHECKING, Final

from kvxfer.protocol import messages as m
from kvxfer.server.stats import OTHER_MODEL, Histogram, ServerStats

if TYPE_CHECKING:
    from kvxfer.server.engine import CacheServer

__all__ = ["model_status", "traffic_status", "latency_status", "plugin_metrics", "check_sample", "metric_prefix",
           "plugin_strings", "CORE_FAMILIES", "MAX_PLUGIN_SAMPLES", "MAX_PLUGIN_STRINGS", "MAX_PLUGIN_TEXT"]

log = logging.getLogger(__name__)

#: Most samples one plugin's ``kvxfer_metrics`` may return (more are dropped).
MAX_PLUGIN_SAMPLES: Final = 512
#: Most entries of one plugin's ``status()`` map or status section (more are dropped), and the
#: most characters of each key and value (longer ones are cut).
MAX_PLUGIN_STRINGS: Final = m.MAX_STATUS_ENTRIES
MAX_PLUGIN_TEXT: Final = m.MAX_STATUS_TEXT
_MAX_LABELS: Final = 8
_MAX_LABEL_VALUE: Final = 128
#: Every metric family the core exports (names as exposed, without ``_bucket``/``_sum``/
#: ``_count`` suffixes). Plugin samples may not reuse these names.
CORE_FAMILIES: Final = frozenset({
    "kvxfer_build_info", "kvxfer_start_time_seconds", "kvxfer_sessions", "kvxfer_contexts",
    "kvxfer_requests_in_flight", "kvxfer_request_duration_seconds", "kvxfer_errors_total",
    "kvxfer_hook_errors_total", "kvxfer_lookups_total", "kvxfer_lookup_chunks_total",
    "kvxfer_lookup_hit_chunks_total", "kvxfer_lookup_l2_hit_chunks_total", "kvxfer_lookup_miss_chunks_total",
    "kvxfer_lookup_hit_ratio",
    "kvxfer_stored_chunks_total", "kvxfer_stored_bytes_total", "kvxfer_store_present_chunks_total",
    "kvxfer_store_failed_chunks_total", "kvxfer_loaded_chunks_total", "kvxfer_loaded_bytes_total",
    "kvxfer_retrieve_missing_chunks_total", "kvxfer_copy_seconds_total", "kvxfer_transfer_duration_seconds",
    "kvxfer_transfers_in_flight", "kvxfer_arena_capacity_bytes", "kvxfer_arena_used_bytes",
    "kvxfer_arena_free_bytes", "kvxfer_arena_largest_free_bytes", "kvxfer_arena_free_extents",
    "kvxfer_arena_chunks", "kvxfer_evicted_chunks_total", "kvxfer_leases", "kvxfer_leased_chunks",
    "kvxfer_reservations", *(f"kvxfer_tier_{name}" for name in (
        "up", "lookups_total", "lookup_chunks_total", "lookup_hit_chunks_total", "lookup_timeouts_total",
        "promoted_chunks_total", "promote_failures_total", "promoting_chunks", "integrity_failures_total",
        "damaged_deleted_total", "written_chunks_total", "written_bytes_total", "write_skipped_chunks_total",
        "dropped_writes_total", "queue_depth", "queue_capacity", "pinned_bytes", "pinned_bytes_limit", "errors_total",
        "outages_total", "busy_lookups_total", "writers", "writers_held")),
})
#: The names a scrape shows for the core's families: each family's (a counter's also without
#: ``_total``, as its ``# TYPE`` line names it) and a histogram's series. A plugin's sample may
#: take none of them, nor a name whose counter family is one (the exposition would name two
#: families alike, and a scraper may refuse it whole).
_CORE_SERIES: Final = frozenset({
    *CORE_FAMILIES, *(n.removesuffix("_total") for n in CORE_FAMILIES),
    *(f"{n}_{part}" for n in CORE_FAMILIES if n.endswith("_duration_seconds")
      for part in ("bucket", "sum", "count", "created")),
})
_NAME: Final = re.compile(r"kvxfer_[a-z0-9_]*[a-z0-9]")
_LABEL: Final = re.compile(r"[a-zA-Z][a-zA-Z0-9_]*")
_KINDS: Final = ("counter", "gauge")


def model_status(server: CacheServer) -> list[m.ModelStatus]:
    stats = server.stats
    contexts: dict[str, int] = {}
    for ctx in server.contexts.values():
        label = stats.model_label(ctx.model_name)
        contexts[label] = contexts.get(label, 0) + 1
    out = []
    for label in sorted(set(stats.models) | set(contexts), key=_model_order):
        st = stats.models.get(label)
        out.append(m.ModelStatus(label, st.lookups, st.lookup_chunks, st.lookup_hits, st.evicted_chunks,
                                 contexts.get(label, 0), st.lookup_l2_hits) if st is not None
                   else m.ModelStatus(label, contexts=contexts.get(label, 0)))
    return out


def traffic_status(server: CacheServer) -> list[m.TrafficStatus]:
    stats = server.stats
    open_: dict[tuple[str, str], list[int]] = {}
    for res in server.index.reservations.values():
        ctx = server.contexts.get(res.instance_id)
        if ctx is not None:
            counts = open_.setdefault((stats.model_label(ctx.model_name), ctx.transport), [0, 0])
            counts[0 if res.write else 1] += 1
    out = []
    for key in sorted(set(stats.traffic) | set(open_), key=lambda k: (_model_order(k[0]), k[1])):
        t = stats.traffic.get(key)
        stores, retrieves = open_.get(key, (0, 0))
        if t is None:
            out.append(m.TrafficStatus(key[0], key[1], stores_in_flight=stores, retrieves_in_flight=retrieves))
            continue
        out.append(m.TrafficStatus(
            key[0], key[1], t.stores, t.stored_chunks, t.stored_bytes, t.present_chunks, t.no_space_chunks,
            t.failed_chunks, t.store_copy_s, t.retrieves, t.loaded_chunks, t.loaded_bytes, t.missing_chunks,
            t.retrieve_copy_s, stores, retrieves, t.abandoned_chunks))
    return out


def _latency(name: str, transport: str, h: Histogram) -> m.LatencyStatus:
    p50, p90, p99, top = h.percentiles(50, 90, 99, 100)
    return m.LatencyStatus(name, transport, h.count, len(h.recent), p50, p90, p99, top)


def latency_status(stats: ServerStats) -> list[m.LatencyStatus]:
    """Requests that were seen at least once, then whole stores and retrieves per transport."""
    out = [_latency(name, "", h) for name, h in stats.requests.items() if h.recent]
    for transport in sorted({t for t, _ in stats.transfers}):
        for op in ("store", "retrieve"):
            h = stats.transfers.get((transport, op))
            if h is not None and h.recent:
                out.append(_latency(op, transport, h))
    return out


def _model_order(label: str) -> tuple[bool, str]:
    return (label == OTHER_MODEL, label)


# --------------------------------------------------------------------------- plugin figures


def check_sample(sample: object) -> str:
    """Why ``sample`` cannot be exported, or "" when it can."""
    if not isinstance(sample, m.MetricSample):
        return f"not a kvxfer.transport.MetricSample: {type(sample).__name__}"
    if not _NAME.fullmatch(sample.name):
        return f"name {sample.name[:80]!r} is not kvxfer_[a-z0-9_]+"
    if sample.kind not in _KINDS:
        return f"{sample.name}: kind {sample.kind!r} is not one of {_KINDS}"
    if (sample.kind == "counter") != sample.name.endswith("_total"):
        return f"{sample.name}: a counter's name, and only a counter's, ends with _total"
    if not isinstance(sample.value, (int, float)) or not math.isfinite(sample.value):
        return f"{sample.name}: value {sample.value!r} is not a finite number"
    if len(sample.labels) > _MAX_LABELS:
        return f"{sample.name}: {len(sample.labels)} labels, at most {_MAX_LABELS}"
    for k, v in sample.labels.items():
        if not isinstance(k, str) or not _LABEL.fullmatch(k):
            return f"{sample.name}: label name {k!r} is not [a-zA-Z][a-zA-Z0-9_]*"
        if not isinstance(v, str) or len(v) > _MAX_LABEL_VALUE:
            return f"{sample.name}: label {k} must be a string of at most {_MAX_LABEL_VALUE} characters"
    return ""


def metric_prefix(plugin: str) -> str:
    """What the names of plugin ``plugin``'s samples start with: ``kvxfer_<name>_``, where the
    name is a transport's (its server half is the hook plugin ``kvxfer.transport.<name>``) or a
    hook plugin's entry point name, in lower case, anything but letters and digits read as ``_``."""
    name = plugin.removeprefix("kvxfer.transport.")
    return f"kvxfer_{re.sub(r'[^a-z0-9]', '_', name.lower())}_"


def plugin_metrics(server: CacheServer) -> list[m.MetricSample]:
    """What the ``kvxfer_metrics`` hook implementations return, checked: a sample that cannot be
    exported, is not named after its plugin (:func:`metric_prefix`) or is named after another one
    too (the longer prefix wins), has a name the core uses, or
    is a second sample of a name with another kind or label names, is dropped and counted as a
    hook error (logged once per name)."""
    out: list[m.MetricSample] = []
    shapes: dict[str, tuple[str, tuple[str, ...]]] = {}
    # longest first: a name under two plugins' prefixes (kvxfer_cuda_ipc_... under a plugin named
    # cuda's too) belongs to the plugin of the longer one
    prefixes = sorted({metric_prefix(p) for p in server.hooks.implementers("kvxfer_metrics")}, key=len, reverse=True)
    for plugin, result in server.hooks.call_by_plugin("kvxfer_metrics", server=server):
        prefix = metric_prefix(plugin)
        try:
            samples = list(result)
        except TypeError:
            samples = [result]
        if len(samples) > MAX_PLUGIN_SAMPLES:
            _reject(server, "kvxfer_metrics", f"a kvxfer_metrics hook returned {len(samples)} samples, at most "
                                              f"{MAX_PLUGIN_SAMPLES}; the rest are dropped")
            samples = samples[:MAX_PLUGIN_SAMPLES]
        for sample in samples:
            why = check_sample(sample)
            if not why and not sample.name.startswith(prefix):
                why = f"{sample.name}: a sample of plugin {plugin} is named {prefix}..."
            if not why:
                owner = next(p for p in prefixes if sample.name.startswith(p))
                if owner != prefix:
                    why = f"{sample.name}: a name of the plugin whose samples are named {owner}..."
            if not why and {sample.name, sample.name.removesuffix("_total")} & _CORE_SERIES:
                why = f"{sample.name}: the name of a core metric or of one of its series"
            if not why:
                shape = (sample.kind, tuple(sorted(sample.labels)))
                known = shapes.setdefault(sample.name, shape)
                if known != shape:
                    why = f"{sample.name}: kind/labels {shape} differ from an earlier sample's {known}"
            if why:
                _reject(server, getattr(sample, "name", "?"),
                        f"a kvxfer_metrics hook returned a sample that cannot be exported ({why}); dropping it")
                continue
            out.append(sample)
    return out


_warned: set[str] = set()


def plugin_strings(server: CacheServer, source: str, values: object) -> dict[str, str]:
    """A plugin's map of strings for ``status`` (a transport's ``status()``, a status section),
    bounded: at most :data:`MAX_PLUGIN_STRINGS` entries of at most :data:`MAX_PLUGIN_TEXT`
    characters each, whatever a plugin that counts something a client names returns. Past the
    bound the rest is dropped and counted as a hook error (logged once per source). Raises
    ``AttributeError`` for something that is not a mapping."""
    items = values.items()  # type: ignore[attr-defined]
    out: dict[str, str] = {}
    for k, v in items:
        if len(out) == MAX_PLUGIN_STRINGS:
            _reject(server, source, f"{source} returned more than {MAX_PLUGIN_STRINGS} entries for status; "
                                    "the rest are dropped")
            break
        out[str(k)[:MAX_PLUGIN_TEXT]] = str(v)[:MAX_PLUGIN_TEXT]
    return out


def _reject(server: CacheServer, key: str, message: str) -> None:
    """Count a hook error; log ``message`` once per ``key``."""
    server.hooks.errors += 1
    if key not in _warned and len(_warned) < 1000:
        _warned.add(key)
        log.warning("%s", message)
