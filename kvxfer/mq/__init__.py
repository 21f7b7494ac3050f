"""Messaging: the client with its I/O thread, the server loop, futures; the ``ipc://`` wire (a
Unix stream socket with length-prefixed frames) and ZeroMQ with CURVE on ``tcp://``."""

from kvxfer.mq.client import CurveClientKeys, MQClient
from kvxfer.mq.futures import ReplyFuture
from kvxfer.mq.server import CurveServerKeys, MQServer

__all__ = ["MQClient", "MQServer", "ReplyFuture", "CurveClientKeys", "CurveServerKeys"]
