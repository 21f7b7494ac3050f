#!/usr/bin/env python3
"""What making room costs the server's loop: one ``reserve_write`` of new chunks into a full
index, in-process (``kvxfer.server.index.ChunkIndex``, the loop's own code, no socket), against
the number of entries it holds, with all of them leased but as many as the write evicts. Each
allocation pops the least recently used evictable entry; the figure should not grow with the
index's size.

    python benchmarks/eviction.py --json benchmarks/results/

Prints a table (milliseconds per reserve_write, median of ``--rounds``) and writes it as JSON.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from kvxfer.server.index import ChunkIndex, ChunkKey, Usage

SIZE = 4096


def key(i: int) -> ChunkKey:
    return ChunkKey("m", 1, 0, i.to_bytes(16, "little"))


def one(entries: int, new: int) -> float:
    """Seconds of one reserve_write of ``new`` chunks into a full index of ``entries``, all of
    them leased but ``new``."""
    index, owner = ChunkIndex(entries * SIZE), Usage()
    filled, _, _ = index.reserve_write([key(i) for i in range(entries)], "f", SIZE, 1, owner)
    index.commit_write(filled)
    del filled  # its list of every entry is freed here, not in the timed write
    index.lease({k: index.entries[k] for k in (key(i) for i in range(entries - new))}, 600, owner)
    keys = [key(10**9 + i) for i in range(new)]
    gc.collect()  # the set-up's garbage is not this write's: collect it before the clock starts
    t = time.perf_counter()
    res, _, no_space = index.reserve_write(keys, "f", SIZE, 1, owner)
    took = time.perf_counter() - t
    assert not no_space and len(res.entries) == new
    return took


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entries", type=int, nargs="+", default=[4096, 16384, 65536, 262144])
    p.add_argument("--new", type=int, default=64, help="chunks per reserve_write (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args()
    rows = []
    for n in args.entries:
        times = [one(n, args.new) for _ in range(args.rounds)]
        rows.append({"entries": n, "new": args.new, "p50_ms": statistics.median(times) * 1e3,
                     "times_ms": [t * 1e3 for t in times]})
        print(f"{n:>8} entries: reserve_write of {args.new} chunks {rows[-1]['p50_ms']:8.3f} ms", flush=True)
    if args.json:
        from kvxfer.bench import write_results

        print(f"wrote {write_results(args.json, 'eviction', {'results': rows})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
