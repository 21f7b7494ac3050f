"""Transfer benchmark: store and retrieve throughput against a real server, with the physical
limit of the same bytes measured in the same run as the denominator.

Denominators: on CPU a one-thread memcpy (``torch.Tensor.copy_``) of the bytes of one request
between buffers that are not in the CPU's caches (as the transfer's source blocks and fresh arena
slots are not: :class:`CopyLimit`; the warm-buffer and the multi-threaded memcpy are recorded
too); on CUDA a pinned
host<->device copy of them (device->host for stores, host->device for retrieves). Every request
stores fresh chunks (no dedupe) from random blocks, and retrieves them into other random blocks;
the first request of each configuration is a warm-up. ``--prefix`` runs the prefix-load
benchmark instead (:mod:`kvxfer.bench_prefix`).

Run ``kvxfer bench --help`` or ``python benchmarks/transfer.py --help``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvxfer.cli import add_client_curve_arguments, client_curve, positive_int
from kvxfer.client import CacheClient
from kvxfer.errors import ConfigError
from kvxfer.layout import KVLayout, LayoutKind, dtype_from_name
from kvxfer.protocol import messages as m
from kvxfer.units import format_bytes

__all__ = [
    "CopyLimit",
    "add_kv_cache_arguments",
    "add_server_tuning_arguments",
    "json_target",
    "main",
    "physical_limit",
    "progress_bar",
    "run",
    "run_record",
    "save_results",
    "server_tuning_args",
    "usable_device",
    "write_results",
]

GB = 1e9


def usable_device(name: str) -> str:
    """An argparse type: a torch device this process can allocate on (checked before any work)."""
    try:
        torch.empty(1, device=torch.device(name))
    except Exception as exc:  # noqa: BLE001  (torch says why in many ways: RuntimeError, AssertionError, ...)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise argparse.ArgumentTypeError(f"{name!r} is not usable here (torch {torch.__version__}): {first}") from None
    return name


def _memory_for(device: torch.device) -> tuple[int, str]:
    """Bytes a KV cache on ``device`` can take at most now, and what they are."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"free memory of {device}"
    try:  # what the kernel can give without swapping
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) << 10, "this host's available memory"
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "this host's memory"


def check_kv_fits(layout: KVLayout, heads: int, device: torch.device, copies: int = 1) -> None:
    """ConfigError before anything is allocated where ``copies`` KV caches of ``layout`` (its
    layers of ``layout.layer_shape(heads)``) would not fit in ``device``'s memory: torch would
    fail after a long while, or the host would swap."""
    nbytes = copies * layout.num_layers * math.prod(layout.layer_shape(heads)) * layout.dtype.itemsize
    have, what = _memory_for(device)
    if nbytes > have:
        raise ConfigError(f"the KV cache would take {format_bytes(nbytes)} ({copies} x {layout.num_layers} layers x "
                          f"{list(layout.layer_shape(heads))}), more than {what} ({format_bytes(have)}): pass "
                          "fewer --layers or --blocks")


def json_target(path: str) -> str:
    """An argparse type: where ``--json`` may write (a directory, made if missing, or a file in
    one), checked before the run rather than after it."""
    from pathlib import Path

    out = Path(path)
    folder = out if path.endswith("/") or out.is_dir() else out.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write into {folder}: {exc.strerror or exc}") from None
    return path


def run_record() -> dict[str, Any]:
    """What every benchmark's JSON records about its run: the git commit of the checkout it ran
    from (``+dirty`` with uncommitted changes; ``unknown`` outside a checkout), the UTC date and
    time, the machine, its CPUs, Python and torch."""
    import subprocess
    from pathlib import Path

    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=here, capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        commit += "+dirty" if dirty else ""
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return {"commit": commit, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__}


def save_results(args: argparse.Namespace, kind: str, payload: dict[str, Any]) -> None:
    """With ``--json``: write ``payload`` and the GPU's name as ``<kind>-<transport>-<device>``
    (:func:`write_results`) and say where."""
    if args.json:
        gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else None
        name = f"{kind}-{args.transport}-{args.device}"
        print(f"wrote {write_results(args.json, name, {'gpu': gpu, **payload})}")


