"""Schema keywords xgrammar cannot enforce (``patch/schema_keywords.py``), each claim
checked against xgrammar itself and ``jsonschema``:

* refused: xgrammar's grammar (as the plugin compiles it for V4.1) accepts a value that
  ``jsonschema`` rejects for exactly that keyword, and ``unenforced`` names the keyword
  and its JSON path;
* enforced: the grammar rejects a value ``jsonschema`` rejects, accepts a valid one, and
  nothing is refused;
* vacuous: keywords that constrain nothing are not refused.

Then the places that refuse: a V4.1 request's ``response_format`` (vLLM's request
validation, other models unchanged) and a forced tool call's parameters (DSML grammar).
"""

from __future__ import annotations

import json
import types

import jsonschema
import pytest
import vllm  # noqa: F401  (vLLM's import order)
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

from deepinfer_vllm.patch.schema_keywords import json_path, unenforced
from deepinfer_vllm.patch.structured_outputs import BoundedGrammarCompiler

I = {"type": "integer"}  # noqa: E741
_DEFS = {"s": {"type": "string", "maxLength": 4}}
_PETS = {
    "$defs": {
        "Cat": {
            "type": "object",
            "properties": {
                "kind": {"const": "cat"},
                "lives": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["kind", "lives"],
        },
        "Dog": {
            "type": "object",
            "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
            "required": ["kind", "good"],
        },
    },
    "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
    "discriminator": {"propertyName": "kind"},
}

# (id, schema, [(keyword, path)] refused, a value xgrammar admits that violates the keyword)
REFUSED = [
    ("uniqueItems", {"type": "array", "items": I, "uniqueItems": True}, [("uniqueItems", "$")], "[1, 1]"),
    ("uniqueItems_untyped", {"items": I, "uniqueItems": True}, [("uniqueItems", "$")], "[1, 1]"),
    ("contains", {"type": "array", "items": I, "contains": {"const": 5}}, [("contains", "$")], "[1]"),
    (
        "minContains",
        {"type": "array", "items": I, "contains": {"const": 5}, "minContains": 2},
        [("contains", "$"), ("minContains", "$")],
        "[5, 1]",
    ),
    (
        "maxContains",
        {"type": "array", "items": I, "contains": {"const": 5}, "maxContains": 1},
        [("contains", "$"), ("maxContains", "$")],
        "[5, 5]",
    ),
    (
        "format_maxLength",
        {
            "type": "object",
            "properties": {"email": {"type": "string", "format": "email", "maxLength": 8}},
            "required": ["email"],
        },
        [("maxLength", "$.properties.email")],
        '{"email": "abcdefgh@b.co"}',
    ),
    (
        "format_minLength",
        {"type": "string", "format": "email", "minLength": 8},
        [("minLength", "$")],
        '"a@b.co"',
    ),
    (
        "pattern_maxLength",
        {"type": "string", "pattern": "^a+$", "maxLength": 3},
        [("maxLength", "$")],
        '"aaaa"',
    ),
    ("format_unsupported", {"type": "string", "format": "idn-email"}, [("format", "$")], '"nope"'),
    ("number_multipleOf", {"type": "number", "multipleOf": 0.5}, [("multipleOf", "$")], "1.25"),
    (
        "integer_multipleOf_one_bound",
        {"type": "integer", "multipleOf": 3, "minimum": 0},
        [("multipleOf", "$")],
        "4",
    ),
    (
        "integer_multipleOf_wide_range",
        {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 10000},
        [("multipleOf", "$")],
        "4",
    ),
    ("integer_multipleOf_large", {"type": "integer", "multipleOf": 2048}, [("multipleOf", "$")], "3"),
    ("integer_multipleOf_fraction", {"type": "integer", "multipleOf": 2.5}, [("multipleOf", "$")], "3"),
    (
        "no_type",
        {"type": "object", "properties": {"x": {"maxLength": 3}}, "required": ["x"]},
        [("maxLength", "$.properties.x")],
        '{"x": "abcd"}',
    ),
    ("no_type_minimum", {"minimum": 3}, [("minimum", "$")], "1"),
    (
        "ref_sibling",
        {
            "$defs": _DEFS,
            "type": "object",
            "properties": {"x": {"$ref": "#/$defs/s", "minLength": 2}},
            "required": ["x"],
        },
        [("minLength", "$.properties.x")],
        '{"x": "a"}',
    ),
    (
        "ref_target",
        {
            "$defs": {"k": {"maxLength": 1}},
            "type": "object",
            "propertyNames": {"$ref": "#/$defs/k"},
            "additionalProperties": I,
        },
        [("maxLength", "$.$defs.k")],
        '{"cd": 1}',
    ),
    ("anyOf_sibling", {"anyOf": [{"type": "string"}, I], "maxLength": 1}, [("maxLength", "$")], '"ab"'),
    ("allOf_several", {"allOf": [I, {"minimum": 3}]}, [("allOf", "$")], "1"),
    ("allOf_sibling", {"allOf": [{"type": "integer", "minimum": 3}], "maximum": 5}, [("maximum", "$")], "9"),
    ("oneOf_overlap", {"oneOf": [I, {"type": "number"}]}, [("oneOf", "$")], "1"),
    (
        "oneOf_overlap_ranges",
        {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 5}]},
        [("oneOf", "$")],
        "3",
    ),
    ("enum_sibling", {"type": "string", "enum": ["abc", "x"], "maxLength": 2}, [("maxLength", "$")], '"abc"'),
    ("const_sibling", {"const": "abc", "maxLength": 2}, [("maxLength", "$")], '"abc"'),
    ("enum_type", {"enum": [1, "a"], "type": "integer"}, [("type", "$")], '"a"'),
    ("const_enum", {"const": 1, "enum": [2]}, [("enum", "$")], "1"),
    ("not", {"type": "integer", "not": {"const": 3}}, [("not", "$")], "3"),
    ("if_then", {"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 6}}, [("if", "$")], "9"),
    (
        "dependentRequired",
        {"type": "object", "properties": {"a": I, "b": I}, "dependentRequired": {"a": ["b"]}},
        [("dependentRequired", "$")],
        '{"a": 1}',
    ),
    (
        "dependentSchemas",
        {"type": "object", "properties": {"a": I, "b": I}, "dependentSchemas": {"a": {"required": ["b"]}}},
        [("dependentSchemas", "$")],
        '{"a": 1}',
    ),
    (
        "required_undeclared",
        {"type": "object", "properties": {"a": I}, "required": ["a", "b"]},
        [("required", "$")],
        '{"a": 1}',
    ),
    (
        "propertyNames_vs_properties",
        {"type": "object", "properties": {"abc": I}, "propertyNames": {"maxLength": 2}},
        [("propertyNames", "$")],
        '{"abc": 1}',
    ),
    (
        "propertyNames_no_additional",
        {"type": "object", "propertyNames": {"maxLength": 2}, "additionalProperties": False},
        [("additionalProperties", "$")],
        '{"ab": 1}',
    ),
    (
        "patternProperties_vs_properties",
        {
            "type": "object",
            "properties": {"xa": I},
            "patternProperties": {"^x": {"type": "integer", "minimum": 5}},
        },
        [("patternProperties", "$")],
        '{"xa": 1}',
    ),
    (
        "dependencies_draft7",
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "type": "object",
            "properties": {"a": I, "b": I},
            "dependencies": {"a": ["b"]},
        },
        [("dependencies", "$")],
        '{"a": 1}',
    ),
    (
        "dynamicRef",
        {
            "type": "object",
            "properties": {"x": {"$dynamicRef": "#/$defs/s"}},
            "required": ["x"],
            "$defs": {"s": I},
        },
        [("$dynamicRef", "$.properties.x")],
        '{"x": "s"}',
    ),
    (
        "ref_to_anchor",
        {
            "$defs": {"s": {"$anchor": "foo", "type": "integer"}},
            "type": "object",
            "properties": {"x": {"$ref": "#foo"}},
            "required": ["x"],
        },
        [("$ref", "$.properties.x")],
        '{"x": "s"}',
    ),
    (
        "propertyNames_no_unevaluated",
        {"type": "object", "propertyNames": {"maxLength": 2}, "unevaluatedProperties": False},
        [("unevaluatedProperties", "$")],
        '{"ab": 1}',
    ),
    ("oneOf_sibling", {"oneOf": [I, {"type": "string"}], "maxLength": 1}, [("maxLength", "$")], '"ab"'),
    (
        "ref_before_const",
        {"$ref": "#/$defs/a", "$defs": {"a": {"const": 1}}, "const": 2},
        [("const", "$")],
        "1",
    ),
    (
        "nested_path",
        {
            "type": "object",
            "properties": {
                "a b": {
                    "type": "array",
                    "items": {"anyOf": [{"type": "array", "items": I, "uniqueItems": True}]},
                }
            },
            "required": ["a b"],
        },
        [("uniqueItems", '$.properties["a b"].items.anyOf[0]')],
        '{"a b": [[2, 2]]}',
    ),
]

