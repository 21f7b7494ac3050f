"""Where the device idles in lone requests of a client-driven transport (hpu on a GPU).

Starts a kvxfer server, registers a KV cache on the GPU through ``--transport`` (client-driven:
every kernel and DMA of a request runs in this process) and runs lone stores and retrieves of
``--chunks`` chunks, each waited for before the next: first ``--iters`` of each timed alone, then
as many under torch's profiler (CUPTI). Each request is a ``record_function`` range; the GPU activities inside it (DMAs,
kernels) give, per request: when its first DMA starts, how long the DMA engine is busy and idle
between its first and last DMA, when its last GPU activity ends, and the request's end, all
from the request's start. In the same process and run the denominators: one pinned copy of the
request's bytes (``cudaHostAlloc`` memory, as ``kvxfer bench``'s), and ``--chunks`` DMAs of a
chunk each between the device and the arena the transport uses (shared memory registered with
``cudaHostRegister``), back to back.

    python benchmarks/device_timeline.py --transport hpu --device cuda --chunks 8 --iters 20 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _dma_denominators(ctx: Any, dev: Any, nbytes: int, chunk_bytes: int, chunks: int,
                      repeats: int = 10) -> dict[str, float]:
    """Milliseconds (median) of one pinned copy of ``nbytes`` each way, and of ``chunks`` DMAs
    of ``chunk_bytes`` between the device ``dev`` and the transport's own (registered) arena mapping."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    arena = ctx.arena.tensor.view(torch.uint8).view(-1)[:nbytes]
    out: dict[str, float] = {}

    def timed(fn: Any) -> float:
        times = []
        for _ in range(repeats + 1):
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times[1:])

    out["pinned_h2d_ms"] = timed(lambda: gpu.copy_(host, non_blocking=True))
    out["pinned_d2h_ms"] = timed(lambda: host.copy_(gpu, non_blocking=True))

    def per_chunk(h2d: bool) -> None:
        for k in range(chunks):
            a, g = arena[k * chunk_bytes:(k + 1) * chunk_bytes], gpu[k * chunk_bytes:(k + 1) * chunk_bytes]
            (g.copy_(a, non_blocking=True) if h2d else a.copy_(g, non_blocking=True))

    out["arena_h2d_ms"] = timed(lambda: per_chunk(True))
    out["arena_d2h_ms"] = timed(lambda: per_chunk(False))
    return out


