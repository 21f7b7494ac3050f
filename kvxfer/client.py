"""CacheClient: what connectors, benchmarks and users call.

::

    client = CacheClient("ipc:///tmp/kvxfer.sock")          # connects and handshakes
    kv = client.register(kv_caches, model_name="m", world_size=1, rank=0, block_size=16)
    hashes = chunk_hashes(token_ids, chunk_size=client.chunk_size)
    kv.submit_store(hashes, block_ids).result(timeout=30)
    n = client.lookup("m", world_size=1, hashes=hashes)
    kv.submit_retrieve(hashes[:n], block_ids[: n * blocks_per_chunk]).result(timeout=30)

A client is one connection (one session) and is thread-safe. When the server restarts, the
next request on a registered context re-handshakes and re-registers it transparently once;
requests in flight at the time fail with :class:`kvxfer.errors.ConnectionFailed`. The client's
own requests (``lookup``, ``lookup_and_lease``, ``status``, ...) raise
:class:`kvxfer.errors.NoSession` instead, once the server has lost the session (it restarted, or
this process was stopped for longer than the server's session timeout): call :meth:`reconnect`
(it opens a new session and registers the client's contexts again) and ask again, after
checking whatever depends on the server's settings (its ``chunk_size`` may have changed).
"""

from __future__ import annotations

import collections
import contextlib
import difflib
import logging
import math
import os
import stat
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

from kvxfer import liveness
from kvxfer.errors import (
    ConfigError,
    ConnectionFailed,
    InvalidRequest,
    KvxferError,
    NoSession,
    RequestTimeout,
    TransportNotFound,
    TransportUnavailable,
)
from kvxfer.mq.claim import claim_path, socket_claimed
from kvxfer.mq.client import CurveClientKeys, MQClient, ipc_server_ready, knock
from kvxfer.protocol import messages as m
from kvxfer.urls import URL_ENV, check_url, default_url, ipc_path

if TYPE_CHECKING:  # loaded by register(): a client that only looks up or reports needs no torch
    import torch

    from kvxfer.layout import KVLayout, LayoutKind
    from kvxfer.transport.contract import TransferContext, TransferContextBase, Transport

Reply = TypeVar("Reply", bound=m.Message)

__all__ = ["CacheClient", "MAX_TIMEOUT_S", "no_server_starting"]

log = logging.getLogger(__name__)

#: Longest timeout a client takes (a year; a request's wait is counted in milliseconds).
MAX_TIMEOUT_S: Final = 365 * 86400.0
#: Longest close() waits for the server to acknowledge the end of the session.
_GOODBYE_S = 1.0


def _drop(mq: MQClient, held: list[liveness.ProcessLock | None]) -> None:
    """Close a client's connection, then release its liveness lock (close(), or the client
    collected unclosed: its server then ends the session as for any connection that ends). In a
    forked child, neither: both are the parent's (removing the lock file would tell the server
    that the parent is gone)."""
    forked = mq.forked
    mq.close()
    if forked:
        return
    lock = held[0]
    if lock is not None:
        lock.release()


def _serve_command(url: str) -> str:
    return f"kvxfer serve --url {url}" + (" --curve-dir DIR" if url.startswith("tcp://") else "")


#: Said where nothing is at the address at all: the address itself may be the mistake.
_OR_ITS_ADDRESS: Final = ("or, if one runs elsewhere, give its address (--url or $KVXFER_URL; the vLLM "
                          "connector's kvxfer.url)")


def _socket_missing(url: str) -> str:
    """Why ``url``'s socket is not there, as far as its directory tells (and, for the default
    address, where that address comes from)."""
    missing = _socket_missing_at(url)
    if url != default_url() or os.environ.get(URL_ENV):
        return missing
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return (f"{missing} (the default address, whose directory follows $XDG_RUNTIME_DIR, "
            f"{'set to ' + xdg if xdg else 'not set'} here: a server started with another environment, under "
            "sudo, by a systemd unit or in a container, listens elsewhere)")


