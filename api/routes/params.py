"""Query, form and JSON body parameters, checked: a bad one is a 400 naming it, never a 500."""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Mapping
from typing import Annotated

from flask import request
from pydantic import BaseModel, TypeAdapter, ValidationError

from api.errors import ApiError
from api.inputs import JSON_PARTS
from api.objects import METADATA_KEY_CHARS, METADATA_PAIRS, METADATA_VALUE_CHARS
from store.models import INVALID_LINE_POLICIES, MAX_PRIORITY, MIN_PRIORITY

MAX_PARAM_DEPTH = 32  # nesting of a JSON parameter (defaults); deeper is a 400, never a RecursionError
INTEGER = re.compile(r"-?\d{1,18}(?:\.0+)?")  # an integer parameter's text: 3 or 3.0, no "+", no spaces


def declared(model: type[BaseModel], source: Mapping[str, str]) -> dict:
    """The fields of `model` (api.inputs) that `source` (query arguments or form fields) holds, each
    checked against its declaration, the one the OpenAPI document publishes: integers from their digits,
    JSON parts parsed. A 400 names the first bad one; absent fields are left out."""
    values = {}
    for name, field in model.model_fields.items():
        if name not in source:
            continue
        raw = source[name]
        if name in JSON_PARTS:
            value = parse_json(raw, name, name)
            _check_json_value(value, name)
        elif field.annotation is int and INTEGER.fullmatch(raw):
            value = int(raw.partition(".")[0])
        else:
            value = raw
        values[name] = checked(model, name, value)
    return values


@functools.cache
def _adapter(model: type[BaseModel], name: str) -> TypeAdapter:
    field = model.model_fields[name]
    return TypeAdapter(Annotated[field.annotation, field])


def checked(model: type[BaseModel], name: str, value):
    """`value` as `model`'s field `name` declares it (strictly: no string for a number), or a 400."""
    try:
        return _adapter(model, name).validate_python(value, strict=True)
    except ValidationError as exc:
        raise invalid(exc, name) from None


def invalid(exc: ValidationError, prefix: str | None = None) -> ApiError:
    """A 400 for pydantic's first error, naming the parameter (dotted into objects)."""
    error = exc.errors(include_url=False)[0]
    param = ".".join([*([prefix] if prefix else []), *(str(p) for p in error["loc"])])
    got = error.get("input")
    shown = f", got {got!r:.40}" if isinstance(got, str | int | float | bool) else ""
    if error["type"] in ("int_type", "int_parsing", "int_from_float"):
        return ApiError(400, f"{param} must be an integer{shown}", param=param)
    return ApiError(400, f"{param or 'the request body'}: {error['msg']}{shown}", param=param or None)


def parse_json(text, what: str, param: str | None = None):
    """JSON text (str or bytes) as a 400 when it is not JSON, however deeply it nests."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and bad UTF-8 are ValueErrors
        raise ApiError(400, f"{what} is not valid JSON: {str(exc)[:200]}", param=param) from None


def _check_json_value(value, name: str) -> None:
    """No nesting past MAX_PARAM_DEPTH, no NUL characters and no NaN or infinities (jsonb refuses them)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_PARAM_DEPTH:
            raise ApiError(400, f"{name} nests deeper than {MAX_PARAM_DEPTH} levels", param=name)
        if isinstance(item, dict):
            stack.extend((k, depth) for k in item)
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
        elif isinstance(item, str) and "\x00" in item:
            raise ApiError(400, f"{name} must not contain NUL characters", param=name)
        elif isinstance(item, float) and not math.isfinite(item):  # NaN, Infinity, 1e999: not JSON
            raise ApiError(400, f"{name} must hold finite numbers only", param=name)


def json_param(value, name: str) -> dict | None:
    """A JSON object given as a form field or query argument (a string) or inline in a JSON body."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        value = parse_json(value, name, name)
    if not isinstance(value, dict):
        raise ApiError(400, f"{name} must be a JSON object", param=name)
    _check_json_value(value, name)
    return value


def metadata_param(value) -> dict | None:
    """OpenAI's metadata: at most 16 pairs of strings, keys up to 64 and values up to 512 characters."""
    metadata = json_param(value, "metadata")
    if metadata is None:
        return None
    if len(metadata) > METADATA_PAIRS:
        raise ApiError(400, f"metadata holds at most {METADATA_PAIRS} pairs", param="metadata")
    for key, item in metadata.items():
        if not isinstance(item, str):
            raise ApiError(400, f"metadata[{key!r:.70}] must be a string", param="metadata")
        if len(key) > METADATA_KEY_CHARS or len(item) > METADATA_VALUE_CHARS:
            raise ApiError(
                400,
                f"metadata keys are at most {METADATA_KEY_CHARS} and values at most {METADATA_VALUE_CHARS} characters",
                param="metadata",
            )
    return metadata


