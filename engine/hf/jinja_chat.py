"""Chat templates rendered with `jinja2` alone, as `transformers.apply_chat_template(tokenize=False)` renders
them: the same sandboxed environment (trim_blocks, lstrip_blocks, loop controls, a no-op `generation` block),
the same globals (`raise_exception`, `strftime_now`, `dict`, a namespace refusing underscore names), the
`tojson` filter without HTML escaping, messages normalised the same way (None values dropped, reasoning
fields aliased), the tokenizer's named special tokens as variables. No torch, no transformers: the API
renders here (`tests/engine/test_light_tokenizer.py` proves byte equality with transformers).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# transformers' `apply_chat_template` arguments: template variables may not set them
OWN_ARGUMENTS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers tracks assistant spans with it)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller):
        return caller()


class _TemplateDict:
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes ({name!r})"
            )


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(), namespace=_Namespace
    )
    return env.from_string(source)


def _plain(value):
    """JSON-shaped copies of what the template sees (as transformers rebuilds it for the sandbox)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _message(message) -> dict:
    if not isinstance(message, dict):
        raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
    message = _plain({k: v for k, v in message.items() if v is not None})
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def pick_template(chat_template, tools) -> str:
    """The template to use: the only one, or from a dict of named ones `tool_use` (with tools) or `default`."""
    if isinstance(chat_template, dict):
        if tools is not None and "tool_use" in chat_template:
            return chat_template["tool_use"]
        if "default" in chat_template:
            return chat_template["default"]
        raise ValueError(f"this model has several chat templates and no default: {sorted(chat_template)}")
    if not chat_template:
        raise ValueError("this model's tokenizer has no chat template; use completions instead")
    return chat_template


def render(
    chat_template,
    conversations: list[list[dict]],
    special_tokens: Mapping[str, str],
    *,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    add_generation_prompt: bool = True,
    **kwargs,
) -> list[str]:
    """Each conversation through the template; `special_tokens` (bos_token, eos_token, ...) are variables
    that `kwargs` may override."""
    template = compile_template(pick_template(chat_template, tools))
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise ValueError("tools should be JSON schemas")
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    variables = _plain({**special_tokens, **kwargs})
    tools, documents = _plain(tools), _plain(documents)
    return [
        template.render(
            messages=[_message(m) for m in chat],
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
        for chat in conversations
    ]
