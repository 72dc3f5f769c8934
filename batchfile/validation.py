"""Validating one request line: the envelope (custom_id, method, url), the model, the prompt
(messages or prompt) and the generation fields, then the fit in the model's context once the
prompt is tokenized."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchfile.endpoints import completion_options, embeddings, scoring
from batchfile.endpoints.responses_api import to_chat_body
from batchfile.endpoints.tool_calls import read_tools
from batchfile.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    DUPLICATE_CUSTOM_ID,
    DUPLICATE_KEY,
    INVALID_CUSTOM_ID,
    INVALID_JSON,
    INVALID_MESSAGES,
    INVALID_METHOD,
    INVALID_PARAMETER,
    INVALID_PROMPT,
    INVALID_REQUEST,
    INVALID_URL,
    INVALID_UTF8,
    LINE_TOO_LONG,
    MISSING_MODEL,
    MODEL_MISMATCH,
    MODEL_NOT_FOUND,
    InvalidLine,
    LineError,
)
from batchfile.fields import as_bool, messages_of, prompt_of, type_name
from batchfile.images import check_count as check_image_count
from batchfile.images import images_in
from batchfile.model_limits import ModelLimits
from batchfile.request import (
    CHAT_URL,
    EMBEDDINGS_URL,
    MESSAGE_URLS,
    RESPONSES_URL,
    SCORING_URLS,
    URLS,
    ParsedRequest,
)
from batchfile.sampling import OPENAI_BOUNDS, RequestBounds, check_output_budget, merge_defaults, sampling_kwargs
from engine.params.sampling_params import SamplingParams

MAX_CUSTOM_ID_LENGTH = 512
SHARED_PARAMS = 256  # distinct generation settings kept per input (a file has a handful)
SHARED_KEY_CHARS = 2048  # longer settings (a line's own token lists) are checked for that line alone


@dataclass
class Pending:
    """A line that passed the JSON checks and waits for batched rendering/tokenization."""

    line: int
    custom_id: str
    url: str
    limits: ModelLimits
    body: dict  # as uploaded
    sampling: Any  # SamplingParams; max_tokens None until the prompt length is known (chat default)
    explicit_max_tokens: bool
    messages: list | None = None
    template_kwargs: dict | None = None
    text: str | None = None
    add_special_tokens: bool = False
    token_ids: list[int] | None = None
    bounds: RequestBounds = OPENAI_BOUNDS
    plain_content: dict[str, str] | None = None  # placeholder -> message content to tokenize as plain text
    embedding: Any = None  # an embeddings line's batchfile.endpoints.embeddings.EmbeddingInputs (tokenized in finish)
    options: dict | None = None  # ParsedRequest.options
    tools: list | None = None  # for the chat template
    images: list | None = None  # a chat line's image URLs in order (batchfile.images)


def _reject_constant(name: str):
    raise InvalidLine(INVALID_JSON, f"line is not valid JSON: {name} is not allowed")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """An object whose keys are all different: a repeated key is an error, not "the last one wins"."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        repeated = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise InvalidLine(DUPLICATE_KEY, f"line has the key {repeated!r:.60} more than once in one object")
    return obj


_DECODER = json.JSONDecoder(parse_constant=_reject_constant, object_pairs_hook=_unique_keys)


def _parse_json(content: bytes):
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidLine(INVALID_UTF8, f"line is not valid UTF-8 (byte {e.start})") from None
    try:
        return _DECODER.decode(text)
    except InvalidLine:
        raise
    except (ValueError, RecursionError) as e:
        raise InvalidLine(INVALID_JSON, f"line is not valid JSON: {str(e)[:200]}") from None


