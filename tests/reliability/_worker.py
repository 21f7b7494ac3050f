"""A kvxfer client in its own process, for the fault, soak and load tests (and benchmarks/soak.py).

Prints one JSON object per line (``{"event": ...}``) on stdout. Modes:

* ``store-loop``: store new chunks forever (``stored`` events) until killed;
* ``retrieve-loop``: store chunks once, then retrieve and check them forever;
* ``hold-write`` / ``hold-read``: open a write (half filled) / read reservation with raw
  requests, report it (``held``), then sleep until killed: a client that dies mid-transfer;
* ``freeze-write`` / ``freeze-read``: store (or store, then retrieve) chunks, SIGSTOP itself
  right before the copy (``freezing``), and once continued report what the request returned
  (``stored`` / ``retrieved`` / ``failed``), then exit on a line from stdin: a client frozen
  mid-copy past its session timeout;
* ``soak``: wait for ``go`` on stdin, then ``--iters`` rounds of store + retrieve + bit-exact
  check; reports counts, bytes, corrupted chunks and its start/end clock (``done``);
* ``race``: wait for ``go``, then ``--iters`` rounds of storing the same keys as the other
  racers (same ``--model``), each with bytes of its own version (``--tag`` of ``--versions``),
  and reading them back: every chunk read must be one whole version (``done`` counts what was
  read as its own version, as another one, and as none of them: ``mixed``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import relkit  # noqa: E402
from kvxfer import CacheClient  # noqa: E402
from kvxfer.protocol import messages as m  # noqa: E402


def emit(event: str, **kw: object) -> None:
    print(json.dumps({"event": event, "pid": os.getpid(), **kw}), flush=True)


def connect(args: argparse.Namespace) -> tuple[CacheClient, object, relkit.Shape, int]:
    curve = None
    if args.curve_dir:
        from kvxfer.security import load_client_keys

        curve = load_client_keys(Path(args.curve_dir))
    client = CacheClient(args.url, name=f"worker-{args.mode}-{args.rank}", curve=curve, timeout=args.timeout)
    shape = relkit.Shape(args.layers, args.num_blocks, args.block_size, args.heads, args.head_dim)
    kv = shape.make()
    ctx = client.register(kv, model_name=args.model, world_size=args.world, rank=args.rank,
                          block_size=shape.block_size, transport="cpu_gather")
    ctx._kv = kv  # type: ignore[attr-defined]
    return client, ctx, shape, client.chunk_size // shape.block_size


def blocks_for(j: int, bpc: int, base: int) -> list[int]:
    return list(range(base + j * bpc, base + (j + 1) * bpc))


def fill(args, shape, kv, bpc: int, keys: list[bytes], base: int, exp: list | None = None) -> list[int]:
    ids: list[int] = []
    for j, h in enumerate(keys):
        b = blocks_for(j, bpc, base)
        relkit.write_chunk(kv, b, exp[j] if exp else relkit.expected(shape, args.model, args.rank, h, bpc))
        ids += b
    return ids


def check(args, shape, kv, bpc: int, keys: list[bytes], base: int, only: list[int] | None = None,
          exp: list | None = None) -> int:
    """Chunks (of ``only``) whose blocks at ``base`` differ from their expected content."""
    bad = 0
    for j, h in enumerate(keys):
        if only is not None and j not in only:
            continue
        got = relkit.read_chunk(kv, blocks_for(j, bpc, base))
        want = exp[j] if exp else relkit.expected(shape, args.model, args.rank, h, bpc)
        if not torch.equal(got, want):
            bad += 1
    return bad


def store_loop(args) -> None:
    client, ctx, shape, bpc = connect(args)
    kv = ctx._kv
    emit("ready", instance_id=ctx.instance_id)
    n = args.start
    while True:
        keys = [relkit.key(args.model, n + j) for j in range(args.chunks)]
        ids = fill(args, shape, kv, bpc, keys, 0)
        res = ctx.submit_store(keys, ids).result(timeout=args.timeout)
        emit("stored", first=n, stored=len(res.stored), failed=len(res.failed))
        n += args.chunks


def retrieve_loop(args) -> None:
    client, ctx, shape, bpc = connect(args)
    kv = ctx._kv
    keys = [relkit.key(args.model, args.start + j) for j in range(args.chunks)]
    ids = fill(args, shape, kv, bpc, keys, 0)
    res = ctx.submit_store(keys, ids).result(timeout=args.timeout)
    emit("ready", instance_id=ctx.instance_id, stored=len(res.stored) + len(res.present))
    base = args.chunks * bpc
    while True:
        for layer in kv:
            layer[:, base:base + len(ids)].zero_()  # a no-op retrieve must not pass the check
        r = ctx.submit_retrieve(keys, [b + base for b in ids]).result(timeout=args.timeout)
        emit("retrieved", loaded=len(r.loaded), corrupt=check(args, shape, kv, bpc, keys, base, r.loaded))


def hold(args, write: bool) -> None:
    client, ctx, shape, bpc = connect(args)
    kv = ctx._kv
    keys = [relkit.key(args.model, args.start + j) for j in range(args.chunks)]
    if write:
        rep = client.request(m.ReserveWrite(ctx.instance_id, keys))
        nbytes = shape.chunk_bytes(client.chunk_size)
        for s in rep.slots[: max(1, len(rep.slots) // 2)]:  # half written, as a copy cut short
            ctx.arena.view(s.offset, nbytes)[: nbytes // 2].fill_(0x5A)
        emit("held", reservation_id=rep.reservation_id, slots=len(rep.slots), instance_id=ctx.instance_id)
    else:
        ids = fill(args, shape, kv, bpc, keys, 0)
        ctx.submit_store(keys, ids).result(timeout=args.timeout)
        rep = client.request(m.ReserveRead(ctx.instance_id, keys))
        emit("held", reservation_id=rep.reservation_id, slots=len(rep.slots), instance_id=ctx.instance_id)
    while True:
        time.sleep(3600)


def freeze(args, write: bool) -> None:
    client, ctx, shape, bpc = connect(args)
    kv = ctx._kv
    keys = [relkit.key(args.model, args.start + j) for j in range(args.chunks)]
    ids = fill(args, shape, kv, bpc, keys, 0)
    if not write:
        ctx.submit_store(keys, ids).result(timeout=args.timeout)
    name = "gather" if write else "scatter"
    copy = getattr(ctx, name)

    def frozen_copy(copies, transfer):  # the real copy, after a freeze the test ends with SIGCONT
        emit("freezing")
        # directed at this thread, so that it stops before the next line (a process-directed
        # SIGSTOP may be taken by another thread while this one runs on for a moment)
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        return copy(copies, transfer)  # and its waiter, if any

    setattr(ctx, name, frozen_copy)
    base = args.chunks * bpc
    try:
        if write:
            res = ctx.submit_store(keys, ids).result(timeout=args.timeout)
            emit("stored", stored=res.stored, failed=res.failed)
        else:
            for layer in kv:
                layer[:, base:base + len(ids)].zero_()
            fut = ctx.submit_retrieve(keys, [b + base for b in ids], by_layer=args.by_layer)
            if args.by_layer:  # what an engine's attention would read once layer 0 is said to have landed
                fut.wait_layer(0, timeout=args.timeout)
                done = fut.done()
                layer0 = [torch.equal(relkit.read_chunk(kv, blocks_for(j, bpc, base))[0],
                                      relkit.expected(shape, args.model, args.rank, h, bpc)[0])
                          for j, h in enumerate(keys)]
                emit("layer0", done=done, right=layer0)
            r = fut.result(timeout=args.timeout)
            emit("retrieved", loaded=r.loaded, missing=r.missing,
                 corrupt=check(args, shape, kv, bpc, keys, base, r.loaded))
    except Exception as exc:
        emit("failed", error=f"{type(exc).__name__}: {exc}")
    sys.stdin.readline()


def soak(args) -> None:
    client, ctx, shape, bpc = connect(args)
    kv = ctx._kv
    emit("ready", instance_id=ctx.instance_id)
    if sys.stdin.readline().strip() != "go":
        return
    chunk_bytes = shape.chunk_bytes(client.chunk_size)
    half = (shape.num_blocks // 2) // bpc
    n_chunks = min(args.chunks, half)
    stored = retrieved = corrupt = missing = failed = 0
    store_s = retrieve_s = 0.0
    t0 = time.monotonic()
    for it in range(args.iters):
        keys = [relkit.key(f"{args.model}/{args.tag}/{it}", j) for j in range(n_chunks)]
        exp = [relkit.expected(shape, args.model, args.rank, h, bpc) for h in keys]
        ids = fill(args, shape, kv, bpc, keys, 0, exp)
        a = time.monotonic()
        res = ctx.submit_store(keys, ids).result(timeout=args.timeout)
        b = time.monotonic()
        store_s += b - a
        stored += len(res.stored) + len(res.present)
        failed += len(res.failed)
        base = n_chunks * bpc
        for layer in kv:
            layer[:, base: base + n_chunks * bpc].zero_()
        a = time.monotonic()
        r = ctx.submit_retrieve(keys, [i + base for i in ids]).result(timeout=args.timeout)
        retrieve_s += time.monotonic() - a
        retrieved += len(r.loaded)
        missing += len(r.missing)
        corrupt += check(args, shape, kv, bpc, keys, base, r.loaded, exp)
    t1 = time.monotonic()
    emit("done", rank=args.rank, stored=stored, failed=failed, retrieved=retrieved, missing=missing,
         corrupt=corrupt, chunk_bytes=chunk_bytes, store_s=store_s, retrieve_s=retrieve_s, t0=t0, t1=t1)
    ctx.close()
    client.close()


def race(args) -> None:
    client, ctx, shape, bpc = connect(args)
    kv = ctx._kv
    emit("ready", instance_id=ctx.instance_id)
    if sys.stdin.readline().strip() != "go":
        return
    n = args.chunks
    own = other = mixed = loaded = stored = 0
    base = n * bpc
    for it in range(args.iters):
        keys = [relkit.key(f"{args.model}/{it}", j) for j in range(n)]
        versions = [[relkit.expected(shape, f"{args.model}#{v}", args.rank, h, bpc) for h in keys]
                    for v in range(args.versions)]
        ids = fill(args, shape, kv, bpc, keys, 0, versions[int(args.tag)])
        stored += len(ctx.submit_store(keys, ids).result(timeout=args.timeout).stored)
        for layer in kv:
            layer[:, base:base + n * bpc].zero_()
        r = ctx.submit_retrieve(keys, [i + base for i in ids]).result(timeout=args.timeout)
        for j in r.loaded:
            got = relkit.read_chunk(kv, blocks_for(j, bpc, base))
            match = [v for v in range(args.versions) if torch.equal(got, versions[v][j])]
            loaded += 1
            if not match:
                mixed += 1
            elif match == [int(args.tag)]:
                own += 1
            else:
                other += 1
    emit("done", stored=stored, loaded=loaded, own=own, other=other, mixed=mixed)
    ctx.close()
    client.close()


def main() -> None:
    torch.set_num_threads(1)  # many workers share few cores: no oversubscribed thread pools
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["store-loop", "retrieve-loop", "hold-write", "hold-read", "freeze-write",
                                    "freeze-read", "soak", "race"])
    p.add_argument("--url", required=True)
    p.add_argument("--curve-dir", default=None)
    p.add_argument("--model", default="m")
    p.add_argument("--tag", default="")
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--versions", type=int, default=1)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--by-layer", action="store_true", help="freeze-read: a layer-wise retrieve")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--num-blocks", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    args = p.parse_args()
    try:
        {"store-loop": store_loop, "retrieve-loop": retrieve_loop, "soak": soak, "race": race,
         "hold-write": lambda a: hold(a, True), "hold-read": lambda a: hold(a, False),
         "freeze-write": lambda a: freeze(a, True), "freeze-read": lambda a: freeze(a, False)}[args.mode](args)
    except Exception as exc:
        emit("error", error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        sys.exit(1)


if __name__ == "__main__":
    main()
