"""OpenAI's `echo`, `best_of` (/v1/completions) and `logit_bias` (both text endpoints): checked
against OpenAI's published ranges, turned into engine parameters and response options.

- `logit_bias`: token id (a JSON key, so a string of digits) -> bias in [-100, 100], added to
  the logit before sampling; at most `MAX_LOGIT_BIAS` entries (our bound: each entry is a
  per-step write into the logits).
- `echo`: the prompt is prepended to every choice's text; with `logprobs: k` the prompt tokens'
  logprobs come first (the engine's `prompt_logprobs=k`; the first token's are null).
- `best_of` in [1, 20] and >= n: best_of candidates are sampled, the n with the highest
  logprob per token are returned (OpenAI's documented rule; vLLM's V0 ranked by the sum).
  At temperature 0 every candidate is the same, so only n are generated.
"""

from __future__ import annotations

import math

from batchfile.errors import INVALID_PARAMETER, InvalidLine
from batchfile.fields import as_bool, as_int, type_name

MAX_BEST_OF = 20  # OpenAI's maximum
MAX_BIAS = 100.0
MAX_LOGIT_BIAS = 300  # entries in one request's logit_bias

FIELDS = frozenset({"echo", "best_of"})  # completions-only fields read here


def as_logit_bias(name: str, value) -> dict[int, float] | None:
    """{"token id": bias} as {int: float}; an empty map is no bias."""
    if not isinstance(value, dict):
        raise InvalidLine(
            INVALID_PARAMETER, f"{name} must be an object of token id -> bias, got {type_name(value)}", param=name
        )
    if len(value) > MAX_LOGIT_BIAS:
        raise InvalidLine(INVALID_PARAMETER, f"{name} holds {len(value)} entries; at most {MAX_LOGIT_BIAS}", param=name)
    out: dict[int, float] = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise InvalidLine(INVALID_PARAMETER, f"{name} key {key!r:.40} is not a token id", param=name)
        if (
            isinstance(bias, bool)
            or not isinstance(bias, int | float)
            or not math.isfinite(bias)
            or not -MAX_BIAS <= bias <= MAX_BIAS
        ):
            raise InvalidLine(
                INVALID_PARAMETER, f"{name}[{key}] must be a number in [-100, 100], got {bias!r:.40}", param=name
            )
        out[int(key)] = float(bias)
    return out or None


def check_bias_ids(bias: dict[int, float] | None, vocab_size: int) -> None:
    bad = next((t for t in bias or () if t >= vocab_size), None)
    if bad is not None:
        raise InvalidLine(
            INVALID_PARAMETER,
            f"logit_bias token id {bad} is outside the vocabulary [0, {vocab_size})",
            param="logit_bias",
        )


def read(body: dict, params: dict) -> dict:
    """The response options of a completions body's echo and best_of; edits `params` (the
    SamplingParams arguments): echo with logprobs asks for prompt logprobs, best_of > n samples
    best_of candidates with their logprobs (to rank them)."""
    options: dict = {}
    echo, best_of = body.get("echo"), body.get("best_of")
    if echo is not None and as_bool("echo", echo):
        options["echo"] = True
        if params.get("logprobs") is not None:
            params["prompt_logprobs"] = params["logprobs"]
    if best_of is None:
        return options
    best_of = as_int("best_of", best_of)
    n = params.get("n", 1)
    if not n <= best_of <= MAX_BEST_OF:
        raise InvalidLine(
            INVALID_PARAMETER, f"best_of must be in [n ({n}), {MAX_BEST_OF}], got {best_of}", param="best_of"
        )
    if best_of > n and params.get("temperature", 1.0) != 0:
        params["n"], options["best_of"] = best_of, n
        if params.get("logprobs") is None:
            params["logprobs"], options["hide_logprobs"] = 0, True
    return options
