#!/usr/bin/env python3
"""Store/retrieve throughput of the hpu transport against a real kvxfer server, with the
denominators measured in the same run:

* ``--device cuda`` (a real accelerator standing in for Gaudi): the pinned host<->device copy of
  the same bytes (device->host for stores, host->device for retrieves);
* ``--device cpu``: memcpy of the same bytes, and the cpu_gather transport on the same workload.

Workload (defaults: the project's standard one): 32 layers x ``[2, num_blocks, 16, 8, 128]`` bf16, 256-token
chunks (32 MiB each), 8 chunks per request. Every request stores fresh chunks (no dedupe) from
random blocks, then retrieves them into other random blocks; the first retrieve of each
transport is checked bit-exact. Prints a table, writes JSON (``--json``)::

    python benchmarks/hpu.py --device cpu --json results/hpu-cpu.json
    python benchmarks/hpu.py --device cuda --json results/hpu-cuda.json
"""

from __future__ import annotations

import argparse
import os
import platform
import secrets
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvxfer import CacheClient
from kvxfer.bench import progress_bar
from kvxfer.layout import dtype_from_name
from kvxfer.testing import ServerProcess

GB = 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stats(nbytes: int, seconds: Sequence[float]) -> dict[str, float]:
    rates = sorted(nbytes / s / GB for s in seconds)
    q = statistics.quantiles(rates, n=10) if len(rates) >= 2 else [rates[0]] * 9
    return {"median_gbps": statistics.median(rates), "p10_gbps": q[0], "p90_gbps": q[-1], "n": len(rates)}


