"""A request body's generation fields (OpenAI's and vLLM's names) as `SamplingParams` arguments."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from batchfile.endpoints import completion_options, structured, tool_calls
from batchfile.errors import INVALID_PARAMETER, OUTPUT_BUDGET_EXCEEDED, UNSUPPORTED_PARAMETER, InvalidLine
from batchfile.fields import (
    MAX_INT32,
    as_bool,
    as_float,
    as_int,
    as_stop,
    as_token_ids,
    bounded_int,
    in_range,
)
from batchfile.request import CHAT_URL

MAX_N = 128
MAX_LOGPROBS = 20  # chat's top_logprobs (OpenAI's range)
MAX_COMPLETIONS_LOGPROBS = 5  # completions' logprobs (OpenAI's range)
MAX_TEMPERATURE = 2.0
OPENAI_MAX_STOP_STRINGS = 4
MIN_TOP_P = 1e-9  # what top_p 0 (OpenAI: only the most likely token) becomes: the engine keeps just the top token


@dataclass(frozen=True)
class RequestBounds:
    """What one request may ask for, so that no line can cost unbounded memory or time."""

    max_stop_strings: int = OPENAI_MAX_STOP_STRINGS
    max_stop_chars: int = 1000  # the length of one stop string
    max_output_tokens: int = 1 << 18  # n x max_tokens x (1 + logprobs asked per token)


OPENAI_BOUNDS = RequestBounds()
# OpenAI's default for /v1/completions; chat defaults to the rest of the context.
DEFAULT_COMPLETIONS_MAX_TOKENS = 16

# body field -> (SamplingParams field, converter)
_SAMPLING_FIELDS = {
    "max_tokens": ("max_tokens", as_int),
    "max_completion_tokens": ("max_tokens", as_int),
    "temperature": ("temperature", lambda name, value: _temperature(name, value)),
    "top_p": ("top_p", lambda name, value: _top_p(name, value)),
    "n": ("n", bounded_int(1, MAX_N)),
    "stop": ("stop", as_stop),
    "seed": ("seed", bounded_int(-(2**63), 2**63 - 1)),
    "presence_penalty": ("presence_penalty", as_float),
    "frequency_penalty": ("frequency_penalty", as_float),
    "top_k": ("top_k", bounded_int(-1, MAX_INT32)),
    "min_p": ("min_p", as_float),
    "min_tokens": ("min_tokens", as_int),
    "repetition_penalty": ("repetition_penalty", as_float),
    "ignore_eos": ("ignore_eos", as_bool),
    "stop_token_ids": ("stop_token_ids", as_token_ids),
    "skip_special_tokens": ("skip_special_tokens", as_bool),
    "logit_bias": ("logit_bias", completion_options.as_logit_bias),
}


def _temperature(name: str, value) -> float:
    return in_range(name, as_float(name, value), 0, MAX_TEMPERATURE)


def _top_p(name: str, value) -> float:
    """OpenAI's [0, 1]; 0 (the most likely token only) as MIN_TOP_P, since the engine takes (0, 1]."""
    return in_range(name, as_float(name, value), 0, 1) or MIN_TOP_P


def _always(value) -> bool:
    return True


def _falsy(value) -> bool:
    return not value


def _none(value) -> bool:
    return value is None


# Fields OpenAI clients send that do not change generation here: ignored when the value is harmless.
_IGNORED_FIELDS = {
    "user": _always,
    "metadata": _always,
    "store": _always,
    "service_tier": _always,
    "prompt_cache_key": _always,
    "safety_identifier": _always,
    "stream": lambda v: v is None or v is False,
    "stream_options": _none,
    "functions": _falsy,
    "function_call": lambda v: v in (None, "none", "auto"),
    "modalities": lambda v: v is None or v == ["text"],
    "echo": lambda v: v is None or v is False,
    "suffix": _falsy,
    "best_of": lambda v: v is None or v == 1,
    "prediction": _none,
    "audio": _none,
    "reasoning_effort": _none,
    "web_search_options": _none,
}
# Fields read with the prompt rather than mapped onto SamplingParams.
_CHAT_OWN = frozenset({"model", "messages", "chat_template_kwargs", "add_special_tokens"})
_COMPLETIONS_OWN = frozenset({"model", "prompt", "add_special_tokens", *completion_options.FIELDS})
_OTHER_ENDPOINT = frozenset({"messages", "prompt", "top_logprobs", "chat_template_kwargs", *tool_calls.FIELDS})
_READ_ELSEWHERE = structured.FIELDS | tool_calls.FIELDS  # the output constraint and the tools


