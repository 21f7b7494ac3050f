"""Futures for replies: ``result(timeout)``, ``done()``, ``add_done_callback``.

A :class:`ReplyFuture` is a :class:`concurrent.futures.Future` whose ``result(timeout)`` raises
:class:`kvxfer.errors.RequestTimeout` naming the server and the request, instead of a bare
``TimeoutError``.
"""

from __future__ import annotations

import concurrent.futures
from typing import TypeVar

from kvxfer.errors import RequestTimeout

__all__ = ["ReplyFuture"]

T = TypeVar("T")


class ReplyFuture(concurrent.futures.Future[T]):
    """The future of one request to one server, resolving to the request's reply type."""

    def __init__(self, url: str, request: str) -> None:
        super().__init__()
        self.url = url
        self.request = request

    def result(self, timeout: float | None = None) -> T:
        try:
            return super().result(timeout)
        except RequestTimeout:
            raise  # the request's own failure (its deadline passed in the I/O thread): keep it
        except concurrent.futures.TimeoutError:
            raise RequestTimeout(
                f"request {self.request!r} to the kvxfer server at {self.url} got no reply within "
                f"{timeout} s; is the server running and not overloaded? (`kvxfer status --url {self.url}`)"
            ) from None
