"""What the engine hands back for a finished request (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)  # arrival/first-token/finish times (time.time())
