#!/usr/bin/env python3
"""cuda_ipc store/retrieve throughput on an NVIDIA GPU, against the pinned host<->device copy of
the same bytes measured in the same run (interleaved with the transfers).

Workload (the project's standard one): 32 layers of flash-attention KV ``[2, num_blocks, 16, 8, 128]`` bf16, chunks of
256 tokens (32 MiB each), 8 chunks per request, blocks picked at random. A store moves one
request's blocks into the server (new keys each time); a retrieve loads those chunks back into
other blocks. Each future is waited for; a request's time is submit -> result. The first
request of each transport is verified bit-exact and not timed.

    python benchmarks/cuda_ipc.py --json results/cuda_ipc.json
    python benchmarks/cuda_ipc.py --transports cuda_ipc cpu_gather   # compare with cpu_gather
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

from kvxfer import CacheClient, KVLayout, LayoutKind, chunk_hashes
from kvxfer.bench import progress_bar
from kvxfer.testing import ServerProcess

GB = 1e9
STAT_KEYS = ("store_bytes", "store_s", "retrieve_bytes", "retrieve_s")


def _server_stats(client: CacheClient) -> dict[str, float]:
    """cuda_ipc's copy counters inside the server (zeros for another transport)."""
    for t in client.status().transports:
        if t.name == "cuda_ipc" and "store_s" in t.state:
            return {k: float(t.state[k]) for k in STAT_KEYS}
    return dict.fromkeys(STAT_KEYS, 0.0)


