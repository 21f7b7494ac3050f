#!/usr/bin/env python3
"""Prefix-load latency: lookup + retrieve of a prompt prefix as the vLLM connector issues it, and
stores, for 1, 2, 8 and 32 chunks, one request alone, against the copy of the same bytes measured
in the same run (pinned H2D/D2H on CUDA, memcpy between cold buffers on CPU).

Same as `kvxfer bench --prefix`; the implementation is kvxfer/bench_prefix.py. Examples:

    python benchmarks/prefix.py --json results/
    python benchmarks/prefix.py --transport cuda_ipc --device cuda --layerwise --json results/
"""

from kvxfer.bench_prefix import main

if __name__ == "__main__":
    raise SystemExit(main())