def _requests(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Per ``request.*`` range of the profiler's trace: its GPU activities' figures (us from its start)."""
    events = trace.get("traceEvents", [])
    ranges = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("request.")]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    gpu.sort(key=lambda e: e["ts"])
    out = []
    for r in ranges:
        t0, t1 = float(r["ts"]), float(r["ts"]) + float(r["dur"])
        mine = [e for e in gpu if t0 <= float(e["ts"]) < t1]
        dmas = [e for e in mine if e["cat"] == "gpu_memcpy" and _copy_sized(e)]  # not the row-id uploads
        if not dmas:
            continue
        first = float(dmas[0]["ts"])
        last = max(float(e["ts"]) + float(e["dur"]) for e in dmas)
        busy = _union_us([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in dmas])  # (engines overlap)
        end_gpu = max(float(e["ts"]) + float(e["dur"]) for e in mine)
        out.append({"kind": r["name"].split(".", 1)[1], "request_us": t1 - t0, "first_dma_us": first - t0,
                    "dma_span_us": last - first, "dma_busy_us": busy, "dma_idle_us": last - first - busy,
                    "dmas": len(dmas), "gpu_end_us": end_gpu - t0, "after_gpu_us": t1 - end_gpu,
                    "kernels": sum(1 for e in mine if e["cat"] == "kernel")})
    return out


def _copy_sized(event: dict[str, Any]) -> bool:
    """A DMA of the data, not a small upload (row ids): a MiB or more where the trace gives the
    bytes, else over 50 us."""
    nbytes = event.get("args", {}).get("bytes")
    return int(nbytes) >= 1 << 20 if isinstance(nbytes, (int, float)) else float(event["dur"]) > 50


def _union_us(spans: list[tuple[float, float]]) -> float:
    """Time covered by at least one of ``spans`` (two copy engines may run DMAs at once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from kvxfer.bench import progress_bar
    from kvxfer.bench_prefix import make_workload
    from kvxfer.client import CacheClient
    from kvxfer.hashing import chunk_hashes
    from kvxfer.testing.server import ServerProcess

    n, bs, chunk = args.chunks, args.block_size, args.chunk_size
    bpc = chunk // bs
    blocks = max(args.blocks, 2 * n * bpc)
    layout, kv = make_workload(args, blocks)
    nbytes = n * layout.chunk_bytes(chunk)
    server = ServerProcess(l1_size=str(3 * nbytes + (64 << 20)), chunk_size=chunk, transports=args.transport)
    server.start()
    gen = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    try:
        client = CacheClient(server.url)
        model = f"timeline-{os.getpid()}"
        ctx = client.register(kv, model_name=model, block_size=bs, transport=args.transport, layout=args.layout)
        denominators = _dma_denominators(ctx, torch.device(args.device), nbytes, layout.chunk_bytes(chunk), n)

        plain: dict[str, list[float]] = {"store": [], "retrieve": []}

        def one(it: int, previous: list[bytes] | None, timed: bool = False) -> list[bytes]:
            tokens = torch.randint(0, 50000, (n * chunk,), generator=gen)
            tokens[0] = it
            keys = chunk_hashes(tokens.tolist(), chunk)
            src = torch.randperm(blocks, generator=gen)[:n * bpc].tolist()
            t0 = time.perf_counter()
            with torch.profiler.record_function("request.store"):
                ctx.submit_store(keys, src).result(timeout=300)
            if timed:
                plain["store"].append(time.perf_counter() - t0)
            if previous is not None:
                dst = torch.randperm(blocks, generator=gen)[:n * bpc].tolist()
                reply = client.lookup_and_lease(model, 1, hashes=previous, lease_s=60.0)
                t0 = time.perf_counter()
                with torch.profiler.record_function("request.retrieve"):
                    got = ctx.submit_retrieve(previous[:reply.hits], dst, lease_id=reply.lease_id).result(timeout=300)
                if timed:
                    plain["retrieve"].append(time.perf_counter() - t0)
                if reply.hits != n or got.missing:
                    raise SystemExit(f"a load missed chunks: {reply.hits} of {n} hit, {got}")
            return keys

        previous = one(0, None)
        previous = one(1, previous)  # warm-up: staging made, kernels loaded
        for it in range(args.iters):  # not profiled: the request times the profiler does not slow
            previous = one(1000 + it, previous, timed=True)
        unprofiled = {f"{k}_ms": statistics.median(v) * 1e3 for k, v in plain.items()}
        unprofiled["store_x_pinned"] = denominators["pinned_d2h_ms"] / unprofiled["store_ms"]
        unprofiled["retrieve_x_pinned"] = denominators["pinned_h2d_ms"] / unprofiled["retrieve_ms"]
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        bar = progress_bar(args.iters, f"profiled requests {args.transport}")
        with torch.profiler.profile(activities=acts) as prof:
            for it in range(args.iters):
                previous = one(it + 2, previous)
                bar.update(1)
        bar.close()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            rows = _requests(json.loads(path.read_text()))
        ctx.close()
        client.close()
    finally:
        server.stop()
    summary: dict[str, Any] = {}
    for kind in ("store", "retrieve"):
        mine = [r for r in rows if r["kind"] == kind]
        if mine:
            summary[kind] = {k: statistics.median(r[k] for r in mine) for k in mine[0] if k != "kind"}
            summary[kind]["requests"] = len(mine)
    return {"denominators_ms": denominators, "unprofiled": unprofiled, "summary": summary, "requests": rows}


def print_summary(result: dict[str, Any]) -> None:
    from kvxfer.text_table import print_table

    d = result["denominators_ms"]
    print("denominators (ms, median): " + ", ".join(f"{k} {v:.3f}" for k, v in d.items()))
    print("requests not profiled (median): " + ", ".join(f"{k} {v:.3f}" for k, v in result["unprofiled"].items()))
    cols = ["request_us", "first_dma_us", "dma_span_us", "dma_busy_us", "dma_idle_us", "gpu_end_us", "after_gpu_us",
            "dmas", "kernels"]
    print_table([[kind] + [f"{s[c]:.0f}" for c in cols] for kind, s in result["summary"].items()], ["request"] + cols)


def build_parser() -> argparse.ArgumentParser:
    from kvxfer.bench_prefix import add_workload_arguments
    from kvxfer.cli import positive_int

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(p)
    p.add_argument("--chunks", type=positive_int, default=8, help="chunks per request (default: %(default)s)")
    p.add_argument("--iters", type=positive_int, default=20,
                   help="stores and retrieves timed alone, and as many profiled (default: %(default)s)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write the results here (a directory: a file named by date and commit)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.device.startswith("cuda"):
        print("device_timeline: needs --device cuda (the profiler reads CUDA's activities)", file=sys.stderr)
        return 2
    from kvxfer.bench import save_results

    result = run(args)
    print_summary(result)
    save_results(args, "device-timeline", {"args": vars(args), **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
