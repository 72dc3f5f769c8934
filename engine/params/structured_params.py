"""vLLM's `StructuredOutputsParams`: which constraint a request's output must follow.

Torch-free (the batch validator builds it too). The checks here need no tokenizer: exactly one
kind of constraint, each of the right type and shape. Whether xgrammar can build the grammar
(an unsupported schema keyword, a bad EBNF) is checked when the engine accepts the request
(`engine.sampling.grammar_cache.check_spec`).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
MAX_SPEC_CHARS = 1 << 20  # a schema, regex or grammar larger than 1 MiB is refused


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema (dict or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF), or Lark
    json_object: bool | None = None  # any JSON object
    disable_fallback: bool = False  # one backend here (xgrammar): accepted, changes nothing
    # JSON's whitespace: None (the default here): none at all ("," and ":" as separators); True (vLLM's): no
    # free whitespace, xgrammar's ", " and ": "; False: any whitespace (vLLM's default)
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool = False  # objects may not hold keys the schema does not name
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self):
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        self.validate()

    @property
    def compact_whitespace(self) -> bool:
        return self.disable_any_whitespace is not False

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None)

    def validate(self) -> None:
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one kind of constraint ({', '.join(KINDS)}); got {given or 'none'}"
            )
        if self.disable_any_whitespace not in (None, True, False):
            raise ValueError(f"disable_any_whitespace must be a boolean, got {self.disable_any_whitespace!r:.40}")
        if self.structural_tag is not None:
            raise ValueError("structured_outputs.structural_tag is not supported")
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported by the xgrammar backend")
        check = {
            "json": check_json_schema,
            "regex": check_regex,
            "choice": check_choice,
            "grammar": check_grammar,
            "json_object": check_json_object,
        }[self.kind]
        check(getattr(self, self.kind))

    def key(self) -> str:
        """One string per distinct constraint: the grammar cache's key."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    def to_dict(self) -> dict:
        """The fields that differ from the defaults (the shard input line's form)."""
        default = {"disable_fallback": False, "disable_additional_properties": False}
        return {k: v for k, v in asdict(self).items() if v is not None and default.get(k) != v}


_BACKEND_OPTIONS = {
    "disable-any-whitespace": "disable_any_whitespace",
    "no-fallback": "disable_fallback",
    "disable-additional-properties": "disable_additional_properties",
}


@dataclass
class GuidedDecodingParams(StructuredOutputsParams):
    """vLLM's older spelling of the same constraint (`vllm.sampling_params.GuidedDecodingParams`, given as
    `SamplingParams(guided_decoding=...)`), with the backend it named. There is one backend here: "auto" and
    "xgrammar" are accepted, with vLLM's options after a colon ("xgrammar:disable-any-whitespace")."""

    backend: str | None = None
    backend_was_auto: bool = False

    def __post_init__(self):
        name, _, options = (self.backend or "auto").partition(":")
        if name not in ("auto", "xgrammar"):
            raise ValueError(f"guided decoding backend {self.backend!r} is not supported: this engine's is xgrammar")
        for option in filter(None, options.split(",")):
            if option not in _BACKEND_OPTIONS:
                raise ValueError(
                    f"unknown guided decoding backend option {option!r}; known: {sorted(_BACKEND_OPTIONS)}"
                )
            setattr(self, _BACKEND_OPTIONS[option], True)
        super().__post_init__()

    def structured_outputs(self) -> StructuredOutputsParams:
        fields = StructuredOutputsParams.__dataclass_fields__
        return StructuredOutputsParams(**{name: getattr(self, name) for name in fields})


_SCHEMA_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def check_json_schema(schema) -> None:
    if not isinstance(schema, dict | bool):
        raise ValueError(f"a JSON schema is an object (or a boolean), got {type(schema).__name__}")
    if len(json.dumps(schema)) > MAX_SPEC_CHARS:
        raise ValueError(f"the JSON schema is larger than {MAX_SPEC_CHARS} characters")
    _check_schema_node(schema, "schema")