# (id, schema, a violating value the grammar rejects, a valid value it accepts)
ENFORCED = [
    ("length", {"type": "string", "minLength": 2, "maxLength": 3}, '"abcd"', '"abc"'),
    ("pattern", {"type": "string", "pattern": "^a+$"}, '"b"', '"aa"'),
    ("format_email", {"type": "string", "format": "email"}, '"nope"', '"a@b.co"'),
    ("format_date", {"type": "string", "format": "date"}, '"2024-13-01"', '"2024-01-31"'),
    (
        "format_nonstandard_with_length",
        {"type": "string", "format": "password", "maxLength": 3},
        '"abcd"',
        '"ab"',
    ),
    ("integer_range", {"type": "integer", "minimum": 1, "maximum": 5}, "6", "5"),
    ("number_exclusive", {"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 5}, "5", "4.5"),
    ("integer_multipleOf", {"type": "integer", "multipleOf": 3}, "4", "6"),
    (
        "integer_multipleOf_range",
        {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 9999},
        "4",
        "9999",
    ),
    (
        "integer_multipleOf_exclusive",
        {"type": "integer", "multipleOf": 3, "exclusiveMinimum": 0, "exclusiveMaximum": 10},
        "4",
        "9",
    ),
    ("integer_multipleOf_whole_float", {"type": "integer", "multipleOf": 2.0}, "3", "4"),
    ("items_count", {"type": "array", "items": I, "minItems": 1, "maxItems": 3}, "[1, 2, 3, 4]", "[1, 2]"),
    (
        "prefixItems",
        {"type": "array", "prefixItems": [{"type": "string"}], "items": False},
        '["a", 1]',
        '["a"]',
    ),
    (
        "uniqueItems_one_item",
        {"type": "array", "items": I, "uniqueItems": True, "maxItems": 1},
        "[1, 1]",
        "[1]",
    ),
    (
        "required",
        {"type": "object", "properties": {"a": I, "b": I}, "required": ["a"]},
        '{"b": 1}',
        '{"a": 1}',
    ),
    (
        "min_max_properties",
        {"type": "object", "properties": {"a": I, "b": I}, "minProperties": 1, "maxProperties": 1},
        '{"a": 1, "b": 2}',
        '{"b": 2}',
    ),
    (
        "additionalProperties",
        {"type": "object", "properties": {"a": I}, "additionalProperties": {"type": "string"}},
        '{"a": 1, "c": 1}',
        '{"a": 1, "c": "x"}',
    ),
    (
        "propertyNames",
        {
            "type": "object",
            "properties": {"ab": I},
            "propertyNames": {"maxLength": 2},
            "additionalProperties": I,
        },
        '{"ab": 1, "xyz": 2}',
        '{"ab": 1, "x": 2}',
    ),
    (
        "patternProperties",
        {"type": "object", "properties": {"a": I}, "patternProperties": {"^x": I}},
        '{"a": "s"}',
        '{"a": 1}',
    ),
    (
        "unevaluatedItems",
        {"type": "array", "prefixItems": [{"type": "string"}], "unevaluatedItems": I},
        '["a", "b"]',
        '["a", 1]',
    ),
    (
        "unevaluatedProperties",
        {"type": "object", "properties": {"a": I}, "unevaluatedProperties": {"type": "string"}},
        '{"a": 1, "c": 1}',
        '{"a": 1, "c": "x"}',
    ),
    ("ref", {"$defs": _DEFS, "$ref": "#/$defs/s"}, '"abcde"', '"ab"'),
    ("anyOf", {"anyOf": [{"type": "string", "maxLength": 1}, {"type": "integer", "minimum": 3}]}, "2", "3"),
    ("allOf_single", {"allOf": [{"type": "integer", "minimum": 3}]}, "1", "4"),
    ("oneOf_types", {"oneOf": [I, {"type": "string"}]}, "true", "1"),
    ("oneOf_values", {"oneOf": [{"enum": ["a", "b"]}, {"const": "c"}]}, '"d"', '"c"'),
    ("oneOf_discriminated", _PETS, '{"kind": "cat", "good": true}', '{"kind": "cat", "lives": 3}'),
    ("enum_sibling_satisfied", {"type": "string", "enum": ["ab", "x"], "maxLength": 2}, '"y"', '"ab"'),
    ("type_list", {"type": ["string", "null"], "maxLength": 2}, '"abc"', "null"),
]

# Keywords that constrain nothing: never refused (and the schema compiles).
VACUOUS = [
    {"type": "array", "items": I, "uniqueItems": False},
    {"type": "array", "items": True, "minItems": 0, "minContains": 2},
    {
        "type": "string",
        "title": "t",
        "description": "d",
        "examples": ["x"],
        "default": "x",
        "$comment": "c",
        "deprecated": True,
        "readOnly": True,
        "writeOnly": False,
        "format": "password",
    },
    {"type": "integer", "maxLength": 3, "uniqueItems": True, "required": ["a"], "pattern": "x"},
    {
        "type": "object",
        "properties": {},
        "additionalProperties": True,
        "required": [],
        "dependentRequired": {},
    },
    {"type": "integer", "then": {"maximum": 1}},
    {"$ref": "#/$defs/s", "$defs": _DEFS, "description": "a string"},
]


@pytest.fixture(scope="module")
def compiler():
    vocab = [chr(c) for c in range(32, 127)] + ["\n", "\t", "\x01", "  "]
    return BoundedGrammarCompiler(xgr.GrammarCompiler(xgr.TokenizerInfo(encoded_vocab=vocab)), 16)


def _valid(schema, text) -> bool:
    return jsonschema.validators.validator_for(schema)(
        schema, format_checker=jsonschema.FormatChecker()
    ).is_valid(json.loads(text))


def _failing_keywords(schema, text) -> set[str]:
    """The keywords of ``schema``'s root object that ``text`` fails."""
    validator = jsonschema.validators.validator_for(schema)(schema, format_checker=jsonschema.FormatChecker())
    return {str(e.relative_schema_path[0]) for e in validator.iter_errors(json.loads(text))}


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_keywords_are_ignored_by_xgrammar_and_named(compiler, case):
    _, schema, expected, text = case
    grammar = compiler.compile_json_schema(json.dumps(schema)).grammar
    assert accepts(grammar, text)  # xgrammar (as compiled for V4.1) lets the violation through
    assert not _valid(schema, text)  # ... which jsonschema rejects
    assert [(p.keyword, p.path) for p in unenforced(schema)] == expected


def test_refused_keywords_are_what_jsonschema_objects_to():
    """Each case's value fails on the refused keyword itself, where it sits at the root
    (nested ones fail through the applicator that holds them)."""
    for name, schema, expected, text in REFUSED:
        failing = {"if" if k in ("then", "else") else k for k in _failing_keywords(schema, text)}
        at_root = {k for k, path in expected if path == "$"}
        assert failing and (failing <= at_root if at_root else True), (name, failing)


@pytest.mark.parametrize("case", ENFORCED, ids=[c[0] for c in ENFORCED])
def test_enforced_keywords_hold_in_the_grammar(compiler, case):
    _, schema, bad, good = case
    grammar = compiler.compile_json_schema(json.dumps(schema)).grammar
    assert not _valid(schema, bad) and not accepts(grammar, bad)
    assert _valid(schema, good) and accepts(grammar, good)
    assert unenforced(schema) == []


@pytest.mark.parametrize("schema", VACUOUS, ids=range(len(VACUOUS)))
def test_keywords_that_constrain_nothing_are_not_refused(compiler, schema):
    compiler.compile_json_schema(json.dumps(schema))
    assert unenforced(schema) == []


FORMATS = [  # (format, an instance, a non-instance)
    ("email", "a@b.co", "nope"),
    ("date", "2024-01-31", "2024-1-1"),
    ("time", "12:30:00Z", "noon"),
    ("date-time", "2024-01-31T12:30:00Z", "2024"),
    ("duration", "P1D", "1D"),
    ("ipv4", "1.2.3.4", "1.2.3"),
    ("ipv6", "::1", "x"),
    ("hostname", "example.com", "-bad-"),
    ("uuid", "123e4567-e89b-12d3-a456-426614174000", "123"),
    ("uri", "http://a.b/c", "no scheme"),
    ("uri-reference", "/a/b", "a b"),
    ("uri-template", "http://a/{x}", "{"),
    ("json-pointer", "/a/b", "a"),
    ("relative-json-pointer", "0/a", "/a"),
    ("idn-email", "a@b.co", "nope"),
    ("idn-hostname", "example.com", "-bad-"),
    ("iri", "http://a", "x y"),
    ("iri-reference", "/a", "a b"),
    ("regex", "a+", "("),
]


@pytest.mark.parametrize(("fmt", "good", "bad"), FORMATS, ids=[f[0] for f in FORMATS])
def test_formats_xgrammar_lacks_are_refused(compiler, fmt, good, bad):
    """The formats of ``SUPPORTED_FORMATS`` hold in the grammar; the other standard ones
    admit any string and are refused."""
    from deepinfer_vllm.patch.schema_keywords import SUPPORTED_FORMATS

    schema = {"type": "string", "format": fmt}
    grammar = compiler.compile_json_schema(json.dumps(schema)).grammar
    assert accepts(grammar, json.dumps(good))
    enforced = not accepts(grammar, json.dumps(bad))
    assert enforced == (fmt in SUPPORTED_FORMATS)
    assert [(p.keyword, p.path) for p in unenforced(schema)] == ([] if enforced else [("format", "$")])


def test_common_schemas_are_not_refused(compiler):
    """Pydantic's schemas (optional fields, literals, nested models, a discriminated
    union, constrained numbers and strings) and the schemas of ``tests/e2e``."""
    from typing import Literal, Optional, Union

    from pydantic import BaseModel, Field

    class Address(BaseModel):
        city: str = Field(max_length=24, description="City")
        zip: Optional[str] = Field(default=None, pattern=r"^[0-9]{5}$")

    class Cat(BaseModel):
        kind: Literal["cat"]
        lives: int = Field(ge=1, le=9)

    class Dog(BaseModel):
        kind: Literal["dog"]
        good: bool

    class Person(BaseModel):
        name: str = Field(min_length=1, max_length=16)
        age: int = Field(ge=0, le=120)
        homepage: str = Field(json_schema_extra={"format": "uri"})
        tags: list[str] = Field(default_factory=list, max_length=3)
        address: Address
        pet: Union[Cat, Dog] = Field(discriminator="kind")
        mood: Literal["happy", "sad"] = "happy"

    schema = Person.model_json_schema()
    compiler.compile_json_schema(json.dumps(schema))
    assert unenforced(schema) == []
    e2e = {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 10},
            "author": {
                "type": "object",
                "properties": {
                    "first": {"type": "string", "maxLength": 6},
                    "born": {"type": "integer", "minimum": 1900, "maximum": 2026},
                },
                "required": ["first", "born"],
                "additionalProperties": False,
            },
            "pages": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 999}, {"type": "null"}]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
            "unit": {"type": "string", "enum": ["c", "f"]},
        },
        "required": ["title", "author", "pages"],
        "additionalProperties": False,
    }
    assert unenforced(e2e) == []