class LineValidator:
    """Validates the lines of one input in order (it remembers the custom_ids it has seen).

    `models`: the known models by name (body.model must name one), or one `ModelLimits` that
    serves every line whatever its body.model says, or (`strict_model`) lines whose body.model is
    absent or names it. `defaults`: job-level body fields that a line's own fields override.
    `bounds`: what one request may ask for.
    """

    def __init__(
        self,
        models: ModelLimits | Mapping[str, ModelLimits],
        defaults: Mapping | None = None,
        bounds: RequestBounds = OPENAI_BOUNDS,
        strict_model: bool = False,
    ):
        if isinstance(models, ModelLimits):
            self.forced: ModelLimits | None = models
            self.models: Mapping[str, ModelLimits] = {models.name: models}
        else:
            self.forced, self.models = None, models
        self.defaults = defaults
        self.bounds = bounds
        self.strict_model = strict_model
        self.seen: set[str] = set()
        # lines with equal generation fields share one checked SamplingParams (most of a file's lines do;
        # building and checking one was a third of validating a line); only `finish` changes one, on a copy
        self._params: dict[str, SamplingParams] = {}

    def check_line(self, line: int, content: bytes | None, max_line_bytes: int) -> Pending | LineError:
        """Everything but the prompt's length; `content` None means the line was too long."""
        if content is None:
            message = f"line is longer than the limit of {max_line_bytes:,} bytes"
            return LineError(line, None, LINE_TOO_LONG, message)
        custom_id = None
        try:
            custom_id, obj = self._envelope(content)
            return self._check(line, custom_id, obj)
        except InvalidLine as e:
            # a repeated custom_id already has its one result line: the repeat's error line names none
            return LineError(line, None if e.code == DUPLICATE_CUSTOM_ID else custom_id, e.code, e.message, e.param)

    def _envelope(self, content: bytes) -> tuple[str, dict]:
        obj = _parse_json(content)
        if not isinstance(obj, dict):
            raise InvalidLine(INVALID_REQUEST, f"line must be a JSON object, got {type_name(obj)}")
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str):
            why = "missing" if custom_id is None else f"must be a string, got {type_name(custom_id)}"
            raise InvalidLine(INVALID_CUSTOM_ID, f"custom_id {why}", "custom_id")
        if not custom_id.strip():
            raise InvalidLine(INVALID_CUSTOM_ID, "custom_id must not be empty", "custom_id")
        if len(custom_id) > MAX_CUSTOM_ID_LENGTH:
            message = f"custom_id is longer than {MAX_CUSTOM_ID_LENGTH} characters"
            raise InvalidLine(INVALID_CUSTOM_ID, message, "custom_id")
        return custom_id, obj

    def _check(self, line: int, custom_id: str, obj: dict) -> Pending:
        if custom_id in self.seen:
            raise InvalidLine(DUPLICATE_CUSTOM_ID, f"duplicate custom_id {custom_id!r:.80}", "custom_id")
        self.seen.add(custom_id)
        method = obj.get("method")
        if method != "POST":
            raise InvalidLine(INVALID_METHOD, f'method must be "POST", got {method!r:.40}', "method")
        url = obj.get("url")
        if url not in URLS:
            raise InvalidLine(INVALID_URL, f"url must be one of {', '.join(URLS)}, got {url!r:.80}", "url")
        raw_body = obj.get("body")
        if not isinstance(raw_body, dict):
            raise InvalidLine(INVALID_REQUEST, f"body must be a JSON object, got {type_name(raw_body)}", "body")
        body, echo = merge_defaults(raw_body, self.defaults), None
        if url == RESPONSES_URL:  # validated as the chat request it amounts to
            body, echo = to_chat_body(body)
        limits = self._model(body.get("model"))
        embeddings.check_model_serves(limits, url)
        if url == EMBEDDINGS_URL:
            inputs = embeddings.read_line(limits, raw_body, body)
            return Pending(line, custom_id, url, limits, raw_body, None, False, bounds=self.bounds, embedding=inputs)
        if url in SCORING_URLS:
            inputs = scoring.read_line(url, raw_body, body)
            return Pending(line, custom_id, url, limits, raw_body, None, False, bounds=self.bounds, embedding=inputs)
        params, explicit = sampling_kwargs(body, CHAT_URL if echo is not None else url, self.bounds)
        options, tools = _shape_options(body, CHAT_URL if echo is not None else url, params)
        if echo is not None:
            options["responses"] = echo
        sampling = self._sampling_params(params)
        completion_options.check_bias_ids(sampling.logit_bias, limits.vocab_size)
        pending = Pending(
            line, custom_id, url, limits, raw_body, sampling, explicit, bounds=self.bounds, options=options, tools=tools
        )
        _read_prompt(pending, body)
        return pending

    def _sampling_params(self, params: dict) -> SamplingParams:
        key = repr(params)  # JSON values: equal reprs, equal fields (1 and 1.0 and True differ)
        sampling = self._params.get(key)
        if sampling is None:
            try:
                sampling = SamplingParams(**params)
            except (ValueError, TypeError) as e:
                raise InvalidLine(INVALID_PARAMETER, str(e)) from None
            if len(key) <= SHARED_KEY_CHARS:
                if len(self._params) >= SHARED_PARAMS:
                    self._params.clear()
                self._params[key] = sampling
        return sampling

    def _model(self, name) -> ModelLimits:
        if self.forced is not None:
            if self.strict_model and name is not None and name != self.forced.name:
                raise InvalidLine(
                    MODEL_MISMATCH,
                    f"body.model {name!r:.80} is not this job's model {self.forced.name!r}; "
                    "leave it out or name the job's model",
                )
            return self.forced
        if name is None:
            raise InvalidLine(MISSING_MODEL, "body.model is required")
        limits = self.models.get(name) if isinstance(name, str) else None
        if limits is None:
            known = ", ".join(sorted(self.models)[:10]) or "none"
            raise InvalidLine(MODEL_NOT_FOUND, f"unknown model {name!r:.80}; available: {known}")
        return limits


