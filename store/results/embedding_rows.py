"""The result row of a finished `/v1/embeddings` line: OpenAI's body in `response_body` and the
vectors in the `embedding` column (one list<float32> per input, in input order)."""

from __future__ import annotations

import json

from batchfile.embeddings import response_of, usage_tokens
from batchfile.request import ParsedRequest
from store.results.rows import COMPLETED, RESULT_SCHEMA, _times


def embedding_row(request: ParsedRequest, output, *, shard_id: str | None = None, tokenizer=None,
                  created_at=None, started_at=None, finished_at=None) -> dict:
    """`output`: the engine's pooling output for the line's inputs (`outputs.data`, [inputs, dim])."""
    vectors = output.outputs.data.tolist()
    row = dict.fromkeys(RESULT_SCHEMA.names)
    row.update(
        custom_id=request.custom_id,
        line=request.line,
        status=COMPLETED,
        url=request.url,
        model=request.model,
        prompt_tokens=usage_tokens(request),
        completion_tokens=0,
        response_body=json.dumps(response_of(request, vectors)),
        embedding=vectors,
        shard_id=None if shard_id is None else str(shard_id),
        **_times(created_at, started_at, finished_at),
    )
    return row
