#!/usr/bin/env python3
"""Start-up time of the ``kvxfer`` command: a fresh ``python -m kvxfer ...`` process per run
(``--help``, ``plugins``, which loads and probes every installed plugin, ``plugins --json``, and
``status`` of a real server), against ``python -c pass`` (the interpreter alone) in the same run.

    python benchmarks/startup.py --runs 5 --json benchmarks/results/
    python benchmarks/startup.py --runs 5 --baseline /tmp/kvxfer-main --json benchmarks/results/

``--baseline DIR`` also times a checkout of kvxfer at ``DIR`` (its ``kvxfer`` package and its
plugins' packages first on ``PYTHONPATH``; the installed distributions' entry points are shared),
interleaved with this checkout run by run, so that drift of a shared machine hits both alike.
Each command also runs once with ``-X importtime`` (untimed) to record whether it imported torch.
Prints medians and writes them, every run's time and the run record as JSON.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PLUGIN_DIRS = ("plugins/cpu_gather", "plugins/cuda_ipc", "plugins/hpu", "plugins/valkey",
               "examples/kvxfer-file-transport")


def commands(url: str) -> dict[str, list[str]]:
    return {
        "python -c pass": ["-c", "pass"],
        "kvxfer --help": ["-m", "kvxfer", "--help"],
        "kvxfer plugins": ["-m", "kvxfer", "plugins"],
        "kvxfer plugins --json": ["-m", "kvxfer", "plugins", "--json"],
        "kvxfer status": ["-m", "kvxfer", "status", "--url", url],
    }


def environment(checkout: Path | None) -> dict[str, str]:
    """This process' environment; with ``checkout``, its packages first on PYTHONPATH."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if checkout is not None:
        env["PYTHONPATH"] = os.pathsep.join(str(checkout / d) for d in ("", *PLUGIN_DIRS))
    return env


def once(args: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        # (kvxfer plugins says why it fails, a broken plugin, on stdout)
        raise SystemExit(f"python {' '.join(args)} failed (exit status {proc.returncode}):\n"
                         f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return elapsed


def imports_torch(args: list[str], env: dict[str, str]) -> bool:
    proc = subprocess.run([sys.executable, "-X", "importtime", *args], env=env, capture_output=True, text=True,
                          timeout=120)
    names = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    return any(n.split(".")[0] == "torch" for n in names)


def commit_of(checkout: Path) -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=checkout, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run(args: argparse.Namespace) -> dict:
    from kvxfer.bench import progress_bar
    from kvxfer.testing.server import ServerProcess

    variants: dict[str, Path | None] = {"current": None}
    if args.baseline:
        variants = {"baseline": Path(args.baseline).resolve(), "current": None}
    envs = {name: environment(path) for name, path in variants.items()}
    with ServerProcess(l1_size="16MiB", transports="cpu_gather") as server:
        cmds = commands(server.url)
        times: dict[str, dict[str, list[float]]] = {v: {c: [] for c in cmds} for v in variants}
        bar = None if args.no_progress else progress_bar(args.runs * len(cmds) * len(variants), "start-ups")
        for _ in range(args.runs):
            for c, cmd in cmds.items():
                for v in variants:
                    times[v][c].append(once(cmd, envs[v]))
                    if bar is not None:
                        bar.update()
        if bar is not None:
            bar.close()
        torch_imported = {v: {c: imports_torch(cmd, envs[v]) for c, cmd in cmds.items()} for v in variants}
    rows = []
    for c in commands(""):
        for v, path in variants.items():
            median = statistics.median(times[v][c])
            rows.append({
                "command": c, "variant": v, "commit": commit_of(path) if path is not None else "",
                "median_s": median, "runs_s": times[v][c],
                "x_python": median / statistics.median(times[v]["python -c pass"]),
                "imports_torch": torch_imported[v][c],
            })
    return {"runs": args.runs, "baseline": str(variants.get("baseline") or ""), "rows": rows}


def print_table(report: dict) -> None:
    base = {r["command"]: r for r in report["rows"] if r["variant"] == "baseline"}
    print(f"{'command':24} {'variant':9} {'median s':>9} {'x python':>9} {'torch':>6}"
          + (f" {'x baseline':>11}" if base else ""))
    for r in report["rows"]:
        line = (f"{r['command']:24} {r['variant']:9} {r['median_s']:9.3f} {r['x_python']:9.1f} "
                f"{'yes' if r['imports_torch'] else 'no':>6}")
        if base and r["variant"] == "current":
            line += f" {r['median_s'] / base[r['command']]['median_s']:11.2f}"
        print(line)
    print(f"medians of {report['runs']} runs; x python: over `python -c pass` of the same variant and run")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="timed start-ups per command and variant (default %(default)s)")
    p.add_argument("--baseline", metavar="DIR", help="a checkout of kvxfer to time as well, interleaved")
    p.add_argument("--json", metavar="PATH", help="write the results here")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1")
    report = run(args)
    print_table(report)
    if args.json:
        from kvxfer.bench import write_results

        print(f"wrote {write_results(args.json, 'startup', report)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
