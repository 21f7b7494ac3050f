"""The kit's fixtures: which transport and device, the gate that skips what cannot run here,
the shared server, and the per-test :class:`~kvxfer.testing.harness.Kit`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import pytest
import torch

from kvxfer.errors import TransportBroken, TransportNotFound
from kvxfer.testing.harness import CHUNK_SIZE, REFERENCE, Kit
from kvxfer.testing.plugin import not_here
from kvxfer.testing.server import ServerProcess
from kvxfer.transport import registry
from kvxfer.transport.contract import Transport

__all__ = ["KitBase", "device_missing", "server_for"]

#: Seconds of silence after which the kit's server drops a client (the dead-client test waits
#: for this). Heartbeats go every third of it.
SESSION_TIMEOUT_S = 3.0
#: The kit server's arena: small, so that the eviction test fills it quickly.
ARENA_SIZE = "16MiB"


_SERVERS = pytest.StashKey[dict[str, ServerProcess]]()


def server_for(config: pytest.Config, transport: str) -> ServerProcess:
    """The session's kit server for ``transport`` (started on first use, stopped at the end)."""
    pool = config.stash.get(_SERVERS, None)
    if pool is None:
        pool = config.stash[_SERVERS] = {}

        def stop_all() -> None:
            for server in pool.values():
                server.__exit__(None, None, None)

        config.add_cleanup(stop_all)
    server = pool.get(transport)
    if server is not None and server.proc is not None and server.proc.poll() is None:
        return server
    if server is not None:
        server.__exit__(None, None, None)
    names = ",".join(dict.fromkeys((transport, REFERENCE)))
    server = ServerProcess(l1_size=ARENA_SIZE, chunk_size=CHUNK_SIZE, transports=names,
                           extra_args=["--session-timeout", str(SESSION_TIMEOUT_S)])
    pool[transport] = server.start()
    return server


def device_missing(device: str) -> str | None:
    """Why torch device type ``device`` cannot be used here, or None if it can."""
    kind = torch.device(device).type
    if kind == "cpu":
        return None
    mod = getattr(torch, kind, None)
    available = getattr(mod, "is_available", None)
    if available is None:
        return f"torch has no '{kind}' backend here (is its torch extension installed and imported?)"
    try:
        ok = bool(available())
    except Exception as exc:  # noqa: BLE001  (a backend that cannot even answer is missing)
        return f"torch.{kind}.is_available() raised {type(exc).__name__}: {exc}"
    return None if ok else f"no {kind} device here (torch.{kind}.is_available() is False)"


class KitBase:
    """Configuration and fixtures shared by every part of the kit."""

    #: Entry-point name of the transport under test; None takes ``--kvxfer-transport``.
    transport: ClassVar[str | None] = None
    #: torch device type of the test KV tensors; None takes ``--kvxfer-device`` (default cpu).
    device: ClassVar[str | None] = None

    @pytest.fixture(scope="class")
    @classmethod
    def kit_transport(cls, request: pytest.FixtureRequest) -> Transport:
        """The transport under test, loaded; skips (or fails) with the reason when it cannot run."""
        name = getattr(request.cls, "transport", None) or request.config.getoption("kvxfer_transport", None)
        if not name:  # a usage error: skipping every test would pass the kit
            pytest.fail("conformance kit: no transport under test: set `transport = \"NAME\"` on the class or "
                        "pass --kvxfer-transport=NAME", pytrace=False)
        try:
            transport = registry.get_transport(name, require_available=False)
        except (TransportNotFound, TransportBroken) as exc:
            pytest.fail(f"conformance kit: {exc}", pytrace=False)
        try:
            registry.get_transport(REFERENCE, require_available=True)
        except Exception as exc:  # noqa: BLE001  (the reference missing in any way fails the kit)
            # exc says how to install it when it is not installed (TransportNotFound)
            pytest.fail(f"conformance kit: the reference transport {REFERENCE!r} is needed: {exc}", pytrace=False)
        probe, faulty = registry.run_probe(transport)
        if faulty:  # a probe that raises, or returns something else, breaks the contract: say so once
            pytest.fail(f"conformance kit: transport {name!r}: {probe.reason}; a probe never raises and returns a "
                        "Probe: Probe(False, reason) where the transport cannot run", pytrace=False)
        if not probe.available:
            not_here(request.config, f"transport {name!r} cannot run here: {probe.reason}")
        device = cls.kit_device_name(request)
        why = device_missing(device)
        if why:
            not_here(request.config, f"transport {name!r} on {device}: {why}")
        refusal = transport.refusal(torch.device(device))
        if refusal is not None:
            chosen = ("`device` on the test class" if getattr(request.cls, "device", None)
                      else "--kvxfer-device")
            pytest.fail(f"conformance kit: transport {name!r} does not serve device {device!r} here: {refusal}; "
                        f"fix that, or {chosen}", pytrace=False)
        return transport

    @staticmethod
    def kit_device_name(request: pytest.FixtureRequest) -> str:
        return (getattr(request.cls, "device", None)
                or request.config.getoption("kvxfer_device", None) or "cpu")

    @pytest.fixture(scope="class")
    @classmethod
    def kit_server(cls, request: pytest.FixtureRequest, kit_transport: Transport) -> ServerProcess:
        """A real server loading the transport under test and the reference; one per transport
        per pytest session (classes of one transport share it; tests use their own model names)."""
        return server_for(request.config, kit_transport.name)

    @pytest.fixture
    def kit(self, request: pytest.FixtureRequest, kit_transport: Transport,
            kit_server: ServerProcess) -> Iterator[Kit]:
        """Helpers for one test; closes what the test registered."""
        k = Kit(kit_server.url, kit_transport, self.kit_device_name(request), request.node.name)
        try:
            yield k
        finally:
            k.close()

