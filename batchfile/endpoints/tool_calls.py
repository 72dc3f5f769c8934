"""Function calling on chat lines: `tools`, `tool_choice` and `parallel_tool_calls` read and checked,
`required` and a named function turned into a JSON-schema constraint (so the call always
validates), and the model's output turned back into OpenAI's `message.tool_calls`.

Output formats: under `required` a JSON array of {"name", "parameters"} objects (the constraint
we impose, as vLLM does); under a named function the arguments object itself; under `auto` what
the model's template taught it: Hermes/Qwen `<tool_call>{json}</tool_call>` blocks or Llama 3.x
JSON (`{"name": ..., "parameters": ...}`, optionally after `<|python_tag|>`, several joined by `;`).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping

from batchfile.endpoints.structured import build, check_name
from batchfile.errors import INVALID_PARAMETER, InvalidLine
from engine.params.structured_params import StructuredOutputsParams

MAX_TOOLS = 128  # OpenAI's limit
FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


def _invalid(message: str) -> InvalidLine:
    return InvalidLine(INVALID_PARAMETER, message)


def read_tools(body: Mapping) -> tuple[list[dict] | None, dict | None, StructuredOutputsParams | None]:
    """(the tools for the chat template, the response options, the constraint) of a chat body."""
    tools = body.get("tools") or None
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is not None and not isinstance(parallel, bool):
        raise _invalid("parallel_tool_calls must be a boolean")
    parallel = parallel is not False
    if tools is None:
        if choice not in (None, "none"):
            raise _invalid(f"tool_choice {json.dumps(choice)[:60]} needs tools")
        return None, None, None
    schemas = _read_tools(tools)
    mode, name = _read_choice(choice, schemas)
    options = {"mode": mode, "names": sorted(schemas)}
    if mode == "named":
        options["name"] = name
        return tools, options, build("tools", json=schemas[name], disable_any_whitespace=True)
    if mode == "required":
        return tools, options, build("tools", json=required_schema(schemas, parallel), disable_any_whitespace=True)
    return tools, (options if mode == "auto" else None), None


def _read_tools(tools) -> dict[str, dict]:
    """Function name -> its parameters' schema."""
    if not isinstance(tools, list):
        raise _invalid('tools must be an array of {"type": "function", "function": {...}}')
    if len(tools) > MAX_TOOLS:
        raise _invalid(f"tools holds {len(tools)} tools; at most {MAX_TOOLS}")
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise _invalid(f'{where} must be {{"type": "function", "function": {{"name": ...}}}}')
        function = tool["function"]
        name = check_name(f"{where}.function.name", function.get("name"))
        if name in schemas:
            raise _invalid(f"{where}.function.name {name!r} is declared twice")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        build(f"{where}.function.parameters", json=parameters)  # a schema we can constrain to
        schemas[name] = parameters
    return schemas


def _read_choice(choice, schemas: dict[str, dict]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if choice in ("none", "auto", "required"):
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in schemas:
            raise _invalid(f"tool_choice names the function {name!r:.70}, which is not in tools")
        return "named", name
    raise _invalid('tool_choice must be none, auto, required or {"type": "function", "function": {"name": ...}}')


def required_schema(schemas: dict[str, dict], parallel: bool) -> dict:
    """A JSON array of one or more calls, each {"name": a declared function, "parameters": its schema}."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, parameters in schemas.items()
    ]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _call(name: str, arguments) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}


def parse_output(text: str, options: Mapping) -> tuple[str | None, list[dict]]:
    """(the message content, its tool calls) for a choice's text under the line's tool options."""
    mode = options.get("mode")
    if mode == "named":
        return None, [_call(options["name"], text)]
    if mode == "required":
        try:
            calls = json.loads(text)
            return None, [_call(c["name"], c["parameters"]) for c in calls]
        except (ValueError, KeyError, TypeError):  # cut short by max_tokens
            return text, []
    return _parse_auto(text)


def _as_call(item) -> dict | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    return _call(item["name"], arguments)


def _json_calls(text: str) -> list[dict] | None:
    """Every piece of `text` (split on ';') as a call, or None if one is not."""
    calls = []
    for piece in (p.strip() for p in text.split(";")):
        try:
            call = _as_call(json.loads(piece))
        except ValueError:
            return None
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _parse_auto(text: str) -> tuple[str | None, list[dict]]:
    if "<tool_call>" in text:
        calls = []
        for block in _HERMES.finditer(text):
            calls.extend(_json_calls(block.group(1)) or [])
        if calls:
            content = text[: text.index("<tool_call>")].strip()
            return content or None, calls
    stripped = text.strip()
    if stripped.startswith(_PYTHON_TAG):
        stripped = stripped[len(_PYTHON_TAG) :].strip()
    if stripped.startswith("{"):
        calls = _json_calls(stripped)
        if calls:
            return None, calls
    return text, []


def with_tool_calls(choice: dict, options: Mapping) -> dict:
    """A chat choice with its message's tool calls parsed out of its content."""
    message = choice["message"]
    content, calls = parse_output(message["content"] or "", options)
    if not calls:
        return choice
    message = {**message, "content": content, "tool_calls": calls}
    reason = "tool_calls" if choice["finish_reason"] == "stop" else choice["finish_reason"]
    return {**choice, "message": message, "finish_reason": reason}
