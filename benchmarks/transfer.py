#!/usr/bin/env python3
"""Store/retrieve throughput against a real kvxfer server, with memcpy (CPU) or the pinned
host<->device copy (CUDA) of the same bytes measured in the same run.

Same as `kvxfer bench`; the implementation is kvxfer/bench.py. Example (the standard workload of docs/performance.md):

    python benchmarks/transfer.py --layers 32 --chunk-sizes 256 --chunks-per-request 1 8 \
        --json results/transfer-cpu.json
"""

from kvxfer.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
