#!/usr/bin/env python3
"""How much of a prefix load hides behind the forward pass when it is loaded layer by layer.

A prefix (default 8 chunks of 256 tokens: 2,048 tokens, 256 MiB with the standard workload) is
stored once. Then, per iteration and interleaved, each measured from the lookup to the end of the
last layer's compute (device synchronized):

* ``load``: ``lookup_and_lease`` + the whole retrieve, nothing else;
* ``compute``: a simulated forward pass alone, ``layers`` x a per-layer compute time;
* ``sequential``: the whole load, then the forward pass (what a connector that loads between
  steps costs a synchronous prefix);
* ``layerwise``: ``submit_retrieve(by_layer=True)``, then per layer ``wait_layer(i)`` and that
  layer's compute (vLLM's ``wait_for_layer_load`` before each attention layer).

The per-layer compute time is a multiple (``--compute-ratios``) of the load's per-layer time
measured in the same run. On CUDA a layer's compute is a kernel that spins for that long on the
caller's stream (``torch.cuda._sleep``, one thread block: it leaves the copy engines and most SMs
to the load); on CPU a ``time.sleep`` (a device busy while the host waits). Reported: medians,
and ``hidden`` = (sequential - layerwise) / load, the share of the load's time the layer-wise
order took off the step (1.0: all of it; at most min(load, compute) / load).

    python benchmarks/layerwise.py --transport cuda_ipc --device cuda --json results/
    python benchmarks/layerwise.py --transport cpu_gather --json results/
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvxfer import CacheClient, KVLayout, LayoutKind, chunk_hashes
from kvxfer.bench import progress_bar, write_results
from kvxfer.layout import dtype_from_name
from kvxfer.testing import ServerProcess


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _compute_fn(device: torch.device) -> Callable[[float], None]:
    """A function that simulates ``seconds`` of one layer's compute on ``device``."""
    if device.type != "cuda":
        return lambda seconds: time.sleep(seconds) if seconds > 0 else None
    torch.cuda._sleep(1000)  # load the kernel
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 5_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    per_s = cycles / (start.elapsed_time(end) / 1e3)

    def compute(seconds: float) -> None:
        if seconds > 0:
            torch.cuda._sleep(int(seconds * per_s))  # queued on the current stream; the host goes on

    return compute


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transport", default="cpu_gather")
    p.add_argument("--device", default="cpu")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--prefix-chunks", type=int, default=8)
    p.add_argument("--blocks", type=int, default=512)
    p.add_argument("--compute-ratios", type=float, nargs="+", default=[0.5, 1.0, 2.0],
                   help="per-layer compute time as a multiple of the load's per-layer time (default: %(default)s)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--layer-parts", type=int, nargs="+", default=[0], metavar="N",
                   help="cut a layer-wise load into at most N parts (requests or copy rounds), each N in turn; "
                        "0: the transport's own choice (default)")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    if any(n < 0 for n in args.layer_parts):
        p.error("--layer-parts must be >= 0")

    device = torch.device(args.device)
    dtype = dtype_from_name("bfloat16")
    n, bs, chunk, layers = args.prefix_chunks, args.block_size, args.chunk_size, args.layers
    bpc = chunk // bs
    num_blocks = max(args.blocks, 2 * n * bpc)
    layout = KVLayout(LayoutKind.FLASH_ATTN, layers, num_blocks, bs, args.heads * args.head_size, dtype)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    kv = []
    for _ in range(layers):
        t = torch.empty(layout.layer_shape(args.heads), dtype=dtype, device=device)
        t.view(torch.uint8).random_(0, 256)  # on the device itself: 2 GiB of KV in a moment on a GPU
        kv.append(t)
    compute = _compute_fn(device)
    nbytes = n * layout.chunk_bytes(chunk)
    results: dict[str, Any] = {"transport": args.transport, "device": str(device), "layers": layers,
                               "prefix_chunks": n, "tokens": n * chunk, "mib": nbytes / 2**20, "rows": []}
    own_parts: int | None = None
    with ServerProcess(l1_size=str(2 * nbytes + (64 << 20)), chunk_size=chunk) as server:
        client = CacheClient(server.url)
        model = f"layerwise-{os.getpid()}"
        ctx = client.register(kv, model_name=model, block_size=bs, transport=args.transport,
                              layout=LayoutKind.FLASH_ATTN)
        perm = torch.randperm(num_blocks, generator=gen)
        src, dst = perm[:n * bpc], perm[n * bpc:2 * n * bpc]
        keys = chunk_hashes(list(range(n * chunk)), chunk, salt=model)
        if ctx.submit_store(keys, src).result(timeout=300).stored != list(range(n)):
            raise SystemExit("storing the prefix failed")

        def load(by_layer: bool, per_layer: float) -> float:
            _sync(device)
            t0 = time.perf_counter()
            reply = client.lookup_and_lease(model, 1, hashes=keys, lease_s=60.0)
            fut = ctx.submit_retrieve(keys[:reply.hits], dst, lease_id=reply.lease_id, by_layer=by_layer)
            if by_layer:
                for i in range(layers):
                    fut.wait_layer(i, timeout=300)  # type: ignore[attr-defined]  # a LayerwiseFuture
                    compute(per_layer)
            else:
                fut.result(timeout=300)
                for _ in range(layers):
                    compute(per_layer)
            got = fut.result(timeout=300)
            _sync(device)
            if got.missing or reply.hits != n:
                raise SystemExit(f"the prefix was not loaded in full: {reply.hits} hits, {got}")
            return time.perf_counter() - t0

        def compute_only(per_layer: float) -> float:
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(layers):
                compute(per_layer)
            _sync(device)
            return time.perf_counter() - t0

        for _ in range(2):  # warm-up, then check the layer-wise load bit for bit
            load(False, 0.0)
            load(True, 0.0)
        for layer in kv:
            rows = layout.row_view(layer).view(torch.uint8)
            if not torch.equal(rows[layout.rows(src.to(device))], rows[layout.rows(dst.to(device))]):
                raise SystemExit("loaded blocks differ from stored blocks")
        base = statistics.median(load(False, 0.0) for _ in range(args.iters))
        own_parts = len(ctx._layer_groups(nbytes))  # type: ignore[attr-defined]  # the core's choice
        bar = progress_bar(len(args.layer_parts) * len(args.compute_ratios) * args.iters, f"layerwise {args.transport}")
        for parts, ratio in [(p_, r) for p_ in args.layer_parts for r in args.compute_ratios]:
            floors = ("min_layer_part_bytes", "min_layer_chunk_bytes")
            if parts:
                ctx.max_layer_parts = parts  # type: ignore[attr-defined]  # the core's bound, for this run
                for name in floors:
                    setattr(ctx, name, 0)
            else:
                for name in ("max_layer_parts", *floors):
                    ctx.__dict__.pop(name, None)
            per_layer = ratio * base / layers
            t: dict[str, list[float]] = {"load": [], "compute": [], "sequential": [], "layerwise": []}
            for _ in range(args.iters):
                t["load"].append(load(False, 0.0))
                t["compute"].append(compute_only(per_layer))
                t["sequential"].append(load(False, per_layer))
                t["layerwise"].append(load(True, per_layer))
                bar.update(1)
            med = {k: statistics.median(v) for k, v in t.items()}
            results["rows"].append({
                "layer_parts": len(ctx._layer_groups(nbytes)),  # type: ignore[attr-defined]
                "compute_ratio": ratio, "per_layer_ms": per_layer * 1e3,
                **{f"{k}_ms": v * 1e3 for k, v in med.items()},
                "hidden": (med["sequential"] - med["layerwise"]) / med["load"],
                "best_hidden": min(med["load"], med["compute"]) / med["load"],
            })
        bar.close()
        ctx.close()
        client.close()

    from kvxfer.text_table import print_table

    print_table(
        [(args.transport, str(device), str(r["layer_parts"]), f"{r['compute_ratio']:g}", f"{r['per_layer_ms']:.3f}", f"{r['load_ms']:.2f}",
          f"{r['compute_ms']:.2f}", f"{r['sequential_ms']:.2f}", f"{r['layerwise_ms']:.2f}", f"{r['hidden']:.2f}",
          f"{r['best_hidden']:.2f}") for r in results["rows"]],
        ["transport", "device", "parts", "compute/load", "compute ms/layer", "load ms", "compute ms", "sequential ms",
         "layerwise ms", "hidden", "at most"],
    )
    print(f"parts: requests (server-driven) or copy rounds (client-driven) of a layer-wise load of {nbytes >> 20} MiB; "
          f"the transport's own choice: {own_parts}")
    if args.json:
        results["own_layer_parts"] = own_parts
        gpu = torch.cuda.get_device_name() if device.type == "cuda" else None
        print(f"wrote {write_results(args.json, f'layerwise-{args.transport}-{args.device}', {'gpu': gpu, **results})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
