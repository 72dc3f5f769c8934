"""What the engine hands back for a finished request (vLLM's shapes: `vllm/outputs.py`,
`vllm/logprobs.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """One token's log probability under the model's raw distribution, its rank there
    (1 = most likely) and its text (None when detokenize=False)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob. The sampled (or prompt) token is always present.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs; None without logprobs

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)  # arrival/first-token/finish times (time.time())
    # One entry per prompt token; the first is None (nothing predicts it), as in vLLM.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # A prefill-only request's KV and first token (engine.kv_transfer.export.KVBundle; finished is False then).
    kv_export: Any = None
