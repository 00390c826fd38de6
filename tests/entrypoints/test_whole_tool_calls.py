"""Only whole tool calls (``entrypoints/tool_parser.py``, "Only whole calls"): a DSML call
that the output cuts off (``max_tokens``) is left out of the parsed calls and never
streamed, and every call before the cut comes back whole, streamed or not.

The outputs are V4.1 DSML text rendered by vLLM's own V4.1 encoder, tokenized with
the checkpoint's tokenizer, and cut after every token; the parser is composed the way
vLLM's OpenAI server composes it (``ParserManager.get_parser``). The reference for each
cut is independent of the parser: the calls whose ``</｜DSML｜ invoke>`` the cut text
holds, with the arguments they were rendered from."""

from __future__ import annotations

import json

import jsonschema
import pytest
import vllm  # noqa: F401  (vLLM's import order)
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tokenizers import deepseek_v41_encoding as enc
from vllm.tool_parsers.deepseekv41_engine_tool_parser import DeepSeekV41EngineToolParser

from deepinfer_vllm.entrypoints.tool_parser import DeepSeekV41ToolParser

INVOKE_END = "</｜DSML｜ invoke>"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 24},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                },
                "required": ["city", "days", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "safe": {"type": "boolean"}},
                "required": ["query", "safe"],
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CALLS = [
    ("get_weather", {"city": "Paris", "days": 3, "unit": "c"}),
    ("add", {"a": 1.5, "b": -2}),
    ("search", {"query": "hotels near the sea", "safe": True}),
]
REASONING = "The user wants weather, a sum and a search."


def dsml(calls) -> str:
    """What V4.1 writes for ``calls`` (vLLM's V4.1 chat encoder, ``deepseek_v41_encoding``)."""
    body = "\n".join(
        enc.tool_call_template.format(
            dsml_token=enc.dsml_token,
            tool_call_tag_name=enc.tool_call_tag_name,
            name=name,
            arguments=enc.encode_arguments_to_dsml({"arguments": arguments}),
        )
        for name, arguments in calls
    )
    return "\n\n" + enc.tool_calls_template.format(
        dsml_token=enc.dsml_token, tc_block_name=enc.tool_calls_block_name, tool_calls=body
    )


def _parser_cls(tool_parser_cls):
    """The ``Parser`` vLLM's server builds for ``--reasoning-parser deepseek_v41
    --tool-call-parser deepseek_v41 --enable-auto-tool-choice`` with ``tool_parser_cls``
    as the tool parser (``ParserManager._compose_parser``)."""
    from vllm.parser.parser_manager import ParserManager
    from vllm.tool_parsers import ToolParserManager

    from deepinfer_vllm import register

    register()
    saved = ToolParserManager.tool_parsers.get("deepseek_v41")
    ToolParserManager.tool_parsers["deepseek_v41"] = tool_parser_cls
    try:
        cls = ParserManager.get_parser(
            tool_parser_name="deepseek_v41", reasoning_parser_name="deepseek_v41", enable_auto_tools=True
        )
    finally:
        if saved is None:
            ToolParserManager.tool_parsers.pop("deepseek_v41")
        else:
            ToolParserManager.tool_parsers["deepseek_v41"] = saved
    assert cls.tool_parser_cls is tool_parser_cls
    return cls


@pytest.fixture(scope="module")
def served_parser_cls():
    from vllm.parser.parser_manager import ParserManager

    from deepinfer_vllm import register

    register()
    cls = ParserManager.get_parser(
        tool_parser_name="deepseek_v41", reasoning_parser_name="deepseek_v41", enable_auto_tools=True
    )
    assert cls.tool_parser_cls is DeepSeekV41ToolParser  # what the server runs
    return cls


def _request(tool_choice="required"):
    return ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": "Plan a trip."}],
        tools=TOOLS,
        tool_choice=tool_choice,
    )


class Output:
    """A model output as vLLM's server sees it: token ids, the text of each prefix
    (the incremental detokenizer's deltas) and the prompt."""

    def __init__(self, tokenizer, thinking: bool):
        self.tokenizer = tokenizer
        self.thinking = thinking
        text = (REASONING + "</think>" if thinking else "") + dsml(CALLS)
        self.ids = tokenizer.encode(text, add_special_tokens=False)
        self.prefixes = [tokenizer.decode(self.ids[:k]) for k in range(len(self.ids) + 1)]
        assert self.prefixes[-1] == text
        opener = "<think>" if thinking else "</think>"
        self.prompt_ids = tokenizer.encode(
            f"<｜User｜>Plan a trip.<｜Assistant｜>{opener}", add_special_tokens=False
        )

    def parser(self, parser_cls, request):
        return parser_cls(
            self.tokenizer, request.tools, chat_template_kwargs={"thinking": self.thinking}, model_config=None
        )

    def expected(self, k: int):
        """The calls whose end tag the first ``k`` tokens hold (independent of the parser)."""
        return CALLS[: self.prefixes[k].count(INVOKE_END)]

    def parse(self, parser_cls, request, k: int):
        reasoning, content, calls = self.parser(parser_cls, request).parse(
            self.prefixes[k], request, enable_auto_tools=True, model_output_token_ids=self.ids[:k]
        )
        return reasoning, content, [(c.name, c.arguments) for c in calls or []]

    def stream(self, parser_cls, request, k: int, chunk: int = 1):
        """Stream the first ``k`` tokens ``chunk`` at a time, as the server does (the last
        delta says ``finished``). Returns ``(reasoning, content, calls, events)`` with
        ``events`` the ``(text streamed so far, delta)`` pairs."""
        parser = self.parser(parser_cls, request)
        events = []
        for start in range(0, k, chunk):
            end = min(start + chunk, k)
            delta = parser.parse_delta(
                self.prefixes[end][len(self.prefixes[start]) :],
                self.ids[start:end],
                request,
                prompt_token_ids=self.prompt_ids,
                finished=end == k,
            )
            events.append((self.prefixes[end], delta))
        reasoning, content, calls = "", "", {}
        for _, delta in events:
            if delta is None:
                continue
            reasoning += delta.reasoning or ""
            content += delta.content or ""
            for call in delta.tool_calls:
                name, args = calls.get(call.index, ("", ""))
                calls[call.index] = (
                    name + (call.function.name or ""),
                    args + (call.function.arguments or ""),
                )
        return reasoning, content, [calls[i] for i in sorted(calls)], events