def _socket_missing_at(url: str) -> str:
    path = ipc_path(url)
    assert path is not None
    try:
        if not path.parent.exists():
            return f"neither {path} nor its directory exists"
    except OSError as exc:  # a directory this user may not enter, a name too long, ...
        return f"{path.parent} cannot be looked at ({exc.strerror or exc})"
    others = _sockets_in(path.parent)
    if not others:
        return f"{path} does not exist"
    named = sorted(others, key=lambda n: -difflib.SequenceMatcher(None, n, path.name).ratio())[:3]
    more = f" and {len(others) - len(named)} more" if len(others) > len(named) else ""
    return f"{path} does not exist, but {path.parent} holds {', '.join(named)}{more} (a misspelt name?)"


def _sockets_in(directory: Path, most: int = 100_000) -> list[str]:
    """Names of the Unix sockets among the first ``most`` entries of ``directory`` (for a
    message; errors: none)."""
    found: list[str] = []
    try:
        with os.scandir(directory) as entries:
            for _, entry in zip(range(most), entries):
                try:
                    if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                        found.append(entry.name)
                except OSError:
                    continue
    except OSError:
        return []
    return sorted(found)


def no_server_starting(url: str, wait_s: float = 0.0) -> str | None:
    """Why no server can answer at ``ipc://`` ``url`` now or soon: its socket is not there and
    no server holds its claim (:mod:`kvxfer.mq.claim`, taken before a server makes its arena),
    for ``wait_s`` seconds (a server launched a moment ago claims the socket within about half a
    second of starting); None as soon as either is there, and for other schemes. For commands a
    person runs, which can say so at once: :class:`CacheClient` waits ``connect_timeout`` for a
    server that may not have started yet. Raises ConfigError where the socket's directory or
    the socket cannot be trusted (:func:`~kvxfer.mq.client.ipc_server_ready`)."""
    if not 0 <= wait_s < math.inf:  # NaN fails too
        raise ConfigError(f"wait_s must be a number of seconds >= 0, got {wait_s!r}")
    if ipc_path(url) is None:
        return None
    deadline = time.monotonic() + wait_s
    # a socket directory that cannot be trusted is refused first (ConfigError), as by a client
    while not (ipc_server_ready(url) or socket_claimed(url)):
        if time.monotonic() >= deadline:
            return (f"no kvxfer server is listening at {url}, and none is starting: {_socket_missing(url)}; start "
                    f"one with `{_serve_command(url)}`, {_OR_ITS_ADDRESS}")
        time.sleep(0.02)
    return None