def test_json_paths():
    assert json_path([]) == "$"
    assert (
        json_path(["properties", "a b", "items", "anyOf", 0, "$defs"])
        == '$.properties["a b"].items.anyOf[0].$defs'
    )


# -- where the plugin refuses ------------------------------------------------------------


def _model_config(model_type: str):
    return types.SimpleNamespace(
        is_diffusion=False, hf_config=types.SimpleNamespace(model_type=model_type, architectures=[])
    )


def _validate(tokenizer, model_type: str, backend: str, schema=None, structural_tag=None):
    """vLLM's request validation (``SamplingParams._validate_structured_outputs``) of a
    JSON-schema request: the backend it picks, or the error text."""
    from vllm import SamplingParams
    from vllm.config import StructuredOutputsConfig
    from vllm.sampling_params import StructuredOutputsParams

    from deepinfer_vllm import register

    register()
    so = (
        StructuredOutputsParams(json=schema)
        if schema is not None
        else StructuredOutputsParams(structural_tag=structural_tag)
    )
    params = SamplingParams(max_tokens=8, structured_outputs=so)
    try:
        params._validate_structured_outputs(
            _model_config(model_type), StructuredOutputsConfig(backend=backend), tokenizer
        )
    except Exception as e:  # noqa: BLE001
        return f"error: {type(e).__name__}: {e}"
    return params.structured_outputs._backend


