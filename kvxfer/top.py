"""``kvxfer top``: a live terminal view of a server's figures.

It polls ``status`` (the same report as ``kvxfer status`` and the Prometheus exporter) once per
``--interval`` and draws it with ``rich``: the server, the arena, lookups and hit rates, stores
and retrieves per model and transport (rates between two polls, totals since the server
started), latency percentiles inside the server, transports and plugin figures. ``q`` quits
(``Ctrl-C`` too). When stdout is not a terminal, or with ``--once``, it prints one frame and
exits. A server that stops answering is shown as such and polled again; a restarted server is
reconnected to.

Runs on the calling thread; :func:`render` is a pure function of two reports, which the tests
use directly.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import select
import shutil
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final

from kvxfer.protocol import messages as m
from kvxfer.text_table import percent, printable, printable_lines, printable_struct
from kvxfer.units import format_bytes

if TYPE_CHECKING:
    from rich.console import RenderableType
    from rich.text import Text

__all__ = ["render", "run_top", "sessions_besides_asker"]


# --------------------------------------------------------------------------- formatting


def _duration(s: float) -> str:
    if s <= 0:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def _uptime(s: float) -> str:
    if not math.isfinite(s) or s < 0:  # a reply from the wire: shown, never trusted
        return "-"
    s = int(s)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    mi, s = divmod(s, 60)
    return (f"{d}d " if d else "") + (f"{h}h{mi:02d}m" if d or h else f"{mi}m{s:02d}s")


def _rate(now: float, before: float | None, dt: float | None) -> str:
    if before is None or not dt:
        return "-"
    r = max(0.0, now - before) / dt
    return f"{r:.1f}" if r < 100 else f"{r:.0f}"


def _short_bytes(n: float) -> str:
    """``n`` bytes in at most 5 characters: 512, 16K, 1.5M, 12G (binary units)."""
    for unit, size in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size:
            v = n / size
            return f"{v:.1f}{unit}" if v < 10 else f"{v:.0f}{unit}"
    return f"{n:.0f}"


def _short_rate(now: float, before: float | None, dt: float | None) -> str:
    if before is None or not dt:
        return "-"
    return _short_bytes(max(0.0, now - before) / dt)


#: Width of a frame printed to a pipe or a file (``$COLUMNS`` overrides it): wide enough that no
#: line of a frame wraps.
_FILE_COLUMNS = 200


def _bar(fraction: float, width: int = 24) -> str:
    n = max(0, min(width, round(fraction * width))) if math.isfinite(fraction) else 0
    return "█" * n + "░" * (width - n)


def sessions_besides_asker(st: m.StatusReply) -> str:
    """The sessions of ``st`` without the one that asked for it, in words (``2 sessions besides
    this one``): what ``kvxfer status`` and ``kvxfer top`` show. The server's count includes the
    session of whoever asked (every status request comes through one), which a user who started
    one client does not expect to see; ``kvxfer status --json`` and the ``kvxfer_sessions``
    metric keep the server's own count."""
    n = max(0, st.sessions - 1)
    return f"{n} session{'' if n == 1 else 's'} besides this one"


def _sample_key(s: m.MetricSample) -> str:
    return s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")


# --------------------------------------------------------------------------- one frame


