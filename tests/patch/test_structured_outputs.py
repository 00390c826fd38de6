"""``patch.structured_outputs``: bounded grammars against xgrammar itself (what the stock
compile lets through, what ours refuses, and that valid text stays accepted), and the vLLM
internals the patch wraps. The request validation it wraps (V4.1 keywords refused, V4.1
schemas kept on xgrammar, other models on vLLM's stock validation) is tested with the
keyword catalogue, in ``tests/entrypoints/test_schema_keywords.py``."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json

import pytest
import vllm  # noqa: F401  (vLLM's import order: transformers' circular import otherwise)
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

from deepinfer_vllm.patch.structured_outputs import (
    BoundedGrammarCompiler,
    bounded_string_pattern,
    grammar_schema,
)

NAME = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}}, "required": ["name"]}


@pytest.fixture(scope="module")
def compiler():
    vocab = [chr(c) for c in range(32, 127)] + ["\n", "\t", "\x01", "  "]
    return xgr.GrammarCompiler(xgr.TokenizerInfo(encoded_vocab=vocab))


def _bounded(compiler, max_whitespace=16):
    return BoundedGrammarCompiler(compiler, max_whitespace)


def test_grammar_schema_rewrites_every_bounded_string_and_leaves_the_input_alone():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "maxLength": 4},
            "b": {"type": "array", "items": {"type": "string", "minLength": 2}},
            "c": {"anyOf": [{"type": "string", "minLength": 1, "maxLength": 3}, {"type": "null"}]},
            "d": {"type": "string", "maxLength": 9, "pattern": "^x+$"},
            "e": {"type": "string", "enum": ["yes", "no"], "maxLength": 3},
            "f": {"type": "string"},
            "type": {"type": "integer"},
        },
        "$defs": {"g": {"type": "string", "maxLength": 7}},
    }
    original = copy.deepcopy(schema)
    out = grammar_schema(schema)
    assert schema == original
    props = out["properties"]
    assert props["a"] == {"type": "string", "pattern": bounded_string_pattern(0, 4)}
    assert props["b"]["items"] == {"type": "string", "pattern": bounded_string_pattern(2, None)}
    assert props["c"]["anyOf"][0] == {"type": "string", "pattern": bounded_string_pattern(1, 3)}
    assert props["d"] == original["properties"]["d"]  # a pattern already pins the text
    assert props["e"] == original["properties"]["e"]
    assert props["f"] == {"type": "string"} and props["type"] == {"type": "integer"}
    assert out["$defs"]["g"] == {"type": "string", "pattern": bounded_string_pattern(0, 7)}
    assert bounded_string_pattern(0, 4) == '^[^"\\\\\\x00-\\x1f]{0,4}$'


def test_stock_bounded_strings_admit_control_characters_and_ours_do_not(compiler):
    stock = compiler.compile_json_schema(json.dumps(NAME)).grammar
    ours = _bounded(compiler).compile_json_schema(json.dumps(NAME)).grammar
    raw_control = '{"name": "a\x01b"}'
    assert accepts(stock, raw_control)  # xgrammar 0.2.8's gap: invalid JSON accepted
    with pytest.raises(json.JSONDecodeError):
        json.loads(raw_control)
    assert not accepts(ours, raw_control)
    for text, ok in [
        ('{"name": "abcde"}', True),
        ('{"name": ""}', True),
        ('{"name": "abcdef"}', False),
        ('{"name": "a\tb"}', False),
        ('{"name": "a\\"b"}', False),
    ]:
        assert accepts(ours, text) is ok, text
        assert accepts(stock, text) is ok or text == '{"name": "a\tb"}', text


def test_whitespace_runs_are_capped(compiler):
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    stock = compiler.compile_json_schema(schema).grammar
    ours = _bounded(compiler, 4).compile_json_schema(schema).grammar
    assert accepts(stock, "{" + " " * 40 + '"n": 1}')
    assert accepts(ours, "{" + " " * 4 + '"n": 1}')
    assert not accepts(ours, "{" + " " * 5 + '"n": 1}')
    compact = (
        _bounded(compiler, 4).compile_json_schema(schema, any_whitespace=False, separators=(",", ":")).grammar
    )
    assert accepts(compact, '{"n":1}') and not accepts(compact, '{ "n":1}')  # vLLM's compact mode kept


def test_json_object_requests_are_bounded_too(compiler):
    ours = _bounded(compiler, 2).compile_json_schema('{"type": "object"}').grammar
    assert accepts(ours, '{"k": [1, 2]}')
    assert not accepts(ours, '{"k":   1}')
    assert not accepts(ours, '{"k": "a\x01"}')  # unbounded strings were right already


def test_structural_tags_bound_json_and_xml_arguments(compiler):
    json_format = {"type": "json_schema", "json_schema": NAME}
    xml_format = {"type": "json_schema", "style": "deepseek_v4_1_xml", "json_schema": NAME}
    for content, good, padded, control in [
        (
            json_format,
            '<a>{"name": "ab"}</a>',
            "<a>{" + " " * 8 + '"name": "ab"}</a>',
            '<a>{"name": "a\x01"}</a>',
        ),
        (
            xml_format,
            '<a><｜DSML｜ parameter name="name" string="true">ab</｜DSML｜ parameter></a>',
            "<a>" + " " * 8 + '<｜DSML｜ parameter name="name" string="true">ab</｜DSML｜ parameter></a>',
            None,
        ),
    ]:
        tag = json.dumps(
            {
                "type": "structural_tag",
                "format": {"type": "tag", "begin": "<a>", "content": content, "end": "</a>"},
            }
        )
        stock = compiler.compile_structural_tag(tag).grammar
        ours = _bounded(compiler, 3).compile_structural_tag(tag).grammar
        assert accepts(stock, good) and accepts(ours, good)
        assert accepts(stock, padded) and not accepts(ours, padded)
        if control is not None:
            assert accepts(stock, control) and not accepts(ours, control)


def test_vllms_xgrammar_backend_compiles_with_its_own_compiler():
    """vLLM builds one ``xgr.GrammarCompiler`` per backend in ``__post_init__`` and compiles
    JSON schemas and structural tags through it, with xgrammar's defaults (no whitespace
    cap). When this fails, vLLM builds or calls the compiler another way: the wrap in
    ``__post_init__`` may no longer reach it."""
    import ast

    from vllm.v1.structured_output import backend_xgrammar

    # vLLM's own source (the class's methods may already be wrapped in this process).
    source = inspect.getsource(backend_xgrammar)
    (backend,) = [
        node for node in ast.parse(source).body
        if isinstance(node, ast.ClassDef) and node.name == "XgrammarBackend"
    ]
    methods = {
        node.name: ast.get_source_segment(source, node)
        for node in backend.body
        if isinstance(node, ast.FunctionDef)
    }
    post_init = methods["__post_init__"]
    assert "self.compiler = xgr.GrammarCompiler(" in post_init
    compile_grammar = methods["compile_grammar"]
    assert "self.compiler.compile_json_schema(" in compile_grammar
    assert "self.compiler.compile_structural_tag(" in compile_grammar
    assert "max_whitespace_cnt" not in compile_grammar


def test_structured_output_validation_hook():
    """The patch wraps ``SamplingParams._validate_structured_outputs`` (the front end's check)
    and pins ``_backend`` to xgrammar for V4.1."""
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    params = list(inspect.signature(SamplingParams._validate_structured_outputs).parameters)
    assert params == ["self", "model_config", "structured_outputs_config", "tokenizer"], params
    fields = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
    assert {"json", "structural_tag", "_backend", "_backend_was_auto"} <= fields, fields


def test_apply_wraps_both_once():
    from vllm.sampling_params import SamplingParams
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    from deepinfer_vllm.patch import structured_outputs

    structured_outputs.apply()
    validate, post_init = SamplingParams._validate_structured_outputs, XgrammarBackend.__post_init__
    structured_outputs.apply()  # idempotent
    assert SamplingParams._validate_structured_outputs is validate and XgrammarBackend.__post_init__ is post_init
    assert validate.__wrapped__.__module__ == "vllm.sampling_params"