TAGS = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": I, "uniqueItems": True}},
    "required": ["tags"],
}
UNTYPED = {"type": "object", "properties": {"tags": {"items": I, "uniqueItems": True}}, "required": ["tags"]}
EMAIL = {
    "type": "object",
    "properties": {"email": {"type": "string", "format": "email", "maxLength": 30}},
    "required": ["email"],
}
PLAIN = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}}, "required": ["name"]}


@pytest.mark.parametrize("backend", ["auto", "xgrammar"])
def test_v41_json_schema_requests_name_the_keyword_and_path(v41_tokenizer, backend):
    for schema, keyword, path in [
        (TAGS, "uniqueItems", "$.properties.tags"),
        (UNTYPED, "uniqueItems", "$.properties.tags"),  # vLLM's own check misses it (no `type`)
        (EMAIL, "maxLength", "$.properties.email"),
    ]:
        outcome = _validate(v41_tokenizer, "deepseek_v41", backend, schema)
        assert outcome.startswith("error: VLLMValidationError") and f"`{keyword}` at {path}" in outcome, (
            outcome
        )
    assert _validate(v41_tokenizer, "deepseek_v41", backend, PLAIN) == "xgrammar"


def test_v41_schemas_stay_on_xgrammar(v41_tokenizer):
    """vLLM's ``auto`` sends an integer ``multipleOf`` to guidance (other models), though
    xgrammar enforces it (``ENFORCED``); V4.1 keeps it on xgrammar, and a schema xgrammar
    cannot compile is a 400 instead of a guidance request."""
    multiple = {"type": "integer", "multipleOf": 3}
    assert _validate(v41_tokenizer, "llama", "auto", multiple) == "guidance"
    assert _validate(v41_tokenizer, "deepseek_v41", "auto", multiple) == "xgrammar"
    fractional_bound = {"type": "integer", "minimum": 1.5}
    assert _validate(v41_tokenizer, "llama", "auto", fractional_bound) == "guidance"
    outcome = _validate(v41_tokenizer, "deepseek_v41", "auto", fractional_bound)
    assert outcome == (
        "error: VLLMValidationError: The grammar backend (xgrammar) cannot compile this JSON schema: "
        "Integer constraint must be a whole number (parameter=response_format)"
    ), outcome


