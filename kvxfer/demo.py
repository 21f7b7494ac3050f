"""`kvxfer demo`: the main job, end to end on one machine.

Starts a server (unless ``--url`` names one), registers a realistic paged KV cache (32 layers,
flash-attention layout ``[2, num_blocks, 16, 8, 128]``, bf16) through a transport, stores the
chunks of a few prompts (two of which share a prefix, so the second store skips the shared
chunks), looks them up, retrieves them into other blocks, verifies every byte, prints a report
and stops the server.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvxfer.client import CacheClient
from kvxfer.hashing import chunk_hashes
from kvxfer.layout import KVLayout, LayoutKind
from kvxfer.units import format_bytes

__all__ = ["run_demo"]

BLOCK_SIZE = 16
HEADS, HEAD_SIZE = 8, 128


def run_demo(args: argparse.Namespace) -> int:
    from kvxfer.testing.server import ServerProcess

    server = None
    url = args.url
    if url is None:
        print(f"starting a kvxfer server (arena {args.l1_size}) ...", flush=True)
        server = ServerProcess(l1_size=args.l1_size).start()
        url = server.url
    try:
        return _demo(url, args)
    finally:
        if server is not None:
            code = server.stop()
            print(f"server stopped (exit code {code})")


def _demo(url: str, args: argparse.Namespace) -> int:
    client = CacheClient(url, name="kvxfer demo")
    cs = client.chunk_size
    bpc = cs // BLOCK_SIZE
    tokens_per_prompt = args.prompt_tokens // cs * cs
    chunks_per_prompt = tokens_per_prompt // cs
    num_blocks = max(args.blocks, 2 * args.prompts * chunks_per_prompt * bpc)
    layout = KVLayout(LayoutKind.FLASH_ATTN, args.layers, num_blocks, BLOCK_SIZE, HEADS * HEAD_SIZE, torch.bfloat16)
    print(f"server {client.server_version} at {url}: chunk size {cs} tokens, transports "
          f"{', '.join(client.server_transports)}")
    print(f"KV cache: {args.layers} layers x {list(layout.layer_shape(HEADS))} bf16 "
          f"({format_bytes(args.layers * 2 * num_blocks * layout.row_bytes)}); "
          f"one chunk = {format_bytes(layout.chunk_bytes(cs))}")

    gen = torch.Generator().manual_seed(1234)
    kv = [torch.empty(layout.layer_shape(HEADS), dtype=torch.bfloat16) for _ in range(args.layers)]
    for layer in kv:  # random bits (NaN patterns too): the check below compares bytes
        layer.view(torch.int16).random_(generator=gen)
    ctx = client.register(kv, model_name="demo-llama-8b", block_size=BLOCK_SIZE, transport=args.transport)
    print(f"registered through {ctx.transport_name} as instance {ctx.instance_id}")

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
        res = ctx.submit_store(h, blocks).result(timeout=120)
        stored += len(res.stored)
        present += len(res.present)
        if res.failed:
            print(f"  warning: {len(res.failed)} chunks did not fit in the arena")
    store_s = time.perf_counter() - t
    store_bytes = stored * layout.chunk_bytes(cs)

    hits = [client.lookup("demo-llama-8b", 1, hashes=h) for h in hashes]
    unseen = chunk_hashes(torch.randint(0, 128_000, (tokens_per_prompt,), generator=gen).tolist(), cs)
    miss = client.lookup("demo-llama-8b", 1, hashes=unseen)

    loaded = 0
    t = time.perf_counter()
    for h, n, blocks in zip(hashes, hits, dst_blocks):
        got = ctx.submit_retrieve(h[:n], blocks[:n * bpc]).result(timeout=120)
        loaded += len(got.loaded)
    retrieve_s = time.perf_counter() - t
    retrieve_bytes = loaded * layout.chunk_bytes(cs)

    ok = all(
        torch.equal(layout.row_view(layer).view(torch.uint8)[layout.rows(s)],
                    layout.row_view(layer).view(torch.uint8)[layout.rows(d)])
        for layer in kv for s, d in zip(src_blocks, dst_blocks)
    )
    st = client.status()
    ctx.close()
    client.close()

    print()
    print(f"prompts: {args.prompts} x {tokens_per_prompt} tokens = {args.prompts * chunks_per_prompt} chunks")
    print(f"store:    {stored} chunks written, {present} already present (shared prefix) "
          f"in {store_s * 1e3:.0f} ms = {store_bytes / store_s / 1e9:.1f} GB/s")
    print(f"lookup:   hits per prompt {hits} of {chunks_per_prompt}; an unseen prompt: {miss}")
    print(f"retrieve: {loaded} chunks into other blocks in {retrieve_s * 1e3:.0f} ms = "
          f"{retrieve_bytes / retrieve_s / 1e9:.1f} GB/s")
    print(f"verify:   {'every byte matches' if ok else 'MISMATCH'}")
    print(f"server:   {st.arena.chunks} chunks, {format_bytes(st.arena.used)} of "
          f"{format_bytes(st.arena.capacity)} used, lookup hit rate "
          f"{100 * st.lookup_hits / max(1, st.lookup_chunks):.0f}%")
    return 0 if ok and miss == 0 and all(n == chunks_per_prompt for n in hits) else 1
