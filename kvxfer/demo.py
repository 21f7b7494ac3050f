"""`kvxfer demo`: the main job, end to end on one machine.

Starts a server (unless ``--url`` names one), registers a realistic paged KV cache (32 layers,
flash-attention layout ``[2, num_blocks, 16, 8, 128]``, bf16) through a transport, stores the
chunks of a few prompts (two of which share a prefix, so the second store skips the shared
chunks), looks them up, retrieves them into other blocks, verifies every byte, prints a report
and stops the server.

``--nodes 2`` runs the two-host story on one machine: a private L2 store (Valkey, from the
``kvxfer-valkey`` plugin's local instance) and two servers with separate arenas standing in for
hosts A and B. The prompts are stored on A, reach L2 through A's writers, and are loaded on B
(looked up across B's tiers, promoted into B's arena, retrieved into B's own KV cache); every
byte is checked against A's. Then A is killed, as a crash would, and started again: its arena is
empty, and its lookups find every chunk in L2.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

import torch

from kvxfer.bench import check_kv_fits
from kvxfer.client import CacheClient
from kvxfer.errors import ConfigError, LimitExceeded
from kvxfer.hashing import chunk_hashes
from kvxfer.layout import KVLayout, LayoutKind
from kvxfer.transport.contract import TransferContext
from kvxfer.units import format_bytes

if TYPE_CHECKING:
    from kvxfer.testing.server import ServerProcess

__all__ = ["run_demo"]

BLOCK_SIZE = 16
HEADS, HEAD_SIZE = 8, 128


def run_demo(args: argparse.Namespace) -> int:
    from kvxfer.testing.server import ServerProcess, transports_for

    nodes = getattr(args, "nodes", 1)
    if nodes == 2:
        if args.url is not None:
            raise ConfigError("--url: the two-host demo starts its own servers and L2 store; leave --url out, "
                              "or run the one-host demo (--nodes 1) against that server")
        return run_two_hosts(args)
    if nodes != 1:
        raise ConfigError(f"--nodes {args.nodes}: the demo runs 1 host, or 2 sharing an L2 store")
    if getattr(args, "l2", None) is not None:
        raise ConfigError("--l2: only the two-host demo (--nodes 2) uses an L2 store; a server of your own "
                          "takes it as `kvxfer serve --l2`")
    server = None
    url = args.url
    if url is None:
        transports = transports_for(args.transport)  # an unknown name is refused before the arena is made
        print(f"starting a kvxfer server (arena {args.l1_size}) ...", flush=True)
        server = ServerProcess(l1_size=args.l1_size, transports=transports).start()
        url = server.url
    try:
        return _demo(url, args)
    finally:
        if server is not None:
            code = server.stop()
            print(f"server stopped (exit code {code})")


def _demo(url: str, args: argparse.Namespace) -> int:
    from kvxfer.cli import client_curve

    client = CacheClient(url, name="kvxfer demo", curve=client_curve(args))
    try:  # a demo that fails still ends its session (the server would wait for it to time out)
        return _demo_with(client, url, args)
    finally:
        client.close()


def demo_model_name(layers: int) -> str:
    """The model name the demo stores under: one per KV layout (a server keeps one chunk format
    per name, and demos of other --layers may share it)."""
    return "demo-llama-8b" if layers == 32 else f"demo-llama-8b-{layers}-layers"


def _demo_with(client: CacheClient, url: str, args: argparse.Namespace) -> int:
    cs = client.chunk_size
    bpc = cs // BLOCK_SIZE
    tokens_per_prompt = args.prompt_tokens // cs * cs
    chunks_per_prompt = tokens_per_prompt // cs
    if not chunks_per_prompt:
        raise ConfigError(f"--prompt-tokens {args.prompt_tokens}: a prompt must hold at least one chunk "
                          f"({cs} tokens at this server)")
    num_blocks = max(args.blocks, 2 * args.prompts * chunks_per_prompt * bpc)
    layout = KVLayout(LayoutKind.FLASH_ATTN, args.layers, num_blocks, BLOCK_SIZE, HEADS * HEAD_SIZE, torch.bfloat16)
    check_kv_fits(layout, HEADS, torch.device("cpu"))
    print(f"server {client.server_version} at {url}: chunk size {cs} tokens, transports "
          f"{', '.join(client.server_transports)}")
    print(f"KV cache: {args.layers} layers x {list(layout.layer_shape(HEADS))} bf16 "
          f"({format_bytes(args.layers * 2 * num_blocks * layout.row_bytes)}); "
          f"one chunk = {format_bytes(layout.chunk_bytes(cs))}")

    gen = torch.Generator().manual_seed(1234)
    kv = [torch.empty(layout.layer_shape(HEADS), dtype=torch.bfloat16) for _ in range(args.layers)]
    for layer in kv:  # random bits (NaN patterns too): the check below compares bytes
        layer.view(torch.int16).random_(generator=gen)
    model = demo_model_name(args.layers)
    ctx = client.register(kv, model_name=model, block_size=BLOCK_SIZE, transport=args.transport)
    print(f"registered through {ctx.transport_name} as instance {ctx.instance_id}")
    try:
        return _store_and_load(client, ctx, model, layout, kv, gen, cs, tokens_per_prompt, num_blocks, args)
    finally:
        ctx.close()


def _store_and_load(client: CacheClient, ctx: TransferContext, model: str, layout: KVLayout, kv: list[torch.Tensor],
                    gen: torch.Generator, cs: int, tokens_per_prompt: int, num_blocks: int,
                    args: argparse.Namespace) -> int:
    """Store the prompts' chunks, look them up, load them into other blocks, check, report."""
    bpc = cs // BLOCK_SIZE
    chunks_per_prompt = tokens_per_prompt // cs

    # Prompts: prompt 1 repeats the first half of prompt 0 (a shared system prompt), so half of its
    # chunks are already stored when it comes.
    prompts = [torch.randint(0, 128_000, (tokens_per_prompt,), generator=gen).tolist() for _ in range(args.prompts)]
    if args.prompts > 1:
        half = tokens_per_prompt // 2 // cs * cs
        prompts[1][:half] = prompts[0][:half]
    # Each prompt's blocks are a random set: a paged cache is fragmented.
    perm = torch.randperm(num_blocks, generator=gen)
    need = chunks_per_prompt * bpc
    src_blocks = [perm[i * need:(i + 1) * need] for i in range(args.prompts)]
    dst_blocks = [perm[(args.prompts + i) * need:(args.prompts + i + 1) * need] for i in range(args.prompts)]
    if args.prompts > 1:  # an engine computes the same KV for the same prefix
        shared = layout.rows(src_blocks[0][:half // BLOCK_SIZE]), layout.rows(src_blocks[1][:half // BLOCK_SIZE])
        for layer in kv:
            rows = layout.row_view(layer)
            rows[shared[1]] = rows[shared[0]]
    hashes = [chunk_hashes(p, cs) for p in prompts]

    stored = present = 0
    t = time.perf_counter()
    for h, blocks in zip(hashes, src_blocks):
        try:
            res = ctx.submit_store(h, blocks).result(timeout=120)
        except LimitExceeded as exc:  # a session may hold at most the arena: one prompt is more
            raise ConfigError(f"one prompt's chunks ({format_bytes(chunks_per_prompt * layout.chunk_bytes(cs))}) "
                              f"do not fit the server's arena: give it a larger --l1-size, or ask for fewer "
                              f"--layers or --prompt-tokens ({exc})") from None
        stored += len(res.stored)
        present += len(res.present)
        if res.failed:
            print(f"  warning: {len(res.failed)} chunks did not fit in the arena")
    store_s = time.perf_counter() - t
    store_bytes = stored * layout.chunk_bytes(cs)

    hits = [client.lookup(model, 1, hashes=h) for h in hashes]
    unseen = chunk_hashes(torch.randint(0, 128_000, (tokens_per_prompt,), generator=gen).tolist(), cs)
    miss = client.lookup(model, 1, hashes=unseen)

    loaded = 0
    t = time.perf_counter()
    for h, n, blocks in zip(hashes, hits, dst_blocks):
        got = ctx.submit_retrieve(h[:n], blocks[:n * bpc]).result(timeout=120)
        loaded += len(got.loaded)
    retrieve_s = time.perf_counter() - t
    retrieve_bytes = loaded * layout.chunk_bytes(cs)

    # what was loaded must match what was stored, byte for byte (chunks evicted before their
    # load were not loaded: they are reported below, not compared)
    ok = all(
        torch.equal(layout.row_view(layer).view(torch.uint8)[layout.rows(s[:n * bpc])],
                    layout.row_view(layer).view(torch.uint8)[layout.rows(d[:n * bpc])])
        for layer in kv for s, d, n in zip(src_blocks, dst_blocks, hits)
    )
    st = client.status()

    print()
    print(f"prompts: {args.prompts} x {tokens_per_prompt} tokens = {args.prompts * chunks_per_prompt} chunks")
    print(f"store:    {stored} chunks written, {present} already present (shared prefix) "
          f"in {store_s * 1e3:.0f} ms = {store_bytes / store_s / 1e9:.1f} GB/s")
    print(f"lookup:   hits per prompt {hits} of {chunks_per_prompt}; an unseen prompt: {miss}")
    print(f"retrieve: {loaded} chunks into other blocks in {retrieve_s * 1e3:.0f} ms = "
          f"{retrieve_bytes / retrieve_s / 1e9:.1f} GB/s")
    print(f"verify:   {'every byte loaded matches' if ok else 'MISMATCH'}")
    asked = args.prompts * chunks_per_prompt
    if sum(hits) < asked:
        distinct = asked - present  # the shared prefix is stored once
        print(f"          {asked - sum(hits)} chunks were evicted before their load: the arena "
              f"({format_bytes(st.arena.capacity)}) holds fewer than the demo's {distinct} chunks "
              f"({format_bytes(distinct * layout.chunk_bytes(cs))}); give the server a larger --l1-size, "
              "or ask for fewer --layers or --prompts")
    print(f"server:   {st.arena.chunks} chunks, {format_bytes(st.arena.used)} of "
          f"{format_bytes(st.arena.capacity)} used, lookup hit rate "
          f"{100 * st.lookup_hits / max(1, st.lookup_chunks):.0f}% of every chunk it was asked for "
          "(the unseen prompt's too)")
    return 0 if ok and miss == 0 and all(n == chunks_per_prompt for n in hits) else 1


#: The two-host demo's servers' --l2-timeout: a lookup's L2 check on a busy machine (a test run
#: beside it) may take longer than the default, and the demo checks every chunk.
L2_TIMEOUT_S = 5.0


def run_two_hosts(args: argparse.Namespace) -> int:
    """``kvxfer demo --nodes 2``: store on host A, load on host B through a shared L2 store."""
    import tempfile
    from pathlib import Path

    from kvxfer.store import LocalInstance, get_store, password_apart
    from kvxfer.testing.server import ServerProcess, transports_for

    transports = transports_for(args.transport)  # an unknown name is refused before anything starts
    store = get_store(args.l2 or "valkey")
    if not store.capabilities.shared or not isinstance(store, LocalInstance):
        raise ConfigError(f"--l2 {store.name}: the two-host demo needs a store that several servers share and that can "
                          "start a local instance of itself, as valkey does (--l2 valkey)")
    with tempfile.TemporaryDirectory(prefix="kvxfer-demo-") as tmp, store.local_instance(Path(tmp)) as url:
        print(f"L2: a private {store.name} at {store.redact(url)}")
        url, env = password_apart(url)  # off the servers' command lines
        l2 = ["--l2", store.name, "--l2-url", url, f"--l2-timeout={L2_TIMEOUT_S:g}"]
        print(f"starting host A and host B (kvxfer servers, arena {args.l1_size} each) ...", flush=True)
        with ServerProcess(l1_size=args.l1_size, transports=transports, extra_args=l2, env=env) as a, \
                ServerProcess(l1_size=args.l1_size, transports=transports, extra_args=l2, env=env) as b:
            return _two_hosts(a, b.url, args)



def _wait_l2(client: CacheClient, writes: int, timeout: float = 120.0) -> float:
    t0 = time.perf_counter()
    while True:
        t = client.status().tiers[0]
        if t.writes + t.write_skipped + t.drops >= writes and t.queue_depth == 0:
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"L2 writes did not finish in {timeout:.0f} s: {t}")
        time.sleep(0.005)


def _two_hosts(a: ServerProcess, url_b: str, args: argparse.Namespace) -> int:
    ca, cb = CacheClient(a.url, name="demo host A"), CacheClient(url_b, name="demo host B")
    cs = ca.chunk_size
    bpc = cs // BLOCK_SIZE
    tokens = args.prompt_tokens // cs * cs
    per_prompt = tokens // cs
    num_blocks = max(args.blocks, args.prompts * per_prompt * bpc)
    layout = KVLayout(LayoutKind.FLASH_ATTN, args.layers, num_blocks, BLOCK_SIZE, HEADS * HEAD_SIZE, torch.bfloat16)
    check_kv_fits(layout, HEADS, torch.device("cpu"), copies=2)  # host A's and host B's
    chunk_bytes = layout.chunk_bytes(cs)
    gen = torch.Generator().manual_seed(4321)
    kv_a = [torch.empty(layout.layer_shape(HEADS), dtype=torch.bfloat16) for _ in range(args.layers)]
    for layer in kv_a:
        layer.view(torch.int16).random_(generator=gen)
    kv_b = [torch.zeros(layout.layer_shape(HEADS), dtype=torch.bfloat16) for _ in range(args.layers)]
    model = demo_model_name(args.layers)
    ctx_a = ca.register(kv_a, model_name=model, block_size=BLOCK_SIZE, transport=args.transport)
    ctx_b = cb.register(kv_b, model_name=model, block_size=BLOCK_SIZE, transport=args.transport)
    print(f"host A: instance {ctx_a.instance_id} through {ctx_a.transport_name}; host B: instance "
          f"{ctx_b.instance_id} through {ctx_b.transport_name}; one chunk = {format_bytes(chunk_bytes)}")

    prompts = [torch.randint(0, 128_000, (tokens,), generator=gen).tolist() for _ in range(args.prompts)]
    hashes = [chunk_hashes(p, cs) for p in prompts]
    perm = torch.randperm(num_blocks, generator=gen)
    need = per_prompt * bpc
    blocks_a = [perm[i * need:(i + 1) * need] for i in range(args.prompts)]
    perm_b = torch.randperm(num_blocks, generator=gen)  # B's cache is fragmented its own way
    blocks_b = [perm_b[i * need:(i + 1) * need] for i in range(args.prompts)]

    t = time.perf_counter()
    stored = sum(len(ctx_a.submit_store(h, bl).result(timeout=120).stored) for h, bl in zip(hashes, blocks_a))
    store_s = time.perf_counter() - t
    l2_s = _wait_l2(ca, stored)
    tier_a = ca.status().tiers[0]

    t = time.perf_counter()
    looked = []
    pairs = []  # (A's blocks, B's blocks) of every chunk B loaded
    for h, bl, ba in zip(hashes, blocks_b, blocks_a):  # as an engine would: look a prompt up, then load it
        r = cb.lookup_and_lease(model, hashes=h, lease_s=60)
        looked.append(r)
        res = ctx_b.submit_retrieve(h[:r.hits], bl[:r.hits * bpc], lease_id=r.lease_id).result(timeout=120)
        pairs += [(ba[i * bpc:(i + 1) * bpc], bl[i * bpc:(i + 1) * bpc]) for i in res.loaded]
    load_s = time.perf_counter() - t
    loaded = len(pairs)
    ok = all(  # the chunks B loaded hold A's bytes
        torch.equal(layout.row_view(la).view(torch.uint8)[layout.rows(sa)],
                    layout.row_view(lb).view(torch.uint8)[layout.rows(sb)])
        for la, lb in zip(kv_a, kv_b) for sa, sb in pairs
    )
    untouched = torch.ones(num_blocks, dtype=torch.bool)  # and B's other blocks still hold zeros
    for _, sb in pairs:
        untouched[sb] = False
    rest = untouched.nonzero().flatten()
    ok = ok and all(not layout.row_view(lb).view(torch.uint8)[layout.rows(rest)].any() for lb in kv_b)
    tier_b = cb.status().tiers[0]
    ctx_a.close()
    ctx_b.close()
    ca.close()
    cb.close()
    total = args.prompts * per_prompt
    print()
    print(f"prompts:  {args.prompts} x {tokens} tokens = {total} chunks ({format_bytes(total * chunk_bytes)})")
    print(f"host A:   stored {stored} chunks in {store_s * 1e3:.0f} ms; its L2 writers put them in "
          f"{tier_a.store} {l2_s * 1e3:.0f} ms later ({tier_a.writes} written, {tier_a.drops} dropped)")
    print(f"host B:   lookups found {sum(r.hits for r in looked)} of {total} chunks "
          f"({sum(r.l2_hits for r in looked)} in L2); promoted and loaded {loaded} chunks in {load_s * 1e3:.0f} ms "
          f"= {loaded * chunk_bytes / load_s / 1e9:.2f} GB/s")
    print(f"host B:   L2 {tier_b.state}: {tier_b.promotions} promotions, {tier_b.integrity_failures} integrity "
          f"failures, {tier_b.errors} errors")
    print(f"verify:   {'MISMATCH' if not ok else 'nothing loaded' if not loaded else 'every byte B loaded matches A'}")
    if loaded < total:
        why = []
        if tier_a.drops:
            why.append(f"A dropped {tier_a.drops} L2 writes: they wait in at most half its arena ({args.l1_size}), "
                       "and a store is never held up for L2")
        if tier_b.errors or tier_b.integrity_failures or tier_b.state != "up":
            why.append(f"B's L2 is {tier_b.state} ({tier_b.errors} errors, {tier_b.integrity_failures} integrity "
                       "failures: its log says more)")
        why.append(f"B's arena ({args.l1_size}) must hold what it promotes")
        print(f"          {total - loaded} of {total} chunks did not reach B: {'; '.join(why)}. The demo's {total} "
              f"chunks are {format_bytes(total * chunk_bytes)}: give the servers a larger --l1-size, or ask for "
              "fewer --layers or --prompts")

    print("host A:   killed, as a crash would, and started again ...", flush=True)
    a.kill()  # its arena goes with its process
    a.start()
    with CacheClient(a.url, name="demo host A, started again") as again:
        ctx = again.register(kv_a, model_name=model, block_size=BLOCK_SIZE, transport=args.transport)
        found = [again.lookup_and_lease(model, hashes=h, lease_s=1, promote=False) for h in hashes]
        status = again.status()  # (lookups that do not promote leave the arena as it was)
        ctx.close()
    in_l1, tier_again = status.arena.chunks, status.tiers[0]
    in_l2 = sum(r.l2_hits for r in found)
    print(f"host A:   its arena holds {in_l1} chunks; its lookups find {in_l2} of {total} chunks in L2")
    if in_l2 < total and loaded == total:  # B found them all there a moment ago
        print(f"          {total - in_l2} not found: A's L2 is {tier_again.state} ({tier_again.errors} errors; a "
              f"lookup waits at most --l2-timeout for the store, {L2_TIMEOUT_S:g} s here: its log says more)")
    return 0 if ok and loaded == total and stored == total and in_l2 == total and in_l1 == 0 else 1
