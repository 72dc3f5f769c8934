"""The result row of a finished `/v1/score` or `/v1/rerank` line: vLLM's body in `response_body`
and the scores in the `scores` column (list<float64>, one per pair or document, in input order)."""

from __future__ import annotations

import hashlib
import json
import time

from batchfile.request import ParsedRequest
from batchfile.scoring import response_of, scores_of, usage_tokens
from store.results.rows import COMPLETED, RESULT_SCHEMA, _times, _ts


def score_row(request: ParsedRequest, output, *, shard_id: str | None = None, tokenizer=None,
              created_at=None, started_at=None, finished_at=None) -> dict:
    """`output`: the engine's pooling output for the line's inputs (`outputs.data`, [inputs, ...])."""
    scores = scores_of(request, output.outputs.data.tolist())
    finished = _ts(finished_at)
    created = int(finished.timestamp()) if finished else int(time.time())
    request_id = hashlib.sha256(f"{request.line}:{request.custom_id}".encode()).hexdigest()[:24]
    row = dict.fromkeys(RESULT_SCHEMA.names)
    row.update(
        custom_id=request.custom_id,
        line=request.line,
        status=COMPLETED,
        url=request.url,
        model=request.model,
        prompt_tokens=usage_tokens(request),
        completion_tokens=0,
        response_body=json.dumps(response_of(request, scores, request_id, created)),
        shard_id=None if shard_id is None else str(shard_id),
        scores=scores,
        **_times(created_at, started_at, finished_at),
    )
    return row
