"""``kvxfer top`` in a real terminal (tmux) against a real CURVE server over tcp://: it shows the
figures of a scripted workload, refreshes as the workload goes on, and quits on ``q``; without a
terminal (or with ``--once``) it prints one frame."""

from __future__ import annotations

import math
import io
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from kvxfer_core_helpers import BLOCK_SIZE, BLOCKS_PER_CHUNK, CHUNK_SIZE, flash_attn_kv, wait_until

from kvxfer import CacheClient, chunk_hashes
from kvxfer.security import make_keys
from kvxfer.testing.server import ServerProcess
from kvxfer.protocol import messages as m
from kvxfer.top import render

needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def curve_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    keys = tmp_path_factory.mktemp("curve") / "keys"
    make_keys(keys)
    with ServerProcess(l1_size="32MiB", chunk_size=CHUNK_SIZE, transports="cpu_gather",
                       url=f"tcp://127.0.0.1:{_free_port()}", curve_dir=keys,
                       extra_args=["--metrics-port", "0"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def curve_client(curve_server: ServerProcess) -> Iterator[CacheClient]:
    with CacheClient(curve_server.url, curve=curve_server.client_keys(), timeout=20) as c:
        # a start-up probe of ServerProcess whose handshake the server answered after the probe gave
        # up (a busy host) leaves a session until the session timeout: the tests count sessions
        assert wait_until(lambda: c.status().sessions == 1, 15)
        yield c


def _workload(client: CacheClient, model: str, n: int) -> None:
    """Store ``n`` chunks, look up ``n + 1`` (n hits), load them back."""
    kv = client.register(flash_attn_kv(), model_name=model, block_size=BLOCK_SIZE, transport="cpu_gather")
    try:
        hashes = chunk_hashes(list(range((n + 1) * CHUNK_SIZE)), CHUNK_SIZE, salt=secrets.token_hex(4))
        assert kv.submit_store(hashes[:n], list(range(n * BLOCKS_PER_CHUNK))).result(30).stored == list(range(n))
        assert client.lookup(model, hashes=hashes) == n
        assert kv.submit_retrieve(hashes[:n], list(range(16, 16 + n * BLOCKS_PER_CHUNK))).result(30).ok
    finally:
        kv.close()


def traffic_row(text: str, model: str, op: str) -> list[str]:
    """The cells of the stores-and-retrieves row of ``model`` and ``op`` (the last one shown):
    model, transport, op, /s, B/s, chunks, bytes, skip, [fail,] open, copy."""
    rows = [line.split() for line in text.splitlines() if line.startswith(f"{model} ")]
    rows = [r for r in rows if len(r) > 3 and r[1] == "cpu_gather" and r[2] == op]
    assert rows, f"no {op} row of {model}:\n{text}"
    return rows[-1]


def test_render_shows_the_figures_and_rates(curve_client: CacheClient) -> None:
    from rich.console import Console

    before = curve_client.status()
    _workload(curve_client, "render-model", 3)
    after = curve_client.status()
    console = Console(width=80, record=True, file=io.StringIO())  # a plain 80-column terminal
    console.print(render(after, before, 2.0))
    text = console.export_text()
    assert f"kvxfer {after.server_version}" in text and after.url in text and after.metrics_url in text
    assert after.sessions == 1 and "0 sessions besides this one" in " ".join(text.split())  # the asker not counted
    # 1 store and 1 retrieve in 2 s: 0.5/s each; 3 chunks (24 KiB) stored and loaded
    assert traffic_row(text, "render-model", "store")[3:8] == ["0.5", "12K", "3", "24K", "0"]
    assert traffic_row(text, "render-model", "retrieve")[3:8] == ["0.5", "12K", "3", "24K", "0"]
    assert max(len(line) for line in text.splitlines() if "render-model" in line) <= 80
    assert "hit rate 75.0% now" in text  # 3 of 4 chunks, the only lookup between the two reports
    assert "lookup" in text and "store" in text and "retrieve" in text
    console.print(render(after, None, None, error="no answer from tcp://x: gone"))
    assert "no answer from tcp://x: gone" in console.export_text()


def test_writers_held_by_a_store_plugin_are_shown(curve_client: CacheClient) -> None:
    """A tier whose plugin holds writers says how many, in red (this server has no L2 tier: the
    tier in the reply is made here; tests/core/test_l2_plugin_faults.py holds real writers)."""
    from rich.console import Console

    st = curve_client.status()
    tier = m.TierStatus(name="l2", store="valkey", url="valkey://h:6379", state="up", writers=1, writers_held=2)
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(render(msgspec.structs.replace(st, tiers=[tier]), None, None))
    assert "writers held 2" in " ".join(console.export_text().split())
    console.print(render(msgspec.structs.replace(st, tiers=[msgspec.structs.replace(tier, writers_held=0)]), None, None))
    assert "writers held" not in console.export_text()  # (export_text clears what it returned)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_reply_with_non_finite_figures_renders(curve_client: CacheClient, bad: float) -> None:
    """The status reply comes from the wire: every float in it NaN or infinite (a broken or
    hostile server) still renders a frame (figures shown as "-" or as they are), never raises."""
    from rich.console import Console

    def spoil(value: object) -> object:
        if isinstance(value, float):
            return bad
        if isinstance(value, msgspec.Struct):
            return msgspec.structs.replace(value, **{f: spoil(getattr(value, f)) for f in value.__struct_fields__})
        if isinstance(value, list):
            return [spoil(v) for v in value]
        if isinstance(value, dict):
            return {k: spoil(v) for k, v in value.items()}
        return value

    _workload(curve_client, "spoiled-model", 1)
    st = spoil(curve_client.status())
    assert isinstance(st, m.StatusReply) and not math.isfinite(st.uptime_s)
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(render(st, st, 1.0))
    console.print(render(st, None, None))
    assert "spoiled-model" in console.export_text()
    curve_client.clear("spoiled-model")  # the arena as the next tests expect it


def test_an_80_column_frame_fits_and_tells_long_model_names_apart(curve_client: CacheClient) -> None:
    """At 80 columns no line is wider, the lines of figures break between fields (never inside
    one), and two model names that differ only at the end are cut in the middle: both ends show."""
    from rich.console import Console

    names = [f"meta-llama/Llama-3.1-8B-Instruct-quantized.{suffix}" for suffix in ("w8a8", "w4a16")]
    for name in names:
        _workload(curve_client, name, 1)
    st = curve_client.status()
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(render(st, st, 1.0))
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    for field in (f"kvxfer {st.server_version}", st.url, f"pid {st.pid}", "0 sessions besides this one",
                  f"{st.requests_in_flight} in flight", "(q quits)", "largest free 32.0 MiB",
                  f"hook errors {st.hook_errors}"):
        assert any(field in line for line in lines), (field, lines)
    for table in ("stores and retrieves", "models"):
        start = next(i for i, line in enumerate(lines) if line.startswith(table))
        rows = [line.split()[0] for line in lines[start + 2:] if line.startswith("meta-")]
        shown = {name: [r for r in rows if "…" in r and name.endswith(r.split("…")[1])] for name in names}
        assert all(shown.values()) and not set(shown[names[0]]) & set(shown[names[1]]), (table, rows)


def test_a_frame_taller_than_the_screen_says_how_much_is_below(curve_client: CacheClient) -> None:
    """A live screen crops a frame that is taller than it: the last line says how many lines
    did not fit (a 60x15 terminal showed the figures and no table, with no sign of them)."""
    from rich.console import Console

    from kvxfer.top import _Fitted

    _workload(curve_client, "tall", 1)
    st = curve_client.status()
    console = Console(width=60, height=15, record=True, file=io.StringIO())
    whole = len(console.render_lines(render(st, st, 1.0), console.options, pad=False))
    lines = console.render_lines(_Fitted(render(st, st, 1.0)), console.options.update(height=15), pad=False)
    assert whole > 15 and len(lines) == 15, (whole, len(lines))
    last = "".join(seg.text for seg in lines[-1])
    assert f"... {whole - 14} more lines (a taller terminal shows them)" in last, last
    short = console.render_lines(_Fitted(render(st, st, 1.0)), console.options.update(height=whole), pad=False)
    assert len(short) == whole and "more line" not in "".join(seg.text for seg in short[-1])


@pytest.mark.parametrize("width", [16, 20, 30])
def test_identities_cut_their_fingerprint_before_their_label(width: int) -> None:
    """The vLLM connector names chunks ``label#<16 hex digits>``: cut in the middle as any name,
    two variants of one model kept only their fingerprints' ends (``/tmp/…9d0f7548a61``). The
    fingerprint now gives up its digits (marked …) but four first, and the label is cut in the middle."""
    from kvxfer.top import _cut_middle

    names = [f"meta-llama/Llama-3.1-8B-Instruct-{v}@auto#{fp}" for v, fp in (("w8a8", "0123456789abcdef"),
                                                                          ("w4a16", "fedcba9876543210"))]
    cut = [_cut_middle(n, width) for n in names]
    assert all(len(c) <= width for c in cut), cut
    assert cut[0].endswith("#0123…") and cut[1].endswith("#fedc…"), cut
    assert "w8a8" in cut[0] and "w4a16" in cut[1], cut  # the model's end shows
    assert ("@auto#" in cut[0]) == (width >= 30), cut  # the dtype, where the model keeps 12 beside it
    assert _cut_middle(names[0], len(names[0])) == names[0]
    assert _cut_middle("abc#0123456789abcdef", 18) == "abc#0123456789abc…", "digits the label leaves are kept"
    # the vLLM connector's labels end in their dtype, the same for every model of a server: at the
    # width of top's model column the models' ends show, not "…float16"
    vllm = [f"{m}@bfloat16#{fp}" for m, fp in (("meta-llama/Llama-3.1-8B-Instruct", "6042" + "0" * 12),
                                                ("Qwen/Qwen2.5-7B-Instruct", "abcd" + "0" * 12))]
    assert [_cut_middle(n, 17) for n in vllm] == ["met…nstruct#6042…", "Qwe…nstruct#abcd…"]
    assert _cut_middle(vllm[0], 30) == "meta…B-Instruct@bfloat16#6042…"  # room for the dtype too


def test_once_without_a_terminal_prints_one_frame(curve_server: ServerProcess, curve_client: CacheClient) -> None:
    _workload(curve_client, "once-model", 2)
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.run([sys.executable, "-m", "kvxfer", "top", "--url", curve_server.url,
                           "--curve-dir", str(curve_server.curve_dir)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "once-model" in proc.stdout and "stores and retrieves" in proc.stdout
    head = proc.stdout.splitlines()[0]  # a pipe gets whole lines, and no hint of keys to press
    assert head.startswith("kvxfer ") and head.rstrip().endswith("in flight"), proc.stdout
    assert "q quits" not in proc.stdout
    no_keys = subprocess.run([sys.executable, "-m", "kvxfer", "top", "--url", curve_server.url, "--timeout", "1"],
                             capture_output=True, text=True, timeout=120)
    assert no_keys.returncode == 2 and "--curve-dir" in no_keys.stderr


class Tmux:
    """A private tmux server (its own socket) with one 220x60 window."""

    def __init__(self, name: str) -> None:
        self.sock = f"kvxfer-test-{name}-{os.getpid()}"

    def __call__(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.sock, *args], capture_output=True, text=True, check=True,
                              timeout=30).stdout

    def start(self, command: str) -> None:
        self("new-session", "-d", "-x", "220", "-y", "60", "-s", "top", command)

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "top")

    def kill(self) -> None:
        subprocess.run(["tmux", "-L", self.sock, "kill-server"], capture_output=True, timeout=30)


@needs_tmux
@pytest.mark.parametrize("term", ["xterm-256color", "dumb"])
def test_live_view_in_a_real_terminal_refreshes_and_quits_on_q(curve_server: ServerProcess, curve_client: CacheClient,
                                                               tmp_path: Path, term: str) -> None:
    """A terminal that moves its cursor redraws one screen; TERM=dumb gets frame after frame."""
    model = f"live-{term}"
    _workload(curve_client, model, 2)
    tmux = Tmux(term)
    done = tmp_path / "exit-code"
    cmd = (f"TERM={term} {sys.executable} -m kvxfer top --url {curve_server.url} "
           f"--curve-dir {curve_server.curve_dir} --interval 0.5; echo $? > {done}; sleep 60")
    tmux.start(f"bash -c '{cmd}'")
    try:
        # a whole frame (the pane may start at 80x24 and grow to 220x60 under the first one)
        assert wait_until(lambda: model in (s := tmux.screen()) and "q quits" in s, timeout=60), \
            f"top never showed the model:\n{tmux.screen()}"
        screen = tmux.screen()
        assert "stores and retrieves" in screen
        assert traffic_row(screen, model, "store")[5] == traffic_row(screen, model, "retrieve")[5] == "2"
        # more work: the totals on screen follow
        _workload(curve_client, model, 4)
        assert wait_until(lambda: traffic_row(tmux.screen(), model, "retrieve")[5] == "6", timeout=30), \
            tmux.screen()
        tmux("send-keys", "-t", "top", "q")
        assert wait_until(lambda: done.exists() and done.read_text().strip(), timeout=30), tmux.screen()
        assert done.read_text().strip() == "0"
        if term != "dumb":
            assert "q quits" not in tmux.screen()  # the alternate screen is gone
    finally:
        tmux.kill()


@pytest.mark.parametrize("command", [
    ("demo", "--layers", "2", "--prompts", "1", "--prompt-tokens", "128"),
    ("bench", "--prefix", "--layers", "2", "--heads", "1", "--prefix-chunks", "1", "--iters", "1",
     "--chunk-size", str(CHUNK_SIZE), "--blocks", "64"),
])
def test_the_demo_and_the_benchmarks_reach_a_tcp_server_with_its_keys(curve_server: ServerProcess,
                                                                      command: tuple[str, ...]) -> None:
    """``--curve-dir`` as ``kvxfer status`` takes it: what the client's CURVE error tells a user to pass."""
    proc = subprocess.run([sys.executable, "-m", "kvxfer", *command, "--url", curve_server.url,
                           "--curve-dir", str(curve_server.curve_dir)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_reply_of_huge_lists_and_texts_is_cut_before_it_is_rendered(curve_client: CacheClient) -> None:
    """A status reply may hold 65,536 entries per list and texts of any length (a broken or
    hostile server): rendered whole, a frame of them took about 90 s. What top polls is cut to
    MAX_ROWS entries per list and MAX_TEXT characters per text, then rendered. (The client below
    stands in for a hostile server: the real one never sends such a reply; the reply is real.)"""
    from rich.console import Console

    from kvxfer import top

    _workload(curve_client, "huge-reply", 1)
    st = curve_client.status()
    (tr,) = [t for t in st.traffic if t.model == "huge-reply"]
    huge = msgspec.structs.replace(
        st, url="u" * 100_000,
        traffic=[msgspec.structs.replace(tr, model=f"m{i}-" + "x" * 1000) for i in range(20_000)],
        sections={f"s{i}": {"k": "v" * 10_000} for i in range(5_000)})

    class Client:
        url = curve_client.url

        def status(self) -> m.StatusReply:
            return huge

    got = top._poll(Client())
    assert len(got.traffic) == top.MAX_ROWS and len(got.sections) == top.MAX_ROWS
    assert len(got.url) == top.MAX_TEXT and all(len(t.model) <= top.MAX_TEXT for t in got.traffic)
    assert all(len(v) <= top.MAX_TEXT for s in got.sections.values() for v in s.values())
    console = Console(width=120, record=True, file=io.StringIO())
    console.print(render(got, got, 1.0))
    assert "m199-" in console.export_text()
    curve_client.clear("huge-reply")


def test_after_a_poll_that_got_no_answer_rates_span_the_time_since_the_last_answer(
        curve_client: CacheClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A poll that gets no answer (a stalled server: here a stand-in for the client raises once,
    0.3 s into its poll) keeps the last report and its time: the next answer's rates divide what
    happened since that report by the time since it, not by the time since the failed poll (the
    count of several seconds over one interval: rates many times too high)."""
    import time

    import kvxfer.top as top
    from kvxfer.errors import RequestTimeout

    seen: list[tuple[float | None, str]] = []
    monkeypatch.setattr(top, "render", lambda st, prev, elapsed, error: seen.append((elapsed, error)) or "")

    class Stalling:
        url = curve_client.url
        calls = 0

        def status(self) -> m.StatusReply:
            self.calls += 1
            if self.calls == 2:
                time.sleep(0.3)
                raise RequestTimeout("no reply")
            return curve_client.status()

    frames = top._frames(Stalling(), curve_client.status(), 0.05, keys=False)
    for _ in range(3):
        next(frames)
    (_, ok), (_, failed), (elapsed, recovered) = seen
    assert not ok and "no answer" in failed and not recovered
    assert elapsed is not None and elapsed >= 0.3, f"rates over {elapsed} s, though the last answer came 0.3 s before"

