"""Per-request generation settings, with vLLM's names, meanings and validation.

Checks that need the model (vocabulary bounds, `max_logprobs`) happen when the engine accepts
the request (`LLMEngine.check_request`); everything else raises ValueError here.
"""

from __future__ import annotations

import copy
import enum
import logging
import math
from dataclasses import InitVar, dataclass
from typing import Any

from engine.beam.search import BeamSearchParams
from engine.params.structured_params import GuidedDecodingParams, StructuredOutputsParams, as_structured_outputs

log = logging.getLogger(__name__)

# vLLM users import these from vllm.sampling_params too
__all__ = ["SamplingParams", "RequestOutputKind", "BeamSearchParams", "GuidedDecodingParams", "StructuredOutputsParams"]

# Temperatures below this sample greedily, as in vLLM: dividing logits by a temperature
# near zero overflows to inf and the softmax to NaN.
_SAMPLING_EPS = 1e-5
# Positive temperatures below this are raised to it (vLLM's _MAX_TEMP), with a warning.
_MIN_POSITIVE_TEMPERATURE = 1e-2


class RequestOutputKind(enum.Enum):
    """vLLM's streaming modes. `LLM.generate` returns finished outputs whatever the kind
    (vLLM's `LLM` forces FINAL_ONLY too), so the field is accepted and changes nothing."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None  # vLLM V1 removed best_of; only None or n is accepted
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) means no top-k cut
    min_p: float = 0.0
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    seed: int | None = None  # -1 means None, as in vLLM
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top logprobs per output token (plus the sampled one); -1: all
    prompt_logprobs: int | None = None  # per prompt token; -1: all
    bad_words: list[str] | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # no-op with fast tokenizers, as in vLLM
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: the context
    logits_processors: list | None = None  # rejected unless empty: per-request callables
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict[str, Any] | None = None  # kept for plugins; unused, as in vLLM
    structured_outputs: StructuredOutputsParams | None = None  # a dict is read as its fields
    # vLLM's older name of structured_outputs (with a GuidedDecodingParams): read into structured_outputs
    guided_decoding: InitVar[StructuredOutputsParams | None] = None

    def __post_init__(self, guided_decoding=None):
        if guided_decoding is not None:
            _check(self.structured_outputs is None, "give structured_outputs or guided_decoding, not both")
            self.structured_outputs = guided_decoding
        if isinstance(self.temperature, int | float) and 0 < self.temperature < _MIN_POSITIVE_TEMPERATURE:
            log.warning("temperature %s is below %s and was raised to it", self.temperature, _MIN_POSITIVE_TEMPERATURE)
            self.temperature = _MIN_POSITIVE_TEMPERATURE
        if self.seed == -1:
            self.seed = None
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if self.stop is None or isinstance(self.stop, str):  # as vLLM: stop is a list from here on
            self.stop = self.stop_strings
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids or []))
        self.bad_words = list(dict.fromkeys(self.bad_words or []))
        if self.logit_bias is not None:
            self.logit_bias = _int_keys(self.logit_bias)
        if self.top_k == -1:
            self.top_k = 0
        self.structured_outputs = as_structured_outputs(self.structured_outputs)
        self.validate()
        if self.greedy:  # as vLLM: greedy ignores the truncations
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list; read on every use, so setting `stop` later takes effect."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

    def validate(self) -> None:
        _check_counts(self)
        _check_numbers(self)
        _check_lists(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def has_token_masks(self) -> bool:
        """Whether the sampler must bias or mask this request's logits."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words)


def _check(ok: bool, message) -> None:
    """Raise ValueError(message) unless `ok`. A message that formats values is a callable: valid
    requests (every request passes here several times) format none."""
    if not ok:
        raise ValueError(message() if callable(message) else message)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_keys(bias) -> dict[int, float]:
    _check(isinstance(bias, dict), lambda: f"logit_bias must be a dict of token id to bias, got {type(bias).__name__}")
    out = {}
    for token, value in bias.items():
        try:
            token_id = int(token)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias key {token!r} is not an integer token id") from None
        _check(
            isinstance(value, int | float) and math.isfinite(value),
            f"logit_bias value for token {token_id} must be a finite number, got {value!r}",
        )
        out[token_id] = float(value)
    return out


