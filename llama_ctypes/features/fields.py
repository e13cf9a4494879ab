"""Reading the fields of an API request converted here (Anthropic's, the Responses API's): an error that
names the field, and a text field's value."""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import InvalidArgumentError

__all__ = ["FieldError", "string_field", "function_tool"]


class FieldError(InvalidArgumentError):
    """A request field this library cannot take; ``param`` names it (``messages[0].content[1].text``)."""

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param


def string_field(obj: Mapping[str, Any], key: str, where: str) -> str:
    """``obj[key]`` as text: a string, or "" when missing; any other type is the caller's error."""
    value = obj.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise FieldError(f"{where}.{key}: expected a string", param=f"{where}.{key}")
    return value


def function_tool(tool: Mapping[str, Any], schema_key: str, where: str) -> dict[str, Any]:
    """An OpenAI function tool from a converted API's tool (its name, its description, and its JSON Schema
    under ``schema_key``: Anthropic's ``input_schema``, the Responses API's ``parameters``)."""
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise FieldError(f"{where}.name: required (a string)", param=f"{where}.name")
    schema = tool.get(schema_key) or {"type": "object"}
    if not isinstance(schema, Mapping):
        raise FieldError(f"{where}.{schema_key}: expected a JSON Schema object", param=f"{where}.{schema_key}")
    fn: dict[str, Any] = {"name": tool["name"], "parameters": schema}
    if tool.get("description"):
        fn["description"] = string_field(tool, "description", where)
    return {"type": "function", "function": fn}
