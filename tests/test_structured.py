"""Structured output: GBNF grammars, JSON Schema, Python types → schema, response models."""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import json
from typing import Literal, Optional, TypedDict

import jsonschema
import pytest
from test_schema_keywords import Gbnf

import llama_ctypes as lc

# ---- 16 schemas, each with a prompt; every output must parse and validate ---------------------------
# Every string has a maxLength (and every number a bound or llama.cpp's digit limit), so each grammar has
# a longest output: with max_tokens above it, generation must end with the grammar complete, whatever
# text the model prefers. Greedy text differs between CPU kernel sets; the assertions do not depend on it.
ADDRESS = {"type": "object", "properties": {"street": {"type": "string", "maxLength": 40},
                                            "city": {"type": "string", "maxLength": 30}},
           "required": ["street", "city"], "additionalProperties": False}
SCHEMAS = {
    "flat object": ("A person named Alice, aged 30:", {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
        "required": ["name", "age"], "additionalProperties": False}),
    "nested object": ("A user with an address in Paris:", {
        "type": "object", "properties": {"user": {"type": "string", "maxLength": 24}, "address": ADDRESS},
        "required": ["user", "address"], "additionalProperties": False}),
    "array with bounds": ("Three fruits:", {
        "type": "object", "properties": {"fruits": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                    "minItems": 2, "maxItems": 4}},
        "required": ["fruits"], "additionalProperties": False}),
    "top-level array": ("Some prime numbers:", {
        "type": "array", "items": {"type": "integer", "minimum": 2, "maximum": 100}, "minItems": 1, "maxItems": 5}),
    "enum": ("The colour of the sky:", {
        "type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"], "additionalProperties": False}),
    "const and boolean": ("Is water wet?", {
        "type": "object", "properties": {"kind": {"const": "answer"}, "value": {"type": "boolean"}},
        "required": ["kind", "value"], "additionalProperties": False}),
    "refs and defs": ("Two points:", {
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                            "required": ["x", "y"], "additionalProperties": False}},
        "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"], "additionalProperties": False}),
    "anyOf": ("An id, as a number or a code:", {
        "type": "object", "properties": {"id": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 12}]}},
        "required": ["id"], "additionalProperties": False}),
    "nullable": ("A middle name, if any:", {
        "type": "object", "properties": {"middle": {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]}},
        "required": ["middle"], "additionalProperties": False}),
    "date format": ("The date of the first moon landing:", {
        "type": "object", "properties": {"date": {"type": "string", "format": "date"}},
        "required": ["date"], "additionalProperties": False}),
    "date-time and uuid": ("An event record:", {
        "type": "object", "properties": {"at": {"type": "string", "format": "date-time"},
                                         "id": {"type": "string", "format": "uuid"}},
        "required": ["at", "id"], "additionalProperties": False}),
    "pattern": ("A US zip code:", {
        "type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["zip"], "additionalProperties": False}),
    "string lengths": ("A short nickname:", {
        "type": "object", "properties": {"nick": {"type": "string", "minLength": 3, "maxLength": 8}},
        "required": ["nick"], "additionalProperties": False}),
    "integer bounds": ("A dice roll:", {
        "type": "object", "properties": {"roll": {"type": "integer", "minimum": 1, "maximum": 6}},
        "required": ["roll"], "additionalProperties": False}),
    "number bounds": ("A probability:", {
        "type": "object", "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["p"], "additionalProperties": False}),
    "tuple": ("A 2D coordinate and its label:", {
        "type": "array", "prefixItems": [{"type": "number"}, {"type": "number"}, {"type": "string", "maxLength": 10}],
        "items": False, "minItems": 3, "maxItems": 3}),
}


def enough_tokens(schema) -> int:
    """max_tokens that fits any output of the schema's grammar (a token is at least one byte), and EOG."""
    longest = Gbnf(lc.grammar.from_json_schema(schema)).max_bytes()
    assert longest < 2000, "the schema must bound its output"
    return int(longest) + 1


@pytest.mark.gemma
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_gemma_output_validates_against_each_schema(gemma, name):
    prompt, schema = SCHEMAS[name]
    done = lc.generate(gemma, f"Reply with JSON only.\n{prompt}\n", json_schema=schema, temp=0,
                       max_tokens=enough_tokens(schema))
    assert done.finish_reason == "eog", f"did not finish: {done!r}"
    jsonschema.validate(json.loads(done), schema)


@pytest.mark.gemma
def test_streamed_constrained_output_concatenates_to_valid_json(gemma):
    prompt, schema = SCHEMAS["nested object"]
    n = enough_tokens(schema)
    pieces = list(lc.stream(gemma, prompt, json_schema=schema, temp=0, max_tokens=n))
    assert len(pieces) > 3
    text = "".join(pieces)
    jsonschema.validate(json.loads(text), schema)
    assert text == lc.generate(gemma, prompt, json_schema=schema, temp=0, max_tokens=n)


def test_grammar_constrains_the_tiny_model(tiny_model):
    # Random weights: only the grammar makes this valid.
    schema = SCHEMAS["flat object"][1]
    for seed in range(3):
        done = lc.generate(tiny_model, "x", json_schema=schema, temp=1.0, seed=seed, max_tokens=300,
                           top_k=0, top_p=1.0, min_p=0.0)
        if done.finish_reason == "eog":
            jsonschema.validate(json.loads(done), schema)
    greedy = lc.generate(tiny_model, "x", grammar='root ::= "yes" | "no" | "maybe"', temp=0)
    assert greedy in ("yes", "no", "maybe") and greedy.finish_reason == "eog"


def test_grammar_rejection_sampling_equals_grammar_first(tiny_model):
    # Ours samples first and checks the grammar after (masking the vocabulary only on a
    # rejection); the reference is llama.cpp's own chain [grammar, greedy], which masks first.
    from llama_ctypes.core.backend import init

    lib = init()
    grammar = 'root ::= [a-z]+ " " [0-9]+'
    prompt = lc.Tokenizer.encode(tiny_model, "hello")
    ours = lc.generate(tiny_model, prompt, grammar=grammar, temp=0, max_tokens=12)
    chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
    lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_grammar(tiny_model.vocab.native(), grammar.encode(),
                                                                      b"root"))
    lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
    reference = []
    try:
        with lc.Context.create(tiny_model, n_ctx=256) as ctx, ctx.lease() as lease:
            lease.prefill(prompt, reuse=False)
            append = lease.append_fn()
            for _ in range(len(ours.tokens)):
                tok = lib.llama_sampler_sample(chain, lease._ptr, -1)  # (test-only: the raw context)
                reference.append(tok)
                append(tok)
    finally:
        lib.llama_sampler_free(chain)
    assert len(ours.tokens) >= 4 and ours.tokens == reference


def test_lazy_grammar_applies_only_after_its_trigger(tiny_model):
    trigger_text = "<tool>"
    bias = {t: 1e4 - 1e3 * i for i, t in enumerate(lc.Tokenizer.encode(tiny_model, trigger_text, add_special=False))}
    done = lc.generate(tiny_model, "call a tool", temp=0, max_tokens=30, penalty_repeat=1e9, logit_bias=bias,
                       grammar='root ::= "<tool>" [0-9]{3}', grammar_lazy_triggers=["<tool>"])
    text = done.text.strip()
    assert text.startswith(trigger_text)
    rest = text[len(trigger_text):]
    assert rest[:3].isdigit() and len(rest) == 3, done.text


def test_invalid_grammar_and_schemas_raise_named_errors_then_work(tiny_model):
    with pytest.raises(lc.GrammarError):
        lc.generate(tiny_model, "x", grammar="root ::= (")
    with pytest.raises(lc.SchemaError, match="not valid under any of the given schemas|is not valid"):
        lc.generate(tiny_model, "x", json_schema={"type": "strng"})
    with pytest.raises(lc.SchemaError, match="'uniqueItems'"):
        lc.grammar.from_json_schema({"type": "array", "items": {"type": "integer"}, "uniqueItems": True})
    with pytest.raises(lc.SchemaError, match="'format'.*email"):
        lc.grammar.from_json_schema({"type": "string", "format": "email"})
    with pytest.raises(lc.SchemaError, match="cannot resolve"):
        lc.grammar.from_json_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}})
    with pytest.raises(lc.SchemaError, match="not valid JSON"):
        lc.grammar.from_json_schema("{not json")
    with pytest.raises(ValueError, match="either grammar or json_schema"):
        lc.generate(tiny_model, "x", grammar='root ::= "a"', json_schema={"type": "string"})
    assert lc.generate(tiny_model, "x", grammar='root ::= "ok"', temp=0) == "ok"


