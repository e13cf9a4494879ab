"""Helpers shared by the server tests."""

from __future__ import annotations

import time


def wait_idle(server, timeout: float = 10.0) -> None:
    """Wait until ``server`` has no running or waiting request (AssertionError after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = server.stats()
        if stats["active_slots"] == 0 and stats["queue_length"] == 0:
            return
        time.sleep(0.01)
    raise AssertionError(f"server still busy: {server.stats()}")


def slow_decode(monkeypatch, server, delay: float) -> None:
    """Every decode of the server's engine takes at least ``delay`` seconds (GIL released)."""
    real = server._engine._decode

    def slow(batch):
        time.sleep(delay)
        return real(batch)

    monkeypatch.setattr(server._engine, "_decode", slow)
