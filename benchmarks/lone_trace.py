"""Where the time of a lone request goes: the steps of a lone prefix load and store, timed in both
processes.

Starts a kvxfer server in a child process and runs lone requests from this one, as ``kvxfer
bench --prefix`` does (a store of a fresh prefix; then ``lookup_and_lease`` and
``submit_retrieve`` of the prefix stored before, waited for), with ``--gap-ms`` of idleness
before each, as a prompt's load comes. In both processes the functions named in ``STEPS`` (and
``--step MODULE:QUALNAME``) are wrapped to record when each call starts and ends
(``time.perf_counter_ns``: on Linux ``CLOCK_MONOTONIC``, one clock for both processes), with the
name of its thread. Per request, each step's first start and last end are taken relative to the
request's start; the table shows their medians over the requests, in order of start, and the
request's own median. The wrappers cost about a microsecond per call: a trace of a lone 8-chunk
load on a GPU ran within the run-to-run spread of untraced ones.

The steps a request waits for and nothing overlaps are what a lone request pays beyond its copy:
the gaps between one process's send and the other's ``MQServer._handle`` or ``MQClient._drain``
are the messaging layer's thread wake-ups; the server's steps before the transport's first copy
are planning. A step missing from a run (another transport's, or absent in this version) is
listed under ``absent`` in the JSON and skipped.

    python benchmarks/lone_trace.py --transport cuda_ipc --device cuda --chunks 8 --iters 30 --json DIR
"""

from __future__ import annotations

import argparse
import atexit
import functools
import importlib
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

#: ``module:qualname`` of the functions timed by default: the client's and server's steps of a
#: lookup, a retrieve and a store, for both styles, and the built-in transports' copy steps.
STEPS = [
    "kvxfer.client:CacheClient.lookup_and_lease",
    "kvxfer.transport._context:ContextCore.submit_retrieve",
    "kvxfer.transport._context:ContextCore.submit_store",
    "kvxfer.copies:check_transfer",
    "kvxfer.copies:plan_copies",
    "kvxfer.mq.client:MQClient._send",
    "kvxfer.mq.client:MQClient._drain",
    "kvxfer.mq.server:MQServer._handle",
    "kvxfer.mq.server:MQServer.send",
    "kvxfer.server.engine:CacheServer._on_lookup",
    "kvxfer.server.engine:CacheServer._on_retrieve",
    "kvxfer.server.engine:CacheServer._on_store",
    "kvxfer.server.engine:CacheServer._on_reserve_read",
    "kvxfer.server.engine:CacheServer._on_reserve_write",
    "kvxfer.server.engine:CacheServer._on_commit_read",
    "kvxfer.server.engine:CacheServer._on_commit_write",
    "kvxfer.server.engine:CacheServer._run_deferred",
    "kvxfer.server.engine:CacheServer._prefetch",
    "kvxfer.transport._client_driven:ClientDrivenCore._retrieve",
    "kvxfer.transport._client_driven:ClientDrivenCore._store",
    "kvxfer_cpu_gather.transport:CpuGatherContext.gather",
    "kvxfer_cpu_gather.transport:CpuGatherContext.scatter",
    "kvxfer_hpu.transport:HpuContext.gather",
    "kvxfer_hpu.transport:HpuContext.scatter",
    "kvxfer_cuda_ipc.transport:CudaIpcContext.prepare",
    "kvxfer_cuda_ipc.transport:CudaIpcContext.finish_retrieve",
    "kvxfer_cuda_ipc.server:CudaIpcServerContext._transfer",
    "kvxfer_cuda_ipc.server:CudaIpcServerContext.prefetch",
    "kvxfer_cuda_ipc.server:CudaIpcServerContext._upload_rows",
    "kvxfer_cuda_ipc.server:_copy",
]


