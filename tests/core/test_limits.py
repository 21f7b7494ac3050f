"""The limits (kvxfer.server.limits): their messages, the `kvxfer serve` options made from them,
docs/reliability.md's table of them; the worker pool that bounds the server's threads; and the
server options that must be in range (a NaN session timeout once made sessions immortal)."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvxfer.cli import build_parser
from kvxfer.errors import ConfigError, LimitExceeded
from kvxfer.units import format_bytes
from kvxfer.server.config import ServerConfig
from kvxfer.server.limits import SPECS, Limits
from kvxfer.server.tier import TierConfig
from kvxfer.server.workers import WorkerPool

DOC = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"


def test_a_limit_names_itself_its_value_and_its_option() -> None:
    limits = Limits(max_reservations_per_session=2)
    limits.check("max_reservations_per_session", 1)
    with pytest.raises(LimitExceeded) as info:
        limits.check("max_reservations_per_session", 2)
    text = str(info.value)
    assert info.value.code == "limit_exceeded"
    assert "max_reservations_per_session" in text and "at most 2" in text
    assert "kvxfer serve --max-reservations-per-session" in text
    with pytest.raises(LimitExceeded, match=r"1\.0 MiB held, 2\.0 MiB more asked"):
        Limits(max_reserved_bytes_per_session=2 << 20).check("max_reserved_bytes_per_session", 1 << 20, 2 << 20)
    with pytest.raises(ConfigError, match="--workers must be a positive number of at most 1024"):
        Limits(workers=0)


def test_byte_limits_default_to_the_arena_size() -> None:
    r = Limits().resolved(64 << 20)
    assert r.max_reserved_bytes_per_session == r.max_leased_bytes_per_session == 64 << 20
    assert Limits(max_leased_bytes_per_session=4096).resolved(64 << 20).max_leased_bytes_per_session == 4096


def test_every_limit_is_a_serve_option() -> None:
    args = build_parser().parse_args(["serve", "--max-reserved-bytes-per-session", "8MiB", "--max-lease", "30",
                                      "--workers", "3"])
    from kvxfer.cli import _limits

    limits = _limits(args)
    assert (limits.max_reserved_bytes_per_session, limits.max_lease_s, limits.workers) == (8 << 20, 30.0, 3)
    assert limits.max_connections == Limits().max_connections
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    for spec in SPECS.values():
        assert spec.option in help_text


def test_docs_list_every_limit_with_its_default_and_option() -> None:
    doc = DOC.read_text()
    defaults = Limits()
    for spec in SPECS.values():
        value = getattr(defaults, spec.name)
        if value is None:
            shown = "the arena's size"
        elif spec.unit == "bytes":
            shown = format_bytes(value) if value >= 1024 else f"{value} bytes"
        elif spec.unit == "seconds":
            shown = f"{value:g} s"
        else:
            shown = f"{value:,}"
        row = re.search(rf"^\| [^|]+ \| ([^|]+) \| `{re.escape(spec.option)}` \|$", doc, re.M)
        assert row, f"docs/reliability.md does not list {spec.option}"
        assert row.group(1).startswith(shown), f"{spec.option}: the docs say {row.group(1)!r}, the default is {shown}"


def test_the_pool_keeps_each_lanes_order_and_its_thread_count() -> None:
    pool = WorkerPool(3)
    lanes = [pool.lane() for _ in range(20)]
    seen: dict[int, list[int]] = {i: [] for i in range(20)}
    names: set[str] = set()
    lock = threading.Lock()

    def work(lane: int, n: int) -> int:
        time.sleep(0.001)
        with lock:
            seen[lane].append(n)
            names.add(threading.current_thread().name)
        return n

    futures = [lanes[i].submit(work, i, n) for n in range(15) for i in range(20)]
    assert [f.result(30) for f in futures] == [n for n in range(15) for _ in range(20)]
    assert all(seen[i] == list(range(15)) for i in range(20)), "a lane ran out of order"
    assert len(names) <= 3, names
    pool.shutdown()


def test_a_lane_runs_one_item_at_a_time_and_shutdown_waits_for_it() -> None:
    pool = WorkerPool(4)
    lane = pool.lane()
    running = 0
    most = 0
    lock = threading.Lock()

    def work() -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.01)
        with lock:
            running -= 1

    futures = [lane.submit(work) for _ in range(10)]
    lane.shutdown(wait=True)
    assert all(f.done() for f in futures) and most == 1
    with pytest.raises(RuntimeError, match="shut down"):
        lane.submit(work)

    failing = pool.lane()
    fut = failing.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        fut.result(10)
    assert failing.submit(lambda: 7).result(10) == 7  # a raising item does not stop its lane
    pool.shutdown()


def test_a_lane_is_idle_once_its_work_has_returned() -> None:
    """idle() (the server may then run a lone request on its loop): false while an item runs
    or waits, true from the moment the last item's work returned, callbacks of its future
    included (they send the reply that the next request follows)."""
    pool = WorkerPool(2)
    lane = pool.lane()
    assert lane.idle()
    first_go, second_go = threading.Event(), threading.Event()
    seen: list[tuple[str, bool]] = []
    first = lane.submit(first_go.wait, 30)
    second = lane.submit(lambda: (second_go.wait(30), seen.append(("running", lane.idle()))))
    second.add_done_callback(lambda _f: seen.append(("callback", lane.idle())))  # runs on the worker
    assert not lane.idle()  # one running, one queued
    first_go.set()
    first.result(30)
    second_go.set()
    second.result(30)
    lane.shutdown(wait=True)
    assert seen == [("running", False), ("callback", True)]
    assert not lane.idle()  # shut down: takes nothing
    pool.shutdown()


def test_a_reserved_place_in_a_lane_keeps_the_order_until_filled_or_cancelled() -> None:
    """reserve() takes a place before its work is known (a retrieve waiting for a promotion from
    L2): what is submitted meanwhile runs after it, once it is filled; a cancelled place lets
    them go; shutdown gives up unfilled places and still runs what is queued behind them."""
    pool = WorkerPool(2)
    lane = pool.lane()
    ran: list[str] = []
    place = lane.reserve()
    later = lane.submit(ran.append, "later")
    assert not lane.idle()
    time.sleep(0.05)  # nothing may run behind the unfilled place (it would have by now)
    assert ran == [] and not later.done()
    filled = lane.fill(place, lambda: ran.append("first") or 1)
    assert filled.result(30) == 1 and later.result(30) is None and ran == ["first", "later"]
    with pytest.raises(RuntimeError, match="filled already"):
        lane.fill(place, ran.append, "again")

    ran.clear()
    gone = lane.reserve()
    after = lane.submit(ran.append, "after")
    lane.cancel(gone)
    assert after.result(30) is None and ran == ["after"] and gone.future.cancelled()
    with pytest.raises(RuntimeError, match="given up"):
        lane.fill(gone, ran.append, "late")

    ran.clear()
    open_place = lane.reserve()
    behind = lane.submit(ran.append, "behind")
    lane.shutdown(wait=True)
    assert behind.done() and ran == ["behind"] and open_place.future.cancelled()
    with pytest.raises(RuntimeError, match="given up"):
        lane.fill(open_place, ran.append, "late")
    with pytest.raises(RuntimeError, match="shut down"):
        lane.reserve()
    pool.shutdown()


@pytest.mark.parametrize(("kwargs", "option"), [
    ({"session_timeout_s": math.nan}, "--session-timeout"),  # no session would ever time out
    ({"session_timeout_s": math.inf}, "--session-timeout"),
    ({"session_timeout_s": 0.0}, "--session-timeout"),
    ({"session_timeout_s": 7200.0}, "--session-timeout"),
    ({"max_message_size": 0}, "--max-message-size"),  # ZeroMQ dropped every request unanswered
    ({"max_message_size": 1}, "--max-message-size"),
    ({"max_message_size": 1 << 40}, "--max-message-size"),
])
def test_server_options_out_of_range_are_refused(kwargs: dict, option: str) -> None:
    with pytest.raises(ConfigError, match=option):
        ServerConfig(url="ipc:///nonexistent/kvxfer.sock", **kwargs)


def test_thread_counts_are_bounded() -> None:
    """Each message states the whole range, the same for a value below it as above it."""
    for workers in (0, 100_000):
        with pytest.raises(ConfigError, match="--workers must be a positive number of at most 1024,"):
            Limits(workers=workers)
    for name in ("writers", "readers"):
        for count in (0, 100_000):
            with pytest.raises(ConfigError, match=rf"--l2-{name} must be in \[1, 64\],"):
                TierConfig(store="fs", url="file:///tmp/x", **{name: count})


@pytest.mark.parametrize("seconds", ["nan", "1e-9"])
def test_kvxfer_serve_names_a_bad_session_timeout(seconds: str) -> None:
    """NaN never timed sessions out; a millisecond made idle clients send heartbeats without end."""
    out = subprocess.run([sys.executable, "-m", "kvxfer", "serve", "--url", "ipc:///nonexistent/kvxfer.sock",
                          "--session-timeout", seconds], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--session-timeout must be in [0.5, 3600] seconds" in out.stderr, \
        out.stderr[-2000:]
