"""`/v1/score` and `/v1/rerank` request lines, as vLLM serves them (torch-free).

`/v1/score`: `text_1` (a text, or a list) against `text_2` (a text or a list: one to one, one to
many, or two lists of one length pairwise); `/v1/rerank`: a `query` against `documents`, the results
ordered by relevance, the first `top_n` (all when 0 or absent), each with its document unless
`return_documents` is false. Both take `truncate_prompt_tokens`.

On a cross-encoder (a sequence-classification model) a pair is one input, encoded with the tokenizer's
pair template (its segment ids travel along) and scored by the model's head; on an embedding model
the texts are embedded and a pair's score is the cosine of its two vectors. The `ParsedRequest`
carries the inputs' ids (`inputs`) and the options (`embedding_options`: task, mode, segment ids,
top_n, documents)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from batchfile.endpoints.embeddings import MAX_INPUTS, MAX_LINE_TOKENS, as_the_model_reads, fit_inputs
from batchfile.errors import CONTEXT_LENGTH_EXCEEDED, INVALID_PARAMETER, INVALID_PROMPT, InvalidLine
from batchfile.fields import type_name
from batchfile.request import RERANK_URL, SCORE_URL, ParsedRequest

SCORE_FIELDS = frozenset({"model", "text_1", "text_2", "truncate_prompt_tokens", "user"})
RERANK_FIELDS = frozenset(
    {"model", "query", "documents", "top_n", "return_documents", "truncate_prompt_tokens", "user"}
)


@dataclass
class ScoreInputs:
    firsts: list[str]  # one per pair
    seconds: list[str]
    truncate_prompt_tokens: int | None = None
    top_n: int | None = None  # rerank
    return_documents: bool = True  # rerank


def _texts(name: str, value, allow_one: bool = True) -> list[str]:
    if isinstance(value, str) and allow_one:
        return [value]
    if not isinstance(value, list) or not value:
        why = "missing" if value is None else f"got {type_name(value)}" if not isinstance(value, list) else "empty"
        raise InvalidLine(
            INVALID_PROMPT, f"{name} must be {'a string or ' if allow_one else ''}a non-empty array of strings ({why})"
        )
    if len(value) > MAX_INPUTS:
        raise InvalidLine(INVALID_PROMPT, f"{name} has {len(value):,} items; at most {MAX_INPUTS:,} are allowed")
    bad = next((i for i, v in enumerate(value) if not isinstance(v, str)), None)
    if bad is not None:
        raise InvalidLine(INVALID_PROMPT, f"{name}[{bad}] must be a string, got {type_name(value[bad])}")
    return list(value)


def _truncate(body: dict) -> int | None:
    keep = body.get("truncate_prompt_tokens")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or (keep < 1 and keep != -1)):
        raise InvalidLine(
            INVALID_PARAMETER, f"truncate_prompt_tokens must be a positive integer or -1, got {keep!r:.40}"
        )
    return keep


def read_line(url: str, raw_body: dict, body: dict) -> ScoreInputs:
    fields = SCORE_FIELDS if url == SCORE_URL else RERANK_FIELDS
    body = {k: v for k, v in body.items() if k in fields or k in raw_body}
    unknown = sorted(set(body) - fields)
    if unknown:
        raise InvalidLine(INVALID_PARAMETER, f"unrecognized {url[4:]} parameter {unknown[0]!r:.60}")
    keep = _truncate(body)
    if url == SCORE_URL:
        firsts, seconds = _texts("text_1", body.get("text_1")), _texts("text_2", body.get("text_2"))
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise InvalidLine(
                INVALID_PROMPT,
                f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: pair one "
                "text with many, or two lists of one length",
            )
        return ScoreInputs(firsts, seconds, keep)
    query = body.get("query")
    if not isinstance(query, str):
        raise InvalidLine(INVALID_PROMPT, f"query must be a string, got {type_name(query)}")
    documents = _texts("documents", body.get("documents"), allow_one=False)
    top_n = body.get("top_n")
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0):
        raise InvalidLine(INVALID_PARAMETER, f"top_n must be a non-negative integer, got {top_n!r:.40}")
    ret = body.get("return_documents", True)
    if not isinstance(ret, bool):
        raise InvalidLine(INVALID_PARAMETER, f"return_documents must be a boolean, got {type_name(ret)}")
    return ScoreInputs([query] * len(documents), documents, keep, top_n or None, ret)


def finish_line(line: int, custom_id: str, url: str, limits, body: dict, inputs: ScoreInputs) -> ParsedRequest:
    """Tokenize (pairs for a cross-encoder, texts for an embedder) and check against the context."""
    options: dict = {"task": url[4:], "top_n": inputs.top_n}
    if url == RERANK_URL and inputs.return_documents:
        options["documents"] = inputs.seconds
    if limits.classifier:
        ids, types = _pairs(limits, inputs)
        options.update(mode="cross", token_type_ids=types)
    else:
        texts = list(dict.fromkeys(inputs.firsts + inputs.seconds))  # each text embedded once
        where = {t: i for i, t in enumerate(texts)}
        read = [as_the_model_reads(limits.pooler, t) for t in texts]
        ids = limits.encode(read, add_special_tokens=True)

        def plain(i: int) -> list[int]:
            return limits.encode([read[i]], add_special_tokens=False)[0]

        ids = fit_inputs(ids, limits.max_model_len, inputs.truncate_prompt_tokens, "right", plain)
        options.update(mode="cosine", pairs=[[where[a], where[b]] for a, b in zip(inputs.firsts, inputs.seconds)])
    return ParsedRequest(line, custom_id, url, limits.name, [], None, body, inputs=ids, embedding_options=options)


def _pairs(limits, inputs: ScoreInputs) -> tuple[list[list[int]], list[list[int]] | None]:
    max_length = None
    if inputs.truncate_prompt_tokens is not None:
        keep = inputs.truncate_prompt_tokens
        if keep > limits.max_model_len:
            raise InvalidLine(
                INVALID_PARAMETER,
                f"truncate_prompt_tokens={keep} exceeds the model's context of {limits.max_model_len}",
            )
        max_length = limits.max_model_len if keep == -1 else keep
    try:
        enc = limits.encode_pairs(inputs.firsts, inputs.seconds, max_length)
    except Exception as e:  # a tokenizer failure is this line's error
        raise InvalidLine(INVALID_PROMPT, f"tokenization failed: {str(e)[:300]}") from None
    ids = [list(x) for x in enc["input_ids"]]
    types = [list(x) for x in enc["token_type_ids"]] if "token_type_ids" in enc else None
    for i, pair in enumerate(ids):
        if len(pair) > limits.max_model_len:
            raise InvalidLine(
                CONTEXT_LENGTH_EXCEEDED,
                f"pair {i} is {len(pair)} tokens; the model's context length is {limits.max_model_len} "
                "tokens (set truncate_prompt_tokens to truncate)",
            )
    total = sum(map(len, ids))
    if total > MAX_LINE_TOKENS:
        raise InvalidLine(INVALID_PROMPT, f"the pairs are {total:,} tokens together; at most {MAX_LINE_TOKENS:,}")
    return ids, types


def scores_of(request: ParsedRequest, rows: Sequence[Sequence[float]]) -> list[float]:
    """The pairs' scores from the engine's rows: a cross-encoder's first output per pair, or the
    cosine of an embedder's two vectors."""
    options = request.embedding_options
    if options["mode"] == "cross":
        return [float(r[0]) for r in rows]
    return [_cosine(rows[a], rows[b]) for a, b in options["pairs"]]


def _cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


def usage_tokens(request: ParsedRequest) -> int:
    return sum(map(len, request.inputs or ()))


def response_of(request: ParsedRequest, scores: list[float], request_id: str, created: int) -> dict:
    """vLLM's ScoreResponse or RerankResponse body."""
    tokens = usage_tokens(request)
    options = request.embedding_options
    if request.url == SCORE_URL:
        return {
            "id": f"score-{request_id}",
            "object": "list",
            "created": created,
            "model": request.model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: options.get("top_n") or None]
    documents = options.get("documents")
    results = []
    for i in order:
        result = {"index": i, "relevance_score": scores[i]}
        if documents is not None:
            result["document"] = {"text": documents[i]}
        results.append(result)
    return {"id": f"rerank-{request_id}", "model": request.model, "usage": {"total_tokens": tokens}, "results": results}
