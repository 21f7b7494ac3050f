"""The transfer, prefix-load, lone-request trace, layer-wise, start-up, eviction and L2 benchmarks run end to end on a tiny workload (real
server processes), write their JSON with the run record, and the GPU check's summary reads it; the
device timeline (GPU only) reads a profiler's trace."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--layers", "2", "--heads", "2", "--head-size", "8", "--block-size", "16", "--chunk-size", "32",
        "--blocks", "64"]


def _run(*args: str) -> str:
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_prefix_benchmark_and_the_gpu_summary(tmp_path: Path) -> None:
    stdout = _run("-m", "kvxfer", "bench", "--prefix", *TINY, "--prefix-chunks", "1", "2", "--iters", "3",
                  "--layerwise", "--json", str(tmp_path / "prefix-cuda_ipc.json"))
    assert "x copy" in stdout and "load_layerwise" in stdout
    assert "p99 of 3 requests is their slowest" in stdout
    data = json.loads((tmp_path / "prefix-cuda_ipc.json").read_text())
    assert data["run"]["commit"] and data["run"]["time"]
    rows = {(r["kind"], r["chunks"]): r for r in data["results"]}
    assert set(rows) == {(k, n) for k in ("store", "load", "load_layerwise") for n in (1, 2)}
    assert all(r["iters"] == 3 and r["p99_ms"] >= r["p50_ms"] > 0 and r["x_copy"] > 0 for r in rows.values())
    summary = _run(str(ROOT / "benchmarks" / "gpu_summary.py"), str(tmp_path))
    assert "cuda_ipc prefix load 32 tokens" in summary and "bench-hpu.json missing" in summary
    assert json.loads((tmp_path / "summary.json").read_text())


def test_results_written_into_a_directory_never_replace_each_other(tmp_path: Path) -> None:
    """Rounds of one day and commit (an A/B comparison's) written into one directory: each its
    own file (the second replaced the first)."""
    from kvxfer.bench import write_results

    paths = [write_results(tmp_path, "prefix-cpu_gather-cpu", {"round": i}) for i in range(3)]
    assert len(set(paths)) == 3 and paths[1].endswith("-prefix-cpu_gather-cpu-2.json"), paths
    assert [json.loads(Path(p).read_text())["round"] for p in paths] == [0, 1, 2]
    assert write_results(tmp_path / "one.json", "x", {"round": 3}) == str(tmp_path / "one.json")
    assert write_results(tmp_path / "one.json", "x", {"round": 4}) == str(tmp_path / "one.json")  # a file: as named


@pytest.mark.parametrize("argv", [["--prefi"], ["--pre", "--iters", "3"]])
def test_an_abbreviated_prefix_flag_is_refused_not_run_as_the_transfer_benchmark(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from kvxfer.bench import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_transfer_benchmark_reports_the_median_round_with_several_in_flight(tmp_path: Path) -> None:
    """One request at a time: the median request; several in flight: each round (its own
    requests) timed as a whole, the median round reported, every round kept in the JSON."""
    tiny = [a if a != "--chunk-size" else "--chunk-sizes" for a in TINY]
    stdout = _run("-m", "kvxfer", "bench", *tiny, "--chunks-per-request", "2", "--inflight", "1", "3",
                  "--iters", "3", "--rounds", "3", "--json", str(tmp_path / "bench.json"))
    assert "retrieve/limit" in stdout
    written = json.loads((tmp_path / "bench.json").read_text())
    assert written["args"]["warm_us"] == 0 and written["args"]["inflight"] == [1, 3]  # how it ran, server's tuning too
    rows = {r["inflight"]: r for r in written["results"]}
    assert rows[1]["rounds"] == 0 and rows[1]["store_p50_ms"] > 0 and rows[1]["store_gbps_rounds"] == []
    several = rows[3]
    assert several["rounds"] == 3 and several["store_p50_ms"] is None
    for kind in ("store", "retrieve"):
        rounds = several[f"{kind}_gbps_rounds"]
        assert len(rounds) == 3 and all(g > 0 for g in rounds)
        assert several[f"{kind}_gbps"] == sorted(rounds)[1]
        assert several[f"{kind}_ratio"] == pytest.approx(several[f"{kind}_gbps"] / several[f"{kind}_limit_gbps"])


def test_gpu_summary_judges_no_ratio_by_a_slow_denominator(tmp_path: Path) -> None:
    """A transfer whose pinned copy, timed beside it, ran far below the check's fastest one (as
    in one H100 check: device->host 34.4 GB/s where every other copy ran at 52-55) is judged
    against no floor, and shown against the fastest copy instead of as 1.05x 'met'."""
    def bench(store_limit: float, rows: list[tuple[int, float, float]]) -> dict[str, object]:
        return {"gpu": "H100", "results": [
            {"chunks_per_request": 8, "chunk_mib": 32.0, "inflight": n, "store_gbps": sg, "retrieve_gbps": rg,
             "store_limit_gbps": store_limit, "retrieve_limit_gbps": 51.9,
             "store_ratio": sg / store_limit, "retrieve_ratio": rg / 51.9} for n, sg, rg in rows]}

    (tmp_path / "bench-cuda_ipc.json").write_text(json.dumps(bench(55.0, [(1, 37.8, 42.1), (4, 52.6, 52.9)])))
    (tmp_path / "bench-hpu.json").write_text(json.dumps(bench(34.4, [(1, 36.1, 41.6), (4, 52.6, 50.9)])))
    _run(str(ROOT / "benchmarks" / "gpu_summary.py"), str(tmp_path))
    rows = {r["what"].split(" (")[0]: r for r in json.loads((tmp_path / "summary.json").read_text())}
    hpu_store = rows["hpu store, 8 x 32 MiB, 1 in flight"]
    assert hpu_store["ok"] is None and hpu_store["floor"] is None and "34.4 GB/s" in hpu_store["note"]
    assert hpu_store["figure"] == pytest.approx(36.1 / 55.0)
    assert rows["hpu retrieve, 8 x 32 MiB, 1 in flight"]["ok"] is False  # 0.80x, judged
    assert rows["hpu retrieve, 8 x 32 MiB, 4 in flight"]["ok"] is True
    assert rows["cuda_ipc store, 8 x 32 MiB, 4 in flight"]["ok"] is True


def test_lone_trace_orders_both_processes_steps(tmp_path: Path) -> None:
    """benchmarks/lone_trace.py: the steps of a lone load, timed in the client and in a traced
    server process on one clock, come in the order the protocol makes them: the lookup's send,
    the server's handling of it, then the retrieve's reservation (cpu_gather)."""
    stdout = _run(str(ROOT / "benchmarks" / "lone_trace.py"), *TINY, "--chunks", "2", "--iters", "3",
                  "--gap-ms", "1", "--step", "kvxfer.copies:no_such_step", "--json", str(tmp_path / "trace.json"))
    assert "load: 3 lone requests" in stdout and "store: 3 lone requests" in stdout
    data = json.loads((tmp_path / "trace.json").read_text())
    assert data["run"]["commit"] and data["absent"] == ["kvxfer.copies:no_such_step"]
    load = {(r["process"], r["step"], r["call"]): r for r in data["summary"]["load"]["steps"]
            if r["thread"] == "MainThread" or r["process"] == "client" and r["step"].startswith("CpuGather")}
    lookup = load[("client", "CacheClient.lookup_and_lease", 1)]
    send = load[("client", "MQClient._send", 1)]  # the caller's own (the lookup)
    on_lookup = load[("server", "CacheServer._on_lookup", 1)]  # the server's loop
    reserve = load[("server", "CacheServer._on_reserve_read", 1)]
    scatter = load[("client", "CpuGatherContext.scatter", 1)]
    assert lookup["start_us"] <= send["start_us"] < on_lookup["start_us"] < lookup["end_us"]
    assert lookup["end_us"] < reserve["start_us"] < scatter["start_us"] < data["summary"]["load"]["median_us"]
    assert all(r["start_us"] <= r["end_us"] and r["seen"] >= 2 for r in load.values())
    store = {(r["process"], r["step"]) for r in data["summary"]["store"]["steps"]}
    assert {("server", "CacheServer._on_reserve_write"), ("server", "CacheServer._on_commit_write"),
            ("client", "CpuGatherContext.gather")} <= store
    # the GPU check's summary reads the file as gpu_check.sh names it
    (tmp_path / "trace.json").rename(tmp_path / "lone-trace-cpu_gather.json")
    summary = _run(str(ROOT / "benchmarks" / "gpu_summary.py"), str(tmp_path))
    first_scatter = scatter["start_us"] / 1e3
    assert "cpu_gather lone load of 2 chunks, traced (median ms)" in summary
    assert f"the first copy starts at {first_scatter:.2f} ms" in summary


def test_layerwise_benchmark(tmp_path: Path) -> None:
    stdout = _run(str(ROOT / "benchmarks" / "layerwise.py"), *TINY, "--prefix-chunks", "2", "--iters", "2",
                  "--compute-ratios", "1", "--json", str(tmp_path / "lw.json"))
    assert "hidden" in stdout
    row = json.loads((tmp_path / "lw.json").read_text())["rows"][0]
    assert row["layerwise_ms"] > 0 and row["sequential_ms"] > 0 and 0 < row["best_hidden"] <= 1


def test_startup_benchmark(tmp_path: Path) -> None:
    stdout = _run(str(ROOT / "benchmarks" / "startup.py"), "--runs", "1", "--no-progress", "--json",
                  str(tmp_path / "startup.json"))
    assert "kvxfer plugins" in stdout and "x python" in stdout
    rows = {r["command"]: r for r in json.loads((tmp_path / "startup.json").read_text())["rows"]}
    assert set(rows) == {"python -c pass", "kvxfer --help", "kvxfer plugins", "kvxfer plugins --json",
                         "kvxfer status"}
    assert all(r["median_s"] > 0 and r["variant"] == "current" and not r["imports_torch"] for r in rows.values())


def test_l2_benchmark_writes_its_results_into_a_directory(tmp_path: Path) -> None:
    """benchmarks/l2.py on a tiny workload (2 chunks of 1 MiB) against a Valkey it starts:
    ``--json DIR`` names the file by date, commit and benchmark, like the other benchmarks."""
    pytest.importorskip("kvxfer_valkey", reason="the valkey store plugin (plugins/valkey) is not installed")
    stdout = _run(str(ROOT / "benchmarks" / "l2.py"), "--chunks", "2", "--layers", "1", "--iters", "2",
                  "--lookups", "20", "--store-rounds", "2", "--sustained", "1", "--burst", "2",
                  "--placements", "free", "--l1-size", "64MiB", "--json", str(tmp_path))
    assert "kvxfer promotion" in stdout and "spanning" in stdout
    (written,) = tmp_path.glob("*-cpu-l2.json")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d-.+-cpu-l2\.json", written.name)
    data = json.loads(written.read_text())
    assert data["run"]["commit"] and data["run"]["time"] and data["argv"][-2:] == ["--json", str(tmp_path)]
    r = data["results"]
    assert r["verified"] and r["round_ratios"]["rounds"] == 2
    assert all(len(v) == 2 and min(v) > 0 for v in r["rounds_s"].values())
    assert r["promotion_vs_plain_get"] > 0 and r["write_vs_plain_set"] > 0
    assert r["store_on_vs_off"]["isolated_rounds"] == 2 and r["lookups"]["free"]["spanning_p50"] > 0


def test_latency_benchmark_with_an_idle_gap(tmp_path: Path) -> None:
    """benchmarks/latency.py times every row after an idle gap, with the raw Unix socket beside
    the raw pyzmq reference, and refuses a gap out of range."""
    stdout = _run(str(ROOT / "benchmarks" / "latency.py"), "--iters", "20", "--warmup", "5", "--idle-us", "200",
                  "--no-progress", "--json", str(tmp_path / "lat.json"))
    assert "raw unix socket (ref)" in stdout and "200 us after the one before" in stdout
    data = json.loads((tmp_path / "lat.json").read_text())
    rows = {r["name"]: r for r in data["results"]}
    assert data["idle_us"] == 200 and data["lookup_hits"] == data["chunks"]
    assert rows["raw unix socket (ref)"]["payload_bytes"] == rows["raw pyzmq (ref)"]["payload_bytes"]
    assert all(r["iters"] in (10, 20) and r["p99_us"] >= r["p50_us"] > 0 for r in rows.values())
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "latency.py"), "--idle-us", "-1"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "--idle-us must be in [0, 1000000]" in bad.stderr


def test_eviction_benchmark(tmp_path: Path) -> None:
    stdout = _run(str(ROOT / "benchmarks" / "eviction.py"), "--entries", "256", "1024", "--new", "8", "--rounds", "1",
                  "--json", str(tmp_path / "eviction.json"))
    assert "1024 entries: reserve_write of 8 chunks" in stdout
    written = json.loads((tmp_path / "eviction.json").read_text())
    assert [r["entries"] for r in written["results"]] == [256, 1024] and written["run"]["commit"]


def test_device_timeline_reads_each_requests_dmas_from_the_profilers_trace() -> None:
    """benchmarks/device_timeline.py (a GPU's profiler trace, so no run here): a request's
    figures come from the DMAs and kernels inside its range only, small uploads are not DMAs of
    the copy, and idle time is the DMA engine's gaps between the first DMA's start and the last's
    end. The benchmark itself refuses a device without CUDA's profiler activities."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import device_timeline
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    def ev(cat: str, ts: float, dur: float, name: str = "x") -> dict[str, object]:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    trace = {"traceEvents": [
        ev("user_annotation", 1000, 2000, "request.store"),
        ev("gpu_memcpy", 1010, 5),  # the row ids' upload: not a DMA of the copy
        ev("kernel", 1100, 50),
        ev("gpu_memcpy", 1200, 600), ev("gpu_memcpy", 1850, 600),  # 50 us idle between them
        ev("kernel", 2500, 100),
        ev("user_annotation", 5000, 1000, "request.retrieve"),
        ev("gpu_memcpy", 5300, 400),
        ev("gpu_memcpy", 9000, 400),  # after both requests: nobody's
    ]}
    store, retrieve = device_timeline._requests(trace)
    assert store == {"kind": "store", "request_us": 2000, "first_dma_us": 200, "dma_span_us": 1250,
                     "dma_busy_us": 1200, "dma_idle_us": 50, "dmas": 2, "gpu_end_us": 1600, "after_gpu_us": 400,
                     "kernels": 2}
    assert (retrieve["kind"], retrieve["first_dma_us"], retrieve["dma_idle_us"], retrieve["gpu_end_us"]) == \
        ("retrieve", 300, 0, 700)
    assert device_timeline._union_us([(0, 10), (5, 15), (20, 25)]) == 20  # two copy engines at once
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "device_timeline.py")], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "needs --device cuda" in out.stderr