def sampling_kwargs(body: Mapping, url: str, bounds: RequestBounds = OPENAI_BOUNDS) -> tuple[dict, bool]:
    """SamplingParams keyword arguments from the body's fields, and whether max_tokens was given.

    Without max_tokens a completion gets OpenAI's default and a chat request None (the rest of
    the context, known once the prompt is tokenized).
    """
    kwargs: dict = {}
    chat = url == CHAT_URL
    own = _CHAT_OWN if chat else _COMPLETIONS_OWN
    for key, value in body.items():
        if key not in own and value is not None and not (key in _READ_ELSEWHERE and (chat or key in structured.FIELDS)):
            _map_field(key, value, url, chat, kwargs)
    spec = structured.from_body(body)
    if spec is not None:
        kwargs["structured_outputs"] = spec
    if chat:
        _chat_logprobs(body, kwargs)
    _check_stops(kwargs.get("stop"), bounds)
    mt, mct = body.get("max_tokens"), body.get("max_completion_tokens")
    if mt is not None and mct is not None and mt != mct:
        raise InvalidLine(INVALID_PARAMETER, f"max_tokens ({mt}) and max_completion_tokens ({mct}) disagree")
    explicit = "max_tokens" in kwargs
    if not explicit:
        kwargs["max_tokens"] = None if chat else DEFAULT_COMPLETIONS_MAX_TOKENS
    return kwargs, explicit


def _map_field(key: str, value, url: str, chat: bool, kwargs: dict) -> None:
    field = _SAMPLING_FIELDS.get(key)
    if field is not None:
        kwargs[field[0]] = field[1](key, value)
    elif key == "logprobs":
        if chat:
            as_bool(key, value)
        else:
            kwargs["logprobs"] = bounded_int(0, MAX_COMPLETIONS_LOGPROBS)(key, value)
    elif key == "top_logprobs" and chat:
        bounded_int(0, MAX_LOGPROBS)(key, value)
    elif key in _IGNORED_FIELDS:
        if not _IGNORED_FIELDS[key](value):
            if key == "stream":
                raise InvalidLine(UNSUPPORTED_PARAMETER, "stream=true is not supported in a batch request")
            raise InvalidLine(UNSUPPORTED_PARAMETER, f"{key}={json.dumps(value)[:60]} is not supported")
    elif key in tool_calls.FIELDS and (not value or key == "parallel_tool_calls"):
        pass  # no tools on /v1/completions: harmless when empty, as before tools were supported
    elif key in _OTHER_ENDPOINT:
        raise InvalidLine(UNSUPPORTED_PARAMETER, f"{key} is not a parameter of {url}")
    else:
        raise InvalidLine(UNSUPPORTED_PARAMETER, f"unknown parameter {key!r:.60}")


def _check_stops(stops: list[str] | None, bounds: RequestBounds) -> None:
    """Every stop string is checked as text is generated: bound how many and how long."""
    if not stops:
        return
    if len(stops) > bounds.max_stop_strings:
        raise InvalidLine(INVALID_PARAMETER, f"stop holds {len(stops)} strings; at most {bounds.max_stop_strings}")
    longest = max(len(s) for s in stops)
    if longest > bounds.max_stop_chars:
        raise InvalidLine(INVALID_PARAMETER, f"a stop string is {longest} characters; at most {bounds.max_stop_chars}")


def check_output_budget(
    n: int, max_tokens: int, logprobs: int | None, bounds: RequestBounds, *, prompt_rows: int = 0
) -> None:
    """What a request may generate: n x max_tokens tokens, each with 1 + logprobs entries when
    logprobs are asked for (the rows a worker holds grow with it), plus the prompt's rows when
    its logprobs are asked for (echo)."""
    per_token = 1 if logprobs is None else 2 + logprobs
    cost = (n * max_tokens + prompt_rows) * per_token
    if cost > bounds.max_output_tokens:
        shape = f"n ({n}) x max_tokens ({max_tokens})"
        if prompt_rows:
            shape = f"({shape} + {prompt_rows} echoed prompt tokens)"
        if logprobs is not None:
            shape += f" x (2 + logprobs {logprobs})"
        raise InvalidLine(
            OUTPUT_BUDGET_EXCEEDED,
            f"{shape} is {cost:,}; a request may ask for at most {bounds.max_output_tokens:,}. "
            "Lower n, best_of, max_tokens or logprobs, or split the request across lines.",
        )


def _chat_logprobs(body: Mapping, kwargs: dict) -> None:
    """Chat asks with ``logprobs: true`` plus ``top_logprobs: k``; the engine takes k (0: the
    sampled token's only)."""
    wants = body.get("logprobs") is True
    top = body.get("top_logprobs")
    if top is not None and not wants:
        raise InvalidLine(INVALID_PARAMETER, "top_logprobs requires logprobs=true")
    if wants:
        kwargs["logprobs"] = top or 0


def merge_defaults(body: dict, defaults: Mapping | None) -> dict:
    """The job's default body fields under the line's own; a line's max_tokens or
    max_completion_tokens replaces both defaults."""
    if not defaults:
        return body
    merged = dict(defaults)
    if body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None:
        merged.pop("max_tokens", None)
        merged.pop("max_completion_tokens", None)
    merged.update((k, v) for k, v in body.items() if v is not None)
    return merged
