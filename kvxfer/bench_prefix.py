"""Prefix-load benchmark (``kvxfer bench --prefix``): the latency a prompt pays for its cached
prefix, one request alone, against the copy time of the same bytes measured in the same run.

For each prefix length (1, 2, 8 and 32 chunks by default), every iteration:

* **store**: ``submit_store`` of a fresh prefix (new keys, random blocks), waited for;
* **load**: what a connector issues for a prompt whose prefix is cached: the scheduler's
  ``lookup_and_lease`` of the prompt's chunk hashes, then the worker's ``submit_retrieve`` of
  the hits into other random blocks with that lease, waited for (and, on a GPU, the device
  synchronized); the prefix loaded is the one stored in the previous iteration, so that its
  slots are not in the CPU's caches;
* the **copy** of the same bytes, interleaved: pinned device->host (store) and host->device
  (load) on CUDA, a memcpy between cold buffers on CPU (:class:`kvxfer.bench.CopyLimit`).

Reported per length and kind: p50 and p99 milliseconds over the iterations, the p50 of the
copy, and ``x copy`` = p50 / copy p50 (1.0 is the physical limit; lower is better). The first
iteration is a warm-up (and checks the loaded blocks bit for bit). ``--prefetch`` also times
loads whose lookup asks the server to prefetch (``load_prefetch``: ``lookup_and_lease(...,
prefetch=True)``, as the vLLM connector issues it); ``--layerwise`` loads submitted layer by
layer (``by_layer=True``), to the last layer landed. The loads of one iteration run one after
the other, in turn first.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from typing import Any

import torch

from kvxfer.bench import (
    CopyLimit,
    _check_moved,
    _sync,
    add_kv_cache_arguments,
    add_server_tuning_arguments,
    bench_model_name,
    check_kv_fits,
    json_target,
    progress_bar,
    run_salt,
    save_results,
    server_tuning_args,
)
from kvxfer.cli import add_client_curve_arguments, client_curve, positive_int
from kvxfer.layout import KVLayout, LayoutKind, dtype_from_name
from kvxfer.units import format_bytes

__all__ = ["add_workload_arguments", "main", "make_workload", "run"]


def _p(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import time

    from kvxfer.client import CacheClient
    from kvxfer.hashing import chunk_hashes
    from kvxfer.testing.server import ServerProcess, transports_for

    # an unknown transport is refused before the KV cache is made (seconds at the default sizes)
    server_transports = transports_for(args.transport, args.server_transports) if args.url is None else ""
    device = torch.device(args.device)
    kind = LayoutKind(args.layout)
    bs, chunk = args.block_size, args.chunk_size
    bpc = chunk // bs
    longest = max(args.prefix_chunks)
    num_blocks = max(args.blocks, 2 * longest * bpc)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    layout, kv = make_workload(args, num_blocks)
    chunk_bytes = layout.chunk_bytes(chunk)
    # room for three requests of the longest prefix: the one loaded, the one stored, one spare
    l1 = args.l1_size or str(3 * longest * chunk_bytes + (64 << 20))
    server = None
    url = args.url
    if url is None:
        server = ServerProcess(l1_size=l1, chunk_size=chunk,
                               transports=server_transports,
                               extra_args=server_tuning_args(args))
        server.start()
        url = server.url
    results: list[dict[str, Any]] = []
    try:
        client = CacheClient(url, curve=client_curve(args))
        if client.chunk_size != chunk:
            raise SystemExit(f"the server at {url} uses chunk size {client.chunk_size}, not {chunk}")
        salt = run_salt()
        model = bench_model_name("prefix", layout, chunk)
        ctx = client.register(kv, model_name=model, block_size=bs, transport=args.transport, layout=kind)
        loads = ["load"] + (["load_prefetch"] if args.prefetch else []) + (["load_layerwise"] if args.layerwise else [])
        kinds = ["store", *loads]
        bar = progress_bar(len(args.prefix_chunks) * (args.iters + 2), f"prefix {args.transport}")
        counter = 0
        for n in args.prefix_chunks:
            nbytes = n * chunk_bytes
            limit = CopyLimit(nbytes, device)
            times: dict[str, list[float]] = {k: [] for k in kinds}
            copy: dict[str, list[float]] = {"store": [], "retrieve": []}
            previous: tuple[list[bytes], torch.Tensor] | None = None
            for it in range(args.iters + 2):
                counter += 1
                tokens = torch.randint(0, 50000, (n * chunk,), generator=gen)
                tokens[0] = counter  # a fresh prefix every time: no dedupe
                keys = chunk_hashes(tokens.tolist(), chunk, salt=salt)
                src = torch.randperm(num_blocks, generator=gen)[:n * bpc]
                _sync(device)
                t0 = time.perf_counter()
                res = ctx.submit_store(keys, src).result(timeout=300)
                t1 = time.perf_counter()
                if res.failed or len(res.stored) != n:
                    raise SystemExit(f"a benchmark store did not store every chunk: {res}")
                timed = it >= 2  # iteration 0 only stores; 1 is the warm-up load
                if timed:
                    times["store"].append(t1 - t0)
                    copy["store"].append(limit.time("store"))
                if previous is not None:
                    old_keys, old_src = previous
                    free = torch.ones(num_blocks, dtype=torch.bool)
                    free[old_src] = False  # load into blocks other than the ones the prefix came from
                    spare = free.nonzero().view(-1)
                    dst = spare[torch.randperm(spare.numel(), generator=gen)[:n * bpc]]
                    for k in loads if it % 2 else loads[::-1]:  # each kind first every other time
                        _sync(device)
                        t0 = time.perf_counter()
                        reply = client.lookup_and_lease(model, 1, hashes=old_keys, lease_s=60.0,
                                                        prefetch=k == "load_prefetch")
                        if reply.hits != n:
                            raise SystemExit(
                                f"the server holds {reply.hits} of the {n} chunks stored just before: its arena "
                                f"is too small for this run (it needs about {format_bytes(3 * n * chunk_bytes)}, "
                                "three of the longest prefixes): give it a larger --l1-size, or ask for fewer "
                                "--prefix-chunks")
                        fut = ctx.submit_retrieve(old_keys[:reply.hits], dst, lease_id=reply.lease_id,
                                                  by_layer=k == "load_layerwise")
                        if k == "load_layerwise":
                            fut.wait_layer(args.layers - 1, timeout=300)  # type: ignore[attr-defined]  # a LayerwiseFuture
                        got = fut.result(timeout=300)
                        _sync(device)
                        t1 = time.perf_counter()
                        _check_moved(got)
                        if timed:
                            times[k].append(t1 - t0)
                        elif args.verify:
                            for layer in kv:
                                rows = layout.row_view(layer).view(torch.uint8)
                                if not torch.equal(rows[layout.rows(old_src.to(device))],
                                                   rows[layout.rows(dst.to(device))]):
                                    raise SystemExit("loaded blocks differ from stored blocks")
                    if timed:
                        copy["retrieve"].append(limit.time("retrieve"))
                previous = (keys, src)
                bar.update(1)
            del limit
            for k in kinds:
                base = copy["store" if k == "store" else "retrieve"]
                p50, base50 = statistics.median(times[k]), statistics.median(base)
                results.append({
                    "transport": args.transport, "device": str(device), "kind": k, "chunks": n,
                    "tokens": n * chunk, "mib": nbytes / 2**20, "iters": len(times[k]),
                    "p50_ms": p50 * 1e3, "p99_ms": _p(times[k], 0.99) * 1e3,
                    "copy_p50_ms": base50 * 1e3, "copy": limit_name(device),
                    "x_copy": p50 / base50, "gbps": nbytes / p50 / 1e9, "copy_gbps": nbytes / base50 / 1e9,
                })
        bar.close()
        ctx.close()
        client.close()
    finally:
        if server is not None:
            server.stop()
    return results


def limit_name(device: torch.device) -> str:
    return "pinned D2H/H2D" if device.type == "cuda" else "memcpy (cold, 1 thread)"


def print_results(results: list[dict[str, Any]]) -> None:
    from kvxfer.text_table import print_table

    print_table(
        [(r["transport"], r["device"], r["kind"], r["chunks"], r["tokens"], f"{r['mib']:.4g}",
          f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}", f"{r['copy_p50_ms']:.2f}", r["copy"],
          f"{r['x_copy']:.2f}x") for r in results],
        ["transport", "device", "kind", "chunks", "tokens", "MiB", "p50 ms", "p99 ms", "copy p50 ms", "copy",
         "x copy"],
    )
    fewest = min((r["iters"] for r in results), default=100)
    if fewest < 100:
        print(f"(p99 of {fewest} requests is their slowest, by nearest rank; --iters 100 or more for a p99 of its own)")


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The transport and the KV cache a lone-request benchmark registers (the standard workload
    of docs/performance.md by default: 32 layers x [2, blocks, 16, 8, 128] bf16, 256-token chunks)."""
    add_kv_cache_arguments(p)
    p.add_argument("--chunk-size", type=positive_int, default=256,
                   help="tokens per chunk (default: %(default)s)")
    p.add_argument("--blocks", type=positive_int, default=1024,
                   help="KV cache blocks per layer (at least two prefixes' worth)")