def _shape_options(body: dict, url: str, params: dict) -> tuple[dict, list | None]:
    """The response options and the chat template's tools; edits `params`: n greedy copies run as
    one sample (OpenAI accepts n > 1 at temperature 0; the engine, as vLLM, does not), and
    tool_choice required or named adds its constraint."""
    options = {} if url == CHAT_URL else completion_options.read(body, params)
    n = params.get("n", 1)
    if n > 1 and params.get("temperature", 1.0) == 0:
        params["n"], options["copies"] = 1, n
    tools = None
    if url == CHAT_URL:
        tools, tool_options, spec = read_tools(body)
        if tool_options:
            options["tools"] = tool_options
        if spec is not None:
            if "structured_outputs" in params:
                raise InvalidLine(
                    INVALID_PARAMETER,
                    "tool_choice required or a named function already "
                    "constrains the output; leave out response_format and structured_outputs",
                )
            params["structured_outputs"] = spec
    return options, tools


def _read_prompt(pending: Pending, body: dict) -> None:
    special = body.get("add_special_tokens")
    if special is not None:
        as_bool("add_special_tokens", special)
    if pending.url in MESSAGE_URLS:
        pending.messages = messages_of(body.get("messages"))
        pending.images = images_in(pending.messages) or None
        if pending.images:
            if pending.limits.image_tokens is None:
                raise InvalidLine("model_not_multimodal", f"model {pending.limits.name} takes no images")
            check_image_count(len(pending.images))
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise InvalidLine(INVALID_PARAMETER, "chat_template_kwargs must be an object")
        pending.template_kwargs = kwargs or None
        pending.add_special_tokens = bool(special)
    else:
        pending.text, pending.token_ids = prompt_of(body.get("prompt"), pending.limits.vocab_size)
        if pending.options and pending.options.get("echo") and pending.text is not None:
            pending.options["echo"] = pending.text  # echoed as sent, not as decoded
        pending.add_special_tokens = special is not False  # vLLM's default for raw prompts


def finish(pending: Pending) -> ParsedRequest:
    """The request, once its prompt is tokenized: the prompt must leave room in the context for
    max_tokens (chat without max_tokens gets the rest of the context)."""
    if pending.embedding is not None and pending.url in SCORING_URLS:
        return scoring.finish_line(
            pending.line, pending.custom_id, pending.url, pending.limits, pending.body, pending.embedding
        )
    if pending.embedding is not None:
        return embeddings.finish_line(pending.line, pending.custom_id, pending.limits, pending.body, pending.embedding)
    images = len(pending.images or ())
    _fit_context(pending, pending.token_ids + [0] * (images * (pending.limits.image_tokens or 1) - images))
    sp = pending.sampling
    check_output_budget(
        sp.n,
        sp.max_tokens,
        sp.logprobs,
        pending.bounds,
        prompt_rows=len(pending.token_ids) if sp.prompt_logprobs is not None else 0,
    )
    return ParsedRequest(
        pending.line,
        pending.custom_id,
        pending.url,
        pending.limits.name,
        pending.token_ids,
        pending.sampling,
        pending.body,
        options=pending.options or {},
        images=pending.images,
        prompt_text=pending.text if pending.images else None,
    )


def _fit_context(pending: Pending, ids: list[int]) -> None:
    sampling, limit = pending.sampling, pending.limits.max_model_len
    if not ids:
        chat = pending.url in MESSAGE_URLS
        raise InvalidLine(
            INVALID_MESSAGES if chat else INVALID_PROMPT,
            f"{'messages' if chat else 'prompt'} tokenized to nothing",
        )
    n = len(ids)
    if n >= limit:
        raise InvalidLine(
            CONTEXT_LENGTH_EXCEEDED,
            f"the prompt is {n} tokens; the model's context length is {limit} tokens, "
            "which must also fit at least one generated token",
        )
    if sampling.max_tokens is None:
        sampling = pending.sampling = copy.copy(sampling)  # shared with other lines: this line's own
        sampling.max_tokens = limit - n
        if sampling.min_tokens > sampling.max_tokens:
            raise InvalidLine(
                INVALID_PARAMETER,
                f"min_tokens ({sampling.min_tokens}) is more than the {limit - n} tokens left "
                f"in the model's context after the {n}-token prompt",
            )
    elif n + sampling.max_tokens > limit:
        default = "" if pending.explicit_max_tokens else ", the default"
        raise InvalidLine(
            CONTEXT_LENGTH_EXCEEDED,
            f"the prompt ({n} tokens) plus max_tokens ({sampling.max_tokens}{default}) is "
            f"{n + sampling.max_tokens} tokens, more than the model's context length of {limit}",
        )
