"""The shard-input line: one validated request as the worker runs it (prompt token ids, sampling
parameters and identity), so workers run exactly what was validated without tokenizing again.

`validate_stream` turns an upload into such lines and per-line errors.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import IO

from batchfile.errors import INVALID_URL, LineError
from batchfile.model_limits import ModelLimits
from batchfile.parser import parse_requests
from batchfile.prefix_plan import DEFAULT_BLOCK_SIZE, PlanLine, prompt_blocks
from batchfile.request import ParsedRequest
from batchfile.sampling import OPENAI_BOUNDS, RequestBounds
from engine.params.sampling_params import SamplingParams


@dataclass
class GoodLine:
    model: str
    shard_line: str  # a JSON line for the shard input file
    line: int = 0  # its line number in the input
    prompt_tokens: int = 0
    max_tokens: int = 0  # the most completion tokens it may generate (all its choices)
    blocks: tuple[bytes, ...] = ()  # its prompt's full KV blocks (batchfile.prefix_plan); () if uncacheable

    @property
    def plan_line(self) -> PlanLine:
        return PlanLine(self.shard_line, self.prompt_tokens, self.max_tokens, self.blocks)


@dataclass
class BadLine:
    error: LineError

    @property
    def as_dict(self) -> dict:
        """OpenAI's batch error shape ({code, message, param, line})."""
        return {
            "code": self.error.code,
            "message": self.error.message,
            "param": self.error.param,
            "line": self.error.line,
        }


def validate_stream(
    stream: IO[bytes],
    models: ModelLimits | Mapping[str, ModelLimits],
    *,
    endpoint: str | None = None,
    defaults: dict | None = None,
    bounds: RequestBounds = OPENAI_BOUNDS,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> Iterator[GoodLine | BadLine]:
    """Parse and validate line by line. With one `ModelLimits` every line runs on it (the native
    API; a line's body.model, if given, must name it); with {name: ModelLimits} each line's
    body.model must name one (the OpenAI API). With an `endpoint` every line's url must be it."""
    for item in parse_requests(stream, models, defaults=defaults, bounds=bounds, strict_model=True):
        if isinstance(item, LineError):
            yield BadLine(item)
        elif endpoint is not None and item.url != endpoint:
            message = f"url {item.url} does not match the batch's endpoint {endpoint}"
            yield BadLine(LineError(item.line, item.custom_id, INVALID_URL, message, "url"))
        else:
            yield _good_line(models, item, block_size)


def _good_line(models, item: ParsedRequest, block_size: int) -> GoodLine:
    """The line with what planning and quotes need: its prompt and completion sizes and block hashes."""
    good = GoodLine(_route(models, item.model), encode_request(item), item.line)
    if item.inputs is not None:  # embeddings: pooled, never served from the prefix cache
        good.prompt_tokens = sum(len(ids) for ids in item.inputs)
        return good
    ids, sp = item.prompt_token_ids, item.sampling_params
    good.prompt_tokens = len(ids)
    limits = models if isinstance(models, ModelLimits) else models.get(item.model)
    room = max(0, limits.max_model_len - len(ids)) if limits is not None else 0
    good.max_tokens = (sp.max_tokens if sp.max_tokens is not None else room) * max(sp.n, sp.best_of or 1)
    if not item.images and sp.prompt_logprobs is None:
        good.blocks = prompt_blocks(ids, item.model.encode(), block_size)
    return good


_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


@functools.cache
def _param_defaults() -> dict:
    default = SamplingParams()
    return {f.name: getattr(default, f.name) for f in dataclasses.fields(SamplingParams) if f.init}


def encode_request(item: ParsedRequest) -> str:
    """A shard-input line; only the sampling parameters that differ from the defaults are written."""
    if item.inputs is not None:  # /v1/embeddings: every input's ids and the options
        return (
            _encode(
                {
                    "line": item.line,
                    "custom_id": item.custom_id,
                    "url": item.url,
                    "model": item.model,
                    "inputs": item.inputs,
                    "embedding": item.embedding_options,
                }
            )
            + "\n"
        )
    sp = item.sampling_params
    params = {name: value for name, default in _param_defaults().items() if (value := getattr(sp, name)) != default}
    if sp.structured_outputs is not None:
        params["structured_outputs"] = sp.structured_outputs.to_dict()
    record = {
        "line": item.line,
        "custom_id": item.custom_id,
        "url": item.url,
        "model": item.model,
        "prompt_token_ids": item.prompt_token_ids,
        "params": params,
    }
    if item.options:
        record["options"] = item.options
    if item.images:
        record["images"], record["prompt_text"] = item.images, item.prompt_text
    return _encode(record) + "\n"


def decode_request(line: str | bytes, shared_params: dict[str, SamplingParams] | None = None) -> ParsedRequest:
    """A shard-input line back as the request it was validated as. `shared_params`: a cache (one per shard
    read) that gives lines with equal sampling parameters one `SamplingParams` (the engine only reads it, as
    when `LLM.generate` takes one for many prompts): most lines of a shard share theirs, and building and
    checking them again for each line was a third of reading a shard."""
    record = json.loads(line)
    if "inputs" in record:
        return ParsedRequest(
            record["line"],
            record["custom_id"],
            record["url"],
            record["model"],
            [],
            None,
            {},
            inputs=record["inputs"],
            embedding_options=record["embedding"],
        )
    return ParsedRequest(
        line=record["line"],
        custom_id=record["custom_id"],
        url=record["url"],
        model=record["model"],
        prompt_token_ids=record["prompt_token_ids"],
        sampling_params=_sampling_params(record["params"], shared_params),
        body={},
        options=record.get("options", {}),
        images=record.get("images"),
        prompt_text=record.get("prompt_text"),
    )


def _sampling_params(fields: dict, shared: dict[str, SamplingParams] | None) -> SamplingParams:
    if shared is None:
        return SamplingParams(**fields)
    key = repr(fields)  # encode_request writes the fields in one order: equal parameters, equal text
    params = shared.get(key)
    if params is None:
        params = shared[key] = SamplingParams(**fields)
    return params


def _route(models, name: str) -> str:
    """The model whose workers run a line of model `name`: a LoRA adapter's base (the line keeps the adapter's
    name, which the worker runs it with)."""
    limits = models if isinstance(models, ModelLimits) else models.get(name)
    return limits.base_model if limits is not None and limits.base_model else name
