"""ZeroMQ messaging: the DEALER client with its I/O thread, the ROUTER server loop, futures."""

from kvxfer.mq.client import CurveClientKeys, MQClient
from kvxfer.mq.futures import ReplyFuture
from kvxfer.mq.server import CurveServerKeys, MQServer

__all__ = ["MQClient", "MQServer", "ReplyFuture", "CurveClientKeys", "CurveServerKeys"]