def _check_counts(p: SamplingParams) -> None:
    _check(_is_int(p.n) and p.n >= 1, lambda: f"n must be a positive integer, got {p.n!r}")
    _check(
        p.best_of is None or p.best_of == p.n,
        lambda: f"best_of={p.best_of!r} is not supported (vLLM V1 removed it): use n, or leave best_of unset",
    )
    _check(not (p.greedy and p.n > 1), lambda: f"n must be 1 when using greedy sampling (temperature=0), got {p.n}")
    _check(
        p.max_tokens is None or (_is_int(p.max_tokens) and p.max_tokens >= 1),
        lambda: f"max_tokens must be a positive integer, got {p.max_tokens!r}",
    )
    _check(
        _is_int(p.min_tokens) and p.min_tokens >= 0,
        lambda: f"min_tokens must be greater than or equal to 0, got {p.min_tokens!r}.",
    )
    _check(
        p.max_tokens is None or p.min_tokens <= p.max_tokens,  # vLLM's words
        lambda: f"min_tokens must be less than or equal to max_tokens={p.max_tokens}, got {p.min_tokens}.",
    )
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(p, name)
        if not (value is None or (_is_int(value) and value >= -1)):
            raise ValueError(f"{name} must be an integer >= 0 or -1, got {value!r}")
    _check(
        p.truncate_prompt_tokens is None
        or (_is_int(p.truncate_prompt_tokens) and (p.truncate_prompt_tokens >= 1 or p.truncate_prompt_tokens == -1)),
        lambda: f"truncate_prompt_tokens must be >= 1 or -1, got {p.truncate_prompt_tokens!r}",
    )
    _check(
        p.seed is None or (_is_int(p.seed) and -(2**63) <= p.seed < 2**63),
        lambda: f"seed must be a 64-bit integer, got {p.seed!r}",
    )


def _check_numbers(p: SamplingParams) -> None:
    _check(
        isinstance(p.temperature, int | float) and 0 <= p.temperature <= 2,
        lambda: f"temperature must be in [0, 2], got {p.temperature!r}",
    )
    _check(0 < p.top_p <= 1, lambda: f"top_p must be in (0, 1], got {p.top_p}")
    _check(_is_int(p.top_k) and p.top_k >= 0, lambda: f"top_k must be 0 (disable), -1 or at least 1, got {p.top_k!r}")
    _check(0 <= p.min_p <= 1, lambda: f"min_p must be in [0, 1], got {p.min_p}")
    _check(-2 <= p.presence_penalty <= 2, lambda: f"presence_penalty must be in [-2, 2], got {p.presence_penalty}")
    _check(-2 <= p.frequency_penalty <= 2, lambda: f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}")
    _check(
        math.isfinite(p.repetition_penalty) and p.repetition_penalty > 0,
        lambda: f"repetition_penalty must be a finite number > 0, got {p.repetition_penalty}",
    )


def _check_lists(p: SamplingParams) -> None:
    stops = p.stop_strings
    _check(all(isinstance(s, str) and s for s in stops), "stop cannot contain an empty string")
    _check(not (stops and not p.detokenize), "stop strings need detokenize=True")
    _check(
        all(_is_int(t) and t >= 0 for t in p.stop_token_ids or []),
        lambda: f"stop_token_ids must be non-negative integers, got {p.stop_token_ids!r}",
    )
    _check(all(isinstance(w, str) and w for w in p.bad_words or []), "bad_words cannot contain an empty string")
    if p.allowed_token_ids is not None:
        _check(
            isinstance(p.allowed_token_ids, list | tuple)
            and len(p.allowed_token_ids) > 0
            and all(_is_int(t) for t in p.allowed_token_ids),
            "allowed_token_ids must be a non-empty list of token ids",
        )
    _check(
        not p.logits_processors,
        "logits_processors is not supported: per-request Python callables cannot run in the batched "
        "sampler (vLLM V1 dropped them too); use logit_bias, allowed_token_ids or bad_words",
    )
    _check(
        isinstance(p.output_kind, RequestOutputKind),
        lambda: f"output_kind must be a RequestOutputKind, got {p.output_kind!r}",
    )
    _check(p.extra_args is None or isinstance(p.extra_args, dict), "extra_args must be a dict")
    _check(
        p.structured_outputs is None or isinstance(p.structured_outputs, StructuredOutputsParams),
        lambda: f"structured_outputs must be a StructuredOutputsParams, got {type(p.structured_outputs).__name__}",
    )
