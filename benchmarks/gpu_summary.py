#!/usr/bin/env python3
"""Read the JSON files one `scripts/gpu_check.sh` run wrote and print each figure next to its
floor (ratios measured in the same run against the pinned copy of the same bytes); writes
``summary.json`` beside them. Files that are missing (a step that failed or ran out of time)
are reported as such. A transfer ratio whose denominator, the pinned copy timed beside it, ran
below :data:`SUSPECT` of the fastest pinned copy of the whole check is judged against neither
floor: its ratio against that fastest copy is shown instead (one pinned buffer of one run has
been seen to copy device->host at 34 GB/s where every other ran at 52-55 GB/s).

    python benchmarks/gpu_summary.py "$OUT"
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

#: (what, floor, "min" when the figure must reach the floor, "max" when it must stay under it)
FLOORS = {
    "transfer_1": (0.90, "min"),
    "transfer_4": (0.92, "min"),
    "prefix_load_2048": (1.15, "max"),
}
#: A pinned copy below this share of the check's fastest one is not a denominator to judge by.
SUSPECT = 0.8
#: The steps of benchmarks/lone_trace.py that copy KV bytes: the first one's start is when a
#: lone request's copying begins.
COPY_STEPS = ("_copy", "HpuContext.scatter", "HpuContext.gather", "CpuGatherContext.scatter",
              "CpuGatherContext.gather")


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def summarize(out: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def add(what: str, figure: float | None, floor_key: str | None, note: str) -> None:
        floor, sense = FLOORS.get(floor_key or "", (None, ""))
        ok = None
        if figure is not None and floor is not None:
            ok = figure >= floor if sense == "min" else figure <= floor
        rows.append({"what": what, "figure": figure, "floor": floor, "sense": sense, "ok": ok, "note": note})

    benches = {t: _load(out / f"bench-{t}.json") for t in ("cuda_ipc", "hpu")}
    fastest = max((r[f"{k}_limit_gbps"] for d in benches.values() if d for r in d["results"]
                   for k in ("store", "retrieve")), default=0.0)
    for transport in ("cuda_ipc", "hpu"):
        data = benches[transport]
        if data is None:
            add(f"{transport} transfer", None, None, f"bench-{transport}.json missing")
        else:
            gpu = data.get("gpu")
            for r in data["results"]:
                for kind in ("store", "retrieve"):
                    what = (f"{transport} {kind}, {r['chunks_per_request']} x {r['chunk_mib']:.0f} MiB, "
                            f"{r['inflight']} in flight (x pinned copy, throughput)")
                    limit = r[f"{kind}_limit_gbps"]
                    if limit < SUSPECT * fastest:
                        add(what, r[f"{kind}_gbps"] / fastest, None,
                            f"against the check's fastest pinned copy ({fastest:.1f} GB/s): the one timed beside "
                            f"it ran at {limit:.1f} GB/s (x {r[f'{kind}_ratio']:.3f}), not a denominator to judge by")
                        continue
                    add(what, r[f"{kind}_ratio"], f"transfer_{1 if r['inflight'] == 1 else 4}", gpu or "")
        data = _load(out / f"prefix-{transport}.json")
        if data is None:
            add(f"{transport} prefix load", None, None, f"prefix-{transport}.json missing")
        else:
            # the floor judges the load as the vLLM connector issues it: with a prefetch, where timed
            judged = "load_prefetch" if any(r["kind"] == "load_prefetch" for r in data["results"]) else "load"
            for r in data["results"]:
                key = "prefix_load_2048" if r["kind"] == judged and r["tokens"] == 2048 else None
                add(f"{transport} prefix {r['kind']} {r['tokens']} tokens: p50 {r['p50_ms']:.2f} ms "
                    f"(p99 {r['p99_ms']:.2f}; copy {r['copy_p50_ms']:.2f}) (x copy time)", r["x_copy"], key,
                    data.get("gpu") or "")
        if not (out / f"lone-trace-{transport}.json").is_file():
            add(f"{transport} lone trace", None, None, f"lone-trace-{transport}.json missing")
        data = _load(out / f"layerwise-{transport}.json")
        if data is None:
            add(f"{transport} layer-wise hiding", None, None, f"layerwise-{transport}.json missing")
        else:
            for r in data["rows"]:
                add(f"{transport} layer-wise, compute {r['compute_ratio']:g} x load: share of the load hidden "
                    f"(at most {r['best_hidden']:.2f})", r["hidden"], None,
                    f"load {r['load_ms']:.2f} ms, sequential {r['sequential_ms']:.2f}, "
                    f"layerwise {r['layerwise_ms']:.2f}")
    for path in sorted(out.glob("lone-trace-*.json")):  # any transport's
        data = _load(path)
        if data is None:
            add(f"{path.name}", None, None, "unreadable")
            continue
        for kind, t in data["summary"].items():
            copies = [r["start_us"] for r in t["steps"] if r["step"] in COPY_STEPS]
            first = f"the first copy starts at {min(copies) / 1e3:.2f} ms" if copies else "no copy step traced"
            add(f"{data['args']['transport']} lone {kind} of {data['args']['chunks']} chunks, traced (median ms)",
                t["median_us"] / 1e3, None, f"{first}; {t['requests']} requests, every step in {path.name}")
    return rows


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0] if args else "gpu-out")
    rows = summarize(out)
    (out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    for r in rows:
        fig = "missing" if r["figure"] is None else f"{r['figure']:.3f}"
        floor = ""
        if r["floor"] is not None:
            floor = f" ({'>=' if r['sense'] == 'min' else '<='} {r['floor']}: {'met' if r['ok'] else 'NOT met'})"
        print(f"{fig:>8}  {r['what']}{floor}  {r['note']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
