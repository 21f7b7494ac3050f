"""The ``kvxfer`` command (also ``python -m kvxfer``).

::

    kvxfer serve   [--url URL] [--l1-size 4GiB] [--chunk-size 256] [--transports a,b] [--shm-dir DIR]
                   [--l2 valkey --l2-url valkey://HOST:6379[,HOST2:6379] [--l2-admission all|hits:N] ...]
                   [--max-... limits, see `kvxfer serve --help` and docs/reliability.md]
    kvxfer plugins [--json]
    kvxfer status  [--url URL] [--json]
    kvxfer top     [--url URL] [--interval 1] [--once]
    kvxfer keys    DIR
    kvxfer demo    [--url URL] ...
    kvxfer bench   ...              (benchmarks/transfer.py)
"""

from __future__ import annotations

import argparse
import atexit
import functools
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, NoReturn

import msgspec

from kvxfer.errors import ConfigError, KvxferError
from kvxfer.text_table import percent, print_table, printable, printable_lines, printable_struct
from kvxfer.units import format_bytes, parse_size
from kvxfer.urls import default_url

if TYPE_CHECKING:
    from kvxfer.client import CacheClient
    from kvxfer.mq.client import CurveClientKeys
    from kvxfer.mq.server import CurveServerKeys
    from kvxfer.protocol.messages import TierStatus
    from kvxfer.server.limits import Limits
    from kvxfer.server.tier import TierConfig
    from kvxfer.transport.registry import PluginInfo

__all__ = ["READY_LINE", "main"]

#: How ``kvxfer serve``'s line starts once the server is bound and about to serve (followed by
#: its url and figures); :class:`kvxfer.testing.ServerProcess` waits for it.
READY_LINE: Final = "kvxfer server ready at"


# --------------------------------------------------------------------------- serve


def _curve_server(curve_dir: str | None, url: str) -> CurveServerKeys | None:
    if curve_dir is None:
        return None
    if not url.startswith("tcp://"):
        raise ConfigError(f"--curve-dir {curve_dir}: CURVE keys admit clients of a tcp:// server; {url} admits "
                          "local processes by its socket's permissions and their credentials, and would use no key: "
                          "leave --curve-dir out, or serve at tcp://HOST:PORT")
    from kvxfer.security import load_server_keys

    return load_server_keys(Path(curve_dir))


#: kvxfer.store.PASSWORD_ENV, named here too: importing kvxfer.store would cost the parser 0.15 s
#: (tests/core/test_l2_tier.py checks that the two agree).
L2_PASSWORD_ENV: Final = "KVXFER_L2_PASSWORD"


#: The defaults of the ``--l2-*`` options of ``kvxfer serve`` (by dest).
_L2_DEFAULTS: Final[dict[str, object]] = {"l2_url": "", "l2_admission": "all", "l2_queue": 64, "l2_writers": 2,
                                          "l2_readers": 2, "l2_timeout": 0.5, "l2_bulk_timeout": 10.0,
                                          "l2_write_yield": 0.1}


def _l2_config(args: argparse.Namespace) -> TierConfig | None:
    """The TierConfig of ``--l2 ...`` (None without ``--l2``). A password in
    ``$KVXFER_L2_PASSWORD`` goes into the URL here, so it need not be on the command line."""
    import os
    from urllib.parse import quote, urlsplit, urlunsplit

    from kvxfer.errors import ConfigError
    from kvxfer.server.tier import TierConfig

    if not args.l2:
        given = [f"--{dest.replace('_', '-')}" for dest, default in _L2_DEFAULTS.items()
                 if getattr(args, dest) != default]
        if given:  # an option of a tier that is not there would be ignored without a word
            raise ConfigError(f"{', '.join(given)} need{'s' if len(given) == 1 else ''} --l2 NAME (the store backend: "
                              "see `kvxfer plugins`)")
        return None
    url = args.l2_url or ""
    password = os.environ.get(L2_PASSWORD_ENV)
    if password:
        try:
            password.encode("utf-8")
        except UnicodeEncodeError:  # bytes that are no UTF-8 text (the value itself is never shown)
            raise ConfigError(f"${L2_PASSWORD_ENV} is not UTF-8 text; set the store's password as text") from None
    if password and url:
        from kvxfer.store import split_hosts

        parts = []
        for part in split_hosts(url):
            s = urlsplit(part)
            if s.password is None and s.hostname and s.scheme.lower() != "file":  # a network store's host
                user = s.username or ""
                host = s.netloc.rpartition("@")[2]
                part = urlunsplit((s.scheme, f"{user}:{quote(password, safe='')}@{host}", s.path, s.query, s.fragment))
            parts.append(part)
        url = ",".join(parts)
    return TierConfig(store=args.l2, url=url, admission=args.l2_admission, queue=args.l2_queue,
                      writers=args.l2_writers, readers=args.l2_readers, timeout_s=args.l2_timeout,
                      bulk_timeout_s=args.l2_bulk_timeout, write_yield_s=args.l2_write_yield)