class CacheClient:
    """A connection to a kvxfer cache server.

    Raises :class:`kvxfer.errors.ConnectionFailed` when no server answers within
    ``connect_timeout`` and :class:`kvxfer.errors.VersionMismatch` when protocols differ.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        timeout: float = 30.0,
        connect_timeout: float = 10.0,
        name: str = "",
        curve: CurveClientKeys | None = None,
    ) -> None:
        self.url = check_url(url or default_url())
        for what, seconds in (("timeout", timeout), ("connect_timeout", connect_timeout)):
            if not 0 < seconds <= MAX_TIMEOUT_S:  # NaN fails too
                raise ConfigError(f"{what} must be a positive number of seconds of at most {MAX_TIMEOUT_S:g}, "
                                  f"got {seconds!r}")
        if curve is None and self.url.startswith("tcp://"):  # a server never serves tcp:// without CURVE
            raise ConfigError(f"{self.url} is a tcp:// server: it answers only clients with an authorized CURVE key. "
                              "Pass curve=kvxfer.security.load_client_keys(DIR) (CLI: --curve-dir DIR; vLLM "
                              "connector: kvxfer.curve_dir), with the "
                              "server's public key and a client key pair listed in its authorized/ folder; nothing "
                              "was sent")
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.name = name
        self._lock = threading.RLock()
        self._contexts: weakref.WeakSet[TransferContextBase] = weakref.WeakSet()
        #: Instance ids of contexts collected without close(), unregistered at the next
        #: register(): a context's finalizer only appends its id here (it may run inside any
        #: allocation, the connection's own under its lock included: it takes no lock, does no I/O)
        self.dropped: collections.deque[int] = collections.deque()
        late = weakref.WeakMethod(self._release_late)  # the connection's thread must not keep this client alive

        def on_late_reply(name: str, request: Any, reply: Any) -> None:
            release = late()
            if release is not None:
                release(name, request, reply)

        self._mq = MQClient(self.url, default_timeout=timeout, curve=curve, on_late_reply=on_late_reply,
                            late_names=frozenset({"reserve_write", "reserve_read", "lookup", "store", "retrieve"}))
        #: The liveness lock held now (one item: the handshake replaces it), for :attr:`_finalizer`.
        self._held: list[liveness.ProcessLock | None] = [None]
        #: A client dropped without close() closes its connection (and with it its I/O thread,
        #: its heartbeats and so its session) and its lock file when it is collected.
        self._finalizer = weakref.finalize(self, _drop, self._mq, self._held)
        self._finalizer.atexit = False
        self._epoch = 0
        #: The last handshake failed (see _handshake).
        self._unopened = False
        #: The server-issued secret of our session (presented to resume it) and lock token.
        self._secret = b""
        self._token = ""
        try:
            self._handshake()
        except BaseException:
            self._mq.close()
            raise

    # ------------------------------------------------------------------ session

    def _handshake(self) -> None:
        """Open a session. :attr:`epoch` is odd while this runs (a request sent meanwhile may reach
        the old session or the new one) and a new even number after it, whether it succeeded or not."""
        self._epoch += 1 + self._epoch % 2
        opened = False
        try:
            self._open_session()
            opened = True
        finally:
            # one that failed here (timed out, say) may have opened a session at the server all the
            # same, whose fields this client never learned: reconnect() opens one again, unasked
            self._unopened = not opened
            self._epoch += 1  # after the fields the handshake sets: whoever reads this epoch reads them

    def _open_session(self) -> None:
        deadline = time.monotonic() + self.connect_timeout
        while not ipc_server_ready(self.url):  # checked before anything is sent
            if time.monotonic() > deadline:
                raise ConnectionFailed(self._no_socket())
            time.sleep(0.02)
        while True:
            try:
                reply = self._mq.request(m.Handshake(m.PROTOCOL_VERSION, self.name, os.getpid(), self._secret),
                                         timeout=max(0.1, deadline - time.monotonic()))
                break
            except ConnectionFailed as exc:
                if (not isinstance(exc, RequestTimeout) and time.monotonic() < deadline
                        and socket_claimed(self.url)):
                    # the socket file of a server that died, where a new one is starting: it
                    # replaces the file once its arena is made
                    time.sleep(0.05)
                    continue
                # a timed-out handshake says no more than this message; anything else is added
                raise ConnectionFailed(self._no_answer("" if isinstance(exc, RequestTimeout) else f" ({exc})")) \
                    from None
        self.server_version = reply.server_version
        self.chunk_size = reply.chunk_size
        self.server_transports = list(reply.transports)
        self.arena_path = reply.arena_path
        self.arena_size = reply.arena_size
        self.max_message_size = reply.max_message_size
        self.session_timeout = reply.session_timeout_s
        self.max_lease_s = reply.max_lease_s
        self.max_name_length = reply.max_name_length
        self.features = frozenset(reply.features)
        self._secret = reply.session_secret
        self._token = reply.client_token
        self._hold_liveness_lock()
        self._mq.enable_heartbeat(reply.heartbeat_s, max(2.0 * reply.session_timeout_s, 5.0))

    def _release_late(self, name: str, request: Any, reply: Any) -> None:
        """A reservation or lease the server granted after its request had timed out here (the
        server stalled): nobody will fill or read its slots, nor retrieve what it leased, so
        release it now rather than leave it held for the rest of the session or the lease (a
        write's slots are dropped, a read's unpinned, a lease released). A server-driven store
        or retrieve answered late is over at the server: its context frees its params now."""
        if name in ("store", "retrieve"):  # its context may now free what the request held
            for ctx in list(self._contexts):
                late = getattr(ctx, "_late_answer", None)
                if late is not None and ctx.instance_id == request.instance_id:
                    late(request)
            return
        if reply is None:  # refused: nothing was granted
            return
        release: m.Request[Any]
        if name == "lookup":
            if not reply.lease_id:
                return
            release = m.ReleaseLease(reply.lease_id)
        elif name == "reserve_write":
            release = m.CommitWrite(request.instance_id, reply.reservation_id, [s.index for s in reply.slots],
                                    abandoned=True)
        else:
            release = m.CommitRead(request.instance_id, reply.reservation_id, loaded=False)
        what = f"lease of {request.model_name!r}" if name == "lookup" else f"{name} of instance {request.instance_id}"
        try:
            self._mq.request(release)
        except (KvxferError, ConnectionError) as exc:  # the session or the server is gone: so is what it held
            log.debug("releasing a %s granted after its request timed out failed: %s", what, exc)
            return
        log.info("released a %s that the server granted after its request had timed out", what)

    def _no_socket(self) -> str:
        """Why nobody answered at an ``ipc://`` url whose socket never appeared."""
        if socket_claimed(self.url):
            return (f"a kvxfer server is starting at {self.url} (it holds {self._claim_path()}) but made no socket "
                    f"within {self.connect_timeout:g} s: it makes its socket once its arena is allocated and "
                    "pre-faulted (seconds per GiB on some hosts); wait for its 'kvxfer server ready' line and try "
                    "again, or allow longer (kvxfer status --timeout S, CacheClient(connect_timeout=S))")
        return (f"no kvxfer server is listening at {self.url}: {_socket_missing(self.url)} (waited "
                f"{self.connect_timeout:g} s); start one with `{_serve_command(self.url)}`, {_OR_ITS_ADDRESS}")

    def _claim_path(self) -> Path:
        path = ipc_path(self.url)
        assert path is not None
        return claim_path(path)

    def _no_answer(self, cause: str) -> str:
        """Why the handshake got no reply, as far as one plain connection attempt can tell: a
        process listens but did not answer (a server still starting, a busy one, or, over
        tcp://, one that refuses our CURVE key), or nothing listens (a socket file left by a
        server that is gone, a closed port)."""
        knocked = knock(self.url, min(1.0, self.connect_timeout))
        if knocked == "accepted":
            starting = ("a `kvxfer serve` that is still starting (it answers once its 'kvxfer server ready' line is "
                        "printed) or one too busy to answer; wait and try again, or allow longer (kvxfer status "
                        "--timeout S, CacheClient(connect_timeout=S))")
            if self.url.startswith("tcp://"):  # a client here has keys: the likeliest cause is that they are refused
                # (ZeroMQ drops a CURVE handshake it refuses without a word)
                starting = ("most likely the server refused this client's keys: a tcp:// server only answers clients "
                            "with an authorized CURVE key and drops a refused handshake without a word (its log "
                            "names a client key it refused; a wrong server key leaves no trace there); check that "
                            "the client's public key is in the server's authorized/ folder and that the server key "
                            "given (kvxfer.security.load_client_keys(DIR), CLI: --curve-dir DIR) is that server's. "
                            "Otherwise: " + starting)
            return (f"a process listens at {self.url} but did not answer kvxfer's handshake within "
                    f"{self.connect_timeout:g} s{cause}: {starting}")
        if knocked == "refused" and socket_claimed(self.url):
            return (f"a kvxfer server is starting at {self.url} (it holds {self._claim_path()}) and has not replaced "
                    f"the socket file left there by a server that did not stop cleanly within "
                    f"{self.connect_timeout:g} s: it does so once its arena is allocated and pre-faulted (seconds "
                    "per GiB on some hosts); wait for its 'kvxfer server ready' line and try again, or allow "
                    "longer (kvxfer status --timeout S, CacheClient(connect_timeout=S))")
        if knocked == "refused" and self.url.startswith("ipc://"):
            return (f"no kvxfer server is listening at {self.url}: its socket file is left from a server that "
                    f"did not stop cleanly (nothing accepts connections on it); start one with "
                    f"`{_serve_command(self.url)}` (it replaces the file)")
        if self.url.startswith("inproc://"):
            return (f"no kvxfer server is reachable at {self.url}: an inproc:// server (CacheServer in a process) "
                    f"answers only clients of its own process; give a server's ipc:// or tcp:// address{cause}")
        what = "connection refused" if knocked == "refused" else knocked
        return (f"no kvxfer server is listening at {self.url} ({what}){cause}; start one with "
                f"`{_serve_command(self.url)}`")

    @property
    def _liveness(self) -> liveness.ProcessLock | None:
        """The liveness lock held now (kept where the finalizer finds it)."""
        return self._held[0]

    @_liveness.setter
    def _liveness(self, lock: liveness.ProcessLock | None) -> None:
        self._held[0] = lock

    def _hold_liveness_lock(self) -> None:
        """Hold the lock that tells the server this process lives (:mod:`kvxfer.liveness`), in
        the directory of the arena of the server we now talk to."""
        if not self.arena_path or not liveness.valid_token(self._token):
            if self._liveness is not None:
                self._liveness.release()
                self._liveness = None
            return
        want = liveness.lock_path(self.arena_path, self._token)
        if self._liveness is not None:
            if self._liveness.path == want and want.exists():
                return
            self._liveness.release()  # the server restarted: its directory is another one
        self._liveness = liveness.ProcessLock.hold(self.arena_path, self._token)

    @property
    def epoch(self) -> int:
        """Changes with each handshake: odd while one is under way, a new even number once it is
        done. A context registered in an older epoch must register again; a reply to a request
        sent in an odd epoch, or in another even one, may come from either session."""
        return self._epoch

    def reconnect(self, context: TransferContextBase | None = None) -> None:
        """Re-open the session if the server lost it (it restarted, or timed us out), then
        register again every context of an older epoch, and ``context`` in any case.

        Contexts call this when a request fails with ``NoSession`` or ``UnknownInstance``;
        concurrent callers are serialized and nothing is registered twice.
        """
        with self._lock:
            try:
                if self._unopened:
                    raise NoSession("the last handshake failed")
                self._mq.request(m.Ping(), timeout=self.connect_timeout)
            except NoSession:
                self._handshake()
                log.info("kvxfer: the server at %s had lost this client's session (it restarted, or timed the "
                         "client out): opened a new one", self.url)
            targets = [c for c in self._contexts if c.epoch != self._epoch]
            if context is not None and context not in targets:
                targets.append(context)
            for ctx in targets:
                try:
                    ctx.on_reconnect()
                except InvalidRequest as exc:
                    if m.ALREADY_REGISTERED not in str(exc):
                        raise
                    ctx.epoch = self._epoch  # registered in this session (while it was being opened)

    def forget(self, context: TransferContextBase) -> None:
        """A context closed: stop re-registering it."""
        self._contexts.discard(context)

    def _unregister_dropped(self) -> None:
        """Unregister the contexts collected without ``close()`` (:attr:`dropped`), without
        waiting for the answers (a server that lost them answers an error, ignored)."""
        while self.dropped:
            try:
                instance_id = self.dropped.popleft()
            except IndexError:  # another thread took the last one
                return
            with contextlib.suppress(KvxferError, ConnectionError):
                self._mq.submit(m.Unregister(instance_id))

    # ------------------------------------------------------------------ Connection protocol

    def submit(self, payload: m.Request[Reply], timeout: float | None = None) -> Future[Reply]:
        """Send ``payload`` (its type names the request and its reply type); the future resolves
        to the reply or raises a :class:`kvxfer.errors.KvxferError`."""
        return self._mq.submit(payload, timeout)

    def request(self, payload: m.Request[Reply], timeout: float | None = None) -> Reply:
        """``submit(payload, timeout).result()``, without the hand-off to a future."""
        return self._mq.request(payload, timeout)

    # ------------------------------------------------------------------ API

    def register(
        self,
        kv_caches: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
        *,
        model_name: str,
        block_size: int,
        world_size: int = 1,
        rank: int = 0,
        transport: str = "auto",
        layout: LayoutKind | str | None = None,
    ) -> TransferContext:
        """Register one paged KV cache (one tensor per layer) and return its context.

        ``transport`` is a transport name or ``"auto"`` (the best available for the tensors'
        device among those the server loaded). ``layout`` settles an ambiguous shape.
        """
        if not model_name:
            raise ConfigError("model_name must not be empty")
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ConfigError(f"rank must be in [0, world_size) with world_size > 0; got rank {rank}, "
                              f"world_size {world_size}")
        from kvxfer.layout import KVLayout, as_layer_list
        from kvxfer.transport._context import plugin_step
        from kvxfer.transport.contract import InstanceIdentity

        layers = as_layer_list(kv_caches)
        kv_layout = KVLayout.infer(layers, block_size, layout)
        # a server restarted since this client's last request: open the session again first (the
        # checks below use its chunk size and transports, the context maps its arena; the
        # client's other contexts register again)
        self.reconnect()
        kv_layout.blocks_per_chunk(self.chunk_size)
        chosen = self._pick_transport(transport, layers[0].device, kv_layout, layers)
        identity = InstanceIdentity.fresh(model_name, world_size, rank)
        self._unregister_dropped()
        with plugin_step(chosen.name, "client_context"):
            ctx = chosen.client_context(self, layers, kv_layout, identity)
        try:
            ctx.check_core_names()
            ctx.register()
        except BaseException:
            ctx.close()
            raise
        self._contexts.add(ctx)
        return ctx

    def _pick_transport(self, name: str, device: torch.device, layout: KVLayout,
                        layers: list[torch.Tensor]) -> Transport:
        from kvxfer.transport import registry

        if name != registry.AUTO and name not in self.server_transports:
            # unknown name -> lists installed; cannot run here -> the probe's reason
            registry.get_transport(name)
            raise TransportUnavailable(
                f"the server at {self.url} did not load transport {name!r}; it has "
                f"{', '.join(self.server_transports)}. Add {name} to the server's --transports, keeping its other "
                f"options and the transports other engines use: `kvxfer serve --url {self.url} --transports "
                f"{','.join([*self.server_transports, name])} ...`"
            )
        try:
            return registry.select(name, device, among=self.server_transports, kv=(layout, layers))
        except TransportNotFound as exc:
            raise TransportUnavailable(f"no transport loaded by the server at {self.url} fits: {exc}") from None

    def lookup(self, model_name: str, world_size: int = 1, *, hashes: Sequence[bytes], promote: bool = False) -> int:
        """How many leading chunks of ``hashes`` the server has for every rank, in its arena or
        in its L2 tier. With ``promote``, the server starts loading the L2 ones into its arena,
        so that a retrieve that follows finds them (it waits for those still on their way)."""
        return self.request(m.Lookup(model_name, world_size, list(hashes), 0.0, promote)).hits

    def lookup_and_lease(
        self, model_name: str, world_size: int = 1, *, hashes: Sequence[bytes], lease_s: float = 30.0,
        promote: bool = True, prefetch: bool = False,
    ) -> m.LookupReply:
        """Like :meth:`lookup`, and keep the hits from eviction for ``lease_s`` seconds or until
        each rank's retrieve naming ``lease_id`` is done. Hits found in the L2 tier are promoted
        into the arena under the lease (``reply.l2_hits`` says how many), unless ``promote`` is
        False (then the lease covers the leading hits already in the arena, up to the first that
        only L2 holds). With ``prefetch`` the
        server may start moving the leased chunks toward the engine that will retrieve them
        (:attr:`kvxfer.protocol.messages.Lookup.prefetch`), so that its retrieve ends sooner."""
        if lease_s <= 0:
            raise ConfigError(f"lease_s must be positive, got {lease_s}")
        return self.request(m.Lookup(model_name, world_size, list(hashes), lease_s, promote, prefetch))

    def release_lease(self, lease_id: int) -> None:
        from kvxfer.copies import check_lease_id

        self.request(m.ReleaseLease(check_lease_id(lease_id)))

    def status(self) -> m.StatusReply:
        return self.request(m.StatusRequest())

    def clear(self, model_name: str = "") -> int:
        """Drop stored chunks not in use (of ``model_name`` only, when given); returns how many."""
        return self.request(m.Clear(model_name)).removed

    def ping(self) -> float:
        """The server's clock; raises when it does not answer."""
        return self.request(m.Ping()).server_time

    def close(self) -> None:
        """Close every context registered through this client, end the session (so the server
        frees what it held at once, not after its session timeout), then the connection."""
        for ctx in list(self._contexts):
            ctx.close()
        try:
            if ipc_server_ready(self.url):  # (a stopped server's ipc socket is gone: nobody to tell)
                self.request(m.Goodbye(), timeout=min(_GOODBYE_S, float(self.timeout or _GOODBYE_S)))
        except (KvxferError, ConnectionError, TimeoutError):
            pass  # gone already, or a server without goodbye: its session times out instead
        self._finalizer()  # the connection, then the lock file

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
