"""kvxfer's figures in vLLM's own metrics, through vLLM's real stats path.

The connector runs vLLM's call sequence (MiniEngine) against a real server; each step, like
vLLM's scheduler, the test asks both sides for ``get_kv_connector_stats`` and aggregates them.
Each step's stats then take the rest of vLLM's real path: ``SchedulerStats`` inside
``EngineCoreOutputs`` through vLLM's msgpack encoder and decoder (engine core -> front end), then
vLLM's ``PrometheusStatLogger`` (which calls ``build_prom_metrics``) and ``LoggingStatLogger``
(which calls ``build_kv_connector_stats`` and logs ``KV Transfer metrics: ...``), built from a
real ``VllmConfig`` of a small local model. The counters in vLLM's registry must equal what the
connector counted and what the kvxfer server saw. test_vllm_e2e.py checks the same counters and
log line in real vLLM runs (offline ``LLM.get_metrics()``, and the OpenAI server's ``/metrics``
with its engine in another process).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvxfer_vllm_harness import MiniEngine, feed, make_vllm_config, workload

from kvxfer import CacheClient
from kvxfer.integrations.vllm import HAVE_VLLM
from kvxfer.integrations.vllm.stats import FIELDS, KvxferConnectorStats, StatsDelta
from kvxfer.testing.server import ServerProcess

needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="needs vLLM (requirements-vllm.txt)")


def test_stats_are_increments_and_foreign_payloads_are_cleaned() -> None:
    delta = StatsDelta({"lookups": "lookups", "lookup_hit_tokens": "hit_tokens"})
    counts = {"lookups": 2, "lookup_hit_tokens": 32, "unrelated": 7}
    first = delta.take(counts)
    assert first is not None and (first.data["lookups"], first.data["hit_tokens"]) == (2, 32)
    assert delta.take(counts) is None  # nothing new
    counts["lookups"] += 1
    assert delta.take(counts).data["lookups"] == 1
    junk = KvxferConnectorStats(data={"lookups": -3, "hit_tokens": "many", "stored_bytes": True, "x": 1,
                                      "loaded_bytes": 4096})
    assert set(junk.data) == set(FIELDS) and junk.data["lookups"] == 0 and junk.data["loaded_bytes"] == 4096
    total = KvxferConnectorStats(data={"lookup_tokens": 64, "hit_tokens": 48}).aggregate(junk)
    assert total.reduce()["Hit rate (%)"] == 75.0 and total.reduce()["Loaded MiB"] == 0.0
    assert KvxferConnectorStats().is_empty()


class StatsEngine(MiniEngine):
    """MiniEngine that collects the connector's stats after every step, as vLLM's scheduler does
    in update_from_output: the worker's (from the model runner output), then the scheduler
    side's added with aggregate()."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reports: list[KvxferConnectorStats] = []

    def step(self) -> None:
        super().step()
        stats = self.worker.get_kv_connector_stats()
        sched = self.scheduler.get_kv_connector_stats()
        if sched is not None and not sched.is_empty():
            stats = stats.aggregate(sched) if stats is not None else sched
        if stats is not None:
            self.reports.append(stats)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random-weight Llama (kvxfer.testing.vllm_models: nothing is downloaded)."""
    from kvxfer.testing.vllm_models import build_model

    return build_model(tmp_path_factory.mktemp("tiny-llama") / "model")


@pytest.fixture(scope="module")
def vllm_config(tiny_model: Path, server: ServerProcess) -> Any:
    """vLLM's own VllmConfig with the connector configured, as vLLM's front end holds it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    kv = KVTransferConfig(kv_connector="KvxferConnector", kv_connector_module_path="kvxfer.integrations.vllm",
                          kv_role="kv_both", kv_connector_extra_config={"kvxfer.url": server.url})
    args = EngineArgs(model=str(tiny_model), max_model_len=512, enforce_eager=True, dtype="float32",
                      disable_log_stats=False, kv_transfer_config=kv)
    return args.create_engine_config()