def _limits(args: argparse.Namespace) -> Limits:
    """A Limits with the --max-... options given on the command line."""
    from kvxfer.server.limits import SPECS, Limits

    given = {name: getattr(args, name) for name in SPECS if getattr(args, name) is not None}
    return Limits(**given)


def _given(option: str, value: str) -> str:
    """``value``, unless it is empty (``--shm-dir ''`` would be the current directory)."""
    if not value.strip():
        raise ConfigError(f"{option} is empty: give a directory")
    return value


#: ``--exit-with-parent`` without a PID: the parent the server has when it starts.
_OWN_PARENT = -1


def _pid(text: str) -> int:
    """A process id given on the command line (a positive integer)."""
    try:
        pid = int(text)
    except ValueError:
        pid = 0
    if pid <= 0:
        raise argparse.ArgumentTypeError(f"a process id is a positive integer, got {text!r}")
    return pid


def cmd_serve(args: argparse.Namespace) -> int:
    from kvxfer.server import CacheServer, ServerConfig

    parent = args.exit_with_parent
    if parent == _OWN_PARENT:  # the bare option: this process's parent now (before the arena's seconds)
        parent = os.getppid()
        if parent == 0:
            raise ConfigError("--exit-with-parent: this server's parent is outside its PID namespace (a container's "
                              "entry point, or a process started by `docker exec`), so its end cannot be seen from "
                              "here; run the server without the option")

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.url.startswith("inproc://"):
        raise ConfigError(f"--url {args.url}: an inproc:// server is reachable only from its own process; serve "
                          "at ipc://PATH (this host) or tcp://HOST:PORT")
    if args.metrics_host is not None and args.metrics_port is None:
        raise ConfigError(f"--metrics-host {args.metrics_host}: no metrics are served without --metrics-port N "
                          "(0: any free port)")
    hangups: list[int] = []
    started: list[Any] = []  # the server, once made

    def hangup(signum: int, frame: Any) -> None:
        if started:
            started[0].reload_authorized_keys()
        else:
            hangups.append(signum)

    if args.url.startswith("tcp://") and threading.current_thread() is threading.main_thread():
        # SIGHUP ends a process by default: one sent while the arena fills in (seconds) is kept
        # for the server to act on once it serves, as kvxfer keys --client tells operators to send
        signal.signal(signal.SIGHUP, hangup)
    config = ServerConfig(
        url=args.url,
        l1_size=parse_size(args.l1_size),
        chunk_size=args.chunk_size,
        transports=tuple(dict.fromkeys(t.strip() for t in args.transports.split(",") if t.strip()))  # each once
        if args.transports else None,
        shm_dir=os.path.abspath(_given("--shm-dir", args.shm_dir)),  # clients map the arena by its path
        session_timeout_s=args.session_timeout,
        heartbeat_s=min(1.0, args.session_timeout / 3),
        max_message_size=parse_size(args.max_message_size),
        curve=_curve_server(args.curve_dir, args.url),
        l2=_l2_config(args),
        limits=_limits(args),
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host or "127.0.0.1",
        metrics_max_models=args.metrics_max_models,
        busy_poll_s=args.busy_poll_us / 1e6,
        warm_s=args.warm_us / 1e6,
        parent_pid=parent,
    )
    try:
        server = CacheServer(config)  # a large arena takes seconds to fault in, signals wait for it
    except KeyboardInterrupt:
        print(f"kvxfer serve: interrupted while starting (arena {format_bytes(config.l1_size)}): not served",
              file=sys.stderr, flush=True)
        return 130
    extra = ""
    if server.tier is not None:
        extra = f", L2 {server.tier.store.name} at {server.tier.url} ({server.tier.status().state})"
    if server.metrics_url:
        extra += f", metrics at {server.metrics_url}"
    print(f"{READY_LINE} {config.url} (arena {format_bytes(server.arena.size)}, "
          f"chunk size {config.chunk_size}, transports {', '.join(server.transports)}{extra})", flush=True)
    started.append(server)
    if hangups:  # (checked after: one that comes in between is the server's)
        server.reload_authorized_keys()
    server.serve_forever(install_signal_handlers=True)
    removed = "arena and socket are" if config.url.startswith("ipc://") else "arena is"
    print(f"kvxfer server at {config.url} stopped: its {removed} removed", flush=True)
    if server.tier is not None and server.tier.left_running:  # (logged): the interpreter would wait for them
        logging.shutdown()
        sys.stderr.flush()
        os._exit(0)
    return 0