def write_results(path: str | os.PathLike[str], benchmark: str, payload: dict[str, Any]) -> str:
    """Write ``payload`` plus :func:`run_record` (key ``"run"``) as JSON. A ``path`` that is a
    directory (or ends with ``/``) gets a file named by date, commit and benchmark:
    ``<dir>/<YYYY-MM-DD>-<commit>-<benchmark>.json``, or ``...-<benchmark>-2.json`` (3, ...) where
    that exists: runs of one day and commit (rounds of a comparison) never replace each other's.
    Returns the path written."""
    from pathlib import Path

    run = run_record()
    out = Path(path)
    text = json.dumps({"run": run, **payload}, indent=2) + "\n"
    if not (str(path).endswith("/") or out.is_dir()):
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{run['time'][:10]}-{run['commit'].replace('+', '-')}-{benchmark}"
    for n in itertools.count(1):
        name = out / (f"{stem}.json" if n == 1 else f"{stem}-{n}.json")
        try:
            with open(name, "x") as f:
                f.write(text)
            return str(name)
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def progress_bar(total: int, desc: str) -> Any:
    """A tqdm bar on stderr (``update``/``close``), or a plain counter when tqdm is absent;
    shared by every benchmark under benchmarks/."""
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="req", leave=False, file=sys.stderr)
    except ImportError:  # tqdm is optional: a plain counter on stderr
        class _Bar:
            n = 0

            def update(self, k: int = 1) -> None:
                self.n += k
                print(f"\r{desc}: {self.n}/{total}", end="", file=sys.stderr, flush=True)

            def close(self) -> None:
                print(file=sys.stderr)

        return _Bar()


def add_server_tuning_arguments(p: argparse.ArgumentParser) -> None:
    """``--busy-poll-us`` and ``--warm-us``: the started server's ``kvxfer serve`` options of the
    same names (every benchmark that starts a server for lone requests takes them, to compare
    both settings in the same run)."""
    p.add_argument("--busy-poll-us", type=float, default=0.0, metavar="US",
                   help="the started server's --busy-poll-us (default: %(default)g, off); with --url it is "
                        "ignored: start that server with it")
    p.add_argument("--warm-us", type=float, default=0.0, metavar="US",
                   help="the started server's --warm-us (default: %(default)g, off); with --url it is "
                        "ignored: start that server with it")


