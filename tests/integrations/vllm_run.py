"""Run real vLLM (offline ``LLM``) in this process, as a test or benchmark asks, and write what
happened as JSON.

``python vllm_run.py SPEC.json`` where the spec names the model, the connector settings (none:
vLLM without kvxfer) and the prompts; each entry of ``"batches"`` is one ``generate`` call. The
result (``"out"`` path of the spec) holds, per batch, each prompt's greedy tokens, finish reason
and vLLM's
``num_cached_tokens``, the deltas of vLLM's own prefix-cache counters
(``vllm:external_prefix_cache_hits`` and friends) and of kvxfer's counters in vLLM's metrics
(``vllm:kvxfer_*``) over the batch, the ``KV Transfer metrics`` lines vLLM's stat logger writes
for it, and its wall time. Runs the
engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the caller) to start fast.

``"record_copy_threads": true`` records, as ``"copy_threads"``, the intra-op thread counts
cpu_gather's copies ran with (``torch.get_num_threads()`` on the copying thread, wrapped around
``CpuGatherContext.gather``/``scatter``), and as ``"engine_threads"`` the count of vLLM's own thread
and of a thread started afresh, before the first batch and after the last.

``"pooling": "MEAN"`` (or another sequence pooling) runs the model as an embedding model and
each batch through ``LLM.embed``, recording ``"embeddings"``.

A fault, for failed-load tests: ``"stall": {"pid": PID, "batch": I}`` stops process PID (the
kvxfer server) with SIGSTOP the moment vLLM's scheduler has planned the first load of batch I
(after the lookup that found the chunks, before the worker's load), and resumes it with SIGCONT
once that batch has returned. The one thing patched is the connector's
``build_connector_meta``, wrapped to send the signal; vLLM, the connector and the server run as
they are.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any


def _counters(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if ("prefix_cache" in m.name or m.name.startswith("vllm:kvxfer_")) and isinstance(value, (int, float)):
            out[m.name] = float(value)
    return out


def _drain(llm: Any, timeout: float = 60.0) -> None:
    """Step the engine until no finished request waits on the connector: ``LLM.generate``
    returns once its outputs are complete, while the stores of the last steps may still be
    running (vLLM keeps those requests' blocks until the connector reports them sent). The
    batch's counters then include every store it made, however slow the machine."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    if scheduler is None:  # not the in-process engine this runner asks for: nothing to wait on
        return
    deadline = time.monotonic() + timeout
    while scheduler.has_requests() and time.monotonic() < deadline:
        llm.llm_engine.step()


class _Stall:
    """Stops ``pid`` when the first load of an armed batch is planned (see the module docstring)."""

    def __init__(self, pid: int) -> None:
        from kvxfer.integrations.vllm import KvxferConnector

        self.pid = pid
        self.armed = self.stopped = False
        build = KvxferConnector.build_connector_meta

        def build_connector_meta(connector: Any, scheduler_output: Any) -> Any:
            meta = build(connector, scheduler_output)
            if self.armed and getattr(meta, "loads", None):
                os.kill(self.pid, signal.SIGSTOP)
                self.armed, self.stopped = False, True
            return meta

        KvxferConnector.build_connector_meta = build_connector_meta

    def resume(self) -> None:
        if self.stopped:
            os.kill(self.pid, signal.SIGCONT)
            self.stopped = False


def _record_copy_threads() -> list[int]:
    """Wrap cpu_gather's copies to note the intra-op thread count each ran with."""
    import torch
    from kvxfer_cpu_gather import CpuGatherContext

    seen: list[int] = []
    for name in ("gather", "scatter"):
        copy = getattr(CpuGatherContext, name)

        def recording(ctx: Any, copies: Any, transfer: Any, copy: Any = copy) -> Any:
            out = copy(ctx, copies, transfer)
            seen.append(torch.get_num_threads())
            return out

        setattr(CpuGatherContext, name, recording)
    return seen


def _engine_threads() -> dict[str, int]:
    """Intra-op threads of this (vLLM's) thread, and of a thread that first uses torch now."""
    import threading

    import torch

    fresh: list[int] = []
    t = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    t.start()
    t.join()
    return {"vllm": torch.get_num_threads(), "fresh": fresh[0]}


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {}
    conn = spec.get("connector")
    if conn is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvxferConnector",
            # by name alone, vLLM finds it through the vllm.general_plugins entry point
            kv_connector_module_path="kvxfer.integrations.vllm" if conn.get("by") == "module" else None,
            kv_role=conn.get("role", "kv_both"),
            kv_load_failure_policy=conn.get("failure_policy", "recompute"),
            kv_connector_extra_config=conn["extra"],
        )
    if spec.get("kv_cache_dtype"):  # "fp8": vLLM holds the KV cache as uint8
        kwargs["kv_cache_dtype"] = spec["kv_cache_dtype"]
    if spec.get("pooling"):  # an embedding model: its sequence pooling ("MEAN", "CLS", "LAST")
        kwargs.update(runner="pooling", convert="embed", pooler_config={"seq_pooling_type": spec["pooling"]})
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "float32"), max_model_len=spec.get("max_model_len", 2048),
              block_size=spec.get("block_size", 32), enforce_eager=True, disable_log_stats=False,
              enable_prefix_caching=spec.get("prefix_caching", True), seed=0, **kwargs)
    result: dict[str, Any] = {"startup_s": time.perf_counter() - t0, "batches": []}
    # vLLM's stat logger; the handler goes on after the engine set up vLLM's logging (which drops it)
    transfer_log: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda r: transfer_log.append(r.getMessage())  # type: ignore[method-assign]
    stat_log = logging.getLogger("vllm.v1.metrics.loggers")
    stat_log.addHandler(handler)
    stat_log.setLevel(logging.DEBUG)
    params = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 8))
    copy_threads = _record_copy_threads() if spec.get("record_copy_threads") else None
    if copy_threads is not None:
        result["engine_threads"] = {"before": _engine_threads()}
    stall = _Stall(spec["stall"]["pid"]) if spec.get("stall") else None
    for i, batch in enumerate(spec["batches"]):
        before = _counters(llm)
        t1 = time.perf_counter()
        if stall is not None:
            stall.armed = i == spec["stall"]["batch"]
        try:
            prompts = [TokensPrompt(prompt_token_ids=p) for p in batch]
            outs = llm.embed(prompts, use_tqdm=False) if spec.get("pooling") else \
                llm.generate(prompts, params, use_tqdm=False)
        finally:
            if stall is not None:
                stall.resume()
        wall = time.perf_counter() - t1
        _drain(llm)
        after = _counters(llm)
        transfer_log.clear()
        llm.llm_engine.do_log_stats()  # the periodic log line, now
        pooled = bool(spec.get("pooling"))
        result["batches"].append({
            "tokens": [] if pooled else [list(o.outputs[0].token_ids) for o in outs],
            "embeddings": [list(o.outputs.embedding) for o in outs] if pooled else [],
            "finish_reasons": [] if pooled else [o.outputs[0].finish_reason for o in outs],
            "stalled": stall is not None and i == spec["stall"]["batch"] and not stall.armed,
            "cached": [getattr(o, "num_cached_tokens", 0) for o in outs],
            "counters": {k: after[k] - before.get(k, 0.0) for k in after},
            "wall_s": wall,
            "kv_transfer_log": [line for line in transfer_log if line.startswith("KV Transfer metrics:")],
        })
    if copy_threads is not None:
        result["copy_threads"] = copy_threads
        result["engine_threads"]["after"] = _engine_threads()
    with open(spec["out"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
