"""Server hooks: pluggy hookspecs (project ``kvxfer``, entry point group ``kvxfer.hooks``).

Hook plugins decorate their implementations with :data:`kvxfer.hookimpl` (this module's
:data:`hookimpl`).

Hook plugins observe and extend the server without subclassing it. Every hook is called with
keyword arguments only, on the server's loop thread, so an implementation must be quick. An
implementation that raises is logged and counted (``hook_errors`` in status), and the other
implementations and the server carry on.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Final

import pluggy

if TYPE_CHECKING:
    from kvxfer.protocol.messages import MetricSample
    from kvxfer.server.context import RegisteredContext
    from kvxfer.server.engine import CacheServer
    from kvxfer.server.index import ChunkKey

__all__ = ["ENTRY_POINT_GROUP", "PROJECT", "HookRelay", "KvxferHookSpec", "hookimpl", "hookspec"]

log = logging.getLogger(__name__)

PROJECT: Final = "kvxfer"
ENTRY_POINT_GROUP: Final = "kvxfer.hooks"

hookspec = pluggy.HookspecMarker(PROJECT)
#: Decorate hook implementations with this.
hookimpl = pluggy.HookimplMarker(PROJECT)


class KvxferHookSpec:
    """The server's hooks."""

    @hookspec
    def kvxfer_server_started(self, server: CacheServer) -> None:
        """The server is bound and about to serve."""

    @hookspec
    def kvxfer_server_stopped(self, server: CacheServer) -> None:
        """The server stopped serving; the arena is about to be released."""

    @hookspec
    def kvxfer_context_registered(self, server: CacheServer, context: RegisteredContext) -> None:
        """An engine instance registered a KV cache (``context.registration``: what it sent,
        decoded and checked; the server may refuse a registration after its transport's ``open()``,
        and then calls no hook for it)."""

    @hookspec
    def kvxfer_context_unregistered(self, server: CacheServer, context: RegisteredContext, reason: str) -> None:
        """A registration ended: ``reason`` is ``"unregister"``, ``"session lost"`` or ``"shutdown"``."""

    @hookspec
    def kvxfer_chunks_stored(self, server: CacheServer, context: RegisteredContext, keys: list[ChunkKey]) -> None:
        """Chunks became readable."""

    @hookspec
    def kvxfer_chunks_retrieved(self, server: CacheServer, context: RegisteredContext, keys: list[ChunkKey]) -> None:
        """Chunks were read by an instance."""

    @hookspec
    def kvxfer_chunks_evicted(self, server: CacheServer, keys: list[ChunkKey]) -> None:
        """Chunks were evicted to make room: once per request that evicted any, with all of them."""

    @hookspec
    def kvxfer_status_section(self, server: CacheServer) -> tuple[str, dict[str, str]] | None:
        """A section of the status report: ``(title, {key: value})``, or None."""

    # Metrics. A loaded transport's server half (its ServerTransport object) is registered as a
    # hook plugin too, so a transport implements these on it with ``@hookimpl`` methods.

    @hookspec
    def kvxfer_transfer_finished(
        self, server: CacheServer, context: RegisteredContext, op: str, chunks: int, nbytes: int,
        seconds: float, copy_seconds: float,
    ) -> None:
        """A store or retrieve was committed: ``op`` is ``"store"`` or ``"retrieve"``; ``chunks``
        and ``nbytes`` were written (store) or read (retrieve); ``seconds`` went from the
        reservation to the commit; ``copy_seconds`` is the copy's share (measured by the client
        for client-driven transports, 0.0 when it sent none)."""

    @hookspec
    def kvxfer_metrics(self, server: CacheServer) -> list[MetricSample] | None:
        """Figures to export, read at each scrape and status request: a list of
        :class:`kvxfer.transport.MetricSample` (names ``kvxfer_<plugin>_...``, counters ending
        ``_total``, few label values). Invalid samples are dropped and counted as hook errors."""


class HookRelay:
    """Calls each hook implementation separately, so that one that raises hurts nobody."""

    def __init__(self, load_entry_points: bool = True) -> None:
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(KvxferHookSpec)
        self.errors = 0
        if load_entry_points:
            try:
                self.pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
            except Exception:  # a broken hook plugin must not keep the server from starting
                self.errors += 1
                log.exception("failed to load hook plugins from %s", ENTRY_POINT_GROUP)

    def register(self, plugin: object, name: str) -> None:
        """Register ``plugin`` under ``name`` (its metrics are named after it: ``kvxfer_<name>_...``)."""
        self.pm.register(plugin, name)

    def implementers(self, hook: str) -> list[str]:
        """The names of the plugins that implement ``hook``."""
        return [impl.plugin_name for impl in getattr(self.pm.hook, hook).get_hookimpls()]

    def call(self, hook: str, **kwargs: Any) -> list[Any]:
        """What each implementation of ``hook`` returned (None left out); one that raises is
        logged and counted in :attr:`errors`."""
        return [res for _, res in self.call_by_plugin(hook, **kwargs)]

    def call_by_plugin(self, hook: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """:meth:`call`, each result with the name of the plugin that returned it."""
        results = []
        caller = getattr(self.pm.hook, hook)
        for impl in caller.get_hookimpls():
            try:
                res = impl.function(*[kwargs[a] for a in impl.argnames])
            except Exception:
                self.errors += 1
                log.exception("hook %s of plugin %r raised; ignoring it", hook, impl.plugin_name)
                continue
            if res is not None:
                results.append((impl.plugin_name, res))
        return results