@pytest.mark.parametrize("backend", ["auto", "xgrammar"])
def test_other_models_keep_vllms_validation(v41_tokenizer, backend):
    from vllm import SamplingParams

    from deepinfer_vllm import register

    register()
    patched = SamplingParams._validate_structured_outputs
    for schema in (TAGS, UNTYPED, EMAIL, PLAIN):
        ours = _validate(v41_tokenizer, "llama", backend, schema)
        SamplingParams._validate_structured_outputs = patched.__wrapped__
        try:
            stock = _validate(v41_tokenizer, "llama", backend, schema)
        finally:
            SamplingParams._validate_structured_outputs = patched
        assert ours == stock, (schema, ours, stock)
    assert _validate(v41_tokenizer, "llama", "auto", UNTYPED) == "xgrammar"  # stock: silently dropped


def test_json_schemas_inside_structural_tags_are_checked(v41_tokenizer):
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<a>",
            "content": {"type": "json_schema", "json_schema": TAGS},
            "end": "</a>",
        },
    }
    outcome = _validate(v41_tokenizer, "deepseek_v41", "auto", structural_tag=json.dumps(tag))
    assert "`uniqueItems` at $.properties.tags" in outcome, outcome
    tag["format"]["content"]["json_schema"] = PLAIN
    assert _validate(v41_tokenizer, "deepseek_v41", "auto", structural_tag=json.dumps(tag)) == "xgrammar"


