"""The exceptions kvxfer raises, one small tree drawn once.

::

    KvxferError
    ├── ConfigError                 a bad argument or setting; the message says which and what to do
    │   └── LayoutError             KV tensors whose shape, dtype or device kvxfer cannot use
    ├── TransportError              about a transport plugin (names the plugin)
    │   ├── TransportNotFound       no such name; lists the installed transports
    │   ├── TransportUnavailable    installed, but probe() says it cannot run here, and why
    │   ├── TransportBroken         fails to import, wrong api_version, or not a Transport
    │   └── TransportFailed         the plugin's code raised during a step (names transport
    │                               and step; the plugin's exception is ``__cause__``)
    ├── StoreError                  about an L2 store backend (names the backend)
    │   ├── StoreNotFound           no such name; lists the installed store backends
    │   ├── StoreBroken             fails to import, wrong api_version, or not a Store
    │   └── StoreUnavailable        the store cannot be reached or failed an operation (retry later)
    ├── ConnectionFailed            the server cannot be reached or stopped answering
    │   └── RequestTimeout          a request got no reply in time (names server and request)
    ├── ProtocolError               the two sides do not speak the same protocol
    └── RemoteError                 the server answered with a typed error (``code``, message)
        ├── InvalidRequest          a payload failed validation (names the field)
        ├── UnknownRequest          the server has no handler of that name
        ├── UnknownInstance         the instance id is not registered (or was dropped)
        ├── NoSession               the server does not know this connection (restarted?)
        ├── VersionMismatch         handshake refused: protocol versions differ
        ├── LimitExceeded           a server limit was reached (names it and the option that raises it)
        └── ServerInternalError     a handler raised (a bug); the server keeps serving

Every :class:`RemoteError` subclass has a wire ``code`` (one of :class:`ErrorCode`);
:func:`remote_error` turns a ``(code, message)`` reply into the matching exception, so clients
can catch by type. Every call into a transport plugin's code goes through one boundary that
turns what the plugin raised into :class:`TransportFailed` (a :class:`KvxferError` raised
``from`` the plugin's exception), so a caller that catches :class:`KvxferError` catches
everything a transfer can fail with.
"""

from __future__ import annotations

import enum
from typing import ClassVar, Final

__all__ = [
    "KvxferError",
    "ConfigError",
    "LayoutError",
    "TransportError",
    "TransportNotFound",
    "TransportUnavailable",
    "TransportBroken",
    "TransportFailed",
    "StoreError",
    "StoreNotFound",
    "StoreBroken",
    "StoreUnavailable",
    "ConnectionFailed",
    "RequestTimeout",
    "ProtocolError",
    "RemoteError",
    "InvalidRequest",
    "UnknownRequest",
    "UnknownInstance",
    "NoSession",
    "VersionMismatch",
    "LimitExceeded",
    "ServerInternalError",
    "ErrorCode",
    "remote_error",
]


class ErrorCode(str, enum.Enum):
    """The ``code`` of an error reply on the wire (``ErrorReply.code``)."""

    #: A code this client does not know (a newer server): a plain :class:`RemoteError`.
    ERROR = "error"
    INVALID_REQUEST = "invalid_request"
    UNKNOWN_REQUEST = "unknown_request"
    UNKNOWN_INSTANCE = "unknown_instance"
    NO_SESSION = "no_session"
    VERSION_MISMATCH = "version_mismatch"
    LIMIT_EXCEEDED = "limit_exceeded"
    INTERNAL = "internal"

    def __str__(self) -> str:
        return self.value


class KvxferError(Exception):
    """Base of every exception kvxfer raises on purpose."""


class ConfigError(KvxferError, ValueError):
    """A bad argument or setting. The message names it and says what would be valid."""


class LayoutError(ConfigError):
    """KV cache tensors that kvxfer cannot describe or that do not match a registration."""


class TransportError(KvxferError):
    """A problem with a transport plugin; the message names the plugin."""