@contextlib.contextmanager
def capture_vllm_log() -> Iterator[list[str]]:
    """Messages of vLLM's stat loggers (DEBUG included: an idle engine logs its line at DEBUG).
    Enter it after vLLM configured its logging (an engine's start does), which drops the handlers
    of vLLM's loggers."""
    messages: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("vllm.v1.metrics.loggers")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    yield messages
    log.removeHandler(handler)
    log.setLevel(level)


@needs_vllm
def test_vllm_metrics_and_log_line_show_what_the_connector_did(server: ServerProcess, vllm_config: Any) -> None:
    from prometheus_client import REGISTRY, generate_latest
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger
    from vllm.v1.metrics.reader import Counter, get_metrics_snapshot
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    model = "vllm-metrics"
    engine = StatsEngine(make_vllm_config(server.url, model_name=model), enable_prefix_caching=False)
    try:
        first = workload("m", n=12, seed=3)
        feed(engine, first, per_step=4)
        again = workload("m", n=12, seed=3)  # the same prompts: loaded instead of computed
        for r in again:
            r.request_id = f"again-{r.request_id}"
        feed(engine, again, per_step=4)
        engine.check_drained()
        work, sched = engine.worker.worker.stats, engine.scheduler.scheduler.stats
        (stored_as,) = [g.name for g in engine.worker.groups]  # the identity chunks are stored under
    finally:
        engine.shutdown()
    assert work["loaded_chunks"] > 0 and work["stored_chunks"] > 0 and sched["lookup_hit_tokens"] > 0

    prom = PrometheusStatLogger(vllm_config)  # its KVConnectorProm calls KvxferConnector.build_prom_metrics
    logging_logger = LoggingStatLogger(vllm_config)
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    for stats in engine.reports:
        wire = encoder.encode(EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=stats.to_dict())))
        received = decoder.decode(wire).scheduler_stats  # what vLLM's front end gets from the engine core
        prom.record(received, None, engine_idx=0)
        logging_logger.record(received, None, engine_idx=0)
    with capture_vllm_log() as vllm_log:
        logging_logger.log()

    got = {m.name: m.value for m in get_metrics_snapshot() if isinstance(m, Counter) and "kvxfer" in m.name}
    want = {"lookups": sched["lookups"], "unanswered_lookups": sched["unanswered_lookups"],
            "lookup_tokens": sched["lookup_tokens"], "hit_tokens": sched["lookup_hit_tokens"],
            "loads_not_retried": sched["loads_not_offered_again"]} | {k: work[k] for k in (
                "loads", "loaded_chunks", "loaded_bytes", "load_failures", "failed_load_blocks", "expired_loads",
                "stores", "stored_chunks", "stored_bytes", "failed_store_chunks", "dropped_stores")}
    assert got == {f"vllm:kvxfer_{k}": v for k, v in want.items()}
    text = generate_latest(REGISTRY).decode()
    labels = f'engine="0",model_name="{vllm_config.model_config.served_model_name}"'
    assert f'vllm:kvxfer_hit_tokens_total{{{labels}}} {float(want["hit_tokens"])}' in text

    # the server saw the same traffic
    with CacheClient(server.url) as client:
        st = client.status()
    (traffic,) = [t for t in st.traffic if t.model == stored_as]
    assert (traffic.stored_bytes, traffic.loaded_bytes) == (want["stored_bytes"], want["loaded_bytes"])
    assert (traffic.stored_chunks, traffic.loaded_chunks) == (want["stored_chunks"], want["loaded_chunks"])
    assert want["loaded_bytes"] == want["loaded_chunks"] * (want["stored_bytes"] // want["stored_chunks"])

    (line,) = [msg for msg in vllm_log if msg.startswith("KV Transfer metrics:")]
    assert f"Hit tokens={want['hit_tokens']}" in line and f"Loaded chunks={want['loaded_chunks']}" in line
    assert f"Stored chunks={want['stored_chunks']}" in line and "Load failures=0" in line


def test_every_vllm_metric_is_documented() -> None:
    import re

    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    documented = re.findall(r"^\| `vllm:kvxfer_(\w+)_total` \|", doc, re.M)
    assert documented == list(FIELDS)
