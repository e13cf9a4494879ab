"""The continuous-batching server: requests, slot pool, strategies, the scheduler, the tick loop, the API."""

from .scheduler import QueueFullError, ServerClosedError
from .server import AsyncServerStream, Server, ServerStream
from .strategies import Balanced, BatchStrategy, DecodeMaximal, Plan, PrefillPriority

__all__ = ["Server", "ServerStream", "AsyncServerStream", "QueueFullError", "ServerClosedError", "BatchStrategy",
           "Plan", "DecodeMaximal", "PrefillPriority", "Balanced"]
