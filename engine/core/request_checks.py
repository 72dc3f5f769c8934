"""The checks of a request's SamplingParams that need the model: token ids inside the
vocabulary and logprob counts within `max_logprobs` (vLLM's `SamplingParams.verify`), and a
request's priority."""

from __future__ import annotations

from engine.params.sampling_params import SamplingParams


def check_against_model(params: SamplingParams, vocab_size: int, max_logprobs: int) -> None:
    for name, ids in (
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias", params.logit_bias),
        ("allowed_token_ids", params.allowed_token_ids),
    ):
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


def check_fits(
    n: int,
    max_tokens: int | None,
    limit: int,
    block_size: int,
    pool_blocks: int,
    sliding: tuple[int, int] | None = None,
) -> None:
    """Raise ValueError if a prompt of `n` tokens can never run: empty, not shorter than the model's context
    `limit`, or needing more KV blocks (with its `max_tokens`) than the whole pool holds. `sliding`: (the
    window, the step's token budget) of a model whose every layer is windowed: a sequence holds at most
    the blocks of a window and a step's tokens."""
    if n == 0:
        raise ValueError("The decoder prompt cannot be empty")  # vLLM's words, here and below
    if n >= limit:
        plus = "" if n > limit else " plus the number of requested output tokens (at least 1)"
        raise ValueError(
            f"The decoder prompt (length {n}){plus} is longer than the maximum model length of "
            f"{limit}. Make sure that `max_model_len` is no smaller than the number of text tokens."
        )
    total = min(n + (max_tokens or limit), limit)
    blocks = -(-total // block_size)
    if sliding:
        blocks = min(blocks, -(-(sliding[0] - 1 + sliding[1]) // block_size) + 1)
    if blocks > pool_blocks:
        raise ValueError(f"the request needs {blocks} KV blocks ({total} tokens) but the pool has only {pool_blocks}")