def server_tuning_args(args: argparse.Namespace) -> list[str]:
    """The ``kvxfer serve`` arguments of :func:`add_server_tuning_arguments`'s options."""
    out = [f"--busy-poll-us={args.busy_poll_us:g}"] if args.busy_poll_us else []
    return [*out, f"--warm-us={args.warm_us:g}"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / GB


#: A memcpy denominator copies between buffers that together hold at least this much, in turn,
#: so that neither side is in the CPU's caches (the transfer's own source blocks and fresh
#: arena slots are not): repeating one copy of a few MiB between two warm buffers measures the
#: last-level cache, not memory.
COLD_POOL_BYTES = 1 << 30


class CopyLimit:
    """The copy a transfer of ``nbytes`` cannot beat, timed on demand: on CUDA a pinned
    device->host (``"store"``) or host->device (``"retrieve"``) copy; on CPU a memcpy (torch
    ``copy_`` on ``threads`` threads, default one, as a libc memcpy and as cpu_gather copies)
    between buffers rotated over :data:`COLD_POOL_BYTES` (``cold=False``: between the same two
    warm buffers every time, which the caches serve in part below ~L3 size)."""

    def __init__(self, nbytes: int, device: torch.device, cold: bool = True, threads: int = 1) -> None:
        self.nbytes = nbytes
        self.device = device
        self.threads = threads
        self.at = 0
        if device.type == "cuda":
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
            host.fill_(1)
            dev.fill_(2)
            self.pairs = {"store": [(host, dev)], "retrieve": [(dev, host)]}
            self.what = "pinned D2H / H2D"
        else:
            n = max(1, -(-COLD_POOL_BYTES // (2 * nbytes))) if cold else 1
            bufs = [(torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)) for _ in range(n)]
            self.pairs = {"store": [(d, s) for s, d in bufs], "retrieve": [(d, s) for s, d in bufs]}
            self.what = ("memcpy (cold" if cold else "memcpy (warm") + (f", {threads} threads)" if threads > 1 else ")")

    def time(self, kind: str) -> float:
        """Seconds of one copy for a ``kind`` ("store" or "retrieve") of ``nbytes``."""
        pairs = self.pairs[kind]
        dst, src = pairs[self.at % len(pairs)]
        self.at += 1
        before = torch.get_num_threads()
        if self.device.type != "cuda":
            torch.set_num_threads(self.threads)  # this thread's setting only
        try:
            _sync(self.device)
            t = time.perf_counter()
            dst.copy_(src, non_blocking=self.device.type == "cuda")
            _sync(self.device)
            return time.perf_counter() - t
        finally:
            torch.set_num_threads(before)


def physical_limit(nbytes: int, device: torch.device, repeats: int = 7) -> dict[str, Any]:
    """GB/s of the copy a transfer cannot beat, for ``nbytes`` (:class:`CopyLimit`, medians of
    ``repeats`` runs after a warm-up); on CPU also the warm-buffer memcpy, for reference."""
    out: dict[str, Any] = {}
    limit = CopyLimit(nbytes, device)
    for kind in ("store", "retrieve"):
        times = [limit.time(kind) for _ in range(repeats + 1)]
        out[f"{kind}_limit"] = _median_gbps(nbytes, times[1:])
    out["limit"] = limit.what
    del limit
    if device.type != "cuda":  # for reference: warm buffers, and torch's own thread count
        warm = CopyLimit(nbytes, device, cold=False)
        out["warm_memcpy"] = _median_gbps(nbytes, [warm.time("store") for _ in range(repeats + 1)][1:])
        del warm
        wide = CopyLimit(nbytes, device, threads=torch.get_num_threads())
        out["parallel_memcpy"] = _median_gbps(nbytes, [wide.time("store") for _ in range(repeats + 1)][1:])
    return out


def _check_moved(result: m.StoreResult | m.RetrieveResult) -> None:
    """A timed request that did not move every chunk would inflate the figures: stop."""
    if result.failed if isinstance(result, m.StoreResult) else result.missing:
        raise SystemExit(f"benchmark request did not move every chunk (an --l1-size too small?): {result}")


def _timed(ctx: Any, reqs: list[tuple[list[bytes], torch.Tensor, torch.Tensor]], inflight: int,
           device: torch.device, bar: Any) -> tuple[list[float], list[float]]:
    """Store every request, then retrieve every one. With ``inflight`` 1: each request alone,
    one duration per request. With more: up to ``inflight`` outstanding, one duration per phase
    (a round: :func:`run` times several, each with requests of its own)."""
    if inflight == 1:
        store_t, retr_t = [], []
        for keys, src, dst in reqs:
            _sync(device)
            t0 = time.perf_counter()
            res = ctx.submit_store(keys, src).result(timeout=300)
            t1 = time.perf_counter()
            got = ctx.submit_retrieve(keys, dst).result(timeout=300)
            _sync(device)
            t2 = time.perf_counter()
            _check_moved(res)
            _check_moved(got)
            store_t.append(t1 - t0)
            retr_t.append(t2 - t1)
            bar.update(1)
        return store_t, retr_t
    phases = []
    for phase in ("store", "retrieve"):
        _sync(device)
        t0 = time.perf_counter()
        window: list[Any] = []
        for keys, src, dst in reqs:
            if len(window) == inflight:
                _check_moved(window.pop(0).result(timeout=300))
            window.append(ctx.submit_store(keys, src) if phase == "store" else ctx.submit_retrieve(keys, dst))
        for fut in window:
            _check_moved(fut.result(timeout=300))
        _sync(device)
        phases.append([time.perf_counter() - t0])
    bar.update(len(reqs))
    return phases[0], phases[1]


def bench_model_name(what: str, layout: KVLayout, chunk_size: int) -> str:
    """The model name a benchmark registers under: one per chunk format (a server keeps one
    format per name), the same for every run, so that runs against a long-lived server
    (``--url``) take one of its ``--metrics-max-models`` labels per format, not one each. Runs
    salt their prefixes (:func:`run_salt`), so that none finds an earlier run's chunks."""
    return f"kvxfer-{what}-{layout.chunk_format(chunk_size)}"


def run_salt() -> str:
    """A salt for one run's chunk hashes: its prefixes are its own (no dedupe against earlier
    runs, or runs beside it, on the same server)."""
    return secrets.token_hex(8)


def _requests(n: int, counter: int, cpr: int, chunk_size: int, bpc: int, num_blocks: int,
              gen: torch.Generator, salt: str) -> list[tuple[list[bytes], torch.Tensor, torch.Tensor]]:
    """``n`` requests of ``cpr`` chunks each: (chunk hashes, source blocks, destination blocks),
    random blocks, a prefix of its own each (``counter`` + 1, + 2, ..., and the run's ``salt``:
    no dedupe)."""
    from kvxfer.hashing import chunk_hashes

    out = []
    for i in range(n):
        tokens = torch.randint(0, 50000, (cpr * chunk_size,), generator=gen)
        tokens[0] = counter + 1 + i
        perm = torch.randperm(num_blocks, generator=gen)
        out.append((chunk_hashes(tokens.tolist(), chunk_size, salt=salt), perm[:cpr * bpc],
                    perm[cpr * bpc:2 * cpr * bpc]))
    return out


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from kvxfer.testing.server import ServerProcess, transports_for

    # an unknown transport is refused before the KV cache is made (seconds at the default sizes)
    server_transports = transports_for(args.transport, args.server_transports) if args.url is None else ""
    device = torch.device(args.device)
    dtype = dtype_from_name(args.dtype)
    kind = LayoutKind(args.layout)
    heads, head_size, bs = args.heads, args.head_size, args.block_size
    results = []
    max_cpr = max(args.chunks_per_request)
    for chunk_size in args.chunk_sizes:
        bpc = chunk_size // bs
        num_blocks = max(2 * max_cpr * bpc, args.blocks)
        layout = KVLayout(kind, args.layers, num_blocks, bs, heads * head_size, dtype)
        check_kv_fits(layout, heads, device)
        shape = layout.layer_shape(heads)
        gen = torch.Generator().manual_seed(0)
        kv = []
        for _ in range(args.layers):
            t = torch.empty(shape, dtype=dtype, device=device)
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8,
                                                    generator=gen).to(device))
            kv.append(t)
        chunk_bytes = layout.chunk_bytes(chunk_size)
        total_reqs = sum(args.iters * (args.rounds if n > 1 else 1) + 1 for n in args.inflight) * len(
            args.chunks_per_request)
        # room for one round's requests (each round stores, then retrieves, all of its own; the
        # server evicts the rounds and settings before)
        l1 = args.l1_size or f"{int((args.iters + 1) * max_cpr * chunk_bytes * 1.1) + (64 << 20)}"
        server = None
        url = args.url
        if url is None:
            server = ServerProcess(l1_size=str(l1), chunk_size=chunk_size,
                                   transports=server_transports,
                                   extra_args=server_tuning_args(args))
            server.start()
            url = server.url
        try:
            client = CacheClient(url, curve=client_curve(args))
            if client.chunk_size != chunk_size:
                raise SystemExit(f"the server at {url} uses chunk size {client.chunk_size}, not {chunk_size}")
            salt = run_salt()
            ctx = client.register(kv, model_name=bench_model_name("bench", layout, chunk_size), block_size=bs,
                                  transport=args.transport, layout=kind)
            bar = progress_bar(total_reqs, f"{args.transport} chunk {chunk_size}")
            counter = 0
            for cpr in args.chunks_per_request:
                nbytes = cpr * chunk_bytes
                limit = physical_limit(nbytes, device)
                for inflight in args.inflight:
                    reqs = _requests(args.iters + 1, counter, cpr, chunk_size, bpc, num_blocks, gen, salt)
                    counter += len(reqs)
                    keys, src, dst = reqs[0]  # warm-up, and the bit-exact check
                    ctx.submit_store(keys, src).result(timeout=300)
                    ctx.submit_retrieve(keys, dst).result(timeout=300)
                    _sync(device)
                    if args.verify:
                        for layer in kv:
                            rows = layout.row_view(layer).view(torch.uint8)  # bytes: NaN != NaN
                            if not torch.equal(rows[layout.rows(src.to(device))], rows[layout.rows(dst.to(device))]):
                                raise SystemExit("retrieved blocks differ from stored blocks")
                    bar.update(1)
                    store_t, retr_t = _timed(ctx, reqs[1:], inflight, device, bar)
                    if inflight == 1:  # the median request
                        store, retrieve = _median_gbps(nbytes, store_t), _median_gbps(nbytes, retr_t)
                        store_rounds: list[float] = []
                        retrieve_rounds: list[float] = []
                    else:  # the median round: one hiccup of the host in ~50 ms of copies is not the figure
                        for _ in range(args.rounds - 1):
                            more = _timed(ctx, _requests(args.iters, counter, cpr, chunk_size, bpc, num_blocks, gen,
                                                         salt),
                                          inflight, device, bar)
                            counter += args.iters
                            store_t += more[0]
                            retr_t += more[1]
                        store_rounds = [nbytes * args.iters / t / GB for t in store_t]
                        retrieve_rounds = [nbytes * args.iters / t / GB for t in retr_t]
                        store, retrieve = statistics.median(store_rounds), statistics.median(retrieve_rounds)
                    results.append({
                        "transport": args.transport, "device": str(device), "layout": kind.value,
                        "dtype": args.dtype, "layers": args.layers, "chunk_size": chunk_size,
                        "chunk_mib": chunk_bytes / 2**20, "chunks_per_request": cpr, "request_mib": nbytes / 2**20,
                        "inflight": inflight, "store_gbps": store, "retrieve_gbps": retrieve,
                        "store_p50_ms": statistics.median(store_t) * 1e3 if inflight == 1 else None,
                        "retrieve_p50_ms": statistics.median(retr_t) * 1e3 if inflight == 1 else None,
                        "limit": limit["limit"], "store_limit_gbps": limit["store_limit"],
                        "retrieve_limit_gbps": limit["retrieve_limit"],
                        "warm_memcpy_gbps": limit.get("warm_memcpy"),
                        "parallel_memcpy_gbps": limit.get("parallel_memcpy"),
                        "store_ratio": store / limit["store_limit"],
                        "retrieve_ratio": retrieve / limit["retrieve_limit"],
                        "iters": args.iters,
                        # with several in flight: each round's GB/s (the figures above are their medians)
                        "rounds": len(store_rounds),
                        "store_gbps_rounds": store_rounds, "retrieve_gbps_rounds": retrieve_rounds,
                    })
            bar.close()
            ctx.close()
            client.close()
        finally:
            if server is not None:
                server.stop()
        del kv
    return results


