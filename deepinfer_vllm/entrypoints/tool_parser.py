"""The ``deepseek_v41`` tool parser: vLLM's, with arguments pinned when a call is forced.

vLLM 0.32's V4.1 parser (``--tool-call-parser deepseek_v41``) parses DSML calls and
constrains them with xgrammar's ``deepseek_v4_1`` structural tag. Under vLLM's
default ``--tool-strict-level auto``, a tool's arguments join the grammar only
when the tool says ``strict: true``; otherwise only the call envelope and the
function name are constrained, and parameter names and values are free text in
the DSML syntax (calls with ``arguments: "{}"``, missing required parameters).

When ``tool_choice`` forces a call (``required``, a named function), a caller
has asked for a call it can run, so this parser treats every tool without an
explicit ``strict`` as strict: the arguments follow the tool's JSON schema inside
the DSML syntax (``deepseek_v4_1_xml`` style: strings raw, other values JSON).
An explicit ``strict: false`` is kept. ``tool_choice: "auto"`` is vLLM's
behaviour unchanged. The grammar itself is xgrammar's; its whitespace and string
bounds come from ``patch.structured_outputs.BoundedGrammarCompiler``.

With thinking on, vLLM applies the grammar after ``</think>`` (the reasoning
parser marks the end); ``thinking_token_budget`` bounds the thinking.

A schema keyword xgrammar would ignore in a forced call's arguments (``uniqueItems``,
``format`` with ``maxLength``, ...: ``patch.schema_keywords``) is a 400 naming the tool, the
keyword and its JSON path, as is a schema xgrammar cannot compile.

**Only whole calls.** vLLM 0.32's parser engine (``vllm/parser/engine``) treats the
end of the output as the end of an open call: ``StreamingParserEngine.finish()``
emits ``TOOL_CALL_END`` for a call still in its name or arguments, and
``ParserEngine._build_extracted_result`` lists every call slot, closed or not. A
call that ``max_tokens`` (or a stop string) cuts mid-way therefore came back as a
call, with the parameters parsed so far (``"{}"`` when none), which fail the tool's
schema; streamed, its name and first arguments had already gone out, since the
engine streams both before ``</｜DSML｜ invoke>``. This parser keeps a call only
once its end tag is parsed: non-streamed, an unclosed call is left out; streamed,
each call is held back and sent whole (id, name and complete arguments in one
delta) when it closes, so a cut call sends nothing (nor does an opening tag cut
short, which vLLM returns as text). Whole calls before the cut are kept, and
``finish_reason`` stays vLLM's ``length``.
"""

from __future__ import annotations

from typing import Any

from vllm.entrypoints.generate.base.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall
from vllm.parser.deepseek_v41 import DSML_INVOKE_PREFIX, DSML_TOOL_START, DeepSeekV41Parser
from vllm.parser.engine.events import EventType
from vllm.parser.engine.parser_engine import ParserEngine, ToolCallSlot
from vllm.parser.engine.parser_engine_config import ParserState
from vllm.parser.engine.streaming_parser_engine import StreamingParserEngine
from vllm.tool_parsers.deepseekv41_engine_tool_parser import DeepSeekV41EngineToolParser
from vllm.tool_parsers.tool_strict_level import ToolStrictLevel

PARSER_NAME = "deepseek_v41"


