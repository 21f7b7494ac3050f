"""The warm thread (``kvxfer serve --warm-us``): what it runs, when, and that a server runs it
only while a context is registered and no request is in flight."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import torch
from kvxfer_core_helpers import BLOCK_SIZE, BLOCKS_PER_CHUNK, CHUNK_SIZE, flash_attn_kv, wait_until

from kvxfer import CacheClient, chunk_hashes
from kvxfer.layout import KVLayout
from kvxfer.server import warmth
from kvxfer.server.config import ServerConfig
from kvxfer.server.warmth import THREAD_NAME, Warmer
from kvxfer.testing.server import ServerProcess


def _layout(num_blocks: int = 32, dtype: torch.dtype = torch.bfloat16) -> KVLayout:
    return KVLayout.infer([t.to(dtype) for t in flash_attn_kv(num_blocks=num_blocks)], BLOCK_SIZE)


def test_one_run_warms_each_distinct_layout_once_and_at_most_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each distinct (layout, chunk size) is warmed once per run, at most MAX_WARM_LAYOUTS of
    them; one whose chunk holds more blocks than the cache has is skipped (no block ids of it
    would pass the check)."""
    planned: list[tuple[KVLayout, int]] = []
    real = warmth.plan_copies

    def plan(layout, chunk_size, *args, **kwargs):  # the real plan, recorded
        planned.append((layout, chunk_size))
        return real(layout, chunk_size, *args, **kwargs)

    monkeypatch.setattr(warmth, "plan_copies", plan)
    a, b = _layout(), _layout(dtype=torch.float16)
    tiny = _layout(num_blocks=4)  # 8 blocks a chunk of 128 tokens at block size 16: none fits
    w = Warmer(1e-3, lambda: [(a, 64), (a, 64), (b, 64), (tiny, 128), (a, 32)], lambda: True)
    assert w.warm_once() == 3
    assert planned == [(a, 64), (b, 64), (a, 32)] and w.runs == 1
    many = [(_layout(num_blocks=n), 64) for n in range(16, 16 + warmth.MAX_WARM_LAYOUTS + 3)]
    planned.clear()
    assert Warmer(1e-3, lambda: many, lambda: True).warm_once() == warmth.MAX_WARM_LAYOUTS
    assert planned == many[:warmth.MAX_WARM_LAYOUTS]
    assert Warmer(1e-3, lambda: [], lambda: True).warm_once() == 0


def test_the_thread_warms_only_while_idle_and_stops() -> None:
    """No run while ``idle()`` says no; runs once it says yes; none once it says no again (the
    thread asks between runs: two answers of no after the switch mean no run is under way)."""
    layout = _layout()
    busy_answers = 0
    idle = threading.Event()

    def is_idle() -> bool:
        nonlocal busy_answers
        if idle.is_set():
            return True
        busy_answers += 1
        return False

    w = Warmer(200e-6, lambda: [(layout, 64)], is_idle)
    w.start()
    try:
        wait_until(lambda: busy_answers >= 3, timeout=30)
        assert w.runs == 0, "it warmed while the server was busy"
        idle.set()
        wait_until(lambda: w.runs >= 5, timeout=30)
        idle.clear()
        seen = busy_answers
        wait_until(lambda: busy_answers >= seen + 2, timeout=30)
        runs, seen = w.runs, busy_answers
        wait_until(lambda: busy_answers >= seen + 3, timeout=30)
        assert w.runs == runs, "it warmed while the server was busy"
    finally:
        w.stop()
    assert not w._thread.is_alive()
    w.stop()  # again: nothing


def test_a_run_that_takes_long_spaces_the_next_out() -> None:
    """A run of the steps costs what the registered layouts make it cost (a client's layout of
    4,096 one-element runs, 1M rows a chunk, took 2.7 ms a run): the thread then waits long
    enough to take at most MAX_SHARE of one CPU, not a run every period."""
    layout = _layout()

    def slow_layouts() -> list[tuple[KVLayout, int]]:
        time.sleep(0.005)  # a run of at least 5 ms
        return [(layout, 64)]

    w = Warmer(100e-6, slow_layouts, lambda: True)
    start = time.monotonic()
    w.start()
    try:
        time.sleep(1.0)
    finally:
        w.stop()
    elapsed = time.monotonic() - start
    # at most one run per 50 ms (5 ms / MAX_SHARE); a run every period would be about 190 a second
    assert 1 <= w.runs <= elapsed / (0.005 / warmth.MAX_SHARE) + 2, (w.runs, elapsed)


