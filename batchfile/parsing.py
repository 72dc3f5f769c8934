"""Validation of a job's input for the platform, on top of `batchfile.requests`.

Each valid line is serialized as a shard-input line (prompt token ids, sampling parameters and
identity), so workers run exactly what was validated without tokenizing again.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

from batchfile import requests as rq
from store.settings import Settings


@dataclass
class GoodLine:
    model: str
    shard_line: str  # a JSON line for the shard input file


@dataclass
class BadLine:
    error: rq.LineError

    @property
    def as_dict(self) -> dict:
        """OpenAI's batch error shape ({code, message, param, line})."""
        return {
            "code": self.error.code,
            "message": self.error.message,
            "param": None,
            "line": self.error.line,
        }


class UnknownModel(ValueError):
    pass


def model_limits(settings: Settings, name: str | None = None):
    """The configured models' limits by name, or only `name`'s (UnknownModel if not configured)."""
    if name is not None:
        path = settings.models.get(name)
        if path is None:
            known = ", ".join(sorted(settings.models)) or "none"
            raise UnknownModel(f"unknown model {name!r}; available: {known}")
        return rq.ModelLimits.from_dir(path, name=name)
    return {n: rq.ModelLimits.from_dir(p, name=n) for n, p in settings.models.items()}


def validate_stream(
    stream: IO[bytes],
    *,
    settings: Settings,
    model: str | None = None,
    endpoint: str | None = None,
    defaults: dict | None = None,
) -> Iterator[GoodLine | BadLine]:
    """Parse and validate line by line. With `model` every line runs on it (the native API);
    without, each line's body.model must name a configured model (the OpenAI API)."""
    models = model_limits(settings, model) if model else model_limits(settings)
    for item in rq.parse_requests(stream, models, defaults=defaults):
        if isinstance(item, rq.LineError):
            yield BadLine(item)
        elif endpoint is not None and item.url != endpoint:
            message = f"url {item.url} does not match the batch's endpoint {endpoint}"
            yield BadLine(rq.LineError(item.line, item.custom_id, rq.INVALID_URL, message))
        else:
            yield GoodLine(item.model, encode_request(item))


_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


@functools.cache
def _param_defaults() -> dict:
    from engine.sampling_params import SamplingParams

    default = SamplingParams()
    return {f.name: getattr(default, f.name) for f in dataclasses.fields(SamplingParams) if f.init}


def encode_request(item: rq.ParsedRequest) -> str:
    """A shard-input line; only the sampling parameters that differ from the defaults are written."""
    sp = item.sampling_params
    params = {
        name: value for name, default in _param_defaults().items() if (value := getattr(sp, name)) != default
    }
    record = {
        "line": item.line,
        "custom_id": item.custom_id,
        "url": item.url,
        "model": item.model,
        "prompt_token_ids": item.prompt_token_ids,
        "params": params,
    }
    return _encode(record) + "\n"


def decode_request(line: str | bytes) -> rq.ParsedRequest:
    from engine.sampling_params import SamplingParams

    record = json.loads(line)
    return rq.ParsedRequest(
        line=record["line"],
        custom_id=record["custom_id"],
        url=record["url"],
        model=record["model"],
        prompt_token_ids=record["prompt_token_ids"],
        sampling_params=SamplingParams(**record["params"]),
        body={},
    )