def test_runs_against_a_running_server_share_one_model_label_and_no_chunks() -> None:
    """``--url``: every run of a benchmark registers under one model name per chunk format (they
    took one per process, so a long-lived server ran out of metrics labels), and each run's
    prefixes are its own (no chunk of an earlier run is found present)."""
    from kvxfer import CacheClient
    from kvxfer.testing.server import ServerProcess

    from kvxfer.bench import bench_model_name
    from kvxfer.layout import KVLayout, LayoutKind

    tiny = [a if a != "--chunk-size" else "--chunk-sizes" for a in TINY]
    with ServerProcess(l1_size="64MiB", chunk_size=32, transports="cpu_gather") as srv:
        for _ in range(2):
            _run("-m", "kvxfer", "bench", *tiny, "--chunks-per-request", "2", "--inflight", "1", "--iters", "2",
                 "--url", srv.url, "--transport", "cpu_gather")
        with CacheClient(srv.url) as c:
            st = c.status()
    # (bench --prefix names itself the same way: kvxfer-prefix-FORMAT)
    layout = KVLayout(LayoutKind.FLASH_ATTN, 2, 64, 16, 2 * 8, torch.bfloat16)
    assert [md.model for md in st.models] == [bench_model_name("bench", layout, 32)], st.models
    (bench,) = st.traffic
    assert bench.stored_chunks == 2 * 3 * 2 and bench.present_chunks == 0, bench  # 2 runs x 3 requests x 2 chunks
