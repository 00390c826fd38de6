"""JSON-schema keywords the xgrammar grammar cannot enforce, found before a request runs.

xgrammar 0.2.8 (vLLM 0.32's default backend, and the only one for tool-call
structural tags) turns a JSON schema into a grammar keyword by keyword. Some
keywords it drops, logging at most a warning on the engine's stderr, and the
answer then need not satisfy the schema (``uniqueItems: true`` gave ``[1, 1, 2]``;
a ``format: "email"`` string lost its ``maxLength`` and ran to ``max_tokens``).
``unenforced(schema)`` lists each such keyword with its JSON path, so that V4.1
requests carrying one are refused with a 400 instead (``patch.structured_outputs`` for
``response_format``/``structured_outputs``, ``entrypoints.tool_parser`` for tool
parameters). It is the catalogue of that correction, not a correction of its own.

What xgrammar 0.2.8 does: read in its converter's source (``SchemaParser::Parse`` and
the ``Parse*`` methods of upstream ``cpp/json_schema_converter.cc``; the wheel ships
only the compiled library), and every claim below checked against the installed
0.2.8 string by string with its matcher (``tests/entrypoints/test_schema_keywords.py``):

* One keyword picks how a schema object is read, the first present of ``$ref``,
  ``const``, ``enum``, ``anyOf``, ``oneOf``, ``allOf``, ``type`` (or an object's
  ``properties``/``additionalProperties``/``unevaluatedProperties``, or an array's
  ``items``/``prefixItems``/``unevaluatedItems``), else any JSON value. Every other
  constraining keyword of that object is ignored: next to ``$ref``, ``anyOf``,
  ``oneOf``, ``allOf``, and with no ``type`` at all (``{"maxLength": 3}`` admits
  ``"abcd"``). ``const``/``enum`` emit their values as listed: other keywords beside
  them are refused only when a listed value violates them (checked with
  ``jsonschema``), since otherwise nothing is lost.
* Enforced, by type. string: ``minLength``, ``maxLength``, ``pattern`` and the formats
  ``SUPPORTED_FORMATS``; integer and number: ``minimum``, ``maximum``,
  ``exclusiveMinimum``, ``exclusiveMaximum``; integer ``multipleOf`` when it is a
  whole number <= 1024 and the range is unbounded or bounded on both sides by
  fewer than 10000 values; array: ``items``, ``prefixItems``, ``unevaluatedItems``,
  ``minItems``, ``maxItems``; object: ``properties``, ``required`` (names listed in
  ``properties``), ``additionalProperties``, ``unevaluatedProperties``,
  ``patternProperties``, ``propertyNames``, ``minProperties``, ``maxProperties``;
  ``anyOf``; ``allOf`` with one subschema; local ``$ref`` (``#`` or ``#/...``).
* Ignored (refused here): ``uniqueItems: true``, ``contains``, ``minContains``,
  ``maxContains``, ``not``, ``if``/``then``/``else``, ``dependentRequired``,
  ``dependentSchemas``, ``dependencies``, ``$dynamicRef``/``$recursiveRef``, other
  ``$ref``s (read as any value), number ``multipleOf`` and integer ``multipleOf``
  outside the limits above, ``minLength``/``maxLength`` next to ``pattern`` or a
  supported ``format``, the standard formats xgrammar lacks (``idn-email``,
  ``idn-hostname``, ``iri``, ``iri-reference``, ``regex``), ``allOf`` with several
  subschemas, ``oneOf`` whose branches may overlap (read as ``anyOf``; accepted when
  the branches are provably disjoint: different types, disjoint ``const``/``enum``
  values, or a required ``const``/``enum`` property with disjoint values), a
  ``required`` name missing from ``properties``, ``propertyNames`` that a name in
  ``properties`` violates, ``additionalProperties``/``unevaluatedProperties: false``
  next to ``propertyNames``, and a
  ``patternProperties`` pattern that also matches a name in ``properties`` (only the
  ``properties`` schema applies).

Keywords that constrain nothing are never refused: annotations (``title``,
``description``, ``examples``, ``default``, ``$comment``, ``deprecated``, ...),
non-standard formats (annotations in JSON Schema), keywords of a type the value
cannot have (``maxLength`` on an integer), and vacuous values (``uniqueItems:
false``, ``minItems: 0``, ``additionalProperties: true``, ``uniqueItems`` with
``maxItems <= 1``, ...). Where xgrammar is stricter than the schema (full-match
``pattern``, no extra properties unless allowed) the answer still validates.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# Formats xgrammar 0.2.8 compiles to a regex (vLLM's ``STRING_SUPPORTED_FORMATS``).
SUPPORTED_FORMATS = frozenset(
    {
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "ipv4",
        "ipv6",
        "hostname",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)
# Formats JSON Schema (2020-12) defines; others are annotations nobody validates.
STANDARD_FORMATS = SUPPORTED_FORMATS | {"idn-email", "idn-hostname", "iri", "iri-reference", "regex"}

INTEGER_MULTIPLE_OF_MAX = 1024
INTEGER_MULTIPLE_OF_RANGE = 10000  # values in a bounded range xgrammar still enforces it for

_TYPE_KEYWORDS: dict[str, frozenset[str]] = {}
for _kw in ("minLength", "maxLength", "pattern", "format"):
    _TYPE_KEYWORDS[_kw] = frozenset({"string"})
for _kw in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
    _TYPE_KEYWORDS[_kw] = frozenset({"integer", "number"})
for _kw in (
    "items",
    "prefixItems",
    "additionalItems",
    "contains",
    "minContains",
    "maxContains",
    "minItems",
    "maxItems",
    "uniqueItems",
    "unevaluatedItems",
):
    _TYPE_KEYWORDS[_kw] = frozenset({"array"})
for _kw in (
    "properties",
    "patternProperties",
    "additionalProperties",
    "required",
    "propertyNames",
    "minProperties",
    "maxProperties",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "unevaluatedProperties",
):
    _TYPE_KEYWORDS[_kw] = frozenset({"object"})
_BRANCHES = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
_NEVER = ("not", "$dynamicRef", "$recursiveRef")
# Keywords that constrain a value (the applicator/validation vocabularies).
CONSTRAINING = frozenset(_TYPE_KEYWORDS) | {"type", *_BRANCHES, *_NEVER, "if", "then", "else"}
_OBJECT_SHAPE = ("properties", "additionalProperties", "unevaluatedProperties")
_ARRAY_SHAPE = ("items", "prefixItems", "unevaluatedItems")
_VACUOUS_SCHEMA = (
    "items",
    "additionalItems",
    "additionalProperties",
    "unevaluatedProperties",
    "unevaluatedItems",
    "propertyNames",
)


@dataclass(frozen=True)
class Problem:
    keyword: str
    path: str  # JSON path of the schema object holding the keyword
    reason: str

    def __str__(self) -> str:
        return f"`{self.keyword}` at {self.path} ({self.reason})"


def describe(problems: list[Problem]) -> str:
    return "; ".join(str(p) for p in problems)


def json_path(segments: list[str | int]) -> str:
    out = "$"
    for seg in segments:
        if isinstance(seg, int):
            out += f"[{seg}]"
        elif re.fullmatch(r"[A-Za-z_$][A-Za-z0-9_$-]*", seg):
            out += f".{seg}"
        else:
            out += f"[{json.dumps(seg, ensure_ascii=False)}]"
    return out


def unenforced(schema: Any) -> list[Problem]:
    """Every keyword of ``schema`` that constrains a value and that xgrammar 0.2.8
    would not enforce (module docstring), in schema order."""
    if isinstance(schema, (str, bytes)):
        schema = json.loads(schema)
    checker = _Checker(schema)
    checker.visit(schema, [])
    return checker.problems


def json_schemas_in_tag(tag: Any) -> list[Any]:
    """The JSON schemas inside a structural tag (an xgrammar ``StructuralTag``, its
    JSON, or the legacy ``structures`` list)."""
    if hasattr(tag, "model_dump"):
        tag = tag.model_dump()
    elif isinstance(tag, (str, bytes)):
        tag = json.loads(tag)
    found: list[Any] = []

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            if node.get("type") == "json_schema" and "json_schema" in node:
                found.append(node["json_schema"])
                return
            for value in node.values():
                walk(value)

    walk(tag)
    if isinstance(tag, dict):
        for structure in tag.get("structures") or []:
            if isinstance(structure, dict) and "schema" in structure:
                found.append(structure["schema"])
    return found


def _json_types(value: Any) -> set[str]:
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    if isinstance(value, str):
        return {"string"}
    if value is None:
        return {"null"}
    return {"array"} if isinstance(value, list) else {"object"}


def _with_integer(types: set[str]) -> set[str]:
    return types | {"integer"} if "number" in types else types


def _canonical(value: Any) -> str:
    """Equal JSON values (JSON Schema equality: ``1 == 1.0``, ``true != 1``) map to the
    same string."""

    def norm(v: Any) -> Any:
        if isinstance(v, bool) or v is None or isinstance(v, str):
            return v
        if isinstance(v, (int, float)):
            return ["#n", float(v)]
        if isinstance(v, list):
            return [norm(x) for x in v]
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        return v

    return json.dumps(norm(value), sort_keys=True)


class _Checker:
    def __init__(self, root: Any):
        self.root = root
        self.problems: list[Problem] = []
        self._visited_refs: set[str] = set()
        self._validator: Any = None

    # -- helpers -------------------------------------------------------------------

    def problem(self, keyword: str, path: list, reason: str) -> None:
        self.problems.append(Problem(keyword, json_path(path), reason))

    def resolve(self, ref: Any) -> tuple[Any, list] | None:
        """A local ``$ref`` (``#`` or a JSON pointer ``#/...``) and its target's path."""
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            return None
        from urllib.parse import unquote

        node, path = self.root, []
        for part in ref[2:].split("/") if ref != "#" else []:
            if part == "":
                continue
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
                path.append(part)
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
                path.append(int(part))
            else:
                return None
        return node, path

    def deref(self, node: Any, depth: int = 0) -> Any:
        while isinstance(node, dict) and "$ref" in node and depth < 32:
            target = self.resolve(node["$ref"])
            if target is None:
                return None
            node, depth = target[0], depth + 1
        return node

    def validator(self, schema: Any) -> Any:
        """A ``jsonschema`` validator for ``schema`` that resolves local references
        against the root and never fetches a remote one."""
        import jsonschema
        import referencing
        import referencing.exceptions

        if self._validator is None:

            def no_remote(uri: str) -> Any:
                raise referencing.exceptions.NoSuchResource(ref=uri)

            root = self.root if isinstance(self.root, (dict, bool)) else {}
            cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
            self._validator = cls(
                root,
                registry=referencing.Registry(retrieve=no_remote),
                format_checker=cls.FORMAT_CHECKER,
            )
        return self._validator.evolve(schema=schema)

    @staticmethod
    def effective(node: dict, key: str) -> bool:
        """Whether ``key`` of ``node`` constrains anything at all."""
        value = node[key]
        if key not in CONSTRAINING:
            return False
        if key in _VACUOUS_SCHEMA and (value is True or value == {}):
            return False
        if key == "additionalItems":
            return isinstance(node.get("items"), list)
        if key in ("minLength", "minItems", "minProperties") and value == 0:
            return False
        if key in ("minContains", "maxContains"):
            return "contains" in node
        if key == "uniqueItems":
            max_items = node.get("maxItems")
            return value is True and not (isinstance(max_items, int) and max_items <= 1)
        if key in (
            "properties",
            "patternProperties",
            "dependentRequired",
            "dependentSchemas",
            "dependencies",
        ):
            return value != {}
        if key == "required":
            return value != []
        if key == "format":
            return value in STANDARD_FORMATS
        if key in ("then", "else"):
            return False  # reported as `if`
        if key == "if":
            return "then" in node or "else" in node
        return True

    # -- the walk ------------------------------------------------------------------

    def visit(self, node: Any, path: list, default_type: str | None = None) -> None:
        if not isinstance(node, dict):
            return  # `true` is any value; `false` and non-objects fail to compile
        for key in _NEVER:
            if key in node:
                self.problem(key, path, "xgrammar has no grammar for it")
        if self.effective_key(node, "if"):
            self.problem("if", path, "conditional subschemas (if/then/else) are ignored")
        branch = next((key for key in _BRANCHES if key in node), None)
        if branch is not None:
            getattr(self, "_" + branch.lstrip("$"))(node, path)
            if branch not in ("const", "enum"):
                for key in node:
                    if key != branch and key not in _NEVER and key != "if" and self.effective(node, key):
                        self.problem(key, path, f"ignored next to `{branch}`")
            return
        types = node.get("type", default_type)
        if types is None:
            if any(key in node for key in _OBJECT_SHAPE):
                types = "object"
            elif any(key in node for key in _ARRAY_SHAPE):
                types = "array"
        if types is None:
            for key in node:
                if key in _TYPE_KEYWORDS and self.effective(node, key):
                    self.problem(key, path, "the schema has no `type`: xgrammar admits any value here")
            return
        types = {types} if isinstance(types, str) else {t for t in types if isinstance(t, str)}
        self._typed(node, path, _with_integer(types))

    def effective_key(self, node: dict, key: str) -> bool:
        return key in node and self.effective(node, key)

    def _ref(self, node: dict, path: list) -> None:
        target = self.resolve(node["$ref"])
        if target is None:
            self.problem(
                "$ref", path, "only local references ('#' or '#/...') are resolved; others admit any value"
            )
            return
        target_node, target_path = target
        key = json_path(target_path)
        if key not in self._visited_refs:
            self._visited_refs.add(key)
            self.visit(target_node, target_path)

    def _values(self, node: dict, path: list, branch: str) -> None:
        values = [node["const"]] if branch == "const" else node["enum"]
        if not isinstance(values, list):
            return
        skip = {branch, *_NEVER, "if", "then", "else"}  # the last ones are reported already
        siblings = {key: value for key, value in node.items() if key not in skip}
        if not any(self.effective(siblings, key) for key in siblings):
            return
        failing: dict[str, Any] = {}
        try:
            validator = self.validator(siblings)
            for value in values:
                for error in validator.iter_errors(value):
                    keyword = (
                        str(error.relative_schema_path[0]) if error.relative_schema_path else error.validator
                    )
                    failing.setdefault(keyword, value)
        except Exception as e:  # noqa: BLE001 (an unresolvable reference, a malformed keyword)
            self.problem(branch, path, f"its values could not be checked against the keywords beside it: {e}")
            return
        for keyword, value in failing.items():
            self.problem(
                keyword,
                path,
                f"the grammar emits the `{branch}` values as listed, and {json.dumps(value)} violates it",
            )

    def _const(self, node: dict, path: list) -> None:
        self._values(node, path, "const")

    def _enum(self, node: dict, path: list) -> None:
        self._values(node, path, "enum")

    def _anyOf(self, node: dict, path: list) -> None:
        options = node["anyOf"]
        for i, option in enumerate(options if isinstance(options, list) else []):
            self.visit(option, [*path, "anyOf", i])

    def _oneOf(self, node: dict, path: list) -> None:
        options = node["oneOf"]
        if not isinstance(options, list):
            return
        for i, option in enumerate(options):
            self.visit(option, [*path, "oneOf", i])
        if not self._disjoint(options):
            self.problem(
                "oneOf",
                path,
                "its branches may overlap, and xgrammar then enforces it as anyOf (a value may match "
                "several); make the branches disjoint (different types, or a required const/enum "
                "property) or use anyOf",
            )

    def _allOf(self, node: dict, path: list) -> None:
        options = node["allOf"]
        if isinstance(options, list) and len(options) == 1:
            self.visit(options[0], [*path, "allOf", 0])
        else:
            self.problem("allOf", path, "xgrammar enforces allOf with a single subschema only; merge them")

    def _typed(self, node: dict, path: list, types: set[str]) -> None:
        for key in node:
            if (
                key not in _TYPE_KEYWORDS
                or not (_TYPE_KEYWORDS[key] & types)
                or not self.effective(node, key)
            ):
                continue
            self._keyword(node, path, key, types)

    def _keyword(self, node: dict, path: list, key: str, types: set[str]) -> None:
        value = node[key]
        here = [*path, key]
        if key in ("minLength", "maxLength"):
            if "pattern" in node or node.get("format") in SUPPORTED_FORMATS:
                pin = "pattern" if "pattern" in node else "format"
                self.problem(key, path, f"xgrammar ignores length bounds next to `{pin}`")
        elif key == "format":
            if value not in SUPPORTED_FORMATS:
                self.problem(key, path, f"xgrammar has no grammar for format {value!r}")
        elif key == "multipleOf":
            self._multiple_of(node, path, types)
        elif key in ("items", "additionalProperties", "unevaluatedItems", "unevaluatedProperties"):
            if key == "unevaluatedItems" and "items" in node:
                return
            if key == "unevaluatedProperties" and "additionalProperties" in node:
                return
            self.visit(value, here)
        elif key == "prefixItems":
            for i, item in enumerate(value if isinstance(value, list) else []):
                self.visit(item, [*here, i])
        elif key in ("properties", "patternProperties"):
            for name, sub in value.items() if isinstance(value, dict) else []:
                self.visit(sub, [*here, name])
            if key == "patternProperties":
                self._pattern_properties(node, path)
        elif key == "propertyNames":
            self.visit(value, here, default_type="string")
            self._property_names(node, path)
        elif key == "required":
            properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            missing = [name for name in value if name not in properties] if isinstance(value, list) else []
            if missing:
                self.problem(
                    key, path, f"xgrammar enforces required names listed in `properties` only: {missing}"
                )
        elif key in ("uniqueItems", "contains", "minContains", "maxContains", "additionalItems") or key in ("dependentRequired", "dependentSchemas", "dependencies"):
            self.problem(key, path, "xgrammar ignores it")
        # minimum/maximum/exclusive*, minItems/maxItems, min/maxProperties, pattern: enforced

    def _multiple_of(self, node: dict, path: list, types: set[str]) -> None:
        value = node["multipleOf"]
        if "number" in types:
            self.problem("multipleOf", path, "xgrammar ignores multipleOf for type number")
            return
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            return  # invalid: xgrammar refuses to compile it
        if float(value) != int(value) or value > INTEGER_MULTIPLE_OF_MAX:
            self.problem(
                "multipleOf",
                path,
                "xgrammar enforces an integer multipleOf only for whole numbers "
                f"<= {INTEGER_MULTIPLE_OF_MAX}",
            )
            return
        low = [v for v in (node.get("minimum"),) if isinstance(v, (int, float))]
        low += [v + 1 for v in (node.get("exclusiveMinimum"),) if isinstance(v, (int, float))]
        high = [v for v in (node.get("maximum"),) if isinstance(v, (int, float))]
        high += [v - 1 for v in (node.get("exclusiveMaximum"),) if isinstance(v, (int, float))]
        if not low and not high:
            return
        if not low or not high or min(high) - max(low) >= INTEGER_MULTIPLE_OF_RANGE:
            self.problem(
                "multipleOf",
                path,
                "xgrammar ignores multipleOf with a range bounded on one side only or spanning "
                f">= {INTEGER_MULTIPLE_OF_RANGE} values",
            )

    def _property_names(self, node: dict, path: list) -> None:
        for key in ("additionalProperties", "unevaluatedProperties"):
            if node.get(key) is False:
                self.problem(
                    key,
                    path,
                    "xgrammar ignores `false` next to `propertyNames`: it admits any name those allow",
                )
        properties = node.get("properties")
        if not isinstance(properties, dict):
            return
        try:
            validator = self.validator(node["propertyNames"])
            bad = [name for name in properties if not validator.is_valid(name)]
        except Exception:  # noqa: BLE001
            bad = list(properties)
        if bad:
            self.problem(
                "propertyNames",
                path,
                f"names in `properties` violate it, and xgrammar does not check those names: {bad}",
            )

    def _pattern_properties(self, node: dict, path: list) -> None:
        properties = node.get("properties")
        if not isinstance(properties, dict):
            return
        for pattern in node["patternProperties"]:
            try:
                overlap = [name for name in properties if re.search(pattern, name)]
            except re.error:
                overlap = list(properties)
            if overlap:
                self.problem(
                    "patternProperties",
                    path,
                    f"pattern {pattern!r} also matches {overlap} from `properties`, and xgrammar "
                    "applies only their `properties` schema",
                )

    # -- oneOf disjointness --------------------------------------------------------

    def _signature(self, option: Any) -> dict | None:
        node = self.deref(option)
        if not isinstance(node, dict):
            return None
        if "const" in node or "enum" in node:
            values = [node["const"]] if "const" in node else node["enum"]
            if not isinstance(values, list):
                return None
            return {
                "values": {_canonical(v) for v in values},
                "types": set().union(*map(_json_types, values)),
            }
        if any(key in node for key in ("anyOf", "oneOf", "allOf")):
            return None
        types = node.get("type")
        if types is None:
            if any(key in node for key in _OBJECT_SHAPE):
                types = "object"
            elif any(key in node for key in _ARRAY_SHAPE):
                types = "array"
            else:
                return None
        types = {types} if isinstance(types, str) else set(types)
        tags: dict[str, set[str]] = {}
        properties = node.get("properties")
        required = node.get("required")
        if "object" in types and isinstance(properties, dict) and isinstance(required, list):
            for name in required:
                prop = self.deref(properties.get(name))
                if isinstance(prop, dict) and ("const" in prop or "enum" in prop):
                    values = [prop["const"]] if "const" in prop else prop["enum"]
                    if isinstance(values, list):
                        tags[name] = {_canonical(v) for v in values}
        return {"values": None, "types": _with_integer(types), "tags": tags}

    def _disjoint(self, options: list) -> bool:
        signatures = [self._signature(option) for option in options]
        if any(s is None for s in signatures):
            return False
        for i, a in enumerate(signatures):
            for b in signatures[i + 1 :]:
                if not _signatures_disjoint(a, b):
                    return False
        return True


def _signatures_disjoint(a: dict, b: dict) -> bool:
    if a["values"] is not None and b["values"] is not None:
        return a["values"].isdisjoint(b["values"])
    if not (_with_integer(a["types"]) & _with_integer(b["types"])):
        return True
    if a["values"] is None and b["values"] is None:
        return any(name in b["tags"] and a["tags"][name].isdisjoint(b["tags"][name]) for name in a["tags"])
    return False