def test_a_failing_step_stops_the_thread_with_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    """Warmth is an optimization: a step that fails (here the layouts' source) is logged once
    and the thread ends; nothing else is affected."""
    calls = []

    def layouts() -> list[tuple[KVLayout, int]]:
        calls.append(1)
        raise RuntimeError("boom")

    w = Warmer(200e-6, layouts, lambda: True)
    with caplog.at_level(logging.ERROR, logger="kvxfer.server.warmth"):
        w.start()
        wait_until(lambda: not w._thread.is_alive(), timeout=30)
    assert len(calls) == 1
    assert [r.getMessage() for r in caplog.records] == ["keeping the request path warm failed; stopped (--warm-us)"]
    w.stop()


@pytest.mark.parametrize("period", [0.0, -1e-3, 50e-6, 6e-3, float("nan")])
def test_a_period_out_of_its_bounds_is_refused(period: float) -> None:
    with pytest.raises(ValueError, match="warm period must be in"):
        Warmer(period, list, lambda: True)


def test_warmth_is_off_by_default_and_takes_its_bounds() -> None:
    url = "ipc:///tmp/kvxfer-unused/s.sock"
    assert ServerConfig(url=url).warm_s == 0
    for period in (100e-6, 5e-3):
        assert ServerConfig(url=url, warm_s=period).warm_s == period


def _warm_threads(pid: int) -> list[int]:
    """The CPU ticks (user + system) of each thread of ``pid`` named THREAD_NAME (Linux /proc)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "comm").read_text().strip() == THREAD_NAME:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                out.append(int(fields[11]) + int(fields[12]))
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return out


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from Linux /proc")
def test_a_server_warms_for_server_driven_contexts_only_and_not_by_default() -> None:
    """A real server with ``--warm-us 1000`` has its warm thread. A client-driven context gives
    it nothing to warm (its client runs those steps), a server-driven one (the example
    file_debug) has it run them every millisecond. CPU seconds, with wide margins: not a
    timing. By default a server has no warm thread. Requests are served alongside it."""
    with ServerProcess(l1_size="16MiB", chunk_size=CHUNK_SIZE, transports="cpu_gather,file_debug",
                       extra_args=["--warm-us", "1000"]) as on, \
            ServerProcess(l1_size="16MiB", chunk_size=CHUNK_SIZE, transports="cpu_gather") as off:
        assert _warm_threads(off.pid) == []
        [before] = wait_until(lambda: _warm_threads(on.pid), timeout=30)
        with CacheClient(on.url) as c:
            kv = c.register(flash_attn_kv(num_blocks=32), model_name="warm", block_size=BLOCK_SIZE,
                            transport="cpu_gather")
            hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt="warm")
            assert kv.submit_store(hashes, list(range(2 * BLOCKS_PER_CHUNK))).result(30).stored == [0, 1]
            assert c.lookup_and_lease("warm", hashes=hashes, lease_s=5).hits == 2
            time.sleep(3.0)
            # waking every 50 ms with nothing to warm: well under 100 ms of CPU in 3 s (warming
            # every millisecond takes several times that)
            [idle] = _warm_threads(on.pid)
            assert idle < before + 10, f"{idle - before} ticks with only a client-driven context"
            served = c.register(flash_attn_kv(num_blocks=32), model_name="warm-sd", block_size=BLOCK_SIZE,
                                transport="file_debug")
            # 100 ms of CPU: a run a millisecond of steps that take tens of microseconds gets
            # there within seconds; a thread that only woke (every 50 ms) would take minutes
            wait_until(lambda: _warm_threads(on.pid)[0] >= idle + 10, timeout=30)
            hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt="warm-sd")
            assert served.submit_store(hashes, list(range(2 * BLOCKS_PER_CHUNK))).result(30).stored == [0, 1]
