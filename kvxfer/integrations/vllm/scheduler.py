"""The scheduler half of the connector, free of vLLM imports.

It reads vLLM's objects by attribute only (``Request``, ``KVCacheBlocks``, ``SchedulerOutput``;
see the Protocols below) and decides, per request:

* **what to load**: :meth:`get_num_new_matched_tokens` hashes the prompt's full chunks
  (salted with the request's ``cache_salt``, LoRA and multimodal inputs), asks the server how
  many leading chunks beyond vLLM's own prefix-cache hit it has (in its arena or its L2 tier),
  leases them so they are not evicted before the load, and has the server promote the L2 ones into
  its arena meanwhile (the load is asynchronous; its retrieve waits for chunks still on their
  way); :meth:`update_state_after_alloc` turns the lease into a :class:`LoadOp` on the blocks
  vLLM allocated;
* **what to store**: :meth:`build_connector_meta` emits a :class:`StoreOp` for every full
  prompt chunk once the step that computes it is scheduled (vLLM's prefix-cache hits included:
  the server skips chunks it has);
* **when blocks may be freed**: :meth:`request_finished` returns True for a request that had
  stores since it was last preempted; the workers report it in ``finished_sending`` once those
  stores are done. The workers track exactly the same set from the same metadata, so the two
  sides agree without talking.

Only prompt tokens are stored (generated tokens may be speculative or not yet known with async
scheduling); the prompt's last partial chunk is never stored.

Each KV cache group is looked up, loaded and stored on its own (see
:mod:`kvxfer.integrations.vllm.groups`): a hit counts the leading chunks every group has.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvxfer.client import CacheClient
from kvxfer.errors import ConfigError, KvxferError, NoSession
from kvxfer.hashing import chunk_hashes
from kvxfer.integrations.vllm.config import ConnectorConfig
from kvxfer.integrations.vllm.groups import NULL_BLOCK, GroupPlan, check_name_lengths
from kvxfer.integrations.vllm.identity import AdapterFingerprints
from kvxfer.integrations.vllm.link import REFUSED, ServerLink, check_transport_name
from kvxfer.integrations.vllm.logs import connected_line
from kvxfer.integrations.vllm.metadata import KvxferConnectorMetadata, LoadOp, StoreOp
from kvxfer.mq.throttled_log import ThrottledLog
from kvxfer.protocol.messages import MAX_CHUNKS_PER_REQUEST

__all__ = ["SchedulerConnector", "RequestLike"]

log = logging.getLogger("kvxfer.integrations.vllm")


class RequestLike(Protocol):
    """The attributes of vLLM's ``Request`` that the connector reads."""

    request_id: str
    prompt_token_ids: Sequence[int] | None

    @property
    def num_tokens(self) -> int: ...


@dataclass
class _ReqState:
    request: Any
    prompt_len: int
    groups: int
    hashes: list[bytes] | None = None
    #: The request's blocks per KV cache group (in the order of the connector's groups).
    block_ids: list[list[int]] = field(default_factory=list)
    #: Outcome of the last lookup, until update_state_after_alloc uses or drops it: one lease
    #: per group, and the chunks [lookup_first, lookup_end) every group has.
    leases: list[int] = field(default_factory=list)
    lookup_first: int = 0
    lookup_end: int = 0
    lookup_computed: int = 0
    lookup_tokens: int = 0
    #: When that lookup was answered (time.monotonic()), in which session of the client
    lookup_at: float = 0.0
    lookup_epoch: int = -1
    #: Per group: chunks [0, next_store) are stored, being stored or were loaded.
    next_store: list[int] = field(default_factory=list)
    #: Stores were sent since the request was last preempted (mirrored by the workers).
    has_stores: bool = False
    #: A load was planned since vLLM last reported the request preempted: vLLM asks again only
    #: when that load failed from its first block, and the request then computes its prefix.
    loaded: bool = False
    #: Its chunk hashes are of an epoch before the last reset_cache: it stores nothing more.
    stale: bool = False

    def __post_init__(self) -> None:
        self.block_ids = [[] for _ in range(self.groups)]
        self.next_store = [0] * self.groups

    @property
    def has_blocks(self) -> bool:
        return any(self.block_ids)


