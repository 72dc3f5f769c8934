"""A line's output constraint: OpenAI's `response_format` (`json_object`, `json_schema` with name,
schema and strict) and vLLM's `structured_outputs` extension (`choice`, `regex`, `grammar`, `json`,
`json_object`), as the engine's `StructuredOutputsParams`.

The shape of the constraint is checked here (torch-free); the worker's engine compiles it with
xgrammar and refuses, per request, what xgrammar cannot build.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from batchfile.errors import INVALID_PARAMETER, InvalidLine
from engine.params.structured_params import StructuredOutputsParams

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for json_schema and function names
FIELDS = frozenset({"response_format", "structured_outputs"})


def _invalid(message: str) -> InvalidLine:
    return InvalidLine(INVALID_PARAMETER, message)


def build(where: str, **fields) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except (ValueError, TypeError) as e:
        raise _invalid(f"{where}: {e}") from None


_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback")


def from_body(body: Mapping) -> StructuredOutputsParams | None:
    """The constraint a body asks for, or None; at most one of the two fields may set one. A
    `structured_outputs` of options only (e.g. {"disable_any_whitespace": false}: JSON with any whitespace,
    compact being the default) tunes the constraint of `response_format`."""
    extension = body.get("structured_outputs")
    if isinstance(extension, dict) and extension and set(extension) <= set(_OPTIONS):
        if not isinstance(body.get("response_format"), dict):
            raise _invalid(f"structured_outputs {sorted(extension)} tune a constraint; give one with it")
        spec = _response_format(body["response_format"])
        if spec is None:
            raise _invalid(f"structured_outputs {sorted(extension)} tune a JSON constraint; response_format is text")
        return build("structured_outputs", **{**spec.to_dict(), **extension})
    from_format = _response_format(body.get("response_format"))
    from_extension = _extension(extension)
    if from_format is not None and from_extension is not None:
        raise _invalid("response_format and structured_outputs both constrain the output; give one")
    return from_format or from_extension


def _response_format(value) -> StructuredOutputsParams | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _invalid('response_format must be an object such as {"type": "json_schema", ...}')
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return build("response_format", json_object=True)
    if kind != "json_schema":
        raise _invalid(f"response_format.type must be text, json_object or json_schema, got {kind!r:.40}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _invalid("response_format.json_schema must be an object with a name and a schema")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _invalid("response_format.json_schema.name must be 1-64 letters, digits, '_' or '-'")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _invalid("response_format.json_schema.strict must be a boolean")
    schema = spec.get("schema", {"type": "object"})  # no schema: any JSON object
    return build("response_format.json_schema.schema", json=schema)


def _extension(value) -> StructuredOutputsParams | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _invalid('structured_outputs must be an object such as {"choice": [...]}')
    unknown = set(value) - set(StructuredOutputsParams.__dataclass_fields__)
    if unknown:
        raise _invalid(f"structured_outputs has unknown fields {sorted(unknown)}")
    if isinstance(value.get("json"), str):
        try:
            value = {**value, "json": json.loads(value["json"])}
        except ValueError as e:
            raise _invalid(f"structured_outputs.json is not valid JSON: {e}") from None
    return build("structured_outputs", **value)


def check_name(where: str, name) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise _invalid(f"{where} must be 1-64 letters, digits, '_' or '-', got {name!r:.70}")
    return name