def test_from_json_schema_keeps_property_order():
    gbnf = lc.grammar.from_json_schema({"type": "object", "properties": {"zeta": {"type": "integer"},
                                                                         "alpha": {"type": "integer"}},
                                        "required": ["zeta", "alpha"], "additionalProperties": False})
    root = next(line for line in gbnf.splitlines() if line.startswith("root ::="))
    assert root.index("zeta") < root.index("alpha")


# ---- Python types → JSON Schema -----------------------------------------------------------------------

class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass
class Address:
    city: str
    zip: Optional[str] = None


@dataclasses.dataclass
class Person:
    name: str
    age: int
    tags: list[str]
    born: dt.date
    color: Color
    kind: Literal["human", "robot"]
    address: Address
    seen: dt.datetime
    score: float = 0.0


class Shipment(TypedDict):
    id: int
    to: list[Address]


def test_dataclass_schema_is_complete_and_convertible():
    schema = lc.schema.to_json_schema(Person)
    props = schema["properties"]
    assert schema["type"] == "object" and schema["additionalProperties"] is False
    assert schema["required"] == ["name", "age", "tags", "born", "color", "kind", "address", "seen"]
    assert props["tags"] == {"type": "array", "items": {"type": "string"}}
    assert props["born"] == {"type": "string", "format": "date"}
    assert props["seen"]["format"] == "date-time"
    assert props["color"] == {"enum": ["red", "blue"]}
    assert props["kind"] == {"enum": ["human", "robot"]}
    assert props["address"] == {"$ref": "#/$defs/Address"}
    assert schema["$defs"]["Address"]["required"] == ["city"]
    assert schema["$defs"]["Address"]["properties"]["zip"] == {"anyOf": [{"type": "string"}, {"type": "null"}]}
    jsonschema.validators.validator_for(schema).check_schema(schema)
    assert "root ::=" in lc.grammar.from_type(Person)