def print_results(results: list[dict[str, Any]]) -> None:
    from kvxfer.text_table import print_table

    print_table(
        [(r["transport"], r["device"], r["chunk_size"], f"{r['chunk_mib']:.1f}", r["chunks_per_request"], r["inflight"],
          f"{r['store_gbps']:.1f}", f"{r['retrieve_gbps']:.1f}", r["limit"],
          f"{r['store_limit_gbps']:.1f}/{r['retrieve_limit_gbps']:.1f}",
          f"{r['store_ratio']:.2f}x", f"{r['retrieve_ratio']:.2f}x") for r in results],
        ["transport", "device", "chunk", "MiB", "chunks/req", "in flight", "store GB/s", "retrieve GB/s", "limit",
         "limit GB/s", "store/limit", "retrieve/limit"],
    )


def add_kv_cache_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmarks' transport and KV cache options (both ``kvxfer bench`` and ``--prefix``)."""
    p.add_argument("--transport", default="cpu_gather",
                   help="the transport measured (a name from `kvxfer plugins`; default: %(default)s)")
    p.add_argument("--device", default="cpu", type=usable_device,
                   help="torch device of the KV cache (cpu, cuda, ...; default: %(default)s)")
    p.add_argument("--layout", default="flash_attn", choices=[k.value for k in LayoutKind if k.value != "bhnc"],
                   help="layout of the benchmark's KV cache (bhnc needs vLLM's own views: see benchmarks/vllm_ttft.py)")
    p.add_argument("--dtype", default="bfloat16", help="element type of the KV cache (default: %(default)s)")
    p.add_argument("--layers", type=positive_int, default=32, help="KV cache layers (default: %(default)s)")
    p.add_argument("--heads", type=positive_int, default=8, help="KV heads per layer (default: %(default)s)")
    p.add_argument("--head-size", type=positive_int, default=128,
                   help="elements per head (default: %(default)s)")
    p.add_argument("--block-size", type=positive_int, default=16,
                   help="tokens per KV cache block (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    # no abbreviations: main() hands "--prefix" itself to the prefix benchmark, so "--prefi" ran this one
    p = argparse.ArgumentParser(prog="kvxfer bench", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_kv_cache_arguments(p)
    p.add_argument("--blocks", type=positive_int, default=512,
                   help="KV cache blocks per layer (at least 2 requests' worth)")
    p.add_argument("--chunk-sizes", type=positive_int, nargs="+", default=[256],
                   help="tokens per chunk, one server each (default: %(default)s)")
    p.add_argument("--chunks-per-request", type=positive_int, nargs="+", default=[1, 8],
                   help="chunks each store and retrieve moves (default: %(default)s)")
    p.add_argument("--iters", type=positive_int, default=8,
                   help="timed requests per configuration, per round with several in flight (after 1 warm-up)")
    p.add_argument("--inflight", type=positive_int, nargs="+", default=[1],
                   help="requests outstanding at once; 1 times each request alone (default: %(default)s)")
    p.add_argument("--rounds", type=positive_int, default=5,
                   help="with more than 1 in flight: rounds of --iters requests each (each round its own "
                        "requests), reported as the median round's GB/s (default: %(default)s)")
    p.add_argument("--l1-size", default=None, help="arena size of the benchmark's server (default: fits all)")
    p.add_argument("--url", default=None,
                   help="use a running server (its chunk size must match); the run registers as the model "
                        "kvxfer-bench-FORMAT (one per chunk format, every run the same: one metrics label) and "
                        "leaves its chunks there, to be evicted like any other")
    p.add_argument("--server-transports", default="",
                   help="--transports of the started server (default: the --transport benchmarked)")
    add_server_tuning_arguments(p)
    add_client_curve_arguments(p)
    p.add_argument("--no-verify", dest="verify", action="store_false", help="skip the bit-exact check")
    p.add_argument("--json", default=None, metavar="PATH", type=json_target,
                   help="also write the results here (a directory: a file named by date and commit)")
    p.add_argument("--prefix", action="store_true",
                   help="run the prefix-load benchmark instead (lookup + retrieve as a connector issues it; "
                        "`kvxfer bench --prefix --help`)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--prefix" in argv:
        from kvxfer.bench_prefix import main as prefix_main

        return prefix_main([a for a in argv if a != "--prefix"])
    args = build_parser().parse_args(argv)
    results = run(args)
    print_results(results)
    save_results(args, "transfer", {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