class TransportNotFound(TransportError, LookupError):
    """No transport of that name is installed. The message lists the installed ones."""


class TransportUnavailable(TransportError):
    """The transport is installed but cannot run here; the message gives its probe's reason."""


class TransportBroken(TransportError):
    """The plugin failed to load, declares another api_version, or is not a Transport."""


class TransportFailed(TransportError):
    """A transport plugin's code raised during a step of a transfer or registration.

    ``transport`` and ``step`` name where (e.g. ``"cpu_gather"``, ``"gather"``); the plugin's own
    exception is ``__cause__``. Raised by the core at its one boundary around plugin calls.
    """

    def __init__(self, transport: str, step: str, cause: BaseException) -> None:
        self.transport = transport
        self.step = step
        super().__init__(f"transport {transport!r} failed in {step}: {type(cause).__name__}: {cause}")


class StoreError(KvxferError):
    """A problem with an L2 store backend (:mod:`kvxfer.store`); the message names it."""


class StoreNotFound(StoreError, LookupError):
    """No store backend of that name is installed. The message lists the installed ones."""


class StoreBroken(StoreError):
    """The store plugin failed to load, declares another api_version, or is not a Store."""


class StoreUnavailable(StoreError):
    """The store cannot be reached, timed out, or refused an operation; the server carries on
    from L1 and retries with backoff."""


class ConnectionFailed(KvxferError, ConnectionError):
    """The cache server cannot be reached, or it stopped answering."""


class RequestTimeout(ConnectionFailed, TimeoutError):
    """A request got no reply within its timeout. The message names server and request."""


class ProtocolError(KvxferError):
    """Frames that do not follow the wire protocol (from either side)."""


class RemoteError(KvxferError):
    """The server answered a request with a typed error.

    ``code`` is the wire code, ``message`` the server's text; ``request`` names the request.
    """

    code: ClassVar[ErrorCode] = ErrorCode.ERROR

    def __init__(self, message: str, *, request: str = "") -> None:
        self.message = message
        self.request = request
        prefix = f"{request}: " if request else ""
        super().__init__(f"{prefix}{message}")


class InvalidRequest(RemoteError, ValueError):
    """A request's payload failed validation; the message names the field."""

    code = ErrorCode.INVALID_REQUEST


class UnknownRequest(RemoteError):
    """The server has no request of that name (client newer than server?)."""

    code = ErrorCode.UNKNOWN_REQUEST


class UnknownInstance(RemoteError, LookupError):
    """The instance id is not registered, or its client's session was dropped."""

    code = ErrorCode.UNKNOWN_INSTANCE


class NoSession(RemoteError):
    """The server does not know this connection: handshake first (the server may have restarted)."""

    code = ErrorCode.NO_SESSION


class VersionMismatch(RemoteError, ProtocolError):
    """The handshake was refused because client and server protocol versions differ."""

    code = ErrorCode.VERSION_MISMATCH


class LimitExceeded(RemoteError):
    """A request would take the client (or everyone) past one of the server's limits on what a
    session may hold. The message names the limit, its value, and the ``kvxfer serve`` option
    that raises it; nothing of the request was done."""

    code = ErrorCode.LIMIT_EXCEEDED


class ServerInternalError(RemoteError):
    """A server handler raised an unexpected exception (a bug); the server keeps serving."""

    code = ErrorCode.INTERNAL


_BY_CODE: Final[dict[str, type[RemoteError]]] = {
    cls.code.value: cls
    for cls in (
        InvalidRequest,
        UnknownRequest,
        UnknownInstance,
        NoSession,
        VersionMismatch,
        LimitExceeded,
        ServerInternalError,
    )
}


def remote_error(code: str, message: str, request: str = "") -> RemoteError:
    """The exception for an error reply; unknown codes give a plain :class:`RemoteError`."""
    cls = _BY_CODE.get(code)
    if cls is None:
        err = RemoteError(f"[{code}] {message}", request=request)
        return err
    return cls(message, request=request)
