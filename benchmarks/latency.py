#!/usr/bin/env python3
"""Control-path latency of a kvxfer server: round trips of ``ping`` and of an 8-chunk ``lookup``
(with and without a lease) against a real server process over ipc://, with the raw pyzmq
DEALER/ROUTER round trip (two processes, same message size) measured in the same run as the
reference, and beside it a raw Unix socket round trip (no I/O threads). ``--idle-us`` times
each round trip after an idle gap, as a lone request comes.

    python benchmarks/latency.py --iters 5000 --json results/latency.json
    python benchmarks/latency.py --metrics --json benchmarks/results/

Prints a table of p50/p99/mean in microseconds and writes the same as JSON (with the run: commit,
date, machine). The server is a ``python -m kvxfer serve`` subprocess
(``kvxfer.testing.ServerProcess``); the client is the public ``CacheClient``. Timings are
wall-clock round trips from ``request()`` call to decoded reply, one request in flight at a time.

``--metrics`` measures what Prometheus metrics cost a lookup, in one run: two servers, one
without and one with ``--metrics-port`` whose ``/metrics`` a thread scrapes every
``--scrape-interval`` seconds, looked up in alternating rounds (so drift of a shared machine hits
both alike); it reports both p50s and their ratio, and the in-process cost of the figures the
loop keeps per lookup (``ServerStats``), which every server pays.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable

import msgspec
import zmq

try:
    from tqdm import tqdm
except ImportError:  # progress bars are a nicety
    def tqdm(it, **_kw):  # type: ignore[no-redef]
        return it


def _percentile(sorted_ns: list[int], q: float) -> float:
    if not sorted_ns:
        return float("nan")
    k = min(len(sorted_ns) - 1, max(0, round(q / 100 * (len(sorted_ns) - 1))))
    return sorted_ns[k] / 1000.0


def measure(name: str, fn: Callable[[], object], iters: int, warmup: int, progress: bool,
            idle_s: float = 0.0) -> dict:
    """p50/p99/mean/min of ``fn``'s wall time; with ``idle_s``, each call comes that long after
    the one before (both processes' threads have gone to sleep: what a lone request pays)."""
    for _ in range(warmup):
        fn()
    samples: list[int] = []
    clock = time.perf_counter_ns
    for _ in tqdm(range(iters), desc=f"{name:<18}", disable=not progress, leave=False, mininterval=0.5):
        if idle_s:
            time.sleep(idle_s)
        t0 = clock()
        fn()
        samples.append(clock() - t0)
    samples.sort()
    return {
        "name": name,
        "iters": iters,
        "p50_us": _percentile(samples, 50),
        "p99_us": _percentile(samples, 99),
        "mean_us": statistics.fmean(samples) / 1000.0,
        "min_us": samples[0] / 1000.0,
    }


# --------------------------------------------------------------------------- raw pyzmq reference


class _Msg(msgspec.Struct):
    model_name: str
    world_size: int
    hashes: list[bytes]


def _echo_server(url: str, ready: mp.Event) -> None:  # type: ignore[valid-type]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(url)
    ready.set()
    dec = msgspec.msgpack.Decoder(_Msg)
    enc = msgspec.msgpack.Encoder()
    while True:
        frames = sock.recv_multipart()
        if frames[2] == b"stop":
            sock.send_multipart([frames[0], frames[1], b"ok", b""])
            break
        msg = dec.decode(frames[3])
        sock.send_multipart([frames[0], frames[1], b"ok", enc.encode({"hits": len(msg.hashes)})])
    sock.close(0)
    ctx.term()


def raw_zmq(iters: int, warmup: int, hashes: list[bytes], progress: bool, idle_s: float = 0.0) -> dict:
    """DEALER/ROUTER in two processes, a msgspec payload of the same size as the lookup's."""
    tmp = tempfile.mkdtemp(prefix="kvxfer-bench-")
    url = f"ipc://{tmp}/raw.sock"
    ready = mp.Event()
    proc = mp.Process(target=_echo_server, args=(url, ready), daemon=True)
    proc.start()
    ready.wait(10)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    enc = msgspec.msgpack.Encoder()
    payload = enc.encode(_Msg("bench-model", 1, hashes))
    rid = b"\0" * 8

    def once() -> None:
        sock.send_multipart([rid, b"lookup", payload])
        sock.recv_multipart()

    try:
        out = measure("raw pyzmq (ref)", once, iters, warmup, progress, idle_s)
    finally:
        sock.send_multipart([rid, b"stop", b""])
        sock.recv_multipart()
        sock.close(0)
        ctx.term()
        proc.join(5)
        os.rmdir(tmp) if not os.listdir(tmp) else None
    out["payload_bytes"] = len(payload)
    return out


def _uds_echo(path: str, size: int, ready: mp.Event) -> None:  # type: ignore[valid-type]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    ready.set()
    conn, _ = listener.accept()
    buf = bytearray(size)
    view = memoryview(buf)
    while True:
        got = 0
        while got < size:
            n = conn.recv_into(view[got:])
            if not n:
                conn.close()
                listener.close()
                return
            got += n
        conn.sendall(b"ok")


def raw_unix(iters: int, warmup: int, size: int, progress: bool, idle_s: float = 0.0) -> dict:
    """A Unix stream socket between two processes, each side's thread reading and writing it
    itself: the round trip of a control channel with no I/O threads, ``size`` bytes each way."""
    tmp = tempfile.mkdtemp(prefix="kvxfer-bench-")
    path = f"{tmp}/raw.uds"
    ready = mp.Event()
    proc = mp.Process(target=_uds_echo, args=(path, size, ready), daemon=True)
    proc.start()
    ready.wait(10)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    payload = b"x" * size

    def once() -> None:
        sock.sendall(payload)
        got = b""
        while len(got) < 2:
            got += sock.recv(2 - len(got))

    try:
        out = measure("raw unix socket (ref)", once, iters, warmup, progress, idle_s)
    finally:
        sock.close()
        proc.join(5)
        os.unlink(path)
        os.rmdir(tmp)
    out["payload_bytes"] = size
    return out


# --------------------------------------------------------------------------- kvxfer


def run(args: argparse.Namespace) -> dict:
    from kvxfer import CacheClient, chunk_hashes
    from kvxfer.testing.server import ServerProcess

    progress = not args.no_progress and sys.stderr.isatty() or args.progress
    chunk_size = 256
    hashes = chunk_hashes(list(range(chunk_size * args.chunks)), chunk_size)
    results = []
    idle = args.idle_us / 1e6
    results.append(raw_zmq(args.iters, args.warmup, hashes, progress, idle))
    results.append(raw_unix(args.iters, args.warmup, results[0]["payload_bytes"], progress, idle))
    # the lookup+lease row holds every lease it takes until the row ends: let one session hold them
    held = ["--max-leases-per-session", str(args.iters + args.warmup + 16), "--max-leased-bytes-per-session", "16TiB"]
    with ServerProcess(l1_size=args.l1_size, chunk_size=chunk_size, extra_args=held) as server:
        client = CacheClient(server.url, name="latency-bench")
        try:
            # Put 8 chunks' worth of hits in the server so the lookup does real work: store them
            # through cpu_gather if it is installed, else look up misses (reported as such).
            hits = _store_chunks(client, hashes)
            results.append(measure("ping", client.ping, args.iters, args.warmup, progress, idle))
            results.append(measure(f"lookup {args.chunks} chunks",
                                   lambda: client.lookup("bench-model", 1, hashes=hashes),
                                   args.iters, args.warmup, progress, idle))
            n = client.lookup("bench-model", 1, hashes=hashes)

            def lease_once() -> None:
                reply = client.lookup_and_lease("bench-model", 1, hashes=hashes, lease_s=30)
                if reply.lease_id:
                    client.release_lease(reply.lease_id)

            # lease + release is two round trips; report the lookup-with-lease alone too
            leases: list[int] = []

            def lease_only() -> None:
                leases.append(client.lookup_and_lease("bench-model", 1, hashes=hashes, lease_s=30).lease_id)

            results.append(measure(f"lookup+lease {args.chunks}", lease_only, args.iters, args.warmup, progress, idle))
            for lid in leases:
                client.release_lease(lid)
            results.append(measure("lookup+lease+release", lease_once, max(1, args.iters // 2), args.warmup,
                                   progress, idle))
            status = client.status()
        finally:
            client.close()
    for r in results:
        r.setdefault("payload_bytes", None)
    report = {
        "benchmark": "latency",
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count()},
        "chunks": args.chunks,
        "idle_us": args.idle_us,
        "stored_hits": hits,
        "lookup_hits": n,
        "server_errors": status.errors,
        "goal_lookup_p50_us": 150.0,
        "results": results,
    }
    if args.metrics:
        report["metrics_cost"] = metrics_cost(args, hashes, progress)
    return report


# --------------------------------------------------------------------------- metrics cost


def _scraper(url: str, interval: float, stop: threading.Event, counts: dict[str, int]) -> None:
    while not stop.wait(interval):
        with urllib.request.urlopen(url, timeout=30) as resp:
            resp.read()
        counts["scrapes"] += 1


def bookkeeping_ns(iters: int = 200_000) -> float:
    """In-process cost (ns) of the figures the loop keeps for one lookup: the request's
    duration and the lookup's counts (what ``CacheServer`` calls per lookup)."""
    from kvxfer.protocol.table import REQUESTS
    from kvxfer.server.stats import ServerStats

    stats = ServerStats(tuple(REQUESTS))
    stats.register_model("bench-model")
    clock = time.perf_counter
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            t = clock()
            stats.on_lookup("bench-model", 8, 8)
            stats.on_request("lookup", clock() - t)
        best = min(best, (time.perf_counter_ns() - t0) / iters)
    # the loop itself (two clock reads): not bookkeeping
    t0 = time.perf_counter_ns()
    for _ in range(iters):
        clock()
        clock()
    return best - (time.perf_counter_ns() - t0) / iters


def metrics_cost(args: argparse.Namespace, hashes: list[bytes], progress: bool) -> dict:
    from kvxfer import CacheClient
    from kvxfer.testing.server import ServerProcess

    chunk_size = 256
    rounds, per_round = args.rounds, args.iters
    samples: dict[str, list[int]] = {"off": [], "on": []}
    counts = {"scrapes": 0}
    stop = threading.Event()
    with ServerProcess(l1_size=args.l1_size, chunk_size=chunk_size) as off, \
            ServerProcess(l1_size=args.l1_size, chunk_size=chunk_size, extra_args=["--metrics-port", "0"]) as on:
        clients = {"off": CacheClient(off.url, name="metrics-cost"), "on": CacheClient(on.url, name="metrics-cost")}
        try:
            for c in clients.values():
                _store_chunks(c, hashes)
            url = clients["on"].status().metrics_url
            scraper = threading.Thread(target=_scraper, args=(url, args.scrape_interval, stop, counts), daemon=True)
            scraper.start()
            clock = time.perf_counter_ns
            for c in clients.values():
                for _ in range(args.warmup):
                    c.lookup("bench-model", 1, hashes=hashes)
            bar = tqdm(total=2 * rounds * per_round, desc="metrics off/on", disable=not progress, mininterval=0.5)
            for r in range(rounds):
                for name in (("off", "on") if r % 2 == 0 else ("on", "off")):
                    c, out = clients[name], samples[name]
                    for _ in range(per_round):
                        t0 = clock()
                        c.lookup("bench-model", 1, hashes=hashes)
                        out.append(clock() - t0)
                    bar.update(per_round)
            bar.close()
            stop.set()
            scraper.join(60)
            scrape = _time_scrapes(url, 30)
            scrape["status_p50_us"] = next(x.p50_s * 1e6 for x in clients["on"].status().latency if x.name == "status")
            errors = {name: c.status().errors for name, c in clients.items()}
        finally:
            stop.set()
            for c in clients.values():
                c.close()
    rows = {}
    for name, ns in samples.items():
        ns.sort()
        rows[name] = {"p50_us": _percentile(ns, 50), "p99_us": _percentile(ns, 99),
                      "mean_us": statistics.fmean(ns) / 1000.0, "iters": len(ns)}
    cost_ns = bookkeeping_ns()
    return {
        "rounds": rounds,
        "iters_per_round": per_round,
        "scrape_interval_s": args.scrape_interval,
        "scrapes": counts["scrapes"],
        "server_errors": errors,
        "off": rows["off"],
        "on": rows["on"],
        "p50_on_over_off": rows["on"]["p50_us"] / rows["off"]["p50_us"],
        "p99_on_over_off": rows["on"]["p99_us"] / rows["off"]["p99_us"],
        "bookkeeping_ns_per_lookup": cost_ns,
        "bookkeeping_share_of_off_p50": cost_ns / 1000.0 / rows["off"]["p50_us"],
        "scrape": scrape,
        "goal_p50_ratio": 1.05,
    }


def _time_scrapes(url: str, n: int) -> dict:
    """Median wall time of ``n`` scrapes of ``url`` one after another, and their size."""
    times, body = [], b""
    for _ in range(n):
        t0 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=30) as resp:
            body = resp.read()
        times.append(time.perf_counter() - t0)
    samples = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    return {"scrapes": n, "median_ms": statistics.median(times) * 1e3, "bytes": len(body), "samples": samples}