def render(st: m.StatusReply, prev: m.StatusReply | None = None, dt: float | None = None,
           error: str = "", live: bool = True) -> RenderableType:
    """One frame: ``st`` now, ``prev`` the report ``dt`` seconds earlier (rates), ``error`` a
    line to show when the last poll failed; ``live`` False for a frame printed once (no key
    hint)."""
    from rich.console import Group
    from rich.text import Text

    prev_models = {x.model: x for x in prev.models} if prev else {}
    prev_traffic = {(x.model, x.transport): x for x in prev.traffic} if prev else {}
    parts: list[Any] = []

    head: list[Text | str] = [Text(f"kvxfer {st.server_version}", style="bold"), st.url, f"pid {st.pid}",
                              f"up {_uptime(st.uptime_s)}", f"chunk {st.chunk_size} tokens", sessions_besides_asker(st),
                              f"{st.requests_in_flight} in flight"]
    if live:
        head.append(Text("(q quits)", style="dim"))
    parts.append(_Fields(*head))
    if st.metrics_url:
        parts.append(Text(f"metrics {st.metrics_url}", style="dim"))
    if error:
        parts.append(Text(error, style="bold red"))

    a = st.arena
    used = a.used / a.capacity if a.capacity else 0.0
    evictions = _rate(a.evictions, prev.arena.evictions if prev else None, dt)
    parts.append(_Fields(f"arena {_bar(used)} {format_bytes(a.used)} of {format_bytes(a.capacity)} ({100 * used:.1f}%)",
                         f"{a.chunks} chunks", f"largest free {format_bytes(a.largest_free)}",
                         f"{a.free_extents} free extents", f"evictions {evictions}/s ({a.evictions} total)"))
    hit_now = "-"
    if prev is not None and st.lookup_chunks > prev.lookup_chunks:
        hit_now = percent(st.lookup_hits - prev.lookup_hits, st.lookup_chunks - prev.lookup_chunks)
    errors = ", ".join(f"{code} {n}" for code, n in sorted(st.errors_by_code.items())) or "none"
    parts.append(_Fields(f"lookups {_rate(st.lookups, prev.lookups if prev else None, dt)}/s ({st.lookups} total)",
                         f"hit rate {hit_now} now, {percent(st.lookup_hits, st.lookup_chunks)} total",
                         f"leases {st.leases} ({st.leased_chunks} chunks)", f"reservations {st.reservations}",
                         f"errors {st.errors} ({errors})", f"hook errors {st.hook_errors}"))

    prev_tiers = {t.name: t for t in prev.tiers} if prev else {}
    for tier in st.tiers:
        pt_ = prev_tiers.get(tier.name)
        name = Text(printable(f"{tier.name} {tier.store} "))
        name.append(tier.state, style="green" if tier.state == "up" else "bold red")
        fields: list[Text | str] = [
            name, f"hits {percent(tier.lookup_hits, tier.lookup_chunks)} of {tier.lookup_chunks} chunks asked",
            (f"promoted {_rate(tier.promotions, pt_.promotions if pt_ else None, dt)}/s "
             f"({tier.promotions}, {tier.promoting} now)"),
            (f"written {_short_rate(tier.write_bytes, pt_.write_bytes if pt_ else None, dt)}/s "
             f"({format_bytes(tier.write_bytes)})"),
            f"queue {tier.queue_depth}/{tier.queue_capacity}", f"drops {tier.drops}", f"errors {tier.errors}",
            f"timeouts {tier.timeouts}", f"busy {tier.busy_lookups}"]
        if tier.writers_held:
            fields.append(Text(f"writers held {tier.writers_held}", style="red"))
        if tier.detail:
            fields.append(Text(printable(tier.detail), style="red"))
        parts.append(_Fields(*fields))

    # one row per model, transport and op, narrow enough for 80 columns
    t = _table("stores and retrieves (skip: already stored / not found; open: in flight)",
               "model", "transport", "op", "/s", "B/s", "chunks", "bytes", "skip", "fail", "open", "copy")
    for tr in st.traffic:
        pt = prev_traffic.get((tr.model, tr.transport), m.TrafficStatus(tr.model, tr.transport) if prev else None)
        _row(t, tr.model, tr.transport, "store", _rate(tr.stores, pt.stores if pt else None, dt),
                  _short_rate(tr.stored_bytes, pt.stored_bytes if pt else None, dt), str(tr.stored_chunks),
                  _short_bytes(tr.stored_bytes), str(tr.present_chunks),
                  str(tr.no_space_chunks + tr.failed_chunks + tr.abandoned_chunks),
                  str(tr.stores_in_flight), _duration(tr.store_copy_s))
        _row(t, tr.model, tr.transport, "retrieve", _rate(tr.retrieves, pt.retrieves if pt else None, dt),
                  _short_rate(tr.loaded_bytes, pt.loaded_bytes if pt else None, dt), str(tr.loaded_chunks),
                  _short_bytes(tr.loaded_bytes), str(tr.missing_chunks), "", str(tr.retrieves_in_flight),
                  _duration(tr.retrieve_copy_s))
    parts += [Text(""), t if st.traffic else Text("no stores or retrieves yet", style="dim")]

    t = _table("models", "model", "contexts", "lookups/s", "lookups", "hit now", "hit total", "evicted/s", "evicted")
    for md in st.models:
        pm = prev_models.get(md.model, m.ModelStatus(md.model) if prev else None)
        now = (percent(md.lookup_hits - pm.lookup_hits, md.lookup_chunks - pm.lookup_chunks)
               if pm is not None and md.lookup_chunks > pm.lookup_chunks else "-")
        _row(t, md.model, str(md.contexts), _rate(md.lookups, pm.lookups if pm else None, dt), str(md.lookups),
                  now, percent(md.lookup_hits, md.lookup_chunks),
                  _rate(md.evicted_chunks, pm.evicted_chunks if pm else None, dt), str(md.evicted_chunks))
    parts += [Text(""), t if st.models else Text("no models yet", style="dim")]

    t = _table("latency inside the server (most recent requests)", "request", "transport", "count", "window",
               "p50", "p90", "p99", "max")
    for la in st.latency:
        _row(t, la.name, la.transport or "", str(la.count), str(la.window), _duration(la.p50_s), _duration(la.p90_s),
                  _duration(la.p99_s), _duration(la.max_s))
    parts += [Text(""), t]

    t = _table("transports", "transport", "style", "contexts", "state")
    for tp in st.transports:
        _row(t, tp.name, tp.style, str(tp.contexts), " ".join(f"{k}={v}" for k, v in tp.state.items()) or "-")
    parts += [Text(""), t]

    if st.plugin_metrics:
        before = {_sample_key(s): s.value for s in prev.plugin_metrics} if prev else {}
        if prev:  # a counter that appeared since the last poll counted from zero
            before = {_sample_key(s): 0.0 for s in st.plugin_metrics if s.kind == "counter"} | before
        t = _table("plugin figures", "metric", "value", "per second")
        for s in st.plugin_metrics:
            key = _sample_key(s)
            per_s = _rate(s.value, before.get(key), dt) if s.kind == "counter" else ""
            _row(t, key, f"{s.value:.6g}", per_s)
        parts += [Text(""), t]
    for title, values in st.sections.items():
        parts += [Text(""), _Fields(printable(f"[{title}]"), *(printable(f"{k}={v}") for k, v in values.items()))]
    return Group(*parts)


