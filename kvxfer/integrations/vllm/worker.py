"""The worker half of the connector, free of vLLM imports.

Per step, in vLLM's order: :meth:`handle_preemptions` (stores of preempted requests finish
before vLLM reuses their blocks) -> :meth:`start_load_kv` (submit retrieves) -> forward pass ->
:meth:`wait_for_save` (submit stores of the chunks the pass computed) -> :meth:`get_finished`
(poll the futures; report each finished load and each finished request's stores exactly once)
-> :meth:`get_block_ids_with_load_errors`.

Nothing here blocks on a transfer except the preemption flush and the stores of groups whose
blocks vLLM frees mid-request (sliding window: done before the next step's loads and forward
pass): loads complete between steps (vLLM schedules the request once ``finished_recving`` names
it) and other stores in the background (vLLM keeps a finished request's blocks until
``finished_sending`` names it).

Each KV cache group has its own registration (:mod:`kvxfer.integrations.vllm.groups`).

With ``kvxfer.layerwise`` the loads run inside the step instead: :meth:`start_load_kv` submits
them layer by layer (``by_layer=True``), :meth:`wait_for_layer_load` waits for one layer of
them (attention of layer i reads nothing before it has landed), :meth:`save_kv_layer` submits
the step's stores at its first call and declares each layer written as the pass produces it,
and :meth:`wait_for_save` declares the rest. Layer-wise loads are synchronous for vLLM: never
in ``finished_recving``; their failed blocks are reported by the same step's
:meth:`get_block_ids_with_load_errors`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, CancelledError, Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch

from kvxfer.client import CacheClient
from kvxfer.errors import ConfigError, InvalidRequest, KvxferError, TransportError, TransportFailed
from kvxfer.integrations.vllm.config import ConnectorConfig
from kvxfer.integrations.vllm.groups import GroupPlan, check_name_lengths
from kvxfer.integrations.vllm.link import REFUSED, ServerLink, check_transport_name
from kvxfer.integrations.vllm.logs import connected_line
from kvxfer.integrations.vllm.metadata import KvxferConnectorMetadata, LoadOp, StoreOp
from kvxfer.mq.throttled_log import ThrottledLog
from kvxfer.protocol.messages import RetrieveResult, StoreResult
from kvxfer.transport.contract import LayerwiseFuture, TransferContext

__all__ = ["WorkerConnector"]

log = logging.getLogger("kvxfer.integrations.vllm")


@dataclass(slots=True)
class _Load:
    op: LoadOp
    future: Future[RetrieveResult] | None
    block_size: int
    #: time.monotonic() past which the load is abandoned (0: never)
    deadline: float = 0.0
    #: cancelled at its deadline before its copy started: it wrote nothing
    abandoned: bool = False
    #: past its deadline, but its copy had started: waited for
    overdue: bool = False

    @property
    def done(self) -> bool:
        return self.future is None or self.abandoned or self.future.done()


class WorkerConnector:
    """Worker-side logic; one per vLLM worker (one GPU / rank)."""

    def __init__(self, config: ConnectorConfig, groups: list[GroupPlan] | None = None) -> None:
        self.config = config
        #: The KV cache groups moved (default: one, under kvxfer.model_name), by vLLM group id.
        self.groups = {g.index: g for g in (groups or [GroupPlan(0, config.model_name, config.block_size, ())])}
        check_transport_name(config.transport)
        #: One registered context per group, by vLLM group id.
        self.contexts: dict[int, TransferContext] = {}
        self._layers: dict[str, torch.Tensor] | None = None
        #: Per request, one load per group; reported finished when all are done.
        self._loads: dict[str, list[_Load]] = {}
        self._stores: dict[str, list[Future[StoreResult]]] = {}
        #: Stores that must be done before the next step's loads and forward pass.
        self._sync: list[Future[StoreResult]] = []
        #: Requests with stores since their last preemption (the scheduler tracks the same set).
        self._store_reqs: set[str] = set()
        #: Finished requests (from get_finished) whose stores are not all done yet.
        self._finishing: set[str] = set()
        self._unsent: list[StoreOp] = []
        self._load_errors: set[int] = set()
        self._failed_reqs: set[str] = set()
        #: Layer-wise mode: layer name -> (KV cache group, index of the layer in its registration);
        #: this step's loads, which the forward pass waits for layer by layer; this step's stores.
        self._layer_index: dict[str, tuple[int, int]] = {}
        self._step_loads: list[_Load] = []
        self._step_stores: list[tuple[int, LayerwiseFuture[StoreResult]]] = []
        self.stats = {"loads": 0, "loaded_chunks": 0, "loaded_bytes": 0, "load_failures": 0, "failed_load_blocks": 0,
                      "expired_loads": 0, "stores": 0, "stored_chunks": 0, "stored_bytes": 0, "present_chunks": 0,
                      "failed_store_chunks": 0, "dropped_stores": 0}
        #: each store in flight: (bytes of one chunk, chunks asked), for the figures once it is done
        self._store_sizes: dict[Future[StoreResult], tuple[int, int]] = {}
        #: Transfers a live server refused: a warning a second at most (a step may refuse many)
        self._refused = ThrottledLog(log)
        self.link = ServerLink(config, f"worker rank {config.rank}", self._on_connect)
        self.link.get(startup=True)

    def _on_connect(self, client: CacheClient) -> None:
        if self.config.chunk_size is not None and client.chunk_size != self.config.chunk_size:
            raise ConfigError(
                f"the kvxfer server at {client.url} uses chunk size {client.chunk_size} but "
                f"kvxfer.chunk_size is {self.config.chunk_size}; make them equal"
            )
        check_name_lengths(self.groups.values(), client)
        for ctx in self.contexts.values():
            if client.chunk_size != ctx.chunk_size:
                raise ConfigError(f"the kvxfer server at {client.url} restarted with another chunk size "
                                  f"({client.chunk_size}); restart vLLM or the server with the same one")
        if self.contexts:  # connected again: the client registered them anew
            self._log_connected(client, list(self.contexts))

    # ------------------------------------------------------------------ registration

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Register vLLM's per-layer KV tensors through the configured transport, one
        registration per KV cache group (at start-up; in ``recompute`` mode with no server, at
        the first step the server answers)."""
        self._layers = dict(kv_caches)
        for g in self.groups.values():
            missing = [n for n in g.layer_names if n not in self._layers]
            if missing or not self._group_layers(g):
                raise ConfigError(f"vLLM registered no KV tensors for layers {missing[:4] or list(g.layer_names)[:4]} "
                                  f"of KV cache group {g.index}; registered: {list(self._layers)[:8]}")
            self._layer_index.update({name: (g.index, i) for i, name in enumerate(self._group_layers(g))})
        self._ensure_contexts(startup=True)

    def _group_layers(self, g: GroupPlan) -> dict[str, torch.Tensor]:
        assert self._layers is not None
        if not g.layer_names:
            return self._layers
        return {n: self._layers[n] for n in g.layer_names if n in self._layers}

    def _ensure_contexts(self, startup: bool = False) -> dict[int, TransferContext] | None:
        """Every group's context, registering those not registered yet; None without a server.
        A registration the server refuses (a transport it does not load, a layout it does not
        take, another format than that of the chunks it holds under the same name) raises at
        start-up, and in a step under ``fail``; in a step under ``recompute`` (a server that came
        after start-up) it is a server error: logged, the cache off until ``kvxfer.retry_s`` has
        passed, the step's transfers reported as not done."""
        client = self.link.get(startup=startup)
        if client is None or self._layers is None:
            return None
        registered = []
        for g in self.groups.values():
            if g.index in self.contexts:
                continue
            layers = self._group_layers(g)
            try:
                try:
                    self.contexts[g.index] = client.register(
                        layers, model_name=g.name, block_size=g.block_size, world_size=self.config.world_size,
                        rank=self.config.rank, transport=self.config.transport, layout=self.config.layout)
                except InvalidRequest as exc:  # a live server that will never take this KV cache as it is
                    raise ConfigError(f"the kvxfer server at {client.url} refused this KV cache: {exc}") from exc
            except (ConfigError, TransportError) as exc:
                if startup:
                    raise
                self.link.failed(exc, "registering the KV caches")  # raises under fail
                return None
            except KvxferError as exc:
                self.link.failed(exc, "registering the KV caches")
                return None
            registered.append(g.index)
        if registered:
            self._log_connected(client, registered)
        return self.contexts

    def _log_connected(self, client: CacheClient, groups: list[int]) -> None:
        """One INFO line for this connection: the server, the transport and the instance of each
        KV cache group in ``groups``."""
        ctxs = [self.contexts[i] for i in groups]
        instances = []
        for i, ctx in zip(groups, ctxs, strict=True):
            n = len(self._group_layers(self.groups[i]))
            instances.append(f"instance {ctx.instance_id} (group {i}: {n} KV layer{'' if n == 1 else 's'} of "
                             f"{self.groups[i].name!r}, chunk {client.chunk_size} tokens)")
        transport = ", ".join(sorted({ctx.transport_name for ctx in ctxs}))
        log.info("%s", connected_line(f"worker rank {self.config.rank}", client.url, client.server_version,
                                      transport, ", ".join(instances)))

    def _usable(self, meta: KvxferConnectorMetadata) -> dict[int, TransferContext] | None:
        ctxs = self._ensure_contexts()
        if ctxs is None:
            return None
        for ctx in ctxs.values():
            if meta.chunk_size != ctx.chunk_size:
                log.error("kvxfer: scheduler planned chunks of %d tokens, the server uses %d; skipping transfers",
                          meta.chunk_size, ctx.chunk_size)
                return None
        return ctxs

    # ------------------------------------------------------------------ per step

    def handle_preemptions(self, meta: KvxferConnectorMetadata) -> None:
        """Wait for the pending stores of requests preempted this step (vLLM is about to reuse
        their blocks), and for the stores of the previous step that read blocks vLLM may free
        mid-request. Idempotent: start_load_kv calls it too, for runners that do not."""
        sync, self._sync = self._sync, []
        for fut in sync:  # accounted for in get_finished, like every store
            try:
                fut.result(timeout=self.config.timeout_s * 2 + 5)
            except Exception:  # noqa: BLE001  (reported when the store is settled in get_finished)
                if not fut.done():  # the wait ended (a store that failed with RequestTimeout is done)
                    self._give_up_store(fut, "a store of a sliding-window group")
        for rid in meta.preempted:
            for fut in self._stores.pop(rid, []):
                self._settle_store(fut, wait=True)
            self._store_reqs.discard(rid)
            self._finishing.discard(rid)

    def start_load_kv(self, meta: KvxferConnectorMetadata) -> None:
        """Submit this step's retrieves; note its stores (submitted by wait_for_save)."""
        self.handle_preemptions(meta)
        self._store_reqs.update(op.req_id for op in meta.stores)
        if self._unsent:  # the last step's stores never saw a wait_for_save (a vLLM that skips it)
            self.stats["dropped_stores"] += len(self._unsent)
        self._unsent = list(meta.stores)
        if not meta.loads:
            return
        ctxs = self._usable(meta) if self.config.loads else None
        for op in meta.loads:
            g = self.groups.get(op.group)
            ctx = ctxs.get(op.group) if ctxs is not None else None
            bs = g.block_size if g is not None else self.config.block_size
            fut = None
            if op.keys and ctx is not None:
                try:
                    fut = ctx.submit_retrieve(op.keys, op.block_ids, skip_first_n_tokens=op.skip_tokens,
                                              lease_id=op.lease_id, by_layer=self.config.layerwise)
                except ConfigError:
                    log.exception("kvxfer: cannot load request %s", op.req_id)
            if op.keys and fut is None:  # no server or a bad op: vLLM recomputes these blocks
                op.failed_block_ids.extend(_unskipped(op, range(len(op.keys)), bs))
                self.link.release_lease(op.lease_id)
            deadline = time.monotonic() + self.config.load_timeout_s if self.config.load_timeout_s else 0.0
            if self.config.layerwise:
                self._step_loads.append(_Load(op, fut, bs, deadline))
            else:
                self._loads.setdefault(op.req_id, []).append(_Load(op, fut, bs, deadline))
            self.stats["loads"] += 1

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer-wise mode, before attention of ``layer_name`` reads the KV cache: wait until that
        layer of this step's loads of its KV cache group has landed. A load that fails, or misses
        its deadline (``kvxfer.load_timeout_ms``, else twice ``kvxfer.timeout_s`` plus 5 s), is reported
        at the end of the step: every block it was to fill counts as failed."""
        where = self._layer_index.get(layer_name)
        if where is None:
            return
        group, i = where
        for load in self._step_loads:
            if load.future is None or load.abandoned or load.overdue or load.op.group != group:
                continue
            assert isinstance(load.future, LayerwiseFuture)
            limit = self.config.timeout_s * 2 + 5
            if load.deadline:
                limit = max(0.0, load.deadline - time.monotonic())
            try:
                load.future.wait_layer(i, timeout=limit)
            except KvxferError:
                if not load.future.done():  # its deadline: cancel it, or it is read before it landed
                    self._expire(load)
                    load.overdue = not load.abandoned
            except CancelledError:
                pass  # cancelled by _server_failed: reported when the step's loads are settled

    def save_kv_layer(self, layer_name: str) -> None:
        """Layer-wise mode, after attention of ``layer_name`` wrote its KV: submit the step's stores
        (first call of the step), then declare that layer of its KV cache group written."""
        where = self._layer_index.get(layer_name)
        if where is None or (not self._unsent and not self._step_stores):
            return
        if self._unsent:
            unsent, self._unsent = self._unsent, []
            ctxs = self._ensure_contexts() if self.config.stores else None
            if ctxs is None:
                self.stats["dropped_stores"] += len(unsent)
                return
            for op in unsent:
                fut = self._submit_store(ctxs, op, by_layer=True)
                if fut is not None:
                    assert isinstance(fut, LayerwiseFuture)
                    self._step_stores.append((op.group, fut))
        group, i = where
        mine = [fut for g, fut in self._step_stores if g == group]
        self._order_after_device(mine)
        for fut in mine:
            fut.layer_ready(i)

    def _submit_store(self, ctxs: dict[int, TransferContext], op: StoreOp,
                      by_layer: bool = False) -> Future[StoreResult] | None:
        ctx = ctxs.get(op.group)
        if ctx is None:
            log.error("kvxfer: a store of request %s names KV cache group %d, which has no registration",
                      op.req_id, op.group)
            self.stats["dropped_stores"] += 1
            return None
        try:
            fut = ctx.submit_store(op.keys, op.block_ids, by_layer=by_layer)
        except ConfigError:
            log.exception("kvxfer: cannot store request %s", op.req_id)
            self.stats["dropped_stores"] += 1
            return None
        self._stores.setdefault(op.req_id, []).append(fut)
        self._store_sizes[fut] = (self._chunk_bytes(op.group), len(op.keys))
        if op.sync:
            self._sync.append(fut)
        self.stats["stores"] += 1
        return fut

    def _order_after_device(self, futures: list[LayerwiseFuture[StoreResult]]) -> None:
        """Before declaring layers written: cuda_ipc and hpu order their copies after the work queued
        on the caller's stream (an event recorded in layer_ready); any other transport on a device
        copies on its own stream, so the device finishes the pass first."""
        if not futures or not self._layers or not self.contexts:
            return
        device = next(iter(self._layers.values())).device
        transport = next(iter(self.contexts.values())).transport_name
        if device.type != "cpu" and transport not in _ORDERED_BY_EVENT:
            _synchronize(device)

    def wait_for_save(self) -> None:
        """Submit the stores of chunks this step's forward pass computed (after the device has
        finished it); returns without waiting for the stores. Layer-wise: declare every layer of
        the step's stores written (those no save_kv_layer call declared)."""
        layered, self._step_stores = self._step_stores, []
        self._order_after_device([fut for _, fut in layered])
        for _, fut in layered:
            fut.all_layers_ready()
        unsent, self._unsent = self._unsent, []
        if not unsent:
            return
        ctxs = self._ensure_contexts() if self.config.stores else None
        if ctxs is None:
            self.stats["dropped_stores"] += len(unsent)
            return
        _synchronize(next(iter(self._layers.values())).device if self._layers else torch.device("cpu"))
        for op in unsent:
            self._submit_store(ctxs, op)

    def get_finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose stores are all done, requests whose load is done), each reported once.

        ``finished_req_ids`` are the requests vLLM finished since the last step; only those
        with stores are reported in the first set (exactly those for which the scheduler's
        ``request_finished`` returned True). vLLM may call it before the step's
        ``wait_for_save`` (its V1 model runner with speculative decoding finalizes after the
        drafter): a request whose store is not submitted yet is not reported then."""
        step_loads, self._step_loads = self._step_loads, []
        for load in step_loads:  # layer-wise: synchronous for vLLM, only their failed blocks are reported
            self._settle_load(load)
        self._yield_to_loads()
        recving: set[str] = set()
        now = time.monotonic()
        for rid, loads in list(self._loads.items()):
            for load in loads:
                if not load.done and load.deadline and now >= load.deadline:
                    self._expire(load)
            if all(load.done for load in loads):
                for load in loads:
                    self._settle_load(load)
                del self._loads[rid]
                recving.add(rid)
        for rid, futs in list(self._stores.items()):
            left = [f for f in futs if not self._settle_store(f, wait=False)]
            if left:
                self._stores[rid] = left
            else:
                del self._stores[rid]
        self._finishing.update(r for r in finished_req_ids if r in self._store_reqs)
        unsent = {op.req_id for op in self._unsent}
        sending = {rid for rid in self._finishing if rid not in self._stores and rid not in unsent}
        self._finishing -= sending
        self._store_reqs -= sending
        return sending or None, recving or None

    def _yield_to_loads(self) -> None:
        """While loads are pending and none has landed, wait up to LOAD_YIELD_S for one.

        A request waiting for its load has vLLM step again at once, with nothing else to run:
        that loop holds the GIL the load's own threads (copies, replies, commits) need, and a
        thread waiting for it gets it only at the interpreter's switch interval (5 ms). Measured
        with vLLM's CPU backend on a 2-core machine, a 28 MiB load then took ~0.3 s instead of
        a few ms. Waiting here releases the GIL, and costs a step nothing once a load has landed."""
        loads = [load for loads in self._loads.values() for load in loads]
        if loads and not any(load.done for load in loads):  # (a load without a future is done)
            wait([load.future for load in loads if load.future is not None], timeout=LOAD_YIELD_S,
                 return_when=FIRST_COMPLETED)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of finished loads that hold no valid KV (missing chunks, failed or abandoned
        transfers); reported no later than the get_finished call that reports their request.
        With several KV cache groups vLLM takes no block-level errors: see take_failed_loads."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_failed_loads(self) -> set[str]:
        """Requests reported finished whose load failed in part, with several KV cache groups
        (vLLM then recomputes the whole request: block ids are per group). Each reported once."""
        failed, self._failed_reqs = self._failed_reqs, set()
        return failed

    def _expire(self, load: _Load) -> None:
        """The load missed kvxfer.load_timeout_ms: cancel it if its copy has not started (then it
        never writes the blocks, and they are reported failed now); else it is waited for, since
        its blocks are not vLLM's to reuse until the copy ends (the copy itself is bounded: a local
        copy, or a server-driven request that the server drops once the client stops waiting)."""
        assert load.future is not None
        if load.future.cancel():
            load.abandoned = True
            self.link.release_lease(load.op.lease_id)  # a server-driven retrieve never sent never releases it
            self.stats["expired_loads"] += 1
            log.warning("kvxfer: the load of request %s missed its %.0f ms deadline; its %d chunks are reported "
                        "not loaded (vLLM's kv_load_failure_policy recomputes them or fails the request)",
                        load.op.req_id, self.config.load_timeout_s * 1000, len(load.op.keys))
        elif not load.overdue:
            load.overdue = True
            log.warning("kvxfer: the load of request %s passed its %.0f ms deadline while copying; waiting for the "
                        "copy to end", load.op.req_id, self.config.load_timeout_s * 1000)

    # ------------------------------------------------------------------ settling futures

    def _settle_load(self, load: _Load) -> None:
        op, bs = load.op, load.block_size
        bad = list(op.failed_block_ids)
        if load.abandoned:
            bad += _unskipped(op, range(len(op.keys)), bs)
        elif load.overdue and self.config.layerwise and load.future is not None:
            # attention read its blocks before they landed: none counts, once the copy has ended
            try:
                load.future.result()
            except (KvxferError, CancelledError):
                pass
            bad += _unskipped(op, range(len(op.keys)), bs)
        elif load.future is not None:
            try:
                res = load.future.result()
                bad += _unskipped(op, res.missing, bs)
                self.stats["loaded_chunks"] += len(res.loaded)
                self.stats["loaded_bytes"] += len(res.loaded) * self._chunk_bytes(op.group)
            except TransportFailed:  # the transport's copy failed: those blocks are reported not loaded
                log.exception("kvxfer: loading request %s failed", op.req_id)
                bad += _unskipped(op, range(len(op.keys)), bs)
            except REFUSED as exc:  # a live server refused this load: only it fails
                bad += _unskipped(op, range(len(op.keys)), bs)
                self._refused.warning("load", f"kvxfer: the server refused the load of request {op.req_id} ({exc}); "
                                      "vLLM computes its blocks")
            except KvxferError as exc:
                bad += _unskipped(op, range(len(op.keys)), bs)
                self._server_failed(exc, f"loading request {op.req_id}")
            except CancelledError:  # cancelled by _server_failed: the server is gone
                bad += _unskipped(op, range(len(op.keys)), bs)
        if bad:
            self.stats["load_failures"] += 1
            self.stats["failed_load_blocks"] += len(bad)
            if len(self.groups) > 1:
                self._failed_reqs.add(op.req_id)
            else:
                self._load_errors.update(bad)

    def _settle_store(self, fut: Future[StoreResult], wait: bool) -> bool:
        """Account for a done store (waiting for it when ``wait``); False if still pending."""
        if not wait and not fut.done():
            return False
        chunk_bytes, chunks = self._store_sizes.pop(fut, (0, 0))
        try:
            res = fut.result(timeout=self.config.timeout_s * 2 + 5 if wait else None)
        except TransportFailed:  # the transport's copy failed: the chunks are not stored
            log.exception("kvxfer: a store failed")
            self.stats["failed_store_chunks"] += chunks
            return True
        except REFUSED as exc:  # a live server refused this store (a limit, say): only it fails
            self.stats["failed_store_chunks"] += chunks
            self._refused.warning("store", f"kvxfer: the server refused a store of {chunks} chunks ({exc}); they are "
                                  "not stored")
            return True
        except KvxferError as exc:  # before FutureTimeout: RequestTimeout is a TimeoutError too
            self.stats["dropped_stores"] += 1  # the server failed it: nothing stored
            self._server_failed(exc, "storing KV")
            return True
        except CancelledError:  # cancelled by _server_failed (the server is gone), or given up on
            self.stats["dropped_stores"] += 1
            return True
        except FutureTimeout:
            if self._give_up_store(fut, "a store of a preempted request"):
                self.stats["dropped_stores"] += 1  # settled here: get_finished never sees it
            return True
        self.stats["stored_chunks"] += len(res.stored)
        self.stats["stored_bytes"] += len(res.stored) * chunk_bytes
        self.stats["present_chunks"] += len(res.present)
        self.stats["failed_store_chunks"] += len(res.failed)
        return True

    def _give_up_store(self, fut: Future[StoreResult], what: str) -> bool:
        """``fut`` is not done after the wait for it, and vLLM is about to reuse its blocks: it is
        cancelled, so that a store whose copy has not started (queued behind a stalled server)
        never reads them; True if it was. One whose copy started cannot be: a server-driven
        store was sent with its deadline, past which the server copies nothing; a client-driven
        one copies on this host and is done with the blocks within moments."""
        limit = self.config.timeout_s * 2 + 5
        if fut.cancel():
            log.warning("kvxfer: %s was not done after %.0f s: cancelled before its copy; nothing stored", what, limit)
            return True
        log.warning("kvxfer: %s was not done after %.0f s and its copy had started; its blocks may be reused",
                    what, limit)
        return False

    def _chunk_bytes(self, group: int) -> int:
        """Bytes of one chunk of KV cache group ``group`` (0 while it has no registration)."""
        ctx = self.contexts.get(group)
        return ctx.layout.chunk_bytes(ctx.chunk_size) if ctx is not None else 0

    def _server_failed(self, exc: BaseException, what: str) -> None:
        """The server failed a transfer: raise (``fail``), or go degraded and cancel the
        transfers still queued behind it, which would each wait ``kvxfer.timeout_s`` for a
        server that is gone (``recompute``)."""
        self.link.failed(exc, what)
        for futs in self._stores.values():
            for fut in futs:
                fut.cancel()
        for load in [*(ld for loads in self._loads.values() for ld in loads), *self._step_loads]:
            if load.future is not None and load.future.cancel():
                load.abandoned = True
                self.link.release_lease(load.op.lease_id)

    def shutdown(self) -> None:
        """Let submitted transfers finish, unregister, disconnect."""
        contexts, self.contexts = self.contexts, {}
        for ctx in contexts.values():
            ctx.close()
        self.link.close()


def _unskipped(op: LoadOp, chunk_indices: Iterable[int], block_size: int) -> list[int]:
    """Blocks of the given chunks of ``op`` that the load was to write (not vLLM's own)."""
    if not op.keys:
        return []
    bpc = len(op.block_ids) // len(op.keys)
    skip = op.skip_tokens // block_size
    out: list[int] = []
    for i in chunk_indices:
        out.extend(op.block_ids[max(i * bpc, skip):(i + 1) * bpc])
    return out


#: Transports whose copies wait for an event recorded on the caller's stream when it submits or
#: declares layers written (so a layer-wise store needs no device synchronization).
_ORDERED_BY_EVENT = frozenset({"cuda_ipc", "hpu"})
#: Longest a step's get_finished waits for a pending load to land (see _yield_to_loads).
LOAD_YIELD_S = 0.002


def _synchronize(device: torch.device) -> None:
    """Wait until the device finished the forward pass that wrote the blocks to store."""
    if device.type == "cpu":
        return
    mod = getattr(torch, device.type, None)
    sync = getattr(mod, "synchronize", None)
    if sync is not None:
        sync(device)
