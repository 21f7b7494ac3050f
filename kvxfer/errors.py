"""The exceptions kvxfer raises, one small tree drawn once.

::

    KvxferError
    ├── ConfigError                 a bad argument or setting; the message says which and what to do
    │   └── LayoutError             KV tensors whose shape, dtype or device kvxfer cannot use
    ├── TransportError              about a transport plugin (names the plugin)
    │   ├── TransportNotFound       no such name; lists the installed transports
    │   ├── TransportUnavailable    installed, but probe() says it cannot run here, and why
    │   └── TransportBroken         fails to import, wrong api_version, or not a Transport
    ├── ConnectionFailed            the server cannot be reached or stopped answering
    │   └── RequestTimeout          a request got no reply in time (names server and request)
    ├── ProtocolError               the two sides do not speak the same protocol
    └── RemoteError                 the server answered with a typed error (``code``, message)
        ├── InvalidRequest          a payload failed validation (names the field)
        ├── UnknownRequest          the server has no handler of that name
        ├── UnknownInstance         the instance id is not registered (or was dropped)
        ├── NoSession               the server does not know this connection (restarted?)
        ├── VersionMismatch         handshake refused: protocol versions differ
        └── ServerInternalError     a handler raised; the server keeps serving

Every :class:`RemoteError` subclass has a wire ``code``; :func:`remote_error` turns a
``(code, message)`` reply into the matching exception, so clients can catch by type.
"""

from __future__ import annotations

from typing import ClassVar, Final

__all__ = [
    "KvxferError",
    "ConfigError",
    "LayoutError",
    "TransportError",
    "TransportNotFound",
    "TransportUnavailable",
    "TransportBroken",
    "ConnectionFailed",
    "RequestTimeout",
    "ProtocolError",
    "RemoteError",
    "InvalidRequest",
    "UnknownRequest",
    "UnknownInstance",
    "NoSession",
    "VersionMismatch",
    "ServerInternalError",
    "remote_error",
]


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

    code: ClassVar[str] = "error"

    def __init__(self, message: str, *, request: str = "") -> None:
        self.message = message
        self.request = request
        prefix = f"{request}: " if request else ""
        super().__init__(f"{prefix}{message}")


class InvalidRequest(RemoteError, ValueError):
    """A request's payload failed validation; the message names the field."""

    code = "invalid_request"


class UnknownRequest(RemoteError):
    """The server has no request of that name (client newer than server?)."""

    code = "unknown_request"


class UnknownInstance(RemoteError, LookupError):
    """The instance id is not registered, or its client's session was dropped."""

    code = "unknown_instance"


class NoSession(RemoteError):
    """The server does not know this connection: handshake first (the server may have restarted)."""

    code = "no_session"


class VersionMismatch(RemoteError, ProtocolError):
    """The handshake was refused because client and server protocol versions differ."""

    code = "version_mismatch"


class ServerInternalError(RemoteError):
    """A server handler raised an unexpected exception; the server keeps serving."""

    code = "internal"


_BY_CODE: Final[dict[str, type[RemoteError]]] = {
    cls.code: cls
    for cls in (
        InvalidRequest,
        UnknownRequest,
        UnknownInstance,
        NoSession,
        VersionMismatch,
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