class _Fitted:
    """A frame cut to the screen's height, saying how many lines did not fit (a live screen
    crops what is taller without a sign)."""

    def __init__(self, frame: RenderableType) -> None:
        self.frame = frame

    def __rich_console__(self, console: Any, options: Any) -> Iterator[Any]:
        from rich.segment import Segment
        from rich.text import Text

        height = options.height or console.height
        lines = console.render_lines(self.frame, options.update(height=None), pad=False)
        if len(lines) > height:
            more = len(lines) - height + 1
            lines = lines[:height - 1]
        else:
            more = 0
        for line in lines:
            yield from line
            yield Segment.line()
        if more:
            yield Text(f"... {more} more line{'' if more == 1 else 's'} (a taller terminal shows them)", style="dim",
                       no_wrap=True, overflow="ellipsis")


class _Fields:
    """A line of fields two spaces apart that breaks, where the width runs out, between fields
    rather than inside one (a field wider than the whole line is folded)."""

    def __init__(self, *fields: Text | str) -> None:
        from rich.text import Text

        self.fields = [f if isinstance(f, Text) else Text(f) for f in fields]

    def __rich_console__(self, console: Any, options: Any) -> Iterator[Any]:
        from rich.text import Text

        line = Text()
        for f in self.fields:
            if line.cell_len and line.cell_len + 2 + f.cell_len > options.max_width:
                yield line
                line = Text()
            if line.cell_len:
                line.append("  ")
            line.append_text(f)
        yield line

    def __rich_measure__(self, console: Any, options: Any) -> Any:
        from rich.measure import Measurement

        widths = [f.cell_len for f in self.fields] or [0]
        return Measurement(max(widths), sum(widths) + 2 * (len(widths) - 1))