class SchedulerConnector:
    """Scheduler-side logic; one per vLLM engine (the scheduler process)."""

    def __init__(self, config: ConnectorConfig, groups: list[GroupPlan] | None = None, *,
                 moves_kv: bool = True, one_scheduler: bool = True) -> None:
        self.config = config
        #: False for a model whose prefill cannot start after a prefix (see the connector): its
        #: KV is neither looked up nor stored
        self.moves_kv = moves_kv
        #: Whether this is the engine's only scheduler (not so under vLLM's external launcher with
        #: several ranks: each runs its own, and they could not agree on a new epoch)
        self.one_scheduler = one_scheduler
        #: Mixed into every chunk hash; a new one at each reset_cache (vLLM's weights changed)
        self._epoch = ""
        self._adapters = AdapterFingerprints()
        #: The KV cache groups moved (default: one, under kvxfer.model_name).
        self.groups = groups or [GroupPlan(0, config.model_name, config.block_size, ())]
        check_transport_name(config.transport)
        self.chunk_size: int | None = config.chunk_size
        self._reqs: dict[str, _ReqState] = {}
        #: Blocks (of the one KV cache group) a load failed to fill, until a request writes them
        #: again: vLLM's prefix cache may hand them to other requests meanwhile
        self._bad_blocks: set[int] = set()
        self._loads: list[LoadOp] = []
        self._preempted: set[str] = set()
        self.stats = {"lookups": 0, "unanswered_lookups": 0, "lookup_tokens": 0, "lookup_hit_tokens": 0,
                      "loads": 0, "loads_not_offered_again": 0, "stores": 0, "store_chunks": 0}
        #: Lookups a live server refused: a warning a second at most
        self._refused = ThrottledLog(log)
        self.link = ServerLink(config, "scheduler", self._on_connect)
        self.link.get(startup=True)
        if not moves_kv:
            log.info("kvxfer: this model's prefill cannot start after a prefix (vLLM: pooling with MEAN or CLS "
                     "pooling, or bidirectional attention): kvxfer neither loads nor stores its KV")

    def _on_connect(self, client: CacheClient) -> None:
        expected = self.config.chunk_size or self.chunk_size
        if expected is not None and client.chunk_size != expected:
            raise ConfigError(
                f"the kvxfer server at {client.url} uses chunk size {client.chunk_size} but this vLLM "
                f"expects {expected} (kvxfer.chunk_size or the server it first met); restart the server "
                f"with --chunk-size {expected} or set kvxfer.chunk_size to {client.chunk_size}"
            )
        for g in self.groups:
            if client.chunk_size % g.block_size:
                raise ConfigError(
                    f"the kvxfer server at {client.url} uses chunk size {client.chunk_size}, not a multiple of "
                    f"vLLM's block size {g.block_size} (KV cache group {g.index}); restart it with --chunk-size a "
                    f"multiple of {g.block_size}"
                )
        check_name_lengths(self.groups, client)
        if client.max_lease_s and self.config.lease_s > client.max_lease_s:
            raise ConfigError(
                f"kvxfer.lease_s is {self.config.lease_s:g} s but the kvxfer server at {client.url} grants leases of "
                f"at most {client.max_lease_s:g} s (--max-lease): set kvxfer.lease_s to at most that, or restart "
                f"the server with a larger --max-lease"
            )
        self.chunk_size = client.chunk_size
        log.info("%s", connected_line("scheduler", client.url, client.server_version,
                                      f"{self.config.transport} (each worker registers through it)",
                                      f"chunk {client.chunk_size} tokens; instances are the workers'"))

    # ------------------------------------------------------------------ helpers

    def _state(self, request: Any) -> _ReqState:
        st = self._reqs.get(request.request_id)
        if st is None:
            prompt = getattr(request, "prompt_token_ids", None)
            st = _ReqState(request, len(prompt) if prompt is not None else 0, len(self.groups))
            self._reqs[request.request_id] = st
        return st

    def _hashes(self, st: _ReqState) -> list[bytes]:
        assert self.chunk_size is not None
        if st.hashes is None:
            prompt = getattr(st.request, "prompt_token_ids", None)
            epoch = f"epoch:{len(self._epoch)}:{self._epoch};" if self._epoch else ""
            salt = request_salt(st.request, self._adapters)
            st.hashes = chunk_hashes(prompt, self.chunk_size, salt=salt + epoch) \
                if prompt and self.moves_kv and tokens_name_its_kv(st.request) and salt is not None else []
        return st.hashes

    def _same_session(self, st: _ReqState) -> bool:
        """Whether the server that answered ``st``'s lookup is still the one talked to, in the same
        session (its leases then still hold: a restarted server's do not)."""
        client = self.link.client
        return client is not None and not self.link.down and client.epoch == st.lookup_epoch

    def _release_lease(self, st: _ReqState) -> None:
        leases, st.leases = st.leases, []
        st.lookup_end = st.lookup_first = st.lookup_tokens = 0
        self._release_leases(leases)

    def _release_leases(self, leases: list[int]) -> None:
        for lease in leases:
            self.link.release_lease(lease)

    # ------------------------------------------------------------------ vLLM's scheduler calls

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` that can be loaded, and whether the load is
        asynchronous (True; False with ``kvxfer.layerwise``: it runs in the step's forward pass).

        Leases the hits. vLLM asks again each step about a request it could not admit (no free
        blocks): while the last answer's lease has more than half its time left and vLLM's own
        hit is the same, that answer stands (no lookup, counted once); otherwise the previous
        lease goes and the server is asked again."""
        st = self._state(request)
        if st.has_blocks:  # asked again after it had blocks: it was preempted
            st.block_ids = [[] for _ in self.groups]
            st.has_stores = False
            self._preempted.add(request.request_id)
        elif (st.leases and st.lookup_end > st.lookup_first and st.lookup_computed == num_computed_tokens
              and time.monotonic() - st.lookup_at < self.config.lease_s / 2 and self._same_session(st)):
            return st.lookup_tokens - num_computed_tokens, not self.config.layerwise
        self._release_lease(st)
        if not self.config.loads:
            return 0, False
        if getattr(request, "skip_reading_prefix_cache", False):
            return 0, False  # vLLM would not read a hit (prompt logprobs, token-level pooling): none is leased
        if st.loaded:
            # its load failed (a server that stopped answering the worker, chunks gone): offering
            # the same hits again would have vLLM plan and fail loads in a loop, each holding a lease
            self.stats["loads_not_offered_again"] += 1
            return 0, False
        client = self.link.get()
        chunk = self.chunk_size
        if chunk is not None:
            hashes = self._hashes(st)
            first = num_computed_tokens // chunk
            if first >= len(hashes):
                return 0, False  # no whole chunk beyond vLLM's own hit: nothing to ask, with or without a server
        if client is None or chunk is None:  # no server (recompute mode): counted, not asked
            self.stats["unanswered_lookups"] += 1
            return 0, False
        hits = min(len(hashes) - first, MAX_CHUNKS_PER_REQUEST)  # (a longer prompt: its leading chunks)
        for g in self.groups:  # the chunks every group has; each group's lease keeps them
            if hits == 0:
                break
            try:
                try:
                    reply = client.lookup_and_lease(g.name, self.config.world_size, hashes=hashes[first:first + hits],
                                                    lease_s=self.config.lease_s, promote=True,
                                                    prefetch=self.config.prefetch)
                except NoSession:  # the server restarted: open a new session, check it, ask again
                    self.link.reconnect()
                    reply = client.lookup_and_lease(g.name, self.config.world_size,
                                                    hashes=hashes[first:first + hits], lease_s=self.config.lease_s,
                                                    promote=True, prefetch=self.config.prefetch)
            except REFUSED as exc:  # a live server refused this lookup (a limit, say): vLLM computes the prefix
                self._release_lease(st)
                self._refused.warning("lookup", f"kvxfer: the server refused the lookup of request "
                                      f"{request.request_id} ({exc}); vLLM computes its prefix")
                self.stats["unanswered_lookups"] += 1
                return 0, False
            except KvxferError as exc:
                self._release_lease(st)
                self.link.failed(exc, f"lookup for request {request.request_id}")  # raises in fail mode
                self.stats["unanswered_lookups"] += 1
                return 0, False
            st.leases.append(reply.lease_id)
            hits = min(hits, reply.hits)
        self.stats["lookups"] += 1
        self.stats["lookup_tokens"] += (len(hashes) - first) * chunk
        end = first + hits
        tokens = end * chunk
        if tokens >= request.num_tokens:
            # vLLM computes at least the last token itself. It allocates blocks for the tokens
            # we promise, so promising one token less still covers every block of the chunk,
            # except with single-token blocks: then drop the last chunk.
            if min(g.block_size for g in self.groups) == 1:
                end -= 1
                tokens = end * chunk
            else:
                tokens = request.num_tokens - 1
        if tokens <= num_computed_tokens or end <= first:
            self._release_lease(st)
            return 0, False
        st.lookup_first, st.lookup_end = first, end
        st.lookup_computed, st.lookup_tokens = num_computed_tokens, tokens
        st.lookup_at, st.lookup_epoch = time.monotonic(), client.epoch
        self.stats["lookup_hit_tokens"] += tokens - num_computed_tokens
        # layer-wise: the load runs inside this step's forward pass (synchronous for vLLM)
        return tokens - num_computed_tokens, not self.config.layerwise

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Turn the request's lookup into a load per group on the blocks vLLM allocated for it."""
        st = self._state(request)
        if num_external_tokens <= 0:
            self._release_lease(st)
            return
        if st.lookup_end <= st.lookup_first or self.chunk_size is None:
            log.warning("kvxfer: vLLM asked to load %d tokens of request %s that kvxfer did not offer",
                        num_external_tokens, request.request_id)
            return
        if st.lookup_computed + num_external_tokens != st.lookup_tokens:
            log.warning("kvxfer: request %s: vLLM allocated %d external tokens, kvxfer offered %d",
                        request.request_id, num_external_tokens, st.lookup_tokens - st.lookup_computed)
        chunk, first, end = self.chunk_size, st.lookup_first, st.lookup_end
        all_ids = blocks.get_block_ids()
        keys = self._hashes(st)[first:end]
        for pos, g in enumerate(self.groups):
            bs, bpc = g.block_size, chunk // g.block_size
            wanted = list(group_blocks(all_ids, g.index))[first * bpc:end * bpc]
            # vLLM computed the first tokens itself; a sliding-window group holds the null block
            # where its window no longer reaches: those blocks are not loaded
            skip = (st.lookup_computed - first * chunk) // bs
            while g.frees_early and skip < len(wanted) and wanted[skip] == NULL_BLOCK:
                skip += 1
            failed: list[int] = []
            op_keys = keys
            lease = st.leases[pos] if pos < len(st.leases) else 0
            if len(wanted) < (end - first) * bpc or (g.frees_early and NULL_BLOCK in wanted[skip:]):
                # not the blocks promised: load nothing, report them (the lease goes back now: no
                # retrieve will name it)
                failed = [b for b in wanted[skip:] if not (g.frees_early and b == NULL_BLOCK)]
                op_keys, wanted, skip = [], [], 0
                self._release_leases([lease])
                lease = 0
            self._loads.append(LoadOp(request.request_id, op_keys, wanted, skip * bs, lease, failed, group=g.index))
            if op_keys and len(self.groups) == 1:  # filled by the load (reported again if it fails)
                self._bad_blocks.difference_update(wanted[skip:])
            st.next_store[pos] = max(st.next_store[pos], end)
        st.leases = []  # the loads' retrieves release them
        st.lookup_end = st.lookup_first = st.lookup_tokens = 0
        st.loaded = True
        self.stats["loads"] += 1

    def build_connector_meta(self, scheduler_output: Any) -> KvxferConnectorMetadata:
        """This step's loads (from update_state_after_alloc), stores (full prompt chunks that
        this step's forward pass completes) and preempted requests."""
        meta = KvxferConnectorMetadata(chunk_size=self.chunk_size or 0)
        meta.loads, self._loads = self._loads, []
        loading = self._loading_blocks(meta.loads)
        loading_reqs = {op.req_id for op in meta.loads if op.keys}
        cached = scheduler_output.scheduled_cached_reqs
        resumed = resumed_req_ids(cached)
        by_vllm = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        preempted = by_vllm | self._preempted | resumed
        self._preempted = set()
        for rid in by_vllm:  # its blocks are gone: its prefix may be loaded again
            st = self._reqs.get(rid)
            if st is not None:
                st.loaded = False
        for rid in preempted:
            st = self._reqs.get(rid)
            if st is not None:
                st.has_stores = False
                if rid not in resumed:
                    st.block_ids = [[] for _ in self.groups]
        meta.preempted = sorted(preempted)
        num_scheduled = scheduler_output.num_scheduled_tokens
        written: list[tuple[str, _ReqState, int, int]] = []  # (request, its state, computed before the step, after)
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = [list(group_blocks(new.block_ids, g.index)) for g in self.groups]
            self._check_bad(st, new.num_computed_tokens, loading)
            written.append((new.req_id, st, new.num_computed_tokens,
                            new.num_computed_tokens + num_scheduled.get(new.req_id, 0)))
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in resumed:
                st.block_ids = [list(group_blocks(new_ids, g.index)) if new_ids is not None else []
                                for g in self.groups]
                self._check_bad(st, cached.num_computed_tokens[i], loading)
            elif new_ids is not None:
                for pos, g in enumerate(self.groups):
                    st.block_ids[pos].extend(group_blocks(new_ids, g.index))
            before = cached.num_computed_tokens[i]
            written.append((rid, st, before, before + num_scheduled.get(rid, 0)))
        for rid, st, _, after in written:
            self._plan_store(rid, st, after, meta, loading, loading_reqs)
        if self._bad_blocks:  # the blocks this step fills up hold new KV (vLLM truncates a failed request to a
            # block's start: a block a request starts mid-way, it began itself)
            bs = self.groups[0].block_size
            for _, st, before, after in written:
                self._bad_blocks.difference_update(st.block_ids[0][before // bs:after // bs])
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """vLLM reports the blocks that loads failed to fill (``invalid_block_ids``; block-level
        reports come only from models with one KV cache group). A layer-by-layer load's blocks
        are in vLLM's prefix cache from its step on: other requests may have taken them as
        computed, and vLLM leaves those requests counting them so while one request computes
        them again (or never, if that one is aborted); later ones may take them too. Every
        request holding one stores nothing more (its KV attends to garbage), and so does every
        request that takes one as computed before a request has written it again."""
        bad = getattr(connector_output, "invalid_block_ids", None)
        if not bad or len(self.groups) != 1:
            return
        self._bad_blocks.update(bad)
        for st in self._reqs.values():
            if not self._bad_blocks.isdisjoint(st.block_ids[0]):
                st.stale = True

    def _check_bad(self, st: _ReqState, computed: int, loading: dict[int, set[int]]) -> None:
        """A request (new, or resumed) whose first ``computed`` tokens vLLM counts as computed:
        if their blocks include one a load failed to fill and no request wrote since, it stores
        nothing (the blocks a load of this step fills are written anew: not counted)."""
        if not self._bad_blocks or len(self.groups) != 1:
            return
        g = self.groups[0]
        hit = -(-computed // g.block_size)
        taken = set(st.block_ids[0][:hit]) - loading.get(g.index, set())
        if not self._bad_blocks.isdisjoint(taken):
            st.stale = True
        self._bad_blocks.difference_update(st.block_ids[0][hit:])  # allocated afresh: written before read

    def _loading_blocks(self, loads: list[LoadOp]) -> dict[int, set[int]]:
        """Per KV cache group, the blocks this step's loads write (past what vLLM computed)."""
        sizes = {g.index: g.block_size for g in self.groups}
        out: dict[int, set[int]] = {}
        for op in loads:
            if op.keys:
                out.setdefault(op.group, set()).update(op.block_ids[op.skip_tokens // sizes.get(op.group, 1):])
        return out

    def reset_cache(self) -> None:
        """vLLM reset its caches (its weights may have changed): a new, random epoch in every
        chunk hash from now on (the requests under way included), so that nothing stored before
        is looked up again, and no store for the requests under way, whose KV may be of the old
        weights. Where each rank runs a scheduler of its own (vLLM's external launcher), their
        epochs would differ and no chunk would be whole across ranks: the cache is off instead."""
        self._epoch = secrets.token_hex(8)
        for st in self._reqs.values():
            self._release_lease(st)
            st.stale = True
            st.hashes = None
        if not self.one_scheduler and self.moves_kv:
            self.moves_kv = False
            log.warning("kvxfer: vLLM reset its prefix cache, and each rank runs its own scheduler (external "
                        "launcher): the ranks cannot agree on which chunks are of the new weights, so kvxfer "
                        "neither loads nor stores from now on (restart the engines to use the cache again)")
            return
        log.info("kvxfer: vLLM reset its prefix cache: chunks stored before are no longer looked up")

    def _plan_store(self, rid: str, st: _ReqState, computed: int, meta: KvxferConnectorMetadata,
                    loading: dict[int, set[int]], loading_reqs: set[str]) -> None:
        """Stores of the full prompt chunks that ``computed`` tokens complete, per group; chunks
        whose blocks a sliding-window group no longer holds (the null block) are passed over.
        A chunk whose blocks a load of this step writes (another request's layer-by-layer load,
        whose blocks vLLM's prefix cache shares at once) ends the store there: the store would
        read them in the step that fills them, and read garbage if that load fails. It is
        planned again in a later step (once the load landed, or the blocks were recomputed). So
        is every chunk of a request whose own load is in this step (``loading_reqs``): they attend
        to the blocks that load fills."""
        if not self.config.stores or self.chunk_size is None or st.stale or rid in loading_reqs:
            return
        chunk = self.chunk_size
        hashes = self._hashes(st)
        for pos, g in enumerate(self.groups):
            bpc = chunk // g.block_size
            ids = st.block_ids[pos]
            upto = min(min(computed, st.prompt_len) // chunk, len(hashes), len(ids) // bpc)
            if upto <= st.next_store[pos]:
                continue
            keys: list[bytes] = []
            blocks: list[int] = []
            filling = loading.get(g.index)
            for c in range(st.next_store[pos], upto):
                chunk_blocks = ids[c * bpc:(c + 1) * bpc]
                if filling and not filling.isdisjoint(chunk_blocks):
                    upto = c
                    break
                if not (g.frees_early and NULL_BLOCK in chunk_blocks):
                    keys.append(hashes[c])
                    blocks.extend(chunk_blocks)
            st.next_store[pos] = upto
            if not keys:
                continue
            for k in range(0, len(keys), MAX_CHUNKS_PER_REQUEST):  # (more chunks than a request may name: in parts)
                part = keys[k:k + MAX_CHUNKS_PER_REQUEST]
                meta.stores.append(StoreOp(rid, part, blocks[k * bpc:(k + len(part)) * bpc], group=g.index,
                                           sync=g.frees_early))
                self.stats["stores"] += 1
            self.stats["store_chunks"] += len(keys)
            st.has_stores = True

    def request_finished(self, request: Any, block_ids: Any = None) -> tuple[bool, dict[str, Any] | None]:
        """True while the request's stores may still read its blocks (freed after the
        workers report it in ``finished_sending``). ``block_ids``: one list, or one per group."""
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        self._release_lease(st)
        return st.has_stores, None

    def shutdown(self) -> None:
        for st in self._reqs.values():
            self._release_lease(st)
        self.link.close()


# --------------------------------------------------------------------------- helpers


def group_blocks(block_ids: Any, group: int) -> Sequence[int]:
    """Block ids of KV cache group ``group`` from vLLM's ``tuple[list[int], ...]`` (a flat list
    is group 0's)."""
    if not block_ids:
        return []
    head = block_ids[0]
    if not isinstance(head, (list, tuple)):
        return block_ids if group == 0 else []
    return block_ids[group] if group < len(block_ids) else []


def resumed_req_ids(cached: Any) -> set[str]:
    """Requests resumed from preemption this step (``resumed_req_ids`` in recent vLLM,
    ``resumed_from_preemption`` flags in older ones)."""
    ids = getattr(cached, "resumed_req_ids", None)
    if ids is not None:
        return set(ids)
    flags = getattr(cached, "resumed_from_preemption", None) or ()
    return {rid for rid, flag in zip(cached.req_ids, flags, strict=False) if flag}


def request_salt(request: Any, adapters: AdapterFingerprints) -> str | None:
    """What besides the tokens decides a request's KV: its ``cache_salt``, its LoRA adapter (its
    name and path, as vLLM's own prefix cache keys it: a name pointed at another adapter is
    another cache; and, since chunks outlive the engine and are shared between hosts, the
    adapter's weights, as ``adapters`` knows them) and its multimodal inputs (placeholder tokens
    alone do not name an image). Each part is written with its length, so that no salt can
    spell another's parts. None: the request's KV is not to be moved (an adapter whose version
    is not known)."""
    parts: list[tuple[str, object]] = []
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(("salt", salt))
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(("lora", getattr(lora, "lora_name", None) or getattr(lora, "lora_int_id", lora)))
        path = getattr(lora, "lora_path", None) or getattr(lora, "path", None)
        parts.append(("lora_path", path))
        if isinstance(path, str) and path:
            fingerprint = adapters.get(path)
            if fingerprint is None:
                return None
            parts.append(("lora_weights", fingerprint))
    mm: Iterable[Any] = getattr(request, "mm_features", None) or ()
    for feature in mm:
        ident = getattr(feature, "identifier", None) or getattr(feature, "mm_hash", None)
        pos = getattr(getattr(feature, "mm_position", None), "offset", None)
        parts.append(("mm", f"{ident}@{pos}"))
    return "".join(f"{kind}:{len(text)}:{text};" for kind, text in ((k, str(v)) for k, v in parts))


def tokens_name_its_kv(request: Any) -> bool:
    """Whether the connector may load or store ``request``'s KV: not when its prompt comes as
    embeddings (in whole or in part), since the token ids then do not say what was computed."""
    return getattr(request, "prompt_embeds", None) is None
