"""An OpenAI-compatible HTTP server over a ModelManager (``llama-ctypes serve``).

Needs the ``server`` extra (``pip install 'llama_ctypes[server]'``: Starlette, uvicorn,
prometheus-client, pydantic). See docs/http_server.md.
"""

from .app import create_app
from .connections import ConnectionLimits, guarded_protocol
from .limits import RequestLimits
from .routing import ModelSettings

__all__ = ["create_app", "ModelSettings", "RequestLimits", "ConnectionLimits", "guarded_protocol"]
