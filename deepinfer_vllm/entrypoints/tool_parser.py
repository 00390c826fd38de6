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
bounds come from ``structured_outputs.BoundedGrammarCompiler``.

With thinking on, vLLM applies the grammar after ``</think>`` (the reasoning
parser marks the end); ``thinking_token_budget`` bounds the thinking.
"""

from __future__ import annotations

from typing import Any

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


class DeepSeekV41ToolParser(DeepSeekV41EngineToolParser):
    """vLLM's V4.1 DSML tool parser; forced calls get their arguments' schema (module
    docstring)."""

    def get_structural_tag(self, request, *, reasoning: bool = False, strict_level=ToolStrictLevel.AUTO):
        pinned = (
            request.tools and forces_call(request.tool_choice) and strict_level < ToolStrictLevel.PARAMETER
        )
        if pinned:
            request = request.model_copy(update={"tools": [_strict_by_default(t) for t in request.tools]})
        tag = super().get_structural_tag(request, reasoning=reasoning, strict_level=strict_level)
        if pinned and tag is not None:
            _check_compiles(tag, request.tools)
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
    except Exception as tag_error:  # noqa: BLE001 (xgrammar raises RuntimeError and others)
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