def _timed(fn: Any, device: torch.device) -> float:
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transports", nargs="+", default=["cuda_ipc"])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--blocks", type=int, default=1024, help="KV blocks per layer")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--chunks-per-request", type=int, default=8)
    p.add_argument("--iters", type=int, default=20, help="timed requests of each kind per transport")
    p.add_argument("--l1-size", default="4GiB")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/cuda_ipc.py needs an NVIDIA GPU", file=sys.stderr)
        return 2

    device = torch.device("cuda", 0)
    bs, cs, cpr = args.block_size, args.chunk_size, args.chunks_per_request
    bpc = cs // bs
    layout = KVLayout(LayoutKind.FLASH_ATTN, args.layers, args.blocks, bs, args.heads * args.head_size, torch.bfloat16)
    if 2 * cpr * bpc > args.blocks:
        p.error(f"--blocks must be at least {2 * cpr * bpc} (two requests)")
    gen = torch.Generator(device=device).manual_seed(0)
    kv = [torch.randint(0, 256, (*layout.layer_shape(args.heads)[:-1], args.head_size * 2), dtype=torch.uint8,
                        device=device, generator=gen).view(torch.bfloat16) for _ in range(args.layers)]
    nbytes = cpr * layout.chunk_bytes(cs)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host.fill_(1)
    dev.fill_(2)

    cpu_gen = torch.Generator().manual_seed(1)
    results: list[dict[str, Any]] = []
    with ServerProcess(l1_size=args.l1_size, chunk_size=cs, transports=",".join(dict.fromkeys(args.transports)),
                       start_timeout=120) as server:
        client = CacheClient(server.url)
        for name in args.transports:
            ctx = client.register(kv, model_name=f"bench-{name}", block_size=bs, transport=name)
            d2h, h2d, store_t, retr_t = [], [], [], []
            bar = progress_bar(args.iters + 1, name)
            for it in range(args.iters + 1):
                tokens = torch.randint(0, 50000, (cpr * cs,), generator=cpu_gen).tolist()
                keys = chunk_hashes(tokens, cs, salt=f"{name}-{it}-{os.getpid()}")
                perm = torch.randperm(args.blocks, generator=cpu_gen)
                src, dst = perm[:cpr * bpc], perm[cpr * bpc:2 * cpr * bpc]
                d2h.append(_timed(lambda: host.copy_(dev, non_blocking=True), device))
                h2d.append(_timed(lambda: dev.copy_(host, non_blocking=True), device))
                res: list[Any] = []
                store_t.append(_timed(lambda: res.append(ctx.submit_store(keys, src).result(300)), device))
                retr_t.append(_timed(lambda: res.append(ctx.submit_retrieve(keys, dst).result(300)), device))
                if len(res[0].stored) != cpr or len(res[1].loaded) != cpr:
                    raise SystemExit(f"{name}: a benchmark request did not move every chunk: {res}")
                if it == 0:
                    for layer in kv:
                        rows = layout.row_view(layer).view(torch.uint8)
                        if not torch.equal(rows[layout.rows(src.to(device))], rows[layout.rows(dst.to(device))]):
                            raise SystemExit(f"{name}: retrieved blocks differ from the stored blocks")
                if it == 0:
                    before = _server_stats(client)
                bar.update(1)
            bar.close()
            after = _server_stats(client)
            noop = [_timed(lambda: ctx.submit_store(keys, src).result(300), device) for _ in range(10)]
            ctx.close()
            med = {k: statistics.median(v[1:]) for k, v in
                   (("d2h", d2h), ("h2d", h2d), ("store", store_t), ("retrieve", retr_t))}
            r = {
                "transport": name,
                "request_mib": nbytes / 2**20,
                "chunk_mib": layout.chunk_bytes(cs) / 2**20,
                "chunks_per_request": cpr,
                "store_gbps": nbytes / med["store"] / GB,
                "retrieve_gbps": nbytes / med["retrieve"] / GB,
                "pinned_d2h_gbps": nbytes / med["d2h"] / GB,
                "pinned_h2d_gbps": nbytes / med["h2d"] / GB,
                "store_p50_ms": med["store"] * 1e3,
                "retrieve_p50_ms": med["retrieve"] * 1e3,
                "store_best_gbps": nbytes / min(store_t[1:]) / GB,
                "retrieve_best_gbps": nbytes / min(retr_t[1:]) / GB,
                "iters": args.iters,
                "noop_store_p50_ms": statistics.median(noop) * 1e3,
            }
            for kind in ("store", "retrieve"):
                secs = after[f"{kind}_s"] - before[f"{kind}_s"]
                r[f"in_server_{kind}_gbps"] = (after[f"{kind}_bytes"] - before[f"{kind}_bytes"]) / secs / GB if secs else None
            r["store_ratio"] = r["store_gbps"] / r["pinned_d2h_gbps"]
            r["retrieve_ratio"] = r["retrieve_gbps"] / r["pinned_h2d_gbps"]
            results.append(r)
        client.close()
        server_notes = [line for line in server.log().splitlines() if "cuda_ipc" in line]

    card = torch.cuda.get_device_name(device)
    kernel = os.environ.get("KVXFER_CUDA_IPC_KERNEL", "triton") + ", mode " + os.environ.get("KVXFER_CUDA_IPC_MODE", "staged")
    for line in server_notes:
        print(f"server: {line}")
    print(f"\n{card}, torch {torch.__version__}, {args.layers} layers x {list(layout.layer_shape(args.heads))} bf16, "
          f"{cpr} chunks x {layout.chunk_bytes(cs) / 2**20:.0f} MiB per request, median of {args.iters}, "
          f"cuda_ipc kernel {kernel}")
    head = ["transport", "store GB/s", "pinned D2H GB/s", "store ratio", "retrieve GB/s", "pinned H2D GB/s",
            "retrieve ratio", "store p50 ms", "retrieve p50 ms", "in-server store/retrieve GB/s", "no-op store ms"]
    rows = [[r["transport"], f"{r['store_gbps']:.1f}", f"{r['pinned_d2h_gbps']:.1f}", f"{r['store_ratio']:.2f}x",
             f"{r['retrieve_gbps']:.1f}", f"{r['pinned_h2d_gbps']:.1f}", f"{r['retrieve_ratio']:.2f}x",
             f"{r['store_p50_ms']:.2f}", f"{r['retrieve_p50_ms']:.2f}",
             "/".join(f"{r[f'in_server_{k}_gbps']:.1f}" if r[f"in_server_{k}_gbps"] else "-" for k in ("store", "retrieve")),
             f"{r['noop_store_p50_ms']:.2f}"] for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
    if args.json:
        from kvxfer.bench import write_results

        print("wrote", write_results(args.json, "cuda_ipc-breakdown", {"card": card, "cuda_ipc_kernel": kernel,
                                                                     "args": vars(args), "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
