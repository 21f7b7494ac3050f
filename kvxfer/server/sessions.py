"""Sessions: who is at the other end of a connection, proven rather than claimed, and what it holds.

A session is opened by a handshake and is bound to three things a client cannot forge:

* the routing id of its connection: on ``ipc://`` one the server assigns to each connection it
  accepts, never reused (:mod:`kvxfer.mq.listener`); on ``tcp://`` the DEALER's ZeroMQ routing
  id (the ROUTER refuses a second connection that claims a routing id in use);
* the peer as the connection itself tells it (:class:`Peer`): on ``ipc://`` the kernel's
  ``SO_PEERCRED`` of the connecting process (uid, gid, pid), read when the connection is
  accepted, as ``PATH:UID:GID:PID``; on ``tcp://`` the CURVE public key the connection
  authenticated with (the ``User-Id`` property set by the ZAP handler). A request whose peer is
  not the session's is answered ``no_session``: another connection that took the routing id
  of one that went away gets nothing of its session;
* a secret the server issues at the handshake (``HandshakeReply.session_secret``). It is the
  only way back to what a session left behind: a client whose session timed out while its
  process was frozen presents it in its next handshake (``Handshake.resume``), from the same
  peer, to reclaim its parked writes (:class:`Parked`).

Reservation and lease ids are random (kvxfer.server.index); reservations are looked up among the
session's own (:class:`kvxfer.server.index.Usage`), so an id is useless on another connection.
The liveness token that names the client's lock file (:mod:`kvxfer.liveness`) is issued by
the server too.

Everything here is owned by the server's loop thread.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from kvxfer.server.index import Reservation, Usage

__all__ = ["Peer", "Session", "Parked"]

_IPC_PEER = re.compile(r".*:(\d+):(\d+):(\d+)")


@dataclass(frozen=True, slots=True)
class Peer:
    """The other end of a connection, as read from the connection (see the module docstring)."""

    #: ``PATH:UID:GID:PID`` on ``ipc://``; ``tcp:`` and ZeroMQ's ``Peer-Address`` and, on CURVE
    #: connections, ``|User-Id`` on ``tcp://``: compared as is.
    raw: str
    uid: int | None = None
    pid: int | None = None
    curve_key: str = ""

    @classmethod
    def parse(cls, raw: str) -> Peer:
        addr, _, user = raw.partition("|")
        m = None if addr.startswith("tcp:") else _IPC_PEER.fullmatch(addr)
        if m:
            return cls(raw, uid=int(m.group(1)), pid=int(m.group(3)))
        return cls(raw, curve_key=user)

    def pid_here(self) -> int:
        """The peer's process id where that process is in this process's PID namespace (the
        kernel's word, the number that process knows itself by), else 0: over ``tcp://``, or
        from another PID namespace (a container's), where the two numbers differ."""
        if not self.pid:
            return 0
        try:
            same = os.readlink(f"/proc/{self.pid}/ns/pid") == os.readlink("/proc/self/ns/pid")
        except OSError:  # gone, or /proc hides it
            return 0
        return self.pid if same else 0

    def label(self) -> str:
        if self.pid is not None:
            return f"pid {self.pid} (uid {self.uid})"
        if self.curve_key:
            return f"CURVE key {self.curve_key[:12]}… at {self.raw.partition('|')[0] or '?'}"
        return self.raw or "an unknown peer"


@dataclass(eq=False)
class Parked:
    """Open writes of a session that went silent while its process still lives (it holds its
    liveness lock): a frozen writer may wake and copy into their slots, so they are kept until
    the process exits, or until the same client resumes its session and sends its late commit
    (which frees them and stores nothing)."""

    secret: bytes
    #: The peer of the session that left them: only the same peer may resume.
    peer: Peer
    token: str
    reservations: dict[int, Reservation] = field(default_factory=dict)


@dataclass(eq=False)
class Session:
    identity: bytes
    peer: Peer
    #: Issued at the handshake; presented by the client to resume after a timeout.
    secret: bytes
    #: Names the client's liveness lock (kvxfer.liveness); issued by the server.
    token: str
    name: str
    #: The client's process id: the kernel's on ipc://, the client's claim elsewhere.
    pid: int
    last_seen: float
    usage: Usage = field(default_factory=Usage)
    #: Registered instance ids of this session, and how many it registered in all.
    instances: set[int] = field(default_factory=set)
    registered: int = 0
    #: Registrations sent to a worker, not finished yet.
    registering: int = 0
    #: Requests waiting on the L2 store (see the engine's ``_Awaiting``).
    waiting: int = 0
    #: The parked writes of the earlier session this one resumed (its late commits free them).
    resumed: Parked | None = None