def invalid_lines_param(value, default: str) -> str:
    """`on_invalid_lines`: "fail" (the whole job fails when a line is invalid) or "skip" (the valid
    lines run, the invalid ones are reported)."""
    if value is None or value == "":
        return default
    if value not in INVALID_LINE_POLICIES:
        raise ApiError(
            400, f"on_invalid_lines must be one of {', '.join(INVALID_LINE_POLICIES)}", param="on_invalid_lines"
        )
    return value


def priority_param(value) -> int:
    """A job's `priority` (vLLM's meaning: a lower value is served first, among its tenant's jobs): an
    integer from MIN_PRIORITY to MAX_PRIORITY, given as a form or query string or a JSON integer; 0 when absent."""
    if value is None or value == "":
        return 0
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d{1,12}(?:\.0+)?\s*", value):
        value = int(value.strip().partition(".")[0])
    if isinstance(value, float) and value.is_integer():  # JSON Schema's integer: 3.0 is one
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"priority must be an integer, got {value!r:.40}", param="priority")
    if not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise ApiError(
            400,
            f"priority must be between {MIN_PRIORITY} and {MAX_PRIORITY} (a lower value is served first), got {value}",
            param="priority",
        )
    return value


def reject_nul_bytes() -> None:
    """A NUL in a path id or query argument is a 400: PostgreSQL text cannot hold one."""
    for name, value in [*(request.view_args or {}).items(), *request.args.items(multi=True)]:
        if isinstance(value, str) and "\x00" in value:
            raise ApiError(400, f"{name} must not contain NUL characters", param=name)


def query(model: type[BaseModel]) -> BaseModel:
    """The request's query parameters as `model` (api.inputs) declares them, defaults filled in."""
    return model.model_construct(**declared(model, request.args))


EXPIRES_MIN_S, EXPIRES_MAX_S = 3600, 30 * 24 * 3600  # OpenAI's range: an hour to 30 days


def expires_after_param(form, name: str = "expires_after") -> int | None:
    """OpenAI's `expires_after` ({anchor: "created_at", seconds}) as seconds after creation, from a
    multipart form (the official client sends `expires_after[anchor]` and `expires_after[seconds]`)
    or a JSON object; None when absent."""
    raw = form.get(name)
    value = json_param(raw, name) if raw else None
    if value is not None:
        return expires_after_value(value, name)
    return _expires_seconds(form.get(f"{name}[anchor]"), form.get(f"{name}[seconds]"), name)


def expires_after_value(value, name: str) -> int | None:
    """The same from a JSON body's object (a batch's `output_expires_after`)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApiError(400, f"{name} must be an object {{anchor, seconds}}", param=name)
    return _expires_seconds(value.get("anchor"), value.get("seconds"), name)


def _expires_seconds(anchor, seconds, name: str) -> int | None:
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise ApiError(400, f"{name}.anchor must be 'created_at'", param=f"{name}.anchor")
    try:
        if isinstance(seconds, float) and seconds.is_integer():
            seconds = int(seconds)
        if isinstance(seconds, bool | float):
            raise TypeError
        seconds = int(seconds)
    except (TypeError, ValueError):
        raise ApiError(400, f"{name}.seconds must be an integer", param=f"{name}.seconds") from None
    if not EXPIRES_MIN_S <= seconds <= EXPIRES_MAX_S:
        raise ApiError(
            400, f"{name}.seconds must be between {EXPIRES_MIN_S} and {EXPIRES_MAX_S}", param=f"{name}.seconds"
        )
    return seconds


def json_body(model: type[BaseModel], max_bytes: int = 1 << 16) -> BaseModel:
    """The request's JSON object body, validated strictly as `model` (api.objects) declares it; a 400 names
    the first bad field, a 413 answers a body over `max_bytes`."""
    raw = request.stream.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise ApiError(413, f"the request body is at most {max_bytes} bytes", code="payload_too_large")
    body = parse_json(raw or b"{}", "the request body")
    if not isinstance(body, dict):
        raise ApiError(400, "expected a JSON object body")
    try:  # the declared fields are checked (no NUL in their strings); others are ignored
        return model.model_validate(body, strict=True)
    except ValidationError as exc:
        raise invalid(exc) from None
