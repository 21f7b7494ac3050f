"""Prometheus metrics of a real server (``kvxfer serve --metrics-port 0``), scraped over HTTP:
counters move by exactly what a scripted workload did, model labels stay bounded, status shows
the same figures, every family is documented, and plugins' samples are checked."""

from __future__ import annotations

import io
import re
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kvxfer_core_helpers import BLOCK_SIZE, BLOCKS_PER_CHUNK, CHUNK_SIZE, env_with, flash_attn_kv, wait_until
from prometheus_client.parser import text_string_to_metric_families

from kvxfer import CacheClient, chunk_hashes
from kvxfer.errors import InvalidRequest
from kvxfer.protocol import messages as m
from kvxfer.server.figures import MAX_PLUGIN_STRINGS, MAX_PLUGIN_TEXT
from kvxfer.server.metrics import CORE_FAMILIES
from kvxfer.testing.server import ServerProcess
from kvxfer.transport import registry

DOCS = Path(__file__).resolve().parents[2] / "docs"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """At most 2 model labels, so the third model lands in __other__."""
    with ServerProcess(l1_size="32MiB", chunk_size=CHUNK_SIZE, transports="cpu_gather",
                       extra_args=["--metrics-port", "0", "--metrics-max-models", "2"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def url(server: ServerProcess) -> str:
    with CacheClient(server.url) as c:
        return c.status().metrics_url


def scrape_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        return resp.read().decode()


def scrape(url: str) -> Samples:
    out: Samples = {}
    for fam in text_string_to_metric_families(scrape_text(url)):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def test_metrics_url_is_local_and_announced(server: ServerProcess, url: str) -> None:
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", url)
    assert f"metrics at {url}" in server.log()


def test_only_the_metrics_path_serves_the_figures(url: str) -> None:
    """Any other path is a 404 (a misconfigured scraper or probe gets an error, not the figures)."""
    import urllib.error

    base = url.rsplit("/", 1)[0]
    assert "kvxfer_lookups_total" in scrape_text(url) and "kvxfer_lookups_total" in scrape_text(base + "/")
    for path in ("/etc/passwd", "/metrics/x", "/favicon.ico"):
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(base + path, timeout=30)
        assert info.value.code == 404, path


def test_a_metrics_host_that_is_no_host_name_is_a_clean_error(tmp_path) -> None:
    """``getaddrinfo`` raises UnicodeError (not OSError) for a label it cannot encode: a traceback
    and exit code 1 before."""
    import subprocess
    import sys

    for host in ("a..b", "x" * 64):
        out = subprocess.run([sys.executable, "-m", "kvxfer", "serve", "--url", f"ipc://{tmp_path}/s.sock",
                              "--l1-size", "8MiB", "--metrics-port", "0", "--metrics-host", host],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and "cannot serve metrics on" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr


def test_counters_move_by_exactly_what_the_workload_did(client: CacheClient, url: str) -> None:
    kv = client.register(flash_attn_kv(), model_name="alpha", block_size=BLOCK_SIZE, transport="cpu_gather")
    chunk = kv.layout.chunk_bytes(CHUNK_SIZE)
    hashes = chunk_hashes(list(range(5 * CHUNK_SIZE)), CHUNK_SIZE, salt=secrets.token_hex(4))
    before = scrape(url)
    blocks = list(range(3 * BLOCKS_PER_CHUNK))
    assert kv.submit_store(hashes[:3], blocks).result(30).stored == [0, 1, 2]
    assert kv.submit_store(hashes[:3], blocks).result(30).present == [0, 1, 2]  # nothing new
    assert client.lookup("alpha", hashes=hashes) == 3
    res = kv.submit_retrieve(hashes[:4], list(range(16, 16 + 4 * BLOCKS_PER_CHUNK))).result(30)
    assert (res.loaded, res.missing) == ([0, 1, 2], [3])
    with pytest.raises(InvalidRequest):
        client.request(m.CommitWrite(kv.instance_id, 1 << 40))
    after = scrape(url)
    kv.close()
    # a model that registered keeps its series at 0 once its contexts are gone (an alert on
    # sum(kvxfer_contexts) == 0 would never fire on a series that vanished)
    series = ("kvxfer_contexts", (("model", "alpha"), ("transport", "cpu_gather")))
    assert wait_until(lambda: scrape(url).get(series, -1.0) == 0, 10)  # there, at 0 (value() reads a missing one as 0)

    mt = {"model": "alpha", "transport": "cpu_gather"}
    assert delta(before, after, "kvxfer_lookups_total", model="alpha") == 1
    assert delta(before, after, "kvxfer_lookup_chunks_total", model="alpha") == 5
    assert delta(before, after, "kvxfer_lookup_hit_chunks_total", model="alpha") == 3
    assert delta(before, after, "kvxfer_lookup_miss_chunks_total", model="alpha") == 2
    assert delta(before, after, "kvxfer_stored_chunks_total", **mt) == 3
    assert delta(before, after, "kvxfer_stored_bytes_total", **mt) == 3 * chunk
    assert delta(before, after, "kvxfer_store_present_chunks_total", **mt) == 3
    assert delta(before, after, "kvxfer_store_failed_chunks_total", **mt, reason="no_space") == 0
    assert delta(before, after, "kvxfer_loaded_chunks_total", **mt) == 3
    assert delta(before, after, "kvxfer_loaded_bytes_total", **mt) == 3 * chunk
    assert delta(before, after, "kvxfer_retrieve_missing_chunks_total", **mt) == 1
    assert delta(before, after, "kvxfer_transfer_duration_seconds_count", **mt, op="store") == 2
    assert delta(before, after, "kvxfer_transfer_duration_seconds_count", **mt, op="retrieve") == 1
    assert delta(before, after, "kvxfer_transfer_duration_seconds_bucket", **mt, op="store", le="+Inf") == 2
    assert delta(before, after, "kvxfer_copy_seconds_total", **mt, op="store") > 0  # reported by the client
    assert delta(before, after, "kvxfer_request_duration_seconds_count", request="lookup") == 1
    assert delta(before, after, "kvxfer_request_duration_seconds_count", request="reserve_write") == 2
    assert delta(before, after, "kvxfer_errors_total", request="commit_write", code="invalid_request") == 1
    assert value(after, "kvxfer_contexts", **mt) == 1
    assert value(after, "kvxfer_lookup_hit_ratio", model="alpha") == pytest.approx(
        value(after, "kvxfer_lookup_hit_chunks_total", model="alpha")
        / value(after, "kvxfer_lookup_chunks_total", model="alpha"))
    assert value(after, "kvxfer_arena_used_bytes") + value(after, "kvxfer_arena_free_bytes") == \
        value(after, "kvxfer_arena_capacity_bytes") == 32 << 20
    assert value(after, "kvxfer_sessions") >= 1
    assert value(after, "kvxfer_build_info", version=client.server_version, protocol=str(m.PROTOCOL_VERSION)) == 1
    assert value(after, "process_resident_memory_bytes") > 0
    # the histogram's buckets are cumulative and end with every observation
    le = [(k[1], v) for k, v in after.items() if k[0] == "kvxfer_request_duration_seconds_bucket"
          and dict(k[1])["request"] == "lookup"]
    counts = [v for _, v in sorted(le, key=lambda kv: float(dict(kv[0])["le"]))]
    assert counts == sorted(counts) and counts[-1] == value(after, "kvxfer_request_duration_seconds_count",
                                                            request="lookup")


def test_a_copy_is_never_counted_longer_than_its_transfer(client: CacheClient, url: str) -> None:
    """A client-driven transfer's copy time is the client's figure: one that claimed more than
    the server saw between the reserve and the commit made the share of transfers spent copying
    (copy seconds over transfer seconds) pass 100%. It counts at most the transfer's time."""
    kv = client.register(flash_attn_kv(), model_name="alpha", block_size=BLOCK_SIZE, transport="cpu_gather")
    mt = {"model": "alpha", "transport": "cpu_gather"}
    before = scrape(url)
    for op in ("store", "retrieve"):
        hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt=secrets.token_hex(4))
        rep = client.request(m.ReserveWrite(kv.instance_id, hashes))
        client.request(m.CommitWrite(kv.instance_id, rep.reservation_id, copy_s=0.0))
        if op == "retrieve":
            rep = client.request(m.ReserveRead(kv.instance_id, hashes))
            client.request(m.CommitRead(kv.instance_id, rep.reservation_id, copy_s=5.0))
        else:
            rep = client.request(m.ReserveWrite(kv.instance_id, chunk_hashes(
                list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt=secrets.token_hex(4))))
            client.request(m.CommitWrite(kv.instance_id, rep.reservation_id, copy_s=5.0))
    after = scrape(url)
    for op in ("store", "retrieve"):
        copied = delta(before, after, "kvxfer_copy_seconds_total", **mt, op=op)
        took = delta(before, after, "kvxfer_transfer_duration_seconds_sum", **mt, op=op)
        assert 0 < copied <= took < 5.0, (op, copied, took)


def test_in_flight_reservations_and_status_agree(client: CacheClient, url: str) -> None:
    kv = client.register(flash_attn_kv(), model_name="alpha", block_size=BLOCK_SIZE, transport="cpu_gather")
    hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt=secrets.token_hex(4))
    rep = client.request(m.ReserveWrite(kv.instance_id, hashes))  # no commit yet
    open_ = scrape(url)
    st = client.status()
    mt = {"model": "alpha", "transport": "cpu_gather"}
    assert value(open_, "kvxfer_transfers_in_flight", **mt, op="store") == 1
    assert value(open_, "kvxfer_reservations", kind="write") == 1
    assert [t.stores_in_flight for t in st.traffic if t.model == "alpha"] == [1]
    time.sleep(0.3)  # the copy the commit reports (0.25 s) took place since the reserve
    client.request(m.CommitWrite(kv.instance_id, rep.reservation_id, copy_s=0.25))
    done = scrape(url)
    assert value(done, "kvxfer_transfers_in_flight", **mt, op="store") == 0
    assert value(done, "kvxfer_reservations", kind="write") == 0
    assert delta(open_, done, "kvxfer_copy_seconds_total", **mt, op="store") == pytest.approx(0.25)
    st = client.status()
    traffic = {(t.model, t.transport): t for t in st.traffic}[("alpha", "cpu_gather")]
    assert traffic.stored_chunks == value(done, "kvxfer_stored_chunks_total", **mt)
    assert traffic.stored_bytes == value(done, "kvxfer_stored_bytes_total", **mt)
    lookup = {(x.name, x.transport): x for x in st.latency}[("lookup", "")]
    assert lookup.count == value(done, "kvxfer_request_duration_seconds_count", request="lookup")
    assert 0 < lookup.p50_s <= lookup.p90_s <= lookup.p99_s <= lookup.max_s
    assert ("store", "cpu_gather") in {(x.name, x.transport) for x in st.latency}
    for bad in (-1.0, float("nan"), 1e9):
        with pytest.raises(InvalidRequest, match="copy_s"):
            client.request(m.CommitRead(kv.instance_id, 1, copy_s=bad))
    kv.close()


def test_a_read_the_client_did_not_copy_counts_nothing_loaded(client: CacheClient, url: str) -> None:
    kv = client.register(flash_attn_kv(), model_name="alpha", block_size=BLOCK_SIZE, transport="cpu_gather")
    hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt=secrets.token_hex(4))
    assert kv.submit_store(hashes, list(range(2 * BLOCKS_PER_CHUNK))).result(30).stored == [0, 1]
    before = scrape(url)
    rep = client.request(m.ReserveRead(kv.instance_id, hashes))
    client.request(m.CommitRead(kv.instance_id, rep.reservation_id, loaded=False))  # e.g. cancelled
    after = scrape(url)
    kv.close()
    mt = {"model": "alpha", "transport": "cpu_gather"}
    assert delta(before, after, "kvxfer_loaded_chunks_total", **mt) == 0
    assert delta(before, after, "kvxfer_retrieve_missing_chunks_total", **mt) == 2
    assert delta(before, after, "kvxfer_transfer_duration_seconds_count", **mt, op="retrieve") == 1


