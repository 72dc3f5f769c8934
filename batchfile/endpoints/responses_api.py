"""`/v1/responses` lines: the body read as the chat request it amounts to (input items as messages,
`instructions` as the system message, `max_output_tokens`, `text.format`, function tools), and the
chat answer reshaped as a Responses `response` object."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping

from batchfile.errors import INVALID_MESSAGES, INVALID_PARAMETER, UNSUPPORTED_PARAMETER, InvalidLine

# Responses field -> chat field, for those that only change name
_RENAMED = {
    "max_output_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "parallel_tool_calls": "parallel_tool_calls",
    "model": "model",
    "top_logprobs": "top_logprobs",
    "structured_outputs": "structured_outputs",
    "seed": "seed",
}
_IGNORED = {"metadata", "store", "user", "service_tier", "prompt_cache_key", "safety_identifier", "background"}
_HARMLESS = {"stream": (None, False), "truncation": (None, "disabled"), "reasoning": (None,), "include": (None, [])}
_ECHOED = ("instructions", "max_output_tokens", "temperature", "top_p", "text", "metadata")


def to_chat_body(body: Mapping) -> tuple[dict, dict]:
    """(the equivalent chat body, what the response echoes back)."""
    chat: dict = {}
    for key, value in body.items():
        if value is None or key in ("input", "instructions", "text", "tools", "tool_choice") or key in _IGNORED:
            continue
        if key in _RENAMED:
            chat[_RENAMED[key]] = value
        elif key in _HARMLESS:
            if value not in _HARMLESS[key]:
                raise InvalidLine(UNSUPPORTED_PARAMETER, f"{key}={json.dumps(value)[:60]} is not supported")
        else:
            raise InvalidLine(UNSUPPORTED_PARAMETER, f"unknown parameter {key!r:.60} for /v1/responses")
    chat["messages"] = _messages(body.get("input"), body.get("instructions"))
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if fmt is not None:
        chat["response_format"] = _response_format(fmt)
    if body.get("tools"):
        chat["tools"] = (
            [_tool(i, t) for i, t in enumerate(body["tools"])] if isinstance(body["tools"], list) else body["tools"]
        )
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    echo = {k: body.get(k) for k in _ECHOED}
    echo.update(
        tools=body.get("tools") or [],
        tool_choice=body.get("tool_choice") or "auto",
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
    )
    return chat, echo


def _messages(items, instructions) -> list[dict]:
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidLine(INVALID_PARAMETER, "instructions must be a string")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise InvalidLine(INVALID_MESSAGES, "input must be a string or a non-empty array of items")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InvalidLine(INVALID_MESSAGES, f"input[{i}] must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _content(i, item.get("content"))})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": output if isinstance(output, str) else json.dumps(output),
                }
            )
        else:
            raise InvalidLine(INVALID_MESSAGES, f"input[{i}].type {kind!r:.40} is not supported")
    return messages


def _content(i: int, content):
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "input_image":  # checked with the chat parts
                parts.append(part)
                continue
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                raise InvalidLine(
                    INVALID_MESSAGES, f"input[{i}].content[{j}] must be an input_text or input_image part"
                )
            parts.append({"type": "text", "text": part.get("text")})
        return parts
    return content


def _response_format(fmt) -> dict:
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidLine(INVALID_PARAMETER, "text.format.type must be text, json_object or json_schema")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def _tool(i: int, tool) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise InvalidLine(UNSUPPORTED_PARAMETER, f"tools[{i}] of type {kind!r:.40} is not supported (function only)")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def response_object(chat_body: dict, echo: Mapping, *, cached_tokens: int = 0) -> dict:
    """The Responses `response` for a chat.completion body of one choice."""
    choice = chat_body["choices"][0]
    message, output = choice["message"], []
    if message.get("content"):
        output.append(
            {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex}",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": message["content"], "annotations": []}],
            }
        )
    for call in message.get("tool_calls") or []:
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{uuid.uuid4().hex}",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    usage = chat_body["usage"]
    cut = choice["finish_reason"] == "length"
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": chat_body["created"],
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "model": chat_body["model"],
        "output": output,
        **{k: echo.get(k) for k in _ECHOED},
        "tools": echo["tools"],
        "tool_choice": echo["tool_choice"],
        "parallel_tool_calls": echo["parallel_tool_calls"],
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
    }
