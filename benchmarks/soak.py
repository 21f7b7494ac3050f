#!/usr/bin/env python3
"""Aggregate store/retrieve throughput of N concurrent client processes against one client.

Each client is its own process with its own registration (like tensor parallelism: world_size
N, ranks 0..N-1) and the same per-client workload: ``--iters`` rounds of one store request of
``--chunks`` chunks, then one retrieve request of them into other blocks. Rounds are
synchronized (every client starts storing round i at the same instant of the shared monotonic
clock, then retrieving it); a phase's time is from that instant to the last client's end, so
the aggregate is what the server and the machine sustain together; the table gives the median
round (the JSON also the mean over all rounds). All client counts run
against one server, their rounds interleaved, so that load from elsewhere on a shared machine
hits each count alike. Every retrieved chunk is compared bit for bit with
the blocks it was stored from (outside the timed windows): corrupted chunks are counted.

    python benchmarks/soak.py                          # clients 1 2 4 8, prints a table
    python benchmarks/soak.py --clients 1 8 --iters 16 --json results/soak.json

The goal is an 8-client aggregate >= 0.8x one client. On a machine with fewer cores than
clients the clients share cores: read the ratio, not the absolute figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

MiB = 1 << 20


# --------------------------------------------------------------------------- worker process


def worker(args: argparse.Namespace) -> None:
    import torch

    from kvxfer import CacheClient

    torch.set_num_threads(1)
    bpc = args.chunk_size // args.block_size
    blocks = 2 * args.chunks * bpc  # source half, destination half
    g = torch.Generator().manual_seed(1000 + args.rank)
    kv = [torch.randint(-(1 << 15), 1 << 15, (2, blocks, args.block_size, args.heads, args.head_dim),
                        dtype=torch.int16, generator=g).view(torch.bfloat16) for _ in range(args.layers)]
    client = CacheClient(args.url, name=f"soak-{args.rank}", timeout=120)
    ctx = client.register(kv, model_name="soak", world_size=args.world, rank=args.rank,
                          block_size=args.block_size, transport="cpu_gather")
    src = list(range(args.chunks * bpc))
    dst = list(range(args.chunks * bpc, blocks))
    chunk_bytes = args.layers * 2 * args.chunk_size * args.heads * args.head_dim * 2

    def say(**kw: object) -> None:
        print(json.dumps(kw), flush=True)

    copy_s = [0.0]

    def timed(fn):  # the transport's copy, timed: the rest of an op is protocol and waiting
        def wrapper(copies):
            t = time.monotonic()
            try:
                return fn(copies)
            finally:
                copy_s[0] += time.monotonic() - t
        return wrapper

    if hasattr(ctx, "gather") and hasattr(ctx, "scatter"):
        ctx.gather, ctx.scatter = timed(ctx.gather), timed(ctx.scatter)
    say(event="ready", pid=os.getpid(), chunk_bytes=chunk_bytes)
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "quit":
            break
        it, start_at = int(rest[0]), float(rest[1])
        keys = [f"soak/{args.tag}/{it}/{j}".encode().ljust(16, b"\0")[:64] for j in range(args.chunks)]
        if cmd == "retrieve":
            for layer in kv:
                layer[:, dst[0]:dst[-1] + 1].zero_()  # a slice: a view, zeroed in place
        while time.monotonic() < start_at:  # every client starts the phase at the same moment
            time.sleep(max(0.0, min(0.001, start_at - time.monotonic())))
        copy_s[0] = 0.0
        if cmd == "store":
            t0 = time.monotonic()
            res = ctx.submit_store(keys, src).result(timeout=120)
            t1 = time.monotonic()
            say(event="phase", t0=t0, t1=t1, bytes=len(res.stored) * chunk_bytes, failed=len(res.failed),
                copy_s=copy_s[0])
        elif cmd == "retrieve":
            t0 = time.monotonic()
            res = ctx.submit_retrieve(keys, dst).result(timeout=120)
            t1 = time.monotonic()
            corrupt = 0
            for j in res.loaded:
                a = slice(src[j * bpc], src[j * bpc] + bpc)
                b = slice(dst[j * bpc], dst[j * bpc] + bpc)
                if not all(torch.equal(layer[:, a].view(torch.int16), layer[:, b].view(torch.int16)) for layer in kv):
                    corrupt += 1
            say(event="phase", t0=t0, t1=t1, bytes=len(res.loaded) * chunk_bytes, missing=len(res.missing),
                corrupt=corrupt, copy_s=copy_s[0])
    ctx.close()
    client.close()


# --------------------------------------------------------------------------- driver


def _event(proc: subprocess.Popen[str], want: str) -> dict:
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a soak worker exited with {proc.wait()}")
        ev = json.loads(line)
        if ev.get("event") == want:
            return ev


class Group:
    """N worker processes (ranks 0..N-1 of world size N) and their measurements."""

    def __init__(self, args: argparse.Namespace, url: str, n: int) -> None:
        self.n = n
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        common = [sys.executable, __file__, "--worker", "--url", url, "--world", str(n), "--tag", f"n{n}"]
        for k in ("layers", "heads", "head_dim", "block_size", "chunk_size", "chunks"):
            common += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
        self.procs = [subprocess.Popen([*common, "--rank", str(r)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True, env=env) for r in range(n)]
        self.windows: dict[str, list[float]] = {"store": [], "retrieve": []}
        self.op_s: dict[str, list[float]] = {"store": [], "retrieve": []}
        self.copy_s: dict[str, list[float]] = {"store": [], "retrieve": []}
        self.moved = {"store": 0, "retrieve": 0}
        self.round_bytes: dict[str, list[int]] = {"store": [], "retrieve": []}
        self.corrupt = self.missing = self.failed = 0

    def ready(self) -> None:
        for p in self.procs:
            _event(p, "ready")

    def phase(self, phase: str, it: int, timed: bool) -> None:
        start_at = time.monotonic() + 0.05 + 0.01 * self.n  # CLOCK_MONOTONIC: one clock for all processes
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(f"{phase} {it} {start_at}\n")
            p.stdin.flush()
        evs = [_event(p, "phase") for p in self.procs]
        self.corrupt += sum(e.get("corrupt", 0) for e in evs)
        self.missing += sum(e.get("missing", 0) for e in evs)
        self.failed += sum(e.get("failed", 0) for e in evs)
        if timed:
            self.windows[phase].append(max(e["t1"] for e in evs) - min(start_at, *(e["t0"] for e in evs)))
            self.op_s[phase] += [e["t1"] - e["t0"] for e in evs]
            self.copy_s[phase] += [e.get("copy_s", 0.0) for e in evs]
            self.moved[phase] += sum(e["bytes"] for e in evs)
            self.round_bytes[phase].append(sum(e["bytes"] for e in evs))

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None and p.stdin is not None:
                try:
                    p.stdin.write("quit\n")
                    p.stdin.flush()
                except BrokenPipeError:
                    pass
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def result(self, chunk_bytes: int, request_bytes: int) -> dict:
        out = {"clients": self.n, "chunk_bytes": chunk_bytes, "request_bytes": request_bytes,
               "corrupt_chunks": self.corrupt, "missing_chunks": self.missing, "failed_chunks": self.failed}
        for phase in ("store", "retrieve"):
            total_s = sum(self.windows[phase])
            rates = [b / w / 1e9 for b, w in zip(self.round_bytes[phase], self.windows[phase]) if w > 0]
            #: the median round (robust to load spikes from elsewhere on a shared machine)
            out[f"{phase}_gbps"] = statistics.median(rates) if rates else 0.0
            #: all bytes over all windows
            out[f"{phase}_gbps_mean"] = self.moved[phase] / total_s / 1e9 if total_s else 0.0
            out[f"{phase}_op_p50_ms"] = statistics.median(self.op_s[phase]) * 1e3 if self.op_s[phase] else 0.0
            #: time inside the transport's copy (gather/scatter), the rest is protocol and waiting
            out[f"{phase}_copy_p50_ms"] = statistics.median(self.copy_s[phase]) * 1e3 if self.copy_s[phase] else 0.0
            out[f"{phase}_bytes"] = self.moved[phase]
        return out


def run(args: argparse.Namespace, bar) -> list[dict]:
    """One server; a group of workers per client count; rounds interleave the groups (order
    alternating), so that load from elsewhere on the machine hits every group alike."""
    from kvxfer.testing.server import ServerProcess

    chunk_bytes = args.layers * 2 * args.chunk_size * args.heads * args.head_dim * 2
    request_bytes = args.chunks * chunk_bytes
    # room for two rounds of every client: older rounds are evicted, as in a full cache
    l1 = max(args.min_l1_mib * MiB, 2 * sum(args.clients) * request_bytes + 64 * MiB)
    with ServerProcess(l1_size=str(l1), chunk_size=args.chunk_size, transports="cpu_gather",
                       start_timeout=120) as server:
        groups = [Group(args, server.url, n) for n in args.clients]
        try:
            for g in groups:
                g.ready()
            for it in range(args.warmup + args.iters):
                for g in groups if it % 2 == 0 else reversed(groups):
                    g.phase("store", it, it >= args.warmup)
                    g.phase("retrieve", it, it >= args.warmup)
                bar.update(1)
        finally:
            for g in groups:
                g.close()
    return [g.result(chunk_bytes, request_bytes) for g in groups]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8], help="client counts to run")
    p.add_argument("--iters", type=int, default=12, help="timed rounds (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default: %(default)s)")
    p.add_argument("--chunks", type=int, default=8, help="chunks per request (default: %(default)s)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=128, help="tokens per chunk (default: %(default)s)")
    p.add_argument("--min-l1-mib", type=int, default=256)
    p.add_argument("--json", default=None, help="write the results here")
    # worker mode (internal)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--tag", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0

    from tqdm import tqdm

    from kvxfer.text_table import print_table

    if len(set(args.clients)) != len(args.clients):
        p.error("--clients: give each count once")
    with tqdm(total=args.warmup + args.iters, desc="soak", unit="round") as bar:
        results = run(args, bar)
    base = next((r for r in results if r["clients"] == 1), None)
    for r in results:
        for phase in ("store", "retrieve"):
            r[f"{phase}_vs_one"] = r[f"{phase}_gbps"] / base[f"{phase}_gbps"] if base and base[f"{phase}_gbps"] else None
    cpus = os.cpu_count()
    print(f"\nkvxfer soak: {args.chunks} x {results[0]['chunk_bytes'] / MiB:.0f} MiB chunks per request, "
          f"{args.iters} timed rounds, cpu_gather, {cpus} CPUs ({platform.processor() or platform.machine()})")
    print_table(
        [(r["clients"], f"{r['store_gbps']:.2f}", f"{r['store_vs_one']:.2f}x" if r["store_vs_one"] else "-",
          f"{r['retrieve_gbps']:.2f}", f"{r['retrieve_vs_one']:.2f}x" if r["retrieve_vs_one"] else "-",
          f"{r['store_op_p50_ms']:.1f} ({r['store_copy_p50_ms']:.1f})",
          f"{r['retrieve_op_p50_ms']:.1f} ({r['retrieve_copy_p50_ms']:.1f})", r["corrupt_chunks"],
          r["missing_chunks"] + r["failed_chunks"]) for r in results],
        ["clients", "store GB/s", "vs 1", "retrieve GB/s", "vs 1", "store p50 ms (copy)", "retrieve p50 ms (copy)",
         "corrupt", "missing"],
    )
    if cpus is not None and max(args.clients) > cpus:
        print(f"note: {max(args.clients)} clients on {cpus} CPUs share cores; compare ratios, not absolutes")
    if args.json:
        from kvxfer.bench import write_results

        payload = {"args": {k: v for k, v in vars(args).items() if k != "worker"}, "cpus": cpus, "results": results}
        print(f"wrote {write_results(args.json, 'soak', payload)}")
    return 1 if any(r["corrupt_chunks"] for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