def _check_schema_node(node, where: str) -> None:
    """The shape errors a schema most often has, each named by its path."""
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise ValueError(f"{where} must be a JSON schema object, got {type(node).__name__}")
    types = node.get("type")
    for t in types if isinstance(types, list) else [types] if types is not None else []:
        if t not in _SCHEMA_TYPES:
            raise ValueError(f"{where}.type {t!r} is not a JSON schema type ({', '.join(sorted(_SCHEMA_TYPES))})")
    if "properties" in node:
        if not isinstance(node["properties"], dict):
            raise ValueError(f"{where}.properties must be an object")
        for name, sub in node["properties"].items():
            _check_schema_node(sub, f"{where}.properties.{name}")
    if "required" in node and not (
        isinstance(node["required"], list) and all(isinstance(r, str) for r in node["required"])
    ):
        raise ValueError(f"{where}.required must be a list of property names")
    if "enum" in node and not (isinstance(node["enum"], list) and node["enum"]):
        raise ValueError(f"{where}.enum must be a non-empty list")
    for bound in ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties"):
        value = node.get(bound)
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            raise ValueError(f"{where}.{bound} must be a non-negative integer, got {value!r}")
    for low, high in (("minItems", "maxItems"), ("minLength", "maxLength"), ("minimum", "maximum")):
        if (
            isinstance(node.get(low), int | float)
            and isinstance(node.get(high), int | float)
            and node[low] > node[high]
        ):
            raise ValueError(f"{where}.{low} ({node[low]}) exceeds {high} ({node[high]})")
    if "pattern" in node:
        check_regex(node["pattern"], f"{where}.pattern")
    if "items" in node:
        _check_schema_node(node["items"], f"{where}.items")
    for group in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if group in node:
            if not isinstance(node[group], list) or not node[group]:
                raise ValueError(f"{where}.{group} must be a non-empty list of schemas")
            for i, sub in enumerate(node[group]):
                _check_schema_node(sub, f"{where}.{group}[{i}]")
    for defs in ("$defs", "definitions"):
        for name, sub in (node.get(defs) or {}).items():
            _check_schema_node(sub, f"{where}.{defs}.{name}")


def check_regex(pattern, where: str = "regex") -> None:
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"{where} must be a non-empty string")
    if len(pattern) > MAX_SPEC_CHARS:
        raise ValueError(f"{where} is longer than {MAX_SPEC_CHARS} characters")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"{where} is not a valid regular expression: {exc}") from None


def check_choice(choice) -> None:
    if not (isinstance(choice, list | tuple) and choice and all(isinstance(c, str) and c for c in choice)):
        raise ValueError("choice must be a non-empty list of non-empty strings")
    if sum(len(c) for c in choice) > MAX_SPEC_CHARS:
        raise ValueError(f"choice holds more than {MAX_SPEC_CHARS} characters")


def check_grammar(grammar) -> None:
    if not isinstance(grammar, str) or not grammar.strip():
        raise ValueError("grammar must be a non-empty EBNF (or Lark) grammar string")
    if len(grammar) > MAX_SPEC_CHARS:
        raise ValueError(f"grammar is longer than {MAX_SPEC_CHARS} characters")


def check_json_object(value) -> None:
    if value is not True:
        raise ValueError(f"json_object must be true when given, got {value!r}")


def as_structured_outputs(value) -> StructuredOutputsParams | None:
    """SamplingParams' field from a StructuredOutputsParams or its dict (a shard input line)."""
    if isinstance(value, GuidedDecodingParams):
        return value.structured_outputs()
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        unknown = set(value) - set(StructuredOutputsParams.__dataclass_fields__)
        if unknown:
            raise ValueError(f"structured_outputs has unknown fields {sorted(unknown)}")
        return StructuredOutputsParams(**value)
    raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {type(value).__name__}")