def forces_call(tool_choice: Any) -> bool:
    """``required`` or a named tool (Chat Completions or Responses spelling)."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return False
    return getattr(tool_choice, "mode", None) != "auto"


def _strict_by_default(tool: Any) -> Any:
    """``tool`` with ``strict=True`` when it leaves ``strict`` unset (a copy)."""
    function = getattr(tool, "function", None)
    if function is not None and hasattr(function, "strict"):
        if function.strict is None:
            return tool.model_copy(update={"function": function.model_copy(update={"strict": True})})
        return tool
    if hasattr(tool, "strict") and tool.strict is None:
        return tool.model_copy(update={"strict": True})
    return tool


_OPEN_CALL_STATES = (ParserState.TOOL_NAME, ParserState.TOOL_ARGS)


_DSML_OPENERS = (DSML_TOOL_START, DSML_INVOKE_PREFIX)


def _cut_opener(text: str) -> bool:
    """A DSML opening tag cut short (``<｜DSML｜`` is a special token: never prose)."""
    return text.startswith("<｜DSML｜") and any(o.startswith(text) and o != text for o in _DSML_OPENERS)


class _WholeCallsEngine(StreamingParserEngine):
    """vLLM's streaming engine, except that ``finish()`` does not close a call the
    output cut off: stock ``finish()`` appends a ``TOOL_CALL_END`` for a call still in
    its name or arguments. The lexer only holds back a proper prefix of a terminal,
    and no V4.1 terminal is a prefix of another, so the flush inside ``finish()``
    never completes ``</｜DSML｜ invoke>``: every end event it reports for such a
    call is the synthetic one. Likewise a calls/invoke opening tag cut short, which
    the flush would hand out as text, is dropped."""

    def finish(self):
        open_call = self.tool_index if self.state in _OPEN_CALL_STATES else None
        events = super().finish()
        return [
            e
            for e in events
            if not (e.type is EventType.TOOL_CALL_END and e.tool_index == open_call)
            and not (e.type is EventType.TEXT_CHUNK and _cut_opener(e.value))
        ]


class WholeCallsV41Parser(DeepSeekV41Parser):
    """vLLM's V4.1 parser engine that reports a tool call only once it has closed
    (module docstring, "Only whole calls")."""

    def __init__(self, tokenizer, tools=None, **kwargs):
        self._closed: set[int] = set()  # call slots whose end tag was parsed
        self._released: set[int] = set()  # closed calls already streamed
        super().__init__(tokenizer, tools, **kwargs)
        self._engine = _WholeCallsEngine(self.parser_engine_config, tokenizer, vocab=self.vocab)

    def _reset(self, initial_state=None) -> None:
        super()._reset(initial_state=initial_state)
        self._closed.clear()
        self._released.clear()

    def _handle_tool_end(self, event, deltas) -> None:
        if event.tool_index < len(self._tool_slots):
            self._closed.add(event.tool_index)
        super()._handle_tool_end(event, deltas)

    def _build_extracted_result(self, *deltas):
        return self._extract_from_slots(self._closed, *deltas)

    def _extract_from_slots(self, keep, *deltas):
        """vLLM's extraction over the slots in ``keep`` only (the others blanked, so
        indices and ids are unchanged)."""
        slots = self._tool_slots
        self._tool_slots = [slot if i in keep else ToolCallSlot() for i, slot in enumerate(slots)]
        try:
            return ParserEngine._build_extracted_result(self, *deltas)
        finally:
            self._tool_slots = slots

    def _events_to_delta(self, events, finished: bool = False):
        delta = super()._events_to_delta(events, finished=finished)
        # vLLM's tool-call deltas (name first, arguments as they parse) are dropped; a
        # call goes out whole, as non-streamed extraction would return it, once closed.
        calls = []
        for index in sorted(self._closed - self._released):
            self._released.add(index)
            for call in self._extract_from_slots({index}).tool_calls:
                calls.append(
                    DeltaToolCall(
                        index=index,
                        id=call.id,
                        type="function",
                        function=DeltaFunctionCall(
                            name=call.function.name, arguments=call.function.arguments
                        ),
                    )
                )
        fields = {}
        if delta is not None:
            fields = {key: getattr(delta, key) for key in delta.model_fields_set if key != "tool_calls"}
        if calls:
            fields["tool_calls"] = calls
        return DeltaMessage(**fields) if fields else None


class DeepSeekV41ToolParser(DeepSeekV41EngineToolParser):
    """vLLM's V4.1 DSML tool parser; forced calls get their arguments' schema, and
    only whole calls are returned or streamed (module docstring)."""

    _parser_engine_cls = WholeCallsV41Parser

    def get_structural_tag(self, request, *, reasoning: bool = False, strict_level=ToolStrictLevel.AUTO):
        pinned = (
            request.tools and forces_call(request.tool_choice) and strict_level < ToolStrictLevel.PARAMETER
        )
        if pinned:
            request = request.model_copy(update={"tools": [_strict_by_default(t) for t in request.tools]})
        tag = super().get_structural_tag(request, reasoning=reasoning, strict_level=strict_level)
        if tag is not None and request.tools:
            if pinned:
                _check_compiles(tag, request.tools)
            _check_keywords(tag, request.tools)
        return tag


def _parameters(tool: Any) -> tuple[str, Any]:
    function = getattr(tool, "function", None) or tool
    return function.name, function.parameters


def _check_compiles(tag: Any, tools: list) -> None:
    """A grammar xgrammar cannot build becomes a 400 naming the tools whose parameter
    schemas it refuses (otherwise vLLM's fallback answers "Invalid grammar
    specification: 'triggers'")."""
    import json

    import xgrammar as xgr
    from vllm.exceptions import VLLMValidationError

    try:
        xgr.Grammar.from_structural_tag(tag)
        return
    except Exception as tag_error:
        refused = []
        for tool in tools:
            name, parameters = _parameters(tool)
            if not isinstance(parameters, dict):
                continue
            try:
                xgr.Grammar.from_json_schema(json.dumps(parameters))
            except Exception as e:  # noqa: BLE001
                refused.append(f"{name!r} ({str(e).splitlines()[0][:200]})")
        detail = "; ".join(refused) if refused else str(tag_error).splitlines()[0][:200]
        raise VLLMValidationError(
            "tool_choice forces a call, so the tool's parameters schema is enforced, and xgrammar "
            f'cannot compile it: {detail}. Fix the schema, or mark the tool "strict": false '
            "to leave its arguments unconstrained."
        ) from tag_error


def _check_keywords(tag: Any, tools: list) -> None:
    """A keyword the grammar would ignore in a tool's arguments schema becomes a 400
    naming the tool, the keyword and its JSON path (``patch.schema_keywords``). Only the
    schemas the grammar holds are checked (a tool left non-strict has none)."""
    from vllm.exceptions import VLLMValidationError

    from deepinfer_vllm.patch.schema_keywords import describe, json_schemas_in_tag, unenforced

    by_schema = {}
    for tool in tools:
        name, parameters = _parameters(tool)
        by_schema.setdefault(_canonical(parameters), []).append(name)
    messages = []
    for schema in json_schemas_in_tag(tag):
        problems = unenforced(schema)
        if problems:
            names = by_schema.get(_canonical(schema)) or ["?"]
            messages.append(f"tool {' / '.join(repr(n) for n in names)}: {describe(problems)}")
    if messages:
        raise VLLMValidationError(
            "tool_choice forces a call (or the tool is strict), so the tool's parameters schema is "
            "enforced by the grammar, and the grammar cannot enforce these keywords (they would be "
            "silently ignored): " + "; ".join(messages) + ". Change the schema, or mark the tool "
            '"strict": false to leave its arguments unconstrained.'
        )


def _canonical(value: Any) -> str:
    import json

    return json.dumps(value, sort_keys=True, default=str)
