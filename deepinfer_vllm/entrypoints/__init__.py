"""What V4.1 needs from vLLM's serving stack, whichever class serves the model.

* ``tool_parser``: ``--tool-call-parser deepseek_v41`` with arguments pinned to the
  tool's schema when a call is forced;
* ``structured_outputs``: xgrammar JSON grammars that keep strings valid and
  whitespace bounded, for JSON responses and tool-call arguments.
"""

from __future__ import annotations


def install() -> None:
    """Install both (idempotent; called by ``deepinfer_vllm.register``)."""
    from deepinfer_vllm.entrypoints import structured_outputs, tool_parser

    tool_parser.install()
    structured_outputs.install()
