"""What V4.1 needs from vLLM's serving stack, whichever class serves the model.

* ``tool_parser``: ``--tool-call-parser deepseek_v41`` with arguments pinned to the
  tool's schema when a call is forced, and only whole calls returned or streamed (a
  call cut by ``max_tokens`` is left out); a schema keyword xgrammar ignores in a
  forced call's arguments is refused with a 400 naming the keyword and its JSON path;
* the structured-outputs correction (``patch.structured_outputs``): xgrammar JSON
  grammars that keep strings valid and whitespace bounded, for JSON responses and
  tool-call arguments, V4.1's JSON schemas kept on xgrammar, and the keywords xgrammar
  ignores refused with a 400.
"""

from __future__ import annotations

TOOL_PARSER = ("deepseek_v41", "deepinfer_vllm.entrypoints.tool_parser", "DeepSeekV41ToolParser")


def install() -> None:
    """Install both (idempotent; called by ``deepinfer_vllm.register``). The parser is
    registered lazily, as vLLM registers its own: nothing of the serving stack is
    imported until a server asks for it."""
    from vllm.tool_parsers import ToolParserManager

    from deepinfer_vllm.patch import structured_outputs

    name, module, cls = TOOL_PARSER
    ToolParserManager.tool_parsers.pop(name, None)  # vLLM's class, if already loaded
    ToolParserManager.register_lazy_module(name, module, cls)
    structured_outputs.apply()