# -- tool parameters (DSML arguments) ------------------------------------------------------


def _tool(parameters, strict=None, name="f"):
    function = {"name": name, "parameters": parameters}
    if strict is not None:
        function["strict"] = strict
    return {"type": "function", "function": function}


def _tag(parser_cls, tools, tool_choice="required"):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    request = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=tools, tool_choice=tool_choice
    )
    return object.__new__(parser_cls).get_structural_tag(request)


def _dsml(arguments, name="f"):
    from vllm.tokenizers import deepseek_v41_encoding as enc

    call = enc.tool_call_template.format(
        dsml_token=enc.dsml_token,
        tool_call_tag_name=enc.tool_call_tag_name,
        name=name,
        arguments=enc.encode_arguments_to_dsml({"arguments": arguments}),
    )
    return "\n\n" + enc.tool_calls_template.format(
        dsml_token=enc.dsml_token, tc_block_name=enc.tool_calls_block_name, tool_calls=call
    )


TOOL_CASES = [
    ("uniqueItems", TAGS, {"tags": [1, 1]}, "uniqueItems", "$.properties.tags"),
    (
        "format_maxLength",
        EMAIL,
        {"email": "abcdefghijklmnopqrstuvwxyz01234@b.co"},
        "maxLength",
        "$.properties.email",
    ),
    (
        "enum_sibling",
        {
            "type": "object",
            "properties": {"u": {"type": "string", "enum": ["abc", "x"], "maxLength": 2}},
            "required": ["u"],
        },
        {"u": "abc"},
        "maxLength",
        "$.properties.u",
    ),
    (
        "dependentRequired",
        {"type": "object", "properties": {"a": I, "b": I}, "dependentRequired": {"a": ["b"]}},
        {"a": 1},
        "dependentRequired",
        "$",
    ),
]