class Limit:
    """The copy a transfer cannot beat, for ``nbytes``: memcpy on CPU (warm buffers), pinned
    device->host (store) and host->device (retrieve) copies on CUDA. Timed once per round,
    between the transfers, so that a noisy machine slows all of them alike."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.device = device
        self.nbytes = nbytes
        self.times: dict[str, list[float]] = {"store": [], "retrieve": []}
        if device.type == "cuda":
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
            host.fill_(1)
            dev.fill_(2)
            self.pairs = {"store": (host, dev), "retrieve": (dev, host)}
            self.what = "pinned D2H (store) / H2D (retrieve) of the same bytes"
        else:
            a = torch.ones(nbytes, dtype=torch.uint8)
            b = torch.zeros(nbytes, dtype=torch.uint8)
            self.pairs = {"store": (b, a), "retrieve": (a, b)}
            self.what = "memcpy (torch copy_, warm buffers) of the same bytes"

    def measure(self, keep: bool) -> None:
        for op, (dst, src) in self.pairs.items():
            _sync(self.device)
            t = time.perf_counter()
            dst.copy_(src, non_blocking=self.device.type == "cuda")
            _sync(self.device)
            if keep:
                self.times[op].append(time.perf_counter() - t)

    def result(self) -> dict[str, Any]:
        return {"store_limit_gbps": _stats(self.nbytes, self.times["store"])["median_gbps"],
                "retrieve_limit_gbps": _stats(self.nbytes, self.times["retrieve"])["median_gbps"],
                "limit": self.what}


def registered_shm_copies(nbytes: int, device: torch.device, repeats: int = 8) -> dict[str, Any]:
    """Diagnostics (CUDA): copies between the device and a /dev/shm mapping pinned in place the
    way the hpu transport pins the arena (cudaHostRegister), in one piece and in 32 MiB pieces:
    GB/s, and how long the non-blocking call took to return (short = asynchronous)."""
    import mmap
    import tempfile

    from kvxfer_hpu import ops_for

    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="kvxfer-bench-")
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
        os.unlink(path)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shm = torch.frombuffer(mm, dtype=torch.uint8)
    pin = ops_for("cuda").pin(shm)
    dev = torch.ones(nbytes, dtype=torch.uint8, device=device)
    out: dict[str, Any] = {"pinned": pin.pinned, "note": pin.note}
    piece = 32 << 20
    try:
        for name, dst, src in (("d2h", shm, dev), ("h2d", dev, shm)):
            for split in (nbytes, piece):
                total, ret = [], []
                for _ in range(repeats + 1):
                    _sync(device)
                    t = time.perf_counter()
                    for off in range(0, nbytes, split):
                        dst[off:off + split].copy_(src[off:off + split], non_blocking=True)
                    r = time.perf_counter()
                    _sync(device)
                    total.append(time.perf_counter() - t)
                    ret.append(r - t)
                key = f"{name}_{'whole' if split == nbytes else '32MiB_pieces'}"
                out[key] = {"gbps": _stats(nbytes, total[1:])["median_gbps"],
                            "call_return_ms": 1e3 * statistics.median(ret[1:]),
                            "total_ms": 1e3 * statistics.median(total[1:])}
    finally:
        pin.release()
        del shm
    return out


def make_kv(args: argparse.Namespace, device: torch.device) -> list[torch.Tensor]:
    shape = (2, args.num_blocks, args.block_size, args.heads, args.head_dim)
    dtype = dtype_from_name(args.dtype)
    layers = []
    for _ in range(args.layers):
        t = torch.empty(shape, dtype=dtype, device=device)
        t.view(torch.uint8).random_(0, 256)  # random bytes: every bit pattern of the dtype
        layers.append(t)
    return layers


class Bench:
    """One registration of transport ``name`` over the shared KV tensors, and its timings."""

    def __init__(self, name: str, client: CacheClient, kv: list[torch.Tensor], args: argparse.Namespace,
                 device: torch.device) -> None:
        self.name, self.kv, self.args, self.device = name, kv, args, device
        self.ctx = client.register(kv, model_name=f"bench-{name}", block_size=args.block_size, transport=name)
        self.nbytes = self.ctx.layout.chunk_bytes(args.chunk_size) * args.chunks_per_request
        self.store_s: list[float] = []
        self.retrieve_s: list[float] = []
        self.verified: bool | None = None
        # Time inside the client-driven copy methods (the rest of a request is reserve/commit
        # round trips and bookkeeping): wraps the context's gather/scatter when it has them.
        self.copy_s: dict[str, list[float]] = {"store": [], "retrieve": []}
        self._copy_t = 0.0
        for meth in ("gather", "scatter"):
            fn = getattr(self.ctx, meth, None)
            if fn is not None:
                setattr(self.ctx, meth, self._timed(fn))

    def _timed(self, fn: Any) -> Any:
        """``fn`` timed: the time queueing the copy plus the time in its waiter, if it returns
        one (which must be passed on: the core commits only once the waiter returns)."""
        def timed(copies: Any, transfer: Any) -> Any:
            t = time.perf_counter()
            try:
                waiter = fn(copies, transfer)
            finally:
                self._copy_t += time.perf_counter() - t
            if waiter is None:
                return None

            def timed_wait() -> None:
                t = time.perf_counter()
                try:
                    waiter()
                finally:
                    self._copy_t += time.perf_counter() - t
            return timed_wait
        return timed

    def request(self, keep: bool) -> None:
        """Store fresh chunks from random blocks of the first half, retrieve them into random
        blocks of the second half; the first retrieve is checked bit-exact."""
        a, name = self.args, self.name
        n_blocks = a.chunks_per_request * (a.chunk_size // a.block_size)
        half = a.num_blocks // 2
        keys = [secrets.token_bytes(16) for _ in range(a.chunks_per_request)]
        src = torch.randperm(half)[:n_blocks]
        dst = torch.randperm(a.num_blocks - half)[:n_blocks] + half
        _sync(self.device)
        self._copy_t = 0.0
        t0 = time.perf_counter()
        res = self.ctx.submit_store(keys, src).result(timeout=120)
        t1 = time.perf_counter()
        store_copy, self._copy_t = self._copy_t, 0.0
        if len(res.stored) != len(keys):
            raise RuntimeError(f"{name}: stored {len(res.stored)} of {len(keys)} chunks: {res}")
        got = self.ctx.submit_retrieve(keys, dst).result(timeout=120)
        t2 = time.perf_counter()
        if len(got.loaded) != len(keys):
            raise RuntimeError(f"{name}: retrieved {len(got.loaded)} of {len(keys)} chunks: {got}")
        if keep:
            self.store_s.append(t1 - t0)
            self.retrieve_s.append(t2 - t1)
            self.copy_s["store"].append(store_copy)
            self.copy_s["retrieve"].append(self._copy_t)
        if self.verified is None:
            s_idx, d_idx = src.to(self.device), dst.to(self.device)
            self.verified = all(torch.equal(t.view(torch.uint8)[:, d_idx], t.view(torch.uint8)[:, s_idx])
                                for t in self.kv)
            if not self.verified:
                raise RuntimeError(f"{name}: retrieved blocks differ from the stored ones")

    def result(self) -> dict[str, Any]:
        pinned = getattr(getattr(self.ctx, "pinning", None), "pinned", None)
        out: dict[str, Any] = {"transport": self.name, "bytes_per_request": self.nbytes,
                               "verified_bit_exact": self.verified, "host_pinned": pinned}
        for op, total in (("store", self.store_s), ("retrieve", self.retrieve_s)):
            out[op] = _stats(self.nbytes, total)
            if any(self.copy_s[op]):  # median share of a request spent copying
                out[op]["copy_share"] = statistics.median(c / t for c, t in zip(self.copy_s[op], total))
        return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="torch device of the KV tensors (cpu, cuda, hpu, ...)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=288, help="blocks per layer (>= 2 requests' worth)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--chunks-per-request", type=int, default=8)
    ap.add_argument("--requests", type=int, default=12, help="measured requests per transport")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--l1-size", default="1GiB")
    ap.add_argument("--transports", nargs="+", default=["hpu", "cpu_gather"],
                    help="transports to compare, interleaved request by request (default: hpu cpu_gather)")
    ap.add_argument("--group-mib", type=int, default=None,
                    help="hpu: device MiB of the gather buffer (HpuContext.GROUP_BYTES; default 32)")
    ap.add_argument("--json", type=Path, default=None, help="write results here")
    args = ap.parse_args(argv)
    if args.group_mib is not None:
        from kvxfer_hpu import HpuContext

        HpuContext.GROUP_BYTES = args.group_mib << 20

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if args.num_blocks < 2 * args.chunks_per_request * (args.chunk_size // args.block_size):
        ap.error("--num-blocks must hold two requests (stores read one half, retrieves write the other)")

    kv = make_kv(args, device)
    _sync(device)
    names = ",".join(dict.fromkeys(["hpu", "cpu_gather", *args.transports]))
    with ServerProcess(l1_size=args.l1_size, chunk_size=args.chunk_size, transports=names) as server:
        client = CacheClient(server.url, timeout=120)
        try:
            benches = [Bench(name, client, kv, args, device) for name in args.transports]
            limit = Limit(benches[0].nbytes, device)
            rounds = args.warmup + args.requests
            bar = progress_bar(rounds * len(benches), f"{'/'.join(args.transports)} on {device}")
            for i in range(rounds):
                keep = i >= args.warmup
                k = i % len(benches)  # rotate the order: no transport always runs first
                for b in benches[k:] + benches[:k]:
                    b.request(keep)
                    bar.update(1)
                limit.measure(keep)
            bar.close()
            results = [b.result() for b in benches]
            for b in benches:
                b.ctx.close()
        finally:
            client.close()
    limits = limit.result()
    nbytes = benches[0].nbytes
    diagnostics: dict[str, Any] = {}
    if device.type == "cuda":
        try:
            diagnostics = registered_shm_copies(nbytes, device)
        except Exception as exc:  # diagnostics must not cost the results above
            diagnostics = {"error": f"{type(exc).__name__}: {exc}"}

    by_name = {r["transport"]: r for r in results}
    for r in results:
        r["store"]["vs_limit"] = r["store"]["median_gbps"] / limits["store_limit_gbps"]
        r["retrieve"]["vs_limit"] = r["retrieve"]["median_gbps"] / limits["retrieve_limit_gbps"]
        if "cpu_gather" in by_name and r["transport"] != "cpu_gather":
            for op in ("store", "retrieve"):
                r[op]["vs_cpu_gather"] = r[op]["median_gbps"] / by_name["cpu_gather"][op]["median_gbps"]

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    report = {
        "benchmark": "hpu", "device": str(device), "device_name": device_name,
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                 "torch": torch.__version__},
        "workload": {"layers": args.layers,
                     "layer_shape": [2, args.num_blocks, args.block_size, args.heads, args.head_dim],
                     "dtype": args.dtype, "chunk_size": args.chunk_size,
                     "chunk_bytes": nbytes // args.chunks_per_request,
                     "chunks_per_request": args.chunks_per_request, "requests": args.requests,
                     "warmup": args.warmup, "order": "transports interleaved per request, rotated",
                     "hpu_group_bytes": _group_bytes()},
        "limits": limits, "results": results, "diagnostics": diagnostics,
    }
    print(table(report))
    if args.json:
        from kvxfer.bench import write_results

        print(f"wrote {write_results(args.json, f'hpu-breakdown-{device.type}', report)}")
    return 0


def _group_bytes() -> int | None:
    try:
        from kvxfer_hpu import HpuContext
    except ImportError:
        return None
    return HpuContext.GROUP_BYTES


def table(report: dict[str, Any]) -> str:
    w = report["workload"]
    lim = report["limits"]
    head = (f"hpu benchmark on {report['device']} ({report['device_name']}): {w['layers']} layers x "
            f"{w['layer_shape']} {w['dtype']}, {w['chunk_bytes'] >> 20} MiB chunks, "
            f"{w['chunks_per_request']} per request, {w['requests']} requests (median GB/s); hpu gather "
            f"buffer {(w.get('hpu_group_bytes') or 0) >> 20} MiB\n"
            f"limit: {lim['limit']}: store {lim['store_limit_gbps']:.1f} GB/s, "
            f"retrieve {lim['retrieve_limit_gbps']:.1f} GB/s\n")
    cols = ["transport", "store GB/s", "store/limit", "retrieve GB/s", "retrieve/limit", "vs cpu_gather (s/r)",
            "pinned", "bit-exact"]
    rows = []
    for r in report["results"]:
        vs = (f"{r['store']['vs_cpu_gather']:.2f} / {r['retrieve']['vs_cpu_gather']:.2f}"
              if "vs_cpu_gather" in r["store"] else "-")
        rows.append([r["transport"], f"{r['store']['median_gbps']:.1f}", f"{r['store']['vs_limit']:.2f}x",
                     f"{r['retrieve']['median_gbps']:.1f}", f"{r['retrieve']['vs_limit']:.2f}x", vs,
                     str(r["host_pinned"]), str(r["verified_bit_exact"])])
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(" --- " for _ in cols) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    for r in report["results"]:
        if "copy_share" in r["store"]:
            lines.append(f"{r['transport']}: share of request time in the copies (rest: reserve/commit): "
                         f"store {r['store']['copy_share']:.2f}, retrieve {r['retrieve']['copy_share']:.2f}")
    diag = report.get("diagnostics") or {}
    for key, v in diag.items():
        if isinstance(v, dict):
            lines.append(f"registered /dev/shm {key}: {v['gbps']:.1f} GB/s, non-blocking call returned after "
                         f"{v['call_return_ms']:.2f} of {v['total_ms']:.2f} ms")
    return head + "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
