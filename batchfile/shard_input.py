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
from batchfile.request import ParsedRequest
from batchfile.sampling import OPENAI_BOUNDS, RequestBounds
from engine.sampling_params import SamplingParams


@dataclass
class GoodLine:
    model: str
    shard_line: str  # a JSON line for the shard input file
    line: int = 0  # its line number in the input


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
            yield GoodLine(item.model, encode_request(item), item.line)


_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


@functools.cache
def _param_defaults() -> dict:
    default = SamplingParams()
    return {f.name: getattr(default, f.name) for f in dataclasses.fields(SamplingParams) if f.init}


def encode_request(item: ParsedRequest) -> str:
    """A shard-input line; only the sampling parameters that differ from the defaults are written."""
    if item.inputs is not None:  # /v1/embeddings: every input's ids and the options
        return _encode({"line": item.line, "custom_id": item.custom_id, "url": item.url, "model": item.model,
                        "inputs": item.inputs, "embedding": item.embedding_options}) + "\n"
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
    return _encode(record) + "\n"


def decode_request(line: str | bytes) -> ParsedRequest:
    record = json.loads(line)
    if "inputs" in record:
        return ParsedRequest(record["line"], record["custom_id"], record["url"], record["model"], [], None, {},
                             inputs=record["inputs"], embedding_options=record["embedding"])
    return ParsedRequest(
        line=record["line"],
        custom_id=record["custom_id"],
        url=record["url"],
        model=record["model"],
        prompt_token_ids=record["prompt_token_ids"],
        sampling_params=SamplingParams(**record["params"]),
        body={},
        options=record.get("options", {}),
    )
