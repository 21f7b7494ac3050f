#!/usr/bin/env python3
"""Aggregate store/retrieve throughput of N concurrent client processes against one client.

Each client is its own process with its own registration (like tensor parallelism: world_size
N, ranks 0..N-1) and the same per-client workload: ``--iters`` rounds of one store request of
``--chunks`` chunks, then one retrieve request of them into other blocks. Rounds are
synchronized (every client starts storing round i at the same instant of the shared monotonic
clock, then retrieving it); a phase's time is from that instant to the last client's end, so
the aggregate is what the server and the machine sustain together. Every retrieved chunk is compared bit for bit with
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
from pathlib import Path

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

    say(event="ready", pid=os.getpid(), chunk_bytes=chunk_bytes)
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "quit":
            break
        it, start_at = int(rest[0]), float(rest[1])
        keys = [f"soak/{args.tag}/{it}/{j}".encode().ljust(16, b"\0")[:64] for j in range(args.chunks)]
        if cmd == "retrieve":
            for layer in kv:
                layer[:, dst].zero_()
        while time.monotonic() < start_at:  # every client starts the phase at the same moment
            time.sleep(max(0.0, min(0.001, start_at - time.monotonic())))
        if cmd == "store":
            t0 = time.monotonic()
            res = ctx.submit_store(keys, src).result(timeout=120)
            t1 = time.monotonic()
            say(event="phase", t0=t0, t1=t1, bytes=len(res.stored) * chunk_bytes, failed=len(res.failed))
        elif cmd == "retrieve":
            t0 = time.monotonic()
            res = ctx.submit_retrieve(keys, dst).result(timeout=120)
            t1 = time.monotonic()
            corrupt = 0
            for j in res.loaded:
                a = [b for b in src[j * bpc:(j + 1) * bpc]]
                b = [b for b in dst[j * bpc:(j + 1) * bpc]]
                if not all(torch.equal(layer[:, a].view(torch.int16), layer[:, b].view(torch.int16)) for layer in kv):
                    corrupt += 1
            say(event="phase", t0=t0, t1=t1, bytes=len(res.loaded) * chunk_bytes, missing=len(res.missing),
                corrupt=corrupt)
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


def run_config(args: argparse.Namespace, n: int, bar) -> dict:
    from kvxfer.testing.server import ServerProcess

    chunk_bytes = args.layers * 2 * args.chunk_size * args.heads * args.head_dim * 2
    per_round = n * args.chunks * chunk_bytes
    # room for two rounds of every client: older rounds are evicted, as in a full cache
    l1 = max(args.min_l1_mib * MiB, 2 * per_round + 64 * MiB)
    with ServerProcess(l1_size=str(l1), chunk_size=args.chunk_size, transports="cpu_gather",
                       start_timeout=120) as server:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        common = [sys.executable, __file__, "--worker", "--url", server.url, "--world", str(n)]
        for k in ("layers", "heads", "head_dim", "block_size", "chunk_size", "chunks"):
            common += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
        procs = [subprocess.Popen([*common, "--rank", str(r), "--tag", f"n{n}"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env) for r in range(n)]
        try:
            for p in procs:
                _event(p, "ready")
            windows: dict[str, list[float]] = {"store": [], "retrieve": []}
            op_s: dict[str, list[float]] = {"store": [], "retrieve": []}
            moved = {"store": 0, "retrieve": 0}
            corrupt = missing = failed = 0
            for it in range(args.warmup + args.iters):
                for phase in ("store", "retrieve"):
                    start_at = time.monotonic() + 0.05 + 0.01 * n  # CLOCK_MONOTONIC: one clock for all
                    for p in procs:
                        assert p.stdin is not None
                        p.stdin.write(f"{phase} {it} {start_at}\n")
                        p.stdin.flush()
                    evs = [_event(p, "phase") for p in procs]
                    corrupt += sum(e.get("corrupt", 0) for e in evs)
                    missing += sum(e.get("missing", 0) for e in evs)
                    failed += sum(e.get("failed", 0) for e in evs)
                    if it < args.warmup:
                        continue
                    windows[phase].append(max(e["t1"] for e in evs) - min(start_at, *(e["t0"] for e in evs)))
                    op_s[phase] += [e["t1"] - e["t0"] for e in evs]
                    moved[phase] += sum(e["bytes"] for e in evs)
                bar.update(1)
            for p in procs:
                assert p.stdin is not None
                p.stdin.write("quit\n")
                p.stdin.flush()
            for p in procs:
                p.wait(60)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    out = {"clients": n, "chunk_bytes": chunk_bytes, "request_bytes": args.chunks * chunk_bytes,
           "corrupt_chunks": corrupt, "missing_chunks": missing, "failed_chunks": failed}
    for phase in ("store", "retrieve"):
        total_s = sum(windows[phase])
        out[f"{phase}_gbps"] = moved[phase] / total_s / 1e9 if total_s else 0.0
        out[f"{phase}_op_p50_ms"] = statistics.median(op_s[phase]) * 1e3 if op_s[phase] else 0.0
        out[f"{phase}_bytes"] = moved[phase]
    return out


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

    from kvxfer.cli import print_table

    results = []
    with tqdm(total=len(args.clients) * (args.warmup + args.iters), desc="soak", unit="round") as bar:
        for n in args.clients:
            bar.set_postfix(clients=n)
            results.append(run_config(args, n, bar))
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
          f"{r['store_op_p50_ms']:.1f}", f"{r['retrieve_op_p50_ms']:.1f}", r["corrupt_chunks"],
          r["missing_chunks"] + r["failed_chunks"]) for r in results],
        ["clients", "store GB/s", "vs 1", "retrieve GB/s", "vs 1", "store p50 ms", "retrieve p50 ms", "corrupt",
         "missing"],
    )
    if cpus is not None and max(args.clients) > cpus:
        print(f"note: {max(args.clients)} clients on {cpus} CPUs share cores; compare ratios, not absolutes")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "worker"},
                                               "cpus": cpus, "results": results}, indent=2))
        print(f"wrote {args.json}")
    return 1 if any(r["corrupt_chunks"] for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