def make_workload(args: argparse.Namespace, num_blocks: int) -> tuple[KVLayout, list[torch.Tensor]]:
    """The layout and random KV cache of :func:`add_workload_arguments`' options, with
    ``num_blocks`` blocks per layer, on ``args.device``."""
    layout = KVLayout(LayoutKind(args.layout), args.layers, num_blocks, args.block_size,
                      args.heads * args.head_size, dtype_from_name(args.dtype))
    check_kv_fits(layout, args.heads, torch.device(args.device))
    kv = []
    for _ in range(args.layers):
        t = torch.empty(layout.layer_shape(args.heads), dtype=layout.dtype, device=torch.device(args.device))
        t.view(torch.uint8).random_(0, 256)  # on the device itself: 2 GiB of KV in a moment on a GPU
        kv.append(t)
    return layout, kv


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvxfer bench --prefix", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_workload_arguments(p)
    p.add_argument("--prefix-chunks", type=positive_int, nargs="+", default=[1, 2, 8, 32],
                   help="prefix lengths in chunks (default: %(default)s)")
    p.add_argument("--iters", type=positive_int, default=20,
                   help="timed requests per length and kind (after a warm-up)")
    p.add_argument("--prefetch", action="store_true",
                   help="also time loads whose lookup asks for a prefetch (load_prefetch; only a transport "
                        "that prefetches, cuda_ipc, loads differently: with others it is the plain load again)")
    p.add_argument("--layerwise", action="store_true", help="also time layer-by-layer loads (by_layer=True)")
    p.add_argument("--l1-size", default=None, help="arena size of the benchmark's server (default: 3 longest prefixes)")
    p.add_argument("--url", default=None,
                   help="use a running server (its chunk size must match); the run registers as the model "
                        "kvxfer-prefix-FORMAT (one per chunk format, every run the same: one metrics label) and "
                        "leaves its chunks there, to be evicted like any other")
    p.add_argument("--server-transports", default="",
                   help="--transports of the started server (default: the --transport benchmarked)")
    add_server_tuning_arguments(p)
    add_client_curve_arguments(p)
    p.add_argument("--no-verify", dest="verify", action="store_false", help="skip the bit-exact check")
    p.add_argument("--json", default=None, metavar="PATH", type=json_target,
                   help="also write the results here (a directory: a file named by date and commit)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    results = run(args)
    print_results(results)
    save_results(args, "prefix", {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
