"""pytest's JUnit XML report as {test id: (outcome, first line of its message)}, for the bench scripts
that run another project's test suite (llama_cpp_python_tests.py, llama_server_suite.py)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

_OUTCOMES = {"failure": "failed", "error": "error", "skipped": "skipped"}


def outcomes(report: Path, strip_prefix: str = "", max_len: int = 300) -> dict[str, tuple[str, str]]:
    """``classname::name`` (``strip_prefix`` removed from the class name) → (passed/failed/error/skipped,
    the first line of the failure's message, at most ``max_len`` characters)."""
    results: dict[str, tuple[str, str]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').removeprefix(strip_prefix)}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag, label in _OUTCOMES.items():
            node = case.find(tag)
            if node is not None:
                outcome = label
                lines = (node.get("message") or "").strip().splitlines()
                message = lines[0][:max_len] if lines else ""
                break
        results[name] = (outcome, message)
    return results