def test_model_labels_are_bounded(client: CacheClient, url: str) -> None:
    names = ["alpha", "beta", "gamma"]  # the server keeps 2 labels; alpha registered first
    ctxs = [client.register(flash_attn_kv(), model_name=n, block_size=BLOCK_SIZE, transport="cpu_gather")
            for n in names]
    before = scrape(url)
    for kv in ctxs:
        hashes = chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE, salt=secrets.token_hex(4))
        assert kv.submit_store(hashes, list(range(BLOCKS_PER_CHUNK))).result(30).stored == [0]
    client.lookup("never-registered", hashes=[secrets.token_bytes(16)])
    after = scrape(url)
    for kv in ctxs:
        kv.close()
    models = {dict(k[1]).get("model") for k in after if "model" in dict(k[1])}
    assert models == {"alpha", "beta", "__other__"}
    for model in ("alpha", "beta", "__other__"):
        assert delta(before, after, "kvxfer_stored_chunks_total", model=model, transport="cpu_gather") == 1
    assert delta(before, after, "kvxfer_lookups_total", model="__other__") == 1
    assert {x.model for x in client.status().models} == {"alpha", "beta", "__other__"}


def test_evictions_are_counted_per_model(client: CacheClient, url: str) -> None:
    layers = flash_attn_kv(num_layers=4, heads=8, head_size=64)  # 512 KiB chunks: 64 fill the arena
    # another layout needs another model name: "delta" counts under __other__ (2 labels, taken)
    kv = client.register(layers, model_name="delta", block_size=BLOCK_SIZE, transport="cpu_gather")
    n = (32 << 20) // kv.layout.chunk_bytes(CHUNK_SIZE) + 6
    hashes = chunk_hashes(list(range(n * CHUNK_SIZE)), CHUNK_SIZE, salt=secrets.token_hex(4))
    before, evictions_before = scrape(url), client.status().arena.evictions
    for i in range(0, n, 16):
        part = hashes[i:i + 16]
        assert kv.submit_store(part, [j % 32 for j in range(len(part) * BLOCKS_PER_CHUNK)]).result(60).ok
    after, evictions_after = scrape(url), client.status().arena.evictions
    kv.close()
    per_model = {mo: delta(before, after, "kvxfer_evicted_chunks_total", model=mo)
                 for mo in ("alpha", "beta", "__other__")}
    assert sum(per_model.values()) == evictions_after - evictions_before >= 6
    assert per_model["__other__"] >= 1  # its own first chunks went last: least recently used
    client.clear()