@pytest.mark.parametrize("case", TOOL_CASES, ids=[c[0] for c in TOOL_CASES])
def test_forced_tool_calls_refuse_keywords_the_dsml_grammar_ignores(compiler, case):
    from vllm.exceptions import VLLMValidationError
    from vllm.tool_parsers.deepseekv41_engine_tool_parser import DeepSeekV41EngineToolParser

    from deepinfer_vllm.entrypoints.tool_parser import DeepSeekV41ToolParser

    _, parameters, arguments, keyword, path = case
    # vLLM's parser with the tool strict: the grammar V4.1 would run lets the violation through
    stock = _tag(DeepSeekV41EngineToolParser, [_tool(parameters, strict=True)])
    grammar = compiler.compile_structural_tag(json.dumps(stock.model_dump())).grammar
    assert accepts(grammar, _dsml(arguments))
    assert not _valid(parameters, json.dumps(arguments))
    with pytest.raises(VLLMValidationError) as refused:
        _tag(
            DeepSeekV41ToolParser,
            [_tool({"type": "object", "properties": {"n": I}}, name="ok"), _tool(parameters)],
        )
    message = str(refused.value)
    assert "tool 'f'" in message and f"`{keyword}` at {path}" in message and "'ok'" not in message, message
    # the way out: a non-strict tool's arguments are not in the grammar, nothing to refuse
    assert _tag(DeepSeekV41ToolParser, [_tool(parameters, strict=False)]) is not None
    assert _tag(DeepSeekV41ToolParser, [_tool(parameters)], tool_choice="auto") is None  # vLLM's auto
