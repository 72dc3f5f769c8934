"""Per-request generation settings, with vLLM's names and meanings."""

from __future__ import annotations

from dataclasses import dataclass, field

# Temperatures below this sample greedily, as in vLLM: dividing logits by a temperature
# near zero overflows to inf and the softmax to NaN.
_SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) means no top-k cut
    min_p: float = 0.0
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # number of top logprobs to return per token
    skip_special_tokens: bool = True
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self):
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def check(ok: bool, message: str):
            if not ok:
                raise ValueError(message)

        check(isinstance(self.n, int) and self.n >= 1, f"n must be a positive integer, got {self.n!r}")
        check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        check(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be >= 0 or -1, got {self.top_k}")
        check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            f"max_tokens must be a positive integer, got {self.max_tokens!r}",
        )
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens must be >= 0")
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        check(-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]")
        check(-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]")
        check(self.repetition_penalty > 0, "repetition_penalty must be > 0")
        check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            "logprobs must be an integer in [0, 20]",
        )
        check(all(isinstance(s, str) and s for s in self.stop_strings), "stop strings must be non-empty")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "bad stop_token_ids")
        check(
            self.seed is None or (isinstance(self.seed, int) and -(2**63) <= self.seed < 2**63),
            f"seed must be a 64-bit integer, got {self.seed!r}",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
        )
