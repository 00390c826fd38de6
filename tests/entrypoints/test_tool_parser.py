"""``deepseek_v41`` tool parser (``entrypoints/tool_parser.py``): a forced call's grammar
holds the tool's argument schema (vLLM's stock parser holds only the name), ``auto`` and
an explicit ``strict: false`` are vLLM's behaviour, and vLLM's manager serves ours."""

from __future__ import annotations

import pytest
import vllm  # noqa: F401  (vLLM's import order)
import xgrammar as xgr
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers.deepseekv41_engine_tool_parser import DeepSeekV41EngineToolParser
from xgrammar.testing import _is_grammar_accept_string as accepts

from deepinfer_vllm.entrypoints.tool_parser import DeepSeekV41ToolParser, forces_call

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["a"],
        },
    },
}
ECHO = {
    "type": "function",
    "function": {
        "name": "echo",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string", "maxLength": 4}},
            "required": ["text"],
        },
    },
}


def _call(name: str, params: str) -> str:
    return (
        f'\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="{name}">\n{params}'
        "</｜DSML｜ invoke>\n</｜DSML｜ calls>"
    )


def _param(key: str, value: str, string: bool) -> str:
    kind = "true" if string else "false"
    return f'<｜DSML｜ parameter name="{key}" string="{kind}">{value}</｜DSML｜ parameter>\n'


def _grammar(parser_cls, tools, tool_choice):
    request = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=tools, tool_choice=tool_choice
    )
    parser = object.__new__(parser_cls)  # get_structural_tag reads class attributes only
    tag = parser.get_structural_tag(request)
    return None if tag is None else xgr.Grammar.from_structural_tag(tag)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_calls_hold_the_argument_schema(tool_choice):
    ours = _grammar(DeepSeekV41ToolParser, [ADD, ECHO], tool_choice)
    stock = _grammar(DeepSeekV41EngineToolParser, [ADD, ECHO], tool_choice)
    good = _call("add", _param("a", "7", string=False))
    missing = _call("add", "")
    out_of_range = _call("add", _param("a", "12", string=False))
    unknown = _call("add", _param("b", "1", string=False))
    assert accepts(ours, good) and accepts(stock, good)
    for bad in (missing, out_of_range, unknown):
        assert accepts(stock, bad), bad  # vLLM's parser: only the envelope and the name
        assert not accepts(ours, bad), bad
    if tool_choice == "required":
        assert accepts(ours, _call("echo", _param("text", "abcd", string=True)))
        assert not accepts(ours, _call("echo", _param("text", "abcde", string=True)))  # maxLength
    else:
        assert not accepts(ours, _call("echo", _param("text", "ab", string=True)))  # not the named tool


def test_explicit_strict_false_and_auto_are_vllms():
    loose = {"type": "function", "function": {**ADD["function"], "strict": False}}
    ours = _grammar(DeepSeekV41ToolParser, [loose], "required")
    assert accepts(ours, _call("add", ""))  # the caller asked for free arguments
    assert _grammar(DeepSeekV41ToolParser, [ADD], "auto") is None
    assert _grammar(DeepSeekV41EngineToolParser, [ADD], "auto") is None


def test_forces_call():
    assert forces_call("required")
    assert forces_call(
        ChatCompletionRequest(
            model="m", messages=[], tools=[ADD], tool_choice={"type": "function", "function": {"name": "add"}}
        ).tool_choice
    )
    assert not any(forces_call(choice) for choice in (None, "auto", "none"))


def test_vllms_manager_serves_our_parser():
    from vllm.tool_parsers import ToolParserManager

    from deepinfer_vllm import register

    register()
    assert ToolParserManager.get_tool_parser("deepseek_v41") is DeepSeekV41ToolParser


def test_a_schema_xgrammar_refuses_is_a_clear_error_naming_the_tool():
    from vllm.exceptions import VLLMValidationError

    lookbehind = {
        "type": "function",
        "function": {
            "name": "find",
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}},
                "required": ["x"],
            },
        },
    }
    with pytest.raises(VLLMValidationError, match=r"cannot compile it: 'find' \(.*strict.: false"):
        _grammar(DeepSeekV41ToolParser, [ADD, lookbehind], "required")
    loose = {"type": "function", "function": {**lookbehind["function"], "strict": False}}
    assert _grammar(DeepSeekV41ToolParser, [ADD, loose], "required") is not None  # the way out works
