"""Prometheus metrics of a cache server: ``kvxfer serve --metrics-port N`` serves ``/metrics``.

:class:`MetricsExporter` runs prometheus-client's HTTP server on a thread of its own, over a
private :class:`~prometheus_client.CollectorRegistry` that holds two collectors:

* :class:`ServerCollector`: at each scrape it asks the server's loop thread for one snapshot (the
  :class:`~kvxfer.protocol.messages.StatusReply` that ``kvxfer status`` shows, plus copies of
  the duration histograms and error counts) and turns it into metric families. Nothing is
  updated for Prometheus on the request path: the loop keeps plain numbers
  (:class:`kvxfer.server.stats.ServerStats`) and the scrape reads them, so all figures of one
  scrape come from the same instant. A scrape fails (HTTP 500) if the loop does not answer
  within :data:`SCRAPE_TIMEOUT_S`: a stuck server shows as a failed scrape, not as old numbers.
* prometheus-client's ``ProcessCollector`` (``process_*``: CPU, memory, open files).

The server is one process with a private registry: ``PROMETHEUS_MULTIPROC_DIR`` plays no part
and nothing is written to disk. Every family is documented in ``docs/metrics.md``.

The HTTP endpoint listens on TCP, where any local user (or anyone who can reach
``--metrics-host``) may connect, so what a connection can hold is bounded
(:class:`_BoundedHttpServer`): at most :data:`MAX_SCRAPERS` connections are served at once (a
newcomer takes the place of the oldest one that has not sent its request whole, or else of one
answered for more than :data:`SCRAPE_STALLED_S`; with none such, it is closed), and each is
closed :data:`SCRAPE_CONNECTION_S` after it was accepted, whatever it is doing (sending its
request slowly, or not reading the reply), and sends at most :data:`MAX_REQUEST_HEAD` bytes of
request head (answered 431 past them, before anything is parsed).
Connections are taken at most :data:`MAX_SCRAPES_PER_S` a second (the accept loop waits for the
next free moment; each connection carries one request, HTTP/1.0), so that scrapes in a loop, or
connections opened and dropped, or garbage sent, cannot take the loop's snapshots and the
interpreter from the server's requests; and the accept loop, when the process is out of file
descriptors, waits :data:`ACCEPT_RETRY_S` before it tries again instead of spinning on a
connection it cannot take.
"""

from __future__ import annotations

import errno
import http.client
import logging
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any, Final
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, ProcessCollector, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvxfer.errors import ConfigError
from kvxfer.protocol import messages as m
from kvxfer.server.figures import CORE_FAMILIES
from kvxfer.server.stats import Histogram

if TYPE_CHECKING:
    from kvxfer.server.engine import CacheServer

__all__ = ["MetricsExporter", "ServerCollector", "Snapshot", "SCRAPE_TIMEOUT_S", "CORE_FAMILIES", "MAX_SCRAPERS",
           "SCRAPE_CONNECTION_S", "SCRAPE_STALLED_S", "MAX_SCRAPES_PER_S", "ACCEPT_RETRY_S", "MAX_REQUEST_HEAD"]

log = logging.getLogger(__name__)

#: How long a scrape waits for the server's loop thread.
SCRAPE_TIMEOUT_S: Final = 5.0
#: Connections to the metrics endpoint served at once (one thread each); more are closed at once.
MAX_SCRAPERS: Final = 8
#: Longest life of one connection to the metrics endpoint, from its accept to its close.
SCRAPE_CONNECTION_S: Final = 15.0
#: A connection answered for longer than this (past the scrape's wait for the loop and its
#: send) gives its place to a newcomer when every place is taken: its reader does not read.
SCRAPE_STALLED_S: Final = SCRAPE_TIMEOUT_S + 3.0
#: Most connections (each one request) the endpoint takes per second (Prometheus scrapes a target
#: every few seconds; each answer costs the server's loop a snapshot and its process about 10 ms
#: of interpreter time).
MAX_SCRAPES_PER_S: Final = 10.0
#: How long the accept loop waits after an accept failed for want of file descriptors.
ACCEPT_RETRY_S: Final = 0.1
#: Bytes of request line and headers a metrics connection may send (a scraper's are a few hundred).
MAX_REQUEST_HEAD: Final = 8192