def print_metrics_cost(m: dict) -> None:
    print(f"\nmetrics cost: lookups, {m['rounds']} alternating rounds of "
          f"{m['iters_per_round']}, /metrics scraped every {m['scrape_interval_s']:g} s ({m['scrapes']} scrapes)")
    print(f"{'server':<24}{'p50 us':>10}{'p99 us':>10}{'mean us':>10}")
    print("-" * 54)
    for name, label in (("off", "metrics off"), ("on", "metrics on (scraped)")):
        r = m[name]
        print(f"{label:<24}{r['p50_us']:>10.1f}{r['p99_us']:>10.1f}{r['mean_us']:>10.1f}")
    ok = m["p50_on_over_off"] <= m["goal_p50_ratio"]
    print(f"p50 on / off {m['p50_on_over_off']:.3f}x (p99 {m['p99_on_over_off']:.3f}x); goal <= "
          f"{m['goal_p50_ratio']:.2f}x: {'met' if ok else 'MISSED'}")
    print(f"figures kept per lookup inside the server: {m['bookkeeping_ns_per_lookup']:.0f} ns "
          f"({100 * m['bookkeeping_share_of_off_p50']:.2f}% of the p50 without metrics)")
    sc = m["scrape"]
    print(f"one scrape: {sc['median_ms']:.2f} ms (median of {sc['scrapes']}), {sc['samples']} samples, "
          f"{sc['bytes']} bytes; a status on the server's loop: p50 {sc['status_p50_us']:.0f} us")


