"""Configuration of the MCP servers behind ``/tools``: llama-server's ``--mcp-servers-json`` /
``--mcp-servers-config`` (Cursor's ``mcpServers`` format)."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_MS = 30_000


@dataclass(frozen=True)
class McpServerConfig:
    """One ``mcpServers`` entry. ``env`` is merged over our environment; ``cwd`` empty = ours;
    ``timeout_ms`` bounds each JSON-RPC request (default 30000, as llama-server)."""

    name: str
    command: str
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict, hash=False)  # hash=False: the config stays hashable
    cwd: str = ""
    timeout_ms: int = DEFAULT_TIMEOUT_MS

    @property
    def timeout(self) -> float:
        """The per-request timeout in seconds."""
        return self.timeout_ms / 1000.0


def _need(ok: bool, name: str, what: str) -> None:
    if not ok:
        raise ValueError(f"failed to parse MCP config JSON: server '{name}': {what}")


def parse_mcp_config(text: str) -> list[McpServerConfig]:
    """Parse llama-server's (Cursor's) ``{"mcpServers": {name: {command, args, env, cwd, timeout_ms}}}``.

    As llama-server: no ``mcpServers`` object gives ``[]``; entries without a command are skipped
    with a warning; unknown keys are ignored. Raises ``ValueError`` on invalid JSON or a wrong type.
    """
    try:
        doc = json.loads(text)
    except ValueError as e:  # JSONDecodeError and bad UTF-8 alike
        raise ValueError(f"failed to parse MCP config JSON: {e}") from None
    servers = doc.get("mcpServers") if isinstance(doc, dict) else None
    if not isinstance(servers, dict):
        log.warning("MCP config: no servers found in JSON")
        return []
    out = []
    for name, cfg in servers.items():
        _need(isinstance(cfg, dict), name, "must be an object")
        command = cfg.get("command", "")
        cwd = cfg.get("cwd", "")
        timeout_ms = cfg.get("timeout_ms", DEFAULT_TIMEOUT_MS)
        args, env = cfg.get("args"), cfg.get("env")
        _need(isinstance(command, str), name, "'command' must be a string")
        _need(isinstance(cwd, str), name, "'cwd' must be a string")
        _need(isinstance(timeout_ms, (int, float)) and not isinstance(timeout_ms, bool)
              and math.isfinite(timeout_ms) and timeout_ms > 0, name, "'timeout_ms' must be a positive number")
        # llama-server ignores "args" that is not an array and "env" that is not an object
        args = args if isinstance(args, list) else []
        env = env if isinstance(env, dict) else {}
        _need(all(isinstance(a, str) for a in args), name, "'args' must hold strings")
        _need(all(isinstance(v, str) for v in env.values()), name, "'env' values must be strings")
        if not command:
            log.warning("MCP server '%s' has no command, skipping", name)
            continue
        out.append(McpServerConfig(name, command, tuple(args), dict(env), cwd, int(timeout_ms)))
    if not out:
        log.warning("MCP config: no servers found in JSON")
    return out


def read_mcp_config_file(path: str | os.PathLike[str]) -> list[McpServerConfig]:
    """:func:`parse_mcp_config` on a file's text; a file that cannot be read raises ``ValueError``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"failed to open MCP config file: {path} ({e})") from None
    return parse_mcp_config(text)