@dataclass(frozen=True, slots=True)
class _Hist:
    counts: tuple[int, ...]
    bounds: tuple[float, ...]
    sum: float

    @staticmethod
    def of(h: Histogram) -> _Hist:
        return _Hist(tuple(h.counts), h.bounds, h.sum)

    def buckets(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, n in zip((*self.bounds, None), self.counts):
            total += n
            out.append(("+Inf" if bound is None else repr(float(bound)), total))
        return out


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What one scrape reads, taken on the loop thread."""

    status: m.StatusReply
    started: float
    requests: dict[str, _Hist]
    #: (model label, transport, "store"|"retrieve") -> durations
    transfers: dict[tuple[str, str, str], _Hist]
    #: (request, code) -> error replies
    errors: dict[tuple[str, str], int]
    #: (model label, transport) -> registered contexts
    contexts: dict[tuple[str, str], int]
    #: "write" | "read" | "parked" -> open reservations
    reservations: dict[str, int]

    @staticmethod
    def take(server: CacheServer) -> Snapshot:
        stats = server.stats
        # every (model, transport) that registered keeps its series, at 0 once its contexts are
        # gone: `sum(kvxfer_contexts) == 0` can fire (a series that vanished is no 0)
        contexts: dict[tuple[str, str], int] = dict.fromkeys(stats.traffic, 0)
        for ctx in server.contexts.values():
            key = (stats.model_label(ctx.model_name), ctx.transport)
            contexts[key] = contexts.get(key, 0) + 1
        writes = sum(r.write for r in server.index.reservations.values())
        parked = server.parked_writes
        return Snapshot(
            status=server.status(),
            started=server.started,
            requests={name: _Hist.of(h) for name, h in stats.requests.items()},
            transfers={(model, transport, op): _Hist.of(h)
                       for (model, transport), t in stats.traffic.items()
                       for op, h in (("store", t.store), ("retrieve", t.retrieve))},
            errors=dict(stats.errors),
            contexts=contexts,
            reservations={"write": writes - parked, "read": len(server.index.reservations) - writes,
                          "parked": parked},  # (each reservation in one kind: the index holds parked writes too)
        )


def _counter(name: str, doc: str, labels: Iterable[str] = ()) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=list(labels))


def _gauge(name: str, doc: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def families(snap: Snapshot) -> Iterator[Metric]:
    """The metric families of one snapshot (see docs/metrics.md)."""
    st = snap.status
    yield InfoMetricFamily("kvxfer_build", "kvxfer version and wire protocol of this server.",
                           value={"version": st.server_version, "protocol": str(st.protocol_version)})
    yield GaugeMetricFamily("kvxfer_start_time_seconds", "Unix time the server started.", value=snap.started)
    yield GaugeMetricFamily("kvxfer_sessions", "Connected clients (sessions).", value=st.sessions)
    g = _gauge("kvxfer_contexts", "Registered KV caches (engine instances).", ["model", "transport"])
    for (model, transport), n in sorted(snap.contexts.items()):
        g.add_metric([model, transport], n)
    yield g
    yield GaugeMetricFamily("kvxfer_requests_in_flight",
                            "Requests received and not answered yet (transfers on worker threads).",
                            value=st.requests_in_flight)
    h = HistogramMetricFamily("kvxfer_request_duration_seconds",
                              "Time from a request's arrival to its reply, inside the server.", labels=["request"])
    for name, hist in sorted(snap.requests.items()):
        if hist.counts and sum(hist.counts):
            h.add_metric([name], hist.buckets(), hist.sum)
    yield h
    c = _counter("kvxfer_errors", "Error replies, by request and error code.", ["request", "code"])
    for (request, code), n in sorted(snap.errors.items()):
        c.add_metric([request, code], n)
    yield c
    yield CounterMetricFamily("kvxfer_hook_errors", "Hook implementations that raised or returned "
                                                    "something unusable (see the server log).",
                              value=st.hook_errors)

    # lookups, per model
    per_model = [
        ("kvxfer_lookups", "Lookup requests.", lambda x: x.lookups),
        ("kvxfer_lookup_chunks", "Chunks named by lookups.", lambda x: x.lookup_chunks),
        ("kvxfer_lookup_hit_chunks", "Chunks lookups found (leading chunks present for every rank).",
         lambda x: x.lookup_hits),
        ("kvxfer_lookup_l2_hit_chunks",
         "Of the chunks lookups found, those found in L2 (or being promoted from it); the rest were in L1.",
         lambda x: x.lookup_l2_hits),
        ("kvxfer_lookup_miss_chunks", "Chunks lookups did not find (after the first missing one).",
         lambda x: x.lookup_chunks - x.lookup_hits),
        ("kvxfer_evicted_chunks", "Chunks evicted (least recently used) to make room.", lambda x: x.evicted_chunks),
    ]
    for name, doc, get in per_model:
        c = _counter(name, doc, ["model"])
        for ms in st.models:
            c.add_metric([ms.model], get(ms))
        yield c
    g = _gauge("kvxfer_lookup_hit_ratio", "Hit chunks / looked-up chunks since the server started.", ["model"])
    for ms in st.models:
        if ms.lookup_chunks:
            g.add_metric([ms.model], ms.lookup_hits / ms.lookup_chunks)
    yield g

    # stores and retrieves, per model and transport
    mt = ["model", "transport"]
    per_traffic = [
        ("kvxfer_stored_chunks", "Chunks stored (readable after their store).", lambda t: t.stored_chunks),
        ("kvxfer_stored_bytes", "Bytes of the chunks stored.", lambda t: t.stored_bytes),
        ("kvxfer_store_present_chunks", "Chunks a store skipped: already stored.", lambda t: t.present_chunks),
        ("kvxfer_loaded_chunks", "Chunks read by retrieves.", lambda t: t.loaded_chunks),
        ("kvxfer_loaded_bytes", "Bytes of the chunks read by retrieves (a chunk partly skipped counts whole).",
         lambda t: t.loaded_bytes),
        ("kvxfer_retrieve_missing_chunks", ("Chunks a retrieve asked for and did not load (not there, or the "
                                            "copy failed, was cancelled or expired)."),
         lambda t: t.missing_chunks),
    ]
    for name, doc, get in per_traffic:
        c = _counter(name, doc, mt)
        for t in st.traffic:
            c.add_metric([t.model, t.transport], get(t))
        yield c
    c = _counter("kvxfer_store_failed_chunks", "Chunks a store did not store: no room (reason=no_space), "
                                               "the copy failed (reason=copy), or the client gave up on the "
                                               "store before its copy (reason=abandoned).", [*mt, "reason"])
    for t in st.traffic:
        c.add_metric([t.model, t.transport, "no_space"], t.no_space_chunks)
        c.add_metric([t.model, t.transport, "copy"], t.failed_chunks)
        c.add_metric([t.model, t.transport, "abandoned"], t.abandoned_chunks)
    yield c
    c = _counter("kvxfer_copy_seconds", "Time spent copying bytes: by the client (client-driven "
                                        "transports, reported with each commit) or by the server.", [*mt, "op"])
    for t in st.traffic:
        c.add_metric([t.model, t.transport, "store"], t.store_copy_s)
        c.add_metric([t.model, t.transport, "retrieve"], t.retrieve_copy_s)
    yield c
    h = HistogramMetricFamily("kvxfer_transfer_duration_seconds",
                              "Stores and retrieves, from the reservation of their slots to their commit.",
                              labels=[*mt, "op"])
    for (model, transport, op), hist in sorted(snap.transfers.items()):
        h.add_metric([model, transport, op], hist.buckets(), hist.sum)
    yield h
    g = _gauge("kvxfer_transfers_in_flight", "Stores and retrieves reserved and not committed yet.", [*mt, "op"])
    for t in st.traffic:
        g.add_metric([t.model, t.transport, "store"], t.stores_in_flight)
        g.add_metric([t.model, t.transport, "retrieve"], t.retrieves_in_flight)
    yield g

    # the arena and its index
    a = st.arena
    yield GaugeMetricFamily("kvxfer_arena_capacity_bytes", "Size of the shared-memory arena.", value=a.capacity)
    yield GaugeMetricFamily("kvxfer_arena_used_bytes", "Arena bytes allocated to chunks.", value=a.used)
    yield GaugeMetricFamily("kvxfer_arena_free_bytes", "Arena bytes not allocated.", value=a.capacity - a.used)
    yield GaugeMetricFamily("kvxfer_arena_largest_free_bytes", "Largest free extent of the arena.",
                            value=a.largest_free)
    yield GaugeMetricFamily("kvxfer_arena_free_extents", "Free extents of the arena (fragmentation).",
                            value=a.free_extents)
    yield GaugeMetricFamily("kvxfer_arena_chunks", "Chunks in the arena (stored or being written).", value=a.chunks)
    yield GaugeMetricFamily("kvxfer_leases", "Open leases (lookups that keep their hits from eviction).",
                            value=st.leases)
    yield GaugeMetricFamily("kvxfer_leased_chunks", "Chunks held by leases (a chunk in two leases counts twice).",
                            value=st.leased_chunks)
    g = _gauge("kvxfer_reservations", "Open reservations: writes and reads between reserve and commit, and "
                                      "writes parked for a silent client that still lives.", ["kind"])
    for kind, n in snap.reservations.items():
        g.add_metric([kind], n)
    yield g

    yield from tier_families(st.tiers)
    yield from plugin_families(st.plugin_metrics)


def tier_families(tiers: list[m.TierStatus]) -> Iterator[Metric]:
    """The storage tiers below the arena (``kvxfer serve --l2``), labelled by tier and store
    backend; families without samples when the server has none."""
    labels = ["tier", "store"]
    up = _gauge("kvxfer_tier_up", "1 while the tier serves, 0 while its circuit breaker is open (the server "
                                  "then answers from L1 and retries).", labels)
    for t in tiers:
        up.add_metric([t.name, t.store], 1.0 if t.state == "up" else 0.0)
    yield up
    counters = [
        ("kvxfer_tier_lookups", "Lookups that asked the tier (their chunks missing from L1).", lambda t: t.lookups),
        ("kvxfer_tier_lookup_chunks", ("Chunks those lookups asked the tier about (a key per rank): every chunk "
                                       "after L1's leading hits."), lambda t: t.lookup_chunks),
        ("kvxfer_tier_lookup_hit_chunks", "Of those, the chunks the tier had at the size this server loads.",
         lambda t: t.lookup_hits),
        ("kvxfer_tier_lookup_timeouts", "Lookups that gave up waiting for the tier (answered from L1).",
         lambda t: t.timeouts),
        ("kvxfer_tier_busy_lookups", ("Lookups that did not ask the tier: earlier lookups' checks had as many keys "
                                      "there as allowed at once (answered from L1)."), lambda t: t.busy_lookups),
        ("kvxfer_tier_promoted_chunks", "Chunks copied from the tier into the arena.", lambda t: t.promotions),
        ("kvxfer_tier_promote_failures", "Promotions that failed (store error, or the value was gone).",
         lambda t: t.promote_failures),
        ("kvxfer_tier_integrity_failures", ("Values whose header, length or checksum did not match: counted as "
                                            "misses, never loaded."), lambda t: t.integrity_failures),
        ("kvxfer_tier_damaged_deleted", ("Damaged values (no reader could load them, in any layout) deleted from "
                                         "the tier, so that their chunks can be stored again."),
         lambda t: t.damaged_deleted),
        ("kvxfer_tier_written_chunks", "Chunks written to the tier.", lambda t: t.writes),
        ("kvxfer_tier_written_bytes", "Bytes written to the tier.", lambda t: t.write_bytes),
        ("kvxfer_tier_write_skipped_chunks", "Chunks not written: the tier had them already.",
         lambda t: t.write_skipped),
        ("kvxfer_tier_dropped_writes", ("Writes dropped: queue full, queued writes' pinned bytes at their limit, or "
                                        "the tier down or failing."), lambda t: t.drops),
        ("kvxfer_tier_errors", "Store operations that failed.", lambda t: t.errors),
        ("kvxfer_tier_outages", "Times the circuit breaker opened.", lambda t: t.outages),
    ]
    for name, doc, get in counters:
        c = _counter(name, doc, labels)
        for t in tiers:
            c.add_metric([t.name, t.store], get(t))
        yield c
    gauges = [
        ("kvxfer_tier_promoting_chunks", "Chunks being promoted into the arena now.", lambda t: t.promoting),
        ("kvxfer_tier_queue_depth", "Chunks queued or being written to the tier now.", lambda t: t.queue_depth),
        ("kvxfer_tier_queue_capacity", "Size of the write queue (--l2-queue).", lambda t: t.queue_capacity),
        ("kvxfer_tier_pinned_bytes", "Arena bytes pinned by queued writes.", lambda t: t.pinned_bytes),
        ("kvxfer_tier_pinned_bytes_limit", ("Arena bytes queued writes may pin (half the arena); a write past it is "
                                            "dropped."), lambda t: t.pin_limit),
        ("kvxfer_tier_writers", "Writer threads running and not held by the store plugin.", lambda t: t.writers),
        ("kvxfer_tier_writers_held", ("Writers the store plugin holds in a submit call that has not returned (given "
                                      "up: their writes dropped)."), lambda t: t.writers_held),
    ]
    for name, doc, get in gauges:
        g = _gauge(name, doc, labels)
        for t in tiers:
            g.add_metric([t.name, t.store], get(t))
        yield g


def plugin_families(samples: list[m.MetricSample]) -> Iterator[Metric]:
    """Samples contributed through the ``kvxfer_metrics`` hook (already checked by
    :func:`kvxfer.server.figures.plugin_metrics`: none has a name the core uses), grouped into
    families."""
    grouped: dict[str, list[m.MetricSample]] = {}
    for s in samples:
        grouped.setdefault(s.name, []).append(s)
    for name, group in grouped.items():
        first = group[0]
        labels = sorted(first.labels)
        doc = first.help or "Contributed by a plugin (kvxfer_metrics hook)."
        fam: CounterMetricFamily | GaugeMetricFamily = (
            _counter(name, doc, labels) if first.kind == "counter" else _gauge(name, doc, labels))
        for s in group:
            fam.add_metric([s.labels[k] for k in labels], s.value)
        yield fam


class ServerCollector(Collector):
    """Reads one :class:`Snapshot` from the server's loop per scrape."""

    def __init__(self, server: CacheServer) -> None:
        self._server = server
        self.closed = False

    def describe(self) -> list[Metric]:
        """The core's families, named without collecting (the registry must not wait for the
        loop at registration), so that a scrape asking for some by ``name[]`` finds them. A
        plugin's families, known only once collected, are not in such a scrape."""
        out = []
        for name in sorted(CORE_FAMILIES):
            if name.endswith("_total"):
                out.append(Metric(name.removesuffix("_total"), "", "counter"))
            else:
                out.append(Metric(name, "", "histogram" if name.endswith("_duration_seconds") else "gauge"))
        return out

    def collect(self) -> Iterator[Metric]:
        if self.closed:
            raise RuntimeError("the kvxfer server is stopping")
        snap = self._server.call_on_loop(lambda: Snapshot.take(self._server), SCRAPE_TIMEOUT_S)
        yield from families(snap)


def _only_at_metrics(app: Any) -> Any:
    """``app`` at ``/metrics`` (and ``/``, where Prometheus' own exporters answer too); 404 for
    any other path, so that a scraper or a probe misconfigured gets an error, not the figures."""

    def only(environ: dict[str, Any], start_response: Any) -> Any:
        if environ.get("PATH_INFO", "") in ("/metrics", "/"):
            return app(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"kvxfer serves its metrics at /metrics\n"]

    return only


class _HeadLimit:
    """A connection's reader that gives at most :data:`MAX_REQUEST_HEAD` bytes of request line and
    headers: past them a line is refused as too long (the handler answers 431 and closes), so a
    request of 6.5 MB of headers (what the standard library takes) is never parsed."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._left = MAX_REQUEST_HEAD

    def readline(self, size: int = -1) -> bytes:
        want = self._left + 1 if size < 0 else min(size, self._left + 1)
        line: bytes = self._raw.readline(want)
        self._left -= len(line)
        if self._left < 0:
            raise http.client.LineTooLong(f"request head past {MAX_REQUEST_HEAD} bytes")
        return line

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class _QuietHandler(WSGIRequestHandler):
    """Logs nothing per request (a scrape a second would flood the log); tells the server when
    its request is read whole (from then on the connection is not the one evicted for a newcomer);
    reads at most :data:`MAX_REQUEST_HEAD` bytes of request head (:class:`_HeadLimit`)."""

    server: _BoundedHttpServer

    def setup(self) -> None:
        super().setup()
        self.rfile = _HeadLimit(self.rfile)  # type: ignore[assignment]  # a reader, as the base class uses it

    def parse_request(self) -> bool:
        ok = bool(super().parse_request())
        if ok:
            self.server.requested(self.connection)
        return ok

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (the base class's name)
        pass


class _BoundedHttpServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most ``max_connections`` at once, each shut down
    ``lifetime_s`` after its accept (checked by the accept loop every half second), at most
    ``per_s`` taken a second.

    Threads: the accept loop's own (``serve_forever``) and one per connection served."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[WSGIRequestHandler], *,
                 family: int, max_connections: int, lifetime_s: float, per_s: float) -> None:
        self.address_family = family
        #: Connections taken per second at most, and the earliest moment the next one is.
        self._per_s = per_s
        self._next_at = 0.0
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lifetime_s = lifetime_s
        self._lock = threading.Lock()
        #: connection -> monotonic time past which it is shut down (in order of acceptance)
        self._open: dict[socket.socket, float] = {}
        #: the open connections whose request was read whole
        self._whole: set[socket.socket] = set()
        #: Connections closed at once because every slot was taken by one past its request, those
        #: cut for a newcomer before their request was whole, and those cut at their deadline.
        self.refused = 0
        self.evicted = 0
        self.expired = 0
        # bound here, listening from server_activate() on (MetricsExporter.start): a port taken
        # fails at once, yet nothing connects before the server is whole
        super().__init__(address, handler, bind_and_activate=False)
        try:
            self.server_bind()
        except BaseException:
            self.server_close()
            raise

    def process_request(self, request: Any, client_address: Any) -> None:
        now = time.monotonic()  # (the accept loop's thread only)
        if self._next_at > now:
            time.sleep(self._next_at - now)
        self._next_at = max(now, self._next_at) + 1.0 / self._per_s
        if not self._slots.acquire(blocking=False) and not self._evict_for_newcomer():
            self.refused += 1
            self.shutdown_request(request)
            return
        with self._lock:
            self._open[request] = time.monotonic() + self._lifetime_s
        try:
            request.settimeout(self._lifetime_s)
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self._forget(request)
            self.shutdown_request(request)
            raise

    def requested(self, request: socket.socket) -> None:
        """``request`` has sent its request whole (its handler's thread)."""
        with self._lock:
            self._whole.add(request)

    def _evict_for_newcomer(self) -> bool:
        """Every slot is taken: shut down the oldest connection that has not sent its request
        whole (idle, or sending it slowly), else the oldest one answered for more than
        :data:`SCRAPE_STALLED_S` (its reader does not read), and take its slot once its thread let
        it go (within a second). So connections that never finish a request, or never read the
        answer, cannot keep a scraper out for ``lifetime_s``. False when every connection is
        being answered and none for that long (the newcomer is refused)."""
        now = time.monotonic()
        with self._lock:  # in order of acceptance
            idle = [r for r in self._open if r not in self._whole]
            stalled = [r for r, deadline in self._open.items()
                       if deadline - self._lifetime_s + SCRAPE_STALLED_S <= now]
        victims = idle or stalled
        if not victims:
            return False
        self.evicted += 1
        try:
            victims[0].shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        return self._slots.acquire(timeout=1.0)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def _forget(self, request: Any) -> None:
        with self._lock:
            known = self._open.pop(request, None) is not None
            self._whole.discard(request)
        if known:
            self._slots.release()

    def service_actions(self) -> None:
        """On the accept loop, between polls: shut down connections past their deadline (their
        thread then sees the connection closed, finishes and frees the slot)."""
        now = time.monotonic()
        with self._lock:
            late = [r for r, deadline in self._open.items() if deadline <= now]
        for request in late:
            self.expired += 1
            try:
                request.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            return super().get_request()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                # the connection stays queued and the socket readable: without a pause the accept
                # loop would spin on it until descriptors come free
                time.sleep(ACCEPT_RETRY_S)
            raise  # socketserver drops the attempt and polls again

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that failed (closed, timed out, cut): one debug line, no traceback."""
        log.debug("metrics connection from %s ended with an error", client_address, exc_info=True)


class MetricsExporter:
    """prometheus-client's HTTP server for one :class:`CacheServer`, bound at construction
    (raises :class:`ConfigError` if the address is unusable: the server binds it before it makes
    its arena), listening and serving from :meth:`start` (once the server is whole: a scrape or a
    TCP probe before is refused, not held); :meth:`close` stops it."""

    def __init__(self, server: CacheServer, host: str, port: int) -> None:
        # auto_describe: the process collector, which has no describe(), is collected once at
        # registration to learn its names (for name[] scrapes); the server's describes its own
        self.registry = CollectorRegistry(auto_describe=True)
        self.collector = ServerCollector(server)
        self.registry.register(self.collector)
        ProcessCollector(registry=self.registry)
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
            self._httpd = _BoundedHttpServer((str(sockaddr[0]), port), _QuietHandler, family=family,
                                             max_connections=MAX_SCRAPERS, lifetime_s=SCRAPE_CONNECTION_S,
                                             per_s=MAX_SCRAPES_PER_S)
            self._httpd.set_app(_only_at_metrics(make_wsgi_app(self.registry)))
        except (OSError, UnicodeError) as exc:  # (a host name that is no IDNA label: UnicodeError)
            raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc}; choose another --metrics-port "
                              "(0 picks a free one) or --metrics-host") from None
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="kvxfer-metrics", daemon=True)
        self.host = host
        self.port = int(self._httpd.server_port)
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.port}/metrics"  # `kvxfer serve` prints it in its ready line

    def start(self) -> None:
        """Listen, and serve scrapes (on a thread of its own). ConfigError if another socket
        started listening at the port since it was bound (one bound alone does not hold it)."""
        try:
            self._httpd.server_activate()
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {self.host}:{self.port}: {exc}; choose another "
                              "--metrics-port (0 picks a free one) or --metrics-host") from None
        self._thread.start()

    def close(self) -> None:
        self.collector.closed = True
        if self._thread.is_alive():
            self._httpd.shutdown()  # waits for serve_forever, which a server that never started never runs
        self._httpd.server_close()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)
