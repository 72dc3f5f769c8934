"""The checks of a request's SamplingParams that need the model: token ids inside the
vocabulary and logprob counts within `max_logprobs` (vLLM's `SamplingParams.verify`), and a
request's priority."""

from __future__ import annotations

from engine.sampling_params import SamplingParams


def check_against_model(params: SamplingParams, vocab_size: int, max_logprobs: int) -> None:
    for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias),
                      ("allowed_token_ids", params.allowed_token_ids)):
        bad = [t for t in ids or () if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{name} has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    limit = vocab_size if max_logprobs == -1 else max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        wanted = getattr(params, name)
        wanted = vocab_size if wanted == -1 else wanted
        if wanted is not None and wanted > limit:
            raise ValueError(
                f"{name}={getattr(params, name)} asks for {wanted} logprobs per token but at most {limit} "
                "are allowed; raise the engine's max_logprobs (-1: the whole vocabulary)"
            )


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """The prompt's last `keep` tokens (vLLM's truncate_prompt_tokens; -1: the context length)."""
    if keep is None:
        return ids
    if keep > max_model_len:
        raise ValueError(f"truncate_prompt_tokens={keep} exceeds the model's context of {max_model_len}")
    return ids[-(max_model_len if keep == -1 else keep) :]


def check_priority(priority, policy: str) -> None:
    """As vLLM V1: any integer; under fcfs (the default) it is accepted and changes nothing."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority must be an integer, got {priority!r:.40}")
