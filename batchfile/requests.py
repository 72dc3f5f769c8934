"""OpenAI-batch request lines: streaming parse and validation, and the OpenAI response shapes.

A batch input is JSONL, one request a line:
``{"custom_id": str, "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body": {...}}``.

`parse_requests` reads a binary stream line by line (never the whole file) and yields, in line
order, a `ParsedRequest` (prompt token ids and engine `SamplingParams`) or a `LineError` (1-based
line number, custom_id when known, a code from `REQUEST_ERROR_CODES` and a message). Nothing a
line contains makes it raise; only the size limits do (`InputTooLarge`, which the API maps to 413).

Lines are validated in chunks so that chat templates are rendered and prompts tokenized in batches
with the fast tokenizer. `ModelLimits` carries what validation needs from a model directory
(tokenizer, context length, vocabulary size) without loading weights.

The second half builds the OpenAI bodies (``chat.completion``, ``text_completion``) from the
engine's `RequestOutput` and the batch output/error line objects.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)

DEFAULT_MAX_LINE_BYTES = 8 * 1024 * 1024
MAX_CUSTOM_ID_LENGTH = 512
MAX_N = 128
MAX_LOGPROBS = 20
MAX_INT32 = 2**31 - 1  # integer parameters end up in tensors: bound them before a worker overflows
# OpenAI's default for /v1/completions; chat defaults to the rest of the context.
DEFAULT_COMPLETIONS_MAX_TOKENS = 16
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

# LineError codes. Every one is a problem with the request itself (an HTTP 400 in OpenAI's terms).
LINE_TOO_LONG = "line_too_long"
INVALID_UTF8 = "invalid_utf8"
INVALID_JSON = "invalid_json"
INVALID_REQUEST = "invalid_request"
INVALID_CUSTOM_ID = "invalid_custom_id"
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
INVALID_METHOD = "invalid_method"
INVALID_URL = "invalid_url"
MISSING_MODEL = "missing_model"
MODEL_NOT_FOUND = "model_not_found"
INVALID_MESSAGES = "invalid_messages"
INVALID_PROMPT = "invalid_prompt"
INVALID_PARAMETER = "invalid_parameter"
UNSUPPORTED_PARAMETER = "unsupported_parameter"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
CHAT_TEMPLATE_ERROR = "chat_template_error"
REQUEST_ERROR_CODES = frozenset({
    LINE_TOO_LONG, INVALID_UTF8, INVALID_JSON, INVALID_REQUEST, INVALID_CUSTOM_ID, DUPLICATE_CUSTOM_ID,
    INVALID_METHOD, INVALID_URL, MISSING_MODEL, MODEL_NOT_FOUND, INVALID_MESSAGES, INVALID_PROMPT,
    INVALID_PARAMETER, UNSUPPORTED_PARAMETER, CONTEXT_LENGTH_EXCEEDED, CHAT_TEMPLATE_ERROR,
})  # fmt: skip


@dataclass
class ParsedRequest:
    line: int
    custom_id: str
    url: str
    model: str  # the name of the model that serves it (the forced model's name when one is forced)
    prompt_token_ids: list[int] | None  # None only from parse_requests(..., tokenize=False)
    sampling_params: Any  # engine.SamplingParams
    body: dict  # the line's body as uploaded (before job defaults)

    @property
    def is_chat(self) -> bool:
        return self.url == CHAT_URL


@dataclass
class LineError:
    line: int
    custom_id: str | None
    code: str
    message: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class InputTooLarge(ValueError):
    """The input has more lines or bytes than allowed (HTTP 413). `actual` is a lower bound."""

    def __init__(self, what: str, limit: int, actual: int):
        self.what, self.limit, self.actual = what, limit, actual
        super().__init__(f"input has more than {limit:,} {what} (read {actual:,} so far)")


class _Invalid(Exception):
    def __init__(self, code: str, message: str):
        self.code, self.message = code, message


# --------------------------------------------------------------------------------------------------
# Model limits


@dataclass(eq=False)
class ModelLimits:
    """What request validation needs from a model: tokenizer, context length and vocabulary size."""

    name: str
    tokenizer: Any  # a Hugging Face tokenizer (fast ones are batched through their Rust backend)
    max_model_len: int
    vocab_size: int

    @classmethod
    def from_dir(cls, model_dir, *, name: str | None = None, max_model_len: int | None = None) -> ModelLimits:
        """Load (once per process and arguments) from a Hugging Face model directory; no weights."""
        return _load_limits(str(Path(model_dir).resolve()), name, max_model_len)

    def render_chat(self, conversations: list[list[dict]], template_kwargs: dict | None = None) -> list[str]:
        """Each conversation through the chat template, with the generation prompt appended."""
        kwargs = template_kwargs or {}
        compiled = self._compiled_template
        if compiled is None or not conversations:
            return self._render_public(conversations, kwargs)
        variables = {**self.tokenizer.special_tokens_map, **kwargs}
        texts = [
            compiled.render(messages=c, tools=None, documents=None, add_generation_prompt=True, **variables)
            for c in conversations
        ]
        if texts[0] != self._render_public(conversations[:1], kwargs)[0]:
            self._compiled_template = None  # this transformers renders differently: use its public path
            return self._render_public(conversations, kwargs)
        return texts

    def _render_public(self, conversations: list[list[dict]], kwargs: dict) -> list[str]:
        texts = self.tokenizer.apply_chat_template(
            conversations, tokenize=False, add_generation_prompt=True, **kwargs
        )
        return [texts] if isinstance(texts, str) else list(texts)

    @functools.cached_property
    def _compiled_template(self):
        """transformers' compiled Jinja template, rendered directly: apply_chat_template spends more
        time preparing the messages than rendering. Every batch checks its first conversation against
        apply_chat_template, so a transformers that renders differently only costs speed."""
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            return _compile_jinja_template(self.tokenizer.get_chat_template())
        except Exception:
            return None

    def encode(self, texts: list[str], *, add_special_tokens: bool) -> list[list[int]]:
        if not texts:
            return []
        backend = getattr(self.tokenizer, "backend_tokenizer", None) if self._fast else None
        if backend is not None:
            encode = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
            return [e.ids for e in encode(texts, add_special_tokens=add_special_tokens)]
        return list(self.tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"])

    def encode_chat(self, messages: list[dict], **template_kwargs) -> list[int]:
        return self.encode(self.render_chat([messages], template_kwargs), add_special_tokens=False)[0]

    def token_bound(self, text: str, *, add_special_tokens: bool) -> int | None:
        """An upper bound on ``len(encode([text]))`` without tokenizing (None: no bound known).

        Every token covers at least one byte of the normalized text, except the post-processor's
        special tokens and a prefix marker per segment (SentencePiece's "▁"); doubling the byte
        count bounds the latter generously.
        """
        if not self._fast:
            return None
        backend = self.tokenizer.backend_tokenizer
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        return 2 * len(text.encode("utf-8")) + 1 + (self._special_count if add_special_tokens else 0)

    @functools.cached_property
    def _special_count(self) -> int:
        return int(self.tokenizer.num_special_tokens_to_add(pair=False))

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    @functools.cached_property
    def _fast(self) -> bool:
        """Use the Rust backend directly only if it agrees with the tokenizer's own __call__."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if not getattr(self.tokenizer, "is_fast", False) or backend is None:
            return False
        probe = "Hello, world! <|im_start|> 12345  x\n\tÿ"
        try:
            mine = [e.ids for e in backend.encode_batch([probe], add_special_tokens=False)]
            return mine == [list(self.tokenizer(probe, add_special_tokens=False)["input_ids"])]
        except Exception:
            return False


def max_model_len_from_config(config: Mapping) -> int:
    """`max_position_embeddings`, capped by an active `sliding_window`."""
    cfg = config
    if "max_position_embeddings" not in cfg and isinstance(cfg.get("text_config"), Mapping):
        cfg = cfg["text_config"]
    length = cfg.get("max_position_embeddings")
    if not isinstance(length, int) or length <= 0:
        raise ValueError("config.json has no usable max_position_embeddings")
    window = cfg.get("sliding_window")
    if isinstance(window, int) and window > 0 and cfg.get("use_sliding_window", True) is not False:
        length = min(length, window)
    return length


@functools.lru_cache(maxsize=16)
def _load_limits(model_dir: str, name: str | None, max_model_len: int | None) -> ModelLimits:
    from transformers import AutoTokenizer

    config = json.loads((Path(model_dir) / "config.json").read_text())
    length = max_model_len_from_config(config)
    if max_model_len is not None:
        if max_model_len > length:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's context length {length}")
        length = max_model_len
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size") or len(tokenizer)
    return ModelLimits(name or Path(model_dir).name, tokenizer, length, int(vocab))


# --------------------------------------------------------------------------------------------------
# Reading lines


def _read_lines(
    stream: IO[bytes],
    max_line_bytes: int,
    max_lines: int | None = None,
    max_bytes: int | None = None,
    first_line: int = 1,
) -> Iterator[tuple[int, bytes | None]]:
    """Yield (line number, content) for non-blank lines; content None when over `max_line_bytes`."""
    number, total, count = first_line - 1, 0, 0

    def account(size: int) -> None:
        nonlocal total
        total += size
        if max_bytes is not None and total > max_bytes:
            raise InputTooLarge("bytes", max_bytes, total)

    while True:
        raw = stream.readline(max_line_bytes + 2)  # content, maybe "\r", and "\n"
        if not raw:
            return
        number += 1
        account(len(raw))
        if number == first_line and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        too_long = False
        if not raw.endswith(b"\n") and len(raw) == max_line_bytes + 2:
            too_long = True
            while True:  # skip the rest of the line without holding it
                rest = stream.readline(1 << 20)
                account(len(rest))
                if not rest or rest.endswith(b"\n"):
                    break
        content = raw.rstrip(b"\r\n")
        if len(content) > max_line_bytes:
            too_long = True
        if not too_long and not content.strip():
            continue
        count += 1
        if max_lines is not None and count > max_lines:
            raise InputTooLarge("lines", max_lines, count)
        yield number, None if too_long else content


@dataclass
class LineCount:
    lines: int  # non-blank lines
    bytes: int


def count_lines(
    stream: IO[bytes], *, max_lines: int | None = None, max_bytes: int | None = None
) -> LineCount:
    """Count non-blank lines and bytes in one cheap pass, raising `InputTooLarge` over a limit."""
    lines = total = 0
    pending = False  # the current, unfinished line has non-blank content
    while chunk := stream.read(1 << 20):
        if total == 0 and chunk.startswith(b"\xef\xbb\xbf"):
            chunk = chunk[3:]
            total += 3
        total += len(chunk)
        if max_bytes is not None and total > max_bytes:
            raise InputTooLarge("bytes", max_bytes, total)
        *complete, last = chunk.split(b"\n")
        for piece in complete:
            if pending or piece.strip():
                lines += 1
            pending = False
        pending = pending or bool(last.strip())
        if max_lines is not None and lines > max_lines:
            raise InputTooLarge("lines", max_lines, lines)
    if pending:
        lines += 1
        if max_lines is not None and lines > max_lines:
            raise InputTooLarge("lines", max_lines, lines)
    return LineCount(lines, total)


# --------------------------------------------------------------------------------------------------
# Validating one line


def _type_name(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def _as_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Invalid(INVALID_PARAMETER, f"{name} must be an integer, got {_type_name(value)} {value!r:.40}")
    return value


def _as_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Invalid(INVALID_PARAMETER, f"{name} must be a number, got {_type_name(value)} {value!r:.40}")
    value = float(value)
    if not math.isfinite(value):
        raise _Invalid(INVALID_PARAMETER, f"{name} must be a finite number")
    return value


def _as_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise _Invalid(INVALID_PARAMETER, f"{name} must be true or false, got {_type_name(value)}")
    return value


def _as_stop(name: str, value) -> list[str] | None:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _Invalid(INVALID_PARAMETER, f"{name} must be a non-empty string or a list of non-empty strings")
    return stops or None


def _as_token_ids(name: str, value) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise _Invalid(INVALID_PARAMETER, f"{name} must be a list of integers")
    if not all(0 <= t <= MAX_INT32 for t in value):
        raise _Invalid(INVALID_PARAMETER, f"{name} must be token ids in [0, {MAX_INT32}]")
    return value


def _in_range(name: str, value, low, high):
    if not low <= value <= high:
        raise _Invalid(INVALID_PARAMETER, f"{name} must be in [{low}, {high}], got {value}")
    return value


# OpenAI / vLLM body field -> (SamplingParams field, converter)
_SAMPLING_FIELDS = {
    "max_tokens": ("max_tokens", _as_int),
    "max_completion_tokens": ("max_tokens", _as_int),
    "temperature": ("temperature", _as_float),
    "top_p": ("top_p", _as_float),
    "n": ("n", lambda k, v: _in_range(k, _as_int(k, v), 1, MAX_N)),
    "stop": ("stop", _as_stop),
    "seed": ("seed", lambda k, v: _in_range(k, _as_int(k, v), -(2**63), 2**63 - 1)),
    "presence_penalty": ("presence_penalty", _as_float),
    "frequency_penalty": ("frequency_penalty", _as_float),
    "top_k": ("top_k", lambda k, v: _in_range(k, _as_int(k, v), -1, MAX_INT32)),
    "min_p": ("min_p", _as_float),
    "min_tokens": ("min_tokens", _as_int),
    "repetition_penalty": ("repetition_penalty", _as_float),
    "ignore_eos": ("ignore_eos", _as_bool),
    "stop_token_ids": ("stop_token_ids", _as_token_ids),
    "skip_special_tokens": ("skip_special_tokens", _as_bool),
}


def _always(value) -> bool:
    return True


def _falsy(value) -> bool:
    return not value


# Fields OpenAI clients send that do not change generation here: ignored when the value is harmless.
_IGNORED_FIELDS = {
    "user": _always,
    "metadata": _always,
    "store": _always,
    "service_tier": _always,
    "prompt_cache_key": _always,
    "safety_identifier": _always,
    "parallel_tool_calls": _always,
    "stream": lambda v: v is None or v is False,
    "stream_options": lambda v: v is None,
    "logit_bias": _falsy,
    "tools": _falsy,
    "functions": _falsy,
    "tool_choice": lambda v: v in (None, "none", "auto"),
    "function_call": lambda v: v in (None, "none", "auto"),
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "modalities": lambda v: v is None or v == ["text"],
    "echo": lambda v: v is None or v is False,
    "suffix": _falsy,
    "best_of": lambda v: v is None or v == 1,
    "prediction": lambda v: v is None,
    "audio": lambda v: v is None,
    "reasoning_effort": lambda v: v is None,
    "web_search_options": lambda v: v is None,
}
# Fields read with the prompt rather than mapped onto SamplingParams.
_CHAT_OWN = frozenset({"model", "messages", "chat_template_kwargs", "add_special_tokens"})
_COMPLETIONS_OWN = frozenset({"model", "prompt", "add_special_tokens"})
_OTHER_ENDPOINT = frozenset({"messages", "prompt", "top_logprobs", "chat_template_kwargs"})


@dataclass
class _Pending:
    """A line that passed the JSON checks and waits for batched rendering/tokenization."""

    line: int
    custom_id: str
    url: str
    limits: ModelLimits
    body: dict
    sampling: Any  # SamplingParams; max_tokens None until the prompt length is known (chat default)
    explicit_max_tokens: bool
    messages: list | None = None
    template_kwargs: dict | None = None
    text: str | None = None
    add_special_tokens: bool = False
    token_ids: list[int] | None = None


def _parse_json(content: bytes):
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _Invalid(INVALID_UTF8, f"line is not valid UTF-8 (byte {e.start})") from None
    try:
        return _DECODER.decode(text)
    except _Invalid:
        raise
    except (ValueError, RecursionError) as e:
        raise _Invalid(INVALID_JSON, f"line is not valid JSON: {str(e)[:200]}") from None


def _reject_constant(name: str):
    raise _Invalid(INVALID_JSON, f"line is not valid JSON: {name} is not allowed")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _messages(value) -> list[dict]:
    if value is None:
        raise _Invalid(INVALID_MESSAGES, "body.messages is required for /v1/chat/completions")
    if not isinstance(value, list) or not value:
        raise _Invalid(INVALID_MESSAGES, "body.messages must be a non-empty array")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _Invalid(INVALID_MESSAGES, f"{where} must be an object")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise _Invalid(
                INVALID_MESSAGES, f"{where}.role must be one of {sorted(CHAT_ROLES)}, got {role!r:.40}"
            )
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    kind = part.get("type") if isinstance(part, dict) else _type_name(part)
                    raise _Invalid(
                        INVALID_MESSAGES,
                        f"{where}.content[{j}] must be a text part {{'type': 'text', 'text': ...}}, "
                        f"got {kind!r:.40}",
                    )
                parts.append(part["text"])
            content = "\n".join(parts)
        elif not isinstance(content, str):
            raise _Invalid(INVALID_MESSAGES, f"{where}.content must be a string or an array of text parts")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _prompt(value, vocab_size: int) -> tuple[str | None, list[int] | None]:
    if value is None:
        raise _Invalid(INVALID_PROMPT, "body.prompt is required for /v1/completions")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one prompt
    if isinstance(value, str):
        if not value:
            raise _Invalid(INVALID_PROMPT, "body.prompt must not be empty")
        return value, None
    if isinstance(value, list):
        if not value:
            raise _Invalid(INVALID_PROMPT, "body.prompt must not be empty")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            bad = next((t for t in value if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise _Invalid(
                    INVALID_PROMPT, f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})"
                )
            return None, value
        if all(isinstance(p, str | list) for p in value):
            raise _Invalid(
                INVALID_PROMPT,
                f"body.prompt holds {len(value)} prompts; a batch line takes one prompt "
                "(put each prompt on its own line)",
            )
    raise _Invalid(INVALID_PROMPT, "body.prompt must be a string or an array of token ids")


def _sampling_kwargs(body: dict, url: str) -> tuple[dict, bool]:
    """Map the body's sampling fields onto SamplingParams keyword arguments."""
    kwargs: dict = {}
    chat = url == CHAT_URL
    own = _CHAT_OWN if chat else _COMPLETIONS_OWN
    for key, value in body.items():
        if key in own or value is None:
            continue
        field = _SAMPLING_FIELDS.get(key)
        if field is not None:
            kwargs[field[0]] = field[1](key, value)
        elif key == "logprobs":
            if chat:
                _as_bool(key, value)
            else:
                kwargs["logprobs"] = _in_range(key, _as_int(key, value), 0, MAX_LOGPROBS)
        elif key == "top_logprobs" and chat:
            _in_range(key, _as_int(key, value), 0, MAX_LOGPROBS)
        elif key in _IGNORED_FIELDS:
            if not _IGNORED_FIELDS[key](value):
                if key == "stream":
                    raise _Invalid(UNSUPPORTED_PARAMETER, "stream=true is not supported in a batch request")
                raise _Invalid(UNSUPPORTED_PARAMETER, f"{key}={json.dumps(value)[:60]} is not supported")
        elif key in _OTHER_ENDPOINT:
            raise _Invalid(UNSUPPORTED_PARAMETER, f"{key} is not a parameter of {url}")
        else:
            raise _Invalid(UNSUPPORTED_PARAMETER, f"unknown parameter {key!r:.60}")
    if chat:
        wants = body.get("logprobs") is True
        top = body.get("top_logprobs")
        if top is not None and not wants:
            raise _Invalid(INVALID_PARAMETER, "top_logprobs requires logprobs=true")
        if wants:
            kwargs["logprobs"] = top or 0
    mt, mct = body.get("max_tokens"), body.get("max_completion_tokens")
    if mt is not None and mct is not None and mt != mct:
        raise _Invalid(INVALID_PARAMETER, f"max_tokens ({mt}) and max_completion_tokens ({mct}) disagree")
    explicit = "max_tokens" in kwargs
    if not explicit:
        kwargs["max_tokens"] = None if chat else DEFAULT_COMPLETIONS_MAX_TOKENS
    return kwargs, explicit


def _merge_defaults(body: dict, defaults: Mapping | None) -> dict:
    if not defaults:
        return body
    merged = dict(defaults)
    if body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None:
        merged.pop("max_tokens", None)
        merged.pop("max_completion_tokens", None)
    merged.update((k, v) for k, v in body.items() if v is not None)
    return merged


class _LineParser:
    def __init__(self, models, defaults: Mapping | None):
        if isinstance(models, ModelLimits):
            self.forced: ModelLimits | None = models
            self.models: Mapping[str, ModelLimits] = {models.name: models}
        else:
            self.forced, self.models = None, models
        self.defaults = defaults
        self.seen: set[str] = set()
        from engine.sampling_params import SamplingParams

        self.SamplingParams = SamplingParams

    def envelope(self, line: int, content: bytes) -> tuple[str, dict]:
        obj = _parse_json(content)
        if not isinstance(obj, dict):
            raise _Invalid(INVALID_REQUEST, f"line must be a JSON object, got {_type_name(obj)}")
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str):
            why = "missing" if custom_id is None else f"must be a string, got {_type_name(custom_id)}"
            raise _Invalid(INVALID_CUSTOM_ID, f"custom_id {why}")
        if not custom_id.strip():
            raise _Invalid(INVALID_CUSTOM_ID, "custom_id must not be empty")
        if len(custom_id) > MAX_CUSTOM_ID_LENGTH:
            raise _Invalid(INVALID_CUSTOM_ID, f"custom_id is longer than {MAX_CUSTOM_ID_LENGTH} characters")
        return custom_id, obj

    def check(self, line: int, custom_id: str, obj: dict) -> _Pending:
        if custom_id in self.seen:
            raise _Invalid(DUPLICATE_CUSTOM_ID, f"duplicate custom_id {custom_id!r:.80}")
        self.seen.add(custom_id)
        method = obj.get("method")
        if method != "POST":
            raise _Invalid(INVALID_METHOD, f'method must be "POST", got {method!r:.40}')
        url = obj.get("url")
        if url not in URLS:
            raise _Invalid(INVALID_URL, f"url must be one of {', '.join(URLS)}, got {url!r:.80}")
        raw_body = obj.get("body")
        if not isinstance(raw_body, dict):
            raise _Invalid(INVALID_REQUEST, f"body must be a JSON object, got {_type_name(raw_body)}")
        body = _merge_defaults(raw_body, self.defaults)
        limits = self._model(body.get("model"))
        params, explicit = _sampling_kwargs(body, url)
        try:
            sampling = self.SamplingParams(**params)
        except (ValueError, TypeError) as e:
            raise _Invalid(INVALID_PARAMETER, str(e)) from None
        pending = _Pending(line, custom_id, url, limits, raw_body, sampling, explicit)
        special = body.get("add_special_tokens")
        if special is not None:
            _as_bool("add_special_tokens", special)
        if url == CHAT_URL:
            pending.messages = _messages(body.get("messages"))
            kwargs = body.get("chat_template_kwargs")
            if kwargs is not None and not isinstance(kwargs, dict):
                raise _Invalid(INVALID_PARAMETER, "chat_template_kwargs must be an object")
            pending.template_kwargs = kwargs or None
            pending.add_special_tokens = bool(special)
        else:
            pending.text, pending.token_ids = _prompt(body.get("prompt"), limits.vocab_size)
            pending.add_special_tokens = special is not False  # vLLM's default for raw prompts
        return pending

    def _model(self, name) -> ModelLimits:
        if self.forced is not None:
            return self.forced
        if name is None:
            raise _Invalid(MISSING_MODEL, "body.model is required")
        limits = self.models.get(name) if isinstance(name, str) else None
        if limits is None:
            known = ", ".join(sorted(self.models)[:10]) or "none"
            raise _Invalid(MODEL_NOT_FOUND, f"unknown model {name!r:.80}; available: {known}")
        return limits

    def finish(self, pending: _Pending) -> ParsedRequest:
        ids, sampling, limit = pending.token_ids, pending.sampling, pending.limits.max_model_len
        if ids is None:  # not tokenized: `_tokenize` proved that the prompt fits
            return ParsedRequest(
                pending.line,
                pending.custom_id,
                pending.url,
                pending.limits.name,
                None,
                sampling,
                pending.body,
            )
        if not ids:
            chat = pending.url == CHAT_URL
            raise _Invalid(
                INVALID_MESSAGES if chat else INVALID_PROMPT,
                f"{'messages' if chat else 'prompt'} tokenized to nothing",
            )
        n = len(ids)
        if n >= limit:
            raise _Invalid(
                CONTEXT_LENGTH_EXCEEDED,
                f"the prompt is {n} tokens; the model's context length is {limit} tokens, "
                "which must also fit at least one generated token",
            )
        if sampling.max_tokens is None:
            sampling.max_tokens = limit - n
            if sampling.min_tokens > sampling.max_tokens:
                raise _Invalid(
                    INVALID_PARAMETER,
                    f"min_tokens ({sampling.min_tokens}) is more than the {limit - n} tokens left "
                    f"in the model's context after the {n}-token prompt",
                )
        elif n + sampling.max_tokens > limit:
            default = "" if pending.explicit_max_tokens else ", the default"
            raise _Invalid(
                CONTEXT_LENGTH_EXCEEDED,
                f"the prompt ({n} tokens) plus max_tokens ({sampling.max_tokens}{default}) is "
                f"{n + sampling.max_tokens} tokens, more than the model's context length of {limit}",
            )
        return ParsedRequest(
            pending.line, pending.custom_id, pending.url, pending.limits.name, ids, sampling, pending.body
        )


def _fits_without_tokenizing(p: _Pending) -> bool:
    bound = p.limits.token_bound(p.text, add_special_tokens=p.add_special_tokens)
    if bound is None:
        return False
    return bound + (p.sampling.max_tokens or 1) <= p.limits.max_model_len


def _render(chunk: list[_Pending], errors: dict[int, LineError]) -> None:
    """Render the chunk's chat conversations, batched per model and template arguments."""
    groups: dict[tuple, list[_Pending]] = {}
    for p in chunk:
        if p.messages is not None:
            kwargs = json.dumps(p.template_kwargs, sort_keys=True) if p.template_kwargs else ""
            groups.setdefault((id(p.limits), kwargs), []).append(p)
    for group in groups.values():
        limits, kwargs = group[0].limits, group[0].template_kwargs
        try:
            texts = limits.render_chat([p.messages for p in group], kwargs)
        except Exception:
            texts = []
            for p in group:  # find the offending conversation(s)
                try:
                    texts.append(limits.render_chat([p.messages], kwargs)[0])
                except Exception as e:
                    message = f"the chat template failed: {str(e)[:300]}"
                    errors[p.line] = LineError(p.line, p.custom_id, CHAT_TEMPLATE_ERROR, message)
                    texts.append(None)
        for p, text in zip(group, texts):
            p.text = text


def _to_encode(chunk: list[_Pending], errors: dict[int, LineError], exact: bool) -> list[list[_Pending]]:
    """The lines to tokenize, grouped by tokenizer and add_special_tokens.

    With `exact` False a line is left untokenized when an upper bound proves that it fits.
    """
    groups: dict[tuple, list[_Pending]] = {}
    for p in chunk:
        if p.token_ids is not None or p.text is None or p.line in errors:
            continue
        if exact or not p.text or not _fits_without_tokenizing(p):
            groups.setdefault((id(p.limits), p.add_special_tokens), []).append(p)
    return list(groups.values())


def _encode(groups: list[list[_Pending]], errors: dict[int, LineError]) -> None:
    """Tokenize the groups in batches (the fast tokenizer releases the GIL: this runs in a thread)."""
    for group in groups:
        limits, special = group[0].limits, group[0].add_special_tokens
        try:
            encoded = limits.encode([p.text for p in group], add_special_tokens=special)
        except Exception:
            encoded = []
            for p in group:
                try:
                    encoded.append(limits.encode([p.text], add_special_tokens=special)[0])
                except Exception as e:
                    encoded.append(None)
                    message = f"tokenization failed: {str(e)[:300]}"
                    errors[p.line] = LineError(p.line, p.custom_id, INVALID_PROMPT, message)
        for p, ids in zip(group, encoded):
            p.token_ids = ids


def parse_requests(
    stream: IO[bytes],
    models: ModelLimits | Mapping[str, ModelLimits],
    *,
    defaults: Mapping[str, Any] | None = None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    max_lines: int | None = None,
    max_bytes: int | None = None,
    first_line: int = 1,
    tokenize: bool = True,
    chunk_size: int = 256,
) -> Iterator[ParsedRequest | LineError]:
    """Yield a ParsedRequest or a LineError per non-blank line of `stream`, in line order.

    `models`: the known models by name (body.model must name one), or one `ModelLimits` that
    serves every line whatever its body.model says (the offline path). `defaults`: job-level body
    fields (OpenAI names, e.g. ``{"max_tokens": 256}``) that a line's own fields override.
    `first_line`: the number of the stream's first line (when parsing a slice of a file).
    `tokenize`: True gives every request its prompt token ids (workers, offline path). False is
    for validating an upload: a prompt is tokenized only when a cheap upper bound on its length
    cannot prove that it fits the context, and requests not tokenized have ``prompt_token_ids``
    None (chat requests without max_tokens then keep ``max_tokens=None``: the rest of the context).
    Raises only `InputTooLarge` (past `max_lines` non-blank lines or `max_bytes` bytes).

    Lines are handled in chunks of `chunk_size`: while one chunk is tokenized in a helper thread,
    the next one is parsed, so at most three chunks are held at a time.
    """
    parser = _LineParser(models, defaults)
    pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
    inflight: collections.deque = collections.deque()

    def submit(chunk: list) -> None:
        errors: dict[int, LineError] = {}
        pending = [p for p in chunk if isinstance(p, _Pending)]
        _render(pending, errors)
        groups = _to_encode(pending, errors, tokenize)
        inflight.append((chunk, errors, pool.submit(_encode, groups, errors) if groups else None))

    def emit() -> Iterator[ParsedRequest | LineError]:
        chunk, errors, future = inflight.popleft()
        if future is not None:
            future.result()
        for item in chunk:
            if isinstance(item, LineError):
                yield item
            elif item.line in errors:
                yield errors[item.line]
            else:
                try:
                    yield parser.finish(item)
                except _Invalid as e:
                    yield LineError(item.line, item.custom_id, e.code, e.message)

    try:
        chunk: list[_Pending | LineError] = []
        for line, content in _read_lines(stream, max_line_bytes, max_lines, max_bytes, first_line):
            chunk.append(_check_line(parser, line, content, max_line_bytes))
            if len(chunk) >= chunk_size:
                submit(chunk)
                chunk = []
                if len(inflight) > 1:
                    yield from emit()
        if chunk:
            submit(chunk)
        while inflight:
            yield from emit()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _check_line(parser: _LineParser, line: int, content: bytes | None, max_line_bytes: int):
    if content is None:
        return LineError(
            line, None, LINE_TOO_LONG, f"line is longer than the limit of {max_line_bytes:,} bytes"
        )
    custom_id = None
    try:
        custom_id, obj = parser.envelope(line, content)
        return parser.check(line, custom_id, obj)
    except _Invalid as e:
        return LineError(line, custom_id, e.code, e.message)


@dataclass
class ValidationSummary:
    lines: int = 0  # non-blank lines
    valid: int = 0
    invalid: int = 0
    models: dict[str, int] = dataclasses.field(default_factory=dict)  # valid requests per model
    urls: dict[str, int] = dataclasses.field(default_factory=dict)  # valid requests per url
    errors: list[LineError] = dataclasses.field(default_factory=list)  # the first `max_errors`


def summarize(items: Iterable[ParsedRequest | LineError], *, max_errors: int = 1000) -> ValidationSummary:
    """Consume `parse_requests` output into counts (keeping the first `max_errors` errors)."""
    summary = ValidationSummary()
    for item in items:
        summary.lines += 1
        if isinstance(item, LineError):
            summary.invalid += 1
            if len(summary.errors) < max_errors:
                summary.errors.append(item)
        else:
            summary.valid += 1
            summary.models[item.model] = summary.models.get(item.model, 0) + 1
            summary.urls[item.url] = summary.urls.get(item.url, 0) + 1
    return summary


def validate_file(
    stream: IO[bytes], models, *, max_errors: int = 1000, tokenize: bool = False, **kwargs
) -> ValidationSummary:
    """Validate an upload: `summarize(parse_requests(stream, models, tokenize=False, ...))`.

    Raises `InputTooLarge` past `max_lines` / `max_bytes` (keyword arguments of parse_requests).
    """
    return summarize(parse_requests(stream, models, tokenize=tokenize, **kwargs), max_errors=max_errors)


# --------------------------------------------------------------------------------------------------
# OpenAI response shapes


def _logprob(value: float) -> float:
    return -9999.0 if value == -math.inf or math.isnan(value) else float(value)  # JSON has no -inf


def _token_text(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    decode = getattr(tokenizer, "token_text", None) or (lambda t: tokenizer.decode([t]))
    return decode(token_id)


def _chat_logprobs(choice, k: int, tokenizer) -> dict:
    content = []
    for token_id, top in zip(choice.token_ids, choice.logprobs or []):
        text = _token_text(tokenizer, token_id)
        best = sorted(top.items(), key=lambda kv: -kv[1])[:k]
        alternatives = []
        for tid, lp in best:
            alt = _token_text(tokenizer, tid)
            alternatives.append({"token": alt, "logprob": _logprob(lp), "bytes": list(alt.encode("utf-8"))})
        content.append({
            "token": text,
            "logprob": _logprob(top.get(token_id, -math.inf)),
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": alternatives,
        })  # fmt: skip
    return {"content": content, "refusal": None}


def _completion_logprobs(choice, k: int, tokenizer) -> dict:
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = 0
    for token_id, top in zip(choice.token_ids, choice.logprobs or []):
        text = _token_text(tokenizer, token_id)
        tokens.append(text)
        token_logprobs.append(_logprob(top.get(token_id, -math.inf)))
        best = sorted(top.items(), key=lambda kv: -kv[1])[:k]
        top_logprobs.append({_token_text(tokenizer, tid): _logprob(lp) for tid, lp in best})
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def _usage(output) -> dict:
    prompt = len(output.prompt_token_ids or [])
    completion = sum(len(c.token_ids) for c in output.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_completion_body(
    output, *, model: str, logprobs: int | None = None, tokenizer=None,
    created: int | None = None, response_id: str | None = None,
) -> dict:  # fmt: skip
    """OpenAI ``chat.completion`` object for an engine `RequestOutput`.

    `logprobs`: the number of top logprobs requested (None: logprobs were not asked for).
    `tokenizer` (a HF tokenizer or a `ModelLimits`) turns token ids into text for logprobs.
    """
    choices = []
    for c in sorted(output.outputs, key=lambda c: c.index):
        lp = (
            _chat_logprobs(c, logprobs, tokenizer)
            if logprobs is not None and c.logprobs is not None
            else None
        )
        choices.append({
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "finish_reason": c.finish_reason,
            "logprobs": lp,
        })  # fmt: skip
    return {
        "id": response_id or f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()) if created is None else int(created),
        "model": model,
        "choices": choices,
        "usage": _usage(output),
        "system_fingerprint": None,
    }


def text_completion_body(
    output, *, model: str, logprobs: int | None = None, tokenizer=None,
    created: int | None = None, response_id: str | None = None,
) -> dict:  # fmt: skip
    """OpenAI ``text_completion`` object for an engine `RequestOutput`."""
    choices = []
    for c in sorted(output.outputs, key=lambda c: c.index):
        lp = (
            _completion_logprobs(c, logprobs, tokenizer)
            if logprobs is not None and c.logprobs is not None
            else None
        )
        choices.append({"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "logprobs": lp})
    return {
        "id": response_id or f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()) if created is None else int(created),
        "model": model,
        "choices": choices,
        "usage": _usage(output),
        "system_fingerprint": None,
    }


def response_body(request: ParsedRequest, output, *, tokenizer=None, created: int | None = None) -> dict:
    """The OpenAI body for a finished request, chat or text completion by the request's url."""
    build = chat_completion_body if request.is_chat else text_completion_body
    return build(
        output,
        model=request.model,
        logprobs=request.sampling_params.logprobs,
        tokenizer=tokenizer,
        created=created,
    )


def batch_output_line(
    custom_id: str, body: dict, *, line_id: str | None = None, request_id: str | None = None
) -> dict:
    """One line of an OpenAI batch output file (a successful request)."""
    return {
        "id": line_id or f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": request_id or f"req_{uuid.uuid4().hex}", "body": body},
        "error": None,
    }


def batch_error_line(
    custom_id: str | None, code: str, message: str, *, status_code: int | None = 400,
    line_id: str | None = None, request_id: str | None = None,
) -> dict:  # fmt: skip
    """One line of an OpenAI batch error file.

    With a `status_code` (a request the API rejected, as OpenAI reports a 400) the error is the
    response body; with ``status_code=None`` (cancelled, expired, engine failure) ``response`` is
    null and ``error`` holds the code and message.
    """
    line = {"id": line_id or f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id}
    if status_code is None:
        line.update(response=None, error={"code": code, "message": message})
        return line
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    line.update(
        response={
            "status_code": status_code,
            "request_id": request_id or f"req_{uuid.uuid4().hex}",
            "body": {"error": error},
        },
        error=None,
    )
    return line