class Recorder:
    """Wraps functions to record ``(start_ns, end_ns, thread name, step)`` of every call."""

    def __init__(self) -> None:
        self.events: list[tuple[int, int, str, str]] = []
        self.absent: list[str] = []

    def install(self, steps: Sequence[str]) -> None:
        """Wrap each ``module:qualname`` (in this process), and every reference to it that
        modules imported so far hold (``from module import name``)."""
        for spec in steps:
            mod_name, _, qual = spec.partition(":")
            try:
                owner: Any = importlib.import_module(mod_name)
                *path, attr = qual.split(".")
                for part in path:
                    owner = getattr(owner, part)
                original = getattr(owner, attr)
            except (ImportError, AttributeError):
                self.absent.append(spec)
                continue
            wrapped = self._wrap(original, qual)
            setattr(owner, attr, wrapped)
            if not path:
                for mod in list(sys.modules.values()):
                    if getattr(mod, attr, None) is original:
                        setattr(mod, attr, wrapped)

    def _wrap(self, fn: Callable[..., Any], step: str) -> Callable[..., Any]:
        clock, record = time.perf_counter_ns, self.events.append

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                record((start, clock(), threading.current_thread().name, step))

        return timed

    def mark(self, step: str, start: int, end: int) -> None:
        self.events.append((start, end, threading.current_thread().name, step))

    def dump(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(json.dumps({"events": self.events, "absent": self.absent}))


def serve_traced(out: str, argv: list[str]) -> int:
    """The server half: ``kvxfer serve`` with :data:`STEPS` (and ``KVXFER_TRACE_STEPS``) wrapped;
    the events are written to ``out`` when it stops."""
    rec = Recorder()
    rec.install(STEPS + [s for s in os.environ.get("KVXFER_TRACE_STEPS", "").split(",") if s])
    atexit.register(rec.dump, out)
    from kvxfer.cli import main

    return main(argv)


def _windows(events: list[tuple[int, int, str, str]]) -> dict[str, list[tuple[int, int]]]:
    """The requests' spans by kind (the ``request.*`` marks of the driver)."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for start, end, _, step in events:
        if step.startswith("request."):
            spans.setdefault(step.removeprefix("request."), []).append((start, end))
    return spans


def timeline(client: list[tuple[int, int, str, str]], server: list[tuple[int, int, str, str]],
             start: int, end: int) -> dict[tuple[str, str, str, int], tuple[float, float]]:
    """Each call of a step in ``[start, end)``: its start and end in microseconds after
    ``start``, keyed by (process, thread, step, its call number in the window)."""
    out: dict[tuple[str, str, str, int], tuple[float, float]] = {}
    for side, events in (("client", client), ("server", server)):
        calls: dict[tuple[str, str], int] = {}
        for a, b, thread, step in sorted(events):
            if not start <= a < end or step.startswith("request."):
                continue
            k = calls[(thread, step)] = calls.get((thread, step), 0) + 1
            out[(side, thread, step, k)] = ((a - start) / 1e3, (b - start) / 1e3)
    return out


def summarize(client: list[tuple[int, int, str, str]], server: list[tuple[int, int, str, str]]
              ) -> dict[str, dict[str, Any]]:
    """Per kind of request: its median duration and each call's median start and end over the
    requests (calls seen in at least half of them), in order of start."""
    result: dict[str, dict[str, Any]] = {}
    for kind, spans in _windows(client).items():
        per = [timeline(client, server, a, b) for a, b in spans]
        rows: list[dict[str, Any]] = []
        for key in {k for t in per for k in t}:
            seen = [t[key] for t in per if key in t]
            if len(seen) * 2 < len(per):
                continue
            rows.append({"process": key[0], "thread": key[1], "step": key[2], "call": key[3], "seen": len(seen),
                         "start_us": statistics.median(s[0] for s in seen),
                         "end_us": statistics.median(s[1] for s in seen)})
        rows.sort(key=lambda r: (r["start_us"], -r["end_us"]))
        result[kind] = {"requests": len(spans), "median_us": statistics.median((b - a) / 1e3 for a, b in spans),
                        "steps": rows}
    return result


def _thread(name: str) -> str:
    """Thread names without their per-instance suffixes (pool numbers, the server's url)."""
    return name.split(" ")[0].split("-ipc:")[0].split("-tcp:")[0][:24]


def print_summary(summary: dict[str, dict[str, Any]]) -> None:
    from kvxfer.text_table import print_table

    for kind, s in summary.items():
        print(f"\n{kind}: {s['requests']} lone requests, median {s['median_us']:.0f} us "
              "(each call: median start and end after the request's start)")
        print_table([(r["process"], _thread(r["thread"]), r["step"] + (f" #{r['call']}" if r["call"] > 1 else ""),
                      f"{r['start_us']:.0f}", f"{r['end_us']:.0f}", f"{r['end_us'] - r['start_us']:.0f}")
                     for r in s["steps"]],
                    ["process", "thread", "step", "start us", "end us", "span us"])


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from kvxfer.bench import _sync, progress_bar, server_tuning_args
    from kvxfer.bench_prefix import make_workload
    from kvxfer.testing.server import ServerProcess

    tmp = Path(args.work_dir)
    server_events = tmp / "server-events.json"
    rec = Recorder()
    rec.install(STEPS + args.step)
    from kvxfer.client import CacheClient
    from kvxfer.hashing import chunk_hashes

    device, n, bs, chunk = torch.device(args.device), args.chunks, args.block_size, args.chunk_size
    bpc = chunk // bs
    blocks = max(args.blocks, 2 * n * bpc)
    layout, kv = make_workload(args, blocks)
    server = ServerProcess(l1_size=str(3 * n * layout.chunk_bytes(chunk) + (64 << 20)), chunk_size=chunk,
                           transports=args.transport, env={"KVXFER_TRACE_STEPS": ",".join(args.step)},
                           extra_args=server_tuning_args(args))
    server.args[1:3] = [str(Path(__file__).resolve()), "--serve-traced", str(server_events)]
    server.start()
    gen = torch.Generator().manual_seed(0)
    try:
        client = CacheClient(server.url)
        model = f"trace-{os.getpid()}"
        ctx = client.register(kv, model_name=model, block_size=bs, transport=args.transport, layout=args.layout)
        previous: list[bytes] | None = None
        bar = progress_bar(args.iters + 2, f"lone requests {args.transport}")
        for it in range(args.iters + 2):  # 0: a store only; 1: the warm-up load
            tokens = torch.randint(0, 50000, (n * chunk,), generator=gen)
            tokens[0] = it
            keys = chunk_hashes(tokens.tolist(), chunk)
            src = torch.randperm(blocks, generator=gen)[:n * bpc]
            time.sleep(args.gap_ms / 1e3)
            _sync(device)
            t0 = time.perf_counter_ns()
            ctx.submit_store(keys, src.tolist()).result(timeout=300)
            t1 = time.perf_counter_ns()
            if it >= 2:
                rec.mark("request.store", t0, t1)
            if previous is not None:
                dst = torch.randperm(blocks, generator=gen)[:n * bpc]
                time.sleep(args.gap_ms / 1e3)
                _sync(device)
                t0 = time.perf_counter_ns()
                reply = client.lookup_and_lease(model, 1, hashes=previous, lease_s=60.0, prefetch=args.prefetch)
                got = ctx.submit_retrieve(previous[:reply.hits], dst.tolist(), lease_id=reply.lease_id).result(
                    timeout=300)
                _sync(device)
                t1 = time.perf_counter_ns()
                if reply.hits != n or got.missing:
                    raise SystemExit(f"a lone load missed chunks: {reply.hits} of {n} hit, {got}")
                if it >= 2:
                    rec.mark("request.load", t0, t1)
            previous = keys
            bar.update(1)
        bar.close()
        ctx.close()
        client.close()
    finally:
        server.stop()
    data = json.loads(server_events.read_text())
    summary = summarize(rec.events, [tuple(e) for e in data["events"]])
    return {"summary": summary, "absent": sorted(set(rec.absent) & set(data["absent"]))}


def build_parser() -> argparse.ArgumentParser:
    from kvxfer.bench import add_server_tuning_arguments
    from kvxfer.bench_prefix import add_workload_arguments

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(p)
    add_server_tuning_arguments(p)
    p.add_argument("--chunks", type=int, default=8, help="chunks per request (default: %(default)s)")
    p.add_argument("--iters", type=int, default=30, help="timed lone loads and stores (default: %(default)s)")
    p.add_argument("--gap-ms", type=float, default=5.0, help="idle time before each request (default: %(default)s)")
    p.add_argument("--prefetch", action="store_true", help="lookups ask the server to prefetch (as the vLLM "
                                                            "connector's do)")
    p.add_argument("--step", action="append", default=[], metavar="MODULE:QUALNAME",
                   help="also time this function (repeatable)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write the results here (a directory: a file named by date and commit)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--serve-traced"]:
        return serve_traced(argv[1], argv[2:])
    args = build_parser().parse_args(argv)
    import tempfile

    from kvxfer.bench import save_results

    with tempfile.TemporaryDirectory(prefix="kvxfer-trace-") as work:
        args.work_dir = work
        result = run(args)
    print_summary(result["summary"])
    del args.work_dir
    save_results(args, "lone-trace", {"args": vars(args), **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