def test_every_family_is_documented_and_every_documented_core_family_is_exported(url: str) -> None:
    exported = {fam.name for fam in text_string_to_metric_families(scrape_text(url))}
    documented = set(re.findall(r"^\| `(kvxfer_\w+?)(?:\{[^`]*\})?` \|", (DOCS / "metrics.md").read_text(), re.M))
    # the parser names families without _total (counters) and _info (info)
    for name in exported:
        if not name.startswith("kvxfer_"):
            continue
        assert {name, f"{name}_total", f"{name}_info"} & documented, f"{name} is exported but not in docs/metrics.md"
    plugin = {d for d in documented if d.startswith(("kvxfer_cuda_ipc_", "kvxfer_hpu_"))}
    for name in documented - plugin:
        assert {name, name.removesuffix("_total"), name.removesuffix("_info")} & exported, \
            f"{name} is documented but this server does not export it"


def test_grafana_dashboard_uses_only_existing_metrics(url: str) -> None:
    import json

    dashboard = json.loads((DOCS / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 12
    assert dashboard["uid"] and dashboard["schemaVersion"] >= 30
    assert {p["type"] for p in dashboard["panels"]} <= {"row", "timeseries", "stat"}
    exported = set()
    for fam in text_string_to_metric_families(scrape_text(url)):
        exported |= {s.name for s in fam.samples} | {fam.name}
    documented = set(re.findall(r"`(kvxfer_\w+?)(?:\{[^`]*\})?`", (DOCS / "metrics.md").read_text()))
    for expr in exprs:
        names = set(re.findall(r"\b((?:kvxfer|process)_[a-z0-9_]+)", expr))
        assert names, f"panel expression names no metric of the server: {expr}"
        for name in names:
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            if name.startswith(("kvxfer_cuda_ipc_", "kvxfer_hpu_")):
                assert name in documented, f"{name} (in {expr!r}) is not a documented plugin metric"
            else:
                assert {name, base, name.removesuffix("_total")} & exported, f"{name} (in {expr!r}) is not exported"


def test_grafana_dashboard_draws_each_series_in_its_own_unit() -> None:
    """A series is drawn in the unit of what it measures: a count (a gauge of things, an
    ``increase``) never under a per-second or bytes axis, a per-second rate never under a plain
    count, bytes only where the series is bytes; a series in another unit than its panel's has
    an override of its own."""
    import json

    dashboard = json.loads((DOCS / "grafana-dashboard.json").read_text())
    per_second = {"ops", "reqps", "Bps"}
    checked = 0
    for panel in dashboard["panels"]:
        default = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
        own = {o["matcher"]["options"]: p["value"] for o in panel.get("fieldConfig", {}).get("overrides", [])
               if o["matcher"]["id"] == "byFrameRefID" for p in o["properties"] if p["id"] == "unit"}
        for target in panel.get("targets", []):
            expr, unit = target["expr"], own.get(target["refId"], default)
            names = re.findall(r"\b((?:kvxfer|process)_[a-z0-9_]+)", expr)
            if unit in ("percentunit", "s") or "/" in expr or "quantile" in expr:
                continue  # ratios and latencies: their own units
            checked += 1
            where = f"panel {panel['title']!r}, {target['refId']}: {expr}"
            if "increase(" in expr or not any(w in expr for w in ("rate(", "irate(")):
                assert unit not in per_second, f"a count drawn per second ({unit}): {where}"
            else:
                assert unit in per_second, f"a per-second rate drawn as {unit}: {where}"
            assert (unit in ("bytes", "Bps")) == all(n.endswith(("_bytes", "_bytes_total")) for n in names), \
                f"bytes drawn as {unit}, or something else drawn as bytes: {where}"
    assert checked >= 30


@pytest.fixture
def on_path(test_plugin_path: Path) -> Iterator[Path]:
    """The test plugin importable and discoverable in this process, for one test."""
    sys.path.insert(0, str(test_plugin_path))
    registry.refresh()
    yield test_plugin_path
    sys.path.remove(str(test_plugin_path))
    registry.refresh()
    for name in [n for n in sys.modules if n.startswith("kvxfer_test_transport")]:
        del sys.modules[name]


def test_a_plugin_sample_is_named_after_its_plugin_and_never_as_a_core_metric() -> None:
    """Names are each plugin's own: ``kvxfer_<plugin>_...`` (a transport's name, or a hook plugin's
    entry point name), never a core family's or one of its series' (a plugin named ``tier`` may not
    export ``kvxfer_tier_up``, one named ``request`` not ``kvxfer_request_duration_seconds_count``).
    A sample that breaks either is dropped and counted as a hook error, once per call (it was
    dropped at the scrape only, uncounted, with a warning at every scrape)."""
    from kvxfer.server.figures import metric_prefix, plugin_metrics
    from kvxfer.server.hooks import HookRelay, hookimpl
    from kvxfer.transport import MetricSample

    class Figures:
        def __init__(self, *names: str) -> None:
            self.names = names

        @hookimpl
        def kvxfer_metrics(self, server: object) -> list[MetricSample]:
            return [MetricSample(n, "gauge", 1.0) for n in self.names]

    class Server:  # what plugin_metrics reads of a server: its hooks (a real HookRelay)
        hooks = HookRelay(load_entry_points=False)

    server = Server()
    server.hooks.register(Figures("kvxfer_tier_up", "kvxfer_tier_mine"), "tier")
    server.hooks.register(Figures("kvxfer_my_plugin_depth", "kvxfer_tier_depth"), "my-plugin")
    server.hooks.register(Figures("kvxfer_disk_queue", "kvxfer_disk_cache_misses"), "kvxfer.transport.disk")
    # nor a series of one (a histogram's), nor the family a core counter's TYPE line names
    server.hooks.register(Figures("kvxfer_request_duration_seconds_count", "kvxfer_request_depth"), "request")
    server.hooks.register(Figures("kvxfer_lookups", "kvxfer_lookups_pending"), "lookups")
    # a name under two plugins' prefixes is the longer one's: a plugin named disk_cache owns
    # kvxfer_disk_cache_..., which the transport disk may not export
    server.hooks.register(Figures("kvxfer_disk_cache_hits"), "disk-cache")
    assert [s.name for s in plugin_metrics(server)] == ["kvxfer_tier_mine", "kvxfer_my_plugin_depth",
                                                        "kvxfer_disk_queue", "kvxfer_request_depth",
                                                        "kvxfer_lookups_pending", "kvxfer_disk_cache_hits"]
    assert server.hooks.errors == 5
    assert metric_prefix("kvxfer.transport.cuda_ipc") == "kvxfer_cuda_ipc_" and metric_prefix("My.Hooks") == \
        "kvxfer_my_hooks_"


def test_plugins_metrics_are_exported_and_bad_samples_dropped(on_path: Path, tmp_path: Path) -> None:
    from kvxfer_test_transport import shared_layers

    env = env_with(on_path, KVXFER_TEST_BAD_METRICS="1")
    with ServerProcess(l1_size="4MiB", chunk_size=CHUNK_SIZE, transports="test_loop", env=env,
                       extra_args=["--metrics-port", "0"]) as srv:
        with CacheClient(srv.url) as c:
            layers = shared_layers(tmp_path / "kv", 2, (2, 16, BLOCK_SIZE, 2, 8), torch.float16)
            kv = c.register(layers, model_name="loop", block_size=BLOCK_SIZE, transport="test_loop")
            hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE)
            assert kv.submit_store(hashes, list(range(2 * BLOCKS_PER_CHUNK))).result(30).stored == [0, 1]
            assert kv.submit_retrieve(hashes, list(range(2 * BLOCKS_PER_CHUNK))).result(30).loaded == [0, 1]
            errors_before = c.status().hook_errors
            samples = scrape(c.status().metrics_url)
            st = c.status()
            kv.close()
        log = srv.log()
        assert "cannot be exported" in log
    chunk = kv.layout.chunk_bytes(CHUNK_SIZE)
    # the transport's server half took part in the hooks: it saw both transfers, with their bytes
    assert value(samples, "kvxfer_test_loop_transfers_total", op="store") == 1
    assert value(samples, "kvxfer_test_loop_bytes_total", op="retrieve") == 2 * chunk
    assert value(samples, "kvxfer_test_loop_copy_seconds_total", op="store") > 0  # measured by the server
    assert value(samples, "kvxfer_copy_seconds_total", model="loop", transport="test_loop", op="store") > 0
    assert value(samples, "kvxfer_test_recorder_calls") > 0
    names = {k[0] for k in samples}
    assert not {"test_no_prefix", "kvxfer_test_counter_without_suffix", "kvxfer_test_not_finite",
                "kvxfer_test_loop_forged_total"} & names
    assert "kvxfer_test_loop_forged_total: a sample of plugin test_recorder is named kvxfer_test_recorder_..." in log
    # each scrape and status call dropped the four bad samples, counting each
    assert st.hook_errors >= errors_before + 8
    assert {s.name for s in st.plugin_metrics} >= {"kvxfer_test_recorder_calls", "kvxfer_test_loop_transfers_total"}
    # a transport's status() of 201 long entries: the first MAX_PLUGIN_STRINGS, each cut short
    (state,) = [t.state for t in st.transports if t.name == "test_loop"]
    assert len(state) == MAX_PLUGIN_STRINGS and state["kind"] == "test", len(state)
    assert max(len(v) for v in state.values()) == MAX_PLUGIN_TEXT
    assert f"transport 'test_loop' status() returned more than {MAX_PLUGIN_STRINGS} entries" in log


def test_metrics_port_in_use_is_refused_with_advice(url: str, tmp_path) -> None:
    port = url.rsplit(":", 1)[1].split("/")[0]
    proc = subprocess.run([sys.executable, "-m", "kvxfer", "serve", "--url", f"ipc://{tmp_path}/run/kvxfer.sock",
                           "--l1-size", "1MiB",
                           "--transports", "cpu_gather", "--metrics-port", port],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"cannot serve metrics on 127.0.0.1:{port}" in proc.stderr and "--metrics-port" in proc.stderr


def test_without_metrics_port_nothing_is_served() -> None:
    with ServerProcess(l1_size="1MiB", chunk_size=CHUNK_SIZE, transports="cpu_gather") as srv, \
            CacheClient(srv.url) as c:
        assert c.status().metrics_url == ""
        assert "metrics at" not in srv.log()


def test_an_l2_tier_is_exported_per_tier(tmp_path: Path) -> None:
    """A server with an fs L2 tier: writes, lookups that find chunks only in L2 and their
    promotion move the tier's figures by what happened; top shows the tier."""
    from rich.console import Console

    from kvxfer.top import render

    with ServerProcess(l1_size="8MiB", chunk_size=CHUNK_SIZE, transports="cpu_gather",
                       extra_args=["--metrics-port", "0", "--l2", "fs", "--l2-url", f"file://{tmp_path}/l2"]) as srv, \
            CacheClient(srv.url, timeout=30) as c:
        url = c.status().metrics_url
        before = scrape(url)
        tier = {"tier": "l2", "store": "fs"}
        assert value(before, "kvxfer_tier_up", **tier) == 1
        assert value(before, "kvxfer_tier_queue_capacity", **tier) == 64
        assert value(before, "kvxfer_tier_pinned_bytes_limit", **tier) == c.status().arena.capacity // 2
        exported = {fam.name for fam in text_string_to_metric_families(scrape_text(url))}
        # a plugin sample may not take a core family's name: the core knows every one it exports
        assert all({n, f"{n}_total", f"{n}_info"} & CORE_FAMILIES for n in exported if n.startswith("kvxfer_")), \
            sorted(n for n in exported if n.startswith("kvxfer_") and not {n, f"{n}_total", f"{n}_info"} & CORE_FAMILIES)
        kv = c.register(flash_attn_kv(), model_name="tiered", block_size=BLOCK_SIZE, transport="cpu_gather")
        hashes = chunk_hashes(list(range(3 * CHUNK_SIZE)), CHUNK_SIZE, salt=secrets.token_hex(4))
        assert kv.submit_store(hashes, list(range(3 * BLOCKS_PER_CHUNK))).result(30).stored == [0, 1, 2]
        assert wait_until(lambda: c.status().tiers[0].writes == 3 and c.status().tiers[0].queue_depth == 0, 30)
        assert c.clear("tiered") == 3  # now only in L2
        reply = c.lookup_and_lease("tiered", hashes=hashes, lease_s=30)
        assert (reply.hits, reply.l2_hits) == (3, 3)
        assert kv.submit_retrieve(hashes, list(range(16, 16 + 3 * BLOCKS_PER_CHUNK)),
                                  lease_id=reply.lease_id).result(30).loaded == [0, 1, 2]
        # the retrieve's commit_read (which counts the loaded chunks) went out before it resolved and
        # is answered in the background: a request after it on the same connection is served after it
        st = c.status()
        after = scrape(url)
        kv.close()
    chunk = kv.layout.chunk_bytes(CHUNK_SIZE)
    assert delta(before, after, "kvxfer_tier_written_chunks_total", **tier) == 3
    assert delta(before, after, "kvxfer_tier_written_bytes_total", **tier) >= 3 * chunk  # values carry a header
    assert delta(before, after, "kvxfer_tier_lookup_hit_chunks_total", **tier) == 3
    assert delta(before, after, "kvxfer_tier_promoted_chunks_total", **tier) == 3
    assert delta(before, after, "kvxfer_lookup_hit_chunks_total", model="tiered") == 3  # hits in either tier
    assert delta(before, after, "kvxfer_lookup_l2_hit_chunks_total", model="tiered") == 3  # all of them in L2
    assert delta(before, after, "kvxfer_loaded_chunks_total", model="tiered", transport="cpu_gather") == 3
    assert value(after, "kvxfer_tier_dropped_writes_total", **tier) == value(after, "kvxfer_tier_errors_total",
                                                                            **tier) == 0
    console = Console(width=120, record=True, file=io.StringIO())
    console.print(render(st))
    line = next(x for x in console.export_text().splitlines() if x.startswith("l2 fs up"))
    assert "hits 100.0% of 3 chunks asked" in line and "queue 0/64" in line


def test_the_metrics_port_is_taken_at_once_and_listens_once_the_server_is_whole() -> None:
    """A server binds its metrics port before it makes its arena (a port in use fails at once),
    but listens only once it is whole: a scrape or a TCP probe meanwhile is refused, not held
    while the arena faults in (the exporter is made here on its own: nothing is scraped)."""
    import socket

    from kvxfer.errors import ConfigError
    from kvxfer.server.metrics import MetricsExporter

    exporter = MetricsExporter(object(), "127.0.0.1", 0)  # type: ignore[arg-type]  # never scraped here
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", exporter.port), timeout=5).close()
        exporter.start()
        socket.create_connection(("127.0.0.1", exporter.port), timeout=5).close()
        with pytest.raises(ConfigError, match=f"cannot serve metrics on 127.0.0.1:{exporter.port}"):
            MetricsExporter(object(), "127.0.0.1", exporter.port)  # type: ignore[arg-type]
    finally:
        exporter.close()


def test_a_transports_latency_percentiles_are_of_its_most_recent_transfers_of_any_model() -> None:
    """The status's store and retrieve percentiles per transport (kvxfer status, top) are of the
    most recent transfers through it, whichever models made them: model a's slow stores after
    model b's many fast ones show. (Each model's window was once joined in model order, so b's
    older stores pushed a's newer ones out: p99 and max showed none of them.) In-process: the
    figures of one server's loop, fed as its handlers feed them."""
    from kvxfer.protocol import REQUESTS
    from kvxfer.server.figures import latency_status
    from kvxfer.server.stats import RECENT, ServerStats

    stats = ServerStats(tuple(REQUESTS))
    for name in ("a", "b"):
        stats.register_model(name)
    a, b = stats.traffic_of("a", "cpu_gather"), stats.traffic_of("b", "cpu_gather")
    stats.on_store(a, 1, 0, 1, 0.06, 0.0)
    for _ in range(RECENT + 76):
        stats.on_store(b, 1, 0, 1, 0.0005, 0.0)
    for _ in range(60):
        stats.on_store(a, 1, 0, 1, 0.06, 0.0)
    store = next(x for x in latency_status(stats) if x.name == "store" and x.transport == "cpu_gather")
    assert store.count == RECENT + 137 and store.window == RECENT
    assert store.max_s == 0.06 and store.p99_s == 0.06, store


def test_a_scrape_of_some_families_by_name_gets_them(url: str) -> None:
    """``/metrics?name[]=...`` (prometheus-client's filter) answers the families asked for, the
    core's counters, gauges and histograms alike (it answered nothing: the collector described
    no family), and every core family collected is one it describes, with its type."""
    from prometheus_client import CollectorRegistry

    from kvxfer.server.metrics import ServerCollector

    asked = ["kvxfer_sessions", "kvxfer_hook_errors_total", "kvxfer_request_duration_seconds_count",
             "process_open_fds"]
    got = {s.name for fam in text_string_to_metric_families(scrape_text(url + "?" + "&".join(
        f"name[]={n}" for n in asked))) for s in fam.samples}
    assert set(asked) <= got, got
    assert not {n for n in got if n not in asked and not n.startswith("kvxfer_request_duration_seconds")}, got
    described = {(d.name, d.type) for d in ServerCollector.describe(None)}  # type: ignore[arg-type]
    for fam in text_string_to_metric_families(scrape_text(url)):
        if fam.name in {n.removesuffix("_total") for n in CORE_FAMILIES} | CORE_FAMILIES:
            assert (fam.name, fam.type) in described, (fam.name, fam.type)
    assert len(described) == len(CORE_FAMILIES)
    CollectorRegistry(auto_describe=True).register(ServerCollector(None))  # type: ignore[arg-type]  # described, not collected



def test_long_model_names_that_differ_only_at_their_end_keep_labels_of_their_own() -> None:
    """The vLLM connector names a model ``PATH@dtype#fingerprint``: 152 characters with a Hugging
    Face snapshot path. Labels were the first 128, so two engines of one path in two layouts
    (fingerprints) shared a label and their figures were summed. A long name is cut in the
    middle, around a digest of the whole name, and keeps its end."""
    path = "/root/.cache/huggingface/hub/models--meta-llama--Llama-3.1-8B-Instruct/snapshots/" + "0e9e39f2" * 5
    names = [f"{path}@bfloat16#{fp}" for fp in ("0123456789abcdef", "fedcba9876543210")]
    assert all(len(n) > 128 for n in names)
    with ServerProcess(l1_size="8MiB", chunk_size=CHUNK_SIZE, transports="cpu_gather",
                       extra_args=["--metrics-port", "0"]) as srv, CacheClient(srv.url) as c:
        for name in names:
            c.register(flash_attn_kv(), model_name=name, block_size=BLOCK_SIZE, transport="cpu_gather")
            c.lookup(name, hashes=chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE))
        samples = scrape(c.status().metrics_url)
    labels = {dict(lb)["model"]: v for (n, lb), v in samples.items() if n == "kvxfer_lookups_total"}
    assert len(labels) == 2 and all(v == 1 for v in labels.values()), labels
    for name in names:
        (label,) = [lb for lb in labels if lb.endswith(name[-40:])]
        assert len(label) <= 128 and label.startswith(name[:64])


def test_no_model_name_is_given_another_models_label() -> None:
    """A name that is another's shortened label, or ``__other__``, took that label: its figures
    were summed with the other model's (or with every model past --metrics-max-models)."""
    from kvxfer.server.stats import OTHER_MODEL, ServerStats, model_label

    stats = ServerStats(("lookup",))
    victim = "meta-llama/Llama-3-70B" + "/x" * 60 + "@bfloat16#abcd1234"
    label = stats.register_model(victim)
    assert len(label) == 128 and "…" in label
    for name in (label, OTHER_MODEL, "a…b"):
        mine = stats.register_model(name)
        assert mine not in (label, OTHER_MODEL) and len(mine) <= 128, (name, mine)
    assert model_label("plain-name") == "plain-name"
    assert stats.named_models == 4 and len(stats.models) == 4

