"""``kvxfer demo``, the README's main command (``./scripts/demo.sh``), made small: it starts a real
server process, stores and loads a paged KV cache through it, reports, and exits 0 only when
every byte matched. The two-host demo (``--nodes 2``) is tested with the valkey plugin."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

KVXFER = Path(sys.executable).with_name("kvxfer")


def test_the_demo_stores_loads_verifies_and_stops_its_server() -> None:
    proc = subprocess.run([str(KVXFER), "demo", "--layers", "2", "--prompts", "2", "--prompt-tokens", "512",
                           "--l1-size", "64MiB"], capture_output=True, text=True, timeout=180)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "prompts: 2 x 512 tokens = 4 chunks" in out
    assert "store:    3 chunks written, 1 already present (shared prefix)" in out  # prompt 1 shares a chunk
    assert "lookup:   hits per prompt [2, 2] of 2; an unseen prompt: 0" in out
    assert "retrieve: 4 chunks into other blocks" in out
    assert "verify:   every byte loaded matches" in out and "evicted" not in out
    assert "server stopped (exit code 0)" in out
