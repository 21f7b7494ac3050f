"""ServerStats: the server's running figures (counts, bytes, durations), owned by the loop thread.

The engine calls the ``on_*`` methods from its loop thread as requests are handled; they only add
to plain numbers and append to short windows (no locks, no allocation on the lookup path), so
they cost about a microsecond per request. Everything that reads the figures (``status``, the
Prometheus exporter, ``kvxfer top`` through ``status``) reads them on the loop thread too.

Label values are bounded: a model gets its own label when it registers, up to ``max_models``
distinct names; later models, and lookups of models that never registered, are counted under
:data:`OTHER_MODEL`. Transports are the ones the server loaded; request names come from the
request table; error codes from :mod:`kvxfer.errors`.
"""

from __future__ import annotations

import hashlib
import math
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field
from typing import Final

__all__ = [
    "OTHER_MODEL",
    "MAX_MODEL_LABEL",
    "model_label",
    "REQUEST_BUCKETS",
    "TRANSFER_BUCKETS",
    "RECENT",
    "Histogram",
    "ModelStats",
    "TrafficStats",
    "ServerStats",
]

#: The model label of every model beyond the first ``max_models``.
OTHER_MODEL: Final = "__other__"
#: Longest model label; a longer name is cut in the middle (see :func:`model_label`).
MAX_MODEL_LABEL: Final = 128
#: Bucket bounds (seconds) of server-side request durations: a lookup takes ~50 us inside the
#: server, a register of a large cache through CUDA IPC several seconds.
REQUEST_BUCKETS: Final = (0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                          0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: Bucket bounds (seconds) of store/retrieve durations (reservation to commit): 8 chunks of
#: 32 MiB take ~20 ms at memcpy speed.
TRANSFER_BUCKETS: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                           2.5, 5.0, 10.0, 30.0)
#: Durations kept per histogram for the percentiles of ``status`` (the most recent ones).
RECENT: Final = 1024


class Histogram:
    """Counts of observations per bucket (``le`` bounds, the last one +Inf), their sum, and the
    most recent :data:`RECENT` values for percentiles."""

    __slots__ = ("bounds", "counts", "sum", "recent")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.recent: deque[float] = deque(maxlen=RECENT)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.recent.append(value)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def percentiles(self, *qs: float) -> list[float]:
        """Nearest-rank percentiles (``qs`` in [0, 100]) of the recent window; 0.0 when empty."""
        values = sorted(self.recent)
        if not values:
            return [0.0 for _ in qs]
        last = len(values) - 1
        return [values[min(last, max(0, math.ceil(q / 100 * len(values)) - 1))] for q in qs]


@dataclass(slots=True, eq=False)
class ModelStats:
    """Lookups and evictions of one model label."""

    lookups: int = 0
    lookup_chunks: int = 0
    lookup_hits: int = 0
    #: Of ``lookup_hits``, those found in L2 (or being promoted from it).
    lookup_l2_hits: int = 0
    evicted_chunks: int = 0


@dataclass(slots=True, eq=False)
class TrafficStats:
    """Stores and retrieves of one (model label, transport)."""

    transport: str = ""
    stores: int = 0
    stored_chunks: int = 0
    stored_bytes: int = 0
    #: Chunks a store skipped because they were stored already (or being stored).
    present_chunks: int = 0
    #: Chunks a store found no room for (everything else leased or in use).
    no_space_chunks: int = 0
    #: Chunks whose copy failed (dropped, never readable).
    failed_chunks: int = 0
    #: Chunks a store did not copy because its client gave up on it (cancelled, or past its deadline).
    abandoned_chunks: int = 0
    store_copy_s: float = 0.0
    retrieves: int = 0
    loaded_chunks: int = 0
    loaded_bytes: int = 0
    #: Chunks a retrieve asked for and did not load (never stored or evicted, or the copy failed,
    #: was cancelled or expired).
    missing_chunks: int = 0
    retrieve_copy_s: float = 0.0
    store: Histogram = field(default_factory=lambda: Histogram(TRANSFER_BUCKETS))
    retrieve: Histogram = field(default_factory=lambda: Histogram(TRANSFER_BUCKETS))


