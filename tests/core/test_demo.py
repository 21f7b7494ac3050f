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


def test_demos_of_other_layouts_share_a_server_and_a_failed_one_ends_its_session() -> None:
    """A server keeps one chunk format per model name: each --layers stores under a name of its
    own, so a demo of another layout runs against a server earlier demos filled. A demo that
    fails ends its session at once rather than leaving the server to time it out."""
    from kvxfer import CacheClient
    from kvxfer.testing.server import ServerProcess

    with ServerProcess(l1_size="64MiB", chunk_size=256, transports="cpu_gather") as srv:
        for layers in ("2", "3"):
            proc = subprocess.run([str(KVXFER), "demo", "--url", srv.url, "--layers", layers, "--prompts", "1",
                                   "--prompt-tokens", "256"], capture_output=True, text=True, timeout=180)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert "verify:   every byte loaded matches" in proc.stdout
        proc = subprocess.run([str(KVXFER), "demo", "--url", srv.url, "--prompt-tokens", "16"],
                              capture_output=True, text=True, timeout=180)
        assert proc.returncode == 2 and "a prompt must hold at least one chunk" in proc.stderr, proc.stderr
        with CacheClient(srv.url) as c:
            assert c.status().sessions == 1, "the failed demo's session ended with it (only this one is left)"
        assert "timed out" not in srv.log()
