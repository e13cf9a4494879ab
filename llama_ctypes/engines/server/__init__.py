"""The continuous-batching server: request state, slot pool, batching strategies, the tick loop, the API."""

from .engine import QueueFullError, ServerClosedError
from .server import Server, ServerStream
from .strategies import Balanced, BatchStrategy, DecodeMaximal, Plan, PrefillPriority

__all__ = ["Server", "ServerStream", "QueueFullError", "ServerClosedError", "BatchStrategy", "Plan",
           "DecodeMaximal", "PrefillPriority", "Balanced"]