def model_label(model_name: str) -> str:
    """``model_name`` as a label of at most :data:`MAX_MODEL_LABEL` characters. A longer name
    keeps its start and its end (the vLLM connector's names end in ``@dtype#fingerprint``, which
    tell an engine's variants apart) around 16 hex digits of its SHA-256, so that names that
    differ anywhere keep labels of their own (cut at the end, two engines of one model path in
    different layouts shared one label, and their figures were summed). A name that could be
    taken for such a label (one with ``…``) or for :data:`OTHER_MODEL` gets a digest too, so that
    no client's name is another's label (16 digits: no name is made to share one)."""
    if len(model_name) <= MAX_MODEL_LABEL and "…" not in model_name and model_name != OTHER_MODEL:
        return model_name
    digest = hashlib.sha256(model_name.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    tail = MAX_MODEL_LABEL - 64 - len(digest) - 2
    return f"{model_name[:64]}…{digest}…{model_name[-tail:]}"


class ServerStats:
    """Running figures of one server. Loop thread only."""

    def __init__(self, request_names: tuple[str, ...], max_models: int = 32) -> None:
        if max_models < 0:
            raise ValueError(f"max_models must be >= 0, got {max_models}")
        self.max_models = max_models
        #: model name -> its label (:func:`model_label`), for the first
        #: ``max_models`` names only: every other name is OTHER_MODEL and is not remembered (a
        #: client registering ever new names must not grow the server)
        self._labels: dict[str, str] = {}
        self.models: dict[str, ModelStats] = {}
        self.traffic: dict[tuple[str, str], TrafficStats] = {}
        #: (transport, "store" or "retrieve") -> the durations of every model's transfers through
        #: it, the recent window in the order they ended (the status's percentiles per transport)
        self.transfers: dict[tuple[str, str], Histogram] = {}
        #: "unknown" holds requests whose name the server does not know.
        self.requests: dict[str, Histogram] = {n: Histogram(REQUEST_BUCKETS) for n in (*request_names, "unknown")}
        #: (request name, error code) -> replies with that error
        self.errors: dict[tuple[str, str], int] = {}
        #: Requests received whose reply is not sent yet (transfers on a worker thread).
        self.in_flight = 0

    # ------------------------------------------------------------------ labels

    def model_label(self, model_name: str) -> str:
        """The label of a model that registered, else :data:`OTHER_MODEL`."""
        return self._labels.get(model_name, OTHER_MODEL)

    def register_model(self, model_name: str) -> str:
        """Give ``model_name`` its own label if there is room (idempotent; its figures are
        reported from now on, zeros included); returns its label."""
        label = self._labels.get(model_name)
        if label is None:
            if len(self._labels) >= self.max_models:
                label = OTHER_MODEL
            else:
                label = self._labels[model_name] = model_label(model_name)
            self._model(label)
        return label

    @property
    def named_models(self) -> int:
        """Model names that have a label of their own (at most ``max_models``)."""
        return len(self._labels)

    def _model(self, label: str) -> ModelStats:
        st = self.models.get(label)
        if st is None:
            st = self.models[label] = ModelStats()
        return st

    def traffic_of(self, model_name: str, transport: str) -> TrafficStats:
        key = (self.model_label(model_name), transport)
        st = self.traffic.get(key)
        if st is None:
            st = self.traffic[key] = TrafficStats(transport)
        return st

    def _transfer(self, traffic: TrafficStats, op: str, seconds: float) -> None:
        h = self.transfers.get((traffic.transport, op))
        if h is None:
            h = self.transfers[(traffic.transport, op)] = Histogram(TRANSFER_BUCKETS)
        h.observe(seconds)

    # ------------------------------------------------------------------ events (loop thread)

    def on_request(self, name: str, seconds: float) -> None:
        """A request was answered ``seconds`` after it arrived."""
        h = self.requests.get(name)
        (h if h is not None else self.requests["unknown"]).observe(seconds)

    def on_error(self, name: str, code: str) -> None:
        key = (name if name in self.requests else "unknown", code)
        self.errors[key] = self.errors.get(key, 0) + 1

    def on_lookup(self, model_name: str, chunks: int, hits: int, l2_hits: int = 0) -> None:
        st = self._model(self._labels.get(model_name, OTHER_MODEL))
        st.lookups += 1
        st.lookup_chunks += chunks
        st.lookup_hits += hits
        st.lookup_l2_hits += l2_hits

    def on_evicted(self, model_names: list[str]) -> None:
        for name in model_names:
            self._model(self.model_label(name)).evicted_chunks += 1

    def on_reserve_write(self, traffic: TrafficStats, present: int, no_space: int) -> None:
        traffic.present_chunks += present
        traffic.no_space_chunks += no_space

    def on_store(self, traffic: TrafficStats, stored: int, failed: int, chunk_bytes: int,
                 seconds: float | None, copy_s: float, abandoned: bool = False) -> None:
        """A store committed: ``failed`` chunks not stored, abandoned by the client if ``abandoned``.
        ``seconds`` None: no store ran (one that came past its deadline, the open writes of a
        session that ended): its chunks are counted, no store and no duration."""
        traffic.stored_chunks += stored
        traffic.stored_bytes += stored * chunk_bytes
        if abandoned:
            traffic.abandoned_chunks += failed
        else:
            traffic.failed_chunks += failed
        if seconds is None:
            return
        traffic.stores += 1
        traffic.store_copy_s += copy_s
        traffic.store.observe(seconds)
        self._transfer(traffic, "store", seconds)

    def on_retrieve(self, traffic: TrafficStats, loaded: int, missing: int, chunk_bytes: int,
                    seconds: float, copy_s: float) -> None:
        traffic.retrieves += 1
        traffic.loaded_chunks += loaded
        traffic.loaded_bytes += loaded * chunk_bytes
        traffic.missing_chunks += missing
        traffic.retrieve_copy_s += copy_s
        traffic.retrieve.observe(seconds)
        self._transfer(traffic, "retrieve", seconds)

    # ------------------------------------------------------------------ reading

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def errors_by_code(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for (_, code), n in self.errors.items():
            out[code] = out.get(code, 0) + n
        return out

    def totals(self) -> ModelStats:
        """Lookups and evictions summed over every model label."""
        total = ModelStats()
        for st in self.models.values():
            total.lookups += st.lookups
            total.lookup_chunks += st.lookup_chunks
            total.lookup_hits += st.lookup_hits
            total.lookup_l2_hits += st.lookup_l2_hits
            total.evicted_chunks += st.evicted_chunks
        return total
