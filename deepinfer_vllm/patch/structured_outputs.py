"""vLLM's structured outputs for V4.1: JSON grammars that always give valid JSON, on xgrammar.

**vLLM behaviour (0.32).** ``vllm/v1/structured_output/backend_xgrammar.py``:
``XgrammarBackend`` hands JSON schemas and structural tags to xgrammar 0.2.8's
``GrammarCompiler`` as they are, and xgrammar compiles them with two gaps that a
weak or random model walks into (the JSON then fails ``json.loads``, or never ends):

* a string with ``minLength``/``maxLength`` becomes ``[^"\\\\\\r\\n]{m,M}``, which
  admits the control characters U+0000-U+001F that JSON forbids raw in strings
  (unbounded strings are right: ``[^\\0-\\x1f"\\\\]``);
* with vLLM's default ``any_whitespace``, whitespace between tokens is
  ``[ \\n\\r\\t]*``, unbounded.

``vllm/sampling_params.py``: ``SamplingParams._validate_structured_outputs`` (the
front end's check of a request) accepts JSON schemas whose keywords xgrammar drops
(``uniqueItems``, length bounds next to ``pattern``/``format``, ...: listed by
``schema_keywords``), and under the ``auto`` backend picks a backend per request,
handing such schemas to guidance. But the engine builds one backend, for the first
structured request (``StructuredOutputManager.grammar_init``), and compiles every
later request with it: a schema sent to "guidance" was compiled by xgrammar whenever
a tool call or an xgrammar-enforceable schema came first (how ``format: "email"``
with ``maxLength`` lost its bound), and a guidance-first engine would refuse V4.1's
tool-call structural tags.

**What the patch does, for V4.1 models only** (other models keep vLLM's behaviour):

* ``XgrammarBackend.__post_init__`` wraps the backend's compiler in
  ``BoundedGrammarCompiler``: in the grammar (never in the request's schema, which
  outputs are validated against), a length-bounded string takes the equivalent pattern
  ``^[^"\\\\\\x00-\\x1f]{m,M}$``, and every whitespace run is bounded by
  ``DEEPINFER_GRAMMAR_MAX_WHITESPACE``. JSON requests (``response_format``
  ``json_schema``/``json_object``) and the JSON schemas inside structural tags
  (tool-call arguments) both go through it. Escapes stay out of bounded strings, as in
  xgrammar's own bounded strings.
* ``SamplingParams._validate_structured_outputs``, under the ``auto`` or ``xgrammar``
  backend: a keyword xgrammar would ignore is a 400 naming the keyword and its JSON
  path, in the request's JSON schema and in those inside a structural tag (tool-call
  arguments, a ``response_format`` joined to tool calls); a schema ``auto`` would hand
  to guidance stays on xgrammar (a 400 when xgrammar cannot compile it).

**Applied** by ``apply()``, from ``entrypoints.install()`` (the plugin entry point
``deepinfer_vllm.register``), in every process: the wrapped validation runs in the API
server, the wrapped backend in the engine core.

**Removable** when xgrammar keeps control characters out of bounded strings and caps
whitespace by default, refuses (or enforces) the keywords it ignores today, and vLLM's
engine compiles each request with the backend its front end chose.
``tests/patch/test_structured_outputs.py`` checks each of these vLLM and xgrammar
behaviours on the installed versions.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from typing import Any

logger = logging.getLogger(__name__)

# Keys that already pin a string's text: left to xgrammar, which drops length bounds
# next to ``pattern`` and a supported ``format`` (refused up front: ``schema_keywords``)
# and emits ``enum``/``const`` values as listed.
_STRING_PINS = ("pattern", "format", "enum", "const")


def bounded_string_pattern(min_length: int, max_length: int | None) -> str:
    """The JSON-string pattern of ``min_length <= len <= max_length`` characters, none
    of them a quote, a backslash or a control character."""
    upper = "" if max_length is None else str(max_length)
    return f'^[^"\\\\\\x00-\\x1f]{{{min_length},{upper}}}$'


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


def unenforced_keyword_error(structured_outputs: Any) -> Exception | None:
    """A ``VLLMValidationError`` listing the keywords xgrammar would ignore in the JSON
    schemas of ``structured_outputs`` (``json``, or those inside ``structural_tag``),
    or ``None`` when there are none."""
    from vllm.exceptions import VLLMValidationError

    from deepinfer_vllm.patch.schema_keywords import describe, json_schemas_in_tag, unenforced

    found = []
    try:
        if structured_outputs.json is not None:
            schema = structured_outputs.json
            found = [
                ("the JSON schema", unenforced(json.loads(schema) if isinstance(schema, str) else schema))
            ]
        elif structured_outputs.structural_tag:
            found = [
                (f"JSON schema {i} of the structural tag", unenforced(schema))
                for i, schema in enumerate(json_schemas_in_tag(structured_outputs.structural_tag))
            ]
    except ValueError:
        return None  # not JSON: vLLM's own validation answers
    found = [(where, problems) for where, problems in found if problems]
    if not found:
        return None
    detail = "; ".join(f"{where}: {describe(problems)}" for where, problems in found)
    return VLLMValidationError(
        "The grammar backend (xgrammar) cannot enforce these JSON schema keywords, so the answer "
        f"could violate the schema: {detail}. Remove or rewrite them.",
        parameter="response_format",
    )


def _xgrammar_compile_error(structured_outputs: Any) -> Exception | None:
    """xgrammar's error compiling the request's JSON schema or structural tag, if any."""
    import xgrammar as xgr

    try:
        if structured_outputs.json is not None:
            schema = structured_outputs.json
            xgr.Grammar.from_json_schema(schema if isinstance(schema, str) else json.dumps(schema))
        elif structured_outputs.structural_tag:
            xgr.Grammar.from_structural_tag(structured_outputs.structural_tag)
    except Exception as e:  # noqa: BLE001 (xgrammar raises RuntimeError and others)
        return e
    return None


def _install_keyword_check() -> None:
    """For V4.1 models, JSON schemas always go to xgrammar and are refused when they
    carry keywords xgrammar would ignore (module docstring), in vLLM's request
    validation (``SamplingParams``, front end)."""
    from vllm.sampling_params import SamplingParams

    if getattr(SamplingParams, "_deepinfer_keyword_check", False):
        return
    stock = SamplingParams._validate_structured_outputs

    @functools.wraps(stock)
    def _validate_structured_outputs(self, model_config, structured_outputs_config, tokenizer) -> None:
        from deepinfer_vllm.configs import is_v41_config

        so = self.structured_outputs
        if (
            so is None
            or structured_outputs_config is None
            or not is_v41_config(model_config.hf_config)
            or not (so.json is not None or so.structural_tag)
            or structured_outputs_config.backend not in ("auto", "xgrammar")
        ):
            return stock(self, model_config, structured_outputs_config, tokenizer)
        from vllm.exceptions import VLLMValidationError

        try:
            stock(self, model_config, structured_outputs_config, tokenizer)
        except Exception as refused:
            error = unenforced_keyword_error(so)  # name the keywords and their paths
            if error is not None:
                raise error from refused
            raise
        error = unenforced_keyword_error(so)
        if error is not None:
            raise error
        if so._backend != "xgrammar":
            # ``auto`` handed the schema to guidance/outlines. vLLM V1 runs one backend per
            # engine, made for the first structured request (``StructuredOutputManager.
            # grammar_init``), so that choice either makes every later request (V4.1's
            # tool-call structural tags included) run on guidance, or is ignored and the
            # schema compiled by xgrammar anyway, dropping what xgrammar ignores: the user
            # report of ``format`` + ``maxLength``. Keep V4.1 on xgrammar, whose keywords
            # were just checked.
            compile_error = _xgrammar_compile_error(so)
            if compile_error is not None:
                reason = re.sub(r"^\[[^\]]*\] [^ ]+:\d+: ", "", str(compile_error).splitlines()[0])
                raise VLLMValidationError(
                    f"The grammar backend (xgrammar) cannot compile this JSON schema: {reason[:300]}",
                    parameter="response_format",
                ) from compile_error
            so._backend = "xgrammar"
            so._backend_was_auto = True

    SamplingParams._validate_structured_outputs = _validate_structured_outputs
    SamplingParams._deepinfer_keyword_check = True


def apply() -> None:
    """Wrap the compiler of every xgrammar backend vLLM builds for a V4.1 model (other
    models keep vLLM's compiler), and check V4.1 requests' JSON schemas for keywords
    xgrammar would ignore (module docstring). Idempotent."""
    _install_keyword_check()
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
