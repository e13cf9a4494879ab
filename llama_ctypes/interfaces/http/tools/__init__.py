"""llama-server's agent tools behind ``/tools``: the built-in ones (``--tools``) and MCP servers' (box.py)."""
