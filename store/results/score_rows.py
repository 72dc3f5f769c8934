"""The result row of a finished `/v1/score` or `/v1/rerank` line: vLLM's body in `response_body`
and the scores in the `scores` column (list<float64>, one per pair or document, in input order)."""

from __future__ import annotations

import hashlib
import time

from batchfile.endpoints.scoring import response_of, scores_of, usage_tokens
from batchfile.request import ParsedRequest
from store.results.embedding_rows import pooling_row
from store.results.rows import _ts


def score_row(
    request: ParsedRequest,
    output,
    *,
    shard_id: str | None = None,
    tokenizer=None,
    created_at=None,
    started_at=None,
    finished_at=None,
) -> dict:
    """`output`: the engine's pooling output for the line's inputs (`outputs.data`, [inputs, ...])."""
    scores = scores_of(request, output.outputs.data.tolist())
    finished = _ts(finished_at)
    created = int(finished.timestamp()) if finished else int(time.time())
    request_id = hashlib.sha256(f"{request.line}:{request.custom_id}".encode()).hexdigest()[:24]
    return pooling_row(
        request,
        usage_tokens(request),
        response_of(request, scores, request_id, created),
        shard_id=shard_id,
        created_at=created_at,
        started_at=started_at,
        finished_at=finished_at,
        scores=scores,
    )
