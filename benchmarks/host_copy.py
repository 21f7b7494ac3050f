#!/usr/bin/env python3
"""The copies of a chunk on the host, one thread, against each other: what bounds cpu_gather.

A cpu_gather store copies a chunk's rows (one per block, layer and K/V) from the engine's KV
tensors into an arena slot in shared memory; a retrieve copies them back. This times, on the same
bytes and interleaved (each kind once per round, ``--rounds`` rounds, each round's buffers
rotated over ``--pool`` so that no copy is served by the caches):

* ``torch copy_``: one memcpy of the chunk's bytes between two buffers (``kvxfer bench``'s
  denominator: "memcpy (cold, 1 thread)");
* ``stream copy``: the same bytes in one row by ``kvxfer._rowcopy`` (streaming stores): the fastest
  one-thread copy of a chunk on this host, the physical limit of one;
* ``index_select`` / ``index_put_``: the row gather and scatter of torch, as cpu_gather copied
  before the C row copy (one call per layer, 16-byte elements);
* ``rowcopy gather`` / ``rowcopy scatter``: cpu_gather's copies now (one ``copy_rows`` call, as
  :class:`kvxfer.copies.HostRows` makes it).

    python benchmarks/host_copy.py --rounds 20 --json benchmarks/results/

Prints each kind's p50 in ms and GB/s, and its ratio to both memcpy kinds, and writes the same
as JSON with the run (commit, date, machine).
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any


def run(args: argparse.Namespace) -> dict[str, Any]:
    import time

    import torch

    from kvxfer.bench import progress_bar
    from kvxfer import _rowcopy

    torch.set_num_threads(1)
    row_bytes = args.block_size * args.heads * args.head_size * 2  # bf16: one block's K (or V) of one layer
    rows_per_chunk = 2 * (args.chunk_tokens // args.block_size)  # K and V of each block
    chunk = args.layers * rows_per_chunk * row_bytes
    g = torch.Generator().manual_seed(0)
    layers = [torch.randint(0, 256, (2 * args.blocks, row_bytes), generator=g, dtype=torch.uint8)
              for _ in range(args.layers)]
    wide = [t.view(torch.complex128) for t in layers]  # 16-byte elements, as cpu_gather indexed them
    ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)
    slots_n = max(2, args.pool // chunk)
    fd, path = tempfile.mkstemp(prefix="kvxfer-host-copy-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        os.ftruncate(fd, slots_n * chunk)
        arena_map = mmap.mmap(fd, slots_n * chunk)
    finally:
        os.close(fd)
        os.unlink(path)
    arena = torch.frombuffer(arena_map, dtype=torch.uint8)
    arena.fill_(0)  # every page mapped before anything is timed
    private = [torch.zeros(chunk, dtype=torch.uint8) for _ in range(max(2, args.pool // chunk // 2))]

    def slot(i: int) -> torch.Tensor:
        return arena[(i % slots_n) * chunk:(i % slots_n + 1) * chunk]

    def pick_rows(i: int) -> torch.Tensor:
        blocks = torch.randperm(args.blocks, generator=torch.Generator().manual_seed(i))[:rows_per_chunk // 2]
        return torch.cat([blocks, blocks + args.blocks])  # K rows then V rows

    def copy_(i: int, rows: torch.Tensor) -> None:
        slot(i).copy_(private[i % len(private)])

    row_zero = torch.zeros(1, dtype=torch.int64)
    private_ptrs = [torch.tensor([t.data_ptr()], dtype=torch.int64) for t in private]

    def stream(i: int, rows: torch.Tensor) -> None:  # the whole chunk as one row of one layer
        _rowcopy.copy_rows(True, slot(i).data_ptr(), private_ptrs[i % len(private)].data_ptr(), 1, 1, chunk, chunk,
                           chunk, chunk, row_zero.data_ptr(), 1, 1)

    def index_select(i: int, rows: torch.Tensor) -> None:
        view = slot(i).view(torch.complex128).view(args.layers, rows_per_chunk, -1)
        for layer, dst in zip(wide, view):
            torch.index_select(layer, 0, rows, out=dst)

    def index_put(i: int, rows: torch.Tensor) -> None:
        view = slot(i).view(torch.complex128).view(args.layers, rows_per_chunk, -1)
        for layer, src in zip(wide, view):
            layer.index_put_((rows,), src)

    def rowcopy(to_slot: bool) -> Callable[[int, torch.Tensor], None]:
        def copy(i: int, rows: torch.Tensor) -> None:
            _rowcopy.copy_rows(to_slot, slot(i).data_ptr(), ptrs.data_ptr(), args.layers, 2 * args.blocks, row_bytes,
                               row_bytes, rows_per_chunk * row_bytes, row_bytes, rows.data_ptr(), rows.numel(), 1)
        return copy

    kinds: dict[str, Callable[[int, torch.Tensor], None]] = {
        "torch copy_": copy_, "stream copy": stream, "index_select": index_select, "rowcopy gather": rowcopy(True),
        "index_put_": index_put, "rowcopy scatter": rowcopy(False)}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    bar = progress_bar(args.rounds * len(kinds), "host copies")
    try:
        for r in range(-1, args.rounds):  # round -1 warms every kind up, untimed
            for k, fn in kinds.items():
                i = (r + 1) * len(kinds) + list(kinds).index(k)
                rows = pick_rows(i)
                t = time.perf_counter()
                fn(i, rows)
                if r >= 0:
                    times[k].append(time.perf_counter() - t)
                    bar.update(1)
    finally:
        bar.close()
    memcpy = statistics.median(times["torch copy_"])
    streamed = statistics.median(times["stream copy"])
    rows_out = []
    for k, ts in times.items():
        p50 = statistics.median(ts)
        rows_out.append({"kind": k, "p50_ms": p50 * 1e3, "gbps": chunk / p50 / 1e9,
                         "x_memcpy_speed": memcpy / p50, "x_stream_speed": streamed / p50})
    return {"chunk_bytes": chunk, "row_bytes": row_bytes, "kernel": _rowcopy.kernel(), "copies": rows_out}


def print_table(result: dict[str, Any]) -> None:
    from kvxfer.text_table import print_table as show

    print(f"one chunk of {result['chunk_bytes'] / 2**20:g} MiB in rows of {result['row_bytes'] / 1024:g} KiB, "
          f"one thread, p50; _rowcopy kernel: {result['kernel']}")
    show([[r["kind"], f"{r['p50_ms']:.3f}", f"{r['gbps']:.2f}", f"{r['x_memcpy_speed']:.2f}x",
           f"{r['x_stream_speed']:.2f}x"] for r in result["copies"]],
         ["copy", "p50 ms", "GB/s", "x torch copy_ speed", "x stream copy speed"])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20, help="timed copies of each kind (default: %(default)s)")
    p.add_argument("--layers", type=int, default=32, help="KV layers (default: %(default)s)")
    p.add_argument("--heads", type=int, default=8, help="KV heads (default: %(default)s)")
    p.add_argument("--head-size", type=int, default=128, help="elements per head (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default: %(default)s)")
    p.add_argument("--chunk-tokens", type=int, default=256, help="tokens per chunk (default: %(default)s)")
    p.add_argument("--blocks", type=int, default=512, help="KV blocks per layer (default: %(default)s)")
    p.add_argument("--pool", type=int, default=1 << 30, help="bytes each side's buffers rotate over "
                                                             "(default: 1 GiB)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write the results here (a directory: a file named by date and commit)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rounds < 1 or args.layers < 1 or args.blocks < 1 or args.chunk_tokens < args.block_size:
        raise SystemExit("--rounds, --layers and --blocks must be >= 1, --chunk-tokens >= --block-size")
    if args.blocks < args.chunk_tokens // args.block_size:
        raise SystemExit("--blocks must hold one chunk's blocks")
    result = run(args)
    print_table(result)
    if args.json:
        from kvxfer.bench import write_results

        print(f"wrote {write_results(args.json, 'host-copy', {'args': vars(args), **result})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
