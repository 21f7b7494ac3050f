"""Load: 8 client processes (tensor parallelism 8: world_size 8, ranks 0..7, one registration
each) store and retrieve at once against one server; not one chunk may come back corrupted."""

from __future__ import annotations

import os

from relkit import read_event

from kvxfer import CacheClient
from kvxfer.testing.server import ServerProcess

RANKS = 8
ITERS = int(os.environ.get("KVXFER_SOAK_ITERS", "60"))
CHUNKS = 8  # per request; 64 KiB each


def test_eight_ranks_store_and_retrieve_at_once(workers):
    # 32 MiB of arena for 8 x 60 x 8 x 64 KiB = 240 MiB stored: eviction runs during the soak
    # a session timeout far above any stall of a loaded machine: this test is about concurrency, not timeouts
    with ServerProcess(l1_size="32MiB", chunk_size=64, transports="cpu_gather",
                       extra_args=["--session-timeout", "30"]) as server:
        procs = [workers("soak", "--url", server.url, "--model", "soak", "--world", str(RANKS), "--rank", str(r),
                         "--iters", str(ITERS), "--chunks", str(CHUNKS)) for r in range(RANKS)]
        for p in procs:
            read_event(p, "ready", timeout=180)
        with CacheClient(server.url) as c:
            st = c.status()
            assert sorted(ctx.rank for ctx in st.contexts) == list(range(RANKS))
            assert len({ctx.client_pid for ctx in st.contexts}) == RANKS
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        done = [read_event(p, "done", timeout=180) for p in procs]
        for d in done:
            assert d["corrupt"] == 0, f"rank {d['rank']}: {d['corrupt']} corrupted chunks"
            assert d["stored"] == ITERS * CHUNKS and d["failed"] == 0, d
            assert d["retrieved"] == ITERS * CHUNKS and d["missing"] == 0, d
        for p in procs:
            assert p.wait(60) == 0
        with CacheClient(server.url) as c:
            st = c.status()
            assert st.arena.evictions > 0 and st.reservations == 0 and st.errors == 0
            assert st.contexts == [], "a worker's registration outlived its clean close"
