"""``generate`` with ``response_model=``: constrained JSON parsed into a Python object."""

from __future__ import annotations

from typing import Any, Sequence

from ..errors import InvalidArgumentError
from ..core.generation import Completion
from ..core.model import Model
from ..core.target import GenerationTarget, as_target
from .schema import ResponseValidationError, parse_response, to_json_schema


def constrain_to(response_model: Any, opts: dict[str, Any]) -> dict[str, Any]:
    """Options with ``json_schema`` set from ``response_model``."""
    if "json_schema" in opts or "grammar" in opts:
        raise InvalidArgumentError("response_model sets the output schema itself; do not also pass json_schema or grammar")
    return {**opts, "json_schema": to_json_schema(response_model)}


def parse_completion(text: str, finish_reason: str, response_model: Any) -> Any:
    if finish_reason == "length":
        raise ResponseValidationError(
            "generation reached max_tokens before the JSON was complete; raise max_tokens", text)
    return parse_response(text, response_model)


def generate(model: Model | GenerationTarget, prompt: str | Sequence[int], *, response_model: Any = None,
             **opts: Any) -> Completion | Any:
    """Generate a completion (see :func:`llama_ctypes.core.one_call.generate`) on a Model, or on any
    :class:`~llama_ctypes.core.target.GenerationTarget` (a ``Server``).

    With ``response_model`` (a Pydantic model, dataclass or TypedDict) the
    output is constrained to its JSON schema and returned parsed and validated;
    text that does not validate raises :class:`ResponseValidationError` with the
    text attached.
    """
    target = as_target(model)
    if response_model is None:
        return target.generate(prompt, **opts)
    done = target.generate(prompt, **constrain_to(response_model, opts))
    return parse_completion(done.text, done.finish_reason, response_model)