@pytest.fixture(scope="module", params=[False, True], ids=["no_thinking", "thinking"])
def output(request, v41_tokenizer):
    return Output(v41_tokenizer, thinking=request.param)


def _check_calls(got, expected, where):
    assert [name for name, _ in got] == [name for name, _ in expected], where
    for (name, arguments), (_, reference) in zip(got, expected, strict=True):
        value = json.loads(arguments)
        assert value == reference, where
        jsonschema.validate(value, SCHEMAS[name])


def test_vllms_parser_returns_and_streams_a_cut_call(output):
    """What the plugin corrects: vLLM 0.32's V4.1 parser, cut inside the second call's
    arguments, returns that call with the arguments parsed so far (failing the tool's
    schema), and streams its name before its end tag."""
    stock = _parser_cls(DeepSeekV41EngineToolParser)
    request = _request()
    second_name = output.prefixes[-1].index('name="add"')
    k = next(k for k, text in enumerate(output.prefixes) if len(text) > second_name + 40)  # inside `a`/`b`
    assert output.prefixes[k].count(INVOKE_END) == 1
    _, _, calls = output.parse(stock, request, k)
    assert [name for name, _ in calls] == ["get_weather", "add"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(calls[1][1]), SCHEMAS["add"])
    _, _, streamed, events = output.stream(stock, request, k)
    assert [name for name, _ in streamed] == ["get_weather", "add"]
    early = [
        text.count(INVOKE_END)
        for text, delta in events
        if delta is not None
        for call in delta.tool_calls
        if call.index == 1 and call.function.name
    ]
    assert early == [1]  # the second call's name went out while only the first had closed


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_a_cut_call_is_left_out_and_whole_calls_are_kept(served_parser_cls, output, tool_choice):
    """Non-streamed, cut after every token: exactly the closed calls, each with its whole
    arguments; the reasoning is the reasoning written so far."""
    request = _request(tool_choice)
    for k in range(len(output.ids) + 1):
        reasoning, content, calls = output.parse(served_parser_cls, request, k)
        where = f"k={k} {output.prefixes[k]!r}"
        _check_calls(calls, output.expected(k), where)
        assert not (content or "").strip(), where  # no cut markup as text either
        if output.thinking and "</think>" in output.prefixes[k]:
            assert reasoning == REASONING, where


@pytest.mark.parametrize(
    ("chunk", "tool_choice"),
    [(1, "required"), (3, "required"), (1, {"type": "function", "function": {"name": "add"}})],
    ids=["token_by_token", "three_tokens", "named"],
)
def test_streamed_calls_are_sent_whole_once_closed(served_parser_cls, output, chunk, tool_choice):
    """Streamed, cut after every token: no delta names a call before its end tag has
    been streamed, each call goes out in one delta (id, name, complete arguments), and
    the calls received are exactly the closed ones."""
    request = _request(tool_choice)
    for k in range(len(output.ids) + 1):
        reasoning, content, calls, events = output.stream(served_parser_cls, request, k, chunk)
        where = f"k={k} chunk={chunk} {output.prefixes[k]!r}"
        seen = set()
        for text, delta in events:
            for call in delta.tool_calls if delta is not None else []:
                assert call.index < text.count(INVOKE_END), where  # held back until closed
                assert call.index not in seen and call.id and call.function.name, where  # whole, once
                json.loads(call.function.arguments)
                seen.add(call.index)
        _check_calls(calls, output.expected(k), where)
        assert not content.strip(), where
        if output.thinking and "</think>" in output.prefixes[k]:
            assert reasoning == REASONING, where


def test_streamed_and_non_streamed_calls_agree(served_parser_cls, output):
    """The whole output: the three calls, the same ids' arguments either way."""
    request = _request()
    _, _, parsed = output.parse(served_parser_cls, request, len(output.ids))
    _, _, streamed, _ = output.stream(served_parser_cls, request, len(output.ids))
    assert parsed == streamed
    _check_calls(parsed, CALLS, "whole output")