# --------------------------------------------------------------------------- plugins


def cmd_plugins(args: argparse.Namespace) -> int:
    """List every installed transport and store backend: name, version, distribution,
    api_version, style (transports), health.

    Health is ``available``, ``unavailable`` (its probe says why) or ``broken`` (it failed to
    load, or declares another api_version). ``--json`` prints the same as an object. Exit status
    1 when any plugin is broken (each is listed with why, once: not logged besides), else 0.
    """
    import dataclasses
    import logging

    import kvxfer
    from kvxfer.store.base import STORE_API_VERSION
    from kvxfer.store.registry import NAMESPACE as STORE_NAMESPACE
    from kvxfer.store.registry import list_stores
    from kvxfer.transport.contract import API_VERSION
    from kvxfer.transport.registry import NAMESPACE, list_plugins

    registry_log = logging.getLogger("kvxfer.transport.registry")  # (both registries log there)
    level = registry_log.level
    registry_log.setLevel(logging.ERROR)  # a broken plugin's reason is in the listing itself
    try:
        plugins = list_plugins()
        stores = list_stores()
    finally:
        registry_log.setLevel(level)
    status = 1 if any(p.health == "broken" for p in [*plugins, *stores]) else 0
    if args.json:
        print(json.dumps({
            "kvxfer": kvxfer.__version__,
            "api_version": API_VERSION,
            "entry_point_group": NAMESPACE,
            "transports": [dataclasses.asdict(p) for p in plugins],
            "store_api_version": STORE_API_VERSION,
            "store_entry_point_group": STORE_NAMESPACE,
            # a store has no style and no production flag (those are the transports'): not shown
            "stores": [{k: v for k, v in dataclasses.asdict(p).items() if k not in ("style", "production")}
                       for p in stores],
        }, indent=2))
        return status
    print(f"kvxfer {kvxfer.__version__}, transport api_version {API_VERSION}, entry point group {NAMESPACE}")
    if not plugins:
        print("no transports installed (kvxfer-cpu-gather: pip install plugins/cpu_gather in a kvxfer checkout)")
    else:
        print_table(
            [(p.name, p.version, p.distribution, p.api_version if p.api_version is not None else "-",
              p.style or "-", "yes" if p.production else "no", p.health) for p in plugins],
            ["name", "version", "distribution", "api", "style", "production", "health"],
        )
        print()
        for p in plugins:
            print(f"{p.name}: {p.detail or p.health}")
    print()
    _stores_table(stores, STORE_API_VERSION, STORE_NAMESPACE)
    return status


def _stores_table(stores: list[PluginInfo], api_version: int, namespace: str) -> None:
    print(f"store backends (L2), store api_version {api_version}, entry point group {namespace}")
    if not stores:
        print("no store backends installed (kvxfer-valkey: pip install plugins/valkey in a kvxfer checkout)")
        return
    print_table([(p.name, p.version, p.distribution, p.api_version if p.api_version is not None else "-", p.health)
                 for p in stores], ["name", "version", "distribution", "api", "health"])
    print()
    for p in stores:
        print(f"{p.name}: {p.detail or p.health}")


