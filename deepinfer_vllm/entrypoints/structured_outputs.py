"""Grammars that always produce valid output, on vLLM's default backend (xgrammar).

xgrammar 0.2.8 compiles JSON schemas with two gaps that a weak or random model
walks into (the JSON then fails ``json.loads``, or never ends):

* a string with ``minLength``/``maxLength`` becomes ``[^"\\\\\\r\\n]{m,M}``, which
  admits the control characters U+0000-U+001F that JSON forbids raw in strings
  (unbounded strings are right: ``[^\\0-\\x1f"\\\\]``);
* with vLLM's default ``any_whitespace``, whitespace between tokens is
  ``[ \\n\\r\\t]*``, unbounded.

For V4.1 models, the plugin wraps the compiler of vLLM's xgrammar backend
(``XgrammarBackend.compiler``) in ``BoundedGrammarCompiler``: in the grammar
(never in the request's schema, which outputs are validated against), such a
string takes the equivalent pattern ``^[^"\\\\\\x00-\\x1f]{m,M}$``, and every
whitespace run is bounded by ``DEEPINFER_GRAMMAR_MAX_WHITESPACE``. JSON requests
(``response_format`` ``json_schema``/``json_object``) and the JSON schemas inside
structural tags (tool-call arguments) both go through it. Escapes stay out of
bounded strings, as in xgrammar's own bounded strings.
"""

from __future__ import annotations

import json
import logging
from typing import Any

logger = logging.getLogger(__name__)

# Keys that already pin a string's text: its length bounds are left to them.
_STRING_PINS = ("pattern", "format", "enum", "const")


def bounded_string_pattern(min_length: int, max_length: int | None) -> str:
    """The JSON-string pattern of ``min_length <= len <= max_length`` characters, none
    of them a quote, a backslash or a control character."""
    upper = "" if max_length is None else str(max_length)
    return '^[^"\\\\\\x00-\\x1f]{%d,%s}$' % (min_length, upper)


def grammar_schema(schema: Any) -> Any:
    """``schema`` with every length-bounded string (no pattern, format, enum or const)
    given ``bounded_string_pattern`` in place of its bounds; a new object, the input is
    left as it was. Every nested schema is visited (properties, items, ``$defs``, ...)."""
    if isinstance(schema, list):
        return [grammar_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: grammar_schema(value) for key, value in schema.items()}
    if (
        out.get("type") == "string"
        and ("minLength" in out or "maxLength" in out)
        and not any(key in out for key in _STRING_PINS)
    ):
        min_length = int(out.pop("minLength", 0))
        max_length = out.pop("maxLength", None)
        out["pattern"] = bounded_string_pattern(min_length, None if max_length is None else int(max_length))
    return out


def _bound_formats(node: Any, max_whitespace: int) -> Any:
    """A structural tag's JSON with each ``json_schema`` format bounded: JSON-style
    schemas through ``grammar_schema`` (XML-style ones carry raw-text strings, which
    need no escaping), and every format's whitespace runs capped."""
    if isinstance(node, list):
        return [_bound_formats(item, max_whitespace) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _bound_formats(value, max_whitespace) for key, value in node.items()}
    if out.get("type") == "json_schema":
        if out.get("style") in (None, "json"):
            out["json_schema"] = grammar_schema(out.get("json_schema"))
        if out.get("max_whitespace_cnt") is None:
            out["max_whitespace_cnt"] = max_whitespace
    return out


class BoundedGrammarCompiler:
    """An ``xgrammar.GrammarCompiler`` whose JSON schemas and structural tags are bounded
    (module docstring); every other call goes to the wrapped compiler unchanged."""

    def __init__(self, compiler: Any, max_whitespace: int):
        self._compiler = compiler
        self.max_whitespace = max_whitespace

    def __getattr__(self, name: str) -> Any:
        return getattr(self._compiler, name)

    def compile_json_schema(self, schema: Any, **kwargs: Any) -> Any:
        if isinstance(schema, (str, bytes)):
            schema = json.loads(schema)
        if kwargs.get("any_whitespace", True) and kwargs.get("max_whitespace_cnt") is None:
            kwargs["max_whitespace_cnt"] = self.max_whitespace
        return self._compiler.compile_json_schema(json.dumps(grammar_schema(schema)), **kwargs)

    def compile_structural_tag(self, tag: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(tag, str) and not args:
            parsed = json.loads(tag)
            if "format" in parsed:  # the current spelling; vLLM sends the old one as a list
                tag = json.dumps(_bound_formats(parsed, self.max_whitespace))
        return self._compiler.compile_structural_tag(tag, *args, **kwargs)


def install() -> None:
    """Wrap the compiler of every xgrammar backend vLLM builds for a V4.1 model (once
    per process; other models keep vLLM's compiler)."""
    from vllm.v1.structured_output import backend_xgrammar

    backend = backend_xgrammar.XgrammarBackend
    if getattr(backend, "_deepinfer_bounded", False):
        return
    stock_post_init = backend.__post_init__

    def __post_init__(self) -> None:
        stock_post_init(self)
        from deepinfer_vllm import envs
        from deepinfer_vllm.configs import is_v41_config

        model_config = self.vllm_config.model_config
        if model_config is not None and is_v41_config(model_config.hf_config):
            self.compiler = BoundedGrammarCompiler(self.compiler, envs.grammar_max_whitespace())
            logger.info(
                "DeepInfer V4.1: xgrammar JSON grammars keep control characters out of "
                "length-bounded strings and cap whitespace runs at %d",
                self.compiler.max_whitespace,
            )

    backend.__post_init__ = __post_init__
    backend._deepinfer_bounded = True
