"""`/v1/embeddings` request lines: reading the body (OpenAI's `input` forms, `encoding_format`,
`dimensions`, `user`, and vLLM's `truncate_prompt_tokens` and `truncation_side`), the per-line
limits (2,048 inputs and 300,000 tokens, as OpenAI), and OpenAI's response body (`object: "list"`, `data[].embedding` as
floats or base64 float32, `usage`). Torch-free.

`batchfile.validation` hands an embeddings line (or any line for an embedding model) here; the
texts are tokenized when the line is finished, and the `ParsedRequest` carries every input's
token ids (`inputs`) for the worker, which runs them as one engine request."""

from __future__ import annotations

import base64
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from batchfile.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    INVALID_PARAMETER,
    INVALID_PROMPT,
    INVALID_URL,
    InvalidLine,
)
from batchfile.fields import type_name
from batchfile.request import EMBEDDINGS_URL, SCORING_URLS, ParsedRequest
from engine.params.pooling_truncation import SIDES, cut, kept_tokens

MAX_INPUTS = 2048  # OpenAI: an input array holds at most 2,048 items
MAX_LINE_TOKENS = 300_000  # OpenAI: at most 300,000 tokens over all inputs of one request
ENCODING_FORMATS = ("float", "base64")
FIELDS = frozenset(
    {"model", "input", "encoding_format", "dimensions", "user", "truncate_prompt_tokens", "truncation_side"}
)


@dataclass
class EmbeddingInputs:
    """One line's inputs: texts to tokenize, or token ids given as such (exactly one is set)."""

    texts: list[str] | None
    token_ids: list[list[int]] | None
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "right"

    def __len__(self) -> int:
        return len(self.texts if self.texts is not None else self.token_ids)


def _positive_int(name: str, value, allow_minus_one: bool = False) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and not (allow_minus_one and value == -1)):
        raise InvalidLine(INVALID_PARAMETER, f"{name} must be a positive integer, got {value!r:.40}")
    return value


def _token_list(value: list, index: int | None, vocab_size: int) -> list[int]:
    where = "input" if index is None else f"input[{index}]"
    if not value:
        raise InvalidLine(INVALID_PROMPT, f"{where} must not be empty")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int):
            raise InvalidLine(INVALID_PROMPT, f"{where} must hold integers only, got {type_name(t)}")
        if not 0 <= t < vocab_size:
            raise InvalidLine(INVALID_PROMPT, f"{where} holds token id {t}, outside the vocabulary [0, {vocab_size})")
    return list(value)


def read_inputs(value, vocab_size: int) -> tuple[list[str] | None, list[list[int]] | None]:
    """`input` as OpenAI takes it: a string, an array of strings, an array of token ids, or an
    array of token-id arrays (at most MAX_INPUTS items, none empty)."""
    if isinstance(value, str):
        if not value:
            raise InvalidLine(INVALID_PROMPT, "input must not be an empty string")
        return [value], None
    if not isinstance(value, list):
        why = "missing" if value is None else f"got {type_name(value)}"
        raise InvalidLine(INVALID_PROMPT, f"input must be a string or an array ({why})")
    if not value:
        raise InvalidLine(INVALID_PROMPT, "input must not be an empty array")
    if len(value) > MAX_INPUTS:
        raise InvalidLine(INVALID_PROMPT, f"input has {len(value):,} items; at most {MAX_INPUTS:,} are allowed")
    if all(isinstance(v, str) for v in value):
        empty = next((i for i, v in enumerate(value) if not v), None)
        if empty is not None:
            raise InvalidLine(INVALID_PROMPT, f"input[{empty}] must not be an empty string")
        return list(value), None
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return None, [_token_list(value, None, vocab_size)]
    if all(isinstance(v, list) for v in value):
        return None, [_token_list(v, i, vocab_size) for i, v in enumerate(value)]
    raise InvalidLine(
        INVALID_PROMPT,
        "input must be a string, an array of strings, an array of token ids, or an "
        "array of token-id arrays (not a mix)",
    )


def read_embedding_body(body: dict, vocab_size: int) -> EmbeddingInputs:
    """The line's inputs and options; raises InvalidLine for anything OpenAI would refuse."""
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise InvalidLine(INVALID_PARAMETER, f"unrecognized embeddings parameter {unknown[0]!r:.60}")
    texts, token_ids = read_inputs(body.get("input"), vocab_size)
    fmt = body.get("encoding_format", "float")
    if fmt not in ENCODING_FORMATS:
        raise InvalidLine(INVALID_PARAMETER, f"encoding_format must be 'float' or 'base64', got {fmt!r:.40}")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidLine(INVALID_PARAMETER, f"user must be a string, got {type_name(user)}")
    side = body.get("truncation_side", "right")
    if side not in SIDES:
        raise InvalidLine(INVALID_PARAMETER, f"truncation_side must be 'left' or 'right', got {side!r:.40}")
    return EmbeddingInputs(
        texts,
        token_ids,
        fmt,
        _positive_int("dimensions", body.get("dimensions")),
        user,
        _positive_int("truncate_prompt_tokens", body.get("truncate_prompt_tokens"), True),
        side,
    )


