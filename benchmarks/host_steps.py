#!/usr/bin/env python3
"""What one step of a lone request's control path costs on this host: back to back, after an
idle gap, and after the same gap spent spinning.

A lone request's time before its first copy is a chain of small steps: Python, small torch
operations on the CPU (the copy plan's views and index arithmetic), system calls, thread
hand-offs and CUDA API calls (an event recorded, a stream made to wait, a copy queued). This
times each kind on its own, one call at a time, in three conditions:

* ``hot``: each call right after the one before;
* ``idle``: each call after ``--gap-ms`` of sleep, as a lone request comes (the CPU may have
  lowered its clock or been given to another guest, its caches refilled by others);
* ``spun``: each call after ``--gap-ms`` of busy waiting (the thread kept running);
* ``warmed``: each call after ``--gap-ms`` of sleep while another thread made the same call
  every millisecond (what ``kvxfer serve --warm-us 1000`` does for the server's steps).

The same probes run on any host (the CUDA ones where a GPU is visible), so two hosts' tables say
how much of a lone request's head is the host's rather than the code's: the same Python and
torch steps, the same CUDA calls, side by side.

    python benchmarks/host_steps.py --iters 400 --gap-ms 5 --json benchmarks/results/

Prints a table of each probe's p50 (and p90) in microseconds per condition, and writes the same
as JSON with the run (commit, date, machine) and the host's CPU model and kernel.
"""

from __future__ import annotations

import argparse
import os
import platform
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

CONDITIONS = ("hot", "idle", "spun", "warmed")
#: The warming thread's period in the ``warmed`` condition (as ``kvxfer serve --warm-us 1000``).
WARM_PERIOD_S = 1e-3


def _python_unit() -> int:
    """A fixed piece of interpreter work (a dict and a sum, as request handling does)."""
    d = {}
    for i in range(64):
        d[i] = i * 2
    return sum(d.values())


def _thread_round_trip() -> tuple[Callable[[], object], Callable[[], None]]:
    """A hand-off to a waiting thread and back (two futex wake-ups), and its stop."""
    there: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    back: queue.SimpleQueue[int] = queue.SimpleQueue()

    def echo() -> None:
        while (item := there.get()) is not None:
            back.put(item)

    t = threading.Thread(target=echo, name="host-steps-echo", daemon=True)
    t.start()

    def once() -> int:
        there.put(1)
        return back.get()

    def stop() -> None:
        there.put(None)
        t.join()

    return once, stop


def probes(device: str) -> tuple[dict[str, Callable[[], object]], list[Callable[[], None]]]:
    """The probes by name, and what stops them."""
    import torch

    arena = torch.zeros(1 << 20, dtype=torch.uint8)
    a = torch.arange(128, dtype=torch.int64)
    thread_rt, stop = _thread_round_trip()
    out: dict[str, Callable[[], object]] = {
        "python (64 dict items and a sum)": _python_unit,
        "torch view (uint8 slot as [layers, rows, row])": lambda: arena.view(torch.bfloat16).view(32, 16, 1024),
        "torch op (128 int64: a * 3 + a)": lambda: a * 3 + a,
        "system call (getppid)": os.getppid,
        "thread hand-off and back": thread_rt,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        dev = torch.device(device)
        stream = torch.cuda.Stream(dev)
        ev = torch.cuda.Event()
        ev.record(stream)
        src = torch.zeros(4096, dtype=torch.uint8).pin_memory()
        dst = torch.empty(4096, dtype=torch.uint8, device=dev)

        def copy() -> None:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)

        out.update({
            "CUDA event record": lambda: ev.record(stream),
            "CUDA stream waits on an event": lambda: stream.wait_event(ev),
            "CUDA event query": ev.query,
            "CUDA copy queued (4 KiB, pinned -> device)": copy,
        })
    return out, [stop]


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def measure(fn: Callable[[], object], iters: int, gap_s: float, condition: str) -> list[float]:
    """``iters`` timings of one call of ``fn`` in microseconds, each after ``condition``."""
    out = []
    lock = threading.Lock()  # the timed call and the warming thread's calls never overlap
    stop = threading.Event()

    def warm() -> None:
        while not stop.wait(WARM_PERIOD_S):
            with lock:
                fn()

    warmer = threading.Thread(target=warm, daemon=True) if condition == "warmed" else None
    if warmer is not None:
        warmer.start()
    try:
        for _ in range(iters):
            if condition in ("idle", "warmed"):
                time.sleep(gap_s)
            elif condition == "spun":
                _spin(gap_s)
            with lock:
                t0 = time.perf_counter_ns()
                fn()
                out.append((time.perf_counter_ns() - t0) / 1e3)
    finally:
        stop.set()
        if warmer is not None:
            warmer.join()
    return out


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def host_facts() -> dict[str, Any]:
    """The CPU model, kernel and (where a GPU is visible) the GPU's name."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    facts: dict[str, Any] = {"cpu_model": model, "kernel": platform.release(), "cpus": os.cpu_count()}
    try:
        import torch

        if torch.cuda.is_available():
            facts["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return facts


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvxfer.bench import progress_bar

    table, stops = probes(args.device)
    gap = args.gap_ms / 1e3
    rows = []
    bar = progress_bar(len(table) * len(CONDITIONS), "host steps")
    try:
        for name, fn in table.items():
            measure(fn, args.warmup, 0.0, "hot")
            row: dict[str, Any] = {"probe": name}
            for cond in CONDITIONS:
                us = measure(fn, args.iters, gap, cond)
                row[cond] = {"p50_us": statistics.median(us), "p90_us": _quantile(us, 0.9), "min_us": min(us)}
                bar.update(1)
            rows.append(row)
    finally:
        bar.close()
        for stop in stops:
            stop()
    return {"host": host_facts(), "probes": rows}


def print_table(result: dict[str, Any], gap_ms: float) -> None:
    from kvxfer.text_table import print_table as show

    host = result["host"]
    print(f"{host['cpu_model'] or 'unknown CPU'}, {host['cpus']} CPUs, kernel {host['kernel']}"
          + (f", {host['gpu']}" if host.get("gpu") else ""))
    print(f"one call, p50 (p90) in us; idle and spun: after {gap_ms:g} ms of sleep or of busy waiting; warmed: "
          f"after {gap_ms:g} ms of sleep while another thread made the call every {WARM_PERIOD_S * 1e3:g} ms")
    show([[r["probe"], *(f"{r[c]['p50_us']:.2f} ({r[c]['p90_us']:.2f})" for c in CONDITIONS),
           f"{r['idle']['p50_us'] / max(r['hot']['p50_us'], 1e-3):.1f}x"] for r in result["probes"]],
         ["probe", *CONDITIONS, "idle / hot"])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=400, help="timed calls per probe and condition (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=200, help="untimed calls first (default: %(default)s)")
    p.add_argument("--gap-ms", type=float, default=5.0, help="sleep or spin before each idle, spun or warmed call "
                                                              "(default: %(default)s)")
    p.add_argument("--device", default="cuda", help="CUDA probes on this device, when one is visible "
                                                     "(default: %(default)s)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write the results here (a directory: a file named by date and commit)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        raise SystemExit("--iters must be >= 1 and --warmup >= 0")
    if not 0 <= args.gap_ms <= 1000:
        raise SystemExit(f"--gap-ms must be in [0, 1000], got {args.gap_ms:g}")
    result = run(args)
    print_table(result, args.gap_ms)
    if args.json:
        from kvxfer.bench import write_results

        print(f"wrote {write_results(args.json, 'host-steps', {'args': vars(args), **result})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
