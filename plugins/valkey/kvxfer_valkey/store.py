"""The ``valkey`` store backend: :class:`ValkeyStore` (the plugin) and :class:`ValkeyBackend`.

Who does what:

* the ``valkey`` client (valkey-py with its ``libvalkey`` parser; chosen because it exposes its
  connections, so bulk bytes can bypass its parser, and because it is the project's own Python
  client) owns connection pools, cluster topology (``ValkeyCluster``: which node holds a key's
  slot, read again after a redirect or a failover), AUTH/ACL users and TLS (``valkeys://``);
* this module takes a connection from the pool of the node that holds a key, sends pipelined
  ``STRLEN`` / ``GET`` / ``SET`` commands on it, and moves the values between the socket and the
  caller's buffers (:class:`~kvxfer_valkey.resp.RespReader`: ``recv_into`` the arena slot;
  ``sendall`` of the slot's memoryview). A key whose node answers with a redirect (``MOVED``,
  ``ASK``: its slot moved or is moving) is absent, a miss, not written or not deleted for that
  call, and a thread of the backend reads the slot map again at once; redirects are not
  followed, since the client's own command path reads a reply whole whatever its size.

Every socket operation is bounded (``options.timeout_s`` for lookups, ``bulk_timeout_s`` while
values move), and so is each operation as a whole (``timeout_s``, or ``bulk_timeout_s`` plus the
values' bytes at 16 MiB/s). What the client reads itself (the handshake, PING, COMMAND, CLUSTER
SLOTS) is bounded too: each reply within ``timeout_s`` and 4 MiB, and CLUSTER SLOTS checked
(:mod:`kvxfer_valkey.connection`). A connection that fails mid-reply is disconnected (the pool
makes a new one next time). Errors become
:class:`~kvxfer.errors.StoreUnavailable`; a wrong user or password is a
:class:`~kvxfer.errors.ConfigError` at open.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final, TypeVar

import valkey
from valkey.backoff import NoBackoff
from valkey.cluster import ClusterNode, ValkeyCluster
from valkey.connection import Connection, ConnectionPool, SSLConnection, parse_url
from valkey.crc import key_slot
from valkey.exceptions import (
    AuthenticationError,
    AuthorizationError,
    NoPermissionError,
    ResponseError,
    ValkeyClusterException,
    ValkeyError,
)
from valkey.retry import Retry

from kvxfer import ConfigError
from kvxfer.store import (
    STORE_API_VERSION,
    GetItem,
    GetStatus,
    Probe,
    PutItem,
    Store,
    StoreCapabilities,
    StoreOptions,
    StoreUnavailable,
    ThreadedBackend,
    redact_url,
    split_hosts,
)
from kvxfer_valkey.connection import BoundedConnection, BoundedSSLConnection, raw_socket
from kvxfer_valkey.resp import ErrorReply, RespError, RespReader, pack, pack_bulk_header

__all__ = ["ValkeyStore", "ValkeyBackend", "parse_valkey_urls"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_SCHEMES: Final = ("valkey", "valkeys", "redis", "rediss")
_REDIRECTS: Final = frozenset({"MOVED", "ASK"})
#: STRLEN commands remembered by key for the loop connection (then forgotten all at once).
_STRLEN_KEPT: Final = 1 << 16
#: Bytes read from the loop connection at a time.
_READ: Final = 1 << 14
#: Largest pipeline sent on a loop connection (about 3,000 keys): the kernel takes it whole
#: whatever Valkey is doing; a wider check goes through a store thread, which may block.
_LOOP_SEND_MAX: Final = 1 << 18
#: Shortest time between two readings of a cluster's slot map, and the longest after failures.
_REFRESH_EVERY_S: Final = 0.5
_REFRESH_MAX_S: Final = 8.0
#: Errors of one key (a third party made it a list, say): that key is absent, the store is fine.
_KEY_ERRORS: Final = frozenset({"WRONGTYPE"})
#: Longest unfinished reply line kept from the loop connection (an answer to STRLEN is at most
#: 21 bytes, a redirect about a hundred): a longer one is not Valkey's, and the connection is dropped.
_LOOP_LINE_MAX: Final = 1 << 12
#: The slowest average rate at which values may move (gets and puts), on top of the bulk
#: timeout: a trickling node ends the operation instead of holding a store thread (and the
#: promotions waiting on it) for ever. An L2 read this slow is far slower than recomputing.
_MIN_BYTES_PER_S: Final = 16 << 20
_HINT: Final = "expected valkey://[USER[:PASSWORD]@]HOST:PORT[,HOST2:PORT...] (valkeys:// for TLS)"
#: Every command this backend sends, as ACL rules name them; ``docs/l2.md``'s ACL user is granted
#: exactly these. This module sends STRLEN, GET, SET, DEL, PING, INFO and DBSIZE; valkey-py sends
#: CLIENT SETNAME and CLIENT SETINFO on each new connection (a refused SETINFO is ignored, but
#: logged by Valkey) and, on a cluster, COMMAND when the client starts and CLUSTER SLOTS to read the
#: slot map (redirects are not followed: no ASKING). AUTH needs no grant; a URL naming a database
#: (``/N``) adds SELECT.
CLUSTER_ACL_COMMANDS: Final = ("command", "cluster|slots")
ACL_COMMANDS: Final = ("get", "set", "strlen", "del", "ping", "info", "dbsize", "client|setname", "client|setinfo",
                       *CLUSTER_ACL_COMMANDS)


#: How Valkey refuses the database a connection selects ("DB index is out of range", "SELECT is not
#: allowed in cluster mode").
_DATABASE_REFUSED: Final = re.compile(r"DB index|SELECT", re.IGNORECASE)
#: The query options a URL may give, passed to the client as they are: the user, the database
#: and TLS. The backend sets its own timeouts, retries and client name, and speaks RESP2 on its
#: loop connections (no ``protocol=3``); any other option is refused, rather than failing every
#: connection later as if the store were down.
URL_OPTIONS: Final = frozenset({
    "db", "username", "password", "socket_keepalive", "ssl_keyfile", "ssl_certfile", "ssl_cert_reqs", "ssl_ca_certs",
    "ssl_ca_path", "ssl_ca_data", "ssl_check_hostname", "ssl_password", "ssl_ciphers"})
#: ``ssl_cert_reqs`` values the client takes.
_CERT_REQS: Final = ("none", "optional", "required")


def _acl_names(commands: tuple[str, ...]) -> str:
    return ", ".join(c.replace("|", " ").upper() for c in commands)


def _shown(part: str) -> str:
    """A URL the client cannot read, as an error may show it: not at all when it has user info
    (where its password ends cannot be told then), else redacted."""
    return "the URL given (not shown: it names a user or password)" if "@" in part else repr(redact_url(part))


def parse_valkey_urls(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """``valkey://[user:pass@]h1:p1[,h2:p2...][?ssl_ca_certs=...]`` -> ([(host, port)], connection
    kwargs of the first URL: user, password, TLS options). Raises :class:`ConfigError`."""
    parts = [p.strip() for p in split_hosts(url) if p.strip()]
    if not parts:
        raise ConfigError(f"valkey store: empty URL; {_HINT}")
    if "," in parts[0].partition("://")[2].rpartition("@")[0]:  # not shown: where its password ends is the question
        raise ConfigError("valkey store: the user info of --l2-url holds a comma (the URL is not shown: it names a "
                          "password): write a comma in a password as %2C, and give user info in the first URL "
                          f"only; {_HINT}")
    last, sep, query = parts[-1].partition("?")
    if sep:  # options after the last host apply to every host
        parts = [p.partition("?")[0] for p in parts[:-1]] + [last]
        parts = [f"{p}?{query}" for p in parts]
    hosts = []
    first: dict[str, Any] | None = None
    scheme = parts[0].split("://", 1)[0].lower()
    for i, part in enumerate(parts):
        if "://" not in part:  # h2:p2 after the first URL inherits its scheme and options
            part = f"{scheme}://{part}"
        if part.split("://", 1)[0].lower() not in _SCHEMES:
            raise ConfigError(f"valkey store: {_shown(parts[i])} is not a valkey:// or valkeys:// URL; {_HINT}")
        try:
            kw = parse_url(part)
        except ValueError as exc:  # its text may quote a password cut in the wrong place: not shown then
            why = f": {exc}" if "@" not in part else ""
            raise ConfigError(f"valkey store: {_shown(parts[i])} does not parse{why}; {_HINT}") from None
        if "host" not in kw:
            raise ConfigError(f"valkey store: no host in the URL; {_HINT}")
        unknown = sorted(set(kw) - URL_OPTIONS - {"host", "port", "connection_class"})
        if unknown:
            raise ConfigError(f"valkey store: unknown option(s) {', '.join(map(repr, unknown))} in the URL: it "
                              f"takes {', '.join(sorted(URL_OPTIONS))}; {_HINT}")
        if kw.get("db", 0) < 0:
            raise ConfigError(f"valkey store: the database number must be 0 or more, got {kw['db']}; {_HINT}")
        hosts.append((kw.pop("host"), int(kw.pop("port", 6379))))
        if kw.pop("connection_class", None) is not None:  # valkeys:// (the clients take ssl=True)
            kw["ssl"] = True
        elif any(k.startswith("ssl_") for k in kw):  # a plain connection takes no TLS option
            tls = sorted(k for k in kw if k.startswith("ssl_"))
            raise ConfigError(f"valkey store: TLS option(s) {', '.join(map(repr, tls))} need a valkeys:// URL (TLS); "
                              f"this one is valkey:// (plain TCP); {_HINT}")
        if i == 0:
            first = kw
    assert first is not None
    return hosts, first


def check_tls(kw: dict[str, Any]) -> None:
    """Build the TLS context that each connection of ``kw`` (from :func:`parse_valkey_urls`, a
    ``valkeys://`` URL) will build, as the client builds it: a certificate, key or CA file or
    folder that is missing or unreadable, a key that does not match its certificate or whose
    password is wrong or missing (never asked for on a terminal), hostname checks with nothing
    verified, an unknown ``ssl_cert_reqs`` or cipher list raises :class:`ConfigError` now,
    naming the option (a store that fails every connection for them looked down for ever)."""
    import ssl

    reqs = kw.get("ssl_cert_reqs", "required")
    if reqs not in _CERT_REQS:
        raise ConfigError(f"valkey store: ssl_cert_reqs={str(reqs)[:40]!r} in --l2-url: it takes "
                          f"{', '.join(_CERT_REQS)}")
    capath = kw.get("ssl_ca_path")
    if capath is not None and not os.path.isdir(capath):
        raise ConfigError(f"valkey store: ssl_ca_path={capath!r} in --l2-url is not a folder this process can read")
    context = ssl.create_default_context()
    step = ""
    asked: list[bool] = []

    def no_password() -> bytes:  # (else OpenSSL asks on the terminal, and a server waits there)
        asked.append(True)
        return b""

    try:
        step = "ssl_check_hostname and ssl_cert_reqs"  # set as the client sets them, in its order
        context.check_hostname = bool(kw.get("ssl_check_hostname", False))
        context.verify_mode = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL,
                               "required": ssl.CERT_REQUIRED}[reqs]
        if kw.get("ssl_certfile") or kw.get("ssl_keyfile"):
            step = "ssl_certfile and ssl_keyfile"
            if not kw.get("ssl_certfile"):
                raise ValueError("ssl_keyfile needs ssl_certfile (the client certificate)")
            context.load_cert_chain(certfile=kw["ssl_certfile"], keyfile=kw.get("ssl_keyfile"),
                                    password=kw.get("ssl_password") or no_password)
        if any(kw.get(k) is not None for k in ("ssl_ca_certs", "ssl_ca_path", "ssl_ca_data")):
            step = "ssl_ca_certs, ssl_ca_path or ssl_ca_data"
            context.load_verify_locations(cafile=kw.get("ssl_ca_certs"), capath=capath, cadata=kw.get("ssl_ca_data"))
        if kw.get("ssl_ciphers"):
            step = "ssl_ciphers"
            context.set_ciphers(kw["ssl_ciphers"])
    except (OSError, ssl.SSLError, ValueError, TypeError) as exc:  # (their texts name files, never a password)
        if asked:
            raise ConfigError("valkey store: the key in ssl_keyfile of --l2-url is encrypted: give its password "
                              "as ssl_password") from None
        raise ConfigError(f"valkey store: the TLS options of --l2-url do not load ({step}): "
                          f"{type(exc).__name__}: {exc}") from None


class _LoopConnection:
    """A connection to one node whose existence checks the server's loop sends and reads itself
    (non-blocking socket; checks answered in the order they were sent)."""

    def __init__(self, node: str, conn: Connection) -> None:
        self.node = node
        self.conn = conn
        sock = raw_socket(conn)
        assert sock is not None, "connect() first"
        self.sock: socket.socket = sock
        self.sock.setblocking(False)
        self.fd = self.sock.fileno()
        #: The start of a reply not read whole yet.
        self.buf = b""
        #: (keys asked, done, when sent) per check sent, oldest first, and the sizes of the oldest so far
        self.pending: deque[tuple[int, Callable[[list[int] | None], None], float]] = deque()
        self.got: list[int] = []
        self.broken = False
        #: When a reply last arrived (checks queued behind others wait for those, not for a node
        #: that stopped answering).
        self.last_read = 0.0


class _Gather:
    """One existence check sent to several nodes: each node's sizes land at their keys'
    positions; ``done`` gets the whole list when every node answered, or None at the first
    failure."""

    __slots__ = ("sizes", "left", "done")

    def __init__(self, n: int, parts: int, done: Callable[[list[int] | None], None]) -> None:
        self.sizes = [0] * n
        self.left = parts
        self.done: Callable[[list[int] | None], None] | None = done

    def part(self, positions: list[int], sizes: list[int] | None) -> None:
        done = self.done
        if done is None:
            return
        if sizes is None:
            self.done = None
            done(None)
            return
        if not sizes and positions:  # that node was not asked (see skip)
            self.done = None
            done([])
            return
        out = self.sizes
        for i, size in zip(positions, sizes):
            out[i] = size
        self.left -= 1
        if not self.left:
            self.done = None
            done(out)


class ValkeyBackend(ThreadedBackend):
    """An open Valkey store: a ``valkey.Valkey`` (one node) or a ``ValkeyCluster``.

    Implements :class:`~kvxfer.store.LoopExists` over plain TCP: one extra connection per node
    (each primary of a cluster) on which the server's loop sends ``STRLEN`` pipelines and reads
    their answers itself. A cluster check goes to the nodes that hold its keys' slots, by the
    client's slot map; a key whose slot moved (``MOVED``/``ASK``) counts as absent for that check
    and has the map read again (:meth:`_topology_stale`). Loop connections are (re)made off the
    loop: at open and by any threaded existence check that finds one missing. A node that is no
    longer a primary once the slot map is read again (a failover, a resharding) has its loop
    connection retired: no check is sent on it any more, the loop reads it until the checks sent
    before are answered (or it goes silent), then stops polling it and it is closed. The loop
    connections held are thus those of the primaries of the last map read, and those of earlier
    maps' primaries while checks sent to them are still unanswered (within the lookup timeout)."""

    def __init__(self, client: valkey.Valkey | ValkeyCluster, cluster: bool, options: StoreOptions) -> None:
        super().__init__("valkey", options)
        self.client = client
        self.cluster = cluster
        self.redirects = 0
        #: Set by a redirect or a failure on a cluster: the slot map is read again (_refresh_topology).
        self._stale_topology = threading.Event()
        self._topology_lock = threading.Lock()
        self._refreshing = False
        #: Held while the slot map is read (by the refreshing thread, or a probe).
        self._read_lock = threading.Lock()
        self._last_refresh = 0.0
        #: Readings of the slot map started, and the number of the last one that ended well.
        self._map_reads_started = 0
        self._map_reads_done = 0
        #: Loop connections by node name ("host:port"): those checks are sent on.
        self._loops: dict[str, _LoopConnection] = {}
        #: Loop connections of nodes no longer primaries, read until their checks are answered.
        self._retiring: dict[int, _LoopConnection] = {}
        #: The loop connections the loop polls (``_loops`` and ``_retiring``), and their descriptors.
        self._by_fd: dict[int, _LoopConnection] = {}
        self._fds: tuple[int, ...] = ()
        #: Loop connections no longer polled, closed once the loop has stopped polling them (drop_loop_fd).
        self._old_loops: dict[int, _LoopConnection] = {}
        #: The descriptors loop_fds last gave (loop thread): those the loop polls.
        self._handed: tuple[int, ...] = ()
        self._loop_lock = threading.Lock()
        #: Loop connections to make (off the loop) for the next checks.
        self._want_loops = threading.Event()
        #: Per key: its packed ``STRLEN key`` and its hash slot (loop thread only).
        self._strlen: dict[bytes, tuple[bytes, int]] = {}
        self._new_loop_connections()

    # ------------------------------------------------------------------ LoopExists

    def _targets(self) -> list[tuple[str, ConnectionPool]]:
        """(node name, pool) of every node a loop connection should reach."""
        if not isinstance(self.client, ValkeyCluster):
            return [("node", self._node_pool())]
        out = []
        for node in self.client.get_primaries():
            pool: ConnectionPool = self.client.get_valkey_connection(node).connection_pool
            out.append((node.name, pool))
        return out

    def _target_names(self) -> set[str]:
        """The names of :meth:`_targets` (no connection pool looked up)."""
        if not isinstance(self.client, ValkeyCluster):
            return {"node"}
        return {node.name for node in self.client.get_primaries()}

    def _new_loop_connections(self) -> None:
        """Make the missing loop connections, and retire those of nodes that are no longer
        primaries. Off the loop: connecting may block (for ``timeout_s`` on a node that does
        not answer), and is done without ``_loop_lock``, which the loop takes to drop one."""
        self._want_loops.clear()
        if self._closed:
            return
        with self._loop_lock:
            targets = self._targets()
            self._retire_loops({name for name, _ in targets})
            missing = [(name, pool) for name, pool in targets if name not in self._loops]
        for name, pool in missing:
            if issubclass(pool.connection_class, SSLConnection):
                return  # a non-blocking TLS socket may need to write to read: keep TLS on threads
            conn = pool.make_connection()
            try:
                conn.connect()
            except Exception:  # noqa: BLE001  (no loop connection now: lookups go through threads)
                with contextlib.suppress(Exception):
                    conn.disconnect()
                continue
            lc = _LoopConnection(name, conn)
            with self._loop_lock:  # (another thread may have made one, or retired the node, meanwhile)
                kept = not self._closed and name not in self._loops and name in self._target_names()
                if kept:
                    self._loops[name] = lc
                    self._by_fd[lc.fd] = lc
                    self._fds = tuple(self._by_fd)
            if not kept:
                with contextlib.suppress(Exception):
                    conn.disconnect()

    def _retire_loops(self, names: set[str]) -> None:
        """Send no more checks on the loop connections of nodes not in ``names`` (the primaries
        of the slot map just read): they are polled until their checks are answered, then
        dropped (:meth:`_drop_retired`, on the loop). Any thread, holding ``_loop_lock``."""
        for name in [n for n in self._loops if n not in names]:
            lc = self._loops.pop(name)
            self._retiring[lc.fd] = lc

    def _drop_retired(self) -> None:
        """(loop thread) Stop polling the retired loop connections that have no check left to
        answer, or that went silent with checks unanswered (those fail, as on any silent
        connection); the others are read on until they have."""
        for lc in list(self._retiring.values()):
            if not lc.pending:
                self._unpoll(lc)
            else:
                self._stuck(lc)

    def loop_fds(self) -> tuple[int, ...]:
        for lc in list(self._loops.values()):  # also when no check is sent (lookups "busy"): see LoopExists
            if lc.pending:
                self._stuck(lc)
        if self._retiring:
            self._drop_retired()
        self._handed = fds = self._fds
        return fds

    def exists_nowait(self, keys: Sequence[bytes], done: Callable[[list[int] | None], None]) -> bool:
        # No check that a peer is still there first: the loop polls these connections all the
        # time, so a closed one has already been read (on_readable) and is no longer offered.
        if not keys or self._closed:
            return False
        cmds = self._strlen
        if not self.cluster:
            lc = self._loops.get("node")
            if lc is None or lc.broken or self._stuck(lc):
                self._want_loops.set()
                return False
            try:
                data = b"".join([cmds[k][0] for k in keys])
            except KeyError:
                data = b"".join([self._strlen_of(k)[0] for k in keys])
            if not self._send(lc, data):
                return False
            lc.pending.append((len(keys), done, time.monotonic()))
            return True
        # a cluster: one pipeline per node holding some of the keys
        assert isinstance(self.client, ValkeyCluster)
        slot_node = self.client.nodes_manager.slots_cache
        groups: dict[str, tuple[list[int], list[bytes]]] = {}
        for i, k in enumerate(keys):
            cmd, slot = cmds.get(k) or self._strlen_of(k)
            nodes = slot_node.get(slot)
            if not nodes:
                self._topology_stale()
                return False
            g = groups.get(nodes[0].name)
            if g is None:
                g = groups[nodes[0].name] = ([], [])
            g[0].append(i)
            g[1].append(cmd)
        conns = []
        for name in groups:
            lc = self._loops.get(name)
            if lc is None or lc.broken or self._stuck(lc):
                self._want_loops.set()
                return False
            conns.append(lc)
        pipelines = [b"".join(parts) for _, parts in groups.values()]
        if any(len(data) > _LOOP_SEND_MAX for data in pipelines):
            return False  # a store thread asks (nothing sent)
        gather = _Gather(len(keys), len(groups), done)
        for n, (lc, (positions, _), data) in enumerate(zip(conns, groups.values(), pipelines)):
            if not self._send(lc, data):
                if n == 0:
                    return False  # nothing sent
                # a node whose connection could take nothing now: the check answers no L2 hits
                # (not a store failure); the other nodes' answers are read and ignored
                gather.part(positions, [])
                return True
            lc.pending.append((len(positions), functools.partial(gather.part, positions), time.monotonic()))
        return True

    def _strlen_of(self, key: bytes) -> tuple[bytes, int]:
        if len(self._strlen) > _STRLEN_KEPT:
            self._strlen.clear()
        out = self._strlen[key] = (pack(b"STRLEN", key), key_slot(key))
        return out

    def _stuck(self, lc: _LoopConnection) -> bool:
        """Drop ``lc`` if it went silent for longer than a lookup may wait while a check was
        unanswered (since that check was sent, or since the last reply when it was sent behind
        others): a node that skipped a reply would have the next checks read each other's
        answers, and one that stopped answering would take every lookup's timeout. A node still
        working through earlier checks is not stuck. True if dropped."""
        if not lc.pending or time.monotonic() - max(lc.pending[0][2], lc.last_read) <= self.options.timeout_s:
            return False
        log.debug("valkey: no answer to an existence check on the loop connection to %s within %g s: "
                  "dropping it", lc.node, self.options.timeout_s)
        self._fail_loop(lc)
        return True

    def _send(self, lc: _LoopConnection, data: bytes) -> bool:
        """Send a whole pipeline, or nothing (False: the check goes through a store thread, or
        the connection failed). The rest of a pipeline the socket took only part of is sent
        blocking, for at most the lookup timeout (the node reads while it works: a few ms at
        most), so that no half pipeline is ever left on the stream."""
        if len(data) > _LOOP_SEND_MAX:
            return False
        try:
            sent = lc.sock.send(data)
        except BlockingIOError:  # the socket's buffer is full (a busy node): nothing was sent
            return False
        except OSError:
            sent = -1
        if 0 <= sent < len(data):
            try:
                lc.sock.settimeout(self.options.timeout_s)
                lc.sock.sendall(memoryview(data)[sent:])
                sent = len(data)
            except OSError:
                sent = -1
            finally:
                with contextlib.suppress(OSError):
                    lc.sock.setblocking(False)
        if sent != len(data):  # the stream is no longer usable: a new connection will be made
            self._fail_loop(lc)
            return False
        return True

    def on_readable(self, fd: int) -> None:
        lc = self._by_fd.get(fd)
        if lc is None or lc.broken:
            return
        try:
            data = lc.sock.recv(_READ)  # more than that stays readable: the loop calls again
        except BlockingIOError:
            return
        except OSError:
            self._fail_loop(lc)
            return
        if not data:  # Valkey closed the connection
            self._fail_loop(lc)
            return
        lc.last_read = time.monotonic()
        if lc.buf:
            data = lc.buf + data
        # every reply to STRLEN is ":N\r\n" (or a redirect); what follows the last CRLF is unfinished
        lines = data.split(b"\r\n")
        lc.buf = lines.pop()
        if len(lc.buf) > _LOOP_LINE_MAX:
            log.debug("valkey: a reply line of more than %d bytes on the loop connection to %s",
                      _LOOP_LINE_MAX, lc.node)
            self._fail_loop(lc)
            return
        got = lc.got
        for line in lines:
            if not lc.pending:
                log.debug("valkey: a reply nobody asked for on the loop connection to %s", lc.node)
                self._fail_loop(lc)
                return
            if line[:1] == b":" and 1 < len(line) <= 20 and line[1:].isdigit():  # a size (never negative)
                got.append(int(line[1:]))
            elif self.cluster and line.startswith((b"-MOVED ", b"-ASK ")):  # absent for now
                got.append(0)
                self._moved()
            elif line[:1] == b"-" and line[1:].split(b" ", 1)[0].decode("ascii", "replace") in _KEY_ERRORS:
                got.append(0)  # not a value of ours (another type under the key): absent
            else:  # an error, or anything unexpected: give up this connection
                log.debug("valkey: unexpected reply to STRLEN from %s: %r", lc.node, line[:80])
                self._fail_loop(lc)
                return
            if len(got) == lc.pending[0][0]:
                done = lc.pending.popleft()[1]
                lc.got = []
                done(got)
                got = lc.got

    def _fail_loop(self, lc: _LoopConnection) -> None:
        if lc.broken:
            return
        self._unpoll(lc)
        self._want_loops.set()
        pending = list(lc.pending)
        lc.pending.clear()
        lc.got = []
        for _, done, _ in pending:
            done(None)

    def _unpoll(self, lc: _LoopConnection) -> None:
        """(loop thread) Take ``lc`` out of the connections checks are sent on and the loop
        polls. The loop stops polling it when it next reads :meth:`loop_fds`, and has it closed
        then (:meth:`drop_loop_fd`); one that :meth:`loop_fds` never gave (made by a store thread
        since the loop last read it, and failed at once) is closed now, since the loop would
        never have it closed."""
        lc.broken = True
        with self._loop_lock:
            if self._loops.get(lc.node) is lc:
                del self._loops[lc.node]
            self._retiring.pop(lc.fd, None)
            self._by_fd.pop(lc.fd, None)
            self._fds = tuple(self._by_fd)
            polled = lc.fd in self._handed
            if polled:
                self._old_loops[lc.fd] = lc
        if not polled:
            with contextlib.suppress(Exception):
                lc.conn.disconnect()

    def drop_loop_fd(self, fd: int) -> None:
        lc = self._old_loops.pop(fd, None)
        if lc is not None:
            with contextlib.suppress(Exception):
                lc.conn.disconnect()

    # ------------------------------------------------------------------ connections

    def _node_pool(self) -> ConnectionPool:
        """The pool of a single node's client."""
        assert isinstance(self.client, valkey.Valkey)
        pool: ConnectionPool = self.client.connection_pool
        return pool

    def _pool(self, key: bytes) -> ConnectionPool:
        if not isinstance(self.client, ValkeyCluster):
            return self._node_pool()
        node = self.client.get_node_from_key(key)
        pool: ConnectionPool = self.client.get_valkey_connection(node).connection_pool
        return pool

    def _by_pool(self, keys: Sequence[bytes]) -> list[tuple[ConnectionPool, list[int]]]:
        groups: dict[int, tuple[ConnectionPool, list[int]]] = {}
        for i, k in enumerate(keys):
            pool = self._pool(k)
            groups.setdefault(id(pool), (pool, []))[1].append(i)
        return list(groups.values())

    def _on(self, pool: ConnectionPool, fn: Callable[[Connection, RespReader], T], timeout: float,
            nbytes: int = 0) -> T:
        """:func:`_run_on`; a failure on a cluster has the slot map read again."""
        try:
            return _run_on(pool, fn, timeout, nbytes)
        except BaseException:
            if self.cluster:
                self._topology_stale()
            raise

    # ------------------------------------------------------------------ operations

    def exists(self, keys: Sequence[bytes]) -> list[int]:
        if self._want_loops.is_set():
            self._new_loop_connections()  # for the next lookups
        out = [0] * len(keys)
        for pool, idx in self._by_pool(keys):
            def run(conn: Connection, r: RespReader, idx: list[int] = idx) -> None:
                conn.send_packed_command([b"".join(pack(b"STRLEN", keys[i]) for i in idx)], check_health=False)
                for i in idx:
                    try:
                        out[i] = int(r.reply_simple() or 0)
                    except ErrorReply as err:
                        if err.kind in _KEY_ERRORS:
                            continue  # not a value of ours: absent
                        self._redirected(err, "STRLEN")  # absent for now
            self._on(pool, run, self.options.timeout_s)
        return out

    def get(self, items: Sequence[GetItem]) -> list[GetStatus]:
        keys = [k for k, _ in items]
        out = [GetStatus.MISS] * len(items)
        for pool, idx in self._by_pool(keys):
            def run(conn: Connection, r: RespReader, idx: list[int] = idx) -> None:
                conn.send_packed_command([b"".join(pack(b"GET", keys[i]) for i in idx)], check_health=False)
                for i in idx:
                    parts = items[i][1]
                    try:
                        n = r.bulk_into(parts)
                    except ErrorReply as err:
                        if err.kind not in _KEY_ERRORS:  # another type under the key: not a value of ours
                            self._redirected(err, "GET")
                        continue  # a miss
                    if n is None:
                        out[i] = GetStatus.MISS
                    else:
                        out[i] = GetStatus.HIT if n == sum(len(p) for p in parts) else GetStatus.WRONG_SIZE
            self._on(pool, run, self.options.bulk_timeout_s, sum(len(p) for i in idx for p in items[i][1]))
        return out

    def put(self, items: Sequence[PutItem]) -> list[bool]:
        """SET each value. On a cluster, values whose node answered ``MOVED`` (their slot moved:
        a failover, a resharding) are sent once more, to the node the slot map names once it has
        been read again (waited for at most ``timeout_s`` and one reading's interval); a second
        redirect leaves them not written. Without that, the first writes to every slot a failover
        moved were lost."""
        out = [False] * len(items)
        moved, after = self._put(items, range(len(items)), out)
        if moved and self._map_read_after(after, self.options.timeout_s + _REFRESH_EVERY_S):
            self._put(items, moved, out)
        return out

    def _put(self, items: Sequence[PutItem], which: Sequence[int], out: list[bool]) -> tuple[list[int], int]:
        """SET ``items[i]`` for ``i`` in ``which`` (``out[i]``: written); returns those answered
        ``MOVED``, and the number of the slot map readings started when the last was read (a
        reading that starts after it knows of the move)."""
        keys = [items[i][0] for i in which]
        moved: list[int] = []
        after = 0
        for pool, at in self._by_pool(keys):
            idx = [which[j] for j in at]

            def run(conn: Connection, r: RespReader, idx: list[int] = idx) -> None:
                sock = r.sock
                for i in idx:
                    key, parts = items[i]
                    size = sum(len(p) for p in parts)
                    # a socket's timeout bounds a whole sendall: as long as the value takes at the slowest rate
                    sock.settimeout(self.options.bulk_timeout_s + size / _MIN_BYTES_PER_S)
                    conn.send_packed_command([pack_bulk_header(b"SET", key, size), *parts, b"\r\n"],
                                             check_health=False)
                sock.settimeout(self.options.bulk_timeout_s)
                for i in idx:
                    try:
                        out[i] = r.reply_simple() == b"OK"
                    except ErrorReply as err:
                        if err.kind != "OOM":  # OOM: full and not allowed to evict: refused
                            if err.kind == "MOVED":  # (ASK: the slot is moving; the map says where once it has)
                                nonlocal after
                                after = self._map_reads_started
                                moved.append(i)
                            self._redirected(err, "SET")  # not written
            self._on(pool, run, self.options.bulk_timeout_s, sum(len(p) for i in idx for p in items[i][1]))
        return moved, after

    def _map_read_after(self, started: int, timeout: float) -> bool:
        """Wait (at most ``timeout``) until a reading of the slot map that started after reading
        number ``started`` has ended well (the thread a redirect starts reads it at most twice a
        second); whether one has."""
        deadline = time.monotonic() + timeout
        while self._map_reads_done <= started:
            if self._closed or time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def delete(self, keys: Sequence[bytes]) -> int:
        n = 0
        for pool, idx in self._by_pool(keys):
            def run(conn: Connection, r: RespReader, idx: list[int] = idx) -> int:
                conn.send_packed_command([b"".join(pack(b"DEL", keys[i]) for i in idx)], check_health=False)
                deleted = 0
                for _ in idx:  # one DEL per key: a cluster node refuses one naming keys of two slots
                    try:
                        deleted += _count(r.reply_simple())
                    except ErrorReply as err:
                        self._redirected(err, "DEL")  # left for now
                return deleted
            n += self._on(pool, run, self.options.timeout_s)
        return n

    def _redirected(self, err: ErrorReply, command: str) -> None:
        """A key's reply was an error: on a cluster, a redirect (the key's slot moved, or is
        moving) has the slot map read again (:meth:`_moved`) and leaves the key as it is for this
        call (absent, a miss, not written, not deleted); anything else fails the call.
        Redirects are not followed: the client's own command path reads a reply whole, whatever
        its size, and may connect wherever the node points."""
        if not (self.cluster and err.kind in _REDIRECTS):
            raise StoreUnavailable(f"valkey: {command} failed: {err.text}")
        self._moved()

    def _moved(self) -> None:
        """A key's slot moved (a redirect, on a store thread or on the loop): counted, and the
        slot map read again."""
        self.redirects += 1
        self._topology_stale()

    def _topology_stale(self) -> None:
        """The slot map may be out of date (a redirect, or a failure on a cluster): read it again
        soon, on a thread of its own (any thread may call this, the server's loop included)."""
        self._stale_topology.set()
        if not self.cluster or self._closed:
            return
        with self._topology_lock:
            if self._refreshing:
                return
            self._refreshing = True
        try:
            threading.Thread(target=self._refresh_topology, name="kvxfer-valkey-slots", daemon=True).start()
        except RuntimeError:  # no thread can be started (the interpreter is ending): the next call tries again
            with self._topology_lock:
                self._refreshing = False

    def _refresh_topology(self) -> None:
        """Read the slot map again while it is stale: at most once per :data:`_REFRESH_EVERY_S`
        (a node that answers every command with a redirect must not make this a busy loop), and
        after a failure (the nodes away) twice as long each time, up to :data:`_REFRESH_MAX_S`;
        then have the loop connections of new primaries made."""
        every = _REFRESH_EVERY_S
        try:
            while self._stale_topology.is_set() and not self._closed:
                wait = self._last_refresh + every - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                self._last_refresh = time.monotonic()
                try:
                    self._read_slot_map()
                except Exception as exc:  # noqa: BLE001  (the nodes may be away: the breaker sees that; try again)
                    log.debug("valkey: reading the slot map failed (%s)", type(exc).__name__)
                    every = min(2 * every, _REFRESH_MAX_S)
                    continue
                every = _REFRESH_EVERY_S
        finally:
            with self._topology_lock:
                self._refreshing = False
        if self._stale_topology.is_set() and not self._closed:  # marked stale as this thread ended
            self._topology_stale()

    def _read_slot_map(self) -> None:
        """Read a cluster's slot map (clears the stale mark first: a redirect meanwhile marks it
        again), then retire the loop connections of nodes that are no longer primaries and have
        those of new primaries made. Raises what the client raises (the mark is then set again)."""
        assert isinstance(self.client, ValkeyCluster)
        self._stale_topology.clear()
        try:
            with self._read_lock:
                self._map_reads_started += 1
                number = self._map_reads_started
                self.client.nodes_manager.initialize()
                self._map_reads_done = number
        except BaseException:
            self._stale_topology.set()
            raise
        with self._loop_lock:
            self._retire_loops(self._target_names())
        self._want_loops.set()

    def ping(self) -> None:
        """A single node: PING. A cluster: the slot map read again, then PING to
        every primary, each through the backend's own bounded reader (the client's own PING
        goes to one node only, and on a connection error drops that node from the nodes it
        starts from: a cluster of one node could then never read its map again). A primary that
        fails marks the map stale, so that a replica promoted in its place is found. An error
        reply (``LOADING``: a node reading its data after a restart) fails the probe."""
        try:
            if not isinstance(self.client, ValkeyCluster):
                self._on(self._node_pool(), _ping, self.options.timeout_s)
                return
            self._read_slot_map()  # probes run while the store is down: a failover may have ended since the last
            for node in self.client.get_primaries():  # a failure marks the map stale: read again, with backoff
                self._on(self.client.get_valkey_connection(node).connection_pool, _ping, self.options.timeout_s)
        except (ValkeyError, ValkeyClusterException, OSError, RespError, ErrorReply) as exc:
            raise StoreUnavailable(f"valkey: {type(exc).__name__}: {exc}") from None

    def stats(self) -> dict[str, str]:
        """Each node's INFO memory, INFO stats and DBSIZE, read through :func:`_node_figures`
        (bounded in size and time: the health thread that asks also probes the store)."""
        try:
            timeout = self.options.timeout_s
            if isinstance(self.client, ValkeyCluster):
                nodes = [self._on(self.client.get_valkey_connection(node).connection_pool, _node_figures, timeout)
                         for node in self.client.get_primaries()]
                used = sum(_count(f.get("used_memory")) for f in nodes)
                limits = [_count(f.get("maxmemory")) for f in nodes]
                limited = sum(1 for x in limits if x)
                return {"nodes": str(len(nodes)), "keys": str(sum(_count(f.get("keys")) for f in nodes)),
                        "used": _human(used),
                        "maxmemory": ("none" if not limited else _human(sum(limits)) if limited == len(nodes)
                                      else f"{_human(sum(limits))} on {limited} of {len(nodes)} nodes"),
                        "policy": ",".join(sorted({f.get("maxmemory_policy", "?")[:32] for f in nodes}))[:100],
                        "evicted": str(sum(_count(f.get("evicted_keys")) for f in nodes)),
                        "redirects": str(self.redirects)}
            f = self._on(self._node_pool(), _node_figures, timeout)
            maxmemory = _count(f.get("maxmemory"))
            return {"keys": str(_count(f.get("keys"))), "used": _human(_count(f.get("used_memory"))),
                    "maxmemory": _human(maxmemory) if maxmemory else "none",
                    "policy": f.get("maxmemory_policy", "?")[:32], "evicted": str(_count(f.get("evicted_keys")))}
        except (ValkeyError, OSError, RespError, ErrorReply) as exc:
            raise StoreUnavailable(f"valkey: {type(exc).__name__}: {exc}") from None

    def close_connections(self) -> None:
        with self._loop_lock:
            loops = list(self._old_loops.values()) + list(self._by_fd.values())
            self._loops.clear()
            self._retiring.clear()
            self._by_fd.clear()
            self._fds = ()
        for lc in loops:
            with contextlib.suppress(Exception):
                lc.conn.disconnect()
        _close_client(self.client)
        if isinstance(self.client, ValkeyCluster):
            # the cluster client's close() leaves each node's pool connected (its nodes' clients
            # were given their pools): a socket per node left open at every open and close
            for node in list(self.client.get_nodes()):
                with contextlib.suppress(Exception):
                    if node.valkey_connection is not None:
                        node.valkey_connection.connection_pool.disconnect()


def _run_on(pool: ConnectionPool, fn: Callable[[Connection, RespReader], T], timeout: float, nbytes: int = 0) -> T:
    """Run ``fn`` on an idle connection of ``pool``, each socket operation bounded by
    ``timeout``, and the replies read by ``timeout`` plus ``nbytes`` (the values moved) at
    :data:`_MIN_BYTES_PER_S`; a failure drops the connection."""
    deadline = time.monotonic() + timeout + nbytes / _MIN_BYTES_PER_S
    conn = pool.get_connection("GET")
    try:
        sock = raw_socket(conn)  # the bulk path: see the module docstring
        if sock is None:
            raise ConnectionError("the pool gave a connection with no socket")
        sock.settimeout(timeout)
        reader = RespReader(sock, deadline)
        out = fn(conn, reader)
        if reader.buffered:
            raise ConnectionError(f"{reader.buffered} unexpected bytes after the replies")
        if sock.gettimeout() != timeout:  # lowered near the deadline: the pool's next user expects it
            sock.settimeout(timeout)
        return out
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def _count(value: object) -> int:
    """A non-negative count from a node's reply (anything else: 0)."""
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    try:
        return max(0, int(value))  # type: ignore[call-overload]  # checked by the except
    except (TypeError, ValueError):
        return 0


def _node_figures(conn: Connection, r: RespReader) -> dict[str, str]:
    """``INFO memory``, ``INFO stats`` (fields as text) and ``DBSIZE`` (as ``keys``) of one node,
    pipelined (run by :func:`_run_on`: every reply at most 64 KiB, all within its timeout, so that
    a node that trickles or inflates them can neither hold the caller nor fill the server's memory)."""
    conn.send_packed_command([pack(b"INFO", b"memory") + pack(b"INFO", b"stats") + pack(b"DBSIZE")],
                             check_health=False)
    out: dict[str, str] = {}
    for _ in range(2):
        text = r.reply_simple()
        if not isinstance(text, bytes):
            raise StoreUnavailable(f"valkey: INFO answered {text!r}")
        for line in text.decode("utf-8", "replace").splitlines():
            name, sep, value = line.partition(":")
            if sep and len(out) < 512:
                out[name.strip()] = value.strip()
    out["keys"] = str(_count(r.reply_simple()))
    return out


def _cluster_enabled(conn: Connection, r: RespReader) -> bool:
    """Whether the node is in cluster mode (``INFO cluster``; run by :func:`_run_on`, as
    :func:`_node_figures`)."""
    conn.send_packed_command([pack(b"INFO", b"cluster")], check_health=False)
    try:
        text = r.reply_simple()
    except ErrorReply as err:
        if err.kind == "NOPERM":  # an ACL user not granted INFO: the credentials' error, as valkey-py's
            raise NoPermissionError(err.text) from None
        raise StoreUnavailable(f"valkey: INFO cluster failed: {err.text}") from None
    if not isinstance(text, bytes):
        raise StoreUnavailable(f"valkey: INFO cluster answered {text!r}")
    return any(line.strip() == b"cluster_enabled:1" for line in text.splitlines())


def _connection_kwargs(kw: dict[str, Any]) -> dict[str, Any]:
    """The connection arguments of ``kw`` (:func:`parse_valkey_urls`' options, timeouts) with the
    backend's connection class (:mod:`kvxfer_valkey.connection`), TLS for ``ssl``."""
    out = dict(kw)
    out["connection_class"] = BoundedSSLConnection if out.pop("ssl", False) else BoundedConnection
    return out


def _node_client(host: str, port: int, kw: dict[str, Any]) -> valkey.Valkey:
    """A client of one node whose connections are the backend's."""
    return valkey.Valkey(connection_pool=ConnectionPool(host=host, port=port, **_connection_kwargs(kw)))


def _close_client(client: valkey.Valkey | ValkeyCluster) -> None:
    """Close ``client`` and its sockets now: a node client's ``close()`` leaves the pool it was
    given connected (a socket open for as long as the backend object lives)."""
    with contextlib.suppress(Exception):
        client.close()
    if not isinstance(client, ValkeyCluster):
        with contextlib.suppress(Exception):
            client.connection_pool.disconnect()


def _plain_url(host: str, port: int) -> str:
    return f"valkey://[{host}]:{port}" if ":" in host else f"valkey://{host}:{port}"


def _sync(value: Any) -> Any:
    """A reply of the synchronous client (its commands are typed for the async one too)."""
    return value


def _ping(conn: Connection, r: RespReader) -> None:
    conn.send_packed_command([pack(b"PING")], check_health=False)
    if r.reply_simple() != b"PONG":
        raise StoreUnavailable("valkey: PING did not answer PONG")


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError


def _refused(where: str, exc: Exception) -> ConfigError:
    """The error of credentials Valkey refused (a configuration error: retrying cannot help)."""
    return ConfigError(f"valkey at {where} refused kvxfer's credentials: check the user and password in "
                       f"--l2-url (or $KVXFER_L2_PASSWORD) and that the ACL user may run "
                       f"{_acl_names(ACL_COMMANDS[:-len(CLUSTER_ACL_COMMANDS)])} (and on a cluster "
                       f"{_acl_names(CLUSTER_ACL_COMMANDS)}) on keys ~kvxfer:* (docs/l2.md). The node said: {exc}")


class ValkeyStore(Store):
    """The ``valkey`` store backend (entry point ``kvxfer.stores: valkey``)."""

    name = "valkey"
    api_version = STORE_API_VERSION
    capabilities = StoreCapabilities(shared=True, persistent=True, max_value_bytes=512 << 20)
    url_schemes = _SCHEMES

    def probe(self) -> Probe:
        from valkey.utils import LIBVALKEY_AVAILABLE

        parser = "libvalkey parser" if LIBVALKEY_AVAILABLE else "pure-Python parser (pip install 'valkey[libvalkey]')"
        return Probe(True, f"valkey-py {valkey.__version__}, {parser}; single node or cluster")

    def open(self, url: str, options: StoreOptions) -> ValkeyBackend:
        hosts, kw = parse_valkey_urls(url)
        if kw.get("ssl"):
            check_tls(kw)
        # the pools' socket timeout bounds what the client reads itself (a new connection's
        # handshake, PING, CLUSTER SLOTS): timeout_s, as pings and lookups are; the backend sets
        # its own timeouts while values move (bulk_timeout_s), on the socket underneath
        kw.update(socket_timeout=options.timeout_s, socket_connect_timeout=options.timeout_s,
                  retry=Retry(NoBackoff(), 0), client_name="kvxfer")
        where = ", ".join(f"{h}:{p}" for h, p in hosts)
        cluster = None
        errors = []
        for host, port in hosts:
            probe = _node_client(host, port, {**kw, "socket_timeout": options.timeout_s})
            try:
                try:
                    cluster = _run_on(probe.connection_pool, _cluster_enabled, options.timeout_s)
                except (OSError, RespError) as exc:
                    raise StoreUnavailable(f"valkey: INFO cluster: {type(exc).__name__}: {exc}") from None
                if cluster:  # the cluster client turns a refused CLUSTER SLOTS into "not a cluster"
                    _sync(probe.execute_command("CLUSTER", "SLOTS"))
                break
            except (AuthenticationError, AuthorizationError, NoPermissionError) as exc:
                raise _refused(f"{host}:{port}", exc) from None
            except ResponseError as exc:
                if not _DATABASE_REFUSED.search(str(exc)):
                    errors.append(f"{host}:{port}: {type(exc).__name__}: {exc}")
                    continue
                # the connection's SELECT of the URL's database refused: a URL to fix, not an outage
                raise ConfigError(f"valkey: {host}:{port} refused the database of --l2-url: {exc} (a node has "
                                  "0-15 unless configured otherwise, a cluster only 0)") from None
            except (ValkeyError, StoreUnavailable) as exc:
                errors.append(f"{host}:{port}: {type(exc).__name__}: {exc}")
            finally:
                _close_client(probe)
        if cluster is None:
            # a plain-text port met with TLS looks like a node that does not answer: its handshake times out
            timed_out = kw.get("ssl") and any("Timeout" in e for e in errors)
            tls = (" (if that port serves plain text: a valkeys:// URL speaks TLS, whose handshake a plain-text "
                   "node never completes; use valkey:// for it)") if timed_out else ""
            raise StoreUnavailable(f"no Valkey node answered at {where}: {'; '.join(errors)}{tls}")
        if cluster:
            kw.pop("db", None)
            try:  # the cluster client asks every node for its commands and slots at once
                # (a URL, not a host, so that its nodes' pools make the backend's connections)
                client: valkey.Valkey | ValkeyCluster = ValkeyCluster(
                    url=_plain_url(*hosts[0]), startup_nodes=[ClusterNode(h, p) for h, p in hosts[1:]],
                    cluster_error_retry_attempts=1, require_full_coverage=False, **_connection_kwargs(kw))
            except (AuthenticationError, AuthorizationError, NoPermissionError) as exc:
                raise _refused(where, exc) from None
            except (ValkeyError, ValkeyClusterException, OSError) as exc:  # its nodes went away since the probe
                raise StoreUnavailable(f"no Valkey cluster node answered at {where}: {type(exc).__name__}: {exc}") \
                    from None
        else:
            if len(hosts) > 1:
                raise ConfigError(f"--l2-url lists {len(hosts)} hosts but {hosts[0][0]}:{hosts[0][1]} is not in "
                                  "cluster mode; give one URL for a single node")
            client = _node_client(hosts[0][0], hosts[0][1], kw)
        return ValkeyBackend(client, cluster, options)

    @contextlib.contextmanager
    def local_instance(self, directory: Path) -> Iterator[str]:
        import secrets

        from kvxfer_valkey.local import ValkeyServer

        # with a password: any local user reaches 127.0.0.1
        server = ValkeyServer(Path(directory) / "valkey", password=secrets.token_urlsafe(24)).start()
        try:
            yield server.private_url
        finally:
            server.stop()