def fit_inputs(
    token_ids: list[list[int]],
    max_model_len: int,
    truncate_prompt_tokens: int | None,
    truncation_side: str = "right",
    plain: Callable[[int], list[int]] | None = None,
) -> list[list[int]]:
    """Each input within the model's context (or cut to `truncate_prompt_tokens` tokens, -1: the
    context, as `LLM.embed` cuts it: `engine.params.pooling_truncation`; `plain(i)`: text input i's tokens
    without special tokens), and the line within MAX_LINE_TOKENS; raises InvalidLine otherwise. A
    sentence-transformers `max_seq_length` caps the context (`engine.hf.model_info.context_length`)."""
    try:
        keep = kept_tokens(truncate_prompt_tokens, max_model_len)
        if keep is not None:
            token_ids = [
                cut(ids, keep, truncation_side, plain(i) if plain and len(ids) > keep else None)
                for i, ids in enumerate(token_ids)
            ]
    except ValueError as e:
        raise InvalidLine(INVALID_PARAMETER, str(e)) from None
    for i, ids in enumerate(token_ids):
        if len(ids) > max_model_len:
            raise InvalidLine(
                CONTEXT_LENGTH_EXCEEDED,
                f"input[{i}] is {len(ids)} tokens; the model's context length is {max_model_len} "
                "tokens (set truncate_prompt_tokens to truncate)",
            )
    total = sum(map(len, token_ids))
    if total > MAX_LINE_TOKENS:
        raise InvalidLine(
            INVALID_PROMPT, f"the inputs are {total:,} tokens together; at most {MAX_LINE_TOKENS:,} per request"
        )
    return token_ids


def encode_vector(vector: Sequence[float], encoding_format: str) -> list[float] | str:
    """A vector as OpenAI writes it: floats, or base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return [float(v) for v in vector]


def embeddings_body(
    model: str, vectors: Sequence[Sequence[float]], prompt_tokens: int, encoding_format: str = "float"
) -> dict:
    """OpenAI's `CreateEmbeddingResponse` for one line."""
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encode_vector(v, encoding_format)}
            for i, v in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def check_model_serves(limits, url: str) -> None:
    """An embedding model serves embeddings, score and rerank lines; a classifier (cross-encoder)
    score and rerank lines; a generative one the others."""
    pooling = limits.runner == "pooling"
    if url in SCORING_URLS and not pooling:
        raise InvalidLine(
            INVALID_URL,
            f"model {limits.name!r} is a generative model; it cannot serve {url} "
            "(an embedding model or a cross-encoder can)",
        )
    if url == EMBEDDINGS_URL and not pooling:
        raise InvalidLine(INVALID_URL, f"model {limits.name!r} is a generative model; it cannot serve {EMBEDDINGS_URL}")
    if url == EMBEDDINGS_URL and limits.classifier:
        raise InvalidLine(
            INVALID_URL,
            f"model {limits.name!r} is a classifier (cross-encoder); it serves {', '.join(SCORING_URLS)} only",
        )
    if url not in (EMBEDDINGS_URL, *SCORING_URLS) and pooling:
        kind = "a classifier (cross-encoder)" if limits.classifier else "an embedding model"
        serves = SCORING_URLS if limits.classifier else (EMBEDDINGS_URL, *SCORING_URLS)
        raise InvalidLine(INVALID_URL, f"model {limits.name!r} is {kind}; it serves {', '.join(serves)} only")


def read_line(limits, raw_body: dict, body: dict) -> EmbeddingInputs:
    """The line's inputs; job-level defaults (`body`) apply only to the embeddings fields."""
    merged = {k: v for k, v in body.items() if k in FIELDS or k in raw_body}
    inputs = read_embedding_body(merged, limits.vocab_size)
    if inputs.dimensions is not None:
        try:
            limits.pooler.check_dimensions(inputs.dimensions, limits.hidden_size or inputs.dimensions)
        except ValueError as e:
            raise InvalidLine(INVALID_PARAMETER, str(e)) from None
    return inputs


def finish_line(line: int, custom_id: str, limits, body: dict, inputs: EmbeddingInputs) -> ParsedRequest:
    """Tokenize the texts (after the model's default prompt, lowercased where it asks, as the engine
    and sentence-transformers do) and check every input against the context and the line's token limit."""
    token_ids = inputs.token_ids
    texts = None if inputs.texts is None else [as_the_model_reads(limits.pooler, t) for t in inputs.texts]
    if token_ids is None:
        try:
            token_ids = limits.encode(texts, add_special_tokens=True)
        except Exception as e:  # a tokenizer failure is this line's error
            raise InvalidLine(INVALID_PROMPT, f"tokenization failed: {str(e)[:300]}") from None
        if not all(token_ids):
            raise InvalidLine(INVALID_PROMPT, "an input tokenized to nothing")

    def plain(i: int) -> list[int]:
        return limits.encode([texts[i]], add_special_tokens=False)[0]

    token_ids = fit_inputs(
        token_ids,
        limits.max_model_len,
        inputs.truncate_prompt_tokens,
        inputs.truncation_side,
        plain if inputs.token_ids is None else None,
    )
    options = {"encoding_format": inputs.encoding_format, "dimensions": inputs.dimensions}
    return ParsedRequest(
        line, custom_id, EMBEDDINGS_URL, limits.name, [], None, body, inputs=token_ids, embedding_options=options
    )


def as_the_model_reads(pooler, text: str) -> str:
    """The text after the model's default sentence-transformers prompt, lowercased where it says
    `do_lower_case` (as `LLM.embed` and sentence-transformers)."""
    if pooler is None:
        return text
    text = pooler.default_prompt + text
    return text.lower() if pooler.do_lower_case else text


def usage_tokens(request: ParsedRequest) -> int:
    return sum(map(len, request.inputs or ()))


def response_of(request: ParsedRequest, vectors) -> dict:
    """The line's OpenAI body from its vectors (rows of floats)."""
    fmt = (request.embedding_options or {}).get("encoding_format", "float")
    return embeddings_body(request.model, vectors, usage_tokens(request), fmt)