def test_typeddict_and_pydantic_schemas():
    schema = lc.schema.to_json_schema(Shipment)
    assert schema["required"] == ["id", "to"] and schema["properties"]["to"]["items"] == {"$ref": "#/$defs/Address"}
    pydantic = pytest.importorskip("pydantic")

    class Item(pydantic.BaseModel):
        name: str
        price: float
        when: Optional[dt.datetime] = None

    class Order(pydantic.BaseModel):
        items: list[Item]
        status: Literal["open", "closed"]

    order = lc.schema.to_json_schema(Order)
    assert order["additionalProperties"] is False
    assert order["$defs"]["Item"]["additionalProperties"] is False
    assert "root ::=" in lc.grammar.from_json_schema(order)


def test_parse_response_builds_instances_and_reports_bad_text():
    text = json.dumps({"name": "Ada", "age": 36, "tags": ["math"], "born": "1815-12-10", "color": "blue",
                       "kind": "human", "address": {"city": "London"}, "seen": "2026-11-30T10:00:00Z"})
    person = lc.schema.parse_response(text, Person)
    assert person.born == dt.date(1815, 12, 10) and person.color is Color.BLUE
    assert person.address == Address("London") and person.seen.tzinfo is not None
    with pytest.raises(lc.ResponseValidationError) as err:
        lc.schema.parse_response('{"name": "Ada"}', Person)
    assert err.value.text == '{"name": "Ada"}' and "Ada" in str(err.value)
    with pytest.raises(lc.ResponseValidationError, match="not valid JSON"):
        lc.schema.parse_response("{", Person)


@pytest.mark.gemma
def test_response_model_on_generate_and_chat(gemma):
    # Free-form fields would let greedy text run on (on one CPU Gemma wrote {"name": "1000000... until
    # max_tokens): the fields are bounded, so the JSON always completes within max_tokens.
    @dataclasses.dataclass
    class City:
        name: Literal["Paris", "Rome", "Berlin", "Madrid", "other"]
        country: Literal["France", "Italy", "Germany", "Spain", "other"]
        population: int
        capital: bool

    n = enough_tokens(lc.schema.to_json_schema(City))
    city = lc.generate(gemma, "Paris, as JSON:\n", response_model=City, temp=0, max_tokens=n)
    assert isinstance(city, City) and isinstance(city.population, int) and isinstance(city.capital, bool)
    reply = lc.chat(gemma, [{"role": "user", "content": "Describe Rome as JSON."}], chat_template="gemma",
                    response_model=City, temp=0, max_tokens=n)
    assert isinstance(reply, City) and reply.country in ("France", "Italy", "Germany", "Spain", "other")
    with pytest.raises(lc.ResponseValidationError, match="max_tokens"):
        lc.generate(gemma, "Paris, as JSON:\n", response_model=City, temp=0, max_tokens=3)
