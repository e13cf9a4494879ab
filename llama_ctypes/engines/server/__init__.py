"""The continuous-batching server: requests, slot pool, strategies, the scheduler, the tick loop, the API,
the consumer streams."""

from .params import DEFAULT_MAX_QUEUE, ServerParams
from .scheduler import QueueFullError, ServerClosedError
from .server import Server
from .strategies import Balanced, BatchStrategy, DecodeMaximal, Plan, PrefillPriority
from .streams import AsyncServerStream, ServerStream

__all__ = ["Server", "ServerParams", "DEFAULT_MAX_QUEUE", "ServerStream", "AsyncServerStream", "QueueFullError",
           "ServerClosedError", "BatchStrategy", "Plan", "DecodeMaximal", "PrefillPriority", "Balanced"]