class _MiddleCut:
    """A table cell of plain text that, in a column narrower than the text, is cut in the middle
    (``meta-llama/L…-Instruct-w8a8``): names that differ only at the end (model variants) stay
    told apart. It gives up columns down to :data:`_CUT_MIN` characters."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __rich_console__(self, console: Any, options: Any) -> Iterator[Any]:
        from rich.text import Text

        yield Text(_cut_middle(self.text, options.max_width), no_wrap=True, overflow="crop")

    def __rich_measure__(self, console: Any, options: Any) -> Any:
        from rich.measure import Measurement

        return Measurement(min(len(self.text), _CUT_MIN), len(self.text))


#: Fewest characters a name cut in the middle keeps.
_CUT_MIN: Final = 12


#: An identity as the vLLM connector makes them: a label, then ``#`` and a 16-hex-digit fingerprint.
_IDENTITY: Final = re.compile(r"(.+)#([0-9a-f]{16})")
#: Hex digits of a fingerprint kept when an identity is cut.
_FINGERPRINT_KEPT: Final = 4


def _cut_middle(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters: a third of them from its start, an ellipsis, the
    rest from its end. An identity (``label#fingerprint``) gives up its fingerprint's digits but
    the first few before its label is cut: the label's end tells model variants apart, which a
    fingerprint alone does not tell a reader. A label ``model@dtype`` (the vLLM connector's)
    then gives up its dtype, unless the model keeps :data:`_CUT_MIN` characters beside it: every
    model of a server would otherwise end in the same ``@bfloat16``."""
    if len(text) <= width:
        return text
    m = _IDENTITY.fullmatch(text)
    if m is not None:  # the fingerprint cut (marked so) first, to no fewer than a few digits
        label, fp = m.groups()
        digits = width - len(label) - 2  # "#" and "…"
        if digits >= _FINGERPRINT_KEPT:
            return f"{label}#{fp[:digits]}…"
        tail = f"#{fp[:_FINGERPRINT_KEPT]}…"
        if width >= len(tail) + _CUT_MIN // 2:
            room = width - len(tail)
            model, at, dtype = label.rpartition("@")
            if at and model:
                suffix = at + dtype
                if room - len(suffix) >= _CUT_MIN:
                    return _cut_middle(model, room - len(suffix)) + suffix + tail
                return _cut_middle(model, room) + tail
            return _cut_middle(label, room) + tail
    if width <= 1:
        return text[-width:] if width else ""
    head = (width - 1) // 3
    return text[:head] + "…" + text[len(text) - (width - 1 - head):]


_TEXT_COLUMNS: Final = frozenset({"model", "transport", "op", "request", "style", "state", "metric"})


def _row(table: Any, *cells: str) -> None:
    """One row of plain text: names come from clients and plugins, so a cell is never read as
    rich markup (``[/]`` would raise, ``[link=...]`` would be obeyed) and its control characters
    are shown escaped, never sent to the terminal. Text columns are cut in the middle where the
    table must narrow them (:class:`_MiddleCut`), numbers never."""
    from rich.text import Text

    table.add_row(*(_MiddleCut(printable(c)) if col.header in _TEXT_COLUMNS else Text(printable(c))
                    for col, c in zip(table.columns, cells, strict=True)))


def _table(title: str, *columns: str) -> Any:
    """A borderless table, one space between columns, text left and numbers right."""
    from rich.table import Table

    t = Table(title=title, title_justify="left", box=None, pad_edge=False, padding=(0, 1, 0, 0))
    for col in columns:
        t.add_column(col, justify="left" if col in _TEXT_COLUMNS else "right")
    return t


# --------------------------------------------------------------------------- the live loop


