"""Checks of one value from a request body: numbers and flags by type and range, the chat
messages, the completion prompt."""

from __future__ import annotations

import json
import math

from batchfile.errors import INVALID_MESSAGES, INVALID_PARAMETER, INVALID_PROMPT, InvalidLine
from batchfile.images import image_part

MAX_INT32 = 2**31 - 1  # integer parameters end up in tensors: bound them before a worker overflows


def type_name(value) -> str:
    """The JSON name of a decoded value's type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def as_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidLine(
            INVALID_PARAMETER, f"{name} must be an integer, got {type_name(value)} {value!r:.40}", param=name
        )
    return value


def as_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidLine(
            INVALID_PARAMETER, f"{name} must be a number, got {type_name(value)} {value!r:.40}", param=name
        )
    value = float(value)
    if not math.isfinite(value):
        raise InvalidLine(INVALID_PARAMETER, f"{name} must be a finite number", param=name)
    return value


def as_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise InvalidLine(INVALID_PARAMETER, f"{name} must be true or false, got {type_name(value)}", param=name)
    return value


def as_stop(name: str, value) -> list[str] | None:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidLine(
            INVALID_PARAMETER, f"{name} must be a non-empty string or a list of non-empty strings", param=name
        )
    return stops or None


def as_token_ids(name: str, value) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise InvalidLine(INVALID_PARAMETER, f"{name} must be a list of integers", param=name)
    if not all(0 <= t <= MAX_INT32 for t in value):
        raise InvalidLine(INVALID_PARAMETER, f"{name} must be token ids in [0, {MAX_INT32}]", param=name)
    return value


def in_range(name: str, value, low, high):
    if not low <= value <= high:
        raise InvalidLine(INVALID_PARAMETER, f"{name} must be in [{low}, {high}], got {value}", param=name)
    return value


def bounded_int(low: int, high: int):
    """A converter for an integer field that must lie in [low, high]."""
    return lambda name, value: in_range(name, as_int(name, value), low, high)


CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def messages_of(value) -> list[dict]:
    """body.messages as plain {role, content} messages (text parts joined, developer as system)."""
    if value is None:
        raise InvalidLine(INVALID_MESSAGES, "body.messages is required for /v1/chat/completions")
    if not isinstance(value, list) or not value:
        raise InvalidLine(INVALID_MESSAGES, "body.messages must be a non-empty array")
    return [_message(i, message) for i, message in enumerate(value)]


def _message(i: int, message) -> dict:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise InvalidLine(INVALID_MESSAGES, f"{where} must be an object")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise InvalidLine(INVALID_MESSAGES, f"{where}.role must be one of {sorted(CHAT_ROLES)}, got {role!r:.40}")
    content = message.get("content")
    calls = message.get("tool_calls") if role == "assistant" else None
    if content is None and calls:
        content = ""  # an assistant turn that only calls tools
    if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PARTS for p in content):
        content = [
            image_part(f"{where}.content[{j}]", part)
            if part.get("type") in IMAGE_PARTS
            else {"type": "text", "text": _text_part(f"{where}.content[{j}]", part)}
            for j, part in enumerate(content)
        ]
    elif isinstance(content, list):
        content = "\n".join(_text_part(f"{where}.content[{j}]", part) for j, part in enumerate(content))
    elif not isinstance(content, str):
        raise InvalidLine(INVALID_MESSAGES, f"{where}.content must be a string or an array of text parts")
    out = {"role": "system" if role == "developer" else role, "content": content}
    if calls:
        out["tool_calls"] = _tool_calls(where, calls)
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise InvalidLine(INVALID_MESSAGES, f"{where}.tool_call_id is required (a string) for a tool message")
        out["tool_call_id"] = call_id
    return out


def _tool_calls(where: str, calls) -> list[dict]:
    """An assistant message's tool calls, arguments as objects (what chat templates expect)."""
    if not isinstance(calls, list):
        raise InvalidLine(INVALID_MESSAGES, f"{where}.tool_calls must be an array")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidLine(INVALID_MESSAGES, f"{where}.tool_calls[{j}] must hold function.name and arguments")
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            raise InvalidLine(INVALID_MESSAGES, f"{where}.tool_calls[{j}].function.arguments is not JSON") from None
        out.append(
            {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}
        )
    return out


IMAGE_PARTS = ("image_url", "input_image")


def _text_part(where: str, part) -> str:
    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        kind = part.get("type") if isinstance(part, dict) else type_name(part)
        raise InvalidLine(
            INVALID_MESSAGES, f"{where} must be a text part {{'type': 'text', 'text': ...}}, got {kind!r:.40}"
        )
    return part["text"]


def prompt_of(value, vocab_size: int) -> tuple[str | None, list[int] | None]:
    """body.prompt as (text, None) or (None, token ids); a batch of one prompt is that prompt."""
    if value is None:
        raise InvalidLine(INVALID_PROMPT, "body.prompt is required for /v1/completions")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str | list) and not value:
        raise InvalidLine(INVALID_PROMPT, "body.prompt must not be empty")
    if isinstance(value, str):
        return value, None
    if isinstance(value, list):
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            bad = next((t for t in value if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise InvalidLine(INVALID_PROMPT, f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")
            return None, value
        if all(isinstance(p, str | list) for p in value):
            raise InvalidLine(
                INVALID_PROMPT,
                f"body.prompt holds {len(value)} prompts; a batch line takes one prompt "
                "(put each prompt on its own line)",
            )
    raise InvalidLine(INVALID_PROMPT, "body.prompt must be a string or an array of token ids")