# --------------------------------------------------------------------------- status


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (counts and sizes of the demo and the benchmarks)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_client_curve_arguments(p: argparse.ArgumentParser) -> None:
    """``--curve-dir`` / ``--curve-name``: a client's keys for a ``tcp://`` server (status, top,
    demo, the benchmarks); :func:`client_curve` loads them."""
    p.add_argument("--curve-dir", default=None, help="CURVE keys made by `kvxfer keys` (for a tcp:// server)")
    p.add_argument("--curve-name", default="client", help="which client key pair in --curve-dir (default: %(default)s)")


def client_curve(args: argparse.Namespace) -> CurveClientKeys | None:
    """The client keys :func:`add_client_curve_arguments` named, or None."""
    if args.curve_dir is None:
        return None
    from kvxfer.security import load_client_keys

    return load_client_keys(Path(args.curve_dir), args.curve_name)


#: How long status and top wait for a server launched a moment ago to claim its socket.
_LAUNCH_S = 1.5


def _connect(args: argparse.Namespace, name: str) -> CacheClient:
    """The client of ``kvxfer status`` and ``kvxfer top``: at once an error where no server
    listens and none is starting, else waiting up to ``--timeout`` for one that is."""
    from kvxfer.client import MAX_TIMEOUT_S, CacheClient, no_server_starting
    from kvxfer.errors import ConnectionFailed
    from kvxfer.urls import check_url, default_url

    url = check_url(args.url or default_url())
    if not 0 < args.timeout <= MAX_TIMEOUT_S:  # NaN fails too
        raise ConfigError(f"--timeout must be a positive number of seconds of at most {MAX_TIMEOUT_S:g}, got "
                          f"{args.timeout!r}")
    why = no_server_starting(url, wait_s=min(args.timeout, _LAUNCH_S))
    if why is not None:
        raise ConnectionFailed(why)
    return CacheClient(url, connect_timeout=args.timeout, timeout=args.timeout, name=name, curve=client_curve(args))


def cmd_status(args: argparse.Namespace) -> int:
    from kvxfer.top import sessions_besides_asker

    with _connect(args, "kvxfer status") as client:
        st = client.status()
    if args.json:  # ASCII: every character a terminal may act on escaped; a NaN figure is null (JSON has none)
        print(json.dumps(msgspec.json.decode(msgspec.json.encode(st)), indent=2))
        return 0
    st = printable_struct(st)  # the server's text goes to a terminal
    a = st.arena
    print(f"kvxfer {st.server_version} (protocol {st.protocol_version}) at {st.url}, pid {st.pid}, "
          f"up {st.uptime_s:.0f} s, chunk size {st.chunk_size}, {sessions_besides_asker(st)}")
    print(f"arena: {format_bytes(a.used)} of {format_bytes(a.capacity)} used, {a.chunks} chunks, "
          f"{a.free_extents} free extents (largest {format_bytes(a.largest_free)}), {a.evictions} evictions; {a.path}")
    rate = percent(st.lookup_hits, st.lookup_chunks)
    if st.tiers:  # where the hits were found: L1, or L2 below it
        rate += (f": L1 {percent(st.lookup_hits - st.lookup_l2_hits, st.lookup_chunks)}, "
                 f"L2 {percent(st.lookup_l2_hits, st.lookup_chunks)}")
    print(f"lookups: {st.lookups} ({st.lookup_chunks} chunks, hit rate {rate}); leases: {st.leases} "
          f"({st.leased_chunks} chunks); reservations: {st.reservations}; errors: {st.errors}; "
          f"hook errors: {st.hook_errors}")
    print()
    if st.contexts:
        print_table(
            [(c.instance_id, c.model_name, c.world_size, c.rank, c.transport, c.layout, c.num_layers, c.block_size,
              c.hidden_dim_size, c.dtype, "yes" if c.use_mla else "no", c.num_blocks, c.client_pid)
             for c in st.contexts],
            ["instance", "model", "world", "rank", "transport", "layout", "layers", "block", "hidden", "dtype", "mla",
             "blocks", "pid"],
        )
    else:
        print("no registered contexts")
    print()
    print_table([(t.name, t.style, t.contexts, ", ".join(f"{k}={v}" for k, v in t.state.items()) or "-")
                 for t in st.transports], ["transport", "style", "contexts", "state"])
    for t in st.tiers:
        print()
        print("\n".join(printable(line) for line in _tier_text(t).split("\n")))
    if st.traffic:
        print()
        print_table(
            [(t.model, t.transport, t.stores, f"{t.stored_chunks} ({format_bytes(t.stored_bytes)})", t.present_chunks,
              t.no_space_chunks + t.failed_chunks + t.abandoned_chunks, t.retrieves,
              f"{t.loaded_chunks} ({format_bytes(t.loaded_bytes)})", t.missing_chunks) for t in st.traffic],
            ["model", "transport", "stores", "stored", "present", "failed", "retrieves", "loaded", "missing"])
    if st.latency:
        print()
        print_table([(x.name, x.transport or "-", x.count, f"{x.p50_s * 1e6:.0f}", f"{x.p99_s * 1e6:.0f}")
                     for x in st.latency], ["latency in the server", "transport", "count", "p50 us", "p99 us"])
    if st.metrics_url:
        print(f"\nmetrics: {st.metrics_url}")
    for title, values in st.sections.items():
        print()
        print(printable(f"[{title}]"))
        for k, v in values.items():
            print(printable(f"  {k}: {v}"))
    return 0


