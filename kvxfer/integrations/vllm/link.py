"""The connection of one connector side to the kvxfer server, and the server-error policy.

``kvxfer.on_server_error``:

* ``"fail"`` (default): a server that is missing at start-up, or that stops answering, raises
  :class:`kvxfer.errors.ConnectionFailed` with a message that names the server and the fix.
* ``"recompute"``: the connector carries on without the cache (lookups miss, loads report
  their blocks as failed so vLLM recomputes them, stores are dropped) and a background thread
  tries to reach the server again every ``kvxfer.retry_s`` seconds, from the moment it was
  found gone until it answers, whether or not requests come meanwhile: a server started while
  vLLM idles is in use from the next request on, without restarting vLLM. Only the request that
  finds the server gone waits (up to ``kvxfer.timeout_s``); later steps do not wait for it.

A server that restarted answers ``NoSession``: :meth:`kvxfer.CacheClient.reconnect`
re-handshakes and re-registers the KV caches, so that case needs no degraded period at all.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Final

from kvxfer.client import CacheClient
from kvxfer.errors import (
    ConfigError,
    ConnectionFailed,
    InvalidRequest,
    KvxferError,
    LimitExceeded,
    TransportError,
)
from kvxfer.integrations.vllm.config import ConnectorConfig
from kvxfer.protocol import messages as m
from kvxfer.transport import registry

__all__ = ["REFUSED", "ServerLink", "check_transport_name"]

log = logging.getLogger("kvxfer.integrations.vllm")

#: Seconds between two ERROR lines of the same reason from the background attempts.
UNUSABLE_REPEAT_S: Final = 60
#: What a live server answers about one request it will not serve (a limit reached, a request it
#: refuses): that request fails, and the server is not down. Its own or its transport's failure
#: (``internal``) is a server error: ``kvxfer.on_server_error`` decides.
REFUSED: Final = (LimitExceeded, InvalidRequest)


def check_transport_name(name: str) -> None:
    """Raise :class:`kvxfer.TransportNotFound` (listing the installed transports) for a name
    that no installed plugin provides; ``"auto"`` always passes."""
    if name != registry.AUTO:
        registry.get_transport(name, require_available=False)


class ServerLink:
    """A lazily (re)connected :class:`CacheClient` with the configured error policy.

    ``on_connect(client)`` runs after every (re)connection; it may raise
    :class:`kvxfer.errors.ConfigError` (e.g. a chunk size mismatch), which is fatal at
    start-up and, later, handled like a server error.
    """

    def __init__(self, config: ConnectorConfig, side: str, on_connect: Callable[[CacheClient], None]) -> None:
        self.config = config
        self.side = side
        self._on_connect = on_connect
        self.client: CacheClient | None = None
        self.down = False
        self._retry_at = 0.0
        self._lock = threading.Lock()
        #: Held while connecting: a start-up call and the background thread never connect at once.
        self._connect_lock = threading.Lock()
        self._attempt: threading.Thread | None = None
        self._closing = threading.Event()
        self._recovered = False
        #: How many times the server was found unreachable (tests and logs read it).
        self.outages = 0
        #: The last reason logged at ERROR by the background attempts, and when it may be again.
        self._unusable = ""
        self._unusable_at = 0.0

    def get(self, *, startup: bool = False) -> CacheClient | None:
        """The client; None while the server is unreachable in ``recompute`` mode (``fail``
        mode raises instead).

        At start-up the connection is made here (and fails here). Later, a lost server is
        looked for by a background thread every ``kvxfer.retry_s`` seconds until it answers (see
        :meth:`_mark_down`), so the engine's step never waits for a server that is not there."""
        if self.client is not None and not self.down:
            return self.client
        with self._lock:
            if self._recovered:  # the background thread connected
                self._recovered = False
                self.down = False
                self._unusable, self._unusable_at = "", 0.0  # a later outage says its reason again
                log.info("kvxfer %s: the server at %s answers again; using the cache", self.side, self.config.url)
                return self.client
            if not startup:
                self._start_attempts()  # (running already, unless the link was never marked down)
                return None
        try:
            with self._connect_lock:
                if not self._recovered:  # (unless the background thread connected meanwhile)
                    self._connect()
        except (ConfigError, TransportError):
            raise
        except KvxferError as exc:
            self.failed(exc, "connecting")
            return None
        with self._lock:  # a background thread still looking stops at its next attempt
            self._recovered = False
            self.down = False
        return self.client

    def _connect(self) -> None:
        """Connect (first time) or re-open the session and re-register (server restarted)."""
        if self.client is None:
            curve = None
            if self.config.curve_dir:
                from kvxfer.security import load_client_keys

                curve = load_client_keys(Path(self.config.curve_dir), self.config.curve_name)
            client = CacheClient(self.config.url, timeout=self.config.timeout_s,
                                 connect_timeout=self.config.timeout_s, name=f"vllm-{self.side}", curve=curve)
            try:
                self._on_connect(client)
            except BaseException:
                client.close()
                raise
            self.client = client
        else:
            self.client.reconnect()
            self._on_connect(self.client)

    def reconnect(self) -> None:
        """The server lost this side's session (it restarted): open a new one, register again,
        and run ``on_connect``, whose checks (the chunk size) hold for a restarted server too.
        Raises what those raise."""
        with self._connect_lock:
            self._connect()

    def _start_attempts(self) -> None:
        """Start the thread that looks for the server (under ``_lock``), unless it runs or the
        link is closing."""
        if self._attempt is None and not self._closing.is_set():
            self._attempt = threading.Thread(target=self._background_connect, daemon=True,
                                             name=f"kvxfer-reconnect-{self.side}")
            self._attempt.start()

    def _background_connect(self) -> None:
        """Try to connect at ``_retry_at``, then every ``retry_s``, until it works (the next
        :meth:`get` then takes the client) or the link closes."""
        while not self._closing.wait(max(0.0, self._retry_at - time.monotonic())):
            try:
                with self._connect_lock:
                    if self._closing.is_set() or not self.down:
                        break  # closing, or a start-up call connected meanwhile
                    self._connect()
            except Exception as exc:  # noqa: BLE001  (anything: stay degraded, try again later)
                self._log_unusable(exc)
                self._retry_at = time.monotonic() + self.config.retry_s
                continue
            with self._lock:
                self._recovered = True
                self._attempt = None
            return
        with self._lock:
            self._attempt = None
            if self.down:  # lost again while this thread was stopping: look on
                self._start_attempts()

    def _log_unusable(self, exc: Exception) -> None:
        """A failed attempt: a server that answers but cannot be used (a configuration or
        transport error) is an ERROR when its reason is new, and again at most every
        :data:`UNUSABLE_REPEAT_S`; a server that does not answer is a DEBUG line (the WARNING that
        started the outage said so)."""
        text = str(exc)
        now = time.monotonic()
        if isinstance(exc, (ConfigError, TransportError)) and (text != self._unusable or now >= self._unusable_at):
            self._unusable, self._unusable_at = text, now + UNUSABLE_REPEAT_S
            log.error("kvxfer %s: the server at %s is still unusable: %s (said again every %d s while it lasts)",
                      self.side, self.config.url, text, UNUSABLE_REPEAT_S)
        else:
            log.debug("kvxfer %s: the server at %s is still unusable: %s", self.side, self.config.url, text)

    def failed(self, exc: BaseException, what: str) -> None:
        """``what`` failed because of the server: raise (``fail``) or go degraded (``recompute``).
        In ``fail`` mode a configuration error (a server restarted with another chunk size, say)
        is raised as it is: it is no outage, and ``recompute`` would not serve from that server."""
        if self.config.on_server_error == "fail":
            if isinstance(exc, (ConfigError, TransportError)):
                raise exc
            url = self.config.url
            # the client's own errors name the server and what to run; others get it said here
            check = "" if url in str(exc) else (f" Check the kvxfer server at {url} (`kvxfer status --url {url}`; "
                                                f"start one with `kvxfer serve --url {url}`).")
            raise ConnectionFailed(
                f"kvxfer {self.side}: {what} failed: {exc}.{check} To serve without the cache while it is down, "
                f"set kv_connector_extra_config {{\"kvxfer.on_server_error\": \"recompute\"}}"
            ) from exc
        if not self.down:
            log.warning("kvxfer %s: %s failed (%s); serving without the cache, retrying every %g s",
                        self.side, what, exc, self.config.retry_s)
        self._mark_down()
        return

    def release_lease(self, lease_id: int) -> None:
        """Give back a lease, sent without waiting for the answer: a server that does not answer
        costs the caller (the scheduler's step, the worker's) nothing, and the lease then ends at
        its time (``kvxfer.lease_s``)."""
        client = self.client
        if not lease_id or client is None:  # (a link marked down may still reach the server)
            return

        def answered(fut: Future[Any]) -> None:
            if fut.exception() is not None:
                log.debug("releasing lease %d failed: %s", lease_id, fut.exception())

        try:
            client.submit(m.ReleaseLease(lease_id)).add_done_callback(answered)
        except (KvxferError, ConnectionError) as exc:  # closed: it ends on its own
            log.debug("releasing lease %d failed: %s", lease_id, exc)

    def _mark_down(self) -> None:
        with self._lock:
            if not self.down:
                self.outages += 1
            self.down = True
            self._recovered = False
            self._retry_at = time.monotonic() + self.config.retry_s
            self._start_attempts()  # from now on, whether or not the engine's steps ask

    def close(self) -> None:
        self._closing.set()
        with self._lock:
            attempt = self._attempt
        if attempt is not None:
            attempt.join(self.config.timeout_s + 2)
        with self._connect_lock:  # an attempt still connecting ends first (its requests have timeouts)
            if self.client is not None:
                self.client.close()
                self.client = None