@contextlib.contextmanager
def _keys() -> Iterator[bool]:
    """stdin in cbreak mode (keys arrive one by one, unechoed) while in the block; yields
    whether keys can be read at all."""
    if not sys.stdin.isatty():
        yield False
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _wait_for_quit(seconds: float, keys: bool) -> bool:
    """Wait up to ``seconds``; True if ``q`` was pressed."""
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if not keys:
            time.sleep(left)
            return False
        ready, _, _ = select.select([sys.stdin], [], [], left)
        if ready:
            ch = os.read(sys.stdin.fileno(), 1)
            if ch in (b"q", b"Q", b"\x03"):
                return True


#: Rows of any one list of a status reply a frame shows, and characters of any one text (a
#: screen shows fewer; a reply may hold 65,536 of each, which took a minute and a half to render).
MAX_ROWS: Final = 200
MAX_TEXT: Final = 256


def bounded(value: Any) -> Any:
    """``value`` (a decoded status reply: Structs, lists, dicts, strings, numbers) with every list
    and dict cut to :data:`MAX_ROWS` items and every string to :data:`MAX_TEXT` characters."""
    import msgspec

    if isinstance(value, str):
        return value[:MAX_TEXT]
    if isinstance(value, msgspec.Struct):
        return msgspec.structs.replace(value, **{f: bounded(getattr(value, f)) for f in value.__struct_fields__})
    if isinstance(value, (list, tuple)):
        return type(value)(bounded(v) for v in value[:MAX_ROWS])
    if isinstance(value, dict):
        return {bounded(k): bounded(v) for k, v in list(value.items())[:MAX_ROWS]}
    return value


def _poll(client: Any) -> m.StatusReply:
    from kvxfer.errors import NoSession

    try:
        st = client.status()
    except NoSession:  # the server restarted: open a new session and ask again
        client.reconnect()
        st = client.status()
    return printable_struct(bounded(st))  # the server's text goes to a terminal


def _frames(client: Any, st: m.StatusReply, interval: float, keys: bool) -> Iterator[RenderableType]:
    """A frame every ``interval`` seconds (rates against the previous poll) until ``q``."""
    from kvxfer.errors import KvxferError

    prev: m.StatusReply | None = None
    t_st = prev_t = polled = time.monotonic()  # the shown report's time; the last poll's end
    while not _wait_for_quit(max(0.0, polled + interval - time.monotonic()), keys):
        error = ""
        try:
            new = _poll(client)
            prev, prev_t, st, t_st = st, t_st, new, time.monotonic()
        except KvxferError as exc:  # the last report stays, with its own time (the rates after it)
            error = printable_lines(f"no answer from {client.url}: {exc} (retrying every {interval:g} s)")
        polled = time.monotonic()
        yield render(st, prev, t_st - prev_t if prev is not None else None, error)


def run_top(client: Any, interval: float = 1.0, once: bool = False) -> int:
    """Show ``client``'s server until ``q`` (or one frame with ``once`` or without a terminal).
    A terminal that cannot move its cursor (``TERM=dumb``) gets one frame after another."""
    from rich.console import Console
    from rich.live import Live

    if sys.stdout.isatty():
        # a shell exports the size the terminal had when it started; the live view follows the
        # terminal's real size instead (rich would take these as fixed)
        os.environ.pop("COLUMNS", None)
        os.environ.pop("LINES", None)
    console = Console()
    if console.is_dumb_terminal and console.is_terminal:  # rich assumes 80 columns there
        console = Console(width=shutil.get_terminal_size().columns)
    st = _poll(client)
    if once or not console.is_terminal:
        if not console.is_terminal and "COLUMNS" not in os.environ:
            console = Console(width=_FILE_COLUMNS)  # a pipe or a file: not wrapped at rich's 80
        console.print(render(st, live=False))
        return 0
    with _keys() as keys:
        if console.is_dumb_terminal:
            console.print(render(st))
            for frame in _frames(client, st, interval, keys):
                console.print()
                console.print(frame)
            return 0
        with Live(_Fitted(render(st)), console=console, screen=True, auto_refresh=False, redirect_stdout=False,
                  redirect_stderr=False) as live:
            for frame in _frames(client, st, interval, keys):
                live.update(_Fitted(frame), refresh=True)
    return 0