def _of_at_most(limit: int) -> str:
    """`` of at most LIMIT``, or nothing from a server that does not say (an older one: 0)."""
    return f" of at most {format_bytes(limit)}" if limit else ""


def _tier_text(t: TierStatus) -> str:
    """The lines ``kvxfer status`` prints for one storage tier."""
    rate = percent(t.lookup_hits, t.lookup_chunks)
    lines = [
        f"{t.name}: {t.store} at {t.url}: {t.state}{' (' + t.detail + ')' if t.detail else ''}",
        f"  size: {', '.join(f'{k} {v}' for k, v in t.store_stats.items()) or '-'}",
        (f"  lookups: {t.lookups} ({t.lookup_chunks} chunks asked, hit rate {rate}, {t.timeouts} timeouts, "
         f"{t.busy_lookups} not asked: busy)"),
        (f"  promotions: {t.promotions} chunks ({t.promoting} running, {t.promote_failures} failed, "
         f"{t.integrity_failures} failed integrity checks, {t.damaged_deleted} damaged values deleted)"),
        (f"  writes: {t.writes} chunks ({format_bytes(t.write_bytes)}; {t.write_skipped} already stored); "
         f"admission {t.admission}; queue {t.queue_depth}/{t.queue_capacity} "
         f"({format_bytes(t.pinned_bytes)} pinned{_of_at_most(t.pin_limit)}); drops {t.drops}"),
        (f"  errors: {t.errors}; outages: {t.outages}; writers: {t.writers}"
         + (f" ({t.writers_held} more held by the store plugin: a submit call that does not return)"
            if t.writers_held else "")),
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- top


def cmd_top(args: argparse.Namespace) -> int:
    """A live view of the server (status polled every --interval seconds); q quits."""
    from kvxfer.top import run_top

    if not 0.1 <= args.interval <= 3600:
        raise ConfigError(f"--interval must be in [0.1, 3600] seconds, got {args.interval}")
    with _connect(args, "kvxfer top") as client:
        return run_top(client, interval=args.interval, once=args.once)


# --------------------------------------------------------------------------- keys


def cmd_keys(args: argparse.Namespace) -> int:
    from kvxfer.security import add_client, make_keys

    directory = Path(args.dir)
    paths = add_client(directory, args.client) if args.client else make_keys(directory)
    for role, path in paths.items():
        print(f"{role}: {path}")
    print(f"serve with `kvxfer serve --url tcp://HOST:PORT --curve-dir {directory}`; clients need "
          f"server.key and their own key pair (never server.key_secret)")
    if args.client:
        print(f"a server already running with --curve-dir {directory} lets {args.client!r} in once it reads "
              "authorized/ again: send it SIGHUP (kill -HUP PID)")
    return 0


# --------------------------------------------------------------------------- demo, bench


def cmd_demo(args: argparse.Namespace) -> int:
    from kvxfer.demo import run_demo

    return run_demo(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from kvxfer.bench import main as bench_main

    return bench_main(args.bench_args)


# --------------------------------------------------------------------------- main


def _size_arg(text: str) -> int:
    """A byte size option's value (:func:`parse_size`), refused with parse_size's own message
    (argparse shows only "invalid value" for a ValueError)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _limit_options(parser: argparse.ArgumentParser) -> None:
    """One option per limit of kvxfer.server.limits (defaults: docs/reliability.md)."""
    from kvxfer.server.limits import SPECS, Limits

    defaults = Limits()
    group = parser.add_argument_group("limits", "what clients can make the server hold (a request past one gets "
                                                "the error limit_exceeded naming it)")
    for spec in SPECS.values():
        default = getattr(defaults, spec.name)
        kind: Callable[[str], object]
        if spec.unit == "bytes":
            kind, shown = _size_arg, format_bytes(default) if default is not None else "the --l1-size"
        elif spec.unit == "seconds":
            kind, shown = float, f"{default:g} s"
        else:
            kind, shown = int, str(default)
        group.add_argument(spec.option, dest=spec.name, type=kind, default=None,
                           metavar="S" if spec.unit == "seconds" else "N", help=f"{spec.what} (default: {shown})")



def build_parser() -> argparse.ArgumentParser:
    import kvxfer
    from kvxfer.protocol.messages import PROTOCOL_VERSION
    from kvxfer.server.tuning import DEFAULT_WARM_S, MAX_WARM_S, MIN_WARM_S

    p = argparse.ArgumentParser(prog="kvxfer", description="KV cache transfer server and tools")
    p.add_argument("--version", action="version",
                   version=f"kvxfer {kvxfer.__version__}, wire protocol {PROTOCOL_VERSION}")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        """A subcommand's parser, which its namespace names (its own usage for an unknown option)."""
        parser = sub.add_parser(name, **kwargs)
        parser.set_defaults(parser=parser)
        return parser

    s = command("serve", help="run a cache server")
    s.add_argument("--url", default=default_url(), help="ipc://PATH or tcp://HOST:PORT (default: %(default)s)")
    s.add_argument("--l1-size", default="1GiB",
                   help="host memory for chunks, e.g. 4GiB (or 4G; 4GB is 4 x 1000^3 bytes): all of it is allocated "
                        "in --shm-dir and faulted in at start-up, before the server answers (default: %(default)s)")
    s.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk (default: %(default)s)")
    s.add_argument("--transports", default="", help="comma-separated transports to load (default: every installed "
                                                    "one meant for production that can run here)")
    s.add_argument("--shm-dir", default="/dev/shm", help="tmpfs directory for the arena (default: %(default)s)")
    s.add_argument("--session-timeout", type=float, default=3.0,
                   help="seconds of client silence before its registrations are dropped (default: %(default)s)")
    s.add_argument("--max-message-size", default="16MiB", help="largest request accepted (default: %(default)s)")
    s.add_argument("--curve-dir", default=None, help="CURVE keys made by `kvxfer keys` (required for tcp://)")
    s.add_argument("--metrics-port", type=int, default=None, metavar="N",
                   help="serve Prometheus metrics at http://HOST:N/metrics (0: any free port; default: none)")
    s.add_argument("--metrics-host", default=None,
                   help="address of the metrics endpoint (default: 127.0.0.1, this host only)")
    s.add_argument("--metrics-max-models", type=int, default=32, metavar="N",
                   help="model names with their own label in metrics; later ones share '__other__' "
                        "(default: %(default)s)")
    s.add_argument("--busy-poll-us", type=float, default=0.0, metavar="US",
                   help="after any message (each client's heartbeat included), the server's loop polls without "
                        "sleeping for this long, a CPU busy meanwhile; whether a lone request gains depends on the "
                        "host: measure it with `kvxfer bench --prefix --busy-poll-us US` (docs/performance.md, "
                        "'Busy polling'); at most 1000000; 0: off (default: %(default)g)")
    s.add_argument("--warm-us", type=float, default=DEFAULT_WARM_S * 1e6, metavar="US",
                   help="while the server is idle, a thread runs the CPU steps a server-driven request makes "
                        "in the server on a chunk of its own every US microseconds, so that a request after an idle "
                        "gap does not run them cold; whether a lone request gains depends on the host: measure it with "
                        "`kvxfer bench --prefix --warm-us US` (docs/performance.md, 'Keeping the steps warm'); "
                        f"0: off, else in [{MIN_WARM_S * 1e6:g}, {MAX_WARM_S * 1e6:g}] (default: %(default)g)")
    s.add_argument("--exit-with-parent", nargs="?", const=_OWN_PARENT, default=None, type=_pid, metavar="PID",
                   help="stop, as on SIGTERM (the arena and socket removed), within a second of the process "
                        "that started this one exiting, however it ended (a test run or a supervisor that was "
                        "killed). With PID (the starting process's own, e.g. --exit-with-parent=$$), a parent "
                        "that is gone before the server starts is seen too: it then refuses to start. The "
                        "conformance kit's servers run with it")
    g = s.add_argument_group("L2 tier", "a shared store under the arena (docs/l2.md); `kvxfer plugins` lists backends")
    g.add_argument("--l2", default="", metavar="NAME", help="store backend: valkey, fs, ... (default: none)")
    g.add_argument("--l2-url", default=_L2_DEFAULTS["l2_url"], metavar="URL",
                   help="valkey://[USER@]HOST:PORT[,HOST2:PORT...] (a cluster is discovered), valkeys:// for TLS, "
                        "file:///DIR?max_size=SIZE for fs, another store plugin's own scheme for it; the password "
                        f"may come from ${L2_PASSWORD_ENV}")
    g.add_argument("--l2-admission", default=_L2_DEFAULTS["l2_admission"], metavar="POLICY",
                   help="which stored chunks go to L2: all, or hits:N once N lookups found them (default: %(default)s)")
    g.add_argument("--l2-queue", type=int, default=_L2_DEFAULTS["l2_queue"], metavar="N",
                   help="chunks waiting for an L2 writer; more are dropped (default: %(default)s)")
    g.add_argument("--l2-writers", type=int, default=_L2_DEFAULTS["l2_writers"], metavar="N",
                   help="L2 writer threads (default: %(default)s)")
    g.add_argument("--l2-readers", type=int, default=_L2_DEFAULTS["l2_readers"], metavar="N",
                   help="L2 connections for promotions (default: %(default)s)")
    g.add_argument("--l2-timeout", type=float, default=_L2_DEFAULTS["l2_timeout"], metavar="S",
                   help="longest wait for the L2 store in a lookup: what a lookup pays at most (default: %(default)s)")
    g.add_argument("--l2-bulk-timeout", type=float, default=_L2_DEFAULTS["l2_bulk_timeout"], metavar="S",
                   help="longest silence while chunks move to or from L2 (default: %(default)s)")
    g.add_argument("--l2-write-yield", type=float, default=_L2_DEFAULTS["l2_write_yield"], metavar="S",
                   help="longest an L2 writer waits for clients' stores in progress before it writes anyway; "
                        "0: writes run beside them (default: %(default)s)")
    _limit_options(s)
    s.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    s.set_defaults(fn=cmd_serve)

    s = command("plugins", help="list installed transports and store backends, and their health (exit status 1 "
                                "when one is broken)")
    s.add_argument("--json", action="store_true", help="print the list as one JSON object")
    s.set_defaults(fn=cmd_plugins)

    s = command("status", help="show a server's report")
    s.add_argument("--url", default=default_url(), help="the server's address (default: %(default)s)")
    s.add_argument("--json", action="store_true",
                   help="print the report as one JSON object (the server's own figures: its 'sessions' counts "
                        "this command's session too, which the table leaves out)")
    s.add_argument("--timeout", type=float, default=5.0,
                   help="seconds to wait for the server to answer, or for one that is starting to make its socket; "
                        "where no server listens at an ipc:// socket and none is starting, the command says so "
                        "within 1.5 s (default: %(default)s)")
    add_client_curve_arguments(s)
    s.set_defaults(fn=cmd_status)

    s = command("top", help="a live view of a server's figures (q quits)")
    s.add_argument("--url", default=default_url(), help="the server's address (default: %(default)s)")
    s.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default: %(default)s)")
    s.add_argument("--once", action="store_true", help="print one frame and exit (also when stdout is not a terminal)")
    s.add_argument("--timeout", type=float, default=5.0,
                   help="seconds to wait for each answer of the server, or for one that is starting to make its "
                        "socket; where no server listens at an ipc:// socket and none is starting, the command says "
                        "so within 1.5 s (default: %(default)s)")
    add_client_curve_arguments(s)
    s.set_defaults(fn=cmd_top)

    s = command("keys", help="make CURVE keys for tcp:// serving")
    s.add_argument("dir", help="directory to create the keys in (made 0700)")
    s.add_argument("--client", default=None, metavar="NAME",
                   help="add and authorize another client key pair NAME in an existing key directory")
    s.set_defaults(fn=cmd_keys)

    s = command("demo", help="start a server, store and load a real paged KV cache, report, stop")
    s.add_argument("--transport", default="cpu_gather", help="transport to register through (default: %(default)s)")
    s.add_argument("--layers", type=positive_int, default=32, help="layers of the KV cache (default: %(default)s)")
    s.add_argument("--blocks", type=positive_int, default=512,
                   help="blocks of 16 tokens per layer, raised to what the prompts need (default: %(default)s)")
    s.add_argument("--prompts", type=positive_int, default=4, help="prompts stored and loaded (default: %(default)s)")
    s.add_argument("--prompt-tokens", type=positive_int, default=2048,
                   help="tokens per prompt, rounded down to whole chunks (default: %(default)s)")
    s.add_argument("--l1-size", default="2GiB", help="arena of each server the demo starts (default: %(default)s)")
    s.add_argument("--url", default=None, help="use a running server instead of starting one (one host only)")
    add_client_curve_arguments(s)
    s.add_argument("--nodes", type=int, default=1, choices=(1, 2),
                   help="2: two servers (hosts A and B) sharing a private L2 store: store on A, load on B, "
                        "then kill A, start it again and find every chunk in L2")
    s.add_argument("--l2", default=None, help="the L2 store of --nodes 2 (default: valkey)")
    s.set_defaults(fn=cmd_demo)

    s = command("bench", help="transfer benchmark (see benchmarks/transfer.py --help)", add_help=False)
    s.add_argument("bench_args", nargs=argparse.REMAINDER)
    s.set_defaults(fn=cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # its own parser: argparse.REMAINDER drops leading options
        from kvxfer.bench import main as bench_main

        command, run = "bench", functools.partial(bench_main, argv[1:])
    else:
        parser = build_parser()
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # the usage of the subcommand the options follow (kvxfer's for those before it)
            before = argv[:argv.index(args.command)] if args.command in argv else []
            (parser if any(u in before for u in unknown) else args.parser).error(
                f"unrecognized arguments: {' '.join(unknown)}")
        command, run = args.command, functools.partial(args.fn, args)
    try:
        code = int(run() or 0)
        sys.stdout.flush()  # here, so that a closed pipe is caught below rather than at exit
        return code
    except BrokenPipeError:
        # the reader went away (`kvxfer status | head`): stop quietly, as a process killed by SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KvxferError as exc:
        print(f"kvxfer {command}: error: {printable_lines(exc)}", file=sys.stderr)  # it may quote a server
        return 2
    except KeyboardInterrupt:
        return 130


def run() -> NoReturn:
    """The ``kvxfer`` command and ``python -m kvxfer``: :func:`main`, then the process ends.
    Once only the main thread is left, the exit handlers run (logging's flush, the thread pools'
    joins) and the process ends without the interpreter's teardown of every module, torch's
    included: 0.3-0.6 s after a server stopped in 20 ms, on a 2-core VM (a supervisor or a test
    waiting for the exit waited for it). :func:`main` itself returns (for callers in a process
    of their own)."""
    code = main()
    exit_funcs = getattr(atexit, "_run_exitfuncs", None)  # CPython's; elsewhere the usual exit
    if exit_funcs is None or threading.active_count() > 1:  # threads the interpreter would wait for
        sys.exit(code)
    exit_funcs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:  # (as main: a reader gone is not an error)
        pass
    os._exit(code)