def _store_chunks(client, hashes: list[bytes]) -> int:
    import torch

    if "cpu_gather" not in client.server_transports:
        return 0
    layers = [torch.zeros(2, 16, 16, 1, 64, dtype=torch.bfloat16) for _ in range(2)]
    kv = client.register(layers, model_name="bench-model", block_size=16, transport="cpu_gather")
    try:
        # 16 blocks of 16 tokens make one 256-token chunk; every chunk reuses the same blocks
        res = kv.submit_store(hashes, [i % 16 for i in range(16 * len(hashes))]).result(60)
        return len(res.stored) + len(res.present)
    finally:
        # keep the chunks: close only unregisters the context, chunks stay READY
        kv.close()


def print_table(report: dict) -> None:
    rows = report["results"]
    ref = next(r for r in rows if r["name"].startswith("raw pyzmq"))
    if report.get("idle_us"):
        print(f"each round trip {report['idle_us']:g} us after the one before")
    print(f"{'round trip':<24}{'p50 us':>10}{'p99 us':>10}{'mean us':>10}{'p50 / raw':>11}")
    print("-" * 65)
    for r in rows:
        ratio = r["p50_us"] / ref["p50_us"]
        print(f"{r['name']:<24}{r['p50_us']:>10.1f}{r['p99_us']:>10.1f}{r['mean_us']:>10.1f}{ratio:>10.2f}x")
    lookup = next(r for r in rows if r["name"].startswith("lookup ") and "lease" not in r["name"])
    ok = lookup["p50_us"] <= report["goal_lookup_p50_us"]
    print(f"\nlookup p50 {lookup['p50_us']:.1f} us; goal <= {report['goal_lookup_p50_us']:.0f} us: "
          f"{'met' if ok else 'MISSED'} ({report['lookup_hits']} of {report['chunks']} chunks hit)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=5000, help="timed round trips per row (default %(default)s)")
    p.add_argument("--warmup", type=int, default=500, help="untimed round trips first (default %(default)s)")
    p.add_argument("--chunks", type=int, default=8, help="chunk hashes per lookup (default %(default)s)")
    p.add_argument("--l1-size", default="64MiB", help="server arena (default %(default)s)")
    p.add_argument("--idle-us", type=float, default=0.0,
                   help="sleep this long before each timed round trip, so that every one finds the threads of "
                        "both processes asleep, as a lone request does (default: back to back)")
    p.add_argument("--metrics", action="store_true",
                   help="also measure lookups with Prometheus metrics off and on (two servers, same run)")
    p.add_argument("--rounds", type=int, default=10,
                   help="alternating rounds of --metrics, --iters lookups per server each (default %(default)s)")
    p.add_argument("--scrape-interval", type=float, default=1.0,
                   help="seconds between scrapes of /metrics during --metrics (default %(default)s)")
    p.add_argument("--json", metavar="PATH", help="write the results here")
    p.add_argument("--progress", action="store_true", help="progress bars even when stderr is not a tty")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if not 0 <= args.idle_us <= 1e6:
        p.error(f"--idle-us must be in [0, 1000000], got {args.idle_us:g}")
    report = run(args)
    print_table(report)
    if "metrics_cost" in report:
        print_metrics_cost(report["metrics_cost"])
    if args.json:
        from kvxfer.bench import write_results

        print(f"wrote {write_results(args.json, 'latency', report)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
